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

/// `2024-05-01T12:00:00Z` for Unix time `secs` (civil-from-days, Howard
/// Hinnant's algorithm; no date crate for one column).
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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
