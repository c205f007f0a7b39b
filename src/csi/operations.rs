//! The volume operations of `CsiClient`: CreateVolume, DeleteVolume,
//! CreateSnapshot, DeleteSnapshot, ListSnapshots, ControllerExpandVolume and
//! NodeExpandVolume. Like the lifecycle calls in `client.rs`, each carries
//! the client's deadline and fails with a classified `CsiError`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::client::{CsiClient, CsiError, CsiMethod};
use super::*;

/// Most pages ListSnapshots is followed through (a plugin whose
/// `next_token` never ends must not hold a request forever).
pub const MAX_SNAPSHOT_PAGES: usize = 1000;

/// A snapshot as a plugin reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub snapshot_id: String,
    /// The plugin's ID of the source volume.
    pub source_volume_id: String,
    pub size_bytes: i64,
    pub creation_time: Option<SystemTime>,
    pub ready_to_use: bool,
}

/// What ControllerExpandVolume answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControllerExpansion {
    pub capacity_bytes: i64,
    /// The CO must call NodeExpandVolume where the volume is used.
    pub node_expansion_required: bool,
}

pub fn snapshot_info(s: &Snapshot) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: s.snapshot_id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        size_bytes: s.size_bytes,
        creation_time: s.creation_time.as_ref().and_then(|t| {
            let secs = u64::try_from(t.seconds).ok()?;
            let nanos = u32::try_from(t.nanos).ok()?;
            UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
        }),
        ready_to_use: s.ready_to_use,
    }
}

/// The controller calls an agent makes for another node (cluster mode:
/// volume operations of a plugin whose controller side runs elsewhere),
/// named as on the wire.
pub const FORWARDED_METHODS: [CsiMethod; 6] = [
    CsiMethod::CreateVolume,
    CsiMethod::DeleteVolume,
    CsiMethod::CreateSnapshot,
    CsiMethod::DeleteSnapshot,
    CsiMethod::ListSnapshots,
    CsiMethod::ControllerExpandVolume,
];

/// A forwarded method by its wire name.
pub fn forwarded_method(name: &str) -> Option<CsiMethod> {
    FORWARDED_METHODS.iter().copied().find(|m| m.name() == name)
}

impl CsiClient {
    /// One controller call made for another node: the request and the
    /// reply as protobuf bytes (one page of ListSnapshots). A request that
    /// does not decode is INVALID_ARGUMENT, sent nowhere.
    pub fn forward_controller_call(
        &self,
        method: CsiMethod,
        request: &[u8],
    ) -> Result<Vec<u8>, CsiError> {
        use protobuf::Message;
        fn parse<M: Message>(method: CsiMethod, b: &[u8]) -> Result<M, CsiError> {
            M::parse_from_bytes(b).map_err(|e| CsiError::Status {
                method,
                code: grpcio::RpcStatusCode::INVALID_ARGUMENT,
                message: format!("the forwarded request does not decode: {e}"),
            })
        }
        let m = method;
        let bytes = match method {
            CsiMethod::CreateVolume => {
                let req: CreateVolumeRequest = parse(m, request)?;
                self.call(m, &req.name, |o| self.controller.create_volume(&req, o))?
                    .write_to_bytes()
            }
            CsiMethod::DeleteVolume => {
                let req: DeleteVolumeRequest = parse(m, request)?;
                self.call(m, &req.volume_id, |o| {
                    self.controller.delete_volume(&req, o)
                })?
                .write_to_bytes()
            }
            CsiMethod::CreateSnapshot => {
                let req: CreateSnapshotRequest = parse(m, request)?;
                self.call(m, &req.source_volume_id, |o| {
                    self.controller.create_snapshot(&req, o)
                })?
                .write_to_bytes()
            }
            CsiMethod::DeleteSnapshot => {
                let req: DeleteSnapshotRequest = parse(m, request)?;
                self.call(m, "", |o| self.controller.delete_snapshot(&req, o))?
                    .write_to_bytes()
            }
            CsiMethod::ListSnapshots => {
                let req: ListSnapshotsRequest = parse(m, request)?;
                self.call(m, &req.source_volume_id, |o| {
                    self.controller.list_snapshots(&req, o)
                })?
                .write_to_bytes()
            }
            CsiMethod::ControllerExpandVolume => {
                let req: ControllerExpandVolumeRequest = parse(m, request)?;
                self.call(m, &req.volume_id, |o| {
                    self.controller.controller_expand_volume(&req, o)
                })?
                .write_to_bytes()
            }
            other => {
                return Err(CsiError::Status {
                    method: other,
                    code: grpcio::RpcStatusCode::UNIMPLEMENTED,
                    message: format!("{} is not forwarded to a controller host", other.name()),
                })
            }
        };
        bytes.map_err(|e| CsiError::Status {
            method: m,
            code: grpcio::RpcStatusCode::INTERNAL,
            message: format!("the reply does not encode: {e}"),
        })
    }
    pub fn create_volume(&self, req: &CreateVolumeRequest) -> Result<Volume, CsiError> {
        let m = CsiMethod::CreateVolume;
        let r = self.call(m, &req.name, |o| self.controller.create_volume(req, o))?;
        match r.volume.into_option() {
            Some(v) if !v.volume_id.is_empty() => Ok(v),
            _ => Err(CsiError::MissingField {
                method: m,
                field: "volume.volume_id",
            }),
        }
    }

    pub fn delete_volume(&self, req: &DeleteVolumeRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::DeleteVolume, &req.volume_id, |o| {
            self.controller.delete_volume(req, o)
        })
        .map(drop)
    }

    pub fn create_snapshot(&self, req: &CreateSnapshotRequest) -> Result<SnapshotInfo, CsiError> {
        let m = CsiMethod::CreateSnapshot;
        let r = self.call(m, &req.source_volume_id, |o| {
            self.controller.create_snapshot(req, o)
        })?;
        match r.snapshot.as_ref() {
            Some(s) if !s.snapshot_id.is_empty() => Ok(snapshot_info(s)),
            _ => Err(CsiError::MissingField {
                method: m,
                field: "snapshot.snapshot_id",
            }),
        }
    }

    pub fn delete_snapshot(&self, req: &DeleteSnapshotRequest) -> Result<(), CsiError> {
        self.call(CsiMethod::DeleteSnapshot, "", |o| {
            self.controller.delete_snapshot(req, o)
        })
        .map(drop)
    }

    /// Every snapshot matching the request's filters, following
    /// `next_token` (up to MAX_SNAPSHOT_PAGES pages).
    pub fn list_snapshots(
        &self,
        req: &ListSnapshotsRequest,
    ) -> Result<Vec<SnapshotInfo>, CsiError> {
        let m = CsiMethod::ListSnapshots;
        let mut req = req.clone();
        let mut out = Vec::new();
        for _ in 0..MAX_SNAPSHOT_PAGES {
            let r = self.call(m, &req.source_volume_id, |o| {
                self.controller.list_snapshots(&req, o)
            })?;
            out.extend(
                r.entries
                    .iter()
                    .filter_map(|e| e.snapshot.as_ref())
                    .map(snapshot_info),
            );
            if r.next_token.is_empty() {
                return Ok(out);
            }
            req.starting_token = r.next_token;
        }
        Err(CsiError::MissingField {
            method: m,
            field: "an end of next_token",
        })
    }

    pub fn controller_expand_volume(
        &self,
        req: &ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpansion, CsiError> {
        let r = self.call(CsiMethod::ControllerExpandVolume, &req.volume_id, |o| {
            self.controller.controller_expand_volume(req, o)
        })?;
        Ok(ControllerExpansion {
            capacity_bytes: r.capacity_bytes,
            node_expansion_required: r.node_expansion_required,
        })
    }

    /// The capacity the node reports after the expansion (0: unknown).
    pub fn node_expand_volume(&self, req: &NodeExpandVolumeRequest) -> Result<i64, CsiError> {
        self.call(CsiMethod::NodeExpandVolume, &req.volume_id, |o| {
            self.node.node_expand_volume(req, o)
        })
        .map(|r| r.capacity_bytes)
    }
}
