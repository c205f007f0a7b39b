//! systemd's notify protocol, by hand: one datagram per message to the
//! unix socket named by `$NOTIFY_SOCKET` (a path, or an abstract name
//! written with a leading `@`). READY=1 once the restore is done and the
//! API answers, STATUS= lines on the way, STOPPING=1 on stop, and
//! WATCHDOG=1 at half of `$WATCHDOG_USEC` when the unit sets
//! `WatchdogSec=`. Without `$NOTIFY_SOCKET` every call does nothing.
//!
//! Written by hand rather than with a crate: the protocol is one
//! `sendto` of `KEY=VALUE` lines.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where notifications go, read once from the environment.
#[derive(Clone, Debug)]
pub struct Notifier {
    socket: Option<String>,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`. The variable is left set: plugins the agent
    /// might start are not its business, and the agent starts none.
    pub fn from_env() -> Notifier {
        Notifier {
            socket: std::env::var("NOTIFY_SOCKET")
                .ok()
                .filter(|s| !s.is_empty()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.socket.is_some()
    }

    fn addr(name: &str) -> io::Result<SocketAddr> {
        match name.strip_prefix('@') {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(abstract_name.as_bytes())
            }
            None => SocketAddr::from_pathname(name),
        }
    }

    /// Sends one message (`"READY=1\nSTATUS=…"`); failures are logged
    /// once per call and otherwise ignored (notification is best effort).
    pub fn notify(&self, message: &str) {
        let Some(name) = &self.socket else {
            return;
        };
        let sent = (|| {
            let addr = Self::addr(name)?;
            let sock = UnixDatagram::unbound()?;
            sock.send_to_addr(message.as_bytes(), &addr)
        })();
        if let Err(e) = sent {
            log::warn!("cannot notify systemd at {name}: {e}");
        }
    }

    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={status}"));
    }
}

/// The watchdog period systemd asked for (`$WATCHDOG_USEC`, for this
/// process when `$WATCHDOG_PID` is set), halved as sd_notify(3) advises.
pub fn watchdog_interval() -> Option<Duration> {
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_an_abstract_name() {
        let dir = std::env::temp_dir().join(format!("claimd-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier {
            socket: Some(path.to_string_lossy().into_owned()),
        };
        n.notify("READY=1");
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("claimd-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("addr");
        let rx2 = UnixDatagram::bind_addr(&addr).expect("bind abstract");
        let n2 = Notifier {
            socket: Some(format!("@{name}")),
        };
        n2.status("ready");
        let len = rx2.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..len], b"STATUS=ready");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
