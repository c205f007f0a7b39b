//! TCP proxies the nemesis cuts: one per (agent, etcd member) client link,
//! cut both ways or one way, and one in front of each etcd member's peer
//! port, which learns who dialed each connection (rafthttp's
//! `X-Server-From` header) so that one member can be cut from the other
//! two in both directions.
//!
//! A cut holds data, it does not drop connections: each pump reads a chunk
//! and keeps it until the policy lets it pass (a partition as TCP sees it;
//! when it heals, what was held flows on).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// How often a pump looks at its policy and the stop flag.
const PUMP_TICK: Duration = Duration::from_millis(10);

/// The direction of a chunk: `Up` from the dialer (an agent, a member
/// dialing a peer) to the target, `Down` back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Up,
    Down,
}

/// Whether a chunk going `Dir` on a connection with this tag is held.
pub type Policy = Arc<dyn Fn(Dir, Option<&str>) -> bool + Send + Sync>;

/// One listening proxy in front of `target`; stopped on drop.
pub struct Proxy {
    addr: SocketAddr,
    stopped: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(target: SocketAddr, policy: Policy) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let stopped = Arc::new(AtomicBool::new(false));
        let st = stopped.clone();
        thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(down) = conn else { continue };
                    let Ok(up) = TcpStream::connect(target) else {
                        continue;
                    };
                    let tag = Arc::new(Mutex::new(None::<String>));
                    for (from, to, dir) in [(&down, &up, Dir::Up), (&up, &down, Dir::Down)] {
                        let from = from.try_clone().expect("clone a socket");
                        let to = to.try_clone().expect("clone a socket");
                        let (st, policy, tag) = (st.clone(), policy.clone(), tag.clone());
                        let _ = thread::Builder::new()
                            .name("proxy-pump".into())
                            .spawn(move || pump(from, to, dir, &tag, &policy, &st));
                    }
                }
            })
            .expect("start a proxy thread");
        Proxy { addr, stopped }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// The sender's member ID in an HTTP request head (`X-Server-From: <hex>`).
fn server_from(chunk: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(chunk);
    text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("x-server-from")
            .then(|| value.trim().to_string())
    })
}

fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    dir: Dir,
    tag: &Mutex<Option<String>>,
    policy: &Policy,
    stopped: &AtomicBool,
) {
    let _ = from.set_read_timeout(Some(PUMP_TICK));
    let mut buf = vec![0u8; 16 * 1024];
    let mut first = true;
    'outer: while !stopped.load(Ordering::SeqCst) {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        if dir == Dir::Up && first {
            first = false;
            if let Some(id) = server_from(&buf[..n]) {
                *tag.lock().expect("tag lock") = Some(id);
            }
        }
        loop {
            if stopped.load(Ordering::SeqCst) {
                break 'outer;
            }
            let t = tag.lock().expect("tag lock").clone();
            if !policy(dir, t.as_deref()) {
                break;
            }
            thread::sleep(PUMP_TICK);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// How an agent's link to etcd is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Nothing passes.
    Both,
    /// Requests do not reach etcd.
    Up,
    /// Answers do not come back (requests are applied).
    Down,
}

impl Cut {
    pub fn name(self) -> &'static str {
        match self {
            Cut::Both => "both",
            Cut::Up => "up",
            Cut::Down => "down",
        }
    }
}

/// One agent's link to etcd: a proxy per member, cut together.
pub struct Link {
    pub proxies: Vec<Proxy>,
    /// bit 0: up held, bit 1: down held.
    state: Arc<AtomicU8>,
}

impl Link {
    pub fn start(members: &[SocketAddr]) -> Link {
        let state = Arc::new(AtomicU8::new(0));
        let proxies = members
            .iter()
            .map(|m| {
                let st = state.clone();
                let policy: Policy = Arc::new(move |dir, _| {
                    let s = st.load(Ordering::SeqCst);
                    match dir {
                        Dir::Up => s & 1 != 0,
                        Dir::Down => s & 2 != 0,
                    }
                });
                Proxy::start(*m, policy)
            })
            .collect();
        Link { proxies, state }
    }

    /// The endpoints for the agent's config, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.proxies.iter().map(Proxy::endpoint).collect()
    }

    pub fn cut(&self, how: Cut) {
        let bits = match how {
            Cut::Both => 3,
            Cut::Up => 1,
            Cut::Down => 2,
        };
        self.state.store(bits, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.state.store(0, Ordering::SeqCst);
    }
}

#[test]
fn the_sender_of_a_raft_request_is_read_from_its_head() {
    let head = b"GET /raft/stream/msgappv2/8e9e05c52164694d HTTP/1.1\r\nHost: x\r\nX-Server-From: 8e9e05c52164694d\r\nX-Raft-To: 1\r\n\r\n";
    assert_eq!(server_from(head).as_deref(), Some("8e9e05c52164694d"));
    assert_eq!(server_from(b"GET /version HTTP/1.1\r\n\r\n"), None);
}
