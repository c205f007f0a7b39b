//! TLS to etcd: the CA that signed the members' certificates and, when etcd
//! asks for client certificates (`--client-cert-auth`), this node's
//! certificate and key, all PEM files.
//!
//! gRPC core's TLS is compiled in only with the cargo feature `tls`
//! (grpcio's `openssl`: gRPC's full `grpc` library instead of
//! `grpc_unsecure`, linked with the system OpenSSL); without it, TLS
//! settings are refused with `EtcdError::TlsNotBuilt` when the client is
//! created. What the feature costs in build time and binary size is
//! measured in packaging/doc/performance.md (*Build time and binary size*).
//!
//! The files are read once, when the client is created, and checked to be
//! PEM of the right kind, so that a wrong path or a swapped file is named at
//! start-up rather than showing as a failed handshake later. The key's bytes
//! are never logged (`TlsMaterial` has no `Debug`) and are zeroed when the
//! client is dropped; grpcio keeps its own copy inside gRPC core, which
//! zeroes it in turn.

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

#[cfg(feature = "tls")]
impl Drop for TlsMaterial {
    fn drop(&mut self) {
        if let Some((_, key)) = self.identity.as_mut() {
            for b in key.iter_mut() {
                // SAFETY: a valid, aligned, exclusive reference to a byte of
                // the vector; volatile so that the zeroing is not elided.
                unsafe { std::ptr::write_volatile(b, 0) };
            }
        }
    }
}

impl TlsOptions {
    /// What `closed_after_handshake` means with these settings.
    pub(crate) fn closed_hint(&self) -> &'static str {
        match self.identity {
            None => {
                "this client presents no certificate, and a member that asks for \
                 one (--client-cert-auth) closes the connection after the TLS handshake"
            }
            Some(_) => {
                "a member closes the connection after the TLS handshake when it does \
                 not accept this client's certificate (not signed by a CA in its \
                 --trusted-ca-file, expired, or not for client authentication)"
            }
        }
    }
}

/// Whether gRPC's connection error is a connection that was closed after
/// it was set up. Through TLS 1.3 that is what a member refusing the
/// client's certificate looks like: the client finishes its handshake
/// first, then the member checks the certificate and closes the connection
/// with an alert that gRPC logs (on stderr: "alert bad certificate") but
/// does not put in the call's status.
pub(crate) fn closed_after_handshake(connect_error: &str) -> bool {
    ["Endpoint read failed", "Socket closed", "reset by peer"]
        .iter()
        .any(|m| connect_error.contains(m))
}

/// Without the `tls` feature there is no TLS material: nothing can make one.
#[cfg(not(feature = "tls"))]
pub(crate) enum TlsMaterial {}

/// What a PEM file must hold: the label of its `-----BEGIN …-----` line.
#[derive(Clone, Copy)]
enum PemKind {
    Certificate,
    PrivateKey,
}

impl PemKind {
    /// The kind's name in errors.
    fn name(self) -> &'static str {
        match self {
            PemKind::Certificate => "certificate",
            PemKind::PrivateKey => "private key",
        }
    }

    /// Whether a `-----BEGIN <label>-----` line names this kind.
    /// Keys come as `PRIVATE KEY` (PKCS#8), `RSA PRIVATE KEY` or `EC
    /// PRIVATE KEY`; an `ENCRYPTED PRIVATE KEY` would need a passphrase
    /// gRPC cannot be given.
    fn matches(self, label: &str) -> bool {
        match self {
            PemKind::Certificate => label == "CERTIFICATE",
            PemKind::PrivateKey => {
                label.ends_with("PRIVATE KEY") && !label.starts_with("ENCRYPTED")
            }
        }
    }
}

/// Reads a PEM file and checks that it holds a block of `kind`. gRPC takes
/// PEM as a C string: a NUL byte (a DER file, say) is refused here rather
/// than panicking inside grpcio. Nothing of the contents goes into errors.
fn read(path: &Path, kind: PemKind) -> Result<Vec<u8>, EtcdError> {
    let pem = std::fs::read(path).map_err(|source| EtcdError::TlsFile {
        path: path.to_path_buf(),
        source,
    })?;
    let not_pem = |reason: String| EtcdError::TlsNotPem {
        path: path.to_path_buf(),
        kind: kind.name(),
        reason,
    };
    if pem.contains(&0) {
        return Err(not_pem("it contains a NUL byte (DER?)".into()));
    }
    let text = String::from_utf8_lossy(&pem);
    let labels: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("-----BEGIN "))
        .filter_map(|l| l.strip_suffix("-----"))
        .collect();
    if labels.iter().any(|l| kind.matches(l)) {
        return Ok(pem);
    }
    Err(not_pem(match labels.first() {
        None => "it has no -----BEGIN line".into(),
        Some(l) if l.starts_with("ENCRYPTED") => {
            "the key is encrypted; give gRPC an unencrypted key".into()
        }
        Some(l) => format!("it holds a {l}"),
    }))
}

impl TlsOptions {
    /// Reads the files (so that a missing one is reported at start-up).
    #[cfg(feature = "tls")]
    pub(crate) fn credentials(&self) -> Result<TlsMaterial, EtcdError> {
        let ca = read(&self.ca, PemKind::Certificate)?;
        let identity = match &self.identity {
            Some(id) => Some((
                read(&id.cert, PemKind::Certificate)?,
                read(&id.key, PemKind::PrivateKey)?,
            )),
            None => None,
        };
        Ok(TlsMaterial { ca, identity })
    }

    #[cfg(not(feature = "tls"))]
    pub(crate) fn credentials(&self) -> Result<TlsMaterial, EtcdError> {
        // Still check the files, so that a wrong path is named even here.
        read(&self.ca, PemKind::Certificate)?;
        if let Some(id) = &self.identity {
            read(&id.cert, PemKind::Certificate)?;
            read(&id.key, PemKind::PrivateKey)?;
        }
        Err(EtcdError::TlsNotBuilt)
    }
}

/// A channel to `addr` that checks the server's certificate against the CA
/// (and its name against the host of `addr`) and, with an identity,
/// presents this node's certificate.
#[cfg(feature = "tls")]
pub(crate) fn secure_channel(builder: ChannelBuilder, tls: &TlsMaterial, addr: &str) -> Channel {
    let mut creds = grpcio::ChannelCredentialsBuilder::new().root_cert(tls.ca.clone());
    if let Some((cert, key)) = &tls.identity {
        // grpcio copies the key into a C string and zeroes the copies it
        // makes; the one given here is moved into it.
        creds = creds.cert(cert.clone(), key.clone());
    }
    builder.set_credentials(creds.build()).connect(addr)
}

#[cfg(not(feature = "tls"))]
pub(crate) fn secure_channel(_: ChannelBuilder, tls: &TlsMaterial, _: &str) -> Channel {
    match *tls {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &[u8]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("a temporary file");
        std::fs::write(f.path(), text).expect("write it");
        f
    }

    fn reason(text: &[u8], kind: PemKind) -> String {
        let f = file(text);
        match read(f.path(), kind) {
            Ok(_) => "ok".into(),
            Err(EtcdError::TlsNotPem { reason, .. }) => reason,
            Err(e) => panic!("{e:?}"),
        }
    }

    const CERT: &[u8] = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    #[test]
    fn pem_files_are_checked_for_their_kind() {
        assert_eq!(reason(CERT, PemKind::Certificate), "ok");
        for key in ["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"] {
            let text = format!("-----BEGIN {key}-----\nMIIE\n-----END {key}-----\n");
            assert_eq!(reason(text.as_bytes(), PemKind::PrivateKey), "ok", "{key}");
        }
        assert_eq!(reason(CERT, PemKind::PrivateKey), "it holds a CERTIFICATE");
        assert_eq!(
            reason(b"-----BEGIN PRIVATE KEY-----\nx\n", PemKind::Certificate),
            "it holds a PRIVATE KEY"
        );
        assert_eq!(
            reason(
                b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nx\n",
                PemKind::PrivateKey
            ),
            "the key is encrypted; give gRPC an unencrypted key"
        );
        assert_eq!(
            reason(b"0\x82\x01\x00", PemKind::Certificate),
            "it contains a NUL byte (DER?)"
        );
        assert_eq!(
            reason(b"hello\n", PemKind::Certificate),
            "it has no -----BEGIN line"
        );
    }

    #[test]
    fn errors_never_show_the_contents() {
        let secret = b"-----BEGIN CERTIFICATE-----\nSECRETSECRET\n";
        let f = file(secret);
        let e = read(f.path(), PemKind::PrivateKey).expect_err("not a key");
        let text = format!("{e} {e:?}");
        assert!(!text.contains("SECRETSECRET"), "{text}");
        assert!(text.contains(&f.path().display().to_string()), "{text}");
    }
}
