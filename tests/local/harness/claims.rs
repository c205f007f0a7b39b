//! The claim stores the lifecycle suite runs against, through the same
//! contract production uses:
//! - the embedded store that ships, wrapped to count takes and frees and to
//!   refuse takes on demand;
//! - a remote-like store: claims live outside the agent's state (in a map
//!   the harness keeps across restarts, like a cluster store outliving an
//!   agent), every transaction makes its own round trip with latency first,
//!   outside every state lock, then writes the local record; round trips
//!   can be made to fail (Unavailable) and are logged.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use claimd::claims::{
    check_claim, Applied, Claim, ClaimChange, ClaimError, ClaimFilter, ClaimState, ClaimStore,
    EmbeddedClaims, Listing, Outcomes, Transaction,
};
use claimd::state::{StateError, StateFile, StateStore};
use parking_lot::Mutex;

/// Which claim store a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Embedded,
    Remote,
}

thread_local! {
    static KIND: Cell<StoreKind> = const { Cell::new(StoreKind::Embedded) };
}

/// Runs a test body with harnesses built on this thread using `kind`.
pub fn with_store(kind: StoreKind, test: fn()) {
    KIND.with(|k| k.set(kind));
    test();
}

/// The store kind harnesses on this thread use.
pub fn store_kind() -> StoreKind {
    KIND.with(Cell::get)
}

/// The remote store's own data: survives agent restarts.
pub type RemoteClaims = Arc<Mutex<BTreeMap<(String, String), Claim>>>;

/// How long one remote round trip takes.
pub const REMOTE_LATENCY: Duration = Duration::from_millis(2);

pub struct TestClaims {
    kind: StoreKind,
    state: Arc<StateStore>,
    embedded: EmbeddedClaims,
    remote: RemoteClaims,
    takes: AtomicUsize,
    frees: AtomicUsize,
    refuse: Mutex<Option<String>>,
    /// Remote round trips still to fail with Unavailable.
    fail_next: AtomicUsize,
    /// Changes of one verb still to fail with Unavailable.
    fail_verb: Mutex<BTreeMap<&'static str, usize>>,
    /// Remote round trips: "verb volume alloc" per change.
    log: Mutex<Vec<String>>,
    /// Allocation -> whether its calls up are refused for good (true) or
    /// for now (false, retried), as a cluster store does when the claim
    /// is gone or the lease is not valid (`check_call_up`).
    calls_up_refused: Mutex<BTreeMap<String, bool>>,
    /// Calls up of an allocation refused so far.
    calls_up_checked: Mutex<BTreeMap<String, usize>>,
}

impl TestClaims {
    pub fn new(kind: StoreKind, state: Arc<StateStore>, remote: RemoteClaims) -> TestClaims {
        TestClaims {
            kind,
            embedded: EmbeddedClaims::new(state.clone()),
            state,
            remote,
            takes: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
            refuse: Mutex::new(None),
            fail_next: AtomicUsize::new(0),
            fail_verb: Mutex::new(BTreeMap::new()),
            log: Mutex::new(Vec::new()),
            calls_up_refused: Mutex::new(BTreeMap::new()),
            calls_up_checked: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    /// Takes asked since this store was built (a restart builds a new one).
    pub fn claim_calls(&self) -> usize {
        self.takes.load(Ordering::SeqCst)
    }

    /// Frees asked since this store was built.
    pub fn release_calls(&self) -> usize {
        self.frees.load(Ordering::SeqCst)
    }

    /// Every take from now on is refused with a final error.
    pub fn refuse(&self, reason: &str) {
        *self.refuse.lock() = Some(reason.to_string());
    }

    /// The next `n` remote round trips fail as if the store were cut off
    /// (remote store only).
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// The next `n` remote changes of kind `verb` (`take`, `attach`,
    /// `mark-releasing`, `free`) fail as if the store were cut off.
    pub fn fail_verb(&self, verb: &'static str, n: usize) {
        self.fail_verb.lock().insert(verb, n);
    }

    /// Every call up of `alloc` from now on is refused: for now (retried,
    /// like a lease that is not valid) or for good (like a claim gone).
    pub fn refuse_calls_up(&self, alloc: &str, for_good: bool) {
        self.calls_up_refused
            .lock()
            .insert(alloc.to_string(), for_good);
    }

    /// How many calls up of `alloc` were refused so far.
    pub fn calls_up_refused(&self, alloc: &str) -> usize {
        self.calls_up_checked
            .lock()
            .get(alloc)
            .copied()
            .unwrap_or(0)
    }

    /// The remote round trips so far (remote store only).
    pub fn remote_log(&self) -> Vec<String> {
        self.log.lock().clone()
    }

    fn count(&self, changes: &[ClaimChange]) {
        for c in changes {
            match c {
                ClaimChange::Take(_) => self.takes.fetch_add(1, Ordering::SeqCst),
                ClaimChange::Free { .. } => self.frees.fetch_add(1, Ordering::SeqCst),
                _ => 0,
            };
        }
    }

    fn refused(&self, c: &ClaimChange) -> Option<ClaimError> {
        let reason = self.refuse.lock().clone()?;
        matches!(c, ClaimChange::Take(_)).then(|| ClaimError::Impossible {
            volume_id: c.volume_id().to_string(),
            reason,
        })
    }

    /// One change on the remote store's data, like a cluster store would
    /// make it (same rules, same idempotence).
    fn apply_remote(&self, c: &ClaimChange) -> Result<(), ClaimError> {
        self.log
            .lock()
            .push(format!("{} {} {}", c.verb(), c.volume_id(), c.alloc_id()));
        let verb_fails =
            self.fail_verb
                .lock()
                .get_mut(c.verb())
                .is_some_and(|n| match n.checked_sub(1) {
                    Some(left) => {
                        *n = left;
                        true
                    }
                    None => false,
                });
        if verb_fails
            || self
                .fail_next
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(ClaimError::Unavailable {
                store: "test-remote".to_string(),
                reason: "the link is cut".to_string(),
            });
        }
        if let Some(e) = self.refused(c) {
            return Err(e);
        }
        let mut m = self.remote.lock();
        let key = (c.volume_id().to_string(), c.alloc_id().to_string());
        match c {
            ClaimChange::Take(req) => {
                if let Some(held) = m.get(&key) {
                    if held.mode == req.mode && held.access_mode == req.access_mode {
                        return Ok(());
                    }
                    return Err(ClaimError::Impossible {
                        volume_id: req.volume_id.clone(),
                        reason: "held with another mode".to_string(),
                    });
                }
                let others: Vec<&Claim> = m
                    .values()
                    .filter(|h| h.volume_id == req.volume_id)
                    .collect();
                check_claim(req, &others)?;
                m.insert(
                    key,
                    Claim {
                        volume_id: req.volume_id.clone(),
                        alloc_id: req.alloc_id.clone(),
                        node: req.node.clone(),
                        mode: req.mode,
                        access_mode: req.access_mode,
                        external_node_id: req.external_node_id.clone(),
                        publish_context: BTreeMap::new(),
                        state: ClaimState::Taken,
                        since_ms: None,
                        last_error: None,
                    },
                );
            }
            ClaimChange::Attach {
                external_node_id,
                publish_context,
                ..
            } => {
                if let Some(h) = m.get_mut(&key) {
                    h.external_node_id = Some(external_node_id.clone());
                    h.publish_context = publish_context.clone();
                }
            }
            ClaimChange::MarkReleasing { .. } => {
                if let Some(h) = m.get_mut(&key) {
                    h.state = ClaimState::Releasing;
                }
            }
            ClaimChange::MarkNodeDetached { error, .. } => {
                if let Some(h) = m.get_mut(&key) {
                    h.state = ClaimState::NodeDetached;
                    h.last_error = Some(error.clone());
                }
            }
            ClaimChange::Free { .. } => {
                m.remove(&key);
            }
        }
        Ok(())
    }

    /// The embedded store, with refused takes taken out before it sees
    /// them and put back into the outcomes the record change gets.
    fn transact_embedded(&self, txn: Transaction<'_>) -> Result<Applied, StateError> {
        let Transaction {
            changes,
            wanted,
            record,
            closing,
        } = txn;
        let refused: Vec<Option<ClaimError>> = changes.iter().map(|c| self.refused(c)).collect();
        let passed: Vec<ClaimChange> = changes
            .iter()
            .zip(&refused)
            .filter(|(_, r)| r.is_none())
            .map(|(c, _)| c.clone())
            .collect();
        let merge = |out: &Outcomes| -> Vec<Result<(), ClaimError>> {
            let mut it = out.iter();
            refused
                .iter()
                .map(|r| match r {
                    Some(e) => Err(e.clone()),
                    None => it.next().cloned().unwrap_or(Ok(())),
                })
                .collect()
        };
        let applied = self.embedded.transact(Transaction {
            changes: passed,
            wanted,
            record: &mut |s: &mut StateFile, out: &Outcomes| record(s, &merge(out)),
            closing,
        })?;
        Ok(match applied {
            Applied::NotWanted => Applied::NotWanted,
            Applied::Done(out) => Applied::Done(merge(&out)),
        })
    }
}

impl ClaimStore for TestClaims {
    fn transact(&self, txn: Transaction<'_>) -> Result<Applied, StateError> {
        self.count(&txn.changes);
        match self.kind {
            StoreKind::Embedded => self.transact_embedded(txn),
            StoreKind::Remote => {
                if !self.state.read(txn.wanted) {
                    return Ok(Applied::NotWanted);
                }
                if !txn.changes.is_empty() {
                    std::thread::sleep(REMOTE_LATENCY);
                }
                let outcomes: Vec<_> = txn.changes.iter().map(|c| self.apply_remote(c)).collect();
                let record = txn.record;
                let write = |s: &mut StateFile| -> Result<(), StateError> {
                    record(s, &outcomes);
                    Ok(())
                };
                if txn.closing {
                    self.state.update_closing(write)?;
                } else {
                    self.state.update(write)?;
                }
                Ok(Applied::Done(outcomes))
            }
        }
    }

    fn check_call_up(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        let Some(for_good) = self.calls_up_refused.lock().get(alloc_id).copied() else {
            return Ok(());
        };
        *self
            .calls_up_checked
            .lock()
            .entry(alloc_id.to_string())
            .or_default() += 1;
        Err(if for_good {
            ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: format!("the claim of allocation {alloc_id} is no longer held"),
            }
        } else {
            ClaimError::Unavailable {
                store: "test".to_string(),
                reason: "the lease is not valid now".to_string(),
            }
        })
    }

    /// As the agent's embedded store: its own claims' states, so that the
    /// metrics' claim counts come from the store here too.
    fn local_claim_states(&self) -> Option<Vec<ClaimState>> {
        match self.kind {
            StoreKind::Embedded => self.embedded.local_claim_states(),
            StoreKind::Remote => None,
        }
    }

    fn list_claims(&self, filter: ClaimFilter<'_>) -> Result<Listing, ClaimError> {
        match self.kind {
            StoreKind::Embedded => self.embedded.list_claims(filter),
            StoreKind::Remote => Ok(Listing {
                claims: self
                    .remote
                    .lock()
                    .values()
                    .filter(|c| filter.admits(c))
                    .cloned()
                    .collect(),
                problems: Vec::new(),
            }),
        }
    }
}
