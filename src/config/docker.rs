//! The config's `docker` section: where the Docker volume plugin protocol
//! (Docker, Podman) is served; none: not served. Errors name the field as
//! the rest of the config does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{check_abs, parse_duration, ConfigError};

pub const DEFAULT_DOCKER_DRIVER: &str = "claimd";
pub const DEFAULT_DOCKER_MOUNT_TIMEOUT: Duration = Duration::from_secs(100);
pub const DEFAULT_DOCKER_UNUSED_CHECK: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DockerConfig {
    /// The driver name (`docker run --volume-driver NAME`).
    pub driver: String,
    /// Default `/run/docker/plugins/<driver>.sock`, where Docker looks.
    pub socket: PathBuf,
    /// How long a Mount may wait (a held claim, a plugin) before it is
    /// given up; below Docker's own 2-minute request timeout.
    pub mount_timeout: Duration,
    /// Period of the engine-death rule: engine mounts no container uses at
    /// two checks in a row are released.
    pub unused_check_interval: Duration,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDocker {
    driver: Option<String>,
    socket: Option<PathBuf>,
    mount_timeout: Option<String>,
    unused_check_interval: Option<String>,
}

/// The section as read from the file at `path` (for messages).
pub fn parse(path: &Path, raw: Option<RawDocker>) -> Result<Option<DockerConfig>, ConfigError> {
    let Some(d) = raw else {
        return Ok(None);
    };
    let field_err = |field: &str, problem: String| ConfigError::Field {
        path: path.to_path_buf(),
        field: format!("docker.{field}"),
        problem,
    };
    let dur = |field: &str, v: Option<String>, default: Duration| match v {
        None => Ok(default),
        Some(s) => match parse_duration(&s) {
            Ok(d) if d > Duration::ZERO => Ok(d),
            Ok(_) => Err(field_err(field, "must be greater than zero".into())),
            Err(e) => Err(field_err(field, e)),
        },
    };
    let driver = d
        .driver
        .unwrap_or_else(|| DEFAULT_DOCKER_DRIVER.to_string());
    crate::ids::check_id("driver", &driver).map_err(|e| field_err("driver", e.to_string()))?;
    let socket = d
        .socket
        .unwrap_or_else(|| PathBuf::from(format!("/run/docker/plugins/{driver}.sock")));
    check_abs(&socket).map_err(|e| field_err("socket", e))?;
    Ok(Some(DockerConfig {
        socket,
        mount_timeout: dur(
            "mount_timeout",
            d.mount_timeout,
            DEFAULT_DOCKER_MOUNT_TIMEOUT,
        )?,
        unused_check_interval: dur(
            "unused_check_interval",
            d.unused_check_interval,
            DEFAULT_DOCKER_UNUSED_CHECK,
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
        assert_eq!(d.mount_timeout, Duration::from_secs(100));
        assert_eq!(d.unused_check_interval, Duration::from_secs(30));
        let d = parse(
            r#"{"docker": {"driver": "csi", "socket": "/run/claimd/docker.sock",
                "mount_timeout": "20s", "unused_check_interval": "5s"}}"#,
        )
        .expect("valid")
        .docker
        .expect("a docker section");
        assert_eq!(d.socket, Path::new("/run/claimd/docker.sock"));
        assert_eq!(d.mount_timeout, Duration::from_secs(20));
        assert_eq!(d.unused_check_interval, Duration::from_secs(5));
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
            (r#"{"docker": {"bogus": 1}}"#, "bogus"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(needle), "{text}: {e}");
            assert!(e.contains("/etc/claimd/config.json"), "{e}");
        }
    }
}
