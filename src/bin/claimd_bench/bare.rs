//! The bare client: the same CSI calls as the agent, with the same paths,
//! and nothing else (the floor the agent is compared with).

use std::path::PathBuf;

use claimd::csi::{self, CsiClient};

/// The bare client: exactly the calls the agent makes for one volume, with
/// the same paths in them (the agent's layout, `claimd::volumes::Paths`,
/// under its own root), so the directories it creates and removes are the
/// same too.
pub struct Bare {
    pub client: CsiClient,
    pub node_id: String,
    pub root: PathBuf,
}

impl Bare {
    pub fn usage() -> claimd::volumes::Usage {
        use claimd::volumes::{AccessMode, AttachmentMode, Usage};
        Usage {
            read_only: false,
            attachment: AttachmentMode::FileSystem,
            access_mode: AccessMode::SingleNodeWriter,
        }
    }

    pub fn cap() -> csi::VolumeCapability {
        use claimd::volumes::{volume_capability, MountOptions};
        volume_capability(&Self::usage(), &MountOptions::default(), &[], "")
    }

    pub fn layout(&self) -> claimd::volumes::Paths {
        claimd::volumes::Paths::new(&self.root)
    }

    pub fn paths(&self, id: &str) -> (PathBuf, PathBuf) {
        let (p, u) = (self.layout(), Self::usage());
        (p.staging("hp", id), p.target(id, id, &u))
    }

    pub fn mount(&self, id: &str) {
        let (staging, target) = self.paths(id);
        let mut cp = csi::ControllerPublishVolumeRequest::new();
        cp.volume_id = format!("ext-{id}");
        cp.node_id = self.node_id.clone();
        cp.volume_capability = protobuf::MessageField::some(Self::cap());
        let ctx = self
            .client
            .controller_publish_volume(&cp)
            .expect("bare publish");
        std::fs::create_dir_all(&staging).expect("mkdir staging");
        let mut st = csi::NodeStageVolumeRequest::new();
        st.volume_id = format!("ext-{id}");
        st.staging_target_path = staging.to_string_lossy().into_owned();
        st.publish_context = ctx.clone().into_iter().collect();
        st.volume_capability = protobuf::MessageField::some(Self::cap());
        self.client.node_stage_volume(&st).expect("bare stage");
        std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir parent");
        let mut p = csi::NodePublishVolumeRequest::new();
        p.volume_id = format!("ext-{id}");
        p.staging_target_path = st.staging_target_path.clone();
        p.target_path = target.to_string_lossy().into_owned();
        p.publish_context = ctx.into_iter().collect();
        p.volume_capability = protobuf::MessageField::some(Self::cap());
        self.client.node_publish_volume(&p).expect("bare publish");
    }

    pub fn release(&self, id: &str) {
        let (staging, target) = self.paths(id);
        let mut u = csi::NodeUnpublishVolumeRequest::new();
        u.volume_id = format!("ext-{id}");
        u.target_path = target.to_string_lossy().into_owned();
        self.client
            .node_unpublish_volume(&u)
            .expect("bare unpublish");
        let mut us = csi::NodeUnstageVolumeRequest::new();
        us.volume_id = format!("ext-{id}");
        us.staging_target_path = staging.to_string_lossy().into_owned();
        self.client.node_unstage_volume(&us).expect("bare unstage");
        let mut cu = csi::ControllerUnpublishVolumeRequest::new();
        cu.volume_id = format!("ext-{id}");
        cu.node_id = self.node_id.clone();
        self.client
            .controller_unpublish_volume(&cu)
            .expect("bare detach");
        // As the agent: the target (the plugin may have removed it), the
        // staging path, then their empty parents.
        let layout = self.layout();
        let _ = std::fs::remove_dir(&target);
        layout.remove_empty_parents(&target);
        let _ = std::fs::remove_dir(&staging);
        layout.remove_empty_parents(&staging);
    }
}
