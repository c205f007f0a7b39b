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

/// NodePublishVolume answered OK, yet nothing is mounted at its target in
/// this agent's mount namespace (or that cannot be checked).
#[derive(Debug)]
pub enum NotMounted {
    Missing { path: PathBuf },
    Unknown { path: PathBuf, source: io::Error },
}

impl fmt::Display for NotMounted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotMounted::Missing { path } => write!(
                f,
                "NodePublishVolume answered OK but nothing is mounted at {} where claimd and the workload look: the plugin mounted it in another mount namespace (a node plugin in a container needs the mount root bind-mounted with rshared propagation; manual: getting-started.md, \"Mount propagation\")",
                path.display()
            ),
            NotMounted::Unknown { path, .. } => {
                write!(f, "cannot check that {} is mounted", path.display())
            }
        }
    }
}

impl std::error::Error for NotMounted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NotMounted::Unknown { source, .. } => Some(source),
            NotMounted::Missing { .. } => None,
        }
    }
}

/// Ok when something is mounted at `path`, the target NodePublishVolume
/// said it published to (for a block volume, a block device node there
/// counts too: the spec has the plugin "place the block device at
/// target_path", which some plugins do with mknod). A plugin whose mount
/// stays in its own namespace answers OK and leaves an empty directory of
/// the node's disk, where the workload's writes would land unseen by
/// anything else.
pub fn ensure_mounted(path: &Path, block: bool) -> Result<(), NotMounted> {
    use std::os::unix::fs::FileTypeExt;
    match crate::mounts::is_mount_point(path) {
        Ok(true) => Ok(()),
        Ok(false)
            if block
                && std::fs::symlink_metadata(path)
                    .is_ok_and(|m| m.file_type().is_block_device()) =>
        {
            Ok(())
        }
        Ok(false) => Err(NotMounted::Missing {
            path: path.to_path_buf(),
        }),
        Err(source) => Err(NotMounted::Unknown {
            path: path.to_path_buf(),
            source,
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty directory is no publish; a block device node placed at a
    /// block volume's target is (the spec lets a plugin mknod it), a file
    /// system volume's is not.
    #[test]
    fn a_target_counts_as_published_when_mounted_or_a_block_device_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).expect("mkdir");
        assert!(matches!(
            ensure_mounted(&empty, false),
            Err(NotMounted::Missing { .. })
        ));
        assert!(matches!(
            ensure_mounted(&empty, true),
            Err(NotMounted::Missing { .. })
        ));
        let node = dir.path().join("dev");
        let c = std::ffi::CString::new(node.to_str().expect("UTF-8")).expect("no NUL");
        // SAFETY: mknod(2) of a NUL-terminated path (loop0's numbers); no
        // device is opened.
        let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, libc::makedev(7, 0)) };
        // The suite runs as root (real mounts): mknod is allowed.
        assert_eq!(r, 0, "mknod: {}", io::Error::last_os_error());
        assert!(ensure_mounted(&node, true).is_ok());
        assert!(matches!(
            ensure_mounted(&node, false),
            Err(NotMounted::Missing { .. })
        ));
    }
}
