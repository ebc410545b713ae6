//! The meter's tables: each sandbox's remainder below a microdollar, and
//! charges per key, sandbox and minute (the 24-hour window and
//! `GET /v1/usage`); a key's daily limit and name.

use super::db::{params, OptionalExtension};

use crate::error::ServerError;
use crate::store::{store_err, Store};

/// What one sandbox of a key was charged: in all, and since a minute.
pub struct SandboxCharges {
    pub key_id: String,
    pub sandbox_id: String,
    pub total: i64,
    pub since: i64,
}

impl Store {
    /// A key's daily spending limit, if it has one.
    pub fn daily_limit(&self, key_id: &str) -> Result<Option<i64>, ServerError> {
        self.conn()
            .query_row(
                "SELECT daily_limit_micros FROM keys WHERE id = ?1",
                params![key_id],
                |r| r.get::<_, Option<i64>>(0),
            )
            .optional()
            .map(Option::flatten)
            .map_err(store_err("read daily limit"))
    }

    /// Microdollars a key's sandboxes settled after `minute`.
    pub fn settled_since(&self, key_id: &str, minute: i64) -> Result<i64, ServerError> {
        self.conn()
            .query_row(
                "SELECT CAST(COALESCE(SUM(micros), 0) AS BIGINT) FROM charges WHERE key_id = ?1 AND minute > ?2",
                params![key_id, minute],
                |r| r.get(0),
            )
            .map_err(store_err("sum charges"))
    }

    /// A sandbox's metered remainder below one microdollar.
    pub fn meter_remainder(&self, id: &str) -> Result<i128, ServerError> {
        let r: Option<i64> = self
            .conn()
            .query_row(
                "SELECT remainder FROM meter WHERE sandbox_id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("read meter"))?;
        Ok(i128::from(r.unwrap_or(0)))
    }

    /// Keeps the remainder and adds the settled microdollars and the
    /// billed milliseconds to the minute's charges, in one transaction.
    pub fn save_charge(
        &self,
        key_id: &str,
        id: &str,
        minute: i64,
        whole: i64,
        billed_ms: i64,
        remainder: i128,
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin charge"))?;
        tx.execute(
            "INSERT INTO meter (sandbox_id, remainder) VALUES (?1, ?2)
             ON CONFLICT(sandbox_id) DO UPDATE SET remainder = excluded.remainder",
            params![id, i64::try_from(remainder).unwrap_or(0)],
        )
        .map_err(store_err("write meter"))?;
        if whole > 0 || billed_ms > 0 {
            tx.execute(
                "INSERT INTO charges (key_id, sandbox_id, minute, micros, billed_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(key_id, sandbox_id, minute) DO UPDATE SET
                   micros = charges.micros + excluded.micros, billed_ms = charges.billed_ms + excluded.billed_ms",
                params![key_id, id, minute, whole, billed_ms],
            )
            .map_err(store_err("write charge"))?;
        }
        tx.commit().map_err(store_err("commit charge"))
    }

    /// Every key's id and name.
    pub fn key_names(&self) -> Result<Vec<(String, Option<String>)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT id, name FROM keys")
            .map_err(store_err("list keys"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
            })
            .map_err(store_err("list keys"))?;
        rows.map(|r| r.map_err(store_err("list keys"))).collect()
    }

    /// The name of the key `id`, if it has one.
    pub fn key_name(&self, id: &str) -> Result<Option<String>, ServerError> {
        Ok(self
            .conn()
            .query_row("SELECT name FROM keys WHERE id = ?1", params![id], |r| {
                r.get::<_, Option<String>>(0)
            })
            .optional()
            .map_err(store_err("read key"))?
            .flatten())
    }

    /// Each sandbox's charges, in all and after `minute`.
    pub fn charges_by_sandbox(&self, minute: i64) -> Result<Vec<SandboxCharges>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT key_id, sandbox_id, CAST(SUM(micros) AS BIGINT), CAST(SUM(CASE WHEN minute > ?1 THEN micros ELSE 0 END) AS BIGINT)
                 FROM charges GROUP BY key_id, sandbox_id",
            )
            .map_err(store_err("sum charges"))?;
        let rows = stmt
            .query_map(params![minute], |r| {
                Ok(SandboxCharges {
                    key_id: r.get(0)?,
                    sandbox_id: r.get(1)?,
                    total: r.get(2)?,
                    since: r.get(3)?,
                })
            })
            .map_err(store_err("sum charges"))?;
        rows.map(|r| r.map_err(store_err("sum charges"))).collect()
    }

    /// Each key's charges per UTC day (days since the epoch) after `minute`,
    /// oldest day first.
    pub fn charges_by_day(&self, minute: i64) -> Result<Vec<(i64, String, i64)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT minute / 1440 AS day, key_id, CAST(SUM(micros) AS BIGINT) FROM charges
                 WHERE minute > ?1 GROUP BY day, key_id ORDER BY day, key_id",
            )
            .map_err(store_err("sum charges by day"))?;
        let rows = stmt
            .query_map(params![minute], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(store_err("sum charges by day"))?;
        rows.map(|r| r.map_err(store_err("sum charges by day")))
            .collect()
    }
}
