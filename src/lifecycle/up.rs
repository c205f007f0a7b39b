//! The calls up of one volume, from its intent (`mounting`) to its result
//! (`published`): ControllerPublish (when the plan attaches), NodeStage
//! (when it stages), NodePublish, then one durable write. Which of them
//! answered lives here, in memory: a crash redoes them all (they are
//! idempotent), and a retry in the same run redoes only the one that
//! failed.

use std::collections::BTreeMap;
use std::path::Path;

use super::core::{attach_change, Core, Step, StepResult};
use super::error::StepError;
use super::plan::ControllerRoute;
use crate::claims::AttachRequest;
use crate::failpoints;
use crate::plugins::PluginSnapshot;
use crate::state::{AllocVolume, Phase};
use crate::volumes::requests;

/// A call of the way up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    ControllerPublish,
    NodeStage,
    NodePublish,
}

impl Call {
    /// What `alloc status` shows while this call is next.
    pub fn step_name(self) -> &'static str {
        match self {
            Call::ControllerPublish => "controller-publishing",
            Call::NodeStage => "staging",
            Call::NodePublish => "publishing",
        }
    }
}

/// Where one volume's way up stands in this run.
#[derive(Debug)]
pub struct Up {
    /// The calls still to make, in order.
    left: Vec<Call>,
    /// The publish context ControllerPublish answered (or the shared
    /// attachment's), for NodeStage, NodePublish and the result.
    publish_context: Option<BTreeMap<String, String>>,
    /// A published volume whose mounts are gone: only the node side is
    /// redone, and the record is published already.
    node_side_only: bool,
}

impl Up {
    /// The whole way up of a record in `mounting`.
    pub fn all(rec: &AllocVolume) -> Up {
        let mut left = Vec::new();
        if rec.holds_attachment {
            left.push(Call::ControllerPublish);
        }
        if rec.staging_path.is_some() {
            left.push(Call::NodeStage);
        }
        left.push(Call::NodePublish);
        Up {
            left,
            publish_context: None,
            node_side_only: false,
        }
    }

    /// NodeStage and NodePublish again for a published record whose
    /// mounts are gone (a reboot, or an administrator's umount), under the
    /// attachment and publish context it recorded.
    pub fn node_side(rec: &AllocVolume) -> Up {
        let mut up = Up::all(rec);
        up.left.retain(|c| *c != Call::ControllerPublish);
        up.publish_context = Some(rec.publish_context.clone());
        up.node_side_only = true;
        up
    }

    pub fn next(&self) -> Option<Call> {
        self.left.first().copied()
    }

    fn done(&mut self) {
        if !self.left.is_empty() {
            self.left.remove(0);
        }
    }
}

/// The next call up, under the volume's operation lock. `Done` once the
/// result is durable.
pub fn step(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    up: &mut Up,
    node: &PluginSnapshot,
    controller: Option<&ControllerRoute>,
) -> StepResult {
    let gone = |why: String| StepError::Gone { why };
    let rec = core
        .record(alloc_id, alias)
        .ok_or_else(|| gone(format!("no longer records volume {alias}")))?;
    let _lock = core.lock_volume(&rec.volume_id)?;
    // Re-read under the lock: a release may have started meanwhile.
    let (rec, releasing) = core
        .store
        .read(|s| {
            let a = s.allocs.get(alloc_id)?;
            Some((a.volumes.get(alias)?.as_ref().clone(), a.releasing))
        })
        .ok_or_else(|| gone(format!("no longer records volume {alias}")))?;
    let expected = if up.node_side_only {
        Phase::Published
    } else {
        Phase::Mounting
    };
    if releasing || rec.phase != expected {
        return Err(match rec.phase {
            Phase::Claiming => gone(format!("volume {alias} is not claimed yet")),
            Phase::Published if !up.node_side_only => return Ok(Step::Done),
            _ => gone("is being released".to_string()),
        });
    }
    let spec = core
        .spec(&rec.volume_id)
        .ok_or_else(|| StepError::UnknownVolume {
            volume_id: rec.volume_id.clone(),
        })?;
    let me = (alloc_id, alias);
    // The record as the calls see it: with the publish context of this run.
    let mut sent = rec.clone();
    if let Some(ctx) = &up.publish_context {
        sent.publish_context = ctx.clone();
    }
    let Some(call) = up.next() else {
        return Ok(Step::Done);
    };
    // No call up under a claim the cluster may have freed: confirmed in
    // this process under a lease still valid, or read back (`fencing`).
    // A mount resumed after a pause or a restore lands here too.
    core.claims
        .check_call_up(&rec.volume_id, alloc_id)
        .map_err(StepError::Claim)?;
    // The claim's epoch, for a plugin that asked for it: recorded with the
    // intent, or known since the check (a read back fills it in).
    let epoch = if core.opts.epoch_plugins.contains(&rec.plugin_id) {
        rec.epoch
            .or_else(|| core.claims.epoch(&rec.volume_id, alloc_id))
    } else {
        None
    };
    let sent_ref = || crate::volumes::requests::VolumeRef {
        epoch,
        ..sent.volume_ref()
    };
    match call {
        Call::ControllerPublish => {
            // Attached to this node for another allocation already (in
            // this run, or by a record whose mount is there now)?
            let node_id = rec.external_node_id.clone().unwrap_or_default();
            // This record uses the attachment from now on, made here or
            // shared: a rollback's way down must count it (its detach step
            // decides by the users left).
            core.progress
                .sending(alloc_id, alias, |s| s.controller_publish = true);
            core.progress
                .attachment_may_be_live(&rec.volume_id, &node_id);
            let shared = core
                .progress
                .attachment(&rec.volume_id, &node_id)
                .or_else(|| {
                    core.store
                        .read(|s| s.established_attachment(&rec.volume_id, Some(&node_id), me))
                });
            let ctx = match shared {
                Some(ctx) => ctx,
                None => {
                    let c = controller.ok_or_else(|| StepError::NoController {
                        plugin_id: rec.plugin_id.clone(),
                    })?;
                    failpoints::hit("before-controller-publish");
                    let ctx = match c {
                        ControllerRoute::Local(c) => {
                            let readonly = c
                                .controller_capabilities
                                .as_ref()
                                .is_some_and(|caps| caps.publish_readonly);
                            let req = requests::controller_publish(sent_ref(), &spec, readonly);
                            c.client.controller_publish_volume(&req)?
                        }
                        ControllerRoute::Remote(r) => {
                            let remote = core.claims.remote_controllers().ok_or_else(|| {
                                StepError::NoController {
                                    plugin_id: r.plugin_id.clone(),
                                }
                            })?;
                            let req = attach_request(core, alloc_id, &rec);
                            remote.attach(&req, core.opts.attach_timeout, &core.shutdown)?
                        }
                    };
                    failpoints::hit("after-controller-publish");
                    core.progress
                        .set_attachment(&rec.volume_id, &node_id, Some(ctx.clone()));
                    ctx
                }
            };
            up.publish_context = Some(ctx);
        }
        Call::NodeStage => {
            let staging = rec.staging_path.clone().unwrap_or_default();
            // As above: staged here or shared, this record uses it now.
            core.progress
                .sending(alloc_id, alias, |s| s.node_stage = true);
            core.progress.stage_may_be_live(&staging);
            let shared = core.progress.is_staged(&staging)
                || core.store.read(|s| s.staging_established(&staging, me));
            if !shared {
                create_dir(&staging)?;
                let req = requests::node_stage(sent_ref(), &spec);
                failpoints::hit("before-node-stage");
                node.client.node_stage_volume(&req)?;
                failpoints::hit("after-node-stage");
                core.progress.set_staged(&staging, true);
            }
        }
        Call::NodePublish => {
            if let Some(parent) = rec.target_path.parent() {
                create_dir(parent)?;
            }
            let req = requests::node_publish(sent_ref(), &spec);
            core.progress
                .sending(alloc_id, alias, |s| s.node_publish = true);
            failpoints::hit("before-node-publish");
            node.client.node_publish_volume(&req)?;
            failpoints::hit("after-node-publish");
            // The plugin's word is not enough: the workload sees only what
            // is mounted in this namespace. An error here undoes the way up
            // (NodeUnpublish first: it was sent).
            crate::volumes::mounted::ensure_mounted(
                &rec.target_path,
                rec.usage.attachment.is_block(),
            )
            .map_err(StepError::NotMounted)?;
            super::volume_ops::expand_pending_on_node(core, node, &rec);
            if !up.node_side_only {
                record_published(core, alloc_id, alias, &rec, up)?;
                core.progress.forget_sent(alloc_id, alias);
            }
            up.done();
            log::info!(
                "allocation {alloc_id}: volume {} mounted at {}",
                rec.volume_id,
                rec.target_path.display()
            );
            return Ok(Step::Done);
        }
    }
    up.done();
    Ok(Step::Next)
}

/// The result, the closing write: `published` with the publish context,
/// and the attachment recorded with the claim.
fn record_published(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
    up: &Up,
) -> Result<(), StepError> {
    let ctx = up.publish_context.clone().unwrap_or_default();
    let published = |v: &mut AllocVolume| {
        v.publish_context = ctx.clone();
        v.phase = Phase::Published;
        // Applied, not yet durable: a crash here finds `mounting`.
        failpoints::hit("mount-after-published");
    };
    // The closing write: the caller is answered once readers see it; it
    // is written with the next write (a crash before that redoes the
    // idempotent way up from the durable `mounting`).
    let attach = rec
        .holds_attachment
        .then(|| attach_change(alloc_id, rec, &ctx));
    core.close_with_claim(alloc_id, alias, attach, published)?;
    Ok(())
}

/// What a controller host on another node needs to attach (or detach)
/// the record's volume to this node.
pub fn attach_request(core: &Core, alloc_id: &str, rec: &AllocVolume) -> AttachRequest {
    AttachRequest {
        volume_id: rec.volume_id.clone(),
        node: core.opts.node_name.clone(),
        plugin_id: rec.plugin_id.clone(),
        external_volume_id: rec.external_volume_id.clone(),
        external_node_id: rec.external_node_id.clone().unwrap_or_default(),
        usage: rec.usage,
        mount_flags: rec.mount_flags.clone(),
        alloc_id: alloc_id.to_string(),
        epoch: 0,
    }
}

fn create_dir(path: &Path) -> Result<(), StepError> {
    std::fs::create_dir_all(path).map_err(|source| StepError::CreateDir {
        path: path.to_path_buf(),
        source,
    })
}
