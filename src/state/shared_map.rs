//! `SharedMap`: an ordered map of shared records, itself shared in chunks.
//!
//! Every state update starts from a clone of the state and changes a few
//! records. A map behind one `Arc` made that clone cheap, but the first
//! change copied the whole map: 10,000 keys and pointers for one record.
//! Here the records sit in chunks of at most `CHUNK_MAX`, each behind its
//! own `Arc`; the chunks sit, in key order, in groups of at most
//! `GROUP_MAX`, each behind its own `Arc` too; and the groups sit in an
//! outer list. A change copies the outer list (one pointer per group), the
//! one group it touches (one pointer per chunk) and the one chunk: at
//! 10,000 records about 20 + 24 pointers and 24 records, where one flat
//! list of chunks copied 208 pointers. Copying a list of pointers touches
//! every pointee's reference count, in records scattered over a large
//! heap, and dropping the old version touches them again: the two-level
//! list is there to keep those touches few.
//!
//! A key is found by a binary search over the groups' first keys, then
//! over the group's chunks' first keys; both lists of first keys are
//! shared too, and copied only when a first key changes (a split, a chunk
//! or group gone, the first key added or removed). Two maps that share
//! groups or chunks are compared, and diffed into a journal line, part by
//! part: shared groups and chunks (the same pointer) are skipped unread.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A chunk splits in two when it grows past this many records.
const CHUNK_MAX: usize = 32;
/// Records per chunk when a map is built whole (room to grow before a
/// split).
const CHUNK_FILL: usize = 24;
/// A group splits in two when it holds more chunks than this.
const GROUP_MAX: usize = 32;
/// Chunks per group when a map is built whole.
const GROUP_FILL: usize = 24;

/// Records in key order: a sorted list, one allocation, found by
/// bisection. (A `BTreeMap` of a chunk's size took an inner node and three
/// leaves, about 1 MiB more at 10,000 allocations.)
struct Chunk<K, V>(Vec<(K, Arc<V>)>);

impl<K: Clone, V> Clone for Chunk<K, V> {
    fn clone(&self) -> Self {
        Chunk(self.0.clone())
    }
}

impl<K: Ord, V> Chunk<K, V> {
    fn find<Q>(&self, k: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.0.binary_search_by(|(x, _)| x.borrow().cmp(k))
    }

    fn get<Q>(&self, k: &Q) -> Option<&Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.find(k).ok().map(|i| &self.0[i].1)
    }

    fn contains_key<Q>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.find(k).is_ok()
    }

    fn get_mut<Q>(&mut self, k: &Q) -> Option<&mut Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = self.find(k).ok()?;
        Some(&mut self.0[i].1)
    }

    /// Adds or replaces; the old value. Grows the list by one only: a
    /// chunk is copied on every change anyway, so room to grow would be
    /// memory held for nothing.
    fn insert(&mut self, k: K, v: Arc<V>) -> Option<Arc<V>> {
        match self.find(&k) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, v)),
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (k, v));
                None
            }
        }
    }

    fn remove<Q>(&mut self, k: &Q) -> Option<Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let i = self.find(k).ok()?;
        Some(self.0.remove(i).1)
    }

    fn first(&self) -> Option<&K> {
        self.0.first().map(|(k, _)| k)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &Arc<V>)> + '_ {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The entries from `from` on.
    fn range_from<'a>(&'a self, from: &K) -> impl Iterator<Item = (&'a K, &'a Arc<V>)> + 'a {
        let start = self.0.partition_point(|(k, _)| k < from);
        self.0[start..].iter().map(|(k, v)| (k, v))
    }

    /// The upper half, taken out (this one keeps the lower half, and no
    /// more room than it needs).
    fn split_half(&mut self) -> Chunk<K, V> {
        let upper = self.0.split_off(self.0.len() / 2);
        self.0.shrink_to_fit();
        Chunk(upper)
    }
}

/// Chunks in key order, and their first keys (`firsts[i]` is the first key
/// of `chunks[i]`).
struct Group<K, V> {
    chunks: Vec<Arc<Chunk<K, V>>>,
    firsts: Arc<Vec<K>>,
}

impl<K, V> Clone for Group<K, V> {
    fn clone(&self) -> Self {
        Group {
            chunks: self.chunks.clone(),
            firsts: self.firsts.clone(),
        }
    }
}

type Groups<K, V> = Vec<Arc<Group<K, V>>>;

/// See the module documentation. Invariants: no chunk and no group is
/// empty; every key of a chunk is below every key of the next chunk, in
/// its group and across groups; `firsts[i]` is the first key of
/// `groups[i]`, which is its first chunk's.
pub struct SharedMap<K: Ord, V> {
    groups: Arc<Groups<K, V>>,
    firsts: Arc<Vec<K>>,
    len: usize,
}

impl<K: Ord, V> Clone for SharedMap<K, V> {
    fn clone(&self) -> Self {
        SharedMap {
            groups: self.groups.clone(),
            firsts: self.firsts.clone(),
            len: self.len,
        }
    }
}

impl<K: Ord, V> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap {
            groups: Arc::new(Vec::new()),
            firsts: Arc::new(Vec::new()),
            len: 0,
        }
    }
}

/// The index of the part that would hold `k`: the last whose first key is
/// at most `k`, or None when `k` is below every part (or there is none).
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

    /// The group and the chunk in it that would hold `k`.
    fn place<Q>(&self, k: &Q) -> Option<(usize, usize)>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let g = slot(&self.firsts, k)?;
        // The group's first chunk starts at the group's first key, which
        // is at most `k`.
        let c = slot(&self.groups[g].firsts, k)?;
        Some((g, c))
    }

    /// The group and chunk that hold `k`, when `k` is in the map.
    fn index_of<Q>(&self, k: &Q) -> Option<(usize, usize)>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let (g, c) = self.place(k)?;
        self.groups[g].chunks[c].contains_key(k).then_some((g, c))
    }

    pub fn get<Q>(&self, k: &Q) -> Option<&Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let (g, c) = self.place(k)?;
        self.groups[g].chunks[c].get(k)
    }

    pub fn contains_key<Q>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.get(k).is_some()
    }

    /// Every chunk, in key order.
    fn chunks(&self) -> impl DoubleEndedIterator<Item = &Arc<Chunk<K, V>>> + '_ {
        self.groups.iter().flat_map(|g| g.chunks.iter())
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &Arc<V>)> + '_ {
        self.chunks().flat_map(|c| c.iter())
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Arc<V>> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// The entries from `from` on, in key order.
    pub fn range_from(&self, from: K) -> impl Iterator<Item = (&K, &Arc<V>)> + '_ {
        let (g, c) = self.place(&from).unwrap_or((0, 0));
        let first = self.groups.get(g).map_or(&[][..], |gr| &gr.chunks[c..]);
        let rest = self.groups.get(g + 1..).unwrap_or(&[]);
        first
            .iter()
            .chain(rest.iter().flat_map(|gr| gr.chunks.iter()))
            .flat_map(move |c| c.range_from(&from))
    }

    /// Whether both are the same map (then equal without looking).
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.groups, &b.groups)
    }
}

/// Which map a `SharedMap` is, for something derived from it that must
/// know whether it still describes it. Holding one keeps the map's outer
/// list alive and shared, so any change to the map (every change goes
/// through a copy-on-write of that list) makes a map this is not.
pub struct MapId<K: Ord, V>(Arc<Groups<K, V>>);

impl<K: Ord, V> Clone for MapId<K, V> {
    fn clone(&self) -> Self {
        MapId(self.0.clone())
    }
}

impl<K: Ord, V> MapId<K, V> {
    /// Whether `m` is the map this names, unchanged.
    pub fn is(&self, m: &SharedMap<K, V>) -> bool {
        Arc::ptr_eq(&self.0, &m.groups)
    }
}

impl<K: Ord, V> SharedMap<K, V> {
    /// This map's identity (see `MapId`).
    pub fn id(&self) -> MapId<K, V> {
        MapId(self.groups.clone())
    }
}

/// Splits `items` and their first keys in two halves when past `max`: the
/// upper half, to go right after them.
fn split_past<T, K>(
    items: &mut Vec<T>,
    firsts: &mut Arc<Vec<K>>,
    max: usize,
) -> Option<(Vec<T>, Vec<K>)>
where
    K: Clone,
{
    if items.len() <= max {
        return None;
    }
    let mid = items.len() / 2;
    let upper = items.split_off(mid);
    let upper_firsts = Arc::make_mut(firsts).split_off(mid);
    Some((upper, upper_firsts))
}

impl<K: Ord + Clone, V> SharedMap<K, V> {
    pub fn from_map(m: BTreeMap<K, Arc<V>>) -> Self {
        let len = m.len();
        let mut groups = Vec::with_capacity(len.div_ceil(CHUNK_FILL * GROUP_FILL));
        let mut firsts = Vec::with_capacity(groups.capacity());
        let mut group = Group {
            chunks: Vec::new(),
            firsts: Arc::new(Vec::new()),
        };
        let mut chunk = Chunk(Vec::with_capacity(CHUNK_FILL));
        let mut close_group = |group: &mut Group<K, V>, groups: &mut Groups<K, V>| {
            let g = std::mem::replace(
                group,
                Group {
                    chunks: Vec::new(),
                    firsts: Arc::new(Vec::new()),
                },
            );
            firsts.push(g.firsts[0].clone());
            groups.push(Arc::new(g));
        };
        for (k, v) in m {
            if chunk.is_empty() {
                Arc::make_mut(&mut group.firsts).push(k.clone());
            }
            // In key order: appended.
            chunk.0.push((k, v));
            if chunk.len() == CHUNK_FILL {
                let full = std::mem::replace(&mut chunk, Chunk(Vec::with_capacity(CHUNK_FILL)));
                group.chunks.push(Arc::new(full));
                if group.chunks.len() == GROUP_FILL {
                    close_group(&mut group, &mut groups);
                }
            }
        }
        if !chunk.is_empty() {
            group.chunks.push(Arc::new(chunk));
        }
        if !group.chunks.is_empty() {
            close_group(&mut group, &mut groups);
        }
        SharedMap {
            groups: Arc::new(groups),
            firsts: Arc::new(firsts),
            len,
        }
    }

    pub fn insert(&mut self, k: K, v: Arc<V>) -> Option<Arc<V>> {
        let groups = Arc::make_mut(&mut self.groups);
        if groups.is_empty() {
            Arc::make_mut(&mut self.firsts).push(k.clone());
            groups.push(Arc::new(Group {
                firsts: Arc::new(vec![k.clone()]),
                chunks: vec![Arc::new(Chunk(vec![(k, v)]))],
            }));
            self.len = 1;
            return None;
        }
        let (g, c) = match slot(&self.firsts, &k) {
            Some(g) => (
                g,
                slot(&groups[g].firsts, &k).expect("a group's first chunk starts at its first key"),
            ),
            None => {
                // Below every key: the first chunk of the first group
                // takes it, and it is both's first key now.
                Arc::make_mut(&mut self.firsts)[0] = k.clone();
                Arc::make_mut(&mut Arc::make_mut(&mut groups[0]).firsts)[0] = k.clone();
                (0, 0)
            }
        };
        let group = Arc::make_mut(&mut groups[g]);
        let chunk = Arc::make_mut(&mut group.chunks[c]);
        let old = chunk.insert(k, v);
        if old.is_none() {
            self.len += 1;
        }
        if chunk.len() > CHUNK_MAX {
            let upper = chunk.split_half();
            let mid = upper
                .first()
                .expect("half of a chunk past its size")
                .clone();
            group.chunks.insert(c + 1, Arc::new(upper));
            Arc::make_mut(&mut group.firsts).insert(c + 1, mid);
            if let Some((chunks, firsts)) =
                split_past(&mut group.chunks, &mut group.firsts, GROUP_MAX)
            {
                let first = firsts[0].clone();
                groups.insert(
                    g + 1,
                    Arc::new(Group {
                        chunks,
                        firsts: Arc::new(firsts),
                    }),
                );
                Arc::make_mut(&mut self.firsts).insert(g + 1, first);
            }
        }
        old
    }

    pub fn remove<Q>(&mut self, k: &Q) -> Option<Arc<V>>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let (g, c) = self.index_of(k)?;
        let groups = Arc::make_mut(&mut self.groups);
        let group = Arc::make_mut(&mut groups[g]);
        let chunk = Arc::make_mut(&mut group.chunks[c]);
        let old = chunk.remove(k);
        match chunk.first() {
            None => {
                group.chunks.remove(c);
                Arc::make_mut(&mut group.firsts).remove(c);
            }
            Some(f) if f != &group.firsts[c] => {
                Arc::make_mut(&mut group.firsts)[c] = f.clone();
            }
            Some(_) => {}
        }
        match group.firsts.first() {
            None => {
                groups.remove(g);
                Arc::make_mut(&mut self.firsts).remove(g);
            }
            Some(f) if f != &self.firsts[g] => {
                Arc::make_mut(&mut self.firsts)[g] = f.clone();
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
        let (g, c) = self.index_of(k)?;
        let group = Arc::make_mut(&mut Arc::make_mut(&mut self.groups)[g]);
        Arc::make_mut(&mut group.chunks[c]).get_mut(k)
    }

    /// Every record for changing (copies every group and chunk that is
    /// shared).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Arc<V>> + '_ {
        Arc::make_mut(&mut self.groups)
            .iter_mut()
            .flat_map(|g| Arc::make_mut(g).chunks.iter_mut())
            .flat_map(|c| Arc::make_mut(c).0.iter_mut().map(|(_, v)| v))
    }

    pub fn clear(&mut self) {
        if !self.is_empty() {
            *self = SharedMap::default();
        }
    }
}

impl<K: Ord, V: PartialEq> SharedMap<K, V> {
    /// Every key whose value differs between `old` and `new`, in key order:
    /// `Some(new value)` when added or changed, None when removed. Groups
    /// and chunks both maps share (the same pointer) are skipped unread;
    /// shared records are skipped without comparing them.
    pub fn diff(old: &Self, new: &Self, mut changed: impl FnMut(&K, Option<&Arc<V>>)) {
        if Self::same(old, new) {
            return;
        }
        // A key in a part both share is in that part on both sides (a
        // shared part holds the same keys in both, and a key is in one
        // part of a map): only the other parts can differ, and a key in
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

/// The positions in `a` of the parts (groups or chunks) that `b` does not
/// share (the same pointer), given both lists in key order with their
/// first keys, strictly increasing. A part both share appears in both
/// lists: the caller passes whole lists, or only the chunks of groups not
/// shared (a chunk in a shared group is in that group on both sides, and
/// in no other part of either map).
///
/// One walk over both lists: a part shared by both holds the same keys on
/// both sides, so it is the part of `b` with its first key. Where the
/// pointers at the walk's two positions differ, the first keys say which
/// side is ahead.
fn unshared<T, K: Ord>(a: &[&Arc<T>], af: &[&K], b: &[&Arc<T>], bf: &[&K]) -> Vec<usize> {
    // The walk trusts both lists' first keys: one that went stale would
    // make a shared part look changed on one side only, and `diff` would
    // call its records removed.
    debug_assert!(a.len() == af.len() && af.windows(2).all(|w| w[0] < w[1]));
    debug_assert!(b.len() == bf.len() && bf.windows(2).all(|w| w[0] < w[1]));
    let mut d = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() {
        if j < b.len() && Arc::ptr_eq(a[i], b[j]) {
            i += 1;
            j += 1;
            continue;
        }
        match bf.get(j).map(|bf| af[i].cmp(bf)) {
            // b's part starts below: no part of a can be it.
            Some(std::cmp::Ordering::Greater) => j += 1,
            // The same first key in another part (changed), or b's part
            // starts above or b has none left: a's part is not in b.
            _ => {
                d.push(i);
                if bf.get(j) == Some(&af[i]) {
                    j += 1;
                }
                i += 1;
            }
        }
    }
    d
}

/// The chunks, with their first keys, of the groups of `m` at `groups`.
#[allow(clippy::type_complexity)]
fn chunks_of<'a, K: Ord, V>(
    m: &'a SharedMap<K, V>,
    groups: &[usize],
) -> (Vec<&'a Arc<Chunk<K, V>>>, Vec<&'a K>) {
    let mut chunks = Vec::new();
    let mut firsts = Vec::new();
    for &g in groups {
        let group = &m.groups[g];
        chunks.extend(group.chunks.iter());
        firsts.extend(group.firsts.iter());
    }
    (chunks, firsts)
}

/// The entries of `a` in chunks that `b` does not share (the same
/// pointer, in itself or in a shared group), in key order. Both maps are
/// borrowed for the whole call, so a pointer seen in both is one part, not
/// a freed one's address reused.
fn dirty_entries<'a, K: Ord, V>(
    a: &'a SharedMap<K, V>,
    b: &SharedMap<K, V>,
) -> Vec<(&'a K, &'a Arc<V>)> {
    let ag: Vec<&Arc<Group<K, V>>> = a.groups.iter().collect();
    let bg: Vec<&Arc<Group<K, V>>> = b.groups.iter().collect();
    let af: Vec<&K> = a.firsts.iter().collect();
    let bf: Vec<&K> = b.firsts.iter().collect();
    let (ac, acf) = chunks_of(a, &unshared(&ag, &af, &bg, &bf));
    let (bc, bcf) = chunks_of(b, &unshared(&bg, &bf, &ag, &af));
    let mut d = Vec::new();
    for i in unshared(&ac, &acf, &bc, &bcf) {
        d.extend(ac[i].iter());
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
mod tests;
