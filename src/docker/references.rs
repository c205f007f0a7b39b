//! Who may decide about an engine mount's references at a time. A Mount
//! adding a reference, an Unmount dropping one (and releasing at the last)
//! and the engine-death rule releasing an unused mount each decide on the
//! allocation's recorded count and then act on it; they take the
//! allocation's turn first, so that a Mount can never add a reference to
//! an allocation whose release an Unmount or the rule has just decided.
//! The counts themselves are the lifecycle's (durable, in the allocation's
//! record); the rule's marks (unused at one check) live here, and a Mount
//! clears its allocation's mark. So do what keeps a mount from being a
//! candidate at all: when each allocation was last mounted (in memory: an
//! agent's restart counts as a Mount of every allocation), and how many
//! Mount requests are running.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The turns and marks of the engine mounts of one agent. Cheap to clone.
#[derive(Clone)]
pub struct Turns {
    inner: Arc<Inner>,
}

impl Default for Turns {
    fn default() -> Turns {
        Turns::new(true)
    }
}

struct Inner {
    /// Allocations a request (or the rule) is deciding about now.
    busy: Mutex<HashSet<String>>,
    ended: Condvar,
    /// Allocations the engine-death rule found unused at its last check.
    marks: Mutex<BTreeSet<String>>,
    /// When a Mount of each allocation last answered (this run).
    mounted_at: Mutex<HashMap<String, Instant>>,
    /// When this run began: the age of a mount no Mount of this run
    /// answered counts from here; None: such a mount is old (after a
    /// reboot, no container can hold it before a Mount).
    since: Option<Instant>,
    /// Mount requests running now: (request, volume, when it began).
    running: Mutex<Vec<(u64, String, Instant)>>,
    next: AtomicU64,
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

/// One running Mount request; counted until dropped.
pub struct Mounting {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for Mounting {
    fn drop(&mut self) {
        self.inner
            .running
            .lock()
            .retain(|(id, _, _)| *id != self.id);
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

    /// The turns of an agent whose mounts without a Mount this run count
    /// their age from now (`counts_from_start`), or are old at once.
    pub fn new(counts_from_start: bool) -> Turns {
        Turns {
            inner: Arc::new(Inner {
                busy: Mutex::default(),
                ended: Condvar::new(),
                marks: Mutex::default(),
                mounted_at: Mutex::default(),
                since: counts_from_start.then(Instant::now),
                running: Mutex::default(),
                next: AtomicU64::new(0),
            }),
        }
    }

    /// Counts a Mount request of `volume` as running until the answer is
    /// dropped.
    pub fn mounting(&self, volume: &str) -> Mounting {
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        self.inner
            .running
            .lock()
            .push((id, volume.to_string(), Instant::now()));
        Mounting {
            inner: self.inner.clone(),
            id,
        }
    }

    /// How many Mount requests are running.
    pub fn mounts_running(&self) -> usize {
        self.inner.running.lock().len()
    }

    /// A Mount of the allocation answered now: its mark goes, its age
    /// starts again.
    pub fn mounted(&self, alloc_id: &str) {
        self.unmark(alloc_id);
        self.inner
            .mounted_at
            .lock()
            .insert(alloc_id.to_string(), Instant::now());
    }

    /// Whether the engine-death rule must leave the allocation (of
    /// `volume`) alone for now, however unused: younger than `min_age`
    /// since its last Mount (or since this run began, when no Mount of
    /// this run answered), or mounted this run before a Mount of another
    /// volume that is still running (the engine mounts a container's
    /// volumes one after another and starts it after the last).
    pub fn protected(&self, alloc_id: &str, volume: &str, min_age: Duration) -> bool {
        let at = self.inner.mounted_at.lock().get(alloc_id).copied();
        match at {
            Some(at) => {
                at.elapsed() < min_age
                    || self
                        .inner
                        .running
                        .lock()
                        .iter()
                        .any(|(_, v, began)| v != volume && *began >= at)
            }
            None => self.inner.since.is_some_and(|s| s.elapsed() < min_age),
        }
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

    /// Keeps the marks (and Mount times) of these allocations only.
    pub fn retain_marks(&self, keep: impl Fn(&str) -> bool) {
        self.inner.marks.lock().retain(|a| keep(a));
    }

    /// Forgets the Mount times of allocations that are gone.
    pub fn retain_mounted(&self, keep: impl Fn(&str) -> bool) {
        self.inner.mounted_at.lock().retain(|a, _| keep(a));
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
        assert!(turns.mark("docker-a-db"));
        turns.mounted("docker-a-db");
        assert!(!turns.mark("docker-a-db"), "a Mount clears the mark");
    }

    #[test]
    fn a_mount_is_protected_while_young_or_while_a_later_mount_of_another_volume_runs() {
        let age = Duration::from_millis(30);
        let turns = Turns::new(true);
        assert!(
            turns.protected("docker-a-db", "db", age),
            "the run is young"
        );
        std::thread::sleep(age);
        assert!(!turns.protected("docker-a-db", "db", age));
        turns.mounted("docker-a-db");
        assert!(turns.protected("docker-a-db", "db", age), "just mounted");
        std::thread::sleep(age);
        assert!(!turns.protected("docker-a-db", "db", age));
        // The container's next volume is being mounted.
        let web = turns.mounting("web");
        let db = turns.mounting("db");
        assert_eq!(turns.mounts_running(), 2);
        assert!(turns.protected("docker-a-db", "db", age));
        drop(web);
        assert!(
            !turns.protected("docker-a-db", "db", age),
            "a Mount of its own volume waits for it, not the other way round"
        );
        drop(db);
        // A Mount that began before the allocation's last Mount is not
        // its container's next one.
        let early = turns.mounting("web");
        std::thread::sleep(Duration::from_millis(2));
        turns.mounted("docker-b-db");
        std::thread::sleep(age);
        assert!(!turns.protected("docker-b-db", "db", age));
        drop(early);
        turns.retain_mounted(|_| false);
        assert!(!turns.protected("docker-a-db", "db", age));
        // After a reboot, a mount no Mount took again is old at once.
        let rebooted = Turns::new(false);
        assert!(!rebooted.protected("docker-a-db", "db", Duration::from_secs(60)));
        assert_eq!(turns.mounts_running(), 0);
    }
}
