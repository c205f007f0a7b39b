//! Restore: at start, before new requests are served, bring every recorded
//! allocation back to what was asked. Intact mounts cost no call and no
//! claim; vanished mounts are staged and published again under the claim
//! still held; in-flight phases are finished; releases are resumed in the
//! background.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use super::core::Core;
use super::error::MountError;
use super::mount::{self, MountGuard, Redo};
use super::release;
use crate::failpoints;
use crate::mounts::MountTable;
use crate::state::{Phase, StateError, StateFile};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Published volumes found still mounted: no call made.
    pub intact: usize,
    /// Published volumes whose mount was gone and were redone.
    pub remounted: usize,
    pub mounts_finished: usize,
    /// Allocation mounts still being finished when the restore returned
    /// (waiting for a held claim or a slow plugin).
    pub in_background: usize,
    pub releases_resumed: usize,
    pub errors: Vec<String>,
}

/// How far a restore got: allocations on record, and those done (intact,
/// released in the background, or mounted again).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreProgress {
    pub allocations: usize,
    pub done: usize,
}

/// What the records ask for, sorted by what must happen.
#[derive(Default)]
struct Plan {
    to_mount: Vec<String>,
    to_release: Vec<String>,
    /// Published but gone: the node side is redone (no write, no claim).
    remount: BTreeSet<(String, String)>,
    intact: usize,
}

fn plan(snapshot: &StateFile, table: &MountTable, rebooted: bool) -> Plan {
    let mut p = Plan::default();
    for a in snapshot.allocs.values() {
        if a.releasing || a.volumes.values().any(|v| v.phase.is_teardown()) {
            p.to_release.push(a.id.clone());
            continue;
        }
        let mut needs = false;
        for v in a.volumes.values() {
            if v.phase == Phase::Published {
                if !rebooted && table.is_mount_point(&v.target_path) {
                    p.intact += 1;
                    continue;
                }
                p.remount.insert((a.id.clone(), v.alias.clone()));
            }
            needs = true;
        }
        if needs {
            p.to_mount.push(a.id.clone());
        }
    }
    p
}

pub fn restore(core: &Arc<Core>, progress: &dyn Fn(RestoreProgress)) -> RestoreReport {
    failpoints::hit("restore-start");
    let mut report = RestoreReport::default();
    // Whatever the records hold may have been set up by any of them before
    // this run: the last holder tears it down (`down::Down::after`). First,
    // so that no way out of the restore skips it.
    core.store.read(|s| {
        for (_, v) in s.alloc_volumes() {
            if let (true, Some(staging)) = (v.holds_staging, &v.staging_path) {
                core.progress.stage_may_be_live(staging);
            }
            if v.holds_attachment {
                let node_id = v.external_node_id.as_deref().unwrap_or_default();
                core.progress.attachment_may_be_live(&v.volume_id, node_id);
            }
        }
    });
    let table = match MountTable::read() {
        Ok(t) => t,
        Err(e) => {
            report
                .errors
                .push(format!("cannot read {}: {e}", crate::mounts::MOUNTINFO));
            return report;
        }
    };
    let rebooted = core.store.rebooted();
    if rebooted {
        log::info!("the node rebooted since the state was written: every recorded mount is redone");
    }
    let snapshot = core.store.snapshot();
    let p = plan(&snapshot, &table, rebooted);
    let mut told = RestoreProgress {
        allocations: snapshot.allocs.len(),
        done: snapshot.allocs.len() - p.to_mount.len(),
    };
    drop(snapshot);
    progress(told);
    report.intact = p.intact;
    // One write at most: this boot, and records of an earlier release cut
    // off before NodeStage (read as `mounting`) made users of the staging
    // path they will stage. Nothing to write: no write.
    let r = core.store.update(|s| -> Result<(), StateError> {
        let stale: Vec<(String, String)> = s
            .alloc_volumes()
            .filter(|(_, v)| {
                v.phase == Phase::Mounting && v.staging_path.is_some() && !v.holds_staging
            })
            .map(|(a, v)| (a.id.clone(), v.alias.clone()))
            .collect();
        for (alloc, alias) in stale {
            if let Some(v) = s.volume_mut(&alloc, &alias) {
                v.holds_staging = true;
            }
        }
        if s.boot_id != core.store.boot_id() {
            s.boot_id = core.store.boot_id().to_string();
        }
        Ok(())
    });
    if let Err(e) = r {
        report.errors.push(crate::error_chain(&e));
        return report;
    }
    report.remounted = p.remount.len();
    resume_releases(core, &p.to_release, &mut report);
    let remount = Arc::new(p.remount);
    finish_mounts(core, &p.to_mount, &remount, &mut report, &mut |n| {
        told.done += n;
        progress(told);
    });
    log::info!(
        "restore: {} intact, {} remounted, {} allocation mount(s) finished, {} still running, {} release(s) resumed, {} error(s)",
        report.intact,
        report.remounted,
        report.mounts_finished,
        report.in_background,
        report.releases_resumed,
        report.errors.len()
    );
    report
}

fn resume_releases(core: &Arc<Core>, ids: &[String], report: &mut RestoreReport) {
    for id in ids {
        // A teardown phase without the flag (should not happen) still means
        // the release must go on.
        let _ = core.store.update(|s| -> Result<(), StateError> {
            if let Some(a) = s.alloc_mut(id) {
                a.releasing = true;
            }
            Ok(())
        });
        match release::release(core, id) {
            Ok(_) => report.releases_resumed += 1,
            Err(e) => report
                .errors
                .push(format!("{id}: {}", crate::error_chain(&e))),
        }
    }
}

/// Finishes mounts on one worker per allocation. Requests are served only
/// after each finished, or waits for the cluster (a claim held elsewhere,
/// etcd not answering: `Progress::waits_for_cluster`), or `restore_wait`
/// passed, whichever comes first: a mount that waits out a held claim (or
/// a plugin that does not come back) goes on in the background, so it
/// cannot keep the API, and with it the release that would free the claim,
/// away.
fn finish_mounts(
    core: &Arc<Core>,
    ids: &[String],
    remount: &Arc<BTreeSet<(String, String)>>,
    report: &mut RestoreReport,
    finished: &mut dyn FnMut(usize),
) {
    let (tx, rx) = crossbeam_channel::unbounded::<(String, Result<(), MountError>)>();
    let (park_tx, parked) = crossbeam_channel::unbounded::<String>();
    core.progress.report_cluster_waits(Some(park_tx));
    let mut pending = BTreeSet::new();
    for id in ids {
        let guard = match mount::begin(core, id) {
            Ok(g) => g,
            Err(e) => {
                report
                    .errors
                    .push(format!("{id}: {}", crate::error_chain(&e)));
                continue;
            }
        };
        let c = core.clone();
        let (id2, tx, remount) = (id.clone(), tx.clone(), remount.clone());
        let spawned = core.spawn(format!("restore-{id}"), move || {
            let r = restore_alloc(&c, &id2, &remount, guard);
            if let Err(e) = &r {
                log::error!(
                    "restore of allocation {id2}: {}; mount it again to retry",
                    crate::error_chain(e)
                );
            }
            let _ = tx.send((id2, r));
        });
        match spawned {
            Ok(()) => {
                pending.insert(id.clone());
            }
            Err(super::core::SpawnError::Stopping) => {}
            Err(super::core::SpawnError::Io(e)) => report
                .errors
                .push(format!("{id}: restore worker could not start: {e}")),
        }
    }
    drop(tx);
    let deadline = Instant::now() + core.opts.restore_wait;
    let started = pending.len();
    let mut failed = 0;
    while !pending.is_empty() {
        crossbeam_channel::select! {
            recv(rx) -> m => {
                let Ok((id, r)) = m else { break };
                // One that went on in the background counts there.
                if pending.remove(&id) {
                    finished(1);
                    match r {
                        Ok(()) => report.mounts_finished += 1,
                        Err(e) => {
                            failed += 1;
                            report
                                .errors
                                .push(format!("{id}: {}", crate::error_chain(&e)));
                        }
                    }
                }
            }
            recv(parked) -> m => {
                // Waits for a claim or for etcd, retrying on its own: the
                // API (and the release that may free that claim) is not
                // kept waiting for it.
                if let Ok(id) = m {
                    if pending.remove(&id) {
                        log::info!(
                            "restore: allocation {id} waits for the cluster; it goes on in the background"
                        );
                    }
                }
            }
            default(deadline.saturating_duration_since(Instant::now())) => break,
        }
    }
    core.progress.report_cluster_waits(None);
    report.in_background = started - report.mounts_finished - failed;
}

fn restore_alloc(
    core: &Core,
    alloc_id: &str,
    remount: &BTreeSet<(String, String)>,
    _guard: MountGuard,
) -> Result<(), MountError> {
    let aliases: Vec<String> = core.store.read(|s| {
        s.allocs
            .get(alloc_id)
            .map(|a| a.volumes.keys().cloned().collect())
            .unwrap_or_default()
    });
    let deadline = Instant::now() + core.opts.mount_retry_deadline;
    for alias in aliases {
        let redo = if remount.contains(&(alloc_id.to_string(), alias.clone())) {
            Redo::NodeSide
        } else {
            Redo::Unfinished
        };
        mount::mount_volume(core, alloc_id, &alias, deadline, redo)?;
    }
    Ok(())
}
