//! The `claimd` binary: parses nothing itself; see `claimd::cli`.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(claimd::cli::run(std::env::args().collect()))
}
