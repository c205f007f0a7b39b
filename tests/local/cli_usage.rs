//! The command line's contract without a working agent: usage errors (exit
//! 2) and the help of every noun and verb (exit 0), an unreachable agent
//! (exit 3), a live agent's own UNAVAILABLE answer (exit 1, not 3), and
//! errors printed exactly once. Runs the real binary.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use serde_json::json;

/// Runs `claimd ARGS` with `CLAIMD_SOCKET` at a socket nobody listens on,
/// so a command that wrongly tries the agent fails with exit 3.
fn claimd_offline(dir: &Path, args: &[&str]) -> CliOutput {
    let socket = dir.join("nobody.sock");
    run_claimd(
        args,
        None,
        &[("CLAIMD_SOCKET", socket.to_str().expect("utf-8"))],
        CLI_TIMEOUT,
    )
}

/// Asserts a usage error: exit 2, one `claimd: ` line naming `needles`,
/// nothing on stdout.
fn assert_usage(out: &CliOutput, needles: &[&str]) {
    assert_eq!(out.code, EXIT_USAGE, "{out:?}");
    assert_eq!(out.stdout, "", "{out:?}");
    assert!(out.stderr.starts_with("claimd: "), "{out:?}");
    assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
    for n in needles {
        assert!(out.stderr.contains(n), "stderr lacks {n:?}: {out:?}");
    }
}

#[test]
fn unknown_verbs_are_usage_errors_with_or_without_help() {
    let dir = TestDir::new();
    let cases: [(&[&str], &str, &str); 6] = [
        (
            &["volume", "destroy"],
            "\"destroy\"",
            "register, list, deregister, create, delete, detach, expand, snapshot",
        ),
        (
            &["volume", "destroy", "--help"],
            "\"destroy\"",
            "register, list, deregister, create, delete, detach, expand, snapshot",
        ),
        (
            &["snapshot", "-h", "rename"],
            "\"rename\"",
            "create, list, delete",
        ),
        (
            &["alloc", "unmount", "a1"],
            "\"unmount\"",
            "mount, release, status",
        ),
        (
            &["alloc", "unmount", "--help"],
            "\"unmount\"",
            "mount, release, status",
        ),
        (&["plugin", "show", "--help"], "\"show\"", "list"),
    ];
    for (args, verb, valid) in cases {
        let out = claimd_offline(dir.path(), args);
        let noun_help = format!("see `claimd {} --help`", args[0]);
        assert_usage(&out, &[verb, valid, &noun_help]);
    }
    // A noun without a verb names the verbs too.
    let out = claimd_offline(dir.path(), &["alloc"]);
    assert_usage(&out, &["mount, release, status"]);
    // So does an unknown command, and no command at all.
    assert_usage(&claimd_offline(dir.path(), &["volumes"]), &["\"volumes\""]);
    assert_usage(&claimd_offline(dir.path(), &[]), &["a command is needed"]);
}

#[test]
fn every_verb_help_describes_that_verb() {
    let dir = TestDir::new();
    // (command, what its help must say, what belongs to other verbs only)
    let cases: [(&[&str], &[&str], &[&str]); 8] = [
        (
            &["volume", "register", "--help"],
            &[
                "claimd volume register FILE|-",
                "standard input",
                "--socket PATH",
                "--json",
                "\"access_modes\"",
            ],
            &["--wait", "--timeout", "--volume"],
        ),
        (
            &["volume", "list", "--help"],
            &["claimd volume list [--socket PATH] [--json]", "secret"],
            &["--wait", "--timeout", "FILE"],
        ),
        (
            &["volume", "deregister", "-h"],
            &["claimd volume deregister ID", "Refused (exit 1) while"],
            &["--wait", "--timeout"],
        ),
        (
            &["alloc", "mount", "--help"],
            &[
                "claimd alloc mount ALLOC --volume ALIAS=VOLUME",
                "-v, --volume",
                "--timeout DURATION",
                "[default: 1h]",
                "access=MODE",
                "attachment=file-system|block-device",
                "flag=MOUNT_FLAG",
                "ro, rw",
            ],
            &["--wait"],
        ),
        // --help anywhere after the verb, even after other arguments.
        (
            &["alloc", "mount", "a1", "--volume", "data=db", "--help"],
            &["claimd alloc mount ALLOC", "--timeout DURATION"],
            &["--wait"],
        ),
        (
            &["alloc", "release", "--help"],
            &[
                "claimd alloc release ALLOC [--wait DURATION]",
                "--wait=DURATION",
                "Exits 1",
            ],
            &["--timeout", "--volume"],
        ),
        (
            &["alloc", "status", "--help"],
            &["claimd alloc status [ALLOC]", "--json"],
            &["--timeout", "--wait", "--volume"],
        ),
        (
            &["plugin", "list", "--help"],
            &["claimd plugin list [--socket PATH] [--json]", "health"],
            &["--timeout", "--wait", "--volume"],
        ),
    ];
    for (args, wanted, unwanted) in cases {
        let out = claimd_offline(dir.path(), args).ok();
        assert_eq!(out.stderr, "", "{out:?}");
        for w in wanted {
            assert!(
                out.stdout.contains(w),
                "`claimd {}` lacks {w:?}:\n{}",
                args.join(" "),
                out.stdout
            );
        }
        for u in unwanted {
            assert!(
                !out.stdout.contains(u),
                "`claimd {}` mentions {u:?}:\n{}",
                args.join(" "),
                out.stdout
            );
        }
    }
    // A noun's help describes its verbs.
    for (noun, verbs) in [
        (
            "volume",
            &[
                "register",
                "list",
                "deregister",
                "create",
                "delete",
                "expand",
                "snapshot",
            ][..],
        ),
        ("snapshot", &["create", "list", "delete"]),
        ("alloc", &["mount", "release", "status"]),
        ("plugin", &["list"]),
    ] {
        let out = claimd_offline(dir.path(), &[noun, "--help"]).ok();
        assert!(
            out.stdout.contains(&format!("claimd {noun} VERB")),
            "{}",
            out.stdout
        );
        for v in verbs {
            assert!(
                out.stdout.lines().any(|l| l.trim_start().starts_with(v)),
                "`claimd {noun} --help` lacks {v}:\n{}",
                out.stdout
            );
        }
    }
}

#[test]
fn bad_arguments_are_usage_errors_pointing_at_the_verbs_help() {
    let dir = TestDir::new();
    let cases: [(&[&str], &str); 7] = [
        (
            &["alloc", "mount", "a1", "--bogus"],
            "claimd alloc mount --help",
        ),
        (
            &["alloc", "mount", "a1", "--volume", "data"],
            "claimd alloc mount --help",
        ),
        (
            &[
                "alloc",
                "mount",
                "a1",
                "--volume",
                "data=db",
                "--timeout",
                "soon",
            ],
            "claimd alloc mount --help",
        ),
        (
            &["alloc", "release", "a1", "--wait"],
            "claimd alloc release --help",
        ),
        (
            &["volume", "register", "a.json", "b.json"],
            "claimd volume register --help",
        ),
        (&["volume", "list", "--bogus"], "claimd volume list --help"),
        (&["agent", "--bogus"], "claimd agent --help"),
    ];
    for (args, help) in cases {
        let out = claimd_offline(dir.path(), args);
        assert_usage(&out, &[help]);
    }
}

#[test]
fn an_unreachable_agent_exits_3() {
    let dir = TestDir::new();
    let file = dir.path().join("vol.json");
    fs::write(
        &file,
        volume_json("db", "ext-db", &["single-node-writer"]).to_string(),
    )
    .expect("write");
    let file = file.to_str().expect("utf-8");
    for args in [
        &["volume", "register", file][..],
        &["volume", "list"],
        &["volume", "deregister", "db"],
        &["alloc", "status"],
        &["alloc", "status", "a1", "--json"],
        &["alloc", "release", "a1", "--wait", "1s"],
        &["plugin", "list"],
    ] {
        let out = claimd_offline(dir.path(), args).expect_code(EXIT_UNREACHABLE);
        let want = format!(
            "claimd: agent not running at {}",
            dir.path().join("nobody.sock").display()
        );
        assert!(out.stderr.starts_with(&want), "{out:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
        assert_eq!(out.stdout, "", "{out:?}");
    }
}

/// The agent answers UNAVAILABLE when a volume's plugin is not ready: that
/// is the agent's answer (exit 1 with its message), not an unreachable
/// agent, whatever the message says.
#[test]
fn the_agents_own_unavailable_answer_is_a_failure_not_unreachable() {
    let dir = TestDir::new();
    let ghost = dir.path().join("ghost").join("csi.sock");
    let mut config = AgentConfig::new(dir.path(), Some(&ghost));
    config.plugin_wait_timeout = "1s".into();
    let agent = Agent::start(dir.path(), config);
    agent
        .register(&volume_json("db", "ext-db", &["single-node-writer"]))
        .ok();
    let out = agent
        .cli(&["alloc", "mount", "a1", "--volume", "data=db"])
        .expect_code(EXIT_FAILED);
    assert!(
        out.stderr.contains("claimd: the mount request failed: "),
        "{out:?}"
    );
    assert!(out.stderr.contains("was not ready after"), "{out:?}");
    assert!(!out.stderr.contains("agent not running"), "{out:?}");
    // The agent is still there and answers.
    agent.cli(&["plugin", "list"]).ok();
}

/// How often `needle` occurs in `haystack`.
fn occurrences(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// An agent that cannot start says why exactly once on stderr, after
/// `claimd: `, and the log does not repeat it.
#[test]
fn a_failed_agent_start_prints_its_error_once() {
    let dir = TestDir::new();
    let config = AgentConfig::new(dir.path(), None);
    let config_path = dir.path().join("config.json");
    config.write(&config_path);
    let config_arg = config_path.to_str().expect("utf-8");

    // A damaged state file: the agent itself refuses to start (exit 1).
    fs::create_dir_all(&config.state_dir).expect("state dir");
    fs::set_permissions(&config.state_dir, fs::Permissions::from_mode(0o700)).expect("chmod");
    let state_file = config.state_dir.join("state.json");
    fs::write(&state_file, b"not json at all\n").expect("write state");
    fs::set_permissions(&state_file, fs::Permissions::from_mode(0o600)).expect("chmod");
    let out = run_claimd(
        &["agent", "--config", config_arg],
        None,
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(out.code, EXIT_FAILED, "{out:?}");
    let want = format!("state file {} is corrupt", state_file.display());
    assert_printed_once(&out, &want);
    assert!(
        out.stderr.contains("claimd: the agent failed to start: "),
        "{out:?}"
    );
    assert_eq!(fs::read(&state_file).expect("read"), b"not json at all\n");

    // A config file that does not exist, and one that is not valid (exit 2).
    let missing = dir.path().join("nope.json");
    let out = run_claimd(
        &["agent", "--config", missing.to_str().expect("utf-8")],
        None,
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(out.code, EXIT_USAGE, "{out:?}");
    assert_printed_once(
        &out,
        &format!("failed to read config file {}", missing.display()),
    );
    fs::write(&config_path, json!({"surprise": 1}).to_string()).expect("write");
    let out = run_claimd(
        &["agent", "--config", config_arg],
        None,
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(out.code, EXIT_USAGE, "{out:?}");
    assert_printed_once(&out, "unknown field `surprise`");
}

/// `needle` occurs once in stderr, on the one line that starts with
/// `claimd: `.
fn assert_printed_once(out: &CliOutput, needle: &str) {
    assert_eq!(occurrences(&out.stderr, needle), 1, "{needle:?} in {out:?}");
    let errors: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("claimd: "))
        .collect();
    assert_eq!(errors.len(), 1, "{out:?}");
    assert!(errors[0].contains(needle), "{out:?}");
    assert!(
        !out.stderr.contains(" ERROR "),
        "the log repeats the error: {out:?}"
    );
}
