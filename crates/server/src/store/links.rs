//! File links (v11), found by their token's hash.

use super::db::{params, OptionalExtension};

use super::{store_err, Store};
use crate::domain::link::Link;
use crate::error::ServerError;

const COLUMNS: &str = "id, sandbox_id, key_id, path, method, filename, max_bytes, wake, archive, created_ms, expires_ms, revoked_ms";

fn link(r: &super::db::Row) -> super::db::DbResult<Link> {
    Ok(Link {
        id: r.get(0)?,
        sandbox_id: r.get(1)?,
        key_id: r.get(2)?,
        path: r.get(3)?,
        method: r.get(4)?,
        filename: r.get(5)?,
        max_bytes: r.get::<_, Option<i64>>(6)?.map(|n| n.max(0) as u64),
        wake: r.get(7)?,
        archive: r.get(8)?,
        created_ms: r.get(9)?,
        expires_ms: r.get(10)?,
        revoked_ms: r.get(11)?,
    })
}

impl Store {
    pub(crate) fn insert_link(&self, l: &Link, hash: &str) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "INSERT INTO file_links (id, sandbox_id, key_id, hash, path, method, filename, max_bytes, wake, archive, created_ms, expires_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                params![
                    l.id,
                    l.sandbox_id,
                    l.key_id,
                    hash,
                    l.path,
                    l.method,
                    l.filename,
                    l.max_bytes.map(|n| n as i64),
                    l.wake,
                    l.archive,
                    l.created_ms,
                    l.expires_ms
                ],
            )
            .map(|_| ())
            .map_err(store_err("insert link"))
    }

    /// The link a token's hash names, when the key that made it is not
    /// revoked.
    pub(crate) fn find_link(&self, hash: &str) -> Result<Option<Link>, ServerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM file_links WHERE hash = ?1 \
             AND key_id IN (SELECT id FROM keys WHERE revoked_at IS NULL)"
        );
        self.conn()
            .query_row(&sql, params![hash], link)
            .optional()
            .map_err(store_err("find link"))
    }

    /// How many of the sandbox's links are live at `now`.
    pub(crate) fn live_links(&self, sandbox_id: &str, now: i64) -> Result<usize, ServerError> {
        self.conn()
            .query_row(
                "SELECT COUNT(*) FROM file_links WHERE sandbox_id = ?1 AND revoked_ms IS NULL AND expires_ms > ?2",
                params![sandbox_id, now],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n.max(0) as usize)
            .map_err(store_err("count links"))
    }

    /// Ends every live link of the sandbox; how many.
    pub(crate) fn revoke_links(&self, sandbox_id: &str, now: i64) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "UPDATE file_links SET revoked_ms = ?2 WHERE sandbox_id = ?1 AND revoked_ms IS NULL AND expires_ms > ?2",
                params![sandbox_id, now],
            )
            .map_err(store_err("revoke links"))
    }

    /// Forgets links that ended before `before`, and those of deleted
    /// sandboxes.
    pub(crate) fn prune_links(&self, before: i64) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM file_links WHERE expires_ms < ?1 OR revoked_ms < ?1 \
                 OR sandbox_id IN (SELECT id FROM sandboxes WHERE deleted IS NOT NULL)",
                params![before],
            )
            .map_err(store_err("prune links"))
    }
}
