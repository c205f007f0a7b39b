//! Shared support for integration tests: waiting with a deadline, the test
//! plugin process, its call log and fault file, and the mount table.
//!
//! Shared by every area: each `tests/<area>/main.rs` declares it as
//! `common`; not every area uses every helper.
#![allow(dead_code)]

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use claimd::csi::CsiClient;
use serde_json::Value;

mod plugin;
pub use plugin::*;

/// How long a plugin may take to listen after it is started.
pub const PLUGIN_START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a plugin may take to exit after a signal.
pub const PLUGIN_EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline of CSI calls made by tests that do not test deadlines.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Polls `cond` until it holds; panics naming `what` if `deadline` passes
/// first. The only place a test waits.
pub fn wait_until(deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    loop {
        if cond() {
            return;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// CLOCK_BOOTTIME in nanoseconds: the clock of the plugin's call log
/// (`start_boottime_ns`, `end_boottime_ns`), the same in every process.
pub fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_BOOTTIME)");
    let secs = u64::try_from(ts.tv_sec).expect("a time after boot");
    let nanos = u64::try_from(ts.tv_nsec).expect("nanoseconds are positive");
    secs * 1_000_000_000 + nanos
}

// ---- Freezing a process (SIGSTOP / SIGCONT) ---------------------------------

/// How long a process may take to show every thread stopped after SIGSTOP
/// (or none stopped after SIGCONT). A loaded machine delays the stop of a
/// thread that is not on a CPU only a little; this bound is for a process
/// that never stops at all.
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

/// The scheduler state of every thread of `pid` (`tid`, the state letter
/// of `/proc/PID/task/TID/stat`). Threads that exit while being read are
/// left out; an error only when the process itself cannot be read.
pub fn thread_states(pid: u32) -> io::Result<Vec<(u32, char)>> {
    let mut states = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/task"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let stat = match fs::read_to_string(entry.path().join("stat")) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        states.push((tid, stat_state(&stat).unwrap_or('?')));
    }
    Ok(states)
}

/// The state letter of a `stat` line: the first field after the command
/// name, which is in parentheses and may itself contain spaces and
/// parentheses (hence the last `)`).
fn stat_state(stat: &str) -> Option<char> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

fn signal_pid(pid: u32, sig: libc::c_int, what: &str) {
    let p = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) on a child the test started and has not reaped.
    let rc = unsafe { libc::kill(p, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}) of {what}: {}",
        io::Error::last_os_error()
    );
}

/// Waits until `done` holds for the states of every thread of `pid`;
/// panics naming `what`, `goal` and the threads that are not there yet.
fn wait_threads(pid: u32, what: &str, goal: &str, done: impl Fn(char) -> bool) {
    let start = Instant::now();
    loop {
        let states = thread_states(pid)
            .unwrap_or_else(|e| panic!("cannot read the threads of {what} (pid {pid}): {e}"));
        let late: Vec<String> = states
            .iter()
            .filter(|(_, s)| !done(*s))
            .map(|(tid, s)| format!("{tid}:{s}"))
            .collect();
        if !states.is_empty() && late.is_empty() {
            return;
        }
        if start.elapsed() >= FREEZE_TIMEOUT {
            panic!(
                "{what} (pid {pid}): {} of {} threads not {goal} after {FREEZE_TIMEOUT:?} \
                 (tid:state {})",
                late.len(),
                states.len(),
                late.join(" ")
            );
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// SIGSTOP, and returns only once every thread of the process is stopped
/// (state `T` in `/proc/PID/task/*/stat`; a zombie thread counts as
/// stopped): from then on the process runs no code at all. The signal
/// alone is not enough: it is delivered to each thread when the scheduler
/// next runs it, and on a loaded machine a test could otherwise make its
/// "frozen" calls while the process still answers.
pub fn freeze(pid: u32, what: &str) {
    signal_pid(pid, libc::SIGSTOP, what);
    wait_threads(pid, what, "stopped", |s| matches!(s, 'T' | 'Z' | 'X'));
}

/// SIGCONT, and returns once no thread of the process is stopped any more
/// (none in state `T`).
pub fn thaw(pid: u32, what: &str) {
    signal_pid(pid, libc::SIGCONT, what);
    wait_threads(pid, what, "running again", |s| s != 'T');
}

/// One gRPC environment (completion-queue threads) for every client in
/// the test process.
pub fn grpc_env() -> Arc<grpcio::Environment> {
    static ENV: OnceLock<Arc<grpcio::Environment>> = OnceLock::new();
    Arc::clone(ENV.get_or_init(|| claimd::csi::grpc_environment("test-grpc")))
}

// ---- A test's directory --------------------------------------------------

/// A temporary directory plus a guard that lazily unmounts everything
/// under it before it is removed, so a failing test never leaks mounts
/// (and never deletes through a leftover bind mount).
pub struct TestDir {
    // Field order is drop order: unmount first, then remove.
    mounts: MountGuard,
    dir: tempfile::TempDir,
}

impl TestDir {
    pub fn new() -> TestDir {
        let dir = tempfile::Builder::new()
            .prefix("claimd-test-")
            .tempdir()
            .expect("create a temporary directory");
        TestDir {
            mounts: MountGuard::new(dir.path()),
            dir,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Creates `<dir>/<rel>` (and its parents) and returns it.
    pub fn mkdir(&self, rel: &str) -> PathBuf {
        let p = self.dir.path().join(rel);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        p
    }
}

/// Lazily unmounts (MNT_DETACH) every mount under a directory on drop,
/// deepest first.
pub struct MountGuard {
    dir: PathBuf,
}

impl MountGuard {
    pub fn new(dir: &Path) -> MountGuard {
        MountGuard {
            dir: fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()),
        }
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        for _ in 0..16 {
            let mut left = mounts_under(&self.dir);
            if left.is_empty() {
                return;
            }
            left.sort_by_key(|m| std::cmp::Reverse(m.mount_point.as_os_str().len()));
            for m in left {
                if let Err(e) = unmount_detach(&m.mount_point) {
                    eprintln!("cleanup: cannot unmount {}: {e}", m.mount_point.display());
                }
            }
        }
        eprintln!("cleanup: mounts left under {}", self.dir.display());
    }
}

fn unmount_detach(path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: a valid NUL-terminated string that outlives the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

// ---- The mount table -----------------------------------------------------

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u64,
    pub parent_id: u64,
    /// `major:minor` of the filesystem.
    pub device: String,
    /// The directory of the filesystem mounted here (for a bind mount, the
    /// source's path inside its filesystem).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options: `ro`/`rw` and the like.
    pub options: String,
    pub fs_type: String,
    pub source: String,
    /// Superblock options.
    pub super_options: String,
}

impl MountEntry {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }

    pub fn has_option(&self, option: &str) -> bool {
        self.options.split(',').any(|o| o == option)
    }
}

/// Undoes the kernel's octal escapes (`\040` is a space).
pub fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(b) = u8::try_from(v) {
                    out.push(b);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn parse_mountinfo_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let l: Vec<&str> = left.split(' ').collect();
    let r: Vec<&str> = right.split(' ').collect();
    if l.len() < 6 || r.len() < 3 {
        return None;
    }
    Some(MountEntry {
        mount_id: l[0].parse().ok()?,
        parent_id: l[1].parse().ok()?,
        device: l[2].to_string(),
        root: PathBuf::from(unescape_mountinfo(l[3])),
        mount_point: PathBuf::from(unescape_mountinfo(l[4])),
        options: l[5].to_string(),
        fs_type: r[0].to_string(),
        source: unescape_mountinfo(r[1]),
        super_options: r[2].to_string(),
    })
}

/// The mount table of this process, in mount order.
pub fn mounts() -> Vec<MountEntry> {
    let text = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    text.lines()
        .map(|l| parse_mountinfo_line(l).unwrap_or_else(|| panic!("bad mountinfo line {l:?}")))
        .collect()
}

fn canonical(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Every mount at `path`, bottom first (more than one means stacked).
pub fn mounts_at(path: &Path) -> Vec<MountEntry> {
    let p = canonical(path);
    mounts()
        .into_iter()
        .filter(|m| m.mount_point == p)
        .collect()
}

/// The topmost mount at `path`.
pub fn mount_at(path: &Path) -> Option<MountEntry> {
    mounts_at(path).pop()
}

pub fn is_mount_point(path: &Path) -> bool {
    !mounts_at(path).is_empty()
}

/// Mounts at or below `dir`.
pub fn mounts_under(dir: &Path) -> Vec<MountEntry> {
    let d = canonical(dir);
    mounts()
        .into_iter()
        .filter(|m| m.mount_point.starts_with(&d))
        .collect()
}

// ---- A child process ----------------------------------------------------

/// A process a test started (the test plugin, the agent): reaped here when
/// it exits, killed on drop. `what` names it in messages.
pub struct ChildProcess {
    child: Option<Child>,
    what: String,
}

impl ChildProcess {
    /// Not started yet.
    pub fn new(what: &str) -> ChildProcess {
        ChildProcess {
            child: None,
            what: what.to_string(),
        }
    }

    /// Starts `cmd`; panics if the process is still running.
    pub fn spawn(&mut self, cmd: &mut Command) {
        assert!(self.child.is_none(), "{} is already running", self.what);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.what));
        self.child = Some(child);
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The exit status, if the process has exited (reaped here).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        match child
            .try_wait()
            .unwrap_or_else(|e| panic!("wait for {}: {e}", self.what))
        {
            Some(status) => {
                self.child = None;
                Some(status)
            }
            None => None,
        }
    }

    /// Waits up to `deadline` for the process to exit on its own.
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        let what = format!("{} to exit", self.what);
        let mut status = None;
        wait_until(deadline, &what, || {
            status = self.try_wait();
            status.is_some()
        });
        status.expect("wait_until returned, so the process exited")
    }

    /// SIGSTOP, returning once every thread is stopped (`freeze`).
    pub fn freeze(&self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.what));
        freeze(pid, &self.what);
    }

    /// SIGCONT, returning once no thread is stopped (`thaw`).
    pub fn thaw(&self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.what));
        thaw(pid, &self.what);
    }

    /// SIGKILL, like a crash; reaps the process.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `timeout` until `socket` accepts a connection; panics
    /// with `log()` if the process exits first.
    pub fn wait_listening(&mut self, socket: &Path, timeout: Duration, log: impl Fn() -> String) {
        let pid = self
            .pid()
            .map_or("not running".into(), |p| format!("pid {p}"));
        let what = format!("{} ({pid}) to listen on {}", self.what, socket.display());
        wait_until(timeout, &what, || {
            if let Some(status) = self.try_wait() {
                panic!(
                    "{} exited with {status} before listening:\n{}",
                    self.what,
                    log()
                );
            }
            UnixStream::connect(socket).is_ok()
        });
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A process's log file so far (empty if there is none yet).
pub fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

// ---- Call log and fault file ---------------------------------------------

/// Reads the plugin's call log (JSON lines; the format is in the plugin's
/// `call_log.rs` and `--help`).
pub struct CallLog {
    pub path: PathBuf,
}

impl CallLog {
    /// Every line, start and end lines alike, in the order written.
    pub fn lines(&self) -> Vec<Value> {
        let text = match fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => panic!("read call log {}: {e}", self.path.display()),
        };
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("call log line {l:?}: {e}")))
            .collect()
    }

    /// Every call that ended so far (its end line, with `code`), in the
    /// order they ended.
    pub fn calls(&self) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["event"] != "start")
            .collect()
    }

    /// The start lines (`--log-starts`), in the order the calls started.
    pub fn starts(&self) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["event"] == "start")
            .collect()
    }

    /// The calls that started and have not ended (yet): their start lines.
    pub fn open_calls(&self) -> Vec<Value> {
        let lines = self.lines();
        let ended: std::collections::HashSet<&str> = lines
            .iter()
            .filter(|l| l["event"] != "start")
            .filter_map(|l| l["call_id"].as_str())
            .collect();
        lines
            .iter()
            .filter(|l| l["event"] == "start")
            .filter(|l| !l["call_id"].as_str().is_some_and(|id| ended.contains(id)))
            .cloned()
            .collect()
    }

    /// The calls of one method.
    pub fn calls_of(&self, method: &str) -> Vec<Value> {
        self.calls()
            .into_iter()
            .filter(|c| c["method"] == method)
            .collect()
    }

    /// The method names, in order.
    pub fn methods(&self) -> Vec<String> {
        self.calls()
            .iter()
            .map(|c| {
                c["method"]
                    .as_str()
                    .expect("method is a string")
                    .to_string()
            })
            .collect()
    }

    /// `(method, code)` pairs, in order.
    pub fn methods_and_codes(&self) -> Vec<(String, String)> {
        self.calls()
            .iter()
            .map(|c| {
                (
                    c["method"].as_str().expect("method").to_string(),
                    c["code"].as_str().expect("code").to_string(),
                )
            })
            .collect()
    }

    /// The raw file, for "this never appears" checks.
    pub fn raw(&self) -> String {
        fs::read_to_string(&self.path).unwrap_or_default()
    }
}

/// Writes the plugin's fault file.
pub struct Faults {
    pub path: PathBuf,
}

impl Faults {
    /// Replaces the rules (a JSON array), atomically.
    pub fn set(&self, rules: Value) {
        assert!(rules.is_array(), "fault rules are a JSON array");
        let text = serde_json::to_vec_pretty(&serde_json::json!({ "rules": rules }))
            .expect("encode fault rules");
        self.write_raw(&text);
    }

    /// Writes the file verbatim (for malformed-file tests), atomically.
    pub fn write_raw(&self, bytes: &[u8]) {
        let tmp = self.path.with_extension("json.tmp");
        fs::write(&tmp, bytes).expect("write fault file");
        fs::rename(&tmp, &self.path).expect("rename fault file");
    }

    pub fn clear(&self) {
        match fs::remove_file(&self.path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => panic!("remove fault file: {e}"),
            _ => {}
        }
    }

    /// The rules now in the file (as the plugin left them).
    pub fn rules(&self) -> Vec<Value> {
        match fs::read_to_string(&self.path) {
            Ok(t) => {
                let v: Value = serde_json::from_str(&t).expect("fault file is JSON");
                v["rules"].as_array().cloned().unwrap_or_default()
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("read fault file: {e}"),
        }
    }
}
