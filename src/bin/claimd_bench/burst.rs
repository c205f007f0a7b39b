//! The scale-out check: many allocations started at once (each one
//! volume) on one agent, the time until the last mount is answered,
//! against the bare client making the same calls from as many threads.

use claimd::api::ApiClient;
use serde_json::{json, Value};

use super::*;

/// `n` allocations at once, twice per side in ABBA order (agent, bare,
/// bare, agent), each round released before the next; the time to the
/// last answer of each side is the mean of its two rounds.
#[allow(clippy::too_many_arguments)]
pub fn burst(
    n: usize,
    c: &ApiClient,
    setup: &Setup,
    bare: &Bare,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    for i in 0..n {
        register(c, setup, &format!("burst{i}"), "single-node-writer");
        create_volume(setup, &format!("burst-b{i}"));
    }
    let (mut agent_s, mut bare_s) = (0.0, 0.0);
    for agent_side in [true, false, false, true] {
        if agent_side {
            let (_, wall) = run_parallel(n, n, |i| {
                mount(c, &format!("burst-a{i}"), &[format!("burst{i}")])
            });
            agent_s += wall.as_secs_f64() / 2.0;
            run_parallel(n, n, |i| {
                let r = release(c, &format!("burst-a{i}"), Duration::from_secs(60));
                assert!(r.done, "release did not finish");
            });
            stats(c);
        } else {
            let (_, wall) = run_parallel(n, n, |i| bare.mount(&format!("burst-b{i}")));
            bare_s += wall.as_secs_f64() / 2.0;
            run_parallel(n, n, |i| bare.release(&format!("burst-b{i}")));
        }
    }
    results.insert(
        "scale_out_burst".into(),
        json!({"allocations": n, "agent_s_to_last_mount": agent_s,
            "bare_s_to_last_mount": bare_s, "ratio": agent_s / bare_s}),
    );
    table.push((
        format!("scale-out: {n} allocations at once, time to the last mount answered, agent vs bare ({n} threads)"),
        format!(
            "{:.1} ms vs {:.1} ms = {:.2}x",
            agent_s * 1000.0,
            bare_s * 1000.0,
            agent_s / bare_s
        ),
    ));
}
