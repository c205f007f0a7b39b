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
//! unmounted them is gone).
//!
//! Never a candidate (no mark, a mark cleared): a mount in use; a mount
//! younger than the engine's own Mount timeout (`engine_mount_timeout`,
//! counted from its last Mount, or from the agent's start unless the node
//! rebooted); a mount whose last Mount answered before a Mount of another
//! volume that is still running began (an engine mounts a container's
//! volumes one after another and starts the container after the last);
//! a mount a request is deciding about; a mount of a volume that a
//! container of an answering engine lists, in any state but removed
//! (`engines`, asked before a release). A Mount clears its mount's mark,
//! and the decision is made in the allocation's turn (`references`), so a
//! Mount adding a reference and the rule never cross.
//!
//! Fails closed: the rule releases nothing, says why once in the log and
//! shows it in `claimd health` (`RuleHealth`) while it cannot see every
//! user: the agent is in a PID namespace of its own (it cannot see the
//! containers' processes), or a task's mount table cannot be read (not
//! because it ended). A task whose namespace link cannot be read (a
//! sandbox's init may refuse even root; an agent without CAP_SYS_PTRACE
//! is refused every other user's) is still judged by its mount table:
//! when that table holds the agent's own root mount (mount IDs are unique
//! across namespaces) it is the agent's own namespace, else another one
//! whose mounts count as users.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::driver::ALLOC_PREFIX;
use super::references::Turns;
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::state::Phase;
use crate::threads::Threads;

/// (device, root) of a mount: what a bind mount of the same data shares in
/// every namespace.
type Data = (String, String);

/// Why the engine-death rule releases nothing now, for `claimd health`.
/// Cheap to clone.
#[derive(Clone, Default)]
pub struct RuleHealth {
    blind: Arc<Mutex<Option<String>>>,
}

impl RuleHealth {
    /// The problem `claimd health` shows; None while the rule sees.
    pub fn problem(&self) -> Option<String> {
        self.blind
            .lock()
            .as_ref()
            .map(|why| format!("docker: the engine-death rule releases no engine mount: {why}"))
    }
}

/// What the rule is given.
pub struct Rule {
    pub lifecycle: Lifecycle,
    pub turns: Turns,
    pub interval: Duration,
    /// A mount younger than this is never a candidate.
    pub min_age: Duration,
    /// The driver's name and the engines' API sockets (`engines`).
    pub driver: String,
    pub engine_sockets: Vec<std::path::PathBuf>,
    pub health: RuleHealth,
}

pub fn start(rule: Rule, threads: &mut Threads, stop: Shutdown) -> std::io::Result<()> {
    threads.spawn("docker-unused", move || {
        while stop.sleep(rule.interval) {
            check(&rule);
        }
    })
}

/// One line of a mount table.
#[derive(Clone, Debug, PartialEq)]
struct Line {
    /// The mount ID: unique across every namespace while the mount lives.
    id: String,
    data: Data,
    /// As mountinfo escapes it.
    mount_point: String,
}

/// The lines of a mount table (lines that are not one are skipped).
fn parse(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(6, ' ').collect();
            (f.len() == 6).then(|| Line {
                id: f[0].to_string(),
                data: (f[2].to_string(), f[3].to_string()),
                mount_point: f[4].to_string(),
            })
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
    /// Tasks whose namespace link could not be read, judged by their
    /// mount tables (the first one, for the debug log).
    unnamed: Option<String>,
}

/// A `/proc` entry of a process or thread that ended while it was read
/// (a thread that has exited but whose process lives on has no namespace
/// left: EINVAL).
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(libc::ESRCH | libc::EINVAL))
}

/// Whether this process sees the host's processes: in the initial PID
/// namespace, PID 2 is the kernel's `kthreadd` (parent 0); in any other,
/// the kernel's threads are not visible at all.
fn sees_the_hosts_processes(proc: &Path) -> bool {
    std::fs::read_to_string(proc.join("2/status")).is_ok_and(|s| {
        s.lines().any(|l| l == "Name:\tkthreadd") && s.lines().any(|l| l == "PPid:\t0")
    })
}

/// Looks at the mount namespace of every thread of every process under
/// `proc` (a thread may have one of its own: newer Docker unshares one for
/// a copy out of a stopped container). `own_ns` and `own` are the agent's
/// namespace and mount table; `mount_root` the agent's mount root as
/// mountinfo writes it, with a trailing `/`. Blind (keeping every mount)
/// when a PID namespace hides the host's processes or a task's mount table
/// cannot be read.
fn scan(proc: &Path, own_ns: &Path, own: &[Line], mount_root: &str) -> std::io::Result<Scan> {
    let mut users: HashSet<Data> = own
        .iter()
        .filter(|l| !l.mount_point.starts_with(mount_root))
        .map(|l| l.data.clone())
        .collect();
    if !sees_the_hosts_processes(proc) {
        return Ok(Scan {
            users,
            unnamed: None,
            blind: Some(
                "the agent runs in a PID namespace of its own and cannot see the containers' processes".to_string(),
            ),
        });
    }
    // The agent's root mount: a mount table that holds it is the agent's
    // own namespace's (a mount's ID belongs to one namespace).
    let own_root = own.iter().find(|l| l.mount_point == "/").map(|l| &l.id);
    let blind = |what: &Path, err: &std::io::Error| {
        Some(format!(
            "{} cannot be read ({err}): a container's use of the volumes cannot be ruled out",
            what.display()
        ))
    };
    let mut seen = HashSet::from([own_ns.to_path_buf()]);
    let mut unnamed = None;
    for e in std::fs::read_dir(proc)? {
        let Ok(e) = e else { continue };
        if !e
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let task_dir = e.path().join("task");
        let tasks = match std::fs::read_dir(&task_dir) {
            Ok(t) => t,
            Err(err) if gone(&err) => continue,
            Err(err) => {
                return Ok(Scan {
                    users,
                    unnamed,
                    blind: blind(&task_dir, &err),
                })
            }
        };
        for t in tasks {
            let Ok(t) = t else { continue };
            let task = t.path();
            // Threads come and go while we read: skip the ones gone.
            let ns = match std::fs::read_link(task.join("ns/mnt")) {
                Ok(ns) => Some(ns),
                Err(err) if gone(&err) => continue,
                Err(err) => {
                    unnamed.get_or_insert(format!("{}: {err}", task.join("ns/mnt").display()));
                    None
                }
            };
            // A namespace counts as read only once a table of it was: a
            // task that ended before its table could be read leaves the
            // namespace to the next task in it.
            if ns.as_ref().is_some_and(|ns| seen.contains(ns)) {
                continue;
            }
            let table = task.join("mountinfo");
            match std::fs::read_to_string(&table) {
                Ok(text) => {
                    if let Some(ns) = &ns {
                        seen.insert(ns.clone());
                    }
                    let lines = parse(&text);
                    if ns.is_none() && own_root.is_some_and(|r| lines.iter().any(|l| &l.id == r)) {
                        // The agent's own namespace, seen through a task
                        // whose namespace link is refused.
                        continue;
                    }
                    users.extend(lines.into_iter().map(|l| l.data));
                }
                Err(err) if gone(&err) => {}
                Err(err) => {
                    return Ok(Scan {
                        users,
                        unnamed,
                        blind: blind(&table, &err),
                    })
                }
            }
        }
    }
    Ok(Scan {
        users,
        blind: None,
        unnamed,
    })
}

/// Says once (log and health) why the rule releases nothing, or that it
/// sees again.
fn set_blind(health: &RuleHealth, why: Option<String>) {
    let mut blind = health.blind.lock();
    match (&*blind, &why) {
        (old, Some(why)) if old.as_deref() != Some(why.as_str()) => {
            log::warn!("docker: the engine-death rule keeps every engine mount: {why}");
        }
        (Some(_), None) => {
            log::info!("docker: the engine-death rule sees every mount namespace again")
        }
        _ => {}
    }
    *blind = why;
}

/// One check.
fn check(rule: &Rule) {
    let (lifecycle, turns) = (&rule.lifecycle, &rule.turns);
    let mounts: Vec<(String, String, std::path::PathBuf)> = lifecycle
        .list_allocs()
        .into_iter()
        .filter(|a| a.id.starts_with(ALLOC_PREFIX) && !a.releasing)
        .filter_map(|a| {
            let v = a.volumes.first()?;
            (v.phase == Some(Phase::Published))
                .then(|| (a.id.clone(), v.volume_id.clone(), v.host_path.clone()))
        })
        .collect();
    turns.retain_marks(|id| mounts.iter().any(|(a, _, _)| a == id));
    turns.retain_mounted(|id| lifecycle.alloc_status(id).is_some());
    if mounts.is_empty() {
        return;
    }
    let root = &lifecycle.paths().mount_root;
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.clone());
    let root = format!("{}/", escape(&root));
    let scanned = std::fs::read_link("/proc/self/ns/mnt").and_then(|own_ns| {
        let own = parse(&std::fs::read_to_string(crate::mounts::MOUNTINFO)?);
        scan(Path::new("/proc"), &own_ns, &own, &root).map(|s| (own, s))
    });
    let (own, users) = match scanned {
        Ok((own, scan)) => {
            if let Some(why) = scan.blind {
                // Nothing is released while the agent cannot see its users.
                turns.retain_marks(|_| false);
                set_blind(&rule.health, Some(why));
                log::debug!(
                    "docker: {} engine mount(s) kept unchecked: the rule cannot see",
                    mounts.len()
                );
                return;
            }
            if let Some(u) = scan.unnamed {
                log::debug!(
                    "docker: a mount namespace link cannot be read, its task is judged by its mount table: {u}"
                );
            }
            (own, scan.users)
        }
        Err(e) => {
            turns.retain_marks(|_| false);
            set_blind(
                &rule.health,
                Some(format!("the mount tables cannot be read: {e}")),
            );
            return;
        }
    };
    set_blind(&rule.health, None);
    let (mut in_use, mut young) = (0, 0);
    // Asked once per check, when a mount is about to be released.
    let mut listed: Option<super::engines::Listed> = None;
    for (alloc, volume, path) in &mounts {
        let target = escape(path);
        // The topmost mount at the target path is the published volume.
        let Some(line) = own.iter().rev().find(|l| l.mount_point == target) else {
            // Not mounted (being restored): nothing to judge yet.
            continue;
        };
        if used_by(&users, &line.data) {
            in_use += 1;
            turns.unmark(alloc);
            continue;
        }
        if turns.protected(alloc, volume, rule.min_age) {
            // Its container may not exist yet.
            young += 1;
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
            let listed = listed.get_or_insert_with(|| {
                super::engines::volumes_in_use(&rule.engine_sockets, &rule.driver)
            });
            // Podman starts a container of a volume it counts as mounted
            // with no request to this plugin: only Podman itself can say
            // none of its containers uses it.
            let podman = alloc.starts_with(&format!(
                "{}{}-",
                super::driver::ALLOC_PREFIX,
                super::PODMAN_MOUNT_ID
            ));
            if podman
                && !listed
                    .answered
                    .iter()
                    .any(|p| p.to_string_lossy().contains("podman"))
            {
                in_use += 1;
                log::debug!(
                    "docker: allocation {alloc} is Podman's and Podman's API socket did not answer: kept"
                );
                continue;
            }
            if listed.volumes.contains(volume) {
                in_use += 1;
                log::debug!(
                    "docker: a container of an engine ({}) lists volume {volume}: allocation {alloc} kept",
                    listed
                        .answered
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                continue;
            }
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
        "docker: {} engine mount(s) checked, {in_use} in use by a container, {young} too young or waiting for a Mount ({} running)",
        mounts.len(),
        turns.mounts_running()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(id: &str, device: &str, root: &str, mount_point: &str) -> Line {
        Line {
            id: id.to_string(),
            data: (device.to_string(), root.to_string()),
            mount_point: mount_point.to_string(),
        }
    }

    #[test]
    fn mountinfo_lines_give_id_device_root_and_escaped_mount_point() {
        let text = "36 25 0:32 /vols/db /m/per\\040alloc/t rw,relatime shared:1 - ext4 /dev/sda1 rw\nbad\n";
        assert_eq!(
            parse(text),
            [line("36", "0:32", "/vols/db", "/m/per\\040alloc/t")]
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
        let proc = Path::new("/proc");
        assert!(sees_the_hosts_processes(proc));
        let own_ns = std::fs::read_link("/proc/self/ns/mnt").expect("own namespace");
        let s = scan(proc, &own_ns, &[], "/nowhere/").expect("scanned");
        assert_eq!(s.blind, None);
        // The agent's own mounts outside its mount root count as users.
        let own = [
            line("1", "0:40", "/v", "/m/per-alloc/t"),
            line("2", "0:41", "/w", "/elsewhere"),
        ];
        let s = scan(proc, &own_ns, &own, "/m/").expect("scanned");
        assert!(s.users.contains(&("0:41".to_string(), "/w".to_string())));
        assert!(!s.users.contains(&("0:40".to_string(), "/v".to_string())));
    }

    /// A `/proc` holding kthreadd and the given tasks: (pid, namespace
    /// link or None for one that is refused, mount table or None for one
    /// that cannot be read).
    fn fake_proc(dir: &Path, tasks: &[(&str, Option<&str>, Option<&str>)]) {
        let kthreadd = dir.join("2/task/2");
        std::fs::create_dir_all(kthreadd.join("ns")).expect("mkdir");
        std::fs::write(dir.join("2/status"), "Name:\tkthreadd\nPPid:\t0\n").expect("write");
        std::os::unix::fs::symlink("mnt:[1]", kthreadd.join("ns/mnt")).expect("symlink");
        std::fs::write(kthreadd.join("mountinfo"), "1 0 0:1 / / rw - ext4 x rw\n").expect("write");
        for (pid, ns, table) in tasks {
            let task = dir.join(pid).join("task").join(pid);
            std::fs::create_dir_all(task.join("ns")).expect("mkdir");
            match ns {
                Some(ns) => std::os::unix::fs::symlink(ns, task.join("ns/mnt")).expect("symlink"),
                // Refused (not gone): ENOTDIR stands for EACCES, which
                // root would not get here.
                None => refused(&task.join("ns/mnt")),
            }
            match table {
                Some(t) => std::fs::write(task.join("mountinfo"), t).expect("write"),
                // A table that cannot be read: a directory (EISDIR).
                None => std::fs::create_dir(task.join("mountinfo")).expect("mkdir"),
            }
        }
    }

    /// Makes `read_link(path)` fail with ENOTDIR: its directory is a
    /// regular file.
    fn refused(path: &Path) {
        std::fs::remove_dir(path.parent().expect("ns")).expect("rmdir ns");
        std::fs::write(path.parent().expect("ns"), "").expect("ns as a file");
    }

    #[test]
    fn a_refused_namespace_link_is_judged_by_its_mount_table_and_an_unreadable_table_blinds_the_rule(
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let own = [
            line("21", "0:1", "/", "/"),
            line("50", "0:40", "/vols/db", "/m/a/t"),
        ];
        let own_ns = Path::new("mnt:[9]");
        fake_proc(
            dir.path(),
            &[
                // The agent's own namespace (its root mount 21), link
                // refused: not a user of anything.
                (
                    "10",
                    None,
                    Some(
                        "21 0 0:1 / / rw - ext4 x rw\n50 21 0:40 /vols/db /m/a/t rw - ext4 x rw\n",
                    ),
                ),
                // Another namespace, link refused, binding the volume.
                (
                    "11",
                    None,
                    Some(
                        "70 0 0:1 / / rw - ext4 x rw\n71 70 0:40 /vols/db/sub /c rw - ext4 x rw\n",
                    ),
                ),
            ],
        );
        let s = scan(dir.path(), own_ns, &own, "/m/").expect("scanned");
        assert_eq!(s.blind, None);
        assert!(s.unnamed.is_some());
        assert!(used_by(
            &s.users,
            &("0:40".to_string(), "/vols/db".to_string())
        ));
        assert!(
            !s.users
                .contains(&("0:40".to_string(), "/vols/db".to_string())),
            "the agent's own mount is not a user"
        );

        // A table that cannot be read: nothing is released.
        let dir = tempfile::tempdir().expect("tempdir");
        fake_proc(dir.path(), &[("12", Some("mnt:[5]"), None)]);
        let s = scan(dir.path(), own_ns, &own, "/m/").expect("scanned");
        let why = s.blind.expect("blind");
        assert!(why.contains("12/task/12/mountinfo cannot be read"), "{why}");

        // A task directory that cannot be read: the same.
        let dir = tempfile::tempdir().expect("tempdir");
        fake_proc(dir.path(), &[]);
        std::fs::create_dir(dir.path().join("13")).expect("mkdir");
        std::fs::write(dir.path().join("13/task"), "").expect("task as a file");
        let s = scan(dir.path(), own_ns, &own, "/m/").expect("scanned");
        assert!(s.blind.expect("blind").contains("13/task cannot be read"));
    }

    /// A task that ends between its namespace link and its table leaves
    /// its namespace to the next task in it (before, the namespace counted
    /// as read, and its users went unseen: the review of issue 36).
    #[test]
    fn a_task_gone_before_its_table_leaves_its_namespace_to_the_next_task() {
        let dir = tempfile::tempdir().expect("tempdir");
        let own = [
            line("21", "0:1", "/", "/"),
            line("50", "0:40", "/vols/db", "/m/a/t"),
        ];
        let table = "70 0 0:1 / / rw - ext4 x rw\n71 70 0:40 /vols/db /c rw - ext4 x rw\n";
        fake_proc(
            dir.path(),
            &[
                ("14", Some("mnt:[7]"), Some(table)),
                ("15", Some("mnt:[7]"), Some(table)),
            ],
        );
        for gone in ["14", "15"] {
            let t = dir
                .path()
                .join(gone)
                .join("task")
                .join(gone)
                .join("mountinfo");
            let kept = std::fs::read(&t).expect("read");
            std::fs::remove_file(&t).expect("rm");
            let s = scan(dir.path(), Path::new("mnt:[9]"), &own, "/m/").expect("scanned");
            assert_eq!(s.blind, None);
            assert!(
                used_by(&s.users, &("0:40".to_string(), "/vols/db".to_string())),
                "task {gone} gone: the other task's bind was not seen"
            );
            std::fs::write(&t, kept).expect("write");
        }
    }

    #[test]
    fn the_rules_blindness_is_said_once_and_shown_until_it_sees_again() {
        let health = RuleHealth::default();
        assert_eq!(health.problem(), None);
        set_blind(&health, Some("x cannot be read".into()));
        set_blind(&health, Some("x cannot be read".into()));
        assert_eq!(
            health.problem().as_deref(),
            Some("docker: the engine-death rule releases no engine mount: x cannot be read")
        );
        set_blind(&health, None);
        assert_eq!(health.problem(), None);
    }
}
