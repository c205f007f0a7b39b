//! Named threads with an owner that joins them within a bound and names the
//! ones that did not finish, and pooled ones for short jobs.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

/// How long a pooled thread waits for its next job before it ends (and its
/// stack's memory goes back to the kernel): the jobs of a burst reuse
/// threads, an idle agent keeps none.
pub const POOL_IDLE_KEEP: Duration = Duration::from_secs(1);
/// Pooled threads kept waiting at most; past this many, a thread whose job
/// ended ends too. (A thread that waited out `POOL_IDLE_KEEP` while a job
/// was on its way to it waits again uncounted, so a few more may wait for
/// a moment.)
pub const POOL_IDLE_MAX: usize = 16;
/// What a pooled thread is called while it waits for a job.
pub const POOL_IDLE_NAME: &str = "pool-idle";

/// A thread's name as its owner reports it; a pooled thread's changes
/// with its job.
type Name = Arc<Mutex<String>>;

thread_local! {
    /// The job a pooled thread runs (std's name is the first job's).
    static JOB_NAME: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Calls `f` with the calling thread's name for logs: the job it runs if it
/// is a pooled thread, else the name it was started with.
pub fn with_current_name<R>(f: impl FnOnce(Option<&str>) -> R) -> R {
    // A log line written while the thread's locals are torn down falls
    // back to std's name; the name is copied out before `f` runs.
    let job = JOB_NAME
        .try_with(|job| job.try_borrow().ok().and_then(|j| j.clone()))
        .ok()
        .flatten();
    match job {
        Some(name) => f(Some(&name)),
        None => f(std::thread::current().name()),
    }
}

/// Names the calling thread for logs (`with_current_name`), for the
/// owner's report and in `/proc/self/task/TID/comm` (the kernel keeps the
/// first 15 bytes).
fn name_current(name: &str, shown: &Mutex<String>) {
    JOB_NAME.with(|job| *job.borrow_mut() = Some(name.to_string()));
    name.clone_into(&mut shown.lock());
    let Ok(name) = std::ffi::CString::new(name) else {
        return;
    };
    // SAFETY: PR_SET_NAME reads a NUL-terminated string from a live
    // pointer, and names only the calling thread.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, name.as_ptr());
    }
}

/// Owns a set of named threads.
pub struct Threads {
    next_id: u64,
    handles: Vec<(u64, Name, JoinHandle<()>)>,
    done_tx: Sender<u64>,
    done_rx: Receiver<u64>,
    pool: Option<Pool>,
    pool_keep: Duration,
}

type Job = (String, Box<dyn FnOnce() + Send>);

/// Jobs for pooled threads. `idle` counts the waiting threads no job was
/// promised to: a spawn takes one (and only then sends its job), a thread
/// that waited `POOL_IDLE_KEEP` takes one to leave; when it finds none, a
/// job is on its way to it and it waits again. So a sent job always has a
/// thread to run it.
struct Pool {
    tx: Sender<Job>,
    rx: Receiver<Job>,
    idle: Arc<AtomicUsize>,
}

impl Pool {
    fn new() -> Pool {
        let (tx, rx) = crossbeam_channel::unbounded();
        Pool {
            tx,
            rx,
            idle: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl Default for Threads {
    fn default() -> Self {
        Self::new()
    }
}

impl Threads {
    pub fn new() -> Threads {
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        Threads {
            next_id: 0,
            handles: Vec::new(),
            done_tx,
            done_rx,
            pool: None,
            pool_keep: POOL_IDLE_KEEP,
        }
    }

    /// How long this owner's pooled threads wait for a job (tests).
    #[cfg(test)]
    fn with_pool_keep(mut self, keep: Duration) -> Threads {
        self.pool_keep = keep;
        self
    }

    fn join_id(&mut self, id: u64) {
        if let Some(i) = self.handles.iter().position(|(n, _, _)| *n == id) {
            let (_, _, h) = self.handles.swap_remove(i);
            let _ = h.join();
        }
    }

    /// Joins the threads that have already ended, so a long-lived owner
    /// does not accumulate handles.
    pub fn reap(&mut self) {
        while let Ok(id) = self.done_rx.try_recv() {
            self.join_id(id);
        }
    }

    /// Threads not yet joined.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Spawns a named thread. A panic inside it is logged with the name.
    pub fn spawn(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        self.spawn_id(name, f).map(|_| ())
    }

    /// Like `spawn`; answers the thread's ID, for `take`.
    pub fn spawn_id(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<u64> {
        self.reap();
        let name = name.into();
        let id = self.next_id;
        self.next_id += 1;
        let done = self.done_tx.clone();
        let shown = Arc::new(Mutex::new(name.clone()));
        let handle = spawn_shown(name, shown.clone(), f, move || {
            let _ = done.send(id);
        })?;
        self.handles.push((id, shown, handle));
        Ok(id)
    }

    /// Runs `f` on a pooled thread named `name` while it runs: one that
    /// waits for a job if there is one, a new one otherwise (so a job never
    /// waits for another to end). A pooled thread is owned and joined like
    /// the others; it waits `POOL_IDLE_KEEP` for its next job, and ends at
    /// once when this owner is joined. For jobs that come in bursts and
    /// allocate little that outlives them (releases, and API requests
    /// other than mounts: registering a volume leaves one small record): a
    /// thread's start and end cost more than many of them. Logs name the
    /// job (`with_current_name`).
    ///
    /// Not for mounts nor restores: a mount's long-lived records, allocated
    /// from threads that live on (glibc's per-thread malloc caches keep
    /// chunks across jobs), left the heap more fragmented: 66.1 against
    /// 63.8 MiB resident with 10,000 allocations (three runs and two; 66.6
    /// against 63.6 on 2026-12-06, one run each); 63.0 with glibc's caches
    /// off (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`). The other API
    /// requests run here (63.7 MiB).
    pub fn spawn_pooled(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        self.reap();
        let name = name.into();
        let pool = self.pool.get_or_insert_with(Pool::new);
        let waiting = pool
            .idle
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if waiting.is_ok() {
            // Cannot fail: `pool.rx` is a receiver.
            let _ = pool.tx.send((name, Box::new(f)));
            return Ok(());
        }
        let (rx, idle, keep) = (pool.rx.clone(), pool.idle.clone(), self.pool_keep);
        let id = self.next_id;
        self.next_id += 1;
        let done = self.done_tx.clone();
        let shown = Arc::new(Mutex::new(name.clone()));
        let slot = shown.clone();
        let handle = spawn_shown(
            name,
            shown.clone(),
            move || {
                f();
                pooled(&rx, &idle, keep, &slot);
            },
            move || {
                let _ = done.send(id);
            },
        )?;
        self.handles.push((id, shown, handle));
        Ok(())
    }

    /// Takes thread `id` out of the set (None when it was joined already),
    /// for its owner to join it outside whatever lock guards the set.
    pub fn take(&mut self, id: u64) -> Option<JoinHandle<()>> {
        let i = self.handles.iter().position(|(n, _, _)| *n == id)?;
        Some(self.handles.swap_remove(i).2)
    }

    /// Joins every thread that finishes before `deadline`; returns the names
    /// of those still running (they are detached).
    pub fn join_until(mut self, deadline: Instant) -> Vec<String> {
        // Waiting pooled threads end once the jobs sent to them have run.
        self.pool = None;
        self.reap();
        while !self.handles.is_empty() {
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.done_rx.recv_timeout(wait) {
                Ok(id) => self.join_id(id),
                Err(_) => break,
            }
        }
        self.handles
            .into_iter()
            .map(|(_, n, _)| n.lock().clone())
            .collect()
    }
}

/// A pooled thread after its first job: waits for the next (see `Pool`).
fn pooled(rx: &Receiver<Job>, idle: &AtomicUsize, keep: Duration, shown: &Mutex<String>) {
    loop {
        // Named idle as soon as its job ended (a stop's report then never
        // names a finished job).
        name_current(POOL_IDLE_NAME, shown);
        let waits = idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < POOL_IDLE_MAX).then_some(n + 1)
        });
        if waits.is_err() {
            return;
        }
        let (name, job) = loop {
            match rx.recv_timeout(keep) {
                Ok(job) => break job,
                Err(RecvTimeoutError::Timeout) => {
                    let leave =
                        idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
                    if leave.is_ok() {
                        return;
                    }
                    // A job was promised to a waiting thread: take it.
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        name_current(&name, shown);
        job();
    }
}

/// Spawns a named thread; `on_exit` runs when it ends, even by panic (a
/// panic is logged with the thread's name).
pub fn spawn_named(
    name: String,
    f: impl FnOnce() + Send + 'static,
    on_exit: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let shown = Arc::new(Mutex::new(name.clone()));
    spawn_shown(name, shown, f, on_exit)
}

/// `spawn_named`, whose panic is logged with the name in `shown` then.
fn spawn_shown(
    name: String,
    shown: Name,
    f: impl FnOnce() + Send + 'static,
    on_exit: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    struct OnExit<F: FnOnce()>(Option<F>, Name);
    impl<F: FnOnce()> Drop for OnExit<F> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                log::error!("thread {} panicked", self.1.lock());
            }
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    std::thread::Builder::new().name(name).spawn(move || {
        let _guard = OnExit(Some(on_exit), shown);
        f();
    })
}

/// Wakes the thread that polls a future.
struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Drives a future to completion on this thread, up to `timeout`; `None`
/// if it did not complete in time.
///
/// grpcio's server sinks return a future that must be kept until the reply
/// is sent: dropping it early lets gRPC cancel the call, and the client sees
/// CANCELLED instead of the answer. A request thread waits on it with this.
pub fn block_on<F: Future>(future: F, timeout: Duration) -> Option<F::Output> {
    block_on_while(future, Instant::now() + timeout, || true)
}

/// Like `block_on`, up to `deadline`, and also gives up (`None`) as soon as
/// `keep_waiting` turns false: it is checked at every wake-up, so another
/// thread interrupts the wait by changing what it reads and unparking this
/// thread (`JoinHandle::thread().unpark()`). Dropping the future is how a
/// stream's pending receive is abandoned; the stream keeps its state.
pub fn block_on_while<F: Future>(
    future: F,
    deadline: Instant,
    keep_waiting: impl Fn() -> bool,
) -> Option<F::Output> {
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return Some(out);
        }
        let now = Instant::now();
        if now >= deadline || !keep_waiting() {
            return None;
        }
        // A wake-up unparks; a spurious one only costs a poll.
        std::thread::park_timeout(deadline - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn block_on_runs_a_future_woken_from_another_thread() {
        let (tx, rx) = std::sync::mpsc::channel::<Waker>();
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flag.clone();
        let fut = std::future::poll_fn(move |cx| {
            if f.load(std::sync::atomic::Ordering::SeqCst) {
                Poll::Ready(7)
            } else {
                let _ = tx.send(cx.waker().clone());
                Poll::Pending
            }
        });
        let waker_thread = std::thread::spawn(move || {
            let w = rx.recv().expect("first poll sends a waker");
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            w.wake();
        });
        assert_eq!(block_on(fut, Duration::from_secs(30)), Some(7));
        waker_thread.join().expect("waker thread");
        assert_eq!(
            block_on(std::future::pending::<()>(), Duration::from_millis(10)),
            None
        );
    }

    #[test]
    fn join_until_names_the_stuck_thread() {
        let mut t = Threads::new();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        t.spawn("quick", || {}).expect("spawn");
        t.spawn("stuck", move || {
            let _ = stop_rx.recv();
        })
        .expect("spawn");
        let left = t.join_until(Instant::now() + Duration::from_millis(200));
        assert_eq!(left, vec!["stuck".to_string()]);
        drop(stop_tx);
    }

    fn comm_of(tid: libc::pid_t) -> String {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
            .expect("comm")
            .trim_end()
            .to_string()
    }

    fn tid() -> libc::pid_t {
        // SAFETY: gettid(2) has no arguments and cannot fail.
        unsafe { libc::gettid() }
    }

    #[test]
    fn a_pooled_thread_runs_the_next_job_under_its_name_and_waits_as_idle() {
        let mut t = Threads::new().with_pool_keep(Duration::from_secs(3600));
        let (tx, rx) = crossbeam_channel::unbounded();
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(0);
        let tx1 = tx.clone();
        t.spawn_pooled("job-first", move || {
            let _ = tx1.send((tid(), comm_of(tid())));
        })
        .expect("spawn");
        let (first, name) = rx.recv().expect("first job ran");
        assert_eq!(name, "job-first");
        // The job has ended; the thread waits (counted idle), named idle.
        let idle = t.pool.as_ref().expect("a pool").idle.clone();
        while idle.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(comm_of(first), POOL_IDLE_NAME);
        let tx2 = tx.clone();
        t.spawn_pooled("release-v1", move || {
            let logged = with_current_name(|n| n.map(String::from));
            let _ = tx2.send((tid(), comm_of(tid())));
            let _ = tx2.send((0, logged.unwrap_or_default()));
            let _ = go_rx.recv();
        })
        .expect("spawn");
        let (second, name) = rx.recv().expect("second job ran");
        assert_eq!((second, name.as_str()), (first, "release-v1"));
        let (_, logged) = rx.recv().expect("the log's name");
        assert_eq!(logged, "release-v1", "logs name the job, not the first one");
        assert_eq!(t.len(), 1, "the waiting thread ran it, none was started");
        // The job blocks: the owner names it by its job when joined.
        let left = t.join_until(Instant::now() + Duration::from_millis(100));
        assert_eq!(left, vec!["release-v1".to_string()]);
        drop(go_tx);
    }

    #[test]
    fn a_pooled_job_never_waits_for_another_and_joining_ends_idle_threads() {
        let mut t = Threads::new().with_pool_keep(Duration::from_secs(3600));
        let (block_tx, block_rx) = crossbeam_channel::bounded::<()>(0);
        let (ran_tx, ran_rx) = crossbeam_channel::unbounded();
        let ran = ran_tx.clone();
        t.spawn_pooled("stuck", move || {
            let _ = ran.send("stuck");
            let _ = block_rx.recv();
        })
        .expect("spawn");
        assert_eq!(ran_rx.recv(), Ok("stuck"));
        // The only pooled thread is busy: the next job gets a thread of its
        // own and runs while the first still blocks.
        let ran = ran_tx.clone();
        t.spawn_pooled("next", move || {
            let _ = ran.send("next");
        })
        .expect("spawn");
        assert_eq!(ran_rx.recv(), Ok("next"));
        assert_eq!(t.len(), 2);
        drop(block_tx);
        assert_eq!(
            ran_rx.try_recv(),
            Err(crossbeam_channel::TryRecvError::Empty)
        );
        // Both wait for jobs now, for an hour: joining ends them.
        assert!(t
            .join_until(Instant::now() + Duration::from_secs(600))
            .is_empty());
    }

    #[test]
    fn a_pooled_thread_no_job_came_for_ends_by_itself() {
        let mut t = Threads::new().with_pool_keep(Duration::from_millis(10));
        let (ran_tx, ran_rx) = crossbeam_channel::unbounded();
        t.spawn_pooled("once", move || {
            let _ = ran_tx.send(());
        })
        .expect("spawn");
        ran_rx.recv().expect("ran");
        while !t.is_empty() {
            t.reap();
            std::thread::yield_now();
        }
        // And the next job gets a new thread.
        let (ran_tx, ran_rx) = crossbeam_channel::unbounded();
        t.spawn_pooled("twice", move || {
            let _ = ran_tx.send(());
        })
        .expect("spawn");
        ran_rx.recv().expect("ran again");
    }

    #[test]
    fn every_job_of_a_burst_runs_and_no_more_than_the_cap_stay_waiting() {
        let mut t = Threads::new().with_pool_keep(Duration::from_secs(3600));
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(0);
        let (ran_tx, ran_rx) = crossbeam_channel::unbounded();
        let n = POOL_IDLE_MAX + 8;
        for i in 0..n {
            let (go, ran) = (go_rx.clone(), ran_tx.clone());
            t.spawn_pooled(format!("job-{i}"), move || {
                let _ = ran.send(i);
                // Every job holds its thread until all have started.
                let _ = go.recv();
            })
            .expect("spawn");
        }
        let mut seen: Vec<usize> = (0..n).map(|_| ran_rx.recv().expect("ran")).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>());
        assert_eq!(t.len(), n, "a job never waited for another");
        drop(go_tx);
        // Past the cap, a thread whose job ended ends too.
        let deadline = Instant::now() + Duration::from_secs(60);
        while t.len() > POOL_IDLE_MAX && Instant::now() < deadline {
            t.reap();
            std::thread::yield_now();
        }
        assert_eq!(t.len(), POOL_IDLE_MAX);
        // The waiting ones take the next burst.
        for i in 0..POOL_IDLE_MAX {
            let ran = ran_tx.clone();
            t.spawn_pooled(format!("again-{i}"), move || {
                let _ = ran.send(i);
            })
            .expect("spawn");
        }
        for _ in 0..POOL_IDLE_MAX {
            ran_rx.recv().expect("ran again");
        }
        assert_eq!(t.len(), POOL_IDLE_MAX);
        assert!(t
            .join_until(Instant::now() + Duration::from_secs(60))
            .is_empty());
    }

    #[test]
    fn reap_joins_finished_threads_with_the_same_name() {
        let mut t = Threads::new();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        t.spawn("w", move || {
            let _ = stop_rx.recv();
        })
        .expect("spawn");
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(1);
        t.spawn("w", move || {
            let _ = done_tx.send(());
        })
        .expect("spawn");
        done_rx.recv().expect("second thread ran");
        // Reaping must join only the finished one, never block on the other.
        let deadline = Instant::now() + Duration::from_secs(5);
        while t.len() > 1 && Instant::now() < deadline {
            t.reap();
            std::thread::yield_now();
        }
        assert_eq!(t.len(), 1);
        drop(stop_tx);
        assert!(t
            .join_until(Instant::now() + Duration::from_secs(5))
            .is_empty());
    }
}
