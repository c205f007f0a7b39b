//! Who may decide about an engine mount's references at a time. A Mount
//! adding a reference, an Unmount dropping one (and releasing at the last)
//! and the engine-death rule releasing an unused mount each decide on the
//! allocation's recorded count and then act on it; they take the
//! allocation's turn first, so that a Mount can never add a reference to
//! an allocation whose release an Unmount or the rule has just decided.
//! The counts themselves are the lifecycle's (durable, in the allocation's
//! record); the rule's marks (unused at one check) live here, and a Mount
//! clears its allocation's mark.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The turns and marks of the engine mounts of one agent. Cheap to clone.
#[derive(Clone, Default)]
pub struct Turns {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Allocations a request (or the rule) is deciding about now.
    busy: Mutex<HashSet<String>>,
    ended: Condvar,
    /// Allocations the engine-death rule found unused at its last check.
    marks: Mutex<BTreeSet<String>>,
}

/// An allocation's turn; ends on drop.
pub struct Turn {
    inner: Arc<Inner>,
    alloc_id: String,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.inner.busy.lock().remove(&self.alloc_id);
        self.inner.ended.notify_all();
    }
}

impl Turns {
    /// Waits for the allocation's turn, up to `wait`; None when another
    /// request still has it then.
    pub fn take(&self, alloc_id: &str, wait: Duration) -> Option<Turn> {
        let deadline = Instant::now() + wait;
        let mut busy = self.inner.busy.lock();
        while busy.contains(alloc_id) {
            if self.inner.ended.wait_until(&mut busy, deadline).timed_out()
                && busy.contains(alloc_id)
            {
                return None;
            }
        }
        busy.insert(alloc_id.to_string());
        Some(Turn {
            inner: self.inner.clone(),
            alloc_id: alloc_id.to_string(),
        })
    }

    /// The allocation's turn when nobody has it now.
    pub fn try_take(&self, alloc_id: &str) -> Option<Turn> {
        self.take(alloc_id, Duration::ZERO)
    }

    /// Forgets the rule's mark of the allocation (mounted again, in use,
    /// or released).
    pub fn unmark(&self, alloc_id: &str) {
        self.inner.marks.lock().remove(alloc_id);
    }

    /// Marks the allocation unused at this check; whether it was marked
    /// at the previous one already.
    pub fn mark(&self, alloc_id: &str) -> bool {
        !self.inner.marks.lock().insert(alloc_id.to_string())
    }

    /// Keeps the marks of these allocations only.
    pub fn retain_marks(&self, keep: impl Fn(&str) -> bool) {
        self.inner.marks.lock().retain(|a| keep(a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_turn_per_allocation_at_a_time() {
        let turns = Turns::default();
        let a = turns.try_take("docker-a-db").expect("free");
        assert!(turns.try_take("docker-a-db").is_none());
        assert!(
            turns
                .take("docker-a-db", Duration::from_millis(20))
                .is_none(),
            "waits, then gives up"
        );
        let b = turns.try_take("docker-b-db").expect("another allocation");
        let t = turns.clone();
        let waiter =
            std::thread::spawn(move || t.take("docker-a-db", Duration::from_secs(30)).is_some());
        drop(a);
        assert!(waiter.join().expect("joined"), "the turn passes on");
        drop(b);
    }

    #[test]
    fn a_mark_is_seen_at_the_next_check_unless_cleared() {
        let turns = Turns::default();
        assert!(!turns.mark("docker-a-db"));
        assert!(turns.mark("docker-a-db"));
        turns.unmark("docker-a-db");
        assert!(!turns.mark("docker-a-db"), "cleared: a fresh first mark");
        turns.retain_marks(|a| a != "docker-a-db");
        assert!(!turns.mark("docker-a-db"));
    }
}
