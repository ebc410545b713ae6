//! Previews: a port of a sandbox served at `<port>-<sandbox>.<domain>`.
//! The preview as kept, its tokens (MACs of their expiry under the
//! preview's own secret), the host names that name a preview, and where a
//! request carries its token.

use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

/// The header a token may come in.
pub(crate) const TOKEN_HEADER: &str = "x-runtime-preview-token";
/// The query parameter a token may come in (which also sets the cookie).
pub(crate) const TOKEN_PARAM: &str = "runtime_preview_token";
/// The cookie a token may come in.
pub(crate) const COOKIE: &str = "runtime_preview_token";
/// A token lasts a day unless asked otherwise (the docs' default).
pub(crate) const DEFAULT_TTL_S: i64 = 86_400;
pub(crate) const MAX_TTL_S: i64 = 30 * 86_400;

/// A preview as kept (`secret` never leaves the server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Preview {
    pub(crate) id: String,
    pub(crate) port: u16,
    pub(crate) public: bool,
    pub(crate) secret: Vec<u8>,
    /// Whether its tokens are MACs under a key derived from `secret` and
    /// the server's sealing key (`secrets.key`, not in the store), so the
    /// store alone mints none; previews made before that use `secret`
    /// itself until rotated.
    pub(crate) keyed: bool,
    /// The token lifetime asked for at create, and the cap.
    pub(crate) ttl_s: i64,
    pub(crate) expires_cap_ms: Option<i64>,
    pub(crate) embed_origins: Vec<String>,
    pub(crate) created_ms: i64,
}

impl Preview {
    pub(crate) fn to_doc(&self) -> Value {
        json!({
            "id": self.id,
            "port": self.port,
            "public": self.public,
            "secret": hex::encode(&self.secret),
            "keyed": self.keyed,
            "ttlS": self.ttl_s,
            "expiresCapMs": self.expires_cap_ms,
            "embedOrigins": self.embed_origins,
            "createdMs": self.created_ms,
        })
    }

    pub(crate) fn from_doc(v: &Value) -> Option<Preview> {
        Some(Preview {
            id: v["id"].as_str()?.to_string(),
            port: u16::try_from(v["port"].as_u64()?).ok()?,
            public: v["public"].as_bool()?,
            secret: hex::decode(v["secret"].as_str()?).ok()?,
            keyed: v["keyed"].as_bool().unwrap_or(false),
            ttl_s: v["ttlS"].as_i64()?,
            expires_cap_ms: v["expiresCapMs"].as_i64(),
            embed_origins: v["embedOrigins"]
                .as_array()?
                .iter()
                .filter_map(|o| o.as_str().map(String::from))
                .collect(),
            created_ms: v["createdMs"].as_i64()?,
        })
    }

    fn mac(&self, key: &[u8], expiry_s: i64) -> String {
        // Any key length is accepted by HMAC.
        let mut m = match Hmac::<Sha256>::new_from_slice(key) {
            Ok(m) => m,
            Err(_) => return String::new(),
        };
        m.update(format!("{}:{expiry_s}", self.port).as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
    }

    /// A fresh token `<expiry s>.<mac>` under `key` (the preview's MAC
    /// key) and its expiry (ms): `ttl_s` (else
    /// the preview's own) from `now_ms`, no later than the preview's cap or
    /// `cap_ms`.
    pub(crate) fn mint(
        &self,
        key: &[u8],
        ttl_s: Option<i64>,
        cap_ms: Option<i64>,
        now_ms: i64,
    ) -> (String, i64) {
        let mut expiry_ms = now_ms + ttl_s.unwrap_or(self.ttl_s) * 1000;
        for cap in [self.expires_cap_ms, cap_ms].into_iter().flatten() {
            expiry_ms = expiry_ms.min(cap);
        }
        let expiry_s = expiry_ms / 1000;
        (
            format!("{expiry_s}.{}", self.mac(key, expiry_s)),
            expiry_s * 1000,
        )
    }

    /// Whether `token` is one of this preview's (under its MAC key `key`
    /// now) and has not expired at `now_ms`.
    pub(crate) fn check(&self, key: &[u8], token: &str, now_ms: i64) -> bool {
        let Some((exp, mac)) = token.split_once('.') else {
            return false;
        };
        let Ok(expiry_s) = exp.parse::<i64>() else {
            return false;
        };
        // An expiry past the clock's range was never minted.
        if expiry_s.checked_mul(1000).is_none_or(|ms| ms <= now_ms) {
            return false;
        }
        let want = self.mac(key, expiry_s);
        // Constant time over the MAC's bytes.
        want.len() == mac.len()
            && want
                .bytes()
                .zip(mac.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// The preview a `Host` header names: `<port>-<sandbox>.<domain>[:port]`
/// (any case).
pub(crate) fn parse_host(host: &str, domain: &str) -> Option<(u16, String)> {
    let host = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    let label = host
        .to_ascii_lowercase()
        .strip_suffix(&format!(".{}", domain.to_ascii_lowercase()))?
        .to_string();
    let (port, sandbox) = label.split_once('-')?;
    if sandbox.contains('.') || sandbox.is_empty() {
        return None;
    }
    Some((port.parse().ok()?, dashed_uuid(sandbox)))
}

/// A sandbox id written without its dashes (E2B's `get_host` names hosts
/// `<port>-<id without dashes>`) as the id itself; anything else as it is.
fn dashed_uuid(s: &str) -> String {
    if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        format!(
            "{}-{}-{}-{}-{}",
            &s[..8],
            &s[8..12],
            &s[12..16],
            &s[16..20],
            &s[20..]
        )
    } else {
        s.to_string()
    }
}

/// A preview's address: `http(s)://<port>-<sandbox>.<domain>[:<port>]/`,
/// the server's port left out when it is 0 or the scheme's own.
pub(crate) fn base_url(
    tls: bool,
    domain: &str,
    server_port: u16,
    sandbox: &str,
    port: u16,
) -> String {
    let host = format!("{port}-{sandbox}.{domain}");
    let (scheme, default_port) = if tls { ("https", 443) } else { ("http", 80) };
    match server_port {
        0 => format!("{scheme}://{host}/"),
        p if p == default_port => format!("{scheme}://{host}/"),
        p => format!("{scheme}://{host}:{p}/"),
    }
}

/// A port in a path: 1 to 65535.
pub(crate) fn parse_port(s: &str) -> Option<u16> {
    s.parse::<u16>().ok().filter(|p| *p != 0)
}

/// An origin for `embedOrigins`: `http(s)://host[:port]`, the host may
/// start with `*.`.
pub(crate) fn valid_origin(o: &str) -> bool {
    let Some(rest) = o
        .strip_prefix("https://")
        .or_else(|| o.strip_prefix("http://"))
    else {
        return false;
    };
    let (host, port) = match rest.split_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (rest, None),
    };
    let port_ok =
        port.is_none_or(|p| p.bytes().all(|b| b.is_ascii_digit()) && parse_port(p).is_some());
    let host = host.strip_prefix("*.").unwrap_or(host);
    port_ok
        && !host.is_empty()
        && !rest.contains('/')
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// The token in a query string, if it has one.
pub(crate) fn token_in_query(query: &str) -> Option<&str> {
    query
        .split('&')
        .find_map(|part| part.strip_prefix(TOKEN_PARAM)?.strip_prefix('='))
}

/// The token among `Cookie` header values, if one carries it.
pub(crate) fn token_in_cookies<'a>(headers: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    headers
        .into_iter()
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// The cookies of `Cookie` header values but the token's, as one header
/// value; `None` when none are left.
pub(crate) fn cookies_without_token<'a>(
    headers: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let kept: Vec<&str> = headers
        .into_iter()
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !is_param(c, COOKIE))
        .collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// `path?query` with the token's parameter (and empty parts) left out.
pub(crate) fn without_token(path: &str, query: Option<&str>) -> String {
    let kept: Vec<&str> = query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty() && !is_param(p, TOKEN_PARAM))
        .collect();
    if kept.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

fn is_param(part: &str, name: &str) -> bool {
    part.strip_prefix(name).is_some_and(|r| r.starts_with('='))
}

/// A guest's `Set-Cookie` value made host-only: its `Domain` attributes
/// are dropped, so a preview cannot set cookies for its sibling previews or
/// for the API's host, which share the preview domain. Everything else of
/// the cookie stays as the guest wrote it.
pub(crate) fn host_only_cookie(value: &str) -> String {
    let mut parts = value.split(';');
    let mut out = parts.next().unwrap_or_default().to_string();
    for attr in parts {
        let name = attr.split('=').next().unwrap_or_default().trim();
        if !name.eq_ignore_ascii_case("domain") {
            out.push(';');
            out.push_str(attr);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preview(secret: &[u8]) -> Preview {
        Preview {
            id: "prv_1".into(),
            port: 8080,
            public: false,
            secret: secret.to_vec(),
            keyed: true,
            ttl_s: DEFAULT_TTL_S,
            expires_cap_ms: None,
            embed_origins: vec!["https://a.example.com".into()],
            created_ms: 1_000,
        }
    }

    const NOW: i64 = 1_700_000_000_000;

    #[test]
    fn a_token_is_good_until_it_expires_and_only_under_its_secret() {
        let p = preview(b"one");
        let (t, exp) = p.mint(&p.secret, Some(60), None, NOW);
        assert_eq!(exp, NOW + 60_000);
        assert!(t.starts_with(&format!("{}.", (NOW + 60_000) / 1000)));
        assert!(p.check(&p.secret, &t, NOW));
        assert!(p.check(&p.secret, &t, exp - 1));
        assert!(!p.check(&p.secret, &t, exp));
        assert!(!preview(b"two").check(b"two", &t, NOW));
        let other_port = Preview {
            port: 8081,
            ..p.clone()
        };
        assert!(!other_port.check(&other_port.secret, &t, NOW));
    }

    #[test]
    fn a_changed_expiry_or_mac_is_refused() {
        let p = preview(b"one");
        let (t, _) = p.mint(&p.secret, None, None, NOW);
        let (exp, mac) = t.split_once('.').unwrap_or_default();
        let later: i64 = exp.parse::<i64>().unwrap_or_default() + 1;
        assert!(!p.check(&p.secret, &format!("{later}.{mac}"), NOW));
        assert!(!p.check(&p.secret, &format!("{exp}.{mac}x"), NOW));
        assert!(!p.check(&p.secret, &format!("{exp}."), NOW));
        assert!(!p.check(&p.secret, exp, NOW));
        assert!(!p.check(&p.secret, "x.y", NOW));
        assert!(!p.check(&p.secret, "", NOW));
    }

    #[test]
    fn a_token_with_an_expiry_past_the_clocks_range_is_refused() {
        let p = preview(b"one");
        let (t, _) = p.mint(&p.secret, None, None, NOW);
        let (_, mac) = t.split_once('.').unwrap_or_default();
        for exp in [i64::MAX, i64::MAX / 999, i64::MIN] {
            assert!(!p.check(&p.secret, &format!("{exp}.{mac}"), NOW), "{exp}");
            assert!(
                !p.check(&p.secret, &format!("{exp}.{}", p.mac(&p.secret, exp)), NOW),
                "{exp}"
            );
        }
    }

    #[test]
    fn tokens_last_a_day_or_as_asked_and_no_later_than_either_cap() {
        let p = preview(b"one");
        assert_eq!(p.mint(&p.secret, None, None, NOW).1, NOW + 86_400_000);
        assert_eq!(
            p.mint(&p.secret, None, Some(NOW + 5_000), NOW).1,
            NOW + 5_000
        );
        let capped = Preview {
            expires_cap_ms: Some(NOW + 7_000),
            ttl_s: 120,
            ..p
        };
        assert_eq!(capped.mint(&capped.secret, None, None, NOW).1, NOW + 7_000);
        assert_eq!(
            capped.mint(&capped.secret, Some(3), None, NOW).1,
            NOW + 3_000
        );
        assert_eq!(
            capped.mint(&capped.secret, None, Some(NOW + 9_000), NOW).1,
            NOW + 7_000
        );
        // Expiries are whole seconds.
        assert_eq!(
            capped.mint(&capped.secret, Some(3), None, NOW + 999).1,
            NOW + 3_000
        );
    }

    #[test]
    fn a_preview_is_kept_as_its_record() {
        let p = preview(&[1, 2, 255]);
        let doc = p.to_doc();
        assert_eq!(doc["secret"], "0102ff");
        assert_eq!(doc["expiresCapMs"], Value::Null);
        assert_eq!(doc["keyed"], true);
        assert_eq!(Preview::from_doc(&doc), Some(p.clone()));
        assert_eq!(Preview::from_doc(&json!({"id": "x"})), None);
        // A preview kept before keyed MACs reads as not keyed.
        let mut old = doc.clone();
        old.as_object_mut().unwrap().remove("keyed");
        assert_eq!(Preview::from_doc(&old), Some(Preview { keyed: false, ..p }));
    }

    #[test]
    fn host_names_name_a_port_and_a_sandbox() {
        let d = "preview.example.com";
        assert_eq!(
            parse_host("8080-abc.preview.example.com", d),
            Some((8080, "abc".into()))
        );
        assert_eq!(
            parse_host("3000-ABC-def.Preview.Example.com:8443", d),
            Some((3000, "abc-def".into()))
        );
        assert_eq!(
            parse_host(
                "3000-7f3a2c1058d44b9e9c610a2b3c4d5e6f.preview.example.com",
                d
            ),
            Some((3000, "7f3a2c10-58d4-4b9e-9c61-0a2b3c4d5e6f".into()))
        );
        assert_eq!(parse_host("preview.example.com", d), None);
        assert_eq!(parse_host("api.example.com", d), None);
        assert_eq!(parse_host("x-abc.preview.example.com", d), None);
        assert_eq!(parse_host("70000-abc.preview.example.com", d), None);
        assert_eq!(parse_host("80-a.b.preview.example.com", d), None);
        assert_eq!(parse_host("80-.preview.example.com", d), None);
        assert_eq!(parse_host("localhost:8080", "localhost"), None);
        assert_eq!(
            parse_host("8080-abc.localhost:1", "localhost"),
            Some((8080, "abc".into()))
        );
    }

    #[test]
    fn urls_leave_out_the_schemes_own_port() {
        assert_eq!(
            base_url(false, "localhost", 0, "s", 80),
            "http://80-s.localhost/"
        );
        assert_eq!(
            base_url(false, "localhost", 80, "s", 3000),
            "http://3000-s.localhost/"
        );
        assert_eq!(
            base_url(false, "localhost", 8443, "s", 3000),
            "http://3000-s.localhost:8443/"
        );
        assert_eq!(base_url(true, "p.io", 443, "s", 1), "https://1-s.p.io/");
        assert_eq!(base_url(true, "p.io", 80, "s", 1), "https://1-s.p.io:80/");
    }

    #[test]
    fn ports_and_origins() {
        assert_eq!(parse_port("8080"), Some(8080));
        assert_eq!(parse_port("0"), None);
        assert_eq!(parse_port("65536"), None);
        assert_eq!(parse_port("x"), None);
        assert!(valid_origin("https://app.example.com"));
        assert!(valid_origin("http://localhost:3000"));
        assert!(valid_origin("https://*.example.com"));
        assert!(!valid_origin("ftp://a.com"));
        assert!(!valid_origin("https://a.com/path"));
        assert!(!valid_origin("https://"));
        assert!(!valid_origin("https://a b.com"));
    }

    #[test]
    fn an_origins_port_is_a_port_number() {
        assert!(valid_origin("https://a.example.com:8443"));
        assert!(valid_origin("https://*.example.com:65535"));
        for bad in [
            "https://a.com:abc",
            "https://a.com:",
            "https://a.com:0",
            "https://a.com:65536",
            "https://a.com:80:81",
            "https://a.com:+80",
        ] {
            assert!(!valid_origin(bad), "{bad} passed");
        }
    }

    #[test]
    fn the_token_is_found_and_scrubbed_wherever_it_comes() {
        assert_eq!(
            token_in_query("a=1&runtime_preview_token=t1&b=2"),
            Some("t1")
        );
        assert_eq!(token_in_query("a=1"), None);
        assert_eq!(token_in_query("runtime_preview_tokenx=1"), None);
        assert_eq!(
            token_in_cookies(["a=1; runtime_preview_token=t2", "c=3"]),
            Some("t2")
        );
        assert_eq!(token_in_cookies(["a=1"]), None);
        assert_eq!(
            cookies_without_token(["a=1; runtime_preview_token=t2", "c=3"]).as_deref(),
            Some("a=1; c=3")
        );
        assert_eq!(cookies_without_token(["runtime_preview_token=t2"]), None);
        assert_eq!(
            without_token("/p", Some("a=1&runtime_preview_token=t1&&b=2")),
            "/p?a=1&b=2"
        );
        assert_eq!(without_token("/p", Some("runtime_preview_token=t1")), "/p");
        assert_eq!(without_token("/", None), "/");
    }

    #[test]
    fn guest_cookies_lose_their_domain_and_keep_the_rest() {
        assert_eq!(
            host_only_cookie("sid=1; Domain=.localhost; Path=/; HttpOnly"),
            "sid=1; Path=/; HttpOnly"
        );
        assert_eq!(
            host_only_cookie("a=b;domain=example.com;DOMAIN = x;Secure"),
            "a=b;Secure"
        );
        // A value with `domain` in it is not an attribute.
        assert_eq!(host_only_cookie("domain=x; Path=/"), "domain=x; Path=/");
        assert_eq!(host_only_cookie("plain=1"), "plain=1");
    }
}
