//! What this node last published of its self-release, and the window it
//! may use until it has published its current one.
//!
//! Observers wait `W` after a node's liveness is gone, with `W` computed
//! from the settings the node wrote at its last registration
//! (`node-settings/<node>`: its window D, its unmount bound U, its check
//! period τ). A node restarted while cut off, with a larger
//! `stop_after_disconnect` or `csi_call_timeout` than it published, cannot
//! publish them before etcd answers: until then it must be done with its
//! volumes by the time the *published* settings let the cluster act. So
//! `published-settings.json` in the state directory keeps every set of
//! settings etcd may hold for this node (written before each registration
//! with the new one added, and cut down to the new one once the
//! registration answered), and until this run's first registration the
//! node uses the largest window that the rule of safety.md (rule 4) allows
//! against each of them (`margins::bounded_window`).
//!
//! A missing file (a first start, or an upgrade from an agent that did not
//! write it) leaves the configured window as it is. A file that is not
//! this format stops the agent, naming it: it is never overwritten.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

use super::margins::ReleaseBounds;

/// The file, in the state directory.
pub const PUBLISHED_FILE: &str = "published-settings.json";

/// Why `published-settings.json` cannot be read or written.
#[derive(Debug)]
pub enum PublishedError {
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not this format; it is never overwritten.
    NotPublishedSettings {
        path: PathBuf,
        source: serde_json::Error,
    },
}

impl fmt::Display for PublishedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublishedError::Read { path, .. } => write!(f, "cannot read {}", path.display()),
            PublishedError::Write { path, .. } => write!(f, "cannot write {}", path.display()),
            PublishedError::NotPublishedSettings { path, .. } => write!(
                f,
                "{} is not what this node published of its self-release: fix or remove it by hand (removing it lets a restart while cut off from etcd use the configured stop_after_disconnect, even if it is larger than the one the cluster knows)",
                path.display()
            ),
        }
    }
}

impl std::error::Error for PublishedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PublishedError::Read { source, .. } | PublishedError::Write { source, .. } => {
                Some(source)
            }
            PublishedError::NotPublishedSettings { source, .. } => Some(source),
        }
    }
}

/// `published-settings.json`.
#[derive(Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishedFile {
    /// Every set of settings etcd may hold for this node.
    published: Vec<ReleaseBounds>,
}

/// The file of one state directory.
pub struct Published {
    path: PathBuf,
    /// What the file says (empty: missing).
    sets: Vec<ReleaseBounds>,
}

impl Published {
    /// Reads the file of `state_dir`; one that cannot be read or is not this
    /// format is refused, naming it.
    pub fn open(state_dir: &Path) -> Result<Published, PublishedError> {
        let path = state_dir.join(PUBLISHED_FILE);
        let sets = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<PublishedFile>(&bytes) {
                Ok(file) => file.published,
                Err(source) => return Err(PublishedError::NotPublishedSettings { path, source }),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(PublishedError::Read { path, source }),
        };
        Ok(Published { path, sets })
    }

    /// Every set etcd may hold for this node (empty: not known).
    pub fn sets(&self) -> &[ReleaseBounds] {
        &self.sets
    }

    /// Before a registration writes `current`: the file holds it too.
    pub fn publishing(&mut self, current: &ReleaseBounds) -> Result<(), PublishedError> {
        if self.sets.contains(current) {
            return Ok(());
        }
        let mut sets = self.sets.clone();
        sets.push(*current);
        self.write(sets)
    }

    /// A registration wrote `current`: it is the only one etcd holds.
    pub fn published(&mut self, current: &ReleaseBounds) -> Result<(), PublishedError> {
        if self.sets == [*current] {
            return Ok(());
        }
        self.write(vec![*current])
    }

    fn write(&mut self, sets: Vec<ReleaseBounds>) -> Result<(), PublishedError> {
        let bytes = serde_json::to_vec(&PublishedFile {
            published: sets.clone(),
        })
        .expect("published settings always encode");
        crate::state::write_file_atomically(&self.path, &bytes).map_err(|source| {
            PublishedError::Write {
                path: self.path.clone(),
                source,
            }
        })?;
        self.sets = sets;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn the_file_keeps_every_set_etcd_may_hold_and_a_bad_one_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut p = Published::open(dir.path()).expect("missing is empty");
        assert!(p.sets().is_empty());
        let a = ReleaseBounds::new(Some(secs(5)), secs(15), secs(1));
        let b = ReleaseBounds::new(Some(secs(50)), secs(15), secs(1));
        p.published(&a).expect("write");
        p.publishing(&b).expect("write");
        assert_eq!(Published::open(dir.path()).expect("read").sets(), [a, b]);
        p.published(&b).expect("write");
        assert_eq!(Published::open(dir.path()).expect("read").sets(), [b]);
        let path = dir.path().join(PUBLISHED_FILE);
        std::fs::write(&path, b"{\"published\": 3}").expect("write");
        let e = Published::open(dir.path()).err().expect("refused");
        assert!(
            matches!(e, PublishedError::NotPublishedSettings { .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains(PUBLISHED_FILE), "{e}");
        assert_eq!(
            std::fs::read(&path).expect("read"),
            b"{\"published\": 3}",
            "never overwritten"
        );
    }
}
