//! Every etcd key claimd reads or writes, in one place. The key schema is a
//! contract between the agents of one cluster, whatever their versions, so
//! each kind of key has one constructor here (and, where claimd reads keys
//! back, one parser), and a test pins their exact bytes. `P` is
//! `cluster.prefix` without a trailing slash.
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `P/schema` | `{"version": N}`: the schema the cluster's agents write | durable, written once |
//! | `P/nodes/NODE` | the node's liveness record | on the node's lease |
//! | `P/node-settings/NODE` | its self-release settings, rewritten by every registration | durable |
//! | `P/node-claims/NODE/VOLUME/ALLOC` | the per-node claim index | durable |
//! | `P/claim-index/NODE` | the node keeps its index | durable |
//! | `P/claims/VOLUME/ALLOC` | a claim | durable |
//! | `P/freed/VOLUME/ALLOC` | why a claim was freed while its node was away | on a lease of `freed_note_retention` |
//! | `P/volumes/VOLUME` | a shared registration | durable |
//! | `P/storage/PLUGIN/HEX` | the name registered for a storage volume (hex of its external ID) | durable |
//! | `P/volumes-docker/NAME` | what an engine's Create said of a volume | durable |
//! | `P/attachments/VOLUME/NODE` | an attach or detach request | durable |
//! | `P/attachment-locks/VOLUME/NODE` | the controller host working on it | on the host's lease |
//! | `P/plugins/PLUGIN/controllers/NODE` | a controller host of the plugin | on the host's lease |
//! | `P/controller-calls/ID` | a forwarded controller call | durable |
//! | `P/controller-call-locks/ID` | the host working on it | on the host's lease |
//! | `P/reaper-locks/NODE` | the agent acting on a gone node | on that agent's lease |

/// The schema of the keys above: written to `P/schema` by the first agent
/// of a cluster, checked by every agent at start (`claims::etcd::schema`).
pub const SCHEMA_VERSION: u64 = 1;

/// The keys under one cluster prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    /// Without a trailing slash, e.g. `/claimd`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn at(&self, rest: std::fmt::Arguments<'_>) -> String {
        format!("{}/{rest}", self.prefix)
    }

    pub fn schema(&self) -> String {
        self.at(format_args!("schema"))
    }

    // ---- Nodes ----------------------------------------------------------

    /// Every node's liveness key.
    pub fn nodes(&self) -> String {
        self.at(format_args!("nodes/"))
    }

    pub fn node(&self, node: &str) -> String {
        self.at(format_args!("nodes/{node}"))
    }

    pub fn settings_all(&self) -> String {
        self.at(format_args!("node-settings/"))
    }

    pub fn settings(&self, node: &str) -> String {
        self.at(format_args!("node-settings/{node}"))
    }

    /// One range holding `nodes/` and `node-settings/` (and `node-claims/`,
    /// which a reader of the first two skips): a watch of both at one
    /// revision.
    pub fn node_range(&self) -> String {
        self.at(format_args!("node"))
    }

    /// The node of a key under `nodes/` or `node-settings/`, and which.
    pub fn parse_node(&self, key: &str) -> Option<NodeKey> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix('/')?;
        if let Some(n) = rest.strip_prefix("nodes/") {
            Some(NodeKey::Liveness(n.to_string()))
        } else {
            rest.strip_prefix("node-settings/")
                .map(|n| NodeKey::Settings(n.to_string()))
        }
    }

    pub fn reaper_lock(&self, node: &str) -> String {
        self.at(format_args!("reaper-locks/{node}"))
    }

    // ---- Claims ---------------------------------------------------------

    pub fn claims(&self) -> String {
        self.at(format_args!("claims/"))
    }

    pub fn claims_of(&self, volume_id: &str) -> String {
        self.at(format_args!("claims/{volume_id}/"))
    }

    pub fn claim(&self, volume_id: &str, alloc_id: &str) -> String {
        self.at(format_args!("claims/{volume_id}/{alloc_id}"))
    }

    /// (volume, allocation) of a claim key.
    pub fn parse_claim<'k>(&self, key: &'k str) -> Option<(&'k str, &'k str)> {
        key.strip_prefix(&self.claims())?.split_once('/')
    }

    pub fn freed(&self, volume_id: &str, alloc_id: &str) -> String {
        self.at(format_args!("freed/{volume_id}/{alloc_id}"))
    }

    /// The per-node claim index of `node`.
    pub fn node_claims(&self, node: &str) -> String {
        self.at(format_args!("node-claims/{node}/"))
    }

    pub fn node_claim(&self, node: &str, volume_id: &str, alloc_id: &str) -> String {
        self.at(format_args!("node-claims/{node}/{volume_id}/{alloc_id}"))
    }

    /// The index entry of the claim at `claim_key` held by `node`: its
    /// path below `claims/` under `node-claims/<node>/` (whatever its
    /// shape: a key written by hand may lack the allocation part).
    pub fn node_claim_of(&self, node: &str, claim_key: &str) -> Option<String> {
        let rest = claim_key.strip_prefix(&self.claims())?;
        Some(self.at(format_args!("node-claims/{node}/{rest}")))
    }

    /// (volume, allocation) of an index key of `node`.
    pub fn parse_node_claim<'k>(&self, node: &str, key: &'k str) -> Option<(&'k str, &'k str)> {
        key.strip_prefix(&self.node_claims(node))?.split_once('/')
    }

    /// The marker of a node that keeps its claim index.
    pub fn claim_index(&self, node: &str) -> String {
        self.at(format_args!("claim-index/{node}"))
    }

    // ---- Registrations --------------------------------------------------

    pub fn volumes(&self) -> String {
        self.at(format_args!("volumes/"))
    }

    pub fn volume(&self, volume_id: &str) -> String {
        self.at(format_args!("volumes/{volume_id}"))
    }

    /// One range holding `volumes/` and `volumes-docker/`.
    pub fn volume_range(&self) -> String {
        self.at(format_args!("volumes"))
    }

    /// `hex`: the storage volume's external ID in hex (any bytes fit).
    pub fn storage(&self, plugin_id: &str, hex: &str) -> String {
        self.at(format_args!("storage/{plugin_id}/{hex}"))
    }

    pub fn docker_notes(&self) -> String {
        self.at(format_args!("volumes-docker/"))
    }

    pub fn docker_note(&self, name: &str) -> String {
        self.at(format_args!("volumes-docker/{name}"))
    }

    // ---- Controller hosts -----------------------------------------------

    pub fn attachments(&self) -> String {
        self.at(format_args!("attachments/"))
    }

    pub fn attachment(&self, volume_id: &str, node: &str) -> String {
        self.at(format_args!("attachments/{volume_id}/{node}"))
    }

    pub fn attachment_locks(&self) -> String {
        self.at(format_args!("attachment-locks/"))
    }

    pub fn attachment_lock(&self, volume_id: &str, node: &str) -> String {
        self.at(format_args!("attachment-locks/{volume_id}/{node}"))
    }

    /// One range holding `attachments/` and `attachment-locks/`.
    pub fn attachment_range(&self) -> String {
        self.at(format_args!("attachment"))
    }

    pub fn plugins(&self) -> String {
        self.at(format_args!("plugins/"))
    }

    pub fn controller_hosts(&self, plugin_id: &str) -> String {
        self.at(format_args!("plugins/{plugin_id}/controllers/"))
    }

    pub fn controller_host(&self, plugin_id: &str, node: &str) -> String {
        self.at(format_args!("plugins/{plugin_id}/controllers/{node}"))
    }

    /// (plugin, node) of a controller host key.
    pub fn parse_controller_host<'k>(&self, key: &'k str) -> Option<(&'k str, &'k str)> {
        let rest = key.strip_prefix(&self.plugins())?;
        let (plugin, node) = rest.split_once("/controllers/")?;
        (!node.contains('/')).then_some((plugin, node))
    }

    pub fn controller_calls(&self) -> String {
        self.at(format_args!("controller-calls/"))
    }

    pub fn controller_call_lock(&self, call: &str) -> String {
        self.at(format_args!("controller-call-locks/{call}"))
    }

    /// One range holding `controller-calls/` and `controller-call-locks/`.
    pub fn controller_call_range(&self) -> String {
        self.at(format_args!("controller-call"))
    }
}

/// A key under `nodes/` or `node-settings/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeKey {
    Liveness(String),
    Settings(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact bytes of every key: changing one is a change of the
    /// schema between agents of one cluster (`SCHEMA_VERSION`).
    #[test]
    fn every_key_is_pinned() {
        let k = Keys::new("/claimd/");
        let pinned = [
            (k.schema(), "/claimd/schema"),
            (k.nodes(), "/claimd/nodes/"),
            (k.node("n1"), "/claimd/nodes/n1"),
            (k.settings_all(), "/claimd/node-settings/"),
            (k.settings("n1"), "/claimd/node-settings/n1"),
            (k.node_range(), "/claimd/node"),
            (k.reaper_lock("n1"), "/claimd/reaper-locks/n1"),
            (k.claims(), "/claimd/claims/"),
            (k.claims_of("v"), "/claimd/claims/v/"),
            (k.claim("v", "a"), "/claimd/claims/v/a"),
            (k.freed("v", "a"), "/claimd/freed/v/a"),
            (k.node_claims("n1"), "/claimd/node-claims/n1/"),
            (k.node_claim("n1", "v", "a"), "/claimd/node-claims/n1/v/a"),
            (k.claim_index("n1"), "/claimd/claim-index/n1"),
            (k.volumes(), "/claimd/volumes/"),
            (k.volume("v"), "/claimd/volumes/v"),
            (k.volume_range(), "/claimd/volumes"),
            (k.storage("p", "6578742d76"), "/claimd/storage/p/6578742d76"),
            (k.docker_notes(), "/claimd/volumes-docker/"),
            (k.docker_note("db"), "/claimd/volumes-docker/db"),
            (k.attachments(), "/claimd/attachments/"),
            (k.attachment("v", "n1"), "/claimd/attachments/v/n1"),
            (k.attachment_locks(), "/claimd/attachment-locks/"),
            (
                k.attachment_lock("v", "n1"),
                "/claimd/attachment-locks/v/n1",
            ),
            (k.attachment_range(), "/claimd/attachment"),
            (k.plugins(), "/claimd/plugins/"),
            (k.controller_hosts("p"), "/claimd/plugins/p/controllers/"),
            (
                k.controller_host("p", "n1"),
                "/claimd/plugins/p/controllers/n1",
            ),
            (k.controller_calls(), "/claimd/controller-calls/"),
            (
                k.controller_call_lock("c1"),
                "/claimd/controller-call-locks/c1",
            ),
            (k.controller_call_range(), "/claimd/controller-call"),
        ];
        for (built, want) in pinned {
            assert_eq!(built, want);
        }
        assert_eq!(SCHEMA_VERSION, 1);
    }

    #[test]
    fn keys_read_back_give_their_parts() {
        let k = Keys::new("/c");
        assert_eq!(k.parse_claim("/c/claims/v/a"), Some(("v", "a")));
        assert_eq!(k.parse_claim("/c/freed/v/a"), None);
        assert_eq!(
            k.parse_node_claim("n", "/c/node-claims/n/v/a"),
            Some(("v", "a"))
        );
        assert_eq!(
            k.parse_node("/c/nodes/n1"),
            Some(NodeKey::Liveness("n1".into()))
        );
        assert_eq!(
            k.parse_node("/c/node-settings/n1"),
            Some(NodeKey::Settings("n1".into()))
        );
        assert_eq!(k.parse_node("/c/node-claims/n1/v/a"), None);
        assert_eq!(
            k.parse_controller_host("/c/plugins/p/controllers/n1"),
            Some(("p", "n1"))
        );
        assert_eq!(k.parse_controller_host("/c/plugins/p/other/n1"), None);
        // Another prefix that starts the same is not this one's.
        assert_eq!(Keys::new("/c").parse_node("/cc/nodes/n1"), None);
    }
}
