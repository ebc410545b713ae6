//! API keys: found by hash on every request; made by `create_key`.

use super::db::{params, Connection, OptionalExtension};

use super::{store_err, Store};
use crate::domain::access::KeyInfo;
use crate::domain::quota::KeyQuotas;
use crate::error::ServerError;

/// Inserts a key row (used by `create_key`, on its own connection).
pub(crate) fn insert_key(
    conn: &Connection,
    id: &str,
    name: Option<&str>,
    hash: &str,
    read_only: bool,
    account_wide: bool,
    created_at: &str,
) -> Result<(), ServerError> {
    conn.execute(
        "INSERT INTO keys (id, name, hash, read_only, account_wide, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![id, name, hash, read_only, account_wide, created_at],
    )
    .map(|_| ())
    .map_err(store_err("insert key"))
}

impl Store {
    pub fn find_key(&self, hash: &str) -> Result<Option<KeyInfo>, ServerError> {
        self.conn()
            .query_row(
                "SELECT id, read_only, account_wide FROM keys WHERE hash = ?1 AND revoked_at IS NULL",
                params![hash],
                |r| Ok(KeyInfo { id: r.get(0)?, read_only: r.get(1)?, account_wide: r.get(2)? }),
            )
            .optional()
            .map_err(store_err("find key"))
    }

    /// The quotas the operator set for key `id` alone (none: the server's).
    pub(crate) fn key_quotas(&self, id: &str) -> Result<KeyQuotas, ServerError> {
        let text: Option<String> = self
            .conn()
            .query_row("SELECT quotas FROM keys WHERE id = ?1", params![id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(store_err("read key quotas"))?
            .flatten();
        match text {
            None => Ok(KeyQuotas::default()),
            Some(t) => serde_json::from_str(&t)
                .map_err(|e| super::corrupt(format!("the quotas of key {id}: {e}"))),
        }
    }

    /// The ids of the keys not revoked.
    pub(crate) fn live_key_ids(&self) -> Result<Vec<String>, ServerError> {
        let conn = self.conn();
        let mut q = conn
            .prepare("SELECT id FROM keys WHERE revoked_at IS NULL")
            .map_err(store_err("list keys"))?;
        let rows = q
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(store_err("list keys"))?;
        rows.collect::<Result<_, _>>()
            .map_err(store_err("list keys"))
    }
}
