//! What mount, release and restore share: the stores, the plugin registry,
//! the options, the per-volume operation locks, in-memory progress and the
//! worker threads; and the few ways a step changes a record.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::StepError;
use super::progress::Progress;
use crate::claims::{Applied, ClaimChange, ClaimRequest, ClaimStore, Outcomes, Transaction};
use crate::plugins::{PluginKind, PluginSnapshot, Registry, WaitError};
use crate::retry::BackoffPolicy;
use crate::shutdown::Shutdown;
use crate::state::{AllocVolume, ClaimMode, StateError, StateFile, StateStore};
use crate::threads::Threads;
use crate::volumes::lock::{OperationLock, OperationLocks};
use crate::volumes::{Paths, VolumeSpec};

/// Claim retries (held by another allocation): Nomad's 2 s doubling to a
/// minute, started a little sooner.
pub const CLAIM_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_secs(1), Duration::from_secs(60));
/// Retries of CSI calls (kubelet: 500 ms doubling to ~2 min).
pub const CSI_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_millis(500), Duration::from_secs(60));
/// Longest single wait for a plugin inside a release retry loop; the loop
/// itself is bounded by the release deadline.
const RELEASE_PLUGIN_WAIT_SLICE: Duration = Duration::from_secs(5);
/// Longest wait for a volume's operation lock. The holder is inside one
/// step (a CSI call with its deadline, a claim round trip, a state write);
/// past this, the waiter reports the volume busy and retries.
pub const OPERATION_LOCK_WAIT: Duration = Duration::from_secs(300);

#[derive(Clone, Debug)]
pub struct LifecycleOptions {
    pub mount_root: PathBuf,
    pub node_name: String,
    pub plugin_wait: Duration,
    pub claim_retry_deadline: Duration,
    pub claim_backoff: BackoffPolicy,
    pub mount_retry_deadline: Duration,
    pub release_retry_deadline: Duration,
    pub csi_backoff: BackoffPolicy,
    /// How long `restore` waits for unfinished mounts before it returns
    /// and lets them go on in the background.
    pub restore_wait: Duration,
    /// Longest wait for a volume's operation lock.
    pub lock_wait: Duration,
    /// After a call timed out, how long the plugin is given to finish it
    /// before the volume is detached or its claim freed (the CSI call
    /// deadline: the plugin got the same one).
    pub uncertain_settle: Duration,
    /// Cluster mode: how long one attach or detach request waits for a
    /// controller host on another node.
    pub attach_timeout: Duration,
    /// Cluster mode: plugins given the claim's epoch in their contexts
    /// (`cluster.epoch_plugins`).
    pub epoch_plugins: Vec<String>,
}

impl LifecycleOptions {
    pub fn new(mount_root: &Path, node_name: &str) -> LifecycleOptions {
        LifecycleOptions {
            mount_root: mount_root.to_path_buf(),
            node_name: node_name.to_string(),
            plugin_wait: crate::config::DEFAULT_PLUGIN_WAIT_TIMEOUT,
            claim_retry_deadline: crate::config::DEFAULT_CLAIM_RETRY_DEADLINE,
            claim_backoff: CLAIM_BACKOFF,
            mount_retry_deadline: crate::config::DEFAULT_MOUNT_RETRY_DEADLINE,
            release_retry_deadline: crate::config::DEFAULT_RELEASE_RETRY_DEADLINE,
            csi_backoff: CSI_BACKOFF,
            restore_wait: crate::config::DEFAULT_PLUGIN_WAIT_TIMEOUT
                + crate::config::DEFAULT_CSI_CALL_TIMEOUT,
            lock_wait: OPERATION_LOCK_WAIT,
            uncertain_settle: crate::config::DEFAULT_CSI_CALL_TIMEOUT,
            attach_timeout: crate::config::DEFAULT_ATTACH_TIMEOUT,
            epoch_plugins: Vec::new(),
        }
    }
}

/// One step's result when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Go on with the next step at once.
    Next,
    Done,
}

pub type StepResult = Result<Step, StepError>;

pub struct Core {
    pub store: Arc<StateStore>,
    pub claims: Arc<dyn ClaimStore>,
    pub registry: Registry,
    pub paths: Paths,
    pub opts: LifecycleOptions,
    pub shutdown: Shutdown,
    /// The one lock held across CSI calls: one operation per volume.
    pub locks: Arc<OperationLocks>,
    pub progress: Progress,
    pub workers: Mutex<Option<Threads>>,
}

impl Core {
    /// The record of one volume of an allocation, as durable now.
    pub fn record(&self, alloc_id: &str, alias: &str) -> Option<AllocVolume> {
        self.store.read(|s| s.volume(alloc_id, alias).cloned())
    }

    pub fn spec(&self, volume_id: &str) -> Option<Arc<VolumeSpec>> {
        self.store.read(|s| s.volumes.get(volume_id).cloned())
    }

    /// The operation lock of a volume, waited for up to the bound.
    pub fn lock_volume(&self, volume_id: &str) -> Result<OperationLock<'_>, StepError> {
        Ok(self.locks.lock(volume_id, self.opts.lock_wait)?)
    }

    pub fn claim_request(&self, alloc_id: &str, rec: &AllocVolume) -> ClaimRequest {
        ClaimRequest {
            external_node_id: rec.external_node_id.clone(),
            volume_id: rec.volume_id.clone(),
            alloc_id: alloc_id.to_string(),
            node: self.opts.node_name.clone(),
            mode: if rec.usage.read_only {
                ClaimMode::Read
            } else {
                ClaimMode::Write
            },
            access_mode: rec.usage.access_mode,
            storage: Some(crate::claims::StorageRef {
                plugin_id: rec.plugin_id.clone(),
                external_id: rec.external_volume_id.clone(),
                context: self
                    .spec(&rec.volume_id)
                    .map(|s| s.context.clone())
                    .unwrap_or_default(),
            }),
        }
    }

    /// Claim changes with the record change they belong to, through the
    /// claim store (one durable write with the embedded store).
    pub fn transact(
        &self,
        changes: Vec<ClaimChange>,
        wanted: &dyn Fn(&StateFile) -> bool,
        record: &mut dyn FnMut(&mut StateFile, &Outcomes),
    ) -> Result<Applied, StateError> {
        self.claims.transact(Transaction {
            changes,
            wanted,
            record,
            closing: false,
        })
    }

    /// As `transact`, for the record change that closes an operation whose
    /// intent is durable: the caller goes on once readers see it, and it
    /// is written with the next write (see `StateStore::update_closing`).
    pub fn transact_closing(
        &self,
        changes: Vec<ClaimChange>,
        record: &mut dyn FnMut(&mut StateFile, &Outcomes),
    ) -> Result<Applied, StateError> {
        self.claims.transact(Transaction {
            changes,
            wanted: &|_| true,
            record,
            closing: true,
        })
    }

    /// Records a change of one volume record durably (no claim change).
    pub fn advance(
        &self,
        alloc_id: &str,
        alias: &str,
        f: impl FnOnce(&mut AllocVolume),
    ) -> Result<(), StateError> {
        self.store.update(|s| -> Result<(), StateError> {
            if let Some(v) = s.volume_mut(alloc_id, alias) {
                f(v);
            }
            Ok(())
        })
    }

    /// Records a change of one volume record together with one claim
    /// change; the record changes only when the claim change went through.
    pub fn advance_with_claim(
        &self,
        alloc_id: &str,
        alias: &str,
        change: ClaimChange,
        f: impl FnOnce(&mut AllocVolume),
    ) -> Result<(), StepError> {
        let mut f = Some(f);
        let applied = self.transact(vec![change], &|_| true, &mut |s, out| {
            if out.iter().all(Result::is_ok) {
                if let (Some(v), Some(f)) = (s.volume_mut(alloc_id, alias), f.take()) {
                    f(v);
                }
            }
        })?;
        applied.single()?;
        Ok(())
    }

    /// The closing write of a mount: one volume record changed, with the
    /// claim change when there is one (the attachment recorded with the
    /// claim); the record changes only when the claim change went through.
    /// A closing change (see `transact_closing`). `f` runs under the
    /// state's lock, before any write can carry the change: a failpoint
    /// there always finds the intent alone on disk.
    pub fn close_with_claim(
        &self,
        alloc_id: &str,
        alias: &str,
        change: Option<ClaimChange>,
        f: impl FnOnce(&mut AllocVolume),
    ) -> Result<(), StepError> {
        let mut f = Some(f);
        let applied = self.transact_closing(change.into_iter().collect(), &mut |s, out| {
            if out.iter().all(Result::is_ok) {
                if let (Some(v), Some(f)) = (s.volume_mut(alloc_id, alias), f.take()) {
                    f(v);
                }
            }
        })?;
        applied.single()?;
        Ok(())
    }

    /// Frees the claim and drops the volume's record (and the allocation
    /// with its last volume): the closing write of a release. The claim
    /// store frees the claim before this returns; the drop is written with
    /// the next write (a crash before it finds the durable `releasing`
    /// record and goes down again, every call idempotent).
    pub fn free_and_drop(&self, alloc_id: &str, alias: &str, volume_id: &str) -> StepResult {
        let free = ClaimChange::Free {
            volume_id: volume_id.to_string(),
            alloc_id: alloc_id.to_string(),
            holder: Some(self.opts.node_name.clone()),
            while_gone: false,
            by_hand: None,
        };
        let applied = self.transact_closing(vec![free], &mut |s, out| {
            if out.iter().all(Result::is_ok) {
                drop_record(s, alloc_id, alias);
                // Applied, not yet durable (see `close_with_claim`).
                crate::failpoints::hit("release-after-claim-freed");
            }
        })?;
        applied.single()?;
        Ok(Step::Done)
    }

    /// The plugin for a release step: waits for it in slices, so the
    /// release's own backoff and deadline stay in charge.
    pub fn plugin_for_release(
        &self,
        plugin_id: &str,
        kind: PluginKind,
        deadline: Instant,
    ) -> Result<PluginSnapshot, WaitError> {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(RELEASE_PLUGIN_WAIT_SLICE);
        self.registry.wait_for_plugin(plugin_id, kind, wait)
    }

    /// Starts a named worker thread owned by the lifecycle (joined on stop).
    pub fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) -> Result<(), SpawnError> {
        match self.workers.lock().as_mut() {
            Some(t) => t.spawn(name, f).map_err(SpawnError::Io),
            None => Err(SpawnError::Stopping),
        }
    }

    /// Like `spawn`, on a pooled thread (`Threads::spawn_pooled`): for a job
    /// that ends, such as one volume's release.
    pub fn spawn_pooled(
        &self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<(), SpawnError> {
        match self.workers.lock().as_mut() {
            Some(t) => t.spawn_pooled(name, f).map_err(SpawnError::Io),
            None => Err(SpawnError::Stopping),
        }
    }
}

/// How long the closing write of an operation waits for company: an
/// operation that starts meanwhile carries it in its own intent's write
/// (back-to-back operations then pay one fdatasync each).
pub const CLOSING_WRITE_DELAY: Duration = Duration::from_millis(2);
/// How long it waits at most while other operations are in flight: their
/// callers' next operations are likely to write an intent soon (a busy
/// node then pays about one fdatasync per operation, not two). Nothing
/// waits for a closing write, so only the window in which a crash makes
/// recovery redo idempotent calls grows.
pub const CLOSING_WRITE_BUSY_DELAY: Duration = Duration::from_millis(10);
/// Longest wait of the flusher for work (the stop wakes it at once).
const FLUSHER_POLL: Duration = Duration::from_secs(1);

/// The flusher of closing changes (the `state-flush` thread): writes each
/// within `CLOSING_WRITE_DELAY` (`CLOSING_WRITE_BUSY_DELAY` while `busy()`)
/// unless another write carried it, and what is left when the agent stops.
pub fn write_closings(store: &StateStore, shutdown: &Shutdown, busy: impl Fn() -> bool) {
    loop {
        let stopping = shutdown.is_triggered();
        if store.wait_closing(FLUSHER_POLL, || shutdown.is_triggered()) {
            if !stopping {
                wait_for_company(store, shutdown, &busy);
            }
            // Operations were answered; their closing writes are not done.
            crate::failpoints::hit("answer-before-closing-write");
            if let Err(e) = store.flush() {
                log::error!(
                    "closing state changes were not written: {}",
                    crate::error_chain(&e)
                );
            }
        }
        if stopping {
            return;
        }
    }
}

/// Sleeps `CLOSING_WRITE_DELAY`, then on in slices of it while other
/// operations are in flight, up to `CLOSING_WRITE_BUSY_DELAY` in all; ends
/// early once another write carried the closing changes, or on the stop.
fn wait_for_company(store: &StateStore, shutdown: &Shutdown, busy: &impl Fn() -> bool) {
    let start = Instant::now();
    while shutdown.sleep(CLOSING_WRITE_DELAY)
        && store.undurable_changes() > 0
        && busy()
        && start.elapsed() + CLOSING_WRITE_DELAY <= CLOSING_WRITE_BUSY_DELAY
    {}
}

/// Why a worker thread did not start.
#[derive(Debug)]
pub enum SpawnError {
    Io(std::io::Error),
    Stopping,
}

/// Drops one volume record, and the allocation with its last one.
pub fn drop_record(s: &mut StateFile, alloc_id: &str, alias: &str) {
    if let Some(a) = s.alloc_mut(alloc_id) {
        a.volumes.remove(alias);
        if a.volumes.is_empty() {
            s.allocs.remove(alloc_id);
        }
    }
}

/// The publish context as recorded with the claim.
pub fn attach_change(
    alloc_id: &str,
    rec: &AllocVolume,
    publish_context: &BTreeMap<String, String>,
) -> ClaimChange {
    ClaimChange::Attach {
        volume_id: rec.volume_id.clone(),
        alloc_id: alloc_id.to_string(),
        external_node_id: rec.external_node_id.clone().unwrap_or_default(),
        publish_context: publish_context.clone(),
    }
}
