//! Controller attachments through etcd (cluster mode; the Kubernetes
//! VolumeAttachment pattern). A node whose own plugin has no controller
//! side writes `<prefix>/attachments/<volume>/<node>` and waits; an agent
//! hosting the plugin's controller side (`cluster::controller_host`)
//! performs ControllerPublish / ControllerUnpublish and writes the result
//! back. Controller hosts announce themselves under
//! `<prefix>/plugins/<plugin>/controllers/<node>` (durable: whether a
//! plugin needs attaching must not depend on a host being alive right now).
//!
//! Every change is a `Txn` with revision compares; a request and its
//! result survive restarts of every party.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::etcd::{unavailable, EtcdClaims};
use super::remote::*;
use super::ClaimError;
use crate::etcd::{Compare, CompareOp, TxnOp};
use crate::shutdown::Shutdown;
use crate::volumes::Usage;

/// A watch etcd has not answered on for this long (an idle stream asks for
/// progress every `etcd::watch::AUTO_PROGRESS`) is stale.
const WATCH_STALE_AFTER: Duration = Duration::from_secs(6);
/// The longest settle after a fence, whatever a host published: a host
/// configured with a deadline of hours would hold every reap that long.
const MAX_SETTLE: Duration = Duration::from_secs(600);

/// The first and the longest pause between two reads of a request that
/// waits for its result.
const RESULT_POLL_MIN: Duration = Duration::from_millis(20);
const RESULT_POLL_MAX: Duration = Duration::from_millis(500);

impl EtcdClaims {
    pub fn attachments_prefix(&self) -> String {
        self.keys().attachments()
    }

    pub fn attachment_key(&self, volume_id: &str, node: &str) -> String {
        self.keys().attachment(volume_id, node)
    }

    pub fn attachment_lock_key(&self, volume_id: &str, node: &str) -> String {
        self.keys().attachment_lock(volume_id, node)
    }

    pub fn controller_host_key(&self, plugin_id: &str, node: &str) -> String {
        self.keys().controller_host(plugin_id, node)
    }

    /// The nodes whose liveness key exists.
    pub fn alive_nodes(&self) -> Result<std::collections::HashSet<String>, ClaimError> {
        Ok(self
            .client()
            .range_prefix(self.keys().nodes())
            .map_err(unavailable)?
            .kvs
            .iter()
            .filter_map(|kv| match self.keys().parse_node(&kv.key_str()) {
                Some(super::etcd::keys::NodeKey::Liveness(n)) => Some(n),
                _ => None,
            })
            .collect())
    }

    /// Every registered controller host, of every plugin.
    pub fn controller_hosts(&self) -> Result<Vec<ControllerHostRecord>, ClaimError> {
        let r = self
            .client()
            .range_prefix(self.keys().plugins())
            .map_err(unavailable)?;
        Ok(r.kvs
            .iter()
            .filter(|kv| self.keys().parse_controller_host(&kv.key_str()).is_some())
            .filter_map(|kv| match parse_host(kv) {
                Ok(h) => Some(h),
                Err(e) => {
                    log::warn!("cluster: {e}");
                    None
                }
            })
            .collect())
    }

    /// Writes this node's record as a controller host of a plugin.
    pub fn put_controller_host(&self, rec: &ControllerHostRecord) -> Result<(), ClaimError> {
        let value = serde_json::to_vec(rec).expect("a host record always encodes");
        self.client()
            .put(self.controller_host_key(&rec.plugin_id, &rec.node), value)
            .map_err(unavailable)?;
        Ok(())
    }

    /// Puts the request (want, pending) unless it already stands as asked;
    /// returns the record as it is after the write and the revision it
    /// stands at (a watch from the next revision misses no answer).
    /// `guard`: more compares the write needs (a detach for a node gone
    /// for good: its liveness key still absent).
    ///
    /// One `Txn` when the key is as this node last saw it (absent when it
    /// saw nothing): the write compares against that sight, and a failed
    /// compare reads what is there in the same round trip. A sight is
    /// never trusted to skip the write (it may be stale): only a read
    /// made now says a request already stands.
    fn request(
        &self,
        req: &AttachRequest,
        want: Want,
        guard: &[Compare],
    ) -> Result<(AttachmentRecord, i64), ClaimError> {
        let key = self.attachment_key(&req.volume_id, &req.node);
        let mut current = self.shared.attachments_seen.lock().get(&key).cloned();
        // The revision of a read made in this call (0: `current` is only
        // an earlier sight).
        let mut read_at = 0;
        for _ in 0..super::etcd::CONFLICT_ATTEMPTS {
            let now = now_ms();
            let (compare, rec) = match &current {
                Some((revision, old)) => {
                    let same_node_id = old.external_node_id == req.external_node_id;
                    if old.want == want
                        && (old.state == AttachState::Pending
                            || (old.state == AttachState::Done && same_node_id))
                    {
                        if read_at != 0 {
                            return Ok((old.clone(), read_at));
                        }
                        // Stands as asked by an earlier sight: read it.
                        let r = self.client().range(&key, "").map_err(unavailable)?;
                        current = r.kvs.first().map(seen).transpose()?;
                        read_at = r.revision;
                        self.saw(&key, current.as_ref());
                        continue;
                    }
                    let rec = AttachmentRecord {
                        want,
                        state: AttachState::Pending,
                        error: old.error.clone(),
                        retryable: old.retryable,
                        updated_at_ms: now,
                        ..fresh(req, want, now)
                    };
                    (
                        Compare::mod_revision(key.clone(), CompareOp::Equal, *revision),
                        rec,
                    )
                }
                None => (Compare::absent(key.clone()), fresh(req, want, now)),
            };
            let value = serde_json::to_vec(&rec).expect("a request always encodes");
            let mut compares = vec![compare];
            compares.extend_from_slice(guard);
            let t = self
                .client()
                .txn(
                    &compares,
                    &[TxnOp::put(key.clone(), value)],
                    &[TxnOp::get(key.clone())],
                )
                .map_err(unavailable)?;
            if t.succeeded {
                self.saw(&key, Some(&(t.revision, rec.clone())));
                return Ok((rec, t.revision));
            }
            current = t
                .first_range()
                .and_then(|r| r.kvs.first())
                .map(seen)
                .transpose()?;
            read_at = t.revision;
            self.saw(&key, current.as_ref());
            if !guard.is_empty() && self.node_is_alive(&req.node)? {
                return Err(ClaimError::Impossible {
                    volume_id: req.volume_id.clone(),
                    reason: format!("node {} is alive again: not detached", req.node),
                });
            }
        }
        Err(ClaimError::Unavailable {
            store: "etcd".to_string(),
            reason: format!("{key} kept changing"),
        })
    }

    /// Remembers this node's last sight of its request `key` (None: gone).
    fn saw(&self, key: &str, rec: Option<&(i64, AttachmentRecord)>) {
        let mut seen = self.shared.attachments_seen.lock();
        match rec {
            Some(r) => {
                seen.insert(key.to_string(), r.clone());
            }
            None => {
                seen.remove(key);
            }
        }
    }

    /// Reads the request until `done` says it is answered, up to `wait`:
    /// through a watch on its key from the revision after `from` (the
    /// request as it stood then was seen already: each later change
    /// arrives as an event, and nothing is read), or from now and read
    /// once after the watch started when `from` is 0 or the watch cannot
    /// start there (compacted); by polling when no watch can be made.
    fn wait_for<T>(
        &self,
        req: &AttachRequest,
        from: i64,
        wait: Duration,
        shutdown: &Shutdown,
        done: impl Fn(Option<&AttachmentRecord>) -> Option<Result<T, AttachError>>,
    ) -> Result<T, AttachError> {
        let key = self.attachment_key(&req.volume_id, &req.node);
        let started = Instant::now();
        let deadline = started + wait;
        let from_next = (from > 0)
            .then(|| self.client().watch(key.as_bytes(), "", from + 1).ok())
            .flatten();
        let mut read = from_next.is_none();
        let watcher = from_next.or_else(|| self.client().watch(key.as_bytes(), "", 0).ok());
        let no_answer = || AttachError::NoAnswer {
            waited: started.elapsed(),
            hosts: self.describe_hosts(&req.plugin_id),
        };
        let mut pause = RESULT_POLL_MIN;
        loop {
            if read {
                let kv = self
                    .client()
                    .get(&key)
                    .map_err(|e| AttachError::Store(unavailable(e)))?;
                let rec = kv
                    .as_ref()
                    .map(seen)
                    .transpose()
                    .map_err(AttachError::Store)?;
                self.saw(&key, rec.as_ref());
                if let Some(answer) = done(rec.as_ref().map(|(_, r)| r)) {
                    return answer;
                }
            }
            if Instant::now() >= deadline {
                return Err(no_answer());
            }
            let Some(w) = &watcher else {
                if !shutdown.sleep(pause.min(deadline - Instant::now())) {
                    return Err(AttachError::Stopping);
                }
                pause = (pause * 2).min(RESULT_POLL_MAX);
                continue;
            };
            let mut select = crossbeam_channel::Select::new();
            let change = select.recv(w.receiver());
            select.recv(shutdown.receiver());
            match select.ready_deadline(deadline) {
                Err(_) => return Err(no_answer()),
                Ok(i) if i != change => return Err(AttachError::Stopping),
                Ok(_) => {}
            }
            // The event carries the new value; a broken watch falls back
            // to reading.
            read = false;
            match w.recv_timeout(Duration::ZERO) {
                Ok(Some(crate::etcd::WatchEvent::Put(kv))) => {
                    let rec = seen(&kv).map_err(AttachError::Store)?;
                    self.saw(&key, Some(&rec));
                    if let Some(answer) = done(Some(&rec.1)) {
                        return answer;
                    }
                }
                Ok(Some(crate::etcd::WatchEvent::Delete(_))) => {
                    self.saw(&key, None);
                    if let Some(answer) = done(None) {
                        return answer;
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    read = true;
                    if !shutdown.sleep(RESULT_POLL_MAX.min(deadline - Instant::now())) {
                        return Err(AttachError::Stopping);
                    }
                }
            }
        }
    }

    /// "b (alive), c (not alive)" for an error message.
    fn describe_hosts(&self, plugin_id: &str) -> String {
        let hosts = match self.controller_hosts() {
            Ok(h) => h,
            Err(e) => return format!("unknown: {e}"),
        };
        let list: Vec<String> = hosts
            .iter()
            .filter(|h| h.plugin_id == plugin_id)
            .map(|h| match self.node_is_alive(&h.node) {
                Ok(true) => format!("{} (alive)", h.node),
                Ok(false) => format!("{} (not alive)", h.node),
                Err(_) => h.node.clone(),
            })
            .collect();
        if list.is_empty() {
            "none registered".to_string()
        } else {
            list.join(", ")
        }
    }
}

fn fresh(req: &AttachRequest, want: Want, now: u64) -> AttachmentRecord {
    AttachmentRecord {
        volume_id: req.volume_id.clone(),
        node: req.node.clone(),
        plugin_id: req.plugin_id.clone(),
        external_volume_id: req.external_volume_id.clone(),
        external_node_id: req.external_node_id.clone(),
        usage: req.usage,
        mount_flags: req.mount_flags.clone(),
        want,
        state: AttachState::Pending,
        publish_context: BTreeMap::new(),
        error: None,
        retryable: false,
        handled_by: None,
        requested_at_ms: now,
        updated_at_ms: now,
        alloc_id: match want {
            Want::Attached => req.alloc_id.clone(),
            Want::Detached => String::new(),
        },
        epoch: match want {
            Want::Attached => req.epoch,
            Want::Detached => 0,
        },
    }
}

/// A request as read: its mod revision and its record.
fn seen(kv: &crate::etcd::KeyValue) -> Result<(i64, AttachmentRecord), ClaimError> {
    Ok((kv.mod_revision, parse_attachment(kv)?))
}

fn failed(rec: &AttachmentRecord) -> AttachError {
    AttachError::Failed {
        host: rec.handled_by.clone().unwrap_or_default(),
        error: rec.error.clone().unwrap_or_default(),
        retryable: rec.retryable,
        code: 0,
    }
}

impl RemoteControllers for EtcdClaims {
    fn remove_node(&self, node: &str) -> Result<Vec<String>, super::remote::RemoveNodeError> {
        EtcdClaims::remove_node(self, node)
    }

    fn hosts(&self) -> Result<Vec<(ControllerHostRecord, bool)>, ClaimError> {
        let alive = self.alive_nodes()?;
        Ok(self
            .controller_hosts()?
            .into_iter()
            .map(|h| {
                let a = alive.contains(&h.node);
                (h, a)
            })
            .collect())
    }

    fn release_node_volume(
        &self,
        volume_id: &str,
        node: &str,
        reason: &str,
        by: &str,
        rule: super::fencing::FreeRule<'_>,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<NodeDetach, AttachError> {
        EtcdClaims::release_node_volume(self, volume_id, node, reason, by, rule, wait, shutdown)
    }

    fn forward(
        &self,
        plugin_id: &str,
        method: &str,
        request: &[u8],
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<Vec<u8>, AttachError> {
        super::controller_calls::forward(self, plugin_id, method, request, wait, shutdown)
    }

    fn controller_of(&self, plugin_id: &str) -> Result<Option<RemoteController>, ClaimError> {
        let (need_watch, old) = {
            let mut cache = self.shared.controllers.lock();
            // Events, an ended watch, or a watch etcd has not answered on
            // lately (a member cut off from its quorum): the answers are
            // not trusted; read again.
            let changed = match &cache.watcher {
                None => true,
                Some(w) => {
                    !matches!(w.recv_timeout(Duration::ZERO), Ok(None))
                        || !w.is_fresh(WATCH_STALE_AFTER)
                }
            };
            let mut old = None;
            if changed {
                // Events (or an ended watch) drop the answers; the watch
                // is made again from now on.
                cache.answers.clear();
                old = cache.watcher.take();
                cache.generation += 1;
            } else if let Some(answer) = cache.answers.get(plugin_id) {
                return Ok(answer.clone());
            }
            (cache.watcher.is_none(), old)
        };
        // Stopped outside the cache's lock (its thread is joined).
        drop(old);
        if need_watch {
            // Made outside the cache's lock (a round trip).
            let prefix = self.keys().plugins();
            let w = self
                .client()
                .watch(
                    prefix.as_bytes(),
                    crate::etcd::prefix_end(prefix.as_bytes()),
                    0,
                )
                .ok();
            let mut cache = self.shared.controllers.lock();
            if cache.watcher.is_none() && w.is_some() {
                cache.watcher = w;
                cache.generation += 1;
            }
        }
        let generation = self.shared.controllers.lock().generation;
        let r = self
            .client()
            .range_prefix(self.keys().controller_hosts(plugin_id))
            .map_err(unavailable)?;
        let mut found = None;
        for kv in &r.kvs {
            let h = parse_host(kv)?;
            if h.publish_unpublish_volume {
                found = Some(RemoteController {
                    plugin_id: plugin_id.to_string(),
                    publish_readonly: h.publish_readonly,
                });
            }
        }
        let mut cache = self.shared.controllers.lock();
        // Kept only while the watch that was running before the read still
        // runs (a change after the read shows as its event).
        if cache.watcher.is_some() && cache.generation == generation {
            cache.answers.insert(plugin_id.to_string(), found.clone());
        }
        Ok(found)
    }

    fn attach(
        &self,
        req: &AttachRequest,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<BTreeMap<String, String>, AttachError> {
        // The request carries the claim's epoch (the fencing token).
        let mut with_epoch;
        let req = if req.epoch == 0 && !req.alloc_id.is_empty() {
            with_epoch = req.clone();
            with_epoch.epoch = self
                .epoch_of(&req.volume_id, &req.alloc_id)
                .map_err(AttachError::Store)?;
            &with_epoch
        } else {
            req
        };
        let (rec, at) = self
            .request(req, Want::Attached, &[])
            .map_err(AttachError::Store)?;
        if rec.state == AttachState::Done {
            return Ok(rec.publish_context);
        }
        self.wait_for(req, at, wait, shutdown, |rec| match rec {
            Some(r) if r.want == Want::Attached && r.state == AttachState::Done => {
                Some(Ok(r.publish_context.clone()))
            }
            Some(r) if r.want == Want::Attached && r.state == AttachState::Failed => {
                Some(Err(failed(r)))
            }
            // Deleted or turned into a detach meanwhile: asked again by
            // the caller's retry.
            Some(r) if r.want == Want::Attached => None,
            _ => Some(Err(AttachError::Failed {
                host: String::new(),
                error: "the attach request was withdrawn while it waited".to_string(),
                retryable: true,
                code: 0,
            })),
        })
    }

    fn detach(
        &self,
        req: &AttachRequest,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<(), AttachError> {
        self.detach_guarded(req, wait, shutdown, &[])
    }
}

impl EtcdClaims {
    fn detach_guarded(
        &self,
        req: &AttachRequest,
        wait: Duration,
        shutdown: &Shutdown,
        guard: &[Compare],
    ) -> Result<(), AttachError> {
        let (_, at) = self
            .request(req, Want::Detached, guard)
            .map_err(AttachError::Store)?;
        self.wait_for(req, at, wait, shutdown, |rec| match rec {
            None => Some(Ok(())),
            Some(r) if r.want == Want::Detached && r.state == AttachState::Failed => {
                Some(Err(failed(r)))
            }
            Some(r) if r.want == Want::Detached => None,
            Some(_) => Some(Err(AttachError::Failed {
                host: String::new(),
                error: "an attach was asked for again while the detach waited".to_string(),
                retryable: true,
                code: 0,
            })),
        })
    }
}

impl EtcdClaims {
    /// The settle after a fence of `node`'s attachment of a `plugin_id`
    /// volume: the longest CSI call deadline of those that may have sent a
    /// ControllerPublish to it (every controller host of the plugin, the
    /// node itself), as they published them, never less than `own` and
    /// never more than `MAX_SETTLE`. Older agents publish none (they count
    /// as `own`); an etcd that does not answer fails the fence's free (the
    /// reaper tries again), never shortens the settle.
    fn publish_settle(
        &self,
        own: Duration,
        node: &str,
        plugin_id: &str,
    ) -> Result<Duration, ClaimError> {
        let ms = |v: &[u8]| {
            serde_json::from_slice::<serde_json::Value>(v)
                .ok()
                .and_then(|j| j["csi_call_timeout_ms"].as_u64())
                .map_or(Duration::ZERO, Duration::from_millis)
        };
        let hosts = self.keys().controller_hosts(plugin_id);
        let r = self
            .shared
            .client
            .range_prefix(&hosts)
            .map_err(unavailable)?;
        let settings = self.keys().settings(node);
        let own_node = self.shared.client.get(&settings).map_err(unavailable)?;
        let published = r
            .kvs
            .iter()
            .chain(own_node.as_ref())
            .map(|kv| ms(&kv.value))
            .max()
            .unwrap_or_default();
        let settle = own.max(published.min(MAX_SETTLE));
        if settle > own {
            log::info!(
                "cluster: the fence of node {node} settles for {settle:?} (the longest CSI call deadline published by it and plugin {plugin_id}'s controller hosts)"
            );
        }
        Ok(settle)
    }
}

impl EtcdClaims {
    /// Detaches `volume_id` from `node` through a controller host when the
    /// node holds an attachment of it (the external node ID recorded at
    /// attach time), then frees the node's claims of the volume, each with
    /// a `freed/` note carrying `reason`. For a node that is gone for good:
    /// the caller checked that it is not alive.
    #[allow(clippy::too_many_arguments)]
    pub fn release_node_volume(
        &self,
        volume_id: &str,
        node: &str,
        reason: &str,
        by: &str,
        rule: super::fencing::FreeRule<'_>,
        wait: Duration,
        shutdown: &Shutdown,
    ) -> Result<NodeDetach, AttachError> {
        let store = |e| AttachError::Store(unavailable(e));
        let r = self
            .client()
            .range_prefix(self.keys().claims_of(volume_id))
            .map_err(store)?;
        let mut mine = Vec::new();
        for kv in &r.kvs {
            match super::etcd::parse(kv) {
                Ok(stored) if stored.claim.node == node => mine.push((kv.clone(), stored)),
                Ok(_) => {}
                // Never freed or overwritten; reported where it is listed.
                Err(e) => log::warn!("cluster: {e} (left untouched)"),
            }
        }
        let attachment = self
            .client()
            .get(self.attachment_key(volume_id, node))
            .map_err(store)?
            .map(|kv| parse_attachment(&kv))
            .transpose()
            .map_err(AttachError::Store)?;
        let recorded_node_id = mine
            .iter()
            .find_map(|(_, s)| s.claim.external_node_id.clone());
        let request = match (attachment, recorded_node_id) {
            (Some(a), _) => Some(AttachRequest {
                volume_id: a.volume_id,
                node: a.node,
                plugin_id: a.plugin_id,
                external_volume_id: a.external_volume_id,
                external_node_id: a.external_node_id,
                usage: a.usage,
                mount_flags: a.mount_flags,
                alloc_id: String::new(),
                epoch: 0,
            }),
            (None, Some(node_id)) => {
                let spec = super::SharedVolumes::get(self, volume_id)
                    .map_err(AttachError::Store)?
                    .ok_or_else(|| {
                        AttachError::Store(ClaimError::UnknownVolume {
                            volume_id: volume_id.to_string(),
                        })
                    })?;
                let claim = &mine[0].1.claim;
                Some(AttachRequest {
                    volume_id: volume_id.to_string(),
                    node: node.to_string(),
                    plugin_id: spec.plugin_id.clone(),
                    external_volume_id: spec.external_id.clone(),
                    external_node_id: node_id,
                    usage: Usage {
                        read_only: claim.mode == super::ClaimMode::Read,
                        attachment: spec
                            .attachment_modes
                            .first()
                            .copied()
                            .unwrap_or(crate::volumes::AttachmentMode::FileSystem),
                        access_mode: claim.access_mode,
                    },
                    mount_flags: Vec::new(),
                    alloc_id: String::new(),
                    epoch: 0,
                })
            }
            (None, None) => None,
        };
        // Every write below holds only while the node is still gone: one
        // that comes back keeps its volumes and claims.
        let gone = match rule {
            super::fencing::FreeRule::Cluster { registered_at, .. } => {
                super::etcd::still_gone(self.keys(), node, registered_at)
            }
            // The operator's word: the node is gone for good, whatever
            // registered before; one that is back now is left alone.
            super::fencing::FreeRule::Operator => {
                vec![Compare::absent(self.keys().node(node))]
            }
        };
        let mut out = NodeDetach::default();
        match rule.decide(request.as_ref().map(|r| r.plugin_id.as_str())) {
            super::fencing::FreeDecision::Keep { why } => {
                out.kept = Some(why);
                return Ok(out);
            }
            super::fencing::FreeDecision::Free => {}
            super::fencing::FreeDecision::DetachThenFree => {
                if let Some(req) = &request {
                    self.detach_guarded(req, wait, shutdown, &gone)?;
                    if let Some(settle) = rule.publish_settle() {
                        let settle = self
                            .publish_settle(settle, node, &req.plugin_id)
                            .map_err(AttachError::Store)?;
                        // A ControllerPublish to the node that timed out
                        // before the fence may still land: wait out its
                        // bound, then unpublish again.
                        if !shutdown.sleep(settle) {
                            return Err(AttachError::Stopping);
                        }
                        self.detach_guarded(req, wait, shutdown, &gone)?;
                    }
                    out.detached = true;
                }
            }
        }
        // One lease for the notes of this call: etcd removes them after
        // the retention.
        let note_lease = if mine.is_empty() {
            None
        } else {
            Some(self.freed_note_lease().map_err(AttachError::Store)?)
        };
        for (kv, stored) in mine {
            let note = serde_json::json!({
                "claim": stored.claim, "reason": reason, "freed_by_node": by, "at_ms": now_ms(),
            });
            let note_key = self
                .keys()
                .freed(&stored.claim.volume_id, &stored.claim.alloc_id);
            let t = self
                .client()
                .txn(
                    &[
                        vec![Compare::mod_revision(
                            kv.key.clone(),
                            CompareOp::Equal,
                            kv.mod_revision,
                        )],
                        gone.clone(),
                    ]
                    .concat(),
                    &[
                        TxnOp::delete(kv.key.clone()),
                        TxnOp::delete(self.index_key_of(&kv.key_str(), node)),
                        TxnOp::put_with_lease(
                            note_key,
                            note.to_string(),
                            note_lease.expect("a lease when there are claims to free"),
                        ),
                    ],
                    &[],
                )
                .map_err(store)?;
            if !t.succeeded {
                log::warn!(
                    "cluster: the claim of volume {volume_id} by allocation {} of node {node} was not freed: it changed, or the node is back",
                    stored.claim.alloc_id
                );
            }
            if t.succeeded {
                log::warn!(
                    "cluster: freed the claim of volume {volume_id} by allocation {} of node {node}: {reason}",
                    stored.claim.alloc_id
                );
                out.freed.push(stored.claim.alloc_id);
            }
        }
        Ok(out)
    }
}
