//! Unit tests of the config parser.
use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(Path::new("/etc/claimd/config.json"), text)
}

#[test]
fn empty_object_gives_defaults() {
    let c = parse("{}").expect("valid");
    assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
    assert_eq!(c.api_socket, PathBuf::from(DEFAULT_API_SOCKET));
    assert_eq!(c.timeouts, Timeouts::default());
    assert!(c.plugins.is_empty());
}

#[test]
fn full_config() {
    let c = parse(
        r#"{"state_dir":"/s","api_socket":"/r/a.sock","mount_root":"/m","plugin_dir":"/p",
            "node_name":"edge-1",
            "plugins":[{"id":"hostpath","type":"monolith","socket":"/p/h.sock"},
                       {"id":"ebs","type":"node","socket":"/p/n.sock"},
                       {"id":"ebs","type":"controller","socket":"/p/c.sock"}],
            "csi_call_timeout":"5s","plugin_wait_timeout":"2m","probe_interval":"250ms",
            "claim_retry_deadline":"1h","release_retry_deadline":"1d"}"#,
    )
    .expect("valid");
    assert_eq!(c.plugins.len(), 3);
    assert_eq!(c.plugins[2].plugin_type, PluginType::Controller);
    assert_eq!(c.timeouts.csi_call, Duration::from_secs(5));
    assert_eq!(c.timeouts.probe_interval, Duration::from_millis(250));
    assert_eq!(
        c.timeouts.release_retry_deadline,
        Duration::from_secs(86400)
    );
    assert_eq!(c.node_name, "edge-1");
}

#[test]
fn endpoints_are_read_as_plugins_write_them() {
    for s in [
        "unix:///run/x/csi.sock",
        "unix:/run/x/csi.sock",
        "/run/x/csi.sock",
    ] {
        assert_eq!(
            parse_endpoint(s).expect(s),
            PathBuf::from("/run/x/csi.sock"),
            "{s}"
        );
    }
    let c = parse(
        r#"{"plugins":[{"id":"a","type":"node","socket":"unix:///run/a/csi.sock"}],
            "mount_retry_deadline":"45s"}"#,
    )
    .expect("valid");
    assert_eq!(c.plugins[0].socket, PathBuf::from("/run/a/csi.sock"));
    assert_eq!(c.metrics_listen, None);
    let m =
        parse(r#"{"metrics_listen":"[::1]:9432","volume_stats_interval":"5s"}"#).expect("valid");
    assert_eq!(m.metrics_listen, Some("[::1]:9432".parse().expect("addr")));
    assert_eq!(m.volume_stats_interval, Duration::from_secs(5));
    assert_eq!(c.timeouts.mount_retry_deadline, Duration::from_secs(45));
    let cl = parse(
        r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"lease_ttl":"3s",
            "call_timeout":"1s","stop_after_disconnect":"3s","attach_timeout":"20s",
            "fencing_plugins":["san"],"free_unfenced_claims":true,"epoch_plugins":["san"],"freed_note_retention":"2h"}}"#,
    )
    .expect("valid")
    .cluster
    .expect("a cluster section");
    assert_eq!(cl.stop_after_disconnect, Some(Duration::from_secs(3)));
    assert_eq!(cl.attach_timeout, Duration::from_secs(20));
    assert_eq!(cl.fencing_plugins, ["san"]);
    assert!(cl.free_unfenced_claims);
    assert_eq!(cl.epoch_plugins, ["san"]);
    assert_eq!(cl.freed_note_retention, Duration::from_secs(7200));
    let d = parse("{}").expect("defaults");
    assert_eq!(
        d.timeouts.mount_retry_deadline,
        DEFAULT_MOUNT_RETRY_DEADLINE
    );
}

#[test]
fn bad_configs_name_the_field() {
    let cases = [
        (r#"{"bogus":1}"#, "bogus"),
        (r#"{"plugins":[{"id":"a","type":"node"}]}"#, "socket"),
        (
            r#"{"plugins":[{"id":"a","type":"node","socket":"rel.sock"}]}"#,
            "plugins[0].socket",
        ),
        (
            r#"{"plugins":[{"id":"a","type":"node","socket":"/a"},{"id":"a","type":"monolith","socket":"/b"}]}"#,
            "plugins[1].id",
        ),
        (
            r#"{"plugins":[{"id":"../x","type":"node","socket":"/a"}]}"#,
            "plugins[0].id",
        ),
        (
            r#"{"plugins":[{"id":"a","type":"sidecar","socket":"/a"}]}"#,
            "sidecar",
        ),
        (r#"{"state_dir":"var/lib"}"#, "state_dir"),
        (r#"{"probe_interval":"soon"}"#, "probe_interval"),
        (r#"{"probe_interval":"0s"}"#, "probe_interval"),
        (r#"{"metrics_listen":"localhost:9432"}"#, "metrics_listen"),
        (r#"{"metrics_listen":"127.0.0.1"}"#, "metrics_listen"),
        (r#"{"metrics_listen":"127.0.0.1:0"}"#, "metrics_listen"),
        (r#"{"volume_stats_interval":"0s"}"#, "volume_stats_interval"),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"stop_after_disconnect":"5s"}}"#,
            "cluster.stop_after_disconnect",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"lease_ttl":"2s","call_timeout":"5s"}}"#,
            "cluster.call_timeout",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"fencing_plugins":["../x"]}}"#,
            "cluster.fencing_plugins",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"epoch_plugins":["a/b"]}}"#,
            "cluster.epoch_plugins",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"freed_note_retention":"30s"}}"#,
            "cluster.freed_note_retention",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"lease_ttl":"2s","call_timeout":"1s","stop_after_disconnect":"1000h"}}"#,
            "cluster.stop_after_disconnect",
        ),
        (
            r#"{"cluster":{"endpoints":["http://127.0.0.1:2379"],"attach_timeout":"0s"}}"#,
            "cluster.attach_timeout",
        ),
        (
            r#"{"mount_retry_deadline":"forever"}"#,
            "mount_retry_deadline",
        ),
        (
            r#"{"plugins":[{"id":"a","type":"node","socket":"tcp://10.0.0.1:9000"}]}"#,
            "scheme \"tcp\"",
        ),
        (
            r#"{"plugins":[{"id":"a","type":"node","socket":"unix://host/x.sock"}]}"#,
            "names a host",
        ),
        (
            r#"{"plugins":[{"id":"a","type":"node","socket":"unix:rel.sock"}]}"#,
            "not an absolute path",
        ),
    ];
    for (text, needle) in cases {
        let e = parse(text).expect_err(text);
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        assert!(msg.contains(needle), "{text}: {msg}");
        assert!(msg.contains("/etc/claimd/config.json"), "{msg}");
    }
}

/// The first error of `text`, with its causes.
fn error_text(text: &str) -> String {
    crate::error_chain(&parse(text).expect_err(text))
}

#[test]
fn endpoint_schemes_must_match_the_tls_section() {
    let e = error_text(r#"{"cluster":{"endpoints":["https://10.0.0.5:2379"]}}"#);
    assert!(
        e.contains("cluster.endpoints[0]")
            && e.contains("https://10.0.0.5:2379 uses TLS: it needs a cluster.tls section"),
        "{e}"
    );
    let e = error_text(
        r#"{"cluster":{"endpoints":["10.0.0.5:2379","http://10.0.0.6:2379"],
            "tls":{"ca":"/etc/claimd/etcd-ca.pem"}}}"#,
    );
    assert!(
        e.contains("cluster.endpoints[1]")
            && e.contains("is plain TCP but cluster.tls is set: write https://10.0.0.6:2379"),
        "{e}"
    );
}

#[cfg(feature = "tls")]
#[test]
fn tls_section() {
    let c = parse(
        r#"{"cluster":{"endpoints":["https://10.0.0.5:2379","10.0.0.6:2379"],
            "tls":{"ca":"/etc/claimd/etcd-ca.pem","cert":"/etc/claimd/node.pem",
                   "key":"/etc/claimd/node.key"}}}"#,
    )
    .expect("valid");
    let tls = c.cluster.expect("cluster mode").tls;
    assert_eq!(
        tls,
        Some(ClusterTls {
            ca: "/etc/claimd/etcd-ca.pem".into(),
            cert: Some("/etc/claimd/node.pem".into()),
            key: Some("/etc/claimd/node.key".into()),
        })
    );
    for (tls, needle) in [
        (r#"{"ca":"ca.pem"}"#, "cluster.tls.ca"),
        (
            r#"{"ca":"/ca.pem","cert":"/c.pem"}"#,
            "cert and key go together",
        ),
        (
            r#"{"ca":"/ca.pem","cert":"/c.pem","key":"k"}"#,
            "cluster.tls.key",
        ),
        (r#"{"cert":"/c.pem","key":"/k"}"#, "ca"),
    ] {
        let text = format!(r#"{{"cluster":{{"endpoints":["https://h:1"],"tls":{tls}}}}}"#);
        let e = error_text(&text);
        assert!(e.contains(needle), "{tls}: {e}");
    }
}

#[cfg(not(feature = "tls"))]
#[test]
fn a_tls_section_needs_the_tls_build() {
    let e = error_text(
        r#"{"cluster":{"endpoints":["https://10.0.0.5:2379"],
            "tls":{"ca":"/etc/claimd/etcd-ca.pem"}}}"#,
    );
    assert!(
        e.contains("cluster.tls") && e.contains("built without TLS"),
        "{e}"
    );
}

#[test]
fn durations() {
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("3m"), Ok(Duration::from_secs(180)));
    assert!(parse_duration("3").is_err());
    assert!(parse_duration("s").is_err());
    assert!(parse_duration("3x").is_err());
    for d in ["250ms", "30s", "5m", "2h", "1d"] {
        assert_eq!(format_duration(parse_duration(d).expect("valid")), d);
    }
}
