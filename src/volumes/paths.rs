//! Where things live under the mount root.

use std::path::{Path, PathBuf};

use super::spec::Usage;

/// The path layout under the mount root.
#[derive(Clone, Debug)]
pub struct Paths {
    pub mount_root: PathBuf,
}

impl Paths {
    pub fn new(mount_root: &Path) -> Paths {
        Paths {
            mount_root: mount_root.to_path_buf(),
        }
    }

    /// `<root>/staging/<plugin>/<volume>`: one staging path per volume on
    /// a node, whatever the allocations using it ask for (the CSI spec: "The
    /// CO SHALL ensure that there is only one staging_target_path per
    /// volume"); read-only is asked at NodePublish. Releases before 0.2 put
    /// the usage below it (`…/<volume>/<usage>`); such records keep their
    /// recorded path, and new users of the volume share it.
    pub fn staging(&self, plugin_id: &str, volume_id: &str) -> PathBuf {
        self.mount_root
            .join("staging")
            .join(plugin_id)
            .join(volume_id)
    }

    /// `<root>/per-alloc/<alloc>/<volume>/<usage>`
    pub fn target(&self, alloc_id: &str, volume_id: &str, usage: &Usage) -> PathBuf {
        self.mount_root
            .join("per-alloc")
            .join(alloc_id)
            .join(volume_id)
            .join(usage.dir_name())
    }

    /// Removes `path`'s empty parents up to (not including) the mount root's
    /// `staging` / `per-alloc` directories. Never removes anything that is
    /// not empty.
    pub fn remove_empty_parents(&self, path: &Path) {
        let stops = [
            self.mount_root.clone(),
            self.mount_root.join("staging"),
            self.mount_root.join("per-alloc"),
        ];
        let mut cur = path.parent();
        while let Some(dir) = cur {
            if !dir.starts_with(&self.mount_root) || stops.iter().any(|s| s == dir) {
                break;
            }
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
            cur = dir.parent();
        }
    }
}
