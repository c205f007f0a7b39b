//! Failing and stuck plugins, corrupt state, bad IDs, rollbacks, and
//! releases that meet work in flight.

use super::*;

// ---- 8. Retried NodeUnpublish; controller detach last, recorded node ID ----

fn failing_node_unpublish_is_retried_and_detach_comes_last() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.plugin.faults().set(json!([{
        "method": NU, "action": "fail", "code": "UNAVAILABLE",
        "message": "plugin busy", "count": 3
    }]));

    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(h.m().release_status("a1"), released(&["data"]));
    let codes: Vec<(String, String)> = h.plugin.call_log().methods_and_codes();
    let codes: Vec<(&str, &str)> = codes
        .iter()
        .filter(|(m, _)| LIFECYCLE_METHODS.contains(&m.as_str()))
        .map(|(m, c)| (m.as_str(), c.as_str()))
        .collect();
    assert_eq!(
        codes,
        vec![
            (CP, "OK"),
            (NS, "OK"),
            (NP, "OK"),
            (NU, "UNAVAILABLE"),
            (NU, "UNAVAILABLE"),
            (NU, "UNAVAILABLE"),
            (NU, "OK"),
            (NUS, "OK"),
            (CU, "OK"),
        ]
    );
    let calls = h.lifecycle_calls();
    assert_eq!(calls[8]["node_id"], PLUGIN_NODE_ID);
    assert_eq!(h.plugin.faults().rules(), Vec::<Value>::new());
    assert_all_released(&h);
}

fn release_waits_for_a_restarted_node_plugin_and_detaches_with_the_recorded_node_id() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let target = h.target("a1", "v", SNW);
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");

    h.plugin.kill();
    let reg = h.registry().clone();
    wait_until(WAIT, "the registry to see the plugin gone", || {
        reg.get_ready(PLUGIN, PluginKind::Node).is_none()
    });
    assert_eq!(h.m().release("a1").expect("release"), ReleaseStart::Started);
    wait_until(WAIT, "the release to report it is retrying", || {
        matches!(
            h.m().release_status("a1").get("data"),
            Some(ReleaseState::Retrying { .. })
        )
    });
    let Some(ReleaseState::Retrying { error, .. }) = h.m().release_status("a1").remove("data")
    else {
        unreachable!("checked above");
    };
    assert!(error.contains(PLUGIN), "{error}");
    // Nothing was torn down without the plugin.
    assert!(is_mount_point(&target));
    assert_eq!(h.lifecycle_calls().len(), 3);
    let st = h.state_on_disk();
    assert_eq!(st.allocs["a1"].volumes["data"].phase, Phase::Releasing);
    assert_eq!(st.claims.len(), 1);
    assert_eq!(claim_list(&st)[0].state, ClaimState::Releasing);

    // The plugin comes back under another node ID.
    h.replace_plugin(|b| b.node_id("node-b"));
    assert!(h.m().wait_released("a1", WAIT), "release did not end");
    assert_eq!(h.m().release_status("a1"), released(&["data"]));
    assert_eq!(
        h.calls_since(3),
        ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
    );
    let calls = h.lifecycle_calls();
    assert_down_details(
        &calls[3..].iter().collect::<Vec<_>>(),
        "v",
        &h.staging("v"),
        &target,
        PLUGIN_NODE_ID,
    );
    let node = h
        .registry()
        .get_ready(PLUGIN, PluginKind::Node)
        .expect("plugin ready");
    assert_eq!(node.node_id(), Some("node-b"));
    assert_all_released(&h);
}

// ---- 9. Ten volumes, one stuck ------------------------------------------------

fn one_stuck_volume_does_not_hold_back_the_other_nine() {
    let h = Harness::new();
    let vols: Vec<String> = (0..10).map(|i| format!("v{i}")).collect();
    for v in &vols {
        h.register(spec(v, &[AccessMode::SingleNodeWriter]));
    }
    let reqs: Vec<_> = vols
        .iter()
        .enumerate()
        .map(|(i, v)| request(&format!("d{i}"), v, false))
        .collect();
    let mounted = h.m().mount("a1", &reqs).expect("mount ten");
    assert_eq!(mounted.len(), 10);
    assert_eq!(mount_points_under(&h.mount_root).len(), 20);
    h.plugin.faults().set(json!([{
        "method": NU, "volume_id": external_id("v9"), "action": "fail",
        "code": "UNAVAILABLE", "message": "device busy"
    }]));
    let n = h.lifecycle_calls().len();
    assert_eq!(n, 30);

    h.m().release("a1").expect("release");
    let nine: Vec<String> = (0..9).map(|i| format!("d{i}")).collect();
    wait_until(WAIT, "nine released and d9 retrying", || {
        let st = h.m().release_status("a1");
        nine.iter()
            .all(|a| st.get(a) == Some(&ReleaseState::Released))
            && matches!(st.get("d9"), Some(ReleaseState::Retrying { attempts, .. }) if *attempts >= 2)
    });
    let status = h.m().release_status("a1");
    assert_eq!(status.len(), 10);
    match &status["d9"] {
        ReleaseState::Retrying { error, attempts } => {
            assert_eq!(
                error, "NodeUnpublishVolume failed: UNAVAILABLE: device busy",
                "after {attempts} attempts"
            );
        }
        other => panic!("d9: {other:?}"),
    }
    // What is left is exactly the stuck volume.
    let st = h.state_on_disk();
    let left: Vec<&String> = st.allocs["a1"].volumes.keys().collect();
    assert_eq!(left, vec!["d9"]);
    assert_eq!(st.allocs["a1"].volumes["d9"].phase, Phase::Releasing);
    assert_eq!(st.claims.len(), 1);
    assert_eq!(claim_list(&st)[0].volume_id, "v9");
    assert_eq!(claim_list(&st)[0].state, ClaimState::Releasing);
    assert_eq!(
        mount_points_under(&h.mount_root),
        sorted(vec![h.staging("v9"), h.target("a1", "v9", SNW)])
    );
    assert_eq!(
        h.attachments(),
        BTreeMap::from([(external_id("v9"), vec![PLUGIN_NODE_ID.to_string()])])
    );
    let by_volume = per_volume(&h.calls_since(n));
    for v in &vols[..9] {
        assert_eq!(by_volume[&external_id(v)], ok(&[NU, NUS, CU]), "{v}");
    }
    let stuck = &by_volume[&external_id("v9")];
    assert!(stuck.len() >= 2, "{stuck:?}");
    assert!(stuck
        .iter()
        .all(|c| *c == (NU.to_string(), "UNAVAILABLE".to_string())));

    h.plugin.faults().clear();
    assert!(h.m().wait_released("a1", WAIT), "d9 did not finish");
    let all: Vec<String> = (0..10).map(|i| format!("d{i}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    assert_eq!(h.m().release_status("a1"), released(&all));
    let stuck = &per_volume(&h.calls_since(n))[&external_id("v9")];
    let k = stuck.len();
    assert_eq!(&stuck[k - 3..], ok(&[NU, NUS, CU]).as_slice());
    assert!(stuck[..k - 3]
        .iter()
        .all(|c| *c == (NU.to_string(), "UNAVAILABLE".to_string())));
    assert_all_released(&h);
}

// ---- 10. A corrupt state file ------------------------------------------------

fn corrupt_state_file_is_refused_named_and_left_untouched() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.stop();
    let path = h.state_path();
    let good = fs::read(&path).expect("read the state file");
    let mounts = mount_points_under(&h.mount_root);
    let torn = good[..good.len() / 2].to_vec();
    for bytes in [torn, b"{not json".to_vec(), Vec::new()] {
        fs::write(&path, &bytes).expect("write");
        let err = StateStore::open_with_boot_id(&h.state_dir, FIRST_BOOT)
            .err()
            .expect("a corrupt state file is refused");
        match &err {
            StateError::Corrupt { path: p, .. } => assert_eq!(p, &path),
            other => panic!("unexpected error {other:?}"),
        }
        let msg = claimd::error_chain(&err);
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("corrupt"), "{msg}");
        assert_eq!(fs::read(&path).expect("read"), bytes, "file changed");
        assert_eq!(mount_points_under(&h.mount_root), mounts);
    }
    // The good file still works.
    fs::write(&path, &good).expect("write back");
    h.start_again(FIRST_BOOT);
    assert_eq!(h.m().restore().intact, 1);
}

// ---- 11. IDs that could escape a directory ----------------------------------

fn bad_ids_are_refused_before_anything_touches_the_disk() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let state_before = h.state_bytes();
    let long = "x".repeat(129);
    let bad = [
        "a/b",
        "..",
        ".",
        "../../etc",
        "a\0b",
        "/abs",
        "",
        long.as_str(),
    ];
    for id in bad {
        let e = h
            .m()
            .mount(id, &[request("data", "v", false)])
            .expect_err("bad allocation ID");
        assert!(matches!(e, MountError::Invalid(_)), "{id:?}: {e}");
        assert!(e.to_string().contains("invalid allocation ID"), "{e}");
        let e = h
            .m()
            .mount("a1", &[request(id, "v", false)])
            .expect_err("bad alias");
        assert!(e.to_string().contains("invalid alias ID"), "{id:?}: {e}");
        let e = h
            .m()
            .mount("a1", &[request("data", id, false)])
            .expect_err("bad volume ID");
        assert!(e.to_string().contains("invalid volume ID"), "{id:?}: {e}");
        let e = h
            .m()
            .register_volume(spec(id, &[AccessMode::SingleNodeWriter]))
            .expect_err("bad volume ID");
        assert!(matches!(e, VolumeRegistryError::Invalid(_)), "{id:?}: {e}");
        let mut s = spec("ok", &[AccessMode::SingleNodeWriter]);
        s.plugin_id = id.to_string();
        let e = h.m().register_volume(s).expect_err("bad plugin ID");
        assert!(e.to_string().contains("invalid plugin ID"), "{id:?}: {e}");
        let e = h.m().release(id).expect_err("bad allocation ID");
        assert!(matches!(e, ReleaseError::Invalid(_)), "{id:?}: {e}");
        assert!(h.m().deregister_volume(id).is_err(), "{id:?}");
    }
    assert_eq!(h.state_bytes(), state_before);
    assert_eq!(h.tree(), Vec::<String>::new());
    assert_eq!(h.lifecycle_calls(), Vec::<Value>::new());
    assert_eq!(h.claims().claim_calls(), 0);

    // The longest valid ID works end to end.
    let longest = "y".repeat(128);
    let mounted = h
        .m()
        .mount(&longest, &[request("data", "v", false)])
        .expect("128-byte allocation ID");
    assert_eq!(mounted[0].host_path, h.target(&longest, "v", SNW));
    h.m().release(&longest).expect("release");
    assert!(h.m().wait_released(&longest, WAIT));
    assert_all_released(&h);
}

// ---- Failed mounts roll back -------------------------------------------------

fn final_node_publish_error_rolls_back_stage_attachment_and_claim() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.plugin.faults().set(json!([{
        "method": NP, "action": "fail", "code": "INVALID_ARGUMENT", "message": "bad flags"
    }]));
    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("NodePublish fails");
    match &err {
        MountError::Csi { alias, source } => {
            assert_eq!(alias, "data");
            assert_eq!(source.code(), Some(grpcio::RpcStatusCode::INVALID_ARGUMENT));
        }
        other => panic!("unexpected error {other:?}"),
    }
    let codes: Vec<(String, String)> = h
        .calls_since(0)
        .into_iter()
        .map(|(m, _, c)| (m, c))
        .collect();
    assert_eq!(
        codes,
        vec![
            (CP.to_string(), "OK".to_string()),
            (NS.to_string(), "OK".to_string()),
            (NP.to_string(), "INVALID_ARGUMENT".to_string()),
            (NU.to_string(), "OK".to_string()),
            (NUS.to_string(), "OK".to_string()),
            (CU.to_string(), "OK".to_string()),
        ]
    );
    assert_eq!(h.lifecycle_calls()[5]["node_id"], PLUGIN_NODE_ID);
    assert_eq!(h.claims().claim_calls(), 1);
    assert_eq!(h.claims().release_calls(), 1);
    assert_all_released(&h);
}

fn failure_of_the_second_volume_rolls_back_the_first() {
    let h = Harness::new();
    h.register(spec("v1", &[AccessMode::SingleNodeWriter]));
    h.register(spec("v2", &[AccessMode::SingleNodeWriter]));
    h.plugin.faults().set(json!([{
        "method": NS, "volume_id": external_id("v2"), "action": "fail",
        "code": "INVALID_ARGUMENT"
    }]));
    let err = h
        .m()
        .mount(
            "a1",
            &[request("d1", "v1", false), request("d2", "v2", false)],
        )
        .expect_err("v2 cannot be staged");
    assert!(
        matches!(&err, MountError::Csi { alias, .. } if alias == "d2"),
        "{err:?}"
    );
    let by_volume = per_volume(&h.calls_since(0));
    assert_eq!(
        by_volume[&external_id("v1")],
        ok(&[CP, NS, NP, NU, NUS, CU])
    );
    assert_eq!(
        by_volume[&external_id("v2")],
        vec![
            (CP.to_string(), "OK".to_string()),
            (NS.to_string(), "INVALID_ARGUMENT".to_string()),
            (NUS.to_string(), "OK".to_string()),
            (CU.to_string(), "OK".to_string()),
        ]
    );
    assert_all_released(&h);
}

// ---- Plugins without staging or controller -------------------------------------

fn plugin_without_stage_or_controller_gets_only_the_calls_it_advertises() {
    /// Plugin flags, expected up calls, expected down calls, staging used.
    type Case<'a> = (&'a [&'a str], &'a [&'a str], &'a [&'a str], bool);
    let cases: [Case; 3] = [
        (&["--no-stage"], &[CP, NP], &[NU, CU], false),
        (&["--no-controller"], &[NS, NP], &[NU, NUS], true),
        (&["--no-stage", "--no-controller"], &[NP], &[NU], false),
    ];
    for (flags, up, down, staged) in cases {
        let case = format!("plugin flags {flags:?}");
        let h = Harness::with_plugin(|b| b.args(flags));
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        let target = h.target("a1", "v", SNW);
        let staging = h.staging("v");
        h.m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mount");
        let want: Vec<(&str, &str)> = up.iter().map(|m| (*m, "v")).collect();
        assert_eq!(h.calls_since(0), ok_calls(&want), "{case}");
        let np = h.lifecycle_calls().pop().expect("NodePublish");
        assert_eq!(np["target_path"], path_str(&target), "{case}");
        let staging_arg = if staged { path_str(&staging) } else { "" };
        assert_eq!(np["staging_target_path"], staging_arg, "{case}");
        let mut points = vec![target.clone()];
        if staged {
            points.push(staging.clone());
        }
        assert_eq!(mount_points_under(&h.mount_root), sorted(points), "{case}");
        let st = h.state_on_disk();
        let rec = &st.allocs["a1"].volumes["data"];
        assert_eq!(rec.holds_staging, staged, "{case}");
        assert_eq!(rec.staging_path.is_some(), staged, "{case}");
        let controller = up.contains(&CP);
        assert_eq!(rec.holds_attachment, controller, "{case}");
        assert_eq!(rec.external_node_id.is_some(), controller, "{case}");

        let n = h.lifecycle_calls().len();
        h.m().release("a1").expect("release");
        assert!(h.m().wait_released("a1", WAIT), "{case}");
        let want: Vec<(&str, &str)> = down.iter().map(|m| (*m, "v")).collect();
        assert_eq!(h.calls_since(n), ok_calls(&want), "{case}");
        let mut tree = vec!["per-alloc".to_string()];
        if staged {
            tree.push("staging".to_string());
        }
        assert_all_released_leaving(&h, &tree);
    }
}

// ---- A release while a mount's call is in flight ------------------------------

fn release_during_an_in_flight_stage_converges_to_released() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    // The rule is consumed when NodeStage arrives: its absence from the
    // fault file tells the call is in flight.
    h.plugin.faults().set(json!([{
        "method": NS, "action": "delay", "ms": 1500, "count": 1
    }]));
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a1", &[request("data", "v", false)]));
    wait_until(WAIT, "NodeStage to be in flight", || {
        h.plugin.faults().rules().is_empty()
    });
    assert_eq!(h.m().release("a1").expect("release"), ReleaseStart::Started);
    let outcome = mounting.join().expect("mount thread");
    assert!(h.m().wait_released("a1", WAIT), "release did not end");
    assert_eq!(h.m().release_status("a1"), released(&["data"]));
    // The mount either lost the race after NodeStage (no NodePublish) or
    // published first; either way the release undoes everything it sent,
    // in order (a NodePublish never sent is not undone).
    let calls = h.calls_since(0);
    let published = calls.iter().any(|(m, _, _)| m == NP);
    let want: &[(&str, &str)] = if published {
        &[
            (CP, "v"),
            (NS, "v"),
            (NP, "v"),
            (NU, "v"),
            (NUS, "v"),
            (CU, "v"),
        ]
    } else {
        &[(CP, "v"), (NS, "v"), (NUS, "v"), (CU, "v")]
    };
    assert_eq!(calls, ok_calls(want), "mount outcome: {outcome:?}");
    if published {
        assert_all_released(&h);
    } else {
        assert!(
            matches!(outcome, Err(MountError::Busy { .. })),
            "{outcome:?}"
        );
        // The target's parents were never created.
        assert_all_released_leaving(&h, &["staging".to_string()]);
    }
}

/// A mount cut off while it waited for a held claim must not hold the
/// restore (and with it the API that would release the holder) hostage:
/// the restore returns after its bound, the claim wait goes on in the
/// background, and the mount completes once the holder is released.
fn restore_does_not_block_on_a_claim_held_by_another_allocation() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let t2 = h.target("a2", "v", SNW);
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount a1");
    let m = h.m().clone();
    let waiter = thread::spawn(move || m.mount("a2", &[request("data", "v", false)]));
    wait_until(WAIT, "a2 to wait for a1's claim", || {
        h.m().alloc_status("a2").is_some_and(|s| {
            s.volumes
                .iter()
                .any(|v| v.message.contains("claimed for writing"))
        })
    });
    // The agent stops while a2 waits: its record stays in `claiming`.
    let interrupted = {
        let shutdown = h.shutdown().clone();
        shutdown.trigger();
        waiter.join().expect("mount thread")
    };
    assert!(interrupted.is_err(), "{interrupted:?}");
    assert_eq!(
        h.state_on_disk().allocs["a2"].volumes["data"].phase,
        Phase::Claiming
    );
    let started = std::time::Instant::now();
    let report = h.restart();
    // The restore answered within its bound (5 s in the harness), leaving
    // a2's claim wait in the background.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(report.intact, 1);
    assert_eq!(report.in_background, 1, "{report:?}");
    assert!(report.errors.is_empty(), "{report:?}");
    // Releasing the holder lets the background restore finish a2's mount.
    h.m().release("a1").expect("release a1");
    assert!(h.m().wait_released("a1", WAIT));
    wait_until(WAIT, "a2 to be mounted by the background restore", || {
        h.m().mounted("a2").len() == 1
    });
    assert!(is_mount_point(&t2));
    assert_eq!(h.all_claims().len(), 1);
    assert_eq!(h.all_claims()[0].alloc_id, "a2");
    h.m().release("a2").expect("release a2");
    assert!(h.m().wait_released("a2", WAIT));
    assert!(mount_points_under(&h.mount_root).is_empty());
    assert!(h.all_claims().is_empty());
}

// ---- CSI conformance (issue 12) ------------------------------------------------

/// A volume has one staging path on a node, whatever the allocations ask:
/// read-only is asked at NodePublish. An allocation that needs another
/// attachment (block device vs file system) is refused at once, naming
/// the allocation that uses the volume.
fn one_staging_path_per_volume_read_only_at_publish() {
    let h = Harness::new();
    let mut s = spec("v", &[AccessMode::MultiNodeMultiWriter]);
    s.attachment_modes = vec![AttachmentMode::FileSystem, AttachmentMode::BlockDevice];
    h.register(s);
    let staging = h.staging("v");
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("a1");
    h.m()
        .mount("a2", &[request("data", "v", false)])
        .expect("a2");
    let ro = h
        .m()
        .mount("a3", &[request("data", "v", true)])
        .expect("a3 read-only shares the staging");
    assert!(ro[0].read_only);
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v"), (NP, "v"), (NP, "v")])
    );
    let calls = h.lifecycle_calls();
    for np in &calls[2..5] {
        assert_eq!(np["staging_target_path"], path_str(&staging), "{np}");
    }
    assert_eq!(calls[2]["readonly"], json!(false));
    assert_eq!(calls[4]["readonly"], json!(true));
    // A block device cannot share a file-system staging: refused at once.
    let mut block = request("raw", "v", false);
    block.attachment = Some(AttachmentMode::BlockDevice);
    let before = h.state_on_disk();
    let err = h
        .m()
        .mount("a4", &[block])
        .expect_err("block beside file system");
    match &err {
        MountError::Incompatible { holder, .. } => assert_eq!(holder, "a1"),
        other => panic!("unexpected error {other:?}"),
    }
    let msg = claimd::error_chain(&err);
    assert!(
        msg.contains("file-system") && msg.contains("block-device") && msg.contains("a1"),
        "{msg}"
    );
    assert_eq!(
        h.lifecycle_calls().len(),
        5,
        "no call for the refused mount"
    );
    assert_eq!(h.state_on_disk(), before, "nothing recorded or claimed");
    for a in ["a1", "a2", "a3"] {
        h.m().release(a).expect("release");
        assert!(h.m().wait_released(a, WAIT));
    }
    assert_eq!(
        h.calls_since(5),
        ok_calls(&[(NU, "v"), (NU, "v"), (NU, "v"), (NUS, "v"), (CU, "v")])
    );
    assert_eq!(
        h.lifecycle_calls()[8]["staging_target_path"],
        path_str(&staging)
    );
    assert_all_released(&h);
}

/// State written by an earlier release staged at `<volume>/<usage>`: such a
/// volume is restored and unstaged at its recorded path, and a new user of
/// it shares that path instead of staging it a second time.
fn a_recorded_staging_path_of_the_old_layout_is_kept_and_shared() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    let usage = "rw-file-system-multi-node-multi-writer";
    let legacy = h.staging("v").join(usage);
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("a1");
    // As an earlier release would have recorded it, after a reboot.
    h.stop();
    detach_all_under(&h.mount_root);
    remove_empty_dirs(&h.mount_root.join("staging"));
    h.edit_state(|s| {
        let v = s.volume_mut("a1", "data").expect("record");
        v.staging_path = Some(legacy.clone());
    });
    h.start_again("boot-2");
    let report = h.m().restore();
    assert!(report.errors.is_empty(), "{report:?}");
    // A read-only user: its own usage, the same one staging path.
    h.m()
        .mount("a2", &[request("data", "v", true)])
        .expect("a2");
    let calls = h.lifecycle_calls();
    let staged: Vec<&Value> = calls.iter().filter(|c| c["method"] == NS).collect();
    assert_eq!(
        staged.len(),
        2,
        "one NodeStage before and one after the reboot"
    );
    assert_eq!(staged[1]["staging_target_path"], path_str(&legacy));
    let published: Vec<&Value> = calls.iter().filter(|c| c["method"] == NP).collect();
    assert_eq!(published.len(), 3);
    for np in &published[1..] {
        assert_eq!(np["staging_target_path"], path_str(&legacy), "{np}");
    }
    assert!(is_mount_point(&legacy));
    assert!(!is_mount_point(&h.staging("v")));
    let skip = calls.len();
    for a in ["a1", "a2"] {
        h.m().release(a).expect("release");
        assert!(h.m().wait_released(a, WAIT));
    }
    assert_eq!(
        h.calls_since(skip),
        ok_calls(&[(NU, "v"), (NU, "v"), (NUS, "v"), (CU, "v")])
    );
    let nus = &h.lifecycle_calls()[skip + 2];
    assert_eq!(nus["staging_target_path"], path_str(&legacy));
    assert_all_released(&h);
}

both_stores!(
    failing_node_unpublish_is_retried_and_detach_comes_last,
    release_waits_for_a_restarted_node_plugin_and_detaches_with_the_recorded_node_id,
    one_stuck_volume_does_not_hold_back_the_other_nine,
    corrupt_state_file_is_refused_named_and_left_untouched,
    bad_ids_are_refused_before_anything_touches_the_disk,
    final_node_publish_error_rolls_back_stage_attachment_and_claim,
    failure_of_the_second_volume_rolls_back_the_first,
    plugin_without_stage_or_controller_gets_only_the_calls_it_advertises,
    release_during_an_in_flight_stage_converges_to_released,
    restore_does_not_block_on_a_claim_held_by_another_allocation,
    one_staging_path_per_volume_read_only_at_publish,
    a_recorded_staging_path_of_the_old_layout_is_kept_and_shared,
);
