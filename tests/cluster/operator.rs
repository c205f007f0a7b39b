//! An operator's hand on the claims (`claim free`), against the agents'
//! own work (issue 37): real agents, a real etcd, the claims and notes as
//! etcd holds them.
//!
//! The harness is tests/cluster/harness/.

use std::time::{Duration, Instant};

use crate::agent_support::*;
use crate::common::*;
use crate::harness::*;
use claimd::etcd::WatchEvent;
use serde_json::Value;

fn volume() -> Value {
    volume_json("v", "ext-v", &["single-node-writer"])
}

/// Starts the node's agent again with `envs`.
fn restart_with(n: &mut Node, envs: &[(&str, &str)]) {
    n.agent.kill();
    n.agent.envs = envs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    n.start_agent();
}

/// Issue 37, item 7: `claim free` of this node's own claim looked at the
/// local records, then deleted whatever etcd held, outside the mount's
/// path: a mount of the same allocation could take (or confirm) the claim
/// in between, and was then acknowledged with no claim in etcd. Here the
/// mount is held right after its take answered, before its record is
/// written (failpoint `etcd-after-round-trip`, pause): the free must be
/// refused and the claim stay. On 3768d0d the free deleted it.
#[test]
fn claim_free_never_deletes_a_claim_this_nodes_mount_is_taking() {
    let mut c = Cluster::start(vec![nfs_node("a")]);
    c.add_volume(&volume());
    restart_with(
        c.node_mut("a"),
        &[("CLAIMD_FAILPOINT", "etcd-after-round-trip:pause")],
    );
    let a = c.node("a");
    // The command gives up; the mount stays held at the failpoint.
    a.mount("k1", "data=v", &["--timeout", "3s"])
        .expect_code(EXIT_FAILED);
    wait_until(SHOW_TIMEOUT, "k1's claim in etcd", || {
        c.holders("v") == ["k1"]
    });
    let out = a
        .agent
        .cli(&["claim", "free", "v", "k1", "--reason", "test"]);
    assert_ne!(out.code, EXIT_OK, "the free went through: {out:?}");
    assert!(
        out.stderr.contains("being mounted on this node"),
        "{}",
        out.stderr
    );
    assert_eq!(c.holders("v"), ["k1"]);
    assert!(c.get_json("freed/v/k1").is_none());
}

/// Issue 37, item 2: `claim free` deleted the claim, then wrote its
/// `freed/` note in a second call; a crash or an etcd error in between
/// left a claim gone without a note, which its node cannot tell from a
/// claim lost by accident. The delete and the note must be one write: the
/// watch sees both at one revision. On 3768d0d the note came one revision
/// after the delete.
#[test]
fn claim_free_deletes_the_claim_and_writes_its_note_in_one_write() {
    let mut c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    c.node_mut("a").agent.kill();
    c.wait_gone("a");
    let client = c.etcd.client();
    let from = client
        .range_prefix(format!("{PREFIX}/claims/"))
        .expect("read etcd")
        .revision;
    c.node("b")
        .agent
        .cli(&["claim", "free", "v", "p1", "--reason", "test"])
        .ok();
    let prefix = format!("{PREFIX}/");
    let watch = client
        .watch(
            prefix.as_bytes(),
            claimd::etcd::prefix_end(prefix.as_bytes()),
            from + 1,
        )
        .expect("watch etcd");
    let (claim_key, note_key) = (
        format!("{PREFIX}/claims/v/p1"),
        format!("{PREFIX}/freed/v/p1"),
    );
    let (mut deleted, mut noted) = (None, None);
    let deadline = Instant::now() + SHOW_TIMEOUT;
    while (deleted.is_none() || noted.is_none()) && Instant::now() < deadline {
        match watch.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(WatchEvent::Delete(kv))) if kv.key_str() == claim_key => {
                deleted = Some(kv.mod_revision)
            }
            Ok(Some(WatchEvent::Put(kv))) if kv.key_str() == note_key => {
                noted = Some(kv.mod_revision)
            }
            Ok(_) => {}
            Err(e) => panic!("the watch ended: {e}"),
        }
    }
    assert!(
        deleted.is_some() && deleted == noted,
        "claim deleted at revision {deleted:?}, note written at {noted:?}"
    );
    let note = c.get_json("freed/v/p1").expect("the note");
    assert_eq!(note["reason"], "test", "{note}");
    assert_eq!(note["freed_by_node"], "b", "{note}");
    assert_eq!(note["claim"]["node"], "a", "{note}");
}

/// Issue 37, item 2: a claim that vanished from etcd without a `freed/`
/// note, while its allocation is still mounted here, was only logged: the
/// node kept the volume mounted and held nothing, so another node could
/// take it. The node's next reconciliation (after its registration) must
/// take it again. On 3768d0d the claim stayed gone.
#[test]
fn a_claim_gone_without_a_note_is_taken_again_by_its_node() {
    let mut c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    c.node_mut("a").agent.kill();
    // No `freed/` note.
    c.delete_in_etcd("claims/v/p1");
    c.node_mut("a").start_agent();
    wait_until(RETRY_TIMEOUT, "p1's claim to be taken again", || {
        c.holders("v") == ["p1"]
    });
    let claims = c.node("a").claims("v");
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0]["node"], "a", "{claims:?}");
    assert!(is_mount_point(&path), "p1 was unmounted");
    assert!(c.node("a").agent.log().contains("its claim is taken again"));
    // b cannot take it now.
    c.node("b").mount_waiting("q1", "data=v");
    assert_eq!(c.holders("v"), ["p1"]);
}

/// Issue 37, item 2, the other way: the claim vanished without a note and
/// another node took the volume meanwhile. The node must stop using it
/// (release its allocation), never keep it mounted while another node
/// holds it. On 3768d0d a kept p1 mounted.
#[test]
fn a_claim_gone_without_a_note_and_taken_elsewhere_releases_its_allocation() {
    let mut c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    c.node_mut("a").agent.kill();
    // No `freed/` note.
    c.delete_in_etcd("claims/v/p1");
    c.node("b").mount_ok("q1", "data=v");
    c.node_mut("a").start_agent();
    wait_until(RETRY_TIMEOUT, "a to release p1", || c.node("a").no_allocs());
    assert!(!is_mount_point(&path), "p1 is still mounted");
    assert_eq!(c.holders("v"), ["q1"]);
    assert!(c.node("a").agent.log().contains("cannot be taken again"));
}

/// Issue 37, item 8: with `lease-clock.json` gone (deleted by hand, a
/// state directory restored without it) on the same boot, the first
/// self-release tick, before the registration, counted the node as cut
/// off since forever and released every allocation, with etcd answering.
/// It must wait for the registration first. On 9347278 p1 was released.
#[test]
fn a_lost_lease_clock_with_etcd_answering_releases_nothing() {
    let mut c = Cluster::start(vec![nfs_node("a").stop_after_disconnect(STOP_AFTER)]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    let a = c.node_mut("a");
    a.agent.kill();
    let clock = a.agent.config.state_dir.join("lease-clock.json");
    std::fs::remove_file(&clock).expect("remove lease-clock.json");
    let log_from = a.agent.log().len();
    a.start_agent();
    let a = c.node("a");
    // Either the self-release counts from the registration, or it
    // released p1 (NodeUnpublish).
    let counted = || {
        a.agent.log()[log_from..].contains("lease clock was not known on this boot; it registered")
    };
    wait_until(SHOW_TIMEOUT, "the self-release to decide", || {
        counted() || !a.calls_of(NUP).is_empty()
    });
    assert!(
        !a.agent.log()[log_from..].contains("released while disconnected"),
        "{}",
        &a.agent.log()[log_from..]
    );
    assert!(
        a.calls_of(NUP).is_empty(),
        "p1 was released: {:?}",
        a.calls_of(NUP)
    );
    assert!(counted());
    assert!(is_mount_point(&path), "p1 was unmounted");
    assert_eq!(c.holders("v"), ["p1"]);
}

/// Issue 37, item 8: a node's liveness key deleted by hand (`etcdctl del`)
/// while its lease lives was written again only at the node's next take:
/// a node that took nothing stayed "gone", and the other nodes' reapers
/// counted it so, towards fencing a live node. The node's own watch must
/// have it written again. On 4cbb4f5 the key stayed gone.
#[test]
fn a_liveness_key_deleted_by_hand_is_written_again_without_a_take() {
    let c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    c.add_volume(&volume());
    let path = c.node("a").mount_ok("p1", "data=v");
    let key = format!("{PREFIX}/nodes/a");
    let client = c.etcd.client();
    let before = client.get(&key).expect("read etcd").expect("nodes/a");
    c.delete_in_etcd("nodes/a");
    wait_until(SHOW_TIMEOUT, "nodes/a to be written again", || c.alive("a"));
    let after = client.get(&key).expect("read etcd").expect("nodes/a");
    assert_eq!(after.lease, before.lease, "not on the same lease");
    assert!(is_mount_point(&path));
    assert_eq!(c.holders("v"), ["p1"]);
}

// ---- Registrations changed by hand -------------------------------------------

fn published(n: &Node) -> Vec<String> {
    n.calls_of("NodePublishVolume")
        .iter()
        .map(|c| c["volume_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// A node keeps a copy of each registration it mounts (to restart without
/// etcd); the copy was never brought up to date. "db" deregistered and
/// registered again for other storage, and its old storage registered as
/// "db2": node a, mounting "db" from its copy, published the storage node
/// b publishes as "db2" (two claims, two writers of one disk). On 611966a
/// a published ext-x for p2.
#[test]
fn a_volume_registered_again_for_other_storage_is_not_mounted_from_a_stale_copy() {
    let c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    let (a, b) = (c.node("a"), c.node("b"));
    let modes = &["single-node-writer"];
    c.add_volume(&volume_json("db", "ext-x", modes));
    a.mount_ok("p1", "data=db");
    a.release_ok("p1");
    // Through b only: a's copy still names ext-x.
    b.agent.cli(&["volume", "deregister", "db"]).ok();
    a.plugin.add_volume("ext-y");
    b.plugin.add_volume("ext-y");
    b.agent.register(&volume_json("db", "ext-y", modes)).ok();
    b.agent.register(&volume_json("db2", "ext-x", modes)).ok();
    b.mount_ok("q1", "data=db2");
    a.mount_ok("p2", "data=db");
    assert_eq!(published(b), ["ext-x"]);
    assert_eq!(
        published(a),
        ["ext-x", "ext-y"],
        "a published p2 from a stale copy of db's registration"
    );
}

/// A store's take for storage other than the registration names (a node's
/// copy gone stale between its read and its take) must be refused, by the
/// take itself: its `Txn` compares the registration's revision. Here the
/// store reads the registration, the volume is registered again for other
/// storage, then the store takes for what it read. On 611966a the take
/// went through (and the storage the stale copy names was claimed as "v").
#[test]
fn a_take_compares_the_registration_it_takes_for() {
    use claimd::claims::{Applied, ClaimChange, ClaimMode, ClaimRequest, StorageRef};
    use claimd::claims::{ClaimStore, SharedVolumes, Transaction};
    let c = Cluster::start(vec![nfs_node("a")]);
    c.add_volume(&volume());
    let dir = TestDir::new();
    let state = std::sync::Arc::new(
        claimd::state::StateStore::open(dir.path()).expect("a state directory"),
    );
    let store = claimd::claims::EtcdClaims::new(c.etcd.client(), PREFIX, state).with_node("b");
    let spec = SharedVolumes::get(&store, "v").expect("read etcd");
    assert_eq!(spec.map(|s| s.external_id).as_deref(), Some("ext-v"));
    let a = c.node("a");
    a.agent.cli(&["volume", "deregister", "v"]).ok();
    a.plugin.add_volume("ext-w");
    a.agent
        .register(&volume_json("v", "ext-w", &["single-node-writer"]))
        .ok();
    let take = |storage: &str| {
        let change = ClaimChange::Take(ClaimRequest {
            volume_id: "v".to_string(),
            alloc_id: "q1".to_string(),
            node: "b".to_string(),
            mode: ClaimMode::Write,
            access_mode: claimd::volumes::AccessMode::SingleNodeWriter,
            external_node_id: None,
            storage: Some(StorageRef {
                plugin_id: PLUGIN_ID.to_string(),
                external_id: storage.to_string(),
                context: Default::default(),
            }),
        });
        let mut record =
            |_: &mut claimd::state::StateFile, _: &[Result<(), claimd::claims::ClaimError>]| {};
        let applied = store
            .transact(Transaction {
                changes: vec![change],
                wanted: &|_| true,
                record: &mut record,
                closing: false,
            })
            .expect("the local write");
        let Applied::Done(mut outcomes) = applied else {
            panic!("the take was not wanted")
        };
        outcomes.remove(0)
    };
    let stale = take("ext-v");
    assert!(
        stale
            .as_ref()
            .is_err_and(|e| e.to_string().contains("registered again")),
        "{stale:?}"
    );
    assert!(c.holders("v").is_empty(), "{:?}", c.holders("v"));
    assert_eq!(take("ext-w"), Ok(()));
    assert_eq!(c.holders("v"), ["q1"]);
}

/// A registration replaced while the volume is claimed changes the
/// storage under the claim. The agent's own check (a claim list) comes
/// first; the write itself must hold against a take that lands after that
/// check: one `Txn` comparing the volume's claims range empty. On 611966a
/// the store's write replaced it.
#[test]
fn a_registration_never_changes_under_a_claim() {
    use claimd::claims::SharedVolumes;
    let c = Cluster::start(vec![nfs_node("a")]);
    c.add_volume(&volume());
    c.node("a").mount_ok("p1", "data=v");
    let dir = TestDir::new();
    let state = std::sync::Arc::new(
        claimd::state::StateStore::open(dir.path()).expect("a state directory"),
    );
    let store = claimd::claims::EtcdClaims::new(c.etcd.client(), PREFIX, state);
    let mut other: claimd::volumes::VolumeSpec =
        serde_json::from_value(volume_json("v", "ext-w", &["single-node-writer"])).expect("a spec");
    let r = SharedVolumes::register(&store, &other);
    assert!(r.is_err(), "replaced the registration of a claimed volume");
    assert_eq!(c.get_json("volumes/v").expect("v")["external_id"], "ext-v");
    // A capacity is written into the registration as it is, whoever holds
    // the volume; the same registration again is no change.
    let registered: claimd::volumes::VolumeSpec =
        serde_json::from_value(c.get_json("volumes/v").expect("v")).expect("a spec");
    SharedVolumes::set_capacity(&store, &registered, 4096, false).expect("capacity");
    let now = c.get_json("volumes/v").expect("v");
    assert_eq!(
        (&now["external_id"], &now["capacity_bytes"]),
        (&"ext-v".into(), &4096.into())
    );
    c.node("a").release_ok("p1");
    other.capacity_bytes = 0;
    SharedVolumes::register(&store, &other).expect("registered while unclaimed");
    assert_eq!(c.get_json("volumes/v").expect("v")["external_id"], "ext-w");
}

/// One storage volume (a plugin's external ID) has one name in the
/// cluster: two names would be two claims, two writers of one disk. A
/// second registration of the storage under another name is refused; one
/// written without the storage index (by an agent older than it, or by
/// hand) is refused at its take while the first name registers the
/// storage. On 611966a both names were registered and taken.
#[test]
fn one_storage_volume_has_one_name_in_the_cluster() {
    let c = Cluster::start(vec![nfs_node("a"), nfs_node("b")]);
    let modes = &["single-node-writer"];
    c.add_volume(&volume_json("db", "ext-x", modes));
    let b = &c.node("b").agent;
    let text = serde_json::to_vec(&volume_json("db2", "ext-x", modes)).expect("encode");
    let socket = b.config.api_socket.to_str().expect("UTF-8 socket path");
    let out = run_claimd(
        &["volume", "register", "-", "--socket", socket],
        Some(&text),
        &[],
        CLI_TIMEOUT,
    );
    assert_ne!(out.code, EXIT_OK, "db2 registered: {out:?}");
    assert!(
        out.stderr.contains("registered as volume db"),
        "{}",
        out.stderr
    );
    assert!(c.get_json("volumes/db2").is_none());
    // As an older agent writes it: no index, no compare.
    let spec = serde_json::to_vec(&volume_json("db2", "ext-x", modes)).expect("encode");
    c.etcd
        .client()
        .put(format!("{PREFIX}/volumes/db2"), spec)
        .expect("write etcd");
    c.node("a").mount_ok("p1", "data=db");
    let out = c.node("b").mount("q1", "data=db2", &[]);
    assert_ne!(out.code, EXIT_OK, "db2 mounted: {out:?}");
    assert!(
        out.stderr.contains("registered as volume db"),
        "{}",
        out.stderr
    );
    assert!(c.holders("db2").is_empty(), "{:?}", c.holders("db2"));
    assert_eq!(c.holders("db"), ["p1"]);
}

/// Issue 40: the key schema has a version in etcd. The first agent writes
/// `P/schema`; an agent that finds a newer one does not register (it
/// counts as cut off), names both versions, and leaves the key as it is;
/// once the key says its own schema again, it registers.
#[test]
fn an_agent_meeting_a_newer_key_schema_does_not_register() {
    let mut c = Cluster::start(vec![nfs_node("a")]);
    assert_eq!(
        c.get_json("schema"),
        Some(serde_json::json!({"version": 1}))
    );
    c.node_mut("a").agent.kill();
    let key = format!("{PREFIX}/schema");
    c.etcd
        .client()
        .put(key.as_str(), br#"{"version": 2}"#)
        .expect("write the schema");
    c.wait_gone("a");
    c.node_mut("a").start_agent();
    let a = c.node("a");
    wait_until(SHOW_TIMEOUT, "a to refuse the newer schema", || {
        a.agent
            .log()
            .contains("etcd holds key schema 2 (/claimd/schema), newer than this claimd's 1")
    });
    assert!(c.get_json("nodes/a").is_none(), "a registered");
    assert_eq!(
        c.get_json("schema"),
        Some(serde_json::json!({"version": 2}))
    );
    c.etcd
        .client()
        .put(key.as_str(), br#"{"version": 1}"#)
        .expect("write the schema");
    c.wait_alive("a");
}
