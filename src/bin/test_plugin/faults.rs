//! The fault file: rules that make chosen calls fail, hang, exit or answer
//! nonsense. Re-read on every call, so a test changes behaviour by
//! rewriting the file; a rule with a count is consumed in the file itself,
//! so an `exit` fault fires once even across plugin restarts.

use std::fs;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use grpcio::RpcStatusCode;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::files::write_atomic;

/// Every RPC the plugin serves, named as on the wire.
pub const METHODS: &[&str] = &[
    "GetPluginInfo",
    "GetPluginCapabilities",
    "Probe",
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeGetCapabilities",
    "NodeGetInfo",
    "NodeGetVolumeStats",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "ValidateVolumeCapabilities",
    "ControllerGetCapabilities",
    "CreateVolume",
    "DeleteVolume",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ListSnapshots",
    "ControllerExpandVolume",
    "NodeExpandVolume",
];

/// The calls a `late` rule applies to: those with an effect.
pub const LATE_METHODS: &[&str] = &[
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "CreateVolume",
    "DeleteVolume",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ControllerExpandVolume",
    "NodeExpandVolume",
];

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultFile {
    #[serde(default)]
    rules: Vec<Rule>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    volume_id: Option<String>,
    action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    count: Option<u64>,
}

/// What a matching rule makes the plugin do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Answer this status without doing the work.
    Fail {
        code: RpcStatusCode,
        message: String,
    },
    /// Sleep, then do the work normally.
    Delay(Duration),
    /// Wait until the caller's deadline has passed, sleep this much more,
    /// then do the work (and log the call as late): the caller sees
    /// DEADLINE_EXCEEDED, yet the effect happens.
    Late(Duration),
    /// Never answer (until the process ends).
    Hang,
    /// Record the call with code EXIT and exit(17) without answering.
    Exit,
    /// Probe only: answer ready=false.
    NotReady,
    /// Answer a default (empty) response without doing the work.
    Empty,
    /// Answer bytes that do not decode as the response.
    Garbage,
}

impl Rule {
    fn action(&self) -> Result<Action, String> {
        if !METHODS.contains(&self.method.as_str()) {
            return Err(format!("unknown method {:?}", self.method));
        }
        let forbid = |field: &str, present: bool| {
            if present {
                Err(format!(
                    "field {field} does not apply to action {:?}",
                    self.action
                ))
            } else {
                Ok(())
            }
        };
        if self.action != "fail" {
            forbid("code", self.code.is_some())?;
            forbid("message", self.message.is_some())?;
        }
        if self.action != "delay" && self.action != "late" {
            forbid("ms", self.ms.is_some())?;
        }
        Ok(match self.action.as_str() {
            "fail" => {
                let name = self.code.as_deref().ok_or("action fail needs a code")?;
                let code = claimd::csi::code_from_name(name)
                    .filter(|c| *c != RpcStatusCode::OK)
                    .ok_or_else(|| format!("{name:?} is not a gRPC error code name"))?;
                Action::Fail {
                    code,
                    message: self
                        .message
                        .clone()
                        .unwrap_or_else(|| format!("injected fault: {name}")),
                }
            }
            "delay" => Action::Delay(Duration::from_millis(
                self.ms.ok_or("action delay needs ms")?,
            )),
            "late" if LATE_METHODS.contains(&self.method.as_str()) => {
                Action::Late(Duration::from_millis(self.ms.unwrap_or(0)))
            }
            "late" => {
                return Err(format!(
                    "action late applies to volume calls only ({}), not {}",
                    LATE_METHODS.join(", "),
                    self.method
                ))
            }
            "hang" => Action::Hang,
            "exit" => Action::Exit,
            "not_ready" if self.method == "Probe" => Action::NotReady,
            "not_ready" => return Err("action not_ready applies to Probe only".into()),
            "empty" => Action::Empty,
            "garbage" => Action::Garbage,
            other => return Err(format!("unknown action {other:?}")),
        })
    }

    fn matches(&self, method: &str, volume_id: Option<&str>) -> bool {
        self.method == method
            && self.count != Some(0)
            && match &self.volume_id {
                None => true,
                Some(v) => volume_id == Some(v.as_str()),
            }
    }
}

/// The fault file of one plugin process.
pub struct Faults {
    path: PathBuf,
    /// Serialises read-decide-rewrite, so concurrent calls consume a counted
    /// rule exactly once each.
    lock: Mutex<()>,
}

impl Faults {
    pub fn new(path: PathBuf) -> Faults {
        Faults {
            path,
            lock: Mutex::new(()),
        }
    }

    /// The action for this call, if a rule matches; consumes one use of a
    /// counted rule. An unreadable or invalid file is an error (the call
    /// then fails with INTERNAL, so a broken test setup is loud).
    pub fn take(&self, method: &str, volume_id: Option<&str>) -> Result<Option<Action>, String> {
        let _guard = self.lock.lock();
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(format!(
                    "cannot read fault file {}: {e}",
                    self.path.display()
                ))
            }
        };
        if text.trim().is_empty() {
            return Ok(None);
        }
        let invalid = |e: String| format!("fault file {} is invalid: {e}", self.path.display());
        let mut file: FaultFile =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        for (i, rule) in file.rules.iter().enumerate() {
            rule.action()
                .map_err(|e| invalid(format!("rule {i}: {e}")))?;
        }
        let Some(index) = file.rules.iter().position(|r| r.matches(method, volume_id)) else {
            return Ok(None);
        };
        let action = file.rules[index].action().map_err(invalid)?;
        if let Some(count) = file.rules[index].count {
            if count <= 1 {
                file.rules.remove(index);
            } else {
                file.rules[index].count = Some(count - 1);
            }
            let bytes = serde_json::to_vec_pretty(&file).map_err(|e| invalid(e.to_string()))?;
            write_atomic(&self.path, &bytes)
                .map_err(|e| format!("cannot rewrite fault file {}: {e}", self.path.display()))?;
        }
        Ok(Some(action))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults(json: &str) -> (tempfile::TempDir, Faults) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("faults.json");
        fs::write(&path, json).expect("write fault file");
        (dir, Faults::new(path))
    }

    #[test]
    fn count_is_consumed_and_rule_dropped() {
        let (_dir, f) = faults(
            r#"{"rules":[{"method":"Probe","action":"fail","code":"UNAVAILABLE","count":2}]}"#,
        );
        for _ in 0..2 {
            assert!(matches!(
                f.take("Probe", None),
                Ok(Some(Action::Fail {
                    code: RpcStatusCode::UNAVAILABLE,
                    ..
                }))
            ));
        }
        assert_eq!(f.take("Probe", None), Ok(None));
        let left: FaultFile =
            serde_json::from_str(&fs::read_to_string(&f.path).expect("read")).expect("parse");
        assert!(left.rules.is_empty());
    }

    #[test]
    fn volume_filter_and_first_match() {
        let (_dir, f) = faults(
            r#"{"rules":[
                {"method":"NodeStageVolume","volume_id":"a","action":"hang"},
                {"method":"NodeStageVolume","action":"exit"}]}"#,
        );
        assert_eq!(f.take("NodeStageVolume", Some("a")), Ok(Some(Action::Hang)));
        assert_eq!(f.take("NodeStageVolume", Some("b")), Ok(Some(Action::Exit)));
        assert_eq!(f.take("NodeUnstageVolume", Some("a")), Ok(None));
    }

    #[test]
    fn invalid_rules_are_errors() {
        for bad in [
            r#"{"rules":[{"method":"Nope","action":"hang"}]}"#,
            r#"{"rules":[{"method":"Probe","action":"fail"}]}"#,
            r#"{"rules":[{"method":"Probe","action":"fail","code":"OK"}]}"#,
            r#"{"rules":[{"method":"NodeGetInfo","action":"not_ready"}]}"#,
            r#"{"rules":[{"method":"Probe","action":"delay"}]}"#,
            r#"{"rules":[{"method":"Probe","action":"hang","ms":3}]}"#,
            r#"{"rules":[{"method":"Probe","action":"late","ms":3}]}"#,
            r#"{"rules":[{"method":"NodeStageVolume","action":"late","code":"ABORTED"}]}"#,
            r#"{"rules":[{"method":"Probe","action":"hang","typo":1}]}"#,
            r#"{"rules":"#,
        ] {
            let (_dir, f) = faults(bad);
            assert!(f.take("Probe", None).is_err(), "{bad}");
        }
    }

    #[test]
    fn late_takes_an_optional_ms() {
        let (_dir, f) = faults(
            r#"{"rules":[
                {"method":"NodeStageVolume","action":"late","ms":250},
                {"method":"NodePublishVolume","action":"late"}]}"#,
        );
        assert_eq!(
            f.take("NodeStageVolume", Some("v")),
            Ok(Some(Action::Late(Duration::from_millis(250))))
        );
        assert_eq!(
            f.take("NodePublishVolume", Some("v")),
            Ok(Some(Action::Late(Duration::ZERO)))
        );
    }

    #[test]
    fn missing_file_means_no_faults() {
        let dir = tempfile::tempdir().expect("temp dir");
        let f = Faults::new(dir.path().join("absent.json"));
        assert_eq!(f.take("Probe", None), Ok(None));
    }
}
