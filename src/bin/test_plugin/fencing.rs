//! Fencing (`--fence-on-unpublish`): ControllerUnpublishVolume(volume,
//! node) really revokes that node's access, as storage that cuts a node's
//! session does, instead of only changing the controller's books.
//!
//! Several plugin processes (one per "node") share one storage system
//! (`--storage`); each keeps its node-local state in its own `--root`. The
//! fencing state lives in the shared storage, one directory per volume and
//! node (`<storage>/fencing/<volume_id>/<node>/`, the node ID escaped to
//! one path component):
//!
//! - `paths.json`: the staging and target paths this node's plugin has
//!   set up for the volume (`{"staging": [..], "targets": [..]}`). Written
//!   only by that node's plugin, replaced atomically, a path added before it
//!   is mounted and removed after it is unmounted, so no mount of the
//!   volume on that node escapes it.
//! - `fenced`: the fence marker (JSON: `volume_id`, `node_id`,
//!   `fenced_boottime_ns` (CLOCK_BOOTTIME), and once the paths are done
//!   `unmounted` and `detached`, the paths unmounted plainly and those only
//!   lazily). Written durably (file and directory fsync'd) before any
//!   unmount.
//!
//! ControllerUnpublishVolume(volume, node) writes the marker, then
//! unmounts every target, then every staging path recorded for that node
//! (an empty node ID: every node with a record), then answers OK. A plain
//! umount2 is tried first; a busy mount (EBUSY: open files, a working
//! directory inside) is detached with MNT_DETACH and listed as `detached`:
//! the path no longer leads to the volume, but what a process already holds
//! open there keeps working until it closes it (real storage would fail
//! that I/O; this plugin cannot).
//!
//! While the marker is there, NodeStageVolume and NodePublishVolume of
//! the volume on that node answer FAILED_PRECONDITION; teardown calls work
//! as always. ControllerPublishVolume of the volume to that node removes
//! the marker (after the attachment is durable). A node call checks the
//! marker before its mount and again after it, and undoes its mount if a
//! fence came in between: the fence either sees the recorded, mounted path
//! or the call sees the fence.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::call_log::boottime_ns;
use crate::files::{write_atomic, write_replace};
use crate::mounts;
use crate::path_locks::VolumeLocks;
use crate::plugin::{Failure, Outcome, Plugin};

/// How many stacked mounts a fence removes at one path before giving up.
const MAX_STACKED_MOUNTS: usize = 8;

/// The paths one node set up for one volume.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePaths {
    #[serde(default)]
    pub staging: BTreeSet<PathBuf>,
    #[serde(default)]
    pub targets: BTreeSet<PathBuf>,
}

/// Which list of `NodePaths` a path belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    Staging,
    Target,
}

/// The fence marker's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    pub volume_id: String,
    pub node_id: String,
    pub fenced_boottime_ns: u64,
    /// Paths unmounted with a plain umount2, once the fence is done.
    #[serde(default)]
    pub unmounted: Vec<PathBuf>,
    /// Paths that were busy and only detached (MNT_DETACH).
    #[serde(default)]
    pub detached: Vec<PathBuf>,
    /// False while the unmounts are under way (or failed).
    #[serde(default)]
    pub done: bool,
}

/// The fencing state in the shared storage.
pub struct Fencing {
    dir: PathBuf,
    /// One read-modify-write of a `paths.json` at a time in this process
    /// (each file has one writer process: its node's plugin).
    records: Mutex<()>,
    /// Serialises ControllerPublish and ControllerUnpublish of a volume,
    /// so a fence and its lifting never interleave.
    pub volume_locks: VolumeLocks,
}

/// A string as one path component: bytes other than `[A-Za-z0-9_-]`
/// (and a `.` anywhere) become `%XX`, so no node ID can name `..` or
/// contain `/`.
pub fn component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, String> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("fencing file {} is invalid: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, String> {
    serde_json::to_vec_pretty(value).map_err(|e| format!("cannot encode fencing state: {e}"))
}

/// What a fence did at one path.
enum Unmounted {
    Nothing,
    Plain,
    Detached,
}

/// Unmounts everything stacked at `path`: plainly while that works, with
/// MNT_DETACH once a mount is busy.
fn unmount_all(path: &Path) -> Result<Unmounted, String> {
    let mut done = Unmounted::Nothing;
    for _ in 0..MAX_STACKED_MOUNTS {
        match mounts::unmount_if_mounted(path) {
            Ok(false) => return Ok(done),
            Ok(true) => {
                if matches!(done, Unmounted::Nothing) {
                    done = Unmounted::Plain;
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                mounts::unmount_detach(path)
                    .map_err(|e| format!("cannot detach {}: {e}", path.display()))?;
                log::warn!(
                    "fence: {} was busy; detached it (open files there keep working)",
                    path.display()
                );
                done = Unmounted::Detached;
            }
            Err(e) => return Err(format!("cannot unmount {}: {e}", path.display())),
        }
    }
    match mounts::mount_at(path) {
        Ok(None) => Ok(done),
        Ok(Some(_)) => Err(format!(
            "{} still mounted after {MAX_STACKED_MOUNTS} unmounts",
            path.display()
        )),
        Err(e) => Err(format!("cannot read /proc/self/mountinfo: {e}")),
    }
}

impl Fencing {
    /// Fencing state under `<storage>/fencing`.
    pub fn new(storage: &Path) -> Fencing {
        Fencing {
            dir: storage.join("fencing"),
            records: Mutex::new(()),
            volume_locks: VolumeLocks::default(),
        }
    }

    fn node_dir(&self, volume_id: &str, node_id: &str) -> PathBuf {
        self.dir.join(volume_id).join(component(node_id))
    }

    fn marker(&self, volume_id: &str, node_id: &str) -> PathBuf {
        self.node_dir(volume_id, node_id).join("fenced")
    }

    fn paths_file(&self, volume_id: &str, node_id: &str) -> PathBuf {
        self.node_dir(volume_id, node_id).join("paths.json")
    }

    /// The fence of the volume on the node, if there is one.
    pub fn fence(&self, volume_id: &str, node_id: &str) -> Result<Option<Fence>, String> {
        read_json(&self.marker(volume_id, node_id))
    }

    /// The paths the node recorded for the volume.
    pub fn node_paths(&self, volume_id: &str, node_id: &str) -> Result<NodePaths, String> {
        Ok(read_json(&self.paths_file(volume_id, node_id))?.unwrap_or_default())
    }

    /// Adds (`add`) or removes a path in the node's record of the volume.
    pub fn record(
        &self,
        volume_id: &str,
        node_id: &str,
        kind: PathKind,
        path: &Path,
        add: bool,
    ) -> Result<(), String> {
        let _guard = self.records.lock();
        let file = self.paths_file(volume_id, node_id);
        let mut paths = self.node_paths(volume_id, node_id)?;
        let set = match kind {
            PathKind::Staging => &mut paths.staging,
            PathKind::Target => &mut paths.targets,
        };
        let changed = if add {
            set.insert(path.to_path_buf())
        } else {
            set.remove(path)
        };
        if !changed {
            return Ok(());
        }
        if let Some(dir) = file.parent() {
            fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        write_replace(&file, &encode(&paths)?)
            .map_err(|e| format!("cannot write {}: {e}", file.display()))
    }

    /// The nodes with a directory for the volume (a record or a fence).
    fn nodes_of(&self, volume_id: &str) -> Result<Vec<String>, String> {
        let dir = self.dir.join(volume_id);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
        };
        let mut nodes = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
            let marker = entry.path().join("fenced");
            let paths = entry.path().join("paths.json");
            // The directory name is escaped; the files hold the real ID.
            if let Some(f) = read_json::<Fence>(&marker)? {
                nodes.push(f.node_id);
            } else if paths.exists() {
                nodes.push(unescape(&entry.file_name().to_string_lossy()));
            }
        }
        Ok(nodes)
    }

    /// Fences the volume from the node (every node with a record when
    /// `node_id` is empty): the durable marker first, then every recorded
    /// target and staging path unmounted. Returns the fences written.
    pub fn fence_node(&self, volume_id: &str, node_id: &str) -> Result<Vec<Fence>, String> {
        let nodes = if node_id.is_empty() {
            self.nodes_of(volume_id)?
        } else {
            vec![node_id.to_string()]
        };
        let mut fences = Vec::new();
        for node in nodes {
            fences.push(self.fence_one(volume_id, &node)?);
        }
        Ok(fences)
    }

    fn fence_one(&self, volume_id: &str, node_id: &str) -> Result<Fence, String> {
        let marker = self.marker(volume_id, node_id);
        let mut fence = match self.fence(volume_id, node_id)? {
            Some(f) => f,
            None => Fence {
                volume_id: volume_id.to_string(),
                node_id: node_id.to_string(),
                fenced_boottime_ns: boottime_ns(),
                ..Fence::default()
            },
        };
        fence.done = false;
        if let Some(dir) = marker.parent() {
            fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        write_atomic(&marker, &encode(&fence)?)
            .map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
        if let Some(dir) = marker.parent() {
            sync_dir(dir)?;
        }
        // Read after the marker is in place: a node call that recorded its
        // path before this read is seen here; one that records it later
        // sees the marker when it checks again after its mount.
        let paths = self.node_paths(volume_id, node_id)?;
        for path in paths.targets.iter().chain(&paths.staging) {
            // A repeated fence (the CO's retry) lists each path once.
            let list = match unmount_all(path)? {
                Unmounted::Nothing => continue,
                Unmounted::Plain => &mut fence.unmounted,
                Unmounted::Detached => &mut fence.detached,
            };
            if !list.contains(path) {
                list.push(path.clone());
            }
        }
        fence.done = true;
        write_atomic(&marker, &encode(&fence)?)
            .map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
        log::info!(
            "fenced volume {volume_id} from node {node_id}: unmounted {:?}, detached {:?}",
            fence.unmounted,
            fence.detached
        );
        Ok(fence)
    }

    /// Lifts the fence of the volume on the node (ControllerPublish);
    /// whether there was one.
    pub fn lift(&self, volume_id: &str, node_id: &str) -> Result<bool, String> {
        let marker = self.marker(volume_id, node_id);
        match fs::remove_file(&marker) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(format!("cannot remove {}: {e}", marker.display())),
        }
        // The removal durable before the publish is answered.
        if let Some(dir) = marker.parent() {
            sync_dir(dir)?;
        }
        log::info!("lifted the fence of volume {volume_id} from node {node_id}");
        Ok(true)
    }
}

/// fsync of a directory: a rename or removal in it is durable.
fn sync_dir(dir: &Path) -> Result<(), String> {
    fs::File::open(dir)
        .and_then(|d| crate::files::sync(&d))
        .map_err(|e| format!("cannot sync {}: {e}", dir.display()))
}

/// Undoes `component`.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        if let (b'%', Some(hex)) = (bytes[i], hex) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---- The plugin's side ------------------------------------------------------

impl Plugin {
    /// FAILED_PRECONDITION while the volume is fenced from this node (with
    /// `--fence-on-unpublish`).
    pub fn check_not_fenced(&self, volume_id: &str) -> Outcome<()> {
        let Some(fencing) = &self.fencing else {
            return Ok(());
        };
        let node = &self.config.node_id;
        match fencing.fence(volume_id, node).map_err(Failure::internal)? {
            None => Ok(()),
            Some(_) => Err(Failure::precondition(format!(
                "volume {volume_id} is fenced from node {node}: ControllerUnpublishVolume cut \
                 its access; ControllerPublishVolume it to this node again first"
            ))),
        }
    }

    /// Adds a staging or target path of the volume to this node's record
    /// (before it is mounted), or removes it (after it is unmounted).
    pub fn record_node_path(
        &self,
        volume_id: &str,
        kind: PathKind,
        path: &Path,
        add: bool,
    ) -> Outcome<()> {
        match &self.fencing {
            None => Ok(()),
            Some(f) => f
                .record(volume_id, &self.config.node_id, kind, path, add)
                .map_err(Failure::internal),
        }
    }

    /// After a mount at `path`: when a fence came in since the first
    /// check, the mount is undone and the call refused.
    pub fn recheck_fence(&self, volume_id: &str, path: &Path) -> Outcome<()> {
        let Err(refusal) = self.check_not_fenced(volume_id) else {
            return Ok(());
        };
        match crate::node::unmount_all(path) {
            Ok(()) => Err(refusal),
            Err(e) => Err(Failure::precondition(format!(
                "{}; undoing its mount at {} failed: {}",
                refusal.message,
                path.display(),
                e.message
            ))),
        }
    }

    /// ControllerUnpublishVolume's fence, after the attachment is gone.
    pub fn fence_on_unpublish(&self, volume_id: &str, node_id: &str) -> Outcome<()> {
        match &self.fencing {
            None => Ok(()),
            Some(f) => f
                .fence_node(volume_id, node_id)
                .map(drop)
                .map_err(Failure::internal),
        }
    }

    /// ControllerPublishVolume lifts the fence, once the attachment is
    /// durable.
    pub fn lift_fence(&self, volume_id: &str, node_id: &str) -> Outcome<()> {
        match &self.fencing {
            None => Ok(()),
            Some(f) => f
                .lift(volume_id, node_id)
                .map(drop)
                .map_err(Failure::internal),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_become_one_component_and_back() {
        for id in ["node-a", "a/b", "..", ".", "x%y", "é z"] {
            let c = component(id);
            assert!(!c.contains('/') && !c.contains('.'), "{c}");
            assert_eq!(unescape(&c), id);
        }
        assert_eq!(component("node-a"), "node-a");
    }

    #[test]
    fn records_add_and_remove_paths_and_a_fence_is_lifted_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let f = Fencing::new(dir.path());
        let s = Path::new("/s/1");
        let t = Path::new("/t/1");
        f.record("v", "n/1", PathKind::Staging, s, true)
            .expect("record");
        f.record("v", "n/1", PathKind::Target, t, true)
            .expect("record");
        f.record("v", "n/1", PathKind::Target, t, true)
            .expect("again");
        let paths = f.node_paths("v", "n/1").expect("read");
        assert_eq!(paths.staging, BTreeSet::from([s.to_path_buf()]));
        assert_eq!(paths.targets, BTreeSet::from([t.to_path_buf()]));
        assert_eq!(f.nodes_of("v").expect("nodes"), vec!["n/1".to_string()]);
        f.record("v", "n/1", PathKind::Target, t, false)
            .expect("remove");
        assert!(f.node_paths("v", "n/1").expect("read").targets.is_empty());

        assert_eq!(f.fence("v", "n/1").expect("read"), None);
        // Nothing is mounted at the recorded paths: the fence has nothing
        // to unmount, and is written all the same.
        let fences = f.fence_node("v", "").expect("fence every node");
        assert_eq!(fences.len(), 1);
        let fence = f.fence("v", "n/1").expect("read").expect("fenced");
        assert!(fence.done && fence.unmounted.is_empty() && fence.detached.is_empty());
        assert_eq!(fence.node_id, "n/1");
        assert!(fence.fenced_boottime_ns > 0);
        assert_eq!(f.lift("v", "n/1"), Ok(true));
        assert_eq!(f.lift("v", "n/1"), Ok(false));
        assert_eq!(f.fence("v", "n/1").expect("read"), None);
    }
}
