//! A throwaway etcd member for tests: Debian's `etcd` (package
//! `etcd-server`; tests/run.sh installs it) on free loopback ports with a
//! temporary data directory, killed when the guard is dropped. A default
//! instance (port 2379, /var/lib/etcd) is never used or touched.
//!
//! Declared as `etcd_support` by the areas that need etcd (cluster,
//! docker), next to `common` (whose `freeze` and `thaw` it uses).
#![allow(dead_code)]

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use claimd::etcd::{ClientIdentity, EtcdClient, EtcdOptions, TlsOptions};

/// The etcd binary; `CLAIMD_TEST_ETCD` overrides it.
pub fn etcd_binary() -> PathBuf {
    std::env::var_os("CLAIMD_TEST_ETCD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"))
}

/// How long a member may take to answer after it is started.
pub const ETCD_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Call deadline of the clients tests use when they do not test deadlines.
pub const TEST_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A port nobody listens on right now (the kernel's choice).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral loopback port")
        .port()
}

/// TLS on a member's client URL (`Etcd::start_tls`): its certificate and
/// key, the CA that signed them (and the client certificates), and whether
/// it asks clients for a certificate. PEM files.
#[derive(Clone, Debug)]
pub struct EtcdTls {
    /// The CA that signed `cert` (and the client certificates).
    pub ca: PathBuf,
    /// The member's certificate (for 127.0.0.1) and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// `--client-cert-auth` (and `--trusted-ca-file` with `ca`), with this
    /// identity for the harness's own clients; `None`: any client that
    /// trusts the CA is served.
    pub client: Option<ClientIdentity>,
}

impl EtcdTls {
    /// The client settings of the harness's own clients.
    pub fn client_options(&self) -> TlsOptions {
        TlsOptions {
            ca: self.ca.clone(),
            identity: self.client.clone(),
        }
    }
}

/// One etcd member, killed on drop.
pub struct Etcd {
    child: Option<Child>,
    // Removed after `drop` has killed the process.
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// TLS on the client URL; none: plain http.
    tls: Option<EtcdTls>,
    /// Where the current process's lines start in the log (restarts
    /// append to it).
    log_start: usize,
}

impl Etcd {
    /// Starts a member and waits until it answers a read.
    pub fn start() -> Etcd {
        Self::start_with(None)
    }

    /// Starts a member that serves clients over TLS only (`https://`;
    /// peers stay on plain http) and waits until it answers a read through
    /// a TLS client.
    pub fn start_tls(tls: EtcdTls) -> Etcd {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<EtcdTls>) -> Etcd {
        // Another process may take a port between the probe and etcd's
        // bind: try a few pairs.
        let mut last_log = String::new();
        for _ in 0..3 {
            let mut etcd = Etcd {
                child: None,
                dir: tempfile::Builder::new()
                    .prefix("claimd-etcd-")
                    .tempdir()
                    .expect("create a temporary directory"),
                client_port: free_port(),
                peer_port: free_port(),
                tls: tls.clone(),
                log_start: 0,
            };
            if etcd.client_port == etcd.peer_port {
                continue;
            }
            etcd.spawn();
            if etcd.wait_ready() {
                return etcd;
            }
            last_log = etcd.log_tail();
        }
        panic!("etcd did not start; its log ends with:\n{last_log}");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let bin = etcd_binary();
        assert!(
            bin.exists(),
            "{} is missing: install Debian's etcd-server (tests/run.sh does)",
            bin.display()
        );
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the etcd log");
        self.log_start = fs::metadata(self.log_path()).map_or(0, |m| m.len() as usize);
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(bin);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key);
            // etcd 3.4 asks every client for a certificate once it has a
            // trusted CA, --client-cert-auth or not: give it one only then.
            if tls.client.is_some() {
                cmd.arg("--trusted-ca-file")
                    .arg(&tls.ca)
                    .arg("--client-cert-auth");
            }
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log file"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
    }

    /// Polls with a read until the member answers and its log says it is
    /// the one serving the port; false if it exits or does not answer
    /// within `ETCD_START_TIMEOUT`.
    fn wait_ready(&mut self) -> bool {
        let client = EtcdClient::connect(&[self.endpoint()], self.options(Duration::from_secs(1)))
            .expect("a valid endpoint");
        let start = Instant::now();
        while start.elapsed() < ETCD_START_TIMEOUT {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_)) = child.try_wait() {
                    return false;
                }
            }
            if client.get("/claimd-test/ready").is_ok() && self.serves_clients() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Whether this member's log says it serves clients on its port. A read
    /// that works is not enough: other test runs on the machine start
    /// members too, and one of them may have taken the port between
    /// `free_port` and this member's bind (this one then exits, and the read
    /// is answered by theirs).
    fn serves_clients(&self) -> bool {
        let line = format!("client requests on 127.0.0.1:{}", self.client_port);
        fs::read(self.log_path()).is_ok_and(|log| {
            String::from_utf8_lossy(log.get(self.log_start..).unwrap_or_default()).contains(&line)
        })
    }

    /// `http://127.0.0.1:<client port>` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The TLS settings the member was started with.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    /// The options of the harness's clients: `call_timeout`, and TLS (with
    /// the harness's identity) when the member has it.
    pub fn options(&self, call_timeout: Duration) -> EtcdOptions {
        EtcdOptions {
            call_timeout,
            tls: self.tls.as_ref().map(EtcdTls::client_options),
        }
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// A client of this member alone.
    pub fn client(&self) -> EtcdClient {
        self.client_with(TEST_CALL_TIMEOUT)
    }

    pub fn client_with(&self, call_timeout: Duration) -> EtcdClient {
        EtcdClient::connect(&[self.endpoint()], self.options(call_timeout))
            .expect("connect to the test etcd")
    }

    /// Kills the member (SIGKILL) and reaps it; its data stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the member with SIGSTOP: connections stay open, nothing
    /// answers. Returns once every thread of etcd is stopped
    /// (`crate::common::freeze`), so the next call is made to a member that
    /// cannot answer it.
    pub fn freeze(&self) {
        crate::common::freeze(self.pid(), "etcd");
    }

    /// Lets a frozen member go on (SIGCONT); returns once none of its
    /// threads is stopped.
    pub fn thaw(&self) {
        crate::common::thaw(self.pid(), "etcd");
    }

    /// The member's process ID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("etcd is running").id()
    }

    /// Starts the member again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        assert!(
            self.wait_ready(),
            "etcd did not restart; its log ends with:\n{}",
            self.log_tail()
        );
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP proxy on a free loopback port in front of one address, that a test
/// can pause: connections stay open and nothing passes (a partition, as a
/// node sees it), until it resumes. Stopped on drop.
pub struct Proxy {
    addr: std::net::SocketAddr,
    state: std::sync::Arc<ProxyState>,
}

#[derive(Default)]
struct ProxyState {
    paused: std::sync::atomic::AtomicBool,
    stopped: std::sync::atomic::AtomicBool,
}

/// How often a pump looks at the pause and stop flags.
const PUMP_TICK: Duration = Duration::from_millis(20);

impl Proxy {
    pub fn start(target: std::net::SocketAddr) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = std::sync::Arc::new(ProxyState::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(down) = conn else { continue };
                let Ok(up) = std::net::TcpStream::connect(target) else {
                    continue;
                };
                for (from, to) in [(&down, &up), (&up, &down)] {
                    let (from, to) = (
                        from.try_clone().expect("clone a socket"),
                        to.try_clone().expect("clone a socket"),
                    );
                    let st = st.clone();
                    std::thread::spawn(move || pump(from, to, &st));
                }
            }
        });
        Proxy { addr, state }
    }

    /// `http://127.0.0.1:<proxy port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    pub fn pause(&self) {
        self.state
            .paused
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.state
            .paused
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state
            .stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the acceptor so that it sees the flag; pumps see it within a
        // tick and close their sockets.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

/// Copies `from` to `to` while not paused; ends (closing both) at EOF, on
/// an error or when the proxy stops.
fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream, st: &ProxyState) {
    use std::io::{ErrorKind, Read, Write};
    use std::sync::atomic::Ordering;
    let _ = from.set_read_timeout(Some(PUMP_TICK));
    let mut buf = [0u8; 16 * 1024];
    while !st.stopped.load(Ordering::SeqCst) {
        if st.paused.load(Ordering::SeqCst) {
            std::thread::sleep(PUMP_TICK);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
