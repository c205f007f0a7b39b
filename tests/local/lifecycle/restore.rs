//! The restore after a restart, a reboot and every crash point of the
//! protocol: what is mounted costs nothing, what is gone is redone, what
//! was cut off half-way is finished or undone.

use super::*;

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

both_stores!(
    restore_with_everything_mounted_costs_no_call_and_no_claim,
    restore_after_a_reboot_stages_and_publishes_again_under_the_held_claims,
    restore_converges_from_every_crash_on_the_way_up,
    restore_converges_from_every_crash_on_the_way_down,
    restore_after_a_reboot_converges_from_every_crash,
    restore_converges_from_an_earlier_releases_controller_publishing,
);
