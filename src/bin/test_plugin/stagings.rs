//! `<root>/node.json`: where each volume is staged on this node. The CSI
//! spec says "The CO SHALL ensure that there is only one
//! `staging_target_path` per volume", and real plugins refuse a second one
//! (a device is mounted once); this record lets the test plugin do the same
//! across its own restarts. A record is only a claim: whether the volume is
//! still staged there is decided by the mount table (see `node.rs`), so a
//! reboot or an administrator's umount leaves nothing stale that matters.
//! The file is replaced atomically but not fsync'd: it has to survive the
//! plugin's own crash (tests kill processes, not machines), and a stage
//! costs no disk flush.

use std::collections::BTreeMap;
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

#[derive(Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct NodeState {
    /// volume ID → where it is staged.
    #[serde(default)]
    staged: BTreeMap<String, Staged>,
}

/// The staging records of this node.
pub struct Stagings {
    path: PathBuf,
    /// One read-modify-write of the file at a time.
    lock: Mutex<()>,
}

impl Stagings {
    pub fn new(path: PathBuf) -> Stagings {
        Stagings {
            path,
            lock: Mutex::new(()),
        }
    }

    fn load(&self) -> Result<NodeState, String> {
        match fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("node state {} is invalid: {e}", self.path.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(NodeState::default()),
            Err(e) => Err(format!(
                "cannot read node state {}: {e}",
                self.path.display()
            )),
        }
    }

    fn store(&self, state: &NodeState) -> Result<(), String> {
        let bytes = serde_json::to_vec_pretty(state)
            .map_err(|e| format!("cannot encode node state: {e}"))?;
        write_replace(&self.path, &bytes)
            .map_err(|e| format!("cannot write node state {}: {e}", self.path.display()))
    }

    /// Where the volume is recorded as staged.
    pub fn get(&self, volume_id: &str) -> Result<Option<Staged>, String> {
        let _guard = self.lock.lock();
        Ok(self.load()?.staged.remove(volume_id))
    }

    /// Records the volume as staged (replacing a stale record).
    pub fn set(&self, volume_id: &str, staged: Staged) -> Result<(), String> {
        let _guard = self.lock.lock();
        let mut state = self.load()?;
        if state.staged.get(volume_id) == Some(&staged) {
            return Ok(());
        }
        state.staged.insert(volume_id.to_string(), staged);
        self.store(&state)
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
        let mut state = self.load()?;
        match state.staged.get(volume_id) {
            Some(staged) if is_it(staged) => {
                state.staged.remove(volume_id);
                self.store(&state)
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
        let path = dir.path().join("node.json");
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
        assert_eq!(again.get("v"), Ok(Some(staged)));
        again
            .remove_if("v", |r| r.staging_target_path == Path::new("/s/1"))
            .expect("remove");
        assert_eq!(again.get("v"), Ok(None));
        fs::write(&path, "{").expect("corrupt");
        assert!(again.get("v").is_err());
    }
}
