//! The key schema's version in etcd (`P/schema`, `keys::SCHEMA_VERSION`).
//! The first agent that knows it writes it; every agent checks it before
//! each registration of its node. An agent that meets a schema newer than
//! its own does not register, naming both versions: it counts as cut off
//! (its self-release, and the other nodes' reapers, act as for any node
//! gone), so it takes no claim and calls nothing up. (A registration or
//! an operator's command through it still writes.) A value that is not a
//! schema record is said loudly and left alone; it blocks nothing, so one
//! damaged key cannot take every node down. Agents older than the key
//! ignore it.

use super::*;
use crate::etcd::TxnOp;

#[derive(Debug, Serialize, Deserialize)]
struct SchemaRecord {
    version: u64,
}

impl EtcdClaims {
    /// Writes the schema when etcd holds none, else checks it: Err (said
    /// in the log) when it is not this agent's.
    pub fn check_schema(&self) -> Result<(), String> {
        let key = self.shared.keys.schema();
        let ours = keys::SCHEMA_VERSION;
        let value = serde_json::to_vec(&SchemaRecord { version: ours })
            .expect("a schema record always encodes");
        let t = self
            .shared
            .client
            .txn(
                &[Compare::absent(key.clone())],
                &[TxnOp::put(key.clone(), value)],
                &[TxnOp::get(key.clone())],
            )
            .map_err(|e| format!("cannot read {key}: {}", crate::error_chain(&e)))?;
        if t.succeeded {
            log::info!("cluster: {key}: key schema {ours} written");
            return Ok(());
        }
        let Some(kv) = t.first_range().and_then(|r| r.kvs.first()) else {
            return Err(format!("{key} changed while it was read: reading it again"));
        };
        let why = match serde_json::from_slice::<SchemaRecord>(&kv.value) {
            Ok(r) if r.version == ours => return Ok(()),
            Ok(r) if r.version > ours => format!(
                "etcd holds key schema {} ({key}), newer than this claimd's {ours}: this agent does not register until it is upgraded",
                r.version
            ),
            Ok(r) => format!(
                "{key} says key schema {}, older than this claimd's {ours}, which has no way from it: this agent does not register",
                r.version
            ),
            Err(e) => {
                log::error!(
                    "cluster: {key} is not a key schema record ({e}): fix it by hand to {{\"version\": {ours}}} (it is left untouched); registering anyway"
                );
                return Ok(());
            }
        };
        log::error!("cluster: {why}");
        Err(why)
    }
}
