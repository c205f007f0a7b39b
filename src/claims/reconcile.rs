//! The start-up reconciliation of the etcd claim store: this node's claims
//! against its local records, after each registration of its liveness.

use std::collections::HashSet;

use super::etcd::{parse, unavailable, EtcdClaims, StoredClaim};
use super::ClaimError;
use crate::etcd::{Compare, CompareOp, KeyValue, TxnOp};

/// What the start-up reconciliation found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// (volume, alloc) of this node's claims without a local record, freed.
    pub freed: Vec<(String, String)>,
    /// Such claims kept because something of them is still mounted.
    pub kept: Vec<(String, String)>,
    /// (volume, alloc, why) of local records past their claim whose claim
    /// etcd no longer holds: freed by the cluster (the disconnect rule) or
    /// by hand while this node was away. Their allocations must go.
    pub lost: Vec<(String, String, String)>,
    /// (volume, alloc) of local records past their claim whose claim etcd
    /// no longer holds and has no note of (gone by accident): taken again
    /// under this instance.
    pub retaken: Vec<(String, String)>,
}

impl EtcdClaims {
    /// Whether this node's record of `alloc_id` holds `volume_id` past its
    /// claim and is not being released.
    fn past_claim(&self, volume_id: &str, alloc_id: &str) -> bool {
        self.shared.state.read(|s| {
            s.allocs.get(alloc_id).is_some_and(|a| {
                !a.releasing
                    && a.volumes.values().any(|v| {
                        v.volume_id == volume_id
                            && matches!(
                                v.phase,
                                crate::state::Phase::Mounting | crate::state::Phase::Published
                            )
                    })
            })
        })
    }

    /// Claims in etcd held by `node` for which no local record exists (a
    /// crash between the claim store's round trip and the local write, or a
    /// state directory replaced by hand) are freed, after checking that
    /// nothing of theirs is mounted under `mount_root`, whenever they were
    /// taken: a take of this process counts as in flight from before its
    /// round trip until its record is written, and a take that did not
    /// answer and is no longer wanted (its record gone) is exactly what
    /// must be collected here.
    pub fn reconcile(
        &self,
        node: &str,
        mount_root: &std::path::Path,
    ) -> Result<Reconciled, ClaimError> {
        // The local records first: one past its claim was in etcd before
        // it was recorded, so a claim missing from the later read was freed.
        let past_claim: Vec<(String, String, super::ClaimRequest)> = self.shared.state.read(|s| {
            s.alloc_volumes()
                .filter(|(a, v)| {
                    !a.releasing
                        && matches!(
                            v.phase,
                            crate::state::Phase::Mounting | crate::state::Phase::Published
                        )
                })
                .map(|(a, v)| {
                    let req = super::ClaimRequest {
                        volume_id: v.volume_id.clone(),
                        alloc_id: a.id.clone(),
                        node: node.to_string(),
                        mode: if v.usage.read_only {
                            super::ClaimMode::Read
                        } else {
                            super::ClaimMode::Write
                        },
                        access_mode: v.usage.access_mode,
                        external_node_id: v.external_node_id.clone(),
                        storage: Some(super::StorageRef {
                            plugin_id: v.plugin_id.clone(),
                            external_id: v.external_volume_id.clone(),
                            context: s
                                .volumes
                                .get(&v.volume_id)
                                .map(|spec| spec.context.clone())
                                .unwrap_or_default(),
                        }),
                    };
                    (v.volume_id.clone(), a.id.clone(), req)
                })
                .collect()
        });
        // What this node holds: through its index (the claims of its
        // entries and of its records, read by key), or, before its first
        // reconciliation with the index, by reading every claim (its older
        // claims are indexed at the end).
        let index = self.read_index(node)?;
        let kvs: Vec<KeyValue> = if index.trusted {
            let mut wanted: HashSet<(String, String)> =
                index.entries.iter().map(|(p, _)| p.clone()).collect();
            wanted.extend(past_claim.iter().map(|(v, a, _)| (v.clone(), a.clone())));
            let read = self.get_claims(&wanted)?;
            self.drop_stale_entries(node, &index.entries, &read);
            let mut kvs: Vec<KeyValue> = read.into_values().collect();
            kvs.sort_by(|a, b| a.key.cmp(&b.key));
            kvs
        } else {
            self.shared
                .client
                .range_prefix(self.all_prefix())
                .map_err(unavailable)?
                .kvs
        };
        // Held by this node, or not known by whom (a value that is not a
        // claim is never taken for a freed one).
        let held: HashSet<(String, String)> = kvs
            .iter()
            .filter_map(|kv| match parse(kv) {
                Ok(s) if s.claim.node == node => Some((s.claim.volume_id, s.claim.alloc_id)),
                Ok(_) => None,
                Err(_) => {
                    let key = kv.key_str();
                    let (v, a) = self.shared.keys.parse_claim(&key)?;
                    Some((v.to_string(), a.to_string()))
                }
            })
            .collect();
        let mut lost = Vec::new();
        let mut retaken = Vec::new();
        for (volume_id, alloc_id, req) in past_claim {
            if held.contains(&(volume_id.clone(), alloc_id.clone())) {
                continue;
            }
            let note = self
                .shared
                .client
                .get(self.shared.keys.freed(&volume_id, &alloc_id))
                .map_err(unavailable)?;
            let why = note
                .and_then(|kv| serde_json::from_slice::<serde_json::Value>(&kv.value).ok())
                .and_then(|v| v["reason"].as_str().map(str::to_string));
            let Some(why) = why else {
                // Gone without a trace (its note's lease ran out while this
                // node was suspended, an etcd restored from an old backup,
                // a changed prefix or node name): the volume may still be
                // in use here, and nothing holds it for this node. Taken
                // again, as a mount takes it (compatible with every claim
                // of the volume, under this instance); if another
                // allocation holds it now, this node stops using it.
                // A release of this node frees the claim after it marked
                // the record releasing: looked at again after the read
                // above, and after the take (given back if it started).
                if !self.past_claim(&volume_id, &alloc_id) {
                    continue;
                }
                match self.take(&req) {
                    Ok(()) if !self.past_claim(&volume_id, &alloc_id) => {
                        self.free(&volume_id, &alloc_id, Some(node), false, None)?;
                    }
                    Ok(()) => {
                        log::warn!(
                            "cluster: allocation {alloc_id} on this node records volume {volume_id} but etcd held no claim of it and no note of it being freed: its claim is taken again (check the cluster section's prefix and node_name if this was not expected)"
                        );
                        retaken.push((volume_id, alloc_id));
                    }
                    // etcd did not answer: the reconciliation is retried.
                    Err(e @ ClaimError::Unavailable { .. }) => return Err(e),
                    // Held by another allocation, or never to be granted
                    // (the volume deregistered meanwhile, a value that is
                    // not a claim in the way): this node stops using it.
                    Err(e) => lost.push((
                        volume_id,
                        alloc_id,
                        format!(
                            "its claim vanished without a note of it being freed, and cannot be taken again: {e}"
                        ),
                    )),
                }
                continue;
            };
            // Freed on purpose (the disconnect rule, or by hand).
            lost.push((volume_id, alloc_id, why));
        }
        let table = crate::mounts::MountTable::read().map_err(|e| ClaimError::Unavailable {
            store: "mountinfo".to_string(),
            reason: e.to_string(),
        })?;
        let mut out = Reconciled {
            lost,
            retaken,
            ..Reconciled::default()
        };
        for kv in &kvs {
            let Ok(stored) = parse(kv) else {
                // A corrupt value is reported where it is used, never
                // touched here.
                continue;
            };
            let c = &stored.claim;
            // Another instance of this node's name took it (a replaced
            // machine, a new state directory): never freed from here.
            // (Taken before instances existed, or by a store without one:
            // this name's, kept only if something is mounted.)
            if c.node == node && self.other_instance(&stored) {
                log::error!(
                    "cluster: claim of volume {} by allocation {} is held under node name {} by another instance ({}): not freed by this one; free it with `claimd claim free` once that instance is known to be gone",
                    c.volume_id,
                    c.alloc_id,
                    c.node,
                    stored.instance.as_deref().unwrap_or_default()
                );
                out.kept.push((c.volume_id.clone(), c.alloc_id.clone()));
                continue;
            }
            if c.node != node {
                continue;
            }
            // Remembered as read (unless this run wrote it since): the
            // first change of it after a restart, the release's mark, is
            // one `Txn` comparing this revision, not a read and a `Txn`.
            // A stale revision only fails the compare.
            self.shared
                .known
                .lock()
                .entry(kv.key_str().to_string())
                .or_insert_with(|| (kv.mod_revision, stored.clone()));
            // A take of this process between its round trip and its
            // record: not an orphan. (Looked at before the records: a take
            // leaves this set only once its record is written.)
            let key = (c.volume_id.clone(), c.alloc_id.clone());
            if self.shared.takes_in_flight.lock().takes.contains_key(&key) {
                continue;
            }
            let recorded = self.shared.state.read(|s| {
                s.allocs
                    .get(&c.alloc_id)
                    .is_some_and(|a| a.volumes.values().any(|v| v.volume_id == c.volume_id))
            });
            if recorded {
                continue;
            }
            let dir = mount_root
                .join("per-alloc")
                .join(&c.alloc_id)
                .join(&c.volume_id);
            if !table.under(&dir).is_empty() {
                log::error!(
                    "cluster: claim of volume {} by allocation {} on this node has no local record but {} still has mounts; keeping it (free it with `claimd claim free` once they are gone)",
                    c.volume_id,
                    c.alloc_id,
                    dir.display()
                );
                out.kept.push(key);
                continue;
            }
            // Only this very claim: one taken again meanwhile stays.
            let same = Compare::mod_revision(kv.key.clone(), CompareOp::Equal, kv.mod_revision);
            let t = self
                .shared
                .client
                .txn(
                    &[same],
                    &[
                        TxnOp::delete(kv.key.clone()),
                        TxnOp::delete(self.index_key_of(&kv.key_str(), node)),
                    ],
                    &[],
                )
                .map_err(unavailable)?;
            if t.succeeded {
                log::warn!(
                    "cluster: freed the claim of volume {} by allocation {} on this node: no local record holds it (a crash between the claim store and the local write) and nothing of it is mounted",
                    c.volume_id,
                    c.alloc_id
                );
                out.freed.push(key);
            }
        }
        if !index.trusted {
            let mine: Vec<(KeyValue, StoredClaim)> = kvs
                .iter()
                .filter_map(|kv| {
                    let s = parse(kv).ok()?;
                    let pair = (s.claim.volume_id.clone(), s.claim.alloc_id.clone());
                    (s.claim.node == node && !out.freed.contains(&pair)).then(|| (kv.clone(), s))
                })
                .collect();
            let have: HashSet<(String, String)> =
                index.entries.iter().map(|(p, _)| p.clone()).collect();
            // Best effort: what was found above is acted on either way; a
            // failure leaves the marker unwritten, so the next
            // reconciliation (and every reaper) reads every claim again.
            match self.index_older_claims(node, &mine, &have) {
                Ok(added) => log::info!(
                    "cluster: this node's claims are indexed now ({added} older claim(s) added to node-claims/{node}/): later reconciliations read only those"
                ),
                Err(e) => log::warn!(
                    "cluster: this node's older claims could not all be indexed now ({e}): the next reconciliation reads every claim again"
                ),
            }
        }
        Ok(out)
    }
}
