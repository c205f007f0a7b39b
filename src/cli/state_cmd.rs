//! `claimd state`: prints the recorded state (snapshot plus journal) as
//! JSON, secrets redacted, without the agent.

use std::path::PathBuf;

use super::agent_cmd::load_config;
use super::error::CliError;
use crate::config;

pub fn help() -> String {
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
    -h, --help       print this help
",
        cfg = config::DEFAULT_CONFIG_PATH,
        tmp = std::env::temp_dir().display(),
    )
}

/// Runs `claimd state ARGS...`.
pub fn run(args: &[String]) -> Result<(), CliError> {
    let usage = |message: String| CliError::usage(message, "claimd state");
    let mut config_path: Option<PathBuf> = None;
    let mut dir: Option<PathBuf> = None;
    let mut dev = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                print!("{}", help());
                return Ok(());
            }
            "--dev" => dev = true,
            "--config" | "--state-dir" => {
                let Some(v) = it.next() else {
                    return Err(usage(format!("{a} needs a path")));
                };
                if a == "--config" {
                    config_path = Some(PathBuf::from(v));
                } else {
                    dir = Some(PathBuf::from(v));
                }
            }
            other => return Err(usage(format!("unknown argument {other:?}"))),
        }
    }
    if [config_path.is_some(), dir.is_some(), dev]
        .iter()
        .filter(|&&x| x)
        .count()
        > 1
    {
        return Err(usage(
            "give at most one of --config, --state-dir and --dev".into(),
        ));
    }
    let dir = match (dir, dev) {
        (Some(d), _) => d,
        (None, true) => std::env::temp_dir().join("claimd-dev").join("state"),
        (None, false) => load_config(config_path.as_deref())?.state_dir,
    };
    let loaded = match crate::state::load_dir(&dir) {
        Ok(Some(l)) => l,
        Ok(None) => return Err(CliError::NoState { dir }),
        Err(e) => {
            return Err(CliError::LoadState {
                dir,
                source: e.into(),
            })
        }
    };
    let mut state = loaded.state;
    for spec in state.volumes.values_mut() {
        let spec = std::sync::Arc::make_mut(spec);
        for v in spec.secrets.values_mut() {
            *v = "(redacted)".to_string();
        }
    }
    let text =
        serde_json::to_string_pretty(&state).map_err(|source| CliError::PrintState { source })?;
    println!("{text}");
    Ok(())
}
