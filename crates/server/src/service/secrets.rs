//! Egress secrets (`/v1/egress-secrets`): values sandboxes never see. A
//! sandbox gets each secret's placeholder in an environment variable; the
//! host's egress proxy puts the value into HTTPS requests to the secret's
//! hosts. Values are sealed (see [`Sealer`]) with a key kept in the data
//! dir (`secrets.key`, mode 0600) and never returned by any call.
//!
//! Secrets belong to the server's one account: every key that may make
//! changes may set them, read-only keys see none, and every sandbox gets them
//! all unless its create named a list (`secrets: [names]`, or `[]` for none).

use runtime_api::codes;
use std::path::Path;

use rand::RngCore;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::secret::{view, Rule, Sealer, MAX_SECRETS};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult, ServerError};
use crate::AppState;

const KIND: &str = "secret";

/// Opens the sealing key of `data_dir` (`secrets.key`), making it on first
/// use.
pub(crate) fn open_sealer(data_dir: &Path) -> Result<Sealer, ServerError> {
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
    Sealer::from_key(&key).ok_or_else(|| ServerError::Corrupt {
        what: "secrets key".into(),
    })
}

/// A secret as the egress proxy needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Opened {
    pub(crate) name: String,
    pub(crate) env: String,
    pub(crate) value: String,
    pub(crate) hosts: Vec<String>,
    pub(crate) header: Option<String>,
    pub(crate) format: Option<String>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) placeholder: String,
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::SECRET_NOT_FOUND,
        what: "secret",
        id: name.to_string(),
    }
}

fn no_read_only(key: &KeyInfo) -> ApiResult<()> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "see secrets",
        });
    }
    Ok(())
}

/// What `PUT /v1/egress-secrets/{name}` asks (checked by the caller).
pub(crate) struct Put {
    pub(crate) name: String,
    pub(crate) value: String,
    pub(crate) hosts: Vec<String>,
    pub(crate) header: Option<String>,
    pub(crate) format: Option<String>,
    /// `None`: the secret's name.
    pub(crate) env: Option<String>,
    pub(crate) rules: Option<Vec<Rule>>,
}

/// `PUT /v1/egress-secrets/{name}`: sets the secret (its placeholder and
/// creation time kept when it exists); every live sandbox follows. Answers
/// its public view.
pub(crate) fn put(st: &AppState, p: Put) -> ApiResult<Value> {
    let name = p.name;
    let existing = st.store().doc_get(KIND, "", &name)?;
    if existing.is_none() && st.store().doc_list(KIND, None)?.len() >= MAX_SECRETS {
        return Err(ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message: format!("At most {MAX_SECRETS} secrets."),
            details: None,
        });
    }
    let env = p.env.unwrap_or_else(|| name.clone());
    // Two secrets in one variable would hide one of them.
    for (_, other, doc) in st.store().doc_list(KIND, None)? {
        if other != name && doc["env"].as_str() == Some(env.as_str()) {
            return Err(ApiError::Conflict {
                code: codes::ENV_TAKEN,
                message: format!("Secret {other} already uses the variable {env}."),
                details: Some(json!({"field": "env"})),
            });
        }
    }
    let sealed = st
        .sealer()?
        .seal(&name, &p.value)
        .ok_or_else(|| ApiError::Internal {
            what: "sealing a secret".into(),
        })?;
    let now = iso(st.now_ms());
    let (placeholder, created) = match &existing {
        Some(d) => (
            d["placeholder"].as_str().map(String::from),
            d["createdAt"].as_str().map(String::from),
        ),
        None => (None, None),
    };
    let doc = json!({
        "name": name,
        "hosts": p.hosts,
        "header": p.header,
        "format": p.format,
        "rules": p.rules,
        "env": env,
        "placeholder": placeholder.unwrap_or_else(runtime_egress::make_placeholder),
        "valueBytes": p.value.len(),
        "createdAt": created.unwrap_or_else(|| now.clone()),
        "updatedAt": now,
        "sealed": sealed,
    });
    st.store().doc_put(KIND, "", &name, &doc)?;
    st.secrets_changed();
    Ok(view(&doc))
}

/// `GET /v1/egress-secrets?limit&after`: the public views of one page (by
/// name, after `after`), and the next page's cursor.
pub(crate) fn list(
    st: &AppState,
    key: &KeyInfo,
    limit: Option<usize>,
    after: Option<&str>,
) -> ApiResult<(Vec<Value>, Option<String>)> {
    no_read_only(key)?;
    let all = st.store().doc_list(KIND, None)?;
    let rest: Vec<&Value> = all
        .iter()
        .filter(|(_, n, _)| after.is_none_or(|a| n.as_str() > a))
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
    Ok((page, next))
}

/// `DELETE /v1/egress-secrets/{name}`: the value is erased; every live
/// sandbox follows.
pub(crate) fn delete(st: &AppState, key: &KeyInfo, name: &str) -> ApiResult<()> {
    no_read_only(key)?;
    if st.store().doc_delete(KIND, "", Some(name))? == 0 {
        return Err(not_found(name));
    }
    st.secrets_changed();
    Ok(())
}

/// Every secret, opened, for the egress proxy and the guests' environment.
pub(crate) fn all_opened(st: &AppState) -> Vec<Opened> {
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
                        .map(|r| Rule {
                            methods: strs(&r["methods"]),
                            paths: strs(&r["paths"]),
                        })
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
pub(crate) fn names(st: &AppState) -> ApiResult<Vec<String>> {
    Ok(st
        .store()
        .doc_list(KIND, None)?
        .into_iter()
        .map(|(_, n, _)| n)
        .collect())
}

/// The variables a sandbox's processes get: each of its secrets' placeholder.
/// `chosen` is its create's `secrets` list (`None` = all).
pub(crate) fn placeholders(st: &AppState, chosen: Option<&[String]>) -> Vec<(String, String)> {
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

    fn dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("sealer-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
        d
    }

    #[test]
    fn the_key_is_made_once_private_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        let s = open_sealer(&d).unwrap_or_else(|e| panic!("{e}"));
        let sealed = s.seal("A", "sk-123").unwrap_or_default();
        let meta = std::fs::metadata(d.join("secrets.key")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 32);
        let again = open_sealer(&d).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again.unseal("A", &sealed).as_deref(), Some("sk-123"));
        let other = dir();
        let stranger = open_sealer(&other).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(stranger.unseal("A", &sealed), None);
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&other);
    }

    #[test]
    fn a_key_file_of_another_size_is_corrupt() {
        let d = dir();
        std::fs::write(d.join("secrets.key"), b"short").unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(open_sealer(&d), Err(ServerError::Corrupt { .. })));
        let _ = std::fs::remove_dir_all(&d);
    }
}
