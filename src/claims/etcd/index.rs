//! The per-node index of claims, so that finding one node's claims never
//! reads every claim of the cluster (a start-up reconciliation, the
//! reaper's look at a gone node, `node remove`).
//!
//! - `<prefix>/node-claims/<node>/<volume>/<alloc>` (empty value) exists
//!   exactly while `claims/<volume>/<alloc>` names `<node>`: it is put in
//!   the `Txn` that takes the claim and deleted in every `Txn` that deletes
//!   it, so the two never disagree, whatever fails.
//! - `<prefix>/claim-index/<node>` (the marker) says that the node's claims
//!   taken before the index existed (by an earlier claimd) are indexed too:
//!   the node's first reconciliation with the index reads every claim once,
//!   indexes the node's own, then writes it.
//! - The node's settings (`node-settings/<node>`, rewritten by every
//!   registration) say `claim_index: true` when the agent that registered
//!   keeps the index. An older claimd rewrites them without it: a node
//!   downgraded to one may take claims it does not index.
//!
//! A node's index is trusted only while both hold; otherwise it is looked
//! up by reading every claim, as before the index. Before each
//! registration the node's own agent deletes a marker whose settings lack
//! the flag (an older claimd ran here since the marker was written), so
//! that its next reconciliation reads every claim and indexes them again.
//!
//! Entries whose claim was deleted by a claimd without the index (a mixed
//! cluster during an upgrade) are stale: whoever finds one deletes it
//! under a compare that the claim is still gone. The node's own agent owns
//! its entries and marker; `node remove` deletes them with the node.

use std::collections::{HashMap, HashSet};

use super::*;
use serde::Deserialize;

use crate::etcd::{CompareOp, RangeResponse, TxnOpResponse};

/// At most this many reads in one `Txn` (etcd refuses more than its
/// `--max-txn-ops`, 128 by default).
const GETS_PER_TXN: usize = 64;

/// One node's claims as found: from its index (with the index read's
/// revision) or, for a node without a marker, from every claim.
#[derive(Debug, Default)]
pub struct NodeClaims {
    /// Found through the index (the marker was there).
    pub indexed: bool,
    /// The revision of the read that listed them: of the index, or of
    /// every claim.
    pub revision: i64,
    /// The node's claims as stored (valid values only).
    pub claims: Vec<(KeyValue, StoredClaim)>,
}

impl NodeClaims {
    /// The volumes of the claims, sorted, each once.
    pub fn volumes(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .claims
            .iter()
            .map(|(_, s)| s.claim.volume_id.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// What the index says of a node: whether its marker is there and its
/// settings say its agent keeps the index, and its entries (volume, alloc)
/// with their key-values.
pub(crate) struct IndexRead {
    /// The marker is there and the node's settings carry `claim_index`.
    pub trusted: bool,
    /// The revision of the read of the entries.
    pub revision: i64,
    pub entries: Vec<((String, String), KeyValue)>,
}

/// The one field of `node-settings/<node>` (`cluster::NodeSettings`) that
/// the index needs; the rest is ignored.
#[derive(Deserialize)]
struct SettingsFlag {
    #[serde(default)]
    claim_index: bool,
}

/// Whether a `node-settings/<node>` value carries `claim_index: true`.
fn keeps_index(kv: Option<&KeyValue>) -> bool {
    kv.and_then(|kv| serde_json::from_slice::<SettingsFlag>(&kv.value).ok())
        .is_some_and(|s| s.claim_index)
}

impl EtcdClaims {
    /// `<prefix>/node-claims/<node>/`.
    pub(crate) fn index_prefix(&self, node: &str) -> String {
        self.shared.keys.node_claims(node)
    }

    /// The index entry of `node`'s claim of `volume_id` by `alloc_id`.
    pub(crate) fn index_key(&self, node: &str, volume_id: &str, alloc_id: &str) -> String {
        self.shared.keys.node_claim(node, volume_id, alloc_id)
    }

    /// The index entry of the claim at `claim_key` held by `node`.
    pub(crate) fn index_key_of(&self, claim_key: &str, node: &str) -> String {
        self.shared
            .keys
            .node_claim_of(node, claim_key)
            .expect("a claim key lies under the claims prefix")
    }

    /// `<prefix>/claim-index/<node>`: the node's older claims are indexed.
    pub(crate) fn index_marker(&self, node: &str) -> String {
        self.shared.keys.claim_index(node)
    }

    /// The marker and settings of `node` (one `Txn`), then its entries
    /// (in pages, at one revision).
    pub(crate) fn read_index(&self, node: &str) -> Result<IndexRead, ClaimError> {
        let (marker, settings) = self.marker_and_settings(node)?;
        let prefix = self.index_prefix(node);
        let index = self
            .shared
            .client
            .range_prefix(&prefix)
            .map_err(unavailable)?;
        let entries = index
            .kvs
            .into_iter()
            .filter_map(|kv| {
                let key = kv.key_str().into_owned();
                let (v, a) = self.shared.keys.parse_node_claim(node, &key)?;
                Some(((v.to_string(), a.to_string()), kv))
            })
            .collect();
        Ok(IndexRead {
            trusted: marker.is_some() && keeps_index(settings.as_ref()),
            revision: index.revision,
            entries,
        })
    }

    /// The marker and the settings of `node`, read in one `Txn`.
    fn marker_and_settings(
        &self,
        node: &str,
    ) -> Result<(Option<KeyValue>, Option<KeyValue>), ClaimError> {
        let t = self
            .shared
            .client
            .txn(
                &[],
                &[
                    TxnOp::get(self.index_marker(node)),
                    TxnOp::get(self.shared.keys.settings(node)),
                ],
                &[],
            )
            .map_err(unavailable)?;
        let mut ranges = t.responses.into_iter().filter_map(|r| match r {
            TxnOpResponse::Range(r) => Some(r.kvs.into_iter().next()),
            _ => None,
        });
        match (ranges.next(), ranges.next()) {
            (Some(marker), Some(settings)) => Ok((marker, settings)),
            _ => Err(ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: "a read of a node's claim index marker and settings answered without its two ranges".to_string(),
            }),
        }
    }

    /// Run before each registration of `node` by its own agent: a marker
    /// whose settings lack `claim_index` (an older claimd registered here
    /// since the marker was written, and may have taken claims it did not
    /// index) is deleted, so that nothing trusts the index until the next
    /// reconciliation has read every claim and indexed them again.
    pub fn forget_index_if_an_older_claimd_ran(&self, node: &str) -> Result<(), ClaimError> {
        let (marker, settings) = self.marker_and_settings(node)?;
        let Some(marker) = marker else {
            return Ok(());
        };
        if keeps_index(settings.as_ref()) {
            return Ok(());
        }
        let settings_as_read = match &settings {
            Some(kv) => Compare::mod_revision(kv.key.clone(), CompareOp::Equal, kv.mod_revision),
            None => Compare::absent(self.shared.keys.settings(node)),
        };
        let same = Compare::mod_revision(marker.key.clone(), CompareOp::Equal, marker.mod_revision);
        let t = self
            .shared
            .client
            .txn(
                &[same, settings_as_read],
                &[TxnOp::delete(marker.key.clone())],
                &[],
            )
            .map_err(unavailable)?;
        if !t.succeeded {
            return Err(ClaimError::Unavailable {
                store: "etcd".to_string(),
                reason: format!(
                    "the claim index marker or the settings of node {node} changed while they were checked"
                ),
            });
        }
        log::warn!(
            "cluster: an older claimd without the claim index ran as node {node} since its claims were indexed: the index is read again in full by the next reconciliation"
        );
        Ok(())
    }

    /// The claims at the keys of `pairs` (volume, alloc), read in `Txn`s of
    /// [`GETS_PER_TXN`]; an absent one is missing from the map.
    pub(crate) fn get_claims<'a>(
        &self,
        pairs: impl IntoIterator<Item = &'a (String, String)>,
    ) -> Result<HashMap<(String, String), KeyValue>, ClaimError> {
        let pairs: Vec<&(String, String)> = pairs.into_iter().collect();
        let mut out = HashMap::new();
        for chunk in pairs.chunks(GETS_PER_TXN) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(v, a)| TxnOp::get(self.key(v, a)))
                .collect();
            let t = self
                .shared
                .client
                .txn(&[], &ops, &[])
                .map_err(unavailable)?;
            if t.responses.len() != chunk.len() {
                return Err(ClaimError::Unavailable {
                    store: "etcd".to_string(),
                    reason: format!(
                        "a read of {} claims answered {} ranges",
                        chunk.len(),
                        t.responses.len()
                    ),
                });
            }
            for (pair, r) in chunk.iter().zip(t.responses) {
                if let TxnOpResponse::Range(RangeResponse { kvs, .. }) = r {
                    if let Some(kv) = kvs.into_iter().next() {
                        out.insert((*pair).clone(), kv);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Deletes index entries whose claim no longer names the entry's node
    /// (deleted by a claimd without the index), each under compares that
    /// the entry and the claim are as read; best effort.
    pub(crate) fn drop_stale_entries(
        &self,
        node: &str,
        entries: &[((String, String), KeyValue)],
        claims: &HashMap<(String, String), KeyValue>,
    ) {
        for ((v, a), entry) in entries {
            let claim = claims.get(&(v.clone(), a.clone()));
            let names_node = claim
                .and_then(|kv| parse(kv).ok())
                .map_or(true, |s| s.claim.node == node);
            if claim.is_some() && names_node {
                continue;
            }
            let claim_key = self.key(v, a);
            let claim_as_read = match claim {
                Some(kv) => Compare::mod_revision(claim_key, CompareOp::Equal, kv.mod_revision),
                None => Compare::absent(claim_key),
            };
            let same =
                Compare::mod_revision(entry.key.clone(), CompareOp::Equal, entry.mod_revision);
            match self.shared.client.txn(
                &[same, claim_as_read],
                &[TxnOp::delete(entry.key.clone())],
                &[],
            ) {
                Ok(t) if t.succeeded => log::info!(
                    "cluster: dropped the stale claim index entry {} (its claim is gone or held by another node)",
                    entry.key_str()
                ),
                Ok(_) => {}
                Err(e) => log::info!(
                    "cluster: stale claim index entry {} not dropped now: {e}",
                    entry.key_str()
                ),
            }
        }
    }

    /// Indexes `node`'s claims found by a read of every claim (taken by a
    /// claimd without the index, or before it), each under a compare that
    /// it is still the same claim (its create revision), then writes the
    /// marker. An error leaves the marker unwritten: the next
    /// reconciliation reads every claim again.
    pub(crate) fn index_older_claims(
        &self,
        node: &str,
        claims: &[(KeyValue, StoredClaim)],
        indexed: &HashSet<(String, String)>,
    ) -> Result<usize, ClaimError> {
        let mut added = 0;
        for (kv, stored) in claims {
            let pair = (
                stored.claim.volume_id.clone(),
                stored.claim.alloc_id.clone(),
            );
            if indexed.contains(&pair) {
                continue;
            }
            let same =
                Compare::create_revision(kv.key.clone(), CompareOp::Equal, kv.create_revision);
            let entry = self.index_key(node, &pair.0, &pair.1);
            let t = self
                .shared
                .client
                .txn(&[same], &[TxnOp::put(entry, "")], &[])
                .map_err(unavailable)?;
            // A claim freed meanwhile (with its entry, if any) needs none.
            if t.succeeded {
                added += 1;
            }
        }
        let marker = serde_json::json!({
            "instance": self.instance(), "at_ms": now_ms(),
        });
        self.shared
            .client
            .put(self.index_marker(node), marker.to_string())
            .map_err(unavailable)?;
        Ok(added)
    }

    /// `node`'s claims: through its index when it is trusted (its marker
    /// is there and its settings say its agent keeps it; the entries'
    /// claims read by key, stale entries dropped on the way), else by
    /// reading every claim. A value under `claims/` that is not a
    /// claim is left out (and reported where claims are listed).
    pub fn claims_of_node(&self, node: &str) -> Result<NodeClaims, ClaimError> {
        let index = self.read_index(node)?;
        if !index.trusted {
            let r = self
                .shared
                .client
                .range_prefix(self.all_prefix())
                .map_err(unavailable)?;
            let claims = r
                .kvs
                .into_iter()
                .filter_map(|kv| {
                    let s = parse(&kv).ok()?;
                    (s.claim.node == node).then_some((kv, s))
                })
                .collect();
            return Ok(NodeClaims {
                indexed: false,
                revision: r.revision,
                claims,
            });
        }
        let read = self.get_claims(index.entries.iter().map(|(p, _)| p))?;
        self.drop_stale_entries(node, &index.entries, &read);
        let mut claims: Vec<(KeyValue, StoredClaim)> = index
            .entries
            .iter()
            .filter_map(|(p, _)| {
                let kv = read.get(p)?;
                let s = parse(kv).ok()?;
                (s.claim.node == node).then(|| (kv.clone(), s))
            })
            .collect();
        claims.sort_by(|a, b| a.0.key.cmp(&b.0.key));
        Ok(NodeClaims {
            indexed: true,
            revision: index.revision,
            claims,
        })
    }
}
