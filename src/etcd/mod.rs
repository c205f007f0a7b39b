//! A thin blocking etcd v3 client (KV, Lease, Watch) over grpcio, for
//! cluster mode: no async runtime, a deadline on every call, failover
//! across endpoints, and errors that classify themselves.
//!
//! Callers see plain Rust values (`KeyValue`, `Compare`, `TxnOp`,
//! `WatchEvent`); the generated wire types stay inside this module. Keep-
//! alives and watches each run on a named thread that their handle owns
//! and stops (bounded) when dropped.

/// grpcio method descriptors and clients for etcd's KV, Watch and Lease.
#[allow(clippy::all, clippy::unwrap_used, dead_code)]
pub(crate) mod grpc {
    include!(concat!(env!("OUT_DIR"), "/etcd_grpc.rs"));
}

mod client;
pub mod endpoint;
mod error;
mod keepalive;
mod kv;
mod stream;
mod tls;
mod txn;
mod watch;
mod worker;

pub use client::{EtcdClient, EtcdOptions, DEFAULT_CALL_TIMEOUT};
pub use error::EtcdError;
pub use keepalive::{KeepAlive, RenewalClock};
pub use kv::{prefix_end, DeleteResponse, KeyValue, LeaseId, PutResponse, RangeResponse};
pub use tls::{ClientIdentity, TlsOptions};
pub use txn::{Compare, CompareOp, CompareTarget, TxnOp, TxnOpResponse, TxnResponse};
pub use watch::{WatchEvent, Watcher, AUTO_PROGRESS};
pub use worker::STOP_TIMEOUT;
