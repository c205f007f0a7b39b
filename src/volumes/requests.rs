//! The CSI requests of the lifecycle, built from a volume record and its
//! spec: every call of one volume carries the same volume ID, capability,
//! secrets, volume context and publish context.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::spec::{AttachmentMode, MountOptions, Usage, VolumeSpec};
use crate::csi;

/// The key under which plugins in `cluster.epoch_plugins` are given the
/// claim's epoch (its etcd create revision, the fencing token).
pub const EPOCH_CONTEXT_KEY: &str = "claimd.io/epoch";

/// What the requests need of a volume record (the state's `AllocVolume`
/// lends itself as one).
#[derive(Clone, Copy, Debug)]
pub struct VolumeRef<'a> {
    /// The plugin's ID of the volume.
    pub external_volume_id: &'a str,
    /// The node ID the volume is (to be) attached to.
    pub external_node_id: Option<&'a str>,
    pub usage: &'a Usage,
    pub mount_flags: &'a [String],
    /// CSI `volume_mount_group` (node calls only); empty: none.
    pub mount_group: &'a str,
    pub staging_path: Option<&'a Path>,
    pub target_path: &'a Path,
    pub publish_context: &'a BTreeMap<String, String>,
    /// The claim's epoch, for a plugin that asked for it
    /// (`cluster.epoch_plugins`): added under `EPOCH_CONTEXT_KEY` to the
    /// volume context of ControllerPublish and the publish context of
    /// NodeStage and NodePublish.
    pub epoch: Option<i64>,
}

/// The CSI volume capability for a usage. `mount_group` goes only to
/// NodeStage and NodePublish (of node plugins with VOLUME_MOUNT_GROUP, which
/// the mount checked before its claim).
pub fn volume_capability(
    usage: &Usage,
    opts: &MountOptions,
    extra_flags: &[String],
    mount_group: &str,
) -> csi::VolumeCapability {
    let mut cap = csi::VolumeCapability::new();
    let mut mode = csi::volume_capability::AccessMode::new();
    mode.mode = usage.access_mode.to_csi().into();
    cap.access_mode = protobuf::MessageField::some(mode);
    match usage.attachment {
        AttachmentMode::BlockDevice => {
            cap.access_type = Some(csi::volume_capability::Access_type::Block(
                csi::volume_capability::BlockVolume::new(),
            ));
        }
        AttachmentMode::FileSystem => {
            let mut m = csi::volume_capability::MountVolume::new();
            m.fs_type = opts.fs_type.clone();
            m.mount_flags = opts
                .mount_flags
                .iter()
                .chain(extra_flags)
                .cloned()
                .collect();
            m.volume_mount_group = mount_group.to_string();
            cap.access_type = Some(csi::volume_capability::Access_type::Mount(m));
        }
    }
    cap
}

pub fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// What NodeStage, NodePublish and ControllerPublish all carry for a volume.
struct RequestFields {
    volume_id: String,
    capability: protobuf::MessageField<csi::VolumeCapability>,
    secrets: HashMap<String, String>,
    volume_context: HashMap<String, String>,
    publish_context: HashMap<String, String>,
    staging_target_path: String,
}

fn request_fields(rec: VolumeRef<'_>, spec: &VolumeSpec, node: bool) -> RequestFields {
    let mut f = RequestFields {
        volume_id: rec.external_volume_id.to_string(),
        capability: protobuf::MessageField::some(volume_capability(
            rec.usage,
            &spec.mount_options,
            rec.mount_flags,
            if node { rec.mount_group } else { "" },
        )),
        secrets: secrets(spec),
        volume_context: spec.context.clone().into_iter().collect(),
        publish_context: rec.publish_context.clone().into_iter().collect(),
        staging_target_path: rec.staging_path.map(path_string).unwrap_or_default(),
    };
    if let Some(epoch) = rec.epoch {
        let into = if node {
            &mut f.publish_context
        } else {
            &mut f.volume_context
        };
        into.insert(EPOCH_CONTEXT_KEY.to_string(), epoch.to_string());
    }
    f
}

fn secrets(spec: &VolumeSpec) -> HashMap<String, String> {
    spec.secrets
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// ControllerPublishVolume to the record's external node ID. `readonly`
/// is asked only of a controller with PUBLISH_READONLY.
pub fn controller_publish(
    rec: VolumeRef<'_>,
    spec: &VolumeSpec,
    publish_readonly: bool,
) -> csi::ControllerPublishVolumeRequest {
    let f = request_fields(rec, spec, false);
    csi::ControllerPublishVolumeRequest {
        volume_id: f.volume_id,
        node_id: rec.external_node_id.unwrap_or_default().to_string(),
        volume_capability: f.capability,
        readonly: rec.usage.read_only && publish_readonly,
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}

pub fn node_stage(rec: VolumeRef<'_>, spec: &VolumeSpec) -> csi::NodeStageVolumeRequest {
    let f = request_fields(rec, spec, true);
    csi::NodeStageVolumeRequest {
        volume_id: f.volume_id,
        publish_context: f.publish_context,
        staging_target_path: f.staging_target_path,
        volume_capability: f.capability,
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}

pub fn node_publish(rec: VolumeRef<'_>, spec: &VolumeSpec) -> csi::NodePublishVolumeRequest {
    let f = request_fields(rec, spec, true);
    csi::NodePublishVolumeRequest {
        volume_id: f.volume_id,
        publish_context: f.publish_context,
        staging_target_path: f.staging_target_path,
        target_path: path_string(rec.target_path),
        volume_capability: f.capability,
        readonly: rec.usage.read_only,
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}

pub fn node_unpublish(rec: VolumeRef<'_>) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: rec.external_volume_id.to_string(),
        target_path: path_string(rec.target_path),
        ..Default::default()
    }
}

pub fn node_unstage(rec: VolumeRef<'_>, staging: &Path) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: rec.external_volume_id.to_string(),
        staging_target_path: path_string(staging),
        ..Default::default()
    }
}

/// ControllerUnpublishVolume with the node ID recorded at attach time,
/// never a fresh lookup. `spec` is None when the volume was deregistered
/// meanwhile (then no secrets are sent).
pub fn controller_unpublish(
    rec: VolumeRef<'_>,
    spec: Option<&VolumeSpec>,
) -> csi::ControllerUnpublishVolumeRequest {
    csi::ControllerUnpublishVolumeRequest {
        volume_id: rec.external_volume_id.to_string(),
        node_id: rec.external_node_id.unwrap_or_default().to_string(),
        secrets: spec.map(secrets).unwrap_or_default(),
        ..Default::default()
    }
}
