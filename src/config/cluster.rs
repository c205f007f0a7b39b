//! The config's `cluster` section: claims shared by every node through
//! etcd; none: one node, claims in the agent's own state. Errors name the
//! field as the rest of the config does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{check_abs, format_duration, ConfigError, Fields};
use crate::etcd::endpoint::Scheme;

pub const DEFAULT_CLUSTER_PREFIX: &str = "/claimd";
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);
pub const DEFAULT_ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_ATTACH_TIMEOUT: Duration = Duration::from_secs(60);
pub use crate::claims::etcd::DEFAULT_FREED_NOTE_RETENTION;
/// Shortest `cluster.freed_note_retention`.
const MIN_FREED_NOTE_RETENTION: Duration = Duration::from_secs(60);

/// Cluster mode: claims shared by every node through etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://host:port` or `host:port`), tried in order
    /// with failover.
    pub endpoints: Vec<String>,
    /// Every key claimd writes starts with this.
    pub prefix: String,
    /// TTL of this node's liveness lease (`<prefix>/nodes/<node>`).
    pub lease_ttl: Duration,
    /// Deadline of every etcd call.
    pub call_timeout: Duration,
    /// TLS to etcd (the `tls` build only).
    pub tls: Option<ClusterTls>,
    /// How long one attach or detach request through a controller host on
    /// another node waits for its answer.
    pub attach_timeout: Duration,
    /// Off (None) by default. When this node cannot renew its lease for
    /// this long it releases its allocations' node side itself; once its
    /// lease has been gone this long the cluster detaches its volumes and
    /// frees its claims.
    pub stop_after_disconnect: Option<Duration>,
    /// Plugins whose ControllerUnpublishVolume cuts a node off the volume
    /// (a fence): only their volumes are detached and freed by the cluster
    /// when their node is gone for good.
    pub fencing_plugins: Vec<String>,
    /// Off by default: the cluster also frees claims it cannot fence
    /// (node-only volumes, plugins not in `fencing_plugins`) of a node gone
    /// for good. The user's risk: a paused or crashed node does not stop.
    pub free_unfenced_claims: bool,
    /// Plugins that are given the claim's epoch (its etcd create revision,
    /// the fencing token) under `claimd.io/epoch`
    /// (`volumes::requests::EPOCH_CONTEXT_KEY`): in the volume context
    /// of ControllerPublishVolume and the publish context of NodeStage and
    /// NodePublish. Off by default: the CSI spec has those maps match what
    /// the plugin answered, so only a plugin that asks for the key gets it.
    pub epoch_plugins: Vec<String>,
    /// How long a `freed/` note is kept (on a lease of that TTL): a node
    /// coming back later finds neither claim nor note and keeps its
    /// allocation, saying so in its log.
    pub freed_note_retention: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterTls {
    pub ca: PathBuf,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    #[serde(default)]
    endpoints: Vec<String>,
    prefix: Option<String>,
    lease_ttl: Option<String>,
    call_timeout: Option<String>,
    tls: Option<RawTls>,
    attach_timeout: Option<String>,
    stop_after_disconnect: Option<String>,
    #[serde(default)]
    fencing_plugins: Vec<String>,
    #[serde(default)]
    free_unfenced_claims: bool,
    #[serde(default)]
    epoch_plugins: Vec<String>,
    freed_note_retention: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: PathBuf,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

/// The section as read from the file at `path` (for messages). The
/// margins, which need the CSI call deadline too, are checked by
/// `check_margins`.
pub fn parse(path: &Path, raw: Option<RawCluster>) -> Result<Option<ClusterConfig>, ConfigError> {
    let Some(c) = raw else {
        return Ok(None);
    };
    let f = Fields::new(path, "cluster.");
    check_endpoints(&f, &c.endpoints, c.tls.is_some())?;
    let prefix = c
        .prefix
        .unwrap_or_else(|| DEFAULT_CLUSTER_PREFIX.to_string());
    check_prefix(&f, &prefix)?;
    let lease_ttl = f.dur("lease_ttl", c.lease_ttl, DEFAULT_LEASE_TTL)?;
    if lease_ttl < Duration::from_secs(2) {
        return Err(f.err(
            "lease_ttl",
            "must be at least 2s (etcd rounds shorter leases up)".into(),
        ));
    }
    let tls = parse_tls(&f, c.tls)?;
    let stop_after_disconnect = match c.stop_after_disconnect.as_deref() {
        None | Some("") => None,
        Some(_) => {
            let d = f.dur(
                "stop_after_disconnect",
                c.stop_after_disconnect,
                Duration::ZERO,
            )?;
            if d < Duration::from_secs(1) || d < lease_ttl {
                return Err(f.err(
                    "stop_after_disconnect",
                    format!(
                        "must be at least 1s and at least lease_ttl ({}): a shorter window would stop allocations of a node whose lease is still valid (leave it out to keep allocations however long the node is cut off)",
                        format_duration(lease_ttl)
                    ),
                ));
            }
            Some(d)
        }
    };
    let call_timeout = f.dur("call_timeout", c.call_timeout, DEFAULT_ETCD_CALL_TIMEOUT)?;
    if call_timeout * 2 > lease_ttl {
        return Err(f.err(
            "call_timeout",
            format!(
                "{} must be at most half of lease_ttl ({}): a keep-alive that waits out its deadline must leave time for another inside the lease's life",
                format_duration(call_timeout),
                format_duration(lease_ttl)
            ),
        ));
    }
    for (field, list) in [
        ("fencing_plugins", &c.fencing_plugins),
        ("epoch_plugins", &c.epoch_plugins),
    ] {
        for p in list {
            crate::ids::check_id("plugin", p).map_err(|e| f.err(field, e.to_string()))?;
        }
    }
    let freed_note_retention = f.dur(
        "freed_note_retention",
        c.freed_note_retention,
        DEFAULT_FREED_NOTE_RETENTION,
    )?;
    if freed_note_retention < MIN_FREED_NOTE_RETENTION {
        return Err(f.err(
            "freed_note_retention",
            format!(
                "{} is shorter than {}: a node back from a short partition must still find why its claims went",
                format_duration(freed_note_retention),
                format_duration(MIN_FREED_NOTE_RETENTION)
            ),
        ));
    }
    Ok(Some(ClusterConfig {
        freed_note_retention,
        attach_timeout: f.dur("attach_timeout", c.attach_timeout, DEFAULT_ATTACH_TIMEOUT)?,
        stop_after_disconnect,
        endpoints: c.endpoints,
        prefix,
        lease_ttl,
        call_timeout,
        tls,
        fencing_plugins: c.fencing_plugins,
        free_unfenced_claims: c.free_unfenced_claims,
        epoch_plugins: c.epoch_plugins,
    }))
}

/// At least one endpoint, each with the scheme the `tls` section asks for.
fn check_endpoints(f: &Fields<'_>, endpoints: &[String], tls: bool) -> Result<(), ConfigError> {
    if endpoints.is_empty() {
        return Err(f.err(
            "endpoints",
            "needs at least one etcd endpoint (http://host:port)".into(),
        ));
    }
    for (i, e) in endpoints.iter().enumerate() {
        let field = format!("endpoints[{i}]");
        let (_, scheme) = crate::etcd::endpoint::parse_endpoint(e)
            .map_err(|err| f.err(&field, err.to_string()))?;
        match (scheme, tls) {
            (Scheme::Https, false) => {
                return Err(f.err(
                    &field,
                    format!("{e} uses TLS: it needs a cluster.tls section, at least the CA (\"ca\": \"/abs/ca.pem\")"),
                ))
            }
            (Scheme::Http, true) => {
                return Err(f.err(
                    &field,
                    format!("{e} is plain TCP but cluster.tls is set: write https://{} (or host:port)", e.trim().trim_start_matches("http://")),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// A prefix like `/claimd`: a slash, then names separated by slashes.
fn check_prefix(f: &Fields<'_>, prefix: &str) -> Result<(), ConfigError> {
    let prefix_ok = prefix.starts_with('/')
        && prefix.len() > 1
        && !prefix.ends_with('/')
        && prefix
            .split('/')
            .skip(1)
            .all(|p| crate::ids::check_id("prefix", p).is_ok());
    if prefix_ok {
        return Ok(());
    }
    Err(f.err(
        "prefix",
        format!(
            "{prefix:?} must be like /claimd: a slash, then names of letters, digits, '.', '_' or '-' separated by slashes"
        ),
    ))
}

/// The `tls` subsection: absolute paths, cert and key together; refused by
/// a build without TLS.
fn parse_tls(f: &Fields<'_>, raw: Option<RawTls>) -> Result<Option<ClusterTls>, ConfigError> {
    let t = match raw {
        None => return Ok(None),
        Some(_) if !cfg!(feature = "tls") => {
            return Err(f.err(
                "tls",
                "this claimd is built without TLS (cargo feature `tls`)".into(),
            ))
        }
        Some(t) => t,
    };
    check_abs(&t.ca).map_err(|e| f.err("tls.ca", e))?;
    for (field, p) in [("tls.cert", &t.cert), ("tls.key", &t.key)] {
        if let Some(p) = p {
            check_abs(p).map_err(|e| f.err(field, e))?;
        }
    }
    if t.cert.is_some() != t.key.is_some() {
        return Err(f.err("tls", "cert and key go together".into()));
    }
    Ok(Some(ClusterTls {
        ca: t.ca,
        cert: t.cert,
        key: t.key,
    }))
}

/// The margin inequality of the disconnect rule (`claims::margins`), which
/// needs this node's CSI call deadline: checked once both are read.
pub fn check_margins(
    path: &Path,
    c: &ClusterConfig,
    csi_call: Duration,
) -> Result<(), ConfigError> {
    let Some(window) = c.stop_after_disconnect else {
        return Ok(());
    };
    use crate::claims::margins;
    margins::check_margins(
        c.lease_ttl,
        window,
        margins::unmount_bound(csi_call),
        margins::tau(margins::self_release_period(c.lease_ttl)),
    )
    .map_err(|e| Fields::new(path, "cluster.").err("stop_after_disconnect", e))
}
