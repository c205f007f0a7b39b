//! Transactions: compares (`Compare`), operations (`TxnOp`) and the
//! answer (`TxnResponse`), as plain Rust values.
//!
//! A compare may cover a key range (`[key, range_end)`): it holds when it
//! holds for every key in the range, and a range without keys compares as
//! one absent key (version, create and mod revision 0). So
//! `Compare::range_empty` is "no key in this range", whatever the timing.

use protobuf::EnumOrUnknown;

use super::kv::{prefix_end, DeleteResponse, LeaseId, PutResponse, RangeResponse};
use crate::generated::etcd as pb;

/// How the key's field compares with the given value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareOp {
    Equal,
    NotEqual,
    Greater,
    Less,
}

/// The field a compare looks at, with the value it is compared with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompareTarget {
    /// Changes since creation; 0 for an absent key.
    Version(i64),
    /// Revision of the creation; 0 for an absent key.
    CreateRevision(i64),
    /// Revision of the last change; 0 for an absent key.
    ModRevision(i64),
    /// The value. A compare on the value of an absent key always fails.
    Value(Vec<u8>),
}

/// One condition of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    pub key: Vec<u8>,
    /// Empty: `key` alone. Otherwise the compare covers `[key, range_end)`.
    pub range_end: Vec<u8>,
    pub op: CompareOp,
    pub target: CompareTarget,
}

impl Compare {
    pub fn new(key: impl Into<Vec<u8>>, op: CompareOp, target: CompareTarget) -> Compare {
        Compare {
            key: key.into(),
            range_end: Vec::new(),
            op,
            target,
        }
    }

    pub fn version(key: impl Into<Vec<u8>>, op: CompareOp, version: i64) -> Compare {
        Compare::new(key, op, CompareTarget::Version(version))
    }

    pub fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Compare {
        Compare::new(key, op, CompareTarget::CreateRevision(revision))
    }

    pub fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Compare {
        Compare::new(key, op, CompareTarget::ModRevision(revision))
    }

    pub fn value(key: impl Into<Vec<u8>>, op: CompareOp, value: impl Into<Vec<u8>>) -> Compare {
        Compare::new(key, op, CompareTarget::Value(value.into()))
    }

    /// The key does not exist (create_revision == 0).
    pub fn absent(key: impl Into<Vec<u8>>) -> Compare {
        Compare::create_revision(key, CompareOp::Equal, 0)
    }

    /// No key lies in `[key, range_end)`.
    pub fn range_empty(key: impl Into<Vec<u8>>, range_end: impl Into<Vec<u8>>) -> Compare {
        Compare::absent(key).with_range_end(range_end)
    }

    /// No key starts with `prefix`.
    pub fn prefix_empty(prefix: impl Into<Vec<u8>>) -> Compare {
        Compare::absent(prefix).with_prefix()
    }

    /// Makes the compare cover `[key, range_end)`.
    pub fn with_range_end(mut self, range_end: impl Into<Vec<u8>>) -> Compare {
        self.range_end = range_end.into();
        self
    }

    /// Makes the compare cover every key that starts with `key`.
    pub fn with_prefix(mut self) -> Compare {
        self.range_end = prefix_end(&self.key);
        self
    }

    pub(crate) fn to_pb(&self) -> pb::Compare {
        use pb::compare::{CompareResult, CompareTarget as T};
        let mut c = pb::Compare::new();
        c.key.clone_from(&self.key);
        c.range_end.clone_from(&self.range_end);
        c.result = EnumOrUnknown::new(match self.op {
            CompareOp::Equal => CompareResult::EQUAL,
            CompareOp::NotEqual => CompareResult::NOT_EQUAL,
            CompareOp::Greater => CompareResult::GREATER,
            CompareOp::Less => CompareResult::LESS,
        });
        let target = match &self.target {
            CompareTarget::Version(v) => {
                c.set_version(*v);
                T::VERSION
            }
            CompareTarget::CreateRevision(r) => {
                c.set_create_revision(*r);
                T::CREATE
            }
            CompareTarget::ModRevision(r) => {
                c.set_mod_revision(*r);
                T::MOD
            }
            CompareTarget::Value(v) => {
                c.set_value(v.clone());
                T::VALUE
            }
        };
        c.target = EnumOrUnknown::new(target);
        c
    }
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Reads `[key, range_end)` (`key` alone when `range_end` is empty).
    Range { key: Vec<u8>, range_end: Vec<u8> },
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    /// Deletes `[key, range_end)` (`key` alone when `range_end` is empty).
    Delete { key: Vec<u8>, range_end: Vec<u8> },
    /// Writes `key` again with its value and lease unchanged (etcd's
    /// `ignore_value` and `ignore_lease`): only its mod revision moves. The
    /// key must exist (guard it with a compare), or the `Txn` fails.
    Touch { key: Vec<u8> },
}

impl TxnOp {
    pub fn get(key: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Range {
            key: key.into(),
            range_end: Vec::new(),
        }
    }

    pub fn get_prefix(prefix: impl Into<Vec<u8>>) -> TxnOp {
        let key = prefix.into();
        let range_end = prefix_end(&key);
        TxnOp::Range { key, range_end }
    }

    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    pub fn put_with_lease(
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> TxnOp {
        TxnOp::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    pub fn touch(key: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Touch { key: key.into() }
    }

    pub fn delete(key: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Delete {
            key: key.into(),
            range_end: Vec::new(),
        }
    }

    pub fn delete_prefix(prefix: impl Into<Vec<u8>>) -> TxnOp {
        let key = prefix.into();
        let range_end = prefix_end(&key);
        TxnOp::Delete { key, range_end }
    }

    pub(crate) fn to_pb(&self) -> pb::RequestOp {
        let mut op = pb::RequestOp::new();
        match self {
            TxnOp::Range { key, range_end } => {
                op.set_request_range(range_request(key, range_end));
            }
            TxnOp::Put { key, value, lease } => {
                op.set_request_put(put_request(key, value, *lease));
            }
            TxnOp::Delete { key, range_end } => {
                op.set_request_delete_range(delete_request(key, range_end));
            }
            TxnOp::Touch { key } => {
                let mut r = put_request(key, &[], None);
                r.ignore_value = true;
                r.ignore_lease = true;
                op.set_request_put(r);
            }
        }
        op
    }
}

pub(crate) fn range_request(key: &[u8], range_end: &[u8]) -> pb::RangeRequest {
    let mut r = pb::RangeRequest::new();
    r.key = key.to_vec();
    r.range_end = range_end.to_vec();
    r
}

pub(crate) fn put_request(key: &[u8], value: &[u8], lease: Option<LeaseId>) -> pb::PutRequest {
    let mut r = pb::PutRequest::new();
    r.key = key.to_vec();
    r.value = value.to_vec();
    r.lease = lease.map_or(0, |l| l.0);
    r
}

pub(crate) fn delete_request(key: &[u8], range_end: &[u8]) -> pb::DeleteRangeRequest {
    let mut r = pb::DeleteRangeRequest::new();
    r.key = key.to_vec();
    r.range_end = range_end.to_vec();
    r
}

/// The answer of one operation of the branch that ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOpResponse {
    Range(RangeResponse),
    Put(PutResponse),
    Delete(DeleteResponse),
}

/// The answer of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// Every compare held and the success branch ran; false: the failure
    /// branch ran (a failed compare is an answer, not an error).
    pub succeeded: bool,
    /// The store's revision after the transaction (unchanged when the
    /// branch that ran only read).
    pub revision: i64,
    /// One per operation of the branch that ran, in order.
    pub responses: Vec<TxnOpResponse>,
}

impl TxnResponse {
    pub(crate) fn from_pb(r: pb::TxnResponse) -> TxnResponse {
        let revision = r.header.revision;
        let responses = r
            .responses
            .into_iter()
            .filter_map(|mut op| {
                if op.has_response_range() {
                    Some(TxnOpResponse::Range(RangeResponse::from_pb(
                        op.take_response_range(),
                    )))
                } else if op.has_response_put() {
                    Some(TxnOpResponse::Put(PutResponse {
                        revision: op.response_put().header.revision,
                    }))
                } else if op.has_response_delete_range() {
                    let d = op.take_response_delete_range();
                    Some(TxnOpResponse::Delete(DeleteResponse {
                        revision: d.header.revision,
                        deleted: d.deleted,
                    }))
                } else {
                    None
                }
            })
            .collect();
        TxnResponse {
            succeeded: r.succeeded,
            revision,
            responses,
        }
    }

    /// The first Range answer of the branch that ran: handy for the
    /// "read what is there when the compare failed" pattern.
    pub fn first_range(&self) -> Option<&RangeResponse> {
        self.responses.iter().find_map(|r| match r {
            TxnOpResponse::Range(r) => Some(r),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_to_wire() {
        let c = Compare::prefix_empty("/claimd/claims/db/").to_pb();
        assert_eq!(c.key, b"/claimd/claims/db/");
        assert_eq!(c.range_end, b"/claimd/claims/db0");
        assert_eq!(
            c.target.enum_value(),
            Ok(pb::compare::CompareTarget::CREATE)
        );
        assert_eq!(c.create_revision(), 0);
        assert!(c.has_create_revision());
        let c = Compare::value("k", CompareOp::NotEqual, "v").to_pb();
        assert_eq!(c.value(), b"v");
        assert_eq!(
            c.result.enum_value(),
            Ok(pb::compare::CompareResult::NOT_EQUAL)
        );
        assert!(c.range_end.is_empty());
    }

    #[test]
    fn ops_to_wire() {
        let op = TxnOp::put_with_lease("k", "v", LeaseId(7)).to_pb();
        assert!(op.has_request_put());
        assert_eq!(op.request_put().lease, 7);
        let op = TxnOp::delete_prefix("a/").to_pb();
        assert_eq!(op.request_delete_range().range_end, b"a0");
    }
}
