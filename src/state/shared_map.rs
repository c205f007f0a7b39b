//! `SharedMap`: an ordered map of shared records, itself shared in chunks.
//!
//! Every state update starts from a clone of the state and changes a few
//! records. A map behind one `Arc` made that clone cheap, but the first
//! change copied the whole map: 10,000 keys and pointers for one record.
//! Here the records sit in chunks of at most `CHUNK_MAX`, each behind its
//! own `Arc`, in key order in an outer list of pointers: a change copies
//! that list (one pointer per chunk, no keys) and the one chunk it touches.
//! A key is found by a binary search over the chunks' first keys, kept in
//! a list of their own (shared too, and copied only when a chunk's first
//! key changes: a split, or the first key added or removed). Two maps
//! that share chunks are compared, and diffed into a journal line, chunk by
//! chunk: shared chunks (the same pointer) are skipped unread.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A chunk splits in two when it grows past this many records.
const CHUNK_MAX: usize = 64;
/// Records per chunk when a map is built whole (room to grow before a
/// split).
const CHUNK_FILL: usize = 48;

type Chunk<K, V> = BTreeMap<K, Arc<V>>;
type Chunks<K, V> = Vec<Arc<Chunk<K, V>>>;

/// See the module documentation. Invariants: no chunk is empty; every key
/// of a chunk is below every key of the next chunk; `firsts[i]` is the
/// first key of `chunks[i]`.
pub struct SharedMap<K: Ord, V> {
    chunks: Arc<Chunks<K, V>>,
    firsts: Arc<Vec<K>>,
    len: usize,
}

impl<K: Ord, V> Clone for SharedMap<K, V> {
    fn clone(&self) -> Self {
        SharedMap {
            chunks: self.chunks.clone(),
            firsts: self.firsts.clone(),
            len: self.len,
        }
    }
}

impl<K: Ord, V> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap {
            chunks: Arc::new(Vec::new()),
            firsts: Arc::new(Vec::new()),
            len: 0,
        }
    }
}

/// The index of the chunk that would hold `k`: the last whose first key is
/// at most `k`, or None when `k` is below every chunk (or there is none).
fn slot<K, Q>(firsts: &[K], k: &Q) -> Option<usize>
where
    K: Borrow<Q>,
    Q: Ord + ?Sized,
{
    firsts.partition_point(|f| f.borrow() <= k).checked_sub(1)
}

impl<K: Ord, V> SharedMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The index of the chunk that holds `k`, when `k` is in the map.
    fn index_of<Q>(&self, k: &Q) -> Option<usize>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = slot(&self.firsts, k)?;
        self.chunks[i].contains_key(k).then_some(i)
    }

    pub fn get<Q>(&self, k: &Q) -> Option<&Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.chunks[slot(&self.firsts, k)?].get(k)
    }

    pub fn contains_key<Q>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.get(k).is_some()
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &Arc<V>)> + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Arc<V>> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// The entries from `from` on, in key order.
    pub fn range_from(&self, from: K) -> impl Iterator<Item = (&K, &Arc<V>)> + '_ {
        let start = slot(&self.firsts, &from).unwrap_or(0);
        self.chunks[start..]
            .iter()
            .flat_map(move |c| c.range::<K, _>((Bound::Included(&from), Bound::Unbounded)))
    }

    /// Whether both are the same map (then equal without looking).
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.chunks, &b.chunks)
    }
}

/// Which map a `SharedMap` is, for something derived from it that must
/// know whether it still describes it. Holding one keeps the map's outer
/// list alive and shared, so any change to the map (every change goes
/// through a copy-on-write of that list) makes a map this is not.
pub struct MapId<K: Ord, V>(Arc<Chunks<K, V>>);

impl<K: Ord, V> Clone for MapId<K, V> {
    fn clone(&self) -> Self {
        MapId(self.0.clone())
    }
}

impl<K: Ord, V> MapId<K, V> {
    /// Whether `m` is the map this names, unchanged.
    pub fn is(&self, m: &SharedMap<K, V>) -> bool {
        Arc::ptr_eq(&self.0, &m.chunks)
    }
}

impl<K: Ord, V> SharedMap<K, V> {
    /// This map's identity (see `MapId`).
    pub fn id(&self) -> MapId<K, V> {
        MapId(self.chunks.clone())
    }
}

impl<K: Ord + Clone, V> SharedMap<K, V> {
    pub fn from_map(m: BTreeMap<K, Arc<V>>) -> Self {
        let len = m.len();
        let mut chunks = Vec::with_capacity(len.div_ceil(CHUNK_FILL));
        let mut firsts = Vec::with_capacity(len.div_ceil(CHUNK_FILL));
        let mut chunk = BTreeMap::new();
        for (k, v) in m {
            if chunk.is_empty() {
                firsts.push(k.clone());
            }
            chunk.insert(k, v);
            if chunk.len() == CHUNK_FILL {
                chunks.push(Arc::new(std::mem::take(&mut chunk)));
            }
        }
        if !chunk.is_empty() {
            chunks.push(Arc::new(chunk));
        }
        SharedMap {
            chunks: Arc::new(chunks),
            firsts: Arc::new(firsts),
            len,
        }
    }

    pub fn insert(&mut self, k: K, v: Arc<V>) -> Option<Arc<V>> {
        let chunks = Arc::make_mut(&mut self.chunks);
        if chunks.is_empty() {
            Arc::make_mut(&mut self.firsts).push(k.clone());
            chunks.push(Arc::new(BTreeMap::from([(k, v)])));
            self.len = 1;
            return None;
        }
        let i = match slot(&self.firsts, &k) {
            Some(i) => i,
            None => {
                // Below every chunk's first key: the first chunk takes it,
                // and it is that chunk's first key now.
                Arc::make_mut(&mut self.firsts)[0] = k.clone();
                0
            }
        };
        let chunk = Arc::make_mut(&mut chunks[i]);
        let old = chunk.insert(k, v);
        if old.is_none() {
            self.len += 1;
        }
        if chunk.len() > CHUNK_MAX {
            let mid = chunk
                .keys()
                .nth(chunk.len() / 2)
                .cloned()
                .expect("a chunk past its size");
            let upper = chunk.split_off(&mid);
            chunks.insert(i + 1, Arc::new(upper));
            Arc::make_mut(&mut self.firsts).insert(i + 1, mid);
        }
        old
    }

    pub fn remove<Q>(&mut self, k: &Q) -> Option<Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = self.index_of(k)?;
        let chunks = Arc::make_mut(&mut self.chunks);
        let chunk = Arc::make_mut(&mut chunks[i]);
        let old = chunk.remove(k);
        match chunk.keys().next() {
            None => {
                chunks.remove(i);
                Arc::make_mut(&mut self.firsts).remove(i);
            }
            Some(f) if f != &self.firsts[i] => {
                Arc::make_mut(&mut self.firsts)[i] = f.clone();
            }
            Some(_) => {}
        }
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    pub fn get_mut<Q>(&mut self, k: &Q) -> Option<&mut Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = self.index_of(k)?;
        let chunks = Arc::make_mut(&mut self.chunks);
        Arc::make_mut(&mut chunks[i]).get_mut(k)
    }

    /// Every record for changing (copies every chunk that is shared).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Arc<V>> + '_ {
        Arc::make_mut(&mut self.chunks)
            .iter_mut()
            .flat_map(|c| Arc::make_mut(c).values_mut())
    }

    pub fn clear(&mut self) {
        if !self.is_empty() {
            *self = SharedMap::default();
        }
    }
}

impl<K: Ord, V: PartialEq> SharedMap<K, V> {
    /// Every key whose value differs between `old` and `new`, in key order:
    /// `Some(new value)` when added or changed, None when removed. Chunks
    /// both maps share (the same pointer) are skipped unread; shared
    /// records are skipped without comparing them.
    pub fn diff(old: &Self, new: &Self, mut changed: impl FnMut(&K, Option<&Arc<V>>)) {
        if Self::same(old, new) {
            return;
        }
        // A key in a chunk both share is in that chunk on both sides (a
        // shared chunk holds the same keys in both, and a key is in one
        // chunk of a map): only the other chunks can differ, and a key in
        // one of them on one side is in one of them on the other side, if
        // anywhere.
        let (o, n) = (dirty_entries(old, new), dirty_entries(new, old));
        let mut o = o.into_iter().peekable();
        let mut n = n.into_iter().peekable();
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
}

/// The entries of `a` in chunks that `b` does not share (the same
/// pointer), in key order. Both maps are borrowed for the whole call, so a
/// pointer seen in both is one chunk, not a freed one's address reused.
///
/// One walk over both chunk lists: a chunk shared by both holds the same
/// keys on both sides, so it is the chunk of `b` with its first key, and
/// both lists are in key order. Where the pointers at the walk's two
/// positions differ, the first keys say which side is ahead.
fn dirty_entries<'a, K: Ord, V>(
    a: &'a SharedMap<K, V>,
    b: &SharedMap<K, V>,
) -> Vec<(&'a K, &'a Arc<V>)> {
    // The walk trusts both lists' first keys: one that went stale would
    // make a shared chunk look changed on one side only, and `diff` would
    // call its records removed.
    debug_assert!(a.firsts.len() == a.chunks.len() && a.firsts.windows(2).all(|w| w[0] < w[1]));
    debug_assert!(b.firsts.len() == b.chunks.len() && b.firsts.windows(2).all(|w| w[0] < w[1]));
    let mut d = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.chunks.len() {
        if j < b.chunks.len() && Arc::ptr_eq(&a.chunks[i], &b.chunks[j]) {
            i += 1;
            j += 1;
            continue;
        }
        match b.firsts.get(j).map(|bf| a.firsts[i].cmp(bf)) {
            // b's chunk starts below: no chunk of a can be it.
            Some(std::cmp::Ordering::Greater) => j += 1,
            // The same first key in another chunk (changed), or b's
            // chunk starts above or b has none left: a's chunk is not in
            // b.
            _ => {
                d.extend(a.chunks[i].iter());
                if b.firsts.get(j) == Some(&a.firsts[i]) {
                    j += 1;
                }
                i += 1;
            }
        }
    }
    d
}

impl<K, Q, V> std::ops::Index<&Q> for SharedMap<K, V>
where
    K: Ord + Borrow<Q>,
    Q: Ord + ?Sized,
{
    type Output = Arc<V>;

    /// As `BTreeMap`'s: panics when the key is missing.
    fn index(&self, k: &Q) -> &Arc<V> {
        self.get(k).expect("no entry found for key")
    }
}

impl<K: Ord, V: PartialEq> PartialEq for SharedMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        if self.len != other.len {
            return false;
        }
        let mut equal = true;
        SharedMap::diff(self, other, |_, _| equal = false);
        equal
    }
}

impl<K: Ord, V: Eq> Eq for SharedMap<K, V> {}

impl<K: Ord + fmt::Debug, V: fmt::Debug> fmt::Debug for SharedMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: Ord + Serialize, V: Serialize> Serialize for SharedMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de, K, V> Deserialize<'de> for SharedMap<K, V>
where
    K: Ord + Clone + Deserialize<'de>,
    V: Deserialize<'de>,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(SharedMap::from_map(BTreeMap::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
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
        for c in m.chunks.iter() {
            assert!(!c.is_empty(), "empty chunk");
            assert!(c.len() <= CHUNK_MAX);
        }
        for w in m.chunks.windows(2) {
            let last = w[0].keys().next_back().expect("not empty");
            let next = w[1].keys().next().expect("not empty");
            assert!(last < next, "chunks overlap at {last}");
        }
        let firsts: Vec<u32> = m
            .chunks
            .iter()
            .map(|c| *c.keys().next().expect("a key"))
            .collect();
        assert_eq!(*m.firsts, firsts, "the first keys kept are the chunks'");
        for (k, v) in want {
            assert_eq!(m.get(k).map(|v| **v), Some(*v));
        }
    }

    /// Inserts and removes in a scrambled order against a BTreeMap.
    #[test]
    fn behaves_as_an_ordered_map() {
        let mut m = SharedMap::default();
        let mut want = BTreeMap::new();
        let mut x: u32 = 7;
        for i in 0..5000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let k = (x >> 8) % 3000;
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
            .chunks
            .iter()
            .filter(|c| new.chunks.iter().any(|n| Arc::ptr_eq(n, c)))
            .count();
        assert!(
            shared + 3 >= old.chunks.len(),
            "{shared} of {} chunks shared",
            old.chunks.len()
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
        let mut x: u32 = 99;
        let mut next = move || {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            x >> 8
        };
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
        let keys: std::collections::BTreeSet<u32> = pa.keys().chain(pb.keys()).copied().collect();
        let want: Vec<(u32, Option<u32>)> = keys
            .into_iter()
            .filter(|k| pa.get(k) != pb.get(k))
            .map(|k| (k, pb.get(&k).copied()))
            .collect();
        let mut got = Vec::new();
        SharedMap::diff(&a, &b, |k, v| got.push((*k, v.map(|v| **v))));
        assert_eq!(got, want);
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

    /// Any two versions from a pool that grew by random changes from one
    /// another (ancestors, siblings, cousins; splits, dropped chunks, new
    /// first keys; rebuilt whole, cleared, every record replaced) diff
    /// exactly against plain maps, both ways, and a one-key change reads
    /// no more than its own chunks.
    #[test]
    fn any_two_related_versions_diff_exactly() {
        let mut x: u32 = 7;
        let mut next = move || {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            x >> 8
        };
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
                let keys: std::collections::BTreeSet<u32> =
                    pf.keys().chain(pt.keys()).copied().collect();
                let want: Vec<(u32, Option<u32>)> = keys
                    .into_iter()
                    .filter(|k| pf.get(k) != pt.get(k))
                    .map(|k| (k, pt.get(&k).copied()))
                    .collect();
                let mut got = Vec::new();
                SharedMap::diff(from, to, |k, v| got.push((*k, v.map(|v| **v))));
                assert_eq!(got, want, "round {round}");
            }
        }
    }
}
