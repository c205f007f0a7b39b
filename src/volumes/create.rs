//! What `volume create` asks for: the volume as claimd will register it
//! (ID, plugin, modes, mount options, secrets) plus what CreateVolume takes
//! (name, capacity range, parameters, accessibility requirements, a content
//! source). The plugin's answer fills in the external ID, the volume
//! context, the accessible topology and the capacity.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::requests::volume_capability;
use super::spec::{
    AccessMode, AttachmentMode, MountOptions, SpecError, Topology, Usage, VolumeSpec,
};
use crate::csi;
use crate::ids::check_id;

/// CreateVolume's capacity range; 0 leaves a bound unset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityRange {
    #[serde(default)]
    pub required_bytes: i64,
    #[serde(default)]
    pub limit_bytes: i64,
}

/// Where the volume may be created (CSI TopologyRequirement).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessibilityRequirements {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requisite: Vec<Topology>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preferred: Vec<Topology>,
}

impl AccessibilityRequirements {
    pub fn is_empty(&self) -> bool {
        self.requisite.is_empty() && self.preferred.is_empty()
    }
}

/// What a new volume starts with: a snapshot of the plugin, or a copy of a
/// registered volume (by claimd's volume ID).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ContentSource {
    SnapshotId(String),
    VolumeId(String),
}

/// A `volume create` definition.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeCreate {
    pub id: String,
    pub plugin_id: String,
    /// The CSI name, the plugin's idempotency key; empty: `id`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub access_modes: Vec<AccessMode>,
    pub attachment_modes: Vec<AttachmentMode>,
    #[serde(default)]
    pub mount_options: MountOptions,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
    #[serde(default)]
    pub capacity_range: CapacityRange,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub accessibility_requirements: AccessibilityRequirements,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ContentSource>,
}

impl std::fmt::Debug for VolumeCreate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeCreate")
            .field("id", &self.id)
            .field("plugin_id", &self.plugin_id)
            .field("name", &self.name)
            .field("capacity_range", &self.capacity_range)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .finish_non_exhaustive()
    }
}

fn invalid(what: &str, problem: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        what: what.to_string(),
        problem: problem.into(),
    }
}

impl VolumeCreate {
    /// The CSI name: `name`, or the volume's ID.
    pub fn csi_name(&self) -> &str {
        if self.name.is_empty() {
            &self.id
        } else {
            &self.name
        }
    }

    /// The spec as it will be registered, before the plugin's answer
    /// (external ID, context, topology, capacity) is filled in.
    pub fn spec(&self) -> VolumeSpec {
        VolumeSpec {
            id: self.id.clone(),
            plugin_id: self.plugin_id.clone(),
            external_id: String::new(),
            access_modes: self.access_modes.clone(),
            attachment_modes: self.attachment_modes.clone(),
            mount_options: self.mount_options.clone(),
            context: BTreeMap::new(),
            secrets: self.secrets.clone(),
            accessible_topology: Vec::new(),
            capacity_bytes: 0,
            node_expansion_pending: false,
        }
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        check_id("volume", &self.id)?;
        check_id("plugin", &self.plugin_id)?;
        let what = format!("volume {}", self.id);
        if self.name.len() > 128 || self.name.chars().any(char::is_control) {
            return Err(invalid(
                &what,
                "name is longer than 128 bytes or has a control character",
            ));
        }
        if self.access_modes.is_empty() {
            return Err(invalid(&what, "access_modes must name at least one mode"));
        }
        if self.attachment_modes.is_empty() {
            return Err(invalid(
                &what,
                "attachment_modes must name at least one mode",
            ));
        }
        let CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        } = self.capacity_range;
        if required < 0 || limit < 0 {
            return Err(invalid(&what, "capacity_range bounds must not be negative"));
        }
        if limit > 0 && limit < required {
            return Err(invalid(
                &what,
                format!("capacity_range limit_bytes {limit} is below required_bytes {required}"),
            ));
        }
        match &self.source {
            Some(ContentSource::SnapshotId(s)) if s.is_empty() => {
                return Err(invalid(&what, "source.snapshot_id must not be empty"))
            }
            Some(ContentSource::VolumeId(v)) => check_id("source volume", v)?,
            _ => {}
        }
        Ok(())
    }

    /// The CreateVolume request: one capability per access mode and
    /// attachment mode. `source_external_id` is the plugin's ID of a source
    /// volume (the caller looks it up).
    pub fn csi_request(&self, source_external_id: Option<&str>) -> csi::CreateVolumeRequest {
        let mut capabilities = Vec::new();
        for access_mode in &self.access_modes {
            for attachment in &self.attachment_modes {
                let usage = Usage {
                    read_only: access_mode.reader_only(),
                    attachment: *attachment,
                    access_mode: *access_mode,
                };
                capabilities.push(volume_capability(&usage, &self.mount_options, &[], ""));
            }
        }
        let topology = |t: &Topology| {
            let mut x = csi::Topology::new();
            x.segments = t.clone().into_iter().collect();
            x
        };
        let mut req = csi::CreateVolumeRequest {
            name: self.csi_name().to_string(),
            volume_capabilities: capabilities,
            parameters: self.parameters.clone().into_iter().collect(),
            secrets: self.secrets.clone().into_iter().collect::<HashMap<_, _>>(),
            ..Default::default()
        };
        let CapacityRange {
            required_bytes,
            limit_bytes,
        } = self.capacity_range;
        if required_bytes > 0 || limit_bytes > 0 {
            req.capacity_range = protobuf::MessageField::some(csi::CapacityRange {
                required_bytes,
                limit_bytes,
                ..Default::default()
            });
        }
        let reqs = &self.accessibility_requirements;
        if !reqs.is_empty() {
            req.accessibility_requirements =
                protobuf::MessageField::some(csi::TopologyRequirement {
                    requisite: reqs.requisite.iter().map(topology).collect(),
                    preferred: reqs.preferred.iter().map(topology).collect(),
                    ..Default::default()
                });
        }
        use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
        let source = match (&self.source, source_external_id) {
            (Some(ContentSource::SnapshotId(id)), _) => Some(Type::Snapshot(SnapshotSource {
                snapshot_id: id.clone(),
                ..Default::default()
            })),
            (Some(ContentSource::VolumeId(_)), Some(external)) => {
                Some(Type::Volume(VolumeSource {
                    volume_id: external.to_string(),
                    ..Default::default()
                }))
            }
            _ => None,
        };
        if let Some(t) = source {
            req.volume_content_source = protobuf::MessageField::some(csi::VolumeContentSource {
                type_: Some(t),
                ..Default::default()
            });
        }
        req
    }

    /// The registered spec once the plugin answered.
    pub fn answered(&self, volume: &csi::Volume) -> VolumeSpec {
        let mut spec = self.spec();
        spec.external_id = volume.volume_id.clone();
        spec.context = volume
            .volume_context
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        spec.accessible_topology = volume
            .accessible_topology
            .iter()
            .map(|t| {
                t.segments
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .collect();
        spec.capacity_bytes = volume.capacity_bytes;
        spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create() -> VolumeCreate {
        serde_json::from_value(serde_json::json!({
            "id": "db", "plugin_id": "hp",
            "access_modes": ["single-node-writer", "multi-node-reader-only"],
            "attachment_modes": ["file-system"],
            "capacity_range": {"required_bytes": 1024},
            "parameters": {"tier": "fast"},
            "accessibility_requirements": {"requisite": [{"zone": "z1"}]},
            "source": {"snapshot_id": "snap-1"}
        }))
        .expect("a valid definition")
    }

    #[test]
    fn request_carries_every_field() {
        let c = create();
        c.validate().expect("valid");
        let r = c.csi_request(None);
        assert_eq!(r.name, "db");
        assert_eq!(r.volume_capabilities.len(), 2);
        assert_eq!(r.capacity_range.required_bytes, 1024);
        assert_eq!(r.parameters["tier"], "fast");
        assert_eq!(
            r.accessibility_requirements.requisite[0].segments["zone"],
            "z1"
        );
        assert!(matches!(
            &r.volume_content_source.type_,
            Some(csi::volume_content_source::Type::Snapshot(s)) if s.snapshot_id == "snap-1"
        ));
    }

    #[test]
    fn bad_definitions_are_refused() {
        let mut c = create();
        c.capacity_range = CapacityRange {
            required_bytes: 10,
            limit_bytes: 5,
        };
        assert!(c.validate().is_err());
        let mut c = create();
        c.access_modes.clear();
        assert!(c.validate().is_err());
        let mut c = create();
        c.source = Some(ContentSource::VolumeId("../x".into()));
        assert!(c.validate().is_err());
        let unknown = serde_json::from_value::<VolumeCreate>(serde_json::json!({
            "id": "db", "plugin_id": "hp", "access_modes": [], "attachment_modes": [],
            "size": 3
        }));
        assert!(unknown.is_err());
    }
}
