//! Check (6): no node is fenced early. The cluster may fence a node (a
//! detach request another node's reaper writes for it) only once it has
//! been gone for its W (`observer_wait`, from its published settings)
//! since its liveness key went.
//!
//! The harness polls `nodes/`, `node-settings/` and `attachments/` in one
//! `Txn` per period (`watch_liveness`), noting each poll's send time, its
//! revision, which nodes were present, and every fence request first seen
//! (want detached, pending, `requested_by` another node) with the
//! monotonic time its poll returned and its mod revision. A node's
//! absence began after the send of the last poll, at a revision below the
//! request's, that still showed its key; the request was written before
//! the return of the poll that first showed it. So
//! `seen - last_present_send` is longer than the real gap between the
//! key's end and the request: a check against it never blames a fence the
//! agents made in time, however slow a poll was (a slow poll only makes
//! the check less sharp).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use claimd::cluster::NodeSettings;
use claimd::etcd::{TxnOp, TxnOpResponse};
use serde_json::Value;

use super::checker::Violation;
use super::nodes::PREFIX;
use super::workload::monotonic_ns;

/// One fence request, as first seen.
#[derive(Clone, Debug)]
pub struct FenceSeen {
    pub volume: String,
    pub node: String,
    pub by: String,
    pub revision: i64,
    pub seen_ns: u128,
}

#[derive(Debug, Default)]
pub struct LivenessSeen {
    /// Per node: (poll revision, poll send time) of the polls that showed
    /// its liveness key.
    pub present: BTreeMap<String, Vec<(i64, u128)>>,
    /// Per node: W from its settings as last read (None: no window, the
    /// cluster never acts on it).
    pub waits: BTreeMap<String, Option<Duration>>,
    pub fences: Vec<FenceSeen>,
    pub polls: usize,
}

/// Polls until `stop`.
pub fn watch_liveness(
    etcd: &claimd::etcd::EtcdClient,
    stop: &AtomicBool,
    period: Duration,
) -> LivenessSeen {
    let mut seen = LivenessSeen::default();
    let mut known: BTreeSet<(String, i64)> = BTreeSet::new();
    let prefixes = ["nodes/", "node-settings/", "attachments/"].map(|p| format!("{PREFIX}/{p}"));
    while !stop.load(Ordering::SeqCst) {
        let sent = monotonic_ns();
        let read = etcd.txn(
            &[],
            &prefixes
                .iter()
                .map(|p| TxnOp::get_prefix(p.clone()))
                .collect::<Vec<_>>(),
            &[],
        );
        let back = monotonic_ns();
        if let Ok(t) = read {
            seen.polls += 1;
            let ranges: Vec<_> = t
                .responses
                .iter()
                .filter_map(|r| match r {
                    TxnOpResponse::Range(r) => Some(r),
                    _ => None,
                })
                .collect();
            if let [nodes, settings, attachments] = ranges[..] {
                for kv in &nodes.kvs {
                    let node = kv.key_str()[prefixes[0].len()..].to_string();
                    seen.present
                        .entry(node)
                        .or_default()
                        .push((t.revision, sent));
                }
                for kv in &settings.kvs {
                    let node = kv.key_str()[prefixes[1].len()..].to_string();
                    let w = serde_json::from_slice::<NodeSettings>(&kv.value)
                        .ok()
                        .and_then(|s| s.observer_wait());
                    seen.waits.insert(node, w);
                }
                for kv in &attachments.kvs {
                    let key = kv.key_str().to_string();
                    let rec: Value = serde_json::from_slice(&kv.value).unwrap_or(Value::Null);
                    let (Some(node), Some(by)) =
                        (rec["node"].as_str(), rec["requested_by"].as_str())
                    else {
                        continue;
                    };
                    // The request as written (a host's answer rewrites it
                    // later, at a revision that says nothing of the fence).
                    if rec["want"] != "detached" || rec["state"] != "pending" || by == node {
                        continue;
                    }
                    if known.insert((key, kv.mod_revision)) {
                        seen.fences.push(FenceSeen {
                            volume: rec["volume_id"].as_str().unwrap_or("?").to_string(),
                            node: node.to_string(),
                            by: by.to_string(),
                            revision: kv.mod_revision,
                            seen_ns: back,
                        });
                    }
                }
            }
        }
        thread::sleep(period);
    }
    seen
}

/// Check (6) on what the polls saw.
pub fn check_fences(seen: &LivenessSeen) -> Vec<Violation> {
    let mut out = Vec::new();
    for f in &seen.fences {
        let wait = seen.waits.get(&f.node).copied().flatten();
        let last_present = seen
            .present
            .get(&f.node)
            .and_then(|p| p.iter().rev().find(|(rev, _)| *rev < f.revision))
            .map(|(_, sent)| *sent);
        let (Some(wait), Some(last)) = (wait, last_present) else {
            if wait.is_none() {
                out.push(Violation {
                    check: 6,
                    text: format!(
                        "node {} fenced from volume {} by {} (revision {}), but it has no stop_after_disconnect: the cluster never acts on it",
                        f.node, f.volume, f.by, f.revision
                    ),
                });
            }
            continue;
        };
        let gap =
            Duration::from_nanos(u64::try_from(f.seen_ns.saturating_sub(last)).unwrap_or(u64::MAX));
        if gap < wait {
            out.push(Violation {
                check: 6,
                text: format!(
                    "node {} fenced from volume {} by {} (revision {}) at most {gap:?} after its liveness key was last seen, before its W of {wait:?}",
                    f.node, f.volume, f.by, f.revision
                ),
            });
        }
    }
    out
}
