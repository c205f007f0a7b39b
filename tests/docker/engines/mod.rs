//! The Docker volume plugin protocol with the real engines: a dockerd (and
//! Podman) that each test starts with its own data and run directories, a
//! busybox image made with `import`, the real agent beside the real test
//! plugin, real mounts. Each test serves its own driver name (Docker finds
//! plugins at the fixed path `/run/docker/plugins/NAME.sock`).
//!
//! The engines come from Debian's packages (`docker.io`, `podman`, `runc`,
//! `busybox-static`), installed when missing.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::Etcd;
use crate::harness::*;
use serde_json::{json, Value};

/// Cluster mode: one node's agent, plugin (no controller) and dockerd.
/// Field order is drop order: the engine's cleanup reaches the agent.
struct DockerNode {
    docker: Dockerd,
    agent: Agent,
    plugin: TestPlugin,
    driver: String,
    _socket: SocketFile,
}

impl DockerNode {
    fn start(dir: &std::path::Path, name: &str, endpoints: &[String]) -> DockerNode {
        let ndir = dir.join(name);
        let plugin = TestPlugin::builder(&ndir)
            .no_controller()
            .node_id(&format!("ext-{name}"))
            .volumes(&["ext-db"])
            .start();
        let driver = format!("claimd-cl{name}-{}", std::process::id());
        let mut config =
            AgentConfig::new(&ndir, Some(&plugin.socket)).cluster_node(name, endpoints);
        config.extra.push((
            "docker".into(),
            json!({"driver": driver, "mount_timeout": "3s"}),
        ));
        let agent = Agent::start_with(&ndir, "agent", config, false, &[]);
        let docker = Dockerd::start(&ndir);
        DockerNode {
            docker,
            agent,
            plugin,
            _socket: SocketFile(format!("/run/docker/plugins/{driver}.sock").into()),
            driver,
        }
    }

    fn claims(&self) -> Vec<Value> {
        let out = self.agent.cli(&["claim", "list", "--json"]).ok().json();
        out["claims"].as_array().cloned().unwrap_or_default()
    }
}

/// Podman's one mount ID for every mount (libpod's `pseudoCtrID`).
const PODMAN_MOUNT_ID: &str = "2f73349cfc4630255319c6c8dfc1b46a8996ace9d14d8e07563b165915918ec2";

mod containers;
mod references;
