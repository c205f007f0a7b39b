//! What every section of the bench uses: scratch directories, the test
//! plugin and the agent as child processes, API helpers, /proc figures and
//! the state store's write counters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::{wire as w, ApiClient};
use grpcio::CallOption;
use serde_json::{json, Value};

use super::*;

/// A scratch directory whose mounts are lazily unmounted on drop.
pub struct Scratch {
    pub dir: PathBuf,
    pub children: Vec<Child>,
}

static SCRATCH_ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Where `Scratch::new` makes its directory (`--scratch`); set once, at
/// the start.
pub fn set_scratch_root(dir: &Path) {
    let _ = SCRATCH_ROOT.set(dir.to_path_buf());
}

/// The file system holding `dir`, as the table prints it: type, source
/// and, for ext4, whether it has a journal (a jbd2 directory named after
/// the kernel's name of its device, found through the mount's
/// major:minor). ext4 without a journal makes `mkdir` slow for minutes
/// after mass deletions (see the performance manual's Method).
pub fn file_system_of(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let table = match std::fs::read("/proc/self/mountinfo") {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => return format!("unknown (/proc/self/mountinfo: {e})"),
    };
    // The longest mount point that holds `dir`; of two on the same point,
    // the later (the one on top).
    let mut best: Option<(PathBuf, String, String, String)> = None;
    for line in table.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(dev), Some(point), Some(fstype), Some(source)) = (
            fields.get(2),
            fields.get(4),
            fields.get(sep + 1),
            fields.get(sep + 2),
        ) else {
            continue;
        };
        let point = claimd::mounts::unescape(point);
        let longer = match &best {
            None => true,
            Some((p, _, _, _)) => point.as_os_str().len() >= p.as_os_str().len(),
        };
        if dir.starts_with(&point) && longer {
            best = Some((
                point,
                dev.to_string(),
                fstype.to_string(),
                claimd::mounts::unescape(source).display().to_string(),
            ));
        }
    }
    let Some((point, dev, fstype, source)) = best else {
        return "unknown (no mount holds it)".into();
    };
    let journal = if fstype == "ext4" {
        match ext4_journal(&dev) {
            Some(true) => ", with a journal",
            Some(false) => {
                ", WITHOUT a journal (mkdir slows for minutes after deletions: compare ratios from one run only)"
            }
            None => ", journal unknown",
        }
    } else {
        ""
    };
    format!("{fstype} on {source} at {}{journal}", point.display())
}

/// Whether the ext4 on block device `major:minor` has a journal: jbd2
/// lists each journal it runs as `<kernel device name>-<inode>`. None when
/// the device's name or jbd2's list cannot be read.
fn ext4_journal(major_minor: &str) -> Option<bool> {
    let link = std::fs::read_link(format!("/sys/dev/block/{major_minor}")).ok()?;
    let name = link.file_name()?.to_string_lossy().into_owned();
    let journals = std::fs::read_dir("/proc/fs/jbd2").ok()?;
    let prefix = format!("{name}-");
    Some(journals.flatten().any(|j| {
        j.file_name()
            .to_str()
            .and_then(|n| n.strip_prefix(prefix.as_str()))
            .is_some_and(|rest| rest.bytes().all(|c| c.is_ascii_digit()))
    }))
}

impl Scratch {
    pub fn new() -> Scratch {
        let root = SCRATCH_ROOT
            .get()
            .cloned()
            .unwrap_or_else(std::env::temp_dir);
        let dir = root.join(format!("claimd-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch {
            dir,
            children: Vec::new(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut left: Vec<PathBuf> = claimd::mounts::mounts()
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(&self.dir))
            .collect();
        left.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
        for p in left {
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub struct Setup {
    pub plugin_socket: PathBuf,
    /// The test plugin's `--root`: its volumes are `<root>/volumes/<id>`.
    pub plugin_root: PathBuf,
    pub call_log: PathBuf,
    pub faults: PathBuf,
    pub config: PathBuf,
    pub api_socket: PathBuf,
    pub mount_root: PathBuf,
}

pub fn start_plugin(args: &Args, s: &mut Scratch) -> Setup {
    let dir = s.dir.clone();
    start_plugin_in(args, s, &dir, &[], json!({}))
}

/// The test plugin under `<dir>/plugin`, started with `plugin_args` as
/// well, and an agent configuration under `dir` with the top-level fields
/// of `extra` (a node name, a `cluster` section) added.
pub fn start_plugin_in(
    args: &Args,
    s: &mut Scratch,
    dir: &Path,
    plugin_args: &[&str],
    extra: Value,
) -> Setup {
    let p = dir.join("plugin");
    std::fs::create_dir_all(&p).expect("plugin dir");
    let setup = Setup {
        plugin_socket: p.join("csi.sock"),
        plugin_root: p.join("root"),
        call_log: p.join("calls.jsonl"),
        faults: p.join("faults.json"),
        config: dir.join("config.json"),
        api_socket: dir.join("api.sock"),
        mount_root: dir.join("mounts"),
    };
    let child = Command::new(&args.plugin)
        .args(plugin_args)
        .arg("--endpoint")
        .arg(&setup.plugin_socket)
        .arg("--root")
        .arg(&setup.plugin_root)
        .arg("--call-log")
        .arg(&setup.call_log)
        .arg("--faults")
        .arg(&setup.faults)
        .stderr(Stdio::null())
        .spawn()
        .expect("start the test plugin");
    s.children.push(child);
    wait_for("the plugin socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&setup.plugin_socket).is_ok()
    });
    let mut cfg = json!({
        "state_dir": dir.join("state"), "api_socket": setup.api_socket,
        "mount_root": setup.mount_root,
        "plugins": [{"id": "hp", "type": "monolith", "socket": setup.plugin_socket}],
        "csi_call_timeout": "5s", "probe_interval": "30s",
    });
    if let (Some(cfg), Value::Object(extra)) = (cfg.as_object_mut(), extra) {
        cfg.extend(extra);
    }
    std::fs::write(&setup.config, cfg.to_string()).expect("write config");
    setup
}

pub struct Agent {
    pub child: Child,
}

impl Agent {
    pub fn start(args: &Args, setup: &Setup) -> (Agent, Instant) {
        let started = Instant::now();
        let child = Command::new(&args.agent)
            .arg("agent")
            .arg("--config")
            .arg(&setup.config)
            .env("RUST_LOG", "warn")
            .stderr(Stdio::null())
            .spawn()
            .expect("start the agent");
        (Agent { child }, started)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(self) {
        drop(self);
    }

    pub fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A no-op after `stop` (the child is reaped); SIGKILL otherwise.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn api(setup: &Setup, env: &Arc<grpcio::Environment>) -> ApiClient {
    wait_for("the API socket", Duration::from_secs(600), || {
        std::os::unix::net::UnixStream::connect(&setup.api_socket).is_ok()
    });
    ApiClient::new(env.clone(), &setup.api_socket)
}

/// Creates volume `ext-<id>` in the test plugin's storage (it refuses
/// volume IDs it does not know), as an administrator would before
/// registering it; outside every timed section.
pub fn create_volume(setup: &Setup, id: &str) {
    let dir = setup.plugin_root.join("volumes").join(format!("ext-{id}"));
    std::fs::create_dir_all(&dir).expect("create the volume in the plugin's storage");
}

/// Creates (`create_volume`) and registers volume `id`.
pub fn register(c: &ApiClient, setup: &Setup, id: &str, mode: &str) {
    create_volume(setup, id);
    let mut v = w::Volume::new();
    v.id = id.to_string();
    v.plugin_id = "hp".into();
    v.external_id = format!("ext-{id}");
    v.access_modes = vec![mode.to_string()];
    v.attachment_modes = vec!["file-system".into()];
    let mut r = w::RegisterVolumeRequest::new();
    r.volume = protobuf::MessageField::some(v);
    c.raw().register_volume(&r, opt()).expect("register");
}

pub fn mount(c: &ApiClient, alloc: &str, vols: &[String]) {
    let mut r = w::MountAllocRequest::new();
    r.alloc_id = alloc.to_string();
    r.volumes = vols
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let mut q = w::VolumeRequest::new();
            q.alias = format!("d{i}");
            q.volume_id = v.clone();
            q
        })
        .collect();
    c.raw().mount_alloc(&r, opt()).expect("mount");
}

pub fn release(c: &ApiClient, alloc: &str, wait: Duration) -> w::ReleaseAllocResponse {
    let mut r = w::ReleaseAllocRequest::new();
    r.alloc_id = alloc.to_string();
    r.wait_ms = wait.as_millis() as u64;
    c.raw()
        .release_alloc(&r, CallOption::default().timeout(wait + CALL))
        .expect("release")
}

/// The agent's metrics in Prometheus text (what `claimd metrics` prints).
pub fn metrics_text(c: &ApiClient) -> String {
    c.raw()
        .get_metrics(&w::GetMetricsRequest::new(), opt())
        .expect("metrics")
        .text
}

/// The store's counters once the closing writes of what was answered are
/// on disk (they follow within milliseconds), so each operation's writes
/// count in its own window.
pub fn stats(c: &ApiClient) -> w::GetStatsResponse {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let s = c
            .raw()
            .get_stats(&w::GetStatsRequest::new(), opt())
            .expect("stats");
        if s.state_undurable_changes == 0 {
            return s;
        }
        assert!(Instant::now() < end, "closing state writes never settled");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn volume_calls(log: &Path) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        if let Ok(v) = serde_json::from_str::<Value>(line) {
            if let Some(method) = v["method"].as_str() {
                if method.ends_with("Volume") {
                    *m.entry(method.to_string()).or_default() += 1;
                }
            }
        }
    }
    m
}

pub fn proc_status(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub fn mean_ms(v: &[Duration]) -> f64 {
    v.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1000.0 / v.len().max(1) as f64
}

pub fn rss_and_peak(pid: u32) -> (u64, u64) {
    (proc_status(pid, "VmRSS:"), proc_status(pid, "VmHWM:"))
}

/// Waits (up to `limit`) until no thread of `pid` serves an API request
/// (named `api-…`; an answer's thread gives the heap it freed back when
/// the agent goes idle) and, with `pooled_too`, until no release runs
/// (`release-…`) and no pooled thread waits for its next job either
/// (`pool-idle`: they end `claimd::threads::POOL_IDLE_KEEP` after their
/// last job, and their stacks with them). False when one still ran at the
/// limit.
pub fn wait_agent_idle(pid: u32, pooled_too: bool, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let busy_name = |comm: &str| {
        comm.starts_with("api-")
            || (pooled_too
                && (comm.starts_with("release-") || comm == claimd::threads::POOL_IDLE_NAME))
    };
    loop {
        let busy = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks.flatten().any(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| busy_name(c.trim_end()))
                })
            })
            .unwrap_or(false);
        if !busy {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn mib_pair(a_kib: u64, b_kib: u64) -> String {
    format!(
        "{:.1} / {:.1} MiB",
        a_kib as f64 / 1024.0,
        b_kib as f64 / 1024.0
    )
}

/// What the agent's state store did between two GetStats answers, per
/// operation: the store's own counters (fsync and fdatasync calls,
/// snapshot rewrites), not estimates.
pub struct StateCost {
    pub writes: f64,
    pub bytes: f64,
    pub fsyncs: f64,
    pub snapshots: f64,
}

impl StateCost {
    pub fn between(a: &w::GetStatsResponse, b: &w::GetStatsResponse, ops: usize) -> StateCost {
        let per = |x: u64, y: u64| y.saturating_sub(x) as f64 / ops.max(1) as f64;
        StateCost {
            writes: per(a.state_writes, b.state_writes),
            bytes: per(a.state_bytes_written, b.state_bytes_written),
            fsyncs: per(a.state_fsyncs, b.state_fsyncs),
            snapshots: per(a.state_snapshots, b.state_snapshots),
        }
    }

    pub fn json(&self) -> Value {
        json!({"state_writes": self.writes, "state_bytes": self.bytes,
               "state_fsyncs": self.fsyncs, "state_snapshots": self.snapshots})
    }

    pub fn row(&self) -> String {
        format!(
            "{:.2} / {:.1} KiB / {:.2}",
            self.writes,
            self.bytes / 1024.0,
            self.snapshots
        )
    }
}
