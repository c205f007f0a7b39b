//! Each request of the protocol as calls of the [`Lifecycle`] facade, the
//! same calls the local API makes. The answer is JSON, or an error whose
//! message the engine shows its user.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{json, Value};

use super::options::{self, Definition, OptionError};
use super::protocol::{self as p, Endpoint};
use super::references::Turns;
use super::view::{Known, View};
use crate::config::docker::{
    ENGINE_ANSWER_MARGIN, ENGINE_MOUNT_LIMIT, ENGINE_REQUEST_LIMIT, MOUNT_GIVE_UP_WAIT,
};
use crate::lifecycle::{
    Lifecycle, MountError, ReleaseError, ReleaseStart, VolumeOpError, VolumeRegistryError,
};
use crate::state::{Phase, StateError};
use crate::threads::Threads;
use crate::volumes::{VolumeRequest, VolumeSpec};

/// Every allocation of a Docker or Podman mount starts with this (the local
/// API refuses it).
pub const ALLOC_PREFIX: &str = crate::ids::ENGINE_ALLOC_PREFIX;
/// The alias of the one volume of such an allocation.
const ALIAS: &str = "volume";
/// How long a Mount given up after `mount_timeout` waits for its rollback.
const GIVE_UP_WAIT: Duration = MOUNT_GIVE_UP_WAIT;

/// The allocation of one mount: `docker-<ID>-<volume>`. The engine's ID is
/// letters and digits only (Docker: 64 hex digits per container mount,
/// kept while the container runs; Podman: one constant ID for every
/// mount), so no ID reaches outside its directory, and the result is
/// checked as every allocation ID is. A volume name too long for the
/// 128 bytes of an allocation ID is cut, and a hash of the whole name
/// (FNV-1a, 64 bits) keeps the cut names apart.
pub fn alloc_id(volume: &str, mount_id: &str) -> Result<String, DriverError> {
    let bad = |problem: &str| DriverError::MountId {
        id: mount_id.chars().take(80).collect(),
        problem: problem.to_string(),
    };
    if mount_id.is_empty() || mount_id.len() > 64 {
        return Err(bad("must be 1 to 64 characters"));
    }
    if !mount_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(bad("may only contain letters and digits"));
    }
    crate::ids::check_id("volume", volume).map_err(|e| DriverError::Invalid(e.to_string()))?;
    let mut id = format!("{ALLOC_PREFIX}{mount_id}-{volume}");
    if id.len() > crate::ids::MAX_ID_LEN {
        let hash = volume.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let keep = crate::ids::MAX_ID_LEN - (ALLOC_PREFIX.len() + mount_id.len() + 2 + 16);
        // IDs are ASCII: any byte is a character boundary.
        id = format!("{ALLOC_PREFIX}{mount_id}-{}-{hash:016x}", &volume[..keep]);
    }
    crate::ids::check_id("allocation", &id).map_err(|e| DriverError::Invalid(e.to_string()))?;
    Ok(id)
}

/// The engine's mount ID of one of our allocation IDs.
fn mount_id_of(alloc_id: &str) -> Option<&str> {
    alloc_id.strip_prefix(ALLOC_PREFIX)?.split('-').next()
}

/// A request that failed; its message goes into the answer's `Err`.
#[derive(Debug)]
pub enum DriverError {
    Request(serde_json::Error),
    UnknownEndpoint(String),
    Invalid(String),
    MountId {
        id: String,
        problem: String,
    },
    NotRegistered {
        name: String,
    },
    Differs {
        name: String,
        differences: Vec<String>,
    },
    Options {
        name: String,
        source: OptionError,
    },
    Registry(VolumeRegistryError),
    Create(VolumeOpError),
    Mount(MountError),
    MountTimeout {
        name: String,
        after: Duration,
        waiting: String,
    },
    Release(ReleaseError),
    References {
        alloc_id: String,
        source: StateError,
    },
    Busy {
        alloc_id: String,
        waited: Duration,
    },
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverError::Request(_) => f.write_str("the request is not valid JSON of the protocol"),
            DriverError::UnknownEndpoint(path) => {
                write!(f, "{path} is not an endpoint of the volume plugin protocol")
            }
            DriverError::Invalid(why) => f.write_str(why),
            DriverError::MountId { id, problem } => {
                write!(f, "the engine's mount ID {id:?} {problem}")
            }
            DriverError::NotRegistered { name } => write!(
                f,
                "volume {name} is not registered with claimd: create it with its definition (docker volume create --driver DRIVER --opt plugin_id=PLUGIN --opt external_id=ID {name}), or register it with `claimd volume register`"
            ),
            DriverError::Differs { name, differences } => write!(
                f,
                "volume {name} is registered with another definition: {}",
                differences.join("; ")
            ),
            DriverError::Options { name, .. } => write!(f, "volume {name}"),
            DriverError::Registry(e) => e.fmt(f),
            DriverError::Create(e) => e.fmt(f),
            DriverError::Mount(e) => e.fmt(f),
            DriverError::MountTimeout {
                name,
                after,
                waiting,
            } => {
                write!(f, "volume {name} was not mounted within {}", crate::config::format_duration(*after))?;
                if !waiting.is_empty() {
                    write!(f, ": {waiting}")?;
                }
                f.write_str("; nothing is left claimed, try again later")
            }
            DriverError::Release(e) => e.fmt(f),
            DriverError::References { alloc_id, .. } => {
                write!(f, "the mount count of allocation {alloc_id} could not be recorded")
            }
            DriverError::Busy { alloc_id, waited } => write!(
                f,
                "another request for allocation {alloc_id} is still running after {}",
                crate::config::format_duration(*waited)
            ),
        }
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DriverError::Request(e) => Some(e),
            DriverError::Options { source, .. } => Some(source),
            DriverError::Registry(e) => e.source(),
            DriverError::Create(e) => e.source(),
            DriverError::Mount(e) => e.source(),
            DriverError::Release(e) => e.source(),
            DriverError::References { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, DriverError> {
    p::parse(body).map_err(DriverError::Request)
}

/// The protocol's requests over one agent's lifecycle. Cheap to clone.
#[derive(Clone)]
pub struct Driver {
    pub lifecycle: Lifecycle,
    /// Cluster mode: volumes are `global` (seen by every node's engine).
    pub cluster: bool,
    pub mount_timeout: Duration,
    /// Whose turn it is to decide about an engine mount's references
    /// (shared with the engine-death rule).
    pub turns: Turns,
    /// The registrations and the plugin's notes, as the agent holds them.
    pub view: View,
    /// The threads that run the Mounts.
    pub mounts: MountThreads,
}

/// The mount threads (`docker-mount-<volume>`), shared by the request
/// threads: each is joined once its mount has answered; one that outlives
/// a given-up Mount's wait goes on, counted here, until it ends (joined by
/// the next Mount) or the plugin's stop joins it.
#[derive(Clone)]
pub struct MountThreads(Arc<Mutex<Option<Threads>>>);

impl Default for MountThreads {
    fn default() -> Self {
        MountThreads(Arc::new(Mutex::new(Some(Threads::new()))))
    }
}

impl MountThreads {
    /// Starts a mount thread; refused once the plugin has stopped.
    fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) -> std::io::Result<u64> {
        match &mut *self.0.lock() {
            Some(t) => t.spawn_id(name, f),
            None => Err(std::io::Error::other("the Docker plugin is stopping")),
        }
    }

    /// Joins mount thread `id` (its mount has answered), outside the lock.
    fn join(&self, id: u64) {
        let handle = self.0.lock().as_mut().and_then(|t| t.take(id));
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    /// At the plugin's stop: joins every mount thread that ends before
    /// `deadline` and names those still running; no mount starts after.
    pub fn join_until(&self, deadline: Instant) -> Vec<String> {
        let threads = self.0.lock().take();
        threads.map(|t| t.join_until(deadline)).unwrap_or_default()
    }
}

impl Driver {
    /// Answers one request.
    pub fn handle(&self, endpoint: Endpoint, body: &[u8]) -> Result<Value, DriverError> {
        match endpoint {
            Endpoint::Activate => Ok(p::activate()),
            Endpoint::Capabilities => Ok(json!({"Capabilities": {
                "Scope": if self.cluster { "global" } else { "local" }
            }})),
            Endpoint::Create => {
                let r: p::CreateRequest = parse(body)?;
                self.create(&r.name, &r.opts.unwrap_or_default())?;
                Ok(json!({}))
            }
            Endpoint::Remove => {
                let r: p::NameRequest = parse(body)?;
                self.remove(&r.name)?;
                Ok(json!({}))
            }
            Endpoint::Mount => {
                let r: p::MountRequest = parse(body)?;
                let path = self.mount(&r.name, &r.id)?;
                Ok(json!({ "Mountpoint": path.to_string_lossy() }))
            }
            Endpoint::Unmount => {
                let r: p::MountRequest = parse(body)?;
                self.unmount(&r.name, &r.id)?;
                Ok(json!({}))
            }
            Endpoint::Path => {
                let r: p::NameRequest = parse(body)?;
                self.check_name(&r.name)?;
                let path = self.mounts(&r.name).into_iter().next().map(|m| m.path);
                Ok(json!({ "Mountpoint": path.unwrap_or_default().to_string_lossy() }))
            }
            Endpoint::Get => {
                let r: p::NameRequest = parse(body)?;
                let known = self.known(&r.name)?.ok_or(DriverError::NotRegistered {
                    name: r.name.clone(),
                })?;
                Ok(json!({ "Volume": self.show(&known) }))
            }
            Endpoint::List => Ok(json!({ "Volumes": self.list() })),
        }
    }

    /// The registration of `name` as the agent holds it (`view`).
    fn known(&self, name: &str) -> Result<Option<Known>, DriverError> {
        self.check_name(name)?;
        Ok(self.view.get(name))
    }

    /// Every volume with the first of this node's engine mounts of it:
    /// one pass over the registrations and one over this node's engine
    /// allocations.
    fn list(&self) -> Vec<Value> {
        let mut mountpoints: std::collections::HashMap<String, PathBuf> =
            std::collections::HashMap::new();
        self.lifecycle.store().read(|s| {
            let engine = s
                .allocs
                .range_from(ALLOC_PREFIX.to_string())
                .take_while(|(id, _)| id.starts_with(ALLOC_PREFIX));
            for (_, a) in engine {
                for v in a.volumes.values() {
                    if v.phase == Phase::Published {
                        mountpoints
                            .entry(v.volume_id.clone())
                            .or_insert_with(|| v.target_path.clone());
                    }
                }
            }
        });
        self.view
            .list()
            .iter()
            .map(|k| {
                let mountpoint = mountpoints
                    .get(&k.spec.id)
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                p::volume(
                    &k.spec.id,
                    &mountpoint,
                    k.note.as_ref().map(|n| n.created_at.as_str()),
                    None,
                )
            })
            .collect()
    }

    fn check_name(&self, name: &str) -> Result<(), DriverError> {
        crate::ids::check_id("volume", name).map_err(|e| DriverError::Invalid(e.to_string()))
    }

    /// The registration of `name` (in cluster mode, the cluster's).
    fn registered(&self, name: &str) -> Result<Option<VolumeSpec>, DriverError> {
        self.check_name(name)?;
        let vols = self
            .lifecycle
            .list_volumes()
            .map_err(DriverError::Registry)?;
        Ok(vols.into_iter().find(|v| v.id == name))
    }

    fn create(&self, name: &str, opts: &BTreeMap<String, String>) -> Result<(), DriverError> {
        self.check_name(name)?;
        let def = options::parse(name, opts).map_err(|source| DriverError::Options {
            name: name.to_string(),
            source,
        })?;
        if let Some(have) = self.registered(name)? {
            let differences = options::differences(&def, &have);
            if !differences.is_empty() {
                return Err(DriverError::Differs {
                    name: name.to_string(),
                    differences,
                });
            }
            return Ok(());
        }
        let (spec, warnings) = match def {
            Definition::Refer => {
                return Err(DriverError::NotRegistered {
                    name: name.to_string(),
                })
            }
            Definition::Register(spec) => {
                let warnings = self
                    .lifecycle
                    .register_volume(spec.clone())
                    .map_err(DriverError::Registry)?;
                (spec, warnings)
            }
            Definition::Create(c) => self
                .lifecycle
                .create_volume(&c)
                .map_err(DriverError::Create)?,
        };
        log::info!("volume {name} registered through the Docker plugin protocol");
        if let Err(e) = self.view.created(&spec) {
            // Without its note an engine's Remove keeps the volume.
            log::warn!(
                "volume {name}: {e}: an engine's Remove will leave it registered (`claimd volume deregister {name}` removes it)"
            );
        }
        for w in warnings {
            log::warn!("{w}");
        }
        Ok(())
    }

    /// Remove: an engine deregisters only what an engine registered
    /// through this plugin (a volume with the plugin's note); one the CLI
    /// or the API registered stays registered and the engine is answered
    /// with success (it forgets its own record: `podman volume prune`
    /// removes every volume no container uses). Refused while in use.
    fn remove(&self, name: &str) -> Result<(), DriverError> {
        self.check_name(name)?;
        if let Some(k) = self.view.get(name) {
            if k.note.is_none() {
                self.refuse_if_in_use(name)?;
                log::info!(
                    "volume {name}: an engine's Remove leaves it registered: it was registered with the claimd CLI or API (`claimd volume deregister {name}` removes it)"
                );
                return Ok(());
            }
        }
        let found = self
            .lifecycle
            .deregister_volume(name)
            .map_err(DriverError::Registry)?;
        if found {
            log::info!("volume {name} deregistered through the Docker plugin protocol");
        }
        if let Err(e) = self.view.removed(name) {
            log::warn!("volume {name}: deregistered, but {e}");
        }
        Ok(())
    }

    /// A volume claimed (by any node) or with a record on this node is in
    /// use: named as `deregister` names it.
    fn refuse_if_in_use(&self, name: &str) -> Result<(), DriverError> {
        let claims = self
            .lifecycle
            .list_claims(crate::claims::ClaimFilter::volume(name))
            .map_err(|e| DriverError::Registry(VolumeRegistryError::Claims(e)))?
            .claims;
        let holder = claims.into_iter().next().map(|c| c.alloc_id).or_else(|| {
            self.lifecycle
                .store()
                .read(|s| s.records_of_volume(name).first().map(|(a, _)| a.id.clone()))
        });
        match holder {
            Some(holder) => Err(DriverError::Registry(VolumeRegistryError::InUse {
                volume_id: name.to_string(),
                holder,
            })),
            None => Ok(()),
        }
    }

    /// Mount: one more reference when the allocation is mounted already
    /// (Docker's `docker cp` on a running container; an engine's retry),
    /// else the allocation is mounted (after the end of a release of it
    /// that its Unmount did not wait for). All of it in the allocation's
    /// turn, and answered within the engine's limit: the turn's wait, then
    /// `mount_timeout`, then a give-up's undo (the config keeps their sum
    /// below the limit).
    fn mount(&self, name: &str, mount_id: &str) -> Result<PathBuf, DriverError> {
        // Not in the view yet (registered on another node a moment ago):
        // the registry itself.
        let spec = match self.known(name)? {
            Some(k) => k.spec,
            None => {
                std::sync::Arc::new(self.registered(name)?.ok_or(DriverError::NotRegistered {
                    name: name.to_string(),
                })?)
            }
        };
        let alloc = alloc_id(name, mount_id)?;
        // While it runs, the engine-death rule leaves alone the mounts of
        // other volumes mounted before it: the same container's, maybe.
        let _mounting = self.turns.mounting(name);
        let turn_wait = ENGINE_MOUNT_LIMIT
            .saturating_sub(ENGINE_ANSWER_MARGIN + self.mount_timeout + 2 * GIVE_UP_WAIT);
        let _turn = self.turn(&alloc, turn_wait)?;
        self.turns.mounted(&alloc);
        // A mounted allocation whose target was emptied (an umount by
        // hand, a restore that met a plugin mounting elsewhere) is
        // published again before it is counted and answered.
        if let Err(e) = self.lifecycle.republish_empty(&alloc) {
            return Err(DriverError::Mount(e));
        }
        let added =
            self.lifecycle
                .add_reference(&alloc)
                .map_err(|source| DriverError::References {
                    alloc_id: alloc.clone(),
                    source,
                })?;
        if let Some(n) = added {
            self.turns.mounted(&alloc);
            log::info!("volume {name}: allocation {alloc} mounted again, {n} references");
            return self
                .lifecycle
                .mounted(&alloc)
                .into_iter()
                .next()
                .map(|m| m.host_path)
                .ok_or_else(|| DriverError::Invalid("the mount answered no path".into()));
        }
        let deadline = Instant::now() + self.mount_timeout;
        if self
            .lifecycle
            .alloc_status(&alloc)
            .is_some_and(|a| a.releasing)
        {
            log::info!(
                "volume {name}: allocation {alloc} is being released; its Mount waits for that"
            );
            self.lifecycle.wait_released(&alloc, self.mount_timeout);
        }
        // The engines bind read-only themselves and do not say so: a
        // volume claims read-only when it has no writable access mode.
        let read_only = spec.access_modes.iter().all(|m| m.reader_only());
        let req = VolumeRequest {
            alias: ALIAS.to_string(),
            volume_id: name.to_string(),
            read_only,
            access_mode: None,
            attachment: None,
            mount_flags: Vec::new(),
            mount_group: String::new(),
        };
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (lc, a) = (self.lifecycle.clone(), alloc.clone());
        // The mount runs on its own thread so that this one can answer
        // within the engine's patience; it is joined once it has answered,
        // and by the plugin's stop if it outlives a given-up Mount.
        let worker = self
            .mounts
            .spawn(format!("docker-mount-{name}"), move || {
                let _ = tx.send(lc.mount(&a, &[req]));
            })
            .map_err(|e| DriverError::Invalid(format!("cannot start a mount thread: {e}")))?;
        let join = || self.mounts.join(worker);
        let answer = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        if answer.is_ok() {
            join();
        }
        match answer {
            Ok(Ok(mounted)) => {
                let path = mounted.into_iter().next().map(|m| m.host_path);
                // Counted 0 (restored after a reboot, its restore unfinished
                // until now): this Mount holds its one reference.
                self.lifecycle.hold_reference(&alloc).map_err(|source| {
                    DriverError::References {
                        alloc_id: alloc.clone(),
                        source,
                    }
                })?;
                self.turns.mounted(&alloc);
                log::info!("volume {name} mounted for allocation {alloc}");
                path.ok_or_else(|| DriverError::Invalid("the mount answered no path".into()))
            }
            Ok(Err(e)) => Err(DriverError::Mount(e)),
            Err(_) => {
                // Past the engine's patience: give the mount up (a release
                // of its allocation ends a wait for a claim or a plugin)
                // rather than leave a claim no container will unmount.
                let waiting = self
                    .lifecycle
                    .alloc_status(&alloc)
                    .and_then(|s| s.volumes.into_iter().next())
                    .map(|v| v.message)
                    .unwrap_or_default();
                log::warn!(
                    "volume {name}: mount for allocation {alloc} not done within {:?} ({waiting}); giving it up",
                    self.mount_timeout
                );
                self.lifecycle
                    .release(&alloc)
                    .map_err(DriverError::Release)?;
                match rx.recv_timeout(GIVE_UP_WAIT) {
                    Ok(_) => join(),
                    Err(_) => log::warn!(
                        "volume {name}: the mount of allocation {alloc} has not ended {GIVE_UP_WAIT:?} after it was given up; it goes on, and the plugin's stop joins its thread"
                    ),
                }
                self.lifecycle.wait_released(&alloc, GIVE_UP_WAIT);
                Err(DriverError::MountTimeout {
                    name: name.to_string(),
                    after: self.mount_timeout,
                    waiting,
                })
            }
        }
    }

    /// Unmount: one reference fewer; the last one releases the allocation
    /// (decided in its turn, waited for outside it). Answered within
    /// `mount_timeout` or the engine's limit, whichever is shorter: a
    /// release still running then goes on in the agent, and a Mount of the
    /// allocation waits for it.
    fn unmount(&self, name: &str, mount_id: &str) -> Result<(), DriverError> {
        self.check_name(name)?;
        let alloc = alloc_id(name, mount_id)?;
        let budget = self
            .mount_timeout
            .min(ENGINE_REQUEST_LIMIT - ENGINE_ANSWER_MARGIN);
        let deadline = Instant::now() + budget;
        let started = {
            let _turn = self.turn(&alloc, budget)?;
            let left = self.lifecycle.drop_reference(&alloc).map_err(|source| {
                DriverError::References {
                    alloc_id: alloc.clone(),
                    source,
                }
            })?;
            if let Some(n) = left {
                log::info!(
                    "volume {name}: allocation {alloc} unmounted once, {n} reference(s) left: kept mounted"
                );
                return Ok(());
            }
            self.turns.unmark(&alloc);
            self.lifecycle
                .release(&alloc)
                .map_err(DriverError::Release)?
        };
        match started {
            ReleaseStart::NotFound => Ok(()),
            ReleaseStart::Started => {
                // The release goes on (and is retried) in the agent whether
                // or not it ends in time; the engine is answered either way.
                let left = deadline.saturating_duration_since(Instant::now());
                if !self.lifecycle.wait_released(&alloc, left) {
                    log::warn!(
                        "volume {name}: release of allocation {alloc} still running after {}; the Unmount is answered, the release goes on in the agent",
                        crate::config::format_duration(budget)
                    );
                }
                Ok(())
            }
        }
    }

    /// The allocation's turn (see `references`), waiting up to `wait`.
    fn turn(&self, alloc: &str, wait: Duration) -> Result<super::references::Turn, DriverError> {
        self.turns.take(alloc, wait).ok_or(DriverError::Busy {
            alloc_id: alloc.to_string(),
            waited: wait,
        })
    }

    /// This node's mounts of `name` by the engines: the records of that
    /// volume only (the state's index), with their reference counts.
    fn mounts(&self, name: &str) -> Vec<Mount> {
        self.lifecycle.store().read(|s| {
            s.records_of_volume(name)
                .into_iter()
                .filter(|(_, v)| v.phase == Phase::Published)
                .filter_map(|(a, v)| {
                    Some(Mount {
                        alloc_id: a.id.clone(),
                        mount_id: mount_id_of(&a.id)?.to_string(),
                        path: v.target_path.clone(),
                        read_only: v.usage.read_only,
                        references: a.references,
                    })
                })
                .collect()
        })
    }

    /// A volume for `Get`: its registration (no secrets), this node's
    /// engine mounts and the plugin's health, from what the agent holds.
    fn show(&self, k: &Known) -> Value {
        let spec = &k.spec;
        let mounts = self.mounts(&spec.id);
        let mountpoint = mounts
            .first()
            .map(|m| m.path.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mounts: Vec<Value> = mounts
            .iter()
            .map(|m| {
                json!({"allocation": m.alloc_id, "mount_id": m.mount_id,
                       "path": m.path, "read_only": m.read_only,
                       "references": m.references})
            })
            .collect();
        let status = json!({
            "plugin_id": spec.plugin_id,
            "external_id": spec.external_id,
            "access_modes": spec.access_modes,
            "registered_by": if k.note.is_some() { "engine" } else { "claimd CLI or API" },
            "plugin_health": self.lifecycle.plugin_health(&spec.plugin_id),
            "mounts": mounts,
        });
        p::volume(
            &spec.id,
            &mountpoint,
            k.note.as_ref().map(|n| n.created_at.as_str()),
            Some(status),
        )
    }
}

struct Mount {
    alloc_id: String,
    mount_id: String,
    path: PathBuf,
    read_only: bool,
    references: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_ids_come_from_the_volume_and_the_mount_id() {
        let id = "a".repeat(64);
        assert_eq!(
            alloc_id("db", &id).expect("valid"),
            format!("docker-{id}-db")
        );
        for bad in ["", "../x", "a/b", "a.b", &"a".repeat(65)] {
            assert!(alloc_id("db", bad).is_err(), "{bad:?}");
        }
        // Too long together: the name is cut and hashed.
        let (long_a, long_b) = ("v".repeat(100) + "a", "v".repeat(100) + "b");
        let (a, b) = (
            alloc_id(&long_a, &id).expect("valid"),
            alloc_id(&long_b, &id).expect("valid"),
        );
        assert_eq!(a.len(), 128);
        assert_ne!(a, b);
        assert_eq!(mount_id_of(&a), Some(id.as_str()));
        assert_eq!(alloc_id(&long_a, &id).expect("valid"), a, "stable");
    }
}
