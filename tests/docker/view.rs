//! What the engines read and remove, with the real engines: Get, List and
//! Path answered from the agent's own view (a dockerd restarted while etcd
//! is away keeps its volumes' options and labels), `CreatedAt`, and an
//! engine's Remove of a volume the CLI registered (Podman's prune).

use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::Etcd;
use crate::harness::*;
use serde_json::{json, Value};

/// `docker volume inspect NAME` as JSON (the one volume).
fn inspect(d: &Dockerd, name: &str) -> Value {
    let out = d.docker(&["volume", "inspect", name]).ok();
    let all: Value = serde_json::from_str(out.stdout.trim()).expect("JSON");
    all[0].clone()
}

#[test]
fn a_dockerd_restarted_while_etcd_is_away_keeps_its_volumes_options_and_labels() {
    let mut etcd = Etcd::start();
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["ext-db"])
        .start();
    let driver = format!("claimd-view-{}", std::process::id());
    let _socket = SocketFile(format!("/run/docker/plugins/{driver}.sock").into());
    let mut config =
        AgentConfig::new(dir.path(), Some(&plugin.socket)).cluster_node("n1", &[etcd.endpoint()]);
    config
        .extra
        .push(("docker".into(), json!({"driver": driver})));
    let agent = Agent::start_with(dir.path(), "agent", config, false, &[]);
    wait_until(Duration::from_secs(20), "the plugin socket", || {
        std::os::unix::net::UnixStream::connect(format!("/run/docker/plugins/{driver}.sock"))
            .is_ok()
    });
    let mut d = Dockerd::start(dir.path());
    d.docker(&[
        "volume",
        "create",
        "--driver",
        &driver,
        "--opt",
        "plugin_id=testplug",
        "--opt",
        "external_id=ext-db",
        "--label",
        "team=storage",
        "db",
    ])
    .ok();
    let before = inspect(&d, "db");
    assert_eq!(before["Options"]["external_id"], "ext-db", "{before}");
    assert_eq!(before["Labels"]["team"], "storage", "{before}");
    let created = before["CreatedAt"].as_str().expect("CreatedAt").to_string();
    assert!(
        created.len() == 20 && created.ends_with('Z') && created.as_bytes()[10] == b'T',
        "RFC 3339: {created}"
    );

    // etcd away, dockerd restarted: at its start it asks Get for every
    // volume it knows and forgets the options and labels of any whose Get
    // fails; the agent answers from its view.
    etcd.kill();
    wait_until(Duration::from_secs(30), "the view to lose etcd", || {
        agent.log().contains("answering from the last view")
    });
    d.restart();
    let during = inspect(&d, "db");
    assert_eq!(during["Options"], before["Options"], "{during}");
    assert_eq!(during["Labels"], before["Labels"], "{during}");
    assert_eq!(during["CreatedAt"], before["CreatedAt"]);
    // (Docker lists every driver in its plugin directory: a test running
    // beside this one in the same binary has its own there.)
    let mine = format!("driver={driver}");
    let list = d
        .docker(&[
            "volume",
            "ls",
            "--filter",
            &mine,
            "--format",
            "{{.Name}} {{.Driver}}",
        ])
        .ok();
    assert_eq!(list.stdout.trim(), format!("db {driver}"));

    // etcd back: nothing lost either.
    etcd.restart();
    wait_until(
        Duration::from_secs(30),
        "the view to read etcd again",
        || {
            agent
                .log()
                .contains("volume view: etcd answers again; the view is current")
        },
    );
    let after = inspect(&d, "db");
    assert_eq!(after["Options"], before["Options"], "{after}");
    assert_eq!(after["Labels"], before["Labels"], "{after}");
    assert!(
        !d.log_text().contains("VolumeDriver.Get"),
        "no Get failed: {}",
        d.log_text()
    );
    drop(agent);
}

#[test]
fn podman_volume_prune_leaves_a_volume_registered_with_the_cli_registered() {
    let w = World::new("prune");
    let p = Podman::new(w.dir.path(), &w.driver, &w.socket());
    // One volume registered with the CLI, adopted by Podman; one Podman
    // registers itself.
    w.agent
        .register(&volume_json("kept", "ext-db", &["single-node-writer"]));
    p.podman(&["volume", "create", "--driver", &w.driver, "kept"])
        .ok();
    p.podman(&[
        "volume",
        "create",
        "--driver",
        &w.driver,
        "--opt",
        "plugin_id=testplug",
        "--opt",
        "external_id=ext-other",
        "made",
    ])
    .ok();
    let ids = |w: &World| -> Vec<String> {
        w.volumes()
            .iter()
            .map(|v| v["id"].as_str().expect("id").to_string())
            .collect()
    };
    assert_eq!(ids(&w), ["kept", "made"]);

    // No container uses either: prune removes both from Podman; claimd
    // deregisters only the one Podman registered.
    p.podman(&["volume", "prune", "-f"]).ok();
    let left = p.podman(&["volume", "ls", "--format", "{{.Name}}"]).ok();
    assert_eq!(left.stdout.trim(), "");
    assert_eq!(ids(&w), ["kept"]);
    assert!(w.agent.log().contains(
        "volume kept: an engine's Remove leaves it registered: it was registered with the claimd CLI or API"
    ));
    assert!(w
        .agent
        .log()
        .contains("volume made deregistered through the Docker plugin protocol"));
    // And Podman can use it again, by adopting it.
    p.podman(&["volume", "create", "--driver", &w.driver, "kept"])
        .ok();
    p.run_with("kept", "echo back > /data/back").ok();
    assert!(w.file("back").exists());
}
