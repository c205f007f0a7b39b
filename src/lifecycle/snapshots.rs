//! Snapshots through the controller plugin: CreateSnapshot of a registered
//! volume, ListSnapshots (of one volume, or of every ready plugin that
//! lists snapshots) and DeleteSnapshot. claimd keeps no record of
//! snapshots: the plugin is the authority on which exist, and the source
//! volume's registration supplies the secrets.

use std::collections::BTreeMap;

use super::controller_ops::Controller;
use super::core::Core;
use super::error::VolumeOpError;
use super::volume_ops::{controller, registered};
use crate::csi::{self, SnapshotInfo};
use crate::plugins::PluginKind;
use crate::volumes::VolumeSpec;

/// A snapshot as `snapshot list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotView {
    pub plugin_id: String,
    /// The registered volume it was taken of, when one is registered with
    /// its source's external ID.
    pub volume_id: Option<String>,
    pub info: SnapshotInfo,
}

fn csi_error(operation: &str) -> impl FnOnce(csi::CsiError) -> VolumeOpError + '_ {
    move |source| VolumeOpError::Csi {
        operation: operation.to_string(),
        source,
    }
}

/// The registered volumes, for naming snapshot sources.
fn specs(core: &Core) -> Vec<VolumeSpec> {
    match core.claims.shared_volumes() {
        Some(shared) => shared.list().unwrap_or_default(),
        None => core
            .store
            .read(|s| s.volumes.values().map(|v| (**v).clone()).collect()),
    }
}

fn source_spec<'a>(
    specs: &'a [VolumeSpec],
    plugin_id: &str,
    external: &str,
) -> Option<&'a VolumeSpec> {
    specs
        .iter()
        .find(|s| s.plugin_id == plugin_id && s.external_id == external)
}

fn view(specs: &[VolumeSpec], plugin_id: &str, info: SnapshotInfo) -> SnapshotView {
    SnapshotView {
        plugin_id: plugin_id.to_string(),
        volume_id: source_spec(specs, plugin_id, &info.source_volume_id).map(|s| s.id.clone()),
        info,
    }
}

/// CreateSnapshot of a registered volume; the same name again answers the
/// same snapshot (the plugin's idempotency).
pub fn create(
    core: &Core,
    volume_id: &str,
    name: &str,
    parameters: &BTreeMap<String, String>,
) -> Result<SnapshotView, VolumeOpError> {
    crate::ids::check_id("volume", volume_id)
        .map_err(|e| VolumeOpError::Invalid(crate::volumes::SpecError::Id(e)))?;
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(VolumeOpError::Request(format!(
            "snapshot name {name:?} must be 1 to 128 bytes without control characters"
        )));
    }
    let spec = registered(core, volume_id)?.ok_or_else(|| VolumeOpError::UnknownVolume {
        volume_id: volume_id.to_string(),
    })?;
    let operation = format!("snapshot volume {volume_id}");
    let c = controller(
        core,
        &spec.plugin_id,
        "CREATE_DELETE_SNAPSHOT",
        |c| c.create_delete_snapshot,
        &operation,
    )?;
    let req = csi::CreateSnapshotRequest {
        source_volume_id: spec.external_id.clone(),
        name: name.to_string(),
        secrets: spec.secrets.clone().into_iter().collect(),
        parameters: parameters.clone().into_iter().collect(),
        ..Default::default()
    };
    let info = c.create_snapshot(&req).map_err(csi_error(&operation))?;
    log::info!(
        "snapshot {} ({name}) of volume {volume_id} created",
        info.snapshot_id
    );
    Ok(SnapshotView {
        plugin_id: spec.plugin_id,
        volume_id: Some(volume_id.to_string()),
        info,
    })
}

/// Every controller that lists snapshots, by plugin ID: this node's ready
/// ones, and in cluster mode the other plugins' hosts elsewhere.
fn listing_plugins(core: &Core) -> Result<Vec<Controller>, VolumeOpError> {
    let mut ids: Vec<String> = core.registry.list().into_iter().map(|p| p.id).collect();
    ids.sort();
    ids.dedup();
    let mut out: Vec<Controller> = ids
        .iter()
        .filter_map(|id| core.registry.get_ready(id, PluginKind::Controller))
        .map(|c| Controller::Local(Box::new(c)))
        .collect();
    if let Some(r) = core.claims.remote_controllers() {
        let hosts = r.hosts().map_err(|e| {
            VolumeOpError::Request(format!(
                "the cluster's controller hosts cannot be read: {e}"
            ))
        })?;
        let mut remote_ids: Vec<String> = hosts.into_iter().map(|(h, _)| h.plugin_id).collect();
        remote_ids.sort();
        remote_ids.dedup();
        for id in remote_ids {
            if out.iter().any(|c| c.id() == id) {
                continue;
            }
            if let Ok(Some(c)) = super::controller_ops::remote(core, &id) {
                out.push(c);
            }
        }
    }
    out.retain(|c| c.caps().list_snapshots);
    Ok(out)
}

/// The snapshots of one registered volume, or of every ready plugin that
/// lists snapshots.
pub fn list(core: &Core, volume_id: Option<&str>) -> Result<Vec<SnapshotView>, VolumeOpError> {
    let all = specs(core);
    let Some(volume_id) = volume_id else {
        let mut out = Vec::new();
        for c in listing_plugins(core)? {
            let operation = format!("list the snapshots of plugin {}", c.id());
            let found = c
                .list_snapshots(&csi::ListSnapshotsRequest::default())
                .map_err(csi_error(&operation))?;
            out.extend(found.into_iter().map(|i| view(&all, c.id(), i)));
        }
        return Ok(out);
    };
    let spec = registered(core, volume_id)?.ok_or_else(|| VolumeOpError::UnknownVolume {
        volume_id: volume_id.to_string(),
    })?;
    let operation = format!("list the snapshots of volume {volume_id}");
    let c = controller(
        core,
        &spec.plugin_id,
        "LIST_SNAPSHOTS",
        |c| c.list_snapshots,
        &operation,
    )?;
    let req = csi::ListSnapshotsRequest {
        source_volume_id: spec.external_id.clone(),
        secrets: spec.secrets.clone().into_iter().collect(),
        ..Default::default()
    };
    let found = c.list_snapshots(&req).map_err(csi_error(&operation))?;
    Ok(found
        .into_iter()
        .map(|i| view(&all, &spec.plugin_id, i))
        .collect())
}

/// DeleteSnapshot at the plugin that lists it (or at `plugin_id`, which
/// must list it too when it can list). Answers the plugin's ID. A snapshot
/// no plugin knows is an error, not a silent success.
pub fn delete(
    core: &Core,
    snapshot_id: &str,
    plugin_id: Option<&str>,
) -> Result<String, VolumeOpError> {
    if snapshot_id.is_empty() {
        return Err(VolumeOpError::Request("a snapshot ID is required".into()));
    }
    let operation = format!("delete snapshot {snapshot_id}");
    let unknown = || VolumeOpError::UnknownSnapshot {
        snapshot_id: snapshot_id.to_string(),
    };
    let lookup = |c: &Controller| -> Result<Option<SnapshotInfo>, VolumeOpError> {
        let req = csi::ListSnapshotsRequest {
            snapshot_id: snapshot_id.to_string(),
            ..Default::default()
        };
        let found = c.list_snapshots(&req).map_err(csi_error(&operation))?;
        Ok(found.into_iter().find(|s| s.snapshot_id == snapshot_id))
    };
    let (c, info) = match plugin_id {
        Some(p) => {
            let c = controller(
                core,
                p,
                "CREATE_DELETE_SNAPSHOT",
                |c| c.create_delete_snapshot,
                &operation,
            )?;
            let lists = c.caps().list_snapshots;
            let info = if lists {
                Some(lookup(&c)?.ok_or_else(unknown)?)
            } else {
                None
            };
            (c, info)
        }
        None => {
            let mut hit = None;
            for c in listing_plugins(core)? {
                if let Some(info) = lookup(&c)? {
                    hit = Some((c, Some(info)));
                    break;
                }
            }
            hit.ok_or_else(unknown)?
        }
    };
    let deletes = c.caps().create_delete_snapshot;
    if !deletes {
        return Err(VolumeOpError::Unsupported {
            plugin_id: c.id().to_string(),
            capability: "CREATE_DELETE_SNAPSHOT",
            operation,
        });
    }
    let all = specs(core);
    let secrets = info
        .as_ref()
        .and_then(|i| source_spec(&all, c.id(), &i.source_volume_id))
        .map(|s| s.secrets.clone())
        .unwrap_or_default();
    let req = csi::DeleteSnapshotRequest {
        snapshot_id: snapshot_id.to_string(),
        secrets: secrets.into_iter().collect(),
        ..Default::default()
    };
    match c.delete_snapshot(&req) {
        Err(e) if !e.is_ignorable() => return Err(csi_error(&operation)(e)),
        _ => {}
    }
    log::info!("snapshot {snapshot_id} of plugin {} deleted", c.id());
    Ok(c.id().to_string())
}
