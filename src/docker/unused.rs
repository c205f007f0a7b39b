//! The engine-death rule: an engine that dies (or is killed) with its
//! containers never sends their Unmounts, and their claims would stay held
//! for good. Thread `docker-unused` looks every `unused_check_interval` at
//! each engine mount of this node (allocations `docker-*`, published) and
//! asks whether anything still uses that volume's data: a mount of the same
//! device whose root is the volume's root or below it (a container's bind
//! of the volume or of a subdirectory) in the mount namespace of any
//! thread of any process but the agent's own, or in the agent's own
//! namespace outside its mount root (an engine that mounts the volume on
//! the host for a copy). A mount that nothing uses at two checks in a row
//! is released with every reference it counts (the engine that would have
//! unmounted them is gone). A Mount of the allocation between two checks
//! clears its mark, a request for it that is running keeps it, and the
//! decision is made in the allocation's turn (`references`), so a Mount
//! adding a reference and the rule never cross.
//!
//! Conservative by design: a volume is in use while any other namespace
//! holds any of its data (a second container, a copy of the host's mounts
//! in a service's private namespace), so a mount in use is never
//! released; one that is not may be kept a while longer. Two checks in a
//! row leave a container a whole interval between Mount and its start.
//! An agent in a PID namespace of its own cannot see the containers'
//! processes: it keeps every mount and says why once. A namespace that
//! cannot be read (a sandbox's init may refuse even root) is not seen: its
//! mounts do not keep anything (said in the debug log).

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use super::driver::ALLOC_PREFIX;
use super::references::Turns;
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::state::Phase;
use crate::threads::Threads;

/// (device, root) of a mount: what a bind mount of the same data shares in
/// every namespace.
type Data = (String, String);

pub fn start(
    lifecycle: Lifecycle,
    turns: Turns,
    interval: Duration,
    threads: &mut Threads,
    stop: Shutdown,
) -> std::io::Result<()> {
    threads.spawn("docker-unused", move || {
        let mut blind = None;
        while stop.sleep(interval) {
            check(&lifecycle, &turns, &mut blind);
        }
    })
}

/// The `(device, root)` and mount point (as mountinfo escapes it) of each
/// line.
fn parse(text: &str) -> Vec<(Data, String)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(6, ' ').collect();
            (f.len() == 6).then(|| ((f[2].to_string(), f[3].to_string()), f[4].to_string()))
        })
        .collect()
}

/// A path as mountinfo writes it (octal escapes for space, tab, newline
/// and backslash).
fn escape(p: &Path) -> String {
    let mut out = String::new();
    for c in p.to_string_lossy().chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

/// Whether `data` is in use by one of `users`: a mount of the same device
/// whose root is the volume's root or below it (a container that binds a
/// subdirectory of the volume: Docker's `volume-subpath`, Podman's
/// `subpath`).
fn used_by(users: &HashSet<Data>, data: &Data) -> bool {
    let (device, root) = data;
    users.iter().any(|(d, r)| {
        d == device
            && (r == root
                || r.strip_prefix(root.as_str())
                    .is_some_and(|rest| rest.starts_with('/') || root.ends_with('/')))
    })
}

/// What a look at every mount namespace found.
struct Scan {
    /// The data mounted in every mount namespace but this process's own,
    /// and in its own outside the agent's mount root (an engine that
    /// mounts a volume in the host's namespace for an archive copy).
    users: HashSet<Data>,
    /// Why the look cannot tell which data is unused: every mount is kept.
    blind: Option<String>,
    /// A namespace that could not be read (the first one): its mounts are
    /// not seen.
    unreadable: Option<String>,
}

/// A `/proc` entry of a process or thread that ended while it was read.
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// Whether this process sees the host's processes: in the initial PID
/// namespace, PID 2 is the kernel's `kthreadd` (parent 0); in any other,
/// the kernel's threads are not visible at all.
fn sees_the_hosts_processes() -> bool {
    std::fs::read_to_string("/proc/2/status").is_ok_and(|s| {
        s.lines().any(|l| l == "Name:\tkthreadd") && s.lines().any(|l| l == "PPid:\t0")
    })
}

/// Looks at the mount namespace of every thread of every process (a
/// thread may have one of its own: newer Docker unshares one for a copy
/// out of a stopped container). A PID namespace that hides the host's
/// processes makes the scan blind. A namespace that cannot be read is
/// named, not counted: a sandbox's own init may refuse even root (as on
/// the machines this is tested on), and counting it as holding
/// everything would never release anything there.
fn scan(own_mounts: &[(Data, String)], mount_root: &str) -> std::io::Result<Scan> {
    let own = std::fs::read_link("/proc/self/ns/mnt")?;
    let mut users: HashSet<Data> = own_mounts
        .iter()
        .filter(|(_, mp)| !mp.starts_with(mount_root))
        .map(|(d, _)| d.clone())
        .collect();
    if !sees_the_hosts_processes() {
        return Ok(Scan {
            users,
            unreadable: None,
            blind: Some(
                "the agent runs in a PID namespace of its own and cannot see the containers' processes".to_string(),
            ),
        });
    }
    let mut seen = HashSet::from([own]);
    let mut unreadable = None;
    for e in std::fs::read_dir("/proc")? {
        let Ok(e) = e else { continue };
        if !e
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let tasks = match std::fs::read_dir(e.path().join("task")) {
            Ok(t) => t,
            Err(err) if gone(&err) => continue,
            Err(err) => {
                unreadable.get_or_insert(format!("{}: {err}", e.path().join("task").display()));
                continue;
            }
        };
        for t in tasks {
            let Ok(t) = t else { continue };
            let task = t.path();
            // Threads come and go while we read: skip the ones gone.
            let ns = match std::fs::read_link(task.join("ns/mnt")) {
                Ok(ns) => ns,
                Err(err) if gone(&err) => continue,
                Err(err) => {
                    unreadable.get_or_insert(format!("{}: {err}", task.join("ns/mnt").display()));
                    continue;
                }
            };
            if !seen.insert(ns) {
                continue;
            }
            match std::fs::read_to_string(task.join("mountinfo")) {
                Ok(text) => users.extend(parse(&text).into_iter().map(|(d, _)| d)),
                Err(err) if gone(&err) => {}
                Err(err) => {
                    unreadable
                        .get_or_insert(format!("{}: {err}", task.join("mountinfo").display()));
                }
            }
        }
    }
    Ok(Scan {
        users,
        blind: None,
        unreadable,
    })
}

/// One check; `blind` is why the last check could not see (said once).
fn check(lifecycle: &Lifecycle, turns: &Turns, blind: &mut Option<String>) {
    let mounts: Vec<(String, std::path::PathBuf)> = lifecycle
        .list_allocs()
        .into_iter()
        .filter(|a| a.id.starts_with(ALLOC_PREFIX) && !a.releasing)
        .filter_map(|a| {
            let v = a.volumes.first()?;
            (v.phase == Some(Phase::Published)).then(|| (a.id.clone(), v.host_path.clone()))
        })
        .collect();
    turns.retain_marks(|id| mounts.iter().any(|(a, _)| a == id));
    if mounts.is_empty() {
        return;
    }
    let root = &lifecycle.paths().mount_root;
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.clone());
    let root = format!("{}/", escape(&root));
    let scanned = std::fs::read_to_string(crate::mounts::MOUNTINFO)
        .map(|text| parse(&text))
        .and_then(|own| scan(&own, &root).map(|s| (own, s)));
    let (own, users) = match scanned {
        Ok((
            _,
            Scan {
                blind: Some(why), ..
            },
        )) => {
            // Nothing is released while the agent cannot see its users.
            turns.retain_marks(|_| false);
            if blind.as_deref() != Some(why.as_str()) {
                log::warn!("docker: the engine-death rule keeps every engine mount: {why}");
                *blind = Some(why);
            }
            log::debug!(
                "docker: {} engine mount(s) kept unchecked: the rule cannot see",
                mounts.len()
            );
            return;
        }
        Ok((
            own,
            Scan {
                users, unreadable, ..
            },
        )) => {
            if let Some(u) = unreadable {
                log::debug!(
                    "docker: a mount namespace cannot be read, its mounts are not seen: {u}"
                );
            }
            (own, users)
        }
        Err(e) => {
            turns.retain_marks(|_| false);
            log::warn!("docker: cannot tell which mounts containers use, keeping them all: {e}");
            return;
        }
    };
    if blind.take().is_some() {
        log::info!("docker: the engine-death rule sees every mount namespace again");
    }
    let mut in_use = 0;
    for (alloc, path) in &mounts {
        let target = escape(path);
        // The topmost mount at the target path is the published volume.
        let Some((data, _)) = own.iter().rev().find(|(_, mp)| *mp == target) else {
            // Not mounted (being restored): nothing to judge yet.
            continue;
        };
        if used_by(&users, data) {
            in_use += 1;
            turns.unmark(alloc);
            continue;
        }
        // A request for it is running: the engine is alive and using it.
        let Some(_turn) = turns.try_take(alloc) else {
            turns.unmark(alloc);
            continue;
        };
        if turns.mark(alloc) {
            turns.unmark(alloc);
            let references = lifecycle.references(alloc).unwrap_or(1);
            log::warn!(
                "docker: no container uses the mount of allocation {alloc} any more (its engine stopped without Unmount): releasing it with its {references} reference(s)"
            );
            if let Err(e) = lifecycle.release(alloc) {
                log::error!("docker: allocation {alloc} cannot be released: {e}");
            }
        }
    }
    log::debug!(
        "docker: {} engine mount(s) checked, {in_use} in use by a container",
        mounts.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_device_root_and_escaped_mount_point() {
        let text = "36 25 0:32 /vols/db /m/per\\040alloc/t rw,relatime shared:1 - ext4 /dev/sda1 rw\nbad\n";
        let p = parse(text);
        assert_eq!(
            p,
            [(
                ("0:32".to_string(), "/vols/db".to_string()),
                "/m/per\\040alloc/t".to_string()
            )]
        );
        assert_eq!(escape(Path::new("/m/per alloc/t")), "/m/per\\040alloc/t");
    }

    #[test]
    fn a_mount_of_the_same_device_at_the_root_or_below_uses_the_data() {
        let data = |d: &str, r: &str| (d.to_string(), r.to_string());
        let users = HashSet::from([data("0:32", "/vols/db/sub"), data("0:33", "/vols/web")]);
        assert!(used_by(&users, &data("0:32", "/vols/db")), "a subdirectory");
        assert!(used_by(&users, &data("0:32", "/vols/db/sub")), "the same");
        assert!(
            !used_by(&users, &data("0:32", "/vols/d")),
            "not a prefix of a name"
        );
        assert!(
            !used_by(&users, &data("0:32", "/vols/db/sub/deeper")),
            "above it"
        );
        assert!(
            !used_by(&users, &data("0:33", "/vols/db")),
            "another device"
        );
        assert!(used_by(&users, &data("0:33", "/")), "the whole file system");
    }

    #[test]
    fn the_scan_sees_the_hosts_processes_and_the_agents_own_mounts_outside_its_root() {
        // As root in the host's PID namespace: nothing is hidden.
        assert!(sees_the_hosts_processes());
        let s = scan(&[], "/nowhere/").expect("scanned");
        assert_eq!(s.blind, None);
        // The agent's own mounts outside its mount root count as users.
        let own = [
            (
                ("0:40".to_string(), "/v".to_string()),
                "/m/per-alloc/t".to_string(),
            ),
            (
                ("0:41".to_string(), "/w".to_string()),
                "/elsewhere".to_string(),
            ),
        ];
        let s = scan(&own, "/m/").expect("scanned");
        assert!(s.users.contains(&("0:41".to_string(), "/w".to_string())));
    }
}
