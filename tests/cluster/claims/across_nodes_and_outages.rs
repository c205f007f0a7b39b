//! Claims across real agents and a real etcd: races between nodes, access
//! modes across nodes, etcd stopped, killed and restarted, partitions.

use super::*;

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
