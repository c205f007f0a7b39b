//! Claims: which allocation may use which volume, and how. The store is a
//! trait; the embedded implementation keeps claims in the state file (one
//! node). A store that spans nodes belongs on an existing distributed
//! store and plugs in behind the same trait.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::state::{StateError, StateFile, StateStore};
use crate::volumes::AccessMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimMode {
    Read,
    Write,
}

impl ClaimMode {
    pub fn name(self) -> &'static str {
        match self {
            ClaimMode::Read => "read",
            ClaimMode::Write => "write",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimState {
    /// Held: the allocation may use the volume.
    Taken,
    /// The allocation is releasing the volume; still held until freed.
    Releasing,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    pub volume_id: String,
    pub alloc_id: String,
    pub node: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_node_id: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub publish_context: BTreeMap<String, String>,
    pub state: ClaimState,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRequest {
    pub volume_id: String,
    pub alloc_id: String,
    pub node: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
}

#[derive(Debug)]
pub enum ClaimError {
    /// Another allocation holds a claim that conflicts; it may let go soon.
    HeldByOther {
        volume_id: String,
        holder: String,
        holder_mode: ClaimMode,
        holder_node: String,
    },
    /// The claim can never be granted as asked.
    Impossible {
        volume_id: String,
        reason: String,
    },
    UnknownVolume {
        volume_id: String,
    },
    Store(StateError),
}

impl ClaimError {
    /// Only "held by another allocation" is worth retrying.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ClaimError::HeldByOther { .. })
    }
}

impl fmt::Display for ClaimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClaimError::HeldByOther {
                volume_id,
                holder,
                holder_mode,
                holder_node,
            } => {
                let how = match holder_mode {
                    ClaimMode::Write => "for writing",
                    ClaimMode::Read => "for reading",
                };
                write!(
                    f,
                    "volume {volume_id} is claimed {how} by allocation {holder} on node {holder_node}"
                )
            }
            ClaimError::Impossible { volume_id, reason } => {
                write!(f, "volume {volume_id} cannot be claimed: {reason}")
            }
            ClaimError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            ClaimError::Store(_) => write!(f, "the claim could not be recorded"),
        }
    }
}

impl std::error::Error for ClaimError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClaimError::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for ClaimError {
    fn from(e: StateError) -> Self {
        ClaimError::Store(e)
    }
}

/// Where claims are kept.
pub trait ClaimStore: Send + Sync {
    /// Takes the claim, or confirms it when this allocation already holds
    /// it. Idempotent.
    fn claim(&self, req: &ClaimRequest) -> Result<Claim, ClaimError>;
    /// Records the external node ID and publish context of the attachment.
    fn record_attachment(
        &self,
        volume_id: &str,
        alloc_id: &str,
        external_node_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<(), ClaimError>;
    /// Marks the claim as being released (still held).
    fn mark_releasing(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError>;
    /// Frees the claim. Freeing a claim that is not held succeeds.
    fn release(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError>;
    fn list(&self) -> Vec<Claim>;
    /// True for a store kept in claimd's own state file (the embedded
    /// one): the lifecycle then changes claims with the `*_in_state`
    /// functions inside the state write of the step they belong to, one
    /// atomic rewrite instead of two. Other stores are called on their own.
    fn in_state_file(&self) -> bool {
        false
    }
}

/// The access-mode rules of the CSI spec, checked against the claims other
/// allocations hold on the same volume.
pub fn check_claim(req: &ClaimRequest, others: &[&Claim]) -> Result<(), ClaimError> {
    let mode = req.access_mode;
    if req.mode == ClaimMode::Write && mode.reader_only() {
        return Err(ClaimError::Impossible {
            volume_id: req.volume_id.clone(),
            reason: format!("access mode {mode} admits no writer"),
        });
    }
    for c in others {
        let held = || ClaimError::HeldByOther {
            volume_id: req.volume_id.clone(),
            holder: c.alloc_id.clone(),
            holder_mode: c.mode,
            holder_node: c.node.clone(),
        };
        // Single-node modes keep every claim on one node (judged by the
        // stricter of the two claims' modes).
        if (mode.single_node() || c.access_mode.single_node()) && c.node != req.node {
            return Err(held());
        }
        // Single-writer modes admit one writer.
        if req.mode == ClaimMode::Write
            && c.mode == ClaimMode::Write
            && (mode.single_writer() || c.access_mode.single_writer())
        {
            return Err(held());
        }
        // A writer is not admitted beside a reader-only claim's readers, nor
        // a reader-only claim beside a writer.
        if (req.mode == ClaimMode::Write && c.access_mode.reader_only())
            || (c.mode == ClaimMode::Write && mode.reader_only())
        {
            return Err(held());
        }
    }
    Ok(())
}

/// Claims kept in the state file.
pub struct EmbeddedClaims {
    store: Arc<StateStore>,
}

impl EmbeddedClaims {
    pub fn new(store: Arc<StateStore>) -> EmbeddedClaims {
        EmbeddedClaims { store }
    }
}

pub fn claim_in_state(s: &mut StateFile, req: &ClaimRequest) -> Result<Claim, ClaimError> {
    if !s.volumes.contains_key(&req.volume_id) {
        return Err(ClaimError::UnknownVolume {
            volume_id: req.volume_id.clone(),
        });
    }
    if let Some(c) = s.claim(&req.volume_id, &req.alloc_id) {
        if c.mode == req.mode && c.access_mode == req.access_mode && c.node == req.node {
            return Ok(c.clone());
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
        external_node_id: None,
        publish_context: BTreeMap::new(),
        state: ClaimState::Taken,
    };
    s.claims.insert(
        (req.volume_id.clone(), req.alloc_id.clone()),
        Arc::new(claim.clone()),
    );
    Ok(claim)
}

pub fn record_attachment_in_state(
    s: &mut StateFile,
    volume_id: &str,
    alloc_id: &str,
    external_node_id: &str,
    publish_context: &BTreeMap<String, String>,
) {
    if let Some(c) = s.claim_mut(volume_id, alloc_id) {
        c.external_node_id = Some(external_node_id.to_string());
        c.publish_context = publish_context.clone();
    }
}

pub fn mark_releasing_in_state(s: &mut StateFile, volume_id: &str, alloc_id: &str) {
    if let Some(c) = s.claim_mut(volume_id, alloc_id) {
        c.state = ClaimState::Releasing;
    }
}

pub fn release_in_state(s: &mut StateFile, volume_id: &str, alloc_id: &str) {
    s.claims
        .remove(&(volume_id.to_string(), alloc_id.to_string()));
}

impl ClaimStore for EmbeddedClaims {
    fn claim(&self, req: &ClaimRequest) -> Result<Claim, ClaimError> {
        self.store.update(|s| claim_in_state(s, req))
    }

    fn record_attachment(
        &self,
        volume_id: &str,
        alloc_id: &str,
        external_node_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<(), ClaimError> {
        self.store.update(|s| {
            record_attachment_in_state(s, volume_id, alloc_id, external_node_id, publish_context);
            Ok(())
        })
    }

    fn mark_releasing(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        self.store.update(|s| {
            mark_releasing_in_state(s, volume_id, alloc_id);
            Ok(())
        })
    }

    fn release(&self, volume_id: &str, alloc_id: &str) -> Result<(), ClaimError> {
        self.store.update(|s| {
            release_in_state(s, volume_id, alloc_id);
            Ok(())
        })
    }

    fn list(&self) -> Vec<Claim> {
        self.store
            .read(|s| s.claims.values().map(|c| (**c).clone()).collect())
    }

    fn in_state_file(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(alloc: &str, node: &str, mode: ClaimMode, am: AccessMode) -> Claim {
        Claim {
            volume_id: "v".into(),
            alloc_id: alloc.into(),
            node: node.into(),
            mode,
            access_mode: am,
            external_node_id: None,
            publish_context: BTreeMap::new(),
            state: ClaimState::Taken,
        }
    }

    fn req(alloc: &str, node: &str, mode: ClaimMode, am: AccessMode) -> ClaimRequest {
        ClaimRequest {
            volume_id: "v".into(),
            alloc_id: alloc.into(),
            node: node.into(),
            mode,
            access_mode: am,
        }
    }

    use AccessMode::*;
    use ClaimMode::*;

    #[test]
    fn single_writer_modes_admit_one_writer() {
        for am in [
            SingleNodeWriter,
            MultiNodeSingleWriter,
            SingleNodeSingleWriter,
        ] {
            let held = claim("a", "n1", Write, am);
            let e = check_claim(&req("b", "n1", Write, am), &[&held]).expect_err("2nd writer");
            assert!(e.is_retryable());
            assert!(
                e.to_string()
                    .contains("claimed for writing by allocation a"),
                "{e}"
            );
            // A reader beside the writer on the same node is fine.
            assert!(check_claim(&req("b", "n1", Read, am), &[&held]).is_ok());
        }
    }

    #[test]
    fn multi_writer_admits_many_writers() {
        for am in [MultiNodeMultiWriter, SingleNodeMultiWriter] {
            let held = claim("a", "n1", Write, am);
            assert!(check_claim(&req("b", "n1", Write, am), &[&held]).is_ok());
        }
        let held = claim("a", "n1", Write, MultiNodeMultiWriter);
        assert!(check_claim(&req("b", "n2", Write, MultiNodeMultiWriter), &[&held]).is_ok());
    }

    #[test]
    fn single_node_modes_keep_claims_on_one_node() {
        for am in [
            SingleNodeWriter,
            SingleNodeReaderOnly,
            SingleNodeSingleWriter,
            SingleNodeMultiWriter,
        ] {
            let held = claim("a", "n1", Read, am);
            let e = check_claim(&req("b", "n2", Read, am), &[&held]).expect_err("other node");
            assert!(e.is_retryable(), "{am}");
            assert!(
                check_claim(&req("b", "n1", Read, am), &[&held]).is_ok(),
                "{am}"
            );
        }
        let held = claim("a", "n1", Read, MultiNodeReaderOnly);
        assert!(check_claim(&req("b", "n2", Read, MultiNodeReaderOnly), &[&held]).is_ok());
    }

    #[test]
    fn reader_only_modes_admit_no_writer() {
        for am in [SingleNodeReaderOnly, MultiNodeReaderOnly] {
            let e = check_claim(&req("a", "n1", Write, am), &[]).expect_err("writer");
            assert!(!e.is_retryable(), "{am}: {e}");
            assert!(e.to_string().contains("admits no writer"), "{e}");
        }
    }

    #[test]
    fn embedded_store_is_idempotent_and_names_holder() {
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
        let r = req("a", "n1", Write, SingleNodeWriter);
        claims.claim(&r).expect("first");
        claims.claim(&r).expect("again: idempotent");
        assert_eq!(claims.list().len(), 1);
        let e = claims
            .claim(&req("b", "n1", Write, SingleNodeWriter))
            .expect_err("held");
        assert!(e.is_retryable());
        let mut unknown = r.clone();
        unknown.volume_id = "nope".into();
        assert!(matches!(
            claims.claim(&unknown),
            Err(ClaimError::UnknownVolume { .. })
        ));
        claims.release("v", "a").expect("release");
        claims.release("v", "a").expect("release again");
        claims
            .claim(&req("b", "n1", Write, SingleNodeWriter))
            .expect("free now");
        assert_eq!(claims.list()[0].alloc_id, "b");
    }
}
