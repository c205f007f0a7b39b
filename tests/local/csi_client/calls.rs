//! Every RPC the agent sends, answered as the spec says: identity, node info,
//! staging and publishing with real mounts, controller attach and detach,
//! volume creation and the contexts a plugin returns.

use super::*;

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
