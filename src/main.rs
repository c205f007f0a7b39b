//! The `claimd` binary: parses nothing itself; see `claimd::cli`.

use std::process::ExitCode;

fn main() -> ExitCode {
    match claimd::cli::run(std::env::args().collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("claimd: {}", claimd::error_chain(&e));
            e.exit_code()
        }
    }
}
