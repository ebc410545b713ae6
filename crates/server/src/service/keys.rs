//! API keys as the operator manages them on the server (`runtime keys
//! list|revoke|limit`, docs/keys.md). Each call opens its own connection, so
//! it works while a server runs on the same data directory, and every
//! change takes effect on the server's next request: keys are looked up by
//! hash on every request. Only a key's SHA-256 is stored.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use crate::error::ServerError;
use crate::service::clock::now_iso;
use crate::store::{open_connection, store_err};

/// A key as listed (never the key itself: only its hash is kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: Option<String>,
    pub read_only: bool,
    pub account_wide: bool,
    pub daily_limit_micros: Option<i64>,
    pub created_at: String,
    pub revoked_at: Option<String>,
}

fn all(conn: &Connection) -> Result<Vec<KeyRecord>, ServerError> {
    let mut stmt = conn
        .prepare(
            "SELECT id, name, read_only, account_wide, daily_limit_micros, created_at, revoked_at
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
            })
        })
        .map_err(store_err("list keys"))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(store_err("list keys"))
}

/// Every key of the data directory, oldest first, revoked ones included.
pub fn list_keys(data_dir: &Path) -> Result<Vec<KeyRecord>, ServerError> {
    all(&open_connection(data_dir)?)
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
pub fn revoke_key(data_dir: &Path, which: &str) -> Result<KeyRecord, ServerError> {
    let conn = open_connection(data_dir)?;
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
    data_dir: &Path,
    which: &str,
    micros: Option<i64>,
) -> Result<KeyRecord, ServerError> {
    let conn = open_connection(data_dir)?;
    let k = find(&conn, which)?;
    set_limit_on(&conn, &k.id, micros)?;
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
