//! Every field of the config file, its default and what it means: the one
//! source of the config reference. `claimd agent --help` prints it
//! (`help_section`), and the manual's configuration page holds
//! `markdown()` between two markers; tests/project/docs.rs fails when the page is
//! not exactly that, or when this table and the parser's fields differ.
//! Defaults are read from the parser's own constants.

use super::docker::{
    DEFAULT_DOCKER_DRIVER, DEFAULT_DOCKER_MOUNT_TIMEOUT, DEFAULT_DOCKER_UNUSED_CHECK,
    DEFAULT_ENGINE_MOUNT_TIMEOUT, DEFAULT_ENGINE_SOCKETS, MAX_DOCKER_MOUNT_TIMEOUT,
};
use super::{format_duration as d, Timeouts};

/// A field's default: a value as written in the file, or words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldDefault {
    Value(String),
    Words(&'static str),
}

/// One field of the config file.
#[derive(Clone, Debug)]
pub struct Field {
    /// Where it sits: `state_dir`, `cluster.tls.ca`, `plugins[].socket`.
    pub name: &'static str,
    pub default: FieldDefault,
    /// At most two short lines, for `claimd agent --help`.
    pub short: &'static str,
    /// The manual's text (Markdown, one paragraph).
    pub doc: String,
}

fn v(s: impl Into<String>) -> FieldDefault {
    FieldDefault::Value(s.into())
}

fn f(
    name: &'static str,
    default: FieldDefault,
    short: &'static str,
    doc: impl Into<String>,
) -> Field {
    Field {
        name,
        default,
        short,
        doc: doc.into(),
    }
}

/// The sections, in the order the reference shows them: "" is the top
/// level.
pub const SECTIONS: [&str; 5] = ["", "plugins[]", "cluster", "cluster.tls", "docker"];

/// Every field, sections included (a section is a field of its parent).
pub fn fields() -> Vec<Field> {
    let t = Timeouts::default();
    use FieldDefault::Words as w;
    vec![
        f("state_dir", v(super::DEFAULT_STATE_DIR),
          "the state: state.json, state.journal, instance-id, lock",
          "The state directory (mode 0700): snapshot `state.json` and journal `state.journal` (mode 0600), its lock `claimd.lock`, `instance-id` and, in cluster mode, `lease-clock.json` and `published-settings.json`. Back it up as described in [Operations](operations.md#backing-up-the-state-directory)."),
        f("api_socket", v(super::DEFAULT_API_SOCKET),
          "the local API (mode 0600)",
          "The local gRPC API's unix socket (mode 0600), which the CLI uses (`--socket`, `CLAIMD_SOCKET`)."),
        f("mount_root", v(super::DEFAULT_MOUNT_ROOT),
          "staging and per-allocation target paths",
          "Where staging paths (`<mount_root>/staging/<plugin>/<volume>`) and per-allocation target paths are made. Node plugins mount here: it must be a path the plugins see, with mounts propagating back to the host (see [Getting started](getting-started.md#mount-propagation))."),
        f("plugin_dir", w("none"),
          "plugins' sockets: <dir>/<id>/csi.sock, node.sock, controller.sock",
          "A directory scanned every 0.5 s for plugin sockets: `<dir>/<plugin-id>/csi.sock` (node and, if advertised, controller), `node.sock`, `controller.sock`. The packaged config sets `/run/claimd/plugins`, kept across `systemctl stop` (see [Upgrading](upgrading.md#the-plugin-directory-survives-a-stop))."),
        f("plugins", v("[]"),
          "the plugins: [{\"id\", \"type\", \"socket\"}, ...]",
          "The CSI plugins, one object each (below). A plugin ID may appear twice only for its node and its controller side."),
        f("plugins[].id", w("required"),
          "the plugin's ID, which volumes name as plugin_id",
          "The plugin's ID: letters, digits, `.`, `_`, `-`. Volumes name it as `plugin_id`."),
        f("plugins[].type", w("required"),
          "node, controller or monolith",
          "`node` (node service only), `controller` (controller service only) or `monolith` (node, plus controller when the plugin advertises CONTROLLER_SERVICE), all on one socket."),
        f("plugins[].socket", w("required"),
          "unix:///abs/path, unix:/abs/path or /abs/path",
          "The plugin's endpoint as plugins and CSI tooling write it: `unix:///abs/path`, `unix:/abs/path` or a plain `/abs/path`. Other schemes are refused, naming the scheme."),
        f("node_name", w("the host name"),
          "this node's name in claims",
          "This node's name in claims and, in cluster mode, in etcd keys."),
        f("csi_call_timeout", v(d(t.csi_call)),
          "deadline of every CSI call",
          "The deadline of every CSI call. A call that hits it is uncertain and is retried, never negated blindly. In cluster mode keep one value across the cluster ([Safety](safety.md))."),
        f("plugin_wait_timeout", v(d(t.plugin_wait)),
          "how long a mount waits for its plugin to be ready",
          "How long a mount waits for its node plugin to be ready."),
        f("probe_interval", v(d(t.probe_interval)),
          "probe period of a healthy plugin",
          "The probe period of a healthy plugin; absent or starting plugins are re-probed within 50–500 ms."),
        f("claim_retry_deadline", v(d(t.claim_retry_deadline)),
          "how long a claim held by another allocation is retried",
          "How long a claim held by another allocation is retried; other refusals fail at once, naming the holder."),
        f("mount_retry_deadline", v(d(t.mount_retry_deadline)),
          "retryable CSI errors of a mount; then it fails and is rolled back",
          "How long a mount retries retryable CSI errors (UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) before it fails with DEADLINE_EXCEEDED and is rolled back. A node plugin's `max_volumes_per_node` already reached fails a mount at once."),
        f("release_retry_deadline", v(d(t.release_retry_deadline)),
          "how long a failing release keeps retrying",
          "How long a failing release keeps retrying."),
        f("metrics_listen", w("none (off)"),
          "an IP:port serving GET /metrics and GET /healthz",
          "An `IP:port` (`127.0.0.1:9432`, `[::1]:9432`; no host names) where `GET /metrics` and `GET /healthz` are served. `claimd metrics` works without it. An address that cannot be bound stops the agent before its restore (exit 1)."),
        f("volume_stats_interval", v(d(super::DEFAULT_VOLUME_STATS_INTERVAL)),
          "NodeGetVolumeStats period per published volume",
          "How often NodeGetVolumeStats is asked for each published volume (plugins with `GET_VOLUME_STATS`)."),
        f("cluster", w("none (one node)"),
          "claims, registrations and attachments shared through etcd",
          "Cluster mode: claims, volume registrations and controller attachments shared through etcd ([Cluster mode](cluster.md)). Without it, claims live in the agent's own state."),
        f("cluster.endpoints", w("required"),
          "etcd client URLs, tried in order with failover",
          "etcd client URLs (`http://host:port`, `https://host:port` or `host:port`), tried in order with failover. `https://` needs `tls`; `http://` excludes it."),
        f("cluster.prefix", v(super::DEFAULT_CLUSTER_PREFIX),
          "every key claimd writes starts with it",
          "Every key claimd writes starts with it."),
        f("cluster.lease_ttl", v(d(super::DEFAULT_LEASE_TTL)),
          "TTL of this node's liveness lease (at least 2s)",
          "The TTL of this node's liveness lease; at least `2s`."),
        f("cluster.call_timeout", v(d(super::DEFAULT_ETCD_CALL_TIMEOUT)),
          "deadline of every etcd call; at most half of lease_ttl",
          "The deadline of every etcd call; at most half of `lease_ttl`."),
        f("cluster.attach_timeout", v(d(super::DEFAULT_ATTACH_TIMEOUT)),
          "one attach/detach request through a controller host",
          "How long one attach or detach request waits for a controller host on another node before it counts as a failed attempt (the mount or release retries it within its own deadline)."),
        f("cluster.stop_after_disconnect", w("off"),
          "a duration >= lease_ttl: self-release when cut off that long",
          "A duration, at least `lease_ttl`. A node that cannot renew its lease that long releases its allocations' node side itself; the cluster detaches and frees its fenced claims after W. The agent refuses a window that breaks the margin inequality ([Safety](safety.md))."),
        f("cluster.fencing_plugins", v("[]"),
          "plugins whose ControllerUnpublish fences a node",
          "Plugin IDs whose ControllerUnpublishVolume cuts a node off the volume (a SAN that revokes the host's access): only their volumes are detached and freed by the cluster when their node is gone."),
        f("cluster.free_unfenced_claims", v("false"),
          "also free unfenceable claims of gone nodes (risky)",
          "Also free, when their node is gone, claims nothing can fence (node-only volumes such as NFS, plugins not in `fencing_plugins`). **The user's risk**: a paused node that comes back may still write ([Safety](safety.md))."),
        f("cluster.freed_note_retention", v(d(super::DEFAULT_FREED_NOTE_RETENTION)),
          "how long a freed/ note is kept (at least 1m)",
          "How long a `freed/<volume>/<alloc>` note (why a claim was freed while its node was away) is kept, on an etcd lease of that TTL; at least `1m`. A node back within it releases the allocation; one back later finds neither claim nor note and takes the claim again, or releases the allocation when another allocation holds the volume by then. Longer costs one small key per freed claim for longer."),
        f("cluster.epoch_plugins", v("[]"),
          "plugins given the claim's epoch under claimd.io/epoch",
          "Plugin IDs given the claim's epoch (the fencing token) under `claimd.io/epoch` in ControllerPublishVolume's `volume_context` and in the `publish_context` of NodeStageVolume and NodePublishVolume. List only a plugin that asks for the key: the CSI spec has those maps be exactly what the plugin returned."),
        f("cluster.tls", w("none"),
          "TLS to etcd (builds with the tls feature)",
          "TLS to etcd, in a claimd built with the cargo feature `tls` (on by default and in the package). PEM files are read once at start: a missing file, or a certificate where the key belongs, stops the agent naming the file."),
        f("cluster.tls.ca", w("required"),
          "the CA that signed the members' certificates",
          "The CA that signed the members' certificates, whose names or IP SANs must cover each endpoint's host."),
        f("cluster.tls.cert", w("none"),
          "this node's client certificate (with key)",
          "This node's client certificate, for etcd's `--client-cert-auth`; goes with `key`."),
        f("cluster.tls.key", w("none"),
          "the client certificate's key (with cert)",
          "The client certificate's private key; goes with `cert`. Keep it readable by root only; it is never logged."),
        f("docker", w("none (off)"),
          "serve the Docker volume plugin protocol (Docker, Podman)",
          "Serve the Docker volume plugin protocol for Docker and Podman ([Docker and Podman](docker.md))."),
        f("docker.driver", v(DEFAULT_DOCKER_DRIVER),
          "the driver name (--driver, --volume-driver)",
          "The driver name (`--driver`, `--volume-driver`)."),
        f("docker.socket", v("/run/docker/plugins/<driver>.sock"),
          "where the protocol is served (mode 0600)",
          "Where the protocol is served (mode 0600). Docker finds a plugin there by its name; elsewhere it needs a spec file in `/etc/docker/plugins/`."),
        f("docker.mount_timeout", v(d(DEFAULT_DOCKER_MOUNT_TIMEOUT)),
          "how long a Mount may wait before it fails (at most 95s)",
          format!("How long a Mount may wait (a claim held elsewhere, a plugin not ready) before it fails naming what it waited on, leaving nothing claimed; at most `{}`, so that a given-up Mount, undone, answers within Docker's 2-minute limit. Also how long an Unmount waits for its release (at most 55 s, within Docker's 1-minute Unmount limit).", d(MAX_DOCKER_MOUNT_TIMEOUT))),
        f("docker.unused_check_interval", v(d(DEFAULT_DOCKER_UNUSED_CHECK)),
          "period of the engine-death rule",
          "The period of the engine-death rule: engine mounts nothing uses at two checks in a row are released."),
        f("docker.engine_sockets", v(format!("[\"{}\"]", DEFAULT_ENGINE_SOCKETS.join("\", \""))),
          "engines' API sockets asked before that rule releases",
          "The engines' API sockets the engine-death rule asks before it releases (`[]`: none). A container they list in any state but removed keeps its volume."),
        f("docker.engine_mount_timeout", v(d(DEFAULT_ENGINE_MOUNT_TIMEOUT)),
          "an engine mount younger than this is never released",
          "The engines' own limit on a Mount (Docker: 2 minutes; Podman: its `volume_plugin_timeout`): an engine mount younger than this is never released by the engine-death rule."),
    ]
}

/// The section a field belongs to and its own name in it.
fn split(name: &str) -> (&str, &str) {
    match name.rfind('.') {
        Some(i) => (&name[..i], &name[i + 1..]),
        None => ("", name),
    }
}

fn words(def: &FieldDefault) -> String {
    match def {
        FieldDefault::Value(s) => s.clone(),
        FieldDefault::Words(s) => (*s).to_string(),
    }
}

/// The CONFIG FIELDS section of `claimd agent --help`.
pub fn help_section() -> String {
    let mut s = String::from("CONFIG FIELDS (all optional unless required) AND DEFAULTS:\n");
    for fl in fields() {
        let (section, leaf) = split(fl.name);
        let depth = if section.is_empty() {
            0
        } else {
            section.matches('.').count() + 1
        };
        let indent = "  ".repeat(depth);
        s.push_str(&format!(
            "    {:<26}{}\n        {indent}{}\n",
            format!("{indent}{leaf}"),
            words(&fl.default),
            fl.short
        ));
    }
    s.push_str("Durations are written like 500ms, 30s, 5m, 2h, 1d. Each field is explained in\n");
    s.push_str("the manual's configuration page (/usr/share/doc/claimd/configuration.md).\n");
    s
}

/// The manual's reference: one table per section.
pub fn markdown() -> String {
    let all = fields();
    let mut s = String::new();
    for section in SECTIONS {
        let title = if section.is_empty() {
            "Top level".to_string()
        } else {
            format!("`{section}`")
        };
        s.push_str(&format!(
            "### {title}\n\n| field | default | meaning |\n|---|---|---|\n"
        ));
        for fl in all.iter().filter(|fl| split(fl.name).0 == section) {
            let default = match &fl.default {
                FieldDefault::Value(v) => format!("`{v}`"),
                FieldDefault::Words(w) => (*w).to_string(),
            };
            s.push_str(&format!("| `{}` | {default} | {} |\n", fl.name, fl.doc));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_holds_fields_and_names_are_unique() {
        let all = fields();
        let mut names: Vec<_> = all.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for section in SECTIONS {
            assert!(all.iter().any(|f| split(f.name).0 == section), "{section}");
        }
        for fl in &all {
            assert!(SECTIONS.contains(&split(fl.name).0), "{}", fl.name);
            assert!(
                !fl.doc.contains('|') && !fl.doc.contains('\n'),
                "{}",
                fl.name
            );
            assert!(
                fl.short.chars().count() <= 66,
                "{}: short text too long",
                fl.name
            );
        }
    }
}
