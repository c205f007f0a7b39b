//! `claimd snapshot create|list|delete` (also `claimd volume snapshot ...`).

use super::*;

pub const SNAPSHOT: Noun = Noun {
    name: "snapshot",
    about: "create, list and delete snapshots of volumes",
    verbs: &[
        Verb {
            name: "create",
            args: "VOLUME NAME [--parameter KEY=VALUE]...",
            about: "snapshot a registered volume",
            details: "\
Takes a snapshot called NAME of registered volume VOLUME through its
controller plugin (CreateSnapshot, which needs CREATE_DELETE_SNAPSHOT) and
prints the plugin's snapshot ID. The same NAME of the same volume again
answers the same snapshot; NAME taken by a snapshot of another volume is
refused with the plugin's reason (exit 1). A new volume starts from the
snapshot with `claimd volume create` and {\"source\": {\"snapshot_id\": ID}}.

OPTIONS:
    --parameter KEY=VALUE   a plugin parameter (repeatable); also
                            --parameter=KEY=VALUE

OUTPUT:
    SNAPSHOT ID, VOLUME, SIZE and READY; with --json the snapshot as
    `snapshot list --json` shows one
",
            run: snapshot_create,
        },
        Verb {
            name: "list",
            args: "[VOLUME]",
            about: "list snapshots, of one volume or of every plugin",
            details: "\
Lists the snapshots of registered volume VOLUME (ListSnapshots, which
needs LIST_SNAPSHOTS), or without VOLUME those of every ready controller
plugin that lists snapshots, whoever took them.

OUTPUT:
    SNAPSHOT ID, PLUGIN, VOLUME (the registered volume it was taken of, or
    the plugin's volume ID in brackets), SIZE, READY and CREATED; with
    --json {\"snapshots\": [{\"snapshot_id\", \"plugin_id\", \"volume_id\",
    \"external_volume_id\", \"size_bytes\", \"created_unix_ms\",
    \"ready_to_use\"}]}
",
            run: snapshot_list,
        },
        Verb {
            name: "delete",
            args: "ID [--plugin PLUGIN]",
            about: "delete a snapshot",
            details: "\
Deletes snapshot ID (DeleteSnapshot, which needs CREATE_DELETE_SNAPSHOT) at
the plugin whose ListSnapshots knows it, or at PLUGIN. A snapshot that no
plugin knows is an error (exit 1), and nothing is deleted.

OPTIONS:
    --plugin PLUGIN   the plugin that holds the snapshot; also
                      --plugin=PLUGIN

OUTPUT:
    one line; with --json {\"snapshot_id\", \"plugin_id\", \"deleted\": true}
",
            run: snapshot_delete,
        },
    ],
};

fn snapshot_json(s: &w::Snapshot) -> Value {
    json!({"snapshot_id": s.snapshot_id, "plugin_id": s.plugin_id,
           "volume_id": s.volume_id, "external_volume_id": s.external_volume_id,
           "size_bytes": s.size_bytes, "created_unix_ms": s.created_unix_ms,
           "ready_to_use": s.ready_to_use})
}

fn utc(secs: u64) -> String {
    crate::clock::utc(secs)
}

fn print_snapshots(snaps: &[w::Snapshot]) {
    let mut rows = vec![vec![
        "SNAPSHOT ID".to_string(),
        "PLUGIN".into(),
        "VOLUME".into(),
        "SIZE".into(),
        "READY".into(),
        "CREATED".into(),
    ]];
    for s in snaps {
        let volume = if s.volume_id.is_empty() {
            format!("[{}]", s.external_volume_id)
        } else {
            s.volume_id.clone()
        };
        let created = if s.created_unix_ms == 0 {
            "-".to_string()
        } else {
            utc(s.created_unix_ms / 1000)
        };
        rows.push(vec![
            s.snapshot_id.clone(),
            s.plugin_id.clone(),
            volume,
            s.size_bytes.to_string(),
            if s.ready_to_use { "yes" } else { "no" }.to_string(),
            created,
        ]);
    }
    print_table(&rows);
}

pub(super) fn snapshot_create(c: &Call) -> Result<(), CliError> {
    let mut positional = Vec::new();
    let mut parameters = std::collections::HashMap::new();
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--parameter"], &mut i)? {
            let (k, x) = v
                .split_once('=')
                .ok_or_else(|| c.usage(format!("--parameter {v:?}: expected KEY=VALUE")))?;
            parameters.insert(k.to_string(), x.to_string());
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if positional.len() < 2 {
            positional.push(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let [volume, name] = positional.as_slice() else {
        return Err(c.usage("snapshot create needs VOLUME and NAME"));
    };
    let api = c.connect()?;
    let mut req = w::CreateSnapshotRequest::new();
    req.volume_id = volume.clone();
    req.name = name.clone();
    req.parameters = parameters;
    let r = api.call("snapshot create", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.create_snapshot(&req, o)
    })?;
    let snap = r.snapshot.clone().unwrap_or_default();
    if c.json() {
        println!("{}", snapshot_json(&snap));
    } else {
        print_snapshots(&[snap]);
    }
    Ok(())
}

pub(super) fn snapshot_list(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let api = c.connect()?;
    let mut req = w::ListSnapshotsRequest::new();
    req.volume_id = args.first().map(|v| v.to_string()).unwrap_or_default();
    let r = api.call("snapshot list", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.list_snapshots(&req, o)
    })?;
    let mut snaps = r.snapshots.clone();
    snaps.sort_by(|a, b| (&a.plugin_id, &a.snapshot_id).cmp(&(&b.plugin_id, &b.snapshot_id)));
    if c.json() {
        let list: Vec<Value> = snaps.iter().map(snapshot_json).collect();
        println!("{}", json!({ "snapshots": list }));
    } else {
        print_snapshots(&snaps);
    }
    Ok(())
}

pub(super) fn snapshot_delete(c: &Call) -> Result<(), CliError> {
    let mut id = None;
    let mut plugin = String::new();
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--plugin"], &mut i)? {
            plugin = v;
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
        return Err(c.usage("snapshot delete needs a snapshot ID"));
    };
    let api = c.connect()?;
    let mut req = w::DeleteSnapshotRequest::new();
    req.snapshot_id = id.clone();
    req.plugin_id = plugin;
    let r = api.call("snapshot delete", DEFAULT_OPERATION_TIMEOUT, |a, o| {
        a.delete_snapshot(&req, o)
    })?;
    if c.json() {
        println!(
            "{}",
            json!({"snapshot_id": id, "plugin_id": r.plugin_id, "deleted": true})
        );
    } else {
        println!("snapshot {id} of plugin {} deleted", r.plugin_id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_unix_time() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_714_564_800 + 3_661), "2024-05-01T13:01:01Z");
    }
}
