//! Controller work for other nodes (the Kubernetes VolumeAttachment
//! pattern): an agent whose own plugin serves a controller side announces
//! it under `<prefix>/plugins/<plugin>/controllers/<node>`, watches
//! `<prefix>/attachments/`, and performs the pending requests for the
//! plugins it hosts: ControllerPublish (result and publish context written
//! back) or ControllerUnpublish (the request deleted once done).
//!
//! Several agents may host the same plugin: each request is performed by
//! the one holding `<prefix>/attachment-locks/<volume>/<node>`, a key on
//! the holder's liveness lease taken by `Txn`. A host that dies mid-request
//! loses the lock when its lease expires, and another host (or the same
//! one, restarted, at once) takes the request over; CSI's controller calls
//! are idempotent, so a call repeated by the next host attaches once. The
//! result is written only while the request is unchanged and the lock is
//! still this host's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::liveness::NodeLiveness;
use crate::claims::controller_calls::{from_hex, parse_call, to_hex, ControllerCallRecord};
use crate::claims::remote::{
    now_ms, parse_attachment, AttachState, AttachmentRecord, ControllerHostRecord, Want,
};
use crate::claims::{ClaimError, EtcdClaims, SharedVolumes};
use crate::etcd::{prefix_end, Compare, CompareOp, KeyValue, LeaseId, TxnOp, Watcher};
use crate::plugins::{PluginKind, PluginSnapshot, Registry};
use crate::shutdown::Shutdown;
use crate::threads::Threads;
use crate::volumes::requests::{self, VolumeRef};

/// Longest pause between two scans of the requests when the watch says
/// nothing (a lock that expired with its lease, a watch that broke).
const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// How recently a watch must have heard from etcd for the host to rely on
/// it instead of reading every `SCAN_INTERVAL`.
const WATCH_FRESH: Duration = Duration::from_secs(6);
/// How often an agent that hosts no controller yet looks at its plugins.
const ANNOUNCE_INTERVAL: Duration = Duration::from_millis(200);

/// The controller host's loop, owned by the agent.
pub struct ControllerHost {
    threads: Mutex<Option<Threads>>,
}

impl ControllerHost {
    /// Starts the loop (thread `controller-host`).
    pub fn start(
        claims: Arc<EtcdClaims>,
        registry: Registry,
        liveness: Arc<NodeLiveness>,
        node: &str,
        epoch_plugins: Vec<String>,
        shutdown: Shutdown,
    ) -> std::io::Result<ControllerHost> {
        let mut threads = Threads::new();
        let host = Host {
            claims,
            registry,
            liveness,
            node: node.to_string(),
            epoch_plugins,
            shutdown,
            announced: BTreeMap::new(),
            busy: Arc::new(Mutex::new(HashSet::new())),
            workers: Threads::new(),
            finished_seen: HashMap::new(),
            scan_again: false,
        };
        threads.spawn("controller-host", move || host.run())?;
        Ok(ControllerHost {
            threads: Mutex::new(Some(threads)),
        })
    }

    /// Joins the loop (after the stop was triggered) up to `deadline`.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        self.threads
            .lock()
            .take()
            .map(|t| t.join_until(deadline))
            .unwrap_or_default()
    }
}

struct Host {
    claims: Arc<EtcdClaims>,
    registry: Registry,
    liveness: Arc<NodeLiveness>,
    node: String,
    /// Plugins given the claim's epoch in ControllerPublish's volume
    /// context (`cluster.epoch_plugins`).
    epoch_plugins: Vec<String>,
    shutdown: Shutdown,
    /// What this node last wrote as its host record, per plugin.
    announced: BTreeMap<String, ControllerHostRecord>,
    /// Requests (keys) a worker of this host is performing.
    busy: Arc<Mutex<HashSet<String>>>,
    workers: Threads,
    /// Finished forwarded calls, since when this host saw them finished:
    /// removed after their retention (a requester that died left them).
    finished_seen: HashMap<String, Instant>,
    /// The last scan could not settle a request (a lock not answered):
    /// scan again after `SCAN_INTERVAL` even if nothing changes.
    scan_again: bool,
}

impl Host {
    /// Reads the requests (`scan`) only when something may have changed:
    /// a watch event, a plugin announced or changed, a worker done, a new
    /// lease, finished calls waiting out their retention; and every
    /// `SCAN_INTERVAL` while a watch is missing or not fresh. An idle host
    /// costs its watches' progress requests, not a full read a second.
    fn run(mut self) {
        let mut watchers: Vec<Watcher> = Vec::new();
        let mut rescan = true;
        let mut scanned_lease = None;
        while !self.shutdown.is_triggered() {
            if self.announce() {
                rescan = true;
            }
            if self.announced.is_empty() {
                // Hosting no controller (yet): nothing to look at; looked
                // at again soon, so a controller is announced as soon as
                // its plugin is fingerprinted.
                watchers.clear();
                rescan = true;
                if !self.shutdown.sleep(ANNOUNCE_INTERVAL) {
                    break;
                }
                continue;
            }
            let running = self.workers.len();
            self.workers.reap();
            if self.workers.len() < running {
                rescan = true;
            }
            if watchers.len() < 2 {
                // Requests and their locks (`attachment…`), forwarded calls
                // and theirs (`controller-call…`), from now: the scan
                // below reads what is there.
                watchers = ["attachment", "controller-call"]
                    .iter()
                    .filter_map(|p| {
                        let prefix = format!("{}/{p}", self.claims.prefix());
                        self.claims
                            .client()
                            .watch(prefix.as_bytes(), prefix_end(prefix.as_bytes()), 0)
                            .ok()
                    })
                    .collect();
                rescan = true;
            }
            let watched = watchers.len() == 2 && watchers.iter().all(|w| w.is_fresh(WATCH_FRESH));
            let lease = self.liveness.status().lease;
            if lease != scanned_lease
                || !watched
                || self.scan_again
                || !self.finished_seen.is_empty()
            {
                rescan = true;
            }
            if let (true, Some(lease)) = (rescan, lease) {
                self.scan_again = false;
                match self.scan(lease) {
                    Ok(()) => {
                        rescan = false;
                        scanned_lease = Some(lease);
                    }
                    Err(e) => log::warn!("controller host: cannot read the attach requests: {e}"),
                }
            }
            if watchers.len() < 2 {
                watchers.clear();
                if !self.shutdown.sleep(SCAN_INTERVAL) {
                    break;
                }
                continue;
            }
            let mut select = crossbeam_channel::Select::new();
            for w in &watchers {
                select.recv(w.receiver());
            }
            select.recv(self.shutdown.receiver());
            if select.ready_timeout(SCAN_INTERVAL).is_ok() {
                // Something changed (or a watch ended): drain, then scan.
                let ended = watchers.iter().any(|w| loop {
                    match w.recv_timeout(Duration::ZERO) {
                        Ok(Some(_)) => rescan = true,
                        Ok(None) => break false,
                        Err(_) => break true,
                    }
                });
                if ended {
                    watchers.clear();
                }
            }
        }
        drop(watchers);
        let deadline = Instant::now() + crate::config::DEFAULT_CSI_CALL_TIMEOUT;
        let left = std::mem::take(&mut self.workers).join_until(deadline);
        if !left.is_empty() {
            log::warn!(
                "controller host: still running at stop: {}",
                left.join(", ")
            );
        }
    }

    /// Writes this node's host record of each plugin whose controller side
    /// it serves, when it changed; true when it wrote one.
    fn announce(&mut self) -> bool {
        let mut wrote = false;
        for p in self.registry.list() {
            if !p.serves(PluginKind::Controller) || p.controller_capabilities.is_none() {
                continue;
            }
            let caps = p.controller_capabilities.as_ref();
            let rec = ControllerHostRecord {
                plugin_id: p.id.clone(),
                node: self.node.clone(),
                publish_unpublish_volume: caps.is_some_and(|c| c.publish_unpublish_volume),
                publish_readonly: caps.is_some_and(|c| c.publish_readonly),
                ready: p.health == crate::plugins::Health::Ready,
                updated_at_ms: 0,
                controller_capabilities: p.controller_capabilities.clone().unwrap_or_default(),
                plugin_capabilities: p.plugin_capabilities.clone().unwrap_or_default(),
            };
            if self.announced.get(&p.id) == Some(&rec) {
                continue;
            }
            let stamped = ControllerHostRecord {
                updated_at_ms: now_ms(),
                ..rec.clone()
            };
            match self.claims.put_controller_host(&stamped) {
                Ok(()) => {
                    log::info!(
                        "controller host: announced the controller of plugin {} (attaches: {}, ready: {})",
                        rec.plugin_id,
                        rec.publish_unpublish_volume,
                        rec.ready
                    );
                    self.announced.insert(p.id.clone(), rec);
                    wrote = true;
                }
                Err(e) => log::warn!(
                    "controller host: cannot announce the controller of plugin {}: {e}",
                    p.id
                ),
            }
        }
        wrote
    }

    /// Takes every pending request of a plugin this node hosts that no
    /// other host holds, each on its own worker thread.
    fn scan(&mut self, lease: LeaseId) -> Result<(), ClaimError> {
        let r = self
            .claims
            .client()
            .range_prefix(self.claims.attachments_prefix())
            .map_err(crate::claims::etcd::unavailable)?;
        for kv in &r.kvs {
            let rec = match parse_attachment(kv) {
                Ok(r) => r,
                Err(e) => {
                    log::warn!("controller host: {e} (left untouched)");
                    continue;
                }
            };
            let key = kv.key_str().into_owned();
            if rec.state != AttachState::Pending || self.busy.lock().contains(&key) {
                continue;
            }
            let plain = [
                ("volume", &rec.volume_id),
                ("node", &rec.node),
                ("plugin", &rec.plugin_id),
            ]
            .iter()
            .all(|(what, id)| crate::ids::check_id(what, id).is_ok());
            if !plain || key != self.claims.attachment_key(&rec.volume_id, &rec.node) {
                log::warn!(
                    "controller host: {key} does not name its own volume and node (left untouched)"
                );
                continue;
            }
            let Some(controller) = self
                .registry
                .get_ready(&rec.plugin_id, PluginKind::Controller)
                .filter(attaches)
            else {
                continue;
            };
            let lock = LockKey {
                key: self.claims.attachment_lock_key(&rec.volume_id, &rec.node),
                value: serde_json::json!({"host": self.node, "lease": lease.to_string()})
                    .to_string(),
            };
            match self.take_lock(&lock, lease) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    log::warn!("controller host: cannot lock {key}: {e}");
                    self.scan_again = true;
                    continue;
                }
            }
            self.busy.lock().insert(key.clone());
            let work = Work {
                claims: self.claims.clone(),
                node: self.node.clone(),
                key: key.clone(),
                lock,
                gives_epoch: self.epoch_plugins.contains(&rec.plugin_id),
                controller,
            };
            let busy = self.busy.clone();
            let spawned = self.workers.spawn(
                format!("attach-{}-{}", rec.volume_id, rec.node),
                move || {
                    work.perform();
                    busy.lock().remove(&work.key);
                },
            );
            if let Err(e) = spawned {
                log::warn!("controller host: cannot start a worker for {key}: {e}");
                self.busy.lock().remove(&key);
            }
        }
        self.scan_calls(lease)
    }

    /// Takes every pending forwarded call of a plugin this node hosts.
    fn scan_calls(&mut self, lease: LeaseId) -> Result<(), ClaimError> {
        let r = self
            .claims
            .client()
            .range_prefix(self.claims.controller_calls_prefix())
            .map_err(crate::claims::etcd::unavailable)?;
        let present: HashSet<String> = r.kvs.iter().map(|kv| kv.key_str().into_owned()).collect();
        self.finished_seen.retain(|k, _| present.contains(k));
        for kv in &r.kvs {
            let key = kv.key_str().into_owned();
            let rec = match parse_call(kv) {
                Ok(r) => r,
                Err(e) => {
                    log::warn!("controller host: {e} (left untouched)");
                    continue;
                }
            };
            if rec.state != AttachState::Pending {
                self.remove_finished(kv, &rec);
                continue;
            }
            if self.busy.lock().contains(&key) {
                continue;
            }
            let under_plugin = key
                .strip_prefix(&self.claims.controller_calls_prefix())
                .and_then(|rest| rest.split_once('/'))
                .is_some_and(|(p, _)| p == rec.plugin_id);
            if crate::ids::check_id("plugin", &rec.plugin_id).is_err() || !under_plugin {
                log::warn!("controller host: {key} does not name its own plugin (left untouched)");
                continue;
            }
            let Some(controller) = self
                .registry
                .get_ready(&rec.plugin_id, PluginKind::Controller)
            else {
                continue;
            };
            let lock = LockKey {
                key: self.claims.controller_call_lock_key(&key),
                value: serde_json::json!({"host": self.node, "lease": lease.to_string()})
                    .to_string(),
            };
            match self.take_lock(&lock, lease) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    log::warn!("controller host: cannot lock {key}: {e}");
                    self.scan_again = true;
                    continue;
                }
            }
            self.busy.lock().insert(key.clone());
            let work = Work {
                claims: self.claims.clone(),
                node: self.node.clone(),
                key: key.clone(),
                lock,
                gives_epoch: false,
                controller,
            };
            let busy = self.busy.clone();
            let spawned = self
                .workers
                .spawn(format!("call-{}", rec.plugin_id), move || {
                    work.perform_call();
                    busy.lock().remove(&work.key);
                });
            if let Err(e) = spawned {
                log::warn!("controller host: cannot start a worker for {key}: {e}");
                self.busy.lock().remove(&key);
            }
        }
        Ok(())
    }

    /// Removes a finished call its requester left behind, once it was seen
    /// finished for longer than its retention (only that very version).
    fn remove_finished(&mut self, kv: &KeyValue, rec: &ControllerCallRecord) {
        let key = kv.key_str().into_owned();
        let since = *self
            .finished_seen
            .entry(key.clone())
            .or_insert_with(Instant::now);
        if since.elapsed() < rec.retention() {
            return;
        }
        let same = Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision);
        match self
            .claims
            .client()
            .txn(&[same], &[TxnOp::delete(key.clone())], &[])
        {
            Ok(_) => {
                log::info!("controller host: removed the finished call {key} its requester left");
                self.finished_seen.remove(&key);
            }
            Err(e) => log::info!("controller host: finished call {key} not removed yet: {e}"),
        }
    }

    /// Takes the request's lock on this node's lease: a free lock, or one
    /// this node held under an earlier lease (before a restart).
    fn take_lock(&self, lock: &LockKey, lease: LeaseId) -> Result<bool, ClaimError> {
        let client = self.claims.client();
        let unavailable = crate::claims::etcd::unavailable;
        let put = TxnOp::put_with_lease(lock.key.clone(), lock.value.clone(), lease);
        let t = client
            .txn(
                &[Compare::absent(lock.key.clone())],
                std::slice::from_ref(&put),
                &[TxnOp::get(lock.key.clone())],
            )
            .map_err(unavailable)?;
        if t.succeeded {
            return Ok(true);
        }
        let Some(held) = t.first_range().and_then(|r| r.kvs.first()) else {
            return Ok(false);
        };
        if held_by(held) != Some(self.node.clone()) {
            return Ok(false);
        }
        if held.lease == Some(lease) {
            // This node's, under its current lease, and no worker of it is
            // on the request (the caller checked): left behind by a worker
            // whose unlock failed. Taken back as it is.
            return Ok(held.value == lock.value.as_bytes());
        }
        let same = Compare::mod_revision(lock.key.clone(), CompareOp::Equal, held.mod_revision);
        Ok(client
            .txn(&[same], &[put], &[])
            .map_err(unavailable)?
            .succeeded)
    }
}

fn held_by(kv: &KeyValue) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&kv.value).ok()?;
    v["host"].as_str().map(str::to_string)
}

fn attaches(c: &PluginSnapshot) -> bool {
    c.controller_capabilities
        .as_ref()
        .is_some_and(|caps| caps.publish_unpublish_volume)
}

/// A request lock as this host wrote it.
struct LockKey {
    key: String,
    value: String,
}

/// One request, performed on a worker thread.
struct Work {
    claims: Arc<EtcdClaims>,
    node: String,
    key: String,
    lock: LockKey,
    /// The plugin asked for the claim's epoch (`cluster.epoch_plugins`).
    gives_epoch: bool,
    controller: PluginSnapshot,
}

impl Work {
    fn perform(&self) {
        if let Err(e) = self.try_perform() {
            log::warn!("controller host: {}: {e}", self.key);
            self.unlock();
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
    /// request is as it was read and the lock is still this host's.
    fn finish(&self, read: &KeyValue, done: TxnOp) -> Result<(), ClaimError> {
        let t = self
            .claims
            .client()
            .txn(
                &[
                    Compare::mod_revision(self.key.clone(), CompareOp::Equal, read.mod_revision),
                    Compare::value(
                        self.lock.key.clone(),
                        CompareOp::Equal,
                        self.lock.value.clone(),
                    ),
                ],
                &[done, TxnOp::delete(self.lock.key.clone())],
                &[],
            )
            .map_err(crate::claims::etcd::unavailable)?;
        if !t.succeeded {
            log::info!(
                "controller host: {} changed or was withdrawn while it was performed; not answered",
                self.key
            );
            self.unlock();
        }
        Ok(())
    }

    fn try_perform(&self) -> Result<(), ClaimError> {
        let Some(kv) = self.read_again()? else {
            return Ok(());
        };
        let mut rec = parse_attachment(&kv)?;
        if rec.state != AttachState::Pending {
            self.unlock();
            return Ok(());
        }
        // The fencing token: nothing is attached for a claim that is gone
        // or newer (a request from a node the cluster fenced meanwhile).
        let refused = match rec.want {
            Want::Attached => self.claim_gone(&rec)?,
            Want::Detached => None,
        };
        let mut result = match refused {
            Some(why) => Err((why, false)),
            None => self.call(&rec),
        };
        if let (Want::Attached, Ok(_)) = (&rec.want, &result) {
            if let Some(why) = self.claim_gone(&rec)? {
                // Gone during the call: undone before anything is recorded.
                let undo = AttachmentRecord {
                    want: Want::Detached,
                    ..rec.clone()
                };
                let undone = match self.call(&undo) {
                    Ok(_) => "detached again".to_string(),
                    Err((e, _)) => format!("the detach failed too: {e}"),
                };
                log::warn!(
                    "controller host: volume {} attached to node {} for a claim that went meanwhile: {undone}",
                    rec.volume_id,
                    rec.node
                );
                result = Err((format!("{why} ({undone})"), false));
            }
        }
        rec.handled_by = Some(self.node.clone());
        rec.updated_at_ms = now_ms();
        let done_op = match (&rec.want, result) {
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
                put(&self.key, &rec)
            }
            (Want::Detached, Ok(_)) => {
                log::info!(
                    "controller host: detached volume {} from node {} (node ID {})",
                    rec.volume_id,
                    rec.node,
                    rec.external_node_id
                );
                TxnOp::delete(self.key.clone())
            }
            (_, Err((error, retryable))) => {
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
                rec.retryable = retryable;
                put(&self.key, &rec)
            }
        };
        self.finish(&kv, done_op)
    }

    /// Why the claim an attach request is for no longer holds (None: it
    /// does): `claims/<volume>/<alloc>` must exist for the requesting node
    /// with the request's epoch as its create revision. Requests without an
    /// epoch (older agents) are not checked.
    fn claim_gone(&self, rec: &AttachmentRecord) -> Result<Option<String>, ClaimError> {
        if rec.epoch == 0 || rec.alloc_id.is_empty() {
            return Ok(None);
        }
        let key = format!(
            "{}/claims/{}/{}",
            self.claims.prefix(),
            rec.volume_id,
            rec.alloc_id
        );
        let kv = self
            .claims
            .client()
            .get(&key)
            .map_err(crate::claims::etcd::unavailable)?;
        let holds = kv.as_ref().is_some_and(|kv| {
            kv.create_revision == rec.epoch
                && crate::claims::etcd::parse(kv).is_ok_and(|c| c.claim.node == rec.node)
        });
        Ok((!holds).then(|| {
            format!(
                "the claim of allocation {} on node {} with epoch {} is gone or newer (freed, or fenced): not attached",
                rec.alloc_id, rec.node, rec.epoch
            )
        }))
    }

    /// The controller call; the publish context, or the error and whether
    /// asking again can help.
    fn call(&self, rec: &AttachmentRecord) -> Result<BTreeMap<String, String>, (String, bool)> {
        let spec = match self.claims.get(&rec.volume_id) {
            Ok(Some(spec)) => spec,
            Ok(None) => {
                return Err((
                    format!("volume {} is not registered in the cluster", rec.volume_id),
                    false,
                ))
            }
            Err(e) => return Err((e.to_string(), true)),
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
                    .map_err(|e| (crate::error_chain(&e), e.is_retryable()))
            }
            Want::Detached => {
                match client
                    .controller_unpublish_volume(&requests::controller_unpublish(vref, Some(&spec)))
                {
                    Err(e) if !e.is_ignorable() => Err((crate::error_chain(&e), e.is_retryable())),
                    _ => Ok(BTreeMap::new()),
                }
            }
        }
    }

    fn perform_call(&self) {
        if let Err(e) = self.try_perform_call() {
            log::warn!("controller host: {}: {e}", self.key);
            self.unlock();
        }
    }

    fn try_perform_call(&self) -> Result<(), ClaimError> {
        let Some(kv) = self.read_again()? else {
            return Ok(());
        };
        let mut rec = parse_call(&kv)?;
        if rec.state != AttachState::Pending {
            self.unlock();
            return Ok(());
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
        let invalid = |why: String| (why, grpcio::RpcStatusCode::INVALID_ARGUMENT, false);
        let result = match (
            crate::csi::forwarded_method(&rec.method),
            from_hex(&rec.request_hex),
        ) {
            (None, _) => Err(invalid(format!("{} is not a forwarded method", rec.method))),
            (_, None) => Err(invalid("the request is not hex".to_string())),
            (Some(m), Some(bytes)) => self
                .controller
                .client
                .forward_controller_call(m, &bytes)
                .map_err(|e| {
                    (
                        crate::error_chain(&e),
                        e.code().unwrap_or(grpcio::RpcStatusCode::UNKNOWN),
                        e.is_retryable(),
                    )
                }),
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
            Err((error, code, retryable)) => {
                log::warn!(
                    "controller host: {} of plugin {} for node {} failed: {error}",
                    rec.method,
                    rec.plugin_id,
                    rec.requested_by
                );
                rec.state = AttachState::Failed;
                rec.error = Some(error);
                rec.code = code.into();
                rec.retryable = retryable;
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
