//! What claimd records: volume registrations, claims and allocation
//! records, shared by `Arc` so an update copies pointers, not records.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::SCHEMA_VERSION;
use crate::volumes::requests::VolumeRef;
use crate::volumes::spec::{AccessMode, Usage, VolumeSpec};

// ---- Claims ----------------------------------------------------------------

/// How an allocation uses a claimed volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimMode {
    Read,
    Write,
}

impl ClaimMode {
    pub fn name(self) -> &'static str {
        match self {
            ClaimMode::Read => "read",
            ClaimMode::Write => "write",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimState {
    /// Held: the allocation may use the volume.
    Taken,
    /// The allocation is releasing the volume; still held until freed.
    Releasing,
    /// The node side is done (unpublished, unstaged) and the controller
    /// detach is being retried; still held until freed.
    NodeDetached,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    pub volume_id: String,
    pub alloc_id: String,
    pub node: String,
    pub mode: ClaimMode,
    pub access_mode: AccessMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_node_id: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub publish_context: BTreeMap<String, String>,
    pub state: ClaimState,
    /// When the claim was taken (milliseconds since the epoch; claims
    /// taken before 0.3 have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    /// Why the holder cannot let go of it yet (a controller detach being
    /// retried), as the holder last wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

// ---- Allocation records ------------------------------------------------------

/// Where one allocation volume stands, durably. Two writes per mount
/// (the intent, `mounting`; the result, `published`) and two per release
/// (`releasing`; the record dropped with the claim): every CSI call is
/// idempotent, so recovery redoes the whole way up from `mounting` and the
/// whole way down from `releasing`. Which call a running operation is at
/// lives in memory only (`alloc status` shows it).
///
/// Releases before 0.2 recorded a phase per call; those names are read as
/// the phase they imply (`controller-publishing`, `staging`, `publishing`:
/// `mounting`; `unpublishing`, `unstaging`, `controller-unpublishing`,
/// `releasing-claim`: `releasing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Recorded; the claim is not taken yet (the plugin was not ready, or
    /// another allocation holds the volume). Nothing was sent.
    Claiming,
    /// The intent: the claim is held and the plan recorded (paths, external
    /// node ID, holds-flags); ControllerPublish, NodeStage and NodePublish
    /// may or may not have happened.
    #[serde(
        alias = "controller-publishing",
        alias = "staging",
        alias = "publishing"
    )]
    Mounting,
    /// Mounted at the target path; the publish context is recorded.
    Published,
    /// Going down: NodeUnpublish, NodeUnstage and ControllerUnpublish may or
    /// may not have happened; the claim is still held.
    #[serde(
        alias = "unpublishing",
        alias = "unstaging",
        alias = "controller-unpublishing",
        alias = "releasing-claim"
    )]
    Releasing,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Claiming => "claiming",
            Phase::Mounting => "mounting",
            Phase::Published => "published",
            Phase::Releasing => "releasing",
        }
    }

    /// Phases of the way down.
    pub fn is_teardown(self) -> bool {
        self == Phase::Releasing
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One volume of one allocation: what recovery needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocVolume {
    pub alias: String,
    pub volume_id: String,
    pub plugin_id: String,
    /// The plugin's ID of the volume.
    pub external_volume_id: String,
    /// The node plugin's node ID used for ControllerPublish; the detach
    /// uses this recorded value, never a fresh lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_node_id: Option<String>,
    pub usage: Usage,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_flags: Vec<String>,
    /// CSI `volume_mount_group` for NodeStage and NodePublish; empty: none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mount_group: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_path: Option<PathBuf>,
    pub target_path: PathBuf,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub publish_context: BTreeMap<String, String>,
    /// This record counts as a user of the controller attachment of the
    /// volume on this node (set before ControllerPublish is sent).
    #[serde(default)]
    pub holds_attachment: bool,
    /// This record counts as a user of the staging path (set before
    /// NodeStage is sent).
    #[serde(default)]
    pub holds_staging: bool,
    /// Cluster mode: the claim's epoch (its etcd create revision, the
    /// fencing token), recorded with the intent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
    pub phase: Phase,
}

impl AllocVolume {
    /// The record as the CSI request builders take it.
    pub fn volume_ref(&self) -> VolumeRef<'_> {
        VolumeRef {
            external_volume_id: &self.external_volume_id,
            external_node_id: self.external_node_id.as_deref(),
            usage: &self.usage,
            mount_flags: &self.mount_flags,
            mount_group: &self.mount_group,
            staging_path: self.staging_path.as_deref(),
            target_path: &self.target_path,
            publish_context: &self.publish_context,
            epoch: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocRecord {
    pub id: String,
    /// A release was asked for (or a failed mount is being rolled back):
    /// every volume goes down, whatever its phase.
    #[serde(default)]
    pub releasing: bool,
    /// How many mounts of the allocation its front end counts (the Docker
    /// volume plugin protocol: one per Mount not yet unmounted, see
    /// `lifecycle::references`); 1 for every other allocation. Written only
    /// when above 1: a record without it (every record written before
    /// counting, and most after) reads as 1, and a claimd from before
    /// counting still reads a state with no shared mount.
    #[serde(default = "one_reference", skip_serializing_if = "is_one_reference")]
    pub references: u32,
    /// Alias -> volume. Shared like the records above it, so changing one
    /// volume of a large allocation copies pointers, not its other volumes.
    pub volumes: BTreeMap<String, Arc<AllocVolume>>,
}

pub(super) fn one_reference() -> u32 {
    1
}

pub(super) fn is_one_reference(n: &u32) -> bool {
    *n == 1
}

/// (volume ID, allocation ID): the key of a claim.
pub type ClaimKey = (String, String);

use super::shared_map::MapId;
pub use super::shared_map::SharedMap;

/// Which allocations have a record of a volume, and which have a record
/// at a staging path: derived from the records, never written (the
/// questions that use it and why it can be trusted: `index`). Keyed by
/// hashes and holding the records' own pointers, so an entry is 24 bytes
/// and nothing of its own on the heap (maps keyed by the strings cost
/// several MiB at 10,000 allocations: the manual's performance.md, "RSS
/// with 10,000").
#[derive(Clone, Default)]
pub struct RecordIndex {
    /// The allocation map this describes; None: none yet.
    built_for: Option<MapId<String, AllocRecord>>,
    /// (hash of a volume ID, hash of an allocation ID) -> the allocation,
    /// which has a record of that volume (a hash is only a hint: the
    /// questions compare the IDs).
    pub(super) by_volume: SharedMap<(u64, u64), AllocRecord>,
    /// (hash of a staging path, hash of an allocation ID) -> the
    /// allocation, which has a record with that staging path.
    pub(super) by_staging: SharedMap<(u64, u64), AllocRecord>,
    /// Two allocations' hashes collided on one key: this index is not used
    /// again (the questions scan every record).
    collided: bool,
}

/// The hash an index key is made of (fixed keys: the same in every run).
pub(super) fn key_hash(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(bytes);
    h.finish()
}

/// Derived from the records: two states with the same records are equal
/// whatever their indexes (and the state's equality is what decides
/// whether an update wrote anything).
impl PartialEq for RecordIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for RecordIndex {}

impl fmt::Debug for RecordIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordIndex({} volume entries)", self.by_volume.len())
    }
}

type IndexMap = SharedMap<(u64, u64), AllocRecord>;

/// Enters `a` under `key`; false when another allocation is there.
fn enter(map: &mut IndexMap, key: (u64, u64), a: &Arc<AllocRecord>) -> bool {
    if map.get(&key).is_some_and(|e| e.id != a.id) {
        return false;
    }
    map.insert(key, a.clone());
    true
}

/// Removes `a` from `key` (nothing when another allocation is there).
fn leave(map: &mut IndexMap, key: (u64, u64), a: &AllocRecord) {
    if map.get(&key).is_some_and(|e| e.id == a.id) {
        map.remove(&key);
    }
}

impl RecordIndex {
    pub(super) fn describes(&self, allocs: &SharedMap<String, AllocRecord>) -> bool {
        !self.collided && self.built_for.as_ref().is_some_and(|id| id.is(allocs))
    }

    fn add(&mut self, a: &Arc<AllocRecord>) {
        let ah = key_hash(a.id.as_bytes());
        for v in a.volumes.values() {
            let ok = enter(
                &mut self.by_volume,
                (key_hash(v.volume_id.as_bytes()), ah),
                a,
            );
            let ok = ok
                && match &v.staging_path {
                    None => true,
                    Some(p) => {
                        let ph = key_hash(p.as_os_str().as_encoded_bytes());
                        enter(&mut self.by_staging, (ph, ah), a)
                    }
                };
            if !ok {
                self.collided = true;
            }
        }
    }

    fn remove(&mut self, a: &AllocRecord) {
        let ah = key_hash(a.id.as_bytes());
        for v in a.volumes.values() {
            leave(
                &mut self.by_volume,
                (key_hash(v.volume_id.as_bytes()), ah),
                a,
            );
            if let Some(p) = &v.staging_path {
                let ph = key_hash(p.as_os_str().as_encoded_bytes());
                leave(&mut self.by_staging, (ph, ah), a);
            }
        }
    }

    /// Makes this describe `after`: from the records that differ from
    /// `before` when this describes `before`, else from every record.
    pub(super) fn update(
        &mut self,
        before: &SharedMap<String, AllocRecord>,
        after: &SharedMap<String, AllocRecord>,
    ) {
        if self.collided {
            return;
        }
        if !self.describes(before) {
            let mut fresh = RecordIndex::default();
            for a in after.values() {
                fresh.add(a);
            }
            *self = fresh;
        } else {
            SharedMap::diff(before, after, |k, new| {
                if let Some(old) = before.get(k) {
                    self.remove(old);
                }
                if let Some(new) = new {
                    self.add(new);
                }
            });
        }
        self.built_for = Some(after.id());
    }
}

/// Everything claimd records. Records are shared (`Arc`) between the durable
/// copy and the copies updates work on, so an update clones pointers, not
/// records, and the journal finds what changed by pointer comparison.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    pub schema_version: u32,
    /// Boot ID of the kernel this state was last converged on.
    pub boot_id: String,
    #[serde(default)]
    pub volumes: SharedMap<String, VolumeSpec>,
    /// Written as a list of claims, ordered by volume, then allocation.
    #[serde(default, with = "claim_list")]
    pub claims: SharedMap<ClaimKey, Claim>,
    #[serde(default)]
    pub allocs: SharedMap<String, AllocRecord>,
    /// The records by volume and staging path, derived (see `index`).
    #[serde(skip)]
    pub(super) index: RecordIndex,
}

/// Claims in the file are a list (as in every earlier file); in memory they
/// are keyed by (volume, allocation).
mod claim_list {
    use super::*;
    use serde::de::Error as _;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        m: &SharedMap<ClaimKey, Claim>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.values())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<SharedMap<ClaimKey, Claim>, D::Error> {
        let list: Vec<Claim> = Vec::deserialize(d)?;
        let mut m = BTreeMap::new();
        for c in list {
            let key = (c.volume_id.clone(), c.alloc_id.clone());
            if m.insert(key, Arc::new(c)).is_some() {
                return Err(D::Error::custom(
                    "two claims of one allocation on one volume",
                ));
            }
        }
        Ok(SharedMap::from_map(m))
    }
}

impl StateFile {
    pub fn new(boot_id: &str) -> StateFile {
        StateFile {
            schema_version: SCHEMA_VERSION,
            boot_id: boot_id.to_string(),
            volumes: SharedMap::default(),
            claims: SharedMap::default(),
            allocs: SharedMap::default(),
            index: RecordIndex::default(),
        }
    }

    /// Every (alloc, alias, record), in order.
    pub fn alloc_volumes(&self) -> impl Iterator<Item = (&AllocRecord, &AllocVolume)> {
        self.allocs
            .values()
            .flat_map(|a| a.volumes.values().map(move |v| (&**a, &**v)))
    }

    /// The allocation's record, for changing (copied first when shared).
    pub fn alloc_mut(&mut self, alloc: &str) -> Option<&mut AllocRecord> {
        self.allocs.get_mut(alloc).map(Arc::make_mut)
    }

    pub fn volume_mut(&mut self, alloc: &str, alias: &str) -> Option<&mut AllocVolume> {
        self.alloc_mut(alloc)?
            .volumes
            .get_mut(alias)
            .map(Arc::make_mut)
    }

    pub fn volume(&self, alloc: &str, alias: &str) -> Option<&AllocVolume> {
        self.allocs.get(alloc)?.volumes.get(alias).map(|v| &**v)
    }

    /// The claims on one volume.
    pub fn claims_on<'a>(&'a self, volume_id: &str) -> impl Iterator<Item = &'a Claim> + 'a {
        let from = (volume_id.to_string(), String::new());
        let volume_id = volume_id.to_string();
        self.claims
            .range_from(from)
            .take_while(move |((v, _), _)| *v == volume_id)
            .map(|(_, c)| &**c)
    }

    pub fn claim(&self, volume_id: &str, alloc_id: &str) -> Option<&Claim> {
        self.claims
            .get(&(volume_id.to_string(), alloc_id.to_string()))
            .map(|c| &**c)
    }

    pub fn claim_mut(&mut self, volume_id: &str, alloc_id: &str) -> Option<&mut Claim> {
        self.claims
            .get_mut(&(volume_id.to_string(), alloc_id.to_string()))
            .map(Arc::make_mut)
    }
}
