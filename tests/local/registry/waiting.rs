//! Waiting for a plugin, and probing it: late, not ready, failing,
//! restarted with a new node ID, killed.

use super::*;

// ---- 1. Configured before it starts ------------------------------------------

#[test]
fn waiter_returns_once_a_late_plugin_starts() {
    let dir = TestDir::new();
    let socket = plugin_socket(&dir);
    let h = Harness::start(
        &[monolith("late", &socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    assert_eq!(h.registry.serves("late", PluginKind::Controller), None);
    let absent = h.wait_health("late", Health::Unhealthy, |_| true);
    assert_eq!(
        absent.reason,
        format!("socket {} does not exist", socket.display())
    );
    assert_eq!(absent.generation, 0);
    assert!(absent.info.is_none() && absent.node_info.is_none());

    let waiter = Waiter::spawn(&h.registry, "late", PluginKind::Node, LONG_WAIT);
    waiter.assert_blocked();
    assert!(h.registry.get_ready("late", PluginKind::Node).is_none());

    let watch = SocketWatch::start(&socket);
    let spawned = Instant::now();
    let plugin = TestPlugin::builder(dir.path())
        .node_id("node-1")
        .name("claimd.test.late")
        .unknown_capability()
        .start();
    let listening = Instant::now();
    let (result, returned) = waiter.finish(STATE_TIMEOUT);
    let appeared = watch.appeared();
    let s = result.expect("the plugin becomes ready");
    let latency = returned.duration_since(appeared);
    eprintln!(
        "socket appeared {:?} after spawn; plugin listening {:?} after spawn; \
         waiter returned {latency:?} after the socket appeared",
        appeared.duration_since(spawned),
        listening.duration_since(spawned),
    );
    // The registry re-probes an absent socket at most FAST_PROBE_MAX apart.
    assert!(
        latency < FAST_PROBE_MAX + SLACK,
        "the waiter returned {latency:?} after the socket appeared"
    );

    assert_eq!(s.id, "late");
    assert_eq!(s.plugin_type, PluginType::Monolith);
    assert_eq!(s.socket, socket);
    assert_eq!(s.source, "config");
    assert_eq!(s.health, Health::Ready);
    assert_eq!(s.reason, "");
    assert_eq!(s.generation, 1);
    assert!(s.last_probe.is_some());
    let info = s.info.as_ref().expect("plugin info");
    assert_eq!(info.name, "claimd.test.late");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(s.node_id(), Some("node-1"));
    assert_eq!(
        s.node_info,
        Some(NodeInfo {
            node_id: "node-1".to_string(),
            max_volumes_per_node: 0,
            // No topology: the plugin does not advertise
            // VOLUME_ACCESSIBILITY_CONSTRAINTS.
            topology: BTreeMap::new(),
        })
    );
    // The plugin also advertised capability type 99 in each list: ignored.
    assert_eq!(
        s.plugin_capabilities,
        Some(PluginCapabilities {
            controller_service: true,
            accessibility_constraints: false,
            ..Default::default()
        })
    );
    assert_eq!(
        s.node_capabilities,
        Some(NodeCapabilities {
            stage_unstage_volume: true,
            get_volume_stats: false,
            volume_condition: false,
            ..Default::default()
        })
    );
    assert_eq!(
        s.controller_capabilities,
        Some(ControllerCapabilities {
            create_delete_volume: true,
            publish_unpublish_volume: true,
            publish_readonly: false,
            ..Default::default()
        })
    );
    assert!(s.serves(PluginKind::Node) && s.serves(PluginKind::Controller));
    assert_eq!(
        h.registry.serves("late", PluginKind::Controller),
        Some(true)
    );
    assert_eq!(h.registry.serves("late", PluginKind::Node), Some(true));
    // The controller side of the monolith is ready too, at once.
    let c = h
        .registry
        .wait_for_plugin("late", PluginKind::Controller, Duration::ZERO)
        .expect("the controller side is ready");
    assert_eq!(c.socket, socket);
    // Exactly one fingerprint, then one probe; nothing else.
    assert_eq!(plugin.call_log().methods(), FINGERPRINT_CALLS);
    h.stop(JOIN_BOUND);
}

// ---- 2. A plugin that never comes --------------------------------------------

#[test]
fn waiter_times_out_naming_the_plugin_and_the_reason() {
    let dir = TestDir::new();
    let socket = plugin_socket(&dir);
    let h = Harness::start(
        &[monolith("ghost", &socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let timeout = Duration::from_millis(700);
    let started = Instant::now();
    let err = h
        .registry
        .wait_for_plugin("ghost", PluginKind::Node, timeout)
        .expect_err("the plugin never starts");
    let took = started.elapsed();
    eprintln!("timed out after {took:?} (timeout {timeout:?})");
    assert_between("the timed-out wait", took, timeout, timeout + SLACK);
    let reason = format!("unhealthy (socket {} does not exist)", socket.display());
    match &err {
        WaitError::Timeout {
            id,
            kind,
            waited,
            reason: r,
        } => {
            assert_eq!(id, "ghost");
            assert_eq!(*kind, PluginKind::Node);
            assert!(*waited >= timeout && *waited <= took, "waited {waited:?}");
            assert_eq!(r, &reason);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with("node plugin ghost was not ready after "),
        "{msg}"
    );
    assert!(msg.ends_with(&format!(": {reason}")), "{msg}");

    // An ID nobody configured is a different reason.
    let err = h
        .registry
        .wait_for_plugin("nobody", PluginKind::Node, Duration::from_millis(50))
        .expect_err("not configured");
    assert!(
        matches!(&err, WaitError::Timeout { reason, .. }
            if reason == "no such plugin is configured or has a socket in the plugin directory"),
        "{err:?}"
    );
    assert!(!socket.exists());
    h.stop(JOIN_BOUND);
}

// ---- 3. Shutdown wakes a waiter ----------------------------------------------

#[test]
fn shutdown_wakes_a_blocked_waiter_at_once() {
    let dir = TestDir::new();
    let socket = plugin_socket(&dir);
    let h = Harness::start(
        &[monolith("never", &socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    h.wait_health("never", Health::Unhealthy, |_| true);
    let node = Waiter::spawn(&h.registry, "never", PluginKind::Node, LONG_WAIT);
    let controller = Waiter::spawn(&h.registry, "never", PluginKind::Controller, LONG_WAIT);
    node.assert_blocked();
    controller.assert_blocked();

    let triggered = Instant::now();
    h.shutdown.trigger();
    for (waiter, kind) in [
        (node, PluginKind::Node),
        (controller, PluginKind::Controller),
    ] {
        let waited_before = triggered.duration_since(waiter.started);
        let (result, returned) = waiter.finish(STATE_TIMEOUT);
        let woke = returned.duration_since(triggered);
        eprintln!("{kind} waiter blocked {waited_before:?}, woke {woke:?} after the stop");
        assert_eq!(
            result.expect_err("stopped"),
            WaitError::Shutdown {
                id: "never".to_string(),
                kind
            }
        );
        assert!(woke < PROMPT, "woke {woke:?} after the stop");
    }
    // A wait that starts after the stop returns at once.
    let started = Instant::now();
    let late = h
        .registry
        .wait_for_plugin("never", PluginKind::Node, LONG_WAIT);
    assert!(matches!(late, Err(WaitError::Shutdown { .. })), "{late:?}");
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    let took = h.stop(JOIN_BOUND);
    eprintln!("registry threads joined {took:?} after the stop");
    assert!(took < PROMPT, "join took {took:?}");
}

// ---- 4. Probe says ready=false -----------------------------------------------

#[test]
fn probe_not_ready_is_starting_until_it_says_ready() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin
        .faults()
        .set(json!([{"method": "Probe", "action": "not_ready"}]));
    let h = Harness::start(
        &[monolith("slow", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let waiter = Waiter::spawn(&h.registry, "slow", PluginKind::Node, LONG_WAIT);
    let s = h.wait_health("slow", Health::Starting, |_| true);
    assert_eq!(s.reason, "Probe answered ready=false");
    assert_eq!(s.generation, 1, "fingerprinted once");
    assert_eq!(s.node_id(), Some("test-node"));
    assert!(s.last_probe.is_some());
    waiter.assert_blocked();
    assert!(h.registry.get_ready("slow", PluginKind::Node).is_none());

    // Starting is re-probed fast, without fingerprinting again.
    let log = plugin.call_log();
    wait_until(STATE_TIMEOUT, "three probes answered not ready", || {
        log.calls_of("Probe").len() >= 3
    });
    assert_eq!(log.calls_of("GetPluginInfo").len(), 1);
    assert_eq!(h.entry("slow").health, Health::Starting);
    let err = h
        .registry
        .wait_for_plugin("slow", PluginKind::Node, Duration::from_millis(100))
        .expect_err("still starting");
    assert!(
        matches!(&err, WaitError::Timeout { reason, .. }
            if reason == "starting (Probe answered ready=false)"),
        "{err:?}"
    );
    waiter.assert_blocked();

    let cleared = Instant::now();
    plugin.faults().clear();
    let (result, returned) = waiter.finish(STATE_TIMEOUT);
    let s = result.expect("ready once Probe says so");
    let latency = returned.duration_since(cleared);
    eprintln!("ready {latency:?} after the fault was cleared");
    assert!(latency < FAST_PROBE_MAX + SLACK, "ready after {latency:?}");
    assert_eq!(s.health, Health::Ready);
    assert_eq!(s.reason, "");
    assert_eq!(s.generation, 1);
    assert_eq!(log.calls_of("GetPluginInfo").len(), 1);
    h.stop(JOIN_BOUND);
}

// ---- 5. Probe fails ----------------------------------------------------------

#[test]
fn probe_failure_is_unhealthy_with_the_code_until_it_recovers() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([{
        "method": "Probe", "action": "fail", "code": "UNAVAILABLE", "message": "warming up"
    }]));
    let h = Harness::start(
        &[monolith("flaky", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let waiter = Waiter::spawn(&h.registry, "flaky", PluginKind::Node, LONG_WAIT);
    let s = h.wait_health("flaky", Health::Unhealthy, |_| true);
    assert_eq!(s.reason, "Probe failed: UNAVAILABLE: warming up");
    assert!(s.last_probe.is_some());
    waiter.assert_blocked();
    let err = h
        .registry
        .wait_for_plugin("flaky", PluginKind::Controller, Duration::from_millis(100))
        .expect_err("unhealthy");
    assert!(
        matches!(&err, WaitError::Timeout { reason, .. }
            if reason == "unhealthy (Probe failed: UNAVAILABLE: warming up)"),
        "{err:?}"
    );

    let cleared = Instant::now();
    plugin.faults().clear();
    let (result, returned) = waiter.finish(STATE_TIMEOUT);
    let s = result.expect("ready after the fault is cleared");
    let latency = returned.duration_since(cleared);
    eprintln!(
        "ready {latency:?} after the fault was cleared (generation {})",
        s.generation
    );
    assert!(latency < FAST_PROBE_MAX + SLACK, "ready after {latency:?}");
    assert_eq!(s.health, Health::Ready);
    assert_eq!(s.reason, "");
    assert_eq!(s.node_id(), Some("test-node"));
    let probes = plugin.call_log().calls_of("Probe");
    assert!(probes.len() >= 2, "{probes:?}");
    assert_eq!(probes[0]["code"], "UNAVAILABLE");
    assert_eq!(probes[probes.len() - 1]["code"], "OK");
    h.stop(JOIN_BOUND);
}

// ---- 6. A restart with a new node ID -----------------------------------------

#[test]
fn restart_with_a_new_node_id_is_noticed_through_the_socket_file() {
    let dir = TestDir::new();
    let mut first = TestPlugin::builder(dir.path()).node_id("node-old").start();
    let socket = first.socket.clone();
    let h = Harness::start(
        &[monolith("phoenix", &socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let before = h
        .registry
        .wait_for_plugin("phoenix", PluginKind::Node, STATE_TIMEOUT)
        .expect("ready");
    assert_eq!(before.node_id(), Some("node-old"));
    let old_inode = socket_inode(&socket);

    // A crash and a new process on the same socket path, with another node
    // ID. The probe interval is a minute: only the socket check can see it.
    // On ext4 the new socket file usually gets the inode number of the old
    // one (freed a moment before), so (device, inode) alone cannot tell
    // them apart.
    first.kill();
    let restarted = Instant::now();
    let second = TestPlugin::builder(dir.path()).node_id("node-new").start();
    let new_inode = socket_inode(&socket);
    eprintln!("socket inode before the restart {old_inode}, after {new_inode}");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        h.wait_health("phoenix", Health::Ready, |s| {
            s.node_id() == Some("node-new") && s.generation > before.generation
        })
    }));
    let after = match r {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "the registry never re-fingerprinted the restarted plugin; the new socket \
                 file has inode {new_inode}, the old one had {old_inode}{}",
                if new_inode == old_inode {
                    " (the same number, reused by the filesystem)"
                } else {
                    ""
                }
            );
            std::panic::resume_unwind(e);
        }
    };
    let noticed = restarted.elapsed();
    eprintln!(
        "restart noticed {noticed:?} after the kill (generation {} -> {})",
        before.generation, after.generation
    );
    assert!(
        noticed < Duration::from_secs(3),
        "noticed {noticed:?} after the kill"
    );
    assert_eq!(
        second.call_log().calls_of("NodeGetInfo").len(),
        2,
        "one NodeGetInfo per process"
    );
    let ready = h
        .registry
        .get_ready("phoenix", PluginKind::Node)
        .expect("ready");
    assert_eq!(ready.node_id(), Some("node-new"));
    h.stop(JOIN_BOUND);
}

// ---- 7. Killed, socket file left behind ---------------------------------------

#[test]
fn killed_plugin_with_its_socket_left_behind_is_unhealthy() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path()).start();
    let socket = plugin.socket.clone();
    let h = Harness::start(
        &[monolith("crashy", &socket)],
        options(REGISTRY_CALL_TIMEOUT, SHORT_PROBE_INTERVAL),
    );
    let ready = h
        .registry
        .wait_for_plugin("crashy", PluginKind::Node, STATE_TIMEOUT)
        .expect("ready");

    let killed = Instant::now();
    plugin.kill();
    let s = h.wait_health("crashy", Health::Unhealthy, |_| true);
    let noticed = killed.elapsed();
    eprintln!("unhealthy {noticed:?} after the kill: {}", s.reason);
    assert!(
        noticed < SHORT_PROBE_INTERVAL + SLACK,
        "noticed {noticed:?} after the kill"
    );
    // The first failed call is the next probe; later rounds fingerprint
    // afresh and fail on the first fingerprint call.
    assert!(
        s.reason.starts_with("Probe failed: UNAVAILABLE")
            || s.reason.starts_with("GetPluginInfo failed: UNAVAILABLE"),
        "{}",
        s.reason
    );
    // The socket file is still there: it exists, it is a socket, and it is
    // not a plugin that answers.
    let meta = fs::metadata(&socket).expect("the socket file stays");
    assert!(meta.file_type().is_socket());
    assert!(h.registry.get_ready("crashy", PluginKind::Node).is_none());
    let err = h
        .registry
        .wait_for_plugin("crashy", PluginKind::Node, Duration::from_millis(300))
        .expect_err("nobody answers");
    assert!(
        matches!(&err, WaitError::Timeout { reason, .. }
            if reason.starts_with("unhealthy (") && reason.contains("failed: UNAVAILABLE")),
        "{err:?}"
    );

    // Started again, it is fingerprinted afresh.
    plugin.restart();
    let back = h.wait_health("crashy", Health::Ready, |_| true);
    assert!(back.generation > ready.generation);
    h.stop(JOIN_BOUND);
}

// ---- 8. Replies that lack a field or do not decode ----------------------------

#[test]
fn node_info_without_node_id_is_unhealthy_until_fixed() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin
        .faults()
        .set(json!([{"method": "NodeGetInfo", "action": "empty"}]));
    let h = Harness::start(
        &[monolith("anon", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let s = h.wait_health("anon", Health::Unhealthy, |_| true);
    assert_eq!(
        s.reason,
        "NodeGetInfo answered without the required field node_id"
    );
    assert_eq!(s.generation, 0, "never fingerprinted");
    assert!(s.node_info.is_none() && s.info.is_none());
    assert_eq!(h.registry.serves("anon", PluginKind::Controller), None);
    // The fingerprint thread keeps trying (it did not die on the bad reply).
    let log = plugin.call_log();
    wait_until(STATE_TIMEOUT, "a second fingerprint attempt", || {
        log.calls_of("NodeGetInfo").len() >= 2
    });
    assert!(log.calls_of("Probe").is_empty(), "{:?}", log.methods());

    plugin.faults().clear();
    let s = h
        .registry
        .wait_for_plugin("anon", PluginKind::Node, STATE_TIMEOUT)
        .expect("ready once NodeGetInfo answers");
    assert_eq!(s.node_id(), Some("test-node"));
    assert_eq!(s.generation, 1);
    h.stop(JOIN_BOUND);
}
