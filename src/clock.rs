//! CLOCK_BOOTTIME: a monotonic clock that keeps counting while the machine
//! is suspended (Rust's `Instant` is CLOCK_MONOTONIC on Linux, which stops
//! then). Lease ages and the persisted disconnect deadline are measured on
//! it: a node that slept through its lease must not think it still holds it.

use std::time::Duration;

/// Time since boot, suspend included.
pub fn boottime() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists on
    // every Linux this runs on (since 2.6.39).
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_BOOTTIME) cannot fail on Linux");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boottime_moves_forward() {
        let a = boottime();
        let b = boottime();
        assert!(b >= a);
        assert!(a > Duration::ZERO);
    }
}
