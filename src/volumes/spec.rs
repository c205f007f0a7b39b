//! The registered volume spec, the usage an allocation asks for, and the
//! checks on both.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::csi;
use crate::ids::{check_id, InvalidId};

/// CSI access modes, spelled as in Nomad (`single-node-writer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    pub const ALL: [AccessMode; 7] = [
        AccessMode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AccessMode::SingleNodeWriter => "single-node-writer",
            AccessMode::SingleNodeReaderOnly => "single-node-reader-only",
            AccessMode::MultiNodeReaderOnly => "multi-node-reader-only",
            AccessMode::MultiNodeSingleWriter => "multi-node-single-writer",
            AccessMode::MultiNodeMultiWriter => "multi-node-multi-writer",
            AccessMode::SingleNodeSingleWriter => "single-node-single-writer",
            AccessMode::SingleNodeMultiWriter => "single-node-multi-writer",
        }
    }

    pub fn parse(s: &str) -> Option<AccessMode> {
        AccessMode::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Modes that keep every claim on one node.
    pub fn single_node(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeWriter
                | AccessMode::SingleNodeReaderOnly
                | AccessMode::SingleNodeSingleWriter
                | AccessMode::SingleNodeMultiWriter
        )
    }

    /// Modes that admit at most one writer.
    pub fn single_writer(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeWriter
                | AccessMode::MultiNodeSingleWriter
                | AccessMode::SingleNodeSingleWriter
        )
    }

    /// Modes that admit no writer.
    pub fn reader_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }

    pub fn to_csi(self) -> csi::volume_capability::access_mode::Mode {
        use csi::volume_capability::access_mode::Mode;
        match self {
            AccessMode::SingleNodeWriter => Mode::SINGLE_NODE_WRITER,
            AccessMode::SingleNodeReaderOnly => Mode::SINGLE_NODE_READER_ONLY,
            AccessMode::MultiNodeReaderOnly => Mode::MULTI_NODE_READER_ONLY,
            AccessMode::MultiNodeSingleWriter => Mode::MULTI_NODE_SINGLE_WRITER,
            AccessMode::MultiNodeMultiWriter => Mode::MULTI_NODE_MULTI_WRITER,
            AccessMode::SingleNodeSingleWriter => Mode::SINGLE_NODE_SINGLE_WRITER,
            AccessMode::SingleNodeMultiWriter => Mode::SINGLE_NODE_MULTI_WRITER,
        }
    }
}

impl fmt::Display for AccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the workload sees the volume.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum AttachmentMode {
    #[default]
    FileSystem,
    BlockDevice,
}

impl AttachmentMode {
    pub fn is_block(self) -> bool {
        self == AttachmentMode::BlockDevice
    }

    pub fn name(self) -> &'static str {
        match self {
            AttachmentMode::FileSystem => "file-system",
            AttachmentMode::BlockDevice => "block-device",
        }
    }

    pub fn parse(s: &str) -> Option<AttachmentMode> {
        match s {
            "file-system" => Some(AttachmentMode::FileSystem),
            "block-device" => Some(AttachmentMode::BlockDevice),
            _ => None,
        }
    }
}

impl fmt::Display for AttachmentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Mount options of a file-system volume.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountOptions {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fs_type: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_flags: Vec<String>,
}

/// A registered volume. `secrets` is kept only in the state file (mode
/// 0600) and never printed: `Debug` redacts it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeSpec {
    pub id: String,
    pub plugin_id: String,
    /// The plugin's own ID of the volume (CSI `volume_id`).
    pub external_id: String,
    pub access_modes: Vec<AccessMode>,
    pub attachment_modes: Vec<AttachmentMode>,
    #[serde(default)]
    pub mount_options: MountOptions,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub context: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
    /// Where the volume can be used: a node qualifies when one of these
    /// segment sets is a subset of its node plugin's segments. Empty: on
    /// every node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<Topology>,
    /// The capacity the plugin last reported (CreateVolume,
    /// ControllerExpandVolume); 0: unknown.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub capacity_bytes: i64,
    /// The plugin asked for a node expansion (ControllerExpandVolume's
    /// `node_expansion_required`) while the volume was mounted nowhere on
    /// the expanding node: the next mount does it after NodePublish.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub node_expansion_pending: bool,
}

/// One set of topology segments (`{"zone": "z1", "rack": "r7"}`).
pub type Topology = BTreeMap<String, String>;

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `{region=r1, zone=z1}`.
pub fn topology_text(t: &Topology) -> String {
    let parts: Vec<String> = t.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", parts.join(", "))
}

impl VolumeSpec {
    /// Whether a node with `segments` may use the volume: the volume names
    /// no topology, or one of its segment sets is a subset of the node's
    /// (Kubernetes' rule; a node may carry more keys than the volume asks
    /// for).
    pub fn accessible_from(&self, segments: &Topology) -> bool {
        self.accessible_topology.is_empty()
            || self
                .accessible_topology
                .iter()
                .any(|t| t.iter().all(|(k, v)| segments.get(k) == Some(v)))
    }

    /// The accessible topology for messages: `{zone=z1} or {zone=z2}`.
    pub fn topology_text(&self) -> String {
        let sets: Vec<String> = self.accessible_topology.iter().map(topology_text).collect();
        sets.join(" or ")
    }
}

impl fmt::Debug for VolumeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeSpec")
            .field("id", &self.id)
            .field("plugin_id", &self.plugin_id)
            .field("external_id", &self.external_id)
            .field("access_modes", &self.access_modes)
            .field("attachment_modes", &self.attachment_modes)
            .field("mount_options", &self.mount_options)
            .field("context", &self.context)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .field("accessible_topology", &self.accessible_topology)
            .field("capacity_bytes", &self.capacity_bytes)
            .finish()
    }
}

/// Why a volume spec or request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecError {
    Id(InvalidId),
    Invalid { what: String, problem: String },
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpecError::Id(e) => e.fmt(f),
            SpecError::Invalid { what, problem } => write!(f, "{what}: {problem}"),
        }
    }
}

impl std::error::Error for SpecError {}

impl From<InvalidId> for SpecError {
    fn from(e: InvalidId) -> Self {
        SpecError::Id(e)
    }
}

fn invalid(what: impl Into<String>, problem: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        what: what.into(),
        problem: problem.into(),
    }
}

impl VolumeSpec {
    pub fn validate(&self) -> Result<(), SpecError> {
        check_id("volume", &self.id)?;
        check_id("plugin", &self.plugin_id)?;
        let what = format!("volume {}", self.id);
        if self.external_id.is_empty() {
            return Err(invalid(what, "external_id must not be empty"));
        }
        if self.external_id.len() > 1024 || self.external_id.contains('\0') {
            return Err(invalid(
                what,
                "external_id is longer than 1024 bytes or has a NUL",
            ));
        }
        if self.access_modes.is_empty() {
            return Err(invalid(what, "access_modes must name at least one mode"));
        }
        if self.attachment_modes.is_empty() {
            return Err(invalid(
                what,
                "attachment_modes must name at least one mode",
            ));
        }
        let flags: usize = self.mount_options.mount_flags.iter().map(|f| f.len()).sum();
        if flags > 4096 {
            return Err(invalid(what, "mount_flags exceed the 4 KiB CSI allows"));
        }
        if self.capacity_bytes < 0 {
            return Err(invalid(what, "capacity_bytes must not be negative"));
        }
        Ok(())
    }
}

/// What one allocation asks of one volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    pub read_only: bool,
    pub attachment: AttachmentMode,
    pub access_mode: AccessMode,
}

impl Usage {
    /// `rw-file-system-single-node-writer`: the last path element of the
    /// staging and target paths.
    pub fn dir_name(&self) -> String {
        format!(
            "{}-{}-{}",
            if self.read_only { "ro" } else { "rw" },
            self.attachment.name(),
            self.access_mode.name()
        )
    }
}

/// One entry of an allocation's mount request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRequest {
    pub alias: String,
    pub volume_id: String,
    pub read_only: bool,
    /// None: the volume's first access mode (that fits `read_only`).
    pub access_mode: Option<AccessMode>,
    /// None: the volume's first attachment mode.
    pub attachment: Option<AttachmentMode>,
    /// Extra mount flags for this allocation (added to the volume's).
    #[serde(default)]
    pub mount_flags: Vec<String>,
    /// CSI `volume_mount_group` (a group ID the plugin mounts the volume
    /// for); empty: none. Only file-system volumes, only node plugins with
    /// VOLUME_MOUNT_GROUP.
    #[serde(default)]
    pub mount_group: String,
}

impl VolumeRequest {
    /// Checks the request against the volume and settles the usage.
    pub fn resolve(&self, spec: &VolumeSpec) -> Result<Usage, SpecError> {
        let what = format!("volume {} (alias {})", spec.id, self.alias);
        let access_mode = match self.access_mode {
            Some(m) if spec.access_modes.contains(&m) => m,
            Some(m) => {
                return Err(invalid(
                    what,
                    format!(
                        "access mode {m} is not one the volume supports ({})",
                        join(&spec.access_modes)
                    ),
                ))
            }
            // The first mode the volume supports that fits the request.
            None => *spec
                .access_modes
                .iter()
                .find(|m| self.read_only || !m.reader_only())
                .ok_or_else(|| {
                    invalid(
                        what.clone(),
                        format!(
                            "a read-write request needs a writable access mode; the volume only has {}",
                            join(&spec.access_modes)
                        ),
                    )
                })?,
        };
        if !self.read_only && access_mode.reader_only() {
            return Err(invalid(
                what,
                format!("a read-write request is impossible with access mode {access_mode}"),
            ));
        }
        let attachment = match self.attachment {
            Some(a) if !self.mount_group.is_empty() && a == AttachmentMode::BlockDevice => {
                return Err(invalid(
                    what,
                    "a mount group applies to file-system volumes only, not to block devices",
                ))
            }
            Some(a) if spec.attachment_modes.contains(&a) => a,
            Some(a) => {
                return Err(invalid(
                    what,
                    format!(
                        "attachment mode {a} is not one the volume supports ({})",
                        join(&spec.attachment_modes)
                    ),
                ))
            }
            None if !self.mount_group.is_empty() => *spec
                .attachment_modes
                .iter()
                .find(|a| **a == AttachmentMode::FileSystem)
                .ok_or_else(|| {
                    invalid(
                        what.clone(),
                        "a mount group applies to file-system volumes only; the volume is a block device",
                    )
                })?,
            None => spec.attachment_modes[0],
        };
        Ok(Usage {
            read_only: self.read_only,
            attachment,
            access_mode,
        })
    }
}

fn join<T: fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Checks one allocation's requests before anything changes.
pub fn validate_requests(alloc_id: &str, reqs: &[VolumeRequest]) -> Result<(), SpecError> {
    check_id("allocation", alloc_id)?;
    if reqs.is_empty() {
        return Err(invalid(
            format!("allocation {alloc_id}"),
            "the mount request names no volume",
        ));
    }
    let mut aliases = std::collections::HashSet::new();
    let mut volumes = std::collections::HashSet::new();
    for r in reqs {
        check_id("alias", &r.alias)?;
        check_id("volume", &r.volume_id)?;
        if !aliases.insert(r.alias.as_str()) {
            return Err(invalid(
                format!("allocation {alloc_id}"),
                format!("alias {} is given twice", r.alias),
            ));
        }
        if !volumes.insert(r.volume_id.as_str()) {
            return Err(invalid(
                format!("allocation {alloc_id}"),
                format!("volume {} is requested twice", r.volume_id),
            ));
        }
        let flags: usize = r.mount_flags.iter().map(|f| f.len()).sum();
        if flags > 4096 {
            return Err(invalid(
                format!("allocation {alloc_id}"),
                "mount_flags exceed the 4 KiB CSI allows",
            ));
        }
        if r.mount_group.len() > 128 || r.mount_group.chars().any(char::is_control) {
            return Err(invalid(
                format!("allocation {alloc_id}"),
                format!(
                    "mount group of alias {} is longer than 128 bytes or has a control character",
                    r.alias
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volumes::Paths;
    use std::path::{Path, PathBuf};

    fn spec(modes: &[AccessMode]) -> VolumeSpec {
        VolumeSpec {
            id: "db".into(),
            plugin_id: "hostpath".into(),
            external_id: "vol-db".into(),
            access_modes: modes.to_vec(),
            attachment_modes: vec![AttachmentMode::FileSystem],
            mount_options: MountOptions::default(),
            context: BTreeMap::new(),
            secrets: BTreeMap::from([("password".to_string(), "hunter2".to_string())]),
            accessible_topology: Vec::new(),
            capacity_bytes: 0,
            node_expansion_pending: false,
        }
    }

    fn req(read_only: bool, mode: Option<AccessMode>) -> VolumeRequest {
        VolumeRequest {
            alias: "data".into(),
            volume_id: "db".into(),
            read_only,
            access_mode: mode,
            attachment: None,
            mount_flags: vec![],
            mount_group: String::new(),
        }
    }

    #[test]
    fn usage_dir_name_and_paths() {
        let u = Usage {
            read_only: false,
            attachment: AttachmentMode::FileSystem,
            access_mode: AccessMode::SingleNodeWriter,
        };
        assert_eq!(u.dir_name(), "rw-file-system-single-node-writer");
        let p = Paths::new(Path::new("/m"));
        assert_eq!(p.staging("hp", "db"), PathBuf::from("/m/staging/hp/db"));
        assert_eq!(
            p.target("a1", "db", &u),
            PathBuf::from("/m/per-alloc/a1/db/rw-file-system-single-node-writer")
        );
    }

    #[test]
    fn resolve_picks_and_checks_modes() {
        let s = spec(&[
            AccessMode::MultiNodeReaderOnly,
            AccessMode::SingleNodeWriter,
        ]);
        assert_eq!(
            req(false, None).resolve(&s).expect("rw").access_mode,
            AccessMode::SingleNodeWriter
        );
        assert_eq!(
            req(true, None).resolve(&s).expect("ro").access_mode,
            AccessMode::MultiNodeReaderOnly
        );
        let ro = spec(&[AccessMode::MultiNodeReaderOnly]);
        let e = req(false, None).resolve(&ro).expect_err("rw on ro");
        assert!(e.to_string().contains("writable access mode"), "{e}");
        let e = req(false, Some(AccessMode::MultiNodeReaderOnly))
            .resolve(&ro)
            .expect_err("rw on ro mode");
        assert!(
            e.to_string().contains("read-write request is impossible"),
            "{e}"
        );
        let e = req(true, Some(AccessMode::MultiNodeMultiWriter))
            .resolve(&ro)
            .expect_err("unsupported");
        assert!(e.to_string().contains("not one the volume supports"), "{e}");
    }

    fn segments(pairs: &[(&str, &str)]) -> Topology {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn topology_matches_when_a_segment_set_is_a_subset_of_the_nodes() {
        let mut s = spec(&[AccessMode::SingleNodeWriter]);
        let node = segments(&[("region", "r1"), ("zone", "z1"), ("rack", "a")]);
        assert!(s.accessible_from(&node), "no topology: every node");
        s.accessible_topology = vec![segments(&[("zone", "z2")]), segments(&[("zone", "z1")])];
        assert!(s.accessible_from(&node));
        // A node with more keys than the volume asks for still matches
        // (Nomad's strict equality would refuse it).
        s.accessible_topology = vec![segments(&[("region", "r1"), ("zone", "z1")])];
        assert!(s.accessible_from(&node));
        s.accessible_topology = vec![segments(&[("region", "r1"), ("zone", "z2")])];
        assert!(!s.accessible_from(&node));
        assert!(!s.accessible_from(&Topology::new()));
        assert_eq!(s.topology_text(), "{region=r1, zone=z2}");
    }

    #[test]
    fn mount_group_needs_a_file_system() {
        let mut s = spec(&[AccessMode::SingleNodeWriter]);
        s.attachment_modes = vec![AttachmentMode::BlockDevice, AttachmentMode::FileSystem];
        let mut r = req(false, None);
        r.mount_group = "1000".into();
        assert_eq!(
            r.resolve(&s).expect("file system picked").attachment,
            AttachmentMode::FileSystem
        );
        r.attachment = Some(AttachmentMode::BlockDevice);
        assert!(r.resolve(&s).is_err());
        s.attachment_modes = vec![AttachmentMode::BlockDevice];
        r.attachment = None;
        assert!(r.resolve(&s).is_err());
    }

    #[test]
    fn debug_redacts_secrets() {
        let s = spec(&[AccessMode::SingleNodeWriter]);
        let d = format!("{s:?}");
        assert!(!d.contains("hunter2"), "{d}");
        assert!(d.contains("redacted"), "{d}");
    }

    #[test]
    fn request_validation() {
        let ok = vec![req(false, None)];
        assert!(validate_requests("a1", &ok).is_ok());
        assert!(validate_requests("../a1", &ok).is_err());
        assert!(validate_requests("a1", &[]).is_err());
        let dup = vec![req(false, None), req(true, None)];
        assert!(validate_requests("a1", &dup)
            .expect_err("dup")
            .to_string()
            .contains("twice"));
        let mut bad = req(false, None);
        bad.volume_id = "a/b".into();
        assert!(validate_requests("a1", &[bad]).is_err());
    }
}
