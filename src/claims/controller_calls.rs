//! Volume operations forwarded to a controller host (cluster mode): an
//! agent whose own plugin has no controller side writes the CSI request
//! (protobuf bytes, hex) under `<prefix>/controller-calls/<plugin>/<id>`;
//! a host of the plugin (`cluster::controller_host`) performs it with its
//! own plugin and writes the reply (or the gRPC status) back; the requester
//! reads it and deletes the request. The same pattern as attachments, one
//! host per call (a lock on its lease), so CreateVolume, DeleteVolume,
//! the snapshot calls and ControllerExpandVolume work from any node.
//! Requests carry the volume's secrets, like the registrations in etcd.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::etcd::{unavailable, EtcdClaims};
use super::remote::{now_ms, AttachError, AttachState};
use super::ClaimError;
use crate::etcd::{Compare, CompareOp, KeyValue, TxnOp};
use crate::shutdown::Shutdown;

/// The first and the longest pause between two reads of a waiting call.
const POLL_MIN: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(500);

static NEXT_CALL: AtomicU64 = AtomicU64::new(0);

/// `<prefix>/controller-calls/<plugin>/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerCallRecord {
    pub plugin_id: String,
    /// The CSI method as on the wire (`CreateVolume`, …).
    pub method: String,
    /// The request's protobuf bytes, in hex.
    pub request_hex: String,
    pub requested_by: String,
    pub state: AttachState,
    /// The reply's protobuf bytes, in hex (state done).
    #[serde(default)]
    pub response_hex: String,
    #[serde(default)]
    pub error: Option<String>,
    /// The gRPC status code of a failed call.
    #[serde(default)]
    pub code: i32,
    #[serde(default)]
    pub retryable: bool,
    #[serde(default)]
    pub handled_by: Option<String>,
    pub requested_at_ms: u64,
    pub updated_at_ms: u64,
    /// How long the requester waits for the answer (0: not said, from an
    /// older agent). A host never performs a call whose requester has given
    /// up (`requested_at_ms + wait_ms` passed by its own clock), and
    /// removes a finished one that long after it first saw it finished.
    #[serde(default)]
    pub wait_ms: u64,
}

/// The longest a finished call stays in etcd, at the least, after the
/// host first saw it finished (its requester reads and deletes it long
/// before; this removes what a requester that died left behind).
pub const FINISHED_CALL_RETENTION: Duration = Duration::from_secs(10);

impl ControllerCallRecord {
    /// The requester has given up on it, by this machine's wall clock (a
    /// skewed clock only makes a host refuse sooner or keep it longer).
    pub fn expired(&self) -> bool {
        self.wait_ms > 0 && now_ms() > self.requested_at_ms.saturating_add(self.wait_ms)
    }

    /// How long the host keeps it once finished.
    pub fn retention(&self) -> Duration {
        Duration::from_millis(self.wait_ms) + FINISHED_CALL_RETENTION
    }
}

pub fn parse_call(kv: &KeyValue) -> Result<ControllerCallRecord, ClaimError> {
    serde_json::from_slice(&kv.value).map_err(|e| ClaimError::Corrupt {
        key: kv.key_str().into_owned(),
        reason: e.to_string(),
    })
}

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

impl EtcdClaims {
    pub fn controller_calls_prefix(&self) -> String {
        self.keys().controller_calls()
    }

    pub fn controller_call_lock_key(&self, call_key: &str) -> String {
        let id = call_key
            .strip_prefix(&self.controller_calls_prefix())
            .unwrap_or(call_key);
        self.keys().controller_call_lock(id)
    }
}

/// Writes the call, waits for its reply up to `wait`, deletes it.
pub(super) fn forward(
    claims: &EtcdClaims,
    plugin_id: &str,
    method: &str,
    request: &[u8],
    wait: Duration,
    shutdown: &Shutdown,
) -> Result<Vec<u8>, AttachError> {
    let store = |e| AttachError::Store(unavailable(e));
    let node = claims.node_name();
    let key = format!(
        "{}{plugin_id}/{node}-{}-{}",
        claims.controller_calls_prefix(),
        now_ms(),
        NEXT_CALL.fetch_add(1, Ordering::Relaxed)
    );
    let now = now_ms();
    let rec = ControllerCallRecord {
        plugin_id: plugin_id.to_string(),
        method: method.to_string(),
        request_hex: to_hex(request),
        requested_by: node.to_string(),
        state: AttachState::Pending,
        response_hex: String::new(),
        error: None,
        code: 0,
        retryable: false,
        handled_by: None,
        requested_at_ms: now,
        updated_at_ms: now,
        wait_ms: wait.as_millis() as u64,
    };
    let value = serde_json::to_vec(&rec).expect("a call always encodes");
    claims
        .client()
        .txn(
            &[Compare::absent(key.clone())],
            &[TxnOp::put(key.clone(), value)],
            &[],
        )
        .map_err(store)?;
    let started = Instant::now();
    let mut pause = POLL_MIN;
    // What a finished record answers; None while it is pending.
    let finished = |rec: &ControllerCallRecord| -> Option<Result<Vec<u8>, AttachError>> {
        match rec.state {
            AttachState::Done => {
                Some(
                    from_hex(&rec.response_hex).ok_or_else(|| AttachError::Failed {
                        host: rec.handled_by.clone().unwrap_or_default(),
                        error: "the forwarded reply is not hex".to_string(),
                        retryable: false,
                        code: 13,
                    }),
                )
            }
            AttachState::Failed => Some(Err(AttachError::Failed {
                host: rec.handled_by.clone().unwrap_or_default(),
                error: rec.error.clone().unwrap_or_default(),
                retryable: rec.retryable,
                code: rec.code,
            })),
            AttachState::Pending => None,
        }
    };
    let mut seen_revision = 0;
    let answer = loop {
        let kv = claims.client().get(&key).map_err(store)?;
        let Some(kv) = kv else {
            break Err(AttachError::Failed {
                host: String::new(),
                error: format!("the forwarded {method} call was deleted before it was answered"),
                retryable: true,
                code: 0,
            });
        };
        seen_revision = kv.mod_revision;
        let rec = parse_call(&kv).map_err(AttachError::Store)?;
        if let Some(a) = finished(&rec) {
            break a;
        }
        if started.elapsed() >= wait {
            break Err(AttachError::NoAnswer {
                waited: started.elapsed(),
                hosts: format!("of plugin {plugin_id}: see `claimd plugin list`"),
            });
        }
        if !shutdown.sleep(pause.min(wait.saturating_sub(started.elapsed()))) {
            break Err(AttachError::Stopping);
        }
        pause = (pause * 2).min(POLL_MAX);
    };
    if matches!(answer, Err(AttachError::NoAnswer { .. })) {
        // Given up: withdrawn only while it is still as last read (not
        // answered meanwhile) and no host has taken it (its lock is
        // absent); otherwise what happened is said, never hidden.
        let lock = claims.controller_call_lock_key(&key);
        let withdrawn = claims.client().txn(
            &[
                Compare::absent(lock.clone()),
                Compare::mod_revision(key.clone(), CompareOp::Equal, seen_revision),
            ],
            &[TxnOp::delete(key.clone())],
            &[TxnOp::get(lock), TxnOp::get(key.clone())],
        );
        let t = match withdrawn {
            Ok(t) if t.succeeded => return answer,
            Ok(t) => t,
            Err(e) => {
                log::info!("cluster: the forwarded call {key} could not be withdrawn: {e} (a host will not perform it once it expired)");
                return answer;
            }
        };
        let ranges: Vec<_> = t
            .responses
            .iter()
            .filter_map(|r| match r {
                crate::etcd::TxnOpResponse::Range(r) => Some(r),
                _ => None,
            })
            .collect();
        let call_now = ranges.get(1).and_then(|r| r.kvs.first());
        if call_now.is_none() {
            // Withdrawn by a host as expired: not performed.
            return answer;
        }
        if let Some(a) = call_now
            .and_then(|kv| parse_call(kv).ok())
            .and_then(|rec| finished(&rec))
        {
            // Answered right at the deadline: the answer counts.
            if let Err(e) = claims.client().delete_range(&key, "") {
                log::info!("cluster: the forwarded call {key} stays in etcd: {e}");
            }
            return a;
        }
        let host = ranges
            .first()
            .and_then(|r| r.kvs.first())
            .and_then(|kv| serde_json::from_slice::<serde_json::Value>(&kv.value).ok())
            .and_then(|v| v["host"].as_str().map(str::to_string))
            .unwrap_or_default();
        return Err(AttachError::Failed {
            error: format!(
                "no answer within {wait:?}, and controller host {host} is performing the forwarded {method} call: its outcome is not known (it is not undone; look before trying again)"
            ),
            host,
            retryable: false,
            code: 4,
        });
    }
    // Answered: the call is not left behind (a host that died first left
    // it: the next host removes it after its retention).
    if let Err(e) = claims.client().delete_range(&key, "") {
        log::info!("cluster: the forwarded call {key} stays in etcd: {e}");
    }
    answer
}
