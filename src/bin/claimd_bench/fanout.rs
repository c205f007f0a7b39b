//! Release fan-out: many volumes of one allocation released at once, with
//! and without a delay on every teardown call, against the bare client.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::wire as w;
use claimd::csi::CsiClient;
use serde_json::{json, Value};

use super::*;

/// Runs `f(i)` for i in 0..n on `threads` threads; returns each latency and
/// the wall time.
pub fn run_parallel(
    n: usize,
    threads: usize,
    f: impl Fn(usize) + Sync,
) -> (Vec<Duration>, Duration) {
    let started = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let lat = parking_lot::Mutex::new(Vec::with_capacity(n));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let t = Instant::now();
                f(i);
                lat.lock().push(t.elapsed());
            });
        }
    });
    (lat.into_inner(), started.elapsed())
}

/// The CSI calls of a release.
pub const TEARDOWN: &[&str] = &[
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
];

/// How often the fan-out poll asks the agent which volumes are released.
pub const FANOUT_POLL: Duration = Duration::from_millis(2);

/// Fault rules: `hang_volume`'s NodeUnpublish hangs (the first matching rule
/// applies), and with `delay` every teardown call sleeps that long first.
pub fn fanout_faults(delay: Option<Duration>, hang_volume: Option<&str>) -> Value {
    let mut rules = Vec::new();
    if let Some(v) = hang_volume {
        rules.push(json!({"method": "NodeUnpublishVolume", "volume_id": v, "action": "hang"}));
    }
    if let Some(d) = delay {
        for m in TEARDOWN {
            rules.push(json!({"method": m, "action": "delay", "ms": d.as_millis() as u64}));
        }
    }
    json!({ "rules": rules })
}

pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Release fan-out: one allocation with `args.fanout` volumes, one of which
/// hangs in NodeUnpublish; the time until the others are released, against
/// one volume released alone, and against a bare client releasing the same
/// number at once. With `delay`, every teardown call of the plugin sleeps
/// that long first (in all three measurements).
pub fn fanout(
    args: &Args,
    env: &Arc<grpcio::Environment>,
    delay: Option<Duration>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    const ALONE_RUNS: usize = 5;
    let mut s = Scratch::new();
    let setup = start_plugin(args, &mut s);
    let (agent, _) = Agent::start(args, &setup);
    let c = api(&setup, env);
    let write_faults = |hang: Option<&str>| {
        std::fs::write(&setup.faults, fanout_faults(delay, hang).to_string())
            .expect("write the fault file");
    };
    write_faults(None);

    // One volume alone, agent and bare client: the median of a few.
    let mut alone = Vec::new();
    for i in 0..ALONE_RUNS {
        let (v, a) = (format!("solo{i}"), format!("solo-a{i}"));
        register(&c, &setup, &v, "single-node-writer");
        mount(&c, &a, std::slice::from_ref(&v));
        let t = Instant::now();
        let r = release(&c, &a, Duration::from_secs(60));
        assert!(r.done, "release of one volume did not finish");
        alone.push(t.elapsed());
    }
    let one = median(alone);
    let bare = Bare {
        client: CsiClient::new(env.clone(), &setup.plugin_socket, CALL),
        node_id: CsiClient::new(env.clone(), &setup.plugin_socket, CALL)
            .node_get_info()
            .expect("node info")
            .node_id,
        root: s.dir.join("bare"),
    };
    let mut bare_alone = Vec::new();
    for i in 0..ALONE_RUNS {
        let id = format!("bsolo{i}");
        create_volume(&setup, &id);
        bare.mount(&id);
        let t = Instant::now();
        bare.release(&id);
        bare_alone.push(t.elapsed());
    }
    let bare_one = median(bare_alone);

    // The agent: one allocation, one volume hangs.
    let vols: Vec<String> = (0..args.fanout).map(|i| format!("f{i}")).collect();
    for v in &vols {
        register(&c, &setup, v, "single-node-writer");
    }
    mount(&c, "fan", &vols);
    write_faults(Some("ext-f0"));
    let log_lines_before = std::fs::read_to_string(&setup.call_log)
        .map(|t| t.lines().count())
        .unwrap_or(0);
    let stats_before = stats(&c);
    let t = Instant::now();
    release(&c, "fan", Duration::ZERO);
    let mut req = w::GetAllocRequest::new();
    req.alloc_id = "fan".into();
    let others = loop {
        let released = c
            .raw()
            .get_alloc(&req, opt())
            .expect("get alloc")
            .alloc
            .volumes
            .iter()
            .filter(|v| v.release_state == "released")
            .count();
        if released == args.fanout - 1 {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the other volumes were not released within 300 s ({released} were)"
        );
        std::thread::sleep(FANOUT_POLL);
    };
    let fan_state = StateCost::between(&stats_before, &stats(&c), 1);
    let plugin_side = teardown_window(&setup.call_log, log_lines_before);

    // The bare client: the same number of releases, all at once.
    let ids: Vec<String> = (1..args.fanout).map(|i| format!("bf{i}")).collect();
    for id in &ids {
        create_volume(&setup, id);
    }
    run_parallel(ids.len(), args.concurrency, |i| bare.mount(&ids[i]));
    let (_, bare_others) = run_parallel(ids.len(), ids.len(), |i| bare.release(&ids[i]));
    let peak = proc_status(agent.pid(), "VmHWM:");
    let _ = std::fs::remove_file(&setup.faults);
    agent.kill();

    let n = args.fanout - 1;
    let (key, what) = match delay {
        None => (
            "release_fanout".to_string(),
            "no injected delay".to_string(),
        ),
        Some(d) => (
            format!("release_fanout_teardown_delay_{}ms", d.as_millis()),
            format!("every teardown call delayed {} ms", d.as_millis()),
        ),
    };
    let secs = |d: Duration| d.as_secs_f64();
    results.insert(
        key,
        json!({
            "what": format!(
                "one allocation of {} volumes, NodeUnpublish of one hangs; {what}",
                args.fanout
            ),
            "teardown_delay_ms": delay.map(|d| d.as_millis() as u64),
            "volumes": args.fanout,
            "seconds_others_released": secs(others),
            "poll_interval_ms": FANOUT_POLL.as_millis() as u64,
            "seconds_one_volume_alone": secs(one),
            "one_volume_alone_runs": ALONE_RUNS,
            "ratio": secs(others) / secs(one),
            "bare_seconds_others_released": secs(bare_others),
            "bare_seconds_one_volume_alone": secs(bare_one),
            "bare_ratio": secs(bare_others) / secs(bare_one),
            "ratio_to_bare": secs(others) / secs(bare_others),
            "plugin_call_log": plugin_side,
            "agent_state_during_release": fan_state.json(),
            "agent_peak_rss_kib": peak,
        }),
    );
    table.push((
        format!(
            "fan-out ({what}): one volume released alone, agent / bare (median of {ALONE_RUNS})"
        ),
        format!("{:.3} s / {:.3} s", secs(one), secs(bare_one)),
    ));
    table.push((
        format!(
            "fan-out ({what}): {n} others of {} with one hung, agent",
            args.fanout
        ),
        format!(
            "{:.3} s = {:.1}x one alone",
            secs(others),
            secs(others) / secs(one)
        ),
    ));
    table.push((
        format!("fan-out ({what}): the same {n} by a bare client, all at once"),
        format!(
            "{:.3} s = {:.1}x bare one alone; agent / bare = {:.2}x",
            secs(bare_others),
            secs(bare_others) / secs(bare_one),
            secs(others) / secs(bare_others)
        ),
    ));
}

/// From the plugin's call log (lines after `skip`): how many teardown calls
/// it answered and the span between the first and the last answer.
pub fn teardown_window(log: &Path, skip: usize) -> Value {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut first = u64::MAX;
    let mut last = 0u64;
    let mut calls = BTreeMap::<String, usize>::new();
    for line in text.lines().skip(skip) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let (Some(method), Some(ts)) = (v["method"].as_str(), v["ts_ms"].as_u64()) else {
            continue;
        };
        if TEARDOWN.contains(&method) {
            *calls.entry(method.to_string()).or_default() += 1;
            first = first.min(ts);
            last = last.max(ts);
        }
    }
    json!({
        "teardown_calls_answered": calls,
        "ms_first_to_last_answer": last.checked_sub(first),
    })
}
