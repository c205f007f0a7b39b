//! The state file: one JSON document under the state directory, rewritten
//! atomically (temporary file in the same directory, fsync, rename, fsync
//! of the directory), mode 0600. A file that does not parse, or has a schema
//! version this build does not know, stops the agent with an error naming
//! it; it is never overwritten.
//!
//! Write-ahead: every allocation volume record carries a phase; an in-flight
//! phase is made durable before its CSI call is sent, so a restart knows
//! which calls may have happened.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};

use crate::claims::Claim;
use crate::volumes::{Usage, VolumeSpec};

pub const SCHEMA_VERSION: u32 = 1;
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
    /// Alias -> volume.
    pub volumes: BTreeMap<String, AllocVolume>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    pub schema_version: u32,
    /// Boot ID of the kernel this state was last converged on.
    pub boot_id: String,
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeSpec>,
    #[serde(default)]
    pub claims: Vec<Claim>,
    #[serde(default)]
    pub allocs: BTreeMap<String, AllocRecord>,
}

impl StateFile {
    pub fn new(boot_id: &str) -> StateFile {
        StateFile {
            schema_version: SCHEMA_VERSION,
            boot_id: boot_id.to_string(),
            volumes: BTreeMap::new(),
            claims: Vec::new(),
            allocs: BTreeMap::new(),
        }
    }

    /// Every (alloc, alias, record), in order.
    pub fn alloc_volumes(&self) -> impl Iterator<Item = (&AllocRecord, &AllocVolume)> {
        self.allocs
            .values()
            .flat_map(|a| a.volumes.values().map(move |v| (a, v)))
    }

    pub fn volume_mut(&mut self, alloc: &str, alias: &str) -> Option<&mut AllocVolume> {
        self.allocs.get_mut(alloc)?.volumes.get_mut(alias)
    }

    pub fn volume(&self, alloc: &str, alias: &str) -> Option<&AllocVolume> {
        self.allocs.get(alloc)?.volumes.get(alias)
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
            StateError::UnknownVersion { path, found } => write!(
                f,
                "state file {} has schema version {found}, which this claimd (schema {SCHEMA_VERSION}) does not know; refusing to start and leaving it untouched",
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
            StateError::Locked { .. } | StateError::UnknownVersion { .. } => None,
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
/// atomic rewrite. Sequence numbers tell each updater when its change is on
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

/// The state file and its in-memory copy. Every change goes through
/// `update`, which holds the lock for the whole read-modify-write and
/// returns only once the change is durable; readers see only durable state.
pub struct StateStore {
    dir: PathBuf,
    path: PathBuf,
    state: Mutex<Commit>,
    durable_changed: Condvar,
    /// Boot ID recorded in the file at open.
    recorded_boot_id: String,
    boot_id: String,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    _lock: File,
}

impl StateStore {
    /// Locks the directory and loads the state file (or starts a new one).
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
        // A temporary file left by a crash mid-write is never authoritative.
        let _ = std::fs::remove_file(tmp_path(&path));
        let (state, fresh) = match std::fs::read(&path) {
            Ok(bytes) => (parse_state(&path, &bytes)?, false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => (StateFile::new(boot_id), true),
            Err(source) => return Err(StateError::Read { path, source }),
        };
        let recorded_boot_id = state.boot_id.clone();
        let store = StateStore {
            dir: dir.to_path_buf(),
            path,
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
            recorded_boot_id,
            boot_id: boot_id.to_string(),
            writes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            _lock: lock,
        };
        if fresh {
            let s = store.state.lock().committed.clone();
            store.write(&s)?;
        } else if let Ok(meta) = std::fs::metadata(&store.path) {
            if meta.permissions().mode() & 0o077 != 0 {
                log::warn!(
                    "state file {} was readable by others; setting mode 0600",
                    store.path.display()
                );
                let _ =
                    std::fs::set_permissions(&store.path, std::fs::Permissions::from_mode(0o600));
            }
        }
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
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
        let writes = self.writes.load(Ordering::Relaxed);
        WriteStats {
            writes,
            bytes: self.bytes_written.load(Ordering::Relaxed),
            // Each atomic rewrite: fdatasync of the file, fsync of the
            // directory.
            fsyncs: writes * 2,
            snapshots: writes,
        }
    }

    /// Reads the durable state.
    pub fn read<R>(&self, f: impl FnOnce(&StateFile) -> R) -> R {
        f(&self.state.lock().committed)
    }

    pub fn snapshot(&self) -> StateFile {
        self.state.lock().committed.clone()
    }

    /// Applies `f` to a copy of the latest state; when it succeeds and
    /// changed something, returns once the change is durable. Concurrent
    /// updates are written together in one atomic rewrite (group commit).
    /// A failed write fails every change of its batch (and those applied on
    /// top of it) and leaves the file and the durable state as they were.
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
        } else {
            g.applied
        };
        loop {
            if g.durable >= mine {
                return Ok(r);
            }
            if g.failed >= mine {
                return Err(StateError::Write {
                    path: self.path.clone(),
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
            let upto = g.applied;
            g.writing = true;
            let res = MutexGuard::unlocked(&mut g, || self.write(&batch));
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

    fn write(&self, state: &StateFile) -> Result<(), StateError> {
        let mut bytes = serde_json::to_vec(state).map_err(|e| StateError::Write {
            path: self.path.clone(),
            source: io::Error::other(e),
        })?;
        bytes.push(b'\n');
        let tmp = tmp_path(&self.path);
        let res = write_atomically(&self.dir, &tmp, &self.path, &bytes);
        if let Err(source) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(StateError::Write {
                path: self.path.clone(),
                source,
            });
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }
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
    if v.schema_version != serde_json::json!(SCHEMA_VERSION) {
        return Err(StateError::UnknownVersion {
            path: path.to_path_buf(),
            found: v.schema_version.to_string(),
        });
    }
    serde_json::from_slice(bytes).map_err(|source| StateError::Corrupt {
        path: path.to_path_buf(),
        source,
    })
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

    fn spec(id: &str) -> VolumeSpec {
        serde_json::from_value(serde_json::json!({
            "id": id, "plugin_id": "p", "external_id": "x",
            "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"],
            "secrets": {"token": "s3cret"}
        }))
        .expect("spec")
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
            assert_eq!(s.write_stats().writes, 2); // creation + update
                                                   // A no-op update writes nothing.
            s.update::<_, TestErr>(|_| Ok(())).expect("noop");
            assert_eq!(s.write_stats().writes, 2);
        }
        let mode = std::fs::metadata(dir.path().join(STATE_FILE))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
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
                    let on_disk = parse_state(s.path(), &std::fs::read(s.path()).expect("read"))
                        .expect("parse");
                    assert!(on_disk.volumes.contains_key(&format!("v{i}")));
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        let on_disk =
            parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
        assert_eq!(on_disk.volumes.len(), 40);
        assert_eq!(s.snapshot(), on_disk);
        let writes = s.write_stats().writes;
        assert!((2..=41).contains(&writes), "{writes} writes");
    }

    #[test]
    fn disk_full_fails_the_update_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
        let (fs, opts) = (c"tmpfs", c"size=64k");
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
        struct Unmount(std::ffi::CString);
        impl Drop for Unmount {
            fn drop(&mut self) {
                // SAFETY: umount2(2) of the tmpfs mounted above.
                unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
            }
        }
        let _unmount = Unmount(c.clone());
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        s.update::<_, TestErr>(|st| {
            st.volumes.insert("small".into(), spec("small"));
            Ok(())
        })
        .expect("a small update fits");
        let before = std::fs::read(s.path()).expect("read");
        let r: Result<(), TestErr> = s.update(|st| {
            let mut big = spec("big");
            big.context.insert("blob".into(), "x".repeat(200 * 1024));
            st.volumes.insert("big".into(), big);
            Ok(())
        });
        let e = r.expect_err("the disk is full");
        assert!(e.0.contains("failed to write state file"), "{e:?}");
        assert_eq!(std::fs::read(s.path()).expect("read"), before);
        assert!(s.read(|st| !st.volumes.contains_key("big")));
        assert!(!tmp_path(s.path()).exists(), "the temporary file was left");
        // The store still works after the failure.
        s.update::<_, TestErr>(|st| {
            st.volumes.remove("small");
            Ok(())
        })
        .expect("update after a failure");
        let on_disk =
            parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
        assert!(on_disk.volumes.is_empty());
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
}
