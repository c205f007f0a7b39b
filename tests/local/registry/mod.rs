//! The plugin registry (`src/plugins.rs`) against the real test plugin
//! process over a real unix socket: fingerprinting, health as the CSI spec
//! defines it, the condvar waiter, shutdown, restarts noticed through the
//! socket file, and discovery through the plugin directory.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::common::*;
use claimd::config::{PluginConfig, PluginType};
use claimd::csi::{ControllerCapabilities, NodeCapabilities, NodeInfo, PluginCapabilities};
use claimd::plugins::{
    Health, PluginKind, PluginSnapshot, Registry, RegistryOptions, WaitError, FAST_PROBE_MAX,
    PLUGIN_DIR_SCAN_INTERVAL,
};
use claimd::shutdown::Shutdown;
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
/// "At once": far below `LONG_WAIT`, far above a loaded two-core machine's
/// scheduling delays (these tests share their binary with heavier ones).
const PROMPT: Duration = Duration::from_secs(3);

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

mod probing;
mod waiting;
