//! The Node service: real bind mounts of `<root>/volumes/<id>`.
//!
//! Stage binds the volume directory onto the staging path (block volumes
//! stage nothing, as several real plugins do); publish binds the staging
//! path (or, without staging, the volume itself) onto a target the plugin
//! creates. Every operation is idempotent and decided by the mount table
//! (teardown: by umount2's answer, the kernel's mount tree itself).

use std::fs;
use std::io;
use std::path::Path;

use claimd::csi::*;
use grpcio::RpcStatusCode;
use protobuf::{EnumOrUnknown, MessageField};

use crate::fencing::PathKind;
use crate::mounts;
use crate::path_locks::lock_key;
use crate::plugin::*;
use crate::stagings::Staged;

/// How many stacked mounts an unmount loop removes before giving up.
const MAX_STACKED_MOUNTS: usize = 8;

fn mount_at(path: &Path) -> Outcome<Option<mounts::Mount>> {
    mounts::mount_at(path)
        .map_err(|e| Failure::internal(format!("cannot read /proc/self/mountinfo: {e}")))
}

fn io_failure(what: &str, path: &Path, e: io::Error) -> Failure {
    Failure::internal(format!("cannot {what} {}: {e}", path.display()))
}

fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is a
    // NUL-terminated string that outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Unmounts everything stacked on `path`.
pub fn unmount_all(path: &Path) -> Outcome<()> {
    for _ in 0..MAX_STACKED_MOUNTS {
        if !mounts::unmount_if_mounted(path).map_err(|e| io_failure("unmount", path, e))? {
            return Ok(());
        }
    }
    // Only here does the mount table decide: whether the last unmount
    // left anything.
    if mount_at(path)?.is_none() {
        return Ok(());
    }
    Err(Failure::internal(format!(
        "{} still mounted after {MAX_STACKED_MOUNTS} unmounts",
        path.display()
    )))
}

impl Plugin {
    fn stage_supported(&self, method: &str) -> Outcome<()> {
        if self.config.stage {
            Ok(())
        } else {
            Err(Failure::unimplemented(
                method,
                "the plugin does not advertise STAGE_UNSTAGE_VOLUME",
            ))
        }
    }

    /// Whether `path` shows the volume: its directory or block image, or a
    /// bind mount of either (a mount point shows its source's inode).
    fn shows_volume(&self, path: &Path, id: &str) -> Outcome<bool> {
        let dir = self.volumes_dir().join(id);
        let img = self.volumes_dir().join(format!("{id}.img"));
        for source in [dir, img] {
            match mounts::same_file(path, &source) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_failure("stat", path, e)),
            }
        }
        Ok(false)
    }

    /// Whether `path` is a mount point of the volume.
    pub fn mounted_here(&self, path: &Path, id: &str) -> Outcome<bool> {
        Ok(Self::is_mount_point(path)? && self.shows_volume(path, id)?)
    }

    /// Whether `path` is a mount point (asked of the path itself, not of
    /// the whole mount table).
    fn is_mount_point(path: &Path) -> Outcome<bool> {
        claimd::mounts::is_mount_point(path).map_err(|e| io_failure("inspect", path, e))
    }

    /// Whether the volume is still staged where its record says: a
    /// file-system volume while that path is a mount of it (a reboot or an
    /// administrator's umount ends it), a block volume (which stages
    /// nothing) while the CO's staging directory is there.
    fn still_staged(&self, id: &str, staged: &Staged) -> Outcome<bool> {
        let path = &staged.staging_target_path;
        if staged.block {
            return Ok(path.is_dir());
        }
        Ok(Self::is_mount_point(path)? && self.shows_volume(path, id)?)
    }

    /// "The CO SHALL ensure that there is only one staging_target_path per
    /// volume": a stage at another path while the volume is staged
    /// somewhere is refused naming that path, like a real plugin whose
    /// device is mounted once. Called with the volume's lock held.
    fn check_one_staging_path(&self, id: &str, staging: &Path, block: bool) -> Outcome<()> {
        let Some(staged) = self.stagings.get(id).map_err(Failure::internal)? else {
            return Ok(());
        };
        if !self.still_staged(id, &staged)? {
            return Ok(());
        }
        let existing = &staged.staging_target_path;
        if lock_key(existing) != lock_key(staging) {
            return Err(Failure::precondition(format!(
                "volume {id} is already staged at {}; it cannot also be staged at {} \
                 (one staging_target_path per volume)",
                existing.display(),
                staging.display()
            )));
        }
        if staged.block != block {
            return Err(Failure::new(
                RpcStatusCode::ALREADY_EXISTS,
                format!(
                    "volume {id} is staged at {} as a {} volume",
                    existing.display(),
                    if staged.block { "block" } else { "file-system" }
                ),
            ));
        }
        Ok(())
    }

    fn record_staging(&self, id: &str, staging: &Path, block: bool) -> Outcome<()> {
        self.stagings
            .set(
                id,
                Staged {
                    staging_target_path: staging.to_path_buf(),
                    block,
                },
            )
            .map_err(Failure::internal)
    }

    pub fn node_stage_volume(
        &self,
        req: NodeStageVolumeRequest,
        _call: &Call,
    ) -> Outcome<NodeStageVolumeResponse> {
        self.stage_supported("NodeStageVolume")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let staging = valid_path("staging_target_path", &req.staging_target_path)?;
        let block = check_capability(&req.volume_capability)?;
        self.check_volume(id)?;
        self.check_not_fenced(id)?;
        self.check_attached(id)?;
        let mut publish_context = req.publish_context.clone();
        self.check_epoch(id, "publish_context", &mut publish_context)?;
        self.check_contexts(id, &publish_context, &req.volume_context)?;
        self.apply_mount_group(id, &req.volume_capability)?;
        if !staging.is_dir() {
            return Err(Failure::precondition(format!(
                "staging path {} is not a directory: the CO creates it",
                staging.display()
            )));
        }
        let _volume = self.volume_locks.lock(id);
        let _paths = self.path_locks.lock(&[staging]);
        self.check_one_staging_path(id, staging, block)?;
        if block {
            // Nothing to stage: the image file is bound at publish.
            self.record_staging(id, staging, true)?;
            return Ok(NodeStageVolumeResponse::new());
        }
        let source = self.volume_dir(id)?;
        if mount_at(staging)?.is_some() {
            if !mounts::same_file(staging, &source).map_err(|e| io_failure("stat", staging, e))? {
                return Err(Failure::new(
                    RpcStatusCode::ALREADY_EXISTS,
                    format!("another volume is staged at {}", staging.display()),
                ));
            }
            self.record_staging(id, staging, false)?;
            self.record_node_path(id, PathKind::Staging, staging, true)?;
            self.recheck_fence(id, staging)?;
            return Ok(NodeStageVolumeResponse::new());
        }
        // Recorded first: a record without its mount is stale and ignored,
        // a mount without its record would escape the one-path rule (and a
        // fence, which unmounts the paths recorded for its node).
        self.record_staging(id, staging, false)?;
        self.record_node_path(id, PathKind::Staging, staging, true)?;
        mounts::bind(&source, staging).map_err(|e| io_failure("bind-mount onto", staging, e))?;
        self.recheck_fence(id, staging)?;
        log::info!("staged {id} at {}", staging.display());
        Ok(NodeStageVolumeResponse::new())
    }

    pub fn node_unstage_volume(
        &self,
        req: NodeUnstageVolumeRequest,
        _call: &Call,
    ) -> Outcome<NodeUnstageVolumeResponse> {
        self.stage_supported("NodeUnstageVolume")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let staging = valid_path("staging_target_path", &req.staging_target_path)?;
        self.check_volume(id)?;
        let _volume = self.volume_locks.lock(id);
        let _paths = self.path_locks.lock(&[staging]);
        if Self::is_mount_point(staging)? && !self.shows_volume(staging, id)? {
            return Err(Failure::precondition(format!(
                "another volume than {id} is staged at {}",
                staging.display()
            )));
        }
        unmount_all(staging)?;
        self.record_node_path(id, PathKind::Staging, staging, false)?;
        let key = lock_key(staging);
        self.stagings
            .remove_if(id, |staged| lock_key(&staged.staging_target_path) == key)
            .map_err(Failure::internal)?;
        // The staging directory belongs to the CO: it stays.
        log::info!("unstaged {id} from {}", staging.display());
        Ok(NodeUnstageVolumeResponse::new())
    }

    pub fn node_publish_volume(
        &self,
        req: NodePublishVolumeRequest,
        _call: &Call,
    ) -> Outcome<NodePublishVolumeResponse> {
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let target = valid_path("target_path", &req.target_path)?;
        let block = check_capability(&req.volume_capability)?;
        // With STAGE_UNSTAGE_VOLUME the staging path is required (the
        // spec's FAILED_PRECONDITION "Staging target path not set").
        let staging = if self.config.stage {
            if req.staging_target_path.is_empty() {
                return Err(Failure::precondition(format!(
                    "staging_target_path is required: the plugin has STAGE_UNSTAGE_VOLUME \
                     (NodeStageVolume volume {id} first)"
                )));
            }
            Some(valid_path("staging_target_path", &req.staging_target_path)?)
        } else {
            None
        };
        self.check_volume(id)?;
        self.check_not_fenced(id)?;
        let mut publish_context = req.publish_context.clone();
        self.check_epoch(id, "publish_context", &mut publish_context)?;
        self.check_contexts(id, &publish_context, &req.volume_context)?;
        self.apply_mount_group(id, &req.volume_capability)?;
        if !self.config.stage {
            self.check_attached(id)?;
        }
        if self.config.create_target_parent {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    Failure::precondition(format!("cannot create {}: {e}", parent.display()))
                })?;
            }
        }
        let parent_ok = target.parent().is_some_and(Path::is_dir);
        if !parent_ok {
            return Err(Failure::precondition(format!(
                "the parent directory of target path {} does not exist: the CO creates it",
                target.display()
            )));
        }

        // The staging path too: an unstage must not remove it between the
        // check below and the bind.
        let _paths = match staging {
            Some(staging) => self.path_locks.lock(&[staging, target]),
            None => self.path_locks.lock(&[target]),
        };
        let not_staged = |staging: &Path| {
            Failure::precondition(format!(
                "volume {id} is not staged at {}: NodeStageVolume first",
                staging.display()
            ))
        };
        let source = match staging {
            Some(staging) if block => {
                let staged = self.stagings.get(id).map_err(Failure::internal)?;
                let here = staged.is_some_and(|s| {
                    s.block && lock_key(&s.staging_target_path) == lock_key(staging)
                });
                if !here {
                    return Err(not_staged(staging));
                }
                self.volume_image(id)?
            }
            Some(staging) => {
                if !(Self::is_mount_point(staging)? && self.shows_volume(staging, id)?) {
                    return Err(not_staged(staging));
                }
                staging.to_path_buf()
            }
            None if block => self.volume_image(id)?,
            None => self.volume_dir(id)?,
        };

        if let Some(existing) = mount_at(target)? {
            let same =
                mounts::same_file(target, &source).map_err(|e| io_failure("stat", target, e))?;
            return if same && existing.read_only() == req.readonly {
                self.record_node_path(id, PathKind::Target, target, true)?;
                self.recheck_fence(id, target)?;
                Ok(NodePublishVolumeResponse::new())
            } else {
                Err(Failure::new(
                    RpcStatusCode::ALREADY_EXISTS,
                    format!(
                        "{} is already published with another volume or another readonly flag",
                        target.display()
                    ),
                ))
            };
        }

        let created = if block {
            fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(target)
                .map(drop)
        } else {
            match fs::create_dir(target) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && target.is_dir() => Ok(()),
                other => other,
            }
        };
        created.map_err(|e| io_failure("create target", target, e))?;
        // Before the mount: a fence finds every path that may be mounted.
        self.record_node_path(id, PathKind::Target, target, true)?;

        mounts::bind(&source, target).map_err(|e| io_failure("bind-mount onto", target, e))?;
        if req.readonly {
            if let Err(e) = mounts::remount_read_only(target) {
                let undo = mounts::unmount(target);
                return Err(Failure::internal(format!(
                    "cannot make {} read-only: {e} (unmount: {undo:?})",
                    target.display()
                )));
            }
        }
        self.recheck_fence(id, target)?;
        log::info!(
            "published {id} at {}{}",
            target.display(),
            if req.readonly { " read-only" } else { "" }
        );
        Ok(NodePublishVolumeResponse::new())
    }

    pub fn node_unpublish_volume(
        &self,
        req: NodeUnpublishVolumeRequest,
        _call: &Call,
    ) -> Outcome<NodeUnpublishVolumeResponse> {
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let target = valid_path("target_path", &req.target_path)?;
        self.check_volume(id)?;
        let _paths = self.path_locks.lock(&[target]);
        if Self::is_mount_point(target)? && !self.shows_volume(target, id)? {
            return Err(Failure::precondition(format!(
                "another volume than {id} is published at {}",
                target.display()
            )));
        }
        unmount_all(target)?;
        self.record_node_path(id, PathKind::Target, target, false)?;
        // The plugin created the target; it removes it. A directory that is
        // not empty once unmounted is not ours to delete.
        match fs::symlink_metadata(target) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_failure("stat", target, e)),
            Ok(m) if m.is_dir() => {
                fs::remove_dir(target).map_err(|e| io_failure("remove target", target, e))?
            }
            Ok(_) => fs::remove_file(target).map_err(|e| io_failure("remove target", target, e))?,
        }
        log::info!("unpublished {id} from {}", target.display());
        Ok(NodeUnpublishVolumeResponse::new())
    }

    pub fn node_get_capabilities(
        &self,
        _req: NodeGetCapabilitiesRequest,
        _call: &Call,
    ) -> Outcome<NodeGetCapabilitiesResponse> {
        use node_service_capability::rpc::Type;
        let cap = |t: EnumOrUnknown<Type>| {
            let mut rpc = node_service_capability::RPC::new();
            rpc.type_ = t;
            let mut c = NodeServiceCapability::new();
            c.type_ = Some(node_service_capability::Type::Rpc(rpc));
            c
        };
        let mut r = NodeGetCapabilitiesResponse::new();
        if self.config.stage {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::STAGE_UNSTAGE_VOLUME)));
        }
        if self.config.volume_stats {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::GET_VOLUME_STATS)));
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::VOLUME_CONDITION)));
        }
        if self.config.expansion {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::EXPAND_VOLUME)));
        }
        if self.config.mount_group {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::VOLUME_MOUNT_GROUP)));
        }
        if let Some(unknown) = self.unknown_capability() {
            r.capabilities.push(cap(EnumOrUnknown::from_i32(unknown)));
        }
        Ok(r)
    }

    /// statvfs of the volume path (or, for a volume with a recorded
    /// capacity, that capacity and the bytes of its files); `<root>/abnormal/<volume_id>` makes the
    /// volume abnormal with its content as the message.
    pub fn node_get_volume_stats(
        &self,
        req: NodeGetVolumeStatsRequest,
        _call: &Call,
    ) -> Outcome<NodeGetVolumeStatsResponse> {
        if !self.config.volume_stats {
            return Err(Failure::unimplemented(
                "NodeGetVolumeStats",
                "the plugin does not advertise GET_VOLUME_STATS",
            ));
        }
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let path = volume_path("volume_path", &req.volume_path)?;
        self.check_volume(id)?;
        // The spec's NOT_FOUND: "volume_id does not exist on specified
        // volume_path" (another volume mounted there is not this one).
        if !self.mounted_here(path, id)? {
            return Err(Failure::not_found(format!(
                "volume {id} is not mounted at {}",
                path.display()
            )));
        }
        let st = statvfs(path).map_err(|e| io_failure("statvfs", path, e))?;
        let usage = |unit, total: u64, free: u64| {
            let mut u = VolumeUsage::new();
            u.unit = EnumOrUnknown::new(unit);
            u.total = total as i64;
            u.available = free as i64;
            u.used = total.saturating_sub(free) as i64;
            u
        };
        let frsize = st.f_frsize as u64;
        let mut r = NodeGetVolumeStatsResponse::new();
        let (total, free) = match self.node_capacity(id)? {
            Some((capacity, used)) => (capacity as u64, (capacity - used) as u64),
            None => (st.f_blocks as u64 * frsize, st.f_bavail as u64 * frsize),
        };
        r.usage.push(usage(volume_usage::Unit::BYTES, total, free));
        r.usage.push(usage(
            volume_usage::Unit::INODES,
            st.f_files as u64,
            st.f_ffree as u64,
        ));
        let flag = self.config.storage.join("abnormal").join(id);
        let mut c = VolumeCondition::new();
        match fs::read_to_string(&flag) {
            Ok(msg) => {
                c.abnormal = true;
                c.message = msg.trim().to_string();
            }
            Err(_) => c.message = "volume is healthy".to_string(),
        }
        r.volume_condition = MessageField::some(c);
        Ok(r)
    }

    pub fn node_get_info(
        &self,
        _req: NodeGetInfoRequest,
        _call: &Call,
    ) -> Outcome<NodeGetInfoResponse> {
        let mut r = NodeGetInfoResponse::new();
        r.node_id = self.config.node_id.clone();
        r.max_volumes_per_node = self.config.max_volumes_per_node;
        // "A plugin that returns this field MUST also set the
        // VOLUME_ACCESSIBILITY_CONSTRAINTS plugin capability": only with
        // --topology, the flag that advertises it (and makes CreateVolume
        // accept accessibility_requirements).
        if let Some(segments) = self.node_topology() {
            let mut topology = Topology::new();
            topology.segments = segments.into_iter().collect();
            r.accessible_topology = MessageField::some(topology);
        }
        Ok(r)
    }
}
