//! The embedded claim store: claims live in claimd's own state, and a
//! claim change is folded into the same journal line as the lifecycle
//! record change it belongs to (one fdatasync for both).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{
    check_claim, Applied, ClaimChange, ClaimError, ClaimFilter, ClaimRequest, ClaimStore, Listing,
    Transaction,
};
use crate::state::{Claim, ClaimState, StateError, StateFile, StateStore};

/// Claims kept in the state (one node).
pub struct EmbeddedClaims {
    state: Arc<StateStore>,
}

impl EmbeddedClaims {
    pub fn new(state: Arc<StateStore>) -> EmbeddedClaims {
        EmbeddedClaims { state }
    }
}

impl ClaimStore for EmbeddedClaims {
    fn transact(&self, txn: Transaction<'_>) -> Result<Applied, StateError> {
        let Transaction {
            changes,
            wanted,
            record,
            closing,
        } = txn;
        let f = |s: &mut StateFile| -> Result<Applied, StateError> {
            if !wanted(s) {
                return Ok(Applied::NotWanted);
            }
            let outcomes: Vec<_> = changes.iter().map(|c| apply(s, c)).collect();
            record(s, &outcomes);
            Ok(Applied::Done(outcomes))
        };
        // The claims live in the same state: a closing free is durable with
        // the record's drop, after the next write or a flush.
        if closing {
            self.state.update_closing(f)
        } else {
            self.state.update(f)
        }
    }

    fn list_claims(&self, filter: ClaimFilter<'_>) -> Result<Listing, ClaimError> {
        let claims = self.state.read(|s| {
            s.claims
                .values()
                .filter(|c| filter.admits(c))
                .map(|c| (**c).clone())
                .collect()
        });
        Ok(Listing {
            claims,
            problems: Vec::new(),
        })
    }

    fn local_claim_states(&self) -> Option<Vec<ClaimState>> {
        Some(
            self.state
                .read(|s| s.claims.values().map(|c| c.state).collect()),
        )
    }
}

impl EmbeddedClaims {
    /// Every claim in the state.
    #[cfg(test)]
    fn all(&self) -> Vec<Claim> {
        self.state
            .read(|s| s.claims.values().map(|c| (**c).clone()).collect())
    }
}

/// Applies one change to the claims of a state.
fn apply(s: &mut StateFile, change: &ClaimChange) -> Result<(), ClaimError> {
    match change {
        ClaimChange::Take(req) => take(s, req),
        ClaimChange::Attach {
            volume_id,
            alloc_id,
            external_node_id,
            publish_context,
        } => {
            if let Some(c) = s.claim_mut(volume_id, alloc_id) {
                c.external_node_id = Some(external_node_id.clone());
                c.publish_context = publish_context.clone();
            }
            Ok(())
        }
        ClaimChange::MarkReleasing {
            volume_id,
            alloc_id,
        } => {
            if let Some(c) = s.claim_mut(volume_id, alloc_id) {
                c.state = ClaimState::Releasing;
            }
            Ok(())
        }
        ClaimChange::MarkNodeDetached {
            volume_id,
            alloc_id,
            error,
        } => {
            if let Some(c) = s.claim_mut(volume_id, alloc_id) {
                c.state = ClaimState::NodeDetached;
                c.last_error = Some(error.clone());
            }
            Ok(())
        }
        ClaimChange::Free {
            volume_id,
            alloc_id,
            ..
        } => {
            s.claims.remove(&(volume_id.clone(), alloc_id.clone()));
            Ok(())
        }
    }
}

fn take(s: &mut StateFile, req: &ClaimRequest) -> Result<(), ClaimError> {
    if !s.volumes.contains_key(&req.volume_id) {
        return Err(ClaimError::UnknownVolume {
            volume_id: req.volume_id.clone(),
        });
    }
    if let Some(c) = s.claim(&req.volume_id, &req.alloc_id) {
        if c.mode == req.mode && c.access_mode == req.access_mode && c.node == req.node {
            return Ok(());
        }
        return Err(ClaimError::Impossible {
            volume_id: req.volume_id.clone(),
            reason: format!(
                "allocation {} already holds it with another mode ({} {})",
                req.alloc_id,
                c.mode.name(),
                c.access_mode
            ),
        });
    }
    let others: Vec<&Claim> = s.claims_on(&req.volume_id).collect();
    check_claim(req, &others)?;
    let claim = Claim {
        volume_id: req.volume_id.clone(),
        alloc_id: req.alloc_id.clone(),
        node: req.node.clone(),
        mode: req.mode,
        access_mode: req.access_mode,
        external_node_id: req.external_node_id.clone(),
        publish_context: BTreeMap::new(),
        state: ClaimState::Taken,
        since_ms: None,
        last_error: None,
    };
    s.claims.insert(
        (req.volume_id.clone(), req.alloc_id.clone()),
        Arc::new(claim),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ClaimMode::*;
    use crate::volumes::AccessMode::*;

    fn req(alloc: &str, node: &str, mode: crate::state::ClaimMode) -> ClaimRequest {
        ClaimRequest {
            volume_id: "v".into(),
            alloc_id: alloc.into(),
            node: node.into(),
            mode,
            access_mode: SingleNodeWriter,
            external_node_id: None,
            storage: None,
        }
    }

    /// One change alone, with a record change that marks the state so the
    /// test sees whether it was written with the claim.
    fn change(claims: &EmbeddedClaims, c: ClaimChange) -> Result<(), ClaimError> {
        let mut record = |s: &mut StateFile, out: &super::super::Outcomes| {
            if out.iter().all(Result::is_ok) {
                s.boot_id = format!("after-{}", c.verb());
            }
        };
        let c2 = c.clone();
        claims
            .transact(Transaction {
                changes: vec![c2],
                wanted: &|_| true,
                record: &mut record,
                closing: false,
            })
            .expect("the state write")
            .single()
            .map(drop)
    }

    #[test]
    fn embedded_store_is_idempotent_names_holder_and_writes_with_the_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
        store
            .update::<_, StateError>(|s| {
                s.volumes.insert(
                    "v".into(),
                    serde_json::from_value(serde_json::json!({
                        "id": "v", "plugin_id": "p", "external_id": "x",
                        "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"]
                    }))
                    .expect("spec"),
                );
                Ok(())
            })
            .expect("register");
        let claims = EmbeddedClaims::new(store.clone());
        let r = req("a", "n1", Write);
        change(&claims, ClaimChange::Take(r.clone())).expect("first");
        assert_eq!(store.read(|s| s.boot_id.clone()), "after-take");
        change(&claims, ClaimChange::Take(r.clone())).expect("again: idempotent");
        assert_eq!(claims.all().len(), 1);
        let of_v = claims.list_claims(ClaimFilter::volume("v")).expect("list");
        assert_eq!(of_v.claims, claims.all());
        assert_eq!(claims.list_claims(ClaimFilter::ALL).expect("list"), of_v);
        let of_w = claims.list_claims(ClaimFilter::volume("w")).expect("list");
        assert_eq!(of_w, Listing::default());
        let e = change(&claims, ClaimChange::Take(req("b", "n1", Write))).expect_err("held");
        assert!(e.is_retryable());
        let mut unknown = r.clone();
        unknown.volume_id = "nope".into();
        assert!(matches!(
            change(&claims, ClaimChange::Take(unknown)),
            Err(ClaimError::UnknownVolume { .. })
        ));
        let free = ClaimChange::Free {
            volume_id: "v".into(),
            alloc_id: "a".into(),
            holder: None,
            while_gone: false,
            by_hand: None,
        };
        change(&claims, free.clone()).expect("free");
        change(&claims, free).expect("free again");
        change(&claims, ClaimChange::Take(req("b", "n1", Write))).expect("free now");
        assert_eq!(claims.all()[0].alloc_id, "b");
        // Not wanted: nothing changes, not even the record.
        let before = store.snapshot();
        let applied = claims
            .transact(Transaction {
                changes: vec![ClaimChange::Free {
                    volume_id: "v".into(),
                    alloc_id: "b".into(),
                    holder: None,
                    while_gone: false,
                    by_hand: None,
                }],
                wanted: &|_| false,
                record: &mut |s, _| s.boot_id = "changed".into(),
                closing: false,
            })
            .expect("write");
        assert!(matches!(applied, Applied::NotWanted));
        assert_eq!(store.snapshot(), before);
    }
}
