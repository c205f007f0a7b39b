//! The local API's gRPC service: each request on a worker thread, errors
//! mapped to status codes by their type.

use std::sync::Arc;
use std::time::Duration;

use grpcio::{RpcContext, RpcStatus, RpcStatusCode, UnarySink};
use parking_lot::Mutex;

use super::convert::*;
use super::{grpc, wire as w, MAX_RELEASE_WAIT, REPLY_TIMEOUT};
use crate::claims::ClaimFilter;
use crate::lifecycle::{
    Lifecycle, MountError, ReleaseError, ReleaseStart, VolumeOpError, VolumeRegistryError,
};
use crate::observe::Observer;
use crate::plugins::Registry;
use crate::threads::Threads;
use crate::volumes::VolumeRequest;

/// An answer larger than this (encoded) is followed by giving the freed
/// heap back to the kernel (`heap::give_back`).
const LARGE_ANSWER_BYTES: u64 = 1 << 20;

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
        MountError::Topology(_) => RpcStatusCode::FAILED_PRECONDITION,
        MountError::MountGroupUnsupported { .. } => RpcStatusCode::FAILED_PRECONDITION,
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

fn volume_op_status(e: &VolumeOpError) -> RpcStatus {
    let code = match e {
        VolumeOpError::Invalid(_) | VolumeOpError::Request(_) | VolumeOpError::Shrink { .. } => {
            RpcStatusCode::INVALID_ARGUMENT
        }
        VolumeOpError::UnknownVolume { .. }
        | VolumeOpError::UnknownSnapshot { .. }
        | VolumeOpError::UnknownPlugin { .. } => RpcStatusCode::NOT_FOUND,
        VolumeOpError::Plugin(_) => RpcStatusCode::UNAVAILABLE,
        VolumeOpError::Unsupported { .. } | VolumeOpError::Conflict { .. } => {
            RpcStatusCode::FAILED_PRECONDITION
        }
        // The plugin's own code, except that its INVALID_ARGUMENT is a
        // refusal of the plugin, not of the request to claimd.
        VolumeOpError::Csi { source, .. } => match source.code() {
            Some(RpcStatusCode::INVALID_ARGUMENT) | None => RpcStatusCode::FAILED_PRECONDITION,
            Some(c) => c,
        },
        VolumeOpError::Registry(e) => return registry_status(e),
        VolumeOpError::Lock(_) => RpcStatusCode::ABORTED,
        VolumeOpError::State(_) => RpcStatusCode::INTERNAL,
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

#[derive(Clone)]
pub struct Service {
    pub(super) lifecycle: Lifecycle,
    pub(super) registry: Registry,
    pub(super) observer: Observer,
    pub(super) threads: Arc<Mutex<Option<Threads>>>,
}

impl Service {
    /// Runs `f` on a pooled thread (`Threads::spawn_pooled`, which saves a
    /// thread's start and end) and answers with its result. For requests
    /// that leave few long-lived records behind; see `run_fresh`.
    fn run<R: protobuf::Message + Send + 'static>(
        &self,
        ctx: &RpcContext<'_>,
        name: &str,
        sink: UnarySink<R>,
        f: impl FnOnce(&Service) -> Result<R, RpcStatus> + Send + 'static,
    ) {
        self.run_on(ctx, name, true, sink, f)
    }

    /// Runs `f` on a new thread and answers with its result: for mounts,
    /// which allocate the records that live on. From pooled threads they
    /// left the heap fragmented (see `Threads::spawn_pooled`).
    fn run_fresh<R: protobuf::Message + Send + 'static>(
        &self,
        ctx: &RpcContext<'_>,
        name: &str,
        sink: UnarySink<R>,
        f: impl FnOnce(&Service) -> Result<R, RpcStatus> + Send + 'static,
    ) {
        self.run_on(ctx, name, false, sink, f)
    }

    fn run_on<R: protobuf::Message + Send + 'static>(
        &self,
        ctx: &RpcContext<'_>,
        name: &str,
        pooled: bool,
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
        let job = move || {
            // Dropped last, once the answer is sent (see `heap::Busy`).
            let _busy = crate::heap::busy();
            let result = f(&me);
            let mut large = false;
            let reply = match result {
                Ok(r) => {
                    large = protobuf::Message::compute_size(&r) > LARGE_ANSWER_BYTES;
                    sink.success(r)
                }
                Err(s) => sink.fail(s),
            };
            // Keep the reply alive until it is sent (see threads::block_on).
            if crate::threads::block_on(reply, REPLY_TIMEOUT).is_none() {
                log::warn!("an API reply was not delivered within {REPLY_TIMEOUT:?}");
            }
            // The answer and its encoding are freed now: give the memory
            // back rather than keep the peak (`alloc status` of 10,000
            // allocations is several MB).
            if large {
                crate::heap::give_back();
            }
        };
        let spawned = if pooled {
            threads.spawn_pooled(format!("api-{name}"), job)
        } else {
            threads.spawn(format!("api-{name}"), job).map(|_| ())
        };
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
        self.run_fresh(&ctx, "mount", sink, move |s| {
            crate::ids::check_api_alloc_id(&req.alloc_id)
                .map_err(|e| status(RpcStatusCode::INVALID_ARGUMENT, e.to_string()))?;
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
            r.state_undurable_changes = store.undurable_changes();
            r.cpu_seconds = crate::metrics::process::cpu_seconds().unwrap_or(0.0);
            let total = |h: &crate::metrics::HistogramVec| -> f64 {
                h.snapshot().iter().map(|(_, d)| d.sum).sum()
            };
            r.csi_seconds = total(&crate::metrics::CSI_OPERATIONS);
            r.commit_wait_seconds = total(&crate::metrics::STATE_COMMIT_WAIT_SECONDS);
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
            // One volume's claims are read alone, never with every other.
            let filter = match req.volume_id.as_str() {
                "" => ClaimFilter::ALL,
                volume_id => ClaimFilter::volume(volume_id),
            };
            let listing = s
                .lifecycle
                .list_claims(filter)
                .map_err(|e| status(RpcStatusCode::UNAVAILABLE, crate::error_chain(&e)))?;
            let mut r = w::ListClaimsResponse::new();
            r.problems = listing.problems;
            r.claims = listing.claims.iter().map(claim_to_wire).collect();
            // One liveness read per holder node (cluster mode only).
            let mut alive = std::collections::BTreeMap::new();
            for c in &mut r.claims {
                let node_alive = *alive
                    .entry(c.node.clone())
                    .or_insert_with(|| s.lifecycle.node_alive(&c.node).ok().flatten());
                c.holder_unreachable = node_alive == Some(false);
            }
            Ok(r)
        });
    }

    fn free_claim(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::FreeClaimRequest,
        sink: UnarySink<w::FreeClaimResponse>,
    ) {
        self.run(&ctx, "free-claim", sink, move |s| {
            use crate::lifecycle::FreeClaimError as E;
            let c = s
                .lifecycle
                .free_claim(&req.volume_id, &req.alloc_id, &req.reason, req.force)
                .map_err(|e| {
                    let code = match &e {
                        E::NoReason => RpcStatusCode::INVALID_ARGUMENT,
                        E::NotHeld { .. } => RpcStatusCode::NOT_FOUND,
                        E::RecordedHere { .. } | E::HolderAlive { .. } => {
                            RpcStatusCode::FAILED_PRECONDITION
                        }
                        E::Store(_) => RpcStatusCode::UNAVAILABLE,
                        E::State(_) => RpcStatusCode::INTERNAL,
                    };
                    status(code, crate::error_chain(&e))
                })?;
            let mut r = w::FreeClaimResponse::new();
            r.claim = protobuf::MessageField::some(claim_to_wire(&c));
            Ok(r)
        });
    }

    fn detach_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::DetachVolumeRequest,
        sink: UnarySink<w::DetachVolumeResponse>,
    ) {
        self.run(&ctx, "detach-volume", sink, move |s| {
            use crate::lifecycle::NodeDetachError as E;
            let d = s
                .lifecycle
                .detach_from_node(&req.volume_id, &req.node, &req.reason)
                .map_err(|e| {
                    let code = match &e {
                        E::NoReason | E::Invalid(_) => RpcStatusCode::INVALID_ARGUMENT,
                        E::NotCluster | E::ThisNode { .. } | E::NodeAlive { .. } => {
                            RpcStatusCode::FAILED_PRECONDITION
                        }
                        E::Store(_) => RpcStatusCode::UNAVAILABLE,
                        E::Attach(a) if a.is_retryable() => RpcStatusCode::UNAVAILABLE,
                        E::Attach(_) => RpcStatusCode::FAILED_PRECONDITION,
                    };
                    status(code, crate::error_chain(&e))
                })?;
            let mut r = w::DetachVolumeResponse::new();
            r.detached = d.detached;
            r.freed_allocs = d.freed;
            Ok(r)
        });
    }

    fn remove_node(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::RemoveNodeRequest,
        sink: UnarySink<w::RemoveNodeResponse>,
    ) {
        self.run(&ctx, "remove-node", sink, move |s| {
            use crate::claims::RemoveNodeError as R;
            use crate::lifecycle::NodeRemoveError as E;
            let removed = s.lifecycle.remove_node(&req.node).map_err(|e| {
                let code = match &e {
                    E::Invalid(_) => RpcStatusCode::INVALID_ARGUMENT,
                    E::NotCluster
                    | E::ThisNode { .. }
                    | E::Remove(R::Alive { .. } | R::HoldsClaims { .. }) => {
                        RpcStatusCode::FAILED_PRECONDITION
                    }
                    E::Remove(R::Unknown { .. }) => RpcStatusCode::NOT_FOUND,
                    E::Remove(R::Store(_)) => RpcStatusCode::UNAVAILABLE,
                };
                status(code, crate::error_chain(&e))
            })?;
            let mut r = w::RemoveNodeResponse::new();
            r.removed_keys = removed;
            Ok(r)
        });
    }

    fn create_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::CreateVolumeRequest,
        sink: UnarySink<w::CreateVolumeResponse>,
    ) {
        self.run(&ctx, "create-volume", sink, move |s| {
            let create =
                create_from_wire(&req).map_err(|e| status(RpcStatusCode::INVALID_ARGUMENT, e))?;
            let (spec, warnings) = s
                .lifecycle
                .create_volume(&create)
                .map_err(|e| volume_op_status(&e))?;
            for warning in &warnings {
                log::warn!("{warning}");
            }
            let mut r = w::CreateVolumeResponse::new();
            r.volume = protobuf::MessageField::some(volume_to_wire(&spec));
            r.warnings = warnings;
            Ok(r)
        });
    }

    fn delete_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::DeleteVolumeRequest,
        sink: UnarySink<w::DeleteVolumeResponse>,
    ) {
        self.run(&ctx, "delete-volume", sink, move |s| {
            s.lifecycle
                .delete_volume(&req.volume_id)
                .map_err(|e| volume_op_status(&e))?;
            Ok(w::DeleteVolumeResponse::new())
        });
    }

    fn create_snapshot(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::CreateSnapshotRequest,
        sink: UnarySink<w::CreateSnapshotResponse>,
    ) {
        self.run(&ctx, "create-snapshot", sink, move |s| {
            let parameters = req
                .parameters
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let snap = s
                .lifecycle
                .create_snapshot(&req.volume_id, &req.name, &parameters)
                .map_err(|e| volume_op_status(&e))?;
            let mut r = w::CreateSnapshotResponse::new();
            r.snapshot = protobuf::MessageField::some(snapshot_to_wire(&snap));
            Ok(r)
        });
    }

    fn list_snapshots(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::ListSnapshotsRequest,
        sink: UnarySink<w::ListSnapshotsResponse>,
    ) {
        self.run(&ctx, "list-snapshots", sink, move |s| {
            let volume = Some(req.volume_id.as_str()).filter(|v| !v.is_empty());
            let snaps = s
                .lifecycle
                .list_snapshots(volume)
                .map_err(|e| volume_op_status(&e))?;
            let mut r = w::ListSnapshotsResponse::new();
            r.snapshots = snaps.iter().map(snapshot_to_wire).collect();
            Ok(r)
        });
    }

    fn delete_snapshot(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::DeleteSnapshotRequest,
        sink: UnarySink<w::DeleteSnapshotResponse>,
    ) {
        self.run(&ctx, "delete-snapshot", sink, move |s| {
            let plugin = Some(req.plugin_id.as_str()).filter(|p| !p.is_empty());
            let plugin_id = s
                .lifecycle
                .delete_snapshot(&req.snapshot_id, plugin)
                .map_err(|e| volume_op_status(&e))?;
            let mut r = w::DeleteSnapshotResponse::new();
            r.plugin_id = plugin_id;
            Ok(r)
        });
    }

    fn expand_volume(
        &mut self,
        ctx: RpcContext<'_>,
        req: w::ExpandVolumeRequest,
        sink: UnarySink<w::ExpandVolumeResponse>,
    ) {
        self.run(&ctx, "expand-volume", sink, move |s| {
            let done = s
                .lifecycle
                .expand_volume(&req.volume_id, req.required_bytes)
                .map_err(|e| volume_op_status(&e))?;
            let mut r = w::ExpandVolumeResponse::new();
            r.capacity_bytes = done.capacity_bytes;
            r.node_expanded = done
                .node_expanded
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            r.node_expansion_pending = done.node_expansion_pending;
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
            match s.lifecycle.controller_hosts() {
                None => {}
                Some(Ok(hosts)) => {
                    r.controller_hosts = hosts
                        .into_iter()
                        .map(|(h, alive)| w::ControllerHost {
                            plugin_id: h.plugin_id,
                            node: h.node,
                            alive,
                            ready: h.ready,
                            publish_unpublish_volume: h.publish_unpublish_volume,
                            ..Default::default()
                        })
                        .collect();
                }
                Some(Err(e)) => r.cluster_error = crate::error_chain(&e),
            }
            Ok(r)
        });
    }
}
