//! The state: a snapshot (`state.json`, one JSON document) plus a journal
//! (`state.journal`, one line per durable change since the snapshot), both
//! mode 0600 in the state directory.
//!
//! A change is made durable by appending one line to the journal and
//! fdatasync'ing it: a few hundred bytes and one flush, whatever the number
//! of allocations on record. When the journal has grown as large as the
//! snapshot, the next write rewrites the snapshot atomically (temporary
//! file, fdatasync, rename, fsync of the directory) and starts an empty
//! journal the same way. Opening the store folds a non-empty journal into
//! a new snapshot.
//!
//! A snapshot that does not parse, has a schema version this build does not
//! know, or a journal damaged anywhere but in its last line (which a crash
//! can cut off) stops the agent with an error naming the file; neither is
//! ever overwritten.
//!
//! Write-ahead: every allocation volume record carries a phase; an in-flight
//! phase is made durable before its CSI call is sent, so a restart knows
//! which calls may have happened.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};

use crate::claims::Claim;
use crate::journal::{self, Delta, JOURNAL_FILE};
use crate::volumes::{Usage, VolumeSpec};

/// The schema this build writes. 2: a snapshot plus a journal (`state.json`
/// alone is not the whole state while an agent runs or after a crash, so a
/// claimd that knows only schema 1 must refuse it rather than miss the
/// journal). 1: `state.json` alone, rewritten on every change; read and
/// converted at start.
pub const SCHEMA_VERSION: u32 = 2;
/// Schemas this build reads.
pub const READABLE_SCHEMAS: &[u32] = &[1, 2];
pub const STATE_FILE: &str = "state.json";
pub const LOCK_FILE: &str = "claimd.lock";
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Where one allocation volume stands. `*ing` phases are in flight: the
/// named CSI call may or may not have happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The claim is being taken.
    Claiming,
    ControllerPublishing,
    Staging,
    Publishing,
    /// Mounted at the target path.
    Published,
    Unpublishing,
    Unstaging,
    ControllerUnpublishing,
    /// Node and controller are done; the claim is being freed.
    ReleasingClaim,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Claiming => "claiming",
            Phase::ControllerPublishing => "controller-publishing",
            Phase::Staging => "staging",
            Phase::Publishing => "publishing",
            Phase::Published => "published",
            Phase::Unpublishing => "unpublishing",
            Phase::Unstaging => "unstaging",
            Phase::ControllerUnpublishing => "controller-unpublishing",
            Phase::ReleasingClaim => "releasing-claim",
        }
    }

    /// Phases of the way down.
    pub fn is_teardown(self) -> bool {
        matches!(
            self,
            Phase::Unpublishing
                | Phase::Unstaging
                | Phase::ControllerUnpublishing
                | Phase::ReleasingClaim
        )
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One volume of one allocation: what recovery needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocVolume {
    pub alias: String,
    pub volume_id: String,
    pub plugin_id: String,
    /// The plugin's ID of the volume.
    pub external_volume_id: String,
    /// The node plugin's node ID used for ControllerPublish; the detach
    /// uses this recorded value, never a fresh lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_node_id: Option<String>,
    pub usage: Usage,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_flags: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_path: Option<PathBuf>,
    pub target_path: PathBuf,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub publish_context: BTreeMap<String, String>,
    /// This record counts as a user of the controller attachment of the
    /// volume on this node (set before ControllerPublish is sent).
    #[serde(default)]
    pub holds_attachment: bool,
    /// This record counts as a user of the staging path (set before
    /// NodeStage is sent).
    #[serde(default)]
    pub holds_staging: bool,
    pub phase: Phase,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocRecord {
    pub id: String,
    /// A release was asked for (or a failed mount is being rolled back):
    /// every volume goes down, whatever its phase.
    #[serde(default)]
    pub releasing: bool,
    /// Alias -> volume. Shared like the records above it, so changing one
    /// volume of a large allocation copies pointers, not its other volumes.
    pub volumes: BTreeMap<String, Arc<AllocVolume>>,
}

/// (volume ID, allocation ID): the key of a claim.
pub type ClaimKey = (String, String);

/// A map of shared records that is itself shared: cloning it (every state
/// update starts from a clone) copies one pointer; the first change to a
/// shared map copies the map, never the records. Reads go through `Deref`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SharedMap<K: Ord, V>(Arc<BTreeMap<K, Arc<V>>>);

impl<K: Ord, V> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap(Arc::new(BTreeMap::new()))
    }
}

impl<K: Ord, V> std::ops::Deref for SharedMap<K, V> {
    type Target = BTreeMap<K, Arc<V>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<K: Ord + Clone, V> SharedMap<K, V> {
    pub fn from_map(m: BTreeMap<K, Arc<V>>) -> Self {
        SharedMap(Arc::new(m))
    }

    /// The map for changing (copied first when shared).
    pub fn make_mut(&mut self) -> &mut BTreeMap<K, Arc<V>> {
        Arc::make_mut(&mut self.0)
    }

    /// Whether both are the same map (then equal without looking).
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }

    pub fn insert(&mut self, k: K, v: Arc<V>) -> Option<Arc<V>> {
        self.make_mut().insert(k, v)
    }

    pub fn remove<Q>(&mut self, k: &Q) -> Option<Arc<V>>
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ?Sized,
    {
        if !self.0.contains_key(k) {
            return None;
        }
        self.make_mut().remove(k)
    }

    pub fn get_mut<Q>(&mut self, k: &Q) -> Option<&mut Arc<V>>
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ?Sized,
    {
        if !self.0.contains_key(k) {
            return None;
        }
        self.make_mut().get_mut(k)
    }

    pub fn values_mut(&mut self) -> std::collections::btree_map::ValuesMut<'_, K, Arc<V>> {
        self.make_mut().values_mut()
    }

    pub fn clear(&mut self) {
        if !self.0.is_empty() {
            self.make_mut().clear();
        }
    }
}

/// Everything claimd records. Records are shared (`Arc`) between the durable
/// copy and the copies updates work on, so an update clones pointers, not
/// records, and the journal finds what changed by pointer comparison.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    pub schema_version: u32,
    /// Boot ID of the kernel this state was last converged on.
    pub boot_id: String,
    #[serde(default)]
    pub volumes: SharedMap<String, VolumeSpec>,
    /// Written as a list of claims, ordered by volume, then allocation.
    #[serde(default, with = "claim_list")]
    pub claims: SharedMap<ClaimKey, Claim>,
    #[serde(default)]
    pub allocs: SharedMap<String, AllocRecord>,
}

/// Claims in the file are a list (as in every earlier file); in memory they
/// are keyed by (volume, allocation).
mod claim_list {
    use super::*;
    use serde::de::Error as _;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        m: &SharedMap<ClaimKey, Claim>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.values())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<SharedMap<ClaimKey, Claim>, D::Error> {
        let list: Vec<Claim> = Vec::deserialize(d)?;
        let mut m = BTreeMap::new();
        for c in list {
            let key = (c.volume_id.clone(), c.alloc_id.clone());
            if m.insert(key, Arc::new(c)).is_some() {
                return Err(D::Error::custom(
                    "two claims of one allocation on one volume",
                ));
            }
        }
        Ok(SharedMap::from_map(m))
    }
}

impl StateFile {
    pub fn new(boot_id: &str) -> StateFile {
        StateFile {
            schema_version: SCHEMA_VERSION,
            boot_id: boot_id.to_string(),
            volumes: SharedMap::default(),
            claims: SharedMap::default(),
            allocs: SharedMap::default(),
        }
    }

    /// Every (alloc, alias, record), in order.
    pub fn alloc_volumes(&self) -> impl Iterator<Item = (&AllocRecord, &AllocVolume)> {
        self.allocs
            .values()
            .flat_map(|a| a.volumes.values().map(move |v| (&**a, &**v)))
    }

    /// The allocation's record, for changing (copied first when shared).
    pub fn alloc_mut(&mut self, alloc: &str) -> Option<&mut AllocRecord> {
        self.allocs.get_mut(alloc).map(Arc::make_mut)
    }

    pub fn volume_mut(&mut self, alloc: &str, alias: &str) -> Option<&mut AllocVolume> {
        self.alloc_mut(alloc)?
            .volumes
            .get_mut(alias)
            .map(Arc::make_mut)
    }

    pub fn volume(&self, alloc: &str, alias: &str) -> Option<&AllocVolume> {
        self.allocs.get(alloc)?.volumes.get(alias).map(|v| &**v)
    }

    /// The claims on one volume.
    pub fn claims_on<'a>(&'a self, volume_id: &str) -> impl Iterator<Item = &'a Claim> + 'a {
        let from = (volume_id.to_string(), String::new());
        let volume_id = volume_id.to_string();
        self.claims
            .range(from..)
            .take_while(move |((v, _), _)| *v == volume_id)
            .map(|(_, c)| &**c)
    }

    pub fn claim(&self, volume_id: &str, alloc_id: &str) -> Option<&Claim> {
        self.claims
            .get(&(volume_id.to_string(), alloc_id.to_string()))
            .map(|c| &**c)
    }

    pub fn claim_mut(&mut self, volume_id: &str, alloc_id: &str) -> Option<&mut Claim> {
        self.claims
            .get_mut(&(volume_id.to_string(), alloc_id.to_string()))
            .map(Arc::make_mut)
    }

    /// Other records that hold the staging path `path`.
    pub fn staging_users(&self, path: &Path, except: (&str, &str)) -> usize {
        self.alloc_volumes()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .filter(|(_, v)| v.holds_staging && v.staging_path.as_deref() == Some(path))
            .count()
    }

    /// Other records that hold the controller attachment of `volume_id`.
    pub fn attachment_users(&self, volume_id: &str, except: (&str, &str)) -> Vec<&AllocVolume> {
        self.alloc_volumes()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .filter(|(_, v)| v.holds_attachment && v.volume_id == volume_id)
            .map(|(_, v)| v)
            .collect()
    }
}

#[derive(Debug)]
pub enum StateError {
    CreateDir {
        path: PathBuf,
        source: io::Error,
    },
    Lock {
        path: PathBuf,
        source: io::Error,
    },
    /// Another agent holds the lock on this state directory.
    Locked {
        path: PathBuf,
    },
    Read {
        path: PathBuf,
        source: io::Error,
    },
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A journal line other than the last is damaged.
    CorruptJournal {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// A journal without the snapshot it belongs to.
    JournalWithoutSnapshot {
        journal: PathBuf,
        snapshot: PathBuf,
    },
    /// The snapshot and the journal kept changing while being read.
    Unstable {
        path: PathBuf,
    },
    UnknownVersion {
        path: PathBuf,
        found: String,
    },
    Write {
        path: PathBuf,
        source: io::Error,
    },
    BootId {
        source: io::Error,
    },
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateError::CreateDir { path, .. } => {
                write!(f, "failed to create state directory {}", path.display())
            }
            StateError::Lock { path, .. } => write!(f, "failed to lock {}", path.display()),
            StateError::Locked { path } => write!(
                f,
                "another claimd agent is using the state directory (lock {} is held)",
                path.display()
            ),
            StateError::Read { path, .. } => {
                write!(f, "failed to read state file {}", path.display())
            }
            StateError::Corrupt { path, .. } => write!(
                f,
                "state file {} is corrupt; refusing to start and leaving it untouched (restore it from a backup or move it aside)",
                path.display()
            ),
            StateError::CorruptJournal { path, line, reason } => write!(
                f,
                "state journal {} is corrupt at line {line} ({reason}); refusing to start and leaving it untouched (restore the state directory from a backup or move it aside)",
                path.display()
            ),
            StateError::JournalWithoutSnapshot { journal, snapshot } => write!(
                f,
                "state journal {} exists but its snapshot {} does not; refusing to start and leaving it untouched (restore the snapshot, or move the journal aside to start empty)",
                journal.display(),
                snapshot.display()
            ),
            StateError::Unstable { path } => write!(
                f,
                "the state in {} kept changing while it was read; try again",
                path.display()
            ),
            StateError::UnknownVersion { path, found } => write!(
                f,
                "state file {} has schema version {found}, which this claimd (schema {SCHEMA_VERSION}, reads {READABLE_SCHEMAS:?}) does not know; refusing to start and leaving it untouched",
                path.display()
            ),
            StateError::Write { path, .. } => {
                write!(f, "failed to write state file {}", path.display())
            }
            StateError::BootId { .. } => write!(f, "failed to read the boot ID from {BOOT_ID_PATH}"),
        }
    }
}

impl std::error::Error for StateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StateError::CreateDir { source, .. }
            | StateError::Lock { source, .. }
            | StateError::Read { source, .. }
            | StateError::Write { source, .. }
            | StateError::BootId { source } => Some(source),
            StateError::Corrupt { source, .. } => Some(source),
            StateError::Locked { .. }
            | StateError::UnknownVersion { .. }
            | StateError::CorruptJournal { .. }
            | StateError::JournalWithoutSnapshot { .. }
            | StateError::Unstable { .. } => None,
        }
    }
}

pub fn current_boot_id() -> Result<String, StateError> {
    std::fs::read_to_string(BOOT_ID_PATH)
        .map(|s| s.trim().to_string())
        .map_err(|source| StateError::BootId { source })
}

/// Durable writes since the store was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Durable writes: journal appends plus snapshot rewrites.
    pub writes: u64,
    /// Bytes written to the journal and to snapshots.
    pub bytes: u64,
    /// fsync and fdatasync calls.
    pub fsyncs: u64,
    /// Snapshot rewrites.
    pub snapshots: u64,
}

/// Group commit: changes of concurrent `update`s pile up in `pending` while
/// one of them writes; the next writer makes the whole pile durable in one
/// journal line. Sequence numbers tell each updater when its change is on
/// disk.
struct Commit {
    /// What is on disk: what readers see.
    committed: StateFile,
    /// Changes applied but not yet durable, including the batch being
    /// written; None when everything is durable.
    pending: Option<StateFile>,
    /// Sequence number of the latest change applied to `pending`.
    applied: u64,
    /// Every change up to this one is on disk.
    durable: u64,
    /// Every change up to this one failed to be written (and was dropped).
    failed: u64,
    failure: String,
    writing: bool,
}

/// The journal file being appended to. Only the writer of the moment
/// touches it.
struct Journal {
    file: File,
    /// Bytes of whole lines in the file.
    len: u64,
    /// Size of the snapshot the journal follows.
    snapshot_len: u64,
    /// An append failed part-way: the file may end in a partial line, so
    /// the next write starts a new snapshot and journal instead.
    broken: bool,
}

/// The journal is folded into a new snapshot once it is at least this
/// large and at least as large as the snapshot.
pub const JOURNAL_MIN_COMPACT: u64 = 1 << 20;

/// The state and its in-memory copy. Every change goes through `update`,
/// which holds the lock for the whole read-modify-write and returns only
/// once the change is durable; readers see only durable state.
pub struct StateStore {
    dir: PathBuf,
    path: PathBuf,
    journal_path: PathBuf,
    state: Mutex<Commit>,
    durable_changed: Condvar,
    journal: Mutex<Journal>,
    /// Boot ID recorded in the file at open.
    recorded_boot_id: String,
    boot_id: String,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    fsyncs: AtomicU64,
    snapshots: AtomicU64,
    _lock: File,
}

impl StateStore {
    /// Locks the directory and loads the state (or starts a new one).
    pub fn open(dir: &Path) -> Result<StateStore, StateError> {
        Self::open_with_boot_id(dir, &current_boot_id()?)
    }

    /// As `open`, with the current boot ID given (tests simulate reboots).
    pub fn open_with_boot_id(dir: &Path, boot_id: &str) -> Result<StateStore, StateError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| StateError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|source| StateError::Lock {
                path: lock_path.clone(),
                source,
            })?;
        // SAFETY: flock on a file descriptor we own; no memory is shared.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            return Err(if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                StateError::Locked { path: lock_path }
            } else {
                StateError::Lock {
                    path: lock_path,
                    source: err,
                }
            });
        }
        let path = dir.join(STATE_FILE);
        let journal_path = dir.join(JOURNAL_FILE);
        // Temporary files left by a crash mid-write are never authoritative.
        let _ = std::fs::remove_file(tmp_path(&path));
        let _ = std::fs::remove_file(tmp_path(&journal_path));
        let loaded = read_files(&path, &journal_path)?;
        let fresh = loaded.is_none();
        let (state, replayed) = match loaded {
            Some(l) => {
                if l.torn_tail {
                    log::warn!(
                        "the last line of {} was cut off (a write interrupted by a crash); it was never acknowledged and is left out",
                        journal_path.display()
                    );
                }
                (l.state, l.journal_len > 0)
            }
            None => (StateFile::new(boot_id), false),
        };
        for p in [&path, &journal_path] {
            if let Ok(meta) = std::fs::metadata(p) {
                if meta.permissions().mode() & 0o077 != 0 {
                    log::warn!("{} was readable by others; setting mode 0600", p.display());
                    let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600));
                }
            }
        }
        let recorded_boot_id = state.boot_id.clone();
        // Start every run from one snapshot and an empty journal: a fresh
        // directory gets both, and a journal left by the last run (or a
        // crash) is folded in. An empty journal is simply reused.
        let journal = if fresh || replayed || !journal_path.exists() {
            let (file, snapshot_len) = fold(dir, &path, &journal_path, &state)?;
            Journal {
                file,
                len: 0,
                snapshot_len,
                broken: false,
            }
        } else {
            let file = open_journal(&journal_path)?;
            let snapshot_len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            Journal {
                file,
                len: 0,
                snapshot_len,
                broken: false,
            }
        };
        Ok(StateStore {
            dir: dir.to_path_buf(),
            path,
            journal_path,
            state: Mutex::new(Commit {
                committed: state,
                pending: None,
                applied: 0,
                durable: 0,
                failed: 0,
                failure: String::new(),
                writing: false,
            }),
            durable_changed: Condvar::new(),
            journal: Mutex::new(journal),
            recorded_boot_id,
            boot_id: boot_id.to_string(),
            writes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            fsyncs: AtomicU64::new(0),
            snapshots: AtomicU64::new(0),
            _lock: lock,
        })
    }

    /// The snapshot, `state.json`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The journal, `state.journal`.
    pub fn journal_path(&self) -> &Path {
        &self.journal_path
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The node rebooted since the state was last converged: every mount it
    /// records is gone.
    pub fn rebooted(&self) -> bool {
        self.recorded_boot_id != self.boot_id
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    /// What the store has written since open.
    pub fn write_stats(&self) -> WriteStats {
        WriteStats {
            writes: self.writes.load(Ordering::Relaxed),
            bytes: self.bytes_written.load(Ordering::Relaxed),
            fsyncs: self.fsyncs.load(Ordering::Relaxed),
            snapshots: self.snapshots.load(Ordering::Relaxed),
        }
    }

    /// Reads the durable state.
    pub fn read<R>(&self, f: impl FnOnce(&StateFile) -> R) -> R {
        f(&self.state.lock().committed)
    }

    /// A copy of the durable state (records are shared, not copied).
    pub fn snapshot(&self) -> StateFile {
        self.state.lock().committed.clone()
    }

    /// Applies `f` to a copy of the latest state; when it succeeds and
    /// changed something, returns once the change is durable. Concurrent
    /// updates are written together in one journal line (group commit).
    /// A failed write fails every change of its batch (and those applied on
    /// top of it) and leaves the files and the durable state as they were.
    pub fn update<R, E: From<StateError>>(
        &self,
        f: impl FnOnce(&mut StateFile) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut g = self.state.lock();
        let base = g.pending.as_ref().unwrap_or(&g.committed);
        let mut next = base.clone();
        let r = f(&mut next)?;
        // Wait for our change, or (when nothing changed) for the pending
        // changes `f` may have read, to be on disk.
        let mine = if next != *base {
            g.applied += 1;
            g.pending = Some(next);
            g.applied
        } else if g.pending.is_none() {
            // Nothing changed and `f` read only durable state (a batch that
            // failed earlier is not an error of this call).
            return Ok(r);
        } else {
            g.applied
        };
        loop {
            if g.durable >= mine {
                return Ok(r);
            }
            if g.failed >= mine {
                return Err(StateError::Write {
                    path: self.journal_path.clone(),
                    source: io::Error::other(g.failure.clone()),
                }
                .into());
            }
            if g.writing {
                self.durable_changed.wait(&mut g);
                continue;
            }
            // Become the writer of everything pending. `pending` stays in
            // place: changes applied while we write build on top of it.
            let Some(batch) = g.pending.clone() else {
                // Nothing pending yet not durable: cannot happen, but never
                // spin on it.
                return Ok(r);
            };
            let old = g.committed.clone();
            let upto = g.applied;
            g.writing = true;
            let res = MutexGuard::unlocked(&mut g, || self.persist(&old, &batch));
            g.writing = false;
            match res {
                Ok(()) => {
                    g.committed = batch;
                    g.durable = upto;
                    if g.applied == upto {
                        g.pending = None;
                    }
                    // Otherwise `pending` holds this batch plus the changes
                    // applied meanwhile, for the next writer.
                }
                Err(e) => {
                    // Later changes were built on the failed batch: drop
                    // them too.
                    g.failed = g.applied;
                    g.failure = crate::error_chain(&e);
                    g.pending = None;
                }
            }
            self.durable_changed.notify_all();
        }
    }

    /// Folds the journal into a new snapshot now (on a graceful stop), so
    /// that `state.json` alone holds the whole state. Waits for a write in
    /// progress; does nothing when the journal is empty or changes are
    /// still waiting for their writer (it will write them).
    pub fn compact(&self) -> Result<(), StateError> {
        let mut g = self.state.lock();
        while g.writing {
            self.durable_changed.wait(&mut g);
        }
        if g.pending.is_some() {
            return Ok(());
        }
        let state = g.committed.clone();
        g.writing = true;
        let res = MutexGuard::unlocked(&mut g, || {
            let mut j = self.journal.lock();
            if j.len == 0 && !j.broken {
                return Ok(());
            }
            self.compact_into(&mut j, &state)
        });
        g.writing = false;
        self.durable_changed.notify_all();
        res
    }

    /// Makes `new` durable, `old` being what is durable now: one journal
    /// line, or a new snapshot and journal when the journal has grown large
    /// (or an append failed part-way).
    fn persist(&self, old: &StateFile, new: &StateFile) -> Result<(), StateError> {
        let mut j = self.journal.lock();
        let delta = Delta::between(old, new);
        if delta.is_empty() {
            return Ok(());
        }
        if j.broken {
            // The journal may end in a partial line: nothing may follow it.
            self.compact_into(&mut j, old)?;
        } else if j.len >= JOURNAL_MIN_COMPACT.max(j.snapshot_len) {
            // Fold what the journal leads to (`old`, never `new`), then
            // append the change to the new journal: a snapshot is always
            // the end state of the journal it replaces, so a crash between
            // the two renames replays that journal onto its own end state,
            // which changes nothing.
            if let Err(e) = self.compact_into(&mut j, old) {
                // A full disk may have no room for a snapshot yet room for
                // a line. Appending stays correct as long as the journal
                // file is still the one at the journal's path (any new
                // snapshot is `old`, the end state of this journal); the
                // next write tries the compaction again.
                if !same_file(&j.file, &self.journal_path) {
                    return Err(e);
                }
                log::warn!(
                    "{}; appending to the journal instead",
                    crate::error_chain(&e)
                );
            }
        }
        let line = journal::encode(&delta).map_err(|e| StateError::Write {
            path: self.journal_path.clone(),
            source: io::Error::other(e),
        })?;
        let res = (|| {
            j.file.write_all(&line)?;
            j.file.sync_data()
        })();
        if let Err(source) = res {
            // The change failed: cut off whatever part of the line was
            // written. If that fails, the line may be whole on disk and
            // would be replayed by a restart: fold the durable state into a
            // new snapshot and journal instead.
            let len = j.len;
            let cut = j.file.set_len(len).and_then(|()| j.file.sync_data());
            if cut.is_err() && self.compact_into(&mut j, old).is_err() {
                j.broken = true;
                log::error!(
                    "a failed write to {} could not be undone; a restart before the next successful write may still apply it",
                    self.journal_path.display()
                );
            }
            return Err(StateError::Write {
                path: self.journal_path.clone(),
                source,
            });
        }
        j.len += line.len() as u64;
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.bytes_written
            .fetch_add(line.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// A new snapshot of `state`, then a new empty journal. The snapshot is
    /// durable before the old journal is replaced, so a crash in between
    /// leaves a snapshot plus a journal whose changes it already holds.
    fn compact_into(&self, j: &mut Journal, state: &StateFile) -> Result<(), StateError> {
        let (file, snapshot_len) = fold(&self.dir, &self.path, &self.journal_path, state)?;
        // Snapshot: fdatasync and directory fsync; journal: fsync of the
        // new file and of the directory.
        self.fsyncs.fetch_add(4, Ordering::Relaxed);
        self.bytes_written
            .fetch_add(snapshot_len, Ordering::Relaxed);
        j.file = file;
        j.len = 0;
        j.snapshot_len = snapshot_len;
        j.broken = false;
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.snapshots.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Whether `file` is the file at `path` now.
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Writes `state` as the new snapshot, then replaces the journal with an
/// empty one; returns the journal, open for appends, and the snapshot's
/// size. The snapshot is durable before the old journal goes, so a crash in
/// between leaves a snapshot plus a journal whose changes it already holds
/// (replaying them changes nothing).
fn fold(
    dir: &Path,
    path: &Path,
    journal_path: &Path,
    state: &StateFile,
) -> Result<(File, u64), StateError> {
    let snapshot_len = write_snapshot(dir, path, state)?;
    crate::failpoints::hit("state-after-snapshot");
    Ok((new_journal(dir, journal_path)?, snapshot_len))
}

/// Writes the snapshot atomically; returns its size.
fn write_snapshot(dir: &Path, path: &Path, state: &StateFile) -> Result<u64, StateError> {
    let write_err = |source| StateError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = serde_json::to_vec(state).map_err(|e| write_err(io::Error::other(e)))?;
    bytes.push(b'\n');
    let tmp = tmp_path(path);
    if let Err(source) = write_atomically(dir, &tmp, path, &bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(write_err(source));
    }
    Ok(bytes.len() as u64)
}

/// Replaces the journal with a new empty one (created aside, then renamed
/// over it, so a reader never sees it half-way) and opens it for appends.
fn new_journal(dir: &Path, path: &Path) -> Result<File, StateError> {
    let tmp = tmp_path(path);
    let res = (|| {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()?;
        open_journal_io(path)
    })();
    res.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        StateError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

fn open_journal_io(path: &Path) -> io::Result<File> {
    OpenOptions::new().append(true).mode(0o600).open(path)
}

fn open_journal(path: &Path) -> Result<File, StateError> {
    open_journal_io(path).map_err(|source| StateError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The state read back from a directory.
pub struct Loaded {
    pub state: StateFile,
    /// Bytes of journal that were read (0: no journal, or an empty one).
    pub journal_len: u64,
    /// The journal's last line was cut off by a crash and left out.
    pub torn_tail: bool,
}

fn read_err(path: &Path) -> impl Fn(io::Error) -> StateError + '_ {
    move |source| StateError::Read {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads the snapshot and replays the journal. None: neither exists.
/// Changes nothing on disk.
fn read_files(path: &Path, journal_path: &Path) -> Result<Option<Loaded>, StateError> {
    let snapshot = match std::fs::read(path) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(read_err(path)(e)),
    };
    let journal = match std::fs::read(journal_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(read_err(journal_path)(e)),
    };
    assemble(path, snapshot.as_deref(), journal_path, &journal)
}

fn assemble(
    path: &Path,
    snapshot: Option<&[u8]>,
    journal_path: &Path,
    journal: &[u8],
) -> Result<Option<Loaded>, StateError> {
    let Some(snapshot) = snapshot else {
        if journal.is_empty() {
            return Ok(None);
        }
        return Err(StateError::JournalWithoutSnapshot {
            journal: journal_path.to_path_buf(),
            snapshot: path.to_path_buf(),
        });
    };
    let mut state = parse_state(path, snapshot)?;
    let replay = journal::parse(journal).map_err(|c| StateError::CorruptJournal {
        path: journal_path.to_path_buf(),
        line: c.line,
        reason: c.reason,
    })?;
    for d in replay.deltas {
        d.apply(&mut state);
    }
    Ok(Some(Loaded {
        state,
        journal_len: journal.len() as u64,
        torn_tail: replay.torn_tail,
    }))
}

/// Reads the state of a directory without locking it, while an agent may
/// be writing it (for `claimd state` and tests). The journal is opened
/// before the snapshot is read, and the read is retried if either file was
/// replaced meanwhile, so a compaction cannot make the result miss a
/// change. Changes nothing on disk. None: the directory holds no state.
pub fn load_dir(dir: &Path) -> Result<Option<Loaded>, StateError> {
    let path = dir.join(STATE_FILE);
    let journal_path = dir.join(JOURNAL_FILE);
    let ino = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let mut corrupt_reads = 0;
    for _ in 0..50 {
        let mut journal_file = match File::open(&journal_path) {
            Ok(f) => Some(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(read_err(&journal_path)(e)),
        };
        let journal_id = match &journal_file {
            Some(f) => {
                let m = f.metadata().map_err(read_err(&journal_path))?;
                Some((m.dev(), m.ino()))
            }
            None => None,
        };
        let (snapshot, snapshot_id) = match File::open(&path) {
            Ok(mut f) => {
                let m = f.metadata().map_err(read_err(&path))?;
                let mut b = Vec::new();
                f.read_to_end(&mut b).map_err(read_err(&path))?;
                (Some(b), Some((m.dev(), m.ino())))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (None, None),
            Err(e) => return Err(read_err(&path)(e)),
        };
        let mut journal = Vec::new();
        if let Some(f) = journal_file.as_mut() {
            f.read_to_end(&mut journal)
                .map_err(read_err(&journal_path))?;
        }
        if ino(&path) != snapshot_id || ino(&journal_path) != journal_id {
            // A compaction replaced a file while we read: read again.
            std::thread::yield_now();
            continue;
        }
        match assemble(&path, snapshot.as_deref(), &journal_path, &journal) {
            // A failed append being cut off while we read can look like a
            // damaged line followed by more: only damage that stays is
            // corruption.
            Err(e @ StateError::CorruptJournal { .. }) => {
                corrupt_reads += 1;
                if corrupt_reads >= 3 {
                    return Err(e);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
    Err(StateError::Unstable { path: path.clone() })
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn write_atomically(dir: &Path, tmp: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)?;
    f.write_all(bytes)?;
    // fdatasync: the data and the size it needs, not the timestamps.
    f.sync_data()?;
    drop(f);
    std::fs::rename(tmp, path)?;
    File::open(dir)?.sync_all()
}

/// Parses state file bytes: the schema version first, then the document.
pub fn parse_state(path: &Path, bytes: &[u8]) -> Result<StateFile, StateError> {
    #[derive(Deserialize)]
    struct Version {
        schema_version: serde_json::Value,
    }
    let v: Version = serde_json::from_slice(bytes).map_err(|source| StateError::Corrupt {
        path: path.to_path_buf(),
        source,
    })?;
    let known = v
        .schema_version
        .as_u64()
        .is_some_and(|n| READABLE_SCHEMAS.iter().any(|&k| u64::from(k) == n));
    if !known {
        return Err(StateError::UnknownVersion {
            path: path.to_path_buf(),
            found: v.schema_version.to_string(),
        });
    }
    let mut state: StateFile =
        serde_json::from_slice(bytes).map_err(|source| StateError::Corrupt {
            path: path.to_path_buf(),
            source,
        })?;
    // A schema 1 file reads the same; it is written back as this schema.
    state.schema_version = SCHEMA_VERSION;
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct TestErr(String);
    impl From<StateError> for TestErr {
        fn from(e: StateError) -> Self {
            TestErr(e.to_string())
        }
    }

    fn spec(id: &str) -> Arc<VolumeSpec> {
        serde_json::from_value(serde_json::json!({
            "id": id, "plugin_id": "p", "external_id": "x",
            "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"],
            "secrets": {"token": "s3cret"}
        }))
        .expect("spec")
    }

    fn on_disk(dir: &Path) -> StateFile {
        load_dir(dir).expect("load").expect("a state").state
    }

    #[test]
    fn round_trip_mode_and_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = StateStore::open_with_boot_id(dir.path(), "boot-a").expect("open");
            s.update::<_, TestErr>(|st| {
                st.volumes.insert("db".into(), spec("db"));
                Ok(())
            })
            .expect("update");
            // One journal line; opening wrote the first snapshot.
            assert_eq!(
                s.write_stats(),
                WriteStats {
                    writes: 1,
                    bytes: std::fs::metadata(s.journal_path()).expect("journal").len(),
                    fsyncs: 1,
                    snapshots: 0
                }
            );
            // A no-op update writes nothing.
            s.update::<_, TestErr>(|_| Ok(())).expect("noop");
            assert_eq!(s.write_stats().writes, 1);
        }
        for f in [STATE_FILE, JOURNAL_FILE] {
            let mode = std::fs::metadata(dir.path().join(f))
                .expect("stat")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
        let s = StateStore::open_with_boot_id(dir.path(), "boot-a").expect("reopen");
        assert!(!s.rebooted());
        assert_eq!(
            s.read(|st| st.volumes["db"].secrets["token"].clone()),
            "s3cret"
        );
        drop(s);
        let s = StateStore::open_with_boot_id(dir.path(), "boot-b").expect("reopen");
        assert!(s.rebooted());
    }

    #[test]
    fn second_open_is_refused_while_locked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _a = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        let e = StateStore::open_with_boot_id(dir.path(), "b")
            .err()
            .expect("second open must fail");
        assert!(matches!(e, StateError::Locked { .. }), "{e}");
    }

    #[test]
    fn corrupt_and_unknown_version_are_refused_and_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(STATE_FILE);
        for (bytes, want) in [
            (
                &b"{\"schema_version\":1,\"boot_id\":\"x\",\"allocs\":{\"a\""[..],
                "corrupt",
            ),
            (&b"not json at all"[..], "corrupt"),
            (
                &b"{\"schema_version\":99,\"boot_id\":\"x\"}"[..],
                "schema version 99",
            ),
            (
                &b"{\"schema_version\":1,\"boot_id\":\"x\",\"surprise\":1}"[..],
                "corrupt",
            ),
        ] {
            std::fs::write(&path, bytes).expect("write");
            let e = StateStore::open_with_boot_id(dir.path(), "b")
                .err()
                .expect("must refuse");
            let msg = e.to_string();
            assert!(msg.contains(want), "{msg}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert_eq!(std::fs::read(&path).expect("read"), bytes, "file changed");
        }
    }

    #[test]
    fn failed_update_changes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        let before = std::fs::read(s.path()).expect("read");
        let r: Result<(), TestErr> = s.update(|st| {
            st.volumes.insert("db".into(), spec("db"));
            Err(TestErr("refused".into()))
        });
        assert!(r.is_err());
        assert!(s.read(|st| st.volumes.is_empty()));
        assert_eq!(std::fs::read(s.path()).expect("read"), before);
    }

    #[test]
    fn concurrent_updates_are_all_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = std::sync::Arc::new(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
        let threads: Vec<_> = (0..40)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || {
                    s.update::<_, TestErr>(|st| {
                        st.volumes.insert(format!("v{i}"), spec(&format!("v{i}")));
                        Ok(())
                    })
                    .expect("update");
                    // Once update returns, the change is on disk.
                    let on_disk = on_disk(s.dir());
                    assert!(on_disk.volumes.contains_key(&format!("v{i}")));
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        let on_disk = on_disk(s.dir());
        assert_eq!(on_disk.volumes.len(), 40);
        assert_eq!(s.snapshot(), on_disk);
        let writes = s.write_stats().writes;
        assert!((1..=40).contains(&writes), "{writes} writes");
    }

    /// A small tmpfs mounted on a test's directory, unmounted on drop.
    struct SmallFs(std::ffi::CString);

    impl SmallFs {
        fn mount(dir: &Path, opts: &std::ffi::CStr) -> SmallFs {
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("path");
            let fs = c"tmpfs";
            // SAFETY: plain mount(2) of a small tmpfs on our own temp dir.
            let rc = unsafe {
                libc::mount(
                    fs.as_ptr(),
                    c.as_ptr(),
                    fs.as_ptr(),
                    0,
                    opts.as_ptr().cast(),
                )
            };
            assert_eq!(rc, 0, "mount tmpfs: {}", io::Error::last_os_error());
            SmallFs(c)
        }
    }

    impl Drop for SmallFs {
        fn drop(&mut self) {
            // SAFETY: umount2(2) of the tmpfs mounted above.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }

    #[test]
    fn disk_full_fails_the_update_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _unmount = SmallFs::mount(dir.path(), c"size=64k");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        s.update::<_, TestErr>(|st| {
            st.volumes.insert("small".into(), spec("small"));
            Ok(())
        })
        .expect("a small update fits");
        let before = std::fs::read(s.path()).expect("read");
        let journal_before = std::fs::read(s.journal_path()).expect("read");
        let r: Result<(), TestErr> = s.update(|st| {
            let mut big = spec("big");
            Arc::make_mut(&mut big)
                .context
                .insert("blob".into(), "x".repeat(200 * 1024));
            st.volumes.insert("big".into(), big);
            Ok(())
        });
        let e = r.expect_err("the disk is full");
        assert!(e.0.contains("failed to write state file"), "{e:?}");
        assert_eq!(std::fs::read(s.path()).expect("read"), before);
        assert_eq!(
            std::fs::read(s.journal_path()).expect("read"),
            journal_before,
            "the part of the line that fitted was not cut off"
        );
        assert!(s.read(|st| !st.volumes.contains_key("big")));
        assert!(!tmp_path(s.path()).exists(), "the temporary file was left");
        // An update that changes nothing is not failed by the earlier batch.
        let r: Result<u32, TestErr> = s.update(|_| Ok(7));
        assert_eq!(r.expect("a no-op update after a failure"), 7);
        // The store still works after the failure.
        s.update::<_, TestErr>(|st| {
            st.volumes.remove("small");
            Ok(())
        })
        .expect("update after a failure");
        assert!(on_disk(s.dir()).volumes.is_empty());
    }

    #[test]
    fn leftover_temporary_file_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
        let tmp = tmp_path(&dir.path().join(STATE_FILE));
        std::fs::write(&tmp, b"torn wri").expect("write");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        assert!(!tmp.exists());
        assert_eq!(s.read(|st| st.schema_version), SCHEMA_VERSION);
    }

    fn put(s: &StateStore, id: &str, blob: usize) {
        s.update::<_, TestErr>(|st| {
            let mut v = spec(id);
            Arc::make_mut(&mut v)
                .context
                .insert("blob".into(), "x".repeat(blob));
            st.volumes.insert(id.into(), v);
            Ok(())
        })
        .expect("update");
    }

    #[test]
    fn changes_are_journal_lines_and_reopening_folds_them_in() {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshot_at_open;
        {
            let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
            snapshot_at_open = std::fs::read(s.path()).expect("read");
            for i in 0..3 {
                put(&s, &format!("v{i}"), 10);
            }
            let ws = s.write_stats();
            assert_eq!((ws.writes, ws.fsyncs, ws.snapshots), (3, 3, 0));
            // The snapshot is untouched; the journal has one line a change.
            assert_eq!(std::fs::read(s.path()).expect("read"), snapshot_at_open);
            let journal = std::fs::read(s.journal_path()).expect("read");
            assert_eq!(journal.iter().filter(|&&b| b == b'\n').count(), 3);
            assert_eq!(ws.bytes, journal.len() as u64);
            assert_eq!(on_disk(dir.path()), s.snapshot());
        }
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
        assert_eq!(s.read(|st| st.volumes.len()), 3);
        // `compact` (a graceful stop) does the same while running.
        put(&s, "v3", 10);
        assert!(std::fs::metadata(s.journal_path()).expect("stat").len() > 0);
        s.compact().expect("compact");
        assert_eq!(std::fs::metadata(s.journal_path()).expect("stat").len(), 0);
        let snap = parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
        assert_eq!(snap, s.snapshot());
        assert_eq!(s.write_stats().snapshots, 1);
        drop(s);
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
        assert_eq!(s.read(|st| st.volumes.len()), 4);
        // Folded in: a new snapshot holds everything, the journal is empty.
        let snap = parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
        assert_eq!(snap, s.snapshot());
        assert_eq!(std::fs::metadata(s.journal_path()).expect("stat").len(), 0);
    }

    #[test]
    fn a_large_journal_is_compacted_into_a_snapshot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        // 100 KiB a change: the journal passes 1 MiB after 11 changes.
        for i in 0..25 {
            put(&s, &format!("v{}", i % 5), 100 * 1024 + i);
        }
        let ws = s.write_stats();
        assert!(ws.snapshots >= 1, "{ws:?}");
        assert!(
            std::fs::metadata(s.journal_path()).expect("stat").len() <= JOURNAL_MIN_COMPACT * 2,
            "the journal kept growing"
        );
        assert_eq!(on_disk(dir.path()), s.snapshot());
        drop(s);
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
        assert_eq!(
            s.read(|st| st.volumes["v4"].context["blob"].len()),
            100 * 1024 + 24
        );
    }

    #[test]
    fn a_corrupt_journal_is_refused_and_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let journal_path;
        {
            let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
            put(&s, "v1", 10);
            put(&s, "v2", 10);
            journal_path = s.journal_path().to_path_buf();
        }
        let snapshot = std::fs::read(dir.path().join(STATE_FILE)).expect("read");
        let mut journal = std::fs::read(&journal_path).expect("read");
        journal[30] ^= 0x20;
        std::fs::write(&journal_path, &journal).expect("write");
        let e = StateStore::open_with_boot_id(dir.path(), "b")
            .err()
            .expect("must refuse");
        let msg = e.to_string();
        assert!(msg.contains(&journal_path.display().to_string()), "{msg}");
        assert!(msg.contains("corrupt at line 1"), "{msg}");
        assert_eq!(std::fs::read(&journal_path).expect("read"), journal);
        assert_eq!(
            std::fs::read(dir.path().join(STATE_FILE)).expect("read"),
            snapshot
        );
        assert!(matches!(
            load_dir(dir.path()),
            Err(StateError::CorruptJournal { line: 1, .. })
        ));
    }

    #[test]
    fn a_torn_last_line_is_left_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
            put(&s, "v1", 10);
            put(&s, "v2", 10);
        }
        let journal_path = dir.path().join(JOURNAL_FILE);
        let journal = std::fs::read(&journal_path).expect("read");
        // Cut the second line in the middle, as a crash during the write.
        let first = journal.iter().position(|&b| b == b'\n').expect("a line") + 1;
        std::fs::write(&journal_path, &journal[..first + 40]).expect("write");
        let loaded = load_dir(dir.path()).expect("load").expect("state");
        assert!(loaded.torn_tail);
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        assert_eq!(
            s.read(|st| st.volumes.keys().cloned().collect::<Vec<_>>()),
            ["v1"]
        );
        assert_eq!(std::fs::metadata(&journal_path).expect("stat").len(), 0);
    }

    #[test]
    fn a_journal_without_its_snapshot_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
            put(&s, "v1", 10);
        }
        std::fs::remove_file(dir.path().join(STATE_FILE)).expect("rm");
        let e = StateStore::open_with_boot_id(dir.path(), "b")
            .err()
            .expect("must refuse");
        assert!(
            matches!(e, StateError::JournalWithoutSnapshot { .. }),
            "{e}"
        );
        assert!(!dir.path().join(STATE_FILE).exists());
    }

    #[test]
    fn a_reader_sees_every_durable_change_while_the_store_compacts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = std::sync::Arc::new(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
        let durable = std::sync::Arc::new(AtomicU64::new(0));
        let writer = {
            let (s, durable) = (s.clone(), durable.clone());
            std::thread::spawn(move || {
                for i in 1..=60u64 {
                    s.update::<_, TestErr>(|st| {
                        let mut v = spec("counter");
                        let m = Arc::make_mut(&mut v);
                        m.context.insert("n".into(), i.to_string());
                        // Big enough to compact every dozen changes.
                        m.context.insert("blob".into(), "x".repeat(90 * 1024));
                        st.volumes.insert("counter".into(), v);
                        Ok(())
                    })
                    .expect("update");
                    durable.store(i, Ordering::SeqCst);
                }
            })
        };
        let mut reads = 0;
        while !writer.is_finished() {
            let floor = durable.load(Ordering::SeqCst);
            let st = on_disk(dir.path());
            let n: u64 = st
                .volumes
                .get("counter")
                .map(|v| v.context["n"].parse().expect("n"))
                .unwrap_or(0);
            assert!(n >= floor, "read {n} after {floor} was durable");
            reads += 1;
        }
        writer.join().expect("writer");
        assert!(s.write_stats().snapshots >= 2, "{:?}", s.write_stats());
        assert!(reads > 0);
        assert_eq!(on_disk(dir.path()), s.snapshot());
    }

    #[test]
    fn a_schema_1_file_is_read_and_written_back_as_schema_2() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(STATE_FILE);
        std::fs::write(
            &path,
            br#"{"schema_version":1,"boot_id":"b","claims":[{"volume_id":"v","alloc_id":"a","node":"n","mode":"write","access_mode":"single-node-writer","state":"taken"}]}"#,
        )
        .expect("write");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        assert_eq!(s.read(|st| st.claims.len()), 1);
        let on_disk = std::fs::read(&path).expect("read");
        let v: serde_json::Value = serde_json::from_slice(&on_disk).expect("json");
        assert_eq!(v["schema_version"], 2);
        assert_eq!(v["claims"][0]["alloc_id"], "a");
        assert!(s.journal_path().exists());
    }

    /// A compaction started by a write folds the state the journal leads
    /// to, not the write's own change: a crash between the new snapshot and
    /// the new journal (simulated by putting the old journal back) then
    /// replays the old journal onto its own end state. Folding the change
    /// instead would bring back a freed claim whose allocation is gone.
    #[test]
    fn a_crash_inside_a_compaction_leaves_a_state_that_was_durable() {
        use crate::claims::{ClaimMode, ClaimState};
        let dir = tempfile::tempdir().expect("tempdir");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        let claim = Claim {
            volume_id: "v".into(),
            alloc_id: "a".into(),
            node: "n".into(),
            mode: ClaimMode::Write,
            access_mode: crate::volumes::AccessMode::SingleNodeWriter,
            external_node_id: None,
            publish_context: BTreeMap::new(),
            state: ClaimState::Taken,
        };
        let record: AllocRecord = serde_json::from_value(serde_json::json!({
            "id": "a", "volumes": {"data": {
                "alias": "data", "volume_id": "v", "plugin_id": "p", "external_volume_id": "x",
                "usage": {"read_only": false, "access_mode": "single-node-writer", "attachment": "file-system"},
                "target_path": "/m/a", "phase": "published"}}
        }))
        .expect("record");
        put(&s, "v", 10);
        s.update::<_, TestErr>(|st| {
            st.claims
                .insert(("v".into(), "a".into()), Arc::new(claim.clone()));
            st.allocs.insert("a".into(), Arc::new(record.clone()));
            Ok(())
        })
        .expect("claim");
        // The allocation and its claim are in the snapshot; from here on the
        // journal holds only changes to them.
        s.compact().expect("compact");
        s.update::<_, TestErr>(|st| {
            st.claim_mut("v", "a").expect("claim").state = ClaimState::Releasing;
            st.alloc_mut("a").expect("a").releasing = true;
            Ok(())
        })
        .expect("mark");
        // Grow the journal past the threshold.
        put(&s, "big", (JOURNAL_MIN_COMPACT + 1024) as usize);
        assert_eq!(s.write_stats().snapshots, 1);
        let before = s.snapshot();
        let old_journal = std::fs::read(s.journal_path()).expect("read");
        // The release's last write: free the claim, drop the allocation.
        s.update::<_, TestErr>(|st| {
            st.claims.remove(&("v".to_string(), "a".to_string()));
            st.allocs.remove("a");
            Ok(())
        })
        .expect("free");
        assert_eq!(s.write_stats().snapshots, 2, "the write compacted");
        let after = s.snapshot();
        assert!(on_disk(dir.path()) == after);
        // The crash: the new snapshot with the old journal still in place.
        std::fs::write(s.journal_path(), &old_journal).expect("put the old journal back");
        let crashed = on_disk(dir.path());
        assert!(
            crashed == before,
            "the state on disk must be one that was durable: claims {:?}, allocations {:?}",
            crashed.claims.keys().collect::<Vec<_>>(),
            crashed.allocs.keys().collect::<Vec<_>>()
        );
        for (volume, alloc) in crashed.claims.keys() {
            assert!(
                crashed.allocs.contains_key(alloc),
                "claim on {volume} held by {alloc}, which has no record"
            );
        }
    }

    /// On a disk with no room for a snapshot but room for a line, a change
    /// that finds the journal due for compaction is appended instead, and
    /// the compaction happens once there is room.
    #[test]
    fn a_full_disk_defers_the_compaction_and_still_appends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _unmount = SmallFs::mount(dir.path(), c"size=4m");
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        // One line past the compaction threshold.
        put(&s, "big", (JOURNAL_MIN_COMPACT + 64 * 1024) as usize);
        assert_eq!(s.write_stats().snapshots, 0);
        // Leave less room than a snapshot needs (about 1.1 MiB), more than a
        // line does.
        let filler = dir.path().join("filler");
        let free = {
            // SAFETY: statvfs(2) into a zeroed struct we own.
            let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
            let c =
                std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
            assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
            st.f_bavail * st.f_frsize
        };
        std::fs::write(&filler, vec![0u8; (free - 256 * 1024) as usize]).expect("filler");
        put(&s, "small", 10);
        assert_eq!(s.write_stats().snapshots, 0, "no room for a snapshot");
        assert!(
            on_disk(dir.path()) == s.snapshot(),
            "the change was appended"
        );
        // With room again, the next change compacts.
        std::fs::remove_file(&filler).expect("rm filler");
        put(&s, "small2", 10);
        assert_eq!(s.write_stats().snapshots, 1);
        assert!(on_disk(dir.path()) == s.snapshot());
        drop(s);
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
        assert_eq!(s.read(|st| st.volumes.len()), 3);
    }
}
