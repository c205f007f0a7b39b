//! The agent's own part of a mount with N allocations on record against an
//! agent with none, on the same disk at the same moment: a second agent
//! (with its own test plugin) beside the one with N, their timed mount and
//! release cycles alternating A,B,B,A. On ext4 without a journal a mkdir
//! stays slow for minutes after a mass deletion, so two figures taken
//! minutes apart compare the file system's state as much as the agent.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use claimd::api::ApiClient;
use serde_json::{json, Value};

use super::*;

/// One timed mount and release of `shared` under a new allocation: the
/// agent's own part of each (wall time less its CSI calls), its CPU time
/// in each and its wait for durability in the mount, in milliseconds.
struct Cycle {
    /// The same directories made bare just before (see `bare_dirs`).
    bare_dirs: f64,
    own_mount: f64,
    cpu_mount: f64,
    wait_mount: f64,
    own_release: f64,
    cpu_release: f64,
}

/// Makes, then removes, the directories of a mount of a new allocation
/// under `mount_root` (`per-alloc/<alloc>/<volume>/<usage>` and
/// `staging/<plugin>/<volume>`, whoever makes them) beside the agent's
/// own: what they cost in these parents (one with N entries under the
/// loaded agent) at this moment, without the agent. Answers the
/// creation's seconds.
fn bare_dirs(mount_root: &Path) -> f64 {
    let alloc = mount_root.join("per-alloc").join("dir-probe");
    let staging = mount_root.join("staging").join("hp").join("dir-probe");
    let t = Instant::now();
    std::fs::create_dir_all(alloc.join("shared").join("mount"))
        .and_then(|_| std::fs::create_dir_all(&staging))
        .expect("create the probe's directories");
    let took = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&alloc)
        .and_then(|_| std::fs::remove_dir(&staging))
        .expect("remove the probe's directories");
    took
}

fn cycle(c: &ApiClient, mount_root: &Path) -> Cycle {
    let ms = |s: f64| s * 1000.0;
    let dirs = bare_dirs(mount_root);
    let a = stats(c);
    let t = Instant::now();
    mount(c, "twin-one", &["shared".to_string()]);
    let mount = t.elapsed().as_secs_f64();
    let b = stats(c);
    let t = Instant::now();
    release(c, "twin-one", Duration::from_secs(60));
    let release = t.elapsed().as_secs_f64();
    let e = stats(c);
    Cycle {
        bare_dirs: ms(dirs),
        own_mount: ms(mount - (b.csi_seconds - a.csi_seconds)),
        cpu_mount: ms(b.cpu_seconds - a.cpu_seconds),
        wait_mount: ms(b.commit_wait_seconds - a.commit_wait_seconds),
        own_release: ms(release - (e.csi_seconds - b.csi_seconds)),
        cpu_release: ms(e.cpu_seconds - b.cpu_seconds),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The medians of each figure over `cycles`.
fn medians(cycles: &[Cycle]) -> [f64; 7] {
    let of = |f: fn(&Cycle) -> f64| median(cycles.iter().map(f).collect());
    [
        of(|c| c.bare_dirs),
        of(|c| c.own_mount - c.bare_dirs),
        of(|c| c.own_mount),
        of(|c| c.cpu_mount),
        of(|c| c.wait_mount),
        of(|c| c.own_release),
        of(|c| c.cpu_release),
    ]
}

/// Starts an empty agent under `<dir>/twin` and alternates timed cycles
/// (`--same-disk-rounds` rounds, each one cycle of either agent)
/// between it and `loaded` (the agent with `n` on record, `shared`
/// registered and not mounted). The twin is stopped before this answers.
#[allow(clippy::too_many_arguments)]
pub fn same_disk(
    n: usize,
    args: &Args,
    s: &mut Scratch,
    dir: &Path,
    loaded: &ApiClient,
    env: &Arc<grpcio::Environment>,
    results: &mut serde_json::Map<String, Value>,
    table: &mut Vec<(String, String)>,
) {
    let setup = start_plugin_in(args, s, &dir.join("twin"), &[], json!({}));
    let (agent, _) = Agent::start(args, &setup);
    let empty = api(&setup, env);
    register(&empty, &setup, "shared", "multi-node-multi-writer");
    let (empty_root, loaded_root) = (&setup.mount_root, &dir.join("mounts"));
    // One untimed cycle each: connections, the plugin's first calls; the
    // staging parent exists from then on.
    cycle(&empty, empty_root);
    cycle(loaded, loaded_root);
    let (mut none, mut many) = (Vec::new(), Vec::new());
    let rounds = args.same_disk_rounds;
    for round in 0..rounds {
        if round % 2 == 0 {
            none.push(cycle(&empty, empty_root));
            many.push(cycle(loaded, loaded_root));
        } else {
            many.push(cycle(loaded, loaded_root));
            none.push(cycle(&empty, empty_root));
        }
    }
    agent.stop();
    let [dirs0, rest0, own0, cpu0, wait0, rel0, rcpu0] = medians(&none);
    let [dirs, rest, own, cpu, wait, rel, rcpu] = medians(&many);
    results.insert(
        format!("same_disk_{n}"),
        json!({
            "allocs_on_record": n,
            "rounds": rounds,
            "own_mount_ms_median": {"none": own0, "n": own},
            "bare_dirs_ms_median": {"none": dirs0, "n": dirs},
            "own_mount_less_bare_dirs_ms_median": {"none": rest0, "n": rest},
            "cpu_per_mount_ms_median": {"none": cpu0, "n": cpu},
            "mount_wait_for_durability_ms_median": {"none": wait0, "n": wait},
            "own_release_ms_median": {"none": rel0, "n": rel},
            "cpu_per_release_ms_median": {"none": rcpu0, "n": rcpu},
            "own_mount_ratio": own / own0,
            "own_mount_less_bare_dirs_ratio": rest / rest0,
            "cpu_per_mount_ratio": cpu / cpu0,
        }),
    );
    table.push((
        format!(
            "same disk, same moment, {rounds} alternating rounds: an agent with none / with {n} on record; own part of a mount, the same directories made bare beside it, the rest; its CPU, its wait for durability; own part of a release, its CPU (medians, ms)"
        ),
        format!(
            "mount {own0:.2} / {own:.2}, bare dirs {dirs0:.2} / {dirs:.2}, rest {rest0:.2} / {rest:.2}; CPU {cpu0:.2} / {cpu:.2}, wait {wait0:.2} / {wait:.2}; release {rel0:.2} / {rel:.2}, CPU {rcpu0:.2} / {rcpu:.2}"
        ),
    ));
    table.push((
        format!("target: the agent's own part of a mount with {n} on record <= 1.5x of none"),
        format!(
            "{:.2}x ({own:.2} vs {own0:.2} ms); less the bare directories' time {:.2}x ({rest:.2} vs {rest0:.2} ms); its CPU per mount {:.2}x ({cpu:.2} vs {cpu0:.2} ms)",
            own / own0,
            rest / rest0,
            cpu / cpu0
        ),
    ));
}
