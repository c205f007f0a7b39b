//! `claimd plugin list`.

use super::*;

pub(super) fn plugin_list(c: &Call) -> Result<(), CliError> {
    c.positional(0)?;
    let api = c.connect()?;
    let r = api.call("plugin list", QUICK_CALL_TIMEOUT, |a, o| {
        a.list_plugins(&w::ListPluginsRequest::new(), o)
    })?;
    if c.json() {
        let list: Vec<Value> = r
            .plugins
            .iter()
            .map(|p| {
                json!({"id": p.id, "type": p.type_, "socket": p.socket, "health": p.health,
                       "reason": p.reason, "name": p.name, "vendor_version": p.vendor_version,
                       "node_id": p.node_id, "max_volumes_per_node": p.max_volumes_per_node,
                       "capabilities": p.capabilities, "source": p.source,
                       "generation": p.generation,
                       "topology": p.topology.iter().collect::<std::collections::BTreeMap<_, _>>()})
            })
            .collect();
        println!("{}", json!({ "plugins": list }));
        return Ok(());
    }
    let mut rows = vec![vec![
        "ID".to_string(),
        "TYPE".into(),
        "HEALTH".into(),
        "NODE ID".into(),
        "CAPABILITIES".into(),
        "REASON".into(),
    ]];
    for p in &r.plugins {
        rows.push(vec![
            p.id.clone(),
            p.type_.clone(),
            p.health.clone(),
            p.node_id.clone(),
            p.capabilities.join(","),
            p.reason.clone(),
        ]);
    }
    print_table(&rows);
    Ok(())
}
