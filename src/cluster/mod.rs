//! Cluster mode's background work on each agent: this node's liveness
//! (`liveness`), the controller work it does for other nodes when it hosts
//! a plugin's controller side (`controller_host`), and the disconnect rule
//! (`disconnect`, `stop_after_disconnect`); how this node joins the
//! cluster and reconciles its claims after each registration (`member`).

mod controller_host;
mod disconnect;
mod host_work;
mod liveness;
mod member;
mod unreachable;
mod view;

pub use controller_host::ControllerHost;
pub use disconnect::{
    settings_entry, DisconnectRule, RuleParts, SelfReleaseParts, DISCONNECT_RELEASE_REASON,
};
pub use liveness::{Liveness, NodeLiveness, NodeRecord, RegistrationHooks};
pub use member::{connect, ClusterWork, JoinParts, Member, StartError};
pub use unreachable::{UnreachableHold, UnreachableHolds};
pub use view::{NodeSettings, NodeView, NodesSnapshot};
