//! `claimd claim list`, `claimd claim free` and `claimd node remove`.

use super::*;

pub(super) fn claim_list(c: &Call) -> Result<(), CliError> {
    let mut req = w::ListClaimsRequest::new();
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--volume"], &mut i)? {
            req.volume_id = v;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else {
            return Err(c.usage(format!("unexpected argument {a:?}")));
        }
        i += 1;
    }
    let api = c.connect()?;
    let r = api.call("claim list", QUICK_CALL_TIMEOUT, |a, o| {
        a.list_claims(&req, o)
    })?;
    // What cannot be read is said on stderr after the list, and fails it.
    let problems = || -> Result<(), CliError> {
        for p in &r.problems {
            eprintln!("claimd: {p}");
        }
        if r.problems.is_empty() {
            Ok(())
        } else {
            Err(CliError::Unreadable {
                what: "claim list",
                count: r.problems.len(),
            })
        }
    };
    if c.json() {
        let list: Vec<Value> = r
            .claims
            .iter()
            .map(|x| {
                json!({"volume_id": x.volume_id, "alloc_id": x.alloc_id, "node": x.node,
                       "mode": x.mode, "access_mode": x.access_mode, "state": x.state,
                       "external_node_id": x.external_node_id,
                       "since_ms": (x.since_ms > 0).then_some(x.since_ms),
                       "last_error": (!x.last_error.is_empty()).then_some(&x.last_error),
                       "holder_unreachable": x.holder_unreachable})
            })
            .collect();
        println!("{}", json!({ "claims": list, "problems": r.problems }));
        return problems();
    }
    let mut rows = vec![vec![
        "VOLUME".to_string(),
        "ALLOCATION".into(),
        "NODE".into(),
        "MODE".into(),
        "ACCESS MODE".into(),
        "STATE".into(),
        "SINCE".into(),
        "LAST ERROR".into(),
    ]];
    for x in &r.claims {
        rows.push(vec![
            x.volume_id.clone(),
            x.alloc_id.clone(),
            if x.holder_unreachable {
                format!("{} (unreachable)", x.node)
            } else {
                x.node.clone()
            },
            x.mode.clone(),
            x.access_mode.clone(),
            x.state.clone(),
            since(x.since_ms),
            x.last_error.clone(),
        ]);
    }
    print_table(&rows);
    for x in r.claims.iter().filter(|x| x.holder_unreachable) {
        println!(
            "volume {} is held by allocation {} on unreachable node {}: it stays claimed until that node comes back or is fenced; once the node is known to be down for good, `claimd volume detach {} --node {} --reason TEXT` frees it",
            x.volume_id, x.alloc_id, x.node, x.volume_id, x.node
        );
    }
    problems()
}

pub(super) fn claim_free(c: &Call) -> Result<(), CliError> {
    let mut req = w::FreeClaimRequest::new();
    let mut positional = Vec::new();
    let mut i = 0;
    while i < c.args.len() {
        let a = &c.args[i];
        if let Some(v) = option_value(c, &["--reason"], &mut i)? {
            req.reason = v;
        } else if a == "--force" {
            req.force = true;
        } else if a.starts_with('-') {
            return Err(c.usage(format!("unknown option {a:?}")));
        } else {
            positional.push(a.clone());
        }
        i += 1;
    }
    let [volume, alloc] = positional.as_slice() else {
        return Err(c.usage("claim free needs a volume ID and an allocation ID"));
    };
    if req.reason.trim().is_empty() {
        return Err(c.usage("claim free needs --reason TEXT (it is recorded)"));
    }
    req.volume_id = volume.clone();
    req.alloc_id = alloc.clone();
    let api = c.connect()?;
    let r = api.call("claim free", QUICK_CALL_TIMEOUT, |a, o| {
        a.free_claim(&req, o)
    })?;
    if c.json() {
        println!(
            "{}",
            json!({"freed": {"volume_id": r.claim.volume_id, "alloc_id": r.claim.alloc_id,
                             "node": r.claim.node}})
        );
    } else {
        println!(
            "claim of volume {} by allocation {} on node {} freed",
            r.claim.volume_id, r.claim.alloc_id, r.claim.node
        );
    }
    Ok(())
}

/// "4m ago" for a claim taken at `ms` (milliseconds since the epoch);
/// "-" when not known.
fn since(ms: u64) -> String {
    if ms == 0 {
        return "-".to_string();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let secs = now.saturating_sub(ms) / 1000;
    match secs {
        0..=59 => format!("{secs}s ago"),
        60..=3599 => format!("{}m ago", secs / 60),
        3600..=86399 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

pub(super) fn node_remove(c: &Call) -> Result<(), CliError> {
    let args = c.positional(1)?;
    let Some(node) = args.first() else {
        return Err(c.usage("node remove needs a node name"));
    };
    let mut req = w::RemoveNodeRequest::new();
    req.node = node.to_string();
    let api = c.connect()?;
    let r = api.call("node remove", QUICK_CALL_TIMEOUT, |a, o| {
        a.remove_node(&req, o)
    })?;
    if c.json() {
        println!(
            "{}",
            json!({"node": req.node, "removed_keys": r.removed_keys})
        );
    } else {
        println!("node {} removed ({})", req.node, r.removed_keys.join(", "));
    }
    Ok(())
}
