//! The etcd claim store (cluster mode): claims shared by every node of a
//! cluster, under `<prefix>/claims/<volume>/<alloc>` as JSON.
//!
//! Claims change only by `Txn` with revision compares (optimistic
//! concurrency): a take reads the volume's claims, checks the access-mode
//! rules against them, and writes its claim only if no claim of the volume
//! changed since the read (a compare on the mod revision of the whole key
//! range; an empty range holds). Two nodes can never both hold a
//! single-writer volume, and single-node modes keep every claim on one
//! node, whatever the timing. Claims are never tied to a lease: a node cut
//! off from the cluster keeps its claims.
//!
//! Volume registrations are shared too, under `<prefix>/volumes/<id>`
//! (the whole spec, secrets included: etcd is where the manual's
//! cluster.md says they live in cluster mode), with one name per storage
//! volume (`registrations.rs`); each node keeps a copy of the specs it
//! uses in its own state, so it restarts without etcd, brought up to the
//! cluster's at each mount.
//!
//! Every round trip is made outside every state lock; the local record is
//! written after it. An unreachable etcd is `Unavailable` (retried by the
//! lifecycle); a value that is not a claim is `Corrupt` and is never
//! overwritten.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

mod changes;
mod index;
pub mod keys;
mod marks;
mod nodes;
mod registrations;
mod schema;

pub(crate) use registrations::parse_spec;

pub use index::NodeClaims;
pub use keys::Keys;
pub use marks::MARKER_THREAD;

use marks::Marks;

use serde::{Deserialize, Serialize};

use super::{
    check_claim, Applied, ClaimChange, ClaimError, ClaimFilter, ClaimRequest, ClaimStore, Listing,
    RemoteControllers, SharedVolumes, Transaction,
};
use crate::etcd::{Compare, EtcdClient, EtcdError, KeyValue, TxnOp};
use crate::state::{Claim, ClaimState, StateError, StateFile, StateStore};
use crate::volumes::VolumeSpec;

/// How often a change is tried again when another node changed the same
/// volume's claims between the read and the write.
pub(super) const CONFLICT_ATTEMPTS: usize = 32;

/// How long a `freed/` note outlives the claim it tells of (a node coming
/// back within it learns why its claim went and releases the allocation).
pub const DEFAULT_FREED_NOTE_RETENTION: std::time::Duration =
    std::time::Duration::from_secs(7 * 86_400);

/// What every write acting on a gone node compares: its liveness key is
/// absent, and it has not registered since its settings' mod revision was
/// `registered_at` (the absence the writer counted is the one still
/// going on).
pub fn still_gone(keys: &Keys, node: &str, registered_at: i64) -> Vec<crate::etcd::Compare> {
    use crate::etcd::{Compare, CompareOp};
    vec![
        Compare::absent(keys.node(node)),
        Compare::mod_revision(keys.settings(node), CompareOp::Equal, registered_at),
    ]
}

/// A claim as stored in etcd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredClaim {
    pub claim: Claim,
    /// When the claim was taken (milliseconds since the epoch).
    pub taken_at_ms: u64,
    /// The instance of the node that took it (`fencing::instance_id`):
    /// another instance of the same name never frees or reuses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// A take whose `Txn` did not answer: the node it named and the revision
/// of that node's liveness key it compared.
pub(super) type UncertainTake = (String, i64);

/// (volume, allocation) of this process's takes between their round trip
/// and their local record (how many of each), and of its operator's frees
/// (`claim free`) between their look at the local records and their write.
/// One excludes the other: a free by hand never deletes a claim that a
/// mount of the same allocation is taking or confirming meanwhile.
#[derive(Debug, Default)]
pub(super) struct InFlightClaims {
    pub(super) takes: HashMap<(String, String), usize>,
    frees_by_hand: HashSet<(String, String)>,
}

/// The takes and frees by hand of one transaction, in flight while it
/// lives; `refused`: the indexes of changes that must not go now (a take
/// of a claim being freed by hand, a free by hand of a claim being taken).
struct InFlight<'a> {
    map: &'a Mutex<InFlightClaims>,
    takes: Vec<(String, String)>,
    frees: Vec<(String, String)>,
    refused: HashSet<usize>,
}

impl<'a> InFlight<'a> {
    fn new(map: &'a Mutex<InFlightClaims>, changes: &[ClaimChange]) -> Self {
        let mut m = map.lock();
        let mut me = InFlight {
            map,
            takes: Vec::new(),
            frees: Vec::new(),
            refused: HashSet::new(),
        };
        for (i, c) in changes.iter().enumerate() {
            let key = (c.volume_id().to_string(), c.alloc_id().to_string());
            match c {
                ClaimChange::Take(_) if m.frees_by_hand.contains(&key) => {
                    me.refused.insert(i);
                }
                ClaimChange::Take(_) => {
                    *m.takes.entry(key.clone()).or_default() += 1;
                    me.takes.push(key);
                }
                ClaimChange::Free {
                    by_hand: Some(_), ..
                } => {
                    if m.takes.contains_key(&key) || !m.frees_by_hand.insert(key.clone()) {
                        me.refused.insert(i);
                    } else {
                        me.frees.push(key);
                    }
                }
                _ => {}
            }
        }
        me
    }

    /// Why change `i` must not go now, if it must not.
    fn refusal(&self, i: usize, change: &ClaimChange) -> Option<ClaimError> {
        if !self.refused.contains(&i) {
            return None;
        }
        let (volume_id, alloc_id) = (change.volume_id(), change.alloc_id());
        Some(match change {
            ClaimChange::Take(_) => ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: format!(
                    "the claim of volume {volume_id} by allocation {alloc_id} is being freed by hand on this node (claim free); the mount retries"
                ),
            },
            _ => ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: format!(
                    "allocation {alloc_id} is being mounted on this node (or freed by hand already): release the allocation, or look again once its mount is done"
                ),
            },
        })
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock();
        for k in &self.takes {
            if let Some(n) = m.takes.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    m.takes.remove(k);
                }
            }
        }
        for k in &self.frees {
            m.frees_by_hand.remove(k);
        }
    }
}

/// Claims in etcd, shared by the cluster. A clone is another handle on
/// the same store: everything it keeps (settings, caches, what is in
/// flight) is in one `Shared` behind one `Arc`, so no clone can split it.
#[derive(Clone)]
pub struct EtcdClaims {
    pub(super) shared: Arc<Shared>,
}

/// What every handle of one `EtcdClaims` shares. The settings (`node`,
/// `fencing`, `freed_retention`) are set by the builder methods before the
/// store is first cloned; the rest changes behind its own lock.
pub(super) struct Shared {
    pub(super) client: EtcdClient,
    /// Every key under `cluster.prefix`.
    pub(super) keys: Keys,
    pub(super) state: Arc<StateStore>,
    /// This node's claims as it last wrote them, with their mod revision:
    /// a later change of one is a single `Txn` comparing that revision
    /// (read first only when the compare fails: changed elsewhere, or not
    /// known since a restart; the start-up reconciliation fills it with
    /// what its read found of this instance's claims).
    pub(super) known: Mutex<HashMap<String, (i64, StoredClaim)>>,
    /// Which plugins have a controller host, as last read, and when.
    pub(super) controllers: super::remote::ControllerCache,
    /// This node's name (requests it forwards name it).
    node: String,
    /// The lease clock and the claims confirmed in this process (agents
    /// set it; a store without it asks nothing before a call up).
    fencing: Option<Arc<super::fencing::Fencing>>,
    /// The revision of the last read of each volume's claims by a take: a
    /// watch made after a refusal starts right after it (no change in
    /// between is missed).
    take_reads: Mutex<HashMap<String, i64>>,
    /// (volume, allocation) -> (node, liveness revision compared) of takes
    /// whose `Txn` did not answer (a timeout: it may still land). Freeing
    /// one first moves the liveness key past that revision, so a take still
    /// in flight can never land after the free looked (`changes.rs`).
    pub(super) uncertain_takes: Mutex<HashMap<(String, String), UncertainTake>>,
    /// Claim key -> its epoch (create revision), as this process took or
    /// read it: the fencing token of attach requests.
    epochs: Mutex<HashMap<String, i64>>,
    /// (volume, allocation) of the takes between their round trip and
    /// their local record (how many of each): the start-up reconciliation
    /// never takes one of these claims for an orphan, whatever the
    /// revisions say (a take's revision is known only once it answered).
    pub(super) takes_in_flight: Mutex<InFlightClaims>,
    /// The TTL of the lease each `freed/` note is written on.
    freed_retention: std::time::Duration,
    /// This node's attach requests as it last wrote or saw them (mod
    /// revision, record): what its next write of one compares against.
    pub(super) attachments_seen: Mutex<HashMap<String, (i64, super::remote::AttachmentRecord)>>,
    /// Volume -> (mod revision, storage) of its registration as this node
    /// last read it: what a take compares (`registration_for`).
    pub(super) registrations: Mutex<HashMap<String, (i64, super::StorageRef)>>,
    /// The claim states waiting to be written (`marks.rs`).
    marks: Marks,
}

impl EtcdClaims {
    pub fn new(client: EtcdClient, prefix: &str, state: Arc<StateStore>) -> EtcdClaims {
        EtcdClaims {
            shared: Arc::new(Shared {
                client,
                keys: Keys::new(prefix),
                state,
                known: Default::default(),
                controllers: Default::default(),
                node: String::new(),
                fencing: None,
                take_reads: Default::default(),
                uncertain_takes: Default::default(),
                epochs: Default::default(),
                takes_in_flight: Default::default(),
                freed_retention: DEFAULT_FREED_NOTE_RETENTION,
                attachments_seen: Default::default(),
                registrations: Default::default(),
                marks: Marks::default(),
            }),
        }
    }

    /// The settings, for the builder methods: they run on the store as
    /// `new` made it, before any clone of it exists.
    fn settings(&mut self) -> &mut Shared {
        Arc::get_mut(&mut self.shared)
            .expect("the builder methods of EtcdClaims run before the store is cloned")
    }

    /// How long `freed/` notes are kept (`cluster.freed_note_retention`).
    pub fn with_freed_retention(mut self, d: std::time::Duration) -> EtcdClaims {
        self.settings().freed_retention = d;
        self
    }

    /// A lease for `freed/` notes written now: etcd removes them after the
    /// retention.
    pub(super) fn freed_note_lease(&self) -> Result<crate::etcd::LeaseId, ClaimError> {
        self.shared
            .client
            .lease_grant(self.shared.freed_retention)
            .map_err(unavailable)
    }

    /// Checks every call up against `fencing` (see `check_call_up`).
    pub fn with_fencing(mut self, fencing: Arc<super::fencing::Fencing>) -> EtcdClaims {
        self.settings().fencing = Some(fencing);
        self
    }

    pub fn fencing(&self) -> Option<&Arc<super::fencing::Fencing>> {
        self.shared.fencing.as_ref()
    }

    /// A claim this process just wrote or read back: confirmed under the
    /// lease that was valid before the round trip started.
    fn confirmed(&self, volume_id: &str, alloc_id: &str, lease: Option<crate::etcd::LeaseId>) {
        if let (Some(f), Some(lease)) = (&self.shared.fencing, lease) {
            f.confirm(volume_id, alloc_id, lease);
        }
    }

    /// The epoch (etcd create revision) of this allocation's claim of the
    /// volume: the fencing token an attach request carries. Read from etcd
    /// when this process did not take it (after a restart); a claim that
    /// is gone is `Impossible`.
    pub fn epoch_of(&self, volume_id: &str, alloc_id: &str) -> Result<i64, ClaimError> {
        let key = self.key(volume_id, alloc_id);
        if let Some(e) = self.shared.epochs.lock().get(&key) {
            return Ok(*e);
        }
        match self.shared.client.get(&key).map_err(unavailable)? {
            Some(kv) => {
                self.shared.epochs.lock().insert(key, kv.create_revision);
                Ok(kv.create_revision)
            }
            None => Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: format!("the claim of allocation {alloc_id} is no longer held in etcd"),
            }),
        }
    }

    /// This node's instance, when the store has one (agents do).
    pub fn instance(&self) -> Option<&str> {
        self.shared.fencing.as_ref().map(|f| f.instance())
    }

    /// The claim was taken by another instance of this node's name.
    pub(super) fn other_instance(&self, stored: &StoredClaim) -> bool {
        matches!(
            (self.instance(), stored.instance.as_deref()),
            (Some(me), Some(them)) if me != them
        )
    }

    fn lease_before(&self) -> Option<crate::etcd::LeaseId> {
        self.shared.fencing.as_ref().and_then(|f| f.valid_lease())
    }

    /// Names this node in the requests it forwards to controller hosts.
    pub fn with_node(mut self, node: &str) -> EtcdClaims {
        self.settings().node = node.to_string();
        self
    }

    pub fn node_name(&self) -> &str {
        &self.shared.node
    }

    /// Without a trailing slash.
    pub fn prefix(&self) -> &str {
        self.shared.keys.prefix()
    }

    pub fn keys(&self) -> &Keys {
        &self.shared.keys
    }

    pub fn client(&self) -> &EtcdClient {
        &self.shared.client
    }

    /// Whether `node`'s liveness key exists.
    pub fn node_is_alive(&self, node: &str) -> Result<bool, ClaimError> {
        let key = self.shared.keys.node(node);
        Ok(self.shared.client.get(key).map_err(unavailable)?.is_some())
    }

    pub(super) fn all_prefix(&self) -> String {
        self.shared.keys.claims()
    }

    fn volume_prefix(&self, volume_id: &str) -> String {
        self.shared.keys.claims_of(volume_id)
    }

    pub(crate) fn volume_key(&self, volume_id: &str) -> String {
        self.shared.keys.volume(volume_id)
    }

    fn key(&self, volume_id: &str, alloc_id: &str) -> String {
        self.shared.keys.claim(volume_id, alloc_id)
    }

    /// Every claim with its stored form, oldest first by key.
    pub fn list_stored(&self) -> Result<Vec<StoredClaim>, ClaimError> {
        let r = self
            .shared
            .client
            .range_prefix(self.all_prefix())
            .map_err(unavailable)?;
        r.kvs.iter().map(parse).collect()
    }

    fn apply(&self, change: &ClaimChange) -> Result<(), ClaimError> {
        match change {
            // A mark still waiting for this claim was made for an earlier
            // claim of the same allocation (or for this one, now freed).
            ClaimChange::Take(req) => {
                self.take(req)?;
                self.shared.marks.forget(&req.volume_id, &req.alloc_id);
                Ok(())
            }
            ClaimChange::Attach {
                volume_id,
                alloc_id,
                external_node_id,
                publish_context,
            } => {
                // The mount's result goes with a claim that must still be
                // held: one freed meanwhile (by hand) fails the mount.
                let held = self.update(volume_id, alloc_id, |c| {
                    c.external_node_id = Some(external_node_id.clone());
                    c.publish_context = publish_context.clone();
                })?;
                if !held {
                    return Err(ClaimError::Impossible {
                        volume_id: volume_id.clone(),
                        reason: format!(
                            "the claim of allocation {alloc_id} is no longer held in etcd (freed while it mounted)"
                        ),
                    });
                }
                Ok(())
            }
            // Informational (the claim stays held either way): queued for
            // the marker thread (`marks.rs`), so a release with etcd cut off
            // starts its node side at once instead of waiting out the call
            // deadline.
            ClaimChange::MarkReleasing {
                volume_id,
                alloc_id,
            } => {
                self.mark(volume_id, alloc_id, ClaimState::Releasing, None);
                Ok(())
            }
            ClaimChange::MarkNodeDetached {
                volume_id,
                alloc_id,
                error,
            } => {
                self.mark(
                    volume_id,
                    alloc_id,
                    ClaimState::NodeDetached,
                    Some(error.clone()),
                );
                Ok(())
            }
            ClaimChange::Free {
                volume_id,
                alloc_id,
                holder,
                while_gone,
                by_hand,
            } => {
                self.free(
                    volume_id,
                    alloc_id,
                    holder.as_deref(),
                    *while_gone,
                    by_hand.as_deref(),
                )?;
                self.shared.marks.forget(volume_id, alloc_id);
                Ok(())
            }
        }
    }
}

impl ClaimStore for EtcdClaims {
    fn transact(&self, txn: Transaction<'_>) -> Result<Applied, StateError> {
        // Its takes count as in flight until the record is written; a free
        // by hand, until its write answered. Marked before `wanted` looks
        // at the records: a free by hand wants the allocation unrecorded,
        // and a mount that records it from now on cannot take the claim
        // until the free is done.
        let in_flight = InFlight::new(&self.shared.takes_in_flight, &txn.changes);
        if !self.shared.state.read(txn.wanted) {
            return Ok(Applied::NotWanted);
        }
        // The round trips first, outside every state lock; then the record.
        let round_trip = !txn.changes.is_empty();
        if round_trip {
            crate::failpoints::hit("etcd-before-round-trip");
        }
        let outcomes: Vec<_> = txn
            .changes
            .iter()
            .enumerate()
            .map(|(i, c)| match in_flight.refusal(i, c) {
                Some(e) => Err(e),
                None => self.apply(c),
            })
            .collect();
        if round_trip {
            // etcd changed, the local record not yet.
            crate::failpoints::hit("etcd-after-round-trip");
        }
        let (record, wanted) = (txn.record, txn.wanted);
        // Checked again in the write: what changed locally during the
        // round trip (another mount recorded meanwhile) is seen here.
        let write = |s: &mut StateFile| -> Result<bool, StateError> {
            if !wanted(s) {
                return Ok(false);
            }
            record(s, &outcomes);
            Ok(true)
        };
        // A closing record change (the drop after a free, `published` after
        // the attach was recorded): etcd holds the change already; the
        // local record follows with the next write. A crash before it
        // leaves the durable intent, from which recovery redoes the
        // idempotent calls (a free compares the recorded epoch, so it
        // never frees a claim taken since by someone else).
        let written = if txn.closing {
            self.shared.state.update_closing(write)?
        } else {
            self.shared.state.update(write)?
        };
        if written {
            return Ok(Applied::Done(outcomes));
        }
        // Not wanted any more: the claims this transaction took, or may
        // have taken (a take that did not answer), are given back (best
        // effort: reconciliation frees any left behind).
        for (change, outcome) in txn.changes.iter().zip(&outcomes) {
            let ClaimChange::Take(req) = change else {
                continue;
            };
            let maybe = outcome.is_err()
                && self
                    .shared
                    .uncertain_takes
                    .lock()
                    .contains_key(&(req.volume_id.clone(), req.alloc_id.clone()));
            if outcome.is_ok() || maybe {
                let free = ClaimChange::Free {
                    volume_id: req.volume_id.clone(),
                    alloc_id: req.alloc_id.clone(),
                    holder: Some(req.node.clone()),
                    while_gone: false,
                    by_hand: None,
                };
                if let Err(e) = self.apply(&free) {
                    log::warn!("cluster: a claim taken for a change no longer wanted stays: {e}");
                }
            }
        }
        Ok(Applied::NotWanted)
    }

    /// One read of `claims/` (every volume's) or of `claims/<volume>/`.
    fn list_claims(&self, filter: ClaimFilter<'_>) -> Result<Listing, ClaimError> {
        match filter.volume {
            Some(volume_id) => self.list_prefix(&self.volume_prefix(volume_id)),
            None => self.list_prefix(&self.all_prefix()),
        }
    }

    fn shared_volumes(&self) -> Option<&dyn SharedVolumes> {
        Some(self)
    }

    fn node_alive(&self, node: &str) -> Result<Option<bool>, ClaimError> {
        self.node_is_alive(node).map(Some)
    }

    fn wait_reachable(
        &self,
        timeout: std::time::Duration,
        shutdown: &crate::shutdown::Shutdown,
    ) -> bool {
        match &self.shared.fencing {
            Some(f) => f.wait_back(timeout, shutdown),
            None => shutdown.sleep(timeout),
        }
    }

    fn check_call_up(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        let Some(f) = &self.shared.fencing else {
            return Ok(());
        };
        if f.is_confirmed(volume_id, alloc_id) {
            return Ok(());
        }
        // Read back after the current lease was registered: what etcd
        // says now is what the cluster has decided.
        let lease = f.valid_lease();
        let key = self.key(volume_id, alloc_id);
        let unsafe_now = |why: String| ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: why,
        };
        match self.shared.client.get(&key) {
            Ok(Some(kv)) => {
                let stored = parse(&kv)?;
                if (!self.shared.node.is_empty() && stored.claim.node != self.shared.node)
                    || self.other_instance(&stored)
                {
                    return Err(ClaimError::Impossible {
                        volume_id: volume_id.to_string(),
                        reason: format!(
                            "the claim of allocation {alloc_id} is held by node {} (instance {}) now, not this instance",
                            stored.claim.node,
                            stored.instance.as_deref().unwrap_or("unknown")
                        ),
                    });
                }
                self.shared.epochs.lock().insert(key.clone(), kv.create_revision);
                match lease {
                    Some(lease) => {
                        f.confirm(volume_id, alloc_id, lease);
                        Ok(())
                    }
                    // Held, but this node's lease is not valid now: the
                    // cluster may act on it unless the window still runs.
                    None => f.without_etcd().map_err(unsafe_now),
                }
            }
            Ok(None) => Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: format!(
                    "the claim of allocation {alloc_id} is no longer held in etcd (freed while this node was away or paused): nothing is mounted under it"
                ),
            }),
            Err(e) => f
                .without_etcd()
                .map_err(|why| unsafe_now(format!("{why} ({})", crate::error_chain(&e)))),
        }
    }

    fn remote_controllers(&self) -> Option<&dyn RemoteControllers> {
        Some(self)
    }

    fn epoch(&self, volume_id: &str, alloc_id: &str) -> Option<i64> {
        self.shared
            .epochs
            .lock()
            .get(&self.key(volume_id, alloc_id))
            .copied()
    }

    fn watch_claims(&self, volume_id: &str) -> Option<Box<dyn super::ClaimWatch>> {
        let prefix = self.volume_prefix(volume_id);
        // Right after the take's read that was refused: a release between
        // that read and this watch is its first event.
        let from = self
            .shared
            .take_reads
            .lock()
            .get(volume_id)
            .map_or(0, |r| r + 1);
        match self.shared.client.watch(
            prefix.as_bytes(),
            crate::etcd::prefix_end(prefix.as_bytes()),
            from,
        ) {
            Ok(watcher) => Some(Box::new(ClaimsWatch { watcher })),
            Err(e) => {
                log::info!("cluster: no watch on the claims of {volume_id} (retries wait their backoff): {e}");
                None
            }
        }
    }
}

impl EtcdClaims {
    /// The valid claims under `prefix`, and a line per value that is not one.
    fn list_prefix(&self, prefix: &str) -> Result<Listing, ClaimError> {
        let r = self
            .shared
            .client
            .range_prefix(prefix)
            .map_err(unavailable)?;
        let mut claims = Vec::new();
        let mut problems = Vec::new();
        for kv in &r.kvs {
            match parse(kv) {
                Ok(s) => claims.push(Claim {
                    since_ms: s.claim.since_ms.or(Some(s.taken_at_ms)),
                    ..s.claim
                }),
                Err(e) => problems.push(e.to_string()),
            }
        }
        Ok(Listing { claims, problems })
    }
}

pub fn parse(kv: &KeyValue) -> Result<StoredClaim, ClaimError> {
    serde_json::from_slice(&kv.value).map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })
}

pub fn unavailable(e: EtcdError) -> ClaimError {
    if e.is_retryable() {
        ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: crate::error_chain(&e),
        }
    } else {
        ClaimError::Store {
            store: "etcd".to_string(),
            reason: crate::error_chain(&e),
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A watch on one volume's claims (`claims/<volume>/`).
struct ClaimsWatch {
    watcher: crate::etcd::Watcher,
}

impl super::ClaimWatch for ClaimsWatch {
    fn wait(&self, timeout: std::time::Duration, shutdown: &crate::shutdown::Shutdown) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut select = crossbeam_channel::Select::new();
        let change = select.recv(self.watcher.receiver());
        select.recv(shutdown.receiver());
        match select.ready_deadline(deadline) {
            Ok(i) if i == change => {
                // Drain what came with it; a watch that ended waits out the
                // step like a plain backoff.
                loop {
                    match self.watcher.recv_timeout(std::time::Duration::ZERO) {
                        Ok(Some(_)) => {}
                        Ok(None) => return !shutdown.is_triggered(),
                        Err(_) => return shutdown.sleep_until(deadline),
                    }
                }
            }
            Ok(_) => !shutdown.is_triggered() && shutdown.sleep_until(deadline),
            Err(_) => !shutdown.is_triggered(),
        }
    }
}
