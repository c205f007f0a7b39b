//! Key-value records and the answers of Range, Put and DeleteRange, as
//! plain Rust values (callers never see generated code), plus key-range
//! helpers.

use std::fmt;

use crate::generated::etcd as pb;
use crate::generated::etcd_kv as mvccpb;

/// An etcd lease ID. Shown in hex, as etcdctl shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One key with its value and revisions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// Revision of the key's creation.
    pub create_revision: i64,
    /// Revision of the key's last change.
    pub mod_revision: i64,
    /// Changes since creation (1 for a new key).
    pub version: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

impl KeyValue {
    /// The key as text (keys claimd writes are UTF-8; others are shown lossily).
    pub fn key_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.key)
    }

    pub(crate) fn from_pb(kv: mvccpb::KeyValue) -> KeyValue {
        KeyValue {
            key: kv.key,
            value: kv.value,
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: (kv.lease != 0).then_some(LeaseId(kv.lease)),
        }
    }
}

/// What Range found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeResponse {
    /// The store's revision the read was served at: watch from
    /// `revision + 1` to see every later change.
    pub revision: i64,
    pub kvs: Vec<KeyValue>,
    /// Keys in the range (not limited).
    pub count: i64,
}

impl RangeResponse {
    pub(crate) fn from_pb(r: pb::RangeResponse) -> RangeResponse {
        RangeResponse {
            revision: r.header.revision,
            count: r.count,
            kvs: r.kvs.into_iter().map(KeyValue::from_pb).collect(),
        }
    }
}

/// What Put did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutResponse {
    /// The revision of this change.
    pub revision: i64,
}

/// What DeleteRange did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteResponse {
    /// The store's revision after the delete.
    pub revision: i64,
    /// How many keys were deleted.
    pub deleted: i64,
}

/// The end of the range of every key that starts with `prefix`: the
/// prefix with its last byte below 0xff incremented and what follows it
/// dropped; `"\0"` (every key) when there is no such byte.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_that_can_be() {
        assert_eq!(prefix_end(b"/claimd/"), b"/claimd0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn lease_ids_print_in_hex() {
        assert_eq!(LeaseId(0x694d7a1b2c3d4e5f).to_string(), "694d7a1b2c3d4e5f");
    }
}
