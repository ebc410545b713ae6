//! Secrets a sandbox uses without holding them: placeholders, which requests
//! get the value, and the substitution itself.

use std::fmt;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Uri};
use rand::RngCore;

use crate::rules::name_matches;

/// A secret's value. It cannot be printed: `Debug` shows `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the request that carries it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<String> for SecretValue {
    fn from(s: String) -> Self {
        Self(s)
    }
}

/// Which requests may carry a secret: any of `methods` (empty = every
/// method) and any of `paths` (exact, or a prefix ending in `/*`; empty =
/// every path).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SecretRule {
    pub methods: Vec<String>,
    pub paths: Vec<String>,
}

/// A secret visible to a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Secret {
    pub name: String,
    pub value: SecretValue,
    /// Names or `*.domain` patterns the value may go to.
    pub hosts: Vec<String>,
    /// When set, this header is set on every matching request.
    pub header: Option<String>,
    /// The header's value, with `{value}` standing for the secret's value;
    /// `"{value}"` when absent.
    pub format: Option<String>,
    /// No rules: every request to the hosts.
    pub rules: Vec<SecretRule>,
    /// What the sandbox holds instead of the value ([`make_placeholder`]).
    pub placeholder: String,
}

/// Prefix of every placeholder.
pub const PLACEHOLDER_PREFIX: &str = "rtsec_";

/// A new placeholder: `rtsec_` and 32 random hex digits (128 bits from the
/// operating system's generator), unguessable and safe in URLs and headers.
pub fn make_placeholder() -> String {
    let mut bytes = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("{PLACEHOLDER_PREFIX}{}", hex::encode(bytes))
}

impl Secret {
    /// Whether requests to `host` (lowercase, no trailing dot) may carry it.
    pub fn covers(&self, host: &str) -> bool {
        self.hosts.iter().any(|p| name_matches(p, host))
    }

    /// Whether this request may carry the value (the host already matched).
    fn admits(&self, method: &str, path: Option<&str>) -> bool {
        if self.rules.is_empty() {
            return true;
        }
        // A path that could be read two ways gets no secret that has rules.
        let Some(path) = path else { return false };
        self.rules.iter().any(|r| {
            (r.methods.is_empty() || r.methods.iter().any(|m| m.eq_ignore_ascii_case(method)))
                && (r.paths.is_empty() || r.paths.iter().any(|p| path_matches(p, path)))
        })
    }
}

fn path_matches(pattern: &str, path: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) if prefix.ends_with('/') => path.starts_with(prefix),
        _ => pattern == path,
    }
}

/// The path as rules see it: `.` and `..` removed, escaped letters and digits
/// decoded. `None` when it could be read two ways (an encoded slash or
/// backslash, a backslash, a semicolon, another escape of a reserved byte,
/// or a malformed escape).
pub(crate) fn normalize_path(raw: &str) -> Option<String> {
    if raw.contains(';') || raw.contains('\\') {
        return None;
    }
    let bytes = raw.as_bytes();
    let mut decoded = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = raw.get(i + 1..i + 3)?;
            let v = u8::from_str_radix(hex, 16).ok()?;
            if v.is_ascii_alphanumeric() || matches!(v, b'-' | b'.' | b'_' | b'~') {
                decoded.push(char::from(v));
            } else {
                // An escaped slash or another reserved byte changes meaning
                // from one server to the next.
                return None;
            }
            i += 3;
        } else {
            decoded.push(char::from(b));
            i += 1;
        }
    }
    if !decoded.starts_with('/') {
        return None;
    }
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = decoded[1..].split('/').collect();
    let last = segments.len().saturating_sub(1);
    let mut trailing = false;
    for (i, seg) in segments.iter().enumerate() {
        match *seg {
            "." => trailing = i == last,
            ".." => {
                out.pop();
                trailing = i == last;
            }
            s => {
                out.push(s);
                trailing = false;
            }
        }
    }
    let mut path = format!("/{}", out.join("/"));
    if trailing && !path.ends_with('/') {
        path.push('/');
    }
    Some(path)
}

/// What substitution did to one request; counts only, never values.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Applied {
    pub names: Vec<String>,
}

/// Puts the values of the secrets that cover `host` and admit this request
/// into its URL (path and query) and header values, and sets their headers.
/// Other secrets' placeholders stay as they are.
pub(crate) fn substitute(
    secrets: &[Secret],
    host: &str,
    method: &str,
    uri: &mut Uri,
    headers: &mut HeaderMap,
) -> Applied {
    let mut applied = Applied::default();
    let path = normalize_path(uri.path());
    for secret in secrets {
        if !secret.covers(host) || !secret.admits(method, path.as_deref()) {
            continue;
        }
        let mut used = false;
        if secret.placeholder.len() >= PLACEHOLDER_PREFIX.len() + 16 {
            used |= replace_in_uri(uri, &secret.placeholder, secret.value.expose());
            used |= replace_in_headers(headers, &secret.placeholder, secret.value.expose());
        }
        if let Some(header) = &secret.header {
            let format = secret.format.as_deref().unwrap_or("{value}");
            let value = format.replace("{value}", secret.value.expose());
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(header.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                headers.remove(&name);
                headers.insert(name, value);
                used = true;
            }
        }
        if used {
            applied.names.push(secret.name.clone());
        }
    }
    applied
}

fn replace_in_uri(uri: &mut Uri, placeholder: &str, value: &str) -> bool {
    let Some(pq) = uri.path_and_query() else {
        return false;
    };
    if !pq.as_str().contains(placeholder) {
        return false;
    }
    let replaced = pq.as_str().replace(placeholder, &uri_escape(value));
    let mut parts = uri.clone().into_parts();
    match replaced.parse() {
        Ok(pq) => parts.path_and_query = Some(pq),
        Err(_) => return false,
    }
    match Uri::from_parts(parts) {
        Ok(new) => {
            *uri = new;
            true
        }
        Err(_) => false,
    }
}

/// Escapes the bytes a URI cannot hold; everything else goes as it is.
fn uri_escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b);
        if keep {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn replace_in_headers(headers: &mut HeaderMap, placeholder: &str, value: &str) -> bool {
    let needle = placeholder.as_bytes();
    let mut used = false;
    for (_, v) in headers.iter_mut() {
        let bytes = v.as_bytes();
        if !bytes.windows(needle.len()).any(|w| w == needle) {
            continue;
        }
        let Ok(s) = std::str::from_utf8(bytes) else {
            continue;
        };
        if let Ok(new) = HeaderValue::from_str(&s.replace(placeholder, value)) {
            *v = new;
            used = true;
        }
    }
    used
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_unique_and_shaped() {
        let a = make_placeholder();
        let b = make_placeholder();
        assert_ne!(a, b);
        assert!(a.starts_with("rtsec_"));
        assert_eq!(a.len(), 6 + 32);
        assert!(a[6..].bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn value_is_never_printed() {
        let s = Secret {
            name: "K".into(),
            value: SecretValue::new("hunter2"),
            hosts: vec![],
            header: None,
            format: None,
            rules: vec![],
            placeholder: make_placeholder(),
        };
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn paths_are_normalised_or_refused() {
        assert_eq!(
            normalize_path("/repos/acme/%2e%2e/admin").as_deref(),
            Some("/repos/admin")
        );
        assert_eq!(normalize_path("/a/./b/../c").as_deref(), Some("/a/c"));
        assert_eq!(normalize_path("/%61pi/v1").as_deref(), Some("/api/v1"));
        assert_eq!(normalize_path("/a/b/..").as_deref(), Some("/a/"));
        assert_eq!(normalize_path("/a%2fb"), None);
        assert_eq!(normalize_path("/a;b"), None);
        assert_eq!(normalize_path("/a\\b"), None);
        assert_eq!(normalize_path("/a%zz"), None);
        assert!(path_matches("/repos/acme/*", "/repos/acme/x/y"));
        assert!(!path_matches("/repos/acme/*", "/repos/acmex"));
        assert!(path_matches("/v1/chat", "/v1/chat"));
        assert!(!path_matches("/v1/chat", "/v1/chat/x"));
    }

    #[test]
    fn substitution_by_rule() {
        let ph = make_placeholder();
        let secret = Secret {
            name: "GH".into(),
            value: SecretValue::new("real value&x"),
            hosts: vec!["api.example.com".into()],
            header: None,
            format: None,
            rules: vec![SecretRule {
                methods: vec!["GET".into()],
                paths: vec!["/repos/acme/*".into()],
            }],
            placeholder: ph.clone(),
        };
        let mut headers = HeaderMap::new();
        headers.insert("x-key", HeaderValue::from_str(&format!("k {ph}")).unwrap());
        let mut uri: Uri = format!("/repos/acme/x?t={ph}").parse().unwrap();
        let applied = substitute(
            std::slice::from_ref(&secret),
            "api.example.com",
            "GET",
            &mut uri,
            &mut headers,
        );
        assert_eq!(applied.names, vec!["GH".to_string()]);
        assert_eq!(uri.to_string(), "/repos/acme/x?t=real%20value&x");
        assert_eq!(headers["x-key"], "k real value&x");

        for (host, method, path) in [
            ("other.example.com", "GET", "/repos/acme/x"),
            ("api.example.com", "POST", "/repos/acme/x"),
            ("api.example.com", "GET", "/repos/other/x"),
            ("api.example.com", "GET", "/repos/acme/%2e%2e/other/x"),
            ("api.example.com", "GET", "/repos/acme%2fx"),
        ] {
            let mut uri: Uri = format!("{path}?t={ph}").parse().unwrap();
            let mut headers = HeaderMap::new();
            let applied = substitute(
                std::slice::from_ref(&secret),
                host,
                method,
                &mut uri,
                &mut headers,
            );
            assert!(applied.names.is_empty(), "{host} {method} {path}");
            assert!(uri.to_string().contains(&ph));
        }
    }
}
