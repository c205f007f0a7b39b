//! Paused mounts, nodes back with a new lease, renewals counted across a
//! restart, and etcd writes whose answers were delayed or lost.

use super::*;

/// Issue 22, part A, "a mount resumed after a pause": a node paused
/// between its take and its attach must not carry on when it is
/// continued. Node a (no controller) mounts p1 through controller host h,
/// whose ControllerPublish is slowed (3 s); while a waits for that attach
/// it is SIGSTOPped (every thread stopped). The host's call ends, under
/// the claim; a's lease expires; the cluster fences v from a
/// (ControllerUnpublish through h) and frees p1, as `volume detach v
/// --node a` asks; b takes v. Then a is continued: it must send nothing
/// more up for p1 (no ControllerPublish through h, no NodeStage, no
/// NodePublish), end with nothing mounted, and leave v attached to b
/// only.
///
/// The fence and the free are an operator's (`volume detach --node`), not
/// the reaper's (`fencing_plugins`, `free_unfenced_claims`): the reaper
/// acts only on a node with `stop_after_disconnect`, which is then due by
/// the time the reaper acts, so at the continue the node's own
/// self-release races the resumed mount (e20db15 passed that way once:
/// its self-release marked p1 first), and the test would not show the
/// check before each call up. a waits for the attach in etcd (its
/// `attach_timeout` is 300 s), not in a CSI call of its own, whose
/// deadline would pass during the pause.
///
/// On e20db15: "a called up for p1 after it was continued, under a claim
/// the cluster had freed: [NodeStageVolume ..., NodePublishVolume ...]"
/// (2 of 2 runs): a took the host's answer, staged and published v with
/// the publish context of the attachment the operator had just undone,
/// while b had it published, and only then found "the claim of allocation
/// p1 is no longer held in etcd (freed while it mounted)" and rolled back.
/// (An earlier version, freed by the reaper with a 3 s window on every
/// node, passed there once: its self-release marked p1 first.)
#[test]
fn a_mount_resumed_after_a_pause_sends_nothing_up() {
    let c = Cluster::start(vec![
        host("h", &["a", "b"]),
        node_only("a").cluster_field("attach_timeout", json!("300s")),
        node_only("b"),
    ]);
    c.add_volume(&volume());
    let (h, a, b) = (c.node("h"), c.node("a"), c.node("b"));
    h.plugin.faults().set(json!([
        {"method": CP, "action": "delay", "ms": 3000, "count": 1}
    ]));
    // The command gives up after 1 s; the agent goes on waiting.
    a.mount("p1", "data=v", &["--timeout", "1s"])
        .expect_code(EXIT_FAILED);
    wait_until(SHOW_TIMEOUT, "h's ControllerPublish for a to start", || {
        h.plugin
            .stderr_text()
            .lines()
            .any(|l| l.contains(CP) && l.contains("delaying"))
    });
    let pid = a.agent.pid().expect("a's agent runs");
    freeze(pid, "a's agent");
    assert!(
        a.calls_of(NS).is_empty() && a.calls_of(NP).is_empty(),
        "a got past its attach before the pause: {:?}",
        a.volume_calls()
    );
    wait_until(SHOW_TIMEOUT, "h's ControllerPublish for a to end", || {
        !h.calls_of(CP).is_empty()
    });
    assert_eq!(h.one_call(CP)["code"], "OK");
    c.wait_gone("a");
    let out = b
        .agent
        .cli(&[
            "volume",
            "detach",
            "v",
            "--node",
            "a",
            "--reason",
            "node a is lost",
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(
        (&out["detached"], &out["freed"]),
        (&json!(true), &json!(["p1"])),
        "{out}"
    );
    b.mount_ok("q1", "data=v");
    let thawed_at = now_ms();
    thaw(pid, "a's agent");
    let up_after = || {
        let mut up = calls_for_since(h, CP, &ext("a"), thawed_at);
        up.extend(calls_since(a, NS, thawed_at));
        up.extend(calls_since(a, NP, thawed_at));
        up
    };
    wait_until(RETRY_TIMEOUT, "a to give p1 up (or call up)", || {
        !up_after().is_empty() || a.no_allocs()
    });
    assert!(
        up_after().is_empty(),
        "a called up for p1 after it was continued, under a claim the cluster had freed: {:?}",
        up_after()
    );
    // Stopped by the check before the call up: etcd no longer holds p1.
    let log = a.agent.log();
    assert!(log.contains(GONE_IN_ETCD), "{log}");
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert!(
        !h.attachments().contains(&("ext-v".to_string(), ext("a"))),
        "{:?}",
        h.attachments()
    );
    assert_eq!(c.holders("v"), ["q1"]);
    assert_eq!(b.targets().len(), 1);
}

// ---- A. A node returning with a new lease -------------------------------------------

/// Issue 22, part A, "a node returning with a new lease": a claim is
/// confirmed in this process under the lease that was valid when it was
/// taken (`EtcdClaims::confirmed`, `Fencing::is_confirmed`: the confirmed
/// lease must equal the current valid one); a node back with a NEW lease
/// must read the claim again before its next call up, not take the old
/// confirmation as still good. Node a (no window: nothing releases by
/// itself; CSI deadline 90 s) mounts p1 with its NodeStage slowed (40 s);
/// while that call runs, a's link to etcd is cut: its lease ends, an
/// operator frees p1 (a's liveness gone) and b takes v. The link heals
/// and a registers again with another lease; only then does the
/// NodeStage answer. a must not NodePublish p1: it unstages it and ends
/// with nothing mounted.
///
/// Reconciliation would release p1 on its own after the new registration
/// (on main and on e20db15): ballast makes its read (of every claim, or of
/// a's claim index) fail, so
/// the lease rule is all that stands between the NodeStage's answer and
/// a NodePublish (main's check reads p1's one claim key, which still
/// works).
///
/// On e20db15: "a published p1 after it came back with a new lease, under
/// the claim confirmed with the old one: [NodePublishVolume ...]" (2 of 2
/// runs).
#[test]
fn a_node_back_with_a_new_lease_does_not_carry_on_a_mount_under_the_old_one() {
    let c = Cluster::start(vec![
        nfs_node("a").proxied().csi_call_timeout("90s"),
        nfs_node("b"),
    ]);
    c.add_volume(&volume());
    let (a, b) = (c.node("a"), c.node("b"));
    a.plugin.faults().set(json!([
        {"method": NS, "action": "delay", "ms": 40_000, "count": 1}
    ]));
    a.mount("p1", "data=v", &["--timeout", "1s"])
        .expect_code(EXIT_FAILED);
    wait_until(SHOW_TIMEOUT, "a's NodeStage to start", || {
        a.plugin
            .stderr_text()
            .lines()
            .any(|l| l.contains(NS) && l.contains("delaying"))
    });
    let old_lease = lease_of(&c, "a");
    a.cut();
    c.wait_gone("a");
    free_by_hand(&c, "b", "p1");
    b.mount_ok("q1", "data=v");
    let _ballast = Ballast::plant(&c.etcd, "a");
    a.heal();
    wait_until(RETRY_TIMEOUT, "a to register with a new lease", || {
        c.alive("a") && lease_of(&c, "a") != old_lease
    });
    assert!(
        a.calls_of(NS).is_empty(),
        "a's NodeStage ended before a registered again: {:?}",
        a.calls_of(NS)
    );
    // The slowed NodeStage answers under the new lease now.
    wait_until(RETRY_TIMEOUT, "a's NodeStage to answer", || {
        !a.calls_of(NS).is_empty()
    });
    wait_until(RETRY_TIMEOUT, "a to unstage p1 (or publish it)", || {
        !a.calls_of(NP).is_empty() || !a.calls_of(NUS).is_empty()
    });
    assert!(
        a.calls_of(NP).is_empty(),
        "a published p1 after it came back with a new lease, under the claim confirmed with the old one: {:?}",
        a.calls_of(NP)
    );
    let log = a.agent.log();
    assert!(log.contains(GONE_IN_ETCD), "{log}");
    wait_until(SHOW_TIMEOUT, "a's mounts to go", || a.mounts().is_empty());
    assert_eq!(a.one_call(NS)["code"], "OK");
    assert_eq!(c.holders("v"), ["q1"]);
    assert_eq!(b.targets().len(), 1);
}

// ---- 15. "last renewed X ago" after a restart ----------------------------------------

/// Issue 22, defect 15 (second half): "last renewed X ago", in `claimd
/// health` and in the self-release's log line, counted from the agent's
/// start after a restart, not from the real last renewal. Node a (window
/// 5 s) mounts p1, is cut off from etcd and killed; 10 s after the cut it
/// is started again, still cut off. Its health must say it was last
/// renewed at least as long ago as the cut (the persisted lease clock),
/// and so must the line of its self-release (which it makes at once: the
/// window passed before the restart).
///
/// On e20db15 (which writes no lease clock: the wait for its file
/// dropped), both halves, 2 of 2 runs: "health gave no \"last renewed\",
/// 10024 ms after the cut: cluster: this node's liveness is not
/// registered in etcd yet" and "the self-release said last renewed 5255
/// ms ago, 15274 ms after the cut: ... this node's lease was last renewed
/// 5.254822568s ago (stop_after_disconnect 5s): released while
/// disconnected ..." (counted from the restart: the window, 5 s).
#[test]
fn last_renewed_counts_from_the_real_renewal_after_a_restart() {
    const RESTART_AFTER_MS: u64 = 10_000;
    // The agent's ages come from CLOCK_BOOTTIME, the test's from the wall
    // clock, read just before.
    const TOLERANCE_MS: f64 = 300.0;
    let mut c = Cluster::start(vec![nfs_node("a").proxied().stop_after_disconnect("5s")]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    let lease_clock = c.node("a").agent.config.state_dir.join("lease-clock.json");
    wait_until(SHOW_TIMEOUT, "a's lease clock file", || {
        lease_clock.exists()
    });
    let cut_at = now_ms();
    c.node("a").cut();
    c.node_mut("a").agent.kill();
    wait_until(RETRY_TIMEOUT, "the restart time", || {
        now_ms() >= cut_at + RESTART_AFTER_MS
    });
    let log_from = c.node("a").agent.log().len();
    c.node_mut("a").agent.restart();
    let a = c.node("a");
    let mut wrong = Vec::new();
    let asked_at = now_ms();
    let health = a.agent.cli(&["health"]);
    let answered_at = now_ms();
    let since_cut = (asked_at - cut_at) as f64;
    match renewed_ago_ms(&health.stdout) {
        Some(x) if x + TOLERANCE_MS >= since_cut => {
            // Not from before the last renewal either (that was at most
            // a keep-alive round before the cut).
            let bound = (answered_at - cut_at + LEASE_TTL_MS) as f64;
            assert!(x <= bound, "health: last renewed {x} ms ago: {health:?}");
        }
        Some(x) => wrong.push(format!(
            "health said last renewed {x:.0} ms ago, {since_cut:.0} ms after the cut: {}",
            health.stdout.trim()
        )),
        None => wrong.push(format!(
            "health gave no \"last renewed\", {since_cut:.0} ms after the cut: {}",
            health.stdout.trim()
        )),
    }
    let released = |log: &str| {
        log.lines()
            .find(|l| l.contains("was last renewed") && l.contains(": releasing "))
            .map(str::to_string)
    };
    wait_until(RETRY_TIMEOUT, "a's self-release line", || {
        released(&log_since(a, log_from)).is_some()
    });
    let line = released(&log_since(a, log_from)).expect("the line");
    let at = log_line_ms(&line).expect("a time stamp");
    let since_cut = at.saturating_sub(cut_at) as f64;
    match renewed_ago_ms(&line) {
        Some(x) if x + TOLERANCE_MS >= since_cut => {}
        Some(x) => wrong.push(format!(
            "the self-release said last renewed {x:.0} ms ago, {since_cut:.0} ms after the cut: {line}"
        )),
        None => wrong.push(format!("no age in the self-release's line: {line}")),
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Issue 41, defect 2 (seed 657716 of the fault-injection run): node c's
/// take of mr0 timed out while its link held requests; its mount was
/// rolled back, and the rollback's free read "no claim" and dropped the
/// record; then the held take landed, a claim with no record that nothing
/// freed (for a single-writer volume: every other writer locked out).
/// Here the take goes through a proxy that keeps it past the client's
/// deadline (and drops the client's cancel, so etcd carries it out when
/// it comes); the mount's retry takes the claim through the next endpoint
/// (the client moves on after a deadline), the release frees it, and only
/// then is the first take delivered. It must not land: a take compares
/// the node's liveness revision, and the free of a claim with a take that
/// did not answer moves the liveness key first (a retry that answered
/// does not settle the one still in flight).
///
/// On f62dff5: "the take landed after its free: claim q1 of v is in etcd".
#[test]
fn a_take_that_did_not_answer_cannot_land_after_its_free() {
    let etcd = Etcd::start();
    let proxy = delay_proxy(&etcd);
    let a = node_a(&etcd, &[proxy.endpoint(), etcd.endpoint()]);
    through(&a, &proxy);

    proxy.keep_requests_dropping_cancels();
    let kept_from = proxy.answers();
    let took = change(&a.store, take_q("q1"));
    assert!(took.is_err(), "the kept take answered: {took:?}");
    // The mount's retry, and later its release, through the other endpoint.
    change(&a.store, take_q("q1")).expect("the retried take");
    change(&a.store, free_q("q1")).expect("the free");
    assert!(!claim_in_etcd(&etcd, "q1"));
    assert_eq!(proxy.answers(), kept_from, "something passed the kept link");
    deliver(&proxy, 1);
    assert!(
        !claim_in_etcd(&etcd, "q1"),
        "the take landed after its free: claim q1 of v is in etcd"
    );
    // The node takes claims as before.
    change(&a.store, take_q("q2")).expect("a take after the fence");
}

/// Issue 41, defect 2, review finding: the fence itself can come back
/// ambiguous. The free's move of the liveness key times out (its link
/// keeps it), the first take lands meanwhile, then the move lands. The
/// next free must still settle (the key was moved: by this agent, on its
/// lease) and free the claim that landed, and later takes must compare
/// where the key is now, not be refused for the rest of the lease as if
/// it had been lost.
///
/// Before the review's fix: "a take after a fence that came back
/// ambiguous: Unavailable ... is not as this agent registered it".
#[test]
fn a_fence_that_did_not_answer_leaves_the_node_able_to_take() {
    let etcd = Etcd::start();
    let (p1, p2) = (delay_proxy(&etcd), delay_proxy(&etcd));
    let a = node_a(&etcd, &[p1.endpoint(), p2.endpoint()]);
    // Both of the store's connections made (a client moves to its next
    // endpoint after a deadline; one that is not connected yet is skipped
    // while it connects), and the store back on p1, which keeps.
    through(&a, &p1);
    kept_read(&a, &p1);
    through(&a, &p2);
    kept_read(&a, &p2);
    deliver(&p2, 1);

    let took = change(&a.store, take_q("q1"));
    assert!(took.is_err(), "the kept take answered: {took:?}");
    // The free's fence goes through p2, kept too.
    p2.keep_requests_dropping_cancels();
    let freed = change(&a.store, free_q("q1"));
    assert!(freed.is_err(), "the kept fence answered: {freed:?}");
    // The take lands (the fence has not yet), then the fence.
    deliver(&p1, 2);
    assert!(claim_in_etcd(&etcd, "q1"), "the kept take did not land");
    deliver(&p2, 1);
    change(&a.store, free_q("q1")).expect("the free, again");
    assert!(
        !claim_in_etcd(&etcd, "q1"),
        "the claim that landed was not freed"
    );
    let again = change(&a.store, take_q("q2"));
    assert!(
        again.is_ok(),
        "a take after a fence that came back ambiguous: {again:?}"
    );
}

/// Issue 41, defect 2 (the reconciliation half): a claim this node's agent
/// took in this run that no record and no take in flight covers (a take
/// that landed after it was given up) is collected by the reconciliation,
/// whenever it was taken. It skipped every claim newer than the run's
/// first take ("its record follows"), so such a claim stayed until a
/// restart.
///
/// On f62dff5: "the reconciliation left claim q3 of v: Reconciled { freed:
/// [], .. }".
#[test]
fn a_claim_of_this_run_without_a_record_is_collected_by_the_reconciliation() {
    let etcd = Etcd::start();
    let a = node_a(&etcd, &[etcd.endpoint()]);
    // Taken, and no local record written (as a take that landed late).
    change(&a.store, take_q("q3")).expect("the take");
    let mount_root = TestDir::new();
    let r = a
        .store
        .reconcile("a", mount_root.path())
        .expect("the reconciliation");
    assert_eq!(
        r.freed,
        vec![("v".to_string(), "q3".to_string())],
        "the reconciliation left claim q3 of v: {r:?}"
    );
    assert!(etcd
        .client()
        .get(format!("{PREFIX}/claims/v/q3"))
        .expect("read the claim")
        .is_none());
}

/// Issue 37, item 8 (in part): this node's liveness key deleted by hand
/// while its lease lives was never written again (the keep-alive goes on,
/// so no new registration comes), and since issue 41 every take compares
/// that key: the node could take no claim until its lease ended. A take
/// that finds the key gone while the lease is held has the liveness thread
/// write it again on the same lease, and the mount's retry takes the
/// claim.
///
/// On f62dff5 the mount worked but the key stayed gone: "nodes/a was not
/// written again".
#[test]
fn a_liveness_key_deleted_by_hand_is_written_again_at_the_next_take() {
    let c = Cluster::start(vec![nfs_node("a")]);
    c.add_volume(&volume());
    let key = format!("{PREFIX}/nodes/a");
    let etcd = c.etcd.client();
    let lease = etcd
        .get(&key)
        .expect("read etcd")
        .expect("a's liveness key")
        .lease;
    etcd.delete_range(&key, "")
        .expect("delete a's liveness key");
    let out = c.node("a").mount("p1", "data=v", &["--timeout", "60s"]);
    assert_eq!(out.code, EXIT_OK, "{out:?}");
    assert_eq!(c.holders("v"), ["p1"]);
    let again = etcd.get(&key).expect("read etcd");
    assert!(again.is_some(), "nodes/a was not written again");
    assert_eq!(
        again.and_then(|kv| kv.lease),
        lease,
        "not on the same lease"
    );
}
