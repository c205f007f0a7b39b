//! The test plugin as a child process: its builder, its volumes, its
//! sockets, call log and fault file.

use super::*;

// ---- The test plugin -----------------------------------------------------

/// Starts `claimd-test-plugin` with chosen flags.
pub struct TestPluginBuilder {
    dir: PathBuf,
    args: Vec<String>,
    /// `--storage`: the storage system shared with other plugins; none:
    /// `<dir>/root`.
    storage: Option<PathBuf>,
}

impl TestPluginBuilder {
    /// Shares the storage system at `storage` (volumes, controller.json,
    /// fencing state) with the other plugins given the same one, as
    /// plugins on several nodes of one storage system do; node-local state
    /// stays in this plugin's own root.
    pub fn storage(mut self, storage: &Path) -> Self {
        self.storage = Some(storage.to_path_buf());
        self
    }

    /// `--fence-on-unpublish`: ControllerUnpublishVolume cuts the node
    /// off (unmounts its paths, refuses its NodeStage and NodePublish
    /// until the next ControllerPublishVolume).
    pub fn fence_on_unpublish(self) -> Self {
        self.args(&["--fence-on-unpublish"])
    }

    pub fn node_id(self, id: &str) -> Self {
        self.args(&["--node-id", id])
    }

    pub fn name(self, name: &str) -> Self {
        self.args(&["--name", name])
    }

    pub fn no_stage(self) -> Self {
        self.args(&["--no-stage"])
    }

    pub fn no_controller(self) -> Self {
        self.args(&["--no-controller"])
    }

    /// `--log-starts`: a call-log line when each call starts, too
    /// (`CallLog::starts`, `CallLog::open_calls`).
    pub fn log_starts(self) -> Self {
        self.args(&["--log-starts"])
    }

    pub fn require_contexts(self) -> Self {
        self.args(&["--require-contexts"])
    }

    pub fn max_volumes_per_node(self, n: u32) -> Self {
        self.args(&["--max-volumes-per-node", &n.to_string()])
    }

    /// Also advertise capability type 99 (defined by no CSI version) in
    /// every capability list.
    pub fn unknown_capability(self) -> Self {
        self.args(&["--unknown-capability"])
    }

    /// Node IDs besides its own that ControllerPublish accepts, in
    /// `<dir>/known-nodes` (more with `TestPlugin::add_known_node`).
    pub fn known_nodes(self, ids: &[&str]) -> Self {
        let file = self.dir.join(KNOWN_NODES_FILE);
        fs::create_dir_all(&self.dir).expect("create the plugin directory");
        let text: String = ids.iter().map(|id| format!("{id}\n")).collect();
        fs::write(&file, text).expect("write the known-nodes file");
        let file = file.to_str().expect("test paths are UTF-8").to_string();
        self.args(&["--known-nodes", &file])
    }

    /// Volumes that exist in the plugin's storage before it starts (more
    /// with `TestPlugin::add_volume`): the plugin refuses unknown volume IDs.
    pub fn volumes(self, ids: &[&str]) -> Self {
        let storage = self.storage_dir();
        for id in ids {
            add_volume_dir(&storage, id);
        }
        self
    }

    fn storage_dir(&self) -> PathBuf {
        self.storage
            .clone()
            .unwrap_or_else(|| self.dir.join("root"))
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Starts the plugin and waits until its socket accepts connections.
    pub fn start(self) -> TestPlugin {
        fs::create_dir_all(&self.dir).expect("create the plugin directory");
        let mut args = self.args.clone();
        if let Some(storage) = &self.storage {
            let storage = storage.to_str().expect("test paths are UTF-8");
            args.extend(["--storage".to_string(), storage.to_string()]);
        }
        let mut plugin = TestPlugin {
            socket: self.dir.join("csi.sock"),
            storage: self.storage_dir(),
            root: self.dir.join("root"),
            call_log: self.dir.join("calls.jsonl"),
            faults: self.dir.join("faults.json"),
            stderr: self.dir.join("stderr.log"),
            dir: self.dir,
            args,
            process: ChildProcess::new("the test plugin"),
        };
        plugin.spawn();
        plugin
    }
}

/// The known-nodes file under a plugin's directory.
const KNOWN_NODES_FILE: &str = "known-nodes";

/// Creates volume `id` in the storage system at `storage`
/// (`<storage>/volumes/<id>`, as CreateVolume would).
pub fn add_volume_dir(storage: &Path, id: &str) {
    assert!(
        !id.is_empty() && !id.contains('/') && id != "." && id != "..",
        "{id:?} is not a volume ID the test plugin accepts"
    );
    let dir = storage.join("volumes").join(id);
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create volume {}: {e}", dir.display()));
}

/// A running `claimd-test-plugin`; killed on drop.
///
/// Layout under its directory: `csi.sock`, `root/` (node-local state, and
/// volumes and `controller.json` unless it shares a storage system),
/// `calls.jsonl`, `faults.json`, `stderr.log`.
pub struct TestPlugin {
    dir: PathBuf,
    args: Vec<String>,
    process: ChildProcess,
    pub socket: PathBuf,
    pub root: PathBuf,
    /// The storage system: `root`, or the one shared with `storage(..)`.
    pub storage: PathBuf,
    pub call_log: PathBuf,
    pub faults: PathBuf,
    pub stderr: PathBuf,
}

impl TestPlugin {
    /// A plugin living in `<dir>/plugin`.
    pub fn builder(dir: &Path) -> TestPluginBuilder {
        TestPluginBuilder {
            dir: dir.join("plugin"),
            args: Vec::new(),
            storage: None,
        }
    }

    fn spawn(&mut self) {
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr)
            .expect("open the plugin's stderr log");
        self.process.spawn(
            Command::new(env!("CARGO_BIN_EXE_claimd-test-plugin"))
                .arg("--endpoint")
                .arg(&self.socket)
                .arg("--root")
                .arg(&self.root)
                .arg("--call-log")
                .arg(&self.call_log)
                .arg("--faults")
                .arg(&self.faults)
                .args(&self.args)
                .env("RUST_LOG", "debug")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr),
        );
        // Readiness is a connect, not a CSI call, so the call log holds
        // exactly the calls the test made. A stale socket file refuses
        // connections until the new plugin has replaced it.
        let stderr = &self.stderr;
        self.process
            .wait_listening(&self.socket, PLUGIN_START_TIMEOUT, || read_log(stderr));
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Waits for the plugin to exit on its own (an `exit` fault).
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        self.process.wait_exit(deadline)
    }

    /// SIGSTOP; returns once every thread of the plugin is stopped.
    pub fn freeze(&self) {
        self.process.freeze();
    }

    /// SIGCONT; returns once no thread of the plugin is stopped.
    pub fn thaw(&self) {
        self.process.thaw();
    }

    /// SIGKILL, like a crash.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM, and wait for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.pid().expect("plugin running");
        let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
        // SAFETY: plain kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "SIGTERM");
        self.wait_exit(PLUGIN_EXIT_TIMEOUT)
    }

    /// Kills (if running) and starts again with the same flags and
    /// directory: its state and fault file stay.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A client for this plugin's socket.
    pub fn client(&self) -> CsiClient {
        self.client_with_timeout(CALL_TIMEOUT)
    }

    pub fn client_with_timeout(&self, timeout: Duration) -> CsiClient {
        CsiClient::new(grpc_env(), &self.socket, timeout)
    }

    pub fn call_log(&self) -> CallLog {
        CallLog {
            path: self.call_log.clone(),
        }
    }

    pub fn faults(&self) -> Faults {
        Faults {
            path: self.faults.clone(),
        }
    }

    /// `<storage>/volumes/<id>`.
    pub fn volume_dir(&self, id: &str) -> PathBuf {
        self.storage.join("volumes").join(id)
    }

    /// Creates a volume in the plugin's storage (the plugin refuses volume
    /// IDs it does not know).
    pub fn add_volume(&self, id: &str) {
        add_volume_dir(&self.storage, id);
    }

    /// Adds a node ID that ControllerPublish accepts; the plugin must have
    /// been started with `known_nodes`.
    pub fn add_known_node(&self, id: &str) {
        let file = self.dir.join(KNOWN_NODES_FILE);
        assert!(file.is_file(), "start the plugin with known_nodes(..)");
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .expect("open the known-nodes file");
        io::Write::write_all(&mut f, format!("{id}\n").as_bytes())
            .expect("append to the known-nodes file");
    }

    /// The plugin's `controller.json`, if written.
    pub fn controller_state(&self) -> Option<Value> {
        let text = fs::read_to_string(self.storage.join("controller.json")).ok()?;
        Some(serde_json::from_str(&text).expect("controller.json is JSON"))
    }

    pub fn stderr_text(&self) -> String {
        read_log(&self.stderr)
    }
}

impl Drop for TestPlugin {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            eprintln!(
                "---- test plugin stderr ({}) ----\n{}",
                self.stderr.display(),
                self.stderr_text()
            );
        }
    }
}
