//! The plugin registry (`src/plugins.rs`) against the real test plugin
//! process over a real unix socket: fingerprinting, health as the CSI spec
//! defines it, the condvar waiter, shutdown, restarts noticed through the
//! socket file, and discovery through the plugin directory.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use claimd::config::{PluginConfig, PluginType};
use claimd::csi::{ControllerCapabilities, NodeCapabilities, NodeInfo, PluginCapabilities};
use claimd::plugins::{
    Health, PluginKind, PluginSnapshot, Registry, RegistryOptions, WaitError, FAST_PROBE_MAX,
    PLUGIN_DIR_SCAN_INTERVAL,
};
use claimd::shutdown::Shutdown;
use common::*;
use serde_json::json;

/// Deadline of the registry's CSI calls in tests that do not test deadlines.
const REGISTRY_CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// A probe interval so long that only the socket check can notice anything.
const LONG_PROBE_INTERVAL: Duration = Duration::from_secs(60);
/// A probe interval short enough that a test sees a few rounds.
const SHORT_PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// How long a test waits for a health change it caused.
const STATE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the registry's threads may take to end after the stop.
const JOIN_BOUND: Duration = Duration::from_secs(5);
/// A waiter's timeout when the test expects it to be woken long before.
const LONG_WAIT: Duration = Duration::from_secs(60);
/// Slack for scheduling and the handful of sub-millisecond CSI calls of a
/// fingerprint, on top of the delays the registry is documented to take.
const SLACK: Duration = Duration::from_millis(500);

/// The fingerprint, in order, of a monolith that serves the controller side.
const FINGERPRINT_CALLS: &[&str] = &[
    "GetPluginInfo",
    "GetPluginCapabilities",
    "NodeGetInfo",
    "NodeGetCapabilities",
    "ControllerGetCapabilities",
    "Probe",
];

fn init_logging() {
    let _ = env_logger::builder().is_test(true).try_init();
}

fn options(call_timeout: Duration, probe_interval: Duration) -> RegistryOptions {
    RegistryOptions {
        call_timeout,
        probe_interval,
        plugin_dir: None,
    }
}

/// Where `TestPlugin::builder(dir)` puts the plugin's socket.
fn plugin_socket(dir: &TestDir) -> PathBuf {
    dir.path().join("plugin").join("csi.sock")
}

fn monolith(id: &str, socket: &Path) -> PluginConfig {
    PluginConfig {
        id: id.to_string(),
        plugin_type: PluginType::Monolith,
        socket: socket.to_path_buf(),
    }
}

/// A started registry that is stopped and joined when dropped, so a failing
/// test leaves no fingerprint thread behind.
struct Harness {
    registry: Registry,
    shutdown: Shutdown,
}

impl Harness {
    fn start(plugins: &[PluginConfig], opts: RegistryOptions) -> Harness {
        init_logging();
        let shutdown = Shutdown::new();
        let registry =
            Registry::start(grpc_env(), plugins, opts, shutdown.clone()).expect("registry starts");
        Harness { registry, shutdown }
    }

    /// The one entry for `id`.
    fn entry(&self, id: &str) -> PluginSnapshot {
        let mut found: Vec<_> = self
            .registry
            .list()
            .into_iter()
            .filter(|s| s.id == id)
            .collect();
        assert_eq!(found.len(), 1, "entries for plugin {id}: {found:#?}");
        found.pop().expect("exactly one entry")
    }

    /// Waits until plugin `id` has `health` and `cond` holds; returns that
    /// snapshot.
    fn wait_health(
        &self,
        id: &str,
        health: Health,
        mut cond: impl FnMut(&PluginSnapshot) -> bool,
    ) -> PluginSnapshot {
        let mut last = None;
        let mut found = None;
        let what = format!("plugin {id} to be {}", health.name());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_until(STATE_TIMEOUT, &what, || {
                let s = self.entry(id);
                if s.health == health && cond(&s) {
                    found = Some(s);
                    return true;
                }
                last = Some((s.health, s.reason.clone(), s.generation));
                false
            })
        }));
        if let Err(e) = r {
            eprintln!("last seen (health, reason, generation): {last:?}");
            std::panic::resume_unwind(e);
        }
        found.expect("wait_until returned, so the condition held")
    }

    /// Triggers the stop and joins the registry's threads; asserts none is
    /// left and returns how long the join took.
    fn stop(&self, bound: Duration) -> Duration {
        self.shutdown.trigger();
        let started = Instant::now();
        let stuck = self.registry.join(started + bound);
        let took = started.elapsed();
        assert!(
            stuck.is_empty(),
            "threads still running {took:?} after the stop: {stuck:?}"
        );
        took
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.trigger();
        let stuck = self.registry.join(Instant::now() + JOIN_BOUND);
        if !stuck.is_empty() {
            eprintln!("registry threads left running: {stuck:?}");
        }
    }
}

// ---- A waiter on another thread --------------------------------------------

type WaitResult = Result<PluginSnapshot, WaitError>;

/// `wait_for_plugin` running on its own thread.
struct Waiter {
    tid: libc::pid_t,
    started: Instant,
    done: mpsc::Receiver<(WaitResult, Instant)>,
    handle: Option<JoinHandle<()>>,
}

impl Waiter {
    fn spawn(registry: &Registry, id: &str, kind: PluginKind, timeout: Duration) -> Waiter {
        let (tid_tx, tid_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let registry = registry.clone();
        let id = id.to_string();
        let started = Instant::now();
        let handle = thread::Builder::new()
            .name(format!("waiter-{id}"))
            .spawn(move || {
                // SAFETY: gettid(2) has no preconditions.
                let _ = tid_tx.send(unsafe { libc::gettid() });
                let result = registry.wait_for_plugin(&id, kind, timeout);
                let _ = done_tx.send((result, Instant::now()));
            })
            .expect("spawn the waiter thread");
        let tid = tid_rx
            .recv_timeout(STATE_TIMEOUT)
            .expect("the waiter thread reports its thread ID");
        Waiter {
            tid,
            started,
            done,
            handle: Some(handle),
        }
    }

    /// The kernel's state letter of the waiter thread (`S`: asleep).
    fn thread_state(&self) -> Option<char> {
        let stat = fs::read_to_string(format!("/proc/self/task/{}/stat", self.tid)).ok()?;
        // "tid (comm) S ...": the comm may hold spaces, the state follows ')'.
        let (_, rest) = stat.rsplit_once(')')?;
        rest.trim_start().chars().next()
    }

    /// Asserts the waiter has not returned and is asleep (blocked on the
    /// registry's condvar: it has nothing else to block on).
    fn assert_blocked(&self) {
        wait_until(STATE_TIMEOUT, "the waiter to block", || {
            self.thread_state() == Some('S')
        });
        match self.done.try_recv() {
            Err(mpsc::TryRecvError::Empty) => {}
            Ok((result, _)) => panic!("the waiter returned early: {result:?}"),
            Err(mpsc::TryRecvError::Disconnected) => panic!("the waiter thread died"),
        }
    }

    /// Waits (up to `bound`) for the waiter to return; gives its result and
    /// the instant it returned.
    fn finish(mut self, bound: Duration) -> (WaitResult, Instant) {
        let out = self
            .done
            .recv_timeout(bound)
            .unwrap_or_else(|e| panic!("the waiter did not return within {bound:?}: {e}"));
        if let Some(h) = self.handle.take() {
            h.join().expect("the waiter thread ends");
        }
        out
    }
}

/// Records the instant a socket file appears at `path` (polled every
/// millisecond, so the measurement is fine-grained).
struct SocketWatch {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Option<Instant>>,
}

impl SocketWatch {
    fn start(path: &Path) -> SocketWatch {
        let path = path.to_path_buf();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = thread::Builder::new()
            .name("socket-watch".to_string())
            .spawn(move || {
                while !s.load(Ordering::SeqCst) {
                    if fs::metadata(&path).is_ok_and(|m| m.file_type().is_socket()) {
                        return Some(Instant::now());
                    }
                    thread::sleep(Duration::from_millis(1));
                }
                None
            })
            .expect("spawn the socket watcher");
        SocketWatch { stop, handle }
    }

    fn appeared(self) -> Instant {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .join()
            .expect("the socket watcher ends")
            .expect("the socket appeared")
    }
}

fn socket_inode(path: &Path) -> u64 {
    fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .ino()
}

#[track_caller]
fn assert_between(what: &str, took: Duration, min: Duration, max: Duration) {
    assert!(
        took >= min && took <= max,
        "{what} took {took:?}, expected between {min:?} and {max:?}"
    );
}

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
        assert!(
            woke < Duration::from_millis(200),
            "woke {woke:?} after the stop"
        );
    }
    // A wait that starts after the stop returns at once.
    let started = Instant::now();
    let late = h
        .registry
        .wait_for_plugin("never", PluginKind::Node, LONG_WAIT);
    assert!(matches!(late, Err(WaitError::Shutdown { .. })), "{late:?}");
    assert!(started.elapsed() < Duration::from_millis(100));
    let took = h.stop(JOIN_BOUND);
    eprintln!("registry threads joined {took:?} after the stop");
    assert!(took < Duration::from_secs(1), "join took {took:?}");
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
