//! The snapshot and journal files: reading them back (also without the
//! lock, for `claimd state`), writing a snapshot atomically, starting a new
//! journal.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::StateError;
use super::journal::{self, JOURNAL_FILE};
use super::model::StateFile;
use super::{READABLE_SCHEMAS, SCHEMA_VERSION, STATE_FILE};

pub(super) fn write_snapshot(
    dir: &Path,
    path: &Path,
    state: &StateFile,
) -> Result<u64, StateError> {
    let tmp = tmp_path(path);
    // Streamed to the file, never held whole: with 10,000 allocations the
    // text is about 16 MB, and a buffer that size (grown by doubling) is
    // heap glibc keeps after it is freed.
    let written = write_atomically(dir, &tmp, path, |w| {
        serde_json::to_writer(&mut *w, state).map_err(io::Error::from)?;
        w.write_all(b"\n")
    });
    written.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        StateError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// Replaces the journal with a new empty one (created aside, then renamed
/// over it, so a reader never sees it half-way) and opens it for appends.
pub(super) fn new_journal(dir: &Path, path: &Path) -> Result<File, StateError> {
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

pub(super) fn open_journal_io(path: &Path) -> io::Result<File> {
    OpenOptions::new().append(true).mode(0o600).open(path)
}

pub(super) fn open_journal(path: &Path) -> Result<File, StateError> {
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

pub(super) fn read_err(path: &Path) -> impl Fn(io::Error) -> StateError + '_ {
    move |source| StateError::Read {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads the snapshot and replays the journal. None: neither exists.
/// Changes nothing on disk.
pub(super) fn read_files(path: &Path, journal_path: &Path) -> Result<Option<Loaded>, StateError> {
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

pub(super) fn assemble(
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

pub(super) fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Writes `tmp` through `write`, makes it durable and renames it over
/// `path`; the file's size.
pub(super) fn write_atomically(
    dir: &Path,
    tmp: &Path,
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&mut File>) -> io::Result<()>,
) -> io::Result<u64> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)?;
    let mut w = BufWriter::with_capacity(64 * 1024, &mut f);
    write(&mut w)?;
    w.flush()?;
    drop(w);
    let len = f.metadata()?.len();
    // fdatasync: the data and the size it needs, not the timestamps.
    f.sync_data()?;
    drop(f);
    std::fs::rename(tmp, path)?;
    File::open(dir)?.sync_all()?;
    Ok(len)
}

/// Writes `bytes` to `path` as a whole, or not at all: a temporary file
/// beside it (mode 0600), fdatasync, rename, fsync of the directory. For
/// the small files of the state directory beside the state itself.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    write_atomically(dir, &tmp_path(path), path, |w| w.write_all(bytes)).map(|_| ())
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
