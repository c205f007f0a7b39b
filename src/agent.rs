//! The agent process: state, plugins, the lifecycle, restore, and a
//! graceful stop bounded by the longest CSI deadline.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::ApiServer;
use crate::claims::fencing::Fencing;
use crate::claims::margins::ReleaseBounds;
use crate::claims::{ClaimStore, EmbeddedClaims, EtcdClaims};
use crate::cluster::{ControllerHost, DisconnectRule, NodeLiveness, RuleParts, SelfReleaseParts};
use crate::config::Config;
use crate::lifecycle::{Lifecycle, LifecycleOptions, RestoreProgress};
use crate::observe::Observer;
use crate::plugins::{Registry, RegistryOptions};
use crate::shutdown::Shutdown;
use crate::state::{StateError, StateStore};
use crate::systemd::Notifier;
use crate::threads::Threads;

/// How long `--dev` waits for its own releases on stop before giving up.
pub const DEV_RELEASE_DEADLINE: Duration = Duration::from_secs(10);
/// Slack on top of the CSI call deadline for threads to finish on stop.
pub const STOP_SLACK: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub enum AgentError {
    State(StateError),
    Api(crate::api::ApiError),
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The cluster section names endpoints or TLS files etcd cannot use.
    Cluster(crate::etcd::EtcdError),
    /// This node's identity cannot be read or made: its instance ID, or
    /// what it last published of its self-release.
    Identity(String),
    /// `metrics_listen` cannot be bound (in use, not local, or the unit's
    /// RestrictAddressFamilies= leaves out its family).
    MetricsListen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentError::State(e) => e.fmt(f),
            AgentError::Api(e) => e.fmt(f),
            AgentError::Io { what, .. } => f.write_str(what),
            AgentError::Cluster(_) => f.write_str("cluster mode cannot start"),
            AgentError::Identity(why) => f.write_str(why),
            AgentError::MetricsListen { addr, source } => {
                write!(f, "config field metrics_listen: cannot listen on {addr}")?;
                if source.raw_os_error() == Some(libc::EAFNOSUPPORT) {
                    f.write_str(" (under systemd, allow its address family: RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 in a drop-in)")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for AgentError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AgentError::State(e) => e.source(),
            AgentError::Api(e) => e.source(),
            AgentError::Io { source, .. } | AgentError::MetricsListen { source, .. } => {
                Some(source)
            }
            AgentError::Cluster(e) => Some(e),
            AgentError::Identity(_) => None,
        }
    }
}

impl From<StateError> for AgentError {
    fn from(e: StateError) -> Self {
        AgentError::State(e)
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentError {
    let what = what.into();
    move |source| AgentError::Io { what, source }
}

/// A running agent (without its signal handling), so tests and the binary
/// share one start-up path.
pub struct Agent {
    pub config: Config,
    pub shutdown: Shutdown,
    pub lifecycle: Lifecycle,
    pub registry: Registry,
    pub dev: bool,
    pub observer: Observer,
    api: ApiServer,
    /// Cluster mode: this node's liveness in etcd.
    liveness: Option<Arc<NodeLiveness>>,
    /// Cluster mode: controller work for other nodes, the disconnect rule.
    cluster_work: Option<Arc<(ControllerHost, DisconnectRule)>>,
    /// The watchdog, the volume stats poller and the metrics listener.
    threads: Threads,
    notifier: Notifier,
}

impl Agent {
    /// Opens the state, starts the plugin registry and restores every
    /// recorded allocation.
    pub fn start(config: Config, dev: bool, shutdown: Shutdown) -> Result<Agent, AgentError> {
        // A bad metrics address stops the start before anything else.
        let listener = match config.metrics_listen {
            Some(addr) => Some(
                crate::observe::http::bind(addr)
                    .map_err(|source| AgentError::MetricsListen { addr, source })?,
            ),
            None => None,
        };
        let notifier = Notifier::from_env();
        notifier.status("opening the state");
        std::fs::create_dir_all(&config.mount_root).map_err(io_err(format!(
            "failed to create mount root {}",
            config.mount_root.display()
        )))?;
        let store = Arc::new(StateStore::open(&config.state_dir)?);
        let mut threads = Threads::new();
        if let Some(every) = crate::systemd::watchdog_interval() {
            start_watchdog(&mut threads, &notifier, &store, every, &shutdown)?;
        }
        log::info!(
            "state file {} loaded ({} allocation(s), {} volume(s), {} claim(s))",
            store.path().display(),
            store.read(|s| s.allocs.len()),
            store.read(|s| s.volumes.len()),
            store.read(|s| s.claims.len()),
        );
        let env = crate::csi::grpc_environment("grpc-cq");
        let registry = Registry::start(
            env.clone(),
            &config.plugins,
            RegistryOptions {
                call_timeout: config.timeouts.csi_call,
                probe_interval: config.timeouts.probe_interval,
                plugin_dir: config.plugin_dir.clone(),
            },
            shutdown.clone(),
        )
        .map_err(io_err("failed to start the plugin registry"))?;
        // The lifecycle, once it exists, for the cluster's reconciliation.
        let lifecycle_slot: Arc<std::sync::OnceLock<Lifecycle>> = Arc::default();
        let (claims, cluster): (Arc<dyn ClaimStore>, _) = match &config.cluster {
            None => (Arc::new(EmbeddedClaims::new(store.clone())), None),
            Some(c) => {
                let client = connect_etcd(c).map_err(AgentError::Cluster)?;
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
                let instance = crate::claims::fencing::instance_id(&config.state_dir)
                    .map_err(|e| AgentError::Identity(crate::error_chain(&e)))?;
                log::info!(
                    "cluster: this node is {} (instance {instance})",
                    config.node_name
                );
                let fencing = Arc::new(
                    Fencing::open(
                        &config.state_dir,
                        &instance,
                        store.boot_id(),
                        ReleaseBounds::new(
                            c.stop_after_disconnect,
                            c.lease_ttl,
                            config.timeouts.csi_call,
                        ),
                    )
                    .map_err(|e| AgentError::Identity(crate::error_chain(&e)))?,
                );
                let etcd_claims = Arc::new(
                    EtcdClaims::new(client.clone(), &c.prefix, store.clone())
                        .with_node(&config.node_name)
                        .with_fencing(fencing.clone())
                        .with_freed_retention(c.freed_note_retention),
                );
                etcd_claims
                    .start_marker(&mut threads, shutdown.clone())
                    .map_err(io_err("failed to start the claim marker thread"))?;
                // Reconciliation runs on its own thread after each
                // registration, retried with backoff until it has been
                // done (and its releases started) once per registration.
                let (registered_tx, registered_rx) = crossbeam_channel::unbounded::<()>();
                let (reconciler, node, root, releaser, stop) = (
                    etcd_claims.clone(),
                    config.node_name.clone(),
                    config.mount_root.clone(),
                    lifecycle_slot.clone(),
                    shutdown.clone(),
                );
                threads
                    .spawn("reconcile", move || {
                        reconcile_loop(&reconciler, &node, &root, &releaser, &stop, &registered_rx)
                    })
                    .map_err(io_err("failed to start the reconciliation thread"))?;
                let liveness = NodeLiveness::start(
                    client,
                    &c.prefix,
                    &config.node_name,
                    c.lease_ttl,
                    shutdown.clone(),
                    vec![crate::cluster::settings_entry(
                        &c.prefix,
                        &config.node_name,
                        fencing.bounds(),
                        config.timeouts.csi_call,
                    )],
                    fencing.clone(),
                    {
                        let (claims, node) = (etcd_claims.clone(), config.node_name.clone());
                        crate::cluster::RegistrationHooks {
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
                .map_err(io_err("failed to start the cluster liveness thread"))?;
                (
                    etcd_claims.clone() as Arc<dyn ClaimStore>,
                    Some((etcd_claims, Arc::new(liveness), c.clone())),
                )
            }
        };
        let liveness = cluster.as_ref().map(|(_, l, _)| l.clone());
        let mut opts = LifecycleOptions::new(&config.mount_root, &config.node_name);
        opts.plugin_wait = config.timeouts.plugin_wait;
        opts.claim_retry_deadline = config.timeouts.claim_retry_deadline;
        opts.mount_retry_deadline = config.timeouts.mount_retry_deadline;
        opts.release_retry_deadline = config.timeouts.release_retry_deadline;
        opts.uncertain_settle = config.timeouts.csi_call;
        opts.restore_wait = config.timeouts.plugin_wait + config.timeouts.csi_call;
        if let Some(c) = &config.cluster {
            opts.attach_timeout = c.attach_timeout;
            opts.epoch_plugins = c.epoch_plugins.clone();
            for p in c
                .fencing_plugins
                .iter()
                .filter(|p| !c.epoch_plugins.contains(p))
            {
                log::warn!(
                    "cluster: fencing plugin {p} is not in cluster.epoch_plugins: a call up that a paused node sends after the cluster fenced it reaches the plugin without the claim's epoch, and only the plugin's own fence can refuse it (manual: safety.md)"
                );
            }
        }
        let rebooted = store.rebooted();
        let lifecycle = Lifecycle::new(store, claims, registry.clone(), opts, shutdown.clone());
        let _ = lifecycle_slot.set(lifecycle.clone());
        // The self-release counts from the last renewal, persisted: armed
        // before the restore, so a restart during a partition does not
        // reset it.
        let rule = match &cluster {
            None => None,
            Some((_, liveness, c)) => Some(
                DisconnectRule::start_self_release(SelfReleaseParts {
                    lifecycle: lifecycle.clone(),
                    fencing: liveness.fencing().clone(),
                    rebooted,
                    window: c.stop_after_disconnect,
                    lease_ttl: c.lease_ttl,
                    shutdown: shutdown.clone(),
                })
                .map_err(io_err("failed to start the self-release thread"))?,
            ),
        };
        let report = lifecycle.restore_with(&|p: RestoreProgress| {
            notifier.status(&format!(
                "restoring {} allocations, {} done",
                p.allocations, p.done
            ));
        });
        for e in &report.errors {
            log::error!("restore: {e}");
        }
        release_start_heap();
        // Cluster work for other nodes and the disconnect rule, once this
        // node's own allocations are back.
        let cluster_work = match (&cluster, rule) {
            (Some((etcd_claims, liveness, c)), Some(rule)) => {
                let host = ControllerHost::start(
                    etcd_claims.clone(),
                    registry.clone(),
                    liveness.clone(),
                    &config.node_name,
                    c.epoch_plugins.clone(),
                    shutdown.clone(),
                )
                .map_err(io_err("failed to start the controller host thread"))?;
                rule.start_reaper(RuleParts {
                    claims: etcd_claims.clone(),
                    liveness: liveness.clone(),
                    node: config.node_name.clone(),
                    lease_ttl: c.lease_ttl,
                    call_timeout: c.call_timeout,
                    attach_timeout: c.attach_timeout,
                    fencing_plugins: c.fencing_plugins.clone(),
                    free_unfenced: c.free_unfenced_claims,
                    csi_call: config.timeouts.csi_call,
                    shutdown: shutdown.clone(),
                })
                .map_err(io_err("failed to start the reaper thread"))?;
                Some(Arc::new((host, rule)))
            }
            _ => None,
        };
        // Requests are served only once the restore has run.
        let mut observer = Observer::new(lifecycle.clone(), registry.clone());
        observer.cluster = liveness.clone();
        observer.docker = config
            .docker
            .as_ref()
            .map(|_| crate::docker::RuleHealth::default());
        let fail = |e: AgentError, threads: Threads| {
            shutdown.trigger();
            let deadline = Instant::now() + config.timeouts.csi_call + STOP_SLACK;
            lifecycle.join(deadline);
            registry.join(deadline);
            threads.join_until(deadline);
            if let Some(l) = &liveness {
                l.join(deadline);
            }
            if let Some(w) = &cluster_work {
                w.0.join(deadline);
                w.1.join(deadline);
            }
            Err(e)
        };
        let api = match ApiServer::start(env, &config.api_socket, observer.clone()) {
            Ok(api) => api,
            Err(e) => return fail(AgentError::Api(e), threads),
        };
        let started = observer
            .start_volume_stats(&mut threads, config.volume_stats_interval, shutdown.clone())
            .map_err(io_err("failed to start the volume stats poller"))
            .and_then(|()| match listener {
                Some(l) => {
                    crate::observe::http::start(l, observer.clone(), &mut threads, shutdown.clone())
                        .map_err(io_err("failed to start the metrics listener"))
                }
                None => Ok(()),
            })
            .and_then(|()| match &config.docker {
                // The Docker plugin socket after the restore, so containers
                // restarted at boot find their volumes mounted.
                Some(d) => crate::docker::start(
                    d,
                    lifecycle.clone(),
                    cluster
                        .as_ref()
                        .map(|(e, _, _)| (e.client().clone(), e.prefix().to_string())),
                    observer.docker.clone().unwrap_or_default(),
                    &mut threads,
                    shutdown.clone(),
                )
                .map_err(|e| AgentError::Io {
                    what: "the Docker volume plugin cannot start".into(),
                    source: std::io::Error::other(crate::error_chain(&e)),
                }),
                None => Ok(()),
            });
        if let Err(e) = started {
            return fail(e, threads);
        }
        // Ready once the API answers (the restore is done by now).
        if notifier.enabled() && std::os::unix::net::UnixStream::connect(&config.api_socket).is_ok()
        {
            let allocs = lifecycle.store().read(|s| s.allocs.len());
            notifier.notify(&format!(
                "READY=1\nSTATUS=ready: {allocs} allocations, {} restored in the background",
                report.in_background
            ));
        }
        Ok(Agent {
            config,
            shutdown,
            lifecycle,
            registry,
            dev,
            observer,
            api,
            liveness,
            cluster_work,
            threads,
            notifier,
        })
    }

    /// Stops: in dev mode releases everything first (bounded), then stops
    /// every loop and joins the threads within the CSI deadline plus slack.
    pub fn stop(mut self) {
        self.notifier.notify("STOPPING=1\nSTATUS=stopping");
        // Stop taking requests first.
        let api_left = self.api.stop(Instant::now() + STOP_SLACK);
        if self.dev {
            let allocs: Vec<String> = self
                .lifecycle
                .store()
                .read(|s| s.allocs.keys().cloned().collect());
            if !allocs.is_empty() {
                log::info!(
                    "dev mode: releasing {} allocation(s) before exit",
                    allocs.len()
                );
            }
            let deadline = Instant::now() + DEV_RELEASE_DEADLINE;
            for a in &allocs {
                if let Err(e) = self.lifecycle.release(a) {
                    log::warn!("dev mode: release of {a}: {}", crate::error_chain(&e));
                }
            }
            for a in &allocs {
                let left = deadline.saturating_duration_since(Instant::now());
                if !self.lifecycle.wait_released(a, left) {
                    log::warn!(
                        "dev mode: allocation {a} not released before the deadline; leaving it"
                    );
                }
            }
        }
        self.shutdown.trigger();
        let deadline = Instant::now() + self.config.timeouts.csi_call + STOP_SLACK;
        let mut left = api_left;
        left.extend(self.lifecycle.join(deadline));
        left.extend(self.registry.join(deadline));
        if let Some(l) = &self.liveness {
            left.extend(l.join(deadline));
        }
        if let Some(w) = &self.cluster_work {
            left.extend(w.0.join(deadline));
            left.extend(w.1.join(deadline));
        }
        left.extend(self.threads.join_until(deadline));
        if !left.is_empty() {
            log::warn!("threads still running at exit: {}", left.join(", "));
        }
        // Leave one complete state.json behind (the next start would fold
        // the journal in anyway).
        if let Err(e) = self.lifecycle.store().compact() {
            log::warn!("{}", crate::error_chain(&e));
        }
        if self.dev {
            remove_dev_dir(&self.config);
        }
        log::info!("stopped");
    }
}

/// Gives back to the kernel the heap the start freed: reading the state
/// (the snapshot's text, the journal's lines) and the mount table (1.5 MB of
/// text with 10,000 mounts) peaks well above what the agent keeps, and glibc
/// holds freed memory for reuse unless asked (the figure: the manual's
/// performance.md, "RSS with 10,000").
fn release_start_heap() {
    crate::heap::give_back();
}

/// Sends WATCHDOG=1 every `every` while the state can be read (a state
/// lock that never comes back stops the pings, and systemd restarts the
/// agent).
fn start_watchdog(
    threads: &mut Threads,
    notifier: &Notifier,
    store: &Arc<StateStore>,
    every: Duration,
    shutdown: &Shutdown,
) -> Result<(), AgentError> {
    let (n, s, stop) = (notifier.clone(), store.clone(), shutdown.clone());
    log::info!("systemd watchdog: a ping every {every:?}");
    threads
        .spawn("watchdog", move || loop {
            s.read(|_| ());
            n.notify("WATCHDOG=1");
            if !stop.sleep(every) {
                return;
            }
        })
        .map_err(io_err("failed to start the watchdog thread"))
}

/// Removes the `--dev` directory when nothing is left mounted below it;
/// otherwise says what is left and keeps it.
fn remove_dev_dir(config: &Config) {
    let Some(base) = config.state_dir.parent() else {
        return;
    };
    let left = crate::mounts::MountTable::read()
        .map(|t| t.under(base))
        .unwrap_or_default();
    if !left.is_empty() {
        log::warn!(
            "dev mode: {} mount(s) left under {}; keeping it",
            left.len(),
            base.display()
        );
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(base) {
        log::warn!("dev mode: cannot remove {}: {e}", base.display());
    }
}

/// The throwaway directory of `--dev`: `$TMPDIR/claimd-dev`. It outlives a
/// crash (a restarted `--dev` agent picks its allocations up, which is what
/// the quickstart shows) and is removed by a graceful stop that released
/// everything. A second `--dev` agent at once is refused by the state lock.
pub fn dev_dir() -> Result<PathBuf, AgentError> {
    let base = std::env::temp_dir().join("claimd-dev");
    std::fs::create_dir_all(&base).map_err(io_err(format!(
        "failed to create dev directory {}",
        base.display()
    )))?;
    Ok(base)
}

/// Backoff of a reconciliation that failed (etcd unreachable, a release
/// that could not start).
const RECONCILE_BACKOFF: crate::retry::BackoffPolicy =
    crate::retry::BackoffPolicy::new(Duration::from_millis(250), Duration::from_secs(10));

/// After each registration of this node's liveness: reconcile this node's
/// claims with its records until that succeeded once, releasing the
/// allocations whose claims the cluster freed.
fn reconcile_loop(
    reconciler: &EtcdClaims,
    node: &str,
    root: &std::path::Path,
    lifecycle: &std::sync::OnceLock<Lifecycle>,
    stop: &Shutdown,
    registered: &crossbeam_channel::Receiver<()>,
) {
    loop {
        crossbeam_channel::select! {
            recv(registered) -> r => if r.is_err() { return },
            recv(stop.receiver()) -> _ => return,
        }
        while registered.try_recv().is_ok() {}
        let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        let mut backoff = crate::retry::Backoff::new(RECONCILE_BACKOFF, far);
        loop {
            let done = match reconciler.reconcile(node, root) {
                Ok(r) => {
                    crate::metrics::RECONCILIATIONS.inc();
                    if !r.freed.is_empty() || !r.kept.is_empty() {
                        log::info!(
                            "cluster: reconciliation freed {} orphaned claim(s) of this node, kept {}",
                            r.freed.len(),
                            r.kept.len()
                        );
                    }
                    // The first registration can come before the lifecycle
                    // exists (it is made right after start).
                    while !r.lost.is_empty() && lifecycle.get().is_none() {
                        if !stop.sleep(Duration::from_millis(20)) {
                            return;
                        }
                    }
                    release_lost(lifecycle.get(), &r.lost)
                }
                Err(e) => {
                    log::warn!("cluster: reconciliation failed: {e} (retrying)");
                    false
                }
            };
            if done || backoff.wait(stop).is_err() {
                break;
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

/// The etcd client of the cluster section (nothing is sent yet: an etcd
/// that is down shows when it is first used).
fn connect_etcd(
    c: &crate::config::ClusterConfig,
) -> Result<crate::etcd::EtcdClient, crate::etcd::EtcdError> {
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
    crate::etcd::EtcdClient::connect(
        &c.endpoints,
        crate::etcd::EtcdOptions {
            call_timeout: c.call_timeout,
            tls,
        },
    )
}
