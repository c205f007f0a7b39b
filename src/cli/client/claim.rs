//! `claimd claim list`.

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
    if c.json() {
        let list: Vec<Value> = r
            .claims
            .iter()
            .map(|x| {
                json!({"volume_id": x.volume_id, "alloc_id": x.alloc_id, "node": x.node,
                       "mode": x.mode, "access_mode": x.access_mode, "state": x.state,
                       "external_node_id": x.external_node_id})
            })
            .collect();
        println!("{}", json!({ "claims": list }));
        return Ok(());
    }
    let mut rows = vec![vec![
        "VOLUME".to_string(),
        "ALLOCATION".into(),
        "NODE".into(),
        "MODE".into(),
        "ACCESS MODE".into(),
        "STATE".into(),
    ]];
    for x in &r.claims {
        rows.push(vec![
            x.volume_id.clone(),
            x.alloc_id.clone(),
            x.node.clone(),
            x.mode.clone(),
            x.access_mode.clone(),
            x.state.clone(),
        ]);
    }
    print_table(&rows);
    Ok(())
}
