//! The optional metrics listener (`metrics_listen`): a small HTTP/1.1
//! server on a named thread that answers `GET /metrics` and `GET /healthz`
//! and nothing else.
//!
//! Written by hand: two read-only paths need no HTTP library. Each
//! connection gets one request and one answer (`Connection: close`). A
//! request is read up to `MAX_REQUEST_BYTES` and for at most
//! `REQUEST_TIMEOUT`, the answer written within `WRITE_TIMEOUT`; at most
//! `MAX_CONNECTIONS` are served at once, each on its own short-lived
//! thread, and more are refused with 503. A scrape reads the state as any
//! reader does (no lock is held across anything slow), so the listener
//! never blocks the API or the lifecycle, and a slow or hostile client
//! only ever holds its own thread.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::metrics::text::CONTENT_TYPE;
use crate::shutdown::Shutdown;
use crate::threads::Threads;

use super::Observer;

/// Largest request head read (request line and headers).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client has to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long writing the answer may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are answered 503 at once.
pub const MAX_CONNECTIONS: usize = 4;
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(200);

/// Binds the listen address (before the restore, so a bad one stops the
/// start at once).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let l = TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves `listener` on thread `metrics-http` until the stop.
pub fn start(
    listener: TcpListener,
    observer: Observer,
    threads: &mut Threads,
    stop: Shutdown,
) -> io::Result<()> {
    if let Ok(a) = listener.local_addr() {
        log::info!("metrics listening on http://{a}/metrics");
    }
    threads.spawn("metrics-http", move || {
        accept_loop(listener, observer, stop)
    })
}

fn wait_readable(listener: &TcpListener, timeout: Duration) -> bool {
    let mut fd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: poll reads and writes the one pollfd it is given.
    let n = unsafe { libc::poll(&mut fd, 1, ms) };
    n > 0
}

fn accept_loop(listener: TcpListener, observer: Observer, stop: Shutdown) {
    // The connection threads, MAX_CONNECTIONS at most: each ends within
    // REQUEST_TIMEOUT plus WRITE_TIMEOUT whatever the client does, and is
    // joined at the next accept after it ended, or at the stop.
    let mut conns = Threads::new();
    while !stop.is_triggered() {
        if !wait_readable(&listener, ACCEPT_POLL) {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                log::warn!("metrics listener: accept: {e}");
                // Out of descriptors, say: do not spin.
                stop.sleep(ACCEPT_POLL);
                continue;
            }
        };
        conns.reap();
        if conns.len() >= MAX_CONNECTIONS {
            let _ = answer_busy(stream);
            continue;
        }
        let o = observer.clone();
        let spawned = conns.spawn("metrics-conn", move || {
            if let Err(e) = serve(stream, &o) {
                log::debug!("metrics listener: {e}");
            }
        });
        if let Err(e) = spawned {
            log::warn!("metrics listener: cannot start a connection thread: {e}");
        }
    }
    let left = conns.join_until(Instant::now() + REQUEST_TIMEOUT + WRITE_TIMEOUT);
    if !left.is_empty() {
        log::warn!(
            "metrics listener: {} connection(s) still open at the stop",
            left.len()
        );
    }
}

fn answer_busy(mut stream: TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_millis(100)))?;
    respond(&mut stream, 503, "text/plain", b"busy\n", false)
}

/// Reads the request head: up to the blank line, within the size and
/// time bounds.
fn read_head(stream: &mut TcpStream) -> io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(buf));
        }
        if buf.len() >= MAX_REQUEST_BYTES {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request too slow"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before the request ended",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn serve(mut stream: TcpStream, observer: &Observer) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let Some(head) = read_head(&mut stream)? else {
        return respond(
            &mut stream,
            431,
            "text/plain",
            b"request too large\n",
            false,
        );
    };
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return respond(&mut stream, 405, "text/plain", b"only GET\n", false);
    }
    // The query string is ignored (Prometheus may add none; curl users may).
    let path = target.split('?').next().unwrap_or("");
    match path {
        "/metrics" => {
            let body = observer.metrics_text();
            respond(&mut stream, 200, CONTENT_TYPE, body.as_bytes(), head_only)
        }
        "/healthz" => {
            let problems = observer.problems();
            if problems.is_empty() {
                respond(&mut stream, 200, "text/plain", b"ok\n", head_only)
            } else {
                let body = format!("degraded\n{}\n", problems.join("\n"));
                respond(&mut stream, 503, "text/plain", body.as_bytes(), head_only)
            }
        }
        _ => respond(
            &mut stream,
            404,
            "text/plain",
            b"not found: try /metrics or /healthz\n",
            head_only,
        ),
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    }
}

fn respond(
    stream: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &[u8],
    head_only: bool,
) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason(code),
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(body)?;
    }
    stream.flush()
}
