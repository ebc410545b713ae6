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

    /// Folds the charges of every minute before `before_minute` (a day's
    /// first minute) into one row per key, sandbox and UTC day (`minutes`
    /// 1440, at the day's first minute), in one transaction: sums by day
    /// and in all stay exact, and a sandbox kept for months holds a row a
    /// day instead of one a minute. The rows folded.
    pub fn fold_charges(&self, before_minute: i64) -> Result<usize, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin fold"))?;
        let days: Vec<(String, String, i64, i64, i64)> = {
            let mut stmt = tx
                .prepare(
                    "SELECT key_id, sandbox_id, minute / 1440, CAST(SUM(micros) AS BIGINT),
                            CAST(SUM(billed_ms) AS BIGINT)
                     FROM charges WHERE minutes = 1 AND minute < ?1
                     GROUP BY key_id, sandbox_id, minute / 1440",
                )
                .map_err(store_err("fold charges"))?;
            let rows = stmt
                .query_map(params![before_minute], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                })
                .map_err(store_err("fold charges"))?;
            rows.collect::<Result<_, _>>()
                .map_err(store_err("fold charges"))?
        };
        let folded = tx
            .execute(
                "DELETE FROM charges WHERE minutes = 1 AND minute < ?1",
                params![before_minute],
            )
            .map_err(store_err("fold charges"))?;
        for (key_id, sandbox_id, day, micros, billed_ms) in days {
            tx.execute(
                "INSERT INTO charges (key_id, sandbox_id, minute, micros, billed_ms, minutes)
                 VALUES (?1, ?2, ?3, ?4, ?5, 1440)
                 ON CONFLICT(key_id, sandbox_id, minute) DO UPDATE SET
                   micros = charges.micros + excluded.micros,
                   billed_ms = charges.billed_ms + excluded.billed_ms",
                params![key_id, sandbox_id, day * 1440, micros, billed_ms],
            )
            .map_err(store_err("fold charges"))?;
        }
        tx.commit().map_err(store_err("fold charges"))?;
        Ok(folded)
    }
}

#[cfg(test)]
mod tests {
    const DAY: i64 = 1440;

    #[test]
    fn old_minutes_fold_into_one_row_a_day_and_keep_every_sum() {
        crate::store::testing::each_engine(|s| {
            // Two days of sandbox a (key k), one of b (key j), and a recent
            // minute that must stay as it is.
            for (key, sb, minute, micros) in [
                ("k", "a", 10 * DAY + 5, 7),
                ("k", "a", 10 * DAY + 600, 11),
                ("k", "a", 11 * DAY + 1, 13),
                ("j", "b", 10 * DAY + 9, 17),
                ("k", "a", 40 * DAY + 3, 19),
            ] {
                s.save_charge(key, sb, minute, micros, 1000, 0).unwrap();
            }
            let by_day_before = s.charges_by_day(0).unwrap();
            let since_before = s.settled_since("k", 0).unwrap();

            assert_eq!(s.fold_charges(12 * DAY).unwrap(), 4);
            // Nothing left to fold: a second run changes nothing.
            assert_eq!(s.fold_charges(12 * DAY).unwrap(), 0);

            assert_eq!(s.charges_by_day(0).unwrap(), by_day_before);
            assert_eq!(s.settled_since("k", 0).unwrap(), since_before);
            let rows = s
                .charge_rows(0, 41 * DAY * 60_000, None, None, 100)
                .unwrap();
            let got: Vec<_> = rows
                .iter()
                .map(|r| {
                    (
                        r.sandbox_id.as_str(),
                        r.minute,
                        r.minutes,
                        r.micros,
                        r.billed_ms,
                    )
                })
                .collect();
            assert_eq!(
                got,
                [
                    ("a", 10 * DAY, DAY, 18, 2000),
                    ("b", 10 * DAY, DAY, 17, 1000),
                    ("a", 11 * DAY, DAY, 13, 1000),
                    ("a", 40 * DAY + 3, 1, 19, 1000),
                ]
            );
            // A folded day is in a range by its end: a range ending inside
            // day 10 does not hold it, one holding the day's end does.
            let mid = s
                .charge_rows(0, (10 * DAY + 700) * 60_000, None, None, 100)
                .unwrap();
            assert!(mid.is_empty());
            let day10 = s
                .charge_rows(
                    10 * DAY * 60_000,
                    11 * DAY * 60_000 + 1,
                    Some("k"),
                    None,
                    100,
                )
                .unwrap();
            assert_eq!(day10.len(), 1);
            assert_eq!((day10[0].minute, day10[0].micros), (10 * DAY, 18));
        });
    }
}
