//! Backoff per step, volume limits, timed-out calls that land late, the last
//! holder's teardown, and a claim store outside the agent.

use super::*;

/// Each step of a release starts its own backoff: after NodeUnpublish
/// failed three times (waits growing to the cap), NodeUnstage's first
/// retry waits the initial delay again.
fn each_release_step_starts_its_own_backoff() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.plugin.faults().set(json!([
        {"method": NU, "action": "fail", "code": "UNAVAILABLE", "count": 3},
        {"method": NUS, "action": "fail", "code": "UNAVAILABLE", "count": 1}
    ]));
    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    let calls: Vec<Value> = h.lifecycle_calls().into_iter().skip(3).collect();
    let methods: Vec<(String, String)> = calls
        .iter()
        .map(|c| {
            let (m, _, code) = summary(c);
            (m, code)
        })
        .collect();
    let u = "UNAVAILABLE".to_string();
    let ok = "OK".to_string();
    assert_eq!(
        methods,
        vec![
            (NU.to_string(), u.clone()),
            (NU.to_string(), u.clone()),
            (NU.to_string(), u.clone()),
            (NU.to_string(), ok.clone()),
            (NUS.to_string(), u),
            (NUS.to_string(), ok.clone()),
            (CU.to_string(), ok),
        ]
    );
    let ts = |i: usize| calls[i]["ts_ms"].as_u64().expect("ts_ms");
    // The harness backs off from 50 ms doubling to a 200 ms cap (±25 %
    // jitter): the third NodeUnpublish retry waited 150-250 ms. NodeUnstage's
    // first retry must wait the initial 37-63 ms again (plus the call and a
    // state write), never the 150-250 ms a backoff shared with the
    // previous step would have reached.
    let last_unpublish_wait = ts(3) - ts(2);
    let first_unstage_wait = ts(5) - ts(4);
    assert!(
        last_unpublish_wait >= 150,
        "the third NodeUnpublish retry waited {last_unpublish_wait} ms"
    );
    assert!(
        first_unstage_wait < 140,
        "NodeUnstage's first retry waited {first_unstage_wait} ms"
    );
    assert_all_released(&h);
}

/// A controller detach that keeps failing after the node side succeeded:
/// the claim shows `node-detached` (still held) while the detach is
/// retried, nothing is mounted any more, and the claim is freed once the
/// detach succeeds.
fn a_detach_being_retried_shows_the_claim_node_detached() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.plugin.faults().set(json!([
        {"method": CU, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    h.m().release("a1").expect("release");
    let claim = || {
        h.all_claims()
            .into_iter()
            .find(|c| c.volume_id == "v" && c.alloc_id == "a1")
    };
    let state = || claim().map(|c| c.state);
    wait_until(WAIT, "the claim marked node-detached", || {
        state() == Some(ClaimState::NodeDetached)
    });
    let why = claim().and_then(|c| c.last_error).unwrap_or_default();
    assert!(
        why.contains("UNAVAILABLE") || why.contains("navailable"),
        "the claim says why it is not freed: {why:?}"
    );
    assert!(
        mounts_under(&h.mount_root).is_empty(),
        "the node side is done while the detach is retried"
    );
    let calls: Vec<(String, String)> = h
        .lifecycle_calls()
        .into_iter()
        .skip(3)
        .take(3)
        .map(|c| {
            let (m, _, code) = summary(&c);
            (m, code)
        })
        .collect();
    let call = |m: &str, code: &str| (m.to_string(), code.to_string());
    assert_eq!(
        calls,
        vec![call(NU, "OK"), call(NUS, "OK"), call(CU, "UNAVAILABLE")]
    );
    h.plugin.faults().set(json!([]));
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(state(), None, "freed once detached");
    assert_all_released(&h);
}

/// A node plugin's `max_volumes_per_node` reached on this node fails a
/// mount of another volume at once, naming the limit; nothing is sent,
/// claimed or recorded for it. A volume already in use still mounts.
fn the_node_plugins_volume_limit_fails_a_mount_at_once() {
    let h = Harness::with_plugin(|b| b.max_volumes_per_node(1));
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    h.register(spec("w", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("a1");
    let before = h.state_on_disk();
    let calls = h.lifecycle_calls().len();
    let started = std::time::Instant::now();
    let err = h
        .m()
        .mount("a2", &[request("other", "w", false)])
        .expect_err("over the limit");
    assert!(
        started.elapsed() < WAIT,
        "refused at once, not after retries"
    );
    match &err {
        MountError::VolumeLimit { max, in_use, .. } => {
            assert_eq!(*max, 1);
            assert_eq!(in_use, &vec!["v".to_string()]);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(
        claimd::error_chain(&err).contains("at most 1 volume(s) per node"),
        "{err}"
    );
    assert_eq!(h.lifecycle_calls().len(), calls);
    assert_eq!(h.state_on_disk(), before);
    // The volume in use shares its attachment: not a new one.
    h.m()
        .mount("a3", &[request("data", "v", false)])
        .expect("a3");
    for a in ["a1", "a3"] {
        h.m().release(a).expect("release");
        assert!(h.m().wait_released(a, WAIT));
    }
    assert_all_released(&h);
}

/// A mount whose retries find the node plugin gone waits for it to be
/// ready again (saying so in its status) and finishes through the new
/// instance, instead of calling a dead socket.
fn mount_retries_wait_for_the_plugin_to_come_back() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a1", &[request("data", "v", false)]));
    wait_until(WAIT, "NodePublish to fail once", || {
        h.lifecycle_calls().iter().any(|c| c["method"] == NP)
    });
    h.plugin.kill();
    wait_until(WAIT, "the mount to wait for the plugin", || {
        h.m().alloc_status("a1").is_some_and(|s| {
            s.volumes[0]
                .message
                .contains("waiting for node plugin testplug to be ready again")
        })
    });
    h.plugin.faults().set(json!([]));
    h.replace_plugin(|b| b);
    let mounted = mounting
        .join()
        .expect("the mount thread")
        .expect("mounted through the new plugin");
    assert!(is_mount_point(&mounted[0].host_path));
    let last = h.lifecycle_calls().pop().expect("a call");
    assert_eq!(
        summary(&last),
        (NP.to_string(), external_id("v"), "OK".to_string())
    );
    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    assert_all_released(&h);
}

/// A NodePublish that hits its deadline is uncertain: the plugin carries it
/// out after the caller gave up. When the mount then fails and is rolled
/// back, nothing of it may survive: the teardown waits for the late call to
/// settle, finds the target mounted again and unpublishes it again, and
/// the controller detach and the claim's release come after the last
/// unmount.
fn a_timed_out_publish_that_completes_late_leaves_no_mount() {
    // A plugin that creates the target's parent itself: the rollback
    // removing it does not stop the late call.
    let h = Harness::with_plugin(|b| b.args(&["--create-target-parent"]));
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "late", "ms": 300, "count": 1},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1},
        // The rollback's NodeUnstage is slow: the staging is still there
        // when the late NodePublish is carried out, so it succeeds.
        {"method": NUS, "action": "delay", "ms": 1500, "count": 1}
    ]));
    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("the second NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a1", WAIT), "the rollback ends");
    assert_eq!(h.m().release_status("a1"), released(&["data"]));
    let calls = h.lifecycle_calls();
    let late = calls
        .iter()
        .find(|c| c["method"] == NP && c["late"] == true)
        .expect("the late NodePublish was carried out");
    assert_eq!(late["code"], "OK", "the late NodePublish mounted: {late}");
    let cu = calls.iter().find(|c| c["method"] == CU).expect("detached");
    let unpublishes: Vec<&Value> = calls.iter().filter(|c| c["method"] == NU).collect();
    let last_nu = unpublishes.last().expect("unpublished");
    let ts = |c: &Value| c["ts_ms"].as_u64().expect("ts_ms");
    assert!(
        ts(last_nu) >= ts(late),
        "the last NodeUnpublish ({}) came before the late mount ({}): {calls:#?}",
        ts(last_nu),
        ts(late)
    );
    assert!(ts(cu) >= ts(last_nu), "detach before the last unmount");
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
    assert_all_released_leaving(&h, &released_tree());
}

/// A rollback after a timed-out NodePublish sends its first NodeUnpublish
/// only after the plugin had time to finish the late call (issue 22,
/// defect 13): a plugin that records the publish in its own books without
/// a visible mount is otherwise left published.
fn the_rollback_of_a_timed_out_publish_waits_before_its_first_unpublish() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "late", "ms": 300, "count": 1},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1}
    ]));
    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("the second NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a1", WAIT), "the rollback ends");
    let calls = h.lifecycle_calls();
    let late = calls
        .iter()
        .find(|c| c["method"] == NP && c["late"] == true)
        .expect("the late NodePublish was carried out");
    let first_nu = calls
        .iter()
        .find(|c| c["method"] == NU)
        .expect("unpublished");
    let ts = |c: &Value| c["ts_ms"].as_u64().expect("ts_ms");
    assert!(
        ts(first_nu) >= ts(late),
        "the first NodeUnpublish ({}) came before the late NodePublish ended ({}): {calls:#?}",
        ts(first_nu),
        ts(late)
    );
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
}

/// A mount that shared another allocation's staging and attachment, and
/// fails after that allocation was released, undoes both: the rollback's
/// way down counts users, not only the calls it sent itself.
fn a_failed_mount_that_shared_the_staging_undoes_it_when_it_was_the_last_user() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    h.m().mount("b", &[request("data", "v", false)]).expect("b");
    h.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 12},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1}
    ]));
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a", &[request("data", "v", false)]));
    wait_until(WAIT, "a's NodePublish to be failing", || {
        h.lifecycle_calls()
            .iter()
            .any(|c| c["method"] == NP && c["code"] == "UNAVAILABLE")
    });
    // b goes while a still counts as a user: b leaves staging and
    // attachment to a.
    h.m().release("b").expect("release b");
    assert!(h.m().wait_released("b", WAIT));
    let err = mounting
        .join()
        .expect("the mount thread")
        .expect_err("a's NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a", WAIT), "the rollback ends");
    let methods: Vec<String> = h
        .lifecycle_calls()
        .iter()
        .map(|c| c["method"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        methods.iter().filter(|m| *m == NS).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(
        methods.iter().filter(|m| *m == NUS).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(
        methods.iter().filter(|m| *m == CU).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(methods.last().map(String::as_str), Some(CU), "{methods:?}");
    assert_all_released(&h);
}

/// Issue 41, defect 1 (seed 657716 of the fault-injection run): a record
/// holds the staging and the attachment from its intent on, but its way
/// down undid only the calls it sent itself. Writer a recorded its intent
/// and sent nothing (its calls up were refused: the lease was not valid);
/// reader b then did ControllerPublish, NodeStage and NodePublish itself
/// and was released first, leaving staging and attachment to a (a still
/// counted as a user); a was then given up and released as the last
/// holder, and nothing unstaged or detached the volume: a staging mount
/// and an attachment left on a node with no claim. The last holder tears
/// them down, whoever set them up.
///
/// On f62dff5 the last release sent no NodeUnstageVolume and no
/// ControllerUnpublishVolume (the staging stayed mounted).
fn the_last_holder_tears_down_a_staging_and_attachment_it_did_not_set_up() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    let staging = h.staging("v");
    h.claims().refuse_calls_up("a", false);
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a", &[request("data", "v", false)]));
    wait_until(WAIT, "a's first call up to be refused", || {
        h.claims().calls_up_refused("a") > 0
    });
    let st = h.state_on_disk();
    let ra = &st.allocs["a"].volumes["data"];
    assert_eq!(ra.phase, Phase::Mounting);
    assert!(ra.holds_staging && ra.holds_attachment, "{ra:?}");
    assert!(h.lifecycle_calls().is_empty(), "{:?}", h.lifecycle_calls());

    h.m().mount("b", &[request("data", "v", true)]).expect("b");
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
    );
    h.m().release("b").expect("release b");
    assert!(h.m().wait_released("b", WAIT));
    // a still counts as a user: b leaves the staging and the attachment.
    assert_eq!(h.calls_since(3), ok_calls(&[(NU, "v")]));
    assert!(mount_points_under(&h.mount_root).contains(&staging));

    h.claims().refuse_calls_up("a", true);
    let err = mounting
        .join()
        .expect("the mount thread")
        .expect_err("a's claim is gone");
    assert!(matches!(err, MountError::Claim { .. }), "{err:?}");
    assert!(h.m().wait_released("a", WAIT), "the rollback ends");
    assert_eq!(
        h.calls_since(4),
        ok_calls(&[(NUS, "v"), (CU, "v")]),
        "the last holder unstages and detaches"
    );
    assert_all_released(&h);
}

/// With a store that lives outside the agent, the claim is taken by a
/// round trip before the local record changes, never kept in the state
/// file, and an unreachable store is retried, not fatal.
#[test]
fn remote_store_unreachable_during_mount_is_retried_and_claims_stay_remote() {
    with_store(StoreKind::Remote, || {
        let h = Harness::new();
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        h.wait_plugin_ready();
        h.claims().fail_next(3);
        let mounted = h
            .m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mounts once the store answers");
        assert_eq!(mounted.len(), 1);
        assert!(is_mount_point(&mounted[0].host_path));
        let log = h.claims().remote_log();
        let takes = log.iter().filter(|l| *l == "take v a1").count();
        assert_eq!(
            takes, 4,
            "three failed takes, then one that went through: {log:?}"
        );
        assert_eq!(
            log.last().map(String::as_str),
            Some("attach v a1"),
            "{log:?}"
        );
        assert_eq!(local_claims(&h), 0, "claims are never in the local state");
        let claims = h.all_claims();
        assert_eq!(claims.len(), 1);
        assert_eq!(claims[0].state, ClaimState::Taken);
        assert_eq!(
            claims[0].external_node_id.as_deref(),
            Some(PLUGIN_NODE_ID),
            "the attachment is recorded with the claim"
        );
        assert_eq!(
            h.calls_since(0),
            ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
        );
    });
}

/// A release with the store cut off does the node side and the detach at
/// once, then frees the claim when the store answers again.
#[test]
fn remote_store_unreachable_during_release_frees_the_claim_when_it_answers() {
    with_store(StoreKind::Remote, || {
        let h = Harness::new();
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        h.m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mount");
        let before = h.claims().remote_log().len();
        // Marking the claim fails (in the release's first write: the way
        // down does not wait for it), and so do the first two frees, after
        // the node side and the detach went through.
        h.claims().fail_verb("mark-releasing", 1);
        h.claims().fail_verb("free", 2);
        assert_eq!(h.m().release("a1").expect("release"), ReleaseStart::Started);
        assert!(h.m().wait_released("a1", WAIT), "release did not end");
        assert_eq!(h.m().release_status("a1"), released(&["data"]));
        let log = h.claims().remote_log()[before..].to_vec();
        assert_eq!(
            log,
            ["mark-releasing v a1", "free v a1", "free v a1", "free v a1"],
            "each change is asked again until the store answers"
        );
        assert_eq!(
            h.calls_since(3),
            ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
        );
        assert_all_released(&h);
    });
}

both_stores!(
    each_release_step_starts_its_own_backoff,
    a_detach_being_retried_shows_the_claim_node_detached,
    the_node_plugins_volume_limit_fails_a_mount_at_once,
    mount_retries_wait_for_the_plugin_to_come_back,
    a_timed_out_publish_that_completes_late_leaves_no_mount,
    the_rollback_of_a_timed_out_publish_waits_before_its_first_unpublish,
    a_failed_mount_that_shared_the_staging_undoes_it_when_it_was_the_last_user,
    the_last_holder_tears_down_a_staging_and_attachment_it_did_not_set_up,
);
