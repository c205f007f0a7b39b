//! Group commit of a state kept in memory and made durable by its owner.
//!
//! Every change is decided under one mutex on the latest state (durable or
//! not), so each decision sees every earlier one. The durable writes of
//! concurrent changes are shared: while one caller writes, the changes of
//! the others pile up in `pending`, and the next caller to find no writer
//! makes the whole pile durable in one write. Sequence numbers tell each
//! caller when its change is durable or was dropped by a failed write.
//!
//! How a state is made durable (a journal line, a rewritten file) is the
//! owner's: it hands `update` a `persist` function, called without the lock.
//!
//! Company: when the owner says many operations are in flight
//! (`set_company`), the writer of a change that waits for its write first
//! waits a little (`COMPANY_WAIT` at most) for others to join its batch,
//! as PostgreSQL's `commit_delay` does. On a busy node their changes come
//! within a write's time, so one write then serves several operations; on
//! a quiet one nobody waits. Every change is still durable before its
//! caller goes on: only when the write starts moves.

use std::time::{Duration, Instant};

use std::sync::OnceLock;

use parking_lot::{Condvar, Mutex, MutexGuard};

/// At least this many operations in flight (as the owner counts them): the
/// writer waits for company.
pub const COMPANY_MIN_BUSY: usize = 4;
/// The writer waits for company until the batch holds this many changes
/// (or half the operations in flight, if fewer)...
pub const COMPANY_BATCH: u64 = 8;
/// ... or this long: a fraction of what one operation's CSI calls take.
pub const COMPANY_WAIT: Duration = Duration::from_millis(2);

struct Commit<S> {
    /// What is durable.
    committed: S,
    /// Changes applied but not yet durable, including the batch being
    /// written; None when everything is durable.
    pending: Option<S>,
    /// What readers see when it is not `committed`: the durable state plus
    /// the closing changes applied after it (see `update_closing`).
    view: Option<S>,
    /// Readers see every change up to this one.
    view_seq: u64,
    /// Sequence number of the latest change applied to `pending`.
    applied: u64,
    /// Sequence number of the latest change whose caller waits for it to
    /// be durable (every change but a closing one).
    last_blocking: u64,
    /// Sequence number of the latest closing change.
    last_closing: u64,
    /// Every change up to this one is durable.
    durable: u64,
    /// Every change up to this one failed to be written (and was dropped).
    failed: u64,
    /// Why the last failed batch failed.
    failure: String,
    /// A caller is writing (or `exclusive` runs) without the lock.
    writing: bool,
}

impl<S: Clone> Commit<S> {
    /// Every change whose caller waits for durability is durable (or was
    /// dropped by a failed write).
    fn blocking_settled(&self) -> bool {
        self.last_blocking <= self.durable.max(self.failed)
    }

    /// A closing change waits for its write.
    fn closing_waits(&self) -> bool {
        self.last_closing > self.durable.max(self.failed)
    }

    /// Readers see the latest state: nothing but closing changes is
    /// waiting for its write.
    fn show_latest(&mut self) {
        self.view = self.pending.clone();
        self.view_seq = self.applied;
    }
}

/// A state with group commit: see the module documentation.
pub struct GroupCommit<S> {
    commit: Mutex<Commit<S>>,
    durable_changed: Condvar,
    /// A closing change waits for its write.
    closing_applied: Condvar,
    /// A change was applied (for a writer waiting for company).
    change_applied: Condvar,
    /// Operations in flight, as the owner counts them (see `set_company`).
    company: OnceLock<Box<dyn Fn() -> usize + Send + Sync>>,
    /// `COMPANY_WAIT` (tests set their own).
    company_wait: Duration,
}

impl<S: Clone + PartialEq> GroupCommit<S> {
    /// `initial` is what is durable now.
    pub fn new(initial: S) -> GroupCommit<S> {
        GroupCommit {
            commit: Mutex::new(Commit {
                committed: initial,
                pending: None,
                view: None,
                view_seq: 0,
                applied: 0,
                last_blocking: 0,
                last_closing: 0,
                durable: 0,
                failed: 0,
                failure: String::new(),
                writing: false,
            }),
            durable_changed: Condvar::new(),
            closing_applied: Condvar::new(),
            change_applied: Condvar::new(),
            company: OnceLock::new(),
            company_wait: COMPANY_WAIT,
        }
    }

    /// Tells the writer how many operations are in flight (it must not
    /// take this state's lock): from `COMPANY_MIN_BUSY` on, the writer of a
    /// change that waits for its write waits for company first. Set once;
    /// a second call is ignored.
    pub fn set_company(&self, busy: impl Fn() -> usize + Send + Sync + 'static) {
        let _ = self.company.set(Box::new(busy));
    }

    /// Runs `f` on what readers see: the durable state, plus the closing
    /// changes applied after it (never a change whose caller still waits
    /// for its write).
    pub fn read<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        let g = self.commit.lock();
        f(g.view.as_ref().unwrap_or(&g.committed))
    }

    /// Changes applied but not durable yet (closing changes waiting for the
    /// next write, and the batch being written).
    pub fn undurable(&self) -> u64 {
        let g = self.commit.lock();
        g.applied.saturating_sub(g.durable.max(g.failed))
    }

    /// When nothing is pending (so no write is in flight either), replaces
    /// the durable state by what `load` reads, for an owner whose file may
    /// be changed behind its back. With changes pending, `load` is not
    /// called: the file may still be the old one.
    pub fn refresh<E>(&self, load: impl FnOnce() -> Result<S, E>) -> Result<(), E> {
        let mut g = self.commit.lock();
        if g.pending.is_none() {
            g.committed = load()?;
            g.view = None;
        }
        Ok(())
    }

    /// Applies `f` to a copy of the latest state (durable or pending). When
    /// `f` fails nothing changes. When `f` changed something, returns once
    /// the change is durable; when it changed nothing, once the pending
    /// changes it may have read are durable (closing changes need not be),
    /// or at once if there are none (a batch that failed earlier is not an
    /// error of this call).
    ///
    /// The caller that finds no writer becomes the writer of everything
    /// pending: it calls `persist(durable, batch)` without the lock. A
    /// failed write fails every change of its batch and those applied on
    /// top of it, each with `failed(message)`, and leaves the durable state
    /// as it was.
    pub fn update<R, E>(
        &self,
        f: impl FnOnce(&mut S) -> Result<R, E>,
        mut persist: impl FnMut(&S, &S) -> Result<(), String>,
        failed: impl FnOnce(String) -> E,
    ) -> Result<R, E> {
        let mut g = self.commit.lock();
        let base = g.pending.as_ref().unwrap_or(&g.committed);
        let mut next = base.clone();
        let r = f(&mut next)?;
        let (mine, applied_at) = if next != *base {
            g.applied += 1;
            g.last_blocking = g.applied;
            g.pending = Some(next);
            self.change_applied.notify_all();
            (g.applied, Some(Instant::now()))
        } else if g.blocking_settled() {
            return Ok(r);
        } else {
            (g.last_blocking, None)
        };
        let waited = || {
            if let Some(t) = applied_at {
                crate::metrics::STATE_COMMIT_WAIT_SECONDS.observe(&[], t.elapsed().as_secs_f64());
            }
        };
        loop {
            if g.durable >= mine {
                waited();
                return Ok(r);
            }
            if g.failed >= mine {
                waited();
                return Err(failed(g.failure.clone()));
            }
            if g.writing {
                self.durable_changed.wait(&mut g);
                continue;
            }
            self.wait_for_company(&mut g);
            self.write_pending(&mut g, &mut persist);
        }
    }

    /// The writer's wait for company (see the module documentation): with
    /// enough operations in flight, until the batch holds `COMPANY_BATCH`
    /// changes (or half the operations, if fewer) or `COMPANY_WAIT` passed.
    /// Marked as writing meanwhile, so nobody else starts a write.
    fn wait_for_company(&self, g: &mut MutexGuard<'_, Commit<S>>) {
        let Some(busy) = self.company.get() else {
            return;
        };
        let busy = busy();
        if busy < COMPANY_MIN_BUSY {
            return;
        }
        let want = COMPANY_BATCH.min(busy as u64 / 2);
        let deadline = Instant::now() + self.company_wait;
        g.writing = true;
        while g.applied - g.durable.max(g.failed) < want {
            if self.change_applied.wait_until(g, deadline).timed_out() {
                break;
            }
        }
        g.writing = false;
    }

    /// A closing change: the last write of an operation whose intent is
    /// durable already, which recovery would redo from that intent. Applied
    /// to the latest state like `update`, it returns once readers see it
    /// (at once, or after the write of a change applied before it and
    /// still waiting for its write), without waiting for its own write:
    /// that rides with the next write of any change, or with `flush`
    /// (`wait_closing` tells a flusher there is one). A failed write drops
    /// it with its batch, like any change (`failed`, when it has not
    /// returned yet).
    pub fn update_closing<R, E>(
        &self,
        f: impl FnOnce(&mut S) -> Result<R, E>,
        failed: impl FnOnce(String) -> E,
    ) -> Result<R, E> {
        let mut g = self.commit.lock();
        let base = g.pending.as_ref().unwrap_or(&g.committed);
        let mut next = base.clone();
        let r = f(&mut next)?;
        if next == *base {
            // Nothing to write; what it read is visible already.
            return Ok(r);
        }
        g.applied += 1;
        let mine = g.applied;
        g.last_closing = mine;
        g.pending = Some(next);
        self.change_applied.notify_all();
        if g.blocking_settled() {
            g.show_latest();
        }
        self.closing_applied.notify_all();
        loop {
            if g.failed >= mine && g.view_seq < mine {
                return Err(failed(g.failure.clone()));
            }
            if g.view_seq >= mine {
                return Ok(r);
            }
            // A change applied before this one is being written (its caller
            // is the writer, or waits to become it).
            self.durable_changed.wait(&mut g);
        }
    }

    /// Makes everything applied so far durable (becoming the writer when
    /// there is none). Err: the write failed (the changes were dropped).
    pub fn flush(
        &self,
        mut persist: impl FnMut(&S, &S) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut g = self.commit.lock();
        if g.pending.is_none() {
            // Nothing to write (an earlier failure is not this call's).
            return Ok(());
        }
        let target = g.applied;
        loop {
            if g.durable >= target {
                return Ok(());
            }
            if g.failed >= target {
                return Err(g.failure.clone());
            }
            if g.pending.is_none() {
                return Ok(());
            }
            if g.writing {
                self.durable_changed.wait(&mut g);
                continue;
            }
            self.write_pending(&mut g, &mut persist);
        }
    }

    /// Waits up to `timeout` until a closing change waits for its write,
    /// or `wake` is called, unless `stop()` (checked under the lock `wake`
    /// takes, so a wake is never missed); whether one waits.
    pub fn wait_closing(&self, timeout: Duration, stop: impl Fn() -> bool) -> bool {
        let mut g = self.commit.lock();
        if !g.closing_waits() && !stop() {
            let _ = self.closing_applied.wait_for(&mut g, timeout);
        }
        g.closing_waits()
    }

    /// Wakes `wait_closing` (to look at its stop condition again).
    pub fn wake(&self) {
        let _g = self.commit.lock();
        self.closing_applied.notify_all();
    }

    /// Becomes the writer of everything pending: `persist(durable, batch)`
    /// without the lock, then the outcome for every waiter.
    fn write_pending(
        &self,
        g: &mut MutexGuard<'_, Commit<S>>,
        persist: &mut impl FnMut(&S, &S) -> Result<(), String>,
    ) {
        // `pending` stays in place: changes applied while we write build on
        // top of it.
        let Some(batch) = g.pending.clone() else {
            return;
        };
        let old = g.committed.clone();
        let upto = g.applied;
        g.writing = true;
        let res = MutexGuard::unlocked(g, || persist(&old, &batch));
        g.writing = false;
        match res {
            Ok(()) => {
                crate::metrics::STATE_CHANGES_WRITTEN.add(upto - g.durable.max(g.failed));
                g.committed = batch;
                g.durable = upto;
                if g.applied == upto {
                    g.pending = None;
                }
                // Otherwise `pending` holds this batch plus the changes
                // applied meanwhile, for the next writer.
                if g.blocking_settled() {
                    g.show_latest();
                } else if upto > g.view_seq {
                    // A change applied after the batch waits for its
                    // write: readers see the batch.
                    g.view = None;
                    g.view_seq = upto;
                }
                if g.pending.is_none() {
                    g.view = None;
                }
            }
            Err(e) => {
                // Later changes were built on the failed batch: drop
                // them too (closing ones included).
                g.failed = g.applied;
                g.failure = e;
                g.pending = None;
                g.view = None;
                g.view_seq = g.durable;
            }
        }
        self.durable_changed.notify_all();
    }

    /// Waits for the writer of the moment, then, unless changes are pending
    /// (their writer will write them: returns None), runs `f` on the
    /// durable state as the writer: without the lock, while no `update`
    /// writes. For work on the durable files such as compaction.
    pub fn exclusive<R>(&self, f: impl FnOnce(&S) -> R) -> Option<R> {
        let mut g = self.commit.lock();
        while g.writing {
            self.durable_changed.wait(&mut g);
        }
        if g.pending.is_some() {
            return None;
        }
        let state = g.committed.clone();
        g.writing = true;
        let r = MutexGuard::unlocked(&mut g, || f(&state));
        g.writing = false;
        self.durable_changed.notify_all();
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::thread;

    type Log = Vec<u32>;

    fn push(v: u32) -> impl FnOnce(&mut Log) -> Result<(), String> {
        move |l| {
            l.push(v);
            Ok(())
        }
    }

    fn persist_ok(_: &Log, _: &Log) -> Result<(), String> {
        Ok(())
    }

    fn failed(msg: String) -> String {
        format!("failed: {msg}")
    }

    #[test]
    fn concurrent_updates_share_writes_and_are_all_durable() {
        let gc = GroupCommit::new(Log::new());
        let writes = Mutex::new(Vec::new());
        thread::scope(|s| {
            for t in 0..8 {
                let (gc, writes) = (&gc, &writes);
                s.spawn(move || {
                    for i in 0..25 {
                        gc.update(
                            push(t * 100 + i),
                            |old: &Log, new: &Log| {
                                writes.lock().push((old.len(), new.len()));
                                Ok(())
                            },
                            failed,
                        )
                        .expect("update");
                    }
                });
            }
        });
        let all = gc.read(Clone::clone);
        assert_eq!(all.len(), 8 * 25);
        // Each write starts from what the one before it made durable.
        let writes = writes.into_inner();
        let mut durable = 0;
        for (old, new) in &writes {
            assert_eq!(*old, durable);
            assert!(new > old);
            durable = *new;
        }
        assert_eq!(durable, 8 * 25);
    }

    #[test]
    fn with_many_operations_in_flight_the_writer_waits_for_company() {
        let mut gc = GroupCommit::new(Log::new());
        // Long enough never to run out here: the batch fills first.
        gc.company_wait = std::time::Duration::from_secs(60);
        gc.set_company(|| 16);
        let batches = Mutex::new(Vec::new());
        let record = |old: &Log, new: &Log| {
            batches.lock().push((old.len(), new.len()));
            Ok(())
        };
        thread::scope(|s| {
            let first = s.spawn(|| gc.update(push(0), record, failed));
            wait_applied(&gc, 1);
            // The first writer waits for company: nothing written yet.
            assert!(batches.lock().is_empty());
            let others: Vec<_> = (1..COMPANY_BATCH as u32)
                .map(|v| {
                    let (gc, record) = (&gc, &record);
                    s.spawn(move || gc.update(push(v), record, failed))
                })
                .collect();
            assert_eq!(first.join().expect("first"), Ok(()));
            for h in others {
                assert_eq!(h.join().expect("other"), Ok(()));
            }
        });
        // One write carried all of them.
        assert_eq!(*batches.lock(), vec![(0, COMPANY_BATCH as usize)]);
    }

    #[test]
    fn with_few_operations_in_flight_the_writer_does_not_wait() {
        let mut gc = GroupCommit::new(Log::new());
        gc.company_wait = std::time::Duration::from_secs(60);
        gc.set_company(|| COMPANY_MIN_BUSY - 1);
        let started = std::time::Instant::now();
        gc.update(push(1), persist_ok, failed).expect("update");
        // Not the minute it would have waited.
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }

    #[test]
    fn a_failed_decision_changes_nothing_and_writes_nothing() {
        let gc = GroupCommit::new(vec![1]);
        let r = gc.update(
            |l: &mut Log| -> Result<(), String> {
                l.push(2);
                Err("refused".into())
            },
            |_, _| panic!("nothing to write"),
            failed,
        );
        assert_eq!(r, Err("refused".to_string()));
        assert_eq!(gc.read(Clone::clone), vec![1]);
    }

    #[test]
    fn a_failed_write_fails_the_change_and_keeps_the_durable_state() {
        let gc = GroupCommit::new(vec![1]);
        let r = gc.update(push(2), |_, _| Err("disk full".into()), failed);
        assert_eq!(r, Err("failed: disk full".to_string()));
        assert_eq!(gc.read(Clone::clone), vec![1]);
        // Nothing changed and nothing pending: at once, and the earlier
        // failure is not this call's.
        let r = gc.update(|_: &mut Log| Ok(7), |_, _| panic!("no write"), failed);
        assert_eq!(r, Ok(7));
        // The next change starts from the durable state.
        gc.update(push(3), persist_ok, failed).expect("update");
        assert_eq!(gc.read(Clone::clone), vec![1, 3]);
    }

    /// The result of a write the test decides.
    type Answer = mpsc::Sender<Result<(), String>>;

    /// Starts an update whose write blocks until the returned sender sends
    /// the write's result; returns once that write has begun.
    fn blocked_writer<'s>(
        s: &'s thread::Scope<'s, '_>,
        gc: &'s GroupCommit<Log>,
        v: u32,
    ) -> (Answer, thread::ScopedJoinHandle<'s, Result<(), String>>) {
        let (started_tx, started_rx) = mpsc::channel();
        let (result_tx, result_rx) = mpsc::channel::<Result<(), String>>();
        let h = s.spawn(move || {
            gc.update(
                push(v),
                |_, _| {
                    started_tx.send(()).expect("test waits");
                    result_rx.recv().expect("test answers")
                },
                failed,
            )
        });
        started_rx.recv().expect("the write began");
        (result_tx, h)
    }

    /// Waits (bounded) until `gc` holds `n` applied changes.
    fn wait_applied(gc: &GroupCommit<Log>, n: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while gc.commit.lock().applied < n {
            assert!(std::time::Instant::now() < deadline, "no change {n}");
            thread::yield_now();
        }
    }

    #[test]
    fn changes_made_during_a_write_go_in_one_batch_after_it() {
        let gc = GroupCommit::new(Log::new());
        let batches = Mutex::new(Vec::new());
        let record = |_: &Log, new: &Log| {
            batches.lock().push(new.clone());
            Ok(())
        };
        thread::scope(|s| {
            let (release, first) = blocked_writer(s, &gc, 1);
            let later: Vec<_> = (2..=4)
                .map(|v| {
                    let gc = &gc;
                    s.spawn(move || gc.update(push(v), record, failed))
                })
                .collect();
            wait_applied(&gc, 4);
            // Nothing changed, but it may have read pending changes: it
            // answers once they are durable.
            let reader = s.spawn(|| {
                let r = gc.update(|l: &mut Log| Ok(l.len()), record, failed);
                (r, gc.read(Vec::len))
            });
            release.send(Ok(())).expect("writer waits");
            assert_eq!(first.join().expect("first"), Ok(()));
            for h in later {
                assert_eq!(h.join().expect("later"), Ok(()));
            }
            assert_eq!(reader.join().expect("reader"), (Ok(4), 4));
        });
        let batches = batches.into_inner();
        assert_eq!(batches.len(), 1, "one write after the first: {batches:?}");
        let mut batch = batches[0].clone();
        batch.sort_unstable();
        assert_eq!(batch, vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_failed_batch_fails_the_changes_applied_on_top_of_it() {
        let gc = GroupCommit::new(vec![0]);
        thread::scope(|s| {
            let (release, first) = blocked_writer(s, &gc, 1);
            let on_top = s.spawn(|| gc.update(push(2), persist_ok, failed));
            wait_applied(&gc, 2);
            release.send(Err("EIO".into())).expect("writer waits");
            assert_eq!(first.join().expect("first"), Err("failed: EIO".into()));
            assert_eq!(on_top.join().expect("on top"), Err("failed: EIO".into()));
        });
        assert_eq!(gc.read(Clone::clone), vec![0]);
    }

    #[test]
    fn exclusive_waits_for_the_writer_and_skips_pending_changes() {
        let gc = GroupCommit::new(vec![0]);
        assert_eq!(gc.exclusive(Clone::clone), Some(vec![0]));
        thread::scope(|s| {
            let (release, first) = blocked_writer(s, &gc, 1);
            // Started during the write, it runs after it (not finding the
            // change pending).
            let after = s.spawn(|| gc.exclusive(Clone::clone));
            release.send(Ok(())).expect("writer waits");
            first.join().expect("first").expect("durable");
            assert_eq!(after.join().expect("exclusive"), Some(vec![0, 1]));
        });
        // A change that waits for its writer: nothing to do now (that
        // window is too short to hit from threads, so it is set up here).
        {
            let mut g = gc.commit.lock();
            g.pending = Some(vec![0, 1, 2]);
            g.applied += 1;
            g.last_blocking = g.applied;
        }
        assert_eq!(gc.exclusive(|_| panic!("not while pending")), None::<()>);
        assert_eq!(
            gc.update(|l: &mut Log| Ok(l.len()), persist_ok, failed),
            Ok(3)
        );
        assert_eq!(gc.exclusive(Clone::clone), Some(vec![0, 1, 2]));
    }

    #[test]
    fn refresh_replaces_the_durable_state_only_when_nothing_is_pending() {
        let gc = GroupCommit::new(vec![0]);
        gc.refresh(|| Ok::<_, ()>(vec![5])).expect("refresh");
        assert_eq!(gc.read(Clone::clone), vec![5]);
        assert_eq!(gc.refresh(|| Err("unreadable")), Err("unreadable"));
        thread::scope(|s| {
            let (release, first) = blocked_writer(s, &gc, 1);
            gc.refresh(|| -> Result<Log, ()> { panic!("not while writing") })
                .expect("refresh");
            release.send(Ok(())).expect("writer waits");
            first.join().expect("first").expect("durable");
        });
        assert_eq!(gc.read(Clone::clone), vec![5, 1]);
    }

    #[test]
    fn a_closing_change_is_seen_at_once_and_rides_with_the_next_write() {
        let gc = GroupCommit::new(vec![0]);
        let writes = Mutex::new(Vec::new());
        let record = |old: &Log, new: &Log| {
            writes.lock().push((old.clone(), new.clone()));
            Ok(())
        };
        gc.update_closing(push(1), failed).expect("closing");
        assert_eq!(gc.read(Clone::clone), vec![0, 1], "readers see it");
        assert_eq!(gc.undurable(), 1);
        assert!(writes.lock().is_empty(), "nothing written yet");
        assert!(gc.wait_closing(std::time::Duration::ZERO, || false));
        // A change that waits for its write writes the closing one with it.
        gc.update(push(2), record, failed).expect("update");
        assert_eq!(*writes.lock(), vec![(vec![0], vec![0, 1, 2])]);
        assert_eq!(gc.undurable(), 0);
        assert!(!gc.wait_closing(std::time::Duration::ZERO, || true));
        // A change that changes nothing does not wait for closing ones.
        gc.update_closing(push(3), failed).expect("closing");
        let r = gc.update(|l: &mut Log| Ok(l.len()), |_, _| panic!("no write"), failed);
        assert_eq!(r, Ok(4));
        gc.flush(record).expect("flush");
        assert_eq!(writes.lock().len(), 2);
        assert_eq!(gc.undurable(), 0);
        gc.flush(|_, _| panic!("nothing to write")).expect("flush");
    }

    #[test]
    fn readers_never_see_a_change_whose_write_is_in_flight() {
        let gc = GroupCommit::new(vec![0]);
        thread::scope(|s| {
            let (release, first) = blocked_writer(s, &gc, 1);
            // Applied after the write began: seen only once that write
            // (which does not carry it) is done, and not written by it.
            let closing = s.spawn(|| gc.update_closing(push(2), failed));
            wait_applied(&gc, 2);
            assert_eq!(gc.read(Clone::clone), vec![0], "neither is durable");
            assert_eq!(gc.undurable(), 2);
            release.send(Ok(())).expect("writer waits");
            first.join().expect("first").expect("durable");
            closing.join().expect("closing").expect("seen");
            assert_eq!(gc.read(Clone::clone), vec![0, 1, 2]);
            assert_eq!(gc.undurable(), 1, "the closing change waits for a write");
        });
        gc.flush(persist_ok).expect("flush");
        assert_eq!(gc.undurable(), 0);
    }

    #[test]
    fn a_failed_write_drops_the_closing_changes_it_carried() {
        let gc = GroupCommit::new(vec![0]);
        gc.update_closing(push(1), failed).expect("closing");
        let r = gc.update(push(2), |_, _| Err("EIO".into()), failed);
        assert_eq!(r, Err("failed: EIO".to_string()));
        assert_eq!(gc.read(Clone::clone), vec![0]);
        assert_eq!(gc.undurable(), 0);
        gc.update_closing(push(3), failed).expect("closing");
        assert_eq!(
            gc.flush(|_, _| Err("ENOSPC".into())),
            Err("ENOSPC".to_string())
        );
        assert_eq!(gc.read(Clone::clone), vec![0]);
    }
}
