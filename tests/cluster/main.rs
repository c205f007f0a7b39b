//! Many agents against one real etcd: claims across nodes, the etcd client,
//! controller hosts, fencing, the storage index, the operator's commands,
//! partial failures (pauses, crashes and lost answers between two steps),
//! the safety rules, and TLS to etcd.
//!
//! The shared harness is in `tests/support/`; this area's own (nodes that
//! host controllers, a proxy that delays etcd's answers, ballast,
//! libfaketime) is `harness/`.

#[path = "../support/agent.rs"]
mod agent_support;
#[path = "../support/common/mod.rs"]
mod common;
#[path = "../support/etcd.rs"]
mod etcd_support;
mod harness;

mod claims;
mod controller;
mod etcd_client;
mod fencing;
mod index;
mod operator;
mod partial_failures;
mod safety;
#[cfg(feature = "tls")]
mod tls;
