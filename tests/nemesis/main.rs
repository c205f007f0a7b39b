//! The nemesis (issue 22 part B): a randomized, seeded fault-injection run
//! of three real agents against a 3-member etcd cluster, in the manner of
//! etcd's robustness tests and Jepsen.
//!
//! Each node has its own agent, test plugin (node-local plugin state, one
//! shared storage for the volume data) and link to etcd (a proxy per
//! member). Workload clients mount and release single-writer and
//! multi-reader volumes on random nodes through the CLI; every
//! acknowledged read-write holding writes records (`node alloc epoch seq
//! monotonic_ns`) into the volume through its target path, one
//! open-append-fsync-close each, and every read-only holding reads them
//! back and logs what it saw (`tests/nemesis/harness/evidence.rs`). Meanwhile
//! faults chosen by the seed (`tests/nemesis/harness/faults.rs`): SIGKILL and
//! restart of an agent, a power cut of an agent that also loses the state
//! writes the design allows to lose (`tests/nemesis/harness/power_cut.rs`),
//! SIGSTOP of an agent (alone or with its workload) for longer than lease
//! TTL + window, a cut link (both ways, requests only, answers only), a
//! cut link with an agent restart or power cut inside it, an etcd member
//! cut from the other two (clients still on it), the etcd leader killed,
//! a plugin restart, slow or late ControllerPublish/Unpublish; in a
//! seed-chosen share of the rounds two of them overlap. From a third
//! stream (issue 37), some rounds are followed by a link flap (cut long
//! enough to be counted gone, healed for about a TTL, cut again), the
//! node's liveness key deleted by hand, or a link cut longer than TTL + W
//! (the other nodes' reapers fence and free; the older faults all heal
//! before that); from a fourth, a crash between two writes, a pause after
//! the lease check, a node lost and freed by hand; from a fifth, a flap
//! during another node's reap. Then everything is healed, the
//! run settles, and the checker (`tests/nemesis/harness/checker.rs`, check (5)
//! in `evidence.rs`, check (6), no fence before a node's W, in
//! `fences.rs`) lists violations. With a controller host (one or two, chosen by the seed),
//! every plugin shares one storage that fences on ControllerUnpublish.
//!
//! Environment:
//!   NEMESIS_SEED     the seed (a number, or `random`); default
//!                    `DEFAULT_SEED`, a schedule that failed on e20db15
//!   NEMESIS_SECONDS  how long faults and workload run [default 40]
//!   NEMESIS_DISCONNECT  `on`/`off`: force stop_after_disconnect (else the
//!                    seed chooses)
//!   NEMESIS_HOSTS    `0`, `1` or `2`: force the number of controller
//!                    hosts (else the seed chooses)
//!   NEMESIS_EPOCHS   `on`/`off`: force the claim's epoch to the plugins
//!                    (else the seed chooses, half)
//!   NEMESIS_FREE_UNFENCED  `on`/`off`: force `free_unfenced_claims` in a
//!                    run with the window (else the seed chooses, half)
//!   NEMESIS_FLAP_DURING_REAP  `on`: a flap during a reap after every round
//!   NEMESIS_OUT      keep the run's records here (default: a directory
//!                    under /tmp, printed; removed after a clean run unless
//!                    NEMESIS_KEEP=1)

#[path = "../support/agent.rs"]
mod agent_support;
#[path = "../support/common/mod.rs"]
mod common;
mod harness;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::harness::checker::{self, EndState, Interval, Violation};
use crate::harness::etcd_cluster::EtcdCluster;
use crate::harness::evidence::{self, FinalFile};
use crate::harness::faults::{self, Kind, Plan};
use crate::harness::fences;
use crate::harness::nodes::*;
use crate::harness::rng::Rng;
use crate::harness::workload::{self, Release, Shared, VolSpec, RECORDS_FILE};
use serde_json::{json, Value};

/// The in-suite seed: a regression test. On e20db15 its schedule
/// (stop_after_disconnect 4 s, node-only plugins, a SIGSTOP longer than
/// TTL + window among its faults) found violations in 3 of 3 runs: mounts
/// sent to a paused node ran after SIGCONT with its lease expired, the
/// cluster freed those claims and another node wrote next to it. Other
/// seeds that failed there: 1, 6, 7 (40 s), 12, 13 (150 s); every one of
/// them passes now. With overlapping faults, power cuts and readers added
/// (its primary faults are drawn as before), seed 2 still failed on
/// e20db15 in 3 of 3 runs (checks 1, 2 and 5: node c's records and reads
/// after the cluster had freed its claims) and passes now. A long run
/// takes `NEMESIS_SEED=random` and a larger `NEMESIS_SECONDS`; a seed that
/// fails becomes the default, or a test of its own.
///
/// Named cases (issue 41), run with `NEMESIS_SECONDS=120`: seed 657716
/// found, once on f62dff5 (a rerun there was clean), a staging and an
/// attachment left on a node by a last holder that had not set them up,
/// and a take that landed after its mount was rolled back (each now has a
/// deterministic test: tests/local/lifecycle/, tests/cluster/partial_failures/);
/// seed 257714 panicked in the harness when an etcd member did not serve
/// again after a leader kill (now an infrastructure fault in the summary).
/// Rerun once each on 3eaf0e8: 0 violations, no infrastructure fault.
const DEFAULT_SEED: u64 = 2;
const DEFAULT_SECONDS: u64 = 40;
const NODES: [&str; 3] = ["a", "b", "c"];
const LEASE_TTL: Duration = Duration::from_secs(2);
const STOP_AFTER_DISCONNECT: Duration = Duration::from_secs(4);
/// The agents' `csi_call_timeout` (`tests/nemesis/harness/nodes.rs`).
const CSI_CALL: Duration = Duration::from_secs(3);
/// How long the healed cluster may take to have nothing in flight.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How long releases that could not be delivered are retried after heal.
const REDELIVER_TIMEOUT: Duration = Duration::from_secs(60);
const WORKLOAD_CLIENTS: usize = 3;
const SAMPLE_PERIOD: Duration = Duration::from_millis(20);
/// How often the harness reads the claims (check 5).
const CLAIMS_POLL: Duration = Duration::from_millis(100);
/// Records the harness writes into the reader-only volume before the start.
const FIXED_RECORDS: usize = 16;

fn env_u64(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

fn seed() -> u64 {
    match env_u64("NEMESIS_SEED").as_deref() {
        None => DEFAULT_SEED,
        Some("random") => {
            let t = workload::monotonic_ns() as u64 ^ u64::from(std::process::id()) << 32;
            Rng::new(t).next_u64() % 1_000_000
        }
        Some(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("NEMESIS_SEED={s:?} is not a number or `random`")),
    }
}

fn volumes() -> Vec<VolSpec> {
    [
        ("sw0", "single-node-writer", true, false),
        ("sw1", "single-node-single-writer", true, false),
        ("sw2", "multi-node-single-writer", true, true),
        ("mr0", "multi-node-reader-only", false, true),
    ]
    .iter()
    .map(|(id, access, rw, readers)| VolSpec {
        id: id.to_string(),
        access: access.to_string(),
        rw: *rw,
        readers: *readers,
    })
    .collect()
}

/// What the harness writes into the reader-only volume: no holder may
/// change it.
fn fixed_records(volume: &str) -> String {
    (0..FIXED_RECORDS)
        .map(|i| format!("harness {volume} 0 {i} 0\n"))
        .collect()
}

/// The claims and `freed/` notes in etcd now.
fn read_claims(etcd: &claimd::etcd::EtcdClient, end: &mut EndState) -> Result<(), String> {
    use claimd::etcd::{TxnOp, TxnOpResponse};
    // The claims and the per-node claim index at one revision (one Txn).
    let t = etcd
        .txn(
            &[],
            &[
                TxnOp::get_prefix(format!("{PREFIX}/claims/")),
                TxnOp::get_prefix(format!("{PREFIX}/node-claims/")),
            ],
            &[],
        )
        .map_err(|e| format!("read the claims and their index: {e}"))?;
    let mut ranges = t.responses.into_iter().filter_map(|r| match r {
        TxnOpResponse::Range(r) => Some(r),
        _ => None,
    });
    let (Some(claims), Some(index)) = (ranges.next(), ranges.next()) else {
        return Err("the read of the claims and their index lacks a range".to_string());
    };
    for kv in &claims.kvs {
        let key = kv.key_str();
        let rest = &key[PREFIX.len() + "/claims/".len()..];
        let Some((vol, alloc)) = rest.split_once('/') else {
            continue;
        };
        let val: Value = serde_json::from_slice(&kv.value).unwrap_or(Value::Null);
        let c = if val["node"].is_string() {
            &val
        } else {
            &val["claim"]
        };
        end.claims.insert(
            (vol.to_string(), alloc.to_string()),
            (
                c["node"].as_str().unwrap_or("?").to_string(),
                c["state"].as_str().unwrap_or("?").to_string(),
            ),
        );
    }
    for kv in &index.kvs {
        let key = kv.key_str();
        let rest = &key[PREFIX.len() + "/node-claims/".len()..];
        let mut parts = rest.splitn(3, '/');
        if let (Some(node), Some(vol), Some(alloc)) = (parts.next(), parts.next(), parts.next()) {
            end.index
                .insert((node.to_string(), vol.to_string(), alloc.to_string()));
        }
    }
    let freed = etcd
        .range_prefix(format!("{PREFIX}/freed/"))
        .map_err(|e| format!("read the freed notes: {e}"))?;
    for kv in &freed.kvs {
        let key = kv.key_str();
        let rest = &key[PREFIX.len() + "/freed/".len()..];
        if let Some((vol, alloc)) = rest.split_once('/') {
            let val: Value = serde_json::from_slice(&kv.value).unwrap_or(Value::Null);
            let reason = val["reason"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| String::from_utf8_lossy(&kv.value).into_owned());
            end.freed
                .insert((vol.to_string(), alloc.to_string()), reason);
        }
    }
    Ok(())
}

/// `alloc status --json` of a node; its allocations' volumes.
fn alloc_status(n: &Node) -> Result<Value, String> {
    let out = cli(n.socket(), &["alloc", "status", "--json"], CLI_DEADLINE);
    match (out.code, out.json()) {
        (Some(0), Some(j)) => Ok(j),
        _ => Err(format!("node {}: alloc status: {}", n.name, out.brief())),
    }
}

/// What is still in flight: empty once settled.
fn in_flight(nodes: &[Node], etcd: &claimd::etcd::EtcdClient) -> Vec<String> {
    let mut out = Vec::new();
    for n in nodes {
        match alloc_status(n) {
            Err(e) => out.push(e),
            Ok(st) => {
                for a in st["allocs"].as_array().into_iter().flatten() {
                    for v in a["volumes"].as_array().into_iter().flatten() {
                        if a["releasing"] == true || v["phase"] != "published" {
                            out.push(format!(
                                "node {}: {} {} phase {} release {} {}",
                                n.name,
                                a["id"].as_str().unwrap_or("?"),
                                v["volume_id"].as_str().unwrap_or("?"),
                                v["phase"],
                                v["release_state"],
                                v["message"]
                                    .as_str()
                                    .or(v["release_error"].as_str())
                                    .unwrap_or("")
                            ));
                        }
                    }
                }
            }
        }
    }
    let mut end = EndState::default();
    match read_claims(etcd, &mut end) {
        Err(e) => out.push(e),
        Ok(()) => {
            for ((vol, alloc), (node, state)) in &end.claims {
                if state != "taken" {
                    out.push(format!("claim {vol}/{alloc} on {node}: {state}"));
                }
            }
        }
    }
    out
}

/// The local records and mounts of every node, and etcd's claims.
fn end_state(nodes: &[Node], etcd: &claimd::etcd::EtcdClient) -> Result<EndState, String> {
    let mut end = EndState::default();
    read_claims(etcd, &mut end)?;
    for n in nodes {
        let st = alloc_status(n)?;
        for a in st["allocs"].as_array().into_iter().flatten() {
            for v in a["volumes"].as_array().into_iter().flatten() {
                end.records.insert(
                    (
                        n.name.clone(),
                        a["id"].as_str().unwrap_or("?").to_string(),
                        v["volume_id"].as_str().unwrap_or("?").to_string(),
                    ),
                    v["phase"].as_str().unwrap_or("?").to_string(),
                );
            }
        }
        let root = fs::canonicalize(n.mount_root()).unwrap_or_else(|_| n.mount_root());
        for m in mounts_under(&root) {
            let rel = m.mount_point.strip_prefix(&root).expect("under the root");
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            match parts.first().map(String::as_str) {
                Some("per-alloc") if parts.len() >= 3 => {
                    end.targets
                        .insert((n.name.clone(), parts[1].clone(), parts[2].clone()));
                }
                // staging/<plugin>/<volume>
                Some("staging") if parts.len() >= 3 => {
                    end.stagings.insert((n.name.clone(), parts[2].clone()));
                }
                _ => {}
            }
        }
    }
    Ok(end)
}

#[test]
fn nemesis() {
    let seed = seed();
    eprintln!("nemesis: seed {seed} (run again with NEMESIS_SEED={seed})");
    let seconds = env_u64("NEMESIS_SECONDS")
        .map(|s| s.parse().expect("NEMESIS_SECONDS is a number"))
        .unwrap_or(DEFAULT_SECONDS);
    let began = Instant::now();
    let rng = Rng::new(seed);
    let mut choose = rng.fork(0);
    let disconnect = match env_u64("NEMESIS_DISCONNECT").as_deref() {
        Some("on") => true,
        Some("off") => false,
        _ => choose.chance(60),
    };
    let host = choose.chance(50).then(|| choose.pick(&NODES).to_string());
    // Drawn after what runs before two hosts existed drew: a second host.
    let second = choose.chance(50);
    let mut hosts: Vec<String> = host.into_iter().collect();
    let wanted = match env_u64("NEMESIS_HOSTS").as_deref() {
        None => hosts.len() + usize::from(second && !hosts.is_empty()),
        Some(n) => n
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= 2)
            .unwrap_or_else(|| panic!("NEMESIS_HOSTS={n:?} is not 0, 1 or 2")),
    };
    hosts.truncate(wanted);
    while hosts.len() < wanted {
        let others: Vec<&str> = NODES
            .iter()
            .copied()
            .filter(|n| !hosts.iter().any(|h| h == n))
            .collect();
        hosts.push(choose.pick(&others).to_string());
    }
    // Drawn last (the draws before it are as they were): half of the
    // runs with the window free the claims nothing can fence.
    let free_unfenced = disconnect
        && match env_u64("NEMESIS_FREE_UNFENCED").as_deref() {
            Some("on") => true,
            Some("off") => false,
            _ => choose.chance(50),
        };
    // Drawn after that: half of the runs give the plugins the claim's
    // epoch (`cluster.epoch_plugins`, the test plugin's `--epoch-key`);
    // only those draw a pause between a call's lease check and its send,
    // which README Safety rule 11 covers only with epochs.
    let epochs = match env_u64("NEMESIS_EPOCHS").as_deref() {
        Some("on") => true,
        Some("off") => false,
        _ => choose.chance(50),
    };
    let settings = NodeSettings {
        lease_ttl: LEASE_TTL,
        stop_after_disconnect: disconnect.then_some(STOP_AFTER_DISCONNECT),
        controller_hosts: hosts.clone(),
        free_unfenced,
        epochs,
    };
    let mut kinds = vec![
        Kind::AgentKill,
        Kind::AgentStop,
        Kind::AgentStopWithWorkload,
        Kind::LinkCut,
        Kind::LinkCut,
        Kind::CutAndRestart,
        Kind::MemberIsolate,
        Kind::LeaderKill,
        Kind::PluginRestart,
    ];
    if !hosts.is_empty() {
        kinds.push(Kind::SlowController);
    }
    let reap = {
        use claimd::claims::margins;
        LEASE_TTL
            + margins::observer_wait(
                STOP_AFTER_DISCONNECT,
                margins::unmount_bound(CSI_CALL),
                margins::tau(margins::self_release_period(LEASE_TTL)),
            )
    };
    let plan = Plan {
        kinds,
        epochs,
        lease_ttl_ms: 2000,
        window_ms: 4000,
        reap_ms: reap.as_millis() as u64,
    };
    eprintln!(
        "nemesis: {seconds} s; lease_ttl 2s; stop_after_disconnect {}{}; epochs {}; controller hosts {}",
        if disconnect { "4s" } else { "off" },
        if free_unfenced {
            " with free_unfenced_claims"
        } else {
            ""
        },
        if epochs { "on" } else { "off" },
        if hosts.is_empty() {
            "none (node-only plugins)".to_string()
        } else {
            hosts.join(", ")
        }
    );

    let dir = TestDir::new();
    let out_dir = env_u64("NEMESIS_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("claimd-nemesis-{seed}-{}", std::process::id()))
        });
    fs::create_dir_all(&out_dir).expect("create the output directory");
    let storage = dir.mkdir("storage/volumes");
    let vols = volumes();
    for v in &vols {
        let d = storage.join(format!("ext-{}", v.id));
        fs::create_dir_all(&d).expect("create a volume");
        let text = if v.rw {
            String::new()
        } else {
            fixed_records(&v.id)
        };
        fs::write(d.join(RECORDS_FILE), text).expect("create the records file");
    }
    let mut etcd = EtcdCluster::start(dir.path(), &format!("nemesis-{seed}"));
    let members = etcd.client_addrs();
    let mut nodes: Vec<Node> = NODES
        .iter()
        .map(|n| Node::prepare(dir.path(), &storage, n, &NODES, &settings, &members))
        .collect();
    let harness_etcd = etcd.client();
    for n in nodes.iter_mut() {
        n.start_agent();
        if n.is_host {
            let key = format!(
                "{PREFIX}/plugins/{}/controllers/{}",
                crate::agent_support::PLUGIN_ID,
                n.name
            );
            wait_until(SHOW_TIMEOUT, "the controller host's registration", || {
                harness_etcd.get(&key).ok().flatten().is_some()
            });
        }
    }
    for n in &nodes {
        for v in &vols {
            n.agent.register(&volume(&v.id, &v.access));
        }
    }
    eprintln!("nemesis: set up in {:?}", began.elapsed());

    let shared = Arc::new(Shared {
        t0: Instant::now(),
        events: Mutex::new(Vec::new()),
        allocs: Mutex::new(Vec::new()),
        writers_paused: NODES.iter().map(|_| AtomicBool::new(false)).collect(),
        node_losses: NODES.iter().map(|_| std::sync::RwLock::new(0)).collect(),
        writers_stop: AtomicBool::new(false),
        stop_clients: AtomicBool::new(false),
        records_written: AtomicU64::new(0),
        write_errors: AtomicU64::new(0),
        node_names: NODES.iter().map(|n| n.to_string()).collect(),
        sockets: nodes.iter().map(|n| n.socket().to_path_buf()).collect(),
        etcd_endpoints: etcd.members.iter().map(|m| m.endpoint()).collect(),
        lingering: Mutex::new(Vec::new()),
        undelivered: Mutex::new(Vec::new()),
        crashes: Mutex::new(Vec::new()),
        infrastructure: Mutex::new(Vec::new()),
        reads: Mutex::new(Vec::new()),
    });
    let roots: Vec<(String, PathBuf)> = nodes
        .iter()
        .map(|n| {
            let r = n.mount_root();
            (n.name.clone(), fs::canonicalize(&r).unwrap_or(r))
        })
        .collect();
    let sampler_stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (roots, stop) = (roots.clone(), sampler_stop.clone());
        thread::Builder::new()
            .name("mount-sampler".into())
            .spawn(move || workload::sample_mounts(&roots, &stop, SAMPLE_PERIOD))
            .expect("start the sampler")
    };
    let claims_watch = {
        let (client, stop) = (etcd.client(), sampler_stop.clone());
        thread::Builder::new()
            .name("claims-watch".into())
            .spawn(move || evidence::watch_claims(&client, &stop, CLAIMS_POLL))
            .expect("start the claims watch")
    };
    let revision_polls = {
        let (client, stop) = (etcd.client(), sampler_stop.clone());
        thread::Builder::new()
            .name("revision-polls".into())
            .spawn(move || fences::poll_revisions(&client, &stop, CLAIMS_POLL))
            .expect("start the revision polls")
    };

    // ---- Workload and faults ----
    let deadline = Instant::now() + Duration::from_secs(seconds);
    thread::scope(|s| {
        for k in 0..WORKLOAD_CLIENTS {
            let (shared, vols, r) = (&shared, &vols, rng.fork(100 + k as u64));
            thread::Builder::new()
                .name(format!("client-{k}"))
                .spawn_scoped(s, move || workload::client(shared, k, r, vols, deadline))
                .expect("start a client");
        }
        let (shared, nodes, etcd, plan) = (&shared, &mut nodes, &mut etcd, &plan);
        let streams = faults::Streams {
            first: rng.fork(1),
            extra: rng.fork(2),
            newer: rng.fork(3),
            latest: rng.fork(4),
            reaps: rng.fork(5),
        };
        thread::Builder::new()
            .name("faults".into())
            .spawn_scoped(s, move || {
                faults::run(shared, nodes, etcd, streams, plan, deadline)
            })
            .expect("start the faults");
    });
    let workload_end = shared.since_ms();

    // ---- Heal and settle ----
    etcd.heal();
    for i in 0..etcd.members.len() {
        if !etcd.members[i].is_running() || etcd.not_back.contains(&i) {
            if let Err(e) = faults::restart_member(&mut etcd, i) {
                faults::infrastructure_fault(&shared, e);
            }
        }
    }
    faults::revive_crashed(&shared, &mut nodes);
    for n in nodes.iter_mut() {
        n.link.heal();
        n.plugin.faults().clear();
        if n.agent.pid().is_none() {
            if let Err(e) = n.start_again() {
                shared.crashes.lock().expect("lock").push(e);
            }
        }
        if let Err(e) = n.wait_listening() {
            shared.crashes.lock().expect("lock").push(e);
        }
    }
    for p in &shared.writers_paused {
        p.store(false, Ordering::SeqCst);
    }
    let redeliver = Instant::now();
    loop {
        let pending: Vec<usize> = std::mem::take(&mut *shared.undelivered.lock().expect("lock"));
        let left: Vec<usize> = pending
            .into_iter()
            .filter(|&i| workload::retry_release(&shared, i))
            .collect();
        let empty = left.is_empty();
        shared.undelivered.lock().expect("lock").extend(left);
        if empty || redeliver.elapsed() > REDELIVER_TIMEOUT {
            break;
        }
        thread::sleep(Duration::from_millis(500));
    }
    let settle_start = Instant::now();
    let mut flight = in_flight(&nodes, &harness_etcd);
    while !flight.is_empty() && settle_start.elapsed() < SETTLE_TIMEOUT {
        thread::sleep(Duration::from_millis(250));
        flight = in_flight(&nodes, &harness_etcd);
    }
    let settled_after = settle_start.elapsed();
    shared.writers_stop.store(true, Ordering::SeqCst);
    for w in std::mem::take(&mut *shared.lingering.lock().expect("lock")) {
        w.stop();
    }
    sampler_stop.store(true, Ordering::SeqCst);
    let seen = sampler.join().expect("the sampler");
    let lives = claims_watch.join().expect("the claims watch");
    let polls = revision_polls.join().expect("the revision polls");

    // ---- Check ----
    let mut violations: Vec<Violation> = Vec::new();
    faults::revive_crashed(&shared, &mut nodes);
    for c in shared.crashes.lock().expect("lock").iter() {
        violations.push(Violation {
            check: 0,
            text: c.clone(),
        });
    }
    if !flight.is_empty() {
        violations.push(Violation {
            check: 3,
            text: format!(
                "not settled {SETTLE_TIMEOUT:?} after heal: {}",
                flight.join("; ")
            ),
        });
    }
    let sw: BTreeSet<String> = vols.iter().filter(|v| v.rw).map(|v| v.id.clone()).collect();
    let allocs = shared.allocs.lock().expect("lock").clone();
    let reads = std::mem::take(&mut *shared.reads.lock().expect("lock"));
    let mut records_checked = 0;
    let (mut held_checked, mut held_unknown) = (0, 0);
    let mut reads_checked = 0;
    for v in &vols {
        let text = fs::read_to_string(storage.join(format!("ext-{}", v.id)).join(RECORDS_FILE))
            .unwrap_or_default();
        if v.rw {
            let (n, vs) = checker::check_records(&v.id, &text);
            records_checked += n;
            violations.extend(vs);
            let (c, u) = evidence::check_records_held(&v.id, &text, &lives, &mut violations);
            held_checked += c;
            held_unknown += u;
        }
        let fixed = (!v.rw).then(|| fixed_records(&v.id));
        reads_checked += evidence::check_reads(
            &v.id,
            &reads,
            &FinalFile::new(text.as_bytes()),
            fixed.as_deref().map(str::as_bytes),
            &mut violations,
        );
        let _ = fs::write(out_dir.join(format!("records-{}", v.id)), text);
    }
    let (reads_held, reads_unknown) = evidence::check_reads_held(&reads, &lives, &mut violations);

    evidence::write_reads(&out_dir.join("reads.jsonl"), &reads);
    let lives_json: Vec<Value> = lives
        .iter()
        .map(|((vol, alloc, epoch), l)| {
            json!({"volume": vol, "alloc": alloc, "epoch": epoch,
            "first_ns": l.first_ns.to_string(), "gone_ns": l.gone_ns.map(|g| g.to_string())})
        })
        .collect();
    evidence::write_lines(&out_dir.join("claims-seen.jsonl"), &lives_json);
    // Check (2) is about writers: a read-only holding of a
    // multi-node-single-writer volume may sit next to its writer.
    let readers: BTreeSet<&str> = allocs
        .iter()
        .filter(|a| !a.rw)
        .map(|a| a.id.as_str())
        .collect();
    // Nodes lost and freed by hand, and the allocations they held then.
    let (losses, lost) = checker::node_losses(&shared.events.lock().expect("events lock"), &allocs);
    let mut intervals: Vec<Interval> = seen.iter().map(Interval::from).collect();
    let mut fences = Vec::new();
    let mut unpublished = BTreeSet::new();
    for n in &nodes {
        let calls = n.plugin.call_log().calls();
        intervals.extend(checker::call_log_intervals(
            &n.name,
            &calls,
            &losses.downs(&n.name),
        ));
        for c in &calls {
            if c["code"] != "OK" {
                continue;
            }
            match c["method"].as_str() {
                Some("ControllerUnpublishVolume") => fences.push((
                    c["volume_id"].as_str().unwrap_or("").to_string(),
                    c["node_id"].as_str().unwrap_or("").to_string(),
                    c["ts_ms"].as_u64().unwrap_or(0),
                )),
                Some("NodeUnpublishVolume") => {
                    if let Some((alloc, vol)) =
                        c["target_path"].as_str().and_then(checker::target_of)
                    {
                        unpublished.insert((n.name.clone(), alloc, vol));
                    }
                }
                _ => {}
            }
        }
        let _ = fs::copy(
            &n.plugin.call_log,
            out_dir.join(format!("calls-{}.jsonl", n.name)),
        );
        let _ = fs::copy(
            &n.agent.log_path,
            out_dir.join(format!("agent-{}.log", n.name)),
        );
    }
    intervals.retain(|i| !readers.contains(i.alloc.as_str()));
    let mut fenced_overlaps = 0;
    violations.extend(checker::check_overlaps(
        &sw,
        &intervals,
        &fences,
        &mut fenced_overlaps,
    ));
    let mut released_by_agent = 0;
    match end_state(&nodes, &harness_etcd) {
        Err(e) => violations.push(Violation {
            check: 3,
            text: format!("cannot read the end state: {e}"),
        }),
        Ok(end) => {
            violations.extend(checker::check_end_state(&end));
            violations.extend(checker::check_allocs(
                &allocs,
                &end,
                &unpublished,
                &lost,
                &mut released_by_agent,
            ));
        }
    }
    for n in &nodes {
        let st = cli(n.socket(), &["alloc", "status", "--json"], CLI_DEADLINE);
        let cl = cli(n.socket(), &["claim", "list", "--json"], CLI_DEADLINE);
        let _ = fs::write(
            out_dir.join(format!("status-{}.txt", n.name)),
            format!("{}\n{}\n{}\n{}", st.stdout, st.stderr, cl.stdout, cl.stderr),
        );
    }
    let history = evidence::etcd_history(&harness_etcd);
    let (early, acts) = fences::check_acts(&history, &polls);
    violations.extend(early);
    evidence::write_lines(&out_dir.join("etcd-history.jsonl"), &history);
    for m in &etcd.members {
        let _ = fs::copy(m.log_path(), out_dir.join(format!("etcd-{}.log", m.name)));
    }
    let events = shared.events.lock().expect("lock").clone();
    evidence::write_lines(&out_dir.join("events.jsonl"), &events);
    let seen_json: Vec<Value> = seen
        .iter()
        .map(|s| json!({"node": s.node, "alloc": s.alloc, "volume": s.volume, "first_ms": s.first_ms, "last_ms": s.last_ms}))
        .collect();
    evidence::write_lines(&out_dir.join("mounts-seen.jsonl"), &seen_json);

    // ---- Summary ----
    let mut ops: BTreeMap<String, usize> = BTreeMap::new();
    let mut faults_by: BTreeMap<String, usize> = BTreeMap::new();
    let mut overlaps: BTreeMap<String, usize> = BTreeMap::new();
    let mut cuts: BTreeMap<String, usize> = BTreeMap::new();
    let mut clock_back_max = 0;
    for e in &events {
        match e["kind"].as_str() {
            Some("op") => {
                let ok = if e["code"] == 0 { "ok" } else { "failed" };
                *ops.entry(format!("{} {ok}", e["op"].as_str().unwrap_or("?")))
                    .or_default() += 1;
            }
            Some("fault") => {
                *faults_by
                    .entry(e["fault"].as_str().unwrap_or("?").to_string())
                    .or_default() += 1;
                if let Some(first) = e["overlaps"].as_str() {
                    *overlaps
                        .entry(format!("{first} + {}", e["fault"].as_str().unwrap_or("?")))
                        .or_default() += 1;
                }
                let pc = &e["power_cut"];
                if pc.is_object() {
                    *cuts
                        .entry(format!("caught {}", pc["caught"].as_str().unwrap_or("?")))
                        .or_default() += 1;
                    if let Some(shape) = pc["shape"].as_str() {
                        *cuts
                            .entry(format!("journal line lost ({shape})"))
                            .or_default() += 1;
                    }
                    if let Some(ms) = pc["lease_clock_set_back_ms"].as_u64() {
                        *cuts.entry("lease clock set back".into()).or_default() += 1;
                        clock_back_max = clock_back_max.max(ms);
                    }
                }
            }
            _ => {}
        }
    }
    // What the agents said when they read a journal whose last line a
    // power cut tore (a cleanly cut one reads as whole).
    let torn_read: usize = nodes
        .iter()
        .map(|n| {
            n.agent
                .log()
                .matches("was cut off (a write interrupted by a crash)")
                .count()
        })
        .sum();
    let acked = allocs.iter().filter(|a| a.acked).count();
    let held_at_end = allocs
        .iter()
        .filter(|a| a.acked && a.release == Release::NotAsked)
        .count();
    eprintln!("nemesis: seed {seed}: workload {workload_end} ms, settled after {settled_after:?}, total {:?}", began.elapsed());
    eprintln!("nemesis: operations: {ops:?}");
    eprintln!("nemesis: allocations: {} asked, {acked} acknowledged, {held_at_end} held at the end, {released_by_agent} released by their agent", allocs.len());
    eprintln!("nemesis: faults: {faults_by:?}");
    eprintln!("nemesis: overlapping faults: {overlaps:?}");
    eprintln!("nemesis: power cuts: {cuts:?}; lease clocks set back by up to {clock_back_max} ms; torn journal tails read back by the agents: {torn_read}");
    eprintln!(
        "nemesis: records: {} written ({} write errors), {records_checked} checked; {held_checked} checked against their claim's life ({held_unknown} of unknown epoch); {} mount intervals; {fenced_overlaps} fenced overlaps",
        shared.records_written.load(Ordering::Relaxed),
        shared.write_errors.load(Ordering::Relaxed),
        intervals.len()
    );
    let reads_ok = reads.iter().filter(|r| r.ok).count();
    eprintln!(
        "nemesis: reads: {} by {} readers ({reads_ok} ok), {reads_checked} checked against the final files, {reads_held} against their claim's life ({reads_unknown} of unknown epoch)",
        reads.len(),
        readers.len()
    );
    let summary = json!({"seed": seed, "seconds": seconds, "disconnect": disconnect,
        "hosts": hosts, "ops": ops, "faults": faults_by, "overlaps": overlaps,
        "power_cuts": cuts, "torn_read": torn_read,
        "records_written": shared.records_written.load(Ordering::Relaxed),
        "records_checked": records_checked, "records_held_checked": held_checked,
        "reads": reads.len(), "reads_ok": reads_ok, "reads_checked": reads_checked,
        "acked": acked, "violations": violations.len(),
        "free_unfenced": free_unfenced, "fences": acts.fences, "reaper_frees": acts.frees,
        "acts_unbounded": acts.unknown, "revision_polls": polls.len(),
        "infrastructure": shared.infrastructure.lock().expect("lock").clone(),
        "total_s": began.elapsed().as_secs()});
    eprintln!("nemesis: summary-json {summary}");
    eprintln!(
        "nemesis: {} violation(s); the run's files are in {}",
        violations.len(),
        out_dir.display()
    );
    for v in &violations {
        eprintln!("nemesis: VIOLATION {v}");
    }
    let text: Vec<String> = violations.iter().map(Violation::to_string).collect();
    let _ = fs::write(out_dir.join("violations.txt"), text.join("\n"));
    if violations.is_empty()
        && env_u64("NEMESIS_KEEP").is_none()
        && env_u64("NEMESIS_OUT").is_none()
    {
        let _ = fs::remove_dir_all(&out_dir);
    }
    // Agents and plugins die before etcd, then the mounts go with the directory.
    drop(nodes);
    drop(etcd);
    assert!(
        violations.is_empty(),
        "nemesis seed {seed}: {} violation(s):\n{}",
        violations.len(),
        text.join("\n")
    );
}
