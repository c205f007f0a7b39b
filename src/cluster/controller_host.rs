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
//! still this host's (`host_work`).
//!
//! The host works from the watch's events: a pending request's event
//! carries the request, so taking it costs the lock's `Txn` alone. It reads
//! every request (a scan) only when the events cannot tell: at start, with
//! a new lease, when a watch broke or went stale, when a lock went without
//! its request being answered (a host's lease ended), when a worker could
//! not answer, and for forwarded calls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::host_work::{claim_key, LockKey, Prefetch, Work};
use super::liveness::NodeLiveness;
use crate::claims::controller_calls::{parse_call, ControllerCallRecord};
use crate::claims::remote::{now_ms, parse_attachment, AttachState, ControllerHostRecord};
use crate::claims::{ClaimError, EtcdClaims};
use crate::etcd::{prefix_end, Compare, CompareOp, KeyValue, LeaseId, TxnOp, WatchEvent, Watcher};
use crate::plugins::{PluginKind, PluginSnapshot, Registry};
use crate::shutdown::Shutdown;
use crate::threads::Threads;

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
            unanswered: Arc::new(AtomicBool::new(false)),
            deferred: HashMap::new(),
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
    /// A worker ended without answering its request (an error, or the
    /// request changed or went meanwhile): scan again.
    unanswered: Arc<AtomicBool>,
    /// Pending requests whose event came while a worker of this host was
    /// on them (the latest version of each): looked at once it is done.
    deferred: HashMap<String, KeyValue>,
}

impl Host {
    /// Works from the watches' events; reads every request (`scan`) only
    /// when they cannot tell (see the module's docs), and every
    /// `SCAN_INTERVAL` while a watch is missing or not fresh. An idle host
    /// costs its watches' progress requests, not a full read a second.
    fn run(mut self) {
        let mut watchers: Vec<Watcher> = Vec::new();
        let mut rescan = true;
        let mut scanned_lease = None;
        let mut events: Vec<WatchEvent> = Vec::new();
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
            self.workers.reap();
            if self.unanswered.swap(false, Ordering::SeqCst) {
                rescan = true;
            }
            if watchers.len() < 2 {
                // Requests and their locks (`attachment…`), forwarded calls
                // and theirs (`controller-call…`), from now: the scan
                // below reads what is there.
                let keys = self.claims.keys();
                watchers = [keys.attachment_range(), keys.controller_call_range()]
                    .iter()
                    .filter_map(|prefix| {
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
                || self.events_need_scan(&events)
            {
                rescan = true;
            }
            if let (true, Some(lease)) = (rescan, lease) {
                self.scan_again = false;
                events.clear();
                self.deferred.clear();
                match self.scan(lease) {
                    Ok(()) => {
                        rescan = false;
                        scanned_lease = Some(lease);
                    }
                    Err(e) => log::warn!("controller host: cannot read the attach requests: {e}"),
                }
            } else if let Some(lease) = lease {
                // Pending requests, from their events' contents, and those
                // that waited for a worker of this host.
                let busy = self.busy.lock().clone();
                let free: Vec<String> = self
                    .deferred
                    .keys()
                    .filter(|k| !busy.contains(*k))
                    .cloned()
                    .collect();
                for key in free {
                    if let Some(kv) = self.deferred.remove(&key) {
                        self.consider(&kv, lease);
                    }
                }
                let requests = self.claims.attachments_prefix();
                for ev in std::mem::take(&mut events) {
                    match ev {
                        WatchEvent::Put(kv) if kv.key.starts_with(requests.as_bytes()) => {
                            self.consider(&kv, lease)
                        }
                        WatchEvent::Delete(kv) => {
                            self.deferred.remove(kv.key_str().as_ref());
                        }
                        _ => {}
                    }
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
                // Something changed (or a watch ended): drain.
                let ended = watchers.iter().any(|w| loop {
                    match w.recv_timeout(Duration::ZERO) {
                        Ok(Some(ev)) => events.push(ev),
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

    /// Whether events say something a request's own event does not: a
    /// forwarded call changed, or a request's lock went without its
    /// request changing at that revision (a host's lease ended, or a
    /// worker let go without answering).
    fn events_need_scan(&self, events: &[WatchEvent]) -> bool {
        let requests = self.claims.keys().attachments();
        let locks = self.claims.keys().attachment_locks();
        let changed: HashSet<(String, i64)> = events
            .iter()
            .filter_map(|ev| match ev {
                WatchEvent::Put(kv) | WatchEvent::Delete(kv) => {
                    let key = kv.key_str();
                    key.strip_prefix(&requests)
                        .map(|rest| (rest.to_string(), kv.mod_revision))
                }
                WatchEvent::Progress { .. } => None,
            })
            .collect();
        events.iter().any(|ev| match ev {
            WatchEvent::Put(kv) => {
                let key = kv.key_str();
                !key.starts_with(&requests) && !key.starts_with(&locks)
            }
            WatchEvent::Delete(kv) => {
                let key = kv.key_str();
                match key.strip_prefix(&locks) {
                    Some(rest) => !changed.contains(&(rest.to_string(), kv.mod_revision)),
                    None => !key.starts_with(&requests),
                }
            }
            WatchEvent::Progress { .. } => false,
        })
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
                csi_call_timeout_ms: Some(self.registry.call_timeout().as_millis() as u64),
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
            self.consider(kv, lease);
        }
        self.scan_calls(lease)
    }

    /// Takes one request, as read or as its event showed it, when it is
    /// pending, of a plugin this node hosts, and no other host holds it.
    fn consider(&mut self, kv: &KeyValue, lease: LeaseId) {
        let rec = match parse_attachment(kv) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("controller host: {e} (left untouched)");
                return;
            }
        };
        let key = kv.key_str().into_owned();
        if rec.state != AttachState::Pending {
            self.deferred.remove(&key);
            return;
        }
        if self.busy.lock().contains(&key) {
            self.deferred.insert(key, kv.clone());
            return;
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
            return;
        }
        let Some(controller) = self
            .registry
            .get_ready(&rec.plugin_id, PluginKind::Controller)
            .filter(attaches)
        else {
            return;
        };
        let lock = LockKey {
            key: self.claims.attachment_lock_key(&rec.volume_id, &rec.node),
            value: serde_json::json!({"host": self.node, "lease": lease.to_string()}).to_string(),
        };
        let claim = claim_key(&self.claims, &rec);
        let pre = match self.lock_request(&lock, lease, kv, claim.as_deref()) {
            Ok(Some(pre)) => pre,
            Ok(None) => return,
            Err(e) => {
                log::warn!("controller host: cannot lock {key}: {e}");
                self.scan_again = true;
                return;
            }
        };
        self.busy.lock().insert(key.clone());
        let work = Work {
            claims: self.claims.clone(),
            node: self.node.clone(),
            key: key.clone(),
            lock,
            gives_epoch: self.epoch_plugins.contains(&rec.plugin_id),
            controller,
        };
        let (busy, unanswered) = (self.busy.clone(), self.unanswered.clone());
        let spawned = self.workers.spawn(
            format!("attach-{}-{}", rec.volume_id, rec.node),
            move || {
                let answered = work.perform(pre);
                busy.lock().remove(&work.key);
                if !answered {
                    unanswered.store(true, Ordering::SeqCst);
                }
            },
        );
        if let Err(e) = spawned {
            log::warn!("controller host: cannot start a worker for {key}: {e}");
            self.busy.lock().remove(&key);
            self.scan_again = true;
        }
    }

    /// Takes a request's lock while the request is still as `kv` shows it,
    /// reading the claim it is for (`claim`) and the volume's registration
    /// in the same `Txn`. Some(Some(..)): locked, with what was read;
    /// Some(None): this node's lock from before a restart, taken back (the
    /// worker reads again); None: not this host's to perform (held by
    /// another, or the request changed: its next version has its own
    /// event).
    fn lock_request(
        &self,
        lock: &LockKey,
        lease: LeaseId,
        kv: &KeyValue,
        claim: Option<&str>,
    ) -> Result<Option<Option<Prefetch>>, ClaimError> {
        let rec_volume = parse_attachment(kv)?.volume_id;
        let mut success = vec![
            TxnOp::put_with_lease(lock.key.clone(), lock.value.clone(), lease),
            TxnOp::get(self.claims.volume_key(&rec_volume)),
        ];
        if let Some(c) = claim {
            success.push(TxnOp::get(c.to_string()));
        }
        let t = self
            .claims
            .client()
            .txn(
                &[
                    Compare::absent(lock.key.clone()),
                    Compare::mod_revision(kv.key.clone(), CompareOp::Equal, kv.mod_revision),
                ],
                &success,
                &[TxnOp::get(lock.key.clone())],
            )
            .map_err(crate::claims::etcd::unavailable)?;
        if t.succeeded {
            let mut ranges = t.responses.iter().filter_map(|r| match r {
                crate::etcd::TxnOpResponse::Range(r) => Some(r.kvs.first().cloned()),
                _ => None,
            });
            let spec = ranges.next().flatten();
            let claim = claim.map(|_| ranges.next().flatten());
            return Ok(Some(Some(Prefetch {
                request: kv.clone(),
                claim,
                spec,
            })));
        }
        let held = t.first_range().and_then(|r| r.kvs.first()).cloned();
        match held {
            // The request changed; the lock is free.
            None => Ok(None),
            Some(held) => Ok(self.take_back(lock, lease, &held)?.then_some(None)),
        }
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
            let (busy, unanswered) = (self.busy.clone(), self.unanswered.clone());
            let spawned = self
                .workers
                .spawn(format!("call-{}", rec.plugin_id), move || {
                    let answered = work.perform_call();
                    busy.lock().remove(&work.key);
                    if !answered {
                        unanswered.store(true, Ordering::SeqCst);
                    }
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
            Ok(t) if t.succeeded => {
                log::info!("controller host: removed the finished call {key} its requester left");
                self.finished_seen.remove(&key);
            }
            // Changed since it was read: the next scan looks at it again.
            Ok(_) => {
                self.finished_seen.remove(&key);
            }
            Err(e) => log::info!("controller host: finished call {key} not removed yet: {e}"),
        }
    }

    /// Takes the request's lock on this node's lease: a free lock, or one
    /// this node held under an earlier lease (before a restart).
    fn take_lock(&self, lock: &LockKey, lease: LeaseId) -> Result<bool, ClaimError> {
        let put = TxnOp::put_with_lease(lock.key.clone(), lock.value.clone(), lease);
        let t = self
            .claims
            .client()
            .txn(
                &[Compare::absent(lock.key.clone())],
                std::slice::from_ref(&put),
                &[TxnOp::get(lock.key.clone())],
            )
            .map_err(crate::claims::etcd::unavailable)?;
        if t.succeeded {
            return Ok(true);
        }
        match t.first_range().and_then(|r| r.kvs.first()) {
            Some(held) => self.take_back(lock, lease, held),
            None => Ok(false),
        }
    }

    /// Takes back a lock `held` as read: only one of this node's, and with
    /// no worker of it on the request (the caller checked).
    fn take_back(
        &self,
        lock: &LockKey,
        lease: LeaseId,
        held: &KeyValue,
    ) -> Result<bool, ClaimError> {
        if held_by(held) != Some(self.node.clone()) {
            return Ok(false);
        }
        if held.lease == Some(lease) {
            // This node's, under its current lease: left behind by a
            // worker whose unlock failed. Taken back as it is.
            return Ok(held.value == lock.value.as_bytes());
        }
        let put = TxnOp::put_with_lease(lock.key.clone(), lock.value.clone(), lease);
        let same = Compare::mod_revision(lock.key.clone(), CompareOp::Equal, held.mod_revision);
        Ok(self
            .claims
            .client()
            .txn(&[same], &[put], &[])
            .map_err(crate::claims::etcd::unavailable)?
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
