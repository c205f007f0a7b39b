//! A 3-member etcd cluster on loopback (Debian's etcd 3.4), compaction
//! off, each member's peer port behind a tagging proxy so that one member
//! can be cut from the other two (`isolate`), its leader found from
//! `/metrics` (`etcd_server_is_leader`), members killed and restarted on
//! their data.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use claimd::etcd::{EtcdClient, EtcdOptions};

use super::proxy::{Policy, Proxy};

/// How long the members may take to form the cluster.
const CLUSTER_START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restarted member may take to serve again.
const MEMBER_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of the harness's own etcd calls.
pub const HARNESS_CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub const MEMBER_NAMES: [&str; 3] = ["e0", "e1", "e2"];

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral loopback port")
        .port()
}

pub struct Member {
    pub name: String,
    dir: PathBuf,
    pub client_port: u16,
    peer_port: u16,
    /// Every peer dials this member through here.
    peer_proxy: Proxy,
    child: Option<Child>,
    /// The member ID as rafthttp writes it (hex).
    pub id: String,
    log_start: u64,
}

impl Member {
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("etcd.log")
    }

    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    fn spawn(&mut self, initial_cluster: &str, token: &str) {
        fs::create_dir_all(&self.dir).expect("create the member's directory");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the member's log");
        self.log_start = fs::metadata(self.log_path()).map_or(0, |m| m.len());
        let client = self.endpoint();
        let child = Command::new("/usr/bin/etcd")
            .args(["--name", &self.name, "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args([
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", self.peer_port),
            ])
            .args(["--initial-advertise-peer-urls", &self.peer_proxy.endpoint()])
            .args(["--initial-cluster", initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", token])
            .args(["--auto-compaction-retention", "0"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log file"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
    }

    /// Whether this process's log says it serves our client port (another
    /// test may have taken the port between the probe and the bind).
    fn serves_clients(&self) -> bool {
        let line = format!("client requests on 127.0.0.1:{}", self.client_port);
        fs::read(self.log_path()).is_ok_and(|log| {
            let start = usize::try_from(self.log_start).unwrap_or(0);
            String::from_utf8_lossy(log.get(start..).unwrap_or_default()).contains(&line)
        })
    }

    fn exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) => {
                self.child = None;
                true
            }
            Some(_) => false,
            None => true,
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `GET /metrics` on the client port, `None` if it does not answer
    /// within a second.
    fn metrics(&self) -> Option<String> {
        let mut s = TcpStream::connect_timeout(&self.client_addr(), Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The member cut from the others: (index, member ID).
type Isolated = Arc<Mutex<Option<(usize, String)>>>;

pub struct EtcdCluster {
    pub members: Vec<Member>,
    initial_cluster: String,
    token: String,
    isolated: Isolated,
    /// Members whose last restart did not serve in time (still to be
    /// started again; the cluster runs on the others meanwhile).
    pub not_back: std::collections::BTreeSet<usize>,
}

impl EtcdCluster {
    /// Starts three members under `dir` and waits until each answers a
    /// linearizable read. Tries a few port sets (another process may take
    /// a probed port first).
    pub fn start(dir: &Path, token: &str) -> EtcdCluster {
        let mut last = String::new();
        for attempt in 0..3 {
            match Self::try_start(&dir.join(format!("etcd-{attempt}")), token) {
                Ok(c) => return c,
                Err(e) => last = e,
            }
        }
        panic!("the etcd cluster did not start: {last}");
    }

    fn try_start(dir: &Path, token: &str) -> Result<EtcdCluster, String> {
        let isolated: Isolated = Arc::new(Mutex::new(None));
        let mut members = Vec::new();
        for (i, name) in MEMBER_NAMES.iter().enumerate() {
            let peer_port = free_port();
            let iso = isolated.clone();
            // Into member i: held while i is cut, and from a cut member.
            let policy: Policy =
                Arc::new(move |_, tag| match &*iso.lock().expect("isolation lock") {
                    Some((j, id)) => *j == i || tag == Some(id.as_str()),
                    None => false,
                });
            let peer_proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], peer_port)), policy);
            members.push(Member {
                name: name.to_string(),
                dir: dir.join(name),
                client_port: free_port(),
                peer_port,
                peer_proxy,
                child: None,
                id: String::new(),
                log_start: 0,
            });
        }
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_proxy.endpoint()))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = EtcdCluster {
            members,
            initial_cluster,
            token: token.to_string(),
            isolated,
            not_back: Default::default(),
        };
        for i in 0..c.members.len() {
            let (ic, tok) = (c.initial_cluster.clone(), c.token.clone());
            c.members[i].spawn(&ic, &tok);
        }
        let start = Instant::now();
        for i in 0..c.members.len() {
            if !c.wait_serving(i, CLUSTER_START_TIMEOUT.saturating_sub(start.elapsed())) {
                return Err(format!(
                    "member {} did not serve; its log ends with:\n{}",
                    c.members[i].name,
                    c.members[i].log_tail()
                ));
            }
        }
        for i in 0..c.members.len() {
            let id = c.members[i]
                .metrics()
                .and_then(|m| {
                    m.lines().find_map(|l| {
                        let rest = l.strip_prefix("etcd_server_id{server_id=\"")?;
                        Some(rest.split('"').next()?.to_string())
                    })
                })
                .ok_or_else(|| format!("no etcd_server_id in {}'s metrics", c.members[i].name))?;
            c.members[i].id = id;
        }
        Ok(c)
    }

    /// Waits until member `i` answers a linearizable read on its own.
    fn wait_serving(&mut self, i: usize, timeout: Duration) -> bool {
        let client = EtcdClient::connect(
            &[self.members[i].endpoint()],
            EtcdOptions {
                call_timeout: Duration::from_secs(1),
                tls: None,
            },
        )
        .expect("a valid endpoint");
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.members[i].exited() {
                return false;
            }
            if client.get("/nemesis/ready").is_ok() && self.members[i].serves_clients() {
                return true;
            }
            thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn client_addrs(&self) -> Vec<SocketAddr> {
        self.members.iter().map(Member::client_addr).collect()
    }

    /// A client of every member, straight (no agent's link).
    pub fn client(&self) -> EtcdClient {
        let eps: Vec<String> = self.members.iter().map(Member::endpoint).collect();
        EtcdClient::connect(
            &eps,
            EtcdOptions {
                call_timeout: HARNESS_CALL_TIMEOUT,
                tls: None,
            },
        )
        .expect("connect to the etcd cluster")
    }

    /// The member that says it leads, if one answers so.
    pub fn leader(&self) -> Option<usize> {
        self.leaders().first().copied()
    }

    /// Every member that says it leads (two while a cut-off old leader has
    /// not noticed yet).
    pub fn leaders(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&i| {
                let m = &self.members[i];
                m.is_running()
                    && m.metrics()
                        .is_some_and(|t| t.lines().any(|l| l.trim() == "etcd_server_is_leader 1"))
            })
            .collect()
    }

    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// Starts a killed member again on its data; waits until it serves.
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        self.members[i].kill();
        let (ic, tok) = (self.initial_cluster.clone(), self.token.clone());
        self.members[i].spawn(&ic, &tok);
        if self.wait_serving(i, MEMBER_START_TIMEOUT) {
            self.not_back.remove(&i);
            Ok(())
        } else {
            self.not_back.insert(i);
            Err(format!(
                "member {} did not serve again; its log ends with:\n{}",
                self.members[i].name,
                self.members[i].log_tail()
            ))
        }
    }

    /// Cuts member `i` from the other two, both ways (its clients stay
    /// connected to it).
    pub fn isolate(&self, i: usize) {
        *self.isolated.lock().expect("isolation lock") = Some((i, self.members[i].id.clone()));
    }

    pub fn heal(&self) {
        *self.isolated.lock().expect("isolation lock") = None;
    }
}
