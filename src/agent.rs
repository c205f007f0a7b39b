//! The agent process, started in named phases (open the state and the
//! plugin registry, join the cluster, restore, serve), and a graceful stop
//! bounded by the longest CSI deadline. What a start has running is
//! joined by one `Running::join_all`, on stop and when serving fails to
//! start; a start that fails earlier (joining the cluster, the restore's
//! cluster work) returns at once, and its threads end on the stop signal
//! (`claimd agent` gives it on every exit).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::ApiServer;
use crate::claims::fencing::Fencing;
use crate::claims::margins::ReleaseBounds;
use crate::claims::{ClaimStore, EmbeddedClaims};
use crate::cluster::{ClusterWork, JoinParts, Member, NodeLiveness};
use crate::config::{ClusterConfig, Config};
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
    /// Everything started that is joined at stop.
    running: Running,
    notifier: Notifier,
}

impl Agent {
    /// Starts in named phases: opens the state and the plugin registry
    /// (`open_state`), joins the cluster in cluster mode (`join_cluster`),
    /// restores every recorded allocation (`restore`), then serves
    /// requests (`serve`). A bad metrics address stops the start before
    /// anything else.
    pub fn start(config: Config, dev: bool, shutdown: Shutdown) -> Result<Agent, AgentError> {
        let listener = match config.metrics_listen {
            Some(addr) => Some(
                crate::observe::http::bind(addr)
                    .map_err(|source| AgentError::MetricsListen { addr, source })?,
            ),
            None => None,
        };
        let notifier = Notifier::from_env();
        let mut opened = open_state(&config, &notifier, &shutdown)?;
        let member = match &config.cluster {
            None => None,
            Some(c) => Some(join_cluster(&config, c, &mut opened, &shutdown)?),
        };
        let restored = restore(&config, opened, member, &notifier, &shutdown)?;
        serve(
            Serving {
                config,
                dev,
                shutdown,
                notifier,
                listener,
            },
            restored,
        )
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
        let mut left = api_left;
        left.extend(
            self.running
                .join_all(&self.shutdown, self.config.timeouts.csi_call),
        );
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

/// What the first phase opened.
struct Opened {
    store: Arc<StateStore>,
    env: Arc<grpcio::Environment>,
    registry: Registry,
    /// The watchdog so far; then the reconciliation, the volume stats
    /// poller, the metrics listener and the Docker plugin.
    threads: Threads,
}

/// Opens the state (creating the mount root), starts the systemd watchdog
/// and the plugin registry.
fn open_state(
    config: &Config,
    notifier: &Notifier,
    shutdown: &Shutdown,
) -> Result<Opened, AgentError> {
    notifier.status("opening the state");
    std::fs::create_dir_all(&config.mount_root).map_err(io_err(format!(
        "failed to create mount root {}",
        config.mount_root.display()
    )))?;
    let store = Arc::new(StateStore::open(&config.state_dir)?);
    let mut threads = Threads::new();
    if let Some(every) = crate::systemd::watchdog_interval() {
        start_watchdog(&mut threads, notifier, &store, every, shutdown)?;
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
    Ok(Opened {
        store,
        env,
        registry,
        threads,
    })
}

impl From<crate::cluster::StartError> for AgentError {
    fn from(e: crate::cluster::StartError) -> Self {
        AgentError::Io {
            what: e.what.to_string(),
            source: e.source,
        }
    }
}

/// Cluster mode: the etcd client, this node's identity and fencing, then
/// claims in etcd, the reconciliation and this node's liveness.
fn join_cluster(
    config: &Config,
    c: &ClusterConfig,
    opened: &mut Opened,
    shutdown: &Shutdown,
) -> Result<Member, AgentError> {
    let client = crate::cluster::connect(c).map_err(AgentError::Cluster)?;
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
            opened.store.boot_id(),
            ReleaseBounds::new(
                c.stop_after_disconnect,
                c.lease_ttl,
                config.timeouts.csi_call,
            ),
        )
        .map_err(|e| AgentError::Identity(crate::error_chain(&e)))?,
    );
    Ok(Member::join(
        JoinParts {
            client,
            config: c,
            node: &config.node_name,
            mount_root: &config.mount_root,
            csi_call: config.timeouts.csi_call,
            store: opened.store.clone(),
            fencing,
            shutdown,
        },
        &mut opened.threads,
    )?)
}

/// What runs once the state is restored: joined by `join_all`, on stop
/// and when serving fails to start.
struct Running {
    lifecycle: Lifecycle,
    registry: Registry,
    /// Cluster mode: this node's liveness in etcd.
    liveness: Option<Arc<NodeLiveness>>,
    /// Cluster mode: controller work for other nodes, the disconnect rule.
    cluster_work: Option<ClusterWork>,
    threads: Threads,
}

impl Running {
    /// Stops every loop and joins every thread within `call` (the CSI call
    /// deadline) plus `STOP_SLACK`; names the threads still running.
    fn join_all(self, shutdown: &Shutdown, call: Duration) -> Vec<String> {
        shutdown.trigger();
        let deadline = Instant::now() + call + STOP_SLACK;
        let mut left = self.lifecycle.join(deadline);
        left.extend(self.registry.join(deadline));
        if let Some(l) = &self.liveness {
            left.extend(l.join(deadline));
        }
        if let Some(w) = &self.cluster_work {
            left.extend(w.join(deadline));
        }
        left.extend(self.threads.join_until(deadline));
        left
    }
}

/// What the restore leaves for serving.
struct Restored {
    running: Running,
    member: Option<Member>,
    env: Arc<grpcio::Environment>,
    /// Allocations whose restore goes on in the background.
    in_background: usize,
}

/// The lifecycle, the self-release armed before the restore (so a restart
/// during a partition does not reset it), the restore itself, then the
/// cluster work for other nodes once this node's own allocations are back.
fn restore(
    config: &Config,
    opened: Opened,
    member: Option<Member>,
    notifier: &Notifier,
    shutdown: &Shutdown,
) -> Result<Restored, AgentError> {
    let Opened {
        store,
        env,
        registry,
        threads,
    } = opened;
    let claims: Arc<dyn ClaimStore> = match &member {
        None => Arc::new(EmbeddedClaims::new(store.clone())),
        Some(m) => m.claims.clone(),
    };
    let opts = lifecycle_options(config);
    let rebooted = store.rebooted();
    let lifecycle = Lifecycle::new(store, claims, registry.clone(), opts, shutdown.clone());
    let rule = match &member {
        None => None,
        Some(m) => {
            m.hand_lifecycle(&lifecycle);
            Some(m.arm_self_release(lifecycle.clone(), rebooted, shutdown.clone())?)
        }
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
    let cluster_work = match (&member, rule) {
        (Some(m), Some(rule)) => Some(m.start_work(
            rule,
            registry.clone(),
            config.timeouts.csi_call,
            shutdown.clone(),
        )?),
        _ => None,
    };
    Ok(Restored {
        running: Running {
            lifecycle,
            registry,
            liveness: member.as_ref().map(|m| m.liveness.clone()),
            cluster_work,
            threads,
        },
        member,
        env,
        in_background: report.in_background,
    })
}

/// The lifecycle's options from the config; warns of a fencing plugin
/// that is not given the claim's epoch.
fn lifecycle_options(config: &Config) -> LifecycleOptions {
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
    opts
}

/// What serving needs besides what the restore left.
struct Serving {
    config: Config,
    dev: bool,
    shutdown: Shutdown,
    notifier: Notifier,
    listener: Option<std::net::TcpListener>,
}

/// Requests are served only once the restore has run: the API, the volume
/// stats poller, the metrics listener and the Docker plugin; then READY.
/// A failure here stops and joins everything started.
fn serve(s: Serving, restored: Restored) -> Result<Agent, AgentError> {
    let Serving {
        config,
        dev,
        shutdown,
        notifier,
        listener,
    } = s;
    let Restored {
        mut running,
        member,
        env,
        in_background,
    } = restored;
    let lifecycle = running.lifecycle.clone();
    let registry = running.registry.clone();
    let mut observer = Observer::new(lifecycle.clone(), registry.clone());
    observer.cluster = running.liveness.clone();
    observer.docker = config
        .docker
        .as_ref()
        .map(|_| crate::docker::RuleHealth::default());
    let fail = |e: AgentError, running: Running| {
        let _ = running.join_all(&shutdown, config.timeouts.csi_call);
        Err(e)
    };
    let api = match ApiServer::start(env, &config.api_socket, observer.clone()) {
        Ok(api) => api,
        Err(e) => return fail(AgentError::Api(e), running),
    };
    let threads = &mut running.threads;
    let started = observer
        .start_volume_stats(threads, config.volume_stats_interval, shutdown.clone())
        .map_err(io_err("failed to start the volume stats poller"))
        .and_then(|()| match listener {
            Some(l) => crate::observe::http::start(l, observer.clone(), threads, shutdown.clone())
                .map_err(io_err("failed to start the metrics listener")),
            None => Ok(()),
        })
        .and_then(|()| match &config.docker {
            // The Docker plugin socket after the restore, so containers
            // restarted at boot find their volumes mounted.
            Some(d) => crate::docker::start(
                d,
                lifecycle.clone(),
                member
                    .as_ref()
                    .map(|m| (m.claims.client().clone(), m.claims.prefix().to_string())),
                observer.docker.clone().unwrap_or_default(),
                threads,
                shutdown.clone(),
            )
            .map_err(|e| AgentError::Io {
                what: "the Docker volume plugin cannot start".into(),
                source: std::io::Error::other(crate::error_chain(&e)),
            }),
            None => Ok(()),
        });
    if let Err(e) = started {
        return fail(e, running);
    }
    // Ready once the API answers (the restore is done by now).
    if notifier.enabled() && std::os::unix::net::UnixStream::connect(&config.api_socket).is_ok() {
        let allocs = lifecycle.store().read(|s| s.allocs.len());
        notifier.notify(&format!(
            "READY=1\nSTATUS=ready: {allocs} allocations, {in_background} restored in the background"
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
        running,
        notifier,
    })
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
