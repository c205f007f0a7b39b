//! Release: every volume of an allocation goes down on its own worker
//! thread, so one stuck volume never holds back the others. Per volume:
//! NodeUnpublish, NodeUnstage when the node's last user of the staging path
//! is gone, ControllerUnpublish (with the external node ID recorded at
//! attach time) only after the node side succeeded and no other record
//! holds the attachment, then the claim is freed and the record dropped.

use std::sync::Arc;
use std::time::Instant;

use super::core::{Core, SpawnError, Step, StepResult};
use super::error::{ReleaseError, StepError};
use super::progress::{ReleaseState, ReleasedVolume};
use crate::claims::ClaimChange;
use crate::failpoints;
use crate::plugins::PluginKind;
use crate::retry::{Backoff, Interrupted};
use crate::state::{AllocVolume, Phase};
use crate::volumes::mounted::ensure_unmounted;
use crate::volumes::{requests, SpecError};

/// Outcome of asking for a release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseStart {
    /// Workers run (or were already running).
    Started,
    /// Nothing is recorded for this allocation: already released.
    NotFound,
}

/// Starts releasing every volume of `alloc_id`, one worker per volume.
///
/// A published volume whose operation lock is free takes its first step
/// down (claim marked releasing, phase `unpublishing`) in the transaction
/// that marks the release; its worker then starts with NodeUnpublish. A
/// volume whose lock is taken (a mount or restore step in flight) is left
/// to its worker.
pub fn release(core: &Arc<Core>, alloc_id: &str) -> Result<ReleaseStart, ReleaseError> {
    crate::ids::check_id("allocation", alloc_id)
        .map_err(|e| ReleaseError::Invalid(SpecError::Id(e)))?;
    let published: Vec<(String, String)> = core.store.read(|s| {
        s.allocs
            .get(alloc_id)
            .map(|a| {
                a.volumes
                    .values()
                    .filter(|v| v.phase == Phase::Published)
                    .map(|v| (v.alias.clone(), v.volume_id.clone()))
                    .collect()
            })
            .unwrap_or_default()
    });
    let held: Vec<_> = published
        .iter()
        .filter_map(|(alias, volume_id)| {
            core.locks
                .try_lock(volume_id)
                .map(|g| (alias, volume_id, g))
        })
        .collect();
    let changes = held
        .iter()
        .map(|(_, volume_id, _)| ClaimChange::MarkReleasing {
            volume_id: volume_id.to_string(),
            alloc_id: alloc_id.to_string(),
        })
        .collect();
    let mut aliases = None;
    core.transact(
        changes,
        &|s| s.allocs.contains_key(alloc_id),
        &mut |s, outcomes| {
            for ((alias, _, _), outcome) in held.iter().zip(outcomes) {
                let published =
                    s.volume(alloc_id, alias).map(|v| v.phase) == Some(Phase::Published);
                if outcome.is_ok() && published {
                    if let Some(v) = s.volume_mut(alloc_id, alias) {
                        v.phase = Phase::Unpublishing;
                    }
                }
            }
            if let Some(a) = s.alloc_mut(alloc_id) {
                a.releasing = true;
                aliases = Some(a.volumes.keys().cloned().collect::<Vec<_>>());
            }
        },
    )?;
    drop(held);
    let Some(aliases) = aliases else {
        return Ok(ReleaseStart::NotFound);
    };
    failpoints::hit("release-after-mark");
    log::info!(
        "releasing allocation {alloc_id}: {} volume(s)",
        aliases.len()
    );
    for alias in aliases {
        spawn_worker(core, alloc_id, &alias)?;
    }
    Ok(ReleaseStart::Started)
}

fn spawn_worker(core: &Arc<Core>, alloc_id: &str, alias: &str) -> Result<(), ReleaseError> {
    let Some(rec) = core.record(alloc_id, alias) else {
        // Released meanwhile by a worker that was already running.
        return Ok(());
    };
    let volume = rec.volume_id.clone();
    let report = ReleasedVolume {
        volume_id: rec.volume_id,
        plugin_id: rec.plugin_id,
        target_path: rec.target_path,
        read_only: rec.usage.read_only,
        attachment: rec.usage.attachment,
    };
    if !core.progress.begin_release(alloc_id, alias, report) {
        return Ok(());
    }
    let c = core.clone();
    let (a, al) = (alloc_id.to_string(), alias.to_string());
    let spawned = core.spawn(format!("release-{volume}"), move || worker(&c, &a, &al));
    if let Err(e) = spawned {
        let e = match e {
            SpawnError::Io(e) => ReleaseError::Spawn(e),
            SpawnError::Stopping => ReleaseError::Stopping,
        };
        core.progress.end_release(
            alloc_id,
            alias,
            ReleaseState::Stopped {
                error: e.to_string(),
            },
        );
        return Err(e);
    }
    Ok(())
}

/// One volume's release: steps down until released, retrying each step
/// with its own backoff, up to the release deadline.
fn worker(core: &Core, alloc_id: &str, alias: &str) {
    let deadline = Instant::now() + core.opts.release_retry_deadline;
    let mut backoff = Backoff::new(core.opts.csi_backoff, deadline);
    let outcome = loop {
        if core.shutdown.is_triggered() {
            break ReleaseState::Stopped {
                error: "the agent is stopping".to_string(),
            };
        }
        match step(core, alloc_id, alias, deadline) {
            Ok(Step::Next) => {
                // Each step starts its own backoff.
                backoff.reset();
            }
            Ok(Step::Done) => break ReleaseState::Released,
            Err(e) => {
                crate::metrics::RELEASE_FAILURES.inc();
                let msg = crate::error_chain(&e);
                log::warn!("release of {alloc_id}/{alias}: {msg} (retrying)");
                core.progress.set_release(
                    alloc_id,
                    alias,
                    ReleaseState::Retrying {
                        error: msg.clone(),
                        attempts: backoff.attempts() + 1,
                    },
                );
                if let Err(why) = backoff.wait(&core.shutdown) {
                    break ReleaseState::Stopped {
                        error: match why {
                            Interrupted::Shutdown => {
                                format!("the agent is stopping; last error: {msg}")
                            }
                            Interrupted::Deadline => {
                                format!("gave up at the release deadline; last error: {msg}")
                            }
                        },
                    };
                }
            }
        }
    };
    match &outcome {
        ReleaseState::Released => log::info!("allocation {alloc_id}: volume {alias} released"),
        other => {
            log::warn!("allocation {alloc_id}: release of volume {alias} stopped: {other:?}")
        }
    }
    core.progress.end_release(alloc_id, alias, outcome);
}

/// One step down, under the volume's operation lock.
fn step(core: &Core, alloc_id: &str, alias: &str, deadline: Instant) -> StepResult {
    let Some(rec) = core.record(alloc_id, alias) else {
        return Ok(Step::Done);
    };
    let _lock = core.lock_volume(&rec.volume_id)?;
    let Some(rec) = core.record(alloc_id, alias) else {
        return Ok(Step::Done);
    };
    match rec.phase {
        // No CSI call was sent; the claim may or may not be held.
        Phase::Claiming => core.free_and_drop(alloc_id, alias, &rec.volume_id),
        // NodePublish was never sent: nothing to unpublish.
        Phase::ControllerPublishing | Phase::Staging => {
            down(core, alloc_id, alias, &rec, next_after_unpublish(&rec))
        }
        Phase::Publishing | Phase::Published | Phase::Unpublishing => {
            unpublish(core, alloc_id, alias, &rec, deadline)
        }
        Phase::Unstaging => unstage(core, alloc_id, alias, &rec, deadline),
        Phase::ControllerUnpublishing => {
            controller_unpublish(core, alloc_id, alias, &rec, deadline)
        }
        Phase::ReleasingClaim => core.free_and_drop(alloc_id, alias, &rec.volume_id),
    }
}

fn unpublish(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
    deadline: Instant,
) -> StepResult {
    if rec.phase != Phase::Unpublishing {
        let mark = ClaimChange::MarkReleasing {
            volume_id: rec.volume_id.clone(),
            alloc_id: alloc_id.to_string(),
        };
        match core.advance_with_claim(alloc_id, alias, mark, |v| v.phase = Phase::Unpublishing) {
            Ok(()) => {}
            // The node side does not wait for the claim store: the claim
            // stays held (shown as taken) until it is freed at the end.
            Err(StepError::Claim(e)) => {
                log::warn!(
                    "release of {alloc_id}/{alias}: the claim cannot be marked releasing ({e}); unmounting anyway"
                );
                core.advance(alloc_id, alias, |v| v.phase = Phase::Unpublishing)?;
            }
            Err(e) => return Err(e),
        }
    }
    let node = core
        .plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline)
        .map_err(StepError::Plugin)?;
    failpoints::hit("before-node-unpublish");
    match node
        .client
        .node_unpublish_volume(&requests::node_unpublish(rec.volume_ref()))
    {
        Err(e) if !e.is_ignorable() => return Err(e.into()),
        _ => {}
    }
    failpoints::hit("after-node-unpublish");
    ensure_unmounted(&rec.target_path, "NodeUnpublishVolume")?;
    // The plugin removes the target; the agent removes the parents it
    // created, when empty.
    let _ = std::fs::remove_dir(&rec.target_path);
    core.paths.remove_empty_parents(&rec.target_path);
    down(core, alloc_id, alias, rec, next_after_unpublish(rec))
}

fn unstage(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
    deadline: Instant,
) -> StepResult {
    let staging = rec.staging_path.clone().unwrap_or_default();
    let others = core
        .store
        .read(|s| s.staging_users(&staging, (alloc_id, alias)));
    if others == 0 {
        let node = core
            .plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline)
            .map_err(StepError::Plugin)?;
        failpoints::hit("before-node-unstage");
        match node
            .client
            .node_unstage_volume(&requests::node_unstage(rec.volume_ref(), &staging))
        {
            Err(e) if !e.is_ignorable() => return Err(e.into()),
            _ => {}
        }
        failpoints::hit("after-node-unstage");
        ensure_unmounted(&staging, "NodeUnstageVolume")?;
        let _ = std::fs::remove_dir(&staging);
        core.paths.remove_empty_parents(&staging);
    }
    let next = next_after_unstage(rec);
    if next == Phase::ReleasingClaim {
        return finish(core, alloc_id, alias, rec);
    }
    core.advance(alloc_id, alias, |v| {
        v.holds_staging = false;
        v.phase = next;
    })?;
    Ok(Step::Next)
}

fn controller_unpublish(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
    deadline: Instant,
) -> StepResult {
    if let Some(back) = settle(core, alloc_id, alias, rec)? {
        return Ok(back);
    }
    let others = core
        .store
        .read(|s| s.attachment_users(&rec.volume_id, (alloc_id, alias)).len());
    if others == 0 {
        let c = core
            .plugin_for_release(&rec.plugin_id, PluginKind::Controller, deadline)
            .map_err(StepError::Plugin)?;
        let spec = core.spec(&rec.volume_id);
        let req = requests::controller_unpublish(rec.volume_ref(), spec.as_deref());
        failpoints::hit("before-controller-unpublish");
        match c.client.controller_unpublish_volume(&req) {
            Err(e) if !e.is_ignorable() => return Err(e.into()),
            _ => {}
        }
        failpoints::hit("after-controller-unpublish");
    }
    finish(core, alloc_id, alias, rec)
}

/// The last step down: frees the claim and drops the record. When the
/// claim store cannot free it now, the record remembers that the node side
/// and the detach are done, so the retry only frees the claim (a release
/// with the cluster store cut off waits in this phase).
fn finish(core: &Core, alloc_id: &str, alias: &str, rec: &AllocVolume) -> StepResult {
    if let Some(back) = settle(core, alloc_id, alias, rec)? {
        return Ok(back);
    }
    match core.free_and_drop(alloc_id, alias, &rec.volume_id) {
        Err(e @ StepError::Claim(_)) => {
            core.advance(alloc_id, alias, |v| {
                v.holds_staging = false;
                v.holds_attachment = false;
                v.phase = Phase::ReleasingClaim;
            })?;
            Err(e)
        }
        other => other,
    }
}

/// Before the detach and the freeing of the claim: when a call of this
/// volume timed out (the plugin may still be carrying it out), wait until
/// it had time to finish, then make sure none of the volume's paths became
/// a mount point meanwhile. One that did sends the record back to the
/// teardown step that undoes it (Some(Next)); None: go on.
fn settle(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
) -> Result<Option<Step>, StepError> {
    let Some(since) = core.progress.uncertain_since(alloc_id, alias) else {
        return Ok(None);
    };
    let until = since + core.opts.uncertain_settle;
    let now = Instant::now();
    if now < until {
        log::info!(
            "release of {alloc_id}/{alias}: a call timed out {:?} ago; waiting {:?} for the plugin to finish it before the volume is detached or its claim freed",
            now - since,
            until - now
        );
        // Under the volume's operation lock: no other operation of this
        // volume starts meanwhile.
        if !core.shutdown.sleep(until - now) {
            return Err(StepError::Stopping);
        }
    }
    let mounted = |p: &std::path::Path| {
        crate::mounts::is_mount_point(p).map_err(|source| {
            StepError::StillMounted(crate::volumes::mounted::StillMounted::Unknown {
                path: p.to_path_buf(),
                source,
            })
        })
    };
    if mounted(&rec.target_path)? {
        log::warn!(
            "release of {alloc_id}/{alias}: {} became a mount point after a timed-out call; unpublishing again",
            rec.target_path.display()
        );
        core.advance(alloc_id, alias, |v| v.phase = Phase::Unpublishing)?;
        return Ok(Some(Step::Next));
    }
    if let Some(staging) = &rec.staging_path {
        let others = core
            .store
            .read(|s| s.staging_users(staging, (alloc_id, alias)));
        if others == 0 && mounted(staging)? {
            log::warn!(
                "release of {alloc_id}/{alias}: {} became a mount point after a timed-out call; unstaging again",
                staging.display()
            );
            core.advance(alloc_id, alias, |v| {
                v.holds_staging = true;
                v.phase = Phase::Unstaging;
            })?;
            return Ok(Some(Step::Next));
        }
    }
    core.progress.clear_uncertain(alloc_id, alias);
    Ok(None)
}

/// Records the next phase down; a record that has nothing left to undo
/// frees its claim and is dropped in the same transaction.
fn down(core: &Core, alloc_id: &str, alias: &str, rec: &AllocVolume, next: Phase) -> StepResult {
    if next == Phase::ReleasingClaim {
        return finish(core, alloc_id, alias, rec);
    }
    core.advance(alloc_id, alias, |v| v.phase = next)?;
    Ok(Step::Next)
}

fn next_after_unpublish(v: &AllocVolume) -> Phase {
    if v.holds_staging {
        Phase::Unstaging
    } else {
        next_after_unstage(v)
    }
}

fn next_after_unstage(v: &AllocVolume) -> Phase {
    if v.holds_attachment {
        Phase::ControllerUnpublishing
    } else {
        Phase::ReleasingClaim
    }
}
