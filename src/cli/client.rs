//! The client commands, `volume`, `alloc` and `plugin`: each verb talks to a
//! running agent over its API socket and prints a table, or JSON with
//! `--json`. Every noun and verb is a row of a table here, so dispatch,
//! `--help` and the error for an unknown verb come from the same place.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use grpcio::{CallOption, RpcStatusCode};
use serde_json::{json, Value};

use super::error::{AgentStatus, CliError};
use crate::api::grpc::ClaimdClient;
use crate::api::{wire as w, ApiClient};
use crate::config::{parse_duration, DEFAULT_API_SOCKET};
use crate::volumes::VolumeSpec;

/// Deadline of quick API calls (lists, status, register).
pub const QUICK_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Default deadline of `alloc mount` (a held claim may take long).
pub const DEFAULT_MOUNT_TIMEOUT: Duration = Duration::from_secs(3600);
/// How often `alloc mount` looks at what the mount is waiting on.
const PROGRESS_POLL: Duration = Duration::from_secs(1);
/// Slack for the clock when telling our own deadline from the agent's
/// DEADLINE_EXCEEDED answer.
const DEADLINE_SLACK: Duration = Duration::from_millis(50);

/// A noun of the command line and its verbs.
pub struct Noun {
    pub name: &'static str,
    /// One line, for `claimd --help` and the noun's help.
    pub about: &'static str,
    pub verbs: &'static [Verb],
}

/// A verb of a noun: what `--help` says about it and what runs it.
pub struct Verb {
    pub name: &'static str,
    /// The arguments after the verb, as USAGE shows them.
    pub args: &'static str,
    /// One line, for the noun's help.
    pub about: &'static str,
    /// The verb's `--help` after USAGE: what it does, its own options.
    pub details: &'static str,
    run: fn(&Call) -> Result<(), CliError>,
}

pub const VOLUME: Noun = Noun {
    name: "volume",
    about: "register, list and deregister volumes",
    verbs: &[
        Verb {
            name: "register",
            args: "FILE|-",
            about: "register volumes from a JSON file (- for standard input)",
            details: "\
Reads volume definitions from FILE, or from standard input with `-`: one
JSON object or an array of them. Every definition is checked before the
agent is asked; then they are registered in order. Registering a volume ID
again replaces its definition, unless an allocation holds a claim on it and
the definition changed (exit 1).

A volume definition (unknown fields are refused):
    {\"id\": \"db\", \"plugin_id\": \"hostpath\", \"external_id\": \"vol-0a1b\",
     \"access_modes\": [\"single-node-writer\"],
     \"attachment_modes\": [\"file-system\"],
     \"mount_options\": {\"fs_type\": \"ext4\", \"mount_flags\": [\"noatime\"]},
     \"context\": {}, \"secrets\": {\"token\": \"...\"}}
id, plugin_id, external_id, access_modes and attachment_modes are required;
mount_options, context and secrets are optional. Secrets are kept only in
the agent's state file and sent to the plugin; they are never printed.

OUTPUT:
    one line per volume registered; with --json
    {\"registered\": [IDS]}
",
            run: volume_register,
        },
        Verb {
            name: "list",
            args: "",
            about: "list the registered volumes",
            details: "\
Lists the registered volumes: ID, plugin, external ID, access modes and
attachment modes. With --json also fs_type, mount_flags, context and the
names of the secrets (never their values).
",
            run: volume_list,
        },
        Verb {
            name: "deregister",
            args: "ID",
            about: "remove a volume no allocation uses",
            details: "\
Removes volume ID from the agent's registry. Refused (exit 1) while an
allocation uses the volume. A volume that is not registered is not an
error: it says so and exits 0 (--json: {\"volume_id\", \"found\"}).
",
            run: volume_deregister,
        },
    ],
};

pub const ALLOC: Noun = Noun {
    name: "alloc",
    about: "mount, release and show the volumes of allocations",
    verbs: &[
        Verb {
            name: "mount",
            args: "ALLOC --volume ALIAS=VOLUME[,OPTION]... [--volume ...] [--timeout DURATION]",
            about: "claim and mount volumes for an allocation",
            details: "\
Claims, stages and publishes registered volumes for allocation ALLOC and
prints where each one is mounted on the host. It waits until they are
mounted, also for a plugin that is not ready yet or a claim held by another
allocation; what it waits on is shown on standard error. Mounting the same
allocation again with the same volumes answers with the same paths.

OPTIONS:
    -v, --volume ALIAS=VOLUME[,OPTION]...
                  Mount registered volume VOLUME as ALIAS (at least one;
                  repeat for more). Also --volume=SPEC. OPTIONs:
                    ro, rw         read-only or read-write [default: rw]
                    access=MODE    the access mode to claim with [default:
                                   the volume's first mode that fits ro/rw]
                    attachment=file-system|block-device
                                   [default: the volume's first mode]
                    flag=MOUNT_FLAG  an extra mount flag (repeatable)
                  Access modes: single-node-writer, single-node-reader-only,
                  multi-node-reader-only, multi-node-single-writer,
                  multi-node-multi-writer, single-node-single-writer,
                  single-node-multi-writer.
    --timeout DURATION
                  How long to wait for the agent's answer [default: 1h];
                  also --timeout=DURATION. When it passes the command exits 1
                  and the mount goes on in the agent.
Durations are written like 500ms, 30s, 5m, 2h, 1d.

OUTPUT:
    ALIAS, VOLUME, MODE (ro/rw) and HOST PATH per volume; with --json
    {\"alloc_id\", \"volumes\": [{\"alias\", \"volume_id\", \"host_path\",
    \"read_only\", \"block\"}]}
",
            run: alloc_mount,
        },
        Verb {
            name: "release",
            args: "ALLOC [--wait DURATION]",
            about: "unmount and free the volumes of an allocation",
            details: "\
Asks the agent to release allocation ALLOC's volumes: unpublish, unstage,
detach and free the claims. The release goes on in the agent, retried
after failures, whether or not the command waits for it. An allocation the
agent does not know is not an error: it says so and exits 0.

OPTIONS:
    --wait DURATION  Wait up to DURATION (at most 1h) for the release to
                     finish; also --wait=DURATION. Exits 1 if it has not
                     finished with every volume released by then.
                     [default: 0, return at once]
Durations are written like 500ms, 30s, 5m, 2h, 1d.

OUTPUT:
    ALIAS, STATE and LAST ERROR per volume; with --json {\"alloc_id\",
    \"found\", \"done\", \"volumes\": [{\"alias\", \"state\", \"error\",
    \"attempts\"}]}
",
            run: alloc_release,
        },
        Verb {
            name: "status",
            args: "[ALLOC]",
            about: "show the volumes of one or every allocation",
            details: "\
Shows each volume of allocation ALLOC, or of every allocation the agent
knows: alias, volume, phase, mode (ro/rw), host path, release state, and
the last release error or what the volume waits on. An ALLOC the agent does
not know is an error (exit 1). --json adds plugin_id and attachment_mode.
",
            run: alloc_status,
        },
    ],
};

pub const PLUGIN: Noun = Noun {
    name: "plugin",
    about: "show the CSI plugins the agent knows",
    verbs: &[Verb {
        name: "list",
        args: "",
        about: "list the plugins and their health",
        details: "\
Lists the CSI plugins the agent knows (from its config and its plugin
directory): ID, type, health, node ID, capabilities, and why a plugin is
not ready. --json adds socket, name, vendor_version, max_volumes_per_node,
source and generation.
",
        run: plugin_list,
    }],
};

/// Every client noun, in help order.
pub const NOUNS: [&Noun; 3] = [&VOLUME, &ALLOC, &PLUGIN];

/// The client noun called `name`.
pub fn noun(name: &str) -> Option<&'static Noun> {
    NOUNS.into_iter().find(|n| n.name == name)
}

fn client_options() -> String {
    format!(
        "CLIENT OPTIONS (before or after the command):
    --socket PATH   API socket [default: $CLAIMD_SOCKET or {DEFAULT_API_SOCKET}];
                    also --socket=PATH
    --json          JSON output for scripts
    -h, --help      print this help
"
    )
}

/// The client part of `claimd --help`: every noun's verbs.
pub fn summary() -> String {
    let mut s = String::from("CLIENT COMMANDS (talk to a running agent):\n");
    for n in NOUNS {
        for v in n.verbs {
            let line = format!("claimd {} {} {}", n.name, v.name, v.args);
            s.push_str(&format!("    {}\n", line.trim_end()));
        }
    }
    s.push_str("Run `claimd NOUN --help` or `claimd NOUN VERB --help` for more.\n\n");
    s.push_str(&client_options());
    s
}

impl Noun {
    fn verb(&self, name: &str) -> Option<&Verb> {
        self.verbs.iter().find(|v| v.name == name)
    }

    fn verb_names(&self) -> String {
        let names: Vec<&str> = self.verbs.iter().map(|v| v.name).collect();
        names.join(", ")
    }

    /// `claimd NOUN --help`.
    pub fn help(&self) -> String {
        let mut s = format!(
            "claimd {name}: {about}.

USAGE:
    claimd {name} VERB [ARGS] [--socket PATH] [--json]

VERBS:
",
            name = self.name,
            about = self.about
        );
        let width = self.verbs.iter().map(|v| v.name.len()).max().unwrap_or(0);
        for v in self.verbs {
            s.push_str(&format!("    {:width$}  {}\n", v.name, v.about));
        }
        s.push_str(&format!(
            "\nRun `claimd {} VERB --help` for a verb's arguments and options.\n\n",
            self.name
        ));
        s.push_str(&client_options());
        s
    }

    /// `claimd NOUN VERB --help`.
    pub fn verb_help(&self, v: &Verb) -> String {
        let usage = format!("claimd {} {} {}", self.name, v.name, v.args);
        format!(
            "claimd {noun} {verb}: {about}.

USAGE:
    {usage} [--socket PATH] [--json]

{details}
{options}",
            noun = self.name,
            verb = v.name,
            about = v.about,
            usage = usage.trim_end(),
            details = v.details,
            options = client_options(),
        )
    }

    /// Runs `claimd NOUN ARGS...`: a verb, or the noun's or a verb's help.
    pub fn run(&self, args: &[String]) -> Result<(), CliError> {
        let help_of_noun = format!("claimd {}", self.name);
        let (client, rest) =
            parse_common(args).map_err(|e| CliError::usage(e, help_of_noun.clone()))?;
        let is_help = |a: &String| a == "-h" || a == "--help";
        let wants_help = rest.iter().any(is_help);
        let Some(name) = rest.iter().find(|a| !is_help(a)) else {
            if wants_help {
                print!("{}", self.help());
                return Ok(());
            }
            return Err(CliError::usage(
                format!("{} needs a verb: {}", self.name, self.verb_names()),
                help_of_noun,
            ));
        };
        let Some(verb) = self.verb(name) else {
            return Err(CliError::usage(
                format!(
                    "unknown {} verb {name:?} (the verbs are {})",
                    self.name,
                    self.verb_names()
                ),
                help_of_noun,
            ));
        };
        if wants_help {
            print!("{}", self.verb_help(verb));
            return Ok(());
        }
        let call = Call {
            client,
            args: rest[1..].to_vec(),
            help: format!("claimd {} {}", self.name, verb.name),
        };
        (verb.run)(&call)
    }
}

/// Where the agent is and how to print.
struct Client {
    socket: PathBuf,
    json: bool,
}

/// One run of a verb: the client options, the verb's own arguments, and
/// the command whose `--help` explains them.
struct Call {
    client: Client,
    args: Vec<String>,
    help: String,
}

impl Call {
    fn usage(&self, message: impl Into<String>) -> CliError {
        CliError::usage(message, self.help.clone())
    }

    fn json(&self) -> bool {
        self.client.json
    }

    /// Connects, or explains that the agent is not there.
    fn connect(&self) -> Result<Api, CliError> {
        let socket = &self.client.socket;
        UnixStream::connect(socket).map_err(|e| CliError::Unreachable {
            socket: socket.clone(),
            source: Box::new(e),
        })?;
        let env = crate::csi::grpc_environment("cli-grpc");
        Ok(Api {
            client: ApiClient::new(env, socket),
            socket: socket.clone(),
        })
    }

    /// The verb's positional arguments (none may look like an option), at
    /// most `max` of them.
    fn positional(&self, max: usize) -> Result<Vec<&String>, CliError> {
        let mut out = Vec::new();
        for a in &self.args {
            if a.starts_with('-') && a != "-" {
                return Err(self.usage(format!("unknown option {a:?}")));
            }
            if out.len() == max {
                return Err(self.usage(format!("unexpected argument {a:?}")));
            }
            out.push(a);
        }
        Ok(out)
    }
}

/// Splits off the client options (`--socket PATH`, `--json`) wherever they
/// are.
fn parse_common(args: &[String]) -> Result<(Client, Vec<String>), String> {
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
    Ok((Client { socket, json }, rest))
}

/// A connected API client.
struct Api {
    client: ApiClient,
    socket: PathBuf,
}

impl Api {
    /// One API call with a deadline; a failure becomes the error its
    /// status code (not its text) says it is.
    fn call<T>(
        &self,
        request: &'static str,
        deadline: Duration,
        f: impl FnOnce(&ClaimdClient, CallOption) -> grpcio::Result<T>,
    ) -> Result<T, CliError> {
        let started = Instant::now();
        f(self.client.raw(), CallOption::default().timeout(deadline))
            .map_err(|e| call_error(&self.socket, request, deadline, started.elapsed(), e))
    }
}

/// Classifies a failed call. UNAVAILABLE is what gRPC reports when the
/// connection fails, and also what the agent answers while a plugin is not
/// ready or it is stopping: a fresh connection to the socket tells them
/// apart (refused: the agent is gone). DEADLINE_EXCEEDED is our own
/// deadline when it has passed, else the agent's answer.
fn call_error(
    socket: &Path,
    request: &'static str,
    deadline: Duration,
    elapsed: Duration,
    e: grpcio::Error,
) -> CliError {
    let status = match e {
        grpcio::Error::RpcFailure(s) => AgentStatus(s),
        grpcio::Error::RemoteStopped => {
            return CliError::Unreachable {
                socket: socket.to_path_buf(),
                source: Box::new(e),
            }
        }
        other => {
            return CliError::Call {
                request,
                source: other,
            }
        }
    };
    match status.code() {
        RpcStatusCode::INVALID_ARGUMENT => CliError::Refused {
            request,
            source: status,
        },
        RpcStatusCode::DEADLINE_EXCEEDED if elapsed + DEADLINE_SLACK >= deadline => {
            CliError::NoAnswer { request, deadline }
        }
        RpcStatusCode::UNAVAILABLE => match UnixStream::connect(socket) {
            Err(gone) => CliError::Unreachable {
                socket: socket.to_path_buf(),
                source: Box::new(gone),
            },
            Ok(_) => CliError::Failed {
                request,
                source: status,
            },
        },
        _ => CliError::Failed {
            request,
            source: status,
        },
    }
}

fn volume_register(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(src) = args.first() else {
        return Err(c.usage("volume register needs FILE or -"));
    };
    let text = if *src == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|source| CliError::ReadInput {
                what: "standard input".into(),
                source,
            })?;
        s
    } else {
        std::fs::read_to_string(src).map_err(|source| CliError::ReadInput {
            what: src.to_string(),
            source,
        })?
    };
    let file = if *src == "-" {
        "standard input".to_string()
    } else {
        src.to_string()
    };
    let specs: Vec<VolumeSpec> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(items)) => items.into_iter().map(serde_json::from_value).collect(),
        Ok(v) => serde_json::from_value(v).map(|s| vec![s]),
        Err(e) => Err(e),
    }
    .map_err(|source| CliError::VolumeFileParse {
        file: file.clone(),
        source,
    })?;
    for s in &specs {
        s.validate().map_err(|source| CliError::VolumeSpec {
            file: file.clone(),
            source,
        })?;
    }
    let api = c.connect()?;
    for s in &specs {
        let mut req = w::RegisterVolumeRequest::new();
        req.volume = protobuf::MessageField::some(spec_to_register_wire(s));
        api.call("register", QUICK_CALL_TIMEOUT, |a, o| {
            a.register_volume(&req, o)
        })?;
        if !c.json() {
            println!("volume {} registered", s.id);
        }
    }
    if c.json() {
        let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
        println!("{}", json!({ "registered": ids }));
    }
    Ok(())
}

/// The wire form for registration: the only message that carries secrets.
fn spec_to_register_wire(s: &VolumeSpec) -> w::Volume {
    let mut v = crate::api::volume_to_wire(s);
    v.secret_keys.clear();
    v.secrets = s.secrets.clone().into_iter().collect();
    v
}

fn volume_list(c: &Call) -> Result<(), CliError> {
    c.positional(0)?;
    let api = c.connect()?;
    let r = api.call("volume list", QUICK_CALL_TIMEOUT, |a, o| {
        a.list_volumes(&w::ListVolumesRequest::new(), o)
    })?;
    if c.json() {
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
        return Ok(());
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
    Ok(())
}

fn volume_deregister(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(id) = args.first() else {
        return Err(c.usage("volume deregister needs a volume ID"));
    };
    let api = c.connect()?;
    let mut req = w::DeregisterVolumeRequest::new();
    req.volume_id = id.to_string();
    let r = api.call("deregister", QUICK_CALL_TIMEOUT, |a, o| {
        a.deregister_volume(&req, o)
    })?;
    if c.json() {
        println!("{}", json!({ "volume_id": id, "found": r.found }));
    } else if r.found {
        println!("volume {id} deregistered");
    } else {
        println!("volume {id} was not registered (nothing to do)");
    }
    Ok(())
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

/// The value of option `name` at `args[*i]` (`--name VALUE` or
/// `--name=VALUE`), advancing `i` past it; None if `args[*i]` is another
/// argument.
fn option_value(c: &Call, names: &[&str], i: &mut usize) -> Result<Option<String>, CliError> {
    let a = &c.args[*i];
    for name in names {
        if a == name {
            *i += 1;
            return match c.args.get(*i) {
                Some(v) => Ok(Some(v.clone())),
                None => Err(c.usage(format!("{a} needs a value"))),
            };
        }
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Ok(Some(v.to_string()));
        }
    }
    Ok(None)
}

fn alloc_mount(c: &Call) -> Result<(), CliError> {
    let mut alloc_id = None;
    let mut vols = Vec::new();
    let mut timeout = DEFAULT_MOUNT_TIMEOUT;
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--volume", "-v"], &mut i)? {
            vols.push(parse_volume_arg(&v).map_err(|e| c.usage(e))?);
        } else if let Some(v) = option_value(c, &["--timeout"], &mut i)? {
            timeout = parse_duration(&v).map_err(|e| c.usage(format!("--timeout: {e}")))?;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return Err(c.usage("alloc mount needs an allocation ID"));
    };
    if vols.is_empty() {
        return Err(c.usage("alloc mount needs at least one --volume ALIAS=VOLUME"));
    }
    let api = c.connect()?;
    let mut req = w::MountAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.volumes = vols;
    // Show what the mount waits on (a plugin, a held claim) while it runs;
    // the mount goes on without it if the thread cannot start.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    let progress = {
        let socket = api.socket.clone();
        let alloc_id = alloc_id.clone();
        std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || show_progress(&socket, &alloc_id, &done_rx))
            .ok()
    };
    let result = api.call("mount", timeout, |a, o| a.mount_alloc(&req, o));
    drop(done_tx);
    if let Some(p) = progress {
        let _ = p.join();
    }
    let r = result?;
    if c.json() {
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
    Ok(())
}

fn show_progress(socket: &Path, alloc_id: &str, done: &crossbeam_channel::Receiver<()>) {
    let client = ApiClient::new(crate::csi::grpc_environment("cli-progress"), socket);
    let mut last: Vec<String> = Vec::new();
    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) = done.recv_timeout(PROGRESS_POLL) {
        let mut req = w::GetAllocRequest::new();
        req.alloc_id = alloc_id.to_string();
        let opt = CallOption::default().timeout(QUICK_CALL_TIMEOUT);
        let Ok(r) = client.raw().get_alloc(&req, opt) else {
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

fn alloc_release(c: &Call) -> Result<(), CliError> {
    let mut alloc_id = None;
    let mut wait = Duration::ZERO;
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--wait"], &mut i)? {
            wait = parse_duration(&v).map_err(|e| c.usage(format!("--wait: {e}")))?;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return Err(c.usage("alloc release needs an allocation ID"));
    };
    let api = c.connect()?;
    let mut req = w::ReleaseAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let r = api.call("release", wait + QUICK_CALL_TIMEOUT, |a, o| {
        a.release_alloc(&req, o)
    })?;
    let all_released = r.volumes.iter().all(|v| v.state == "released");
    if c.json() {
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
    }
    // With --wait, a release that did not finish is a failure for scripts.
    if !wait.is_zero() && r.found && !(r.done && all_released) {
        return Err(CliError::ReleaseUnfinished {
            alloc_id,
            running: !r.done,
        });
    }
    Ok(())
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

fn alloc_status(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let api = c.connect()?;
    let allocs: Vec<w::AllocStatus> = match args.first() {
        Some(id) => {
            let mut req = w::GetAllocRequest::new();
            req.alloc_id = id.to_string();
            let r = api.call("status", QUICK_CALL_TIMEOUT, |a, o| a.get_alloc(&req, o))?;
            vec![r.alloc.unwrap_or_default()]
        }
        None => {
            api.call("status", QUICK_CALL_TIMEOUT, |a, o| {
                a.list_allocs(&w::ListAllocsRequest::new(), o)
            })?
            .allocs
        }
    };
    if c.json() {
        let list: Vec<Value> = allocs.iter().map(alloc_json).collect();
        println!("{}", json!({ "allocs": list }));
        return Ok(());
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
    Ok(())
}

fn plugin_list(c: &Call) -> Result<(), CliError> {
    c.positional(0)?;
    let api = c.connect()?;
    let r = api.call("plugin list", QUICK_CALL_TIMEOUT, |a, o| {
        a.list_plugins(&w::ListPluginsRequest::new(), o)
    })?;
    if c.json() {
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
        return Ok(());
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
    Ok(())
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
    use crate::volumes::{AccessMode, AttachmentMode};

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

    /// The mount help names every access and attachment mode the parser
    /// takes, so it cannot fall behind `volumes`.
    #[test]
    fn mount_help_lists_every_mode() {
        let help = ALLOC.verb_help(ALLOC.verb("mount").expect("mount"));
        // The help wraps lines; compare with the whitespace folded.
        let folded = help.split_whitespace().collect::<Vec<_>>().join(" ");
        for m in AccessMode::ALL {
            assert!(folded.contains(m.name()), "{} missing:\n{help}", m.name());
        }
        for m in [AttachmentMode::FileSystem, AttachmentMode::BlockDevice] {
            assert!(folded.contains(m.name()), "{} missing:\n{help}", m.name());
        }
    }

    /// Every verb's help shows its own usage line, and the summary names
    /// every verb.
    #[test]
    fn every_verb_has_help_and_is_in_the_summary() {
        let summary = summary();
        for n in NOUNS {
            let noun_help = n.help();
            for v in n.verbs {
                let help = n.verb_help(v);
                let usage = format!("claimd {} {} {}", n.name, v.name, v.args);
                assert!(help.contains(usage.trim_end()), "{help}");
                assert!(noun_help.contains(v.about), "{noun_help}");
                assert!(summary.contains(usage.trim_end()), "{summary}");
            }
        }
    }

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn unknown_verbs_are_usage_errors_with_or_without_help() {
        for a in [
            &["create"][..],
            &["create", "--help"],
            &["--help", "create"],
        ] {
            let e = VOLUME.run(&args(a)).expect_err("unknown verb");
            assert_eq!(e.exit(), super::super::exit::Exit::Usage, "{a:?}");
            let text = crate::error_chain(&e);
            assert!(text.contains("\"create\""), "{text}");
            assert!(text.contains("register, list, deregister"), "{text}");
        }
        let e = ALLOC.run(&args(&[])).expect_err("no verb");
        assert!(crate::error_chain(&e).contains("mount, release, status"));
    }

    #[test]
    fn bad_arguments_name_the_verbs_help() {
        let cases: [(&Noun, &[&str], &str); 5] = [
            (&ALLOC, &["mount", "a1"], "claimd alloc mount --help"),
            (
                &ALLOC,
                &["mount", "a1", "--bogus"],
                "claimd alloc mount --help",
            ),
            (
                &ALLOC,
                &["release", "a1", "--wait", "soon"],
                "claimd alloc release --help",
            ),
            (&VOLUME, &["list", "extra"], "claimd volume list --help"),
            (&PLUGIN, &["list", "--socket"], "claimd plugin --help"),
        ];
        for (noun, a, want) in cases {
            let e = noun.run(&args(a)).expect_err("usage error");
            assert_eq!(e.exit(), super::super::exit::Exit::Usage, "{a:?}");
            let text = crate::error_chain(&e);
            assert!(text.contains(want), "{a:?}: {text}");
        }
    }

    #[test]
    fn option_values_take_both_forms() {
        let c = Call {
            client: Client {
                socket: PathBuf::from("/nonexistent"),
                json: false,
            },
            args: args(&["--wait=5s", "--wait", "6s", "--waiting", "--wait"]),
            help: "claimd alloc release".into(),
        };
        let mut i = 0;
        assert_eq!(
            option_value(&c, &["--wait"], &mut i)
                .ok()
                .flatten()
                .as_deref(),
            Some("5s")
        );
        i = 1;
        assert_eq!(
            option_value(&c, &["--wait"], &mut i)
                .ok()
                .flatten()
                .as_deref(),
            Some("6s")
        );
        assert_eq!(i, 2);
        i = 3;
        assert!(matches!(option_value(&c, &["--wait"], &mut i), Ok(None)));
        i = 4;
        assert!(option_value(&c, &["--wait"], &mut i).is_err());
    }
}
