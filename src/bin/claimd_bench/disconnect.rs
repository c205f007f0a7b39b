//! Controller hosts and disconnects (issue 15), on a throwaway etcd like
//! the cluster part:
//!
//! 1. Attach latency through a remote controller host against a local
//!    one: mount and release of one volume at a time on a node whose own
//!    plugin has the controller side (ControllerPublish called directly)
//!    and on a node-only agent (`--no-controller --require-contexts`)
//!    attaching through that host (`attachments/` requests in etcd),
//!    interleaved ABBA in blocks, with both agents' etcd calls.
//! 2. Takeover after a partition: node A (`stop_after_disconnect` D,
//!    `lease_ttl` T) holds a single-writer volume attached through a
//!    controller host H; node B's mount of it waits. A's link to etcd (its
//!    own TCP proxy) is cut; the times from the cut to A's liveness key
//!    expiring, to the claim freed, to B's claim taken and B's mount done
//!    are polled from etcd and from the mount call itself, and the detach
//!    from the host plugin's call log.
//!
//! Watches and the lease keep-alive are streams, not in the agent's call
//! counters; every agent also makes calls of its own in the background
//! (the disconnect rule reads `node-settings/` and `nodes/` every
//! `lease_ttl`/4, 250 ms to 2 s; a host rescans `attachments/` every
//! second), which the counts include.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use claimd::api::wire as w;
use claimd::claims::etcd::Keys;
use claimd::etcd::{EtcdClient, EtcdOptions};
use grpcio::CallOption;
use serde_json::{json, Value};

use super::cluster_support::*;
use super::*;

/// Volumes per side and turn of the ABBA comparison.
const ABBA_BLOCK: usize = 10;
/// (lease_ttl, stop_after_disconnect) pairs of the takeover, in seconds.
const TAKEOVER_PAIRS: [(u64, u64); 3] = [(2, 2), (3, 5), (5, 5)];
/// Longest wait for a host's announcement, a liveness key, a release.
const SHOW_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for a takeover (T + D plus the waiting mount's backoff,
/// whose step doubles from 1 s).
const TAKEOVER_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the takeover looks at etcd and at B's mount.
const POLL: Duration = Duration::from_millis(10);
/// The plugin ID every bench configuration gives the test plugin.
const PLUGIN: &str = "hp";

pub fn disconnect(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let mut s = Scratch::new();
    let load_before = load_average();
    let endpoint = start_etcd(args, &mut s);
    let etcd = EtcdClient::connect(
        std::slice::from_ref(&endpoint),
        EtcdOptions {
            call_timeout: Duration::from_secs(5),
            ..EtcdOptions::default()
        },
    )
    .expect("a valid endpoint");
    let mut out = serde_json::Map::new();
    remote_attach(args, env, &mut s, &endpoint, &etcd, &mut out, table);
    let load_mid = load_average();
    takeover(args, env, &mut s, &endpoint, &etcd, &mut out, table);
    let load_after = load_average();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    out.insert(
        "conditions".into(),
        json!({"load_average_before": load_before, "load_average_between": load_mid,
               "load_average_after": load_after, "cpus": cpus, "etcd": args.etcd}),
    );
    table.push((
        "disconnect: conditions (1/5/15-min load average before; between; after)".into(),
        format!("{load_before}; {load_mid}; {load_after}; {cpus} CPUs"),
    ));
    results.insert("disconnect".into(), Value::Object(out));
}

/// The `cluster` section of an agent on `endpoint` under `prefix`.
fn section(endpoint: &str, prefix: &str, lease_ttl: Option<u64>, stop_after: Option<u64>) -> Value {
    let mut c = json!({"endpoints": [endpoint], "prefix": prefix});
    if let Some(t) = lease_ttl {
        c["lease_ttl"] = json!(format!("{t}s"));
        // The agent refuses a call deadline above half the lease (its
        // default, 5 s, is above half of the short leases here).
        c["call_timeout"] = json!(format!("{}ms", (t * 500).min(5000)));
        // The takeover: the cluster moves a volume of a vanished node only
        // once it is fenced, and counts ControllerUnpublish as a fence only
        // for plugins listed here (packaging/doc/safety.md).
        c["fencing_plugins"] = json!(["hp"]);
    }
    if let Some(d) = stop_after {
        c["stop_after_disconnect"] = json!(format!("{d}s"));
    }
    c
}

/// A controller host: its plugin serves the controller side and accepts
/// the external node IDs of `others` besides its own. Ready once its
/// controller is announced in etcd.
fn start_host(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    s: &mut Scratch,
    etcd: &EtcdClient,
    name: &str,
    others: &[&str],
    cluster: Value,
) -> Node {
    let prefix = cluster["prefix"].as_str().expect("a prefix").to_string();
    let known = s.dir.join(format!("{name}-known-nodes"));
    let ids: String = others.iter().map(|n| format!("ext-{n}\n")).collect();
    std::fs::write(&known, ids).expect("write the known-nodes file");
    let known = known.to_str().expect("scratch paths are UTF-8").to_string();
    let node = Node::start_with(
        args,
        env,
        s,
        name,
        &["--known-nodes", &known],
        Some(cluster),
        json!({}),
    );
    let key = Keys::new(&prefix).controller_host(PLUGIN, name);
    wait_for(&format!("{key} to be written"), SHOW_TIMEOUT, || {
        etcd.get(&key).is_ok_and(|kv| kv.is_some())
    });
    node
}

/// A node-only agent: its plugin has no controller side and refuses a
/// NodeStage without the publish context of a ControllerPublish.
fn start_node_only(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    s: &mut Scratch,
    name: &str,
    cluster: Value,
) -> Node {
    Node::start_with(
        args,
        env,
        s,
        name,
        &["--no-controller", "--require-contexts"],
        Some(cluster),
        // A waiting mount keeps waiting for the whole takeover.
        json!({"claim_retry_deadline": "5m"}),
    )
}

/// Creates volume `id` in every node's plugin storage and registers it
/// (once: the registry is the cluster's).
fn add_volume(nodes: &[&Node], id: &str, mode: &str) {
    for n in nodes {
        create_volume(&n.setup, id);
    }
    nodes[0].register(id, mode);
}

// ---- 1. attach through a remote host against a local controller ------------------

/// One side: latencies and both agents' etcd calls over its mounts and
/// over its releases.
#[derive(Default)]
struct Side {
    mounts: Vec<Duration>,
    releases: Vec<Duration>,
    /// [host, node-only] agent's calls.
    mount_calls: [Counters; 2],
    release_calls: [Counters; 2],
}

fn remote_attach(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    s: &mut Scratch,
    endpoint: &str,
    etcd: &EtcdClient,
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let prefix = "/claimd-attach";
    let n = args.attach_n;
    let h = start_host(
        args,
        env,
        s,
        etcd,
        "attach-h",
        &["attach-b"],
        section(endpoint, prefix, None, None),
    );
    let b = start_node_only(
        args,
        env,
        s,
        "attach-b",
        section(endpoint, prefix, None, None),
    );
    let agents = [&h, &b];
    for i in 0..n + WARM_UP {
        add_volume(&agents, &format!("al{i}"), "single-node-writer");
        add_volume(&agents, &format!("ar{i}"), "single-node-writer");
    }
    // Not measured: first connections, first attach requests.
    for i in n..n + WARM_UP {
        h.mount(&format!("warm-l{i}"), &format!("al{i}"));
        h.release(&format!("warm-l{i}"));
        b.mount(&format!("warm-r{i}"), &format!("ar{i}"));
        b.release(&format!("warm-r{i}"));
    }
    for a in agents {
        a.wait_marks();
    }
    // Side 0: the host mounts with its own controller; side 1: the
    // node-only agent, through the host.
    let mut sides = [Side::default(), Side::default()];
    let (vol, alloc) = (["al", "ar"], ["l-a", "r-a"]);
    for (blk, from) in (0..n).step_by(ABBA_BLOCK).enumerate() {
        let to = (from + ABBA_BLOCK).min(n);
        let order = if blk % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let node = agents[side];
            let c0 = agents.map(Node::calls);
            for i in from..to {
                let t = Instant::now();
                node.mount(&format!("{}{i}", alloc[side]), &format!("{}{i}", vol[side]));
                sides[side].mounts.push(t.elapsed());
            }
            let c1 = agents.map(Node::calls);
            for i in from..to {
                let t = Instant::now();
                node.release(&format!("{}{i}", alloc[side]));
                sides[side].releases.push(t.elapsed());
            }
            for a in agents {
                a.wait_marks();
            }
            let c2 = agents.map(Node::calls);
            for k in 0..2 {
                let a = agents[k];
                sides[side].mount_calls[k].add(&a.made(&c0[k], &c1[k]));
                sides[side].release_calls[k].add(&a.made(&c1[k], &c2[k]));
            }
        }
    }
    let ms = quantile_ms;
    let summary =
        |v: &[Duration]| json!({"median_ms": ms(v, 0.5), "p90_ms": ms(v, 0.9), "n": v.len()});
    let calls = |c: &[Counters; 2]| {
        json!({"host": c[0].per_op(n), "node_only": c[1].per_op(n),
               "host_mean_ms": c[0].mean_ms(), "node_only_mean_ms": c[1].mean_ms()})
    };
    let [l, r] = &sides;
    out.insert(
        "remote_vs_local_attach".into(),
        json!({
            "what": format!("{n} volumes each side, mount then release one at a time; local: the host's own controller; remote: a node-only agent through the host; ABBA in blocks of {ABBA_BLOCK}"),
            "mount": {"local": summary(&l.mounts), "remote": summary(&r.mounts),
                      "median_ratio": ms(&r.mounts, 0.5) / ms(&l.mounts, 0.5),
                      "p90_ratio": ms(&r.mounts, 0.9) / ms(&l.mounts, 0.9)},
            "release": {"local": summary(&l.releases), "remote": summary(&r.releases),
                        "median_ratio": ms(&r.releases, 0.5) / ms(&l.releases, 0.5),
                        "p90_ratio": ms(&r.releases, 0.9) / ms(&l.releases, 0.9)},
            "etcd_calls_per_mount": {"local": calls(&l.mount_calls), "remote": calls(&r.mount_calls)},
            "etcd_calls_per_release": {"local": calls(&l.release_calls), "remote": calls(&r.release_calls)},
        }),
    );
    for (what, a, b) in [
        ("mount", &r.mounts, &l.mounts),
        ("release", &r.releases, &l.releases),
    ] {
        table.push((
            format!("disconnect: {what}, remote host vs local controller (median / p90, {n} each, ABBA)"),
            format!(
                "{:.2} / {:.2} ms vs {:.2} / {:.2} ms = {:.2}x / {:.2}x",
                ms(a, 0.5),
                ms(a, 0.9),
                ms(b, 0.5),
                ms(b, 0.9),
                ms(a, 0.5) / ms(b, 0.5),
                ms(a, 0.9) / ms(b, 0.9)
            ),
        ));
    }
    for (what, side) in [("local", l), ("remote", r)] {
        table.push((
            format!("disconnect: etcd calls per mount, {what}: host agent; node-only agent"),
            format!(
                "{}; {}",
                side.mount_calls[0].row(n),
                side.mount_calls[1].row(n)
            ),
        ));
        table.push((
            format!("disconnect: etcd calls per release, {what}: host agent; node-only agent"),
            format!(
                "{}; {}",
                side.release_calls[0].row(n),
                side.release_calls[1].row(n)
            ),
        ));
    }
}

// ---- 2. takeover after a partition ------------------------------------------------

/// One takeover, in milliseconds from the cut (None: not seen).
#[derive(Default)]
struct Takeover {
    /// B's mount was waiting this long (its first claim refusal) before
    /// the cut.
    waiting_before_cut: f64,
    /// A's last lease renewal (negative: before the cut), from A's own
    /// health answer ("last renewed X ago"), which A gives through its
    /// local API once its lease is older than its TTL.
    renewal: Option<f64>,
    /// A's liveness key first seen gone.
    gone: Option<f64>,
    /// The host's ControllerUnpublish for A (its call log).
    detached: Option<f64>,
    /// A's claim freed (its `freed/` note first seen).
    freed: Option<f64>,
    /// B's claim first seen in etcd.
    b_claimed: Option<f64>,
    /// B's mount call returned.
    mounted: f64,
    /// B's claim attempts refused, over the whole wait.
    b_retries: f64,
}

impl Takeover {
    fn json(&self, ttl_ms: f64) -> Value {
        json!({
            "waiting_before_cut_ms": self.waiting_before_cut,
            "last_renewal_ms": self.renewal,
            "gone_ms": self.gone, "detached_ms": self.detached, "freed_ms": self.freed,
            "b_claimed_ms": self.b_claimed, "mounted_ms": self.mounted,
            "mounted_from_last_renewal_ms": self.renewal.map(|r| self.mounted - r),
            "etcd_expiry_lag_ms": self.expiry_lag(ttl_ms),
            "b_claim_retries": self.b_retries,
        })
    }

    /// How long after the lease's end (last renewal + TTL) etcd deleted
    /// the liveness key, as seen by the poll.
    fn expiry_lag(&self, ttl_ms: f64) -> Option<f64> {
        Some(self.gone? - (self.renewal? + ttl_ms))
    }
}

fn takeover(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    s: &mut Scratch,
    endpoint: &str,
    etcd: &EtcdClient,
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let reps = args.takeover_reps;
    let mut pairs = Vec::new();
    for (t, d) in TAKEOVER_PAIRS {
        let prefix = format!("/claimd-t{t}d{d}");
        let (hn, an, bn) = (
            format!("t{t}d{d}-h"),
            format!("t{t}d{d}-a"),
            format!("t{t}d{d}-b"),
        );
        // The host and B have no window of their own: the rule they run
        // for A reads A's setting.
        let h = start_host(
            args,
            env,
            s,
            etcd,
            &hn,
            &[&an, &bn],
            section(endpoint, &prefix, Some(t), None),
        );
        let proxy = Proxy::start(endpoint);
        let a = start_node_only(
            args,
            env,
            s,
            &an,
            section(&proxy.endpoint(), &prefix, Some(t), Some(d)),
        );
        let b = start_node_only(args, env, s, &bn, section(endpoint, &prefix, Some(t), None));
        let settings = Keys::new(&prefix).settings(&an);
        wait_for(&format!("{settings} to be written"), SHOW_TIMEOUT, || {
            etcd.get(&settings).is_ok_and(|kv| kv.is_some())
        });
        let mut runs = Vec::new();
        for rep in 0..reps {
            let v = format!("tk{rep}");
            add_volume(&[&h, &a, &b], &v, "single-node-writer");
            runs.push(one_takeover(
                env, etcd, &prefix, &h, &a, &b, &proxy, &v, rep,
            ));
        }
        let ttl_ms = (t * 1000) as f64;
        let floor_ms = ((t + d) * 1000) as f64;
        let col = |f: &dyn Fn(&Takeover) -> Option<f64>| -> Vec<f64> {
            let mut v: Vec<f64> = runs.iter().filter_map(f).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let stat = |v: &[f64]| json!({"median": median(v), "min": v.first(), "max": v.last(), "n": v.len()});
        let from_cut = col(&|r| Some(r.mounted));
        let from_renewal = col(&|r| r.renewal.map(|x| r.mounted - x));
        let renewal = col(&|r| r.renewal);
        let lag = col(&|r| r.expiry_lag(ttl_ms));
        let gone = col(&|r| r.gone);
        let gone_to_detached = col(&|r| Some(r.detached? - r.gone?));
        let detached_to_freed = col(&|r| Some(r.freed? - r.detached?));
        let freed_to_claimed = col(&|r| Some(r.b_claimed? - r.freed?));
        let claimed_to_mounted = col(&|r| Some(r.mounted - r.b_claimed?));
        let retries = col(&|r| Some(r.b_retries));
        pairs.push(json!({
            "lease_ttl_s": t, "stop_after_disconnect_s": d, "floor_ms": floor_ms,
            "runs": runs.iter().map(|r| r.json(ttl_ms)).collect::<Vec<_>>(),
            "mounted_from_cut_ms": stat(&from_cut),
            "mounted_from_last_renewal_ms": stat(&from_renewal),
            "last_renewal_ms": stat(&renewal),
            "etcd_expiry_lag_ms": stat(&lag),
            "cut_to_gone_ms": stat(&gone),
            "gone_to_detached_ms": stat(&gone_to_detached),
            "detached_to_freed_ms": stat(&detached_to_freed),
            "freed_to_b_claimed_ms": stat(&freed_to_claimed),
            "b_claimed_to_mounted_ms": stat(&claimed_to_mounted),
            "b_claim_retries": stat(&retries),
        }));
        let s3 = |v: &[f64]| {
            format!(
                "{:.2} s ({:.2}-{:.2})",
                median(v) / 1000.0,
                v.first().copied().unwrap_or(0.0) / 1000.0,
                v.last().copied().unwrap_or(0.0) / 1000.0
            )
        };
        table.push((
            format!("disconnect: takeover T={t}s D={d}s (floor {}s), {reps} runs: B mounted from A's last renewal; from the cut", t + d),
            format!("{}; {}", s3(&from_renewal), s3(&from_cut)),
        ));
        table.push((
            format!("disconnect: T={t}s D={d}s: renewal (from the cut); etcd's expiry lag past renewal+T; cut->gone; gone->detach; detach->freed; freed->B's claim; B's claim->mounted"),
            format!(
                "{}; {}; {}; {}; {}; {}; {}",
                s3(&renewal),
                s3(&lag),
                s3(&gone),
                s3(&gone_to_detached),
                s3(&detached_to_freed),
                s3(&freed_to_claimed),
                s3(&claimed_to_mounted)
            ),
        ));
        table.push((
            format!("disconnect: T={t}s D={d}s: B's claim attempts refused per takeover"),
            format!(
                "median {} ({}-{})",
                median(&retries),
                retries.first().copied().unwrap_or(0.0),
                retries.last().copied().unwrap_or(0.0)
            ),
        ));
        drop((a, b, h, proxy));
    }
    out.insert(
        "takeover".into(),
        json!({
            "what": format!("A (lease_ttl T, stop_after_disconnect D, behind its own proxy) holds a single-writer volume attached through host H; B's mount waits; A's proxy is cut; {reps} runs per (T, D); times in ms from the cut, polled every {} ms", POLL.as_millis()),
            "pairs": pairs,
        }),
    );
}

/// How long ago the agent's lease was last renewed, in ms, when its
/// health says so ("... last renewed 2.345s ago (TTL 2s) ...": only once
/// the lease is older than its TTL).
fn last_renewal(node: &Node) -> Option<f64> {
    let h = node
        .api
        .raw()
        .get_health(&w::GetHealthRequest::new(), opt())
        .ok()?;
    h.problems.iter().find_map(|p| {
        let rest = p.split("last renewed ").nth(1)?;
        parse_debug_duration_ms(rest.split(" ago").next()?)
    })
}

/// "2.5s", "850.1ms", "12µs", "40ns" (Duration's Debug) in ms.
fn parse_debug_duration_ms(s: &str) -> Option<f64> {
    for (unit, ms) in [("ms", 1.0), ("µs", 1e-3), ("ns", 1e-6), ("s", 1e3)] {
        if let Some(n) = s.strip_suffix(unit) {
            return n.parse::<f64>().ok().map(|n| n * ms);
        }
    }
    None
}

/// The median of sorted values (0 when empty).
fn median(v: &[f64]) -> f64 {
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[allow(clippy::too_many_arguments)]
fn one_takeover(
    env: &Arc<grpcio::Environment>,
    etcd: &EtcdClient,
    prefix: &str,
    h: &Node,
    a: &Node,
    b: &Node,
    proxy: &Proxy,
    v: &str,
    rep: usize,
) -> Takeover {
    let (pa, qb) = (format!("p{rep}"), format!("q{rep}"));
    a.mount(&pa, v);
    let retries0 = b.claim_retries();
    // B's mount, on a thread of its own: it returns once the claim is
    // B's and the volume mounted.
    let (tx, rx) = mpsc::channel();
    let b_api = claimd::api::ApiClient::new(env.clone(), &b.setup.api_socket);
    let (qb2, v2) = (qb.clone(), v.to_string());
    let waiter = std::thread::Builder::new()
        .name("bench-b-mount".into())
        .spawn(move || {
            let mut r = w::MountAllocRequest::new();
            r.alloc_id = qb2;
            let mut q = w::VolumeRequest::new();
            q.alias = "d0".into();
            q.volume_id = v2;
            r.volumes = vec![q];
            let res = b_api
                .raw()
                .mount_alloc(&r, CallOption::default().timeout(TAKEOVER_TIMEOUT));
            let _ = tx.send((now_ms(), res.map(|_| ()).map_err(|e| e.to_string())));
        })
        .expect("start B's mount");
    let asked = now_ms();
    wait_for(
        "B's mount to be refused the claim once",
        SHOW_TIMEOUT,
        || b.claim_retries() > retries0,
    );
    let cut = now_ms();
    proxy.pause();
    let keys = Keys::new(prefix);
    let (node_key, freed_key, b_key) = (keys.node(&a.name), keys.freed(v, &pa), keys.claim(v, &qb));
    let since = |t: u64| t.saturating_sub(cut) as f64;
    let mut r = Takeover {
        waiting_before_cut: cut.saturating_sub(asked) as f64,
        ..Takeover::default()
    };
    let end = Instant::now() + TAKEOVER_TIMEOUT;
    let mounted = loop {
        // One read of the prefix per tick: A's liveness key, the freed
        // note, B's claim.
        if let Ok(kvs) = etcd.range_prefix(format!("{prefix}/")) {
            let has = |k: &str| kvs.kvs.iter().any(|kv| kv.key_str() == k);
            let now = since(now_ms());
            if r.gone.is_none() && !has(&node_key) {
                r.gone = Some(now);
            }
            if r.freed.is_none() && has(&freed_key) {
                r.freed = Some(now);
            }
            if r.b_claimed.is_none() && has(&b_key) {
                r.b_claimed = Some(now);
            }
        }
        if r.renewal.is_none() {
            r.renewal = last_renewal(a).map(|ago| now_ms() as f64 - ago - cut as f64);
        }
        match rx.recv_timeout(POLL) {
            Ok((at, res)) => {
                res.unwrap_or_else(|e| panic!("B's mount of {v} failed: {e}"));
                break at;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                assert!(Instant::now() < end, "B's mount of {v} did not finish");
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("B's mount thread died"),
        }
    };
    waiter.join().expect("B's mount thread");
    r.mounted = since(mounted);
    r.detached = call_times(
        &h.setup.call_log,
        "ControllerUnpublishVolume",
        Some(&format!("ext-{}", a.name)),
    )
    .into_iter()
    .find(|&t| t >= cut)
    .map(since);
    r.b_retries = b.claim_retries() - retries0;
    // Heal: A comes back and finishes its release; B lets go.
    proxy.resume();
    wait_for(&format!("{node_key} again"), SHOW_TIMEOUT, || {
        etcd.get(&node_key).is_ok_and(|kv| kv.is_some())
    });
    wait_for(
        &format!("{} to finish releasing {pa}", a.name),
        SHOW_TIMEOUT,
        || {
            a.api
                .raw()
                .list_allocs(&w::ListAllocsRequest::new(), opt())
                .is_ok_and(|l| l.allocs.is_empty())
        },
    );
    b.release(&qb);
    for n in [h, a, b] {
        n.wait_marks();
    }
    r
}
