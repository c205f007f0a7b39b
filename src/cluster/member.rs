//! This node as a member of the cluster, in the order the agent starts
//! it: the etcd client (`connect`); claims in etcd, the reconciliation
//! thread and this node's liveness (`Member::join`); the self-release,
//! armed before the restore (`Member::arm_self_release`); the controller
//! work for other nodes and the reaper, once this node's own allocations
//! are back (`Member::start_work`).
//!
//! The reconciliation runs after each registration of the liveness,
//! retried with backoff until it has been done (and its releases started)
//! once per registration. The first registration can come before the
//! lifecycle exists: the lifecycle is handed to the thread by a channel
//! (`Member::hand_lifecycle`), and a reconciliation that found allocations
//! to release waits on it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::controller_host::ControllerHost;
use super::disconnect::{settings_entry, DisconnectRule, RuleParts, SelfReleaseParts};
use super::liveness::{NodeLiveness, RegistrationHooks};
use crate::claims::fencing::Fencing;
use crate::claims::EtcdClaims;
use crate::config::ClusterConfig;
use crate::etcd::{EtcdClient, EtcdError};
use crate::lifecycle::Lifecycle;
use crate::plugins::Registry;
use crate::retry::{Backoff, BackoffPolicy};
use crate::shutdown::Shutdown;
use crate::state::StateStore;
use crate::threads::Threads;

/// Backoff of a reconciliation that failed (etcd unreachable, a release
/// that could not start).
const RECONCILE_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_millis(250), Duration::from_secs(10));

/// A thread of the cluster's background work that could not start.
#[derive(Debug)]
pub struct StartError {
    /// What could not start, as a sentence ("failed to start the reaper
    /// thread").
    pub what: &'static str,
    pub source: std::io::Error,
}

impl StartError {
    fn of(what: &'static str) -> impl FnOnce(std::io::Error) -> StartError {
        move |source| StartError { what, source }
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// The etcd client of the cluster section (nothing is sent yet: an etcd
/// that is down shows when it is first used), logged with where the claims
/// live.
pub fn connect(c: &ClusterConfig) -> Result<EtcdClient, EtcdError> {
    let tls = c.tls.as_ref().map(|t| crate::etcd::TlsOptions {
        ca: t.ca.clone(),
        identity: match (&t.cert, &t.key) {
            (Some(cert), Some(key)) => Some(crate::etcd::ClientIdentity {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        },
    });
    let client = EtcdClient::connect(
        &c.endpoints,
        crate::etcd::EtcdOptions {
            call_timeout: c.call_timeout,
            tls,
        },
    )?;
    log::info!(
        "cluster mode: claims in etcd under {} ({}){}",
        c.prefix,
        c.endpoints.join(", "),
        match &c.tls {
            None => String::new(),
            // Paths only: the files' contents are never logged.
            Some(t) => format!(
                ", TLS: CA {}{}",
                t.ca.display(),
                t.cert
                    .as_ref()
                    .map(|p| format!(", client certificate {}", p.display()))
                    .unwrap_or_default()
            ),
        }
    );
    Ok(client)
}

/// What joining the cluster needs, once this node's identity is known.
pub struct JoinParts<'a> {
    pub client: EtcdClient,
    pub config: &'a ClusterConfig,
    pub node: &'a str,
    pub mount_root: &'a Path,
    /// This node's CSI call deadline (published with its settings).
    pub csi_call: Duration,
    pub store: Arc<StateStore>,
    pub fencing: Arc<Fencing>,
    pub shutdown: &'a Shutdown,
}

/// This node in the cluster: its claims in etcd and its liveness.
pub struct Member {
    pub claims: Arc<EtcdClaims>,
    pub liveness: Arc<NodeLiveness>,
    config: ClusterConfig,
    node: String,
    /// Hands the lifecycle to the reconciliation thread once it exists.
    lifecycle: Sender<Lifecycle>,
}

impl Member {
    /// Claims in etcd with their marker thread (`etcd-marker`), the
    /// reconciliation thread (`reconcile`), both on `threads`, and this
    /// node's liveness.
    pub fn join(parts: JoinParts<'_>, threads: &mut Threads) -> Result<Member, StartError> {
        let c = parts.config;
        let claims = Arc::new(
            EtcdClaims::new(parts.client.clone(), &c.prefix, parts.store)
                .with_node(parts.node)
                .with_fencing(parts.fencing.clone())
                .with_freed_retention(c.freed_note_retention),
        );
        claims
            .start_marker(threads, parts.shutdown.clone())
            .map_err(StartError::of("failed to start the claim marker thread"))?;
        let (registered_tx, registered_rx) = crossbeam_channel::unbounded::<()>();
        let (lifecycle_tx, lifecycle_rx) = crossbeam_channel::bounded::<Lifecycle>(1);
        let reconciler = Reconciler {
            claims: claims.clone(),
            node: parts.node.to_string(),
            root: parts.mount_root.to_path_buf(),
            lifecycle: lifecycle_rx,
            stop: parts.shutdown.clone(),
        };
        threads
            .spawn("reconcile", move || reconciler.run(&registered_rx))
            .map_err(StartError::of("failed to start the reconciliation thread"))?;
        let liveness = NodeLiveness::start(
            parts.client,
            &c.prefix,
            parts.node,
            c.lease_ttl,
            parts.shutdown.clone(),
            vec![settings_entry(
                &c.prefix,
                parts.node,
                parts.fencing.bounds(),
                parts.csi_call,
            )],
            parts.fencing.clone(),
            {
                let (claims, node) = (claims.clone(), parts.node.to_string());
                RegistrationHooks {
                    before_register: Box::new(move || {
                        claims.check_schema()?;
                        claims
                            .forget_index_if_an_older_claimd_ran(&node)
                            .map_err(|e| crate::error_chain(&e))
                    }),
                    on_registered: Box::new(move || {
                        let _ = registered_tx.send(());
                    }),
                }
            },
        )
        .map_err(StartError::of(
            "failed to start the cluster liveness thread",
        ))?;
        Ok(Member {
            claims,
            liveness: Arc::new(liveness),
            config: c.clone(),
            node: parts.node.to_string(),
            lifecycle: lifecycle_tx,
        })
    }

    /// Gives the reconciliation thread the lifecycle, which exists only
    /// after the join.
    pub fn hand_lifecycle(&self, lifecycle: &Lifecycle) {
        let _ = self.lifecycle.try_send(lifecycle.clone());
    }

    /// The self-release counts from the last renewal, persisted: armed
    /// before the restore, so a restart during a partition does not reset
    /// it.
    pub fn arm_self_release(
        &self,
        lifecycle: Lifecycle,
        rebooted: bool,
        shutdown: Shutdown,
    ) -> Result<DisconnectRule, StartError> {
        DisconnectRule::start_self_release(SelfReleaseParts {
            lifecycle,
            fencing: self.liveness.fencing().clone(),
            rebooted,
            window: self.config.stop_after_disconnect,
            lease_ttl: self.config.lease_ttl,
            shutdown,
        })
        .map_err(StartError::of("failed to start the self-release thread"))
    }

    /// Cluster work for other nodes (the controller host) and the
    /// disconnect rule's reaper, once this node's own allocations are back.
    pub fn start_work(
        &self,
        rule: DisconnectRule,
        registry: Registry,
        csi_call: Duration,
        shutdown: Shutdown,
    ) -> Result<ClusterWork, StartError> {
        let c = &self.config;
        let host = ControllerHost::start(
            self.claims.clone(),
            registry,
            self.liveness.clone(),
            &self.node,
            c.epoch_plugins.clone(),
            shutdown.clone(),
        )
        .map_err(StartError::of("failed to start the controller host thread"))?;
        rule.start_reaper(RuleParts {
            claims: self.claims.clone(),
            liveness: self.liveness.clone(),
            node: self.node.clone(),
            lease_ttl: c.lease_ttl,
            call_timeout: c.call_timeout,
            attach_timeout: c.attach_timeout,
            fencing_plugins: c.fencing_plugins.clone(),
            free_unfenced: c.free_unfenced_claims,
            csi_call,
            shutdown,
        })
        .map_err(StartError::of("failed to start the reaper thread"))?;
        Ok(ClusterWork { host, rule })
    }
}

/// The controller host and the disconnect rule of a started member.
pub struct ClusterWork {
    host: ControllerHost,
    rule: DisconnectRule,
}

impl ClusterWork {
    /// Joins both within `deadline`; names the threads still running.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        let mut left = self.host.join(deadline);
        left.extend(self.rule.join(deadline));
        left
    }
}

/// The reconciliation thread's parts.
struct Reconciler {
    claims: Arc<EtcdClaims>,
    node: String,
    root: PathBuf,
    /// The lifecycle, once it exists.
    lifecycle: Receiver<Lifecycle>,
    stop: Shutdown,
}

impl Reconciler {
    /// After each registration of this node's liveness: reconciles this
    /// node's claims with its records until that succeeded once, releasing
    /// the allocations whose claims the cluster freed. Retried until it
    /// succeeds or the agent stops: no deadline.
    fn run(self, registered: &Receiver<()>) {
        let mut lifecycle: Option<Lifecycle> = None;
        loop {
            crossbeam_channel::select! {
                recv(registered) -> r => if r.is_err() { return },
                recv(self.stop.receiver()) -> _ => return,
            }
            while registered.try_recv().is_ok() {}
            let mut backoff = Backoff::delays(RECONCILE_BACKOFF);
            loop {
                let done = match self.claims.reconcile(&self.node, &self.root) {
                    Ok(r) => {
                        crate::metrics::RECONCILIATIONS.inc();
                        if !r.freed.is_empty() || !r.kept.is_empty() {
                            log::info!(
                                "cluster: reconciliation freed {} orphaned claim(s) of this node, kept {}",
                                r.freed.len(),
                                r.kept.len()
                            );
                        }
                        // The first registration can come before the
                        // lifecycle exists (it is made right after start).
                        if !r.lost.is_empty() && lifecycle.is_none() {
                            crossbeam_channel::select! {
                                recv(self.lifecycle) -> l => match l {
                                    Ok(l) => lifecycle = Some(l),
                                    // The start failed before it existed.
                                    Err(_) => return,
                                },
                                recv(self.stop.receiver()) -> _ => return,
                            }
                        }
                        release_lost(lifecycle.as_ref(), &r.lost)
                    }
                    Err(e) => {
                        log::warn!("cluster: reconciliation failed: {e} (retrying)");
                        false
                    }
                };
                if done || !self.stop.sleep(backoff.next_delay()) {
                    break;
                }
            }
        }
    }
}

/// Releases the allocations whose claims etcd no longer holds (freed by the
/// cluster's disconnect rule or by hand while this node was away): they
/// must not stay mounted without a claim. False when one could not start.
fn release_lost(lifecycle: Option<&Lifecycle>, lost: &[(String, String, String)]) -> bool {
    let Some(lifecycle) = lifecycle else {
        return lost.is_empty();
    };
    let mut done = std::collections::BTreeSet::new();
    let mut all = true;
    for (volume, alloc, why) in lost {
        log::warn!(
            "cluster: allocation {alloc} records volume {volume} but etcd no longer holds its claim ({why}): releasing the allocation"
        );
        if done.insert(alloc.clone()) {
            if let Err(e) = lifecycle.release(alloc) {
                log::error!("allocation {alloc}: cannot be released: {e} (retrying)");
                all = false;
            }
        }
    }
    all
}
