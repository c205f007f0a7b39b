//! Mount: take every requested volume of an allocation from nothing to
//! published, reading top-down like the steps it does:
//!
//! 1. the intent, one durable write before any call: the allocation's
//!    records, and for volumes whose plugins are ready the claim and the
//!    plan (`mounting`) in the same transaction; the others wait in
//!    `claiming` and take their claim with their intent in `take_claim`;
//! 2. per volume: ControllerPublish → NodeStage → NodePublish (`up`), then
//!    the result, one durable write (`published`);
//! 3. on a failure, roll back what was done (a release of the allocation).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::core::{Core, Step};
use super::error::{MountError, StepError};
use super::placement::check_node_fits;
use super::plan::{check_volume_limit, controller_for, ready_plans, ControllerRoute, Plan};
use super::progress::NotNow;
use super::release;
use super::up::{self, Up};
use crate::claims::{Applied, ClaimChange, ClaimRequest};
use crate::failpoints;
use crate::plugins::{PluginKind, WaitError};
use crate::retry::{Backoff, Interrupted};
use crate::state::{AllocRecord, AllocVolume, Phase, StateFile};
use crate::volumes::{validate_requests, AttachmentMode, Paths, Usage, VolumeRequest, VolumeSpec};

/// How long a failed mount waits for its own rollback before answering.
pub const ROLLBACK_WAIT: Duration = Duration::from_secs(30);

/// A mounted volume as handed to the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountedVolume {
    pub alias: String,
    pub volume_id: String,
    pub host_path: std::path::PathBuf,
    pub read_only: bool,
    pub block: bool,
}

/// Marks a mount (or restore) of one allocation as running while alive.
pub struct MountGuard {
    core: Arc<Core>,
    alloc_id: String,
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        self.core.progress.end_mount(&self.alloc_id);
    }
}

pub fn begin(core: &Arc<Core>, alloc_id: &str) -> Result<MountGuard, MountError> {
    core.progress
        .begin_mount(alloc_id)
        .map_err(|n| MountError::Busy {
            alloc_id: alloc_id.to_string(),
            why: match n {
                NotNow::Mounting => "is being mounted or restored already",
                NotNow::Releasing => "is being released",
            }
            .to_string(),
        })?;
    Ok(MountGuard {
        core: core.clone(),
        alloc_id: alloc_id.to_string(),
    })
}

/// Mounts every requested volume for `alloc_id` and answers with the host
/// paths; on failure, rolls back what it did so nothing stays half-claimed.
/// Mounting an allocation again with the same requests finishes what is
/// unfinished and answers the same paths.
pub fn mount(
    core: &Arc<Core>,
    alloc_id: &str,
    reqs: &[VolumeRequest],
) -> Result<Vec<MountedVolume>, MountError> {
    validate_requests(alloc_id, reqs)?;
    let _guard = begin(core, alloc_id)?;
    // Mounted already: a failure below (publishing again a volume whose
    // target is empty) leaves the allocation as it is; its other volumes
    // are in use, and a rollback would free their claims.
    let was_published = published_whole(core, alloc_id);
    let result = match record_intent(core, alloc_id, reqs)? {
        Some(refused) => Err(refused),
        None => {
            let deadline = Instant::now() + core.opts.mount_retry_deadline;
            reqs.iter().try_for_each(|r| {
                mount_volume(core, alloc_id, &r.alias, deadline, Redo::Unfinished)
            })
        }
    };
    match result {
        Ok(()) => Ok(mounted(core, alloc_id)),
        // A graceful stop unmounts nothing: the next start finishes this
        // mount from the state.
        Err(e @ MountError::Shutdown) => Err(e),
        Err(e) if was_published => {
            log::warn!(
                "mount of allocation {alloc_id}, mounted already, failed ({}); the allocation is left as it is",
                crate::error_chain(&e)
            );
            Err(e)
        }
        Err(e) => {
            log::warn!(
                "mount of allocation {alloc_id} failed ({}); rolling back",
                crate::error_chain(&e)
            );
            rollback(core, alloc_id);
            Err(e)
        }
    }
}

/// Step 1: records every volume of the allocation in one durable write
/// before any CSI call. Volumes whose plugins are ready take their claim
/// and enter their first in-flight phase in the same transaction; the
/// others start in `claiming` and take the claim in `take_claim`. An
/// allocation already recorded with the same requests is left as it is.
/// Some(error): recorded, but a claim can never be granted (roll back).
fn record_intent(
    core: &Core,
    alloc_id: &str,
    reqs: &[VolumeRequest],
) -> Result<Option<MountError>, MountError> {
    copy_shared_specs(core, reqs)?;
    // The plan, computed once: the records this mount wants.
    let wanted = core
        .store
        .read(|s| wanted_records(core, s, alloc_id, reqs))?;
    let Some(mut wanted) = wanted else {
        return Ok(None);
    };
    let plans = ready_plans(core, wanted.values().map(|v| v.plugin_id.as_str()));
    let claimed: Vec<String> = wanted
        .values()
        .filter(|v| plans.contains_key(&v.plugin_id))
        .map(|v| v.alias.clone())
        .collect();
    // The node plugin's volume limit, counting the volumes this mount
    // attaches before each one.
    core.store.read(|s| -> Result<(), MountError> {
        let mut mine = BTreeSet::new();
        for alias in &claimed {
            let v = &wanted[alias];
            check_volume_limit(s, &plans[&v.plugin_id], v, &mine)?;
            mine.insert(v.volume_id.clone());
        }
        Ok(())
    })?;
    let changes = claimed
        .iter()
        .map(|alias| {
            let v = &wanted[alias];
            let mut req = core.claim_request(alloc_id, v);
            req.external_node_id = plans[&v.plugin_id].attach_node_id();
            ClaimChange::Take(req)
        })
        .collect();
    let paths = &core.paths;
    let applied = core.transact(
        changes,
        // Nothing recorded for this allocation, and nothing incompatible
        // recorded meanwhile for its volumes.
        &|s| matches!(wanted_records(core, s, alloc_id, reqs), Ok(Some(_))),
        &mut |s, outcomes| {
            let mut volumes = std::mem::take(&mut wanted);
            for (alias, outcome) in claimed.iter().zip(outcomes) {
                if let (Ok(()), Some(v)) = (outcome, volumes.get_mut(alias)) {
                    let staged = s.staging_path_of(&v.volume_id, (alloc_id, alias));
                    plans[&v.plugin_id].enter(v, paths, staged);
                    // The take just wrote or read the claim: its epoch
                    // (the fencing token) is kept with the intent, for the
                    // calls up after a restart.
                    v.epoch = core.claims.epoch(&v.volume_id, alloc_id);
                    core.progress.intent_recorded(alloc_id, alias);
                }
            }
            s.allocs.insert(
                alloc_id.to_string(),
                Arc::new(AllocRecord {
                    id: alloc_id.to_string(),
                    releasing: false,
                    references: 1,
                    volumes: volumes.into_iter().map(|(k, v)| (k, Arc::new(v))).collect(),
                }),
            );
        },
    )?;
    let Applied::Done(outcomes) = applied else {
        // The state changed between the read and the write: say why.
        return core
            .store
            .read(|s| wanted_records(core, s, alloc_id, reqs))
            .map(|_| None);
    };
    // Reports of an earlier release under the same ID are stale now.
    core.progress.forget_releases(alloc_id);
    failpoints::hit("mount-after-record");
    if outcomes.iter().any(Result::is_ok) {
        // The claim and the intent are durable already.
        failpoints::hit("mount-after-intent");
    }
    log::info!("mounting allocation {alloc_id}: {} volume(s)", reqs.len());
    // A claim that can never be granted fails the mount now; one held by
    // another allocation is waited for in `take_claim`.
    for (alias, outcome) in claimed.iter().zip(outcomes) {
        if let Err(e) = outcome {
            if !e.is_retryable() {
                return Ok(Some(MountError::Claim {
                    alias: alias.clone(),
                    source: e,
                }));
            }
        }
    }
    Ok(None)
}

/// In cluster mode, the node's copies of the requested volumes' specs
/// (kept in its own state, so it restarts without etcd) are brought up to
/// the cluster's registrations: a volume registered again for other
/// storage, or deregistered, is not mounted from a stale copy (the take
/// compares the registration too). A copy that records on this node still
/// use with other storage is kept, and the mount refused. With etcd away
/// the copy is used as it is (the take needs etcd anyway, and refuses a
/// stale one).
fn copy_shared_specs(core: &Core, reqs: &[VolumeRequest]) -> Result<(), MountError> {
    let Some(shared) = core.claims.shared_volumes() else {
        return Ok(());
    };
    for r in reqs {
        let local = core.spec(&r.volume_id);
        let cluster = match shared.get(&r.volume_id) {
            Ok(cluster) => cluster,
            Err(e) if local.is_some() => {
                log::debug!(
                    "volume {}: registration not read ({e}); using this node's copy",
                    r.volume_id
                );
                continue;
            }
            Err(source) => {
                return Err(MountError::Claim {
                    alias: r.alias.clone(),
                    source,
                })
            }
        };
        if cluster.as_ref() == local.as_deref() {
            continue;
        }
        core.store.update(|s| -> Result<(), MountError> {
            // The calls up of its records carry the copy's context.
            let context_moved = match (&cluster, &local) {
                (Some(c), Some(l)) => c.context != l.context,
                _ => false,
            };
            let user = s.records_of_volume(&r.volume_id).into_iter().find(|(_, v)| {
                match &cluster {
                    None => true,
                    Some(c) => {
                        context_moved
                            || c.plugin_id != v.plugin_id
                            || c.external_id != v.external_volume_id
                    }
                }
            });
            if let Some((a, v)) = user {
                if cluster.is_none() {
                    // Deregistered under a record (a claim freed by hand):
                    // the copy stays for it; new takes are refused.
                    return Ok(());
                }
                return Err(MountError::Incompatible {
                    alias: r.alias.clone(),
                    volume_id: r.volume_id.clone(),
                    holder: a.id.clone(),
                    why: format!(
                        "the cluster registered it again for other storage while allocation {} still uses {} here: release it first",
                        a.id, v.external_volume_id
                    ),
                });
            }
            match &cluster {
                Some(spec) => s.volumes.insert(spec.id.clone(), Arc::new(spec.clone())),
                None => s.volumes.remove(&r.volume_id),
            };
            Ok(())
        })?;
    }
    Ok(())
}

/// The records a mount of `reqs` wants, when nothing is recorded for the
/// allocation yet; None when it is recorded with the same volumes already.
/// Refuses a volume that another allocation on this node uses with another
/// attachment (block device vs file system: one staging cannot serve both).
fn wanted_records(
    core: &Core,
    s: &StateFile,
    alloc_id: &str,
    reqs: &[VolumeRequest],
) -> Result<Option<BTreeMap<String, AllocVolume>>, MountError> {
    {
        let mut wanted = BTreeMap::new();
        for r in reqs {
            let spec = s
                .volumes
                .get(&r.volume_id)
                .ok_or_else(|| MountError::UnknownVolume {
                    volume_id: r.volume_id.clone(),
                })?;
            if !core.registry.knows(&spec.plugin_id) {
                return Err(MountError::UnknownPlugin {
                    alias: r.alias.clone(),
                    plugin_id: spec.plugin_id.clone(),
                });
            }
            let usage = r.resolve(spec)?;
            // Topology and mount group, before any claim, when the node
            // plugin is known already (else after waiting for it).
            if let Some(node) = core.registry.get_ready(&spec.plugin_id, PluginKind::Node) {
                check_node_fits(&r.alias, spec, &r.mount_group, &node)?;
            }
            wanted.insert(
                r.alias.clone(),
                new_record(&core.paths, alloc_id, r, spec, usage),
            );
        }
        if let Some(existing) = s.allocs.get(alloc_id) {
            let why = if existing.releasing {
                "is being released"
            } else if same_volumes(existing, &wanted) {
                return Ok(None);
            } else {
                "already has other volumes mounted; release it first"
            };
            return Err(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: why.to_string(),
            });
        }
        for w in wanted.values() {
            // The volume's own records (the record index), not every
            // record on the node.
            let of_volume = s.records_of_volume(&w.volume_id);
            let other = of_volume
                .iter()
                .copied()
                .find(|(a, o)| a.id != alloc_id && o.usage.attachment != w.usage.attachment);
            if let Some((a, o)) = other {
                return Err(MountError::Incompatible {
                    alias: w.alias.clone(),
                    volume_id: w.volume_id.clone(),
                    holder: a.id.clone(),
                    why: format!(
                        "it is used on this node as {} by allocation {}; {} cannot share its staging",
                        o.usage.attachment, a.id, w.usage.attachment
                    ),
                });
            }
            // The staging is mounted once, for one mount group.
            let other = of_volume
                .iter()
                .copied()
                .find(|(a, o)| a.id != alloc_id && o.mount_group != w.mount_group);
            if let Some((a, o)) = other {
                let group = |g: &str| {
                    if g.is_empty() {
                        "no mount group".to_string()
                    } else {
                        format!("mount group {g}")
                    }
                };
                return Err(MountError::Incompatible {
                    alias: w.alias.clone(),
                    volume_id: w.volume_id.clone(),
                    holder: a.id.clone(),
                    why: format!(
                        "allocation {} uses it on this node with {}; {} cannot share its staging",
                        a.id,
                        group(&o.mount_group),
                        group(&w.mount_group)
                    ),
                });
            }
        }
        Ok(Some(wanted))
    }
}

fn same_volumes(existing: &AllocRecord, wanted: &BTreeMap<String, AllocVolume>) -> bool {
    existing.volumes.len() == wanted.len()
        && wanted.iter().all(|(alias, w)| {
            existing.volumes.get(alias).is_some_and(|v| {
                v.volume_id == w.volume_id && v.usage == w.usage && v.mount_group == w.mount_group
            })
        })
}

fn new_record(
    paths: &Paths,
    alloc_id: &str,
    r: &VolumeRequest,
    spec: &VolumeSpec,
    usage: Usage,
) -> AllocVolume {
    AllocVolume {
        alias: r.alias.clone(),
        volume_id: spec.id.clone(),
        plugin_id: spec.plugin_id.clone(),
        external_volume_id: spec.external_id.clone(),
        external_node_id: None,
        usage,
        mount_flags: r.mount_flags.clone(),
        mount_group: r.mount_group.clone(),
        staging_path: None,
        target_path: paths.target(alloc_id, &spec.id, &usage),
        publish_context: BTreeMap::new(),
        holds_attachment: false,
        holds_staging: false,
        epoch: None,
        phase: Phase::Claiming,
    }
}

/// The host paths of a mounted allocation.
pub fn mounted(core: &Core, alloc_id: &str) -> Vec<MountedVolume> {
    core.store.read(|s| {
        s.allocs
            .get(alloc_id)
            .map(|a| {
                a.volumes
                    .values()
                    .filter(|v| v.phase == Phase::Published)
                    .map(|v| MountedVolume {
                        alias: v.alias.clone(),
                        volume_id: v.volume_id.clone(),
                        host_path: v.target_path.clone(),
                        read_only: v.usage.read_only,
                        block: v.usage.attachment == AttachmentMode::BlockDevice,
                    })
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Whether `alloc_id` is recorded, not being released, and every volume of
/// it is published.
fn published_whole(core: &Core, alloc_id: &str) -> bool {
    core.store.read(|s| {
        s.allocs.get(alloc_id).is_some_and(|a| {
            !a.releasing && a.volumes.values().all(|v| v.phase == Phase::Published)
        })
    })
}

/// A mounted allocation asked for again by a front end that counts its
/// own mounts (the Docker plugin's second Mount): every published volume
/// whose target has nothing mounted is published again (node side), as
/// `mount` does; never rolled back. Nothing to do: no lock taken.
pub fn republish_empty(core: &Arc<Core>, alloc_id: &str) -> Result<(), MountError> {
    let empty: Vec<String> = core.store.read(|s| {
        s.allocs
            .get(alloc_id)
            .map(|a| {
                a.volumes
                    .values()
                    .filter(|v| {
                        v.phase == Phase::Published
                            && matches!(crate::mounts::is_mount_point(&v.target_path), Ok(false))
                    })
                    .map(|v| v.alias.clone())
                    .collect()
            })
            .unwrap_or_default()
    });
    if empty.is_empty() {
        return Ok(());
    }
    let _guard = begin(core, alloc_id)?;
    let deadline = Instant::now() + core.opts.mount_retry_deadline;
    for alias in empty {
        mount_volume(core, alloc_id, &alias, deadline, Redo::Unfinished)?;
    }
    Ok(())
}

/// What a mount of one volume redoes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redo {
    /// From wherever the record stands to `published`.
    Unfinished,
    /// A published volume whose mounts are gone: the node side again.
    NodeSide,
}

/// Step 2: takes one volume from wherever it stands to `published`.
pub fn mount_volume(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    deadline: Instant,
    redo: Redo,
) -> Result<(), MountError> {
    let result = mount_volume_steps(core, alloc_id, alias, deadline, redo);
    core.progress.set_message(alloc_id, alias, None);
    core.progress.set_step(alloc_id, alias, None);
    result
}

fn mount_volume_steps(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    deadline: Instant,
    redo: Redo,
) -> Result<(), MountError> {
    let gone = || MountError::Busy {
        alloc_id: alloc_id.to_string(),
        why: format!("no longer records volume {alias}"),
    };
    let rec = core.record(alloc_id, alias).ok_or_else(gone)?;
    let mut redo = redo;
    if rec.phase == Phase::Published && redo == Redo::Unfinished {
        // Published and still there: nothing to do. Published, and nothing
        // at the target (unmounted by hand, or a restore whose NodePublish
        // landed in another mount namespace): the node side again, so a
        // mount is never answered with an empty directory.
        // A mount, not a block device node: a node made by mknod outlives
        // a reboot, so only NodePublish's answer vouches for one.
        match crate::volumes::mounted::ensure_mounted(&rec.target_path, false) {
            Err(crate::volumes::mounted::NotMounted::Missing { .. }) => {
                log::info!(
                    "allocation {alloc_id}: volume {alias} is recorded as published but nothing is mounted at {}: publishing it again",
                    rec.target_path.display()
                );
                redo = Redo::NodeSide;
            }
            Ok(()) | Err(crate::volumes::mounted::NotMounted::Unknown { .. }) => return Ok(()),
        }
    }
    // The node plugin must be ready before anything else.
    let say = |m: Option<String>| core.progress.set_message(alloc_id, alias, m);
    say(Some(format!("waiting for node plugin {}", rec.plugin_id)));
    let node = core
        .registry
        .wait_for_plugin(&rec.plugin_id, PluginKind::Node, core.opts.plugin_wait)
        .map_err(|source| MountError::Plugin {
            alias: alias.to_string(),
            source,
        })?;
    say(None);
    let controller = controller_for(core, alloc_id, &rec.plugin_id, alias)?;
    // The claim, retrying while another allocation holds it.
    if rec.phase == Phase::Claiming {
        let spec = core
            .spec(&rec.volume_id)
            .ok_or_else(|| MountError::UnknownVolume {
                volume_id: rec.volume_id.clone(),
            })?;
        check_node_fits(alias, &spec, &rec.mount_group, &node)?;
        let plan = Plan::new(&node, controller.is_some());
        core.store
            .read(|s| check_volume_limit(s, &plan, &rec, &BTreeSet::new()))?;
        take_claim(core, alloc_id, &rec, &plan)?;
    }
    // Controller publish, stage, publish, from the intent now recorded.
    let rec = core.record(alloc_id, alias).ok_or_else(gone)?;
    let mut up = match redo {
        Redo::Unfinished => Up::all(&rec),
        Redo::NodeSide => Up::node_side(&rec),
    };
    let (mut node, mut controller) = (node, controller);
    let mut backoff = Backoff::new(core.opts.csi_backoff, deadline);
    loop {
        if core.shutdown.is_triggered() {
            return Err(MountError::Shutdown);
        }
        let live = up.next().map(|c| c.step_name().to_string());
        core.progress.set_step(alloc_id, alias, live);
        match up::step(core, alloc_id, alias, &mut up, &node, controller.as_ref()) {
            Ok(step) => {
                // A call answered: no retry message is current, no earlier
                // timed-out call is in doubt, and the next step starts its
                // own backoff.
                say(None);
                core.progress.clear_uncertain(alloc_id, alias);
                if step == Step::Done {
                    return Ok(());
                }
                backoff.reset();
            }
            Err(e) => {
                if matches!(&e, StepError::Csi(c) if c.is_uncertain()) {
                    // The plugin may still carry the call out: a rollback
                    // must make sure nothing of it is left (see release),
                    // whether this error is retried or not.
                    core.progress
                        .mark_uncertain(alloc_id, alias, Instant::now());
                }
                if !e.is_retryable() {
                    return Err(MountError::from_step(alloc_id, alias, e));
                }
                let msg = crate::error_chain(&e);
                log::warn!("mount of {alloc_id}/{alias}: {msg} (retrying)");
                say(Some(format!("{msg} (retrying)")));
                if matches!(e, StepError::Claim(_)) {
                    // No call up until the cluster confirms the claim.
                    core.progress.waits_for_cluster(alloc_id);
                }
                let timeout = |e: StepError| MountError::Timeout {
                    alias: alias.to_string(),
                    last_error: Box::new(e),
                };
                match backoff.wait(&core.shutdown) {
                    Ok(()) => {}
                    Err(Interrupted::Shutdown) => return Err(MountError::Shutdown),
                    Err(Interrupted::Deadline) => return Err(timeout(e)),
                }
                // A retry goes to a plugin that is ready (waiting for it,
                // within the deadline, when it is not), never to a dead
                // socket, and through its current connection.
                let ready = |kind| {
                    if core.registry.get_ready(&rec.plugin_id, kind).is_none() {
                        say(Some(format!(
                            "waiting for {kind} plugin {} to be ready again (last error: {msg})",
                            rec.plugin_id
                        )));
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    core.registry
                        .wait_for_plugin(&rec.plugin_id, kind, left)
                        .map_err(|w| match w {
                            WaitError::Shutdown { .. } => MountError::Shutdown,
                            w => timeout(StepError::Plugin(w)),
                        })
                };
                node = ready(PluginKind::Node)?;
                if let Some(ControllerRoute::Local(_)) = controller {
                    controller = Some(ControllerRoute::Local(Box::new(ready(
                        PluginKind::Controller,
                    )?)));
                }
            }
        }
    }
}

/// Takes the claim and records the intent in one transaction, retrying
/// while another allocation holds the claim.
fn take_claim(
    core: &Core,
    alloc_id: &str,
    rec: &AllocVolume,
    plan: &Plan,
) -> Result<(), MountError> {
    let deadline = Instant::now() + core.opts.claim_retry_deadline;
    let mut backoff = Backoff::new(core.opts.claim_backoff, deadline);
    let alias = rec.alias.as_str();
    let claim_error = |source| MountError::Claim {
        alias: alias.to_string(),
        source,
    };
    // Made at the first refusal (most takes succeed at once).
    let mut watch: Option<Option<Box<dyn crate::claims::ClaimWatch>>> = None;
    loop {
        // Each attempt runs under the volume's lock and only while the
        // record still waits for its claim: a release that started
        // meanwhile frees the claim under the same lock, and a claim
        // granted after that would be held by no record.
        let attempt = {
            let _lock = core
                .locks
                .lock(&rec.volume_id, core.opts.lock_wait)
                .map_err(|e| MountError::Busy {
                    alloc_id: alloc_id.to_string(),
                    why: e.to_string(),
                })?;
            let paths = &core.paths;
            core.transact(
                vec![ClaimChange::Take(ClaimRequest {
                    external_node_id: plan.attach_node_id(),
                    ..core.claim_request(alloc_id, rec)
                })],
                &|s| {
                    s.allocs.get(alloc_id).is_some_and(|a| {
                        !a.releasing
                            && a.volumes
                                .get(alias)
                                .is_some_and(|v| v.phase == Phase::Claiming)
                    })
                },
                &mut |s, out| {
                    if out.iter().all(Result::is_ok) {
                        let staged = s.staging_path_of(&rec.volume_id, (alloc_id, alias));
                        if let Some(v) = s.volume_mut(alloc_id, alias) {
                            plan.enter(v, paths, staged);
                            // The take just wrote or read the claim: its
                            // epoch is known here, with no round trip.
                            v.epoch = core.claims.epoch(&rec.volume_id, alloc_id);
                            core.progress.intent_recorded(alloc_id, alias);
                        }
                    }
                },
            )?
            .single()
        };
        match attempt {
            Ok(true) => {
                core.progress.set_message(alloc_id, alias, None);
                failpoints::hit("mount-after-intent");
                return Ok(());
            }
            Ok(false) => {
                return Err(MountError::Busy {
                    alloc_id: alloc_id.to_string(),
                    why: "is being released".to_string(),
                })
            }
            Err(e) if e.is_retryable() => {
                crate::metrics::CLAIM_RETRIES.inc();
                let msg = format!("{e} (retrying)");
                log::info!("allocation {alloc_id}: {msg}");
                core.progress.set_message(alloc_id, alias, Some(msg));
                core.progress.waits_for_cluster(alloc_id);
                // Woken early when the volume's claims change (the holder
                // let go), where the claim store can tell.
                if watch.is_none() {
                    watch = Some(core.claims.watch_claims(&rec.volume_id));
                }
                let shutdown = &core.shutdown;
                let mut sleep = |d| match watch.as_ref().and_then(Option::as_ref) {
                    Some(w) => w.wait(d, shutdown),
                    None => shutdown.sleep(d),
                };
                match backoff.wait_with(shutdown, &mut sleep) {
                    Ok(()) => {}
                    Err(Interrupted::Shutdown) => return Err(MountError::Shutdown),
                    Err(Interrupted::Deadline) => return Err(claim_error(e)),
                }
            }
            Err(e) => return Err(claim_error(e)),
        }
    }
}

/// Step 3: a failed mount is undone by releasing the allocation.
fn rollback(core: &Arc<Core>, alloc_id: &str) {
    if let Err(e) = release::release(core, alloc_id) {
        log::error!(
            "rollback of allocation {alloc_id} could not start: {}",
            crate::error_chain(&e)
        );
        return;
    }
    let shutdown = &core.shutdown;
    if !core
        .progress
        .wait_released(alloc_id, ROLLBACK_WAIT, || shutdown.is_triggered())
    {
        log::warn!(
            "rollback of allocation {alloc_id} is still running after {:?}; it goes on in the background",
            ROLLBACK_WAIT
        );
    }
}
