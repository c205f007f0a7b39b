//! Errors of the state store.

use std::fmt;
use std::io;
use std::path::PathBuf;

use super::{BOOT_ID_PATH, READABLE_SCHEMAS, SCHEMA_VERSION};

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
