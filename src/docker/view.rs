//! What `Get`, `List`, `Path` and `Mount` read: the registrations and the
//! plugin's notes on them, from what the agent already holds, never a read
//! of etcd per request and never a secret on the way (dockerd asks `Get`
//! for every volume it knows at its start, all at once).
//!
//! - One node: the registrations are the agent's own state (one lookup);
//!   the notes are `docker-volumes.json` in the state directory.
//! - Cluster mode: one Range of `<prefix>/volumes` (the registrations,
//!   `<prefix>/volumes/<id>`, and the notes, `<prefix>/volumes-docker/<id>`)
//!   and then a watch from its revision (thread `docker-view`), secrets
//!   dropped as they arrive. While etcd is away the last view answers;
//!   before etcd first answered, this node's own registrations (kept in its
//!   state) do. A watch that ends is replaced by a new Range and watch.
//!
//! A note says when the plugin registered the volume (`CreatedAt`) and
//! that an engine did: only such a volume may an engine's `Remove`
//! deregister. A volume registered with the CLI or the API has no note,
//! and a note counts only for the plugin and external ID it was written
//! for (a note left behind by a deregistration elsewhere does not make a
//! later registration of the name the engines').

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::claims::etcd::Keys;
use crate::etcd::{prefix_end, EtcdClient, KeyValue, WatchEvent};
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::threads::Threads;
use crate::volumes::VolumeSpec;

/// How long the keeper waits for an event before it looks at the stop.
const POLL: Duration = Duration::from_millis(250);
/// A watch etcd has not answered on for this long (it asks for progress
/// every 2 s when idle) is said to be stale, once.
const STALE_AFTER: Duration = Duration::from_secs(6);
/// Backoff between attempts to read and watch again after a failure.
const RETRY: Duration = Duration::from_secs(1);
/// The notes' file in the state directory (one node).
const NOTES_FILE: &str = "docker-volumes.json";

/// The plugin's note on a volume an engine registered through it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    /// RFC 3339, UTC: when the engine's Create registered it.
    pub created_at: String,
    /// What the engine registered: a note whose volume was deregistered
    /// (by the CLI, say) and another one registered under its name since
    /// does not count.
    pub plugin_id: String,
    pub external_id: String,
}

impl Note {
    fn of(&self, spec: &VolumeSpec) -> bool {
        self.plugin_id == spec.plugin_id && self.external_id == spec.external_id
    }
}

/// A registration without its secrets, and the plugin's note on it.
#[derive(Clone)]
pub struct Known {
    pub spec: Arc<VolumeSpec>,
    pub note: Option<Note>,
}

/// Cheap to clone.
#[derive(Clone)]
pub struct View {
    inner: Arc<Inner>,
}

struct Inner {
    lifecycle: Lifecycle,
    source: Source,
    state: Mutex<Cached>,
}

enum Source {
    Local { notes_file: PathBuf },
    Cluster { client: EtcdClient, keys: Keys },
}

#[derive(Default)]
struct Cached {
    /// Cluster mode: the registrations as last read (secrets dropped).
    volumes: BTreeMap<String, Arc<VolumeSpec>>,
    notes: BTreeMap<String, Note>,
}

/// Why a note could not be written or removed.
#[derive(Debug)]
pub struct NoteError(String);

impl std::fmt::Display for NoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn without_secrets(spec: &VolumeSpec) -> Arc<VolumeSpec> {
    let mut s = spec.clone();
    s.secrets.clear();
    Arc::new(s)
}

impl View {
    /// One node's view (notes read from the state directory), or a
    /// cluster's (`etcd`: the client and the key prefix; call `start`).
    pub fn new(lifecycle: Lifecycle, etcd: Option<(EtcdClient, String)>) -> View {
        let mut cached = Cached::default();
        let source = match etcd {
            None => {
                let notes_file = lifecycle.store().dir().join(NOTES_FILE);
                match std::fs::read(&notes_file) {
                    Ok(bytes) => match serde_json::from_slice(&bytes) {
                        Ok(notes) => cached.notes = notes,
                        Err(e) => log::warn!(
                            "docker: {} is not the plugin's notes ({e}): every volume reads as registered with the CLI",
                            notes_file.display()
                        ),
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => log::warn!(
                        "docker: cannot read {} ({e}): every volume reads as registered with the CLI",
                        notes_file.display()
                    ),
                }
                Source::Local { notes_file }
            }
            Some((client, prefix)) => {
                // Until etcd answers: this node's own registrations.
                cached.volumes = lifecycle.store().read(|s| {
                    s.volumes
                        .values()
                        .map(|v| (v.id.clone(), without_secrets(v)))
                        .collect()
                });
                Source::Cluster {
                    client,
                    keys: Keys::new(&prefix),
                }
            }
        };
        View {
            inner: Arc::new(Inner {
                lifecycle,
                source,
                state: Mutex::new(cached),
            }),
        }
    }

    /// Cluster mode: starts thread `docker-view`, which keeps the view.
    pub fn start(&self, threads: &mut Threads, stop: Shutdown) -> std::io::Result<()> {
        if let Source::Cluster { client, keys } = &self.inner.source {
            let keeper = Keeper {
                client: client.clone(),
                range: keys.volume_range(),
                volumes: keys.volumes(),
                notes: keys.docker_notes(),
                view: self.clone(),
                stop,
            };
            threads.spawn("docker-view", move || keeper.run())?;
        }
        Ok(())
    }

    /// One volume: a lookup.
    pub fn get(&self, name: &str) -> Option<Known> {
        let cached = self.inner.state.lock();
        let spec = match &self.inner.source {
            Source::Local { .. } => self
                .inner
                .lifecycle
                .store()
                .read(|s| s.volumes.get(name).map(|v| without_secrets(v)))?,
            Source::Cluster { .. } => cached.volumes.get(name)?.clone(),
        };
        Some(Known {
            note: cached.notes.get(name).filter(|n| n.of(&spec)).cloned(),
            spec,
        })
    }

    /// Every volume, by name.
    pub fn list(&self) -> Vec<Known> {
        let cached = self.inner.state.lock();
        let specs: Vec<Arc<VolumeSpec>> = match &self.inner.source {
            Source::Local { .. } => self
                .inner
                .lifecycle
                .store()
                .read(|s| s.volumes.values().map(|v| without_secrets(v)).collect()),
            Source::Cluster { .. } => cached.volumes.values().cloned().collect(),
        };
        specs
            .into_iter()
            .map(|spec| Known {
                note: cached.notes.get(&spec.id).filter(|n| n.of(&spec)).cloned(),
                spec,
            })
            .collect()
    }

    /// An engine's Create registered `spec`: its note is written (in
    /// cluster mode to etcd, for every node), and the view has both now.
    pub fn created(&self, spec: &VolumeSpec) -> Result<(), NoteError> {
        let note = Note {
            created_at: crate::clock::utc(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            ),
            plugin_id: spec.plugin_id.clone(),
            external_id: spec.external_id.clone(),
        };
        let name = spec.id.clone();
        let mut cached = self.inner.state.lock();
        match &self.inner.source {
            Source::Local { notes_file } => {
                let mut notes = cached.notes.clone();
                notes.insert(name.clone(), note.clone());
                write_notes(notes_file, &notes)?;
            }
            Source::Cluster { client, keys } => {
                let value = serde_json::to_vec(&note).expect("a note always encodes");
                client
                    .put(keys.docker_note(&name), value)
                    .map_err(|e| NoteError(format!("cannot write the volume's note: {e}")))?;
                cached.volumes.insert(name.clone(), without_secrets(spec));
            }
        }
        cached.notes.insert(name, note);
        Ok(())
    }

    /// `name` was deregistered: its note goes.
    pub fn removed(&self, name: &str) -> Result<(), NoteError> {
        let mut cached = self.inner.state.lock();
        match &self.inner.source {
            Source::Local { notes_file } => {
                if cached.notes.contains_key(name) {
                    let mut notes = cached.notes.clone();
                    notes.remove(name);
                    write_notes(notes_file, &notes)?;
                }
            }
            Source::Cluster { client, keys } => {
                client
                    .delete_range(keys.docker_note(name), b"")
                    .map_err(|e| NoteError(format!("cannot remove the volume's note: {e}")))?;
                cached.volumes.remove(name);
            }
        }
        cached.notes.remove(name);
        Ok(())
    }
}

/// Writes the notes durably: a new file renamed over the old one.
fn write_notes(path: &std::path::Path, notes: &BTreeMap<String, Note>) -> Result<(), NoteError> {
    use std::io::Write;
    let err = |e: std::io::Error| NoteError(format!("cannot write {}: {e}", path.display()));
    let tmp = path.with_extension("json.new");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(&serde_json::to_vec(notes).expect("notes always encode"))
        .map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

struct Keeper {
    client: EtcdClient,
    /// One range holds both: `<prefix>/volumes`.
    range: String,
    volumes: String,
    notes: String,
    view: View,
    stop: Shutdown,
}

impl Keeper {
    fn run(self) {
        // Said once per outage, not once per retry.
        let mut failing = false;
        while !self.stop.is_triggered() {
            match self.follow(&mut failing) {
                Ok(()) => {}
                Err(why) if failing => log::debug!("docker: volume view: {why}"),
                Err(why) => {
                    failing = true;
                    log::info!(
                        "docker: volume view: {why}; answering from the last view, reading again every {RETRY:?}"
                    );
                }
            }
            if !self.stop.sleep(RETRY) {
                break;
            }
        }
    }

    /// One Range, then the watch from the revision after it, until the
    /// watch ends or the agent stops.
    fn follow(&self, failing: &mut bool) -> Result<(), String> {
        let key = self.range.as_bytes();
        let end = prefix_end(key);
        let read = self
            .client
            .range(key, &end)
            .map_err(|e| format!("cannot read the volumes: {e}"))?;
        let watch = self
            .client
            .watch(key, &end, read.revision + 1)
            .map_err(|e| format!("cannot watch the volumes: {e}"))?;
        {
            let mut fresh = Cached::default();
            for kv in &read.kvs {
                self.apply(&mut fresh, &WatchEvent::Put(kv.clone()));
            }
            *self.view.inner.state.lock() = fresh;
        }
        if std::mem::take(failing) {
            log::info!("docker: volume view: etcd answers again; the view is current");
        }
        while !self.stop.is_triggered() {
            // The watch reopens a broken stream by itself: a silence says
            // etcd is away.
            let fresh = watch.is_fresh(STALE_AFTER);
            if !fresh && !*failing {
                *failing = true;
                log::info!(
                    "docker: volume view: etcd has not answered for {STALE_AFTER:?}; answering from the last view"
                );
            } else if fresh && std::mem::take(failing) {
                log::info!("docker: volume view: etcd answers again; the view is current");
            }
            let mut next = watch
                .recv_timeout(POLL)
                .map_err(|e| format!("watch ended: {e}"))?;
            while let Some(ev) = next {
                self.apply(&mut self.view.inner.state.lock(), &ev);
                next = watch
                    .recv_timeout(Duration::ZERO)
                    .map_err(|e| format!("watch ended: {e}"))?;
            }
        }
        Ok(())
    }

    fn apply(&self, cached: &mut Cached, ev: &WatchEvent) {
        let (kv, put): (&KeyValue, bool) = match ev {
            WatchEvent::Put(kv) => (kv, true),
            WatchEvent::Delete(kv) => (kv, false),
            WatchEvent::Progress { .. } => return,
        };
        let key = kv.key_str();
        if let Some(name) = key.strip_prefix(&self.volumes) {
            if !put {
                cached.volumes.remove(name);
                return;
            }
            match crate::claims::etcd::parse_spec(kv) {
                Ok(spec) => {
                    cached
                        .volumes
                        .insert(name.to_string(), without_secrets(&spec));
                }
                Err(e) => {
                    cached.volumes.remove(name);
                    log::warn!("docker: {key} is not a volume: {e} (left out)");
                }
            }
        } else if let Some(name) = key.strip_prefix(&self.notes) {
            if !put {
                cached.notes.remove(name);
                return;
            }
            match serde_json::from_slice::<Note>(&kv.value) {
                Ok(n) => {
                    cached.notes.insert(name.to_string(), n);
                }
                Err(e) => {
                    cached.notes.remove(name);
                    log::warn!("docker: {key} is not a note of the plugin: {e} (left out)");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_written_durably_and_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(NOTES_FILE);
        let notes = BTreeMap::from([(
            "db".to_string(),
            Note {
                created_at: "2026-12-05T18:00:00Z".to_string(),
                plugin_id: "hp".to_string(),
                external_id: "vol-1".to_string(),
            },
        )]);
        write_notes(&path, &notes).expect("written");
        let back: BTreeMap<String, Note> =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("JSON");
        assert_eq!(back, notes);
        assert!(!path.with_extension("json.new").exists());
        // A note counts for the volume it was written for only.
        let spec = |external: &str| -> VolumeSpec {
            serde_json::from_value(serde_json::json!({
                "id": "db", "plugin_id": "hp", "external_id": external,
                "access_modes": ["single-node-writer"], "attachment_modes": ["file-system"]
            }))
            .expect("a spec")
        };
        assert!(notes["db"].of(&spec("vol-1")));
        assert!(!notes["db"].of(&spec("vol-2")));
    }
}
