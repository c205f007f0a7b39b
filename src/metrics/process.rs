//! The process figures every Prometheus exporter shows, with the names
//! the Go and Python clients use: resident and virtual memory, CPU time,
//! open and maximum file descriptors, threads and start time. Read from
//! `/proc` at scrape time; a figure that cannot be read is left out.

use std::fs;

use super::text::{Kind, Text};

/// Fields of `/proc/self/stat` after the command name, zero-based from the
/// state field (field 3 of proc(5)).
struct Stat {
    utime_ticks: u64,
    stime_ticks: u64,
    threads: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

fn stat() -> Option<Stat> {
    let text = fs::read_to_string("/proc/self/stat").ok()?;
    // The command name is in parentheses and may hold spaces.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
    Some(Stat {
        utime_ticks: n(11)?,
        stime_ticks: n(12)?,
        threads: n(17)?,
        start_ticks: n(19)?,
        vsize: n(20)?,
        rss_pages: n(21)?,
    })
}

/// Boot time, seconds since the epoch (`btime` of `/proc/stat`).
fn boot_time() -> Option<u64> {
    fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn open_fds() -> Option<u64> {
    Some(fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

fn max_fds() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (r == 0).then_some(lim.rlim_cur)
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf only reads a configuration value.
    let v = unsafe { libc::sysconf(name) };
    (v > 0).then_some(v as u64)
}

/// User plus system CPU time of this process (every thread, ended ones
/// included), from getrusage(2).
pub fn cpu_seconds() -> Option<f64> {
    // SAFETY: getrusage writes into the struct it is given; all-zero is a
    // valid value of it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above, with a pointer to our own struct.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return None;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(secs(u.ru_utime) + secs(u.ru_stime))
}

/// Resident memory of this process, in bytes.
pub fn resident_memory_bytes() -> Option<u64> {
    Some(stat()?.rss_pages * sysconf(libc::_SC_PAGESIZE)?)
}

/// Writes the `process_*` families.
pub fn write(t: &mut Text) {
    let page = sysconf(libc::_SC_PAGESIZE);
    let ticks = sysconf(libc::_SC_CLK_TCK);
    let st = stat();
    if let (Some(s), Some(page)) = (&st, page) {
        t.single(
            "process_resident_memory_bytes",
            Kind::Gauge,
            "Resident memory size in bytes.",
            (s.rss_pages * page) as f64,
        );
        t.single(
            "process_virtual_memory_bytes",
            Kind::Gauge,
            "Virtual memory size in bytes.",
            s.vsize as f64,
        );
    }
    // getrusage(2) to the microsecond where /proc counts clock ticks
    // (10 ms): an operation's CPU time is a fraction of a tick.
    let cpu = cpu_seconds().or_else(|| {
        let (s, ticks) = (st.as_ref()?, ticks?);
        Some((s.utime_ticks + s.stime_ticks) as f64 / ticks as f64)
    });
    if let Some(cpu) = cpu {
        t.single(
            "process_cpu_seconds_total",
            Kind::Counter,
            "Total user and system CPU time spent in seconds.",
            cpu,
        );
    }
    if let (Some(s), Some(ticks)) = (&st, ticks) {
        if let Some(boot) = boot_time() {
            t.single(
                "process_start_time_seconds",
                Kind::Gauge,
                "Start time of the process since unix epoch in seconds.",
                boot as f64 + s.start_ticks as f64 / ticks as f64,
            );
        }
    }
    if let Some(s) = &st {
        t.single(
            "process_threads",
            Kind::Gauge,
            "Number of OS threads in the process.",
            s.threads as f64,
        );
    }
    if let Some(n) = open_fds() {
        t.single(
            "process_open_fds",
            Kind::Gauge,
            "Number of open file descriptors.",
            n as f64,
        );
    }
    if let Some(n) = max_fds() {
        t.single(
            "process_max_fds",
            Kind::Gauge,
            "Maximum number of open file descriptors.",
            n as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let mut t = Text::new();
        write(&mut t);
        let s = t.finish();
        for name in [
            "process_resident_memory_bytes ",
            "process_threads ",
            "process_open_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(s.contains(name), "{name} missing from {s}");
        }
        assert!(resident_memory_bytes().is_some_and(|b| b > 0));
    }
}
