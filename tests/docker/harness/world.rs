//! The world of one Docker plugin test: the agent serving a driver name of
//! its own beside the test plugin, and helpers to speak the protocol.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use super::{ensure_engines, post};
use crate::agent_support::*;
use crate::common::*;

/// How long the engine's cleanup of a stopped container (its Unmount, and
/// the release behind it) may take.
pub const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Field order is drop order: the agent (which the engines' cleanup
/// still talks to, so they are dropped before the world), then the
/// plugin, then the directory.
pub struct World {
    pub agent: Agent,
    pub plugin: TestPlugin,
    pub driver: String,
    pub dir: TestDir,
}

impl World {
    /// The agent serving driver `claimd-<name>-<pid>`, and the test
    /// plugin with volume `ext-db` (and `ext-other`).
    pub fn new(name: &str) -> World {
        World::with(name, json!({}))
    }

    /// The same, with more fields in the agent's `docker` section.
    pub fn with(name: &str, docker: Value) -> World {
        World::wrapped(name, docker, &[])
    }

    /// The same, the agent run under `wrapper` (a command and its
    /// arguments before the agent's own).
    pub fn wrapped(name: &str, docker: Value, wrapper: &[&str]) -> World {
        ensure_engines();
        let dir = TestDir::new();
        let plugin = TestPlugin::builder(dir.path())
            .volumes(&["ext-db", "ext-other"])
            .start();
        let driver = format!("claimd-{name}-{}", std::process::id());
        let mut config = AgentConfig::new(dir.path(), Some(&plugin.socket));
        let mut section = docker;
        section["driver"] = json!(driver);
        config.extra.push(("docker".into(), section));
        let mut agent = Agent::prepare(dir.path(), "agent", config, false, &[]);
        agent.wrapper = wrapper.iter().map(|a| a.to_string()).collect();
        agent.spawn();
        agent.wait_listening();
        let w = World {
            agent,
            plugin,
            driver,
            dir,
        };
        wait_until(Duration::from_secs(20), "the plugin to be ready", || {
            let out = w.agent.cli(&["plugin", "list", "--json"]);
            out.code == 0 && out.json()["plugins"][0]["health"] == "ready"
        });
        w
    }

    pub fn socket(&self) -> PathBuf {
        PathBuf::from(format!("/run/docker/plugins/{}.sock", self.driver))
    }

    pub fn calls(&self) -> Vec<String> {
        volume_methods(&self.plugin.call_log())
    }

    /// Waits until the plugin has had `n` volume calls.
    pub fn wait_calls(&self, n: usize, what: &str) -> Vec<String> {
        wait_until(CLEANUP_TIMEOUT, what, || self.calls().len() >= n);
        self.calls()
    }

    pub fn claims(&self) -> Vec<Value> {
        let out = self.agent.cli(&["claim", "list", "--json"]).ok().json();
        out["claims"].as_array().cloned().unwrap_or_default()
    }

    pub fn volumes(&self) -> Vec<Value> {
        let out = self.agent.cli(&["volume", "list", "--json"]).ok().json();
        out["volumes"].as_array().cloned().unwrap_or_default()
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.plugin.volume_dir("ext-db").join(name)
    }

    /// `volume create --driver DRIVER --opt ...` for volume `db` on
    /// `ext-db`, with more options.
    pub fn create_args<'a>(&'a self, more: &[&'a str], name: &'a str) -> Vec<&'a str> {
        let mut args = vec!["volume", "create", "--driver", self.driver.as_str()];
        args.extend(["--opt", "plugin_id=testplug", "--opt", "external_id=ext-db"]);
        args.extend(more);
        args.push(name);
        args
    }
}

impl Drop for World {
    /// The agent is killed after this: its socket would stay behind in
    /// Docker's plugin directory.
    fn drop(&mut self) {
        self.agent.kill();
        let _ = fs::remove_file(self.socket());
    }
}

/// One container's allocation, up and down.
pub const ONE_CONTAINER: [&str; 6] = [CP, NS, NP, NUP, NUS, CUP];

/// One request of the protocol that must succeed: its answer.
pub fn plugin_ok(socket: &std::path::Path, path: &str, body: Value) -> Value {
    let (code, answer) = post(socket, path, &body);
    assert_eq!(code, 200, "{path} {body}: {answer}");
    assert!(answer.get("Err").is_none(), "{path}: {answer}");
    answer
}

/// The target path of an engine allocation's one volume, from the state.
pub fn target_of(w: &World, alloc: &str) -> PathBuf {
    let allocs = w.agent.state_allocs();
    let path = allocs[alloc]["volumes"]["volume"]["target_path"]
        .as_str()
        .unwrap_or_else(|| panic!("allocation {alloc} recorded: {allocs:?}"));
    PathBuf::from(path)
}

/// Removes the agent's plugin socket from Docker's directory on drop.
pub struct SocketFile(pub PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}
