//! Observability end to end, with the real binary, the real test plugin
//! and real mounts: the metrics text checked by Prometheus's own
//! `promtool` and scraped by a real Prometheus server, `claimd health`'s
//! exit codes, systemd notifications read from a fake notify socket,
//! volume usage and condition from NodeGetVolumeStats, and a bad
//! `metrics_listen`.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use serde_json::{json, Value};

/// Field order is drop order: agent, then plugin, then the directory.
struct World {
    agent: Agent,
    plugin: TestPlugin,
    dir: TestDir,
}

impl World {
    fn new(
        plugin: impl FnOnce(TestPluginBuilder) -> TestPluginBuilder,
        tweak: impl FnOnce(&mut AgentConfig),
        envs: &[(&str, &str)],
    ) -> World {
        let dir = TestDir::new();
        let plugin = plugin(TestPlugin::builder(dir.path())).start();
        let mut config = AgentConfig::new(dir.path(), Some(&plugin.socket));
        tweak(&mut config);
        let agent = Agent::start_with(dir.path(), "agent", config, false, envs);
        World { agent, plugin, dir }
    }

    fn wait_plugin_ready(&self) {
        wait_until(Duration::from_secs(20), "the plugin to be ready", || {
            let out = self.agent.cli(&["plugin", "list", "--json"]).ok();
            out.json()["plugins"][0]["health"] == "ready"
        });
    }

    /// Registers `vol-<i>` and mounts it for `a<i>`, for each i in 0..n.
    fn mount_n(&self, n: usize) -> Vec<PathBuf> {
        let vols: Vec<Value> = (0..n)
            .map(|i| {
                volume_json(
                    &format!("vol-{i}"),
                    &format!("ext-{i}"),
                    &["single-node-writer"],
                )
            })
            .collect();
        for i in 0..n {
            self.plugin.add_volume(&format!("ext-{i}"));
        }
        self.agent.register(&json!(vols));
        self.wait_plugin_ready();
        (0..n)
            .map(|i| {
                let spec = format!("data=vol-{i}");
                let alloc = format!("a{i}");
                let out = self
                    .agent
                    .cli(&["alloc", "mount", &alloc, "--volume", &spec, "--json"])
                    .ok()
                    .json();
                PathBuf::from(out["volumes"][0]["host_path"].as_str().expect("host_path"))
            })
            .collect()
    }

    fn metrics(&self) -> String {
        self.agent.cli(&["metrics"]).ok().stdout
    }
}

/// The value of the sample whose line starts with `series ` (the series
/// written exactly as the agent writes it).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn csi_count(text: &str, method: &str, code: &str) -> f64 {
    let service = if method.starts_with("Node") {
        "Node"
    } else {
        "Controller"
    };
    let series = format!(
        "claimd_csi_operations_seconds_count{{driver_name=\"{PLUGIN_ID}\",method_name=\"/csi.v1.{service}/{method}\",grpc_status_code=\"{code}\"}}"
    );
    sample(text, &series).unwrap_or(0.0)
}

/// `promtool check metrics` on `text`: (exit code, output).
fn promtool_check(text: &str) -> (i32, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool (Debian package prometheus; tests/run.sh installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool output");
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), msg)
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

/// One HTTP/1.0 GET (no chunked answers): status and body.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ---- metrics ------------------------------------------------------------------

#[test]
fn metrics_pass_promtool_and_count_what_the_test_did() {
    let w = World::new(|p| p, |_| {}, &[]);
    let n = 3;
    w.mount_n(n);
    let text = w.metrics();
    let (code, msg) = promtool_check(&text);
    assert_eq!(code, 0, "promtool check metrics failed:\n{msg}\n{text}");

    let log = w.plugin.call_log();
    for (method, want) in [
        ("NodePublishVolume", n),
        ("NodeStageVolume", n),
        ("ControllerPublishVolume", n),
    ] {
        assert_eq!(
            count_calls(&log, method, "OK"),
            want,
            "{method} in the call log"
        );
        assert_eq!(
            csi_count(&text, method, "OK"),
            want as f64,
            "{method}:\n{text}"
        );
    }
    assert_eq!(csi_count(&text, "NodeUnpublishVolume", "OK"), 0.0);
    assert_eq!(
        sample(&text, "claimd_allocations{phase=\"mounted\"}"),
        Some(n as f64)
    );
    assert_eq!(
        sample(&text, "claimd_allocations{phase=\"releasing\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "claimd_allocation_volumes{phase=\"published\"}"),
        Some(n as f64)
    );
    assert_eq!(
        sample(&text, "claimd_claims{state=\"taken\"}"),
        Some(n as f64)
    );
    assert_eq!(sample(&text, "claimd_registered_volumes"), Some(n as f64));
    assert_eq!(
        sample(
            &text,
            &format!("claimd_plugin_health{{plugin_id=\"{PLUGIN_ID}\",plugin_type=\"monolith\",health=\"ready\"}}")
        ),
        Some(1.0)
    );
    // The store's own counters, as GetStats reports them: at least the
    // intent and the result of each mount.
    let fsyncs = sample(&text, "claimd_state_fsyncs_total").expect("fsyncs");
    assert!(fsyncs >= (2 * n) as f64, "{fsyncs}");
    let writes = sample(&text, "claimd_state_write_duration_seconds_count").expect("writes");
    assert!(writes >= (2 * n) as f64, "{writes}");
    assert!(sample(&text, "process_resident_memory_bytes").expect("rss") > 1e6);
    assert!(sample(&text, "process_threads").expect("threads") >= 2.0);
    assert!(sample(&text, "process_open_fds").expect("fds") >= 3.0);
    assert!(sample(&text, "process_start_time_seconds").expect("start") > 1.6e9);
    // GetStats carries the same sums as the metrics (what a benchmark
    // reads without rendering every metric): read around a metrics
    // render, each lies between the two (a probe may call the plugin in
    // between), and the CPU time only grows.
    let api = claimd::api::ApiClient::new(grpc_env(), &w.agent.config.api_socket);
    let stats = || {
        api.raw()
            .get_stats(
                &claimd::api::wire::GetStatsRequest::new(),
                grpcio::CallOption::default().timeout(Duration::from_secs(30)),
            )
            .expect("GetStats")
    };
    let (before, text, after) = (stats(), w.metrics(), stats());
    let csi: f64 = text
        .lines()
        .filter(|l| l.starts_with("claimd_csi_operations_seconds_sum{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let wait = sample(&text, "claimd_state_commit_wait_seconds_sum").expect("commit wait");
    let cpu = sample(&text, "process_cpu_seconds_total").expect("cpu");
    // The text rounds; a microsecond either way.
    let within = |lo: f64, x: f64, hi: f64| lo - 1e-6 <= x && x <= hi + 1e-6;
    assert!(
        csi > 0.0 && within(before.csi_seconds, csi, after.csi_seconds),
        "{csi} {before:?} {after:?}"
    );
    assert!(
        wait > 0.0 && within(before.commit_wait_seconds, wait, after.commit_wait_seconds),
        "{wait} {before:?} {after:?}"
    );
    assert!(
        cpu > 0.0 && within(before.cpu_seconds, cpu, after.cpu_seconds),
        "{cpu} {before:?} {after:?}"
    );

    // A release: one NodeUnpublishVolume more, one allocation fewer.
    w.agent
        .cli(&["alloc", "release", "a0", "--wait", "30s"])
        .ok();
    let text = w.metrics();
    assert_eq!(csi_count(&text, "NodeUnpublishVolume", "OK"), 1.0, "{text}");
    assert_eq!(
        sample(&text, "claimd_allocations{phase=\"mounted\"}"),
        Some((n - 1) as f64)
    );
    assert_eq!(
        sample(&text, "claimd_claims{state=\"taken\"}"),
        Some((n - 1) as f64)
    );
    let (code, msg) = promtool_check(&text);
    assert_eq!(code, 0, "{msg}");

    // A failing call is counted with gRPC-Go's code name, as kubelet does.
    w.plugin.faults().set(json!([
        {"method": "NodePublishVolume", "action": "fail", "code": "INVALID_ARGUMENT", "count": 1}
    ]));
    w.plugin.add_volume("ext-bad");
    w.agent.register(&json!([volume_json(
        "bad",
        "ext-bad",
        &["single-node-writer"]
    )]));
    w.agent
        .cli(&["alloc", "mount", "b1", "--volume", "data=bad"])
        .expect_code(EXIT_FAILED);
    let text = w.metrics();
    assert_eq!(
        csi_count(&text, "NodePublishVolume", "InvalidArgument"),
        1.0,
        "{text}"
    );
}

#[test]
fn a_real_prometheus_scrapes_metrics_listen() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let w = World::new(
        |p| p,
        |c| c.extra.push(("metrics_listen".into(), json!(listen))),
        &[],
    );
    w.mount_n(1);
    let (code, body) = http_get(&listen, "/metrics").expect("GET /metrics");
    assert_eq!(code, 200);
    assert!(
        body.contains("claimd_csi_operations_seconds_bucket"),
        "{body}"
    );
    assert_eq!(
        http_get(&listen, "/healthz"),
        Some((200, "ok\n".to_string()))
    );
    assert_eq!(http_get(&listen, "/nope").map(|r| r.0), Some(404));
    // A client that sends nothing holds only its own connection: the API
    // and other scrapes go on.
    let _idle = TcpStream::connect(&listen).expect("connect");
    w.agent.cli(&["alloc", "status"]).ok();
    assert_eq!(http_get(&listen, "/healthz").map(|r| r.0), Some(200));

    let prom_port = free_port();
    let prom = format!("127.0.0.1:{prom_port}");
    let cfg = w.dir.path().join("prometheus.yml");
    fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: claimd\n    static_configs:\n      - targets: ['{listen}']\n"
        ),
    )
    .expect("write prometheus.yml");
    let data = w.dir.mkdir("prometheus-data");
    let mut server = ChildProcess::new("prometheus");
    let log = fs::File::create(w.dir.path().join("prometheus.log")).expect("log");
    server.spawn(
        Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!("--storage.tsdb.path={}", data.display()))
            .arg(format!("--web.listen-address={prom}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log),
    );
    let query = format!(
        "/api/v1/query?query={}",
        urlencode(
            "claimd_csi_operations_seconds_count{job=\"claimd\",method_name=\"/csi.v1.Node/NodePublishVolume\",grpc_status_code=\"OK\"}"
        )
    );
    let mut last = String::new();
    let seen = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until(
            Duration::from_secs(60),
            "Prometheus to scrape the agent",
            || {
                let Some((200, body)) = http_get(&prom, &query) else {
                    return false;
                };
                last = body.clone();
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                v["data"]["result"][0]["value"][1] == "1"
            },
        )
    }));
    if seen.is_err() {
        panic!(
            "last answer: {last}\nprometheus log:\n{}",
            read_log(&w.dir.path().join("prometheus.log"))
        );
    }
    let v: Value = serde_json::from_str(&last).expect("json");
    assert_eq!(v["data"]["result"][0]["metric"]["driver_name"], PLUGIN_ID);
    // `up` says the scrape itself succeeded.
    let (_, up) = http_get(
        &prom,
        &format!("/api/v1/query?query={}", urlencode("up{job=\"claimd\"}")),
    )
    .expect("query up");
    let up: Value = serde_json::from_str(&up).expect("json");
    assert_eq!(up["data"]["result"][0]["value"][1], "1", "{up}");
}

#[test]
fn a_bad_metrics_listen_stops_the_start_naming_the_field() {
    let dir = TestDir::new();
    for bad in ["localhost:9432", "127.0.0.1", "127.0.0.1:99999"] {
        let mut config = AgentConfig::new(dir.path(), None);
        config.extra.push(("metrics_listen".into(), json!(bad)));
        let mut agent = Agent::prepare(dir.path(), "bad", config, false, &[]);
        agent.spawn();
        let status = agent.wait_exit(Duration::from_secs(20));
        assert_eq!(status.code(), Some(EXIT_USAGE), "{bad}: {}", agent.log());
        assert!(
            agent.log().contains("field metrics_listen"),
            "{bad}: {}",
            agent.log()
        );
    }
    // In use: refused at start, exit 1, naming the field and the cause.
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let mut config = AgentConfig::new(dir.path(), None);
    config.extra.push(("metrics_listen".into(), json!(addr)));
    let mut agent = Agent::prepare(dir.path(), "inuse", config.clone(), false, &[]);
    agent.spawn();
    let status = agent.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(EXIT_FAILED), "{}", agent.log());
    let log = agent.log();
    assert!(
        log.contains(&format!(
            "config field metrics_listen: cannot listen on {addr}"
        )) && log.contains("in use"),
        "{log}"
    );
    assert!(!config.api_socket.exists(), "no API was served");
}

// ---- health ---------------------------------------------------------------------

#[test]
fn health_exit_codes() {
    let mut w = World::new(|p| p, |c| c.probe_interval = "200ms".into(), &[]);
    w.mount_n(1);
    let out = w.agent.cli(&["health"]).ok();
    assert_eq!(out.stdout, "ready\n");
    let j = w.agent.cli(&["health", "--json"]).ok().json();
    assert_eq!(j, json!({"ready": true, "degraded": false, "problems": []}));

    // A release that keeps failing: degraded, one line naming it.
    w.plugin.faults().set(json!([
        {"method": "NodeUnpublishVolume", "action": "fail", "code": "UNAVAILABLE", "message": "backend down"}
    ]));
    w.agent.cli(&["alloc", "release", "a0"]).ok();
    wait_until(
        Duration::from_secs(30),
        "health to report the failing release",
        || {
            let out = w.agent.cli(&["health"]);
            out.code == EXIT_FAILED
                && out
                    .stdout
                    .contains("release of allocation a0 volume data is failing")
                && out.stdout.contains("backend down")
        },
    );
    let j = w
        .agent
        .cli(&["health", "--json"])
        .expect_code(EXIT_FAILED)
        .json();
    assert_eq!(j["degraded"], true);
    assert_eq!(j["problems"].as_array().map(Vec::len), Some(1), "{j}");
    w.plugin.faults().set(json!([]));
    wait_until(Duration::from_secs(30), "the release to finish", || {
        w.agent.cli(&["health"]).code == EXIT_OK
    });

    // The plugin gone: unhealthy, one line naming it.
    w.plugin.kill();
    wait_until(
        Duration::from_secs(30),
        "health to report the plugin",
        || {
            let out = w.agent.cli(&["health"]);
            out.code == EXIT_FAILED
                && out
                    .stdout
                    .starts_with(&format!("plugin {PLUGIN_ID} (monolith) is unhealthy"))
        },
    );

    // The agent gone: unreachable.
    w.agent.terminate(Duration::from_secs(20));
    let out = w.agent.cli(&["health"]).expect_code(EXIT_UNREACHABLE);
    assert!(out.stderr.contains("agent not running"), "{}", out.stderr);
}

// ---- systemd --------------------------------------------------------------------

/// Reads datagrams until one contains `want` or `deadline` passes.
fn read_until(sock: &UnixDatagram, got: &mut Vec<String>, want: &str, deadline: Duration) {
    let mut buf = vec![0u8; 4096];
    wait_until(deadline, &format!("{want} on the notify socket"), || {
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        got.iter().any(|m| m.contains(want))
    });
}

#[test]
fn systemd_notifications_on_a_fake_notify_socket() {
    let mut w = World::new(|p| p, |_| {}, &[]);
    w.mount_n(2);
    w.agent.terminate(Duration::from_secs(20));

    let path = w.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let notify = path.to_str().expect("utf-8").to_string();
    w.agent.envs = vec![
        ("NOTIFY_SOCKET".into(), notify),
        ("WATCHDOG_USEC".into(), "200000".into()),
    ];
    w.agent.spawn();
    let mut got = Vec::new();
    read_until(&sock, &mut got, "READY=1", Duration::from_secs(30));
    let ready = got
        .iter()
        .position(|m| m.contains("READY=1"))
        .expect("ready");
    let restoring = got
        .iter()
        .position(|m| m == "STATUS=restoring 2 allocations, 2 done")
        .unwrap_or_else(|| panic!("no restoring status in {got:?}"));
    assert!(restoring < ready, "{got:?}");
    assert!(
        got[ready].contains("STATUS=ready: 2 allocations"),
        "{got:?}"
    );
    // The API answers once READY=1 was sent.
    w.agent.cli(&["alloc", "status"]).ok();
    // Watchdog pings at half of WATCHDOG_USEC: several within a second.
    let before = got.iter().filter(|m| *m == "WATCHDOG=1").count();
    wait_until(Duration::from_secs(10), "three more watchdog pings", || {
        let mut buf = vec![0u8; 4096];
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        got.iter().filter(|m| *m == "WATCHDOG=1").count() >= before + 3
    });
    let pid = w.agent.pid().expect("running");
    send_signal(pid, libc::SIGTERM);
    read_until(&sock, &mut got, "STOPPING=1", Duration::from_secs(20));
    w.agent.wait_exit(Duration::from_secs(20));
}

// ---- volume stats ---------------------------------------------------------------

fn statvfs(path: &std::path::Path) -> libc::statvfs {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    // SAFETY: zeroed statvfs is a valid out-parameter; c outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st
}

#[test]
fn volume_usage_and_condition_from_node_get_volume_stats() {
    let w = World::new(
        |p| p.args(&["--volume-stats"]),
        |c| {
            c.extra
                .push(("volume_stats_interval".into(), json!("200ms")))
        },
        &[],
    );
    let paths = w.mount_n(1);
    let status = || {
        w.agent
            .cli(&["alloc", "status", "a0", "--json"])
            .ok()
            .json()
    };
    wait_until(
        Duration::from_secs(20),
        "volume stats in alloc status",
        || {
            status()["allocs"][0]["volumes"][0]["stats"]["bytes"]["capacity"]
                .as_i64()
                .is_some_and(|c| c > 0)
        },
    );
    let st = statvfs(&paths[0]);
    let s = status()["allocs"][0]["volumes"][0]["stats"].clone();
    let frsize = st.f_frsize as i64;
    assert_eq!(
        s["bytes"]["capacity"],
        json!(st.f_blocks as i64 * frsize),
        "{s}"
    );
    assert_eq!(s["inodes"]["capacity"], json!(st.f_files as i64), "{s}");
    assert_eq!(s["condition"]["abnormal"], false, "{s}");
    assert!(s["bytes"]["used"].as_i64().expect("used") > 0, "{s}");
    let human = w.agent.cli(&["alloc", "status", "a0"]).ok().stdout;
    assert!(human.contains("USAGE") && human.contains(" of "), "{human}");
    let calls = w.plugin.call_log().calls_of("NodeGetVolumeStats");
    assert!(!calls.is_empty());
    assert_eq!(calls[0]["volume_id"], "ext-0");
    assert_eq!(calls[0]["target_path"], json!(paths[0]));

    let labels =
        format!("{{alloc_id=\"a0\",alias=\"data\",volume_id=\"vol-0\",plugin_id=\"{PLUGIN_ID}\"}}");
    let text = w.agent.cli(&["metrics"]).ok().stdout;
    assert_eq!(
        sample(
            &text,
            &format!("claimd_volume_stats_capacity_bytes{labels}")
        ),
        Some((st.f_blocks as i64 * frsize) as f64),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!("claimd_volume_stats_health_status_abnormal{labels}")
        ),
        Some(0.0)
    );
    assert_eq!(promtool_check(&text).0, 0, "{}", promtool_check(&text).1);

    // The plugin reports the volume abnormal: status, metrics and health.
    let flags = w.plugin.root.join("abnormal");
    fs::create_dir_all(&flags).expect("mkdir");
    fs::write(flags.join("ext-0"), "disk reports I/O errors\n").expect("flag");
    wait_until(Duration::from_secs(20), "the abnormal condition", || {
        status()["allocs"][0]["volumes"][0]["stats"]["condition"]["abnormal"] == true
    });
    let human = w.agent.cli(&["alloc", "status", "a0"]).ok().stdout;
    assert!(
        human.contains("abnormal: disk reports I/O errors"),
        "{human}"
    );
    let text = w.agent.cli(&["metrics"]).ok().stdout;
    assert_eq!(
        sample(
            &text,
            &format!("claimd_volume_stats_health_status_abnormal{labels}")
        ),
        Some(1.0)
    );
    let out = w.agent.cli(&["health"]).expect_code(EXIT_FAILED);
    assert_eq!(
        out.stdout,
        "volume vol-0 of allocation a0 (data) is abnormal: disk reports I/O errors\n"
    );

    // Released: the entry goes with the record.
    w.agent
        .cli(&["alloc", "release", "a0", "--wait", "30s"])
        .ok();
    wait_until(Duration::from_secs(20), "the stats to go", || {
        let text = w.agent.cli(&["metrics"]).ok().stdout;
        sample(
            &text,
            &format!("claimd_volume_stats_capacity_bytes{labels}"),
        )
        .is_none()
    });
}
