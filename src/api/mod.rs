//! The local API (`proto/claimd.proto`): the grpcio server on a unix socket
//! (mode 0600) and the conversions between its messages and the library's
//! types. Every request runs on a named thread of its own (a mount on a
//! new one, others on pooled ones), so a mount waiting for a plugin or a
//! held claim never blocks gRPC's completion queue nor another request.

use std::fmt;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::observe::Observer;
use crate::threads::Threads;

/// The wire messages of the local API.
pub use crate::generated::claimd as wire;

/// grpcio method descriptors, the blocking client and the server trait.
#[allow(clippy::all, clippy::unwrap_used)]
pub mod grpc {
    include!(concat!(env!("OUT_DIR"), "/claimd_grpc.rs"));
}

/// How long a request thread waits for its reply to be delivered.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest wait a release request may ask for.
pub const MAX_RELEASE_WAIT: Duration = Duration::from_secs(3600);

mod convert;
mod service;

pub use convert::*;
use service::Service;

#[derive(Debug)]
pub enum ApiError {
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
        source: grpcio::Error,
    },
    Chmod {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Dir { path, .. } => {
                write!(
                    f,
                    "failed to create the API socket directory {}",
                    path.display()
                )
            }
            ApiError::InUse { path } => write!(
                f,
                "another agent is already serving the API socket {}",
                path.display()
            ),
            ApiError::RemoveStale { path, .. } => {
                write!(
                    f,
                    "failed to remove the stale API socket {}",
                    path.display()
                )
            }
            ApiError::Bind { path, .. } => {
                write!(f, "failed to listen on the API socket {}", path.display())
            }
            ApiError::Chmod { path, .. } => {
                write!(
                    f,
                    "failed to set mode 0600 on the API socket {}",
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ApiError::Dir { source, .. }
            | ApiError::RemoveStale { source, .. }
            | ApiError::Chmod { source, .. } => Some(source),
            ApiError::Bind { source, .. } => Some(source),
            ApiError::InUse { .. } => None,
        }
    }
}

/// The running API server.
pub struct ApiServer {
    server: Option<grpcio::Server>,
    socket: PathBuf,
    threads: Arc<Mutex<Option<Threads>>>,
}

impl ApiServer {
    /// Listens on `socket` (replacing a stale socket left by a dead agent;
    /// refusing one a live agent answers on) with mode 0600.
    pub fn start(
        env: Arc<grpcio::Environment>,
        socket: &Path,
        observer: Observer,
    ) -> Result<ApiServer, ApiError> {
        if let Some(dir) = socket.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| ApiError::Dir {
                    path: dir.to_path_buf(),
                    source,
                })?;
        }
        if socket.exists() {
            if UnixStream::connect(socket).is_ok() {
                return Err(ApiError::InUse {
                    path: socket.to_path_buf(),
                });
            }
            log::info!("removing stale API socket {}", socket.display());
            std::fs::remove_file(socket).map_err(|source| ApiError::RemoveStale {
                path: socket.to_path_buf(),
                source,
            })?;
        }
        let threads = Arc::new(Mutex::new(Some(Threads::new())));
        let service = grpc::create_claimd(Service {
            lifecycle: observer.lifecycle.clone(),
            registry: observer.registry.clone(),
            observer,
            threads: threads.clone(),
        });
        // The socket is created with the process umask; tighten it first so
        // the socket is never reachable by others, then set 0600 for sure.
        // SAFETY: umask only changes this process's file-creation mask.
        let old = unsafe { libc::umask(0o177) };
        let built = grpcio::ServerBuilder::new(env)
            .register_service(service)
            .build()
            .and_then(|mut s| {
                s.add_listening_port(
                    format!("unix:{}", socket.display()),
                    grpcio::ServerCredentials::insecure(),
                )?;
                Ok(s)
            });
        // SAFETY: restores the previous mask.
        unsafe { libc::umask(old) };
        let mut server = built.map_err(|source| ApiError::Bind {
            path: socket.to_path_buf(),
            source,
        })?;
        server.start();
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(
            |source| ApiError::Chmod {
                path: socket.to_path_buf(),
                source,
            },
        )?;
        log::info!("API listening on {}", socket.display());
        Ok(ApiServer {
            server: Some(server),
            socket: socket.to_path_buf(),
            threads,
        })
    }

    /// Stops taking requests (in-flight calls are cancelled), removes the
    /// socket, and joins request threads up to `deadline`.
    pub fn stop(&mut self, deadline: Instant) -> Vec<String> {
        drop(self.server.take());
        let _ = std::fs::remove_file(&self.socket);
        let threads = self.threads.lock().take();
        threads.map(|t| t.join_until(deadline)).unwrap_or_default()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if self.server.is_some() {
            self.stop(Instant::now());
        }
    }
}

/// A blocking client of the local API.
pub struct ApiClient {
    client: grpc::ClaimdClient,
    socket: PathBuf,
}

impl ApiClient {
    pub fn new(env: Arc<grpcio::Environment>, socket: &Path) -> ApiClient {
        let channel =
            grpcio::ChannelBuilder::new(env).connect(&format!("unix:{}", socket.display()));
        ApiClient {
            client: grpc::ClaimdClient::new(channel),
            socket: socket.to_path_buf(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn raw(&self) -> &grpc::ClaimdClient {
        &self.client
    }
}
