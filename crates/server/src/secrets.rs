//! Egress secrets (`/v1/egress-secrets`): values sandboxes never see. A
//! sandbox gets each secret's placeholder in an environment variable; the
//! host's egress proxy puts the value into HTTPS requests to the secret's
//! hosts. Values are sealed (XChaCha20-Poly1305) with a key kept in the data
//! dir (`secrets.key`, mode 0600) and never returned by any call.
//!
//! Secrets belong to the server's one account: every key that may make
//! changes may set them, read-only keys see none, and every sandbox gets them
//! all unless its create named a list (`secrets: [names]`, or `[]` for none).

use std::path::Path;

use base64::Engine;
use bytes::Bytes;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::RngCore;
use serde_json::{json, Map, Value};

use crate::error::{ApiError, ApiResult, ServerError};
use crate::http::extract::{json_object, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_iso;
use crate::AppState;

const KIND: &str = "secret";
const MAX_SECRETS: usize = 50;
const MAX_VALUE: usize = 8 << 10;

/// A secret as the egress proxy needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub name: String,
    pub env: String,
    pub value: String,
    pub hosts: Vec<String>,
    pub header: Option<String>,
    pub format: Option<String>,
    /// `(methods, paths)` per rule.
    pub rules: Vec<(Vec<String>, Vec<String>)>,
    pub placeholder: String,
}

/// The sealing key, made on first use.
pub struct Sealer {
    cipher: XChaCha20Poly1305,
}

impl Sealer {
    pub fn open(data_dir: &Path) -> Result<Sealer, ServerError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = data_dir.join("secrets.key");
        let io = |op, source| ServerError::Io {
            op,
            path: path.display().to_string(),
            source,
        };
        let key = match std::fs::read(&path) {
            Ok(k) if k.len() == 32 => k,
            Ok(_) => {
                return Err(ServerError::Corrupt {
                    what: format!("{} is not a 32-byte key", path.display()),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut k = vec![0u8; 32];
                rand::thread_rng().fill_bytes(&mut k);
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| io("create secrets key", e))?;
                f.write_all(&k)
                    .and_then(|_| f.sync_all())
                    .map_err(|e| io("write secrets key", e))?;
                k
            }
            Err(e) => return Err(io("read secrets key", e)),
        };
        let cipher = XChaCha20Poly1305::new_from_slice(&key).map_err(|_| ServerError::Corrupt {
            what: "secrets key".into(),
        })?;
        Ok(Sealer { cipher })
    }

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

pub(crate) fn valid_env_name(n: &str) -> bool {
    let mut b = n.bytes();
    n.len() <= 128
        && matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
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

fn valid_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 128
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A rule path: `/` then segments, exact or ending in `/*`, written
/// canonically (no `.`/`..` segments, no `;`, `\` or encoded slash).
fn valid_rule_path(p: &str) -> bool {
    let body = p.strip_suffix("/*").unwrap_or(p);
    p.starts_with('/')
        && !p.contains(';')
        && !p.contains('\\')
        && !p.to_ascii_lowercase().contains("%2f")
        && !body[1.min(body.len())..].contains('*')
        && body.split('/').skip(1).all(|s| s != "." && s != "..")
}

const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound {
        code: "secret_not_found",
        what: "secret",
        id: name.to_string(),
    }
}

fn no_read_only(ctx: &Ctx) -> ApiResult<()> {
    if ctx.key.read_only {
        return Err(ApiError::Forbidden {
            action: "see secrets",
        });
    }
    Ok(())
}

/// The public view of a stored secret.
fn view(doc: &Value) -> Value {
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

/// `PUT /v1/egress-secrets/{name}`.
pub async fn put(st: AppState, _ctx: Ctx, name: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    if !valid_env_name(&name) {
        f.issue(
            "name",
            "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*, at most 128)",
        );
    }
    let value = f.string("value");
    match &value {
        None => f.issue("value", "is required"),
        Some(v) if v.is_empty() || v.len() > MAX_VALUE => {
            f.issue("value", "must be 1 to 8192 bytes")
        }
        Some(v) if !v.bytes().all(|b| (0x20..0x7f).contains(&b)) => {
            f.issue("value", "must be visible ASCII and spaces")
        }
        Some(_) => {}
    }
    let hosts = strings(&mut f, "hosts", 1, 16);
    if !f.present("hosts") {
        f.issue("hosts", "is required: the hosts the value may go to");
    }
    for (i, h) in hosts.iter().enumerate() {
        if !valid_host_pattern(h) {
            f.issue(
                &format!("hosts[{i}]"),
                "must be a lower-case host name or *.domain",
            );
        }
    }
    let header = f.string("header");
    if let Some(h) = &header {
        if !valid_header_name(h) {
            f.issue("header", "must be an HTTP header name");
        }
    }
    let format = f.string("format");
    if let Some(fm) = &format {
        if !fm.contains("{value}") {
            f.issue("format", "must contain {value}");
        }
        if header.is_none() {
            f.issue("format", "needs header");
        }
    }
    let env = f.string("env");
    if let Some(e) = &env {
        if !valid_env_name(e) {
            f.issue("env", "must be an environment variable name");
        }
    }
    let rules = rules(&mut f);
    match f.raw("only") {
        None => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => f.issue(
            "only",
            "scoping a secret to some sandboxes is not supported by this server yet; name secrets at create instead",
        ),
    }
    for unsupported in ["githubApp", "git", "api"] {
        f.refuse(unsupported, "is not supported by this server yet");
    }
    f.finish()?;
    let value = value.unwrap_or_default();
    let existing = st.store().doc_get(KIND, "", &name)?;
    if existing.is_none() && st.store().doc_list(KIND, None)?.len() >= MAX_SECRETS {
        return Err(ApiError::Conflict {
            code: "quota_exceeded",
            message: format!("At most {MAX_SECRETS} secrets."),
            details: None,
        });
    }
    let env = env.unwrap_or_else(|| name.clone());
    // Two secrets in one variable would hide one of them.
    for (_, other, doc) in st.store().doc_list(KIND, None)? {
        if other != name && doc["env"].as_str() == Some(env.as_str()) {
            return Err(ApiError::Conflict {
                code: "env_taken",
                message: format!("Secret {other} already uses the variable {env}."),
                details: Some(json!({"field": "env"})),
            });
        }
    }
    let sealed = st
        .sealer()?
        .seal(&name, &value)
        .ok_or_else(|| ApiError::Internal {
            what: "sealing a secret".into(),
        })?;
    let now = now_iso();
    let (placeholder, created) = match &existing {
        Some(d) => (
            d["placeholder"].as_str().map(String::from),
            d["createdAt"].as_str().map(String::from),
        ),
        None => (None, None),
    };
    let doc = json!({
        "name": name,
        "hosts": hosts,
        "header": header,
        "format": format,
        "rules": rules,
        "env": env,
        "placeholder": placeholder.unwrap_or_else(runtime_egress::make_placeholder),
        "valueBytes": value.len(),
        "createdAt": created.unwrap_or_else(|| now.clone()),
        "updatedAt": now,
        "sealed": sealed,
    });
    st.store().doc_put(KIND, "", &name, &doc)?;
    st.secrets_changed();
    Reply::ok(view(&doc))
}

fn strings(f: &mut Fields<'_>, field: &str, min: usize, max: usize) -> Vec<String> {
    match f.raw(field) {
        None => Vec::new(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if a.len() < min || a.len() > max {
                f.issue(field, format!("must have {min} to {max} entries"));
            }
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        }
        Some(_) => {
            f.issue(field, "must be an array of strings");
            Vec::new()
        }
    }
}

fn rules(f: &mut Fields<'_>) -> Value {
    let Some(raw) = f.raw("rules") else {
        return Value::Null;
    };
    let Value::Array(list) = raw else {
        f.issue("rules", "must be an array of {methods?, paths}");
        return Value::Null;
    };
    if list.is_empty() || list.len() > 16 {
        f.issue("rules", "must have 1 to 16 rules");
    }
    let mut out = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let Value::Object(m) = r else {
            f.issue(
                &format!("rules[{i}]"),
                "must be an object {methods?, paths}",
            );
            continue;
        };
        for k in m.keys() {
            if k != "methods" && k != "paths" {
                f.issue(&format!("rules[{i}].{k}"), "is not a known field");
            }
        }
        let methods: Vec<String> = match m.get("methods") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .filter_map(|(j, v)| match v.as_str() {
                    Some(s) if METHODS.contains(&s.to_ascii_uppercase().as_str()) => {
                        Some(s.to_ascii_uppercase())
                    }
                    _ => {
                        f.issue(
                            &format!("rules[{i}].methods[{j}]"),
                            format!("must be one of {}", METHODS.join(", ")),
                        );
                        None
                    }
                })
                .collect(),
            Some(_) => {
                f.issue(&format!("rules[{i}].methods"), "must be an array");
                Vec::new()
            }
        };
        let paths: Vec<String> = match m.get("paths") {
            Some(Value::Array(a)) if (1..=16).contains(&a.len()) => a
                .iter()
                .enumerate()
                .filter_map(|(j, v)| match v.as_str() {
                    Some(s) if valid_rule_path(s) => Some(s.to_string()),
                    _ => {
                        f.issue(
                            &format!("rules[{i}].paths[{j}]"),
                            "must be a canonical path, exact or ending in /* (no . or .. segments, ; \\ or encoded slash)",
                        );
                        None
                    }
                })
                .collect(),
            _ => {
                f.issue(&format!("rules[{i}].paths"), "must be 1 to 16 paths");
                Vec::new()
            }
        };
        out.push(json!({"methods": methods, "paths": paths}));
    }
    Value::Array(out)
}

/// `GET /v1/egress-secrets?limit&after`.
pub async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    no_read_only(&ctx)?;
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let limit = f.q_int("limit", 1, 100).map(|l| l as usize);
    let after = f.string("after");
    f.finish()?;
    let all = st.store().doc_list(KIND, None)?;
    let rest: Vec<&Value> = all
        .iter()
        .filter(|(_, n, _)| after.as_ref().is_none_or(|a| n > a))
        .map(|(_, _, d)| d)
        .collect();
    let take = limit.unwrap_or(rest.len());
    let page: Vec<Value> = rest.iter().take(take).map(|d| view(d)).collect();
    let next = (rest.len() > take)
        .then(|| {
            page.last()
                .and_then(|p| p["name"].as_str().map(String::from))
        })
        .flatten();
    Reply::ok(json!({"secrets": page, "next": next}))
}

/// `DELETE /v1/egress-secrets/{name}`: the value is erased.
pub async fn delete(st: AppState, ctx: Ctx, name: String) -> ApiResult<Reply> {
    no_read_only(&ctx)?;
    if st.store().doc_delete(KIND, "", Some(&name))? == 0 {
        return Err(not_found(&name));
    }
    st.secrets_changed();
    Reply::ok(json!({"name": name, "deleted": true, "enforced": true}))
}

/// Every secret, opened, for the egress proxy and the guests' environment.
pub fn all_opened(st: &AppState) -> Vec<Opened> {
    let docs = match st.store().doc_list(KIND, None) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "reading secrets failed");
            return Vec::new();
        }
    };
    let sealer = match st.sealer() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "the secrets key cannot be read");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (_, name, d) in docs {
        let Some(value) = d["sealed"].as_str().and_then(|s| sealer.unseal(&name, s)) else {
            tracing::error!(secret = %name, "a secret could not be unsealed (another data dir's key?)");
            continue;
        };
        let strs = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        out.push(Opened {
            env: d["env"].as_str().unwrap_or(&name).to_string(),
            hosts: strs(&d["hosts"]),
            header: d["header"].as_str().map(String::from),
            format: d["format"].as_str().map(String::from),
            rules: d["rules"]
                .as_array()
                .map(|rs| {
                    rs.iter()
                        .map(|r| (strs(&r["methods"]), strs(&r["paths"])))
                        .collect()
                })
                .unwrap_or_default(),
            placeholder: d["placeholder"].as_str().unwrap_or_default().to_string(),
            value,
            name,
        });
    }
    out
}

/// The names of the secrets that exist now.
pub fn names(st: &AppState) -> ApiResult<Vec<String>> {
    Ok(st
        .store()
        .doc_list(KIND, None)?
        .into_iter()
        .map(|(_, n, _)| n)
        .collect())
}

/// The variables a sandbox's processes get: each of its secrets' placeholder.
/// `chosen` is its create's `secrets` list (`None` = all).
pub fn placeholders(st: &AppState, chosen: Option<&[String]>) -> Vec<(String, String)> {
    let docs = st.store().doc_list(KIND, None).unwrap_or_default();
    docs.into_iter()
        .filter(|(_, n, _)| chosen.is_none_or(|c| c.contains(n)))
        .filter_map(|(_, n, d)| {
            Some((
                d["env"].as_str().unwrap_or(&n).to_string(),
                d["placeholder"].as_str()?.to_string(),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_paths_must_be_canonical() {
        assert!(valid_rule_path("/v1/chat/completions"));
        assert!(valid_rule_path("/repos/acme/*"));
        for bad in [
            "v1", "/a/../b", "/a/./b", "/a;b", "/a\\b", "/a%2Fb", "/a*/b",
        ] {
            assert!(!valid_rule_path(bad), "{bad} passed");
        }
    }

    #[test]
    fn host_patterns() {
        assert!(valid_host_pattern("api.example.com"));
        assert!(valid_host_pattern("*.example.org"));
        for bad in ["", "*.", "Example.com", "a..b", "-a.com", "a b.com", "*"] {
            assert!(!valid_host_pattern(bad), "{bad} passed");
        }
    }

    #[test]
    fn sealed_values_open_only_with_their_name_and_key() {
        let dir = std::env::temp_dir().join(format!("sealer-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let s = Sealer::open(&dir).unwrap_or_else(|e| panic!("{e}"));
        let sealed = s.seal("A", "sk-123").unwrap_or_default();
        assert!(!sealed.contains("sk-123"));
        assert_eq!(s.unseal("A", &sealed).as_deref(), Some("sk-123"));
        assert_eq!(s.unseal("B", &sealed), None);
        let again = Sealer::open(&dir).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again.unseal("A", &sealed).as_deref(), Some("sk-123"));
        let other = std::env::temp_dir().join(format!("sealer-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&other).unwrap_or_else(|e| panic!("{e}"));
        let stranger = Sealer::open(&other).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(stranger.unseal("A", &sealed), None);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&other);
    }
}
