//! The plugin's state, its error type, argument validation and the
//! Identity service. Node and Controller handlers live in `node.rs` and
//! `controller.rs`.

use std::fs;
use std::path::{Component, Path, PathBuf};

use claimd::csi::*;
use grpcio::{RpcStatus, RpcStatusCode};
use protobuf::well_known_types::wrappers::BoolValue;
use protobuf::{EnumOrUnknown, MessageField};

use crate::call_log::CallLog;
use crate::config::Config;
use crate::controller_store::ControllerStore;
use crate::faults::Faults;
use crate::path_locks::PathLocks;

/// A capability type number no CSI version defines: agents must ignore it.
pub const UNKNOWN_CAPABILITY: i32 = 99;

/// A failed call: the status the plugin answers with.
#[derive(Debug)]
pub struct Failure {
    pub code: RpcStatusCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: RpcStatusCode, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure::new(RpcStatusCode::INVALID_ARGUMENT, message)
    }

    pub fn precondition(message: impl Into<String>) -> Failure {
        Failure::new(RpcStatusCode::FAILED_PRECONDITION, message)
    }

    pub fn internal(message: impl Into<String>) -> Failure {
        Failure::new(RpcStatusCode::INTERNAL, message)
    }

    pub fn unimplemented(method: &str, why: &str) -> Failure {
        Failure::new(
            RpcStatusCode::UNIMPLEMENTED,
            format!("{method} is not implemented: {why}"),
        )
    }

    pub fn status(&self) -> RpcStatus {
        RpcStatus::with_message(self.code, self.message.clone())
    }
}

/// An error of the plugin's own files (controller state): INTERNAL.
impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::internal(message)
    }
}

pub type Outcome<T> = Result<T, Failure>;

/// Per-call facts set by a fault rule that a handler must see.
#[derive(Debug, Default)]
pub struct Call {
    /// Probe answers ready=false.
    pub not_ready: bool,
}

pub struct Plugin {
    pub config: Config,
    /// Serialises node operations on a common staging or target path
    /// (calls on different paths run concurrently). Never held while a
    /// fault delays a call.
    pub path_locks: PathLocks,
    /// `controller.json`: serialised decisions, group-committed writes.
    pub controller_state: ControllerStore,
    pub faults: Option<Faults>,
    pub call_log: Option<CallLog>,
}

impl Plugin {
    pub fn new(config: Config) -> Plugin {
        Plugin {
            faults: config.faults.clone().map(Faults::new),
            call_log: config.call_log.clone().map(CallLog::new),
            controller_state: ControllerStore::new(config.root.join("controller.json")),
            config,
            path_locks: PathLocks::default(),
        }
    }

    pub fn volumes_dir(&self) -> PathBuf {
        self.config.root.join("volumes")
    }

    /// `<root>/volumes/<id>`, created on demand.
    pub fn volume_dir(&self, id: &str) -> Outcome<PathBuf> {
        let dir = self.volumes_dir().join(id);
        fs::create_dir_all(&dir).map_err(|e| {
            Failure::internal(format!("cannot create volume {}: {e}", dir.display()))
        })?;
        Ok(dir)
    }

    /// `<root>/volumes/<id>.img`, the block volume, created on demand.
    pub fn volume_image(&self, id: &str) -> Outcome<PathBuf> {
        let img = self.volumes_dir().join(format!("{id}.img"));
        let created = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&img)
            .and_then(|f| {
                if f.metadata()?.len() == 0 {
                    f.set_len(1 << 20)?;
                }
                Ok(())
            });
        created.map_err(|e| {
            Failure::internal(format!("cannot create block volume {}: {e}", img.display()))
        })?;
        Ok(img)
    }

    // ---- Identity --------------------------------------------------------

    pub fn get_plugin_info(
        &self,
        _req: GetPluginInfoRequest,
        _call: &Call,
    ) -> Outcome<GetPluginInfoResponse> {
        let mut r = GetPluginInfoResponse::new();
        r.name = self.config.name.clone();
        r.vendor_version = env!("CARGO_PKG_VERSION").to_string();
        Ok(r)
    }

    pub fn get_plugin_capabilities(
        &self,
        _req: GetPluginCapabilitiesRequest,
        _call: &Call,
    ) -> Outcome<GetPluginCapabilitiesResponse> {
        use plugin_capability::service::Type;
        let cap = |t: EnumOrUnknown<Type>| {
            let mut service = plugin_capability::Service::new();
            service.type_ = t;
            let mut c = PluginCapability::new();
            c.type_ = Some(plugin_capability::Type::Service(service));
            c
        };
        let mut r = GetPluginCapabilitiesResponse::new();
        if self.config.controller {
            r.capabilities
                .push(cap(EnumOrUnknown::new(Type::CONTROLLER_SERVICE)));
        }
        r.capabilities
            .push(cap(EnumOrUnknown::from_i32(UNKNOWN_CAPABILITY)));
        Ok(r)
    }

    pub fn probe(&self, _req: ProbeRequest, call: &Call) -> Outcome<ProbeResponse> {
        let mut ready = BoolValue::new();
        ready.value = !call.not_ready;
        let mut r = ProbeResponse::new();
        r.ready = MessageField::some(ready);
        Ok(r)
    }
}

/// A volume ID usable as a single path component.
pub fn valid_volume_id<'a>(field: &str, id: &'a str) -> Outcome<&'a str> {
    if id.is_empty() {
        return Err(Failure::invalid(format!("{field} is required")));
    }
    if id.contains('/') || id.contains("..") || id.contains('\0') || id == "." {
        return Err(Failure::invalid(format!(
            "{field} {id:?} is not a valid volume ID"
        )));
    }
    Ok(id)
}

/// An absolute path without `..` components.
pub fn valid_path<'a>(field: &str, path: &'a str) -> Outcome<&'a Path> {
    if path.is_empty() {
        return Err(Failure::invalid(format!("{field} is required")));
    }
    let p = Path::new(path);
    if !p.is_absolute() || path.contains('\0') || p.components().any(|c| c == Component::ParentDir)
    {
        return Err(Failure::invalid(format!(
            "{field} {path:?} is not an absolute path"
        )));
    }
    Ok(p)
}

/// Whether the capability asks for a block volume. The access type is
/// required.
pub fn is_block(cap: &VolumeCapability) -> Outcome<bool> {
    match &cap.access_type {
        Some(volume_capability::Access_type::Block(_)) => Ok(true),
        Some(volume_capability::Access_type::Mount(_)) => Ok(false),
        _ => Err(Failure::invalid(
            "volume_capability.access_type (mount or block) is required",
        )),
    }
}
