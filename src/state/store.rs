//! The state store: the in-memory state, its group commit into journal
//! lines, and compaction into a new snapshot.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::error::{current_boot_id, StateError};
use super::files::{new_journal, open_journal, read_files, tmp_path, write_snapshot};
use super::group_commit::GroupCommit;
use super::journal::{self, Delta, JOURNAL_FILE};
use super::model::StateFile;
use super::{LOCK_FILE, STATE_FILE};

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
/// once the change is durable, or `update_closing` (an operation's last
/// write, which recovery would redo from its durable intent), which
/// returns once readers see it and is written with the next write; readers
/// see durable state and closing changes, never a change whose caller
/// still waits for its write.
pub struct StateStore {
    dir: PathBuf,
    path: PathBuf,
    journal_path: PathBuf,
    /// The durable state and the changes waiting for their write.
    state: GroupCommit<StateFile>,
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
            state: GroupCommit::new(state.indexed()),
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

    /// Operations in flight, as the owner counts them: the writer of a
    /// change waits a little for company when many are (see
    /// `GroupCommit::set_company`). `busy` must not use the store.
    pub fn set_company(&self, busy: impl Fn() -> usize + Send + Sync + 'static) {
        self.state.set_company(busy);
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

    /// Reads the state: durable, plus closing changes waiting for their
    /// write.
    pub fn read<R>(&self, f: impl FnOnce(&StateFile) -> R) -> R {
        self.state.read(f)
    }

    /// A copy of what `read` sees (records are shared, not copied).
    pub fn snapshot(&self) -> StateFile {
        self.state.read(StateFile::clone)
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
        self.state.update(
            reindexed(f),
            |old, batch| self.persist(old, batch).map_err(|e| crate::error_chain(&e)),
            |failure| {
                StateError::Write {
                    path: self.journal_path.clone(),
                    source: io::Error::other(failure),
                }
                .into()
            },
        )
    }

    /// A closing change (the last write of an operation whose intent is
    /// durable, which recovery would redo from that intent): applied like
    /// `update` and seen by readers when this returns, but made durable by
    /// the next write of any change or by `flush`, not before the caller
    /// goes on. See `GroupCommit::update_closing`.
    pub fn update_closing<R, E: From<StateError>>(
        &self,
        f: impl FnOnce(&mut StateFile) -> Result<R, E>,
    ) -> Result<R, E> {
        self.state.update_closing(reindexed(f), |failure| {
            StateError::Write {
                path: self.journal_path.clone(),
                source: io::Error::other(failure),
            }
            .into()
        })
    }

    /// Makes every change applied so far durable (closing ones included).
    pub fn flush(&self) -> Result<(), StateError> {
        self.state
            .flush(|old, batch| self.persist(old, batch).map_err(|e| crate::error_chain(&e)))
            .map_err(|failure| StateError::Write {
                path: self.journal_path.clone(),
                source: io::Error::other(failure),
            })
    }

    /// Changes applied but not durable yet: closing changes waiting for the
    /// next write (0 once they are all on disk).
    pub fn undurable_changes(&self) -> u64 {
        self.state.undurable()
    }

    /// Waits up to `timeout` until a closing change waits for its write,
    /// unless `stop()`; whether one waits (for the flusher of closing
    /// changes). `wake_flusher` ends the wait early.
    pub fn wait_closing(&self, timeout: std::time::Duration, stop: impl Fn() -> bool) -> bool {
        self.state.wait_closing(timeout, stop)
    }

    pub fn wake_flusher(&self) {
        self.state.wake();
    }

    /// Folds the journal into a new snapshot now (on a graceful stop), so
    /// that `state.json` alone holds the whole state. Writes the changes
    /// still waiting for their write first (closing changes), waits for a
    /// write in progress; does nothing when the journal is empty or changes
    /// are still waiting for their writer (it will write them).
    pub fn compact(&self) -> Result<(), StateError> {
        self.flush()?;
        self.state
            .exclusive(|state| {
                let mut j = self.journal.lock();
                if j.len == 0 && !j.broken {
                    return Ok(());
                }
                self.compact_into(&mut j, state)
            })
            .unwrap_or(Ok(()))
    }

    /// Makes `new` durable, `old` being what is durable now: one journal
    /// line, or a new snapshot and journal when the journal has grown large
    /// (or an append failed part-way).
    fn persist(&self, old: &StateFile, new: &StateFile) -> Result<(), StateError> {
        let started = std::time::Instant::now();
        let r = self.persist_timed(old, new);
        crate::metrics::STATE_WRITE_SECONDS.observe(&[], started.elapsed().as_secs_f64());
        r
    }

    fn persist_timed(&self, old: &StateFile, new: &StateFile) -> Result<(), StateError> {
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

/// `f`, then the record index brought along with what it changed.
fn reindexed<R, E>(
    f: impl FnOnce(&mut StateFile) -> Result<R, E>,
) -> impl FnOnce(&mut StateFile) -> Result<R, E> {
    move |s| {
        let before = s.allocs.clone();
        let r = f(s)?;
        s.reindex_from(&before);
        Ok(r)
    }
}
