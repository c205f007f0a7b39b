//! What a node plugin must offer before a volume is claimed for it: the
//! volume's accessible topology must include this node, and a mount group
//! needs VOLUME_MOUNT_GROUP. Checked when the intent is recorded (for
//! plugins already fingerprinted) and again after waiting for the node
//! plugin, always before the claim; a mismatch fails at once, since
//! waiting cannot change it.

use super::error::{MountError, TopologyMismatch};
use crate::plugins::PluginSnapshot;
use crate::volumes::spec::topology_text;
use crate::volumes::VolumeSpec;

/// Checks one volume of a mount against its node plugin.
pub fn check_node_fits(
    alias: &str,
    spec: &VolumeSpec,
    mount_group: &str,
    node: &PluginSnapshot,
) -> Result<(), MountError> {
    if let Some(info) = &node.node_info {
        if !spec.accessible_from(&info.topology) {
            return Err(MountError::Topology(Box::new(TopologyMismatch {
                alias: alias.to_string(),
                volume_id: spec.id.clone(),
                volume_topology: spec.topology_text(),
                plugin_id: node.id.clone(),
                node_id: info.node_id.clone(),
                node_topology: topology_text(&info.topology),
            })));
        }
    }
    let has_mount_group = node
        .node_capabilities
        .as_ref()
        .is_some_and(|c| c.volume_mount_group);
    if !mount_group.is_empty() && !has_mount_group {
        return Err(MountError::MountGroupUnsupported {
            alias: alias.to_string(),
            plugin_id: node.id.clone(),
        });
    }
    Ok(())
}
