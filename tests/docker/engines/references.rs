//! The engines' mount references: docker cp and export of a running
//! container, Podman's shared allocations, counts across agent restarts and
//! reboots, the engine-death rule, slow releases, PID namespaces.

use super::*;

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
