//! Private-registry credentials (`/v1/images/registries`, docs/images.md
//! "Private registries"): what a key's pulls authenticate with.
//!
//! A credential belongs to the key that set it, as egress secrets do: a key
//! sets, lists and deletes only its own, and only its own pulls use them.
//! The secret (password, token, or ECR secret access key) is sealed on
//! arrival with the egress secrets' [`Sealer`](crate::domain::secret::Sealer)
//! (`secrets.key` of the data dir), bound to its key and registry, and only
//! [`credentials_for`] opens it again; no answer or log carries it.

use runtime_api::codes;
use serde_json::Value;

use crate::domain::access::KeyInfo;
use crate::domain::registry::{normalize, seal_name, view, Kind, Registry, MAX_REGISTRIES};
use crate::domain::secret::Sealer;
use crate::error::{ApiError, ApiResult};
use crate::store::{PutRegistry, Store};
use crate::AppState;
use runtime_host::oci::Credentials;

/// A credential as its set gives it (the fields already checked).
pub(crate) enum Credential {
    Password {
        username: String,
        password: String,
    },
    Ecr {
        access_key_id: String,
        secret_access_key: String,
    },
}

fn not_found(registry: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::REGISTRY_NOT_FOUND,
        what: "registry",
        id: registry.to_string(),
    }
}

/// `POST /v1/images/registries`: creates or replaces the key's credential
/// for `registry` (already normalised). Answers its public view.
pub(crate) fn set(
    st: &AppState,
    key: &KeyInfo,
    registry: String,
    cred: Credential,
) -> ApiResult<Value> {
    let (kind, username, secret) = match cred {
        Credential::Password { username, password } => (Kind::Password, username, password),
        Credential::Ecr {
            access_key_id,
            secret_access_key,
        } => (Kind::Ecr, access_key_id, secret_access_key),
    };
    let sealed = st
        .sealer()?
        .seal(&seal_name(&key.id, &registry), &secret)
        .ok_or_else(|| ApiError::Internal {
            what: "sealing a registry credential".into(),
        })?;
    let now = st.now_ms();
    let row = Registry {
        key_id: key.id.clone(),
        registry,
        kind,
        username,
        sealed,
        secret_bytes: secret.len(),
        created_ms: now,
        updated_ms: now,
    };
    match st.store().put_registry(&row, MAX_REGISTRIES)? {
        PutRegistry::Kept(kept) => {
            tracing::info!(registry = %kept.registry, kind = kept.kind.as_str(), "registry credential set");
            Ok(view(&kept))
        }
        PutRegistry::Full => Err(ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message: format!(
                "At most {MAX_REGISTRIES} registries per key; delete one to add {}.",
                row.registry
            ),
            details: None,
        }),
    }
}

/// `GET /v1/images/registries`: the key's credentials, by registry.
pub(crate) fn list(st: &AppState, key: &KeyInfo) -> ApiResult<Vec<Value>> {
    Ok(st.store().registries(&key.id)?.iter().map(view).collect())
}

/// `POST /v1/images/registries:delete`: the secret is erased.
pub(crate) fn delete(st: &AppState, key: &KeyInfo, registry: &str) -> ApiResult<()> {
    if !st.store().delete_registry(&key.id, registry)? {
        return Err(not_found(registry));
    }
    tracing::info!(registry = %registry, "registry credential deleted");
    Ok(())
}

/// The credentials key `key_id` pulls from `registry` with (normalised as
/// the API does: `index.docker.io` is `docker.io`), for the puller: a user
/// name and secret, or an ECR access key (which the pull exchanges for a
/// token). `None` when the key has none for it, or when the secret cannot
/// be opened (logged, never the secret).
pub(crate) fn credentials_for(st: &AppState, key_id: &str, registry: &str) -> Option<Credentials> {
    let sealer = match st.sealer() {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "the secrets key cannot be read: pulling without credentials");
            return None;
        }
    };
    open(st.store(), sealer, key_id, registry)
}

fn open(store: &Store, sealer: &Sealer, key_id: &str, registry: &str) -> Option<Credentials> {
    let registry = normalize(registry)?;
    let row = match store.get_registry(key_id, &registry) {
        Ok(r) => r?,
        Err(e) => {
            tracing::error!(error = %e, "reading registry credentials failed");
            return None;
        }
    };
    let Some(secret) = sealer.unseal(&seal_name(key_id, &registry), &row.sealed) else {
        tracing::error!(registry = %registry, "a registry credential could not be unsealed (another data dir's key?)");
        return None;
    };
    Some(if row.kind == Kind::Ecr {
        Credentials::Ecr {
            access_key_id: row.username,
            secret_access_key: secret,
        }
    } else {
        Credentials::Basic {
            username: row.username,
            password: secret,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_opens_for_its_key_and_registry_only() {
        let dir = std::env::temp_dir().join(format!("rt-reg-open-{}", uuid::Uuid::new_v4()));
        let store = Store::open(&dir).unwrap_or_else(|e| panic!("{e}"));
        let sealer = Sealer::from_key(&[3u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        let put = |key: &str, registry: &str, kind: Kind, user: &str, secret: &str| {
            let row = Registry {
                key_id: key.into(),
                registry: registry.into(),
                kind,
                username: user.into(),
                sealed: sealer
                    .seal(&seal_name(key, registry), secret)
                    .unwrap_or_default(),
                secret_bytes: secret.len(),
                created_ms: 0,
                updated_ms: 0,
            };
            assert!(matches!(
                store.put_registry(&row, MAX_REGISTRIES),
                Ok(PutRegistry::Kept(_))
            ));
            row
        };
        put("a", "docker.io", Kind::Password, "me", "hub-token");
        put("a", "ghcr.io", Kind::Password, "me", "gh-token");
        let pair = |u: &str, s: &str| {
            Some(Credentials::Basic {
                username: u.to_string(),
                password: s.to_string(),
            })
        };
        for name in [
            "docker.io",
            "index.docker.io",
            "https://index.docker.io/v1/",
            "registry-1.docker.io",
        ] {
            assert_eq!(
                open(&store, &sealer, "a", name),
                pair("me", "hub-token"),
                "{name}"
            );
        }
        assert_eq!(
            open(&store, &sealer, "a", "GHCR.IO"),
            pair("me", "gh-token")
        );
        assert_eq!(open(&store, &sealer, "b", "ghcr.io"), None);
        assert_eq!(open(&store, &sealer, "a", "quay.io"), None);
        assert_eq!(open(&store, &sealer, "a", "not a host"), None);
        // Another key's sealed value copied into b's row opens to nothing.
        let stolen = put("a", "quay.io", Kind::Password, "me", "quay-token");
        let mut copy = stolen.clone();
        copy.key_id = "b".into();
        assert!(matches!(
            store.put_registry(&copy, MAX_REGISTRIES),
            Ok(PutRegistry::Kept(_))
        ));
        assert_eq!(open(&store, &sealer, "b", "quay.io"), None);
        assert_eq!(
            open(&store, &sealer, "a", "quay.io"),
            pair("me", "quay-token")
        );
        // An ECR access key, for the pull to exchange for a token.
        let ecr = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
        put("a", ecr, Kind::Ecr, "AKIAIOSFODNN7EXAMPLE", "secret");
        assert_eq!(
            open(&store, &sealer, "a", ecr),
            Some(Credentials::Ecr {
                access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
                secret_access_key: "secret".into()
            })
        );
        // Another data dir's key opens nothing.
        let stranger = Sealer::from_key(&[4u8; 32]).unwrap_or_else(|| panic!("a 32-byte key"));
        assert_eq!(open(&store, &stranger, "a", "ghcr.io"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
