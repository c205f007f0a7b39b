//! The scale part's table rows, its printed growth table and its JSON
//! summary.

use serde_json::{json, Value};

use super::{Idle, Memory, Row, LOAD_OPS, LOAD_WORKERS};
use crate::cluster_support::Counters;

pub(super) fn rows_of(
    r: &Row,
    idle: &Idle,
    m: &Memory,
    mounts: &Counters,
    releases: &Counters,
    table: &mut Vec<(String, String)>,
) {
    let n = r.n;
    let e = &idle.etcd;
    let by: Vec<String> = e
        .received
        .iter()
        .map(|(k, v)| format!("{k} {:.2}", v / e.secs / n as f64))
        .collect();
    let agent_by: Vec<String> = idle
        .agent_by_method
        .by_method
        .iter()
        .map(|(k, (c, _))| format!("{k} {:.2}", c / idle.agent_secs / n as f64))
        .collect();
    let t = |k: String, v: String| (format!("scale N={n}: {k}"), v);
    table.extend([
        t(
            "idle etcd messages received/s, total / per agent (by method, per agent)".into(),
            format!(
                "{:.1} / {:.2} ({})",
                e.msgs_per_s(),
                r.etcd_msgs,
                by.join(", ")
            ),
        ),
        t(
            "idle etcd calls+streams started/s (grpc_server_started_total), total / per agent"
                .into(),
            format!("{:.1} / {:.2}", e.started_per_s(), r.etcd_started),
        ),
        t(
            "idle etcd bytes/s sent to clients, total / per agent".into(),
            format!("{:.0} / {:.0}", e.sent_per_s(), r.sent),
        ),
        t(
            "idle etcd bytes/s received from clients, total / per agent".into(),
            format!("{:.0} / {:.0}", e.received_per_s(), r.received),
        ),
        t(
            "idle etcd calls/s per agent, agents' counters (by method)".into(),
            format!("{:.2} ({})", r.agent_calls, agent_by.join(", ")),
        ),
        t(
            "agent RSS mean / max; plugin RSS mean; etcd RSS; agent threads".into(),
            format!(
                "{:.1} / {:.1} MiB; {:.1} MiB; {:.1} MiB; {:.0}",
                m.agent_mean / 1024.0,
                m.agent_max as f64 / 1024.0,
                m.plugin_mean / 1024.0,
                m.etcd as f64 / 1024.0,
                m.threads_mean
            ),
        ),
        t(
            format!("mount p50 / p99; release p50 / p99 ({LOAD_OPS} each, {LOAD_WORKERS} at a time in all)"),
            format!(
                "{:.1} / {:.1} ms; {:.1} / {:.1} ms",
                r.mount.0, r.mount.1, r.release.0, r.release.1
            ),
        ),
        t(
            "etcd calls per mount; per release (agents' counters, idle background included)"
                .into(),
            format!("{}; {}", mounts.row(LOAD_OPS), releases.row(LOAD_OPS)),
        ),
    ]);
}

/// The growth of the per-agent idle figures against N, as table rows, a
/// printed table and JSON.
pub(super) fn summary(rows: &[Row], table: &mut Vec<(String, String)>) -> Value {
    let series = |f: fn(&Row) -> f64, digits: usize| -> String {
        let v: Vec<String> = rows
            .iter()
            .map(|r| format!("{}: {:.*}", r.n, digits, f(r)))
            .collect();
        let ratio = match (rows.first(), rows.last()) {
            (Some(a), Some(b)) if rows.len() > 1 && f(a) > 0.0 => {
                format!(" ({}/{}: {:.2}x)", b.n, a.n, f(b) / f(a))
            }
            _ => String::new(),
        };
        format!("{}{ratio}", v.join(", "))
    };
    table.extend([
        (
            "scale growth: idle etcd bytes/s sent per agent, by N (flat is the target)".into(),
            series(|r| r.sent, 0),
        ),
        (
            "scale growth: idle etcd bytes/s received per agent, by N".into(),
            series(|r| r.received, 0),
        ),
        (
            "scale growth: idle etcd messages received/s per agent, by N".into(),
            series(|r| r.etcd_msgs, 2),
        ),
        (
            "scale growth: idle etcd calls/s per agent (agents' counters), by N".into(),
            series(|r| r.agent_calls, 2),
        ),
    ]);
    println!();
    println!("scale: per agent, idle (etcd's counters; agents' counters) and under load");
    println!(
        "{:>4} {:>10} {:>10} {:>10} {:>11} {:>13} {:>15} {:>17} {:>17} {:>7} {:>9}",
        "N",
        "msgs/s",
        "sent B/s",
        "recv B/s",
        "started/s",
        "agent calls/s",
        "RSS MiB mean/max",
        "mount p50/p99 ms",
        "release p50/p99",
        "c/mount",
        "c/release"
    );
    for r in rows {
        println!(
            "{:>4} {:>10.2} {:>10.0} {:>10.0} {:>11.2} {:>13.2} {:>15} {:>17} {:>17} {:>7.2} {:>9.2}",
            r.n,
            r.etcd_msgs,
            r.sent,
            r.received,
            r.etcd_started,
            r.agent_calls,
            format!("{:.1}/{:.1}", r.rss_mean_kib / 1024.0, r.rss_max_kib as f64 / 1024.0),
            format!("{:.1}/{:.1}", r.mount.0, r.mount.1),
            format!("{:.1}/{:.1}", r.release.0, r.release.1),
            r.per_mount,
            r.per_release
        );
    }
    println!();
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({"n": r.n, "etcd_messages_received_per_s_per_agent": r.etcd_msgs,
                       "etcd_started_per_s_per_agent": r.etcd_started,
                       "etcd_sent_bytes_per_s_per_agent": r.sent,
                       "etcd_received_bytes_per_s_per_agent": r.received,
                       "agent_calls_per_s_per_agent": r.agent_calls,
                       "agent_rss_kib_mean": r.rss_mean_kib, "agent_rss_kib_max": r.rss_max_kib,
                       "mount_p50_ms": r.mount.0, "mount_p99_ms": r.mount.1,
                       "release_p50_ms": r.release.0, "release_p99_ms": r.release.1,
                       "agent_calls_per_mount": r.per_mount, "agent_calls_per_release": r.per_release})
            })
            .collect(),
    )
}
