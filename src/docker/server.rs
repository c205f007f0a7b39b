//! The protocol's HTTP server: tiny_http on a unix socket (mode 0600; the
//! engines run as root), one thread `docker-plugin` taking requests, and
//! every request on its own named thread (`docker-<endpoint>`), so a Mount
//! waiting for a claim never holds up a List; a Mount's own work runs on
//! `docker-mount-<volume>` (`driver::MountThreads`), joined at the stop. Failures are answered with
//! HTTP 500 and `{"Err": "..."}`: Docker reads `Err` from any answer,
//! Podman only from one that is not 200.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use super::driver::Driver;
use super::protocol::{self as p, Endpoint};
use super::DockerError;
use crate::config::docker::DockerConfig;
use crate::lifecycle::Lifecycle;
use crate::shutdown::Shutdown;
use crate::threads::Threads;

/// How often the request loop looks at the stop flag.
const RECV_POLL: Duration = Duration::from_millis(200);
/// How long request threads may take to end after the stop (their waits
/// for claims and plugins end with the agent's stop).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Listens on the configured socket (replacing a stale one; refusing one
/// that a live process answers on) and serves it on thread `docker-plugin`
/// until the stop; starts the engine-death rule (thread `docker-unused`),
/// which shows in `health` why it releases nothing when it cannot see,
/// and in cluster mode the volume view (thread `docker-view`; `etcd`: the
/// cluster's client and key prefix).
pub fn start(
    config: &DockerConfig,
    lifecycle: Lifecycle,
    etcd: Option<(crate::etcd::EtcdClient, String)>,
    health: super::RuleHealth,
    threads: &mut Threads,
    stop: Shutdown,
) -> Result<(), DockerError> {
    let socket = config.socket.clone();
    let listener = bind(&socket)?;
    let server =
        tiny_http::Server::from_listener(listener, None).map_err(|e| DockerError::Serve {
            path: socket.clone(),
            reason: e.to_string(),
        })?;
    let rebooted = lifecycle.store().rebooted();
    if rebooted {
        // The containers that held references died with the kernel; their
        // engines start them again with Mounts that count from nothing.
        match lifecycle.clear_references(super::ALLOC_PREFIX) {
            Ok(0) => {}
            Ok(n) => log::info!(
                "docker: the node rebooted: {n} engine mount(s) restored with no reference; the engines' next Mounts count again"
            ),
            Err(e) => log::warn!(
                "docker: the node rebooted, but the engine mounts' counts could not be cleared (kept: the engine-death rule releases what no container uses): {}",
                crate::error_chain(&e)
            ),
        }
    }
    // After a reboot no container holds a mount before the engine's Mount
    // of it: those mounts are not young.
    let turns = super::references::Turns::new(!rebooted);
    super::unused::start(
        super::unused::Rule {
            lifecycle: lifecycle.clone(),
            turns: turns.clone(),
            interval: config.unused_check_interval,
            min_age: config.engine_mount_timeout,
            driver: config.driver.clone(),
            engine_sockets: config.engine_sockets.clone(),
            health,
        },
        threads,
        stop.clone(),
    )
    .map_err(DockerError::Thread)?;
    let cluster = etcd.is_some();
    let view = super::view::View::new(lifecycle.clone(), etcd);
    view.start(threads, stop.clone())
        .map_err(DockerError::Thread)?;
    let driver = Driver {
        lifecycle,
        cluster,
        view,
        mount_timeout: config.mount_timeout,
        turns,
        mounts: super::driver::MountThreads::default(),
    };
    log::info!(
        "Docker volume plugin {} listening on {}",
        config.driver,
        socket.display()
    );
    threads
        .spawn("docker-plugin", move || serve(server, driver, stop))
        .map_err(DockerError::Thread)
}

fn bind(socket: &Path) -> Result<UnixListener, DockerError> {
    if let Some(dir) = socket.parent() {
        // Docker's own plugin directory is 0755.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|source| DockerError::Dir {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    if socket.exists() {
        if UnixStream::connect(socket).is_ok() {
            return Err(DockerError::InUse {
                path: socket.to_path_buf(),
            });
        }
        log::info!("removing stale Docker plugin socket {}", socket.display());
        std::fs::remove_file(socket).map_err(|source| DockerError::RemoveStale {
            path: socket.to_path_buf(),
            source,
        })?;
    }
    // Connecting needs write permission on the socket, which the umask
    // leaves to the owner (root) at most; 0600 makes it certain.
    let listener = UnixListener::bind(socket).map_err(|source| DockerError::Bind {
        path: socket.to_path_buf(),
        source,
    })?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
        DockerError::Bind {
            path: socket.to_path_buf(),
            source,
        }
    })?;
    Ok(listener)
}

fn serve(server: tiny_http::Server, driver: Driver, stop: Shutdown) {
    let mut requests = Threads::new();
    while !stop.is_triggered() {
        let request = match server.recv_timeout(RECV_POLL) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                log::warn!("Docker plugin socket: {e}");
                stop.sleep(RECV_POLL);
                continue;
            }
        };
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let endpoint = Endpoint::from_path(&path);
        let d = driver.clone();
        let name = format!("docker-{}", endpoint.map_or("unknown", Endpoint::name));
        if let Err(e) = requests.spawn(name, move || answer(request, endpoint, &path, &d)) {
            log::error!("cannot start a Docker plugin request thread: {e}");
        }
    }
    // Dropping the server closes the socket and removes its file.
    drop(server);
    let deadline = Instant::now() + STOP_WAIT;
    let left = requests.join_until(deadline);
    if !left.is_empty() {
        log::warn!("Docker plugin requests still running: {}", left.join(", "));
    }
    // Mounts that outlived a given-up Mount end with the agent's stop too.
    let left = driver.mounts.join_until(deadline);
    if !left.is_empty() {
        log::warn!("Docker plugin mounts still running: {}", left.join(", "));
    }
}

fn answer(mut request: tiny_http::Request, endpoint: Option<Endpoint>, path: &str, d: &Driver) {
    let mut body = Vec::new();
    let read = request
        .as_reader()
        .take(p::MAX_BODY_BYTES)
        .read_to_end(&mut body);
    let result = match (read, endpoint) {
        (Err(e), _) => Err(format!("cannot read the request: {e}")),
        (Ok(_), None) => Err(format!(
            "{path} is not an endpoint of the volume plugin protocol"
        )),
        (Ok(_), Some(ep)) => d
            .handle(ep, &body)
            .map_err(|e| crate::error_chain(&e))
            .inspect_err(|msg| {
                // The engines ask Get before every Create: an unknown name
                // there is the normal way in.
                if ep == Endpoint::Get {
                    log::debug!("Docker plugin {path}: {msg}");
                } else {
                    log::warn!("Docker plugin {path}: {msg}");
                }
            }),
    };
    let (code, value) = match result {
        Ok(v) => (200, v),
        Err(msg) => (500, p::error(&msg)),
    };
    let header = tiny_http::Header::from_bytes("Content-Type", p::CONTENT_TYPE)
        .expect("a constant, valid header");
    let response = tiny_http::Response::from_string(value.to_string())
        .with_status_code(code)
        .with_header(header);
    if let Err(e) = request.respond(response) {
        log::debug!("Docker plugin {path}: the answer was not delivered: {e}");
    }
}
