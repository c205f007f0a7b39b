//! Volume operations through the controller, end to end: the real agent
//! driven by the `claimd` binary's client commands against the real test
//! plugin, with the plugin's call log asserted. `volume create|delete|
//! expand`, `snapshot create|list|delete` (and `volume snapshot ...`),
//! topology matching before any claim, and the mount group. Also what a
//! mount checks of the plugin's answer: its target is a mount point.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use serde_json::{json, Value};

/// Agent, plugin and directory; dropped in that order.
struct World {
    agent: Agent,
    plugin: TestPlugin,
    _dir: TestDir,
}

impl World {
    /// The test plugin with `flags`, and an agent for it.
    fn new(flags: &[&str]) -> World {
        let dir = TestDir::new();
        let plugin = TestPlugin::builder(dir.path()).args(flags).start();
        let config = AgentConfig::new(dir.path(), Some(&plugin.socket));
        let agent = Agent::start(dir.path(), config);
        let w = World {
            agent,
            plugin,
            _dir: dir,
        };
        wait_until(Duration::from_secs(20), "the plugin to be ready", || {
            let out = w.agent.cli(&["plugin", "list", "--json"]).ok();
            out.json()["plugins"][0]["health"] == "ready"
        });
        w
    }

    fn cli(&self, args: &[&str]) -> CliOutput {
        self.agent.cli(args)
    }

    /// `volume create - --json` with `definition` on standard input.
    fn create(&self, definition: &Value) -> CliOutput {
        let socket = self.agent.config.api_socket.to_str().expect("UTF-8");
        let text = serde_json::to_vec(definition).expect("encode");
        run_claimd(
            &["volume", "create", "-", "--socket", socket, "--json"],
            Some(&text),
            &[],
            CLI_TIMEOUT,
        )
    }

    /// The volume calls of the call log (no fingerprints, probes or
    /// volume-stats polls), with their codes.
    fn ops(&self) -> Vec<(String, String)> {
        volume_calls(&self.plugin.call_log())
            .into_iter()
            .filter(|(m, _)| m != "NodeGetVolumeStats")
            .collect()
    }

    fn volumes(&self) -> Value {
        self.cli(&["volume", "list", "--json"]).ok().json()["volumes"].clone()
    }

    /// `alloc mount ALLOC --volume SPEC --json`: the output.
    fn mount(&self, alloc: &str, spec: &str) -> CliOutput {
        self.cli(&["alloc", "mount", alloc, "--volume", spec, "--json"])
    }

    fn release(&self, alloc: &str) {
        self.cli(&["alloc", "release", alloc, "--wait", "30s"]).ok();
    }
}

fn ok(method: &str) -> (String, String) {
    (method.to_string(), "OK".to_string())
}

fn host_path(out: &CliOutput) -> PathBuf {
    PathBuf::from(
        out.json()["volumes"][0]["host_path"]
            .as_str()
            .expect("host_path is a string"),
    )
}

/// A creation request of the test plugin's volume `id`.
fn definition(id: &str) -> Value {
    json!({
        "id": id,
        "plugin_id": PLUGIN_ID,
        "access_modes": ["single-node-writer"],
        "attachment_modes": ["file-system"],
        "secrets": {"token": "t0ken"},
        "capacity_range": {"required_bytes": 1_048_576},
        "parameters": {"tier": "fast"},
    })
}

/// Fails unless `out` exited with `code` and its stderr has every needle.
fn assert_fails(out: &CliOutput, code: i32, needles: &[&str]) {
    assert_eq!(out.code, code, "{out:?}");
    for n in needles {
        assert!(out.stderr.contains(n), "stderr lacks {n:?}: {out:?}");
    }
}

// ---- create and delete ------------------------------------------------------

#[test]
fn create_registers_the_plugins_answer_idempotently_and_delete_waits_for_release() {
    let w = World::new(&[]);
    let out = w.create(&definition("db")).ok().json();
    let created = &out["created"][0];
    assert_eq!(created["id"], "db");
    // The test plugin answers with the name as its volume ID.
    assert_eq!(created["external_id"], "db");
    assert_eq!(created["capacity_bytes"], 1_048_576);
    assert_eq!(created["context"], json!({"claimd.test/volume": "db"}));
    let creates = w.plugin.call_log().calls_of("CreateVolume");
    assert_eq!(creates.len(), 1);
    assert_eq!(creates[0]["volume_id"], "db");
    assert_eq!(creates[0]["required_bytes"], 1_048_576);
    assert_eq!(creates[0]["secret_keys"], json!(["token"]));
    assert!(w.plugin.volume_dir("db").is_dir());
    let vols = w.volumes();
    assert_eq!(vols.as_array().expect("array").len(), 1);
    assert_eq!(vols[0]["external_id"], "db");
    assert_eq!(vols[0]["capacity_bytes"], 1_048_576);
    assert_eq!(vols[0]["context"], json!({"claimd.test/volume": "db"}));
    assert_eq!(vols[0]["secret_keys"], json!(["token"]));

    // The same request again: the same volume, the registration unchanged.
    let state_before = w.agent.state()["volumes"].clone();
    let again = w.create(&definition("db")).ok().json();
    assert_eq!(again["created"][0]["external_id"], "db");
    assert_eq!(w.agent.state()["volumes"], state_before);

    // A conflicting request: refused with the plugin's reason, nothing
    // changed.
    let mut other = definition("db");
    other["parameters"] = json!({"tier": "slow"});
    let out = w.create(&other);
    assert_fails(
        &out,
        EXIT_FAILED,
        &["create volume db", "ALREADY_EXISTS", "tier"],
    );
    assert_eq!(w.agent.state()["volumes"], state_before);
    assert_eq!(
        w.ops(),
        vec![
            ok("CreateVolume"),
            ok("CreateVolume"),
            ("CreateVolume".into(), "ALREADY_EXISTS".into())
        ]
    );

    // The created volume mounts with the plugin's volume context.
    let host = host_path(&w.mount("a1", "data=db").ok());
    assert!(is_mount_point(&host));
    let stage = w.plugin.call_log().calls_of("NodeStageVolume");
    assert_eq!(
        stage[0]["volume_context"],
        json!({"claimd.test/volume": "db"})
    );

    // Delete is refused while the volume is claimed; no call is made.
    let calls_before = w.ops();
    let out = w.cli(&["volume", "delete", "db"]);
    assert_fails(&out, EXIT_FAILED, &["volume db is in use by allocation a1"]);
    assert_eq!(w.ops(), calls_before);
    assert_eq!(w.agent.state()["volumes"], state_before);

    // Released: DeleteVolume, then the registration goes.
    w.release("a1");
    let out = w.cli(&["volume", "delete", "db", "--json"]).ok().json();
    assert_eq!(out, json!({"volume_id": "db", "deleted": true}));
    let ops = w.ops();
    assert_eq!(ops.last(), Some(&ok("DeleteVolume")));
    let delete = w.plugin.call_log().calls_of("DeleteVolume");
    assert_eq!(delete[0]["volume_id"], "db");
    assert_eq!(delete[0]["secret_keys"], json!(["token"]));
    assert_eq!(w.volumes(), json!([]));
    assert!(!w.plugin.volume_dir("db").exists());

    // An unknown volume: a clear error, no call.
    let out = w.cli(&["volume", "delete", "db"]);
    assert_fails(&out, EXIT_FAILED, &["volume db is not registered"]);
    assert_eq!(w.ops(), ops);
}

#[test]
fn operations_a_plugin_does_not_offer_are_refused_and_change_nothing() {
    let w = World::new(&["--no-controller"]);
    let out = w.create(&definition("db"));
    assert_fails(
        &out,
        EXIT_FAILED,
        &["cannot create volume db", "CONTROLLER_SERVICE"],
    );
    assert_eq!(w.volumes(), json!([]));
    assert_eq!(w.ops(), vec![]);

    // A plugin with a controller but without snapshots or expansion.
    let w = World::new(&[]);
    w.create(&definition("db")).ok();
    let before = (w.ops(), w.agent.state()["volumes"].clone());
    let out = w.cli(&["snapshot", "create", "db", "s1"]);
    assert_fails(
        &out,
        EXIT_FAILED,
        &["snapshot volume db", "CREATE_DELETE_SNAPSHOT"],
    );
    let out = w.cli(&["snapshot", "list", "db"]);
    assert_fails(&out, EXIT_FAILED, &["LIST_SNAPSHOTS"]);
    let out = w.cli(&["volume", "expand", "db", "--size", "2097152"]);
    assert_fails(&out, EXIT_FAILED, &["expand volume db", "EXPAND_VOLUME"]);
    let mut from_snapshot = definition("copy");
    from_snapshot["source"] = json!({"snapshot_id": "snap-s1"});
    let out = w.create(&from_snapshot);
    assert_fails(&out, EXIT_FAILED, &["CREATE_DELETE_SNAPSHOT"]);
    let mut placed = definition("zonal");
    placed["accessibility_requirements"] = json!({"requisite": [{"zone": "z1"}]});
    let out = w.create(&placed);
    assert_fails(&out, EXIT_FAILED, &["VOLUME_ACCESSIBILITY_CONSTRAINTS"]);
    assert_eq!((w.ops(), w.agent.state()["volumes"].clone()), before);

    // Bad definitions never reach the agent.
    let mut bad = definition("db");
    bad["capacity_range"] = json!({"required_bytes": 10, "limit_bytes": 5});
    assert_fails(
        &w.create(&bad),
        EXIT_USAGE,
        &["limit_bytes 5 is below required_bytes 10"],
    );
    let mut unknown = definition("db");
    unknown["size"] = json!(3);
    assert_fails(&w.create(&unknown), EXIT_USAGE, &["unknown field `size`"]);
    assert_eq!(w.ops(), before.0);
}

// ---- topology ---------------------------------------------------------------

#[test]
fn topology_is_matched_before_any_claim_on_multi_segment_nodes() {
    let w = World::new(&["--topology", "region=r1,zone=z1,rack=a"]);
    let plugins = w.cli(&["plugin", "list", "--json"]).ok().json();
    assert_eq!(
        plugins["plugins"][0]["topology"],
        json!({"rack": "a", "region": "r1", "zone": "z1"})
    );
    let caps = plugins["plugins"][0]["capabilities"].to_string();
    assert!(caps.contains("VOLUME_ACCESSIBILITY_CONSTRAINTS"), "{caps}");

    // A volume placed in zone z1: the node has more keys than the volume
    // asks for, and still matches (a subset, not equality).
    let mut near = definition("near");
    near["accessibility_requirements"] = json!({"requisite": [{"zone": "z1"}]});
    let out = w.create(&near).ok().json();
    assert_eq!(
        out["created"][0]["accessible_topology"],
        json!([{"zone": "z1"}])
    );
    let creates = w.plugin.call_log().calls_of("CreateVolume");
    assert_eq!(creates[0]["topology"], json!(["zone=z1"]));
    let host = host_path(&w.mount("a1", "data=near").ok());
    assert!(is_mount_point(&host));

    // A volume in zone z2 of the same region: refused at once, naming
    // both, before any claim or call.
    let mut far = definition("far");
    far["accessibility_requirements"] = json!({"requisite": [{"region": "r1", "zone": "z2"}]});
    w.create(&far).ok();
    let before = w.ops();
    let out = w.mount("a2", "data=far");
    assert_fails(
        &out,
        EXIT_FAILED,
        &[
            "volume data (far) cannot be used on this node",
            "{region=r1, zone=z2}",
            "node test-node in {rack=a, region=r1, zone=z1}",
        ],
    );
    assert_eq!(w.ops(), before);
    let claims = w
        .cli(&["claim", "list", "--volume", "far", "--json"])
        .ok()
        .json();
    assert_eq!(claims["claims"], json!([]));
    assert!(!w.agent.state_allocs().contains_key("a2"));

    // A registered volume with several segment sets: one that fits is
    // enough.
    w.plugin.add_volume("ext-multi");
    let mut multi = volume_json("multi", "ext-multi", &["single-node-writer"]);
    multi["accessible_topology"] = json!([{"zone": "z9"}, {"zone": "z1", "rack": "a"}]);
    w.agent.register(&multi);
    let host = host_path(&w.mount("a3", "data=multi").ok());
    assert!(is_mount_point(&host));
    let mut none = volume_json("none", "ext-multi", &["single-node-writer"]);
    none["accessible_topology"] = json!([{"zone": "z9"}, {"zone": "z1", "rack": "b"}]);
    w.agent.register(&none);
    let out = w.mount("a4", "data=none");
    assert_fails(&out, EXIT_FAILED, &["{zone=z9} or {rack=b, zone=z1}"]);
}

// ---- mount group --------------------------------------------------------------

#[test]
fn mount_group_is_passed_with_volume_mount_group_and_refused_without() {
    let w = World::new(&["--mount-group"]);
    w.create(&definition("db")).ok();
    let host = host_path(&w.mount("a1", "data=db,group=4242").ok());
    let log = w.plugin.call_log();
    assert_eq!(log.calls_of("NodeStageVolume")[0]["mount_group"], "4242");
    assert_eq!(log.calls_of("NodePublishVolume")[0]["mount_group"], "4242");
    // ControllerPublish is not a mount: no group there.
    assert_eq!(
        log.calls_of("ControllerPublishVolume")[0]["mount_group"],
        Value::Null
    );
    // The workload's path belongs to the group.
    let meta = std::fs::metadata(&host).expect("stat the host path");
    assert_eq!(meta.gid(), 4242);
    // Recorded, so a restore sends it again.
    let rec = &w.agent.state_allocs()["a1"]["volumes"]["data"];
    assert_eq!(rec["mount_group"], "4242");
    // Another allocation cannot share the staging with another group.
    let out = w.mount("a2", "data=db,group=5000");
    assert_fails(&out, EXIT_FAILED, &["mount group 4242", "mount group 5000"]);

    let w = World::new(&[]);
    w.create(&definition("db")).ok();
    let before = w.ops();
    let out = w.mount("a1", "data=db,group=4242");
    assert_fails(
        &out,
        EXIT_FAILED,
        &[
            "cannot be mounted with a mount group",
            "does not offer VOLUME_MOUNT_GROUP",
        ],
    );
    assert_eq!(w.ops(), before);
    assert!(!w.agent.state_allocs().contains_key("a1"));
    let claims = w.cli(&["claim", "list", "--json"]).ok().json();
    assert_eq!(claims["claims"], json!([]));
}

// ---- snapshots ---------------------------------------------------------------

#[test]
fn snapshots_are_created_listed_restored_into_new_volumes_and_deleted() {
    let w = World::new(&["--snapshots"]);
    w.create(&definition("src")).ok();
    let host = host_path(&w.mount("a1", "data=src").ok());
    std::fs::write(host.join("hello.txt"), b"from src").expect("write into the volume");

    // `volume snapshot create` is `snapshot create`.
    let snap = w
        .cli(&["volume", "snapshot", "create", "src", "s1", "--json"])
        .ok()
        .json();
    assert_eq!(snap["snapshot_id"], "snap-s1");
    assert_eq!(snap["volume_id"], "src");
    assert_eq!(snap["plugin_id"], PLUGIN_ID);
    assert_eq!(snap["size_bytes"], 1_048_576);
    assert_eq!(snap["ready_to_use"], true);
    let call = &w.plugin.call_log().calls_of("CreateSnapshot")[0];
    assert_eq!(call["volume_id"], "src");
    assert_eq!(call["snapshot"], "s1");
    assert_eq!(call["secret_keys"], json!(["token"]));
    // The same name again: the same snapshot.
    let again = w
        .cli(&["snapshot", "create", "src", "s1", "--json"])
        .ok()
        .json();
    assert_eq!(again["snapshot_id"], "snap-s1");

    let listed = w.cli(&["snapshot", "list", "src", "--json"]).ok().json();
    assert_eq!(listed["snapshots"].as_array().expect("array").len(), 1);
    assert_eq!(listed["snapshots"][0]["snapshot_id"], "snap-s1");
    let all = w.cli(&["snapshot", "list", "--json"]).ok().json();
    assert_eq!(all["snapshots"], listed["snapshots"]);
    let table = w.cli(&["snapshot", "list"]).ok();
    assert!(
        table.stdout.contains("snap-s1") && table.stdout.contains("src"),
        "{}",
        table.stdout
    );

    // A volume from the snapshot starts with its content.
    let mut copy = definition("copy");
    copy["source"] = json!({"snapshot_id": "snap-s1"});
    w.create(&copy).ok();
    let create = &w.plugin.call_log().calls_of("CreateVolume")[1];
    assert_eq!(create["snapshot"], "snapshot:snap-s1");
    let copy_host = host_path(&w.mount("a2", "data=copy").ok());
    assert_eq!(
        std::fs::read(copy_host.join("hello.txt")).expect("read the copy"),
        b"from src"
    );
    // And a copy of a volume (CLONE_VOLUME).
    let mut clone = definition("clone");
    clone["source"] = json!({"volume_id": "src"});
    w.create(&clone).ok();
    assert_eq!(
        std::fs::read(w.plugin.volume_dir("clone").join("hello.txt")).expect("read the clone"),
        b"from src"
    );

    // Bad input: a clear error and nothing changed.
    let before = (w.ops(), w.agent.state()["volumes"].clone());
    let out = w.cli(&["snapshot", "create", "copy", "s1"]);
    assert_fails(&out, EXIT_FAILED, &["ALREADY_EXISTS", "of volume src"]);
    let out = w.cli(&["snapshot", "delete", "snap-nope"]);
    assert_fails(&out, EXIT_FAILED, &["snapshot snap-nope is not known"]);
    let mut from_nothing = definition("ghost");
    from_nothing["source"] = json!({"snapshot_id": "snap-nope"});
    let out = w.create(&from_nothing);
    assert_fails(
        &out,
        EXIT_FAILED,
        &["NOT_FOUND", "snapshot snap-nope does not exist"],
    );
    let out = w.cli(&["snapshot", "create", "nope", "s2"]);
    assert_fails(&out, EXIT_FAILED, &["volume nope is not registered"]);
    assert_eq!(w.agent.state()["volumes"], before.1);
    assert!(!w.plugin.volume_dir("ghost").exists());
    let methods: Vec<String> = w.ops()[before.0.len()..]
        .iter()
        .map(|(m, _)| m.clone())
        .collect();
    assert_eq!(methods, ["CreateSnapshot", "ListSnapshots", "CreateVolume"]);

    let out = w
        .cli(&["snapshot", "delete", "snap-s1", "--json"])
        .ok()
        .json();
    assert_eq!(
        out,
        json!({"snapshot_id": "snap-s1", "plugin_id": PLUGIN_ID, "deleted": true})
    );
    assert_eq!(w.ops().last(), Some(&ok("DeleteSnapshot")));
    let listed = w.cli(&["snapshot", "list", "--json"]).ok().json();
    assert_eq!(listed["snapshots"], json!([]));
    // The volume made from it keeps its content.
    assert!(copy_host.join("hello.txt").is_file());
}

// ---- expansion ------------------------------------------------------------------

/// The bytes capacity NodeGetVolumeStats reports at `path`.
fn reported_capacity(plugin: &TestPlugin, volume: &str, path: &Path) -> i64 {
    let req = claimd::csi::NodeGetVolumeStatsRequest {
        volume_id: volume.to_string(),
        volume_path: path.to_string_lossy().into_owned(),
        ..Default::default()
    };
    let stats = plugin
        .client()
        .node_get_volume_stats(&req)
        .expect("NodeGetVolumeStats");
    stats.bytes.expect("bytes usage").total
}

#[test]
fn expansion_grows_a_mounted_volume_online_and_records_the_capacity() {
    let w = World::new(&["--expansion", "--volume-stats"]);
    w.create(&definition("db")).ok();
    let host = host_path(&w.mount("a1", "data=db").ok());
    assert_eq!(reported_capacity(&w.plugin, "db", &host), 1_048_576);
    let staging = w.plugin.call_log().calls_of("NodeStageVolume")[0]["staging_target_path"].clone();

    let before = w.ops().len();
    let out = w
        .cli(&["volume", "expand", "db", "--size", "4194304", "--json"])
        .ok()
        .json();
    assert_eq!(out["capacity_bytes"], 4_194_304);
    assert_eq!(out["node_expanded"], json!([host]));
    assert_eq!(out["node_expansion_pending"], false);
    assert_eq!(
        w.ops()[before..].to_vec(),
        vec![ok("ControllerExpandVolume"), ok("NodeExpandVolume")]
    );
    let log = w.plugin.call_log();
    let controller = &log.calls_of("ControllerExpandVolume")[0];
    assert_eq!(controller["required_bytes"], 4_194_304);
    assert_eq!(controller["access_mode"], "SINGLE_NODE_WRITER");
    let node = &log.calls_of("NodeExpandVolume")[0];
    assert_eq!(node["target_path"], json!(host));
    assert_eq!(node["staging_target_path"], staging);
    // The workload's path sees the new size, while it stays mounted.
    assert!(is_mount_point(&host));
    assert_eq!(reported_capacity(&w.plugin, "db", &host), 4_194_304);
    assert_eq!(w.volumes()[0]["capacity_bytes"], 4_194_304);
    assert_eq!(
        w.agent.state()["volumes"]["db"]["capacity_bytes"],
        4_194_304
    );

    // Smaller than now, or an unknown volume: refused, nothing changed.
    let before = (w.ops(), w.agent.state()["volumes"].clone());
    let out = w.cli(&["volume", "expand", "db", "--size", "1048576"]);
    assert_fails(
        &out,
        EXIT_USAGE,
        &["volume db has 4194304 bytes; it cannot shrink to 1048576 bytes"],
    );
    let out = w.cli(&["volume", "expand", "nope", "--size", "1048576"]);
    assert_fails(&out, EXIT_FAILED, &["volume nope is not registered"]);
    let out = w.cli(&["volume", "expand", "db"]);
    assert_fails(&out, EXIT_USAGE, &["needs --size BYTES"]);
    assert_eq!((w.ops(), w.agent.state()["volumes"].clone()), before);

    // Not mounted on this node: the controller grows it, the node part
    // waits.
    w.release("a1");
    let before = w.ops().len();
    let out = w
        .cli(&["volume", "expand", "db", "--size", "8388608", "--json"])
        .ok()
        .json();
    assert_eq!(out["capacity_bytes"], 8_388_608);
    assert_eq!(out["node_expanded"], json!([]));
    assert_eq!(out["node_expansion_pending"], true);
    assert_eq!(
        w.ops()[before..].to_vec(),
        vec![ok("ControllerExpandVolume")]
    );
    assert_eq!(
        w.agent.state()["volumes"]["db"]["node_expansion_pending"],
        true
    );

    // The next mount does the node's part after NodePublish, once.
    let before = w.ops().len();
    let host = host_path(&w.mount("a2", "data=db").ok());
    assert_eq!(
        w.ops()[before..].to_vec(),
        vec![
            ok("ControllerPublishVolume"),
            ok("NodeStageVolume"),
            ok("NodePublishVolume"),
            ok("NodeExpandVolume")
        ]
    );
    let node = w.plugin.call_log().calls_of("NodeExpandVolume")[1].clone();
    assert_eq!(node["target_path"], json!(host));
    assert_eq!(node["required_bytes"], 8_388_608, "{node}");
    assert_eq!(reported_capacity(&w.plugin, "db", &host), 8_388_608);
    assert_eq!(
        w.agent.state()["volumes"]["db"]["node_expansion_pending"],
        Value::Null,
        "done: no longer pending"
    );
    w.release("a2");
    let before = w.ops().len();
    w.mount("a3", "data=db").ok();
    assert!(
        !w.ops()[before..].contains(&ok("NodeExpandVolume")),
        "{:?}",
        w.ops()
    );
}

// ---- what a mount checks of the plugin's answer -------------------------------

/// A node plugin whose mount stays in its own mount namespace (a plugin
/// container without `rshared` propagation) answers NodePublishVolume OK
/// and leaves an empty directory of the node's disk where the workload's
/// writes would land. The mount fails, naming the cause, and its way up is
/// undone; the next mount, with a plugin that mounts, works. The test
/// plugin's `empty` fault answers OK without mounting. Until 2026-12-06
/// `alloc mount` exited 0 with that directory (found while writing the
/// getting-started guide with csi-driver-host-path in Podman).
#[test]
fn a_publish_answered_ok_without_a_mount_fails_and_is_undone() {
    let w = World::new(&[]);
    w.plugin.add_volume("ext-v");
    w.agent
        .register(&volume_json("v", "ext-v", &["single-node-writer"]))
        .ok();
    w.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "empty", "count": 1}
    ]));
    let out = w.mount("a1", "data=v");
    assert_fails(
        &out,
        EXIT_FAILED,
        &[
            "NodePublishVolume answered OK but nothing is mounted at",
            "rshared",
        ],
    );
    let ops = w.ops();
    assert_eq!(
        &ops[ops.len() - 3..],
        &[
            ok("NodeUnpublishVolume"),
            ok("NodeUnstageVolume"),
            ok("ControllerUnpublishVolume")
        ],
        "{ops:?}"
    );
    assert_eq!(w.agent.state()["claims"], json!([]));
    assert!(!w.agent.state_allocs().contains_key("a1"));
    let left = mounts_under(&w.agent.config.mount_root);
    assert!(left.is_empty(), "{left:?}");
    let host = host_path(&w.mount("a1", "data=v").ok());
    assert!(is_mount_point(&host));
}

/// The same for a restore, and for a later mount of a published
/// allocation: a1's mount vanishes while the agent is down, its restore's
/// NodePublish is answered OK with nothing mounted (the restore says so,
/// naming the target), and the next `alloc mount a1` publishes it again
/// instead of answering with the empty directory. Before, a published
/// record was answered as it stood, whatever was at its target.
#[test]
fn a_published_allocation_whose_target_is_empty_is_published_again() {
    let mut w = World::new(&[]);
    w.plugin.add_volume("ext-v");
    w.agent
        .register(&volume_json("v", "ext-v", &["single-node-writer"]))
        .ok();
    let host = host_path(&w.mount("a1", "data=v").ok());
    w.agent.kill();
    let out = std::process::Command::new("umount")
        .arg(&host)
        .output()
        .expect("run umount");
    assert!(out.status.success(), "umount {host:?}: {out:?}");
    w.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "empty", "count": 1}
    ]));
    w.agent.restart();
    wait_until(Duration::from_secs(60), "the restore to fail", || {
        w.agent.log().contains("restore of allocation a1")
    });
    assert!(
        w.agent
            .log()
            .contains("NodePublishVolume answered OK but nothing is mounted at"),
        "{}",
        w.agent.log()
    );
    assert!(!is_mount_point(&host));
    let again = host_path(&w.mount("a1", "data=v").ok());
    assert_eq!(again, host);
    assert!(
        is_mount_point(&host),
        "a1 was answered with an empty directory"
    );
    let publishes = w
        .ops()
        .into_iter()
        .filter(|(m, _)| m == "NodePublishVolume")
        .count();
    assert_eq!(publishes, 3, "{:?}", w.ops());
}

/// A mounted allocation asked for again whose re-publish fails is left as
/// it is: its other volume stays mounted and claimed (a rollback would
/// free a claim its workload still uses), and the error is answered.
#[test]
fn a_failed_republish_leaves_the_allocation_as_it_is() {
    let w = World::new(&[]);
    for (id, ext) in [("v", "ext-v"), ("u", "ext-u")] {
        w.plugin.add_volume(ext);
        w.agent
            .register(&volume_json(id, ext, &["single-node-writer"]))
            .ok();
    }
    let args = [
        "alloc", "mount", "a1", "--volume", "data=v", "--volume", "logs=u", "--json",
    ];
    let out = w.cli(&args).ok();
    let paths: Vec<PathBuf> = out.json()["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| PathBuf::from(v["host_path"].as_str().expect("host_path")))
        .collect();
    assert_eq!(paths.len(), 2, "{out:?}");
    let (emptied, kept) = if paths[0].to_string_lossy().contains("/v/") {
        (&paths[0], &paths[1])
    } else {
        (&paths[1], &paths[0])
    };
    let um = std::process::Command::new("umount")
        .arg(emptied)
        .output()
        .expect("run umount");
    assert!(um.status.success(), "{um:?}");
    w.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "empty", "count": 1}
    ]));
    assert_fails(
        &w.cli(&args),
        EXIT_FAILED,
        &["NodePublishVolume answered OK but nothing is mounted at"],
    );
    assert!(is_mount_point(kept), "the other volume was unmounted");
    let claims = w.agent.state()["claims"].clone();
    assert_eq!(claims.as_array().map(Vec::len), Some(2), "{claims}");
    assert!(w.agent.state_allocs().contains_key("a1"));
    // The fault spent, the same mount publishes it again.
    w.cli(&args).ok();
    assert!(is_mount_point(emptied));
}
