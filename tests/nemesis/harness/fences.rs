//! Check (6): the cluster acts on a node only once it has been gone for
//! its W (`observer_wait`, from the settings the node had published at
//! the time) since its liveness key went. An act is a fence request
//! (`attachments/<volume>/<node>` written pending, want detached, while
//! another node's reaper holds `reaper-locks/<node>`: a reaper writes its
//! fences only under that lock, which it takes only once it counted W) or
//! a reaper's free (a `freed/` note, by another node, for a disconnect),
//! both read from etcd's full history at the end of the run, so none is
//! missed however fast it was answered. (A detach request of the node
//! itself written while a reaper holds its lock counts as a fence too: the
//! lock stands for the reaper's decision that W ran out, so such a request
//! is late enough whenever the reaper was right.)
//!
//! etcd keeps revisions, not times. The harness polls etcd's revision
//! every period (`poll_revisions`), noting each poll's send and return
//! time (monotonic). A write at revision r came after the send of the last
//! poll that answered a revision below r, and before the return of the
//! first poll that answered r or later. So for a key deleted at revision d
//! and an act at revision a, `return(a) - send(d)` is longer than the real
//! gap: a check against it never blames an act the agents made in time,
//! however slow a poll was (a slow poll only makes the check less sharp).
//! An act of a node whose key is present at its revision is a violation
//! too (every act's `Txn` compares it absent).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use claimd::cluster::NodeSettings;
use serde_json::Value;

use super::checker::Violation;
use super::nodes::PREFIX;
use super::workload::monotonic_ns;

/// (revision answered, send time, return time) of each poll.
pub type Polls = Vec<(i64, u128, u128)>;

/// Polls etcd's revision until `stop`.
pub fn poll_revisions(
    etcd: &claimd::etcd::EtcdClient,
    stop: &AtomicBool,
    period: Duration,
) -> Polls {
    let mut out = Vec::new();
    let key = format!("{PREFIX}/nodes/");
    while !stop.load(Ordering::SeqCst) {
        let sent = monotonic_ns();
        if let Ok(r) = etcd.range_prefix(&key) {
            out.push((r.revision, sent, monotonic_ns()));
        }
        thread::sleep(period);
    }
    out
}

/// What check (6) looked at.
#[derive(Debug, Default)]
pub struct FenceFigures {
    pub fences: usize,
    pub frees: usize,
    /// Acts outside the polled span (their times cannot be bounded).
    pub unknown: usize,
}

/// Per node, as the history stands at some revision.
#[derive(Default)]
struct NodeSeen {
    /// The revision its key was deleted at; None while it exists (or
    /// before it ever did).
    gone_at: Option<i64>,
    present: bool,
    wait: Option<Duration>,
    /// The node whose reaper holds its lock now.
    reaped_by: Option<String>,
}

/// Check (6) on etcd's history (`etcd_history`'s lines) and the polls.
pub fn check_acts(history: &[Value], polls: &Polls) -> (Vec<Violation>, FenceFigures) {
    let mut out = Vec::new();
    let mut figures = FenceFigures::default();
    let mut nodes: BTreeMap<String, NodeSeen> = BTreeMap::new();
    // The send of the last poll below `rev`; the return of the first at or
    // above it.
    let after = |rev: i64| polls.iter().rev().find(|p| p.0 < rev).map(|p| p.1);
    let before = |rev: i64| polls.iter().find(|p| p.0 >= rev).map(|p| p.2);
    let nodes_p = format!("{PREFIX}/nodes/");
    let settings_p = format!("{PREFIX}/node-settings/");
    let attach_p = format!("{PREFIX}/attachments/");
    let freed_p = format!("{PREFIX}/freed/");
    let locks_p = format!("{PREFIX}/reaper-locks/");
    for e in history {
        let (Some(key), Some(rev), Some(op)) =
            (e["key"].as_str(), e["rev"].as_i64(), e["op"].as_str())
        else {
            continue;
        };
        let put = op == "put";
        let value: Value = e["value"]
            .as_str()
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or(Value::Null);
        if let Some(n) = key.strip_prefix(&nodes_p) {
            let s = nodes.entry(n.to_string()).or_default();
            s.present = put;
            s.gone_at = (!put).then_some(rev);
            continue;
        }
        if let Some(n) = key.strip_prefix(&locks_p) {
            nodes.entry(n.to_string()).or_default().reaped_by =
                put.then(|| value["host"].as_str().unwrap_or("?").to_string());
            continue;
        }
        if let Some(n) = key.strip_prefix(&settings_p) {
            if put {
                let w = serde_json::from_value::<NodeSettings>(value)
                    .ok()
                    .and_then(|s| s.observer_wait());
                nodes.entry(n.to_string()).or_default().wait = w;
            }
            continue;
        }
        // The act, its node and who did it.
        let act = if key.starts_with(&attach_p) {
            let Some(node) = value["node"].as_str() else {
                continue;
            };
            let Some(by) = nodes.get(node).and_then(|s| s.reaped_by.clone()) else {
                continue;
            };
            if !put || value["want"] != "detached" || value["state"] != "pending" {
                continue;
            }
            figures.fences += 1;
            (
                "fenced",
                node.to_string(),
                by.to_string(),
                value["volume_id"].clone(),
            )
        } else if key.starts_with(&freed_p) {
            let (Some(node), Some(by)) = (
                value["claim"]["node"].as_str(),
                value["freed_by_node"].as_str(),
            ) else {
                continue;
            };
            let reaper = value["reason"]
                .as_str()
                .is_some_and(|r| r.contains("disconnected"));
            if !put || by == node || !reaper {
                continue;
            }
            figures.frees += 1;
            (
                "freed",
                node.to_string(),
                by.to_string(),
                value["claim"]["volume_id"].clone(),
            )
        } else {
            continue;
        };
        let (what, node, by, volume) = act;
        let s = nodes.entry(node.clone()).or_default();
        if s.present && what == "fenced" {
            // A reaper's fence request compares the node's key absent: one
            // written while the key exists is the node's own (its release,
            // while a reaper that has not noticed it is back still holds
            // the lock). Reapers' compares are pinned by
            // tests/cluster/fencing.rs; frees are told apart by their note.
            figures.fences -= 1;
            continue;
        }
        if s.present {
            out.push(Violation {
                check: 6,
                text: format!(
                    "node {node} {what} (volume {volume}) by {by} at revision {rev} while its liveness key existed"
                ),
            });
            continue;
        }
        let Some(wait) = s.wait else {
            out.push(Violation {
                check: 6,
                text: format!(
                    "node {node} {what} (volume {volume}) by {by} at revision {rev}, but it has no stop_after_disconnect: the cluster never acts on it"
                ),
            });
            continue;
        };
        let gone_at = s.gone_at.unwrap_or(0);
        let (Some(from), Some(to)) = (after(gone_at), before(rev)) else {
            figures.unknown += 1;
            continue;
        };
        let gap = Duration::from_nanos(u64::try_from(to.saturating_sub(from)).unwrap_or(u64::MAX));
        if gap < wait {
            out.push(Violation {
                check: 6,
                text: format!(
                    "node {node} {what} (volume {volume}) by {by} at revision {rev}, at most {gap:?} after its liveness key went (revision {gone_at}), before its W of {wait:?}"
                ),
            });
        }
    }
    (out, figures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn put(rev: i64, key: &str, value: Value) -> Value {
        json!({"key": format!("{PREFIX}/{key}"), "rev": rev, "op": "put", "value": value.to_string()})
    }

    /// Seed 75676 (with b61c888): node b came back while c's reaper still
    /// held b's lock, then released its own volume: its own detach request
    /// was taken for c's fence "while its liveness key existed".
    #[test]
    fn a_nodes_own_detach_while_a_reaper_holds_its_lock_is_no_fence() {
        let request =
            json!({"node": "b", "volume_id": "sw0", "want": "detached", "state": "pending"});
        let history = vec![
            put(242, "reaper-locks/b", json!({"host": "c"})),
            put(261, "nodes/b", json!({"node": "b"})),
            put(277, "attachments/sw0/b", request),
        ];
        let (violations, figures) = check_acts(&history, &Vec::new());
        assert!(violations.is_empty(), "{violations:?}");
        assert_eq!(figures.fences, 0);
    }
}
