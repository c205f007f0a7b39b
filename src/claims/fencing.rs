//! Fencing: every safety decision of cluster mode that depends on time or
//! on what this process has seen, in one place. A reader finds here
//!
//! - the **lease-validity clock**: the send time (CLOCK_BOOTTIME) of the
//!   last keep-alive etcd answered, fed by the liveness thread; the lease
//!   is valid by this node's own clock while
//!   `now < sent + lease_ttl·(1−ρ) − LEASE_MARGIN`;
//! - the **persisted deadline**: `lease-clock.json` in the state directory
//!   keeps the boot ID, the lease ID and that send time, written atomically
//!   at most every `lease_ttl`/3, so that a restarted agent knows how long
//!   the cluster cannot have freed its claims: until `sent +
//!   stop_after_disconnect`. A different boot ID, an unreadable or missing
//!   file count as expired;
//! - **claims confirmed in this process**: a claim may be used for a call up
//!   (ControllerPublish, NodeStage, NodePublish) only under the lease it was
//!   confirmed with (taken by a `Txn`, or read back from etcd after that
//!   lease was registered), and only while that lease is valid. A mount
//!   resumed after a pause, or a node back with a new lease, reads its
//!   claim again before it calls up;
//! - the **window this node goes by** (`Fencing::window`): its
//!   `stop_after_disconnect` once this run registered, before that no more
//!   than the settings it last published allow (`claims::published`);
//! - the **free rule** of the reaper and the operator (`FreeRule`).
//!
//! The margin arithmetic (W, U, τ, the inequality) is `claims::margins`.
//! The lifecycle asks `ClaimStore::check_call_up` before every call up; the
//! etcd store answers from here. The cluster's reaper computes
//! its wait from `margins::observer_wait` and frees only by the rules in
//! `may_free_unfenced`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::margins::{bounded_window, ReleaseBounds, DRIFT};
use super::published::{Published, PublishedError};
use crate::clock::boottime;
use crate::etcd::{LeaseId, RenewalClock};

/// Subtracted from the lease's life before a call up: the call is sent
/// with this much of the lease left at least.
pub const LEASE_MARGIN: Duration = Duration::from_millis(200);
/// The file of the persisted lease clock, in the state directory.
pub const LEASE_CLOCK_FILE: &str = "lease-clock.json";
/// The file of this node's instance ID, in the state directory.
pub const INSTANCE_FILE: &str = "instance-id";

/// This node's instance ID: a node is an instance, not a name. Made once
/// per state directory (128 random bits, hex), so a replaced or restored
/// machine that reuses the name, with another state directory, is another
/// instance: it cannot register while the original's lease is alive, and
/// it never frees the original's claims. A file that is not an ID stops
/// the agent, naming it (never overwritten).
pub fn instance_id(state_dir: &Path) -> Result<String, IdentityError> {
    let path = state_dir.join(INSTANCE_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(id.to_string())
            } else {
                Err(IdentityError::NotAnInstanceId { path })
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut bytes = [0u8; 16];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
                .map_err(IdentityError::Random)?;
            let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            crate::state::write_file_atomically(&path, format!("{id}\n").as_bytes()).map_err(
                |source| IdentityError::Write {
                    path: path.clone(),
                    source,
                },
            )?;
            Ok(id)
        }
        Err(source) => Err(IdentityError::Read { path, source }),
    }
}

/// Why this node's identity cannot be read or made: its instance ID, or
/// what it last published of its self-release. The agent does not start.
#[derive(Debug)]
pub enum IdentityError {
    /// The instance file holds something that is not an ID; it is never
    /// overwritten.
    NotAnInstanceId {
        path: PathBuf,
    },
    /// No random bytes for a new instance ID.
    Random(std::io::Error),
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    Published(PublishedError),
}

impl fmt::Display for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdentityError::NotAnInstanceId { path } => write!(
                f,
                "{} is not an instance ID (32 hex digits): fix or remove it by hand (removing it makes this node a new instance, which frees none of the old one's claims)",
                path.display()
            ),
            IdentityError::Random(_) => f.write_str("cannot read /dev/urandom"),
            IdentityError::Read { path, .. } => write!(f, "cannot read {}", path.display()),
            IdentityError::Write { path, .. } => write!(f, "cannot write {}", path.display()),
            IdentityError::Published(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for IdentityError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            IdentityError::NotAnInstanceId { .. } => None,
            IdentityError::Random(source)
            | IdentityError::Read { source, .. }
            | IdentityError::Write { source, .. } => Some(source),
            IdentityError::Published(e) => e.source(),
        }
    }
}

/// What `lease-clock.json` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseClockFile {
    pub boot_id: String,
    /// The lease, in etcd's hex form.
    pub lease_id: String,
    /// CLOCK_BOOTTIME (ms) at which the last answered keep-alive was sent.
    pub sent_boottime_ms: u64,
}

/// Whether the cluster may free a claim of a node gone for good without a
/// fence: only when the cluster's config opts in (`free_unfenced_claims`,
/// the user's risk: nothing on a paused or crashed node acts).
pub fn may_free_unfenced(opted_in: bool) -> bool {
    opted_in
}

/// Whether ControllerUnpublish of `plugin_id` counts as a fence: only for
/// plugins the operator marked as fencing.
pub fn unpublish_fences(fencing_plugins: &[String], plugin_id: &str) -> bool {
    fencing_plugins.iter().any(|p| p == plugin_id)
}

/// Who frees the claims of a node that is gone, and so by which rule.
#[derive(Clone, Copy, Debug)]
pub enum FreeRule<'a> {
    /// An operator said so (`volume detach --node`): detach when the node
    /// held an attachment, then free.
    Operator,
    /// The cluster's reaper: free only a volume that was fenced from the
    /// node (ControllerUnpublish OK of a plugin in `fencing_plugins`), or
    /// any when the cluster opted in to freeing unfenced claims.
    Cluster {
        fencing_plugins: &'a [String],
        free_unfenced: bool,
        /// How long a ControllerPublish to the node sent before the fence
        /// may still be running (the CSI call deadline): the fence counts
        /// only once that long after a first ControllerUnpublish OK a second
        /// one answered OK too, so a timed-out publish that lands late is
        /// undone before the claim is freed.
        publish_settle: Duration,
        /// The mod revision of the node's settings when the reaper first
        /// saw it gone (`claims::etcd::still_gone`): every write compares
        /// it, so a node that registered again since is left alone.
        registered_at: i64,
    },
}

/// What the rule lets the reaper do with one volume of a gone node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FreeDecision {
    /// Detach through the controller (a fence, or the operator's or the
    /// opt-in's word), then free.
    DetachThenFree,
    /// Nothing to detach; free.
    Free,
    /// Keep the claims: nothing can fence the volume from that node.
    Keep { why: String },
}

impl FreeRule<'_> {
    /// See `FreeRule::Cluster::publish_settle`; none for an operator.
    pub fn publish_settle(&self) -> Option<Duration> {
        match self {
            FreeRule::Operator => None,
            FreeRule::Cluster { publish_settle, .. } => Some(*publish_settle),
        }
    }

    /// `attached_plugin`: the plugin of the node's controller attachment
    /// of the volume, if it has one.
    pub fn decide(&self, attached_plugin: Option<&str>) -> FreeDecision {
        match (self, attached_plugin) {
            (FreeRule::Operator, Some(_)) => FreeDecision::DetachThenFree,
            (FreeRule::Operator, None) => FreeDecision::Free,
            (
                FreeRule::Cluster {
                    fencing_plugins,
                    free_unfenced,
                    ..
                },
                Some(p),
            ) => {
                if unpublish_fences(fencing_plugins, p) || may_free_unfenced(*free_unfenced) {
                    FreeDecision::DetachThenFree
                } else {
                    FreeDecision::Keep {
                        why: format!(
                            "plugin {p} is not in cluster.fencing_plugins: its ControllerUnpublish is not known to cut the node off"
                        ),
                    }
                }
            }
            (FreeRule::Cluster { free_unfenced, .. }, None) => {
                if may_free_unfenced(*free_unfenced) {
                    FreeDecision::Free
                } else {
                    FreeDecision::Keep {
                        why: "the volume has no controller attachment, so nothing can fence it from that node".to_string(),
                    }
                }
            }
        }
    }
}

/// The fencing state of one agent.
pub struct Fencing {
    /// This node's instance ID (`instance_id`).
    instance: String,
    ttl: Duration,
    /// The settings this agent publishes (its window among them).
    bounds: ReleaseBounds,
    /// What etcd may hold of this node's settings, until this run's first
    /// registration (`window`).
    published: Mutex<Published>,
    /// This run registered: etcd holds `bounds`.
    published_now: std::sync::atomic::AtomicBool,
    boot_id: String,
    path: PathBuf,
    /// The previous run's last answered send time (this boot only).
    persisted: Option<Duration>,
    live: Mutex<Option<(LeaseId, RenewalClock)>>,
    /// The mod revision of this node's liveness key as this agent last
    /// wrote it (a registration, or a move that fences off a take that did
    /// not answer: `EtcdClaims::settle_uncertain_take`), while the lease
    /// is held:
    /// every take compares it, so a take still in flight when this node
    /// moves it (or when the key ends with its lease) can never land.
    liveness_revision: Mutex<Option<i64>>,
    /// See `ask_reregistration`.
    reregister: std::sync::atomic::AtomicBool,
    /// (volume, alloc) -> the lease it was confirmed under.
    confirmed: Mutex<HashMap<(String, String), LeaseId>>,
    /// The send time last written to the file.
    written: Mutex<Option<Duration>>,
    /// Counts the times etcd answered again after a gap (a registration,
    /// or a renewal after more than half a TTL without one); waiters on
    /// `back_cv` retry what waits for the claim store at once.
    back: Mutex<(u64, Option<Duration>)>,
    back_cv: Condvar,
}

impl Fencing {
    /// Reads the persisted clock of `state_dir` (a missing, unreadable or
    /// other-boot file counts as expired and is said in the log) and what
    /// this node last published (`claims::published`: a file that is not
    /// that is refused, naming it). `bounds`: the settings this agent
    /// publishes.
    pub fn open(
        state_dir: &Path,
        instance: &str,
        boot_id: &str,
        bounds: ReleaseBounds,
    ) -> Result<Fencing, IdentityError> {
        let ttl = bounds.lease_ttl();
        let published = Published::open(state_dir).map_err(IdentityError::Published)?;
        let path = state_dir.join(LEASE_CLOCK_FILE);
        let persisted = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<LeaseClockFile>(&bytes) {
                Ok(f) if f.boot_id == boot_id => Some(Duration::from_millis(f.sent_boottime_ms)),
                Ok(_) => {
                    log::info!(
                        "{}: written before the last reboot: the lease it records is expired",
                        path.display()
                    );
                    None
                }
                Err(e) => {
                    log::error!(
                        "{}: not a lease clock ({e}): counted as expired (calls up wait for etcd); it is replaced at the next renewal",
                        path.display()
                    );
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                log::error!(
                    "{}: cannot be read ({e}): counted as expired",
                    path.display()
                );
                None
            }
        };
        let fencing = Fencing {
            instance: instance.to_string(),
            ttl,
            bounds,
            published: Mutex::new(published),
            published_now: Default::default(),
            boot_id: boot_id.to_string(),
            path,
            persisted,
            live: Mutex::new(None),
            liveness_revision: Mutex::new(None),
            reregister: Default::default(),
            confirmed: Mutex::new(HashMap::new()),
            written: Mutex::new(None),
            back: Mutex::new((0, None)),
            back_cv: Condvar::new(),
        };
        let window = fencing.window();
        if window != bounds.window() {
            log::warn!(
                "cluster: this node last published other self-release settings ({}): until it registers in etcd again, it lets go of its volumes {} after its last renewal, not {} (the cluster acts by what it knows)",
                fencing.published.lock().sets().iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", "),
                window.map_or("never".to_string(), |w| format!("{w:?}")),
                bounds.window().map_or("never".to_string(), |w| format!("{w:?}")),
            );
        }
        Ok(fencing)
    }

    /// The settings this agent publishes.
    pub fn bounds(&self) -> &ReleaseBounds {
        &self.bounds
    }

    /// The window (D) this node goes by: its `stop_after_disconnect` once
    /// this run registered (etcd holds it then); before, no more than
    /// every set of settings etcd may still hold allows (`bounded_window`).
    pub fn window(&self) -> Option<Duration> {
        if self.published_now.load(std::sync::atomic::Ordering::SeqCst) {
            return self.bounds.window();
        }
        bounded_window(&self.bounds, self.published.lock().sets())
    }

    /// Before a registration writes this node's settings: the file of what
    /// etcd may hold names them first (an error stops the registration).
    pub fn publishing(&self) -> Result<(), PublishedError> {
        self.published.lock().publishing(&self.bounds)
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The liveness thread registered `lease` (its liveness key written at
    /// `revision`); `clock` reads its renewals.
    pub fn lease_registered(&self, lease: LeaseId, revision: i64, clock: RenewalClock) {
        let sent = clock.last_sent_boottime();
        // The registration wrote this node's settings with its liveness.
        self.published_now
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Err(e) = self.published.lock().published(&self.bounds) {
            // The file still names these among others: stricter, not wrong.
            log::warn!("cluster: {}", crate::error_chain(&e));
        }
        *self.liveness_revision.lock() = Some(revision);
        *self.live.lock() = Some((lease, clock));
        self.persist();
        let mut back = self.back.lock();
        *back = (back.0 + 1, Some(sent));
        self.back_cv.notify_all();
    }

    /// Waits up to `timeout`, less when etcd answers again after a gap;
    /// false when the agent stops.
    pub fn wait_back(&self, timeout: Duration, shutdown: &crate::shutdown::Shutdown) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut back = self.back.lock();
        let start = back.0;
        while back.0 == start {
            if shutdown.is_triggered() {
                return false;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return true;
            }
            // Bounded slices: the shutdown flag is re-checked.
            let slice = (deadline - now).min(Duration::from_millis(200));
            self.back_cv.wait_for(&mut back, slice);
        }
        !shutdown.is_triggered()
    }

    /// etcd said the lease is gone: nothing confirmed under it counts.
    pub fn lease_lost(&self) {
        *self.live.lock() = None;
        *self.liveness_revision.lock() = None;
    }

    /// The mod revision of this node's liveness key that a take compares
    /// (None: not registered, no take may be sent).
    pub fn liveness_revision(&self) -> Option<i64> {
        *self.liveness_revision.lock()
    }

    /// The liveness key was seen at `revision` holding `lease`: when that
    /// is this agent's current lease and a later revision than the one
    /// takes compare, this agent moved it (a fence whose answer was lost):
    /// takes compare that one from now on. Moving forward never lets an
    /// older take land (it compares an older revision).
    pub fn liveness_seen(&self, lease: Option<LeaseId>, revision: i64) {
        let ours = self.live.lock().as_ref().map(|(l, _)| *l);
        if lease.is_none() || lease != ours {
            return;
        }
        let mut r = self.liveness_revision.lock();
        if r.is_some_and(|now| now < revision) {
            *r = Some(revision);
        }
    }

    /// A take found this node's liveness key gone while this agent holds
    /// its lease (deleted by hand): the liveness thread writes it again.
    pub fn ask_reregistration(&self) {
        self.reregister
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a new registration was asked for since the last call.
    pub fn reregistration_asked(&self) -> bool {
        self.reregister
            .swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits up to `timeout` for this agent to be registered (a take
    /// before it is refused); true when it is.
    pub fn wait_registered(&self, timeout: Duration, shutdown: &crate::shutdown::Shutdown) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut back = self.back.lock();
        loop {
            if self.liveness_revision.lock().is_some() {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline || shutdown.is_triggered() {
                return false;
            }
            // Bounded slices: the shutdown flag is re-checked.
            let slice = (deadline - now).min(Duration::from_millis(200));
            self.back_cv.wait_for(&mut back, slice);
        }
    }

    /// The send time (CLOCK_BOOTTIME) of the last keep-alive etcd answered,
    /// in this run or, on the same boot, the previous one.
    pub fn last_sent(&self) -> Option<Duration> {
        let live = self
            .live
            .lock()
            .as_ref()
            .map(|(_, c)| c.last_sent_boottime());
        let written = *self.written.lock();
        [live, written, self.persisted].into_iter().flatten().max()
    }

    /// How long ago that was.
    pub fn since_last_sent(&self) -> Option<Duration> {
        self.last_sent().map(|s| boottime().saturating_sub(s))
    }

    /// The lease this agent registered with, valid or not by its clock
    /// (None: not registered).
    pub fn registered_lease(&self) -> Option<LeaseId> {
        self.live.lock().as_ref().map(|(l, _)| *l)
    }

    /// The current lease, while it is valid by this node's own clock.
    pub fn valid_lease(&self) -> Option<LeaseId> {
        let live = self.live.lock();
        let (lease, clock) = live.as_ref()?;
        let life = clock
            .ttl()
            .min(self.ttl)
            .mul_f64(1.0 - DRIFT)
            .saturating_sub(LEASE_MARGIN);
        let age = boottime().saturating_sub(clock.last_sent_boottime());
        (age < life).then_some(*lease)
    }

    /// Whether a call up may go out without etcd's word on the claim: with
    /// no `stop_after_disconnect` only an operator frees a claim; with one,
    /// only before `last_sent + window`.
    pub fn without_etcd(&self) -> Result<(), String> {
        let Some(window) = self.window() else {
            return Ok(());
        };
        match self.last_sent() {
            Some(s) if boottime() < s + window => Ok(()),
            Some(s) => Err(format!(
                "this node's lease was last renewed {:?} ago, more than stop_after_disconnect ({window:?}): the cluster may have freed the claim, so no call up is made before etcd confirms it",
                boottime().saturating_sub(s)
            )),
            None => Err(format!(
                "no renewal of this node's lease is known since boot ({} missing or expired): the cluster may have freed the claim, so no call up is made before etcd confirms it",
                self.path.display()
            )),
        }
    }

    /// The claim was taken, or read back, while `lease` was this node's.
    pub fn confirm(&self, volume_id: &str, alloc_id: &str, lease: LeaseId) {
        self.confirmed
            .lock()
            .insert((volume_id.to_string(), alloc_id.to_string()), lease);
    }

    /// The claim may be used now without reading it again.
    pub fn is_confirmed(&self, volume_id: &str, alloc_id: &str) -> bool {
        let Some(lease) = self.valid_lease() else {
            return false;
        };
        self.confirmed
            .lock()
            .get(&(volume_id.to_string(), alloc_id.to_string()))
            == Some(&lease)
    }

    /// The claim is freed or given up: forget it.
    pub fn forget(&self, volume_id: &str, alloc_id: &str) {
        self.confirmed
            .lock()
            .remove(&(volume_id.to_string(), alloc_id.to_string()));
    }

    /// Writes the current send time to the file, atomically, when it moved
    /// by at least a third of the TTL since the last write.
    pub fn persist(&self) {
        let Some((lease, sent)) = self
            .live
            .lock()
            .as_ref()
            .map(|(l, c)| (*l, c.last_sent_boottime()))
        else {
            return;
        };
        {
            let mut back = self.back.lock();
            if let Some(prev) = back.1 {
                if sent > prev && sent - prev > self.ttl / 2 {
                    back.0 += 1;
                    self.back_cv.notify_all();
                }
            }
            back.1 = Some(sent);
        }
        {
            let written = self.written.lock();
            if written.is_some_and(|w| sent < w + self.ttl / 3) {
                return;
            }
        }
        let file = LeaseClockFile {
            boot_id: self.boot_id.clone(),
            lease_id: lease.to_string(),
            sent_boottime_ms: sent.as_millis() as u64,
        };
        match write_atomically(&self.path, &file) {
            Ok(()) => {
                let mut written = self.written.lock();
                // Never moves back (two writers cannot race here: one
                // liveness thread).
                if !matches!(*written, Some(w) if w >= sent) {
                    *written = Some(sent);
                }
            }
            Err(e) => log::warn!(
                "cannot write {}: {e} (a restart counts from the last time it was written)",
                self.path.display()
            ),
        }
    }
}

fn write_atomically(path: &Path, file: &LeaseClockFile) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(file).expect("a lease clock always encodes");
    crate::state::write_file_atomically(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(window: Option<Duration>) -> ReleaseBounds {
        ReleaseBounds::new(window, Duration::from_secs(2), Duration::from_secs(1))
    }

    #[test]
    fn a_missing_file_is_expired_and_without_a_window_nothing_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Fencing::open(dir.path(), "i", "boot", bounds(None)).expect("opens");
        assert_eq!(f.last_sent(), None);
        assert!(f.without_etcd().is_ok());
        let f = Fencing::open(
            dir.path(),
            "i",
            "boot",
            bounds(Some(Duration::from_secs(4))),
        )
        .expect("opens");
        assert!(f.without_etcd().is_err());
        assert_eq!(f.valid_lease(), None);
        assert!(!f.is_confirmed("v", "a"));
    }

    #[test]
    fn a_file_of_this_boot_sets_the_deadline_and_another_boot_does_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = boottime();
        let file = LeaseClockFile {
            boot_id: "this".into(),
            lease_id: "1".into(),
            sent_boottime_ms: now.as_millis() as u64,
        };
        write_atomically(&dir.path().join(LEASE_CLOCK_FILE), &file).expect("write");
        let window = Some(Duration::from_secs(10));
        let f = Fencing::open(dir.path(), "i", "this", bounds(window)).expect("opens");
        assert!(f.without_etcd().is_ok());
        assert!(f.since_last_sent().is_some());
        let f = Fencing::open(dir.path(), "i", "other", bounds(window)).expect("opens");
        assert!(f.without_etcd().is_err());
        // Long past: expired.
        let old = LeaseClockFile {
            sent_boottime_ms: now.saturating_sub(Duration::from_secs(20)).as_millis() as u64,
            ..file
        };
        write_atomically(&dir.path().join(LEASE_CLOCK_FILE), &old).expect("write");
        let f = Fencing::open(dir.path(), "i", "this", bounds(window)).expect("opens");
        assert!(f.without_etcd().is_err());
    }

    #[test]
    fn a_corrupt_file_is_expired_and_left_for_the_next_renewal() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(LEASE_CLOCK_FILE), b"{not json").expect("write");
        let f = Fencing::open(dir.path(), "i", "b", bounds(Some(Duration::from_secs(60))))
            .expect("opens");
        assert!(f.without_etcd().is_err());
    }

    #[test]
    fn an_instance_id_is_made_once_and_a_bad_one_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = instance_id(dir.path()).expect("made");
        assert_eq!(a.len(), 32);
        assert_eq!(instance_id(dir.path()).expect("read"), a);
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(instance_id(other.path()).expect("made"), a);
        std::fs::write(dir.path().join(INSTANCE_FILE), "../x").expect("write");
        let e = instance_id(dir.path()).expect_err("refused");
        assert!(matches!(e, IdentityError::NotAnInstanceId { .. }), "{e:?}");
        assert!(e.to_string().contains(INSTANCE_FILE), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join(INSTANCE_FILE)).expect("read"),
            "../x"
        );
    }

    #[test]
    fn only_marked_plugins_fence() {
        let marked = vec!["san".to_string()];
        assert!(unpublish_fences(&marked, "san"));
        assert!(!unpublish_fences(&marked, "nfs"));
        assert!(!may_free_unfenced(false));
    }

    #[test]
    fn the_reaper_frees_only_what_is_fenced_or_opted_in() {
        let marked = vec!["san".to_string()];
        let cluster = FreeRule::Cluster {
            fencing_plugins: &marked,
            free_unfenced: false,
            publish_settle: Duration::ZERO,
            registered_at: 1,
        };
        assert_eq!(cluster.decide(Some("san")), FreeDecision::DetachThenFree);
        assert!(matches!(
            cluster.decide(Some("nfs")),
            FreeDecision::Keep { .. }
        ));
        assert!(matches!(cluster.decide(None), FreeDecision::Keep { .. }));
        let opted = FreeRule::Cluster {
            fencing_plugins: &[],
            free_unfenced: true,
            publish_settle: Duration::ZERO,
            registered_at: 1,
        };
        assert_eq!(opted.decide(None), FreeDecision::Free);
        assert_eq!(opted.decide(Some("nfs")), FreeDecision::DetachThenFree);
        assert_eq!(FreeRule::Operator.decide(None), FreeDecision::Free);
        assert_eq!(
            FreeRule::Operator.decide(Some("nfs")),
            FreeDecision::DetachThenFree
        );
    }
}
