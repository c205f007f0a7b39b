//! Per-path and per-volume locks for node operations: calls on different
//! staging and target paths run concurrently; calls that touch a common path
//! (the same target twice, or a publish and the unstage of its staging path)
//! are serialised. A call takes all its paths at once, so two calls can never
//! wait on each other in a cycle. Stage and unstage also hold their volume
//! (taken before any path, never while holding one), so the "one staging
//! path per volume" decision and its mount are one step.

use std::collections::HashSet;
use std::fs;
use std::hash::Hash;
use std::path::{Component, Path, PathBuf};

use parking_lot::{Condvar, Mutex};

/// The set of keys some call holds.
pub struct Locks<K> {
    held: Mutex<HashSet<K>>,
    released: Condvar,
}

/// Locks on staging and target paths.
pub type PathLocks = Locks<PathBuf>;
/// Locks on volume IDs.
pub type VolumeLocks = Locks<String>;

impl<K> Default for Locks<K> {
    fn default() -> Self {
        Locks {
            held: Mutex::new(HashSet::new()),
            released: Condvar::new(),
        }
    }
}

/// Holds a set of keys until dropped.
pub struct Guard<'a, K: Eq + Hash> {
    locks: &'a Locks<K>,
    keys: Vec<K>,
}

/// The name a path is locked under: its parent resolved (symlinks, `.`,
/// doubled slashes) plus its last component, so two spellings of one
/// target share a lock whether or not the target exists yet.
pub fn lock_key(path: &Path) -> PathBuf {
    let lexical: PathBuf = path
        .components()
        .filter(|c| *c != Component::CurDir)
        .collect();
    match (lexical.parent(), lexical.file_name()) {
        (Some(parent), Some(name)) => fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or(lexical),
        _ => lexical,
    }
}

impl<K: Eq + Hash + Ord + Clone> Locks<K> {
    /// Blocks until no other call holds any of `keys`, then holds them all.
    fn lock_keys(&self, mut keys: Vec<K>) -> Guard<'_, K> {
        keys.sort();
        keys.dedup();
        let mut held = self.held.lock();
        while keys.iter().any(|k| held.contains(k)) {
            self.released.wait(&mut held);
        }
        held.extend(keys.iter().cloned());
        Guard { locks: self, keys }
    }
}

impl PathLocks {
    /// Blocks until no other call holds any of `paths`, then holds them all.
    pub fn lock(&self, paths: &[&Path]) -> Guard<'_, PathBuf> {
        self.lock_keys(paths.iter().map(|p| lock_key(p)).collect())
    }
}

impl VolumeLocks {
    /// Blocks until no other call holds the volume, then holds it.
    pub fn lock(&self, volume_id: &str) -> Guard<'_, String> {
        self.lock_keys(vec![volume_id.to_string()])
    }
}

impl<K: Eq + Hash> Drop for Guard<'_, K> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock();
        for k in &self.keys {
            held.remove(k);
        }
        drop(held);
        self.locks.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn different_paths_do_not_block() {
        let locks = PathLocks::default();
        let _a = locks.lock(&[Path::new("/x/a")]);
        let _b = locks.lock(&[Path::new("/x/b"), Path::new("/x/c")]);
    }

    impl PathLocks {
        fn is_free(&self, path: &Path) -> bool {
            !self.held.lock().contains(&lock_key(path))
        }
    }

    #[test]
    fn a_common_path_blocks_until_released() {
        let locks = PathLocks::default();
        let first = locks.lock(&[Path::new("/x/a"), Path::new("/x/b")]);
        assert!(!locks.is_free(Path::new("/x/b")));
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _g = locks.lock(&[Path::new("/x/b"), Path::new("/x/./c")]);
                tx.send(()).expect("send");
            });
            // Whether or not it is waiting yet, the second caller cannot be
            // in, and holds none of its paths (all or nothing).
            assert!(rx.try_recv().is_err());
            assert!(locks.is_free(Path::new("/x/c")));
            drop(first);
            rx.recv().expect("the second caller got its paths");
        });
        assert!(locks.held.lock().is_empty());
    }

    #[test]
    fn spellings_of_one_path_share_a_lock() {
        let dir = tempfile::tempdir().expect("temp dir");
        let a = dir.path().join("t");
        let b = dir.path().join(".").join("t");
        assert_eq!(lock_key(&a), lock_key(&b));
        // One call naming the same path twice does not block itself.
        let locks = PathLocks::default();
        let _g = locks.lock(&[&a, &b]);
    }
}
