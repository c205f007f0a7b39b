//! Volume usage and condition: a poller thread asks NodeGetVolumeStats for
//! every published volume whose node plugin offers GET_VOLUME_STATS, once
//! per `volume_stats_interval`, and keeps the latest answer per
//! allocation volume for the metrics and `alloc status`.
//!
//! No lock is held across a call: the list of published volumes is copied
//! out of the state first, and the answer is stored after. The volume's
//! operation lock is not taken either, so a poll never delays a mount or a
//! release; a poll that races a release gets an error or a last figure,
//! and the entry goes at the next round, with the record.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use crate::csi::{CsiError, NodeGetVolumeStatsRequest, VolumeStats};
use crate::lifecycle::Lifecycle;
use crate::plugins::{PluginKind, Registry};
use crate::shutdown::Shutdown;
use crate::state::Phase;

/// (allocation, alias)
pub type Key = (String, String);

/// The latest poll of one allocation volume.
#[derive(Clone, Debug, PartialEq)]
pub struct StatsEntry {
    pub volume_id: String,
    pub plugin_id: String,
    /// The latest answer, and when it came.
    pub stats: Option<(SystemTime, VolumeStats)>,
    /// The latest poll failed: why (the figures are from an earlier one).
    pub error: String,
}

/// The latest answers. Cheap to clone.
#[derive(Clone, Default)]
pub struct StatsCache {
    entries: Arc<Mutex<BTreeMap<Key, StatsEntry>>>,
}

impl StatsCache {
    pub fn get(&self, alloc_id: &str, alias: &str) -> Option<StatsEntry> {
        self.entries
            .lock()
            .get(&(alloc_id.to_string(), alias.to_string()))
            .cloned()
    }

    pub fn all(&self) -> Vec<(Key, StatsEntry)> {
        self.entries
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn keep_only(&self, keys: &HashSet<Key>) {
        self.entries.lock().retain(|k, _| keys.contains(k));
    }

    fn record(&self, key: Key, target: &Target, result: Result<VolumeStats, String>) {
        let mut m = self.entries.lock();
        let e = m.entry(key).or_insert_with(|| StatsEntry {
            volume_id: target.volume_id.clone(),
            plugin_id: target.plugin_id.clone(),
            stats: None,
            error: String::new(),
        });
        match result {
            Ok(s) => {
                e.stats = Some((SystemTime::now(), s));
                e.error.clear();
            }
            Err(why) => e.error = why,
        }
    }
}

/// One published volume to ask about.
struct Target {
    key: Key,
    volume_id: String,
    plugin_id: String,
    request: NodeGetVolumeStatsRequest,
}

fn targets(lifecycle: &Lifecycle) -> Vec<Target> {
    lifecycle.store().read(|s| {
        s.alloc_volumes()
            .filter(|(a, v)| !a.releasing && v.phase == Phase::Published)
            .map(|(a, v)| {
                let mut r = NodeGetVolumeStatsRequest::new();
                r.volume_id = v.external_volume_id.clone();
                r.volume_path = v.target_path.to_string_lossy().into_owned();
                r.staging_target_path = v
                    .staging_path
                    .as_ref()
                    .map(|p: &PathBuf| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                Target {
                    key: (a.id.clone(), v.alias.clone()),
                    volume_id: v.volume_id.clone(),
                    plugin_id: v.plugin_id.clone(),
                    request: r,
                }
            })
            .collect()
    })
}

/// One round: every published volume of a plugin that offers the stats.
/// A plugin whose call hit its deadline is skipped for the rest of the
/// round, so one hung plugin costs one deadline per round, not one per
/// volume.
pub fn poll_once(lifecycle: &Lifecycle, registry: &Registry, cache: &StatsCache, stop: &Shutdown) {
    let targets = targets(lifecycle);
    cache.keep_only(&targets.iter().map(|t| t.key.clone()).collect());
    let mut hung: HashSet<String> = HashSet::new();
    for t in targets {
        if stop.is_triggered() {
            return;
        }
        if hung.contains(&t.plugin_id) {
            continue;
        }
        let Some(plugin) = registry.get_ready(&t.plugin_id, PluginKind::Node) else {
            continue;
        };
        if !plugin
            .node_capabilities
            .as_ref()
            .is_some_and(|c| c.get_volume_stats)
        {
            continue;
        }
        let result = plugin.client.node_get_volume_stats(&t.request);
        if let Err(e) = &result {
            crate::metrics::VOLUME_STATS_ERRORS.inc();
            if matches!(e, CsiError::Status { code, .. } if *code == grpcio::RpcStatusCode::DEADLINE_EXCEEDED)
            {
                hung.insert(t.plugin_id.clone());
            }
            log::debug!(
                "volume stats of {}/{}: {}",
                t.key.0,
                t.key.1,
                crate::error_chain(e)
            );
        }
        // Only while the volume is still published (a release may have
        // taken it meanwhile).
        let still = lifecycle.store().read(|s| {
            s.volume(&t.key.0, &t.key.1)
                .is_some_and(|v| v.phase == Phase::Published)
        });
        if still {
            let key = t.key.clone();
            cache.record(key, &t, result.map_err(|e| crate::error_chain(&e)));
        }
    }
}

/// The poller's loop: a round at start, then one per `interval`, until the
/// stop.
pub fn run(
    lifecycle: Lifecycle,
    registry: Registry,
    cache: StatsCache,
    interval: Duration,
    stop: Shutdown,
) {
    loop {
        let next = Instant::now() + interval;
        poll_once(&lifecycle, &registry, &cache, &stop);
        if !stop.sleep_until(next) {
            return;
        }
    }
}
