//! Asking the engines themselves before the engine-death rule releases a
//! mount: `GET /containers/json?all=1` on each configured engine API
//! socket (`docker.engine_sockets`; Docker's and Podman's compatible API
//! answer it alike). A container in any state but removed (created,
//! running, paused, exited, ...) that lists a volume mount of that name by
//! this driver keeps the volume's engine mounts. An engine that does not
//! answer (not running, no socket, an error) says nothing: the namespace
//! scan's verdict stands. So the engines can only keep a mount, never
//! release one.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// How long one engine may take to answer (connect, request, answer).
const ENGINE_API_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of an answer read (a list of every container).
const MAX_ANSWER_BYTES: u64 = 64 << 20;

#[derive(Debug, Deserialize)]
struct Container {
    #[serde(rename = "Mounts", default)]
    mounts: Option<Vec<MountPoint>>,
}

#[derive(Debug, Deserialize)]
struct MountPoint {
    #[serde(rename = "Type", default)]
    kind: String,
    #[serde(rename = "Name", default)]
    name: String,
    #[serde(rename = "Driver", default)]
    driver: String,
}

/// The volumes of `driver` that some container of some answering engine
/// lists, and the engines that answered.
pub struct Listed {
    pub volumes: HashSet<String>,
    pub answered: Vec<PathBuf>,
}

/// Asks every engine in `sockets` that has one.
pub fn volumes_in_use(sockets: &[PathBuf], driver: &str) -> Listed {
    let mut listed = Listed {
        volumes: HashSet::new(),
        answered: Vec::new(),
    };
    for socket in sockets.iter().filter(|s| s.exists()) {
        match containers(socket) {
            Ok(containers) => {
                listed.answered.push(socket.clone());
                listed.volumes.extend(
                    containers
                        .into_iter()
                        .flat_map(|c| c.mounts.unwrap_or_default())
                        .filter(|m| {
                            m.kind == "volume"
                                && !m.name.is_empty()
                                && (m.driver == driver || m.driver.is_empty())
                        })
                        .map(|m| m.name),
                );
            }
            Err(e) => log::debug!(
                "docker: the engine at {} did not list its containers: {e}",
                socket.display()
            ),
        }
    }
    listed
}

/// Connects without waiting: a wedged engine whose listen queue is full
/// makes a blocking connect wait for ever (the answer's timeouts are set
/// only after it); such an engine says nothing.
fn connect(socket: &Path) -> Result<UnixStream, String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::FromRawFd;
    let path = socket.as_os_str().as_bytes();
    // SAFETY: a zeroed sockaddr_un is valid; the path is copied in within
    // its bounds (checked), NUL-terminated by the zeroing.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if path.len() >= addr.sun_path.len() {
        return Err("the socket path is too long".to_string());
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2); the descriptor is owned by the stream below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: fd is a fresh socket nothing else owns.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_un of `len` bytes.
    let r = unsafe { libc::connect(fd, std::ptr::addr_of!(addr).cast(), len) };
    if r != 0 {
        // A full listen queue answers EAGAIN at once instead of waiting.
        return Err(std::io::Error::last_os_error().to_string());
    }
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Every container of the engine at `socket`, in any state.
fn containers(socket: &Path) -> Result<Vec<Container>, String> {
    let mut s = connect(socket)?;
    s.set_read_timeout(Some(ENGINE_API_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(ENGINE_API_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    // HTTP/1.0: the engine closes the connection after the answer, which
    // is then neither chunked nor kept alive.
    s.write_all(b"GET /containers/json?all=1 HTTP/1.0\r\nHost: engine\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    s.take(MAX_ANSWER_BYTES)
        .read_to_end(&mut answer)
        .map_err(|e| e.to_string())?;
    parse_answer(&answer)
}

fn parse_answer(answer: &[u8]) -> Result<Vec<Container>, String> {
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP answer")?;
    let head = String::from_utf8_lossy(&answer[..split]);
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("answered {status:?}"));
    }
    serde_json::from_slice(&answer[split + 4..]).map_err(|e| format!("not a container list: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_list_names_the_volumes_of_the_driver() {
        let body = br#"[{"Id":"a","State":"exited","Mounts":[
            {"Type":"volume","Name":"db","Driver":"claimd","Destination":"/data"},
            {"Type":"volume","Name":"other","Driver":"local"},
            {"Type":"bind","Source":"/x","Destination":"/x"}]},
            {"Id":"b","Mounts":null}]"#;
        let answer = [
            b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n".as_slice(),
            body,
        ]
        .concat();
        let containers = parse_answer(&answer).expect("parsed");
        let names: Vec<(String, String)> = containers
            .into_iter()
            .flat_map(|c| c.mounts.unwrap_or_default())
            .filter(|m| m.kind == "volume")
            .map(|m| (m.name, m.driver))
            .collect();
        assert_eq!(
            names,
            [
                ("db".to_string(), "claimd".to_string()),
                ("other".to_string(), "local".to_string())
            ]
        );
        assert!(parse_answer(b"HTTP/1.0 500 Oops\r\n\r\n{}")
            .expect_err("an error")
            .contains("500"));
        assert!(parse_answer(b"garbage").is_err());
    }

    #[test]
    fn engines_without_a_socket_say_nothing() {
        let listed = volumes_in_use(&[PathBuf::from("/nonexistent/docker.sock")], "claimd");
        assert!(listed.volumes.is_empty());
        assert!(listed.answered.is_empty());
    }
}
