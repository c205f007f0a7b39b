//! `<root>/staged/<volume>.json`: where each volume is staged on this
//! node, one small file per volume. The CSI spec says "The CO SHALL ensure
//! that there is only one `staging_target_path` per volume", and real
//! plugins refuse a second one (a device is mounted once); these records
//! let the test plugin do the same across its own restarts. A record is
//! only a claim: whether the volume is still staged there is decided by
//! the mount table (see `node.rs`), so a reboot or an administrator's
//! umount leaves nothing stale that matters. A file is replaced atomically
//! but not fsync'd: it has to survive the plugin's own crash (tests kill
//! processes, not machines), and a stage costs no disk flush. One file per
//! volume keeps a call's cost independent of how many volumes the node has
//! staged (a single file of every record was rewritten whole on each stage
//! and unstage: about 1.5 MB with 10,000 volumes, which made the plugin,
//! not the agent, the cost that grew in claimd's benchmarks).

use std::fs;
use std::io;
use std::path::PathBuf;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::files::write_replace;

/// One volume's staging.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staged {
    pub staging_target_path: PathBuf,
    /// Block volumes stage nothing: their record is all there is.
    pub block: bool,
}

/// The staging records of this node.
pub struct Stagings {
    dir: PathBuf,
    /// One read-modify-write of a record at a time.
    lock: Mutex<()>,
}

impl Stagings {
    /// Records kept in `dir` (made on the first record).
    pub fn new(dir: PathBuf) -> Stagings {
        Stagings {
            dir,
            lock: Mutex::new(()),
        }
    }

    /// The record's file: the volume ID hex-encoded, so that no ID can
    /// name another path.
    fn path(&self, volume_id: &str) -> PathBuf {
        let name: String = volume_id.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{name}.json"))
    }

    fn load(&self, volume_id: &str) -> Result<Option<Staged>, String> {
        let path = self.path(volume_id);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| format!("staging record {} is invalid: {e}", path.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!(
                "cannot read staging record {}: {e}",
                path.display()
            )),
        }
    }

    /// Where the volume is recorded as staged.
    pub fn get(&self, volume_id: &str) -> Result<Option<Staged>, String> {
        let _guard = self.lock.lock();
        self.load(volume_id)
    }

    /// Records the volume as staged (replacing a stale record).
    pub fn set(&self, volume_id: &str, staged: Staged) -> Result<(), String> {
        let _guard = self.lock.lock();
        if self.load(volume_id)?.as_ref() == Some(&staged) {
            return Ok(());
        }
        let bytes = serde_json::to_vec_pretty(&staged)
            .map_err(|e| format!("cannot encode a staging record: {e}"))?;
        fs::create_dir_all(&self.dir)
            .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let path = self.path(volume_id);
        write_replace(&path, &bytes)
            .map_err(|e| format!("cannot write staging record {}: {e}", path.display()))
    }

    /// Drops the volume's record if `is_it` says it names the path just
    /// unstaged (a record of another path stays: the volume is still
    /// staged there).
    pub fn remove_if(
        &self,
        volume_id: &str,
        is_it: impl FnOnce(&Staged) -> bool,
    ) -> Result<(), String> {
        let _guard = self.lock.lock();
        match self.load(volume_id)? {
            Some(staged) if is_it(&staged) => {
                let path = self.path(volume_id);
                match fs::remove_file(&path) {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(format!(
                        "cannot remove staging record {}: {e}",
                        path.display()
                    )),
                }
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn records_survive_a_new_instance_and_only_their_path_removes_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("staged");
        let s = Stagings::new(path.clone());
        assert_eq!(s.get("v"), Ok(None));
        let staged = Staged {
            staging_target_path: PathBuf::from("/s/1"),
            block: false,
        };
        s.set("v", staged.clone()).expect("set");
        let again = Stagings::new(path.clone());
        assert_eq!(again.get("v"), Ok(Some(staged.clone())));
        again
            .remove_if("v", |r| r.staging_target_path == Path::new("/s/2"))
            .expect("remove another path");
        assert_eq!(again.get("v"), Ok(Some(staged.clone())));
        again
            .remove_if("v", |r| r.staging_target_path == Path::new("/s/1"))
            .expect("remove");
        assert_eq!(again.get("v"), Ok(None));
        assert!(fs::read_dir(&path).expect("the records").next().is_none());
        // Another volume's record is its own file; a corrupt one fails
        // only its volume.
        again.set("w", staged.clone()).expect("set w");
        fs::write(path.join("77.json"), "{").expect("corrupt w's record");
        assert!(again.get("w").is_err());
        assert_eq!(again.get("v"), Ok(None));
        // An ID cannot name a path outside the records.
        again.set("../x", staged).expect("set ../x");
        assert!(path.join("2e2e2f78.json").is_file());
    }
}
