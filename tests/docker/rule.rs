//! The engine-death rule's limits with the real agent and test plugin,
//! speaking the protocol as the engines do: what is never a candidate (a
//! mount younger than the engine's Mount timeout, every mount while a
//! Mount runs), and a namespace whose link the agent cannot read, judged
//! by its mount table. (tests/docker/engines/ has the rule with real engines.)

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use serde_json::json;

/// Create `name` on the test plugin's `external` volume.
fn create(w: &World, name: &str, external: &str) {
    let def = json!({"plugin_id": "testplug", "external_id": external});
    plugin_ok(
        &w.socket(),
        "/VolumeDriver.Create",
        json!({"Name": name, "Opts": def}),
    );
}

#[test]
fn a_mount_younger_than_the_engines_mount_timeout_or_while_another_mount_runs_is_not_released() {
    let w = World::with(
        "young",
        json!({"unused_check_interval": "2s", "engine_mount_timeout": "5s", "mount_timeout": "12s"}),
    );
    let sock = w.socket();
    create(&w, "db", "ext-db");
    create(&w, "db2", "ext-other");

    // Unused from the start, but released only once older than the
    // engine's Mount timeout (two checks would have taken 2 to 4 s).
    let a = json!({"Name": "db", "ID": "a0".repeat(32)});
    let mounted = Instant::now();
    plugin_ok(&sock, "/VolumeDriver.Mount", a.clone());
    let calls = w.wait_calls(6, "the unused mount to be released");
    let took = mounted.elapsed();
    assert_eq!(calls, ONE_CONTAINER);
    assert!(took >= Duration::from_secs(5), "released after {took:?}");
    assert!(w.agent.log().contains("1 too young or waiting for a Mount"));

    // A container with two volumes: the first is mounted, the Mount of the
    // second takes 9 s (its NodeStage and NodePublish slow). No mount is
    // released while it runs, however old.
    let b = json!({"Name": "db", "ID": "b0".repeat(32)});
    plugin_ok(&sock, "/VolumeDriver.Mount", b);
    assert_eq!(w.calls().len(), 9, "{:?}", w.calls());
    w.plugin.faults().set(json!([
        {"method": NS, "volume_id": "ext-other", "action": "delay", "ms": 4500, "count": 1},
        {"method": NP, "volume_id": "ext-other", "action": "delay", "ms": 4500, "count": 1}
    ]));
    let released_db = || {
        w.plugin
            .call_log()
            .calls_of(NUP)
            .iter()
            .filter(|c| c["volume_id"] == "ext-db")
            .count()
    };
    let c = json!({"Name": "db2", "ID": "b0".repeat(32)});
    let started = Instant::now();
    plugin_ok(&sock, "/VolumeDriver.Mount", c);
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(9), "mounted in {took:?}");
    // The first volume is older than 9 s, and kept until now.
    assert_eq!(released_db(), 1, "kept while the Mount ran");
    assert!(w
        .agent
        .log()
        .contains("1 too young or waiting for a Mount (1 running)"));
    // Then the rule takes it (the second is still young).
    wait_until(CLEANUP_TIMEOUT, "the unused mount to be released", || {
        released_db() == 2
    });
}

#[test]
fn a_namespace_whose_link_the_agent_cannot_read_is_judged_by_its_mount_table() {
    // Without CAP_SYS_PTRACE the agent is refused the namespace link of
    // every process with more privileges than its own (every other root
    // process here, and the sandbox's init even with it), but reads their
    // mount tables.
    let w = World::wrapped(
        "nolink",
        json!({"unused_check_interval": "1s", "engine_mount_timeout": "10s"}),
        &["setpriv", "--bounding-set", "-sys_ptrace", "--"],
    );
    let sock = w.socket();
    create(&w, "db", "ext-db");
    let m = plugin_ok(
        &sock,
        "/VolumeDriver.Mount",
        json!({"Name": "db", "ID": "c0".repeat(32)}),
    );
    let path = PathBuf::from(m["Mountpoint"].as_str().expect("a mountpoint"));
    fs::create_dir(path.join("sub")).expect("a subdirectory");

    // A container's namespace binding a subdirectory of the volume.
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
    let checks_in_use = || {
        w.agent
            .log()
            .matches("1 engine mount(s) checked, 1 in use by a container")
            .count()
    };
    let before = checks_in_use();
    wait_until(Duration::from_secs(30), "three checks", || {
        checks_in_use() >= before + 3
    });
    assert_eq!(
        w.calls(),
        [CP, NS, NP],
        "kept: its mount table shows the bind"
    );
    let log = w.agent.log();
    assert!(
        log.contains(
            "a mount namespace link cannot be read, its task is judged by its mount table"
        ),
        "the agent was refused links: {log}"
    );
    assert!(!log.contains("keeps every engine mount"), "{log}");

    // The holder gone, the refused links left are the agent's own
    // namespace's (the test plugin, the sandbox's init): released.
    container.kill();
    let calls = w.wait_calls(6, "the unused mount to be released");
    assert_eq!(calls, ONE_CONTAINER);
    let health = w.agent.cli(&["health"]);
    assert_eq!(health.code, 0, "{health:?}");
}

#[test]
fn with_the_engines_socket_configured_a_stopped_container_keeps_its_volume() {
    // The engine's socket as the config names it before dockerd exists: a
    // link made once it runs.
    let link = PathBuf::from(format!(
        "/run/claimd-test-engine-{}.sock",
        std::process::id()
    ));
    let _link = SocketFile(link.clone());
    let w = World::with(
        "stopped",
        json!({"unused_check_interval": "1s", "engine_mount_timeout": "1s",
               "engine_sockets": [link]}),
    );
    let d = Dockerd::start(w.dir.path());
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(d.dir.join("docker.sock"), &link).expect("link the socket");
    d.docker(&w.create_args(&[], "db")).ok();
    // A container that ran and stopped, not removed: its Unmount came.
    let mut args = vec!["run", "--name", "c1"];
    args.extend(RUN_FLAGS);
    args.extend([
        "-v",
        "db:/data",
        "--volume-driver",
        &w.driver,
        IMAGE,
        "sh",
        "-c",
        "echo hi > /data/f",
    ]);
    d.docker(&args).ok();
    assert_eq!(w.wait_calls(6, "c1's Unmount"), ONE_CONTAINER);
    // An engine mount of the volume that no namespace uses (an Unmount
    // that never came): the engine's stopped container keeps it.
    let alloc = format!("docker-{}-db", "d0".repeat(32));
    plugin_ok(
        &w.socket(),
        "/VolumeDriver.Mount",
        json!({"Name": "db", "ID": "d0".repeat(32)}),
    );
    let kept = || {
        w.agent
            .log()
            .matches(&format!("lists volume db: allocation {alloc} kept"))
            .count()
    };
    wait_until(Duration::from_secs(30), "three checks keeping it", || {
        kept() >= 3
    });
    assert_eq!(w.calls().len(), 9, "kept: {:?}", w.calls());
    assert!(w.file("f").exists());

    // The container removed: nothing lists the volume any more.
    d.docker(&["rm", "c1"]).ok();
    let calls = w.wait_calls(12, "the unused mount to be released");
    assert_eq!(calls[9..], [NUP, NUS, CUP]);
}
