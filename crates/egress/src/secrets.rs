//! Secrets a sandbox uses without holding them: placeholders, which requests
//! get the value, and the substitution itself.

use std::fmt;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
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

/// What substitution did to one request: the secrets' names, and what the
/// answer must be scrubbed of. `Debug` shows only the names.
#[derive(Default, Clone, PartialEq, Eq)]
pub(crate) struct Applied {
    pub names: Vec<String>,
    /// Every form in which a value left in this request: as it is, escaped
    /// for a URL, and inside a `Basic` credential.
    pub needles: Vec<Vec<u8>>,
}

impl fmt::Debug for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Applied")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl Applied {
    fn add_needle(&mut self, needle: impl Into<Vec<u8>>) {
        let needle = needle.into();
        if !needle.is_empty() && !self.needles.contains(&needle) {
            self.needles.push(needle);
        }
    }

    /// The value itself and the escaped forms a host may echo it in.
    fn add_value(&mut self, value: &str) {
        self.add_needle(value.as_bytes());
        self.add_needle(query_escape(value, false));
        self.add_needle(query_escape(value, true));
    }
}

/// Whether a header carries credentials, by its name: only these get a
/// secret's value, so a header the host echoes back (`X-Request-Note`, a
/// path quoted in an error) never holds it.
pub(crate) fn is_credential_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["key", "token", "auth", "secret", "signature"]
        .iter()
        .any(|word| name.contains(word))
}

/// Puts the values of the secrets that cover `host` and admit this request
/// where the secret says: a secret with `header` sets that header (to
/// `format`) and goes nowhere else; one without replaces its placeholder in
/// credential headers ([`is_credential_header`], inside a `Basic` credential
/// too) and in query-parameter values, never in the path. Other secrets'
/// placeholders stay as they are.
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
        let used = match &secret.header {
            Some(header) => set_header(secret, header, headers, &mut applied),
            None if secret.placeholder.len() >= PLACEHOLDER_PREFIX.len() + 16 => {
                let value = secret.value.expose();
                let in_query = replace_in_query(uri, &secret.placeholder, value);
                let in_headers =
                    replace_in_credentials(headers, &secret.placeholder, value, &mut applied);
                in_query | in_headers
            }
            None => false,
        };
        if used {
            applied.add_value(secret.value.expose());
            applied.names.push(secret.name.clone());
        }
    }
    applied
}

/// Sets a secret's own header to its format; false when the name or the
/// value cannot be a header.
fn set_header(
    secret: &Secret,
    header: &str,
    headers: &mut HeaderMap,
    applied: &mut Applied,
) -> bool {
    let format = secret.format.as_deref().unwrap_or("{value}");
    let value = format.replace("{value}", secret.value.expose());
    let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(header.as_bytes()),
        HeaderValue::from_str(&value),
    ) else {
        return false;
    };
    applied.add_needle(value.as_bytes());
    headers.remove(&name);
    headers.insert(name, value);
    true
}

/// Replaces the placeholder in the values of the query's parameters (after
/// the first `=` of each), escaped so the value stays one parameter.
fn replace_in_query(uri: &mut Uri, placeholder: &str, value: &str) -> bool {
    let Some(query) = uri.query() else {
        return false;
    };
    if !query.contains(placeholder) {
        return false;
    }
    let escaped = query_escape(value, false);
    let mut used = false;
    let params: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((k, v)) if v.contains(placeholder) => {
                used = true;
                format!("{k}={}", v.replace(placeholder, &escaped))
            }
            _ => param.to_owned(),
        })
        .collect();
    if !used {
        return false;
    }
    let pq = format!("{}?{}", uri.path(), params.join("&"));
    let mut parts = uri.clone().into_parts();
    match pq.parse() {
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

/// Percent-escapes every byte but the unreserved ones (letters, digits,
/// `-._~`), so the value cannot end or split a query parameter.
fn query_escape(value: &str, lower: bool) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else if lower {
            out.push_str(&format!("%{b:02x}"));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Replaces the placeholder in the credential headers' values, and inside a
/// `Basic` credential (`user:placeholder`, as clients send a URL's
/// `user:password@`), whose new encoding is scrubbed from the answer too.
fn replace_in_credentials(
    headers: &mut HeaderMap,
    placeholder: &str,
    value: &str,
    applied: &mut Applied,
) -> bool {
    let mut used = false;
    for (name, v) in headers.iter_mut() {
        if !is_credential_header(name.as_str()) {
            continue;
        }
        let Ok(s) = v.to_str() else { continue };
        let replaced = match basic_credential(s) {
            Some(decoded) if decoded.contains(placeholder) => {
                let token = BASE64.encode(decoded.replace(placeholder, value));
                applied.add_needle(token.as_bytes());
                format!("Basic {token}")
            }
            _ if s.contains(placeholder) => s.replace(placeholder, value),
            _ => continue,
        };
        if let Ok(new) = HeaderValue::from_str(&replaced) {
            *v = new;
            used = true;
        }
    }
    used
}

/// The decoded `user:password` of a `Basic` credential.
fn basic_credential(header: &str) -> Option<String> {
    let (scheme, token) = header.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let bytes = BASE64.decode(token.trim()).ok()?;
    String::from_utf8(bytes).ok()
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
        assert_eq!(uri.to_string(), "/repos/acme/x?t=real%20value%26x");
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

    fn plain(ph: &str) -> Secret {
        Secret {
            name: "K".into(),
            value: SecretValue::new("sk-live"),
            hosts: vec!["api.example.com".into()],
            header: None,
            format: None,
            rules: vec![],
            placeholder: ph.to_owned(),
        }
    }

    fn apply(secret: &Secret, uri: &str, headers: &[(&str, String)]) -> (Uri, HeaderMap, Applied) {
        let mut uri: Uri = uri.parse().unwrap();
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let applied = substitute(
            std::slice::from_ref(secret),
            "api.example.com",
            "GET",
            &mut uri,
            &mut map,
        );
        (uri, map, applied)
    }

    #[test]
    fn only_credential_headers_and_query_values_get_the_value() {
        let ph = make_placeholder();
        let (uri, h, applied) = apply(
            &plain(&ph),
            &format!("/v1/models/{ph}?key={ph}&{ph}=x&q=a{ph}"),
            &[
                ("authorization", format!("Bearer {ph}")),
                ("x-api-key", ph.clone()),
                ("api-key", ph.clone()),
                ("x-goog-api-key", ph.clone()),
                ("private-token", ph.clone()),
                ("x-auth-token", ph.clone()),
                ("x-amz-signature", ph.clone()),
                ("x-client-secret", ph.clone()),
                ("x-whatever", ph.clone()),
                ("openai-organization", ph.clone()),
                ("user-agent", format!("ua {ph}")),
            ],
        );
        assert_eq!(applied.names, vec!["K".to_string()]);
        assert_eq!(
            uri.to_string(),
            format!("/v1/models/{ph}?key=sk-live&{ph}=x&q=ask-live")
        );
        assert_eq!(h["authorization"], "Bearer sk-live");
        for name in [
            "x-api-key",
            "api-key",
            "x-goog-api-key",
            "private-token",
            "x-auth-token",
            "x-amz-signature",
            "x-client-secret",
        ] {
            assert_eq!(h[name], "sk-live", "{name}");
        }
        for name in ["x-whatever", "openai-organization"] {
            assert_eq!(h[name], ph.as_str(), "{name}");
        }
        assert_eq!(h["user-agent"], format!("ua {ph}"));
        assert!(applied.needles.contains(&b"sk-live".to_vec()));
    }

    #[test]
    fn a_secret_with_a_header_goes_only_into_that_header() {
        let ph = make_placeholder();
        let mut s = plain(&ph);
        s.header = Some("Authorization".into());
        s.format = Some("Bearer {value}".into());
        let (uri, h, applied) = apply(
            &s,
            &format!("/x/{ph}?k={ph}"),
            &[("x-api-key", ph.clone()), ("authorization", "junk".into())],
        );
        assert_eq!(uri.to_string(), format!("/x/{ph}?k={ph}"));
        assert_eq!(h["x-api-key"], ph.as_str());
        assert_eq!(h["authorization"], "Bearer sk-live");
        assert_eq!(h.get_all("authorization").iter().count(), 1);
        assert!(applied.needles.contains(&b"sk-live".to_vec()));
        assert!(applied.needles.contains(&b"Bearer sk-live".to_vec()));
    }

    #[test]
    fn a_basic_credential_is_decoded_replaced_and_encoded_again() {
        let ph = make_placeholder();
        let basic = format!("Basic {}", BASE64.encode(format!("x-access-token:{ph}")));
        let (_, h, applied) = apply(
            &plain(&ph),
            "/repo.git/info/refs",
            &[("authorization", basic)],
        );
        let token = BASE64.encode("x-access-token:sk-live");
        assert_eq!(h["authorization"], format!("Basic {token}"));
        assert!(applied.needles.contains(&token.into_bytes()));
        // A Basic credential without the placeholder is left alone.
        let other = format!("Basic {}", BASE64.encode("u:p"));
        let (_, h, applied) = apply(&plain(&ph), "/", &[("authorization", other.clone())]);
        assert_eq!(h["authorization"], other.as_str());
        assert!(applied.names.is_empty() && applied.needles.is_empty());
    }

    #[test]
    fn applied_never_prints_a_value() {
        let ph = make_placeholder();
        let (_, _, applied) = apply(&plain(&ph), &format!("/?k={ph}"), &[]);
        assert!(!applied.needles.is_empty());
        assert!(!format!("{applied:?}").contains("sk-live"));
    }
}
