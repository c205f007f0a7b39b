//! Tests of the state store and its files.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::files::tmp_path;
use super::journal::JOURNAL_FILE;
use super::*;
use crate::volumes::VolumeSpec;

#[derive(Debug)]
struct TestErr(String);
impl From<StateError> for TestErr {
    fn from(e: StateError) -> Self {
        TestErr(e.to_string())
    }
}

fn spec(id: &str) -> Arc<VolumeSpec> {
    serde_json::from_value(serde_json::json!({
        "id": id, "plugin_id": "p", "external_id": "x",
        "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"],
        "secrets": {"token": "s3cret"}
    }))
    .expect("spec")
}

fn on_disk(dir: &Path) -> StateFile {
    load_dir(dir).expect("load").expect("a state").state
}

#[test]
fn round_trip_mode_and_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = StateStore::open_with_boot_id(dir.path(), "boot-a").expect("open");
        s.update::<_, TestErr>(|st| {
            st.volumes.insert("db".into(), spec("db"));
            Ok(())
        })
        .expect("update");
        // One journal line; opening wrote the first snapshot.
        assert_eq!(
            s.write_stats(),
            WriteStats {
                writes: 1,
                bytes: std::fs::metadata(s.journal_path()).expect("journal").len(),
                fsyncs: 1,
                snapshots: 0
            }
        );
        // A no-op update writes nothing.
        s.update::<_, TestErr>(|_| Ok(())).expect("noop");
        assert_eq!(s.write_stats().writes, 1);
    }
    for f in [STATE_FILE, JOURNAL_FILE] {
        let mode = std::fs::metadata(dir.path().join(f))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    let s = StateStore::open_with_boot_id(dir.path(), "boot-a").expect("reopen");
    assert!(!s.rebooted());
    assert_eq!(
        s.read(|st| st.volumes["db"].secrets["token"].clone()),
        "s3cret"
    );
    drop(s);
    let s = StateStore::open_with_boot_id(dir.path(), "boot-b").expect("reopen");
    assert!(s.rebooted());
}

#[test]
fn second_open_is_refused_while_locked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _a = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    let e = StateStore::open_with_boot_id(dir.path(), "b")
        .err()
        .expect("second open must fail");
    assert!(matches!(e, StateError::Locked { .. }), "{e}");
}

#[test]
fn corrupt_and_unknown_version_are_refused_and_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(STATE_FILE);
    for (bytes, want) in [
        (
            &b"{\"schema_version\":1,\"boot_id\":\"x\",\"allocs\":{\"a\""[..],
            "corrupt",
        ),
        (&b"not json at all"[..], "corrupt"),
        (
            &b"{\"schema_version\":99,\"boot_id\":\"x\"}"[..],
            "schema version 99",
        ),
        (
            &b"{\"schema_version\":1,\"boot_id\":\"x\",\"surprise\":1}"[..],
            "corrupt",
        ),
    ] {
        std::fs::write(&path, bytes).expect("write");
        let e = StateStore::open_with_boot_id(dir.path(), "b")
            .err()
            .expect("must refuse");
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert_eq!(std::fs::read(&path).expect("read"), bytes, "file changed");
    }
}

#[test]
fn failed_update_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    let before = std::fs::read(s.path()).expect("read");
    let r: Result<(), TestErr> = s.update(|st| {
        st.volumes.insert("db".into(), spec("db"));
        Err(TestErr("refused".into()))
    });
    assert!(r.is_err());
    assert!(s.read(|st| st.volumes.is_empty()));
    assert_eq!(std::fs::read(s.path()).expect("read"), before);
}

#[test]
fn concurrent_updates_are_all_durable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = std::sync::Arc::new(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
    let threads: Vec<_> = (0..40)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                s.update::<_, TestErr>(|st| {
                    st.volumes.insert(format!("v{i}"), spec(&format!("v{i}")));
                    Ok(())
                })
                .expect("update");
                // Once update returns, the change is on disk.
                let on_disk = on_disk(s.dir());
                assert!(on_disk.volumes.contains_key(&format!("v{i}")));
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let on_disk = on_disk(s.dir());
    assert_eq!(on_disk.volumes.len(), 40);
    assert_eq!(s.snapshot(), on_disk);
    let writes = s.write_stats().writes;
    assert!((1..=40).contains(&writes), "{writes} writes");
}

/// A small tmpfs mounted on a test's directory, unmounted on drop.
struct SmallFs(std::ffi::CString);

impl SmallFs {
    fn mount(dir: &Path, opts: &std::ffi::CStr) -> SmallFs {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("path");
        let fs = c"tmpfs";
        // SAFETY: plain mount(2) of a small tmpfs on our own temp dir.
        let rc = unsafe {
            libc::mount(
                fs.as_ptr(),
                c.as_ptr(),
                fs.as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount tmpfs: {}", io::Error::last_os_error());
        SmallFs(c)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        // SAFETY: umount2(2) of the tmpfs mounted above.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn disk_full_fails_the_update_and_keeps_the_old_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _unmount = SmallFs::mount(dir.path(), c"size=64k");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    s.update::<_, TestErr>(|st| {
        st.volumes.insert("small".into(), spec("small"));
        Ok(())
    })
    .expect("a small update fits");
    let before = std::fs::read(s.path()).expect("read");
    let journal_before = std::fs::read(s.journal_path()).expect("read");
    let r: Result<(), TestErr> = s.update(|st| {
        let mut big = spec("big");
        Arc::make_mut(&mut big)
            .context
            .insert("blob".into(), "x".repeat(200 * 1024));
        st.volumes.insert("big".into(), big);
        Ok(())
    });
    let e = r.expect_err("the disk is full");
    assert!(e.0.contains("failed to write state file"), "{e:?}");
    assert_eq!(std::fs::read(s.path()).expect("read"), before);
    assert_eq!(
        std::fs::read(s.journal_path()).expect("read"),
        journal_before,
        "the part of the line that fitted was not cut off"
    );
    assert!(s.read(|st| !st.volumes.contains_key("big")));
    assert!(!tmp_path(s.path()).exists(), "the temporary file was left");
    // An update that changes nothing is not failed by the earlier batch.
    let r: Result<u32, TestErr> = s.update(|_| Ok(7));
    assert_eq!(r.expect("a no-op update after a failure"), 7);
    // The store still works after the failure.
    s.update::<_, TestErr>(|st| {
        st.volumes.remove("small");
        Ok(())
    })
    .expect("update after a failure");
    assert!(on_disk(s.dir()).volumes.is_empty());
}

#[test]
fn leftover_temporary_file_is_ignored() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
    let tmp = tmp_path(&dir.path().join(STATE_FILE));
    std::fs::write(&tmp, b"torn wri").expect("write");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    assert!(!tmp.exists());
    assert_eq!(s.read(|st| st.schema_version), SCHEMA_VERSION);
}

fn put(s: &StateStore, id: &str, blob: usize) {
    s.update::<_, TestErr>(|st| {
        let mut v = spec(id);
        Arc::make_mut(&mut v)
            .context
            .insert("blob".into(), "x".repeat(blob));
        st.volumes.insert(id.into(), v);
        Ok(())
    })
    .expect("update");
}

#[test]
fn changes_are_journal_lines_and_reopening_folds_them_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let snapshot_at_open;
    {
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        snapshot_at_open = std::fs::read(s.path()).expect("read");
        for i in 0..3 {
            put(&s, &format!("v{i}"), 10);
        }
        let ws = s.write_stats();
        assert_eq!((ws.writes, ws.fsyncs, ws.snapshots), (3, 3, 0));
        // The snapshot is untouched; the journal has one line a change.
        assert_eq!(std::fs::read(s.path()).expect("read"), snapshot_at_open);
        let journal = std::fs::read(s.journal_path()).expect("read");
        assert_eq!(journal.iter().filter(|&&b| b == b'\n').count(), 3);
        assert_eq!(ws.bytes, journal.len() as u64);
        assert_eq!(on_disk(dir.path()), s.snapshot());
    }
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
    assert_eq!(s.read(|st| st.volumes.len()), 3);
    // `compact` (a graceful stop) does the same while running.
    put(&s, "v3", 10);
    assert!(std::fs::metadata(s.journal_path()).expect("stat").len() > 0);
    s.compact().expect("compact");
    assert_eq!(std::fs::metadata(s.journal_path()).expect("stat").len(), 0);
    let snap = parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
    assert_eq!(snap, s.snapshot());
    assert_eq!(s.write_stats().snapshots, 1);
    drop(s);
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
    assert_eq!(s.read(|st| st.volumes.len()), 4);
    // Folded in: a new snapshot holds everything, the journal is empty.
    let snap = parse_state(s.path(), &std::fs::read(s.path()).expect("read")).expect("parse");
    assert_eq!(snap, s.snapshot());
    assert_eq!(std::fs::metadata(s.journal_path()).expect("stat").len(), 0);
}

#[test]
fn a_large_journal_is_compacted_into_a_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    // 100 KiB a change: the journal passes 1 MiB after 11 changes.
    for i in 0..25 {
        put(&s, &format!("v{}", i % 5), 100 * 1024 + i);
    }
    let ws = s.write_stats();
    assert!(ws.snapshots >= 1, "{ws:?}");
    assert!(
        std::fs::metadata(s.journal_path()).expect("stat").len() <= JOURNAL_MIN_COMPACT * 2,
        "the journal kept growing"
    );
    assert_eq!(on_disk(dir.path()), s.snapshot());
    drop(s);
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
    assert_eq!(
        s.read(|st| st.volumes["v4"].context["blob"].len()),
        100 * 1024 + 24
    );
}

#[test]
fn a_corrupt_journal_is_refused_and_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let journal_path;
    {
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        put(&s, "v1", 10);
        put(&s, "v2", 10);
        journal_path = s.journal_path().to_path_buf();
    }
    let snapshot = std::fs::read(dir.path().join(STATE_FILE)).expect("read");
    let mut journal = std::fs::read(&journal_path).expect("read");
    journal[30] ^= 0x20;
    std::fs::write(&journal_path, &journal).expect("write");
    let e = StateStore::open_with_boot_id(dir.path(), "b")
        .err()
        .expect("must refuse");
    let msg = e.to_string();
    assert!(msg.contains(&journal_path.display().to_string()), "{msg}");
    assert!(msg.contains("corrupt at line 1"), "{msg}");
    assert_eq!(std::fs::read(&journal_path).expect("read"), journal);
    assert_eq!(
        std::fs::read(dir.path().join(STATE_FILE)).expect("read"),
        snapshot
    );
    assert!(matches!(
        load_dir(dir.path()),
        Err(StateError::CorruptJournal { line: 1, .. })
    ));
}

#[test]
fn a_torn_last_line_is_left_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        put(&s, "v1", 10);
        put(&s, "v2", 10);
    }
    let journal_path = dir.path().join(JOURNAL_FILE);
    let journal = std::fs::read(&journal_path).expect("read");
    // Cut the second line in the middle, as a crash during the write.
    let first = journal.iter().position(|&b| b == b'\n').expect("a line") + 1;
    std::fs::write(&journal_path, &journal[..first + 40]).expect("write");
    let loaded = load_dir(dir.path()).expect("load").expect("state");
    assert!(loaded.torn_tail);
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    assert_eq!(
        s.read(|st| st.volumes.keys().cloned().collect::<Vec<_>>()),
        ["v1"]
    );
    assert_eq!(std::fs::metadata(&journal_path).expect("stat").len(), 0);
}

#[test]
fn a_journal_without_its_snapshot_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
        put(&s, "v1", 10);
    }
    std::fs::remove_file(dir.path().join(STATE_FILE)).expect("rm");
    let e = StateStore::open_with_boot_id(dir.path(), "b")
        .err()
        .expect("must refuse");
    assert!(
        matches!(e, StateError::JournalWithoutSnapshot { .. }),
        "{e}"
    );
    assert!(!dir.path().join(STATE_FILE).exists());
}

#[test]
fn a_reader_sees_every_durable_change_while_the_store_compacts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = std::sync::Arc::new(StateStore::open_with_boot_id(dir.path(), "b").expect("open"));
    let durable = std::sync::Arc::new(AtomicU64::new(0));
    let writer = {
        let (s, durable) = (s.clone(), durable.clone());
        std::thread::spawn(move || {
            for i in 1..=60u64 {
                s.update::<_, TestErr>(|st| {
                    let mut v = spec("counter");
                    let m = Arc::make_mut(&mut v);
                    m.context.insert("n".into(), i.to_string());
                    // Big enough to compact every dozen changes.
                    m.context.insert("blob".into(), "x".repeat(90 * 1024));
                    st.volumes.insert("counter".into(), v);
                    Ok(())
                })
                .expect("update");
                durable.store(i, Ordering::SeqCst);
            }
        })
    };
    let mut reads = 0;
    while !writer.is_finished() {
        let floor = durable.load(Ordering::SeqCst);
        let st = on_disk(dir.path());
        let n: u64 = st
            .volumes
            .get("counter")
            .map(|v| v.context["n"].parse().expect("n"))
            .unwrap_or(0);
        assert!(n >= floor, "read {n} after {floor} was durable");
        reads += 1;
    }
    writer.join().expect("writer");
    assert!(s.write_stats().snapshots >= 2, "{:?}", s.write_stats());
    assert!(reads > 0);
    assert_eq!(on_disk(dir.path()), s.snapshot());
}

#[test]
fn a_schema_1_file_is_read_and_written_back_as_schema_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(STATE_FILE);
    std::fs::write(
        &path,
        br#"{"schema_version":1,"boot_id":"b","claims":[{"volume_id":"v","alloc_id":"a","node":"n","mode":"write","access_mode":"single-node-writer","state":"taken"}]}"#,
    )
    .expect("write");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    assert_eq!(s.read(|st| st.claims.len()), 1);
    let on_disk = std::fs::read(&path).expect("read");
    let v: serde_json::Value = serde_json::from_slice(&on_disk).expect("json");
    assert_eq!(v["schema_version"], 2);
    assert_eq!(v["claims"][0]["alloc_id"], "a");
    assert!(s.journal_path().exists());
}

/// A compaction started by a write folds the state the journal leads
/// to, not the write's own change: a crash between the new snapshot and
/// the new journal (simulated by putting the old journal back) then
/// replays the old journal onto its own end state. Folding the change
/// instead would bring back a freed claim whose allocation is gone.
#[test]
fn a_crash_inside_a_compaction_leaves_a_state_that_was_durable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    let claim = Claim {
        volume_id: "v".into(),
        alloc_id: "a".into(),
        node: "n".into(),
        mode: ClaimMode::Write,
        access_mode: crate::volumes::AccessMode::SingleNodeWriter,
        external_node_id: None,
        publish_context: BTreeMap::new(),
        state: ClaimState::Taken,
        since_ms: None,
        last_error: None,
    };
    let record: AllocRecord = serde_json::from_value(serde_json::json!({
        "id": "a", "volumes": {"data": {
            "alias": "data", "volume_id": "v", "plugin_id": "p", "external_volume_id": "x",
            "usage": {"read_only": false, "access_mode": "single-node-writer", "attachment": "file-system"},
            "target_path": "/m/a", "phase": "published"}}
    }))
    .expect("record");
    put(&s, "v", 10);
    s.update::<_, TestErr>(|st| {
        st.claims
            .insert(("v".into(), "a".into()), Arc::new(claim.clone()));
        st.allocs.insert("a".into(), Arc::new(record.clone()));
        Ok(())
    })
    .expect("claim");
    // The allocation and its claim are in the snapshot; from here on the
    // journal holds only changes to them.
    s.compact().expect("compact");
    s.update::<_, TestErr>(|st| {
        st.claim_mut("v", "a").expect("claim").state = ClaimState::Releasing;
        st.alloc_mut("a").expect("a").releasing = true;
        Ok(())
    })
    .expect("mark");
    // Grow the journal past the threshold.
    put(&s, "big", (JOURNAL_MIN_COMPACT + 1024) as usize);
    assert_eq!(s.write_stats().snapshots, 1);
    let before = s.snapshot();
    let old_journal = std::fs::read(s.journal_path()).expect("read");
    // The release's last write: free the claim, drop the allocation.
    s.update::<_, TestErr>(|st| {
        st.claims.remove(&("v".to_string(), "a".to_string()));
        st.allocs.remove("a");
        Ok(())
    })
    .expect("free");
    assert_eq!(s.write_stats().snapshots, 2, "the write compacted");
    let after = s.snapshot();
    assert!(on_disk(dir.path()) == after);
    // The crash: the new snapshot with the old journal still in place.
    std::fs::write(s.journal_path(), &old_journal).expect("put the old journal back");
    let crashed = on_disk(dir.path());
    assert!(
        crashed == before,
        "the state on disk must be one that was durable: claims {:?}, allocations {:?}",
        crashed.claims.keys().collect::<Vec<_>>(),
        crashed.allocs.keys().collect::<Vec<_>>()
    );
    for (volume, alloc) in crashed.claims.keys() {
        assert!(
            crashed.allocs.contains_key(alloc),
            "claim on {volume} held by {alloc}, which has no record"
        );
    }
}

/// On a disk with no room for a snapshot but room for a line, a change
/// that finds the journal due for compaction is appended instead, and
/// the compaction happens once there is room.
#[test]
fn a_full_disk_defers_the_compaction_and_still_appends() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _unmount = SmallFs::mount(dir.path(), c"size=4m");
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("open");
    // One line past the compaction threshold.
    put(&s, "big", (JOURNAL_MIN_COMPACT + 64 * 1024) as usize);
    assert_eq!(s.write_stats().snapshots, 0);
    // Leave less room than a snapshot needs (about 1.1 MiB), more than a
    // line does.
    let filler = dir.path().join("filler");
    let free = {
        // SAFETY: statvfs(2) into a zeroed struct we own.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        st.f_bavail * st.f_frsize
    };
    std::fs::write(&filler, vec![0u8; (free - 256 * 1024) as usize]).expect("filler");
    put(&s, "small", 10);
    assert_eq!(s.write_stats().snapshots, 0, "no room for a snapshot");
    assert!(
        on_disk(dir.path()) == s.snapshot(),
        "the change was appended"
    );
    // With room again, the next change compacts.
    std::fs::remove_file(&filler).expect("rm filler");
    put(&s, "small2", 10);
    assert_eq!(s.write_stats().snapshots, 1);
    assert!(on_disk(dir.path()) == s.snapshot());
    drop(s);
    let s = StateStore::open_with_boot_id(dir.path(), "b").expect("reopen");
    assert_eq!(s.read(|st| st.volumes.len()), 3);
}

#[test]
fn per_call_phases_of_earlier_releases_read_as_the_phase_they_imply() {
    let record = |phase: &str| {
        serde_json::json!({
            "alias": "data", "volume_id": "v", "plugin_id": "p", "external_volume_id": "x",
            "usage": {"access_mode": "single-node-writer", "attachment": "file-system",
                      "read_only": false},
            "target_path": "/m/t", "phase": phase
        })
    };
    for (old, new) in [
        ("claiming", Phase::Claiming),
        ("controller-publishing", Phase::Mounting),
        ("staging", Phase::Mounting),
        ("publishing", Phase::Mounting),
        ("published", Phase::Published),
        ("unpublishing", Phase::Releasing),
        ("unstaging", Phase::Releasing),
        ("controller-unpublishing", Phase::Releasing),
        ("releasing-claim", Phase::Releasing),
    ] {
        let v: AllocVolume = serde_json::from_value(record(old)).expect(old);
        assert_eq!(v.phase, new, "{old}");
        // Written back under its new name.
        assert_eq!(
            serde_json::to_value(&v).expect("encode")["phase"],
            new.name(),
            "{old}"
        );
    }
    let e = serde_json::from_value::<AllocVolume>(record("bogus")).expect_err("unknown phase");
    assert!(e.to_string().contains("bogus"), "{e}");
}
