//! Stopping everything when the bench cannot: a panic hook and a signal
//! handler.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::support::proc_status;

/// On a panic (the release build aborts: no destructor runs) or SIGINT,
/// SIGTERM or SIGHUP: SIGKILL this process's children that run under the
/// scratch directory, lazily unmount everything under it and remove it.
/// The normal path stops everything through `Node` and `Scratch` drops.
pub(super) fn install_cleanup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if STOPPING.load(Ordering::SeqCst) {
                // Calls failing because the signal handler is stopping
                // everything: it exits when done; aborting here would cut
                // it short.
                loop {
                    std::thread::park();
                }
            }
            previous(info);
            emergency_cleanup();
        }));
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(mut signals) => {
                let spawned = std::thread::Builder::new()
                    .name("scale-signals".into())
                    .spawn(move || {
                        if let Some(sig) = signals.forever().next() {
                            STOPPING.store(true, Ordering::SeqCst);
                            eprintln!("scale: signal {sig}: stopping every agent, plugin and etcd");
                            emergency_cleanup();
                            std::process::exit(128 + sig);
                        }
                    });
                if let Err(e) = spawned {
                    eprintln!("scale: no signal handler thread: {e}");
                }
            }
            Err(e) => eprintln!("scale: no signal handler: {e}"),
        }
    });
}

/// Set once a signal handler is stopping everything.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// The scratch directory of the N being measured.
static SCRATCH: parking_lot::Mutex<Option<PathBuf>> = parking_lot::const_mutex(None);

/// Makes `dir` the directory whose processes and mounts the guard clears.
pub(super) fn watch(dir: &Path) {
    *SCRATCH.lock() = Some(dir.to_path_buf());
}

fn emergency_cleanup() {
    // A panic while the lock is held (it never is for long) leaves the
    // children to their parent-death signal.
    let Some(dir) = SCRATCH
        .try_lock_for(Duration::from_secs(1))
        .and_then(|d| d.clone())
    else {
        return;
    };
    let needle = dir.to_string_lossy().into_owned();
    let me = u64::from(std::process::id());
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .collect()
        })
        .unwrap_or_default();
    for pid in pids {
        // Only children (not yet reaped: their PIDs cannot be reused) that
        // run under the scratch directory.
        if proc_status(pid, "PPid:") != me {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            // SAFETY: kill(2) on a child of this process.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
    unmount_under(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `umount -l` of every mount under `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let mut left: Vec<PathBuf> = claimd::mounts::mounts()
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    left.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in left {
        let _ = Command::new("umount").arg("-l").arg(&p).status();
    }
}
