//! The state journal: what changed, appended as one line per durable write.
//!
//! `state.json` is a snapshot; `state.journal` holds, line by line, the
//! changes made since that snapshot. A line is
//!
//! ```text
//! <crc32c of the JSON, 8 hex digits> <JSON of a Delta>\n
//! ```
//!
//! and a `Delta` carries whole records: the new value of every volume,
//! claim, allocation added or dropped, and, inside an allocation that
//! stays, of every volume record that changed (or its removal). Replaying
//! the lines in order over the snapshot gives the state; replaying them over
//! a later snapshot that already contains them changes nothing (each line
//! sets values to what they were then, and the later lines set them to
//! what the later snapshot holds; a change inside an allocation that the
//! later snapshot no longer has is skipped, as a later line drops it),
//! which keeps a crash in the middle of a compaction harmless.
//!
//! Only the last line can be torn by a crash (each durable write appends one
//! line and waits for it to reach the disk before anything depends on it),
//! so a bad last line is dropped; a bad line with anything after it is
//! corruption.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::model::{AllocRecord, AllocVolume, Claim, ClaimKey, SharedMap, StateFile};
use crate::volumes::VolumeSpec;

pub const JOURNAL_FILE: &str = "state.journal";

/// The records that changed between two states.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// Volume ID -> new spec, or null when deregistered.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volumes: BTreeMap<String, Option<Arc<VolumeSpec>>>,
    /// Claims taken or changed (whole claims).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<Arc<Claim>>,
    /// Claims freed: [volume ID, allocation ID].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims_freed: Vec<ClaimKey>,
    /// Allocations added (the whole record) or dropped (null).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocs: BTreeMap<String, Option<Arc<AllocRecord>>>,
    /// Allocation ID -> what changed inside an allocation that stays.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub alloc_changes: BTreeMap<String, AllocChange>,
}

/// What changed inside one allocation: its releasing flag (always given),
/// its reference count (given when not 1, as in the record) and the volume
/// records that changed.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocChange {
    pub releasing: bool,
    #[serde(
        default = "super::model::one_reference",
        skip_serializing_if = "super::model::is_one_reference"
    )]
    pub references: u32,
    /// Alias -> new volume record, or null when dropped.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volumes: BTreeMap<String, Option<Arc<AllocVolume>>>,
}

fn diff_shared<K: Ord, V: PartialEq>(
    old: &SharedMap<K, V>,
    new: &SharedMap<K, V>,
    changed: impl FnMut(&K, Option<&Arc<V>>),
) {
    SharedMap::diff(old, new, changed);
}

/// Walks two sorted maps side by side and reports every key whose value
/// differs: `Some(new)` for added or changed, `None` for removed. Shared
/// records (the same `Arc`) are skipped without comparing them.
fn diff_maps<K: Ord + Clone, V: PartialEq>(
    old: &BTreeMap<K, Arc<V>>,
    new: &BTreeMap<K, Arc<V>>,
    mut changed: impl FnMut(&K, Option<&Arc<V>>),
) {
    let mut o = old.iter().peekable();
    let mut n = new.iter().peekable();
    loop {
        match (o.peek(), n.peek()) {
            (None, None) => return,
            (Some((ok, _)), None) => {
                changed(ok, None);
                o.next();
            }
            (None, Some((nk, nv))) => {
                changed(nk, Some(nv));
                n.next();
            }
            (Some((ok, ov)), Some((nk, nv))) => match ok.cmp(nk) {
                std::cmp::Ordering::Less => {
                    changed(ok, None);
                    o.next();
                }
                std::cmp::Ordering::Greater => {
                    changed(nk, Some(nv));
                    n.next();
                }
                std::cmp::Ordering::Equal => {
                    if !Arc::ptr_eq(ov, nv) && ov != nv {
                        changed(nk, Some(nv));
                    }
                    o.next();
                    n.next();
                }
            },
        }
    }
}

impl Delta {
    /// What turns `old` into `new`.
    pub fn between(old: &StateFile, new: &StateFile) -> Delta {
        let mut d = Delta {
            boot_id: (old.boot_id != new.boot_id).then(|| new.boot_id.clone()),
            ..Delta::default()
        };
        diff_shared(&old.volumes, &new.volumes, |k, v| {
            d.volumes.insert(k.clone(), v.cloned());
        });
        diff_shared(&old.claims, &new.claims, |k, v| match v {
            Some(c) => d.claims.push(c.clone()),
            None => d.claims_freed.push(k.clone()),
        });
        diff_shared(&old.allocs, &new.allocs, |k, v| {
            match (old.allocs.get(k), v) {
                (Some(o), Some(n)) if o.id == n.id => {
                    let mut c = AllocChange {
                        releasing: n.releasing,
                        references: n.references,
                        volumes: BTreeMap::new(),
                    };
                    diff_maps(&o.volumes, &n.volumes, |alias, v| {
                        c.volumes.insert(alias.clone(), v.cloned());
                    });
                    d.alloc_changes.insert(k.clone(), c);
                }
                _ => {
                    d.allocs.insert(k.clone(), v.cloned());
                }
            }
        });
        d
    }

    pub fn is_empty(&self) -> bool {
        self.boot_id.is_none()
            && self.volumes.is_empty()
            && self.claims.is_empty()
            && self.claims_freed.is_empty()
            && self.allocs.is_empty()
            && self.alloc_changes.is_empty()
    }

    pub fn apply(self, s: &mut StateFile) {
        if let Some(b) = self.boot_id {
            s.boot_id = b;
        }
        for (k, v) in self.volumes {
            match v {
                Some(v) => s.volumes.insert(k, v),
                None => s.volumes.remove(&k),
            };
        }
        for k in self.claims_freed {
            s.claims.remove(&k);
        }
        for c in self.claims {
            s.claims
                .insert((c.volume_id.clone(), c.alloc_id.clone()), c);
        }
        for (k, v) in self.allocs {
            match v {
                Some(v) => s.allocs.insert(k, v),
                None => s.allocs.remove(&k),
            };
        }
        for (k, c) in self.alloc_changes {
            // Missing only when replaying over a later snapshot, where a
            // later line drops the allocation.
            let Some(a) = s.alloc_mut(&k) else {
                continue;
            };
            a.releasing = c.releasing;
            a.references = c.references;
            for (alias, v) in c.volumes {
                match v {
                    Some(v) => a.volumes.insert(alias, v),
                    None => a.volumes.remove(&alias),
                };
            }
        }
    }
}

const fn crc32c_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

const CRC32C: [u32; 256] = crc32c_table();

/// CRC-32C (Castagnoli), as used by ext4 and iSCSI.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC32C[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// One journal line, newline included.
pub fn encode(delta: &Delta) -> serde_json::Result<Vec<u8>> {
    let json = serde_json::to_vec(delta)?;
    let mut line = format!("{:08x} ", crc32c(&json)).into_bytes();
    line.reserve(json.len() + 1);
    line.extend_from_slice(&json);
    line.push(b'\n');
    Ok(line)
}

/// Why a line does not decode. Only damage a cut-off write can cause
/// (`Torn`) is forgiven in the last line: a line whose checksum matches was
/// written whole, so if it does not parse it is corruption wherever it is.
enum Bad {
    Torn(String),
    Invalid(String),
}

fn decode(line: &[u8]) -> Result<Delta, Bad> {
    if line.len() < 9 || line[8] != b' ' {
        return Err(Bad::Torn("no checksum".to_string()));
    }
    let want = std::str::from_utf8(&line[..8])
        .ok()
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| Bad::Torn("the checksum is not hexadecimal".to_string()))?;
    let json = &line[9..];
    let got = crc32c(json);
    if got != want {
        return Err(Bad::Torn(format!(
            "checksum mismatch ({got:08x}, recorded {want:08x})"
        )));
    }
    serde_json::from_slice(json).map_err(|e| {
        Bad::Invalid(format!(
            "checksum matches but the change does not parse: {e}"
        ))
    })
}

/// A journal read back.
#[derive(Debug, Default)]
pub struct Replay {
    pub deltas: Vec<Delta>,
    /// The last line was incomplete or damaged (a write cut off by a crash)
    /// and was left out.
    pub torn_tail: bool,
}

/// A damaged line that is not the last one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    /// 1-based.
    pub line: usize,
    pub reason: String,
}

/// Parses a whole journal. A damaged or unterminated last line is a torn
/// write and is left out; a damaged line followed by more data is
/// corruption.
pub fn parse(bytes: &[u8]) -> Result<Replay, Corruption> {
    let mut r = Replay::default();
    let mut pos = 0;
    let mut line_no = 0;
    while pos < bytes.len() {
        line_no += 1;
        let (line, next, terminated) = match bytes[pos..].iter().position(|&b| b == b'\n') {
            Some(e) => (&bytes[pos..pos + e], pos + e + 1, true),
            None => (&bytes[pos..], bytes.len(), false),
        };
        let last = next >= bytes.len();
        let decoded = if terminated {
            decode(line)
        } else {
            Err(Bad::Torn("the line is not terminated".to_string()))
        };
        match decoded {
            Ok(d) => r.deltas.push(d),
            Err(Bad::Torn(_)) if last => {
                r.torn_tail = true;
                break;
            }
            Err(Bad::Torn(reason) | Bad::Invalid(reason)) => {
                return Err(Corruption {
                    line: line_no,
                    reason,
                })
            }
        }
        pos = next;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Phase;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    fn alloc(id: &str, phase: Phase) -> Arc<AllocRecord> {
        let v: AllocVolume = serde_json::from_value(serde_json::json!({
            "alias": "data", "volume_id": "v", "plugin_id": "p", "external_volume_id": "x",
            "usage": {"read_only": false, "access_mode": "single-node-writer", "attachment": "file-system"},
            "target_path": format!("/m/{id}"), "phase": phase,
        }))
        .expect("volume record");
        Arc::new(AllocRecord {
            id: id.into(),
            releasing: false,
            references: 1,
            volumes: [("data".to_string(), Arc::new(v))].into(),
        })
    }

    #[test]
    fn between_then_apply_reproduces_the_new_state() {
        let mut old = StateFile::new("b1");
        old.allocs
            .insert("a1".into(), alloc("a1", Phase::Published));
        old.allocs.insert("a2".into(), alloc("a2", Phase::Claiming));
        old.allocs
            .insert("a3".into(), alloc("a3", Phase::Published));
        let mut new = old.clone();
        new.boot_id = "b2".into();
        new.allocs.remove("a1");
        new.volume_mut("a2", "data").expect("a2").phase = Phase::Mounting;
        new.allocs.insert("a4".into(), alloc("a4", Phase::Claiming));
        // The same value in a new Arc is not a change.
        new.allocs
            .insert("a3".into(), alloc("a3", Phase::Published));
        let d = Delta::between(&old, &new);
        assert_eq!(d.boot_id.as_deref(), Some("b2"));
        // Added and dropped allocations are whole; a2 stays and only its
        // changed volume is written; a3 is unchanged.
        assert_eq!(d.allocs.keys().collect::<Vec<_>>(), ["a1", "a4"], "{d:?}");
        assert!(d.allocs["a1"].is_none());
        assert_eq!(d.alloc_changes.keys().collect::<Vec<_>>(), ["a2"]);
        assert_eq!(
            d.alloc_changes["a2"].volumes["data"]
                .as_ref()
                .map(|v| v.phase),
            Some(Phase::Mounting)
        );
        let line = encode(&d).expect("encode");
        let mut replayed = old.clone();
        for d in parse(&line).expect("parse").deltas {
            d.apply(&mut replayed);
        }
        assert_eq!(replayed, new);
        // Replaying over the newer state changes nothing.
        let mut again = new.clone();
        for d in parse(&line).expect("parse").deltas {
            d.apply(&mut again);
        }
        assert_eq!(again, new);
        assert!(Delta::between(&new, &new.clone()).is_empty());
    }

    /// A reference count is written in a change of an allocation that
    /// stays, only when it is not 1, and replays either way.
    #[test]
    fn a_changed_reference_count_replays() {
        let mut old = StateFile::new("b");
        old.allocs
            .insert("a1".into(), alloc("a1", Phase::Published));
        for (from, to) in [(1, 2), (2, 3), (3, 1), (1, 0)] {
            old.alloc_mut("a1").expect("a1").references = from;
            let mut new = old.clone();
            new.alloc_mut("a1").expect("a1").references = to;
            let line = encode(&Delta::between(&old, &new)).expect("encode");
            let text = String::from_utf8_lossy(&line).into_owned();
            assert_eq!(text.contains("\"references\""), to != 1, "{text}");
            let mut replayed = old.clone();
            for d in parse(&line).expect("parse").deltas {
                d.apply(&mut replayed);
            }
            assert_eq!(replayed, new, "{from} -> {to}");
        }
    }

    #[test]
    fn torn_tail_is_dropped_and_damage_before_the_end_is_corruption() {
        let mut s = StateFile::new("b");
        let mut lines = Vec::new();
        for i in 0..3 {
            let before = s.clone();
            s.allocs
                .insert(format!("a{i}"), alloc(&format!("a{i}"), Phase::Published));
            lines.push(encode(&Delta::between(&before, &s)).expect("encode"));
        }
        let all = lines.concat();
        assert_eq!(parse(&all).expect("whole").deltas.len(), 3);
        // Every cut of the last line is a torn tail.
        let two = lines[0].len() + lines[1].len();
        for cut in two..all.len() {
            let r = parse(&all[..cut]).expect("torn tail");
            assert_eq!(r.deltas.len(), 2, "cut at {cut}");
            assert_eq!(r.torn_tail, cut > two, "cut at {cut}");
        }
        // Zeros after the last good line (a size update without its data).
        let mut zeros = lines[..2].concat();
        zeros.extend_from_slice(&[0u8; 100]);
        assert!(parse(&zeros).expect("zeros").torn_tail);
        // A flipped byte in the middle line is corruption, named by line.
        let mut bad = all.clone();
        bad[lines[0].len() + 20] ^= 0x01;
        let e = parse(&bad).expect_err("corrupt");
        assert_eq!(e.line, 2);
        assert!(e.reason.contains("checksum"), "{e:?}");
        // A last line written whole (its checksum matches) that does not
        // parse was not cut off: corruption, not a torn write.
        let json = br#"{"surprise":1}"#;
        let mut whole_bad = lines[..2].concat();
        whole_bad.extend_from_slice(format!("{:08x} ", crc32c(json)).as_bytes());
        whole_bad.extend_from_slice(json);
        whole_bad.push(b'\n');
        let e = parse(&whole_bad).expect_err("corrupt");
        assert_eq!(e.line, 3);
        assert!(e.reason.contains("does not parse"), "{e:?}");
        // The same damage in the last line is a torn write.
        let mut bad_last = all.clone();
        bad_last[two + 20] ^= 0x01;
        assert!(parse(&bad_last).expect("torn").torn_tail);
    }

    /// A crash between a compaction's new snapshot and its new journal
    /// leaves the old journal; replayed over the newer snapshot it must
    /// change nothing, also where a line changes an allocation that a later
    /// line drops.
    #[test]
    fn replaying_over_a_later_snapshot_changes_nothing() {
        let s1 = StateFile::new("b");
        let mut lines = Vec::new();
        let mut cur = s1.clone();
        let mut step = |f: &dyn Fn(&mut StateFile)| {
            let before = cur.clone();
            f(&mut cur);
            lines.push(encode(&Delta::between(&before, &cur)).expect("encode"));
        };
        step(&|s| {
            s.allocs.insert("a1".into(), alloc("a1", Phase::Claiming));
            s.allocs.insert("a2".into(), alloc("a2", Phase::Claiming));
        });
        step(&|s| s.volume_mut("a1", "data").expect("a1").phase = Phase::Claiming);
        step(&|s| s.volume_mut("a2", "data").expect("a2").phase = Phase::Published);
        step(&|s| {
            s.allocs.remove("a1");
        });
        step(&|s| s.alloc_mut("a2").expect("a2").releasing = true);
        let s2 = cur.clone();
        let journal = lines.concat();
        let replay = |base: &StateFile| {
            let mut st = base.clone();
            for d in parse(&journal).expect("parse").deltas {
                d.apply(&mut st);
            }
            st
        };
        assert_eq!(replay(&s1), s2, "over the snapshot it follows");
        assert_eq!(replay(&s2), s2, "over the later snapshot");
    }
}
