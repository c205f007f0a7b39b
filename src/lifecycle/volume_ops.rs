//! Volume operations through the controller plugin, one node's part:
//! create (CreateVolume, then the facade registers the answer), delete
//! (DeleteVolume, then deregistration) and expand (ControllerExpandVolume,
//! the new capacity recorded, then NodeExpandVolume where this node has the
//! volume mounted, online). Each runs under the volume's operation lock, so
//! it never overlaps a mount or a release step of the same volume.
//!
//! In cluster mode, on a node without the plugin's controller side, these
//! calls go to a controller host elsewhere (`controller_ops`).

use std::path::PathBuf;
use std::sync::Arc;

use super::controller_ops::Controller;
use super::core::Core;
use super::error::VolumeOpError;
use crate::csi::{self, ControllerCapabilities, CsiError};
use crate::plugins::{PluginKind, PluginSnapshot};
use crate::state::{AllocVolume, Phase};
use crate::volumes::requests::{path_string, volume_capability};
use crate::volumes::{ContentSource, Usage, VolumeCreate, VolumeSpec};

/// The registered spec of a volume (in cluster mode: the cluster's).
pub fn registered(core: &Core, id: &str) -> Result<Option<VolumeSpec>, VolumeOpError> {
    if let Some(shared) = core.claims.shared_volumes() {
        return shared
            .get(id)
            .map_err(|e| VolumeOpError::Registry(super::error::VolumeRegistryError::Claims(e)));
    }
    Ok(core.spec(id).map(|s| (*s).clone()))
}

fn registered_or_unknown(core: &Core, id: &str) -> Result<VolumeSpec, VolumeOpError> {
    crate::ids::check_id("volume", id)
        .map_err(|e| VolumeOpError::Invalid(crate::volumes::SpecError::Id(e)))?;
    registered(core, id)?.ok_or_else(|| VolumeOpError::UnknownVolume {
        volume_id: id.to_string(),
    })
}

/// The plugin's controller, ready (waited for up to the plugin wait), when
/// it offers `capability` (named as in the CSI spec): this node's own, or
/// in cluster mode, when this node has no controller side of the plugin, a
/// host of the plugin elsewhere (the calls forwarded through etcd).
pub fn controller(
    core: &Core,
    plugin_id: &str,
    capability: &'static str,
    has: fn(&ControllerCapabilities) -> bool,
    operation: &str,
) -> Result<Controller, VolumeOpError> {
    let reg = &core.registry;
    let unsupported = |capability| VolumeOpError::Unsupported {
        plugin_id: plugin_id.to_string(),
        capability,
        operation: operation.to_string(),
    };
    if !reg.knows(plugin_id) || reg.serves(plugin_id, PluginKind::Controller) == Some(false) {
        let remote = super::controller_ops::remote(core, plugin_id).map_err(|e| {
            VolumeOpError::Request(format!(
                "the cluster's controller hosts of plugin {plugin_id} cannot be read: {e}"
            ))
        })?;
        return match remote {
            Some(c) if has(&c.caps()) => Ok(c),
            Some(_) => Err(unsupported(capability)),
            None if !reg.knows(plugin_id) => Err(VolumeOpError::UnknownPlugin {
                plugin_id: plugin_id.to_string(),
            }),
            None => Err(unsupported("CONTROLLER_SERVICE")),
        };
    }
    let c = reg
        .wait_for_plugin(plugin_id, PluginKind::Controller, core.opts.plugin_wait)
        .map_err(VolumeOpError::Plugin)?;
    if c.controller_capabilities.as_ref().is_some_and(has) {
        Ok(Controller::Local(Box::new(c)))
    } else {
        Err(unsupported(capability))
    }
}

fn csi_error(operation: &str) -> impl FnOnce(CsiError) -> VolumeOpError + '_ {
    move |source| VolumeOpError::Csi {
        operation: operation.to_string(),
        source,
    }
}

/// CreateVolume; answers the spec to register. The same request again
/// gets the same volume from the plugin (idempotent by name); a request
/// that conflicts with the existing volume is refused with the plugin's
/// reason.
pub fn create(core: &Core, req: &VolumeCreate) -> Result<VolumeSpec, VolumeOpError> {
    req.validate().map_err(VolumeOpError::Invalid)?;
    let operation = format!("create volume {}", req.id);
    let existing = registered(core, &req.id)?;
    if let Some(e) = existing.as_ref().filter(|e| e.plugin_id != req.plugin_id) {
        return Err(VolumeOpError::Conflict {
            volume_id: req.id.clone(),
            why: format!(
                "it is registered already with plugin {}, not {}",
                e.plugin_id, req.plugin_id
            ),
        });
    }
    let c = controller(
        core,
        &req.plugin_id,
        "CREATE_DELETE_VOLUME",
        |c| c.create_delete_volume,
        &operation,
    )?;
    let caps = c.caps();
    let unsupported = |capability| VolumeOpError::Unsupported {
        plugin_id: req.plugin_id.clone(),
        capability,
        operation: operation.clone(),
    };
    let source_external = match &req.source {
        Some(ContentSource::SnapshotId(_)) if !caps.create_delete_snapshot => {
            return Err(unsupported("CREATE_DELETE_SNAPSHOT"))
        }
        Some(ContentSource::VolumeId(_)) if !caps.clone_volume => {
            return Err(unsupported("CLONE_VOLUME"))
        }
        Some(ContentSource::VolumeId(v)) => {
            let source = registered_or_unknown(core, v)?;
            if source.plugin_id != req.plugin_id {
                return Err(VolumeOpError::Request(format!(
                    "volume {v} belongs to plugin {}: plugin {} cannot copy it",
                    source.plugin_id, req.plugin_id
                )));
            }
            Some(source.external_id)
        }
        _ => None,
    };
    let constraints = c.plugin_caps().accessibility_constraints;
    if !req.accessibility_requirements.is_empty() && !constraints {
        return Err(unsupported("VOLUME_ACCESSIBILITY_CONSTRAINTS"));
    }
    let volume = c
        .create_volume(&req.csi_request(source_external.as_deref()))
        .map_err(csi_error(&operation))?;
    let spec = req.answered(&volume);
    if let Some(e) = existing.filter(|e| e.external_id != spec.external_id) {
        return Err(VolumeOpError::Conflict {
            volume_id: req.id.clone(),
            why: format!(
                "it is registered already as the plugin's volume {}, but CreateVolume of name {} \
                 answered volume {}, which stays unregistered",
                e.external_id,
                req.csi_name(),
                spec.external_id
            ),
        });
    }
    log::info!(
        "created volume {} as the plugin's {} ({} bytes)",
        spec.id,
        spec.external_id,
        spec.capacity_bytes
    );
    Ok(spec)
}

/// DeleteVolume of a registered volume, under its operation lock;
/// `unused` refuses a volume that is claimed or in use, and runs again
/// under the lock. The caller deregisters it afterwards.
pub fn delete(
    core: &Core,
    id: &str,
    unused: &dyn Fn() -> Result<(), VolumeOpError>,
) -> Result<(), VolumeOpError> {
    let spec = registered_or_unknown(core, id)?;
    unused()?;
    let operation = format!("delete volume {id}");
    let c = controller(
        core,
        &spec.plugin_id,
        "CREATE_DELETE_VOLUME",
        |c| c.create_delete_volume,
        &operation,
    )?;
    let _lock = core.locks.lock(id, core.opts.lock_wait)?;
    unused()?;
    let req = csi::DeleteVolumeRequest {
        volume_id: spec.external_id.clone(),
        secrets: spec.secrets.clone().into_iter().collect(),
        ..Default::default()
    };
    match c.delete_volume(&req) {
        // NOT_FOUND: deleted already.
        Err(e) if !e.is_ignorable() => return Err(csi_error(&operation)(e)),
        _ => {}
    }
    log::info!("deleted volume {id} (the plugin's {})", spec.external_id);
    Ok(())
}

/// What an expansion did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expansion {
    pub capacity_bytes: i64,
    /// Volume paths NodeExpandVolume ran on.
    pub node_expanded: Vec<PathBuf>,
    /// The plugin asked for node expansion and the volume is not mounted
    /// on this node.
    pub node_expansion_pending: bool,
}

/// ControllerExpandVolume to `size` bytes, the new capacity recorded, then
/// NodeExpandVolume (online) where this node has the volume published and
/// the plugin asks for it.
pub fn expand(core: &Core, id: &str, size: i64) -> Result<Expansion, VolumeOpError> {
    let spec = registered_or_unknown(core, id)?;
    if size <= 0 {
        return Err(VolumeOpError::Request(format!(
            "the new size of volume {id} must be a positive number of bytes, not {size}"
        )));
    }
    if spec.capacity_bytes > size {
        return Err(VolumeOpError::Shrink {
            volume_id: id.to_string(),
            current: spec.capacity_bytes,
            asked: size,
        });
    }
    let operation = format!("expand volume {id}");
    let c = controller(
        core,
        &spec.plugin_id,
        "EXPAND_VOLUME",
        |c| c.expand_volume,
        &operation,
    )?;
    let _lock = core.locks.lock(id, core.opts.lock_wait)?;
    // This node's published records of the volume (the staging is shared:
    // one of them is enough for the node's expansion).
    let published: Vec<_> = core.store.read(|s| {
        s.alloc_volumes()
            .filter(|(_, v)| v.volume_id == id && v.phase == Phase::Published)
            .map(|(a, v)| (a.id.clone(), v.clone()))
            .collect()
    });
    let plugin_caps = c.plugin_caps();
    if let Some((alloc, _)) = published.first() {
        if plugin_caps.offline_expansion && !plugin_caps.online_expansion {
            return Err(VolumeOpError::Request(format!(
                "plugin {} expands volumes only offline, and allocation {alloc} has volume {id} \
                 mounted on this node: release it first",
                spec.plugin_id
            )));
        }
    }
    let usage = match published.first() {
        Some((_, v)) => v.usage,
        None => Usage {
            read_only: false,
            attachment: spec.attachment_modes[0],
            access_mode: spec.access_modes[0],
        },
    };
    let capability = volume_capability(&usage, &spec.mount_options, &[], "");
    let range = csi::CapacityRange {
        required_bytes: size,
        ..Default::default()
    };
    let req = csi::ControllerExpandVolumeRequest {
        volume_id: spec.external_id.clone(),
        capacity_range: protobuf::MessageField::some(range.clone()),
        secrets: spec.secrets.clone().into_iter().collect(),
        volume_capability: protobuf::MessageField::some(capability.clone()),
        ..Default::default()
    };
    let answer = c
        .controller_expand_volume(&req)
        .map_err(csi_error(&operation))?;
    let capacity = if answer.capacity_bytes > 0 {
        answer.capacity_bytes
    } else {
        size
    };
    // Asked for while the volume is mounted nowhere here: the next mount
    // expands it on its node (after NodePublish).
    let pending = answer.node_expansion_required && published.is_empty();
    record_capacity(core, &spec, capacity, pending)?;
    log::info!("expanded volume {id} to {capacity} bytes through its controller");

    let mut out = Expansion {
        capacity_bytes: capacity,
        ..Expansion::default()
    };
    if !answer.node_expansion_required {
        return Ok(out);
    }
    let Some((_, rec)) = published.first() else {
        out.node_expansion_pending = true;
        return Ok(out);
    };
    let node = core
        .registry
        .wait_for_plugin(&spec.plugin_id, PluginKind::Node, core.opts.plugin_wait)
        .map_err(VolumeOpError::Plugin)?;
    if !node
        .node_capabilities
        .as_ref()
        .is_some_and(|n| n.expand_volume)
    {
        return Ok(out);
    }
    let req = node_expand_request(&spec, rec, capacity);
    let node_operation = format!(
        "expand the file system of volume {id} at {} (its controller expansion to {capacity} bytes is done)",
        rec.target_path.display()
    );
    node.client
        .node_expand_volume(&req)
        .map_err(csi_error(&node_operation))?;
    log::info!(
        "expanded volume {id} on this node at {}",
        rec.target_path.display()
    );
    out.node_expanded.push(rec.target_path.clone());
    Ok(out)
}

/// NodeExpandVolume of a published record to `capacity` bytes.
fn node_expand_request(
    spec: &VolumeSpec,
    rec: &AllocVolume,
    capacity: i64,
) -> csi::NodeExpandVolumeRequest {
    let cap = volume_capability(
        &rec.usage,
        &spec.mount_options,
        &rec.mount_flags,
        &rec.mount_group,
    );
    csi::NodeExpandVolumeRequest {
        volume_id: spec.external_id.clone(),
        volume_path: path_string(&rec.target_path),
        capacity_range: protobuf::MessageField::some(csi::CapacityRange {
            required_bytes: capacity,
            ..Default::default()
        }),
        staging_target_path: rec
            .staging_path
            .as_deref()
            .map(path_string)
            .unwrap_or_default(),
        volume_capability: protobuf::MessageField::some(cap),
        secrets: spec.secrets.clone().into_iter().collect(),
        ..Default::default()
    }
}

/// After NodePublish: the node expansion a plugin asked for while the
/// volume was mounted nowhere on the expanding node (CSI: the CO calls
/// NodeExpandVolume once the volume is published). Done, the pending mark
/// is cleared; a failure is logged and left pending for the next mount
/// (the volume is usable at its old size meanwhile).
pub fn expand_pending_on_node(core: &Core, node: &PluginSnapshot, rec: &AllocVolume) {
    let Some(spec) = core.spec(&rec.volume_id) else {
        return;
    };
    if !spec.node_expansion_pending {
        return;
    }
    let id = &rec.volume_id;
    let expands = node
        .node_capabilities
        .as_ref()
        .is_some_and(|n| n.expand_volume);
    if expands {
        let req = node_expand_request(&spec, rec, spec.capacity_bytes);
        if let Err(e) = node.client.node_expand_volume(&req) {
            log::warn!(
                "volume {id}: the node expansion to {} bytes asked for at its last expansion failed at {} (tried again at its next mount): {}",
                spec.capacity_bytes,
                rec.target_path.display(),
                crate::error_chain(&e)
            );
            return;
        }
        log::info!(
            "volume {id}: expanded on this node at {} to {} bytes (asked for at its last expansion, while it was not mounted)",
            rec.target_path.display(),
            spec.capacity_bytes
        );
    } else {
        log::warn!(
            "volume {id}: its plugin asked for a node expansion but node plugin {} cannot expand (no EXPAND_VOLUME); left as it is",
            node.id
        );
    }
    if let Err(e) = record_capacity(core, &spec, spec.capacity_bytes, false) {
        log::warn!("volume {id}: the finished node expansion is not recorded: {e}");
    }
}

/// Records a volume's new capacity and whether a node expansion is
/// pending (and in cluster mode the cluster's registration too), whoever
/// holds it.
fn record_capacity(
    core: &Core,
    spec: &VolumeSpec,
    capacity: i64,
    pending: bool,
) -> Result<(), VolumeOpError> {
    let mut updated = spec.clone();
    updated.capacity_bytes = capacity;
    updated.node_expansion_pending = pending;
    if let Some(shared) = core.claims.shared_volumes() {
        shared
            .set_capacity(spec, capacity, pending)
            .map_err(|e| VolumeOpError::Registry(super::error::VolumeRegistryError::Claims(e)))?;
    }
    core.store.update(|s| -> Result<(), VolumeOpError> {
        match s.volumes.get(&spec.id) {
            Some(local) => {
                let mut local = (**local).clone();
                local.capacity_bytes = capacity;
                local.node_expansion_pending = pending;
                s.volumes.insert(spec.id.clone(), Arc::new(local));
            }
            // In cluster mode this node may hold no copy: the cluster's is
            // the one that counts.
            None if core.claims.shared_volumes().is_some() => {}
            None => {
                s.volumes.insert(spec.id.clone(), Arc::new(updated.clone()));
            }
        }
        Ok(())
    })
}
