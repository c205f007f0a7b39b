//! Where a volume operation's controller calls go: this node's own
//! controller plugin, or, in cluster mode when this node has no controller
//! side of the plugin, a host of the plugin on another node (the call
//! forwarded through etcd, see `claims::controller_calls`). Both answer
//! the same types and the same `CsiError`s, so the operations do not ask
//! which one they have.

use std::sync::Arc;
use std::time::Duration;

use grpcio::RpcStatusCode;
use protobuf::Message;

use super::core::Core;
use crate::claims::{AttachError, ClaimError, ClaimStore};
use crate::csi::{
    self, snapshot_info, ControllerCapabilities, ControllerExpansion, CsiError, CsiMethod,
    PluginCapabilities, SnapshotInfo,
};
use crate::plugins::PluginSnapshot;
use crate::shutdown::Shutdown;

/// A plugin's controller, local or on another node.
pub enum Controller {
    Local(Box<PluginSnapshot>),
    Remote(RemoteOps),
}

/// A controller host elsewhere, reached through the claim store.
pub struct RemoteOps {
    plugin_id: String,
    caps: ControllerCapabilities,
    plugin_caps: PluginCapabilities,
    claims: Arc<dyn ClaimStore>,
    wait: Duration,
    shutdown: Shutdown,
}

/// The cluster's controller of `plugin_id` (capabilities from a live,
/// ready host when there is one); None on one node or when no host of the
/// plugin ever announced itself.
pub fn remote(core: &Core, plugin_id: &str) -> Result<Option<Controller>, ClaimError> {
    let Some(r) = core.claims.remote_controllers() else {
        return Ok(None);
    };
    let mut hosts: Vec<_> = r
        .hosts()?
        .into_iter()
        .filter(|(h, _)| h.plugin_id == plugin_id)
        .collect();
    // Live and ready hosts first: their capabilities are current.
    hosts.sort_by_key(|(h, alive)| (!alive, !h.ready));
    Ok(hosts.into_iter().next().map(|(h, _)| {
        Controller::Remote(RemoteOps {
            plugin_id: plugin_id.to_string(),
            caps: h.controller_capabilities,
            plugin_caps: h.plugin_capabilities,
            claims: core.claims.clone(),
            wait: core.opts.attach_timeout,
            shutdown: core.shutdown.clone(),
        })
    }))
}

impl Controller {
    pub fn id(&self) -> &str {
        match self {
            Controller::Local(c) => &c.id,
            Controller::Remote(r) => &r.plugin_id,
        }
    }

    pub fn caps(&self) -> ControllerCapabilities {
        match self {
            Controller::Local(c) => c.controller_capabilities.clone().unwrap_or_default(),
            Controller::Remote(r) => r.caps.clone(),
        }
    }

    pub fn plugin_caps(&self) -> PluginCapabilities {
        match self {
            Controller::Local(c) => c.plugin_capabilities.clone().unwrap_or_default(),
            Controller::Remote(r) => r.plugin_caps.clone(),
        }
    }

    pub fn create_volume(&self, req: &csi::CreateVolumeRequest) -> Result<csi::Volume, CsiError> {
        match self {
            Controller::Local(c) => c.client.create_volume(req),
            Controller::Remote(r) => {
                let m = CsiMethod::CreateVolume;
                let reply: csi::CreateVolumeResponse = r.forward(m, req)?;
                match reply.volume.into_option() {
                    Some(v) if !v.volume_id.is_empty() => Ok(v),
                    _ => Err(CsiError::MissingField {
                        method: m,
                        field: "volume.volume_id",
                    }),
                }
            }
        }
    }

    pub fn delete_volume(&self, req: &csi::DeleteVolumeRequest) -> Result<(), CsiError> {
        match self {
            Controller::Local(c) => c.client.delete_volume(req),
            Controller::Remote(r) => r
                .forward::<_, csi::DeleteVolumeResponse>(CsiMethod::DeleteVolume, req)
                .map(drop),
        }
    }

    pub fn create_snapshot(
        &self,
        req: &csi::CreateSnapshotRequest,
    ) -> Result<SnapshotInfo, CsiError> {
        match self {
            Controller::Local(c) => c.client.create_snapshot(req),
            Controller::Remote(r) => {
                let m = CsiMethod::CreateSnapshot;
                let reply: csi::CreateSnapshotResponse = r.forward(m, req)?;
                match reply.snapshot.as_ref() {
                    Some(s) if !s.snapshot_id.is_empty() => Ok(snapshot_info(s)),
                    _ => Err(CsiError::MissingField {
                        method: m,
                        field: "snapshot.snapshot_id",
                    }),
                }
            }
        }
    }

    pub fn delete_snapshot(&self, req: &csi::DeleteSnapshotRequest) -> Result<(), CsiError> {
        match self {
            Controller::Local(c) => c.client.delete_snapshot(req),
            Controller::Remote(r) => r
                .forward::<_, csi::DeleteSnapshotResponse>(CsiMethod::DeleteSnapshot, req)
                .map(drop),
        }
    }

    /// Every snapshot matching the request, following `next_token`.
    pub fn list_snapshots(
        &self,
        req: &csi::ListSnapshotsRequest,
    ) -> Result<Vec<SnapshotInfo>, CsiError> {
        let r = match self {
            Controller::Local(c) => return c.client.list_snapshots(req),
            Controller::Remote(r) => r,
        };
        let m = CsiMethod::ListSnapshots;
        let mut req = req.clone();
        let mut out = Vec::new();
        for _ in 0..csi::MAX_SNAPSHOT_PAGES {
            let reply: csi::ListSnapshotsResponse = r.forward(m, &req)?;
            out.extend(
                reply
                    .entries
                    .iter()
                    .filter_map(|e| e.snapshot.as_ref())
                    .map(snapshot_info),
            );
            if reply.next_token.is_empty() {
                return Ok(out);
            }
            req.starting_token = reply.next_token;
        }
        Err(CsiError::MissingField {
            method: m,
            field: "an end of next_token",
        })
    }

    pub fn controller_expand_volume(
        &self,
        req: &csi::ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpansion, CsiError> {
        match self {
            Controller::Local(c) => c.client.controller_expand_volume(req),
            Controller::Remote(r) => {
                let reply: csi::ControllerExpandVolumeResponse =
                    r.forward(CsiMethod::ControllerExpandVolume, req)?;
                Ok(ControllerExpansion {
                    capacity_bytes: reply.capacity_bytes,
                    node_expansion_required: reply.node_expansion_required,
                })
            }
        }
    }
}

impl RemoteOps {
    /// One call through a controller host: its gRPC status when the
    /// plugin refused, UNAVAILABLE when no host answered.
    fn forward<Req: Message, Resp: Message>(
        &self,
        method: CsiMethod,
        req: &Req,
    ) -> Result<Resp, CsiError> {
        let status = |code, message: String| CsiError::Status {
            method,
            code,
            message,
        };
        let remote = self.claims.remote_controllers().ok_or_else(|| {
            status(
                RpcStatusCode::UNAVAILABLE,
                "no cluster to forward the call to".to_string(),
            )
        })?;
        let bytes = req
            .write_to_bytes()
            .map_err(|e| status(RpcStatusCode::INTERNAL, e.to_string()))?;
        match remote.forward(
            &self.plugin_id,
            method.name(),
            &bytes,
            self.wait,
            &self.shutdown,
        ) {
            Ok(reply) => Resp::parse_from_bytes(&reply).map_err(|e| {
                status(
                    RpcStatusCode::INTERNAL,
                    format!("the controller host's reply does not decode: {e}"),
                )
            }),
            Err(AttachError::Failed {
                host, error, code, ..
            }) if code != 0 => Err(status(
                RpcStatusCode::from(code),
                format!("{error} (controller host {host})"),
            )),
            Err(e) => Err(status(RpcStatusCode::UNAVAILABLE, e.to_string())),
        }
    }
}
