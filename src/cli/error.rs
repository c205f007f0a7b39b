//! The command line's one error type. Every command returns it; `main`
//! prints its chain once (`claimd: <error>: <cause>...`) and exits with the
//! code its variant picks.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use grpcio::{RpcStatus, RpcStatusCode};

use super::exit::Exit;
use crate::config::{format_duration, ConfigError};

/// An error from a module that is not the CLI's (the agent, the state
/// store): kept whole as the source, whatever its type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug)]
pub enum CliError {
    /// Bad arguments. `help` is the command whose `--help` explains them.
    Usage { message: String, help: String },
    /// A volume file that is not JSON volume definitions.
    VolumeFileParse {
        file: String,
        source: serde_json::Error,
    },
    /// A volume definition the agent would refuse.
    VolumeSpec {
        file: String,
        source: crate::volumes::SpecError,
    },
    /// The config file cannot be read or is invalid.
    Config { source: ConfigError },
    /// An input file (or standard input) cannot be read.
    ReadInput {
        what: String,
        source: std::io::Error,
    },
    /// No agent answers at the API socket.
    Unreachable { socket: PathBuf, source: BoxError },
    /// `claimd health`: the agent answers but has problems (printed).
    Degraded { problems: usize },
    /// A listing found stored values it cannot read (printed before).
    Unreadable { what: &'static str, count: usize },
    /// The agent refused a request as invalid (INVALID_ARGUMENT).
    Refused {
        request: &'static str,
        source: AgentStatus,
    },
    /// The agent answered a request with an error (any other status).
    Failed {
        request: &'static str,
        source: AgentStatus,
    },
    /// The call failed in gRPC itself (not a status from the agent).
    Call {
        request: &'static str,
        source: grpcio::Error,
    },
    /// The client's deadline passed before the agent answered.
    NoAnswer {
        request: &'static str,
        deadline: Duration,
    },
    /// `alloc release --wait` returned before every volume was released.
    ReleaseUnfinished { alloc_id: String, running: bool },
    /// `claimd agent` could not start the agent.
    AgentStart { source: BoxError },
    /// `claimd agent` could not install its signal handlers.
    Signals { source: std::io::Error },
    /// A thread of the CLI could not be started.
    SpawnThread {
        name: &'static str,
        source: std::io::Error,
    },
    /// `claimd state`: the directory holds no state.
    NoState { dir: PathBuf },
    /// `claimd state`: the state cannot be read.
    LoadState { dir: PathBuf, source: BoxError },
    /// `claimd state`: the state cannot be written as JSON.
    PrintState { source: serde_json::Error },
    /// `claimd failpoints` in a build without them.
    NoFailpoints,
}

impl CliError {
    /// A usage error explained by `claimd <help> --help`.
    pub fn usage(message: impl Into<String>, help: impl Into<String>) -> CliError {
        CliError::Usage {
            message: message.into(),
            help: help.into(),
        }
    }

    /// The exit code, by type.
    pub fn exit(&self) -> Exit {
        match self {
            CliError::Usage { .. }
            | CliError::VolumeFileParse { .. }
            | CliError::VolumeSpec { .. }
            | CliError::Config { .. }
            | CliError::Refused { .. } => Exit::Usage,
            CliError::Unreachable { .. } => Exit::Unreachable,
            CliError::ReadInput { .. }
            | CliError::Failed { .. }
            | CliError::Call { .. }
            | CliError::NoAnswer { .. }
            | CliError::ReleaseUnfinished { .. }
            | CliError::Degraded { .. }
            | CliError::Unreadable { .. }
            | CliError::AgentStart { .. }
            | CliError::Signals { .. }
            | CliError::SpawnThread { .. }
            | CliError::NoState { .. }
            | CliError::LoadState { .. }
            | CliError::PrintState { .. }
            | CliError::NoFailpoints => Exit::Failed,
        }
    }

    /// The process exit code (what `main` returns).
    pub fn exit_code(&self) -> std::process::ExitCode {
        self.exit().into()
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage { message, help } => {
                write!(f, "{message}; see `{help} --help`")
            }
            CliError::VolumeFileParse { file, .. } => {
                write!(f, "{file} is not a valid volume definition")
            }
            CliError::VolumeSpec { file, .. } => {
                write!(f, "{file} holds an invalid volume definition")
            }
            CliError::Config { .. } => f.write_str("cannot load the configuration"),
            CliError::ReadInput { what, .. } => write!(f, "cannot read {what}"),
            CliError::Unreachable { socket, .. } => {
                write!(f, "agent not running at {}", socket.display())
            }
            CliError::Unreadable { what, count } => {
                write!(f, "{what}: {count} stored value(s) could not be read")
            }
            CliError::Degraded { problems } => {
                write!(f, "the agent is degraded ({problems} problem(s))")
            }
            CliError::Refused { request, .. } => {
                write!(f, "the agent refused the {request} request")
            }
            CliError::Failed { request, .. } => write!(f, "the {request} request failed"),
            CliError::Call { request, .. } => {
                write!(f, "the {request} request failed in gRPC")
            }
            CliError::NoAnswer { request, deadline } => write!(
                f,
                "the agent did not answer in time ({request} request, deadline {}); \
                 the operation goes on in the agent: check `claimd alloc status`",
                format_duration(*deadline)
            ),
            CliError::ReleaseUnfinished { alloc_id, running } => {
                if *running {
                    write!(
                        f,
                        "the release of allocation {alloc_id} is still running; \
                         check `claimd alloc status {alloc_id}`"
                    )
                } else {
                    write!(
                        f,
                        "the release of allocation {alloc_id} left volumes unreleased; \
                         check `claimd alloc status {alloc_id}`"
                    )
                }
            }
            CliError::AgentStart { .. } => f.write_str("the agent failed to start"),
            CliError::Signals { .. } => f.write_str("cannot install the signal handlers"),
            CliError::SpawnThread { name, .. } => write!(f, "cannot start the {name} thread"),
            CliError::NoState { dir } => write!(f, "no state in {}", dir.display()),
            CliError::LoadState { dir, .. } => {
                write!(f, "cannot read the state in {}", dir.display())
            }
            CliError::PrintState { .. } => f.write_str("cannot print the state"),
            CliError::NoFailpoints => {
                f.write_str("this build has no failpoints (build with --features failpoints)")
            }
        }
    }
}

impl std::error::Error for CliError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CliError::VolumeFileParse { source, .. } => Some(source),
            CliError::VolumeSpec { source, .. } => Some(source),
            CliError::Config { source } => Some(source),
            CliError::ReadInput { source, .. } => Some(source),
            CliError::Unreachable { source, .. } => Some(source.as_ref()),
            CliError::Refused { source, .. } | CliError::Failed { source, .. } => Some(source),
            CliError::Call { source, .. } => Some(source),
            CliError::AgentStart { source } => Some(source.as_ref()),
            CliError::Signals { source } => Some(source),
            CliError::SpawnThread { source, .. } => Some(source),
            CliError::LoadState { source, .. } => Some(source.as_ref()),
            CliError::PrintState { source } => Some(source),
            CliError::Usage { .. }
            | CliError::NoAnswer { .. }
            | CliError::Degraded { .. }
            | CliError::Unreadable { .. }
            | CliError::ReleaseUnfinished { .. }
            | CliError::NoState { .. }
            | CliError::NoFailpoints => None,
        }
    }
}

impl From<ConfigError> for CliError {
    fn from(source: ConfigError) -> Self {
        CliError::Config { source }
    }
}

/// A status the agent answered with: printed as its message (the agent
/// writes its messages for people), the code kept for the exit code.
#[derive(Debug)]
pub struct AgentStatus(pub RpcStatus);

impl AgentStatus {
    pub fn code(&self) -> RpcStatusCode {
        self.0.code()
    }
}

impl fmt::Display for AgentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.message().is_empty() {
            write!(f, "status {:?} without a message", self.0.code())
        } else {
            f.write_str(self.0.message())
        }
    }
}

impl std::error::Error for AgentStatus {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain;

    fn status(code: RpcStatusCode, msg: &str) -> AgentStatus {
        AgentStatus(RpcStatus::with_message(code, msg.to_string()))
    }

    #[test]
    fn exit_codes_follow_the_type() {
        let unreachable = CliError::Unreachable {
            socket: PathBuf::from("/run/x.sock"),
            source: Box::new(std::io::Error::from(std::io::ErrorKind::NotFound)),
        };
        assert_eq!(unreachable.exit(), Exit::Unreachable);
        let refused = CliError::Refused {
            request: "mount",
            source: status(RpcStatusCode::INVALID_ARGUMENT, "invalid alias"),
        };
        assert_eq!(refused.exit(), Exit::Usage);
        // A message that mentions connecting does not make it unreachable.
        let failed = CliError::Failed {
            request: "mount",
            source: status(RpcStatusCode::UNAVAILABLE, "cannot connect to plugin p"),
        };
        assert_eq!(failed.exit(), Exit::Failed);
        assert_eq!(CliError::usage("bad", "claimd").exit(), Exit::Usage);
        assert_eq!(CliError::NoFailpoints.exit(), Exit::Failed);
    }

    #[test]
    fn chain_names_the_cause_once() {
        let e = CliError::Failed {
            request: "mount",
            source: status(RpcStatusCode::NOT_FOUND, "volume nosuch is not registered"),
        };
        assert_eq!(
            error_chain(&e),
            "the mount request failed: volume nosuch is not registered"
        );
        let e = CliError::usage("unknown volume verb \"create\"", "claimd volume");
        assert_eq!(
            error_chain(&e),
            "unknown volume verb \"create\"; see `claimd volume --help`"
        );
    }
}
