//! The record index (`RecordIndex`, kept in `model` beside the state it
//! indexes): which allocations have a record of a volume, and which have
//! a record at a staging path, so the usage checks (`usage`) read the few
//! records of one volume instead of every record on the node (with 10,000
//! on record a mount asks several of them).
//!
//! Derived from the records and never written: the files hold the records
//! only. An index describes one allocation map, named by identity
//! (`MapId`), and is used only for that map: a map changed since (or read
//! from the files, or built by hand) is not the one it names, and the
//! questions scan every record instead, as they always did. The store
//! brings the index along with each update from the records that changed
//! (`StateFile::reindex_from`), so a live state always has one. In debug
//! builds (the test suite) every indexed answer is checked against the
//! scan.

use std::path::Path;

use super::model::{key_hash, AllocRecord, AllocVolume, StateFile};
use super::shared_map::SharedMap;

type Allocs = SharedMap<String, AllocRecord>;

type Found<'a> = Vec<(&'a AllocRecord, &'a AllocVolume)>;

impl StateFile {
    /// After an update changed this state (it started as a copy of a state
    /// whose allocations were `before`): brings the index along.
    pub fn reindex_from(&mut self, before: &Allocs) {
        self.index.update(before, &self.allocs);
    }

    /// This state with an index of all its records (for a state read from
    /// the files).
    pub fn indexed(mut self) -> StateFile {
        self.index.update(&Allocs::default(), &self.allocs);
        self
    }

    /// Every (alloc, record) of `volume_id`, in order.
    pub fn records_of_volume(&self, volume_id: &str) -> Found<'_> {
        let scan = || -> Found<'_> {
            self.alloc_volumes()
                .filter(|(_, v)| v.volume_id == volume_id)
                .collect()
        };
        if !self.index.describes(&self.allocs) {
            return scan();
        }
        let vh = key_hash(volume_id.as_bytes());
        let mut found: Found<'_> = self
            .index
            .by_volume
            .range_from((vh, 0))
            .take_while(|((h, _), _)| *h == vh)
            .flat_map(|(_, a)| {
                a.volumes
                    .values()
                    .filter(|v| v.volume_id == volume_id)
                    .map(move |v| (&**a, &**v))
            })
            .collect();
        in_order(&mut found);
        debug_assert!(
            same(&found, &scan()),
            "the record index disagrees with the records on volume {volume_id}"
        );
        found
    }

    /// Every (alloc, record) whose staging path is `path`, in order.
    pub fn records_at_staging(&self, path: &Path) -> Found<'_> {
        let scan = || -> Found<'_> {
            self.alloc_volumes()
                .filter(|(_, v)| v.staging_path.as_deref() == Some(path))
                .collect()
        };
        if !self.index.describes(&self.allocs) {
            return scan();
        }
        let ph = key_hash(path.as_os_str().as_encoded_bytes());
        let mut found: Found<'_> = self
            .index
            .by_staging
            .range_from((ph, 0))
            .take_while(|((h, _), _)| *h == ph)
            .flat_map(|(_, a)| {
                a.volumes
                    .values()
                    .filter(|v| v.staging_path.as_deref() == Some(path))
                    .map(move |v| (&**a, &**v))
            })
            .collect();
        in_order(&mut found);
        debug_assert!(
            same(&found, &scan()),
            "the record index disagrees with the records at {}",
            path.display()
        );
        found
    }
}

/// In the order of the records (allocation, then alias), as a scan finds
/// them: the index's order is its hashes'.
fn in_order(found: &mut Found<'_>) {
    found.sort_by(|(a, v), (b, w)| (&a.id, &v.alias).cmp(&(&b.id, &w.alias)));
}

/// The same records, in the same order.
fn same(a: &Found<'_>, b: &Found<'_>) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|((aa, av), (ba, bv))| aa.id == ba.id && av.alias == bv.alias)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::state::model::Phase;
    use crate::volumes::{AccessMode, AttachmentMode, Usage};

    fn rec(alias: &str, volume: &str, staging: Option<&str>) -> Arc<AllocVolume> {
        Arc::new(AllocVolume {
            alias: alias.into(),
            volume_id: volume.into(),
            plugin_id: "p".into(),
            external_volume_id: "x".into(),
            external_node_id: None,
            usage: Usage {
                access_mode: AccessMode::MultiNodeMultiWriter,
                attachment: AttachmentMode::FileSystem,
                read_only: false,
            },
            mount_flags: Vec::new(),
            mount_group: String::new(),
            staging_path: staging.map(PathBuf::from),
            target_path: PathBuf::from(format!("/m/per-alloc/{alias}")),
            publish_context: Default::default(),
            holds_attachment: false,
            holds_staging: staging.is_some(),
            epoch: None,
            phase: Phase::Published,
        })
    }

    fn alloc(id: &str, vols: Vec<Arc<AllocVolume>>) -> Arc<AllocRecord> {
        Arc::new(AllocRecord {
            id: id.into(),
            releasing: false,
            references: 1,
            volumes: vols.into_iter().map(|v| (v.alias.clone(), v)).collect(),
        })
    }

    /// An update as the store makes it: on a copy, then reindexed.
    fn update(s: &StateFile, f: impl FnOnce(&mut StateFile)) -> StateFile {
        let mut next = s.clone();
        let before = next.allocs.clone();
        f(&mut next);
        next.reindex_from(&before);
        next
    }

    fn ids(found: Found<'_>) -> Vec<(String, String)> {
        found
            .into_iter()
            .map(|(a, v)| (a.id.clone(), v.alias.clone()))
            .collect()
    }

    #[test]
    fn the_index_follows_every_update_and_answers_as_the_scan() {
        let mut s = StateFile::new("b");
        for i in 0..300 {
            s = update(&s, |s| {
                let vol = format!("v{}", i % 7);
                let staging = format!("/m/staging/{vol}");
                s.allocs.insert(
                    format!("a{i:03}"),
                    alloc(
                        &format!("a{i:03}"),
                        vec![rec("d", &vol, Some(&staging)), rec("e", "solo", None)],
                    ),
                );
            });
        }
        assert!(s.index.describes(&s.allocs));
        assert_eq!(s.records_of_volume("v3").len(), 43);
        assert_eq!(s.records_of_volume("solo").len(), 300);
        assert_eq!(s.records_at_staging(Path::new("/m/staging/v3")).len(), 43);
        // A record moved to another volume, an allocation removed: the
        // index follows (and, in this debug build, checks itself).
        s = update(&s, |s| {
            s.allocs
                .insert("a003".into(), alloc("a003", vec![rec("d", "v9", None)]));
            s.allocs.remove("a010");
        });
        assert_eq!(
            ids(s.records_of_volume("v9")),
            vec![("a003".into(), "d".into())]
        );
        assert_eq!(s.records_of_volume("v3").len(), 41);
        assert_eq!(s.records_at_staging(Path::new("/m/staging/v3")).len(), 41);
        assert_eq!(s.records_of_volume("solo").len(), 298);
    }

    #[test]
    fn a_map_changed_behind_the_index_is_scanned_not_trusted() {
        let s = update(&StateFile::new("b"), |s| {
            s.allocs
                .insert("a1".into(), alloc("a1", vec![rec("d", "v", None)]));
        });
        assert!(s.index.describes(&s.allocs));
        // Changed without reindexing (as a state read from the files, or
        // built by hand): the index does not describe it and is not used.
        let mut t = s.clone();
        t.allocs
            .insert("a2".into(), alloc("a2", vec![rec("d", "v", None)]));
        assert!(!t.index.describes(&t.allocs));
        assert_eq!(t.records_of_volume("v").len(), 2);
        // Changed in place through the only other copy: still a new map.
        drop(s);
        t.allocs.remove("a2");
        assert!(!t.index.describes(&t.allocs));
        assert_eq!(
            ids(t.records_of_volume("v")),
            vec![("a1".into(), "d".into())]
        );
    }

    #[test]
    fn a_hash_collision_retires_the_index() {
        let mut s = update(&StateFile::new("b"), |s| {
            s.allocs
                .insert("a1".into(), alloc("a1", vec![rec("d", "v", None)]));
        });
        // a2's key already names a1, as a collision of hashes would.
        let a1 = s.allocs.get("a1").cloned().expect("a1");
        s.index
            .by_volume
            .insert((key_hash(b"v"), key_hash(b"a2")), a1);
        let s = update(&s, |s| {
            s.allocs
                .insert("a2".into(), alloc("a2", vec![rec("d", "v", None)]));
        });
        assert!(!s.index.describes(&s.allocs));
        assert_eq!(
            ids(s.records_of_volume("v")),
            vec![("a1".into(), "d".into()), ("a2".into(), "d".into())]
        );
        // It stays retired: later updates leave it alone.
        let s = update(&s, |s| {
            s.allocs.remove("a1");
        });
        assert!(!s.index.describes(&s.allocs));
        assert_eq!(
            ids(s.records_of_volume("v")),
            vec![("a2".into(), "d".into())]
        );
    }
}
