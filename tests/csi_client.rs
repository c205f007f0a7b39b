//! `CsiClient` against the real test plugin process over a real unix
//! socket, with real bind mounts: every RPC, every error class, deadlines,
//! undecodable replies and the call log.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use claimd::csi::grpc::{ControllerClient, IdentityClient, NodeClient};
use claimd::csi::volume_capability::access_mode::Mode;
use claimd::csi::*;
use common::*;
use grpcio::{CallOption, ChannelBuilder, RpcStatusCode};
use serde_json::json;

const NODE: &str = "node-a";
/// What the test plugin's controller answers for `volume` on `node`.
fn expected_context(volume: &str, node: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("attached_node".to_string(), node.to_string()),
        ("device".to_string(), format!("/dev/claimd-test/{volume}")),
    ])
}

// ---- Requests ------------------------------------------------------------

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn context_map(ctx: &BTreeMap<String, String>) -> HashMap<String, String> {
    ctx.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("test paths are UTF-8").to_string()
}

fn capability(mode: Mode, block: bool) -> VolumeCapability {
    let mut cap = VolumeCapability::new();
    cap.access_type = Some(if block {
        volume_capability::Access_type::Block(volume_capability::BlockVolume::new())
    } else {
        volume_capability::Access_type::Mount(volume_capability::MountVolume::new())
    });
    let mut am = volume_capability::AccessMode::new();
    am.mode = mode.into();
    cap.access_mode = Some(am).into();
    cap
}

fn controller_publish(volume: &str, node: &str, mode: Mode) -> ControllerPublishVolumeRequest {
    let mut r = ControllerPublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.node_id = node.to_string();
    r.volume_capability = Some(capability(mode, false)).into();
    r
}

fn controller_unpublish(volume: &str, node: &str) -> ControllerUnpublishVolumeRequest {
    let mut r = ControllerUnpublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.node_id = node.to_string();
    r
}

fn stage(volume: &str, staging: &Path, ctx: &BTreeMap<String, String>) -> NodeStageVolumeRequest {
    let mut r = NodeStageVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = path_str(staging);
    r.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, false)).into();
    r.publish_context = context_map(ctx);
    r
}

fn unstage(volume: &str, staging: &Path) -> NodeUnstageVolumeRequest {
    let mut r = NodeUnstageVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = path_str(staging);
    r
}

fn publish(
    volume: &str,
    staging: Option<&Path>,
    target: &Path,
    readonly: bool,
    ctx: &BTreeMap<String, String>,
) -> NodePublishVolumeRequest {
    let mut r = NodePublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = staging.map(path_str).unwrap_or_default();
    r.target_path = path_str(target);
    r.readonly = readonly;
    r.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, false)).into();
    r.publish_context = context_map(ctx);
    r
}

fn unpublish(volume: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    let mut r = NodeUnpublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.target_path = path_str(target);
    r
}

// ---- Assertions ----------------------------------------------------------

/// Asserts a gRPC status error with this code and class; returns it.
#[track_caller]
fn expect_status<T: std::fmt::Debug>(
    result: Result<T, CsiError>,
    code: RpcStatusCode,
    class: ErrorClass,
) -> CsiError {
    let err = result.expect_err("the call should fail");
    assert_eq!(err.code(), Some(code), "unexpected error: {err:?}");
    assert_eq!(err.class(), class, "class of {err:?}");
    err
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(m, c)| (m.to_string(), c.to_string()))
        .collect()
}

// ---- Identity and node info ----------------------------------------------

#[test]
fn identity_calls_report_name_capabilities_and_readiness() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .name("example.csi.test")
        .unknown_capability()
        .start();
    let c = plugin.client();

    let info = c.get_plugin_info().expect("GetPluginInfo");
    assert_eq!(info.name, "example.csi.test");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(
        c.get_plugin_capabilities().expect("GetPluginCapabilities"),
        PluginCapabilities {
            controller_service: true,
            accessibility_constraints: false,
            ..Default::default()
        }
    );
    assert_eq!(c.probe().expect("Probe"), Readiness::Ready);
    assert_eq!(
        c.node_get_capabilities().expect("NodeGetCapabilities"),
        NodeCapabilities {
            stage_unstage_volume: true,
            get_volume_stats: false,
            volume_condition: false,
            ..Default::default()
        }
    );
    assert_eq!(
        c.controller_get_capabilities()
            .expect("ControllerGetCapabilities"),
        ControllerCapabilities {
            create_delete_volume: true,
            publish_unpublish_volume: true,
            publish_readonly: false,
            ..Default::default()
        }
    );

    // The lists on the wire really carry a value no CSI version defines,
    // which the client above ignored.
    let channel =
        ChannelBuilder::new(grpc_env()).connect(&format!("unix:{}", plugin.socket.display()));
    let opt = || CallOption::default().timeout(CALL_TIMEOUT);
    let raw = IdentityClient::new(channel.clone())
        .get_plugin_capabilities(&GetPluginCapabilitiesRequest::new(), opt())
        .expect("raw GetPluginCapabilities");
    let plugin_types: Vec<i32> = raw
        .capabilities
        .iter()
        .map(|c| match &c.type_ {
            Some(plugin_capability::Type::Service(s)) => s.type_.value(),
            _ => -1,
        })
        .collect();
    assert_eq!(plugin_types, vec![1, 99]);
    let raw = NodeClient::new(channel)
        .node_get_capabilities(&NodeGetCapabilitiesRequest::new(), opt())
        .expect("raw NodeGetCapabilities");
    let node_types: Vec<i32> = raw
        .capabilities
        .iter()
        .map(|c| match &c.type_ {
            Some(node_service_capability::Type::Rpc(r)) => r.type_.value(),
            _ => -1,
        })
        .collect();
    assert_eq!(node_types, vec![1, 99]);

    assert_eq!(
        plugin.call_log().methods_and_codes(),
        pairs(&[
            ("GetPluginInfo", "OK"),
            ("GetPluginCapabilities", "OK"),
            ("Probe", "OK"),
            ("NodeGetCapabilities", "OK"),
            ("ControllerGetCapabilities", "OK"),
            ("GetPluginCapabilities", "OK"),
            ("NodeGetCapabilities", "OK"),
        ])
    );
}

#[test]
fn node_get_info_reports_node_id_limit_and_topology() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id("node-7")
        .max_volumes_per_node(3)
        .start();
    let info = plugin.client().node_get_info().expect("NodeGetInfo");
    // No VOLUME_ACCESSIBILITY_CONSTRAINTS without --topology, so no
    // topology either ("a plugin that returns this field MUST also set"
    // that capability).
    assert_eq!(
        info,
        NodeInfo {
            node_id: "node-7".to_string(),
            max_volumes_per_node: 3,
            topology: BTreeMap::new(),
        }
    );
    assert_eq!(plugin.call_log().methods(), vec!["NodeGetInfo"]);

    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id("node-8")
        .args(&["--topology", "zone=z1,rack=r2"])
        .start();
    let c = plugin.client();
    let caps = c.get_plugin_capabilities().expect("GetPluginCapabilities");
    assert!(caps.accessibility_constraints);
    assert_eq!(
        c.node_get_info().expect("NodeGetInfo").topology,
        BTreeMap::from([
            ("rack".to_string(), "r2".to_string()),
            ("zone".to_string(), "z1".to_string()),
        ])
    );
}

// ---- Node: stage, publish, unpublish, unstage ----------------------------

#[test]
fn stage_publish_unpublish_unstage_with_real_mounts() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["vol-1"])
        .start();
    let c = plugin.client();
    let vol = "vol-1";

    let ctx = c
        .controller_publish_volume(&controller_publish(vol, NODE, Mode::SINGLE_NODE_WRITER))
        .expect("ControllerPublish");
    assert_eq!(ctx, expected_context(vol, NODE));

    let staging = dir.mkdir("staging/vol-1");
    let parent = dir.mkdir("alloc/a1");
    let rw_target = parent.join("rw");
    let ro_target = parent.join("ro");

    let mut stage_req = stage(vol, &staging, &ctx);
    stage_req.volume_context = map(&[("from", "create")]);
    c.node_stage_volume(&stage_req).expect("NodeStage");
    assert!(is_mount_point(&staging), "staging path is a mount point");
    c.node_stage_volume(&stage_req).expect("NodeStage again");
    assert_eq!(
        mounts_at(&staging).len(),
        1,
        "a repeated stage mounts nothing more"
    );

    let rw_req = publish(vol, Some(&staging), &rw_target, false, &ctx);
    c.node_publish_volume(&rw_req).expect("NodePublish rw");
    c.node_publish_volume(&publish(vol, Some(&staging), &ro_target, true, &ctx))
        .expect("NodePublish ro");
    c.node_publish_volume(&rw_req)
        .expect("NodePublish rw again");
    assert_eq!(
        mounts_at(&rw_target).len(),
        1,
        "a repeated publish mounts nothing more"
    );

    let rw = mount_at(&rw_target).expect("rw target is a mount point");
    assert!(rw.has_option("rw") && !rw.read_only(), "{rw:?}");
    let ro = mount_at(&ro_target).expect("ro target is a mount point");
    assert!(ro.read_only(), "{ro:?}");

    // One volume, seen through every mount.
    fs::write(staging.join("hello.txt"), "hello").expect("write through the staging path");
    for seen in [
        rw_target.join("hello.txt"),
        ro_target.join("hello.txt"),
        plugin.volume_dir(vol).join("hello.txt"),
    ] {
        assert_eq!(
            fs::read_to_string(&seen).expect("read"),
            "hello",
            "{}",
            seen.display()
        );
    }
    let err = fs::write(ro_target.join("nope"), "x").expect_err("the ro target refuses writes");
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));

    // Publishing the same target writable now is a conflict.
    expect_status(
        c.node_publish_volume(&publish(vol, Some(&staging), &ro_target, false, &ctx)),
        RpcStatusCode::ALREADY_EXISTS,
        ErrorClass::Final,
    );

    for target in [&rw_target, &ro_target] {
        c.node_unpublish_volume(&unpublish(vol, target))
            .expect("NodeUnpublish");
        assert!(!is_mount_point(target));
        assert!(!target.exists(), "the plugin removes the target it made");
        c.node_unpublish_volume(&unpublish(vol, target))
            .expect("NodeUnpublish again");
    }
    assert!(parent.is_dir(), "the target's parent belongs to the CO");

    c.node_unstage_volume(&unstage(vol, &staging))
        .expect("NodeUnstage");
    assert!(!is_mount_point(&staging));
    assert!(staging.is_dir(), "the staging directory belongs to the CO");
    c.node_unstage_volume(&unstage(vol, &staging))
        .expect("NodeUnstage again");
    c.controller_unpublish_volume(&controller_unpublish(vol, NODE))
        .expect("ControllerUnpublish");

    assert_eq!(mounts_under(dir.path()), Vec::<MountEntry>::new());
    assert_eq!(
        fs::read_to_string(plugin.volume_dir(vol).join("hello.txt")).expect("data kept"),
        "hello"
    );

    let log = plugin.call_log();
    assert_eq!(
        log.methods_and_codes(),
        pairs(&[
            ("ControllerPublishVolume", "OK"),
            ("NodeStageVolume", "OK"),
            ("NodeStageVolume", "OK"),
            ("NodePublishVolume", "OK"),
            ("NodePublishVolume", "OK"),
            ("NodePublishVolume", "OK"),
            ("NodePublishVolume", "ALREADY_EXISTS"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnstageVolume", "OK"),
            ("NodeUnstageVolume", "OK"),
            ("ControllerUnpublishVolume", "OK"),
        ])
    );
    let staged = &log.calls_of("NodeStageVolume")[0];
    assert_eq!(staged["volume_id"], vol);
    assert_eq!(staged["staging_target_path"], path_str(&staging));
    assert_eq!(staged["access_mode"], "SINGLE_NODE_WRITER");
    assert_eq!(staged["publish_context"], json!(ctx));
    assert_eq!(staged["volume_context"], json!({"from": "create"}));
    assert_eq!(staged["secret_keys"], json!([]));
    let published = log.calls_of("NodePublishVolume");
    assert_eq!(published[1]["target_path"], path_str(&ro_target));
    assert_eq!(published[1]["readonly"], true);
    assert_eq!(log.calls_of("ControllerPublishVolume")[0]["node_id"], NODE);
}

#[test]
fn without_stage_publish_binds_the_volume_itself() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_stage()
        .no_controller()
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    assert!(
        !c.node_get_capabilities()
            .expect("caps")
            .stage_unstage_volume
    );
    assert!(
        !c.get_plugin_capabilities()
            .expect("caps")
            .controller_service
    );

    let staging = dir.mkdir("staging");
    expect_status(
        c.node_stage_volume(&stage("v", &staging, &BTreeMap::new())),
        RpcStatusCode::UNIMPLEMENTED,
        ErrorClass::Final,
    );
    assert!(!is_mount_point(&staging));

    let target = dir.mkdir("alloc").join("t");
    c.node_publish_volume(&publish("v", None, &target, false, &BTreeMap::new()))
        .expect("NodePublish");
    assert!(is_mount_point(&target));
    fs::write(plugin.volume_dir("v").join("f"), "data").expect("write into the volume");
    assert_eq!(fs::read_to_string(target.join("f")).expect("read"), "data");
    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    assert!(!target.exists());
    assert!(mounts_under(dir.path()).is_empty());

    // Controller RPCs are not served.
    for err in [
        c.controller_get_capabilities().map(drop).expect_err("caps"),
        c.controller_publish_volume(&controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER))
            .map(drop)
            .expect_err("publish"),
    ] {
        assert_eq!(err.code(), Some(RpcStatusCode::UNIMPLEMENTED), "{err:?}");
        assert_eq!(err.class(), ErrorClass::Final);
    }
}

#[test]
fn block_volume_is_a_file_bound_onto_a_file_target() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["blk"])
        .start();
    let c = plugin.client();
    let ctx = c
        .controller_publish_volume(&controller_publish("blk", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("ControllerPublish");
    let staging = dir.mkdir("staging");
    let mut stage_req = stage("blk", &staging, &ctx);
    stage_req.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, true)).into();
    c.node_stage_volume(&stage_req).expect("NodeStage block");
    assert!(
        !is_mount_point(&staging),
        "block volumes stage nothing here"
    );

    let target = dir.mkdir("alloc").join("dev");
    let mut req = publish("blk", Some(&staging), &target, false, &ctx);
    req.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, true)).into();
    c.node_publish_volume(&req).expect("NodePublish block");
    c.node_publish_volume(&req)
        .expect("NodePublish block again");
    assert_eq!(mounts_at(&target).len(), 1);
    assert!(target.is_file());
    fs::write(&target, b"block bytes").expect("write the device");
    let image = plugin.root.join("volumes/blk.img");
    assert_eq!(&fs::read(&image).expect("read image")[..11], b"block bytes");

    c.node_unpublish_volume(&unpublish("blk", &target))
        .expect("NodeUnpublish");
    assert!(!target.exists());
    c.node_unstage_volume(&unstage("blk", &staging))
        .expect("NodeUnstage");
    assert!(mounts_under(dir.path()).is_empty());
}

#[test]
fn publish_refuses_a_missing_target_parent_and_an_unstaged_volume() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let ctx = c
        .controller_publish_volume(&controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("ControllerPublish");
    let staging = dir.mkdir("staging");

    let orphan = dir.path().join("no-such-parent/target");
    expect_status(
        c.node_publish_volume(&publish("v", Some(&staging), &orphan, false, &ctx)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(!orphan.parent().expect("parent").exists());

    let target = dir.mkdir("alloc").join("t");
    expect_status(
        c.node_publish_volume(&publish("v", Some(&staging), &target, false, &ctx)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(!target.exists(), "nothing is created for a refused publish");
}

#[test]
fn invalid_arguments_are_final() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).node_id(NODE).start();
    let c = plugin.client();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let none = BTreeMap::new();

    for bad_id in ["", "a/b", "..", "x..y"] {
        expect_status(
            c.node_stage_volume(&stage(bad_id, &staging, &none)),
            RpcStatusCode::INVALID_ARGUMENT,
            ErrorClass::Final,
        );
        expect_status(
            c.node_unpublish_volume(&unpublish(bad_id, &target)),
            RpcStatusCode::INVALID_ARGUMENT,
            ErrorClass::Final,
        );
        expect_status(
            c.controller_unpublish_volume(&controller_unpublish(bad_id, NODE)),
            RpcStatusCode::INVALID_ARGUMENT,
            ErrorClass::Final,
        );
    }
    for bad_path in ["", "relative/path", "/tmp/../etc"] {
        let mut r = unstage("v", &staging);
        r.staging_target_path = bad_path.to_string();
        expect_status(
            c.node_unstage_volume(&r),
            RpcStatusCode::INVALID_ARGUMENT,
            ErrorClass::Final,
        );
        let mut r = unpublish("v", &target);
        r.target_path = bad_path.to_string();
        expect_status(
            c.node_unpublish_volume(&r),
            RpcStatusCode::INVALID_ARGUMENT,
            ErrorClass::Final,
        );
    }
    let mut no_cap = stage("v", &staging, &none);
    no_cap.volume_capability = None.into();
    expect_status(
        c.node_stage_volume(&no_cap),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    // ControllerPublish needs a node ID and an access mode.
    expect_status(
        c.controller_publish_volume(&controller_publish("v", "", Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    expect_status(
        c.controller_publish_volume(&controller_publish("v", NODE, Mode::UNKNOWN)),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    assert!(mounts_under(dir.path()).is_empty());
    assert!(plugin.controller_state().is_none(), "nothing was attached");
    assert!(plugin
        .call_log()
        .calls()
        .iter()
        .all(|c| c["code"] == "INVALID_ARGUMENT"));
}

/// A volume_path that is not absolute names no mounted volume: the spec's
/// NOT_FOUND ("volume does not exist on specified volume_path"), as
/// csi-sanity expects, in NodeGetVolumeStats and NodeExpandVolume alike; a
/// missing one is INVALID_ARGUMENT. The same for an absolute path where the
/// volume is not mounted.
#[test]
fn a_volume_path_that_is_relative_or_not_the_volume_is_not_found() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v", "w"])
        .args(&["--volume-stats", "--expansion"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    c.node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    c.node_publish_volume(&publish("v", Some(&staging), &target, false, &none))
        .expect("NodePublish");
    let stats = |volume: &str, path: &str| NodeGetVolumeStatsRequest {
        volume_id: volume.to_string(),
        volume_path: path.to_string(),
        ..Default::default()
    };
    let expand = |volume: &str, path: &str, staging: &str| NodeExpandVolumeRequest {
        volume_id: volume.to_string(),
        volume_path: path.to_string(),
        staging_target_path: staging.to_string(),
        ..Default::default()
    };
    let target_s = path_str(&target);
    c.node_get_volume_stats(&stats("v", &target_s))
        .expect("stats where v is published");
    c.node_expand_volume(&expand("v", &target_s, &path_str(&staging)))
        .expect("expand where v is published and staged");

    let not_mounted = path_str(&dir.mkdir("empty"));
    for bad in [
        "relative/path",
        "alloc/t",
        ".",
        "/tmp/../etc",
        not_mounted.as_str(),
    ] {
        let e = expect_status(
            c.node_get_volume_stats(&stats("v", bad)),
            RpcStatusCode::NOT_FOUND,
            ErrorClass::Final,
        );
        assert!(e.to_string().contains(bad), "{e}");
        expect_status(
            c.node_expand_volume(&expand("v", bad, "")),
            RpcStatusCode::NOT_FOUND,
            ErrorClass::Final,
        );
        expect_status(
            c.node_expand_volume(&expand("v", &target_s, bad)),
            RpcStatusCode::NOT_FOUND,
            ErrorClass::Final,
        );
    }
    // Another volume than the one mounted there.
    expect_status(
        c.node_get_volume_stats(&stats("w", &target_s)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
    expect_status(
        c.node_get_volume_stats(&stats("v", "")),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    expect_status(
        c.node_expand_volume(&expand("v", "", "")),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    assert!(is_mount_point(&target), "nothing was undone");
}

// ---- Controller ----------------------------------------------------------

#[test]
fn controller_publish_is_idempotent_and_exclusive_for_single_node_modes() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path())
        .known_nodes(&["node-a", "node-b"])
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let req_a = controller_publish("v", "node-a", Mode::SINGLE_NODE_WRITER);

    let ctx = c.controller_publish_volume(&req_a).expect("publish to a");
    assert_eq!(ctx, expected_context("v", "node-a"));
    assert_eq!(
        c.controller_publish_volume(&req_a)
            .expect("publish to a again"),
        ctx
    );
    expect_status(
        c.controller_publish_volume(&controller_publish("v", "node-b", Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Retryable,
    );
    assert_eq!(
        plugin.controller_state().expect("controller.json")["attachments"],
        json!({"v": {"node-a": {"access_mode": "SINGLE_NODE_WRITER", "readonly": false}}})
    );

    // Attachments survive a plugin restart.
    plugin.restart();
    let c = plugin.client();
    expect_status(
        c.controller_publish_volume(&controller_publish("v", "node-b", Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Retryable,
    );
    c.controller_unpublish_volume(&controller_unpublish("v", "node-a"))
        .expect("unpublish from a");
    c.controller_unpublish_volume(&controller_unpublish("v", "node-a"))
        .expect("unpublish from a again");
    assert_eq!(
        c.controller_publish_volume(&controller_publish("v", "node-b", Mode::SINGLE_NODE_WRITER))
            .expect("publish to b once a is detached"),
        expected_context("v", "node-b")
    );
}

#[test]
fn multi_node_volumes_attach_to_several_nodes_and_detach_from_all() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .known_nodes(&["n1", "n2", "n3"])
        .volumes(&["shared"])
        .start();
    let c = plugin.client();
    for node in ["n1", "n2", "n3"] {
        c.controller_publish_volume(&controller_publish(
            "shared",
            node,
            Mode::MULTI_NODE_MULTI_WRITER,
        ))
        .expect("multi-node publish");
    }
    assert_eq!(
        plugin.controller_state().expect("state")["attachments"]["shared"]
            .as_object()
            .expect("nodes")
            .len(),
        3
    );
    // An empty node ID detaches from every node.
    c.controller_unpublish_volume(&controller_unpublish("shared", ""))
        .expect("unpublish everywhere");
    assert_eq!(
        plugin.controller_state().expect("state")["attachments"],
        json!({})
    );
}

#[test]
fn node_stage_before_controller_publish_is_refused() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .known_nodes(&["elsewhere"])
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let staging = dir.mkdir("staging");
    expect_status(
        c.node_stage_volume(&stage("v", &staging, &BTreeMap::new())),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(!is_mount_point(&staging));
    // Attached to another node is not attached here.
    c.controller_publish_volume(&controller_publish(
        "v",
        "elsewhere",
        Mode::SINGLE_NODE_WRITER,
    ))
    .expect("publish elsewhere");
    expect_status(
        c.node_stage_volume(&stage("v", &staging, &BTreeMap::new())),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(!is_mount_point(&staging));
}

#[test]
fn attachments_per_node_are_limited() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .known_nodes(&["other"])
        .volumes(&["v1", "v2"])
        .max_volumes_per_node(1)
        .start();
    let c = plugin.client();
    c.controller_publish_volume(&controller_publish("v1", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("first volume");
    expect_status(
        c.controller_publish_volume(&controller_publish("v2", NODE, Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::RESOURCE_EXHAUSTED,
        ErrorClass::Retryable,
    );
    c.controller_publish_volume(&controller_publish("v2", "other", Mode::SINGLE_NODE_WRITER))
        .expect("another node has room");
}

#[test]
fn create_and_delete_volume() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).node_id(NODE).start();
    let c = plugin.client();
    let mut req = CreateVolumeRequest::new();
    req.name = "made".to_string();
    req.volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    let vol = c.create_volume(&req).expect("CreateVolume");
    assert_eq!(vol.volume_id, "made");
    assert_eq!(
        vol.volume_context
            .get("claimd.test/volume")
            .map(String::as_str),
        Some("made")
    );
    assert!(plugin.volume_dir("made").is_dir());
    assert_eq!(c.create_volume(&req).expect("again").volume_id, "made");

    // An attached volume cannot be deleted.
    c.controller_publish_volume(&controller_publish("made", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("attach");
    let mut del = DeleteVolumeRequest::new();
    del.volume_id = "made".to_string();
    expect_status(
        c.delete_volume(&del),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(plugin.volume_dir("made").is_dir());
    c.controller_unpublish_volume(&controller_unpublish("made", NODE))
        .expect("detach");
    c.delete_volume(&del).expect("DeleteVolume");
    assert!(!plugin.volume_dir("made").exists());
    c.delete_volume(&del).expect("DeleteVolume again");
}

#[test]
fn required_contexts_must_be_passed_unchanged() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .require_contexts()
        .start();
    let c = plugin.client();
    let mut create = CreateVolumeRequest::new();
    create.name = "v".to_string();
    create
        .volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    let volume_context = context_map(
        &c.create_volume(&create)
            .expect("CreateVolume")
            .volume_context
            .into_iter()
            .collect(),
    );
    let ctx = c
        .controller_publish_volume(&controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("ControllerPublish");
    let staging = dir.mkdir("staging");

    let mut req = stage("v", &staging, &BTreeMap::new());
    req.volume_context = volume_context.clone();
    expect_status(
        c.node_stage_volume(&req),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    let mut req = stage("v", &staging, &ctx);
    expect_status(
        c.node_stage_volume(&req),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    assert!(!is_mount_point(&staging));
    req.volume_context = volume_context;
    c.node_stage_volume(&req)
        .expect("NodeStage with both contexts");
    assert!(is_mount_point(&staging));
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
}

// ---- Strict like a real plugin: the spec's refusals ----------------------

/// A raw Controller client (for ValidateVolumeCapabilities, which claimd
/// does not call).
fn raw_controller(plugin: &TestPlugin) -> ControllerClient {
    let channel =
        ChannelBuilder::new(grpc_env()).connect(&format!("unix:{}", plugin.socket.display()));
    ControllerClient::new(channel)
}

/// The status code of a raw call's error.
#[track_caller]
fn raw_code<T: std::fmt::Debug>(r: grpcio::Result<T>) -> RpcStatusCode {
    match r.expect_err("the call should fail") {
        grpcio::Error::RpcFailure(s) => s.code(),
        e => panic!("not a status: {e:?}"),
    }
}

fn call_codes(plugin: &TestPlugin, method: &str) -> Vec<String> {
    plugin
        .call_log()
        .calls_of(method)
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect()
}

#[test]
fn controller_publish_refuses_unknown_volumes_and_nodes() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .known_nodes(&["node-b"])
        .volumes(&["v"])
        .start();
    let c = plugin.client();

    let err = expect_status(
        c.controller_publish_volume(&controller_publish(
            "nosuch",
            NODE,
            Mode::SINGLE_NODE_WRITER,
        )),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
    assert!(
        err.to_string().contains("volume nosuch does not exist"),
        "{err}"
    );
    let err = expect_status(
        c.controller_publish_volume(&controller_publish("v", "node-x", Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
    assert!(
        err.to_string().contains("node node-x does not exist"),
        "{err}"
    );
    assert!(plugin.controller_state().is_none(), "nothing was attached");
    assert!(!plugin.volume_dir("nosuch").exists(), "no volume is made");

    // Its own node and the known ones are accepted; the file is re-read on
    // every call.
    c.controller_publish_volume(&controller_publish(
        "v",
        NODE,
        Mode::MULTI_NODE_MULTI_WRITER,
    ))
    .expect("own node");
    c.controller_publish_volume(&controller_publish(
        "v",
        "node-b",
        Mode::MULTI_NODE_MULTI_WRITER,
    ))
    .expect("known node");
    plugin.add_known_node("node-x");
    c.controller_publish_volume(&controller_publish(
        "v",
        "node-x",
        Mode::MULTI_NODE_MULTI_WRITER,
    ))
    .expect("a node added while the plugin runs");
    assert_eq!(
        plugin.controller_state().expect("controller.json")["attachments"]["v"]
            .as_object()
            .expect("nodes")
            .keys()
            .collect::<Vec<_>>(),
        ["node-a", "node-b", "node-x"]
    );

    // A single-node volume attached to one node is refused to another,
    // naming the node it is attached to.
    plugin.add_volume("solo");
    c.controller_publish_volume(&controller_publish("solo", NODE, Mode::SINGLE_NODE_WRITER))
        .expect("solo on node-a");
    let err = expect_status(
        c.controller_publish_volume(&controller_publish(
            "solo",
            "node-b",
            Mode::SINGLE_NODE_READER_ONLY,
        )),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Retryable,
    );
    assert!(err.to_string().contains("node-a"), "{err}");
    assert_eq!(
        plugin.controller_state().expect("controller.json")["attachments"]["solo"],
        json!({"node-a": {"access_mode": "SINGLE_NODE_WRITER", "readonly": false}})
    );

    // ControllerUnpublish of what is not attached is done (the spec's
    // "MUST reply 0 OK"), unknown volume or node alike.
    c.controller_unpublish_volume(&controller_unpublish("nosuch", NODE))
        .expect("unknown volume");
    c.controller_unpublish_volume(&controller_unpublish("solo", "node-y"))
        .expect("unknown node");
    assert_eq!(
        call_codes(&plugin, "ControllerPublishVolume"),
        [
            "NOT_FOUND",
            "NOT_FOUND",
            "OK",
            "OK",
            "OK",
            "OK",
            "FAILED_PRECONDITION"
        ]
    );
    assert_eq!(
        plugin.controller_state().expect("controller.json")["attachments"]["solo"],
        json!({"node-a": {"access_mode": "SINGLE_NODE_WRITER", "readonly": false}})
    );
}

#[test]
fn node_calls_refuse_unknown_volumes_and_touch_nothing() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    c.node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    c.node_publish_volume(&publish("v", Some(&staging), &target, false, &none))
        .expect("NodePublish");

    let other_staging = dir.mkdir("staging-x");
    let other_target = dir.path().join("alloc/x");
    expect_status(
        c.node_stage_volume(&stage("nosuch", &other_staging, &none)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
    expect_status(
        c.node_publish_volume(&publish(
            "nosuch",
            Some(&staging),
            &other_target,
            false,
            &none,
        )),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
    // Teardown with an unknown volume ID: NOT_FOUND (which an agent takes
    // as done) without unmounting what is there.
    expect_status(
        c.node_unpublish_volume(&unpublish("nosuch", &target)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Ignorable,
    );
    expect_status(
        c.node_unstage_volume(&unstage("nosuch", &staging)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Ignorable,
    );
    assert!(!is_mount_point(&other_staging));
    assert!(!other_target.exists(), "no target was made");
    assert!(is_mount_point(&target) && is_mount_point(&staging));
    assert!(!plugin.volume_dir("nosuch").exists(), "no volume was made");

    // Teardown with another volume's ID where a volume is mounted:
    // refused, the mount stays.
    plugin.add_volume("w");
    let err = expect_status(
        c.node_unpublish_volume(&unpublish("w", &target)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(err.to_string().contains("another volume"), "{err}");
    expect_status(
        c.node_unstage_volume(&unstage("w", &staging)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    // Publishing w from v's staging path: w is not staged there.
    let err = expect_status(
        c.node_publish_volume(&publish("w", Some(&staging), &other_target, false, &none)),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(err.to_string().contains("not staged"), "{err}");
    assert!(!other_target.exists());
    assert_eq!(mounts_at(&target).len(), 1);
    assert_eq!(mounts_at(&staging).len(), 1);

    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
    assert!(mounts_under(dir.path()).is_empty());
    assert_eq!(
        plugin.call_log().methods_and_codes(),
        pairs(&[
            ("NodeStageVolume", "OK"),
            ("NodePublishVolume", "OK"),
            ("NodeStageVolume", "NOT_FOUND"),
            ("NodePublishVolume", "NOT_FOUND"),
            ("NodeUnpublishVolume", "NOT_FOUND"),
            ("NodeUnstageVolume", "NOT_FOUND"),
            ("NodeUnpublishVolume", "FAILED_PRECONDITION"),
            ("NodeUnstageVolume", "FAILED_PRECONDITION"),
            ("NodePublishVolume", "FAILED_PRECONDITION"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnstageVolume", "OK"),
        ])
    );
}

#[test]
fn a_volume_is_staged_at_one_staging_path_only() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let none = BTreeMap::new();
    let first = dir.mkdir("staging/rw");
    let second = dir.mkdir("staging/ro");
    let c = plugin.client();
    c.node_stage_volume(&stage("v", &first, &none))
        .expect("NodeStage");

    let refuse = |c: &CsiClient| {
        let err = expect_status(
            c.node_stage_volume(&stage("v", &second, &none)),
            RpcStatusCode::FAILED_PRECONDITION,
            ErrorClass::Final,
        );
        assert!(
            err.to_string().contains(&format!(
                "volume v is already staged at {}",
                first.display()
            )),
            "the refusal names the existing staging path: {err}"
        );
        assert!(
            !is_mount_point(&second),
            "nothing is mounted at the second path"
        );
        assert_eq!(mounts_at(&first).len(), 1, "the first staging is untouched");
    };
    refuse(&c);
    // Staging again at the first path is idempotent.
    c.node_stage_volume(&stage("v", &first, &none))
        .expect("NodeStage at the same path");
    assert_eq!(mounts_at(&first).len(), 1);
    // The plugin remembers across a restart.
    plugin.restart();
    let c = plugin.client();
    refuse(&c);
    // An unstage of the second path (where it is not staged) changes
    // nothing; once unstaged from the first, the second path is free.
    c.node_unstage_volume(&unstage("v", &second))
        .expect("NodeUnstage where it is not staged");
    refuse(&c);
    c.node_unstage_volume(&unstage("v", &first))
        .expect("NodeUnstage");
    c.node_stage_volume(&stage("v", &second, &none))
        .expect("NodeStage at the second path once the first is unstaged");
    assert!(is_mount_point(&second) && !is_mount_point(&first));

    // A staging that is gone (a reboot, an administrator's umount) no
    // longer counts.
    let status = admin_umount(&second);
    assert_eq!(status, 0, "umount {}", second.display());
    c.node_stage_volume(&stage("v", &first, &none))
        .expect("NodeStage after the old staging vanished");
    assert!(is_mount_point(&first));
    c.node_unstage_volume(&unstage("v", &first))
        .expect("NodeUnstage");
    assert!(mounts_under(dir.path()).is_empty());
    assert_eq!(
        call_codes(&plugin, "NodeStageVolume"),
        [
            "OK",
            "FAILED_PRECONDITION",
            "OK",
            "FAILED_PRECONDITION",
            "FAILED_PRECONDITION",
            "OK",
            "OK"
        ]
    );
}

/// umount(2) of a path, as an administrator would; the return code.
fn admin_umount(path: &Path) -> i32 {
    let c = std::ffi::CString::new(path.to_str().expect("UTF-8")).expect("no NUL");
    // SAFETY: a valid NUL-terminated path that outlives the call.
    unsafe { libc::umount2(c.as_ptr(), 0) }
}

#[test]
fn a_block_volume_is_staged_at_one_staging_path_and_published_only_once_staged() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["blk"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let block = |mut r: NodeStageVolumeRequest| {
        r.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, true)).into();
        r
    };
    let (first, second) = (dir.mkdir("staging/a"), dir.mkdir("staging/b"));
    let target = dir.mkdir("alloc").join("dev");
    let mut pub_req = publish("blk", Some(&first), &target, false, &none);
    pub_req.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, true)).into();
    expect_status(
        c.node_publish_volume(&pub_req),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(!target.exists());
    c.node_stage_volume(&block(stage("blk", &first, &none)))
        .expect("NodeStage block");
    let err = expect_status(
        c.node_stage_volume(&block(stage("blk", &second, &none))),
        RpcStatusCode::FAILED_PRECONDITION,
        ErrorClass::Final,
    );
    assert!(
        err.to_string().contains(&first.display().to_string()),
        "{err}"
    );
    // Staged as block, so not as a file system at the same path.
    expect_status(
        c.node_stage_volume(&stage("blk", &first, &none)),
        RpcStatusCode::ALREADY_EXISTS,
        ErrorClass::Final,
    );
    assert!(!is_mount_point(&first) && !is_mount_point(&second));
    c.node_publish_volume(&pub_req)
        .expect("NodePublish once staged");
    assert!(is_mount_point(&target));
    c.node_unpublish_volume(&unpublish("blk", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("blk", &first))
        .expect("NodeUnstage");
    c.node_stage_volume(&block(stage("blk", &second, &none)))
        .expect("NodeStage at the other path once unstaged");
    assert!(mounts_under(dir.path()).is_empty());
}

#[test]
fn create_volume_is_idempotent_and_refuses_an_incompatible_request_for_a_name() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    let c = plugin.client();
    let create = |required: i64, limit: i64, params: &[(&str, &str)]| {
        let mut req = CreateVolumeRequest::new();
        req.name = "made".to_string();
        req.volume_capabilities
            .push(capability(Mode::SINGLE_NODE_WRITER, false));
        let mut range = CapacityRange::new();
        range.required_bytes = required;
        range.limit_bytes = limit;
        req.capacity_range = Some(range).into();
        req.parameters = map(params);
        req
    };
    const GIB: i64 = 1 << 30;
    let vol = c
        .create_volume(&create(GIB, 0, &[("tier", "gold")]))
        .expect("CreateVolume");
    assert_eq!(vol.capacity_bytes, GIB);
    let state = plugin.controller_state().expect("controller.json");
    // The same request, or one the volume satisfies, is the same volume.
    for (required, limit) in [(GIB, 0), (GIB / 2, 0), (0, 2 * GIB), (GIB, GIB)] {
        let again = c
            .create_volume(&create(required, limit, &[("tier", "gold")]))
            .expect("CreateVolume again");
        assert_eq!(again, vol, "required {required} limit {limit}");
    }
    // A capacity the volume does not have, or other parameters: the
    // spec's ALREADY_EXISTS.
    for (required, limit, params) in [
        (2 * GIB, 0, [("tier", "gold")]),
        (0, GIB / 2, [("tier", "gold")]),
        (GIB, 0, [("tier", "lead")]),
    ] {
        expect_status(
            c.create_volume(&create(required, limit, &params)),
            RpcStatusCode::ALREADY_EXISTS,
            ErrorClass::Final,
        );
    }
    expect_status(
        c.create_volume(&create(2 * GIB, GIB, &[])),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    assert_eq!(plugin.controller_state().expect("controller.json"), state);
    assert_eq!(
        call_codes(&plugin, "CreateVolume"),
        [
            "OK",
            "OK",
            "OK",
            "OK",
            "OK",
            "ALREADY_EXISTS",
            "ALREADY_EXISTS",
            "ALREADY_EXISTS",
            "INVALID_ARGUMENT"
        ]
    );
}

#[test]
fn validate_volume_capabilities_confirms_known_volumes_only() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).volumes(&["pre"]).start();
    let c = plugin.client();
    let mut create = CreateVolumeRequest::new();
    create.name = "made".to_string();
    create
        .volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    c.create_volume(&create).expect("CreateVolume");
    let raw = raw_controller(&plugin);
    let opt = || CallOption::default().timeout(CALL_TIMEOUT);
    let request = |id: &str, caps: Vec<VolumeCapability>| {
        let mut r = ValidateVolumeCapabilitiesRequest::new();
        r.volume_id = id.to_string();
        r.volume_capabilities = caps;
        r.parameters = map(&[("p", "1")]);
        r
    };
    let caps = vec![
        capability(Mode::SINGLE_NODE_WRITER, false),
        capability(Mode::MULTI_NODE_READER_ONLY, true),
    ];
    for id in ["pre", "made"] {
        let r = raw
            .validate_volume_capabilities(&request(id, caps.clone()), opt())
            .expect("ValidateVolumeCapabilities");
        let confirmed = r.confirmed.as_ref().expect("confirmed");
        assert_eq!(confirmed.volume_capabilities, caps, "{id}");
        assert_eq!(confirmed.parameters, map(&[("p", "1")]));
    }
    assert_eq!(
        raw_code(raw.validate_volume_capabilities(&request("nosuch", caps.clone()), opt())),
        RpcStatusCode::NOT_FOUND
    );
    let mut no_mode = capability(Mode::SINGLE_NODE_WRITER, false);
    no_mode.access_mode = None.into();
    for bad in [
        request("", caps.clone()),
        request("pre", Vec::new()),
        request("pre", vec![no_mode]),
    ] {
        assert_eq!(
            raw_code(raw.validate_volume_capabilities(&bad, opt())),
            RpcStatusCode::INVALID_ARGUMENT,
            "{bad:?}"
        );
    }
    assert!(!plugin.volume_dir("nosuch").exists());
    assert_eq!(
        call_codes(&plugin, "ValidateVolumeCapabilities"),
        [
            "OK",
            "OK",
            "NOT_FOUND",
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT"
        ]
    );
}

#[test]
fn every_rpc_refuses_missing_required_fields() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let no_mode = || {
        let mut cap = capability(Mode::SINGLE_NODE_WRITER, false);
        cap.access_mode = None.into();
        Some(cap).into()
    };
    let no_type = || {
        let mut cap = capability(Mode::SINGLE_NODE_WRITER, false);
        cap.access_type = None;
        Some(cap).into()
    };
    let invalid = |r: Result<(), CsiError>, what: &str| {
        let err = r.expect_err(what);
        assert_eq!(
            err.code(),
            Some(RpcStatusCode::INVALID_ARGUMENT),
            "{what}: {err:?}"
        );
    };

    let mut r = controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER);
    r.volume_capability = None.into();
    invalid(
        c.controller_publish_volume(&r).map(drop),
        "ControllerPublish without capability",
    );
    r.volume_capability = no_type();
    invalid(
        c.controller_publish_volume(&r).map(drop),
        "ControllerPublish without access type",
    );
    invalid(
        c.controller_unpublish_volume(&controller_unpublish("", NODE)),
        "ControllerUnpublish without volume_id",
    );

    let mut r = stage("v", &staging, &none);
    r.volume_capability = no_mode();
    invalid(c.node_stage_volume(&r), "NodeStage without access mode");
    let mut r = stage("v", &staging, &none);
    r.staging_target_path.clear();
    invalid(c.node_stage_volume(&r), "NodeStage without staging path");
    invalid(
        c.node_unstage_volume(&unstage("", &staging)),
        "NodeUnstage without volume_id",
    );

    let mut r = publish("v", Some(&staging), &target, false, &none);
    r.volume_capability = None.into();
    invalid(c.node_publish_volume(&r), "NodePublish without capability");
    let mut r = publish("v", Some(&staging), &target, false, &none);
    r.volume_capability = no_mode();
    invalid(c.node_publish_volume(&r), "NodePublish without access mode");
    let mut r = publish("v", Some(&staging), &target, false, &none);
    r.target_path.clear();
    invalid(c.node_publish_volume(&r), "NodePublish without target");
    invalid(
        c.node_publish_volume(&publish("", Some(&staging), &target, false, &none)),
        "NodePublish without volume_id",
    );
    invalid(
        c.node_unpublish_volume(&unpublish("", &target)),
        "NodeUnpublish without volume_id",
    );

    let mut create = CreateVolumeRequest::new();
    create
        .volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    invalid(
        c.create_volume(&create).map(drop),
        "CreateVolume without name",
    );
    create.name = "made".to_string();
    create.volume_capabilities[0].access_mode = None.into();
    invalid(
        c.create_volume(&create).map(drop),
        "CreateVolume without access mode",
    );
    invalid(
        c.delete_volume(&DeleteVolumeRequest::new()),
        "DeleteVolume without volume_id",
    );

    // With STAGE_UNSTAGE_VOLUME, NodePublish without a staging path is
    // the spec's FAILED_PRECONDITION ("Staging target path not set").
    let err = c
        .node_publish_volume(&publish("v", None, &target, false, &none))
        .expect_err("NodePublish without staging path");
    assert_eq!(
        err.code(),
        Some(RpcStatusCode::FAILED_PRECONDITION),
        "{err:?}"
    );

    assert!(mounts_under(dir.path()).is_empty());
    assert!(!target.exists());
    assert!(
        plugin.controller_state().is_none(),
        "nothing was attached or created"
    );
    let invalid = "INVALID_ARGUMENT";
    assert_eq!(
        plugin.call_log().methods_and_codes(),
        pairs(&[
            ("ControllerPublishVolume", invalid),
            ("ControllerPublishVolume", invalid),
            ("ControllerUnpublishVolume", invalid),
            ("NodeStageVolume", invalid),
            ("NodeStageVolume", invalid),
            ("NodeUnstageVolume", invalid),
            ("NodePublishVolume", invalid),
            ("NodePublishVolume", invalid),
            ("NodePublishVolume", invalid),
            ("NodePublishVolume", invalid),
            ("NodeUnpublishVolume", invalid),
            ("CreateVolume", invalid),
            ("CreateVolume", invalid),
            ("DeleteVolume", invalid),
            ("NodePublishVolume", "FAILED_PRECONDITION"),
        ])
    );
}

#[test]
fn unknown_capabilities_are_advertised_only_with_the_flag() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    let channel =
        ChannelBuilder::new(grpc_env()).connect(&format!("unix:{}", plugin.socket.display()));
    let opt = || CallOption::default().timeout(CALL_TIMEOUT);
    let plugin_caps = IdentityClient::new(channel.clone())
        .get_plugin_capabilities(&GetPluginCapabilitiesRequest::new(), opt())
        .expect("GetPluginCapabilities");
    assert_eq!(plugin_caps.capabilities.len(), 1, "{plugin_caps:?}");
    let node_caps = NodeClient::new(channel.clone())
        .node_get_capabilities(&NodeGetCapabilitiesRequest::new(), opt())
        .expect("NodeGetCapabilities");
    assert_eq!(node_caps.capabilities.len(), 1, "{node_caps:?}");
    let controller_caps = ControllerClient::new(channel)
        .controller_get_capabilities(&ControllerGetCapabilitiesRequest::new(), opt())
        .expect("ControllerGetCapabilities");
    let types: Vec<i32> = controller_caps
        .capabilities
        .iter()
        .map(|c| match &c.type_ {
            Some(controller_service_capability::Type::Rpc(r)) => r.type_.value(),
            _ => -1,
        })
        .collect();
    assert_eq!(types, vec![2, 1]);
}

/// Milliseconds since the epoch, as the call log's `ts_ms`.
fn now_ms() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch");
    u64::try_from(d.as_millis()).expect("fits")
}

#[test]
fn a_late_call_times_out_for_the_caller_and_takes_effect_afterwards() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .node_id(NODE)
        .volumes(&["v"])
        .start();
    const AFTER_MS: u64 = 2000;
    plugin.faults().set(json!([
        {"method": "ControllerPublishVolume", "action": "late", "ms": AFTER_MS, "count": 1},
        {"method": "NodeStageVolume", "action": "late", "ms": AFTER_MS, "count": 1},
        {"method": "NodePublishVolume", "action": "late", "ms": AFTER_MS, "count": 1}
    ]));
    let deadline = Duration::from_millis(300);
    let c = plugin.client_with_timeout(deadline);
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let log = plugin.call_log();
    let wait_logged = |method: &str| {
        wait_until(
            Duration::from_secs(20),
            &format!("the late {method}"),
            || !log.calls_of(method).is_empty(),
        );
        let call = log.calls_of(method).remove(0);
        assert_eq!(call["late"], true, "{call}");
        assert_eq!(call["code"], "OK", "{call}");
        call
    };

    let started = Instant::now();
    expect_status(
        c.controller_publish_volume(&controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    let timed_out = now_ms();
    assert!(
        started.elapsed() < Duration::from_millis(AFTER_MS),
        "{:?}",
        started.elapsed()
    );
    assert!(
        plugin.controller_state().is_none(),
        "not attached when the caller gave up"
    );
    let call = wait_logged("ControllerPublishVolume");
    assert!(call["ts_ms"].as_u64().expect("ts") >= timed_out, "{call}");
    assert_eq!(
        plugin.controller_state().expect("attached late")["attachments"]["v"],
        json!({"node-a": {"access_mode": "SINGLE_NODE_WRITER", "readonly": false}})
    );

    let ctx = expected_context("v", NODE);
    expect_status(
        c.node_stage_volume(&stage("v", &staging, &ctx)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    assert!(
        !is_mount_point(&staging),
        "not staged when the caller gave up"
    );
    wait_logged("NodeStageVolume");
    assert!(is_mount_point(&staging), "staged late");

    expect_status(
        c.node_publish_volume(&publish("v", Some(&staging), &target, false, &ctx)),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    assert!(
        !is_mount_point(&target),
        "not published when the caller gave up"
    );
    wait_logged("NodePublishVolume");
    assert!(is_mount_point(&target), "published late");
    assert!(plugin.faults().rules().is_empty());

    // Calls without the fault are not late.
    let c = plugin.client();
    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
    assert!(log.calls_of("NodeUnstageVolume")[0].get("late").is_none());
    assert!(mounts_under(dir.path()).is_empty());
}

// ---- Error classes through faults ----------------------------------------

/// A plugin with a volume staged and published at `target`.
struct Published {
    plugin: TestPlugin,
    client: CsiClient,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
}

fn published(dir: &TestDir) -> Published {
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let client = plugin.client();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let none = BTreeMap::new();
    client
        .node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    client
        .node_publish_volume(&publish("v", Some(&staging), &target, false, &none))
        .expect("NodePublish");
    Published {
        plugin,
        client,
        staging,
        target,
    }
}

#[test]
fn not_found_on_node_unpublish_is_ignorable() {
    let dir = TestDir::new();
    let p = published(&dir);
    p.plugin.faults().set(json!([
        {"method": "NodeUnpublishVolume", "action": "fail", "code": "NOT_FOUND", "count": 1}
    ]));
    let err = expect_status(
        p.client.node_unpublish_volume(&unpublish("v", &p.target)),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Ignorable,
    );
    assert!(err.is_ignorable());
    assert!(is_mount_point(&p.target), "a failed call did no work");
    // NOT_FOUND is ignorable only where the spec says "already done".
    p.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "fail", "code": "NOT_FOUND"}
    ]));
    expect_status(
        p.client.node_publish_volume(&publish(
            "v",
            Some(&p.staging),
            &p.target,
            false,
            &BTreeMap::new(),
        )),
        RpcStatusCode::NOT_FOUND,
        ErrorClass::Final,
    );
}

#[test]
fn unavailable_is_retryable_and_a_count_fails_exactly_that_many_calls() {
    let dir = TestDir::new();
    let p = published(&dir);
    p.plugin.faults().set(json!([{
        "method": "NodeUnpublishVolume", "action": "fail", "code": "UNAVAILABLE",
        "message": "plugin restarting", "count": 3
    }]));
    for remaining in [2, 1, 0] {
        let err = expect_status(
            p.client.node_unpublish_volume(&unpublish("v", &p.target)),
            RpcStatusCode::UNAVAILABLE,
            ErrorClass::Retryable,
        );
        assert!(err.to_string().contains("plugin restarting"), "{err}");
        assert!(is_mount_point(&p.target));
        let left = p.plugin.faults().rules();
        if remaining == 0 {
            assert!(
                left.is_empty(),
                "a rule that reaches 0 is dropped: {left:?}"
            );
        } else {
            assert_eq!(left[0]["count"], remaining);
        }
    }
    p.client
        .node_unpublish_volume(&unpublish("v", &p.target))
        .expect("the fourth call works");
    assert!(!is_mount_point(&p.target));
    let unpublishes: Vec<String> = p
        .plugin
        .call_log()
        .calls_of("NodeUnpublishVolume")
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect();
    assert_eq!(
        unpublishes,
        ["UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK"]
    );
}

#[test]
fn invalid_argument_fault_is_final_and_rules_filter_by_volume() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["bad", "good"])
        .start();
    let c = plugin.client();
    plugin.faults().set(json!([
        {"method": "NodeStageVolume", "volume_id": "bad", "action": "fail", "code": "INVALID_ARGUMENT"}
    ]));
    let none = BTreeMap::new();
    let bad_staging = dir.mkdir("staging/bad");
    let good_staging = dir.mkdir("staging/good");
    expect_status(
        c.node_stage_volume(&stage("bad", &bad_staging, &none)),
        RpcStatusCode::INVALID_ARGUMENT,
        ErrorClass::Final,
    );
    c.node_stage_volume(&stage("good", &good_staging, &none))
        .expect("another volume is unaffected");
    assert!(!is_mount_point(&bad_staging));
    assert!(is_mount_point(&good_staging));
    assert_eq!(
        plugin.faults().rules().len(),
        1,
        "a rule without count stays"
    );
    c.node_unstage_volume(&unstage("good", &good_staging))
        .expect("NodeUnstage");
}

#[test]
fn an_invalid_fault_file_fails_calls_with_internal() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().write_raw(b"{\"rules\": [");
    expect_status(
        plugin.client().probe(),
        RpcStatusCode::INTERNAL,
        ErrorClass::Final,
    );
    plugin
        .faults()
        .set(json!([{"method": "Probe", "action": "explode"}]));
    expect_status(
        plugin.client().probe(),
        RpcStatusCode::INTERNAL,
        ErrorClass::Final,
    );
    plugin.faults().clear();
    assert_eq!(plugin.client().probe().expect("Probe"), Readiness::Ready);
}

#[test]
fn a_hung_call_hits_the_deadline_and_other_calls_still_answer() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "hang", "count": 1}
    ]));
    let deadline = Duration::from_millis(500);
    let c = plugin.client_with_timeout(deadline);
    let started = Instant::now();
    let err = expect_status(
        c.node_get_info(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    let took = started.elapsed();
    assert!(err.is_retryable());
    assert!(took >= deadline - Duration::from_millis(50), "{took:?}");
    assert!(
        took < deadline + Duration::from_millis(1500),
        "returned {took:?} after the call, deadline {deadline:?}"
    );
    // The hung call still holds its thread; others are served.
    assert_eq!(c.probe().expect("Probe during the hang"), Readiness::Ready);
    assert_eq!(c.node_get_info().expect("NodeGetInfo").node_id, "test-node");
    // A hung call is never logged: it never finished.
    assert_eq!(plugin.call_log().methods(), vec!["Probe", "NodeGetInfo"]);
}

/// `freeze` returns once every thread of the plugin is stopped, so a call
/// made right after it cannot be answered; `thaw` once none is.
#[test]
fn a_frozen_plugin_has_every_thread_stopped_and_answers_once_thawed() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).no_controller().start();
    assert_eq!(plugin.client().probe().expect("Probe"), Readiness::Ready);
    let pid = plugin.pid().expect("running");
    plugin.freeze();
    let states = thread_states(pid).expect("the plugin's threads");
    assert!(
        states.len() > 1 && states.iter().all(|(_, s)| *s == 'T'),
        "{states:?}"
    );
    expect_status(
        plugin
            .client_with_timeout(Duration::from_millis(300))
            .probe(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    plugin.thaw();
    let states = thread_states(pid).expect("the plugin's threads");
    assert!(states.iter().all(|(_, s)| *s != 'T'), "{states:?}");
    assert_eq!(
        plugin.client().probe().expect("Probe after the thaw"),
        Readiness::Ready
    );
}

#[test]
fn a_delayed_call_blocks_neither_other_calls_nor_other_mounts() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let c = plugin.client();
    let none = BTreeMap::new();
    let staging = dir.mkdir("staging");
    c.node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    let slow_target = dir.mkdir("alloc").join("slow");
    let fast_target = dir.path().join("alloc/fast");

    plugin.faults().set(json!([{
        "method": "NodePublishVolume", "volume_id": "v", "action": "delay", "ms": 3000, "count": 1
    }]));
    let done = Arc::new(AtomicBool::new(false));
    let slow = {
        let (c, done) = (c.clone(), Arc::clone(&done));
        let req = publish("v", Some(&staging), &slow_target, false, &none);
        thread::spawn(move || {
            let r = c.node_publish_volume(&req);
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    // The rule is consumed when the call arrives: the slow call is now
    // sleeping inside the plugin.
    let faults = plugin.faults();
    wait_until(Duration::from_secs(10), "the delay rule to fire", || {
        faults.rules().is_empty()
    });
    c.node_publish_volume(&publish("v", Some(&staging), &fast_target, false, &none))
        .expect("a publish during the delay");
    assert!(is_mount_point(&fast_target));
    assert!(
        !done.load(Ordering::SeqCst),
        "the delayed call finished before the fast one"
    );
    slow.join()
        .expect("the slow caller thread")
        .expect("the delayed publish works after its delay");
    assert!(is_mount_point(&slow_target));
    let targets: Vec<String> = plugin
        .call_log()
        .calls_of("NodePublishVolume")
        .iter()
        .map(|c| c["target_path"].as_str().expect("target").to_string())
        .collect();
    assert_eq!(targets, [path_str(&fast_target), path_str(&slow_target)]);
}

#[test]
fn empty_replies_lack_required_fields() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "empty"},
        {"method": "GetPluginInfo", "action": "empty"}
    ]));
    let c = plugin.client();
    let err = c.node_get_info().expect_err("NodeGetInfo without node_id");
    assert!(
        matches!(
            err,
            CsiError::MissingField {
                method: CsiMethod::NodeGetInfo,
                field: "node_id"
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Final);
    let err = c.get_plugin_info().expect_err("GetPluginInfo without name");
    assert!(
        matches!(
            err,
            CsiError::MissingField {
                method: CsiMethod::GetPluginInfo,
                field: "name"
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.code_name(), "MISSING_FIELD");
}

#[test]
fn garbage_replies_are_bad_replies() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "garbage"},
        {"method": "GetPluginCapabilities", "action": "garbage"}
    ]));
    let c = plugin.client();
    let err = c.node_get_info().expect_err("garbage NodeGetInfo");
    assert!(
        matches!(
            err,
            CsiError::BadReply {
                method: CsiMethod::NodeGetInfo,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Final);
    let err = c
        .get_plugin_capabilities()
        .expect_err("garbage GetPluginCapabilities");
    assert!(matches!(err, CsiError::BadReply { .. }), "{err:?}");
    // The plugin answered OK; the bytes were the problem.
    assert_eq!(
        plugin.call_log().methods_and_codes(),
        pairs(&[("NodeGetInfo", "OK"), ("GetPluginCapabilities", "OK")])
    );
}

#[test]
fn probe_reports_starting_when_not_ready() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).start();
    plugin.faults().set(json!([
        {"method": "Probe", "action": "not_ready", "count": 2}
    ]));
    let c = plugin.client();
    assert_eq!(c.probe().expect("Probe"), Readiness::Starting);
    assert_eq!(c.probe().expect("Probe"), Readiness::Starting);
    assert_eq!(c.probe().expect("Probe"), Readiness::Ready);
}

#[test]
fn an_exit_fault_fires_once_even_across_restarts() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    plugin.faults().set(json!([
        {"method": "NodeStageVolume", "action": "exit", "count": 1}
    ]));
    let c = plugin.client();
    let staging = dir.mkdir("staging");
    let req = stage("v", &staging, &BTreeMap::new());
    // The connection drops under the call.
    expect_status(
        c.node_stage_volume(&req),
        RpcStatusCode::UNAVAILABLE,
        ErrorClass::Retryable,
    );
    let status = plugin.wait_exit(PLUGIN_EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(17));
    assert!(!is_mount_point(&staging));
    assert!(plugin.faults().rules().is_empty());

    plugin.restart();
    // The client reconnects on its own once the plugin is back.
    wait_until(
        Duration::from_secs(10),
        "the restarted plugin to answer",
        || c.probe().is_ok(),
    );
    c.node_stage_volume(&req).expect("NodeStage after restart");
    assert!(is_mount_point(&staging));

    let stages: Vec<String> = plugin
        .call_log()
        .calls_of("NodeStageVolume")
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect();
    assert_eq!(stages, ["EXIT", "OK"]);
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
}

// ---- Transport ------------------------------------------------------------

#[test]
fn a_missing_socket_is_unavailable_quickly() {
    let dir = TestDir::new();
    let c = CsiClient::new(grpc_env(), &dir.path().join("absent.sock"), CALL_TIMEOUT);
    let started = Instant::now();
    let err = expect_status(
        c.get_plugin_info(),
        RpcStatusCode::UNAVAILABLE,
        ErrorClass::Retryable,
    );
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?} with a {CALL_TIMEOUT:?} deadline",
        started.elapsed()
    );
}

#[test]
fn a_terminated_plugin_leaves_a_socket_that_does_not_answer() {
    let dir = TestDir::new();
    let mut plugin = TestPlugin::builder(dir.path()).start();
    let c = plugin.client();
    c.probe().expect("Probe");
    let status = plugin.terminate();
    assert!(status.success(), "SIGTERM exit: {status}");
    let meta = fs::symlink_metadata(&plugin.socket).expect("the socket file stays");
    assert!(meta.file_type().is_socket());
    expect_status(c.probe(), RpcStatusCode::UNAVAILABLE, ErrorClass::Retryable);

    plugin.restart();
    wait_until(
        Duration::from_secs(10),
        "the restarted plugin to answer",
        || c.probe().is_ok(),
    );
}

#[test]
fn the_plugin_rejects_bad_flags_and_documents_good_ones() {
    let bin = env!("CARGO_BIN_EXE_claimd-test-plugin");
    let out = std::process::Command::new(bin)
        .args([
            "--endpoint",
            "/nonexistent/csi.sock",
            "--root",
            "/nonexistent",
            "--bogus",
        ])
        .output()
        .expect("run the plugin");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bogus"));
    let out = std::process::Command::new(bin)
        .args(["--root", "/nonexistent"])
        .output()
        .expect("run the plugin");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--endpoint is required"));
    let out = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .expect("run the plugin");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--endpoint",
        "--root",
        "--node-id",
        "--name",
        "--no-stage",
        "--no-controller",
        "--call-log",
        "--faults",
        "--max-volumes-per-node",
        "--require-contexts",
        "--known-nodes",
        "--unknown-capability",
        "--storage",
        "--fence-on-unpublish",
        "--log-starts",
        "start_boottime_ns",
        "end_boottime_ns",
        "call_id",
        "late",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

// ---- The call log --------------------------------------------------------

/// With --log-starts every call has a start line and (once it answers) an
/// end line with the same call_id and CLOCK_BOOTTIME stamps within the
/// test's own readings of that clock; a hung call stays started and not
/// ended. Without the flag only end lines, with the same stamps.
#[test]
fn the_call_log_has_start_and_end_lines_on_one_machine_wide_clock() {
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .log_starts()
        .start();
    let c = plugin.client();
    let before = boottime_ns();
    assert_eq!(c.probe().expect("Probe"), Readiness::Ready);
    plugin.faults().set(json!([
        {"method": "NodeGetInfo", "action": "hang", "count": 1}
    ]));
    expect_status(
        plugin
            .client_with_timeout(Duration::from_millis(500))
            .node_get_info(),
        RpcStatusCode::DEADLINE_EXCEEDED,
        ErrorClass::Retryable,
    );
    c.node_get_capabilities().expect("NodeGetCapabilities");
    let after = boottime_ns();

    let log = plugin.call_log();
    let pid = u64::from(plugin.pid().expect("running"));
    let starts = log.starts();
    let methods: Vec<&str> = starts
        .iter()
        .map(|l| l["method"].as_str().expect("method"))
        .collect();
    assert_eq!(methods, ["Probe", "NodeGetInfo", "NodeGetCapabilities"]);
    // The hung NodeGetInfo: started, never ended.
    let open = log.open_calls();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0]["method"], "NodeGetInfo");
    assert_eq!(open[0]["call_id"], starts[1]["call_id"]);
    assert_eq!(log.methods(), ["Probe", "NodeGetCapabilities"]);

    let ends = log.calls();
    for (start, end) in [(&starts[0], &ends[0]), (&starts[2], &ends[1])] {
        assert_eq!(start["event"], "start");
        assert_eq!(end["event"], "end");
        assert_eq!(start["call_id"], end["call_id"]);
        assert_eq!(start["pid"], pid);
        assert_eq!(end["pid"], pid);
        assert_eq!(start["code"], serde_json::Value::Null, "{start}");
        assert_eq!(end["code"], "OK");
        let s = start["start_boottime_ns"]
            .as_u64()
            .expect("start_boottime_ns");
        assert_eq!(end["start_boottime_ns"].as_u64(), Some(s));
        let e = end["end_boottime_ns"].as_u64().expect("end_boottime_ns");
        assert!(
            before <= s && s <= e && e <= after,
            "{before} {s} {e} {after}"
        );
        assert_eq!(start["end_boottime_ns"], serde_json::Value::Null);
    }
    let started = |l: &serde_json::Value| l["start_boottime_ns"].as_u64().expect("a stamp");
    assert!(started(&starts[0]) < started(&starts[1]));
    assert!(started(&starts[1]) < started(&starts[2]));
    let ids: std::collections::HashSet<&str> = starts
        .iter()
        .map(|l| l["call_id"].as_str().expect("call_id"))
        .collect();
    assert_eq!(ids.len(), 3, "call IDs are unique: {ids:?}");

    // Without --log-starts: end lines only, stamped the same way.
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).no_controller().start();
    plugin.client().probe().expect("Probe");
    let lines = plugin.call_log().lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["event"], "end");
    let stamp = |k: &str| lines[0][k].as_u64().expect("a stamp");
    assert!(stamp("end_boottime_ns") >= stamp("start_boottime_ns"));
    assert!(plugin.call_log().open_calls().is_empty());
}

#[test]
fn the_call_log_names_secret_keys_but_never_secret_values() {
    const SECRET: &str = "s3cr3t-value-4711";
    let dir = TestDir::new();
    let plugin = TestPlugin::builder(dir.path()).node_id(NODE).start();
    let c = plugin.client();
    let secrets = map(&[("password", SECRET), ("api-key", SECRET)]);

    let mut create = CreateVolumeRequest::new();
    create.name = "v".to_string();
    create
        .volume_capabilities
        .push(capability(Mode::SINGLE_NODE_WRITER, false));
    create.secrets = secrets.clone();
    c.create_volume(&create).expect("CreateVolume");
    let mut cp = controller_publish("v", NODE, Mode::SINGLE_NODE_WRITER);
    cp.secrets = secrets.clone();
    let ctx = c.controller_publish_volume(&cp).expect("ControllerPublish");
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let mut st = stage("v", &staging, &ctx);
    st.secrets = secrets.clone();
    c.node_stage_volume(&st).expect("NodeStage");
    let mut pb = publish("v", Some(&staging), &target, false, &ctx);
    pb.secrets = secrets.clone();
    c.node_publish_volume(&pb).expect("NodePublish");
    c.node_unpublish_volume(&unpublish("v", &target))
        .expect("NodeUnpublish");
    c.node_unstage_volume(&unstage("v", &staging))
        .expect("NodeUnstage");
    let mut cu = controller_unpublish("v", NODE);
    cu.secrets = secrets.clone();
    c.controller_unpublish_volume(&cu)
        .expect("ControllerUnpublish");
    let mut del = DeleteVolumeRequest::new();
    del.volume_id = "v".to_string();
    del.secrets = secrets;
    c.delete_volume(&del).expect("DeleteVolume");

    let log = plugin.call_log();
    assert_eq!(
        log.methods(),
        [
            "CreateVolume",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
            "DeleteVolume",
        ]
    );
    for call in log.calls() {
        let with_secrets = !matches!(
            call["method"].as_str(),
            Some("NodeUnpublishVolume" | "NodeUnstageVolume")
        );
        if with_secrets {
            assert_eq!(
                call["secret_keys"],
                json!(["api-key", "password"]),
                "{call}"
            );
        } else {
            assert!(call.get("secret_keys").is_none(), "{call}");
        }
    }
    let raw = log.raw();
    assert!(raw.contains("password"), "key names are logged");
    assert!(!raw.contains(SECRET), "a secret value reached the call log");
    assert!(
        !plugin.stderr_text().contains(SECRET),
        "a secret value reached the plugin's log"
    );
}
