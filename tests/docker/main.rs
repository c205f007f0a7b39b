//! claimd as the volume plugin of real Docker and Podman engines (Debian's
//! `docker.io` and `podman`, each test with its own daemon and data
//! directory): containers, the engines' mount references, the engine-death
//! rule, and the view of which engine mounts are in use.
//!
//! The shared harness is in `tests/support/`; this area's own (engines,
//! images, a world of agent and plugin per test) is `harness/`.

#[path = "../support/agent.rs"]
mod agent_support;
#[path = "../support/common/mod.rs"]
mod common;
#[path = "../support/etcd.rs"]
mod etcd_support;
mod harness;

mod engines;
mod rule;
mod view;
