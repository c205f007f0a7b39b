//! The call log: one JSON line per call, appended before the reply is sent,
//! so a test can assert the exact calls the plugin received. Secrets are
//! recorded by key name only, never by value.

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use claimd::csi::*;
use parking_lot::Mutex;
use serde::Serialize;

/// One call as logged. Fields a method's request does not have are
/// omitted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CallRecord {
    pub ts_ms: u64,
    pub method: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staging_target_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_context: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_context: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_keys: Option<Vec<String>>,
    /// The CSI volume_mount_group, when one was sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount_group: Option<String>,
    /// CreateVolume's, ControllerExpandVolume's and NodeExpandVolume's
    /// capacity_range.required_bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub required_bytes: Option<i64>,
    /// CreateSnapshot's name, DeleteSnapshot's snapshot ID, CreateVolume's
    /// source (`snapshot:<id>`, `volume:<id>`), ListSnapshots' filters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// CreateVolume's accessibility requirements (requisite, then
    /// preferred) as `k=v,k=v` sets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<Vec<String>>,
    /// "OK", a canonical gRPC code name, or "EXIT".
    pub code: String,
    /// A `late` fault held the call past the caller's deadline before it
    /// did its work: the caller saw DEADLINE_EXCEEDED, whatever `code` says.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub late: bool,
}

/// Appends records to the call log file.
pub struct CallLog {
    path: PathBuf,
    /// One writer at a time keeps lines whole and in reply order.
    lock: Mutex<()>,
}

impl CallLog {
    pub fn new(path: PathBuf) -> CallLog {
        CallLog {
            path,
            lock: Mutex::new(()),
        }
    }

    pub fn append(&self, record: &CallRecord) -> io::Result<()> {
        let mut line = serde_json::to_vec(record).map_err(io::Error::other)?;
        line.push(b'\n');
        let _guard = self.lock.lock();
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        // One write(2) per line: with O_APPEND the line lands whole even if
        // another process appends to the same file.
        let written = f.write(&line)?;
        if written != line.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!(
                    "short write to call log ({written} of {} bytes)",
                    line.len()
                ),
            ));
        }
        Ok(())
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn context(map: &HashMap<String, String>) -> Option<BTreeMap<String, String>> {
    Some(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

fn secret_keys(map: &HashMap<String, String>) -> Option<Vec<String>> {
    let mut keys: Vec<String> = map.keys().cloned().collect();
    keys.sort();
    Some(keys)
}

fn mount_group(cap: &protobuf::MessageField<VolumeCapability>) -> Option<String> {
    match cap.as_ref()?.access_type.as_ref()? {
        volume_capability::Access_type::Mount(m) if !m.volume_mount_group.is_empty() => {
            Some(m.volume_mount_group.clone())
        }
        _ => None,
    }
}

fn required(range: &protobuf::MessageField<CapacityRange>) -> Option<i64> {
    range.as_ref().map(|r| r.required_bytes)
}

fn access_mode(cap: &protobuf::MessageField<VolumeCapability>) -> Option<String> {
    let cap = cap.as_ref()?;
    Some(match cap.access_mode.as_ref() {
        None => "UNKNOWN".to_string(),
        Some(m) => match m.mode.enum_value() {
            Ok(mode) => format!("{mode:?}"),
            Err(n) => format!("UNKNOWN_{n}"),
        },
    })
}

/// The loggable, non-secret facts of a request.
pub trait Describe {
    fn describe(&self, method: &'static str) -> CallRecord;
}

macro_rules! describe_empty {
    ($($t:ty),*) => {$(
        impl Describe for $t {
            fn describe(&self, method: &'static str) -> CallRecord {
                CallRecord { method, ..CallRecord::default() }
            }
        }
    )*};
}

describe_empty!(
    GetPluginInfoRequest,
    GetPluginCapabilitiesRequest,
    ProbeRequest,
    NodeGetCapabilitiesRequest,
    NodeGetInfoRequest,
    ControllerGetCapabilitiesRequest
);

impl Describe for NodeStageVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            staging_target_path: Some(self.staging_target_path.clone()),
            access_mode: access_mode(&self.volume_capability),
            publish_context: context(&self.publish_context),
            volume_context: context(&self.volume_context),
            secret_keys: secret_keys(&self.secrets),
            mount_group: mount_group(&self.volume_capability),
            ..CallRecord::default()
        }
    }
}

impl Describe for NodeUnstageVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            staging_target_path: Some(self.staging_target_path.clone()),
            ..CallRecord::default()
        }
    }
}

impl Describe for NodePublishVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            staging_target_path: Some(self.staging_target_path.clone()),
            target_path: Some(self.target_path.clone()),
            readonly: Some(self.readonly),
            access_mode: access_mode(&self.volume_capability),
            publish_context: context(&self.publish_context),
            volume_context: context(&self.volume_context),
            secret_keys: secret_keys(&self.secrets),
            mount_group: mount_group(&self.volume_capability),
            ..CallRecord::default()
        }
    }
}

impl Describe for NodeGetVolumeStatsRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            target_path: Some(self.volume_path.clone()),
            ..CallRecord::default()
        }
    }
}

impl Describe for NodeUnpublishVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            target_path: Some(self.target_path.clone()),
            ..CallRecord::default()
        }
    }
}

impl Describe for ControllerPublishVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            node_id: Some(self.node_id.clone()),
            readonly: Some(self.readonly),
            access_mode: access_mode(&self.volume_capability),
            volume_context: context(&self.volume_context),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for ControllerUnpublishVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            node_id: Some(self.node_id.clone()),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for CreateVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        use volume_content_source::Type;
        let source = self
            .volume_content_source
            .as_ref()
            .and_then(|s| s.type_.as_ref())
            .map(|t| match t {
                Type::Snapshot(s) => format!("snapshot:{}", s.snapshot_id),
                Type::Volume(v) => format!("volume:{}", v.volume_id),
                _ => "unknown".to_string(),
            });
        let topology = self.accessibility_requirements.as_ref().map(|r| {
            r.requisite
                .iter()
                .chain(&r.preferred)
                .map(|t| {
                    let mut pairs: Vec<String> =
                        t.segments.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    pairs.sort();
                    pairs.join(",")
                })
                .collect()
        });
        CallRecord {
            method,
            // The volume ID this plugin will answer with is the name.
            volume_id: Some(self.name.clone()),
            secret_keys: secret_keys(&self.secrets),
            required_bytes: required(&self.capacity_range),
            snapshot: source,
            topology,
            ..CallRecord::default()
        }
    }
}

impl Describe for CreateSnapshotRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.source_volume_id.clone()),
            snapshot: Some(self.name.clone()),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for DeleteSnapshotRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            snapshot: Some(self.snapshot_id.clone()),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for ListSnapshotsRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.source_volume_id.clone()).filter(|v| !v.is_empty()),
            snapshot: Some(self.snapshot_id.clone()).filter(|v| !v.is_empty()),
            ..CallRecord::default()
        }
    }
}

impl Describe for ControllerExpandVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            required_bytes: required(&self.capacity_range),
            access_mode: access_mode(&self.volume_capability),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for NodeExpandVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            target_path: Some(self.volume_path.clone()),
            staging_target_path: Some(self.staging_target_path.clone()),
            required_bytes: required(&self.capacity_range),
            access_mode: access_mode(&self.volume_capability),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for ValidateVolumeCapabilitiesRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            volume_context: context(&self.volume_context),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}

impl Describe for DeleteVolumeRequest {
    fn describe(&self, method: &'static str) -> CallRecord {
        CallRecord {
            method,
            volume_id: Some(self.volume_id.clone()),
            secret_keys: secret_keys(&self.secrets),
            ..CallRecord::default()
        }
    }
}
