//! The per-volume operation lock: one operation in flight per volume.
//!
//! This is the one lock claimd holds across CSI calls (and the remote
//! claim-store round trip of a step). Every other lock is taken for a
//! memory access only. Waiting for it is bounded, and the map of locks
//! shrinks: a volume's entry goes when its last user lets go.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::lock_api::ArcMutexGuard;
use parking_lot::{Mutex, RawMutex};

/// The locks of every volume with an operation in flight or waiting.
#[derive(Default)]
pub struct OperationLocks {
    map: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

/// Held while one operation of a volume runs.
pub struct OperationLock<'a> {
    locks: &'a OperationLocks,
    volume_id: String,
    guard: Option<ArcMutexGuard<RawMutex, ()>>,
}

/// Another operation of the volume held its lock for longer than the wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockTimeout {
    pub volume_id: String,
    pub waited: Duration,
}

impl fmt::Display for LockTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "another operation of volume {} is still in flight after {:?}",
            self.volume_id, self.waited
        )
    }
}

impl std::error::Error for LockTimeout {}

impl OperationLocks {
    pub fn new() -> OperationLocks {
        OperationLocks::default()
    }

    fn entry(&self, volume_id: &str) -> Arc<Mutex<()>> {
        self.map
            .lock()
            .entry(volume_id.to_string())
            .or_default()
            .clone()
    }

    /// Waits up to `wait` for the volume's lock.
    pub fn lock(&self, volume_id: &str, wait: Duration) -> Result<OperationLock<'_>, LockTimeout> {
        let m = self.entry(volume_id);
        let guard = Mutex::try_lock_arc_for(&m, wait);
        drop(m);
        match guard {
            Some(g) => Ok(self.held(volume_id, g)),
            None => {
                self.forget_if_unused(volume_id);
                Err(LockTimeout {
                    volume_id: volume_id.to_string(),
                    waited: wait,
                })
            }
        }
    }

    /// The volume's lock when no operation holds it now.
    pub fn try_lock(&self, volume_id: &str) -> Option<OperationLock<'_>> {
        let m = self.entry(volume_id);
        let guard = Mutex::try_lock_arc(&m);
        drop(m);
        match guard {
            Some(g) => Some(self.held(volume_id, g)),
            None => {
                self.forget_if_unused(volume_id);
                None
            }
        }
    }

    fn held(&self, volume_id: &str, g: ArcMutexGuard<RawMutex, ()>) -> OperationLock<'_> {
        OperationLock {
            locks: self,
            volume_id: volume_id.to_string(),
            guard: Some(g),
        }
    }

    /// Drops the volume's entry when nobody holds or waits for it. Clones
    /// are made under the map's lock, so the count cannot grow meanwhile.
    fn forget_if_unused(&self, volume_id: &str) {
        let mut map = self.map.lock();
        if map
            .get(volume_id)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            map.remove(volume_id);
        }
    }

    /// Volumes with an entry (held or waited for).
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for OperationLock<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.locks.forget_if_unused(&self.volume_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_per_volume_others_proceed_and_the_map_shrinks() {
        let locks = OperationLocks::new();
        let a = locks.lock("a", Duration::from_millis(10)).expect("free");
        assert!(locks.try_lock("a").is_none(), "held");
        let e = locks
            .lock("a", Duration::from_millis(20))
            .err()
            .expect("the wait is bounded");
        assert!(e.to_string().contains("volume a"), "{e}");
        let b = locks.try_lock("b").expect("another volume is independent");
        assert_eq!(locks.len(), 2);
        drop(a);
        drop(b);
        assert!(locks.is_empty(), "entries of released volumes are gone");
    }

    #[test]
    fn a_waiter_gets_the_lock_when_the_holder_lets_go() {
        let locks = Arc::new(OperationLocks::new());
        let held = locks.lock("v", Duration::from_secs(1)).expect("free");
        let (tx, rx) = crossbeam_channel::bounded(1);
        let l2 = locks.clone();
        let t = std::thread::spawn(move || {
            tx.send(()).expect("send");
            let g = l2.lock("v", Duration::from_secs(10)).is_ok();
            g
        });
        rx.recv().expect("the waiter started");
        // The waiter holds an entry clone: the entry must survive our drop.
        drop(held);
        assert!(t.join().expect("join"), "the waiter got the lock");
        assert!(locks.is_empty());
    }
}
