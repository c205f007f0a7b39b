//! Named threads with an owner that joins them within a bound and names the
//! ones that did not finish.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

/// Owns a set of named threads.
pub struct Threads {
    next_id: u64,
    handles: Vec<(u64, String, JoinHandle<()>)>,
    done_tx: Sender<u64>,
    done_rx: Receiver<u64>,
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
        }
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
        let handle = spawn_named(name.clone(), f, move || {
            let _ = done.send(id);
        })?;
        self.handles.push((id, name, handle));
        Ok(id)
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
        self.reap();
        while !self.handles.is_empty() {
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.done_rx.recv_timeout(wait) {
                Ok(id) => self.join_id(id),
                Err(_) => break,
            }
        }
        self.handles.into_iter().map(|(_, n, _)| n).collect()
    }
}

/// Spawns a named thread; `on_exit` runs when it ends, even by panic (a
/// panic is logged with the thread's name).
pub fn spawn_named(
    name: String,
    f: impl FnOnce() + Send + 'static,
    on_exit: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    struct OnExit<F: FnOnce()>(Option<F>, String);
    impl<F: FnOnce()> Drop for OnExit<F> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                log::error!("thread {} panicked", self.1);
            }
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    let guard_name = name.clone();
    std::thread::Builder::new().name(name).spawn(move || {
        let _guard = OnExit(Some(on_exit), guard_name);
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
