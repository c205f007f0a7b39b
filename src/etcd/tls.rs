//! TLS to etcd: the CA that signed the members' certificates and, when etcd
//! asks for client certificates (`--client-cert-auth`), this node's
//! certificate and key, all PEM files.
//!
//! gRPC core's TLS is compiled in only with the cargo feature `tls`; without
//! it, TLS settings are refused with `EtcdError::TlsNotBuilt` when the
//! client is created. The feature is off by default because of what it
//! costs: grpcio-sys then builds gRPC's full `grpc` library instead of
//! `grpc_unsecure` (763 C++ objects instead of 371: the security stack plus
//! xDS and its generated protos, ~1060 objects in all instead of ~670) and
//! links OpenSSL (libcrypto.a 9.1 MB, libssl.a 1.2 MB as archives) into
//! the static binary. On the shared two-core machine that is a second full
//! C++ core build per profile (debug and the static release alike), over
//! half again as long as today's; the path below follows grpcio 0.13's API
//! but has not been compiled or run yet.

use std::path::{Path, PathBuf};

use grpcio::{Channel, ChannelBuilder};

use super::EtcdError;

/// Where the PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsOptions {
    /// The CA certificate(s) that the members' certificates must chain to.
    pub ca: PathBuf,
    /// This node's certificate and key, for etcd's client-certificate
    /// authentication; `None`: the server is checked, the client is not.
    pub identity: Option<ClientIdentity>,
}

/// A client certificate and its private key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The PEM contents, read once when the client is created. Never logged.
#[cfg(feature = "tls")]
pub(crate) struct TlsMaterial {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// Without the `tls` feature there is no TLS material: nothing can make one.
#[cfg(not(feature = "tls"))]
pub(crate) enum TlsMaterial {}

/// Reads a PEM file. gRPC takes PEM as a C string: a NUL byte (a DER
/// file, say) is refused here rather than panicking inside grpcio.
fn read(path: &Path) -> Result<Vec<u8>, EtcdError> {
    let err = |source| EtcdError::TlsFile {
        path: path.to_path_buf(),
        source,
    };
    let pem = std::fs::read(path).map_err(err)?;
    if pem.contains(&0) {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a PEM file (it contains a NUL byte)",
        )));
    }
    Ok(pem)
}

impl TlsOptions {
    /// Reads the files (so that a missing one is reported at start-up).
    #[cfg(feature = "tls")]
    pub(crate) fn credentials(&self) -> Result<TlsMaterial, EtcdError> {
        let ca = read(&self.ca)?;
        let identity = match &self.identity {
            Some(id) => Some((read(&id.cert)?, read(&id.key)?)),
            None => None,
        };
        Ok(TlsMaterial { ca, identity })
    }

    #[cfg(not(feature = "tls"))]
    pub(crate) fn credentials(&self) -> Result<TlsMaterial, EtcdError> {
        // Still check the files, so that a wrong path is named even here.
        read(&self.ca)?;
        Err(EtcdError::TlsNotBuilt)
    }
}

#[cfg(feature = "tls")]
pub(crate) fn secure_channel(builder: ChannelBuilder, tls: &TlsMaterial, addr: &str) -> Channel {
    let mut creds = grpcio::ChannelCredentialsBuilder::new().root_cert(tls.ca.clone());
    if let Some((cert, key)) = &tls.identity {
        creds = creds.cert(cert.clone(), key.clone());
    }
    builder.set_credentials(creds.build()).connect(addr)
}

#[cfg(not(feature = "tls"))]
pub(crate) fn secure_channel(_: ChannelBuilder, tls: &TlsMaterial, _: &str) -> Channel {
    match *tls {}
}
