//! Evidence every holder leaves, and check (5) on it.
//!
//! Writers append records (`workload.rs`); **readers** read. The workload's
//! read-only holdings are of two kinds (see `VolSpec`):
//!
//! - `multi-node-single-writer` (sw2) mounted read-only: readers next to at
//!   most one writer, on any node. A reader reads the volume's records
//!   file every period and logs what it saw (node, allocation, epoch, the
//!   time, how many whole records, their length and hash);
//! - `multi-node-reader-only` (mr0): no holder may ever write. The harness
//!   writes its records file once before the agents start; every read must
//!   see exactly that, and so must the file at the end.
//!
//! The harness also polls etcd's claims (`watch_claims`) and notes when it
//! first saw each claim (volume, allocation, create revision: the epoch)
//! gone. Check (5) then fails on
//!
//! (5a) a read that is not a prefix of the volume's records file at the
//!      end (whole lines, by length and FNV-1a hash): the file is only ever
//!      appended to, so any other view is a stale or foreign copy of the
//!      volume. With check (1) on the final file this makes every reader's
//!      view consistent too: no reader can have seen a fenced or stale
//!      writer's record after a newer writer's first record unless (1)
//!      reports it. For mr0, a read (or the final file) that differs from
//!      what the harness wrote: a write into a reader-only volume;
//! (5b) a reader whose view shrank between two of its reads;
//! (5c) a read that succeeded, or a record that was written, after the
//!      harness had seen the holder's claim gone from etcd (and no later
//!      claim of that allocation). The time of a record is taken before
//!      its file is opened, and a read's start before its open, while
//!      "gone" is when the poll that showed it absent had returned: so the
//!      open came after the cluster freed the claim. The cluster frees a
//!      claim only after the holder's own release (its unmount done) or a
//!      fence (the test plugin's fence unmounts the holder's paths), so
//!      any such open is a use of a volume its node no longer holds, a
//!      reader's as much as a writer's. A reader runs only between its
//!      mount's acknowledgement and its release request, so every read is
//!      also under an acknowledged mount by construction.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::{json, Value};

use super::checker::Violation;
use super::nodes::PREFIX;
use super::workload::{monotonic_ns, wall_ms, Alloc, Shared, RECORDS_FILE};

/// FNV-1a, 64 bits: a cheap hash of a prefix, extended line by line.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// One read of a volume's records file by a holder.
#[derive(Clone, Debug)]
pub struct Read {
    pub node: String,
    pub alloc: String,
    pub volume: String,
    pub epoch: i64,
    pub start_ns: u128,
    pub end_ns: u128,
    pub wall_ms: u64,
    /// Whether the file could be read.
    pub ok: bool,
    /// Whole records seen, their bytes and hash.
    pub records: usize,
    pub len: usize,
    pub hash: u64,
    pub error: Option<String>,
}

impl Read {
    pub fn json(&self) -> Value {
        json!({"node": self.node, "alloc": self.alloc, "volume": self.volume,
            "epoch": self.epoch, "start_ns": self.start_ns.to_string(),
            "end_ns": self.end_ns.to_string(), "wall_ms": self.wall_ms, "ok": self.ok,
            "records": self.records, "len": self.len, "hash": format!("{:016x}", self.hash),
            "error": self.error})
    }
}

/// A reader thread of one read-only holding.
pub struct Reader {
    stop: Arc<AtomicBool>,
    handle: thread::JoinHandle<()>,
}

impl Reader {
    /// `losses`: the node's loss count before the mount was asked (see
    /// `Writer::start`).
    pub fn start(shared: &Arc<Shared>, a: &Alloc, period: Duration, losses: u64) -> Reader {
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sh) = (stop.clone(), shared.clone());
        let path = a
            .host_path
            .as_ref()
            .expect("an acknowledged mount has a path")
            .join(RECORDS_FILE);
        let a = a.clone();
        let ni = shared.node_index(&a.node);
        let handle = thread::Builder::new()
            .name(format!("reader-{}", a.id))
            .spawn(move || {
                let mut reads = Vec::new();
                while !st.load(Ordering::SeqCst) && !sh.writers_stop.load(Ordering::SeqCst) {
                    let gate = sh.node_losses[ni].read().expect("node_losses lock");
                    if *gate != losses {
                        break;
                    }
                    reads.push(read_once(&a, &path));
                    drop(gate);
                    thread::sleep(period);
                }
                let ok = reads.iter().filter(|r| r.ok).count();
                sh.event(json!({"kind": "reader-end", "alloc": a.id, "node": a.node,
                    "reads": reads.len(), "ok": ok,
                    "first_error": reads.iter().find_map(|r| r.error.clone())}));
                sh.reads.lock().expect("reads lock").extend(reads);
            })
            .expect("start a reader");
        Reader { stop, handle }
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.handle.join();
    }
}

fn read_once(a: &Alloc, path: &Path) -> Read {
    let (start_ns, wall) = (monotonic_ns(), wall_ms());
    let got = fs::read(path);
    let mut r = Read {
        node: a.node.clone(),
        alloc: a.id.clone(),
        volume: a.volume.clone(),
        epoch: a.epoch,
        start_ns,
        end_ns: monotonic_ns(),
        wall_ms: wall,
        ok: false,
        records: 0,
        len: 0,
        hash: FNV_START,
        error: None,
    };
    match got {
        Ok(bytes) => {
            // A writer's append may be half-way: whole lines only.
            let len = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            r.ok = true;
            r.len = len;
            r.records = bytes[..len].iter().filter(|&&b| b == b'\n').count();
            r.hash = fnv(FNV_START, &bytes[..len]);
        }
        Err(e) => r.error = Some(e.to_string()),
    }
    r
}

// ---- The claims as the harness saw them ------------------------------------------

/// One claim (volume, allocation, epoch) as the polls saw it: when it was
/// first seen, and when a poll that had returned showed it gone.
#[derive(Clone, Debug)]
pub struct ClaimLife {
    pub first_ns: u128,
    pub gone_ns: Option<u128>,
}

pub type Lives = BTreeMap<(String, String, i64), ClaimLife>;

/// Polls `<prefix>/claims/` every `period` until `stop`.
pub fn watch_claims(etcd: &claimd::etcd::EtcdClient, stop: &AtomicBool, period: Duration) -> Lives {
    let mut lives = Lives::new();
    let prefix = format!("{PREFIX}/claims/");
    while !stop.load(Ordering::SeqCst) {
        if let Ok(resp) = etcd.range_prefix(&prefix) {
            let now = monotonic_ns();
            let mut present = std::collections::BTreeSet::new();
            for kv in &resp.kvs {
                let key = kv.key_str();
                let Some((vol, alloc)) = key[prefix.len()..].split_once('/') else {
                    continue;
                };
                let k = (vol.to_string(), alloc.to_string(), kv.create_revision);
                lives.entry(k.clone()).or_insert(ClaimLife {
                    first_ns: now,
                    gone_ns: None,
                });
                present.insert(k);
            }
            for (k, l) in lives.iter_mut() {
                if l.gone_ns.is_none() && !present.contains(k) {
                    l.gone_ns = Some(now);
                }
            }
        }
        thread::sleep(period);
    }
    lives
}

/// When the claim of `alloc` on `volume` with `epoch` was seen gone, with
/// no later claim of that allocation alive at `t`; None: held (or not
/// known).
fn gone_before(lives: &Lives, volume: &str, alloc: &str, epoch: i64, t: u128) -> Option<u128> {
    let life = lives.get(&(volume.to_string(), alloc.to_string(), epoch))?;
    let gone = life.gone_ns.filter(|g| t > *g)?;
    let later_alive = lives.iter().any(|((v, a, e), l)| {
        v == volume && a == alloc && *e > epoch && l.gone_ns.map_or(true, |g| g >= t)
    });
    (!later_alive).then_some(gone)
}

// ---- Check (5) ---------------------------------------------------------------

/// A volume's records file at the end: its whole-line prefixes by length.
pub struct FinalFile {
    pub prefixes: HashMap<usize, u64>,
    pub len: usize,
}

impl FinalFile {
    pub fn new(text: &[u8]) -> FinalFile {
        let mut prefixes = HashMap::from([(0, FNV_START)]);
        let (mut h, mut start) = (FNV_START, 0);
        for (i, &b) in text.iter().enumerate() {
            if b == b'\n' {
                h = fnv(h, &text[start..=i]);
                start = i + 1;
                prefixes.insert(start, h);
            }
        }
        FinalFile {
            prefixes,
            len: text.len(),
        }
    }
}

fn v(text: String) -> Violation {
    Violation { check: 5, text }
}

/// Check (5a) and (5b) on the reads of one volume. `fixed`: the content of
/// a reader-only volume (every read must be all of it). Returns the reads
/// checked.
pub fn check_reads(
    volume: &str,
    reads: &[Read],
    end: &FinalFile,
    fixed: Option<&[u8]>,
    out: &mut Vec<Violation>,
) -> usize {
    let mut checked = 0;
    let mut by_reader: BTreeMap<&str, Vec<&Read>> = BTreeMap::new();
    for r in reads.iter().filter(|r| r.volume == volume && r.ok) {
        checked += 1;
        by_reader.entry(&r.alloc).or_default().push(r);
    }
    let fixed = fixed.map(|f| (f.len(), fnv(FNV_START, f)));
    for (alloc, rs) in by_reader {
        let mut bad = rs
            .iter()
            .filter(|r| end.prefixes.get(&r.len) != Some(&r.hash));
        if let Some(first) = bad.next() {
            out.push(v(format!(
                "volume {volume}: {} read(s) by {} on node {} are not a prefix of the records file at the end ({} bytes): the first at wall ms {} saw {} records, {} bytes",
                1 + bad.count(), alloc, first.node, end.len, first.wall_ms, first.records, first.len
            )));
        }
        if let Some((len, hash)) = fixed {
            let n = rs.iter().filter(|r| (r.len, r.hash) != (len, hash)).count();
            if n > 0 {
                out.push(v(format!(
                    "volume {volume} (reader-only): {n} read(s) by {alloc} differ from what the harness wrote ({len} bytes)"
                )));
            }
        }
        for w in rs.windows(2) {
            if w[1].len < w[0].len {
                out.push(v(format!(
                    "volume {volume}: the view of {alloc} on node {} shrank from {} to {} records (reads at wall ms {} and {})",
                    w[0].node, w[0].records, w[1].records, w[0].wall_ms, w[1].wall_ms
                )));
                break;
            }
        }
    }
    if let Some((len, hash)) = fixed {
        if end.prefixes.get(&len) != Some(&hash) || end.len != len {
            out.push(v(format!(
                "volume {volume} (reader-only): its records file changed ({len} bytes written by the harness, {} at the end)",
                end.len
            )));
        }
    }
    checked
}

/// Check (5c) on the reads: (reads checked against a known claim, reads
/// whose epoch was not known).
pub fn check_reads_held(reads: &[Read], lives: &Lives, out: &mut Vec<Violation>) -> (usize, usize) {
    let (mut checked, mut unknown) = (0, 0);
    let mut after: BTreeMap<(&str, &str), (usize, &Read, u128)> = BTreeMap::new();
    for r in reads.iter().filter(|r| r.ok) {
        if r.epoch == 0 {
            unknown += 1;
            continue;
        }
        checked += 1;
        if let Some(g) = gone_before(lives, &r.volume, &r.alloc, r.epoch, r.start_ns) {
            let e = after.entry((&r.volume, &r.alloc)).or_insert((0, r, g));
            e.0 += 1;
        }
    }
    for ((vol, alloc), (n, first, gone)) in after {
        out.push(v(format!(
            "volume {vol}: {n} read(s) by {alloc} on node {} succeeded after its claim (epoch {}) was gone from etcd: the first began {} ms after",
            first.node,
            first.epoch,
            (first.start_ns - gone) / 1_000_000
        )));
    }
    (checked, unknown)
}

/// Check (5c) on one volume's records: (records checked against a known
/// claim, records whose epoch was not known).
pub fn check_records_held(
    volume: &str,
    text: &str,
    lives: &Lives,
    out: &mut Vec<Violation>,
) -> (usize, usize) {
    let (mut checked, mut unknown) = (0, 0);
    let mut after: BTreeMap<String, (usize, usize, u128, u128)> = BTreeMap::new();
    for (i, l) in text.lines().enumerate() {
        let f: Vec<&str> = l.split(' ').collect();
        let (Some(alloc), Some(epoch), Some(mono)) = (
            f.get(1),
            f.get(2).and_then(|e| e.parse::<i64>().ok()),
            f.get(4).and_then(|m| m.parse::<u128>().ok()),
        ) else {
            continue;
        };
        if f.len() != 5 || epoch == 0 {
            unknown += 1;
            continue;
        }
        checked += 1;
        if let Some(g) = gone_before(lives, volume, alloc, epoch, mono) {
            let e = after
                .entry(format!("{}/{alloc} (epoch {epoch})", f[0]))
                .or_insert((0, i + 1, mono, g));
            e.0 += 1;
        }
    }
    for (holder, (n, line, mono, gone)) in after {
        out.push(v(format!(
            "volume {volume}: {n} record(s) by {holder} written after its claim was gone from etcd: the first at line {line}, {} ms after",
            (mono - gone) / 1_000_000
        )));
    }
    (checked, unknown)
}

/// Where a run keeps the reads.
pub fn write_reads(path: &PathBuf, reads: &[Read]) {
    let text: String = reads.iter().map(|r| format!("{}\n", r.json())).collect();
    let _ = fs::write(path, text);
}

/// Every change under the prefix since revision 1 (compaction is off).
pub fn etcd_history(etcd: &claimd::etcd::EtcdClient) -> Vec<Value> {
    let Ok(now) = etcd.range_prefix(format!("{PREFIX}/")) else {
        return vec![json!({"error": "cannot read etcd"})];
    };
    let p = format!("{PREFIX}/").into_bytes();
    let Ok(w) = etcd.watch(&p, claimd::etcd::prefix_end(&p), 1) else {
        return vec![json!({"error": "cannot watch etcd"})];
    };
    let mut out = Vec::new();
    let mut last = 0;
    while last < now.revision {
        match w.recv_timeout(Duration::from_secs(5)) {
            Ok(Some(ev)) => {
                last = ev.revision();
                let (op, kv) = match &ev {
                    claimd::etcd::WatchEvent::Put(kv) => ("put", kv),
                    claimd::etcd::WatchEvent::Delete(kv) => ("delete", kv),
                    claimd::etcd::WatchEvent::Progress { .. } => continue,
                };
                out.push(
                    json!({"rev": kv.mod_revision, "op": op, "key": kv.key_str(),
                    "create_revision": kv.create_revision,
                    "value": String::from_utf8_lossy(&kv.value)}),
                );
            }
            _ => break,
        }
    }
    out
}

/// One JSON value per line (best effort: the files are evidence).
pub fn write_lines(path: &Path, lines: &[Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let _ = fs::write(path, text);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(alloc: &str, content: &[u8], start_ns: u128, epoch: i64) -> Read {
        let len = content
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        Read {
            node: "a".into(),
            alloc: alloc.into(),
            volume: "v".into(),
            epoch,
            start_ns,
            end_ns: start_ns,
            wall_ms: 0,
            ok: true,
            records: content[..len].iter().filter(|&&b| b == b'\n').count(),
            len,
            hash: fnv(FNV_START, &content[..len]),
            error: None,
        }
    }

    #[test]
    fn a_view_that_is_not_a_prefix_or_shrinks_is_found() {
        let end = FinalFile::new(b"a a1 5 0 1\na a1 5 1 2\nb b1 9 0 3\n");
        let good = [
            read("r1", b"", 1, 7),
            read("r1", b"a a1 5 0 1\na a1", 2, 7),
            read("r1", b"a a1 5 0 1\na a1 5 1 2\nb b1 9 0 3\n", 3, 7),
        ];
        let mut out = Vec::new();
        assert_eq!(check_reads("v", &good, &end, None, &mut out), 3);
        assert!(out.is_empty(), "{out:?}");
        let bad = [
            read("r2", b"a a1 5 0 1\nb b1 9 0 3\n", 1, 7),
            read("r3", b"a a1 5 0 1\na a1 5 1 2\n", 1, 7),
            read("r3", b"a a1 5 0 1\n", 2, 7),
        ];
        check_reads("v", &bad, &end, None, &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out[0].text.contains("not a prefix"), "{}", out[0]);
        assert!(out[1].text.contains("shrank from 2 to 1"), "{}", out[1]);
        // A reader-only volume: every read is all of the fixed content.
        let fixed = b"seed mr 0 0 0\nseed mr 0 1 0\n";
        let end = FinalFile::new(fixed);
        let mut out = Vec::new();
        check_reads(
            "v",
            &[read("r4", b"seed mr 0 0 0\n", 1, 7)],
            &end,
            Some(fixed),
            &mut out,
        );
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(out[0].text.contains("differ from what the harness wrote"));
    }

    #[test]
    fn a_use_after_the_claim_was_seen_gone_is_found() {
        let mut lives = Lives::new();
        let life = |first_ns, gone_ns| ClaimLife { first_ns, gone_ns };
        lives.insert(("v".into(), "w1".into(), 5), life(10, Some(100)));
        lives.insert(("v".into(), "r1".into(), 7), life(10, Some(200)));
        let text = "a w1 5 0 50\na w1 5 1 150\nb w2 9 0 160\nc w3 0 0 170\n";
        let mut out = Vec::new();
        assert_eq!(check_records_held("v", text, &lives, &mut out), (3, 1));
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(
            out[0].text.contains("1 record(s) by a/w1 (epoch 5)"),
            "{}",
            out[0]
        );
        let reads = [read("r1", b"", 150, 7), read("r1", b"", 250, 7)];
        let mut out = Vec::new();
        assert_eq!(check_reads_held(&reads, &lives, &mut out), (2, 0));
        assert_eq!(out.len(), 1, "{out:?}");
        // A later claim of the same allocation, alive then: held.
        lives.insert(("v".into(), "r1".into(), 12), life(240, None));
        let mut out = Vec::new();
        check_reads_held(&reads, &lives, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }
}
