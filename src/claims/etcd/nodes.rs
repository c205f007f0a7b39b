//! Forgetting a node that is gone for good (`claimd node remove`): its
//! settings stop the reaper from looking at it, so they go only once
//! nothing of the node is left to act on.

use super::*;
use crate::claims::remote::RemoveNodeError;
use crate::etcd::{CompareOp, TxnOpResponse};

impl EtcdClaims {
    /// Deletes `node-settings/<node>`, `reaper-locks/<node>`, the node's
    /// claim index marker and any stale entries of its index in one `Txn`
    /// that holds only while the node's liveness key is absent and none of
    /// its claims changed since the read that found none (the node's index
    /// compared, or every claim for a node without one); the keys deleted
    /// (relative to the prefix).
    pub fn remove_node(&self, node: &str) -> Result<Vec<String>, RemoveNodeError> {
        let store = |e| RemoveNodeError::Store(unavailable(e));
        let liveness = self.shared.keys.node(node);
        let alive = || RemoveNodeError::Alive {
            node: node.to_string(),
        };
        if self.shared.client.get(&liveness).map_err(store)?.is_some() {
            return Err(alive());
        }
        let held = self.claims_of_node(node).map_err(RemoveNodeError::Store)?;
        let volumes = held.volumes();
        if !volumes.is_empty() {
            return Err(RemoveNodeError::HoldsClaims {
                node: node.to_string(),
                volumes,
            });
        }
        let keys = [
            self.shared.keys.settings(node),
            self.shared.keys.reaper_lock(node),
            self.shared.keys.claim_index(node),
        ];
        // A claim taken since the read has an index entry newer than it
        // (or, without the index, is a claim newer than it).
        let watched = if held.indexed {
            self.index_prefix(node)
        } else {
            self.all_prefix()
        };
        let unchanged =
            Compare::mod_revision(watched.into_bytes(), CompareOp::Less, held.revision + 1)
                .with_prefix();
        let mut deletes: Vec<TxnOp> = keys.iter().map(|k| TxnOp::delete(k.clone())).collect();
        deletes.push(TxnOp::delete_prefix(self.index_prefix(node)));
        let t = self
            .shared
            .client
            .txn(
                &[Compare::absent(liveness.clone()), unchanged],
                &deletes,
                &[TxnOp::get(liveness)],
            )
            .map_err(store)?;
        if !t.succeeded {
            let now_alive = matches!(
                t.responses.first(),
                Some(TxnOpResponse::Range(r)) if !r.kvs.is_empty()
            );
            return Err(if now_alive {
                alive()
            } else {
                RemoveNodeError::Store(ClaimError::Unavailable {
                    store: "etcd".to_string(),
                    reason: "the claims changed while the node was being removed: try again"
                        .to_string(),
                })
            });
        }
        let removed: Vec<String> = keys
            .iter()
            .zip(&t.responses)
            .filter(|(_, r)| matches!(r, TxnOpResponse::Delete(d) if d.deleted > 0))
            .map(|(k, _)| {
                k.strip_prefix(self.shared.keys.prefix())
                    .map_or(k.as_str(), |r| r.trim_start_matches('/'))
                    .to_string()
            })
            .collect();
        if removed.is_empty() {
            return Err(RemoveNodeError::Unknown {
                node: node.to_string(),
            });
        }
        log::warn!("cluster: node {node} removed: {}", removed.join(", "));
        Ok(removed)
    }
}
