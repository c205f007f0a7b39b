//! `claimd alloc mount|release|status`.

use super::*;

/// Parses `ALIAS=VOLUME[,ro][,access=MODE][,attachment=MODE][,flag=F]`.
pub fn parse_volume_arg(s: &str) -> Result<w::VolumeRequest, String> {
    let mut parts = s.split(',');
    let head = parts.next().unwrap_or_default();
    let (alias, volume) = head
        .split_once('=')
        .ok_or_else(|| format!("--volume {s:?}: expected ALIAS=VOLUME"))?;
    let mut r = w::VolumeRequest::new();
    r.alias = alias.to_string();
    r.volume_id = volume.to_string();
    for p in parts {
        match p.split_once('=') {
            None if p == "ro" => r.read_only = true,
            None if p == "rw" => r.read_only = false,
            Some(("access", m)) => {
                if crate::volumes::AccessMode::parse(m).is_none() {
                    return Err(format!("--volume {s:?}: unknown access mode {m:?}"));
                }
                r.access_mode = m.to_string();
            }
            Some(("attachment", m)) => {
                if crate::volumes::AttachmentMode::parse(m).is_none() {
                    return Err(format!("--volume {s:?}: unknown attachment mode {m:?}"));
                }
                r.attachment_mode = m.to_string();
            }
            Some(("flag", f)) => r.mount_flags.push(f.to_string()),
            Some(("group", g)) if !g.is_empty() => r.mount_group = g.to_string(),
            _ => return Err(format!("--volume {s:?}: unknown option {p:?}")),
        }
    }
    Ok(r)
}

/// The value of option `name` at `args[*i]` (`--name VALUE` or
/// `--name=VALUE`), advancing `i` past it; None if `args[*i]` is another
/// argument.
pub(super) fn option_value(
    c: &Call,
    names: &[&str],
    i: &mut usize,
) -> Result<Option<String>, CliError> {
    let a = &c.args[*i];
    for name in names {
        if a == name {
            *i += 1;
            return match c.args.get(*i) {
                Some(v) => Ok(Some(v.clone())),
                None => Err(c.usage(format!("{a} needs a value"))),
            };
        }
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            return Ok(Some(v.to_string()));
        }
    }
    Ok(None)
}

pub(super) fn alloc_mount(c: &Call) -> Result<(), CliError> {
    let mut alloc_id = None;
    let mut vols = Vec::new();
    let mut timeout = DEFAULT_MOUNT_TIMEOUT;
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--volume", "-v"], &mut i)? {
            vols.push(parse_volume_arg(&v).map_err(|e| c.usage(e))?);
        } else if let Some(v) = option_value(c, &["--timeout"], &mut i)? {
            timeout = parse_duration(&v).map_err(|e| c.usage(format!("--timeout: {e}")))?;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return Err(c.usage("alloc mount needs an allocation ID"));
    };
    if vols.is_empty() {
        return Err(c.usage("alloc mount needs at least one --volume ALIAS=VOLUME"));
    }
    let api = c.connect()?;
    let mut req = w::MountAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.volumes = vols;
    // Show what the mount waits on (a plugin, a held claim) while it runs;
    // the mount goes on without it if the thread cannot start.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    let mut progress = crate::threads::Threads::new();
    {
        let socket = api.socket.clone();
        let alloc_id = alloc_id.clone();
        let _ = progress.spawn("progress", move || {
            show_progress(&socket, &alloc_id, &done_rx)
        });
    }
    let result = api.call("mount", timeout, |a, o| a.mount_alloc(&req, o));
    drop(done_tx);
    // It ends once its last status call answers.
    let _ = progress.join_until(Instant::now() + QUICK_CALL_TIMEOUT + PROGRESS_POLL);
    let r = result?;
    if c.json() {
        let vols: Vec<Value> = r
            .volumes
            .iter()
            .map(|v| {
                json!({"alias": v.alias, "volume_id": v.volume_id, "host_path": v.host_path,
                       "read_only": v.read_only, "block": v.block})
            })
            .collect();
        println!("{}", json!({ "alloc_id": alloc_id, "volumes": vols }));
    } else {
        let mut rows = vec![vec![
            "ALIAS".to_string(),
            "VOLUME".into(),
            "MODE".into(),
            "HOST PATH".into(),
        ]];
        for v in &r.volumes {
            rows.push(vec![
                v.alias.clone(),
                v.volume_id.clone(),
                if v.read_only { "ro" } else { "rw" }.to_string(),
                v.host_path.clone(),
            ]);
        }
        print_table(&rows);
    }
    Ok(())
}

pub(super) fn show_progress(socket: &Path, alloc_id: &str, done: &crossbeam_channel::Receiver<()>) {
    let client = ApiClient::new(crate::csi::grpc_environment("cli-progress"), socket);
    let mut last: Vec<String> = Vec::new();
    while let Err(crossbeam_channel::RecvTimeoutError::Timeout) = done.recv_timeout(PROGRESS_POLL) {
        let mut req = w::GetAllocRequest::new();
        req.alloc_id = alloc_id.to_string();
        let opt = CallOption::default().timeout(QUICK_CALL_TIMEOUT);
        let Ok(r) = client.raw().get_alloc(&req, opt) else {
            continue;
        };
        // Progress lines start with "progress:", never with "claimd:" as
        // errors do, so people and scripts can tell them apart.
        let msgs: Vec<String> = r
            .alloc
            .volumes
            .iter()
            .filter(|v| !v.message.is_empty())
            .map(|v| format!("progress: {alloc_id}/{}: {}", v.alias, v.message))
            .collect();
        for m in &msgs {
            if !last.contains(m) {
                eprintln!("{m}");
            }
        }
        last = msgs;
    }
}

pub(super) fn release_json(alloc_id: &str, r: &w::ReleaseAllocResponse) -> Value {
    let vols: Vec<Value> = r
        .volumes
        .iter()
        .map(|v| json!({"alias": v.alias, "state": v.state, "error": v.error, "attempts": v.attempts}))
        .collect();
    json!({"alloc_id": alloc_id, "found": r.found, "done": r.done, "volumes": vols})
}

pub(super) fn alloc_release(c: &Call) -> Result<(), CliError> {
    let mut alloc_id = None;
    let mut wait = Duration::ZERO;
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--wait"], &mut i)? {
            wait = parse_duration(&v).map_err(|e| c.usage(format!("--wait: {e}")))?;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else if alloc_id.is_none() {
            alloc_id = Some(a.clone());
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let Some(alloc_id) = alloc_id else {
        return Err(c.usage("alloc release needs an allocation ID"));
    };
    let api = c.connect()?;
    let mut req = w::ReleaseAllocRequest::new();
    req.alloc_id = alloc_id.clone();
    req.wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let r = api.call("release", wait + QUICK_CALL_TIMEOUT, |a, o| {
        a.release_alloc(&req, o)
    })?;
    let all_released = r.volumes.iter().all(|v| v.state == "released");
    if c.json() {
        println!("{}", release_json(&alloc_id, &r));
    } else if !r.found {
        println!("allocation {alloc_id} is not known to the agent: nothing to release");
    } else {
        let mut rows = vec![vec![
            "ALIAS".to_string(),
            "STATE".into(),
            "LAST ERROR".into(),
        ]];
        for v in &r.volumes {
            rows.push(vec![v.alias.clone(), v.state.clone(), v.error.clone()]);
        }
        print_table(&rows);
    }
    // With --wait, a release that did not finish is a failure for scripts.
    if !wait.is_zero() && r.found && !(r.done && all_released) {
        return Err(CliError::ReleaseUnfinished {
            alloc_id,
            running: !r.done,
        });
    }
    Ok(())
}

/// The latest volume stats as JSON: absent figures are null.
fn stats_json(s: &w::VolumeStats) -> Value {
    let bytes = s.has_bytes.then(|| {
        json!({"capacity": s.capacity_bytes, "used": s.used_bytes,
               "available": s.available_bytes})
    });
    let inodes = s
        .has_inodes
        .then(|| json!({"capacity": s.inodes, "used": s.inodes_used, "free": s.inodes_free}));
    let condition = s
        .has_condition
        .then(|| json!({"abnormal": s.abnormal, "message": s.condition_message}));
    json!({"at_unix_ms": s.at_unix_ms, "bytes": bytes, "inodes": inodes,
           "condition": condition, "error": s.error})
}

/// `1.5 GiB`-style sizes for the table.
fn human_bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The USAGE cell: used of capacity, or `-` without stats.
fn usage_cell(v: &w::AllocVolumeStatus) -> String {
    match v.stats.as_ref() {
        Some(s) if s.has_bytes => {
            let pct = if s.capacity_bytes > 0 {
                format!(" ({}%)", s.used_bytes * 100 / s.capacity_bytes)
            } else {
                String::new()
            };
            format!(
                "{} of {}{pct}",
                human_bytes(s.used_bytes),
                human_bytes(s.capacity_bytes)
            )
        }
        _ => "-".into(),
    }
}

pub(super) fn alloc_json(a: &w::AllocStatus) -> Value {
    let vols: Vec<Value> = a
        .volumes
        .iter()
        .map(|v| {
            json!({"alias": v.alias, "volume_id": v.volume_id, "plugin_id": v.plugin_id,
                   "phase": v.phase, "host_path": v.host_path, "read_only": v.read_only,
                   "attachment_mode": v.attachment_mode, "release_state": v.release_state,
                   "release_error": v.release_error, "message": v.message,
                   "epoch": (v.epoch != 0).then_some(v.epoch),
                   "stats": v.stats.as_ref().map(stats_json)})
        })
        .collect();
    json!({"id": a.id, "releasing": a.releasing, "volumes": vols})
}

pub(super) fn alloc_status(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let api = c.connect()?;
    let allocs: Vec<w::AllocStatus> = match args.first() {
        Some(id) => {
            let mut req = w::GetAllocRequest::new();
            req.alloc_id = id.to_string();
            let r = api.call("status", QUICK_CALL_TIMEOUT, |a, o| a.get_alloc(&req, o))?;
            vec![r.alloc.unwrap_or_default()]
        }
        None => {
            api.call("status", QUICK_CALL_TIMEOUT, |a, o| {
                a.list_allocs(&w::ListAllocsRequest::new(), o)
            })?
            .allocs
        }
    };
    if c.json() {
        let list: Vec<Value> = allocs.iter().map(alloc_json).collect();
        println!("{}", json!({ "allocs": list }));
        return Ok(());
    }
    // The claim's epoch (cluster mode only): a column when any has one.
    let epochs = allocs.iter().flat_map(|a| &a.volumes).any(|v| v.epoch != 0);
    let mut head = vec![
        "ALLOC".to_string(),
        "ALIAS".into(),
        "VOLUME".into(),
        "PHASE".into(),
        "MODE".into(),
        "HOST PATH".into(),
        "RELEASE".into(),
        "USAGE".into(),
    ];
    if epochs {
        head.push("EPOCH".into());
    }
    head.push("NOTE".into());
    let mut rows = vec![head];
    for a in &allocs {
        for v in &a.volumes {
            let abnormal = v
                .stats
                .as_ref()
                .filter(|s| s.abnormal)
                .map(|s| format!("abnormal: {}", s.condition_message));
            let note = if !v.release_error.is_empty() {
                v.release_error.clone()
            } else if let Some(a) = abnormal {
                a
            } else {
                v.message.clone()
            };
            let mut row = vec![
                a.id.clone(),
                v.alias.clone(),
                v.volume_id.clone(),
                if v.phase.is_empty() {
                    "-".into()
                } else {
                    v.phase.clone()
                },
                if v.read_only { "ro" } else { "rw" }.to_string(),
                v.host_path.clone(),
                if v.release_state.is_empty() {
                    "-".into()
                } else {
                    v.release_state.clone()
                },
                usage_cell(v),
            ];
            if epochs {
                row.push(if v.epoch == 0 {
                    "-".into()
                } else {
                    v.epoch.to_string()
                });
            }
            row.push(note);
            rows.push(row);
        }
    }
    print_table(&rows);
    Ok(())
}
