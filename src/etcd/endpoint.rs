//! Endpoint strings as etcdctl and etcd's own flags write them.

use super::EtcdError;

/// The scheme an endpoint was written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
    /// `host:port`: TLS follows the client's settings.
    Unspecified,
}

/// `[http://|https://]host:port[/]` -> (`host:port`, scheme). The host is a
/// name, an IPv4 address or a bracketed IPv6 address.
pub fn parse_endpoint(given: &str) -> Result<(String, Scheme), EtcdError> {
    let bad = |reason| EtcdError::BadEndpoint {
        endpoint: given.to_string(),
        reason,
    };
    let s = given.trim();
    if s.is_empty() {
        return Err(bad("it is empty"));
    }
    let (scheme, rest) = if let Some(r) = s.strip_prefix("http://") {
        (Scheme::Http, r)
    } else if let Some(r) = s.strip_prefix("https://") {
        (Scheme::Https, r)
    } else if s.contains("://") {
        return Err(bad("the scheme must be http:// or https://"));
    } else {
        (Scheme::Unspecified, s)
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err(bad("an endpoint has no path"));
    }
    if rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("it contains white space"));
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| bad("an IPv6 address lacks its closing bracket"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| bad("it has no port (host:port)"))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad("the bracketed host is not an IPv6 address"));
        }
        (format!("[{host}]"), port)
    } else {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| bad("it has no port (host:port)"))?;
        if host.contains(':') {
            return Err(bad("an IPv6 address must be in brackets: [::1]:2379"));
        }
        (host.to_string(), port)
    };
    if host.is_empty() {
        return Err(bad("it has no host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(bad("the port is not a number from 1 to 65535")),
    }
    Ok((format!("{host}:{port}"), scheme))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_what_etcdctl_accepts() {
        for (given, addr, scheme) in [
            ("127.0.0.1:2379", "127.0.0.1:2379", Scheme::Unspecified),
            ("http://127.0.0.1:2379", "127.0.0.1:2379", Scheme::Http),
            (
                "https://etcd-0.example:2379/",
                "etcd-0.example:2379",
                Scheme::Https,
            ),
            ("[::1]:2379", "[::1]:2379", Scheme::Unspecified),
            (" localhost:1 ", "localhost:1", Scheme::Unspecified),
        ] {
            assert_eq!(
                parse_endpoint(given).expect(given),
                (addr.to_string(), scheme)
            );
        }
    }

    #[test]
    fn refuses_garbage_with_a_reason() {
        for (given, reason) in [
            ("", "it is empty"),
            (
                "unix:///run/etcd.sock",
                "the scheme must be http:// or https://",
            ),
            ("127.0.0.1", "it has no port (host:port)"),
            ("127.0.0.1:http", "the port is not a number from 1 to 65535"),
            ("127.0.0.1:0", "the port is not a number from 1 to 65535"),
            (
                "127.0.0.1:99999",
                "the port is not a number from 1 to 65535",
            ),
            (":2379", "it has no host"),
            (
                "::1:2379",
                "an IPv6 address must be in brackets: [::1]:2379",
            ),
            ("[::1:2379", "an IPv6 address lacks its closing bracket"),
            ("http://h:1/v3", "an endpoint has no path"),
            ("h :1", "it contains white space"),
        ] {
            match parse_endpoint(given) {
                Err(EtcdError::BadEndpoint { reason: r, .. }) => assert_eq!(r, reason, "{given}"),
                other => panic!("{given}: {other:?}"),
            }
        }
    }
}
