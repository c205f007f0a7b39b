//! `controller.json` with group commit: every controller call decides on
//! the latest state under one mutex (so the single-node, attachment-limit
//! and idempotency checks see every earlier change), but the fsync'd
//! rewrites of concurrent calls are shared: while one call writes, the
//! changes of the others pile up and the next writer makes the whole pile
//! durable in one rewrite. A call answers only once its change (or, when it
//! changed nothing, every change it may have read) is on disk.
//!
//! When nothing is pending the file is re-read on every call, so a test
//! that edits or deletes it between calls is seen at once.
//!
//! The group commit itself is the state store's:
//! `claimd::state::group_commit`.
//!
//! A storage shared by several plugin processes (`--storage` other than
//! `--root`) may have more than one writer (a node's NodeExpandVolume
//! records a capacity; a restarted controller overlaps a dying one): there
//! every change takes an exclusive flock of `<file>.lock` around re-reading,
//! deciding and writing, so no process overwrites another's change. That
//! serialises the changes of one process too (no shared fsyncs): the price
//! of several writers, paid only with a shared storage.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use claimd::state::group_commit::GroupCommit;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::files::write_atomic;

/// A JSON document written atomically, with group commit.
pub struct Store<S> {
    path: PathBuf,
    /// What is on disk as far as this process knows (refreshed from the
    /// file whenever nothing is pending), and the changes waiting for
    /// their write.
    state: GroupCommit<S>,
    /// `<file>.lock`, flocked around each change, when other processes
    /// may write the file too.
    cross_process: Option<PathBuf>,
}

/// An exclusive flock, released when dropped (the file is closed).
struct FileLock {
    _file: fs::File,
}

impl FileLock {
    fn exclusive(path: &Path) -> Result<FileLock, String> {
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| format!("cannot open lock file {}: {e}", path.display()))?;
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(FileLock { _file: f });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(format!("cannot lock {}: {e}", path.display()));
            }
        }
    }
}

pub type ControllerStore = Store<crate::controller::ControllerState>;

fn load<S: DeserializeOwned + Default>(path: &Path) -> Result<S, String> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| format!("controller state {} is invalid: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(S::default()),
        Err(e) => Err(format!(
            "cannot read controller state {}: {e}",
            path.display()
        )),
    }
}

impl<S> Store<S>
where
    S: Clone + PartialEq + Default + Serialize + DeserializeOwned,
{
    /// A store only this process writes.
    pub fn new(path: PathBuf) -> Store<S> {
        Store {
            path,
            state: GroupCommit::new(S::default()),
            cross_process: None,
        }
    }

    /// A store that other processes may write too (a shared storage).
    pub fn shared(path: PathBuf) -> Store<S> {
        let mut lock = path.clone().into_os_string();
        lock.push(".lock");
        Store {
            cross_process: Some(PathBuf::from(lock)),
            ..Store::new(path)
        }
    }

    /// Runs `f` on the durable state (read from the file unless a write is
    /// in flight, when the file may still be the old one).
    pub fn read<R>(&self, f: impl FnOnce(&S) -> R) -> Result<R, String> {
        self.state.refresh(|| load(&self.path))?;
        Ok(self.state.read(f))
    }

    /// Applies `f` to a copy of the latest state (durable or pending).
    /// When `f` fails nothing changes. Otherwise returns once the change,
    /// or when `f` changed nothing the pending changes it may have based
    /// its answer on, is durable; a failed write is an error for every
    /// change of its batch and for those applied on top of it.
    pub fn update<R, E: From<String>>(
        &self,
        f: impl FnOnce(&mut S) -> Result<R, E>,
    ) -> Result<R, E> {
        // Held until the change is written: under it, nothing of this
        // process is pending, so the refresh reads the latest file.
        let _other_writers = match &self.cross_process {
            Some(lock) => Some(FileLock::exclusive(lock)?),
            None => None,
        };
        self.state.refresh(|| load(&self.path))?;
        self.state.update(f, |_, batch| self.write(batch), E::from)
    }

    fn write(&self, state: &S) -> Result<(), String> {
        let bytes = serde_json::to_vec_pretty(state)
            .map_err(|e| format!("cannot encode controller state: {e}"))?;
        write_atomic(&self.path, &bytes)
            .map_err(|e| format!("cannot write controller state {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    type Map = BTreeMap<String, u32>;

    fn store() -> (tempfile::TempDir, Arc<Store<Map>>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let s = Store::new(dir.path().join("state.json"));
        (dir, Arc::new(s))
    }

    fn on_disk(s: &Store<Map>) -> Map {
        serde_json::from_slice(&fs::read(&s.path).expect("read")).expect("parse")
    }

    #[test]
    fn concurrent_updates_are_all_durable_and_decided_in_order() {
        let (_dir, s) = store();
        std::thread::scope(|scope| {
            for t in 0..8 {
                let s = &s;
                scope.spawn(move || {
                    for i in 0..25 {
                        s.update(|m: &mut Map| -> Result<(), String> {
                            m.insert(format!("{t}-{i}"), i);
                            // A counter every change reads and bumps: a lost
                            // or reordered decision would show.
                            *m.entry("count".into()).or_default() += 1;
                            Ok(())
                        })
                        .expect("update");
                    }
                });
            }
        });
        let m = on_disk(&s);
        assert_eq!(m.len(), 8 * 25 + 1);
        assert_eq!(m["count"], 8 * 25);
    }

    #[test]
    fn shared_stores_of_two_processes_lose_no_change() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("state.json");
        // Two stores on one file stand for two processes: each has its own
        // view and its own group commit, as separate processes would.
        let stores = [
            Arc::new(Store::<Map>::shared(path.clone())),
            Arc::new(Store::<Map>::shared(path.clone())),
        ];
        std::thread::scope(|scope| {
            for (t, s) in stores.iter().enumerate() {
                for i in 0..4 {
                    let s = Arc::clone(s);
                    scope.spawn(move || {
                        for j in 0..10 {
                            s.update(|m: &mut Map| -> Result<(), String> {
                                m.insert(format!("{t}-{i}-{j}"), j);
                                *m.entry("count".into()).or_default() += 1;
                                Ok(())
                            })
                            .expect("update");
                        }
                    });
                }
            }
        });
        let m = on_disk(&stores[0]);
        assert_eq!(m["count"], 2 * 4 * 10);
        assert_eq!(m.len(), 2 * 4 * 10 + 1);
    }

    #[test]
    fn failed_decision_changes_nothing() {
        let (_dir, s) = store();
        s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("a".into(), 1);
            Ok(())
        })
        .expect("update");
        let r = s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("b".into(), 2);
            Err("refused".into())
        });
        assert_eq!(r, Err("refused".to_string()));
        assert_eq!(on_disk(&s), Map::from([("a".into(), 1)]));
    }

    #[test]
    fn edits_and_deletion_between_calls_are_seen() {
        let (_dir, s) = store();
        s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("a".into(), 1);
            Ok(())
        })
        .expect("update");
        fs::write(&s.path, r#"{"b": 2}"#).expect("edit");
        assert_eq!(
            s.read(|m| m.clone()).expect("read"),
            Map::from([("b".into(), 2)])
        );
        fs::remove_file(&s.path).expect("delete");
        assert_eq!(s.read(|m| m.len()).expect("read"), 0);
        fs::write(&s.path, "{").expect("corrupt");
        assert!(s.read(|m| m.len()).is_err());
    }

    #[test]
    fn failed_write_fails_the_change_and_keeps_the_file() {
        let (dir, s) = store();
        s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("a".into(), 1);
            Ok(())
        })
        .expect("update");
        // A directory where the temporary file goes makes the write fail.
        let tmp = dir
            .path()
            .join(format!("state.json.tmp-{}", std::process::id()));
        fs::create_dir(&tmp).expect("block the temporary file");
        let r = s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("b".into(), 2);
            Ok(())
        });
        let err = r.expect_err("the write fails");
        assert!(err.starts_with("cannot write controller state"), "{err}");
        fs::remove_dir(&tmp).expect("unblock");
        assert_eq!(on_disk(&s), Map::from([("a".into(), 1)]));
        assert_eq!(
            s.read(|m| m.clone()).expect("read"),
            Map::from([("a".into(), 1)])
        );
        // The failure was that change's: a call that changes nothing, then
        // one that changes something, succeed.
        assert_eq!(s.update(|m: &mut Map| Ok::<_, String>(m.len())), Ok(1));
        s.update(|m: &mut Map| -> Result<(), String> {
            m.insert("c".into(), 3);
            Ok(())
        })
        .expect("update");
        assert_eq!(on_disk(&s), Map::from([("a".into(), 1), ("c".into(), 3)]));
    }
}
