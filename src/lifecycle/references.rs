//! Reference counts: how many mounts of an allocation its front end has
//! answered and not yet unmounted. The Docker volume plugin protocol asks a
//! plugin to count: Docker sends Mount and Unmount with a running
//! container's own mount ID around `docker cp` and archive reads, and the
//! container's own Unmount comes only when it stops. The count is part of
//! the allocation's record, so a restart keeps it.
//!
//! The rules (pure, over the state; each change is one durable write):
//! - adding a reference needs an allocation that is mounted (every volume
//!   `published`) and not being released; it is durable before the mount
//!   is answered;
//! - dropping one leaves the allocation mounted while more than one is
//!   counted, and is durable before the unmount is answered; the last one
//!   is not written here: the caller releases the allocation, which drops
//!   every reference with its record.
//!
//! - after a reboot every reference died with the processes that held
//!   it: the front end sets its allocations' counts to 0 (their mounts
//!   are restored all the same), so the first Mount after the boot counts
//!   1 and its Unmount releases;
//! - a Mount answered holds a reference: one that mounted (or finished
//!   mounting) an allocation counted 0 sets it to 1 before its answer.
//!   Else a second Mount would count 1 and its Unmount release what the
//!   first still uses.
//!
//! A crash between a change and its answer errs toward keeping the mount:
//! an engine that retries a Mount adds one more reference, one that
//! retries an Unmount finds one fewer.

use super::core::Core;
use crate::state::{Phase, StateError, StateFile};

/// Adds a reference to a mounted allocation; the new count. None: not
/// recorded, not mounted yet, or being released (nothing written).
pub fn add(core: &Core, alloc_id: &str) -> Result<Option<u32>, StateError> {
    core.store.update(|s| Ok(add_to(s, alloc_id)))
}

/// Drops a reference from an allocation counted more than once; the count
/// left. None: this is its last reference (or it is not recorded, or
/// being released already): nothing written, release it.
pub fn drop_one(core: &Core, alloc_id: &str) -> Result<Option<u32>, StateError> {
    core.store.update(|s| Ok(drop_from(s, alloc_id)))
}

/// Makes the allocation count at least one reference (a Mount that
/// mounted it is answered); nothing written when it does already.
pub fn hold(core: &Core, alloc_id: &str) -> Result<(), StateError> {
    core.store.update(|s| {
        hold_in(s, alloc_id);
        Ok(())
    })
}

/// Sets the count of every allocation whose ID starts with `prefix` to 0
/// (after a reboot: nothing holds a reference any more); how many changed.
pub fn clear(core: &Core, prefix: &str) -> Result<usize, StateError> {
    core.store.update(|s| Ok(clear_in(s, prefix)))
}

/// The allocation's count, as recorded; None when not recorded.
pub fn count(core: &Core, alloc_id: &str) -> Option<u32> {
    core.store
        .read(|s| s.allocs.get(alloc_id).map(|a| a.references))
}

fn add_to(s: &mut StateFile, alloc_id: &str) -> Option<u32> {
    let a = s.allocs.get(alloc_id)?;
    let mounted = !a.releasing
        && !a.volumes.is_empty()
        && a.volumes.values().all(|v| v.phase == Phase::Published);
    if !mounted {
        return None;
    }
    let a = s.alloc_mut(alloc_id)?;
    a.references = a.references.saturating_add(1);
    Some(a.references)
}

fn hold_in(s: &mut StateFile, alloc_id: &str) -> bool {
    let unheld = s
        .allocs
        .get(alloc_id)
        .is_some_and(|a| !a.releasing && a.references == 0);
    if unheld {
        if let Some(a) = s.alloc_mut(alloc_id) {
            a.references = 1;
        }
    }
    unheld
}

fn clear_in(s: &mut StateFile, prefix: &str) -> usize {
    let counted: Vec<String> = s
        .allocs
        .values()
        .filter(|a| a.id.starts_with(prefix) && a.references != 0)
        .map(|a| a.id.clone())
        .collect();
    for id in &counted {
        if let Some(a) = s.alloc_mut(id) {
            a.references = 0;
        }
    }
    counted.len()
}

fn drop_from(s: &mut StateFile, alloc_id: &str) -> Option<u32> {
    let a = s.allocs.get(alloc_id)?;
    if a.releasing || a.references <= 1 {
        return None;
    }
    let a = s.alloc_mut(alloc_id)?;
    a.references -= 1;
    Some(a.references)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::state::{AllocRecord, AllocVolume};

    fn record(phase: Phase) -> AllocVolume {
        serde_json::from_value(serde_json::json!({
            "alias": "volume", "volume_id": "db", "plugin_id": "p",
            "external_volume_id": "ext-db",
            "usage": {"read_only": false, "attachment": "file-system",
                      "access_mode": "single-node-writer"},
            "target_path": "/m/t", "phase": phase,
        }))
        .expect("a record")
    }

    fn state(phase: Phase, releasing: bool) -> StateFile {
        let mut s = StateFile::new("boot");
        s.allocs.insert(
            "docker-a-db".to_string(),
            Arc::new(AllocRecord {
                id: "docker-a-db".to_string(),
                releasing,
                references: 1,
                volumes: [("volume".to_string(), Arc::new(record(phase)))].into(),
            }),
        );
        s
    }

    fn the(s: &StateFile) -> &AllocRecord {
        s.allocs.get("docker-a-db").expect("recorded")
    }

    fn count(s: &StateFile) -> u32 {
        the(s).references
    }

    #[test]
    fn a_mounted_allocation_counts_up_and_down_and_its_last_reference_is_the_callers() {
        let mut s = state(Phase::Published, false);
        assert_eq!(add_to(&mut s, "docker-a-db"), Some(2));
        assert_eq!(add_to(&mut s, "docker-a-db"), Some(3));
        assert_eq!(drop_from(&mut s, "docker-a-db"), Some(2));
        assert_eq!(drop_from(&mut s, "docker-a-db"), Some(1));
        // The last one: nothing written, the caller releases.
        assert_eq!(drop_from(&mut s, "docker-a-db"), None);
        assert_eq!(count(&s), 1);
        assert_eq!(drop_from(&mut s, "nosuch"), None);
    }

    #[test]
    fn only_a_mounted_allocation_not_being_released_gains_a_reference() {
        for phase in [Phase::Claiming, Phase::Mounting, Phase::Releasing] {
            let mut s = state(phase, false);
            assert_eq!(add_to(&mut s, "docker-a-db"), None, "{phase}");
            assert_eq!(count(&s), 1);
        }
        let mut s = state(Phase::Published, true);
        assert_eq!(add_to(&mut s, "docker-a-db"), None, "releasing");
        assert_eq!(add_to(&mut s, "nosuch"), None);
        // One being released drops no reference either: its release goes on.
        s.alloc_mut("docker-a-db").expect("recorded").references = 3;
        assert_eq!(drop_from(&mut s, "docker-a-db"), None);
    }

    #[test]
    fn after_a_reboot_the_counts_start_from_nothing() {
        let mut s = state(Phase::Published, false);
        s.alloc_mut("docker-a-db").expect("recorded").references = 3;
        let mut web = the(&s).clone();
        web.id = "web-1".to_string();
        s.allocs.insert("web-1".to_string(), Arc::new(web));
        assert_eq!(clear_in(&mut s, "docker-"), 1);
        assert_eq!(count(&s), 0);
        assert_eq!(s.allocs.get("web-1").map(|a| a.references), Some(3));
        assert_eq!(clear_in(&mut s, "docker-"), 0, "nothing left to change");
        // The first Mount after the boot counts one; its Unmount is the
        // last.
        assert_eq!(add_to(&mut s, "docker-a-db"), Some(1));
        assert_eq!(drop_from(&mut s, "docker-a-db"), None);
        // An Unmount with no Mount since the boot is the last one too.
        s.alloc_mut("docker-a-db").expect("recorded").references = 0;
        assert_eq!(drop_from(&mut s, "docker-a-db"), None);
        // A Mount that mounts it (its restore unfinished) holds one: a
        // second Mount's Unmount then leaves it mounted.
        assert!(hold_in(&mut s, "docker-a-db"));
        assert_eq!(count(&s), 1);
        assert_eq!(add_to(&mut s, "docker-a-db"), Some(2));
        assert_eq!(drop_from(&mut s, "docker-a-db"), Some(1));
        assert!(!hold_in(&mut s, "docker-a-db"), "held already: unchanged");
        assert_eq!(count(&s), 1);
        assert!(!hold_in(&mut s, "nosuch"));
        s.alloc_mut("docker-a-db").expect("recorded").references = 0;
        s.alloc_mut("docker-a-db").expect("recorded").releasing = true;
        assert!(!hold_in(&mut s, "docker-a-db"), "being released");
    }

    #[test]
    fn the_count_is_written_only_above_one_and_read_as_one_when_absent() {
        let mut s = state(Phase::Published, false);
        let one = serde_json::to_value(the(&s)).expect("JSON");
        assert!(one.get("references").is_none(), "{one}");
        let back: AllocRecord = serde_json::from_value(one).expect("reads back");
        assert_eq!(back.references, 1);
        add_to(&mut s, "docker-a-db");
        let two = serde_json::to_value(the(&s)).expect("JSON");
        assert_eq!(two["references"], 2);
        let back: AllocRecord = serde_json::from_value(two).expect("reads back");
        assert_eq!(back.references, 2);
    }
}
