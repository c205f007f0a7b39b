//! `SharedMap`'s tests: against plain ordered maps, its invariants after
//! every kind of change, and exact diffs between related versions.

use super::*;

fn map(keys: impl IntoIterator<Item = u32>) -> SharedMap<u32, u32> {
    let mut m = SharedMap::default();
    for k in keys {
        m.insert(k, Arc::new(k * 10));
    }
    m
}

fn check(m: &SharedMap<u32, u32>, want: &BTreeMap<u32, u32>) {
    let got: Vec<(u32, u32)> = m.iter().map(|(k, v)| (*k, **v)).collect();
    let exp: Vec<(u32, u32)> = want.iter().map(|(k, v)| (*k, *v)).collect();
    assert_eq!(got, exp);
    assert_eq!(m.len(), want.len());
    assert_eq!(m.groups.len(), m.firsts.len());
    for (g, first) in m.groups.iter().zip(m.firsts.iter()) {
        assert!(!g.chunks.is_empty(), "empty group");
        assert!(g.chunks.len() <= GROUP_MAX);
        let firsts: Vec<u32> = g
            .chunks
            .iter()
            .map(|c| *c.first().expect("a key"))
            .collect();
        assert_eq!(*g.firsts, firsts, "a group's first keys are its chunks'");
        assert_eq!(firsts[0], *first, "the map's first keys are its groups'");
    }
    let chunks: Vec<_> = m.chunks().collect();
    for c in &chunks {
        assert!(!c.is_empty(), "empty chunk");
        assert!(c.len() <= CHUNK_MAX);
        assert!(
            c.0.windows(2).all(|w| w[0].0 < w[1].0),
            "a chunk out of order"
        );
    }
    for w in chunks.windows(2) {
        let last = w[0].iter().next_back().expect("not empty").0;
        let next = w[1].first().expect("not empty");
        assert!(last < next, "chunks overlap at {last}");
    }
    for (k, v) in want {
        assert_eq!(m.get(k).map(|v| **v), Some(*v));
    }
}

/// A fixed sequence of pseudo-random numbers from `seed`.
fn numbers(seed: u32) -> impl FnMut() -> u32 {
    let mut x = seed;
    move || {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        x >> 8
    }
}

/// The differences from `from` to `to` as `SharedMap::diff` reports them
/// (in key order; the new value, None when removed), found on plain maps.
fn plain_diff(from: &BTreeMap<u32, u32>, to: &BTreeMap<u32, u32>) -> Vec<(u32, Option<u32>)> {
    let keys: std::collections::BTreeSet<u32> = from.keys().chain(to.keys()).copied().collect();
    keys.into_iter()
        .filter(|k| from.get(k) != to.get(k))
        .map(|k| (k, to.get(&k).copied()))
        .collect()
}

/// What `SharedMap::diff` reports from `from` to `to`.
fn diff_of(from: &SharedMap<u32, u32>, to: &SharedMap<u32, u32>) -> Vec<(u32, Option<u32>)> {
    let mut got = Vec::new();
    SharedMap::diff(from, to, |k, v| got.push((*k, v.map(|v| **v))));
    got
}

/// Inserts and removes in a scrambled order against a BTreeMap.
#[test]
fn behaves_as_an_ordered_map() {
    let mut m = SharedMap::default();
    let mut want = BTreeMap::new();
    let mut next = numbers(7);
    for i in 0..5000u32 {
        let k = next() % 3000;
        if i % 3 == 2 {
            assert_eq!(m.remove(&k).map(|v| *v), want.remove(&k));
        } else {
            assert_eq!(m.insert(k, Arc::new(i)).map(|v| *v), want.insert(k, i));
        }
    }
    check(&m, &want);
    let from = 1500;
    let got: Vec<u32> = m.range_from(from).map(|(k, _)| *k).collect();
    let exp: Vec<u32> = want.range(from..).map(|(k, _)| *k).collect();
    assert_eq!(got, exp);
    let rebuilt = SharedMap::from_map(m.iter().map(|(k, v)| (*k, v.clone())).collect());
    check(&rebuilt, &want);
    assert_eq!(rebuilt, m);
    let json = serde_json::to_string(&m).expect("serialize");
    let back: SharedMap<u32, u32> = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, m);
    m.clear();
    assert!(m.is_empty() && m.iter().next().is_none());
}

/// A change copies one chunk, and the diff of two versions reads only
/// the chunks that differ and finds exactly the changes.
#[test]
fn a_change_copies_one_chunk_and_diffs_exactly() {
    let old = map(0..10_000);
    let mut new = old.clone();
    new.insert(5_000, Arc::new(1));
    new.remove(&7_777);
    new.insert(20_000, Arc::new(2));
    let shared = old
        .chunks()
        .filter(|c| new.chunks().any(|n| Arc::ptr_eq(n, c)))
        .count();
    assert!(
        shared + 3 >= old.chunks().count(),
        "{shared} of {} chunks shared",
        old.chunks().count()
    );
    // And at most the groups those chunks are in.
    let groups = old
        .groups
        .iter()
        .filter(|g| new.groups.iter().any(|n| Arc::ptr_eq(n, g)))
        .count();
    assert!(old.groups.len() > 3, "{} groups", old.groups.len());
    assert!(
        groups + 3 >= old.groups.len(),
        "{groups} of {} groups shared",
        old.groups.len()
    );
    let mut changes = Vec::new();
    SharedMap::diff(&old, &new, |k, v| changes.push((*k, v.map(|v| **v))));
    assert_eq!(
        changes,
        vec![(5_000, Some(1)), (7_777, None), (20_000, Some(2))]
    );
    assert_ne!(old, new);
    // The same values in new records are not changes.
    let mut again = old.clone();
    again.insert(42, Arc::new(420));
    assert_eq!(again, old);
    let mut none = Vec::new();
    SharedMap::diff(&old, &again, |k, _| none.push(*k));
    assert!(none.is_empty(), "{none:?}");
    // A key below every chunk's first key goes to the first chunk.
    let mut low = map(100..200);
    low.insert(1, Arc::new(10));
    let mut want: BTreeMap<u32, u32> = (100..200).map(|k| (k, k * 10)).collect();
    want.insert(1, 10);
    check(&low, &want);
}

/// Diffs between versions that split, empty and drop chunks find
/// exactly what a plain map comparison finds.
#[test]
fn diffs_across_splits_and_dropped_chunks_are_exact() {
    let mut next = numbers(99);
    let mut cur = map(0..2000);
    let mut plain: BTreeMap<u32, u32> = (0..2000).map(|k| (k, k * 10)).collect();
    for round in 0..200 {
        let (before, before_plain) = (cur.clone(), plain.clone());
        for _ in 0..(next() % 90) {
            let k = if round % 4 == 0 {
                next() % 2200
            } else {
                500 + next() % 80
            };
            if next() % 2 == 0 {
                cur.remove(&k);
                plain.remove(&k);
            } else {
                let v = next() % 3;
                cur.insert(k, Arc::new(v));
                plain.insert(k, v);
            }
        }
        check(&cur, &plain);
        let mut got = Vec::new();
        SharedMap::diff(&before, &cur, |k, v| got.push((*k, v.map(|v| **v))));
        let mut want = Vec::new();
        for k in before_plain.keys().chain(plain.keys()) {
            if before_plain.get(k) != plain.get(k) && want.last().map(|(l, _)| l) != Some(k) {
                want.push((*k, plain.get(k).copied()));
            }
        }
        want.sort_unstable();
        want.dedup();
        assert_eq!(got, want, "round {round}");
        assert_eq!(before == cur, want.is_empty());
    }
}

/// Two versions that both changed since a common one (a split on one
/// side, a dropped chunk on the other) diff exactly, a map built whole
/// equals the copied one, and every change makes a map its old
/// identity is not (a change that changes nothing keeps it).
#[test]
fn siblings_diff_exactly_and_every_change_gets_a_new_id() {
    let base = map(0..1000);
    let (mut a, mut b) = (base.clone(), base.clone());
    for k in 0..70 {
        a.insert(500 + k * 2 + 1, Arc::new(1));
    }
    for k in 0..48 {
        b.remove(&k);
    }
    b.insert(5000, Arc::new(2));
    let plain = |m: &SharedMap<u32, u32>| -> BTreeMap<u32, u32> {
        m.iter().map(|(k, v)| (*k, **v)).collect()
    };
    let (pa, pb) = (plain(&a), plain(&b));
    check(&a, &pa);
    check(&b, &pb);
    assert_eq!(diff_of(&a, &b), plain_diff(&pa, &pb));
    let rebuilt = SharedMap::from_map(b.iter().map(|(k, v)| (*k, v.clone())).collect());
    assert_eq!(rebuilt, b);
    let id = a.id();
    assert!(a.remove(&999_999).is_none());
    assert!(id.is(&a), "removing a missing key changes nothing");
    for op in 0..4 {
        let id = a.id();
        match op {
            0 => {
                a.insert(0, Arc::new(9));
            }
            1 => {
                a.remove(&0);
            }
            2 => {
                *a.get_mut(&1).expect("key 1") = Arc::new(7);
            }
            _ => a.clear(),
        }
        assert!(!id.is(&a), "op {op} kept the identity");
    }
}

/// Whole groups emptied and dropped, groups split by inserts below and
/// inside them, the first key of the map and of groups moved: every
/// batch's diff is exactly the plain maps' difference, and the map
/// ends empty.
#[test]
fn groups_dropped_and_split_diff_exactly() {
    let mut next = numbers(3);
    let mut cur = map(1000..5000);
    let mut plain: BTreeMap<u32, u32> = (1000..5000).map(|k| (k, k * 10)).collect();
    assert!(cur.groups.len() > 4, "{} groups", cur.groups.len());
    let batch = |cur: &mut SharedMap<u32, u32>,
                 plain: &mut BTreeMap<u32, u32>,
                 keys: &[u32],
                 insert: bool| {
        let (before, before_plain) = (cur.clone(), plain.clone());
        for &k in keys {
            if insert {
                cur.insert(k, Arc::new(k + 1));
                plain.insert(k, k + 1);
            } else {
                assert_eq!(cur.remove(&k).map(|v| *v), plain.remove(&k));
            }
        }
        check(cur, plain);
        assert_eq!(diff_of(&before, cur), plain_diff(&before_plain, plain));
    };
    // The middle, scrambled, 400 at a time: whole groups go.
    let mut middle: Vec<u32> = (1500..4500).collect();
    for i in (1..middle.len()).rev() {
        middle.swap(i, next() as usize % (i + 1));
    }
    for keys in middle.chunks(400) {
        batch(&mut cur, &mut plain, keys, false);
    }
    // Below the first key, descending: the first chunk and group take
    // them and split.
    let below: Vec<u32> = (0..1000).rev().collect();
    for keys in below.chunks(300) {
        batch(&mut cur, &mut plain, keys, true);
    }
    // Back into the gap, ascending: splits at the end of a group.
    let gap: Vec<u32> = (1500..4500).step_by(2).collect();
    for keys in gap.chunks(500) {
        batch(&mut cur, &mut plain, keys, true);
    }
    // Everything, from the first key up: the map's first key moves
    // with every removal.
    let all: Vec<u32> = plain.keys().copied().collect();
    for keys in all.chunks(700) {
        batch(&mut cur, &mut plain, keys, false);
    }
    assert!(cur.is_empty() && cur.groups.is_empty() && cur.firsts.is_empty());
}

/// Any two versions from a pool that grew by random changes from one
/// another (ancestors, siblings, cousins; splits, dropped chunks, new
/// first keys; rebuilt whole, cleared, every record replaced) diff
/// exactly against plain maps, both ways, and a one-key change reads
/// no more than its own chunks.
#[test]
fn any_two_related_versions_diff_exactly() {
    let mut next = numbers(7);
    let start = map(0..600);
    let plain_of = |m: &SharedMap<u32, u32>| -> BTreeMap<u32, u32> {
        m.iter().map(|(k, v)| (*k, **v)).collect()
    };
    let mut pool = vec![start.clone()];
    for round in 0..400 {
        let mut m = pool[next() as usize % pool.len()].clone();
        let mut plain = plain_of(&m);
        match next() % 16 {
            // Rebuilt whole (as read back): shares no chunk.
            0 => m = SharedMap::from_map(m.iter().map(|(k, v)| (*k, v.clone())).collect()),
            1 => {
                m.clear();
                plain.clear();
            }
            // Every record replaced: every chunk copied.
            2 => {
                for v in m.values_mut() {
                    *v = Arc::new(**v + 1);
                }
                plain.values_mut().for_each(|v| *v += 1);
            }
            _ => {}
        }
        let span = [700, 60, 5][round % 3];
        let base = next() % 700;
        for _ in 0..(1 + next() % 40) {
            let k = base + next() % span;
            match next() % 3 {
                0 => {
                    m.remove(&k);
                    plain.remove(&k);
                }
                1 => {
                    let v = next() % 4;
                    m.insert(k, Arc::new(v));
                    plain.insert(k, v);
                }
                _ => {
                    if let Some(v) = m.get_mut(&k) {
                        let n = next() % 4;
                        *v = Arc::new(n);
                        plain.insert(k, n);
                    }
                }
            }
        }
        check(&m, &plain);
        // Only the chunks a change touched are read: with one key
        // changed, at most the two halves of a split.
        let mut one = m.clone();
        one.insert(next() % 700, Arc::new(9));
        assert!(
            dirty_entries(&one, &m).len() <= 2 * CHUNK_MAX,
            "round {round}"
        );
        if pool.len() < 12 {
            pool.push(m);
        } else {
            let i = next() as usize % pool.len();
            pool[i] = m;
        }
        let (a, b) = (
            &pool[next() as usize % pool.len()],
            &pool[next() as usize % pool.len()],
        );
        for (from, to) in [(a, b), (b, a)] {
            let (pf, pt) = (plain_of(from), plain_of(to));
            let (got, want) = (diff_of(from, to), plain_diff(&pf, &pt));
            assert_eq!(got, want, "round {round}");
        }
    }
}
