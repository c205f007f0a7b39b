//! `claimd volume register|list|deregister|create|delete|detach|expand`.

use super::*;

pub const VOLUME: Noun = Noun {
    name: "volume",
    about: "create, register, list, expand, delete and snapshot volumes",
    verbs: &[
        Verb {
            name: "register",
            args: "FILE|-",
            about: "register volumes from a JSON file (- for standard input)",
            details: "\
Reads volume definitions from FILE, or from standard input with `-`: one
JSON object or an array of them. Every definition is checked before the
agent is asked; then they are registered in order. Registering a volume ID
again replaces its definition, unless an allocation holds a claim on it and
the definition changed (exit 1).

A volume definition (unknown fields are refused):
    {\"id\": \"db\", \"plugin_id\": \"hostpath\", \"external_id\": \"vol-0a1b\",
     \"access_modes\": [\"single-node-writer\"],
     \"attachment_modes\": [\"file-system\"],
     \"mount_options\": {\"fs_type\": \"ext4\", \"mount_flags\": [\"noatime\"]},
     \"context\": {}, \"secrets\": {\"token\": \"...\"},
     \"accessible_topology\": [{\"zone\": \"z1\"}], \"capacity_bytes\": 0}
id, plugin_id, external_id, access_modes and attachment_modes are required;
mount_options, context, secrets, accessible_topology and capacity_bytes are
optional. Secrets are kept only in the agent's state file and sent to the
plugin; they are never printed. A volume with an accessible_topology is
mounted only on nodes whose node plugin segments include one of its sets.

OUTPUT:
    one line per volume registered; with --json
    {\"registered\": [IDS]}
",
            run: volume_register,
        },
        Verb {
            name: "list",
            args: "",
            about: "list the registered volumes",
            details: "\
Lists the registered volumes: ID, plugin, external ID, access modes,
attachment modes and capacity. With --json also fs_type, mount_flags,
context, accessible_topology, capacity_bytes and the names of the secrets
(never their values).
",
            run: volume_list,
        },
        Verb {
            name: "deregister",
            args: "ID",
            about: "remove a volume no allocation uses",
            details: "\
Removes volume ID from the agent's registry. Refused (exit 1) while an
allocation uses the volume. A volume that is not registered is not an
error: it says so and exits 0 (--json: {\"volume_id\", \"found\"}).
",
            run: volume_deregister,
        },
        Verb {
            name: "create",
            args: "FILE|-",
            about: "create volumes through their controller plugin and register them",
            details: "\
Reads volume creation requests from FILE, or from standard input with `-`:
one JSON object or an array of them. Each is checked, then the volume's
controller plugin creates it (CreateVolume, which needs
CREATE_DELETE_VOLUME) and the agent registers it with the plugin's volume
ID, volume context, accessible topology and capacity. Creating the same
volume again with the same request answers the same volume (the plugin
keys it by name); a request that conflicts with the existing volume is
refused with the plugin's reason (exit 1), and nothing is registered.

A creation request (unknown fields are refused):
    {\"id\": \"db\", \"plugin_id\": \"hostpath\", \"name\": \"db-2024\",
     \"access_modes\": [\"single-node-writer\"],
     \"attachment_modes\": [\"file-system\"],
     \"mount_options\": {\"fs_type\": \"ext4\", \"mount_flags\": [\"noatime\"]},
     \"secrets\": {\"token\": \"...\"},
     \"capacity_range\": {\"required_bytes\": 1073741824, \"limit_bytes\": 0},
     \"parameters\": {\"tier\": \"fast\"},
     \"accessibility_requirements\": {\"requisite\": [{\"zone\": \"z1\"}],
                                    \"preferred\": [{\"zone\": \"z1\"}]},
     \"source\": {\"snapshot_id\": \"SNAPSHOT\"}}
id, plugin_id, access_modes and attachment_modes are required. name is the
plugin's idempotency key [default: id]. source is a snapshot of the plugin
({\"snapshot_id\": ...}, needs CREATE_DELETE_SNAPSHOT) or a registered
volume to copy ({\"volume_id\": ...}, needs CLONE_VOLUME); the new volume
starts with its content. accessibility_requirements need a plugin with
VOLUME_ACCESSIBILITY_CONSTRAINTS.

OUTPUT:
    ID, EXTERNAL ID, CAPACITY and TOPOLOGY per volume; with --json
    {\"created\": [{\"id\", \"external_id\", \"capacity_bytes\",
    \"accessible_topology\", \"context\"}], \"warnings\": [...]}
",
            run: volume_create,
        },
        Verb {
            name: "delete",
            args: "ID",
            about: "delete a volume through its controller plugin and deregister it",
            details: "\
Deletes volume ID in the storage system (DeleteVolume, which needs
CREATE_DELETE_VOLUME) and removes it from the agent's registry. Refused
(exit 1), with nothing changed, while an allocation claims or uses the
volume, or when ID is not registered.

OUTPUT:
    one line; with --json {\"volume_id\", \"deleted\": true}
",
            run: volume_delete,
        },
        Verb {
            name: "detach",
            args: "VOLUME --node NODE --reason TEXT",
            about: "detach a volume from a dead node and free its claims (cluster mode)",
            details: "\
Cluster mode only. For a node that is gone for good: detaches VOLUME from
NODE through a controller host of the volume's plugin
(ControllerUnpublishVolume with the external node ID recorded when it was
attached), then frees NODE's claims of the volume, keeping the reason in
etcd (`<prefix>/freed/<volume>/<alloc>`), so allocations waiting elsewhere
go on. Refused (exit 1), with nothing changed, while NODE's liveness lease
is held (release the allocation there instead), for this agent's own node,
and on one node. Waits for a controller host up to the cluster's
attach_timeout; when none answered in time nothing is freed (exit 1: try
again).

OPTIONS:
    --node NODE     the node to detach from (required)
    --reason TEXT   why, kept with the freed claims (required)

OUTPUT:
    what was done; with --json
    {\"volume_id\", \"node\", \"detached\": BOOL, \"freed\": [ALLOCS]}
",
            run: volume_detach,
        },
        Verb {
            name: "expand",
            args: "ID --size BYTES",
            about: "grow a volume, online when it is mounted",
            details: "\
Grows volume ID to at least BYTES through its controller plugin
(ControllerExpandVolume, which needs EXPAND_VOLUME) and records the new
capacity. When the plugin asks for node expansion and the volume is
mounted on this node, the file system is grown there while it stays
mounted (NodeExpandVolume on its target path, with its staging path);
when it is mounted nowhere here, the next mount of the volume does it
right after NodePublish (node_expansion_pending says so).
A size below the volume's recorded capacity is refused (exit 2) with
nothing changed.

OPTIONS:
    --size BYTES   the new size in bytes (required); also --size=BYTES

OUTPUT:
    the new capacity and where the node expanded it; with --json
    {\"volume_id\", \"capacity_bytes\", \"node_expanded\": [PATHS],
    \"node_expansion_pending\"}
",
            run: volume_expand,
        },
        Verb {
            name: "snapshot",
            args: "create VOLUME NAME | list [VOLUME] | delete ID",
            about: "snapshots of volumes (the same as `claimd snapshot`)",
            details: "\
`claimd volume snapshot create VOLUME NAME`, `... list [VOLUME]` and
`... delete ID [--plugin PLUGIN]` do what `claimd snapshot create`, `list`
and `delete` do; see `claimd snapshot VERB --help`.
",
            run: volume_snapshot,
        },
    ],
};

pub(super) fn volume_register(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(src) = args.first() else {
        return Err(c.usage("volume register needs FILE or -"));
    };
    let text = if *src == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|source| CliError::ReadInput {
                what: "standard input".into(),
                source,
            })?;
        s
    } else {
        std::fs::read_to_string(src).map_err(|source| CliError::ReadInput {
            what: src.to_string(),
            source,
        })?
    };
    let file = if *src == "-" {
        "standard input".to_string()
    } else {
        src.to_string()
    };
    let specs: Vec<VolumeSpec> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(items)) => items.into_iter().map(serde_json::from_value).collect(),
        Ok(v) => serde_json::from_value(v).map(|s| vec![s]),
        Err(e) => Err(e),
    }
    .map_err(|source| CliError::VolumeFileParse {
        file: file.clone(),
        source,
    })?;
    for s in &specs {
        s.validate().map_err(|source| CliError::VolumeSpec {
            file: file.clone(),
            source,
        })?;
    }
    let api = c.connect()?;
    let mut warnings = Vec::new();
    for s in &specs {
        let mut req = w::RegisterVolumeRequest::new();
        req.volume = protobuf::MessageField::some(spec_to_register_wire(s));
        let r = api.call("register", QUICK_CALL_TIMEOUT, |a, o| {
            a.register_volume(&req, o)
        })?;
        // Warnings go to stderr, marked as such, in both output modes.
        for warning in &r.warnings {
            eprintln!("claimd: warning: {warning}");
        }
        warnings.extend(r.warnings);
        if !c.json() {
            println!("volume {} registered", s.id);
        }
    }
    if c.json() {
        let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
        println!("{}", json!({ "registered": ids, "warnings": warnings }));
    }
    Ok(())
}

/// The wire form for registration: the only message that carries secrets.
pub(super) fn spec_to_register_wire(s: &VolumeSpec) -> w::Volume {
    let mut v = crate::api::volume_to_wire(s);
    v.secret_keys.clear();
    v.secrets = s.secrets.clone().into_iter().collect();
    v
}

pub(super) fn volume_list(c: &Call) -> Result<(), CliError> {
    c.positional(0)?;
    let api = c.connect()?;
    let r = api.call("volume list", QUICK_CALL_TIMEOUT, |a, o| {
        a.list_volumes(&w::ListVolumesRequest::new(), o)
    })?;
    if c.json() {
        let vols: Vec<Value> = r
            .volumes
            .iter()
            .map(|v| {
                let ctx: serde_json::Map<String, Value> = v
                    .context
                    .iter()
                    .map(|(k, x)| (k.clone(), Value::String(x.clone())))
                    .collect();
                let mut keys = v.secret_keys.clone();
                keys.sort();
                json!({
                    "id": v.id, "plugin_id": v.plugin_id, "external_id": v.external_id,
                    "access_modes": v.access_modes, "attachment_modes": v.attachment_modes,
                    "fs_type": v.fs_type, "mount_flags": v.mount_flags,
                    "context": ctx, "secret_keys": keys,
                    "plugin_health": v.plugin_health,
                    "capacity_bytes": v.capacity_bytes,
                    "accessible_topology": topology_json(&v.accessible_topology),
                })
            })
            .collect();
        println!("{}", json!({ "volumes": vols }));
        return Ok(());
    }
    let mut rows = vec![vec![
        "ID".to_string(),
        "PLUGIN".into(),
        "EXTERNAL ID".into(),
        "ACCESS MODES".into(),
        "ATTACHMENT".into(),
        "CAPACITY".into(),
        "PLUGIN HEALTH".into(),
    ]];
    let mut vols = r.volumes.clone();
    vols.sort_by(|a, b| a.id.cmp(&b.id));
    for v in &vols {
        rows.push(vec![
            v.id.clone(),
            v.plugin_id.clone(),
            v.external_id.clone(),
            v.access_modes.join(","),
            v.attachment_modes.join(","),
            if v.capacity_bytes > 0 {
                v.capacity_bytes.to_string()
            } else {
                "-".to_string()
            },
            v.plugin_health.clone(),
        ]);
    }
    print_table(&rows);
    Ok(())
}

pub(super) fn volume_deregister(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(id) = args.first() else {
        return Err(c.usage("volume deregister needs a volume ID"));
    };
    let api = c.connect()?;
    let mut req = w::DeregisterVolumeRequest::new();
    req.volume_id = id.to_string();
    let r = api.call("deregister", QUICK_CALL_TIMEOUT, |a, o| {
        a.deregister_volume(&req, o)
    })?;
    if c.json() {
        println!("{}", json!({ "volume_id": id, "found": r.found }));
    } else if r.found {
        println!("volume {id} deregistered");
    } else {
        println!("volume {id} was not registered (nothing to do)");
    }
    Ok(())
}

/// Reads FILE or standard input (`-`), and names it for messages.
fn read_source(src: &str) -> Result<(String, String), CliError> {
    if src == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|source| CliError::ReadInput {
                what: "standard input".into(),
                source,
            })?;
        return Ok((s, "standard input".to_string()));
    }
    let text = std::fs::read_to_string(src).map_err(|source| CliError::ReadInput {
        what: src.to_string(),
        source,
    })?;
    Ok((text, src.to_string()))
}

fn topology_json(list: &[w::Topology]) -> Value {
    Value::Array(
        list.iter()
            .map(|t| {
                let m: serde_json::Map<String, Value> = t
                    .segments
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect();
                Value::Object(m)
            })
            .collect(),
    )
}

fn topology_cell(list: &[w::Topology]) -> String {
    if list.is_empty() {
        return "-".to_string();
    }
    let sets: Vec<String> = list
        .iter()
        .map(|t| {
            let mut pairs: Vec<String> =
                t.segments.iter().map(|(k, v)| format!("{k}={v}")).collect();
            pairs.sort();
            pairs.join(",")
        })
        .collect();
    sets.join(" | ")
}

pub(super) fn volume_create(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(src) = args.first() else {
        return Err(c.usage("volume create needs FILE or -"));
    };
    let (text, file) = read_source(src)?;
    let creates: Vec<crate::volumes::VolumeCreate> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(items)) => items.into_iter().map(serde_json::from_value).collect(),
        Ok(v) => serde_json::from_value(v).map(|s| vec![s]),
        Err(e) => Err(e),
    }
    .map_err(|source| CliError::VolumeFileParse {
        file: file.clone(),
        source,
    })?;
    for cr in &creates {
        cr.validate().map_err(|source| CliError::VolumeSpec {
            file: file.clone(),
            source,
        })?;
    }
    let api = c.connect()?;
    let mut created = Vec::new();
    let mut warnings = Vec::new();
    for cr in &creates {
        let req = crate::api::create_to_wire(cr);
        let r = api.call("volume create", DEFAULT_OPERATION_TIMEOUT, |a, o| {
            a.create_volume(&req, o)
        })?;
        for warning in &r.warnings {
            eprintln!("claimd: warning: {warning}");
        }
        warnings.extend(r.warnings.clone());
        created.push(r.volume.clone().unwrap_or_default());
    }
    if c.json() {
        let vols: Vec<Value> = created
            .iter()
            .map(|v| {
                json!({"id": v.id, "external_id": v.external_id,
                       "capacity_bytes": v.capacity_bytes,
                       "accessible_topology": topology_json(&v.accessible_topology),
                       "context": v.context.iter().collect::<std::collections::BTreeMap<_, _>>()})
            })
            .collect();
        println!("{}", json!({ "created": vols, "warnings": warnings }));
        return Ok(());
    }
    let mut rows = vec![vec![
        "ID".to_string(),
        "EXTERNAL ID".into(),
        "CAPACITY".into(),
        "TOPOLOGY".into(),
    ]];
    for v in &created {
        rows.push(vec![
            v.id.clone(),
            v.external_id.clone(),
            v.capacity_bytes.to_string(),
            topology_cell(&v.accessible_topology),
        ]);
    }
    print_table(&rows);
    Ok(())
}

pub(super) fn volume_delete(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(id) = args.first() else {
        return Err(c.usage("volume delete needs a volume ID"));
    };
    let api = c.connect()?;
    let mut req = w::DeleteVolumeRequest::new();
    req.volume_id = id.to_string();
    api.call("volume delete", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.delete_volume(&req, o)
    })?;
    if c.json() {
        println!("{}", json!({ "volume_id": id, "deleted": true }));
    } else {
        println!("volume {id} deleted");
    }
    Ok(())
}

pub(super) fn volume_detach(c: &Call) -> Result<(), CliError> {
    let (mut id, mut node, mut reason) = (None, None, None);
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--node"], &mut i)? {
            node = Some(v);
        } else if let Some(v) = option_value(c, &["--reason"], &mut i)? {
            reason = Some(v);
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if id.is_none() {
            id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(id) = id else {
        return Err(c.usage("volume detach needs a volume ID"));
    };
    let Some(node) = node else {
        return Err(c.usage("volume detach needs --node NODE"));
    };
    let Some(reason) = reason.filter(|r| !r.trim().is_empty()) else {
        return Err(c.usage("volume detach needs --reason TEXT"));
    };
    let api = c.connect()?;
    let mut req = w::DetachVolumeRequest::new();
    req.volume_id = id.clone();
    req.node = node.clone();
    req.reason = reason;
    let r = api.call("volume detach", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.detach_volume(&req, o)
    })?;
    if c.json() {
        println!(
            "{}",
            json!({"volume_id": id, "node": node, "detached": r.detached,
                   "freed": r.freed_allocs})
        );
    } else {
        if r.detached {
            println!("volume {id} detached from node {node}");
        } else {
            println!("volume {id} was not attached to node {node} (no controller detach needed)");
        }
        if r.freed_allocs.is_empty() {
            println!("node {node} held no claim of volume {id}");
        } else {
            println!("freed the claims of {}", r.freed_allocs.join(", "));
        }
    }
    Ok(())
}

pub(super) fn volume_expand(c: &Call) -> Result<(), CliError> {
    let mut id = None;
    let mut size = None;
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--size"], &mut i)? {
            let n = v.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                c.usage(format!(
                    "--size takes a positive number of bytes, not {v:?}"
                ))
            })?;
            size = Some(n);
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if id.is_none() {
            id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(id) = id else {
        return Err(c.usage("volume expand needs a volume ID"));
    };
    let Some(size) = size else {
        return Err(c.usage("volume expand needs --size BYTES"));
    };
    let api = c.connect()?;
    let mut req = w::ExpandVolumeRequest::new();
    req.volume_id = id.clone();
    req.required_bytes = size;
    let r = api.call("volume expand", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.expand_volume(&req, o)
    })?;
    if c.json() {
        println!(
            "{}",
            json!({"volume_id": id, "capacity_bytes": r.capacity_bytes,
                   "node_expanded": r.node_expanded,
                   "node_expansion_pending": r.node_expansion_pending})
        );
        return Ok(());
    }
    println!("volume {id} expanded to {} bytes", r.capacity_bytes);
    for p in &r.node_expanded {
        println!("file system grown on this node at {p}");
    }
    if r.node_expansion_pending {
        println!("the plugin asks for node expansion, and volume {id} is not mounted on this node");
    }
    Ok(())
}

/// `volume snapshot VERB ARGS`: the `snapshot` noun's verb.
pub(super) fn volume_snapshot(c: &Call) -> Result<(), CliError> {
    let names = SNAPSHOT
        .verbs
        .iter()
        .map(|v| v.name)
        .collect::<Vec<_>>()
        .join(", ");
    let Some(name) = c.args.first() else {
        return Err(c.usage(format!("volume snapshot needs a verb: {names}")));
    };
    let Some(verb) = SNAPSHOT.verbs.iter().find(|v| v.name == name) else {
        return Err(c.usage(format!(
            "unknown snapshot verb {name:?} (the verbs are {names})"
        )));
    };
    let call = Call {
        client: c.client.clone(),
        args: c.args[1..].to_vec(),
        help: format!("claimd snapshot {}", verb.name),
    };
    (verb.run)(&call)
}
