//! The per-node claim index (issue 24): `node-claims/<node>/<volume>/<alloc>`
//! exists exactly while that claim does, so that a node's own claims are
//! found without reading every claim of the cluster.
//!
//! 1. Every way a claim comes and goes keeps its entry with it: a take, a
//!    release, a gone node's volume detached by an operator, a claim freed
//!    by hand, an orphan freed by the start-up reconciliation.
//! 2. A node whose claims predate the index (no `claim-index/<node>`
//!    marker) reads every claim once, frees its orphans, indexes the rest
//!    (another instance's too) and writes the marker; a node an older
//!    claimd ran as since (its settings lack `claim_index`) is looked up by
//!    reading every claim, and forgets its marker when it comes back.
//! 3. With a few megabytes of other nodes' claims in etcd, a restart's
//!    reconciliation and the reaper's look at a gone node cost etcd far
//!    less than one read of every claim (etcd's own sent-bytes counter).
//!
//! The harness is tests/cluster/harness/.

use std::io::{Read, Write};
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use serde_json::{json, Value};

use claimd::etcd::TxnOp;

fn volume(id: &str) -> Value {
    volume_json(id, &format!("ext-{id}"), &["single-node-writer"])
}

/// The index entries under `node-claims/`, relative to the prefix.
fn index(c: &Cluster) -> Vec<String> {
    c.keys("node-claims/")
}

/// `claimd_cluster_reconciliations_total` of the node's running agent.
fn reconciliations(n: &Node) -> u64 {
    let out = n.agent.cli(&["metrics"]);
    if out.code != EXIT_OK {
        return 0;
    }
    out.stdout
        .lines()
        .find_map(|l| l.strip_prefix("claimd_cluster_reconciliations_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// SIGKILLs the node's agent and starts it again; returns once its first
/// reconciliation with etcd succeeded.
fn restart_and_reconcile(c: &mut Cluster, name: &str) {
    let n = c.node_mut(name);
    n.agent.kill();
    n.start_agent();
    let n = c.node(name);
    wait_until(
        RETRY_TIMEOUT,
        "the restarted agent's reconciliation",
        || reconciliations(n) >= 1,
    );
}

/// The claim of `volume` by `alloc` as stored, from etcd.
fn stored_claim(c: &Cluster, volume: &str, alloc: &str) -> Value {
    c.get_json(&format!("claims/{volume}/{alloc}"))
        .unwrap_or_else(|| panic!("no claim of {volume} by {alloc}"))
}

/// Writes claims straight into etcd, 64 to a Txn.
fn put_claims(c: &Cluster, claims: &[(String, Value)]) {
    let client = c.etcd.client();
    for chunk in claims.chunks(64) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|(rel, v)| TxnOp::put(format!("{PREFIX}/{rel}"), v.to_string()))
            .collect();
        assert!(client.txn(&[], &ops, &[]).expect("write claims").succeeded);
    }
}

/// `template` (a stored claim) as `node`'s claim of `volume` by `alloc`.
fn claim_like(template: &Value, volume: &str, alloc: &str, node: &str) -> Value {
    let mut v = template.clone();
    v["claim"]["volume_id"] = json!(volume);
    v["claim"]["alloc_id"] = json!(alloc);
    v["claim"]["node"] = json!(node);
    v
}

/// etcd's `etcd_network_client_grpc_sent_bytes_total`: every byte it sent
/// to its gRPC clients.
fn etcd_sent_bytes(c: &Cluster) -> f64 {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", c.etcd.client_port()))
        .expect("connect to etcd's client port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a read timeout");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("ask for etcd's metrics");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("etcd's metrics");
    text.lines()
        .find_map(|l| l.strip_prefix("etcd_network_client_grpc_sent_bytes_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sent-bytes counter in etcd's metrics: {text}"))
}

// ---- 1. The entry comes and goes with its claim --------------------------------

#[test]
fn every_take_and_free_keeps_the_claims_index_entry_with_it() {
    let mut c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    for v in ["v", "w", "x"] {
        c.add_volume(&volume(v));
    }
    // The first reconciliation of a node with no older claims writes its
    // marker at once.
    wait_until(SHOW_TIMEOUT, "a's claim index marker", || {
        c.get_json("claim-index/a").is_some()
    });
    // A take writes the entry with the claim; a release deletes both.
    c.node("a").mount_ok("k1", "data=v");
    assert_eq!(c.holders("v"), ["k1"]);
    assert_eq!(index(&c), ["node-claims/a/v/k1"]);
    c.node("a").release_ok("k1");
    assert!(c.holders("v").is_empty());
    assert!(index(&c).is_empty(), "{:?}", index(&c));
    // A gone node's volume detached by an operator, and a claim of a gone
    // node freed by hand: each with its entry.
    let b = c.node("b");
    b.mount_ok("q1", "data=w");
    b.mount_ok("q2", "data=x");
    assert_eq!(index(&c), ["node-claims/b/w/q1", "node-claims/b/x/q2"]);
    c.node_mut("b").agent.kill();
    c.wait_gone("b");
    let a = c.node("a");
    a.agent
        .cli(&["volume", "detach", "w", "--node", "b", "--reason", "gone"])
        .ok();
    assert!(c.holders("w").is_empty());
    assert_eq!(index(&c), ["node-claims/b/x/q2"]);
    a.agent
        .cli(&["claim", "free", "x", "q2", "--reason", "gone"])
        .ok();
    assert!(c.holders("x").is_empty());
    assert!(index(&c).is_empty(), "{:?}", index(&c));
    // An orphan (the agent died between etcd's take and its local record)
    // is found through the index at the next start and freed with it.
    let n = c.node_mut("a");
    n.agent.kill();
    n.agent.envs = vec![(
        "CLAIMD_FAILPOINT".to_string(),
        "etcd-after-round-trip".to_string(),
    )];
    n.start_agent();
    let out = c.node("a").mount("k2", "data=v", &[]);
    assert_ne!(out.code, EXIT_OK, "{out:?}");
    c.node_mut("a").agent.wait_exit(SHOW_TIMEOUT);
    assert_eq!(c.holders("v"), ["k2"]);
    assert_eq!(index(&c), ["node-claims/a/v/k2"]);
    c.node_mut("a").agent.envs.clear();
    c.node_mut("a").start_agent();
    wait_until(RETRY_TIMEOUT, "the orphan to be freed", || {
        c.holders("v").is_empty()
    });
    assert!(index(&c).is_empty(), "{:?}", index(&c));
    assert!(c
        .node("a")
        .agent
        .log()
        .contains("freed the claim of volume v by allocation k2 on this node"));
}

// ---- 2. Claims from before the index --------------------------------------------

#[test]
fn a_node_without_its_index_reads_every_claim_once_then_indexes_its_own() {
    let mut c = Cluster::start(vec![nfs_node("a")]);
    for v in ["v", "w", "x"] {
        c.add_volume(&volume(v));
    }
    let a = c.node("a");
    a.mount_ok("k1", "data=v");
    let template = stored_claim(&c, "v", "k1");
    // As an older claimd would have left it: a's claim k1 (recorded), an
    // orphan of a on w (no record, nothing mounted), a claim on x by
    // another instance of a's name, and no entries and no marker.
    let mut other = claim_like(&template, "x", "o1", "a");
    other["instance"] = json!("0123456789abcdef0123456789abcdef");
    put_claims(
        &c,
        &[
            (
                "claims/w/orphan1".to_string(),
                claim_like(&template, "w", "orphan1", "a"),
            ),
            ("claims/x/o1".to_string(), other),
        ],
    );
    let client = c.etcd.client();
    client
        .delete_prefix(format!("{PREFIX}/node-claims/"))
        .expect("drop the index");
    client
        .delete_range(format!("{PREFIX}/claim-index/a"), "")
        .expect("drop the marker");
    restart_and_reconcile(&mut c, "a");
    // The orphan is freed; the rest is indexed, the marker written.
    assert!(c.holders("w").is_empty());
    assert_eq!(c.holders("v"), ["k1"]);
    assert_eq!(c.holders("x"), ["o1"]);
    assert_eq!(index(&c), ["node-claims/a/v/k1", "node-claims/a/x/o1"]);
    let marker = c.get_json("claim-index/a").expect("a's marker");
    assert!(marker["instance"].is_string(), "{marker}");
    assert!(c
        .node("a")
        .agent
        .log()
        .contains("this node's claims are indexed now (2 older claim(s) added"));
    // A stale entry (its claim deleted by a claimd without the index) is
    // dropped by the next reconciliation; the claims stay.
    put_claims(&c, &[("node-claims/a/w/gone1".to_string(), json!(""))]);
    restart_and_reconcile(&mut c, "a");
    assert_eq!(index(&c), ["node-claims/a/v/k1", "node-claims/a/x/o1"]);
    assert_eq!(c.holders("v"), ["k1"]);
    // And the index follows the release of an indexed older claim.
    c.node("a").release_ok("k1");
    assert_eq!(index(&c), ["node-claims/a/x/o1"]);
}

/// An older claimd ran as node b after b's claims were indexed (b was
/// downgraded): its registration rewrote b's settings without
/// `claim_index` and it took a claim without an index entry. b is gone:
/// a's reaper and `node remove` must see that claim (they read every
/// claim, not b's index); when b comes back with the index it forgets its
/// marker before it registers and reads every claim once more.
#[test]
fn a_node_an_older_claimd_ran_as_is_looked_up_by_reading_every_claim() {
    let mut c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b").stop_after_disconnect(STOP_AFTER),
    ]);
    c.add_volume(&volume("v"));
    c.add_volume(&volume("w"));
    c.node("b").mount_ok("q1", "data=v");
    wait_until(SHOW_TIMEOUT, "b's claim index marker", || {
        c.get_json("claim-index/b").is_some()
    });
    let template = stored_claim(&c, "v", "q1");
    c.node_mut("b").agent.kill();
    c.wait_gone("b");
    // What the older claimd left: settings without the flag, a claim of
    // w without an entry.
    let mut settings = c.get_json("node-settings/b").expect("b's settings");
    assert_eq!(settings["claim_index"], true, "{settings}");
    settings
        .as_object_mut()
        .expect("settings are an object")
        .remove("claim_index");
    put_claims(
        &c,
        &[
            ("node-settings/b".to_string(), settings),
            (
                "claims/w/old1".to_string(),
                claim_like(&template, "w", "old1", "b"),
            ),
        ],
    );
    let a = c.node("a");
    wait_until(
        RETRY_TIMEOUT,
        "a's reaper to keep both of b's claims",
        || {
            let log = a.agent.log();
            log.contains("volume v stays claimed by unreachable node b")
                && log.contains("volume w stays claimed by unreachable node b")
        },
    );
    let e = a
        .agent
        .cli(&["node", "remove", "b"])
        .expect_code(EXIT_FAILED)
        .stderr;
    assert!(e.contains("node b still holds claims of v, w"), "{e}");
    // b is back with the index: the stale marker goes before it
    // registers, its reconciliation reads every claim, frees old1 (no
    // record, nothing mounted: only a read of every claim finds it) and
    // writes the marker again.
    restart_and_reconcile(&mut c, "b");
    let log = c.node("b").agent.log();
    assert!(
        log.contains("an older claimd without the claim index ran as node b"),
        "{log}"
    );
    assert!(c.holders("w").is_empty());
    assert!(log.contains("freed the claim of volume w by allocation old1 on this node"));
    assert!(c.get_json("claim-index/b").is_some());
    assert_eq!(
        c.get_json("node-settings/b").expect("settings")["claim_index"],
        true
    );
    // b was away longer than its window: it releases q1 by itself, and
    // the entry goes with the claim.
    wait_until(RETRY_TIMEOUT, "b to release q1", || c.node("b").no_allocs());
    assert!(c.holders("v").is_empty());
    assert!(index(&c).is_empty(), "{:?}", index(&c));
}

// ---- 3. What it costs etcd ------------------------------------------------------

/// Other nodes' claims planted in etcd: about BULK * 1.5 KB.
const BULK: usize = 2000;
/// A read of every claim sends at least the planted bytes; an index read
/// of one node's few claims, a few KB. Everything else the cluster does
/// in the measured windows (keep-alives, watches, the node's own claims)
/// is far below this.
const FAR_BELOW_A_FULL_READ: f64 = 600_000.0;

#[test]
fn a_restart_and_the_reaper_read_one_nodes_claims_not_every_claim() {
    let mut c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b").stop_after_disconnect(STOP_AFTER),
    ]);
    c.add_volume(&volume("v"));
    c.add_volume(&volume("w"));
    c.node("a").mount_ok("k1", "data=v");
    c.node("b").mount_ok("q1", "data=w");
    // Node z (no agent, no settings: never reaped) holds BULK claims.
    let template = stored_claim(&c, "v", "k1");
    let pad = "p".repeat(1200);
    let bulk: Vec<(String, Value)> = (0..BULK)
        .map(|i| {
            let (v, al) = (format!("bulk{i}"), format!("z{i}"));
            let mut claim = claim_like(&template, &v, &al, "z");
            claim["claim"]["publish_context"] = json!({ "pad": pad });
            (format!("claims/{v}/{al}"), claim)
        })
        .collect();
    put_claims(&c, &bulk);
    let planted: usize = bulk.iter().map(|(_, v)| v.to_string().len()).sum();
    assert!(planted as f64 > 4.0 * FAR_BELOW_A_FULL_READ, "{planted}");
    // A restart: its reconciliation reads a's claims through its index.
    let before = etcd_sent_bytes(&c);
    restart_and_reconcile(&mut c, "a");
    let restart = etcd_sent_bytes(&c) - before;
    eprintln!("a restart: etcd sent {restart} bytes (every claim: {planted})");
    assert!(
        restart < FAR_BELOW_A_FULL_READ,
        "a restart's reconciliation made etcd send {restart} bytes (every claim: {planted})"
    );
    assert_eq!(c.holders("v"), ["k1"]);
    // b goes away for good; a's reaper waits out b's window, looks at b's
    // claims (its index) and keeps q1: nothing can fence w.
    let before = etcd_sent_bytes(&c);
    c.node_mut("b").agent.kill();
    c.wait_gone("b");
    let a = c.node("a");
    wait_until(RETRY_TIMEOUT, "a's reaper to keep b's claim", || {
        a.agent
            .log()
            .contains("volume w stays claimed by unreachable node b")
    });
    let reap = etcd_sent_bytes(&c) - before;
    eprintln!("b gone until a's reaper kept its claim: etcd sent {reap} bytes");
    assert!(
        reap < FAR_BELOW_A_FULL_READ,
        "the reaper's look at b made etcd send {reap} bytes (every claim: {planted})"
    );
    assert_eq!(c.holders("w"), ["q1"]);
    let health = a.agent.cli(&["health"]).stdout;
    assert!(
        health.contains("volume w stays claimed by unreachable node b"),
        "{health}"
    );
    // node remove refuses while b holds q1 (found through the index).
    let e = a
        .agent
        .cli(&["node", "remove", "b"])
        .expect_code(EXIT_FAILED)
        .stderr;
    assert!(e.contains("node b still holds claims of w"), "{e}");
}
