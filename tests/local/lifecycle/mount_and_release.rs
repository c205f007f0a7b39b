//! A mount and its release: the exact calls, claims held and waited for,
//! one staging and one attachment shared by two allocations.

use super::*;

// ---- 1. Mount and release ------------------------------------------------

fn mount_then_release_sends_the_exact_calls_and_leaves_nothing() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let target = h.target("a1", "v", SNW);
    let staging = h.staging("v");

    let mounted = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    assert_eq!(
        mounted,
        vec![MountedVolume {
            alias: "data".into(),
            volume_id: "v".into(),
            host_path: target.clone(),
            read_only: false,
            block: false,
        }]
    );
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
    );
    let calls = h.lifecycle_calls();
    assert_up_details(
        &calls.iter().collect::<Vec<_>>(),
        "v",
        &staging,
        &target,
        false,
    );
    assert!(!h.plugin.call_log().raw().contains(SECRET), "secret logged");

    // Exactly the staging and target mounts, both of the volume, read-write.
    assert_eq!(
        mount_points_under(&h.mount_root),
        sorted(vec![staging.clone(), target.clone()])
    );
    for p in [&staging, &target] {
        let m = mount_at(p).expect("mounted");
        assert!(!m.read_only(), "{m:?}");
        assert!(
            m.root.ends_with(format!("volumes/{}", external_id("v"))),
            "{m:?}"
        );
        assert_eq!(mounts_at(p).len(), 1, "stacked mounts at {}", p.display());
    }
    // Data written by the workload lands in the volume.
    fs::write(target.join("hello.txt"), b"hi").expect("write through the target");
    let in_volume = h.plugin.volume_dir(&external_id("v")).join("hello.txt");
    assert_eq!(fs::read(&in_volume).expect("in the volume"), b"hi");

    // The durable record and claim.
    let st = h.state_on_disk();
    let rec = &st.allocs["a1"].volumes["data"];
    assert_eq!(rec.phase, Phase::Published);
    assert_eq!(rec.external_node_id.as_deref(), Some(PLUGIN_NODE_ID));
    assert!(rec.holds_attachment && rec.holds_staging);
    assert_eq!(rec.staging_path.as_deref(), Some(staging.as_path()));
    assert_eq!(rec.target_path, target);
    assert_eq!(rec.publish_context, publish_context("v", PLUGIN_NODE_ID));
    assert!(!st.allocs["a1"].releasing);
    let claim = full_claim("v", "a1", ClaimMode::Write, AccessMode::SingleNodeWriter);
    assert_eq!(claim_list(&st), vec![claim.clone()]);
    assert_eq!(h.all_claims(), vec![claim]);
    assert_eq!(h.claims().claim_calls(), 1);

    // Mounting again with the same request answers the same paths and
    // costs nothing; another request for the allocation is refused.
    let again = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount again");
    assert_eq!(again, mounted);
    let busy = h
        .m()
        .mount("a1", &[request("data", "v", true)])
        .expect_err("other request");
    assert!(matches!(busy, MountError::Busy { .. }), "{busy}");
    assert_eq!(h.lifecycle_calls().len(), 3);
    // A claimed volume cannot be changed or deregistered.
    let mut changed = spec("v", &[AccessMode::SingleNodeWriter]);
    changed.external_id = "elsewhere".into();
    assert!(matches!(
        h.m().register_volume(changed),
        Err(VolumeRegistryError::InUse { .. })
    ));
    assert!(matches!(
        h.m().deregister_volume("v"),
        Err(VolumeRegistryError::InUse { .. })
    ));

    assert_eq!(h.m().release("a1").expect("release"), ReleaseStart::Started);
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
        &staging,
        &target,
        PLUGIN_NODE_ID,
    );
    assert_all_released(&h);
    assert_eq!(h.claims().release_calls(), 1);
    // The data stays in the volume; releasing again finds nothing.
    assert!(in_volume.exists());
    assert_eq!(h.m().release("a1").expect("again"), ReleaseStart::NotFound);
    assert_eq!(h.lifecycle_calls().len(), 6);
}

fn read_only_request_gives_a_read_only_mount() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let usage = "ro-file-system-single-node-writer";
    let target = h.target("a1", "v", usage);
    let staging = h.staging("v");

    let mounted = h
        .m()
        .mount("a1", &[request("data", "v", true)])
        .expect("mount");
    assert_eq!(mounted.len(), 1);
    assert!(mounted[0].read_only);
    assert_eq!(mounted[0].host_path, target);
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
    );
    let calls = h.lifecycle_calls();
    assert_up_details(
        &calls.iter().collect::<Vec<_>>(),
        "v",
        &staging,
        &target,
        true,
    );

    let m = mount_at(&target).expect("target mounted");
    assert!(m.read_only(), "target mount options: {}", m.options);
    let e = fs::write(target.join("x"), b"x").expect_err("writing a read-only mount");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    assert_eq!(
        h.all_claims(),
        vec![full_claim(
            "v",
            "a1",
            ClaimMode::Read,
            AccessMode::SingleNodeWriter
        )]
    );

    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(
        h.calls_since(3),
        ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
    );
    assert_all_released(&h);
}

// ---- 2. A final claim error ------------------------------------------------

fn final_claim_error_mounts_nothing_and_claims_nothing() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.claims().refuse("the volume's quota is exhausted");

    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("the claim is refused");
    match &err {
        MountError::Claim {
            alias,
            source: ClaimError::Impossible { volume_id, reason },
        } => {
            assert_eq!(alias, "data");
            assert_eq!(volume_id, "v");
            assert_eq!(reason, "the volume's quota is exhausted");
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(claimd::error_chain(&err).contains("quota is exhausted"));
    // A final error is not retried.
    assert_eq!(h.claims().claim_calls(), 1);
    assert_eq!(h.lifecycle_calls(), Vec::<Value>::new());
    let st = h.state_on_disk();
    assert!(st.allocs.is_empty(), "{:?}", st.allocs);
    assert!(st.claims.is_empty());
    assert!(h.all_claims().is_empty());
    assert!(h.m().list_allocs().is_empty());
    assert_eq!(h.tree(), Vec::<String>::new());
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
    assert_eq!(h.attachments(), BTreeMap::new());
}

// ---- 3. A claim held by another allocation ---------------------------------

fn second_writer_waits_for_the_held_claim_then_gets_the_volume() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let t1 = h.target("a1", "v", SNW);
    let t2 = h.target("a2", "v", SNW);
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount a1");

    let m = h.m().clone();
    let waiter = thread::spawn(move || m.mount("a2", &[request("data", "v", false)]));
    wait_until(WAIT, "a2 to report a1's claim", || {
        h.m().alloc_status("a2").is_some_and(|s| {
            s.volumes.len() == 1
                && s.volumes[0]
                    .message
                    .contains("volume v is claimed for writing by allocation a1 on node node-1")
        })
    });
    let st = h.m().alloc_status("a2").expect("a2 recorded");
    assert_eq!(st.volumes[0].phase, Some(Phase::Claiming));
    assert!(!waiter.is_finished(), "a2's mount returned early");
    // Nothing was sent for a2, nothing claimed for it.
    assert_eq!(h.lifecycle_calls().len(), 3);
    assert_eq!(
        h.all_claims(),
        vec![full_claim(
            "v",
            "a1",
            ClaimMode::Write,
            AccessMode::SingleNodeWriter
        )]
    );
    assert!(h.claims().claim_calls() >= 2, "the claim was not retried");

    h.m().release("a1").expect("release a1");
    assert!(h.m().wait_released("a1", WAIT));
    let mounted = waiter
        .join()
        .expect("mount thread")
        .expect("a2 gets the volume");
    assert_eq!(mounted[0].host_path, t2);

    // a1's teardown completes before a2's first call.
    assert_eq!(
        h.calls_since(3),
        ok_calls(&[
            (NU, "v"),
            (NUS, "v"),
            (CU, "v"),
            (CP, "v"),
            (NS, "v"),
            (NP, "v")
        ])
    );
    let calls = h.lifecycle_calls();
    assert_eq!(calls[3]["target_path"], path_str(&t1));
    assert_eq!(calls[8]["target_path"], path_str(&t2));
    assert_eq!(
        mount_points_under(&h.mount_root),
        sorted(vec![h.staging("v"), t2])
    );
    assert_eq!(
        h.all_claims(),
        vec![full_claim(
            "v",
            "a2",
            ClaimMode::Write,
            AccessMode::SingleNodeWriter
        )]
    );
    let st = h.m().alloc_status("a2").expect("a2");
    assert_eq!(st.volumes[0].phase, Some(Phase::Published));
    assert_eq!(st.volumes[0].message, "");
    assert!(!h.state_on_disk().allocs.contains_key("a1"));
}

fn releasing_an_allocation_that_waits_for_a_claim_leaks_no_claim() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount a1");
    let m = h.m().clone();
    let waiter = thread::spawn(move || m.mount("a2", &[request("data", "v", false)]));
    wait_until(WAIT, "a2 to wait for a1's claim", || {
        h.m()
            .alloc_status("a2")
            .is_some_and(|s| s.volumes[0].message.contains("claimed for writing"))
    });
    // The orchestrator gives up on a2 while it waits, then a1 goes.
    assert_eq!(
        h.m().release("a2").expect("release a2"),
        ReleaseStart::Started
    );
    assert!(h.m().wait_released("a2", WAIT));
    h.m().release("a1").expect("release a1");
    assert!(h.m().wait_released("a1", WAIT));
    match waiter.join().expect("mount thread") {
        Err(MountError::Busy { alloc_id, why }) => {
            assert_eq!(alloc_id, "a2");
            assert_eq!(why, "is being released");
        }
        other => panic!("a2's mount after its release: {other:?}"),
    }
    assert!(h.m().wait_released("a2", WAIT));

    // Only a1's calls; no claim, record or mount left behind for a2.
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[
            (CP, "v"),
            (NS, "v"),
            (NP, "v"),
            (NU, "v"),
            (NUS, "v"),
            (CU, "v")
        ])
    );
    assert_all_released(&h);
}

// ---- 4. Two allocations, one staged volume -------------------------------------

fn two_allocations_share_one_staging_and_one_attachment() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    let usage = "rw-file-system-multi-node-multi-writer";
    let staging = h.staging("v");
    let (t1, t2) = (h.target("a1", "v", usage), h.target("a2", "v", usage));

    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("a1");
    h.m()
        .mount("a2", &[request("data", "v", false)])
        .expect("a2");
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v"), (NP, "v")])
    );
    let calls = h.lifecycle_calls();
    assert_eq!(calls[2]["target_path"], path_str(&t1));
    assert_eq!(calls[3]["target_path"], path_str(&t2));
    assert_eq!(calls[3]["staging_target_path"], path_str(&staging));
    assert_eq!(
        calls[3]["publish_context"],
        json!(publish_context("v", PLUGIN_NODE_ID))
    );
    assert_eq!(
        mount_points_under(&h.mount_root),
        sorted(vec![staging.clone(), t1.clone(), t2.clone()])
    );
    // The second allocation shares the attachment and the staging: its
    // record holds both and carries the recorded node ID and context.
    let st = h.state_on_disk();
    let r2 = &st.allocs["a2"].volumes["data"];
    assert!(r2.holds_attachment && r2.holds_staging);
    assert_eq!(r2.external_node_id.as_deref(), Some(PLUGIN_NODE_ID));
    assert_eq!(r2.publish_context, publish_context("v", PLUGIN_NODE_ID));
    assert_eq!(
        claim_list(&st),
        vec![
            full_claim(
                "v",
                "a1",
                ClaimMode::Write,
                AccessMode::MultiNodeMultiWriter
            ),
            full_claim(
                "v",
                "a2",
                ClaimMode::Write,
                AccessMode::MultiNodeMultiWriter
            ),
        ]
    );
    fs::write(t1.join("shared"), b"from a1").expect("write via a1");
    assert_eq!(
        fs::read(t2.join("shared")).expect("read via a2"),
        b"from a1"
    );

    // The first release only unpublishes.
    h.m().release("a1").expect("release a1");
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(h.calls_since(4), ok_calls(&[(NU, "v")]));
    assert_eq!(h.lifecycle_calls()[4]["target_path"], path_str(&t1));
    assert_eq!(
        mount_points_under(&h.mount_root),
        sorted(vec![staging.clone(), t2.clone()])
    );
    assert!(!h.mount_root.join("per-alloc/a1").exists());
    assert_eq!(
        h.attachments(),
        BTreeMap::from([(external_id("v"), vec![PLUGIN_NODE_ID.to_string()])])
    );
    assert_eq!(
        h.all_claims(),
        vec![full_claim(
            "v",
            "a2",
            ClaimMode::Write,
            AccessMode::MultiNodeMultiWriter
        )]
    );
    assert_eq!(
        fs::read(t2.join("shared")).expect("a2 still reads"),
        b"from a1"
    );

    // The last one tears everything down.
    h.m().release("a2").expect("release a2");
    assert!(h.m().wait_released("a2", WAIT));
    assert_eq!(
        h.calls_since(5),
        ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
    );
    let calls = h.lifecycle_calls();
    assert_down_details(
        &calls[5..].iter().collect::<Vec<_>>(),
        "v",
        &staging,
        &t2,
        PLUGIN_NODE_ID,
    );
    assert_all_released(&h);
}

both_stores!(
    mount_then_release_sends_the_exact_calls_and_leaves_nothing,
    read_only_request_gives_a_read_only_mount,
    final_claim_error_mounts_nothing_and_claims_nothing,
    second_writer_waits_for_the_held_claim_then_gets_the_volume,
    releasing_an_allocation_that_waits_for_a_claim_leaks_no_claim,
    two_allocations_share_one_staging_and_one_attachment,
);
