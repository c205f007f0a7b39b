//! The exit codes of every `claimd` command, documented in `--help` and the
//! manual (packaging/doc/cli.md). An error picks its code by its type (`CliError::exit`), never by
//! its message.

/// How a command ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: success.
    Ok,
    /// 1: the command failed (the message says why).
    Failed,
    /// 2: bad arguments, invalid input, or a bad config.
    Usage,
    /// 3: no agent answers at the API socket.
    Unreachable,
}

impl Exit {
    /// Every exit code, in order (for the help text).
    pub const ALL: [Exit; 4] = [Exit::Ok, Exit::Failed, Exit::Usage, Exit::Unreachable];

    pub const fn code(self) -> u8 {
        match self {
            Exit::Ok => 0,
            Exit::Failed => 1,
            Exit::Usage => 2,
            Exit::Unreachable => 3,
        }
    }

    /// What the code means, as `--help` says it.
    pub const fn meaning(self) -> &'static str {
        match self {
            Exit::Ok => "success",
            Exit::Failed => "the command failed (the message says why)",
            Exit::Usage => "usage error (bad arguments, invalid input, or a bad config)",
            Exit::Unreachable => "the agent is not reachable",
        }
    }

    /// The EXIT CODES section of `--help`.
    pub fn help_section() -> String {
        let mut s = String::from("EXIT CODES:\n");
        for e in Exit::ALL {
            s.push_str(&format!("    {}  {}\n", e.code(), e.meaning()));
        }
        s
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(e: Exit) -> Self {
        std::process::ExitCode::from(e.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_documented_ones() {
        let codes: Vec<u8> = Exit::ALL.iter().map(|e| e.code()).collect();
        assert_eq!(codes, vec![0, 1, 2, 3]);
        let help = Exit::help_section();
        assert!(
            help.contains("    3  the agent is not reachable\n"),
            "{help}"
        );
    }
}
