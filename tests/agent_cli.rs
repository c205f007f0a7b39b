//! The `claimd` binary end to end: a real agent process, driven only
//! through the same binary's client commands, against the real test CSI
//! plugin process, with real mounts. Each test has its own directory
//! (config, state, mount root, API socket, plugin) and runs in parallel with
//! the others.

mod agent_support;
mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use agent_support::*;
use common::*;
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

// ---- 1. Full cycle ---------------------------------------------------------

#[test]
fn full_cycle_register_mount_status_release() {
    let w = World::new(|_| {});
    let agent = &w.agent;
    let mount_root = w.mount_root();
    w.plugin.add_volume("ext-db");

    // Register from a file.
    let vol_file = w.dir.path().join("db.json");
    fs::write(
        &vol_file,
        serde_json::to_vec(&volume_json("db", "ext-db", &["single-node-writer"])).expect("json"),
    )
    .expect("write volume file");
    let out = agent
        .cli(&["volume", "register", vol_file.to_str().expect("utf-8")])
        .ok();
    assert_eq!(out.stdout.trim(), "volume db registered");
    let list = agent.cli(&["volume", "list", "--json"]).ok().json();
    assert_eq!(list["volumes"].as_array().expect("array").len(), 1);
    assert_eq!(list["volumes"][0]["id"], "db");
    assert_eq!(list["volumes"][0]["plugin_id"], PLUGIN_ID);
    assert_eq!(list["volumes"][0]["external_id"], "ext-db");
    assert_eq!(
        list["volumes"][0]["access_modes"],
        json!(["single-node-writer"])
    );

    // Plugin list: ready, with the plugin's node ID and capabilities.
    w.wait_plugin_ready();
    let plugins = agent.cli(&["plugin", "list", "--json"]).ok().json();
    let p = &plugins["plugins"][0];
    assert_eq!(plugins["plugins"].as_array().expect("array").len(), 1);
    assert_eq!(p["id"], PLUGIN_ID);
    assert_eq!(p["type"], "monolith");
    assert_eq!(p["health"], "ready");
    assert_eq!(p["node_id"], "test-node");
    assert_eq!(p["name"], "claimd.test.plugin");
    let caps: Vec<String> = serde_json::from_value(p["capabilities"].clone()).expect("caps");
    for c in [
        "CONTROLLER_SERVICE",
        "STAGE_UNSTAGE_VOLUME",
        "PUBLISH_UNPUBLISH_VOLUME",
    ] {
        assert!(caps.iter().any(|x| x == c), "{c} missing from {caps:?}");
    }
    let table = agent.cli(&["plugin", "list"]).ok();
    assert!(
        table.stdout.contains("ready") && table.stdout.contains("test-node"),
        "{}",
        table.stdout
    );

    // Mount: the table names the host path.
    let expected = target_path(&mount_root, "a1", "db", "single-node-writer");
    let out = agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=db"])
        .ok();
    assert!(
        out.stdout.contains(expected.to_str().expect("utf-8")),
        "host path {} not in:\n{}",
        expected.display(),
        out.stdout
    );
    assert!(out.stdout.contains("data") && out.stdout.contains("rw"));
    let after_mount = volume_methods(&w.plugin.call_log());
    assert_eq!(after_mount, strings(&[CP, NS, NP]));

    // Mounting again with the same request is idempotent and answers the
    // same path as JSON, with no CSI call.
    let j = agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=db", "--json"])
        .ok()
        .json();
    assert_eq!(j["alloc_id"], "a1");
    assert_eq!(j["volumes"].as_array().expect("array").len(), 1);
    assert_eq!(j["volumes"][0]["alias"], "data");
    assert_eq!(j["volumes"][0]["volume_id"], "db");
    assert_eq!(j["volumes"][0]["read_only"], false);
    assert_eq!(j["volumes"][0]["block"], false);
    assert_eq!(j["volumes"][0]["host_path"], json!(expected));
    assert_eq!(volume_methods(&w.plugin.call_log()), after_mount);

    // A real, writable mount of the plugin's volume directory.
    let m = mount_at(&expected).expect("the host path is a mount point");
    assert!(!m.read_only(), "{m:?}");
    fs::write(expected.join("hello.txt"), b"hello from a1").expect("write into the mount");
    assert_eq!(
        fs::read(w.plugin.volume_dir("ext-db").join("hello.txt")).expect("lands in the volume"),
        b"hello from a1"
    );

    // Status: table and JSON; the state file agrees.
    let st = agent.cli(&["alloc", "status", "a1", "--json"]).ok().json();
    let a = &st["allocs"][0];
    assert_eq!(a["id"], "a1");
    assert_eq!(a["releasing"], false);
    assert_eq!(a["volumes"][0]["alias"], "data");
    assert_eq!(a["volumes"][0]["volume_id"], "db");
    assert_eq!(a["volumes"][0]["plugin_id"], PLUGIN_ID);
    assert_eq!(a["volumes"][0]["phase"], "published");
    assert_eq!(a["volumes"][0]["host_path"], json!(expected));
    assert_eq!(a["volumes"][0]["read_only"], false);
    assert_eq!(a["volumes"][0]["attachment_mode"], "file-system");
    assert_eq!(a["volumes"][0]["release_state"], "");
    let all = agent.cli(&["alloc", "status"]).ok();
    assert!(
        all.stdout.contains("a1") && all.stdout.contains("published"),
        "{}",
        all.stdout
    );
    let state = agent.state();
    assert_eq!(
        state["allocs"]["a1"]["volumes"]["data"]["phase"],
        "published"
    );
    assert_eq!(state["claims"].as_array().expect("claims").len(), 1);

    // Release and wait.
    let out = agent.cli(&["alloc", "release", "a1", "--wait", "30s"]).ok();
    assert!(out.stdout.contains("released"), "{}", out.stdout);
    let st = agent.cli(&["alloc", "status", "a1", "--json"]).ok().json();
    assert_eq!(st["allocs"][0]["id"], "a1");
    assert_eq!(st["allocs"][0]["releasing"], true);
    assert_eq!(st["allocs"][0]["volumes"][0]["release_state"], "released");
    assert_eq!(st["allocs"][0]["volumes"][0]["release_error"], "");
    let all = agent.cli(&["alloc", "status", "--json"]).ok().json();
    assert_eq!(all["allocs"], json!([]));

    // Exactly the lifecycle calls, in order, all OK.
    let calls = volume_calls(&w.plugin.call_log());
    let expected_calls: Vec<(String, String)> = [CP, NS, NP, NUP, NUS, CUP]
        .iter()
        .map(|m| (m.to_string(), "OK".to_string()))
        .collect();
    assert_eq!(calls, expected_calls);

    // Nothing left mounted or recorded.
    assert_eq!(mounts_under(w.dir.path()), vec![]);
    assert!(dir_is_empty(&mount_root.join("per-alloc")));
    assert!(dir_is_empty(&mount_root.join("staging")));
    let state = agent.state();
    assert_eq!(state["allocs"], json!({}));
    assert_eq!(state["claims"], json!([]));

    // The data stays in the volume; the volume can be deregistered.
    assert!(w.plugin.volume_dir("ext-db").join("hello.txt").exists());
    let out = agent.cli(&["volume", "deregister", "db"]).ok();
    assert_eq!(out.stdout.trim(), "volume db deregistered");
    let list = agent.cli(&["volume", "list", "--json"]).ok().json();
    assert_eq!(list["volumes"], json!([]));
}

// ---- 2. Many allocations at once -------------------------------------------

#[test]
fn two_hundred_allocations_mount_and_release_concurrently() {
    const ALLOCS: usize = 200;
    const OWN: usize = 100; // allocations 0..OWN each have their own volume
    const PARALLEL: usize = 32;
    let w = World::new(|c| c.csi_call_timeout = "10s".into());
    let agent = &w.agent;
    let mount_root = w.mount_root();

    let mut vols: Vec<Value> = (0..OWN)
        .map(|i| {
            volume_json(
                &format!("v{i:03}"),
                &format!("ext-v{i:03}"),
                &["single-node-writer"],
            )
        })
        .collect();
    vols.push(volume_json(
        "shared",
        "ext-shared",
        &["single-node-multi-writer"],
    ));
    w.register(&Value::Array(vols));
    let volume_of = |i: usize| {
        if i < OWN {
            format!("v{i:03}")
        } else {
            "shared".to_string()
        }
    };

    let started = Instant::now();
    let mounted = parallel(ALLOCS, PARALLEL, |i| {
        let spec = format!("data={}", volume_of(i));
        agent.cli(&[
            "alloc",
            "mount",
            &format!("alloc-{i:03}"),
            "--volume",
            &spec,
            "--json",
        ])
    });
    let mount_time = started.elapsed();
    let mut paths = Vec::new();
    for (i, out) in mounted.into_iter().enumerate() {
        let out = out.ok();
        let j = out.json();
        assert_eq!(j["alloc_id"], format!("alloc-{i:03}"));
        let p = PathBuf::from(j["volumes"][0]["host_path"].as_str().expect("host path"));
        let mode = if i < OWN {
            "single-node-writer"
        } else {
            "single-node-multi-writer"
        };
        assert_eq!(
            p,
            target_path(&mount_root, &format!("alloc-{i:03}"), &volume_of(i), mode)
        );
        paths.push(p);
    }
    // Every allocation is mounted: one publish mount each, one staging
    // mount per volume.
    let per_alloc = mounts_under(&mount_root.join("per-alloc"));
    assert_eq!(per_alloc.len(), ALLOCS, "per-alloc mounts");
    for p in &paths {
        assert!(is_mount_point(p), "{} is not mounted", p.display());
    }
    assert_eq!(mounts_under(&mount_root.join("staging")).len(), OWN + 1);
    let state = agent.state();
    let allocs = state["allocs"].as_object().expect("allocs");
    assert_eq!(allocs.len(), ALLOCS);
    assert!(allocs
        .values()
        .all(|a| a["volumes"]["data"]["phase"] == "published"));
    assert_eq!(state["claims"].as_array().expect("claims").len(), ALLOCS);
    let status = agent.cli(&["alloc", "status", "--json"]).ok().json();
    assert_eq!(status["allocs"].as_array().expect("allocs").len(), ALLOCS);
    let log = w.plugin.call_log();
    assert_eq!(count_calls(&log, CP, "OK"), OWN + 1);
    assert_eq!(count_calls(&log, NS, "OK"), OWN + 1);
    assert_eq!(count_calls(&log, NP, "OK"), ALLOCS);
    assert_eq!(
        volume_calls(&log).len(),
        2 * (OWN + 1) + ALLOCS,
        "no other calls"
    );

    let started = Instant::now();
    let released = parallel(ALLOCS, PARALLEL, |i| {
        agent.cli(&[
            "alloc",
            "release",
            &format!("alloc-{i:03}"),
            "--wait",
            "60s",
            "--json",
        ])
    });
    let release_time = started.elapsed();
    for out in released {
        let j = out.ok().json();
        assert_eq!(j["found"], true);
        assert_eq!(j["done"], true);
        assert_eq!(j["volumes"][0]["state"], "released");
    }
    assert_eq!(mounts_under(&mount_root), vec![]);
    assert_eq!(mounts_under(w.dir.path()), vec![]);
    let state = agent.state();
    assert_eq!(state["allocs"], json!({}));
    assert_eq!(state["claims"], json!([]));
    assert!(dir_is_empty(&mount_root.join("per-alloc")));
    assert!(dir_is_empty(&mount_root.join("staging")));
    assert_eq!(count_calls(&log, NUP, "OK"), ALLOCS);
    assert_eq!(count_calls(&log, NUS, "OK"), OWN + 1);
    assert_eq!(count_calls(&log, CUP, "OK"), OWN + 1);
    assert_eq!(
        volume_calls(&log).len(),
        4 * (OWN + 1) + 2 * ALLOCS,
        "no other calls"
    );
    // Per volume, the calls come in lifecycle order: an own volume sees
    // exactly one of each; the shared one is attached and staged once,
    // published per allocation, and unstaged and detached after its last
    // unpublish.
    let mut by_volume: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for c in log.calls() {
        let m = c["method"].as_str().expect("method");
        if IDENTITY_METHODS.contains(&m) {
            continue;
        }
        let v = c["volume_id"].as_str().expect("volume_id").to_string();
        by_volume.entry(v).or_default().push(m.to_string());
    }
    assert_eq!(by_volume.len(), OWN + 1);
    for i in 0..OWN {
        assert_eq!(
            by_volume[&format!("ext-v{i:03}")],
            strings(&[CP, NS, NP, NUP, NUS, CUP]),
            "ext-v{i:03}"
        );
    }
    let shared = &by_volume["ext-shared"];
    let shared_allocs = ALLOCS - OWN;
    let mut want = strings(&[CP, NS]);
    want.extend(std::iter::repeat(NP.to_string()).take(shared_allocs));
    want.extend(std::iter::repeat(NUP.to_string()).take(shared_allocs));
    want.extend(strings(&[NUS, CUP]));
    assert_eq!(shared, &want, "calls of the shared volume");
    eprintln!(
        "{ALLOCS} allocations, {PARALLEL} at a time: mounted in {mount_time:?}, released in {release_time:?}"
    );
}

// ---- 3. A plugin that comes up late ------------------------------------------

#[test]
fn mount_waits_for_a_plugin_that_starts_late() {
    const PLUGIN_DELAY: Duration = Duration::from_secs(10);
    let dir = TestDir::new();
    let plugin_socket = dir.path().join("plugin").join("csi.sock");
    let mut config = AgentConfig::new(dir.path(), Some(&plugin_socket));
    config.plugin_wait_timeout = "60s".into();
    let agent_started = Instant::now();
    let agent = Agent::start(dir.path(), config);
    agent.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    let plugins = agent.cli(&["plugin", "list", "--json"]).ok().json();
    assert_ne!(plugins["plugins"][0]["health"], "ready");

    let mount = thread::scope(|s| {
        let mounting = s.spawn(|| {
            let out = agent.cli(&["alloc", "mount", "a1", "--volume", "data=db", "--json"]);
            (out, Instant::now())
        });
        // The request is in: recorded, and waiting on the plugin.
        wait_until(
            Duration::from_secs(20),
            "the mount to wait for the plugin",
            || {
                let st = agent.cli(&["alloc", "status", "a1", "--json"]);
                st.code == EXIT_OK
                    && st.json()["allocs"][0]["volumes"][0]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("waiting for node plugin testplug"))
            },
        );
        assert_eq!(
            agent.state()["allocs"]["a1"]["volumes"]["data"]["phase"],
            "claiming"
        );
        // The plugin's start is scheduled ten seconds after the agent's.
        thread::sleep(PLUGIN_DELAY.saturating_sub(agent_started.elapsed()));
        assert!(
            !mounting.is_finished(),
            "the mount returned before the plugin started"
        );
        let plugin_started = Instant::now();
        let plugin = TestPlugin::builder(dir.path()).volumes(&["ext-db"]).start();
        let (out, returned) = mounting.join().expect("mount thread");
        (out, returned, plugin_started, plugin)
    });
    let (out, returned, plugin_started, plugin) = mount;
    let out = out.ok();
    assert!(
        returned >= plugin_started,
        "the mount returned before the plugin started"
    );
    assert!(returned.duration_since(agent_started) >= PLUGIN_DELAY);
    let host = PathBuf::from(
        out.json()["volumes"][0]["host_path"]
            .as_str()
            .expect("path"),
    );
    assert!(is_mount_point(&host));
    assert!(
        out.stderr.contains("waiting for node plugin testplug"),
        "the client shows what it waits on; stderr:\n{}",
        out.stderr
    );
    assert_eq!(volume_methods(&plugin.call_log()), strings(&[CP, NS, NP]));
    eprintln!(
        "mount returned {:?} after the plugin started ({:?} after the agent)",
        returned.duration_since(plugin_started),
        returned.duration_since(agent_started)
    );
    agent.cli(&["alloc", "release", "a1", "--wait", "30s"]).ok();
    assert_eq!(mounts_under(dir.path()), vec![]);
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

#[test]
fn sigterm_during_hanging_release_exits_in_time_and_resumes() {
    sigterm_during_stuck_release(json!({"method": "NodeUnpublishVolume", "action": "hang"}));
}

#[test]
fn sigterm_during_failing_release_exits_in_time_and_resumes() {
    sigterm_during_stuck_release(json!({
        "method": "NodeUnpublishVolume", "action": "fail", "code": "UNAVAILABLE",
        "message": "storage backend unreachable"
    }));
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

#[test]
fn dev_mode_with_the_plugin_killed_exits_within_its_bound() {
    let (mut w, dev_dir) = dev_world();
    let host = w.mount("a1", "db");
    assert!(
        host.starts_with(dev_dir.join("mounts")),
        "--dev mounts under its throwaway directory, not {}",
        host.display()
    );
    assert!(is_mount_point(&host));
    w.plugin.kill();
    let (status, took) = w.agent.terminate(Duration::from_secs(60));
    eprintln!("dev agent exited {took:?} after SIGTERM with the plugin gone");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let log = w.agent.log();
    assert!(
        log.contains("dev mode: releasing 1 allocation(s) before exit"),
        "log"
    );
    // The release could not happen; it stays recorded in the dev state.
    let state = state_of_dir(&dev_dir.join("state"));
    assert_eq!(state["allocs"]["a1"]["releasing"], true, "{state:#}");
}

#[test]
fn dev_mode_releases_everything_on_stop() {
    let (mut w, dev_dir) = dev_world();
    let host = w.mount("a1", "db");
    assert!(host.starts_with(dev_dir.join("mounts")));
    let (status, took) = w.agent.terminate(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "exit status {status}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert_eq!(mounts_under(w.dir.path()), vec![]);
    // Everything was released, so the throwaway directory is gone too.
    assert!(!dev_dir.exists(), "{} was left behind", dev_dir.display());
    assert!(w
        .agent
        .log()
        .contains("dev mode: releasing 1 allocation(s) before exit"));
    assert_eq!(
        volume_methods(&w.plugin.call_log()),
        strings(&[CP, NS, NP, NUP, NUS, CUP])
    );
}

// ---- 6. Bad input ------------------------------------------------------------

#[test]
fn bad_input_is_refused_with_a_message_and_changes_nothing() {
    let w = World::new(|_| {});
    let agent = &w.agent;
    w.register(&json!([
        volume_json("db", "ext-db", &["single-node-writer"]),
        volume_json("ro-only", "ext-ro", &["multi-node-reader-only"]),
    ]));
    let held = w.mount("holder", "db");
    let before = agent.state_bytes();
    let mounts_before = mounts_under(w.dir.path());
    let calls_before = volume_calls(&w.plugin.call_log());

    let bad_file = w.dir.path().join("bad.json");
    let mut bad = volume_json("new", "ext-new", &["single-node-writer"]);
    bad["size"] = json!("10G");
    fs::write(&bad_file, serde_json::to_vec(&bad).expect("json")).expect("write");
    let bad_file = bad_file.to_str().expect("utf-8");

    // (args, exit code, what stderr must say)
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["alloc", "mount", "a1", "--volume", "data=nosuch"],
            EXIT_FAILED,
            "volume nosuch is not registered",
        ),
        (
            vec!["alloc", "mount", "../x", "--volume", "data=db"],
            EXIT_USAGE,
            "invalid allocation ID \"../x\"",
        ),
        (
            vec!["alloc", "mount", "a1", "--volume", "a/b=db"],
            EXIT_USAGE,
            "invalid alias ID \"a/b\"",
        ),
        (
            vec!["alloc", "mount", "a1", "--volume", "data=db", "--volume", "data=ro-only,ro"],
            EXIT_USAGE,
            "alias data is given twice",
        ),
        (
            vec!["alloc", "mount", "a1", "--volume", "data=ro-only"],
            EXIT_USAGE,
            "a read-write request needs a writable access mode; the volume only has multi-node-reader-only",
        ),
        (
            vec!["alloc", "mount", "a1", "--volume", "data=ro-only,access=multi-node-reader-only"],
            EXIT_USAGE,
            "a read-write request is impossible with access mode multi-node-reader-only",
        ),
        (
            vec!["alloc", "mount", "a1"],
            EXIT_USAGE,
            "needs at least one --volume",
        ),
        (
            vec!["volume", "register", bad_file],
            EXIT_USAGE,
            "unknown field `size`",
        ),
        (
            vec!["alloc", "release", "../x"],
            EXIT_USAGE,
            "invalid allocation ID \"../x\"",
        ),
        (
            vec!["alloc", "status", "nosuch"],
            EXIT_FAILED,
            "allocation nosuch is not known to this agent",
        ),
        (
            vec!["volume", "deregister", "db"],
            EXIT_FAILED,
            "volume db is in use by allocation holder",
        ),
    ];
    for (args, code, msg) in &cases {
        let out = agent.cli(args).expect_code(*code);
        assert!(
            out.stderr.contains(msg),
            "`claimd {}`: stderr lacks {msg:?}:\n{}",
            args.join(" "),
            out.stderr
        );
        assert!(
            out.stderr.starts_with("claimd: "),
            "`claimd {}`: {}",
            args.join(" "),
            out.stderr
        );
        assert_eq!(
            out.stdout,
            "",
            "`claimd {}` prints nothing on stdout",
            args.join(" ")
        );
        assert_eq!(
            agent.state_bytes(),
            before,
            "`claimd {}` changed the state file",
            args.join(" ")
        );
    }

    // Releasing an unknown allocation succeeds and says so.
    let out = agent.cli(&["alloc", "release", "nosuch"]).ok();
    assert_eq!(
        out.stdout.trim(),
        "allocation nosuch is not known to the agent: nothing to release"
    );
    let j = agent
        .cli(&["alloc", "release", "nosuch", "--wait", "1s", "--json"])
        .ok()
        .json();
    assert_eq!(j["found"], false);
    assert_eq!(agent.state_bytes(), before);

    // Nothing was mounted, unmounted or called.
    assert_eq!(mounts_under(w.dir.path()), mounts_before);
    assert!(is_mount_point(&held));
    assert_eq!(volume_calls(&w.plugin.call_log()), calls_before);

    // No agent at the socket: missing file, and a stale socket file.
    let missing = w.dir.path().join("nobody.sock");
    let stale = w.dir.path().join("stale.sock");
    drop(UnixListener::bind(&stale).expect("bind"));
    assert!(stale.exists());
    for sock in [&missing, &stale] {
        for args in [
            &["plugin", "list"][..],
            &["volume", "list", "--json"][..],
            &["alloc", "mount", "a1", "--volume", "data=db"][..],
            &["alloc", "release", "a1"][..],
        ] {
            let out = cli_at(sock, args).expect_code(EXIT_UNREACHABLE);
            let want = format!("agent not running at {}", sock.display());
            assert!(
                out.stderr.contains(&want),
                "{want:?} not in {:?}",
                out.stderr
            );
        }
    }
    // CLAIMD_SOCKET is honoured too.
    let out = run_claimd(
        &["plugin", "list"],
        None,
        &[("CLAIMD_SOCKET", missing.to_str().expect("utf-8"))],
        CLI_TIMEOUT,
    )
    .expect_code(EXIT_UNREACHABLE);
    assert!(out
        .stderr
        .contains(&format!("agent not running at {}", missing.display())));
    assert_eq!(agent.state_bytes(), before);
}

// ---- 7. Socket permissions ---------------------------------------------------

#[test]
fn api_socket_is_private() {
    let w = World::new(|c| {
        c.api_socket = c
            .api_socket
            .parent()
            .expect("parent")
            .join("api")
            .join("claimd.sock")
    });
    let socket = &w.agent.config.api_socket;
    let meta = fs::metadata(socket).expect("socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode");
    for dir in [socket.parent().expect("dir"), &w.dir.path().join("run")] {
        let mode = fs::metadata(dir).expect("dir").permissions().mode() & 0o777;
        assert_eq!(mode & 0o007, 0, "{} is mode {mode:o}", dir.display());
        assert_eq!(mode, 0o700, "{} is mode {mode:o}", dir.display());
    }
    // The state (which holds secrets) is private too.
    let state_mode = fs::metadata(w.agent.state_path())
        .expect("state")
        .permissions()
        .mode();
    assert_eq!(state_mode & 0o777, 0o600);
    w.agent.cli(&["plugin", "list"]).ok();
}

// ---- 8. One agent per state dir; stale socket --------------------------------

#[test]
fn second_agent_is_refused_and_stale_socket_is_replaced() {
    let mut w = World::new(|_| {});
    w.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    let host = w.mount("a1", "db");
    let before = w.agent.state_bytes();

    // A second agent on the same state directory, with its own socket and
    // with the first one's socket: both refuse to start.
    let mut own_socket = w.agent.config.clone();
    own_socket.api_socket = w.dir.path().join("run2").join("claimd.sock");
    let same_socket = w.agent.config.clone();
    for (name, config) in [("second", own_socket), ("third", same_socket)] {
        let socket = config.api_socket.clone();
        let mut other = Agent::prepare(w.dir.path(), name, config, false, &[]);
        other.spawn();
        let status = other.wait_exit(Duration::from_secs(30));
        assert_eq!(status.code(), Some(1), "{name}: {status}");
        let log = other.log();
        assert!(
            log.contains("another claimd agent is using the state directory")
                && log.contains("claimd.lock"),
            "{name}: {log}"
        );
        if socket != w.agent.config.api_socket {
            assert!(!socket.exists(), "{name} created its socket");
        }
        // The first agent is untouched.
        w.agent.cli(&["plugin", "list"]).ok();
        assert_eq!(w.agent.state_bytes(), before);
    }

    // SIGKILL leaves the socket file behind; a restart replaces it.
    let socket = w.agent.config.api_socket.clone();
    let calls = volume_calls(&w.plugin.call_log());
    w.agent
        .signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(fs::symlink_metadata(&socket)
        .expect("socket left behind")
        .file_type()
        .is_socket());
    cli_at(&socket, &["plugin", "list"]).expect_code(EXIT_UNREACHABLE);
    w.agent.restart();
    assert!(w.agent.log().contains("removing stale API socket"), "log");
    let meta = fs::metadata(&socket).expect("socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let st = w
        .agent
        .cli(&["alloc", "status", "a1", "--json"])
        .ok()
        .json();
    assert_eq!(st["allocs"][0]["volumes"][0]["phase"], "published");
    // The intact mount cost no CSI call.
    assert!(is_mount_point(&host));
    assert_eq!(volume_calls(&w.plugin.call_log()), calls);
    w.agent
        .cli(&["alloc", "release", "a1", "--wait", "30s"])
        .ok();
    assert_eq!(mounts_under(w.dir.path()), vec![]);
}

// ---- 9. Secrets --------------------------------------------------------------

#[test]
fn secrets_never_leave_the_state_file() {
    const SECRET: &str = "s3cr3t-Pa55w0rd-9f1c";
    let w = World::new(|_| {});
    let agent = &w.agent;
    let mut vol = volume_json("db", "ext-db", &["single-node-writer"]);
    vol["secrets"] = json!({"password": SECRET});
    vol["context"] = json!({"tier": "gold"});
    let mut outputs = vec![w.register(&vol)];

    let list = agent.cli(&["volume", "list", "--json"]).ok();
    let j = list.json();
    assert_eq!(j["volumes"][0]["secret_keys"], json!(["password"]));
    assert_eq!(j["volumes"][0]["context"], json!({"tier": "gold"}));
    outputs.push(list);
    outputs.push(agent.cli(&["volume", "list"]).ok());
    outputs.push(
        agent
            .cli(&["alloc", "mount", "a1", "--volume", "data=db", "--json"])
            .ok(),
    );
    outputs.push(agent.cli(&["alloc", "status", "--json"]).ok());
    outputs.push(agent.cli(&["alloc", "status"]).ok());
    // Replacing a claimed volume is refused; the message names no secret.
    let mut changed = vol.clone();
    changed["secrets"] = json!({"password": format!("{SECRET}-new")});
    let socket = agent.config.api_socket.to_str().expect("utf-8");
    let text = serde_json::to_vec(&changed).expect("json");
    let out = run_claimd(
        &["volume", "register", "-", "--socket", socket],
        Some(&text),
        &[],
        CLI_TIMEOUT,
    )
    .expect_code(EXIT_FAILED);
    assert!(
        out.stderr.contains("in use by allocation a1"),
        "{}",
        out.stderr
    );
    outputs.push(out);
    outputs.push(
        agent
            .cli(&["alloc", "release", "a1", "--wait", "30s", "--json"])
            .ok(),
    );
    for out in &outputs {
        assert!(
            !out.stdout.contains(SECRET) && !out.stderr.contains(SECRET),
            "`claimd {}` shows the secret:\n{}\n{}",
            out.args.join(" "),
            out.stdout,
            out.stderr
        );
    }

    // The plugin got the secret (by key) on every call that takes secrets,
    // and its call log never shows the value.
    let log = w.plugin.call_log();
    assert_eq!(volume_methods(&log), strings(&[CP, NS, NP, NUP, NUS, CUP]));
    for m in [CP, NS, NP, CUP] {
        let calls = log.calls_of(m);
        assert_eq!(calls[0]["secret_keys"], json!(["password"]), "{m}");
    }
    assert!(!log.raw().contains(SECRET), "the call log shows the secret");

    // The agent's debug log never shows it.
    let agent_log = agent.log();
    assert!(agent_log.contains("DEBUG"), "the agent logs at debug level");
    assert!(
        agent_log.contains("ControllerPublishVolume") || agent_log.contains("NodePublishVolume"),
        "the debug log shows CSI calls"
    );
    assert!(
        !agent_log.contains(SECRET),
        "the agent log shows the secret"
    );

    // Only the private state file keeps it.
    let state = String::from_utf8(agent.state_bytes()).expect("utf-8");
    assert!(state.contains(SECRET));
    for path in [agent.state_path(), agent.journal_path()] {
        let mode = fs::metadata(&path).expect("state").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", path.display());
    }
}

// ---- Progress messages -------------------------------------------------------

/// While a mount is busy in a CSI call, neither `alloc status` nor the
/// client's progress lines may claim it waits for a plugin that is ready.
#[test]
fn mount_progress_does_not_blame_a_ready_plugin() {
    // A CSI deadline well above the 4 s delay: the mount must succeed.
    let w = World::new(|c| c.csi_call_timeout = "60s".into());
    w.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    w.wait_plugin_ready();
    w.plugin.faults().set(json!([
        {"method": "NodeStageVolume", "action": "delay", "ms": 4000}
    ]));
    let (out, message) = thread::scope(|s| {
        let mounting = s.spawn(|| {
            w.agent
                .cli(&["alloc", "mount", "a1", "--volume", "data=db"])
        });
        wait_until(
            Duration::from_secs(20),
            "NodeStageVolume to be delayed",
            || {
                w.plugin
                    .stderr_text()
                    .lines()
                    .any(|l| l.contains("NodeStageVolume") && l.contains("delaying"))
            },
        );
        let st = w
            .agent
            .cli(&["alloc", "status", "a1", "--json"])
            .ok()
            .json();
        let message = st["allocs"][0]["volumes"][0]["message"].clone();
        (mounting.join().expect("mount thread"), message)
    });
    let out = out.ok();
    let plugins = w.agent.cli(&["plugin", "list", "--json"]).ok().json();
    assert_eq!(plugins["plugins"][0]["health"], "ready");
    assert!(
        !message
            .as_str()
            .is_some_and(|m| m.contains("waiting for node plugin")),
        "status during NodeStageVolume says {message}, but the plugin is ready"
    );
    assert!(
        !out.stderr.contains("waiting for node plugin"),
        "the client told the user it waits for a ready plugin:\n{}",
        out.stderr
    );
}

// ---- A client that gives up -----------------------------------------------

/// A mount whose client deadline expires mid-way is not left half-claimed:
/// the agent finishes it and records it (and a later release frees it all).
#[test]
fn expired_client_deadline_leaves_a_complete_mount_not_a_half_claimed_one() {
    let w = World::new(|_| {});
    let agent = &w.agent;
    w.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    w.wait_plugin_ready();
    // NodePublish takes 3 s; the client waits 1 s.
    w.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "delay", "ms": 3000}
    ]));
    let out = agent.cli(&[
        "alloc",
        "mount",
        "a1",
        "--volume",
        "data=db",
        "--timeout",
        "1s",
    ]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("did not answer in time"),
        "{}",
        out.stderr
    );
    // The agent goes on and records the completed mount.
    wait_until(Duration::from_secs(30), "the mount to complete", || {
        agent.state()["allocs"]["a1"]["volumes"]["data"]["phase"] == "published"
    });
    let status = agent.cli(&["alloc", "status", "a1", "--json"]).ok().json();
    let host = PathBuf::from(
        status["allocs"][0]["volumes"][0]["host_path"]
            .as_str()
            .expect("host path"),
    );
    assert!(is_mount_point(&host), "{} is not mounted", host.display());
    assert_eq!(agent.state()["claims"].as_array().expect("claims").len(), 1);
    // The same request again answers at once with the same path.
    w.plugin.faults().clear();
    let again = agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=db", "--json"])
        .ok()
        .json();
    assert_eq!(
        again["volumes"][0]["host_path"],
        host.to_str().expect("utf-8")
    );
    agent.cli(&["alloc", "release", "a1", "--wait", "30s"]).ok();
    assert!(!is_mount_point(&host));
    assert_eq!(agent.state()["claims"], json!([]));
    assert_eq!(
        volume_methods(&w.plugin.call_log()),
        strings(&[CP, NS, NP, NUP, NUS, CUP])
    );
}

// ---- A bad config ---------------------------------------------------------

/// An invalid config stops the agent at once with a message naming the
/// file and the field, exit code 2, and nothing created.
#[test]
fn invalid_config_stops_the_agent_naming_the_field() {
    let dir = TestDir::new();
    let state = dir.path().join("state");
    let cases = [
        (
            json!({"state_dir": state, "surprise": 1}),
            "unknown field `surprise`",
        ),
        (
            json!({"state_dir": state, "plugins": [{"id": "p", "type": "node"}]}),
            "missing field `socket`",
        ),
        (
            json!({"state_dir": state, "plugins": [{"id": "p", "type": "node", "socket": "rel.sock"}]}),
            "field plugins[0].socket: rel.sock is not an absolute path",
        ),
        (
            json!({"state_dir": state, "plugins": [
                {"id": "p", "type": "node", "socket": "/a.sock"},
                {"id": "p", "type": "monolith", "socket": "/b.sock"}]}),
            "field plugins[1].id: duplicate plugin ID",
        ),
        (
            json!({"state_dir": state, "probe_interval": "soon"}),
            "field probe_interval",
        ),
    ];
    let config = dir.path().join("config.json");
    for (text, needle) in cases {
        fs::write(&config, text.to_string()).expect("write config");
        let out = run_claimd(
            &["agent", "--config", config.to_str().expect("utf-8")],
            None,
            &[],
            Duration::from_secs(30),
        );
        assert_eq!(out.code, 2, "{text}: {out:?}");
        assert!(out.stderr.contains(needle), "{text}: {}", out.stderr);
        assert!(
            out.stderr.contains(config.to_str().expect("utf-8")),
            "{}",
            out.stderr
        );
        assert!(!state.exists(), "the state dir was created for {text}");
    }
    // A config file given explicitly that does not exist is an error too.
    let missing = dir.path().join("nope.json");
    let out = run_claimd(
        &["agent", "--config", missing.to_str().expect("utf-8")],
        None,
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("failed to read config file"),
        "{}",
        out.stderr
    );
}

// ---- Block volumes ----------------------------------------------------------

/// A block-device volume is published as a file (the plugin creates it) and
/// released like any other.
#[test]
fn block_volume_cycle() {
    let w = World::new(|_| {});
    let agent = &w.agent;
    let mut vol = volume_json("raw", "ext-raw", &["single-node-writer"]);
    vol["attachment_modes"] = json!(["block-device"]);
    w.register(&vol);
    w.wait_plugin_ready();
    let out = agent
        .cli(&[
            "alloc",
            "mount",
            "b1",
            "--volume",
            "disk=raw,attachment=block-device",
            "--json",
        ])
        .ok()
        .json();
    assert_eq!(out["volumes"][0]["block"], true, "{out}");
    let host = PathBuf::from(out["volumes"][0]["host_path"].as_str().expect("path"));
    assert!(
        host.ends_with("per-alloc/b1/raw/rw-block-device-single-node-writer"),
        "{}",
        host.display()
    );
    assert!(is_mount_point(&host), "{} is not mounted", host.display());
    assert!(
        fs::metadata(&host).expect("stat").is_file(),
        "a block target is a file"
    );
    let status = agent.cli(&["alloc", "status", "b1", "--json"]).ok().json();
    assert_eq!(
        status["allocs"][0]["volumes"][0]["attachment_mode"],
        "block-device"
    );
    agent.cli(&["alloc", "release", "b1", "--wait", "30s"]).ok();
    assert!(!is_mount_point(&host));
    assert!(!host.exists(), "the block target was left behind");
    assert_eq!(agent.state()["claims"], json!([]));
    assert_eq!(
        volume_methods(&w.plugin.call_log()),
        strings(&[CP, NS, NP, NUP, NUS, CUP])
    );
}

// ---- a claim held by another allocation ----------------------------------------

/// A mount whose plugin is ready claims in the write that records it; when
/// another allocation holds the volume for writing, that write records the
/// mount in phase `claiming` without a claim, the mount waits (status says
/// on whom), and it claims and mounts once the holder is released.
#[test]
fn a_held_claim_is_waited_for_and_taken_after_the_holder_is_released() {
    let w = World::new(|c| c.claim_retry_deadline = "60s".into());
    w.register(&volume_json("db", "ext-db", &["single-node-writer"]));
    w.wait_plugin_ready();
    let host1 = w.mount("a1", "db");
    assert!(is_mount_point(&host1));
    thread::scope(|s| {
        let second = s.spawn(|| {
            w.agent
                .cli(&["alloc", "mount", "a2", "--volume", "data=db", "--json"])
        });
        wait_until(Duration::from_secs(20), "a2 to wait for a1's claim", || {
            let st = w.agent.cli(&["alloc", "status", "a2", "--json"]);
            st.code == 0
                && st.json()["allocs"][0]["volumes"][0]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("claimed for writing by allocation a1"))
        });
        let state = w.agent.state();
        assert_eq!(
            state["allocs"]["a2"]["volumes"]["data"]["phase"], "claiming",
            "{state:#}"
        );
        let claims = state["claims"].as_array().expect("claims");
        assert_eq!(claims.len(), 1, "{state:#}");
        assert_eq!(claims[0]["alloc_id"], "a1");
        assert!(is_mount_point(&host1));

        w.agent
            .cli(&["alloc", "release", "a1", "--wait", "30s"])
            .ok();
        let out = second.join().expect("the second mount").ok();
        let host2 = PathBuf::from(
            out.json()["volumes"][0]["host_path"]
                .as_str()
                .expect("host path"),
        );
        assert!(is_mount_point(&host2));
        assert!(!is_mount_point(&host1));
    });
    let state = w.agent.state();
    let claims = state["claims"].as_array().expect("claims");
    assert_eq!(claims.len(), 1, "{state:#}");
    assert_eq!(claims[0]["alloc_id"], "a2");
    assert_eq!(
        state["allocs"]["a2"]["volumes"]["data"]["phase"],
        "published"
    );
    assert_eq!(
        volume_methods(&w.plugin.call_log()),
        strings(&[CP, NS, NP, NUP, NUS, CUP, CP, NS, NP])
    );
}

// ---- configuration as plugins and operators write it ---------------------------

/// A plugin socket written as plugins and CSI tooling write it
/// (`unix:///abs`) is used as the socket at that path.
#[test]
fn a_unix_url_plugin_endpoint_is_used() {
    let w = World::new(|c| {
        let socket = c.plugins[0].2.clone();
        c.plugins[0].2 = PathBuf::from(format!("unix://{}", socket.display()));
    });
    w.register(&volume_json("v", "ext-v", &["single-node-writer"]));
    w.wait_plugin_ready();
    let out = w
        .agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=v", "--json"])
        .ok()
        .json();
    let host = PathBuf::from(out["volumes"][0]["host_path"].as_str().expect("path"));
    assert!(is_mount_point(&host));
    assert_eq!(volume_methods(&w.plugin.call_log()), strings(&[CP, NS, NP]));
}

/// `mount_retry_deadline` bounds how long a mount retries a retryable CSI
/// error; then the mount fails (DEADLINE_EXCEEDED, exit 1) and is rolled
/// back: nothing stays mounted or claimed.
#[test]
fn mount_retry_deadline_bounds_a_mount_that_keeps_failing() {
    let w = World::new(|c| c.mount_retry_deadline = Some("2s".into()));
    w.register(&volume_json("v", "ext-v", &["single-node-writer"]));
    w.wait_plugin_ready();
    w.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    let started = Instant::now();
    let out = w.agent.cli(&[
        "alloc",
        "mount",
        "a1",
        "--volume",
        "data=v",
        "--timeout",
        "60s",
    ]);
    let took = started.elapsed();
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("mount retry deadline"),
        "{}",
        out.stderr
    );
    assert!(
        took < Duration::from_secs(30),
        "the mount gave up after {took:?}, not near its 2s deadline"
    );
    let methods = volume_methods(&w.plugin.call_log());
    assert!(methods.len() > 3, "NodePublish was retried: {methods:?}");
    assert_eq!(
        &methods[methods.len() - 3..],
        &strings(&[NUP, NUS, CUP])[..]
    );
    assert_eq!(w.agent.state()["claims"], json!([]));
    assert_eq!(mounts_under(&w.mount_root()), Vec::new());
}

/// A volume whose plugin is neither configured nor in the plugin directory
/// is registered with a warning, `volume list` shows its plugin's health,
/// and a mount of it fails at once (not after `plugin_wait_timeout`),
/// naming the plugin; nothing is recorded.
#[test]
fn an_unknown_plugin_is_named_at_registration_and_fails_a_mount_at_once() {
    let w = World::new(|c| c.plugin_wait_timeout = "60s".into());
    w.wait_plugin_ready();
    let mut ghost = volume_json("g", "ext-g", &["single-node-writer"]);
    ghost["plugin_id"] = json!("ghost");
    let reg = w.agent.register(&ghost);
    assert!(
        reg.stderr
            .contains("claimd: warning: plugin ghost is neither configured"),
        "{}",
        reg.stderr
    );
    w.register(&volume_json("v", "ext-v", &["single-node-writer"]));
    let list = w.agent.cli(&["volume", "list", "--json"]).ok().json();
    let health = |id: &str| {
        list["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| v["id"] == id)
            .map(|v| v["plugin_health"].as_str().unwrap_or("").to_string())
            .expect("listed")
    };
    assert_eq!(health("v"), "ready");
    assert!(health("g").starts_with("not configured"), "{}", health("g"));
    let table = w.agent.cli(&["volume", "list"]).ok();
    assert!(table.stdout.contains("PLUGIN HEALTH"), "{}", table.stdout);

    let started = Instant::now();
    let out = w.agent.cli(&["alloc", "mount", "a1", "--volume", "data=g"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the mount waited for a plugin that cannot come"
    );
    assert!(
        out.stderr
            .contains("plugin ghost is neither configured nor in the plugin directory"),
        "{}",
        out.stderr
    );
    assert_eq!(w.agent.state()["allocs"], json!({}));
    assert_eq!(volume_methods(&w.plugin.call_log()), Vec::<String>::new());
}

/// A mount that fails and is rolled back leaves a clear entry in `alloc
/// status`: each volume named, with its plugin, path and phase `released`;
/// never empty fields. Progress lines during the mount's retries start
/// with `progress:`, errors with `claimd:`.
#[test]
fn a_failed_mount_leaves_a_clear_status_and_progress_is_not_an_error() {
    let w = World::new(|c| c.mount_retry_deadline = Some("3s".into()));
    w.register(&volume_json("v", "ext-v", &["single-node-writer"]));
    w.wait_plugin_ready();
    w.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    let out = w.agent.cli(&["alloc", "mount", "a1", "--volume", "data=v"]);
    assert_eq!(out.code, 1, "{out:?}");
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("progress: a1/data: ") && l.contains("(retrying)")),
        "{}",
        out.stderr
    );
    let errors: Vec<&&str> = lines.iter().filter(|l| l.starts_with("claimd: ")).collect();
    assert_eq!(errors.len(), 1, "one error line: {}", out.stderr);
    wait_until(Duration::from_secs(20), "the rollback to finish", || {
        w.agent.state()["allocs"] == json!({})
    });
    let st = w
        .agent
        .cli(&["alloc", "status", "a1", "--json"])
        .ok()
        .json();
    let v = &st["allocs"][0]["volumes"][0];
    for field in [
        "alias",
        "volume_id",
        "plugin_id",
        "phase",
        "host_path",
        "attachment_mode",
    ] {
        assert!(
            v[field].as_str().is_some_and(|s| !s.is_empty()),
            "field {field} is empty: {st}"
        );
    }
    assert_eq!(v["volume_id"], "v");
    assert_eq!(v["plugin_id"], PLUGIN_ID);
    assert_eq!(v["phase"], "released");
}

// ---- claims by hand ---------------------------------------------------------

/// `claim list` shows who holds what; `claim free` frees a claim no agent
/// will release (here: one whose allocation record was lost), with a
/// reason, and refuses one an allocation on this node still records.
#[test]
fn a_claim_left_behind_is_listed_and_freed_by_hand() {
    let mut w = World::new(|_| {});
    w.register(&volume_json("v", "ext-v", &["single-node-writer"]));
    w.wait_plugin_ready();
    w.agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=v"])
        .ok();
    let list = w.agent.cli(&["claim", "list", "--json"]).ok().json();
    assert_eq!(list["claims"][0]["volume_id"], "v", "{list}");
    assert_eq!(list["claims"][0]["alloc_id"], "a1");
    assert_eq!(list["claims"][0]["node"], NODE_NAME);
    assert_eq!(list["claims"][0]["state"], "taken");
    // Recorded here: release it instead.
    let out = w
        .agent
        .cli(&["claim", "free", "v", "a1", "--reason", "testing"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("claimd alloc release a1"),
        "{}",
        out.stderr
    );
    // Lose the allocation's record (as a state directory restored from an
    // old backup would), keeping the claim.
    w.agent
        .cli(&["alloc", "release", "a1", "--wait", "30s"])
        .ok();
    w.agent
        .cli(&["alloc", "mount", "a2", "--volume", "data=v"])
        .ok();
    w.agent.terminate(Duration::from_secs(30));
    let state_dir = w.agent.config.state_dir.clone();
    {
        let store = claimd::state::StateStore::open(&state_dir).expect("open the state");
        store
            .update::<_, claimd::state::StateError>(|s| {
                s.allocs.clear();
                Ok(())
            })
            .expect("drop the record");
    }
    // The mount stays; an administrator unmounts it by hand.
    for m in mounts_under(&w.mount_root()) {
        let c = std::ffi::CString::new(m.mount_point.to_str().expect("utf-8")).expect("path");
        // SAFETY: umount2 on a path we own, as an administrator would.
        assert_eq!(unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) }, 0);
    }
    w.agent.restart();
    let list = w.agent.cli(&["claim", "list", "--volume", "v"]).ok();
    assert!(list.stdout.contains("a2"), "{}", list.stdout);
    let out = w.agent.cli(&["claim", "free", "v", "a2"]);
    assert_eq!(out.code, 2, "a reason is required: {out:?}");
    let out = w
        .agent
        .cli(&[
            "claim",
            "free",
            "v",
            "a2",
            "--reason",
            "record lost in a restore",
        ])
        .ok();
    assert!(out.stdout.contains("freed"), "{}", out.stdout);
    assert!(
        w.agent
            .log()
            .contains("freed by hand: record lost in a restore"),
        "the reason is logged"
    );
    assert_eq!(
        w.agent.cli(&["claim", "list", "--json"]).ok().json()["claims"],
        json!([])
    );
    // The volume can be claimed again.
    w.agent
        .cli(&["alloc", "mount", "a3", "--volume", "data=v"])
        .ok();
    let out = w
        .agent
        .cli(&["claim", "free", "v", "nobody", "--reason", "x"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("holds no claim"), "{}", out.stderr);
}
