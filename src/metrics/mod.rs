//! Counters and histograms that the rest of the agent records into, and
//! the Prometheus text format they are written in (`text`), plus the
//! process figures every exporter shows (`process`).
//!
//! The few metrics that are events (a CSI call answered, a state write
//! made durable, a claim retried) live here as process-wide statics, so
//! the code that sees the event records it with one call and no handle to
//! pass around. Everything that is a level (allocations by phase, plugin
//! health, volume usage) is read at scrape time from its owner by
//! the observer module (`observe`); nothing is kept twice. One level lives
//! here too: the claim marks waiting for etcd, set by the etcd store's
//! marker thread, to which the observer holds no handle.
//!
//! Written by hand rather than with a crate: the text format is a few
//! lines, and the `prometheus` crate would bring protobuf 2 (the agent uses
//! protobuf 3) and a larger binary for features the agent does not use.
//! This module imports nothing from the crate, so anything may record.

pub mod process;
pub mod text;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// kubelet's buckets for `csi_operations_seconds` (and the CSI sidecars'
/// `csi_sidecar_operations_seconds`), so dashboards and alerts carry over.
pub const CSI_OPERATION_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// Buckets of a durable state write (an fdatasync is about 0.2 ms here;
/// a compaction of a large state takes tens of milliseconds).
pub const STATE_WRITE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A counter that only goes up.
pub struct Counter(AtomicU64);

impl Counter {
    pub const fn new() -> Counter {
        Counter(AtomicU64::new(0))
    }

    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for Counter {
    fn default() -> Self {
        Self::new()
    }
}

/// A level set by its one owner (a figure kept where no scrape can reach
/// its owner by a handle).
pub struct Gauge(AtomicU64);

impl Gauge {
    pub const fn new() -> Gauge {
        Gauge(AtomicU64::new(0))
    }

    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for Gauge {
    fn default() -> Self {
        Self::new()
    }
}

/// One histogram series: observations per bucket (not cumulative), their
/// count and their sum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramData {
    pub per_bucket: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

impl HistogramData {
    fn observe(&mut self, buckets: &[f64], value: f64) {
        if self.per_bucket.len() != buckets.len() {
            self.per_bucket = vec![0; buckets.len()];
        }
        if let Some(i) = buckets.iter().position(|b| value <= *b) {
            self.per_bucket[i] += 1;
        }
        self.count += 1;
        self.sum += value;
    }

    /// Cumulative counts per bucket, as the text format wants them.
    pub fn cumulative(&self) -> Vec<u64> {
        let mut total = 0;
        self.per_bucket
            .iter()
            .map(|n| {
                total += n;
                total
            })
            .collect()
    }
}

/// A histogram with labels: one series per label-value combination.
pub struct HistogramVec {
    pub buckets: &'static [f64],
    series: Mutex<BTreeMap<Vec<String>, HistogramData>>,
}

impl HistogramVec {
    pub const fn new(buckets: &'static [f64]) -> HistogramVec {
        HistogramVec {
            buckets,
            series: parking_lot::const_mutex(BTreeMap::new()),
        }
    }

    /// Records one observation (seconds) for the series `labels`.
    pub fn observe(&self, labels: &[&str], value: f64) {
        let key: Vec<String> = labels.iter().map(|s| s.to_string()).collect();
        self.series
            .lock()
            .entry(key)
            .or_default()
            .observe(self.buckets, value);
    }

    /// A copy of every series, ordered by label values.
    pub fn snapshot(&self) -> Vec<(Vec<String>, HistogramData)> {
        self.series
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

/// CSI calls: `driver_name` (the plugin ID), `method_name` (the gRPC
/// method path, `/csi.v1.Node/NodePublishVolume`) and `grpc_status_code`
/// (gRPC's code name, `OK`, `DeadlineExceeded`), as kubelet labels them.
pub static CSI_OPERATIONS: HistogramVec = HistogramVec::new(CSI_OPERATION_BUCKETS);

/// Durable state writes (a journal line and its fdatasync, or a
/// compaction), in seconds; no labels.
pub static STATE_WRITE_SECONDS: HistogramVec = HistogramVec::new(STATE_WRITE_BUCKETS);

/// State changes whose caller waits for them to be durable: the time from
/// the change applied (in memory, under the state's lock) to durable, that
/// is the wait for the write in flight and the change's own write
/// (group commit), in seconds; no labels.
pub static STATE_COMMIT_WAIT_SECONDS: HistogramVec = HistogramVec::new(STATE_WRITE_BUCKETS);

/// State changes made durable by the writes of `STATE_WRITE_SECONDS`
/// (changes per write = this / that count: what group commit shares).
pub static STATE_CHANGES_WRITTEN: Counter = Counter::new();

/// etcd calls of cluster mode: `method` (`Range`, `Txn`, `LeaseGrant`, …)
/// and `result` (`ok`, or `error`), in seconds.
pub static ETCD_REQUESTS: HistogramVec = HistogramVec::new(STATE_WRITE_BUCKETS);

/// Claims found held by another allocation and retried.
pub static CLAIM_RETRIES: Counter = Counter::new();

/// Start-up reconciliations of this node's claims with its records that
/// succeeded (one after each registration of its liveness).
pub static RECONCILIATIONS: Counter = Counter::new();

/// Claim state marks (`releasing`, `node-detached`) waiting to be written
/// to etcd, and the one being written (set by the etcd store's marker).
pub static CLAIM_MARKS_PENDING: Gauge = Gauge::new();

/// Release steps that failed (each failed attempt counts once).
pub static RELEASE_FAILURES: Counter = Counter::new();

/// NodeGetVolumeStats polls that failed.
pub static VOLUME_STATS_ERRORS: Counter = Counter::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_inclusive() {
        let h = HistogramVec::new(&[0.1, 1.0]);
        h.observe(&["a"], 0.1);
        h.observe(&["a"], 0.5);
        h.observe(&["a"], 7.0);
        let s = h.snapshot();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].0, vec!["a".to_string()]);
        assert_eq!(s[0].1.cumulative(), vec![1, 2]);
        assert_eq!(s[0].1.count, 3);
        assert!((s[0].1.sum - 7.6).abs() < 1e-9);
    }

    #[test]
    fn counters_count() {
        let c = Counter::new();
        c.inc();
        c.inc();
        assert_eq!(c.get(), 2);
    }
}
