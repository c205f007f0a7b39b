//! The `claimd` binary end to end: a real agent process, driven only
//! through the same binary's client commands, against the real test CSI
//! plugin process, with real mounts. Each test has its own directory
//! (config, state, mount root, API socket, plugin) and runs in parallel with
//! the others.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use crate::agent_support::*;
use crate::common::*;
use serde_json::{json, Value};

/// A test's world. Field order is drop order: the agent dies first, then
/// the plugin, then the directory is unmounted and removed.
struct World {
    agent: Agent,
    plugin: TestPlugin,
    dir: TestDir,
}

impl World {
    /// The test plugin (stage + controller) and an agent configured for it.
    fn new(tweak: impl FnOnce(&mut AgentConfig)) -> World {
        let dir = TestDir::new();
        let plugin = TestPlugin::builder(dir.path()).start();
        let mut config = AgentConfig::new(dir.path(), Some(&plugin.socket));
        tweak(&mut config);
        let agent = Agent::start(dir.path(), config);
        World { agent, plugin, dir }
    }

    fn mount_root(&self) -> PathBuf {
        self.agent.config.mount_root.clone()
    }

    /// Creates the volumes (an object or an array) in the test plugin's
    /// storage, which refuses unknown volume IDs, then registers them with
    /// the agent (`volume register -`); must succeed.
    fn register(&self, volumes: &Value) -> CliOutput {
        create_volumes(&self.plugin, volumes);
        self.agent.register(volumes)
    }

    /// Waits until `plugin list` shows the test plugin ready.
    fn wait_plugin_ready(&self) {
        wait_until(Duration::from_secs(20), "the plugin to be ready", || {
            let out = self.agent.cli(&["plugin", "list", "--json"]).ok();
            out.json()["plugins"][0]["health"] == "ready"
        });
    }

    /// `alloc mount ALLOC --volume data=VOLUME --json`; must succeed; the
    /// host path.
    fn mount(&self, alloc: &str, volume: &str) -> PathBuf {
        let spec = format!("data={volume}");
        let out = self
            .agent
            .cli(&["alloc", "mount", alloc, "--volume", &spec, "--json"])
            .ok();
        let v = out.json();
        PathBuf::from(
            v["volumes"][0]["host_path"]
                .as_str()
                .expect("host_path is a string"),
        )
    }
}

/// `<mount_root>/per-alloc/<alloc>/<volume>/rw-file-system-<mode>`.
fn target_path(mount_root: &Path, alloc: &str, volume: &str, mode: &str) -> PathBuf {
    mount_root
        .join("per-alloc")
        .join(alloc)
        .join(volume)
        .join(format!("rw-file-system-{mode}"))
}

/// Creates each volume's `external_id` in the plugin's storage.
fn create_volumes(plugin: &TestPlugin, volumes: &Value) {
    let list = match volumes {
        Value::Array(list) => list.clone(),
        one => vec![one.clone()],
    };
    for v in list {
        plugin.add_volume(v["external_id"].as_str().expect("external_id is a string"));
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ---- 4. SIGTERM during a stuck release ---------------------------------------

fn sigterm_during_stuck_release(fault: Value) {
    const CALL_TIMEOUT_S: u64 = 2;
    let mut w = World::new(|c| c.csi_call_timeout = format!("{CALL_TIMEOUT_S}s"));
    w.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    let host = w.mount("a1", "db");
    assert!(is_mount_point(&host));
    let hangs = fault["action"] == "hang";
    w.plugin.faults().set(json!([fault]));

    let out = w.agent.cli(&["alloc", "release", "a1"]).ok();
    assert!(out.stdout.contains("data"), "{}", out.stdout);
    // The release is stuck in NodeUnpublishVolume.
    wait_until(Duration::from_secs(20), "the release to be stuck", || {
        if hangs {
            w.plugin
                .stderr_text()
                .lines()
                .any(|l| l.contains("NodeUnpublishVolume") && l.contains("hanging"))
        } else {
            count_calls(&w.plugin.call_log(), NUP, "UNAVAILABLE") >= 1
                && w.agent
                    .cli(&["alloc", "status", "a1", "--json"])
                    .ok()
                    .json()["allocs"][0]["volumes"][0]["release_state"]
                    == "retrying"
        }
    });

    let bound = Duration::from_secs(CALL_TIMEOUT_S) + Duration::from_secs(1);
    let (status, took) = w.agent.terminate(Duration::from_secs(30));
    eprintln!("agent exited {took:?} after SIGTERM (bound {bound:?})");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    assert!(
        took <= bound,
        "the agent took {took:?} to stop (bound {bound:?})"
    );
    // Nothing was unmounted and the allocation is still recorded.
    assert!(is_mount_point(&host), "a graceful stop unmounts nothing");
    let state = w.agent.state();
    let a1 = &state["allocs"]["a1"];
    assert_eq!(a1["releasing"], true, "{state:#}");
    assert_eq!(a1["volumes"]["data"]["phase"], "releasing", "{state:#}");
    assert_eq!(state["claims"].as_array().expect("claims").len(), 1);
    assert!(w.agent.log().contains("signal 15 received"), "log");

    // Clear the fault and restart: the release finishes by itself.
    w.plugin.faults().clear();
    w.agent.restart();
    wait_until(
        Duration::from_secs(30),
        "the resumed release to finish",
        || w.agent.state_allocs().is_empty() && !is_mount_point(&host),
    );
    let state = w.agent.state();
    assert_eq!(state["claims"], json!([]));
    assert_eq!(mounts_under(w.dir.path()), vec![]);
    let all = w.agent.cli(&["alloc", "status", "--json"]).ok().json();
    assert_eq!(all["allocs"], json!([]));
    let log = w.plugin.call_log();
    assert_eq!(count_calls(&log, NUP, "OK"), 1);
    assert_eq!(count_calls(&log, NUS, "OK"), 1);
    assert_eq!(count_calls(&log, CUP, "OK"), 1);
    let calls = volume_calls(&log);
    let ok: Vec<String> = calls
        .iter()
        .filter(|(_, c)| c == "OK")
        .map(|(m, _)| m.clone())
        .collect();
    assert_eq!(ok, strings(&[CP, NS, NP, NUP, NUS, CUP]));
    let failed: Vec<&(String, String)> = calls.iter().filter(|(_, c)| c != "OK").collect();
    assert!(
        failed.iter().all(|(m, c)| m == NUP && c == "UNAVAILABLE"),
        "{failed:?}"
    );
    if hangs {
        assert!(
            failed.is_empty(),
            "hung calls are never answered: {failed:?}"
        );
    }
}

// ---- 5. --dev -------------------------------------------------------------

/// An agent in `--dev` mode whose throwaway directory lands inside the test
/// directory (TMPDIR), so the test directory's cleanup covers it.
fn dev_world() -> (World, PathBuf) {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).volumes(&["ext-db"]).start();
    let mut config = AgentConfig::new(dir.path(), Some(&plugin.socket));
    config.csi_call_timeout = "2s".into();
    let tmp = dir.path().to_str().expect("utf-8").to_string();
    let agent = Agent::start_with(dir.path(), "agent", config, true, &[("TMPDIR", &tmp)]);
    let dev_dir = dir.path().join("claimd-dev");
    let w = World { agent, plugin, dir };
    w.agent
        .register(&volume_json("db", "ext-db", &["single-node-writer"]));
    (w, dev_dir)
}

mod claims_and_failures;
mod cycles;
mod refusals;
