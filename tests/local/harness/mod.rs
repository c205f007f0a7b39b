//! The local area's harness, for `tests/local/lifecycle/`: the real test plugin, a plugin
//! registry, a state store, a claim store (the embedded one or a
//! remote-like one, see `claims.rs`) that counts (and can refuse) claims,
//! and a `Lifecycle`, all on one test directory; plus a "restart"
//! that stops every thread, drops the store (releasing its lock) and builds
//! everything again on the same directories, optionally with a new boot ID.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::config::{PluginConfig, PluginType};
use claimd::lifecycle::{Lifecycle, LifecycleOptions, RestoreReport};
use claimd::plugins::{PluginKind, Registry, RegistryOptions};
use claimd::retry::BackoffPolicy;
use claimd::shutdown::Shutdown;
use claimd::state::{StateError, StateFile, StateStore, STATE_FILE};
use claimd::volumes::{AccessMode, AttachmentMode, MountOptions, VolumeRequest, VolumeSpec};
use serde_json::Value;

use crate::common::*;

mod claims;
pub use claims::{store_kind, with_store, RemoteClaims, StoreKind, TestClaims};

/// The plugin ID every test volume uses.
pub const PLUGIN: &str = "testplug";
/// claimd's own node name (claims).
pub const NODE_NAME: &str = "node-1";
/// The test plugin's default external node ID (NodeGetInfo).
pub const PLUGIN_NODE_ID: &str = "test-node";
pub const FIRST_BOOT: &str = "boot-1";

/// The CSI calls of the volume lifecycle, as named in the call log.
pub const CP: &str = "ControllerPublishVolume";
pub const CU: &str = "ControllerUnpublishVolume";
pub const NS: &str = "NodeStageVolume";
pub const NUS: &str = "NodeUnstageVolume";
pub const NP: &str = "NodePublishVolume";
pub const NU: &str = "NodeUnpublishVolume";
pub const LIFECYCLE_METHODS: [&str; 6] = [CP, NS, NP, NU, NUS, CU];

/// Bound of every wait for an outcome that should take well under a second.
pub const WAIT: Duration = Duration::from_secs(20);
/// How long stopping the manager and registry may take.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

pub fn init_logging() {
    let _ = env_logger::builder().is_test(true).try_init();
}

// ---- Volumes and requests --------------------------------------------------

pub fn external_id(volume: &str) -> String {
    format!("ext-{volume}")
}

/// A file-system volume of the test plugin.
pub fn spec(id: &str, modes: &[AccessMode]) -> VolumeSpec {
    VolumeSpec {
        id: id.to_string(),
        plugin_id: PLUGIN.to_string(),
        external_id: external_id(id),
        access_modes: modes.to_vec(),
        attachment_modes: vec![AttachmentMode::FileSystem],
        mount_options: MountOptions::default(),
        context: BTreeMap::from([("origin".to_string(), format!("ctx-{id}"))]),
        secrets: BTreeMap::from([("token".to_string(), SECRET.to_string())]),
        accessible_topology: Vec::new(),
        capacity_bytes: 0,
        node_expansion_pending: false,
    }
}

/// The secret value every test volume carries; it must never reach a log.
pub const SECRET: &str = "s3cret-value-never-logged";

pub fn request(alias: &str, volume: &str, read_only: bool) -> VolumeRequest {
    VolumeRequest {
        alias: alias.to_string(),
        volume_id: volume.to_string(),
        read_only,
        access_mode: None,
        attachment: None,
        mount_flags: Vec::new(),
        mount_group: String::new(),
    }
}

/// What the test plugin's ControllerPublish answers for a volume.
pub fn publish_context(volume: &str, node_id: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("attached_node".to_string(), node_id.to_string()),
        (
            "device".to_string(),
            format!("/dev/claimd-test/{}", external_id(volume)),
        ),
    ])
}

// ---- One "agent": store, claims, registry, manager ---------------------------

pub struct Running {
    pub shutdown: Shutdown,
    pub registry: Registry,
    pub store: Arc<StateStore>,
    pub claims: Arc<TestClaims>,
    pub manager: Lifecycle,
}

impl Running {
    fn start(
        state_dir: &Path,
        mount_root: &Path,
        socket: &Path,
        boot_id: &str,
        kind: StoreKind,
        remote: &RemoteClaims,
    ) -> Running {
        let store = Arc::new(open_store(state_dir, boot_id));
        let shutdown = Shutdown::new();
        let registry = Registry::start(
            grpc_env(),
            &[PluginConfig {
                id: PLUGIN.to_string(),
                plugin_type: PluginType::Monolith,
                socket: socket.to_path_buf(),
            }],
            RegistryOptions {
                call_timeout: Duration::from_secs(5),
                probe_interval: Duration::from_millis(200),
                plugin_dir: None,
            },
            shutdown.clone(),
        )
        .expect("start the plugin registry");
        let claims = Arc::new(TestClaims::new(kind, store.clone(), remote.clone()));
        let backoff = BackoffPolicy::new(Duration::from_millis(50), Duration::from_millis(200));
        let mut opts = LifecycleOptions::new(mount_root, NODE_NAME);
        opts.plugin_wait = Duration::from_secs(15);
        opts.claim_retry_deadline = Duration::from_secs(30);
        opts.claim_backoff = backoff;
        opts.mount_retry_deadline = Duration::from_secs(15);
        opts.release_retry_deadline = Duration::from_secs(60);
        opts.csi_backoff = backoff;
        opts.restore_wait = Duration::from_secs(5);
        // The registry's call deadline: a timed-out call has had that long
        // to finish.
        opts.uncertain_settle = Duration::from_secs(5);
        let manager = Lifecycle::new(
            store.clone(),
            claims.clone(),
            registry.clone(),
            opts,
            shutdown.clone(),
        );
        Running {
            shutdown,
            registry,
            store,
            claims,
            manager,
        }
    }

    /// Triggers the stop, joins every thread, and drops the store so its
    /// lock is free. Panics (unless already panicking) when a thread does
    /// not end or something still holds the store.
    fn stop(self) {
        let Running {
            shutdown,
            registry,
            store,
            claims,
            manager,
        } = self;
        shutdown.trigger();
        let deadline = Instant::now() + STOP_TIMEOUT;
        let mut left = manager.join(deadline);
        left.extend(registry.join(deadline));
        drop(manager);
        drop(claims);
        drop(registry);
        let quiet = std::thread::panicking();
        if !left.is_empty() && !quiet {
            panic!("threads still running after the stop: {left:?}");
        }
        // Threads a test started (a blocked mount) return once the stop
        // wakes them; wait for their manager clones to go.
        let start = Instant::now();
        while Arc::strong_count(&store) > 1 {
            if start.elapsed() > STOP_TIMEOUT {
                if !quiet {
                    panic!("the state store is still referenced after the stop");
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // As the agent's stop: what is applied is written (closing writes
        // the flusher did not get to).
        if let Err(e) = store.flush() {
            if !quiet {
                panic!("the stop's flush failed: {e}");
            }
        }
        drop(store);
    }
}

/// Opens the state store of a stopped manager. Its lock (a `flock` on a
/// close-on-exec descriptor) can outlive the stop by a moment: a process
/// that another test of this binary forks at that time holds a copy of
/// every descriptor until its `exec`. So `Locked` is waited out while the
/// lock is held (bounded); any other error fails at once.
fn open_store(state_dir: &Path, boot_id: &str) -> StateStore {
    let start = Instant::now();
    loop {
        match StateStore::open_with_boot_id(state_dir, boot_id) {
            Ok(store) => return store,
            Err(StateError::Locked { .. }) if start.elapsed() < STOP_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("open the state store: {e:?}"),
        }
    }
}

// ---- The harness ---------------------------------------------------------------

pub struct Harness {
    running: Option<Running>,
    pub plugin: TestPlugin,
    pub state_dir: PathBuf,
    pub mount_root: PathBuf,
    pub boot_id: String,
    /// The claim store kind of this test (see `with_store`).
    pub store_kind: StoreKind,
    /// The remote-like store's claims: outlive every restart.
    pub remote: RemoteClaims,
    /// The canonical test directory (the plugin lives in `<base>/plugin`).
    pub base: PathBuf,
    // Last: unmounts everything under it, then removes it.
    pub dir: TestDir,
}

impl Harness {
    /// The default plugin: monolith, STAGE_UNSTAGE and controller on.
    pub fn new() -> Harness {
        Harness::with_plugin(|b| b)
    }

    pub fn with_plugin(f: impl FnOnce(TestPluginBuilder) -> TestPluginBuilder) -> Harness {
        init_logging();
        let dir = TestDir::new();
        let base = fs::canonicalize(dir.path()).expect("canonical test directory");
        let plugin = f(TestPlugin::builder(&base)).start();
        let mount_root = base.join("mounts");
        fs::create_dir_all(&mount_root).expect("create the mount root");
        let mut h = Harness {
            running: None,
            plugin,
            state_dir: base.join("state"),
            mount_root,
            boot_id: FIRST_BOOT.to_string(),
            store_kind: store_kind(),
            remote: RemoteClaims::default(),
            base,
            dir,
        };
        h.start();
        h
    }

    fn start(&mut self) {
        assert!(self.running.is_none(), "already running");
        self.running = Some(Running::start(
            &self.state_dir,
            &self.mount_root,
            &self.plugin.socket,
            &self.boot_id,
            self.store_kind,
            &self.remote,
        ));
    }

    fn running(&self) -> &Running {
        self.running.as_ref().expect("the manager is running")
    }

    pub fn m(&self) -> &Lifecycle {
        &self.running().manager
    }

    pub fn claims(&self) -> &TestClaims {
        &self.running().claims
    }

    /// Every claim of the lifecycle's claim store.
    pub fn all_claims(&self) -> Vec<claimd::claims::Claim> {
        self.m()
            .list_claims(claimd::claims::ClaimFilter::ALL)
            .expect("the test claim store answers")
            .claims
    }

    pub fn registry(&self) -> &Registry {
        &self.running().registry
    }

    pub fn shutdown(&self) -> &Shutdown {
        &self.running().shutdown
    }

    /// Kills the plugin and starts a new one on the same socket, root,
    /// call log and fault file, with other flags.
    pub fn replace_plugin(&mut self, f: impl FnOnce(TestPluginBuilder) -> TestPluginBuilder) {
        self.plugin.kill();
        self.plugin = f(TestPlugin::builder(&self.base)).start();
    }

    /// Stops the manager and registry and frees the state directory.
    pub fn stop(&mut self) {
        if let Some(r) = self.running.take() {
            r.stop();
        }
    }

    /// Starts again on the same directories (after `stop`), without restore.
    pub fn start_again(&mut self, boot_id: &str) {
        self.boot_id = boot_id.to_string();
        self.start();
    }

    /// Stop, start on the same directories and boot, restore.
    pub fn restart(&mut self) -> RestoreReport {
        self.stop();
        self.start();
        self.m().restore()
    }

    /// A simulated reboot: stop, lazily unmount everything under the mount
    /// root, start with a new boot ID, restore.
    pub fn reboot(&mut self, boot_id: &str) -> RestoreReport {
        self.stop();
        detach_all_under(&self.mount_root);
        self.start_again(boot_id);
        self.m().restore()
    }

    /// Edits the stopped agent's state through a store of its own. With
    /// the remote-like claim store, `f` sees (and edits) its claims as if
    /// they were in the state: they are moved in before and back after.
    pub fn edit_state(&self, f: impl FnOnce(&mut StateFile)) {
        assert!(self.running.is_none(), "stop the manager first");
        let store = open_store(&self.state_dir, &self.boot_id);
        store
            .update::<_, StateError>(|s| {
                self.claims_into(s);
                f(s);
                if self.store_kind == StoreKind::Remote {
                    let mut remote = self.remote.lock();
                    remote.clear();
                    for (k, c) in s.claims.iter() {
                        remote.insert(k.clone(), (**c).clone());
                    }
                    s.claims.clear();
                }
                Ok(())
            })
            .expect("write state");
    }

    /// With the remote-like claim store, puts its claims into `s` (where
    /// the embedded store keeps them), so one view serves both kinds.
    fn claims_into(&self, s: &mut StateFile) {
        if self.store_kind == StoreKind::Remote {
            assert!(
                s.claims.is_empty(),
                "claims in the local state: {:?}",
                s.claims
            );
            for (k, c) in self.remote.lock().iter() {
                s.claims.insert(k.clone(), Arc::new(c.clone()));
            }
        }
    }

    pub fn state_path(&self) -> PathBuf {
        self.state_dir.join(STATE_FILE)
    }

    /// Waits until the running manager's closing state writes are on disk
    /// (its flusher writes them within milliseconds).
    pub fn wait_settled(&self) {
        if let Some(r) = &self.running {
            wait_until(
                Duration::from_secs(20),
                "the closing state writes to reach the disk",
                || r.store.undurable_changes() == 0,
            );
        }
    }

    /// The durable state: the snapshot with the journal replayed (and, with
    /// the remote-like claim store, the claims it holds).
    pub fn state_on_disk(&self) -> StateFile {
        self.wait_settled();
        let mut s = claimd::state::load_dir(&self.state_dir)
            .expect("the state on disk reads back")
            .expect("there is a state on disk")
            .state;
        self.claims_into(&mut s);
        s
    }

    /// The bytes of the snapshot and of the journal.
    pub fn state_bytes(&self) -> (Vec<u8>, Vec<u8>) {
        self.wait_settled();
        (
            fs::read(self.state_path()).expect("read the snapshot"),
            fs::read(self.state_dir.join(claimd::state::journal::JOURNAL_FILE))
                .expect("read the journal"),
        )
    }

    /// Registers a volume with the agent, after creating it in the test
    /// plugin's storage (the plugin refuses volume IDs it does not know).
    pub fn register(&self, spec: VolumeSpec) {
        self.plugin.add_volume(&spec.external_id);
        self.m().register_volume(spec).expect("register volume");
    }

    /// Where a volume of an allocation is published.
    pub fn target(&self, alloc: &str, volume: &str, usage_dir: &str) -> PathBuf {
        self.mount_root
            .join("per-alloc")
            .join(alloc)
            .join(volume)
            .join(usage_dir)
    }

    /// Where a volume is staged: one path per volume on the node.
    pub fn staging(&self, volume: &str) -> PathBuf {
        self.mount_root.join("staging").join(PLUGIN).join(volume)
    }

    /// The lifecycle calls (no fingerprint or probe calls) so far.
    pub fn lifecycle_calls(&self) -> Vec<Value> {
        self.plugin
            .call_log()
            .calls()
            .into_iter()
            .filter(|c| {
                LIFECYCLE_METHODS
                    .iter()
                    .any(|m| c["method"].as_str() == Some(m))
            })
            .collect()
    }

    /// Lifecycle calls after the first `skip`, as (method, volume, code).
    pub fn calls_since(&self, skip: usize) -> Vec<(String, String, String)> {
        self.lifecycle_calls()
            .iter()
            .skip(skip)
            .map(summary)
            .collect()
    }

    /// Waits until the plugin is ready for the node side (fingerprinted).
    pub fn wait_plugin_ready(&self) {
        let reg = self.registry().clone();
        wait_until(WAIT, "the node plugin to be ready", || {
            reg.get_ready(PLUGIN, PluginKind::Node).is_some()
        });
    }

    /// The plugin's attachments: volume -> node IDs.
    pub fn attachments(&self) -> BTreeMap<String, Vec<String>> {
        let Some(state) = self.plugin.controller_state() else {
            return BTreeMap::new();
        };
        state["attachments"]
            .as_object()
            .map(|vols| {
                vols.iter()
                    .map(|(v, nodes)| {
                        let nodes = nodes
                            .as_object()
                            .map(|n| n.keys().cloned().collect())
                            .unwrap_or_default();
                        (v.clone(), nodes)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Removes a volume's attachment from the plugin's controller state,
    /// as if ControllerPublish had never been sent.
    pub fn forget_attachment(&self, volume: &str) {
        let path = self.plugin.root.join("controller.json");
        let text = fs::read_to_string(&path).expect("read controller.json");
        let mut v: Value = serde_json::from_str(&text).expect("controller.json is JSON");
        let removed = v["attachments"]
            .as_object_mut()
            .expect("attachments")
            .remove(&external_id(volume));
        assert!(removed.is_some(), "{volume} was not attached");
        let tmp = path.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(&v).expect("encode")).expect("write");
        fs::rename(&tmp, &path).expect("rename controller.json");
    }

    /// Every path under the mount root, relative, sorted.
    pub fn tree(&self) -> Vec<String> {
        tree(&self.mount_root)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.stop();
        }
    }
}

/// (method, volume_id, code) of a call-log record.
pub fn summary(c: &Value) -> (String, String, String) {
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    (s("method"), s("volume_id"), s("code"))
}

/// Expected (method, external volume id, "OK") triples.
pub fn ok_calls(calls: &[(&str, &str)]) -> Vec<(String, String, String)> {
    calls
        .iter()
        .map(|(m, v)| (m.to_string(), external_id(v), "OK".to_string()))
        .collect()
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

pub fn tree(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = fs::read_dir(dir) else { return };
        for e in rd {
            let e = e.expect("read dir entry");
            let p = e.path();
            out.push(
                p.strip_prefix(root)
                    .expect("under root")
                    .to_string_lossy()
                    .into_owned(),
            );
            if e.file_type().expect("file type").is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

// ---- Mounts ------------------------------------------------------------------

/// umount(2), as an administrator undoing a mount would.
pub fn umount(path: &Path) {
    umount_flags(path, 0).unwrap_or_else(|e| panic!("umount {}: {e}", path.display()));
}

fn umount_flags(path: &Path, flags: libc::c_int) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).expect("no NUL in path");
    // SAFETY: a valid NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Lazily unmounts every mount under `dir`, deepest first (a reboot).
pub fn detach_all_under(dir: &Path) {
    let mut left = mounts_under(dir);
    left.sort_by_key(|m| std::cmp::Reverse(m.mount_point.as_os_str().len()));
    for m in left {
        umount_flags(&m.mount_point, libc::MNT_DETACH)
            .unwrap_or_else(|e| panic!("detach {}: {e}", m.mount_point.display()));
    }
    assert!(mounts_under(dir).is_empty(), "mounts left under {dir:?}");
}

/// Removes `dir` and everything below it that is an empty directory;
/// panics on anything else (never deletes data).
pub fn remove_empty_dirs(dir: &Path) {
    if !dir.exists() {
        return;
    }
    for e in fs::read_dir(dir).expect("read dir") {
        let e = e.expect("entry");
        assert!(
            e.file_type().expect("type").is_dir(),
            "{} is not a directory",
            e.path().display()
        );
        remove_empty_dirs(&e.path());
    }
    fs::remove_dir(dir).unwrap_or_else(|e| panic!("remove {}: {e}", dir.display()));
}

/// The claims of a state, in key order.
pub fn claim_list(st: &StateFile) -> Vec<claimd::claims::Claim> {
    st.claims.values().map(|c| (**c).clone()).collect()
}
