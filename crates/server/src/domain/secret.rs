//! Egress secrets: what a secret's name, hosts, header and rules may be,
//! the public view of a kept secret (never its value), and the sealing of
//! values (XChaCha20-Poly1305, each bound to the name it was sealed under).

use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::Serialize;
use serde_json::{json, Map, Value};
use sha2::Sha256;

/// At most this many secrets.
pub(crate) const MAX_SECRETS: usize = 50;
/// A value is 1 to this many bytes.
pub(crate) const MAX_VALUE: usize = 8 << 10;
/// The methods a rule may name.
pub(crate) const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// A secret's name, and the variable it goes in: `[A-Za-z_][A-Za-z0-9_]*`,
/// at most 128.
pub(crate) fn valid_env_name(n: &str) -> bool {
    n.len() <= 128 && crate::domain::names::valid_env_name(n)
}

/// A value: visible ASCII and spaces.
pub(crate) fn valid_value_bytes(v: &str) -> bool {
    v.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// A host name or `*.domain`, lower case.
pub(crate) fn valid_host_pattern(h: &str) -> bool {
    let name = h.strip_prefix("*.").unwrap_or(h);
    (1..=253).contains(&name.len())
        && name.split('.').count() >= 1
        && name.split('.').all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

pub(crate) fn valid_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 128
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A rule path: `/` then segments, exact or ending in `/*`, written
/// canonically (no `.`/`..` segments, no `;`, `\` or encoded slash).
pub(crate) fn valid_rule_path(p: &str) -> bool {
    let body = p.strip_suffix("/*").unwrap_or(p);
    p.starts_with('/')
        && !p.contains(';')
        && !p.contains('\\')
        && !p.to_ascii_lowercase().contains("%2f")
        && !body[1.min(body.len())..].contains('*')
        && body.split('/').skip(1).all(|s| s != "." && s != "..")
}

/// A method a rule may name, upper-cased; `None` for any other.
pub(crate) fn rule_method(m: &str) -> Option<String> {
    let up = m.to_ascii_uppercase();
    METHODS.contains(&up.as_str()).then_some(up)
}

/// One rule of a secret: the requests (methods, paths) that may carry it.
/// No methods: any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Rule {
    pub(crate) methods: Vec<String>,
    pub(crate) paths: Vec<String>,
}

/// The public view of a kept secret: its fields but never the sealed value.
pub(crate) fn view(doc: &Value) -> Value {
    let mut v = Map::new();
    for k in [
        "name",
        "hosts",
        "header",
        "format",
        "rules",
        "env",
        "placeholder",
        "valueBytes",
        "createdAt",
        "updatedAt",
    ] {
        if let Some(x) = doc.get(k).filter(|x| !x.is_null()) {
            v.insert(k.into(), x.clone());
        }
    }
    v.insert("enforced".into(), json!(true));
    Value::Object(v)
}

/// Seals and opens values with one 32-byte key. A value opens only under
/// the name it was sealed with.
pub(crate) struct Sealer {
    cipher: XChaCha20Poly1305,
    /// Derived from the key, for [`Sealer::keyed_digest`].
    mac_key: Vec<u8>,
}

impl Sealer {
    /// A sealer of a 32-byte key; `None` for a key of another length.
    pub(crate) fn from_key(key: &[u8]) -> Option<Sealer> {
        let cipher = XChaCha20Poly1305::new_from_slice(key).ok()?;
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).ok()?;
        m.update(b"runtime keyed digest v1");
        let mac_key = m.finalize().into_bytes().to_vec();
        Some(Sealer { cipher, mac_key })
    }

    /// A digest of `data` that only this key can make (hex HMAC-SHA256
    /// under a key derived from it): a fingerprint of a request that
    /// carries a secret, which a plain hash would let anyone holding the
    /// store test guesses against.
    pub(crate) fn keyed_digest(&self, data: &[u8]) -> String {
        let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(&self.mac_key) else {
            return String::new();
        };
        m.update(data);
        m.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// `value` sealed under `name`: base64 of a random nonce and the
    /// ciphertext.
    pub(crate) fn seal(&self, name: &str, value: &str) -> Option<String> {
        let mut nonce = [0u8; 24];
        rand::thread_rng().fill_bytes(&mut nonce);
        let ct = self
            .cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: value.as_bytes(),
                    aad: name.as_bytes(),
                },
            )
            .ok()?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&ct);
        Some(base64::engine::general_purpose::STANDARD.encode(out))
    }

    pub(crate) fn unseal(&self, name: &str, sealed: &str) -> Option<String> {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(sealed)
            .ok()?;
        if raw.len() < 24 {
            return None;
        }
        let (nonce, ct) = raw.split_at(24);
        let pt = self
            .cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: ct,
                    aad: name.as_bytes(),
                },
            )
            .ok()?;
        String::from_utf8(pt).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_paths_must_be_canonical() {
        assert!(valid_rule_path("/v1/chat/completions"));
        assert!(valid_rule_path("/repos/acme/*"));
        assert!(valid_rule_path("/"));
        for bad in [
            "v1", "/a/../b", "/a/./b", "/a;b", "/a\\b", "/a%2Fb", "/a%2fb", "/a*/b", "",
        ] {
            assert!(!valid_rule_path(bad), "{bad} passed");
        }
    }

    #[test]
    fn host_patterns() {
        assert!(valid_host_pattern("api.example.com"));
        assert!(valid_host_pattern("*.example.org"));
        assert!(valid_host_pattern("localhost"));
        for bad in [
            "",
            "*.",
            "Example.com",
            "a..b",
            "-a.com",
            "a-.com",
            "a b.com",
            "*",
        ] {
            assert!(!valid_host_pattern(bad), "{bad} passed");
        }
        assert!(!valid_host_pattern(&format!("{}.com", "a".repeat(64))));
    }

    #[test]
    fn names_headers_values_and_methods() {
        assert!(valid_env_name("OPENAI_API_KEY"));
        assert!(valid_env_name(&"A".repeat(128)));
        assert!(!valid_env_name(&"A".repeat(129)));
        assert!(!valid_env_name("1A"));
        assert!(valid_header_name("Authorization"));
        assert!(valid_header_name("x-api-key"));
        assert!(!valid_header_name(""));
        assert!(!valid_header_name("a b"));
        assert!(!valid_header_name("a:b"));
        assert!(valid_value_bytes("sk-1 2~"));
        assert!(!valid_value_bytes("a\nb"));
        assert!(!valid_value_bytes("é"));
        assert_eq!(rule_method("get").as_deref(), Some("GET"));
        assert_eq!(rule_method("TRACE"), None);
    }

    #[test]
    fn the_view_never_shows_the_sealed_value() {
        let doc = json!({"name": "A", "sealed": "xyz", "header": null, "hosts": ["a.com"],
                         "valueBytes": 3});
        assert_eq!(
            view(&doc),
            json!({"name": "A", "hosts": ["a.com"], "valueBytes": 3, "enforced": true})
        );
    }

    #[test]
    fn sealed_values_open_only_with_their_name_and_key() {
        let s = Sealer::from_key(&[7u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        let sealed = s.seal("A", "sk-123").unwrap_or_default();
        assert!(!sealed.contains("sk-123"));
        assert_eq!(s.unseal("A", &sealed).as_deref(), Some("sk-123"));
        assert_eq!(s.unseal("B", &sealed), None);
        // A fresh nonce each time.
        assert_ne!(s.seal("A", "sk-123").unwrap_or_default(), sealed);
        let again = Sealer::from_key(&[7u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        assert_eq!(again.unseal("A", &sealed).as_deref(), Some("sk-123"));
        let stranger = Sealer::from_key(&[8u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        assert_eq!(stranger.unseal("A", &sealed), None);
        assert_eq!(s.unseal("A", "not base64!"), None);
        assert_eq!(s.unseal("A", "AAAA"), None);
        assert!(Sealer::from_key(&[0u8; 16]).is_none());
    }

    #[test]
    fn keyed_digests_need_the_key() {
        let s = Sealer::from_key(&[7u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        let d = s.keyed_digest(b"POST /v1/images/registries?\n{}");
        assert_eq!(d.len(), 64);
        assert_eq!(d, s.keyed_digest(b"POST /v1/images/registries?\n{}"));
        assert_ne!(d, s.keyed_digest(b"POST /v1/images/registries?\n{ }"));
        assert_ne!(
            d,
            crate::domain::access::sha256_hex(b"POST /v1/images/registries?\n{}")
        );
        let other = Sealer::from_key(&[8u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        assert_ne!(d, other.keyed_digest(b"POST /v1/images/registries?\n{}"));
    }
}
