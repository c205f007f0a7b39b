//! The Controller service: attachments and created volumes, kept in
//! `<storage>/controller.json` in the shared storage (`--storage`; written
//! atomically, re-read on every call when no write is in flight, so a
//! restarted plugin remembers them and a test can make it "lose" them by
//! deleting the file). Concurrent calls share fsyncs: see
//! `controller_store.rs` (which also keeps the changes of several plugin
//! processes sharing one storage from overwriting each other). With
//! `--fence-on-unpublish`, ControllerUnpublishVolume fences the node
//! (`fencing.rs`).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;

use claimd::csi::*;
use grpcio::RpcStatusCode;
use protobuf::EnumOrUnknown;
use serde::{Deserialize, Serialize};

use crate::plugin::*;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Attachment {
    access_mode: String,
    readonly: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedVolume {
    pub capacity_bytes: i64,
    pub volume_context: BTreeMap<String, String>,
    /// CreateVolume's parameters: a later CreateVolume of the same name
    /// with others is refused (ALREADY_EXISTS).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<BTreeMap<String, String>>,
    /// `snapshot:<id>` or `volume:<id>`: what it started with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// A volume's capacity: what the controller gave it, and what its file
/// system was grown to on the node (what NodeGetVolumeStats reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub controller: i64,
    pub node: i64,
}

/// A snapshot: a copy of the volume directory in `<storage>/snapshots/<id>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub name: String,
    pub source_volume_id: String,
    pub size_bytes: i64,
    pub created_ms: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerState {
    /// volume ID → node ID → attachment.
    #[serde(default)]
    attachments: BTreeMap<String, BTreeMap<String, Attachment>>,
    /// Volumes made by CreateVolume.
    #[serde(default)]
    pub volumes: BTreeMap<String, CreatedVolume>,
    /// Capacities of volumes that have one (created with a size, or
    /// expanded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacities: BTreeMap<String, Capacity>,
    /// snapshot ID → snapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub snapshots: BTreeMap<String, SnapshotRecord>,
}

fn single_node(access_mode: &str) -> bool {
    access_mode.starts_with("SINGLE_NODE_")
}

/// What ControllerPublishVolume answers for a volume on a node.
fn publish_context(volume_id: &str, node_id: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("attached_node".to_string(), node_id.to_string()),
        (
            "device".to_string(),
            format!("/dev/claimd-test/{volume_id}"),
        ),
    ])
}

fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// A required, non-empty list of volume capabilities, each with an access
/// type and an access mode.
fn check_capabilities(caps: &[VolumeCapability]) -> Outcome<()> {
    if caps.is_empty() {
        return Err(Failure::invalid("volume_capabilities is required"));
    }
    for cap in caps {
        is_block(cap)?;
        access_mode(cap)?;
    }
    Ok(())
}

impl Plugin {
    /// Runs `f` on the durable controller state.
    pub fn read_state<R>(&self, f: impl FnOnce(&ControllerState) -> R) -> Outcome<R> {
        self.controller_state.read(f).map_err(Failure::internal)
    }

    pub fn controller_supported(&self, method: &str) -> Outcome<()> {
        if self.config.controller {
            Ok(())
        } else {
            Err(Failure::unimplemented(
                method,
                "the plugin does not advertise CONTROLLER_SERVICE",
            ))
        }
    }

    /// With a controller, a volume must be attached to this node before a
    /// node may use it (real plugins refuse NodeStage before
    /// ControllerPublish).
    pub fn check_attached(&self, volume_id: &str) -> Outcome<()> {
        if !self.config.controller {
            return Ok(());
        }
        let node = &self.config.node_id;
        let attached = self.read_state(|state| {
            state
                .attachments
                .get(volume_id)
                .is_some_and(|nodes| nodes.contains_key(node))
        })?;
        if attached {
            Ok(())
        } else {
            Err(Failure::precondition(format!(
                "volume {volume_id} is not attached to node {node}: ControllerPublishVolume first"
            )))
        }
    }

    /// With `--require-contexts`: the publish context must be the one
    /// ControllerPublish returned, and the volume context the one
    /// CreateVolume returned (for volumes it made).
    pub fn check_contexts(
        &self,
        volume_id: &str,
        publish: &HashMap<String, String>,
        volume: &HashMap<String, String>,
    ) -> Outcome<()> {
        if !self.config.require_contexts {
            return Ok(());
        }
        if self.config.controller
            && sorted(publish) != publish_context(volume_id, &self.config.node_id)
        {
            return Err(Failure::invalid(format!(
                "publish_context of volume {volume_id} is not the one ControllerPublishVolume returned"
            )));
        }
        self.check_volume_context(volume_id, volume)
    }

    /// The volume context must be the one CreateVolume returned, for volumes
    /// it made.
    fn check_volume_context(
        &self,
        volume_id: &str,
        volume: &HashMap<String, String>,
    ) -> Outcome<()> {
        let matches = self.read_state(|state| {
            state
                .volumes
                .get(volume_id)
                .map_or(true, |created| sorted(volume) == created.volume_context)
        })?;
        if matches {
            Ok(())
        } else {
            Err(Failure::invalid(format!(
                "volume_context of volume {volume_id} is not the one CreateVolume returned"
            )))
        }
    }

    pub fn controller_publish_volume(
        &self,
        req: ControllerPublishVolumeRequest,
        _call: &Call,
    ) -> Outcome<ControllerPublishVolumeResponse> {
        self.controller_supported("ControllerPublishVolume")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let node = req.node_id.as_str();
        if node.is_empty() {
            return Err(Failure::invalid("node_id is required"));
        }
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Failure::invalid("volume_capability is required"))?;
        is_block(cap)?;
        let wanted = Attachment {
            access_mode: format!("{:?}", access_mode(cap)?),
            readonly: req.readonly,
        };
        let mut volume_context = req.volume_context.clone();
        self.check_epoch(id, "volume_context", &mut volume_context)?;
        let mut response = ControllerPublishVolumeResponse::new();
        response.publish_context = publish_context(id, node).into_iter().collect();

        // A fence of this volume and its lifting never interleave.
        let _fence = self.fencing.as_ref().map(|f| f.volume_locks.lock(id));
        let attached = self.controller_state.update(|state| -> Outcome<bool> {
            // Under the state's lock, like DeleteVolume's check: a volume
            // cannot be deleted between this check and the attachment.
            self.check_volume(id)?;
            self.check_node(node)?;
            let nodes = state.attachments.get(id);
            if let Some(existing) = nodes.and_then(|n| n.get(node)) {
                return if *existing == wanted {
                    Ok(false)
                } else {
                    Err(Failure::new(
                        RpcStatusCode::ALREADY_EXISTS,
                        format!(
                            "volume {id} is attached to node {node} with access mode {} readonly={}",
                            existing.access_mode, existing.readonly
                        ),
                    ))
                };
            }
            let others: Vec<(&String, &Attachment)> = nodes
                .map(|n| n.iter().filter(|(k, _)| *k != node).collect())
                .unwrap_or_default();
            if !others.is_empty()
                && (single_node(&wanted.access_mode)
                    || others.iter().any(|(_, a)| single_node(&a.access_mode)))
            {
                let names: Vec<&str> = others.iter().map(|(k, _)| k.as_str()).collect();
                return Err(Failure::precondition(format!(
                    "volume {id} is attached to node {} with a single-node access mode",
                    names.join(",")
                )));
            }
            let limit = self.config.max_volumes_per_node;
            if limit > 0 {
                let on_node = state
                    .attachments
                    .values()
                    .filter(|n| n.contains_key(node))
                    .count();
                if i64::try_from(on_node).unwrap_or(i64::MAX) >= limit {
                    return Err(Failure::new(
                        RpcStatusCode::RESOURCE_EXHAUSTED,
                        format!("node {node} already has {on_node} volumes attached (limit {limit})"),
                    ));
                }
            }
            state
                .attachments
                .entry(id.to_string())
                .or_default()
                .insert(node.to_string(), wanted);
            Ok(true)
        })?;
        if attached {
            log::info!("attached {id} to node {node}");
        }
        // Only once the attachment is durable: the node may use the volume
        // again.
        self.lift_fence(id, node)?;
        Ok(response)
    }

    pub fn controller_unpublish_volume(
        &self,
        req: ControllerUnpublishVolumeRequest,
        _call: &Call,
    ) -> Outcome<ControllerUnpublishVolumeResponse> {
        self.controller_supported("ControllerUnpublishVolume")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        let node = req.node_id.as_str();
        let _fence = self.fencing.as_ref().map(|f| f.volume_locks.lock(id));
        let changed = self.controller_state.update(|state| -> Outcome<bool> {
            Ok(match state.attachments.get_mut(id) {
                None => false,
                Some(_) if node.is_empty() => state.attachments.remove(id).is_some(),
                Some(nodes) => {
                    let removed = nodes.remove(node).is_some();
                    if nodes.is_empty() {
                        state.attachments.remove(id);
                    }
                    removed
                }
            })
        })?;
        if changed {
            log::info!(
                "detached {id} from {}",
                if node.is_empty() { "every node" } else { node }
            );
        }
        // OK only once the node has lost access (`fencing.rs`): a failed
        // unmount fails the call, and the CO's retry fences again.
        self.fence_on_unpublish(id, node)?;
        Ok(ControllerUnpublishVolumeResponse::new())
    }

    pub fn controller_get_capabilities(
        &self,
        _req: ControllerGetCapabilitiesRequest,
        _call: &Call,
    ) -> Outcome<ControllerGetCapabilitiesResponse> {
        self.controller_supported("ControllerGetCapabilities")?;
        use controller_service_capability::rpc::Type;
        let cap = |t: EnumOrUnknown<Type>| {
            let mut rpc = controller_service_capability::RPC::new();
            rpc.type_ = t;
            let mut c = ControllerServiceCapability::new();
            c.type_ = Some(controller_service_capability::Type::Rpc(rpc));
            c
        };
        let mut r = ControllerGetCapabilitiesResponse::new();
        r.capabilities
            .push(cap(EnumOrUnknown::new(Type::PUBLISH_UNPUBLISH_VOLUME)));
        r.capabilities
            .push(cap(EnumOrUnknown::new(Type::CREATE_DELETE_VOLUME)));
        if self.config.snapshots {
            for t in [
                Type::CREATE_DELETE_SNAPSHOT,
                Type::LIST_SNAPSHOTS,
                Type::CLONE_VOLUME,
            ] {
                r.capabilities.push(cap(EnumOrUnknown::new(t)));
            }
        }
        if self.config.expansion {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::EXPAND_VOLUME)));
        }
        if let Some(unknown) = self.unknown_capability() {
            r.capabilities.push(cap(EnumOrUnknown::from_i32(unknown)));
        }
        Ok(r)
    }

    pub fn create_volume(
        &self,
        req: CreateVolumeRequest,
        _call: &Call,
    ) -> Outcome<CreateVolumeResponse> {
        self.controller_supported("CreateVolume")?;
        let id = valid_volume_id("name", &req.name)?;
        check_capabilities(&req.volume_capabilities)?;
        let (required, limit) = req
            .capacity_range
            .as_ref()
            .map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        if required < 0 || limit < 0 || (limit > 0 && limit < required) {
            return Err(Failure::invalid(format!(
                "capacity_range required_bytes={required} limit_bytes={limit} is not a range"
            )));
        }
        let parameters = sorted(&req.parameters);
        let topology = self.placement(req.accessibility_requirements.as_ref())?;
        let source = self.content_source(req.volume_content_source.as_ref())?;
        let created = self
            .controller_state
            .update(|state| -> Outcome<CreatedVolume> {
                if let Some(existing) = state.volumes.get(id) {
                    // Idempotent for a compatible request; the spec's
                    // ALREADY_EXISTS for an incompatible one.
                    let fits = existing.capacity_bytes >= required
                        && (limit == 0 || existing.capacity_bytes <= limit);
                    let source_name = source.as_ref().map(|s| s.name.clone());
                    if !fits || existing.parameters != parameters || existing.source != source_name
                    {
                        return Err(Failure::new(
                            RpcStatusCode::ALREADY_EXISTS,
                            format!(
                                "volume {id} exists with capacity {} bytes, parameters {:?} and \
                                 source {:?}, incompatible with required_bytes={required} \
                                 limit_bytes={limit} parameters {parameters:?} source {:?}",
                                existing.capacity_bytes,
                                existing.parameters,
                                existing.source,
                                source_name
                            ),
                        ));
                    }
                    self.create_volume_dir(id)?;
                    return Ok(existing.clone());
                }
                // A volume from a source is at least as big as it.
                let mut capacity = required;
                if let Some(s) = &source {
                    capacity = capacity.max(s.size_bytes);
                    if limit > 0 && capacity > limit {
                        return Err(Failure::new(
                            RpcStatusCode::OUT_OF_RANGE,
                            format!(
                                "{} has {} bytes, more than limit_bytes={limit}",
                                s.name, s.size_bytes
                            ),
                        ));
                    }
                }
                let dir = self.create_volume_dir(id)?;
                if let Some(s) = &source {
                    crate::volume_ops::copy_dir(&s.dir, &dir)?;
                }
                let created = CreatedVolume {
                    capacity_bytes: capacity,
                    volume_context: BTreeMap::from([(
                        "claimd.test/volume".to_string(),
                        id.to_string(),
                    )]),
                    parameters: parameters.clone(),
                    accessible_topology: topology.clone(),
                    source: source.as_ref().map(|s| s.name.clone()),
                };
                if capacity > 0 {
                    state.capacities.insert(
                        id.to_string(),
                        Capacity {
                            controller: capacity,
                            node: capacity,
                        },
                    );
                }
                state.volumes.insert(id.to_string(), created.clone());
                Ok(created)
            })?;
        let mut volume = Volume::new();
        volume.volume_id = id.to_string();
        volume.capacity_bytes = created.capacity_bytes;
        volume.volume_context = created.volume_context.into_iter().collect();
        volume.accessible_topology = created
            .accessible_topology
            .iter()
            .map(|t| {
                let mut x = Topology::new();
                x.segments = t.clone().into_iter().collect();
                x
            })
            .collect();
        if req.volume_content_source.is_some() {
            volume.content_source = req.volume_content_source.clone();
        }
        let mut r = CreateVolumeResponse::new();
        r.volume = protobuf::MessageField::some(volume);
        log::info!("created volume {id}");
        Ok(r)
    }

    pub fn validate_volume_capabilities(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
        _call: &Call,
    ) -> Outcome<ValidateVolumeCapabilitiesResponse> {
        self.controller_supported("ValidateVolumeCapabilities")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        check_capabilities(&req.volume_capabilities)?;
        self.check_volume(id)?;
        if self.config.require_contexts {
            self.check_volume_context(id, &req.volume_context)?;
        }
        // Every access type and access mode CSI defines works here (the
        // checks above refused the rest): all of them are confirmed.
        let mut confirmed = validate_volume_capabilities_response::Confirmed::new();
        confirmed.volume_context = req.volume_context;
        confirmed.volume_capabilities = req.volume_capabilities;
        confirmed.parameters = req.parameters;
        let mut r = ValidateVolumeCapabilitiesResponse::new();
        r.confirmed = protobuf::MessageField::some(confirmed);
        Ok(r)
    }

    pub fn delete_volume(
        &self,
        req: DeleteVolumeRequest,
        _call: &Call,
    ) -> Outcome<DeleteVolumeResponse> {
        self.controller_supported("DeleteVolume")?;
        let id = valid_volume_id("volume_id", &req.volume_id)?;
        // Under the state's lock: no ControllerPublish can attach the
        // volume between the check and the removal.
        self.controller_state.update(|state| -> Outcome<()> {
            if let Some(nodes) = state.attachments.get(id) {
                let names: Vec<&str> = nodes.keys().map(String::as_str).collect();
                return Err(Failure::precondition(format!(
                    "volume {id} is still attached to node {}",
                    names.join(",")
                )));
            }
            let dir = self.volumes_dir().join(id);
            match fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(Failure::internal(format!(
                        "cannot remove volume {}: {e}",
                        dir.display()
                    )))
                }
                _ => {}
            }
            let img = self.volumes_dir().join(format!("{id}.img"));
            match fs::remove_file(&img) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(Failure::internal(format!(
                        "cannot remove volume {}: {e}",
                        img.display()
                    )))
                }
                _ => {}
            }
            state.volumes.remove(id);
            Ok(())
        })?;
        log::info!("deleted volume {id}");
        Ok(DeleteVolumeResponse::new())
    }
}
