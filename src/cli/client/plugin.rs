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
        let hosts: Vec<Value> = r
            .controller_hosts
            .iter()
            .map(|h| {
                json!({"plugin_id": h.plugin_id, "node": h.node, "alive": h.alive,
                       "ready": h.ready, "publish_unpublish_volume": h.publish_unpublish_volume})
            })
            .collect();
        let mut out = json!({ "plugins": list, "controller_hosts": hosts });
        if !r.cluster_error.is_empty() {
            out["cluster_error"] = json!(r.cluster_error);
        }
        println!("{out}");
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
    if !r.controller_hosts.is_empty() {
        println!();
        println!("controller hosts (cluster):");
        let mut rows = vec![vec![
            "PLUGIN".to_string(),
            "NODE".into(),
            "ALIVE".into(),
            "READY".into(),
            "ATTACHES".into(),
        ]];
        for h in &r.controller_hosts {
            let yes = |b: bool| if b { "yes" } else { "no" }.to_string();
            rows.push(vec![
                h.plugin_id.clone(),
                h.node.clone(),
                yes(h.alive),
                yes(h.ready),
                yes(h.publish_unpublish_volume),
            ]);
        }
        print_table(&rows);
    }
    if !r.cluster_error.is_empty() {
        eprintln!(
            "warning: the cluster's controller hosts cannot be listed: {}",
            r.cluster_error
        );
    }
    Ok(())
}
