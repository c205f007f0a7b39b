//! What the test plugin refuses, as strictly as the spec allows: unknown
//! volumes and nodes, a second staging path, missing required fields, an
//! incompatible request for a name.

use super::*;

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
