//! What `Create`'s options (`docker volume create --opt KEY=VALUE`) mean.
//!
//! The keys are the field names of `claimd volume register` and `claimd
//! volume create` definitions (`-` may stand for `_`), and the values are
//! put into the same JSON definition and read by the same parser, so a
//! volume reads the same whichever way it came in:
//!
//! - `external_id` present: an existing volume is registered;
//! - other definition keys without it: a new volume is created through
//!   the controller plugin (`size`, `limit_bytes`, `name`, `parameters.K`);
//! - no option at all: the name refers to a volume already registered.
//!
//! Options are visible to anyone who can run `docker volume inspect`, so
//! they never carry secrets: `secrets_file` names a file owned by root and
//! readable by no one else, holding a JSON object of strings.

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::volumes::{SpecError, VolumeCreate, VolumeSpec};

/// What a `Create` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Definition {
    /// No options: a volume that is registered already.
    Refer,
    /// An existing volume of the storage system.
    Register(VolumeSpec),
    /// A new volume, made by the controller plugin.
    Create(VolumeCreate),
}

#[derive(Debug)]
pub enum OptionError {
    Unknown { key: String },
    Secret { key: String },
    Both { create_key: String },
    Value { key: String, problem: String },
    SecretsFile { path: PathBuf, problem: String },
    Definition(serde_json::Error),
    Spec(SpecError),
}

/// Every key an option may have (after `-` became `_`), for messages.
const KEYS: &str = "plugin_id, external_id, access_modes, attachment_modes, fs_type, mount_flags, \
                    context.KEY, topology.KEY, secrets_file; to create: size, limit_bytes, name, \
                    parameters.KEY";

impl fmt::Display for OptionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptionError::Unknown { key } => {
                write!(f, "unknown option {key:?} (the options are {KEYS})")
            }
            OptionError::Secret { key } => write!(
                f,
                "option {key:?}: secrets never go in options (anyone who can run `docker volume inspect` reads them); name a file owned by root with mode 0600 in secrets_file=PATH, or register the volume with `claimd volume register`"
            ),
            OptionError::Both { create_key } => write!(
                f,
                "options external_id and {create_key} do not go together: external_id registers an existing volume, {create_key} creates a new one"
            ),
            OptionError::Value { key, problem } => write!(f, "option {key}: {problem}"),
            OptionError::SecretsFile { path, problem } => {
                write!(f, "secrets file {}: {problem}", path.display())
            }
            OptionError::Definition(_) => f.write_str("the options are not a volume definition"),
            OptionError::Spec(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for OptionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OptionError::Definition(e) => Some(e),
            _ => None,
        }
    }
}

/// Keys that make a new volume.
const CREATE_KEYS: [&str; 3] = ["size", "limit_bytes", "name"];

fn list(v: &str) -> Vec<Value> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| Value::String(s.to_string()))
        .collect()
}

/// `10737418240`, `10G`, `512Mi`, `1T` (K, M, G, T: powers of 1024).
pub fn parse_size(key: &str, v: &str) -> Result<i64, OptionError> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let shift = match unit.trim_end_matches('i').trim_end_matches(['B', 'b']) {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        "T" | "t" => 40,
        _ => -1,
    };
    let n: i64 = num.parse().unwrap_or(-1);
    if shift < 0 || n <= 0 {
        return Err(OptionError::Value {
            key: key.to_string(),
            problem: format!("{v:?} is not a size such as 1073741824, 512M or 10G"),
        });
    }
    n.checked_mul(1i64 << shift).ok_or(OptionError::Value {
        key: key.to_string(),
        problem: format!("{v} is too large"),
    })
}

/// Reads the options of `Create` for volume `name` (already a valid ID).
pub fn parse(name: &str, opts: &BTreeMap<String, String>) -> Result<Definition, OptionError> {
    if opts.is_empty() {
        return Ok(Definition::Refer);
    }
    let mut flat: BTreeMap<String, String> = BTreeMap::new();
    let mut context = Map::new();
    let mut topology = Map::new();
    let mut parameters = Map::new();
    let mut secrets = None;
    for (raw_key, value) in opts {
        let key = raw_key.trim().replace('-', "_");
        if key == "secrets" || key.starts_with("secret.") || key.starts_with("secrets.") {
            return Err(OptionError::Secret { key: key.clone() });
        }
        let sub = |prefix: &str| key.strip_prefix(prefix).filter(|k| !k.is_empty());
        if let Some(k) = sub("context.") {
            context.insert(k.to_string(), json!(value));
        } else if let Some(k) = sub("topology.") {
            topology.insert(k.to_string(), json!(value));
        } else if let Some(k) = sub("parameters.").or_else(|| sub("parameter.")) {
            parameters.insert(k.to_string(), json!(value));
        } else if key == "secrets_file" {
            secrets = Some(read_secrets_file(Path::new(value))?);
        } else {
            let key = match key.as_str() {
                "plugin" => "plugin_id",
                "access_mode" => "access_modes",
                "attachment_mode" | "attachment" => "attachment_modes",
                "capacity" | "required_bytes" => "size",
                k => k,
            };
            let known = [
                "plugin_id",
                "external_id",
                "access_modes",
                "attachment_modes",
                "fs_type",
                "mount_flags",
            ];
            if !known.contains(&key) && !CREATE_KEYS.contains(&key) {
                return Err(OptionError::Unknown {
                    key: raw_key.clone(),
                });
            }
            flat.insert(key.to_string(), value.clone());
        }
    }
    let get = |k: &str| flat.get(k).map(String::as_str);
    let Some(plugin_id) = get("plugin_id") else {
        return Err(OptionError::Value {
            key: "plugin_id".into(),
            problem: "is required with any other option (the CSI plugin of the volume)".into(),
        });
    };
    let create_key = CREATE_KEYS
        .iter()
        .find(|k| flat.contains_key(**k))
        .map(|k| k.to_string())
        .or_else(|| (!parameters.is_empty()).then(|| "parameters".to_string()));
    let mut def = json!({
        "id": name,
        "plugin_id": plugin_id,
        "access_modes": list(get("access_modes").unwrap_or("single-node-writer")),
        "attachment_modes": list(get("attachment_modes").unwrap_or("file-system")),
        "mount_options": {
            "fs_type": get("fs_type").unwrap_or(""),
            "mount_flags": list(get("mount_flags").unwrap_or("")),
        },
    });
    if let Some(s) = secrets {
        def["secrets"] = Value::Object(s);
    }
    if let Some(external_id) = get("external_id") {
        if let Some(create_key) = create_key {
            return Err(OptionError::Both { create_key });
        }
        def["external_id"] = json!(external_id);
        def["context"] = Value::Object(context);
        if !topology.is_empty() {
            def["accessible_topology"] = json!([topology]);
        }
        let spec: VolumeSpec = serde_json::from_value(def).map_err(OptionError::Definition)?;
        spec.validate().map_err(OptionError::Spec)?;
        return Ok(Definition::Register(spec));
    }
    if let Some(k) = context.keys().next() {
        return Err(OptionError::Value {
            key: format!("context.{k}"),
            problem: "a new volume's context comes from its plugin; context goes with external_id"
                .into(),
        });
    }
    let mut range = Map::new();
    for (key, field) in [("size", "required_bytes"), ("limit_bytes", "limit_bytes")] {
        if let Some(v) = get(key) {
            range.insert(field.into(), json!(parse_size(key, v)?));
        }
    }
    def["capacity_range"] = Value::Object(range);
    def["parameters"] = Value::Object(parameters);
    if let Some(n) = get("name") {
        def["name"] = json!(n);
    }
    if !topology.is_empty() {
        def["accessibility_requirements"] = json!({ "requisite": [topology] });
    }
    let create: VolumeCreate = serde_json::from_value(def).map_err(OptionError::Definition)?;
    create.validate().map_err(OptionError::Spec)?;
    Ok(Definition::Create(create))
}

/// The secrets in `path`: a JSON object of strings in a regular file owned
/// by root that no one else may read or write.
pub fn read_secrets_file(path: &Path) -> Result<Map<String, Value>, OptionError> {
    let bad = |problem: String| OptionError::SecretsFile {
        path: path.to_path_buf(),
        problem,
    };
    if !path.is_absolute() {
        return Err(bad("is not an absolute path".into()));
    }
    let meta = std::fs::symlink_metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("is not a regular file".into()));
    }
    if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "must be owned by root and readable by no one else (mode 0600); it is owned by uid {} with mode {:04o}",
            meta.uid(),
            meta.mode() & 0o7777
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) if m.values().all(Value::is_string) => Ok(m),
        _ => Err(bad(
            "must hold one JSON object of strings ({\"key\": \"value\"})".into(),
        )),
    }
}

/// How a wanted definition differs from the registered one, one phrase per
/// field (secrets by name only). Empty: the same.
pub fn differences(def: &Definition, have: &VolumeSpec) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |field: &str, want: String, got: String| {
        if want != got {
            out.push(format!("{field} is {got} there, not {want}"));
        }
    };
    let join = |v: &[String]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(",")
        }
    };
    let names = |v: &[crate::volumes::AccessMode]| {
        join(&v.iter().map(|m| m.to_string()).collect::<Vec<_>>())
    };
    let attach = |v: &[crate::volumes::AttachmentMode]| {
        join(&v.iter().map(|m| m.to_string()).collect::<Vec<_>>())
    };
    let (plugin_id, access, attachment, mount) = match def {
        Definition::Refer => return out,
        Definition::Register(s) => (
            &s.plugin_id,
            &s.access_modes,
            &s.attachment_modes,
            &s.mount_options,
        ),
        Definition::Create(c) => (
            &c.plugin_id,
            &c.access_modes,
            &c.attachment_modes,
            &c.mount_options,
        ),
    };
    cmp("plugin_id", plugin_id.clone(), have.plugin_id.clone());
    cmp("access_modes", names(access), names(&have.access_modes));
    cmp(
        "attachment_modes",
        attach(attachment),
        attach(&have.attachment_modes),
    );
    cmp(
        "fs_type",
        mount.fs_type.clone(),
        have.mount_options.fs_type.clone(),
    );
    cmp(
        "mount_flags",
        join(&mount.mount_flags),
        join(&have.mount_options.mount_flags),
    );
    match def {
        Definition::Register(s) => {
            cmp(
                "external_id",
                s.external_id.clone(),
                have.external_id.clone(),
            );
            let ctx = |m: &BTreeMap<String, String>| format!("{m:?}");
            cmp("context", ctx(&s.context), ctx(&have.context));
            let topo = |s: &VolumeSpec| s.topology_text();
            cmp("topology", topo(s), topo(have));
            // Secrets only when the options name them (a definition without
            // secrets_file keeps the registered ones).
            if !s.secrets.is_empty() && s.secrets != have.secrets {
                out.push("the secrets differ".to_string());
            }
        }
        Definition::Create(c) => {
            let size = c.capacity_range.required_bytes;
            if have.capacity_bytes > 0 && size > have.capacity_bytes {
                out.push(format!(
                    "its capacity is {} bytes there, less than size {size}",
                    have.capacity_bytes
                ));
            }
        }
        Definition::Refer => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn options_read_as_a_register_definition() {
        let d = parse(
            "db",
            &opts(&[
                ("plugin", "hostpath"),
                ("external-id", "vol-1"),
                (
                    "access_modes",
                    "single-node-multi-writer,multi-node-reader-only",
                ),
                ("fs_type", "ext4"),
                ("mount_flags", "noatime,nodev"),
                ("context.tier", "fast"),
            ]),
        )
        .expect("valid");
        let Definition::Register(s) = d else {
            panic!("a registration: {d:?}")
        };
        assert_eq!(s.id, "db");
        assert_eq!(s.plugin_id, "hostpath");
        assert_eq!(s.external_id, "vol-1");
        assert_eq!(s.access_modes.len(), 2);
        assert_eq!(s.mount_options.mount_flags, ["noatime", "nodev"]);
        assert_eq!(s.context["tier"], "fast");
        assert_eq!(parse("db", &opts(&[])).expect("refer"), Definition::Refer);
    }

    #[test]
    fn options_without_external_id_create_a_volume() {
        let d = parse(
            "db",
            &opts(&[
                ("plugin_id", "hostpath"),
                ("size", "1G"),
                ("parameters.tier", "fast"),
            ]),
        )
        .expect("valid");
        let Definition::Create(c) = d else {
            panic!("a creation: {d:?}")
        };
        assert_eq!(c.capacity_range.required_bytes, 1 << 30);
        assert_eq!(c.parameters["tier"], "fast");
        assert_eq!(parse_size("size", "512Mi").expect("size"), 512 << 20);
        assert!(parse_size("size", "lots").is_err());
        assert!(parse_size("size", "0").is_err());
    }

    #[test]
    fn bad_options_are_refused_naming_the_key() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("plugin_id", "hp"), ("bogus", "1")],
                "unknown option \"bogus\"",
            ),
            (
                &[("plugin_id", "hp"), ("secret.token", "x")],
                "secrets never go in options",
            ),
            (&[("external_id", "v")], "plugin_id: is required"),
            (
                &[("plugin_id", "hp"), ("external_id", "v"), ("size", "1G")],
                "external_id and size do not go together",
            ),
            (
                &[
                    ("plugin_id", "hp"),
                    ("external_id", "v"),
                    ("access_modes", "sometimes"),
                ],
                "unknown variant `sometimes`",
            ),
            (
                &[("plugin_id", "../x"), ("external_id", "v")],
                "invalid plugin ID",
            ),
            (&[("plugin_id", "hp"), ("size", "huge")], "option size"),
            (
                &[
                    ("plugin_id", "hp"),
                    ("external_id", "v"),
                    ("secrets_file", "rel"),
                ],
                "not an absolute path",
            ),
        ];
        for (pairs, needle) in cases {
            let e = parse("db", &opts(pairs)).expect_err(needle);
            let msg = crate::error_chain(&e);
            assert!(msg.contains(needle), "{pairs:?}: {msg}");
        }
    }

    #[test]
    fn secrets_files_must_be_root_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("s.json");
        std::fs::write(&f, r#"{"token":"hunter2"}"#).expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = read_secrets_file(&f).expect_err("world-readable");
        assert!(e.to_string().contains("mode 0644"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        // The tests run as root, as the agent does.
        if unsafe { libc::geteuid() } == 0 {
            let s = read_secrets_file(&f).expect("root-only");
            assert_eq!(s["token"], "hunter2");
            let path = f.to_str().expect("utf-8");
            let d = parse(
                "db",
                &opts(&[
                    ("plugin_id", "hp"),
                    ("external_id", "v"),
                    ("secrets_file", path),
                ]),
            )
            .expect("valid");
            let Definition::Register(spec) = &d else {
                panic!("{d:?}")
            };
            assert_eq!(spec.secrets["token"], "hunter2");
            assert!(!format!("{d:?}").contains("hunter2"));
        }
    }

    #[test]
    fn differences_name_each_field() {
        let reg = |pairs: &[(&str, &str)]| parse("db", &opts(pairs)).expect("valid");
        let have = match reg(&[("plugin_id", "hp"), ("external_id", "v1")]) {
            Definition::Register(s) => s,
            d => panic!("{d:?}"),
        };
        let same = reg(&[("plugin_id", "hp"), ("external_id", "v1")]);
        assert!(differences(&same, &have).is_empty());
        let other = reg(&[
            ("plugin_id", "hp"),
            ("external_id", "v2"),
            ("access_modes", "multi-node-reader-only"),
        ]);
        let d = differences(&other, &have);
        assert_eq!(
            d,
            [
                "access_modes is single-node-writer there, not multi-node-reader-only",
                "external_id is v1 there, not v2"
            ]
        );
        assert!(differences(&Definition::Refer, &have).is_empty());
    }
}
