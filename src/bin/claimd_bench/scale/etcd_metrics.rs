//! etcd's own counters, read from its `/metrics` (Prometheus text on the
//! client URL) with a plain HTTP/1.0 GET.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Instant;

use serde_json::{json, Value};

use super::PROBE_CALL;
use crate::cluster_support::label;

/// One read of etcd's `/metrics` (Prometheus text on the client URL).
pub(super) struct EtcdScrape {
    at: Instant,
    /// (name, labels, value).
    samples: Vec<(String, String, f64)>,
}

const STARTED: &str = "grpc_server_started_total";
const RECEIVED: &str = "grpc_server_msg_received_total";
const SENT_BYTES: &str = "etcd_network_client_grpc_sent_bytes_total";
const RECEIVED_BYTES: &str = "etcd_network_client_grpc_received_bytes_total";

impl EtcdScrape {
    pub(super) fn read(endpoint: &str) -> EtcdScrape {
        let text = http_get(endpoint, "/metrics")
            .unwrap_or_else(|e| panic!("scale: read {endpoint}/metrics: {e}"));
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let (name, labels) = match series.find('{') {
                    Some(i) => (&series[..i], &series[i..]),
                    None => (series, ""),
                };
                Some((name.to_string(), labels.to_string(), value.parse().ok()?))
            })
            .collect::<Vec<_>>();
        assert!(
            samples.iter().any(|(n, _, _)| n == STARTED),
            "scale: {endpoint}/metrics has no {STARTED}"
        );
        EtcdScrape {
            at: Instant::now(),
            samples,
        }
    }

    pub(super) fn value(&self, name: &str) -> Option<f64> {
        self.samples.iter().find(|(n, _, _)| n == name).map(|s| s.2)
    }

    /// `name` by its `grpc_method` label (streams and unary calls alike).
    fn by_method(&self, name: &str) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        for (n, labels, v) in &self.samples {
            if n == name {
                let method = label(labels, "grpc_method").unwrap_or("?");
                *m.entry(method.to_string()).or_default() += v;
            }
        }
        m
    }

    fn unary(&self) -> f64 {
        self.samples
            .iter()
            .filter(|(n, l, _)| n == STARTED && label(l, "grpc_type") == Some("unary"))
            .map(|s| s.2)
            .sum()
    }

    pub(super) fn delta(&self, later: &EtcdScrape) -> EtcdDelta {
        let diff = |name: &str| {
            let a = self.by_method(name);
            let mut d = later.by_method(name);
            for (m, v) in d.iter_mut() {
                *v -= a.get(m).copied().unwrap_or(0.0);
            }
            d.retain(|_, v| *v > 0.0);
            d
        };
        let one = |name: &str| later.value(name).unwrap_or(0.0) - self.value(name).unwrap_or(0.0);
        EtcdDelta {
            secs: later.at.duration_since(self.at).as_secs_f64(),
            started: diff(STARTED),
            received: diff(RECEIVED),
            unary: later.unary() - self.unary(),
            sent_bytes: one(SENT_BYTES),
            received_bytes: one(RECEIVED_BYTES),
        }
    }
}

/// What etcd served between two reads of its counters.
pub(super) struct EtcdDelta {
    pub(super) secs: f64,
    /// Calls and streams started, by method.
    pub(super) started: BTreeMap<String, f64>,
    /// Messages received (a unary call is one; every keep-alive and watch
    /// request on a stream is one), by method.
    pub(super) received: BTreeMap<String, f64>,
    pub(super) unary: f64,
    pub(super) sent_bytes: f64,
    pub(super) received_bytes: f64,
}

impl EtcdDelta {
    pub(super) fn msgs_per_s(&self) -> f64 {
        self.received.values().sum::<f64>() / self.secs
    }

    pub(super) fn started_per_s(&self) -> f64 {
        self.started.values().sum::<f64>() / self.secs
    }

    pub(super) fn sent_per_s(&self) -> f64 {
        self.sent_bytes / self.secs
    }

    pub(super) fn received_per_s(&self) -> f64 {
        self.received_bytes / self.secs
    }

    pub(super) fn json(&self, n: usize) -> Value {
        let rate = |m: &BTreeMap<String, f64>| -> BTreeMap<String, f64> {
            m.iter().map(|(k, v)| (k.clone(), v / self.secs)).collect()
        };
        let a = n.max(1) as f64;
        json!({
            "messages_received_per_s": self.msgs_per_s(),
            "started_per_s": self.started_per_s(),
            "unary_calls_per_s": self.unary / self.secs,
            "sent_bytes_per_s": self.sent_per_s(),
            "received_bytes_per_s": self.received_per_s(),
            "started_per_s_by_method": rate(&self.started),
            "messages_received_per_s_by_method": rate(&self.received),
            "per_agent": {"messages_received_per_s": self.msgs_per_s() / a,
                          "started_per_s": self.started_per_s() / a,
                          "unary_calls_per_s": self.unary / self.secs / a,
                          "sent_bytes_per_s": self.sent_per_s() / a,
                          "received_bytes_per_s": self.received_per_s() / a},
        })
    }

    pub(super) fn per_op(&self, ops: usize) -> Value {
        let ops = ops.max(1) as f64;
        json!({"unary_calls": self.unary / ops,
               "messages_received": self.received.values().sum::<f64>() / ops,
               "sent_bytes": self.sent_bytes / ops, "received_bytes": self.received_bytes / ops,
               "seconds": self.secs})
    }
}

/// A plain HTTP/1.0 GET (no chunked encoding in the answer), bounded.
fn http_get(endpoint: &str, path: &str) -> std::io::Result<String> {
    let host = endpoint.trim_start_matches("http://");
    let addr: std::net::SocketAddr = host
        .parse()
        .map_err(|e| std::io::Error::other(format!("{host}: {e}")))?;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, PROBE_CALL)?;
    conn.set_read_timeout(Some(PROBE_CALL))?;
    conn.set_write_timeout(Some(PROBE_CALL))?;
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no end of headers"))?;
    if !head.lines().next().is_some_and(|l| l.contains(" 200")) {
        return Err(std::io::Error::other(format!(
            "answered {:?}",
            head.lines().next().unwrap_or_default()
        )));
    }
    Ok(body.to_string())
}
