//! One node's agent without a cluster: the CSI client against the real test
//! plugin, the plugin registry, the claim lifecycle at library level, the
//! agent binary and its CLI end to end, volume operations, observability,
//! the test plugin's own fence, and the restart and crash scripts.
//!
//! The suite is one test binary per area, as cargo's own test suite is
//! laid out: `local` (this one), `cluster`, `docker`, `nemesis` and
//! `project`. The harness every area shares is in `tests/support/`; an
//! area's own harness is its `harness/` module.

#[path = "../support/agent.rs"]
mod agent_support;
#[path = "../support/common/mod.rs"]
mod common;
mod harness;

mod agent_cli;
mod cli_usage;
mod csi_client;
mod lifecycle;
mod observability;
mod registry;
#[cfg(feature = "failpoints")]
mod restart;
mod test_plugin_fence;
mod volume_ops;
