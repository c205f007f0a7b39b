//! What the agent shows about itself: every metric in the Prometheus text
//! format (`collect`), its health (`health`), volume usage and condition
//! from NodeGetVolumeStats (`volume_stats`), and the optional HTTP
//! listener serving both (`http`).
//!
//! Levels (allocations by phase, claims, plugin health, volume usage) are
//! read from their owners at scrape time; events were counted as they
//! happened in `crate::metrics`.

mod collect;
pub mod health;
pub mod http;
pub mod volume_stats;

use std::time::Duration;

use crate::lifecycle::Lifecycle;
use crate::plugins::Registry;
use crate::shutdown::Shutdown;
use crate::threads::Threads;

pub use volume_stats::{StatsCache, StatsEntry};

/// Everything the metrics and health read. Cheap to clone.
#[derive(Clone)]
pub struct Observer {
    pub lifecycle: Lifecycle,
    pub registry: Registry,
    pub stats: StatsCache,
    /// Cluster mode: this node's liveness in etcd.
    pub cluster: Option<std::sync::Arc<crate::cluster::NodeLiveness>>,
    /// With a `docker` section: why the engine-death rule releases nothing.
    pub docker: Option<crate::docker::RuleHealth>,
}

impl Observer {
    pub fn new(lifecycle: Lifecycle, registry: Registry) -> Observer {
        Observer {
            lifecycle,
            registry,
            stats: StatsCache::default(),
            cluster: None,
            docker: None,
        }
    }

    /// Every metric, in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        collect::render(self)
    }

    /// One line per problem; empty when healthy.
    pub fn problems(&self) -> Vec<String> {
        health::problems(self)
    }

    /// Starts the volume stats poller on `threads` (thread `volume-stats`).
    pub fn start_volume_stats(
        &self,
        threads: &mut Threads,
        interval: Duration,
        stop: Shutdown,
    ) -> std::io::Result<()> {
        let (l, r, c) = (
            self.lifecycle.clone(),
            self.registry.clone(),
            self.stats.clone(),
        );
        threads.spawn("volume-stats", move || {
            volume_stats::run(l, r, c, interval, stop)
        })
    }
}
