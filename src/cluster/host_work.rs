//! One request of another node, performed by a controller host on its own
//! worker thread: an attachment (ControllerPublish or ControllerUnpublish)
//! or a forwarded volume operation, under the request's lock.
//!
//! A request taken from a watch event costs the host two round trips: the
//! lock's `Txn`, which also reads the claim the request is for and the
//! volume's registration, and the answer's `Txn`, which writes the result
//! only while the request is unchanged, the lock is still this host's and
//! the claim still holds with the request's epoch (a claim that went during
//! the call fails it, and the call is undone before anything is recorded).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::claims::controller_calls::{from_hex, parse_call, to_hex};
use crate::claims::remote::{now_ms, parse_attachment, AttachState, AttachmentRecord, Want};
use crate::claims::{ClaimError, EtcdClaims, SharedVolumes};
use crate::etcd::{Compare, CompareOp, KeyValue, TxnOp};
use crate::plugins::PluginSnapshot;
use crate::volumes::requests::{self, VolumeRef};

/// A request lock as this host wrote it.
pub(super) struct LockKey {
    pub(super) key: String,
    pub(super) value: String,
}

/// What the lock's `Txn` read with it: the request at the revision it was
/// locked at, the claim it is for (when it names one) and the volume's
/// registration.
pub(super) struct Prefetch {
    pub(super) request: KeyValue,
    /// None: the request names no claim (no epoch); Some(None): the claim
    /// is gone.
    pub(super) claim: Option<Option<KeyValue>>,
    pub(super) spec: Option<KeyValue>,
}

/// Why a controller call for another node's attach request failed: what
/// its answer records, with whether asking again can help.
#[derive(Debug)]
enum CallError {
    /// The volume is no longer registered in the cluster.
    NotRegistered { volume_id: String },
    /// The volume's registration could not be read.
    Registration(ClaimError),
    /// The controller plugin failed the call.
    Plugin(crate::csi::CsiError),
    /// Not attached: the claim the request is for is gone or newer (`why`);
    /// `undone` says what became of an attach an earlier attempt may have
    /// made.
    ClaimGone { why: String, undone: String },
}

impl CallError {
    /// Whether the requester may ask again.
    fn is_retryable(&self) -> bool {
        match self {
            CallError::NotRegistered { .. } | CallError::ClaimGone { .. } => false,
            CallError::Registration(_) => true,
            CallError::Plugin(e) => e.is_retryable(),
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::NotRegistered { volume_id } => {
                write!(f, "volume {volume_id} is not registered in the cluster")
            }
            CallError::Registration(e) => e.fmt(f),
            CallError::Plugin(e) => e.fmt(f),
            CallError::ClaimGone { why, undone } => write!(f, "{why} ({undone})"),
        }
    }
}

impl std::error::Error for CallError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CallError::Registration(e) => e.source(),
            CallError::Plugin(e) => e.source(),
            CallError::NotRegistered { .. } | CallError::ClaimGone { .. } => None,
        }
    }
}

/// Why a forwarded controller call failed: what its answer records, with
/// the gRPC code the requester returns and whether it may ask again.
#[derive(Debug)]
enum ForwardError {
    NotForwarded {
        method: String,
    },
    NotHex,
    /// The controller plugin failed the call.
    Plugin(crate::csi::CsiError),
}

impl ForwardError {
    fn code(&self) -> grpcio::RpcStatusCode {
        match self {
            ForwardError::NotForwarded { .. } | ForwardError::NotHex => {
                grpcio::RpcStatusCode::INVALID_ARGUMENT
            }
            ForwardError::Plugin(e) => e.code().unwrap_or(grpcio::RpcStatusCode::UNKNOWN),
        }
    }

    fn is_retryable(&self) -> bool {
        match self {
            ForwardError::NotForwarded { .. } | ForwardError::NotHex => false,
            ForwardError::Plugin(e) => e.is_retryable(),
        }
    }
}

impl fmt::Display for ForwardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForwardError::NotForwarded { method } => {
                write!(f, "{method} is not a forwarded method")
            }
            ForwardError::NotHex => f.write_str("the request is not hex"),
            ForwardError::Plugin(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ForwardError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ForwardError::Plugin(e) => e.source(),
            ForwardError::NotForwarded { .. } | ForwardError::NotHex => None,
        }
    }
}

/// One request, performed on a worker thread.
pub(super) struct Work {
    pub(super) claims: Arc<EtcdClaims>,
    pub(super) node: String,
    pub(super) key: String,
    pub(super) lock: LockKey,
    /// The plugin asked for the claim's epoch (`cluster.epoch_plugins`).
    pub(super) gives_epoch: bool,
    pub(super) controller: PluginSnapshot,
}

/// The key of the claim an attach request is for, when it names one.
pub(super) fn claim_key(claims: &EtcdClaims, rec: &AttachmentRecord) -> Option<String> {
    (rec.epoch != 0 && !rec.alloc_id.is_empty())
        .then(|| claims.keys().claim(&rec.volume_id, &rec.alloc_id))
}

impl Work {
    /// Performs the request; false when it was not answered (an error, or
    /// the request changed or went): the host looks at the requests again.
    pub(super) fn perform(&self, pre: Option<Prefetch>) -> bool {
        match self.try_perform(pre) {
            Ok(answered) => answered,
            Err(e) => {
                log::warn!("controller host: {}: {e}", self.key);
                self.unlock();
                false
            }
        }
    }

    /// The request as it is now, read again under the lock (the requester
    /// may have changed or withdrawn it); None (lock let go) when gone.
    fn read_again(&self) -> Result<Option<KeyValue>, ClaimError> {
        let kv = self
            .claims
            .client()
            .get(&self.key)
            .map_err(crate::claims::etcd::unavailable)?;
        if kv.is_none() {
            self.unlock();
        }
        Ok(kv)
    }

    /// Writes the result (`done`) and lets go of the lock, only while the
    /// request is as it was read, the lock is still this host's and every
    /// compare of `more` holds; false (nothing written) otherwise.
    fn try_finish(
        &self,
        read: &KeyValue,
        done: TxnOp,
        more: &[Compare],
    ) -> Result<bool, ClaimError> {
        let mut compares = vec![
            Compare::mod_revision(self.key.clone(), CompareOp::Equal, read.mod_revision),
            Compare::value(
                self.lock.key.clone(),
                CompareOp::Equal,
                self.lock.value.clone(),
            ),
        ];
        compares.extend_from_slice(more);
        let t = self
            .claims
            .client()
            .txn(
                &compares,
                &[done, TxnOp::delete(self.lock.key.clone())],
                &[],
            )
            .map_err(crate::claims::etcd::unavailable)?;
        Ok(t.succeeded)
    }

    /// `try_finish`, and the lock let go when the request changed.
    fn finish(&self, read: &KeyValue, done: TxnOp) -> Result<bool, ClaimError> {
        let answered = self.try_finish(read, done, &[])?;
        if !answered {
            self.not_answered();
        }
        Ok(answered)
    }

    fn not_answered(&self) {
        log::info!(
            "controller host: {} changed or was withdrawn while it was performed; not answered",
            self.key
        );
        self.unlock();
    }

    fn try_perform(&self, pre: Option<Prefetch>) -> Result<bool, ClaimError> {
        let (kv, claim, spec) = match pre {
            Some(p) => (p.request, p.claim, Some(p.spec)),
            None => match self.read_again()? {
                Some(kv) => (kv, None, None),
                None => return Ok(false),
            },
        };
        let mut rec = parse_attachment(&kv)?;
        if rec.state != AttachState::Pending {
            self.unlock();
            return Ok(false);
        }
        // The fencing token: nothing is attached for a claim that is gone
        // or newer (a request from a node the cluster fenced meanwhile).
        let refused = match (rec.want, claim) {
            (Want::Attached, Some(read)) => gone_why(&rec, read.as_ref()),
            (Want::Attached, None) => self.claim_gone(&rec)?,
            (Want::Detached, _) => None,
        };
        let result = match refused {
            // An earlier attempt may have attached it and lost its answer
            // (etcd did not answer the write that records it): undone.
            Some(why) => Err(CallError::ClaimGone {
                why,
                undone: self.undo_attach(&rec, spec.as_ref())?,
            }),
            None => self.call(&rec, spec.as_ref()),
        };
        // An attach is recorded only while its claim holds with its epoch.
        let holds: Vec<Compare> = match (&rec.want, &result, claim_key(&self.claims, &rec)) {
            (Want::Attached, Ok(_), Some(key)) => {
                vec![Compare::create_revision(key, CompareOp::Equal, rec.epoch)]
            }
            _ => Vec::new(),
        };
        rec.handled_by = Some(self.node.clone());
        rec.updated_at_ms = now_ms();
        let attempt = rec.clone();
        let done_op = answer(&self.key, &mut rec, result);
        if holds.is_empty() {
            return self.finish(&kv, done_op);
        }
        if self.try_finish(&kv, done_op, &holds)? {
            return Ok(true);
        }
        let Some(why) = self.claim_gone(&attempt)? else {
            // The claim holds: the request changed, or the lock went.
            self.not_answered();
            return Ok(false);
        };
        // Gone during the call: undone before anything is recorded.
        let undone = self.undo_attach(&attempt, spec.as_ref())?;
        log::warn!(
            "controller host: volume {} attached to node {} for a claim that went meanwhile: {undone}",
            attempt.volume_id,
            attempt.node
        );
        let mut rec = attempt;
        let done_op = answer(
            &self.key,
            &mut rec,
            Err(CallError::ClaimGone { why, undone }),
        );
        self.finish(&kv, done_op)
    }

    /// Undoes an attach for a claim that is gone (ControllerUnpublish; a
    /// volume never attached answers OK): says what was done. Left
    /// attached while another claim of the volume on that node holds it
    /// (another allocation there, or the same one's claim taken again):
    /// the attachment is theirs. A detach that fails and may succeed if
    /// asked again is an error (the request is looked at again, and undone
    /// then); one that cannot is said in the answer.
    fn undo_attach(
        &self,
        rec: &AttachmentRecord,
        spec: Option<&Option<KeyValue>>,
    ) -> Result<String, ClaimError> {
        let claims = self
            .claims
            .client()
            .range_prefix(self.claims.keys().claims_of(&rec.volume_id))
            .map_err(crate::claims::etcd::unavailable)?;
        let theirs = claims.kvs.iter().find_map(|kv| {
            let c = crate::claims::etcd::parse(kv).ok()?.claim;
            (c.node == rec.node).then_some(c.alloc_id)
        });
        if let Some(alloc) = theirs {
            return Ok(format!(
                "left attached: allocation {alloc} on node {} holds the volume",
                rec.node
            ));
        }
        let undo = AttachmentRecord {
            want: Want::Detached,
            ..rec.clone()
        };
        match self.call(&undo, spec) {
            Ok(_) => Ok("detached (again)".to_string()),
            // Asking again cannot help (the volume is no longer
            // registered, the plugin refuses for good): said in the answer.
            Err(e) if !e.is_retryable() => {
                Ok(format!("the detach failed: {}", crate::error_chain(&e)))
            }
            Err(e) => Err(ClaimError::Unavailable {
                store: "controller".to_string(),
                reason: format!(
                    "volume {} may be attached to node {} for a claim that is gone, and its detach failed: {} (retried)",
                    rec.volume_id,
                    rec.node,
                    crate::error_chain(&e)
                ),
            }),
        }
    }

    /// Why the claim an attach request is for no longer holds (None: it
    /// does), read now. Requests without an epoch (older agents) are not
    /// checked.
    fn claim_gone(&self, rec: &AttachmentRecord) -> Result<Option<String>, ClaimError> {
        let Some(key) = claim_key(&self.claims, rec) else {
            return Ok(None);
        };
        let kv = self
            .claims
            .client()
            .get(&key)
            .map_err(crate::claims::etcd::unavailable)?;
        Ok(gone_why(rec, kv.as_ref()))
    }

    /// The controller call; the publish context, or why it failed.
    /// `spec`: the volume's registration when read already (None: read
    /// it now; Some(None): not registered).
    fn call(
        &self,
        rec: &AttachmentRecord,
        spec: Option<&Option<KeyValue>>,
    ) -> Result<BTreeMap<String, String>, CallError> {
        let read = match spec {
            Some(kv) => kv.as_ref().map(crate::claims::etcd::parse_spec).transpose(),
            None => self.claims.get(&rec.volume_id),
        };
        let spec = match read {
            Ok(Some(spec)) => spec,
            Ok(None) => {
                return Err(CallError::NotRegistered {
                    volume_id: rec.volume_id.clone(),
                })
            }
            Err(e) => return Err(CallError::Registration(e)),
        };
        let no_context = BTreeMap::new();
        let vref = VolumeRef {
            external_volume_id: &rec.external_volume_id,
            external_node_id: Some(&rec.external_node_id),
            usage: &rec.usage,
            mount_flags: &rec.mount_flags,
            mount_group: "",
            staging_path: None,
            target_path: Path::new(""),
            publish_context: &no_context,
            epoch: (self.gives_epoch && rec.epoch != 0).then_some(rec.epoch),
        };
        let client = &self.controller.client;
        match rec.want {
            Want::Attached => {
                let readonly = self
                    .controller
                    .controller_capabilities
                    .as_ref()
                    .is_some_and(|c| c.publish_readonly);
                client
                    .controller_publish_volume(&requests::controller_publish(vref, &spec, readonly))
                    .map_err(CallError::Plugin)
            }
            Want::Detached => {
                match client
                    .controller_unpublish_volume(&requests::controller_unpublish(vref, Some(&spec)))
                {
                    Err(e) if !e.is_ignorable() => Err(CallError::Plugin(e)),
                    _ => Ok(BTreeMap::new()),
                }
            }
        }
    }

    /// Performs a forwarded call; false when it was not answered.
    pub(super) fn perform_call(&self) -> bool {
        match self.try_perform_call() {
            Ok(answered) => answered,
            Err(e) => {
                log::warn!("controller host: {}: {e}", self.key);
                self.unlock();
                false
            }
        }
    }

    fn try_perform_call(&self) -> Result<bool, ClaimError> {
        let Some(kv) = self.read_again()? else {
            return Ok(false);
        };
        let mut rec = parse_call(&kv)?;
        if rec.state != AttachState::Pending {
            self.unlock();
            return Ok(false);
        }
        if rec.expired() {
            // Its requester gave up: never performed late (a DeleteVolume
            // after the user saw an error), withdrawn instead.
            log::warn!(
                "controller host: {} of plugin {} for node {} not performed: its requester stopped waiting for it",
                rec.method,
                rec.plugin_id,
                rec.requested_by
            );
            return self.finish(&kv, TxnOp::delete(self.key.clone()));
        }
        let result = match (
            crate::csi::forwarded_method(&rec.method),
            from_hex(&rec.request_hex),
        ) {
            (None, _) => Err(ForwardError::NotForwarded {
                method: rec.method.clone(),
            }),
            (_, None) => Err(ForwardError::NotHex),
            (Some(m), Some(bytes)) => self
                .controller
                .client
                .forward_controller_call(m, &bytes)
                .map_err(ForwardError::Plugin),
        };
        rec.handled_by = Some(self.node.clone());
        rec.updated_at_ms = now_ms();
        match result {
            Ok(reply) => {
                log::info!(
                    "controller host: {} of plugin {} for node {} done",
                    rec.method,
                    rec.plugin_id,
                    rec.requested_by
                );
                rec.state = AttachState::Done;
                rec.response_hex = to_hex(&reply);
            }
            Err(e) => {
                let error = crate::error_chain(&e);
                log::warn!(
                    "controller host: {} of plugin {} for node {} failed: {error}",
                    rec.method,
                    rec.plugin_id,
                    rec.requested_by
                );
                rec.state = AttachState::Failed;
                rec.error = Some(error);
                rec.code = e.code().into();
                rec.retryable = e.is_retryable();
            }
        }
        let value = serde_json::to_vec(&rec).expect("a call always encodes");
        self.finish(&kv, TxnOp::put(self.key.clone(), value))
    }

    /// Lets go of the lock (only this host's: compared by value).
    fn unlock(&self) {
        let same = Compare::value(
            self.lock.key.clone(),
            CompareOp::Equal,
            self.lock.value.clone(),
        );
        let del = TxnOp::delete(self.lock.key.clone());
        if let Err(e) = self.claims.client().txn(&[same], &[del], &[]) {
            log::info!(
                "controller host: lock {} stays until this node's lease ends: {e}",
                self.lock.key
            );
        }
    }
}

fn put(key: &str, rec: &AttachmentRecord) -> TxnOp {
    TxnOp::put(
        key.to_string(),
        serde_json::to_vec(rec).expect("a request always encodes"),
    )
}

/// Why the claim `kv` (None: absent) does not hold an attach request's
/// claim (None: it does): `claims/<volume>/<alloc>` must exist for the
/// requesting node with the request's epoch as its create revision.
fn gone_why(rec: &AttachmentRecord, kv: Option<&KeyValue>) -> Option<String> {
    if rec.epoch == 0 || rec.alloc_id.is_empty() {
        return None;
    }
    let holds = kv.is_some_and(|kv| {
        kv.create_revision == rec.epoch
            && crate::claims::etcd::parse(kv).is_ok_and(|c| c.claim.node == rec.node)
    });
    (!holds).then(|| {
        format!(
            "the claim of allocation {} on node {} with epoch {} is gone or newer (freed, or fenced): not attached",
            rec.alloc_id, rec.node, rec.epoch
        )
    })
}

/// The answer to write for a request, from the call's result.
fn answer(
    key: &str,
    rec: &mut AttachmentRecord,
    result: Result<BTreeMap<String, String>, CallError>,
) -> TxnOp {
    match (&rec.want, result) {
        (Want::Attached, Ok(ctx)) => {
            log::info!(
                "controller host: attached volume {} to node {} (node ID {})",
                rec.volume_id,
                rec.node,
                rec.external_node_id
            );
            rec.state = AttachState::Done;
            rec.publish_context = ctx;
            rec.error = None;
            put(key, rec)
        }
        (Want::Detached, Ok(_)) => {
            log::info!(
                "controller host: detached volume {} from node {} (node ID {})",
                rec.volume_id,
                rec.node,
                rec.external_node_id
            );
            TxnOp::delete(key.to_string())
        }
        (_, Err(e)) => {
            let error = crate::error_chain(&e);
            log::warn!(
                "controller host: {} of volume {} for node {} failed: {error}",
                match rec.want {
                    Want::Attached => "ControllerPublishVolume",
                    Want::Detached => "ControllerUnpublishVolume",
                },
                rec.volume_id,
                rec.node
            );
            rec.state = AttachState::Failed;
            rec.error = Some(error);
            rec.retryable = e.is_retryable();
            put(key, rec)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::{CsiError, CsiMethod};
    use grpcio::RpcStatusCode;

    fn status(method: CsiMethod, code: RpcStatusCode) -> CsiError {
        CsiError::Status {
            method,
            code,
            message: "said the plugin".to_string(),
        }
    }

    #[test]
    fn a_failed_call_says_what_its_answer_records_and_whether_to_ask_again() {
        let busy = status(CsiMethod::ControllerPublishVolume, RpcStatusCode::ABORTED);
        let busy_text = crate::error_chain(&busy);
        let cases = [
            (
                CallError::NotRegistered {
                    volume_id: "v".to_string(),
                },
                "volume v is not registered in the cluster".to_string(),
                false,
            ),
            (
                CallError::Registration(ClaimError::Unavailable {
                    store: "etcd".to_string(),
                    reason: "no answer".to_string(),
                }),
                "the claim store etcd is unavailable: no answer".to_string(),
                true,
            ),
            (
                CallError::ClaimGone {
                    why: "the claim is gone".to_string(),
                    undone: "detached (again)".to_string(),
                },
                "the claim is gone (detached (again))".to_string(),
                false,
            ),
            (CallError::Plugin(busy), busy_text, true),
            (
                CallError::Plugin(status(
                    CsiMethod::ControllerPublishVolume,
                    RpcStatusCode::INVALID_ARGUMENT,
                )),
                crate::error_chain(&status(
                    CsiMethod::ControllerPublishVolume,
                    RpcStatusCode::INVALID_ARGUMENT,
                )),
                false,
            ),
        ];
        for (e, text, retryable) in cases {
            assert_eq!(crate::error_chain(&e), text);
            assert_eq!(e.is_retryable(), retryable, "{e}");
        }
    }

    #[test]
    fn a_failed_forwarded_call_keeps_the_plugins_code() {
        let not_forwarded = ForwardError::NotForwarded {
            method: "Nope".to_string(),
        };
        assert_eq!(not_forwarded.to_string(), "Nope is not a forwarded method");
        assert_eq!(not_forwarded.code(), RpcStatusCode::INVALID_ARGUMENT);
        assert!(!not_forwarded.is_retryable());
        assert_eq!(ForwardError::NotHex.to_string(), "the request is not hex");
        assert_eq!(ForwardError::NotHex.code(), RpcStatusCode::INVALID_ARGUMENT);
        let plugin = status(CsiMethod::CreateVolume, RpcStatusCode::UNAVAILABLE);
        let text = crate::error_chain(&plugin);
        let e = ForwardError::Plugin(plugin);
        assert_eq!(crate::error_chain(&e), text);
        assert_eq!(e.code(), RpcStatusCode::UNAVAILABLE);
        assert!(e.is_retryable());
    }
}
