//! Agent restarts and SIGKILLs around etcd round trips, health and metrics
//! that follow the link, claims freed while the agent was down.

use super::*;

#[test]
fn a_release_waiting_for_a_cut_link_survives_an_agent_restart() {
    let dir = TestDir::new();
    let etcd = Etcd::start();
    let proxy = Proxy::start(
        format!("127.0.0.1:{}", etcd.client_port())
            .parse()
            .expect("an address"),
    );
    let mut a = Node::start(dir.path(), "a", &[proxy.endpoint()], &|_| {});
    a.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = a.mount_ok("p1", "data=v");
    let key = format!("{PREFIX}/claims/v/p1");

    proxy.pause();
    a.agent.cli(&["alloc", "release", "p1"]).ok();
    wait_until(
        SHOW_TIMEOUT,
        "the release to retry freeing the claim",
        || a.volume_status("p1")["release_state"] == "retrying",
    );
    assert!(!is_mount_point(&path));
    // A crash while the claim waits to be freed, and a start with the link
    // still cut: the release goes on from the record.
    a.agent.kill();
    a.agent.spawn();
    a.agent.wait_listening();
    wait_until(SHOW_TIMEOUT, "the resumed release to retry", || {
        let st = a.volume_status("p1");
        st["release_state"] == "retrying"
            && st["release_error"].as_str().unwrap_or("").contains("etcd")
    });
    assert!(!is_mount_point(&path));
    assert!(a.targets().is_empty());
    assert!(etcd.client().get(&key).expect("read etcd").is_some());

    proxy.resume();
    wait_until(RETRY_TIMEOUT, "the claim to be freed", || {
        etcd.client().get(&key).expect("read etcd").is_none()
    });
    wait_until(SHOW_TIMEOUT, "node a to forget p1", || no_allocs(&a));
}

#[test]
fn a_mount_waiting_for_a_holder_survives_an_agent_restart() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    c.nodes[0].mount_ok("h1", "data=v");
    // b's mount waits for h1; the command gives up, the agent goes on.
    let b = &c.nodes[1];
    b.mount("w1", "data=v", &["--timeout", "2s"])
        .expect_code(EXIT_FAILED);
    assert_eq!(b.volume_status("w1")["phase"], "claiming");
    let b = &mut c.nodes[1];
    b.agent.kill();
    b.agent.spawn();
    b.agent.wait_listening();
    let b = &c.nodes[1];
    // Still waiting after the restart, and saying for what.
    wait_until(SHOW_TIMEOUT, "the restored mount to wait for h1", || {
        b.volume_status("w1")["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("h1", "a"))
    });
    assert_eq!(holders(&b.claims("v")), ["h1"]);
    assert!(b.targets().is_empty());
    c.nodes[0].release_ok("h1");
    wait_until(RETRY_TIMEOUT, "the restored mount to finish", || {
        b.volume_status("w1")["phase"] == "published"
    });
    assert_eq!(b.targets().len(), 1);
    assert_eq!(holders(&c.nodes[0].claims("v")), ["w1"]);
    b.release_ok("w1");
    assert!(stored_claims(&c.etcd, "").is_empty());
}

#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs the failpoints feature (cargo test --features failpoints)"
)]
fn sigkill_around_the_etcd_round_trip_of_a_mount_and_a_release() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let etcd = &c.etcd;
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };

    // Before the round trip of the mount's first transaction: nothing
    // anywhere; the mount can be asked again.
    restart_with_failpoint(a, "etcd-before-round-trip");
    die_at(a, "etcd-before-round-trip", |n| {
        let out = n.mount("k1", "data=v", &[]);
        assert_ne!(out.code, EXIT_OK);
    });
    assert!(stored_claims(etcd, "v").is_empty());
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    assert_eq!(a.volume_calls(), [] as [String; 0]);
    a.mount_ok("k1", "data=v");
    a.release_ok("k1");
    assert!(stored_claims(etcd, "v").is_empty());

    // After the local intent (claim in etcd and record both durable): the
    // restart finishes the mount under the claim.
    restart_with_failpoint(a, "mount-after-intent");
    die_at(a, "mount-after-intent", |n| {
        n.mount("k2", "data=v", &[]);
    });
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the restore to finish the mount", || {
        a.volume_status("k2")["phase"] == "published"
    });
    assert_eq!(a.targets().len(), 1);
    assert_eq!(holders(&b.claims("v")), ["k2"]);

    // After the release's first write (the claim marked releasing in etcd,
    // the record marked releasing): the restart resumes the release and
    // frees the claim.
    restart_with_failpoint(a, "release-after-mark");
    die_at(a, "release-after-mark", |n| {
        n.agent.cli(&["alloc", "release", "k2"]);
    });
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the resumed release", || no_allocs(a));
    assert!(a.targets().is_empty());
    assert!(stored_claims(etcd, "v").is_empty());

    // After the round trip of the mount's first transaction: the claim is
    // in etcd, the allocation in no local record. The same mount asked
    // again adopts the claim (its own: same allocation, node and mode).
    restart_with_failpoint(a, "etcd-after-round-trip");
    let calls = a.volume_calls().len();
    die_at(a, "etcd-after-round-trip", |n| {
        n.mount("k3", "data=v", &[]);
    });
    assert_eq!(holders(&b.claims("v")), ["k3"]);
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    assert_eq!(a.volume_calls()[calls..], [] as [String; 0]);
    a.mount_ok("k3", "data=v");
    assert_eq!(holders(&b.claims("v")), ["k3"]);
    a.release_ok("k3");
    assert!(stored_claims(etcd, "v").is_empty());
}

/// A claim that reached etcd just before the agent died (before its local
/// record) is freed by the next start's reconciliation once nothing of it
/// is mounted, so it does not block the volume for every node.
#[test]
fn a_claim_taken_just_before_a_crash_is_freed_by_the_next_start() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };
    restart_with_failpoint(a, "etcd-after-round-trip");
    // With the plugin ready, the mount takes the claim in its first
    // transaction: the agent dies after etcd has it and before any local
    // record exists.
    wait_until(SHOW_TIMEOUT, "node a's plugin to be ready", || {
        a.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"] == "ready"
    });
    die_at(a, "etcd-after-round-trip", |n| {
        n.mount("k1", "data=v", &[]);
    });
    assert_eq!(holders(&b.claims("v")), ["k1"]);
    // The orchestrator gave up on k1 and forgets it; node a restarts.
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    // Nothing of k1 is mounted on node a: its claim is freed, and node b
    // can take the volume.
    let out = b.mount("w1", "data=v", &["--timeout", "60s"]);
    assert_eq!(out.code, EXIT_OK, "{}", b.volume_status("w1"));
    assert_eq!(holders(&a.claims("v")), ["w1"]);
}

/// `claimd health` says when this node's liveness lease is not held (etcd
/// unreachable) and is ready again once it is; the metrics count the etcd
/// calls by method and show the lease.
#[test]
fn health_and_metrics_follow_the_link_to_etcd() {
    let mut c = Cluster::start(&["a"], &|cfg| {
        cfg.claim_retry_deadline = "60s".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let n = &c.nodes[0];
    n.mount_ok("a1", "data=v");
    wait_until(SHOW_TIMEOUT, "the agent to be healthy", || {
        n.agent.cli(&["health"]).code == EXIT_OK
    });
    let metrics = n.agent.cli(&["metrics"]).ok().stdout;
    let txns = metrics
        .lines()
        .find(|l| {
            l.starts_with("claimd_etcd_request_duration_seconds_count")
                && l.contains("method=\"Txn\"")
                && l.contains("result=\"ok\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .expect("a Txn count");
    assert!(txns >= 1.0, "{txns}");
    assert!(metrics.contains("claimd_etcd_lease_held 1"), "{metrics}");

    c.etcd.kill();
    let n = &c.nodes[0];
    wait_until(
        Duration::from_secs(60),
        "health to say the lease is gone",
        || {
            let out = n.agent.cli(&["health"]);
            out.code == EXIT_FAILED && out.stdout.contains("cluster:")
        },
    );
    assert!(n
        .agent
        .cli(&["metrics"])
        .ok()
        .stdout
        .contains("claimd_etcd_lease_held 0"));
    c.etcd.restart();
    let n = &c.nodes[0];
    wait_until(Duration::from_secs(60), "health to be ready again", || {
        n.agent.cli(&["health"]).code == EXIT_OK
    });
}

/// A node whose claim was freed elsewhere while its agent was down (by hand
/// here; the disconnect rule frees the same way, with a note) releases the
/// allocation when it is back in touch with etcd: nothing stays mounted
/// without a claim. The workload moved to another node under the same
/// allocation ID meanwhile: that node's claim is left alone (neither marked
/// nor freed by the returning node) and its mount stays.
#[test]
fn a_claim_freed_while_the_agent_was_down_releases_its_allocation() {
    let mut c = Cluster::start(&["a", "b"], &|_| {});
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = c.nodes[0].mount_ok("a1", "data=v");
    c.nodes[0].agent.kill();
    c.nodes[1]
        .agent
        .cli(&[
            "claim",
            "free",
            "v",
            "a1",
            "--reason",
            "node a replaced",
            "--force",
        ])
        .ok();
    assert!(stored_claims(&c.etcd, "v").is_empty());
    let moved = c.nodes[1].mount_ok("a1", "data=v");
    let held_by_b = stored_claims(&c.etcd, "v");
    c.nodes[0].agent.spawn();
    c.nodes[0].agent.wait_listening();
    wait_until(RETRY_TIMEOUT, "node a to release a1", || {
        no_allocs(&c.nodes[0]) && c.nodes[0].targets().is_empty()
    });
    assert!(!is_mount_point(&path));
    assert_eq!(
        stored_claims(&c.etcd, "v"),
        held_by_b,
        "b's claim of the same allocation ID is untouched"
    );
    assert!(is_mount_point(&moved), "b's mount stays");
    let log = c.nodes[0].agent.log();
    assert!(
        log.contains("no longer holds its claim") && log.contains("node a replaced"),
        "the log says why: {log}"
    );
    let calls = c.nodes[0].volume_calls();
    assert!(
        calls.ends_with(&[
            "NodeUnpublishVolume".to_string(),
            "NodeUnstageVolume".to_string()
        ]),
        "{calls:?}"
    );
}

// ---- 10. A crash between a release's answer and its closing write ------------------

/// A release is answered once its claim is freed in etcd, before the drop
/// of its local record reaches the disk (the closing write rides with the
/// next write, or the flusher's a few milliseconds later). With the
/// flusher stopped there and the volume taken meanwhile by another node, a
/// crash of the releasing node: its restart goes down from the durable
/// `releasing` record (calls down only, no take), drops the record, and
/// leaves the other node's claim as it is (the free compares the recorded
/// epoch; the key names another allocation anyway).
#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs the failpoints feature (cargo test --features failpoints)"
)]
fn a_crash_after_a_release_was_answered_goes_down_and_frees_no_other_claim() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let etcd = &c.etcd;
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };
    a.mount_ok("k1", "data=v");
    restart_with_failpoint(a, "answer-before-closing-write:pause");
    a.release_ok("k1");
    assert!(stored_claims(etcd, "v").is_empty(), "the claim is freed");
    // The files as they are (the flusher is stopped: nothing settles).
    let on_disk = state_of_dir(&a.agent.config.state_dir);
    let phases: Vec<String> = on_disk["allocs"]["k1"]["volumes"]
        .as_object()
        .map(|v| {
            v.values()
                .map(|r| r["phase"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(phases, ["releasing"], "{on_disk}");
    assert!(a.targets().is_empty());
    assert!(
        a.agent
            .log()
            .contains("failpoint answer-before-closing-write: paused"),
        "{}",
        a.agent.log()
    );

    // Node b takes the volume for another allocation.
    b.mount_ok("w1", "data=v");
    assert_eq!(holders(&b.claims("v")), ["w1"]);
    let w1_claim = stored_claims(etcd, "v");

    // Node a dies in the window and starts again.
    let calls = a.volume_calls().len();
    a.agent.kill_now();
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the resumed release to drop k1", || {
        no_allocs(a)
    });
    let on_disk = a.agent.state();
    assert_eq!(on_disk["allocs"], json!({}), "{on_disk}");
    let after: Vec<String> = a.volume_calls()[calls..].to_vec();
    assert!(
        after.iter().any(|m| m == "NodeUnpublishVolume")
            && after
                .iter()
                .all(|m| m == "NodeUnpublishVolume" || m == "NodeUnstageVolume"),
        "node a's calls after the restart: only the way down: {after:?}"
    );
    assert!(a.targets().is_empty());
    // w1's claim is untouched, in etcd byte for byte.
    assert_eq!(stored_claims(etcd, "v"), w1_claim);
    assert_eq!(holders(&a.claims("v")), ["w1"]);
    assert_eq!(b.targets().len(), 1);
    b.release_ok("w1");
    assert!(stored_claims(etcd, "v").is_empty());
}
