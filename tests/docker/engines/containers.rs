//! Containers of real Docker and Podman engines on claimd volumes: data
//! through the mount, shared volumes, the agent killed under a writer, bad
//! options, the plugin protocol, held claims, engine death, cluster mode.

use super::*;

#[test]
fn a_container_writes_through_a_claimd_volume_and_a_second_one_reads_it_back() {
    let w = World::new("rw");
    let d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&[], "db")).ok();
    let vols = w.volumes();
    assert_eq!(vols.len(), 1, "{vols:?}");
    assert_eq!(
        (&vols[0]["id"], &vols[0]["external_id"]),
        (&json!("db"), &json!("ext-db"))
    );
    assert!(w.calls().is_empty(), "Create makes no CSI call");

    d.run_with(&w.driver, "db", "echo hello > /data/greeting")
        .ok();
    let out = d.run_with(&w.driver, "db", "cat /data/greeting").ok();
    assert_eq!(out.stdout.trim(), "hello");
    assert_eq!(
        fs::read_to_string(w.file("greeting")).expect("the file is in the volume"),
        "hello\n"
    );
    // Each container is its own allocation: claimed, attached, staged and
    // published, then all of it undone at its Unmount.
    let calls = w.wait_calls(12, "both containers' Unmount");
    let want: Vec<&str> = ONE_CONTAINER
        .iter()
        .chain(&ONE_CONTAINER)
        .copied()
        .collect();
    assert_eq!(calls, want);
    assert!(w.claims().is_empty(), "{:?}", w.claims());
    assert!(w.agent.state_allocs().is_empty());
}

#[test]
fn two_containers_share_one_volume_on_one_node_with_one_staging() {
    let w = World::new("share");
    let d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&["--opt", "access_modes=single-node-multi-writer"], "db"))
        .ok();
    d.start_container(
        "c1",
        &w.driver,
        "db",
        "echo one > /data/one; exec sleep 1000",
    )
    .ok();
    d.start_container(
        "c2",
        &w.driver,
        "db",
        "echo two > /data/two; exec sleep 1000",
    )
    .ok();
    wait_until(CLEANUP_TIMEOUT, "both containers' files", || {
        w.file("one").exists() && w.file("two").exists()
    });
    assert_eq!(w.calls(), [CP, NS, NP, NP], "one attachment, one staging");
    let claims = w.claims();
    assert_eq!(claims.len(), 2, "one claim per container: {claims:?}");
    assert!(claims.iter().all(|c| c["alloc_id"]
        .as_str()
        .is_some_and(|a| a.starts_with("docker-") && a.ends_with("-db"))));
    // `docker volume inspect` shows this node's mounts.
    let status = d.docker(&["volume", "inspect", "db", "--format", "{{json .Status}}"]);
    let status: Value = serde_json::from_str(status.ok().stdout.trim()).expect("JSON status");
    assert_eq!(status["registered_by"], "engine", "{status}");
    assert_eq!(
        status["mounts"].as_array().map(Vec::len),
        Some(2),
        "{status}"
    );
    assert_eq!(status["plugin_id"], "testplug");

    // In use: docker refuses the removal, and nothing changes.
    let out = d.docker(&["volume", "rm", "db"]).failed();
    assert!(out.text().contains("in use"), "{}", out.text());
    assert_eq!(w.volumes().len(), 1);

    d.docker(&["rm", "-f", "c1"]).ok();
    let calls = w.wait_calls(5, "c1's Unmount");
    assert_eq!(calls, [CP, NS, NP, NP, NUP], "the staging stays for c2");
    d.docker(&["rm", "-f", "c2"]).ok();
    let calls = w.wait_calls(7, "c2's Unmount");
    assert_eq!(calls, [CP, NS, NP, NP, NUP, NUP, NUS, CUP]);
    assert!(w.claims().is_empty());
    d.docker(&["volume", "rm", "db"]).ok();
    assert!(w.volumes().is_empty(), "Remove deregisters");
}

#[test]
fn the_agent_killed_and_restarted_while_a_container_writes_costs_no_csi_call() {
    let mut w = World::new("restart");
    let d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&[], "db")).ok();
    d.start_container(
        "writer",
        &w.driver,
        "db",
        "i=0; while true; do i=$((i+1)); echo $i >> /data/log; sleep 0.05; done",
    )
    .ok();
    let log = w.file("log");
    let lines = || {
        fs::read_to_string(&log)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    wait_until(CLEANUP_TIMEOUT, "the container to write", || lines() >= 5);
    let before = w.calls();
    assert_eq!(before, [CP, NS, NP]);

    w.agent.kill();
    w.agent.spawn();
    w.agent.wait_listening();
    let at_restart = lines();
    wait_until(
        Duration::from_secs(30),
        "the container to keep writing after the restart",
        || lines() >= at_restart + 10,
    );
    assert_eq!(w.calls(), before, "no CSI volume call at the restart");
    assert_eq!(w.claims().len(), 1);

    // The restarted agent serves the container's Unmount.
    d.docker(&["rm", "-f", "writer"]).ok();
    let calls = w.wait_calls(6, "the writer's Unmount");
    assert_eq!(calls, ONE_CONTAINER);
    assert!(w.claims().is_empty());
}

#[test]
fn bad_options_and_unknown_names_give_clear_errors_and_change_nothing() {
    let w = World::new("bad");
    let d = Dockerd::start(w.dir.path());
    let cases: &[(&[&str], &str)] = &[
        (&["--opt", "bogus=1"], "unknown option \"bogus\""),
        (
            &["--opt", "secret.token=hunter2"],
            "secrets never go in options",
        ),
        (
            &["--opt", "access_modes=sometimes"],
            "unknown variant `sometimes`",
        ),
        (
            &["--opt", "secrets_file=/etc/passwd"],
            "must be owned by root and readable by no one else",
        ),
        (
            &["--opt", "size=1G"],
            "external_id and size do not go together",
        ),
    ];
    for (more, needle) in cases {
        let out = d.docker(&w.create_args(more, "bad")).failed();
        let text = out.text();
        assert!(
            text.contains("VolumeDriver.Create") && text.contains(needle),
            "{more:?}: {text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
    }
    let out = d
        .docker(&[
            "volume",
            "create",
            "--driver",
            &w.driver,
            "--opt",
            "external_id=x",
            "bad",
        ])
        .failed();
    assert!(
        out.text().contains("plugin_id: is required"),
        "{}",
        out.text()
    );
    let out = d.run_with(&w.driver, "nosuch", "true").failed();
    assert!(
        out.text()
            .contains("volume nosuch is not registered with claimd"),
        "{}",
        out.text()
    );
    // Nothing changed anywhere.
    assert!(w.volumes().is_empty(), "{:?}", w.volumes());
    assert!(w.claims().is_empty());
    assert!(w.calls().is_empty());
    // (Docker lists every driver in its plugin directory: other tests' too.)
    let mine = format!("driver={}", w.driver);
    let listed = d.docker(&["volume", "ls", "-q", "--filter", &mine]).ok();
    assert_eq!(listed.stdout.trim(), "");

    // A name claimd knows already: Docker finds it through Get and uses
    // it as registered, without a Create (so its options are not
    // compared; Podman sends the Create, see the Podman test).
    w.agent
        .register(&volume_json("db", "ext-db", &["single-node-writer"]));
    d.docker(&w.create_args(&[], "db")).ok();

    // Remove is refused while an allocation holds the volume.
    w.agent
        .cli(&["alloc", "mount", "web-1", "--volume", "data=db"])
        .ok();
    let out = d.docker(&["volume", "rm", "db"]).failed();
    assert!(
        out.text()
            .contains("volume db is in use by allocation web-1"),
        "{}",
        out.text()
    );
    assert_eq!(w.volumes().len(), 1);
    w.agent
        .cli(&["alloc", "release", "web-1", "--wait", "30s"])
        .ok();
    // Registered with the CLI: Docker forgets it, claimd keeps it.
    d.docker(&["volume", "rm", "db"]).ok();
    assert_eq!(w.volumes().len(), 1);
    assert!(w.agent.log().contains(
        "volume db: an engine's Remove leaves it registered: it was registered with the claimd CLI or API"
    ));
}

#[test]
fn podman_mounts_writes_reads_back_and_removes_through_the_same_plugin() {
    let w = World::new("podman");
    let p = Podman::new(w.dir.path(), &w.driver, &w.socket());
    p.podman(&w.create_args(&[], "db")).ok();
    assert_eq!(w.volumes().len(), 1);
    p.run_with("db", "echo from-podman > /data/f").ok();
    let out = p.run_with("db", "cat /data/f").ok();
    assert_eq!(out.stdout.trim(), "from-podman");
    let calls = w.wait_calls(12, "both containers' Unmount");
    let want: Vec<&str> = ONE_CONTAINER
        .iter()
        .chain(&ONE_CONTAINER)
        .copied()
        .collect();
    assert_eq!(calls, want);
    assert!(w.claims().is_empty());

    let out = p
        .podman(&w.create_args(&["--opt", "bogus=1"], "bad"))
        .failed();
    assert!(
        out.text().contains("unknown option \"bogus\""),
        "{}",
        out.text()
    );
    p.podman(&["volume", "rm", "db"]).ok();
    assert!(w.volumes().is_empty(), "Remove deregisters");
}

#[test]
fn the_protocol_answers_as_the_engines_expect_and_mount_and_unmount_are_idempotent() {
    let w = World::new("proto");
    let sock = w.socket();
    let ok = |path: &str, body: Value| {
        let (code, answer) = post(&sock, path, &body);
        assert_eq!(code, 200, "{path} {body}: {answer}");
        assert!(answer.get("Err").is_none(), "{path}: {answer}");
        answer
    };
    let err = |path: &str, body: Value| {
        let (code, answer) = post(&sock, path, &body);
        assert_eq!(code, 500, "{path} {body}: {answer}");
        answer["Err"].as_str().expect("an Err").to_string()
    };
    assert_eq!(
        ok("/Plugin.Activate", json!({})),
        json!({"Implements": ["VolumeDriver"]})
    );
    assert_eq!(
        ok("/VolumeDriver.Capabilities", json!({})),
        json!({"Capabilities": {"Scope": "local"}})
    );
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    ok("/VolumeDriver.Create", json!({"Name": "db", "Opts": def}));
    // The same again (two engines racing to create it) succeeds; another
    // definition is refused naming the difference.
    ok("/VolumeDriver.Create", json!({"Name": "db", "Opts": def}));
    let e = err(
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": {"plugin_id": "testplug", "external_id": "ext-other",
                                       "access_modes": "single-node-multi-writer"}}),
    );
    assert_eq!(
        e,
        "volume db is registered with another definition: access_modes is single-node-writer there, not single-node-multi-writer; external_id is ext-db there, not ext-other"
    );
    ok("/VolumeDriver.Create", json!({"Name": "db", "Opts": null}));
    assert!(err("/VolumeDriver.Get", json!({"Name": "nosuch"})).contains("not registered"));
    assert!(err("/VolumeDriver.Bogus", json!({})).contains("not an endpoint"));

    // Mount twice with one ID: one allocation counted twice, one path,
    // one NodePublish.
    let id = "0123456789abcdef".repeat(4);
    let alloc = format!("docker-{id}-db");
    let m1 = ok("/VolumeDriver.Mount", json!({"Name": "db", "ID": id}));
    let m2 = ok("/VolumeDriver.Mount", json!({"Name": "db", "ID": id}));
    assert_eq!(m1, m2);
    let path = m1["Mountpoint"].as_str().expect("a mountpoint").to_string();
    assert!(is_mount_point(std::path::Path::new(&path)), "{path}");
    assert_eq!(w.calls(), [CP, NS, NP]);
    assert_eq!(w.agent.state_allocs()[&alloc]["references"], 2);
    assert_eq!(
        ok("/VolumeDriver.Path", json!({"Name": "db"}))["Mountpoint"],
        path.as_str()
    );
    let got = ok("/VolumeDriver.Get", json!({"Name": "db"}));
    assert_eq!(got["Volume"]["Mountpoint"], path.as_str());
    assert_eq!(
        got["Volume"]["Status"]["mounts"][0]["mount_id"],
        id.as_str()
    );
    assert_eq!(got["Volume"]["Status"]["mounts"][0]["references"], 2);
    let list = ok("/VolumeDriver.List", json!({}));
    assert_eq!(list["Volumes"][0]["Name"], "db");
    // Remove is refused while claimed, naming the holder.
    let e = err("/VolumeDriver.Remove", json!({"Name": "db"}));
    assert!(
        e.contains(&format!("volume db is in use by allocation docker-{id}-db")),
        "{e}"
    );
    // A mount ID that is not letters and digits reaches no path.
    let e = err(
        "/VolumeDriver.Mount",
        json!({"Name": "db", "ID": "../../etc"}),
    );
    assert!(e.contains("may only contain letters and digits"), "{e}");

    // The local API leaves the engines' allocations to them.
    let out = w
        .agent
        .cli(&["alloc", "mount", "docker-x", "--volume", "data=db"])
        .expect_code(EXIT_USAGE);
    assert!(
        out.stderr.contains(
            "starts with docker-, which is reserved for the mounts of Docker and Podman containers"
        ),
        "{}",
        out.stderr
    );

    // Unmount: one reference fewer, the mount stays; the last one releases
    // the ID's allocation; again, or an unknown ID, succeeds and calls
    // nothing.
    ok("/VolumeDriver.Unmount", json!({"Name": "db", "ID": id}));
    assert_eq!(w.calls(), [CP, NS, NP]);
    assert!(is_mount_point(std::path::Path::new(&path)), "{path}");
    assert!(w.agent.state_allocs()[&alloc].get("references").is_none());
    ok("/VolumeDriver.Unmount", json!({"Name": "db", "ID": id}));
    assert_eq!(w.calls(), ONE_CONTAINER);
    ok("/VolumeDriver.Unmount", json!({"Name": "db", "ID": id}));
    ok(
        "/VolumeDriver.Unmount",
        json!({"Name": "db", "ID": "feed".repeat(16)}),
    );
    assert_eq!(w.calls(), ONE_CONTAINER);
    assert!(!is_mount_point(std::path::Path::new(&path)));
    assert_eq!(
        ok("/VolumeDriver.Path", json!({"Name": "db"}))["Mountpoint"],
        ""
    );
    ok("/VolumeDriver.Remove", json!({"Name": "db"}));
    assert!(w.volumes().is_empty());
}

#[test]
fn a_container_start_waiting_for_a_held_claim_fails_naming_the_holder_and_leaves_nothing() {
    let w = World::with("held", json!({"mount_timeout": "2s"}));
    let d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&[], "db")).ok();
    w.agent
        .cli(&["alloc", "mount", "web-1", "--volume", "data=db"])
        .ok();
    let out = d.run_with(&w.driver, "db", "true").failed();
    assert!(
        out.text().contains(
            "volume db was not mounted within 2s: volume db is claimed for writing by allocation web-1 on node node-1"
        ),
        "{}",
        out.text()
    );
    // The mount given up holds nothing.
    wait_until(CLEANUP_TIMEOUT, "the given-up mount to be gone", || {
        w.agent.state_allocs().len() == 1
    });
    let claims = w.claims();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0]["alloc_id"], "web-1");
    w.agent
        .cli(&["alloc", "release", "web-1", "--wait", "30s"])
        .ok();
    d.run_with(&w.driver, "db", "echo mine > /data/f").ok();
    assert_eq!(fs::read_to_string(w.file("f")).expect("written"), "mine\n");
}

#[test]
fn an_engine_killed_without_unmount_has_its_claim_released_once_no_container_uses_it() {
    let w = World::with(
        "dead",
        json!({"unused_check_interval": "2s", "engine_mount_timeout": "1s"}),
    );
    let mut d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&[], "db")).ok();
    d.start_container("c0", &w.driver, "db", "echo up > /data/up; exec sleep 1000")
        .ok();
    wait_until(CLEANUP_TIMEOUT, "the container to start", || {
        w.file("up").exists()
    });
    let pid: u32 = d
        .docker(&["inspect", "-f", "{{.State.Pid}}", "c0"])
        .ok()
        .stdout
        .trim()
        .parse()
        .expect("the container's pid");
    // Not before: while the container runs, checks pass and keep it.
    let rounds = |w: &World| w.agent.log().matches("1 in use by a container").count();
    wait_until(Duration::from_secs(30), "three checks", || rounds(&w) >= 3);
    assert_eq!(w.calls(), [CP, NS, NP]);
    assert_eq!(w.claims().len(), 1);

    // The engine dies and takes its container with it: no Unmount comes.
    d.kill_daemon();
    send_signal(pid, libc::SIGKILL);
    let calls = w.wait_calls(6, "the unused mount to be released");
    assert_eq!(calls, ONE_CONTAINER);
    assert!(w.claims().is_empty());
    assert!(w
        .agent
        .log()
        .contains("no container uses the mount of allocation docker-"));
}

#[test]
fn cluster_mode_a_second_nodes_container_fails_naming_the_holder_then_starts_once_it_stops() {
    let etcd = Etcd::start();
    let dir = TestDir::new();
    let endpoints = vec![etcd.endpoint()];
    let n1 = DockerNode::start(dir.path(), "n1", &endpoints);
    let n2 = DockerNode::start(dir.path(), "n2", &endpoints);
    n1.docker
        .docker(&[
            "volume",
            "create",
            "--driver",
            &n1.driver,
            "--opt",
            "plugin_id=testplug",
            "--opt",
            "external_id=ext-db",
            "--opt",
            "access_modes=multi-node-single-writer",
            "db",
        ])
        .ok();
    let scope = n1
        .docker
        .docker(&["volume", "inspect", "db", "--format", "{{.Scope}}"])
        .ok();
    assert_eq!(scope.stdout.trim(), "global");
    n1.docker
        .start_container("c1", &n1.driver, "db", "echo n1 > /data/f; exec sleep 1000")
        .ok();
    wait_until(CLEANUP_TIMEOUT, "n1's container", || {
        n1.plugin.volume_dir("ext-db").join("f").exists()
    });

    // n2 knows the volume from the cluster's registrations (no options),
    // and its container cannot start while n1's writes.
    let out = n2.docker.run_with(&n2.driver, "db", "true").failed();
    let text = out.text();
    assert!(
        text.contains("volume db was not mounted within 3s: volume db is claimed for writing by allocation docker-")
            && text.contains("on node n1"),
        "{text}"
    );
    assert_eq!(n2.claims().len(), 1, "only n1's claim: {:?}", n2.claims());
    assert!(volume_methods(&n2.plugin.call_log()).is_empty());

    n1.docker.docker(&["rm", "-f", "c1"]).ok();
    wait_until(CLEANUP_TIMEOUT, "n1's claim to be freed", || {
        n2.claims().is_empty()
    });
    n2.docker
        .run_with(&n2.driver, "db", "echo n2 > /data/f")
        .ok();
    assert_eq!(
        fs::read_to_string(n2.plugin.volume_dir("ext-db").join("f")).expect("written on n2"),
        "n2\n"
    );
    wait_until(CLEANUP_TIMEOUT, "n2's claim to be freed", || {
        n2.claims().is_empty()
    });
}

#[test]
fn a_volume_with_only_reader_modes_is_claimed_and_published_read_only() {
    let w = World::new("ro");
    let d = Dockerd::start(w.dir.path());
    fs::write(w.file("seed"), "seeded\n").expect("seed the volume");
    d.docker(&w.create_args(&["--opt", "access_modes=multi-node-reader-only"], "ro"))
        .ok();
    let out = d
        .run_with(&w.driver, "ro", "cat /data/seed; echo x > /data/new")
        .failed();
    assert!(out.stdout.contains("seeded"), "{}", out.text());
    assert!(
        out.text().contains("Read-only file system"),
        "{}",
        out.text()
    );
    assert!(!w.file("new").exists());
    let calls = w.wait_calls(6, "the container's Unmount");
    assert_eq!(calls, ONE_CONTAINER);
    let publish = w.plugin.call_log().calls_of(NP);
    assert_eq!(publish[0]["readonly"], true, "{publish:?}");
}

#[test]
fn a_volume_without_external_id_is_created_through_the_controller_with_secrets_from_a_file() {
    use std::os::unix::fs::PermissionsExt;
    let w = World::new("create");
    let d = Dockerd::start(w.dir.path());
    let secrets = w.dir.path().join("secrets.json");
    fs::write(&secrets, r#"{"token": "t0ken-s3cret"}"#).expect("write the secrets");
    fs::set_permissions(&secrets, fs::Permissions::from_mode(0o600)).expect("chmod 0600");
    let file_opt = format!("secrets_file={}", secrets.display());
    d.docker(&[
        "volume",
        "create",
        "--driver",
        &w.driver,
        "--opt",
        "plugin_id=testplug",
        "--opt",
        "size=1M",
        "--opt",
        "parameters.tier=fast",
        "--opt",
        &file_opt,
        "fresh",
    ])
    .ok();
    let creates = w.plugin.call_log().calls_of("CreateVolume");
    assert_eq!(creates.len(), 1, "{creates:?}");
    assert_eq!(creates[0]["required_bytes"], 1_048_576);
    assert_eq!(creates[0]["secret_keys"], json!(["token"]));
    let vols = w.volumes();
    assert_eq!(vols[0]["id"], "fresh");
    assert_eq!(vols[0]["capacity_bytes"], 1_048_576);
    assert_eq!(vols[0]["secret_keys"], json!(["token"]));
    // The options Docker shows name the file, never the secret.
    let inspect = d.docker(&["volume", "inspect", "fresh"]).ok();
    assert!(!inspect.stdout.contains("s3cret"), "{}", inspect.stdout);

    d.run_with(&w.driver, "fresh", "echo new > /data/f").ok();
    let f = w.plugin.volume_dir("fresh").join("f");
    assert_eq!(fs::read_to_string(&f).expect("written"), "new\n");
    // Remove deregisters; deleting the storage stays `claimd volume delete`.
    let calls = w.wait_calls(7, "the container's Unmount");
    assert_eq!(calls[0], "CreateVolume");
    assert_eq!(calls[1..], ONE_CONTAINER);
    d.docker(&["volume", "rm", "fresh"]).ok();
    assert!(w.volumes().is_empty());
    assert!(w.plugin.call_log().calls_of("DeleteVolume").is_empty());
    assert!(f.exists());
}
