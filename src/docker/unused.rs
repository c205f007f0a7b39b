//! The engine-death rule: an engine that dies (or is killed) with its
//! containers never sends their Unmounts, and their claims would stay held
//! for good. Thread `docker-unused` looks every `unused_check_interval` at
//! each engine mount of this node (allocations `docker-*`, published) and
//! asks whether any process outside the agent's own mount namespace still
//! has that volume's data mounted: a container's namespace holds a bind
//! mount of it (the same device and root in its mountinfo). A mount that
//! no other namespace holds at two checks in a row is released with every
//! reference it counts (the engine that would have unmounted them is
//! gone). A Mount of the allocation between two checks clears its mark,
//! and the decision is made in the allocation's turn (`references`), so a
//! Mount adding a reference and the rule never cross.
//!
//! Conservative by design: a volume is in use while any other namespace
//! holds any of its data (a second container, a copy of the host's mounts
//! in a service's private namespace), so a mount in use is never
//! released; one that is not may be kept a while longer. Two checks in a
//! row leave a container a whole interval between Mount and its start.

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
        while stop.sleep(interval) {
            check(&lifecycle, &turns);
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

/// The data mounted in every mount namespace but this process's own.
fn data_in_other_namespaces() -> std::io::Result<HashSet<Data>> {
    let own = std::fs::read_link("/proc/self/ns/mnt")?;
    let mut seen = HashSet::new();
    let mut data = HashSet::new();
    for e in std::fs::read_dir("/proc")? {
        let Ok(e) = e else { continue };
        let pid = e.file_name();
        if !pid.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // Processes come and go while we read: skip the ones gone.
        let Ok(ns) = std::fs::read_link(e.path().join("ns/mnt")) else {
            continue;
        };
        if ns == own || !seen.insert(ns) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(e.path().join("mountinfo")) else {
            continue;
        };
        data.extend(parse(&text).into_iter().map(|(d, _)| d));
    }
    Ok(data)
}

fn check(lifecycle: &Lifecycle, turns: &Turns) {
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
    let (own, others) = match (
        std::fs::read_to_string(crate::mounts::MOUNTINFO),
        data_in_other_namespaces(),
    ) {
        (Ok(own), Ok(others)) => (parse(&own), others),
        (Err(e), _) | (_, Err(e)) => {
            log::warn!("docker: cannot tell which mounts containers use: {e}");
            return;
        }
    };
    let mut in_use = 0;
    for (alloc, path) in &mounts {
        let target = escape(path);
        // The topmost mount at the target path is the published volume.
        let Some((data, _)) = own.iter().rev().find(|(_, mp)| *mp == target) else {
            // Not mounted (being restored): nothing to judge yet.
            continue;
        };
        if others.contains(data) {
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
    fn other_namespaces_can_be_read() {
        // In one namespace only (no container here) the set may be empty,
        // but reading it works as root and as anyone.
        assert!(data_in_other_namespaces().is_ok());
    }
}
