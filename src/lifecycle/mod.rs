//! The allocation lifecycle: mount, release and restore, behind a small
//! facade ([`Lifecycle`]) that the API calls.
//!
//! Every step of a volume runs under that volume's operation lock (one
//! operation in flight per volume; unrelated volumes proceed in parallel),
//! re-reads the record, decides, makes its in-flight phase durable, and only
//! then sends the CSI call. Claim changes go through the claim store's
//! transactions together with the record change they belong to. No lock of
//! the state is held across a call; backoff waits happen outside the
//! operation lock.
//!
//! Files: `mount`, `release`, `restore` (each reads top-down like the steps
//! it does); `up` and `down` (the calls up and down of one volume), `plan`
//! (which calls a volume's mount needs), `placement` (topology and mount
//! group, before a claim); `core` (what they share), `progress`
//! (in-memory progress), `references` (the count of a front end's mounts
//! of an allocation), `status` (what `alloc status` shows), `error`;
//! `volume_ops`, `controller_ops` and `snapshots` (volume operations
//! through the controller plugin, here or on a controller host).

mod controller_ops;
mod core;
mod down;
mod error;
mod mount;
mod placement;
mod plan;
mod progress;
mod references;
mod release;
mod restore;
mod snapshots;
mod status;
mod up;
mod volume_ops;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::core::Core;
pub use self::core::{LifecycleOptions, CLAIM_BACKOFF, CSI_BACKOFF};
pub use error::{
    FreeClaimError, MountError, NodeDetachError, NodeRemoveError, ReleaseError, StepError,
    VolumeOpError, VolumeRegistryError,
};
pub use mount::{MountedVolume, ROLLBACK_WAIT};
pub use progress::ReleaseState;
pub use release::ReleaseStart;
pub use restore::{RestoreProgress, RestoreReport};
pub use snapshots::SnapshotView;
pub use status::{AllocStatus, VolumeStatus};
pub use volume_ops::Expansion;

use crate::claims::{
    Claim, ClaimFilter, ClaimState, ClaimStore, ControllerHostRecord, Listing, NodeDetach,
};
use crate::plugins::Registry;
use crate::shutdown::Shutdown;
use crate::state::{StateError, StateStore};
use crate::threads::Threads;
use crate::volumes::lock::OperationLocks;
use crate::volumes::{Paths, SpecError, VolumeCreate, VolumeRequest, VolumeSpec};

/// The allocation lifecycle. Cheap to clone.
#[derive(Clone)]
pub struct Lifecycle {
    core: Arc<Core>,
}

impl Lifecycle {
    pub fn new(
        store: Arc<StateStore>,
        claims: Arc<dyn ClaimStore>,
        registry: Registry,
        opts: LifecycleOptions,
        shutdown: Shutdown,
    ) -> Lifecycle {
        let core = Arc::new(Core {
            store,
            claims,
            registry,
            paths: Paths::new(&opts.mount_root),
            opts,
            shutdown: shutdown.clone(),
            locks: Arc::new(OperationLocks::new()),
            progress: Default::default(),
            workers: Mutex::new(Some(Threads::new())),
        });
        let (store, stop) = (core.store.clone(), shutdown.clone());
        // Busy: an operation holds (or waits for) a volume's lock.
        let locks = core.locks.clone();
        let busy = move || !locks.is_empty();
        // Operations in flight: volumes whose lock is held or waited for.
        // Many of them: a durable write waits a little for company.
        let locks = core.locks.clone();
        core.store.set_company(move || locks.len());
        let flusher = core.spawn("state-flush".to_string(), move || {
            self::core::write_closings(&store, &stop, busy)
        });
        if let Err(e) = flusher {
            // Closing changes then ride with the next write of any change
            // (and the stop's compaction writes what is left).
            log::error!("the state flusher did not start: {e:?}");
        }
        let weak = Arc::downgrade(&core);
        shutdown.on_trigger(move || {
            if let Some(core) = weak.upgrade() {
                core.progress.wake_all();
                core.store.wake_flusher();
            }
        });
        Lifecycle { core }
    }

    pub fn store(&self) -> &Arc<StateStore> {
        &self.core.store
    }

    pub fn claims(&self) -> &Arc<dyn ClaimStore> {
        &self.core.claims
    }

    /// The claims the filter asks for (every one, or one volume's, read
    /// alone) and a line per stored value among them that is not a claim,
    /// or why the claim store cannot tell now.
    pub fn list_claims(
        &self,
        filter: ClaimFilter<'_>,
    ) -> Result<Listing, crate::claims::ClaimError> {
        self.core.claims.list_claims(filter)
    }

    /// The states of the claims this node holds: the store's own on one
    /// node; in a cluster, counted from this node's records (a record past
    /// its take holds its claim), so that asking costs the cluster store
    /// nothing (a metrics scrape would otherwise read every claim of the
    /// cluster, on every node). A claim this run marked node-detached
    /// counts as such.
    pub fn claim_states_here(&self) -> Vec<ClaimState> {
        if let Some(states) = self.core.claims.local_claim_states() {
            return states;
        }
        let detached = self.core.progress.node_detached();
        self.core.store.read(|s| {
            s.alloc_volumes()
                .filter(|(_, v)| v.phase != crate::state::Phase::Claiming)
                .map(|(a, v)| {
                    if detached.contains(&(a.id.clone(), v.alias.clone())) {
                        ClaimState::NodeDetached
                    } else if a.releasing || v.phase.is_teardown() {
                        ClaimState::Releasing
                    } else {
                        ClaimState::Taken
                    }
                })
                .collect()
        })
    }

    /// Frees a claim by hand (`claimd claim free`): a claim left behind by
    /// an allocation that no agent will release. Refused when an
    /// allocation on this node records it (release it instead), and while
    /// the holder's node is alive unless `force`. The reason is logged (and
    /// kept in the cluster store).
    pub fn free_claim(
        &self,
        volume_id: &str,
        alloc_id: &str,
        reason: &str,
        force: bool,
    ) -> Result<Claim, FreeClaimError> {
        if reason.trim().is_empty() {
            return Err(FreeClaimError::NoReason);
        }
        let claims = self
            .core
            .claims
            .list_claims(ClaimFilter::volume(volume_id))
            .map_err(FreeClaimError::Store)?
            .claims;
        let claim = claims
            .into_iter()
            .find(|c| c.volume_id == volume_id && c.alloc_id == alloc_id)
            .ok_or_else(|| FreeClaimError::NotHeld {
                volume_id: volume_id.to_string(),
                alloc_id: alloc_id.to_string(),
            })?;
        let recorded = |s: &crate::state::StateFile| {
            s.allocs
                .get(alloc_id)
                .is_some_and(|a| a.volumes.values().any(|v| v.volume_id == volume_id))
        };
        let here = claim.node == self.core.opts.node_name;
        if here && self.core.store.read(recorded) {
            return Err(FreeClaimError::RecordedHere {
                alloc_id: alloc_id.to_string(),
            });
        }
        if !here && !force {
            let alive = self
                .core
                .claims
                .node_alive(&claim.node)
                .map_err(FreeClaimError::Store)?;
            if alive != Some(false) {
                return Err(FreeClaimError::HolderAlive {
                    node: claim.node.clone(),
                });
            }
        }
        // Another node's claim, not forced: only while that node is still
        // gone when the claim goes (it may come back after the check above).
        let while_gone = !here && !force;
        // The note of why goes in the same write as the free.
        let free = crate::claims::ClaimChange::Free {
            volume_id: volume_id.to_string(),
            alloc_id: alloc_id.to_string(),
            holder: None,
            while_gone,
            by_hand: Some(Box::new(crate::claims::ByHand {
                claim: claim.clone(),
                reason: reason.to_string(),
                by: self.core.opts.node_name.clone(),
            })),
        };
        // This node's own claim: looked at again once the claim store has
        // marked the free (a mount of the allocation that recorded it
        // meanwhile keeps it; one still taking it refuses the free).
        // Decided at the first look: the write after the free records
        // nothing, so a mount recorded after the free does not undo it.
        let first = std::cell::OnceCell::new();
        let applied = self
            .core
            .transact(
                vec![free],
                &|s| *first.get_or_init(|| !(here && recorded(s))),
                &mut |_, _| {},
            )
            .map_err(FreeClaimError::State)?;
        if matches!(applied, crate::claims::Applied::NotWanted) {
            return Err(FreeClaimError::RecordedHere {
                alloc_id: alloc_id.to_string(),
            });
        }
        applied.single().map_err(|e| match e {
            crate::claims::ClaimError::Impossible { .. } if while_gone => {
                FreeClaimError::HolderAlive {
                    node: claim.node.clone(),
                }
            }
            e => FreeClaimError::Store(e),
        })?;
        log::warn!(
            "claim of volume {volume_id} by allocation {alloc_id} on node {} freed by hand{}: {reason}",
            claim.node,
            if force { " (forced)" } else { "" }
        );
        Ok(claim)
    }

    /// Cluster mode: every controller host of the cluster with whether its
    /// node is alive; None on one node.
    pub fn controller_hosts(
        &self,
    ) -> Option<Result<Vec<(ControllerHostRecord, bool)>, crate::claims::ClaimError>> {
        self.core.claims.remote_controllers().map(|r| r.hosts())
    }

    /// Cluster mode (`claimd volume detach VOLUME --node NODE`): detaches
    /// the volume from a node that is gone for good, through a controller
    /// host, and frees that node's claims of it with the reason. Refused
    /// while the node is alive, and for this agent's own node.
    pub fn detach_from_node(
        &self,
        volume_id: &str,
        node: &str,
        reason: &str,
    ) -> Result<NodeDetach, NodeDetachError> {
        if reason.trim().is_empty() {
            return Err(NodeDetachError::NoReason);
        }
        for (what, id) in [("volume", volume_id), ("node", node)] {
            crate::ids::check_id(what, id).map_err(|e| NodeDetachError::Invalid(e.to_string()))?;
        }
        let remote = self
            .core
            .claims
            .remote_controllers()
            .ok_or(NodeDetachError::NotCluster)?;
        let me = &self.core.opts.node_name;
        if node == me {
            return Err(NodeDetachError::ThisNode {
                node: node.to_string(),
            });
        }
        let alive = self
            .core
            .claims
            .node_alive(node)
            .map_err(NodeDetachError::Store)?;
        if alive != Some(false) {
            return Err(NodeDetachError::NodeAlive {
                node: node.to_string(),
            });
        }
        log::warn!("volume {volume_id}: detaching from node {node} by hand: {reason}");
        remote
            .release_node_volume(
                volume_id,
                node,
                reason,
                me,
                crate::claims::fencing::FreeRule::Operator,
                self.core.opts.attach_timeout,
                &self.core.shutdown,
            )
            .map_err(NodeDetachError::Attach)
    }

    /// Cluster mode: forgets a node gone for good (`claimd node remove`);
    /// the keys removed.
    pub fn remove_node(&self, node: &str) -> Result<Vec<String>, NodeRemoveError> {
        crate::ids::check_id("node", node).map_err(|e| NodeRemoveError::Invalid(e.to_string()))?;
        let remote = self
            .core
            .claims
            .remote_controllers()
            .ok_or(NodeRemoveError::NotCluster)?;
        if node == self.core.opts.node_name {
            return Err(NodeRemoveError::ThisNode {
                node: node.to_string(),
            });
        }
        remote.remove_node(node).map_err(NodeRemoveError::Remove)
    }

    /// Cluster mode: whether `node`'s liveness key exists; None on one node.
    pub fn node_alive(&self, node: &str) -> Result<Option<bool>, crate::claims::ClaimError> {
        self.core.claims.node_alive(node)
    }

    pub fn registry(&self) -> &Registry {
        &self.core.registry
    }

    pub fn paths(&self) -> &Paths {
        &self.core.paths
    }

    /// Volumes with an operation in flight or waiting (their locks).
    pub fn operations_in_flight(&self) -> usize {
        self.core.locks.len()
    }

    // ---- volumes --------------------------------------------------------

    /// Registers (or replaces, while unclaimed) a volume. Answers with
    /// warnings for the operator (its plugin is not known on this node).
    pub fn register_volume(&self, spec: VolumeSpec) -> Result<Vec<String>, VolumeRegistryError> {
        spec.validate().map_err(VolumeRegistryError::Invalid)?;
        let shared = self.core.claims.shared_volumes();
        let changed = match shared {
            Some(r) => r
                .get(&spec.id)
                .map_err(VolumeRegistryError::Claims)?
                .is_some_and(|old| old != spec),
            None => self
                .core
                .store
                .read(|s| s.volumes.get(&spec.id).is_some_and(|old| **old != spec)),
        };
        if changed {
            self.refuse_if_claimed(&spec.id)?;
        }
        if let Some(r) = shared {
            r.register(&spec).map_err(VolumeRegistryError::Claims)?;
        }
        let mut warnings = Vec::new();
        if !self.core.registry.knows(&spec.plugin_id) {
            warnings.push(format!(
                "plugin {} is neither configured nor in the plugin directory of this agent: mounts of volume {} fail until it is",
                spec.plugin_id, spec.id
            ));
        }
        self.core
            .store
            .update(|s| -> Result<(), VolumeRegistryError> {
                // A record here still using other storage (its claim freed
                // by hand) keeps the copy its calls down need; the next
                // mount brings it up to date once the record is gone.
                let still_used = s.records_of_volume(&spec.id).iter().any(|(_, v)| {
                    v.plugin_id != spec.plugin_id || v.external_volume_id != spec.external_id
                });
                if !still_used {
                    s.volumes.insert(spec.id.clone(), Arc::new(spec));
                }
                Ok(())
            })?;
        Ok(warnings)
    }

    /// The node plugin's health, as `volume list` shows it.
    pub fn plugin_health(&self, plugin_id: &str) -> String {
        self.core.registry.node_health(plugin_id)
    }

    /// Deregisters a volume no allocation uses.
    pub fn deregister_volume(&self, id: &str) -> Result<bool, VolumeRegistryError> {
        crate::ids::check_id("volume", id)
            .map_err(|e| VolumeRegistryError::Invalid(SpecError::Id(e)))?;
        self.refuse_if_claimed(id)?;
        let in_use = self.core.store.read(|s| {
            s.alloc_volumes()
                .find(|(_, v)| v.volume_id == id)
                .map(|(a, _)| a.id.clone())
        });
        if let Some(holder) = in_use {
            return Err(VolumeRegistryError::InUse {
                volume_id: id.to_string(),
                holder,
            });
        }
        let shared_found = match self.core.claims.shared_volumes() {
            Some(r) => r.delete(id).map_err(VolumeRegistryError::Claims)?,
            None => false,
        };
        let local_found = self.core.store.update(|s| {
            if let Some((a, _)) = s.alloc_volumes().find(|(_, v)| v.volume_id == id) {
                return Err(VolumeRegistryError::InUse {
                    volume_id: id.to_string(),
                    holder: a.id.clone(),
                });
            }
            Ok(s.volumes.remove(id).is_some())
        })?;
        Ok(shared_found || local_found)
    }

    fn refuse_if_claimed(&self, id: &str) -> Result<(), VolumeRegistryError> {
        let claims = self
            .core
            .claims
            .list_claims(ClaimFilter::volume(id))
            .map_err(VolumeRegistryError::Claims)?
            .claims;
        match claims.into_iter().next() {
            Some(c) => Err(VolumeRegistryError::InUse {
                volume_id: id.to_string(),
                holder: c.alloc_id,
            }),
            None => Ok(()),
        }
    }

    /// The registered volumes (in cluster mode: the cluster's).
    pub fn list_volumes(&self) -> Result<Vec<VolumeSpec>, VolumeRegistryError> {
        match self.core.claims.shared_volumes() {
            Some(r) => r.list().map_err(VolumeRegistryError::Claims),
            None => Ok(self
                .core
                .store
                .read(|s| s.volumes.values().map(|v| (**v).clone()).collect())),
        }
    }

    // ---- volume operations through the controller -----------------------

    /// CreateVolume, then registration of the plugin's answer (external
    /// ID, context, topology, capacity). Answers the registered spec and
    /// warnings for the operator. The same request again answers the same
    /// volume.
    pub fn create_volume(
        &self,
        req: &VolumeCreate,
    ) -> Result<(VolumeSpec, Vec<String>), VolumeOpError> {
        let spec = volume_ops::create(&self.core, req)?;
        let warnings = self.register_volume(spec.clone())?;
        Ok((spec, warnings))
    }

    /// DeleteVolume of a volume no allocation claims or uses, then its
    /// deregistration.
    pub fn delete_volume(&self, id: &str) -> Result<(), VolumeOpError> {
        let unused = || -> Result<(), VolumeOpError> {
            self.refuse_if_claimed(id)?;
            let holder = self.core.store.read(|s| {
                s.alloc_volumes()
                    .find(|(_, v)| v.volume_id == id)
                    .map(|(a, _)| a.id.clone())
            });
            match holder {
                Some(holder) => Err(VolumeRegistryError::InUse {
                    volume_id: id.to_string(),
                    holder,
                }
                .into()),
                None => Ok(()),
            }
        };
        volume_ops::delete(&self.core, id, &unused)?;
        self.deregister_volume(id)?;
        Ok(())
    }

    /// ControllerExpandVolume to `size` bytes, the new capacity recorded,
    /// then NodeExpandVolume where this node has the volume mounted.
    pub fn expand_volume(&self, id: &str, size: i64) -> Result<Expansion, VolumeOpError> {
        volume_ops::expand(&self.core, id, size)
    }

    pub fn create_snapshot(
        &self,
        volume_id: &str,
        name: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<SnapshotView, VolumeOpError> {
        snapshots::create(&self.core, volume_id, name, parameters)
    }

    pub fn list_snapshots(
        &self,
        volume_id: Option<&str>,
    ) -> Result<Vec<SnapshotView>, VolumeOpError> {
        snapshots::list(&self.core, volume_id)
    }

    /// Deletes a snapshot; answers the plugin that had it.
    pub fn delete_snapshot(
        &self,
        snapshot_id: &str,
        plugin_id: Option<&str>,
    ) -> Result<String, VolumeOpError> {
        snapshots::delete(&self.core, snapshot_id, plugin_id)
    }

    // ---- allocations ----------------------------------------------------

    /// Mounts every requested volume for `alloc_id`; see `mount::mount`.
    pub fn mount(
        &self,
        alloc_id: &str,
        reqs: &[VolumeRequest],
    ) -> Result<Vec<MountedVolume>, MountError> {
        mount::mount(&self.core, alloc_id, reqs)
    }

    /// The host paths of a mounted allocation.
    pub fn mounted(&self, alloc_id: &str) -> Vec<MountedVolume> {
        mount::mounted(&self.core, alloc_id)
    }

    /// Publishes again every published volume of `alloc_id` whose target
    /// has nothing mounted (a front end's second Mount, before it counts
    /// one more reference); never rolls the allocation back.
    pub fn republish_empty(&self, alloc_id: &str) -> Result<(), MountError> {
        mount::republish_empty(&self.core, alloc_id)
    }

    /// One more reference to a mounted allocation (a front end's second
    /// Mount of it), durable when this returns; the new count. None: not
    /// recorded, not mounted yet or being released (nothing written): mount
    /// it. See `references`.
    pub fn add_reference(&self, alloc_id: &str) -> Result<Option<u32>, StateError> {
        references::add(&self.core, alloc_id)
    }

    /// One reference fewer (a front end's Unmount), durable when this
    /// returns; the count left. None: it was the last one (nothing
    /// written): release the allocation, which drops every reference.
    pub fn drop_reference(&self, alloc_id: &str) -> Result<Option<u32>, StateError> {
        references::drop_one(&self.core, alloc_id)
    }

    /// A front end's Mount that mounted the allocation is answered: it
    /// counts at least one reference (durable when this returns).
    pub fn hold_reference(&self, alloc_id: &str) -> Result<(), StateError> {
        references::hold(&self.core, alloc_id)
    }

    /// After a reboot: the allocations whose IDs start with `prefix` count
    /// no reference (their mounts are restored all the same); how many
    /// changed.
    pub fn clear_references(&self, prefix: &str) -> Result<usize, StateError> {
        references::clear(&self.core, prefix)
    }

    /// The allocation's recorded reference count.
    pub fn references(&self, alloc_id: &str) -> Option<u32> {
        references::count(&self.core, alloc_id)
    }

    /// Starts releasing every volume of `alloc_id`, one worker per volume.
    pub fn release(&self, alloc_id: &str) -> Result<ReleaseStart, ReleaseError> {
        release::release(&self.core, alloc_id)
    }

    /// Waits until every volume of the allocation's latest release ended
    /// (released or stopped), up to `timeout`. True when all ended.
    pub fn wait_released(&self, alloc_id: &str, timeout: Duration) -> bool {
        let shutdown = &self.core.shutdown;
        self.core
            .progress
            .wait_released(alloc_id, timeout, || shutdown.is_triggered())
    }

    /// Release state of each volume of the allocation's latest release.
    pub fn release_status(&self, alloc_id: &str) -> BTreeMap<String, ReleaseState> {
        self.core.progress.releases(alloc_id)
    }

    /// Every release report kept, in order: (allocation, alias, state).
    pub fn release_reports(&self) -> Vec<(String, String, ReleaseState)> {
        self.core.progress.all_releases()
    }

    pub fn alloc_status(&self, alloc_id: &str) -> Option<AllocStatus> {
        status::alloc_status(&self.core, alloc_id)
    }

    pub fn list_allocs(&self) -> Vec<AllocStatus> {
        status::list_allocs(&self.core)
    }

    /// Brings every recorded allocation back to what was asked; see
    /// `restore::restore`.
    pub fn restore(&self) -> RestoreReport {
        restore::restore(&self.core, &|_| {})
    }

    /// The same, telling `progress` how far it got (for systemd's STATUS).
    pub fn restore_with(&self, progress: &dyn Fn(RestoreProgress)) -> RestoreReport {
        restore::restore(&self.core, progress)
    }

    /// Stops taking work and joins the worker threads up to `deadline`;
    /// returns the names of workers still running.
    pub fn join(&self, deadline: Instant) -> Vec<String> {
        let workers = self.core.workers.lock().take();
        workers.map(|w| w.join_until(deadline)).unwrap_or_default()
    }
}
