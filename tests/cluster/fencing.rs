//! What the cluster does to a node's attachments (issue 37): the reaper
//! acts only on the absence it counted, and a controller host undoes an
//! attach whose claim is gone. Real agents, a real etcd, real mounts and
//! the test plugins' call logs and controller state.
//!
//! The harness is tests/cluster/harness/.

use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use claimd::cluster::NodeSettings;
use serde_json::{json, Value};

/// W of `node` as its published settings give it.
fn observer_wait(c: &Cluster, node: &str) -> Duration {
    let settings = c
        .get_json(&format!("node-settings/{node}"))
        .unwrap_or_else(|| panic!("node-settings/{node}"));
    let s: NodeSettings = serde_json::from_value(settings.clone()).expect("node settings");
    s.observer_wait()
        .unwrap_or_else(|| panic!("{node} has no stop_after_disconnect: {settings}"))
}

/// Waits until the wall clock reaches `at_ms`: the tests below act at the
/// times the reaper's own rule sets (a node's W after it was seen gone).
fn wait_for_clock(at_ms: u64) {
    wait_until(
        RETRY_TIMEOUT * 2,
        &format!("the clock to reach {at_ms}"),
        || now_ms() >= at_ms,
    );
}

/// The calls of `method` for `external_node` in `n`'s plugin log, after
/// `since_ms`.
fn calls_for(n: &Node, method: &str, external_node: &str, since_ms: u64) -> Vec<Value> {
    n.calls_of(method)
        .into_iter()
        .filter(|c| c["node_id"] == external_node && ts(c) >= since_ms)
        .collect()
}

/// Issue 37, item 1: node b is seen gone, the reaper is held in another
/// node's reap (a fence that does not answer), b comes back, registers,
/// and is cut off again. When the other reap returns, b's first absence is
/// long enough, but it was interrupted: the reaper must count b's absence
/// again (every write of the reap compares b's settings revision from
/// when the absence began), so b is fenced only after it let go of its
/// volume by itself. Before the fix, b was fenced at once while its
/// allocation was still published.
#[test]
fn an_absence_interrupted_during_another_reap_is_counted_again() {
    const B_WINDOW_S: u64 = 40;
    let mut c = Cluster::start(vec![
        host("h", &["a", "b"])
            .stop_after_disconnect(STOP_AFTER)
            .fencing()
            .fenced_storage()
            // The fence of a's volume hangs until the test restarts the
            // plugin: neither deadline ends it first.
            .csi_call_timeout("150s")
            .cluster_field("attach_timeout", json!("200s")),
        node_only("a")
            .proxied()
            .stop_after_disconnect(STOP_AFTER)
            .fenced_storage(),
        node_only("b")
            .proxied()
            .stop_after_disconnect(&format!("{B_WINDOW_S}s"))
            .csi_call_timeout("2s")
            .fenced_storage(),
    ]);
    c.add_volume(&volume_json("v1", "ext-v1", &["single-node-writer"]));
    c.add_volume(&volume_json("v2", "ext-v2", &["single-node-writer"]));
    let b_wait = observer_wait(&c, "b");
    let b_window_ms = B_WINDOW_S * 1000;
    c.node("a").mount_ok("p1", "data=v1");
    let path = c.node("b").mount_ok("p2", "data=v2");
    let h_faults = c.node("h").plugin.faults();
    h_faults.set(json!([{
        "method": CUP, "volume_id": "ext-v1", "action": "hang", "count": 1
    }]));

    // a, then b, seen gone: a's reap starts first (its W is shorter) and
    // its fence hangs.
    c.node("a").cut();
    c.wait_gone("a");
    c.node("b").cut();
    let b_gone = c.wait_gone("b");
    wait_until(
        RETRY_TIMEOUT,
        "the reaper's fence of a to reach h's plugin",
        || h_faults.rules().is_empty(),
    );
    assert!(
        now_ms() < b_gone + b_window_ms,
        "b's own window ran out before its link could heal: the test's timing is off"
    );

    // b comes back (keeping p2) and registers, unseen by the held reaper,
    // then is cut off again late enough that its first absence has run
    // out W before its second one runs out its window.
    c.node("b").heal();
    c.wait_alive("b");
    assert!(is_mount_point(&path), "p2 is no longer mounted");
    let b_wait_ms = b_wait.as_millis() as u64;
    wait_for_clock(b_gone + (b_wait_ms - b_window_ms) + 10_000);
    let b_cut_again = now_ms();
    c.node("b").cut();
    c.wait_gone("b");
    wait_for_clock(b_gone + b_wait_ms + 1_000);
    assert!(
        now_ms() + 5_000 < b_cut_again + b_window_ms,
        "b's second window is about to run out: the test's timing is off"
    );

    // a's fence ends (its plugin restarted; it refuses a's fence from now
    // on): the reaper goes on to b.
    let released_at = now_ms();
    h_faults.set(json!([{
        "method": CUP, "volume_id": "ext-v1", "action": "fail", "code": "FAILED_PRECONDITION"
    }]));
    c.node_mut("h").plugin.restart();

    let h = c.node("h");
    let b = c.node("b");
    wait_until(RETRY_TIMEOUT * 2, "the fence of b", || {
        !calls_for(h, CUP, &ext("b"), released_at).is_empty()
    });
    let fence = calls_for(h, CUP, &ext("b"), released_at)[0].clone();
    let nus = b.calls_of(NUS);
    assert!(
        !nus.is_empty() && ts(&nus[0]) <= ts(&fence),
        "b was fenced ({fence}) while p2 was still staged there (NodeUnstage: {nus:?}); b was cut off again {} ms before the fence, its window is {b_window_ms} ms",
        ts(&fence).saturating_sub(b_cut_again)
    );
    assert!(!is_mount_point(&path), "p2 is still mounted");
    assert!(
        ts(&fence) >= b_cut_again + b_window_ms,
        "b fenced {} ms after it was cut off again, within its window",
        ts(&fence).saturating_sub(b_cut_again)
    );
    assert!(
        h.agent
            .log()
            .contains("node b registered again since it was first seen gone")
            || h.agent.log().contains("absences counted again"),
        "the reaper did not say it counts b's absence again"
    );
}

/// Issue 37, item 5: a controller host whose ControllerPublish answered
/// OK but whose write of the answer got no answer from etcd (its link cut
/// during the call) returned before any undo; when it looked at the
/// request again, the claim was gone, and it answered "failed" without a
/// ControllerUnpublish: the volume stayed attached to a node that holds
/// no claim of it. The host must undo it once etcd answers again. On
/// 9347278 the plugin kept the attachment.
#[test]
fn an_attach_whose_answer_etcd_lost_is_undone_once_its_claim_is_gone() {
    let mut c = Cluster::start(vec![host("h", &["a"]).proxied(), node_only("a")]);
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let h_faults = c.node("h").plugin.faults();
    h_faults.set(json!([{
        "method": "ControllerPublishVolume", "volume_id": "ext-v", "action": "delay",
        "ms": 4000, "count": 1
    }]));
    // a's mount waits for the attach; the command gives up.
    c.node("a").mount_waiting("p1", "data=v");
    wait_until(SHOW_TIMEOUT, "the attach to reach h's plugin", || {
        h_faults.rules().is_empty()
    });
    // The call goes on and attaches; its answer cannot be written.
    c.node("h").cut();
    wait_until(SHOW_TIMEOUT, "the attach to be done in h's plugin", || {
        c.node("h").attachments() == [("ext-v".to_string(), ext("a"))]
    });
    // a goes away; its claim goes (as a reaper or an operator frees it).
    c.node_mut("a").agent.kill();
    c.wait_gone("a");
    c.delete_in_etcd("claims/v/p1");
    c.node("h").heal();
    wait_until(RETRY_TIMEOUT, "h to answer the request", || {
        c.attachment("v", "a")
            .is_some_and(|r| r["state"] == "failed")
    });
    let record = c.attachment("v", "a").expect("attachments/v/a");
    assert!(
        c.node("h").attachments().is_empty(),
        "the volume stays attached to a: {:?} ({record})",
        c.node("h").attachments()
    );
    let calls = c.node("h").volume_call_summary();
    assert_eq!(
        calls.last(),
        Some(&(CUP.to_string(), ext("a"))),
        "{calls:?}"
    );
}

/// Issue 37, item 6: after a fence, the reaper waits for a ControllerPublish
/// to the node that timed out before the fence but may still land, then
/// fences again. That call's deadline is the sender's (a controller host,
/// or the node itself), not the reaper's: the settle must be the longest
/// deadline those published. Here the reaper h has a 2 s deadline and node
/// a, the one fenced, a 5 s one. On 611966a the second fence came about
/// 2 s after the first.
#[test]
fn the_settle_after_a_fence_waits_out_the_senders_deadline() {
    const A_CALL_MS: u64 = 5000;
    let c = Cluster::start(vec![
        host("h", &["a"])
            .stop_after_disconnect(STOP_AFTER)
            .fencing()
            .fenced_storage()
            .csi_call_timeout("2s"),
        node_only("a")
            .proxied()
            .stop_after_disconnect(STOP_AFTER)
            .csi_call_timeout(&format!("{A_CALL_MS}ms"))
            .fenced_storage(),
    ]);
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    c.node("a").mount_ok("p1", "data=v");
    let cut_at = now_ms();
    c.node("a").cut();
    c.wait_gone("a");
    let h = c.node("h");
    wait_until(RETRY_TIMEOUT * 2, "the second fence of a", || {
        calls_for(h, CUP, &ext("a"), cut_at).len() >= 2
    });
    let fences = calls_for(h, CUP, &ext("a"), cut_at);
    let gap = ts(&fences[1]).saturating_sub(ts(&fences[0]));
    assert!(
        gap >= A_CALL_MS,
        "the fence was repeated {gap} ms after the first; a's CSI call deadline is {A_CALL_MS} ms: {fences:?}"
    );
    wait_until(RETRY_TIMEOUT, "v's claim to be freed", || {
        c.holders("v").is_empty()
    });
}

/// Issue 37, item 6: the cluster waits the W that node a last published
/// (`node-settings/a`). a is cut off from etcd, killed, and started again,
/// still cut off, with a window of 10 minutes instead of 3 s: it cannot
/// publish that before etcd answers, so until it registers it must let go
/// of its volume by the settings the cluster knows, not by its new config.
/// Before the fix (`claims::published`), a kept its volume for the new 10
/// minutes while the cluster could act after about 16 s.
#[test]
fn a_window_raised_while_cut_off_counts_only_once_published() {
    let mut c = Cluster::start(vec![
        nfs_node("a")
            .proxied()
            .stop_after_disconnect(STOP_AFTER)
            .csi_call_timeout("2s"),
        nfs_node("b"),
    ]);
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = c.node("a").mount_ok("p1", "data=v");
    let state_dir = c.node("a").agent.config.state_dir.clone();
    wait_until(
        SHOW_TIMEOUT,
        "a's lease clock and published settings",
        || {
            state_dir.join("lease-clock.json").exists()
                && state_dir.join("published-settings.json").exists()
        },
    );
    let w = observer_wait(&c, "a");
    let cut_at = now_ms();
    c.node("a").cut();
    c.node_mut("a").agent.kill();
    let a = c.node_mut("a");
    a.agent.config.cluster.as_mut().expect("a cluster section")["stop_after_disconnect"] =
        json!("10m");
    a.agent.config.write(&a.agent.config_path);
    a.agent.restart();
    let a = c.node("a");
    let unpublished = || -> Vec<Value> {
        a.calls_of(NUP)
            .into_iter()
            .filter(|c| ts(c) >= cut_at)
            .collect()
    };
    wait_until(
        RETRY_TIMEOUT,
        "a to let go of p1 by its published window",
        || !unpublished().is_empty(),
    );
    let nup = ts(&unpublished()[0]);
    // The cluster may act on a's claim from s + TTL + W on, s (a's last
    // renewal) before the cut.
    assert!(
        nup < cut_at + LEASE_TTL_MS + w.as_millis() as u64,
        "a let go {} ms after the cut; the cluster may act after {} ms",
        nup - cut_at,
        LEASE_TTL_MS + w.as_millis() as u64
    );
    assert!(!is_mount_point(&path));
    assert!(
        a.agent
            .log()
            .contains("as the settings this node last published allow"),
        "{}",
        a.agent.log()
    );
    // etcd still holds the old settings; once a registers, the new ones.
    assert_eq!(observer_wait(&c, "a"), w);
    a.heal();
    c.wait_alive("a");
    wait_until(SHOW_TIMEOUT, "a's new settings in etcd", || {
        c.get_json("node-settings/a").expect("a's settings")["stop_after_disconnect_ms"]
            == json!(600_000)
    });
    wait_until(RETRY_TIMEOUT, "a to free p1", || c.holders("v").is_empty());
}

/// A `published-settings.json` that is not that file stops the agent,
/// naming it, and is left as it is: going by the configured window
/// instead could outlast what the cluster knows (the test above).
#[test]
fn a_corrupt_published_settings_file_stops_the_agent_and_is_kept() {
    let mut c = Cluster::start(vec![nfs_node("a").stop_after_disconnect(STOP_AFTER)]);
    let file = c
        .node("a")
        .agent
        .config
        .state_dir
        .join("published-settings.json");
    wait_until(SHOW_TIMEOUT, "a's published settings", || file.exists());
    c.node_mut("a").agent.kill();
    std::fs::write(&file, b"{\"published\": [{\"window_ms\": \"x\"}]}").expect("write");
    let a = c.node_mut("a");
    a.agent.spawn();
    let status = a.agent.wait_exit(AGENT_START_TIMEOUT);
    assert!(!status.success(), "{status:?}");
    let log = a.agent.log();
    assert!(
        log.contains("published-settings.json is not what this node published"),
        "{log}"
    );
    assert_eq!(
        std::fs::read(&file).expect("read"),
        b"{\"published\": [{\"window_ms\": \"x\"}]}"
    );
}

/// Rule 11, issue 37 item 4: a call up paused between its lease check and
/// its send reaches an epoch plugin after the cluster freed the claim and
/// another node took it; the plugin refuses the stale epoch and nothing of
/// it is mounted on the paused node. A node-only volume, and b frees
/// unfenced claims: nothing fences a, so the epoch is all that stands
/// between two writers. a's NodePublish is held by a failpoint (10 s),
/// then the whole agent is stopped (SIGSTOP) until b holds the volume, so
/// the call goes out after the take however slow the cluster is.
#[test]
fn a_call_up_sent_after_the_claim_moved_is_refused_by_its_epoch() {
    const EPOCH_KEY: &str = "claimd.io/epoch";
    let spec = |name: &str| {
        node_only(name)
            .fenced_storage()
            .plugin_args(&["--epoch-key", EPOCH_KEY])
            .cluster_field("epoch_plugins", json!([PLUGIN_ID]))
            .stop_after_disconnect(STOP_AFTER)
            .csi_call_timeout("2s")
    };
    let mut c = Cluster::start(vec![
        spec("a"),
        spec("b").cluster_field("free_unfenced_claims", json!(true)),
    ]);
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let a = c.node_mut("a");
    a.agent.kill();
    a.agent.envs.push((
        "CLAIMD_FAILPOINT".to_string(),
        "before-node-publish:pause=10000".to_string(),
    ));
    a.agent.restart();
    let (a, b) = (c.node("a"), c.node("b"));
    a.mount_waiting("p1", "data=v");
    wait_until(SHOW_TIMEOUT, "a's NodePublish to be held", || {
        a.agent
            .log()
            .contains("failpoint before-node-publish: paused for")
    });
    let pid = a.agent.pid().expect("a runs");
    freeze(pid, "a's agent");
    assert!(
        a.calls_of(NP).is_empty(),
        "a's NodePublish went out before the agent was stopped: {:?}",
        a.calls_of(NP)
    );
    c.wait_gone("a");
    wait_until(RETRY_TIMEOUT, "the cluster to free p1", || {
        c.get_json("freed/v/p1").is_some()
    });
    b.mount_ok("q1", "data=v");
    let e2 = c
        .etcd
        .client()
        .get(format!("{PREFIX}/claims/v/q1"))
        .expect("read etcd")
        .expect("q1's claim")
        .create_revision;
    thaw(pid, "a's agent");
    wait_until(RETRY_TIMEOUT, "a's held NodePublish", || {
        !a.calls_of(NP).is_empty()
    });
    let np = a.calls_of(NP)[0].clone();
    // Sent under p1's claim, refused as older than q1's.
    assert_eq!(np["code"], "FAILED_PRECONDITION", "{np}");
    let sent: i64 = np["publish_context"][EPOCH_KEY]
        .as_str()
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("an epoch in {np}"));
    assert!(sent < e2, "a sent epoch {sent}, q1's is {e2}");
    wait_until(RETRY_TIMEOUT, "a to drop p1", || a.no_allocs());
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert_eq!(c.holders("v"), ["q1"]);
}

/// The other side of the test above: a restart with a much longer
/// `csi_call_timeout` than published (U grows by 4 × 18 s: no window is
/// left by the published settings) while etcd answers. The node waits for
/// its registration, which publishes its own settings, instead of
/// releasing every allocation at its first check; p1 stays mounted.
#[test]
fn a_restart_with_a_longer_csi_deadline_and_etcd_answering_releases_nothing() {
    let mut c = Cluster::start(vec![nfs_node("a")
        .stop_after_disconnect(STOP_AFTER)
        .csi_call_timeout("2s")]);
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = c.node("a").mount_ok("p1", "data=v");
    let state_dir = c.node("a").agent.config.state_dir.clone();
    wait_until(SHOW_TIMEOUT, "a's published settings", || {
        state_dir.join("published-settings.json").exists()
    });
    c.node_mut("a").agent.kill();
    let restarted_at = now_ms();
    let a = c.node_mut("a");
    a.agent.config.csi_call_timeout = "20s".to_string();
    a.agent.config.write(&a.agent.config_path);
    a.agent.restart();
    wait_until(SHOW_TIMEOUT, "a's new settings in etcd", || {
        c.get_json("node-settings/a").expect("a's settings")["csi_call_timeout_ms"] == json!(20_000)
    });
    let a = c.node("a");
    // The registration is what the self-release waited for; its next
    // checks count by a's own window from a fresh renewal.
    wait_until(SHOW_TIMEOUT, "a's restore", || {
        a.volume_status("p1")["phase"] == "published"
    });
    let log = a.agent.log();
    assert!(!log.contains("released while disconnected"), "{log}");
    assert!(
        a.calls_of(NUP).iter().all(|c| ts(c) < restarted_at),
        "{:?}",
        a.calls_of(NUP)
    );
    assert!(is_mount_point(&path));
}
