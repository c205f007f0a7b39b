//! Claims: which allocation may use which volume, and how.
//!
//! The contract is transactional. A claim change is a value
//! ([`ClaimChange`]: take, record an attachment, mark releasing, free) that
//! a [`ClaimStore`] applies together with the lifecycle record change it
//! belongs to ([`Transaction`]). The embedded store ([`EmbeddedClaims`])
//! keeps claims in claimd's own state and folds both into one journal line;
//! a store that spans nodes makes its own round trip first, outside every
//! state lock, and then writes the local record. The lifecycle never asks
//! which kind of store it has.
//!
//! The access-mode rules of the CSI spec live in `rules`; the claim
//! records themselves are part of the state model (`crate::state::Claim`).

use std::collections::BTreeMap;
use std::fmt;

use crate::state::{StateError, StateFile};
use crate::volumes::{AccessMode, VolumeSpec};

pub mod attach;
pub mod controller_calls;
mod embedded;
pub mod etcd;
pub mod fencing;
pub mod margins;
pub mod published;
mod reconcile;
pub mod remote;
mod rules;

pub use crate::state::{Claim, ClaimMode, ClaimState};
pub use embedded::EmbeddedClaims;
pub use etcd::EtcdClaims;
pub use reconcile::Reconciled;
pub use remote::{
    AttachError, AttachRequest, ControllerHostRecord, NodeDetach, RemoteController,
    RemoteControllers, RemoveNodeError,
};
pub use rules::check_claim;

/// What a take asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRequest {
    pub volume_id: String,
    pub alloc_id: String,
    pub node: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    /// The node ID the volume is to be attached to, when the mount will
    /// attach it: recorded with the claim from the start, so a node that
    /// dies between the attach and its result can still be detached.
    pub external_node_id: Option<String>,
    /// The storage this node will call up with (from its record): a
    /// cluster's take holds only while the volume's registration names it
    /// (None: a store's own take, nothing to compare).
    pub storage: Option<StorageRef>,
}

/// A volume's storage as a registration names it: the plugin and the
/// plugin's own ID of the volume. Two claim names of one storage volume
/// would be two claims of one disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageRef {
    pub plugin_id: String,
    pub external_id: String,
    /// The volume context the calls up carry (a static volume's share or
    /// path may be named there).
    pub context: BTreeMap<String, String>,
}

impl StorageRef {
    pub fn of(spec: &VolumeSpec) -> StorageRef {
        StorageRef {
            plugin_id: spec.plugin_id.clone(),
            external_id: spec.external_id.clone(),
            context: spec.context.clone(),
        }
    }

    /// The storage volume itself (plugin and external ID), whatever the
    /// context.
    pub fn volume(&self) -> (&str, &str) {
        (&self.plugin_id, &self.external_id)
    }
}

/// One change of one claim. Every change is idempotent: applying it again
/// (after a crash between the store's round trip and the local record)
/// changes nothing more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimChange {
    /// Take the claim, or confirm it when this allocation holds it already.
    Take(ClaimRequest),
    /// Record the external node ID and publish context of the attachment.
    Attach {
        volume_id: String,
        alloc_id: String,
        external_node_id: String,
        publish_context: BTreeMap<String, String>,
    },
    /// The allocation is releasing the volume (the claim is still held).
    MarkReleasing { volume_id: String, alloc_id: String },
    /// The node side is released and the controller detach is retried
    /// (the claim is still held).
    MarkNodeDetached {
        volume_id: String,
        alloc_id: String,
        /// Why the detach is retried.
        error: String,
    },
    /// Free the claim; freeing a claim that is not held succeeds.
    /// `holder`: free it only while that node holds it (a node's own
    /// release: the same allocation ID may be held on another node by
    /// now); None: whoever holds it (freed by hand).
    /// `while_gone`: only while the holder's node is not alive (in a cluster
    /// store: its liveness key absent, compared in the same write), so that
    /// a node that came back since an operator looked keeps its claim.
    /// `by_hand`: an operator's free (`claim free`), noted in the cluster
    /// store in the same write (`freed/<volume>/<alloc>`).
    Free {
        volume_id: String,
        alloc_id: String,
        holder: Option<String>,
        while_gone: bool,
        by_hand: Option<Box<ByHand>>,
    },
}

/// An operator's free of a claim (`claim free`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByHand {
    /// The claim as the operator's command read it: a claim held by
    /// another node by the time of the write is left alone.
    pub claim: Claim,
    pub reason: String,
    /// The node whose agent frees it.
    pub by: String,
}

impl ClaimChange {
    pub fn volume_id(&self) -> &str {
        match self {
            ClaimChange::Take(r) => &r.volume_id,
            ClaimChange::Attach { volume_id, .. }
            | ClaimChange::MarkReleasing { volume_id, .. }
            | ClaimChange::MarkNodeDetached { volume_id, .. }
            | ClaimChange::Free { volume_id, .. } => volume_id,
        }
    }

    pub fn alloc_id(&self) -> &str {
        match self {
            ClaimChange::Take(r) => &r.alloc_id,
            ClaimChange::Attach { alloc_id, .. }
            | ClaimChange::MarkReleasing { alloc_id, .. }
            | ClaimChange::MarkNodeDetached { alloc_id, .. }
            | ClaimChange::Free { alloc_id, .. } => alloc_id,
        }
    }

    /// A short name for logs and call logs.
    pub fn verb(&self) -> &'static str {
        match self {
            ClaimChange::Take(_) => "take",
            ClaimChange::Attach { .. } => "attach",
            ClaimChange::MarkReleasing { .. } => "mark-releasing",
            ClaimChange::MarkNodeDetached { .. } => "mark-node-detached",
            ClaimChange::Free { .. } => "free",
        }
    }
}

/// The outcome of each change of a transaction, in the order asked.
pub type Outcomes = [Result<(), ClaimError>];

/// Claim changes and the record change they belong to.
pub struct Transaction<'a> {
    /// Applied one by one; each may be refused on its own (a take held by
    /// another allocation) without undoing the others.
    pub changes: Vec<ClaimChange>,
    /// Whether the local record still wants the changes. Checked before any
    /// change is made; when false, nothing is changed anywhere.
    pub wanted: &'a dyn Fn(&StateFile) -> bool,
    /// The local record change, given the outcome of every change. Made
    /// durable with the changes (embedded) or right after them (remote).
    pub record: &'a mut dyn FnMut(&mut StateFile, &Outcomes),
    /// The record change closes an operation whose intent is durable (a
    /// volume published, a released record dropped): it is written with
    /// the next write (`StateStore::update_closing`) instead of before the
    /// transaction returns. The claim changes are made as always.
    pub closing: bool,
}

/// What became of a transaction.
#[derive(Debug)]
pub enum Applied {
    /// `wanted` said no: nothing was changed.
    NotWanted,
    /// The record change was made durable; one outcome per change.
    Done(Vec<Result<(), ClaimError>>),
}

impl Applied {
    /// The outcome of a transaction of one change: Ok(false) when not
    /// wanted, Ok(true) when done, the change's error when refused.
    pub fn single(self) -> Result<bool, ClaimError> {
        match self {
            Applied::NotWanted => Ok(false),
            Applied::Done(mut v) => v.pop().unwrap_or(Ok(())).map(|()| true),
        }
    }
}

/// See `ClaimStore::watch_claims`.
pub trait ClaimWatch: Send {
    /// Waits up to `timeout`, less when the volume's claims change; false
    /// when the agent stops.
    fn wait(&self, timeout: std::time::Duration, shutdown: &crate::shutdown::Shutdown) -> bool;
}

/// Volume registrations shared by every node of a cluster (cluster stores
/// only; on one node registrations live in the agent's own state).
pub trait SharedVolumes: Send + Sync {
    /// Registers the volume, or replaces its registration while nothing
    /// claims it (one write comparing both): a registration never changes
    /// under a claim, so a claim's storage is the one its take compared.
    /// `Impossible` when claimed.
    fn register(&self, spec: &VolumeSpec) -> Result<(), ClaimError>;
    /// The capacity a controller reported (and whether a node expansion is
    /// pending), written into the registration as it is now: the rest of
    /// it (its storage) is never written back from an older copy. Nothing
    /// when the volume is no longer registered.
    fn set_capacity(
        &self,
        spec: &VolumeSpec,
        capacity: i64,
        pending: bool,
    ) -> Result<(), ClaimError>;
    /// True when the volume was registered.
    fn delete(&self, volume_id: &str) -> Result<bool, ClaimError>;
    fn get(&self, volume_id: &str) -> Result<Option<VolumeSpec>, ClaimError>;
    fn list(&self) -> Result<Vec<VolumeSpec>, ClaimError>;
}

/// Which claims `ClaimStore::list_claims` answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimFilter<'a> {
    /// Only this volume's claims (None: every volume's).
    pub volume: Option<&'a str>,
}

impl<'a> ClaimFilter<'a> {
    /// Every claim of the store.
    pub const ALL: ClaimFilter<'static> = ClaimFilter { volume: None };

    /// The claims of one volume.
    pub fn volume(volume_id: &'a str) -> ClaimFilter<'a> {
        ClaimFilter {
            volume: Some(volume_id),
        }
    }

    /// Whether `claim` is one the filter asks for.
    pub fn admits(&self, claim: &Claim) -> bool {
        self.volume.map_or(true, |v| claim.volume_id == v)
    }
}

/// What `ClaimStore::list_claims` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// The valid claims.
    pub claims: Vec<Claim>,
    /// A line per stored value that is not a claim (it is left untouched;
    /// a take of its volume fails naming it).
    pub problems: Vec<String>,
}

/// Where claims are kept. A store is built on the agent's state store (the
/// one its record changes are written to).
pub trait ClaimStore: Send + Sync {
    /// Applies the transaction's claim changes together with its record
    /// change. A failed local write is the `Err`; refusals of single
    /// changes are in the outcomes.
    fn transact(&self, txn: Transaction<'_>) -> Result<Applied, StateError>;
    /// The valid claims the filter asks for (in cluster stores: every
    /// node's) and a line per stored value among them that is not a claim,
    /// or why the store cannot tell now. One volume's are read alone (a
    /// cluster store reads only that volume's keys).
    fn list_claims(&self, filter: ClaimFilter<'_>) -> Result<Listing, ClaimError>;
    /// The states of the claims this node holds, when the store keeps them
    /// on this node (one node), without copying the claims (a metrics
    /// scrape asks); None when they live in a store shared by the cluster
    /// (count them from this node's records instead: no round trip). Not a
    /// `list_claims` filter: it answers without asking the store, and its
    /// None means "not kept here", not "none".
    fn local_claim_states(&self) -> Option<Vec<ClaimState>> {
        None
    }
    /// The cluster's shared volume registrations, when the store has them.
    fn shared_volumes(&self) -> Option<&dyn SharedVolumes> {
        None
    }
    /// A watch on one volume's claims, when the store can tell when they
    /// change (a mount waiting for a held claim retries at once when the
    /// holder lets go, instead of at its next backoff step).
    fn watch_claims(&self, _volume_id: &str) -> Option<Box<dyn ClaimWatch>> {
        None
    }
    /// Controller plugins on other nodes, when the store spans nodes.
    fn remote_controllers(&self) -> Option<&dyn RemoteControllers> {
        None
    }
    /// Asked right before every call up (ControllerPublish, NodeStage,
    /// NodePublish) of a volume under this allocation's claim: Ok when the
    /// claim is held and may be used now (`fencing`); `Impossible` when it
    /// is gone; `Unavailable` (retried) while that cannot be told safely.
    fn check_call_up(&self, _volume_id: &str, _alloc_id: &str) -> Result<(), ClaimError> {
        Ok(())
    }
    /// The epoch of this allocation's claim (cluster stores: its etcd
    /// create revision, the fencing token) as this process took or read
    /// it; None when not known here (no round trip is made).
    fn epoch(&self, _volume_id: &str, _alloc_id: &str) -> Option<i64> {
        None
    }
    /// Waits up to `timeout` before a retry of something that needs the
    /// store, less when a store that spans nodes answers again after a gap
    /// (a release waiting to free its claim goes on at once). False when
    /// the agent stops.
    fn wait_reachable(
        &self,
        timeout: std::time::Duration,
        shutdown: &crate::shutdown::Shutdown,
    ) -> bool {
        shutdown.sleep(timeout)
    }
    /// Whether `node` is alive (its liveness lease is held); None when the
    /// store does not know other nodes (one node).
    fn node_alive(&self, _node: &str) -> Result<Option<bool>, ClaimError> {
        Ok(None)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimError {
    /// Another allocation holds a claim that conflicts; it may let go soon.
    HeldByOther {
        volume_id: String,
        holder: String,
        holder_mode: ClaimMode,
        holder_node: String,
    },
    /// The claim can never be granted as asked.
    Impossible {
        volume_id: String,
        reason: String,
    },
    UnknownVolume {
        volume_id: String,
    },
    /// The store could not be reached or did not answer in time: the change
    /// may or may not have been made (every change is idempotent, so it is
    /// asked again).
    Unavailable {
        store: String,
        reason: String,
    },
    /// The store refused the change for good (permissions, a bad request).
    Store {
        store: String,
        reason: String,
    },
    /// A stored value that is not a claim; it is left untouched.
    Corrupt {
        key: String,
        reason: String,
    },
}

impl ClaimError {
    /// "Held by another allocation" and an unreachable store are worth
    /// retrying; other refusals are final.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClaimError::HeldByOther { .. } | ClaimError::Unavailable { .. }
        )
    }
}

impl fmt::Display for ClaimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClaimError::HeldByOther {
                volume_id,
                holder,
                holder_mode,
                holder_node,
            } => {
                let how = match holder_mode {
                    ClaimMode::Write => "for writing",
                    ClaimMode::Read => "for reading",
                };
                write!(
                    f,
                    "volume {volume_id} is claimed {how} by allocation {holder} on node {holder_node}"
                )
            }
            ClaimError::Impossible { volume_id, reason } => {
                write!(f, "volume {volume_id} cannot be claimed: {reason}")
            }
            ClaimError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            ClaimError::Unavailable { store, reason } => {
                write!(f, "the claim store {store} is unavailable: {reason}")
            }
            ClaimError::Store { store, reason } => {
                write!(f, "the claim store {store} refused the change: {reason}")
            }
            ClaimError::Corrupt { key, reason } => write!(
                f,
                "the claim store holds a value at {key} that is not a claim ({reason}); it is left untouched: fix or remove it by hand"
            ),
        }
    }
}

impl std::error::Error for ClaimError {}
