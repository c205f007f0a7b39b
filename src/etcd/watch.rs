//! `Watcher`: one watch on a key range, driven by a named thread
//! (`etcd-watch`) over the Watch stream, its events handed over in order
//! through a channel.
//!
//! A broken stream is reopened (on the next endpoint if need be) from the
//! revision after the last event delivered, so no event is lost or repeated;
//! a start revision that has been compacted away ends the watch with
//! `EtcdError::Compacted`.
//!
//! A watch is trusted only while it shows it is alive: the stream asks for
//! a leader (etcd's `hasleader` metadata: a member cut off from its quorum
//! ends the stream instead of going silent, and the watch is reopened on
//! another endpoint), and an idle stream asks for progress every
//! `AUTO_PROGRESS`; `Watcher::is_fresh` says whether etcd answered lately.
//! What depends on a watch that is not fresh reads with a Range instead.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use grpcio::CallOption;

use super::client::{EtcdClient, Inner};
use super::kv::KeyValue;
use super::stream::{DuplexStream, Received};
use super::worker::{StopSignal, Worker};
use super::EtcdError;
use crate::generated::etcd as pb;
use crate::generated::etcd_kv as mvccpb;

type WatchStream = DuplexStream<pb::WatchRequest, pb::WatchResponse>;

/// How long an idle stream waits before it asks etcd for progress.
pub const AUTO_PROGRESS: Duration = Duration::from_secs(2);
/// Backoff between attempts to reopen a broken stream.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// What a watch saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or changed (`kv.version == 1`: created).
    Put(KeyValue),
    /// A key was deleted (or expired with its lease); `kv.mod_revision` is
    /// the revision of the deletion, the value is empty.
    Delete(KeyValue),
    /// Every event up to `revision` has been delivered (an answer to
    /// `request_progress`).
    Progress { revision: i64 },
}

impl WatchEvent {
    /// The revision the event happened at.
    pub fn revision(&self) -> i64 {
        match self {
            WatchEvent::Put(kv) | WatchEvent::Delete(kv) => kv.mod_revision,
            WatchEvent::Progress { revision } => *revision,
        }
    }
}

enum Command {
    Progress,
    Cancel,
}

/// A running watch. Dropping it stops the thread (bounded) and the stream.
pub struct Watcher {
    events: Receiver<Result<WatchEvent, EtcdError>>,
    commands: Sender<Command>,
    /// When etcd last answered on the stream (an event, a progress).
    heard: std::sync::Arc<parking_lot::Mutex<Instant>>,
    call_timeout: Duration,
    worker: Worker,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

impl Watcher {
    /// The next event, waiting up to `timeout`: `Ok(None)` when none came.
    /// An error ends the watch (`Stopped` once it has ended).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<WatchEvent>, EtcdError> {
        match self.events.recv_timeout(timeout) {
            Ok(Ok(event)) => Ok(Some(event)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(EtcdError::Stopped),
        }
    }

    /// Whether etcd answered on this watch's stream within `max_age`: a
    /// watch that did not is stale, and nothing may be concluded from its
    /// silence. (An idle stream asks for progress every `AUTO_PROGRESS`.)
    pub fn is_fresh(&self, max_age: Duration) -> bool {
        self.heard.lock().elapsed() < max_age
    }

    /// When etcd last answered on this watch's stream (an event, a
    /// progress), counted once that answer's events were handed over.
    pub fn last_heard(&self) -> Instant {
        *self.heard.lock()
    }

    /// The event channel itself, for `select!`.
    pub fn receiver(&self) -> &Receiver<Result<WatchEvent, EtcdError>> {
        &self.events
    }

    /// Asks etcd for a `Progress` event (what revision the watch is at).
    pub fn request_progress(&self) {
        let _ = self.commands.send(Command::Progress);
        self.worker.unpark();
    }

    /// Cancels the watch on the server, waits (bounded by the call
    /// deadline) for etcd to confirm, and stops the thread.
    pub fn cancel(mut self) {
        if self.commands.send(Command::Cancel).is_ok() {
            self.worker.unpark();
            self.worker.wait_done(self.call_timeout);
        }
        self.worker.stop();
    }
}

/// Where the watch stands: what to ask for when the stream is reopened.
#[derive(Clone)]
struct Spec {
    key: Vec<u8>,
    range_end: Vec<u8>,
    /// The first revision not delivered yet (0: from now).
    next_revision: i64,
}

impl Spec {
    fn create_request(&self) -> pb::WatchRequest {
        let mut c = pb::WatchCreateRequest::new();
        c.key.clone_from(&self.key);
        c.range_end.clone_from(&self.range_end);
        c.start_revision = self.next_revision;
        let mut req = pb::WatchRequest::new();
        req.set_create_request(c);
        req
    }
}

/// Opens a stream on the first endpoint that answers and creates the
/// watch; the stream and etcd's answer.
fn open(
    inner: &Inner,
    spec: &Spec,
    stop: &StopSignal,
) -> Result<(WatchStream, pb::WatchResponse), EtcdError> {
    let deadline = Instant::now() + inner.call_timeout;
    inner.with_endpoint("Watch", deadline, true, stop, |ep, deadline| {
        let mut md = grpcio::MetadataBuilder::new();
        md.add_str("hasleader", "true")
            .expect("a valid ASCII metadata pair");
        let pair = ep
            .watch
            .watch(CallOption::default().headers(md.build()))
            .map_err(|e| EtcdError::from_grpc("Watch", &ep.name, e))?;
        let mut stream = DuplexStream::new("Watch", &ep.name, pair);
        stream.send(spec.create_request(), deadline, stop)?;
        let created = stream.answer(deadline, stop)?;
        if !created.created {
            return Err(EtcdError::BadReply {
                method: "Watch",
                what: "the watch's creation",
            });
        }
        if created.canceled {
            return Err(canceled(spec, &created));
        }
        Ok((stream, created))
    })
}

fn canceled(spec: &Spec, resp: &pb::WatchResponse) -> EtcdError {
    if resp.compact_revision > 0 {
        EtcdError::Compacted {
            start_revision: spec.next_revision,
            compact_revision: resp.compact_revision,
        }
    } else {
        EtcdError::WatchCanceled {
            reason: resp.cancel_reason.clone(),
        }
    }
}

impl EtcdClient {
    /// Watches `[key, range_end)` (`key` alone when `range_end` is empty)
    /// from `start_revision` (inclusive; 0: from now). Returns once etcd
    /// has created the watch.
    pub fn watch(
        &self,
        key: impl AsRef<[u8]>,
        range_end: impl AsRef<[u8]>,
        start_revision: i64,
    ) -> Result<Watcher, EtcdError> {
        let mut spec = Spec {
            key: key.as_ref().to_vec(),
            range_end: range_end.as_ref().to_vec(),
            next_revision: start_revision.max(0),
        };
        let (stream, created) = open(&self.inner, &spec, &StopSignal::none())?;
        if spec.next_revision == 0 {
            spec.next_revision = created.header.revision + 1;
        }
        let (events_tx, events) = crossbeam_channel::unbounded();
        let (commands, commands_rx) = crossbeam_channel::unbounded();
        let inner = self.inner.clone();
        let heard = std::sync::Arc::new(parking_lot::Mutex::new(Instant::now()));
        let loop_heard = heard.clone();
        let worker = Worker::spawn("etcd-watch", move |stop| {
            let mut w = WatchLoop {
                inner: &inner,
                spec,
                watch_id: created.watch_id,
                events: events_tx,
                commands: commands_rx,
                stop,
                heard: loop_heard,
                asked_progress: 0,
            };
            w.run(stream);
        })?;
        Ok(Watcher {
            events,
            commands,
            heard,
            call_timeout: self.inner.call_timeout,
            worker,
        })
    }
}

struct WatchLoop<'a> {
    inner: &'a Inner,
    spec: Spec,
    watch_id: i64,
    events: Sender<Result<WatchEvent, EtcdError>>,
    commands: Receiver<Command>,
    stop: StopSignal,
    heard: std::sync::Arc<parking_lot::Mutex<Instant>>,
    /// Progress answers owed to `request_progress` callers (the loop's own
    /// idle requests are not delivered).
    asked_progress: usize,
}

/// Whether the watch goes on after a response.
enum Next {
    Continue,
    End,
}

impl WatchLoop<'_> {
    fn run(&mut self, stream: WatchStream) {
        let mut stream = Some(stream);
        let mut backoff = RETRY_MIN;
        let mut canceling = false;
        while !self.stop.is_stopped() {
            let Some(s) = stream.as_mut() else {
                match open(self.inner, &self.spec, &self.stop) {
                    Ok((s, created)) => {
                        log::info!("etcd watch reopened at {}", s.endpoint);
                        self.watch_id = created.watch_id;
                        stream = Some(s);
                        backoff = RETRY_MIN;
                    }
                    Err(e) if e.is_retryable() => {
                        log::debug!("etcd watch: reopening failed: {}", crate::error_chain(&e));
                        if !self.stop.sleep(backoff) {
                            return;
                        }
                        backoff = (backoff * 2).min(RETRY_MAX);
                    }
                    Err(e) => return self.fail(e),
                }
                continue;
            };
            let received = match self.send_commands(s, &mut canceling) {
                Ok(()) => s.recv(Instant::now() + AUTO_PROGRESS, &self.stop, || {
                    !self.commands.is_empty()
                }),
                Err(e) => Err(e),
            };
            match received {
                Ok(Received::Message(resp)) => {
                    // Heard once its events are handed over: a reader that
                    // takes `last_heard` and then drains the channel has
                    // every event up to then.
                    let answered = Instant::now();
                    let next = self.handle(resp, canceling);
                    *self.heard.lock() = answered;
                    if let Next::End = next {
                        return;
                    }
                }
                Ok(Received::Nothing) if self.stop.is_stopped() => return,
                Ok(Received::Nothing) if self.commands.is_empty() => {
                    // Idle: ask etcd to show it is there (the answer keeps
                    // `is_fresh` true; a stream that cannot send breaks).
                    let mut req = pb::WatchRequest::new();
                    req.set_progress_request(pb::WatchProgressRequest::new());
                    let deadline = Instant::now() + self.inner.call_timeout;
                    if let Err(e) = s.send(req, deadline, &self.stop) {
                        log::warn!(
                            "etcd watch: progress request failed, reopening from revision {}: {}",
                            self.spec.next_revision,
                            crate::error_chain(&e)
                        );
                        stream = None;
                    }
                }
                Ok(Received::Nothing) => {}
                Err(_) if self.stop.is_stopped() => return,
                Err(e) => {
                    log::warn!(
                        "etcd watch: stream broke, reopening from revision {}: {}",
                        self.spec.next_revision,
                        crate::error_chain(&e)
                    );
                    stream = None;
                }
            }
        }
    }

    fn send_commands(
        &mut self,
        s: &mut WatchStream,
        canceling: &mut bool,
    ) -> Result<(), EtcdError> {
        while let Ok(cmd) = self.commands.try_recv() {
            let mut req = pb::WatchRequest::new();
            match cmd {
                Command::Progress => {
                    self.asked_progress += 1;
                    req.set_progress_request(pb::WatchProgressRequest::new())
                }
                Command::Cancel => {
                    let mut c = pb::WatchCancelRequest::new();
                    c.watch_id = self.watch_id;
                    req.set_cancel_request(c);
                    *canceling = true;
                }
            }
            s.send(req, Instant::now() + self.inner.call_timeout, &self.stop)?;
        }
        Ok(())
    }

    fn handle(&mut self, resp: pb::WatchResponse, canceling: bool) -> Next {
        if resp.canceled {
            if !canceling {
                self.fail(canceled(&self.spec, &resp));
            }
            return Next::End;
        }
        if resp.created {
            return Next::Continue;
        }
        if resp.events.is_empty() {
            if self.asked_progress == 0 {
                return Next::Continue;
            }
            self.asked_progress -= 1;
            let revision = resp.header.revision;
            return self.deliver(WatchEvent::Progress { revision });
        }
        for ev in resp.events {
            let is_put = ev.type_.enum_value() == Ok(mvccpb::event::EventType::PUT);
            let kv = KeyValue::from_pb(ev.kv.unwrap_or_default());
            self.spec.next_revision = kv.mod_revision + 1;
            let event = if is_put {
                WatchEvent::Put(kv)
            } else {
                WatchEvent::Delete(kv)
            };
            if let Next::End = self.deliver(event) {
                return Next::End;
            }
        }
        Next::Continue
    }

    /// Hands an event over; the watch ends when nobody listens any more.
    fn deliver(&self, event: WatchEvent) -> Next {
        match self.events.send(Ok(event)) {
            Ok(()) => Next::Continue,
            Err(_) => Next::End,
        }
    }

    fn fail(&self, e: EtcdError) {
        log::warn!("etcd watch ended: {}", crate::error_chain(&e));
        let _ = self.events.send(Err(e));
    }
}
