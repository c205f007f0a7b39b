//! The Docker volume plugin protocol, which Docker and Podman both speak:
//! HTTP/1.1 POST with JSON bodies on a unix socket (`server`), the
//! requests and answers on the wire (`protocol`), what `Create`'s options
//! mean (`options`), and each request turned into calls of the same
//! [`Lifecycle`](crate::lifecycle::Lifecycle) facade the local API uses
//! (`driver`), whose turn it is to decide about an engine mount
//! (`references`), the engine-death rule (`unused`: mounts no container
//! uses any more are released), and what Get, List, Path and Mount read
//! (`view`: the registrations as the agent holds them, and the plugin's
//! notes on the volumes engines created). No lifecycle logic lives here.
//!
//! One allocation per mount ID: `Mount {Name, ID}` mounts volume `Name`
//! for allocation `docker-<ID>-<Name>` (see [`alloc_id`]), and the
//! volume's staging is shared on the node as for any two allocations.
//! The IDs the engines send (read in their sources):
//! - Docker: a random ID per container mount, kept while the container
//!   runs and sent again with Mount and Unmount around `docker cp` (and
//!   the archive reads behind it) of a running container; so each
//!   container holds its own claim and target path, and the access modes
//!   read per container.
//! - Podman: one constant ID (libpod's `pseudoCtrID`) for every mount of
//!   every volume; Podman counts its containers' mounts itself and sends
//!   Mount for the first and Unmount after the last. Its containers share
//!   one allocation per volume per node, and the access modes read per
//!   node.
//!
//! So the allocation counts references, durably in its record: a Mount of
//! an allocation that is mounted adds one and answers the same path; an
//! Unmount drops one and releases the allocation at the last.

/// The one mount ID Podman sends (libpod's `pseudoCtrID`: the SHA-256 of
/// "placeholder\n").
pub const PODMAN_MOUNT_ID: &str =
    "2f73349cfc4630255319c6c8dfc1b46a8996ace9d14d8e07563b165915918ec2";

mod driver;
mod engines;
mod options;
mod protocol;
mod references;
mod server;
mod unused;
mod view;

use std::fmt;
use std::path::PathBuf;

pub use driver::{alloc_id, Driver, ALLOC_PREFIX};
pub use options::{Definition, OptionError};
pub use server::start;
pub use unused::RuleHealth;

/// Why the protocol cannot be served.
#[derive(Debug)]
pub enum DockerError {
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    InUse {
        path: PathBuf,
    },
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    Serve {
        path: PathBuf,
        reason: String,
    },
    Thread(std::io::Error),
}

impl fmt::Display for DockerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DockerError::Dir { path, .. } => write!(
                f,
                "failed to create the Docker plugin socket directory {}",
                path.display()
            ),
            DockerError::InUse { path } => write!(
                f,
                "another process already serves the Docker plugin socket {}",
                path.display()
            ),
            DockerError::RemoveStale { path, .. } => write!(
                f,
                "failed to remove the stale Docker plugin socket {}",
                path.display()
            ),
            DockerError::Bind { path, .. } => write!(
                f,
                "failed to listen on the Docker plugin socket {}",
                path.display()
            ),
            DockerError::Serve { path, reason } => write!(
                f,
                "failed to serve the Docker plugin socket {}: {reason}",
                path.display()
            ),
            DockerError::Thread(_) => f.write_str("failed to start the Docker plugin thread"),
        }
    }
}

impl std::error::Error for DockerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DockerError::Dir { source, .. }
            | DockerError::RemoveStale { source, .. }
            | DockerError::Bind { source, .. } => Some(source),
            DockerError::Thread(source) => Some(source),
            DockerError::InUse { .. } | DockerError::Serve { .. } => None,
        }
    }
}
