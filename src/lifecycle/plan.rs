//! What a volume's mount will do, decided once its plugins are known: which
//! calls it needs (controller attachment, staging), the external node ID,
//! and the node plugin's volume limit.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use super::core::Core;
use super::error::MountError;
use crate::claims::RemoteController;
use crate::plugins::{PluginKind, PluginSnapshot};
use crate::retry::{Backoff, Interrupted};
use crate::state::{AllocVolume, Phase, StateFile};
use crate::volumes::Paths;

/// The node plugin's `max_volumes_per_node`: a volume not in use on this
/// node yet is refused at once when the plugin's limit is reached (retrying
/// RESOURCE_EXHAUSTED cannot help). `mine`: volumes the same mount takes
/// before this one.
pub fn check_volume_limit(
    s: &StateFile,
    plan: &Plan,
    v: &AllocVolume,
    mine: &BTreeSet<String>,
) -> Result<(), MountError> {
    if plan.max_volumes <= 0 {
        return Ok(());
    }
    let mut used: BTreeSet<&str> = s
        .alloc_volumes()
        .filter(|(_, o)| o.plugin_id == v.plugin_id && o.phase != Phase::Claiming)
        .map(|(_, o)| o.volume_id.as_str())
        .collect();
    used.extend(mine.iter().map(String::as_str));
    if used.contains(v.volume_id.as_str()) || (used.len() as i64) < plan.max_volumes {
        return Ok(());
    }
    Err(MountError::VolumeLimit {
        alias: v.alias.clone(),
        plugin_id: v.plugin_id.clone(),
        max: plan.max_volumes,
        in_use: used.into_iter().map(str::to_string).collect(),
    })
}

/// Who attaches a plugin's volumes to this node.
#[derive(Clone)]
pub enum ControllerRoute {
    /// This node's own controller plugin.
    Local(Box<PluginSnapshot>),
    /// A controller host on another node, through the cluster (the node
    /// side of the plugin here has no controller side).
    Remote(RemoteController),
}

/// The controller that attaches the plugin's volumes, when the plugin has
/// one with PUBLISH_UNPUBLISH_VOLUME: this node's own (waited for until
/// ready), or in cluster mode one on another node.
pub fn controller_for(
    core: &Core,
    alloc_id: &str,
    plugin_id: &str,
    alias: &str,
) -> Result<Option<ControllerRoute>, MountError> {
    let reg = &core.registry;
    if reg.serves(plugin_id, PluginKind::Controller) == Some(false) {
        return remote_controller(core, alloc_id, plugin_id, alias);
    }
    if reg.get_ready(plugin_id, PluginKind::Controller).is_none() {
        core.progress.set_message(
            alloc_id,
            alias,
            Some(format!("waiting for controller plugin {plugin_id}")),
        );
    }
    let c = reg
        .wait_for_plugin(plugin_id, PluginKind::Controller, core.opts.plugin_wait)
        .map_err(|source| MountError::Plugin {
            alias: alias.to_string(),
            source,
        })?;
    core.progress.set_message(alloc_id, alias, None);
    Ok(publishes(&c).then_some(ControllerRoute::Local(Box::new(c))))
}

/// The cluster's controller of a plugin this node has no controller side
/// of (None on one node, or when no node registered one), asked again
/// while the claim store cannot answer, up to the claim retry deadline.
fn remote_controller(
    core: &Core,
    alloc_id: &str,
    plugin_id: &str,
    alias: &str,
) -> Result<Option<ControllerRoute>, MountError> {
    let Some(remote) = core.claims.remote_controllers() else {
        return Ok(None);
    };
    let deadline = Instant::now() + core.opts.claim_retry_deadline;
    let mut backoff = Backoff::new(core.opts.claim_backoff, deadline);
    loop {
        let e = match remote.controller_of(plugin_id) {
            Ok(c) => {
                core.progress.set_message(alloc_id, alias, None);
                return Ok(c.map(ControllerRoute::Remote));
            }
            Err(e) if e.is_retryable() => e,
            Err(source) => {
                return Err(MountError::Claim {
                    alias: alias.to_string(),
                    source,
                })
            }
        };
        core.progress.set_message(
            alloc_id,
            alias,
            Some(format!(
                "cannot learn whether plugin {plugin_id} has a controller host in the cluster: {e} (retrying)"
            )),
        );
        core.progress.waits_for_cluster(alloc_id);
        match backoff.wait(&core.shutdown) {
            Ok(()) => {}
            Err(Interrupted::Shutdown) => return Err(MountError::Shutdown),
            Err(Interrupted::Deadline) => {
                return Err(MountError::Claim {
                    alias: alias.to_string(),
                    source: e,
                })
            }
        }
    }
}

fn publishes(controller: &PluginSnapshot) -> bool {
    controller
        .controller_capabilities
        .as_ref()
        .is_some_and(|caps| caps.publish_unpublish_volume)
}

/// Plans for the plugins that are ready now (node side, and controller
/// side when the plugin has one): what lets the first write claim. Plugins
/// not ready are left out; their volumes take the waiting path.
pub fn ready_plans<'a>(
    core: &Core,
    plugins: impl Iterator<Item = &'a str>,
) -> HashMap<String, Plan> {
    let reg = &core.registry;
    let mut plans = HashMap::new();
    for p in plugins.collect::<BTreeSet<_>>() {
        let Some(node) = reg.get_ready(p, PluginKind::Node) else {
            continue;
        };
        let controller = if reg.serves(p, PluginKind::Controller) == Some(false) {
            match core.claims.remote_controllers().map(|r| r.controller_of(p)) {
                None => false,
                Some(Ok(c)) => c.is_some(),
                // The claim store cannot tell now: the waiting path asks.
                Some(Err(_)) => continue,
            }
        } else {
            match reg.get_ready(p, PluginKind::Controller) {
                Some(c) => publishes(&c),
                None => continue,
            }
        };
        plans.insert(p.to_string(), Plan::new(&node, controller));
    }
    plans
}

/// Which calls a volume needs, decided once its plugins are known.
pub struct Plan {
    stage: bool,
    controller: bool,
    /// The node plugin's `max_volumes_per_node` (0: no limit).
    max_volumes: i64,
    /// The node plugin's node ID: the external node ID of the attachment.
    node_id: String,
}

impl Plan {
    pub fn new(node: &PluginSnapshot, controller: bool) -> Plan {
        Plan {
            stage: node
                .node_capabilities
                .as_ref()
                .is_some_and(|c| c.stage_unstage_volume),
            controller,
            max_volumes: node
                .node_info
                .as_ref()
                .map_or(0, |n| n.max_volumes_per_node),
            node_id: node.node_id().unwrap_or_default().to_string(),
        }
    }

    /// The node ID the volume will be attached to, when it will be.
    pub fn attach_node_id(&self) -> Option<String> {
        self.controller.then(|| self.node_id.clone())
    }

    /// The intent: moves a record from `claiming` to `mounting` with
    /// everything recovery needs to redo (or undo) the whole way up: the
    /// staging path, the external node ID, and the holds-flags that make
    /// the record a user of the staging and the attachment from now on,
    /// before any call they stand for is sent. A volume already staged on
    /// this node (`staged`, possibly at a path of an earlier release's
    /// layout) keeps its one staging path.
    pub fn enter(&self, v: &mut AllocVolume, paths: &Paths, staged: Option<PathBuf>) {
        if v.phase != Phase::Claiming {
            return;
        }
        v.staging_path = self
            .stage
            .then(|| staged.unwrap_or_else(|| paths.staging(&v.plugin_id, &v.volume_id)));
        v.holds_staging = self.stage;
        v.holds_attachment = self.controller;
        v.external_node_id = self.controller.then(|| self.node_id.clone());
        v.phase = Phase::Mounting;
    }
}
