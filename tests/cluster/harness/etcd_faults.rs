//! Faults between an agent and etcd, for `tests/cluster/partial_failures/`:
//! a TCP proxy that delays etcd's replies (and can
//! hold the requests), ballast that makes a Range of the whole claims
//! prefix larger than a client may receive, and libfaketime for one agent.

#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use crate::etcd_support::Etcd;
use crate::harness::PREFIX;

// ---- A proxy that delays replies ---------------------------------------------

/// How often a pump looks at its flags.
const PUMP_TICK: Duration = Duration::from_millis(5);

#[derive(Default)]
struct DelayState {
    /// Added to every chunk coming back from etcd, from when it was read.
    reply_delay_ms: AtomicU64,
    /// Requests stay in the socket: nothing new reaches etcd.
    requests_held: AtomicBool,
    /// Requests are read and kept in the proxy, the client's cancellations
    /// (HTTP/2 RST_STREAM frames) left out, and delivered at release.
    requests_kept: AtomicBool,
    /// gRPC answers (HTTP/2 HEADERS frames that end a stream) etcd sent.
    answers: AtomicU64,
    stopped: AtomicBool,
}

/// A TCP proxy in front of one etcd member: every reply chunk reaches the
/// agent `reply_delay` after etcd sent it (in order, without queueing one
/// delay behind another), and the requests can be held (a link cut in the
/// agent-to-etcd direction only: what etcd already has is still answered).
/// Stopped on drop.
pub struct DelayProxy {
    addr: SocketAddr,
    state: Arc<DelayState>,
}

impl DelayProxy {
    pub fn start(target: SocketAddr) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the delay proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let state = Arc::new(DelayState::default());
        let st = state.clone();
        thread::Builder::new()
            .name(format!("delay-proxy-{}", addr.port()))
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.stopped.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(agent) = conn else { continue };
                    let Ok(etcd) = TcpStream::connect(target) else {
                        continue;
                    };
                    connect_pumps(agent, etcd, &st);
                }
            })
            .expect("start the delay proxy");
        DelayProxy { addr, state }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every reply chunk read from now on reaches the agent this much
    /// later.
    pub fn delay_replies(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).expect("a delay in u64 ms");
        self.state.reply_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Nothing more from the agent reaches etcd.
    pub fn hold_requests(&self) {
        self.state.requests_held.store(true, Ordering::SeqCst);
    }

    pub fn release_requests(&self) {
        self.state.requests_held.store(false, Ordering::SeqCst);
        self.state.requests_kept.store(false, Ordering::SeqCst);
    }

    /// Every request from now on is kept in the proxy until
    /// `release_requests`, and the client's cancellations of them are
    /// dropped: a link that delays requests past the client's deadline,
    /// delivering them to an etcd that never learns the client gave up
    /// (the cancel can be lost or come too late in a real network; here it
    /// never comes, so what etcd does with a late request is certain).
    pub fn keep_requests_dropping_cancels(&self) {
        self.state.requests_kept.store(true, Ordering::SeqCst);
    }

    /// How many gRPC answers etcd sent through the proxy so far.
    pub fn answers(&self) -> u64 {
        self.state.answers.load(Ordering::SeqCst)
    }
}

/// The client's connection preface of HTTP/2.
const H2_PREFACE_LEN: usize = 24;
/// HTTP/2 frame types and flags the proxy looks at.
const H2_HEADERS: u8 = 0x1;
const H2_RST_STREAM: u8 = 0x3;
const H2_END_STREAM: u8 = 0x1;

/// Cuts a byte stream of HTTP/2 into its preface (client side) and frames.
struct H2Frames {
    buf: Vec<u8>,
    preface_left: usize,
}

impl H2Frames {
    fn new(preface: usize) -> H2Frames {
        H2Frames {
            buf: Vec::new(),
            preface_left: preface,
        }
    }

    /// The complete pieces (the preface, then whole frames) that `data`
    /// finishes, in order, each with whether it is (part of) the preface.
    fn push(&mut self, data: &[u8]) -> Vec<(bool, Vec<u8>)> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.buf.len());
            out.push((true, self.buf.drain(..n).collect()));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return out;
            }
        }
        while self.buf.len() >= 9 {
            let len = (usize::from(self.buf[0]) << 16)
                | (usize::from(self.buf[1]) << 8)
                | usize::from(self.buf[2]);
            if self.buf.len() < 9 + len {
                break;
            }
            out.push((false, self.buf.drain(..9 + len).collect()));
        }
        out
    }
}

/// Whether a whole frame belongs to the connection (stream 0) and is one
/// whose order against the streams' frames does not matter: PING,
/// SETTINGS, WINDOW_UPDATE.
fn connection_frame(frame: &[u8]) -> bool {
    const PING: u8 = 0x6;
    const SETTINGS: u8 = 0x4;
    const WINDOW_UPDATE: u8 = 0x8;
    frame.len() >= 9
        && matches!(frame[3], PING | SETTINGS | WINDOW_UPDATE)
        && u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff == 0
}

/// The stream ID of a whole frame.
fn h2_stream(frame: &[u8]) -> Option<u32> {
    (frame.len() >= 9)
        .then(|| u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff)
}

/// (type, flags) of a whole frame.
fn h2_kind(frame: &[u8]) -> Option<(u8, u8)> {
    (frame.len() >= 9).then(|| (frame[3], frame[4]))
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.state.stopped.store(true, Ordering::SeqCst);
        // Wakes the acceptor; pumps see the flag within a tick.
        let _ = TcpStream::connect(self.addr);
    }
}

fn connect_pumps(agent: TcpStream, etcd: TcpStream, st: &Arc<DelayState>) {
    let clone = |s: &TcpStream| s.try_clone().expect("clone a socket");
    let (from, to, s) = (clone(&agent), clone(&etcd), st.clone());
    let _ = thread::Builder::new()
        .name("delay-proxy-up".into())
        .spawn(move || pump_requests(from, to, &s));
    // Replies: one thread reads and stamps, one writes when each is due.
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let (from, s) = (clone(&etcd), st.clone());
    let _ = thread::Builder::new()
        .name("delay-proxy-read".into())
        .spawn(move || read_replies(from, &tx, &s));
    let s = st.clone();
    let _ = thread::Builder::new()
        .name("delay-proxy-write".into())
        .spawn(move || write_replies(agent, etcd, &rx, &s));
}

fn pump_requests(mut from: TcpStream, mut to: TcpStream, st: &DelayState) {
    let _ = from.set_read_timeout(Some(PUMP_TICK));
    let mut buf = vec![0u8; 16 * 1024];
    let mut frames = H2Frames::new(H2_PREFACE_LEN);
    let mut kept: Vec<u8> = Vec::new();
    // Bytes forwarded as they came (not keeping: the stream passes
    // untouched) beyond the last whole piece the parser gave back.
    let mut ahead = 0usize;
    let mut was_keeping = false;
    // The connection's preface is among the kept bytes: nothing may pass
    // before it.
    let mut preface_kept = false;
    // Streams with a frame kept: their cancels are dropped.
    let mut kept_streams = std::collections::BTreeSet::new();
    // Keeping ended: what was kept goes first. When bytes pass as they
    // come again (no stream was kept), so does the start of a frame the
    // parser holds (less what was forwarded of it before keeping began);
    // else the parser hands it on whole. The bytes forwarded ahead, after.
    let release =
        |kept: &mut Vec<u8>, frames: &H2Frames, ahead: usize, raw: bool, to: &mut TcpStream| {
            if raw {
                kept.extend_from_slice(&frames.buf[ahead.min(frames.buf.len())..]);
            }
            let ok = to.write_all(kept).is_ok();
            kept.clear();
            ok.then_some(if raw { frames.buf.len() } else { ahead })
        };
    while !st.stopped.load(Ordering::SeqCst) {
        if st.requests_held.load(Ordering::SeqCst) {
            thread::sleep(PUMP_TICK);
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => 0,
            Err(_) => break,
        };
        // As of now, not of before the read: a request that came after
        // the test said "keep" is kept, one after "release" is not.
        let keeping = st.requests_kept.load(Ordering::SeqCst);
        if !keeping && was_keeping {
            let Some(a) = release(&mut kept, &frames, ahead, kept_streams.is_empty(), &mut to)
            else {
                break;
            };
            ahead = a;
            preface_kept = false;
        }
        was_keeping = keeping;
        if n == 0 {
            continue;
        }
        // Bytes pass as they come until a request was kept; from then on
        // frame by frame, so that a late cancel of a kept request can be
        // left out.
        if !keeping && kept_streams.is_empty() {
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
            ahead += n;
        }
        let mut now = Vec::new();
        for (preface, piece) in frames.push(&buf[..n]) {
            let sent = ahead.min(piece.len());
            ahead -= sent;
            if sent == piece.len() {
                continue;
            }
            let stream = h2_stream(&piece);
            let kind = h2_kind(&piece).map(|k| k.0);
            // The client's cancels never reach etcd: of a request kept now,
            // or of one kept before (the cancel can come after the release).
            if !preface
                && sent == 0
                && kind == Some(H2_RST_STREAM)
                && (keeping || stream.is_some_and(|id| kept_streams.contains(&id)))
            {
                continue;
            }
            if !keeping {
                now.extend_from_slice(&piece[sent..]);
                continue;
            }
            if preface {
                preface_kept = true;
                kept.extend_from_slice(&piece[sent..]);
                continue;
            }
            // Frames of the connection, not of a stream (pings, settings,
            // window updates of the connection) pass: a client whose ping
            // is not answered closes the connection, and what was kept
            // with it.
            if sent == 0 && !preface_kept && connection_frame(&piece) {
                now.extend_from_slice(&piece);
                continue;
            }
            if let Some(id) = stream.filter(|id| *id != 0) {
                kept_streams.insert(id);
            }
            kept.extend_from_slice(&piece[sent..]);
        }
        if !now.is_empty() && to.write_all(&now).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn read_replies(mut from: TcpStream, tx: &mpsc::Sender<(Instant, Vec<u8>)>, st: &DelayState) {
    let _ = from.set_read_timeout(Some(PUMP_TICK));
    let mut buf = vec![0u8; 16 * 1024];
    let mut frames = H2Frames::new(0);
    while !st.stopped.load(Ordering::SeqCst) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let ends = frames
                    .push(&buf[..n])
                    .iter()
                    .filter_map(|(_, f)| h2_kind(f))
                    .filter(|(kind, flags)| *kind == H2_HEADERS && flags & H2_END_STREAM != 0)
                    .count();
                st.answers.fetch_add(ends as u64, Ordering::SeqCst);
                let delay = Duration::from_millis(st.reply_delay_ms.load(Ordering::SeqCst));
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
}

/// Writes each reply chunk to the agent once it is due; ends (closing
/// both sockets) when the reader ended and everything read was written,
/// on an error, or when the proxy stops.
fn write_replies(
    mut to: TcpStream,
    etcd: TcpStream,
    rx: &mpsc::Receiver<(Instant, Vec<u8>)>,
    st: &DelayState,
) {
    'outer: while !st.stopped.load(Ordering::SeqCst) {
        let (due, chunk) = match rx.recv_timeout(PUMP_TICK) {
            Ok(c) => c,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        loop {
            if st.stopped.load(Ordering::SeqCst) {
                break 'outer;
            }
            let now = Instant::now();
            if now >= due {
                break;
            }
            thread::sleep((due - now).min(PUMP_TICK));
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = etcd.shutdown(Shutdown::Both);
}

// ---- An oversized claims range ---------------------------------------------------

/// How many ballast keys, and how large each: etcd takes a request of up
/// to 1.5 MiB (`--max-request-bytes`), a client receives at most 4 MiB
/// (gRPC's default), so four keys of 1.2 MiB make any Range that covers
/// them fail while each was written on its own.
const BALLAST_KEYS: usize = 4;
const BALLAST_BYTES: usize = 1_200_000;

/// Keys under `<prefix>/claims/~ballast/` (a volume no test uses; `~`
/// sorts after every test volume) and under the node's claim index
/// (`<prefix>/node-claims/<node>/~ballast/`) that make a Range of the
/// whole claims prefix, and one of the node's index, larger than a client
/// may receive, so that the node's reconciliation fails whether it reads
/// every claim (the code before the index) or its index; a Range of one
/// volume's claims, or a read of one claim, still works. Removed on drop.
pub struct Ballast {
    client: claimd::etcd::EtcdClient,
    node: String,
    planted: bool,
}

impl Ballast {
    /// The ballast prefix under the claims, relative to the cluster prefix.
    pub const REL: &'static str = "claims/~ballast/";

    fn index_rel(node: &str) -> String {
        format!("node-claims/{node}/~ballast/")
    }

    pub fn plant(etcd: &Etcd, node: &str) -> Ballast {
        let client = etcd.client();
        let value = vec![b'x'; BALLAST_BYTES];
        for rel in [Self::REL.to_string(), Self::index_rel(node)] {
            for i in 0..BALLAST_KEYS {
                client
                    .put(format!("{PREFIX}/{rel}{i}"), &value)
                    .expect("write a ballast key");
            }
        }
        // The trick works only while this holds: check it, so that a test
        // built on it cannot pass for another reason.
        for whole in [
            format!("{PREFIX}/claims/"),
            format!("{PREFIX}/node-claims/{node}/"),
        ] {
            assert!(
                client.range_prefix(&whole).is_err(),
                "a Range of {whole} still succeeds with the ballast"
            );
        }
        Ballast {
            client,
            node: node.to_string(),
            planted: true,
        }
    }

    pub fn remove(&mut self) {
        if self.planted {
            for rel in [Self::REL.to_string(), Self::index_rel(&self.node)] {
                self.client
                    .delete_prefix(format!("{PREFIX}/{rel}"))
                    .expect("delete the ballast");
            }
            self.planted = false;
        }
    }
}

impl Drop for Ballast {
    fn drop(&mut self) {
        if self.planted && !thread::panicking() {
            self.remove();
        }
    }
}

// ---- libfaketime ---------------------------------------------------------------

/// Debian's libfaketime (package `faketime`; tests/run.sh installs it).
pub fn libfaketime() -> PathBuf {
    let lib = PathBuf::from("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1");
    assert!(
        lib.exists(),
        "{} is missing: install Debian's faketime (tests/run.sh does)",
        lib.display()
    );
    lib
}

/// The environment that runs a process with its wall clock `offset_s`
/// seconds off (negative: behind) and its monotonic clocks untouched.
pub fn faketime_env(offset_s: i64) -> Vec<(String, String)> {
    vec![
        (
            "LD_PRELOAD".to_string(),
            libfaketime().to_str().expect("UTF-8 path").to_string(),
        ),
        ("FAKETIME".to_string(), format!("{offset_s:+}")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
    ]
}

// ---- "last renewed X ago" ------------------------------------------------------

/// A `Duration`'s `Debug` text (`12.345678s`, `950.2ms`, `3µs`, `7ns`) in
/// milliseconds.
pub fn debug_duration_ms(text: &str) -> Option<f64> {
    let (number, per_ms) = [("ms", 1.0), ("µs", 1e-3), ("ns", 1e-6), ("s", 1e3)]
        .iter()
        .find_map(|(unit, per_ms)| Some((text.strip_suffix(unit)?, *per_ms)))?;
    Some(number.parse::<f64>().ok()? * per_ms)
}

/// X, in ms, of the first "last renewed X ago" in `text`.
pub fn renewed_ago_ms(text: &str) -> Option<f64> {
    let rest = text.split("last renewed ").nth(1)?;
    debug_duration_ms(rest.split(" ago").next()?)
}
