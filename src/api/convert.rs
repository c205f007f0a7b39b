//! Conversions between the local API's wire messages and claimd's types.

use crate::lifecycle::{AllocStatus, MountedVolume, ReleaseState, SnapshotView};
use crate::observe::{Observer, StatsEntry};
use crate::plugins::PluginSnapshot;
use crate::volumes::create::{AccessibilityRequirements, CapacityRange};
use crate::volumes::{
    AccessMode, AttachmentMode, ContentSource, MountOptions, Topology, VolumeCreate, VolumeSpec,
};

use super::wire as w;

/// A wire volume into a spec (validated by the caller).
pub fn volume_from_wire(v: &w::Volume) -> Result<VolumeSpec, String> {
    let access_modes = v
        .access_modes
        .iter()
        .map(|m| AccessMode::parse(m).ok_or_else(|| format!("unknown access mode {m:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    let attachment_modes = v
        .attachment_modes
        .iter()
        .map(|m| AttachmentMode::parse(m).ok_or_else(|| format!("unknown attachment mode {m:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(VolumeSpec {
        id: v.id.clone(),
        plugin_id: v.plugin_id.clone(),
        external_id: v.external_id.clone(),
        access_modes,
        attachment_modes,
        mount_options: MountOptions {
            fs_type: v.fs_type.clone(),
            mount_flags: v.mount_flags.clone(),
        },
        context: v
            .context
            .iter()
            .map(|(k, x)| (k.clone(), x.clone()))
            .collect(),
        secrets: v
            .secrets
            .iter()
            .map(|(k, x)| (k.clone(), x.clone()))
            .collect(),
        accessible_topology: v
            .accessible_topology
            .iter()
            .map(topology_from_wire)
            .collect(),
        capacity_bytes: v.capacity_bytes,
        node_expansion_pending: false,
    })
}

pub fn topology_from_wire(t: &w::Topology) -> Topology {
    t.segments
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

pub fn topology_to_wire(t: &Topology) -> w::Topology {
    let mut x = w::Topology::new();
    x.segments = t.clone().into_iter().collect();
    x
}

/// A `volume create` definition onto the wire (with its secrets).
pub fn create_to_wire(c: &VolumeCreate) -> w::CreateVolumeRequest {
    let mut v = volume_to_wire(&c.spec());
    v.secret_keys.clear();
    v.secrets = c.secrets.clone().into_iter().collect();
    let mut r = w::CreateVolumeRequest::new();
    r.volume = protobuf::MessageField::some(v);
    r.name = c.name.clone();
    r.required_bytes = c.capacity_range.required_bytes;
    r.limit_bytes = c.capacity_range.limit_bytes;
    r.parameters = c.parameters.clone().into_iter().collect();
    r.requisite = c
        .accessibility_requirements
        .requisite
        .iter()
        .map(topology_to_wire)
        .collect();
    r.preferred = c
        .accessibility_requirements
        .preferred
        .iter()
        .map(topology_to_wire)
        .collect();
    match &c.source {
        Some(ContentSource::SnapshotId(s)) => r.source_snapshot_id = s.clone(),
        Some(ContentSource::VolumeId(v)) => r.source_volume_id = v.clone(),
        None => {}
    }
    r
}

/// A wire create request into a definition (validated by the caller).
pub fn create_from_wire(r: &w::CreateVolumeRequest) -> Result<VolumeCreate, String> {
    let v = r.volume.as_ref().ok_or("the request has no volume")?;
    let spec = volume_from_wire(v)?;
    let source = match (r.source_snapshot_id.as_str(), r.source_volume_id.as_str()) {
        ("", "") => None,
        (s, "") => Some(ContentSource::SnapshotId(s.to_string())),
        ("", v) => Some(ContentSource::VolumeId(v.to_string())),
        _ => return Err("a volume has one source: a snapshot or a volume, not both".into()),
    };
    Ok(VolumeCreate {
        id: spec.id,
        plugin_id: spec.plugin_id,
        name: r.name.clone(),
        access_modes: spec.access_modes,
        attachment_modes: spec.attachment_modes,
        mount_options: spec.mount_options,
        secrets: spec.secrets,
        capacity_range: CapacityRange {
            required_bytes: r.required_bytes,
            limit_bytes: r.limit_bytes,
        },
        parameters: r
            .parameters
            .iter()
            .map(|(k, x)| (k.clone(), x.clone()))
            .collect(),
        accessibility_requirements: AccessibilityRequirements {
            requisite: r.requisite.iter().map(topology_from_wire).collect(),
            preferred: r.preferred.iter().map(topology_from_wire).collect(),
        },
        source,
    })
}

pub fn snapshot_to_wire(s: &SnapshotView) -> w::Snapshot {
    let mut x = w::Snapshot::new();
    x.snapshot_id = s.info.snapshot_id.clone();
    x.plugin_id = s.plugin_id.clone();
    x.volume_id = s.volume_id.clone().unwrap_or_default();
    x.external_volume_id = s.info.source_volume_id.clone();
    x.size_bytes = s.info.size_bytes;
    x.created_unix_ms = s
        .info
        .creation_time
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    x.ready_to_use = s.info.ready_to_use;
    x
}

/// A spec onto the wire, without secret values.
pub fn volume_to_wire(s: &VolumeSpec) -> w::Volume {
    let mut v = w::Volume::new();
    v.id = s.id.clone();
    v.plugin_id = s.plugin_id.clone();
    v.external_id = s.external_id.clone();
    v.access_modes = s
        .access_modes
        .iter()
        .map(|m| m.name().to_string())
        .collect();
    v.attachment_modes = s
        .attachment_modes
        .iter()
        .map(|m| m.name().to_string())
        .collect();
    v.fs_type = s.mount_options.fs_type.clone();
    v.mount_flags = s.mount_options.mount_flags.clone();
    v.context = s.context.clone().into_iter().collect();
    v.secret_keys = s.secrets.keys().cloned().collect();
    v.accessible_topology = s.accessible_topology.iter().map(topology_to_wire).collect();
    v.capacity_bytes = s.capacity_bytes;
    v
}

pub fn request_from_wire(r: &w::VolumeRequest) -> Result<crate::volumes::VolumeRequest, String> {
    let access_mode = match r.access_mode.as_str() {
        "" => None,
        m => Some(AccessMode::parse(m).ok_or_else(|| format!("unknown access mode {m:?}"))?),
    };
    let attachment = match r.attachment_mode.as_str() {
        "" => None,
        m => {
            Some(AttachmentMode::parse(m).ok_or_else(|| format!("unknown attachment mode {m:?}"))?)
        }
    };
    Ok(crate::volumes::VolumeRequest {
        alias: r.alias.clone(),
        volume_id: r.volume_id.clone(),
        read_only: r.read_only,
        access_mode,
        attachment,
        mount_flags: r.mount_flags.clone(),
        mount_group: r.mount_group.clone(),
    })
}

pub fn mounted_to_wire(m: &MountedVolume) -> w::MountedVolume {
    let mut w = w::MountedVolume::new();
    w.alias = m.alias.clone();
    w.volume_id = m.volume_id.clone();
    w.host_path = m.host_path.to_string_lossy().into_owned();
    w.read_only = m.read_only;
    w.block = m.block;
    w
}

pub fn release_state_parts(st: &ReleaseState) -> (&'static str, String, u32) {
    match st {
        ReleaseState::InProgress => ("in-progress", String::new(), 0),
        ReleaseState::Retrying { error, attempts } => ("retrying", error.clone(), *attempts),
        ReleaseState::Released => ("released", String::new(), 0),
        ReleaseState::Stopped { error } => ("stopped", error.clone(), 0),
    }
}

pub fn alloc_to_wire(a: &AllocStatus) -> w::AllocStatus {
    let mut w = w::AllocStatus::new();
    w.id = a.id.clone();
    w.releasing = a.releasing;
    w.volumes = a
        .volumes
        .iter()
        .map(|v| {
            let mut x = w::AllocVolumeStatus::new();
            x.alias = v.alias.clone();
            x.volume_id = v.volume_id.clone();
            x.plugin_id = v.plugin_id.clone();
            // A volume whose record is gone was released (only its
            // release report is left).
            // The live step of a running operation when there is one
            // (`alloc status` shows where it is; `claimd state` the durable
            // phase).
            x.phase = match (&v.step, v.phase) {
                (Some(step), _) => step.clone(),
                (None, Some(p)) => p.name().to_string(),
                (None, None) => "released".to_string(),
            };
            x.host_path = v.host_path.to_string_lossy().into_owned();
            x.read_only = v.read_only;
            x.attachment_mode = if v.volume_id.is_empty() {
                String::new()
            } else {
                v.attachment.name().to_string()
            };
            if let Some(st) = &v.release {
                let (s, e, _) = release_state_parts(st);
                x.release_state = s.to_string();
                x.release_error = e;
            }
            x.message = v.message.clone();
            x.epoch = v.epoch.unwrap_or(0);
            x
        })
        .collect();
    w
}

/// The latest volume stats onto the wire.
pub fn stats_to_wire(e: &StatsEntry) -> w::VolumeStats {
    let mut x = w::VolumeStats::new();
    x.error = e.error.clone();
    if let Some((at, s)) = &e.stats {
        x.at_unix_ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        if let Some(b) = s.bytes {
            x.has_bytes = true;
            x.capacity_bytes = b.total;
            x.used_bytes = b.used;
            x.available_bytes = b.available;
        }
        if let Some(i) = s.inodes {
            x.has_inodes = true;
            x.inodes = i.total;
            x.inodes_used = i.used;
            x.inodes_free = i.available;
        }
        if let Some(c) = &s.condition {
            x.has_condition = true;
            x.abnormal = c.abnormal;
            x.condition_message = c.message.clone();
        }
    }
    x
}

/// An allocation's status with the latest volume stats of each volume.
pub fn alloc_with_stats(o: &Observer, a: &AllocStatus) -> w::AllocStatus {
    let mut x = alloc_to_wire(a);
    for v in &mut x.volumes {
        if let Some(e) = o.stats.get(&a.id, &v.alias) {
            v.stats = protobuf::MessageField::some(stats_to_wire(&e));
        }
    }
    x
}

pub fn plugin_to_wire(p: &PluginSnapshot) -> w::Plugin {
    let mut w = w::Plugin::new();
    w.id = p.id.clone();
    w.type_ = p.plugin_type.name().to_string();
    w.socket = p.socket.to_string_lossy().into_owned();
    w.health = p.health.name().to_string();
    w.reason = p.reason.clone();
    if let Some(i) = &p.info {
        w.name = i.name.clone();
        w.vendor_version = i.vendor_version.clone();
    }
    if let Some(n) = &p.node_info {
        w.node_id = n.node_id.clone();
        w.topology = n.topology.clone().into_iter().collect();
        w.max_volumes_per_node = n.max_volumes_per_node;
    }
    let mut caps = Vec::new();
    if let Some(c) = &p.plugin_capabilities {
        if c.controller_service {
            caps.push("CONTROLLER_SERVICE");
        }
        if c.accessibility_constraints {
            caps.push("VOLUME_ACCESSIBILITY_CONSTRAINTS");
        }
        if c.online_expansion {
            caps.push("ONLINE_EXPANSION");
        }
        if c.offline_expansion {
            caps.push("OFFLINE_EXPANSION");
        }
    }
    if let Some(c) = &p.node_capabilities {
        if c.stage_unstage_volume {
            caps.push("STAGE_UNSTAGE_VOLUME");
        }
        if c.get_volume_stats {
            caps.push("GET_VOLUME_STATS");
        }
        if c.expand_volume {
            caps.push("NODE_EXPAND_VOLUME");
        }
        if c.volume_mount_group {
            caps.push("VOLUME_MOUNT_GROUP");
        }
    }
    if let Some(c) = &p.controller_capabilities {
        if c.create_delete_volume {
            caps.push("CREATE_DELETE_VOLUME");
        }
        if c.publish_unpublish_volume {
            caps.push("PUBLISH_UNPUBLISH_VOLUME");
        }
        if c.publish_readonly {
            caps.push("PUBLISH_READONLY");
        }
        if c.create_delete_snapshot {
            caps.push("CREATE_DELETE_SNAPSHOT");
        }
        if c.list_snapshots {
            caps.push("LIST_SNAPSHOTS");
        }
        if c.clone_volume {
            caps.push("CLONE_VOLUME");
        }
        if c.expand_volume {
            caps.push("EXPAND_VOLUME");
        }
    }
    w.capabilities = caps.into_iter().map(String::from).collect();
    w.source = p.source.to_string();
    w.generation = p.generation;
    w
}

// ---- the server -----------------------------------------------------------

pub fn claim_to_wire(c: &crate::state::Claim) -> w::ClaimInfo {
    w::ClaimInfo {
        volume_id: c.volume_id.clone(),
        alloc_id: c.alloc_id.clone(),
        node: c.node.clone(),
        mode: c.mode.name().to_string(),
        access_mode: c.access_mode.name().to_string(),
        state: match c.state {
            crate::state::ClaimState::Taken => "taken",
            crate::state::ClaimState::Releasing => "releasing",
            crate::state::ClaimState::NodeDetached => "node-detached",
        }
        .to_string(),
        external_node_id: c.external_node_id.clone().unwrap_or_default(),
        since_ms: c.since_ms.unwrap_or_default(),
        last_error: c.last_error.clone().unwrap_or_default(),
        ..Default::default()
    }
}
