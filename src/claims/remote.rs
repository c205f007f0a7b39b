//! The contract of controllers on other nodes (cluster mode): what a
//! node asks of a controller host (an attachment, a detachment, a
//! forwarded volume operation), the records they exchange through the
//! store, and the errors. `attach` and `controller_calls` implement it on
//! etcd.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ClaimError;
use crate::etcd::KeyValue;
use crate::shutdown::Shutdown;
use crate::volumes::Usage;

/// Answers of `controller_of`, per plugin, kept while a watch on
/// `<prefix>/plugins/` says nothing changed: a host's announcement (or
/// any change there) drops them all, and a broken watch drops them too.
/// A mount asks twice; with the cache, etcd is asked once per change.
#[derive(Default)]
pub(super) struct ControllerCacheInner {
    pub(super) watcher: Option<crate::etcd::Watcher>,
    /// Bumped whenever the answers are dropped or the watch replaced: an
    /// answer read under an older generation is not kept.
    pub(super) generation: u64,
    pub(super) answers: std::collections::HashMap<String, Option<RemoteController>>,
}

pub(super) type ControllerCache = parking_lot::Mutex<ControllerCacheInner>;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Want {
    Attached,
    Detached,
}

/// Where a request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttachState {
    /// Waiting for a controller host.
    Pending,
    /// Attached (a detach that succeeded deletes the key instead).
    Done,
    /// The controller call failed (`error`); the requester asks again.
    Failed,
}

/// `<prefix>/attachments/<volume>/<node>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachmentRecord {
    pub volume_id: String,
    pub node: String,
    pub plugin_id: String,
    /// The plugin's ID of the volume.
    pub external_volume_id: String,
    /// The requesting node plugin's node ID (NodeGetInfo).
    pub external_node_id: String,
    pub usage: Usage,
    #[serde(default)]
    pub mount_flags: Vec<String>,
    pub want: Want,
    pub state: AttachState,
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    #[serde(default)]
    pub error: Option<String>,
    /// Whether asking again can help (the CSI code's classification).
    #[serde(default)]
    pub retryable: bool,
    #[serde(default)]
    pub handled_by: Option<String>,
    pub requested_at_ms: u64,
    pub updated_at_ms: u64,
    /// The allocation of the claim an attach is for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub alloc_id: String,
    /// That claim's epoch (etcd create revision): a host attaches only
    /// while `claims/<volume>/<alloc>` exists with this create revision for
    /// this node, and undoes an attach whose claim went during the call.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `<prefix>/plugins/<plugin>/controllers/<node>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerHostRecord {
    pub plugin_id: String,
    pub node: String,
    pub publish_unpublish_volume: bool,
    pub publish_readonly: bool,
    pub ready: bool,
    pub updated_at_ms: u64,
    /// Everything the controller offers, for volume operations forwarded
    /// to it.
    #[serde(default)]
    pub controller_capabilities: crate::csi::ControllerCapabilities,
    #[serde(default)]
    pub plugin_capabilities: crate::csi::PluginCapabilities,
    /// The host's CSI call deadline: how long a ControllerPublish it sent
    /// may still land (the reaper's settle after a fence). Absent from
    /// older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_call_timeout_ms: Option<u64>,
}

/// The cluster's controller of a plugin, as a requesting node sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteController {
    pub plugin_id: String,
    pub publish_readonly: bool,
}

/// A request for an attachment (or a detachment) of a volume to a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachRequest {
    pub volume_id: String,
    pub node: String,
    pub plugin_id: String,
    pub external_volume_id: String,
    pub external_node_id: String,
    pub usage: Usage,
    pub mount_flags: Vec<String>,
    /// The allocation whose claim the attach is for (empty for a detach
    /// of a gone node's volume).
    pub alloc_id: String,
    /// The claim's epoch (its etcd create revision: the fencing token);
    /// 0: filled in by the store from the claim.
    pub epoch: i64,
}

/// Why an attachment through the cluster did not happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttachError {
    /// etcd could not be asked.
    Store(ClaimError),
    /// The controller host tried and the plugin refused or failed.
    Failed {
        host: String,
        error: String,
        retryable: bool,
        /// The gRPC status code the plugin answered (0: none).
        code: i32,
    },
    /// No controller host answered in time.
    NoAnswer { waited: Duration, hosts: String },
    /// The agent is stopping.
    Stopping,
}

impl AttachError {
    pub fn is_retryable(&self) -> bool {
        match self {
            AttachError::Store(e) => e.is_retryable(),
            AttachError::Failed { retryable, .. } => *retryable,
            AttachError::NoAnswer { .. } | AttachError::Stopping => true,
        }
    }
}

impl fmt::Display for AttachError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttachError::Store(e) => e.fmt(f),
            AttachError::Failed { host, error, .. } => {
                write!(f, "the controller plugin on node {host} failed: {error}")
            }
            AttachError::NoAnswer { waited, hosts } => write!(
                f,
                "no controller host answered within {waited:?} (hosts: {hosts})"
            ),
            AttachError::Stopping => f.write_str("the agent is stopping"),
        }
    }
}

impl std::error::Error for AttachError {}

/// Attachments made by a controller plugin on another node.
pub trait RemoteControllers: Send + Sync {
    /// The cluster's controller of `plugin_id` when one that attaches
    /// (PUBLISH_UNPUBLISH_VOLUME) was registered; None when none was.
    fn controller_of(&self, plugin_id: &str) -> Result<Option<RemoteController>, ClaimError>;
    /// Asks for the attachment and waits up to `wait` for a host's answer:
    /// the publish context.
    fn attach(
        &self,
        req: &AttachRequest,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<BTreeMap<String, String>, AttachError>;
    /// Asks for the detachment (with the external node ID recorded at
    /// attach time) and waits up to `wait` for it to be done.
    fn detach(
        &self,
        req: &AttachRequest,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<(), AttachError>;
    /// Every registered controller host with whether its node is alive.
    fn hosts(&self) -> Result<Vec<(ControllerHostRecord, bool)>, ClaimError>;
    /// Forwards one controller call (`method`, the request's protobuf
    /// bytes) to a host of `plugin_id` and waits up to `wait` for the
    /// reply's bytes.
    fn forward(
        &self,
        plugin_id: &str,
        method: &str,
        request: &[u8],
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<Vec<u8>, AttachError>;
    /// See `EtcdClaims::release_node_volume`.
    #[allow(clippy::too_many_arguments)]
    fn release_node_volume(
        &self,
        volume_id: &str,
        node: &str,
        reason: &str,
        by: &str,
        rule: super::fencing::FreeRule<'_>,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<NodeDetach, AttachError>;
    /// See `EtcdClaims::remove_node`.
    fn remove_node(&self, node: &str) -> Result<Vec<String>, RemoveNodeError>;
}

/// Why a node cannot be removed.
#[derive(Debug)]
pub enum RemoveNodeError {
    /// Its liveness key exists: it is alive.
    Alive {
        node: String,
    },
    /// It still holds claims: they must be freed first.
    HoldsClaims {
        node: String,
        volumes: Vec<String>,
    },
    /// Nothing of that node is known.
    Unknown {
        node: String,
    },
    Store(ClaimError),
}

impl fmt::Display for RemoveNodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoveNodeError::Alive { node } => write!(
                f,
                "node {node} is alive (its liveness lease is held): stop its agent first"
            ),
            RemoveNodeError::HoldsClaims { node, volumes } => write!(
                f,
                "node {node} still holds claims of {}: free them first with `claimd volume detach VOLUME --node {node} --reason ...`",
                volumes.join(", ")
            ),
            RemoveNodeError::Unknown { node } => {
                write!(f, "the cluster knows nothing of node {node}")
            }
            RemoveNodeError::Store(_) => f.write_str("the cluster cannot be asked now"),
        }
    }
}

impl std::error::Error for RemoveNodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RemoveNodeError::Store(e) => Some(e),
            _ => None,
        }
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn parse_attachment(kv: &KeyValue) -> Result<AttachmentRecord, ClaimError> {
    serde_json::from_slice(&kv.value).map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })
}

pub fn parse_host(kv: &KeyValue) -> Result<ControllerHostRecord, ClaimError> {
    serde_json::from_slice(&kv.value).map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })
}

/// What detaching a volume from a node (gone for good) did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDetach {
    /// A controller detach was performed (the node held an attachment).
    pub detached: bool,
    /// The allocations whose claims of the volume were freed.
    pub freed: Vec<String>,
    /// Why the claims were kept (nothing can fence the volume from the
    /// node, and the cluster did not opt in to freeing it unfenced).
    pub kept: Option<String>,
}
