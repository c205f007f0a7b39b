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
//!
//! Files: `model` (what is recorded), `store` (the store: its writes and
//! compaction), `group_commit` (sharing one durable write among concurrent
//! changes), `files` (reading and writing the snapshot and journal files),
//! `journal` (the journal's line format), `usage` (usage counting over
//! the records), `index` (the records by volume, for those questions),
//! `shared_map` (the chunked maps records are kept in, so an
//! update copies one chunk, not every record), `error`.

mod error;
mod files;
pub mod group_commit;
mod index;
pub mod journal;
mod model;
mod shared_map;
mod store;
#[cfg(test)]
mod tests;
pub mod usage;

pub use error::{current_boot_id, StateError};
pub use files::{load_dir, parse_state, write_file_atomically, Loaded};
pub use model::*;
pub use store::{StateStore, WriteStats, JOURNAL_MIN_COMPACT};

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
