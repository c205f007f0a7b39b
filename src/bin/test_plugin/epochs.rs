//! `--epoch-key KEY`: the plugin enforces the CO's fencing token, as
//! storage that keeps a generation number per volume would. The CO puts the
//! claim's epoch under KEY in ControllerPublish's volume context and in the
//! publish context of NodeStage and NodePublish (claimd's
//! `cluster.epoch_plugins`). Every such call must carry an epoch at least as
//! new as the newest one the storage has seen for the volume (kept in
//! `<storage>/epochs/<volume_id>`, shared by every node's plugin): a call
//! under an older claim (a paused node waking up, a request that arrived
//! late) is refused with FAILED_PRECONDITION. The key is taken out of the
//! maps before the other checks (`--require-contexts`), which compare them
//! with what the plugin answered.

use std::collections::HashMap;
use std::path::PathBuf;

use parking_lot::Mutex;

use crate::files::write_atomic;
use crate::plugin::{Failure, Outcome};

pub struct Epochs {
    key: String,
    dir: PathBuf,
    /// Serialises read-compare-write of the newest epoch in this process
    /// (between processes the storage's file is last-writer-wins, which
    /// only ever raises it: every writer writes a value at least as new as
    /// what it read).
    lock: Mutex<()>,
}

impl Epochs {
    pub fn new(key: String, storage: &std::path::Path) -> Epochs {
        Epochs {
            key,
            dir: storage.join("epochs"),
            lock: Mutex::new(()),
        }
    }

    /// Takes the epoch out of `ctx` and checks it against the newest seen
    /// for the volume; a call without the key is not checked.
    pub fn check(
        &self,
        volume_id: &str,
        field: &str,
        ctx: &mut HashMap<String, String>,
    ) -> Outcome<()> {
        let Some(value) = ctx.remove(&self.key) else {
            return Ok(());
        };
        let epoch: i64 = value.parse().ok().filter(|e| *e > 0).ok_or_else(|| {
            Failure::invalid(format!(
                "{field}[{}] = {value:?} is not a positive epoch",
                self.key
            ))
        })?;
        let _guard = self.lock.lock();
        let path = self.dir.join(volume_id);
        let newest = match std::fs::read_to_string(&path) {
            Ok(s) => s.trim().parse::<i64>().map_err(|e| {
                Failure::internal(format!("epoch file {} is damaged: {e}", path.display()))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(Failure::internal(format!("{}: {e}", path.display()))),
        };
        if epoch < newest {
            return Err(Failure::precondition(format!(
                "volume {volume_id}: epoch {epoch} is older than {newest}: a newer claim holds it"
            )));
        }
        if epoch > newest {
            std::fs::create_dir_all(&self.dir)
                .and_then(|()| write_atomic(&path, epoch.to_string().as_bytes()))
                .map_err(|e| Failure::internal(format!("{}: {e}", path.display())))?;
        }
        Ok(())
    }
}
