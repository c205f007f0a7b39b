//! `EtcdError`: every way an etcd call can fail, classified by the error
//! itself (`is_retryable`). A failed compare is not an error: it is
//! `succeeded == false` in the transaction's response.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use grpcio::RpcStatusCode;

use super::LeaseId;
use crate::csi::code_name;

/// A failed etcd call or a client that could not be set up.
#[derive(Debug)]
pub enum EtcdError {
    /// `connect` was given no endpoint.
    NoEndpoints,
    /// An endpoint string that is not `[http://|https://]host:port`.
    BadEndpoint {
        endpoint: String,
        reason: &'static str,
    },
    /// TLS settings were given, or an `https://` endpoint, but this build
    /// has no TLS (cargo feature `tls`).
    TlsNotBuilt,
    /// An `https://` endpoint without TLS settings, or an `http://` one with.
    TlsMismatch { endpoint: String },
    /// A certificate or key file could not be read.
    TlsFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A certificate or key file that is not PEM of the kind it should be.
    /// The reason never quotes the file's contents.
    TlsNotPem {
        path: PathBuf,
        kind: &'static str,
        reason: String,
    },
    /// No endpoint could be connected to before the call's deadline (each
    /// refused, failed recently, or did not finish connecting in time).
    Unreachable {
        method: &'static str,
        endpoints: Vec<String>,
        timeout: Duration,
        /// The last connection error gRPC gave ("Connection refused", a
        /// failed TLS handshake), when one failed rather than timed out.
        connect_error: Option<String>,
        /// What the connection error may mean for this client's settings
        /// (a TLS client whose certificate etcd does not accept).
        hint: Option<&'static str>,
    },
    /// etcd answered with a gRPC status other than OK. UNAVAILABLE covers
    /// "no leader" and a connection lost mid-call; DEADLINE_EXCEEDED a call
    /// that may or may not have been applied.
    Status {
        method: &'static str,
        endpoint: String,
        code: RpcStatusCode,
        message: String,
    },
    /// The call could not be carried out by the gRPC library itself.
    Transport {
        method: &'static str,
        endpoint: String,
        source: Box<grpcio::Error>,
    },
    /// A keep-alive or watch stream broke: no answer within the call
    /// deadline, or the server closed it.
    StreamBroken {
        method: &'static str,
        endpoint: String,
        reason: &'static str,
    },
    /// etcd's reply lacks what the call needs.
    BadReply {
        method: &'static str,
        what: &'static str,
    },
    /// etcd no longer knows the lease: it expired or was revoked.
    LeaseNotFound { lease: LeaseId },
    /// A watch's start revision has been compacted away: watch again from
    /// a fresh Range's revision.
    Compacted {
        start_revision: i64,
        compact_revision: i64,
    },
    /// etcd cancelled the watch for another reason.
    WatchCanceled { reason: String },
    /// The watch or keep-alive was stopped by its owner.
    Stopped,
    /// A thread could not be started.
    Spawn {
        thread: &'static str,
        source: std::io::Error,
    },
}

impl EtcdError {
    /// Transient: the same call may succeed later (after a backoff). A call
    /// that failed this way with DEADLINE_EXCEEDED or UNAVAILABLE may still
    /// have been applied; guard writes with compares so that a retry is safe.
    pub fn is_retryable(&self) -> bool {
        match self {
            EtcdError::Unreachable { .. }
            | EtcdError::Transport { .. }
            | EtcdError::StreamBroken { .. } => true,
            EtcdError::Status { code, .. } => matches!(
                *code,
                RpcStatusCode::UNAVAILABLE
                    | RpcStatusCode::DEADLINE_EXCEEDED
                    | RpcStatusCode::RESOURCE_EXHAUSTED
                    | RpcStatusCode::ABORTED
            ),
            _ => false,
        }
    }

    /// The gRPC status code, when etcd answered with one.
    pub fn code(&self) -> Option<RpcStatusCode> {
        match self {
            EtcdError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// UNAVAILABLE, a transport failure or a broken stream: another
    /// endpoint may answer.
    pub(crate) fn is_unavailable(&self) -> bool {
        matches!(
            self,
            EtcdError::Transport { .. } | EtcdError::StreamBroken { .. }
        ) || self.code() == Some(RpcStatusCode::UNAVAILABLE)
    }

    pub(crate) fn from_grpc(method: &'static str, endpoint: &str, e: grpcio::Error) -> EtcdError {
        match e {
            grpcio::Error::RpcFailure(status) => EtcdError::Status {
                method,
                endpoint: endpoint.to_string(),
                code: status.code(),
                message: status.message().to_string(),
            },
            e @ grpcio::Error::Codec(_) => EtcdError::Transport {
                method,
                endpoint: endpoint.to_string(),
                source: Box::new(e),
            },
            // A stream that ended with a status reports it here.
            grpcio::Error::RpcFinished(Some(status)) => EtcdError::Status {
                method,
                endpoint: endpoint.to_string(),
                code: status.code(),
                message: status.message().to_string(),
            },
            e => EtcdError::Transport {
                method,
                endpoint: endpoint.to_string(),
                source: Box::new(e),
            },
        }
    }
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdError::NoEndpoints => write!(f, "no etcd endpoint is configured"),
            EtcdError::BadEndpoint { endpoint, reason } => {
                write!(f, "etcd endpoint {endpoint:?} is not valid: {reason}")
            }
            EtcdError::TlsNotBuilt => write!(
                f,
                "etcd over TLS needs a claimd built with the `tls` feature"
            ),
            EtcdError::TlsMismatch { endpoint } => write!(
                f,
                "etcd endpoint {endpoint} does not match the TLS settings \
                 (https:// needs them, http:// excludes them)"
            ),
            EtcdError::TlsFile { path, .. } => {
                write!(f, "failed to read TLS file {}", path.display())
            }
            EtcdError::TlsNotPem { path, kind, reason } => write!(
                f,
                "TLS file {} is not a PEM {kind}: {reason}",
                path.display()
            ),
            EtcdError::Unreachable {
                method,
                endpoints,
                timeout,
                connect_error,
                hint,
            } => {
                write!(
                    f,
                    "etcd {method} failed: no endpoint of {} could be connected to \
                     within the {timeout:?} call deadline",
                    endpoints.join(",")
                )?;
                match (connect_error, hint) {
                    (Some(e), Some(h)) => write!(f, " (last connection error: {e}; {h})"),
                    (Some(e), None) => write!(f, " (last connection error: {e})"),
                    _ => Ok(()),
                }
            }
            EtcdError::Status {
                method,
                endpoint,
                code,
                message,
            } => {
                write!(
                    f,
                    "etcd {method} at {endpoint} failed: {}",
                    code_name(*code)
                )?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                Ok(())
            }
            EtcdError::Transport {
                method, endpoint, ..
            } => write!(f, "etcd {method} at {endpoint} could not be carried out"),
            EtcdError::StreamBroken {
                method,
                endpoint,
                reason,
            } => write!(f, "etcd {method} stream at {endpoint} broke: {reason}"),
            EtcdError::BadReply { method, what } => {
                write!(f, "etcd {method} answered without {what}")
            }
            EtcdError::LeaseNotFound { lease } => {
                write!(f, "etcd lease {lease} is gone (expired or revoked)")
            }
            EtcdError::Compacted {
                start_revision,
                compact_revision,
            } => write!(
                f,
                "etcd watch from revision {start_revision} is impossible: \
                 history is compacted up to {compact_revision}"
            ),
            EtcdError::WatchCanceled { reason } => {
                write!(f, "etcd cancelled the watch")?;
                if !reason.is_empty() {
                    write!(f, ": {reason}")?;
                }
                Ok(())
            }
            EtcdError::Stopped => write!(f, "the etcd stream was stopped"),
            EtcdError::Spawn { thread, .. } => write!(f, "failed to start thread {thread}"),
        }
    }
}

impl std::error::Error for EtcdError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EtcdError::TlsFile { source, .. } | EtcdError::Spawn { source, .. } => Some(source),
            EtcdError::Transport { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: RpcStatusCode) -> EtcdError {
        EtcdError::Status {
            method: "Txn",
            endpoint: "127.0.0.1:2379".into(),
            code,
            message: String::new(),
        }
    }

    #[test]
    fn classification() {
        assert!(status(RpcStatusCode::UNAVAILABLE).is_retryable());
        assert!(status(RpcStatusCode::DEADLINE_EXCEEDED).is_retryable());
        assert!(!status(RpcStatusCode::INVALID_ARGUMENT).is_retryable());
        assert!(!status(RpcStatusCode::NOT_FOUND).is_retryable());
        assert!(EtcdError::Unreachable {
            method: "Range",
            endpoints: vec![],
            timeout: Duration::from_secs(1),
            connect_error: None,
            hint: None,
        }
        .is_retryable());
        assert!(!EtcdError::NoEndpoints.is_retryable());
        assert!(!EtcdError::LeaseNotFound { lease: LeaseId(1) }.is_retryable());
    }

    #[test]
    fn messages_name_the_call_and_endpoint() {
        let e = EtcdError::Status {
            method: "Put",
            endpoint: "10.0.0.1:2379".into(),
            code: RpcStatusCode::UNAVAILABLE,
            message: "etcdserver: no leader".into(),
        };
        assert_eq!(
            e.to_string(),
            "etcd Put at 10.0.0.1:2379 failed: UNAVAILABLE: etcdserver: no leader"
        );
        assert_eq!(
            EtcdError::LeaseNotFound {
                lease: LeaseId(255)
            }
            .to_string(),
            "etcd lease ff is gone (expired or revoked)"
        );
    }
}
