//! The docker area's harness: real container engines from Debian's
//! packages (installed when missing), each started by the test with its
//! own data and run directories, and a busybox image made with `import`
//! (there is no registry here).
//!
//! Declared in tests/docker/main.rs as `harness`, next to the shared
//! `common`, `agent_support` and `etcd_support` (tests/support/).
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::agent_support::send_signal;
use crate::common::*;

mod world;
pub use world::*;

/// The image every test container runs: busybox-static's busybox and its
/// links, `PATH=/bin`.
pub const IMAGE: &str = "claimd-test-busybox:1";
/// How long one engine command may run before the test calls it hung.
pub const ENGINE_COMMAND_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a daemon may take to answer after it is started.
pub const DAEMON_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a daemon may take to stop after SIGTERM.
pub const DAEMON_STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// The flags every container runs with: no network here, and Podman's
/// runc cannot raise these limits in this sandbox.
pub const RUN_FLAGS: [&str; 6] = [
    "--network",
    "none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// Installs docker.io, podman, runc and busybox-static when one is
/// missing (once per test process), as tests/run.sh does.
pub fn ensure_engines() {
    static DONE: OnceLock<()> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().expect("install lock");
    DONE.get_or_init(|| {
        let have = |p: &str| Path::new(p).exists();
        let busybox_static = Command::new("dpkg")
            .args(["-s", "busybox-static"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if have("/usr/sbin/dockerd")
            && have("/usr/bin/podman")
            && have("/usr/sbin/runc")
            && busybox_static
        {
            return;
        }
        let install = || {
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(["docker.io", "podman", "runc", "busybox-static"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .is_ok_and(|s| s.success())
        };
        if !install() {
            let _ = Command::new("apt-get").args(["update", "-qq"]).status();
            assert!(
                install(),
                "apt-get install docker.io podman runc busybox-static failed"
            );
        }
    });
}

/// What an engine command did.
#[derive(Clone, Debug)]
pub struct Out {
    pub args: String,
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn ok(self) -> Out {
        assert_eq!(
            self.code, 0,
            "`{}` failed ({}):\nstdout:\n{}\nstderr:\n{}",
            self.args, self.code, self.stdout, self.stderr
        );
        self
    }

    /// Panics unless the command failed; answers its output.
    pub fn failed(self) -> Out {
        assert_ne!(
            self.code, 0,
            "`{}` succeeded, and should not have:\n{}",
            self.args, self.stdout
        );
        self
    }

    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `program args` with `envs`, killed after ENGINE_COMMAND_TIMEOUT.
pub fn run(program: &str, args: &[&str], envs: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new("timeout");
    cmd.arg("--kill-after=5")
        .arg(ENGINE_COMMAND_TIMEOUT.as_secs().to_string())
        .arg(program)
        .args(args)
        .stdin(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    Out {
        args: format!("{program} {}", args.join(" ")),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A rootfs tar under `dir`: `/bin/busybox` and a relative link per applet.
pub fn image_tar(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    let bin = root.join("bin");
    fs::create_dir_all(&bin).expect("create the rootfs");
    fs::copy("/bin/busybox", bin.join("busybox")).expect("copy busybox-static's busybox");
    let list = run("/bin/busybox", &["--list"], &[]).ok().stdout;
    for applet in list.lines().filter(|a| !a.is_empty() && *a != "busybox") {
        symlink("busybox", bin.join(applet)).expect("link an applet");
    }
    let tar = dir.join("image.tar");
    let (root_s, tar_s) = (root.to_str().expect("UTF-8"), tar.to_str().expect("UTF-8"));
    run("tar", &["-C", root_s, "-cf", tar_s, "."], &[]).ok();
    tar
}

/// A throwaway dockerd with its own data root, exec root, pidfile and
/// socket; its containers are removed and it is stopped on drop.
pub struct Dockerd {
    pub dir: PathBuf,
    pub host: String,
    pub log: PathBuf,
    process: ChildProcess,
}

impl Dockerd {
    /// Starts dockerd in `<dir>/docker` and imports IMAGE.
    pub fn start(dir: &Path) -> Dockerd {
        ensure_engines();
        let dir = dir.join("docker");
        fs::create_dir_all(&dir).expect("create the dockerd directory");
        let log = dir.join("dockerd.log");
        let socket = dir.join("docker.sock");
        let host = format!("unix://{}", socket.display());
        let mut d = Dockerd {
            dir: dir.clone(),
            host,
            log,
            process: ChildProcess::new("dockerd"),
        };
        d.spawn();
        let tar = image_tar(&dir);
        let tar = tar.to_str().expect("UTF-8");
        d.docker(&["import", "-c", "ENV PATH=/bin", tar, IMAGE])
            .ok();
        d
    }

    /// Starts the daemon process and waits until it answers.
    fn spawn(&mut self) {
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open dockerd's log");
        let dir = &self.dir;
        self.process.spawn(
            Command::new("dockerd")
                .arg("--data-root")
                .arg(dir.join("data"))
                .arg("--exec-root")
                .arg(dir.join("exec"))
                .arg("--pidfile")
                .arg(dir.join("dockerd.pid"))
                .args(["-H", &self.host])
                .args(["--iptables=false", "--ip6tables=false", "--bridge=none"])
                .arg("--storage-driver=vfs")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr),
        );
        let socket = dir.join("docker.sock");
        wait_until(DAEMON_START_TIMEOUT, "dockerd's socket", || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        wait_until(DAEMON_START_TIMEOUT, "dockerd to answer", || {
            self.docker(&["version", "--format", "{{.Server.Version}}"])
                .code
                == 0
        });
    }

    /// Stops the daemon (SIGTERM, as `systemctl restart` does) and starts
    /// it again on the same directories: its volumes and containers stay.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// SIGTERM, then SIGKILL after DAEMON_STOP_TIMEOUT.
    fn stop(&mut self) {
        if let Some(pid) = self.process.pid() {
            send_signal(pid, libc::SIGTERM);
            let deadline = std::time::Instant::now() + DAEMON_STOP_TIMEOUT;
            while std::time::Instant::now() < deadline && self.process.try_wait().is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.process.kill();
    }

    /// `docker ARGS` against this daemon.
    pub fn docker(&self, args: &[&str]) -> Out {
        run("docker", args, &[("DOCKER_HOST", &self.host)])
    }

    /// `docker run --rm RUN_FLAGS -v VOLUME:/data --volume-driver DRIVER
    /// IMAGE sh -c SCRIPT`.
    pub fn run_with(&self, driver: &str, volume: &str, script: &str) -> Out {
        let spec = format!("{volume}:/data");
        let mut args = vec!["run", "--rm"];
        args.extend(RUN_FLAGS);
        args.extend([
            "-v",
            &spec,
            "--volume-driver",
            driver,
            IMAGE,
            "sh",
            "-c",
            script,
        ]);
        self.docker(&args)
    }

    /// The same, detached, as container `name`.
    pub fn start_container(&self, name: &str, driver: &str, volume: &str, script: &str) -> Out {
        let spec = format!("{volume}:/data");
        let mut args = vec!["run", "-d", "--name", name];
        args.extend(RUN_FLAGS);
        args.extend([
            "-v",
            &spec,
            "--volume-driver",
            driver,
            IMAGE,
            "sh",
            "-c",
            script,
        ]);
        self.docker(&args)
    }

    /// SIGKILL to dockerd, as a crash (its containers' shims stay).
    pub fn kill_daemon(&mut self) {
        self.process.kill();
    }

    pub fn log_text(&self) -> String {
        read_log(&self.log)
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = self.docker(&["ps", "-aq"]).stdout;
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let mut args = vec!["rm", "-f"];
            args.extend(ids);
            let _ = self.docker(&args);
        }
        self.stop();
        // A daemon that was killed leaves its containers' shims behind.
        kill_processes_naming(&self.dir);
        if std::thread::panicking() {
            eprintln!("---- dockerd log ----\n{}", self.log_text());
        }
    }
}

/// Podman with its own storage, run directory and containers.conf (runc,
/// the volume plugin's socket); its containers are removed on drop.
pub struct Podman {
    pub dir: PathBuf,
    conf: PathBuf,
    global: Vec<String>,
}

impl Podman {
    /// Podman in `<dir>/podman`, with plugin `driver` at `socket`, and
    /// IMAGE imported.
    pub fn new(dir: &Path, driver: &str, socket: &Path) -> Podman {
        ensure_engines();
        let dir = dir.join("podman");
        fs::create_dir_all(&dir).expect("create the podman directory");
        let conf = dir.join("containers.conf");
        // Podman waits 5 s for a volume plugin by default; a mount may wait
        // longer for a claim (docker.mount_timeout).
        fs::write(
            &conf,
            format!(
                "[engine]\nruntime = \"/usr/sbin/runc\"\nvolume_plugin_timeout = 120\n\n[engine.volume_plugins]\n{driver} = \"{}\"\n",
                socket.display()
            ),
        )
        .expect("write containers.conf");
        let p = |s: &str| dir.join(s).to_string_lossy().into_owned();
        let global = vec![
            "--root".to_string(),
            p("root"),
            "--runroot".into(),
            p("run"),
            "--tmpdir".into(),
            p("tmp"),
            "--storage-driver".into(),
            "vfs".into(),
            "--cgroup-manager".into(),
            "cgroupfs".into(),
            "--events-backend".into(),
            "file".into(),
        ];
        let podman = Podman { dir, conf, global };
        let tar = image_tar(&podman.dir);
        let tar = tar.to_str().expect("UTF-8");
        podman
            .podman(&["import", "-c", "ENV PATH=/bin", tar, IMAGE])
            .ok();
        podman
    }

    pub fn podman(&self, args: &[&str]) -> Out {
        let mut all: Vec<&str> = self.global.iter().map(String::as_str).collect();
        all.extend(args);
        let conf = self.conf.to_str().expect("UTF-8");
        run("podman", &all, &[("CONTAINERS_CONF", conf)])
    }

    /// `podman run --rm RUN_FLAGS -v VOLUME:/data IMAGE sh -c SCRIPT`.
    pub fn run_with(&self, volume: &str, script: &str) -> Out {
        let spec = format!("{volume}:/data");
        let mut args = vec!["run", "--rm"];
        args.extend(RUN_FLAGS);
        args.extend(["-v", &spec, IMAGE, "sh", "-c", script]);
        self.podman(&args)
    }

    /// The same, detached, as container `name`.
    pub fn start_container(&self, name: &str, volume: &str, script: &str) -> Out {
        let spec = format!("{volume}:/data");
        let mut args = vec!["run", "-d", "--name", name];
        args.extend(RUN_FLAGS);
        args.extend(["-v", &spec, IMAGE, "sh", "-c", script]);
        self.podman(&args)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.podman(&["rm", "-f", "-a"]);
    }
}

/// One request of the plugin protocol on `socket`, as the engines send it:
/// the HTTP status and the JSON answer.
pub fn post(socket: &Path, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connect to {}: {e}", socket.display()));
    s.set_read_timeout(Some(ENGINE_COMMAND_TIMEOUT))
        .expect("read timeout");
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: plugin\r\nContent-Type: application/vnd.docker.plugins.v1.2+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read the answer");
    let code = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let (_, json) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no body: {answer:?}"));
    let json = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json:?}"));
    (code, json)
}

/// SIGKILL to every process whose command line names `dir` (what a daemon
/// started there and left behind).
pub fn kill_processes_naming(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) && pid != std::process::id() {
            send_signal(pid, libc::SIGKILL);
        }
    }
}
