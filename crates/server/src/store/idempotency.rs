//! Stored answers of idempotent requests.

use super::db::{params, Connection, OptionalExtension};

use super::{store_err, Store};
use crate::error::ServerError;

/// The kind of a record stored with the sandbox a create made, in the
/// same transaction, before its answer exists (`{"sandboxId": …}`): a
/// resend after a crash answers that sandbox instead of making another.
/// The answer, once there, replaces it.
pub(crate) const PENDING_SANDBOX: &str = "sandbox";
/// Likewise for a fork, stored with its copies (`{"sandboxIds": […],
/// "snapshotId": …|null}`).
pub(crate) const PENDING_FORK: &str = "fork";
/// Likewise for a snapshot, stored with its record (`{"snapshotId": …}`).
pub(crate) const PENDING_SNAPSHOT: &str = "snapshot";

#[derive(Debug, Clone)]
pub struct StoredAnswer {
    pub fingerprint: String,
    /// `json` (replay body), `stream` (body names the process to follow),
    /// [`PENDING_SANDBOX`], [`PENDING_FORK`] or [`PENDING_SNAPSHOT`].
    pub kind: String,
    pub status: u16,
    pub body: String,
    pub created_ms: i64,
}

impl Store {
    pub fn idem_get(
        &self,
        key_id: &str,
        idem_key: &str,
    ) -> Result<Option<StoredAnswer>, ServerError> {
        self.conn()
            .query_row(
                "SELECT fingerprint, kind, status, body, created_ms FROM idempotency WHERE key_id = ?1 AND idem_key = ?2",
                params![key_id, idem_key],
                |r| {
                    Ok(StoredAnswer {
                        fingerprint: r.get(0)?,
                        kind: r.get(1)?,
                        status: r.get(2)?,
                        body: r.get(3)?,
                        created_ms: r.get(4)?,
                    })
                },
            )
            .optional()
            .map_err(store_err("get idempotency"))
    }

    pub fn idem_put(
        &self,
        key_id: &str,
        idem_key: &str,
        a: &StoredAnswer,
    ) -> Result<(), ServerError> {
        put(&self.conn(), key_id, idem_key, a)
    }

    pub fn idem_purge(&self, older_than_ms: i64) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM idempotency WHERE created_ms < ?1",
                params![older_than_ms],
            )
            .map_err(store_err("purge idempotency"))
    }
}

/// Stores (or replaces) one answer on `conn`, which may be a transaction.
pub(super) fn put(
    conn: &Connection,
    key_id: &str,
    idem_key: &str,
    a: &StoredAnswer,
) -> Result<(), ServerError> {
    conn.execute(
        "INSERT INTO idempotency (key_id, idem_key, fingerprint, kind, status, body, created_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT (key_id, idem_key) DO UPDATE SET fingerprint = excluded.fingerprint,
           kind = excluded.kind, status = excluded.status, body = excluded.body,
           created_ms = excluded.created_ms",
        params![
            key_id,
            idem_key,
            a.fingerprint,
            a.kind,
            a.status,
            a.body,
            a.created_ms
        ],
    )
    .map(|_| ())
    .map_err(store_err("put idempotency"))
}
