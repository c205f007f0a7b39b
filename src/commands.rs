//! The CLI's client commands: they talk to a running agent over its API
//! socket and print a table, or JSON with `--json`.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use grpcio::{CallOption, RpcStatusCode};
use serde_json::{json, Value};

use crate::api::{wire as w, ApiClient};
use crate::cli::{EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE};
use crate::config::{parse_duration, DEFAULT_API_SOCKET};
use crate::volumes::VolumeSpec;

/// Deadline of quick API calls (lists, status, register).
pub const QUICK_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Default deadline of `alloc mount` (a held claim may take long).
pub const DEFAULT_MOUNT_TIMEOUT: Duration = Duration::from_secs(3600);
/// How often `alloc mount` looks at what the mount is waiting on.
const PROGRESS_POLL: Duration = Duration::from_secs(1);

pub fn client_help() -> &'static str {
    "CLIENT COMMANDS (talk to a running agent):
    claimd volume register FILE|-         Register volume(s) from JSON (an
                                          object or an array of objects)
    claimd volume list
    claimd volume deregister ID
    claimd alloc mount ALLOC --volume ALIAS=VOLUME[,ro][,access=MODE]
                          [,attachment=file-system|block-device]
                          [,flag=MOUNT_FLAG]... [--volume ...]
                          [--timeout DURATION]   (default 1h)
    claimd alloc release ALLOC [--wait DURATION]
    claimd alloc status [ALLOC]
    claimd plugin list
Access modes: single-node-writer, single-node-reader-only,
    multi-node-reader-only, multi-node-single-writer, multi-node-multi-writer,
    single-node-single-writer, single-node-multi-writer. Durations: 500ms,
    30s, 5m, 2h, 1d.
Client options (before or after the command):
    --socket PATH   API socket [default: $CLAIMD_SOCKET or /run/claimd/claimd.sock]
    --json          JSON output for scripts
"
}

struct Common {
    socket: PathBuf,
    json: bool,
    rest: Vec<String>,
}

fn usage(msg: impl std::fmt::Display) -> u8 {
    eprintln!("claimd: {msg}; see `claimd --help`");
    EXIT_USAGE
}

/// `-h`/`--help` anywhere in a client command prints the client help.
fn wants_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "-h" || a == "--help")
}

fn parse_common(args: &[String]) -> Result<Common, String> {
    let mut socket = std::env::var_os("CLAIMD_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET));
    let mut json = false;
    let mut rest = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--json" {
            json = true;
        } else if a == "--socket" {
            i += 1;
            socket = PathBuf::from(args.get(i).ok_or("--socket needs a path")?);
        } else if let Some(p) = a.strip_prefix("--socket=") {
            socket = PathBuf::from(p);
        } else {
            rest.push(a.clone());
        }
        i += 1;
    }
    Ok(Common { socket, json, rest })
}

/// Connects, or explains that the agent is not there (exit code 3).
fn connect(socket: &Path) -> Result<ApiClient, u8> {
    if let Err(e) = UnixStream::connect(socket) {
        eprintln!("claimd: agent not running at {} ({e})", socket.display());
        return Err(EXIT_UNREACHABLE);
    }
    let env = crate::csi::grpc_environment("cli-grpc");
    Ok(ApiClient::new(env, socket))
}

fn opt(timeout: Duration) -> CallOption {
    CallOption::default().timeout(timeout)
}

/// Prints an API failure and picks the exit code.
fn failed(socket: &Path, e: grpcio::Error) -> u8 {
    match e {
        grpcio::Error::RpcFailure(s) => {
            if s.code() == RpcStatusCode::UNAVAILABLE && s.message().contains("connect") {
                eprintln!("claimd: agent not running at {}", socket.display());
                return EXIT_UNREACHABLE;
            }
            if s.code() == RpcStatusCode::DEADLINE_EXCEEDED {
                eprintln!("claimd: the agent did not answer in time (the operation goes on in the agent; check `claimd alloc status`)");
            } else if s.code() == RpcStatusCode::INVALID_ARGUMENT {
                eprintln!("claimd: {}", s.message());
                return EXIT_USAGE;
            } else {
                eprintln!("claimd: {}", s.message());
            }
            EXIT_FAILED
        }
        other => {
            eprintln!("claimd: {other}");
            EXIT_FAILED
        }
    }
}

/// A subcommand: its name and what runs it.
type Subcommand<'a> = (&'a str, fn(&Common) -> u8);

/// Runs `noun`'s subcommand from `table`, after the shared options.
fn dispatch(args: &[String], noun: &str, table: &[Subcommand<'_>]) -> u8 {
    if wants_help(args) {
        print!("{}", client_help());
        return EXIT_OK;
    }
    let c = match parse_common(args) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
    let Some(sub) = c.rest.first() else {
        return usage(format!("{noun} needs one of: {}", names.join(", ")));
    };
    match table.iter().find(|(n, _)| n == sub) {
        Some((_, run)) => run(&c),
        None => usage(format!("unknown {noun} command {sub:?}")),
    }
}

pub fn volume(args: &[String]) -> u8 {
    dispatch(
        args,
        "volume",
        &[
            ("register", volume_register),
            ("list", volume_list),
            ("deregister", volume_deregister),
        ],
    )
}

fn volume_register(c: &Common) -> u8 {
    let Some(src) = c.rest.get(1) else {
        return usage("volume register needs FILE or -");
    };
    if c.rest.len() > 2 {
        return usage(format!("unexpected argument {:?}", c.rest[2]));
    }
    let text = if src == "-" {
        let mut s = String::new();
        if let Err(e) = std::io::stdin().read_to_string(&mut s) {
            eprintln!("claimd: cannot read standard input: {e}");
            return EXIT_FAILED;
        }
        s
    } else {
        match std::fs::read_to_string(src) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("claimd: cannot read {src}: {e}");
                return EXIT_FAILED;
            }
        }
    };
    let parsed: Result<Vec<VolumeSpec>, _> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(items)) => items.into_iter().map(serde_json::from_value).collect(),
        Ok(v) => serde_json::from_value(v).map(|s| vec![s]),
        Err(e) => Err(e),
    };
    let specs = match parsed {
        Ok(s) => s,
        Err(e) => {
            eprintln!("claimd: {src} is not a valid volume definition: {e}");
            return EXIT_USAGE;
        }
    };
    for s in &specs {
        if let Err(e) = s.validate() {
            eprintln!("claimd: {e}");
            return EXIT_USAGE;
        }
    }
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    for s in &specs {
        let mut req = w::RegisterVolumeRequest::new();
        req.volume = protobuf::MessageField::some(spec_to_register_wire(s));
        if let Err(e) = client.raw().register_volume(&req, opt(QUICK_CALL_TIMEOUT)) {
            return failed(&c.socket, e);
        }
        if !c.json {
            println!("volume {} registered", s.id);
        }
    }
    if c.json {
        let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
        println!("{}", json!({ "registered": ids }));
    }
    EXIT_OK
}

/// The wire form for registration: the only message that carries secrets.
fn spec_to_register_wire(s: &VolumeSpec) -> w::Volume {
    let mut v = crate::api::volume_to_wire(s);
    v.secret_keys.clear();
    v.secrets = s.secrets.clone().into_iter().collect();
    v
}

fn volume_list(c: &Common) -> u8 {
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let r = match client
        .raw()
        .list_volumes(&w::ListVolumesRequest::new(), opt(QUICK_CALL_TIMEOUT))
    {
        Ok(r) => r,
        Err(e) => return failed(&c.socket, e),
    };
    if c.json {
        let vols: Vec<Value> = r
            .volumes
            .iter()
            .map(|v| {
                let ctx: serde_json::Map<String, Value> = v
                    .context
                    .iter()
                    .map(|(k, x)| (k.clone(), Value::String(x.clone())))
                    .collect();
                let mut keys = v.secret_keys.clone();
                keys.sort();
                json!({
                    "id": v.id, "plugin_id": v.plugin_id, "external_id": v.external_id,
                    "access_modes": v.access_modes, "attachment_modes": v.attachment_modes,
                    "fs_type": v.fs_type, "mount_flags": v.mount_flags,
                    "context": ctx, "secret_keys": keys,
                })
            })
            .collect();
        println!("{}", json!({ "volumes": vols }));
        return EXIT_OK;
    }
    let mut rows = vec![vec![
        "ID".to_string(),
        "PLUGIN".into(),
        "EXTERNAL ID".into(),
        "ACCESS MODES".into(),
        "ATTACHMENT".into(),
    ]];
    let mut vols = r.volumes.clone();
    vols.sort_by(|a, b| a.id.cmp(&b.id));
    for v in &vols {
        rows.push(vec![
            v.id.clone(),
            v.plugin_id.clone(),
            v.external_id.clone(),
            v.access_modes.join(","),
            v.attachment_modes.join(","),
        ]);
    }
    print_table(&rows);
    EXIT_OK
}

fn volume_deregister(c: &Common) -> u8 {
    let Some(id) = c.rest.get(1) else {
        return usage("volume deregister needs a volume ID");
    };
    if c.rest.len() > 2 {
        return usage(format!("unexpected argument {:?}", c.rest[2]));
    }
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let mut req = w::DeregisterVolumeRequest::new();
    req.volume_id = id.clone();
    match client
        .raw()
        .deregister_volume(&req, opt(QUICK_CALL_TIMEOUT))
    {
        Ok(r) => {
            if c.json {
                println!("{}", json!({ "volume_id": id, "found": r.found }));
            } else if r.found {
                println!("volume {id} deregistered");
            } else {
                println!("volume {id} was not registered (nothing to do)");
            }
            EXIT_OK
        }
        Err(e) => failed(&c.socket, e),
    }
}

/// Parses `ALIAS=VOLUME[,ro][,access=MODE][,attachment=MODE][,flag=F]`.
pub fn parse_volume_arg(s: &str) -> Result<w::VolumeRequest, String> {
    let mut parts = s.split(',');
    let head = parts.next().unwrap_or_default();
    let (alias, volume) = head
        .split_once('=')
        .ok_or_else(|| format!("--volume {s:?}: expected ALIAS=VOLUME"))?;
    let mut r = w::VolumeRequest::new();
    r.alias = alias.to_string();
    r.volume_id = volume.to_string();
    for p in parts {
        match p.split_once('=') {
            None if p == "ro" => r.read_only = true,
            None if p == "rw" => r.read_only = false,
            Some(("access", m)) => {
                if crate::volumes::AccessMode::parse(m).is_none() {
                    return Err(format!("--volume {s:?}: unknown access mode {m:?}"));
                }
                r.access_mode = m.to_string();
            }
            Some(("attachment", m)) => {
                if crate::volumes::AttachmentMode::parse(m).is_none() {
                    return Err(format!("--volume {s:?}: unknown attachment mode {m:?}"));
                }
                r.attachment_mode = m.to_string();
            }
            Some(("flag", f)) => r.mount_flags.push(f.to_string()),
            _ => return Err(format!("--volume {s:?}: unknown option {p:?}")),
        }
    }
    Ok(r)
}

pub fn alloc(args: &[String]) -> u8 {
    dispatch(
        args,
        "alloc",
        &[
            ("mount", alloc_mount),
            ("release", alloc_release),
            ("status", alloc_status),
        ],
    )
}

fn alloc_mount(c: &Common) -> u8 {
    let mut alloc_id = None;
    let mut vols = Vec::new();
    let mut timeout = DEFAULT_MOUNT_TIMEOUT;
    let mut i = 1;
    while i < c.rest.len() {
        let a = &c.rest[i];
        let value = |i: &mut usize| -> Result<String, u8> {
            *i += 1;
            c.rest
                .get(*i)
                .cloned()
                .ok_or_else(|| usage(format!("{a} needs a value")))
        };
        if a == "--volume" || a == "-v" {
            match value(&mut i) {
                Ok(v) => match parse_volume_arg(&v) {
                    Ok(r) => vols.push(r),
                    Err(e) => return usage(e),
                },
                Err(code) => return code,
            }
        } else if let Some(v) = a.strip_prefix("--volume=") {
            match parse_volume_arg(v) {
                Ok(r) => vols.push(r),
                Err(e) => return usage(e),
            }
        } else if a == "--timeout" {
            match value(&mut i).map(|v| parse_duration(&v)) {
                Ok(Ok(d)) => timeout = d,
                Ok(Err(e)) => return usage(format!("--timeout: {e}")),
                Err(code) => return code,
            }
        } else if a.starts_with('-') {
            return usage(format!("unknown option {a:?}"));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return usage(format!("unexpected argument {a:?}"));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return usage("alloc mount needs an allocation ID");
    };
    if vols.is_empty() {
        return usage("alloc mount needs at least one --volume ALIAS=VOLUME");
    }
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let mut req = w::MountAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.volumes = vols;
    // Show what the mount waits on (a plugin, a held claim) while it runs.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    let progress = {
        let socket = c.socket.clone();
        let alloc_id = alloc_id.clone();
        std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || show_progress(&socket, &alloc_id, &done_rx))
            .ok()
    };
    let result = client.raw().mount_alloc(&req, opt(timeout));
    drop(done_tx);
    if let Some(p) = progress {
        let _ = p.join();
    }
    match result {
        Ok(r) => {
            if c.json {
                let vols: Vec<Value> = r
                    .volumes
                    .iter()
                    .map(|v| {
                        json!({"alias": v.alias, "volume_id": v.volume_id, "host_path": v.host_path,
                               "read_only": v.read_only, "block": v.block})
                    })
                    .collect();
                println!("{}", json!({ "alloc_id": alloc_id, "volumes": vols }));
            } else {
                let mut rows = vec![vec![
                    "ALIAS".to_string(),
                    "VOLUME".into(),
                    "MODE".into(),
                    "HOST PATH".into(),
                ]];
                for v in &r.volumes {
                    rows.push(vec![
                        v.alias.clone(),
                        v.volume_id.clone(),
                        if v.read_only { "ro" } else { "rw" }.to_string(),
                        v.host_path.clone(),
                    ]);
                }
                print_table(&rows);
            }
            EXIT_OK
        }
        Err(e) => failed(&c.socket, e),
    }
}

fn show_progress(socket: &Path, alloc_id: &str, done: &crossbeam_channel::Receiver<()>) {
    let client = ApiClient::new(crate::csi::grpc_environment("cli-progress"), socket);
    let mut last: Vec<String> = Vec::new();
    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) = done.recv_timeout(PROGRESS_POLL) {
        let mut req = w::GetAllocRequest::new();
        req.alloc_id = alloc_id.to_string();
        let Ok(r) = client.raw().get_alloc(&req, opt(QUICK_CALL_TIMEOUT)) else {
            continue;
        };
        let msgs: Vec<String> = r
            .alloc
            .volumes
            .iter()
            .filter(|v| !v.message.is_empty())
            .map(|v| v.message.clone())
            .collect();
        for m in &msgs {
            if !last.contains(m) {
                eprintln!("claimd: {m}");
            }
        }
        last = msgs;
    }
}

fn release_json(alloc_id: &str, r: &w::ReleaseAllocResponse) -> Value {
    let vols: Vec<Value> = r
        .volumes
        .iter()
        .map(|v| json!({"alias": v.alias, "state": v.state, "error": v.error, "attempts": v.attempts}))
        .collect();
    json!({"alloc_id": alloc_id, "found": r.found, "done": r.done, "volumes": vols})
}

fn alloc_release(c: &Common) -> u8 {
    let mut alloc_id = None;
    let mut wait = Duration::ZERO;
    let mut i = 1;
    while i < c.rest.len() {
        let a = &c.rest[i];
        if a == "--wait" {
            i += 1;
            match c.rest.get(i).map(|v| parse_duration(v)) {
                Some(Ok(d)) => wait = d,
                Some(Err(e)) => return usage(format!("--wait: {e}")),
                None => return usage("--wait needs a duration"),
            }
        } else if let Some(v) = a.strip_prefix("--wait=") {
            match parse_duration(v) {
                Ok(d) => wait = d,
                Err(e) => return usage(format!("--wait: {e}")),
            }
        } else if a.starts_with('-') {
            return usage(format!("unknown option {a:?}"));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return usage(format!("unexpected argument {a:?}"));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return usage("alloc release needs an allocation ID");
    };
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let mut req = w::ReleaseAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let r = match client
        .raw()
        .release_alloc(&req, opt(wait + QUICK_CALL_TIMEOUT))
    {
        Ok(r) => r,
        Err(e) => return failed(&c.socket, e),
    };
    let all_released = r.volumes.iter().all(|v| v.state == "released");
    if c.json {
        println!("{}", release_json(&alloc_id, &r));
    } else if !r.found {
        println!("allocation {alloc_id} is not known to the agent: nothing to release");
    } else {
        let mut rows = vec![vec![
            "ALIAS".to_string(),
            "STATE".into(),
            "LAST ERROR".into(),
        ]];
        for v in &r.volumes {
            rows.push(vec![v.alias.clone(), v.state.clone(), v.error.clone()]);
        }
        print_table(&rows);
        if !r.done && !wait.is_zero() {
            eprintln!(
                "claimd: the release is still running; check `claimd alloc status {alloc_id}`"
            );
        }
    }
    // With --wait, a release that did not finish is a failure for scripts.
    if !wait.is_zero() && r.found && !(r.done && all_released) {
        return EXIT_FAILED;
    }
    EXIT_OK
}

fn alloc_json(a: &w::AllocStatus) -> Value {
    let vols: Vec<Value> = a
        .volumes
        .iter()
        .map(|v| {
            json!({"alias": v.alias, "volume_id": v.volume_id, "plugin_id": v.plugin_id,
                   "phase": v.phase, "host_path": v.host_path, "read_only": v.read_only,
                   "attachment_mode": v.attachment_mode, "release_state": v.release_state,
                   "release_error": v.release_error, "message": v.message})
        })
        .collect();
    json!({"id": a.id, "releasing": a.releasing, "volumes": vols})
}

fn alloc_status(c: &Common) -> u8 {
    if c.rest.len() > 2 {
        return usage(format!("unexpected argument {:?}", c.rest[2]));
    }
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let allocs: Vec<w::AllocStatus> = match c.rest.get(1) {
        Some(id) => {
            let mut req = w::GetAllocRequest::new();
            req.alloc_id = id.clone();
            match client.raw().get_alloc(&req, opt(QUICK_CALL_TIMEOUT)) {
                Ok(r) => vec![r.alloc.unwrap_or_default()],
                Err(e) => return failed(&c.socket, e),
            }
        }
        None => match client
            .raw()
            .list_allocs(&w::ListAllocsRequest::new(), opt(QUICK_CALL_TIMEOUT))
        {
            Ok(r) => r.allocs,
            Err(e) => return failed(&c.socket, e),
        },
    };
    if c.json {
        let list: Vec<Value> = allocs.iter().map(alloc_json).collect();
        println!("{}", json!({ "allocs": list }));
        return EXIT_OK;
    }
    let mut rows = vec![vec![
        "ALLOC".to_string(),
        "ALIAS".into(),
        "VOLUME".into(),
        "PHASE".into(),
        "MODE".into(),
        "HOST PATH".into(),
        "RELEASE".into(),
        "NOTE".into(),
    ]];
    for a in &allocs {
        for v in &a.volumes {
            let note = if !v.release_error.is_empty() {
                v.release_error.clone()
            } else {
                v.message.clone()
            };
            rows.push(vec![
                a.id.clone(),
                v.alias.clone(),
                v.volume_id.clone(),
                if v.phase.is_empty() {
                    "-".into()
                } else {
                    v.phase.clone()
                },
                if v.read_only { "ro" } else { "rw" }.to_string(),
                v.host_path.clone(),
                if v.release_state.is_empty() {
                    "-".into()
                } else {
                    v.release_state.clone()
                },
                note,
            ]);
        }
    }
    print_table(&rows);
    EXIT_OK
}

pub fn plugin(args: &[String]) -> u8 {
    dispatch(args, "plugin", &[("list", plugin_list)])
}

fn plugin_list(c: &Common) -> u8 {
    if c.rest.len() > 1 {
        return usage(format!("unexpected argument {:?}", c.rest[1]));
    }
    let client = match connect(&c.socket) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let r = match client
        .raw()
        .list_plugins(&w::ListPluginsRequest::new(), opt(QUICK_CALL_TIMEOUT))
    {
        Ok(r) => r,
        Err(e) => return failed(&c.socket, e),
    };
    if c.json {
        let list: Vec<Value> = r
            .plugins
            .iter()
            .map(|p| {
                json!({"id": p.id, "type": p.type_, "socket": p.socket, "health": p.health,
                       "reason": p.reason, "name": p.name, "vendor_version": p.vendor_version,
                       "node_id": p.node_id, "max_volumes_per_node": p.max_volumes_per_node,
                       "capabilities": p.capabilities, "source": p.source,
                       "generation": p.generation})
            })
            .collect();
        println!("{}", json!({ "plugins": list }));
        return EXIT_OK;
    }
    let mut rows = vec![vec![
        "ID".to_string(),
        "TYPE".into(),
        "HEALTH".into(),
        "NODE ID".into(),
        "CAPABILITIES".into(),
        "REASON".into(),
    ]];
    for p in &r.plugins {
        rows.push(vec![
            p.id.clone(),
            p.type_.clone(),
            p.health.clone(),
            p.node_id.clone(),
            p.capabilities.join(","),
            p.reason.clone(),
        ]);
    }
    print_table(&rows);
    EXIT_OK
}

fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        println!("{}", line.trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_arg_parsing() {
        let r = parse_volume_arg("data=db,ro,access=multi-node-reader-only,flag=noatime")
            .expect("valid");
        assert_eq!(r.alias, "data");
        assert_eq!(r.volume_id, "db");
        assert!(r.read_only);
        assert_eq!(r.access_mode, "multi-node-reader-only");
        assert_eq!(r.mount_flags, vec!["noatime".to_string()]);
        assert!(parse_volume_arg("db").is_err());
        assert!(parse_volume_arg("a=db,access=sometimes").is_err());
        assert!(parse_volume_arg("a=db,attachment=tape").is_err());
        assert!(parse_volume_arg("a=db,bogus").is_err());
    }
}
