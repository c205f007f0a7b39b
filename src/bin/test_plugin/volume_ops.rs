//! Volume operations beyond create and delete: topology placement and
//! content sources for CreateVolume, snapshots (copies of the volume
//! directory in `<root>/snapshots/<id>`), expansion (a recorded capacity
//! that NodeGetVolumeStats reports once the node grew it) and mount groups.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use claimd::csi::*;
use grpcio::RpcStatusCode;
use protobuf::MessageField;

use crate::call_log::now_ms;
use crate::controller::{Capacity, SnapshotRecord};
use crate::plugin::*;

/// What a new volume starts with.
pub struct Source {
    /// `snapshot:<id>` or `volume:<id>`.
    pub name: String,
    pub dir: PathBuf,
    pub size_bytes: i64,
}

fn io_failure(what: &str, path: &Path, e: io::Error) -> Failure {
    Failure::internal(format!("cannot {what} {}: {e}", path.display()))
}

/// Copies the content of directory `from` into `to` (made if missing):
/// regular files, directories and symlinks.
pub fn copy_dir(from: &Path, to: &Path) -> Outcome<()> {
    fs::create_dir_all(to).map_err(|e| io_failure("create", to, e))?;
    for entry in fs::read_dir(from).map_err(|e| io_failure("read", from, e))? {
        let entry = entry.map_err(|e| io_failure("read", from, e))?;
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let ty = entry.file_type().map_err(|e| io_failure("stat", &src, e))?;
        if ty.is_dir() {
            copy_dir(&src, &dst)?;
        } else if ty.is_symlink() {
            let link = fs::read_link(&src).map_err(|e| io_failure("read link", &src, e))?;
            std::os::unix::fs::symlink(link, &dst).map_err(|e| io_failure("link", &dst, e))?;
        } else {
            fs::copy(&src, &dst).map_err(|e| io_failure("copy", &src, e))?;
        }
    }
    Ok(())
}

/// Bytes of the regular files under `dir`.
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

fn segments(t: &Topology) -> BTreeMap<String, String> {
    t.segments
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

impl Plugin {
    /// This node's topology segments, as NodeGetInfo reports them: only
    /// with `--topology`, which also advertises
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS (the spec ties the two together).
    pub fn node_topology(&self) -> Option<BTreeMap<String, String>> {
        self.config.topology.clone()
    }

    /// Where CreateVolume puts a volume: its requisite segment sets, else
    /// the first preferred one, else (with --topology) this node's.
    pub fn placement(
        &self,
        reqs: Option<&TopologyRequirement>,
    ) -> Outcome<Vec<BTreeMap<String, String>>> {
        let Some(topology) = &self.config.topology else {
            return match reqs {
                Some(r) if !r.requisite.is_empty() || !r.preferred.is_empty() => {
                    Err(Failure::invalid(
                        "accessibility_requirements given, but the plugin does not advertise \
                         VOLUME_ACCESSIBILITY_CONSTRAINTS",
                    ))
                }
                _ => Ok(Vec::new()),
            };
        };
        Ok(match reqs {
            Some(r) if !r.requisite.is_empty() => r.requisite.iter().map(segments).collect(),
            Some(r) if !r.preferred.is_empty() => vec![segments(&r.preferred[0])],
            _ => vec![topology.clone()],
        })
    }

    /// The content source of a CreateVolume: an existing snapshot or
    /// volume (NOT_FOUND otherwise), with --snapshots.
    pub fn content_source(&self, source: Option<&VolumeContentSource>) -> Outcome<Option<Source>> {
        use volume_content_source::Type;
        let Some(source) = source else {
            return Ok(None);
        };
        if !self.config.snapshots {
            return Err(Failure::invalid(
                "volume_content_source given, but the plugin does not advertise \
                 CREATE_DELETE_SNAPSHOT or CLONE_VOLUME",
            ));
        }
        match &source.type_ {
            Some(Type::Snapshot(s)) => {
                let id = valid_volume_id("snapshot_id", &s.snapshot_id)?;
                let snap = self.read_state(|st| st.snapshots.get(id).cloned())?;
                let snap = snap
                    .ok_or_else(|| Failure::not_found(format!("snapshot {id} does not exist")))?;
                Ok(Some(Source {
                    name: format!("snapshot:{id}"),
                    dir: self.snapshots_dir().join(id),
                    size_bytes: snap.size_bytes,
                }))
            }
            Some(Type::Volume(v)) => {
                let id = valid_volume_id("volume_id", &v.volume_id)?;
                self.check_volume(id)?;
                let size = self.read_state(|st| st.capacities.get(id).map(|c| c.controller))?;
                Ok(Some(Source {
                    name: format!("volume:{id}"),
                    dir: self.volume_dir(id)?,
                    size_bytes: size.unwrap_or(0),
                }))
            }
            _ => Err(Failure::invalid("volume_content_source names no source")),
        }
    }

    fn snapshots_dir(&self) -> PathBuf {
        self.config.storage.join("snapshots")
    }

    fn snapshots_supported(&self, method: &str) -> Outcome<()> {
        self.controller_supported(method)?;
        if self.config.snapshots {
            Ok(())
        } else {
            Err(Failure::unimplemented(
                method,
                "the plugin does not advertise CREATE_DELETE_SNAPSHOT",
            ))
        }
    }

    pub fn create_snapshot(
        &self,
        req: CreateSnapshotRequest,
        _call: &Call,
    ) -> Outcome<CreateSnapshotResponse> {
        self.snapshots_supported("CreateSnapshot")?;
        let source = valid_volume_id("source_volume_id", &req.source_volume_id)?;
        let name = valid_volume_id("name", &req.name)?;
        let id = format!("snap-{name}");
        let record = self
            .controller_state
            .update(|st| -> Outcome<SnapshotRecord> {
                self.check_volume(source)?;
                if let Some(existing) = st.snapshots.get(&id) {
                    return if existing.source_volume_id == source {
                        Ok(existing.clone())
                    } else {
                        Err(Failure::new(
                            RpcStatusCode::ALREADY_EXISTS,
                            format!(
                                "snapshot {name} exists already, of volume {}, not {source}",
                                existing.source_volume_id
                            ),
                        ))
                    };
                }
                let from = self.volume_dir(source)?;
                let to = self.snapshots_dir().join(&id);
                let _ = fs::remove_dir_all(&to);
                copy_dir(&from, &to)?;
                let size = st
                    .capacities
                    .get(source)
                    .map(|c| c.controller)
                    .filter(|c| *c > 0)
                    .unwrap_or_else(|| i64::try_from(dir_size(&to)).unwrap_or(i64::MAX));
                let record = SnapshotRecord {
                    name: name.to_string(),
                    source_volume_id: source.to_string(),
                    size_bytes: size,
                    created_ms: now_ms(),
                };
                st.snapshots.insert(id.clone(), record.clone());
                Ok(record)
            })?;
        log::info!("snapshot {id} of volume {source}");
        let mut r = CreateSnapshotResponse::new();
        r.snapshot = MessageField::some(snapshot_message(&id, &record));
        Ok(r)
    }

    pub fn delete_snapshot(
        &self,
        req: DeleteSnapshotRequest,
        _call: &Call,
    ) -> Outcome<DeleteSnapshotResponse> {
        self.snapshots_supported("DeleteSnapshot")?;
        let id = valid_volume_id("snapshot_id", &req.snapshot_id)?;
        self.controller_state.update(|st| -> Outcome<()> {
            let dir = self.snapshots_dir().join(id);
            match fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(io_failure("remove", &dir, e))
                }
                _ => {}
            }
            st.snapshots.remove(id);
            Ok(())
        })?;
        log::info!("deleted snapshot {id}");
        Ok(DeleteSnapshotResponse::new())
    }

    /// Snapshots in ID order; `starting_token` is the index to start at.
    pub fn list_snapshots(
        &self,
        req: ListSnapshotsRequest,
        _call: &Call,
    ) -> Outcome<ListSnapshotsResponse> {
        self.controller_supported("ListSnapshots")?;
        if !self.config.snapshots {
            return Err(Failure::unimplemented(
                "ListSnapshots",
                "the plugin does not advertise LIST_SNAPSHOTS",
            ));
        }
        if req.max_entries < 0 {
            return Err(Failure::invalid("max_entries must not be negative"));
        }
        let start: usize = match req.starting_token.as_str() {
            "" => 0,
            t => t.parse().map_err(|_| {
                Failure::new(
                    RpcStatusCode::ABORTED,
                    format!("starting_token {t:?} is not valid"),
                )
            })?,
        };
        let all: Vec<(String, SnapshotRecord)> = self.read_state(|st| {
            st.snapshots
                .iter()
                .filter(|(id, s)| {
                    (req.snapshot_id.is_empty() || **id == req.snapshot_id)
                        && (req.source_volume_id.is_empty()
                            || s.source_volume_id == req.source_volume_id)
                })
                .map(|(id, s)| (id.clone(), s.clone()))
                .collect()
        })?;
        let max = match req.max_entries {
            0 => all.len(),
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        let mut r = ListSnapshotsResponse::new();
        for (id, s) in all.iter().skip(start).take(max) {
            let mut e = list_snapshots_response::Entry::new();
            e.snapshot = MessageField::some(snapshot_message(id, s));
            r.entries.push(e);
        }
        if start + max < all.len() {
            r.next_token = (start + max).to_string();
        }
        Ok(r)
    }

    pub fn controller_expand_volume(
        &self,
        req: ControllerExpandVolumeRequest,
        _call: &Call,
    ) -> Outcome<ControllerExpandVolumeResponse> {
        self.controller_supported("ControllerExpandVolume")?;
        if !self.config.expansion {
            return Err(Failure::unimplemented(
                "ControllerExpandVolume",
                "the plugin does not advertise EXPAND_VOLUME",
            ));
        }
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| Failure::invalid("capacity_range is required"))?;
        let (required, limit) = (range.required_bytes, range.limit_bytes);
        if required <= 0 || limit < 0 || (limit > 0 && limit < required) {
            return Err(Failure::new(
                RpcStatusCode::OUT_OF_RANGE,
                format!(
                    "capacity_range required_bytes={required} limit_bytes={limit} is not a range"
                ),
            ));
        }
        let capacity = self.controller_state.update(|st| -> Outcome<i64> {
            self.check_volume(id)?;
            let c = st.capacities.entry(id.to_string()).or_default();
            if limit > 0 && c.controller > limit {
                return Err(Failure::new(
                    RpcStatusCode::OUT_OF_RANGE,
                    format!(
                        "volume {id} has {} bytes already, more than limit_bytes={limit}",
                        c.controller
                    ),
                ));
            }
            // Idempotent: a volume this big already stays as it is.
            c.controller = c.controller.max(required);
            let capacity = c.controller;
            if let Some(v) = st.volumes.get_mut(id) {
                v.capacity_bytes = capacity;
            }
            Ok(capacity)
        })?;
        log::info!("expanded volume {id} to {capacity} bytes (controller)");
        let mut r = ControllerExpandVolumeResponse::new();
        r.capacity_bytes = capacity;
        r.node_expansion_required = true;
        Ok(r)
    }

    /// Grows the "file system" to the controller's capacity: the capacity
    /// NodeGetVolumeStats reports from now on. The volume must be mounted
    /// at `volume_path` (and staged at `staging_target_path` when given).
    pub fn node_expand_volume(
        &self,
        req: NodeExpandVolumeRequest,
        _call: &Call,
    ) -> Outcome<NodeExpandVolumeResponse> {
        if !self.config.expansion {
            return Err(Failure::unimplemented(
                "NodeExpandVolume",
                "the plugin does not advertise EXPAND_VOLUME",
            ));
        }
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let path = volume_path("volume_path", &req.volume_path)?;
        self.check_volume(id)?;
        let mut paths = vec![path];
        if !req.staging_target_path.is_empty() {
            paths.push(volume_path(
                "staging_target_path",
                &req.staging_target_path,
            )?);
        }
        for p in paths {
            if !self.mounted_here(p, id)? {
                return Err(Failure::not_found(format!(
                    "volume {id} is not mounted at {}",
                    p.display()
                )));
            }
        }
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        let capacity = self.controller_state.update(|st| -> Outcome<i64> {
            let c: &mut Capacity = st.capacities.entry(id.to_string()).or_default();
            if required > c.controller {
                return Err(Failure::new(
                    RpcStatusCode::OUT_OF_RANGE,
                    format!(
                        "volume {id} has {} bytes; ControllerExpandVolume to {required} first",
                        c.controller
                    ),
                ));
            }
            c.node = c.controller;
            Ok(c.node)
        })?;
        log::info!(
            "expanded volume {id} to {capacity} bytes at {}",
            path.display()
        );
        let mut r = NodeExpandVolumeResponse::new();
        r.capacity_bytes = capacity;
        Ok(r)
    }

    /// The capacity NodeGetVolumeStats reports for a volume, when it has
    /// one.
    pub fn node_capacity(&self, id: &str) -> Outcome<Option<(i64, i64)>> {
        let node = self.read_state(|st| st.capacities.get(id).map(|c| c.node))?;
        Ok(node.filter(|n| *n > 0).map(|n| {
            let used = i64::try_from(dir_size(&self.volumes_dir().join(id))).unwrap_or(i64::MAX);
            (n, used.min(n))
        }))
    }

    /// With --mount-group: the volume directory gets group GID, setgid and
    /// group rwx (what a file system mounted with gid=GID shows); without
    /// it a mount group is refused.
    pub fn apply_mount_group(&self, id: &str, cap: &MessageField<VolumeCapability>) -> Outcome<()> {
        let group = match cap.as_ref().and_then(|c| c.access_type.as_ref()) {
            Some(volume_capability::Access_type::Mount(m)) => m.volume_mount_group.as_str(),
            _ => "",
        };
        if group.is_empty() {
            return Ok(());
        }
        if !self.config.mount_group {
            return Err(Failure::invalid(format!(
                "volume_mount_group {group:?} given, but the plugin does not advertise VOLUME_MOUNT_GROUP"
            )));
        }
        let gid: u32 = group.parse().map_err(|_| {
            Failure::invalid(format!(
                "volume_mount_group {group:?} is not a numeric group ID"
            ))
        })?;
        let dir = self.volume_dir(id)?;
        std::os::unix::fs::chown(&dir, None, Some(gid))
            .map_err(|e| io_failure("chown", &dir, e))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o2775))
            .map_err(|e| io_failure("chmod", &dir, e))?;
        Ok(())
    }
}

fn snapshot_message(id: &str, s: &SnapshotRecord) -> Snapshot {
    let mut t = protobuf::well_known_types::timestamp::Timestamp::new();
    t.seconds = i64::try_from(s.created_ms / 1000).unwrap_or(i64::MAX);
    t.nanos = i32::try_from((s.created_ms % 1000) * 1_000_000).unwrap_or(0);
    let mut x = Snapshot::new();
    x.snapshot_id = id.to_string();
    x.source_volume_id = s.source_volume_id.clone();
    x.size_bytes = s.size_bytes;
    x.creation_time = MessageField::some(t);
    x.ready_to_use = true;
    x
}
