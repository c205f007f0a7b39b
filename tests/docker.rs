//! The Docker volume plugin protocol with the real engines: a dockerd (and
//! Podman) that each test starts with its own data and run directories, a
//! busybox image made with `import`, the real agent beside the real test
//! plugin, real mounts. Each test serves its own driver name (Docker finds
//! plugins at the fixed path `/run/docker/plugins/NAME.sock`).
//!
//! The engines come from Debian's packages (`docker.io`, `podman`, `runc`,
//! `busybox-static`), installed when missing.

mod agent_support;
mod common;
mod docker_support;
mod etcd_support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use agent_support::*;
use common::*;
use docker_support::*;
use etcd_support::Etcd;
use serde_json::{json, Value};

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

#[test]
fn docker_cp_and_export_of_a_running_container_keep_its_mount_claim_and_data() {
    let w = World::with("cp", json!({"mount_timeout": "2s"}));
    let d = Dockerd::start(w.dir.path());
    d.docker(&w.create_args(&[], "db")).ok();
    d.start_container(
        "writer",
        &w.driver,
        "db",
        "echo before > /data/before; i=0; while true; do i=$((i+1)); echo $i >> /data/log; sleep 0.05; done",
    )
    .ok();
    let lines = || {
        fs::read_to_string(w.file("log"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    wait_until(CLEANUP_TIMEOUT, "the container to write", || lines() >= 5);
    assert_eq!(w.calls(), [CP, NS, NP]);
    let allocs = w.agent.state_allocs();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let alloc = allocs.keys().next().expect("one").clone();
    let target = target_of(&w, &alloc);
    assert!(is_mount_point(&target), "{}", target.display());

    // Docker mounts the running container's volumes again, with the
    // container's own mount ID, around each copy, and unmounts them after.
    let host = w.dir.path().join("host");
    fs::create_dir_all(&host).expect("a host directory");
    for round in 1..=2 {
        let src = host.join(format!("in{round}"));
        fs::write(&src, format!("copied in {round}\n")).expect("a file to copy");
        let dest = format!("writer:/data/in{round}");
        d.docker(&["cp", src.to_str().expect("UTF-8"), &dest]).ok();
        let out = host.join(format!("out{round}"));
        d.docker(&["cp", "writer:/data/before", out.to_str().expect("UTF-8")])
            .ok();
        assert_eq!(fs::read_to_string(&out).expect("copied out"), "before\n");
        assert_eq!(
            fs::read_to_string(w.file(&format!("in{round}"))).expect("copied in"),
            format!("copied in {round}\n")
        );
    }
    let tar = host.join("export.tar");
    d.docker(&["export", "-o", tar.to_str().expect("UTF-8"), "writer"])
        .ok();
    assert!(tar.metadata().is_ok_and(|m| m.len() > 0));

    // Every Mount was counted and every Unmount undid one: no CSI call,
    // the allocation and its claim stay, the mount too.
    let log = w.agent.log();
    let (again, once) = (
        log.matches("mounted again").count(),
        log.matches("unmounted once").count(),
    );
    assert!(again >= 4, "one Mount per copy at least: {again}\n{log}");
    assert_eq!(again, once, "as many Unmounts as Mounts");
    assert_eq!(w.calls(), [CP, NS, NP], "no CSI call");
    let allocs = w.agent.state_allocs();
    assert_eq!(allocs.keys().collect::<Vec<_>>(), [&alloc]);
    assert!(allocs[&alloc].get("references").is_none(), "back to one");
    assert!(allocs[&alloc]["releasing"] != true);
    assert!(is_mount_point(&target));
    assert_eq!(w.claims().len(), 1);
    let at = lines();
    wait_until(CLEANUP_TIMEOUT, "the container to keep writing", || {
        lines() >= at + 10
    });

    // The single-node-writer volume still admits no second writer.
    let out = d.run_with(&w.driver, "db", "true").failed();
    assert!(
        out.text().contains(&format!(
            "volume db was not mounted within 2s: volume db is claimed for writing by allocation {alloc}"
        )),
        "{}",
        out.text()
    );
    assert_eq!(w.calls(), [CP, NS, NP]);

    // The container's own stop releases it; every file written stays.
    d.docker(&["rm", "-f", "writer"]).ok();
    let calls = w.wait_calls(6, "the writer's Unmount");
    assert_eq!(calls, ONE_CONTAINER);
    assert!(w.claims().is_empty());
    assert!(w.agent.state_allocs().is_empty());
    assert_eq!(
        fs::read_to_string(w.file("before")).expect("kept"),
        "before\n"
    );
    for round in 1..=2 {
        assert!(w.file(&format!("in{round}")).exists());
    }
    assert!(lines() >= at + 10);
}

/// Podman's one mount ID for every mount (libpod's `pseudoCtrID`).
const PODMAN_MOUNT_ID: &str = "2f73349cfc4630255319c6c8dfc1b46a8996ace9d14d8e07563b165915918ec2";

#[test]
fn podman_containers_of_one_volume_share_one_allocation_released_after_the_last_one_stops() {
    let w = World::new("podshare");
    let p = Podman::new(w.dir.path(), &w.driver, &w.socket());
    p.podman(&w.create_args(&[], "db")).ok();
    let alloc = format!("docker-{PODMAN_MOUNT_ID}-db");
    // The first container out first, then the second out first.
    for (round, order) in [["p1", "p2"], ["p2", "p1"]].iter().enumerate() {
        let before = w.calls().len();
        for name in ["p1", "p2"] {
            let script = format!("echo {name} > /data/{name}-{round}; exec sleep 1000");
            p.start_container(name, "db", &script).ok();
        }
        wait_until(CLEANUP_TIMEOUT, "both containers' files", || {
            ["p1", "p2"]
                .iter()
                .all(|n| w.file(&format!("{n}-{round}")).exists())
        });
        // Podman counts its containers itself and sends one Mount, with
        // its one ID: one allocation, so a single-node-writer volume is
        // written by both containers of this node.
        assert_eq!(w.calls()[before..], [CP, NS, NP], "round {round}");
        let allocs = w.agent.state_allocs();
        assert_eq!(allocs.keys().collect::<Vec<_>>(), [&alloc]);
        assert!(allocs[&alloc].get("references").is_none());
        assert_eq!(w.claims().len(), 1);
        let target = target_of(&w, &alloc);

        p.podman(&["rm", "-f", order[0]]).ok();
        assert_eq!(
            w.calls()[before..],
            [CP, NS, NP],
            "{} out first: nothing released",
            order[0]
        );
        assert!(is_mount_point(&target));
        assert_eq!(w.claims().len(), 1);
        p.podman(&["rm", "-f", order[1]]).ok();
        let calls = w.wait_calls(before + 6, "the last container's Unmount");
        assert_eq!(calls[before..], ONE_CONTAINER, "round {round}");
        assert!(!is_mount_point(&target));
        assert!(w.claims().is_empty());
        assert!(w.agent.state_allocs().is_empty());
    }
}

#[test]
fn an_engine_mounts_count_survives_a_restart_of_the_agent_between_mount_and_unmount() {
    let mut w = World::new("refrestart");
    let sock = w.socket();
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    let id = "a1b2c3d4".repeat(8);
    let alloc = format!("docker-{id}-db");
    let mount = json!({"Name": "db", "ID": id});
    let m = plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    let path = PathBuf::from(m["Mountpoint"].as_str().expect("a mountpoint"));
    assert_eq!(w.calls(), [CP, NS, NP]);

    // Killed as soon as the second Mount is answered: its count was
    // durable before the answer.
    w.agent.kill_now();
    assert_eq!(w.agent.state_allocs()[&alloc]["references"], 2);
    w.agent.spawn();
    w.agent.wait_listening();
    wait_until(Duration::from_secs(30), "the plugin socket", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    });
    assert_eq!(w.agent.state_allocs()[&alloc]["references"], 2);

    // The first Unmount leaves one reference: nothing released.
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount.clone());
    assert_eq!(w.calls(), [CP, NS, NP], "no call at the restart either");
    assert!(is_mount_point(&path), "{}", path.display());
    assert!(w.agent.state_allocs()[&alloc].get("references").is_none());
    assert_eq!(w.claims().len(), 1);
    // The second releases.
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount);
    assert_eq!(w.calls(), ONE_CONTAINER);
    assert!(!is_mount_point(&path));
    assert!(w.claims().is_empty());
}

#[test]
fn an_engine_mount_counted_twice_that_no_container_uses_is_released_with_every_reference() {
    let w = World::with(
        "deadref",
        json!({"unused_check_interval": "1s", "engine_mount_timeout": "1s"}),
    );
    let sock = w.socket();
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    let mount = json!({"Name": "db", "ID": "feed".repeat(16)});
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    // No container holds it (only this test asked): the engine is taken
    // for dead, and both references go with the release.
    let calls = w.wait_calls(6, "the rule to release the unused mount");
    assert_eq!(calls, ONE_CONTAINER);
    assert!(
        w.agent
            .log()
            .contains("releasing it with its 2 reference(s)"),
        "{}",
        w.agent.log()
    );
    assert!(w.claims().is_empty());
    // The engine's late Unmounts find nothing and change nothing.
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount.clone());
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount);
    assert_eq!(w.calls(), ONE_CONTAINER);
    assert!(w.agent.state_allocs().is_empty());
}

#[test]
fn after_a_reboot_the_engines_restored_mounts_count_no_reference_so_their_first_unmount_releases() {
    let mut w = World::new("reboot");
    let sock = w.socket();
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    // Podman's one ID: its containers' Mount before the reboot, counted
    // twice (a retried Mount, say).
    let alloc = format!("docker-{PODMAN_MOUNT_ID}-db");
    let mount = json!({"Name": "db", "ID": PODMAN_MOUNT_ID});
    let m = plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    let path = PathBuf::from(m["Mountpoint"].as_str().expect("a mountpoint"));
    assert_eq!(w.agent.state_allocs()[&alloc]["references"], 2);

    // The reboot: the agent stopped (its state in the snapshot), the
    // plugin and every mount gone, the state written during another boot.
    w.agent.terminate(Duration::from_secs(20));
    let mut mounted = mounts_under(w.dir.path());
    mounted.reverse();
    for m in mounted {
        let out = std::process::Command::new("umount")
            .arg(&m.mount_point)
            .output()
            .expect("run umount");
        assert!(out.status.success(), "umount {:?}: {out:?}", m.mount_point);
    }
    assert!(!is_mount_point(&path));
    w.plugin.restart();
    let state_file = w.agent.state_path();
    let mut state: Value =
        serde_json::from_slice(&fs::read(&state_file).expect("the snapshot")).expect("JSON");
    state["boot_id"] = json!("an-earlier-boot");
    fs::write(&state_file, state.to_string()).expect("write the snapshot");
    w.agent.spawn();
    w.agent.wait_listening();
    wait_until(Duration::from_secs(30), "the plugin socket", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    });
    assert!(is_mount_point(&path), "restored");
    assert_eq!(w.calls(), [CP, NS, NP, NS, NP]);
    assert_eq!(w.agent.state_allocs()[&alloc]["references"], 0);
    assert!(w
        .agent
        .log()
        .contains("the node rebooted: 1 engine mount(s) restored with no reference"));

    // Podman, rebooted too, counts from nothing: its first container's
    // Mount is the one reference, its last container's Unmount releases.
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    assert!(w.agent.state_allocs()[&alloc].get("references").is_none());
    assert_eq!(w.calls(), [CP, NS, NP, NS, NP]);
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount);
    assert_eq!(w.calls(), [CP, NS, NP, NS, NP, NUP, NUS, CUP]);
    assert!(!is_mount_point(&path));
    assert!(w.claims().is_empty());
}

#[test]
fn the_engine_death_rule_keeps_a_mount_whose_subdirectory_or_whose_data_in_the_hosts_namespace_is_in_use(
) {
    let w = World::with(
        "subdir",
        // Old enough for the rule only once the first namespace holds it.
        json!({"unused_check_interval": "1s", "engine_mount_timeout": "10s"}),
    );
    let sock = w.socket();
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    let mount = json!({"Name": "db", "ID": "5ab".repeat(20)});
    let m = plugin_ok(&sock, "/VolumeDriver.Mount", mount);
    let path = PathBuf::from(m["Mountpoint"].as_str().expect("a mountpoint"));
    fs::create_dir(path.join("sub")).expect("a subdirectory");
    let checks_in_use = || {
        w.agent
            .log()
            .matches("1 engine mount(s) checked, 1 in use by a container")
            .count()
    };

    // A container binding only a subdirectory of the volume (Docker's
    // volume-subpath, Podman's subpath): a mount namespace of its own in
    // which nothing but that bind shows the volume's data.
    let holder = w.dir.mkdir("holder");
    let ready = w.dir.path().join("ready");
    let mounts = w.agent.config.mount_root.display().to_string();
    let script = format!(
        "mount --bind {sub} {holder} && for m in $(awk '$5 ~ \"^{mounts}/\" {{print $5}}' /proc/self/mountinfo | sort -r); do umount -l \"$m\"; done && touch {ready} && exec sleep 1000",
        sub = path.join("sub").display(),
        holder = holder.display(),
        ready = ready.display(),
    );
    let mut container = ChildProcess::new("a namespace binding the subdirectory");
    container.spawn(
        std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(std::process::Stdio::null()),
    );
    wait_until(Duration::from_secs(10), "the namespace's bind", || {
        ready.exists()
    });
    let before = checks_in_use();
    wait_until(Duration::from_secs(30), "three checks", || {
        checks_in_use() >= before + 3
    });
    assert_eq!(
        w.calls(),
        [CP, NS, NP],
        "kept while the subdirectory is used"
    );

    // Docker 20.10 copies to and from a stopped container with the
    // volume's data mounted in its own (the host's) namespace: a mount
    // of it outside the agent's mount root keeps it too.
    let archive = w.dir.mkdir("archive");
    let _unmount = MountGuard::new(&archive);
    let status = std::process::Command::new("mount")
        .arg("--bind")
        .arg(&path)
        .arg(&archive)
        .status()
        .expect("run mount");
    assert!(status.success());
    container.kill();
    let before = checks_in_use();
    wait_until(Duration::from_secs(30), "three checks", || {
        checks_in_use() >= before + 3
    });
    assert_eq!(
        w.calls(),
        [CP, NS, NP],
        "kept while the host's namespace uses it"
    );

    // Nobody left: released.
    let status = std::process::Command::new("umount")
        .arg(&archive)
        .status()
        .expect("run umount");
    assert!(status.success());
    let calls = w.wait_calls(6, "the unused mount to be released");
    assert_eq!(calls, ONE_CONTAINER);
}

#[test]
fn an_unmount_answers_in_time_while_a_slow_release_goes_on_and_the_next_mount_waits_for_it() {
    let w = World::with("slow", json!({"mount_timeout": "3s"}));
    let sock = w.socket();
    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    let mount = json!({"Name": "db", "ID": "51ow".repeat(16)});
    let m1 = plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    w.plugin.faults().set(json!([
        {"method": "ControllerUnpublishVolume", "action": "delay", "ms": 4500}
    ]));

    // The Unmount answers within `mount_timeout` (the engine's limit,
    // scaled down), the release still running (ControllerUnpublish takes
    // 4.5 s, within the CSI call's deadline).
    let asked = std::time::Instant::now();
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount.clone());
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    assert_eq!(
        w.calls(),
        [CP, NS, NP, NUP, NUS],
        "ControllerUnpublish delayed"
    );
    assert!(w
        .agent
        .log()
        .contains("the Unmount is answered, the release goes on in the agent"));

    // The engine starts the container again (Podman: the same ID): the
    // Mount waits for the release, then mounts anew.
    let m2 = plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    assert_eq!(m1, m2);
    assert_eq!(w.calls(), [CP, NS, NP, NUP, NUS, CUP, CP, NS, NP]);
    w.plugin.faults().clear();
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount);
    assert_eq!(w.calls()[9..], [NUP, NUS, CUP]);
}

#[test]
fn an_agent_in_a_pid_namespace_of_its_own_keeps_every_engine_mount_and_says_why() {
    let dir = TestDir::new();
    // The mount root is a shared mount, so that the plugin's mounts (made
    // in this namespace) reach the agent's namespace, a slave of it.
    let mounts = dir.mkdir("mounts");
    let _unmount = MountGuard::new(&mounts);
    for args in [
        vec![
            "--bind",
            mounts.to_str().expect("UTF-8"),
            mounts.to_str().expect("UTF-8"),
        ],
        vec!["--make-shared", mounts.to_str().expect("UTF-8")],
    ] {
        let status = std::process::Command::new("mount")
            .args(&args)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount {args:?}");
    }
    let plugin = TestPlugin::builder(dir.path()).volumes(&["ext-db"]).start();
    let driver = format!("claimd-pidns-{}", std::process::id());
    let sock = PathBuf::from(format!("/run/docker/plugins/{driver}.sock"));
    let _socket = SocketFile(sock.clone());
    let mut config = AgentConfig::new(dir.path(), Some(&plugin.socket));
    config.extra.push((
        "docker".into(),
        json!({"driver": driver, "unused_check_interval": "1s"}),
    ));
    let mut agent = Agent::prepare(dir.path(), "agent", config, false, &[]);
    agent.wrapper = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "slave",
    ]
    .map(String::from)
    .to_vec();
    agent.spawn();
    agent.wait_listening();
    wait_until(Duration::from_secs(20), "the plugin to be ready", || {
        let out = agent.cli(&["plugin", "list", "--json"]);
        out.code == 0 && out.json()["plugins"][0]["health"] == "ready"
    });
    wait_until(Duration::from_secs(20), "the plugin socket", || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    });

    let def = json!({"plugin_id": "testplug", "external_id": "ext-db"});
    plugin_ok(
        &sock,
        "/VolumeDriver.Create",
        json!({"Name": "db", "Opts": def}),
    );
    let mount = json!({"Name": "db", "ID": "9d".repeat(32)});
    plugin_ok(&sock, "/VolumeDriver.Mount", mount.clone());
    // No container uses it, but the agent cannot see the containers'
    // processes: it keeps the mount, check after check.
    let kept = || {
        agent
            .log()
            .matches("1 engine mount(s) kept unchecked")
            .count()
    };
    wait_until(Duration::from_secs(30), "three checks", || kept() >= 3);
    assert!(
        agent.log().contains(
            "the engine-death rule keeps every engine mount: the agent runs in a PID namespace of its own and cannot see the containers' processes"
        ),
        "{}",
        agent.log()
    );
    assert_eq!(
        agent.log().matches("keeps every engine mount:").count(),
        1,
        "said once"
    );
    let health = agent.cli(&["health"]);
    assert_ne!(health.code, 0, "degraded: {health:?}");
    assert!(
        health.stdout.contains(
            "docker: the engine-death rule releases no engine mount: the agent runs in a PID namespace of its own"
        ),
        "{health:?}"
    );
    assert_eq!(volume_methods(&plugin.call_log()), [CP, NS, NP]);
    plugin_ok(&sock, "/VolumeDriver.Unmount", mount);
    assert_eq!(volume_methods(&plugin.call_log()), ONE_CONTAINER);
}
