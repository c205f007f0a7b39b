//! `claimd agent`: runs the node agent until SIGTERM or SIGINT.

use std::path::{Path, PathBuf};
use std::time::Instant;

use signal_hook::consts::{SIGINT, SIGTERM};

use super::error::CliError;
use crate::agent::{dev_dir, Agent, STOP_SLACK};
use crate::config::{self, Config};
use crate::shutdown::Shutdown;
use crate::threads::Threads;

pub fn help() -> String {
    format!(
        "claimd agent: run the node agent.

USAGE:
    claimd agent [--config PATH] [--dev]

OPTIONS:
    --config PATH   JSON config file [default: {cfg}]; also
                    --config=PATH. A missing file at the default path means
                    all defaults; a missing file given explicitly is an
                    error.
    --dev           Development mode: state and mount root in
                    {tmp}/claimd-dev (kept if the agent crashes, so a
                    restarted --dev agent picks its allocations up), debug
                    logs, and on a graceful stop every volume it mounted is
                    released (best effort, bounded) and the directory removed.
    -h, --help      Print this help.

{fields}
SIGNALS:
    SIGTERM, SIGINT  stop gracefully: nothing is unmounted; the next start
                     resumes from the state file. Exits within the CSI call
                     timeout plus a second.

LOGS:
    RUST_LOG=debug shows one line per CSI call (default: info).

SYSTEMD:
    With $NOTIFY_SOCKET set (Type=notify): STATUS= while restoring
    (\"restoring N allocations, M done\"), READY=1 once the restore is done
    and the API answers, STOPPING=1 on stop, and WATCHDOG=1 at half of
    $WATCHDOG_USEC when the unit sets WatchdogSec=.

EXIT CODES:
    0  stopped gracefully (SIGTERM, SIGINT)
    1  the agent failed to start (the message says why; e.g. the
       metrics_listen address is in use)
    2  bad arguments or a bad config
",
        cfg = config::DEFAULT_CONFIG_PATH,
        tmp = std::env::temp_dir().display(),
        fields = config::fields::help_section(),
    )
}

/// The config named on the command line, or the default one (all
/// defaults when the default file is missing).
pub fn load_config(path: Option<&Path>) -> Result<Config, CliError> {
    let Some(path) = path else {
        let default = Path::new(config::DEFAULT_CONFIG_PATH);
        if !default.exists() {
            return Ok(Config::default());
        }
        return Ok(Config::load(default)?);
    };
    Ok(Config::load(path)?)
}

fn init_logger(default: &str) {
    let env = env_logger::Env::default().default_filter_or(default);
    let _ = env_logger::Builder::from_env(env)
        .format(|buf, record| {
            use std::io::Write;
            crate::threads::with_current_name(|name| {
                writeln!(
                    buf,
                    "{} {:5} [{}] {}",
                    buf.timestamp_millis(),
                    record.level(),
                    name.unwrap_or("-"),
                    record.args()
                )
            })
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

/// Runs `claimd agent ARGS...` until a signal stops it.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let usage = |message: String| CliError::usage(message, "claimd agent");
    let mut config_path: Option<PathBuf> = None;
    let mut dev = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                print!("{}", help());
                return Ok(());
            }
            "--dev" => dev = true,
            "--config" => match it.next() {
                Some(p) => config_path = Some(PathBuf::from(p)),
                None => return Err(usage("--config needs a path".into())),
            },
            a if a.starts_with("--config=") => {
                config_path = Some(PathBuf::from(&a["--config=".len()..]));
            }
            other => return Err(usage(format!("unknown argument {other:?}"))),
        }
    }
    init_logger(if dev { "debug" } else { "info" });
    limit_malloc_arenas();
    let mut config = load_config(config_path.as_deref())?;
    if dev {
        let d = dev_dir().map_err(|e| CliError::AgentStart { source: e.into() })?;
        config.state_dir = d.join("state");
        config.mount_root = d.join("mounts");
        log::info!("dev mode: state and mounts under {}", d.display());
    }
    let shutdown = Shutdown::new();
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(1);
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .map_err(|source| CliError::Signals { source })?;
    let handle = signals.handle();
    // The signals thread ends once its handle is closed.
    let mut threads = Threads::new();
    let close_signals = |threads: Threads| {
        handle.close();
        let _ = threads.join_until(Instant::now() + STOP_SLACK);
    };
    {
        let shutdown = shutdown.clone();
        threads
            .spawn("signals", move || {
                if let Some(sig) = signals.forever().next() {
                    log::info!("signal {sig} received: stopping");
                    let _ = stop_tx.try_send(());
                    // Outside dev mode nothing is released on stop, so every
                    // wait and retry loop may stop at once.
                    if !dev {
                        shutdown.trigger();
                    }
                }
            })
            .map_err(|source| CliError::SpawnThread {
                name: "signals",
                source,
            })?;
    }
    // The error is printed once, by `main`: not logged here too.
    let agent = match Agent::start(config, dev, shutdown.clone()) {
        Ok(a) => a,
        Err(e) => {
            shutdown.trigger();
            close_signals(threads);
            return Err(CliError::AgentStart { source: e.into() });
        }
    };
    log::info!("claimd {} running", env!("CARGO_PKG_VERSION"));
    crossbeam_channel::select! {
        recv(stop_rx) -> _ => {},
        recv(shutdown.receiver()) -> _ => {},
    }
    agent.stop();
    close_signals(threads);
    Ok(())
}
