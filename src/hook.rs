//! The allocation lifecycle: mount, release and restore.
//!
//! Every step of a volume runs under that volume's lock (one CSI operation
//! in flight per volume; unrelated volumes proceed in parallel), re-reads
//! the record, decides, makes its in-flight phase durable, and only then
//! sends the CSI call. No lock of the state is held across a call. Backoff
//! waits happen outside the volume lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::claims::{self, ClaimError, ClaimMode, ClaimRequest, ClaimStore};
use crate::csi::{self, CsiError};
use crate::failpoints;
use crate::mounts::MountTable;
use crate::plugins::{PluginKind, PluginSnapshot, Registry, WaitError};
use crate::retry::{Backoff, BackoffPolicy, Interrupted};
use crate::shutdown::Shutdown;
use crate::state::{AllocRecord, AllocVolume, Phase, StateError, StateFile, StateStore};
use crate::threads::Threads;
use crate::volumes::{
    validate_requests, volume_capability, AttachmentMode, Paths, SpecError, Usage, VolumeRequest,
    VolumeSpec,
};

/// Claim retries (held by another allocation): Nomad's 2 s doubling to a
/// minute, started a little sooner.
pub const CLAIM_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_secs(1), Duration::from_secs(60));
/// Retries of CSI calls (kubelet: 500 ms doubling to ~2 min).
pub const CSI_BACKOFF: BackoffPolicy =
    BackoffPolicy::new(Duration::from_millis(500), Duration::from_secs(60));
/// How long a mount keeps retrying retryable CSI errors.
pub const MOUNT_RETRY_DEADLINE: Duration = Duration::from_secs(120);
/// How long a failed mount waits for its own rollback before answering.
pub const ROLLBACK_WAIT: Duration = Duration::from_secs(30);
/// How many completed release reports are kept for `alloc status`.
const MAX_RELEASE_REPORTS: usize = 1024;
/// Longest single wait for a plugin inside a release retry loop; the loop
/// itself is bounded by the release deadline.
const RELEASE_PLUGIN_WAIT_SLICE: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct ManagerOptions {
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
}

impl ManagerOptions {
    pub fn new(mount_root: &Path, node_name: &str) -> ManagerOptions {
        ManagerOptions {
            mount_root: mount_root.to_path_buf(),
            node_name: node_name.to_string(),
            plugin_wait: crate::config::DEFAULT_PLUGIN_WAIT_TIMEOUT,
            claim_retry_deadline: crate::config::DEFAULT_CLAIM_RETRY_DEADLINE,
            claim_backoff: CLAIM_BACKOFF,
            mount_retry_deadline: MOUNT_RETRY_DEADLINE,
            release_retry_deadline: crate::config::DEFAULT_RELEASE_RETRY_DEADLINE,
            csi_backoff: CSI_BACKOFF,
            restore_wait: crate::config::DEFAULT_PLUGIN_WAIT_TIMEOUT
                + crate::config::DEFAULT_CSI_CALL_TIMEOUT,
        }
    }
}

/// A mounted volume as handed to the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountedVolume {
    pub alias: String,
    pub volume_id: String,
    pub host_path: PathBuf,
    pub read_only: bool,
    pub block: bool,
}

#[derive(Debug)]
pub enum MountError {
    Invalid(SpecError),
    UnknownVolume {
        volume_id: String,
    },
    /// The allocation is being mounted, restored or released already, or
    /// holds other volumes.
    Busy {
        alloc_id: String,
        why: String,
    },
    Plugin {
        alias: String,
        source: WaitError,
    },
    Claim {
        alias: String,
        source: ClaimError,
    },
    Csi {
        alias: String,
        source: CsiError,
    },
    State(StateError),
    Shutdown,
}

impl fmt::Display for MountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MountError::Invalid(e) => e.fmt(f),
            MountError::UnknownVolume { volume_id } => {
                write!(f, "volume {volume_id} is not registered")
            }
            MountError::Busy { alloc_id, why } => write!(f, "allocation {alloc_id} {why}"),
            MountError::Plugin { alias, .. } => write!(f, "volume {alias} could not be mounted"),
            MountError::Claim { alias, .. } => write!(f, "volume {alias} could not be claimed"),
            MountError::Csi { alias, .. } => write!(f, "volume {alias} could not be mounted"),
            MountError::State(_) => write!(f, "the mount could not be recorded"),
            MountError::Shutdown => write!(f, "the agent is stopping"),
        }
    }
}

impl std::error::Error for MountError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MountError::Plugin { source, .. } => Some(source),
            MountError::Claim { source, .. } => Some(source),
            MountError::Csi { source, .. } => Some(source),
            MountError::State(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for MountError {
    fn from(e: StateError) -> Self {
        MountError::State(e)
    }
}

impl From<SpecError> for MountError {
    fn from(e: SpecError) -> Self {
        MountError::Invalid(e)
    }
}

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

/// Outcome of asking for a release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReleaseStart {
    /// Workers run (or were already running).
    Started,
    /// Nothing is recorded for this allocation: already released.
    NotFound,
}

/// One volume in a status answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeStatus {
    pub alias: String,
    pub volume_id: String,
    pub plugin_id: String,
    pub phase: Option<Phase>,
    pub host_path: PathBuf,
    pub read_only: bool,
    pub attachment: AttachmentMode,
    pub release: Option<ReleaseState>,
    /// What a running mount or restore is waiting on, if anything.
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocStatus {
    pub id: String,
    pub releasing: bool,
    pub volumes: Vec<VolumeStatus>,
}

/// Per-volume locks: one CSI operation in flight per volume.
#[derive(Default)]
struct VolumeLocks {
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl VolumeLocks {
    fn get(&self, volume_id: &str) -> Arc<Mutex<()>> {
        self.locks
            .lock()
            .entry(volume_id.to_string())
            .or_default()
            .clone()
    }
}

/// In-memory progress that is not worth a durable write.
#[derive(Default)]
struct Progress {
    /// (alloc, alias) -> release state of the latest release.
    releases: HashMap<(String, String), ReleaseState>,
    /// Release workers running.
    active: HashSet<(String, String)>,
    /// Allocations with a mount or restore running.
    mounting: HashSet<String>,
    /// (alloc, alias) -> what a mount is waiting on.
    messages: HashMap<(String, String), String>,
    /// Releases that completed, oldest first: their reports are kept for
    /// `alloc status` until MAX_RELEASE_REPORTS newer ones push them out.
    finished: std::collections::VecDeque<(String, String)>,
}

/// Outcome of one step of a volume.
enum Step {
    /// Go on with the next step at once.
    Next,
    Done,
    /// A transient failure: back off, then try again.
    Retry(String, Option<CsiError>),
    /// Retrying cannot help.
    Fail(MountError),
}

struct Inner {
    store: Arc<StateStore>,
    claims: Arc<dyn ClaimStore>,
    registry: Registry,
    paths: Paths,
    opts: ManagerOptions,
    shutdown: Shutdown,
    locks: VolumeLocks,
    progress: Mutex<Progress>,
    progress_changed: Condvar,
    workers: Mutex<Option<Threads>>,
}

/// The allocation lifecycle manager. Cheap to clone.
#[derive(Clone)]
pub struct Manager {
    inner: Arc<Inner>,
}

type Key = (String, String);

fn key(alloc: &str, alias: &str) -> Key {
    (alloc.to_string(), alias.to_string())
}

impl Manager {
    pub fn new(
        store: Arc<StateStore>,
        claims: Arc<dyn ClaimStore>,
        registry: Registry,
        opts: ManagerOptions,
        shutdown: Shutdown,
    ) -> Manager {
        let m = Manager {
            inner: Arc::new(Inner {
                store,
                claims,
                registry,
                paths: Paths::new(&opts.mount_root),
                opts,
                shutdown: shutdown.clone(),
                locks: VolumeLocks::default(),
                progress: Mutex::new(Progress::default()),
                progress_changed: Condvar::new(),
                workers: Mutex::new(Some(Threads::new())),
            }),
        };
        let weak = Arc::downgrade(&m.inner);
        shutdown.on_trigger(move || {
            if let Some(inner) = weak.upgrade() {
                let _g = inner.progress.lock();
                inner.progress_changed.notify_all();
            }
        });
        m
    }

    pub fn store(&self) -> &Arc<StateStore> {
        &self.inner.store
    }

    pub fn claims(&self) -> &Arc<dyn ClaimStore> {
        &self.inner.claims
    }

    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    pub fn paths(&self) -> &Paths {
        &self.inner.paths
    }

    // ---- volumes --------------------------------------------------------

    /// Registers (or replaces, while unclaimed) a volume.
    pub fn register_volume(&self, spec: VolumeSpec) -> Result<(), VolumeRegistryError> {
        spec.validate().map_err(VolumeRegistryError::Invalid)?;
        self.inner.store.update(|s| {
            if let Some(old) = s.volumes.get(&spec.id) {
                if **old != spec {
                    if let Some(c) = s.claims_on(&spec.id).next() {
                        return Err(VolumeRegistryError::InUse {
                            volume_id: spec.id.clone(),
                            holder: c.alloc_id.clone(),
                        });
                    }
                }
            }
            s.volumes.insert(spec.id.clone(), Arc::new(spec));
            Ok(())
        })
    }

    /// Deregisters a volume no allocation uses.
    pub fn deregister_volume(&self, id: &str) -> Result<bool, VolumeRegistryError> {
        crate::ids::check_id("volume", id)
            .map_err(|e| VolumeRegistryError::Invalid(SpecError::Id(e)))?;
        self.inner.store.update(|s| {
            if let Some(c) = s.claims_on(id).next() {
                return Err(VolumeRegistryError::InUse {
                    volume_id: id.to_string(),
                    holder: c.alloc_id.clone(),
                });
            }
            if let Some((a, _)) = s.alloc_volumes().find(|(_, v)| v.volume_id == id) {
                return Err(VolumeRegistryError::InUse {
                    volume_id: id.to_string(),
                    holder: a.id.clone(),
                });
            }
            Ok(s.volumes.remove(id).is_some())
        })
    }

    pub fn list_volumes(&self) -> Vec<VolumeSpec> {
        self.inner
            .store
            .read(|s| s.volumes.values().map(|v| (**v).clone()).collect())
    }

    // ---- mount ----------------------------------------------------------

    /// Mounts every requested volume for `alloc_id` and answers with the
    /// host paths; on failure, rolls back what it did so nothing stays
    /// half-claimed. Mounting an allocation again with the same requests
    /// finishes what is unfinished and answers the same paths.
    pub fn mount(
        &self,
        alloc_id: &str,
        reqs: &[VolumeRequest],
    ) -> Result<Vec<MountedVolume>, MountError> {
        validate_requests(alloc_id, reqs)?;
        let _guard = self.begin_mount(alloc_id)?;
        let plans = self.ready_plans(reqs);
        let paths = &self.inner.paths;
        let mut claimed_at_once = false;
        // Resolve and record every volume in phase `claiming`, in one
        // durable write, before any claim or call. With the claim store in
        // the state file and the volume's plugins ready, the same write
        // takes the claim and enters the first in-flight phase (what
        // `take_claim` would write next); a claim that cannot be granted
        // now is left to `take_claim`, which retries and reports it.
        let created = self.inner.store.update(|s| -> Result<bool, MountError> {
            let mut wanted = BTreeMap::new();
            for r in reqs {
                let spec =
                    s.volumes
                        .get(&r.volume_id)
                        .ok_or_else(|| MountError::UnknownVolume {
                            volume_id: r.volume_id.clone(),
                        })?;
                let usage = r.resolve(spec)?;
                wanted.insert(r.alias.clone(), self.new_record(alloc_id, r, spec, usage));
            }
            if let Some(existing) = s.allocs.get(alloc_id) {
                if existing.releasing {
                    return Err(MountError::Busy {
                        alloc_id: alloc_id.to_string(),
                        why: "is being released".to_string(),
                    });
                }
                let same = existing.volumes.len() == wanted.len()
                    && wanted.iter().all(|(alias, w)| {
                        existing
                            .volumes
                            .get(alias)
                            .is_some_and(|v| v.volume_id == w.volume_id && v.usage == w.usage)
                    });
                if !same {
                    return Err(MountError::Busy {
                        alloc_id: alloc_id.to_string(),
                        why: "already has other volumes mounted; release it first".to_string(),
                    });
                }
                return Ok(false);
            }
            for rec in wanted.values_mut() {
                let Some(plan) = plans.get(&rec.plugin_id) else {
                    continue;
                };
                let req = self.claim_request(alloc_id, rec);
                if claims::claim_in_state(s, &req).is_ok() {
                    plan.enter(rec, paths);
                    claimed_at_once = true;
                }
            }
            s.allocs.insert(
                alloc_id.to_string(),
                Arc::new(AllocRecord {
                    id: alloc_id.to_string(),
                    releasing: false,
                    volumes: wanted.into_iter().map(|(k, v)| (k, Arc::new(v))).collect(),
                }),
            );
            Ok(true)
        })?;
        if created {
            // Reports of an earlier release under the same ID are stale now.
            self.inner
                .progress
                .lock()
                .releases
                .retain(|(a, _), _| a != alloc_id);
            failpoints::hit("mount-after-record");
            if claimed_at_once {
                // The claim and the first phase are durable already.
                failpoints::hit("mount-after-claim");
                failpoints::hit("mount-after-first-phase");
            }
            log::info!("mounting allocation {alloc_id}: {} volume(s)", reqs.len());
        }
        let deadline = Instant::now() + self.inner.opts.mount_retry_deadline;
        for r in reqs {
            if let Err(e) = self.mount_volume(alloc_id, &r.alias, deadline) {
                if matches!(e, MountError::Shutdown) {
                    // A graceful stop unmounts nothing: the next start
                    // finishes this mount from the state file.
                    return Err(e);
                }
                log::warn!(
                    "mount of allocation {alloc_id} failed ({}); rolling back",
                    crate::error_chain(&e)
                );
                self.rollback(alloc_id);
                return Err(e);
            }
        }
        Ok(self.mounted(alloc_id))
    }

    fn new_record(
        &self,
        alloc_id: &str,
        r: &VolumeRequest,
        spec: &VolumeSpec,
        usage: Usage,
    ) -> AllocVolume {
        AllocVolume {
            alias: r.alias.clone(),
            volume_id: spec.id.clone(),
            plugin_id: spec.plugin_id.clone(),
            external_volume_id: spec.external_id.clone(),
            external_node_id: None,
            usage,
            mount_flags: r.mount_flags.clone(),
            staging_path: None,
            target_path: self.inner.paths.target(alloc_id, &spec.id, &usage),
            publish_context: BTreeMap::new(),
            holds_attachment: false,
            holds_staging: false,
            phase: Phase::Claiming,
        }
    }

    /// The host paths of a mounted allocation.
    pub fn mounted(&self, alloc_id: &str) -> Vec<MountedVolume> {
        self.inner.store.read(|s| {
            s.allocs
                .get(alloc_id)
                .map(|a| {
                    a.volumes
                        .values()
                        .filter(|v| v.phase == Phase::Published)
                        .map(|v| MountedVolume {
                            alias: v.alias.clone(),
                            volume_id: v.volume_id.clone(),
                            host_path: v.target_path.clone(),
                            read_only: v.usage.read_only,
                            block: v.usage.attachment == AttachmentMode::BlockDevice,
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    fn begin_mount(&self, alloc_id: &str) -> Result<MountGuard, MountError> {
        let mut p = self.inner.progress.lock();
        if !p.mounting.insert(alloc_id.to_string()) {
            return Err(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: "is being mounted or restored already".to_string(),
            });
        }
        if p.active.iter().any(|(a, _)| a == alloc_id) {
            p.mounting.remove(alloc_id);
            return Err(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: "is being released".to_string(),
            });
        }
        Ok(MountGuard {
            manager: self.clone(),
            alloc_id: alloc_id.to_string(),
        })
    }

    fn set_message(&self, alloc_id: &str, alias: &str, msg: Option<String>) {
        let mut p = self.inner.progress.lock();
        match msg {
            Some(m) => p.messages.insert(key(alloc_id, alias), m),
            None => p.messages.remove(&key(alloc_id, alias)),
        };
    }

    fn record(&self, alloc_id: &str, alias: &str) -> Option<AllocVolume> {
        self.inner
            .store
            .read(|s| s.volume(alloc_id, alias).cloned())
    }

    fn spec(&self, volume_id: &str) -> Option<Arc<VolumeSpec>> {
        self.inner.store.read(|s| s.volumes.get(volume_id).cloned())
    }

    /// Takes one volume from wherever it stands to `published`.
    fn mount_volume(
        &self,
        alloc_id: &str,
        alias: &str,
        deadline: Instant,
    ) -> Result<(), MountError> {
        let result = self.mount_volume_inner(alloc_id, alias, deadline);
        self.set_message(alloc_id, alias, None);
        result
    }

    fn mount_volume_inner(
        &self,
        alloc_id: &str,
        alias: &str,
        deadline: Instant,
    ) -> Result<(), MountError> {
        let rec = self
            .record(alloc_id, alias)
            .ok_or_else(|| MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: format!("no longer records volume {alias}"),
            })?;
        if rec.phase == Phase::Published {
            return Ok(());
        }
        // 1. The node plugin must be ready before anything else.
        self.set_message(
            alloc_id,
            alias,
            Some(format!("waiting for node plugin {}", rec.plugin_id)),
        );
        let node = self
            .inner
            .registry
            .wait_for_plugin(
                &rec.plugin_id,
                PluginKind::Node,
                self.inner.opts.plugin_wait,
            )
            .map_err(|source| MountError::Plugin {
                alias: alias.to_string(),
                source,
            })?;
        self.set_message(alloc_id, alias, None);
        let controller = self.controller_for(alloc_id, &rec.plugin_id, alias)?;
        // 2. The claim, retrying while another allocation holds it.
        if rec.phase == Phase::Claiming {
            let plan = Plan::new(&node, controller.is_some());
            self.take_claim(alloc_id, &rec, &plan)?;
            self.enter_first_phase(alloc_id, alias, &plan)?;
        }
        // 3. Controller publish, stage, publish.
        let mut backoff = Backoff::new(self.inner.opts.csi_backoff, deadline);
        loop {
            if self.inner.shutdown.is_triggered() {
                return Err(MountError::Shutdown);
            }
            match self.mount_step(alloc_id, alias, &node, controller.as_ref()) {
                Step::Next => {
                    // A step went through: no retry message is current.
                    self.set_message(alloc_id, alias, None);
                    continue;
                }
                Step::Done => return Ok(()),
                Step::Fail(e) => return Err(e),
                Step::Retry(msg, err) => {
                    log::warn!("mount of {alloc_id}/{alias}: {msg} (retrying)");
                    self.set_message(alloc_id, alias, Some(format!("{msg} (retrying)")));
                    if let Err(why) = backoff.wait(&self.inner.shutdown) {
                        return Err(match (why, err) {
                            (Interrupted::Shutdown, _) => MountError::Shutdown,
                            (Interrupted::Deadline, Some(source)) => MountError::Csi {
                                alias: alias.to_string(),
                                source,
                            },
                            (Interrupted::Deadline, None) => MountError::Busy {
                                alloc_id: alloc_id.to_string(),
                                why: msg,
                            },
                        });
                    }
                }
            }
        }
    }

    /// The ready controller side of a plugin, when the plugin has one with
    /// PUBLISH_UNPUBLISH_VOLUME.
    fn controller_for(
        &self,
        alloc_id: &str,
        plugin_id: &str,
        alias: &str,
    ) -> Result<Option<PluginSnapshot>, MountError> {
        let reg = &self.inner.registry;
        if reg.serves(plugin_id, PluginKind::Controller) == Some(false) {
            return Ok(None);
        }
        if reg.get_ready(plugin_id, PluginKind::Controller).is_none() {
            self.set_message(
                alloc_id,
                alias,
                Some(format!("waiting for controller plugin {plugin_id}")),
            );
        }
        let c = reg
            .wait_for_plugin(
                plugin_id,
                PluginKind::Controller,
                self.inner.opts.plugin_wait,
            )
            .map_err(|source| MountError::Plugin {
                alias: alias.to_string(),
                source,
            })?;
        self.set_message(alloc_id, alias, None);
        let publishes = c
            .controller_capabilities
            .as_ref()
            .is_some_and(|caps| caps.publish_unpublish_volume);
        Ok(publishes.then_some(c))
    }

    fn claim_request(&self, alloc_id: &str, rec: &AllocVolume) -> ClaimRequest {
        ClaimRequest {
            volume_id: rec.volume_id.clone(),
            alloc_id: alloc_id.to_string(),
            node: self.inner.opts.node_name.clone(),
            mode: if rec.usage.read_only {
                ClaimMode::Read
            } else {
                ClaimMode::Write
            },
            access_mode: rec.usage.access_mode,
        }
    }

    /// Plans for the plugins of `reqs` that are ready now (node side, and
    /// controller side when the plugin has one), when claims live in the
    /// state file: what lets `mount` claim in its first write. Plugins not
    /// ready are left out; their volumes take the waiting path.
    fn ready_plans(&self, reqs: &[VolumeRequest]) -> HashMap<String, Plan> {
        let mut plans = HashMap::new();
        if !self.inner.claims.in_state_file() {
            return plans;
        }
        let plugins: BTreeSet<String> = self.inner.store.read(|s| {
            reqs.iter()
                .filter_map(|r| s.volumes.get(&r.volume_id))
                .map(|v| v.plugin_id.clone())
                .collect()
        });
        let reg = &self.inner.registry;
        for p in plugins {
            let Some(node) = reg.get_ready(&p, PluginKind::Node) else {
                continue;
            };
            let controller = if reg.serves(&p, PluginKind::Controller) == Some(false) {
                false
            } else {
                match reg.get_ready(&p, PluginKind::Controller) {
                    Some(c) => c
                        .controller_capabilities
                        .as_ref()
                        .is_some_and(|caps| caps.publish_unpublish_volume),
                    None => continue,
                }
            };
            plans.insert(p, Plan::new(&node, controller));
        }
        plans
    }

    fn take_claim(&self, alloc_id: &str, rec: &AllocVolume, plan: &Plan) -> Result<(), MountError> {
        let req = self.claim_request(alloc_id, rec);
        let deadline = Instant::now() + self.inner.opts.claim_retry_deadline;
        let mut backoff = Backoff::new(self.inner.opts.claim_backoff, deadline);
        loop {
            // Each attempt runs under the volume's lock and only while the
            // record still waits for its claim: a release that started
            // meanwhile frees the claim under the same lock, and a claim
            // granted after that would be held by no record.
            let attempt = {
                let lock = self.inner.locks.get(&rec.volume_id);
                let _g = lock.lock();
                let wanted = |s: &StateFile| {
                    s.allocs.get(alloc_id).is_some_and(|a| {
                        !a.releasing
                            && a.volumes
                                .get(&rec.alias)
                                .is_some_and(|v| v.phase == Phase::Claiming)
                    })
                };
                let released = || MountError::Busy {
                    alloc_id: alloc_id.to_string(),
                    why: "is being released".to_string(),
                };
                if self.inner.claims.in_state_file() {
                    // The claim and the first in-flight phase in one write.
                    let paths = &self.inner.paths;
                    let r = self.inner.store.update(|s| {
                        if !wanted(s) {
                            return Ok(false);
                        }
                        claims::claim_in_state(s, &req)?;
                        if let Some(v) = s.volume_mut(alloc_id, &rec.alias) {
                            plan.enter(v, paths);
                        }
                        Ok(true)
                    });
                    match r {
                        Ok(false) => return Err(released()),
                        Ok(true) => Ok(()),
                        Err(e) => Err(e),
                    }
                } else {
                    if !self.inner.store.read(wanted) {
                        return Err(released());
                    }
                    self.inner.claims.claim(&req).map(drop)
                }
            };
            match attempt {
                Ok(_) => {
                    self.set_message(alloc_id, &rec.alias, None);
                    failpoints::hit("mount-after-claim");
                    return Ok(());
                }
                Err(e) if e.is_retryable() => {
                    let msg = format!("{e} (retrying)");
                    log::info!("allocation {alloc_id}: {msg}");
                    self.set_message(alloc_id, &rec.alias, Some(msg));
                    match backoff.wait(&self.inner.shutdown) {
                        Ok(()) => {}
                        Err(Interrupted::Shutdown) => return Err(MountError::Shutdown),
                        Err(Interrupted::Deadline) => {
                            return Err(MountError::Claim {
                                alias: rec.alias.clone(),
                                source: e,
                            })
                        }
                    }
                }
                Err(e) => {
                    return Err(MountError::Claim {
                        alias: rec.alias.clone(),
                        source: e,
                    })
                }
            }
        }
    }

    /// After the claim: record the first in-flight phase (already done, in
    /// the claim's own write, with a claim store kept in the state file).
    fn enter_first_phase(
        &self,
        alloc_id: &str,
        alias: &str,
        plan: &Plan,
    ) -> Result<(), MountError> {
        let paths = self.inner.paths.clone();
        let lock = self.inner.locks.get(&self.volume_of(alloc_id, alias));
        let _g = lock.lock();
        self.inner.store.update(|s| -> Result<(), MountError> {
            let v = s
                .volume_mut(alloc_id, alias)
                .ok_or_else(|| MountError::Busy {
                    alloc_id: alloc_id.to_string(),
                    why: format!("no longer records volume {alias}"),
                })?;
            plan.enter(v, &paths);
            Ok(())
        })?;
        failpoints::hit("mount-after-first-phase");
        Ok(())
    }

    fn volume_of(&self, alloc_id: &str, alias: &str) -> String {
        self.record(alloc_id, alias)
            .map(|v| v.volume_id)
            .unwrap_or_default()
    }

    /// One step up, under the volume's lock.
    fn mount_step(
        &self,
        alloc_id: &str,
        alias: &str,
        node: &PluginSnapshot,
        controller: Option<&PluginSnapshot>,
    ) -> Step {
        let Some(rec) = self.record(alloc_id, alias) else {
            return Step::Fail(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: format!("no longer records volume {alias}"),
            });
        };
        let lock = self.inner.locks.get(&rec.volume_id);
        let _g = lock.lock();
        // Re-read under the lock.
        let Some(rec) = self.record(alloc_id, alias) else {
            return Step::Next;
        };
        let Some(spec) = self.spec(&rec.volume_id) else {
            return Step::Fail(MountError::UnknownVolume {
                volume_id: rec.volume_id,
            });
        };
        let me = (alloc_id, alias);
        match rec.phase {
            Phase::Published => Step::Done,
            Phase::Claiming => Step::Fail(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: format!("volume {alias} is not claimed yet"),
            }),
            p if p.is_teardown() => Step::Fail(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: "is being released".to_string(),
            }),
            Phase::ControllerPublishing => {
                // Already attached to this node for another allocation?
                let shared = self.inner.store.read(|s| {
                    s.attachment_users(&rec.volume_id, me)
                        .into_iter()
                        .find(|o| {
                            attachment_established(o.phase)
                                && o.external_node_id == rec.external_node_id
                        })
                        .map(|o| o.publish_context.clone())
                });
                let ctx = match shared {
                    Some(ctx) => ctx,
                    None => {
                        let Some(c) = controller else {
                            return Step::Retry(
                                format!("controller plugin {} is not available", rec.plugin_id),
                                None,
                            );
                        };
                        let req = controller_publish_request(&rec, &spec, c);
                        failpoints::hit("before-controller-publish");
                        match c.client.controller_publish_volume(&req) {
                            Ok(ctx) => {
                                failpoints::hit("after-controller-publish");
                                ctx
                            }
                            Err(e) => return classify_up(alias, e),
                        }
                    }
                };
                let node_id = rec.external_node_id.clone().unwrap_or_default();
                let stage = rec.staging_path.is_some();
                let attach = ClaimChange::Attach {
                    volume_id: &rec.volume_id,
                    node_id: &node_id,
                    publish_context: &ctx.clone(),
                };
                self.advance_claim(alloc_id, alias, attach, |v| {
                    v.publish_context = ctx;
                    if stage {
                        v.holds_staging = true;
                        v.phase = Phase::Staging;
                    } else {
                        v.phase = Phase::Publishing;
                    }
                })
            }
            Phase::Staging => {
                let staging = rec.staging_path.clone().unwrap_or_default();
                let shared = self.inner.store.read(|s| {
                    s.alloc_volumes().any(|(a, o)| {
                        (a.id.as_str(), o.alias.as_str()) != me
                            && o.holds_staging
                            && o.staging_path.as_deref() == Some(staging.as_path())
                            && staging_established(o.phase)
                    })
                });
                if !shared {
                    if let Err(e) = create_dir(&staging) {
                        return Step::Retry(e, None);
                    }
                    let req = node_stage_request(&rec, &spec);
                    failpoints::hit("before-node-stage");
                    if let Err(e) = node.client.node_stage_volume(&req) {
                        return classify_up(alias, e);
                    }
                    failpoints::hit("after-node-stage");
                }
                self.advance(alloc_id, alias, |v| v.phase = Phase::Publishing)
            }
            Phase::Publishing => {
                if let Some(parent) = rec.target_path.parent() {
                    if let Err(e) = create_dir(parent) {
                        return Step::Retry(e, None);
                    }
                }
                let req = node_publish_request(&rec, &spec);
                failpoints::hit("before-node-publish");
                if let Err(e) = node.client.node_publish_volume(&req) {
                    return classify_up(alias, e);
                }
                failpoints::hit("after-node-publish");
                match self.advance(alloc_id, alias, |v| v.phase = Phase::Published) {
                    Step::Next => {
                        failpoints::hit("mount-after-published");
                        log::info!(
                            "allocation {alloc_id}: volume {} mounted at {}",
                            rec.volume_id,
                            rec.target_path.display()
                        );
                        Step::Done
                    }
                    other => other,
                }
            }
            _ => Step::Fail(MountError::Busy {
                alloc_id: alloc_id.to_string(),
                why: format!("volume {alias} is in an unexpected phase {}", rec.phase),
            }),
        }
    }

    /// Records the next phase durably.
    fn advance(&self, alloc_id: &str, alias: &str, f: impl FnOnce(&mut AllocVolume)) -> Step {
        let r = self.inner.store.update(|s| -> Result<(), StateError> {
            if let Some(v) = s.volume_mut(alloc_id, alias) {
                f(v);
            }
            Ok(())
        });
        match r {
            Ok(()) => Step::Next,
            Err(e) => Step::Retry(crate::error_chain(&e), None),
        }
    }

    fn rollback(&self, alloc_id: &str) {
        if let Err(e) = self.release(alloc_id) {
            log::error!(
                "rollback of allocation {alloc_id} could not start: {}",
                crate::error_chain(&e)
            );
            return;
        }
        if !self.wait_released(alloc_id, ROLLBACK_WAIT) {
            log::warn!(
                "rollback of allocation {alloc_id} is still running after {:?}; it goes on in the background",
                ROLLBACK_WAIT
            );
        }
    }

    // ---- release --------------------------------------------------------

    /// Starts releasing every volume of `alloc_id`, one worker per volume.
    pub fn release(&self, alloc_id: &str) -> Result<ReleaseStart, ReleaseError> {
        crate::ids::check_id("allocation", alloc_id)
            .map_err(|e| ReleaseError::Invalid(SpecError::Id(e)))?;
        // With the claim store in the state file, a published volume whose
        // lock is free takes its first step down (claim marked releasing,
        // phase `unpublishing`) in the write that marks the release; its
        // worker then starts with NodeUnpublish. A volume whose lock is
        // taken (a mount or restore step in flight) is left to its worker.
        let embedded = self.inner.claims.in_state_file();
        let volumes: Vec<(String, String)> = if embedded {
            self.inner.store.read(|s| {
                s.allocs
                    .get(alloc_id)
                    .map(|a| {
                        a.volumes
                            .values()
                            .filter(|v| v.phase == Phase::Published)
                            .map(|v| (v.alias.clone(), v.volume_id.clone()))
                            .collect()
                    })
                    .unwrap_or_default()
            })
        } else {
            Vec::new()
        };
        let locks: Vec<_> = volumes
            .iter()
            .map(|(alias, volume_id)| (alias, volume_id, self.inner.locks.get(volume_id)))
            .collect();
        let held: Vec<_> = locks
            .iter()
            .filter_map(|(alias, volume_id, l)| l.try_lock().map(|g| (*alias, *volume_id, g)))
            .collect();
        let aliases = self.inner.store.update(|s| -> Result<_, ReleaseError> {
            if !s.allocs.contains_key(alloc_id) {
                return Ok(None);
            }
            for (alias, volume_id, _guard) in &held {
                if s.volume(alloc_id, alias).map(|v| v.phase) != Some(Phase::Published) {
                    continue;
                }
                claims::mark_releasing_in_state(s, volume_id, alloc_id);
                if let Some(v) = s.volume_mut(alloc_id, alias) {
                    v.phase = Phase::Unpublishing;
                }
            }
            let Some(a) = s.alloc_mut(alloc_id) else {
                return Ok(None);
            };
            a.releasing = true;
            Ok(Some(a.volumes.keys().cloned().collect::<Vec<_>>()))
        })?;
        drop(held);
        let Some(aliases) = aliases else {
            return Ok(ReleaseStart::NotFound);
        };
        failpoints::hit("release-after-mark");
        log::info!(
            "releasing allocation {alloc_id}: {} volume(s)",
            aliases.len()
        );
        for alias in aliases {
            self.spawn_release_worker(alloc_id, &alias)?;
        }
        Ok(ReleaseStart::Started)
    }

    fn spawn_release_worker(&self, alloc_id: &str, alias: &str) -> Result<(), ReleaseError> {
        let k = key(alloc_id, alias);
        {
            let mut p = self.inner.progress.lock();
            if !p.active.insert(k.clone()) {
                return Ok(());
            }
            p.releases.insert(k.clone(), ReleaseState::InProgress);
        }
        let volume = self.volume_of(alloc_id, alias);
        let m = self.clone();
        let (a, al) = (alloc_id.to_string(), alias.to_string());
        let spawned = match self.inner.workers.lock().as_mut() {
            Some(t) => t
                .spawn(format!("release-{volume}"), move || {
                    m.release_worker(&a, &al)
                })
                .map_err(ReleaseError::Spawn),
            None => Err(ReleaseError::Stopping),
        };
        if let Err(e) = spawned {
            let mut p = self.inner.progress.lock();
            p.active.remove(&k);
            p.releases.insert(
                k,
                ReleaseState::Stopped {
                    error: e.to_string(),
                },
            );
            self.inner.progress_changed.notify_all();
            return Err(e);
        }
        Ok(())
    }

    fn set_release(&self, alloc_id: &str, alias: &str, st: ReleaseState) {
        let mut p = self.inner.progress.lock();
        p.releases.insert(key(alloc_id, alias), st);
        self.inner.progress_changed.notify_all();
    }

    fn release_worker(&self, alloc_id: &str, alias: &str) {
        let deadline = Instant::now() + self.inner.opts.release_retry_deadline;
        let mut backoff = Backoff::new(self.inner.opts.csi_backoff, deadline);
        let outcome = loop {
            if self.inner.shutdown.is_triggered() {
                break ReleaseState::Stopped {
                    error: "the agent is stopping".to_string(),
                };
            }
            match self.release_step(alloc_id, alias, deadline) {
                Step::Next => continue,
                Step::Done => break ReleaseState::Released,
                Step::Fail(e) => {
                    break ReleaseState::Stopped {
                        error: crate::error_chain(&e),
                    }
                }
                Step::Retry(msg, _) => {
                    log::warn!("release of {alloc_id}/{alias}: {msg} (retrying)");
                    self.set_release(
                        alloc_id,
                        alias,
                        ReleaseState::Retrying {
                            error: msg.clone(),
                            attempts: backoff.attempts() + 1,
                        },
                    );
                    if let Err(why) = backoff.wait(&self.inner.shutdown) {
                        break ReleaseState::Stopped {
                            error: match why {
                                Interrupted::Shutdown => {
                                    format!("the agent is stopping; last error: {msg}")
                                }
                                Interrupted::Deadline => {
                                    format!("gave up at the release deadline; last error: {msg}")
                                }
                            },
                        };
                    }
                }
            }
        };
        match &outcome {
            ReleaseState::Released => log::info!("allocation {alloc_id}: volume {alias} released"),
            other => {
                log::warn!("allocation {alloc_id}: release of volume {alias} stopped: {other:?}")
            }
        }
        let mut p = self.inner.progress.lock();
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
                    }
                }
            }
        }
        p.releases.insert(k, outcome);
        self.inner.progress_changed.notify_all();
    }

    /// One step down, under the volume's lock.
    fn release_step(&self, alloc_id: &str, alias: &str, deadline: Instant) -> Step {
        let Some(rec) = self.record(alloc_id, alias) else {
            return Step::Done;
        };
        let lock = self.inner.locks.get(&rec.volume_id);
        let _g = lock.lock();
        let Some(rec) = self.record(alloc_id, alias) else {
            return Step::Done;
        };
        let me = (alloc_id, alias);
        match rec.phase {
            Phase::Claiming => {
                // No CSI call was sent; the claim may or may not be held.
                self.advance_down(alloc_id, alias, |v| v.phase = Phase::ReleasingClaim)
            }
            Phase::ControllerPublishing | Phase::Staging => {
                // NodePublish was never sent: nothing to unpublish.
                self.advance_down(alloc_id, alias, |v| v.phase = next_down_after_unpublish(v))
            }
            Phase::Publishing | Phase::Published | Phase::Unpublishing => {
                if rec.phase != Phase::Unpublishing {
                    let mark = ClaimChange::MarkReleasing {
                        volume_id: &rec.volume_id,
                    };
                    if let Step::Retry(m, e) =
                        self.advance_claim(alloc_id, alias, mark, |v| v.phase = Phase::Unpublishing)
                    {
                        return Step::Retry(m, e);
                    }
                }
                let node = match self.plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline)
                {
                    Ok(n) => n,
                    Err(e) => return Step::Retry(e.to_string(), None),
                };
                let mut req = csi::NodeUnpublishVolumeRequest::new();
                req.volume_id = rec.external_volume_id.clone();
                req.target_path = path_string(&rec.target_path);
                failpoints::hit("before-node-unpublish");
                match node.client.node_unpublish_volume(&req) {
                    Ok(()) => {}
                    Err(e) if e.is_ignorable() => {}
                    Err(e) => return Step::Retry(crate::error_chain(&e), Some(e)),
                }
                failpoints::hit("after-node-unpublish");
                match crate::mounts::is_mount_point(&rec.target_path) {
                    Ok(false) => {}
                    Ok(true) => {
                        return Step::Retry(
                            format!(
                                "NodeUnpublishVolume succeeded but {} is still mounted",
                                rec.target_path.display()
                            ),
                            None,
                        )
                    }
                    Err(e) => {
                        return Step::Retry(
                            format!(
                                "cannot check that {} is unmounted: {e}",
                                rec.target_path.display()
                            ),
                            None,
                        )
                    }
                }
                // The plugin removes the target; the agent removes the
                // parents it created, when empty.
                let _ = std::fs::remove_dir(&rec.target_path);
                self.inner.paths.remove_empty_parents(&rec.target_path);
                self.advance_down(alloc_id, alias, |v| v.phase = next_down_after_unpublish(v))
            }
            Phase::Unstaging => {
                let staging = rec.staging_path.clone().unwrap_or_default();
                let others = self.inner.store.read(|s| s.staging_users(&staging, me));
                if others == 0 {
                    let node =
                        match self.plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline) {
                            Ok(n) => n,
                            Err(e) => return Step::Retry(e.to_string(), None),
                        };
                    let mut req = csi::NodeUnstageVolumeRequest::new();
                    req.volume_id = rec.external_volume_id.clone();
                    req.staging_target_path = path_string(&staging);
                    failpoints::hit("before-node-unstage");
                    match node.client.node_unstage_volume(&req) {
                        Ok(()) => {}
                        Err(e) if e.is_ignorable() => {}
                        Err(e) => return Step::Retry(crate::error_chain(&e), Some(e)),
                    }
                    failpoints::hit("after-node-unstage");
                    match crate::mounts::is_mount_point(&staging) {
                        Ok(false) => {}
                        Ok(true) => {
                            return Step::Retry(
                                format!(
                                    "NodeUnstageVolume succeeded but {} is still mounted",
                                    staging.display()
                                ),
                                None,
                            )
                        }
                        Err(e) => {
                            return Step::Retry(
                                format!(
                                    "cannot check that {} is unmounted: {e}",
                                    staging.display()
                                ),
                                None,
                            )
                        }
                    }
                    let _ = std::fs::remove_dir(&staging);
                    self.inner.paths.remove_empty_parents(&staging);
                }
                self.advance_down(alloc_id, alias, |v| {
                    v.holds_staging = false;
                    v.phase = next_down_after_unstage(v);
                })
            }
            Phase::ControllerUnpublishing => {
                let others = self
                    .inner
                    .store
                    .read(|s| s.attachment_users(&rec.volume_id, me).len());
                if others == 0 {
                    let c = match self.plugin_for_release(
                        &rec.plugin_id,
                        PluginKind::Controller,
                        deadline,
                    ) {
                        Ok(c) => c,
                        Err(e) => return Step::Retry(e.to_string(), None),
                    };
                    let mut req = csi::ControllerUnpublishVolumeRequest::new();
                    req.volume_id = rec.external_volume_id.clone();
                    // The recorded node ID, never a fresh lookup.
                    req.node_id = rec.external_node_id.clone().unwrap_or_default();
                    if let Some(spec) = self.spec(&rec.volume_id) {
                        req.secrets = spec
                            .secrets
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect();
                    }
                    failpoints::hit("before-controller-unpublish");
                    match c.client.controller_unpublish_volume(&req) {
                        Ok(()) => {}
                        Err(e) if e.is_ignorable() => {}
                        Err(e) => return Step::Retry(crate::error_chain(&e), Some(e)),
                    }
                    failpoints::hit("after-controller-unpublish");
                }
                self.advance_down(alloc_id, alias, |v| {
                    v.holds_attachment = false;
                    v.phase = Phase::ReleasingClaim;
                })
            }
            Phase::ReleasingClaim => self.finish_release(alloc_id, alias, &rec.volume_id),
        }
    }

    /// The last step down: free the claim, then drop the record (one write
    /// when the claim store lives in the state file).
    fn finish_release(&self, alloc_id: &str, alias: &str, volume_id: &str) -> Step {
        if self.inner.claims.in_state_file() {
            let r = self.inner.store.update(|s| -> Result<(), StateError> {
                claims::release_in_state(s, volume_id, alloc_id);
                drop_record(s, alloc_id, alias);
                Ok(())
            });
            return match r {
                Ok(()) => {
                    released_failpoints(true);
                    Step::Done
                }
                Err(e) => Step::Retry(crate::error_chain(&e), None),
            };
        }
        if let Err(e) = self.inner.claims.release(volume_id, alloc_id) {
            return Step::Retry(crate::error_chain(&e), None);
        }
        released_failpoints(false);
        let r = self.inner.store.update(|s| -> Result<(), StateError> {
            drop_record(s, alloc_id, alias);
            Ok(())
        });
        match r {
            Ok(()) => {
                release_record_dropped();
                Step::Done
            }
            Err(e) => Step::Retry(crate::error_chain(&e), None),
        }
    }

    /// Records the next phase down. With the claim store in the state file,
    /// a record that reaches `releasing-claim` is finished (claim freed,
    /// record dropped) in the same write.
    fn advance_down(&self, alloc_id: &str, alias: &str, f: impl FnOnce(&mut AllocVolume)) -> Step {
        if !self.inner.claims.in_state_file() {
            return self.advance(alloc_id, alias, f);
        }
        let r = self.inner.store.update(|s| -> Result<bool, StateError> {
            let Some(v) = s.volume_mut(alloc_id, alias) else {
                return Ok(false);
            };
            f(v);
            if v.phase != Phase::ReleasingClaim {
                return Ok(false);
            }
            let volume_id = v.volume_id.clone();
            claims::release_in_state(s, &volume_id, alloc_id);
            drop_record(s, alloc_id, alias);
            Ok(true)
        });
        match r {
            Ok(true) => {
                released_failpoints(true);
                Step::Done
            }
            Ok(false) => Step::Next,
            Err(e) => Step::Retry(crate::error_chain(&e), None),
        }
    }

    /// Records the next phase with a claim change: in the same write when
    /// the claim store lives in the state file, else through the store
    /// first (the claim change is idempotent, so a crash between the two
    /// only repeats it).
    fn advance_claim(
        &self,
        alloc_id: &str,
        alias: &str,
        change: ClaimChange<'_>,
        f: impl FnOnce(&mut AllocVolume),
    ) -> Step {
        if !self.inner.claims.in_state_file() {
            let r = match change {
                ClaimChange::Attach {
                    volume_id,
                    node_id,
                    publish_context,
                } => self.inner.claims.record_attachment(
                    volume_id,
                    alloc_id,
                    node_id,
                    publish_context,
                ),
                ClaimChange::MarkReleasing { volume_id } => {
                    self.inner.claims.mark_releasing(volume_id, alloc_id)
                }
            };
            if let Err(e) = r {
                return Step::Retry(crate::error_chain(&e), None);
            }
            return self.advance(alloc_id, alias, f);
        }
        let r = self.inner.store.update(|s| -> Result<(), StateError> {
            match change {
                ClaimChange::Attach {
                    volume_id,
                    node_id,
                    publish_context,
                } => claims::record_attachment_in_state(
                    s,
                    volume_id,
                    alloc_id,
                    node_id,
                    publish_context,
                ),
                ClaimChange::MarkReleasing { volume_id } => {
                    claims::mark_releasing_in_state(s, volume_id, alloc_id)
                }
            }
            if let Some(v) = s.volume_mut(alloc_id, alias) {
                f(v);
            }
            Ok(())
        });
        match r {
            Ok(()) => Step::Next,
            Err(e) => Step::Retry(crate::error_chain(&e), None),
        }
    }

    fn plugin_for_release(
        &self,
        plugin_id: &str,
        kind: PluginKind,
        deadline: Instant,
    ) -> Result<PluginSnapshot, WaitError> {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(RELEASE_PLUGIN_WAIT_SLICE);
        self.inner.registry.wait_for_plugin(plugin_id, kind, wait)
    }

    /// Waits until every volume of the allocation's latest release ended
    /// (released or stopped), up to `timeout`. True when all ended.
    pub fn wait_released(&self, alloc_id: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut p = self.inner.progress.lock();
        loop {
            if !p.active.iter().any(|(a, _)| a == alloc_id) {
                return true;
            }
            if self.inner.shutdown.is_triggered() {
                return false;
            }
            if self
                .inner
                .progress_changed
                .wait_until(&mut p, deadline)
                .timed_out()
            {
                return !p.active.iter().any(|(a, _)| a == alloc_id);
            }
        }
    }

    /// Release state of each volume of the allocation's latest release.
    pub fn release_status(&self, alloc_id: &str) -> BTreeMap<String, ReleaseState> {
        let p = self.inner.progress.lock();
        p.releases
            .iter()
            .filter(|((a, _), _)| a == alloc_id)
            .map(|((_, alias), st)| (alias.clone(), st.clone()))
            .collect()
    }

    // ---- status ---------------------------------------------------------

    pub fn alloc_status(&self, alloc_id: &str) -> Option<AllocStatus> {
        let rec = self.inner.store.read(|s| s.allocs.get(alloc_id).cloned());
        let mut releases = self.release_status(alloc_id);
        let p = self.inner.progress.lock();
        // A volume whose release finished has no record any more: only its
        // in-memory release report is left.
        let released = |alias: String, st: ReleaseState| VolumeStatus {
            alias,
            volume_id: String::new(),
            plugin_id: String::new(),
            phase: None,
            host_path: PathBuf::new(),
            read_only: false,
            attachment: AttachmentMode::FileSystem,
            release: Some(st),
            message: String::new(),
        };
        match rec {
            Some(a) => {
                let mut volumes: Vec<VolumeStatus> = a
                    .volumes
                    .values()
                    .map(|v| VolumeStatus {
                        alias: v.alias.clone(),
                        volume_id: v.volume_id.clone(),
                        plugin_id: v.plugin_id.clone(),
                        phase: Some(v.phase),
                        host_path: v.target_path.clone(),
                        read_only: v.usage.read_only,
                        attachment: v.usage.attachment,
                        release: releases.remove(&v.alias),
                        message: p
                            .messages
                            .get(&key(alloc_id, &v.alias))
                            .cloned()
                            .unwrap_or_default(),
                    })
                    .collect();
                volumes.extend(releases.into_iter().map(|(al, st)| released(al, st)));
                volumes.sort_by(|x, y| x.alias.cmp(&y.alias));
                Some(AllocStatus {
                    id: a.id.clone(),
                    releasing: a.releasing,
                    volumes,
                })
            }
            None if !releases.is_empty() => Some(AllocStatus {
                id: alloc_id.to_string(),
                releasing: true,
                volumes: releases
                    .into_iter()
                    .map(|(al, st)| released(al, st))
                    .collect(),
            }),
            None => None,
        }
    }

    pub fn list_allocs(&self) -> Vec<AllocStatus> {
        let ids: Vec<String> = self
            .inner
            .store
            .read(|s| s.allocs.keys().cloned().collect());
        ids.iter().filter_map(|id| self.alloc_status(id)).collect()
    }

    // ---- restore --------------------------------------------------------

    /// Brings every recorded allocation back to what was asked, before new
    /// requests are served: intact mounts cost nothing; vanished mounts are
    /// staged and published again under the claim still held; in-flight
    /// phases are finished; releases are resumed in the background.
    pub fn restore(&self) -> RestoreReport {
        failpoints::hit("restore-start");
        let mut report = RestoreReport::default();
        let table = match MountTable::read() {
            Ok(t) => t,
            Err(e) => {
                report
                    .errors
                    .push(format!("cannot read {}: {e}", crate::mounts::MOUNTINFO));
                return report;
            }
        };
        let rebooted = self.inner.store.rebooted();
        if rebooted {
            log::info!(
                "the node rebooted since the state was written: every recorded mount is redone"
            );
        }
        let snapshot = self.inner.store.snapshot();
        let mut to_mount: Vec<String> = Vec::new();
        let mut to_release: Vec<String> = Vec::new();
        let mut remount: Vec<(String, String)> = Vec::new();
        // Cut off in `publishing` before a reboot: the staging is gone too.
        let mut restage: Vec<(String, String)> = Vec::new();
        for a in snapshot.allocs.values() {
            if a.releasing || a.volumes.values().any(|v| v.phase.is_teardown()) {
                to_release.push(a.id.clone());
                continue;
            }
            let mut needs = false;
            for v in a.volumes.values() {
                if v.phase == Phase::Published {
                    if !rebooted && table.is_mount_point(&v.target_path) {
                        report.intact += 1;
                        continue;
                    }
                    remount.push((a.id.clone(), v.alias.clone()));
                } else if rebooted && v.phase == Phase::Publishing && v.holds_staging {
                    restage.push((a.id.clone(), v.alias.clone()));
                }
                needs = true;
            }
            if needs {
                to_mount.push(a.id.clone());
            }
        }
        // Published but gone: back to the first node step, in one write.
        let r = self
            .inner
            .store
            .update(|s: &mut StateFile| -> Result<(), StateError> {
                for (alloc, alias) in remount.iter().chain(&restage) {
                    if let Some(v) = s.volume_mut(alloc, alias) {
                        v.phase = if v.holds_staging {
                            Phase::Staging
                        } else {
                            Phase::Publishing
                        };
                    }
                }
                s.boot_id = self.inner.store.boot_id().to_string();
                Ok(())
            });
        if let Err(e) = r {
            report.errors.push(crate::error_chain(&e));
            return report;
        }
        report.remounted = remount.len();
        for id in &to_release {
            // A teardown phase without the flag (should not happen) still
            // means the release must go on.
            let _ = self.inner.store.update(|s| -> Result<(), StateError> {
                if let Some(a) = s.alloc_mut(id) {
                    a.releasing = true;
                }
                Ok(())
            });
            match self.release(id) {
                Ok(_) => report.releases_resumed += 1,
                Err(e) => report
                    .errors
                    .push(format!("{id}: {}", crate::error_chain(&e))),
            }
        }
        // Finish mounts on one worker per allocation. Requests are served
        // only after they finished or `restore_wait` passed, whichever comes
        // first: a mount that waits out a held claim (or a plugin that does
        // not come back) goes on in the background, so it cannot keep the
        // API, and with it the release that would free the claim, away.
        let (tx, rx) = crossbeam_channel::unbounded::<(String, Result<(), MountError>)>();
        let mut started = 0;
        for id in &to_mount {
            let guard = match self.begin_mount(id) {
                Ok(g) => g,
                Err(e) => {
                    report
                        .errors
                        .push(format!("{id}: {}", crate::error_chain(&e)));
                    continue;
                }
            };
            let m = self.clone();
            let (id2, tx) = (id.clone(), tx.clone());
            let spawned = match self.inner.workers.lock().as_mut() {
                Some(t) => t.spawn(format!("restore-{id}"), move || {
                    let r = m.restore_alloc(&id2, guard);
                    if let Err(e) = &r {
                        log::error!(
                            "restore of allocation {id2}: {}; mount it again to retry",
                            crate::error_chain(e)
                        );
                    }
                    let _ = tx.send((id2, r));
                }),
                None => Ok(()),
            };
            match spawned {
                Ok(()) => started += 1,
                Err(e) => report
                    .errors
                    .push(format!("{id}: restore worker could not start: {e}")),
            }
        }
        drop(tx);
        let deadline = Instant::now() + self.inner.opts.restore_wait;
        for _ in 0..started {
            match rx.recv_deadline(deadline) {
                Ok((_, Ok(()))) => report.mounts_finished += 1,
                Ok((id, Err(e))) => report
                    .errors
                    .push(format!("{id}: {}", crate::error_chain(&e))),
                Err(_) => break,
            }
        }
        report.in_background = started - report.mounts_finished - report.errors.len().min(started);
        log::info!(
            "restore: {} intact, {} remounted, {} allocation mount(s) finished, {} still running, {} release(s) resumed, {} error(s)",
            report.intact,
            report.remounted,
            report.mounts_finished,
            report.in_background,
            report.releases_resumed,
            report.errors.len()
        );
        report
    }

    fn restore_alloc(&self, alloc_id: &str, _guard: MountGuard) -> Result<(), MountError> {
        let aliases: Vec<String> = self.inner.store.read(|s| {
            s.allocs
                .get(alloc_id)
                .map(|a| a.volumes.keys().cloned().collect())
                .unwrap_or_default()
        });
        let deadline = Instant::now() + self.inner.opts.mount_retry_deadline;
        for alias in aliases {
            self.mount_volume(alloc_id, &alias, deadline)?;
        }
        Ok(())
    }

    /// Stops taking work and joins the release workers up to `deadline`;
    /// returns the names of workers still running.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        let workers = self.inner.workers.lock().take();
        workers.map(|w| w.join_until(deadline)).unwrap_or_default()
    }
}

struct MountGuard {
    manager: Manager,
    alloc_id: String,
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let mut p = self.manager.inner.progress.lock();
        p.mounting.remove(&self.alloc_id);
        self.manager.inner.progress_changed.notify_all();
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Published volumes found still mounted: no call made.
    pub intact: usize,
    /// Published volumes whose mount was gone and were redone.
    pub remounted: usize,
    pub mounts_finished: usize,
    /// Allocation mounts still being finished when the restore returned
    /// (waiting for a held claim or a slow plugin).
    pub in_background: usize,
    pub releases_resumed: usize,
    pub errors: Vec<String>,
}

#[derive(Debug)]
pub enum ReleaseError {
    Invalid(SpecError),
    State(StateError),
    Spawn(std::io::Error),
    Stopping,
}

impl fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseError::Invalid(e) => e.fmt(f),
            ReleaseError::State(_) => write!(f, "the release could not be recorded"),
            ReleaseError::Spawn(_) => write!(f, "a release worker could not be started"),
            ReleaseError::Stopping => write!(f, "the agent is stopping"),
        }
    }
}

impl std::error::Error for ReleaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReleaseError::State(e) => Some(e),
            ReleaseError::Spawn(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for ReleaseError {
    fn from(e: StateError) -> Self {
        ReleaseError::State(e)
    }
}

#[derive(Debug)]
pub enum VolumeRegistryError {
    Invalid(SpecError),
    InUse { volume_id: String, holder: String },
    State(StateError),
}

impl fmt::Display for VolumeRegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeRegistryError::Invalid(e) => e.fmt(f),
            VolumeRegistryError::InUse { volume_id, holder } => write!(
                f,
                "volume {volume_id} is in use by allocation {holder}; release it first"
            ),
            VolumeRegistryError::State(_) => write!(f, "the volume registry could not be saved"),
        }
    }
}

impl std::error::Error for VolumeRegistryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VolumeRegistryError::State(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StateError> for VolumeRegistryError {
    fn from(e: StateError) -> Self {
        VolumeRegistryError::State(e)
    }
}

/// A claim change that belongs to a lifecycle step.
enum ClaimChange<'a> {
    Attach {
        volume_id: &'a str,
        node_id: &'a str,
        publish_context: &'a BTreeMap<String, String>,
    },
    MarkReleasing {
        volume_id: &'a str,
    },
}

/// Drops one volume record, and the allocation with its last one.
fn drop_record(s: &mut StateFile, alloc_id: &str, alias: &str) {
    if let Some(a) = s.alloc_mut(alloc_id) {
        a.volumes.remove(alias);
        if a.volumes.is_empty() {
            s.allocs.remove(alloc_id);
        }
    }
}

/// The failpoints at the end of a release: the claim is freed (and, when
/// `dropped`, the record is gone in the same write).
fn released_failpoints(dropped: bool) {
    failpoints::hit("release-after-claim-freed");
    if dropped {
        release_record_dropped();
    }
}

fn release_record_dropped() {
    failpoints::hit("release-after-record-dropped");
}

/// Which calls a volume needs, decided once its plugins are known.
struct Plan {
    stage: bool,
    controller: bool,
    /// The node plugin's node ID: the external node ID of the attachment.
    node_id: String,
}

impl Plan {
    fn new(node: &PluginSnapshot, controller: bool) -> Plan {
        Plan {
            stage: node
                .node_capabilities
                .as_ref()
                .is_some_and(|c| c.stage_unstage_volume),
            controller,
            node_id: node.node_id().unwrap_or_default().to_string(),
        }
    }

    /// Moves a record from `claiming` to its first in-flight phase, setting
    /// the holds-flags before the call they stand for is sent.
    fn enter(&self, v: &mut AllocVolume, paths: &Paths) {
        if v.phase != Phase::Claiming {
            return;
        }
        v.staging_path = self
            .stage
            .then(|| paths.staging(&v.plugin_id, &v.volume_id, &v.usage));
        if self.controller {
            v.external_node_id = Some(self.node_id.clone());
            v.holds_attachment = true;
            v.phase = Phase::ControllerPublishing;
        } else if self.stage {
            v.holds_staging = true;
            v.phase = Phase::Staging;
        } else {
            v.phase = Phase::Publishing;
        }
    }
}

/// Phases in which another record's controller attachment is known done.
fn attachment_established(p: Phase) -> bool {
    matches!(
        p,
        Phase::Staging
            | Phase::Publishing
            | Phase::Published
            | Phase::Unpublishing
            | Phase::Unstaging
    )
}

/// Phases in which another record's staging is known done.
fn staging_established(p: Phase) -> bool {
    matches!(
        p,
        Phase::Publishing | Phase::Published | Phase::Unpublishing
    )
}

fn next_down_after_unpublish(v: &AllocVolume) -> Phase {
    if v.holds_staging {
        Phase::Unstaging
    } else {
        next_down_after_unstage(v)
    }
}

fn next_down_after_unstage(v: &AllocVolume) -> Phase {
    if v.holds_attachment {
        Phase::ControllerUnpublishing
    } else {
        Phase::ReleasingClaim
    }
}

fn classify_up(alias: &str, e: CsiError) -> Step {
    if e.is_retryable() {
        Step::Retry(crate::error_chain(&e), Some(e))
    } else {
        Step::Fail(MountError::Csi {
            alias: alias.to_string(),
            source: e,
        })
    }
}

fn create_dir(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("cannot create {}: {e}", path.display()))
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// What NodeStage, NodePublish and ControllerPublish all carry for a volume.
struct RequestFields {
    volume_id: String,
    capability: protobuf::MessageField<csi::VolumeCapability>,
    secrets: std::collections::HashMap<String, String>,
    volume_context: std::collections::HashMap<String, String>,
    publish_context: std::collections::HashMap<String, String>,
    staging_target_path: String,
}

fn request_fields(rec: &AllocVolume, spec: &VolumeSpec) -> RequestFields {
    RequestFields {
        volume_id: rec.external_volume_id.clone(),
        capability: protobuf::MessageField::some(volume_capability(
            &rec.usage,
            &spec.mount_options,
            &rec.mount_flags,
        )),
        secrets: spec.secrets.clone().into_iter().collect(),
        volume_context: spec.context.clone().into_iter().collect(),
        publish_context: rec.publish_context.clone().into_iter().collect(),
        staging_target_path: rec
            .staging_path
            .as_deref()
            .map(path_string)
            .unwrap_or_default(),
    }
}

fn controller_publish_request(
    rec: &AllocVolume,
    spec: &VolumeSpec,
    controller: &PluginSnapshot,
) -> csi::ControllerPublishVolumeRequest {
    let f = request_fields(rec, spec);
    csi::ControllerPublishVolumeRequest {
        volume_id: f.volume_id,
        node_id: rec.external_node_id.clone().unwrap_or_default(),
        volume_capability: f.capability,
        // Only a controller with PUBLISH_READONLY may be asked for it.
        readonly: rec.usage.read_only
            && controller
                .controller_capabilities
                .as_ref()
                .is_some_and(|c| c.publish_readonly),
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}

fn node_stage_request(rec: &AllocVolume, spec: &VolumeSpec) -> csi::NodeStageVolumeRequest {
    let f = request_fields(rec, spec);
    csi::NodeStageVolumeRequest {
        volume_id: f.volume_id,
        publish_context: f.publish_context,
        staging_target_path: f.staging_target_path,
        volume_capability: f.capability,
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}

fn node_publish_request(rec: &AllocVolume, spec: &VolumeSpec) -> csi::NodePublishVolumeRequest {
    let f = request_fields(rec, spec);
    csi::NodePublishVolumeRequest {
        volume_id: f.volume_id,
        publish_context: f.publish_context,
        staging_target_path: f.staging_target_path,
        target_path: path_string(&rec.target_path),
        volume_capability: f.capability,
        readonly: rec.usage.read_only,
        secrets: f.secrets,
        volume_context: f.volume_context,
        ..Default::default()
    }
}
