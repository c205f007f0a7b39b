//! `claimd-test-plugin`: a real CSI plugin (Identity, Node, Controller)
//! over a unix socket, for claimd's integration tests. Real bind mounts,
//! persistent controller and staging state, a JSON-lines call log and a
//! fault file that makes chosen calls fail, hang, exit, finish after the
//! caller's deadline or answer nonsense. As strict as real plugins: unknown
//! volume or node IDs, second staging paths, second attachments of
//! single-node volumes, conflicting names and missing fields are refused
//! with the spec's codes (`inventory.rs`, `stagings.rs`). Plugins of
//! several nodes can share one storage system (`--storage`), and with
//! `--fence-on-unpublish` a ControllerUnpublishVolume really cuts the node
//! off: it unmounts the node's staging and target paths and refuses its
//! NodeStage and NodePublish until the next ControllerPublishVolume
//! (`fencing.rs`). The call log records each call's start (with
//! `--log-starts`) and end with CLOCK_BOOTTIME timestamps (`call_log.rs`).
//! See `--help` (and `config.rs`) for the flags, the call log fields and
//! the fault file format.

#[path = "test_plugin/call_log.rs"]
mod call_log;
#[path = "test_plugin/config.rs"]
mod config;
#[path = "test_plugin/controller.rs"]
mod controller;
#[path = "test_plugin/controller_store.rs"]
mod controller_store;
#[path = "test_plugin/epochs.rs"]
mod epochs;
#[path = "test_plugin/faults.rs"]
mod faults;
#[path = "test_plugin/fencing.rs"]
mod fencing;
#[path = "test_plugin/files.rs"]
mod files;
#[path = "test_plugin/inventory.rs"]
mod inventory;
#[path = "test_plugin/mounts.rs"]
mod mounts;
#[path = "test_plugin/node.rs"]
mod node;
#[path = "test_plugin/path_locks.rs"]
mod path_locks;
#[path = "test_plugin/plugin.rs"]
mod plugin;
#[path = "test_plugin/server.rs"]
mod server;
#[path = "test_plugin/stagings.rs"]
mod stagings;
#[path = "test_plugin/volume_ops.rs"]
mod volume_ops;

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use config::{Config, Parsed, USAGE};

fn main() -> ExitCode {
    let config = match Config::parse(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(config)) => *config,
        Ok(Parsed::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("claimd-test-plugin: {e}\nTry 'claimd-test-plugin --help'.");
            return ExitCode::from(2);
        }
    };
    init_logging();
    match run(config) {
        Ok(signal) => {
            log::info!("exiting on signal {signal}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| {
            writeln!(
                buf,
                "{} {:5} test-plugin[{}] {}",
                buf.timestamp_millis(),
                record.level(),
                std::thread::current().name().unwrap_or("-"),
                record.args()
            )
        })
        .init();
}

/// Serves until SIGTERM or SIGINT; returns the signal's number.
fn run(config: Config) -> Result<usize, String> {
    fs::create_dir_all(&config.root)
        .map_err(|e| format!("cannot create {}: {e}", config.root.display()))?;
    let volumes = config.storage.join("volumes");
    fs::create_dir_all(&volumes)
        .map_err(|e| format!("cannot create {}: {e}", volumes.display()))?;
    remove_stale_socket(&config)?;

    // Signals arrive on a self-pipe (the main thread just blocks on it),
    // and which one it was in an atomic.
    let (mut signal_rx, signal_tx) =
        UnixStream::pair().map_err(|e| format!("cannot create the signal pipe: {e}"))?;
    let received = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let tx = signal_tx
            .try_clone()
            .map_err(|e| format!("cannot clone the signal pipe: {e}"))?;
        let number = usize::try_from(sig).expect("signal numbers are positive");
        signal_hook::flag::register_usize(sig, Arc::clone(&received), number)
            .map_err(|e| format!("cannot handle signal {sig}: {e}"))?;
        signal_hook::low_level::pipe::register(sig, tx)
            .map_err(|e| format!("cannot handle signal {sig}: {e}"))?;
    }

    let endpoint = config.endpoint.clone();
    let plugin = Arc::new(plugin::Plugin::new(config));
    let env = claimd::csi::grpc_environment("plugin-grpc");
    let mut builder = grpcio::ServerBuilder::new(env);
    for service in server::services(&plugin) {
        builder = builder.register_service(service);
    }
    let mut server = builder
        .build()
        .map_err(|e| format!("cannot build the gRPC server: {e}"))?;
    server
        .add_listening_port(
            format!("unix:{}", endpoint.display()),
            grpcio::ServerCredentials::insecure(),
        )
        .map_err(|e| format!("cannot listen on {}: {e}", endpoint.display()))?;
    server.start();
    log::info!(
        "{} serving on {} (node {}, stage={}, controller={}, storage {}, fencing={})",
        plugin.config.name,
        endpoint.display(),
        plugin.config.node_id,
        plugin.config.stage,
        plugin.config.controller,
        plugin.config.storage.display(),
        plugin.config.fence_on_unpublish
    );

    let mut byte = [0u8; 1];
    loop {
        match signal_rx.read(&mut byte) {
            Ok(1) => break,
            Ok(_) => return Err("the signal pipe closed".to_string()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read the signal pipe: {e}")),
        }
    }
    // Like a real plugin killed by SIGTERM: no graceful shutdown (a hung
    // call would block it), and the socket file stays behind.
    std::mem::forget(server);
    Ok(received.load(Ordering::SeqCst))
}

fn remove_stale_socket(config: &Config) -> Result<(), String> {
    let path = &config.endpoint;
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot stat {}: {e}", path.display())),
        Ok(m) if m.file_type().is_socket() => {
            log::info!("removing stale socket {}", path.display());
            fs::remove_file(path).map_err(|e| format!("cannot remove {}: {e}", path.display()))
        }
        Ok(_) => Err(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        )),
    }
}
