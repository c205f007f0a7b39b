//! The command line: `run` parses the first word and hands the rest to the
//! command's module. Every command returns `Result<(), CliError>`; `main`
//! prints the error once and exits with the code the error picks.
//!
//! - `exit`: the exit codes.
//! - `error`: `CliError`, the one error of every command.
//! - `client`: `volume`, `alloc` and `plugin`, which talk to a running agent.
//! - `agent_cmd`: `claimd agent`; `state_cmd`: `claimd state`.
//!
//! Imports only go down this list's dependency order (`mod` uses all;
//! `client` and the command modules use `error`; `error` uses `exit`);
//! nothing imports `mod`.

mod agent_cmd;
mod client;
mod error;
mod exit;
mod state_cmd;

pub use error::{AgentStatus, BoxError, CliError};
pub use exit::Exit;

pub fn version() -> String {
    format!("claimd {}", env!("CARGO_PKG_VERSION"))
}

/// `claimd --help`.
pub fn help() -> String {
    format!(
        "{version}
A node agent that claims, mounts and releases CSI volumes for the
allocations on this node, and survives its own restarts.

USAGE:
    claimd agent [--config PATH] [--dev]
    claimd volume|alloc|plugin VERB ...
    claimd metrics | claimd health
    claimd state [--config PATH | --state-dir DIR | --dev]
    claimd --help | --version

COMMANDS:
    agent       Run the agent (under systemd, or by hand).
    state       Print the recorded state (snapshot plus journal) as JSON,
                secrets redacted. Reads the state directory directly, so it
                works with the agent running or stopped, and changes
                nothing.
{nouns}
{client}
OPTIONS:
    -h, --help     Print this help.
    -V, --version  Print the version.

{exit}
Run `claimd agent --help` for the agent's options and defaults.
",
        version = version(),
        nouns = noun_lines(),
        client = client::summary(),
        exit = Exit::help_section(),
    )
}

fn noun_lines() -> String {
    let nouns = client::NOUNS
        .iter()
        .map(|n| format!("    {:<10}  {}.\n", n.name, capitalized(n.about)));
    let singles = client::SINGLES
        .iter()
        .map(|c| format!("    {:<10}  {}.\n", c.name, capitalized(c.about)));
    nouns.chain(singles).collect()
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(first) => first.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Runs the command line (`args[0]` is the program).
pub fn run(args: Vec<String>) -> Result<(), CliError> {
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
        return Err(CliError::usage(
            "a command is needed: agent, state, volume, alloc, plugin, metrics or health",
            "claimd",
        ));
    }
    let cmd = args.remove(0);
    let mut rest = args;
    rest.extend(global);
    match cmd.as_str() {
        "-h" | "--help" | "help" => {
            print!("{}", help());
            Ok(())
        }
        "-V" | "--version" | "version" => {
            println!("{}", version());
            Ok(())
        }
        "agent" => agent_cmd::run(&rest),
        "state" => state_cmd::run(&rest),
        "failpoints" => {
            // For the restart tests: lists the crash points of this build.
            if !crate::failpoints::ENABLED {
                return Err(CliError::NoFailpoints);
            }
            for f in crate::failpoints::FAILPOINTS {
                println!("{f}");
            }
            Ok(())
        }
        other => match (client::noun(other), client::single(other)) {
            (Some(noun), _) => noun.run(&rest),
            (None, Some(single)) => single.run(&rest),
            (None, None) => Err(CliError::usage(
                format!("unknown command {other:?}"),
                "claimd",
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(a: &[&str]) -> Result<(), CliError> {
        let mut v = vec!["claimd".to_string()];
        v.extend(a.iter().map(|s| s.to_string()));
        run(v)
    }

    #[test]
    fn usage_errors_exit_2() {
        for a in [
            &[][..],
            &["bogus"],
            &["agent", "--bogus"],
            &["agent", "--config"],
            &["state", "--dev", "--state-dir", "/x"],
            &["volume"],
            &["volume", "create"],
            &["volume", "destroy"],
            &["volume", "destroy", "--help"],
        ] {
            let e = run_args(a).expect_err("usage error");
            assert_eq!(e.exit(), Exit::Usage, "{a:?}: {e}");
            assert!(matches!(e, CliError::Usage { .. }), "{a:?}: {e:?}");
        }
    }

    #[test]
    fn help_lists_every_noun_and_exit_code() {
        let h = help();
        for n in client::NOUNS {
            assert!(h.contains(&format!("claimd {} ", n.name)), "{h}");
        }
        for e in Exit::ALL {
            assert!(h.contains(e.meaning()), "{h}");
        }
    }
}
