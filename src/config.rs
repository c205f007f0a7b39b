//! The agent's config file: JSON, validated once at start. Every error names
//! the file and the field.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub mod cluster;
pub mod docker;
pub mod fields;

pub use cluster::{
    ClusterConfig, ClusterTls, DEFAULT_ATTACH_TIMEOUT, DEFAULT_CLUSTER_PREFIX,
    DEFAULT_ETCD_CALL_TIMEOUT, DEFAULT_FREED_NOTE_RETENTION, DEFAULT_LEASE_TTL,
};
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
    cluster: Option<cluster::RawCluster>,
    docker: Option<docker::RawDocker>,
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

    /// Validates config text; `path` is only used in messages. Section by
    /// section, in the order the errors have always come in: the plugins,
    /// the cluster, this agent's own fields, the docker section, the
    /// timeouts.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let f = Fields::new(path, "");
        let plugin_dir = match raw.plugin_dir {
            None => None,
            Some(p) => {
                check_abs(&p).map_err(|e| f.err("plugin_dir", e))?;
                Some(p)
            }
        };
        let plugins = parse_plugins(&f, raw.plugins)?;
        let cluster = cluster::parse(path, raw.cluster)?;
        let metrics_listen = match raw.metrics_listen.as_deref() {
            None | Some("") => None,
            Some(a) => Some(parse_listen(a).map_err(|e| f.err("metrics_listen", e))?),
        };
        let volume_stats_interval = f.dur(
            "volume_stats_interval",
            raw.volume_stats_interval,
            DEFAULT_VOLUME_STATS_INTERVAL,
        )?;
        let node_name = raw.node_name.unwrap_or_else(local_hostname);
        crate::ids::check_id("node", &node_name).map_err(|e| f.err("node_name", e.to_string()))?;
        let csi_call = f.dur(
            "csi_call_timeout",
            raw.csi_call_timeout,
            DEFAULT_CSI_CALL_TIMEOUT,
        )?;
        if let Some(c) = &cluster {
            cluster::check_margins(path, c, csi_call)?;
        }
        Ok(Config {
            state_dir: f.abs("state_dir", raw.state_dir, DEFAULT_STATE_DIR)?,
            api_socket: f.abs("api_socket", raw.api_socket, DEFAULT_API_SOCKET)?,
            mount_root: f.abs("mount_root", raw.mount_root, DEFAULT_MOUNT_ROOT)?,
            plugin_dir,
            plugins,
            node_name,
            cluster,
            metrics_listen,
            volume_stats_interval,
            docker: docker::parse(path, raw.docker)?,
            timeouts: parse_timeouts(
                &f,
                csi_call,
                [
                    raw.plugin_wait_timeout,
                    raw.probe_interval,
                    raw.claim_retry_deadline,
                    raw.mount_retry_deadline,
                    raw.release_retry_deadline,
                ],
            )?,
        })
    }
}

/// Where a section's fields are read from, for its errors: the file and
/// the section's prefix (`cluster.`; empty for the agent's own fields).
pub(crate) struct Fields<'a> {
    path: &'a Path,
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(path: &'a Path, prefix: &'static str) -> Fields<'a> {
        Fields { path, prefix }
    }

    /// The error of `field` (without the section's prefix).
    pub(crate) fn err(&self, field: &str, problem: String) -> ConfigError {
        ConfigError::Field {
            path: self.path.to_path_buf(),
            field: format!("{}{field}", self.prefix),
            problem,
        }
    }

    /// A duration greater than zero, or `default` when the field is left
    /// out.
    pub(crate) fn dur(
        &self,
        field: &str,
        v: Option<String>,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => match parse_duration(&s) {
                Ok(d) if d > Duration::ZERO => Ok(d),
                Ok(_) => Err(self.err(field, "must be greater than zero".into())),
                Err(e) => Err(self.err(field, e)),
            },
        }
    }

    /// An absolute path, or `default` when the field is left out.
    fn abs(&self, field: &str, p: Option<PathBuf>, default: &str) -> Result<PathBuf, ConfigError> {
        let p = p.unwrap_or_else(|| PathBuf::from(default));
        check_abs(&p).map_err(|problem| self.err(field, problem))?;
        Ok(p)
    }
}

/// The `plugins` list: valid IDs and endpoints, and no two entries serving
/// the same side (node, controller) of one plugin ID.
fn parse_plugins(f: &Fields<'_>, raw: Vec<RawPlugin>) -> Result<Vec<PluginConfig>, ConfigError> {
    let mut plugins = Vec::new();
    let mut roles: HashSet<(String, &'static str)> = HashSet::new();
    for (i, p) in raw.into_iter().enumerate() {
        crate::ids::check_id("plugin", &p.id)
            .map_err(|e| f.err(&format!("plugins[{i}].id"), e.to_string()))?;
        let socket =
            parse_endpoint(&p.socket).map_err(|e| f.err(&format!("plugins[{i}].socket"), e))?;
        let mut claimed = Vec::new();
        if p.plugin_type.serves_node() {
            claimed.push("node");
        }
        if p.plugin_type.serves_controller() {
            claimed.push("controller");
        }
        for role in claimed {
            if !roles.insert((p.id.clone(), role)) {
                return Err(f.err(
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
    Ok(plugins)
}

/// The timeouts besides `csi_call_timeout` (read earlier: the cluster's
/// margins need it): plugin wait, probe interval, claim, mount and
/// release retry deadlines, as written in the file.
fn parse_timeouts(
    f: &Fields<'_>,
    csi_call: Duration,
    [plugin_wait, probe_interval, claim_retry, mount_retry, release_retry]: [Option<String>; 5],
) -> Result<Timeouts, ConfigError> {
    Ok(Timeouts {
        csi_call,
        plugin_wait: f.dur(
            "plugin_wait_timeout",
            plugin_wait,
            DEFAULT_PLUGIN_WAIT_TIMEOUT,
        )?,
        probe_interval: f.dur("probe_interval", probe_interval, DEFAULT_PROBE_INTERVAL)?,
        claim_retry_deadline: f.dur(
            "claim_retry_deadline",
            claim_retry,
            DEFAULT_CLAIM_RETRY_DEADLINE,
        )?,
        mount_retry_deadline: f.dur(
            "mount_retry_deadline",
            mount_retry,
            DEFAULT_MOUNT_RETRY_DEADLINE,
        )?,
        release_retry_deadline: f.dur(
            "release_retry_deadline",
            release_retry,
            DEFAULT_RELEASE_RETRY_DEADLINE,
        )?,
    })
}

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

/// A plugin endpoint as plugins and CSI tooling write it: `unix:///abs`,
/// `unix:/abs`, or a plain absolute path. Other schemes are refused by
/// name (CSI plugins listen on unix sockets).
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
