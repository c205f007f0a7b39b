//! The config's `docker` section: where the Docker volume plugin protocol
//! (Docker, Podman) is served; none: not served. Errors name the field as
//! the rest of the config does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{check_abs, ConfigError, Fields};

pub const DEFAULT_DOCKER_DRIVER: &str = "claimd";
pub const DEFAULT_DOCKER_MOUNT_TIMEOUT: Duration = Duration::from_secs(90);
/// Docker's own limit on a Create or Mount request (moby
/// volume/drivers/proxy.go, `longTimeout`); Podman's is its
/// `volume_plugin_timeout` (5 s unless set: set it to 120).
pub const ENGINE_MOUNT_LIMIT: Duration = Duration::from_secs(120);
/// Docker's limit on every other request (`shortTimeout`): Unmount, Get,
/// Path, List, Remove.
pub const ENGINE_REQUEST_LIMIT: Duration = Duration::from_secs(60);
/// What an answer keeps in hand below the engine's limit (the request's
/// own work around its waits).
pub const ENGINE_ANSWER_MARGIN: Duration = Duration::from_secs(5);
/// How long a Mount given up after `mount_timeout` waits for its thread,
/// and then for the release of what it claimed (each).
pub const MOUNT_GIVE_UP_WAIT: Duration = Duration::from_secs(10);
/// The longest `mount_timeout` whose Mount, given up and undone, still
/// answers within ENGINE_MOUNT_LIMIT.
pub const MAX_DOCKER_MOUNT_TIMEOUT: Duration = Duration::from_secs(
    ENGINE_MOUNT_LIMIT.as_secs()
        - ENGINE_ANSWER_MARGIN.as_secs()
        - 2 * MOUNT_GIVE_UP_WAIT.as_secs(),
);
pub const DEFAULT_DOCKER_UNUSED_CHECK: Duration = Duration::from_secs(30);
/// The engines' own limit on a Mount: Docker's (ENGINE_MOUNT_LIMIT) unless
/// `engine_mount_timeout` says otherwise (Podman: its
/// `volume_plugin_timeout`).
pub const DEFAULT_ENGINE_MOUNT_TIMEOUT: Duration = ENGINE_MOUNT_LIMIT;
/// The engines' API sockets asked before the engine-death rule releases:
/// Docker's and Podman's (rootful) defaults.
pub const DEFAULT_ENGINE_SOCKETS: [&str; 2] = ["/run/docker.sock", "/run/podman/podman.sock"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DockerConfig {
    /// The driver name (`docker run --volume-driver NAME`).
    pub driver: String,
    /// Default `/run/docker/plugins/<driver>.sock`, where Docker looks.
    pub socket: PathBuf,
    /// How long a Mount may wait (a held claim, a plugin) before it is
    /// given up; at most MAX_DOCKER_MOUNT_TIMEOUT, so that a given-up
    /// Mount's answer comes within Docker's own 2-minute limit.
    pub mount_timeout: Duration,
    /// Period of the engine-death rule: engine mounts no container uses at
    /// two checks in a row are released.
    pub unused_check_interval: Duration,
    /// The engine's own limit on a Mount: an engine mount younger than
    /// this (since its last Mount) is never released by the engine-death
    /// rule (a container's later volumes may still be mounting).
    pub engine_mount_timeout: Duration,
    /// The engines' API sockets: a container an answering engine lists (in
    /// any state but removed) keeps its volume's engine mounts.
    pub engine_sockets: Vec<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDocker {
    driver: Option<String>,
    socket: Option<PathBuf>,
    mount_timeout: Option<String>,
    unused_check_interval: Option<String>,
    engine_mount_timeout: Option<String>,
    engine_sockets: Option<Vec<PathBuf>>,
}

/// The section as read from the file at `path` (for messages).
pub fn parse(path: &Path, raw: Option<RawDocker>) -> Result<Option<DockerConfig>, ConfigError> {
    let Some(d) = raw else {
        return Ok(None);
    };
    let f = Fields::new(path, "docker.");
    let driver = d
        .driver
        .unwrap_or_else(|| DEFAULT_DOCKER_DRIVER.to_string());
    crate::ids::check_id("driver", &driver).map_err(|e| f.err("driver", e.to_string()))?;
    let socket = d
        .socket
        .unwrap_or_else(|| PathBuf::from(format!("/run/docker/plugins/{driver}.sock")));
    check_abs(&socket).map_err(|e| f.err("socket", e))?;
    let mount_timeout = f.dur(
        "mount_timeout",
        d.mount_timeout,
        DEFAULT_DOCKER_MOUNT_TIMEOUT,
    )?;
    if mount_timeout > MAX_DOCKER_MOUNT_TIMEOUT {
        return Err(f.err(
            "mount_timeout",
            format!(
                "must be at most {}: a Mount given up is undone within {} more, and Docker gives up on a Mount after {} (Podman after its volume_plugin_timeout)",
                super::format_duration(MAX_DOCKER_MOUNT_TIMEOUT),
                super::format_duration(2 * MOUNT_GIVE_UP_WAIT + ENGINE_ANSWER_MARGIN),
                super::format_duration(ENGINE_MOUNT_LIMIT)
            ),
        ));
    }
    let engine_sockets = d
        .engine_sockets
        .unwrap_or_else(|| DEFAULT_ENGINE_SOCKETS.iter().map(PathBuf::from).collect());
    for s in &engine_sockets {
        check_abs(s).map_err(|e| f.err("engine_sockets", e))?;
    }
    Ok(Some(DockerConfig {
        engine_sockets,
        socket,
        mount_timeout,
        unused_check_interval: f.dur(
            "unused_check_interval",
            d.unused_check_interval,
            DEFAULT_DOCKER_UNUSED_CHECK,
        )?,
        engine_mount_timeout: f.dur(
            "engine_mount_timeout",
            d.engine_mount_timeout,
            DEFAULT_ENGINE_MOUNT_TIMEOUT,
        )?,
        driver,
    }))
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use crate::config::Config;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(Path::new("/etc/claimd/config.json"), text)
            .map_err(|e| crate::error_chain(&e))
    }

    #[test]
    fn the_docker_section_of_the_config() {
        assert_eq!(parse("{}").expect("valid").docker, None);
        let d = parse(r#"{"docker": {}}"#)
            .expect("valid")
            .docker
            .expect("a docker section");
        assert_eq!(d.driver, "claimd");
        assert_eq!(d.socket, Path::new("/run/docker/plugins/claimd.sock"));
        assert_eq!(d.mount_timeout, Duration::from_secs(90));
        assert_eq!(d.unused_check_interval, Duration::from_secs(30));
        assert_eq!(d.engine_mount_timeout, Duration::from_secs(120));
        assert_eq!(
            d.engine_sockets,
            [
                Path::new("/run/docker.sock"),
                Path::new("/run/podman/podman.sock")
            ]
        );
        let d = parse(
            r#"{"docker": {"driver": "csi", "socket": "/run/claimd/docker.sock",
                "mount_timeout": "20s", "unused_check_interval": "5s",
                "engine_mount_timeout": "300s", "engine_sockets": []}}"#,
        )
        .expect("valid")
        .docker
        .expect("a docker section");
        assert_eq!(d.socket, Path::new("/run/claimd/docker.sock"));
        assert_eq!(d.mount_timeout, Duration::from_secs(20));
        assert_eq!(d.unused_check_interval, Duration::from_secs(5));
        assert_eq!(d.engine_mount_timeout, Duration::from_secs(300));
        assert!(d.engine_sockets.is_empty());
        for (text, needle) in [
            (r#"{"docker": {"driver": "a/b"}}"#, "field docker.driver"),
            (
                r#"{"docker": {"socket": "rel.sock"}}"#,
                "field docker.socket",
            ),
            (
                r#"{"docker": {"mount_timeout": "0s"}}"#,
                "field docker.mount_timeout",
            ),
            (
                r#"{"docker": {"mount_timeout": "96s"}}"#,
                "field docker.mount_timeout: must be at most 95s: a Mount given up is undone within 25s more, and Docker gives up on a Mount after 2m",
            ),
            (
                r#"{"docker": {"engine_sockets": ["docker.sock"]}}"#,
                "field docker.engine_sockets",
            ),
            (r#"{"docker": {"bogus": 1}}"#, "bogus"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(needle), "{text}: {e}");
            assert!(e.contains("/etc/claimd/config.json"), "{e}");
        }
    }
}
