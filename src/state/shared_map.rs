//! `SharedMap`: an ordered map of shared records, itself shared in chunks.
//!
//! Every state update starts from a clone of the state and changes a few
//! records. A map behind one `Arc` made that clone cheap, but the first
//! change copied the whole map: 10,000 keys and pointers for one record.
//! Here the records sit in chunks of at most `CHUNK_MAX`, each behind its
//! own `Arc`, under an outer map from each chunk's lower bound to the chunk:
//! a change copies the outer map (one entry per chunk) and the one chunk it
//! touches. Two maps that share chunks are compared, and diffed into a
//! journal line, chunk by chunk: shared chunks are skipped unread.

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

/// See the module documentation. Invariants: no chunk is empty; every key
/// of a chunk is at least its bound and below the next chunk's bound.
pub struct SharedMap<K: Ord, V> {
    chunks: Arc<BTreeMap<K, Arc<Chunk<K, V>>>>,
    len: usize,
}

impl<K: Ord, V> Clone for SharedMap<K, V> {
    fn clone(&self) -> Self {
        SharedMap {
            chunks: self.chunks.clone(),
            len: self.len,
        }
    }
}

impl<K: Ord, V> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap {
            chunks: Arc::new(BTreeMap::new()),
            len: 0,
        }
    }
}

impl<K: Ord, V> SharedMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bound and chunk that holds `k` if anything does.
    fn chunk_of<Q>(&self, k: &Q) -> Option<(&K, &Arc<Chunk<K, V>>)>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.chunks
            .range::<Q, _>((Bound::Unbounded, Bound::Included(k)))
            .next_back()
    }

    pub fn get<Q>(&self, k: &Q) -> Option<&Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.chunk_of(k)?.1.get(k)
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
        self.chunks.values().flat_map(|c| c.iter())
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Arc<V>> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// The entries from `from` on, in key order.
    pub fn range_from(&self, from: K) -> impl Iterator<Item = (&K, &Arc<V>)> + '_ {
        let outer = match self.chunk_of(&from) {
            Some((b, _)) => self
                .chunks
                .range::<K, _>((Bound::Included(b), Bound::Unbounded)),
            None => self.chunks.range::<K, _>(..),
        };
        outer.flat_map(move |(_, c)| c.range::<K, _>((Bound::Included(&from), Bound::Unbounded)))
    }

    /// Whether both are the same map (then equal without looking).
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.chunks, &b.chunks)
    }
}

/// Which map a `SharedMap` is, for something derived from it that must
/// know whether it still describes it. Holding one keeps the map's outer
/// node alive and shared, so any change to the map (every change goes
/// through a copy-on-write of that node) makes a map this is not.
pub struct MapId<K: Ord, V>(Arc<BTreeMap<K, Arc<Chunk<K, V>>>>);

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
        let mut chunks = BTreeMap::new();
        let mut chunk = BTreeMap::new();
        for (k, v) in m {
            chunk.insert(k, v);
            if chunk.len() == CHUNK_FILL {
                let full = std::mem::take(&mut chunk);
                let bound = full.keys().next().cloned().expect("a full chunk");
                chunks.insert(bound, Arc::new(full));
            }
        }
        if let Some(bound) = chunk.keys().next().cloned() {
            chunks.insert(bound, Arc::new(chunk));
        }
        SharedMap {
            chunks: Arc::new(chunks),
            len,
        }
    }

    pub fn insert(&mut self, k: K, v: Arc<V>) -> Option<Arc<V>> {
        let chunks = Arc::make_mut(&mut self.chunks);
        let bound = match chunks
            .range::<K, _>((Bound::Unbounded, Bound::Included(&k)))
            .next_back()
        {
            Some((b, _)) => b.clone(),
            None => {
                // Below every bound (or the first key): the first chunk
                // takes it under a lower bound.
                let c = match chunks.pop_first() {
                    Some((_, c)) => c,
                    None => Arc::new(BTreeMap::new()),
                };
                chunks.insert(k.clone(), c);
                k.clone()
            }
        };
        let chunk = Arc::make_mut(chunks.get_mut(&bound).expect("the chunk just found"));
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
            chunks.insert(mid, Arc::new(upper));
        }
        old
    }

    /// The bound of the chunk holding `k`, when `k` is in the map.
    fn bound_of<Q>(&self, k: &Q) -> Option<K>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let (b, c) = self.chunk_of(k)?;
        c.contains_key(k).then(|| b.clone())
    }

    pub fn remove<Q>(&mut self, k: &Q) -> Option<Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let bound = self.bound_of(k)?;
        let chunks = Arc::make_mut(&mut self.chunks);
        let chunk = Arc::make_mut(chunks.get_mut::<K>(&bound)?);
        let old = chunk.remove(k);
        if chunk.is_empty() {
            chunks.remove::<K>(&bound);
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
        let bound = self.bound_of(k)?;
        let chunks = Arc::make_mut(&mut self.chunks);
        Arc::make_mut(chunks.get_mut::<K>(&bound)?).get_mut(k)
    }

    /// Every record for changing (copies every chunk that is shared).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Arc<V>> + '_ {
        Arc::make_mut(&mut self.chunks)
            .values_mut()
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
    /// both maps share (same bound, same chunk) are skipped unread; shared
    /// records are skipped without comparing them.
    pub fn diff(old: &Self, new: &Self, mut changed: impl FnMut(&K, Option<&Arc<V>>)) {
        if Self::same(old, new) {
            return;
        }
        // A key in a chunk both share is in that chunk on both sides: only
        // the others can differ, and a key in one of them on one side is in
        // one of them on the other side, if anywhere.
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

/// The entries of `a` in chunks that `b` does not share (same bound, same
/// chunk), in key order.
fn dirty_entries<'a, K: Ord, V>(
    a: &'a SharedMap<K, V>,
    b: &SharedMap<K, V>,
) -> Vec<(&'a K, &'a Arc<V>)> {
    let mut d = Vec::new();
    for (bound, c) in a.chunks.iter() {
        if !b.chunks.get(bound).is_some_and(|o| Arc::ptr_eq(o, c)) {
            d.extend(c.iter());
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
        for (b, c) in m.chunks.iter() {
            assert!(!c.is_empty(), "empty chunk at {b}");
            assert!(c.len() <= CHUNK_MAX);
            assert!(c.keys().all(|k| k >= b), "chunk {b} holds a smaller key");
        }
        let bounds: Vec<&u32> = m.chunks.keys().collect();
        for w in bounds.windows(2) {
            assert!(m.chunks[w[0]].keys().all(|k| k < w[1]));
        }
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
            .filter(|(b, c)| new.chunks.get(*b).is_some_and(|n| Arc::ptr_eq(n, c)))
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
        // Keys below every bound move the first chunk's bound.
        let mut low = map(100..200);
        low.insert(1, Arc::new(10));
        let mut want: BTreeMap<u32, u32> = (100..200).map(|k| (k, k * 10)).collect();
        want.insert(1, 10);
        check(&low, &want);
    }
}
