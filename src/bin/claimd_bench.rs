//! `claimd-bench`: measures the agent against bare CSI calls to the same
//! test plugin in the same run, restart recovery, release fan-out, memory
//! and state-file cost. Prints a table and writes JSON. Not shipped.
//!
//! Run through `packaging/bench.sh` (release build, real mounts, as root).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::{wire as w, ApiClient};
use claimd::csi::{self, CsiClient};
use grpcio::CallOption;
use serde_json::{json, Value};

const CALL: Duration = Duration::from_secs(60);

fn opt() -> CallOption {
    CallOption::default().timeout(CALL)
}

struct Args {
    agent: PathBuf,
    plugin: PathBuf,
    out: PathBuf,
    n: usize,
    restart_n: usize,
    fanout: usize,
    fanout_delay_ms: u64,
    concurrency: usize,
    only: Vec<String>,
}

const SECTIONS: &[&str] = &["overhead", "restart", "fanout"];

impl Args {
    fn runs(&self, section: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == section)
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        agent: PathBuf::new(),
        plugin: PathBuf::new(),
        out: PathBuf::from("target/bench/results.json"),
        n: 200,
        restart_n: 1000,
        fanout: 100,
        fanout_delay_ms: 20,
        concurrency: 16,
        only: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--agent" => a.agent = PathBuf::from(val()?),
            "--plugin" => a.plugin = PathBuf::from(val()?),
            "--out" => a.out = PathBuf::from(val()?),
            "--n" => a.n = val()?.parse().map_err(|e| format!("--n: {e}"))?,
            "--restart-n" => {
                a.restart_n = val()?.parse().map_err(|e| format!("--restart-n: {e}"))?
            }
            "--fanout" => a.fanout = val()?.parse().map_err(|e| format!("--fanout: {e}"))?,
            "--concurrency" => {
                a.concurrency = val()?.parse().map_err(|e| format!("--concurrency: {e}"))?
            }
            "--fanout-delay-ms" => {
                a.fanout_delay_ms = val()?
                    .parse()
                    .map_err(|e| format!("--fanout-delay-ms: {e}"))?
            }
            "--only" => {
                for section in val()?.split(',') {
                    if !SECTIONS.contains(&section) {
                        return Err(format!(
                            "--only: unknown section {section:?} (sections: {})",
                            SECTIONS.join(",")
                        ));
                    }
                    a.only.push(section.to_string());
                }
            }
            "-h" | "--help" => {
                println!(
                    "claimd-bench --agent PATH --plugin PATH [--out FILE] [--n 200] [--restart-n 1000] [--fanout 100] [--fanout-delay-ms 20 (0: skip)] [--concurrency 16] [--only {}]",
                    SECTIONS.join(",")
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.agent.as_os_str().is_empty() || a.plugin.as_os_str().is_empty() {
        return Err("--agent and --plugin are required".into());
    }
    if a.fanout < 2 {
        return Err("--fanout must be at least 2 (one hung volume and the others)".into());
    }
    Ok(a)
}

/// A scratch directory whose mounts are lazily unmounted on drop.
struct Scratch {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("claimd-bench-{}", std::process::id()));
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

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

struct Setup {
    plugin_socket: PathBuf,
    call_log: PathBuf,
    faults: PathBuf,
    config: PathBuf,
    api_socket: PathBuf,
    mount_root: PathBuf,
}

fn start_plugin(args: &Args, s: &mut Scratch) -> Setup {
    let p = s.dir.join("plugin");
    std::fs::create_dir_all(&p).expect("plugin dir");
    let setup = Setup {
        plugin_socket: p.join("csi.sock"),
        call_log: p.join("calls.jsonl"),
        faults: p.join("faults.json"),
        config: s.dir.join("config.json"),
        api_socket: s.dir.join("api.sock"),
        mount_root: s.dir.join("mounts"),
    };
    let child = Command::new(&args.plugin)
        .arg("--endpoint")
        .arg(&setup.plugin_socket)
        .arg("--root")
        .arg(p.join("root"))
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
    let cfg = json!({
        "state_dir": s.dir.join("state"), "api_socket": setup.api_socket,
        "mount_root": setup.mount_root,
        "plugins": [{"id": "hp", "type": "monolith", "socket": setup.plugin_socket}],
        "csi_call_timeout": "5s", "probe_interval": "30s",
    });
    std::fs::write(&setup.config, cfg.to_string()).expect("write config");
    setup
}

struct Agent {
    child: Child,
}

impl Agent {
    fn start(args: &Args, setup: &Setup) -> (Agent, Instant) {
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

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(self) {
        drop(self);
    }

    fn stop(mut self) {
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

fn api(setup: &Setup, env: &Arc<grpcio::Environment>) -> ApiClient {
    wait_for("the API socket", Duration::from_secs(600), || {
        std::os::unix::net::UnixStream::connect(&setup.api_socket).is_ok()
    });
    ApiClient::new(env.clone(), &setup.api_socket)
}

fn register(c: &ApiClient, id: &str, mode: &str) {
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

fn mount(c: &ApiClient, alloc: &str, vols: &[String]) {
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

fn release(c: &ApiClient, alloc: &str, wait: Duration) -> w::ReleaseAllocResponse {
    let mut r = w::ReleaseAllocRequest::new();
    r.alloc_id = alloc.to_string();
    r.wait_ms = wait.as_millis() as u64;
    c.raw()
        .release_alloc(&r, CallOption::default().timeout(wait + CALL))
        .expect("release")
}

fn stats(c: &ApiClient) -> w::GetStatsResponse {
    c.raw()
        .get_stats(&w::GetStatsRequest::new(), opt())
        .expect("stats")
}

fn volume_calls(log: &Path) -> BTreeMap<String, usize> {
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

fn proc_status(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn mean_ms(v: &[Duration]) -> f64 {
    v.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1000.0 / v.len().max(1) as f64
}

fn rss_and_peak(pid: u32) -> (u64, u64) {
    (proc_status(pid, "VmRSS:"), proc_status(pid, "VmHWM:"))
}

fn mib_pair(a_kib: u64, b_kib: u64) -> String {
    format!(
        "{:.1} / {:.1} MiB",
        a_kib as f64 / 1024.0,
        b_kib as f64 / 1024.0
    )
}

/// What the agent's state store did between two GetStats answers, per
/// operation: the store's own counters (fsync and fdatasync calls,
/// snapshot rewrites), not estimates.
struct StateCost {
    writes: f64,
    bytes: f64,
    fsyncs: f64,
    snapshots: f64,
}

impl StateCost {
    fn between(a: &w::GetStatsResponse, b: &w::GetStatsResponse, ops: usize) -> StateCost {
        let per = |x: u64, y: u64| y.saturating_sub(x) as f64 / ops.max(1) as f64;
        StateCost {
            writes: per(a.state_writes, b.state_writes),
            bytes: per(a.state_bytes_written, b.state_bytes_written),
            fsyncs: per(a.state_fsyncs, b.state_fsyncs),
            snapshots: per(a.state_snapshots, b.state_snapshots),
        }
    }

    fn json(&self) -> Value {
        json!({"state_writes": self.writes, "state_bytes": self.bytes,
               "state_fsyncs": self.fsyncs, "state_snapshots": self.snapshots})
    }

    fn row(&self) -> String {
        format!(
            "{:.2} / {:.1} KiB / {:.2}",
            self.writes,
            self.bytes / 1024.0,
            self.snapshots
        )
    }
}

/// The bare client: exactly the calls the agent makes for one volume, with
/// the same paths in them (the agent's layout, `claimd::volumes::Paths`,
/// under its own root), so the directories it creates and removes are the
/// same too.
struct Bare {
    client: CsiClient,
    node_id: String,
    root: PathBuf,
}

impl Bare {
    fn usage() -> claimd::volumes::Usage {
        use claimd::volumes::{AccessMode, AttachmentMode, Usage};
        Usage {
            read_only: false,
            attachment: AttachmentMode::FileSystem,
            access_mode: AccessMode::SingleNodeWriter,
        }
    }

    fn cap() -> csi::VolumeCapability {
        use claimd::volumes::{volume_capability, MountOptions};
        volume_capability(&Self::usage(), &MountOptions::default(), &[])
    }

    fn layout(&self) -> claimd::volumes::Paths {
        claimd::volumes::Paths::new(&self.root)
    }

    fn paths(&self, id: &str) -> (PathBuf, PathBuf) {
        let (p, u) = (self.layout(), Self::usage());
        (p.staging("hp", id, &u), p.target(id, id, &u))
    }

    fn mount(&self, id: &str) {
        let (staging, target) = self.paths(id);
        let mut cp = csi::ControllerPublishVolumeRequest::new();
        cp.volume_id = format!("ext-{id}");
        cp.node_id = self.node_id.clone();
        cp.volume_capability = protobuf::MessageField::some(Self::cap());
        let ctx = self
            .client
            .controller_publish_volume(&cp)
            .expect("bare publish");
        std::fs::create_dir_all(&staging).expect("mkdir staging");
        let mut st = csi::NodeStageVolumeRequest::new();
        st.volume_id = format!("ext-{id}");
        st.staging_target_path = staging.to_string_lossy().into_owned();
        st.publish_context = ctx.clone().into_iter().collect();
        st.volume_capability = protobuf::MessageField::some(Self::cap());
        self.client.node_stage_volume(&st).expect("bare stage");
        std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir parent");
        let mut p = csi::NodePublishVolumeRequest::new();
        p.volume_id = format!("ext-{id}");
        p.staging_target_path = st.staging_target_path.clone();
        p.target_path = target.to_string_lossy().into_owned();
        p.publish_context = ctx.into_iter().collect();
        p.volume_capability = protobuf::MessageField::some(Self::cap());
        self.client.node_publish_volume(&p).expect("bare publish");
    }

    fn release(&self, id: &str) {
        let (staging, target) = self.paths(id);
        let mut u = csi::NodeUnpublishVolumeRequest::new();
        u.volume_id = format!("ext-{id}");
        u.target_path = target.to_string_lossy().into_owned();
        self.client
            .node_unpublish_volume(&u)
            .expect("bare unpublish");
        let mut us = csi::NodeUnstageVolumeRequest::new();
        us.volume_id = format!("ext-{id}");
        us.staging_target_path = staging.to_string_lossy().into_owned();
        self.client.node_unstage_volume(&us).expect("bare unstage");
        let mut cu = csi::ControllerUnpublishVolumeRequest::new();
        cu.volume_id = format!("ext-{id}");
        cu.node_id = self.node_id.clone();
        self.client
            .controller_unpublish_volume(&cu)
            .expect("bare detach");
        // As the agent: the target (the plugin may have removed it), the
        // staging path, then their empty parents.
        let layout = self.layout();
        let _ = std::fs::remove_dir(&target);
        layout.remove_empty_parents(&target);
        let _ = std::fs::remove_dir(&staging);
        layout.remove_empty_parents(&staging);
    }
}

/// Runs `f(i)` for i in 0..n on `threads` threads; returns each latency and
/// the wall time.
fn run_parallel(n: usize, threads: usize, f: impl Fn(usize) + Sync) -> (Vec<Duration>, Duration) {
    let started = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let lat = parking_lot::Mutex::new(Vec::with_capacity(n));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let t = Instant::now();
                f(i);
                lat.lock().push(t.elapsed());
            });
        }
    });
    (lat.into_inner(), started.elapsed())
}

/// The CSI calls of a release.
const TEARDOWN: &[&str] = &[
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
];

/// How often the fan-out poll asks the agent which volumes are released.
const FANOUT_POLL: Duration = Duration::from_millis(2);

/// Fault rules: `hang_volume`'s NodeUnpublish hangs (the first matching rule
/// applies), and with `delay` every teardown call sleeps that long first.
fn fanout_faults(delay: Option<Duration>, hang_volume: Option<&str>) -> Value {
    let mut rules = Vec::new();
    if let Some(v) = hang_volume {
        rules.push(json!({"method": "NodeUnpublishVolume", "volume_id": v, "action": "hang"}));
    }
    if let Some(d) = delay {
        for m in TEARDOWN {
            rules.push(json!({"method": m, "action": "delay", "ms": d.as_millis() as u64}));
        }
    }
    json!({ "rules": rules })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Release fan-out: one allocation with `args.fanout` volumes, one of which
/// hangs in NodeUnpublish; the time until the others are released, against
/// one volume released alone, and against a bare client releasing the same
/// number at once. With `delay`, every teardown call of the plugin sleeps
/// that long first (in all three measurements).
fn fanout(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    delay: Option<Duration>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    const ALONE_RUNS: usize = 5;
    let mut s = Scratch::new();
    let setup = start_plugin(args, &mut s);
    let (agent, _) = Agent::start(args, &setup);
    let c = api(&setup, env);
    let write_faults = |hang: Option<&str>| {
        std::fs::write(&setup.faults, fanout_faults(delay, hang).to_string())
            .expect("write the fault file");
    };
    write_faults(None);

    // One volume alone, agent and bare client: the median of a few.
    let mut alone = Vec::new();
    for i in 0..ALONE_RUNS {
        let (v, a) = (format!("solo{i}"), format!("solo-a{i}"));
        register(&c, &v, "single-node-writer");
        mount(&c, &a, std::slice::from_ref(&v));
        let t = Instant::now();
        let r = release(&c, &a, Duration::from_secs(60));
        assert!(r.done, "release of one volume did not finish");
        alone.push(t.elapsed());
    }
    let one = median(alone);
    let bare = Bare {
        client: CsiClient::new(env.clone(), &setup.plugin_socket, CALL),
        node_id: CsiClient::new(env.clone(), &setup.plugin_socket, CALL)
            .node_get_info()
            .expect("node info")
            .node_id,
        root: s.dir.join("bare"),
    };
    let mut bare_alone = Vec::new();
    for i in 0..ALONE_RUNS {
        let id = format!("bsolo{i}");
        bare.mount(&id);
        let t = Instant::now();
        bare.release(&id);
        bare_alone.push(t.elapsed());
    }
    let bare_one = median(bare_alone);

    // The agent: one allocation, one volume hangs.
    let vols: Vec<String> = (0..args.fanout).map(|i| format!("f{i}")).collect();
    for v in &vols {
        register(&c, v, "single-node-writer");
    }
    mount(&c, "fan", &vols);
    write_faults(Some("ext-f0"));
    let log_lines_before = std::fs::read_to_string(&setup.call_log)
        .map(|t| t.lines().count())
        .unwrap_or(0);
    let stats_before = stats(&c);
    let t = Instant::now();
    release(&c, "fan", Duration::ZERO);
    let mut req = w::GetAllocRequest::new();
    req.alloc_id = "fan".into();
    let others = loop {
        let released = c
            .raw()
            .get_alloc(&req, opt())
            .expect("get alloc")
            .alloc
            .volumes
            .iter()
            .filter(|v| v.release_state == "released")
            .count();
        if released == args.fanout - 1 {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the other volumes were not released within 300 s ({released} were)"
        );
        std::thread::sleep(FANOUT_POLL);
    };
    let fan_state = StateCost::between(&stats_before, &stats(&c), 1);
    let plugin_side = teardown_window(&setup.call_log, log_lines_before);

    // The bare client: the same number of releases, all at once.
    let ids: Vec<String> = (1..args.fanout).map(|i| format!("bf{i}")).collect();
    run_parallel(ids.len(), args.concurrency, |i| bare.mount(&ids[i]));
    let (_, bare_others) = run_parallel(ids.len(), ids.len(), |i| bare.release(&ids[i]));
    let peak = proc_status(agent.pid(), "VmHWM:");
    let _ = std::fs::remove_file(&setup.faults);
    agent.kill();

    let n = args.fanout - 1;
    let (key, what) = match delay {
        None => (
            "release_fanout".to_string(),
            "no injected delay".to_string(),
        ),
        Some(d) => (
            format!("release_fanout_teardown_delay_{}ms", d.as_millis()),
            format!("every teardown call delayed {} ms", d.as_millis()),
        ),
    };
    let secs = |d: Duration| d.as_secs_f64();
    results.insert(
        key,
        json!({
            "what": format!(
                "one allocation of {} volumes, NodeUnpublish of one hangs; {what}",
                args.fanout
            ),
            "teardown_delay_ms": delay.map(|d| d.as_millis() as u64),
            "volumes": args.fanout,
            "seconds_others_released": secs(others),
            "poll_interval_ms": FANOUT_POLL.as_millis() as u64,
            "seconds_one_volume_alone": secs(one),
            "one_volume_alone_runs": ALONE_RUNS,
            "ratio": secs(others) / secs(one),
            "bare_seconds_others_released": secs(bare_others),
            "bare_seconds_one_volume_alone": secs(bare_one),
            "bare_ratio": secs(bare_others) / secs(bare_one),
            "ratio_to_bare": secs(others) / secs(bare_others),
            "plugin_call_log": plugin_side,
            "agent_state_during_release": fan_state.json(),
            "agent_peak_rss_kib": peak,
        }),
    );
    table.push((
        format!(
            "fan-out ({what}): one volume released alone, agent / bare (median of {ALONE_RUNS})"
        ),
        format!("{:.3} s / {:.3} s", secs(one), secs(bare_one)),
    ));
    table.push((
        format!(
            "fan-out ({what}): {n} others of {} with one hung, agent",
            args.fanout
        ),
        format!(
            "{:.3} s = {:.1}x one alone",
            secs(others),
            secs(others) / secs(one)
        ),
    ));
    table.push((
        format!("fan-out ({what}): the same {n} by a bare client, all at once"),
        format!(
            "{:.3} s = {:.1}x bare one alone; agent / bare = {:.2}x",
            secs(bare_others),
            secs(bare_others) / secs(bare_one),
            secs(others) / secs(bare_others)
        ),
    ));
}

/// From the plugin's call log (lines after `skip`): how many teardown calls
/// it answered and the span between the first and the last answer.
fn teardown_window(log: &Path, skip: usize) -> Value {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut first = u64::MAX;
    let mut last = 0u64;
    let mut calls = BTreeMap::<String, usize>::new();
    for line in text.lines().skip(skip) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(method), Some(ts)) = (v["method"].as_str(), v["ts_ms"].as_u64()) else {
            continue;
        };
        if TEARDOWN.contains(&method) {
            *calls.entry(method.to_string()).or_default() += 1;
            first = first.min(ts);
            last = last.max(ts);
        }
    }
    json!({
        "teardown_calls_answered": calls,
        "ms_first_to_last_answer": last.checked_sub(first),
    })
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("claimd-bench: {e}");
            std::process::exit(2);
        }
    };
    let env = claimd::csi::grpc_environment("bench-grpc");
    let mut results = serde_json::Map::new();
    let mut table: Vec<(String, String)> = Vec::new();

    // ---- 1. mount and release overhead, and 4. idle footprint -------------
    if args.runs("overhead") {
        let mut s = Scratch::new();
        let setup = start_plugin(&args, &mut s);
        let (agent, _) = Agent::start(&args, &setup);
        let c = api(&setup, &env);
        wait_for("the plugin to be ready", Duration::from_secs(30), || {
            c.raw()
                .list_plugins(&w::ListPluginsRequest::new(), opt())
                .is_ok_and(|r| r.plugins.iter().any(|p| p.health == "ready"))
        });
        // Idle footprint with nothing recorded.
        let (rss0, peak0) = rss_and_peak(agent.pid());
        let threads0 = proc_status(agent.pid(), "Threads:");
        results.insert("idle_rss_kib_0_allocs".into(), json!(rss0));
        results.insert("idle_peak_rss_kib_0_allocs".into(), json!(peak0));
        results.insert("idle_threads".into(), json!(threads0));
        table.push((
            "idle RSS / peak RSS (VmHWM), 0 allocations".into(),
            mib_pair(rss0, peak0),
        ));
        table.push(("threads at idle".into(), threads0.to_string()));

        let bare = Bare {
            client: CsiClient::new(env.clone(), &setup.plugin_socket, CALL),
            node_id: CsiClient::new(env.clone(), &setup.plugin_socket, CALL)
                .node_get_info()
                .expect("node info")
                .node_id,
            root: s.dir.join("bare"),
        };
        for i in 0..args.n {
            register(&c, &format!("v{i}"), "single-node-writer");
        }
        for (label, threads) in [("sequential", 1usize), ("concurrent", args.concurrency)] {
            // ABBA: the agent, then the bare client, on the first half of
            // the volumes; the bare client, then the agent, on the second.
            // The file system's history (ext4 inode allocation gets dearer
            // as directories are created and deleted) and the machine's
            // drift then weigh on both sides alike.
            let half = args.n / 2;
            let rounds = [(0, half, true), (half, args.n, false)];
            let (mut mount_lat, mut rel_lat, mut bare_mount, mut bare_rel) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut mount_wall, mut rel_wall, mut bare_mount_wall, mut bare_rel_wall) = (
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
                Duration::ZERO,
            );
            let zero = w::GetStatsResponse::new();
            let (mut mount_stats, mut rel_stats) = (zero.clone(), zero.clone());
            let add = |acc: &mut w::GetStatsResponse,
                       a: &w::GetStatsResponse,
                       b: &w::GetStatsResponse| {
                acc.state_writes += b.state_writes - a.state_writes;
                acc.state_bytes_written += b.state_bytes_written - a.state_bytes_written;
                acc.state_fsyncs += b.state_fsyncs - a.state_fsyncs;
                acc.state_snapshots += b.state_snapshots - a.state_snapshots;
            };
            for (from, to, agent_first) in rounds {
                let count = to - from;
                for agent_side in [agent_first, !agent_first] {
                    if agent_side {
                        let before = stats(&c);
                        let (lat, wall) = run_parallel(count, threads, |i| {
                            let i = from + i;
                            mount(&c, &format!("{label}-a{i}"), &[format!("v{i}")])
                        });
                        mount_lat.extend(lat);
                        mount_wall += wall;
                        let mid = stats(&c);
                        let (lat, wall) = run_parallel(count, threads, |i| {
                            let i = from + i;
                            let r = release(&c, &format!("{label}-a{i}"), Duration::from_secs(60));
                            assert!(r.done, "release did not finish");
                        });
                        rel_lat.extend(lat);
                        rel_wall += wall;
                        let after = stats(&c);
                        add(&mut mount_stats, &before, &mid);
                        add(&mut rel_stats, &mid, &after);
                    } else {
                        let (lat, wall) = run_parallel(count, threads, |i| {
                            bare.mount(&format!("{label}-b{}", from + i))
                        });
                        bare_mount.extend(lat);
                        bare_mount_wall += wall;
                        let (lat, wall) = run_parallel(count, threads, |i| {
                            bare.release(&format!("{label}-b{}", from + i))
                        });
                        bare_rel.extend(lat);
                        bare_rel_wall += wall;
                    }
                }
            }
            let (am, bm, ar, br) = (
                mean_ms(&mount_lat),
                mean_ms(&bare_mount),
                mean_ms(&rel_lat),
                mean_ms(&bare_rel),
            );
            let mount_cost = StateCost::between(&zero, &mount_stats, args.n);
            let release_cost = StateCost::between(&zero, &rel_stats, args.n);
            results.insert(
                format!("{label}_mount_release"),
                json!({
                    "threads": threads, "volumes": args.n,
                    "agent_mount_ms_mean": am, "bare_mount_ms_mean": bm, "mount_ratio": am / bm,
                    "agent_release_ms_mean": ar, "bare_release_ms_mean": br, "release_ratio": ar / br,
                    "agent_mount_wall_s": mount_wall.as_secs_f64(), "bare_mount_wall_s": bare_mount_wall.as_secs_f64(),
                    "agent_release_wall_s": rel_wall.as_secs_f64(), "bare_release_wall_s": bare_rel_wall.as_secs_f64(),
                    "state_per_mount": mount_cost.json(),
                    "state_per_release": release_cost.json(),
                }),
            );
            table.push((
                format!("{label} ({threads} at a time): mount, agent vs bare"),
                format!("{am:.2} ms vs {bm:.2} ms = {:.2}x", am / bm),
            ));
            table.push((
                format!("{label}: release, agent vs bare"),
                format!("{ar:.2} ms vs {br:.2} ms = {:.2}x", ar / br),
            ));
            table.push((
                format!("{label}: wall time for {} mounts, agent vs bare", args.n),
                format!(
                    "{:.2} s vs {:.2} s = {:.2}x",
                    mount_wall.as_secs_f64(),
                    bare_mount_wall.as_secs_f64(),
                    mount_wall.as_secs_f64() / bare_mount_wall.as_secs_f64()
                ),
            ));
            table.push((
                format!("{label}: state fsyncs per mount / per release (GetStats)"),
                format!("{:.2} / {:.2}", mount_cost.fsyncs, release_cost.fsyncs),
            ));
            table.push((
                format!("{label}: state writes / KiB / snapshots per mount"),
                mount_cost.row(),
            ));
            table.push((
                format!("{label}: state writes / KiB / snapshots per release"),
                release_cost.row(),
            ));
        }
        let (rss, peak) = rss_and_peak(agent.pid());
        results.insert(
            "rss_kib_after_overhead".into(),
            json!({"rss": rss, "peak": peak}),
        );
        table.push((
            format!(
                "RSS / peak RSS (VmHWM) after {} mounts and releases x2",
                args.n
            ),
            mib_pair(rss, peak),
        ));
        agent.stop();
    }

    // ---- 2. restart recovery, 4. footprint with many, 5. write cost -------
    if args.runs("restart") {
        let mut s = Scratch::new();
        let setup = start_plugin(&args, &mut s);
        let (agent, _) = Agent::start(&args, &setup);
        let c = api(&setup, &env);
        register(&c, "shared", "multi-node-multi-writer");
        for i in 0..args.restart_n {
            register(&c, &format!("r{i}"), "single-node-writer");
        }
        run_parallel(args.restart_n, args.concurrency, |i| {
            mount(&c, &format!("r-a{i}"), &[format!("r{i}")])
        });
        let (rss_n, peak) = rss_and_peak(agent.pid());
        // Write cost of one more mount and release with N on record.
        let b = stats(&c);
        mount(&c, "one-more", &["shared".to_string()]);
        let m = stats(&c);
        release(&c, "one-more", Duration::from_secs(60));
        let e = stats(&c);
        results.insert(
            "state_cost_with_n_on_record".into(),
            json!({
                "allocs_on_record": args.restart_n,
                "writes_per_mount": m.state_writes - b.state_writes,
                "bytes_per_mount": m.state_bytes_written - b.state_bytes_written,
                "writes_per_release": e.state_writes - m.state_writes,
                "bytes_per_release": e.state_bytes_written - m.state_bytes_written,
                "per_mount": StateCost::between(&b, &m, 1).json(),
                "per_release": StateCost::between(&m, &e, 1).json(),
            }),
        );
        table.push((
            format!(
                "state writes / KiB / snapshots per mount with {} on record",
                args.restart_n
            ),
            StateCost::between(&b, &m, 1).row(),
        ));
        table.push((
            format!(
                "state fsyncs per mount / per release with {} on record (GetStats)",
                args.restart_n
            ),
            format!(
                "{} / {}",
                m.state_fsyncs - b.state_fsyncs,
                e.state_fsyncs - m.state_fsyncs
            ),
        ));
        results.insert("rss_kib_n_allocs".into(), json!(rss_n));
        results.insert("peak_rss_kib_n_allocs".into(), json!(peak));
        table.push((
            format!("RSS / peak RSS (VmHWM) with {} allocations", args.restart_n),
            mib_pair(rss_n, peak),
        ));
        // 100 concurrent mounts: writes per mount.
        for i in 0..100 {
            register(&c, &format!("c{i}"), "single-node-writer");
        }
        let b = stats(&c);
        run_parallel(100, 100, |i| {
            mount(&c, &format!("c-a{i}"), &[format!("c{i}")])
        });
        let e = stats(&c);
        let cost = StateCost::between(&b, &e, 100);
        results.insert("writes_per_mount_100_concurrent".into(), json!(cost.writes));
        results.insert("state_per_mount_100_concurrent".into(), cost.json());
        table.push((
            "state writes / KiB / snapshots per mount, 100 concurrent".into(),
            cost.row(),
        ));
        table.push((
            "state fsyncs per mount, 100 concurrent (GetStats)".into(),
            format!("{:.2}", cost.fsyncs),
        ));
        run_parallel(100, 16, |i| {
            release(&c, &format!("c-a{i}"), Duration::from_secs(60));
        });

        let calls_before = volume_calls(&setup.call_log);
        agent.kill();
        let (agent, started) = Agent::start(&args, &setup);
        let c = api(&setup, &env);
        let allocs = c
            .raw()
            .list_allocs(&w::ListAllocsRequest::new(), opt())
            .expect("list");
        let recovered = started.elapsed();
        let published = allocs
            .allocs
            .iter()
            .filter(|a| a.volumes.iter().all(|v| v.phase == "published"))
            .count();
        assert_eq!(published, args.restart_n, "not every allocation came back");
        let calls_after = volume_calls(&setup.call_log);
        let new_calls: usize =
            calls_after.values().sum::<usize>() - calls_before.values().sum::<usize>();
        results.insert(
            "restart_recovery".into(),
            json!({"allocs": args.restart_n, "seconds_to_all_reported_mounted": recovered.as_secs_f64(),
                   "csi_volume_calls": new_calls}),
        );
        table.push((
            format!(
                "restart after SIGKILL with {} mounted: time to all reported",
                args.restart_n
            ),
            format!(
                "{:.3} s, {new_calls} CSI volume calls",
                recovered.as_secs_f64()
            ),
        ));
        let (rss_restart, peak_restart) = rss_and_peak(agent.pid());
        results.insert(
            "idle_rss_kib_n_allocs_after_restart".into(),
            json!(rss_restart),
        );
        results.insert(
            "peak_rss_kib_n_allocs_after_restart".into(),
            json!(peak_restart),
        );
        table.push((
            format!(
                "idle RSS / peak RSS (VmHWM) after restart with {} allocations",
                args.restart_n
            ),
            mib_pair(rss_restart, peak_restart),
        ));
        run_parallel(args.restart_n, args.concurrency, |i| {
            release(&c, &format!("r-a{i}"), Duration::from_secs(60));
        });
        agent.stop();
    }

    // ---- 3. release fan-out with one hung volume ---------------------------
    if args.runs("fanout") {
        // As the plugin comes: teardown as fast as its syscalls and fsyncs.
        fanout(&args, &env, None, &mut results, &mut table);
        // Every teardown call delayed: what is left is the agent's
        // parallelism, not the plugin's throughput.
        if args.fanout_delay_ms > 0 {
            fanout(
                &args,
                &env,
                Some(Duration::from_millis(args.fanout_delay_ms)),
                &mut results,
                &mut table,
            );
        }
    }

    let size = std::fs::metadata(&args.agent).map(|m| m.len()).unwrap_or(0);
    results.insert("binary_bytes".into(), json!(size));
    table.push((
        "agent binary size (as given to --agent; bench.sh gives the stripped static build)".into(),
        format!("{:.1} MiB", size as f64 / 1048576.0),
    ));

    let width = table.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in &table {
        println!("{k:<width$}  {v}");
    }
    if let Some(dir) = args.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&Value::Object(results)).expect("json"),
    )
    .expect("write results");
    println!("results written to {}", args.out.display());
}
