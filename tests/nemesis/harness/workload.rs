//! The workload: clients that mount and release volumes on random nodes
//! through the CLI, a writer thread per acknowledged read-write holding
//! that appends records into the volume through its target path, and a
//! sampler of the mount table. Everything they do is logged with wall-clock
//! times (the call logs' clock) and since-start times.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::nodes::{cli, Out, CLI_DEADLINE, PREFIX};
use super::rng::Rng;

/// The file every holder appends to, in every read-write volume.
pub const RECORDS_FILE: &str = "records";

pub fn wall_ms() -> u64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970");
    u64::try_from(d.as_millis()).expect("milliseconds fit u64")
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process here.
pub fn monotonic_ns() -> u128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u128::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u128::try_from(ts.tv_nsec).unwrap_or(0)
}

/// A volume of the run: `rw` ones are single-writer and written; the
/// others are multi-node reader-only, mounted read-only (and read: see
/// `evidence.rs`). A `readers` volume (multi-node-single-writer) is
/// mounted read-only by one mount in three (chosen by the client's draw)
/// and read while its writer writes.
#[derive(Clone, Debug)]
pub struct VolSpec {
    pub id: String,
    pub access: String,
    pub rw: bool,
    pub readers: bool,
}

/// Where the workload's release of an allocation stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    NotAsked,
    /// Asked; `done`: the command said every volume was released.
    Asked {
        done: bool,
    },
    /// The agent could not be reached to ask; retried.
    Undelivered,
}

/// An allocation the workload asked for.
#[derive(Clone, Debug)]
pub struct Alloc {
    pub id: String,
    pub node: String,
    pub volume: String,
    /// Mounted read-write (its holder writes records); false: read-only
    /// (its holder reads them).
    pub rw: bool,
    /// The mount command answered OK.
    pub acked: bool,
    pub host_path: Option<PathBuf>,
    /// create_revision of its claim when the mount was acknowledged (0:
    /// not read).
    pub epoch: i64,
    pub release: Release,
    pub acked_at_ms: u64,
}

/// What every thread of the run shares.
pub struct Shared {
    pub t0: Instant,
    pub events: Mutex<Vec<Value>>,
    pub allocs: Mutex<Vec<Alloc>>,
    /// Per node: its writers hold still (an agent paused with its workload).
    pub writers_paused: Vec<AtomicBool>,
    /// Per node: how many times it was lost (`faults::Kind::NodeLost`),
    /// behind a lock each holding's writer or reader holds across one
    /// write or read: a holding mounted before a loss never writes or
    /// reads again, and none is in the middle of one once the count moved.
    pub node_losses: Vec<std::sync::RwLock<u64>>,
    pub writers_stop: AtomicBool,
    pub stop_clients: AtomicBool,
    pub records_written: AtomicU64,
    pub write_errors: AtomicU64,
    pub node_names: Vec<String>,
    pub sockets: Vec<PathBuf>,
    pub etcd_endpoints: Vec<String>,
    /// Writers and readers of holdings kept at the end of the workload.
    pub lingering: Mutex<Vec<Holder>>,
    /// Releases (index into `allocs`) no agent took yet.
    pub undelivered: Mutex<Vec<usize>>,
    /// Agents that exited without being killed.
    pub crashes: Mutex<Vec<String>>,
    /// Faults of the harness's own infrastructure the run survived (an etcd
    /// member that did not serve again in time): reported, never a
    /// violation.
    pub infrastructure: Mutex<Vec<String>>,
    /// Every read of a read-only holding (`evidence.rs`).
    pub reads: Mutex<Vec<super::evidence::Read>>,
}

impl Shared {
    pub fn since_ms(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn event(&self, mut e: Value) {
        e["t_ms"] = json!(self.since_ms());
        e["wall_ms"] = json!(wall_ms());
        self.events.lock().expect("events lock").push(e);
    }

    /// The node's loss count now (read before a mount is asked: its
    /// holding's writer or reader stops once the count moves).
    pub fn losses(&self, ni: usize) -> u64 {
        *self.node_losses[ni].read().expect("node_losses lock")
    }

    pub fn node_index(&self, node: &str) -> usize {
        self.node_names
            .iter()
            .position(|n| n == node)
            .expect("a node of the run")
    }

    fn etcd(&self) -> claimd::etcd::EtcdClient {
        claimd::etcd::EtcdClient::connect(
            &self.etcd_endpoints,
            claimd::etcd::EtcdOptions {
                call_timeout: Duration::from_secs(2),
                tls: None,
            },
        )
        .expect("connect to etcd")
    }
}

/// Appends one record: open (never create: an unmounted target has no
/// records file), write, fsync, close.
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    let mut f = OpenOptions::new().append(true).open(path)?;
    f.write_all(line.as_bytes())?;
    f.sync_all()
}

/// A writer thread of one holding.
pub struct Writer {
    stop: Arc<AtomicBool>,
    handle: thread::JoinHandle<()>,
}

impl Writer {
    /// `losses`: the node's loss count before the mount was asked.
    pub fn start(shared: &Arc<Shared>, a: &Alloc, period: Duration, losses: u64) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sh) = (stop.clone(), shared.clone());
        let path = a
            .host_path
            .as_ref()
            .expect("an acknowledged mount has a path")
            .join(RECORDS_FILE);
        let (node, alloc, epoch) = (a.node.clone(), a.id.clone(), a.epoch);
        let ni = shared.node_index(&node);
        let handle = thread::Builder::new()
            .name(format!("writer-{alloc}"))
            .spawn(move || {
                let (mut seq, mut errors, mut first_error) = (0u64, 0u64, None::<String>);
                while !st.load(Ordering::SeqCst) && !sh.writers_stop.load(Ordering::SeqCst) {
                    if sh.writers_paused[ni].load(Ordering::SeqCst) {
                        thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let gate = sh.node_losses[ni].read().expect("node_losses lock");
                    if *gate != losses {
                        // Its node was lost: this holding is gone with it.
                        break;
                    }
                    let line = format!("{node} {alloc} {epoch} {seq} {}\n", monotonic_ns());
                    let written = append(&path, &line);
                    drop(gate);
                    match written {
                        Ok(()) => {
                            seq += 1;
                            sh.records_written.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            errors += 1;
                            sh.write_errors.fetch_add(1, Ordering::Relaxed);
                            first_error.get_or_insert_with(|| e.to_string());
                        }
                    }
                    thread::sleep(period);
                }
                sh.event(json!({"kind": "writer-end", "alloc": alloc, "node": node,
                    "records": seq, "errors": errors, "first_error": first_error}));
            })
            .expect("start a writer");
        Writer { stop, handle }
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.handle.join();
    }
}

/// What an acknowledged holding leaves as evidence while it is held.
pub enum Holder {
    Writer(Writer),
    Reader(super::evidence::Reader),
}

impl Holder {
    pub fn stop(self) {
        match self {
            Holder::Writer(w) => w.stop(),
            Holder::Reader(r) => r.stop(),
        }
    }
}

/// The claim's create_revision in etcd, 0 if it cannot be read.
fn epoch_of(shared: &Shared, volume: &str, alloc: &str) -> i64 {
    shared
        .etcd()
        .get(format!("{PREFIX}/claims/{volume}/{alloc}"))
        .ok()
        .flatten()
        .map_or(0, |kv| kv.create_revision)
}

fn op_event(shared: &Shared, op: &str, node: &str, alloc: &str, vol: &str, start: u64, out: &Out) {
    shared.event(json!({"kind": "op", "op": op, "node": node, "alloc": alloc,
        "volume": vol, "start_ms": start, "end_ms": shared.since_ms(),
        "outcome": out.brief(), "code": out.code}));
}

/// Asks node `node` to release `alloc` (not waiting unless `wait`);
/// `Undelivered` when the agent did not take the request.
pub fn release(shared: &Shared, node: &str, alloc: &str, vol: &str, wait: bool) -> Release {
    let socket = &shared.sockets[shared.node_index(node)];
    let start = shared.since_ms();
    let mut args = vec!["alloc", "release", alloc, "--json"];
    if wait {
        args.extend(["--wait", "20s"]);
    }
    let out = cli(socket, &args, CLI_DEADLINE);
    op_event(
        shared,
        if wait { "release" } else { "release-abandoned" },
        node,
        alloc,
        vol,
        start,
        &out,
    );
    match (out.code, out.json()) {
        (Some(0), Some(j)) => Release::Asked {
            done: j["done"] == true,
        },
        // Exit 1 with an answer: asked, not finished within the wait.
        (Some(1), Some(j)) if j["alloc_id"] == alloc => Release::Asked { done: false },
        (Some(1), _) if wait && out.stderr.contains("not finished") => {
            Release::Asked { done: false }
        }
        _ => Release::Undelivered,
    }
}

/// One workload client: `mine` are its holdings (index into
/// `shared.allocs`, writer).
pub fn client(
    shared: &Arc<Shared>,
    k: usize,
    mut rng: Rng,
    volumes: &[VolSpec],
    deadline: Instant,
) {
    let mut mine: Vec<(usize, Holder)> = Vec::new();
    let mut undelivered: Vec<usize> = Vec::new();
    let mut n = 0;
    while Instant::now() < deadline && !shared.stop_clients.load(Ordering::SeqCst) {
        // Every choice drawn every round, used or not: the schedule does
        // not depend on earlier outcomes.
        let think = rng.range(100, 1200);
        let roll = rng.below(100);
        let ni = rng.index(shared.node_names.len());
        let vi = rng.index(volumes.len());
        let ri = rng.next_u64();
        let period = rng.range(20, 60);
        thread::sleep(Duration::from_millis(think));
        undelivered.retain(|&i| retry_release(shared, i));
        let mount = mine.is_empty() || (mine.len() < 2 && roll < 50);
        if mount {
            let (node, vol) = (shared.node_names[ni].clone(), volumes[vi].clone());
            let alloc = format!("{node}-k{k}-{n}");
            n += 1;
            // `ri` chooses the holding to release otherwise.
            let rw = vol.rw && !(vol.readers && ri % 3 == 0);
            let spec = if rw {
                format!("data={}", vol.id)
            } else {
                format!("data={},ro", vol.id)
            };
            let start = shared.since_ms();
            let losses = shared.losses(ni);
            let out = cli(
                &shared.sockets[ni],
                &[
                    "alloc",
                    "mount",
                    &alloc,
                    "--volume",
                    &spec,
                    "--json",
                    "--timeout",
                    "10s",
                ],
                CLI_DEADLINE,
            );
            op_event(shared, "mount", &node, &alloc, &vol.id, start, &out);
            let host_path = out
                .json()
                .and_then(|j| j["volumes"][0]["host_path"].as_str().map(PathBuf::from));
            let acked = out.code == Some(0) && host_path.is_some();
            let mut a = Alloc {
                id: alloc.clone(),
                node: node.clone(),
                volume: vol.id.clone(),
                rw,
                acked,
                host_path,
                epoch: 0,
                release: Release::NotAsked,
                acked_at_ms: shared.since_ms(),
            };
            if acked {
                a.epoch = epoch_of(shared, &vol.id, &alloc);
            }
            let idx = {
                let mut allocs = shared.allocs.lock().expect("allocs lock");
                allocs.push(a.clone());
                allocs.len() - 1
            };
            if acked {
                let period = Duration::from_millis(period);
                let h = if rw {
                    Holder::Writer(Writer::start(shared, &a, period, losses))
                } else {
                    Holder::Reader(super::evidence::Reader::start(shared, &a, period, losses))
                };
                mine.push((idx, h));
            } else {
                // The orchestrator gives up on it: release what the agent
                // may still be doing.
                let r = release(shared, &node, &alloc, &vol.id, false);
                if r == Release::Undelivered {
                    undelivered.push(idx);
                }
                shared.allocs.lock().expect("allocs lock")[idx].release = r;
            }
        } else {
            let j = usize::try_from(ri % mine.len() as u64).expect("fits");
            let (idx, h) = mine.remove(j);
            h.stop();
            let a = shared.allocs.lock().expect("allocs lock")[idx].clone();
            let r = release(shared, &a.node, &a.id, &a.volume, true);
            if r == Release::Undelivered {
                undelivered.push(idx);
            }
            shared.allocs.lock().expect("allocs lock")[idx].release = r;
        }
    }
    // Holdings stay (their writers and readers too) for the end-state
    // checks.
    for (_, h) in mine {
        shared.lingering.lock().expect("lingering lock").push(h);
    }
    for i in undelivered {
        shared.undelivered.lock().expect("undelivered lock").push(i);
    }
}

/// Tries an undelivered release again; false once it was delivered.
pub fn retry_release(shared: &Shared, idx: usize) -> bool {
    let a = shared.allocs.lock().expect("allocs lock")[idx].clone();
    let r = release(shared, &a.node, &a.id, &a.volume, a.acked);
    let again = r == Release::Undelivered;
    shared.allocs.lock().expect("allocs lock")[idx].release = r;
    again
}

/// A mount of a volume target seen in the mount table: from the first to
/// the last sample that showed it (wall-clock ms).
#[derive(Clone, Debug)]
pub struct Seen {
    pub node: String,
    pub alloc: String,
    pub volume: String,
    pub first_ms: u64,
    pub last_ms: u64,
}

/// Samples /proc/self/mountinfo until `stop`: the targets under each
/// node's `per-alloc` directory.
pub fn sample_mounts(
    roots: &[(String, PathBuf)],
    stop: &AtomicBool,
    period: Duration,
) -> Vec<Seen> {
    let mut open: HashMap<(String, String, String), Seen> = HashMap::new();
    let mut done = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let now = wall_ms();
        let mut present = std::collections::HashSet::new();
        for m in crate::common::mounts() {
            for (node, root) in roots {
                let Ok(rest) = m.mount_point.strip_prefix(root.join("per-alloc")) else {
                    continue;
                };
                let parts: Vec<String> = rest
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if parts.len() >= 2 {
                    present.insert((node.clone(), parts[0].clone(), parts[1].clone()));
                }
            }
        }
        for key in &present {
            open.entry(key.clone())
                .and_modify(|s| s.last_ms = now)
                .or_insert_with(|| Seen {
                    node: key.0.clone(),
                    alloc: key.1.clone(),
                    volume: key.2.clone(),
                    first_ms: now,
                    last_ms: now,
                });
        }
        let gone: Vec<_> = open
            .keys()
            .filter(|k| !present.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            done.push(open.remove(&k).expect("an open interval"));
        }
        thread::sleep(period);
    }
    done.extend(open.into_values());
    done
}
