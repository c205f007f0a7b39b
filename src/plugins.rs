//! The plugin registry: one fingerprint thread per plugin socket, health as
//! the CSI spec defines it, and `wait_for_plugin`, a condvar waiter that
//! returns the moment a plugin is ready.
//!
//! Plugins come from the config file and from the plugin directory, whose
//! layout is `<plugin_dir>/<plugin-id>/csi.sock` (a monolith: node service,
//! plus controller when it advertises CONTROLLER_SERVICE),
//! `<plugin_dir>/<plugin-id>/node.sock` and
//! `<plugin_dir>/<plugin-id>/controller.sock`.

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Condvar, Mutex};

use crate::config::{PluginConfig, PluginType};
use crate::csi::{
    ControllerCapabilities, CsiClient, CsiError, NodeCapabilities, NodeInfo, PluginCapabilities,
    PluginInfo, Readiness,
};
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// First re-probe delay while a plugin is absent or not ready.
pub const FAST_PROBE_INITIAL: Duration = Duration::from_millis(50);
/// Cap of the re-probe delay while a plugin is absent or not ready.
pub const FAST_PROBE_MAX: Duration = Duration::from_millis(500);
/// How often a healthy plugin's socket is checked for replacement
/// (a restarted plugin) between probes; a stat, not an RPC.
pub const SOCKET_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// How often the plugin directory is scanned for new sockets.
pub const PLUGIN_DIR_SCAN_INTERVAL: Duration = Duration::from_millis(500);

/// Which side of a plugin a caller needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    Node,
    Controller,
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PluginKind::Node => "node",
            PluginKind::Controller => "controller",
        })
    }
}

/// Health as the CSI spec defines it, plus "not seen yet".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Not fingerprinted yet.
    Unknown,
    /// Probe failed, or the socket is gone or does not answer.
    Unhealthy,
    /// Probe said `ready = false`.
    Starting,
    /// Probe said ready (or left `ready` out).
    Ready,
}

impl Health {
    pub fn name(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Unhealthy => "unhealthy",
            Health::Starting => "starting",
            Health::Ready => "ready",
        }
    }
}

/// Everything known about one plugin socket; cloned out of the registry.
#[derive(Clone, Debug)]
pub struct PluginSnapshot {
    pub id: String,
    pub plugin_type: PluginType,
    pub socket: PathBuf,
    pub health: Health,
    /// Why it is not ready (empty when ready).
    pub reason: String,
    pub info: Option<PluginInfo>,
    pub plugin_capabilities: Option<PluginCapabilities>,
    pub node_capabilities: Option<NodeCapabilities>,
    pub controller_capabilities: Option<ControllerCapabilities>,
    pub node_info: Option<NodeInfo>,
    /// Bumped when a new plugin instance (a new socket file) is
    /// fingerprinted, or the fingerprint changed.
    pub generation: u64,
    pub last_probe: Option<SystemTime>,
    /// Where the entry came from: "config" or "plugin_dir".
    pub source: &'static str,
    pub client: CsiClient,
}

impl PluginSnapshot {
    pub fn serves(&self, kind: PluginKind) -> bool {
        match kind {
            PluginKind::Node => self.plugin_type.serves_node(),
            PluginKind::Controller => match self.plugin_type {
                PluginType::Controller => true,
                PluginType::Node => false,
                // A monolith serves the controller side only when it says so.
                PluginType::Monolith => self
                    .plugin_capabilities
                    .as_ref()
                    .is_some_and(|c| c.controller_service),
            },
        }
    }

    /// The external node ID (NodeGetInfo's `node_id`), when known.
    pub fn node_id(&self) -> Option<&str> {
        self.node_info.as_ref().map(|n| n.node_id.as_str())
    }
}

/// Why `wait_for_plugin` gave up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitError {
    Timeout {
        id: String,
        kind: PluginKind,
        waited: Duration,
        reason: String,
    },
    Shutdown {
        id: String,
        kind: PluginKind,
    },
}

impl fmt::Display for WaitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::Timeout {
                id,
                kind,
                waited,
                reason,
            } => write!(
                f,
                "{kind} plugin {id} was not ready after {}: {reason}",
                crate::config::format_duration(*waited)
            ),
            WaitError::Shutdown { id, kind } => {
                write!(
                    f,
                    "stopped waiting for {kind} plugin {id}: the agent is stopping"
                )
            }
        }
    }
}

impl std::error::Error for WaitError {}

#[derive(Clone, Debug)]
pub struct RegistryOptions {
    pub call_timeout: Duration,
    pub probe_interval: Duration,
    pub plugin_dir: Option<PathBuf>,
}

struct Entry {
    snapshot: PluginSnapshot,
}

struct State {
    entries: Vec<Entry>,
}

struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    shutdown: Shutdown,
    env: Arc<grpcio::Environment>,
    opts: RegistryOptions,
    threads: Mutex<Option<Threads>>,
}

/// The registry. Cheap to clone.
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

impl Registry {
    /// The deadline of every CSI call to this registry's plugins.
    pub fn call_timeout(&self) -> Duration {
        self.inner.opts.call_timeout
    }

    /// Starts a fingerprint thread for every configured plugin and, with a
    /// plugin directory, a scanner thread.
    pub fn start(
        env: Arc<grpcio::Environment>,
        plugins: &[PluginConfig],
        opts: RegistryOptions,
        shutdown: Shutdown,
    ) -> std::io::Result<Registry> {
        let reg = Registry {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    entries: Vec::new(),
                }),
                changed: Condvar::new(),
                shutdown: shutdown.clone(),
                env,
                opts,
                threads: Mutex::new(Some(Threads::new())),
            }),
        };
        {
            let weak = Arc::downgrade(&reg.inner);
            shutdown.on_trigger(move || {
                if let Some(inner) = weak.upgrade() {
                    // Take the lock so no waiter can miss the wake-up between
                    // its flag check and its wait.
                    let _guard = inner.state.lock();
                    inner.changed.notify_all();
                }
            });
        }
        for p in plugins {
            reg.add(p.clone(), "config")?;
        }
        if let Some(dir) = reg.inner.opts.plugin_dir.clone() {
            let r = reg.clone();
            reg.spawn("plugin-dir".to_string(), move || r.scan_loop(&dir))?;
        }
        Ok(reg)
    }

    fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        match self.inner.threads.lock().as_mut() {
            Some(t) => t.spawn(name, f),
            None => Ok(()), // already joined: the agent is stopping
        }
    }

    /// Adds a plugin socket and starts its fingerprint thread. A duplicate
    /// (same ID and type) is ignored.
    pub fn add(&self, p: PluginConfig, source: &'static str) -> std::io::Result<()> {
        {
            let mut st = self.inner.state.lock();
            if st.entries.iter().any(|e| {
                e.snapshot.id == p.id
                    && (e.snapshot.plugin_type == p.plugin_type || e.snapshot.socket == p.socket)
            }) {
                return Ok(());
            }
            let client = CsiClient::new(
                self.inner.env.clone(),
                &p.socket,
                self.inner.opts.call_timeout,
            )
            .with_driver(&p.id);
            st.entries.push(Entry {
                snapshot: PluginSnapshot {
                    id: p.id.clone(),
                    plugin_type: p.plugin_type,
                    socket: p.socket.clone(),
                    health: Health::Unknown,
                    reason: "not fingerprinted yet".to_string(),
                    info: None,
                    plugin_capabilities: None,
                    node_capabilities: None,
                    controller_capabilities: None,
                    node_info: None,
                    generation: 0,
                    last_probe: None,
                    source,
                    client,
                },
            });
            self.inner.changed.notify_all();
        }
        log::info!(
            "plugin {} ({}) registered from {source} at {}",
            p.id,
            p.plugin_type.name(),
            p.socket.display()
        );
        let r = self.clone();
        let name = format!("fingerprint-{}-{}", p.id, p.plugin_type.name());
        self.spawn(name, move || r.fingerprint_loop(&p.id, p.plugin_type))
    }

    /// All plugins, ordered by ID then type.
    pub fn list(&self) -> Vec<PluginSnapshot> {
        let mut v: Vec<_> = self
            .inner
            .state
            .lock()
            .entries
            .iter()
            .map(|e| e.snapshot.clone())
            .collect();
        v.sort_by(|a, b| (&a.id, a.plugin_type.name()).cmp(&(&b.id, b.plugin_type.name())));
        v
    }

    /// Whether plugin `id` is configured, already discovered, or has its
    /// directory in the plugin directory (its socket may come later). A
    /// plugin none of these is true of cannot come without a config change.
    pub fn knows(&self, id: &str) -> bool {
        if self
            .inner
            .state
            .lock()
            .entries
            .iter()
            .any(|e| e.snapshot.id == id)
        {
            return true;
        }
        crate::ids::check_id("plugin", id).is_ok()
            && self
                .inner
                .opts
                .plugin_dir
                .as_ref()
                .is_some_and(|d| d.join(id).is_dir())
    }

    /// One word for the node side of plugin `id`, with the reason when it
    /// is not ready: what `volume list` shows.
    pub fn node_health(&self, id: &str) -> String {
        let st = self.inner.state.lock();
        if Self::ready_entry(&st, id, PluginKind::Node).is_some() {
            return Health::Ready.name().to_string();
        }
        let reason = Self::reason_for(&st, id, PluginKind::Node);
        drop(st);
        if self.knows(id) {
            format!("not ready: {reason}")
        } else {
            format!("not configured: {reason}")
        }
    }

    /// The ready entry serving `kind` for `id`, if any.
    pub fn get_ready(&self, id: &str, kind: PluginKind) -> Option<PluginSnapshot> {
        let st = self.inner.state.lock();
        Self::ready_entry(&st, id, kind)
    }

    /// Whether any entry for `id` is known to serve (or, for a separate
    /// controller entry, is configured to serve) `kind`. A monolith that has
    /// not been fingerprinted yet counts as "unknown" and returns None.
    pub fn serves(&self, id: &str, kind: PluginKind) -> Option<bool> {
        let st = self.inner.state.lock();
        let mut unknown = false;
        for e in st.entries.iter().filter(|e| e.snapshot.id == id) {
            let s = &e.snapshot;
            if s.serves(kind) {
                return Some(true);
            }
            if kind == PluginKind::Controller
                && s.plugin_type == PluginType::Monolith
                && s.plugin_capabilities.is_none()
            {
                unknown = true;
            }
        }
        if unknown {
            None
        } else {
            Some(false)
        }
    }

    fn ready_entry(st: &State, id: &str, kind: PluginKind) -> Option<PluginSnapshot> {
        st.entries
            .iter()
            .map(|e| &e.snapshot)
            .find(|s| s.id == id && s.health == Health::Ready && s.serves(kind))
            .cloned()
    }

    fn reason_for(st: &State, id: &str, kind: PluginKind) -> String {
        let mut reasons: Vec<String> = st
            .entries
            .iter()
            .map(|e| &e.snapshot)
            .filter(|s| s.id == id)
            .filter(|s| match kind {
                PluginKind::Node => s.plugin_type.serves_node(),
                PluginKind::Controller => s.plugin_type.serves_controller(),
            })
            .map(|s| {
                if s.health == Health::Ready {
                    format!(
                        "{} at {} does not serve the {kind} side",
                        s.plugin_type.name(),
                        s.socket.display()
                    )
                } else {
                    format!("{} ({})", s.health.name(), s.reason)
                }
            })
            .collect();
        if reasons.is_empty() {
            return "no such plugin is configured or has a socket in the plugin directory"
                .to_string();
        }
        reasons.dedup();
        reasons.join("; ")
    }

    /// Waits until plugin `id` is ready to serve `kind`, up to `timeout`.
    /// Returns at once when it already is, and at once when the agent stops.
    pub fn wait_for_plugin(
        &self,
        id: &str,
        kind: PluginKind,
        timeout: Duration,
    ) -> Result<PluginSnapshot, WaitError> {
        let started = Instant::now();
        // None: no practical limit (a timeout too large to add).
        let deadline = started.checked_add(timeout);
        let mut st = self.inner.state.lock();
        loop {
            if let Some(s) = Self::ready_entry(&st, id, kind) {
                return Ok(s);
            }
            if self.inner.shutdown.is_triggered() {
                return Err(WaitError::Shutdown {
                    id: id.to_string(),
                    kind,
                });
            }
            let Some(deadline) = deadline else {
                self.inner.changed.wait(&mut st);
                continue;
            };
            if self.inner.changed.wait_until(&mut st, deadline).timed_out() {
                if let Some(s) = Self::ready_entry(&st, id, kind) {
                    return Ok(s);
                }
                return Err(WaitError::Timeout {
                    id: id.to_string(),
                    kind,
                    waited: started.elapsed(),
                    reason: Self::reason_for(&st, id, kind),
                });
            }
        }
    }

    /// Joins the registry's threads (after the stop was triggered); returns
    /// the names of those that did not end in time.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        let threads = self.inner.threads.lock().take();
        match threads {
            Some(t) => t.join_until(deadline),
            None => Vec::new(),
        }
    }

    fn update(&self, id: &str, ty: PluginType, f: impl FnOnce(&mut PluginSnapshot)) {
        let mut st = self.inner.state.lock();
        if let Some(e) = st
            .entries
            .iter_mut()
            .find(|e| e.snapshot.id == id && e.snapshot.plugin_type == ty)
        {
            let before = (e.snapshot.health, e.snapshot.reason.clone());
            f(&mut e.snapshot);
            if before != (e.snapshot.health, e.snapshot.reason.clone()) {
                let s = &e.snapshot;
                if s.health == Health::Ready {
                    log::info!("plugin {} ({}) is ready", s.id, ty.name());
                } else {
                    log::info!(
                        "plugin {} ({}) is {}: {}",
                        s.id,
                        ty.name(),
                        s.health.name(),
                        s.reason
                    );
                }
            }
            self.inner.changed.notify_all();
        }
    }

    fn client_of(&self, id: &str, ty: PluginType) -> Option<CsiClient> {
        self.inner
            .state
            .lock()
            .entries
            .iter()
            .find(|e| e.snapshot.id == id && e.snapshot.plugin_type == ty)
            .map(|e| e.snapshot.client.clone())
    }

    fn fingerprint_loop(&self, id: &str, ty: PluginType) {
        let Some(client) = self.client_of(id, ty) else {
            return;
        };
        let shutdown = self.inner.shutdown.clone();
        let interval = self.inner.opts.probe_interval;
        let mut fast = FAST_PROBE_INITIAL;
        // Identity of the socket file the last fingerprint talked to; a new
        // one means the plugin was restarted.
        let mut fingerprinted: Option<SocketId> = None;
        // The socket the current generation was counted for.
        let mut generation_socket: Option<SocketId> = None;
        while !shutdown.is_triggered() {
            let socket_id = socket_identity(client.socket());
            let healthy = match socket_id {
                Err(reason) => {
                    fingerprinted = None;
                    self.update(id, ty, |s| {
                        s.health = Health::Unhealthy;
                        s.reason = reason;
                    });
                    false
                }
                Ok(sid) => {
                    let fresh = if fingerprinted != Some(sid) {
                        match fingerprint(&client, ty) {
                            Ok(fp) => {
                                fingerprinted = Some(sid);
                                let new_socket = generation_socket != Some(sid);
                                generation_socket = Some(sid);
                                self.update(id, ty, |s| {
                                    let changed_node = s.node_id()
                                        != fp.node_info.as_ref().map(|n| n.node_id.as_str());
                                    if s.generation > 0 && changed_node {
                                        log::info!(
                                            "plugin {id} ({}) came back with node ID {:?}",
                                            ty.name(),
                                            fp.node_info
                                                .as_ref()
                                                .map(|n| n.node_id.as_str())
                                                .unwrap_or("-")
                                        );
                                    }
                                    let info = Some(fp.info);
                                    let plugin_caps = Some(fp.plugin_caps);
                                    // Counts plugin instances (a new socket)
                                    // and changed fingerprints, not rounds.
                                    if new_socket
                                        || s.info != info
                                        || s.plugin_capabilities != plugin_caps
                                        || s.node_capabilities != fp.node_caps
                                        || s.controller_capabilities != fp.controller_caps
                                        || s.node_info != fp.node_info
                                    {
                                        s.generation += 1;
                                    }
                                    s.info = info;
                                    s.plugin_capabilities = plugin_caps;
                                    s.node_capabilities = fp.node_caps;
                                    s.controller_capabilities = fp.controller_caps;
                                    s.node_info = fp.node_info;
                                });
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    } else {
                        Ok(())
                    };
                    let outcome = fresh.and_then(|()| client.probe());
                    match outcome {
                        Ok(Readiness::Ready) => {
                            self.update(id, ty, |s| {
                                s.health = Health::Ready;
                                s.reason.clear();
                                s.last_probe = Some(SystemTime::now());
                            });
                            true
                        }
                        Ok(Readiness::Starting) => {
                            self.update(id, ty, |s| {
                                s.health = Health::Starting;
                                s.reason = "Probe answered ready=false".to_string();
                                s.last_probe = Some(SystemTime::now());
                            });
                            false
                        }
                        Err(e) => {
                            // Fingerprint afresh next round: the plugin may
                            // come back as a different process.
                            fingerprinted = None;
                            let reason = crate::error_chain(&e);
                            self.update(id, ty, |s| {
                                s.health = Health::Unhealthy;
                                s.reason = reason;
                                s.last_probe = Some(SystemTime::now());
                            });
                            false
                        }
                    }
                }
            };
            if healthy {
                fast = FAST_PROBE_INITIAL;
                // Sleep until the next probe, checking the socket for a
                // replacement meanwhile.
                let next_probe = Instant::now().checked_add(interval);
                let current = fingerprinted;
                loop {
                    let now = Instant::now();
                    let left =
                        next_probe.map_or(Duration::MAX, |t| t.saturating_duration_since(now));
                    if left.is_zero() {
                        break;
                    }
                    if !shutdown.sleep(left.min(SOCKET_CHECK_INTERVAL)) {
                        return;
                    }
                    if socket_identity(client.socket()).ok() != current {
                        break;
                    }
                }
            } else {
                if !shutdown.sleep(fast) {
                    return;
                }
                fast = (fast * 2).min(FAST_PROBE_MAX);
            }
        }
    }

    fn scan_loop(&self, dir: &Path) {
        let shutdown = self.inner.shutdown.clone();
        loop {
            for p in scan_plugin_dir(dir) {
                if let Err(e) = self.add(p, "plugin_dir") {
                    log::error!("cannot start a fingerprint thread: {e}");
                }
            }
            if !shutdown.sleep(PLUGIN_DIR_SCAN_INTERVAL) {
                return;
            }
        }
    }
}

struct Fingerprint {
    info: PluginInfo,
    plugin_caps: PluginCapabilities,
    node_caps: Option<NodeCapabilities>,
    controller_caps: Option<ControllerCapabilities>,
    node_info: Option<NodeInfo>,
}

fn fingerprint(client: &CsiClient, ty: PluginType) -> Result<Fingerprint, CsiError> {
    let info = client.get_plugin_info()?;
    let plugin_caps = client.get_plugin_capabilities()?;
    let (node_caps, node_info) = if ty.serves_node() {
        let node_info = client.node_get_info()?;
        (Some(client.node_get_capabilities()?), Some(node_info))
    } else {
        (None, None)
    };
    let wants_controller = match ty {
        PluginType::Controller => true,
        PluginType::Monolith => plugin_caps.controller_service,
        PluginType::Node => false,
    };
    let controller_caps = if wants_controller {
        Some(client.controller_get_capabilities()?)
    } else {
        None
    };
    Ok(Fingerprint {
        info,
        plugin_caps,
        node_caps,
        controller_caps,
        node_info,
    })
}

/// Identity of a socket file: device, inode and change time. A restarted
/// plugin recreates its socket; file systems such as ext4 often hand the
/// new file the old inode number, so the change time is part of it.
type SocketId = (u64, u64, i64, i64);

/// The socket file's identity, or why it cannot be used.
fn socket_identity(path: &Path) -> Result<SocketId, String> {
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_socket() => Ok((m.dev(), m.ino(), m.ctime(), m.ctime_nsec())),
        Ok(_) => Err(format!("{} is not a socket", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("socket {} does not exist", path.display()))
        }
        Err(e) => Err(format!("socket {}: {e}", path.display())),
    }
}

/// Plugin sockets found in the plugin directory (layout in the module doc).
pub fn scan_plugin_dir(dir: &Path) -> Vec<PluginConfig> {
    let mut found = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return found;
    };
    let mut names: BTreeMap<String, PathBuf> = BTreeMap::new();
    for ent in rd.flatten() {
        if let Some(name) = ent.file_name().to_str() {
            if crate::ids::check_id("plugin", name).is_ok() && ent.path().is_dir() {
                names.insert(name.to_string(), ent.path());
            }
        }
    }
    for (id, path) in names {
        for (file, ty) in [
            ("csi.sock", PluginType::Monolith),
            ("node.sock", PluginType::Node),
            ("controller.sock", PluginType::Controller),
        ] {
            let socket = path.join(file);
            if socket_identity(&socket).is_ok() {
                found.push(PluginConfig {
                    id: id.clone(),
                    plugin_type: ty,
                    socket,
                });
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(shutdown: &Shutdown) -> Registry {
        Registry::start(
            crate::csi::grpc_environment("test-grpc"),
            &[PluginConfig {
                id: "absent".into(),
                plugin_type: PluginType::Node,
                socket: PathBuf::from("/nonexistent/claimd-test/csi.sock"),
            }],
            RegistryOptions {
                call_timeout: Duration::from_secs(1),
                probe_interval: Duration::from_secs(1),
                plugin_dir: None,
            },
            shutdown.clone(),
        )
        .expect("registry starts")
    }

    #[test]
    fn waiter_times_out_with_the_plugin_and_reason() {
        let shutdown = Shutdown::new();
        let reg = registry(&shutdown);
        let e = reg
            .wait_for_plugin("absent", PluginKind::Node, Duration::from_millis(300))
            .expect_err("never ready");
        let msg = e.to_string();
        assert!(msg.contains("node plugin absent"), "{msg}");
        assert!(msg.contains("does not exist"), "{msg}");
        let e = reg
            .wait_for_plugin("other", PluginKind::Node, Duration::from_millis(50))
            .expect_err("unknown");
        assert!(e.to_string().contains("no such plugin"), "{e}");
        shutdown.trigger();
        assert!(reg.join(Instant::now() + Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn waiter_wakes_at_once_on_shutdown() {
        let shutdown = Shutdown::new();
        let reg = registry(&shutdown);
        let r = reg.clone();
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            let res = r.wait_for_plugin("absent", PluginKind::Node, Duration::from_secs(120));
            (res, t.elapsed())
        });
        // Let the waiter block (it cannot become ready: the socket is absent).
        std::thread::sleep(Duration::from_millis(100));
        shutdown.trigger();
        let (res, took) = waiter.join().expect("waiter");
        assert!(matches!(res, Err(WaitError::Shutdown { .. })), "{res:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(reg.join(Instant::now() + Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn plugin_dir_layout() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("hostpath")).expect("mkdir");
        std::fs::create_dir_all(dir.path().join("ebs")).expect("mkdir");
        std::fs::create_dir_all(dir.path().join("bad id")).expect("mkdir");
        let bind = |p: PathBuf| std::os::unix::net::UnixListener::bind(p).expect("bind");
        let _a = bind(dir.path().join("hostpath/csi.sock"));
        let _b = bind(dir.path().join("ebs/node.sock"));
        let _c = bind(dir.path().join("ebs/controller.sock"));
        let _d = bind(dir.path().join("bad id/csi.sock"));
        std::fs::write(dir.path().join("hostpath/node.sock"), b"not a socket").expect("write");
        let found = scan_plugin_dir(dir.path());
        let got: Vec<_> = found
            .iter()
            .map(|p| (p.id.as_str(), p.plugin_type))
            .collect();
        assert_eq!(
            got,
            vec![
                ("ebs", PluginType::Node),
                ("ebs", PluginType::Controller),
                ("hostpath", PluginType::Monolith)
            ]
        );
    }
}
