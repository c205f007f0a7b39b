//! Where a mount's or release's time goes, agent against bare
//! client, measured in the same run: the bench stamps CLOCK_BOOTTIME
//! around each operation, and the test plugin's call log stamps the same
//! clock when each CSI call reached it and when it ended. One operation
//! then splits into:
//!
//! - before: from the request to the first CSI call reaching the plugin
//!   (for the agent: its API request, the intent's durable write);
//! - in the plugin: the CSI calls' own time, arrival to end;
//! - between: the caller's time from one call's end to the next call's
//!   arrival (the reply's way back, the caller's work, the next request);
//! - after: from the last call's end to the operation's answer.

use std::collections::BTreeMap;
use std::path::Path;

use claimd::clock::boottime;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// The CLOCK_BOOTTIME windows of operations, one per call of `time`, each
/// with the (external) ID of the volume its calls name.
#[derive(Default)]
pub struct Windows(Mutex<Vec<(String, u64, u64)>>);

impl Windows {
    pub fn time<T>(&self, volume: String, f: impl FnOnce() -> T) -> T {
        let from = boottime().as_nanos() as u64;
        let out = f();
        let to = boottime().as_nanos() as u64;
        self.0.lock().push((volume, from, to));
        out
    }
}

/// The mean of each phase over the operations, in ms.
#[derive(Clone, Debug, Default)]
pub struct Phases {
    pub ops: usize,
    /// Operations in which no volume call was seen (not in the means).
    pub without_calls: usize,
    pub calls_per_op: f64,
    pub total: f64,
    pub before: f64,
    pub plugin: f64,
    pub between: f64,
    pub after: f64,
    /// Time in the plugin by method (mean per call).
    pub by_method: BTreeMap<String, (usize, f64)>,
}

impl Phases {
    pub fn json(&self) -> Value {
        json!({"ops": self.ops, "ops_without_calls": self.without_calls,
            "calls_per_op": self.calls_per_op, "total_ms": self.total,
            "before_first_call_ms": self.before, "in_plugin_ms": self.plugin,
            "between_calls_ms": self.between, "after_last_call_ms": self.after,
            "in_plugin_ms_per_call": self.by_method.iter()
                .map(|(m, (n, ms))| (m.clone(), json!(ms / (*n).max(1) as f64)))
                .collect::<serde_json::Map<_, _>>()})
    }
}

/// Volume calls (`…Volume` methods) of the call log by volume ID: (arrival,
/// end) in ns and the method, by arrival.
fn volume_calls(log: &Path) -> BTreeMap<String, Vec<(u64, u64, String)>> {
    let mut calls = BTreeMap::<String, Vec<(u64, u64, String)>>::new();
    for v in std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "end")
    {
        let Some(method) = v["method"].as_str().filter(|m| m.ends_with("Volume")) else {
            continue;
        };
        let (Some(from), Some(to), Some(volume)) = (
            v["start_boottime_ns"].as_u64(),
            v["end_boottime_ns"].as_u64(),
            v["volume_id"].as_str(),
        ) else {
            continue;
        };
        calls
            .entry(volume.to_string())
            .or_default()
            .push((from, to, method.to_string()));
    }
    for c in calls.values_mut() {
        c.sort_unstable();
    }
    calls
}

/// Splits each operation of `windows` by the calls naming its volume that
/// reached the plugin within it (operations may overlap: each is told
/// apart by its volume).
pub fn phases(log: &Path, windows: &Windows) -> Phases {
    let calls = volume_calls(log);
    let windows = windows.0.lock();
    let mut p = Phases::default();
    let ms = |ns: u64| ns as f64 / 1e6;
    let none = Vec::new();
    for (volume, from, to) in windows.iter() {
        let (from, to) = (*from, *to);
        let calls = calls.get(volume).unwrap_or(&none);
        let first = calls.partition_point(|c| c.0 < from);
        let last = calls.partition_point(|c| c.0 <= to);
        let mine = &calls[first..last];
        let (Some(head), Some(tail)) = (mine.first(), mine.last()) else {
            p.without_calls += 1;
            continue;
        };
        p.ops += 1;
        p.calls_per_op += mine.len() as f64;
        p.total += ms(to - from);
        p.before += ms(head.0 - from);
        for c in mine {
            p.plugin += ms(c.1 - c.0);
            let m = p.by_method.entry(c.2.clone()).or_default();
            m.0 += 1;
            m.1 += ms(c.1 - c.0);
        }
        p.between += mine
            .windows(2)
            .map(|w| ms(w[1].0.saturating_sub(w[0].1)))
            .sum::<f64>();
        p.after += ms(to.saturating_sub(tail.1));
    }
    let n = p.ops.max(1) as f64;
    for f in [
        &mut p.calls_per_op,
        &mut p.total,
        &mut p.before,
        &mut p.plugin,
        &mut p.between,
        &mut p.after,
    ] {
        *f /= n;
    }
    p
}

/// One table row: each phase, agent / bare.
pub fn row(agent: &Phases, bare: &Phases) -> String {
    format!(
        "before the first call {:.2} / {:.2}, in the plugin {:.2} / {:.2}, between calls {:.2} / {:.2}, after the last {:.2} / {:.2} ms ({:.1} / {:.1} calls)",
        agent.before,
        bare.before,
        agent.plugin,
        bare.plugin,
        agent.between,
        bare.between,
        agent.after,
        bare.after,
        agent.calls_per_op,
        bare.calls_per_op
    )
}
