//! Deadlines, injected faults, frozen and dead plugins, undecodable replies,
//! and the call log the tests read.

use super::*;

#[test]
fn a_late_call_times_out_for_the_caller_and_takes_effect_afterwards() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["v"])
        .start();
    const AFTER_MS: u64 = 2000;
    plugin.faults().set(json!([
        {"method": "ControllerPublishVolume", "action": "late", "ms": AFTER_MS, "count": 1},
        {"method": "NodeStageVolume", "action": "late", "ms": AFTER_MS, "count": 1},
        {"method": "NodePublishVolume", "action": "late", "ms": AFTER_MS, "count": 1}
    ]));
    let deadline = Duration::from_millis(300);
    let c = plugin.client_with_timeout(deadline);
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let log = plugin.call_log();
    let wait_logged = |method: &str| {
        wait_until(
            Duration::from_secs(20),
            &format!("the late {method}"),
            || !log.calls_of(method).is_empty(),
        );
        let call = log.calls_of(method).remove(0);
        assert_eq!(call["late"], true, "{call}");
        assert_eq!(call["code"], "OK", "{call}");
        call
    };

    let started = Instant::now();
    expect_status(
        c.controller_publish_volume(&controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    let timed_out = now_ms();
    assert!(
        started.elapsed() < Duration::from_millis(AFTER_MS),
        "{:?}",
        started.elapsed()
    );
    assert!(
        plugin.controller_state().is_none(),
        "not attached when the caller gave up"
    );
    let call = wait_logged("ControllerPublishVolume");
    assert!(call["ts_ms"].as_u64().expect("ts") >= timed_out, "{call}");
    assert_eq!(
        plugin.controller_state().expect("attached late")["attachments"]["v"],
        json!({"node-a": {"access_mode": "SINGLE_NODE_WRITER", "readonly": false}})
    );

    let ctx = expected_context("v", NODE);
    expect_status(
        c.node_stage_volume(&stage("v", &staging, &ctx)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    assert!(
        !is_mount_point(&staging),
        "not staged when the caller gave up"
    );
    wait_logged("NodeStageVolume");
    assert!(is_mount_point(&staging), "staged late");

    expect_status(
        c.node_publish_volume(&publish("v", Some(&staging), &target, false, &ctx)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    assert!(
        !is_mount_point(&target),
        "not published when the caller gave up"
    );
    wait_logged("NodePublishVolume");
    assert!(is_mount_point(&target), "published late");
    assert!(plugin.faults().rules().is_empty());

    // Calls without the fault are not late.
    let c = plugin.client();
    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
    assert!(log.calls_of("NodeUnstageVolume")[0].get("late").is_none());
    assert!(mounts_under(dir.path()).is_empty());
}

#[test]
fn not_found_on_node_unpublish_is_ignorable() {
    let dir = TestDir::new();
    let p = published(&dir);
    p.plugin.faults().set(json!([
        {"method": "NodeUnpublishVolume", "action": "fail", "code": "NOT_FOUND", "count": 1}
    ]));
    let err = expect_status(
        p.client.node_unpublish_volume(&unpublish("v", &p.target)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Ignorable,
    );
    assert!(err.is_ignorable());
    assert!(is_mount_point(&p.target), "a failed call did no work");
    // NOT_FOUND is ignorable only where the spec says "already done".
    p.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "fail", "code": "NOT_FOUND"}
    ]));
    expect_status(
        p.client.node_publish_volume(&publish(
            "v",
            Some(&p.staging),
            &p.target,
            false,
            &BTreeMap::new(),
        )),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
}

#[test]
fn unavailable_is_retryable_and_a_count_fails_exactly_that_many_calls() {
    let dir = TestDir::new();
    let p = published(&dir);
    p.plugin.faults().set(json!([{
        "method": "NodeUnpublishVolume", "action": "fail", "code": "UNAVAILABLE",
        "message": "plugin restarting", "count": 3
    }]));
    for remaining in [2, 1, 0] {
        let err = expect_status(
            p.client.node_unpublish_volume(&unpublish("v", &p.target)),
            RpcStatusCode::UNAVAILABLE,
            ErrorClass::Retryable,
        );
        assert!(err.to_string().contains("plugin restarting"), "{err}");
        assert!(is_mount_point(&p.target));
        let left = p.plugin.faults().rules();
        if remaining == 0 {
            assert!(
                left.is_empty(),
                "a rule that reaches 0 is dropped: {left:?}"
            );
        } else {
            assert_eq!(left[0]["count"], remaining);
        }
    }
    p.client
        .node_unpublish_volume(&unpublish("v", &p.target))
        .expect("the fourth call works");
    assert!(!is_mount_point(&p.target));
    let unpublishes: Vec<String> = p
        .plugin
        .call_log()
        .calls_of("NodeUnpublishVolume")
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect();
    assert_eq!(
        unpublishes,
        ["UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK"]
    );
}

#[test]
fn invalid_argument_fault_is_final_and_rules_filter_by_volume() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["bad", "good"])
        .start();
    let c = plugin.client();
    plugin.faults().set(json!([
        {"method": "NodeStageVolume", "volume_id": "bad", "action": "fail", "code": "INVALID_ARGUMENT"}
    ]));
    let none = BTreeMap::new();
    let bad_staging = dir.mkdir("staging/bad");
    let good_staging = dir.mkdir("staging/good");
    expect_status(
        c.node_stage_volume(&stage("bad", &bad_staging, &none)),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    c.node_stage_volume(&stage("good", &good_staging, &none))
        .expect("another volume is unaffected");
    assert!(!is_mount_point(&bad_staging));
    assert!(is_mount_point(&good_staging));
    assert_eq!(
        plugin.faults().rules().len(),
        1,
        "a rule without count stays"
    );
    c.node_unstage_volume(&unstage("good", &good_staging))
        .expect("NodeUnstage");
}

#[test]
fn an_invalid_fault_file_fails_calls_with_internal() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().write_raw(b"{\"rules\": [");
    expect_status(
        plugin.client().probe(),
        RpcStatusCode::INTERNAL,
        ErrorClass::Final,
    );
    plugin
        .faults()
        .set(json!([{"method": "Probe", "action": "explode"}]));
    expect_status(
        plugin.client().probe(),
        RpcStatusCode::INTERNAL,
        ErrorClass::Final,
    );
    plugin.faults().clear();
    assert_eq!(plugin.client().probe().expect("Probe"), Readiness::Ready);
}

#[test]
fn a_hung_call_hits_the_deadline_and_other_calls_still_answer() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "hang", "count": 1}
    ]));
    let deadline = Duration::from_millis(500);
    let c = plugin.client_with_timeout(deadline);
    let started = Instant::now();
    let err = expect_status(
        c.node_get_info(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    let took = started.elapsed();
    assert!(err.is_retryable());
    assert!(took >= deadline - Duration::from_millis(50), "{took:?}");
    assert!(
        took < deadline + Duration::from_millis(1500),
        "returned {took:?} after the call, deadline {deadline:?}"
    );
    // The hung call still holds its thread; others are served.
    assert_eq!(c.probe().expect("Probe during the hang"), Readiness::Ready);
    assert_eq!(c.node_get_info().expect("NodeGetInfo").node_id, "test-node");
    // A hung call is never logged: it never finished.
    assert_eq!(plugin.call_log().methods(), vec!["Probe", "NodeGetInfo"]);
}

/// `freeze` returns once every thread of the plugin is stopped, so a call
/// made right after it cannot be answered; `thaw` once none is.
#[test]
fn a_frozen_plugin_has_every_thread_stopped_and_answers_once_thawed() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).no_controller().start();
    assert_eq!(plugin.client().probe().expect("Probe"), Readiness::Ready);
    let pid = plugin.pid().expect("running");
    plugin.freeze();
    let states = thread_states(pid).expect("the plugin's threads");
    assert!(
        states.len() > 1 && states.iter().all(|(_, s)| *s == 'T'),
        "{states:?}"
    );
    expect_status(
        plugin
            .client_with_timeout(Duration::from_millis(300))
            .probe(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    plugin.thaw();
    let states = thread_states(pid).expect("the plugin's threads");
    assert!(states.iter().all(|(_, s)| *s != 'T'), "{states:?}");
    assert_eq!(
        plugin.client().probe().expect("Probe after the thaw"),
        Readiness::Ready
    );
}

#[test]
fn a_delayed_call_blocks_neither_other_calls_nor_other_mounts() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let staging = dir.mkdir("staging");
    c.node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    let slow_target = dir.mkdir("alloc").join("slow");
    let fast_target = dir.path().join("alloc/fast");

    plugin.faults().set(json!([{
        "method": "NodePublishVolume", "volume_id": "v", "action": "delay", "ms": 3000, "count": 1
    }]));
    let done = Arc::new(AtomicBool::new(false));
    let slow = {
        let (c, done) = (c.clone(), Arc::clone(&done));
        let req = publish("v", Some(&staging), &slow_target, false, &none);
        thread::spawn(move || {
            let r = c.node_publish_volume(&req);
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    // The rule is consumed when the call arrives: the slow call is now
    // sleeping inside the plugin.
    let faults = plugin.faults();
    wait_until(Duration::from_secs(10), "the delay rule to fire", || {
        faults.rules().is_empty()
    });
    c.node_publish_volume(&publish("v", Some(&staging), &fast_target, false, &none))
        .expect("a publish during the delay");
    assert!(is_mount_point(&fast_target));
    assert!(
        !done.load(Ordering::SeqCst),
        "the delayed call finished before the fast one"
    );
    slow.join()
        .expect("the slow caller thread")
        .expect("the delayed publish works after its delay");
    assert!(is_mount_point(&slow_target));
    let targets: Vec<String> = plugin
        .call_log()
        .calls_of("NodePublishVolume")
        .iter()
        .map(|c| c["target_path"].as_str().expect("target").to_string())
        .collect();
    assert_eq!(targets, [path_str(&fast_target), path_str(&slow_target)]);
}

#[test]
fn empty_replies_lack_required_fields() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "empty"},
        {"method": "GetPluginInfo", "action": "empty"}
    ]));
    let c = plugin.client();
    let err = c.node_get_info().expect_err("NodeGetInfo without node_id");
    assert!(
        matches!(
            err,
            CsiError::MissingField {
                method: CsiMethod::NodeGetInfo,
                field: "node_id"
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Final);
    let err = c.get_plugin_info().expect_err("GetPluginInfo without name");
    assert!(
        matches!(
            err,
            CsiError::MissingField {
                method: CsiMethod::GetPluginInfo,
                field: "name"
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.code_name(), "MISSING_FIELD");
}

#[test]
fn garbage_replies_are_bad_replies() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "garbage"},
        {"method": "GetPluginCapabilities", "action": "garbage"}
    ]));
    let c = plugin.client();
    let err = c.node_get_info().expect_err("garbage NodeGetInfo");
    assert!(
        matches!(
            err,
            CsiError::BadReply {
                method: CsiMethod::NodeGetInfo,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Final);
    let err = c
        .get_plugin_capabilities()
        .expect_err("garbage GetPluginCapabilities");
    assert!(matches!(err, CsiError::BadReply { .. }), "{err:?}");
    // The plugin answered OK; the bytes were the problem.
    assert_eq!(
        plugin.call_log().methods_and_codes(),
        pairs(&[("NodeGetInfo", "OK"), ("GetPluginCapabilities", "OK")])
    );
}

#[test]
fn probe_reports_starting_when_not_ready() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "Probe", "action": "not_ready", "count": 2}
    ]));
    let c = plugin.client();
    assert_eq!(c.probe().expect("Probe"), Readiness::Starting);
    assert_eq!(c.probe().expect("Probe"), Readiness::Starting);
    assert_eq!(c.probe().expect("Probe"), Readiness::Ready);
}

#[test]
fn an_exit_fault_fires_once_even_across_restarts() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    plugin.faults().set(json!([
        {"method": "NodeStageVolume", "action": "exit", "count": 1}
    ]));
    let c = plugin.client();
    let staging = dir.mkdir("staging");
    let req = stage("v", &staging, &BTreeMap::new());
    // The connection drops under the call.
    expect_status(
        c.node_stage_volume(&req),
        RpcStatusCode::UNAVAILABLE,
        ErrorClass::Retryable,
    );
    let status = plugin.wait_exit(PLUGIN_EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(17));
    assert!(!is_mount_point(&staging));
    assert!(plugin.faults().rules().is_empty());

    plugin.restart();
    // The client reconnects on its own once the plugin is back.
    wait_until(
        Duration::from_secs(10),
        "the restarted plugin to answer",
        || c.probe().is_ok(),
    );
    c.node_stage_volume(&req).expect("NodeStage after restart");
    assert!(is_mount_point(&staging));

    let stages: Vec<String> = plugin
        .call_log()
        .calls_of("NodeStageVolume")
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect();
    assert_eq!(stages, ["EXIT", "OK"]);
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
}

// ---- Transport ------------------------------------------------------------

#[test]
fn a_missing_socket_is_unavailable_quickly() {
    let dir = TestDir::new();
    let c = CsiClient::new(grpc_env(), &dir.path().join("absent.sock"), CALL_TIMEOUT);
    let started = Instant::now();
    let err = expect_status(
        c.get_plugin_info(),
        RpcStatusCode::UNAVAILABLE,
        ErrorClass::Retryable,
    );
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?} with a {CALL_TIMEOUT:?} deadline",
        started.elapsed()
    );
}

#[test]
fn a_terminated_plugin_leaves_a_socket_that_does_not_answer() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path()).start();
    let c = plugin.client();
    c.probe().expect("Probe");
    let status = plugin.terminate();
    assert!(status.success(), "SIGTERM exit: {status}");
    let meta = fs::symlink_metadata(&plugin.socket).expect("the socket file stays");
    assert!(meta.file_type().is_socket());
    expect_status(c.probe(), RpcStatusCode::UNAVAILABLE, ErrorClass::Retryable);

    plugin.restart();
    wait_until(
        Duration::from_secs(10),
        "the restarted plugin to answer",
        || c.probe().is_ok(),
    );
}

#[test]
fn the_plugin_rejects_bad_flags_and_documents_good_ones() {
    let bin = env!("CARGO_BIN_EXE_claimd-test-plugin");
    let out = std::process::Command::new(bin)
        .args([
            "--endpoint",
            "/nonexistent/csi.sock",
            "--root",
            "/nonexistent",
            "--bogus",
        ])
        .output()
        .expect("run the plugin");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bogus"));
    let out = std::process::Command::new(bin)
        .args(["--root", "/nonexistent"])
        .output()
        .expect("run the plugin");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--endpoint is required"));
    let out = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .expect("run the plugin");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--endpoint",
        "--root",
        "--node-id",
        "--name",
        "--no-stage",
        "--no-controller",
        "--call-log",
        "--faults",
        "--max-volumes-per-node",
        "--require-contexts",
        "--known-nodes",
        "--unknown-capability",
        "--storage",
        "--fence-on-unpublish",
        "--log-starts",
        "start_boottime_ns",
        "end_boottime_ns",
        "call_id",
        "late",
        "fsyncs",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

// ---- The call log --------------------------------------------------------

/// With --log-starts every call has a start line and (once it answers) an
/// end line with the same call_id and CLOCK_BOOTTIME stamps within the
/// test's own readings of that clock; a hung call stays started and not
/// ended. Without the flag only end lines, with the same stamps.
#[test]
fn the_call_log_has_start_and_end_lines_on_one_machine_wide_clock() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .log_starts()
        .start();
    let c = plugin.client();
    let before = boottime_ns();
    assert_eq!(c.probe().expect("Probe"), Readiness::Ready);
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "hang", "count": 1}
    ]));
    expect_status(
        plugin
            .client_with_timeout(Duration::from_millis(500))
            .node_get_info(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    c.node_get_capabilities().expect("NodeGetCapabilities");
    let after = boottime_ns();

    let log = plugin.call_log();
    let pid = u64::from(plugin.pid().expect("running"));
    let starts = log.starts();
    let methods: Vec<&str> = starts
        .iter()
        .map(|l| l["method"].as_str().expect("method"))
        .collect();
    assert_eq!(methods, ["Probe", "NodeGetInfo", "NodeGetCapabilities"]);
    // The hung NodeGetInfo: started, never ended.
    let open = log.open_calls();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0]["method"], "NodeGetInfo");
    assert_eq!(open[0]["call_id"], starts[1]["call_id"]);
    assert_eq!(log.methods(), ["Probe", "NodeGetCapabilities"]);

    let ends = log.calls();
    for (start, end) in [(&starts[0], &ends[0]), (&starts[2], &ends[1])] {
        assert_eq!(start["event"], "start");
        assert_eq!(end["event"], "end");
        assert_eq!(start["call_id"], end["call_id"]);
        assert_eq!(start["pid"], pid);
        assert_eq!(end["pid"], pid);
        assert_eq!(start["code"], serde_json::Value::Null, "{start}");
        assert_eq!(end["code"], "OK");
        let s = start["start_boottime_ns"]
            .as_u64()
            .expect("start_boottime_ns");
        assert_eq!(end["start_boottime_ns"].as_u64(), Some(s));
        let e = end["end_boottime_ns"].as_u64().expect("end_boottime_ns");
        assert!(
            before <= s && s <= e && e <= after,
            "{before} {s} {e} {after}"
        );
        assert_eq!(start["end_boottime_ns"], serde_json::Value::Null);
    }
    let started = |l: &serde_json::Value| l["start_boottime_ns"].as_u64().expect("a stamp");
    assert!(started(&starts[0]) < started(&starts[1]));
    assert!(started(&starts[1]) < started(&starts[2]));
    let ids: std::collections::HashSet<&str> = starts
        .iter()
        .map(|l| l["call_id"].as_str().expect("call_id"))
        .collect();
    assert_eq!(ids.len(), 3, "call IDs are unique: {ids:?}");

    // Without --log-starts: end lines only, stamped the same way.
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).no_controller().start();
    plugin.client().probe().expect("Probe");
    let lines = plugin.call_log().lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["event"], "end");
    let stamp = |k: &str| lines[0][k].as_u64().expect("a stamp");
    assert!(stamp("end_boottime_ns") >= stamp("start_boottime_ns"));
    assert!(plugin.call_log().open_calls().is_empty());
}

/// End lines carry the plugin's fsync(2) count so far: a ControllerPublish
/// that attaches makes the controller state durable (at least one more), a
/// call that writes nothing adds none, and a repeated publish (nothing to
/// change) adds none either; start lines carry no count.
#[test]
fn the_call_log_counts_the_plugins_fsyncs_on_end_lines() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .known_nodes(&[NODE])
        .volumes(&["v"])
        .log_starts()
        .start();
    let c = plugin.client();
    c.probe().expect("Probe");
    let req = controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER);
    c.controller_publish_volume(&req).expect("publish");
    c.probe().expect("Probe");
    c.controller_publish_volume(&req).expect("publish again");
    c.probe().expect("Probe");

    let log = plugin.call_log();
    let counts: Vec<u64> = log
        .calls()
        .iter()
        .map(|l| {
            l["fsyncs"]
                .as_u64()
                .unwrap_or_else(|| panic!("no count: {l}"))
        })
        .collect();
    assert_eq!(counts.len(), 5, "{counts:?}");
    assert!(
        counts[1] > counts[0],
        "the publish made nothing durable: {counts:?}"
    );
    assert_eq!(counts[2], counts[1], "a probe counted an fsync: {counts:?}");
    assert_eq!(
        counts[3], counts[2],
        "the repeated publish wrote: {counts:?}"
    );
    assert_eq!(counts[4], counts[3], "{counts:?}");
    for start in log.starts() {
        assert_eq!(start["fsyncs"], serde_json::Value::Null, "{start}");
    }
}

#[test]
fn the_call_log_names_secret_keys_but_never_secret_values() {
    const SECRET: &str = "s3cr3t-value-4711";
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).node_id(NODE).start();
    let c = plugin.client();
    let secrets = map(&[("password", SECRET), ("api-key", SECRET)]);

    let mut create = CreateVolumeRequest::new();
    create.name = "v".to_string();
    create
        .volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    create.secrets = secrets.clone();
    c.create_volume(&create).expect("CreateVolume");
    let mut cp = controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER);
    cp.secrets = secrets.clone();
    let ctx = c.controller_publish_volume(&cp).expect("ControllerPublish");
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let mut st = stage("v", &staging, &ctx);
    st.secrets = secrets.clone();
    c.node_stage_volume(&st).expect("NodeStage");
    let mut pb = publish("v", Some(&staging), &target, false, &ctx);
    pb.secrets = secrets.clone();
    c.node_publish_volume(&pb).expect("NodePublish");
    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
    let mut cu = controller_unpublish("v", NODE);
    cu.secrets = secrets.clone();
    c.controller_unpublish_volume(&cu)
        .expect("ControllerUnpublish");
    let mut del = DeleteVolumeRequest::new();
    del.volume_id = "v".to_string();
    del.secrets = secrets;
    c.delete_volume(&del).expect("DeleteVolume");

    let log = plugin.call_log();
    assert_eq!(
        log.methods(),
        [
            "CreateVolume",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
            "DeleteVolume",
        ]
    );
    for call in log.calls() {
        let with_secrets = !matches!(
            call["method"].as_str(),
            Some("NodeUnpublishVolume" | "NodeUnstageVolume")
        );
        if with_secrets {
            assert_eq!(
                call["secret_keys"],
                json!(["api-key", "password"]),
                "{call}"
            );
        } else {
            assert!(call.get("secret_keys").is_none(), "{call}");
        }
    }
    let raw = log.raw();
    assert!(raw.contains("password"), "key names are logged");
    assert!(!raw.contains(SECRET), "a secret value reached the call log");
    assert!(
        !plugin.stderr_text().contains(SECRET),
        "a secret value reached the plugin's log"
    );
}
