//! The disconnect rule (`cluster.stop_after_disconnect`, off by default,
//! like Nomad's `stop_on_client_disconnect`), run on every agent by one
//! named thread (`disconnect-rule`):
//!
//! - **This node**, when the rule is set here: once its lease has not been
//!   renewed for that long, it releases every allocation itself. The node
//!   side (NodeUnpublish, NodeUnstage) is done at once; the controller
//!   detach and the claims follow when etcd answers again.
//! - **Other nodes**: each node writes its own setting to
//!   `<prefix>/node-settings/<node>` (durable, with each registration of its
//!   liveness: `settings_entry`). When a node with the rule set has had
//!   no liveness key for that long (measured here, from when this agent
//!   first saw it gone: the floor is the lease TTL plus the window after
//!   its last renewal), the agent that takes `<prefix>/reaper-locks/<node>`
//!   (a `Txn` on its own lease: exactly one at a time) detaches the node's
//!   volumes through a controller host with the external node ID recorded
//!   in its claims, then frees its claims (a `freed/` note each), so
//!   allocations waiting elsewhere go on.
//!
//! A node without the rule keeps its claims and mounts however long it is
//! cut off.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::liveness::NodeLiveness;
use crate::claims::etcd::unavailable;
use crate::claims::{ClaimError, ClaimStore, EtcdClaims};
use crate::etcd::{Compare, CompareOp, LeaseId, TxnOp};
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// What the log and the release say of allocations released by the rule.
pub const DISCONNECT_RELEASE_REASON: &str = "released while disconnected";

/// `<prefix>/node-settings/<node>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSettings {
    pub stop_after_disconnect_ms: Option<u64>,
}

/// The durable key and value of this node's settings, written with each
/// registration of its liveness.
pub fn settings_entry(prefix: &str, node: &str, window: Option<Duration>) -> (String, Vec<u8>) {
    let value = NodeSettings {
        stop_after_disconnect_ms: window.map(|w| w.as_millis() as u64),
    };
    (
        format!("{}/node-settings/{node}", prefix.trim_end_matches('/')),
        serde_json::to_vec(&value).expect("settings always encode"),
    )
}

pub struct DisconnectRule {
    threads: Mutex<Option<Threads>>,
}

/// What the rule needs to run.
pub struct RuleParts {
    pub claims: Arc<EtcdClaims>,
    pub lifecycle: Lifecycle,
    pub liveness: Arc<NodeLiveness>,
    pub node: String,
    /// This node's own `stop_after_disconnect`.
    pub window: Option<Duration>,
    pub lease_ttl: Duration,
    pub attach_timeout: Duration,
    pub shutdown: Shutdown,
}

impl DisconnectRule {
    pub fn start(parts: RuleParts) -> std::io::Result<DisconnectRule> {
        let mut threads = Threads::new();
        let every = (parts.lease_ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(2));
        let mut rule = Rule {
            parts,
            started: Instant::now(),
            released: false,
            gone_since: HashMap::new(),
        };
        threads.spawn("disconnect-rule", move || {
            while rule.parts.shutdown.sleep(every) {
                rule.tick();
            }
        })?;
        Ok(DisconnectRule {
            threads: Mutex::new(Some(threads)),
        })
    }

    /// Joins the thread (after the stop was triggered) up to `deadline`.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        self.threads
            .lock()
            .take()
            .map(|t| t.join_until(deadline))
            .unwrap_or_default()
    }
}

struct Rule {
    parts: RuleParts,
    started: Instant,
    /// This node released its allocations during the current disconnect.
    released: bool,
    /// Nodes seen without a liveness key, since when (this agent's clock).
    gone_since: HashMap<String, Instant>,
}

impl Rule {
    fn tick(&mut self) {
        self.this_node();
        let Some(lease) = self.parts.liveness.status().lease else {
            return;
        };
        if let Err(e) = self.other_nodes(lease) {
            log::warn!("cluster: disconnect rule: cannot look at the other nodes: {e}");
        }
    }

    fn this_node(&mut self) {
        let Some(window) = self.parts.window else {
            return;
        };
        let last = self.parts.liveness.status().renewed.unwrap_or(self.started);
        if last.elapsed() < window {
            self.released = false;
            return;
        }
        if self.released {
            return;
        }
        self.released = true;
        let allocs: Vec<String> = self
            .parts
            .lifecycle
            .list_allocs()
            .into_iter()
            .filter(|a| !a.releasing)
            .map(|a| a.id)
            .collect();
        if allocs.is_empty() {
            return;
        }
        log::warn!(
            "cluster: this node's lease was last renewed {:?} ago (stop_after_disconnect {window:?}): {DISCONNECT_RELEASE_REASON}: releasing {} allocation(s): {}",
            last.elapsed(),
            allocs.len(),
            allocs.join(", ")
        );
        for a in allocs {
            match self.parts.lifecycle.release(&a) {
                Ok(_) => log::warn!("allocation {a}: {DISCONNECT_RELEASE_REASON} from etcd"),
                Err(e) => log::error!("allocation {a}: cannot be released: {e}"),
            }
        }
    }

    fn other_nodes(&mut self, lease: LeaseId) -> Result<(), ClaimError> {
        let claims = &self.parts.claims;
        let client = claims.client();
        let prefix = claims.prefix().to_string();
        let settings = client
            .range_prefix(format!("{prefix}/node-settings/"))
            .map_err(unavailable)?;
        let mut windows = BTreeMap::new();
        for kv in &settings.kvs {
            let node = kv
                .key_str()
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_string();
            match serde_json::from_slice::<NodeSettings>(&kv.value) {
                Ok(NodeSettings {
                    stop_after_disconnect_ms: Some(ms),
                }) if node != self.parts.node => {
                    windows.insert(node, Duration::from_millis(ms));
                }
                Ok(_) => {}
                Err(e) => log::warn!("cluster: {} is not node settings: {e}", kv.key_str()),
            }
        }
        if windows.is_empty() {
            self.gone_since.clear();
            return Ok(());
        }
        let alive = claims.alive_nodes()?;
        self.gone_since
            .retain(|n, _| windows.contains_key(n) && !alive.contains(n));
        for (node, window) in windows {
            if alive.contains(&node) {
                continue;
            }
            let since = *self
                .gone_since
                .entry(node.clone())
                .or_insert_with(Instant::now);
            if since.elapsed() >= window {
                self.reap(&node, window, lease)?;
            }
        }
        Ok(())
    }

    /// Detaches and frees the claims of a node gone for longer than its
    /// window, under the node's reaper lock.
    fn reap(&self, node: &str, window: Duration, lease: LeaseId) -> Result<(), ClaimError> {
        let claims = &self.parts.claims;
        let volumes: Vec<String> = {
            // A value that is not a claim is skipped (and reported where
            // it is listed), never a reason to stop reaping other nodes.
            let (all, _problems) = ClaimStore::list_with_problems(&**claims)?;
            let mut v: Vec<String> = all
                .into_iter()
                .filter(|c| c.node == node)
                .map(|c| c.volume_id)
                .collect();
            v.dedup();
            v
        };
        if volumes.is_empty() {
            return Ok(());
        }
        let client = claims.client();
        let lock = format!("{}/reaper-locks/{node}", claims.prefix());
        let me =
            serde_json::json!({"host": self.parts.node, "lease": lease.to_string()}).to_string();
        let t = client
            .txn(
                &[Compare::absent(lock.clone())],
                &[TxnOp::put_with_lease(lock.clone(), me.clone(), lease)],
                &[],
            )
            .map_err(unavailable)?;
        if !t.succeeded {
            return Ok(());
        }
        let reason = format!(
            "node {node} disconnected for more than {window:?} (its stop_after_disconnect)"
        );
        for v in &volumes {
            match claims.release_node_volume(
                v,
                node,
                &reason,
                &self.parts.node,
                self.parts.attach_timeout,
                &self.parts.shutdown,
            ) {
                Ok(d) => log::warn!(
                    "cluster: volume {v} of disconnected node {node}: {}freed the claims of {}",
                    if d.detached { "detached, " } else { "" },
                    d.freed.join(", ")
                ),
                Err(e) => log::warn!(
                    "cluster: volume {v} of disconnected node {node} not released yet: {e} (retrying)"
                ),
            }
        }
        let same = Compare::value(lock.clone(), CompareOp::Equal, me);
        client
            .txn(&[same], &[TxnOp::delete(lock)], &[])
            .map_err(unavailable)?;
        Ok(())
    }
}
