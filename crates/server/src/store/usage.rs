//! The account's usage tables (v16): each key's outbound bytes per sandbox
//! and calendar month, its authenticated API answers per hour and
//! operation, and the settled charges the export pages through
//! (`service/usage.rs`, docs/billing.md).

use super::db::params;

use crate::error::ServerError;
use crate::store::{store_err, Store};

/// A key's API answers in one hour for one operation, by status class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestCount {
    /// Hours since the epoch.
    pub hour: i64,
    pub key_id: String,
    pub operation: String,
    pub calls: u64,
    pub client_errors: u64,
    pub server_errors: u64,
}

/// One settled row of the export: what a sandbox was charged in one minute.
#[derive(Debug, Clone)]
pub struct ChargeRow {
    pub key_id: String,
    pub sandbox_id: String,
    /// Minutes since the epoch: the row's first.
    pub minute: i64,
    /// Minutes the row spans: 1, or 1440 for a day folded into one row.
    pub minutes: i64,
    pub micros: i64,
    /// Milliseconds of that minute the sandbox was billed for.
    pub billed_ms: i64,
    /// The sandbox's name, if it has one.
    pub name: Option<String>,
    /// The sandbox is deleted (or unknown): it can be charged nothing more.
    pub ended: bool,
}

/// Where a page of the export starts: after this minute and sandbox.
type ExportAfter = (i64, String);

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl Store {
    /// Adds each sandbox's outbound bytes to its key's `month` (YYYYMM),
    /// in one transaction. Bytes of a sandbox the store does not know (a
    /// warm machine no create took) are left out; answers how many bytes
    /// were kept.
    pub fn add_outbound(&self, month: i64, bytes: &[(String, u64)]) -> Result<u64, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin outbound"))?;
        let mut kept = 0u64;
        for (sandbox_id, n) in bytes {
            let added = tx
                .execute(
                    "INSERT INTO outbound (key_id, sandbox_id, month, bytes)
                     SELECT key_id, id, ?2, ?3 FROM sandboxes WHERE id = ?1
                     ON CONFLICT(key_id, sandbox_id, month) DO UPDATE SET bytes = outbound.bytes + excluded.bytes",
                    params![sandbox_id, month, to_i64(*n)],
                )
                .map_err(store_err("add outbound"))?;
            if added > 0 {
                kept = kept.saturating_add(*n);
            }
        }
        tx.commit().map_err(store_err("commit outbound"))?;
        Ok(kept)
    }

    /// Each key's outbound bytes in `month` (YYYYMM).
    pub fn outbound_by_key(&self, month: i64) -> Result<Vec<(String, u64)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT key_id, CAST(SUM(bytes) AS BIGINT) FROM outbound WHERE month = ?1
                 GROUP BY key_id ORDER BY key_id",
            )
            .map_err(store_err("sum outbound"))?;
        let rows = stmt
            .query_map(params![month], |r| {
                Ok((r.get::<_, String>(0)?, to_u64(r.get::<_, i64>(1)?)))
            })
            .map_err(store_err("sum outbound"))?;
        rows.map(|r| r.map_err(store_err("sum outbound"))).collect()
    }

    /// Adds counted answers, and forgets hours before `keep_from`, in one
    /// transaction.
    pub fn add_request_counts(
        &self,
        counts: &[RequestCount],
        keep_from: i64,
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin requests"))?;
        for c in counts {
            tx.execute(
                "INSERT INTO request_counts (hour, key_id, operation, calls, client_errors, server_errors)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT(hour, key_id, operation) DO UPDATE SET
                   calls = request_counts.calls + excluded.calls,
                   client_errors = request_counts.client_errors + excluded.client_errors,
                   server_errors = request_counts.server_errors + excluded.server_errors",
                params![
                    c.hour,
                    c.key_id,
                    c.operation,
                    to_i64(c.calls),
                    to_i64(c.client_errors),
                    to_i64(c.server_errors)
                ],
            )
            .map_err(store_err("add requests"))?;
        }
        tx.execute(
            "DELETE FROM request_counts WHERE hour < ?1",
            params![keep_from],
        )
        .map_err(store_err("forget old requests"))?;
        tx.commit().map_err(store_err("commit requests"))
    }

    /// Counted answers from hour `from` on, of `key_id` (every key's with
    /// `None`).
    pub fn request_counts(
        &self,
        from: i64,
        key_id: Option<&str>,
    ) -> Result<Vec<RequestCount>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT hour, key_id, operation, calls, client_errors, server_errors
                 FROM request_counts WHERE hour >= ?1 AND (CAST(?2 AS TEXT) IS NULL OR key_id = ?2)
                 ORDER BY hour, operation",
            )
            .map_err(store_err("read requests"))?;
        let rows = stmt
            .query_map(params![from, key_id], |r| {
                Ok(RequestCount {
                    hour: r.get(0)?,
                    key_id: r.get(1)?,
                    operation: r.get(2)?,
                    calls: to_u64(r.get(3)?),
                    client_errors: to_u64(r.get(4)?),
                    server_errors: to_u64(r.get(5)?),
                })
            })
            .map_err(store_err("read requests"))?;
        rows.map(|r| r.map_err(store_err("read requests")))
            .collect()
    }

    /// Up to `limit` settled charge rows whose minute ends in
    /// `[since_ms, until_ms)`, of `key_id` (every key's with `None`), in
    /// order of minute and sandbox, after `after`.
    pub fn charge_rows(
        &self,
        since_ms: i64,
        until_ms: i64,
        key_id: Option<&str>,
        after: Option<&ExportAfter>,
        limit: usize,
    ) -> Result<Vec<ChargeRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT c.key_id, c.sandbox_id, c.minute, c.micros, c.billed_ms, s.name,
                        s.id IS NULL OR s.deleted IS NOT NULL, c.minutes
                 FROM charges c LEFT JOIN sandboxes s ON s.id = c.sandbox_id
                 WHERE c.minute + c.minutes - 1 >= ?1 AND c.minute + c.minutes - 1 < ?2
                   AND (CAST(?3 AS TEXT) IS NULL OR c.key_id = ?3)
                   AND (c.minute > ?4 OR (c.minute = ?4 AND c.sandbox_id > ?5))
                 ORDER BY c.minute, c.sandbox_id
                 LIMIT ?6",
            )
            .map_err(store_err("read charges"))?;
        // A row's last minute m ends at (m + 1) minutes: since <= end < until.
        let first = since_ms.div_euclid(60_000) + i64::from(since_ms.rem_euclid(60_000) != 0) - 1;
        let end = (until_ms - 1).div_euclid(60_000);
        let (after_minute, after_id) = match after {
            Some((m, id)) => (*m, id.as_str()),
            None => (i64::MIN, ""),
        };
        let rows = stmt
            .query_map(
                params![
                    first,
                    end,
                    key_id,
                    after_minute,
                    after_id,
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                |r| {
                    Ok(ChargeRow {
                        key_id: r.get(0)?,
                        sandbox_id: r.get(1)?,
                        minute: r.get(2)?,
                        micros: r.get(3)?,
                        billed_ms: r.get(4)?,
                        name: r.get(5)?,
                        ended: r.get(6)?,
                        minutes: r.get(7)?,
                    })
                },
            )
            .map_err(store_err("read charges"))?;
        rows.map(|r| r.map_err(store_err("read charges"))).collect()
    }
}
