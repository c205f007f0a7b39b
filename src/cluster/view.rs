//! This agent's view of the other nodes: which are alive (`nodes/<node>`,
//! on each node's lease) and their settings (`node-settings/<node>`), kept
//! by one Range and then one watch on both prefixes (thread `node-view`),
//! instead of reading both in full on every reaper tick. An idle cluster
//! then costs each agent its keep-alive and its watches' progress
//! requests, whatever the number of nodes.
//!
//! The view is trusted only while its watch shows it is alive (etcd
//! answered on the stream within `max_age`, `Watcher::is_fresh`): what
//! reads a view that is not fresh reads etcd with a Range instead. A
//! watch that ends (compaction, an error) is replaced by a new Range and a
//! new watch from that Range's revision.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use serde::{Deserialize, Serialize};

use crate::claims::etcd::keys::{Keys, NodeKey};
use crate::claims::margins;
use crate::etcd::{prefix_end, EtcdClient, KeyValue, WatchEvent};
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// How long the thread waits for an event before it looks at the watch's
/// freshness and the shutdown again.
const POLL: Duration = Duration::from_millis(250);
/// Backoff between attempts to read and watch again after a failure.
const RETRY: Duration = Duration::from_millis(500);

/// `<prefix>/node-settings/<node>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSettings {
    pub stop_after_disconnect_ms: Option<u64>,
    /// U: the node's longest unmount (NodeUnpublish + NodeUnstage at their
    /// deadlines). Absent from older agents: observers assume 2 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmount_bound_ms: Option<u64>,
    /// τ: the node's self-release check period plus scheduling delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_period_ms: Option<u64>,
    /// The node's agent keeps the per-node claim index
    /// (`claims::etcd::index`): every registration of such an agent
    /// writes true. An older claimd's registration writes settings without
    /// it, so nothing trusts that node's index while an older claimd may
    /// have taken claims it did not index.
    #[serde(default)]
    pub claim_index: bool,
    /// The node's CSI call deadline: how long a ControllerPublish it sent
    /// itself may still land (the reaper's settle after a fence). Absent
    /// from older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_call_timeout_ms: Option<u64>,
}

/// U and τ assumed for a node that does not publish them.
const ASSUMED_UNMOUNT_BOUND: Duration = Duration::from_secs(120);
const ASSUMED_TAU: Duration = Duration::from_secs(3);

impl NodeSettings {
    /// W for this node: how long observers wait after first seeing it gone.
    pub fn observer_wait(&self) -> Option<Duration> {
        let d = Duration::from_millis(self.stop_after_disconnect_ms?);
        let u = self
            .unmount_bound_ms
            .map_or(ASSUMED_UNMOUNT_BOUND, Duration::from_millis);
        let t = self
            .check_period_ms
            .map_or(ASSUMED_TAU, Duration::from_millis);
        Some(margins::observer_wait(d, u, t))
    }
}

/// Alive nodes and node settings, as of a fresh watch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodesSnapshot {
    pub alive: HashSet<String>,
    pub settings: BTreeMap<String, NodeSettings>,
    /// The mod revision of each node's settings in `settings`: every
    /// registration of the node writes them again, so a revision that
    /// moved means the node registered in between.
    pub registered_at: BTreeMap<String, i64>,
}

impl NodesSnapshot {
    /// Records `node-settings/<node>` as read (an undecodable value is
    /// left out, with a warning).
    pub fn set_settings(&mut self, node: &str, kv: &KeyValue) {
        match serde_json::from_slice::<NodeSettings>(&kv.value) {
            Ok(v) => {
                self.settings.insert(node.to_string(), v);
                self.registered_at.insert(node.to_string(), kv.mod_revision);
            }
            Err(e) => {
                self.remove_settings(node);
                log::warn!(
                    "cluster: {} is not node settings: {e} (ignored)",
                    kv.key_str()
                );
            }
        }
    }

    pub fn remove_settings(&mut self, node: &str) {
        self.settings.remove(node);
        self.registered_at.remove(node);
    }
}

#[derive(Default)]
struct ViewState {
    nodes: NodesSnapshot,
    /// When the watch last showed that everything up to then is applied
    /// (None: no current watch).
    current_at: Option<Instant>,
}

pub struct NodeView {
    state: Arc<Mutex<ViewState>>,
}

impl NodeView {
    /// Starts the `node-view` thread on `threads` (which joins it).
    /// `own`: this node's name, and what to do when the watch sees its
    /// liveness key deleted (by hand, or by its lease's end).
    pub fn start(
        client: EtcdClient,
        keys: Keys,
        own: (String, Box<dyn Fn() + Send>),
        shutdown: Shutdown,
        threads: &mut Threads,
    ) -> std::io::Result<NodeView> {
        let state = Arc::new(Mutex::new(ViewState::default()));
        let keeper = Keeper {
            client,
            keys,
            state: state.clone(),
            own,
            shutdown,
        };
        threads.spawn("node-view", move || keeper.run())?;
        Ok(NodeView { state })
    }

    /// The view, when its watch showed within `max_age` that it is
    /// current; None otherwise (read etcd instead).
    pub fn fresh(&self, max_age: Duration) -> Option<NodesSnapshot> {
        let s = self.state.lock();
        let at = s.current_at?;
        (at.elapsed() < max_age).then(|| s.nodes.clone())
    }
}

struct Keeper {
    client: EtcdClient,
    keys: Keys,
    state: Arc<Mutex<ViewState>>,
    own: (String, Box<dyn Fn() + Send>),
    shutdown: Shutdown,
}

impl Keeper {
    fn run(self) {
        while !self.shutdown.is_triggered() {
            if let Err(why) = self.follow() {
                self.state.lock().current_at = None;
                log::info!("cluster: node view: {why}; reading again");
                if !self.shutdown.sleep(RETRY) {
                    break;
                }
            }
        }
    }

    /// One Range, then the watch from the revision after it, until the
    /// watch ends or the agent stops.
    fn follow(&self) -> Result<(), String> {
        // One range holds both `nodes/` and `node-settings/`.
        let range = self.keys.node_range();
        let key = range.as_bytes();
        let end = prefix_end(key);
        let read = self
            .client
            .range(key, &end)
            .map_err(|e| format!("cannot read the nodes: {e}"))?;
        let watch = self
            .client
            .watch(key, &end, read.revision + 1)
            .map_err(|e| format!("cannot watch the nodes: {e}"))?;
        {
            let mut s = self.state.lock();
            s.nodes = NodesSnapshot::default();
            for kv in &read.kvs {
                self.apply(&mut s.nodes, &WatchEvent::Put(kv.clone()));
            }
            // A delete while no watch ran (a reconnect after a leader
            // change) shows only as a key missing from the read.
            if !s.nodes.alive.contains(&self.own.0) {
                (self.own.1)();
            }
            // Current as of the read: the watch starts right after it.
            s.current_at = Some(Instant::now());
        }
        while !self.shutdown.is_triggered() {
            // When etcd last answered, taken before the events are
            // drained: everything it delivered until then is applied below.
            let heard = watch.last_heard();
            let first = watch
                .recv_timeout(POLL)
                .map_err(|e| format!("watch ended: {e}"))?;
            let mut s = self.state.lock();
            let mut next = first;
            while let Some(ev) = next {
                self.apply(&mut s.nodes, &ev);
                next = watch
                    .recv_timeout(Duration::ZERO)
                    .map_err(|e| format!("watch ended: {e}"))?;
            }
            s.current_at = Some(heard.max(s.current_at.unwrap_or(heard)));
        }
        Ok(())
    }

    fn apply(&self, nodes: &mut NodesSnapshot, ev: &WatchEvent) {
        let (kv, put): (&KeyValue, bool) = match ev {
            WatchEvent::Put(kv) => (kv, true),
            WatchEvent::Delete(kv) => (kv, false),
            WatchEvent::Progress { .. } => return,
        };
        match self.keys.parse_node(&kv.key_str()) {
            Some(NodeKey::Liveness(node)) => {
                if put {
                    nodes.alive.insert(node);
                } else {
                    nodes.alive.remove(&node);
                    if node == self.own.0 {
                        (self.own.1)();
                    }
                }
            }
            Some(NodeKey::Settings(node)) => {
                if put {
                    nodes.set_settings(&node, kv);
                } else {
                    nodes.remove_settings(&node);
                }
            }
            None => {}
        }
    }
}
