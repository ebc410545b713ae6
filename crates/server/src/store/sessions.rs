//! Sandbox sessions (v11): found by their token's hash on every request
//! made with one, together with the key that made them (a revoked key ends
//! its sessions).

use super::db::{params, OptionalExtension};

use super::{corrupt, store_err, Store};
use crate::domain::access::KeyInfo;
use crate::domain::session::Session;
use crate::error::ServerError;

const COLUMNS: &str =
    "s.id, s.sandbox_id, s.key_id, s.name, s.origins, s.created_ms, s.expires_ms, s.revoked_ms";

type Raw = (
    String,
    String,
    String,
    Option<String>,
    String,
    i64,
    i64,
    Option<i64>,
);

fn raw(r: &super::db::Row) -> super::db::DbResult<Raw> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

fn parse(
    (id, sandbox_id, key_id, name, origins, created_ms, expires_ms, revoked_ms): Raw,
) -> Result<Session, ServerError> {
    let origins: Vec<String> =
        serde_json::from_str(&origins).map_err(|e| corrupt(format!("session origins: {e}")))?;
    Ok(Session {
        id,
        sandbox_id,
        key_id,
        name,
        origins,
        created_ms,
        expires_ms,
        revoked_ms,
    })
}

impl Store {
    pub(crate) fn insert_session(&self, s: &Session, hash: &str) -> Result<(), ServerError> {
        let origins = serde_json::to_string(&s.origins).map_err(|e| corrupt(e.to_string()))?;
        self.conn()
            .execute(
                "INSERT INTO sandbox_sessions (id, sandbox_id, key_id, hash, name, origins, created_ms, expires_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![s.id, s.sandbox_id, s.key_id, hash, s.name, origins, s.created_ms, s.expires_ms],
            )
            .map(|_| ())
            .map_err(store_err("insert session"))
    }

    /// The session a token's hash names, with the key that made it, when
    /// that key is not revoked (the session may still have ended).
    pub(crate) fn find_session(
        &self,
        hash: &str,
    ) -> Result<Option<(Session, KeyInfo)>, ServerError> {
        let sql = format!(
            "SELECT {COLUMNS}, k.read_only, k.account_wide FROM sandbox_sessions s \
             JOIN keys k ON k.id = s.key_id WHERE s.hash = ?1 AND k.revoked_at IS NULL"
        );
        let found = self
            .conn()
            .query_row(&sql, params![hash], |r| {
                Ok((raw(r)?, r.get::<_, bool>(8)?, r.get::<_, bool>(9)?))
            })
            .optional()
            .map_err(store_err("find session"))?;
        let Some((row, read_only, account_wide)) = found else {
            return Ok(None);
        };
        let s = parse(row)?;
        let key = KeyInfo {
            id: s.key_id.clone(),
            read_only,
            account_wide,
        };
        Ok(Some((s, key)))
    }

    pub(crate) fn get_session(
        &self,
        sandbox_id: &str,
        id: &str,
    ) -> Result<Option<Session>, ServerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM sandbox_sessions s WHERE s.sandbox_id = ?1 AND s.id = ?2"
        );
        let row = self
            .conn()
            .query_row(&sql, params![sandbox_id, id], raw)
            .optional()
            .map_err(store_err("get session"))?;
        row.map(parse).transpose()
    }

    /// A sandbox's sessions still live at `now` or ended since `since`,
    /// newest first.
    pub(crate) fn list_sessions(
        &self,
        sandbox_id: &str,
        since: i64,
    ) -> Result<Vec<Session>, ServerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM sandbox_sessions s WHERE s.sandbox_id = ?1 \
             AND s.expires_ms >= ?2 AND (s.revoked_ms IS NULL OR s.revoked_ms >= ?2) \
             ORDER BY s.created_ms DESC, s.id DESC"
        );
        let conn = self.conn();
        let mut stmt = conn.prepare(&sql).map_err(store_err("list sessions"))?;
        let rows = stmt
            .query_map(params![sandbox_id, since], raw)
            .map_err(store_err("list sessions"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(store_err("list sessions"))?;
        rows.into_iter().map(parse).collect()
    }

    /// Ends a live session at `now`; false when it had already ended.
    pub(crate) fn revoke_session(
        &self,
        sandbox_id: &str,
        id: &str,
        now: i64,
    ) -> Result<bool, ServerError> {
        self.conn()
            .execute(
                "UPDATE sandbox_sessions SET revoked_ms = ?3 \
                 WHERE sandbox_id = ?1 AND id = ?2 AND revoked_ms IS NULL AND expires_ms > ?3",
                params![sandbox_id, id, now],
            )
            .map(|n| n > 0)
            .map_err(store_err("revoke session"))
    }

    /// Forgets sessions that ended before `before`, and every session of
    /// sandboxes that are deleted: nothing is kept without bound.
    pub(crate) fn prune_sessions(&self, before: i64) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM sandbox_sessions WHERE \
                 expires_ms < ?1 OR revoked_ms < ?1 \
                 OR sandbox_id IN (SELECT id FROM sandboxes WHERE deleted IS NOT NULL)",
                params![before],
            )
            .map_err(store_err("prune sessions"))
    }
}

impl Store {
    /// Whether some live session lists `origin` (a CORS preflight's check).
    pub(crate) fn origin_in_live_session(
        &self,
        origin: &str,
        now: i64,
    ) -> Result<bool, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT origins FROM sandbox_sessions \
                 WHERE revoked_ms IS NULL AND expires_ms > ?1 AND origins LIKE ?2 ESCAPE '\\'",
            )
            .map_err(store_err("session origins"))?;
        let like = format!(
            "%{}%",
            origin
                .replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_")
        );
        let rows = stmt
            .query_map(params![now, like], |r| r.get::<_, String>(0))
            .map_err(store_err("session origins"))?;
        for row in rows {
            let origins: Vec<String> =
                serde_json::from_str(&row.map_err(store_err("session origins"))?)
                    .map_err(|e| corrupt(format!("session origins: {e}")))?;
            if origins.iter().any(|o| o == origin) {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
