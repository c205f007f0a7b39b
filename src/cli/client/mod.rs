//! The client commands (`volume`, `alloc`, `claim`, `plugin`, `snapshot`,
//! and the single verbs of `observe`: `metrics`, `health`): each verb
//! talks to a running agent over its API socket and prints a table, or
//! JSON with `--json`. Every noun and verb is a row of a table here, so
//! dispatch, `--help` and the error for an unknown verb come from the same
//! place; each noun's verbs live in the file of that name.

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

mod alloc;
mod claim;
mod observe;
mod plugin;
mod snapshot;
mod volume;

pub use observe::{Single, SINGLES};

use alloc::*;
use claim::*;
use plugin::*;
pub use snapshot::SNAPSHOT;
pub use volume::VOLUME;

/// Deadline of quick API calls (lists, status, register).
pub const QUICK_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of volume operations through a controller plugin (create,
/// delete, expand, snapshots): a wait for the plugin plus its calls.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(600);
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
prints where each one is mounted on the host. Before any claim, a volume
with an accessible topology must fit the node: one of its segment sets must
be a subset of the node plugin's segments (NodeGetInfo); otherwise the
mount fails at once, naming both. It waits until they are
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
                    group=GID      the mount group (CSI volume_mount_group):
                                   the plugin makes the volume usable by
                                   that group; only file systems, only node
                                   plugins with VOLUME_MOUNT_GROUP
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

USAGE shows the volume's bytes used of its capacity, and NOTE an abnormal
condition, from the plugin's latest NodeGetVolumeStats answer (plugins
with GET_VOLUME_STATS, polled every volume_stats_interval); --json has
them as \"stats\": {\"at_unix_ms\", \"bytes\": {\"capacity\", \"used\",
\"available\"}, \"inodes\": {\"capacity\", \"used\", \"free\"},
\"condition\": {\"abnormal\", \"message\"}, \"error\"} (null without stats).
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
source and generation. In cluster mode it also lists the cluster's
controller hosts: plugin, node, whether the node is alive, whether its
controller is ready and attaches volumes (--json: \"controller_hosts\";
\"cluster_error\" when etcd cannot be read).
",
        run: plugin_list,
    }],
};

pub const CLAIM: Noun = Noun {
    name: "claim",
    about: "show who holds which volume, free a claim left behind",
    verbs: &[
        Verb {
            name: "list",
            args: "[--volume VOLUME]",
            about: "list the claims of the claim store",
            details: "\
Lists every claim the agent's claim store holds: volume, allocation, node,
mode (read or write), access mode, state (taken; releasing while its
allocation is being released; node-detached once the node side is done
and the controller detach is being retried), since when it is held
(cluster mode) and the holder's last error (why it cannot let go yet).
--json adds external_node_id, since_ms, last_error and holder_unreachable.
On one node these are this agent's claims; in cluster mode (a `cluster`
section in the config) they are every node's, read from etcd, and the
command fails (exit 1) when etcd cannot be reached. A claim whose node has
no liveness key shows NODE as `N (unreachable)`, followed by a line that
says it stays claimed and which command frees it once that node is known
to be down for good.

OPTIONS:
    --volume VOLUME   only the claims on VOLUME; also --volume=VOLUME
",
            run: claim_list,
        },
        Verb {
            name: "free",
            args: "VOLUME ALLOC --reason TEXT [--force]",
            about: "free a claim no agent will release",
            details: "\
Frees the claim of allocation ALLOC on VOLUME: one left behind by an
allocation that no agent will release (a lost node, a state directory
wiped by hand). The reason is required; it is logged, and in cluster mode
kept in etcd under <prefix>/freed/VOLUME/ALLOC.

Refused (exit 1) when an allocation on this node still records the volume
(release it with `claimd alloc release` instead), and, in cluster mode,
while the holder's node is alive (its liveness lease is held): it may still
have the volume mounted. --force frees it anyway; use it only when you know
nothing uses the volume there.

OPTIONS:
    --reason TEXT   why (required); also --reason=TEXT
    --force         free it although the holder's node is alive
",
            run: claim_free,
        },
    ],
};

pub const NODE: Noun = Noun {
    name: "node",
    about: "forget a node that is gone for good (cluster mode)",
    verbs: &[Verb {
        name: "remove",
        args: "NODE",
        about: "remove a gone node's settings from the cluster",
        details: "\
Forgets NODE, a node that is gone for good: deletes its settings
(<prefix>/node-settings/NODE, which every agent's reaper watches), its
reaper lock and its claim index marker (<prefix>/claim-index/NODE), so the
cluster stops looking at it. Refused (exit 1) while
NODE is alive (its liveness lease is held), while it still holds claims
(free them first with `claimd volume detach VOLUME --node NODE --reason
TEXT`), for this agent's own node, and on one node. A node that comes
back writes its settings again when it registers. --json prints
{\"node\", \"removed_keys\"}.
",
        run: node_remove,
    }],
};

/// Every client noun, in help order.
pub const NOUNS: [&Noun; 6] = [&VOLUME, &SNAPSHOT, &ALLOC, &PLUGIN, &CLAIM, &NODE];

/// The verbless client command called `name` (`metrics`, `health`).
pub fn single(name: &str) -> Option<&'static Single> {
    SINGLES.into_iter().find(|s| s.name == name)
}

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
    for c in SINGLES {
        s.push_str(&format!("    claimd {}\n", c.name));
    }
    s.push_str(
        "Run `claimd NOUN --help`, `claimd NOUN VERB --help` or `claimd metrics|health --help` for more.\n\n",
    );
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
#[derive(Clone)]
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
        let r =
            parse_volume_arg("data=db,ro,access=multi-node-reader-only,flag=noatime,group=1000")
                .expect("valid");
        assert_eq!(r.mount_group, "1000");
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
            &["destroy"][..],
            &["destroy", "--help"],
            &["--help", "destroy"],
        ] {
            let e = VOLUME.run(&args(a)).expect_err("unknown verb");
            assert_eq!(e.exit(), super::super::exit::Exit::Usage, "{a:?}");
            let text = crate::error_chain(&e);
            assert!(text.contains("\"destroy\""), "{text}");
            assert!(
                text.contains(
                    "register, list, deregister, create, delete, detach, expand, snapshot"
                ),
                "{text}"
            );
        }
        for a in [
            &["volume", "snapshot", "rename"][..],
            &["volume", "snapshot"],
        ] {
            let e = VOLUME
                .run(&args(&a[1..]))
                .expect_err("unknown snapshot verb");
            assert_eq!(e.exit(), super::super::exit::Exit::Usage, "{a:?}");
            let text = crate::error_chain(&e);
            assert!(text.contains("create, list, delete"), "{text}");
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
