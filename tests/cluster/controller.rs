//! Cluster mode with controller plugins on a few nodes (issue 15): nodes
//! whose plugins have no controller side attach through etcd
//! (`attachments/<volume>/<node>`) and a controller host; a host killed
//! mid-attach is replaced; `stop_after_disconnect` lets a cut-off node go
//! and has the cluster detach it; `plugin list` shows the controller hosts;
//! `volume detach --node` detaches a dead node's volume by hand.
//!
//! One machine: one etcd member, several real agents with their own test
//! plugins (every node's plugin reports `ext-<node>` as its node ID; a
//! host's plugin accepts the other nodes' IDs), and a TCP proxy in front of
//! etcd for a node whose link a test cuts. The harness is in
//! tests/cluster/harness/.

use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use serde_json::{json, Value};

/// The volume these tests use: one writer on one node, so that the test
/// plugin's controller refuses a second node's attachment while the first
/// one's is there.
fn volume() -> Value {
    volume_json("v", "ext-v", &["single-node-writer"])
}

/// (volume, external node ID) pairs, for comparing with `attachments`.
fn attached(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(v, n)| (v.to_string(), n.to_string()))
        .collect()
}

/// Checks the fields of an `attachments/<volume>/<node>` record that
/// succeeded.
fn assert_attached(record: &Value, node: &str, handled_by: &str) {
    for (field, want) in [
        ("volume_id", json!("v")),
        ("node", json!(node)),
        ("plugin_id", json!(PLUGIN_ID)),
        ("external_node_id", json!(ext(node))),
        ("want", json!("attached")),
        ("state", json!("done")),
        ("publish_context", publish_context("ext-v", &ext(node))),
        ("error", Value::Null),
        ("handled_by", json!(handled_by)),
    ] {
        assert_eq!(record[field], want, "{field} of {record}");
    }
}

/// The plugin's NodeStage and NodePublish of node `n` carried the publish
/// context the host's ControllerPublish answered for `n`.
fn assert_staged_with_context(n: &Node) {
    for method in [NS, NP] {
        let call = n.one_call(method);
        assert_eq!(call["code"], "OK", "{call}");
        assert_eq!(
            call["publish_context"],
            publish_context("ext-v", &ext(&n.name)),
            "{call}"
        );
    }
}

// ---- 1. Attach and detach through a controller host -------------------------

#[test]
fn node_only_agents_attach_and_detach_through_the_controller_host() {
    let c = Cluster::start(vec![host("h", &["b", "c"]), node_only("b"), node_only("c")]);
    c.add_volume(&volume());
    let (h, b, n3) = (c.node("h"), c.node("b"), c.node("c"));

    // Only h registers a controller of the plugin.
    let controllers = format!("plugins/{PLUGIN_ID}/controllers/");
    wait_until(SHOW_TIMEOUT, "h's controller registration", || {
        !c.keys(&controllers).is_empty()
    });
    assert_eq!(c.keys(&controllers), [format!("{controllers}h")]);
    let reg = c.get_json(&format!("{controllers}h")).expect("registered");
    for (field, want) in [
        ("plugin_id", json!(PLUGIN_ID)),
        ("node", json!("h")),
        ("publish_unpublish_volume", json!(true)),
    ] {
        assert_eq!(reg[field], want, "{field} of {reg}");
    }

    let path = b.mount_ok("m1", "data=v");
    // h attached the volume to b's external node ID; b then staged and
    // published it with the context h's plugin answered.
    assert_eq!(h.volume_call_summary(), calls(&[(CP, "ext-b")]));
    let cp = h.one_call(CP);
    assert_eq!(
        (&cp["volume_id"], &cp["code"], &cp["readonly"]),
        (&json!("ext-v"), &json!("OK"), &json!(false)),
        "{cp}"
    );
    assert_eq!(b.volume_call_summary(), calls(&[(NS, ""), (NP, "")]));
    assert_staged_with_context(b);
    let (ns, np) = (b.one_call(NS), b.one_call(NP));
    assert!(ts(&ns) >= ts(&cp), "NodeStage {ns} before {cp}");
    assert!(ts(&np) >= ts(&ns), "{np} before {ns}");
    assert_eq!(n3.volume_calls(), [] as [Value; 0]);
    assert_eq!(h.attachments(), attached(&[("ext-v", "ext-b")]));
    let targets: Vec<_> = b.targets().into_iter().map(|m| m.mount_point).collect();
    assert_eq!(targets, [path]);
    // The request and its result, kept while attached.
    assert_eq!(c.keys("attachments/"), ["attachments/v/b"]);
    assert_attached(&c.attachment("v", "b").expect("attachments/v/b"), "b", "h");
    // The claim records b's external node ID, whichever node is asked.
    for n in [h, n3] {
        let claims = n.claims("v");
        assert_eq!(claims.len(), 1, "{claims:?}");
        assert_eq!(
            (
                &claims[0]["alloc_id"],
                &claims[0]["node"],
                &claims[0]["external_node_id"]
            ),
            (&json!("m1"), &json!("b"), &json!("ext-b")),
            "{claims:?}"
        );
    }

    // Release: the node side on b, then h detaches with the same ID.
    b.release_ok("m1");
    assert_eq!(
        b.volume_call_summary(),
        calls(&[(NS, ""), (NP, ""), (NUP, ""), (NUS, "")])
    );
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-b"), (CUP, "ext-b")])
    );
    let (nup, nus, cup) = (b.one_call(NUP), b.one_call(NUS), h.one_call(CUP));
    assert_eq!(
        (&cup["volume_id"], &cup["code"]),
        (&json!("ext-v"), &json!("OK"))
    );
    assert!(ts(&nus) >= ts(&nup), "{nus} before {nup}");
    assert!(
        ts(&cup) >= ts(&nus),
        "ControllerUnpublish {cup} before {nus}"
    );
    assert!(
        c.keys("attachments/").is_empty(),
        "{:?}",
        c.keys("attachments/")
    );
    assert!(c.holders("v").is_empty());
    assert!(h.attachments().is_empty(), "{:?}", h.attachments());
    assert!(b.mounts().is_empty(), "{:?}", b.mounts());

    // The third node does the same with its own ID.
    n3.mount_ok("m2", "data=v");
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-b"), (CUP, "ext-b"), (CP, "ext-c")])
    );
    assert_staged_with_context(n3);
    assert_attached(&c.attachment("v", "c").expect("attachments/v/c"), "c", "h");
    assert_eq!(h.attachments(), attached(&[("ext-v", "ext-c")]));
    n3.release_ok("m2");
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-b"), (CUP, "ext-b"), (CP, "ext-c"), (CUP, "ext-c")])
    );
    assert!(c.keys("attachments/").is_empty());
    assert!(c.holders("v").is_empty());
    assert!(h.attachments().is_empty());
    // A host's own mounts call its plugin directly: no request in etcd.
    let p = h.mount_ok("m3", "data=v");
    assert!(is_mount_point(&p));
    assert_eq!(
        h.volume_call_summary()[4..],
        calls(&[(CP, "ext-h"), (NS, ""), (NP, "")])
    );
    assert!(c.keys("attachments/").is_empty());
    assert_eq!(h.claims("v")[0]["external_node_id"], "ext-h");
    h.release_ok("m3");
    assert!(h.attachments().is_empty());
}

// ---- 2. The controller host dies mid-attach ------------------------------------

#[test]
fn a_second_host_finishes_an_attach_whose_host_was_killed() {
    // h's hung call must not reach its deadline before h is killed.
    let mut c = Cluster::prepare(vec![
        host("h", &["b"]).csi_call_timeout("120s"),
        node_only("b"),
        host("h2", &["b"]),
    ]);
    c.start_agent("h");
    c.start_agent("b");
    c.add_volume(&volume());
    c.node("h")
        .plugin
        .faults()
        .set(json!([{"method": CP, "volume_id": "ext-v", "action": "hang"}]));
    c.node("b").mount_waiting("m1", "data=v");
    let h = c.node("h");
    wait_until(SHOW_TIMEOUT, "h's ControllerPublish to hang", || {
        h.plugin
            .stderr_text()
            .contains("ControllerPublishVolume volume=ext-v: hanging")
    });
    let lock = c
        .get_json("attachment-locks/v/b")
        .expect("the request's lock");
    assert_eq!(lock["host"], "h", "{lock}");
    let pending = c.attachment("v", "b").expect("the request");
    assert_eq!(
        (
            &pending["want"],
            &pending["state"],
            &pending["external_node_id"]
        ),
        (&json!("attached"), &json!("pending"), &json!("ext-b")),
        "{pending}"
    );

    // A second host comes up: it leaves a request alone that a live host
    // holds.
    c.start_agent("h2");
    c.node("h2").agent.register(&volume());
    hold_for(Duration::from_secs(3), "the request staying with h", || {
        let calls = c.node("h2").volume_calls();
        ensure(calls.is_empty(), || format!("h2 called {calls:?}"))?;
        let r = c.attachment("v", "b");
        ensure(r.as_ref().is_some_and(|r| r["state"] == "pending"), || {
            format!("attachments/v/b is {r:?}")
        })
    });

    // h dies (its plugin stays hung); h2 takes the request over once h's
    // lease is gone.
    c.node_mut("h").agent.kill();
    let killed = now_ms();
    let (h, h2, b) = (c.node("h"), c.node("h2"), c.node("b"));
    wait_until(RETRY_TIMEOUT, "b's mount", || {
        b.volume_status("m1")["phase"] == "published"
    });
    assert_eq!(h2.volume_call_summary(), calls(&[(CP, "ext-b")]));
    let cp = h2.one_call(CP);
    assert_eq!(
        (&cp["volume_id"], &cp["code"]),
        (&json!("ext-v"), &json!("OK"))
    );
    assert!(ts(&cp) >= killed, "{cp} before h was killed ({killed})");
    // The hung call never answered; exactly one attachment exists.
    assert_eq!(h.calls_of(CP), [] as [Value; 0]);
    assert!(h.attachments().is_empty(), "{:?}", h.attachments());
    assert_eq!(h2.attachments(), attached(&[("ext-v", "ext-b")]));
    assert_attached(&c.attachment("v", "b").expect("attachments/v/b"), "b", "h2");
    assert_staged_with_context(b);
    assert_eq!(b.targets().len(), 1, "{:?}", b.targets());

    // The release detaches through h2 too.
    b.release_ok("m1");
    assert_eq!(
        h2.volume_call_summary(),
        calls(&[(CP, "ext-b"), (CUP, "ext-b")])
    );
    assert!(h2.attachments().is_empty());
    assert!(c.keys("attachments/").is_empty());
    assert!(c.holders("v").is_empty());
    assert!(b.mounts().is_empty());
}

#[test]
fn a_restarted_host_finishes_the_attach_it_was_killed_in() {
    let mut c = Cluster::start(vec![host("h", &["b"]), node_only("b")]);
    c.add_volume(&volume());
    c.node("h").plugin.faults().set(json!([
        {"method": CP, "volume_id": "ext-v", "action": "delay", "ms": 10000, "count": 1}
    ]));
    c.node("b").mount_waiting("m1", "data=v");
    wait_until(
        SHOW_TIMEOUT,
        "h's ControllerPublish to be under way",
        || {
            c.node("h")
                .plugin
                .stderr_text()
                .contains("ControllerPublishVolume volume=ext-v: delaying")
        },
    );
    // Killed while its plugin is still attaching; started again at once.
    let h = c.node_mut("h");
    h.agent.kill();
    h.agent.spawn();
    h.agent.wait_listening();
    let (h, b) = (c.node("h"), c.node("b"));
    wait_until(RETRY_TIMEOUT, "b's mount", || {
        b.volume_status("m1")["phase"] == "published"
    });
    // The restarted agent asked again; the first call finishes on its own.
    wait_until(
        SHOW_TIMEOUT,
        "the delayed ControllerPublish to finish",
        || h.calls_of(CP).len() == 2,
    );
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-b"), (CP, "ext-b")])
    );
    for cp in h.calls_of(CP) {
        assert_eq!(
            (&cp["volume_id"], &cp["code"]),
            (&json!("ext-v"), &json!("OK"))
        );
    }
    assert_eq!(h.attachments(), attached(&[("ext-v", "ext-b")]));
    assert_attached(&c.attachment("v", "b").expect("attachments/v/b"), "b", "h");
    assert_staged_with_context(b);
    assert_eq!(b.targets().len(), 1, "{:?}", b.targets());
    b.release_ok("m1");
    assert_eq!(h.calls_of(CUP).len(), 1);
    assert_eq!(h.one_call(CUP)["node_id"], "ext-b");
    assert!(h.attachments().is_empty());
    assert!(c.keys("attachments/").is_empty());
    assert!(c.holders("v").is_empty());
}

// ---- 3. A cut-off node with stop_after_disconnect -------------------------------

#[test]
fn a_cut_off_node_lets_go_by_itself_and_the_cluster_detaches_and_frees_it() {
    let c = Cluster::start(vec![
        host("h", &["a", "b"])
            .stop_after_disconnect(STOP_AFTER)
            .fencing()
            .fenced_storage(),
        node_only("a")
            .proxied()
            .stop_after_disconnect(STOP_AFTER)
            .fenced_storage(),
        node_only("b")
            .stop_after_disconnect(STOP_AFTER)
            .fencing()
            .fenced_storage(),
    ]);
    c.add_volume(&volume());
    let (h, a, b) = (c.node("h"), c.node("a"), c.node("b"));
    wait_until(SHOW_TIMEOUT, "node-settings/a", || {
        c.get_json("node-settings/a").is_some()
    });
    let settings = c.get_json("node-settings/a").expect("node-settings/a");
    assert_eq!(
        settings["stop_after_disconnect_ms"], STOP_AFTER_MS,
        "{settings}"
    );
    let path = a.mount_ok("p1", "data=v");
    assert_eq!(h.volume_call_summary(), calls(&[(CP, "ext-a")]));
    // b's mount waits for p1.
    b.mount_waiting("q1", "data=v");
    wait_until(SHOW_TIMEOUT, "q1 to wait for p1", || {
        b.volume_status("q1")["message"]
            .as_str()
            .unwrap_or("")
            .contains(&held_by("p1", "a"))
    });

    let cut_at = now_ms();
    a.cut();
    let gone_at = c.wait_gone("a");
    // a lets go of its node side by itself.
    wait_until(RETRY_TIMEOUT, "a's NodeUnpublish and NodeUnstage", || {
        a.volume_call_summary() == calls(&[(NS, ""), (NP, ""), (NUP, ""), (NUS, "")])
    });
    assert!(!is_mount_point(&path));
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    wait_until(SHOW_TIMEOUT, "a to log its release", || {
        a.agent.log().contains("released while disconnected")
    });
    // The cluster detaches a's attachment with a's ID, frees p1, and b's
    // mount goes on.
    wait_until(RETRY_TIMEOUT, "b's mount", || {
        b.volume_status("q1")["phase"] == "published"
    });
    // Detached twice: a second time once a ControllerPublish of a sent
    // before the fence could no longer be running (the CSI deadline).
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-a"), (CUP, "ext-a"), (CUP, "ext-a"), (CP, "ext-b")])
    );
    let (nup, nus) = (a.one_call(NUP), a.one_call(NUS));
    let cup = h.calls_of(CUP)[0].clone();
    let np = b.one_call(NP);
    // a waited for stop_after_disconnect (its lease was renewed at least
    // every TTL/2 before the cut).
    assert!(
        ts(&nup) >= cut_at + STOP_AFTER_MS - LEASE_TTL_MS / 2,
        "a let go {} ms after the cut",
        ts(&nup).saturating_sub(cut_at)
    );
    assert!(ts(&cup) >= ts(&nus), "detached {cup} before a's {nus}");
    assert!(
        ts(&cup) + 1000 >= gone_at + STOP_AFTER_MS,
        "detached {} ms after nodes/a was seen gone",
        ts(&cup).saturating_sub(gone_at)
    );
    assert!(ts(&np) >= ts(&nup), "b published {np} before a's {nup}");
    assert_staged_with_context(b);
    assert_eq!(h.attachments(), attached(&[("ext-v", "ext-b")]));
    assert_eq!(c.holders("v"), ["q1"]);
    assert!(c.attachment("v", "a").is_none());
    assert_attached(&c.attachment("v", "b").expect("attachments/v/b"), "b", "h");
    let note = c.get_json("freed/v/p1").expect("a freed note for p1");
    assert!(
        note["reason"]
            .as_str()
            .unwrap_or("")
            .contains("disconnected"),
        "{note}"
    );
    assert_eq!(
        (&note["claim"]["alloc_id"], &note["claim"]["node"]),
        (&json!("p1"), &json!("a")),
        "{note}"
    );
    let by = note["freed_by_node"].as_str().unwrap_or("");
    assert!(by == "h" || by == "b", "{note}");
    assert_eq!(c.keys("freed/"), ["freed/v/p1"]);
    // The note lives on a lease of `freed_note_retention` (7 days by
    // default): etcd removes it then.
    let kv = c
        .etcd
        .client()
        .get(format!("{PREFIX}/freed/v/p1"))
        .expect("read etcd")
        .expect("the note");
    let ttl = c
        .etcd
        .client()
        .lease_time_to_live(kv.lease.expect("the note is on a lease"))
        .expect("read the lease")
        .expect("a live lease");
    let week = Duration::from_secs(7 * 86_400);
    assert!(
        ttl <= week && ttl + Duration::from_secs(3600) > week,
        "{ttl:?}"
    );

    // The link heals: a finishes its release; no claim of a comes back,
    // b's attachment stays.
    a.heal();
    c.wait_alive("a");
    wait_until(RETRY_TIMEOUT, "a to finish the release of p1", || {
        a.no_allocs()
    });
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
    assert_eq!(c.holders("v"), ["q1"]);
    assert!(b.claims("v").iter().all(|x| x["node"] == "b"));
    // (A second detach with a's ID is harmless; nothing else.)
    let later = &h.volume_call_summary()[4..];
    assert!(
        later.iter().all(|x| *x == (CUP.to_string(), ext("a"))),
        "{later:?}"
    );
    assert_eq!(h.attachments(), attached(&[("ext-v", "ext-b")]));
    assert_eq!(b.targets().len(), 1, "{:?}", b.targets());
    b.release_ok("q1");
    assert!(c.holders("v").is_empty());
    assert!(c.keys("attachments/").is_empty());
    assert!(h.attachments().is_empty());
}

// ---- 4. Without stop_after_disconnect ---------------------------------------------

#[test]
fn without_stop_after_disconnect_a_cut_off_node_keeps_its_mounts_and_claims() {
    // The other nodes apply the disconnect rule; a's own setting is off.
    let c = Cluster::start(vec![
        host("h", &["a", "b"]).stop_after_disconnect(STOP_AFTER),
        node_only("a").proxied(),
        node_only("b").stop_after_disconnect(STOP_AFTER),
    ]);
    c.add_volume(&volume());
    let (h, a, b) = (c.node("h"), c.node("a"), c.node("b"));
    wait_until(SHOW_TIMEOUT, "node-settings/a", || {
        c.get_json("node-settings/a").is_some()
    });
    let settings = c.get_json("node-settings/a").expect("node-settings/a");
    assert_eq!(
        settings["stop_after_disconnect_ms"],
        Value::Null,
        "{settings}"
    );
    let path = a.mount_ok("p1", "data=v");
    let before = mount_at(&path).expect("mounted");
    b.mount_waiting("q1", "data=v");

    a.cut();
    c.wait_gone("a");
    // Five lease periods more (five times the others' rule): nothing moves.
    let period = Duration::from_millis(5 * LEASE_TTL_MS);
    hold_for(period, "a's mount, claim and attachment", || {
        let m = mount_at(&path);
        ensure(m.as_ref() == Some(&before), || format!("mount is {m:?}"))?;
        let holders = c.holders("v");
        ensure(holders == ["p1"], || format!("holders {holders:?}"))?;
        let ac = a.volume_call_summary();
        ensure(ac == calls(&[(NS, ""), (NP, "")]), || {
            format!("a's calls {ac:?}")
        })?;
        let hc = h.volume_call_summary();
        ensure(hc == calls(&[(CP, "ext-a")]), || {
            format!("h's calls {hc:?}")
        })?;
        let r = c.attachment("v", "a");
        ensure(r.as_ref().is_some_and(|r| r["state"] == "done"), || {
            format!("attachments/v/a is {r:?}")
        })?;
        ensure(!c.alive("a"), || "nodes/a is back".to_string())
    });
    assert_eq!(a.volume_status("p1")["phase"], "published");
    assert_eq!(b.volume_status("q1")["phase"], "claiming");
    assert!(b.targets().is_empty(), "{:?}", b.targets());
    assert!(c.keys("freed/").is_empty(), "{:?}", c.keys("freed/"));
    assert!(!a.agent.log().contains("released while disconnected"));

    // Healed: a is alive again with everything as it was; its own release
    // lets b in.
    a.heal();
    c.wait_alive("a");
    assert_eq!(mount_at(&path), Some(before));
    assert_eq!(c.holders("v"), ["p1"]);
    a.release_ok("p1");
    wait_until(RETRY_TIMEOUT, "b's mount", || {
        b.volume_status("q1")["phase"] == "published"
    });
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-a"), (CUP, "ext-a"), (CP, "ext-b")])
    );
    assert!(c.keys("freed/").is_empty());
    b.release_ok("q1");
    assert!(c.holders("v").is_empty());
}

// ---- 5. plugin list shows the controller hosts -----------------------------------

/// `plugin list --json`'s controller hosts as (plugin, node, alive), by node.
fn controller_hosts(n: &Node) -> Vec<(String, String, bool)> {
    let out = n.agent.cli(&["plugin", "list", "--json"]).ok().json();
    let mut list: Vec<(String, String, bool)> = out["controller_hosts"]
        .as_array()
        .unwrap_or_else(|| panic!("no controller_hosts in {out}"))
        .iter()
        .map(|x| {
            (
                x["plugin_id"].as_str().expect("plugin_id").to_string(),
                x["node"].as_str().expect("node").to_string(),
                x["alive"].as_bool().expect("alive"),
            )
        })
        .collect();
    list.sort_by(|x, y| x.1.cmp(&y.1));
    list
}

fn host_entry(node: &str, alive: bool) -> (String, String, bool) {
    (PLUGIN_ID.to_string(), node.to_string(), alive)
}

#[test]
fn plugin_list_shows_the_controller_hosts_and_whether_they_are_alive() {
    let mut c = Cluster::start(vec![host("h1", &["b"]), host("h2", &["b"]), node_only("b")]);
    let both = [host_entry("h1", true), host_entry("h2", true)];
    wait_until(SHOW_TIMEOUT, "both hosts listed alive", || {
        controller_hosts(c.node("b")) == both
    });
    for n in ["h1", "h2"] {
        assert_eq!(controller_hosts(c.node(n)), both);
    }
    let out = c
        .node("b")
        .agent
        .cli(&["plugin", "list", "--json"])
        .ok()
        .json();
    for x in out["controller_hosts"]
        .as_array()
        .expect("controller_hosts")
    {
        assert_eq!(
            (&x["ready"], &x["publish_unpublish_volume"]),
            (&json!(true), &json!(true)),
            "{x}"
        );
    }
    let controllers = format!("plugins/{PLUGIN_ID}/controllers/");
    assert_eq!(
        c.keys(&controllers),
        [format!("{controllers}h1"), format!("{controllers}h2")]
    );
    let text = c.node("b").agent.cli(&["plugin", "list"]).ok().stdout;
    assert!(text.to_lowercase().contains("controller hosts"), "{text}");
    assert!(text.contains("h1") && text.contains("h2"), "{text}");

    // h2 dies: listed, not alive, once its lease is gone.
    c.node_mut("h2").agent.kill();
    c.wait_gone("h2");
    let after = [host_entry("h1", true), host_entry("h2", false)];
    for n in ["b", "h1"] {
        wait_until(SHOW_TIMEOUT, "h2 listed as not alive", || {
            controller_hosts(c.node(n)) == after
        });
    }
    // Its registration is durable.
    assert_eq!(
        c.keys(&controllers),
        [format!("{controllers}h1"), format!("{controllers}h2")]
    );
}

// ---- 6. volume detach --node --------------------------------------------------------

/// `volume detach v --node a [more]` on node h.
fn detach(c: &Cluster, more: &[&str]) -> CliOutput {
    let mut args = vec!["volume", "detach", "v", "--node", "a"];
    args.extend(more);
    c.node("h").agent.cli(&args)
}

#[test]
fn volume_detach_frees_a_dead_nodes_volume_and_refuses_a_live_one() {
    let mut c = Cluster::start(vec![host("h", &["a"]), node_only("a")]);
    c.add_volume(&volume());
    c.node("a").mount_ok("d1", "data=v");
    let h = c.node("h");
    assert_eq!(h.volume_call_summary(), calls(&[(CP, "ext-a")]));
    // --reason is required.
    let out = detach(&c, &[]).expect_code(EXIT_USAGE);
    assert!(out.stderr.contains("--reason"), "{}", out.stderr);
    // Refused while a is alive.
    let out = detach(&c, &["--reason", "node a is lost"]).expect_code(EXIT_FAILED);
    assert!(out.stderr.contains("alive"), "{}", out.stderr);
    assert_eq!(h.volume_call_summary(), calls(&[(CP, "ext-a")]));
    assert_eq!(c.holders("v"), ["d1"]);
    assert!(c.attachment("v", "a").is_some());
    assert!(c.keys("freed/").is_empty());

    c.node_mut("a").agent.kill();
    c.wait_gone("a");
    let h = c.node("h");
    // Nothing else frees it (no disconnect rule here).
    assert_eq!(c.holders("v"), ["d1"]);
    let out = detach(&c, &["--reason", "node a is lost", "--json"])
        .ok()
        .json();
    assert_eq!(
        (
            &out["volume_id"],
            &out["node"],
            &out["detached"],
            &out["freed"]
        ),
        (&json!("v"), &json!("a"), &json!(true), &json!(["d1"])),
        "{out}"
    );
    assert_eq!(
        h.volume_call_summary(),
        calls(&[(CP, "ext-a"), (CUP, "ext-a")])
    );
    assert_eq!(h.one_call(CUP)["volume_id"], "ext-v");
    assert!(h.attachments().is_empty(), "{:?}", h.attachments());
    assert!(c.holders("v").is_empty());
    assert!(c.attachment("v", "a").is_none());
    let note = c.get_json("freed/v/d1").expect("a freed note for d1");
    assert_eq!(note["reason"], "node a is lost", "{note}");
    assert_eq!(
        (&note["claim"]["alloc_id"], &note["claim"]["node"]),
        (&json!("d1"), &json!("a")),
        "{note}"
    );
    // The volume is free and detached: another node attaches it.
    h.mount_ok("d2", "data=v");
    assert_eq!(
        h.volume_call_summary(),
        calls(&[
            (CP, "ext-a"),
            (CUP, "ext-a"),
            (CP, "ext-h"),
            (NS, ""),
            (NP, "")
        ])
    );
    h.release_ok("d2");

    // Outside cluster mode the command is refused.
    let dir = c.dir.path().join("solo");
    let solo = Agent::start(&dir, AgentConfig::new(&dir, None));
    let out = solo
        .cli(&["volume", "detach", "v", "--node", "a", "--reason", "x"])
        .expect_code(EXIT_FAILED);
    assert!(out.stderr.contains("cluster mode"), "{}", out.stderr);
}

/// `claimd_claims{state=STATE}` in the node's metrics.
fn claims_gauge(n: &Node, state: &str) -> Option<f64> {
    let series = format!("claimd_claims{{state=\"{state}\"}} ");
    n.agent
        .cli(&["metrics"])
        .ok()
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// A controller detach that keeps failing after the node side succeeded,
/// in cluster mode: the claim in etcd is `node-detached` with the error
/// (still held), the node's `claimd_claims` gauge counts it as such
/// (counted from the node's records, no etcd read), nothing is mounted;
/// once the detach succeeds the claim and its index entry are gone and the
/// gauge is back to 0.
#[test]
fn a_detach_being_retried_shows_the_claim_node_detached_in_etcd_and_the_metrics() {
    let c = Cluster::start(vec![host("h", &[])]);
    c.add_volume(&volume());
    let h = c.node("h");
    h.mount_ok("n1", "data=v");
    assert_eq!(claims_gauge(h, "taken"), Some(1.0));
    assert_eq!(claims_gauge(h, "node-detached"), Some(0.0));
    h.plugin.faults().set(json!([
        {"method": CUP, "action": "fail", "code": "UNAVAILABLE", "count": 100000}
    ]));
    assert_eq!(
        h.agent.cli(&["alloc", "release", "n1"]).code,
        EXIT_OK,
        "the release starts"
    );
    wait_until(
        RETRY_TIMEOUT,
        "the claim marked node-detached in etcd",
        || {
            c.get_json("claims/v/n1")
                .is_some_and(|v| v["claim"]["state"] == "node-detached")
        },
    );
    let claim = c.get_json("claims/v/n1").expect("the claim");
    let why = claim["claim"]["last_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("UNAVAILABLE") || why.contains("navailable"),
        "the claim says why it is not freed: {claim}"
    );
    wait_until(SHOW_TIMEOUT, "the gauge to count it node-detached", || {
        claims_gauge(h, "node-detached") == Some(1.0)
    });
    assert_eq!(claims_gauge(h, "taken"), Some(0.0));
    assert_eq!(claims_gauge(h, "releasing"), Some(0.0));
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    assert_eq!(c.keys("node-claims/h/"), ["node-claims/h/v/n1"]);
    h.plugin.faults().set(json!([]));
    wait_until(RETRY_TIMEOUT, "the release to finish", || h.no_allocs());
    assert!(c.holders("v").is_empty());
    assert!(
        c.keys("node-claims/").is_empty(),
        "{:?}",
        c.keys("node-claims/")
    );
    assert_eq!(claims_gauge(h, "node-detached"), Some(0.0));
    assert_eq!(claims_gauge(h, "taken"), Some(0.0));
    let detaches: Vec<String> = h
        .calls_of(CUP)
        .iter()
        .map(|c| c["code"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        detaches.len() >= 2
            && detaches.last().map(String::as_str) == Some("OK")
            && detaches[..detaches.len() - 1]
                .iter()
                .all(|c| c == "UNAVAILABLE"),
        "the detach failed, was retried, then succeeded: {detaches:?}"
    );
}

/// Volume operations asked of a node whose plugin has no controller side
/// go to a controller host through etcd (`controller-calls/`): create,
/// snapshot create/list/delete, expand and delete are each performed by
/// the host's plugin, the volume is registered cluster-wide, and no call
/// is left behind in etcd. A plugin refusal comes back with its reason.
#[test]
fn volume_operations_from_a_node_only_agent_go_to_the_controller_host() {
    let c = Cluster::start(vec![
        host("h", &["b"]).plugin_args(&["--snapshots", "--expansion"]),
        node_only("b"),
    ]);
    let (h, b) = (c.node("h"), c.node("b"));
    let definition = json!({
        "id": "db",
        "plugin_id": PLUGIN_ID,
        "access_modes": ["single-node-writer"],
        "attachment_modes": ["file-system"],
        "secrets": {"token": "t0ken"},
        "capacity_range": {"required_bytes": 1_048_576},
    });
    let socket = b
        .agent
        .config
        .api_socket
        .to_str()
        .expect("UTF-8")
        .to_string();
    let text = serde_json::to_vec(&definition).expect("encode");
    let created = run_claimd(
        &["volume", "create", "-", "--socket", &socket, "--json"],
        Some(&text),
        &[],
        MOUNT_TIMEOUT,
    )
    .ok()
    .json();
    let external = created["created"][0]["external_id"]
        .as_str()
        .expect("an external ID")
        .to_string();
    // Registered for the whole cluster: h lists it too.
    let listed = h.agent.cli(&["volume", "list", "--json"]).ok().json();
    assert_eq!(listed["volumes"][0]["id"], "db", "{listed}");
    assert_eq!(listed["volumes"][0]["external_id"], external.as_str());

    let snap = b
        .agent
        .cli(&["volume", "snapshot", "create", "db", "s1", "--json"])
        .ok()
        .json();
    let snap_id = snap["snapshot_id"]
        .as_str()
        .expect("a snapshot ID")
        .to_string();
    let listed = b
        .agent
        .cli(&["volume", "snapshot", "list", "db", "--json"])
        .ok()
        .json();
    assert_eq!(listed["snapshots"][0]["snapshot_id"], snap_id.as_str());
    let grown = b
        .agent
        .cli(&["volume", "expand", "db", "--size", "2097152", "--json"])
        .ok()
        .json();
    assert_eq!(grown["capacity_bytes"], 2_097_152, "{grown}");
    b.agent
        .cli(&["volume", "snapshot", "delete", &snap_id])
        .ok();
    // A refusal of the host's plugin comes back with its reason (a size
    // below the current one is refused before any call; an unknown
    // snapshot is looked up through the host).
    let out = b.agent.cli(&["volume", "snapshot", "delete", "snap-none"]);
    assert_eq!(out.code, EXIT_FAILED, "{out:?}");
    b.agent.cli(&["volume", "delete", "db"]).ok();

    let methods: Vec<String> = volume_methods(&h.plugin.call_log())
        .into_iter()
        .filter(|m| m != "NodeGetVolumeStats")
        .collect();
    assert_eq!(
        methods,
        [
            "CreateVolume",
            "CreateSnapshot",
            "ListSnapshots",
            "ControllerExpandVolume",
            "ListSnapshots",
            "DeleteSnapshot",
            "ListSnapshots",
            "DeleteVolume",
        ],
        "the host's plugin performed every operation"
    );
    let create = &h.plugin.call_log().calls_of("CreateVolume")[0];
    assert_eq!(create["secret_keys"], json!(["token"]), "{create}");
    assert!(
        volume_methods(&b.plugin.call_log())
            .iter()
            .all(|m| m == "NodeGetVolumeStats"),
        "b's plugin has no controller: {:?}",
        volume_methods(&b.plugin.call_log())
    );
    assert!(
        c.keys("controller-calls/").is_empty(),
        "{:?}",
        c.keys("controller-calls/")
    );
    assert!(
        h.agent.cli(&["volume", "list", "--json"]).ok().json()["volumes"]
            .as_array()
            .is_some_and(Vec::is_empty)
    );
}
