//! The named thread behind a keep-alive or a watch, and how its owner stops
//! it: a flag plus a closed channel (sleeps wake) plus an unpark (a wait on
//! the stream wakes), then a join bounded by `STOP_TIMEOUT`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::EtcdError;
use crate::threads::{block_on_while, spawn_named};

/// How long stopping waits for the thread: its waits are interruptible, so
/// it normally ends within a poll.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// What the thread sees of its owner's stop.
#[derive(Clone)]
pub(crate) struct StopSignal {
    flag: Arc<AtomicBool>,
    /// Disconnected on stop: wakes `sleep`.
    closed: Receiver<()>,
}

impl StopSignal {
    /// For work done on the caller's own thread: never stops.
    pub(crate) fn none() -> StopSignal {
        StopSignal {
            flag: Arc::new(AtomicBool::new(false)),
            closed: crossbeam_channel::never(),
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Sleeps for `d` or until the stop; true when the full time passed.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        !self.is_stopped() && matches!(self.closed.recv_timeout(d), Err(RecvTimeoutError::Timeout))
    }

    /// Waits for `future` up to `deadline`. `None`: the deadline passed, the
    /// owner stopped the thread, or `interrupt` turned true (the owner
    /// unparks the thread after changing what it reads).
    pub(crate) fn wait<F: Future>(
        &self,
        future: F,
        deadline: Instant,
        interrupt: impl Fn() -> bool,
    ) -> Option<F::Output> {
        block_on_while(future, deadline, || !self.is_stopped() && !interrupt())
    }
}

/// Owns one named thread.
pub(crate) struct Worker {
    name: &'static str,
    flag: Arc<AtomicBool>,
    close: Option<Sender<()>>,
    done: Receiver<()>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    pub(crate) fn spawn(
        name: &'static str,
        f: impl FnOnce(StopSignal) + Send + 'static,
    ) -> Result<Worker, EtcdError> {
        let flag = Arc::new(AtomicBool::new(false));
        let (close, closed) = crossbeam_channel::bounded(0);
        let (done_tx, done) = crossbeam_channel::bounded(1);
        let signal = StopSignal {
            flag: flag.clone(),
            closed,
        };
        let handle = spawn_named(
            name.to_string(),
            move || f(signal),
            move || {
                let _ = done_tx.send(());
            },
        )
        .map_err(|source| EtcdError::Spawn {
            thread: name,
            source,
        })?;
        Ok(Worker {
            name,
            flag,
            close: Some(close),
            done,
            handle: Some(handle),
        })
    }

    /// Wakes the thread out of a stream wait, so that it re-reads what its
    /// `interrupt` looks at.
    pub(crate) fn unpark(&self) {
        if let Some(h) = &self.handle {
            h.thread().unpark();
        }
    }

    /// Waits up to `timeout` for the thread to end by itself; true if it did.
    pub(crate) fn wait_done(&self, timeout: Duration) -> bool {
        match self.done.recv_timeout(timeout) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => true,
            Err(RecvTimeoutError::Timeout) => false,
        }
    }

    /// Stops the thread and joins it, up to `STOP_TIMEOUT`; a thread that
    /// does not end by then is named in the log and left detached.
    pub(crate) fn stop(&mut self) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        self.flag.store(true, Ordering::SeqCst);
        drop(self.close.take());
        handle.thread().unpark();
        if self.wait_done(STOP_TIMEOUT) {
            let _ = handle.join();
        } else {
            log::warn!(
                "thread {} did not stop within {STOP_TIMEOUT:?}; leaving it",
                self.name
            );
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_interrupts_a_stream_wait_and_a_sleep() {
        let (tx, rx) = crossbeam_channel::bounded(2);
        let mut w = Worker::spawn("test-worker", move |stop| {
            let waited = stop.wait(
                std::future::pending::<()>(),
                Instant::now() + Duration::from_secs(600),
                || false,
            );
            let _ = tx.send(waited.is_none());
            let _ = tx.send(stop.sleep(Duration::from_secs(600)));
        })
        .expect("spawn");
        let started = Instant::now();
        w.stop();
        assert!(started.elapsed() < STOP_TIMEOUT);
        assert_eq!(rx.recv().ok(), Some(true));
        assert_eq!(rx.recv().ok(), Some(false));
    }
}
