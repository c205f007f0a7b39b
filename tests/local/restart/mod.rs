//! The restart and crash scenarios: thin runner of `tests/local/restart/*.sh`.
//!
//! Each script is one test. It runs under bash with `CLAIMD_BIN` and
//! `PLUGIN_BIN` pointing at this build's binaries (built with the
//! `failpoints` feature: see `required-features` in Cargo.toml), in its own
//! temporary directory with its own sockets, so scripts run in parallel. A
//! script that exits non-zero fails its test with everything it printed.
//! One more test fails when a script exists that the list below lacks.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A script still running after this is stopped (SIGTERM, so its trap
/// cleans up) and fails. Every wait inside a script has its own, shorter
/// deadline; this only guards against a script that hangs.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a stopped script may take to clean up before SIGKILL.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);

/// One `#[test]` per script, and the list of scripts for
/// `every_script_has_a_test`.
macro_rules! scenarios {
    ($($test:ident => $script:literal,)*) => {
        const SCRIPTS: &[&str] = &[$($script),*];
        $(
            #[test]
            fn $test() {
                run_script($script);
            }
        )*
    };
}

scenarios! {
    clean_restart => "01-clean-restart.sh",
    plugin_starts_late => "02-plugin-starts-late.sh",
    plugin_dies_during_release => "03-plugin-dies-during-release.sh",
    reboot => "04-reboot.sh",
    crash_mount_path => "05-crash-mount-path.sh",
    crash_release_path => "06-crash-release-path.sh",
    crash_restore_and_shared_staging => "07-crash-restore-and-shared-staging.sh",
    sigterm_hung_release => "08-sigterm-hung-release.sh",
    dev_stop_dead_plugin => "09-dev-stop-dead-plugin.sh",
    one_stuck_volume => "10-one-stuck-volume.sh",
    corrupt_state => "11-corrupt-state.sh",
    state_v1 => "12-state-v1.sh",
    journal => "13-journal.sh",
    crash_after_answer => "14-crash-after-answer.sh",
}

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/local/restart")
}

fn run_script(script: &str) {
    let path = scripts_dir().join(script);
    assert!(path.is_file(), "{} does not exist", path.display());
    // stdout and stderr into one file, so the output keeps its order.
    let mut output = tempfile::tempfile().expect("create a file for the script's output");
    let out = output.try_clone().expect("clone the output file");
    let err = output.try_clone().expect("clone the output file");
    let started = Instant::now();
    let mut child = Command::new("bash")
        .arg(&path)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CLAIMD_BIN", env!("CARGO_BIN_EXE_claimd"))
        .env("PLUGIN_BIN", env!("CARGO_BIN_EXE_claimd-test-plugin"))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run bash {}: {e}", path.display()));
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the script") {
            break status;
        }
        let elapsed = started.elapsed();
        if !timed_out && elapsed > SCRIPT_TIMEOUT {
            timed_out = true;
            // SIGTERM: the script's trap kills what it started and unmounts.
            let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
            // SAFETY: kill(2) on the PID of our own child, not yet reaped.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        if timed_out && elapsed > SCRIPT_TIMEOUT + CLEANUP_TIMEOUT {
            let _ = child.kill();
        }
        thread::sleep(Duration::from_millis(100));
    };
    let mut text = String::new();
    output
        .seek(SeekFrom::Start(0))
        .and_then(|_| output.read_to_string(&mut text))
        .expect("read the script's output");
    let took = started.elapsed();
    if timed_out {
        panic!(
            "{script} did not finish within {SCRIPT_TIMEOUT:?} and was stopped ({status}); its output:\n{text}"
        );
    }
    if !status.success() {
        panic!("{script} failed ({status}) after {took:.1?}; its output:\n{text}");
    }
    eprintln!("{script}: passed in {took:.1?}");
}

/// Every `tests/local/restart/*.sh` except the sourced `lib.sh` must be listed in
/// `scenarios!`, so no script is silently left out of `cargo test`.
#[test]
fn every_script_has_a_test() {
    let mut found: Vec<String> = std::fs::read_dir(scripts_dir())
        .expect("read tests/local/restart")
        .map(|e| e.expect("read a directory entry").file_name())
        .filter_map(|name| name.into_string().ok())
        .filter(|name| name.ends_with(".sh") && name != "lib.sh")
        .collect();
    found.sort();
    let missing: Vec<&String> = found
        .iter()
        .filter(|s| !SCRIPTS.contains(&s.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "scripts in tests/local/restart without a test in tests/local/restart/mod.rs (add them to scenarios!): {missing:?}"
    );
    let gone: Vec<&&str> = SCRIPTS
        .iter()
        .filter(|s| !found.iter().any(|f| f == *s))
        .collect();
    assert!(
        gone.is_empty(),
        "scenarios! lists scripts that do not exist: {gone:?}"
    );
}
