//! claimd: a node-side CSI volume agent. It claims, mounts and releases CSI
//! volumes for the allocations on a node, records every step durably, and
//! converges after its own restarts, plugin restarts and crashes.

/// Messages generated from `proto/*.proto` (rust-protobuf, in OUT_DIR).
#[allow(clippy::all, clippy::pedantic, clippy::unwrap_used)]
pub mod generated {
    include!(concat!(env!("OUT_DIR"), "/protos/mod.rs"));
}

pub mod agent;
pub mod api;
pub mod claims;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod csi;
pub mod docker;
pub mod etcd;
pub mod failpoints;
pub mod heap;
pub mod ids;
pub mod lifecycle;
pub mod metrics;
pub mod mounts;
pub mod observe;
pub mod plugins;
pub mod retry;
pub mod shutdown;
pub mod state;
pub mod systemd;
pub mod threads;
pub mod volumes;

/// An error and its sources, joined with ": " (how errors are printed once).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}
