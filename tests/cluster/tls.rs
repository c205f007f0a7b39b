#![cfg(feature = "tls")]
//! Cluster mode over TLS (the `tls` build only: without the feature this
//! file is empty). Each test generates its own PKI with the `openssl` CLI
//! (a CA, a server certificate for 127.0.0.1 as an IP SAN, a client
//! certificate, and a second, unrelated CA), starts a throwaway etcd member
//! that serves clients over TLS only (tests/support/etcd.rs), and runs real
//! `claimd` agents against it with real mounts. What is stored in etcd is
//! read back through a TLS `EtcdClient`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::agent_support::*;
use crate::common::*;
use crate::etcd_support::*;
use claimd::etcd::{ClientIdentity, EtcdClient, EtcdOptions, TlsOptions};
use serde_json::{json, Value};

/// The default key prefix (`cluster_section`).
const PREFIX: &str = "/claimd";
/// Longest a test waits for an agent to show a state it reaches at once.
const SHOW_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest an agent with a bad config may take to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

// ---- A test PKI ------------------------------------------------------------------

/// PEM files made by `openssl` in one directory: `ca.pem` (and its key),
/// `server.pem`/`server.key` for 127.0.0.1, `client.pem`/`client.key`
/// (both signed by `ca`), and `other-ca.pem`, a CA that signed none of
/// them. EC P-256 keys: quick to make.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn generate(dir: &Path) -> Pki {
        fs::create_dir_all(dir).expect("create the PKI directory");
        let pki = Pki {
            dir: dir.to_path_buf(),
        };
        for ca in ["ca", "other-ca"] {
            pki.openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-noenc",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
                "-days",
                "2",
                "-subj",
                &format!("/CN=claimd test {ca}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
        }
        // etcd's gateway dials the member with the server certificate as a
        // client certificate: it needs both uses.
        pki.sign(
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
            2,
        );
        pki.sign("client", "extendedKeyUsage=clientAuth\n", 3);
        pki
    }

    /// A key and a certificate `<name>.pem` signed by `ca` with the
    /// extensions `ext`.
    fn sign(&self, name: &str, ext: &str, serial: u32) {
        let ext_file = format!("{name}.ext");
        fs::write(self.path(&ext_file), ext).expect("write the extensions");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-noenc",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN=claimd test {name}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-extfile",
            &ext_file,
            "-out",
            &format!("{name}.pem"),
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("run openssl (tests/run.sh installs it)");
        assert!(
            out.status.success(),
            "openssl {}: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The member's TLS, asking clients for a certificate when
    /// `client_cert_auth` (the harness then presents `client.pem`).
    fn etcd_tls(&self, client_cert_auth: bool) -> EtcdTls {
        EtcdTls {
            ca: self.path("ca.pem"),
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client: client_cert_auth.then(|| self.client_identity()),
        }
    }

    fn client_identity(&self) -> ClientIdentity {
        ClientIdentity {
            cert: self.path("client.pem"),
            key: self.path("client.key"),
        }
    }

    /// The config's `cluster.tls`: `ca` and, when `identity`, the client
    /// certificate and key.
    fn config(&self, ca: &str, identity: bool) -> Value {
        let mut tls = json!({ "ca": self.path(ca) });
        if identity {
            tls["cert"] = json!(self.path("client.pem"));
            tls["key"] = json!(self.path("client.key"));
        }
        tls
    }

    /// A line of the client key's base64 body: what must never be logged.
    fn client_key_line(&self) -> String {
        let key = fs::read_to_string(self.path("client.key")).expect("read the client key");
        key.lines()
            .find(|l| !l.starts_with("-----") && l.len() > 20)
            .expect("a key has a body")
            .to_string()
    }
}

// ---- A node ------------------------------------------------------------------

/// One node: an agent and its test plugin (no controller) under
/// `<dir>/<name>/`. Field order is drop order: the agent dies first.
struct Node {
    agent: Agent,
    plugin: TestPlugin,
}

impl Node {
    /// The plugin, started, and an agent in cluster mode on `etcd` with
    /// `tls` as its `cluster.tls`, configured but not started.
    fn prepare(dir: &Path, name: &str, endpoint: &str, tls: Option<Value>) -> Node {
        let ndir = dir.join(name);
        let plugin = TestPlugin::builder(&ndir)
            .no_controller()
            .node_id(&format!("ext-{name}"))
            .start();
        let mut config = AgentConfig::new(&ndir, Some(&plugin.socket))
            .cluster_node(name, &[endpoint.to_string()]);
        config.claim_retry_deadline = "5m".into();
        let section = config.cluster.as_mut().expect("a cluster section");
        if let Some(tls) = tls {
            section["tls"] = tls;
        }
        let agent = Agent::prepare(&ndir, "agent", config, false, &[]);
        Node { agent, plugin }
    }

    /// As `prepare`, and the agent started and listening.
    fn start(dir: &Path, name: &str, endpoint: &str, tls: Option<Value>) -> Node {
        let mut n = Self::prepare(dir, name, endpoint, tls);
        n.agent.spawn();
        n.agent.wait_listening();
        n
    }

    /// `alloc mount ALLOC --volume SPEC --json [more]`, whatever it answers.
    fn mount(&self, alloc: &str, spec: &str, more: &[&str]) -> CliOutput {
        let mut args = vec!["alloc", "mount", alloc, "--volume", spec, "--json"];
        args.extend(more);
        self.agent.cli(&args)
    }

    /// A mount that must succeed; the host path.
    fn mount_ok(&self, alloc: &str, spec: &str) -> PathBuf {
        let out = self.mount(alloc, spec, &[]).ok();
        PathBuf::from(
            out.json()["volumes"][0]["host_path"]
                .as_str()
                .expect("host_path is a string"),
        )
    }

    fn release_ok(&self, alloc: &str) {
        self.agent
            .cli(&["alloc", "release", alloc, "--wait", "30s"])
            .ok();
    }

    /// The first volume of `alloc status ALLOC --json`.
    fn volume_status(&self, alloc: &str) -> Value {
        let out = self.agent.cli(&["alloc", "status", alloc, "--json"]);
        if out.code != EXIT_OK {
            return Value::Null;
        }
        out.json()["allocs"][0]["volumes"][0].clone()
    }

    /// Restarts the agent with `ca` as `cluster.tls.ca`.
    fn restart_with_ca(&mut self, pki: &Pki, ca: &str) {
        self.agent.kill();
        let cluster = self.agent.config.cluster.as_mut().expect("cluster mode");
        cluster["tls"]["ca"] = json!(pki.path(ca));
        self.agent.config.write(&self.agent.config_path);
        self.agent.spawn();
        self.agent.wait_listening();
    }

    /// Every mount under this node's mount root.
    fn mounts(&self) -> Vec<MountEntry> {
        mounts_under(&self.agent.config.mount_root)
    }
}

/// Everything etcd holds under the prefix: (key, value, mod revision).
fn stored(etcd: &Etcd) -> Vec<(String, Vec<u8>, i64)> {
    etcd.client()
        .range_prefix(format!("{PREFIX}/"))
        .expect("read etcd")
        .kvs
        .into_iter()
        .map(|kv| (kv.key_str().into_owned(), kv.value.clone(), kv.mod_revision))
        .collect()
}

/// The keys of `stored`.
fn keys(etcd: &Etcd) -> Vec<String> {
    stored(etcd).into_iter().map(|(k, _, _)| k).collect()
}

/// The claim keys etcd holds.
fn claim_keys(etcd: &Etcd) -> Vec<String> {
    keys(etcd)
        .into_iter()
        .filter(|k| k.starts_with(&format!("{PREFIX}/claims/")))
        .collect()
}

/// Whether `text` says that TLS failed, the way gRPC and OpenSSL put it.
fn names_tls(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("ssl") || t.contains("tls") || t.contains("certificate")
}

// ---- 1. A mount and a release over TLS -------------------------------------------

#[test]
fn mounts_and_releases_over_tls_with_a_client_certificate() {
    let dir = TestDir::new();
    let pki = Pki::generate(&dir.path().join("pki"));
    let etcd = Etcd::start_tls(pki.etcd_tls(true));
    let endpoint = etcd.endpoint();
    assert!(endpoint.starts_with("https://127.0.0.1:"), "{endpoint}");

    // TLS is really on: plain TCP to the same port gets nowhere.
    let plain = EtcdClient::connect(
        &[format!("127.0.0.1:{}", etcd.client_port())],
        EtcdOptions {
            call_timeout: Duration::from_secs(2),
            tls: None,
        },
    )
    .expect("a valid endpoint");
    let e = plain
        .get(format!("{PREFIX}/x"))
        .expect_err("plain TCP to TLS");
    assert!(e.is_retryable(), "{e:?}");

    let n = Node::start(dir.path(), "a", &endpoint, Some(pki.config("ca.pem", true)));
    n.plugin.add_volume("ext-v");
    n.agent
        .register(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = n.mount_ok("a1", "data=v");

    // Mounted: the one target, where the agent says.
    let targets: Vec<PathBuf> = mounts_under(&n.agent.config.mount_root.join("per-alloc"))
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    assert_eq!(targets, std::slice::from_ref(&path));
    // The registration, the claim and the liveness key, as etcd holds them
    // (read through a TLS client with the client certificate).
    let claim_key = format!("{PREFIX}/claims/v/a1");
    let claim = etcd
        .client()
        .get(&claim_key)
        .expect("read the claim")
        .expect("the claim is stored");
    let claim: Value = serde_json::from_slice(&claim.value).expect("a JSON claim");
    assert_eq!(claim["claim"]["alloc_id"], "a1", "{claim}");
    assert_eq!(claim["claim"]["node"], "a", "{claim}");
    assert_eq!(claim["claim"]["volume_id"], "v", "{claim}");
    wait_until(SHOW_TIMEOUT, "node a's liveness key, on its lease", || {
        etcd.client()
            .get(format!("{PREFIX}/nodes/a"))
            .ok()
            .flatten()
            .is_some_and(|kv| kv.lease.is_some())
    });
    // The claim index marker comes with the first reconciliation, after
    // the registration.
    wait_until(SHOW_TIMEOUT, "node a's claim index marker", || {
        etcd.client()
            .get(format!("{PREFIX}/claim-index/a"))
            .ok()
            .flatten()
            .is_some()
    });
    assert_eq!(
        keys(&etcd),
        [
            format!("{PREFIX}/claim-index/a"),
            claim_key.clone(),
            format!("{PREFIX}/node-claims/a/v/a1"),
            format!("{PREFIX}/node-settings/a"),
            format!("{PREFIX}/nodes/a"),
            // The key schema's version, written by the first agent.
            format!("{PREFIX}/schema"),
            // The storage index: "ext-v" in hex names volume v.
            format!("{PREFIX}/storage/testplug/6578742d76"),
            format!("{PREFIX}/volumes/v"),
        ]
    );

    n.release_ok("a1");
    assert!(mount_at(&path).is_none(), "{path:?} is still mounted");
    assert!(n.mounts().is_empty(), "{:?}", n.mounts());
    assert_eq!(
        keys(&etcd),
        [
            format!("{PREFIX}/claim-index/a"),
            format!("{PREFIX}/node-settings/a"),
            format!("{PREFIX}/nodes/a"),
            format!("{PREFIX}/schema"),
            format!("{PREFIX}/storage/testplug/6578742d76"),
            format!("{PREFIX}/volumes/v")
        ]
    );
    // The key's contents never reach the log, even at debug level.
    let log = n.agent.log();
    assert!(!log.contains(&pki.client_key_line()), "the key is logged");
    let said = format!(
        "TLS: CA {}, client certificate {}",
        pki.path("ca.pem").display(),
        pki.path("client.pem").display()
    );
    assert!(log.contains(&said), "{log}");
}

// ---- 2. A wrong CA -------------------------------------------------------------------

#[test]
fn a_wrong_ca_is_a_clear_error_and_nothing_is_lost() {
    let dir = TestDir::new();
    let pki = Pki::generate(&dir.path().join("pki"));
    let etcd = Etcd::start_tls(pki.etcd_tls(true));
    let endpoint = etcd.endpoint();
    let a = Node::start(dir.path(), "a", &endpoint, Some(pki.config("ca.pem", true)));
    a.plugin.add_volume("ext-v");
    a.agent
        .register(&volume_json("v", "ext-v", &["multi-node-reader-only"]));
    let a_path = a.mount_ok("a1", "data=v,ro");
    let a_mount = mount_at(&a_path).expect("a's target is mounted");
    wait_until(SHOW_TIMEOUT, "node a's liveness key", || {
        keys(&etcd).contains(&format!("{PREFIX}/nodes/a"))
    });
    let before = stored(&etcd);

    // Node b trusts another CA: etcd's certificate does not verify. The
    // agent starts (the local record needs no etcd) and says why it cannot
    // reach etcd.
    let mut b = Node::prepare(
        dir.path(),
        "b",
        &endpoint,
        Some(pki.config("other-ca.pem", true)),
    );
    b.plugin.add_volume("ext-v");
    b.agent.spawn();
    b.agent.wait_listening();
    let out = b.mount("b1", "data=v,ro", &["--timeout", "5s"]);
    assert_ne!(out.code, EXIT_OK, "{out:?}");
    let st = b.volume_status("b1");
    let said = format!("{}\n{}", out.stderr, st["message"]);
    assert!(
        said.contains("certificate verify failed"),
        "the mount does not say why: {said}"
    );
    eprintln!("wrong CA: {said}");
    assert!(b.mounts().is_empty(), "{:?}", b.mounts());
    assert_eq!(volume_methods(&b.plugin.call_log()), [] as [String; 0]);
    let log = b.agent.log();
    assert!(log.contains("certificate verify failed"), "{log}");
    assert!(!log.contains(&pki.client_key_line()), "the key is logged");
    // Nothing written to etcd, nothing of a's changed.
    assert_eq!(stored(&etcd), before);
    assert_eq!(mount_at(&a_path), Some(a_mount.clone()));

    // With the right CA, b mounts what it asked for (and keeps a copy of
    // the registration).
    b.restart_with_ca(&pki, "ca.pem");
    let b_path = b.mount_ok("b1", "data=v,ro");
    assert!(mount_at(&b_path).is_some());
    assert_eq!(
        claim_keys(&etcd),
        [
            format!("{PREFIX}/claims/v/a1"),
            format!("{PREFIX}/claims/v/b1")
        ]
    );
    b.release_ok("b1");
    assert!(mount_at(&b_path).is_none());

    // The wrong CA again, now with the volume known locally: the mount
    // waits for etcd, saying why, and writes nothing.
    b.restart_with_ca(&pki, "other-ca.pem");
    let before = stored(&etcd);
    let calls = volume_methods(&b.plugin.call_log()).len();
    let out = b.mount("b2", "data=v,ro", &["--timeout", "3s"]);
    assert_ne!(out.code, EXIT_OK, "{out:?}");
    let st = b.volume_status("b2");
    let msg = st["message"].as_str().unwrap_or("").to_string();
    assert_eq!(st["phase"], "claiming", "{st}");
    assert!(
        msg.contains("certificate verify failed") && msg.contains("(retrying)"),
        "{st}"
    );
    assert!(b.mounts().is_empty(), "{:?}", b.mounts());
    assert_eq!(volume_methods(&b.plugin.call_log()).len(), calls);
    assert_eq!(stored(&etcd), before);

    // Nothing lost: with the right CA the waiting mount goes through.
    b.restart_with_ca(&pki, "ca.pem");
    wait_until(SHOW_TIMEOUT, "b2 to be published", || {
        b.volume_status("b2")["phase"] == "published"
    });
    assert!(claim_keys(&etcd).contains(&format!("{PREFIX}/claims/v/b2")));
    assert_eq!(mount_at(&a_path), Some(a_mount));
    b.release_ok("b2");
    a.release_ok("a1");
    assert_eq!(claim_keys(&etcd), [] as [String; 0]);
}

// ---- 3. A client without a certificate -------------------------------------------

#[test]
fn a_client_without_a_certificate_is_refused_when_etcd_asks_for_one() {
    let dir = TestDir::new();
    let pki = Pki::generate(&dir.path().join("pki"));
    let etcd = Etcd::start_tls(pki.etcd_tls(true));

    // The library's own error, with the CA but no certificate.
    let anonymous = EtcdClient::connect(
        &[etcd.endpoint()],
        EtcdOptions {
            call_timeout: Duration::from_secs(2),
            tls: Some(TlsOptions {
                ca: pki.path("ca.pem"),
                identity: None,
            }),
        },
    )
    .expect("valid settings");
    let e = anonymous
        .get(format!("{PREFIX}/x"))
        .expect_err("etcd asks for a client certificate");
    let msg = claimd::error_chain(&e);
    eprintln!("no client certificate: {msg}");
    assert!(names_tls(&msg), "{msg}");

    // An agent configured the same way: its mount fails, saying so.
    let n = Node::start(
        dir.path(),
        "a",
        &etcd.endpoint(),
        Some(pki.config("ca.pem", false)),
    );
    n.plugin.add_volume("ext-v");
    let out = n.mount("a1", "data=v", &["--timeout", "5s"]);
    assert_ne!(out.code, EXIT_OK, "{out:?}");
    let st = n.volume_status("a1");
    let said = format!("{}\n{}", out.stderr, st["message"]);
    assert!(names_tls(&said), "the mount does not say why: {said}");
    assert!(n.mounts().is_empty());
    assert_eq!(keys(&etcd), [] as [String; 0]);

    // Against a member that does not ask for one, the CA alone is enough.
    drop(n);
    let open = Etcd::start_tls(pki.etcd_tls(false));
    let n = Node::start(
        dir.path(),
        "b",
        &open.endpoint(),
        Some(pki.config("ca.pem", false)),
    );
    n.plugin.add_volume("ext-v");
    n.agent
        .register(&volume_json("v", "ext-v", &["single-node-writer"]));
    let path = n.mount_ok("b1", "data=v");
    assert!(mount_at(&path).is_some());
    assert!(keys(&open).contains(&format!("{PREFIX}/claims/v/b1")));
    n.release_ok("b1");
    assert!(mount_at(&path).is_none());
}

// ---- 4. Bad TLS settings stop the agent at start ---------------------------------

#[test]
fn bad_tls_settings_stop_the_agent_naming_the_file_or_field() {
    let dir = TestDir::new();
    let pki = Pki::generate(&dir.path().join("pki"));
    let https = format!("https://127.0.0.1:{}", free_port());
    let http = format!("http://127.0.0.1:{}", free_port());
    let missing = pki.path("missing.key");
    let mut swapped = pki.config("ca.pem", true);
    swapped["key"] = json!(pki.path("client.pem"));
    let mut unpaired = pki.config("ca.pem", false);
    unpaired["cert"] = json!(pki.path("client.pem"));
    let mut no_key = pki.config("ca.pem", true);
    no_key["key"] = json!(missing);
    let missing = missing.display().to_string();
    // (name, endpoint, cluster.tls, exit code, what the log says)
    type Case<'a> = (&'a str, &'a str, Option<Value>, i32, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "missing-key",
            &https,
            Some(no_key),
            EXIT_FAILED,
            vec!["failed to read TLS file", &missing, "No such file"],
        ),
        (
            "swapped",
            &https,
            Some(swapped),
            EXIT_FAILED,
            vec!["is not a PEM private key: it holds a CERTIFICATE"],
        ),
        (
            "https-without-tls",
            &https,
            None,
            EXIT_USAGE,
            vec!["cluster.endpoints[0]", "needs a cluster.tls section"],
        ),
        (
            "http-with-tls",
            &http,
            Some(pki.config("ca.pem", true)),
            EXIT_USAGE,
            vec![
                "cluster.endpoints[0]",
                "is plain TCP but cluster.tls is set",
            ],
        ),
        (
            "cert-without-key",
            &https,
            Some(unpaired),
            EXIT_USAGE,
            vec!["cluster.tls", "cert and key go together"],
        ),
    ];
    for (name, endpoint, tls, code, needles) in cases {
        let mut n = Node::prepare(dir.path(), name, endpoint, tls);
        n.agent.spawn();
        let status = n.agent.wait_exit(EXIT_TIMEOUT);
        let log = n.agent.log();
        assert_eq!(status.code(), Some(code), "{name}: {log}");
        for needle in needles {
            assert!(log.contains(needle), "{name}: {needle:?} not in {log}");
        }
        assert!(
            !log.contains(&pki.client_key_line()),
            "{name}: the key is logged"
        );
    }
}
