//! The claim lifecycle end to end at library level: `Lifecycle` against
//! the real test plugin process over a real unix socket, with real bind
//! mounts. Every test asserts the exact lifecycle calls the plugin received
//! (order, counts, node IDs, paths), the mounts in /proc/self/mountinfo,
//! and the state file and claim list.
//!
//! Every test runs twice (see `both_stores!` at the end): against the
//! embedded claim store that ships (`embedded::*`), and against a
//! remote-like store that makes its own round trip before the local record
//! is written (`remote::*`), so both paths of the claim-store contract are
//! proven.

mod common;
mod lifecycle_support;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread;

use claimd::claims::{Claim, ClaimError, ClaimMode, ClaimState};
use claimd::lifecycle::{
    MountError, MountedVolume, ReleaseError, ReleaseStart, ReleaseState, RestoreReport,
    VolumeRegistryError,
};
use claimd::plugins::PluginKind;
use claimd::state::{Phase, StateError, StateStore};
use claimd::volumes::{AccessMode, AttachmentMode};
use common::*;
use lifecycle_support::*;
use serde_json::{json, Value};

const SNW: &str = "rw-file-system-single-node-writer";

fn mount_points_under(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mounts_under(root)
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    v.sort();
    v
}

fn sorted(mut v: Vec<PathBuf>) -> Vec<PathBuf> {
    v.sort();
    v
}

/// What a mount root holds once everything is released: the two fixed
/// directories, empty.
fn released_tree() -> Vec<String> {
    vec!["per-alloc".to_string(), "staging".to_string()]
}

/// Lifecycle calls grouped by external volume ID, as (method, code).
fn per_volume(calls: &[(String, String, String)]) -> BTreeMap<String, Vec<(String, String)>> {
    let mut m: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for (method, vol, code) in calls {
        m.entry(vol.clone())
            .or_default()
            .push((method.clone(), code.clone()));
    }
    m
}

fn ok(methods: &[&str]) -> Vec<(String, String)> {
    methods
        .iter()
        .map(|m| (m.to_string(), "OK".to_string()))
        .collect()
}

fn full_claim(volume: &str, alloc: &str, mode: ClaimMode, access_mode: AccessMode) -> Claim {
    Claim {
        volume_id: volume.to_string(),
        alloc_id: alloc.to_string(),
        node: NODE_NAME.to_string(),
        mode,
        access_mode,
        external_node_id: Some(PLUGIN_NODE_ID.to_string()),
        publish_context: publish_context(volume, PLUGIN_NODE_ID),
        state: ClaimState::Taken,
        since_ms: None,
        last_error: None,
    }
}

/// Asserts the details of one volume's ControllerPublish, NodeStage and
/// NodePublish records.
fn assert_up_details(calls: &[&Value], volume: &str, staging: &Path, target: &Path, ro: bool) {
    let [cp, ns, np] = calls else {
        panic!("expected three calls, got {calls:?}");
    };
    let ctx = json!(publish_context(volume, PLUGIN_NODE_ID));
    let vctx = json!({ "origin": format!("ctx-{volume}") });
    assert_eq!(cp["method"], CP);
    assert_eq!(cp["volume_id"], external_id(volume));
    assert_eq!(cp["node_id"], PLUGIN_NODE_ID);
    // The test plugin does not advertise PUBLISH_READONLY.
    assert_eq!(cp["readonly"], false);
    assert_eq!(cp["secret_keys"], json!(["token"]));
    assert_eq!(cp["volume_context"], vctx);
    assert_eq!(ns["method"], NS);
    assert_eq!(ns["volume_id"], external_id(volume));
    assert_eq!(ns["staging_target_path"], path_str(staging));
    assert_eq!(ns["publish_context"], ctx);
    assert_eq!(ns["volume_context"], vctx);
    assert_eq!(ns["secret_keys"], json!(["token"]));
    assert_eq!(np["method"], NP);
    assert_eq!(np["volume_id"], external_id(volume));
    assert_eq!(np["staging_target_path"], path_str(staging));
    assert_eq!(np["target_path"], path_str(target));
    assert_eq!(np["readonly"], ro);
    assert_eq!(np["publish_context"], ctx);
    assert_eq!(np["volume_context"], vctx);
}

/// Asserts the details of one volume's NodeUnpublish, NodeUnstage and
/// ControllerUnpublish records.
fn assert_down_details(calls: &[&Value], volume: &str, staging: &Path, target: &Path, node: &str) {
    let [nu, nus, cu] = calls else {
        panic!("expected three calls, got {calls:?}");
    };
    assert_eq!(nu["method"], NU);
    assert_eq!(nu["volume_id"], external_id(volume));
    assert_eq!(nu["target_path"], path_str(target));
    assert_eq!(nus["method"], NUS);
    assert_eq!(nus["volume_id"], external_id(volume));
    assert_eq!(nus["staging_target_path"], path_str(staging));
    assert_eq!(cu["method"], CU);
    assert_eq!(cu["volume_id"], external_id(volume));
    assert_eq!(cu["node_id"], node);
    assert_eq!(cu["secret_keys"], json!(["token"]));
}

/// Everything released: no record, no claim, no mount, no attachment,
/// only the fixed directories under the mount root.
fn assert_all_released(h: &Harness) {
    assert_all_released_leaving(h, &released_tree());
}

/// As `assert_all_released`, with the directories expected to be left
/// under the mount root.
fn assert_all_released_leaving(h: &Harness, tree: &[String]) {
    let st = h.state_on_disk();
    assert!(st.allocs.is_empty(), "records left: {:?}", st.allocs);
    assert!(st.claims.is_empty(), "claims left: {:?}", st.claims);
    assert!(h.all_claims().is_empty());
    assert!(h.m().list_allocs().is_empty());
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
    assert_eq!(h.tree(), tree);
    assert_eq!(h.attachments(), BTreeMap::new());
}

fn released(aliases: &[&str]) -> BTreeMap<String, ReleaseState> {
    aliases
        .iter()
        .map(|a| (a.to_string(), ReleaseState::Released))
        .collect()
}

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

// ---- 5 and 6. Restore ------------------------------------------------------------

/// a1: `data` -> v (single-node-writer), `shared` -> w; a2: `shared` -> w
/// (multi-node-multi-writer). Returns the five mount points.
fn mount_two_allocations(h: &Harness) -> Vec<PathBuf> {
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.register(spec("w", &[AccessMode::MultiNodeMultiWriter]));
    let mnmw = "rw-file-system-multi-node-multi-writer";
    h.m()
        .mount(
            "a1",
            &[request("data", "v", false), request("shared", "w", false)],
        )
        .expect("mount a1");
    h.m()
        .mount("a2", &[request("shared", "w", false)])
        .expect("mount a2");
    let points = sorted(vec![
        h.staging("v"),
        h.staging("w"),
        h.target("a1", "v", SNW),
        h.target("a1", "w", mnmw),
        h.target("a2", "w", mnmw),
    ]);
    assert_eq!(mount_points_under(&h.mount_root), points);
    assert_eq!(
        per_volume(&h.calls_since(0)),
        BTreeMap::from([
            (external_id("v"), ok(&[CP, NS, NP])),
            (external_id("w"), ok(&[CP, NS, NP, NP])),
        ])
    );
    points
}

fn assert_all_published(h: &Harness) {
    for (alloc, n) in [("a1", 2), ("a2", 1)] {
        let st = h.m().alloc_status(alloc).expect("recorded");
        assert!(!st.releasing);
        assert_eq!(st.volumes.len(), n);
        for v in &st.volumes {
            assert_eq!(v.phase, Some(Phase::Published), "{alloc}/{}", v.alias);
        }
        assert_eq!(h.m().mounted(alloc).len(), n);
    }
}

/// Releases both allocations of `mount_two_allocations` and checks the
/// usage counts rebuilt from the state: only the last user unstages and
/// detaches.
fn release_two_allocations(h: &Harness, skip: usize) {
    h.m().release("a1").expect("release a1");
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(
        per_volume(&h.calls_since(skip)),
        BTreeMap::from([
            (external_id("v"), ok(&[NU, NUS, CU])),
            (external_id("w"), ok(&[NU])),
        ])
    );
    h.m().release("a2").expect("release a2");
    assert!(h.m().wait_released("a2", WAIT));
    assert_eq!(
        per_volume(&h.calls_since(skip + 4)),
        BTreeMap::from([(external_id("w"), ok(&[NU, NUS, CU]))])
    );
    assert_all_released(h);
}

fn restore_with_everything_mounted_costs_no_call_and_no_claim() {
    let mut h = Harness::new();
    let points = mount_two_allocations(&h);
    let ids_before: Vec<(u64, PathBuf)> = mounts_under(&h.mount_root)
        .into_iter()
        .map(|m| (m.mount_id, m.mount_point))
        .collect();
    let state_before = h.state_on_disk();
    let n = h.lifecycle_calls().len();

    let report = h.restart();
    assert_eq!(
        report,
        RestoreReport {
            intact: 3,
            remounted: 0,
            mounts_finished: 0,
            in_background: 0,
            releases_resumed: 0,
            errors: vec![],
        }
    );
    assert_eq!(h.calls_since(n), vec![]);
    assert_eq!(h.claims().claim_calls(), 0);
    assert_eq!(h.claims().release_calls(), 0);
    // The very same mounts (same mount IDs), and the same state.
    let ids_after: Vec<(u64, PathBuf)> = mounts_under(&h.mount_root)
        .into_iter()
        .map(|m| (m.mount_id, m.mount_point))
        .collect();
    assert_eq!(ids_after, ids_before);
    assert_eq!(mount_points_under(&h.mount_root), points);
    assert_eq!(h.state_on_disk(), state_before);
    assert_all_published(&h);
    // Mounting a restored allocation again answers at once, no call.
    let again = h
        .m()
        .mount(
            "a1",
            &[request("data", "v", false), request("shared", "w", false)],
        )
        .expect("mount again");
    assert_eq!(again.len(), 2);
    assert_eq!(h.calls_since(n), vec![]);
    assert_eq!(h.claims().claim_calls(), 0);

    release_two_allocations(&h, n);
}

fn restore_after_a_reboot_stages_and_publishes_again_under_the_held_claims() {
    let mut h = Harness::new();
    let points = mount_two_allocations(&h);
    let claims_before = h.state_on_disk().claims;
    let n = h.lifecycle_calls().len();

    let report = h.reboot("boot-2");
    assert_eq!(
        report,
        RestoreReport {
            intact: 0,
            remounted: 3,
            mounts_finished: 2,
            in_background: 0,
            releases_resumed: 0,
            errors: vec![],
        }
    );
    // One NodeStage per staged volume (w is shared by two allocations),
    // one NodePublish per target, no ControllerPublish, no claim.
    assert_eq!(
        per_volume(&h.calls_since(n)),
        BTreeMap::from([
            (external_id("v"), ok(&[NS, NP])),
            (external_id("w"), ok(&[NS, NP, NP])),
        ])
    );
    assert_eq!(h.claims().claim_calls(), 0);
    assert_eq!(mount_points_under(&h.mount_root), points);
    for p in &points {
        assert_eq!(mounts_at(p).len(), 1, "{}", p.display());
    }
    let st = h.state_on_disk();
    assert_eq!(st.boot_id, "boot-2");
    assert_eq!(st.claims, claims_before);
    assert_all_published(&h);

    let n = h.lifecycle_calls().len();
    release_two_allocations(&h, n);
}

// ---- 7. Restore from every crash point --------------------------------------

/// Where a crash left a1/data -> v: its durable phase, and how many of that
/// phase's calls had taken effect (up: ControllerPublish, NodeStage,
/// NodePublish; down: NodeUnpublish, NodeUnstage, ControllerUnpublish).
/// `Claiming`: `done` 1 means the claim was taken, 0 that it was not.
#[derive(Clone, Copy, Debug)]
struct Crash {
    phase: Phase,
    done: usize,
}

/// The state a crash leaves, crafted from a real mount of a1/data -> v by
/// undoing what had not happened yet (and doing what had, on the way down).
fn craft_crash(h: &Harness, crash: Crash) {
    let target = h.target("a1", "v", SNW);
    let staging = h.staging("v");
    let Crash { phase, done } = crash;
    let (attached, staged, published) = match phase {
        Phase::Claiming => (false, false, false),
        Phase::Mounting => (done >= 1, done >= 2, done >= 3),
        Phase::Published => (true, true, true),
        Phase::Releasing => (done < 3, done < 2, done < 1),
    };
    if !published {
        umount(&target);
        // The plugin created the target and removes it on unpublish; the
        // agent removes the parents it created.
        fs::remove_dir(&target).expect("remove the target");
        if phase != Phase::Mounting || done < 2 {
            remove_empty_dirs(&h.mount_root.join("per-alloc/a1"));
        }
    }
    if !staged {
        umount(&staging);
        if phase != Phase::Mounting {
            remove_empty_dirs(&h.mount_root.join("staging").join(PLUGIN));
        }
    }
    if !attached {
        h.forget_attachment("v");
    }
    let claim_held = phase != Phase::Claiming || done >= 1;
    h.edit_state(|s| {
        let a = s.alloc_mut("a1").expect("a1");
        a.releasing = phase == Phase::Releasing;
        let v = std::sync::Arc::make_mut(a.volumes.get_mut("data").expect("data"));
        v.phase = phase;
        match phase {
            Phase::Claiming => {
                v.external_node_id = None;
                v.staging_path = None;
                v.publish_context.clear();
                v.holds_attachment = false;
                v.holds_staging = false;
            }
            // The intent holds everything but the publish context, which
            // the result records.
            Phase::Mounting => v.publish_context.clear(),
            _ => {}
        }
        if !claim_held {
            s.claims.clear();
        }
        for c in s.claims.values_mut() {
            let c = std::sync::Arc::make_mut(c);
            if matches!(phase, Phase::Claiming | Phase::Mounting) {
                // The attachment is recorded with the claim in the result.
                c.external_node_id = None;
                c.publish_context.clear();
            }
            if phase == Phase::Releasing {
                c.state = ClaimState::Releasing;
            }
        }
    });
}

/// Every crash point of the protocol.
fn every_crash() -> Vec<Crash> {
    let mut v = vec![
        Crash {
            phase: Phase::Claiming,
            done: 0,
        },
        Crash {
            phase: Phase::Claiming,
            done: 1,
        },
    ];
    for phase in [Phase::Mounting, Phase::Releasing] {
        for done in 0..=3 {
            v.push(Crash { phase, done });
        }
    }
    v
}

/// The lifecycle calls a restore sends after `crash`: the whole idempotent
/// sequence from the durable phase (no call for a claim never taken).
fn calls_to_finish(crash: Crash) -> Vec<&'static str> {
    match crash.phase {
        Phase::Claiming | Phase::Mounting => vec![CP, NS, NP],
        Phase::Published => vec![],
        Phase::Releasing => vec![NU, NUS, CU],
    }
}

fn restore_converges_from(crash: Crash) {
    let case = format!("crash in {} after {} call(s)", crash.phase, crash.done);
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    let target = h.target("a1", "v", SNW);
    let staging = h.staging("v");
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    let published = h.state_on_disk();
    h.stop();
    craft_crash(&h, crash);
    let n = h.lifecycle_calls().len();

    h.start_again(FIRST_BOOT);
    let writes_before = h.m().store().write_stats().writes;
    let report = h.m().restore();
    assert_eq!(report.errors, Vec::<String>::new(), "{case}");
    let want = ok_calls(
        &calls_to_finish(crash)
            .into_iter()
            .map(|m| (m, "v"))
            .collect::<Vec<_>>(),
    );

    if crash.phase == Phase::Releasing {
        assert_eq!(report.releases_resumed, 1, "{case}");
        assert!(h.m().wait_released("a1", WAIT), "{case}: release hangs");
        assert_eq!(h.m().release_status("a1"), released(&["data"]), "{case}");
        assert_eq!(h.calls_since(n), want, "{case}");
        let cu = &h.lifecycle_calls()[n + 2];
        assert_eq!(cu["node_id"], PLUGIN_NODE_ID, "{case}");
        assert_eq!(h.claims().claim_calls(), 0, "{case}");
        assert_eq!(h.claims().release_calls(), 1, "{case}");
        assert_all_released(&h);
    } else {
        assert_eq!(report.mounts_finished, 1, "{case}");
        assert_eq!(h.calls_since(n), want, "{case}");
        let claim_calls = usize::from(crash.phase == Phase::Claiming);
        assert_eq!(h.claims().claim_calls(), claim_calls, "{case}");
        // Exactly one mount at each path, and the very record and claim a
        // clean mount leaves.
        assert_eq!(
            mount_points_under(&h.mount_root),
            sorted(vec![staging.clone(), target.clone()]),
            "{case}"
        );
        assert_eq!(mounts_at(&target).len(), 1, "{case}");
        assert_eq!(mounts_at(&staging).len(), 1, "{case}");
        let st = h.state_on_disk();
        assert_eq!(st.allocs, published.allocs, "{case}");
        assert_eq!(st.claims, published.claims, "{case}");
        // One durable write to finish (two from `claiming`: the intent
        // with the claim, then the result).
        let writes = h.m().store().write_stats().writes - writes_before;
        let want_writes = if crash.phase == Phase::Claiming { 2 } else { 1 };
        assert_eq!(writes, want_writes, "{case}: durable writes");
        assert_eq!(
            h.attachments(),
            BTreeMap::from([(external_id("v"), vec![PLUGIN_NODE_ID.to_string()])]),
            "{case}"
        );
        fs::write(target.join("after-restore"), b"ok").expect("write through the target");
        assert!(h
            .plugin
            .volume_dir(&external_id("v"))
            .join("after-restore")
            .exists());
        // And it still releases cleanly.
        let n = h.lifecycle_calls().len();
        h.m().release("a1").expect("release");
        assert!(h.m().wait_released("a1", WAIT), "{case}");
        assert_eq!(
            h.calls_since(n),
            ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")]),
            "{case}"
        );
        assert_all_released(&h);
    }
}

fn restore_converges_from_every_crash_on_the_way_up() {
    for crash in every_crash() {
        if crash.phase != Phase::Releasing {
            restore_converges_from(crash);
        }
    }
}

fn restore_converges_from_every_crash_on_the_way_down() {
    for crash in every_crash() {
        if crash.phase == Phase::Releasing {
            restore_converges_from(crash);
        }
    }
}

/// After a reboot nothing is mounted: a record in `mounting` redoes the
/// whole way up, one in `releasing` the whole way down.
fn restore_after_a_reboot_converges_from_every_crash() {
    for crash in every_crash()
        .into_iter()
        .filter(|c| c.phase != Phase::Claiming)
    {
        let case = format!(
            "reboot after a crash in {} after {} call(s)",
            crash.phase, crash.done
        );
        let mut h = Harness::new();
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        h.m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mount");
        let published = h.state_on_disk();
        h.stop();
        craft_crash(&h, crash);
        let n = h.lifecycle_calls().len();
        detach_all_under(&h.mount_root);
        h.start_again("boot-2");
        let report = h.m().restore();
        assert_eq!(report.errors, Vec::<String>::new(), "{case}");
        let want = ok_calls(
            &calls_to_finish(crash)
                .into_iter()
                .map(|m| (m, "v"))
                .collect::<Vec<_>>(),
        );
        if crash.phase == Phase::Releasing {
            assert!(h.m().wait_released("a1", WAIT), "{case}");
            assert_eq!(h.calls_since(n), want, "{case}");
            assert_all_released(&h);
        } else {
            assert_eq!(h.calls_since(n), want, "{case}");
            let st = h.state_on_disk();
            assert_eq!(st.allocs, published.allocs, "{case}");
            assert_eq!(st.boot_id, "boot-2");
            assert_eq!(
                mount_points_under(&h.mount_root),
                sorted(vec![h.staging("v"), h.target("a1", "v", SNW)]),
                "{case}"
            );
        }
    }
}

/// A record an earlier release wrote in `controller-publishing` (read as
/// `mounting`) had not set its staging flag yet: the restore makes it a
/// user of its staging path before redoing the way up, so it converges,
/// and later unstages, like any intent.
fn restore_converges_from_an_earlier_releases_controller_publishing() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    let published = h.state_on_disk();
    h.stop();
    craft_crash(
        &h,
        Crash {
            phase: Phase::Mounting,
            done: 0,
        },
    );
    h.edit_state(|s| {
        let v = s.volume_mut("a1", "data").expect("record");
        v.holds_staging = false;
    });
    let n = h.lifecycle_calls().len();
    h.start_again(FIRST_BOOT);
    let report = h.m().restore();
    assert_eq!(report.errors, Vec::<String>::new());
    assert_eq!(
        h.calls_since(n),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
    );
    let st = h.state_on_disk();
    assert_eq!(st.allocs, published.allocs);
    assert!(st.allocs["a1"].volumes["data"].holds_staging);
    let n = h.lifecycle_calls().len();
    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(
        h.calls_since(n),
        ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
    );
    assert_all_released(&h);
}

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

/// Each step of a release starts its own backoff: after NodeUnpublish
/// failed three times (waits growing to the cap), NodeUnstage's first
/// retry waits the initial delay again.
fn each_release_step_starts_its_own_backoff() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.plugin.faults().set(json!([
        {"method": NU, "action": "fail", "code": "UNAVAILABLE", "count": 3},
        {"method": NUS, "action": "fail", "code": "UNAVAILABLE", "count": 1}
    ]));
    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    let calls: Vec<Value> = h.lifecycle_calls().into_iter().skip(3).collect();
    let methods: Vec<(String, String)> = calls
        .iter()
        .map(|c| {
            let (m, _, code) = summary(c);
            (m, code)
        })
        .collect();
    let u = "UNAVAILABLE".to_string();
    let ok = "OK".to_string();
    assert_eq!(
        methods,
        vec![
            (NU.to_string(), u.clone()),
            (NU.to_string(), u.clone()),
            (NU.to_string(), u.clone()),
            (NU.to_string(), ok.clone()),
            (NUS.to_string(), u),
            (NUS.to_string(), ok.clone()),
            (CU.to_string(), ok),
        ]
    );
    let ts = |i: usize| calls[i]["ts_ms"].as_u64().expect("ts_ms");
    // The harness backs off from 50 ms doubling to a 200 ms cap (±25 %
    // jitter): the third NodeUnpublish retry waited 150-250 ms. NodeUnstage's
    // first retry must wait the initial 37-63 ms again (plus the call and a
    // state write), never the 150-250 ms a backoff shared with the
    // previous step would have reached.
    let last_unpublish_wait = ts(3) - ts(2);
    let first_unstage_wait = ts(5) - ts(4);
    assert!(
        last_unpublish_wait >= 150,
        "the third NodeUnpublish retry waited {last_unpublish_wait} ms"
    );
    assert!(
        first_unstage_wait < 140,
        "NodeUnstage's first retry waited {first_unstage_wait} ms"
    );
    assert_all_released(&h);
}

/// A controller detach that keeps failing after the node side succeeded:
/// the claim shows `node-detached` (still held) while the detach is
/// retried, nothing is mounted any more, and the claim is freed once the
/// detach succeeds.
fn a_detach_being_retried_shows_the_claim_node_detached() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("mount");
    h.plugin.faults().set(json!([
        {"method": CU, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    h.m().release("a1").expect("release");
    let claim = || {
        h.all_claims()
            .into_iter()
            .find(|c| c.volume_id == "v" && c.alloc_id == "a1")
    };
    let state = || claim().map(|c| c.state);
    wait_until(WAIT, "the claim marked node-detached", || {
        state() == Some(ClaimState::NodeDetached)
    });
    let why = claim().and_then(|c| c.last_error).unwrap_or_default();
    assert!(
        why.contains("UNAVAILABLE") || why.contains("navailable"),
        "the claim says why it is not freed: {why:?}"
    );
    assert!(
        mounts_under(&h.mount_root).is_empty(),
        "the node side is done while the detach is retried"
    );
    let calls: Vec<(String, String)> = h
        .lifecycle_calls()
        .into_iter()
        .skip(3)
        .take(3)
        .map(|c| {
            let (m, _, code) = summary(&c);
            (m, code)
        })
        .collect();
    let call = |m: &str, code: &str| (m.to_string(), code.to_string());
    assert_eq!(
        calls,
        vec![call(NU, "OK"), call(NUS, "OK"), call(CU, "UNAVAILABLE")]
    );
    h.plugin.faults().set(json!([]));
    assert!(h.m().wait_released("a1", WAIT));
    assert_eq!(state(), None, "freed once detached");
    assert_all_released(&h);
}

/// A node plugin's `max_volumes_per_node` reached on this node fails a
/// mount of another volume at once, naming the limit; nothing is sent,
/// claimed or recorded for it. A volume already in use still mounts.
fn the_node_plugins_volume_limit_fails_a_mount_at_once() {
    let h = Harness::with_plugin(|b| b.max_volumes_per_node(1));
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    h.register(spec("w", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.m()
        .mount("a1", &[request("data", "v", false)])
        .expect("a1");
    let before = h.state_on_disk();
    let calls = h.lifecycle_calls().len();
    let started = std::time::Instant::now();
    let err = h
        .m()
        .mount("a2", &[request("other", "w", false)])
        .expect_err("over the limit");
    assert!(
        started.elapsed() < WAIT,
        "refused at once, not after retries"
    );
    match &err {
        MountError::VolumeLimit { max, in_use, .. } => {
            assert_eq!(*max, 1);
            assert_eq!(in_use, &vec!["v".to_string()]);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(
        claimd::error_chain(&err).contains("at most 1 volume(s) per node"),
        "{err}"
    );
    assert_eq!(h.lifecycle_calls().len(), calls);
    assert_eq!(h.state_on_disk(), before);
    // The volume in use shares its attachment: not a new one.
    h.m()
        .mount("a3", &[request("data", "v", false)])
        .expect("a3");
    for a in ["a1", "a3"] {
        h.m().release(a).expect("release");
        assert!(h.m().wait_released(a, WAIT));
    }
    assert_all_released(&h);
}

/// A mount whose retries find the node plugin gone waits for it to be
/// ready again (saying so in its status) and finishes through the new
/// instance, instead of calling a dead socket.
fn mount_retries_wait_for_the_plugin_to_come_back() {
    let mut h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 1000}
    ]));
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a1", &[request("data", "v", false)]));
    wait_until(WAIT, "NodePublish to fail once", || {
        h.lifecycle_calls().iter().any(|c| c["method"] == NP)
    });
    h.plugin.kill();
    wait_until(WAIT, "the mount to wait for the plugin", || {
        h.m().alloc_status("a1").is_some_and(|s| {
            s.volumes[0]
                .message
                .contains("waiting for node plugin testplug to be ready again")
        })
    });
    h.plugin.faults().set(json!([]));
    h.replace_plugin(|b| b);
    let mounted = mounting
        .join()
        .expect("the mount thread")
        .expect("mounted through the new plugin");
    assert!(is_mount_point(&mounted[0].host_path));
    let last = h.lifecycle_calls().pop().expect("a call");
    assert_eq!(
        summary(&last),
        (NP.to_string(), external_id("v"), "OK".to_string())
    );
    h.m().release("a1").expect("release");
    assert!(h.m().wait_released("a1", WAIT));
    assert_all_released(&h);
}

/// A NodePublish that hits its deadline is uncertain: the plugin carries it
/// out after the caller gave up. When the mount then fails and is rolled
/// back, nothing of it may survive: the teardown waits for the late call to
/// settle, finds the target mounted again and unpublishes it again, and
/// the controller detach and the claim's release come after the last
/// unmount.
fn a_timed_out_publish_that_completes_late_leaves_no_mount() {
    // A plugin that creates the target's parent itself: the rollback
    // removing it does not stop the late call.
    let h = Harness::with_plugin(|b| b.args(&["--create-target-parent"]));
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "late", "ms": 300, "count": 1},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1},
        // The rollback's NodeUnstage is slow: the staging is still there
        // when the late NodePublish is carried out, so it succeeds.
        {"method": NUS, "action": "delay", "ms": 1500, "count": 1}
    ]));
    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("the second NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a1", WAIT), "the rollback ends");
    assert_eq!(h.m().release_status("a1"), released(&["data"]));
    let calls = h.lifecycle_calls();
    let late = calls
        .iter()
        .find(|c| c["method"] == NP && c["late"] == true)
        .expect("the late NodePublish was carried out");
    assert_eq!(late["code"], "OK", "the late NodePublish mounted: {late}");
    let cu = calls.iter().find(|c| c["method"] == CU).expect("detached");
    let unpublishes: Vec<&Value> = calls.iter().filter(|c| c["method"] == NU).collect();
    let last_nu = unpublishes.last().expect("unpublished");
    let ts = |c: &Value| c["ts_ms"].as_u64().expect("ts_ms");
    assert!(
        ts(last_nu) >= ts(late),
        "the last NodeUnpublish ({}) came before the late mount ({}): {calls:#?}",
        ts(last_nu),
        ts(late)
    );
    assert!(ts(cu) >= ts(last_nu), "detach before the last unmount");
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
    assert_all_released_leaving(&h, &released_tree());
}

/// A rollback after a timed-out NodePublish sends its first NodeUnpublish
/// only after the plugin had time to finish the late call (issue 22,
/// defect 13): a plugin that records the publish in its own books without
/// a visible mount is otherwise left published.
fn the_rollback_of_a_timed_out_publish_waits_before_its_first_unpublish() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::SingleNodeWriter]));
    h.wait_plugin_ready();
    h.plugin.faults().set(json!([
        {"method": NP, "action": "late", "ms": 300, "count": 1},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1}
    ]));
    let err = h
        .m()
        .mount("a1", &[request("data", "v", false)])
        .expect_err("the second NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a1", WAIT), "the rollback ends");
    let calls = h.lifecycle_calls();
    let late = calls
        .iter()
        .find(|c| c["method"] == NP && c["late"] == true)
        .expect("the late NodePublish was carried out");
    let first_nu = calls
        .iter()
        .find(|c| c["method"] == NU)
        .expect("unpublished");
    let ts = |c: &Value| c["ts_ms"].as_u64().expect("ts_ms");
    assert!(
        ts(first_nu) >= ts(late),
        "the first NodeUnpublish ({}) came before the late NodePublish ended ({}): {calls:#?}",
        ts(first_nu),
        ts(late)
    );
    assert_eq!(mount_points_under(&h.mount_root), Vec::<PathBuf>::new());
}

/// A mount that shared another allocation's staging and attachment, and
/// fails after that allocation was released, undoes both: the rollback's
/// way down counts users, not only the calls it sent itself.
fn a_failed_mount_that_shared_the_staging_undoes_it_when_it_was_the_last_user() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    h.m().mount("b", &[request("data", "v", false)]).expect("b");
    h.plugin.faults().set(json!([
        {"method": NP, "action": "fail", "code": "UNAVAILABLE", "count": 12},
        {"method": NP, "action": "fail", "code": "INVALID_ARGUMENT",
         "message": "bad flags", "count": 1}
    ]));
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a", &[request("data", "v", false)]));
    wait_until(WAIT, "a's NodePublish to be failing", || {
        h.lifecycle_calls()
            .iter()
            .any(|c| c["method"] == NP && c["code"] == "UNAVAILABLE")
    });
    // b goes while a still counts as a user: b leaves staging and
    // attachment to a.
    h.m().release("b").expect("release b");
    assert!(h.m().wait_released("b", WAIT));
    let err = mounting
        .join()
        .expect("the mount thread")
        .expect_err("a's NodePublish fails for good");
    assert!(matches!(err, MountError::Csi { .. }), "{err:?}");
    assert!(h.m().wait_released("a", WAIT), "the rollback ends");
    let methods: Vec<String> = h
        .lifecycle_calls()
        .iter()
        .map(|c| c["method"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        methods.iter().filter(|m| *m == NS).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(
        methods.iter().filter(|m| *m == NUS).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(
        methods.iter().filter(|m| *m == CU).count(),
        1,
        "{methods:?}"
    );
    assert_eq!(methods.last().map(String::as_str), Some(CU), "{methods:?}");
    assert_all_released(&h);
}

/// Issue 41, defect 1 (seed 657716 of the fault-injection run): a record
/// holds the staging and the attachment from its intent on, but its way
/// down undid only the calls it sent itself. Writer a recorded its intent
/// and sent nothing (its calls up were refused: the lease was not valid);
/// reader b then did ControllerPublish, NodeStage and NodePublish itself
/// and was released first, leaving staging and attachment to a (a still
/// counted as a user); a was then given up and released as the last
/// holder, and nothing unstaged or detached the volume: a staging mount
/// and an attachment left on a node with no claim. The last holder tears
/// them down, whoever set them up.
///
/// On f62dff5 the last release sent no NodeUnstageVolume and no
/// ControllerUnpublishVolume (the staging stayed mounted).
fn the_last_holder_tears_down_a_staging_and_attachment_it_did_not_set_up() {
    let h = Harness::new();
    h.register(spec("v", &[AccessMode::MultiNodeMultiWriter]));
    let staging = h.staging("v");
    h.claims().refuse_calls_up("a", false);
    let m = h.m().clone();
    let mounting = thread::spawn(move || m.mount("a", &[request("data", "v", false)]));
    wait_until(WAIT, "a's first call up to be refused", || {
        h.claims().calls_up_refused("a") > 0
    });
    let st = h.state_on_disk();
    let ra = &st.allocs["a"].volumes["data"];
    assert_eq!(ra.phase, Phase::Mounting);
    assert!(ra.holds_staging && ra.holds_attachment, "{ra:?}");
    assert!(h.lifecycle_calls().is_empty(), "{:?}", h.lifecycle_calls());

    h.m().mount("b", &[request("data", "v", true)]).expect("b");
    assert_eq!(
        h.calls_since(0),
        ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
    );
    h.m().release("b").expect("release b");
    assert!(h.m().wait_released("b", WAIT));
    // a still counts as a user: b leaves the staging and the attachment.
    assert_eq!(h.calls_since(3), ok_calls(&[(NU, "v")]));
    assert!(mount_points_under(&h.mount_root).contains(&staging));

    h.claims().refuse_calls_up("a", true);
    let err = mounting
        .join()
        .expect("the mount thread")
        .expect_err("a's claim is gone");
    assert!(matches!(err, MountError::Claim { .. }), "{err:?}");
    assert!(h.m().wait_released("a", WAIT), "the rollback ends");
    assert_eq!(
        h.calls_since(4),
        ok_calls(&[(NUS, "v"), (CU, "v")]),
        "the last holder unstages and detaches"
    );
    assert_all_released(&h);
}

// ---- The remote-like store's own path --------------------------------------

/// The claims of the local state file alone (no remote claims merged in).
fn local_claims(h: &Harness) -> usize {
    claimd::state::load_dir(&h.state_dir)
        .expect("state reads back")
        .expect("a state")
        .state
        .claims
        .len()
}

/// With a store that lives outside the agent, the claim is taken by a
/// round trip before the local record changes, never kept in the state
/// file, and an unreachable store is retried, not fatal.
#[test]
fn remote_store_unreachable_during_mount_is_retried_and_claims_stay_remote() {
    with_store(StoreKind::Remote, || {
        let h = Harness::new();
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        h.wait_plugin_ready();
        h.claims().fail_next(3);
        let mounted = h
            .m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mounts once the store answers");
        assert_eq!(mounted.len(), 1);
        assert!(is_mount_point(&mounted[0].host_path));
        let log = h.claims().remote_log();
        let takes = log.iter().filter(|l| *l == "take v a1").count();
        assert_eq!(
            takes, 4,
            "three failed takes, then one that went through: {log:?}"
        );
        assert_eq!(
            log.last().map(String::as_str),
            Some("attach v a1"),
            "{log:?}"
        );
        assert_eq!(local_claims(&h), 0, "claims are never in the local state");
        let claims = h.all_claims();
        assert_eq!(claims.len(), 1);
        assert_eq!(claims[0].state, ClaimState::Taken);
        assert_eq!(
            claims[0].external_node_id.as_deref(),
            Some(PLUGIN_NODE_ID),
            "the attachment is recorded with the claim"
        );
        assert_eq!(
            h.calls_since(0),
            ok_calls(&[(CP, "v"), (NS, "v"), (NP, "v")])
        );
    });
}

/// A release with the store cut off does the node side and the detach at
/// once, then frees the claim when the store answers again.
#[test]
fn remote_store_unreachable_during_release_frees_the_claim_when_it_answers() {
    with_store(StoreKind::Remote, || {
        let h = Harness::new();
        h.register(spec("v", &[AccessMode::SingleNodeWriter]));
        h.m()
            .mount("a1", &[request("data", "v", false)])
            .expect("mount");
        let before = h.claims().remote_log().len();
        // Marking the claim fails (in the release's first write: the way
        // down does not wait for it), and so do the first two frees, after
        // the node side and the detach went through.
        h.claims().fail_verb("mark-releasing", 1);
        h.claims().fail_verb("free", 2);
        assert_eq!(h.m().release("a1").expect("release"), ReleaseStart::Started);
        assert!(h.m().wait_released("a1", WAIT), "release did not end");
        assert_eq!(h.m().release_status("a1"), released(&["data"]));
        let log = h.claims().remote_log()[before..].to_vec();
        assert_eq!(
            log,
            ["mark-releasing v a1", "free v a1", "free v a1", "free v a1"],
            "each change is asked again until the store answers"
        );
        assert_eq!(
            h.calls_since(3),
            ok_calls(&[(NU, "v"), (NUS, "v"), (CU, "v")])
        );
        assert_all_released(&h);
    });
}

// ---- Every test, against both claim stores ----------------------------------

macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(#[test]
            fn $name() {
                super::with_store(super::StoreKind::Embedded, super::$name);
            })*
        }
        mod remote {
            $(#[test]
            fn $name() {
                super::with_store(super::StoreKind::Remote, super::$name);
            })*
        }
    };
}

both_stores!(
    a_failed_mount_that_shared_the_staging_undoes_it_when_it_was_the_last_user,
    the_last_holder_tears_down_a_staging_and_attachment_it_did_not_set_up,
    restore_converges_from_an_earlier_releases_controller_publishing,
    a_timed_out_publish_that_completes_late_leaves_no_mount,
    the_rollback_of_a_timed_out_publish_waits_before_its_first_unpublish,
    one_staging_path_per_volume_read_only_at_publish,
    a_recorded_staging_path_of_the_old_layout_is_kept_and_shared,
    each_release_step_starts_its_own_backoff,
    a_detach_being_retried_shows_the_claim_node_detached,
    the_node_plugins_volume_limit_fails_a_mount_at_once,
    mount_retries_wait_for_the_plugin_to_come_back,
    mount_then_release_sends_the_exact_calls_and_leaves_nothing,
    read_only_request_gives_a_read_only_mount,
    final_claim_error_mounts_nothing_and_claims_nothing,
    second_writer_waits_for_the_held_claim_then_gets_the_volume,
    releasing_an_allocation_that_waits_for_a_claim_leaks_no_claim,
    two_allocations_share_one_staging_and_one_attachment,
    restore_with_everything_mounted_costs_no_call_and_no_claim,
    restore_after_a_reboot_stages_and_publishes_again_under_the_held_claims,
    restore_converges_from_every_crash_on_the_way_up,
    restore_converges_from_every_crash_on_the_way_down,
    restore_after_a_reboot_converges_from_every_crash,
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
);
