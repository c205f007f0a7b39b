//! The volume plugin protocol on the wire: the request bodies the engines
//! send and the answers they read. Field names are the protocol's
//! (`Name`, `Opts`, `ID`, `Mountpoint`, `Err`); fields the engines add
//! later are ignored.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{json, Value};

/// The media type of every answer (the protocol's v1).
pub const CONTENT_TYPE: &str = "application/vnd.docker.plugins.v1+json";

/// Largest request body read; the protocol's requests are a few hundred
/// bytes.
pub const MAX_BODY_BYTES: u64 = 1024 * 1024;

/// The endpoints, as the request path names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Activate,
    Create,
    Remove,
    Mount,
    Unmount,
    Path,
    Get,
    List,
    Capabilities,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Some(match path {
            "/Plugin.Activate" => Endpoint::Activate,
            "/VolumeDriver.Create" => Endpoint::Create,
            "/VolumeDriver.Remove" => Endpoint::Remove,
            "/VolumeDriver.Mount" => Endpoint::Mount,
            "/VolumeDriver.Unmount" => Endpoint::Unmount,
            "/VolumeDriver.Path" => Endpoint::Path,
            "/VolumeDriver.Get" => Endpoint::Get,
            "/VolumeDriver.List" => Endpoint::List,
            "/VolumeDriver.Capabilities" => Endpoint::Capabilities,
            _ => return None,
        })
    }

    /// For thread names and logs.
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Activate => "activate",
            Endpoint::Create => "create",
            Endpoint::Remove => "remove",
            Endpoint::Mount => "mount",
            Endpoint::Unmount => "unmount",
            Endpoint::Path => "path",
            Endpoint::Get => "get",
            Endpoint::List => "list",
            Endpoint::Capabilities => "capabilities",
        }
    }
}

/// `Create`: the volume's name and the `--opt` options.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CreateRequest {
    #[serde(rename = "Name", default)]
    pub name: String,
    /// `null` when the engine has none.
    #[serde(rename = "Opts", default)]
    pub opts: Option<BTreeMap<String, String>>,
}

/// `Remove`, `Path`, `Get`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NameRequest {
    #[serde(rename = "Name", default)]
    pub name: String,
}

/// `Mount`, `Unmount`: the engine's ID of this one mount.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct MountRequest {
    #[serde(rename = "Name", default)]
    pub name: String,
    #[serde(rename = "ID", default)]
    pub id: String,
}

/// Parses a request body; an empty body reads as `{}`.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, serde_json::Error> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    serde_json::from_slice(body)
}

pub fn activate() -> Value {
    json!({"Implements": ["VolumeDriver"]})
}

/// A failure the user sees (`docker: Error response from daemon: ...`).
pub fn error(message: &str) -> Value {
    json!({ "Err": message })
}

/// One volume as `Get` and `List` show it (`created_at`: RFC 3339).
pub fn volume(
    name: &str,
    mountpoint: &str,
    created_at: Option<&str>,
    status: Option<Value>,
) -> Value {
    let mut v = json!({"Name": name, "Mountpoint": mountpoint});
    if let Some(c) = created_at {
        v["CreatedAt"] = json!(c);
    }
    if let Some(s) = status {
        v["Status"] = s;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_the_engines_send_them() {
        let c: CreateRequest =
            parse(br#"{"Name":"db","Opts":{"plugin_id":"hp"}}"#).expect("create");
        assert_eq!(c.name, "db");
        assert_eq!(c.opts.expect("opts")["plugin_id"], "hp");
        let c: CreateRequest = parse(br#"{"Name":"db","Opts":null}"#).expect("null opts");
        assert!(c.opts.is_none());
        let m: MountRequest = parse(br#"{"Name":"db","ID":"abc","Extra":1}"#).expect("mount");
        assert_eq!((m.name.as_str(), m.id.as_str()), ("db", "abc"));
        let n: NameRequest = parse(b"").expect("empty body");
        assert_eq!(n.name, "");
        assert!(parse::<NameRequest>(b"{").is_err());
        assert_eq!(
            Endpoint::from_path("/VolumeDriver.Mount"),
            Some(Endpoint::Mount)
        );
        assert_eq!(Endpoint::from_path("/VolumeDriver.Bogus"), None);
    }
}
