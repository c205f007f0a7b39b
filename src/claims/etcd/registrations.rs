//! Volume registrations in etcd (`<prefix>/volumes/<id>`): written only
//! while nothing claims the volume, and compared by every take, so a claim
//! is always a claim of the storage its registration names. One storage
//! volume (a plugin's external ID) is registered under one name: the
//! index `<prefix>/storage/<plugin>/<hex of the external ID>` names it,
//! and every registration and every take compares it.

use super::*;
use crate::claims::StorageRef;
use crate::etcd::CompareOp;

impl SharedVolumes for EtcdClaims {
    fn register(&self, spec: &VolumeSpec) -> Result<(), ClaimError> {
        let key = self.volume_key(&spec.id);
        let value = serde_json::to_vec(spec).expect("a volume spec always encodes");
        let storage = StorageRef::of(spec);
        let index = self.storage_key(&storage);
        for _ in 0..=CONFLICT_ATTEMPTS {
            let now = self.shared.client.get(&key).map_err(unavailable)?;
            let old = now.as_ref().map(parse_spec).transpose()?;
            if now.as_ref().is_some_and(|kv| kv.value == value) {
                return Ok(());
            }
            self.name_storage(&storage, &spec.id)?;
            // Nothing claims the volume (a new registration too: a claim
            // whose registration went by hand keeps its storage), and the
            // index still names it.
            let mut compares = vec![
                Compare::prefix_empty(self.volume_prefix(&spec.id)),
                Compare::value(index.as_bytes(), CompareOp::Equal, spec.id.as_bytes()),
            ];
            compares.push(match &now {
                None => Compare::create_revision(key.as_bytes(), CompareOp::Equal, 0),
                Some(kv) => {
                    Compare::mod_revision(key.as_bytes(), CompareOp::Equal, kv.mod_revision)
                }
            });
            let t = self
                .shared
                .client
                .txn(&compares, &[TxnOp::put(key.as_bytes(), value.clone())], &[])
                .map_err(unavailable)?;
            if t.succeeded {
                // The storage it named before is free for another name.
                if let Some(old) = old.filter(|o| StorageRef::of(o).volume() != storage.volume()) {
                    self.unname_storage(&StorageRef::of(&old), &spec.id);
                }
                return Ok(());
            }
            let claimed = !self
                .shared
                .client
                .range_prefix(self.volume_prefix(&spec.id))
                .map_err(unavailable)?
                .kvs
                .is_empty();
            if claimed {
                return Err(ClaimError::Impossible {
                    volume_id: spec.id.clone(),
                    reason: "it is claimed: its registration changes only while nothing claims it (release it first)".to_string(),
                });
            }
        }
        Err(conflict(
            &spec.id,
            "its registration kept changing while this node wrote it",
        ))
    }

    /// Written only while the registration still names `expanded`'s
    /// storage (registered again meanwhile: the capacity is not its).
    fn set_capacity(
        &self,
        expanded: &VolumeSpec,
        capacity: i64,
        pending: bool,
    ) -> Result<(), ClaimError> {
        let volume_id = &expanded.id;
        let key = self.volume_key(volume_id);
        for _ in 0..=CONFLICT_ATTEMPTS {
            let Some(kv) = self.shared.client.get(&key).map_err(unavailable)? else {
                return Ok(());
            };
            let mut spec = parse_spec(&kv)?;
            if StorageRef::of(&spec) != StorageRef::of(expanded) {
                log::info!(
                    "volume {volume_id}: registered again for other storage since its expansion: its capacity is not written"
                );
                return Ok(());
            }
            spec.capacity_bytes = capacity;
            spec.node_expansion_pending = pending;
            let value = serde_json::to_vec(&spec).expect("a volume spec always encodes");
            let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, kv.mod_revision);
            let t = self
                .shared
                .client
                .txn(&[same], &[TxnOp::put(key.as_bytes(), value)], &[])
                .map_err(unavailable)?;
            if t.succeeded {
                return Ok(());
            }
        }
        Err(conflict(
            volume_id,
            "its registration kept changing while this node wrote its capacity",
        ))
    }

    /// One `Txn`: the registration goes only while the volume has no
    /// claim (a take racing the deregistration makes it fail, never the
    /// other way round).
    fn delete(&self, volume_id: &str) -> Result<bool, ClaimError> {
        let key = self.volume_key(volume_id);
        let unclaimed = Compare::prefix_empty(self.volume_prefix(volume_id));
        let before = match self.shared.client.get(&key).map_err(unavailable)? {
            Some(kv) => parse_spec(&kv).ok(),
            None => None,
        };
        let t = self
            .shared
            .client
            .txn(&[unclaimed], &[TxnOp::delete(key.as_bytes())], &[])
            .map_err(unavailable)?;
        if !t.succeeded {
            return Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: "it is claimed (a claim was taken while it was being deregistered): release it first".to_string(),
            });
        }
        // The storage it named is free for another name (an index left
        // naming a volume that is gone counts as free anyway).
        if let Some(spec) = before {
            self.unname_storage(&StorageRef::of(&spec), volume_id);
        }
        Ok(t.responses
            .first()
            .is_some_and(|r| matches!(r, crate::etcd::TxnOpResponse::Delete(d) if d.deleted > 0)))
    }

    /// Also remembered as the registration the next take of the volume
    /// compares (`registration_for`).
    fn get(&self, volume_id: &str) -> Result<Option<VolumeSpec>, ClaimError> {
        let kv = self
            .shared
            .client
            .get(self.volume_key(volume_id))
            .map_err(unavailable)?;
        self.registration_seen(volume_id, kv.as_ref())
    }

    fn list(&self) -> Result<Vec<VolumeSpec>, ClaimError> {
        let r = self
            .shared
            .client
            .range_prefix(self.shared.keys.volumes())
            .map_err(unavailable)?;
        r.kvs.iter().map(parse_spec).collect()
    }
}

pub(crate) fn parse_spec(kv: &KeyValue) -> Result<VolumeSpec, ClaimError> {
    let spec: VolumeSpec = serde_json::from_slice(&kv.value).map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })?;
    spec.validate().map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })?;
    Ok(spec)
}

impl EtcdClaims {
    /// `<prefix>/storage/<plugin>/<hex of the external ID>`: the name the
    /// storage volume is registered under.
    fn storage_key(&self, storage: &StorageRef) -> String {
        let hex: String = storage
            .external_id
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.shared.keys.storage(&storage.plugin_id, &hex)
    }

    /// Makes the storage index name `name`: written when absent, or when
    /// the name it holds has no registration of that storage any more (an
    /// index left behind, or a registration older than the index);
    /// `Impossible` when another registration names the storage.
    pub(super) fn name_storage(&self, storage: &StorageRef, name: &str) -> Result<(), ClaimError> {
        let index = self.storage_key(storage);
        for _ in 0..=CONFLICT_ATTEMPTS {
            let compare = match self.shared.client.get(&index).map_err(unavailable)? {
                Some(kv) if kv.value == name.as_bytes() => return Ok(()),
                Some(kv) => {
                    let other = String::from_utf8_lossy(&kv.value).into_owned();
                    let holds = match self
                        .shared
                        .client
                        .get(self.volume_key(&other))
                        .map_err(unavailable)?
                    {
                        Some(r) => parse_spec(&r)
                            .is_ok_and(|o| StorageRef::of(&o).volume() == storage.volume()),
                        None => false,
                    };
                    if holds {
                        return Err(ClaimError::Impossible {
                            volume_id: name.to_string(),
                            reason: format!(
                                "its storage (volume {} of plugin {}) is registered as volume {other}: one storage volume has one name in the cluster",
                                storage.external_id, storage.plugin_id
                            ),
                        });
                    }
                    Compare::mod_revision(index.as_bytes(), CompareOp::Equal, kv.mod_revision)
                }
                None => Compare::create_revision(index.as_bytes(), CompareOp::Equal, 0),
            };
            let t = self
                .shared
                .client
                .txn(
                    &[compare],
                    &[TxnOp::put(index.as_bytes(), name.as_bytes())],
                    &[],
                )
                .map_err(unavailable)?;
            if t.succeeded {
                return Ok(());
            }
        }
        Err(conflict(name, "the index of its storage kept changing"))
    }

    /// Drops the storage index while it names `name` (best effort: an
    /// index left behind is taken over by the next name).
    fn unname_storage(&self, storage: &StorageRef, name: &str) {
        let index = self.storage_key(storage);
        let ours = Compare::value(index.as_bytes(), CompareOp::Equal, name.as_bytes());
        if let Err(e) = self
            .shared
            .client
            .txn(&[ours], &[TxnOp::delete(index.as_bytes())], &[])
        {
            log::info!("cluster: the storage index {index} of {name} stays: {e}");
        }
    }

    /// The compare a take of `volume_id` makes on its storage's index.
    pub(super) fn storage_named(&self, storage: &StorageRef, volume_id: &str) -> (String, Compare) {
        let index = self.storage_key(storage);
        let c = Compare::value(index.as_bytes(), CompareOp::Equal, volume_id.as_bytes());
        (index, c)
    }

    /// Remembers a registration as read (its revision and storage), and
    /// answers it; an absent one is forgotten.
    pub(super) fn registration_seen(
        &self,
        volume_id: &str,
        kv: Option<&KeyValue>,
    ) -> Result<Option<VolumeSpec>, ClaimError> {
        let Some(kv) = kv else {
            self.shared.registrations.lock().remove(volume_id);
            return Ok(None);
        };
        let spec = parse_spec(kv)?;
        self.shared.registrations.lock().insert(
            volume_id.to_string(),
            (kv.mod_revision, StorageRef::of(&spec)),
        );
        Ok(Some(spec))
    }

    /// The mod revision of the registration a take of `req` compares: the
    /// last one read when it names the storage the take is for, else read
    /// now. `Impossible` when the volume is not registered, or registered
    /// for other storage than this node's record says (registered again
    /// since the node copied it: a new mount copies the new one).
    pub(super) fn registration_for(
        &self,
        volume_id: &str,
        storage: &StorageRef,
    ) -> Result<i64, ClaimError> {
        if let Some((rev, seen)) = self.shared.registrations.lock().get(volume_id) {
            if seen == storage {
                return Ok(*rev);
            }
        }
        let kv = self
            .shared
            .client
            .get(self.volume_key(volume_id))
            .map_err(unavailable)?;
        self.registration_matches(volume_id, storage, kv.as_ref())
    }

    /// Checks a registration as read against the storage a take is for;
    /// its mod revision when it matches.
    pub(super) fn registration_matches(
        &self,
        volume_id: &str,
        storage: &StorageRef,
        kv: Option<&KeyValue>,
    ) -> Result<i64, ClaimError> {
        let rev = kv.map(|kv| kv.mod_revision);
        match (self.registration_seen(volume_id, kv)?, rev) {
            (Some(spec), Some(rev)) if StorageRef::of(&spec) == *storage => Ok(rev),
            (Some(spec), _) => Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: format!(
                    "the cluster's registration names volume {} of plugin {}, this node's copy {} of plugin {} (registered again since this node copied it): mount it again to use the registration as it is now",
                    spec.external_id, spec.plugin_id, storage.external_id, storage.plugin_id
                ),
            }),
            (None, _) => Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: "it is not registered in the cluster (deregistered since this node copied it)".to_string(),
            }),
        }
    }
}

fn conflict(volume_id: &str, why: &str) -> ClaimError {
    ClaimError::Unavailable {
        store: "etcd".to_string(),
        reason: format!("volume {volume_id}: {why}"),
    }
}
