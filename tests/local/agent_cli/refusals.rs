//! Bad input, the private API socket, a second agent, secrets, client
//! deadlines and an invalid configuration.

use super::*;

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
