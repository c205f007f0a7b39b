//! "Is anything of this volume still mounted here?": asked after every
//! teardown call, on the path itself (openat2 `RESOLVE_NO_XDEV`, with
//! `/proc/self/mountinfo` as the fallback), never by directory existence.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// A path that a teardown call should have unmounted but did not (or that
/// could not be checked).
#[derive(Debug)]
pub enum StillMounted {
    Mounted { path: PathBuf, call: &'static str },
    Unknown { path: PathBuf, source: io::Error },
}

impl fmt::Display for StillMounted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StillMounted::Mounted { path, call } => {
                write!(
                    f,
                    "{call} succeeded but {} is still mounted",
                    path.display()
                )
            }
            StillMounted::Unknown { path, .. } => {
                write!(f, "cannot check that {} is unmounted", path.display())
            }
        }
    }
}

impl std::error::Error for StillMounted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StillMounted::Unknown { source, .. } => Some(source),
            StillMounted::Mounted { .. } => None,
        }
    }
}

/// Ok when nothing is mounted at `path` after `call` said it was done.
pub fn ensure_unmounted(path: &Path, call: &'static str) -> Result<(), StillMounted> {
    match crate::mounts::is_mount_point(path) {
        Ok(false) => Ok(()),
        Ok(true) => Err(StillMounted::Mounted {
            path: path.to_path_buf(),
            call,
        }),
        Err(source) => Err(StillMounted::Unknown {
            path: path.to_path_buf(),
            source,
        }),
    }
}
