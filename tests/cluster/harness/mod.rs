//! The cluster area's harness: nodes that host a controller
//! plugin and nodes whose plugins have none, each an agent with its own
//! test plugin, optionally behind its own TCP proxy to etcd (a link a test
//! can cut), and readers for what etcd, the call logs and the plugins'
//! controller state hold.
//!
//! Declared in tests/cluster/main.rs as `harness`, next to the shared
//! `common`, `agent_support` and `etcd_support` (tests/support/);
//! `etcd_faults` holds the faults between an agent and etcd.
#![allow(dead_code)]

pub mod etcd_faults;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::*;

/// The default key prefix (`cluster_section`).
pub const PREFIX: &str = "/claimd";
/// Longest a test waits for a mount that is not held back by anything.
pub const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a test waits for something the agents do within a few claim
/// retries, lease expiries and attach requests (the machine is shared).
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest a test waits for an agent to show a state it reaches at once.
pub const SHOW_TIMEOUT: Duration = Duration::from_secs(30);
/// The lease TTL of every agent in these tests: short, so that a dead or
/// cut-off node shows within seconds.
pub const LEASE_TTL: &str = "3s";
pub const LEASE_TTL_MS: u64 = 3000;
/// `stop_after_disconnect` where a test sets it.
pub const STOP_AFTER: &str = "3s";
pub const STOP_AFTER_MS: u64 = 3000;

/// The external node ID (NodeGetInfo's node_id) of node `name`'s plugin.
pub fn ext(name: &str) -> String {
    format!("ext-{name}")
}

/// Milliseconds since the epoch, the call log's clock.
pub fn now_ms() -> u64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970");
    u64::try_from(d.as_millis()).expect("milliseconds fit u64")
}

/// Polls `check` for `period`; panics with its complaint the first time
/// it has one. What a test uses to show that something does NOT happen
/// for a while (not a wait for something).
pub fn hold_for(period: Duration, what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let start = Instant::now();
    while start.elapsed() < period {
        if let Err(e) = check() {
            panic!("{what} stopped holding after {:?}: {e}", start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `Ok` when `ok`, else the complaint `what()`.
pub fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

// ---- What a node is ------------------------------------------------------------

/// How to make one node.
pub struct NodeSpec {
    pub name: String,
    /// Some: the plugin serves the controller side, accepting these
    /// external node IDs besides its own; None: `--no-controller`.
    pub controller_for: Option<Vec<String>>,
    /// Talks to etcd through its own proxy.
    pub proxied: bool,
    /// Fields set in the agent's `cluster` section (besides `lease_ttl`).
    pub cluster: Vec<(String, Value)>,
    /// The agent's `csi_call_timeout`, when not the harness's default.
    pub csi_call_timeout: Option<String>,
    /// The agent's `plugin_wait_timeout`, when not the harness's default.
    pub plugin_wait_timeout: Option<String>,
    /// More flags for the node's test plugin.
    pub plugin_args: Vec<String>,
    /// Without a controller side: NodeStage requires the publish context
    /// of a ControllerPublish (`--require-contexts`, block storage);
    /// false for a node-only plugin (NFS-like: nothing to attach).
    pub requires_contexts: bool,
    /// The plugin shares the cluster's storage (`<dir>/storage`) and
    /// fences on ControllerUnpublish (`--fence-on-unpublish`).
    pub fenced_storage: bool,
}

/// A node whose plugin serves the controller side for itself and for
/// the nodes named in `others`.
pub fn host(name: &str, others: &[&str]) -> NodeSpec {
    NodeSpec {
        name: name.to_string(),
        controller_for: Some(others.iter().map(|n| ext(n)).collect()),
        proxied: false,
        cluster: Vec::new(),
        csi_call_timeout: None,
        plugin_wait_timeout: None,
        plugin_args: Vec::new(),
        requires_contexts: true,
        fenced_storage: false,
    }
}

/// A node whose plugin has no controller side (`--no-controller`,
/// `--require-contexts`).
pub fn node_only(name: &str) -> NodeSpec {
    NodeSpec {
        name: name.to_string(),
        controller_for: None,
        proxied: false,
        cluster: Vec::new(),
        csi_call_timeout: None,
        plugin_wait_timeout: None,
        plugin_args: Vec::new(),
        requires_contexts: true,
        fenced_storage: false,
    }
}

/// A node whose plugin has no controller side and needs none (`--no-controller`
/// only): its volumes are node-only (NFS-like), nothing can fence them.
pub fn nfs_node(name: &str) -> NodeSpec {
    NodeSpec {
        requires_contexts: false,
        ..node_only(name)
    }
}

impl NodeSpec {
    /// The plugin shares the cluster's storage and fences on
    /// ControllerUnpublish: a detach really cuts the node off.
    pub fn fenced_storage(mut self) -> NodeSpec {
        self.fenced_storage = true;
        self
    }

    /// Sets a field of the agent's `cluster` section.
    pub fn cluster_field(mut self, key: &str, value: Value) -> NodeSpec {
        self.cluster.push((key.to_string(), value));
        self
    }

    pub fn proxied(mut self) -> NodeSpec {
        self.proxied = true;
        self
    }

    pub fn plugin_args(mut self, args: &[&str]) -> NodeSpec {
        self.plugin_args = args.iter().map(|a| a.to_string()).collect();
        self
    }

    pub fn csi_call_timeout(mut self, d: &str) -> NodeSpec {
        self.csi_call_timeout = Some(d.to_string());
        self
    }

    pub fn plugin_wait_timeout(mut self, d: &str) -> NodeSpec {
        self.plugin_wait_timeout = Some(d.to_string());
        self
    }

    pub fn stop_after_disconnect(mut self, d: &str) -> NodeSpec {
        self.cluster
            .push(("stop_after_disconnect".to_string(), json!(d)));
        self
    }

    /// Marks the test plugin as fencing (`cluster.fencing_plugins`): this
    /// agent's reaper detaches and frees the volumes of a gone node.
    pub fn fencing(mut self) -> NodeSpec {
        self.cluster
            .push(("fencing_plugins".to_string(), json!([PLUGIN_ID])));
        self
    }
}

// ---- A node ----------------------------------------------------------------------

/// One node: an agent, its own test plugin (in `<dir>/<name>/plugin`) and
/// maybe its proxy to etcd. Field order is drop order: the agent dies
/// first.
pub struct Node {
    pub agent: Agent,
    pub plugin: TestPlugin,
    pub proxy: Option<Proxy>,
    pub name: String,
    /// Whether its plugin serves the controller side.
    pub is_host: bool,
}

impl Node {
    /// The plugin, started; the agent, configured (not started).
    pub fn prepare(dir: &Path, spec: NodeSpec, etcd: &Etcd) -> Node {
        let ndir = dir.join(&spec.name);
        let extra: Vec<&str> = spec.plugin_args.iter().map(String::as_str).collect();
        let mut builder = TestPlugin::builder(&ndir)
            .node_id(&ext(&spec.name))
            .args(&extra);
        if spec.fenced_storage {
            builder = builder.storage(&dir.join("storage")).fence_on_unpublish();
        }
        let plugin = match &spec.controller_for {
            Some(others) => {
                let others: Vec<&str> = others.iter().map(String::as_str).collect();
                builder.known_nodes(&others).start()
            }
            None if spec.requires_contexts => builder.no_controller().require_contexts().start(),
            None => builder.no_controller().start(),
        };
        let proxy = spec.proxied.then(|| {
            Proxy::start(
                format!("127.0.0.1:{}", etcd.client_port())
                    .parse()
                    .expect("an address"),
            )
        });
        let endpoint = proxy.as_ref().map_or(etcd.endpoint(), Proxy::endpoint);
        let mut config =
            AgentConfig::new(&ndir, Some(&plugin.socket)).cluster_node(&spec.name, &[endpoint]);
        config.claim_retry_deadline = "5m".into();
        if let Some(d) = &spec.csi_call_timeout {
            config.csi_call_timeout = d.clone();
        }
        if let Some(d) = &spec.plugin_wait_timeout {
            config.plugin_wait_timeout = d.clone();
        }
        let cluster = config.cluster.as_mut().expect("a cluster section");
        cluster["lease_ttl"] = json!(LEASE_TTL);
        // At most half the TTL (the config refuses more).
        cluster["call_timeout"] = json!("1s");
        for (k, v) in &spec.cluster {
            cluster[k.as_str()] = v.clone();
        }
        let agent = Agent::prepare(&ndir, "agent", config, false, &[]);
        Node {
            agent,
            plugin,
            proxy,
            is_host: spec.controller_for.is_some(),
            name: spec.name,
        }
    }

    /// Starts the agent and waits for its socket and for its plugin to be
    /// ready.
    pub fn start_agent(&mut self) {
        self.agent.spawn();
        self.agent.wait_listening();
        wait_until(SHOW_TIMEOUT, "the node plugin to be ready", || {
            self.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"]
                == "ready"
        });
    }

    /// Creates the volume in this node's plugin storage and registers it
    /// with this node's agent.
    pub fn add_volume(&self, volume: &Value) {
        self.plugin
            .add_volume(volume["external_id"].as_str().expect("external_id"));
        self.agent.register(volume);
    }

    pub fn mount_root(&self) -> PathBuf {
        self.agent.config.mount_root.clone()
    }

    /// `alloc mount ALLOC --volume SPEC --json [more]`, whatever it answers.
    pub fn mount(&self, alloc: &str, spec: &str, more: &[&str]) -> CliOutput {
        let mut args = vec!["alloc", "mount", alloc, "--volume", spec, "--json"];
        args.extend(more);
        self.agent.cli(&args)
    }

    /// A mount that must succeed; the host path.
    pub fn mount_ok(&self, alloc: &str, spec: &str) -> PathBuf {
        host_path(&self.mount(alloc, spec, &[]).ok())
    }

    /// A mount that waits (for a holder): the command gives up after 3 s,
    /// the agent goes on.
    pub fn mount_waiting(&self, alloc: &str, spec: &str) {
        self.mount(alloc, spec, &["--timeout", "3s"])
            .expect_code(EXIT_FAILED);
    }

    /// `alloc release ALLOC --wait 60s`; must finish.
    pub fn release_ok(&self, alloc: &str) {
        self.agent
            .cli(&["alloc", "release", alloc, "--wait", "60s"])
            .ok();
    }

    /// The first volume of `alloc status ALLOC --json`; null while the
    /// agent does not know the allocation.
    pub fn volume_status(&self, alloc: &str) -> Value {
        let out = self.agent.cli(&["alloc", "status", alloc, "--json"]);
        if out.code == EXIT_FAILED && out.stderr.contains("is not known to this agent") {
            return Value::Null;
        }
        out.ok().json()["allocs"][0]["volumes"][0].clone()
    }

    /// Whether the agent records no allocation at all.
    pub fn no_allocs(&self) -> bool {
        self.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
            .as_array()
            .is_some_and(|l| l.is_empty())
    }

    /// `claim list --volume VOLUME --json`: the claims, in key order.
    pub fn claims(&self, volume: &str) -> Vec<Value> {
        let out = self
            .agent
            .cli(&["claim", "list", "--volume", volume, "--json"])
            .ok()
            .json();
        out["claims"].as_array().cloned().unwrap_or_default()
    }

    /// The mounts under this node's mount root (targets and stagings).
    /// Unmounts every mount of the node (targets first): mounts that
    /// vanished while the agent was down (an operator's umount, a plugin's
    /// cleanup, a reboot).
    pub fn unmount_all(&self) {
        for m in self.mounts().iter().rev() {
            let out = std::process::Command::new("umount")
                .arg(&m.mount_point)
                .output()
                .expect("run umount");
            assert!(out.status.success(), "umount {:?}: {out:?}", m.mount_point);
        }
        assert!(self.mounts().is_empty(), "{:?}", self.mounts());
    }

    pub fn mounts(&self) -> Vec<MountEntry> {
        mounts_under(&self.mount_root())
    }

    /// The targets mounted under this node's `per-alloc` directory.
    pub fn targets(&self) -> Vec<MountEntry> {
        mounts_under(&self.mount_root().join("per-alloc"))
    }

    /// The volume calls of this node's plugin (identity and probe calls
    /// left out), each a call-log line.
    pub fn volume_calls(&self) -> Vec<Value> {
        self.plugin
            .call_log()
            .calls()
            .into_iter()
            .filter(|c| {
                !IDENTITY_METHODS.contains(&c["method"].as_str().expect("method is a string"))
            })
            .collect()
    }

    /// (method, node_id or "") of every volume call, in order.
    pub fn volume_call_summary(&self) -> Vec<(String, String)> {
        self.volume_calls().iter().map(summary).collect()
    }

    /// The calls of one method.
    pub fn calls_of(&self, method: &str) -> Vec<Value> {
        self.plugin.call_log().calls_of(method)
    }

    /// The one call of `method`; panics unless there is exactly one.
    pub fn one_call(&self, method: &str) -> Value {
        let calls = self.calls_of(method);
        assert_eq!(
            calls.len(),
            1,
            "node {}: {method} calls: {calls:?}",
            self.name
        );
        calls[0].clone()
    }

    /// The (volume, external node ID) attachments in this plugin's
    /// controller state.
    pub fn attachments(&self) -> Vec<(String, String)> {
        attachments_of(&self.plugin)
    }

    pub fn cut(&self) {
        self.proxy.as_ref().expect("a proxied node").pause();
    }

    pub fn heal(&self) {
        self.proxy.as_ref().expect("a proxied node").resume();
    }
}

/// (method, node_id or "") of one call-log line.
pub fn summary(call: &Value) -> (String, String) {
    (
        call["method"].as_str().expect("method").to_string(),
        call["node_id"].as_str().unwrap_or("").to_string(),
    )
}

/// (method, node_id) pairs, for comparing with `volume_call_summary`.
pub fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(m, n)| (m.to_string(), n.to_string()))
        .collect()
}

/// A call-log line's timestamp.
pub fn ts(call: &Value) -> u64 {
    call["ts_ms"].as_u64().expect("ts_ms")
}

/// The (volume, external node ID) attachments of a plugin's
/// `controller.json` (none when the file was never written).
pub fn attachments_of(plugin: &TestPlugin) -> Vec<(String, String)> {
    let Some(state) = plugin.controller_state() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if let Some(vols) = state["attachments"].as_object() {
        for (vol, nodes) in vols {
            for node in nodes.as_object().expect("nodes of an attachment").keys() {
                out.push((vol.clone(), node.clone()));
            }
        }
    }
    out
}

/// The host path of the first volume of `alloc mount --json`.
pub fn host_path(out: &CliOutput) -> PathBuf {
    PathBuf::from(
        out.json()["volumes"][0]["host_path"]
            .as_str()
            .expect("host_path is a string"),
    )
}

/// What a waiting take says about its holder.
pub fn held_by(alloc: &str, node: &str) -> String {
    format!("by allocation {alloc} on node {node}")
}

/// The publish context the test plugin's ControllerPublishVolume answers.
pub fn publish_context(volume: &str, node: &str) -> Value {
    json!({"attached_node": node, "device": format!("/dev/claimd-test/{volume}")})
}

// ---- A cluster -----------------------------------------------------------------

/// A test's cluster. Field order is drop order: agents, plugins and
/// proxies first, then etcd, then the directory is unmounted and removed.
pub struct Cluster {
    pub nodes: Vec<Node>,
    pub etcd: Etcd,
    pub dir: TestDir,
}

impl Cluster {
    /// etcd and one node per spec, every agent started, every host's
    /// controller announced in etcd.
    pub fn start(specs: Vec<NodeSpec>) -> Cluster {
        let mut c = Cluster::prepare(specs);
        let names: Vec<String> = c.nodes.iter().map(|n| n.name.clone()).collect();
        for name in names {
            c.start_agent(&name);
        }
        c
    }

    /// Starts node `name`'s agent; a host's, until its controller is
    /// announced (a node that mounts before any host is announced does not
    /// know the plugin needs attaching).
    pub fn start_agent(&mut self, name: &str) {
        self.node_mut(name).start_agent();
        if self.node(name).is_host {
            let key = format!("{PREFIX}/plugins/{PLUGIN_ID}/controllers/{name}");
            let client = self.etcd.client();
            wait_until(SHOW_TIMEOUT, &format!("{key} to be written"), || {
                client.get(&key).expect("read etcd").is_some()
            });
        }
    }

    /// etcd and one node per spec, plugins started, agents not.
    pub fn prepare(specs: Vec<NodeSpec>) -> Cluster {
        let dir = TestDir::new();
        let etcd = Etcd::start();
        let nodes = specs
            .into_iter()
            .map(|s| Node::prepare(dir.path(), s, &etcd))
            .collect();
        Cluster { nodes, etcd, dir }
    }

    pub fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    pub fn node_mut(&mut self, name: &str) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Registers the volume with every running agent and creates it in
    /// every plugin's storage.
    pub fn add_volume(&self, volume: &Value) {
        for n in &self.nodes {
            if n.agent.pid().is_some() {
                n.add_volume(volume);
            } else {
                n.plugin
                    .add_volume(volume["external_id"].as_str().expect("external_id"));
            }
        }
    }

    /// The JSON value of `<prefix>/<rel>`, if the key exists.
    pub fn get_json(&self, rel: &str) -> Option<Value> {
        let key = format!("{PREFIX}/{rel}");
        let kv = self.etcd.client().get(&key).expect("read etcd")?;
        Some(serde_json::from_slice(&kv.value).unwrap_or_else(|e| {
            panic!(
                "{key} is not JSON ({e}): {}",
                String::from_utf8_lossy(&kv.value)
            )
        }))
    }

    /// Deletes `<prefix>/<rel>` straight in etcd, as `etcdctl del` (or an
    /// etcd restored from an older backup) would; it must exist.
    pub fn delete_in_etcd(&self, rel: &str) {
        let key = format!("{PREFIX}/{rel}");
        let gone = self
            .etcd
            .client()
            .delete_range(key.as_bytes(), b"")
            .expect("delete in etcd");
        assert_eq!(gone.deleted, 1, "{key} was not there");
    }

    /// The keys under `<prefix>/<rel>`, without the prefix, in order.
    pub fn keys(&self, rel: &str) -> Vec<String> {
        self.etcd
            .client()
            .range_prefix(format!("{PREFIX}/{rel}"))
            .expect("read etcd")
            .kvs
            .iter()
            .map(|kv| kv.key_str()[PREFIX.len() + 1..].to_string())
            .collect()
    }

    /// `attachments/<volume>/<node>`.
    pub fn attachment(&self, volume: &str, node: &str) -> Option<Value> {
        self.get_json(&format!("attachments/{volume}/{node}"))
    }

    /// The allocations holding claims of `volume` in etcd.
    pub fn holders(&self, volume: &str) -> Vec<String> {
        self.keys(&format!("claims/{volume}/"))
            .iter()
            .map(|k| k.rsplit('/').next().expect("a key").to_string())
            .collect()
    }

    /// Whether `nodes/<node>` (the liveness key) exists.
    pub fn alive(&self, node: &str) -> bool {
        let key = format!("{PREFIX}/nodes/{node}");
        self.etcd.client().get(&key).expect("read etcd").is_some()
    }

    /// Waits until the liveness key of `node` is gone (its lease
    /// expired); the wall-clock time it was first seen gone.
    pub fn wait_gone(&self, node: &str) -> u64 {
        let key = format!("{PREFIX}/nodes/{node}");
        let client = self.etcd.client();
        wait_until(RETRY_TIMEOUT, &format!("{key} to expire"), || {
            client.get(&key).expect("read etcd").is_none()
        });
        now_ms()
    }

    /// Waits until the liveness key of `node` exists.
    pub fn wait_alive(&self, node: &str) {
        let key = format!("{PREFIX}/nodes/{node}");
        let client = self.etcd.client();
        wait_until(RETRY_TIMEOUT, &format!("{key} to exist"), || {
            client.get(&key).expect("read etcd").is_some()
        });
    }
}
