//! The documentation against the code. The README and the manual
//! (`packaging/doc/`) must name every config field, CLI command and metric
//! that exists and none that does not; the config reference in the manual
//! is exactly what `src/config/fields.rs` renders (`CLAIMD_UPDATE_DOCS=1`
//! rewrites it); the example configs load in the agent's parser; every
//! relative link and heading anchor resolves; the README stays short and
//! names the test command that `.ci/run` runs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use claimd::config::{fields, Config};

const README_MAX_LINES: usize = 250;
const TEST_COMMAND: &str = "bash tests/run.sh";
const BEGIN_REFERENCE: &str = "<!-- BEGIN config reference";
const END_REFERENCE: &str = "<!-- END config reference -->";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// The README, the manual's pages and the changelog: repository-relative
/// paths.
fn markdown_files() -> Vec<String> {
    let mut out = vec![
        "README.md".to_string(),
        "packaging/CHANGELOG.md".to_string(),
    ];
    let mut pages: Vec<String> = fs::read_dir(root().join("packaging/doc"))
        .expect("packaging/doc")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            format!(
                "packaging/doc/{}",
                p.file_name().expect("name").to_string_lossy()
            )
        })
        .collect();
    pages.sort();
    out.extend(pages);
    out
}

/// The field names the parser accepts, read from serde's own refusal of
/// an unknown field ("unknown field `x`, expected one of `a`, `b`").
fn parser_fields(text: &str, prefix: &str) -> BTreeSet<String> {
    let e = Config::parse(Path::new("/probe.json"), text).expect_err("unknown field refused");
    let chain = claimd::error_chain(&e);
    let expected = chain
        .split("expected ")
        .nth(1)
        .unwrap_or_else(|| panic!("no list of fields in: {chain}"));
    let expected = expected.split(" at line").next().expect("list");
    expected
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, name)| format!("{prefix}{name}"))
        .collect()
}

#[test]
fn the_field_table_is_the_parsers_fields() {
    let mut parsed = BTreeSet::new();
    for (probe, prefix) in [
        (r#"{"zz_probe": 1}"#, ""),
        (
            r#"{"plugins": [{"id": "p", "type": "node", "socket": "/p.sock", "zz_probe": 1}]}"#,
            "plugins[].",
        ),
        (
            r#"{"cluster": {"endpoints": ["http://127.0.0.1:2379"], "zz_probe": 1}}"#,
            "cluster.",
        ),
        (
            r#"{"cluster": {"endpoints": ["https://127.0.0.1:2379"], "tls": {"ca": "/ca.pem", "zz_probe": 1}}}"#,
            "cluster.tls.",
        ),
        (r#"{"docker": {"zz_probe": 1}}"#, "docker."),
    ] {
        parsed.extend(parser_fields(probe, prefix));
    }
    let table: BTreeSet<String> = fields::fields()
        .iter()
        .map(|f| f.name.to_string())
        .collect();
    let missing: Vec<_> = parsed.difference(&table).collect();
    let unknown: Vec<_> = table.difference(&parsed).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "src/config/fields.rs lacks {missing:?} and names {unknown:?}, which the parser does not have"
    );
}

#[test]
fn the_config_reference_is_generated_from_the_field_table() {
    let rel = "packaging/doc/configuration.md";
    let text = read(rel);
    let begin = text.find(BEGIN_REFERENCE).expect("begin marker");
    let body_start = begin + text[begin..].find("-->\n").expect("end of begin marker") + 4;
    let end = text.find(END_REFERENCE).expect("end marker");
    let want = fields::markdown();
    if text[body_start..end] == want {
        return;
    }
    if std::env::var_os("CLAIMD_UPDATE_DOCS").is_some() {
        let new = format!("{}{}{}", &text[..body_start], want, &text[end..]);
        fs::write(root().join(rel), new).expect("rewrite");
        return;
    }
    panic!("{rel}: the config reference differs from src/config/fields.rs; run the test with CLAIMD_UPDATE_DOCS=1 to rewrite it");
}

#[test]
fn agent_help_prints_the_field_table() {
    let out = Command::new(env!("CARGO_BIN_EXE_claimd"))
        .args(["agent", "--help"])
        .output()
        .expect("run claimd");
    let help = String::from_utf8(out.stdout).expect("utf-8");
    assert!(help.contains(&fields::help_section()), "{help}");
}

/// `claimd --help`'s commands: `agent`, `state` and every `NOUN VERB` and
/// single command of its CLIENT COMMANDS list (made from the CLI's tables).
fn cli_commands() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_claimd"))
        .arg("--help")
        .output()
        .expect("run claimd");
    let help = String::from_utf8(out.stdout).expect("utf-8");
    let mut cmds: BTreeSet<String> = ["agent".to_string(), "state".to_string()].into();
    let list = help
        .split("CLIENT COMMANDS")
        .nth(1)
        .expect("a CLIENT COMMANDS section");
    for line in list.lines().skip(1) {
        let Some(rest) = line.trim().strip_prefix("claimd ") else {
            break;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let verb = words
            .get(1)
            .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()));
        cmds.insert(match verb {
            Some(v) => format!("{} {v}", words[0]),
            None => words[0].to_string(),
        });
    }
    assert!(cmds.len() > 10, "{cmds:?}");
    cmds
}

/// The man page as text: roff font escapes and `\-` undone.
fn man_text() -> String {
    read("packaging/claimd.8")
        .replace("\\fB", "")
        .replace("\\fR", "")
        .replace("\\fI", "")
        .replace("\\-", "-")
}

#[test]
fn the_cli_page_and_the_man_page_name_every_command_and_no_other() {
    let cmds = cli_commands();
    let page = read("packaging/doc/cli.md");
    let man = man_text();
    for c in &cmds {
        assert!(
            page.contains(&format!("claimd {c}")),
            "packaging/doc/cli.md does not show `claimd {c}`"
        );
        let in_man = man.contains(&format!("claimd {c}"))
            || man.lines().any(|l| {
                let l = l.trim_start_matches(".TP").trim_start_matches(".TQ").trim();
                l == c.as_str() || l.starts_with(&format!("{c} ")) || l == format!(".B {c}")
            });
        assert!(in_man, "packaging/claimd.8 does not document `{c}`");
    }
    // Every `claimd WORD [WORD]` the manual shows in a code block exists.
    let nouns: BTreeSet<&str> = cmds
        .iter()
        .map(|c| c.split(' ').next().expect("noun"))
        .collect();
    for rel in markdown_files() {
        let text = read(&rel);
        for block in text.split("```").skip(1).step_by(2) {
            // Shell sessions only (a picture's words are not commands).
            if !(block.starts_with("sh\n") || block.starts_with("console\n")) {
                continue;
            }
            for line in block.lines() {
                let line = line.trim_start_matches("# ").trim();
                let Some(rest) = line.strip_prefix("claimd ") else {
                    continue;
                };
                let words: Vec<&str> = rest
                    .split_whitespace()
                    .filter(|w| !w.starts_with('-'))
                    .collect();
                let Some(first) = words.first() else { continue };
                assert!(
                    nouns.contains(first),
                    "{rel}: `{line}`: no command {first:?}"
                );
                let verbs: Vec<&String> = cmds
                    .iter()
                    .filter(|c| c.starts_with(&format!("{first} ")))
                    .collect();
                if !verbs.is_empty() {
                    let verb = format!("{first} {}", words.get(1).copied().unwrap_or(""));
                    assert!(cmds.contains(&verb), "{rel}: `{line}`: no command `{verb}`");
                }
            }
        }
    }
}

#[test]
fn the_man_page_names_every_top_level_config_field() {
    let man = man_text();
    for f in fields::fields() {
        if !f.name.contains('.') {
            assert!(
                man.contains(f.name),
                "packaging/claimd.8 lacks config field {}",
                f.name
            );
        }
    }
}

/// Metric names the code exports: the string literals of the collectors.
fn code_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for rel in ["src/observe/collect.rs", "src/metrics/process.rs"] {
        for piece in read(rel).split('"').skip(1).step_by(2) {
            let n = piece.trim_end();
            if (n.starts_with("claimd_") || n.starts_with("process_"))
                && n.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                names.insert(n.to_string());
            }
        }
    }
    assert!(names.len() > 20, "{names:?}");
    names
}

#[test]
fn the_operations_page_lists_every_metric_and_no_other() {
    let code = code_metrics();
    let page = read("packaging/doc/operations.md");
    let table: BTreeSet<String> = page
        .lines()
        .filter(|l| l.starts_with("| `claimd_") || l.starts_with("| `process_"))
        .flat_map(|l| {
            let cell = l.split('|').nth(1).expect("first cell").to_string();
            cell.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    let missing: Vec<_> = code.difference(&table).collect();
    let unknown: Vec<_> = table.difference(&code).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "operations.md's metrics table lacks {missing:?} and names {unknown:?}"
    );
    // A code span that starts with a metric's prefix names a metric.
    for rel in markdown_files() {
        for span in read(&rel).split('`').skip(1).step_by(2) {
            if !span.starts_with("claimd_") {
                continue;
            }
            let name: String = span
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let base = ["_count", "_sum", "_bucket"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| code.contains(*b)))
                .unwrap_or(&name);
            assert!(
                code.contains(base),
                "{rel} names metric {name}, which the code does not export"
            );
        }
    }
}

#[test]
fn the_example_configs_load() {
    let dir = root().join("packaging/examples");
    let mut n = 0;
    for e in fs::read_dir(&dir).expect("packaging/examples") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "json") {
            let text = fs::read_to_string(&p).expect("read example");
            if text.contains("\"tls\"") && !cfg!(feature = "tls") {
                // A build without TLS refuses the section, by design.
                continue;
            }
            Config::load(&p)
                .unwrap_or_else(|e| panic!("{}: {}", p.display(), claimd::error_chain(&e)));
            n += 1;
        }
    }
    assert!(n >= 2, "expected the examples in {}", dir.display());
    Config::load(&root().join("packaging/config.json")).expect("the packaged config loads");
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces
/// to hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if !in_code && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every `[text](target)` outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, part) in text.split("```").enumerate() {
        if i % 2 == 1 {
            continue;
        }
        let mut rest = part;
        while let Some(p) = rest.find("](") {
            let after = &rest[p + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut cache: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for rel in markdown_files() {
        let text = read(&rel);
        let base = root().join(&rel);
        let dir = base.parent().expect("dir").to_path_buf();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, frag) = match link.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                base.clone()
            } else {
                dir.join(file)
            };
            assert!(
                target.exists(),
                "{rel}: link {link}: {} does not exist",
                target.display()
            );
            if let Some(a) = frag {
                let set = cache.entry(target.clone()).or_insert_with(|| {
                    anchors(&fs::read_to_string(&target).expect("read link target"))
                });
                assert!(
                    set.contains(a),
                    "{rel}: link {link}: no heading #{a} in {}",
                    target.display()
                );
            }
        }
    }
}

#[test]
fn the_readme_is_short_and_names_the_test_command_ci_runs() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES})"
    );
    assert_eq!(
        readme.matches(TEST_COMMAND).count(),
        1,
        "README.md names `{TEST_COMMAND}` once"
    );
    let ci = read(".ci/run");
    assert!(
        ci.lines().any(|l| l.trim() == TEST_COMMAND),
        ".ci/run does not run `{TEST_COMMAND}`"
    );
}
