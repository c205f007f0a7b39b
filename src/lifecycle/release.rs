//! Release: every volume of an allocation goes down on its own worker
//! thread, so one stuck volume never holds back the others. Per volume:
//! NodeUnpublish, NodeUnstage when the node's last user of the staging path
//! is gone, ControllerUnpublish (with the external node ID recorded at
//! attach time) only after the node side succeeded and no other record
//! holds the attachment, then the claim is freed and the record dropped.

use std::sync::Arc;
use std::time::Instant;

use super::core::{Core, SpawnError, Step};
use super::down::{self, Down};
use super::error::ReleaseError;
use super::progress::{ReleaseState, ReleasedVolume};
use crate::claims::ClaimChange;
use crate::failpoints;
use crate::retry::{Backoff, Interrupted};
use crate::state::Phase;
use crate::volumes::SpecError;

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
/// One durable write before any call: the allocation is marked releasing,
/// and every volume whose operation lock is free goes to `releasing` (its
/// claim marked releasing) in the same transaction; its worker then starts
/// with NodeUnpublish. A volume whose lock is taken (a mount step in
/// flight) is moved by its worker.
pub fn release(core: &Arc<Core>, alloc_id: &str) -> Result<ReleaseStart, ReleaseError> {
    crate::ids::check_id("allocation", alloc_id)
        .map_err(|e| ReleaseError::Invalid(SpecError::Id(e)))?;
    let published: Vec<(String, String)> = core.store.read(|s| {
        s.allocs
            .get(alloc_id)
            .map(|a| {
                a.volumes
                    .values()
                    .filter(|v| matches!(v.phase, Phase::Published | Phase::Mounting))
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
            // A claim the store cannot mark now stays marked `taken` until
            // it is freed: the way down does not wait for the store.
            for ((alias, _, _), _outcome) in held.iter().zip(outcomes) {
                if let Some(v) = s.volume_mut(alloc_id, alias) {
                    if matches!(v.phase, Phase::Published | Phase::Mounting) {
                        v.phase = Phase::Releasing;
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
    let spawned = core.spawn_pooled(format!("release-{volume}"), move || worker(&c, &a, &al));
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
    let mut down = Down::after(core.progress.sent_up(alloc_id, alias));
    let outcome = loop {
        if core.shutdown.is_triggered() {
            break ReleaseState::Stopped {
                error: "the agent is stopping".to_string(),
            };
        }
        core.progress
            .set_step(alloc_id, alias, Some(down.step_name().to_string()));
        match down::step(core, alloc_id, alias, &mut down, deadline) {
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
                // A claim store that answers again (etcd back) ends the
                // wait early: the free it waits for goes on at once.
                let claims = core.claims.clone();
                let shutdown = core.shutdown.clone();
                let mut sleep = |d| claims.wait_reachable(d, &shutdown);
                if let Err(why) = backoff.wait_with(&core.shutdown, &mut sleep) {
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
    core.progress.set_step(alloc_id, alias, None);
    if outcome == ReleaseState::Released {
        core.progress.forget_sent(alloc_id, alias);
    }
    match &outcome {
        ReleaseState::Released => log::info!("allocation {alloc_id}: volume {alias} released"),
        other => {
            log::warn!("allocation {alloc_id}: release of volume {alias} stopped: {other:?}")
        }
    }
    core.progress.end_release(alloc_id, alias, outcome);
}
