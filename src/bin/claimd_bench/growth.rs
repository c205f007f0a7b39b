//! What may grow with the number of allocations on record: the time and
//! bytes of one state change, `alloc status` (ListAllocs), a scrape of
//! `/metrics` over HTTP. Measured in the restart part, with N on record.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use claimd::api::{wire as w, ApiClient};
use serde_json::{json, Value};

use super::*;

/// A loopback address no one listens on now, for the agent's
/// `metrics_listen`.
pub fn free_metrics_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

/// GET /metrics over HTTP, the body's length.
fn scrape(addr: SocketAddr) -> usize {
    let mut s = TcpStream::connect(addr).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
        .expect("send the scrape");
    let mut body = Vec::new();
    s.read_to_end(&mut body).expect("read the scrape");
    assert!(body.starts_with(b"HTTP/1."), "not an HTTP answer");
    body.len()
}

/// Mount and release cycles whose agent's own part is taken the median of.
const OWN_RUNS: usize = 7;

/// The median of `n` timed runs of `f`.
fn median(n: usize, mut f: impl FnMut()) -> Duration {
    let mut v: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    v.sort();
    v[v.len() / 2]
}

/// The mean duration of the state writes between two scrapes of the
/// agent's metrics (`claimd_state_write_duration_seconds`), in milliseconds.
fn write_seconds(text: &str) -> (f64, f64) {
    let get = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        get("claimd_state_write_duration_seconds_sum"),
        get("claimd_state_write_duration_seconds_count"),
    )
}

/// Seconds the agent spent in CSI calls so far: the sum of every series of
/// `claimd_csi_operations_seconds` (one per plugin, operation and result).
fn csi_seconds(text: &str) -> f64 {
    let name = "claimd_csi_operations_seconds_sum";
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Appends `bytes` bytes to `path` and waits for them on disk (the size of
/// a mount's journal line): what a durable write costs on this disk at
/// this moment, without the agent. Answers its time in milliseconds.
fn bare_durable_append(path: &Path, bytes: usize) -> f64 {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open the fdatasync probe");
    let t = Instant::now();
    f.write_all(&vec![b'x'; bytes]).expect("write the probe");
    f.sync_data().expect("fdatasync the probe");
    t.elapsed().as_secs_f64() * 1000.0
}

/// Creates three nested new directories under `dir` (as a mount's
/// staging and target parents are), then removes them: what the
/// directories of a mount cost on this file system at this moment,
/// without the agent. Answers the creation's time in milliseconds.
fn bare_mkdirs(dir: &Path, i: usize) -> f64 {
    let top = dir.join(format!("mkdir-probe-{i}"));
    let deepest = top.join("alloc").join("volume");
    let t = Instant::now();
    std::fs::create_dir_all(&deepest).expect("create the probe's directories");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    std::fs::remove_dir_all(&top).expect("remove the probe's directories");
    ms
}

/// Measures, with `n` allocations on record: one mount and one release
/// of volume `shared` (their times, state bytes and mean write time), then
/// `alloc status` and a /metrics scrape (medians of 5). `dir` is on the
/// agent's disk: a bare durable write and three bare mkdirs there, just
/// before each timed mount, are what the agent's own wait for durability
/// and its directories are compared with.
pub fn growth(
    n: usize,
    dir: &Path,
    c: &ApiClient,
    metrics: SocketAddr,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let m0 = metrics_text(c);
    let b = stats(c);
    let t = Instant::now();
    mount(c, "growth-one", &["shared".to_string()]);
    let mount_time = t.elapsed();
    let mm = metrics_text(c);
    let m = stats(c);
    let t = Instant::now();
    release(c, "growth-one", Duration::from_secs(60));
    let release_time = t.elapsed();
    let e = stats(c);
    let m1 = metrics_text(c);
    let ((s0, c0), (s1, c1)) = (write_seconds(&m0), write_seconds(&m1));
    let writes = c1 - c0;
    let write_ms = if writes > 0.0 {
        (s1 - s0) * 1000.0 / writes
    } else {
        0.0
    };
    // How much of each the plugin took (its CSI calls, as the agent timed
    // them): the rest is the agent's own.
    let csi_mount_ms = (csi_seconds(&mm) - csi_seconds(&m0)) * 1000.0;
    let csi_release_ms = (csi_seconds(&m1) - csi_seconds(&mm)) * 1000.0;
    // The agent's own part of a mount and a release (not in CSI calls):
    // the median of a few more, each cycle timed alone.
    let (mut own_mount, mut own_release) = (Vec::new(), Vec::new());
    let (mut waits, mut bare_writes, mut own_less_wait) = (Vec::new(), Vec::new(), Vec::new());
    let (mut dirs, mut own_rest) = (Vec::new(), Vec::new());
    // The agent's CPU (user + system, its own getrusage, from GetStats)
    // per mount. Its system time includes the mount's mkdirs, so ext4's
    // state moves it too.
    let mut cpu = Vec::new();
    let probe = dir.join("fdatasync-probe");
    for run in 0..OWN_RUNS {
        bare_writes.push(bare_durable_append(&probe, 1600));
        let mkdirs = bare_mkdirs(dir, run);
        dirs.push(mkdirs);
        let a = stats(c);
        let t = Instant::now();
        mount(c, "growth-one", &["shared".to_string()]);
        let mount_ms = t.elapsed().as_secs_f64() * 1000.0;
        let b = stats(c);
        cpu.push((b.cpu_seconds - a.cpu_seconds) * 1000.0);
        let t = Instant::now();
        release(c, "growth-one", Duration::from_secs(60));
        let release_ms = t.elapsed().as_secs_f64() * 1000.0;
        let e = stats(c);
        let own = mount_ms - (b.csi_seconds - a.csi_seconds) * 1000.0;
        let wait = (b.commit_wait_seconds - a.commit_wait_seconds) * 1000.0;
        own_mount.push(own);
        waits.push(wait);
        own_less_wait.push(own - wait);
        own_rest.push(own - wait - mkdirs);
        own_release.push(release_ms - (e.csi_seconds - b.csi_seconds) * 1000.0);
    }
    let mid = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (own_mount, own_release) = (mid(&mut own_mount), mid(&mut own_release));
    let (wait, bare_write, own_less_wait) = (
        mid(&mut waits),
        mid(&mut bare_writes),
        mid(&mut own_less_wait),
    );
    let (bare_dirs, own_rest) = (mid(&mut dirs), mid(&mut own_rest));
    let cpu = mid(&mut cpu);
    let _ = std::fs::remove_file(&probe);
    let status = median(5, || {
        c.raw()
            .list_allocs(&w::ListAllocsRequest::new(), opt())
            .expect("list");
    });
    let mut scraped = 0;
    let scrape_time = median(5, || scraped = scrape(metrics));
    results.insert(
        format!("growth_{n}"),
        json!({
            "allocs_on_record": n,
            "mount_ms": mount_time.as_secs_f64() * 1000.0,
            "release_ms": release_time.as_secs_f64() * 1000.0,
            "bytes_per_mount": m.state_bytes_written - b.state_bytes_written,
            "bytes_per_release": e.state_bytes_written - m.state_bytes_written,
            "mean_state_write_ms": write_ms,
            "csi_ms_in_mount": csi_mount_ms,
            "csi_ms_in_release": csi_release_ms,
            "own_mount_ms_median": own_mount,
            "own_release_ms_median": own_release,
            "own_mount_wait_for_durability_ms_median": wait,
            "own_mount_less_wait_ms_median": own_less_wait,
            "bare_durable_append_ms_median": bare_write,
            "bare_mkdirs_ms_median": bare_dirs,
            "own_mount_less_wait_and_bare_mkdirs_ms_median": own_rest,
            "agent_cpu_per_mount_ms_median": cpu,
            "alloc_status_ms": status.as_secs_f64() * 1000.0,
            "metrics_scrape_ms": scrape_time.as_secs_f64() * 1000.0,
            "metrics_scrape_bytes": scraped,
        }),
    );
    table.push((
        format!(
            "with {n} on record: one mount / release (ms), state bytes of each, mean state write"
        ),
        format!(
            "{:.2} / {:.2} ms, {} / {} B, {:.3} ms",
            mount_time.as_secs_f64() * 1000.0,
            release_time.as_secs_f64() * 1000.0,
            m.state_bytes_written - b.state_bytes_written,
            e.state_bytes_written - m.state_bytes_written,
            write_ms
        ),
    ));
    table.push((
        format!("with {n} on record: of the mount / release, in CSI calls / the agent's own"),
        format!(
            "{:.2} / {:.2} ms, {:.2} / {:.2} ms",
            csi_mount_ms,
            csi_release_ms,
            mount_time.as_secs_f64() * 1000.0 - csi_mount_ms,
            release_time.as_secs_f64() * 1000.0 - csi_release_ms
        ),
    ));
    table.push((
        format!(
            "with {n} on record: the agent's own part of a mount / release, median of {OWN_RUNS}"
        ),
        format!("{own_mount:.2} / {own_release:.2} ms"),
    ));
    table.push((
        format!(
            "with {n} on record: of the agent's own part of a mount, its wait for durability / the rest / the rest less 3 bare mkdirs; beside it a bare 1.6 KiB append + fdatasync / 3 mkdirs, medians of {OWN_RUNS}"
        ),
        format!("{wait:.2} / {own_less_wait:.2} / {own_rest:.2} ms; {bare_write:.2} / {bare_dirs:.2} ms"),
    ));
    table.push((
        format!(
            "with {n} on record: the agent's CPU per mount (user + system), median of {OWN_RUNS}"
        ),
        format!("{cpu:.2} ms"),
    ));
    table.push((
        format!("with {n} on record: alloc status (ListAllocs) / GET /metrics, median of 5"),
        format!(
            "{:.1} / {:.1} ms ({:.0} KiB scraped)",
            status.as_secs_f64() * 1000.0,
            scrape_time.as_secs_f64() * 1000.0,
            scraped as f64 / 1024.0
        ),
    ));
}
