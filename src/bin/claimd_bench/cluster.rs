//! Cluster mode on etcd: a throwaway etcd member on free loopback ports,
//! one test plugin per agent (no controller, its own directories and node
//! ID) and real agents in cluster mode, driven through the API like the
//! other parts.
//!
//! 1. Mount and release one at a time on an agent with the etcd store and
//!    one with the embedded store, interleaved ABBA in blocks, and the etcd
//!    calls each mount and release makes, from the agent's own metrics.
//! 2. Three agents each mounting their own volumes at once, against each
//!    of them alone.
//! 3. Allocations spread over the three nodes contending for one
//!    multi-node-multi-writer volume.
//!
//! etcd calls are counted from `claimd_etcd_request_duration_seconds_count`
//! (unary calls by method; the keep-alive stream is not in it). Reading the
//! metrics costs a call itself (the `claimd_claims` gauge lists the claims
//! from etcd), measured at start and taken off every difference.

use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::wire as w;
use serde_json::{json, Value};

use super::cluster_support::*;
use super::*;

/// Agents of the throughput and contention parts.
const NODES: usize = 3;
/// Volumes per side and turn of the ABBA comparison.
const ABBA_BLOCK: usize = 10;
/// Rounds of the contention part (all mounted, then all released).
const CONTENTION_ROUNDS: usize = 3;
/// The two sides of the store comparison.
const STORES: [&str; 2] = ["etcd", "embedded"];

pub fn cluster(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let mut s = Scratch::new();
    let load_before = load_average();
    let endpoint = start_etcd(args, &mut s);
    let mut out = serde_json::Map::new();
    {
        let mut etcd_node = Node::start(args, env, &mut s, "etcd-store", Some(&endpoint));
        let local_node = Node::start(args, env, &mut s, "embedded-store", None);
        stores(args, &etcd_node, &local_node, &mut out, table);
        after_restart(args, &mut etcd_node, &mut out, table);
    }
    let nodes: Vec<Node> = (1..=NODES)
        .map(|i| Node::start(args, env, &mut s, &format!("n{i}"), Some(&endpoint)))
        .collect();
    throughput(args, &nodes, &mut out, table);
    contention(args, &nodes, &mut out, table);
    drop(nodes);
    let load_after = load_average();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    out.insert(
        "conditions".into(),
        json!({"load_average_before": load_before, "load_average_after": load_after,
               "cpus": cpus, "etcd": args.etcd}),
    );
    table.push((
        "cluster: conditions (1/5/15-min load average before; after)".into(),
        format!("{load_before}; {load_after}; {cpus} CPUs"),
    ));
    results.insert("cluster".into(), Value::Object(out));
}

// ---- 1. etcd store against the embedded store --------------------------------

/// One side of the comparison: latencies, and the agent's counters and
/// state store figures over its mounts and over its releases.
#[derive(Default)]
struct Side {
    mounts: Vec<Duration>,
    releases: Vec<Duration>,
    mount_counters: Counters,
    release_counters: Counters,
    mount_state: w::GetStatsResponse,
    release_state: w::GetStatsResponse,
}

impl Side {
    /// Mean latency = CSI + state writes + etcd + the rest, per operation
    /// (etcd calls made in the background included).
    fn breakdown(lat: &[Duration], c: &Counters) -> (Value, String) {
        let ops = lat.len().max(1) as f64;
        let mean = lat.iter().map(Duration::as_secs_f64).sum::<f64>() * 1000.0 / ops;
        let csi = c.csi_seconds * 1000.0 / ops;
        let state = c.state_seconds * 1000.0 / ops;
        let etcd = c.by_method.values().map(|e| e.1).sum::<f64>() * 1000.0 / ops;
        let rest = mean - csi - state - etcd;
        (
            json!({"mean_ms": mean, "csi_ms": csi, "state_write_ms": state, "etcd_ms": etcd,
                   "rest_ms": rest}),
            format!("{mean:.2} = {csi:.2} + {state:.2} + {etcd:.2} + {rest:.2}"),
        )
    }
}

/// Adds the state store's counters between `a` and `b` to `acc`.
fn add_state(acc: &mut w::GetStatsResponse, a: &w::GetStatsResponse, b: &w::GetStatsResponse) {
    acc.state_writes += b.state_writes - a.state_writes;
    acc.state_bytes_written += b.state_bytes_written - a.state_bytes_written;
    acc.state_fsyncs += b.state_fsyncs - a.state_fsyncs;
    acc.state_snapshots += b.state_snapshots - a.state_snapshots;
}

fn stores(
    args: &Args,
    etcd_node: &Node,
    local_node: &Node,
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let n = args.cluster_n;
    let sides = [etcd_node, local_node];
    for node in sides {
        for i in 0..n {
            node.register(&format!("s{i}"), "single-node-writer");
        }
        node.warm_up();
    }
    let mut lat = [Side::default(), Side::default()];
    let mut blocks = Vec::new();
    // ABBA in blocks: etcd then embedded, embedded then etcd, and so on,
    // so the machine's drift weighs on both alike.
    for (b, from) in (0..n).step_by(ABBA_BLOCK).enumerate() {
        let to = (from + ABBA_BLOCK).min(n);
        let order = if b % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let (node, l) = (sides[side], &mut lat[side]);
            let (c0, s0) = (node.calls(), stats(&node.api));
            for i in from..to {
                let t = Instant::now();
                node.mount(&format!("s-a{i}"), &format!("s{i}"));
                l.mounts.push(t.elapsed());
            }
            let (c1, s1) = (node.calls(), stats(&node.api));
            for i in from..to {
                let t = Instant::now();
                node.release(&format!("s-a{i}"));
                l.releases.push(t.elapsed());
            }
            // The marks run in the background: counted with the release
            // that started them, and never overlapping the other side.
            node.wait_marks();
            let (c2, s2) = (node.calls(), stats(&node.api));
            l.mount_counters.add(&node.made(&c0, &c1));
            l.release_counters.add(&node.made(&c1, &c2));
            add_state(&mut l.mount_state, &s0, &s1);
            add_state(&mut l.release_state, &s1, &s2);
            let k = to - from;
            blocks.push(json!({
                "store": STORES[side],
                "mount_median_ms": quantile_ms(&l.mounts[l.mounts.len() - k..], 0.5),
                "release_median_ms": quantile_ms(&l.releases[l.releases.len() - k..], 0.5),
            }));
        }
    }
    let [e, l] = &lat;
    let ms = |v: &[Duration], q: f64| quantile_ms(v, q);
    let ratio = |a: &[Duration], b: &[Duration], q: f64| ms(a, q) / ms(b, q);
    let summary =
        |v: &[Duration]| json!({"median_ms": ms(v, 0.5), "p90_ms": ms(v, 0.9), "n": v.len()});
    let (mount_calls, release_calls) = (&e.mount_counters, &e.release_counters);
    let split = |s: &Side| {
        (
            Side::breakdown(&s.mounts, &s.mount_counters),
            Side::breakdown(&s.releases, &s.release_counters),
        )
    };
    let ((em, em_row), (er, er_row)) = split(e);
    let ((lm, lm_row), (lr, lr_row)) = split(l);
    out.insert(
        "etcd_vs_embedded".into(),
        json!({
            "what": format!("{n} volumes, mount then release one at a time; ABBA in blocks of {ABBA_BLOCK}"),
            "blocks": blocks,
            "mount": {"etcd": summary(&e.mounts), "embedded": summary(&l.mounts),
                      "median_ratio": ratio(&e.mounts, &l.mounts, 0.5),
                      "p90_ratio": ratio(&e.mounts, &l.mounts, 0.9)},
            "release": {"etcd": summary(&e.releases), "embedded": summary(&l.releases),
                        "median_ratio": ratio(&e.releases, &l.releases, 0.5),
                        "p90_ratio": ratio(&e.releases, &l.releases, 0.9)},
            "mount_breakdown": {"etcd": em, "embedded": lm},
            "release_breakdown": {"etcd": er, "embedded": lr},
            "state_per_mount": {"etcd": state_cost(&e.mount_state, n), "embedded": state_cost(&l.mount_state, n)},
            "state_per_release": {"etcd": state_cost(&e.release_state, n), "embedded": state_cost(&l.release_state, n)},
        }),
    );
    out.insert(
        "etcd_calls".into(),
        json!({
            "per_mount": mount_calls.per_op(n), "per_release": release_calls.per_op(n),
            "mean_ms_during_mounts": mount_calls.mean_ms(),
            "mean_ms_during_releases": release_calls.mean_ms(),
            "errors": mount_calls.errors + release_calls.errors,
            "one_metrics_read": etcd_node.scrape.per_op(1),
        }),
    );
    for (what, a, b) in [
        ("mount", &e.mounts, &l.mounts),
        ("release", &e.releases, &l.releases),
    ] {
        table.push((
            format!(
                "cluster: {what}, etcd store vs embedded (median / p90, {n} one at a time, ABBA)"
            ),
            format!(
                "{:.2} / {:.2} ms vs {:.2} / {:.2} ms = {:.2}x / {:.2}x",
                ms(a, 0.5),
                ms(a, 0.9),
                ms(b, 0.5),
                ms(b, 0.9),
                ratio(a, b, 0.5),
                ratio(a, b, 0.9)
            ),
        ));
    }
    table.push((
        "cluster: mean mount = CSI + state writes + etcd + rest, etcd vs embedded".into(),
        format!("{em_row} ms vs {lm_row} ms"),
    ));
    table.push((
        "cluster: mean release, the same (etcd: background mark included)".into(),
        format!("{er_row} ms vs {lr_row} ms"),
    ));
    table.push((
        "cluster: etcd round trips per mount (agent metrics)".into(),
        mount_calls.row(n),
    ));
    table.push((
        "cluster: etcd round trips per release (agent metrics)".into(),
        release_calls.row(n),
    ));
    table.push((
        "cluster: mean etcd call time, mounts; releases".into(),
        format!(
            "{}; {}",
            mean_row(&mount_calls.mean_ms()),
            mean_row(&release_calls.mean_ms())
        ),
    ));
    table.push((
        "cluster: etcd calls of one metrics read (taken off the counts above)".into(),
        etcd_node.scrape.row(1),
    ));
}

/// Releases right after a restart: the agent is SIGKILLed with its
/// volumes mounted and started again (its revision cache is what the
/// start-up reconciliation read), then each allocation is released; the
/// etcd calls per release (background marks included) are counted.
fn after_restart(
    args: &Args,
    node: &mut Node,
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let n = args.cluster_n.min(ABBA_BLOCK * 2);
    for i in 0..n {
        node.mount(&format!("r-a{i}"), &format!("s{i}"));
    }
    node.wait_marks();
    node.restart(args);
    let before = node.calls();
    for i in 0..n {
        node.release(&format!("r-a{i}"));
    }
    node.wait_marks();
    let calls = node.made(&before, &node.calls());
    out.insert(
        "release_after_restart".into(),
        json!({"n": n, "per_release": calls.per_op(n), "errors": calls.errors}),
    );
    table.push((
        format!("cluster: etcd round trips per release right after a restart ({n}, agent metrics)"),
        calls.row(n),
    ));
}

// ---- 2. three agents at once against one alone -------------------------------

/// Wall times of one agent's mounts and releases of its volumes.
#[derive(Clone, Copy, Default)]
struct Pass {
    mount: Duration,
    release: Duration,
}

fn throughput(
    args: &Args,
    nodes: &[Node],
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let per = args.cluster_per_node;
    let k = args.concurrency;
    for node in nodes {
        for i in 0..per {
            node.register(&format!("{}-v{i}", node.name), "single-node-writer");
        }
        node.warm_up();
    }
    let mut run = 0;
    // Each node's volumes, `k` at a time; every node of `which` at once
    // (mounts together, then releases together).
    let mut pass = |which: &[&Node]| -> Vec<Pass> {
        run += 1;
        let id = run;
        let alloc = |node: &Node, i: usize| format!("{}-r{id}-a{i}", node.name);
        let each = |f: &(dyn Fn(&Node) -> Duration + Sync)| -> Vec<Duration> {
            std::thread::scope(|sc| {
                let handles: Vec<_> = which.iter().map(|node| sc.spawn(|| f(node))).collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a node's pass"))
                    .collect()
            })
        };
        let mounts = each(&|node| {
            run_parallel(per, k, |i| {
                node.mount(&alloc(node, i), &format!("{}-v{i}", node.name))
            })
            .1
        });
        let releases = each(&|node| run_parallel(per, k, |i| node.release(&alloc(node, i))).1);
        for node in which {
            node.wait_marks();
        }
        mounts
            .into_iter()
            .zip(releases)
            .map(|(mount, release)| Pass { mount, release })
            .collect()
    };
    let mut alone: Vec<Vec<Pass>> = vec![Vec::new(); nodes.len()];
    let mut together: Vec<Vec<Pass>> = vec![Vec::new(); nodes.len()];
    // ABBA: each alone, all together twice, each alone in reverse order.
    let before: Vec<Counters> = nodes.iter().map(Node::calls).collect();
    for (i, node) in nodes.iter().enumerate() {
        alone[i].extend(pass(&[node]));
    }
    let all: Vec<&Node> = nodes.iter().collect();
    for _ in 0..2 {
        for (i, p) in pass(&all).into_iter().enumerate() {
            together[i].push(p);
        }
    }
    for (i, node) in nodes.iter().enumerate().rev() {
        alone[i].extend(pass(&[node]));
    }
    let mut calls = Counters::default();
    for (node, b) in nodes.iter().zip(&before) {
        calls.add(&node.made(b, &node.calls()));
    }
    let rate = |ps: &[Pass], f: fn(&Pass) -> Duration| {
        (per * ps.len()) as f64 / ps.iter().map(|p| f(p).as_secs_f64()).sum::<f64>()
    };
    let mut per_node = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let (am, tm) = (
            rate(&alone[i], |p| p.mount),
            rate(&together[i], |p| p.mount),
        );
        let (ar, tr) = (
            rate(&alone[i], |p| p.release),
            rate(&together[i], |p| p.release),
        );
        per_node.push(json!({
            "node": node.name,
            "alone_mounts_per_s": am, "together_mounts_per_s": tm, "mount_ratio": tm / am,
            "alone_releases_per_s": ar, "together_releases_per_s": tr, "release_ratio": tr / ar,
        }));
        table.push((
            format!(
                "cluster: {} mounts/s, {per} volumes {k} at a time: alone vs {NODES} agents at once",
                node.name
            ),
            format!("{am:.0} vs {tm:.0} = {:.2}x", tm / am),
        ));
        table.push((
            format!(
                "cluster: {} releases/s: alone vs {NODES} agents at once",
                node.name
            ),
            format!("{ar:.0} vs {tr:.0} = {:.2}x", tr / ar),
        ));
    }
    // The cluster as a whole: every node's volumes over the slowest node's
    // wall time, against the mean single agent alone.
    let whole = |f: fn(&Pass) -> Duration| {
        let passes = together[0].len();
        let walls: f64 = (0..passes)
            .map(|p| {
                together
                    .iter()
                    .map(|t| f(&t[p]).as_secs_f64())
                    .fold(0.0, f64::max)
            })
            .sum();
        (per * nodes.len() * passes) as f64 / walls
    };
    let one = |f: fn(&Pass) -> Duration| {
        let all: Vec<Pass> = alone.iter().flatten().copied().collect();
        rate(&all, f)
    };
    let (cm, om) = (whole(|p| p.mount), one(|p| p.mount));
    let (cr, or) = (whole(|p| p.release), one(|p| p.release));
    out.insert(
        "three_agents_at_once".into(),
        json!({
            "what": format!("{NODES} agents, {per} distinct volumes each, {k} at a time per agent; each alone twice (before and after), all together twice"),
            "per_node": per_node,
            "cluster_mounts_per_s": cm, "one_alone_mounts_per_s": om, "cluster_mount_ratio": cm / om,
            "cluster_releases_per_s": cr, "one_alone_releases_per_s": or, "cluster_release_ratio": cr / or,
            "etcd_calls_per_mount_and_release": calls.per_op(per * nodes.len() * 4),
        }),
    );
    table.push((
        format!("cluster: mounts/s, {NODES} agents at once (all volumes / slowest) vs one alone"),
        format!("{cm:.0} vs {om:.0} = {:.2}x", cm / om),
    ));
    table.push((
        format!("cluster: releases/s, {NODES} agents at once vs one alone"),
        format!("{cr:.0} vs {or:.0} = {:.2}x", cr / or),
    ));
    table.push((
        "cluster: etcd calls per mount + release in this part".into(),
        calls.row(per * nodes.len() * 4),
    ));
}

// ---- 3. contention for one multi-writer volume -------------------------------

/// Allocations mounted all at once, then released all at once.
#[derive(Default)]
struct Bursts {
    mount_walls: Vec<Duration>,
    release_walls: Vec<Duration>,
    mount_lat: Vec<Duration>,
    mount_calls: Counters,
    release_calls: Counters,
    rounds: Vec<Value>,
}

impl Bursts {
    /// Allocation j on node j mod 3, mounting `volume(j)`.
    fn run(
        &mut self,
        nodes: &[Node],
        k: usize,
        tag: &str,
        volume: &(dyn Fn(usize) -> String + Sync),
    ) {
        let alloc = |j: usize| format!("{tag}-a{j}");
        let node = |j: usize| &nodes[j % nodes.len()];
        let before: Vec<Counters> = nodes.iter().map(Node::calls).collect();
        let (lat, mount_wall) = run_parallel(k, k, |j| node(j).mount(&alloc(j), &volume(j)));
        let mid: Vec<Counters> = nodes.iter().map(Node::calls).collect();
        let (_, release_wall) = run_parallel(k, k, |j| node(j).release(&alloc(j)));
        for n in nodes {
            n.wait_marks();
        }
        let after: Vec<Counters> = nodes.iter().map(Node::calls).collect();
        let (mut m, mut r) = (Counters::default(), Counters::default());
        for (i, n) in nodes.iter().enumerate() {
            m.add(&n.made(&before[i], &mid[i]));
            r.add(&n.made(&mid[i], &after[i]));
        }
        self.rounds.push(json!({
            "all_mounted_s": mount_wall.as_secs_f64(), "all_released_s": release_wall.as_secs_f64(),
            "mount_median_ms": quantile_ms(&lat, 0.5), "mount_max_ms": quantile_ms(&lat, 1.0),
            "etcd_calls_per_mount": m.per_op(k), "etcd_calls_per_release": r.per_op(k),
            "txn_beyond_one_per_take": m.count("Txn") - k as f64,
        }));
        self.mount_calls.add(&m);
        self.release_calls.add(&r);
        self.mount_walls.push(mount_wall);
        self.release_walls.push(release_wall);
        self.mount_lat.extend(lat);
    }

    /// Txn calls beyond one per take: each is a take tried again after its
    /// compare failed (another claim of the volume changed between its
    /// read and its write; see `claims/etcd.rs`).
    fn conflicts(&self, takes: usize) -> f64 {
        self.mount_calls.count("Txn") - takes as f64
    }

    fn json(&self, takes: usize) -> Value {
        let secs = |v: &[Duration], q: f64| quantile_ms(v, q) / 1000.0;
        json!({
            "rounds": self.rounds,
            "all_mounted_s_median": secs(&self.mount_walls, 0.5),
            "all_released_s_median": secs(&self.release_walls, 0.5),
            "mount_latency_median_ms": quantile_ms(&self.mount_lat, 0.5),
            "mount_latency_max_ms": quantile_ms(&self.mount_lat, 1.0),
            "etcd_calls_per_mount": self.mount_calls.per_op(takes),
            "etcd_calls_per_release": self.release_calls.per_op(takes),
            "txn_conflicts_inferred": self.conflicts(takes),
        })
    }

    /// "0.088 s / 0.062 s (0.078-0.116 / 0.058-0.070)".
    fn row(&self) -> String {
        let secs = |v: &[Duration], q: f64| quantile_ms(v, q) / 1000.0;
        let (m, r) = (&self.mount_walls, &self.release_walls);
        format!(
            "{:.3} s / {:.3} s ({:.3}-{:.3} / {:.3}-{:.3})",
            secs(m, 0.5),
            secs(r, 0.5),
            secs(m, 0.0),
            secs(m, 1.0),
            secs(r, 0.0),
            secs(r, 1.0)
        )
    }
}

fn contention(
    args: &Args,
    nodes: &[Node],
    out: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let k = args.cluster_allocs;
    for node in nodes {
        node.register("mw", "multi-node-multi-writer");
    }
    // The baseline: the same allocations on the same nodes, each with a
    // volume of its own.
    for j in 0..k {
        nodes[j % nodes.len()].register(&format!("own{j}"), "single-node-writer");
    }
    let (mut shared, mut own) = (Bursts::default(), Bursts::default());
    let retries_before: f64 = nodes.iter().map(Node::claim_retries).sum();
    // ABBA: shared then own, own then shared, ...
    for round in 0..CONTENTION_ROUNDS {
        for contended in [round % 2 == 0, round % 2 == 1] {
            if contended {
                shared.run(nodes, k, &format!("mw-r{round}"), &|_| "mw".to_string());
            } else {
                own.run(nodes, k, &format!("own-r{round}"), &|j| format!("own{j}"));
            }
        }
    }
    let retries = nodes.iter().map(Node::claim_retries).sum::<f64>() - retries_before;
    let takes = k * CONTENTION_ROUNDS;
    let n = nodes.len();
    out.insert(
        "contention".into(),
        json!({
            "what": format!("{k} allocations on {n} nodes (round robin), all at once, {CONTENTION_ROUNDS} rounds; shared: one multi-node-multi-writer volume; own: a single-node-writer volume each (the baseline); ABBA"),
            "shared": shared.json(takes),
            "own": own.json(takes),
            "claim_retries": retries,
        }),
    );
    table.push((
        format!(
            "cluster: {k} allocations on {n} nodes, one multi-writer volume: all mounted / all released (median of {CONTENTION_ROUNDS}; range)"
        ),
        shared.row(),
    ));
    table.push((
        format!("cluster: the same {k}, a volume each (baseline)"),
        own.row(),
    ));
    table.push((
        "cluster: contention, one mount's latency median / max, shared vs own".into(),
        format!(
            "{:.1} / {:.1} ms vs {:.1} / {:.1} ms",
            quantile_ms(&shared.mount_lat, 0.5),
            quantile_ms(&shared.mount_lat, 1.0),
            quantile_ms(&own.mount_lat, 0.5),
            quantile_ms(&own.mount_lat, 1.0)
        ),
    ));
    table.push((
        "cluster: contention, etcd calls per mount; per release (shared volume)".into(),
        format!(
            "{}; {}",
            shared.mount_calls.row(takes),
            shared.release_calls.row(takes)
        ),
    ));
    table.push((
        format!("cluster: Txn conflicts (Txn calls beyond one per take, {takes} takes), shared vs own / claim retries"),
        format!(
            "{} vs {} / {retries}",
            shared.conflicts(takes),
            own.conflicts(takes)
        ),
    ));
}
