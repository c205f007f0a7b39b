//! The access-mode rules of the CSI spec, checked against the claims other
//! allocations hold on the same volume.

use super::{ClaimError, ClaimRequest};
use crate::state::{Claim, ClaimMode};

/// Whether `req` may be granted beside `others` (the claims of other
/// allocations on the same volume).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ClaimState;
    use crate::volumes::AccessMode;
    use std::collections::BTreeMap;

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
            since_ms: None,
            last_error: None,
        }
    }

    fn req(alloc: &str, node: &str, mode: ClaimMode, am: AccessMode) -> ClaimRequest {
        ClaimRequest {
            storage: None,
            volume_id: "v".into(),
            alloc_id: alloc.into(),
            node: node.into(),
            mode,
            access_mode: am,
            external_node_id: None,
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
}
