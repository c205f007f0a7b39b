//! claimd: a node-side CSI volume agent. It claims, mounts and releases CSI
//! volumes for the allocations on a node, records every step durably, and
//! converges after its own restarts, plugin restarts and crashes.

pub mod config;
pub mod csi;
pub mod ids;
pub mod plugins;
pub mod retry;
pub mod shutdown;
pub mod threads;
