//! Deterministic regression tests for the cluster-safety defects of issue
//! 22 that the tests in tests/cluster/safety.rs do not pin down, one test
//! per defect (numbered as in the issue), each with real agents, a real
//! etcd, real mounts and the test plugin's call log. Each failed on
//! e20db15 (the code before the fixes) for the reason its doc names and
//! passes now:
//!
//! - 3: a restart after the cluster freed the claim sends nothing up
//!   without asking etcd (made deterministic on the old code: its
//!   whole-range reconciliation fails, so nothing races the restore);
//! - 4: the release of allocations whose claims were freed survives a
//!   failed reconciliation;
//! - 6: the self-release does not wait behind a hung detach of another
//!   node;
//! - 7: the self-release counts from the send of the last answered
//!   keep-alive; a call deadline above half the lease is refused;
//! - 8: a reaper lock left on the reaper's own lease is taken back;
//! - 12: the orphan filter does not compare wall clocks;
//! - 15 (second half): "last renewed X ago" after a restart counts from
//!   the persisted renewal, not from the agent's start;
//! - part A's holes "a mount resumed after a pause" and "a node returning
//!   with a new lease": neither carries on under the claim it had.
//!
//! The harness is tests/cluster/harness/, plus
//! tests/cluster/harness/etcd_faults.rs (a proxy that delays replies, ballast
//! for an oversized claims range, libfaketime).

use std::time::{Duration, Instant};

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::Etcd;
use crate::harness::etcd_faults::*;
use crate::harness::*;
use serde_json::{json, Value};

/// A single-writer volume.
fn volume() -> Value {
    volume_json("v", "ext-v", &["single-node-writer"])
}

/// The call-log lines of `method` made at or after `since_ms`.
fn calls_since(n: &Node, method: &str, since_ms: u64) -> Vec<Value> {
    n.calls_of(method)
        .into_iter()
        .filter(|c| ts(c) >= since_ms)
        .collect()
}

/// The agent's log written after byte `from`.
fn log_since(n: &Node, from: usize) -> String {
    n.agent.log().get(from..).unwrap_or_default().to_string()
}

/// An operator frees `alloc`'s claim of v from node `by` (the holder's
/// node is gone): the claim goes, with a `freed/` note.
fn free_by_hand(c: &Cluster, by: &str, alloc: &str) {
    c.node(by)
        .agent
        .cli(&["claim", "free", "v", alloc, "--reason", "regression test"])
        .ok();
    assert!(c.holders("v").is_empty(), "{:?}", c.holders("v"));
    assert!(c.get_json(&format!("freed/v/{alloc}")).is_some());
}

// ---- 7. The self-release counts from the send --------------------------------------

/// The lease ID of `node`'s liveness key.
fn lease_of(c: &Cluster, node: &str) -> claimd::etcd::LeaseId {
    c.etcd
        .client()
        .get(format!("{PREFIX}/nodes/{node}"))
        .expect("read etcd")
        .unwrap_or_else(|| panic!("nodes/{node} exists"))
        .lease
        .expect("the liveness key is on a lease")
}

// ---- 12. The orphan filter compares revisions, not wall clocks ---------------------

/// The wall-clock time (ms since the epoch) of an agent log line
/// (`2026-12-02T15:04:05.678Z INFO ...`).
fn log_line_ms(line: &str) -> Option<u64> {
    let stamp = line.split(' ').next()?;
    let (date, time) = stamp.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, millis) = time.split_once('.')?;
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (hh, mm, ss) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    // Days since 1970-01-01 of a proleptic Gregorian date.
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs * 1000 + millis.parse::<i64>().ok()?).ok()
}

/// Starts node `n`'s agent again with `envs` added to its environment;
/// waits for its plugin to be ready (so that a mount takes its claim in
/// its first transaction).
fn restart_with(n: &mut Node, envs: &[(String, String)]) {
    n.agent.kill();
    n.agent.envs = envs.to_vec();
    n.agent.spawn();
    n.agent.wait_listening();
    wait_until(SHOW_TIMEOUT, "the node plugin to be ready", || {
        n.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"] == "ready"
    });
}

// ---- A. A mount resumed after a pause ----------------------------------------------

/// What main's check before a call up says of a claim etcd no longer
/// holds (`ClaimStore::check_call_up`).
const GONE_IN_ETCD: &str = "the claim of allocation p1 is no longer held in etcd";

/// The call-log lines of `method` for external node `node` made at or
/// after `since_ms`.
fn calls_for_since(n: &Node, method: &str, node: &str, since_ms: u64) -> Vec<Value> {
    calls_since(n, method, since_ms)
        .into_iter()
        .filter(|c| c["node_id"] == node)
        .collect()
}

// ---- Issue 41: a take that did not answer ---------------------------------------

/// A claim store of node `a` as an agent has it: fenced, its liveness
/// registered (by the agent's own liveness thread) on a client of its own,
/// its claims through `endpoints`. Dropping the returned shutdown's guard
/// is left to the test's end.
struct NodeA {
    store: claimd::claims::EtcdClaims,
    shutdown: claimd::shutdown::Shutdown,
    _liveness: claimd::cluster::NodeLiveness,
    _dir: TestDir,
}

impl Drop for NodeA {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn node_a(etcd: &Etcd, endpoints: &[String]) -> NodeA {
    use std::sync::Arc;
    let dir = TestDir::new();
    let state = Arc::new(claimd::state::StateStore::open(dir.path()).expect("a state directory"));
    let fencing = Arc::new(
        claimd::claims::fencing::Fencing::open(
            dir.path(),
            "instance-a",
            state.boot_id(),
            claimd::claims::margins::ReleaseBounds::new(
                None,
                Duration::from_secs(30),
                Duration::from_secs(60),
            ),
        )
        .expect("a fencing state"),
    );
    let shutdown = claimd::shutdown::Shutdown::new();
    let liveness = claimd::cluster::NodeLiveness::start(
        etcd.client(),
        PREFIX,
        "a",
        Duration::from_secs(30),
        shutdown.clone(),
        Vec::new(),
        fencing.clone(),
        claimd::cluster::RegistrationHooks {
            before_register: Box::new(|| Ok(())),
            on_registered: Box::new(|| {}),
        },
    )
    .expect("start the liveness thread");
    wait_until(SHOW_TIMEOUT, "node a to be registered", || {
        fencing.valid_lease().is_some()
    });
    let client = claimd::etcd::EtcdClient::connect(endpoints, etcd.options(Duration::from_secs(2)))
        .expect("a client");
    let store = claimd::claims::EtcdClaims::new(client, PREFIX, state)
        .with_node("a")
        .with_fencing(fencing);
    NodeA {
        store,
        shutdown,
        _liveness: liveness,
        _dir: dir,
    }
}

/// One change through the store's contract, as the lifecycle makes it;
/// its outcome (the local record is left alone).
fn change(
    store: &claimd::claims::EtcdClaims,
    c: claimd::claims::ClaimChange,
) -> Result<(), claimd::claims::ClaimError> {
    use claimd::claims::{Applied, ClaimStore, Transaction};
    let mut record =
        |_: &mut claimd::state::StateFile, _: &[Result<(), claimd::claims::ClaimError>]| {};
    let applied = store
        .transact(Transaction {
            changes: vec![c],
            wanted: &|_| true,
            record: &mut record,
            closing: false,
        })
        .expect("the local write");
    let Applied::Done(mut outcomes) = applied else {
        panic!("the change was not wanted")
    };
    outcomes.remove(0)
}

fn take_q(alloc: &str) -> claimd::claims::ClaimChange {
    claimd::claims::ClaimChange::Take(claimd::claims::ClaimRequest {
        volume_id: "v".to_string(),
        alloc_id: alloc.to_string(),
        node: "a".to_string(),
        mode: claimd::claims::ClaimMode::Write,
        access_mode: claimd::volumes::AccessMode::SingleNodeWriter,
        external_node_id: None,
        storage: None,
    })
}

fn free_q(alloc: &str) -> claimd::claims::ClaimChange {
    claimd::claims::ClaimChange::Free {
        volume_id: "v".to_string(),
        alloc_id: alloc.to_string(),
        holder: Some("a".to_string()),
        while_gone: false,
        by_hand: None,
    }
}

fn delay_proxy(etcd: &Etcd) -> DelayProxy {
    let target = format!("127.0.0.1:{}", etcd.client_port())
        .parse()
        .expect("an address");
    DelayProxy::start(target)
}

/// A read by the store through its current endpoint, which must pass
/// `proxy`.
fn through(a: &NodeA, proxy: &DelayProxy) {
    let before = proxy.answers();
    a.store
        .client()
        .get(format!("{PREFIX}/warm-up"))
        .expect("a read through the proxy");
    assert!(proxy.answers() > before, "the read did not pass the proxy");
}

/// Lets `proxy` deliver the `n` requests it kept and waits until etcd
/// answered them.
fn deliver(proxy: &DelayProxy, n: u64) {
    let answered = proxy.answers();
    proxy.release_requests();
    wait_until(SHOW_TIMEOUT, "etcd to answer what the proxy kept", || {
        proxy.answers() >= answered + n
    });
}

/// A read by the store kept by `proxy` (its current endpoint): it fails
/// at its deadline, and the store's client moves to its next endpoint.
fn kept_read(a: &NodeA, proxy: &DelayProxy) {
    proxy.keep_requests_dropping_cancels();
    let r = a.store.client().get(format!("{PREFIX}/kept"));
    assert!(r.is_err(), "the kept read answered: {r:?}");
}

fn claim_in_etcd(etcd: &Etcd, alloc: &str) -> bool {
    etcd.client()
        .get(format!("{PREFIX}/claims/v/{alloc}"))
        .expect("read the claim")
        .is_some()
}

mod pauses_and_lost_answers;
mod restore_and_release;
