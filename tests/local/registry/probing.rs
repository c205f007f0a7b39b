//! Undecodable answers, hung probes, the plugin directory, and limits
//! without a practical bound.

use super::*;

#[test]
fn undecodable_plugin_info_is_unhealthy_until_fixed() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin
        .faults()
        .set(json!([{"method": "GetPluginInfo", "action": "garbage"}]));
    let h = Harness::start(
        &[monolith("garbled", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    let s = h.wait_health("garbled", Health::Unhealthy, |s| {
        s.reason.starts_with("GetPluginInfo")
    });
    assert!(
        s.reason
            .starts_with("GetPluginInfo answered with a reply that does not decode: "),
        "{}",
        s.reason
    );
    assert_eq!(s.generation, 0);
    assert!(s.info.is_none());
    let log = plugin.call_log();
    wait_until(STATE_TIMEOUT, "a second fingerprint attempt", || {
        log.calls_of("GetPluginInfo").len() >= 2
    });
    assert_eq!(
        log.methods()
            .iter()
            .filter(|m| *m != "GetPluginInfo")
            .count(),
        0,
        "nothing after the undecodable reply: {:?}",
        log.methods()
    );

    plugin.faults().clear();
    let s = h
        .registry
        .wait_for_plugin("garbled", PluginKind::Node, STATE_TIMEOUT)
        .expect("ready once GetPluginInfo decodes");
    assert_eq!(
        s.info.as_ref().map(|i| i.name.as_str()),
        Some("claimd.test.plugin")
    );
    h.stop(JOIN_BOUND);
}

// ---- 9. Probe hangs -----------------------------------------------------------

#[test]
fn hung_probe_is_unhealthy_after_the_call_deadline() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    let call_timeout = Duration::from_millis(500);
    let h = Harness::start(
        &[monolith("stuck", &plugin.socket)],
        options(call_timeout, SHORT_PROBE_INTERVAL),
    );
    h.registry
        .wait_for_plugin("stuck", PluginKind::Node, STATE_TIMEOUT)
        .expect("ready");

    let hung = Instant::now();
    plugin
        .faults()
        .set(json!([{"method": "Probe", "action": "hang"}]));
    let s = h.wait_health("stuck", Health::Unhealthy, |_| true);
    let took = hung.elapsed();
    eprintln!(
        "unhealthy {took:?} after Probe started hanging: {}",
        s.reason
    );
    assert!(
        s.reason.starts_with("Probe failed: DEADLINE_EXCEEDED"),
        "{}",
        s.reason
    );
    // The first hanging probe starts after the fault is set and gives up
    // at the call deadline; it starts at most one probe interval later.
    assert_between(
        "turning unhealthy",
        took,
        call_timeout,
        call_timeout + SHORT_PROBE_INTERVAL + SLACK,
    );
    // Every probe the plugin answered was OK: a hung call is never
    // answered (nor logged), so the deadline is what made it unhealthy.
    let probes = plugin.call_log().calls_of("Probe");
    assert!(!probes.is_empty());
    assert!(probes.iter().all(|c| c["code"] == "OK"), "{probes:?}");

    // A stop does not wait longer than one call deadline for a thread that
    // is inside a hung call.
    let joined = h.stop(call_timeout + SLACK);
    eprintln!("joined {joined:?} after the stop");
}

// ---- 10. The plugin directory ------------------------------------------------

#[test]
fn plugin_in_the_plugin_directory_is_found_and_becomes_ready() {
    let dir = TestDir::new();
    // The test plugin lives in <dir>/plugin/ with its socket at
    // <dir>/plugin/csi.sock: with <dir> as the plugin directory, that is
    // the monolith layout for plugin ID "plugin".
    let h = Harness::start(
        &[],
        RegistryOptions {
            call_timeout: REGISTRY_CALL_TIMEOUT,
            probe_interval: LONG_PROBE_INTERVAL,
            plugin_dir: Some(dir.path().to_path_buf()),
        },
    );
    assert!(h.registry.list().is_empty());
    let err = h
        .registry
        .wait_for_plugin("plugin", PluginKind::Node, Duration::from_millis(100))
        .expect_err("nothing there yet");
    assert!(
        matches!(&err, WaitError::Timeout { reason, .. }
            if reason == "no such plugin is configured or has a socket in the plugin directory"),
        "{err:?}"
    );
    let waiter = Waiter::spawn(&h.registry, "plugin", PluginKind::Node, LONG_WAIT);
    waiter.assert_blocked();

    let plugin = TestPlugin::builder(dir.path()).start();
    let listening = Instant::now();
    let (result, returned) = waiter.finish(STATE_TIMEOUT);
    let s = result.expect("found and ready");
    let latency = returned.duration_since(listening);
    eprintln!("ready {latency:?} after the plugin listened");
    assert!(
        latency < PLUGIN_DIR_SCAN_INTERVAL + SLACK,
        "ready {latency:?} after the plugin listened"
    );
    assert_eq!(s.id, "plugin");
    assert_eq!(s.plugin_type, PluginType::Monolith);
    assert_eq!(s.socket, plugin.socket);
    assert_eq!(s.source, "plugin_dir");
    assert_eq!(s.node_id(), Some("test-node"));
    let all = h.registry.list();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert_eq!(all[0].source, "plugin_dir");
    assert_eq!(all[0].health, Health::Ready);
    assert_eq!(plugin.call_log().methods(), FINGERPRINT_CALLS);
    h.stop(JOIN_BOUND);
}

// ---- 11. A monolith without a controller --------------------------------------

#[test]
fn monolith_without_controller_does_not_serve_the_controller_side() {
    let dir = TestDir::new();
    let socket = plugin_socket(&dir);
    let h = Harness::start(
        &[monolith("nodeonly", &socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    // Not fingerprinted yet: unknown.
    assert_eq!(h.registry.serves("nodeonly", PluginKind::Controller), None);
    let plugin = TestPlugin::builder(dir.path()).no_controller().start();
    let s = h
        .registry
        .wait_for_plugin("nodeonly", PluginKind::Node, STATE_TIMEOUT)
        .expect("the node side is ready");
    assert_eq!(
        s.plugin_capabilities,
        Some(PluginCapabilities {
            controller_service: false,
            accessibility_constraints: false,
            ..Default::default()
        })
    );
    assert_eq!(s.controller_capabilities, None);
    assert!(!s.serves(PluginKind::Controller));
    assert_eq!(
        h.registry.serves("nodeonly", PluginKind::Controller),
        Some(false)
    );
    assert_eq!(h.registry.serves("nodeonly", PluginKind::Node), Some(true));
    assert!(h
        .registry
        .get_ready("nodeonly", PluginKind::Controller)
        .is_none());

    let timeout = Duration::from_millis(400);
    let started = Instant::now();
    let err = h
        .registry
        .wait_for_plugin("nodeonly", PluginKind::Controller, timeout)
        .expect_err("no controller side");
    let took = started.elapsed();
    eprintln!("controller wait gave up after {took:?}");
    assert_between("the controller wait", took, timeout, timeout + SLACK);
    match &err {
        WaitError::Timeout {
            id,
            kind,
            waited,
            reason,
        } => {
            assert_eq!(id, "nodeonly");
            assert_eq!(*kind, PluginKind::Controller);
            assert!(*waited >= timeout && *waited <= took, "waited {waited:?}");
            assert_eq!(
                reason,
                &format!(
                    "monolith at {} does not serve the controller side",
                    socket.display()
                )
            );
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The fingerprint never asked for controller capabilities.
    assert_eq!(
        plugin.call_log().methods(),
        [
            "GetPluginInfo",
            "GetPluginCapabilities",
            "NodeGetInfo",
            "NodeGetCapabilities",
            "Probe"
        ]
    );
    h.stop(JOIN_BOUND);
}

// ---- 12. Durations without a practical limit -----------------------------------
// The config accepts any positive duration ("999999999999999999d" saturates
// to u64::MAX seconds), and Duration::MAX is the usual "no limit": neither
// may make `Instant + Duration` overflow (a panic; an abort in release).

#[test]
fn wait_without_a_practical_limit_returns_a_ready_plugin() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    let h = Harness::start(
        &[monolith("patient", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, LONG_PROBE_INTERVAL),
    );
    h.wait_health("patient", Health::Ready, |_| true);
    // "As long as it takes": the plugin is ready, so this returns at once.
    let s = h
        .registry
        .wait_for_plugin("patient", PluginKind::Node, Duration::MAX)
        .expect("ready");
    assert_eq!(s.health, Health::Ready);
    h.stop(JOIN_BOUND);
}

#[test]
fn probe_interval_without_a_practical_limit_still_watches_the_socket() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    let h = Harness::start(
        &[monolith("sleepy", &plugin.socket)],
        options(REGISTRY_CALL_TIMEOUT, Duration::MAX),
    );
    h.wait_health("sleepy", Health::Ready, |_| true);
    // The socket file goes away: the socket check sees it within a round.
    let removed = Instant::now();
    fs::remove_file(&plugin.socket).expect("remove the socket file");
    let s = h.wait_health("sleepy", Health::Unhealthy, |_| true);
    let noticed = removed.elapsed();
    eprintln!("unhealthy {noticed:?} after the socket file was removed");
    assert_eq!(
        s.reason,
        format!("socket {} does not exist", plugin.socket.display())
    );
    h.stop(JOIN_BOUND);
}
