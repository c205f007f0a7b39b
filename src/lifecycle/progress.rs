//! In-memory progress that is not worth a durable write: which allocations
//! have a mount running, which release workers run, the latest release
//! report of every volume, and what a running mount waits on.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How many completed release reports are kept for `alloc status`.
const MAX_RELEASE_REPORTS: usize = 1024;

/// Where one volume of a release stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseState {
    InProgress,
    /// Failing and retrying; `error` is the last failure.
    Retrying {
        error: String,
        attempts: u32,
    },
    Released,
    /// Gave up at the release deadline (or the agent stopped); the record
    /// and the claim are kept and a restart resumes.
    Stopped {
        error: String,
    },
}

impl ReleaseState {
    pub fn is_final(&self) -> bool {
        matches!(self, ReleaseState::Released | ReleaseState::Stopped { .. })
    }
}

/// What a release report keeps of the volume it released: its record is
/// gone once the release is done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReleasedVolume {
    pub volume_id: String,
    pub plugin_id: String,
    pub target_path: std::path::PathBuf,
    pub read_only: bool,
    pub attachment: crate::volumes::AttachmentMode,
}

/// The calls up sent (answered or not) since an intent recorded in this run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SentUp {
    pub controller_publish: bool,
    pub node_stage: bool,
    pub node_publish: bool,
}

/// (allocation, alias)
type Key = (String, String);

/// The keys of one allocation's volumes: from (alloc, "") up to, not
/// including, the next allocation ID (`alloc` followed by a NUL, the
/// smallest string after every (alloc, alias)).
fn alloc_range(alloc: &str) -> std::ops::Range<Key> {
    (alloc.to_string(), String::new())..(format!("{alloc}\0"), String::new())
}

fn key(alloc: &str, alias: &str) -> Key {
    (alloc.to_string(), alias.to_string())
}

#[derive(Default)]
struct Inner {
    /// (alloc, alias) -> release state of the latest release.
    releases: BTreeMap<Key, ReleaseState>,
    /// Release workers running.
    active: HashSet<Key>,
    /// Allocations with a mount or restore running.
    mounting: HashSet<String>,
    /// (alloc, alias) -> what a mount is waiting on.
    messages: HashMap<Key, String>,
    /// Releases that completed, oldest first: their reports are kept for
    /// `alloc status` until MAX_RELEASE_REPORTS newer ones push them out.
    finished: VecDeque<Key>,
    /// (alloc, alias) -> the volume of a release report, so a report
    /// outliving its record still names what it released.
    released_volumes: BTreeMap<Key, ReleasedVolume>,
    /// (alloc, alias) -> the call a running mount or release is at (the
    /// live step `alloc status` shows; the durable phase is coarser).
    steps: HashMap<Key, String>,
    /// (alloc, alias) -> the calls up sent for an intent recorded in this
    /// run (so a rollback undoes only what was sent; after a restart the
    /// history is unknown and the whole way down is redone).
    sent: HashMap<Key, SentUp>,
    /// (volume, external node ID) -> the publish context of a
    /// ControllerPublish that answered in this run and has not been undone:
    /// other users of the volume share it instead of calling again.
    attachments: HashMap<(String, String), BTreeMap<String, String>>,
    /// Staging paths whose NodeStage answered in this run and that have not
    /// been unstaged since.
    stagings: HashSet<std::path::PathBuf>,
    /// Staging paths a NodeStage may have reached on this node (sent in
    /// this run by any record, or held by a record found at restore) with no
    /// NodeUnstage answered since: whichever record is the last holder of
    /// one tears it down, whoever sent the call.
    stages_live: HashSet<std::path::PathBuf>,
    /// The same for (volume, external node ID) and ControllerPublish.
    attachments_live: HashSet<(String, String)>,
    /// Records whose way down passed its NodeUnstage step (unstaged, or
    /// left the staging to other users) in this run: they no longer count
    /// as users of the staging path, though their flag stays until the
    /// record is dropped (a crash redoes the step, and recounts).
    past_staging: BTreeSet<Key>,
    /// The same for the ControllerUnpublish step and the attachment.
    past_attachment: BTreeSet<Key>,
    /// Records whose claim this run marked node-detached (the node side
    /// done, the controller detach failing and retried), until dropped.
    node_detached: BTreeSet<Key>,
    /// (alloc, alias) -> when a call of that volume timed out (it may still
    /// be carried out by the plugin).
    uncertain: HashMap<Key, Instant>,
    /// While a restore waits for its mounts: told of each allocation whose
    /// mount waits for the cluster (a claim held elsewhere, etcd not
    /// answering), so the restore stops waiting for it.
    restore_parks: Option<crossbeam_channel::Sender<String>>,
}

/// Why a mount cannot start now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotNow {
    Mounting,
    Releasing,
}

#[derive(Default)]
pub struct Progress {
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl Progress {
    /// Wakes every waiter (on shutdown).
    pub fn wake_all(&self) {
        let _g = self.inner.lock();
        self.changed.notify_all();
    }

    /// Marks a mount of `alloc_id` as running.
    pub fn begin_mount(&self, alloc_id: &str) -> Result<(), NotNow> {
        let mut p = self.inner.lock();
        if p.mounting.contains(alloc_id) {
            return Err(NotNow::Mounting);
        }
        if p.active.iter().any(|(a, _)| a == alloc_id) {
            return Err(NotNow::Releasing);
        }
        p.mounting.insert(alloc_id.to_string());
        Ok(())
    }

    pub fn end_mount(&self, alloc_id: &str) {
        let mut p = self.inner.lock();
        p.mounting.remove(alloc_id);
        self.changed.notify_all();
    }

    /// Where `waits_for_cluster` reports go while a restore waits (None:
    /// nowhere).
    pub fn report_cluster_waits(&self, to: Option<crossbeam_channel::Sender<String>>) {
        self.inner.lock().restore_parks = to;
    }

    /// The mount of `alloc_id` waits for the cluster (it retries on its
    /// own): a restore waiting for it goes on without it.
    pub fn waits_for_cluster(&self, alloc_id: &str) {
        if let Some(tx) = &self.inner.lock().restore_parks {
            let _ = tx.send(alloc_id.to_string());
        }
    }

    /// Forgets the release reports of an earlier allocation of this ID.
    pub fn forget_releases(&self, alloc_id: &str) {
        let mut p = self.inner.lock();
        // Keyed by (allocation, alias): the allocation's reports are one
        // range, not a scan of every report kept.
        let mine: Vec<Key> = p
            .releases
            .range(alloc_range(alloc_id))
            .map(|(k, _)| k.clone())
            .collect();
        for k in mine {
            p.releases.remove(&k);
        }
        let mine: Vec<Key> = p
            .released_volumes
            .range(alloc_range(alloc_id))
            .map(|(k, _)| k.clone())
            .collect();
        for k in mine {
            p.released_volumes.remove(&k);
        }
    }

    pub fn set_message(&self, alloc_id: &str, alias: &str, msg: Option<String>) {
        let mut p = self.inner.lock();
        match msg {
            Some(m) => p.messages.insert(key(alloc_id, alias), m),
            None => p.messages.remove(&key(alloc_id, alias)),
        };
    }

    pub fn set_step(&self, alloc_id: &str, alias: &str, step: Option<String>) {
        let mut p = self.inner.lock();
        match step {
            Some(s) => p.steps.insert(key(alloc_id, alias), s),
            None => p.steps.remove(&key(alloc_id, alias)),
        };
    }

    /// The call a running mount or release of the volume is at.
    pub fn step(&self, alloc_id: &str, alias: &str) -> Option<String> {
        self.inner.lock().steps.get(&key(alloc_id, alias)).cloned()
    }

    /// An intent was recorded in this run: from now on every call up of
    /// the volume is tracked.
    /// (A mark of an earlier record of the same key no longer applies.)
    pub fn intent_recorded(&self, alloc_id: &str, alias: &str) {
        let mut p = self.inner.lock();
        let k = key(alloc_id, alias);
        p.node_detached.remove(&k);
        p.sent.insert(k, SentUp::default());
    }

    /// A call up is about to be sent (when its intent is from this run).
    pub fn sending(&self, alloc_id: &str, alias: &str, f: impl FnOnce(&mut SentUp)) {
        if let Some(s) = self.inner.lock().sent.get_mut(&key(alloc_id, alias)) {
            f(s);
        }
    }

    /// The calls up sent for an intent of this run; None when unknown.
    pub fn sent_up(&self, alloc_id: &str, alias: &str) -> Option<SentUp> {
        self.inner.lock().sent.get(&key(alloc_id, alias)).copied()
    }

    /// Forgets the history of a volume (published, or released).
    pub fn forget_sent(&self, alloc_id: &str, alias: &str) {
        self.inner.lock().sent.remove(&key(alloc_id, alias));
    }

    /// A ControllerPublish answered (Some) or an unpublish is about to be
    /// sent (None). Changed under the volume's operation lock only.
    pub fn set_attachment(
        &self,
        volume_id: &str,
        node_id: &str,
        ctx: Option<BTreeMap<String, String>>,
    ) {
        let mut p = self.inner.lock();
        let k = (volume_id.to_string(), node_id.to_string());
        match ctx {
            Some(c) => p.attachments.insert(k, c),
            None => p.attachments.remove(&k),
        };
    }

    pub fn attachment(&self, volume_id: &str, node_id: &str) -> Option<BTreeMap<String, String>> {
        self.inner
            .lock()
            .attachments
            .get(&(volume_id.to_string(), node_id.to_string()))
            .cloned()
    }

    /// A NodeStage answered (true) or an unstage is about to be sent.
    pub fn set_staged(&self, path: &std::path::Path, staged: bool) {
        let mut p = self.inner.lock();
        if staged {
            p.stagings.insert(path.to_path_buf());
        } else {
            p.stagings.remove(path);
        }
    }

    pub fn is_staged(&self, path: &std::path::Path) -> bool {
        self.inner.lock().stagings.contains(path)
    }

    /// A NodeStage of `path` is about to be sent (or a record that may have
    /// sent one was found at restore): the last holder must unstage it.
    pub fn stage_may_be_live(&self, path: &std::path::Path) {
        self.inner.lock().stages_live.insert(path.to_path_buf());
    }

    /// A NodeUnstage of `path` answered (done, or nothing there).
    pub fn stage_torn_down(&self, path: &std::path::Path) {
        self.inner.lock().stages_live.remove(path);
    }

    /// Whether a NodeStage may have reached `path` and was not undone.
    pub fn stage_live(&self, path: &std::path::Path) -> bool {
        self.inner.lock().stages_live.contains(path)
    }

    /// A ControllerPublish of the volume to the node is about to be sent
    /// (or may have been, by a record found at restore).
    pub fn attachment_may_be_live(&self, volume_id: &str, node_id: &str) {
        self.inner
            .lock()
            .attachments_live
            .insert((volume_id.to_string(), node_id.to_string()));
    }

    /// A ControllerUnpublish of the volume from the node answered.
    pub fn attachment_torn_down(&self, volume_id: &str, node_id: &str) {
        self.inner
            .lock()
            .attachments_live
            .remove(&(volume_id.to_string(), node_id.to_string()));
    }

    /// Whether a ControllerPublish of the volume to the node may have
    /// happened and was not undone.
    pub fn attachment_live(&self, volume_id: &str, node_id: &str) -> bool {
        self.inner
            .lock()
            .attachments_live
            .contains(&(volume_id.to_string(), node_id.to_string()))
    }

    /// The volume's way down passed its NodeUnstage step.
    pub fn passed_staging(&self, alloc_id: &str, alias: &str) {
        self.inner.lock().past_staging.insert(key(alloc_id, alias));
    }

    /// The volume's way down passed its ControllerUnpublish step.
    pub fn passed_attachment(&self, alloc_id: &str, alias: &str) {
        self.inner
            .lock()
            .past_attachment
            .insert(key(alloc_id, alias));
    }

    /// The record's claim was marked node-detached in the cluster store.
    pub fn marked_node_detached(&self, alloc_id: &str, alias: &str) {
        self.inner.lock().node_detached.insert(key(alloc_id, alias));
    }

    /// Records whose claim this run marked node-detached.
    pub fn node_detached(&self) -> BTreeSet<Key> {
        self.inner.lock().node_detached.clone()
    }

    /// Records past their NodeUnstage step, and past their
    /// ControllerUnpublish step.
    pub fn past_teardown(&self) -> (BTreeSet<Key>, BTreeSet<Key>) {
        let p = self.inner.lock();
        (p.past_staging.clone(), p.past_attachment.clone())
    }

    /// The record is gone: forget what its way down passed.
    pub fn forget_teardown(&self, alloc_id: &str, alias: &str) {
        let mut p = self.inner.lock();
        let k = key(alloc_id, alias);
        p.past_staging.remove(&k);
        p.past_attachment.remove(&k);
        p.node_detached.remove(&k);
    }

    pub fn message(&self, alloc_id: &str, alias: &str) -> String {
        self.inner
            .lock()
            .messages
            .get(&key(alloc_id, alias))
            .cloned()
            .unwrap_or_default()
    }

    /// Marks a release worker as running; false when one runs already.
    pub fn begin_release(&self, alloc_id: &str, alias: &str, volume: ReleasedVolume) -> bool {
        let mut p = self.inner.lock();
        let k = key(alloc_id, alias);
        if !p.active.insert(k.clone()) {
            return false;
        }
        p.releases.insert(k.clone(), ReleaseState::InProgress);
        p.released_volumes.insert(k, volume);
        true
    }

    /// The volume of the latest release report of (alloc, alias).
    pub fn released_volume(&self, alloc_id: &str, alias: &str) -> Option<ReleasedVolume> {
        self.inner
            .lock()
            .released_volumes
            .get(&key(alloc_id, alias))
            .cloned()
    }

    /// A call of the volume timed out at `at`: the plugin may still carry
    /// it out.
    pub fn mark_uncertain(&self, alloc_id: &str, alias: &str, at: Instant) {
        self.inner.lock().uncertain.insert(key(alloc_id, alias), at);
    }

    /// When the latest uncertain call of the volume timed out, if any.
    pub fn uncertain_since(&self, alloc_id: &str, alias: &str) -> Option<Instant> {
        self.inner
            .lock()
            .uncertain
            .get(&key(alloc_id, alias))
            .copied()
    }

    pub fn clear_uncertain(&self, alloc_id: &str, alias: &str) {
        self.inner.lock().uncertain.remove(&key(alloc_id, alias));
    }

    pub fn set_release(&self, alloc_id: &str, alias: &str, st: ReleaseState) {
        let mut p = self.inner.lock();
        p.releases.insert(key(alloc_id, alias), st);
        self.changed.notify_all();
    }

    /// A release worker ended with `outcome`.
    pub fn end_release(&self, alloc_id: &str, alias: &str, outcome: ReleaseState) {
        let mut p = self.inner.lock();
        let k = key(alloc_id, alias);
        p.active.remove(&k);
        if outcome == ReleaseState::Released {
            p.finished.push_back(k.clone());
            while p.finished.len() > MAX_RELEASE_REPORTS {
                if let Some(old) = p.finished.pop_front() {
                    if !p.active.contains(&old)
                        && p.releases.get(&old) == Some(&ReleaseState::Released)
                    {
                        p.releases.remove(&old);
                        p.released_volumes.remove(&old);
                    }
                }
            }
        }
        p.releases.insert(k, outcome);
        self.changed.notify_all();
    }

    /// Waits until no release worker of the allocation runs, up to
    /// `timeout` or until `stop()` says so. True when none runs.
    pub fn wait_released(
        &self,
        alloc_id: &str,
        timeout: Duration,
        stop: impl Fn() -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        let mut p = self.inner.lock();
        loop {
            if !p.active.iter().any(|(a, _)| a == alloc_id) {
                return true;
            }
            if stop() {
                return false;
            }
            if self.changed.wait_until(&mut p, deadline).timed_out() {
                return !p.active.iter().any(|(a, _)| a == alloc_id);
            }
        }
    }

    /// Every release report kept: (allocation, alias, state).
    pub fn all_releases(&self) -> Vec<(String, String, ReleaseState)> {
        let mut v: Vec<_> = self
            .inner
            .lock()
            .releases
            .iter()
            .map(|((a, al), st)| (a.clone(), al.clone(), st.clone()))
            .collect();
        v.sort_by(|x, y| (&x.0, &x.1).cmp(&(&y.0, &y.1)));
        v
    }

    /// Release state of each volume of the allocation's latest release.
    pub fn releases(&self, alloc_id: &str) -> BTreeMap<String, ReleaseState> {
        self.inner
            .lock()
            .releases
            .range(alloc_range(alloc_id))
            .map(|((_, alias), st)| (alias.clone(), st.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_mount_at_a_time_and_none_while_releasing() {
        let p = Progress::default();
        p.begin_mount("a").expect("first");
        assert_eq!(p.begin_mount("a"), Err(NotNow::Mounting));
        p.end_mount("a");
        let vol = ReleasedVolume {
            volume_id: "v".into(),
            plugin_id: "p".into(),
            ..Default::default()
        };
        assert!(p.begin_release("a", "d", vol.clone()));
        assert!(
            !p.begin_release("a", "d", vol.clone()),
            "one worker per volume"
        );
        assert_eq!(p.begin_mount("a"), Err(NotNow::Releasing));
        assert!(!p.wait_released("a", Duration::from_millis(10), || false));
        p.end_release("a", "d", ReleaseState::Released);
        assert!(p.wait_released("a", Duration::from_millis(10), || false));
        assert_eq!(p.releases("a")["d"], ReleaseState::Released);
        assert_eq!(p.released_volume("a", "d"), Some(vol));
        p.forget_releases("a");
        assert!(p.releases("a").is_empty());
    }

    #[test]
    fn old_release_reports_are_dropped() {
        let p = Progress::default();
        for i in 0..MAX_RELEASE_REPORTS + 5 {
            let a = format!("a{i}");
            assert!(p.begin_release(&a, "d", ReleasedVolume::default()));
            p.end_release(&a, "d", ReleaseState::Released);
        }
        assert!(p.releases("a0").is_empty());
        assert_eq!(p.releases(&format!("a{MAX_RELEASE_REPORTS}")).len(), 1);
    }
}
