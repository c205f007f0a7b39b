//! What `alloc status` shows: the durable record of each volume, with the
//! live step of a running mount (what it waits on) and the latest release
//! report, both kept in memory.

use std::path::PathBuf;

use super::core::Core;
use super::progress::ReleaseState;
use crate::state::Phase;
use crate::volumes::AttachmentMode;

/// One volume in a status answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeStatus {
    pub alias: String,
    pub volume_id: String,
    pub plugin_id: String,
    pub phase: Option<Phase>,
    pub host_path: PathBuf,
    pub read_only: bool,
    pub attachment: AttachmentMode,
    pub release: Option<ReleaseState>,
    /// The call a running mount or release is at (`staging`,
    /// `unpublishing`, …): finer than the durable phase.
    pub step: Option<String>,
    /// What a running mount or restore is waiting on, if anything.
    pub message: String,
    /// Cluster mode: the claim's epoch (etcd create revision).
    pub epoch: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocStatus {
    pub id: String,
    pub releasing: bool,
    pub volumes: Vec<VolumeStatus>,
}

/// A volume whose release finished has no record any more: only its
/// in-memory release report is left, with the volume it released.
fn released(core: &Core, alloc_id: &str, alias: String, st: ReleaseState) -> VolumeStatus {
    let v = core
        .progress
        .released_volume(alloc_id, &alias)
        .unwrap_or_default();
    VolumeStatus {
        alias,
        volume_id: v.volume_id,
        plugin_id: v.plugin_id,
        phase: None,
        host_path: v.target_path,
        read_only: v.read_only,
        attachment: v.attachment,
        release: Some(st),
        step: None,
        message: String::new(),
        epoch: None,
    }
}

pub fn alloc_status(core: &Core, alloc_id: &str) -> Option<AllocStatus> {
    let rec = core.store.read(|s| s.allocs.get(alloc_id).cloned());
    let mut releases = core.progress.releases(alloc_id);
    match rec {
        Some(a) => {
            let mut volumes: Vec<VolumeStatus> = a
                .volumes
                .values()
                .map(|v| VolumeStatus {
                    alias: v.alias.clone(),
                    volume_id: v.volume_id.clone(),
                    plugin_id: v.plugin_id.clone(),
                    phase: Some(v.phase),
                    host_path: v.target_path.clone(),
                    read_only: v.usage.read_only,
                    attachment: v.usage.attachment,
                    release: releases.remove(&v.alias),
                    step: core.progress.step(alloc_id, &v.alias),
                    message: core.progress.message(alloc_id, &v.alias),
                    epoch: v
                        .epoch
                        .or_else(|| core.claims.epoch(&v.volume_id, alloc_id)),
                })
                .collect();
            volumes.extend(
                releases
                    .into_iter()
                    .map(|(al, st)| released(core, alloc_id, al, st)),
            );
            volumes.sort_by(|x, y| x.alias.cmp(&y.alias));
            Some(AllocStatus {
                id: a.id.clone(),
                releasing: a.releasing,
                volumes,
            })
        }
        None if !releases.is_empty() => Some(AllocStatus {
            id: alloc_id.to_string(),
            releasing: true,
            volumes: releases
                .into_iter()
                .map(|(al, st)| released(core, alloc_id, al, st))
                .collect(),
        }),
        None => None,
    }
}

pub fn list_allocs(core: &Core) -> Vec<AllocStatus> {
    let ids: Vec<String> = core.store.read(|s| s.allocs.keys().cloned().collect());
    ids.iter().filter_map(|id| alloc_status(core, id)).collect()
}
