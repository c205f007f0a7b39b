//! `CsiClient` against the real test plugin process over a real unix
//! socket, with real bind mounts: every RPC, every error class, deadlines,
//! undecodable replies and the call log.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::*;
use claimd::csi::grpc::{ControllerClient, IdentityClient, NodeClient};
use claimd::csi::volume_capability::access_mode::Mode;
use claimd::csi::*;
use grpcio::{CallOption, ChannelBuilder, RpcStatusCode};
use serde_json::json;

const NODE: &str = "node-a";

/// What the test plugin's controller answers for `volume` on `node`.
fn expected_context(volume: &str, node: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("attached_node".to_string(), node.to_string()),
        ("device".to_string(), format!("/dev/claimd-test/{volume}")),
    ])
}

// ---- Requests ------------------------------------------------------------

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn context_map(ctx: &BTreeMap<String, String>) -> HashMap<String, String> {
    ctx.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("test paths are UTF-8").to_string()
}

fn capability(mode: Mode, block: bool) -> VolumeCapability {
    let mut cap = VolumeCapability::new();
    cap.access_type = Some(if block {
        volume_capability::Access_type::Block(volume_capability::BlockVolume::new())
    } else {
        volume_capability::Access_type::Mount(volume_capability::MountVolume::new())
    });
    let mut am = volume_capability::AccessMode::new();
    am.mode = mode.into();
    cap.access_mode = Some(am).into();
    cap
}

fn controller_publish(volume: &str, node: &str, mode: Mode) -> ControllerPublishVolumeRequest {
    let mut r = ControllerPublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.node_id = node.to_string();
    r.volume_capability = Some(capability(mode, false)).into();
    r
}

fn controller_unpublish(volume: &str, node: &str) -> ControllerUnpublishVolumeRequest {
    let mut r = ControllerUnpublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.node_id = node.to_string();
    r
}

fn stage(volume: &str, staging: &Path, ctx: &BTreeMap<String, String>) -> NodeStageVolumeRequest {
    let mut r = NodeStageVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = path_str(staging);
    r.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, false)).into();
    r.publish_context = context_map(ctx);
    r
}

fn unstage(volume: &str, staging: &Path) -> NodeUnstageVolumeRequest {
    let mut r = NodeUnstageVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = path_str(staging);
    r
}

fn publish(
    volume: &str,
    staging: Option<&Path>,
    target: &Path,
    readonly: bool,
    ctx: &BTreeMap<String, String>,
) -> NodePublishVolumeRequest {
    let mut r = NodePublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.staging_target_path = staging.map(path_str).unwrap_or_default();
    r.target_path = path_str(target);
    r.readonly = readonly;
    r.volume_capability = Some(capability(Mode::SINGLE_NODE_WRITER, false)).into();
    r.publish_context = context_map(ctx);
    r
}

fn unpublish(volume: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    let mut r = NodeUnpublishVolumeRequest::new();
    r.volume_id = volume.to_string();
    r.target_path = path_str(target);
    r
}

// ---- Assertions ----------------------------------------------------------

/// Asserts a gRPC status error with this code and class; returns it.
#[track_caller]
fn expect_status<T: std::fmt::Debug>(
    result: Result<T, CsiError>,
    code: RpcStatusCode,
    class: ErrorClass,
) -> CsiError {
    let err = result.expect_err("the call should fail");
    assert_eq!(err.code(), Some(code), "unexpected error: {err:?}");
    assert_eq!(err.class(), class, "class of {err:?}");
    err
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(m, c)| (m.to_string(), c.to_string()))
        .collect()
}

// ---- Strict like a real plugin: the spec's refusals ----------------------

/// A raw Controller client (for ValidateVolumeCapabilities, which claimd
/// does not call).
fn raw_controller(plugin: &TestPlugin) -> ControllerClient {
    let channel =
        ChannelBuilder::new(grpc_env()).connect(&format!("unix:{}", plugin.socket.display()));
    ControllerClient::new(channel)
}

/// The status code of a raw call's error.
#[track_caller]
fn raw_code<T: std::fmt::Debug>(r: grpcio::Result<T>) -> RpcStatusCode {
    match r.expect_err("the call should fail") {
        grpcio::Error::RpcFailure(s) => s.code(),
        e => panic!("not a status: {e:?}"),
    }
}

fn call_codes(plugin: &TestPlugin, method: &str) -> Vec<String> {
    plugin
        .call_log()
        .calls_of(method)
        .iter()
        .map(|c| c["code"].as_str().expect("code").to_string())
        .collect()
}

/// umount(2) of a path, as an administrator would; the return code.
fn admin_umount(path: &Path) -> i32 {
    let c = std::ffi::CString::new(path.to_str().expect("UTF-8")).expect("no NUL");
    // SAFETY: a valid NUL-terminated path that outlives the call.
    unsafe { libc::umount2(c.as_ptr(), 0) }
}

/// Milliseconds since the epoch, as the call log's `ts_ms`.
fn now_ms() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch");
    u64::try_from(d.as_millis()).expect("fits")
}

// ---- Error classes through faults ----------------------------------------

/// A plugin with a volume staged and published at `target`.
struct Published {
    plugin: TestPlugin,
    client: CsiClient,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
}

fn published(dir: &TestDir) -> Published {
    let plugin = TestPlugin::builder(dir.path())
        .no_controller()
        .volumes(&["v"])
        .start();
    let client = plugin.client();
    let staging = dir.mkdir("staging");
    let target = dir.mkdir("alloc").join("t");
    let none = BTreeMap::new();
    client
        .node_stage_volume(&stage("v", &staging, &none))
        .expect("NodeStage");
    client
        .node_publish_volume(&publish("v", Some(&staging), &target, false, &none))
        .expect("NodePublish");
    Published {
        plugin,
        client,
        staging,
        target,
    }
}

mod calls;
mod faults_and_log;
mod refusals;
