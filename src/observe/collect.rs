//! Every metric family, written in the text format. Names follow kubelet's
//! where kubelet has one (`csi_operations_seconds`,
//! `kubelet_volume_stats_*`), with the `claimd_` prefix.

use std::collections::BTreeMap;

use crate::lifecycle::ReleaseState;
use crate::metrics::text::{Kind, Text};
use crate::metrics::{self, process};
use crate::plugins::Health;
use crate::state::{ClaimState, Phase};

use super::Observer;

const PHASES: &[Phase] = &[
    Phase::Claiming,
    Phase::Mounting,
    Phase::Published,
    Phase::Releasing,
];

const HEALTHS: &[Health] = &[
    Health::Unknown,
    Health::Unhealthy,
    Health::Starting,
    Health::Ready,
];

pub fn render(o: &Observer) -> String {
    let mut t = Text::new();
    csi(&mut t);
    records(&mut t, o);
    claims(&mut t, o);
    releases(&mut t, o);
    plugins(&mut t, o);
    state(&mut t, o);
    etcd(&mut t, o);
    volume_stats(&mut t, o);
    process::write(&mut t);
    t.finish()
}

fn csi(t: &mut Text) {
    t.histogram(
        "claimd_csi_operations_seconds",
        "Container Storage Interface operation duration with gRPC error code status total.",
        &["driver_name", "method_name", "grpc_status_code"],
        metrics::CSI_OPERATIONS.buckets,
        &metrics::CSI_OPERATIONS.snapshot(),
    );
}

/// Allocations by phase (`mounting`, `mounted`, `releasing`) and their
/// volumes by durable phase.
fn records(t: &mut Text, o: &Observer) {
    let (allocs, volumes, registered) = o.lifecycle.store().read(|s| {
        let mut allocs: BTreeMap<&'static str, u64> =
            [("mounting", 0), ("mounted", 0), ("releasing", 0)].into();
        let mut volumes: BTreeMap<&'static str, u64> =
            PHASES.iter().map(|p| (p.name(), 0)).collect();
        for a in s.allocs.values() {
            let phase = if a.releasing || a.volumes.values().any(|v| v.phase.is_teardown()) {
                "releasing"
            } else if a.volumes.values().all(|v| v.phase == Phase::Published) {
                "mounted"
            } else {
                "mounting"
            };
            *allocs.entry(phase).or_default() += 1;
            for v in a.volumes.values() {
                *volumes.entry(v.phase.name()).or_default() += 1;
            }
        }
        (allocs, volumes, s.volumes.len())
    });
    t.family(
        "claimd_allocations",
        Kind::Gauge,
        "Allocations on record by phase: mounting, mounted or releasing.",
    );
    for (phase, n) in allocs {
        t.sample("claimd_allocations", &[("phase", phase)], n as f64);
    }
    t.family(
        "claimd_allocation_volumes",
        Kind::Gauge,
        "Allocation volumes on record by durable phase.",
    );
    for (phase, n) in volumes {
        t.sample("claimd_allocation_volumes", &[("phase", phase)], n as f64);
    }
    t.single(
        "claimd_registered_volumes",
        Kind::Gauge,
        "Volumes registered with this agent.",
        registered as f64,
    );
}

fn claims(t: &mut Text, o: &Observer) {
    let mut by_state: BTreeMap<&'static str, u64> =
        [("taken", 0), ("releasing", 0), ("node-detached", 0)].into();
    for state in o.lifecycle.claim_states_here() {
        let s = match state {
            ClaimState::Taken => "taken",
            ClaimState::Releasing => "releasing",
            ClaimState::NodeDetached => "node-detached",
        };
        *by_state.entry(s).or_default() += 1;
    }
    t.family(
        "claimd_claims",
        Kind::Gauge,
        "Claims this node holds, by state (in cluster mode counted from its records).",
    );
    for (s, n) in by_state {
        t.sample("claimd_claims", &[("state", s)], n as f64);
    }
    t.single(
        "claimd_claim_retries_total",
        Kind::Counter,
        "Claims found held by another allocation and retried.",
        metrics::CLAIM_RETRIES.get() as f64,
    );
}

fn releases(t: &mut Text, o: &Observer) {
    let mut by_state: BTreeMap<&'static str, u64> =
        [("in-progress", 0), ("retrying", 0), ("stopped", 0)].into();
    for (_, _, st) in o.lifecycle.release_reports() {
        let s = match st {
            ReleaseState::InProgress => "in-progress",
            ReleaseState::Retrying { .. } => "retrying",
            ReleaseState::Stopped { .. } => "stopped",
            ReleaseState::Released => continue,
        };
        *by_state.entry(s).or_default() += 1;
    }
    t.family(
        "claimd_volume_releases",
        Kind::Gauge,
        "Volume releases not done, by state: in-progress, retrying (failing), stopped (gave up; the claim is kept).",
    );
    for (s, n) in by_state {
        t.sample("claimd_volume_releases", &[("state", s)], n as f64);
    }
    t.single(
        "claimd_release_failures_total",
        Kind::Counter,
        "Release steps that failed and were retried.",
        metrics::RELEASE_FAILURES.get() as f64,
    );
}

fn plugins(t: &mut Text, o: &Observer) {
    t.family(
        "claimd_plugin_health",
        Kind::Gauge,
        "Health of each plugin socket: 1 for its current health (unknown, unhealthy, starting, ready), 0 for the others.",
    );
    for p in o.registry.list() {
        for h in HEALTHS {
            t.sample(
                "claimd_plugin_health",
                &[
                    ("plugin_id", &p.id),
                    ("plugin_type", p.plugin_type.name()),
                    ("health", h.name()),
                ],
                if p.health == *h { 1.0 } else { 0.0 },
            );
        }
    }
}

fn state(t: &mut Text, o: &Observer) {
    let ws = o.lifecycle.store().write_stats();
    t.single(
        "claimd_state_writes_total",
        Kind::Counter,
        "Durable state writes: journal lines plus snapshot rewrites.",
        ws.writes as f64,
    );
    t.single(
        "claimd_state_undurable_changes",
        Kind::Gauge,
        "State changes applied but not on disk yet (closing writes waiting for the next write).",
        o.lifecycle.store().undurable_changes() as f64,
    );
    t.single(
        "claimd_state_fsyncs_total",
        Kind::Counter,
        "fsync and fdatasync calls made for the state.",
        ws.fsyncs as f64,
    );
    t.single(
        "claimd_state_written_bytes_total",
        Kind::Counter,
        "Bytes written to the state journal and snapshots.",
        ws.bytes as f64,
    );
    t.single(
        "claimd_state_compactions_total",
        Kind::Counter,
        "Journal compactions (snapshot rewrites).",
        ws.snapshots as f64,
    );
    t.histogram(
        "claimd_state_write_duration_seconds",
        "Time to make one state change durable (journal line and fdatasync, or a compaction).",
        &[],
        metrics::STATE_WRITE_SECONDS.buckets,
        &metrics::STATE_WRITE_SECONDS.snapshot(),
    );
    t.single(
        "claimd_state_changes_written_total",
        Kind::Counter,
        "State changes made durable by those writes (group commit puts several in one).",
        metrics::STATE_CHANGES_WRITTEN.get() as f64,
    );
    t.histogram(
        "claimd_state_commit_wait_seconds",
        "Time from a state change applied to durable, for changes whose caller waits for it: the write in flight, then its own write.",
        &[],
        metrics::STATE_COMMIT_WAIT_SECONDS.buckets,
        &metrics::STATE_COMMIT_WAIT_SECONDS.snapshot(),
    );
}

/// Cluster mode: etcd calls, and whether this node's liveness lease is
/// held (nothing on one node).
fn etcd(t: &mut Text, o: &Observer) {
    let Some(c) = &o.cluster else {
        return;
    };
    t.histogram(
        "claimd_etcd_request_duration_seconds",
        "etcd calls of cluster mode by method and result (ok or error).",
        &["method", "result"],
        metrics::ETCD_REQUESTS.buckets,
        &metrics::ETCD_REQUESTS.snapshot(),
    );
    t.single(
        "claimd_etcd_lease_held",
        Kind::Gauge,
        "1 while this node's liveness lease in etcd is held and renewed within its TTL.",
        if c.problem().is_none() { 1.0 } else { 0.0 },
    );
    t.single(
        "claimd_etcd_claim_marks_pending",
        Kind::Gauge,
        "Claim states (releasing, node-detached) waiting to be written to this node's claims in etcd.",
        metrics::CLAIM_MARKS_PENDING.get() as f64,
    );
    t.single(
        "claimd_cluster_reconciliations_total",
        Kind::Counter,
        "Reconciliations of this node's claims in etcd with its records that succeeded (one after each registration of its liveness).",
        metrics::RECONCILIATIONS.get() as f64,
    );
    let name = "claimd_cluster_unreachable_holds";
    t.family(
        name,
        Kind::Gauge,
        "Volumes kept claimed by a node this agent sees gone, that nothing can fence (freed only by an operator or the node's return), by node.",
    );
    let mut by_node = std::collections::BTreeMap::<String, f64>::new();
    for h in c.unreachable.list() {
        *by_node.entry(h.node).or_default() += 1.0;
    }
    for (node, n) in &by_node {
        t.sample(name, &[("node", node.as_str())], *n);
    }
}

fn volume_stats(t: &mut Text, o: &Observer) {
    let all = o.stats.all();
    type Pick = fn(&crate::csi::VolumeStats) -> Option<f64>;
    let families: [(&str, &str, Pick); 6] = [
        (
            "claimd_volume_stats_capacity_bytes",
            "Capacity in bytes of the volume.",
            |s| s.bytes.map(|u| u.total as f64),
        ),
        (
            "claimd_volume_stats_used_bytes",
            "Number of used bytes in the volume.",
            |s| s.bytes.map(|u| u.used as f64),
        ),
        (
            "claimd_volume_stats_available_bytes",
            "Number of available bytes in the volume.",
            |s| s.bytes.map(|u| u.available as f64),
        ),
        (
            "claimd_volume_stats_inodes",
            "Maximum number of inodes in the volume.",
            |s| s.inodes.map(|u| u.total as f64),
        ),
        (
            "claimd_volume_stats_inodes_used",
            "Number of used inodes in the volume.",
            |s| s.inodes.map(|u| u.used as f64),
        ),
        (
            "claimd_volume_stats_inodes_free",
            "Number of free inodes in the volume.",
            |s| s.inodes.map(|u| u.available as f64),
        ),
    ];
    for (name, help, pick) in families {
        t.family(name, Kind::Gauge, help);
        for ((alloc, alias), e) in &all {
            if let Some(v) = e.stats.as_ref().and_then(|(_, s)| pick(s)) {
                t.sample(name, &labels(alloc, alias, e), v);
            }
        }
    }
    let name = "claimd_volume_stats_health_status_abnormal";
    t.family(
        name,
        Kind::Gauge,
        "Abnormal volume health status: 1 abnormal, 0 normal (VOLUME_CONDITION).",
    );
    for ((alloc, alias), e) in &all {
        if let Some(c) = e.stats.as_ref().and_then(|(_, s)| s.condition.as_ref()) {
            let v = if c.abnormal { 1.0 } else { 0.0 };
            t.sample(name, &labels(alloc, alias, e), v);
        }
    }
    t.single(
        "claimd_volume_stats_errors_total",
        Kind::Counter,
        "NodeGetVolumeStats polls that failed.",
        metrics::VOLUME_STATS_ERRORS.get() as f64,
    );
}

fn labels<'a>(alloc: &'a str, alias: &'a str, e: &'a super::StatsEntry) -> [(&'a str, &'a str); 4] {
    [
        ("alloc_id", alloc),
        ("alias", alias),
        ("volume_id", &e.volume_id),
        ("plugin_id", &e.plugin_id),
    ]
}
