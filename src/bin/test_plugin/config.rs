//! The test plugin's command line: a small hand-written parser, so the
//! binary needs no argument-parsing crate.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

pub const USAGE: &str = "\
claimd-test-plugin: a CSI plugin (Identity, Node, Controller) for claimd's tests.

Serves CSI v1 on a unix socket. The storage system (--storage, default --root) holds
the volumes, directories <storage>/volumes/<volume_id> (block volumes: regular files
<storage>/volumes/<volume_id>.img), and <storage>/controller.json (controller
attachments, created volumes, snapshots); node operations are real bind mounts, and
this node's staging paths are kept in <root>/staged/, so all survive a restart.
Plugins of several nodes share one --storage, each with its own --root.

STRICT LIKE A REAL PLUGIN (the CSI spec's error codes):
    A volume exists when CreateVolume made it or when <storage>/volumes/<id> (or
    <id>.img) exists: a test \"creates\" a volume in the storage system with mkdir.
    Calls naming any other volume answer NOT_FOUND (DeleteVolume and
    ControllerUnpublish answer OK: such a volume is deleted and not attached).
    A node exists when it is --node-id or listed in --known-nodes;
    ControllerPublish to any other answers NOT_FOUND. A single-node volume
    attached to one node is refused to another (FAILED_PRECONDITION naming it).
    CreateVolume of an existing name with a capacity_range or parameters that
    volume does not satisfy answers ALREADY_EXISTS. A volume is staged at one
    staging_target_path only: NodeStage at another while it is staged answers
    FAILED_PRECONDITION naming the first. NodePublish needs staging_target_path
    (with STAGE_UNSTAGE_VOLUME) and the volume staged there (FAILED_PRECONDITION);
    NodeUnpublish and NodeUnstage of a path where another volume is mounted answer
    FAILED_PRECONDITION. A missing required field (IDs, paths, capabilities with
    access type and access mode) answers INVALID_ARGUMENT. A volume_path (or
    NodeExpandVolume's staging_target_path) that is not absolute, or where the
    volume is not mounted, answers NOT_FOUND (\"volume does not exist on
    specified volume_path\").
    ValidateVolumeCapabilities confirms every capability of an existing volume.

USAGE:
    claimd-test-plugin --endpoint PATH --root DIR [OPTIONS]

OPTIONS:
    --endpoint PATH             unix socket to serve (required); a stale socket
                                file there is removed at start
    --root DIR                  the plugin's node-local state (required; created), and
                                the storage system too unless --storage is given
    --storage DIR               the storage system shared by every node's plugin:
                                volumes, snapshots, controller.json, fencing state
                                [default: --root]
    --node-id ID                node ID reported by NodeGetInfo [default: test-node]
    --known-nodes FILE          other node IDs ControllerPublishVolume accepts, one a
                                line (blank lines and lines starting with # are
                                ignored); re-read on every call (missing = none)
    --name NAME                 plugin name reported by GetPluginInfo
                                [default: claimd.test.plugin]
    --no-stage                  do not advertise STAGE_UNSTAGE_VOLUME; NodeStage and
                                NodeUnstage answer UNIMPLEMENTED
    --no-controller             do not advertise CONTROLLER_SERVICE; controller RPCs
                                answer UNIMPLEMENTED
    --unknown-capability        also advertise capability type 99 (which no CSI
                                version defines) in each capability list, to test
                                that agents ignore it
    --call-log PATH             append one JSON line per call when it ends (never
                                secret values); fields: see CALL LOG below
    --log-starts                also append a line when each call starts, before its
                                fault rule and its work (\"event\": \"start\"), so a call
                                that never answers shows as started and not ended
    --faults PATH               fault file, re-read on every call (missing = none)
    --max-volumes-per-node N    reported by NodeGetInfo and enforced by
                                ControllerPublishVolume (RESOURCE_EXHAUSTED) [default: 0,
                                no limit]
    --volume-stats              advertise GET_VOLUME_STATS and VOLUME_CONDITION:
                                NodeGetVolumeStats answers statvfs of the volume
                                path; a file <storage>/abnormal/<volume_id> makes the
                                volume abnormal, its content the message (without
                                the flag: UNIMPLEMENTED)
    --epoch-key KEY             enforce the CO's fencing token: an epoch under KEY in
                                ControllerPublish's volume_context or NodeStage's and
                                NodePublish's publish_context must be at least the
                                newest the storage saw for the volume
                                (<storage>/epochs/<volume_id>), else
                                FAILED_PRECONDITION; KEY is taken out before the
                                --require-contexts checks
    --require-contexts          NodeStage and NodePublish refuse (INVALID_ARGUMENT) a
                                publish_context other than ControllerPublish's, or a
                                volume_context other than CreateVolume's
    --create-target-parent      NodePublish creates the target's parent directory
                                itself (as some plugins do) instead of refusing
                                (FAILED_PRECONDITION) when the CO did not
    --topology KEY=VALUE[,KEY=VALUE]...
                                this node's topology segments (NodeGetInfo) and
                                VOLUME_ACCESSIBILITY_CONSTRAINTS: CreateVolume places
                                a volume in its requisite segment sets (else the first
                                preferred one, else this node's); without the flag
                                NodeGetInfo reports no topology and CreateVolume
                                refuses accessibility_requirements (INVALID_ARGUMENT),
                                as the spec ties both to that capability
    --snapshots                 advertise CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and
                                CLONE_VOLUME: a snapshot is a copy of the volume
                                directory in <storage>/snapshots/<snapshot_id> (ID
                                snap-<name>); a volume created from a snapshot or a
                                volume starts with a copy of its content
    --expansion                 advertise EXPAND_VOLUME (controller and node) and
                                online VolumeExpansion: ControllerExpandVolume records
                                the new capacity and asks for node expansion;
                                NodeExpandVolume (on a path where the volume is
                                mounted) makes it the capacity NodeGetVolumeStats
                                reports
    --mount-group               advertise VOLUME_MOUNT_GROUP: NodeStage and
                                NodePublish with volume_mount_group GID give the
                                volume directory that group (setgid, group rwx);
                                without the flag a volume_mount_group is refused
                                (INVALID_ARGUMENT)
    --fence-on-unpublish        fencing, for every plugin sharing a --storage: as a
                                node, record under <storage>/fencing/ each staging and
                                target path set up, and refuse NodeStage and NodePublish
                                of a volume fenced from this node (FAILED_PRECONDITION);
                                as a controller, ControllerUnpublishVolume(volume, node)
                                writes a durable fence marker, then unmounts every
                                target and staging path that node recorded for the
                                volume (umount2; a busy mount with MNT_DETACH) before it
                                answers OK; ControllerPublishVolume of the volume to the
                                node lifts the fence
    -h, --help                  print this help

FAULT FILE (JSON):
    {\"rules\": [{\"method\": \"NodeUnpublishVolume\", \"volume_id\": \"v1\",
                \"action\": \"fail\", \"code\": \"UNAVAILABLE\", \"message\": \"m\",
                \"count\": 3}]}
    method     RPC name as on the wire, e.g. NodeStageVolume (required)
    volume_id  only calls for this volume (optional; CreateVolume: its name)
    action     fail (answer `code` without doing the work) | delay (sleep `ms`, then
               work) | late (wait until the caller's deadline has passed, sleep `ms`
               more (default 0), then do the work: the caller sees DEADLINE_EXCEEDED
               and the effect happens anyway; its call-log line says \"late\": true;
               volume calls only) | hang (never answer) | exit (log code EXIT,
               exit(17) without answering) | not_ready (Probe only: ready=false) |
               empty (answer a default response) | garbage (answer bytes that do
               not decode)
    count      applies to this many more calls; decremented in the file, which is
               rewritten atomically; the rule is dropped at 0 (absent = forever)
    The first matching rule applies.

CALL LOG (JSON lines, one write(2) each, O_APPEND):
    event             \"end\" (written before the reply is sent; always) or \"start\"
                      (with --log-starts)
    call_id           \"<pid>-<n>\": the same on a call's start and end lines
    pid               the plugin process
    start_boottime_ns CLOCK_BOOTTIME (ns) when the call reached the plugin: one
                      clock for every process of the machine
    end_boottime_ns   CLOCK_BOOTTIME (ns) when it ended (end lines only)
    ts_ms             wall clock (ms since the epoch) when the line was written
    method, code      the RPC; \"OK\", a gRPC code name or \"EXIT\" (end lines only)
    late              true when a late fault held the call past its deadline
    fsyncs            fsync(2) calls of the process so far (its controller state,
                      fences), on end lines
    volume_id, node_id, staging_target_path, target_path, readonly, access_mode,
    publish_context, volume_context, secret_keys (names only), mount_group,
    required_bytes, snapshot, topology: what the request had
";

#[derive(Clone, Debug)]
pub struct Config {
    pub endpoint: PathBuf,
    pub root: PathBuf,
    pub node_id: String,
    pub name: String,
    pub stage: bool,
    pub controller: bool,
    pub call_log: Option<PathBuf>,
    /// `--log-starts`: a call-log line when each call starts too.
    pub log_starts: bool,
    /// `--storage`: the storage system shared by every node's plugin
    /// (`root` when not given).
    pub storage: PathBuf,
    /// `--fence-on-unpublish`: see `fencing.rs`.
    pub fence_on_unpublish: bool,
    /// `--epoch-key`: see `epochs.rs`.
    pub epoch_key: Option<String>,
    pub faults: Option<PathBuf>,
    pub max_volumes_per_node: i64,
    pub require_contexts: bool,
    pub create_target_parent: bool,
    pub known_nodes: Option<PathBuf>,
    pub unknown_capability: bool,
    pub volume_stats: bool,
    /// This node's topology segments (`--topology`); None: the default
    /// `{claimd.test/node: NODE_ID}` without VOLUME_ACCESSIBILITY_CONSTRAINTS.
    pub topology: Option<std::collections::BTreeMap<String, String>>,
    pub snapshots: bool,
    pub expansion: bool,
    pub mount_group: bool,
}

pub enum Parsed {
    Run(Box<Config>),
    Help,
}

#[derive(Debug)]
pub struct UsageError(String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn usage_error(msg: impl Into<String>) -> UsageError {
    UsageError(msg.into())
}

impl Config {
    /// Parses the arguments after the program name. Accepts `--flag VALUE`
    /// and `--flag=VALUE`.
    pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, UsageError> {
        let mut endpoint = None;
        let mut root = None;
        let mut storage = None;
        let mut config = Config {
            endpoint: PathBuf::new(),
            root: PathBuf::new(),
            node_id: "test-node".to_string(),
            name: "claimd.test.plugin".to_string(),
            stage: true,
            controller: true,
            call_log: None,
            log_starts: false,
            storage: PathBuf::new(),
            fence_on_unpublish: false,
            epoch_key: None,
            faults: None,
            max_volumes_per_node: 0,
            require_contexts: false,
            create_target_parent: false,
            known_nodes: None,
            unknown_capability: false,
            volume_stats: false,
            topology: None,
            snapshots: false,
            expansion: false,
            mount_group: false,
        };
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let arg = arg
                .into_string()
                .map_err(|a| usage_error(format!("argument {a:?} is not valid UTF-8")))?;
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            let mut value = |what: &str| -> Result<String, UsageError> {
                match inline.clone() {
                    Some(v) => Ok(v),
                    None => args
                        .next()
                        .ok_or_else(|| usage_error(format!("{flag} needs a value ({what})")))?
                        .into_string()
                        .map_err(|v| usage_error(format!("value {v:?} of {flag} is not UTF-8"))),
                }
            };
            match flag.as_str() {
                "-h" | "--help" => return Ok(Parsed::Help),
                "--endpoint" => endpoint = Some(PathBuf::from(value("PATH")?)),
                "--root" => root = Some(PathBuf::from(value("DIR")?)),
                "--storage" => storage = Some(PathBuf::from(value("DIR")?)),
                "--node-id" => config.node_id = value("ID")?,
                "--name" => config.name = value("NAME")?,
                "--call-log" => config.call_log = Some(PathBuf::from(value("PATH")?)),
                "--faults" => config.faults = Some(PathBuf::from(value("PATH")?)),
                "--epoch-key" => {
                    let key = value("KEY")?;
                    if key.is_empty() {
                        return Err(usage_error("--epoch-key must not be empty"));
                    }
                    config.epoch_key = Some(key);
                }
                "--known-nodes" => config.known_nodes = Some(PathBuf::from(value("FILE")?)),
                "--max-volumes-per-node" => {
                    let v = value("N")?;
                    config.max_volumes_per_node =
                        v.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                            usage_error(format!(
                                "--max-volumes-per-node takes a number >= 0, not {v:?}"
                            ))
                        })?;
                }
                "--topology" => {
                    let v = value("KEY=VALUE[,KEY=VALUE]...")?;
                    let mut segments = std::collections::BTreeMap::new();
                    for pair in v.split(',') {
                        match pair.split_once('=') {
                            Some((k, x)) if !k.is_empty() => {
                                segments.insert(k.to_string(), x.to_string());
                            }
                            _ => {
                                return Err(usage_error(format!(
                                    "--topology takes KEY=VALUE pairs, not {pair:?}"
                                )))
                            }
                        }
                    }
                    config.topology = Some(segments);
                }
                "--no-stage"
                | "--snapshots"
                | "--expansion"
                | "--mount-group"
                | "--no-controller"
                | "--require-contexts"
                | "--create-target-parent"
                | "--volume-stats"
                | "--log-starts"
                | "--fence-on-unpublish"
                | "--unknown-capability" => {
                    if inline.is_some() {
                        return Err(usage_error(format!("{flag} takes no value")));
                    }
                    match flag.as_str() {
                        "--no-stage" => config.stage = false,
                        "--no-controller" => config.controller = false,
                        "--unknown-capability" => config.unknown_capability = true,
                        "--create-target-parent" => config.create_target_parent = true,
                        "--volume-stats" => config.volume_stats = true,
                        "--snapshots" => config.snapshots = true,
                        "--expansion" => config.expansion = true,
                        "--mount-group" => config.mount_group = true,
                        "--log-starts" => config.log_starts = true,
                        "--fence-on-unpublish" => config.fence_on_unpublish = true,
                        _ => config.require_contexts = true,
                    }
                }
                _ => return Err(usage_error(format!("unknown argument {arg:?}"))),
            }
        }
        config.endpoint = endpoint.ok_or_else(|| usage_error("--endpoint is required"))?;
        config.root = root.ok_or_else(|| usage_error("--root is required"))?;
        config.storage = storage.unwrap_or_else(|| config.root.clone());
        if config.node_id.is_empty() {
            return Err(usage_error("--node-id must not be empty"));
        }
        if config.name.is_empty() {
            return Err(usage_error("--name must not be empty"));
        }
        if config.endpoint.as_os_str().is_empty()
            || config.root.as_os_str().is_empty()
            || config.storage.as_os_str().is_empty()
        {
            return Err(usage_error(
                "--endpoint, --root and --storage must not be empty",
            ));
        }
        Ok(Parsed::Run(Box::new(config)))
    }
}
