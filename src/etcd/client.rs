//! `EtcdClient`: blocking KV and Lease calls over grpcio, one channel per
//! endpoint, failover across endpoints, a deadline on every call.
//!
//! Failover: a call starts at the endpoint that last worked; an endpoint
//! that does not connect within its share of the deadline is skipped (the
//! request was never sent, so this is safe for every call). A request that
//! was sent and failed with UNAVAILABLE is sent again to the next endpoint
//! only when it is a read; a write returns the (retryable) error. After
//! UNAVAILABLE or DEADLINE_EXCEEDED the next call starts at the next
//! endpoint.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grpcio::{CallOption, Channel, ChannelBuilder, ConnectivityState, Environment, RpcStatusCode};

use super::endpoint::{parse_endpoint, Scheme};
use super::grpc::{KVClient as KvClient, LeaseClient, WatchClient};
use super::kv::{prefix_end, DeleteResponse, KeyValue, LeaseId, PutResponse, RangeResponse};
use super::tls::{closed_after_handshake, TlsOptions};
use super::txn::{delete_request, put_request, range_request, Compare, TxnOp, TxnResponse};
use super::worker::StopSignal;
use super::EtcdError;
use crate::generated::etcd as pb;

/// Default deadline of one etcd call (etcdctl's `--command-timeout` is 5s).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Keys per Range of [`EtcdClient::range_prefix`]: 1,000 claims are about
/// 0.4 MB, far below gRPC's 4 MiB receive limit and etcd's 1.5 MiB
/// request limit.
pub const RANGE_PAGE: i64 = 1000;

/// How a client connects.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// The deadline of every unary call, connecting included; also bounds
    /// each send and receive on a keep-alive or watch stream.
    pub call_timeout: Duration,
    /// TLS for every endpoint; `None`: plain TCP.
    pub tls: Option<TlsOptions>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            call_timeout: DEFAULT_CALL_TIMEOUT,
            tls: None,
        }
    }
}

/// One etcd member: its address and the stubs on its channel.
pub(crate) struct Endpoint {
    /// `host:port`, as logged and shown in errors.
    pub(crate) name: String,
    channel: Channel,
    pub(crate) kv: KvClient,
    pub(crate) lease: LeaseClient,
    pub(crate) watch: WatchClient,
}

impl Endpoint {
    /// True once the channel is connected; false when a connection attempt
    /// fails, `deadline` passes or the owner stops first. Nothing is sent.
    ///
    /// A failed channel stays in TRANSIENT_FAILURE (gRPC's pick-first is
    /// "sticky") while it retries in the background every
    /// `MAX_RECONNECT_BACKOFF` at most, and turns READY when the member is
    /// back: until then it counts as down at once, like gRPC's own
    /// fail-fast calls, and the next endpoint gets the time.
    fn connect_by(&self, deadline: Instant, stop: &StopSignal) -> bool {
        let mut state = self.channel.check_connectivity_state(true);
        loop {
            match state {
                ConnectivityState::GRPC_CHANNEL_READY => return true,
                ConnectivityState::GRPC_CHANNEL_TRANSIENT_FAILURE
                | ConnectivityState::GRPC_CHANNEL_SHUTDOWN => return false,
                // IDLE starts connecting; CONNECTING ends one way or the other.
                _ => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let changed = self.channel.wait_for_state_change(state, left);
            let deadline = deadline + Duration::from_millis(100);
            if !stop.wait(changed, deadline, || false).unwrap_or(false) {
                return false;
            }
            state = self.channel.check_connectivity_state(true);
        }
    }

    /// Why the channel failed to connect, in gRPC's words ("Connection
    /// refused", "Ssl handshake failed: … certificate verify failed"); None
    /// while it is not in TRANSIENT_FAILURE (still connecting, say).
    ///
    /// gRPC keeps the last connection error only in the status of the calls
    /// it fails: on a channel in TRANSIENT_FAILURE a fail-fast call fails at
    /// once, before anything is sent. The probe is a read, so a channel that
    /// connects in between gets a harmless Range.
    fn failure_reason(&self) -> Option<String> {
        if self.channel.check_connectivity_state(false)
            != ConnectivityState::GRPC_CHANNEL_TRANSIENT_FAILURE
        {
            return None;
        }
        let req = range_request(FAILURE_PROBE_KEY, b"");
        match self
            .kv
            .range(&req, CallOption::default().timeout(FAILURE_PROBE_TIMEOUT))
        {
            Err(grpcio::Error::RpcFailure(s)) if s.code() == RpcStatusCode::UNAVAILABLE => {
                let m = s.message();
                let m = m
                    .strip_prefix("failed to connect to all addresses; last error: ")
                    .unwrap_or(m);
                (!m.is_empty()).then(|| m.to_string())
            }
            _ => None,
        }
    }
}

/// The key `failure_reason` reads, should its probe reach etcd.
const FAILURE_PROBE_KEY: &[u8] = b"\0claimd-connection-probe";
/// How long `failure_reason` waits: a failed channel answers at once; only
/// one that connected meanwhile sends the read.
const FAILURE_PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// A reconnecting channel retries at most this far apart, so that a
/// restarted member is used again within about a second.
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(1);

pub(crate) struct Inner {
    pub(crate) endpoints: Vec<Endpoint>,
    /// The endpoint that last worked: calls start there.
    current: AtomicUsize,
    pub(crate) call_timeout: Duration,
    /// What a connection closed right after the TLS handshake may mean for
    /// this client's settings; None without TLS.
    tls_hint: Option<&'static str>,
    // Keeps the completion-queue threads alive as long as the channels.
    _env: Arc<Environment>,
}

impl Inner {
    /// Runs `attempt` on the first endpoint that connects, starting with
    /// the one that last worked, within `deadline`. `retry_unavailable`:
    /// an attempt that failed with UNAVAILABLE (sent, maybe applied) goes on
    /// to the next endpoint; only for requests that are safe to repeat.
    /// `stop` interrupts the connection waits of a stream's thread.
    pub(crate) fn with_endpoint<T>(
        &self,
        method: &'static str,
        deadline: Instant,
        retry_unavailable: bool,
        stop: &StopSignal,
        mut attempt: impl FnMut(&Endpoint, Instant) -> Result<T, EtcdError>,
    ) -> Result<T, EtcdError> {
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = None;
        let mut connect_error = None;
        for k in 0..n {
            let i = (first + k) % n;
            let ep = &self.endpoints[i];
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // Each endpoint left gets an equal share of the time left.
            let share = (deadline - now) / u32::try_from(n - k).unwrap_or(u32::MAX);
            if !ep.connect_by(now + share, stop) {
                let reason = ep.failure_reason();
                log::debug!(
                    "etcd {method}: {} did not connect{}",
                    ep.name,
                    reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                );
                connect_error = reason.or(connect_error);
                continue;
            }
            let started = Instant::now();
            let result = attempt(ep, deadline);
            log::debug!(
                "etcd {method} endpoint={} took={:?} result={}",
                ep.name,
                started.elapsed(),
                match &result {
                    Ok(_) => "OK".to_string(),
                    Err(e) => e.to_string(),
                }
            );
            match result {
                Ok(v) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) if e.is_unavailable() && retry_unavailable => {
                    self.current.store((i + 1) % n, Ordering::Relaxed);
                    last = Some(e);
                }
                Err(e) => {
                    // A member that is down, or connected but silent (a
                    // partition keeps TCP open until HTTP/2 keepalive gives
                    // up): the next call starts at the next endpoint.
                    if e.is_unavailable() || e.code() == Some(RpcStatusCode::DEADLINE_EXCEEDED) {
                        self.current.store((i + 1) % n, Ordering::Relaxed);
                    }
                    return Err(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| EtcdError::Unreachable {
            method,
            endpoints: self.endpoints.iter().map(|e| e.name.clone()).collect(),
            timeout: self.call_timeout,
            hint: self
                .tls_hint
                .filter(|_| connect_error.as_deref().is_some_and(closed_after_handshake)),
            connect_error,
        }))
    }

    /// One unary call under the call deadline.
    fn unary<T>(
        &self,
        method: &'static str,
        retry_unavailable: bool,
        call: impl Fn(&Endpoint, CallOption) -> grpcio::Result<T>,
    ) -> Result<T, EtcdError> {
        let started = Instant::now();
        let deadline = started + self.call_timeout;
        let stop = StopSignal::none();
        let result = self.with_endpoint(
            method,
            deadline,
            retry_unavailable,
            &stop,
            |ep, deadline| {
                let left = deadline.saturating_duration_since(Instant::now());
                call(ep, CallOption::default().timeout(left))
                    .map_err(|e| EtcdError::from_grpc(method, &ep.name, e))
            },
        );
        crate::metrics::ETCD_REQUESTS.observe(
            &[method, if result.is_ok() { "ok" } else { "error" }],
            started.elapsed().as_secs_f64(),
        );
        result
    }
}

/// A blocking etcd v3 client. Cheap to clone; clones share the channels.
#[derive(Clone)]
pub struct EtcdClient {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.endpoints())
            .field("call_timeout", &self.inner.call_timeout)
            .finish()
    }
}

impl EtcdClient {
    /// Checks the endpoints (`host:port`, `http://host:port`,
    /// `https://host:port`, IPv6 as `[::1]:2379`) and creates one channel
    /// per endpoint. Nothing is sent: an etcd that is down shows as a
    /// retryable error on the first call.
    pub fn connect(endpoints: &[String], options: EtcdOptions) -> Result<EtcdClient, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let parsed = endpoints
            .iter()
            .map(|e| parse_endpoint(e))
            .collect::<Result<Vec<_>, _>>()?;
        for (given, (_, scheme)) in endpoints.iter().zip(&parsed) {
            let mismatch = match scheme {
                Scheme::Http => options.tls.is_some(),
                Scheme::Https => options.tls.is_none(),
                Scheme::Unspecified => false,
            };
            if mismatch {
                return Err(EtcdError::TlsMismatch {
                    endpoint: given.clone(),
                });
            }
        }
        let credentials = match &options.tls {
            Some(tls) => Some(tls.credentials()?),
            None => None,
        };
        let env = Arc::new(
            grpcio::EnvBuilder::new()
                .cq_count(1)
                .name_prefix("grpc-etcd")
                .build(),
        );
        let endpoints = parsed
            .into_iter()
            .map(|(addr, _)| {
                let builder = ChannelBuilder::new(env.clone())
                    .initial_reconnect_backoff(Duration::from_millis(100))
                    .max_reconnect_backoff(MAX_RECONNECT_BACKOFF)
                    // HTTP/2 pings find a dead connection under a silent
                    // watch; etcd refuses pings more often than every 5s and
                    // pings without a call at all.
                    .keepalive_time(Duration::from_secs(10))
                    .keepalive_timeout(Duration::from_secs(5))
                    .keepalive_permit_without_calls(false);
                let channel = match &credentials {
                    Some(c) => super::tls::secure_channel(builder, c, &addr),
                    None => builder.connect(&addr),
                };
                Endpoint {
                    name: addr,
                    kv: KvClient::new(channel.clone()),
                    lease: LeaseClient::new(channel.clone()),
                    watch: WatchClient::new(channel.clone()),
                    channel,
                }
            })
            .collect();
        Ok(EtcdClient {
            inner: Arc::new(Inner {
                endpoints,
                current: AtomicUsize::new(0),
                call_timeout: options.call_timeout,
                tls_hint: options.tls.as_ref().map(TlsOptions::closed_hint),
                _env: env,
            }),
        })
    }

    /// The endpoints as `host:port`, in the order given.
    pub fn endpoints(&self) -> Vec<String> {
        self.inner
            .endpoints
            .iter()
            .map(|e| e.name.clone())
            .collect()
    }

    /// The endpoint the next call starts at (the one that last worked).
    pub fn current_endpoint(&self) -> String {
        let i = self.inner.current.load(Ordering::Relaxed);
        self.inner.endpoints[i].name.clone()
    }

    pub fn call_timeout(&self) -> Duration {
        self.inner.call_timeout
    }

    /// Reads `[key, range_end)`; `key` alone when `range_end` is empty.
    pub fn range(
        &self,
        key: impl AsRef<[u8]>,
        range_end: impl AsRef<[u8]>,
    ) -> Result<RangeResponse, EtcdError> {
        let req = range_request(key.as_ref(), range_end.as_ref());
        let r = self
            .inner
            .unary("Range", true, |ep, o| ep.kv.range(&req, o))?;
        Ok(RangeResponse::from_pb(r))
    }

    /// Reads every key that starts with `prefix`, at one revision: in
    /// pages of [`RANGE_PAGE`] keys, so that a prefix of any size (the
    /// cluster's `claims/` on a start-up reconciliation) never makes an
    /// answer that nears gRPC's or etcd's message limits. A prefix with
    /// fewer keys is one call.
    pub fn range_prefix(&self, prefix: impl AsRef<[u8]>) -> Result<RangeResponse, EtcdError> {
        let prefix = prefix.as_ref();
        let mut req = range_request(prefix, &prefix_end(prefix));
        req.limit = RANGE_PAGE;
        let mut out: Option<RangeResponse> = None;
        loop {
            let r = self
                .inner
                .unary("Range", true, |ep, o| ep.kv.range(&req, o))?;
            let more = r.more;
            let page = RangeResponse::from_pb(r);
            // The next page starts right after this one's last key.
            let next = page.kvs.last().map(|kv| {
                let mut k = kv.key.clone();
                k.push(0);
                k
            });
            match &mut out {
                Some(o) => o.kvs.extend(page.kvs),
                None => {
                    // Later pages are read at the first one's revision.
                    req.revision = page.revision;
                    out = Some(page);
                }
            }
            match next {
                Some(k) if more => req.key = k,
                _ => break,
            }
        }
        Ok(out.unwrap_or_default())
    }

    /// Reads one key.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<KeyValue>, EtcdError> {
        Ok(self.range(key, b"")?.kvs.into_iter().next())
    }

    pub fn put(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
    ) -> Result<PutResponse, EtcdError> {
        self.put_request(put_request(key.as_ref(), value.as_ref(), None))
    }

    /// Puts a key that etcd deletes when `lease` ends.
    pub fn put_with_lease(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        lease: LeaseId,
    ) -> Result<PutResponse, EtcdError> {
        self.put_request(put_request(key.as_ref(), value.as_ref(), Some(lease)))
    }

    fn put_request(&self, req: pb::PutRequest) -> Result<PutResponse, EtcdError> {
        let r = self.inner.unary("Put", false, |ep, o| ep.kv.put(&req, o))?;
        Ok(PutResponse {
            revision: r.header.revision,
        })
    }

    /// Deletes `[key, range_end)`; `key` alone when `range_end` is empty.
    pub fn delete_range(
        &self,
        key: impl AsRef<[u8]>,
        range_end: impl AsRef<[u8]>,
    ) -> Result<DeleteResponse, EtcdError> {
        let req = delete_request(key.as_ref(), range_end.as_ref());
        let r = self
            .inner
            .unary("DeleteRange", false, |ep, o| ep.kv.delete_range(&req, o))?;
        Ok(DeleteResponse {
            revision: r.header.revision,
            deleted: r.deleted,
        })
    }

    /// Deletes every key that starts with `prefix`.
    pub fn delete_prefix(&self, prefix: impl AsRef<[u8]>) -> Result<DeleteResponse, EtcdError> {
        let prefix = prefix.as_ref();
        self.delete_range(prefix, prefix_end(prefix))
    }

    /// If every compare holds, runs `success`, else `failure`, atomically.
    /// A failed compare is `succeeded == false`, not an error.
    pub fn txn(
        &self,
        compares: &[Compare],
        success: &[TxnOp],
        failure: &[TxnOp],
    ) -> Result<TxnResponse, EtcdError> {
        let mut req = pb::TxnRequest::new();
        req.compare = compares.iter().map(Compare::to_pb).collect();
        req.success = success.iter().map(TxnOp::to_pb).collect();
        req.failure = failure.iter().map(TxnOp::to_pb).collect();
        let r = self.inner.unary("Txn", false, |ep, o| ep.kv.txn(&req, o))?;
        Ok(TxnResponse::from_pb(r))
    }

    /// Grants a lease of `ttl` (whole seconds, at least one; etcd may raise
    /// it to its minimum, about two seconds).
    pub fn lease_grant(&self, ttl: Duration) -> Result<LeaseId, EtcdError> {
        let mut req = pb::LeaseGrantRequest::new();
        req.TTL = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let r = self
            .inner
            .unary("LeaseGrant", false, |ep, o| ep.lease.lease_grant(&req, o))?;
        if r.ID == 0 {
            return Err(EtcdError::BadReply {
                method: "LeaseGrant",
                what: "a lease ID",
            });
        }
        Ok(LeaseId(r.ID))
    }

    /// Ends the lease and deletes its keys. A lease etcd no longer knows is
    /// already gone: that is success.
    pub fn lease_revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        let mut req = pb::LeaseRevokeRequest::new();
        req.ID = lease.0;
        match self
            .inner
            .unary("LeaseRevoke", true, |ep, o| ep.lease.lease_revoke(&req, o))
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some(RpcStatusCode::NOT_FOUND) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The lease's remaining time to live; `None` when etcd no longer
    /// knows it (expired or revoked).
    pub fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, EtcdError> {
        let mut req = pb::LeaseTimeToLiveRequest::new();
        req.ID = lease.0;
        let r = self.inner.unary("LeaseTimeToLive", true, |ep, o| {
            ep.lease.lease_time_to_live(&req, o)
        });
        match r {
            Ok(r) if r.TTL < 0 => Ok(None),
            Ok(r) => Ok(Some(Duration::from_secs(r.TTL.unsigned_abs()))),
            Err(e) if e.code() == Some(RpcStatusCode::NOT_FOUND) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
