//! File helpers shared by the controller state, the node state and the
//! fault file.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// fsync(2) calls this process made: end lines of the call log carry the
/// count (`fsyncs`), so a bench can tell the plugin's own durable writes
/// per operation.
static FSYNCS: AtomicU64 = AtomicU64::new(0);

/// fsync(2) calls made so far (files and directories).
pub fn fsyncs() -> u64 {
    FSYNCS.load(Ordering::Relaxed)
}

/// fsync(2) of `f` (a file or a directory), counted in `fsyncs`.
pub fn sync(f: &fs::File) -> io::Result<()> {
    FSYNCS.fetch_add(1, Ordering::Relaxed);
    f.sync_all()
}

/// Replaces `path` with `bytes` so that a reader sees either the old or the
/// new content, never a torn one: write a temporary file next to it, sync,
/// rename over.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        sync(&f)?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Replaces `path` with `bytes` so that a reader sees either the old or the
/// new content, without waiting for the disk: what it writes survives the
/// process (killed at any point), not the machine.
pub fn write_replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path);
    let result = fs::write(&tmp, bytes).and_then(|()| fs::rename(&tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}
