//! Exponential backoff with jitter, bounded by a deadline and cut short by
//! the stop signal.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::shutdown::Shutdown;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub initial: Duration,
    pub max: Duration,
}

impl BackoffPolicy {
    pub const fn new(initial: Duration, max: Duration) -> BackoffPolicy {
        BackoffPolicy { initial, max }
    }
}

/// Why a retry loop stopped waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interrupted {
    /// The deadline passed.
    Deadline,
    /// The agent is stopping.
    Shutdown,
}

/// One retry loop's state.
pub struct Backoff {
    policy: BackoffPolicy,
    next: Duration,
    deadline: Instant,
    attempts: u32,
}

impl Backoff {
    pub fn new(policy: BackoffPolicy, deadline: Instant) -> Backoff {
        Backoff {
            policy,
            next: policy.initial,
            deadline,
            attempts: 0,
        }
    }

    /// Delays only, for a loop that retries until the agent stops: use
    /// `next_delay` with `Shutdown::sleep`. It has no deadline, so `wait`
    /// on it ends at once (`Interrupted::Deadline`).
    pub fn delays(policy: BackoffPolicy) -> Backoff {
        Backoff::new(policy, Instant::now())
    }

    /// Starts over (a step went through): the next wait is the initial
    /// one again, so one step's failures never lengthen the next step's
    /// first retry. The deadline stays.
    pub fn reset(&mut self) {
        self.next = self.policy.initial;
        self.attempts = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The next delay: the current step with ±25 % jitter, then doubles the
    /// step up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.policy.max);
        self.attempts += 1;
        jitter(base)
    }

    /// Like `wait`, with `sleep(delay)` doing the waiting: it may end early
    /// (something the caller waits for changed) and returns false when the
    /// agent stops.
    pub fn wait_with(
        &mut self,
        shutdown: &Shutdown,
        sleep: &mut dyn FnMut(Duration) -> bool,
    ) -> Result<(), Interrupted> {
        if shutdown.is_triggered() {
            return Err(Interrupted::Shutdown);
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Err(Interrupted::Deadline);
        }
        let delay = self.next_delay().min(self.deadline - now);
        if sleep(delay) {
            Ok(())
        } else {
            Err(Interrupted::Shutdown)
        }
    }

    /// Waits for the next attempt. Fails when the deadline would pass first
    /// or the agent stops.
    pub fn wait(&mut self, shutdown: &Shutdown) -> Result<(), Interrupted> {
        if shutdown.is_triggered() {
            return Err(Interrupted::Shutdown);
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Err(Interrupted::Deadline);
        }
        let delay = self.next_delay().min(self.deadline - now);
        if shutdown.sleep(delay) {
            Ok(())
        } else {
            Err(Interrupted::Shutdown)
        }
    }
}

/// ±25 % jitter from a cheap per-call source (no RNG crate needed: the
/// point is only to spread retries of many workers apart).
fn jitter(d: Duration) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    let mut x = u64::from(nanos) ^ thread_salt();
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let frac = (x % 1000) as f64 / 1000.0; // 0..1
    d.mul_f64(0.75 + 0.5 * frac)
}

fn thread_salt() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::thread::current().id().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_cap_with_bounded_jitter() {
        let p = BackoffPolicy::new(Duration::from_millis(100), Duration::from_millis(800));
        let mut b = Backoff::new(p, Instant::now() + Duration::from_secs(3600));
        let steps = [100u64, 200, 400, 800, 800, 800];
        for base in steps {
            let d = b.next_delay();
            let base = Duration::from_millis(base);
            assert!(
                d >= base.mul_f64(0.75) && d <= base.mul_f64(1.25),
                "{d:?} vs {base:?}"
            );
        }
        assert_eq!(b.attempts(), 6);
    }

    #[test]
    fn wait_stops_at_deadline_and_on_shutdown() {
        let p = BackoffPolicy::new(Duration::from_millis(1), Duration::from_millis(2));
        let s = Shutdown::new();
        let mut b = Backoff::new(p, Instant::now());
        assert_eq!(b.wait(&s), Err(Interrupted::Deadline));
        let mut b = Backoff::new(p, Instant::now() + Duration::from_secs(60));
        assert_eq!(b.wait(&s), Ok(()));
        s.trigger();
        assert_eq!(b.wait(&s), Err(Interrupted::Shutdown));
    }
}
