//! Cluster mode end to end: several real `claimd` agents (one per node,
//! each with its own state directory, mount root, API socket and test
//! plugin) sharing their claims through a real, throwaway etcd member
//! (tests/support/etcd.rs), with real mounts. The plugins here run without a
//! controller (attachments through controller hosts are in
//! tests/cluster/controller.rs); every node registers the volumes it uses
//! (registering again replaces the shared registration).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::*;
use serde_json::{json, Value};

/// The default key prefix (`cluster_section`).
const PREFIX: &str = "/claimd";

/// Longest a test waits for a mount that is not held back by anything.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest a test waits for something the agent does within a few claim
/// retries (the claim backoff starts at 1 s and doubles).
const RETRY_TIMEOUT: Duration = Duration::from_secs(90);

/// Longest a test waits for an agent to show a state it reaches at once.
const SHOW_TIMEOUT: Duration = Duration::from_secs(20);

// ---- A node and a cluster ------------------------------------------------------

/// One node: an agent and its own test plugin under `<dir>/<name>/`. Field
/// order is drop order: the agent dies first.
struct Node {
    agent: Agent,
    plugin: TestPlugin,
    name: String,
}

impl Node {
    /// The plugin (no controller, node ID `ext-<name>`) and an agent in
    /// cluster mode on `endpoints` as node `name`.
    fn start(
        dir: &Path,
        name: &str,
        endpoints: &[String],
        tweak: &dyn Fn(&mut AgentConfig),
    ) -> Node {
        let (plugin, agent) = Self::prepare(dir, name, endpoints, tweak);
        let mut agent = agent;
        agent.spawn();
        agent.wait_listening();
        Node {
            agent,
            plugin,
            name: name.to_string(),
        }
    }

    /// The plugin, started, and the agent, configured but not started.
    fn prepare(
        dir: &Path,
        name: &str,
        endpoints: &[String],
        tweak: &dyn Fn(&mut AgentConfig),
    ) -> (TestPlugin, Agent) {
        let ndir = dir.join(name);
        let plugin = TestPlugin::builder(&ndir)
            .no_controller()
            .node_id(&format!("ext-{name}"))
            .start();
        let mut config =
            AgentConfig::new(&ndir, Some(&plugin.socket)).cluster_node(name, endpoints);
        tweak(&mut config);
        let agent = Agent::prepare(&ndir, "agent", config, false, &[]);
        (plugin, agent)
    }

    /// Creates the volume in this node's plugin storage and registers it
    /// with this node's agent.
    fn add_volume(&self, volume: &Value) {
        self.plugin
            .add_volume(volume["external_id"].as_str().expect("external_id"));
        self.agent.register(volume);
    }

    fn mount_root(&self) -> PathBuf {
        self.agent.config.mount_root.clone()
    }

    /// `alloc mount ALLOC --volume SPEC --json [more args]`, whatever it
    /// answers.
    fn mount(&self, alloc: &str, spec: &str, more: &[&str]) -> CliOutput {
        let mut args = vec!["alloc", "mount", alloc, "--volume", spec, "--json"];
        args.extend(more);
        self.agent.cli(&args)
    }

    /// A mount that must succeed; the host path.
    fn mount_ok(&self, alloc: &str, spec: &str) -> PathBuf {
        host_path(&self.mount(alloc, spec, &[]).ok())
    }

    /// `alloc release ALLOC --wait 30s`; must finish with everything
    /// released.
    fn release_ok(&self, alloc: &str) {
        self.agent
            .cli(&["alloc", "release", alloc, "--wait", "30s"])
            .ok();
    }

    /// The first volume of `alloc status ALLOC --json`; null while the
    /// agent does not know the allocation (a mount not recorded yet).
    fn volume_status(&self, alloc: &str) -> Value {
        let out = self.agent.cli(&["alloc", "status", alloc, "--json"]);
        if out.code == EXIT_FAILED && out.stderr.contains("is not known to this agent") {
            return Value::Null;
        }
        out.ok().json()["allocs"][0]["volumes"][0].clone()
    }

    /// `claim list --volume VOLUME --json`: the claims, in key order.
    fn claims(&self, volume: &str) -> Vec<Value> {
        let out = self
            .agent
            .cli(&["claim", "list", "--volume", volume, "--json"])
            .ok()
            .json();
        out["claims"].as_array().cloned().unwrap_or_default()
    }

    /// The targets mounted under this node's `per-alloc` directory.
    fn targets(&self) -> Vec<MountEntry> {
        mounts_under(&self.mount_root().join("per-alloc"))
    }

    /// The volume calls of this node's plugin so far.
    fn volume_calls(&self) -> Vec<String> {
        volume_methods(&self.plugin.call_log())
    }
}

/// A test's cluster. Field order is drop order: agents and plugins die
/// first, then etcd, then the directory is unmounted and removed.
struct Cluster {
    nodes: Vec<Node>,
    etcd: Etcd,
    dir: TestDir,
}

impl Cluster {
    /// etcd and one node per name, every agent talking to etcd directly.
    fn start(names: &[&str], tweak: &dyn Fn(&mut AgentConfig)) -> Cluster {
        let dir = TestDir::new();
        let etcd = Etcd::start();
        let endpoints = [etcd.endpoint()];
        let nodes = names
            .iter()
            .map(|n| Node::start(dir.path(), n, &endpoints, tweak))
            .collect();
        Cluster { nodes, etcd, dir }
    }

    /// Registers the volume on every node.
    fn add_volume(&self, volume: &Value) {
        for n in &self.nodes {
            n.add_volume(volume);
        }
    }
}

/// The host path of the first volume of `alloc mount --json`.
fn host_path(out: &CliOutput) -> PathBuf {
    PathBuf::from(
        out.json()["volumes"][0]["host_path"]
            .as_str()
            .expect("host_path is a string"),
    )
}

/// The claims of `volume` (of every volume when empty) as stored in etcd:
/// (key, value) pairs.
fn stored_claims(etcd: &Etcd, volume: &str) -> Vec<(String, Vec<u8>)> {
    let prefix = match volume {
        "" => format!("{PREFIX}/claims/"),
        v => format!("{PREFIX}/claims/{v}/"),
    };
    etcd.client()
        .range_prefix(prefix)
        .expect("read the claims from etcd")
        .kvs
        .iter()
        .map(|kv| (kv.key_str().into_owned(), kv.value.clone()))
        .collect()
}

/// The allocation IDs of a claim list.
fn holders(claims: &[Value]) -> Vec<String> {
    claims
        .iter()
        .map(|c| c["alloc_id"].as_str().expect("alloc_id").to_string())
        .collect()
}

/// What a waiting take says about its holder.
fn held_by(alloc: &str, node: &str) -> String {
    format!("by allocation {alloc} on node {node}")
}

// ---- 8. Restarts in the middle of cluster waits -----------------------------------

/// Whether the agent records no allocation at all.
fn no_allocs(n: &Node) -> bool {
    n.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
        .as_array()
        .is_some_and(|l| l.is_empty())
}

// ---- 9. SIGKILL at the failpoints around the etcd round trip ---------------------

/// Starts the node's agent again with `CLAIMD_FAILPOINT=point` (none when
/// empty), after killing it.
fn restart_with_failpoint(n: &mut Node, point: &str) {
    n.agent.kill();
    n.agent.envs.clear();
    if !point.is_empty() {
        n.agent
            .envs
            .push(("CLAIMD_FAILPOINT".to_string(), point.to_string()));
    }
    n.agent.spawn();
    n.agent.wait_listening();
    // The plugin ready before the next mount: its claim then goes with its
    // first transaction (the fast path the failpoints are placed around).
    wait_until(SHOW_TIMEOUT, "the node plugin to be ready", || {
        n.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"] == "ready"
    });
}

/// Runs `f`, which makes the agent reach the failpoint `point` it was
/// started with, and waits for it to die of it.
fn die_at(n: &mut Node, point: &str, f: impl FnOnce(&Node)) {
    f(n);
    let status = n.agent.wait_exit(SHOW_TIMEOUT);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{status}"
    );
    assert!(
        n.agent
            .log()
            .contains(&format!("failpoint {point}: killing the agent")),
        "{}",
        n.agent.log()
    );
}

mod across_nodes_and_outages;
mod restarts_and_crashes;
