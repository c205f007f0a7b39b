//! Volume registrations in etcd (`<prefix>/volumes/<id>`): written only
//! while nothing claims the volume, and compared by every take, so a claim
//! is always a claim of the storage its registration names.

use super::*;
use crate::claims::StorageRef;
use crate::etcd::CompareOp;

impl SharedVolumes for EtcdClaims {
    fn register(&self, spec: &VolumeSpec) -> Result<(), ClaimError> {
        let key = self.volume_key(&spec.id);
        let value = serde_json::to_vec(spec).expect("a volume spec always encodes");
        for _ in 0..=CONFLICT_ATTEMPTS {
            let now = self.client.get(&key).map_err(unavailable)?;
            let compares = match &now {
                None => vec![Compare::create_revision(
                    key.as_bytes(),
                    CompareOp::Equal,
                    0,
                )],
                Some(kv) if kv.value == value => return Ok(()),
                Some(kv) => vec![
                    Compare::mod_revision(key.as_bytes(), CompareOp::Equal, kv.mod_revision),
                    Compare::prefix_empty(self.volume_prefix(&spec.id)),
                ],
            };
            let t = self
                .client
                .txn(&compares, &[TxnOp::put(key.as_bytes(), value.clone())], &[])
                .map_err(unavailable)?;
            if t.succeeded {
                return Ok(());
            }
            let claimed = !self
                .client
                .range_prefix(self.volume_prefix(&spec.id))
                .map_err(unavailable)?
                .kvs
                .is_empty();
            if claimed && now.is_some() {
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

    fn set_capacity(
        &self,
        volume_id: &str,
        capacity: i64,
        pending: bool,
    ) -> Result<(), ClaimError> {
        let key = self.volume_key(volume_id);
        for _ in 0..=CONFLICT_ATTEMPTS {
            let Some(kv) = self.client.get(&key).map_err(unavailable)? else {
                return Ok(());
            };
            let mut spec = parse_spec(&kv)?;
            spec.capacity_bytes = capacity;
            spec.node_expansion_pending = pending;
            let value = serde_json::to_vec(&spec).expect("a volume spec always encodes");
            let same = Compare::mod_revision(key.as_bytes(), CompareOp::Equal, kv.mod_revision);
            let t = self
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
        let t = self
            .client
            .txn(&[unclaimed], &[TxnOp::delete(key.as_bytes())], &[])
            .map_err(unavailable)?;
        if !t.succeeded {
            return Err(ClaimError::Impossible {
                volume_id: volume_id.to_string(),
                reason: "it is claimed (a claim was taken while it was being deregistered): release it first".to_string(),
            });
        }
        Ok(t.responses
            .first()
            .is_some_and(|r| matches!(r, crate::etcd::TxnOpResponse::Delete(d) if d.deleted > 0)))
    }

    /// Also remembered as the registration the next take of the volume
    /// compares (`registration_for`).
    fn get(&self, volume_id: &str) -> Result<Option<VolumeSpec>, ClaimError> {
        let kv = self
            .client
            .get(self.volume_key(volume_id))
            .map_err(unavailable)?;
        self.registration_seen(volume_id, kv.as_ref())
    }

    fn list(&self) -> Result<Vec<VolumeSpec>, ClaimError> {
        let r = self
            .client
            .range_prefix(format!("{}/volumes/", self.prefix))
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
    /// Remembers a registration as read (its revision and storage), and
    /// answers it; an absent one is forgotten.
    pub(super) fn registration_seen(
        &self,
        volume_id: &str,
        kv: Option<&KeyValue>,
    ) -> Result<Option<VolumeSpec>, ClaimError> {
        let Some(kv) = kv else {
            self.registrations.lock().remove(volume_id);
            return Ok(None);
        };
        let spec = parse_spec(kv)?;
        self.registrations.lock().insert(
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
        if let Some((rev, seen)) = self.registrations.lock().get(volume_id) {
            if seen == storage {
                return Ok(*rev);
            }
        }
        let kv = self
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
