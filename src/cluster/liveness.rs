//! Node liveness: `<prefix>/nodes/<node>` attached to a
//! lease this agent keeps alive from a named thread (`etcd-liveness`).
//! Claims are never tied to the lease: a node cut off from the cluster
//! keeps its claims and mounts; the lease only tells the others whether it
//! is alive. An etcd that cannot be reached is retried with backoff for as
//! long as the agent runs; nothing here is ever fatal.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::claims::fencing::Fencing;
use crate::etcd::{EtcdClient, LeaseId, RenewalClock};
use crate::retry::{Backoff, BackoffPolicy};
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// Retries of the lease grant and registration while etcd is unreachable.
/// Short at its cap: a node back from a partition registers again within
/// about 2 s (one LeaseGrant every 2 s while cut off is little load).
const LIVENESS_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_millis(500), Duration::from_secs(2));

/// What `nodes/<node>` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node: String,
    pub pid: u32,
    pub started_at_ms: u64,
    pub version: String,
    /// The instance (`claims::fencing::instance_id`); empty from agents
    /// before it existed.
    #[serde(default)]
    pub instance: String,
}

/// Where this node's liveness stands.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// The lease is held and was renewed at this time.
    pub renewed: Option<Instant>,
    /// The last failure, while the lease is not held.
    pub last_error: Option<String>,
    /// The lease, while it is held (locks of controller work hang on it).
    pub lease: Option<LeaseId>,
    /// The keep-alive's own record of its last renewal: `status()` reads
    /// `renewed` from it, so it is current, whatever this thread is doing.
    clock: Option<RenewalClock>,
}

pub struct NodeLiveness {
    status: Arc<Mutex<Liveness>>,
    ttl: Duration,
    fencing: Arc<Fencing>,
    threads: Mutex<Option<Threads>>,
    /// Other nodes' claims the cluster keeps while they are unreachable
    /// (filled by the reaper; shown by `health` and the metrics).
    pub unreachable: super::UnreachableHolds,
}

impl NodeLiveness {
    /// Starts keeping `<prefix>/nodes/<node>` alive.
    /// `hooks.before_register` runs on the liveness thread before each
    /// registration (an error is retried like a failed registration),
    /// `hooks.on_registered` after each successful one (the start-up
    /// reconciliation).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        client: EtcdClient,
        prefix: &str,
        node: &str,
        ttl: Duration,
        shutdown: Shutdown,
        durable: Vec<(String, Vec<u8>)>,
        fencing: Arc<Fencing>,
        hooks: RegistrationHooks,
    ) -> std::io::Result<NodeLiveness> {
        let status = Arc::new(Mutex::new(Liveness::default()));
        let mut threads = Threads::new();
        let (key, node, st, f) = (
            crate::claims::etcd::Keys::new(prefix).node(node),
            node.to_string(),
            status.clone(),
            fencing.clone(),
        );
        threads.spawn("etcd-liveness".to_string(), move || {
            let instance = f.instance().to_string();
            let reg = Registration {
                key: &key,
                node: &node,
                instance: &instance,
                durable: &durable,
            };
            run(&client, &reg, ttl, &shutdown, &st, &f, &hooks)
        })?;
        Ok(NodeLiveness {
            status,
            ttl,
            fencing,
            threads: Mutex::new(Some(threads)),
            unreachable: Default::default(),
        })
    }

    /// The lease clock this liveness feeds.
    pub fn fencing(&self) -> &Arc<Fencing> {
        &self.fencing
    }

    pub fn status(&self) -> Liveness {
        let mut s = self.status.lock().clone();
        if let Some(c) = &s.clock {
            s.renewed = Some(c.last_renewed());
        }
        s
    }

    /// Why this node's liveness is not current (etcd unreachable, the lease
    /// lost, renewals late), if it is not.
    /// Ages count from the last answered renewal's send, on
    /// CLOCK_BOOTTIME, in this run or the previous one of this boot (not
    /// from this agent's start).
    pub fn problem(&self) -> Option<String> {
        let s = self.status();
        let ago = self.fencing.since_last_sent();
        let last = match ago {
            Some(a) => format!(" (last renewed {a:?} ago)"),
            None => " (no renewal known since boot)".to_string(),
        };
        match (s.renewed, s.last_error) {
            (_, Some(e)) => Some(format!(
                "this node's liveness lease is not held: {e}{last}"
            )),
            (None, None) => Some(format!(
                "this node's liveness is not registered in etcd yet{last}"
            )),
            (Some(_), None) if !matches!(ago, Some(a) if a <= self.ttl) => Some(format!(
                "this node's liveness lease was last renewed {:?} ago (TTL {:?}): etcd unreachable?",
                ago.unwrap_or_default(),
                self.ttl
            )),
            _ => None,
        }
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

/// What runs around each registration of the node's liveness.
pub struct RegistrationHooks {
    /// Before each registration: what must hold before the node's durable
    /// keys are written again (the claim index's check for an older
    /// claimd, `EtcdClaims::forget_index_if_an_older_claimd_ran`).
    pub before_register: Box<dyn Fn() -> Result<(), String> + Send>,
    /// After each successful registration.
    pub on_registered: Box<dyn Fn() + Send>,
}

/// What a registration writes: the liveness key (on the lease) and, in the
/// same transaction, this node's durable keys (its settings).
struct Registration<'a> {
    key: &'a str,
    node: &'a str,
    instance: &'a str,
    durable: &'a [(String, Vec<u8>)],
}

/// Why a registration did not go through.
enum RegisterError {
    Etcd(crate::etcd::EtcdError),
    /// What must hold before the registration could not be made so.
    Before(String),
    /// The name is registered by another instance whose lease is alive.
    OtherInstance(String),
    /// The key changed between the two transactions: try again.
    Changed,
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::Etcd(e) => f.write_str(&crate::error_chain(e)),
            RegisterError::Before(why) => f.write_str(why),
            RegisterError::OtherInstance(why) => f.write_str(why),
            RegisterError::Changed => f.write_str("the liveness key changed meanwhile"),
        }
    }
}

/// Writes the liveness key on `lease` by `Txn`: only while it is absent or
/// this instance's own (a restart of this agent before its old lease
/// ended). Another live instance of the same name is refused, never
/// overwritten: a replaced machine waits for the original's lease to end.
fn register(
    client: &EtcdClient,
    reg: &Registration<'_>,
    value: &[u8],
    lease: LeaseId,
) -> Result<i64, RegisterError> {
    use crate::etcd::{Compare, CompareOp, TxnOp};
    let mut ops = vec![TxnOp::put_with_lease(reg.key, value.to_vec(), lease)];
    ops.extend(
        reg.durable
            .iter()
            .map(|(k, v)| TxnOp::put(k.clone(), v.clone())),
    );
    let t = client
        .txn(&[Compare::absent(reg.key)], &ops, &[TxnOp::get(reg.key)])
        .map_err(RegisterError::Etcd)?;
    if t.succeeded {
        return Ok(t.revision);
    }
    let Some(kv) = t.first_range().and_then(|r| r.kvs.first()) else {
        return Err(RegisterError::Changed);
    };
    let theirs: Option<NodeRecord> = serde_json::from_slice(&kv.value).ok();
    match theirs {
        Some(r) if r.instance == reg.instance => {
            let same = Compare::mod_revision(reg.key, CompareOp::Equal, kv.mod_revision);
            let t = client.txn(&[same], &ops, &[]).map_err(RegisterError::Etcd)?;
            if t.succeeded {
                Ok(t.revision)
            } else {
                Err(RegisterError::Changed)
            }
        }
        Some(r) => Err(RegisterError::OtherInstance(format!(
            "node name {} is registered in etcd by another instance ({}, pid {}, version {}) whose lease is alive: this agent stays unregistered until that lease ends (two machines with one node_name?)",
            reg.node,
            if r.instance.is_empty() { "an older agent" } else { &r.instance },
            r.pid,
            r.version
        ))),
        None => Err(RegisterError::OtherInstance(format!(
            "{} holds a value that is not a node record: this agent stays unregistered until it is gone (it is left untouched)",
            reg.key
        ))),
    }
}

fn run(
    client: &EtcdClient,
    reg: &Registration<'_>,
    ttl: Duration,
    shutdown: &Shutdown,
    status: &Mutex<Liveness>,
    fencing: &Fencing,
    hooks: &RegistrationHooks,
) {
    let key = reg.key;
    let record = NodeRecord {
        node: reg.node.to_string(),
        pid: std::process::id(),
        started_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        version: env!("CARGO_PKG_VERSION").to_string(),
        instance: reg.instance.to_string(),
    };
    let value = serde_json::to_vec(&record).expect("a node record always encodes");
    let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let mut backoff = Backoff::new(LIVENESS_BACKOFF, far);
    while !shutdown.is_triggered() {
        let held = (hooks.before_register)()
            .and_then(|()| fencing.publishing().map_err(|e| crate::error_chain(&e)))
            .map_err(RegisterError::Before)
            .and_then(|()| client.lease_grant(ttl).map_err(RegisterError::Etcd))
            .and_then(|lease| {
                let revision = match register(client, reg, &value, lease) {
                    Ok(r) => r,
                    Err(e) => {
                        // Not left to expire: the lease is this agent's alone.
                        let _ = client.lease_revoke(lease);
                        return Err(e);
                    }
                };
                client
                    .keep_alive(lease)
                    .map(|k| (lease, revision, k))
                    .map_err(RegisterError::Etcd)
            });
        let (lease, revision, keep_alive) = match held {
            Ok(k) => k,
            Err(e) => {
                match &e {
                    RegisterError::OtherInstance(_) => log::error!("cluster: {e} (retrying)"),
                    _ => log::warn!("cluster: cannot keep {key} alive: {e} (retrying)"),
                }
                let mut st = status.lock();
                st.last_error = Some(e.to_string());
                st.lease = None;
                drop(st);
                if backoff.wait(shutdown).is_err() {
                    return;
                }
                continue;
            }
        };
        log::info!("cluster: {key} registered (lease TTL {ttl:?})");
        backoff.reset();
        *status.lock() = Liveness {
            renewed: Some(keep_alive.last_renewed()),
            last_error: None,
            lease: Some(lease),
            clock: Some(keep_alive.renewal_clock()),
        };
        fencing.lease_registered(lease, revision, keep_alive.renewal_clock());
        (hooks.on_registered)();
        // Renewal happens on the keep-alive's own thread; this one reports
        // and notices a lease etcd says is gone.
        while !keep_alive.is_lost() {
            if !shutdown.sleep(ttl / 3) {
                // Stopping: the lease is left to expire (a restart is
                // usually quick; the claims are not tied to it anyway).
                keep_alive.stop();
                return;
            }
            status.lock().renewed = Some(keep_alive.last_renewed());
            fencing.persist();
            if fencing.reregistration_asked() {
                // The key went while the lease lives: written again on the
                // same lease (nothing that hangs on the lease moves).
                match register(client, reg, &value, lease) {
                    Ok(revision) => {
                        log::warn!("cluster: {key} written again (lease TTL {ttl:?})");
                        fencing.lease_registered(lease, revision, keep_alive.renewal_clock());
                        (hooks.on_registered)();
                    }
                    Err(e) => {
                        // Asked again: retried at the next renewal, until
                        // the key is back or the lease is lost.
                        fencing.ask_reregistration();
                        log::warn!("cluster: cannot write {key} again: {e} (retrying)")
                    }
                }
            }
        }
        fencing.lease_lost();
        log::warn!("cluster: the lease of {key} was lost; registering again");
        let mut st = status.lock();
        st.last_error = Some("the lease was lost".to_string());
        st.lease = None;
        drop(st);
        keep_alive.stop();
    }
}
