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

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread;

use crate::common::*;
use crate::harness::*;
use claimd::claims::{Claim, ClaimError, ClaimMode, ClaimState};
use claimd::lifecycle::{
    MountError, MountedVolume, ReleaseError, ReleaseStart, ReleaseState, RestoreReport,
    VolumeRegistryError,
};
use claimd::plugins::PluginKind;
use claimd::state::{Phase, StateError, StateStore};
use claimd::volumes::{AccessMode, AttachmentMode};
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

mod failures;
mod mount_and_release;
mod restore;
mod retries;
