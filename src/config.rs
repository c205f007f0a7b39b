//! The agent's config file: JSON, validated once at start. Every error names
//! the file and the field.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::etcd::endpoint::Scheme;

pub mod docker;
pub mod fields;
pub const DEFAULT_CONFIG_PATH: &str = "/etc/claimd/config.json";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/claimd";
pub const DEFAULT_API_SOCKET: &str = "/run/claimd/claimd.sock";
pub const DEFAULT_MOUNT_ROOT: &str = "/var/lib/claimd/mounts";

/// Deadline of one CSI call.
pub const DEFAULT_CSI_CALL_TIMEOUT: Duration = crate::csi::DEFAULT_CALL_TIMEOUT;
/// How long a mount waits for its node plugin to be ready (Nomad: 1 min).
pub const DEFAULT_PLUGIN_WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Probe interval of a healthy plugin.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a claim held by another allocation is retried.
pub const DEFAULT_CLAIM_RETRY_DEADLINE: Duration = Duration::from_secs(3600);
/// How long a mount keeps retrying retryable CSI errors before it fails
/// (and rolls back).
pub const DEFAULT_MOUNT_RETRY_DEADLINE: Duration = Duration::from_secs(120);
/// How long a release keeps retrying a failing volume.
pub const DEFAULT_RELEASE_RETRY_DEADLINE: Duration = Duration::from_secs(24 * 3600);
/// How often NodeGetVolumeStats is asked per published volume (kubelet's
/// volume stats aggregation period is also one minute).
pub const DEFAULT_VOLUME_STATS_INTERVAL: Duration = Duration::from_secs(60);

/// What a plugin socket serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginType {
    Node,
    Controller,
    /// Node and (if it advertises CONTROLLER_SERVICE) controller on one socket.
    Monolith,
}

impl PluginType {
    pub fn serves_node(self) -> bool {
        matches!(self, PluginType::Node | PluginType::Monolith)
    }
    pub fn serves_controller(self) -> bool {
        matches!(self, PluginType::Controller | PluginType::Monolith)
    }
    pub fn name(self) -> &'static str {
        match self {
            PluginType::Node => "node",
            PluginType::Controller => "controller",
            PluginType::Monolith => "monolith",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginConfig {
    pub id: String,
    pub plugin_type: PluginType,
    pub socket: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub csi_call: Duration,
    pub plugin_wait: Duration,
    pub probe_interval: Duration,
    pub claim_retry_deadline: Duration,
    pub mount_retry_deadline: Duration,
    pub release_retry_deadline: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            csi_call: DEFAULT_CSI_CALL_TIMEOUT,
            plugin_wait: DEFAULT_PLUGIN_WAIT_TIMEOUT,
            probe_interval: DEFAULT_PROBE_INTERVAL,
            claim_retry_deadline: DEFAULT_CLAIM_RETRY_DEADLINE,
            mount_retry_deadline: DEFAULT_MOUNT_RETRY_DEADLINE,
            release_retry_deadline: DEFAULT_RELEASE_RETRY_DEADLINE,
        }
    }
}

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

pub const DEFAULT_CLUSTER_PREFIX: &str = "/claimd";
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);
pub const DEFAULT_ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_ATTACH_TIMEOUT: Duration = Duration::from_secs(60);
pub use crate::claims::etcd::DEFAULT_FREED_NOTE_RETENTION;
/// Shortest `cluster.freed_note_retention`.
const MIN_FREED_NOTE_RETENTION: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub state_dir: PathBuf,
    pub api_socket: PathBuf,
    pub mount_root: PathBuf,
    /// Where plugins drop their sockets (layout: `plugins::scan_plugin_dir`).
    pub plugin_dir: Option<PathBuf>,
    pub plugins: Vec<PluginConfig>,
    /// This node's name in claims.
    pub node_name: String,
    pub timeouts: Timeouts,
    /// None: one node, claims in the agent's own state.
    pub cluster: Option<ClusterConfig>,
    /// Where `GET /metrics` and `GET /healthz` are served; none: no
    /// listener (`claimd metrics` still works over the API socket).
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How often each published volume's usage is polled.
    pub volume_stats_interval: Duration,
    pub docker: Option<docker::DockerConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            api_socket: PathBuf::from(DEFAULT_API_SOCKET),
            mount_root: PathBuf::from(DEFAULT_MOUNT_ROOT),
            plugin_dir: None,
            plugins: Vec::new(),
            node_name: local_hostname(),
            timeouts: Timeouts::default(),
            cluster: None,
            metrics_listen: None,
            volume_stats_interval: DEFAULT_VOLUME_STATS_INTERVAL,
            docker: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    state_dir: Option<PathBuf>,
    api_socket: Option<PathBuf>,
    mount_root: Option<PathBuf>,
    plugin_dir: Option<PathBuf>,
    #[serde(default)]
    plugins: Vec<RawPlugin>,
    node_name: Option<String>,
    csi_call_timeout: Option<String>,
    plugin_wait_timeout: Option<String>,
    probe_interval: Option<String>,
    claim_retry_deadline: Option<String>,
    mount_retry_deadline: Option<String>,
    release_retry_deadline: Option<String>,
    metrics_listen: Option<String>,
    volume_stats_interval: Option<String>,
    cluster: Option<RawCluster>,
    docker: Option<docker::RawDocker>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    id: String,
    #[serde(rename = "type")]
    plugin_type: PluginType,
    /// `unix:///abs/path`, `unix:/abs/path` or `/abs/path`.
    socket: String,
}

#[derive(Debug)]
pub enum ConfigError {
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    Field {
        path: PathBuf,
        field: String,
        problem: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, .. } => {
                write!(f, "failed to read config file {}", path.display())
            }
            ConfigError::Parse { path, .. } => {
                write!(f, "config file {} is not valid", path.display())
            }
            ConfigError::Field {
                path,
                field,
                problem,
            } => write!(
                f,
                "config file {}: field {field}: {problem}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { source, .. } => Some(source),
            ConfigError::Parse { source, .. } => Some(source),
            ConfigError::Field { .. } => None,
        }
    }
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Validates config text; `path` is only used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let field_err = |field: &str, problem: String| ConfigError::Field {
            path: path.to_path_buf(),
            field: field.to_string(),
            problem,
        };
        let abs =
            |field: &str, p: Option<PathBuf>, default: &str| -> Result<PathBuf, ConfigError> {
                let p = p.unwrap_or_else(|| PathBuf::from(default));
                check_abs(&p).map_err(|problem| field_err(field, problem))?;
                Ok(p)
            };
        let dur = |field: &str, v: Option<String>, default: Duration| match v {
            None => Ok(default),
            Some(s) => match parse_duration(&s) {
                Ok(d) if d > Duration::ZERO => Ok(d),
                Ok(_) => Err(field_err(field, "must be greater than zero".into())),
                Err(e) => Err(field_err(field, e)),
            },
        };
        let plugin_dir = match raw.plugin_dir {
            None => None,
            Some(p) => {
                check_abs(&p).map_err(|e| field_err("plugin_dir", e))?;
                Some(p)
            }
        };
        let mut plugins = Vec::new();
        let mut roles: HashSet<(String, &'static str)> = HashSet::new();
        for (i, p) in raw.plugins.into_iter().enumerate() {
            crate::ids::check_id("plugin", &p.id)
                .map_err(|e| field_err(&format!("plugins[{i}].id"), e.to_string()))?;
            let socket = parse_endpoint(&p.socket)
                .map_err(|e| field_err(&format!("plugins[{i}].socket"), e))?;
            let mut claimed = Vec::new();
            if p.plugin_type.serves_node() {
                claimed.push("node");
            }
            if p.plugin_type.serves_controller() {
                claimed.push("controller");
            }
            for role in claimed {
                if !roles.insert((p.id.clone(), role)) {
                    return Err(field_err(
                        &format!("plugins[{i}].id"),
                        format!(
                            "duplicate plugin ID {:?}: another entry already serves its {role} side",
                            p.id
                        ),
                    ));
                }
            }
            plugins.push(PluginConfig {
                id: p.id,
                plugin_type: p.plugin_type,
                socket,
            });
        }
        let cluster = match raw.cluster {
            None => None,
            Some(c) => {
                if c.endpoints.is_empty() {
                    return Err(field_err(
                        "cluster.endpoints",
                        "needs at least one etcd endpoint (http://host:port)".into(),
                    ));
                }
                for (i, e) in c.endpoints.iter().enumerate() {
                    let field = format!("cluster.endpoints[{i}]");
                    let (_, scheme) = crate::etcd::endpoint::parse_endpoint(e)
                        .map_err(|err| field_err(&field, err.to_string()))?;
                    match (scheme, c.tls.is_some()) {
                        (Scheme::Https, false) => {
                            return Err(field_err(
                                &field,
                                format!("{e} uses TLS: it needs a cluster.tls section, at least the CA (\"ca\": \"/abs/ca.pem\")"),
                            ))
                        }
                        (Scheme::Http, true) => {
                            return Err(field_err(
                                &field,
                                format!("{e} is plain TCP but cluster.tls is set: write https://{} (or host:port)", e.trim().trim_start_matches("http://")),
                            ))
                        }
                        _ => {}
                    }
                }
                let prefix = c
                    .prefix
                    .unwrap_or_else(|| DEFAULT_CLUSTER_PREFIX.to_string());
                let prefix_ok = prefix.starts_with('/')
                    && prefix.len() > 1
                    && !prefix.ends_with('/')
                    && prefix
                        .split('/')
                        .skip(1)
                        .all(|p| crate::ids::check_id("prefix", p).is_ok());
                if !prefix_ok {
                    return Err(field_err(
                        "cluster.prefix",
                        format!(
                            "{prefix:?} must be like /claimd: a slash, then names of letters, digits, '.', '_' or '-' separated by slashes"
                        ),
                    ));
                }
                let lease_ttl = dur("cluster.lease_ttl", c.lease_ttl, DEFAULT_LEASE_TTL)?;
                if lease_ttl < Duration::from_secs(2) {
                    return Err(field_err(
                        "cluster.lease_ttl",
                        "must be at least 2s (etcd rounds shorter leases up)".into(),
                    ));
                }
                let tls = match c.tls {
                    None => None,
                    Some(_) if !cfg!(feature = "tls") => {
                        return Err(field_err(
                            "cluster.tls",
                            "this claimd is built without TLS (cargo feature `tls`)".into(),
                        ))
                    }
                    Some(t) => {
                        check_abs(&t.ca).map_err(|e| field_err("cluster.tls.ca", e))?;
                        for (f, p) in [("cluster.tls.cert", &t.cert), ("cluster.tls.key", &t.key)] {
                            if let Some(p) = p {
                                check_abs(p).map_err(|e| field_err(f, e))?;
                            }
                        }
                        if t.cert.is_some() != t.key.is_some() {
                            return Err(field_err(
                                "cluster.tls",
                                "cert and key go together".into(),
                            ));
                        }
                        Some(ClusterTls {
                            ca: t.ca,
                            cert: t.cert,
                            key: t.key,
                        })
                    }
                };
                let stop_after_disconnect = match c.stop_after_disconnect.as_deref() {
                    None | Some("") => None,
                    Some(_) => {
                        let d = dur(
                            "cluster.stop_after_disconnect",
                            c.stop_after_disconnect,
                            Duration::ZERO,
                        )?;
                        if d < Duration::from_secs(1) || d < lease_ttl {
                            return Err(field_err(
                                "cluster.stop_after_disconnect",
                                format!(
                                    "must be at least 1s and at least lease_ttl ({}): a shorter window would stop allocations of a node whose lease is still valid (leave it out to keep allocations however long the node is cut off)",
                                    format_duration(lease_ttl)
                                ),
                            ));
                        }
                        Some(d)
                    }
                };
                let call_timeout = dur(
                    "cluster.call_timeout",
                    c.call_timeout,
                    DEFAULT_ETCD_CALL_TIMEOUT,
                )?;
                if call_timeout * 2 > lease_ttl {
                    return Err(field_err(
                        "cluster.call_timeout",
                        format!(
                            "{} must be at most half of lease_ttl ({}): a keep-alive that waits out its deadline must leave time for another inside the lease's life",
                            format_duration(call_timeout),
                            format_duration(lease_ttl)
                        ),
                    ));
                }
                for (field, list) in [
                    ("cluster.fencing_plugins", &c.fencing_plugins),
                    ("cluster.epoch_plugins", &c.epoch_plugins),
                ] {
                    for p in list {
                        crate::ids::check_id("plugin", p)
                            .map_err(|e| field_err(field, e.to_string()))?;
                    }
                }
                let freed_note_retention = dur(
                    "cluster.freed_note_retention",
                    c.freed_note_retention,
                    DEFAULT_FREED_NOTE_RETENTION,
                )?;
                if freed_note_retention < MIN_FREED_NOTE_RETENTION {
                    return Err(field_err(
                        "cluster.freed_note_retention",
                        format!(
                            "{} is shorter than {}: a node back from a short partition must still find why its claims went",
                            format_duration(freed_note_retention),
                            format_duration(MIN_FREED_NOTE_RETENTION)
                        ),
                    ));
                }
                Some(ClusterConfig {
                    freed_note_retention,
                    attach_timeout: dur(
                        "cluster.attach_timeout",
                        c.attach_timeout,
                        DEFAULT_ATTACH_TIMEOUT,
                    )?,
                    stop_after_disconnect,
                    endpoints: c.endpoints,
                    prefix,
                    lease_ttl,
                    call_timeout,
                    tls,
                    fencing_plugins: c.fencing_plugins,
                    free_unfenced_claims: c.free_unfenced_claims,
                    epoch_plugins: c.epoch_plugins,
                })
            }
        };
        let metrics_listen = match raw.metrics_listen.as_deref() {
            None | Some("") => None,
            Some(a) => Some(parse_listen(a).map_err(|e| field_err("metrics_listen", e))?),
        };
        let volume_stats_interval = dur(
            "volume_stats_interval",
            raw.volume_stats_interval,
            DEFAULT_VOLUME_STATS_INTERVAL,
        )?;
        let node_name = raw.node_name.unwrap_or_else(local_hostname);
        crate::ids::check_id("node", &node_name)
            .map_err(|e| field_err("node_name", e.to_string()))?;
        let csi_call = dur(
            "csi_call_timeout",
            raw.csi_call_timeout,
            DEFAULT_CSI_CALL_TIMEOUT,
        )?;
        if let Some(c) = &cluster {
            if let Some(window) = c.stop_after_disconnect {
                use crate::claims::margins;
                margins::check_margins(
                    c.lease_ttl,
                    window,
                    margins::unmount_bound(csi_call),
                    margins::tau(margins::self_release_period(c.lease_ttl)),
                )
                .map_err(|e| field_err("cluster.stop_after_disconnect", e))?;
            }
        }
        Ok(Config {
            state_dir: abs("state_dir", raw.state_dir, DEFAULT_STATE_DIR)?,
            api_socket: abs("api_socket", raw.api_socket, DEFAULT_API_SOCKET)?,
            mount_root: abs("mount_root", raw.mount_root, DEFAULT_MOUNT_ROOT)?,
            plugin_dir,
            plugins,
            node_name,
            cluster,
            metrics_listen,
            volume_stats_interval,
            docker: docker::parse(path, raw.docker)?,
            timeouts: Timeouts {
                csi_call,
                plugin_wait: dur(
                    "plugin_wait_timeout",
                    raw.plugin_wait_timeout,
                    DEFAULT_PLUGIN_WAIT_TIMEOUT,
                )?,
                probe_interval: dur("probe_interval", raw.probe_interval, DEFAULT_PROBE_INTERVAL)?,
                claim_retry_deadline: dur(
                    "claim_retry_deadline",
                    raw.claim_retry_deadline,
                    DEFAULT_CLAIM_RETRY_DEADLINE,
                )?,
                mount_retry_deadline: dur(
                    "mount_retry_deadline",
                    raw.mount_retry_deadline,
                    DEFAULT_MOUNT_RETRY_DEADLINE,
                )?,
                release_retry_deadline: dur(
                    "release_retry_deadline",
                    raw.release_retry_deadline,
                    DEFAULT_RELEASE_RETRY_DEADLINE,
                )?,
            },
        })
    }
}

/// A plugin endpoint as plugins and CSI tooling write it: `unix:///abs`,
/// `unix:/abs`, or a plain absolute path. Other schemes are refused by
/// name (CSI plugins listen on unix sockets).
/// An `IP:port` listen address (`127.0.0.1:9432`, `[::1]:9432`); host
/// names are refused (the listener must not depend on name resolution).
pub fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    let a: std::net::SocketAddr = s.parse().map_err(|_| {
        format!("{s:?} is not an address and port such as 127.0.0.1:9432 or [::1]:9432")
    })?;
    if a.port() == 0 {
        return Err(format!("{s:?} names no port"));
    }
    Ok(a)
}

pub fn parse_endpoint(s: &str) -> Result<PathBuf, String> {
    let path = match s.split_once(':') {
        Some((scheme, rest)) if !s.starts_with('/') => {
            if scheme != "unix" {
                return Err(format!(
                    "{s:?} uses scheme {scheme:?}; plugin endpoints are unix sockets: unix:///path or /path"
                ));
            }
            // unix:///abs (empty authority) or unix:/abs.
            match rest.strip_prefix("//") {
                Some(after) if after.starts_with('/') => after,
                Some(_) => return Err(format!("{s:?} names a host; use unix:///absolute/path")),
                None => rest,
            }
        }
        _ => s,
    };
    let p = PathBuf::from(path);
    check_abs(&p)?;
    Ok(p)
}

fn check_abs(p: &Path) -> Result<(), String> {
    if p.as_os_str().is_empty() {
        return Err("must not be empty".into());
    }
    if !p.is_absolute() {
        return Err(format!("{} is not an absolute path", p.display()));
    }
    if p.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(format!("{} must not contain ..", p.display()));
    }
    Ok(())
}

/// The kernel's host name, or "localhost" when it cannot be read.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| crate::ids::check_id("node", s).is_ok())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Parses "250ms", "30s", "5m", "2h", "1d" (one number and one unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?} has no unit (use ms, s, m, h or d)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 500ms, 30s, 5m, 2h"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        "d" => Duration::from_secs(n.saturating_mul(86400)),
        _ => return Err(format!("{s:?} has an unknown unit (use ms, s, m, h or d)")),
    };
    Ok(d)
}

/// Formats a duration the way `parse_duration` reads it.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 86_400_000 == 0 && ms > 0 {
        format!("{}d", ms / 86_400_000)
    } else if ms % 3_600_000 == 0 && ms > 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms % 60_000 == 0 && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests;
