//! The process-wide stop signal: a channel that is closed on stop (every
//! `recv` on it wakes) plus a flag, plus wakers so condvar waiters elsewhere
//! re-check their predicate at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

type Waker = Box<dyn Fn() + Send + Sync>;

struct Inner {
    flag: AtomicBool,
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
    wakers: Mutex<Vec<Waker>>,
}

/// Cheap to clone; every clone sees the same stop.
#[derive(Clone)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        let (sender, receiver) = crossbeam_channel::bounded(0);
        Shutdown {
            inner: Arc::new(Inner {
                flag: AtomicBool::new(false),
                sender: Mutex::new(Some(sender)),
                receiver,
                wakers: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Starts the stop: sets the flag, closes the channel, runs the wakers.
    /// Idempotent.
    pub fn trigger(&self) {
        if self.inner.flag.swap(true, Ordering::SeqCst) {
            return;
        }
        drop(self.inner.sender.lock().take());
        let wakers = std::mem::take(&mut *self.inner.wakers.lock());
        for w in wakers {
            w();
        }
    }

    pub fn is_triggered(&self) -> bool {
        self.inner.flag.load(Ordering::SeqCst)
    }

    /// A receiver that becomes ready (disconnected) when the stop starts;
    /// for `select!`.
    pub fn receiver(&self) -> &Receiver<()> {
        &self.inner.receiver
    }

    /// Runs `waker` when the stop starts (at once if it already has).
    /// Condvar owners use it to `notify_all`.
    pub fn on_trigger(&self, waker: impl Fn() + Send + Sync + 'static) {
        let mut wakers = self.inner.wakers.lock();
        if self.is_triggered() {
            drop(wakers);
            waker();
        } else {
            wakers.push(Box::new(waker));
        }
    }

    /// Sleeps for `d` or until the stop; true when the full time passed.
    pub fn sleep(&self, d: Duration) -> bool {
        if self.is_triggered() {
            return false;
        }
        matches!(
            self.inner.receiver.recv_timeout(d),
            Err(RecvTimeoutError::Timeout)
        )
    }

    /// Sleeps until `deadline` or the stop; true when the deadline passed.
    pub fn sleep_until(&self, deadline: Instant) -> bool {
        self.sleep(deadline.saturating_duration_since(Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_wakes_sleepers_and_runs_wakers() {
        let s = Shutdown::new();
        let woke = Arc::new(AtomicBool::new(false));
        let w = woke.clone();
        s.on_trigger(move || w.store(true, Ordering::SeqCst));
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let started = Instant::now();
            let full = s2.sleep(Duration::from_secs(60));
            (full, started.elapsed())
        });
        // The sleeper may or may not have started sleeping yet: either way it
        // must return early once triggered.
        s.trigger();
        let (full, took) = t.join().expect("sleeper thread");
        assert!(!full);
        assert!(took < Duration::from_secs(30));
        assert!(woke.load(Ordering::SeqCst));
        assert!(s.is_triggered());
        // After the stop, sleeping returns at once and late wakers run at once.
        assert!(!s.sleep(Duration::from_secs(60)));
        let late = Arc::new(AtomicBool::new(false));
        let l = late.clone();
        s.on_trigger(move || l.store(true, Ordering::SeqCst));
        assert!(late.load(Ordering::SeqCst));
    }

    #[test]
    fn sleep_runs_full_time_without_trigger() {
        let s = Shutdown::new();
        assert!(s.sleep(Duration::from_millis(5)));
    }
}
