//! The call log: one JSON line per call, appended before the reply is sent,
//! so a test can assert the exact calls the plugin received. Secrets are
//! recorded by key name only, never by value.
//!
//! Format (JSON lines, each written with one write(2) on an O_APPEND file,
//! so lines of concurrent calls, and of several plugin processes sharing a
//! file, never tear):
//!
//! - `event`: `"end"` — the line every call gets once its outcome is
//!   known, before the reply is sent (always written; these are the lines
//!   tests have always read) — or `"start"`, written when the call reaches
//!   the plugin, before its fault rule and its work, only with
//!   `--log-starts`. A call that never answers (a `hang` fault, a process
//!   killed or stopped mid-call) has a start line and no end line; a `late`
//!   call ends only after its late work, whatever the caller saw.
//! - `call_id`: `"<pid>-<n>"`, `n` counting from 1 in each process: the
//!   same on a call's start and end lines. `pid`: the plugin's process.
//! - `start_boottime_ns`: CLOCK_BOOTTIME in ns when the call reached the
//!   plugin (on both lines); `end_boottime_ns`: when it ended (end lines
//!   only). CLOCK_BOOTTIME is one clock for the whole machine (unlike
//!   `ts_ms`, it never steps and it runs through suspend), so times of
//!   several plugin processes, agents and the test compare directly.
//! - `ts_ms`: the wall clock (ms since the Unix epoch) when the line was
//!   written.
//! - `method`; `code` (end lines only): `"OK"`, a canonical gRPC code name,
//!   or `"EXIT"` for an `exit` fault; `late`: true when a `late` fault held
//!   the call past the caller's deadline.
//! - `fsyncs` (end lines only): the fsync(2) calls the process made until
//!   the line was written (its controller state and fences), counting from
//!   its start: a bench's difference of two lines is the plugin's own
//!   durable writes between them.
//! - What the request named, when the method has it: `volume_id`,
//!   `node_id`, `staging_target_path`, `target_path`, `readonly`,
//!   `access_mode`, `publish_context`, `volume_context`, `secret_keys`,
//!   `mount_group`, `required_bytes`, `snapshot`, `topology`.

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use claimd::csi::*;
use parking_lot::Mutex;
use serde::Serialize;

/// One call as logged. Fields a method's request does not have are
/// omitted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CallRecord {
    /// `"start"` or `"end"`.
    pub event: &'static str,
    /// `"<pid>-<n>"`: one call's start and end lines share it.
    pub call_id: String,
    pub pid: u32,
    /// CLOCK_BOOTTIME (ns) when the call reached the plugin.
    pub start_boottime_ns: u64,
    /// CLOCK_BOOTTIME (ns) when it ended; end lines only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end_boottime_ns: Option<u64>,
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
    /// "OK", a canonical gRPC code name, or "EXIT"; empty (left out) on
    /// start lines.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub code: String,
    /// A `late` fault held the call past the caller's deadline before it
    /// did its work: the caller saw DEADLINE_EXCEEDED, whatever `code` says.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub late: bool,
    /// End lines: the fsync(2) calls this process made until then
    /// (controller state, fences), counting from its start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsyncs: Option<u64>,
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

/// The start line's and end line's `event`.
pub const START: &str = "start";
pub const END: &str = "end";

/// A new `call_id` of this process.
pub fn next_call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// CLOCK_BOOTTIME in nanoseconds: one clock for every process of the
/// machine, running through suspend, never stepped.
pub fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec; CLOCK_BOOTTIME exists on
    // every Linux this runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
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
