//! `KeepAlive`: keeps one lease alive from a named thread (`etcd-keepalive`)
//! over the LeaseKeepAlive stream, one request and one response per round
//! (as etcd's own `KeepAliveOnce` does), a round every third of the TTL.
//!
//! A broken stream is reopened (on the next endpoint if need be) with a
//! short backoff. "Lost" is etcd's word only: a response with TTL <= 0 or
//! NOT_FOUND. While etcd cannot be reached the lease is not reported lost;
//! `last_renewed` and `ttl` tell the caller how long it has been.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use grpcio::{CallOption, RpcStatusCode};
use parking_lot::Mutex;

use super::client::{EtcdClient, Inner};
use super::kv::LeaseId;
use super::stream::DuplexStream;
use super::worker::{StopSignal, Worker};
use super::EtcdError;
use crate::generated::etcd as pb;

type KeepAliveStream = DuplexStream<pb::LeaseKeepAliveRequest, pb::LeaseKeepAliveResponse>;

/// Never renew more often than this, whatever the TTL.
const MIN_INTERVAL: Duration = Duration::from_millis(500);
/// Backoff between attempts to reopen a broken stream.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// The last renewal etcd answered: when its request was *sent* (the lease
/// lives at least TTL from then, whatever the answer's delay), on both
/// clocks.
#[derive(Clone, Copy, Debug)]
struct Renewal {
    at: Instant,
    /// CLOCK_BOOTTIME at the send (counts through a suspend).
    sent_boottime: Duration,
    ttl: Duration,
}

/// When a round's request goes out.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Instant,
    boottime: Duration,
}

impl Sent {
    fn now() -> Sent {
        Sent {
            at: Instant::now(),
            boottime: crate::clock::boottime(),
        }
    }
}

struct Shared {
    last: Mutex<Renewal>,
    /// Dropped (so `lost` receivers wake) when etcd says the lease is gone.
    lost_tx: Mutex<Option<Sender<()>>>,
}

impl Shared {
    fn renewed(&self, sent: Sent, ttl: Duration) {
        *self.last.lock() = Renewal {
            at: sent.at,
            sent_boottime: sent.boottime,
            ttl,
        };
    }

    fn lose(&self) {
        drop(self.lost_tx.lock().take());
    }
}

/// Keeps a lease alive until dropped or stopped (the lease itself is left
/// to expire or to be revoked by the caller).
pub struct KeepAlive {
    lease: LeaseId,
    shared: Arc<Shared>,
    lost_rx: Receiver<()>,
    worker: Worker,
}

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepAlive")
            .field("lease", &self.lease)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl KeepAlive {
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// etcd said the lease is gone (expired or revoked).
    pub fn is_lost(&self) -> bool {
        self.shared.lost_tx.lock().is_none()
    }

    /// Becomes ready (disconnected) once etcd says the lease is gone: for
    /// `select!` next to a shutdown receiver.
    pub fn lost(&self) -> &Receiver<()> {
        &self.lost_rx
    }

    /// When the request of the last renewal etcd answered was sent.
    pub fn last_renewed(&self) -> Instant {
        self.shared.last.lock().at
    }

    /// The TTL etcd gave at the last renewal: the lease lives at least
    /// until `last_renewed() + ttl()`.
    pub fn ttl(&self) -> Duration {
        self.shared.last.lock().ttl
    }

    /// Stops the thread and waits for it (bounded); dropping does the same.
    pub fn stop(mut self) {
        self.worker.stop();
    }

    /// Reads the time of the last renewal from any thread, for as long as
    /// the handle lives (also after the lease is lost: it then keeps the
    /// last renewal that happened).
    pub fn renewal_clock(&self) -> RenewalClock {
        RenewalClock(self.shared.clone())
    }
}

/// See `KeepAlive::renewal_clock`.
#[derive(Clone)]
pub struct RenewalClock(Arc<Shared>);

impl RenewalClock {
    /// When the request of the last answered renewal was sent.
    pub fn last_renewed(&self) -> Instant {
        self.0.last.lock().at
    }

    /// The same, on CLOCK_BOOTTIME (`crate::clock::boottime`).
    pub fn last_sent_boottime(&self) -> Duration {
        self.0.last.lock().sent_boottime
    }

    /// The TTL etcd gave at the last renewal.
    pub fn ttl(&self) -> Duration {
        self.0.last.lock().ttl
    }
}

impl std::fmt::Debug for RenewalClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RenewalClock").finish()
    }
}

fn interval(ttl: Duration) -> Duration {
    (ttl / 3).max(MIN_INTERVAL)
}

/// One round: one request, one response; the TTL etcd answered (<= 0: the
/// lease is gone).
fn round(
    stream: &mut KeepAliveStream,
    lease: LeaseId,
    deadline: Instant,
    stop: &StopSignal,
) -> Result<i64, EtcdError> {
    let mut req = pb::LeaseKeepAliveRequest::new();
    req.ID = lease.0;
    stream.send(req, deadline, stop)?;
    Ok(stream.answer(deadline, stop)?.TTL)
}

/// Opens a stream on the first endpoint that answers and does one round.
fn open(
    inner: &Inner,
    lease: LeaseId,
    stop: &StopSignal,
) -> Result<(KeepAliveStream, i64, Sent), EtcdError> {
    let deadline = Instant::now() + round_timeout(inner.call_timeout, None);
    inner.with_endpoint("LeaseKeepAlive", deadline, true, stop, |ep, deadline| {
        let pair = ep
            .lease
            .lease_keep_alive(CallOption::default())
            .map_err(|e| EtcdError::from_grpc("LeaseKeepAlive", &ep.name, e))?;
        let mut stream = DuplexStream::new("LeaseKeepAlive", &ep.name, pair);
        let sent = Sent::now();
        let ttl = round(&mut stream, lease, deadline, stop)?;
        Ok((stream, ttl, sent))
    })
}

/// A round waits at most the call deadline, and never more than a third
/// of the TTL: a round that hangs must leave time for another inside the
/// lease's life.
fn round_timeout(call_timeout: Duration, ttl: Option<Duration>) -> Duration {
    match ttl {
        Some(ttl) => call_timeout.min(interval(ttl)),
        None => call_timeout,
    }
}

fn gone(e: &EtcdError) -> bool {
    e.code() == Some(RpcStatusCode::NOT_FOUND)
}

impl EtcdClient {
    /// Renews `lease` once (so that an unknown lease or an unreachable etcd
    /// is an error here), then keeps renewing it from a thread.
    pub fn keep_alive(&self, lease: LeaseId) -> Result<KeepAlive, EtcdError> {
        let (stream, ttl, sent) = match open(&self.inner, lease, &StopSignal::none()) {
            Ok((_, ttl, _)) if ttl <= 0 => return Err(EtcdError::LeaseNotFound { lease }),
            Err(e) if gone(&e) => return Err(EtcdError::LeaseNotFound { lease }),
            r => r?,
        };
        let ttl = Duration::from_secs(ttl.unsigned_abs());
        let (lost_tx, lost_rx) = crossbeam_channel::bounded(0);
        let shared = Arc::new(Shared {
            last: Mutex::new(Renewal {
                at: sent.at,
                sent_boottime: sent.boottime,
                ttl,
            }),
            lost_tx: Mutex::new(Some(lost_tx)),
        });
        let inner = self.inner.clone();
        let thread_shared = shared.clone();
        let worker = Worker::spawn("etcd-keepalive", move |stop| {
            run(&inner, lease, stream, ttl, &thread_shared, &stop);
        })?;
        Ok(KeepAlive {
            lease,
            shared,
            lost_rx,
            worker,
        })
    }
}

fn run(
    inner: &Inner,
    lease: LeaseId,
    stream: KeepAliveStream,
    ttl: Duration,
    shared: &Shared,
    stop: &StopSignal,
) {
    let mut stream = Some(stream);
    let mut next = interval(ttl);
    let mut backoff = RETRY_MIN;
    let mut failing = false;
    while stop.sleep(next) {
        let result = match stream.as_mut() {
            Some(s) => {
                let sent = Sent::now();
                let deadline = Instant::now() + round_timeout(inner.call_timeout, Some(ttl));
                round(s, lease, deadline, stop).map(|t| (t, sent))
            }
            None => open(inner, lease, stop).map(|(s, ttl, sent)| {
                stream = Some(s);
                (ttl, sent)
            }),
        };
        match result {
            Ok((ttl, sent)) if ttl > 0 => {
                let ttl = Duration::from_secs(ttl.unsigned_abs());
                shared.renewed(sent, ttl);
                if failing {
                    log::info!("etcd lease {lease}: renewed again");
                }
                (next, backoff, failing) = (interval(ttl), RETRY_MIN, false);
            }
            Ok(_) => {
                log::warn!("etcd lease {lease}: lost (etcd no longer knows it)");
                shared.lose();
                return;
            }
            Err(e) if gone(&e) => {
                log::warn!("etcd lease {lease}: lost: {}", crate::error_chain(&e));
                shared.lose();
                return;
            }
            Err(_) if stop.is_stopped() => return,
            Err(e) => {
                let msg = format!(
                    "etcd lease {lease}: keep-alive failed, retrying in {backoff:?}: {}",
                    crate::error_chain(&e)
                );
                if failing {
                    log::debug!("{msg}");
                } else {
                    log::warn!("{msg}");
                }
                stream = None;
                next = backoff;
                (backoff, failing) = ((backoff * 2).min(RETRY_MAX), true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renews_every_third_of_the_ttl_but_not_too_often() {
        assert_eq!(interval(Duration::from_secs(9)), Duration::from_secs(3));
        assert_eq!(interval(Duration::from_secs(1)), MIN_INTERVAL);
    }
}
