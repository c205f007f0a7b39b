//! The plugin's state, its error type, argument validation and the
//! Identity service. Node and Controller handlers live in `node.rs` and
//! `controller.rs`.

use std::path::{Component, Path};

use claimd::csi::*;
use grpcio::{RpcStatus, RpcStatusCode};
use protobuf::well_known_types::wrappers::BoolValue;
use protobuf::{EnumOrUnknown, MessageField};

use crate::call_log::CallLog;
use crate::config::Config;
use crate::controller_store::ControllerStore;
use crate::faults::Faults;
use crate::fencing::Fencing;
use crate::path_locks::{PathLocks, VolumeLocks};
use crate::stagings::Stagings;

/// A capability type number no CSI version defines: agents must ignore it
/// (advertised with `--unknown-capability`).
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

    pub fn not_found(message: impl Into<String>) -> Failure {
        Failure::new(RpcStatusCode::NOT_FOUND, message)
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
    /// Serialises stage and unstage of one volume, so that "staged at one
    /// path only" is decided and done in one step. Taken before any path
    /// lock, never while holding one.
    pub volume_locks: VolumeLocks,
    /// `staged/`: where each volume is staged.
    pub stagings: Stagings,
    /// `controller.json`: serialised decisions, group-committed writes.
    pub controller_state: ControllerStore,
    pub faults: Option<Faults>,
    pub call_log: Option<CallLog>,
    /// With `--fence-on-unpublish`: the fencing state in the shared
    /// storage.
    pub fencing: Option<Fencing>,
    /// `--epoch-key`: the fencing token's check.
    pub epochs: Option<crate::epochs::Epochs>,
}

impl Plugin {
    pub fn new(config: Config) -> Plugin {
        Plugin {
            faults: config.faults.clone().map(Faults::new),
            call_log: config.call_log.clone().map(CallLog::new),
            controller_state: if config.storage == config.root {
                ControllerStore::new(config.storage.join("controller.json"))
            } else {
                ControllerStore::shared(config.storage.join("controller.json"))
            },
            fencing: config
                .fence_on_unpublish
                .then(|| Fencing::new(&config.storage)),
            stagings: Stagings::new(config.root.join("staged")),
            epochs: config
                .epoch_key
                .clone()
                .map(|k| crate::epochs::Epochs::new(k, &config.storage)),
            config,
            path_locks: PathLocks::default(),
            volume_locks: VolumeLocks::default(),
        }
    }

    /// The epoch under `--epoch-key` in `ctx`, taken out and checked
    /// (`epochs.rs`); nothing without the flag.
    pub fn check_epoch(
        &self,
        volume_id: &str,
        field: &str,
        ctx: &mut std::collections::HashMap<String, String>,
    ) -> Outcome<()> {
        match &self.epochs {
            Some(e) => e.check(volume_id, field, ctx),
            None => Ok(()),
        }
    }

    /// The capability type no CSI version defines, with
    /// `--unknown-capability`.
    pub fn unknown_capability(&self) -> Option<i32> {
        self.config.unknown_capability.then_some(UNKNOWN_CAPABILITY)
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
        if self.config.topology.is_some() {
            r.capabilities.push(cap(EnumOrUnknown::new(
                Type::VOLUME_ACCESSIBILITY_CONSTRAINTS,
            )));
        }
        if self.config.expansion {
            use plugin_capability::volume_expansion::Type as Expansion;
            let mut e = plugin_capability::VolumeExpansion::new();
            e.type_ = EnumOrUnknown::new(Expansion::ONLINE);
            let mut c = PluginCapability::new();
            c.type_ = Some(plugin_capability::Type::VolumeExpansion(e));
            r.capabilities.push(c);
        }
        if let Some(unknown) = self.unknown_capability() {
            r.capabilities.push(cap(EnumOrUnknown::from_i32(unknown)));
        }
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

/// The path of a volume the CO asks about (`volume_path` of
/// NodeGetVolumeStats and NodeExpandVolume, the `staging_target_path` of
/// NodeExpandVolume). Missing: INVALID_ARGUMENT (a required field). Not an
/// absolute path (or with `..`): NOT_FOUND, the spec's code for "volume
/// does not exist on specified volume_path" (no volume can be mounted at a
/// relative path of the plugin's root file system), which is what csi-sanity
/// expects; INVALID_ARGUMENT would tell the CO its request is malformed and
/// never to retry it.
pub fn volume_path<'a>(field: &str, path: &'a str) -> Outcome<&'a Path> {
    match valid_path(field, path) {
        Err(_) if !path.is_empty() => Err(Failure::not_found(format!(
            "{field} {path:?} is not an absolute path: no volume is mounted there"
        ))),
        other => other,
    }
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

/// The capability's access mode: required, and one CSI defines.
pub fn access_mode(cap: &VolumeCapability) -> Outcome<volume_capability::access_mode::Mode> {
    use volume_capability::access_mode::Mode;
    match cap.access_mode.as_ref().map(|m| m.mode.enum_value()) {
        Some(Ok(m)) if m != Mode::UNKNOWN => Ok(m),
        Some(Err(n)) => Err(Failure::invalid(format!(
            "volume_capability.access_mode {n} is not an access mode"
        ))),
        _ => Err(Failure::invalid(
            "volume_capability.access_mode is required",
        )),
    }
}

/// A required volume capability (access type and access mode); whether it
/// asks for a block volume.
pub fn check_capability(cap: &MessageField<VolumeCapability>) -> Outcome<bool> {
    let cap = cap
        .as_ref()
        .ok_or_else(|| Failure::invalid("volume_capability is required"))?;
    let block = is_block(cap)?;
    access_mode(cap)?;
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_the_co_gives_must_be_absolute_without_dot_dot() {
        assert_eq!(
            valid_path("target_path", "/a/b")
                .map(Path::to_path_buf)
                .ok(),
            Some("/a/b".into())
        );
        for bad in ["", "a/b", "/a/../b", "/a\0b"] {
            let e = valid_path("target_path", bad).expect_err(bad);
            assert_eq!(e.code, RpcStatusCode::INVALID_ARGUMENT, "{bad:?}");
        }
    }

    #[test]
    fn a_volume_path_that_is_not_absolute_is_not_found_and_a_missing_one_invalid() {
        assert_eq!(
            volume_path("volume_path", "/a/b")
                .map(Path::to_path_buf)
                .ok(),
            Some("/a/b".into())
        );
        let e = volume_path("volume_path", "").expect_err("empty");
        assert_eq!(e.code, RpcStatusCode::INVALID_ARGUMENT);
        assert_eq!(e.message, "volume_path is required");
        for bad in ["relative/path", ".", "/a/../b"] {
            let e = volume_path("volume_path", bad).expect_err(bad);
            assert_eq!(e.code, RpcStatusCode::NOT_FOUND, "{bad:?}");
            assert!(e.message.contains(bad), "{}", e.message);
        }
    }
}
