//! The nemesis's nodes: per node an agent (the real `claimd`), its own test
//! plugin (node-local plugin state; `<root>/volumes` is a symlink to the
//! one shared storage, as hosts on one SAN/NFS), and its own link to etcd
//! (a proxy per member). Plus a client-command runner that never panics
//! (a command against a stopped agent times out and says so).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::proxy::Link;
use crate::agent_support::*;
use crate::common::*;

pub const PREFIX: &str = "/claimd";
/// Longest the harness waits for an agent or plugin to show a state it
/// reaches at once (the machine is shared and loaded).
pub const SHOW_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest an agent may take from its start to listening (its restore
/// holds the API while a restored mount waits for its claim).
pub const RESTART_TIMEOUT: Duration = Duration::from_secs(180);

pub fn ext(node: &str) -> String {
    format!("ext-{node}")
}

/// How a run's agents are configured (chosen by the seed).
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub lease_ttl: Duration,
    pub stop_after_disconnect: Option<Duration>,
    /// The nodes whose plugins serve the controller side (for every
    /// node): none, one or two.
    pub controller_hosts: Vec<String>,
    /// `cluster.free_unfenced_claims` (with the window only).
    pub free_unfenced: bool,
    /// `cluster.epoch_plugins` and the plugins' `--epoch-key` (their
    /// newest epoch per volume kept in the shared storage).
    pub epochs: bool,
}

pub struct Node {
    pub agent: Agent,
    pub plugin: TestPlugin,
    pub link: Link,
    pub name: String,
    pub is_host: bool,
    /// The failpoint the agent runs with (`CLAIMD_FAILPOINT`), if any: an
    /// agent that dies of it did not crash on its own.
    pub armed: Option<String>,
}

impl Node {
    /// Starts the plugin, prepares the agent (not started).
    pub fn prepare(
        dir: &Path,
        shared_volumes: &Path,
        name: &str,
        all: &[&str],
        settings: &NodeSettings,
        members: &[std::net::SocketAddr],
    ) -> Node {
        let ndir = dir.join(name);
        let is_host = settings.controller_hosts.iter().any(|h| h == name);
        let mut builder = TestPlugin::builder(&ndir).node_id(&ext(name));
        if !settings.controller_hosts.is_empty() {
            // One storage system for every node's plugin, which really
            // fences on ControllerUnpublish: the agents list the plugin in
            // `fencing_plugins`.
            let storage = shared_volumes.parent().expect("storage/volumes");
            builder = builder.storage(storage).fence_on_unpublish();
        } else {
            let root = ndir.join("plugin").join("root");
            fs::create_dir_all(&root).expect("create the plugin root");
            std::os::unix::fs::symlink(shared_volumes, root.join("volumes"))
                .expect("link the shared volumes");
            let epochs = shared_volumes
                .parent()
                .expect("storage/volumes")
                .join("epochs");
            fs::create_dir_all(&epochs).expect("create the shared epochs");
            std::os::unix::fs::symlink(&epochs, root.join("epochs")).expect("link the epochs");
        }
        if settings.epochs {
            builder = builder.args(&["--epoch-key", claimd::volumes::requests::EPOCH_CONTEXT_KEY]);
        }
        let plugin = if is_host {
            let others: Vec<String> = all.iter().filter(|n| **n != name).map(|n| ext(n)).collect();
            let others: Vec<&str> = others.iter().map(String::as_str).collect();
            builder.known_nodes(&others).start()
        } else {
            builder.no_controller().start()
        };
        let link = Link::start(&rotate(members, all.iter().position(|n| *n == name)));
        let mut config =
            AgentConfig::new(&ndir, Some(&plugin.socket)).cluster_node(name, &link.endpoints());
        config.claim_retry_deadline = "5m".into();
        config.csi_call_timeout = "3s".into();
        config.probe_interval = "1s".into();
        let cluster = config.cluster.as_mut().expect("a cluster section");
        cluster["lease_ttl"] = json!(format!("{}ms", settings.lease_ttl.as_millis()));
        cluster["call_timeout"] = json!("1s");
        if let Some(d) = settings.stop_after_disconnect {
            cluster["stop_after_disconnect"] = json!(format!("{}ms", d.as_millis()));
            if settings.free_unfenced {
                cluster["free_unfenced_claims"] = json!(true);
            }
        }
        if !settings.controller_hosts.is_empty() {
            cluster["fencing_plugins"] = json!([PLUGIN_ID]);
        }
        if settings.epochs {
            cluster["epoch_plugins"] = json!([PLUGIN_ID]);
        }
        let agent = Agent::prepare(&ndir, "agent", config, false, &[]);
        Node {
            agent,
            plugin,
            link,
            name: name.to_string(),
            is_host,
            armed: None,
        }
    }

    /// Starts the agent; waits for its socket and its plugin to be ready.
    pub fn start_agent(&mut self) {
        self.agent.spawn();
        self.agent.wait_listening();
        wait_until(SHOW_TIMEOUT, "the node plugin to be ready", || {
            let out = cli(self.socket(), &["plugin", "list", "--json"], CLI_DEADLINE);
            out.code == Some(0)
                && serde_json::from_str::<Value>(&out.stdout)
                    .is_ok_and(|v| v["plugins"][0]["health"] == "ready")
        });
    }

    pub fn socket(&self) -> &Path {
        &self.agent.config.api_socket
    }

    pub fn mount_root(&self) -> PathBuf {
        self.agent.config.mount_root.clone()
    }

    pub fn pid(&self) -> Option<u32> {
        self.agent.pid()
    }

    /// Whether the agent process exited (or died) without the harness
    /// killing it: gone, or a zombie nobody reaped yet.
    pub fn agent_exited(&self) -> bool {
        let Some(pid) = self.agent.pid() else {
            return false;
        };
        match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|s| s == "Z" || s == "X"),
        }
    }

    /// Restarts an agent that exited on its own; its log's tail, to report.
    pub fn revive(&mut self) -> String {
        let log = self.agent.log();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        self.agent.kill();
        self.agent.spawn();
        let _ = self.wait_listening();
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Starts the (killed) agent again; how long it took to listen.
    pub fn start_again(&mut self) -> Result<Duration, String> {
        self.agent.spawn();
        self.wait_listening()
    }

    /// Where a started agent is. The process is looked at before its
    /// socket is tried: one that dies between the two looks is `Starting`
    /// now and `Exited` on the next look, never reported as having exited
    /// before it listened while it was still alive at the first look.
    pub fn start_state(&self) -> Start {
        let exited = self.agent_exited();
        if std::os::unix::net::UnixStream::connect(self.socket()).is_ok() {
            Start::Listening
        } else if exited {
            Start::Exited
        } else {
            Start::Starting
        }
    }

    /// The report of an agent that exited before it listened, with its pid.
    pub fn exited_before_listening(&self) -> String {
        let pid = self
            .pid()
            .map_or("no pid".to_string(), |p| format!("pid {p}"));
        format!(
            "the agent of node {} ({pid}) exited before listening",
            self.name
        )
    }

    /// Waits until the agent's API socket accepts a connection (a restore
    /// holds the API: this can take long), bounded by `RESTART_TIMEOUT`.
    pub fn wait_listening(&self) -> Result<Duration, String> {
        let start = Instant::now();
        loop {
            match self.start_state() {
                Start::Listening => return Ok(start.elapsed()),
                Start::Exited => return Err(self.exited_before_listening()),
                Start::Starting => {}
            }
            if start.elapsed() > RESTART_TIMEOUT {
                return Err(format!(
                    "the agent of node {} did not listen within {RESTART_TIMEOUT:?} of its start",
                    self.name
                ));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Where a started agent is (`Node::start_state`).
pub enum Start {
    Listening,
    Exited,
    Starting,
}

/// The members in the order node `i` lists them: its own member first.
fn rotate<T: Clone>(items: &[T], i: Option<usize>) -> Vec<T> {
    let i = i.unwrap_or(0) % items.len().max(1);
    items[i..].iter().chain(&items[..i]).cloned().collect()
}

/// A file-system volume of the test plugin.
pub fn volume(id: &str, access: &str) -> Value {
    volume_json(id, &format!("ext-{id}"), &[access])
}

/// How long a workload command may run before the runner kills it.
pub const CLI_DEADLINE: Duration = Duration::from_secs(45);

/// What a client command did; `code` None: killed at its deadline.
#[derive(Clone, Debug)]
pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(self.stdout.trim()).ok()
    }

    /// One line for the operation log.
    pub fn brief(&self) -> String {
        let err = self.stderr.lines().last().unwrap_or("").trim();
        match self.code {
            Some(0) => "ok".to_string(),
            Some(c) => format!("exit {c}: {err}"),
            None => format!("killed at the runner's deadline: {err}"),
        }
    }
}

/// `claimd ARGS --socket SOCKET`, killed after `deadline`.
pub fn cli(socket: &Path, args: &[&str], deadline: Duration) -> Out {
    let mut child = Command::new(CLAIMD)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .env_remove("CLAIMD_SOCKET")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start claimd");
    let (mut so, mut se) = (
        child.stdout.take().expect("piped"),
        child.stderr.take().expect("piped"),
    );
    let (tx, rx) = mpsc::channel();
    let tx2 = tx.clone();
    thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        let _ = tx.send((0, s));
    });
    thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        let _ = tx2.send((1, s));
    });
    let start = Instant::now();
    let code = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break st.code();
        }
        if start.elapsed() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(5));
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    for _ in 0..2 {
        if let Ok((k, s)) = rx.recv_timeout(Duration::from_secs(5)) {
            if k == 0 {
                stdout = s;
            } else {
                stderr = s;
            }
        }
    }
    Out {
        code,
        stdout,
        stderr,
    }
}

/// Whether every thread of `pid` is stopped (`T` in /proc/PID/task/*/stat).
pub fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(stat) = fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // "pid (comm) S ...": the state follows the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if !matches!(state, Some("T") | Some("t")) {
            return false;
        }
        any = true;
    }
    any
}
