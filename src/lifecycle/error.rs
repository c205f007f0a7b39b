//! Errors of the lifecycle: of one step (classified, asked whether a retry
//! can help), of a mount, of a release, of the volume registry.

use std::fmt;
use std::io;
use std::path::PathBuf;

use crate::claims::{AttachError, ClaimError};
use crate::csi::CsiError;
use crate::plugins::WaitError;
use crate::state::StateError;
use crate::volumes::lock::LockTimeout;
use crate::volumes::mounted::{NotMounted, StillMounted};
use crate::volumes::SpecError;

/// Why one step of a volume did not go through.
#[derive(Debug)]
pub enum StepError {
    Csi(CsiError),
    Claim(ClaimError),
    State(StateError),
    /// The plugin the step needs is not ready.
    Plugin(WaitError),
    /// An attachment through a controller host on another node.
    Attach(AttachError),
    /// Another operation of the volume holds its lock.
    Lock(LockTimeout),
    StillMounted(StillMounted),
    /// NodePublishVolume answered OK, and nothing is mounted at the target.
    NotMounted(NotMounted),
    CreateDir {
        path: PathBuf,
        source: io::Error,
    },
    /// The volume needs a controller attachment and no controller plugin
    /// is ready for it.
    NoController {
        plugin_id: String,
    },
    /// The record no longer wants this step (released, or changed).
    Gone {
        why: String,
    },
    UnknownVolume {
        volume_id: String,
    },
    /// The agent is stopping.
    Stopping,
}

impl StepError {
    /// Whether trying the same step again later can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StepError::Csi(e) => e.is_retryable(),
            StepError::Claim(e) => e.is_retryable(),
            StepError::Attach(e) => e.is_retryable(),
            StepError::State(_)
            | StepError::Plugin(_)
            | StepError::Lock(_)
            | StepError::StillMounted(_)
            | StepError::CreateDir { .. }
            | StepError::NoController { .. }
            | StepError::Stopping => true,
            // The same plugin answers the same way again: a setup to fix.
            StepError::NotMounted(NotMounted::Missing { .. }) => false,
            StepError::NotMounted(NotMounted::Unknown { .. }) => true,
            StepError::Gone { .. } | StepError::UnknownVolume { .. } => false,
        }
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Wrapped errors speak for themselves (their cause follows in the
        // chain); the others say what went wrong.
        match self {
            StepError::Csi(e) => e.fmt(f),
            StepError::Claim(e) => e.fmt(f),
            StepError::Attach(e) => write!(f, "attachment through the cluster: {e}"),
            StepError::State(e) => e.fmt(f),
            StepError::Plugin(e) => e.fmt(f),
            StepError::Lock(e) => e.fmt(f),
            StepError::StillMounted(e) => e.fmt(f),
            StepError::NotMounted(e) => e.fmt(f),
            StepError::CreateDir { path, .. } => write!(f, "cannot create {}", path.display()),
            StepError::NoController { plugin_id } => {
                write!(f, "controller plugin {plugin_id} is not available")
            }
            StepError::Gone { why } => f.write_str(why),
            StepError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            StepError::Stopping => f.write_str("the agent is stopping"),
        }
    }
}

impl std::error::Error for StepError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StepError::Csi(e) => e.source(),
            StepError::Claim(e) => e.source(),
            StepError::Attach(_) => None,
            StepError::State(e) => e.source(),
            StepError::Plugin(e) => e.source(),
            StepError::Lock(e) => e.source(),
            StepError::StillMounted(e) => e.source(),
            StepError::NotMounted(e) => e.source(),
            StepError::CreateDir { source, .. } => Some(source),
            StepError::NoController { .. }
            | StepError::Gone { .. }
            | StepError::UnknownVolume { .. }
            | StepError::Stopping => None,
        }
    }
}

impl From<StateError> for StepError {
    fn from(e: StateError) -> Self {
        StepError::State(e)
    }
}

impl From<CsiError> for StepError {
    fn from(e: CsiError) -> Self {
        StepError::Csi(e)
    }
}

impl From<ClaimError> for StepError {
    fn from(e: ClaimError) -> Self {
        StepError::Claim(e)
    }
}

impl From<AttachError> for StepError {
    fn from(e: AttachError) -> Self {
        match e {
            AttachError::Stopping => StepError::Stopping,
            e => StepError::Attach(e),
        }
    }
}

impl From<LockTimeout> for StepError {
    fn from(e: LockTimeout) -> Self {
        StepError::Lock(e)
    }
}

impl From<StillMounted> for StepError {
    fn from(e: StillMounted) -> Self {
        StepError::StillMounted(e)
    }
}

/// A volume whose accessible topology does not include this node.
#[derive(Debug)]
pub struct TopologyMismatch {
    pub alias: String,
    pub volume_id: String,
    /// `{zone=z1} or {zone=z2}`.
    pub volume_topology: String,
    pub plugin_id: String,
    pub node_id: String,
    pub node_topology: String,
}

#[derive(Debug)]
pub enum MountError {
    Invalid(SpecError),
    UnknownVolume {
        volume_id: String,
    },
    /// The volume's plugin is neither configured nor in the plugin
    /// directory: waiting for it cannot help.
    UnknownPlugin {
        alias: String,
        plugin_id: String,
    },
    /// The allocation is being mounted, restored or released already, or
    /// holds other volumes.
    Busy {
        alloc_id: String,
        why: String,
    },
    Plugin {
        alias: String,
        source: WaitError,
    },
    Claim {
        alias: String,
        source: ClaimError,
    },
    /// The plugin refused a call with an error that retrying cannot fix.
    Csi {
        alias: String,
        source: CsiError,
    },
    /// Another allocation on this node uses the volume in a way this one
    /// cannot share (block device vs file system).
    Incompatible {
        alias: String,
        volume_id: String,
        holder: String,
        why: String,
    },
    /// None of the volume's accessible topology segment sets is a subset
    /// of the node plugin's segments: the volume cannot be used here.
    Topology(Box<TopologyMismatch>),
    /// A mount group was asked of a node plugin without VOLUME_MOUNT_GROUP.
    MountGroupUnsupported {
        alias: String,
        plugin_id: String,
    },
    /// The node plugin's `max_volumes_per_node` is reached on this node.
    VolumeLimit {
        alias: String,
        plugin_id: String,
        max: i64,
        in_use: Vec<String>,
    },
    /// The mount retry deadline passed while a step kept failing with a
    /// retryable error.
    Timeout {
        alias: String,
        last_error: Box<StepError>,
    },
    State(StateError),
    Shutdown,
}

impl MountError {
    /// The mount error for a step error that retrying cannot fix.
    pub fn from_step(alloc_id: &str, alias: &str, e: StepError) -> MountError {
        match e {
            StepError::Csi(source) => MountError::Csi {
                alias: alias.to_string(),
                source,
            },
            StepError::Claim(source) => MountError::Claim {
                alias: alias.to_string(),
                source,
            },
            StepError::Plugin(source) => MountError::Plugin {
                alias: alias.to_string(),
                source,
            },
            StepError::State(e) => MountError::State(e),
            StepError::UnknownVolume { volume_id } => MountError::UnknownVolume { volume_id },
            other => MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: other.to_string(),
            },
        }
    }
}

impl fmt::Display for MountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MountError::Invalid(e) => e.fmt(f),
            MountError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            MountError::UnknownPlugin { alias, plugin_id } => write!(
                f,
                "volume {alias} cannot be mounted: its plugin {plugin_id} is neither configured nor in the plugin directory"
            ),
            MountError::Busy { alloc_id, why } => write!(f, "allocation {alloc_id} {why}"),
            MountError::Plugin { alias, .. } => write!(f, "volume {alias} could not be mounted"),
            MountError::Claim { alias, .. } => write!(f, "volume {alias} could not be claimed"),
            MountError::Csi { alias, .. } => write!(f, "volume {alias} could not be mounted"),
            MountError::Incompatible {
                alias,
                volume_id,
                why,
                ..
            } => write!(f, "volume {alias} ({volume_id}) cannot be mounted: {why}"),
            MountError::Topology(m) => write!(
                f,
                "volume {} ({}) cannot be used on this node: it is accessible from {}, \
                 and node plugin {} puts node {} in {}",
                m.alias, m.volume_id, m.volume_topology, m.plugin_id, m.node_id, m.node_topology
            ),
            MountError::MountGroupUnsupported { alias, plugin_id } => write!(
                f,
                "volume {alias} cannot be mounted with a mount group: node plugin {plugin_id} does not offer VOLUME_MOUNT_GROUP"
            ),
            MountError::VolumeLimit {
                alias,
                plugin_id,
                max,
                in_use,
            } => write!(
                f,
                "volume {alias} cannot be mounted: node plugin {plugin_id} allows at most {max} volume(s) per node, and this node uses {} already ({})",
                in_use.len(),
                in_use.join(", ")
            ),
            MountError::Timeout { alias, .. } => write!(
                f,
                "volume {alias} could not be mounted before the mount retry deadline"
            ),
            MountError::State(_) => write!(f, "the mount could not be recorded"),
            MountError::Shutdown => write!(f, "the agent is stopping"),
        }
    }
}

impl std::error::Error for MountError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MountError::Plugin { source, .. } => Some(source),
            MountError::Claim { source, .. } => Some(source),
            MountError::Csi { source, .. } => Some(source),
            MountError::Timeout { last_error, .. } => Some(&**last_error),
            MountError::State(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for MountError {
    fn from(e: StateError) -> Self {
        MountError::State(e)
    }
}

impl From<SpecError> for MountError {
    fn from(e: SpecError) -> Self {
        MountError::Invalid(e)
    }
}

#[derive(Debug)]
pub enum ReleaseError {
    Invalid(SpecError),
    State(StateError),
    Spawn(io::Error),
    Stopping,
}

impl fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseError::Invalid(e) => e.fmt(f),
            ReleaseError::State(_) => write!(f, "the release could not be recorded"),
            ReleaseError::Spawn(_) => write!(f, "a release worker could not be started"),
            ReleaseError::Stopping => write!(f, "the agent is stopping"),
        }
    }
}

impl std::error::Error for ReleaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReleaseError::State(e) => Some(e),
            ReleaseError::Spawn(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for ReleaseError {
    fn from(e: StateError) -> Self {
        ReleaseError::State(e)
    }
}

/// Why `claim free` refused.
#[derive(Debug)]
pub enum FreeClaimError {
    NoReason,
    NotHeld {
        volume_id: String,
        alloc_id: String,
    },
    /// An allocation on this node records the volume: release it instead.
    RecordedHere {
        alloc_id: String,
    },
    /// The holder's node is alive and may still use the volume.
    HolderAlive {
        node: String,
    },
    Store(ClaimError),
    State(StateError),
}

impl fmt::Display for FreeClaimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FreeClaimError::NoReason => f.write_str("a reason is required (--reason TEXT)"),
            FreeClaimError::NotHeld {
                volume_id,
                alloc_id,
            } => write!(f, "allocation {alloc_id} holds no claim on volume {volume_id}"),
            FreeClaimError::RecordedHere { alloc_id } => write!(
                f,
                "allocation {alloc_id} on this node still records the volume: release it (claimd alloc release {alloc_id}) instead"
            ),
            FreeClaimError::HolderAlive { node } => write!(
                f,
                "the holder's node {node} is alive and may still have the volume mounted: release the allocation there, or free it with --force once you know it is not"
            ),
            FreeClaimError::Store(_) => f.write_str("the claim store cannot free it now"),
            FreeClaimError::State(_) => f.write_str("the change could not be recorded"),
        }
    }
}

impl std::error::Error for FreeClaimError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FreeClaimError::Store(e) => Some(e),
            FreeClaimError::State(e) => Some(e),
            _ => None,
        }
    }
}

/// Why `volume detach --node` refused or failed.
#[derive(Debug)]
pub enum NodeRemoveError {
    /// A node name that is not a plain name.
    Invalid(String),
    /// One node: there is no cluster to forget a node in.
    NotCluster,
    /// The node asked is this agent's own.
    ThisNode {
        node: String,
    },
    Remove(crate::claims::RemoveNodeError),
}

impl fmt::Display for NodeRemoveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeRemoveError::Invalid(why) => f.write_str(why),
            NodeRemoveError::NotCluster => {
                f.write_str("node remove needs cluster mode (a `cluster` section in the config)")
            }
            NodeRemoveError::ThisNode { node } => write!(
                f,
                "{node} is this agent's own node: it cannot remove itself"
            ),
            NodeRemoveError::Remove(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for NodeRemoveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NodeRemoveError::Remove(e) => std::error::Error::source(e),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum NodeDetachError {
    NoReason,
    /// A volume ID or node name that is not a plain name.
    Invalid(String),
    /// One node: there is no other node to detach from.
    NotCluster,
    /// The node asked is this agent's own: release its allocations instead.
    ThisNode {
        node: String,
    },
    /// The node is alive and may still use the volume.
    NodeAlive {
        node: String,
    },
    Store(ClaimError),
    Attach(AttachError),
}

impl fmt::Display for NodeDetachError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeDetachError::NoReason => f.write_str("a reason is required (--reason TEXT)"),
            NodeDetachError::Invalid(why) => f.write_str(why),
            NodeDetachError::NotCluster => f.write_str(
                "volume detach --node needs cluster mode (a `cluster` section in the config)",
            ),
            NodeDetachError::ThisNode { node } => write!(
                f,
                "{node} is this agent's own node: release its allocations (claimd alloc release) instead"
            ),
            NodeDetachError::NodeAlive { node } => write!(
                f,
                "node {node} is alive and may still have the volume mounted: release the allocation there"
            ),
            NodeDetachError::Store(_) => f.write_str("the cluster cannot be asked now"),
            NodeDetachError::Attach(_) => f.write_str("the volume could not be detached"),
        }
    }
}

impl std::error::Error for NodeDetachError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NodeDetachError::Store(e) => Some(e),
            NodeDetachError::Attach(e) => Some(e),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum VolumeRegistryError {
    Invalid(SpecError),
    InUse {
        volume_id: String,
        holder: String,
    },
    /// The claim store cannot tell whether the volume is claimed.
    Claims(ClaimError),
    State(StateError),
}

impl fmt::Display for VolumeRegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeRegistryError::Invalid(e) => e.fmt(f),
            VolumeRegistryError::InUse { volume_id, holder } => write!(
                f,
                "volume {volume_id} is in use by allocation {holder}; release it first"
            ),
            VolumeRegistryError::State(_) => write!(f, "the volume registry could not be saved"),
            VolumeRegistryError::Claims(ClaimError::Impossible { .. }) => {
                write!(f, "the cluster refuses it")
            }
            VolumeRegistryError::Claims(_) => {
                write!(f, "cannot tell whether the volume is claimed")
            }
        }
    }
}

impl std::error::Error for VolumeRegistryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VolumeRegistryError::State(e) => Some(e),
            VolumeRegistryError::Claims(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for VolumeRegistryError {
    fn from(e: StateError) -> Self {
        VolumeRegistryError::State(e)
    }
}

/// Why a volume operation (create, delete, snapshot, expand) did not go
/// through. Nothing changed unless the plugin's call succeeded and a later
/// step failed, which the message then says.
#[derive(Debug)]
pub enum VolumeOpError {
    Invalid(SpecError),
    /// The request is malformed or asks for something impossible.
    Request(String),
    UnknownVolume {
        volume_id: String,
    },
    UnknownSnapshot {
        snapshot_id: String,
    },
    /// The plugin is not configured on this agent.
    UnknownPlugin {
        plugin_id: String,
    },
    /// The controller (or node) plugin did not become ready.
    Plugin(WaitError),
    /// The plugin does not offer what the operation needs.
    Unsupported {
        plugin_id: String,
        capability: &'static str,
        operation: String,
    },
    /// The plugin refused the call; its reason follows in the chain.
    Csi {
        operation: String,
        source: CsiError,
    },
    /// A size smaller than the volume has.
    Shrink {
        volume_id: String,
        current: i64,
        asked: i64,
    },
    /// The registration conflicts with what the plugin answered.
    Conflict {
        volume_id: String,
        why: String,
    },
    Registry(VolumeRegistryError),
    Lock(LockTimeout),
    State(StateError),
}

impl fmt::Display for VolumeOpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeOpError::Invalid(e) => e.fmt(f),
            VolumeOpError::Request(why) => f.write_str(why),
            VolumeOpError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            VolumeOpError::UnknownSnapshot { snapshot_id } => write!(
                f,
                "snapshot {snapshot_id} is not known to any plugin that lists snapshots"
            ),
            VolumeOpError::UnknownPlugin { plugin_id } => write!(
                f,
                "plugin {plugin_id} is neither configured nor in the plugin directory of this agent"
            ),
            VolumeOpError::Plugin(e) => e.fmt(f),
            VolumeOpError::Unsupported {
                plugin_id,
                capability,
                operation,
            } => write!(
                f,
                "cannot {operation}: plugin {plugin_id} does not offer {capability}"
            ),
            VolumeOpError::Csi { operation, .. } => {
                write!(f, "cannot {operation}: the plugin refused")
            }
            VolumeOpError::Shrink {
                volume_id,
                current,
                asked,
            } => write!(
                f,
                "volume {volume_id} has {current} bytes; it cannot shrink to {asked} bytes"
            ),
            VolumeOpError::Conflict { volume_id, why } => write!(f, "volume {volume_id}: {why}"),
            VolumeOpError::Registry(e) => e.fmt(f),
            VolumeOpError::Lock(e) => e.fmt(f),
            VolumeOpError::State(_) => write!(f, "the volume registry could not be saved"),
        }
    }
}

impl std::error::Error for VolumeOpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VolumeOpError::Csi { source, .. } => Some(source),
            VolumeOpError::Registry(e) => e.source(),
            VolumeOpError::State(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for VolumeOpError {
    fn from(e: StateError) -> Self {
        VolumeOpError::State(e)
    }
}

impl From<VolumeRegistryError> for VolumeOpError {
    fn from(e: VolumeRegistryError) -> Self {
        VolumeOpError::Registry(e)
    }
}

impl From<LockTimeout> for VolumeOpError {
    fn from(e: LockTimeout) -> Self {
        VolumeOpError::Lock(e)
    }
}
