//! What the cluster part stands on: a throwaway etcd member, an agent
//! with its own test plugin as a cluster node, and the agent's counters
//! read from its metrics (etcd calls by method, time in CSI calls and in
//! durable state writes).

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::{wire as w, ApiClient};
use claimd::etcd::{EtcdClient, EtcdOptions};
use serde_json::{json, Value};

use super::*;

/// Mounts and releases per agent before anything is measured (first
/// connections, first calls).
pub const WARM_UP: usize = 2;
pub const ETCD_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Until an agent's plugin is ready and, in cluster mode, its lease held.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Until the background threads that mark claims `releasing` are done.
pub const MARKS_TIMEOUT: Duration = Duration::from_secs(60);
pub const RELEASE_WAIT: Duration = Duration::from_secs(60);
pub const PREFIX: &str = "/claimd";
pub const ETCD_COUNT: &str = "claimd_etcd_request_duration_seconds_count";
pub const ETCD_SUM: &str = "claimd_etcd_request_duration_seconds_sum";
pub const CSI_SUM: &str = "claimd_csi_operations_seconds_sum";
pub const STATE_SUM: &str = "claimd_state_write_duration_seconds_sum";
/// The claim marks (`releasing`, `node-detached`) an agent has yet to
/// write to etcd (see `claims/etcd/marks.rs`).
pub const MARKS_PENDING: &str = "claimd_etcd_claim_marks_pending";

/// Starts a single etcd member on free loopback ports with its data under
/// the scratch directory (killed and removed with it) and answers its
/// client URL once it answers a read.
pub fn start_etcd(args: &Args, s: &mut Scratch) -> String {
    let free_port = || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind an ephemeral loopback port")
            .port()
    };
    // Another process may take a port between the probe and etcd's bind.
    for attempt in 0..3 {
        let (client_port, peer_port) = (free_port(), free_port());
        if client_port == peer_port {
            continue;
        }
        let dir = s.dir.join(format!("etcd-{attempt}"));
        std::fs::create_dir_all(&dir).expect("create the etcd directory");
        let log = std::fs::File::create(dir.join("etcd.log")).expect("create the etcd log");
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut child = Command::new(&args.etcd)
            .args(["--name", "bench", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("bench={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log file"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        let probe = EtcdClient::connect(
            std::slice::from_ref(&client),
            EtcdOptions {
                call_timeout: Duration::from_secs(1),
                ..EtcdOptions::default()
            },
        )
        .expect("a valid endpoint");
        let end = Instant::now() + ETCD_START_TIMEOUT;
        let ready = loop {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break false;
            }
            if probe.get("/claimd-bench/ready").is_ok() {
                break true;
            }
            if Instant::now() >= end {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if ready {
            s.children.push(child);
            return client;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!(
        "etcd did not start; see {}/etcd-*/etcd.log",
        s.dir.display()
    );
}

/// An agent with its own test plugin under `<scratch>/<name>/`.
pub struct Node {
    pub name: String,
    pub setup: Setup,
    pub agent: Agent,
    pub api: ApiClient,
    /// In cluster mode (ready only with its lease held).
    pub cluster: bool,
    /// The etcd calls one metrics read makes itself.
    pub scrape: Counters,
}

impl Node {
    /// The plugin (no controller, node ID `ext-<name>`) and the agent, as
    /// node `name`, in cluster mode on `endpoint` when given; ready when
    /// the plugin is and, in cluster mode, the node's lease is held.
    pub fn start(
        args: &Args,
        env: &Arc<grpcio::Environment>,
        s: &mut Scratch,
        name: &str,
        endpoint: Option<&str>,
    ) -> Node {
        let cluster = endpoint.map(|ep| json!({"endpoints": [ep], "prefix": PREFIX}));
        Node::start_with(args, env, s, name, &["--no-controller"], cluster, json!({}))
    }

    /// The same with the plugin's own arguments (besides `--node-id
    /// ext-<name>`), the agent's whole `cluster` section (None: the
    /// embedded store) and more top-level configuration fields.
    pub fn start_with(
        args: &Args,
        env: &Arc<grpcio::Environment>,
        s: &mut Scratch,
        name: &str,
        plugin_args: &[&str],
        cluster: Option<Value>,
        more: Value,
    ) -> Node {
        let dir = s.dir.join(name);
        let mut extra = json!({ "node_name": name });
        let endpoint = cluster.is_some();
        if let Some(c) = cluster {
            extra["cluster"] = c;
        }
        if let (Some(e), Value::Object(more)) = (extra.as_object_mut(), more) {
            e.extend(more);
        }
        let node_id = format!("ext-{name}");
        let mut plugin_args = plugin_args.to_vec();
        plugin_args.extend(["--node-id", node_id.as_str()]);
        let setup = start_plugin_in(args, s, &dir, &plugin_args, extra);
        let (agent, _) = Agent::start(args, &setup);
        let api = api(&setup, env);
        let mut node = Node {
            name: name.to_string(),
            setup,
            agent,
            api,
            cluster: endpoint,
            scrape: Counters::default(),
        };
        node.wait_ready();
        let a = node.calls();
        node.scrape = node.calls().minus(&a);
        node
    }

    /// Ready when the plugin is and, in cluster mode, the node's lease is
    /// held.
    fn wait_ready(&self) {
        wait_for(
            &format!("agent {} to be ready", self.name),
            AGENT_READY_TIMEOUT,
            || {
                let ready = self
                    .api
                    .raw()
                    .list_plugins(&w::ListPluginsRequest::new(), opt())
                    .is_ok_and(|r| r.plugins.iter().any(|p| p.health == "ready"));
                ready
                    && (!self.cluster
                        || sample(&metrics_text(&self.api), "claimd_etcd_lease_held") == Some(1.0))
            },
        );
    }

    /// SIGKILLs the agent and starts it again on the same state (its
    /// mounts stay); returns once it is ready and has reconciled its
    /// claims. Its counters start at 0.
    pub fn restart(&mut self, args: &Args) {
        // Dead and reaped before the new one starts on its state.
        let _ = self.agent.child.kill();
        let _ = self.agent.child.wait();
        self.agent = Agent::start(args, &self.setup).0;
        self.wait_ready();
        if !self.cluster {
            return;
        }
        wait_for(
            &format!("agent {}'s start-up reconciliation", self.name),
            AGENT_READY_TIMEOUT,
            || {
                sample(
                    &metrics_text(&self.api),
                    "claimd_cluster_reconciliations_total",
                )
                .is_some_and(|n| n >= 1.0)
            },
        );
    }

    pub fn register(&self, id: &str, mode: &str) {
        register(&self.api, &self.setup, id, mode);
    }

    pub fn mount(&self, alloc: &str, volume: &str) {
        mount(&self.api, alloc, &[volume.to_string()]);
    }

    pub fn release(&self, alloc: &str) {
        let r = release(&self.api, alloc, RELEASE_WAIT);
        assert!(r.done, "{}: release of {alloc} did not finish", self.name);
    }

    /// A few mounts and releases of volumes of its own, not measured.
    pub fn warm_up(&self) {
        for i in 0..WARM_UP {
            let (v, a) = (format!("warm-{}-{i}", self.name), format!("warm-a{i}"));
            self.register(&v, "single-node-writer");
            self.mount(&a, &v);
            self.release(&a);
        }
        self.wait_marks();
    }

    /// The agent's etcd call counters now.
    pub fn calls(&self) -> Counters {
        Counters::read(&metrics_text(&self.api))
    }

    /// The calls made between two readings, less the second reading's own.
    pub fn made(&self, before: &Counters, after: &Counters) -> Counters {
        after.minus(before).minus(&self.scrape)
    }

    pub fn claim_retries(&self) -> f64 {
        sample(&metrics_text(&self.api), "claimd_claim_retries_total").unwrap_or(0.0)
    }

    /// Waits until the agent has no claim mark left to write.
    pub fn wait_marks(&self) {
        wait_for(
            &format!("agent {}'s claim marks", self.name),
            MARKS_TIMEOUT,
            || sample(&metrics_text(&self.api), MARKS_PENDING) == Some(0.0),
        );
    }
}

/// An agent's counters: etcd calls by method (count, seconds) and the
/// failed ones, and the seconds spent in CSI calls and in durable state
/// writes (sums of their histograms).
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub by_method: BTreeMap<String, (f64, f64)>,
    pub errors: f64,
    pub csi_seconds: f64,
    pub state_seconds: f64,
}

impl Counters {
    /// From `claimd_etcd_request_duration_seconds_{count,sum}{method,result}`,
    /// `claimd_csi_operations_seconds_sum` and
    /// `claimd_state_write_duration_seconds_sum`.
    pub fn read(text: &str) -> Counters {
        let mut c = Counters::default();
        let value = |rest: &str| rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix(CSI_SUM) {
                c.csi_seconds += value(rest).unwrap_or(0.0);
                continue;
            }
            if let Some(rest) = line.strip_prefix(STATE_SUM) {
                c.state_seconds += value(rest).unwrap_or(0.0);
                continue;
            }
            let (is_count, rest) = if let Some(r) = line.strip_prefix(ETCD_COUNT) {
                (true, r)
            } else if let Some(r) = line.strip_prefix(ETCD_SUM) {
                (false, r)
            } else {
                continue;
            };
            let (Some(method), Some(result), Some(v)) =
                (label(rest, "method"), label(rest, "result"), value(rest))
            else {
                continue;
            };
            let e = c.by_method.entry(method.to_string()).or_default();
            if is_count {
                e.0 += v;
                if result != "ok" {
                    c.errors += v;
                }
            } else {
                e.1 += v;
            }
        }
        c
    }

    pub fn minus(&self, other: &Counters) -> Counters {
        let mut c = self.clone();
        for (m, (n, s)) in &other.by_method {
            let e = c.by_method.entry(m.clone()).or_default();
            e.0 -= n;
            e.1 -= s;
        }
        c.by_method.retain(|_, (n, _)| n.abs() > 1e-9);
        c.errors -= other.errors;
        c.csi_seconds -= other.csi_seconds;
        c.state_seconds -= other.state_seconds;
        c
    }

    pub fn add(&mut self, other: &Counters) {
        for (m, (n, s)) in &other.by_method {
            let e = self.by_method.entry(m.clone()).or_default();
            e.0 += n;
            e.1 += s;
        }
        self.errors += other.errors;
        self.csi_seconds += other.csi_seconds;
        self.state_seconds += other.state_seconds;
    }

    pub fn count(&self, method: &str) -> f64 {
        self.by_method.get(method).map_or(0.0, |e| e.0)
    }

    pub fn total(&self) -> f64 {
        self.by_method.values().map(|e| e.0).sum()
    }

    pub fn per_op(&self, ops: usize) -> Value {
        let ops = ops.max(1) as f64;
        let by: serde_json::Map<String, Value> = self
            .by_method
            .iter()
            .map(|(m, (n, _))| (m.clone(), json!(n / ops)))
            .collect();
        json!({"total": self.total() / ops, "by_method": by, "failed": self.errors / ops})
    }

    pub fn mean_ms(&self) -> BTreeMap<String, f64> {
        self.by_method
            .iter()
            .filter(|(_, (n, _))| *n > 0.0)
            .map(|(m, (n, s))| (m.clone(), s * 1000.0 / n))
            .collect()
    }

    /// "2.00 (Range 1.00, Txn 1.00)".
    pub fn row(&self, ops: usize) -> String {
        let ops = ops.max(1) as f64;
        let by: Vec<String> = self
            .by_method
            .iter()
            .map(|(m, (n, _))| format!("{m} {:.2}", n / ops))
            .collect();
        format!("{:.2} ({})", self.total() / ops, by.join(", "))
    }
}

pub fn mean_row(means: &BTreeMap<String, f64>) -> String {
    means
        .iter()
        .map(|(m, ms)| format!("{m} {ms:.2} ms"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn state_cost(acc: &w::GetStatsResponse, ops: usize) -> Value {
    StateCost::between(&w::GetStatsResponse::new(), acc, ops).json()
}

/// The value of label `name` in `{a="x",b="y"} 1`.
pub fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let start = labels.find(&key)? + key.len();
    let len = labels[start..].find('"')?;
    Some(&labels[start..start + len])
}

/// The value of the unlabelled sample `name`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The `q` quantile (0 = min, 1 = max) in milliseconds, nearest rank.
pub fn quantile_ms(v: &[Duration], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort();
    let i = ((v.len().saturating_sub(1)) as f64 * q).round() as usize;
    v.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg has them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Milliseconds since the epoch: the clock of the test plugin's call log.
pub fn now_ms() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970");
    u64::try_from(d.as_millis()).expect("milliseconds fit u64")
}

/// The times (`ts_ms`) of the calls of `method` in a test plugin's call
/// log, with `node_id` when given, in order.
pub fn call_times(log: &std::path::Path, method: &str, node_id: Option<&str>) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|c| c["method"] == method && node_id.map_or(true, |n| c["node_id"] == n))
        .filter_map(|c| c["ts_ms"].as_u64())
        .collect()
}

// ---- A link to etcd that can be cut ---------------------------------------------

/// A TCP proxy in front of etcd for one agent: `pause` stops forwarding
/// both ways (the connections stay open, as in a partition: calls hang
/// until their deadline), `resume` forwards again. Stops on drop.
pub struct Proxy {
    addr: std::net::SocketAddr,
    state: Arc<ProxyState>,
}

#[derive(Default)]
struct ProxyState {
    paused: std::sync::atomic::AtomicBool,
    stopped: std::sync::atomic::AtomicBool,
}

/// How often a pump looks at the pause and stop flags.
const PUMP_TICK: Duration = Duration::from_millis(20);

impl Proxy {
    /// Forwards a free loopback port to `target` (`http://host:port`).
    pub fn start(target: &str) -> Proxy {
        use std::sync::atomic::Ordering;
        let target: std::net::SocketAddr = target
            .trim_start_matches("http://")
            .parse()
            .expect("etcd's client address");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let state = Arc::new(ProxyState::default());
        let st = state.clone();
        std::thread::Builder::new()
            .name("bench-proxy".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(down) = conn else { continue };
                    let Ok(up) = std::net::TcpStream::connect(target) else {
                        continue;
                    };
                    for (from, to) in [(&down, &up), (&up, &down)] {
                        let (from, to) = (
                            from.try_clone().expect("clone a socket"),
                            to.try_clone().expect("clone a socket"),
                        );
                        let st = st.clone();
                        std::thread::Builder::new()
                            .name("bench-pump".into())
                            .spawn(move || pump(from, to, &st))
                            .expect("start a proxy pump");
                    }
                }
            })
            .expect("start the proxy");
        Proxy { addr, state }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pause(&self) {
        self.state
            .paused
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.state
            .paused
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state
            .stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the acceptor; pumps see the flag within a tick.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

/// Copies `from` to `to` while not paused; ends (closing both) at EOF, on
/// an error or when the proxy stops.
fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream, st: &ProxyState) {
    use std::io::{ErrorKind, Read, Write};
    use std::sync::atomic::Ordering;
    let _ = from.set_read_timeout(Some(PUMP_TICK));
    let mut buf = [0u8; 16 * 1024];
    while !st.stopped.load(Ordering::SeqCst) {
        if st.paused.load(Ordering::SeqCst) {
            std::thread::sleep(PUMP_TICK);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
