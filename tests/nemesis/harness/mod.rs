//! Harness of `tests/nemesis/main.rs`: a 3-member etcd cluster, three nodes
//! (agent, own plugin, own link to etcd), a seeded workload that writes
//! records into the volumes and reads them back, a seeded fault schedule
//! (overlapping faults, power cuts that lose what the design allows), and
//! the checker.
//!
//! Declared in tests/nemesis/main.rs as `harness`, next to the shared
//! `common` and `agent_support` (tests/support/).
#![allow(dead_code)]

pub mod checker;
pub mod etcd_cluster;
pub mod evidence;
pub mod faults;
pub mod fences;
pub mod nodes;
pub mod power_cut;
pub mod proxy;
pub mod rng;
pub mod workload;
