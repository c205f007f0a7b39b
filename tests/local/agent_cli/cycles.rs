//! The agent binary and its CLI end to end: whole cycles, many allocations
//! at once, late plugins, SIGTERM during a stuck release, dev mode.

use super::*;

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
