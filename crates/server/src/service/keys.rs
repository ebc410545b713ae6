//! API keys as the operator manages them on the server (`runtime keys
//! list|revoke|limit`, docs/keys.md). Each call opens its own connection, so
//! it works while a server runs on the same data directory, and every
//! change takes effect on the server's next request: keys are looked up by
//! hash on every request. Only a key's SHA-256 is stored.

use crate::store::db::{params, Connection, DbError, DbResult, OptionalExtension};

pub use crate::domain::quota::KeyQuotas;
use crate::error::ServerError;
use crate::service::clock::now_iso;
use crate::store::{open_connection, store_err, StoreLocation};

/// A key as listed (never the key itself: only its hash is kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: Option<String>,
    pub read_only: bool,
    pub account_wide: bool,
    pub daily_limit_micros: Option<i64>,
    /// The quotas the operator set for this key alone.
    pub quotas: KeyQuotas,
    pub created_at: String,
    pub revoked_at: Option<String>,
}

fn all(conn: &Connection) -> Result<Vec<KeyRecord>, ServerError> {
    let mut stmt = conn
        .prepare(
            "SELECT id, name, read_only, account_wide, daily_limit_micros, created_at, revoked_at, quotas
             FROM keys ORDER BY created_at, id",
        )
        .map_err(store_err("list keys"))?;
    let rows = stmt
        .query_map([], |r| {
            Ok(KeyRecord {
                id: r.get(0)?,
                name: r.get(1)?,
                read_only: r.get(2)?,
                account_wide: r.get(3)?,
                daily_limit_micros: r.get(4)?,
                created_at: r.get(5)?,
                revoked_at: r.get(6)?,
                quotas: quotas_of(r.get(7)?)?,
            })
        })
        .map_err(store_err("list keys"))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(store_err("list keys"))
}

/// A key's stored quotas (NULL: none of its own).
fn quotas_of(text: Option<String>) -> DbResult<KeyQuotas> {
    text.map_or(Ok(KeyQuotas::default()), |t| {
        serde_json::from_str(&t).map_err(|e| DbError::Type {
            index: 7,
            what: format!("quotas: {e}"),
        })
    })
}

/// Every key of the data directory, oldest first, revoked ones included.
pub fn list_keys(at: &(impl StoreLocation + ?Sized)) -> Result<Vec<KeyRecord>, ServerError> {
    all(&open_connection(&at.store_at())?)
}

/// The key that is `which` (the key itself, its id or its name).
pub fn find_key(at: &(impl StoreLocation + ?Sized), which: &str) -> Result<KeyRecord, ServerError> {
    find(&open_connection(&at.store_at())?, which)
}

/// The one key that is `which` (the key itself, found by its hash), or
/// whose id or name it is (revoked ones too).
fn find(conn: &Connection, which: &str) -> Result<KeyRecord, ServerError> {
    let keys = all(conn)?;
    if let Some(id) = key_id_of(which) {
        // A key proves itself by its hash, not by the id it spells.
        let hash = crate::domain::access::sha256_hex(which.as_bytes());
        let found: Option<String> = conn
            .query_row("SELECT id FROM keys WHERE hash = ?1", params![hash], |r| {
                r.get(0)
            })
            .optional()
            .map_err(store_err("find key"))?;
        return match found.and_then(|f| keys.into_iter().find(|k| k.id == f)) {
            Some(k) => Ok(k),
            None => Err(ServerError::KeyUnknown { id: id.to_string() }),
        };
    }
    if let Some(k) = keys.iter().find(|k| k.id == which) {
        return Ok(k.clone());
    }
    let named: Vec<&KeyRecord> = keys
        .iter()
        .filter(|k| k.name.as_deref() == Some(which) && k.revoked_at.is_none())
        .collect();
    match named.as_slice() {
        [k] => Ok((*k).clone()),
        [] => Err(ServerError::KeyNotFound {
            which: which.into(),
        }),
        more => Err(ServerError::KeyAmbiguous {
            which: which.into(),
            count: more.len(),
        }),
    }
}

/// Revokes a key by id or name; its next request answers 401. Revoking a
/// revoked key changes nothing. Answers the key as it is now.
pub fn revoke_key(
    at: &(impl StoreLocation + ?Sized),
    which: &str,
) -> Result<KeyRecord, ServerError> {
    let conn = open_connection(&at.store_at())?;
    let k = find(&conn, which)?;
    conn.execute(
        "UPDATE keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
        params![k.id, now_iso()],
    )
    .map_err(store_err("revoke key"))?;
    find(&conn, &k.id)
}

/// Sets (or with `None` removes) a key's daily spending limit. Only a
/// person does this, on the server or on the approval page; no API route
/// changes it.
pub fn set_daily_limit(
    at: &(impl StoreLocation + ?Sized),
    which: &str,
    micros: Option<i64>,
) -> Result<KeyRecord, ServerError> {
    let conn = open_connection(&at.store_at())?;
    let k = find(&conn, which)?;
    set_limit_on(&conn, &k.id, micros)?;
    find(&conn, &k.id)
}

/// Applies the operator's `name=value` settings to a key's own quotas
/// (`name=default` gives it the server's back), all or none; answers the
/// key as it is now. Takes effect on the server's next admission.
pub fn set_quotas(
    at: &(impl StoreLocation + ?Sized),
    which: &str,
    settings: &[String],
) -> Result<KeyRecord, ServerError> {
    let conn = open_connection(&at.store_at())?;
    let k = find(&conn, which)?;
    let mut quotas = k.quotas.clone();
    quotas
        .apply(settings)
        .map_err(|message| ServerError::BadSetting { message })?;
    let text = (!quotas.is_empty())
        .then(|| serde_json::to_string(&quotas))
        .transpose()
        .map_err(|e| ServerError::Corrupt {
            what: format!("the quotas of key {}: {e}", k.id),
        })?;
    conn.execute(
        "UPDATE keys SET quotas = ?2 WHERE id = ?1",
        params![k.id, text],
    )
    .map_err(store_err("set key quotas"))?;
    find(&conn, &k.id)
}

pub(crate) fn set_limit_on(
    conn: &Connection,
    id: &str,
    micros: Option<i64>,
) -> Result<(), ServerError> {
    conn.execute(
        "UPDATE keys SET daily_limit_micros = ?2 WHERE id = ?1",
        params![id, micros.map(|m| m.max(0))],
    )
    .map(|_| ())
    .map_err(store_err("set daily limit"))
}

/// The id inside a key this server made (`rtcloud_<id>_<secret>`).
pub fn key_id_of(key: &str) -> Option<&str> {
    let rest = key.strip_prefix("rtcloud_")?;
    let id = rest.get(..36)?;
    (rest.as_bytes().get(36) == Some(&b'_')).then_some(id)
}

/// What a key may do with keys through the API (`/v1/keys`, the console's
/// keys page): an admin (account-wide, full) key manages every key, as on
/// the approval page of `runtime login`; account-wide and read-only keys
/// list them all; any other key sees and may revoke only itself.
pub(crate) mod api {
    use crate::domain::access::KeyInfo;
    use crate::error::{ApiError, ApiResult, ServerError};
    use crate::AppState;

    use super::KeyRecord;

    /// What a create asks for, checked.
    pub(crate) struct NewKey {
        pub name: Option<String>,
        pub read_only: bool,
        pub account_wide: bool,
        pub daily_limit_micros: Option<i64>,
    }

    fn is_admin(key: &KeyInfo) -> bool {
        key.account_wide && !key.read_only
    }

    fn admin_only(key: &KeyInfo) -> ApiResult<()> {
        if is_admin(key) {
            Ok(())
        } else {
            Err(ApiError::AdminOnly {
                action: "manage other keys",
            })
        }
    }

    fn not_found(id: &str) -> ApiError {
        ApiError::NotFound {
            code: runtime_api::codes::NOT_FOUND,
            what: "key",
            id: id.to_string(),
        }
    }

    /// The keys `key` may see, oldest first.
    pub(crate) fn list(st: &AppState, key: &KeyInfo) -> ApiResult<Vec<KeyRecord>> {
        let all = super::list_keys(&st.config().store_at())?;
        Ok(if key.account_wide || key.read_only {
            all
        } else {
            all.into_iter().filter(|k| k.id == key.id).collect()
        })
    }

    /// The key with this id, when `key` may see it (by id only, never by
    /// name: a path names one key).
    fn get(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<KeyRecord> {
        list(st, key)?
            .into_iter()
            .find(|k| k.id == id)
            .ok_or_else(|| not_found(id))
    }

    /// Makes a key; answers its record and the key itself (shown once).
    pub(crate) fn create(
        st: &AppState,
        key: &KeyInfo,
        req: NewKey,
    ) -> ApiResult<(KeyRecord, String)> {
        admin_only(key)?;
        let at = &st.config().store_at();
        let secret = crate::create_key(at, req.name.as_deref(), req.read_only, req.account_wide)?;
        let id = super::key_id_of(&secret)
            .ok_or_else(|| ApiError::Internal {
                what: "a new key without an id".into(),
            })?
            .to_string();
        if req.daily_limit_micros.is_some() {
            let conn = super::open_connection(at)?;
            super::set_limit_on(&conn, &id, req.daily_limit_micros)?;
        }
        Ok((get(st, key, &id)?, secret))
    }

    /// Revokes a key: an admin any other key; any key itself (signing out),
    /// unless it is account-wide, which is revoked on the server so the
    /// server is never left without an admin key by a click.
    pub(crate) fn revoke(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<KeyRecord> {
        let target = get(st, key, id)?;
        if target.id == key.id {
            if key.account_wide {
                return Err(ApiError::BadField {
                    code: runtime_api::codes::INVALID_REQUEST,
                    field: "id",
                    message: "The key in use is account-wide: revoke it on the server \
                              (`runtime keys revoke`), so no click leaves the server \
                              without an admin key."
                        .into(),
                });
            }
        } else {
            admin_only(key)?;
        }
        Ok(super::revoke_key(&st.config().store_at(), &target.id)?)
    }

    /// Sets or (with `None`) removes a key's daily spending limit: admins only.
    pub(crate) fn set_limit(
        st: &AppState,
        key: &KeyInfo,
        id: &str,
        micros: Option<i64>,
    ) -> ApiResult<KeyRecord> {
        admin_only(key)?;
        let target = get(st, key, id)?;
        super::set_daily_limit(&st.config().store_at(), &target.id, micros)
            .map_err(ApiError::from)
            .map_err(|e| match e {
                ApiError::Server(ServerError::KeyNotFound { .. }) => not_found(id),
                e => e,
            })
    }
}
