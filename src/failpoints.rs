//! Failpoints: named places in the mount, release and restore paths where a
//! test can make the agent die (SIGKILL itself) or freeze, to prove that a
//! crash at any step converges after a restart.
//!
//! Compiled in only with the `failpoints` cargo feature (the tests enable
//! it; release builds and the package do not). Selected at run time with
//! `CLAIMD_FAILPOINT=NAME[:ACTION[:N]]`: ACTION is `kill` (default: the
//! process sends itself SIGKILL, like a crash), `pause` (the thread stops
//! forever, for a test to kill the agent at a known point) or `pause=MS`
//! (the thread stops for MS milliseconds, then goes on: a process paused
//! between two steps, as a SIGSTOP or a paused VM would); N (default 1)
//! fires on the N-th time the point is reached. `claimd failpoints` lists
//! them all.

/// Every failpoint, in lifecycle order. A unit test checks this list
/// against the `failpoints::hit("...")` calls in the source, so it cannot go
/// stale.
pub const FAILPOINTS: &[&str] = &[
    // Every transaction of the etcd claim store (cluster mode).
    "etcd-before-round-trip",
    "etcd-after-round-trip",
    "mount-after-record",
    "mount-after-intent",
    "before-controller-publish",
    "after-controller-publish",
    "before-node-stage",
    "after-node-stage",
    "before-node-publish",
    "after-node-publish",
    "mount-after-published",
    "release-after-mark",
    "before-node-unpublish",
    "after-node-unpublish",
    "before-node-unstage",
    "after-node-unstage",
    "before-controller-unpublish",
    "after-controller-unpublish",
    "release-after-claim-freed",
    // The flusher of closing writes, after the answers, before the write.
    "answer-before-closing-write",
    "restore-start",
    "state-after-snapshot",
];

pub const ENV: &str = "CLAIMD_FAILPOINT";

/// Whether this build has failpoints.
pub const ENABLED: bool = cfg!(feature = "failpoints");

#[cfg(feature = "failpoints")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    #[derive(Debug)]
    struct Selected {
        name: String,
        /// Some(None): for ever; Some(Some(d)): for `d`.
        pause: Option<Option<std::time::Duration>>,
        nth: u64,
        hits: AtomicU64,
    }

    fn selected() -> Option<&'static Selected> {
        static SELECTED: OnceLock<Option<Selected>> = OnceLock::new();
        SELECTED
            .get_or_init(|| {
                let v = std::env::var(super::ENV).ok()?;
                let mut parts = v.split(':');
                let name = parts.next()?.to_string();
                if !super::FAILPOINTS.contains(&name.as_str()) {
                    eprintln!("claimd: {}={v}: no such failpoint", super::ENV);
                    std::process::exit(2);
                }
                let pause = match parts.next() {
                    None | Some("kill") => None,
                    Some("pause") => Some(None),
                    Some(other) => {
                        match other.strip_prefix("pause=").and_then(|ms| ms.parse().ok()) {
                            Some(ms) => Some(Some(std::time::Duration::from_millis(ms))),
                            None => {
                                eprintln!("claimd: {}: unknown action {other:?}", super::ENV);
                                std::process::exit(2);
                            }
                        }
                    }
                };
                let nth = parts.next().and_then(|n| n.parse().ok()).unwrap_or(1);
                Some(Selected {
                    name,
                    pause,
                    nth,
                    hits: AtomicU64::new(0),
                })
            })
            .as_ref()
    }

    pub fn hit(name: &'static str) {
        let Some(s) = selected() else {
            return;
        };
        if s.name != name || s.hits.fetch_add(1, Ordering::SeqCst) + 1 != s.nth {
            return;
        }
        match s.pause {
            Some(None) => {
                eprintln!("claimd: failpoint {name}: paused");
                log::warn!("failpoint {name}: paused");
                loop {
                    std::thread::park();
                }
            }
            Some(Some(d)) => {
                log::warn!("failpoint {name}: paused for {d:?}");
                std::thread::sleep(d);
                log::warn!("failpoint {name}: going on after {d:?}");
                return;
            }
            None => {}
        }
        eprintln!("claimd: failpoint {name}: killing the agent");
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, so this
        // is a crash as abrupt as a power cut for the process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Reaches failpoint `name` (a no-op without the `failpoints` feature).
#[inline]
pub fn hit(name: &'static str) {
    #[cfg(feature = "failpoints")]
    imp::hit(name);
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.rs` file under `dir`.
    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).expect("read the source directory") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn the_list_matches_the_source() {
        let mut found = Vec::new();
        let mut files = Vec::new();
        sources(std::path::Path::new("src"), &mut files);
        for file in files.iter().filter(|f| !f.ends_with("failpoints.rs")) {
            let text = std::fs::read_to_string(file).expect("read source");
            let needle = "failpoints::hit(\"";
            let mut rest = text.as_str();
            while let Some(i) = rest.find(needle) {
                rest = &rest[i + needle.len()..];
                let end = rest.find('"').expect("closing quote");
                found.push(rest[..end].to_string());
            }
        }
        let mut listed: Vec<String> = FAILPOINTS.iter().map(|s| s.to_string()).collect();
        listed.sort();
        found.sort();
        // A point may be reached from two places (the same durable state).
        found.dedup();
        assert_eq!(found, listed, "FAILPOINTS and the hit() calls differ");
    }
}
