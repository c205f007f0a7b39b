//! The checker: reads the records in the volumes, the mount-table samples,
//! the plugins' call logs, etcd's end state and every agent's state, and
//! lists every violation of the cluster's safety promises.
//!
//! (1) a record written by a holder after another holder's first record of
//!     the same single-writer volume (the order of the lines in the
//!     volume's file decides);
//! (2) two read-write holders with one single-writer volume published at
//!     once (mount table samples, or the call logs' NodePublish..
//!     NodeUnpublish intervals) without a ControllerUnpublish of the older
//!     one between (read-only holders of a multi-node-single-writer volume
//!     are left out: they may sit next to its writer);
//! (3) after heal and settle: a mount without its claim, a claim without a
//!     local record on its node, a local record without its claim;
//! (4) an acknowledged allocation that ended neither mounted (record,
//!     claim and target) nor released (none of them left, its target
//!     unpublished by a NodeUnpublish); a released one with something left;
//! (5) in `evidence.rs`: what readers saw and when holders read or wrote,
//!     against the records files at the end and the claims' lives in etcd;
//! (6) in `fences.rs`: a fence of a node requested before its W had run
//!     out since its liveness key was last seen.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use serde_json::Value;

use super::workload::{Alloc, Release, Seen};

#[derive(Clone, Debug)]
pub struct Violation {
    pub check: u8,
    pub text: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}) {}", self.check, self.text)
    }
}

fn v(check: u8, text: String) -> Violation {
    Violation { check, text }
}

// ---- (1) the records ---------------------------------------------------------

/// One line of a volume's records file.
#[derive(Clone, Debug)]
struct Record {
    line: usize,
    holder: String,
    epoch: i64,
    seq: u64,
    mono_ns: u128,
}

fn parse(text: &str) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for (i, l) in text.lines().enumerate() {
        let f: Vec<&str> = l.split(' ').collect();
        let parsed = (f.len() == 5)
            .then(|| {
                Some(Record {
                    line: i + 1,
                    holder: format!("{}/{}", f[0], f[1]),
                    epoch: f[2].parse().ok()?,
                    seq: f[3].parse().ok()?,
                    mono_ns: f[4].parse().ok()?,
                })
            })
            .flatten();
        match parsed {
            Some(r) => out.push(r),
            None => bad += 1,
        }
    }
    (out, bad)
}

/// Check (1) on one single-writer volume's records file: the number of
/// records read and the violations.
pub fn check_records(volume: &str, text: &str) -> (usize, Vec<Violation>) {
    let (recs, bad) = parse(text);
    let mut out = Vec::new();
    if bad > 0 {
        out.push(v(
            1,
            format!("volume {volume}: {bad} torn or unreadable record lines"),
        ));
    }
    let mut first: HashMap<&str, &Record> = HashMap::new();
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    let mut latest: Option<&Record> = None;
    // (stale holder, newer holder) -> (count, first stale record, newer's first)
    let mut stale: BTreeMap<(String, String), (usize, Record, Record)> = BTreeMap::new();
    for r in &recs {
        if let Some(prev) = last_seq.get(r.holder.as_str()) {
            if r.seq <= *prev {
                out.push(v(
                    1,
                    format!(
                        "volume {volume}: holder {} wrote seq {} after seq {prev} (line {})",
                        r.holder, r.seq, r.line
                    ),
                ));
            }
        }
        last_seq.insert(&r.holder, r.seq);
        if !first.contains_key(r.holder.as_str()) {
            first.insert(&r.holder, r);
            latest = Some(r);
            continue;
        }
        let newest = latest.expect("a holder has written");
        if newest.holder != r.holder {
            let e = stale
                .entry((r.holder.clone(), newest.holder.clone()))
                .or_insert_with(|| (0, r.clone(), newest.clone()));
            e.0 += 1;
        }
    }
    for ((old, new), (count, s, n)) in stale {
        let old_first = first[old.as_str()];
        out.push(v(
            1,
            format!(
                "volume {volume}: {count} record(s) by {old} (epoch {}) after {new}'s first record (epoch {}, line {}, mono {} ns): the first at line {} (seq {}, mono {} ns, {} ms after); {old} began at line {}",
                s.epoch,
                n.epoch,
                n.line,
                n.mono_ns,
                s.line,
                s.seq,
                s.mono_ns,
                s.mono_ns.saturating_sub(n.mono_ns) / 1_000_000,
                old_first.line
            ),
        ));
    }
    (recs.len(), out)
}

// ---- (2) two published at once ---------------------------------------------------

/// A publish interval of one holder: wall-clock ms (`u64::MAX`: to the end).
#[derive(Clone, Debug)]
pub struct Interval {
    pub node: String,
    pub alloc: String,
    pub volume: String,
    pub from_ms: u64,
    pub to_ms: u64,
    pub source: &'static str,
}

impl From<&Seen> for Interval {
    fn from(s: &Seen) -> Interval {
        Interval {
            node: s.node.clone(),
            alloc: s.alloc.clone(),
            volume: s.volume.clone(),
            from_ms: s.first_ms,
            to_ms: s.last_ms,
            source: "mount table",
        }
    }
}

/// `(alloc, volume)` of a target path `.../per-alloc/<alloc>/<volume>/...`.
pub fn target_of(path: &str) -> Option<(String, String)> {
    let rest = path.split("/per-alloc/").nth(1)?;
    let mut parts = rest.split('/');
    Some((parts.next()?.to_string(), parts.next()?.to_string()))
}

/// NodePublish OK .. NodeUnpublish OK per target, from one node's calls.
/// `downs`: wall ms at which the node was lost (its mounts went with it):
/// every interval still open then ends there.
pub fn call_log_intervals(node: &str, calls: &[Value], downs: &[u64]) -> Vec<Interval> {
    let mut open: HashMap<String, u64> = HashMap::new();
    let mut out = Vec::new();
    let mut downs = downs.to_vec();
    downs.sort_unstable();
    let mut next_down = downs.into_iter().peekable();
    for c in calls {
        let at = c["ts_ms"].as_u64().unwrap_or(0);
        while let Some(down) = next_down.next_if(|d| *d <= at) {
            for (target, from) in open.drain() {
                if let Some((alloc, volume)) = target_of(&target) {
                    out.push(Interval {
                        node: node.to_string(),
                        alloc,
                        volume,
                        from_ms: from,
                        to_ms: down,
                        source: "call log",
                    });
                }
            }
        }
        if c["code"] != "OK" {
            continue;
        }
        let Some(target) = c["target_path"].as_str() else {
            continue;
        };
        let ts = c["ts_ms"].as_u64().unwrap_or(0);
        let Some((alloc, volume)) = target_of(target) else {
            continue;
        };
        match c["method"].as_str() {
            Some("NodePublishVolume") => {
                open.entry(target.to_string()).or_insert(ts);
            }
            Some("NodeUnpublishVolume") => {
                if let Some(from) = open.remove(target) {
                    out.push(Interval {
                        node: node.to_string(),
                        alloc,
                        volume,
                        from_ms: from,
                        to_ms: ts,
                        source: "call log",
                    });
                }
            }
            _ => {}
        }
    }
    // Still open after the last call: to the next loss, else to the end.
    let end = next_down.next().unwrap_or(u64::MAX);
    for (target, from) in open {
        if let Some((alloc, volume)) = target_of(&target) {
            out.push(Interval {
                node: node.to_string(),
                alloc,
                volume,
                from_ms: from,
                to_ms: end,
                source: "call log",
            });
        }
    }
    out
}

/// Check (2). `fences`: (external volume ID, external node ID, ts_ms) of
/// every ControllerUnpublish that answered OK.
pub fn check_overlaps(
    single_writer: &BTreeSet<String>,
    intervals: &[Interval],
    fences: &[(String, String, u64)],
    fenced_overlaps: &mut usize,
) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut seen_pairs = BTreeSet::new();
    for (i, x) in intervals.iter().enumerate() {
        if !single_writer.contains(&x.volume) {
            continue;
        }
        for y in &intervals[i + 1..] {
            if y.volume != x.volume || y.alloc == x.alloc {
                continue;
            }
            let (from, to) = (x.from_ms.max(y.from_ms), x.to_ms.min(y.to_ms));
            if from > to {
                continue;
            }
            let (old, new) = if x.from_ms <= y.from_ms {
                (x, y)
            } else {
                (y, x)
            };
            let fenced = fences.iter().any(|(vol, node, ts)| {
                *vol == format!("ext-{}", x.volume)
                    && *node == format!("ext-{}", old.node)
                    && *ts >= old.from_ms
                    && *ts <= new.from_ms
            });
            if fenced {
                *fenced_overlaps += 1;
                continue;
            }
            let key = (x.volume.clone(), old.alloc.clone(), new.alloc.clone());
            if !seen_pairs.insert(key) {
                continue;
            }
            let place = if old.node == new.node {
                format!("on node {}", old.node)
            } else {
                format!("on nodes {} and {}", old.node, new.node)
            };
            let until = if to == u64::MAX {
                "the end of the run".to_string()
            } else {
                format!("{} ms later", to - from)
            };
            out.push(v(
                2,
                format!(
                    "volume {} published {place} at once ({}), no fence between: {} (since {}) and {} (since {}), both from wall ms {from} until {until}",
                    x.volume, new.source, old.alloc, old.from_ms, new.alloc, new.from_ms
                ),
            ));
        }
    }
    out
}

/// Nodes lost and freed by hand (`faults::Kind::NodeLost`, every free
/// answered): (node, wall ms its mounts went, since-start ms it came back).
pub struct Losses(Vec<(String, u64, u64)>);

impl Losses {
    /// When (wall ms) `node` was lost.
    pub fn downs(&self, node: &str) -> Vec<u64> {
        self.0
            .iter()
            .filter(|(n, ..)| n == node)
            .map(|(_, down, _)| *down)
            .collect()
    }
}

/// The losses among the run's events, and the allocations held on a lost
/// node then (acknowledged before it came back): `check_allocs`'s `lost`.
pub fn node_losses(events: &[Value], allocs: &[Alloc]) -> (Losses, BTreeSet<String>) {
    let losses: Vec<(String, u64, u64)> = events
        .iter()
        .filter(|e| {
            e["kind"] == "fault" && e["fault"] == "node-lost-freed-by-hand" && e["freed_ok"] == true
        })
        .filter_map(|e| {
            Some((
                e["node"].as_str()?.to_string(),
                e["down_wall_ms"].as_u64()?,
                e["up_t_ms"].as_u64().unwrap_or(u64::MAX),
            ))
        })
        .collect();
    let lost = allocs
        .iter()
        .filter(|a| {
            losses
                .iter()
                .any(|(n, _, up)| *n == a.node && a.acked_at_ms < *up)
        })
        .map(|a| a.id.clone())
        .collect();
    (Losses(losses), lost)
}

// ---- (3) and (4) the end state ----------------------------------------------------

/// What is left at the end, per place.
#[derive(Default, Debug)]
pub struct EndState {
    /// (volume, alloc) -> (node, state) of claims in etcd.
    pub claims: BTreeMap<(String, String), (String, String)>,
    /// (volume, alloc) with a `freed/` note, and its reason.
    pub freed: BTreeMap<(String, String), String>,
    /// (node, alloc, volume) -> phase of every local record.
    pub records: BTreeMap<(String, String, String), String>,
    /// (node, alloc, volume) of target mounts.
    pub targets: BTreeSet<(String, String, String)>,
    /// (node, volume) of staging mounts.
    pub stagings: BTreeSet<(String, String)>,
    /// (node, volume, alloc) of the per-node claim index
    /// (`node-claims/<node>/<volume>/<alloc>`).
    pub index: BTreeSet<(String, String, String)>,
}

fn freed_note(end: &EndState, vol: &str, alloc: &str) -> String {
    match end.freed.get(&(vol.to_string(), alloc.to_string())) {
        Some(reason) => format!(" (freed/ note: {reason})"),
        None => " (no freed/ note)".to_string(),
    }
}

/// Check (3).
pub fn check_end_state(end: &EndState) -> Vec<Violation> {
    let mut out = Vec::new();
    for (node, alloc, vol) in &end.targets {
        match end.claims.get(&(vol.clone(), alloc.clone())) {
            Some((n, _)) if n == node => {}
            Some((n, _)) => out.push(v(
                3,
                format!(
                    "{vol} is mounted for {alloc} on node {node}, but its claim names node {n}"
                ),
            )),
            None => out.push(v(
                3,
                format!(
                    "{vol} is mounted for {alloc} on node {node} without a claim in etcd{}",
                    freed_note(end, vol, alloc)
                ),
            )),
        }
    }
    for (node, vol) in &end.stagings {
        if !end
            .claims
            .iter()
            .any(|((cv, _), (n, _))| cv == vol && n == node)
        {
            out.push(v(
                3,
                format!("{vol} is staged on node {node} without any claim of that node"),
            ));
        }
    }
    for ((vol, alloc), (node, state)) in &end.claims {
        if !end
            .records
            .contains_key(&(node.clone(), alloc.clone(), vol.clone()))
        {
            out.push(v(
                3,
                format!("claim of {vol} by {alloc} on node {node} ({state}) has no local record on that node"),
            ));
        }
        if let Some(reason) = end.freed.get(&(vol.clone(), alloc.clone())) {
            out.push(v(
                3,
                format!("claim of {vol} by {alloc} on node {node} is in etcd next to a freed/ note ({reason})"),
            ));
        }
    }
    // The claim index names exactly the claims: an entry is written and
    // deleted in the same Txn as its claim.
    for ((vol, alloc), (node, _)) in &end.claims {
        if !end
            .index
            .contains(&(node.clone(), vol.clone(), alloc.clone()))
        {
            out.push(v(
                3,
                format!(
                    "claim of {vol} by {alloc} on node {node} has no entry in node-claims/{node}/"
                ),
            ));
        }
    }
    for (node, vol, alloc) in &end.index {
        match end.claims.get(&(vol.clone(), alloc.clone())) {
            Some((n, _)) if n == node => {}
            other => out.push(v(
                3,
                format!(
                    "node-claims/{node}/{vol}/{alloc} names a claim that is {}",
                    match other {
                        Some((n, _)) => format!("held by node {n}"),
                        None => "gone".to_string(),
                    }
                ),
            )),
        }
    }
    for ((node, alloc, vol), phase) in &end.records {
        match end.claims.get(&(vol.clone(), alloc.clone())) {
            Some((n, _)) if n == node => {}
            _ => out.push(v(
                3,
                format!(
                    "node {node} records {alloc} on {vol} ({phase}) without its claim in etcd{}",
                    freed_note(end, vol, alloc)
                ),
            )),
        }
    }
    out
}

/// Check (4). `unpublished`: (node, alloc, volume) that a NodeUnpublish
/// answered OK for.
/// `lost`: allocations held on a node when it was lost and freed by hand
/// (`faults::Kind::NodeLost`): each must end with nothing left, whatever
/// its workload asked.
pub fn check_allocs(
    allocs: &[Alloc],
    end: &EndState,
    unpublished: &BTreeSet<(String, String, String)>,
    lost: &BTreeSet<String>,
    released_by_agent: &mut usize,
) -> Vec<Violation> {
    let mut out = Vec::new();
    for a in allocs {
        let key = (a.node.clone(), a.id.clone(), a.volume.clone());
        let record = end.records.get(&key);
        let target = end.targets.contains(&key);
        let claim = end.claims.get(&(a.volume.clone(), a.id.clone()));
        let left = || {
            let mut l = Vec::new();
            if let Some(p) = record {
                l.push(format!("a local record ({p})"));
            }
            if target {
                l.push("its target mounted".to_string());
            }
            if let Some((n, s)) = claim {
                l.push(format!("a claim on node {n} ({s})"));
            }
            l.join(", ")
        };
        let nothing = record.is_none() && !target && claim.is_none();
        if a.acked && lost.contains(&a.id) {
            if !nothing {
                out.push(v(
                    4,
                    format!(
                        "{} on node {} ({}) was held when its node was lost and freed by hand, but has {} left",
                        a.id,
                        a.node,
                        a.volume,
                        left()
                    ),
                ));
            }
            continue;
        }
        match (&a.release, a.acked) {
            (Release::NotAsked, true) => {
                let held = record.is_some_and(|p| p == "published")
                    && target
                    && claim.is_some_and(|(n, _)| *n == a.node);
                if held {
                    continue;
                }
                if nothing && unpublished.contains(&key) {
                    *released_by_agent += 1;
                    continue;
                }
                let what = if nothing {
                    "nothing left, and no NodeUnpublish of its target".to_string()
                } else {
                    left()
                };
                out.push(v(
                    4,
                    format!(
                        "{} on node {} ({}, acknowledged at {} ms, never released) ended neither mounted nor released: {what}",
                        a.id, a.node, a.volume, a.acked_at_ms
                    ),
                ));
            }
            (Release::Undelivered, _) => out.push(v(
                4,
                format!(
                    "{} on node {}: its release never reached the agent",
                    a.id, a.node
                ),
            )),
            _ => {
                if !nothing {
                    out.push(v(
                        4,
                        format!(
                            "{} on node {} ({}) was released ({:?}) but has {} left",
                            a.id,
                            a.node,
                            a.volume,
                            a.release,
                            left()
                        ),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_by_an_older_holder_after_a_newer_ones_first_is_found() {
        let text = "a a1 5 0 100\na a1 5 1 200\nb b1 9 0 300\na a1 5 2 400\nb b1 9 1 500\n";
        let (n, vs) = check_records("v", text);
        assert_eq!(n, 5);
        assert_eq!(vs.len(), 1, "{vs:?}");
        assert!(vs[0].text.contains("1 record(s) by a/a1"), "{}", vs[0]);
        let (_, ok) = check_records("v", "a a1 5 0 1\nb b1 9 0 2\nb b1 9 1 3\nc c1 12 0 4\n");
        assert!(ok.is_empty(), "{ok:?}");
    }

    #[test]
    fn overlapping_publishes_without_a_fence_are_found() {
        let iv = |node: &str, alloc: &str, f, t| Interval {
            node: node.into(),
            alloc: alloc.into(),
            volume: "v".into(),
            from_ms: f,
            to_ms: t,
            source: "mount table",
        };
        let sw: BTreeSet<String> = ["v".to_string()].into();
        let ivs = [
            iv("a", "a1", 0, 100),
            iv("b", "b1", 50, 200),
            iv("c", "c1", 201, 300),
        ];
        let mut fenced = 0;
        assert_eq!(check_overlaps(&sw, &ivs, &[], &mut fenced).len(), 1);
        let fence = [("ext-v".to_string(), "ext-a".to_string(), 40)];
        assert!(check_overlaps(&sw, &ivs, &fence, &mut fenced).is_empty());
        assert_eq!(fenced, 1);
    }

    #[test]
    fn a_mount_without_a_claim_and_a_claim_without_a_record_are_found() {
        let k = |a: &str, b: &str| (a.to_string(), b.to_string());
        let mut end = EndState::default();
        end.claims.insert(k("v", "x1"), k("a", "taken"));
        end.records
            .insert(("a".into(), "x1".into(), "v".into()), "published".into());
        end.targets.insert(("a".into(), "x1".into(), "v".into()));
        end.stagings.insert(k("a", "v"));
        end.index.insert(("a".into(), "v".into(), "x1".into()));
        assert!(check_end_state(&end).is_empty());
        // b still has its mount of v, whose claim the cluster freed.
        end.targets.insert(("b".into(), "y1".into(), "v".into()));
        end.freed.insert(k("v", "y1"), "node b disconnected".into());
        // A claim of w nobody records.
        end.claims.insert(k("w", "z1"), k("c", "taken"));
        end.index.insert(("c".into(), "w".into(), "z1".into()));
        let found = check_end_state(&end);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0]
                .text
                .contains("without a claim in etcd (freed/ note: node b"),
            "{}",
            found[0]
        );
        assert!(
            found[1].text.contains("has no local record"),
            "{}",
            found[1]
        );
    }

    #[test]
    fn a_claim_without_its_index_entry_and_a_stale_entry_are_found() {
        let mut end = EndState::default();
        end.claims
            .insert(("v".into(), "x1".into()), ("a".into(), "taken".into()));
        end.records
            .insert(("a".into(), "x1".into(), "v".into()), "published".into());
        end.index.insert(("a".into(), "v".into(), "x1".into()));
        assert!(check_end_state(&end).is_empty());
        end.index.clear();
        let found = check_end_state(&end);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].text.contains("no entry in node-claims/a/"),
            "{}",
            found[0]
        );
        end.index.insert(("a".into(), "v".into(), "x1".into()));
        end.index.insert(("b".into(), "v".into(), "x1".into()));
        end.index.insert(("a".into(), "w".into(), "y1".into()));
        let found = check_end_state(&end);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0]
                .text
                .contains("node-claims/a/w/y1 names a claim that is gone"),
            "{}",
            found[0]
        );
        assert!(found[1].text.contains("held by node a"), "{}", found[1]);
    }
}
