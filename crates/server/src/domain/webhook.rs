//! Webhooks (docs/api.md#webhooks): the signature, the retry schedule,
//! where a webhook may point, and their limits.

use std::net::IpAddr;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Webhooks a key may have.
pub(crate) const MAX_WEBHOOKS: usize = 16;
/// Deliveries waiting to be sent per key; past it a new one is recorded
/// as failed at once (`pending_limit`) rather than queued.
pub(crate) const MAX_PENDING: i64 = 1000;
pub(crate) const MAX_URL: usize = 2048;
pub(crate) const MAX_DESCRIPTION: usize = 256;
/// How long the previous secret keeps signing after a rotation, by default
/// and at most.
pub(crate) const KEEP_PREVIOUS_DEFAULT_S: i64 = 24 * 3600;
pub(crate) const KEEP_PREVIOUS_MAX_S: i64 = 7 * 24 * 3600;
/// Secrets signing at once: the current one and up to two previous.
pub(crate) const MAX_LIVE_SECRETS: usize = 3;
/// Each attempt's wait for the whole answer.
pub(crate) const TIMEOUT_S: u64 = 10;

/// The waits before each retry, in seconds, as the product documents them:
/// ten attempts in about three days.
pub(crate) const RETRY_DELAYS_S: [i64; 9] = [
    60,
    300,
    900,
    3600,
    3 * 3600,
    6 * 3600,
    12 * 3600,
    86400,
    86400,
];
#[cfg(test)]
pub(crate) const MAX_ATTEMPTS: u32 = RETRY_DELAYS_S.len() as u32 + 1;

/// After `attempts` failed attempts, how long until the next one (each
/// second of the schedule lasting `second_ms`), or `None` when that was the
/// last.
pub(crate) fn retry_delay_ms(attempts: u32, second_ms: i64) -> Option<i64> {
    let i = usize::try_from(attempts.checked_sub(1)?).ok()?;
    RETRY_DELAYS_S.get(i).map(|s| s.saturating_mul(second_ms))
}

/// The hex HMAC-SHA256 of `{t}.{body}` keyed with `secret`: what
/// `withruntime.verify_webhook` checks.
pub(crate) fn sign(secret: &str, t: i64, body: &[u8]) -> String {
    // HMAC takes a key of any length.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

/// `Runtime-Signature`: `t=<unix seconds>`, then one `v1=` per live secret.
pub(crate) fn signature_header<S: AsRef<str>>(t: i64, body: &[u8], secrets: &[S]) -> String {
    let mut h = format!("t={t}");
    for s in secrets {
        h.push_str(",v1=");
        h.push_str(&sign(s.as_ref(), t, body));
    }
    h
}

/// A new signing secret: `whsec_` and 32 random bytes, base64url.
pub(crate) fn new_secret() -> String {
    crate::domain::access::random_token("whsec_")
}

/// A host the operator lets webhooks reach over plain HTTP and at private
/// addresses (`--webhook-allow-host HOST[:PORT]`); no port: any port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowHost {
    pub host: String,
    pub port: Option<u16>,
}

impl AllowHost {
    /// Parses `HOST`, `HOST:PORT`, `[V6]` or `[V6]:PORT`.
    pub fn parse(s: &str) -> Option<AllowHost> {
        let (host, port) = split_host_port(s.trim())?;
        let host = normal_host(host);
        if host.is_empty() {
            return None;
        }
        Some(AllowHost { host, port })
    }
}

/// A webhook URL, parsed: where a delivery connects and what it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub https: bool,
    /// Lowercase, without brackets or a trailing dot.
    pub host: String,
    pub port: u16,
    /// The path and query, `/` at least.
    pub path: String,
    /// The operator allows this host and port: plain HTTP and private
    /// addresses are fine.
    pub allowed: bool,
}

impl Target {
    /// Whether a delivery may connect to `ip`, which the host resolved to.
    pub(crate) fn may_connect(&self, ip: IpAddr) -> bool {
        self.allowed || !runtime_egress::is_internal(ip)
    }

    /// The `Host` header.
    pub(crate) fn authority(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let default = if self.https { 443 } else { 80 };
        if self.port == default {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

fn normal_host(h: &str) -> String {
    h.trim_end_matches('.').to_ascii_lowercase()
}

/// `host[:port]` with IPv6 in brackets; `None` when malformed.
fn split_host_port(s: &str) -> Option<(&str, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        host.parse::<std::net::Ipv6Addr>().ok()?;
        return match after {
            "" => Some((host, None)),
            p => Some((host, Some(p.strip_prefix(':')?.parse().ok()?))),
        };
    }
    match s.split_once(':') {
        Some((h, p)) => Some((h, Some(p.parse().ok()?))),
        None => Some((s, None)),
    }
}

fn valid_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// Names that are never public: loopback, one-label and local names.
fn local_name(h: &str) -> bool {
    !h.contains('.')
        || h == "localhost"
        || [
            ".localhost",
            ".local",
            ".internal",
            ".localdomain",
            ".home.arpa",
        ]
        .iter()
        .any(|s| h.ends_with(s))
}

/// Checks a webhook URL: HTTPS to a public name or address, unless the
/// operator allows its host. The refusal says why.
pub(crate) fn check_url(url: &str, allow: &[AllowHost]) -> Result<Target, String> {
    if url.len() > MAX_URL {
        return Err(format!("must be at most {MAX_URL} characters"));
    }
    if url.bytes().any(|b| b <= b' ' || b == 0x7f) || !url.is_ascii() {
        return Err("must be an ASCII URL without spaces".into());
    }
    let lower = url.to_ascii_lowercase();
    let (https, rest) = if lower.starts_with("https://") {
        (true, &url["https://".len()..])
    } else if lower.starts_with("http://") {
        (false, &url["http://".len()..])
    } else {
        return Err("must be an https:// URL".into());
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if authority.contains('@') {
        return Err("must not carry a user name or password".into());
    }
    let Some((host, port)) = split_host_port(authority) else {
        return Err("has a malformed host or port".into());
    };
    let host = normal_host(host);
    let ip = host.parse::<IpAddr>().ok();
    if ip.is_none() && !valid_name(&host) {
        return Err("has a malformed host".into());
    }
    let port = match port {
        Some(0) => return Err("has port 0".into()),
        Some(p) => p,
        None if https => 443,
        None => 80,
    };
    let allowed = allow
        .iter()
        .any(|a| a.host == host && a.port.is_none_or(|p| p == port));
    if !https && !allowed {
        return Err(
            "must be an https:// URL (plain http only for hosts the operator allows)".into(),
        );
    }
    if !allowed {
        let private = match ip {
            Some(ip) => runtime_egress::is_internal(ip),
            None => local_name(&host),
        };
        if private {
            return Err(
                "must name a public host: loopback, private and link-local addresses are refused"
                    .into(),
            );
        }
    }
    let tail = tail.split('#').next().unwrap_or("");
    let path = if tail.starts_with('/') {
        tail.to_string()
    } else {
        format!("/{tail}")
    };
    Ok(Target {
        https,
        host,
        port,
        path,
        allowed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = br#"{"id":"e1","type":"webhook.test"}"#;

    #[test]
    fn the_signature_is_the_hmac_python_computes() {
        // python3 -c 'import hmac,hashlib; print(hmac.new(b"whsec_test",
        //   b"1758650000.{\"id\":\"e1\",\"type\":\"webhook.test\"}",
        //   hashlib.sha256).hexdigest())'
        assert_eq!(
            sign("whsec_test", 1758650000, BODY),
            "b7343ef2e47bcae66dc76390a9b28d3674cd4ff349464d99f2297c84e70b540f"
        );
        // The same with the key b"old".
        assert_eq!(
            signature_header(1758650000, BODY, &["whsec_test", "old"]),
            "t=1758650000,\
             v1=b7343ef2e47bcae66dc76390a9b28d3674cd4ff349464d99f2297c84e70b540f,\
             v1=8b2571f3a4709ad451e5c1e8a1ecbd72cdec9d16c6b5277b3f08f7d9e8fb9d1d"
        );
        assert_ne!(
            sign("whsec_test", 1758650001, BODY),
            sign("whsec_test", 1758650000, BODY)
        );
    }

    #[test]
    fn secrets_are_new_each_time() {
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        assert!(a.starts_with("whsec_") && a.len() == 6 + 43, "{a}");
    }

    #[test]
    fn retries_follow_the_documented_schedule_then_stop() {
        let waits: Vec<i64> = (1..=MAX_ATTEMPTS)
            .map_while(|n| retry_delay_ms(n, 1000))
            .collect();
        assert_eq!(
            waits,
            [60, 300, 900, 3600, 10800, 21600, 43200, 86400, 86400].map(|s| s * 1000)
        );
        assert_eq!(MAX_ATTEMPTS, 10);
        assert_eq!(retry_delay_ms(MAX_ATTEMPTS, 1000), None);
        assert_eq!(retry_delay_ms(0, 1000), None);
        // About three days in all.
        let total: i64 = waits.iter().sum();
        assert!((2 * 86400 * 1000..4 * 86400 * 1000).contains(&total));
        // A test's schedule: a second lasts 10 ms.
        assert_eq!(retry_delay_ms(1, 10), Some(600));
    }

    #[test]
    fn urls_must_be_https_to_public_hosts() {
        let t = check_url("https://Example.com./hooks?x=1#frag", &[]).unwrap();
        assert_eq!(
            (t.https, t.host.as_str(), t.port, t.path.as_str(), t.allowed),
            (true, "example.com", 443, "/hooks?x=1", false)
        );
        assert_eq!(t.authority(), "example.com");
        let t = check_url("https://example.com:8443", &[]).unwrap();
        assert_eq!((t.port, t.path.as_str()), (8443, "/"));
        assert_eq!(t.authority(), "example.com:8443");
        for bad in [
            "http://example.com/h",
            "ftp://example.com",
            "example.com",
            "",
            "https://user:pw@example.com/",
            "https://127.0.0.1/",
            "https://10.1.2.3/",
            "https://169.254.169.254/latest/meta-data",
            "https://[::1]/",
            "https://[::ffff:127.0.0.1]/",
            "https://localhost/",
            "https://metadata/",
            "https://svc.internal/",
            "https://exa mple.com/",
            "https://example.com:0/",
            "https://example.com:99999/",
            "https://-bad-.com/",
        ] {
            assert!(check_url(bad, &[]).is_err(), "{bad}");
        }
        assert!(check_url(&format!("https://example.com/{}", "a".repeat(MAX_URL)), &[]).is_err());
    }

    #[test]
    fn the_operator_may_allow_a_host_and_port() {
        let allow = vec![
            AllowHost::parse("127.0.0.1").unwrap(),
            AllowHost::parse("Hooks.Lan:8080").unwrap(),
            AllowHost::parse("[::1]:9000").unwrap(),
        ];
        let t = check_url("http://127.0.0.1:5000/x", &allow).unwrap();
        assert!(t.allowed && !t.https);
        assert!(t.may_connect("127.0.0.1".parse().unwrap()));
        assert!(check_url("http://hooks.lan:8080/", &allow).unwrap().allowed);
        assert!(check_url("http://hooks.lan:8081/", &allow).is_err());
        assert!(check_url("http://[::1]:9000/", &allow).unwrap().allowed);
        assert!(check_url("http://[::1]:9001/", &allow).is_err());
        assert!(check_url("http://10.0.0.1/", &allow).is_err());
        assert_eq!(AllowHost::parse("h:x"), None);
        assert_eq!(AllowHost::parse(""), None);
    }

    #[test]
    fn delivery_refuses_a_public_name_that_resolves_inside() {
        let t = check_url("https://example.com/", &[]).unwrap();
        assert!(t.may_connect("93.184.215.14".parse().unwrap()));
        for ip in ["127.0.0.1", "10.0.0.5", "169.254.169.254", "::1", "fd00::1"] {
            assert!(!t.may_connect(ip.parse().unwrap()), "{ip}");
        }
    }
}
