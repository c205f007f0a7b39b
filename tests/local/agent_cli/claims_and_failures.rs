//! Block volumes, held claims, plugin endpoints, mount deadlines, unknown
//! plugins, failed mounts and claims freed by hand.

use super::*;

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
