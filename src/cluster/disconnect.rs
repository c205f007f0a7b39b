//! The disconnect rule (`cluster.stop_after_disconnect`, off by default,
//! like Nomad's `stop_on_client_disconnect`), on two named threads of every
//! agent, so that neither waits behind the other:
//!
//! - **`self-release`** (this node, when the rule is set here): once the
//!   last keep-alive etcd answered was *sent* longer ago than the window
//!   (CLOCK_BOOTTIME, persisted across restarts of this boot by
//!   `claims::fencing`, so a restart does not reset it), it releases every
//!   allocation itself. Until this run registers, the window is no longer
//!   than the settings this node last published allow
//!   (`claims::published`: a restart with a larger one while cut off).
//!   The node side (NodeUnpublish, NodeUnstage) is done
//!   at once; the controller detach and the claims follow when etcd
//!   answers again.
//! - **`reaper`** (other nodes): each node writes its settings to
//!   `<prefix>/node-settings/<node>` (durable, with each registration of its
//!   liveness: `settings_entry`): its window D, its longest unmount U and its
//!   check period τ. An observer counts a node's absence only from fresh
//!   observations (its own lease valid, its reads answered, no gap longer
//!   than a few periods between two of them); once the node has been seen
//!   gone for `W = margins::observer_wait(D, U, τ)`, the agent that takes
//!   `<prefix>/reaper-locks/<node>` (a `Txn` on its own lease: exactly one at
//!   a time; an ambiguous answer is settled by reading the lock) acts on the
//!   node's volumes by `fencing::FreeRule::Cluster`: a volume fenced from the
//!   node (ControllerUnpublish of a plugin in `cluster.fencing_plugins`) is
//!   detached, then its claims are freed (a `freed/` note each); a volume
//!   nothing can fence stays claimed, shown as held by an unreachable node,
//!   unless the cluster opted in (`cluster.free_unfenced_claims`).
//!
//! A node without the rule keeps its claims and mounts however long it is
//! cut off.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::liveness::NodeLiveness;
use super::view::{NodeSettings, NodeView, NodesSnapshot};
use crate::claims::etcd::keys::NodeKey;
use crate::claims::etcd::unavailable;
use crate::claims::fencing::{Fencing, FreeRule};
use crate::claims::margins::{self, ReleaseBounds};
use crate::claims::{ClaimError, EtcdClaims};
use crate::etcd::{Compare, LeaseId, TxnOp};
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// How old the node view may be for the reaper to use it instead of
/// reading etcd (the watch asks for progress every `AUTO_PROGRESS`).
const VIEW_FRESH: Duration = Duration::from_secs(6);
/// Backoff of looking again at a gone node whose claims were all kept (or
/// that held none).
const REAP_QUIET_FIRST: Duration = Duration::from_secs(2);
const REAP_QUIET_MAX: Duration = Duration::from_secs(60);

/// What the log and the release say of allocations released by the rule.
pub const DISCONNECT_RELEASE_REASON: &str = "released while disconnected";

/// The durable key and value of this node's settings, written with each
/// registration of its liveness.
pub fn settings_entry(
    prefix: &str,
    node: &str,
    bounds: &ReleaseBounds,
    csi_call: Duration,
) -> (String, Vec<u8>) {
    let value = NodeSettings {
        stop_after_disconnect_ms: bounds.window_ms,
        unmount_bound_ms: Some(bounds.unmount_bound_ms),
        check_period_ms: Some(bounds.check_period_ms),
        claim_index: true,
        csi_call_timeout_ms: Some(csi_call.as_millis() as u64),
    };
    (
        crate::claims::etcd::Keys::new(prefix).settings(node),
        serde_json::to_vec(&value).expect("settings always encode"),
    )
}

pub struct DisconnectRule {
    threads: Mutex<Option<Threads>>,
}

/// What the self-release needs; started before the restore, so that a
/// restart during a partition keeps counting from the last renewal.
pub struct SelfReleaseParts {
    pub lifecycle: Lifecycle,
    pub fencing: Arc<Fencing>,
    /// Whether the node rebooted since the state was written (nothing of
    /// the records is mounted then).
    pub rebooted: bool,
    /// This node's own `stop_after_disconnect`.
    pub window: Option<Duration>,
    pub lease_ttl: Duration,
    pub shutdown: Shutdown,
}

/// What the reaper needs to run.
pub struct RuleParts {
    pub claims: Arc<EtcdClaims>,
    pub liveness: Arc<NodeLiveness>,
    pub node: String,
    pub lease_ttl: Duration,
    pub call_timeout: Duration,
    pub attach_timeout: Duration,
    pub fencing_plugins: Vec<String>,
    pub free_unfenced: bool,
    /// This cluster's CSI call deadline: how long a ControllerPublish sent
    /// before a fence may still land.
    pub csi_call: Duration,
    pub shutdown: Shutdown,
}

impl DisconnectRule {
    /// Starts the self-release (when the window is set here). Call before
    /// the restore; `start_reaper` adds the reaper after it.
    pub fn start_self_release(parts: SelfReleaseParts) -> std::io::Result<DisconnectRule> {
        let mut threads = Threads::new();
        // Started when the node has a window, or when what it published
        // has one (a window turned off while cut off: the cluster still
        // acts by the published one until this run registers).
        if parts.window.is_some() || parts.fencing.window().is_some() {
            let every = margins::self_release_period(parts.lease_ttl);
            let mut me = SelfRelease {
                started: Instant::now(),
                released: false,
                waited_for_registration: false,
                parts,
            };
            threads.spawn("self-release", move || {
                me.tick();
                while me.parts.shutdown.sleep(every) {
                    me.tick();
                }
            })?;
        }
        Ok(DisconnectRule {
            threads: Mutex::new(Some(threads)),
        })
    }

    /// Starts the reaper of other nodes' claims.
    pub fn start_reaper(&self, parts: RuleParts) -> std::io::Result<()> {
        let every = (parts.lease_ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(2));
        // Two observations further apart than this are not one watch.
        let max_gap = every * 3 + parts.call_timeout * 2;
        let mut guard = self.threads.lock();
        let threads = guard.get_or_insert_with(Threads::new);
        // This node's own liveness key deleted while its lease lives (by
        // hand): written again on the same lease, before the other nodes'
        // reapers could count this node as gone for long.
        // (Asked whatever this node's clock says of its lease: the
        // liveness thread acts only while it holds one.)
        let fencing = parts.claims.fencing().cloned();
        let own_gone = move || {
            if let Some(f) = fencing.as_ref().filter(|f| f.registered_lease().is_some()) {
                log::warn!("cluster: this node's liveness key is gone while this agent holds a lease: writing it again");
                f.ask_reregistration();
            }
        };
        let view = NodeView::start(
            parts.claims.client().clone(),
            parts.claims.keys().clone(),
            (parts.node.clone(), Box::new(own_gone)),
            parts.shutdown.clone(),
            threads,
        )?;
        let mut reaper = Reaper {
            view,
            parts,
            gone_since: HashMap::new(),
            last_observation: None,
            kept_reported: HashSet::new(),
            quiet: HashMap::new(),
            max_gap,
        };
        threads.spawn("reaper", move || {
            while reaper.parts.shutdown.sleep(every) {
                reaper.tick();
            }
        })
    }

    /// Joins the threads (after the stop was triggered) up to `deadline`.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        self.threads
            .lock()
            .take()
            .map(|t| t.join_until(deadline))
            .unwrap_or_default()
    }
}

struct SelfRelease {
    parts: SelfReleaseParts,
    started: Instant,
    /// This node released its allocations during the current disconnect.
    released: bool,
    /// The wait for this run's registration, before a release by a window
    /// that published settings cut short, was done.
    waited_for_registration: bool,
}

impl SelfRelease {
    /// The lease clock is unknown on this boot (`lease-clock.json` missing
    /// or unreadable): before the node counts as cut off since forever,
    /// its first registration may answer (bounded by the lease TTL, the
    /// registration's two calls at `call_timeout` each at most): once
    /// registered, the renewal clock is known and the claims the cluster
    /// freed meanwhile are released by the reconciliation. Without an
    /// answer, everything is released as before, one TTL later.
    fn wait_for_registration(&self) {
        if self
            .parts
            .fencing
            .wait_registered(self.parts.lease_ttl, &self.parts.shutdown)
        {
            log::info!(
                "cluster: self-release: this node's lease clock was not known on this boot; it registered, so the window counts from its renewals"
            );
        }
    }

    /// The window this node goes by now: the one the settings etcd may
    /// hold allow until this run registered (`Fencing::window`). After a
    /// reboot nothing of the records is mounted and no call up goes out
    /// before etcd confirms its claim, so the node's own window counts
    /// (from this run's start) whatever it published.
    fn window(&self) -> Option<Duration> {
        if self.parts.rebooted {
            return self.parts.window;
        }
        self.parts.fencing.window()
    }

    /// How long since the last answered renewal's send: from the lease
    /// clock (this run or the previous one of this boot). Unknown on this
    /// boot (the file missing or unreadable): as long ago as can be, since
    /// the cluster may have counted from long before; after a reboot,
    /// nothing is mounted, calls up wait for etcd, and this run's start
    /// counts.
    fn since_renewal(&self) -> Duration {
        match self.parts.fencing.since_last_sent() {
            Some(d) => d,
            None if self.parts.rebooted => self.started.elapsed(),
            None => Duration::MAX,
        }
    }

    fn tick(&mut self) {
        if self.parts.fencing.since_last_sent().is_none() && !self.parts.rebooted {
            self.wait_for_registration();
            // Waited for once: not again below.
            self.waited_for_registration = true;
        }
        let mut ago = self.since_renewal();
        let Some(mut window) = self.window() else {
            self.released = false;
            return;
        };
        if ago < window {
            self.released = false;
            return;
        }
        if Some(window) != self.parts.window && !self.waited_for_registration {
            // Cut short by settings this node published before (a longer
            // csi_call_timeout can leave no window at all): a restart
            // after a config change usually finds etcd answering at once,
            // so its registration, which publishes this node's own
            // settings, is waited for up to one lease TTL before
            // everything is released (safety.md, rule 11).
            self.waited_for_registration = true;
            self.wait_for_registration();
            ago = self.since_renewal();
            match self.window() {
                Some(w) if ago >= w => window = w,
                _ => {
                    self.released = false;
                    return;
                }
            }
        }
        if self.released {
            return;
        }
        self.released = true;
        let lifecycle = &self.parts.lifecycle;
        let allocs: Vec<String> = lifecycle
            .list_allocs()
            .into_iter()
            .filter(|a| !a.releasing)
            .map(|a| a.id)
            .collect();
        if allocs.is_empty() {
            return;
        }
        let ago = if ago == Duration::MAX {
            "not known since boot".to_string()
        } else {
            format!("{ago:?} ago")
        };
        log::warn!(
            "cluster: this node's lease was last renewed {ago} (stop_after_disconnect {window:?}{}): {DISCONNECT_RELEASE_REASON}: releasing {} allocation(s): {}",
            if Some(window) == self.parts.window {
                ""
            } else {
                ", as the settings this node last published allow"
            },
            allocs.len(),
            allocs.join(", ")
        );
        for a in allocs {
            match lifecycle.release(&a) {
                Ok(_) => log::warn!("allocation {a}: {DISCONNECT_RELEASE_REASON} from etcd"),
                Err(e) => log::error!("allocation {a}: cannot be released: {e}"),
            }
        }
    }
}

/// A node seen without its liveness key.
#[derive(Clone, Copy, Debug)]
struct Absence {
    /// When this agent first saw it gone (its clock, fresh observations
    /// only).
    since: Instant,
    /// The mod revision of the node's settings then. Every registration
    /// writes them again, so the reaper lock and every write of the reap
    /// compare it: a node that registered again since (even unseen,
    /// between two observations or during another node's reap) is never
    /// acted on by this count.
    registered_at: i64,
}

struct Reaper {
    parts: RuleParts,
    /// The other nodes, as a watch keeps them.
    view: NodeView,
    /// Nodes seen without a liveness key (fresh observations only).
    gone_since: HashMap<String, Absence>,
    last_observation: Option<Instant>,
    /// (node, volume) kept claimed and already said so in the log.
    kept_reported: HashSet<(String, String)>,
    /// Gone nodes with nothing to do at the last reap: when to look again,
    /// and the current backoff.
    quiet: HashMap<String, (Instant, Duration)>,
    max_gap: Duration,
}

impl Reaper {
    /// Forgets every absence: counting starts again at the next fresh
    /// observation.
    fn lose_sight(&mut self, why: &str) {
        if !self.gone_since.is_empty() {
            log::info!("cluster: reaper: absences counted again from the next observation: {why}");
        }
        self.gone_since.clear();
        self.last_observation = None;
    }

    fn tick(&mut self) {
        let fencing = self.parts.claims.fencing().cloned();
        let lease = self.parts.liveness.status().lease;
        let valid = fencing.as_ref().map_or(lease, |f| f.valid_lease());
        let Some(lease) = valid.filter(|v| Some(*v) == lease) else {
            self.lose_sight("this node's own lease is not valid");
            return;
        };
        if let Err(e) = self.other_nodes(lease) {
            self.lose_sight("etcd did not answer");
            log::warn!("cluster: reaper: cannot look at the other nodes: {e}");
        }
    }

    /// Every node's settings and the nodes alive: from the node view while
    /// its watch is fresh (no read), else read from etcd (two Ranges).
    fn observe(&self) -> Result<NodesSnapshot, ClaimError> {
        if let Some(v) = self.view.fresh(VIEW_FRESH) {
            return Ok(v);
        }
        let claims = &self.parts.claims;
        let settings = claims
            .client()
            .range_prefix(claims.keys().settings_all())
            .map_err(unavailable)?;
        let mut out = NodesSnapshot::default();
        for kv in &settings.kvs {
            if let Some(NodeKey::Settings(node)) = claims.keys().parse_node(&kv.key_str()) {
                out.set_settings(&node, kv);
            }
        }
        out.alive = claims.alive_nodes()?;
        Ok(out)
    }

    fn other_nodes(&mut self, lease: LeaseId) -> Result<(), ClaimError> {
        let seen = self.observe()?;
        let mut waits = BTreeMap::new();
        for (node, s) in &seen.settings {
            if *node != self.parts.node {
                if let Some(w) = s.observer_wait() {
                    waits.insert(node.clone(), w);
                }
            }
        }
        let unreachable = &self.parts.liveness.unreachable;
        if waits.is_empty() {
            self.gone_since.clear();
            unreachable.retain_nodes(|_| false);
            return Ok(());
        }
        let alive = seen.alive;
        unreachable.retain_nodes(|n| waits.contains_key(n) && !alive.contains(n));
        let now = Instant::now();
        // An observer that was stuck (a slow reap, a descheduled process)
        // saw nothing in between: it does not count that time.
        if let Some(last) = self.last_observation {
            if now.duration_since(last) > self.max_gap {
                self.lose_sight("too long since the last observation");
            }
        }
        self.last_observation = Some(now);
        self.gone_since
            .retain(|n, _| waits.contains_key(n) && !alive.contains(n));
        self.quiet.retain(|n, _| self.gone_since.contains_key(n));
        self.kept_reported.retain(|(n, _)| !alive.contains(n));
        for (node, wait) in waits {
            if alive.contains(&node) {
                continue;
            }
            let Some(&registered_at) = seen.registered_at.get(&node) else {
                continue;
            };
            let absence = self.gone_since.entry(node.clone()).or_insert(Absence {
                since: now,
                registered_at,
            });
            if absence.registered_at != registered_at {
                // Back and gone again between two observations.
                log::info!(
                    "cluster: reaper: node {node} registered again since it was first seen gone: its absence is counted again from now"
                );
                *absence = Absence {
                    since: now,
                    registered_at,
                };
                self.quiet.remove(&node);
            }
            let absence = *absence;
            if absence.since.elapsed() < wait
                || self.quiet.get(&node).is_some_and(|(next, _)| now < *next)
            {
                continue;
            }
            if self.reap(&node, wait, absence, lease)? {
                // Nothing this agent can do for that node now: looked at
                // again less and less often (up to REAP_QUIET_MAX), so a
                // node gone for good costs no full read of the claims on
                // every tick.
                let b = self
                    .quiet
                    .get(&node)
                    .map_or(REAP_QUIET_FIRST, |(_, b)| (*b * 2).min(REAP_QUIET_MAX));
                self.quiet.insert(node, (Instant::now() + b, b));
            } else {
                self.quiet.remove(&node);
            }
        }
        Ok(())
    }

    /// Takes the node's reaper lock: true when this agent holds it (also
    /// when an earlier take of this agent left it, or its answer was lost)
    /// while the node's liveness key is absent and it has not registered
    /// since `registered_at`. All are compared in one `Txn`, so the
    /// decision is linearizable even when the absence was seen through a
    /// watch, or long ago.
    fn lock(
        &self,
        node: &str,
        registered_at: i64,
        lock: &str,
        me: &str,
        lease: LeaseId,
    ) -> Result<bool, ClaimError> {
        let client = self.parts.claims.client();
        let gone = crate::claims::etcd::still_gone(self.parts.claims.keys(), node, registered_at);
        let took = client.txn(
            &[&[Compare::absent(lock)], &gone[..]].concat(),
            &[TxnOp::put_with_lease(lock, me, lease)],
            &[],
        );
        match took {
            Ok(t) if t.succeeded => return Ok(true),
            Ok(_) => {}
            // Ambiguous: settled by reading the lock, never by a retry.
            Err(e) => {
                log::info!("cluster: reaper lock {lock}: take not answered ({e}); reading it")
            }
        }
        let mine = Compare::value(lock, crate::etcd::CompareOp::Equal, me);
        let held = client
            .txn(&[&[mine], &gone[..]].concat(), &[], &[])
            .map_err(unavailable)?;
        Ok(held.succeeded)
    }

    /// Acts on the claims of a node gone for longer than its wait, under
    /// the node's reaper lock, by the cluster's free rule.
    /// True when there was nothing it could do: no claims of that node, or
    /// each one kept (nothing can fence it).
    fn reap(
        &mut self,
        node: &str,
        wait: Duration,
        absence: Absence,
        lease: LeaseId,
    ) -> Result<bool, ClaimError> {
        let claims = self.parts.claims.clone();
        // The node's claims through its index (a few small reads), never
        // every claim of the cluster, unless the node never ran a claimd
        // with the index. A value that is not a claim is skipped (and
        // reported where it is listed), never a reason to stop reaping
        // other nodes.
        let volumes = claims.claims_of_node(node)?.volumes();
        let unreachable = &self.parts.liveness.unreachable;
        unreachable.retain_node(node, &volumes);
        if volumes.is_empty() {
            return Ok(true);
        }
        let gone_for = absence.since.elapsed();
        let lock = claims.keys().reaper_lock(node);
        let me =
            serde_json::json!({"host": self.parts.node, "lease": lease.to_string()}).to_string();
        if !self.lock(node, absence.registered_at, &lock, &me, lease)? {
            // Another agent reaps it now (or the node is back).
            return Ok(false);
        }
        let mut all_kept = true;
        let reason = format!(
            "node {node} disconnected for more than {wait:?} (its stop_after_disconnect plus its unmount bound and margins)"
        );
        let rule = FreeRule::Cluster {
            fencing_plugins: &self.parts.fencing_plugins,
            free_unfenced: self.parts.free_unfenced,
            publish_settle: self.parts.csi_call,
            registered_at: absence.registered_at,
        };
        for v in &volumes {
            match claims.release_node_volume(
                v,
                node,
                &reason,
                &self.parts.node,
                rule,
                self.parts.attach_timeout,
                &self.parts.shutdown,
            ) {
                Ok(d) if d.kept.is_some() => {
                    unreachable.kept(v, node, gone_for, d.kept.as_deref().unwrap_or_default());
                    if self.kept_reported.insert((node.to_string(), v.clone())) {
                        log::warn!(
                            "cluster: volume {v} stays claimed by unreachable node {node}: {}; once that node is known to be down for good, free it with `claimd volume detach {v} --node {node} --reason ...`",
                            d.kept.unwrap_or_default()
                        );
                    }
                }
                Ok(d) => {
                    all_kept = false;
                    unreachable.gone(v, node);
                    log::warn!(
                        "cluster: volume {v} of unreachable node {node}: {}freed the claims of {}",
                        if d.detached {
                            "fenced (detached), "
                        } else {
                            ""
                        },
                        d.freed.join(", ")
                    )
                }
                Err(e) => {
                    all_kept = false;
                    log::warn!(
                        "cluster: volume {v} of unreachable node {node} not released yet: {e} (retrying)"
                    )
                }
            }
        }
        let same = Compare::value(lock.clone(), crate::etcd::CompareOp::Equal, me);
        // A lost answer leaves the lock on this agent's lease: the next
        // reap takes it back (`lock`), and it ends with the lease.
        if let Err(e) = claims.client().txn(&[same], &[TxnOp::delete(lock)], &[]) {
            log::info!("cluster: reaper lock of {node} not released now: {e}");
        }
        Ok(all_kept)
    }
}
