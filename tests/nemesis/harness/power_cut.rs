//! A power cut of one agent: SIGKILL, and its state directory left as a
//! power cut at that moment may leave it, losing only what the design
//! (DESIGN.md section 4, `src/state/`, `src/claims/fencing.rs`) allows to
//! lose. Nothing acknowledged as durable is ever taken away: that is not a
//! fault an agent has to survive.
//!
//! What may be lost, and how it is chosen here:
//!
//! - **The journal's unsynced tail.** Each durable change appends one line
//!   to `state.journal` and fdatasyncs it under the journal's lock, and no
//!   caller acts on the change (answers, calls its plugin, lets another
//!   change in) before that fdatasync returns (`state/group_commit.rs`).
//!   So at any moment at most the last line is not yet durable, and only
//!   while its writer is inside that `write(2)` or `fdatasync(2)`. The cut
//!   waits (up to a seed-chosen time) for the journal to change (inotify),
//!   SIGSTOPs the agent at once, waits until `/proc` shows every thread
//!   stopped, and reads each thread's `/proc/PID/task/TID/syscall`: a
//!   thread stopped inside `write`/`fdatasync` on the journal's file
//!   descriptor has not returned to user space since (a stopped thread's
//!   registers are those of its last entry into the kernel), so nothing
//!   depended on its line. Only then is that line lost: cut off cleanly,
//!   or torn (a prefix of it kept, unterminated), or replaced by zeros (a
//!   size update that reached the disk without its data), as the seed
//!   says. The journal reader (`state/journal.rs`) must take a torn or
//!   zeroed last line as never acknowledged; damage before the last line
//!   is corruption that stops the agent, and is never made here. With no
//!   write caught in flight the journal is left whole (the kill then loses
//!   nothing of it: honest, and said in the event as `caught: none`).
//!   Once closing writes are group-committed after the answer (DESIGN.md
//!   section 4), a closing write caught in flight is lost the same way,
//!   which is then a loss the design allows after an answer.
//! - **lease-clock.json updates.** The file keeps the send time of the
//!   last answered keep-alive; the agent reads it only to know how long
//!   the cluster cannot have freed its claims, and an older time only
//!   makes that deadline earlier. With a seed-chosen chance the copy taken
//!   a seed-chosen time before the cut is put back (all updates since then
//!   lost).

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::nodes::{all_threads_stopped, Node};
use super::rng::Rng;
use super::workload::Shared;
use crate::agent_support::send_signal;
use crate::common::wait_until;

const JOURNAL: &str = "state.journal";
const LEASE_CLOCK: &str = "lease-clock.json";
/// How long a SIGSTOPped agent may take to show every thread stopped.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// x86_64 system call numbers that write or sync a file.
const SYS_WRITE: i64 = 1;
const SYS_PWRITE64: i64 = 18;
const SYS_WRITEV: i64 = 20;
const SYS_FSYNC: i64 = 74;
const SYS_FDATASYNC: i64 = 75;

/// How a lost journal tail looks after the cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Gone: the file ends at the last durable line.
    Clean,
    /// A prefix of the line kept, unterminated.
    Torn,
    /// As many zero bytes as the line had.
    Zeros,
}

/// The seed's choices for one power cut.
#[derive(Clone, Copy, Debug)]
pub struct LossPlan {
    /// How long before the cut the lease clock is copied.
    pub clock_age_ms: u64,
    /// How long the cut waits for a journal write to catch in flight.
    pub catch_ms: u64,
    pub shape: Shape,
    /// Chooses how much of a torn line is kept.
    pub keep: u64,
    /// Whether the older lease clock is put back.
    pub set_back_clock: bool,
}

impl LossPlan {
    pub fn from_draw(r: u64) -> LossPlan {
        let mut g = Rng::new(r);
        LossPlan {
            clock_age_ms: g.range(0, 2000),
            catch_ms: g.range(300, 2500),
            shape: [Shape::Clean, Shape::Torn, Shape::Zeros][g.index(3)],
            keep: g.next_u64(),
            set_back_clock: g.chance(75),
        }
    }
}

fn state_dir(n: &Node) -> PathBuf {
    n.agent.config.state_dir.clone()
}

/// The node's lease clock file now, if it has one.
pub fn read_lease_clock(n: &Node) -> Option<Vec<u8>> {
    fs::read(state_dir(n).join(LEASE_CLOCK)).ok()
}

fn sent_ms(bytes: &[u8]) -> Option<i64> {
    serde_json::from_slice::<Value>(bytes).ok()?["sent_boottime_ms"].as_i64()
}

/// Waits until `until` for a change of the journal in `dir` (inotify);
/// whether one came.
fn wait_for_journal_write(dir: &Path, until: Instant) -> bool {
    // SAFETY: plain inotify calls on a descriptor owned here and closed
    // below; the buffer outlives every read into it.
    unsafe {
        let fd = libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK);
        if fd < 0 {
            return false;
        }
        let path = CString::new(dir.as_os_str().as_bytes()).expect("no NUL in a path");
        let caught = if libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_MODIFY) < 0 {
            false
        } else {
            let mut buf = [0u8; 4096];
            let mut caught = false;
            while !caught {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
                if libc::poll(&mut pfd, 1, ms) <= 0 {
                    continue;
                }
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                let Ok(n) = usize::try_from(n) else { continue };
                let mut off = 0;
                // struct inotify_event: wd, mask, cookie, len, name[len].
                while off + 16 <= n {
                    let len = u32::from_ne_bytes(buf[off + 12..off + 16].try_into().expect("4"));
                    let len = usize::try_from(len).expect("fits");
                    let name = &buf[off + 16..(off + 16 + len).min(n)];
                    let name = name.split(|&b| b == 0).next().unwrap_or_default();
                    caught |= name == JOURNAL.as_bytes();
                    off += 16 + len;
                }
            }
            caught
        };
        libc::close(fd);
        caught
    }
}

/// What a stopped thread is inside: (system call number, first argument).
fn syscall_of(task: &Path) -> Option<(i64, u64)> {
    let text = fs::read_to_string(task.join("syscall")).ok()?;
    let mut f = text.split_whitespace();
    let nr: i64 = f.next()?.parse().ok()?;
    let arg = f
        .next()
        .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
        .unwrap_or(u64::MAX);
    Some((nr, arg))
}

/// The thread of `pid` stopped inside a write or sync of the journal, if
/// any: "write" or "fdatasync" (or "fsync").
fn journal_call_in_flight(pid: u32, journal: &Path) -> Option<&'static str> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for t in tasks.flatten() {
        let Some((nr, fd)) = syscall_of(&t.path()) else {
            continue;
        };
        let what = match nr {
            SYS_WRITE | SYS_PWRITE64 | SYS_WRITEV => "write",
            SYS_FDATASYNC => "fdatasync",
            SYS_FSYNC => "fsync",
            _ => continue,
        };
        let Ok(target) = fs::read_link(format!("/proc/{pid}/fd/{fd}")) else {
            continue;
        };
        if target == journal || fs::canonicalize(journal).is_ok_and(|j| j == target) {
            return Some(what);
        }
    }
    None
}

/// Cuts the journal's unsynced tail as `plan` says: the last line when its
/// fdatasync was in flight, the unterminated part when its write was.
/// Returns (bytes lost, bytes of it kept torn or zeroed, the lost bytes).
fn lose_tail(
    journal: &Path,
    in_write: bool,
    plan: &LossPlan,
) -> std::io::Result<(usize, usize, String)> {
    let bytes = fs::read(journal)?;
    let ends_whole = bytes.last() == Some(&b'\n');
    let boundary = if in_write || !ends_whole {
        // Everything up to the last newline was written (and synced) by
        // earlier writers; the partial rest is the write in flight.
        bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)
    } else {
        // The last line is whole and its fdatasync in flight.
        bytes[..bytes.len() - 1]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1)
    };
    let lost = bytes.len() - boundary;
    if lost == 0 {
        return Ok((0, 0, String::new()));
    }
    let tail: Vec<u8> = match plan.shape {
        Shape::Clean => Vec::new(),
        // 1..lost bytes of the line, never its newline.
        Shape::Torn => {
            let whole = &bytes[boundary..];
            let max = whole.len() - usize::from(whole.last() == Some(&b'\n'));
            if max <= 1 {
                Vec::new()
            } else {
                let keep = 1 + usize::try_from(plan.keep % (max as u64 - 1)).expect("fits");
                whole[..keep].to_vec()
            }
        }
        Shape::Zeros => vec![0u8; lost],
    };
    let f = fs::OpenOptions::new().write(true).open(journal)?;
    f.set_len(boundary as u64)?;
    drop(f);
    let mut f = fs::OpenOptions::new().append(true).open(journal)?;
    f.write_all(&tail)?;
    f.sync_all()?;
    let text = String::from_utf8_lossy(&bytes[boundary..]).into_owned();
    Ok((lost, tail.len(), text))
}

/// The power cut: see the module documentation. `older`: the lease clock
/// copied earlier; `next_due`: the catch never waits past it (another
/// fault's step). Returns what was done, for the event.
pub fn cut(
    shared: &Shared,
    n: &mut Node,
    plan: &LossPlan,
    older: Option<Vec<u8>>,
    next_due: Option<Instant>,
) -> Value {
    let dir = state_dir(n);
    let journal = dir.join(JOURNAL);
    let pid = n.pid().expect("the agent runs");
    let start = Instant::now();
    let mut until = start + Duration::from_millis(plan.catch_ms);
    if let Some(d) = next_due {
        until = until.min(d);
    }
    let wrote = wait_for_journal_write(&dir, until);
    send_signal(pid, libc::SIGSTOP);
    wait_until(STOP_TIMEOUT, "every thread of the agent to stop", || {
        all_threads_stopped(pid)
    });
    let caught = journal_call_in_flight(pid, &journal);
    let stopped_ms = shared.since_ms();
    n.agent.kill();
    let mut report = json!({
        "waited_ms": start.elapsed().as_millis(),
        "journal_changed": wrote,
        "caught": caught.unwrap_or("none"),
        "stopped_ms": stopped_ms,
        "journal_bytes_lost": 0,
        "journal_bytes_left": 0,
        "shape": null,
        "lease_clock_set_back_ms": null,
    });
    if let Some(what) = caught {
        match lose_tail(&journal, what == "write", plan) {
            Ok((lost, left, text)) => {
                report["journal_bytes_lost"] = json!(lost);
                report["journal_bytes_left"] = json!(left);
                if lost > 0 {
                    report["shape"] = json!(format!("{:?}", plan.shape).to_lowercase());
                    report["lost"] = json!(text);
                }
            }
            Err(e) => report["error"] = json!(format!("cut the journal's tail: {e}")),
        }
    }
    let path = dir.join(LEASE_CLOCK);
    if let (true, Some(old)) = (plan.set_back_clock, older) {
        let now = fs::read(&path).ok();
        let back = match (now.as_deref().and_then(sent_ms), sent_ms(&old)) {
            (Some(a), Some(b)) => a - b,
            _ => 0,
        };
        if back > 0 {
            let tmp = dir.join(format!("{LEASE_CLOCK}.nemesis"));
            match fs::write(&tmp, &old).and_then(|()| fs::rename(&tmp, &path)) {
                Ok(()) => report["lease_clock_set_back_ms"] = json!(back),
                Err(e) => report["error"] = json!(format!("set the lease clock back: {e}")),
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use claimd::state::journal::{encode, parse, Delta};

    fn line(i: usize) -> Vec<u8> {
        encode(&Delta {
            boot_id: Some(format!("boot-{i}")),
            ..Delta::default()
        })
        .expect("encode")
    }

    /// Every loss a power cut makes reads back as the journal's durable
    /// lines (the lost one as a torn tail or not at all), never as
    /// corruption, and a write caught before any of its bytes loses
    /// nothing.
    #[test]
    fn a_lost_tail_reads_back_as_torn_or_clean_never_as_corruption() {
        let dir = std::env::temp_dir().join(format!("nemesis-power-cut-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("a temporary directory");
        let path = dir.join(JOURNAL);
        let whole: Vec<u8> = (0..3).flat_map(line).collect();
        let two = line(0).len() + line(1).len();
        for (shape, keep) in [Shape::Clean, Shape::Torn, Shape::Zeros]
            .into_iter()
            .flat_map(|s| (0..40u64).map(move |k| (s, k)))
        {
            let plan = LossPlan {
                clock_age_ms: 0,
                catch_ms: 0,
                shape,
                keep,
                set_back_clock: false,
            };
            // Caught in fdatasync: the last whole line goes.
            fs::write(&path, &whole).expect("write");
            let (lost, left, _) = lose_tail(&path, false, &plan).expect("cut");
            assert_eq!(lost, whole.len() - two, "{shape:?}");
            let r = parse(&fs::read(&path).expect("read")).expect("no corruption");
            assert_eq!(r.deltas.len(), 2, "{shape:?} keep {keep}");
            assert_eq!(r.torn_tail, left > 0, "{shape:?} keep {keep}");
            assert!(
                shape == Shape::Clean || left > 0,
                "{shape:?} keeps something"
            );
            // Caught in write, part of the third line written: that part goes.
            let part = two + 1 + usize::try_from(keep).expect("fits") % (whole.len() - two - 1);
            fs::write(&path, &whole[..part]).expect("write");
            let (lost, _, _) = lose_tail(&path, true, &plan).expect("cut");
            assert_eq!(lost, part - two);
            assert_eq!(
                parse(&fs::read(&path).expect("read"))
                    .expect("no corruption")
                    .deltas
                    .len(),
                2
            );
            // Caught in write before any byte of its line: nothing goes.
            fs::write(&path, &whole).expect("write");
            assert_eq!(lose_tail(&path, true, &plan).expect("cut").0, 0);
            assert_eq!(fs::read(&path).expect("read"), whole);
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
