//! The shape of the source tree, checked so that it stays as designed:
//! no hand-written file under `src/` or `tests/` is longer than 900
//! lines, no module imports another that imports it back (directly or in
//! a loop), and the retired escape hatches are gone.
//!
//! Modules are files (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`). An
//! edge is a path in a `use`, in code or in a comment (`crate::a::b::c`,
//! `super::x`),
//! resolved to the deepest module it names. Edges between a module and its
//! own ancestors are left out: a directory's `mod.rs` re-exporting its
//! children is a facade, not a dependency. Two graphs must be acyclic: the
//! modules, and the top-level modules they fold into (`crate::a`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 900;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).expect("read src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The library's modules: path segments -> file. Binaries are left out.
fn library_modules() -> BTreeMap<Vec<String>, PathBuf> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut m = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src()).expect("under src");
        let parts: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if parts[0] == "bin" || parts == ["main.rs"] {
            continue;
        }
        let mut segs: Vec<String> = parts.clone();
        let last = segs.pop().expect("a file name");
        if last != "mod.rs" && last != "lib.rs" {
            segs.push(last.trim_end_matches(".rs").to_string());
        }
        m.insert(segs, f);
    }
    m
}

/// The text of a file without its tests. Comments are kept: a module that
/// names another in its docs (`crate::x`) counts as depending on it, so the
/// docs cannot describe a loop the code avoids.
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).expect("read source");
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// Expands `a::{b, c::{d, e}}` into `a::b`, `a::c::d`, `a::c::e`.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    match tree.find('{') {
        None => out.push(format!("{prefix}{tree}")),
        Some(open) => {
            let head = &tree[..open];
            let inner = &tree[open + 1..tree.rfind('}').expect("a closing brace")];
            let mut depth = 0;
            let mut start = 0;
            for (i, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&format!("{prefix}{head}"), &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            if !inner[start..].trim().is_empty() {
                expand(&format!("{prefix}{head}"), &inner[start..], out);
            }
        }
    }
}

/// Every path a file's code names, as written.
fn named_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    // `use` declarations, braces and all.
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().last();
        let after = &rest[i + 4..];
        rest = after;
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let Some(end) = after.find(';') else { break };
        let decl: String = after[..end].split_whitespace().collect();
        if decl.starts_with("crate::") || decl.starts_with("super::") || decl.starts_with("self::")
        {
            expand("", &decl, &mut out);
        }
    }
    // Paths in code.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| at + e);
            out.push(code[at..end].trim_end_matches(':').to_string());
            from = end.max(at + start.len());
        }
    }
    out
}

/// The deepest module a path names, from inside module `me`.
fn resolve(
    me: &[String],
    is_dir: bool,
    path: &str,
    modules: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let mut segs: Vec<String> = Vec::new();
    let mut parts = path.split("::").filter(|s| !s.is_empty()).peekable();
    match parts.peek().copied() {
        Some("crate") => {
            parts.next();
        }
        Some("super") => {
            // `super` of a file module is its directory's module; of a
            // mod.rs, the directory above.
            segs = me.to_vec();
            while parts.peek() == Some(&"super") {
                parts.next();
                segs.pop();
            }
            let _ = is_dir;
        }
        Some("self") => {
            parts.next();
            segs = me.to_vec();
        }
        _ => return None,
    }
    let mut best = segs.clone();
    for p in parts {
        segs.push(p.to_string());
        if modules.contains_key(&segs) {
            best = segs.clone();
        } else {
            break;
        }
    }
    Some(best)
}

fn is_ancestor(a: &[String], b: &[String]) -> bool {
    a.len() < b.len() && b.starts_with(a)
}

fn edges() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let modules = library_modules();
    let mut g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (me, file) in &modules {
        let is_dir = file.ends_with("mod.rs") || file.ends_with("lib.rs");
        let entry = g.entry(me.clone()).or_default();
        for p in named_paths(&code(file)) {
            let Some(to) = resolve(me, is_dir, &p, &modules) else {
                continue;
            };
            if &to == me || to.is_empty() || is_ancestor(&to, me) || is_ancestor(me, &to) {
                continue;
            }
            entry.insert(to);
        }
    }
    g
}

/// A cycle in `g`, if there is one.
fn find_cycle<N: Ord + Clone>(g: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<N>> {
    fn visit<N: Ord + Clone>(
        n: &N,
        g: &BTreeMap<N, BTreeSet<N>>,
        state: &mut BTreeMap<N, u8>,
        stack: &mut Vec<N>,
    ) -> Option<Vec<N>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let i = stack.iter().position(|x| x == n).expect("on the stack");
                let mut c = stack[i..].to_vec();
                c.push(n.clone());
                return Some(c);
            }
            _ => {}
        }
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

fn show(c: &[Vec<String>]) -> String {
    c.iter()
        .map(|m| format!("crate::{}", m.join("::")))
        .collect::<Vec<_>>()
        .join(" -> ")
}

#[test]
fn no_module_imports_another_that_imports_it_back() {
    let g = edges();
    assert!(g.len() > 20, "too few modules found: {:?}", g.keys());
    if let Some(c) = find_cycle(&g) {
        panic!("import loop between modules: {}", show(&c));
    }
    // The same, with every module folded into its top-level module.
    let mut top: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (from, tos) in &g {
        let f = from[..from.len().min(1)].to_vec();
        let e = top.entry(f.clone()).or_default();
        for to in tos {
            let t = to[..1].to_vec();
            if t != f && !f.is_empty() {
                e.insert(t);
            }
        }
    }
    if let Some(c) = find_cycle(&top) {
        panic!("import loop between top-level modules: {}", show(&c));
    }
}

#[test]
fn the_checker_sees_a_loop_when_there_is_one() {
    let mut g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let m = |s: &str| vec![s.to_string()];
    g.entry(m("a")).or_default().insert(m("b"));
    g.entry(m("b")).or_default().insert(m("c"));
    assert_eq!(find_cycle(&g), None);
    g.entry(m("c")).or_default().insert(m("a"));
    assert!(find_cycle(&g).is_some());
    let mut paths = Vec::new();
    expand("", "crate::x::{a, b::{c, d}, E}", &mut paths);
    assert_eq!(
        paths,
        [
            "crate::x::a",
            "crate::x::b::c",
            "crate::x::b::d",
            "crate::x::E"
        ]
    );
}

#[test]
fn no_hand_written_source_or_test_file_is_longer_than_900_lines() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests"),
        &mut files,
    );
    assert!(
        files.iter().any(|f| f.ends_with("tests/local/main.rs")),
        "the test tree was not read"
    );
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = fs::read_to_string(f).expect("read").lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "longer than {MAX_LINES} lines: {long:?}");
}

#[test]
fn the_retired_escape_hatches_are_gone() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    assert!(!src().join("hook.rs").exists(), "src/hook.rs is back");
    for f in files {
        let text = fs::read_to_string(&f).expect("read");
        for word in ["in_state_file", "struct Manager"] {
            assert!(!text.contains(word), "{} mentions {word}", f.display());
        }
    }
}
