//! Claims held by nodes this agent sees gone, that the cluster keeps
//! because nothing can fence them (`fencing::FreeRule::Cluster`): the
//! reaper fills it, `health` and the metrics show it, so that an operator
//! learns that a volume is stuck on a vanished node and what frees it.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// One kept claim's volume on one unreachable node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreachableHold {
    pub volume_id: String,
    pub node: String,
    /// When this agent first saw the node gone (milliseconds since the
    /// epoch, this machine's clock: for people, never for decisions).
    pub gone_since_ms: u64,
    /// Why the cluster does not free it.
    pub why: String,
}

/// (volume, node) -> what is known of the hold.
#[derive(Default)]
pub struct UnreachableHolds {
    holds: Mutex<BTreeMap<(String, String), UnreachableHold>>,
}

impl UnreachableHolds {
    /// The reaper kept `volume_id` claimed for `node`, gone for `gone_for`.
    pub fn kept(&self, volume_id: &str, node: &str, gone_for: Duration, why: &str) {
        let since = SystemTime::now()
            .checked_sub(gone_for)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        let key = (volume_id.to_string(), node.to_string());
        let mut holds = self.holds.lock();
        let h = holds.entry(key).or_insert_with(|| UnreachableHold {
            volume_id: volume_id.to_string(),
            node: node.to_string(),
            gone_since_ms: since,
            why: String::new(),
        });
        h.why = why.to_string();
    }

    /// The volume's claims of `node` were freed (fenced, or by hand).
    pub fn gone(&self, volume_id: &str, node: &str) {
        self.holds
            .lock()
            .remove(&(volume_id.to_string(), node.to_string()));
    }

    /// Keeps only the holds of `node` on `volumes` (what it still holds).
    pub fn retain_node(&self, node: &str, volumes: &[String]) {
        self.holds
            .lock()
            .retain(|(v, n), _| n != node || volumes.contains(v));
    }

    /// Forgets the holds of nodes for which `keep` says no (back, or no
    /// longer known to be gone).
    pub fn retain_nodes(&self, keep: impl Fn(&str) -> bool) {
        self.holds.lock().retain(|(_, n), _| keep(n));
    }

    pub fn list(&self) -> Vec<UnreachableHold> {
        self.holds.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_kept_until_freed_or_back() {
        let u = UnreachableHolds::default();
        u.kept("v", "a", Duration::from_secs(60), "node-only");
        u.kept("w", "a", Duration::from_secs(60), "node-only");
        u.kept("v", "b", Duration::from_secs(5), "not fencing");
        let first = u.list()[0].gone_since_ms;
        u.kept("v", "a", Duration::from_secs(1), "again");
        let l = u.list();
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].gone_since_ms, first, "the first sighting counts");
        assert_eq!(l[0].why, "again");
        u.gone("w", "a");
        u.retain_node("b", &[]);
        assert_eq!(u.list().len(), 1);
        u.retain_nodes(|n| n != "a");
        assert!(u.list().is_empty());
    }
}
