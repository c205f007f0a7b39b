//! `claimd::etcd` against a real etcd member (Debian's etcd-server, started
//! per test on free loopback ports): KV with prefixes, transactions and
//! their compares (create/mod revision, key ranges), leases with keep-alive,
//! expiry and revocation, watches from a revision, failover, a stopped
//! etcd, and bad endpoints.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::wait_until;
use crate::etcd_support::*;
use claimd::etcd::*;

/// Longest a test waits for etcd to act on its own (lease expiry runs
/// every 500 ms; the minimum TTL is about two seconds).
const ETCD_ACT_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest a test waits for one watch event.
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

fn keys(r: &RangeResponse) -> Vec<String> {
    r.kvs.iter().map(|kv| kv.key_str().into_owned()).collect()
}

fn next_event(w: &Watcher) -> WatchEvent {
    match w.recv_timeout(EVENT_TIMEOUT) {
        Ok(Some(ev)) => ev,
        Ok(None) => panic!("no watch event within {EVENT_TIMEOUT:?}"),
        Err(e) => panic!("watch failed: {}", claimd::error_chain(&e)),
    }
}

/// An event's kind, key and value, for comparing sequences.
fn summary(ev: &WatchEvent) -> (String, String, String) {
    match ev {
        WatchEvent::Put(kv) => (
            "put".into(),
            kv.key_str().into_owned(),
            String::from_utf8_lossy(&kv.value).into_owned(),
        ),
        WatchEvent::Delete(kv) => ("delete".into(), kv.key_str().into_owned(), String::new()),
        WatchEvent::Progress { revision } => {
            ("progress".into(), revision.to_string(), String::new())
        }
    }
}

/// A call whose only interest is how it fails.
type Call<'a> = Box<dyn Fn() -> Result<(), EtcdError> + 'a>;

fn triple(kind: &str, key: &str, value: &str) -> (String, String, String) {
    (kind.into(), key.into(), value.into())
}

#[test]
fn put_range_and_delete_with_prefixes() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let first = c.put("/t/a/1", "one").expect("put").revision;
    c.put("/t/a/2", "two").expect("put");
    c.put("/t/a2", "outside the prefix /t/a/").expect("put");
    let last = c.put("/t/b/1", "other").expect("put").revision;
    assert!(last > first);

    let a = c.range_prefix("/t/a/").expect("range");
    assert_eq!(keys(&a), ["/t/a/1", "/t/a/2"]);
    assert_eq!(a.count, 2);
    assert_eq!(a.revision, last);
    assert_eq!(a.kvs[0].value, b"one");
    assert_eq!(a.kvs[0].create_revision, first);
    assert_eq!(a.kvs[0].version, 1);
    assert_eq!(a.kvs[0].lease, None);

    // A second put changes the value, version and mod revision only.
    let rev = c.put("/t/a/1", "uno").expect("put").revision;
    let kv = c.get("/t/a/1").expect("get").expect("the key exists");
    assert_eq!(
        (
            kv.value.as_slice(),
            kv.version,
            kv.create_revision,
            kv.mod_revision
        ),
        (&b"uno"[..], 2, first, rev)
    );
    // [key, range_end) excludes range_end.
    let r = c.range("/t/a/1", "/t/a/2").expect("range");
    assert_eq!(keys(&r), ["/t/a/1"]);
    assert_eq!(c.get("/t/none").expect("get"), None);

    let d = c.delete_prefix("/t/a/").expect("delete");
    assert_eq!(d.deleted, 2);
    assert!(c.range_prefix("/t/a/").expect("range").kvs.is_empty());
    let rest = c.range_prefix("/t/").expect("range");
    assert_eq!(keys(&rest), ["/t/a2", "/t/b/1"]);
    assert_eq!(c.delete_range("/t/b/1", "").expect("delete").deleted, 1);
    assert_eq!(c.delete_range("/t/b/1", "").expect("delete").deleted, 0);
}

/// A prefix larger than one page, and larger than gRPC's 4 MiB receive
/// limit in all (5,000 values of 1 KiB: one unpaged Range of it fails), is
/// read whole by `range_prefix`, in key order, at one revision.
#[test]
fn a_prefix_larger_than_a_message_is_read_whole_in_pages() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let value = vec![b'x'; 1024];
    let n = 5_000;
    let mut last = 0;
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let puts: Vec<TxnOp> = chunk
            .iter()
            .map(|i| TxnOp::put(format!("/big/{i:05}"), value.clone()))
            .collect();
        let t = c.txn(&[], &puts, &[]).expect("txn");
        assert!(t.succeeded);
        last = t.revision;
    }
    let whole = c.range("/big/", "/big0");
    assert!(
        whole.is_err(),
        "one Range of 5 MB answered: the page size is not what keeps reads small"
    );
    let r = c.range_prefix("/big/").expect("a paged read");
    assert_eq!(r.revision, last);
    assert_eq!(r.kvs.len(), n);
    assert_eq!(r.count, n as i64);
    let want: Vec<String> = (0..n).map(|i| format!("/big/{i:05}")).collect();
    assert_eq!(keys(&r), want);
    assert!(r.kvs.iter().all(|kv| kv.value == value));
    let rev = c.put("/big/99999", "later").expect("put").revision;
    assert!(rev > r.revision);
    assert_eq!(c.range_prefix("/big/").expect("read").kvs.len(), n + 1);
}

#[test]
fn create_if_absent_has_exactly_one_winner_per_race() {
    let etcd = Etcd::start();
    // Two clients, as two nodes would have.
    let clients = [etcd.client(), etcd.client()];
    for round in 0..50 {
        let key = format!("/t/claims/vol-{round}");
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (c, key, barrier) = (c.clone(), key.clone(), barrier.clone());
                thread::spawn(move || {
                    let me = format!("node-{i}");
                    barrier.wait();
                    let r = c
                        .txn(
                            &[Compare::absent(key.as_str())],
                            &[TxnOp::put(key.as_str(), me.as_str())],
                            &[TxnOp::get(key.as_str())],
                        )
                        .expect("txn");
                    (me, r)
                })
            })
            .collect();
        let results: Vec<(String, TxnResponse)> = racers
            .into_iter()
            .map(|t| t.join().expect("racer"))
            .collect();
        let winners: Vec<&String> = results
            .iter()
            .filter(|(_, r)| r.succeeded)
            .map(|(me, _)| me)
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        // The loser's failure branch read the winner's claim.
        let (_, lost) = results.iter().find(|(_, r)| !r.succeeded).expect("a loser");
        let seen = lost.first_range().expect("the failure branch's read");
        assert_eq!(seen.kvs.len(), 1);
        assert_eq!(seen.kvs[0].value, winners[0].as_bytes());
        let stored = clients[0].get(&key).expect("get").expect("claimed");
        assert_eq!(stored.value, winners[0].as_bytes());
        assert!(matches!(
            results
                .iter()
                .find(|(_, r)| r.succeeded)
                .map(|(_, r)| &r.responses[..]),
            Some([TxnOpResponse::Put(_)])
        ));
    }
}

#[test]
fn mod_revision_and_value_compares() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let rev = c.put("/t/claim", "taken").expect("put").revision;

    // Update only if nobody changed it since we read it.
    let ok = c
        .txn(
            &[Compare::mod_revision("/t/claim", CompareOp::Equal, rev)],
            &[TxnOp::put("/t/claim", "releasing")],
            &[],
        )
        .expect("txn");
    assert!(ok.succeeded);
    assert!(ok.revision > rev);
    // The same compare is stale now: nothing happens, and that is no error.
    let stale = c
        .txn(
            &[Compare::mod_revision("/t/claim", CompareOp::Equal, rev)],
            &[TxnOp::put("/t/claim", "lost update")],
            &[TxnOp::get("/t/claim")],
        )
        .expect("txn");
    assert!(!stale.succeeded);
    assert_eq!(
        stale.revision, ok.revision,
        "a failed compare writes nothing"
    );
    let seen = stale.first_range().expect("read");
    assert_eq!(seen.kvs[0].value, b"releasing");
    assert_eq!(seen.kvs[0].mod_revision, ok.revision);

    // Greater/Less and value compares; all compares must hold.
    let r = c
        .txn(
            &[
                Compare::mod_revision("/t/claim", CompareOp::Greater, rev),
                Compare::value("/t/claim", CompareOp::Equal, "releasing"),
                Compare::version("/t/claim", CompareOp::Equal, 2),
            ],
            &[TxnOp::delete("/t/claim")],
            &[],
        )
        .expect("txn");
    assert!(r.succeeded);
    assert!(matches!(
        r.responses[..],
        [TxnOpResponse::Delete(DeleteResponse { deleted: 1, .. })]
    ));
    // A value compare on an absent key never holds.
    let r = c
        .txn(
            &[Compare::value("/t/claim", CompareOp::NotEqual, "x")],
            &[TxnOp::put("/t/claim", "x")],
            &[],
        )
        .expect("txn");
    assert!(!r.succeeded);
}

#[test]
fn key_range_compare_treats_an_empty_range_as_no_keys() {
    let etcd = Etcd::start();
    let c = etcd.client();
    // Keys next to the prefix, but outside it.
    c.put("/t/claims/db", "not under db/").expect("put");
    c.put("/t/claims/db0", "not under db/ either").expect("put");
    c.put("/t/claims/dbx/a", "another volume").expect("put");

    let take = |alloc: &str| {
        c.txn(
            &[Compare::prefix_empty("/t/claims/db/")],
            &[TxnOp::put(format!("/t/claims/db/{alloc}"), alloc)],
            &[TxnOp::get_prefix("/t/claims/db/")],
        )
        .expect("txn")
    };
    let first = take("alloc-1");
    assert!(first.succeeded, "nothing under the prefix yet");
    let second = take("alloc-2");
    assert!(!second.succeeded, "a claim exists under the prefix");
    assert_eq!(
        keys(second.first_range().expect("read")),
        ["/t/claims/db/alloc-1"]
    );

    // The same with an explicit range_end, and a compare that holds for
    // every key in a non-empty range.
    let r = c
        .txn(
            &[Compare::range_empty("/t/claims/db/", "/t/claims/db0")],
            &[],
            &[],
        )
        .expect("txn");
    assert!(!r.succeeded);
    let every_key_exists = Compare::version("/t/claims/db/", CompareOp::Greater, 0).with_prefix();
    assert!(c.txn(&[every_key_exists], &[], &[]).expect("txn").succeeded);

    // Once the range is empty again, the compare holds again.
    c.delete_prefix("/t/claims/db/").expect("delete");
    assert!(take("alloc-3").succeeded);
}

#[test]
fn keep_alive_keeps_a_key_past_twice_its_ttl_and_revoke_deletes_it() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let lease = c.lease_grant(Duration::from_secs(2)).expect("grant");
    let ttl = c
        .lease_time_to_live(lease)
        .expect("ttl")
        .expect("the lease exists");
    assert!(ttl <= Duration::from_secs(3), "{ttl:?}");
    c.put_with_lease("/t/nodes/n1", "alive", lease)
        .expect("put");
    let kv = c.get("/t/nodes/n1").expect("get").expect("the key exists");
    assert_eq!(kv.lease, Some(lease));

    let ka = c.keep_alive(lease).expect("keep-alive");
    assert_eq!(ka.lease(), lease);
    let granted = ka.ttl();
    assert!(granted >= Duration::from_secs(2), "{granted:?}");
    // Twice the TTL and a second more: the key must be there throughout.
    let past = granted * 2 + Duration::from_secs(1);
    let start = Instant::now();
    wait_until(past + ETCD_ACT_TIMEOUT, "twice the lease's TTL", || {
        assert!(
            c.get("/t/nodes/n1").expect("get").is_some(),
            "the key expired after {:?} despite the keep-alive",
            start.elapsed()
        );
        start.elapsed() > past
    });
    assert!(!ka.is_lost());
    assert!(ka.last_renewed() > start, "renewed while the test waited");

    c.lease_revoke(lease).expect("revoke");
    assert_eq!(c.get("/t/nodes/n1").expect("get"), None);
    assert_eq!(c.lease_time_to_live(lease).expect("ttl"), None);
    // The keep-alive hears it at its next round.
    let lost = ka.lost().recv_timeout(granted + ETCD_ACT_TIMEOUT);
    assert!(lost.is_err(), "the lost channel closes");
    assert!(ka.is_lost());
    // Revoking a lease that is gone is success; keeping it alive is not.
    c.lease_revoke(lease).expect("revoke again");
    match c.keep_alive(lease) {
        Err(EtcdError::LeaseNotFound { lease: l }) => assert_eq!(l, lease),
        other => panic!("keep-alive of a revoked lease: {other:?}"),
    }
    // Dropping the handle stops its thread promptly.
    let started = Instant::now();
    drop(ka);
    assert!(started.elapsed() < STOP_TIMEOUT);
}

#[test]
fn a_lease_that_is_not_kept_alive_expires_with_its_keys() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let lease = c.lease_grant(Duration::from_secs(2)).expect("grant");
    c.put_with_lease("/t/nodes/n2", "alive", lease)
        .expect("put");
    c.put("/t/nodes/n3", "no lease").expect("put");
    let start = Instant::now();
    wait_until(ETCD_ACT_TIMEOUT, "the lease's key to expire", || {
        c.get("/t/nodes/n2").expect("get").is_none()
    });
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "expired after {:?}, before its TTL",
        start.elapsed()
    );
    assert_eq!(c.lease_time_to_live(lease).expect("ttl"), None);
    assert!(c.get("/t/nodes/n3").expect("get").is_some());
}

#[test]
fn a_keep_alive_stopped_early_lets_the_lease_expire() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let lease = c.lease_grant(Duration::from_secs(2)).expect("grant");
    c.put_with_lease("/t/nodes/n4", "alive", lease)
        .expect("put");
    let ka = c.keep_alive(lease).expect("keep-alive");
    let started = Instant::now();
    ka.stop();
    assert!(started.elapsed() < STOP_TIMEOUT);
    wait_until(ETCD_ACT_TIMEOUT, "the lease's key to expire", || {
        c.get("/t/nodes/n4").expect("get").is_none()
    });
}

#[test]
fn watch_from_a_revision_sees_puts_and_deletes_in_order() {
    let etcd = Etcd::start();
    let c = etcd.client();
    let start = c.put("/t/att/vol/n1", "requested").expect("put").revision;
    c.put("/t/att/vol/n1", "attached").expect("put");
    c.put("/t/other", "outside").expect("put");
    c.delete_range("/t/att/vol/n1", "").expect("delete");

    // Everything from `start` on, history first.
    let w = c
        .watch("/t/att/", prefix_end(b"/t/att/"), start)
        .expect("watch");
    let mut seen = Vec::new();
    let mut last = 0;
    for _ in 0..3 {
        let ev = next_event(&w);
        assert!(ev.revision() > last, "in revision order");
        last = ev.revision();
        seen.push(summary(&ev));
    }
    assert_eq!(
        seen,
        [
            triple("put", "/t/att/vol/n1", "requested"),
            triple("put", "/t/att/vol/n1", "attached"),
            triple("delete", "/t/att/vol/n1", ""),
        ]
    );
    // Then live changes, as they happen.
    let rev = c.put("/t/att/vol/n2", "requested").expect("put").revision;
    let ev = next_event(&w);
    assert_eq!(summary(&ev), triple("put", "/t/att/vol/n2", "requested"));
    assert_eq!(ev.revision(), rev);
    match &ev {
        WatchEvent::Put(kv) => assert_eq!((kv.version, kv.create_revision), (1, rev)),
        other => panic!("{other:?}"),
    }
    c.put("/t/other", "still outside").expect("put");
    // A progress answer says how far the watch has seen.
    w.request_progress();
    match next_event(&w) {
        WatchEvent::Progress { revision } => assert!(revision >= rev),
        other => panic!("expected progress, got {other:?}"),
    }
    assert_eq!(
        w.recv_timeout(Duration::from_millis(50)).expect("no error"),
        None
    );

    // A watch from now sees only what follows.
    let now = c.watch("/t/att/vol/n2", "", 0).expect("watch");
    c.delete_range("/t/att/vol/n2", "").expect("delete");
    assert_eq!(
        summary(&next_event(&now)),
        triple("delete", "/t/att/vol/n2", "")
    );
    assert_eq!(
        summary(&next_event(&w)),
        triple("delete", "/t/att/vol/n2", "")
    );

    // Cancelling ends the watch.
    now.cancel();
    let started = Instant::now();
    drop(w);
    assert!(started.elapsed() < STOP_TIMEOUT);
}

#[test]
fn watch_survives_an_etcd_restart_without_losing_events() {
    let mut etcd = Etcd::start();
    let c = etcd.client();
    let w = c.watch("/t/w/", prefix_end(b"/t/w/"), 0).expect("watch");
    c.put("/t/w/1", "before").expect("put");
    assert_eq!(summary(&next_event(&w)), triple("put", "/t/w/1", "before"));
    etcd.restart();
    wait_until(ETCD_ACT_TIMEOUT, "a put after the restart", || {
        c.put("/t/w/2", "after").is_ok()
    });
    c.delete_range("/t/w/1", "").expect("delete");
    assert_eq!(summary(&next_event(&w)), triple("put", "/t/w/2", "after"));
    assert_eq!(summary(&next_event(&w)), triple("delete", "/t/w/1", ""));
}

#[test]
fn keep_alive_survives_an_etcd_restart() {
    let mut etcd = Etcd::start();
    let c = etcd.client();
    let lease = c.lease_grant(Duration::from_secs(5)).expect("grant");
    c.put_with_lease("/t/nodes/n5", "alive", lease)
        .expect("put");
    let ka = c.keep_alive(lease).expect("keep-alive");
    etcd.restart();
    let restarted = Instant::now();
    wait_until(ETCD_ACT_TIMEOUT, "a renewal after the restart", || {
        ka.last_renewed() > restarted
    });
    assert!(!ka.is_lost());
    assert!(c.get("/t/nodes/n5").expect("get").is_some());
}

#[test]
fn failover_skips_a_dead_endpoint_and_remembers_the_live_one() {
    let etcd = Etcd::start();
    let dead = format!("http://127.0.0.1:{}", free_port());
    let c = EtcdClient::connect(
        &[dead, etcd.endpoint()],
        EtcdOptions {
            call_timeout: Duration::from_secs(5),
            ..EtcdOptions::default()
        },
    )
    .expect("connect");
    c.put("/t/f", "1").expect("put through the second endpoint");
    let live = format!("127.0.0.1:{}", etcd.client_port());
    assert_eq!(c.current_endpoint(), live);
    assert_eq!(c.get("/t/f").expect("get").expect("exists").value, b"1");
    assert!(
        c.txn(&[Compare::absent("/t/g")], &[TxnOp::put("/t/g", "x")], &[])
            .expect("txn")
            .succeeded
    );
    let w = c.watch("/t/f", "", 0).expect("watch");
    c.put("/t/f", "2").expect("put");
    assert_eq!(summary(&next_event(&w)), triple("put", "/t/f", "2"));
    let lease = c.lease_grant(Duration::from_secs(5)).expect("grant");
    let ka = c.keep_alive(lease).expect("keep-alive");
    assert!(!ka.is_lost());
    assert_eq!(c.current_endpoint(), live);
}

#[test]
fn a_stopped_etcd_gives_a_retryable_error_within_the_deadline() {
    let mut etcd = Etcd::start();
    let timeout = Duration::from_secs(2);
    let c = etcd.client_with(timeout);
    c.put("/t/s", "1").expect("put");
    etcd.kill();
    let calls: [(&str, Call); 5] = [
        ("get", Box::new(|| c.get("/t/s").map(drop))),
        ("put", Box::new(|| c.put("/t/s", "2").map(drop))),
        (
            "txn",
            Box::new(|| c.txn(&[Compare::absent("/t/s")], &[], &[]).map(drop)),
        ),
        (
            "lease_grant",
            Box::new(|| c.lease_grant(Duration::from_secs(5)).map(drop)),
        ),
        ("watch", Box::new(|| c.watch("/t/s", "", 0).map(drop))),
    ];
    for (name, call) in &calls {
        let started = Instant::now();
        let e = call().expect_err(name);
        let took = started.elapsed();
        assert!(e.is_retryable(), "{name}: {e:?}");
        assert!(
            took < timeout + Duration::from_secs(1),
            "{name} took {took:?}, past its {timeout:?} deadline"
        );
        assert!(e.to_string().contains("etcd"), "{name}: {e}");
    }
    // Back again: the same client works without being recreated.
    etcd.restart();
    wait_until(ETCD_ACT_TIMEOUT, "the client to reconnect", || {
        c.get("/t/s").is_ok()
    });
    assert_eq!(c.get("/t/s").expect("get").expect("kept").value, b"1");
}

#[test]
fn an_idle_watch_stays_fresh_and_a_frozen_member_makes_it_stale() {
    let etcd = Etcd::start();
    let c = etcd.client_with(Duration::from_secs(2));
    let w = c.watch("/t/fresh", "", 0).expect("watch");
    let fresh = Duration::from_secs(4);
    assert!(w.is_fresh(fresh));
    // Idle for longer than its progress period: still fresh, because the
    // stream asks etcd for progress and etcd answers.
    let idle_until = Instant::now() + claimd::etcd::AUTO_PROGRESS * 3;
    while Instant::now() < idle_until {
        assert!(w.is_fresh(fresh), "an idle watch of a live etcd went stale");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A member that answers nothing: the watch shows it (issue 22, defect
    // 9: a silent watch is never taken for "nothing changed").
    etcd.freeze();
    wait_until(Duration::from_secs(30), "the watch to go stale", || {
        !w.is_fresh(fresh)
    });
    etcd.thaw();
    wait_until(
        Duration::from_secs(60),
        "the watch to be fresh again",
        || w.is_fresh(fresh),
    );
    // And it still delivers.
    c.put("/t/fresh", "1").expect("put");
    assert_eq!(summary(&next_event(&w)), triple("put", "/t/fresh", "1"));
}

#[test]
fn a_frozen_etcd_costs_one_call_deadline_not_a_hang() {
    let etcd = Etcd::start();
    let timeout = Duration::from_secs(2);
    let c = etcd.client_with(timeout);
    let lease = c.lease_grant(Duration::from_secs(10)).expect("grant");
    let ka = c.keep_alive(lease).expect("keep-alive");
    let w = c.watch("/t/z", "", 0).expect("watch");
    c.put("/t/z", "1").expect("put");
    assert_eq!(summary(&next_event(&w)), triple("put", "/t/z", "1"));
    // SIGSTOP: the connection stays open and nothing answers.
    etcd.freeze();
    let calls: [(&str, Call); 3] = [
        ("get", Box::new(|| c.get("/t/z").map(drop))),
        ("put", Box::new(|| c.put("/t/z", "2").map(drop))),
        ("watch", Box::new(|| c.watch("/t/z", "", 0).map(drop))),
    ];
    for (name, call) in &calls {
        let started = Instant::now();
        let e = call().expect_err(name);
        let took = started.elapsed();
        assert!(e.is_retryable(), "{name}: {e:?}");
        assert!(
            took >= timeout - Duration::from_millis(100) && took < timeout + Duration::from_secs(1),
            "{name} took {took:?} with a {timeout:?} deadline: {e}"
        );
    }
    etcd.thaw();
    // The put that timed out may or may not have been applied: exactly the
    // uncertainty a deadline leaves. Everything works again, the watch and
    // the keep-alive included.
    wait_until(ETCD_ACT_TIMEOUT, "etcd to answer again", || {
        c.put("/t/z", "3").is_ok()
    });
    let thawed = Instant::now();
    loop {
        let ev = next_event(&w);
        if summary(&ev) == triple("put", "/t/z", "3") {
            break;
        }
        assert_eq!(
            summary(&ev),
            triple("put", "/t/z", "2"),
            "only the uncertain put"
        );
    }
    wait_until(ETCD_ACT_TIMEOUT, "a renewal after the freeze", || {
        ka.last_renewed() > thawed
    });
    assert!(!ka.is_lost());
}

#[test]
fn after_a_silent_member_times_out_the_next_call_goes_elsewhere() {
    let etcd = Etcd::start();
    let proxy = Proxy::start(
        format!("127.0.0.1:{}", etcd.client_port())
            .parse()
            .expect("an address"),
    );
    let timeout = Duration::from_secs(2);
    let c = EtcdClient::connect(
        &[proxy.endpoint(), etcd.endpoint()],
        EtcdOptions {
            call_timeout: timeout,
            ..EtcdOptions::default()
        },
    )
    .expect("connect");
    c.put("/t/p", "1").expect("put through the proxy");
    assert_eq!(c.current_endpoint(), proxy.addr().to_string());
    // A partition: the connection stays open, nothing answers.
    proxy.pause();
    let started = Instant::now();
    let e = c.put("/t/p", "2").expect_err("nothing passes the proxy");
    assert!(e.is_retryable(), "{e:?}");
    assert_eq!(
        e.code(),
        Some(grpcio::RpcStatusCode::DEADLINE_EXCEEDED),
        "{e}"
    );
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
    // The next call starts at the other endpoint and goes through.
    c.put("/t/p", "3").expect("put through the second endpoint");
    assert_eq!(
        c.current_endpoint(),
        format!("127.0.0.1:{}", etcd.client_port())
    );
    proxy.resume();
    assert_eq!(c.get("/t/p").expect("get").expect("exists").value, b"3");
}

#[test]
fn a_member_that_never_answers_gets_its_share_of_the_deadline() {
    // Accepts connections and never says a word (no HTTP/2 handshake).
    let mute = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let mute_addr = mute.local_addr().expect("address");
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let acceptor = thread::spawn(move || {
        for conn in mute.incoming() {
            // Kept open until the test ends.
            if held_tx.send(conn).is_err() {
                return;
            }
        }
    });
    let etcd = Etcd::start();
    let timeout = Duration::from_secs(2);
    let c = EtcdClient::connect(
        &[format!("http://{mute_addr}"), etcd.endpoint()],
        EtcdOptions {
            call_timeout: timeout,
            ..EtcdOptions::default()
        },
    )
    .expect("connect");
    let started = Instant::now();
    c.put("/t/m", "1").expect("put through the second endpoint");
    let took = started.elapsed();
    assert!(took < timeout, "took {took:?}");
    assert!(
        took >= timeout / 2 - Duration::from_millis(100),
        "took {took:?}"
    );
    assert_eq!(
        c.current_endpoint(),
        format!("127.0.0.1:{}", etcd.client_port())
    );

    // Alone, it costs the whole deadline and a retryable error.
    let alone = EtcdClient::connect(
        &[mute_addr.to_string()],
        EtcdOptions {
            call_timeout: timeout,
            ..EtcdOptions::default()
        },
    )
    .expect("connect");
    let started = Instant::now();
    let e = alone.get("/t/m").expect_err("nobody answers");
    assert!(e.is_retryable(), "{e:?}");
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
    assert!(held_rx.try_recv().is_ok(), "the mute member was dialled");
    drop(held_rx);
    // Unblock the acceptor so that it sees the closed channel and ends.
    let _ = std::net::TcpStream::connect(mute_addr);
    acceptor.join().expect("acceptor");
}

#[test]
fn bad_endpoints_give_clear_errors() {
    let connect = |eps: &[&str], tls: Option<TlsOptions>| {
        let eps: Vec<String> = eps.iter().map(|s| s.to_string()).collect();
        EtcdClient::connect(
            &eps,
            EtcdOptions {
                tls,
                ..EtcdOptions::default()
            },
        )
    };
    let msg = |r: Result<EtcdClient, EtcdError>| match r {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => {
            assert!(!e.is_retryable(), "{e:?}");
            claimd::error_chain(&e)
        }
    };
    assert_eq!(msg(connect(&[], None)), "no etcd endpoint is configured");
    assert_eq!(
        msg(connect(&["127.0.0.1:2379", "etcd-1"], None)),
        "etcd endpoint \"etcd-1\" is not valid: it has no port (host:port)"
    );
    assert_eq!(
        msg(connect(&["unix:///run/etcd.sock"], None)),
        "etcd endpoint \"unix:///run/etcd.sock\" is not valid: the scheme must be http:// or https://"
    );
    assert_eq!(
        msg(connect(&["http://127.0.0.1:99999"], None)),
        "etcd endpoint \"http://127.0.0.1:99999\" is not valid: the port is not a number from 1 to 65535"
    );
    assert_eq!(
        msg(connect(&["https://127.0.0.1:2379"], None)),
        "etcd endpoint https://127.0.0.1:2379 does not match the TLS settings \
         (https:// needs them, http:// excludes them)"
    );
    let missing = TlsOptions {
        ca: "/nonexistent/ca.pem".into(),
        identity: None,
    };
    assert_eq!(
        msg(connect(&["127.0.0.1:2379"], Some(missing))),
        "failed to read TLS file /nonexistent/ca.pem: No such file or directory (os error 2)"
    );
}

#[cfg(not(feature = "tls"))]
#[test]
fn tls_settings_need_the_tls_build() {
    let ca = tempfile::NamedTempFile::new().expect("a CA file");
    // PEM-shaped: the files are checked before the build is.
    std::fs::write(
        ca.path(),
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
    )
    .expect("write the CA file");
    let r = EtcdClient::connect(
        &["127.0.0.1:2379".to_string()],
        EtcdOptions {
            tls: Some(TlsOptions {
                ca: ca.path().to_path_buf(),
                identity: None,
            }),
            ..EtcdOptions::default()
        },
    );
    match r {
        Err(e @ EtcdError::TlsNotBuilt) => assert_eq!(
            e.to_string(),
            "etcd over TLS needs a claimd built with the `tls` feature"
        ),
        other => panic!("{other:?}"),
    }
}
