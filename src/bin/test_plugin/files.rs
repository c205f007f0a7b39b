//! File helpers shared by the controller state, the node state and the
//! fault file.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Replaces `path` with `bytes` so that a reader sees either the old or the
/// new content, never a torn one: write a temporary file next to it, sync,
/// rename over.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
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
