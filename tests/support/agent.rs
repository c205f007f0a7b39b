//! The real `claimd` binary as an agent
//! process (config file, state directory, mount root and API socket all
//! inside one test directory), the same binary's client commands with
//! captured output and exit code, signals, and a guard that kills the agent
//! when a test ends.
//!
//! Shared by every area: each `tests/<area>/main.rs` declares it as
//! `agent_support`, next to `common`.
#![allow(dead_code)]

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;

/// The `claimd` binary under test.
pub const CLAIMD: &str = env!("CARGO_BIN_EXE_claimd");
/// claimd's node name (claims) unless `AgentConfig::node_name` says otherwise.
pub const NODE_NAME: &str = "node-1";
/// The plugin ID test volumes use.
pub const PLUGIN_ID: &str = "testplug";
/// How long an agent may take to listen on its API socket after start.
pub const AGENT_START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client command may run before the test calls it hung.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(120);

/// Exit codes of the CLI.
pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_UNREACHABLE: i32 = 3;

/// CSI methods that only fingerprint or probe a plugin; everything else in
/// a call log is a volume operation.
pub const IDENTITY_METHODS: [&str; 6] = [
    "GetPluginInfo",
    "GetPluginCapabilities",
    "Probe",
    "NodeGetCapabilities",
    "NodeGetInfo",
    "ControllerGetCapabilities",
];

pub const CP: &str = "ControllerPublishVolume";
pub const NS: &str = "NodeStageVolume";
pub const NP: &str = "NodePublishVolume";
pub const NUP: &str = "NodeUnpublishVolume";
pub const NUS: &str = "NodeUnstageVolume";
pub const CUP: &str = "ControllerUnpublishVolume";

/// The volume calls of a call log, in order, with their codes.
pub fn volume_calls(log: &CallLog) -> Vec<(String, String)> {
    log.methods_and_codes()
        .into_iter()
        .filter(|(m, _)| !IDENTITY_METHODS.contains(&m.as_str()))
        .collect()
}

/// The volume call methods of a call log, in order.
pub fn volume_methods(log: &CallLog) -> Vec<String> {
    volume_calls(log).into_iter().map(|(m, _)| m).collect()
}

/// How many calls of `method` ended with `code`.
pub fn count_calls(log: &CallLog, method: &str, code: &str) -> usize {
    log.methods_and_codes()
        .iter()
        .filter(|(m, c)| m == method && c == code)
        .count()
}

// ---- Config ----------------------------------------------------------------

/// What goes into the agent's config file. Paths default to places inside
/// the test directory.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub state_dir: PathBuf,
    pub api_socket: PathBuf,
    pub mount_root: PathBuf,
    /// (id, type, socket)
    pub plugins: Vec<(String, String, PathBuf)>,
    pub csi_call_timeout: String,
    pub plugin_wait_timeout: String,
    pub probe_interval: String,
    pub release_retry_deadline: String,
    pub claim_retry_deadline: String,
    /// Left to the agent's default when None.
    pub mount_retry_deadline: Option<String>,
    /// The agent's node name (claims; in cluster mode, `nodes/<node>`).
    pub node_name: String,
    /// The `cluster` section (see `cluster_section`); none by default.
    pub cluster: Option<Value>,
    /// More fields, written as they are (`metrics_listen`, ...).
    pub extra: Vec<(String, Value)>,
}

impl AgentConfig {
    /// Everything under `dir`: `agent/state`, `run/claimd.sock`, `mounts`,
    /// and the test plugin's socket as monolith `testplug` when given.
    pub fn new(dir: &Path, plugin_socket: Option<&Path>) -> AgentConfig {
        AgentConfig {
            state_dir: dir.join("agent").join("state"),
            api_socket: dir.join("run").join("claimd.sock"),
            mount_root: dir.join("mounts"),
            plugins: plugin_socket
                .map(|s| {
                    vec![(
                        PLUGIN_ID.to_string(),
                        "monolith".to_string(),
                        s.to_path_buf(),
                    )]
                })
                .unwrap_or_default(),
            csi_call_timeout: "5s".into(),
            plugin_wait_timeout: "20s".into(),
            probe_interval: "2s".into(),
            release_retry_deadline: "10m".into(),
            claim_retry_deadline: "10s".into(),
            mount_retry_deadline: None,
            node_name: NODE_NAME.to_string(),
            cluster: None,
            extra: Vec::new(),
        }
    }

    /// Cluster mode on `endpoints` (see `cluster_section`), as node `node`.
    pub fn cluster_node(mut self, node: &str, endpoints: &[String]) -> AgentConfig {
        self.node_name = node.to_string();
        self.cluster = Some(cluster_section(endpoints));
        self
    }

    pub fn to_json(&self) -> Value {
        let plugins: Vec<Value> = self
            .plugins
            .iter()
            .map(|(id, ty, socket)| json!({"id": id, "type": ty, "socket": socket}))
            .collect();
        let mut config = json!({
            "state_dir": self.state_dir,
            "api_socket": self.api_socket,
            "mount_root": self.mount_root,
            "plugins": plugins,
            "node_name": self.node_name,
            "csi_call_timeout": self.csi_call_timeout,
            "plugin_wait_timeout": self.plugin_wait_timeout,
            "probe_interval": self.probe_interval,
            "release_retry_deadline": self.release_retry_deadline,
            "claim_retry_deadline": self.claim_retry_deadline,
        });
        if let Some(d) = &self.mount_retry_deadline {
            config["mount_retry_deadline"] = json!(d);
        }
        if let Some(c) = &self.cluster {
            config["cluster"] = c.clone();
        }
        for (k, v) in &self.extra {
            config[k.as_str()] = v.clone();
        }
        config
    }

    /// Writes the config to `path` (parents created).
    pub fn write(&self, path: &Path) {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create the config directory");
        }
        let text = serde_json::to_vec_pretty(&self.to_json()).expect("encode config");
        fs::write(path, text).expect("write config");
    }
}

/// A `cluster` section for `endpoints`: the default prefix (`/claimd`),
/// the default lease TTL, and a 2 s call deadline so that a silent etcd
/// shows quickly. Change fields of the returned value as a test needs.
pub fn cluster_section(endpoints: &[String]) -> Value {
    json!({
        "endpoints": endpoints,
        "prefix": "/claimd",
        "lease_ttl": "15s",
        "call_timeout": "2s",
    })
}

// ---- CLI -------------------------------------------------------------------

/// What a client command did.
#[derive(Clone, Debug)]
pub struct CliOutput {
    pub args: Vec<String>,
    /// The exit code (-1 if killed by a signal).
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    /// Panics with the whole output unless the exit code is `code`.
    pub fn expect_code(self, code: i32) -> CliOutput {
        assert_eq!(
            self.code,
            code,
            "`claimd {}` exited with {} (wanted {code})\nstdout:\n{}\nstderr:\n{}",
            self.args.join(" "),
            self.code,
            self.stdout,
            self.stderr
        );
        self
    }

    pub fn ok(self) -> CliOutput {
        self.expect_code(EXIT_OK)
    }

    /// stdout as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "`claimd {}` stdout is not JSON ({e}):\n{}",
                self.args.join(" "),
                self.stdout
            )
        })
    }
}

/// Runs `claimd ARGS` (no `--socket` added), with `stdin` fed in, and
/// waits up to `timeout`; a command still running then is killed and the
/// test fails.
pub fn run_claimd(
    args: &[&str],
    stdin: Option<&[u8]>,
    envs: &[(&str, &str)],
    timeout: Duration,
) -> CliOutput {
    let mut cmd = Command::new(CLAIMD);
    cmd.args(args)
        .env_remove("CLAIMD_SOCKET")
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start claimd");
    if let Some(bytes) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(bytes).expect("write claimd's stdin");
    }
    let pid = child.id();
    let (tx, rx) = mpsc::channel::<io::Result<Output>>();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(timeout) {
        Ok(out) => out.expect("wait for claimd"),
        Err(_) => {
            send_signal(pid, libc::SIGKILL);
            let out = rx.recv().ok().and_then(Result::ok);
            panic!(
                "`claimd {}` did not finish within {timeout:?}; killed. stdout:\n{}\nstderr:\n{}",
                args.join(" "),
                out.as_ref()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default(),
                out.as_ref()
                    .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                    .unwrap_or_default(),
            );
        }
    };
    CliOutput {
        args: args.iter().map(|a| a.to_string()).collect(),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `claimd ARGS --socket SOCKET`.
pub fn cli_at(socket: &Path, args: &[&str]) -> CliOutput {
    let socket = socket.to_str().expect("socket path is UTF-8");
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--socket", socket]);
    run_claimd(&all, None, &[], CLI_TIMEOUT)
}

pub fn send_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: plain kill(2) on a child we started.
    unsafe {
        libc::kill(pid, sig);
    }
}

// ---- The agent ---------------------------------------------------------------

/// A running (or stopped) `claimd agent` process, killed on drop.
pub struct Agent {
    pub config: AgentConfig,
    pub config_path: PathBuf,
    /// The agent's stderr, appended over restarts.
    pub log_path: PathBuf,
    pub dev: bool,
    /// Extra environment of the agent process.
    pub envs: Vec<(String, String)>,
    /// A command the agent runs under (`unshare ...`); empty: none.
    pub wrapper: Vec<String>,
    process: ChildProcess,
}

impl Agent {
    /// Writes the config into `<dir>/agent/config.json` and starts the
    /// agent; waits until its API socket accepts connections.
    pub fn start(dir: &Path, config: AgentConfig) -> Agent {
        Self::start_with(dir, "agent", config, false, &[])
    }

    /// As `start`, with the config and log in `<dir>/<name>/`, `--dev` if
    /// asked, and extra environment.
    pub fn start_with(
        dir: &Path,
        name: &str,
        config: AgentConfig,
        dev: bool,
        envs: &[(&str, &str)],
    ) -> Agent {
        let mut agent = Self::prepare(dir, name, config, dev, envs);
        agent.spawn();
        agent.wait_listening();
        agent
    }

    /// Writes the config to `<dir>/<name>/config.json`; starts nothing.
    pub fn prepare(
        dir: &Path,
        name: &str,
        config: AgentConfig,
        dev: bool,
        envs: &[(&str, &str)],
    ) -> Agent {
        let config_path = dir.join(name).join("config.json");
        config.write(&config_path);
        Agent {
            config,
            config_path,
            log_path: dir.join(name).join("stderr.log"),
            dev,
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            wrapper: Vec::new(),
            process: ChildProcess::new("the agent"),
        }
    }

    /// Starts the process (without waiting for the socket).
    pub fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("open the agent's log");
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(CLAIMD);
                c
            }
            None => Command::new(CLAIMD),
        };
        cmd.arg("agent").arg("--config").arg(&self.config_path);
        if self.dev {
            cmd.arg("--dev");
        }
        cmd.env_remove("CLAIMD_SOCKET")
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        self.process.spawn(&mut cmd);
    }

    /// Waits until the API socket accepts a connection; panics with the log
    /// if the agent exits first.
    pub fn wait_listening(&mut self) {
        let log_path = &self.log_path;
        self.process
            .wait_listening(&self.config.api_socket, AGENT_START_TIMEOUT, || {
                read_log(log_path)
            });
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Waits for the agent to exit on its own.
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        self.process.wait_exit(deadline)
    }

    /// Sends `sig` and waits up to `deadline` for the exit; returns the
    /// status and the time from the signal to the exit.
    pub fn signal_and_wait(
        &mut self,
        sig: libc::c_int,
        deadline: Duration,
    ) -> (ExitStatus, Duration) {
        let pid = self.pid().expect("agent running");
        let start = Instant::now();
        send_signal(pid, sig);
        let status = self.wait_exit(deadline);
        (status, start.elapsed())
    }

    /// SIGTERM, and the time it took to exit (bounded by `deadline`).
    pub fn terminate(&mut self, deadline: Duration) -> (ExitStatus, Duration) {
        self.signal_and_wait(libc::SIGTERM, deadline)
    }

    /// SIGKILL, like a crash, once the closing state writes of what the
    /// agent answered are on disk (they follow within milliseconds), so
    /// the state left is the one the test's operations led to.
    pub fn kill(&mut self) {
        self.wait_settled();
        self.kill_now();
    }

    /// SIGKILL at once, whatever still waits for its write.
    pub fn kill_now(&mut self) {
        self.process.kill();
    }

    /// Waits until no closing state write of the running agent waits
    /// (`claimd_state_undurable_changes` is 0). An agent that is not
    /// running, or is stopped (every thread in state T), writes nothing
    /// more: no wait.
    pub fn wait_settled(&self) {
        let Some(pid) = self.pid() else {
            return;
        };
        let still_running = || {
            thread_states(pid)
                .map(|t| {
                    !t.is_empty() && t.iter().any(|(_, s)| !matches!(s, 'T' | 't' | 'Z' | 'X'))
                })
                .unwrap_or(false)
        };
        wait_until(
            Duration::from_secs(20),
            "the agent's closing state writes to reach the disk",
            || {
                if !still_running() {
                    return true;
                }
                let out = self.cli(&["metrics"]);
                if out.code != 0 {
                    // Not answering: settled once it no longer runs.
                    return !still_running();
                }
                out.stdout
                    .lines()
                    .any(|l| l == "claimd_state_undurable_changes 0")
            },
        );
    }

    /// Starts the agent again with the same config; waits for its socket.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        self.wait_listening();
    }

    /// A client command against this agent's socket.
    pub fn cli(&self, args: &[&str]) -> CliOutput {
        cli_at(&self.config.api_socket, args)
    }

    /// `volume register -` with `volumes` on stdin; must succeed.
    pub fn register(&self, volumes: &Value) -> CliOutput {
        let socket = self.config.api_socket.to_str().expect("UTF-8 socket path");
        let text = serde_json::to_vec(volumes).expect("encode volumes");
        run_claimd(
            &["volume", "register", "-", "--socket", socket],
            Some(&text),
            &[],
            CLI_TIMEOUT,
        )
        .ok()
    }

    /// The agent's stderr so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// `<state_dir>/state.json`.
    pub fn state_path(&self) -> PathBuf {
        self.config.state_dir.join("state.json")
    }

    /// `<state_dir>/state.journal`.
    pub fn journal_path(&self) -> PathBuf {
        self.config.state_dir.join("state.journal")
    }

    /// The bytes of the snapshot followed by those of the journal: what
    /// "the state files did not change" compares.
    pub fn state_bytes(&self) -> Vec<u8> {
        self.wait_settled();
        let mut b = fs::read(self.state_path()).expect("read the state file");
        b.extend(fs::read(self.journal_path()).expect("read the state journal"));
        b
    }

    /// The state as the agent would read it back: the snapshot with the
    /// journal replayed.
    pub fn state(&self) -> Value {
        self.wait_settled();
        state_of_dir(&self.config.state_dir)
    }

    /// The allocation records of the state file.
    pub fn state_allocs(&self) -> serde_json::Map<String, Value> {
        self.state()["allocs"]
            .as_object()
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill_now();
        if thread::panicking() {
            eprintln!(
                "---- agent log ({}) ----\n{}",
                self.log_path.display(),
                self.log()
            );
        }
    }
}

// ---- Volumes -------------------------------------------------------------------

/// A file-system volume of the test plugin.
pub fn volume_json(id: &str, external_id: &str, access_modes: &[&str]) -> Value {
    json!({
        "id": id,
        "plugin_id": PLUGIN_ID,
        "external_id": external_id,
        "access_modes": access_modes,
        "attachment_modes": ["file-system"],
    })
}

/// Runs `f(i)` for every `i` in `0..n` on `threads` worker threads; the
/// results come back in index order.
pub fn parallel<R: Send>(n: usize, threads: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..n).map(|_| None).collect());
    thread::scope(|s| {
        for _ in 0..threads.min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                results.lock().expect("results lock")[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .expect("results lock")
        .into_iter()
        .map(|r| r.expect("every index ran"))
        .collect()
}

/// Whether a directory is missing or has no entries.
pub fn dir_is_empty(path: &Path) -> bool {
    match fs::read_dir(path) {
        Ok(mut it) => it.next().is_none(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => true,
        Err(e) => panic!("read {}: {e}", path.display()),
    }
}

/// The state of a state directory (snapshot plus journal), as JSON.
pub fn state_of_dir(dir: &std::path::Path) -> Value {
    let loaded = claimd::state::load_dir(dir)
        .expect("the state reads back")
        .expect("there is a state");
    serde_json::to_value(&loaded.state).expect("the state serializes")
}
