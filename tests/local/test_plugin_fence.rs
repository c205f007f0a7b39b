//! The test plugin's fencing (`--fence-on-unpublish`): two plugin
//! processes, one per node, share one storage system; node A's plugin also
//! serves the controller. ControllerUnpublishVolume of the volume from node
//! B really cuts B off: its staging and target paths are unmounted (read
//! from /proc/self/mountinfo) and its NodeStage and NodePublish refused,
//! until a new ControllerPublishVolume to B. Node A is untouched.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::common::*;
use claimd::csi::volume_capability::access_mode::Mode;
use claimd::csi::*;
use grpcio::RpcStatusCode;
use serde_json::Value;

const VOLUME: &str = "shared-v";

fn path_str(p: &Path) -> String {
    p.to_str().expect("test paths are UTF-8").to_string()
}

fn capability() -> VolumeCapability {
    let mut cap = VolumeCapability::new();
    cap.access_type = Some(volume_capability::Access_type::Mount(
        volume_capability::MountVolume::new(),
    ));
    let mut am = volume_capability::AccessMode::new();
    am.mode = Mode::MULTI_NODE_MULTI_WRITER.into();
    cap.access_mode = Some(am).into();
    cap
}

fn controller_publish(node: &str) -> ControllerPublishVolumeRequest {
    let mut r = ControllerPublishVolumeRequest::new();
    r.volume_id = VOLUME.to_string();
    r.node_id = node.to_string();
    r.volume_capability = Some(capability()).into();
    r
}

fn controller_unpublish(node: &str) -> ControllerUnpublishVolumeRequest {
    let mut r = ControllerUnpublishVolumeRequest::new();
    r.volume_id = VOLUME.to_string();
    r.node_id = node.to_string();
    r
}

/// One node: its plugin (sharing `storage`) and its staging and target
/// paths.
struct Node {
    id: String,
    plugin: TestPlugin,
    staging: PathBuf,
    target: PathBuf,
}

impl Node {
    fn start(dir: &TestDir, name: &str, storage: &Path, controller_for: &[&str]) -> Node {
        let id = format!("node-{name}");
        let builder = TestPlugin::builder(&dir.path().join(name))
            .node_id(&id)
            .storage(storage)
            .fence_on_unpublish()
            .log_starts();
        let plugin = if controller_for.is_empty() {
            builder.start()
        } else {
            builder.known_nodes(controller_for).start()
        };
        Node {
            staging: dir.mkdir(&format!("{name}/staging")),
            target: dir.mkdir(&format!("{name}/pods")).join("t"),
            id,
            plugin,
        }
    }

    fn stage(&self, ctx: &HashMap<String, String>) -> Result<(), CsiError> {
        let mut r = NodeStageVolumeRequest::new();
        r.volume_id = VOLUME.to_string();
        r.staging_target_path = path_str(&self.staging);
        r.volume_capability = Some(capability()).into();
        r.publish_context = ctx.clone();
        self.plugin.client().node_stage_volume(&r).map(drop)
    }

    fn publish(&self, ctx: &HashMap<String, String>) -> Result<(), CsiError> {
        let mut r = NodePublishVolumeRequest::new();
        r.volume_id = VOLUME.to_string();
        r.staging_target_path = path_str(&self.staging);
        r.target_path = path_str(&self.target);
        r.volume_capability = Some(capability()).into();
        r.publish_context = ctx.clone();
        self.plugin.client().node_publish_volume(&r).map(drop)
    }

    fn unpublish(&self) {
        let mut r = NodeUnpublishVolumeRequest::new();
        r.volume_id = VOLUME.to_string();
        r.target_path = path_str(&self.target);
        self.plugin
            .client()
            .node_unpublish_volume(&r)
            .expect("NodeUnpublish");
    }

    fn unstage(&self) {
        let mut r = NodeUnstageVolumeRequest::new();
        r.volume_id = VOLUME.to_string();
        r.staging_target_path = path_str(&self.staging);
        self.plugin
            .client()
            .node_unstage_volume(&r)
            .expect("NodeUnstage");
    }

    fn mount_up(&self, controller: &TestPlugin) {
        let ctx: HashMap<String, String> = controller
            .client()
            .controller_publish_volume(&controller_publish(&self.id))
            .expect("ControllerPublish")
            .into_iter()
            .collect();
        self.stage(&ctx).expect("NodeStage");
        self.publish(&ctx).expect("NodePublish");
    }

    /// Whether the staging path and the target are mount points (from
    /// /proc/self/mountinfo).
    fn mounted(&self) -> (bool, bool) {
        (is_mount_point(&self.staging), is_mount_point(&self.target))
    }
}

#[track_caller]
fn refused(result: Result<(), CsiError>, what: &str) -> String {
    let e = result.expect_err(what);
    assert_eq!(
        e.code(),
        Some(RpcStatusCode::FAILED_PRECONDITION),
        "{what}: {e}"
    );
    e.to_string()
}

fn fence_file(storage: &Path, node: &str) -> PathBuf {
    storage
        .join("fencing")
        .join(VOLUME)
        .join(node)
        .join("fenced")
}

fn read_json(path: &Path) -> Value {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn controller_unpublish_cuts_the_node_off_until_the_next_controller_publish() {
    let dir = TestDir::new();
    let storage = dir.mkdir("storage");
    add_volume_dir(&storage, VOLUME);
    let a = Node::start(&dir, "a", &storage, &["node-b"]);
    let b = Node::start(&dir, "b", &storage, &[]);
    a.mount_up(&a.plugin);
    b.mount_up(&a.plugin);
    assert_eq!(a.mounted(), (true, true));
    assert_eq!(b.mounted(), (true, true));
    // One volume: what B writes is in the shared storage.
    fs::write(b.target.join("from-b"), "1").expect("write through B's target");
    assert_eq!(
        fs::read_to_string(storage.join("volumes").join(VOLUME).join("from-b"))
            .expect("in the volume"),
        "1"
    );
    // B's plugin recorded its paths in the shared storage.
    let paths = read_json(
        &storage
            .join("fencing")
            .join(VOLUME)
            .join("node-b/paths.json"),
    );
    assert_eq!(paths["staging"], serde_json::json!([path_str(&b.staging)]));
    assert_eq!(paths["targets"], serde_json::json!([path_str(&b.target)]));

    // The controller unpublishes B: B's paths are unmounted before the
    // answer, A's stay.
    a.plugin
        .client()
        .controller_unpublish_volume(&controller_unpublish(&b.id))
        .expect("ControllerUnpublish");
    assert_eq!(b.mounted(), (false, false), "B is cut off");
    assert_eq!(a.mounted(), (true, true), "A keeps its mounts");
    assert!(!b.target.join("from-b").exists());
    let fence = read_json(&fence_file(&storage, "node-b"));
    assert_eq!(fence["done"], true, "{fence}");
    assert_eq!(fence["node_id"], "node-b");
    assert_eq!(
        fence["unmounted"],
        serde_json::json!([path_str(&b.target), path_str(&b.staging)]),
        "{fence}"
    );
    assert_eq!(fence["detached"], serde_json::json!([]));
    assert!(!fence_file(&storage, "node-a").exists());

    // B may not come back on its own: NodeStage and NodePublish refused.
    let ctx = HashMap::new();
    let msg = refused(b.stage(&ctx), "NodeStage of a fenced node");
    assert!(msg.contains("fenced from node node-b"), "{msg}");
    let msg = refused(b.publish(&ctx), "NodePublish of a fenced node");
    assert!(msg.contains("fenced from node node-b"), "{msg}");
    assert_eq!(b.mounted(), (false, false));
    // Its teardown works as always.
    b.unpublish();
    b.unstage();
    assert!(read_json(
        &storage
            .join("fencing")
            .join(VOLUME)
            .join("node-b/paths.json")
    )["targets"]
        .as_array()
        .expect("a list")
        .is_empty());

    // A new ControllerPublish to B lifts the fence.
    b.mount_up(&a.plugin);
    assert_eq!(b.mounted(), (true, true));
    assert!(!fence_file(&storage, "node-b").exists());
    assert_eq!(
        fs::read_to_string(b.target.join("from-b")).expect("the volume again"),
        "1"
    );
    // Every call ended (none is left started and not ended).
    for n in [&a, &b] {
        assert!(n.plugin.call_log().open_calls().is_empty());
    }
    let codes: Vec<(String, String)> = b
        .plugin
        .call_log()
        .methods_and_codes()
        .into_iter()
        .filter(|(m, _)| m.starts_with("Node"))
        .collect();
    let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(m, c)| (m.to_string(), c.to_string()))
            .collect()
    };
    assert_eq!(
        codes,
        pairs(&[
            ("NodeStageVolume", "OK"),
            ("NodePublishVolume", "OK"),
            ("NodeStageVolume", "FAILED_PRECONDITION"),
            ("NodePublishVolume", "FAILED_PRECONDITION"),
            ("NodeUnpublishVolume", "OK"),
            ("NodeUnstageVolume", "OK"),
            ("NodeStageVolume", "OK"),
            ("NodePublishVolume", "OK"),
        ])
    );
}

/// A busy mount (a file open in B's target) cannot be unmounted plainly:
/// the fence detaches it (MNT_DETACH) and says so in the marker. The path
/// no longer leads to the volume; the open file itself keeps working (real
/// storage would fail its I/O).
#[test]
fn a_busy_mount_is_detached_by_the_fence() {
    let dir = TestDir::new();
    let storage = dir.mkdir("storage");
    add_volume_dir(&storage, VOLUME);
    let a = Node::start(&dir, "a", &storage, &["node-b"]);
    let b = Node::start(&dir, "b", &storage, &[]);
    b.mount_up(&a.plugin);
    let open = fs::File::create(b.target.join("held-open")).expect("open a file in B's target");
    a.plugin
        .client()
        .controller_unpublish_volume(&controller_unpublish(""))
        .expect("ControllerUnpublish from every node");
    assert_eq!(b.mounted(), (false, false), "detached");
    let fence = read_json(&fence_file(&storage, "node-b"));
    assert_eq!(fence["done"], true, "{fence}");
    let detached: Vec<String> = fence["detached"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|p| p.as_str().expect("a path").to_string())
        .collect();
    assert!(detached.contains(&path_str(&b.target)), "{fence}");
    assert!(!b.target.join("held-open").exists());
    drop(open);
    let msg = refused(b.publish(&HashMap::new()), "NodePublish of a fenced node");
    assert!(msg.contains("fenced"), "{msg}");
    // The volume is still there, with the file.
    assert!(storage
        .join("volumes")
        .join(VOLUME)
        .join("held-open")
        .exists());
}

/// A NodePublish that reached B's plugin before the fence but does its
/// work after it (held by a `delay` fault) is refused, and mounts nothing:
/// a late call cannot undo a fence.
#[test]
fn a_node_publish_held_across_the_fence_is_refused() {
    let dir = TestDir::new();
    let storage = dir.mkdir("storage");
    add_volume_dir(&storage, VOLUME);
    let a = Node::start(&dir, "a", &storage, &["node-b"]);
    let b = Node::start(&dir, "b", &storage, &[]);
    let ctx: HashMap<String, String> = a
        .plugin
        .client()
        .controller_publish_volume(&controller_publish(&b.id))
        .expect("ControllerPublish")
        .into_iter()
        .collect();
    b.stage(&ctx).expect("NodeStage");
    b.plugin.faults().set(serde_json::json!([
        {"method": "NodePublishVolume", "action": "delay", "ms": 5000, "count": 1}
    ]));
    let publish = std::thread::scope(|s| {
        let late = s.spawn(|| b.publish(&ctx));
        wait_until(
            std::time::Duration::from_secs(10),
            "B's NodePublish to start",
            || {
                b.plugin
                    .call_log()
                    .open_calls()
                    .iter()
                    .any(|c| c["method"] == "NodePublishVolume")
            },
        );
        a.plugin
            .client()
            .controller_unpublish_volume(&controller_unpublish(&b.id))
            .expect("ControllerUnpublish");
        late.join().expect("the publishing thread")
    });
    // The fence ended before the held call did its work.
    let fenced_at = a.plugin.call_log().calls_of("ControllerUnpublishVolume")[0]["end_boottime_ns"]
        .as_u64()
        .expect("end_boottime_ns");
    let published = b.plugin.call_log().calls_of("NodePublishVolume");
    let ended_at = published[0]["end_boottime_ns"]
        .as_u64()
        .expect("end_boottime_ns");
    assert!(
        fenced_at < ended_at,
        "the fence ({fenced_at}) came after the held call ended ({ended_at})"
    );
    let msg = refused(publish, "a NodePublish held across the fence");
    assert!(msg.contains("fenced"), "{msg}");
    assert_eq!(b.mounted(), (false, false));
}
