//! The local API (`proto/claimd.proto`): the grpcio server on a unix socket
//! (mode 0600) and the conversions between its messages and the library's
//! types. Every request runs on its own named thread, so a mount waiting
//! for a plugin or a held claim never blocks gRPC's completion queue.

use std::fmt;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grpcio::{RpcContext, RpcStatus, RpcStatusCode, UnarySink};
use parking_lot::Mutex;

use crate::lifecycle::{
    AllocStatus, Lifecycle, MountError, MountedVolume, ReleaseError, ReleaseStart, ReleaseState,
    VolumeRegistryError,
};
use crate::observe::{Observer, StatsEntry};
use crate::plugins::{PluginSnapshot, Registry};
use crate::threads::Threads;
use crate::volumes::{AccessMode, AttachmentMode, MountOptions, VolumeRequest, VolumeSpec};

/// The wire messages of the local API.
pub use crate::generated::claimd as wire;
use wire as w;

/// grpcio method descriptors, the blocking client and the server trait.
#[allow(clippy::all, clippy::unwrap_used)]
pub mod grpc {
    include!(concat!(env!("OUT_DIR"), "/claimd_grpc.rs"));
}

/// How long a request thread waits for its reply to be delivered.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest wait a release request may ask for.
pub const MAX_RELEASE_WAIT: Duration = Duration::from_secs(3600);

fn status(code: RpcStatusCode, msg: impl Into<String>) -> RpcStatus {
    RpcStatus::with_message(code, msg.into())
}

fn mount_status(e: &MountError) -> RpcStatus {
    let code = match e {
        MountError::Invalid(_) => RpcStatusCode::INVALID_ARGUMENT,
        MountError::UnknownVolume { .. } => RpcStatusCode::NOT_FOUND,
        MountError::UnknownPlugin { .. } => RpcStatusCode::NOT_FOUND,
        MountError::Busy { .. } => RpcStatusCode::FAILED_PRECONDITION,
        MountError::Plugin { .. } => RpcStatusCode::UNAVAILABLE,
        MountError::Claim { source, .. } if source.is_retryable() => {
            RpcStatusCode::RESOURCE_EXHAUSTED
        }
        MountError::Claim { .. } => RpcStatusCode::FAILED_PRECONDITION,
        MountError::Csi { .. } => RpcStatusCode::INTERNAL,
        MountError::Timeout { .. } => RpcStatusCode::DEADLINE_EXCEEDED,
        MountError::Incompatible { .. } => RpcStatusCode::FAILED_PRECONDITION,
        MountError::VolumeLimit { .. } => RpcStatusCode::RESOURCE_EXHAUSTED,
        MountError::State(_) => RpcStatusCode::INTERNAL,
        MountError::Shutdown => RpcStatusCode::UNAVAILABLE,
    };
    status(code, crate::error_chain(e))
}

fn release_status(e: &ReleaseError) -> RpcStatus {
    let code = match e {
        ReleaseError::Invalid(_) => RpcStatusCode::INVALID_ARGUMENT,
        ReleaseError::Stopping => RpcStatusCode::UNAVAILABLE,
        _ => RpcStatusCode::INTERNAL,
    };
    status(code, crate::error_chain(e))
}

fn registry_status(e: &VolumeRegistryError) -> RpcStatus {
    let code = match e {
        VolumeRegistryError::Invalid(_) => RpcStatusCode::INVALID_ARGUMENT,
        VolumeRegistryError::InUse { .. } => RpcStatusCode::FAILED_PRECONDITION,
        VolumeRegistryError::Claims(_) => RpcStatusCode::UNAVAILABLE,
        VolumeRegistryError::State(_) => RpcStatusCode::INTERNAL,
    };
    status(code, crate::error_chain(e))
}

// ---- conversions ----------------------------------------------------------

/// A wire volume into a spec (validated by the caller).
pub fn volume_from_wire(v: &w::Volume) -> Result<VolumeSpec, String> {
    let access_modes = v
        .access_modes
        .iter()
        .map(|m| AccessMode::parse(m).ok_or_else(|| format!("unknown access mode {m:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    let attachment_modes = v
        .attachment_modes
        .iter()
        .map(|m| AttachmentMode::parse(m).ok_or_else(|| format!("unknown attachment mode {m:?}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(VolumeSpec {
        id: v.id.clone(),
        plugin_id: v.plugin_id.clone(),
        external_id: v.external_id.clone(),
        access_modes,
        attachment_modes,
        mount_options: MountOptions {
            fs_type: v.fs_type.clone(),
            mount_flags: v.mount_flags.clone(),
        },
        context: v
            .context
            .iter()
            .map(|(k, x)| (k.clone(), x.clone()))
            .collect(),
        secrets: v
            .secrets
            .iter()
            .map(|(k, x)| (k.clone(), x.clone()))
            .collect(),
    })
}

/// A spec onto the wire, without secret values.
pub fn volume_to_wire(s: &VolumeSpec) -> w::Volume {
    let mut v = w::Volume::new();
    v.id = s.id.clone();
    v.plugin_id = s.plugin_id.clone();
    v.external_id = s.external_id.clone();
    v.access_modes = s
        .access_modes
        .iter()
        .map(|m| m.name().to_string())
        .collect();
    v.attachment_modes = s
        .attachment_modes
        .iter()
        .map(|m| m.name().to_string())
        .collect();
    v.fs_type = s.mount_options.fs_type.clone();
    v.mount_flags = s.mount_options.mount_flags.clone();
    v.context = s.context.clone().into_iter().collect();
    v.secret_keys = s.secrets.keys().cloned().collect();
    v
}

pub fn request_from_wire(r: &w::VolumeRequest) -> Result<crate::volumes::VolumeRequest, String> {
    let access_mode = match r.access_mode.as_str() {
        "" => None,
        m => Some(AccessMode::parse(m).ok_or_else(|| format!("unknown access mode {m:?}"))?),
    };
    let attachment = match r.attachment_mode.as_str() {
        "" => None,
        m => {
            Some(AttachmentMode::parse(m).ok_or_else(|| format!("unknown attachment mode {m:?}"))?)
        }
    };
    Ok(crate::volumes::VolumeRequest {
        alias: r.alias.clone(),
        volume_id: r.volume_id.clone(),
        read_only: r.read_only,
        access_mode,
        attachment,
        mount_flags: r.mount_flags.clone(),
    })
}

fn mounted_to_wire(m: &MountedVolume) -> w::MountedVolume {
    let mut w = w::MountedVolume::new();
    w.alias = m.alias.clone();
    w.volume_id = m.volume_id.clone();
    w.host_path = m.host_path.to_string_lossy().into_owned();
    w.read_only = m.read_only;
    w.block = m.block;
    w
}

fn release_state_parts(st: &ReleaseState) -> (&'static str, String, u32) {
    match st {
        ReleaseState::InProgress => ("in-progress", String::new(), 0),
        ReleaseState::Retrying { error, attempts } => ("retrying", error.clone(), *attempts),
        ReleaseState::Released => ("released", String::new(), 0),
        ReleaseState::Stopped { error } => ("stopped", error.clone(), 0),
    }
}

pub fn alloc_to_wire(a: &AllocStatus) -> w::AllocStatus {
    let mut w = w::AllocStatus::new();
    w.id = a.id.clone();
    w.releasing = a.releasing;
    w.volumes = a
        .volumes
        .iter()
        .map(|v| {
            let mut x = w::AllocVolumeStatus::new();
            x.alias = v.alias.clone();
            x.volume_id = v.volume_id.clone();
            x.plugin_id = v.plugin_id.clone();
            // A volume whose record is gone was released (only its
            // release report is left).
            // The live step of a running operation when there is one
            // (`alloc status` shows where it is; `claimd state` the durable
            // phase).
            x.phase = match (&v.step, v.phase) {
                (Some(step), _) => step.clone(),
                (None, Some(p)) => p.name().to_string(),
                (None, None) => "released".to_string(),
            };
            x.host_path = v.host_path.to_string_lossy().into_owned();
            x.read_only = v.read_only;
            x.attachment_mode = if v.volume_id.is_empty() {
                String::new()
            } else {
                v.attachment.name().to_string()
            };
            if let Some(st) = &v.release {
                let (s, e, _) = release_state_parts(st);
                x.release_state = s.to_string();
                x.release_error = e;
            }
            x.message = v.message.clone();
            x
        })
        .collect();
    w
}

/// The latest volume stats onto the wire.
pub fn stats_to_wire(e: &StatsEntry) -> w::VolumeStats {
    let mut x = w::VolumeStats::new();
    x.error = e.error.clone();
    if let Some((at, s)) = &e.stats {
        x.at_unix_ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        if let Some(b) = s.bytes {
            x.has_bytes = true;
            x.capacity_bytes = b.total;
            x.used_bytes = b.used;
            x.available_bytes = b.available;
        }
        if let Some(i) = s.inodes {
            x.has_inodes = true;
            x.inodes = i.total;
            x.inodes_used = i.used;
            x.inodes_free = i.available;
        }
        if let Some(c) = &s.condition {
            x.has_condition = true;
            x.abnormal = c.abnormal;
            x.condition_message = c.message.clone();
        }
    }
    x
}

/// An allocation's status with the latest volume stats of each volume.
fn alloc_with_stats(o: &Observer, a: &AllocStatus) -> w::AllocStatus {
    let mut x = alloc_to_wire(a);
    for v in &mut x.volumes {
        if let Some(e) = o.stats.get(&a.id, &v.alias) {
            v.stats = protobuf::MessageField::some(stats_to_wire(&e));
        }
    }
    x
}

pub fn plugin_to_wire(p: &PluginSnapshot) -> w::Plugin {
    let mut w = w::Plugin::new();
    w.id = p.id.clone();
    w.type_ = p.plugin_type.name().to_string();
    w.socket = p.socket.to_string_lossy().into_owned();
    w.health = p.health.name().to_string();
    w.reason = p.reason.clone();
    if let Some(i) = &p.info {
        w.name = i.name.clone();
        w.vendor_version = i.vendor_version.clone();
    }
    if let Some(n) = &p.node_info {
        w.node_id = n.node_id.clone();
        w.max_volumes_per_node = n.max_volumes_per_node;
    }
    let mut caps = Vec::new();
    if let Some(c) = &p.plugin_capabilities {
        if c.controller_service {
            caps.push("CONTROLLER_SERVICE");
        }
        if c.accessibility_constraints {
            caps.push("VOLUME_ACCESSIBILITY_CONSTRAINTS");
        }
    }
    if let Some(c) = &p.node_capabilities {
        if c.stage_unstage_volume {
            caps.push("STAGE_UNSTAGE_VOLUME");
        }
        if c.get_volume_stats {
            caps.push("GET_VOLUME_STATS");
        }
    }
    if let Some(c) = &p.controller_capabilities {
        if c.create_delete_volume {
            caps.push("CREATE_DELETE_VOLUME");
        }
        if c.publish_unpublish_volume {
            caps.push("PUBLISH_UNPUBLISH_VOLUME");
        }
        if c.publish_readonly {
            caps.push("PUBLISH_READONLY");
        }
    }
    w.capabilities = caps.into_iter().map(String::from).collect();
    w.source = p.source.to_string();
    w.generation = p.generation;
    w
}

// ---- the server -----------------------------------------------------------

#[derive(Clone)]
struct Service {
    lifecycle: Lifecycle,
    registry: Registry,
    observer: Observer,
    threads: Arc<Mutex<Option<Threads>>>,
}

impl Service {
    /// Runs `f` on its own thread and answers with its result.
    fn run<R: Send + 'static>(
        &self,
        ctx: &RpcContext<'_>,
        name: &str,
        sink: UnarySink<R>,
        f: impl FnOnce(&Service) -> Result<R, RpcStatus> + Send + 'static,
    ) {
        let me = self.clone();
        let mut guard = self.threads.lock();
        let Some(threads) = guard.as_mut() else {
            let reply = sink.fail(status(RpcStatusCode::UNAVAILABLE, "the agent is stopping"));
            ctx.spawn(async move {
                let _ = reply.await;
            });
            return;
        };
        // The sink moves into the thread; if the spawn fails it is lost and
        // the client sees the call cancelled.
        let spawned = threads.spawn(format!("api-{name}"), move || {
            let result = f(&me);
            let reply = match result {
                Ok(r) => sink.success(r),
                Err(s) => sink.fail(s),
            };
            // Keep the reply alive until it is sent (see threads::block_on).
            if crate::threads::block_on(reply, REPLY_TIMEOUT).is_none() {
                log::warn!("an API reply was not delivered within {REPLY_TIMEOUT:?}");
            }
        });
        if let Err(e) = spawned {
            log::error!("cannot start an API thread: {e}");
        }
    }
}

impl grpc::Claimd for Service {
    fn register_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::RegisterVolumeRequest,
        sink: UnarySink<w::RegisterVolumeResponse>,
    ) {
        self.run(&ctx, "register", sink, move |s| {
            let Some(v) = req.volume.as_ref() else {
                return Err(status(
                    RpcStatusCode::INVALID_ARGUMENT,
                    "the request has no volume",
                ));
            };
            let spec = volume_from_wire(v).map_err(|e| {
                status(
                    RpcStatusCode::INVALID_ARGUMENT,
                    format!("volume {}: {e}", v.id),
                )
            })?;
            let warnings = s
                .lifecycle
                .register_volume(spec)
                .map_err(|e| registry_status(&e))?;
            log::info!("volume {} registered", v.id);
            for warning in &warnings {
                log::warn!("{warning}");
            }
            let mut r = w::RegisterVolumeResponse::new();
            r.warnings = warnings;
            Ok(r)
        });
    }

    fn deregister_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::DeregisterVolumeRequest,
        sink: UnarySink<w::DeregisterVolumeResponse>,
    ) {
        self.run(&ctx, "deregister", sink, move |s| {
            let found = s
                .lifecycle
                .deregister_volume(&req.volume_id)
                .map_err(|e| registry_status(&e))?;
            let mut r = w::DeregisterVolumeResponse::new();
            r.found = found;
            Ok(r)
        });
    }

    fn list_volumes(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::ListVolumesRequest,
        sink: UnarySink<w::ListVolumesResponse>,
    ) {
        self.run(&ctx, "list-volumes", sink, |s| {
            let mut r = w::ListVolumesResponse::new();
            r.volumes = s
                .lifecycle
                .list_volumes()
                .map_err(|e| registry_status(&e))?
                .iter()
                .map(|v| {
                    let mut w = volume_to_wire(v);
                    w.plugin_health = s.lifecycle.plugin_health(&v.plugin_id);
                    w
                })
                .collect();
            Ok(r)
        });
    }

    fn mount_alloc(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::MountAllocRequest,
        sink: UnarySink<w::MountAllocResponse>,
    ) {
        self.run(&ctx, "mount", sink, move |s| {
            let reqs: Vec<VolumeRequest> = req
                .volumes
                .iter()
                .map(request_from_wire)
                .collect::<Result<_, _>>()
                .map_err(|e| status(RpcStatusCode::INVALID_ARGUMENT, e))?;
            let mounted = s
                .lifecycle
                .mount(&req.alloc_id, &reqs)
                .map_err(|e| mount_status(&e))?;
            let mut r = w::MountAllocResponse::new();
            r.volumes = mounted.iter().map(mounted_to_wire).collect();
            Ok(r)
        });
    }

    fn release_alloc(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::ReleaseAllocRequest,
        sink: UnarySink<w::ReleaseAllocResponse>,
    ) {
        self.run(&ctx, "release", sink, move |s| {
            let started = s
                .lifecycle
                .release(&req.alloc_id)
                .map_err(|e| release_status(&e))?;
            let mut r = w::ReleaseAllocResponse::new();
            r.found = started == ReleaseStart::Started;
            r.done = if r.found {
                let wait = Duration::from_millis(req.wait_ms).min(MAX_RELEASE_WAIT);
                s.lifecycle.wait_released(&req.alloc_id, wait)
            } else {
                true
            };
            if r.found {
                r.volumes = s
                    .lifecycle
                    .release_status(&req.alloc_id)
                    .iter()
                    .map(|(alias, st)| {
                        let (state, error, attempts) = release_state_parts(st);
                        let mut v = w::VolumeReleaseStatus::new();
                        v.alias = alias.clone();
                        v.state = state.to_string();
                        v.error = error;
                        v.attempts = attempts;
                        v
                    })
                    .collect();
            }
            Ok(r)
        });
    }

    fn get_alloc(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::GetAllocRequest,
        sink: UnarySink<w::GetAllocResponse>,
    ) {
        self.run(&ctx, "get-alloc", sink, move |s| {
            crate::ids::check_id("allocation", &req.alloc_id)
                .map_err(|e| status(RpcStatusCode::INVALID_ARGUMENT, e.to_string()))?;
            match s.lifecycle.alloc_status(&req.alloc_id) {
                Some(a) => {
                    let mut r = w::GetAllocResponse::new();
                    r.alloc = protobuf::MessageField::some(alloc_with_stats(&s.observer, &a));
                    Ok(r)
                }
                None => Err(status(
                    RpcStatusCode::NOT_FOUND,
                    format!("allocation {} is not known to this agent", req.alloc_id),
                )),
            }
        });
    }

    fn list_allocs(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::ListAllocsRequest,
        sink: UnarySink<w::ListAllocsResponse>,
    ) {
        self.run(&ctx, "list-allocs", sink, |s| {
            let mut r = w::ListAllocsResponse::new();
            r.allocs = s
                .lifecycle
                .list_allocs()
                .iter()
                .map(|a| alloc_with_stats(&s.observer, a))
                .collect();
            Ok(r)
        });
    }

    fn get_stats(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::GetStatsRequest,
        sink: UnarySink<w::GetStatsResponse>,
    ) {
        self.run(&ctx, "stats", sink, |s| {
            let store = s.lifecycle.store();
            let ws = store.write_stats();
            let mut r = w::GetStatsResponse::new();
            r.state_writes = ws.writes;
            r.state_bytes_written = ws.bytes;
            r.state_fsyncs = ws.fsyncs;
            r.state_snapshots = ws.snapshots;
            store.read(|st| {
                r.allocs = st.allocs.len() as u64;
                r.volumes = st.volumes.len() as u64;
                r.claims = st.claims.len() as u64;
            });
            Ok(r)
        });
    }

    fn get_metrics(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::GetMetricsRequest,
        sink: UnarySink<w::GetMetricsResponse>,
    ) {
        self.run(&ctx, "metrics", sink, |s| {
            let mut r = w::GetMetricsResponse::new();
            r.text = s.observer.metrics_text();
            Ok(r)
        });
    }

    fn get_health(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::GetHealthRequest,
        sink: UnarySink<w::GetHealthResponse>,
    ) {
        self.run(&ctx, "health", sink, |s| {
            let mut r = w::GetHealthResponse::new();
            // Requests are served only once the restore has run.
            r.ready = true;
            r.problems = s.observer.problems();
            Ok(r)
        });
    }

    fn list_claims(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::ListClaimsRequest,
        sink: UnarySink<w::ListClaimsResponse>,
    ) {
        self.run(&ctx, "list-claims", sink, move |s| {
            let claims = s
                .lifecycle
                .try_list_claims()
                .map_err(|e| status(RpcStatusCode::UNAVAILABLE, crate::error_chain(&e)))?;
            let mut r = w::ListClaimsResponse::new();
            r.claims = claims
                .iter()
                .filter(|c| req.volume_id.is_empty() || c.volume_id == req.volume_id)
                .map(|c| w::ClaimInfo {
                    volume_id: c.volume_id.clone(),
                    alloc_id: c.alloc_id.clone(),
                    node: c.node.clone(),
                    mode: c.mode.name().to_string(),
                    access_mode: c.access_mode.name().to_string(),
                    state: match c.state {
                        crate::state::ClaimState::Taken => "taken",
                        crate::state::ClaimState::Releasing => "releasing",
                    }
                    .to_string(),
                    external_node_id: c.external_node_id.clone().unwrap_or_default(),
                    ..Default::default()
                })
                .collect();
            Ok(r)
        });
    }

    fn list_plugins(
        &mut self,
        ctx: RpcContext<'_>,
        _req: w::ListPluginsRequest,
        sink: UnarySink<w::ListPluginsResponse>,
    ) {
        self.run(&ctx, "list-plugins", sink, |s| {
            let mut r = w::ListPluginsResponse::new();
            r.plugins = s.registry.list().iter().map(plugin_to_wire).collect();
            Ok(r)
        });
    }
}

#[derive(Debug)]
pub enum ApiError {
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    InUse {
        path: PathBuf,
    },
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    Bind {
        path: PathBuf,
        source: grpcio::Error,
    },
    Chmod {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Dir { path, .. } => {
                write!(
                    f,
                    "failed to create the API socket directory {}",
                    path.display()
                )
            }
            ApiError::InUse { path } => write!(
                f,
                "another agent is already serving the API socket {}",
                path.display()
            ),
            ApiError::RemoveStale { path, .. } => {
                write!(
                    f,
                    "failed to remove the stale API socket {}",
                    path.display()
                )
            }
            ApiError::Bind { path, .. } => {
                write!(f, "failed to listen on the API socket {}", path.display())
            }
            ApiError::Chmod { path, .. } => {
                write!(
                    f,
                    "failed to set mode 0600 on the API socket {}",
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ApiError::Dir { source, .. }
            | ApiError::RemoveStale { source, .. }
            | ApiError::Chmod { source, .. } => Some(source),
            ApiError::Bind { source, .. } => Some(source),
            ApiError::InUse { .. } => None,
        }
    }
}

/// The running API server.
pub struct ApiServer {
    server: Option<grpcio::Server>,
    socket: PathBuf,
    threads: Arc<Mutex<Option<Threads>>>,
}

impl ApiServer {
    /// Listens on `socket` (replacing a stale socket left by a dead agent;
    /// refusing one a live agent answers on) with mode 0600.
    pub fn start(
        env: Arc<grpcio::Environment>,
        socket: &Path,
        observer: Observer,
    ) -> Result<ApiServer, ApiError> {
        if let Some(dir) = socket.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| ApiError::Dir {
                    path: dir.to_path_buf(),
                    source,
                })?;
        }
        if socket.exists() {
            if UnixStream::connect(socket).is_ok() {
                return Err(ApiError::InUse {
                    path: socket.to_path_buf(),
                });
            }
            log::info!("removing stale API socket {}", socket.display());
            std::fs::remove_file(socket).map_err(|source| ApiError::RemoveStale {
                path: socket.to_path_buf(),
                source,
            })?;
        }
        let threads = Arc::new(Mutex::new(Some(Threads::new())));
        let service = grpc::create_claimd(Service {
            lifecycle: observer.lifecycle.clone(),
            registry: observer.registry.clone(),
            observer,
            threads: threads.clone(),
        });
        // The socket is created with the process umask; tighten it first so
        // the socket is never reachable by others, then set 0600 for sure.
        // SAFETY: umask only changes this process's file-creation mask.
        let old = unsafe { libc::umask(0o177) };
        let built = grpcio::ServerBuilder::new(env)
            .register_service(service)
            .build()
            .and_then(|mut s| {
                s.add_listening_port(
                    format!("unix:{}", socket.display()),
                    grpcio::ServerCredentials::insecure(),
                )?;
                Ok(s)
            });
        // SAFETY: restores the previous mask.
        unsafe { libc::umask(old) };
        let mut server = built.map_err(|source| ApiError::Bind {
            path: socket.to_path_buf(),
            source,
        })?;
        server.start();
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(
            |source| ApiError::Chmod {
                path: socket.to_path_buf(),
                source,
            },
        )?;
        log::info!("API listening on {}", socket.display());
        Ok(ApiServer {
            server: Some(server),
            socket: socket.to_path_buf(),
            threads,
        })
    }

    /// Stops taking requests (in-flight calls are cancelled), removes the
    /// socket, and joins request threads up to `deadline`.
    pub fn stop(&mut self, deadline: Instant) -> Vec<String> {
        drop(self.server.take());
        let _ = std::fs::remove_file(&self.socket);
        let threads = self.threads.lock().take();
        threads.map(|t| t.join_until(deadline)).unwrap_or_default()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.stop(Instant::now());
        }
    }
}

/// A blocking client of the local API.
pub struct ApiClient {
    client: grpc::ClaimdClient,
    socket: PathBuf,
}

impl ApiClient {
    pub fn new(env: Arc<grpcio::Environment>, socket: &Path) -> ApiClient {
        let channel =
            grpcio::ChannelBuilder::new(env).connect(&format!("unix:{}", socket.display()));
        ApiClient {
            client: grpc::ClaimdClient::new(channel),
            socket: socket.to_path_buf(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn raw(&self) -> &grpc::ClaimdClient {
        &self.client
    }
}
