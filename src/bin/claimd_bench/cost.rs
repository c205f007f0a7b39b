//! What operations cost besides their time, between two probes: the CPU
//! time of the agent (getrusage, through its `process_cpu_seconds_total`),
//! of the plugin (its CPU clock, in nanoseconds) and of the client
//! (this process, getrusage), and the agent's own account of its durable
//! writes and CSI calls (its metrics).

use std::collections::BTreeMap;
use std::path::Path;

use claimd::api::ApiClient;
use serde_json::{json, Value};

use super::*;

/// The figures at one moment.
pub struct Probe {
    agent_cpu: f64,
    plugin_cpu: f64,
    client_cpu: f64,
    /// The plugin's fsync(2) calls so far (its call log's last end line);
    /// None when the log could not be read or had no count.
    plugin_fsyncs: Option<f64>,
    metrics: String,
}

/// The `fsyncs` of the last end line of process `pid` in the plugin's
/// call log, read from the file's tail (the log grows by a line per call);
/// None when the log cannot be read or its tail has no such line.
fn plugin_fsyncs(call_log: &Path, pid: u32) -> Option<f64> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 256 * 1024;
    let mut f = std::fs::File::open(call_log).ok()?;
    let len = f.metadata().ok()?.len();
    let mut tail = Vec::new();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).ok()?;
    f.read_to_end(&mut tail).ok()?;
    String::from_utf8_lossy(&tail)
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "end" && v["pid"] == pid && v["fsyncs"].is_u64())
        .and_then(|v| v["fsyncs"].as_f64())
}

/// CPU seconds of this process (every thread), from getrusage(2).
fn self_cpu() -> f64 {
    // SAFETY: getrusage writes into the struct it is given; all-zero is a
    // valid value of it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// CPU seconds of process `pid` (every thread, ended ones too): its CPU
/// clock (clock_getcpuclockid(3), nanoseconds), or `/proc/<pid>/stat`'s
/// clock ticks (10 ms) if that clock cannot be read. Ticks are too coarse
/// for a plugin's 0.1 ms differences over 200 operations.
pub fn proc_cpu(pid: u32) -> f64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid writes the clock ID into `clock`.
    if unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) } == 0 {
        // SAFETY: all-zero is a valid timespec; clock_gettime writes into it.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
            return ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9;
        }
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = text.rfind(')').map(|i| &text[i + 2..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (n(11) + n(12)) as f64 / ticks
}

/// The value of the sample `name` (no labels) in Prometheus text.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// `claimd_csi_operations_seconds` sum and count by method (short name).
fn csi_by_method(text: &str) -> BTreeMap<String, (f64, f64)> {
    let mut m = BTreeMap::<String, (f64, f64)>::new();
    for (suffix, count) in [("_sum{", false), ("_count{", true)] {
        let prefix = format!("claimd_csi_operations_seconds{suffix}");
        for l in text.lines().filter(|l| l.starts_with(&prefix)) {
            let Some(method) = l
                .split("method_name=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .and_then(|p| p.rsplit('/').next())
            else {
                continue;
            };
            let v = l
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            let e = m.entry(method.to_string()).or_default();
            if count {
                e.1 += v;
            } else {
                e.0 += v;
            }
        }
    }
    m
}

impl Probe {
    pub fn take(c: &ApiClient, agent_pid: u32, plugin_pid: u32, call_log: &Path) -> Probe {
        let metrics = metrics_text(c);
        let agent_cpu = match sample(&metrics, "process_cpu_seconds_total") {
            v if v > 0.0 => v,
            _ => proc_cpu(agent_pid),
        };
        Probe {
            agent_cpu,
            plugin_cpu: proc_cpu(plugin_pid),
            client_cpu: self_cpu(),
            plugin_fsyncs: plugin_fsyncs(call_log, plugin_pid),
            metrics,
        }
    }
}

/// Sums over the windows between probes.
#[derive(Default)]
pub struct Cost {
    ops: usize,
    agent_cpu: f64,
    plugin_cpu: f64,
    client_cpu: f64,
    plugin_fsyncs: f64,
    /// A probe could not read the plugin's count.
    plugin_fsyncs_unread: bool,
    commit_wait: (f64, f64),
    write: (f64, f64),
    changes_written: f64,
    csi: BTreeMap<String, (f64, f64)>,
}

impl Cost {
    /// Adds what happened between `a` and `b`, over `ops` operations.
    pub fn add(&mut self, a: &Probe, b: &Probe, ops: usize) {
        self.ops += ops;
        self.agent_cpu += b.agent_cpu - a.agent_cpu;
        self.plugin_cpu += b.plugin_cpu - a.plugin_cpu;
        self.client_cpu += b.client_cpu - a.client_cpu;
        match (a.plugin_fsyncs, b.plugin_fsyncs) {
            (Some(a), Some(b)) => self.plugin_fsyncs += b - a,
            _ => self.plugin_fsyncs_unread = true,
        }
        let d = |name: &str| sample(&b.metrics, name) - sample(&a.metrics, name);
        self.commit_wait.0 += d("claimd_state_commit_wait_seconds_sum");
        self.commit_wait.1 += d("claimd_state_commit_wait_seconds_count");
        self.write.0 += d("claimd_state_write_duration_seconds_sum");
        self.write.1 += d("claimd_state_write_duration_seconds_count");
        self.changes_written += d("claimd_state_changes_written_total");
        let before = csi_by_method(&a.metrics);
        for (m, (s, n)) in csi_by_method(&b.metrics) {
            let (s0, n0) = before.get(&m).copied().unwrap_or_default();
            let e = self.csi.entry(m).or_default();
            e.0 += s - s0;
            e.1 += n - n0;
        }
    }

    fn per_op_ms(&self, v: f64) -> f64 {
        v * 1000.0 / self.ops.max(1) as f64
    }

    pub fn agent_cpu_ms(&self) -> f64 {
        self.per_op_ms(self.agent_cpu)
    }

    pub fn plugin_cpu_ms(&self) -> f64 {
        self.per_op_ms(self.plugin_cpu)
    }

    pub fn client_cpu_ms(&self) -> f64 {
        self.per_op_ms(self.client_cpu)
    }

    /// The plugin's own fsync(2) calls per operation (None when a probe
    /// could not read them).
    pub fn plugin_fsyncs_per_op(&self) -> Option<f64> {
        (!self.plugin_fsyncs_unread).then(|| self.plugin_fsyncs / self.ops.max(1) as f64)
    }

    /// Agent, plugin and client CPU per operation, ms.
    pub fn total_cpu_ms(&self) -> f64 {
        self.agent_cpu_ms() + self.plugin_cpu_ms() + self.client_cpu_ms()
    }

    /// The mean wait of a change for durability, ms.
    pub fn commit_wait_ms(&self) -> f64 {
        self.commit_wait.0 * 1000.0 / self.commit_wait.1.max(1.0)
    }

    pub fn write_ms(&self) -> f64 {
        self.write.0 * 1000.0 / self.write.1.max(1.0)
    }

    pub fn changes_per_write(&self) -> f64 {
        self.changes_written / self.write.1.max(1.0)
    }

    /// CSI time per operation as the agent's client timed it, ms.
    pub fn csi_ms(&self) -> f64 {
        self.per_op_ms(self.csi.values().map(|v| v.0).sum())
    }

    pub fn json(&self) -> Value {
        json!({
            "ops": self.ops,
            "agent_cpu_ms_per_op": self.agent_cpu_ms(),
            "plugin_cpu_ms_per_op": self.plugin_cpu_ms(),
            "client_cpu_ms_per_op": self.client_cpu_ms(),
            "plugin_fsyncs_per_op": self.plugin_fsyncs_per_op(),
            "commit_wait_ms_mean": self.commit_wait_ms(),
            "commit_waits_per_op": self.commit_wait.1 / self.ops.max(1) as f64,
            "state_write_ms_mean": self.write_ms(),
            "changes_per_write": self.changes_per_write(),
            "agent_csi_ms_per_op": self.csi_ms(),
            "agent_csi_ms_per_call": self.csi.iter()
                .map(|(m, (s, n))| (m.clone(), json!(s * 1000.0 / n.max(1.0))))
                .collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// One row: CPU per operation, agent side against bare.
pub fn cpu_row(agent: &Cost, bare: &Cost) -> String {
    format!(
        "agent {:.3} + plugin {:.3} + client {:.3} = {:.3} ms vs bare: plugin {:.3} + client {:.3} = {:.3} ms (agent idle meanwhile {:.3})",
        agent.agent_cpu_ms(),
        agent.plugin_cpu_ms(),
        agent.client_cpu_ms(),
        agent.agent_cpu_ms() + agent.plugin_cpu_ms() + agent.client_cpu_ms(),
        bare.plugin_cpu_ms(),
        bare.client_cpu_ms(),
        bare.plugin_cpu_ms() + bare.client_cpu_ms(),
        bare.agent_cpu_ms(),
    )
}

/// One row: the agent's own account of an operation.
pub fn agent_row(agent: &Cost, plugin_ms: f64) -> String {
    format!(
        "waits for durability {:.2} ms ({:.2} waits/op; write {:.2} ms, {:.1} changes per write); CSI calls as its client timed them {:.2} ms/op, in the plugin {:.2}",
        agent.commit_wait_ms(),
        agent.commit_wait.1 / agent.ops.max(1) as f64,
        agent.write_ms(),
        agent.changes_per_write(),
        agent.csi_ms(),
        plugin_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_fsyncs_come_from_its_own_last_end_line_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("claimd-bench-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let log = dir.join("calls.jsonl");
        assert_eq!(plugin_fsyncs(&log, 7), None, "no file");
        std::fs::write(
            &log,
            concat!(
                r#"{"event":"end","pid":7,"method":"Probe","fsyncs":3}"#,
                "\n",
                r#"{"event":"end","pid":7,"method":"ControllerPublishVolume","fsyncs":5}"#,
                "\n",
                r#"{"event":"start","pid":7,"method":"Probe"}"#,
                "\n",
                r#"{"event":"end","pid":8,"method":"Probe","fsyncs":40}"#,
                "\n",
                "not json\n",
            ),
        )
        .expect("write");
        assert_eq!(plugin_fsyncs(&log, 7), Some(5.0));
        assert_eq!(plugin_fsyncs(&log, 8), Some(40.0));
        assert_eq!(plugin_fsyncs(&log, 9), None, "no line of that process");
        std::fs::write(&log, "{\"event\":\"end\",\"pid\":7,\"method\":\"Probe\"}\n")
            .expect("write");
        assert_eq!(
            plugin_fsyncs(&log, 7),
            None,
            "a plugin that writes no count"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fsyncs_per_operation_are_unread_once_a_probe_missed_them() {
        let probe = |fsyncs: Option<f64>| Probe {
            agent_cpu: 0.0,
            plugin_cpu: 0.0,
            client_cpu: 0.0,
            plugin_fsyncs: fsyncs,
            metrics: String::new(),
        };
        let mut c = Cost::default();
        c.add(&probe(Some(10.0)), &probe(Some(14.0)), 8);
        c.add(&probe(Some(20.0)), &probe(Some(22.0)), 4);
        assert_eq!(c.plugin_fsyncs_per_op(), Some(0.5));
        c.add(&probe(Some(30.0)), &probe(None), 4);
        assert_eq!(c.plugin_fsyncs_per_op(), None);
    }
}
