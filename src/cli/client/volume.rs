//! `claimd volume register|list|deregister`.

use super::*;

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
