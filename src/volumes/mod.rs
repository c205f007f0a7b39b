//! Volumes as claimd knows them, and what the lifecycle does with one
//! volume: the registered spec and the usage an allocation asks for
//! (`spec`), the path layout under the mount root (`paths`), the CSI
//! requests built from a record (`requests`), the per-volume operation lock
//! (`lock`) and the "is anything of it still mounted" check (`mounted`).
//!
//! Usage counting (which records hold a staging path or an attachment) is a
//! query over the records and lives with them, in the state module (`usage.rs` there).

pub mod create;
pub mod lock;
pub mod mounted;
pub mod paths;
pub mod requests;
pub mod spec;

pub use create::{ContentSource, VolumeCreate};
pub use lock::{OperationLock, OperationLocks};
pub use paths::Paths;
pub use requests::volume_capability;
pub use spec::{
    topology_text, validate_requests, AccessMode, AttachmentMode, MountOptions, SpecError,
    Topology, Usage, VolumeRequest, VolumeSpec,
};
