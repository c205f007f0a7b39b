//! The command line: parsing, help, and the `agent` command's signal
//! handling. `main` only calls `run` and turns its result into an exit code.

use std::path::PathBuf;

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::agent::{dev_dir, Agent};
use crate::config::{self, format_duration, Config};
use crate::shutdown::Shutdown;

/// Exit codes, documented in `--help` and the README.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_UNREACHABLE: u8 = 3;

pub fn version() -> String {
    format!("claimd {}", env!("CARGO_PKG_VERSION"))
}

pub fn help() -> String {
    format!(
        "{version}
A node agent that claims, mounts and releases CSI volumes for the
allocations on this node, and survives its own restarts.

USAGE:
    claimd agent [--config PATH] [--dev]
    claimd volume|alloc|plugin ...
    claimd state [--config PATH | --state-dir DIR | --dev]
    claimd --help | --version

COMMANDS:
    agent       Run the agent (under systemd, or by hand).
    state       Print the recorded state (snapshot plus journal) as JSON,
                secrets redacted. Reads the state directory directly, so it
                works with the agent running or stopped, and changes
                nothing.

{client}
OPTIONS:
    -h, --help     Print this help.
    -V, --version  Print the version.

EXIT CODES:
    {EXIT_OK}  success
    {EXIT_FAILED}  the command failed (the message says why)
    {EXIT_USAGE}  usage error (bad arguments, invalid input, or a bad config)
    {EXIT_UNREACHABLE}  the agent is not reachable

Run `claimd agent --help` for the agent's options and defaults.
",
        version = version(),
        client = crate::commands::client_help(),
    )
}

pub fn agent_help() -> String {
    let d = config::Timeouts::default();
    format!(
        "claimd agent: run the node agent.

USAGE:
    claimd agent [--config PATH] [--dev]

OPTIONS:
    --config PATH   JSON config file [default: {cfg}]. A missing file at
                    the default path means all defaults; a missing file
                    given explicitly is an error.
    --dev           Development mode: state and mount root in
                    {tmp}/claimd-dev (kept if the agent crashes, so a
                    restarted --dev agent picks its allocations up), debug
                    logs, and on a graceful stop every volume it mounted is
                    released (best effort, bounded) and the directory removed.

CONFIG FIELDS (all optional) AND DEFAULTS:
    state_dir               {state}
    api_socket              {api}
    mount_root              {mounts}
    plugin_dir              none (layout: <dir>/<plugin-id>/csi.sock,
                            node.sock or controller.sock)
    plugins                 [] of {{\"id\", \"type\": node|controller|monolith,
                            \"socket\": absolute path}}
    node_name               this host's name
    csi_call_timeout        {call}
    plugin_wait_timeout     {wait}
    probe_interval          {probe}
    claim_retry_deadline    {claim}
    release_retry_deadline  {release}
Durations are written like 500ms, 30s, 5m, 2h, 1d.

SIGNALS:
    SIGTERM, SIGINT  stop gracefully: nothing is unmounted; the next start
                     resumes from the state file. Exits within the CSI call
                     timeout plus a second.

LOGS:
    RUST_LOG=debug shows one line per CSI call (default: info).
",
        cfg = config::DEFAULT_CONFIG_PATH,
        tmp = std::env::temp_dir().display(),
        state = config::DEFAULT_STATE_DIR,
        api = config::DEFAULT_API_SOCKET,
        mounts = config::DEFAULT_MOUNT_ROOT,
        call = format_duration(d.csi_call),
        wait = format_duration(d.plugin_wait),
        probe = format_duration(d.probe_interval),
        claim = format_duration(d.claim_retry_deadline),
        release = format_duration(d.release_retry_deadline),
    )
}

/// A command-line error: printed with a hint, exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

fn init_logger(default: &str) {
    let env = env_logger::Env::default().default_filter_or(default);
    let _ = env_logger::Builder::from_env(env)
        .format(|buf, record| {
            use std::io::Write;
            let t = std::thread::current();
            writeln!(
                buf,
                "{} {:5} [{}] {}",
                buf.timestamp_millis(),
                record.level(),
                t.name().unwrap_or("-"),
                record.args()
            )
        })
        .try_init();
}

/// glibc gives every thread that allocates its own malloc arena, and keeps
/// what each arena once held: with many short request threads cloning a
/// large state, resident memory grows far past what is in use. Two arenas
/// are plenty for an agent whose hot path is fsync-bound.
fn limit_malloc_arenas() {
    // SAFETY: mallopt only tunes the allocator; called before the agent's
    // threads start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Runs the command line; returns the exit code.
pub fn run(args: Vec<String>) -> u8 {
    // Client options may also come before the command
    // (`claimd --socket PATH alloc status`): move them behind it.
    let mut args: Vec<String> = args.into_iter().skip(1).collect();
    let mut global = Vec::new();
    while let Some(first) = args.first() {
        if first == "--json" {
            global.push(args.remove(0));
        } else if first == "--socket" && args.len() >= 2 {
            global.extend(args.drain(..2));
        } else if first.starts_with("--socket=") {
            global.push(args.remove(0));
        } else {
            break;
        }
    }
    if args.is_empty() {
        eprint!("{}", help());
        return EXIT_USAGE;
    }
    let cmd = args.remove(0);
    let mut rest = args;
    rest.extend(global);
    match cmd.as_str() {
        "-h" | "--help" | "help" => {
            print!("{}", help());
            EXIT_OK
        }
        "-V" | "--version" | "version" => {
            println!("{}", version());
            EXIT_OK
        }
        "agent" => run_agent(&rest),
        "state" => run_state(&rest),
        "volume" => crate::commands::volume(&rest),
        "alloc" => crate::commands::alloc(&rest),
        "plugin" => crate::commands::plugin(&rest),
        "failpoints" => {
            // For the restart tests: lists the crash points of this build.
            if !crate::failpoints::ENABLED {
                eprintln!(
                    "claimd: this build has no failpoints (build with --features failpoints)"
                );
                return EXIT_FAILED;
            }
            for f in crate::failpoints::FAILPOINTS {
                println!("{f}");
            }
            EXIT_OK
        }
        other => {
            eprintln!("claimd: unknown command {other:?}; see `claimd --help`");
            EXIT_USAGE
        }
    }
}

/// The config named on the command line, or the default one (all
/// defaults when the default file is missing).
fn load_config(path: Option<&PathBuf>) -> Result<Config, u8> {
    let (p, explicit) = match path {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(config::DEFAULT_CONFIG_PATH), false),
    };
    if !explicit && !p.exists() {
        return Ok(Config::default());
    }
    Config::load(&p).map_err(|e| {
        eprintln!("claimd: {}", crate::error_chain(&e));
        EXIT_USAGE
    })
}

pub fn state_help() -> String {
    format!(
        "claimd state: print the recorded state as JSON.

USAGE:
    claimd state [--config PATH | --state-dir DIR | --dev]

Reads the snapshot (state.json) and replays the journal (state.journal) of
the state directory, the way the agent does at start, and prints the result:
registered volumes, claims and allocations with each volume's phase. Secret
values are replaced by \"(redacted)\". Nothing is locked or written, so it
works while the agent runs. A damaged state stops it with a message naming
the file (exit 1), as it would stop the agent.

OPTIONS:
    --config PATH    take state_dir from this config [default: {cfg}]
    --state-dir DIR  read this state directory
    --dev            read the --dev agent's state ({tmp}/claimd-dev/state)
",
        cfg = config::DEFAULT_CONFIG_PATH,
        tmp = std::env::temp_dir().display(),
    )
}

fn run_state(args: &[String]) -> u8 {
    let mut config_path: Option<PathBuf> = None;
    let mut dir: Option<PathBuf> = None;
    let mut dev = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                print!("{}", state_help());
                return EXIT_OK;
            }
            "--dev" => dev = true,
            "--config" | "--state-dir" => {
                let Some(v) = it.next() else {
                    eprintln!("claimd state: {a} needs a path");
                    return EXIT_USAGE;
                };
                if a == "--config" {
                    config_path = Some(PathBuf::from(v));
                } else {
                    dir = Some(PathBuf::from(v));
                }
            }
            other => {
                eprintln!("claimd state: unknown argument {other:?}; see `claimd state --help`");
                return EXIT_USAGE;
            }
        }
    }
    if [config_path.is_some(), dir.is_some(), dev]
        .iter()
        .filter(|&&x| x)
        .count()
        > 1
    {
        eprintln!("claimd state: give at most one of --config, --state-dir and --dev");
        return EXIT_USAGE;
    }
    let dir = match (dir, dev) {
        (Some(d), _) => d,
        (None, true) => std::env::temp_dir().join("claimd-dev").join("state"),
        (None, false) => match load_config(config_path.as_ref()) {
            Ok(c) => c.state_dir,
            Err(code) => return code,
        },
    };
    let loaded = match crate::state::load_dir(&dir) {
        Ok(Some(l)) => l,
        Ok(None) => {
            eprintln!("claimd: no state in {}", dir.display());
            return EXIT_FAILED;
        }
        Err(e) => {
            eprintln!("claimd: {}", crate::error_chain(&e));
            return EXIT_FAILED;
        }
    };
    let mut state = loaded.state;
    for spec in state.volumes.values_mut() {
        let spec = std::sync::Arc::make_mut(spec);
        for v in spec.secrets.values_mut() {
            *v = "(redacted)".to_string();
        }
    }
    match serde_json::to_string_pretty(&state) {
        Ok(s) => {
            println!("{s}");
            EXIT_OK
        }
        Err(e) => {
            eprintln!("claimd: cannot print the state: {e}");
            EXIT_FAILED
        }
    }
}

fn run_agent(args: &[String]) -> u8 {
    let mut config_path: Option<PathBuf> = None;
    let mut dev = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "-h" | "--help" => {
                print!("{}", agent_help());
                return EXIT_OK;
            }
            "--dev" => dev = true,
            "--config" => {
                i += 1;
                match args.get(i) {
                    Some(p) => config_path = Some(PathBuf::from(p)),
                    None => {
                        eprintln!("claimd agent: --config needs a path");
                        return EXIT_USAGE;
                    }
                }
            }
            a if a.starts_with("--config=") => {
                config_path = Some(PathBuf::from(&a["--config=".len()..]));
            }
            other => {
                eprintln!("claimd agent: unknown argument {other:?}; see `claimd agent --help`");
                return EXIT_USAGE;
            }
        }
        i += 1;
    }
    init_logger(if dev { "debug" } else { "info" });
    limit_malloc_arenas();
    let mut config = match load_config(config_path.as_ref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if dev {
        match dev_dir() {
            Ok(d) => {
                config.state_dir = d.join("state");
                config.mount_root = d.join("mounts");
                log::info!("dev mode: state and mounts under {}", d.display());
            }
            Err(e) => {
                eprintln!("claimd: {}", crate::error_chain(&e));
                return EXIT_FAILED;
            }
        }
    }
    let shutdown = Shutdown::new();
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(1);
    let mut signals = match signal_hook::iterator::Signals::new([SIGTERM, SIGINT]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("claimd: cannot install signal handlers: {e}");
            return EXIT_FAILED;
        }
    };
    let handle = signals.handle();
    {
        let shutdown = shutdown.clone();
        let spawned = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    log::info!("signal {sig} received: stopping");
                    let _ = stop_tx.try_send(());
                    // Outside dev mode nothing is released on stop, so every
                    // wait and retry loop may stop at once.
                    if !dev {
                        shutdown.trigger();
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!("claimd: cannot start the signal thread: {e}");
            return EXIT_FAILED;
        }
    }
    let agent = match Agent::start(config, dev, shutdown.clone()) {
        Ok(a) => a,
        Err(e) => {
            log::error!("{}", crate::error_chain(&e));
            eprintln!("claimd: {}", crate::error_chain(&e));
            shutdown.trigger();
            handle.close();
            return EXIT_FAILED;
        }
    };
    log::info!("{} running", version());
    crossbeam_channel::select! {
        recv(stop_rx) -> _ => {},
        recv(shutdown.receiver()) -> _ => {},
    }
    agent.stop();
    handle.close();
    EXIT_OK
}
