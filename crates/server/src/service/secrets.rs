//! Egress secrets (`/v1/egress-secrets`): values sandboxes never see. A
//! sandbox gets each secret's placeholder in an environment variable; the
//! host's egress proxy puts the value into HTTPS requests to the secret's
//! hosts. Values are sealed (see [`Sealer`]) with a key kept in the data
//! dir (`secrets.key`, mode 0600) and never returned by any call.
//!
//! Secrets belong to the key that set them (its id is their scope in the
//! store): a key sets, lists and deletes only its own, read-only keys see
//! none, and a sandbox gets its own key's secrets, all of them unless its
//! create named a list (`secrets: [names]`, or `[]` for none). Two keys may
//! each have a secret of one name.

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

/// With several nodes on one store: every node must seal secrets with the
/// same `secrets.key`, or a sandbox on one could not open what was stored
/// through another. The first node records a digest of its key in the
/// store; a node whose key differs, or that has none while the store has
/// one, is refused at its start, naming the file to copy.
pub(crate) fn check_shared_key(
    data_dir: &Path,
    store: &crate::store::Store,
) -> Result<(), ServerError> {
    const CHECK: &str = "secrets_key_check";
    let path = data_dir.join("secrets.key");
    let recorded = store.meta(CHECK)?;
    if recorded.is_some() && !path.exists() {
        return Err(ServerError::BadSetting {
            message: format!(
                "this node has no {} and the store's secrets are sealed with another node's key: \
             copy secrets.key from a node of this store into the data directory (mode 0600) \
             before starting",
                path.display()
            ),
        });
    }
    let mine = open_sealer(data_dir)?.keyed_digest(b"runtime: the store's sealing key");
    let kept = store.claim_meta(CHECK, &mine)?;
    if kept != mine {
        return Err(ServerError::BadSetting {
            message: format!(
                "{} is not the key the store's secrets are sealed with: every node of one store \
             needs the same secrets.key (copy it from another node of this store)",
                path.display()
            ),
        });
    }
    Ok(())
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
pub(crate) fn put(st: &AppState, key: &KeyInfo, p: Put) -> ApiResult<Value> {
    let name = p.name;
    let scope = key.id.as_str();
    let existing = st.store().doc_get(KIND, scope, &name)?;
    if existing.is_none() && st.store().doc_list(KIND, Some(scope))?.len() >= MAX_SECRETS {
        return Err(ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message: format!("At most {MAX_SECRETS} secrets."),
            details: None,
        });
    }
    let env = p.env.unwrap_or_else(|| name.clone());
    // Two secrets in one variable would hide one of them.
    for (_, other, doc) in st.store().doc_list(KIND, Some(scope))? {
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
    st.store().doc_put(KIND, scope, &name, &doc)?;
    changed(st);
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
    let all = st.store().doc_list(KIND, Some(&key.id))?;
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
    if st.store().doc_delete(KIND, &key.id, Some(name))? == 0 {
        return Err(not_found(name));
    }
    changed(st);
    Ok(())
}

/// Every secret of key `owner`, opened, for the egress proxy.
pub(crate) fn all_opened(st: &AppState, owner: &str) -> Vec<Opened> {
    let docs = match st.store().doc_list(KIND, Some(owner)) {
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

/// The names of key `owner`'s secrets.
pub(crate) fn names(st: &AppState, owner: &str) -> ApiResult<Vec<String>> {
    Ok(st
        .store()
        .doc_list(KIND, Some(owner))?
        .into_iter()
        .map(|(_, n, _)| n)
        .collect())
}

/// The variables a sandbox of key `owner` gets: each of its secrets'
/// placeholder. `chosen` is its create's `secrets` list (`None` = all).
pub(crate) fn placeholders(
    st: &AppState,
    owner: &str,
    chosen: Option<&[String]>,
) -> Vec<(String, String)> {
    let docs = st.store().doc_list(KIND, Some(owner)).unwrap_or_else(|e| {
        tracing::error!(error = %e, "reading the secrets failed: no placeholders given");
        Vec::new()
    });
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

/// The store-wide fact that changes with every secret's change: the other
/// nodes on a shared store read it each second ([`watch_peers`]).
const CHANGED_META: &str = "secrets_changed";

/// A secret of some key changed here: this node's running sandboxes take
/// it up at once, the other nodes' within a second.
fn changed(st: &AppState) {
    st.secrets_changed();
    if st.store().shared() {
        let mark = uuid::Uuid::new_v4().simple().to_string();
        if let Err(e) = st.store().set_meta(CHANGED_META, &mark) {
            tracing::error!(error = %e, "telling the other nodes of a secret's change failed");
        }
    }
}

/// Run each second on a shared store: when another node changed a secret
/// since the mark last read (`seen`: `None` before the first read, then
/// the mark, `Some(None)` while no secret ever changed), this node's
/// running sandboxes take the secrets up again. Answers what to pass next.
pub(crate) fn watch_peers(st: &AppState, seen: Option<Option<String>>) -> Option<Option<String>> {
    let now = match st.store().meta(CHANGED_META) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "reading whether a secret changed failed");
            return seen;
        }
    };
    if seen.as_ref().is_some_and(|before| *before != now) {
        st.secrets_changed();
    }
    Some(now)
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
