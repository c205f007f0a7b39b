//! The scale part (issue 24): N agent processes in cluster mode against one
//! throwaway etcd on this machine, for each N of `--scale-n` (default
//! 1,10,25,50). Every agent has its own state directory, API socket, mount
//! root and test plugin process (`--no-controller`, node ID `ext-<name>`),
//! and `stop_after_disconnect` set (the disconnect rule's threads run);
//! otherwise the agents' defaults.
//!
//! 1. Idle: once every agent holds its lease, its `nodes/` key is in etcd
//!    and a warm-up is done, etcd's own counters (`/metrics`:
//!    `grpc_server_started_total`, `grpc_server_msg_received_total`, both
//!    by method, and `etcd_network_client_grpc_{sent,received}_bytes_total`)
//!    and every agent's `claimd_etcd_request_duration_seconds_count` are
//!    read before and after a fixed window, as rates in total and per agent.
//! 2. Resident memory (VmRSS) of every agent, its plugin and etcd.
//! 3. Load: a fixed number of mounts, spread round robin over the agents
//!    (each agent mounts its own volumes), a fixed number at a time over
//!    the whole cluster, then their releases; latency as the client sees
//!    it, and etcd calls per mount and per release from the agents'
//!    counters and from etcd's.
//!
//! Every process is started with a parent-death signal, and a panic hook
//! and a signal handler kill this process's children and lazily unmount
//! everything under the scratch directory: the release build aborts on a
//! panic, so no destructor would run. Every wait is bounded.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::{wire as w, ApiClient};
use claimd::etcd::{EtcdClient, EtcdOptions};
use grpcio::CallOption;
use serde_json::{json, Value};

use super::cluster_support::*;
use super::*;

mod etcd_metrics;
mod guard;
mod output;

use etcd_metrics::{EtcdDelta, EtcdScrape};

/// The idle measurement window (the figures used 30 s).
const IDLE_WINDOW: Duration = Duration::from_secs(30);
/// Mounts (and as many releases) of the load, whatever N.
const LOAD_OPS: usize = 200;
/// Mounts or releases in flight at once over the whole cluster.
const LOAD_WORKERS: usize = 8;
/// Agents started at once (each batch is ready before the next starts).
const START_BATCH: usize = 5;
/// The agents' `cluster.stop_after_disconnect`.
const STOP_AFTER_DISCONNECT: &str = "30s";
/// Until an agent's API answers, its plugin is ready and its lease held.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Until every agent's `nodes/` key is in etcd.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline of each readiness probe and of a read of etcd's metrics.
const PROBE_CALL: Duration = Duration::from_secs(5);
/// How often readiness is polled.
const POLL: Duration = Duration::from_millis(50);

/// The growth figures of one N, for the summary.
struct Row {
    n: usize,
    etcd_msgs: f64,
    etcd_started: f64,
    sent: f64,
    received: f64,
    agent_calls: f64,
    rss_mean_kib: f64,
    rss_max_kib: u64,
    mount: (f64, f64),
    release: (f64, f64),
    per_mount: f64,
    per_release: f64,
}

pub fn scale(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    guard::install_cleanup();
    let mut runs = Vec::new();
    let mut rows = Vec::new();
    for &n in &args.scale_n {
        eprintln!("scale: {n} agents");
        let (run, row) = one(args, env, n, table);
        runs.push(run);
        rows.push(row);
    }
    let growth = output::summary(&rows, table);
    results.insert(
        "scale".into(),
        json!({
            "what": format!(
                "N agents (own state, API socket, mount root and test plugin each) in cluster mode on one throwaway etcd; idle window {} s; load {LOAD_OPS} mounts then {LOAD_OPS} releases, round robin over the agents, {LOAD_WORKERS} at a time in all",
                IDLE_WINDOW.as_secs()
            ),
            "agent_settings": {"stop_after_disconnect": STOP_AFTER_DISCONNECT,
                               "lease_ttl": "15s (default)", "call_timeout": "5s (default)",
                               "csi_call_timeout": "5s", "probe_interval": "30s"},
            "runs": runs,
            "growth": growth,
        }),
    );
}

/// One N: start, settle, warm up, idle window, memory, load; everything
/// stopped and unmounted on return.
fn one(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    n: usize,
    table: &mut Vec<(String, String)>,
) -> (Value, Row) {
    let mut s = Scratch::new();
    guard::watch(&s.dir);
    let load_before = load_average();
    let endpoint = start_etcd(args, &mut s);
    let etcd_pid = s.children.last().map_or(0, Child::id);
    let started = Instant::now();
    let (nodes, plugin_pids) = start_nodes(args, env, &mut s, n, &endpoint);
    settle(&endpoint, n);
    let start_s = started.elapsed().as_secs_f64();
    eprintln!("scale: {n} agents ready in {start_s:.1} s");

    // The load's volumes, and a warm-up (first connections, first calls).
    let node = |k: usize| &nodes[k % n];
    let vol = |k: usize| format!("{}-v{}", node(k).name, k / n);
    let alloc = |k: usize| format!("{}-a{}", node(k).name, k / n);
    run_parallel(LOAD_OPS, LOAD_WORKERS, |k| {
        node(k).register(&vol(k), "single-node-writer")
    });
    run_parallel(n, LOAD_WORKERS, |j| nodes[j].warm_up());

    let idle = idle(&nodes, &endpoint);
    let rss = memory(&nodes, &plugin_pids, etcd_pid);
    eprintln!(
        "scale: {n} agents idle: etcd {:.1} msgs/s, {:.0} B/s sent",
        idle.etcd.msgs_per_s(),
        idle.etcd.sent_per_s()
    );

    // Load: every mount, then every release.
    let c0: Vec<Counters> = nodes.iter().map(Node::calls).collect();
    let e0 = EtcdScrape::read(&endpoint);
    let (mounts, mount_wall) = run_parallel(LOAD_OPS, LOAD_WORKERS, |k| {
        node(k).mount(&alloc(k), &vol(k))
    });
    let e1 = EtcdScrape::read(&endpoint);
    let c1: Vec<Counters> = nodes.iter().map(Node::calls).collect();
    let e2 = EtcdScrape::read(&endpoint);
    let (releases, release_wall) =
        run_parallel(LOAD_OPS, LOAD_WORKERS, |k| node(k).release(&alloc(k)));
    for node in &nodes {
        node.wait_marks();
    }
    let e3 = EtcdScrape::read(&endpoint);
    let c2: Vec<Counters> = nodes.iter().map(Node::calls).collect();
    let rss_after = memory(&nodes, &plugin_pids, etcd_pid);
    let made = |a: &[Counters], b: &[Counters]| {
        let mut sum = Counters::default();
        for (i, node) in nodes.iter().enumerate() {
            sum.add(&node.made(&a[i], &b[i]));
        }
        sum
    };
    let (mount_calls, release_calls) = (made(&c0, &c1), made(&c1, &c2));
    let (etcd_mounts, etcd_releases) = (e0.delta(&e1), e2.delta(&e3));
    // What the idle agents would have made in the same time anyway.
    let background = |wall: Duration| idle.agent_calls_per_s * wall.as_secs_f64();
    let net = |c: &Counters, wall: Duration| (c.total() - background(wall)) / LOAD_OPS as f64;
    let lat = |v: &[Duration]| {
        json!({"p50_ms": quantile_ms(v, 0.5), "p99_ms": quantile_ms(v, 0.99),
               "max_ms": quantile_ms(v, 1.0), "mean_ms": mean_ms(v), "n": v.len()})
    };
    let load = json!({
        "ops": LOAD_OPS, "at_a_time": LOAD_WORKERS,
        "mount": lat(&mounts), "release": lat(&releases),
        "mount_wall_s": mount_wall.as_secs_f64(), "release_wall_s": release_wall.as_secs_f64(),
        "agent_calls_per_mount": mount_calls.per_op(LOAD_OPS),
        "agent_calls_per_release": release_calls.per_op(LOAD_OPS),
        "agent_calls_per_mount_less_idle_background": net(&mount_calls, mount_wall),
        "agent_calls_per_release_less_idle_background": net(&release_calls, release_wall),
        "etcd_per_mount": etcd_mounts.per_op(LOAD_OPS),
        "etcd_per_release": etcd_releases.per_op(LOAD_OPS),
    });
    let row = Row {
        n,
        etcd_msgs: idle.etcd.msgs_per_s() / n as f64,
        etcd_started: idle.etcd.started_per_s() / n as f64,
        sent: idle.etcd.sent_per_s() / n as f64,
        received: idle.etcd.received_per_s() / n as f64,
        agent_calls: idle.agent_calls_per_s / n as f64,
        rss_mean_kib: rss.agent_mean,
        rss_max_kib: rss.agent_max,
        mount: (quantile_ms(&mounts, 0.5), quantile_ms(&mounts, 0.99)),
        release: (quantile_ms(&releases, 0.5), quantile_ms(&releases, 0.99)),
        per_mount: mount_calls.total() / LOAD_OPS as f64,
        per_release: release_calls.total() / LOAD_OPS as f64,
    };
    drop(nodes);
    drop(s);
    let load_after = load_average();
    output::rows_of(&row, &idle, &rss, &mount_calls, &release_calls, table);
    let run = json!({
        "n": n, "seconds_to_all_ready": start_s,
        "idle": idle.json(n), "rss_kib_idle": rss.json(), "rss_kib_after_load": rss_after.json(),
        "load": load,
        "conditions": {"load_average_before": load_before, "load_average_after": load_after,
                       "cpus": std::thread::available_parallelism().map_or(0, |c| c.get())},
    });
    (run, row)
}

// ---- Starting N agents ---------------------------------------------------------

/// An agent and its plugin started, not yet known to be ready.
struct Pending {
    name: String,
    setup: Setup,
    agent: Agent,
    dir: PathBuf,
}

/// N nodes `s1`..`sN`, START_BATCH at a time; the plugins' PIDs alongside.
fn start_nodes(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    s: &mut Scratch,
    n: usize,
    endpoint: &str,
) -> (Vec<Node>, Vec<u32>) {
    let (mut nodes, mut plugins) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let names: Vec<String> = (1..=n).map(|i| format!("s{i}")).collect();
    for batch in names.chunks(START_BATCH) {
        // Spawned from this (the main) thread: the parent-death signal is
        // tied to the thread that forks.
        let mut pending: Vec<Pending> = batch
            .iter()
            .map(|name| {
                let (p, plugin) = spawn_node(args, s, name, endpoint);
                plugins.push(plugin);
                p
            })
            .collect();
        let apis: Vec<ApiClient> = std::thread::scope(|sc| {
            let handles: Vec<_> = pending
                .iter_mut()
                .map(|p| sc.spawn(move || ready(env, p)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a readiness wait"))
                .collect()
        });
        for (p, api) in pending.into_iter().zip(apis) {
            let mut node = Node {
                name: p.name,
                setup: p.setup,
                agent: p.agent,
                api,
                cluster: true,
                scrape: Counters::default(),
            };
            node.scrape = scrape_cost(&node);
            nodes.push(node);
        }
    }
    (nodes, plugins)
}

/// The etcd calls one metrics read makes: the smallest of three
/// back-to-back differences (a background call may fall into one).
fn scrape_cost(node: &Node) -> Counters {
    let mut best: Option<Counters> = None;
    let mut last = node.calls();
    for _ in 0..3 {
        let next = node.calls();
        let d = next.minus(&last);
        if best.as_ref().map_or(true, |b| d.total() < b.total()) {
            best = Some(d);
        }
        last = next;
    }
    best.unwrap_or_default()
}

/// Starts `cmd` so that it gets SIGKILL when this thread ends (the bench
/// exiting, aborting or being killed).
fn spawn_tied(cmd: &mut Command, what: &str) -> Child {
    // SAFETY: getpid is async-signal-safe; read before the fork.
    let parent = unsafe { libc::getpid() };
    // SAFETY: only async-signal-safe calls (prctl, getppid) run between
    // fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the bench already exited"));
            }
            Ok(())
        });
    }
    cmd.spawn()
        .unwrap_or_else(|e| panic!("scale: start {what}: {e}"))
}

/// The test plugin (no controller, node ID `ext-<name>`) and the agent
/// under `<scratch>/<name>/`, as `start_plugin_in` lays them out, with a
/// log file each.
fn spawn_node(args: &Args, s: &mut Scratch, name: &str, endpoint: &str) -> (Pending, u32) {
    let dir = s.dir.join(name);
    let p = dir.join("plugin");
    std::fs::create_dir_all(&p).expect("create the plugin directory");
    let setup = Setup {
        plugin_socket: p.join("csi.sock"),
        plugin_root: p.join("root"),
        call_log: p.join("calls.jsonl"),
        faults: p.join("faults.json"),
        config: dir.join("config.json"),
        api_socket: dir.join("api.sock"),
        mount_root: dir.join("mounts"),
    };
    let log = |file: &str| std::fs::File::create(dir.join(file)).expect("create a log file");
    let plugin = spawn_tied(
        Command::new(&args.plugin)
            .args(["--no-controller", "--node-id", &format!("ext-{name}")])
            .arg("--endpoint")
            .arg(&setup.plugin_socket)
            .arg("--root")
            .arg(&setup.plugin_root)
            .arg("--call-log")
            .arg(&setup.call_log)
            .arg("--faults")
            .arg(&setup.faults)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log("plugin.log")),
        &format!("the test plugin of {name}"),
    );
    let plugin_pid = plugin.id();
    s.children.push(plugin);
    let cfg = json!({
        "node_name": name,
        "state_dir": dir.join("state"), "api_socket": setup.api_socket,
        "mount_root": setup.mount_root,
        "plugins": [{"id": "hp", "type": "monolith", "socket": setup.plugin_socket}],
        "csi_call_timeout": "5s", "probe_interval": "30s",
        "cluster": {"endpoints": [endpoint], "prefix": PREFIX,
                    "stop_after_disconnect": STOP_AFTER_DISCONNECT},
    });
    std::fs::write(&setup.config, cfg.to_string()).expect("write the agent's config");
    let child = spawn_tied(
        Command::new(&args.agent)
            .arg("agent")
            .arg("--config")
            .arg(&setup.config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log("agent.log")),
        &format!("agent {name}"),
    );
    let pending = Pending {
        name: name.to_string(),
        setup,
        agent: Agent { child },
        dir,
    };
    (pending, plugin_pid)
}

/// Waits (bounded) until the agent answers on its socket, its plugin is
/// ready and its lease is held; panics with the end of its log otherwise.
fn ready(env: &Arc<grpcio::Environment>, p: &mut Pending) -> ApiClient {
    let end = Instant::now() + READY_TIMEOUT;
    let call = || CallOption::default().timeout(PROBE_CALL);
    let mut api: Option<ApiClient> = None;
    loop {
        if let Ok(Some(status)) = p.agent.child.try_wait() {
            fail(p, &format!("exited ({status})"));
        }
        if Instant::now() >= end {
            fail(p, &format!("was not ready within {READY_TIMEOUT:?}"));
        }
        if api.is_none() && std::os::unix::net::UnixStream::connect(&p.setup.api_socket).is_ok() {
            api = Some(ApiClient::new(env.clone(), &p.setup.api_socket));
        }
        if let Some(c) = &api {
            let plugin_ready = c
                .raw()
                .list_plugins(&w::ListPluginsRequest::new(), call())
                .is_ok_and(|r| r.plugins.iter().any(|p| p.health == "ready"));
            let lease_held = plugin_ready
                && c.raw()
                    .get_metrics(&w::GetMetricsRequest::new(), call())
                    .is_ok_and(|m| sample(&m.text, "claimd_etcd_lease_held") == Some(1.0));
            if lease_held {
                return api.take().expect("checked above");
            }
        }
        std::thread::sleep(POLL);
    }
}

fn fail(p: &Pending, why: &str) -> ! {
    let tail = |f: &str| {
        let text = std::fs::read_to_string(p.dir.join(f)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    };
    panic!(
        "scale: agent {} {why}\n--- agent.log ---\n{}\n--- plugin.log ---\n{}",
        p.name,
        tail("agent.log"),
        tail("plugin.log")
    );
}

/// Waits (bounded) until etcd has the `nodes/` key of every agent.
fn settle(endpoint: &str, n: usize) {
    let etcd = EtcdClient::connect(
        &[endpoint.to_string()],
        EtcdOptions {
            call_timeout: PROBE_CALL,
            ..EtcdOptions::default()
        },
    )
    .expect("a valid endpoint");
    let key = claimd::claims::etcd::keys::Keys::new(PREFIX).nodes();
    let mut seen = 0;
    let end = Instant::now() + SETTLE_TIMEOUT;
    while seen != n {
        assert!(
            Instant::now() < end,
            "scale: etcd has {seen} of {n} keys under {key} after {SETTLE_TIMEOUT:?}"
        );
        std::thread::sleep(POLL);
        seen = etcd.range_prefix(&key).map_or(0, |r| r.count as usize);
    }
}

// ---- Idle ---------------------------------------------------------------------

struct Idle {
    etcd: EtcdDelta,
    /// Calls every agent's counters show, summed, per second.
    agent_calls_per_s: f64,
    agent_by_method: Counters,
    agent_secs: f64,
    /// Each agent's calls per second.
    each: Vec<f64>,
    keys: Option<f64>,
    db_bytes: Option<f64>,
}

impl Idle {
    fn json(&self, n: usize) -> Value {
        let per_s: BTreeMap<&String, f64> = self
            .agent_by_method
            .by_method
            .iter()
            .map(|(m, (c, _))| (m, c / self.agent_secs))
            .collect();
        let max = self.each.iter().copied().fold(0.0, f64::max);
        json!({
            "window_s": self.etcd.secs,
            "etcd": self.etcd.json(n),
            "agents": {"calls_per_s": self.agent_calls_per_s,
                       "calls_per_s_per_agent": self.agent_calls_per_s / n as f64,
                       "calls_per_s_per_agent_max": max,
                       "by_method_per_s": per_s,
                       "failed_per_s": self.agent_by_method.errors / self.agent_secs},
            "etcd_keys": self.keys, "etcd_db_bytes": self.db_bytes,
        })
    }
}

fn idle(nodes: &[Node], endpoint: &str) -> Idle {
    let read = || -> Vec<(Instant, Counters)> {
        nodes.iter().map(|n| (Instant::now(), n.calls())).collect()
    };
    let c0 = read();
    let e0 = EtcdScrape::read(endpoint);
    std::thread::sleep(IDLE_WINDOW);
    let e1 = EtcdScrape::read(endpoint);
    let c1 = read();
    let (mut sum, mut each, mut secs) = (Counters::default(), Vec::new(), 0.0);
    for (node, ((t0, a), (t1, b))) in nodes.iter().zip(c0.iter().zip(&c1)) {
        let made = node.made(a, b);
        let s = t1.duration_since(*t0).as_secs_f64();
        each.push(made.total() / s);
        secs += s / nodes.len() as f64;
        sum.add(&made);
    }
    Idle {
        etcd: e0.delta(&e1),
        agent_calls_per_s: each.iter().sum(),
        agent_by_method: sum,
        agent_secs: secs,
        each,
        keys: e1.value("etcd_debugging_mvcc_keys_total"),
        db_bytes: e1.value("etcd_mvcc_db_total_size_in_bytes"),
    }
}

// ---- Memory -------------------------------------------------------------------

struct Memory {
    agent_mean: f64,
    agent_max: u64,
    plugin_mean: f64,
    etcd: u64,
    threads_mean: f64,
}

impl Memory {
    fn json(&self) -> Value {
        json!({"agent_mean": self.agent_mean, "agent_max": self.agent_max,
               "plugin_mean": self.plugin_mean, "etcd": self.etcd,
               "agent_threads_mean": self.threads_mean})
    }
}

fn memory(nodes: &[Node], plugins: &[u32], etcd: u32) -> Memory {
    let rss = |pid: u32| proc_status(pid, "VmRSS:");
    let agents: Vec<u64> = nodes.iter().map(|n| rss(n.agent.pid())).collect();
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    let plugins: Vec<u64> = plugins.iter().map(|&p| rss(p)).collect();
    let threads: Vec<u64> = nodes
        .iter()
        .map(|n| proc_status(n.agent.pid(), "Threads:"))
        .collect();
    Memory {
        agent_mean: mean(&agents),
        agent_max: agents.iter().copied().max().unwrap_or(0),
        plugin_mean: mean(&plugins),
        etcd: rss(etcd),
        threads_mean: mean(&threads),
    }
}
