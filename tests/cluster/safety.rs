//! Cluster safety (issue 22): the cases in which a single-writer volume
//! could end up in use on two nodes, or a claim freed while its volume is
//! still mounted, each reproduced with real agents, a real etcd, real
//! mounts and the test plugin's call log. Each of these fails on e20db15:
//!
//! 1. a paused agent's node-only volume is not given to another node (the
//!    cluster cannot fence it): it stays claimed, the reaper says so;
//! 2. an agent restarted while cut off keeps counting its self-release
//!    from its last renewal (persisted), not from its restart;
//! 3. an agent restarted after the cluster freed its claim does not stage
//!    or publish the volume again: it releases the allocation;
//! 4. a volume is deregistered only while it has no claim (one `Txn`);
//! 5. a second instance of a node name neither registers nor frees the
//!    first one's claims;
//! 6. a forwarded controller call that outlasts its requester's wait is
//!    reported as in progress and removed once finished.
//!
//! Also here: a fenced volume of a paused node moves only after the fence.
//!
//! The harness is tests/cluster/harness/.

use std::path::Path;
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use serde_json::{json, Value};

/// A single-writer volume.
fn volume() -> Value {
    volume_json("v", "ext-v", &["single-node-writer"])
}

/// SIGSTOPs the node's agent; returns once every thread is stopped.
fn stop(n: &Node) -> u32 {
    let pid = n.agent.pid().expect("the agent runs");
    freeze(pid, "the agent");
    pid
}

/// The call-log lines of `method` made after `since_ms`.
fn calls_since(n: &Node, method: &str, since_ms: u64) -> Vec<Value> {
    n.calls_of(method)
        .into_iter()
        .filter(|c| ts(c) >= since_ms)
        .collect()
}

fn assert_mounted(path: &Path) {
    assert!(
        is_mount_point(path),
        "{} is no longer mounted",
        path.display()
    );
}

// ---- 1. A paused node's node-only volume stays claimed ----------------------

#[test]
fn a_paused_agents_node_only_volume_is_not_given_to_another_node() {
    let c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b").stop_after_disconnect(STOP_AFTER),
    ]);
    c.add_volume(&volume());
    let (a, b) = (c.node("a"), c.node("b"));
    let path = a.mount_ok("p1", "data=v");
    b.mount_waiting("q1", "data=v");
    wait_until(SHOW_TIMEOUT, "q1 to wait for p1", || {
        b.volume_status("q1")["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("p1", "a"))
    });
    let pid = stop(a);
    c.wait_gone("a");
    // b's reaper waits out a's window and margins, then keeps the claim:
    // nothing can fence a node-only volume from a paused node.
    wait_until(RETRY_TIMEOUT, "b's reaper to keep a's claim", || {
        b.agent
            .log()
            .contains("volume v stays claimed by unreachable node a")
    });
    assert_eq!(c.holders("v"), ["p1"]);
    // claim list shows it held by an unreachable node, and what frees it.
    assert_eq!(b.claims("v")[0]["holder_unreachable"], true);
    let text = b.agent.cli(&["claim", "list"]).ok().stdout;
    assert!(text.contains("a (unreachable)"), "{text}");
    assert!(
        text.contains("claimd volume detach v --node a --reason"),
        "{text}"
    );
    // So do health (degraded, with the command) and the metrics.
    let health = b.agent.cli(&["health"]);
    assert!(
        health
            .stdout
            .contains("volume v stays claimed by unreachable node a (gone since 20")
            && health
                .stdout
                .contains("claimd volume detach v --node a --reason"),
        "{health:?}"
    );
    let metrics = b.agent.cli(&["metrics"]).ok().stdout;
    assert!(
        metrics.contains("claimd_cluster_unreachable_holds{node=\"a\"} 1"),
        "{metrics}"
    );
    assert_ne!(b.volume_status("q1")["phase"], "published");
    assert!(b.calls_of(NP).is_empty(), "{:?}", b.calls_of(NP));
    assert!(c.keys("freed/").is_empty());
    assert_mounted(&path);
    // a goes on: its own clock says its lease is long gone, so it lets go
    // by itself; then b gets the volume, after a's unmount.
    thaw(pid, "the agent");
    wait_until(RETRY_TIMEOUT, "b's mount after a let go", || {
        b.volume_status("q1")["phase"] == "published"
    });
    assert!(!is_mount_point(&path));
    let nup = a.one_call(NUP);
    let np = b.one_call(NP);
    assert!(ts(&np) >= ts(&nup), "b published {np} before a's {nup}");
    assert!(a.agent.log().contains("released while disconnected"));
    assert_eq!(c.holders("v"), ["q1"]);
    // Back and released: b no longer shows a hold.
    wait_until(SHOW_TIMEOUT, "b's health to drop a's hold", || {
        !b.agent
            .cli(&["health"])
            .stdout
            .contains("stays claimed by unreachable node a")
    });
    let metrics = b.agent.cli(&["metrics"]).ok().stdout;
    assert!(
        !metrics.contains("claimd_cluster_unreachable_holds{"),
        "{metrics}"
    );
}

/// The same pause with a volume the cluster can fence (a plugin listed in
/// `fencing_plugins` whose ControllerUnpublish cuts the node off): the
/// reaper detaches it from the paused node first, the fence unmounts the
/// paused node's paths, and only then does the other node get it.
#[test]
fn a_paused_agents_fenced_volume_moves_after_the_fence() {
    let c = Cluster::start(vec![
        host("h", &["a", "b"]).fencing().fenced_storage(),
        node_only("a")
            .stop_after_disconnect(STOP_AFTER)
            .fenced_storage(),
        node_only("b").fencing().fenced_storage(),
    ]);
    c.add_volume(&volume());
    let (h, a, b) = (c.node("h"), c.node("a"), c.node("b"));
    let path = a.mount_ok("p1", "data=v");
    b.mount_waiting("q1", "data=v");
    let pid = stop(a);
    c.wait_gone("a");
    wait_until(RETRY_TIMEOUT, "b's mount after the fence", || {
        b.volume_status("q1")["phase"] == "published"
    });
    // a is still paused: it did nothing; the fence unmounted its target.
    assert!(!is_mount_point(&path), "{} still mounted", path.display());
    assert!(a.calls_of(NUP).is_empty(), "{:?}", a.calls_of(NUP));
    let cup = h
        .calls_of(CUP)
        .into_iter()
        .find(|c| c["node_id"] == "ext-a")
        .expect("a ControllerUnpublish of a");
    let np = b.one_call(NP);
    assert!(
        ts(&np) >= ts(&cup),
        "b published {np} before the fence {cup}"
    );
    let fence = c.dir.path().join("storage/fencing/ext-v/ext-a/fenced");
    let marker: Value =
        serde_json::from_str(&std::fs::read_to_string(&fence).expect("the fence marker"))
            .expect("JSON");
    assert!(
        marker["unmounted"]
            .as_array()
            .is_some_and(|l| l.iter().any(|p| p.as_str() == path.to_str())),
        "{marker}"
    );
    let note = c.get_json("freed/v/p1").expect("a freed note");
    assert_eq!(note["claim"]["node"], "a", "{note}");
    assert_eq!(c.holders("v"), ["q1"]);
    thaw(pid, "the agent");
    // a comes back: its release of p1 finishes, nothing of a is mounted.
    wait_until(RETRY_TIMEOUT, "a to drop p1", || a.no_allocs());
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert_eq!(c.holders("v"), ["q1"]);
}

// ---- 2. A restart during a partition keeps the self-release clock -----------

#[test]
fn a_restart_while_cut_off_does_not_reset_the_self_release_clock() {
    const WINDOW: &str = "5s";
    const WINDOW_MS: u64 = 5000;
    let mut c = Cluster::start(vec![
        nfs_node("a").proxied().stop_after_disconnect(WINDOW),
        nfs_node("b"),
    ]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    let lease_clock = c.node("a").agent.config.state_dir.join("lease-clock.json");
    wait_until(SHOW_TIMEOUT, "a's lease clock file", || {
        lease_clock.exists()
    });
    let cut_at = now_ms();
    c.node("a").cut();
    c.node_mut("a").agent.kill();
    assert_mounted(&path);
    // Restart a (still cut off) once its window has passed since the cut.
    wait_until(RETRY_TIMEOUT, "a's window to pass", || {
        now_ms() >= cut_at + WINDOW_MS + 500
    });
    let restarted_at = now_ms();
    c.node_mut("a").agent.restart();
    let a = c.node("a");
    // It lets go at once: its last renewal is older than the window.
    wait_until(RETRY_TIMEOUT, "a's NodeUnpublish after the restart", || {
        !calls_since(a, NUP, restarted_at).is_empty()
    });
    let nup = &calls_since(a, NUP, restarted_at)[0];
    assert!(
        ts(nup) < restarted_at + WINDOW_MS,
        "a released {} ms after its restart, as if its clock had started again",
        ts(nup) - restarted_at
    );
    assert!(!is_mount_point(&path));
    // Nothing was staged or published again meanwhile.
    assert!(calls_since(a, NS, restarted_at).is_empty());
    assert!(calls_since(a, NP, restarted_at).is_empty());
    a.heal();
    c.wait_alive("a");
    wait_until(RETRY_TIMEOUT, "a to free p1", || c.holders("v").is_empty());
}

// ---- 3. A restart after the cluster freed the claim -------------------------

#[test]
fn a_restart_after_the_cluster_freed_the_claim_stages_and_publishes_nothing() {
    // b opts in to freeing unfenced claims: the cluster frees a's claim.
    let mut c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b")
            .stop_after_disconnect(STOP_AFTER)
            .cluster_field("free_unfenced_claims", json!(true)),
    ]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    c.node_mut("a").agent.kill();
    // The mounts vanish while the agent is down (an operator's umount, or
    // the plugin's own cleanup): its restore would mount them again.
    for m in c.node("a").mounts().iter().rev() {
        let out = std::process::Command::new("umount")
            .arg(&m.mount_point)
            .output()
            .expect("run umount");
        assert!(out.status.success(), "umount {:?}: {out:?}", m.mount_point);
    }
    assert!(!is_mount_point(&path));
    c.wait_gone("a");
    wait_until(RETRY_TIMEOUT, "the cluster to free p1", || {
        c.get_json("freed/v/p1").is_some()
    });
    c.node("b").mount_ok("q1", "data=v");
    let restarted_at = now_ms();
    c.node_mut("a").agent.restart();
    let a = c.node("a");
    wait_until(RETRY_TIMEOUT, "a to release p1", || a.no_allocs());
    assert!(
        calls_since(a, NS, restarted_at).is_empty(),
        "{:?}",
        calls_since(a, NS, restarted_at)
    );
    assert!(calls_since(a, NP, restarted_at).is_empty());
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert_eq!(c.holders("v"), ["q1"]);
    assert_eq!(c.node("b").targets().len(), 1);
}

// ---- 4. Deregistration and a claim -------------------------------------------

#[test]
fn the_shared_registration_of_a_claimed_volume_is_not_deleted() {
    let c = Cluster::start(vec![nfs_node("a")]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    // The agent's own check (a claim list) comes first; the delete itself
    // must hold against a take that lands between that list and it: one
    // `Txn` comparing the volume's claims range empty.
    let state_dir = TestDir::new();
    let state = std::sync::Arc::new(
        claimd::state::StateStore::open(state_dir.path()).expect("a state directory"),
    );
    let store = claimd::claims::EtcdClaims::new(c.etcd.client(), PREFIX, state);
    let r = claimd::claims::SharedVolumes::delete(&store, "v");
    assert!(
        r.is_err(),
        "deleted the registration of a claimed volume: {r:?}"
    );
    assert!(c.get_json("volumes/v").is_some());
    c.node("a").release_ok("p1");
    let r = claimd::claims::SharedVolumes::delete(&store, "v");
    assert_eq!(r, Ok(true));
    assert!(c.get_json("volumes/v").is_none());
}

// ---- 5. A reused node name ----------------------------------------------------

/// A second machine with the same `node_name` (a replaced or restored VM,
/// a new state directory) is another instance: it does not register while
/// the original's lease is alive, and once it does (the original cut off),
/// it does not free the original's claims, although nothing of them is
/// mounted on it.
#[test]
fn a_second_instance_of_a_node_name_neither_registers_nor_frees_the_claims() {
    let c = Cluster::start(vec![nfs_node("a").proxied()]);
    c.add_volume(&volume());
    let a = c.node("a");
    let path = a.mount_ok("p1", "data=v");
    let original = c.get_json("nodes/a").expect("nodes/a");
    // The twin: its own directory, plugin and state, the same name.
    let tdir = c.dir.path().join("twin");
    let plugin = TestPlugin::builder(&tdir)
        .no_controller()
        .node_id("ext-a")
        .start();
    let mut config =
        AgentConfig::new(&tdir, Some(&plugin.socket)).cluster_node("a", &[c.etcd.endpoint()]);
    let cluster = config.cluster.as_mut().expect("a cluster section");
    cluster["lease_ttl"] = json!(LEASE_TTL);
    cluster["call_timeout"] = json!("1s");
    let mut twin = Agent::prepare(&tdir, "agent", config, false, &[]);
    twin.spawn();
    twin.wait_listening();
    wait_until(SHOW_TIMEOUT, "the twin to be refused", || {
        twin.log()
            .contains("registered in etcd by another instance")
    });
    assert_eq!(
        c.get_json("nodes/a").expect("nodes/a")["instance"],
        original["instance"]
    );
    // The original is cut off: its lease ends, the twin registers and
    // reconciles, and keeps the original's claim.
    a.cut();
    wait_until(RETRY_TIMEOUT, "the twin to register", || {
        c.get_json("nodes/a")
            .is_some_and(|r| r["instance"] != original["instance"])
    });
    wait_until(RETRY_TIMEOUT, "the twin's reconciliation", || {
        twin.log().contains("by another instance") && twin.log().contains("not freed by this one")
    });
    assert_eq!(
        c.holders("v"),
        ["p1"],
        "twin: {}\na: {}",
        twin.log(),
        a.agent.log()
    );
    assert_mounted(&path);
    // The twin cannot take the claim over either.
    let out = twin.cli(&["alloc", "mount", "p1", "--volume", "data=v", "--json"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("another instance"), "{}", out.stderr);
    assert!(mounts_under(&tdir).is_empty());
    assert_eq!(c.holders("v"), ["p1"]);
    twin.kill();
    a.heal();
}

// ---- 6. A forwarded call its requester gave up on ----------------------------

/// A volume operation forwarded to a controller host that outlasts the
/// requester's wait: the requester says the host is performing it (its
/// outcome unknown), not that it failed; and the finished call is removed
/// from etcd although its requester no longer reads it (issue 22, defect
/// 11). (A call nobody took is withdrawn by the requester; a host refuses
/// one whose wait has passed: not tested here.)
#[test]
fn a_forwarded_call_outlasting_its_wait_is_reported_in_progress_and_cleaned_up() {
    // The host's CSI deadline well above the 5 s delay: the call must
    // finish OK on the host, only the requester's wait runs out.
    let c = Cluster::start(vec![
        host("h", &["b"]).csi_call_timeout("60s"),
        node_only("b").cluster_field("attach_timeout", json!("2s")),
    ]);
    let (h, b) = (c.node("h"), c.node("b"));
    let definition = json!({
        "id": "db",
        "plugin_id": PLUGIN_ID,
        "access_modes": ["single-node-writer"],
        "attachment_modes": ["file-system"],
        "capacity_range": {"required_bytes": 1_048_576},
    });
    let socket = b
        .agent
        .config
        .api_socket
        .to_str()
        .expect("UTF-8")
        .to_string();
    let text = serde_json::to_vec(&definition).expect("encode");
    run_claimd(
        &["volume", "create", "-", "--socket", &socket, "--json"],
        Some(&text),
        &[],
        MOUNT_TIMEOUT,
    )
    .ok();
    h.plugin.faults().set(json!([
        {"method": "DeleteVolume", "action": "delay", "ms": 5000, "count": 1}
    ]));
    let out = b.agent.cli(&["volume", "delete", "db"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr
            .contains("is performing the forwarded DeleteVolume call"),
        "{}",
        out.stderr
    );
    wait_until(RETRY_TIMEOUT, "the host's DeleteVolume", || {
        !h.calls_of("DeleteVolume").is_empty()
    });
    assert_eq!(h.calls_of("DeleteVolume")[0]["code"], "OK");
    // The host logs the removal after its Txn answered: waiting for the
    // key alone and then reading the log raced that line (CI, once).
    wait_until(
        RETRY_TIMEOUT,
        "the host to remove the finished call",
        || h.agent.log().contains("removed the finished call"),
    );
    assert!(c.keys("controller-calls/").is_empty());
    assert!(c.keys("controller-call-locks/").is_empty());
}

// ---- 7. A release waiting for etcd ---------------------------------------------

/// A release cut off from etcd does its node side at once and retries
/// freeing the claim with a growing backoff; when etcd answers again it
/// frees the claim at once, not at its next backoff step (issue 22,
/// defect 15: 28 s later in one run).
#[test]
fn a_release_waiting_for_etcd_frees_its_claim_as_soon_as_etcd_answers() {
    let c = Cluster::start(vec![nfs_node("a").proxied()]);
    c.add_volume(&volume());
    let a = c.node("a");
    a.mount_ok("p1", "data=v");
    a.cut();
    a.agent.cli(&["alloc", "release", "p1"]).ok();
    // Seven failed attempts: the next step is 32 s (±25 %) away.
    wait_until(RETRY_TIMEOUT, "seven failed attempts to free p1", || {
        let log = a.agent.log();
        let failed = log
            .lines()
            .filter(|l| l.contains("release of p1/data:") && l.ends_with("(retrying)"));
        failed.count() >= 7
    });
    assert_eq!(c.holders("v"), ["p1"]);
    a.heal();
    // Well before the next step (at least 24 s away): freed once the node
    // registered again (its own retries are 2 s apart at most).
    wait_until(
        Duration::from_secs(20),
        "p1 freed as soon as etcd answers",
        || c.holders("v").is_empty(),
    );
    wait_until(SHOW_TIMEOUT, "a to drop p1", || a.no_allocs());
}

// ---- 8. The fencing token --------------------------------------------------------

/// A controller host attaches only for a claim that still holds: the
/// request carries the claim's epoch (its etcd create revision), and an
/// attach whose claim is freed while the host's ControllerPublish runs is
/// undone by the host itself, so nothing stays attached to a requester
/// that is paused and cannot roll back.
#[test]
fn an_attach_whose_claim_goes_during_the_call_is_undone_by_the_host() {
    let c = Cluster::start(vec![
        host("h", &["a", "b"])
            .plugin_args(&["--log-starts"])
            .csi_call_timeout("60s"),
        node_only("a"),
        node_only("b"),
    ]);
    c.add_volume(&volume());
    let (h, a, b) = (c.node("h"), c.node("a"), c.node("b"));
    h.plugin.faults().set(json!([
        {"method": CP, "action": "delay", "ms": 4000, "count": 1}
    ]));
    a.mount_waiting("p1", "data=v");
    wait_until(
        SHOW_TIMEOUT,
        "the host's ControllerPublish to start",
        || {
            h.plugin
                .call_log()
                .open_calls()
                .iter()
                .any(|l| l["method"] == CP)
        },
    );
    let epoch = c.get_json("attachments/v/a").expect("the attach request")["epoch"].clone();
    assert!(epoch.as_i64().is_some_and(|e| e > 0), "epoch {epoch}");
    let pid = stop(a);
    b.agent
        .cli(&["claim", "free", "v", "p1", "--force", "--reason", "test"])
        .ok();
    wait_until(RETRY_TIMEOUT, "the host to undo the attach", || {
        h.agent
            .log()
            .contains("attached to node a for a claim that went meanwhile")
    });
    assert!(
        !h.attachments()
            .contains(&("ext-v".to_string(), "ext-a".to_string())),
        "{:?}",
        h.attachments()
    );
    let cup = h.calls_of(CUP);
    assert!(cup.iter().any(|x| x["node_id"] == "ext-a"), "{cup:?}");
    let rec = c.get_json("attachments/v/a").expect("the attach request");
    assert_eq!(rec["state"], "failed", "{rec}");
    // b can have the volume now.
    b.mount_ok("q1", "data=v");
    thaw(pid, "the agent");
    wait_until(RETRY_TIMEOUT, "a to give up p1", || a.no_allocs());
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert_eq!(c.holders("v"), ["q1"]);
}

// ---- 9. Absence counted from fresh observations ------------------------------

/// An observer counts a node's absence only while it can observe: one cut
/// off itself (its own lease not valid, its reads failing) starts counting
/// again once it is back, and waits the whole W = D + U + τ + 2ρD + M from
/// there (issue 22, defect 5: on e20db15 an observer back from its own
/// partition freed at once).
#[test]
fn an_observer_back_from_its_own_partition_counts_the_absence_again() {
    let mut c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b")
            .proxied()
            .cluster_field("free_unfenced_claims", json!(true)),
    ]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    c.node_mut("a").agent.kill();
    c.wait_gone("a");
    let b = c.node("b");
    b.cut();
    // Cut off longer than a's whole wait W.
    let wait_ms = STOP_AFTER_MS + 2 * 5000 + 3000;
    let cut_at = now_ms();
    wait_until(RETRY_TIMEOUT, "b's cut to outlast W", || {
        now_ms() >= cut_at + wait_ms
    });
    assert!(c.get_json("freed/v/p1").is_none());
    let healed_at = now_ms();
    b.heal();
    wait_until(RETRY_TIMEOUT, "b to free p1", || {
        c.get_json("freed/v/p1").is_some()
    });
    let note = c.get_json("freed/v/p1").expect("the freed note");
    let at = note["at_ms"].as_u64().expect("at_ms");
    // W > D + U (U: twice the 5 s CSI call deadline), counted from the heal.
    assert!(
        at >= healed_at + STOP_AFTER_MS + 2 * 5000,
        "freed {} ms after b came back",
        at.saturating_sub(healed_at)
    );
}

// ---- The epoch: the fencing token reaches the plugins that ask for it -------

/// The epoch under `claimd.io/epoch` in a call-log line's `field`.
fn epoch_in(call: &Value, field: &str) -> Option<i64> {
    call[field][EPOCH_KEY]
        .as_str()
        .map(|e| e.parse().expect("a number"))
}

const EPOCH_KEY: &str = "claimd.io/epoch";

/// With the plugin in `cluster.epoch_plugins`, the claim's epoch (its etcd
/// create revision) goes into ControllerPublish's volume context and the
/// publish context of NodeStage and NodePublish, and `alloc status` shows
/// it. A plugin that enforces it (`--epoch-key`, one storage for both
/// nodes) then refuses a call made under the older claim, as storage with
/// a generation number would refuse a late request of a fenced node.
#[test]
fn the_claims_epoch_reaches_the_plugins_that_ask_for_it() {
    let spec = |name: &str| {
        host(name, &[])
            .fenced_storage()
            .plugin_args(&["--epoch-key", EPOCH_KEY])
            .cluster_field("epoch_plugins", json!([PLUGIN_ID]))
    };
    let c = Cluster::start(vec![spec("a"), spec("b")]);
    c.add_volume(&volume());
    let (a, b) = (c.node("a"), c.node("b"));
    let epoch_of = |alloc: &str| {
        c.etcd
            .client()
            .get(format!("{PREFIX}/claims/v/{alloc}"))
            .expect("read etcd")
            .expect("the claim")
            .create_revision
    };
    a.mount_ok("p1", "data=v");
    let e1 = epoch_of("p1");
    assert_eq!(epoch_in(&a.one_call(CP), "volume_context"), Some(e1));
    assert_eq!(epoch_in(&a.one_call(NS), "publish_context"), Some(e1));
    assert_eq!(epoch_in(&a.one_call(NP), "publish_context"), Some(e1));
    assert_eq!(a.volume_status("p1")["epoch"], json!(e1));
    let text = a.agent.cli(&["alloc", "status", "p1"]).ok().stdout;
    assert!(
        text.contains("EPOCH") && text.contains(&e1.to_string()),
        "{text}"
    );
    a.release_ok("p1");
    b.mount_ok("q1", "data=v");
    let e2 = epoch_of("q1");
    assert!(e2 > e1, "the newer claim's epoch {e2} is not above {e1}");
    assert_eq!(epoch_in(&b.one_call(NP), "publish_context"), Some(e2));
    // A ControllerPublish under p1's claim, arriving late: refused.
    let late = a
        .plugin
        .client()
        .controller_publish_volume(&single_writer_publish("ext-v", &ext("a"), e1))
        .expect_err("a call under the older claim");
    let msg = format!("{late}");
    assert!(
        msg.contains(&format!("epoch {e1} is older than {e2}")),
        "{msg}"
    );
    // Without the setting a plugin gets no key (the spec has the contexts
    // match what the plugin answered).
    let plain = Cluster::start(vec![host("c", &[])]);
    plain.add_volume(&volume());
    let n = plain.node("c");
    n.mount_ok("r1", "data=v");
    assert_eq!(epoch_in(&n.one_call(NP), "publish_context"), None);
    assert_eq!(epoch_in(&n.one_call(CP), "volume_context"), None);
    assert!(n.volume_status("r1")["epoch"]
        .as_i64()
        .is_some_and(|e| e > 0));
}

/// Issue 37, item 3: a mount whose plugins were ready took its claim in
/// its first write, and that intent did not keep the claim's epoch (only
/// a take that waited did); a call up computed the epoch before the check
/// that reads the claim back could fill it in. So after a restart the
/// restore's NodeStage and NodePublish reached an epoch-checking plugin
/// without `claimd.io/epoch`, and `alloc status` showed no epoch. Node a
/// mounts p1, is killed, its mounts vanish, it starts again: the restore's
/// calls carry p1's epoch and `alloc status` shows it.
///
/// On f62dff5: the restore's NodeStage had no epoch (None, not Some(e)).
#[test]
fn the_epoch_survives_a_restart_and_reaches_the_restores_calls() {
    let spec = host("a", &[])
        .plugin_args(&["--epoch-key", EPOCH_KEY])
        .cluster_field("epoch_plugins", json!([PLUGIN_ID]));
    let mut c = Cluster::start(vec![spec]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    let e1 = c
        .etcd
        .client()
        .get(format!("{PREFIX}/claims/v/p1"))
        .expect("read etcd")
        .expect("the claim")
        .create_revision;
    let a = c.node_mut("a");
    a.agent.kill();
    a.unmount_all();
    a.agent.spawn();
    a.agent.wait_listening();
    wait_until(SHOW_TIMEOUT, "the restore to publish p1 again", || {
        a.calls_of(NP).len() == 2
    });
    let stage = a.calls_of(NS).pop().expect("the restore's NodeStage");
    assert_eq!(epoch_in(&stage, "publish_context"), Some(e1), "{stage}");
    let publish = a.calls_of(NP).pop().expect("the restore's NodePublish");
    assert_eq!(epoch_in(&publish, "publish_context"), Some(e1), "{publish}");
    assert_eq!(a.volume_status("p1")["epoch"], json!(e1));
}

/// ControllerPublishVolume of a single-writer mount volume with `epoch`
/// in its volume context.
fn single_writer_publish(
    volume: &str,
    node: &str,
    epoch: i64,
) -> claimd::csi::ControllerPublishVolumeRequest {
    use claimd::csi::volume_capability::{access_mode::Mode, AccessMode, Access_type, MountVolume};
    let mut cap = claimd::csi::VolumeCapability::new();
    cap.access_type = Some(Access_type::Mount(MountVolume::new()));
    let mut am = AccessMode::new();
    am.mode = Mode::SINGLE_NODE_WRITER.into();
    cap.access_mode = Some(am).into();
    let mut r = claimd::csi::ControllerPublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.node_id = node.to_string();
    r.volume_capability = Some(cap).into();
    r.volume_context
        .insert(EPOCH_KEY.to_string(), epoch.to_string());
    r
}

// ---- A restore does not wait for a claim held elsewhere ------------------------

/// A restored mount that waits for a claim another node holds goes on in
/// the background: the restarted agent answers at once, not after its
/// restore wait (plugin_wait + csi_call, here over 10 minutes), and mounts
/// the volume once the holder lets go.
#[test]
fn a_restored_mount_waiting_for_a_held_claim_does_not_hold_the_api() {
    let mut c = Cluster::start(vec![
        nfs_node("a"),
        nfs_node("b").plugin_wait_timeout("10m"),
    ]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    let waiting = |b: &Node| {
        b.volume_status("q1")["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("p1", "a"))
    };
    let b = c.node("b");
    b.mount_waiting("q1", "data=v");
    wait_until(SHOW_TIMEOUT, "q1 to wait for p1", || waiting(b));
    // Within the harness's start bound (30 s), far below the restore wait.
    let b = c.node_mut("b");
    b.agent.restart();
    wait_until(SHOW_TIMEOUT, "the restarted agent to say q1 waits", || {
        waiting(b)
    });
    assert!(
        b.agent
            .log()
            .contains("restore: allocation q1 waits for the cluster; it goes on in the background"),
        "{}",
        b.agent.log()
    );
    c.node("a").release_ok("p1");
    let b = c.node("b");
    wait_until(RETRY_TIMEOUT, "q1 to be mounted once p1 let go", || {
        b.volume_status("q1")["phase"] == "published"
    });
}

// ---- node remove ------------------------------------------------------------------

/// `node remove` forgets a node gone for good only once nothing of it is
/// left: refused while it is alive, for the agent's own node, and while it
/// holds claims; then its settings go (every reaper stops looking at it).
#[test]
fn node_remove_forgets_a_gone_node_only_once_nothing_of_it_is_left() {
    let mut c = Cluster::start(vec![
        nfs_node("a").stop_after_disconnect(STOP_AFTER),
        nfs_node("b").stop_after_disconnect(STOP_AFTER),
    ]);
    c.add_volume(&volume());
    c.node("b").mount_ok("q1", "data=v");
    let refused =
        |c: &Cluster, args: &[&str]| c.node("a").agent.cli(args).expect_code(EXIT_FAILED).stderr;
    let e = refused(&c, &["node", "remove", "b"]);
    assert!(e.contains("node b is alive"), "{e}");
    let e = refused(&c, &["node", "remove", "a"]);
    assert!(e.contains("this agent's own node"), "{e}");
    c.node_mut("b").agent.kill();
    c.wait_gone("b");
    let e = refused(&c, &["node", "remove", "b"]);
    assert!(
        e.contains("node b still holds claims of v")
            && e.contains("claimd volume detach VOLUME --node b"),
        "{e}"
    );
    assert!(c.get_json("node-settings/b").is_some());
    c.node("a")
        .agent
        .cli(&[
            "volume",
            "detach",
            "v",
            "--node",
            "b",
            "--reason",
            "gone for good",
        ])
        .ok();
    let out = c
        .node("a")
        .agent
        .cli(&["node", "remove", "b", "--json"])
        .ok()
        .json();
    // Its claim index marker goes with it (b's first reconciliation wrote
    // it).
    assert_eq!(
        out["removed_keys"],
        json!(["node-settings/b", "claim-index/b"]),
        "{out}"
    );
    assert!(c.get_json("node-settings/b").is_none());
    assert!(c.keys("claim-index/").iter().all(|k| k != "claim-index/b"));
    assert!(c
        .keys("node-settings/")
        .contains(&"node-settings/a".to_string()));
    let e = refused(&c, &["node", "remove", "b"]);
    assert!(e.contains("knows nothing of node b"), "{e}");
}

// ---- claim free by hand ---------------------------------------------------------

/// `claim free` of another node's claim checks that the node is gone, then
/// deletes the claim: two round trips. A node that came back in between
/// (registered, its claim confirmed under its new lease, its volume
/// mounted) must keep its claim, or another node could take the volume
/// while it is mounted. So the delete compares the holder's liveness key
/// absent in its own `Txn`. Here the free's write is made while b is
/// alive (as if b came back right after the check): refused, naming b;
/// once b is gone the same free goes through.
#[test]
fn a_claim_freed_by_hand_stays_with_a_node_that_is_back_at_the_write() {
    use claimd::claims::{Applied, ClaimChange, ClaimError, ClaimStore, Transaction};
    let mut c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    c.add_volume(&volume());
    c.node("b").mount_ok("q1", "data=v");
    let dir = TestDir::new();
    let state = std::sync::Arc::new(
        claimd::state::StateStore::open(dir.path()).expect("a state directory"),
    );
    let operator = claimd::claims::EtcdClaims::new(c.etcd.client(), PREFIX, state).with_node("a");
    let free = |store: &claimd::claims::EtcdClaims| {
        let mut record = |_: &mut claimd::state::StateFile, _: &[Result<(), ClaimError>]| {};
        let applied = store
            .transact(Transaction {
                changes: vec![ClaimChange::Free {
                    volume_id: "v".to_string(),
                    alloc_id: "q1".to_string(),
                    holder: None,
                    while_gone: true,
                    by_hand: None,
                }],
                wanted: &|_| true,
                record: &mut record,
                closing: false,
            })
            .expect("the local write");
        let Applied::Done(mut outcomes) = applied else {
            panic!("the free was not wanted")
        };
        outcomes.pop().expect("one outcome")
    };
    let refused = free(&operator).expect_err("b is alive");
    assert!(
        refused.to_string().contains("node b, is alive again"),
        "{refused}"
    );
    assert_eq!(c.holders("v"), ["q1"]);
    assert_eq!(c.keys("node-claims/b/"), ["node-claims/b/v/q1"]);
    c.node_mut("b").agent.kill();
    c.wait_gone("b");
    free(&operator).expect("b is gone");
    assert!(c.holders("v").is_empty());
    assert!(c.keys("node-claims/").is_empty());
}
