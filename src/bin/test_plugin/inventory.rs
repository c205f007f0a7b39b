//! What exists in the plugin's "storage system": volumes and nodes. Like a
//! real plugin, the test plugin refuses (NOT_FOUND) a volume or node ID it
//! does not know, so an agent that sends a wrong ID fails loudly instead of
//! getting a fresh, empty volume.
//!
//! A volume exists when `<storage>/volumes/<id>` (a directory) or
//! `<storage>/volumes/<id>.img` (a block image) exists: CreateVolume makes the
//! directory, and a test "creates a volume in the storage system" with
//! mkdir. A node exists when it is this plugin's own node ID or is listed in
//! the `--known-nodes` file (one ID a line), which is re-read on every call
//! so a test can add nodes while the plugin runs.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::plugin::{Failure, Outcome, Plugin};

fn exists(path: &Path) -> Outcome<bool> {
    path.try_exists()
        .map_err(|e| Failure::internal(format!("cannot stat {}: {e}", path.display())))
}

/// The node IDs listed in a known-nodes file: one a line, surrounding
/// blanks trimmed, blank lines and `#` comments skipped. A missing file
/// lists none.
pub fn read_known_nodes(path: &Path) -> Result<Vec<String>, String> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(format!(
                "cannot read the known-nodes file {}: {e}",
                path.display()
            ))
        }
    };
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect())
}

impl Plugin {
    pub fn volumes_dir(&self) -> PathBuf {
        self.config.storage.join("volumes")
    }

    /// Whether the volume exists (see the module comment).
    pub fn volume_exists(&self, id: &str) -> Outcome<bool> {
        let dir = self.volumes_dir().join(id);
        Ok(exists(&dir)? || exists(&self.volumes_dir().join(format!("{id}.img")))?)
    }

    /// NOT_FOUND unless the volume exists.
    pub fn check_volume(&self, id: &str) -> Outcome<()> {
        if self.volume_exists(id)? {
            Ok(())
        } else {
            Err(Failure::not_found(format!("volume {id} does not exist")))
        }
    }

    /// `<root>/volumes/<id>`, made if missing (CreateVolume).
    pub fn create_volume_dir(&self, id: &str) -> Outcome<PathBuf> {
        let dir = self.volumes_dir().join(id);
        fs::create_dir_all(&dir).map_err(|e| {
            Failure::internal(format!("cannot create volume {}: {e}", dir.display()))
        })?;
        Ok(dir)
    }

    /// `<root>/volumes/<id>` of a volume that exists (NOT_FOUND otherwise);
    /// a volume that so far existed only as a block image gets its
    /// directory.
    pub fn volume_dir(&self, id: &str) -> Outcome<PathBuf> {
        self.check_volume(id)?;
        self.create_volume_dir(id)
    }

    /// `<root>/volumes/<id>.img`, the block form of a volume that exists
    /// (NOT_FOUND otherwise), made (1 MiB) if missing.
    pub fn volume_image(&self, id: &str) -> Outcome<PathBuf> {
        self.check_volume(id)?;
        let img = self.volumes_dir().join(format!("{id}.img"));
        let created = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&img)
            .and_then(|f| {
                if f.metadata()?.len() == 0 {
                    f.set_len(1 << 20)?;
                }
                Ok(())
            });
        created.map_err(|e| {
            Failure::internal(format!("cannot create block volume {}: {e}", img.display()))
        })?;
        Ok(img)
    }

    /// NOT_FOUND unless the node is this plugin's own or a known one.
    pub fn check_node(&self, node: &str) -> Outcome<()> {
        if node == self.config.node_id {
            return Ok(());
        }
        let known = match &self.config.known_nodes {
            None => Vec::new(),
            Some(path) => read_known_nodes(path).map_err(Failure::internal)?,
        };
        if known.iter().any(|k| k == node) {
            return Ok(());
        }
        Err(Failure::not_found(format!(
            "node {node} does not exist (known nodes: {})",
            std::iter::once(self.config.node_id.as_str())
                .chain(known.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(",")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_nodes_skip_blanks_and_comments() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("nodes");
        assert_eq!(read_known_nodes(&path), Ok(Vec::new()));
        fs::write(&path, "# cluster\nnode-a\n\n  node-b  \n#node-c\n").expect("write");
        assert_eq!(
            read_known_nodes(&path),
            Ok(vec!["node-a".to_string(), "node-b".to_string()])
        );
        fs::create_dir(dir.path().join("d")).expect("mkdir");
        assert!(read_known_nodes(&dir.path().join("d")).is_err());
    }
}
