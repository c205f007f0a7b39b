//! `CsiClient`: a blocking grpcio client for one plugin socket, one method
//! per RPC, a deadline on every call, and errors that classify themselves.
//!
//! Requests are never formatted into logs or errors: several carry secrets.
//! A log line names the method, the volume, the duration and the result code.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grpcio::{CallOption, ChannelBuilder, Environment, RpcStatusCode};

use super::grpc::{ControllerClient, IdentityClient, NodeClient};
use super::*;

/// Default deadline of one CSI call. Kubelet uses two minutes for every
/// call; claimd's calls are mostly local mounts, so a shorter bound keeps a
/// hung plugin from stalling a stop for long. Configurable.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The CSI RPCs claimd sends, named as on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CsiMethod {
    GetPluginInfo,
    GetPluginCapabilities,
    Probe,
    NodeStageVolume,
    NodeUnstageVolume,
    NodePublishVolume,
    NodeUnpublishVolume,
    NodeGetCapabilities,
    NodeGetInfo,
    NodeGetVolumeStats,
    ControllerPublishVolume,
    ControllerUnpublishVolume,
    ControllerGetCapabilities,
    CreateVolume,
    DeleteVolume,
    CreateSnapshot,
    DeleteSnapshot,
    ListSnapshots,
    ControllerExpandVolume,
    NodeExpandVolume,
}

impl CsiMethod {
    pub fn name(self) -> &'static str {
        match self {
            CsiMethod::GetPluginInfo => "GetPluginInfo",
            CsiMethod::GetPluginCapabilities => "GetPluginCapabilities",
            CsiMethod::Probe => "Probe",
            CsiMethod::NodeStageVolume => "NodeStageVolume",
            CsiMethod::NodeUnstageVolume => "NodeUnstageVolume",
            CsiMethod::NodePublishVolume => "NodePublishVolume",
            CsiMethod::NodeUnpublishVolume => "NodeUnpublishVolume",
            CsiMethod::NodeGetCapabilities => "NodeGetCapabilities",
            CsiMethod::NodeGetInfo => "NodeGetInfo",
            CsiMethod::NodeGetVolumeStats => "NodeGetVolumeStats",
            CsiMethod::ControllerPublishVolume => "ControllerPublishVolume",
            CsiMethod::ControllerUnpublishVolume => "ControllerUnpublishVolume",
            CsiMethod::ControllerGetCapabilities => "ControllerGetCapabilities",
            CsiMethod::CreateVolume => "CreateVolume",
            CsiMethod::DeleteVolume => "DeleteVolume",
            CsiMethod::CreateSnapshot => "CreateSnapshot",
            CsiMethod::DeleteSnapshot => "DeleteSnapshot",
            CsiMethod::ListSnapshots => "ListSnapshots",
            CsiMethod::ControllerExpandVolume => "ControllerExpandVolume",
            CsiMethod::NodeExpandVolume => "NodeExpandVolume",
        }
    }

    /// The gRPC method path (`/csi.v1.Node/NodePublishVolume`): kubelet's
    /// `method_name` label.
    pub fn path(self) -> String {
        let service = match self {
            CsiMethod::GetPluginInfo | CsiMethod::GetPluginCapabilities | CsiMethod::Probe => {
                "Identity"
            }
            CsiMethod::NodeStageVolume
            | CsiMethod::NodeUnstageVolume
            | CsiMethod::NodePublishVolume
            | CsiMethod::NodeUnpublishVolume
            | CsiMethod::NodeGetCapabilities
            | CsiMethod::NodeGetInfo
            | CsiMethod::NodeGetVolumeStats
            | CsiMethod::NodeExpandVolume => "Node",
            CsiMethod::ControllerPublishVolume
            | CsiMethod::ControllerUnpublishVolume
            | CsiMethod::ControllerGetCapabilities
            | CsiMethod::CreateVolume
            | CsiMethod::DeleteVolume
            | CsiMethod::CreateSnapshot
            | CsiMethod::DeleteSnapshot
            | CsiMethod::ListSnapshots
            | CsiMethod::ControllerExpandVolume => "Controller",
        };
        format!("/csi.v1.{service}/{}", self.name())
    }

    /// Teardown calls for which NOT_FOUND means "already done".
    fn not_found_is_done(self) -> bool {
        matches!(
            self,
            CsiMethod::NodeUnpublishVolume
                | CsiMethod::NodeUnstageVolume
                | CsiMethod::ControllerUnpublishVolume
                | CsiMethod::DeleteVolume
                | CsiMethod::DeleteSnapshot
        )
    }
}

impl fmt::Display for CsiMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the caller should treat a failed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The call's goal already holds (NOT_FOUND on a teardown call).
    Ignorable,
    /// Transient: send the same call again after a backoff.
    Retryable,
    /// Retrying the same call cannot help.
    Final,
}

/// A failed CSI call.
#[derive(Debug)]
pub enum CsiError {
    /// The plugin answered with a gRPC status other than OK (this includes
    /// UNAVAILABLE when the socket is absent and DEADLINE_EXCEEDED when the
    /// call's deadline passed).
    Status {
        method: CsiMethod,
        code: RpcStatusCode,
        message: String,
    },
    /// The reply could not be decoded.
    BadReply {
        method: CsiMethod,
        source: grpcio::Error,
    },
    /// The reply decoded but lacks a field the CSI spec requires.
    MissingField {
        method: CsiMethod,
        field: &'static str,
    },
    /// The call could not be carried out by the gRPC library itself.
    Transport {
        method: CsiMethod,
        source: grpcio::Error,
    },
}

impl CsiError {
    pub fn method(&self) -> CsiMethod {
        match self {
            CsiError::Status { method, .. }
            | CsiError::BadReply { method, .. }
            | CsiError::MissingField { method, .. }
            | CsiError::Transport { method, .. } => *method,
        }
    }

    /// The gRPC status code, when the plugin answered with one.
    pub fn code(&self) -> Option<RpcStatusCode> {
        match self {
            CsiError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            CsiError::Status { method, code, .. } => classify(*method, *code),
            CsiError::BadReply { .. } | CsiError::MissingField { .. } => ErrorClass::Final,
            CsiError::Transport { .. } => ErrorClass::Retryable,
        }
    }

    pub fn is_ignorable(&self) -> bool {
        self.class() == ErrorClass::Ignorable
    }

    pub fn is_retryable(&self) -> bool {
        self.class() == ErrorClass::Retryable
    }

    /// Whether the call may still have its effect: it hit its deadline, or
    /// the transport failed after it may have been sent. The plugin may be
    /// doing it and finish later (kubelet's "uncertain" state).
    pub fn is_uncertain(&self) -> bool {
        match self {
            CsiError::Status { code, .. } => matches!(
                *code,
                RpcStatusCode::DEADLINE_EXCEEDED | RpcStatusCode::CANCELLED
            ),
            CsiError::Transport { .. } => true,
            CsiError::BadReply { .. } | CsiError::MissingField { .. } => false,
        }
    }

    /// A short result code for logs and call records: `OK`-style names.
    pub fn code_name(&self) -> String {
        match self {
            CsiError::Status { code, .. } => code_name(*code),
            CsiError::BadReply { .. } => "BAD_REPLY".to_string(),
            CsiError::MissingField { .. } => "MISSING_FIELD".to_string(),
            CsiError::Transport { .. } => "TRANSPORT".to_string(),
        }
    }
}

/// The CSI spec's error table, as claimd acts on it.
pub fn classify(method: CsiMethod, code: RpcStatusCode) -> ErrorClass {
    match code {
        RpcStatusCode::NOT_FOUND if method.not_found_is_done() => ErrorClass::Ignorable,
        RpcStatusCode::UNAVAILABLE
        | RpcStatusCode::DEADLINE_EXCEEDED
        | RpcStatusCode::ABORTED
        | RpcStatusCode::RESOURCE_EXHAUSTED => ErrorClass::Retryable,
        // Attached to another node: it may be detached there soon.
        RpcStatusCode::FAILED_PRECONDITION if method == CsiMethod::ControllerPublishVolume => {
            ErrorClass::Retryable
        }
        _ => ErrorClass::Final,
    }
}

/// The canonical upper-case name of a gRPC status code.
pub fn code_name(code: RpcStatusCode) -> String {
    let name = match code {
        RpcStatusCode::OK => "OK",
        RpcStatusCode::CANCELLED => "CANCELLED",
        RpcStatusCode::UNKNOWN => "UNKNOWN",
        RpcStatusCode::INVALID_ARGUMENT => "INVALID_ARGUMENT",
        RpcStatusCode::DEADLINE_EXCEEDED => "DEADLINE_EXCEEDED",
        RpcStatusCode::NOT_FOUND => "NOT_FOUND",
        RpcStatusCode::ALREADY_EXISTS => "ALREADY_EXISTS",
        RpcStatusCode::PERMISSION_DENIED => "PERMISSION_DENIED",
        RpcStatusCode::RESOURCE_EXHAUSTED => "RESOURCE_EXHAUSTED",
        RpcStatusCode::FAILED_PRECONDITION => "FAILED_PRECONDITION",
        RpcStatusCode::ABORTED => "ABORTED",
        RpcStatusCode::OUT_OF_RANGE => "OUT_OF_RANGE",
        RpcStatusCode::UNIMPLEMENTED => "UNIMPLEMENTED",
        RpcStatusCode::INTERNAL => "INTERNAL",
        RpcStatusCode::UNAVAILABLE => "UNAVAILABLE",
        RpcStatusCode::DATA_LOSS => "DATA_LOSS",
        RpcStatusCode::UNAUTHENTICATED => "UNAUTHENTICATED",
        other => return format!("CODE_{}", i32::from(other)),
    };
    name.to_string()
}

/// gRPC-Go's name of a status code (`codes.Code.String()`), which
/// kubelet's `grpc_status_code` label carries: `OK`, `DeadlineExceeded`.
pub fn go_code_name(code: RpcStatusCode) -> &'static str {
    match code {
        RpcStatusCode::OK => "OK",
        RpcStatusCode::CANCELLED => "Canceled",
        RpcStatusCode::UNKNOWN => "Unknown",
        RpcStatusCode::INVALID_ARGUMENT => "InvalidArgument",
        RpcStatusCode::DEADLINE_EXCEEDED => "DeadlineExceeded",
        RpcStatusCode::NOT_FOUND => "NotFound",
        RpcStatusCode::ALREADY_EXISTS => "AlreadyExists",
        RpcStatusCode::PERMISSION_DENIED => "PermissionDenied",
        RpcStatusCode::RESOURCE_EXHAUSTED => "ResourceExhausted",
        RpcStatusCode::FAILED_PRECONDITION => "FailedPrecondition",
        RpcStatusCode::ABORTED => "Aborted",
        RpcStatusCode::OUT_OF_RANGE => "OutOfRange",
        RpcStatusCode::UNIMPLEMENTED => "Unimplemented",
        RpcStatusCode::INTERNAL => "Internal",
        RpcStatusCode::UNAVAILABLE => "Unavailable",
        RpcStatusCode::DATA_LOSS => "DataLoss",
        RpcStatusCode::UNAUTHENTICATED => "Unauthenticated",
        _ => "Unknown",
    }
}

/// Parses a canonical code name (`"UNAVAILABLE"`) back into a code.
pub fn code_from_name(name: &str) -> Option<RpcStatusCode> {
    (0..=16)
        .map(RpcStatusCode::from)
        .find(|c| code_name(*c) == name)
}

impl fmt::Display for CsiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CsiError::Status {
                method,
                code,
                message,
            } => {
                write!(f, "{method} failed: {}", code_name(*code))?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                Ok(())
            }
            CsiError::BadReply { method, .. } => {
                write!(f, "{method} answered with a reply that does not decode")
            }
            CsiError::MissingField { method, field } => {
                write!(f, "{method} answered without the required field {field}")
            }
            CsiError::Transport { method, .. } => write!(f, "{method} could not be sent"),
        }
    }
}

impl std::error::Error for CsiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CsiError::BadReply { source, .. } | CsiError::Transport { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// What GetPluginCapabilities said, with unknown values ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PluginCapabilities {
    pub controller_service: bool,
    pub accessibility_constraints: bool,
    /// VolumeExpansion ONLINE: expansion while the volume is published.
    pub online_expansion: bool,
    /// VolumeExpansion OFFLINE: expansion only while it is not.
    pub offline_expansion: bool,
}

/// What NodeGetCapabilities said, with unknown values ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeCapabilities {
    pub stage_unstage_volume: bool,
    pub get_volume_stats: bool,
    pub volume_condition: bool,
    pub expand_volume: bool,
    pub volume_mount_group: bool,
}

/// What ControllerGetCapabilities said, with unknown values ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ControllerCapabilities {
    pub create_delete_volume: bool,
    pub publish_unpublish_volume: bool,
    pub publish_readonly: bool,
    pub create_delete_snapshot: bool,
    pub list_snapshots: bool,
    pub clone_volume: bool,
    pub expand_volume: bool,
}

/// What NodeGetInfo said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The plugin's ID of this node: the "external node ID" that
    /// ControllerPublish and ControllerUnpublish take.
    pub node_id: String,
    pub max_volumes_per_node: i64,
    pub topology: std::collections::BTreeMap<String, String>,
}

/// One unit of NodeGetVolumeStats's usage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub total: i64,
    pub used: i64,
    pub available: i64,
}

/// VOLUME_CONDITION as the plugin reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Condition {
    pub abnormal: bool,
    pub message: String,
}

/// What NodeGetVolumeStats said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeStats {
    pub bytes: Option<Usage>,
    pub inodes: Option<Usage>,
    pub condition: Option<Condition>,
}

/// What GetPluginInfo said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub vendor_version: String,
}

/// Readiness reported by Probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    /// `ready = false`: healthy but still initialising.
    Starting,
}

/// One shared gRPC environment (its completion-queue threads) for every
/// client and server in the process.
pub fn grpc_environment(name_prefix: &str) -> Arc<Environment> {
    Arc::new(
        grpcio::EnvBuilder::new()
            .cq_count(1)
            .name_prefix(name_prefix)
            .build(),
    )
}

/// A blocking client for one plugin socket.
#[derive(Clone)]
pub struct CsiClient {
    socket: PathBuf,
    timeout: Duration,
    /// The `driver_name` label of this client's calls in the metrics.
    driver: Arc<str>,
    identity: IdentityClient,
    pub(super) node: NodeClient,
    pub(super) controller: ControllerClient,
}

impl fmt::Debug for CsiClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CsiClient")
            .field("socket", &self.socket)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl CsiClient {
    /// Creates the channel; nothing is sent until the first call, and a
    /// socket that does not answer yet is retried on each later call.
    pub fn new(env: Arc<Environment>, socket: &Path, timeout: Duration) -> CsiClient {
        let channel = ChannelBuilder::new(env)
            // A plugin that comes back must be seen within a probe round,
            // not after gRPC's default two-minute reconnect backoff.
            .initial_reconnect_backoff(Duration::from_millis(50))
            .max_reconnect_backoff(Duration::from_millis(500))
            .connect(&format!("unix:{}", socket.display()));
        CsiClient {
            socket: socket.to_path_buf(),
            timeout,
            driver: Arc::from("unknown-driver"),
            identity: IdentityClient::new(channel.clone()),
            node: NodeClient::new(channel.clone()),
            controller: ControllerClient::new(channel),
        }
    }

    /// Names the driver in the call metrics (`driver_name`); the registry
    /// uses the plugin ID.
    pub fn with_driver(mut self, driver: &str) -> CsiClient {
        self.driver = Arc::from(driver);
        self
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(super) fn call<R>(
        &self,
        method: CsiMethod,
        volume: &str,
        f: impl FnOnce(CallOption) -> grpcio::Result<R>,
    ) -> Result<R, CsiError> {
        let started = Instant::now();
        let result = f(CallOption::default().timeout(self.timeout)).map_err(|e| match e {
            grpcio::Error::RpcFailure(status) => CsiError::Status {
                method,
                code: status.code(),
                message: status.message().to_string(),
            },
            e @ grpcio::Error::Codec(_) => CsiError::BadReply { method, source: e },
            e => CsiError::Transport { method, source: e },
        });
        let took = started.elapsed();
        let code = match &result {
            Ok(_) => "OK".to_string(),
            Err(e) => e.code_name(),
        };
        let grpc_code = match &result {
            Ok(_) => "OK",
            Err(CsiError::Status { code, .. }) => go_code_name(*code),
            // A reply that does not decode: what gRPC-Go reports for it.
            Err(CsiError::BadReply { .. }) => "Internal",
            Err(_) => "Unknown",
        };
        crate::metrics::CSI_OPERATIONS.observe(
            &[&self.driver, &method.path(), grpc_code],
            took.as_secs_f64(),
        );
        log::debug!(
            "csi {method} volume={} socket={} took={:?} result={code}",
            if volume.is_empty() { "-" } else { volume },
            self.socket.display(),
            took
        );
        result
    }

    pub fn get_plugin_info(&self) -> Result<PluginInfo, CsiError> {
        let m = CsiMethod::GetPluginInfo;
        let r = self.call(m, "", |o| {
            self.identity
                .get_plugin_info(&GetPluginInfoRequest::new(), o)
        })?;
        if r.name.is_empty() {
            return Err(CsiError::MissingField {
                method: m,
                field: "name",
            });
        }
        Ok(PluginInfo {
            name: r.name,
            vendor_version: r.vendor_version,
        })
    }

    pub fn get_plugin_capabilities(&self) -> Result<PluginCapabilities, CsiError> {
        use plugin_capability::service::Type;
        let r = self.call(CsiMethod::GetPluginCapabilities, "", |o| {
            self.identity
                .get_plugin_capabilities(&GetPluginCapabilitiesRequest::new(), o)
        })?;
        let mut caps = PluginCapabilities::default();
        use plugin_capability::volume_expansion::Type as Expansion;
        for c in &r.capabilities {
            match &c.type_ {
                Some(plugin_capability::Type::Service(s)) => match s.type_.enum_value() {
                    Ok(Type::CONTROLLER_SERVICE) => caps.controller_service = true,
                    Ok(Type::VOLUME_ACCESSIBILITY_CONSTRAINTS) => {
                        caps.accessibility_constraints = true
                    }
                    _ => {}
                },
                Some(plugin_capability::Type::VolumeExpansion(e)) => match e.type_.enum_value() {
                    Ok(Expansion::ONLINE) => caps.online_expansion = true,
                    Ok(Expansion::OFFLINE) => caps.offline_expansion = true,
                    _ => {}
                },
                _ => {}
            }
        }
        Ok(caps)
    }

    pub fn probe(&self) -> Result<Readiness, CsiError> {
        let r = self.call(CsiMethod::Probe, "", |o| {
            self.identity.probe(&ProbeRequest::new(), o)
        })?;
        Ok(match r.ready.as_ref() {
            Some(b) if !b.value => Readiness::Starting,
            _ => Readiness::Ready,
        })
    }

    pub fn node_get_info(&self) -> Result<NodeInfo, CsiError> {
        let m = CsiMethod::NodeGetInfo;
        let r = self.call(m, "", |o| {
            self.node.node_get_info(&NodeGetInfoRequest::new(), o)
        })?;
        if r.node_id.is_empty() {
            return Err(CsiError::MissingField {
                method: m,
                field: "node_id",
            });
        }
        Ok(NodeInfo {
            node_id: r.node_id,
            max_volumes_per_node: r.max_volumes_per_node,
            topology: r
                .accessible_topology
                .as_ref()
                .map(|t| {
                    t.segments
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    pub fn node_get_capabilities(&self) -> Result<NodeCapabilities, CsiError> {
        use node_service_capability::rpc::Type;
        let r = self.call(CsiMethod::NodeGetCapabilities, "", |o| {
            self.node
                .node_get_capabilities(&NodeGetCapabilitiesRequest::new(), o)
        })?;
        let mut caps = NodeCapabilities::default();
        for c in &r.capabilities {
            if let Some(node_service_capability::Type::Rpc(rpc)) = &c.type_ {
                match rpc.type_.enum_value() {
                    Ok(Type::STAGE_UNSTAGE_VOLUME) => caps.stage_unstage_volume = true,
                    Ok(Type::GET_VOLUME_STATS) => caps.get_volume_stats = true,
                    Ok(Type::VOLUME_CONDITION) => caps.volume_condition = true,
                    Ok(Type::EXPAND_VOLUME) => caps.expand_volume = true,
                    Ok(Type::VOLUME_MOUNT_GROUP) => caps.volume_mount_group = true,
                    _ => {}
                }
            }
        }
        Ok(caps)
    }

    pub fn controller_get_capabilities(&self) -> Result<ControllerCapabilities, CsiError> {
        use controller_service_capability::rpc::Type;
        let r = self.call(CsiMethod::ControllerGetCapabilities, "", |o| {
            self.controller
                .controller_get_capabilities(&ControllerGetCapabilitiesRequest::new(), o)
        })?;
        let mut caps = ControllerCapabilities::default();
        for c in &r.capabilities {
            if let Some(controller_service_capability::Type::Rpc(rpc)) = &c.type_ {
                match rpc.type_.enum_value() {
                    Ok(Type::CREATE_DELETE_VOLUME) => caps.create_delete_volume = true,
                    Ok(Type::PUBLISH_UNPUBLISH_VOLUME) => caps.publish_unpublish_volume = true,
                    Ok(Type::PUBLISH_READONLY) => caps.publish_readonly = true,
                    Ok(Type::CREATE_DELETE_SNAPSHOT) => caps.create_delete_snapshot = true,
                    Ok(Type::LIST_SNAPSHOTS) => caps.list_snapshots = true,
                    Ok(Type::CLONE_VOLUME) => caps.clone_volume = true,
                    Ok(Type::EXPAND_VOLUME) => caps.expand_volume = true,
                    _ => {}
                }
            }
        }
        Ok(caps)
    }

    pub fn node_stage_volume(&self, req: &NodeStageVolumeRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::NodeStageVolume, &req.volume_id, |o| {
            self.node.node_stage_volume(req, o)
        })
        .map(drop)
    }

    pub fn node_unstage_volume(&self, req: &NodeUnstageVolumeRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::NodeUnstageVolume, &req.volume_id, |o| {
            self.node.node_unstage_volume(req, o)
        })
        .map(drop)
    }

    pub fn node_publish_volume(&self, req: &NodePublishVolumeRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::NodePublishVolume, &req.volume_id, |o| {
            self.node.node_publish_volume(req, o)
        })
        .map(drop)
    }

    pub fn node_unpublish_volume(&self, req: &NodeUnpublishVolumeRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::NodeUnpublishVolume, &req.volume_id, |o| {
            self.node.node_unpublish_volume(req, o)
        })
        .map(drop)
    }

    /// Returns the publish context to hand to NodeStage and NodePublish.
    pub fn controller_publish_volume(
        &self,
        req: &ControllerPublishVolumeRequest,
    ) -> Result<std::collections::BTreeMap<String, String>, CsiError> {
        let r = self.call(CsiMethod::ControllerPublishVolume, &req.volume_id, |o| {
            self.controller.controller_publish_volume(req, o)
        })?;
        Ok(r.publish_context.into_iter().collect())
    }

    pub fn controller_unpublish_volume(
        &self,
        req: &ControllerUnpublishVolumeRequest,
    ) -> Result<(), CsiError> {
        self.call(CsiMethod::ControllerUnpublishVolume, &req.volume_id, |o| {
            self.controller.controller_unpublish_volume(req, o)
        })
        .map(drop)
    }

    /// Usage and condition of a published volume (GET_VOLUME_STATS).
    pub fn node_get_volume_stats(
        &self,
        req: &NodeGetVolumeStatsRequest,
    ) -> Result<VolumeStats, CsiError> {
        let r = self.call(CsiMethod::NodeGetVolumeStats, &req.volume_id, |o| {
            self.node.node_get_volume_stats(req, o)
        })?;
        let mut stats = VolumeStats::default();
        for u in &r.usage {
            let usage = Usage {
                total: u.total,
                used: u.used,
                available: u.available,
            };
            match u.unit.enum_value() {
                Ok(volume_usage::Unit::BYTES) => stats.bytes = Some(usage),
                Ok(volume_usage::Unit::INODES) => stats.inodes = Some(usage),
                _ => {}
            }
        }
        if let Some(c) = r.volume_condition.as_ref() {
            stats.condition = Some(Condition {
                abnormal: c.abnormal,
                message: c.message.clone(),
            });
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_is_ignorable_only_on_teardown() {
        let nf = RpcStatusCode::NOT_FOUND;
        assert_eq!(
            classify(CsiMethod::NodeUnpublishVolume, nf),
            ErrorClass::Ignorable
        );
        assert_eq!(
            classify(CsiMethod::NodeUnstageVolume, nf),
            ErrorClass::Ignorable
        );
        assert_eq!(
            classify(CsiMethod::ControllerUnpublishVolume, nf),
            ErrorClass::Ignorable
        );
        assert_eq!(
            classify(CsiMethod::NodePublishVolume, nf),
            ErrorClass::Final
        );
        assert_eq!(classify(CsiMethod::NodeStageVolume, nf), ErrorClass::Final);
    }

    #[test]
    fn transient_codes_are_retryable() {
        for code in [
            RpcStatusCode::UNAVAILABLE,
            RpcStatusCode::DEADLINE_EXCEEDED,
            RpcStatusCode::ABORTED,
            RpcStatusCode::RESOURCE_EXHAUSTED,
        ] {
            for m in [
                CsiMethod::NodeStageVolume,
                CsiMethod::ControllerUnpublishVolume,
            ] {
                assert_eq!(classify(m, code), ErrorClass::Retryable, "{m} {code:?}");
            }
        }
    }

    #[test]
    fn failed_precondition_is_retryable_only_on_controller_publish() {
        let fp = RpcStatusCode::FAILED_PRECONDITION;
        assert_eq!(
            classify(CsiMethod::ControllerPublishVolume, fp),
            ErrorClass::Retryable
        );
        assert_eq!(classify(CsiMethod::NodeStageVolume, fp), ErrorClass::Final);
    }

    #[test]
    fn final_codes() {
        for code in [
            RpcStatusCode::INVALID_ARGUMENT,
            RpcStatusCode::UNIMPLEMENTED,
            RpcStatusCode::ALREADY_EXISTS,
            RpcStatusCode::PERMISSION_DENIED,
            RpcStatusCode::INTERNAL,
        ] {
            assert_eq!(
                classify(CsiMethod::NodePublishVolume, code),
                ErrorClass::Final
            );
        }
    }

    #[test]
    fn code_names_round_trip() {
        for i in 0..=16 {
            let c = RpcStatusCode::from(i);
            assert_eq!(code_from_name(&code_name(c)), Some(c));
        }
        assert_eq!(code_from_name("NOPE"), None);
    }

    #[test]
    fn error_message_names_method_and_code() {
        let e = CsiError::Status {
            method: CsiMethod::NodeStageVolume,
            code: RpcStatusCode::UNAVAILABLE,
            message: "socket gone".into(),
        };
        assert_eq!(
            e.to_string(),
            "NodeStageVolume failed: UNAVAILABLE: socket gone"
        );
        assert!(e.is_retryable());
    }
}
