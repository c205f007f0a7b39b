//! Changes of this node's claims in etcd: take, update, free, each by
//! `Txn` with revision compares (see the parent module).

use super::*;
use crate::etcd::{Compare, CompareOp, TxnOp};

impl EtcdClaims {
    /// A new claim of `req`, held by this node and instance.
    pub(super) fn new_claim(&self, req: &ClaimRequest) -> StoredClaim {
        StoredClaim {
            claim: Claim {
                volume_id: req.volume_id.clone(),
                alloc_id: req.alloc_id.clone(),
                node: req.node.clone(),
                mode: req.mode,
                access_mode: req.access_mode,
                external_node_id: req.external_node_id.clone(),
                publish_context: Default::default(),
                state: ClaimState::Taken,
                since_ms: Some(now_ms()),
                last_error: None,
            },
            taken_at_ms: now_ms(),
            instance: self.instance().map(str::to_string),
        }
    }

    /// A new claim written by `t` (at its revision): remembered as taken.
    pub(super) fn took(
        &self,
        req: &ClaimRequest,
        key: String,
        stored: StoredClaim,
        t: &crate::etcd::TxnResponse,
        lease: Option<crate::etcd::LeaseId>,
    ) {
        self.shared.epochs.lock().insert(key.clone(), t.revision);
        self.shared.known.lock().insert(key, (t.revision, stored));
        self.confirmed(&req.volume_id, &req.alloc_id, lease);
    }

    /// The index entry of the claim `req` takes (see `index.rs`), written
    /// in the same `Txn` as the claim.
    fn index_put(&self, req: &ClaimRequest) -> TxnOp {
        TxnOp::put(self.index_key(&req.node, &req.volume_id, &req.alloc_id), "")
    }

    /// Takes the claim: one `Txn` when the volume has no claim yet (it
    /// takes it, or reads what is there), else a read and a `Txn` that
    /// holds only while nothing of the volume's claims changed since.
    /// With fencing (an agent), every take `Txn` also compares this node's
    /// liveness key with the revision this agent wrote it at: a take still
    /// in flight lands only while the node is registered and has not fenced
    /// its takes off since (`settle_uncertain_take`).
    pub(in crate::claims) fn take(&self, req: &ClaimRequest) -> Result<(), ClaimError> {
        let prefix = self.volume_prefix(&req.volume_id);
        let lease = self.lease_before();
        let key = self.key(&req.volume_id, &req.alloc_id);
        let mut liveness = self.take_liveness(req)?;
        // The volume's registration, as naming the storage this node's
        // record calls up: compared by the take, so a volume registered
        // again for other storage is never claimed under a stale copy.
        let mut registration = match &req.storage {
            Some(storage) => {
                let revision = self.registration_for(&req.volume_id, storage)?;
                // One name per storage volume (registrations older than the
                // index get it here).
                self.name_storage(storage, &req.volume_id)?;
                let (index, named) = self.storage_named(storage, &req.volume_id);
                Some(TakeRegistration {
                    key: self.volume_key(&req.volume_id),
                    revision,
                    storage,
                    index,
                    named,
                })
            }
            None => None,
        };
        let mut read = None;
        let mut attempts = 0;
        loop {
            attempts += 1;
            if attempts > CONFLICT_ATTEMPTS + 1 {
                return Err(ClaimError::Unavailable {
                    store: "etcd".to_string(),
                    reason: format!(
                        "the claims of volume {} kept changing while this node tried to take one",
                        req.volume_id
                    ),
                });
            }
            let r = match read.take() {
                Some(r) => r,
                None if attempts == 1 => {
                    // No claim of the volume yet: one `Txn` takes it (or
                    // reads what is there).
                    let mut compares = vec![Compare::prefix_empty(prefix.clone())];
                    compares.extend(liveness.compare());
                    compares.extend(registration.iter().flat_map(TakeRegistration::compares));
                    let stored = self.new_claim(req);
                    let value = serde_json::to_vec(&stored).expect("a claim always encodes");
                    let t = self.take_txn(req, &liveness, &registration, &compares, &key, value)?;
                    if t.succeeded {
                        self.took(req, key, stored, &t, lease);
                        return Ok(());
                    }
                    self.registration_moved(req, &liveness, &mut registration, &t)?;
                    if let Some(again) = self.liveness_moved(req, &liveness, &t)? {
                        liveness = again;
                        continue;
                    }
                    read_of(t)?
                }
                None => self
                    .shared
                    .client
                    .range_prefix(&prefix)
                    .map_err(unavailable)?,
            };
            self.shared
                .take_reads
                .lock()
                .insert(req.volume_id.clone(), r.revision);
            let mut others = Vec::new();
            let mut changed = false;
            for kv in &r.kvs {
                let stored = parse(kv)?;
                let c = stored.claim.clone();
                if c.alloc_id != req.alloc_id {
                    others.push(c);
                    continue;
                }
                if c.node == req.node && self.other_instance(&stored) {
                    return Err(ClaimError::Impossible {
                        volume_id: req.volume_id.clone(),
                        reason: format!(
                            "allocation {} holds it on node {} under another instance of that name (a replaced machine, or a new state directory): free it with `claimd claim free` once the old instance is known to be gone",
                            req.alloc_id, c.node
                        ),
                    });
                }
                if c.mode == req.mode && c.access_mode == req.access_mode && c.node == req.node {
                    // This allocation holds it already (a mount asked
                    // again, maybe after a crash): confirm it with a fresh
                    // time and revision, so a reconciliation that read it
                    // before cannot free it under this mount.
                    let fresh = StoredClaim {
                        taken_at_ms: now_ms(),
                        ..stored
                    };
                    let value = serde_json::to_vec(&fresh).expect("a claim always encodes");
                    let same =
                        Compare::mod_revision(kv.key.clone(), CompareOp::Equal, kv.mod_revision);
                    // (Its index entry too: one taken by a claimd without
                    // the index has none yet.)
                    let t = self
                        .shared
                        .client
                        .txn(
                            &[same],
                            &[TxnOp::put(kv.key.clone(), value), self.index_put(req)],
                            &[],
                        )
                        .map_err(unavailable)?;
                    if t.succeeded {
                        self.shared
                            .known
                            .lock()
                            .insert(kv.key_str().into_owned(), (t.revision, fresh));
                        self.shared
                            .epochs
                            .lock()
                            .insert(kv.key_str().into_owned(), kv.create_revision);
                        self.confirmed(&req.volume_id, &req.alloc_id, lease);
                        return Ok(());
                    }
                    // Changed meanwhile (freed by hand, say): read again.
                    changed = true;
                    break;
                }
                return Err(ClaimError::Impossible {
                    volume_id: req.volume_id.clone(),
                    reason: format!(
                        "allocation {} already holds it with another mode ({} {} on node {})",
                        req.alloc_id,
                        c.mode.name(),
                        c.access_mode,
                        c.node
                    ),
                });
            }
            if changed {
                continue;
            }
            check_claim(req, &others.iter().collect::<Vec<_>>())?;
            let stored = self.new_claim(req);
            let value = serde_json::to_vec(&stored).expect("a claim always encodes");
            // Nothing of this volume's claims changed since the read; if
            // something did, the same round trip reads it again.
            let unchanged =
                Compare::mod_revision(prefix.as_bytes(), CompareOp::Less, r.revision + 1)
                    .with_prefix();
            let mut compares = vec![unchanged];
            compares.extend(liveness.compare());
            compares.extend(registration.iter().flat_map(TakeRegistration::compares));
            let t = self.take_txn(req, &liveness, &registration, &compares, &key, value)?;
            if t.succeeded {
                // A new key: created at the transaction's revision.
                self.took(req, key, stored, &t, lease);
                return Ok(());
            }
            self.registration_moved(req, &liveness, &mut registration, &t)?;
            if let Some(again) = self.liveness_moved(req, &liveness, &t)? {
                liveness = again;
                continue;
            }
            read = Some(read_of(t)?);
        }
    }

    /// The liveness revision a take compares: none without fencing (a
    /// store that is not an agent's); an agent not registered takes nothing.
    fn take_liveness(&self, req: &ClaimRequest) -> Result<TakeLiveness, ClaimError> {
        let Some(f) = &self.shared.fencing else {
            return Ok(TakeLiveness(None));
        };
        let key = self.shared.keys.node(&req.node);
        if f.liveness_revision().is_none() {
            // Registering (at start, or after the lease was lost): a take
            // waits for it a little rather than a whole claim backoff.
            f.wait_registered(REGISTRATION_WAIT, &crate::shutdown::Shutdown::new());
        }
        match f.liveness_revision() {
            Some(rev) => Ok(TakeLiveness(Some((key, rev)))),
            None => Err(ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: format!(
                    "this node is not registered in etcd ({key} is not held by this agent's lease): no claim is taken until it is"
                ),
            }),
        }
    }

    /// One take `Txn`: the claim and its index entry on success, the
    /// volume's claims (and this node's liveness key) read on failure. A
    /// `Txn` that did not answer is remembered as uncertain.
    fn take_txn(
        &self,
        req: &ClaimRequest,
        liveness: &TakeLiveness,
        registration: &Option<TakeRegistration<'_>>,
        compares: &[Compare],
        key: &str,
        value: Vec<u8>,
    ) -> Result<crate::etcd::TxnResponse, ClaimError> {
        let mut failure = vec![TxnOp::get_prefix(self.volume_prefix(&req.volume_id))];
        if let Some((k, _)) = &liveness.0 {
            failure.push(TxnOp::get(k.clone()));
        }
        if let Some(r) = registration {
            failure.push(TxnOp::get(r.key.clone()));
            failure.push(TxnOp::get(r.index.clone()));
        }
        self.shared
            .client
            .txn(
                compares,
                &[TxnOp::put(key.to_string(), value), self.index_put(req)],
                &failure,
            )
            .map_err(|e| {
                if let Some((_, rev)) = &liveness.0 {
                    self.shared.uncertain_takes.lock().insert(
                        (req.volume_id.clone(), req.alloc_id.clone()),
                        (req.node.clone(), *rev),
                    );
                }
                unavailable(e)
            })
    }

    /// After a take `Txn` failed: the registration and the storage index
    /// as it read them (after the claims and the liveness key). Moved but
    /// naming the same storage (a capacity written): the next attempt
    /// compares the new revision; registered again for other storage, or
    /// deregistered: `Impossible`. An index that no longer names the
    /// volume is taken back, unless another registration holds it.
    fn registration_moved(
        &self,
        req: &ClaimRequest,
        liveness: &TakeLiveness,
        registration: &mut Option<TakeRegistration<'_>>,
        t: &crate::etcd::TxnResponse,
    ) -> Result<(), ClaimError> {
        let Some(r) = registration else {
            return Ok(());
        };
        let at = 1 + usize::from(liveness.0.is_some());
        let read = |i: usize| match t.responses.get(i) {
            Some(crate::etcd::TxnOpResponse::Range(read)) => Ok(read.kvs.first()),
            _ => Err(ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: "a take's transaction answered without the read it asked for".to_string(),
            }),
        };
        r.revision = self.registration_matches(&req.volume_id, r.storage, read(at)?)?;
        if !read(at + 1)?.is_some_and(|kv| kv.value == req.volume_id.as_bytes()) {
            self.name_storage(r.storage, &req.volume_id)?;
        }
        Ok(())
    }

    /// After a take `Txn` failed: whether its liveness compare did. Some
    /// (the revision to compare now) when this agent moved the key itself
    /// since; an error when the key is gone or not this lease's any more
    /// (the lease ended: no take until the node registers again); None
    /// when the liveness held (the volume's claims changed).
    fn liveness_moved(
        &self,
        req: &ClaimRequest,
        liveness: &TakeLiveness,
        t: &crate::etcd::TxnResponse,
    ) -> Result<Option<TakeLiveness>, ClaimError> {
        let Some((key, rev)) = &liveness.0 else {
            return Ok(None);
        };
        let seen = match t.responses.get(1) {
            Some(crate::etcd::TxnOpResponse::Range(r)) => r.kvs.first(),
            _ => None,
        };
        let now = seen.map(|kv| kv.mod_revision);
        if now == Some(*rev) {
            return Ok(None);
        }
        if let Some(f) = &self.shared.fencing {
            match seen {
                Some(kv) => f.liveness_seen(kv.lease, kv.mod_revision),
                // Gone while this agent holds its lease: deleted by hand
                // (its lease would have ended otherwise, and the liveness
                // thread would register again by itself).
                None if f.valid_lease().is_some() => {
                    log::warn!(
                        "cluster: {key} is gone while this agent's lease is held (deleted by hand?): registering again"
                    );
                    f.ask_reregistration();
                }
                None => {}
            }
        }
        let again = self.take_liveness(req)?;
        match &again.0 {
            Some((_, r)) if now == Some(*r) && r != rev => Ok(Some(again)),
            _ => Err(ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: format!(
                    "{key} is not as this agent registered it (its lease ended?): no claim is taken until the node registers again"
                ),
            }),
        }
    }

    /// Before a claim whose take did not answer is freed (or given up): a
    /// take still in flight could land after the free read "no claim".
    /// Every take compares this node's liveness revision; moving the key
    /// past the revision that take compared (one `Txn` that writes it with
    /// value and lease unchanged) makes sure it never lands. A key moved
    /// already (a registration since, the lease ended, another fence) did
    /// the same. After this, what the free reads is final. An entry stays
    /// until this settles it: a later take of the same claim that answered
    /// does not stop an earlier one still in flight.
    pub(super) fn settle_uncertain_take(
        &self,
        volume_id: &str,
        alloc_id: &str,
    ) -> Result<(), ClaimError> {
        let k = (volume_id.to_string(), alloc_id.to_string());
        let Some((node, rev)) = self.shared.uncertain_takes.lock().get(&k).cloned() else {
            return Ok(());
        };
        let key = self.shared.keys.node(&node);
        let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, rev);
        let t = self
            .shared
            .client
            .txn(
                &[same],
                &[TxnOp::touch(key.as_bytes())],
                &[TxnOp::get(key.as_bytes())],
            )
            .map_err(unavailable)?;
        if let Some(f) = &self.shared.fencing {
            // Moved here, or before (a fence of this agent whose answer was
            // lost moved it too: takes compare where it is now).
            match t.responses.first() {
                Some(crate::etcd::TxnOpResponse::Range(r)) => {
                    if let Some(kv) = r.kvs.first() {
                        f.liveness_seen(kv.lease, kv.mod_revision);
                    }
                }
                _ if t.succeeded => f.liveness_seen(f.registered_lease(), t.revision),
                _ => {}
            }
        }
        if t.succeeded {
            log::info!(
                "cluster: a take of the claim of volume {volume_id} by {alloc_id} did not answer: {key} moved to revision {} so that it can no longer land",
                t.revision
            );
        }
        self.shared.uncertain_takes.lock().remove(&k);
        Ok(())
    }

    /// Deletes the claim; with `holder`, only while that node holds it (one
    /// `Txn` when it is as this node last wrote it). A claim another node
    /// holds under the same allocation ID is left alone; a value that is
    /// not a claim is never deleted.
    pub(in crate::claims) fn free(
        &self,
        volume_id: &str,
        alloc_id: &str,
        holder: Option<&str>,
        while_gone: bool,
        by_hand: Option<&crate::claims::ByHand>,
    ) -> Result<(), ClaimError> {
        let key = self.key(volume_id, alloc_id);
        if let Some(f) = &self.shared.fencing {
            f.forget(volume_id, alloc_id);
        }
        // A take that did not answer may still land: made impossible first,
        // so that the read below is final.
        self.settle_uncertain_take(volume_id, alloc_id)?;
        let epoch = self
            .shared
            .epochs
            .lock()
            .remove(&key)
            .or_else(|| self.recorded_epoch(volume_id, alloc_id));
        let Some(holder) = holder else {
            return self.free_whoever_holds(&key, while_gone, by_hand);
        };
        let known = self
            .shared
            .known
            .lock()
            .get(&key)
            .map(|(rev, s)| (*rev, s.claim.node.clone()));
        if let Some((revision, node)) = known {
            if self.delete_if_unchanged(&key, revision, &node)? {
                return Ok(());
            }
        } else if let Some(epoch) = epoch {
            // Not written by this process (after a restart): the claim this
            // node took is the key created at its epoch; one Txn deletes it,
            // or reads what is there instead.
            let ours = Compare::create_revision(key.as_bytes(), CompareOp::Equal, epoch);
            let t = self
                .shared
                .client
                .txn(
                    &[ours],
                    &[
                        TxnOp::delete(key.as_bytes()),
                        TxnOp::delete(self.index_key_of(&key, holder)),
                    ],
                    &[TxnOp::get(key.as_bytes())],
                )
                .map_err(unavailable)?;
            let gone = matches!(
                t.responses.first(),
                Some(crate::etcd::TxnOpResponse::Range(r)) if r.kvs.is_empty()
            );
            if t.succeeded || gone {
                return Ok(());
            }
        }
        for _ in 0..CONFLICT_ATTEMPTS {
            let Some(kv) = self.shared.client.get(&key).map_err(unavailable)? else {
                self.shared.known.lock().remove(&key);
                return Ok(());
            };
            let stored = parse(&kv)?;
            if self.other_instance(&stored) {
                log::info!(
                    "cluster: claim {key} is held under node name {holder} by another instance: left alone"
                );
                self.shared.known.lock().remove(&key);
                return Ok(());
            }
            if stored.claim.node != holder {
                log::info!(
                    "cluster: claim {key} is held by node {} now, not {holder}: left alone",
                    stored.claim.node
                );
                self.shared.known.lock().remove(&key);
                return Ok(());
            }
            if self.delete_if_unchanged(&key, kv.mod_revision, holder)? {
                return Ok(());
            }
        }
        Err(ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: format!("claim {key} kept changing"),
        })
    }

    /// Deletes the claim at `key` whoever holds it (an operator's free),
    /// with its holder's index entry; a value that is not a claim goes
    /// alone (its entry, if any, is dropped as stale where it is found).
    /// `while_gone`: only while the holder's liveness key is absent, in the
    /// same `Txn`; a holder that is alive again keeps it (`Impossible`).
    /// `by_hand`: only while the node that the operator's command saw
    /// holds it, and with the `freed/` note in the same `Txn` (a crash or
    /// an error between two writes would leave a claim gone without a
    /// note, which its node could not tell from a lost one).
    fn free_whoever_holds(
        &self,
        key: &str,
        while_gone: bool,
        by_hand: Option<&crate::claims::ByHand>,
    ) -> Result<(), ClaimError> {
        let note_lease = by_hand.map(|_| self.freed_note_lease()).transpose()?;
        for _ in 0..CONFLICT_ATTEMPTS {
            let Some(kv) = self.shared.client.get(key).map_err(unavailable)? else {
                self.shared.known.lock().remove(key);
                return Ok(());
            };
            let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, kv.mod_revision);
            let mut compares = vec![same];
            let mut deletes = vec![TxnOp::delete(key.as_bytes())];
            let mut liveness = None;
            if let (Some(hand), Some(lease)) = (by_hand, note_lease) {
                let holder = parse(&kv).ok().map(|s| s.claim.node);
                if holder.as_deref() != Some(hand.claim.node.as_str()) {
                    return Err(ClaimError::Impossible {
                        volume_id: stored_volume(key),
                        reason: format!(
                            "the claim changed since it was read (held by node {} then, {} now): look again",
                            hand.claim.node,
                            holder.as_deref().unwrap_or("none: the value is not a claim")
                        ),
                    });
                }
                let note = serde_json::json!({
                    "claim": hand.claim, "reason": hand.reason, "freed_by_node": hand.by,
                    "at_ms": super::now_ms(),
                });
                deletes.push(TxnOp::put_with_lease(
                    self.shared
                        .keys
                        .freed(&hand.claim.volume_id, &hand.claim.alloc_id),
                    note.to_string(),
                    lease,
                ));
            }
            if let Ok(stored) = parse(&kv) {
                deletes.push(TxnOp::delete(self.index_key_of(key, &stored.claim.node)));
                if while_gone {
                    let k = self.shared.keys.node(&stored.claim.node);
                    compares.push(Compare::absent(k.clone()));
                    liveness = Some((k, stored.claim.node));
                }
            }
            let failure: Vec<TxnOp> = liveness
                .iter()
                .map(|(k, _)| TxnOp::get(k.clone()))
                .collect();
            let t = self
                .shared
                .client
                .txn(&compares, &deletes, &failure)
                .map_err(unavailable)?;
            if t.succeeded {
                self.shared.known.lock().remove(key);
                return Ok(());
            }
            if let Some((_, node)) = liveness {
                let back = t.first_range().is_some_and(|r| !r.kvs.is_empty());
                if back {
                    return Err(ClaimError::Impossible {
                        volume_id: stored_volume(key),
                        reason: format!(
                            "its holder, node {node}, is alive again (its liveness key exists): the claim is left to it"
                        ),
                    });
                }
            }
        }
        Err(ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: format!("claim {key} kept changing"),
        })
    }

    /// The epoch this node's record of the allocation's volume keeps (from
    /// its take, in an earlier run).
    pub(super) fn recorded_epoch(&self, volume_id: &str, alloc_id: &str) -> Option<i64> {
        self.shared.state.read(|s| {
            s.allocs
                .get(alloc_id)?
                .volumes
                .values()
                .find_map(|v| (v.volume_id == volume_id).then_some(v.epoch).flatten())
        })
    }

    /// Deletes the claim at `key`, held by `node`, with its index entry,
    /// if it is still at `revision`.
    pub(super) fn delete_if_unchanged(
        &self,
        key: &str,
        revision: i64,
        node: &str,
    ) -> Result<bool, ClaimError> {
        let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, revision);
        let t = self
            .shared
            .client
            .txn(
                &[same],
                &[
                    TxnOp::delete(key.as_bytes()),
                    TxnOp::delete(self.index_key_of(key, node)),
                ],
                &[],
            )
            .map_err(unavailable)?;
        self.shared.known.lock().remove(key);
        Ok(t.succeeded)
    }

    /// Changes this allocation's claim, if it is held: false when it is
    /// not (a claim not held has nothing to change). One `Txn` when the
    /// claim is as this node last wrote it.
    pub(super) fn update(
        &self,
        volume_id: &str,
        alloc_id: &str,
        f: impl Fn(&mut Claim),
    ) -> Result<bool, ClaimError> {
        let key = self.key(volume_id, alloc_id);
        let known = self.shared.known.lock().get(&key).cloned();
        if let Some((revision, mut stored)) = known {
            f(&mut stored.claim);
            if self.put_if_unchanged(&key, revision, &stored)? {
                return Ok(true);
            }
        }
        for _ in 0..CONFLICT_ATTEMPTS {
            let Some(kv) = self.shared.client.get(&key).map_err(unavailable)? else {
                self.shared.known.lock().remove(&key);
                return Ok(false);
            };
            let mut stored = parse(&kv)?;
            if (!self.shared.node.is_empty() && stored.claim.node != self.shared.node)
                || self.other_instance(&stored)
            {
                // The same allocation ID held on another node by now.
                self.shared.known.lock().remove(&key);
                return Ok(false);
            }
            f(&mut stored.claim);
            if self.put_if_unchanged(&key, kv.mod_revision, &stored)? {
                return Ok(true);
            }
        }
        Err(ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: format!("claim {key} kept changing"),
        })
    }

    /// Writes the claim if its key is still at `revision`; remembers it.
    pub(super) fn put_if_unchanged(
        &self,
        key: &str,
        revision: i64,
        stored: &StoredClaim,
    ) -> Result<bool, ClaimError> {
        let value = serde_json::to_vec(stored).expect("a claim always encodes");
        let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, revision);
        let t = self
            .shared
            .client
            .txn(&[same], &[TxnOp::put(key.as_bytes(), value)], &[])
            .map_err(unavailable)?;
        let mut known = self.shared.known.lock();
        if t.succeeded {
            known.insert(key.to_string(), (t.revision, stored.clone()));
        } else {
            known.remove(key);
        }
        Ok(t.succeeded)
    }
}

/// The read of the failure branch of a take's `Txn`, at its revision.
fn read_of(t: crate::etcd::TxnResponse) -> Result<crate::etcd::RangeResponse, ClaimError> {
    let revision = t.revision;
    match t.responses.into_iter().next() {
        Some(crate::etcd::TxnOpResponse::Range(mut r)) => {
            r.revision = revision;
            Ok(r)
        }
        _ => Err(ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: "a take's transaction answered without the read it asked for".to_string(),
        }),
    }
}

/// The volume of a claim key (`<prefix>/claims/<volume>/<alloc>`).
fn stored_volume(key: &str) -> String {
    key.rsplit('/').nth(1).unwrap_or_default().to_string()
}

/// How long a take waits for this agent's registration before it is
/// refused (and retried by the mount with its backoff).
const REGISTRATION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The registration a take compares, at the revision that named the
/// take's storage.
struct TakeRegistration<'a> {
    key: String,
    revision: i64,
    storage: &'a crate::claims::StorageRef,
    /// The storage index and its compare (it names this volume).
    index: String,
    named: Compare,
}

impl TakeRegistration<'_> {
    fn compares(&self) -> [Compare; 2] {
        [
            Compare::mod_revision(self.key.as_bytes(), CompareOp::Equal, self.revision),
            self.named.clone(),
        ]
    }
}

/// The liveness key a take compares and its revision (None: no compare).
struct TakeLiveness(Option<(String, i64)>);

impl TakeLiveness {
    fn compare(&self) -> Option<Compare> {
        self.0
            .as_ref()
            .map(|(k, rev)| Compare::mod_revision(k.as_bytes(), CompareOp::Equal, *rev))
    }
}
