//! Usage counting: which records count as users of a volume's staging path
//! and of its controller attachment on this node. Answered from the records
//! on every question, never from a count kept only in memory: a record
//! counts as a user from the write that sets its `holds_*` flag (before the
//! call it stands for) until the write that clears it (after the teardown
//! call). The records of one volume or staging path are found through the
//! record index (`index`), which is derived from the same records.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::model::{AllocVolume, Phase, StateFile};

/// (allocation ID, alias): one volume record.
pub type RecordKey<'a> = (&'a str, &'a str);

impl StateFile {
    /// Other records that hold the staging path `path`.
    pub fn staging_users(&self, path: &Path, except: RecordKey<'_>) -> usize {
        self.staging_users_but(path, except, &BTreeSet::new())
    }

    /// Other records that hold the staging path `path`, leaving out those
    /// in `past` (their way down already passed its unstage step).
    pub fn staging_users_but(
        &self,
        path: &Path,
        except: RecordKey<'_>,
        past: &BTreeSet<(String, String)>,
    ) -> usize {
        self.records_at_staging(path)
            .into_iter()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .filter(|(_, v)| v.holds_staging)
            .filter(|(a, v)| !past.contains(&(a.id.clone(), v.alias.clone())))
            .count()
    }

    /// Other records that hold the attachment of `volume_id`, leaving out
    /// those in `past` (their way down already passed its detach step).
    pub fn attachment_users_but(
        &self,
        volume_id: &str,
        except: RecordKey<'_>,
        past: &BTreeSet<(String, String)>,
    ) -> usize {
        self.records_of_volume(volume_id)
            .into_iter()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .filter(|(_, v)| v.holds_attachment)
            .filter(|(a, v)| !past.contains(&(a.id.clone(), v.alias.clone())))
            .count()
    }

    /// Other records that hold the controller attachment of `volume_id`.
    pub fn attachment_users(&self, volume_id: &str, except: RecordKey<'_>) -> Vec<&AllocVolume> {
        self.records_of_volume(volume_id)
            .into_iter()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .filter(|(_, v)| v.holds_attachment)
            .map(|(_, v)| v)
            .collect()
    }

    /// The publish context of an attachment of `volume_id` to
    /// `external_node_id` that another record established and still uses
    /// (published, and its target path is a mount point now), if any: a
    /// second user shares it instead of calling again. After a reboot no
    /// target is mounted, so nothing counts as established until redone.
    pub fn established_attachment(
        &self,
        volume_id: &str,
        external_node_id: Option<&str>,
        except: RecordKey<'_>,
    ) -> Option<BTreeMap<String, String>> {
        self.attachment_users(volume_id, except)
            .into_iter()
            .find(|o| o.external_node_id.as_deref() == external_node_id && in_use(o))
            .map(|o| o.publish_context.clone())
    }

    /// The staging path another record of `volume_id` holds on this node,
    /// if any: a volume has one staging path per node, and a new user of a
    /// staged volume shares it.
    pub fn staging_path_of(&self, volume_id: &str, except: RecordKey<'_>) -> Option<PathBuf> {
        self.records_of_volume(volume_id)
            .into_iter()
            .filter(|(a, v)| (a.id.as_str(), v.alias.as_str()) != except)
            .find(|(_, v)| v.holds_staging)
            .and_then(|(_, v)| v.staging_path.clone())
    }

    /// Whether another record staged `path` and still uses it (published,
    /// and its target is a mount point now): a second user shares the
    /// staging instead of staging again.
    pub fn staging_established(&self, path: &Path, except: RecordKey<'_>) -> bool {
        self.records_at_staging(path).into_iter().any(|(a, o)| {
            (a.id.as_str(), o.alias.as_str()) != except && o.holds_staging && in_use(o)
        })
    }
}

/// A record whose way up is known done and whose mount is there now.
fn in_use(v: &AllocVolume) -> bool {
    v.phase == Phase::Published && crate::mounts::is_mount_point(&v.target_path).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::state::AllocRecord;
    use crate::volumes::{AccessMode, AttachmentMode, Usage};

    fn rec(alias: &str, phase: Phase, staging: bool, attach: bool) -> AllocVolume {
        AllocVolume {
            alias: alias.into(),
            volume_id: "v".into(),
            plugin_id: "p".into(),
            external_volume_id: "x".into(),
            external_node_id: attach.then(|| "n1".to_string()),
            usage: Usage {
                access_mode: AccessMode::MultiNodeMultiWriter,
                attachment: AttachmentMode::FileSystem,
                read_only: false,
            },
            mount_flags: Vec::new(),
            mount_group: String::new(),
            staging_path: staging.then(|| PathBuf::from("/m/staging/v")),
            target_path: PathBuf::from(format!("/m/per-alloc/{alias}")),
            publish_context: [("k".to_string(), alias.to_string())].into(),
            holds_attachment: attach,
            holds_staging: staging,
            epoch: None,
            phase,
        }
    }

    fn state(recs: Vec<(&str, AllocVolume)>) -> StateFile {
        let mut s = StateFile::new("b");
        for (alloc, v) in recs {
            s.allocs.insert(
                alloc.to_string(),
                Arc::new(AllocRecord {
                    id: alloc.to_string(),
                    releasing: false,
                    references: 1,
                    volumes: [(v.alias.clone(), Arc::new(v))].into(),
                }),
            );
        }
        s
    }

    #[test]
    fn users_are_counted_from_the_records_except_the_asking_one() {
        let staging = Path::new("/m/staging/v");
        let s = state(vec![
            ("a1", rec("d", Phase::Published, true, true)),
            ("a2", rec("d", Phase::Mounting, true, true)),
            ("a3", rec("d", Phase::Mounting, false, false)),
        ]);
        assert_eq!(s.staging_users(staging, ("a1", "d")), 1);
        assert_eq!(s.staging_users(staging, ("a9", "d")), 2);
        assert_eq!(s.attachment_users("v", ("a2", "d")).len(), 1);
        assert_eq!(s.attachment_users("other", ("a9", "d")).len(), 0);
    }

    #[test]
    fn only_a_published_record_that_is_mounted_now_is_shared() {
        let staging = Path::new("/m/staging/v");
        // a2 recorded its intent; its calls may not have answered.
        let s = state(vec![("a2", rec("d", Phase::Mounting, true, true))]);
        assert!(!s.staging_established(staging, ("a1", "d")));
        assert_eq!(s.established_attachment("v", Some("n1"), ("a1", "d")), None);
        // Published, but its target is not mounted (after a reboot).
        let s = state(vec![("a2", rec("d", Phase::Published, true, true))]);
        assert!(!s.staging_established(staging, ("a1", "d")));
        assert_eq!(s.established_attachment("v", Some("n1"), ("a1", "d")), None);
        // Either way it holds the staging path new users share.
        assert_eq!(
            s.staging_path_of("v", ("a1", "d")),
            Some(PathBuf::from("/m/staging/v"))
        );
        assert_eq!(s.staging_path_of("w", ("a1", "d")), None);
    }
}
