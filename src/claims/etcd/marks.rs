//! Claim state marks (`releasing`, `node-detached`), written to etcd by
//! one thread, `etcd-marker`, in the background: a mark is informational
//! (the claim stays held either way), so a release with etcd cut off starts
//! its node side at once instead of waiting out the call deadline. A mark
//! never blocks its caller: it is queued, and the caller goes on.
//!
//! The queue keeps one mark per (volume, allocation): a newer mark replaces
//! the one still waiting, except that a `releasing` never replaces a
//! `node-detached` (a late `releasing` never hides a later `node-detached`;
//! the write checks the same against what etcd holds). So the queue holds
//! at most one mark per claim of this node, however long etcd is away.
//! Marks are best effort: one that fails is logged and dropped; when etcd
//! does not answer, the marks waiting then are dropped with it (each would
//! wait out a call deadline in turn); those still waiting when the agent
//! stops are dropped (with a line in the log).
//!
//! A mark is for one claim: it carries the claim's epoch, and a take or a
//! free of that volume and allocation drops the mark still waiting, so a
//! mark made for an earlier claim never lands on a later one (Podman
//! mounts one allocation again and again under one mount ID).

use std::collections::{HashMap, VecDeque};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::EtcdClaims;
use crate::claims::ClaimError;
use crate::shutdown::Shutdown;
use crate::state::{Claim, ClaimState};
use crate::threads::Threads;

/// The name of the thread that writes the marks.
pub const MARKER_THREAD: &str = "etcd-marker";

/// One claim state to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Mark {
    pub(super) state: ClaimState,
    /// Why the detach is retried (`node-detached`).
    pub(super) error: Option<String>,
    /// The epoch (create revision) of the claim the mark was made for, as
    /// this process knew it: a claim of the same volume and allocation
    /// taken again since is another claim, and the mark is dropped.
    pub(super) epoch: Option<i64>,
}

impl Mark {
    /// Changes a claim as the mark says; a `releasing` leaves a
    /// `node-detached` claim as it is.
    fn apply(&self, c: &mut Claim) {
        if self.state == ClaimState::Releasing && c.state == ClaimState::NodeDetached {
            return;
        }
        c.state = self.state;
        if self.error.is_some() {
            c.last_error = self.error.clone();
        }
    }
}

/// (volume, allocation).
type ClaimKey = (String, String);

/// Where the marker is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Phase {
    /// Marks wait for `start_marker`.
    #[default]
    NotStarted,
    Running,
    /// The agent stopped: marks are dropped.
    Stopped,
}

#[derive(Default)]
struct Queue {
    pending: HashMap<ClaimKey, Mark>,
    /// The keys of `pending`, first queued first.
    order: VecDeque<ClaimKey>,
    /// A mark is being written now.
    writing: bool,
    phase: Phase,
}

impl Queue {
    /// Queues `mark` (coalesced with the one waiting for that claim);
    /// false when the marker stopped (the mark is dropped).
    fn push(&mut self, key: ClaimKey, mark: Mark) -> bool {
        if self.phase == Phase::Stopped {
            return false;
        }
        match self.pending.get_mut(&key) {
            Some(waiting) => {
                let hides = mark.state == ClaimState::Releasing
                    && waiting.state == ClaimState::NodeDetached;
                if !hides {
                    *waiting = mark;
                }
            }
            None => {
                self.order.push_back(key.clone());
                self.pending.insert(key, mark);
            }
        }
        self.publish();
        true
    }

    /// The next mark to write (it counts as being written until `written`).
    fn pop(&mut self) -> Option<(ClaimKey, Mark)> {
        let key = self.order.pop_front()?;
        let mark = self.pending.remove(&key)?;
        self.writing = true;
        self.publish();
        Some((key, mark))
    }

    fn written(&mut self) {
        self.writing = false;
        self.publish();
    }

    /// Drops the mark waiting for a claim (taken again or freed: it was
    /// made for an earlier claim).
    fn forget(&mut self, key: &ClaimKey) {
        if self.pending.remove(key).is_some() {
            self.order.retain(|k| k != key);
            self.publish();
        }
    }

    /// Drops every mark waiting; how many.
    fn clear(&mut self) -> usize {
        let n = self.pending.len();
        self.pending.clear();
        self.order.clear();
        self.publish();
        n
    }

    /// Stops the queue; how many marks were still waiting (dropped).
    fn stop(&mut self) -> usize {
        self.phase = Phase::Stopped;
        let left = self.pending.len();
        self.pending.clear();
        self.order.clear();
        self.writing = false;
        self.publish();
        left
    }

    fn publish(&self) {
        let n = self.pending.len() + usize::from(self.writing);
        crate::metrics::CLAIM_MARKS_PENDING.set(n as u64);
    }
}

/// The marks of one store, and the bell that wakes its marker.
pub(super) struct Marks {
    queue: Mutex<Queue>,
    /// Rung (without waiting: one ring wakes the marker for every mark
    /// queued before it looks) when a mark is queued.
    bell: (Sender<()>, Receiver<()>),
}

impl Default for Marks {
    fn default() -> Self {
        Marks {
            queue: Mutex::default(),
            bell: crossbeam_channel::bounded(1),
        }
    }
}

impl Marks {
    /// Queues a mark of the claim of `volume_id` by `alloc_id`.
    pub(super) fn push(&self, volume_id: &str, alloc_id: &str, mark: Mark) {
        let state = mark.state;
        let queued = self
            .queue
            .lock()
            .push((volume_id.to_string(), alloc_id.to_string()), mark);
        if queued {
            let _ = self.bell.0.try_send(());
        } else {
            log::info!(
                "cluster: claim of {volume_id} by {alloc_id} not marked {state:?}: the agent is stopping"
            );
        }
    }

    /// Drops the mark waiting for the claim of `volume_id` by `alloc_id`:
    /// called when that claim is taken or freed, so a mark made for an
    /// earlier claim never lands on a later one of the same allocation.
    pub(super) fn forget(&self, volume_id: &str, alloc_id: &str) {
        self.queue
            .lock()
            .forget(&(volume_id.to_string(), alloc_id.to_string()));
    }

    /// Whether the marker was started already; marks it started.
    fn start(&self) -> bool {
        let mut q = self.queue.lock();
        let started = q.phase != Phase::NotStarted;
        if !started {
            q.phase = Phase::Running;
        }
        started
    }

    /// The marker's loop: writes the marks one by one, first queued first,
    /// until `shutdown`. `write` answers `Unreachable` when etcd did not
    /// answer: the marks waiting then were made while it was away, and
    /// each would cost a call deadline of its own, so they are dropped
    /// (as a mark that fails always is) rather than tried in turn. A panic
    /// stops the queue too, so marks are not queued for nothing.
    fn run(&self, shutdown: &Shutdown, write: impl Fn(&str, &str, &Mark) -> Written) {
        let _stopped = StopOnExit(self);
        while !shutdown.is_triggered() {
            let next = self.queue.lock().pop();
            match next {
                Some(((volume_id, alloc_id), mark)) => {
                    let written = write(&volume_id, &alloc_id, &mark);
                    let mut q = self.queue.lock();
                    q.written();
                    if written == Written::Unreachable {
                        let dropped = q.clear();
                        drop(q);
                        if dropped > 0 {
                            log::info!(
                                "cluster: {dropped} claim state mark(s) not written: etcd did not answer"
                            );
                        }
                    }
                }
                None => crossbeam_channel::select! {
                    recv(self.bell.1) -> _ => {}
                    recv(shutdown.receiver()) -> _ => {}
                },
            }
        }
    }
}

/// What became of one mark's write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Written {
    /// Written, or dropped for a reason of its own (the claim gone,
    /// taken again, refused).
    Done,
    /// etcd did not answer.
    Unreachable,
}

/// Stops the queue when the marker's loop ends, by the stop or by a panic.
struct StopOnExit<'m>(&'m Marks);

impl Drop for StopOnExit<'_> {
    fn drop(&mut self) {
        let left = self.0.queue.lock().stop();
        if std::thread::panicking() {
            log::error!("cluster: the claim marker stopped: {left} claim state mark(s) not written, and none will be until the agent restarts");
        } else if left > 0 {
            log::info!("cluster: {left} claim state mark(s) not written: the agent is stopping");
        }
    }
}

impl EtcdClaims {
    /// Starts the thread that writes this store's claim marks
    /// (`MARKER_THREAD`) on `threads`, which joins it; it stops when
    /// `shutdown` does. Marks queued before it starts wait for it; a store
    /// whose owner never starts it (a tool's, a test's) writes none. A
    /// second call starts nothing.
    pub fn start_marker(&self, threads: &mut Threads, shutdown: Shutdown) -> std::io::Result<()> {
        if self.shared.marks.start() {
            return Ok(());
        }
        let store = self.clone();
        threads.spawn(MARKER_THREAD, move || {
            store
                .shared
                .marks
                .run(&shutdown, |v, a, mark| store.write_mark(v, a, mark))
        })
    }

    /// Queues a mark of a claim (see the module's comment).
    pub(super) fn mark(
        &self,
        volume_id: &str,
        alloc_id: &str,
        state: ClaimState,
        error: Option<String>,
    ) {
        let epoch = self.epoch_known(volume_id, alloc_id);
        self.shared.marks.push(
            volume_id,
            alloc_id,
            Mark {
                state,
                error,
                epoch,
            },
        );
    }

    fn write_mark(&self, volume_id: &str, alloc_id: &str, mark: &Mark) -> Written {
        if mark.epoch.is_some() && self.epoch_known(volume_id, alloc_id) != mark.epoch {
            log::info!(
                "cluster: claim of {volume_id} by {alloc_id} not marked {:?}: freed or taken again since",
                mark.state
            );
            return Written::Done;
        }
        match self.update(volume_id, alloc_id, |c| mark.apply(c)) {
            Ok(_) => Written::Done,
            Err(e) => {
                log::info!(
                    "cluster: claim of {volume_id} by {alloc_id} not marked {:?}: {e}",
                    mark.state
                );
                match e {
                    ClaimError::Unavailable { .. } => Written::Unreachable,
                    _ => Written::Done,
                }
            }
        }
    }

    /// The claim's epoch as this process took or read it (no round trip).
    fn epoch_known(&self, volume_id: &str, alloc_id: &str) -> Option<i64> {
        crate::claims::ClaimStore::epoch(self, volume_id, alloc_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn releasing() -> Mark {
        Mark {
            state: ClaimState::Releasing,
            error: None,
            epoch: None,
        }
    }

    fn detached(why: &str) -> Mark {
        Mark {
            state: ClaimState::NodeDetached,
            error: Some(why.to_string()),
            epoch: None,
        }
    }

    fn key(v: &str, a: &str) -> ClaimKey {
        (v.to_string(), a.to_string())
    }

    #[test]
    fn the_queue_keeps_one_mark_per_claim_and_a_late_releasing_never_hides_node_detached() {
        let mut q = Queue::default();
        assert!(q.push(key("v", "a"), releasing()));
        assert!(q.push(key("w", "a"), releasing()));
        assert!(q.push(key("v", "a"), detached("first")));
        assert!(q.push(key("v", "a"), releasing()));
        assert!(q.push(key("v", "a"), detached("second")));
        assert!(q.push(key("v", "a"), releasing()));
        assert_eq!(q.pending.len(), 2, "bounded by the claims");
        assert_eq!(q.pop(), Some((key("v", "a"), detached("second"))));
        q.written();
        assert_eq!(q.pop(), Some((key("w", "a"), releasing())));
        q.written();
        assert_eq!(q.pop(), None);
        // A mark queued while one of its claim is written is written after.
        assert!(q.push(key("v", "a"), releasing()));
        assert_eq!(q.pop(), Some((key("v", "a"), releasing())));
        assert!(q.push(key("v", "a"), detached("third")));
        q.written();
        assert_eq!(q.pop(), Some((key("v", "a"), detached("third"))));
        q.written();
        assert!(q.push(key("x", "a"), releasing()));
        assert_eq!(q.stop(), 1);
        assert!(!q.push(key("x", "a"), releasing()), "dropped once stopped");
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn a_mark_applied_to_a_claim_keeps_node_detached() {
        let mut c: Claim = serde_json::from_value(serde_json::json!({
            "volume_id": "v", "alloc_id": "a", "node": "n", "mode": "write",
            "access_mode": "single-node-writer", "state": "taken"
        }))
        .expect("a claim");
        releasing().apply(&mut c);
        assert_eq!(c.state, ClaimState::Releasing);
        detached("why").apply(&mut c);
        releasing().apply(&mut c);
        assert_eq!(
            (c.state, c.last_error.as_deref()),
            (ClaimState::NodeDetached, Some("why"))
        );
    }

    #[test]
    fn the_marker_writes_in_order_without_blocking_and_stops_with_the_agent() {
        let marks = Arc::new(Marks::default());
        let shutdown = Shutdown::new();
        let written = Arc::new(Mutex::new(Vec::new()));
        let (gate_tx, gate_rx) = crossbeam_channel::unbounded::<()>();
        marks.push("v", "a", releasing());
        assert!(!marks.start());
        assert!(marks.start(), "started once");
        let mut threads = Threads::new();
        let (m, s, w) = (marks.clone(), shutdown.clone(), written.clone());
        threads
            .spawn(MARKER_THREAD, move || {
                m.run(&s, |v, a, mark| {
                    // Each write waits for the test: the callers do not.
                    let _ = gate_rx.recv_timeout(Duration::from_secs(10));
                    w.lock().push((v.to_string(), a.to_string(), mark.state));
                    Written::Done
                })
            })
            .expect("spawn");
        marks.push("w", "a", releasing());
        marks.push("w", "a", detached("x"));
        gate_tx.send(()).expect("gate");
        gate_tx.send(()).expect("gate");
        let deadline = Instant::now() + Duration::from_secs(10);
        while written.lock().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            *written.lock(),
            vec![
                ("v".to_string(), "a".to_string(), ClaimState::Releasing),
                ("w".to_string(), "a".to_string(), ClaimState::NodeDetached),
            ]
        );
        marks.push("x", "a", releasing());
        shutdown.trigger();
        drop(gate_tx);
        let left = threads.join_until(Instant::now() + Duration::from_secs(10));
        assert!(left.is_empty(), "the marker stops with the agent: {left:?}");
        assert_eq!(marks.queue.lock().phase, Phase::Stopped);
        assert!(marks.queue.lock().pending.is_empty());
    }

    #[test]
    fn an_unanswered_write_drops_the_waiting_marks_and_a_take_or_free_drops_its_own() {
        let mut q = Queue::default();
        q.push(key("v", "a"), releasing());
        q.push(key("w", "a"), releasing());
        q.forget(&key("v", "a"));
        assert_eq!(q.pop(), Some((key("w", "a"), releasing())));
        q.written();
        assert_eq!(q.pop(), None);

        let marks = Arc::new(Marks::default());
        let shutdown = Shutdown::new();
        let tried = Arc::new(Mutex::new(Vec::new()));
        let (gate_tx, gate_rx) = crossbeam_channel::unbounded::<()>();
        marks.push("v", "a", releasing());
        marks.push("w", "a", releasing());
        marks.push("x", "a", releasing());
        assert!(!marks.start());
        let mut threads = Threads::new();
        let (m, s, t) = (marks.clone(), shutdown.clone(), tried.clone());
        threads
            .spawn(MARKER_THREAD, move || {
                m.run(&s, |v, _, _| {
                    let _ = gate_rx.recv_timeout(Duration::from_secs(10));
                    t.lock().push(v.to_string());
                    Written::Unreachable
                })
            })
            .expect("spawn");
        gate_tx.send(()).expect("gate");
        let deadline = Instant::now() + Duration::from_secs(10);
        while (tried.lock().is_empty() || marks.queue.lock().writing) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*tried.lock(), ["v"], "one unanswered write, not three");
        assert!(marks.queue.lock().pending.is_empty(), "the others dropped");
        shutdown.trigger();
        drop(gate_tx);
        assert!(threads
            .join_until(Instant::now() + Duration::from_secs(10))
            .is_empty());
    }

    #[test]
    fn a_marker_that_panics_stops_its_queue() {
        let marks = Arc::new(Marks::default());
        marks.push("v", "a", releasing());
        assert!(!marks.start());
        let m = marks.clone();
        let ended = std::thread::spawn(move || {
            m.run(&Shutdown::new(), |_, _, _| panic!("a write that panics"))
        })
        .join();
        assert!(ended.is_err(), "the write panicked");
        assert_eq!(marks.queue.lock().phase, Phase::Stopped);
        marks.push("w", "a", releasing());
        assert!(
            marks.queue.lock().pending.is_empty(),
            "nothing queued for nothing"
        );
    }
}
