//! Harness of `tests/nemesis.rs`: a 3-member etcd cluster, three nodes
//! (agent, own plugin, own link to etcd), a seeded workload that writes
//! records into the volumes, a seeded fault schedule, and the checker.
//!
//! Used as `mod nemesis_support;` next to `mod common;` and
//! `mod agent_support;`.
#![allow(dead_code)]

pub mod checker;
pub mod etcd_cluster;
pub mod faults;
pub mod nodes;
pub mod proxy;
pub mod rng;
pub mod workload;
