//! Cluster mode end to end: several real `claimd` agents (one per node,
//! each with its own state directory, mount root, API socket and test
//! plugin) sharing their claims through a real, throwaway etcd member
//! (tests/etcd_support), with real mounts. The plugins here run without a
//! controller (attachments through controller hosts are in
//! tests/cluster_controller.rs); every node registers the volumes it uses
//! (registering again replaces the shared registration).

mod agent_support;
mod common;
mod etcd_support;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use agent_support::*;
use common::*;
use etcd_support::*;
use serde_json::{json, Value};

/// The default key prefix (`cluster_section`).
const PREFIX: &str = "/claimd";
/// Longest a test waits for a mount that is not held back by anything.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a test waits for something the agent does within a few claim
/// retries (the claim backoff starts at 1 s and doubles).
const RETRY_TIMEOUT: Duration = Duration::from_secs(90);
/// Longest a test waits for an agent to show a state it reaches at once.
const SHOW_TIMEOUT: Duration = Duration::from_secs(20);

// ---- A node and a cluster ------------------------------------------------------

/// One node: an agent and its own test plugin under `<dir>/<name>/`. Field
/// order is drop order: the agent dies first.
struct Node {
    agent: Agent,
    plugin: TestPlugin,
    name: String,
}

impl Node {
    /// The plugin (no controller, node ID `ext-<name>`) and an agent in
    /// cluster mode on `endpoints` as node `name`.
    fn start(
        dir: &Path,
        name: &str,
        endpoints: &[String],
        tweak: &dyn Fn(&mut AgentConfig),
    ) -> Node {
        let (plugin, agent) = Self::prepare(dir, name, endpoints, tweak);
        let mut agent = agent;
        agent.spawn();
        agent.wait_listening();
        Node {
            agent,
            plugin,
            name: name.to_string(),
        }
    }

    /// The plugin, started, and the agent, configured but not started.
    fn prepare(
        dir: &Path,
        name: &str,
        endpoints: &[String],
        tweak: &dyn Fn(&mut AgentConfig),
    ) -> (TestPlugin, Agent) {
        let ndir = dir.join(name);
        let plugin = TestPlugin::builder(&ndir)
            .no_controller()
            .node_id(&format!("ext-{name}"))
            .start();
        let mut config =
            AgentConfig::new(&ndir, Some(&plugin.socket)).cluster_node(name, endpoints);
        tweak(&mut config);
        let agent = Agent::prepare(&ndir, "agent", config, false, &[]);
        (plugin, agent)
    }

    /// Creates the volume in this node's plugin storage and registers it
    /// with this node's agent.
    fn add_volume(&self, volume: &Value) {
        self.plugin
            .add_volume(volume["external_id"].as_str().expect("external_id"));
        self.agent.register(volume);
    }

    fn mount_root(&self) -> PathBuf {
        self.agent.config.mount_root.clone()
    }

    /// `alloc mount ALLOC --volume SPEC --json [more args]`, whatever it
    /// answers.
    fn mount(&self, alloc: &str, spec: &str, more: &[&str]) -> CliOutput {
        let mut args = vec!["alloc", "mount", alloc, "--volume", spec, "--json"];
        args.extend(more);
        self.agent.cli(&args)
    }

    /// A mount that must succeed; the host path.
    fn mount_ok(&self, alloc: &str, spec: &str) -> PathBuf {
        host_path(&self.mount(alloc, spec, &[]).ok())
    }

    /// `alloc release ALLOC --wait 30s`; must finish with everything
    /// released.
    fn release_ok(&self, alloc: &str) {
        self.agent
            .cli(&["alloc", "release", alloc, "--wait", "30s"])
            .ok();
    }

    /// The first volume of `alloc status ALLOC --json`; null while the
    /// agent does not know the allocation (a mount not recorded yet).
    fn volume_status(&self, alloc: &str) -> Value {
        let out = self.agent.cli(&["alloc", "status", alloc, "--json"]);
        if out.code == EXIT_FAILED && out.stderr.contains("is not known to this agent") {
            return Value::Null;
        }
        out.ok().json()["allocs"][0]["volumes"][0].clone()
    }

    /// `claim list --volume VOLUME --json`: the claims, in key order.
    fn claims(&self, volume: &str) -> Vec<Value> {
        let out = self
            .agent
            .cli(&["claim", "list", "--volume", volume, "--json"])
            .ok()
            .json();
        out["claims"].as_array().cloned().unwrap_or_default()
    }

    /// The targets mounted under this node's `per-alloc` directory.
    fn targets(&self) -> Vec<MountEntry> {
        mounts_under(&self.mount_root().join("per-alloc"))
    }

    /// The volume calls of this node's plugin so far.
    fn volume_calls(&self) -> Vec<String> {
        volume_methods(&self.plugin.call_log())
    }
}

/// A test's cluster. Field order is drop order: agents and plugins die
/// first, then etcd, then the directory is unmounted and removed.
struct Cluster {
    nodes: Vec<Node>,
    etcd: Etcd,
    dir: TestDir,
}

impl Cluster {
    /// etcd and one node per name, every agent talking to etcd directly.
    fn start(names: &[&str], tweak: &dyn Fn(&mut AgentConfig)) -> Cluster {
        let dir = TestDir::new();
        let etcd = Etcd::start();
        let endpoints = [etcd.endpoint()];
        let nodes = names
            .iter()
            .map(|n| Node::start(dir.path(), n, &endpoints, tweak))
            .collect();
        Cluster { nodes, etcd, dir }
    }

    /// Registers the volume on every node.
    fn add_volume(&self, volume: &Value) {
        for n in &self.nodes {
            n.add_volume(volume);
        }
    }
}

/// The host path of the first volume of `alloc mount --json`.
fn host_path(out: &CliOutput) -> PathBuf {
    PathBuf::from(
        out.json()["volumes"][0]["host_path"]
            .as_str()
            .expect("host_path is a string"),
    )
}

/// The claims of `volume` (of every volume when empty) as stored in etcd:
/// (key, value) pairs.
fn stored_claims(etcd: &Etcd, volume: &str) -> Vec<(String, Vec<u8>)> {
    let prefix = match volume {
        "" => format!("{PREFIX}/claims/"),
        v => format!("{PREFIX}/claims/{v}/"),
    };
    etcd.client()
        .range_prefix(prefix)
        .expect("read the claims from etcd")
        .kvs
        .iter()
        .map(|kv| (kv.key_str().into_owned(), kv.value.clone()))
        .collect()
}

/// The allocation IDs of a claim list.
fn holders(claims: &[Value]) -> Vec<String> {
    claims
        .iter()
        .map(|c| c["alloc_id"].as_str().expect("alloc_id").to_string())
        .collect()
}

/// What a waiting take says about its holder.
fn held_by(alloc: &str, node: &str) -> String {
    format!("by allocation {alloc} on node {node}")
}

// ---- 1. Two nodes race for one single-writer volume ----------------------------

#[test]
fn two_nodes_race_for_a_single_writer_volume() {
    let c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let mut waits = Vec::new();
    let mut winners = String::new();
    let started = Instant::now();
    for round in 0..10 {
        let allocs = [format!("r{round}-a"), format!("r{round}-b")];
        let (tx, rx) = mpsc::channel::<(usize, CliOutput)>();
        thread::scope(|s| {
            // Both mounts at once.
            for (i, node) in c.nodes.iter().enumerate() {
                let (tx, alloc) = (tx.clone(), allocs[i].clone());
                s.spawn(move || {
                    let out = node.mount(&alloc, "data=v", &[]);
                    let _ = tx.send((i, out));
                });
            }
            let (w, out) = rx
                .recv_timeout(MOUNT_TIMEOUT)
                .unwrap_or_else(|_| panic!("round {round}: neither mount finished"));
            let winner_path = host_path(&out.ok());
            let l = 1 - w;
            let (winner, loser) = (&c.nodes[w], &c.nodes[l]);
            winners.push_str(&winner.name);
            // The other waits, saying who holds the volume.
            let want = held_by(&allocs[w], &winner.name);
            wait_until(
                SHOW_TIMEOUT,
                "the loser's status to name the holder",
                || {
                    let st = loser.volume_status(&allocs[l]);
                    st["message"].as_str().unwrap_or("").contains(&want)
                },
            );
            let st = loser.volume_status(&allocs[l]);
            assert_eq!(st["phase"], "claiming", "round {round}: {st}");
            // One holder, whichever node is asked; one target mounted.
            for n in &c.nodes {
                assert_eq!(
                    holders(&n.claims("v")),
                    [allocs[w].clone()],
                    "round {round}"
                );
            }
            let targets = winner.targets();
            assert_eq!(targets.len(), 1, "round {round}: {targets:?}");
            assert_eq!(targets[0].mount_point, winner_path);
            assert!(
                loser.targets().is_empty(),
                "round {round}: {:?}",
                loser.targets()
            );
            assert!(
                rx.try_recv().is_err(),
                "round {round}: both mounts finished"
            );

            // The winner lets go; the loser mounts.
            winner.release_ok(&allocs[w]);
            let released = Instant::now();
            let (l2, out) = rx
                .recv_timeout(RETRY_TIMEOUT)
                .unwrap_or_else(|_| panic!("round {round}: the loser never mounted"));
            waits.push(released.elapsed());
            assert_eq!(l2, l);
            // (Its progress lines on stderr are polled once a second and
            // may miss a wait shorter than that: the status above is what
            // shows the wait.)
            let loser_path = host_path(&out.ok());
            assert_eq!(
                loser
                    .targets()
                    .iter()
                    .map(|m| &m.mount_point)
                    .collect::<Vec<_>>(),
                [&loser_path]
            );
            assert!(winner.targets().is_empty());
            for n in &c.nodes {
                assert_eq!(
                    holders(&n.claims("v")),
                    [allocs[l].clone()],
                    "round {round}"
                );
            }
            loser.release_ok(&allocs[l]);
            assert!(stored_claims(&c.etcd, "v").is_empty(), "round {round}");
        });
    }
    eprintln!(
        "10 rounds in {:?}; winners {winners}; the loser mounted {:?} after the winner's release (per round)",
        started.elapsed(),
        waits
    );
}

// ---- 2. Access modes across nodes ----------------------------------------------

#[test]
fn reader_only_across_three_nodes_and_single_node_modes_stay_on_one_node() {
    let c = Cluster::start(&["a", "b", "c"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json(
        "shared",
        "ext-shared",
        &["multi-node-reader-only", "multi-node-multi-writer"],
    ));
    c.add_volume(&volume_json(
        "local",
        "ext-local",
        &["single-node-reader-only"],
    ));

    // Three readers on three nodes, at once.
    let paths: Vec<PathBuf> = thread::scope(|s| {
        let handles: Vec<_> = c
            .nodes
            .iter()
            .map(|n| s.spawn(move || n.mount_ok(&format!("r-{}", n.name), "data=shared,ro")))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a reader's mount"))
            .collect()
    });
    for (n, p) in c.nodes.iter().zip(&paths) {
        assert!(p.starts_with(n.mount_root()), "{}", p.display());
        let m = mount_at(p).unwrap_or_else(|| panic!("{} is not mounted", p.display()));
        assert!(m.read_only(), "{m:?}");
    }
    let claims = c.nodes[0].claims("shared");
    let seen: Vec<(Value, Value, Value, Value)> = claims
        .iter()
        .map(|c| {
            (
                c["alloc_id"].clone(),
                c["node"].clone(),
                c["mode"].clone(),
                c["access_mode"].clone(),
            )
        })
        .collect();
    let want: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            (
                json!(format!("r-{n}")),
                json!(n),
                json!("read"),
                json!("multi-node-reader-only"),
            )
        })
        .collect();
    assert_eq!(seen, want);

    // A writer with the reader-only mode is refused at once (a request
    // that can never be granted: exit 2).
    let out = c.nodes[2]
        .mount("w-c", "data=shared,rw,access=multi-node-reader-only", &[])
        .expect_code(EXIT_USAGE);
    assert!(
        out.stderr
            .contains("a read-write request is impossible with access mode multi-node-reader-only"),
        "{}",
        out.stderr
    );
    // A writer with the writable mode waits for the readers to go, naming
    // one of them; it takes no claim meanwhile.
    let out = c.nodes[1]
        .mount("w-b", "data=shared,rw", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    let st = c.nodes[1].volume_status("w-b");
    let msg = st["message"].as_str().unwrap_or("").to_string();
    assert!(
        msg.contains("claimed for reading by allocation r-") && msg.contains("(retrying)"),
        "{st}\n{}",
        out.stderr
    );
    assert_eq!(holders(&c.nodes[2].claims("shared")), ["r-a", "r-b", "r-c"]);
    assert!(!c.nodes[1].targets().iter().any(|m| !m.read_only()));
    c.nodes[1].release_ok("w-b");

    // A single-node mode: two readers on node a; node b waits, naming the
    // first holder and node a, and mounts once both are gone.
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    a.mount_ok("l-a1", "data=local,ro");
    a.mount_ok("l-a2", "data=local,ro");
    let out = b
        .mount("l-b", "data=local,ro", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    let want = held_by("l-a1", "a");
    assert!(out.stderr.contains(&want), "{}", out.stderr);
    let st = b.volume_status("l-b");
    assert!(st["message"].as_str().unwrap_or("").contains(&want), "{st}");
    assert_eq!(st["phase"], "claiming");
    assert_eq!(holders(&b.claims("local")), ["l-a1", "l-a2"]);
    a.release_ok("l-a1");
    // Still held on node a by l-a2.
    wait_until(SHOW_TIMEOUT, "node b to name the other holder", || {
        let st = b.volume_status("l-b");
        st["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("l-a2", "a"))
    });
    a.release_ok("l-a2");
    // The mount went on in the agent after the command gave up.
    wait_until(RETRY_TIMEOUT, "node b's mount of the local volume", || {
        b.volume_status("l-b")["phase"] == "published"
    });
    assert_eq!(holders(&a.claims("local")), ["l-b"]);
    assert_eq!(b.claims("local")[0]["node"], "b");

    for n in &c.nodes {
        n.release_ok(&format!("r-{}", n.name));
    }
    b.release_ok("l-b");
    assert!(stored_claims(&c.etcd, "shared").is_empty());
    assert!(stored_claims(&c.etcd, "local").is_empty());
}

// ---- 3. A restart with etcd stopped ---------------------------------------------

#[test]
fn agent_restarts_with_etcd_stopped_keeps_every_mount_without_csi_calls() {
    let mut c = Cluster::start(&["a"], &|_| {});
    let volumes = ["v1", "v2", "v3"];
    for v in volumes {
        c.add_volume(&volume_json(
            v,
            &format!("ext-{v}"),
            &["single-node-writer"],
        ));
    }
    c.add_volume(&volume_json("s", "ext-s", &["multi-node-multi-writer"]));
    let n = &c.nodes[0];
    let mut paths = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        paths.push(n.mount_ok(&format!("a{i}"), &format!("data={v}")));
    }
    // Two allocations sharing one staging.
    paths.push(n.mount_ok("s1", "data=s"));
    paths.push(n.mount_ok("s2", "data=s"));
    let allocs = ["a0", "a1", "a2", "s1", "s2"];
    let before: Vec<MountEntry> = paths
        .iter()
        .map(|p| mount_at(p).expect("mounted"))
        .collect();
    let claims_before = stored_claims(&c.etcd, "");
    assert_eq!(claims_before.len(), allocs.len());

    c.etcd.kill();
    let n = &mut c.nodes[0];
    for graceful in [false, true] {
        let calls = n.volume_calls().len();
        if graceful {
            n.agent.terminate(Duration::from_secs(30));
        } else {
            n.agent.kill();
        }
        let start = Instant::now();
        n.agent.spawn();
        n.agent.wait_listening();
        let listening = start.elapsed();
        let st = n.agent.cli(&["alloc", "status", "--json"]).ok().json();
        let answered = start.elapsed();
        let list = st["allocs"].as_array().expect("allocs");
        assert_eq!(list.len(), allocs.len(), "{st}");
        for a in list {
            assert_eq!(a["volumes"][0]["phase"], "published", "{a}");
        }
        for (p, m) in paths.iter().zip(&before) {
            assert_eq!(mount_at(p).as_ref(), Some(m), "{} changed", p.display());
        }
        assert_eq!(
            n.volume_calls()[calls..],
            [] as [String; 0],
            "CSI volume calls after the restart"
        );
        // The claims cannot be listed, and the command says why.
        let out = n.agent.cli(&["claim", "list"]);
        assert_ne!(out.code, EXIT_OK, "{out:?}");
        assert!(out.stderr.contains("etcd"), "{}", out.stderr);
        eprintln!(
            "restart with etcd down ({}): listening after {listening:?}, status answered after {answered:?}",
            if graceful { "SIGTERM" } else { "SIGKILL" }
        );
    }
    // etcd back: the claims are as they were.
    c.etcd.restart();
    assert_eq!(stored_claims(&c.etcd, ""), claims_before);
    let n = &c.nodes[0];
    assert_eq!(holders(&n.claims("v1")), ["a0"]);
    for a in allocs {
        n.release_ok(a);
    }
    assert!(stored_claims(&c.etcd, "").is_empty());
    assert!(n.targets().is_empty());
}

// ---- 4. A release while the link to etcd is cut --------------------------------

#[test]
fn release_during_a_partition_unmounts_at_once_and_frees_the_claim_after() {
    let dir = TestDir::new();
    let etcd = Etcd::start();
    let proxy = Proxy::start(
        format!("127.0.0.1:{}", etcd.client_port())
            .parse()
            .expect("an address"),
    );
    let tweak = |cfg: &mut AgentConfig| cfg.claim_retry_deadline = "5m".into();
    // Node a talks to etcd through the proxy; node b directly.
    let a = Node::start(dir.path(), "a", &[proxy.endpoint()], &tweak);
    let b = Node::start(dir.path(), "b", &[etcd.endpoint()], &tweak);
    let vol = volume_json("v", "ext-v", &["single-node-writer"]);
    a.add_volume(&vol);
    b.add_volume(&vol);
    let path = a.mount_ok("p1", "data=v");
    assert!(is_mount_point(&path));
    let key = format!("{PREFIX}/claims/v/p1");

    proxy.pause();
    let calls = a.volume_calls().len();
    let start = Instant::now();
    a.agent.cli(&["alloc", "release", "p1"]).ok();
    wait_until(SHOW_TIMEOUT, "NodeUnpublish and NodeUnstage", || {
        a.volume_calls()[calls..] == [NUP.to_string(), NUS.to_string()]
    });
    let node_side = start.elapsed();
    // The release's first write waits for one etcd call deadline (2 s, the
    // claim marked releasing) before the node side starts.
    assert!(node_side < Duration::from_secs(5), "{node_side:?}");
    assert!(!is_mount_point(&path));
    assert!(a.targets().is_empty());
    // The claim stays in etcd; the release says it is retrying.
    wait_until(
        SHOW_TIMEOUT,
        "the release to retry freeing the claim",
        || {
            let st = a.volume_status("p1");
            st["release_state"] == "retrying"
                && st["release_error"].as_str().unwrap_or("").contains("etcd")
        },
    );
    assert!(etcd.client().get(&key).expect("read etcd").is_some());
    assert_eq!(holders(&b.claims("v")), ["p1"]);
    // Node b waits for it, naming the holder on node a.
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        let b = &b;
        s.spawn(move || {
            let _ = tx.send(b.mount("q1", "data=v", &[]));
        });
        wait_until(SHOW_TIMEOUT, "node b to wait for p1", || {
            let st = b.volume_status("q1");
            st["message"]
                .as_str()
                .unwrap_or("")
                .contains(&held_by("p1", "a"))
        });
        // Still held a while later: nothing frees it but node a.
        wait_until(SHOW_TIMEOUT, "a second attempt to free the claim", || {
            let out = a
                .agent
                .cli(&["alloc", "release", "p1", "--json"])
                .ok()
                .json();
            out["volumes"][0]["attempts"].as_u64().unwrap_or(0) >= 2
        });
        assert!(etcd.client().get(&key).expect("read etcd").is_some());
        assert_eq!(
            a.volume_calls()[calls..],
            [NUP.to_string(), NUS.to_string()]
        );

        proxy.resume();
        let healed = Instant::now();
        wait_until(RETRY_TIMEOUT, "the claim to be freed", || {
            etcd.client().get(&key).expect("read etcd").is_none()
        });
        let freed = healed.elapsed();
        let out = rx
            .recv_timeout(RETRY_TIMEOUT)
            .expect("node b's mount finishes");
        let q = host_path(&out.ok());
        assert!(is_mount_point(&q));
        wait_until(SHOW_TIMEOUT, "node a to forget p1", || {
            a.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
                .as_array()
                .is_some_and(|l| l.is_empty())
        });
        eprintln!(
            "partitioned release: node side done {node_side:?} after the request; claim freed {freed:?} after the link healed"
        );
    });
    assert_eq!(holders(&a.claims("v")), ["q1"]);
    b.release_ok("q1");
}

// ---- 5. etcd killed mid-mount -------------------------------------------------

#[test]
fn etcd_killed_before_and_during_a_mount_the_mount_completes_when_it_is_back() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    c.add_volume(&volume_json("w", "ext-w", &["single-node-writer"]));

    // Killed before: the mount waits, says why, and makes no CSI call.
    let etcd = &mut c.etcd;
    let a = &c.nodes[0];
    etcd.kill();
    let (tx, rx) = mpsc::channel();
    let m1_after = thread::scope(|s| {
        s.spawn(move || {
            let _ = tx.send(a.mount("m1", "data=v", &[]));
        });
        wait_until(SHOW_TIMEOUT, "the mount to wait for etcd", || {
            let st = a.volume_status("m1");
            let msg = st["message"].as_str().unwrap_or("");
            msg.contains("the claim store etcd is unavailable") && msg.contains("(retrying)")
        });
        assert_eq!(a.volume_status("m1")["phase"], "claiming");
        assert_eq!(a.volume_calls(), [] as [String; 0]);
        assert!(rx.try_recv().is_err());
        etcd.restart();
        let back = Instant::now();
        let out = rx.recv_timeout(RETRY_TIMEOUT).expect("the mount finishes");
        let m1_after = back.elapsed();
        let p = host_path(&out.ok());
        assert!(is_mount_point(&p));
        m1_after
    });
    assert_eq!(holders(&c.nodes[1].claims("v")), ["m1"]);

    // Killed while a mount waits for a holder on another node: the holder's
    // release does its node side at once and frees the claim once etcd is
    // back; the waiting mount then completes.
    let etcd = &mut c.etcd;
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    b.mount_ok("h1", "data=w");
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        s.spawn(move || {
            let _ = tx.send(a.mount("m2", "data=w", &[]));
        });
        wait_until(SHOW_TIMEOUT, "m2 to wait for h1", || {
            let st = a.volume_status("m2");
            st["message"]
                .as_str()
                .unwrap_or("")
                .contains(&held_by("h1", "b"))
        });
        etcd.kill();
        let calls = b.volume_calls().len();
        b.agent.cli(&["alloc", "release", "h1"]).ok();
        wait_until(SHOW_TIMEOUT, "h1's node side", || {
            b.volume_calls()[calls..] == [NUP.to_string(), NUS.to_string()]
        });
        wait_until(SHOW_TIMEOUT, "m2 to see etcd gone", || {
            let st = a.volume_status("m2");
            st["message"]
                .as_str()
                .unwrap_or("")
                .contains("the claim store etcd is unavailable")
        });
        assert!(rx.try_recv().is_err(), "m2 mounted while etcd was down");
        assert_eq!(a.targets().len(), 1, "{:?}", a.targets());
        etcd.restart();
        let back = Instant::now();
        let out = rx.recv_timeout(RETRY_TIMEOUT).expect("m2's mount finishes");
        let m2_after = back.elapsed();
        let p = host_path(&out.ok());
        assert!(is_mount_point(&p));
        eprintln!(
            "etcd back: m1 mounted {m1_after:?} after, m2 (behind a release) {m2_after:?} after"
        );
    });
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    assert_eq!(holders(&b.claims("w")), ["m2"]);
    wait_until(SHOW_TIMEOUT, "node b to forget h1", || {
        b.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
            .as_array()
            .is_some_and(|l| l.is_empty())
    });
    a.release_ok("m1");
    a.release_ok("m2");
    assert!(stored_claims(&c.etcd, "").is_empty());
}

// ---- 6. A restart of etcd itself ----------------------------------------------

#[test]
fn etcd_restart_loses_no_claim() {
    let mut c = Cluster::start(&["a", "b"], &|_| {});
    c.add_volume(&volume_json("x", "ext-x", &["single-node-writer"]));
    c.add_volume(&volume_json("y", "ext-y", &["multi-node-single-writer"]));
    c.add_volume(&volume_json("s", "ext-s", &["multi-node-reader-only"]));
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    a.mount_ok("x1", "data=x");
    b.mount_ok("y1", "data=y");
    a.mount_ok("s-a", "data=s,ro");
    b.mount_ok("s-b", "data=s,ro");
    let before = c
        .etcd
        .client()
        .range_prefix(format!("{PREFIX}/claims/"))
        .expect("range");
    assert_eq!(before.kvs.len(), 4);
    let listed = a.agent.cli(&["claim", "list", "--json"]).ok().json();

    let liveness = |etcd: &Etcd| -> Vec<(String, claimd::etcd::LeaseId)> {
        let r = etcd
            .client()
            .range_prefix(format!("{PREFIX}/nodes/"))
            .expect("range");
        r.kvs
            .iter()
            .filter_map(|kv| Some((kv.key_str().into_owned(), kv.lease?)))
            .collect()
    };
    let nodes = [format!("{PREFIX}/nodes/a"), format!("{PREFIX}/nodes/b")];
    wait_until(SHOW_TIMEOUT, "both nodes' liveness keys", || {
        let l = liveness(&c.etcd);
        l.iter().map(|(k, _)| k).eq(nodes.iter())
    });
    let leases = liveness(&c.etcd);

    c.etcd.restart();
    let after = c
        .etcd
        .client()
        .range_prefix(format!("{PREFIX}/claims/"))
        .expect("range");
    let summary = |r: &claimd::etcd::RangeResponse| -> Vec<_> {
        r.kvs
            .iter()
            .map(|kv| {
                (
                    kv.key.clone(),
                    kv.value.clone(),
                    kv.create_revision,
                    kv.mod_revision,
                )
            })
            .collect()
    };
    assert_eq!(summary(&after), summary(&before));
    // The nodes stay alive through it: same keys and leases, renewed by
    // their agents after the restart (the remaining TTL goes up again).
    assert_eq!(liveness(&c.etcd), leases);
    for (key, lease) in &leases {
        let mut lowest = None;
        wait_until(
            Duration::from_secs(30),
            &format!("a renewal of {key}"),
            || {
                let ttl = c
                    .etcd
                    .client()
                    .lease_time_to_live(*lease)
                    .expect("lease TTL")
                    .expect("the lease exists");
                let renewed = lowest.is_some_and(|l| ttl > l);
                lowest = Some(lowest.map_or(ttl, |l: Duration| l.min(ttl)));
                renewed
            },
        );
    }
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    // Both agents see every claim, and the claims still hold.
    for n in [a, b] {
        wait_until(
            SHOW_TIMEOUT,
            "the claim list after the etcd restart",
            || {
                let out = n.agent.cli(&["claim", "list", "--json"]);
                out.code == EXIT_OK && out.json() == listed
            },
        );
    }
    let out = b
        .mount("x2", "data=x", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    assert!(out.stderr.contains(&held_by("x1", "a")), "{}", out.stderr);
    b.release_ok("x2");
    let out = a
        .mount("y2", "data=y", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    assert!(out.stderr.contains(&held_by("y1", "b")), "{}", out.stderr);
    a.release_ok("y2");
    for (n, alloc) in [(a, "x1"), (b, "y1"), (a, "s-a"), (b, "s-b")] {
        n.release_ok(alloc);
    }
    assert!(stored_claims(&c.etcd, "").is_empty());
}

// ---- 7. Bad input ---------------------------------------------------------------

#[test]
fn unreachable_endpoints_at_start_the_agent_restores_and_serves_and_mounts_wait() {
    let c = Cluster::start(&["a"], &|_| {});
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    c.add_volume(&volume_json("w", "ext-w", &["single-node-writer"]));
    let mut n = c.nodes.into_iter().next().expect("one node");
    let path = n.mount_ok("u1", "data=v");
    let before = mount_at(&path).expect("mounted");
    n.agent.kill();
    // Two endpoints nobody listens on.
    let dead = [
        format!("http://127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    ];
    n.agent.config.cluster = Some(cluster_section(&dead));
    n.agent.config.write(&n.agent.config_path);
    let calls = n.volume_calls().len();
    let start = Instant::now();
    n.agent.spawn();
    n.agent.wait_listening();
    let listening = start.elapsed();
    let st = n.volume_status("u1");
    assert_eq!(st["phase"], "published", "{st}");
    assert_eq!(mount_at(&path), Some(before));
    assert_eq!(n.volume_calls()[calls..], [] as [String; 0]);
    // A new mount waits, saying why.
    let out = n
        .mount("u2", "data=w", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    let st = n.volume_status("u2");
    let msg = st["message"].as_str().unwrap_or("").to_string();
    assert!(
        msg.contains("the claim store etcd is unavailable") && msg.contains("(retrying)"),
        "{st}\n{}",
        out.stderr
    );
    assert_eq!(st["phase"], "claiming");
    assert_eq!(n.volume_calls()[calls..], [] as [String; 0]);
    // The agent's health stays answerable.
    n.agent.cli(&["alloc", "status"]).ok();
    eprintln!("agent with unreachable etcd endpoints listening after {listening:?}: {msg}");
    drop(n);
    drop(c.etcd);
    drop(c.dir);
}

#[test]
fn a_badly_written_endpoint_stops_the_agent_naming_the_field() {
    let dir = TestDir::new();
    for (i, endpoints) in [
        vec!["http://127.0.0.1:notaport".to_string()],
        vec![
            "127.0.0.1:2379".to_string(),
            "ftp://127.0.0.1:2379".to_string(),
        ],
        vec!["http://127.0.0.1:2379/v3".to_string()],
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("n{i}");
        let (_plugin, mut agent) = Node::prepare(dir.path(), &name, &endpoints, &|_| {});
        agent.spawn();
        let status = agent.wait_exit(Duration::from_secs(30));
        assert_eq!(status.code(), Some(EXIT_USAGE), "{}", agent.log());
        let field = format!("cluster.endpoints[{}]", endpoints.len() - 1);
        let log = agent.log();
        assert!(log.contains(&field), "{endpoints:?}: {log}");
        assert!(
            log.contains(endpoints.last().expect("an endpoint")),
            "{endpoints:?}: {log}"
        );
    }
}

#[test]
fn a_value_that_is_not_a_claim_fails_the_mount_and_is_left_untouched() {
    let c = Cluster::start(&["a"], &|_| {});
    c.add_volume(&volume_json("v", "ext-v", &["multi-node-multi-writer"]));
    c.add_volume(&volume_json("w", "ext-w", &["single-node-writer"]));
    let n = &c.nodes[0];
    let key = format!("{PREFIX}/claims/v/junk");
    let etcd = c.etcd.client();
    etcd.put(&key, "{not json").expect("put");
    let before = etcd.get(&key).expect("get").expect("the key");

    let out = n.mount("c1", "data=v", &[]).expect_code(EXIT_FAILED);
    assert!(out.stderr.contains(&key), "{}", out.stderr);
    assert!(out.stderr.contains("not a claim"), "{}", out.stderr);
    wait_until(SHOW_TIMEOUT, "the failed mount to be rolled back", || {
        n.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
            .as_array()
            .is_some_and(|l| l.is_empty())
    });
    assert!(n.targets().is_empty());
    assert_eq!(n.volume_calls(), [] as [String; 0]);
    let after = etcd
        .get(&key)
        .expect("get")
        .expect("the key is still there");
    assert_eq!(
        (&after.value, after.mod_revision),
        (&before.value, before.mod_revision)
    );
    assert_eq!(
        stored_claims(&c.etcd, "v"),
        [(key.clone(), b"{not json".to_vec())]
    );
    // Listing the claims names the key too.
    let out = n.agent.cli(&["claim", "list"]);
    assert_ne!(out.code, EXIT_OK);
    assert!(out.stderr.contains(&key), "{}", out.stderr);
    // Other volumes are not affected.
    n.mount_ok("c2", "data=w");
    n.release_ok("c2");
    // Once the value is fixed by hand, the volume mounts.
    etcd.delete_range(&key, "").expect("delete");
    n.mount_ok("c1", "data=v");
    n.release_ok("c1");
}

// ---- 8. Restarts in the middle of cluster waits -----------------------------------

/// Whether the agent records no allocation at all.
fn no_allocs(n: &Node) -> bool {
    n.agent.cli(&["alloc", "status", "--json"]).ok().json()["allocs"]
        .as_array()
        .is_some_and(|l| l.is_empty())
}

#[test]
fn a_release_waiting_for_a_cut_link_survives_an_agent_restart() {
    let dir = TestDir::new();
    let etcd = Etcd::start();
    let proxy = Proxy::start(
        format!("127.0.0.1:{}", etcd.client_port())
            .parse()
            .expect("an address"),
    );
    let mut a = Node::start(dir.path(), "a", &[proxy.endpoint()], &|_| {});
    a.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = a.mount_ok("p1", "data=v");
    let key = format!("{PREFIX}/claims/v/p1");

    proxy.pause();
    a.agent.cli(&["alloc", "release", "p1"]).ok();
    wait_until(
        SHOW_TIMEOUT,
        "the release to retry freeing the claim",
        || a.volume_status("p1")["release_state"] == "retrying",
    );
    assert!(!is_mount_point(&path));
    // A crash while the claim waits to be freed, and a start with the link
    // still cut: the release goes on from the record.
    a.agent.kill();
    a.agent.spawn();
    a.agent.wait_listening();
    wait_until(SHOW_TIMEOUT, "the resumed release to retry", || {
        let st = a.volume_status("p1");
        st["release_state"] == "retrying"
            && st["release_error"].as_str().unwrap_or("").contains("etcd")
    });
    assert!(!is_mount_point(&path));
    assert!(a.targets().is_empty());
    assert!(etcd.client().get(&key).expect("read etcd").is_some());

    proxy.resume();
    wait_until(RETRY_TIMEOUT, "the claim to be freed", || {
        etcd.client().get(&key).expect("read etcd").is_none()
    });
    wait_until(SHOW_TIMEOUT, "node a to forget p1", || no_allocs(&a));
}

#[test]
fn a_mount_waiting_for_a_holder_survives_an_agent_restart() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    c.nodes[0].mount_ok("h1", "data=v");
    // b's mount waits for h1; the command gives up, the agent goes on.
    let b = &c.nodes[1];
    b.mount("w1", "data=v", &["--timeout", "2s"])
        .expect_code(EXIT_FAILED);
    assert_eq!(b.volume_status("w1")["phase"], "claiming");
    let b = &mut c.nodes[1];
    b.agent.kill();
    b.agent.spawn();
    b.agent.wait_listening();
    let b = &c.nodes[1];
    // Still waiting after the restart, and saying for what.
    wait_until(SHOW_TIMEOUT, "the restored mount to wait for h1", || {
        b.volume_status("w1")["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("h1", "a"))
    });
    assert_eq!(holders(&b.claims("v")), ["h1"]);
    assert!(b.targets().is_empty());
    c.nodes[0].release_ok("h1");
    wait_until(RETRY_TIMEOUT, "the restored mount to finish", || {
        b.volume_status("w1")["phase"] == "published"
    });
    assert_eq!(b.targets().len(), 1);
    assert_eq!(holders(&c.nodes[0].claims("v")), ["w1"]);
    b.release_ok("w1");
    assert!(stored_claims(&c.etcd, "").is_empty());
}

// ---- 9. SIGKILL at the failpoints around the etcd round trip ---------------------

/// Starts the node's agent again with `CLAIMD_FAILPOINT=point` (none when
/// empty), after killing it.
fn restart_with_failpoint(n: &mut Node, point: &str) {
    n.agent.kill();
    n.agent.envs.clear();
    if !point.is_empty() {
        n.agent
            .envs
            .push(("CLAIMD_FAILPOINT".to_string(), point.to_string()));
    }
    n.agent.spawn();
    n.agent.wait_listening();
    // The plugin ready before the next mount: its claim then goes with its
    // first transaction (the fast path the failpoints are placed around).
    wait_until(SHOW_TIMEOUT, "the node plugin to be ready", || {
        n.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"] == "ready"
    });
}

/// Runs `f`, which makes the agent reach the failpoint `point` it was
/// started with, and waits for it to die of it.
fn die_at(n: &mut Node, point: &str, f: impl FnOnce(&Node)) {
    f(n);
    let status = n.agent.wait_exit(SHOW_TIMEOUT);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{status}"
    );
    assert!(
        n.agent
            .log()
            .contains(&format!("failpoint {point}: killing the agent")),
        "{}",
        n.agent.log()
    );
}

#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs the failpoints feature (cargo test --features failpoints)"
)]
fn sigkill_around_the_etcd_round_trip_of_a_mount_and_a_release() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let etcd = &c.etcd;
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };

    // Before the round trip of the mount's first transaction: nothing
    // anywhere; the mount can be asked again.
    restart_with_failpoint(a, "etcd-before-round-trip");
    die_at(a, "etcd-before-round-trip", |n| {
        let out = n.mount("k1", "data=v", &[]);
        assert_ne!(out.code, EXIT_OK);
    });
    assert!(stored_claims(etcd, "v").is_empty());
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    assert_eq!(a.volume_calls(), [] as [String; 0]);
    a.mount_ok("k1", "data=v");
    a.release_ok("k1");
    assert!(stored_claims(etcd, "v").is_empty());

    // After the local intent (claim in etcd and record both durable): the
    // restart finishes the mount under the claim.
    restart_with_failpoint(a, "mount-after-intent");
    die_at(a, "mount-after-intent", |n| {
        n.mount("k2", "data=v", &[]);
    });
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the restore to finish the mount", || {
        a.volume_status("k2")["phase"] == "published"
    });
    assert_eq!(a.targets().len(), 1);
    assert_eq!(holders(&b.claims("v")), ["k2"]);

    // After the release's first write (the claim marked releasing in etcd,
    // the record marked releasing): the restart resumes the release and
    // frees the claim.
    restart_with_failpoint(a, "release-after-mark");
    die_at(a, "release-after-mark", |n| {
        n.agent.cli(&["alloc", "release", "k2"]);
    });
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the resumed release", || no_allocs(a));
    assert!(a.targets().is_empty());
    assert!(stored_claims(etcd, "v").is_empty());

    // After the round trip of the mount's first transaction: the claim is
    // in etcd, the allocation in no local record. The same mount asked
    // again adopts the claim (its own: same allocation, node and mode).
    restart_with_failpoint(a, "etcd-after-round-trip");
    let calls = a.volume_calls().len();
    die_at(a, "etcd-after-round-trip", |n| {
        n.mount("k3", "data=v", &[]);
    });
    assert_eq!(holders(&b.claims("v")), ["k3"]);
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    assert_eq!(a.volume_calls()[calls..], [] as [String; 0]);
    a.mount_ok("k3", "data=v");
    assert_eq!(holders(&b.claims("v")), ["k3"]);
    a.release_ok("k3");
    assert!(stored_claims(etcd, "v").is_empty());
}

/// A claim that reached etcd just before the agent died (before its local
/// record) is freed by the next start's reconciliation once nothing of it
/// is mounted, so it does not block the volume for every node.
#[test]
fn a_claim_taken_just_before_a_crash_is_freed_by_the_next_start() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };
    restart_with_failpoint(a, "etcd-after-round-trip");
    // With the plugin ready, the mount takes the claim in its first
    // transaction: the agent dies after etcd has it and before any local
    // record exists.
    wait_until(SHOW_TIMEOUT, "node a's plugin to be ready", || {
        a.agent.cli(&["plugin", "list", "--json"]).ok().json()["plugins"][0]["health"] == "ready"
    });
    die_at(a, "etcd-after-round-trip", |n| {
        n.mount("k1", "data=v", &[]);
    });
    assert_eq!(holders(&b.claims("v")), ["k1"]);
    // The orchestrator gave up on k1 and forgets it; node a restarts.
    restart_with_failpoint(a, "");
    assert!(no_allocs(a));
    // Nothing of k1 is mounted on node a: its claim is freed, and node b
    // can take the volume.
    let out = b.mount("w1", "data=v", &["--timeout", "60s"]);
    assert_eq!(out.code, EXIT_OK, "{}", b.volume_status("w1"));
    assert_eq!(holders(&a.claims("v")), ["w1"]);
}

/// `claimd health` says when this node's liveness lease is not held (etcd
/// unreachable) and is ready again once it is; the metrics count the etcd
/// calls by method and show the lease.
#[test]
fn health_and_metrics_follow_the_link_to_etcd() {
    let mut c = Cluster::start(&["a"], &|cfg| {
        cfg.claim_retry_deadline = "60s".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let n = &c.nodes[0];
    n.mount_ok("a1", "data=v");
    wait_until(SHOW_TIMEOUT, "the agent to be healthy", || {
        n.agent.cli(&["health"]).code == EXIT_OK
    });
    let metrics = n.agent.cli(&["metrics"]).ok().stdout;
    let txns = metrics
        .lines()
        .find(|l| {
            l.starts_with("claimd_etcd_request_duration_seconds_count")
                && l.contains("method=\"Txn\"")
                && l.contains("result=\"ok\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .expect("a Txn count");
    assert!(txns >= 1.0, "{txns}");
    assert!(metrics.contains("claimd_etcd_lease_held 1"), "{metrics}");

    c.etcd.kill();
    let n = &c.nodes[0];
    wait_until(
        Duration::from_secs(60),
        "health to say the lease is gone",
        || {
            let out = n.agent.cli(&["health"]);
            out.code == EXIT_FAILED && out.stdout.contains("cluster:")
        },
    );
    assert!(n
        .agent
        .cli(&["metrics"])
        .ok()
        .stdout
        .contains("claimd_etcd_lease_held 0"));
    c.etcd.restart();
    let n = &c.nodes[0];
    wait_until(Duration::from_secs(60), "health to be ready again", || {
        n.agent.cli(&["health"]).code == EXIT_OK
    });
}

/// A node whose claim was freed elsewhere while its agent was down (by hand
/// here; the disconnect rule frees the same way, with a note) releases the
/// allocation when it is back in touch with etcd: nothing stays mounted
/// without a claim. The workload moved to another node under the same
/// allocation ID meanwhile: that node's claim is left alone (neither marked
/// nor freed by the returning node) and its mount stays.
#[test]
fn a_claim_freed_while_the_agent_was_down_releases_its_allocation() {
    let mut c = Cluster::start(&["a", "b"], &|_| {});
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = c.nodes[0].mount_ok("a1", "data=v");
    c.nodes[0].agent.kill();
    c.nodes[1]
        .agent
        .cli(&[
            "claim",
            "free",
            "v",
            "a1",
            "--reason",
            "node a replaced",
            "--force",
        ])
        .ok();
    assert!(stored_claims(&c.etcd, "v").is_empty());
    let moved = c.nodes[1].mount_ok("a1", "data=v");
    let held_by_b = stored_claims(&c.etcd, "v");
    c.nodes[0].agent.spawn();
    c.nodes[0].agent.wait_listening();
    wait_until(RETRY_TIMEOUT, "node a to release a1", || {
        no_allocs(&c.nodes[0]) && c.nodes[0].targets().is_empty()
    });
    assert!(!is_mount_point(&path));
    assert_eq!(
        stored_claims(&c.etcd, "v"),
        held_by_b,
        "b's claim of the same allocation ID is untouched"
    );
    assert!(is_mount_point(&moved), "b's mount stays");
    let log = c.nodes[0].agent.log();
    assert!(
        log.contains("no longer holds its claim") && log.contains("node a replaced"),
        "the log says why: {log}"
    );
    let calls = c.nodes[0].volume_calls();
    assert!(
        calls.ends_with(&[
            "NodeUnpublishVolume".to_string(),
            "NodeUnstageVolume".to_string()
        ]),
        "{calls:?}"
    );
}

// ---- 10. A crash between a release's answer and its closing write ------------------

/// A release is answered once its claim is freed in etcd, before the drop
/// of its local record reaches the disk (the closing write rides with the
/// next write, or the flusher's a few milliseconds later). With the
/// flusher stopped there and the volume taken meanwhile by another node, a
/// crash of the releasing node: its restart goes down from the durable
/// `releasing` record (calls down only, no take), drops the record, and
/// leaves the other node's claim as it is (the free compares the recorded
/// epoch; the key names another allocation anyway).
#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs the failpoints feature (cargo test --features failpoints)"
)]
fn a_crash_after_a_release_was_answered_goes_down_and_frees_no_other_claim() {
    let mut c = Cluster::start(&["a", "b"], &|cfg| {
        cfg.claim_retry_deadline = "5m".into();
    });
    c.add_volume(&volume_json("v", "ext-v", &["single-node-writer"]));
    let etcd = &c.etcd;
    let [a, b] = &mut c.nodes[..] else {
        unreachable!("two nodes")
    };
    a.mount_ok("k1", "data=v");
    restart_with_failpoint(a, "answer-before-closing-write:pause");
    a.release_ok("k1");
    assert!(stored_claims(etcd, "v").is_empty(), "the claim is freed");
    // The files as they are (the flusher is stopped: nothing settles).
    let on_disk = state_of_dir(&a.agent.config.state_dir);
    let phases: Vec<String> = on_disk["allocs"]["k1"]["volumes"]
        .as_object()
        .map(|v| {
            v.values()
                .map(|r| r["phase"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(phases, ["releasing"], "{on_disk}");
    assert!(a.targets().is_empty());
    assert!(
        a.agent
            .log()
            .contains("failpoint answer-before-closing-write: paused"),
        "{}",
        a.agent.log()
    );

    // Node b takes the volume for another allocation.
    b.mount_ok("w1", "data=v");
    assert_eq!(holders(&b.claims("v")), ["w1"]);
    let w1_claim = stored_claims(etcd, "v");

    // Node a dies in the window and starts again.
    let calls = a.volume_calls().len();
    a.agent.kill_now();
    restart_with_failpoint(a, "");
    wait_until(RETRY_TIMEOUT, "the resumed release to drop k1", || {
        no_allocs(a)
    });
    let on_disk = a.agent.state();
    assert_eq!(on_disk["allocs"], json!({}), "{on_disk}");
    let after: Vec<String> = a.volume_calls()[calls..].to_vec();
    assert!(
        after.iter().any(|m| m == "NodeUnpublishVolume")
            && after
                .iter()
                .all(|m| m == "NodeUnpublishVolume" || m == "NodeUnstageVolume"),
        "node a's calls after the restart: only the way down: {after:?}"
    );
    assert!(a.targets().is_empty());
    // w1's claim is untouched, in etcd byte for byte.
    assert_eq!(stored_claims(etcd, "v"), w1_claim);
    assert_eq!(holders(&a.claims("v")), ["w1"]);
    assert_eq!(b.targets().len(), 1);
    b.release_ok("w1");
    assert!(stored_claims(etcd, "v").is_empty());
}
