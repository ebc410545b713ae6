//! The event log, webhooks and their deliveries (v10). An event's body is
//! its JSON exactly as listed and sent; a webhook's settings and sealed
//! secrets are one JSON document beside the columns queries filter on.

use super::db::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::{corrupt, store_err, Store};
use crate::error::ServerError;

/// One event as logged.
#[derive(Debug, Clone)]
pub(crate) struct EventRow {
    pub seq: i64,
    pub id: String,
    pub key_id: String,
    pub ty: String,
    pub resource_id: String,
    pub created_ms: i64,
    pub body: String,
}

/// A signing secret, sealed; `expires_ms` once a rotation replaced it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SealedSecret {
    pub sealed: String,
    pub expires_ms: Option<i64>,
}

/// A webhook as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WebhookRow {
    pub id: String,
    pub key_id: String,
    pub url: String,
    pub events: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub failing_since_ms: Option<i64>,
    /// The current secret first.
    pub secrets: Vec<SealedSecret>,
}

/// One try of a delivery.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Attempt {
    pub at_ms: i64,
    pub status: Option<u16>,
    pub duration_ms: i64,
    pub error: Option<String>,
    /// Sent by `:retry`, not by the schedule.
    pub manual: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct DeliveryRow {
    pub seq: i64,
    pub id: String,
    pub webhook_id: String,
    pub key_id: String,
    pub event_id: String,
    pub event_type: String,
    pub body: String,
    /// `pending`, `succeeded` or `failed`.
    pub state: String,
    /// Scheduled attempts made (manual ones are in `log` only).
    pub attempts: u32,
    /// When a pending delivery is next due.
    pub next_ms: Option<i64>,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub log: Vec<Attempt>,
}

/// What `list_events` filters on. `key_id: None` reads every key's.
pub(crate) struct EventQuery<'a> {
    pub key_id: Option<&'a str>,
    pub resource_id: Option<&'a str>,
    pub ty: Option<&'a str>,
    /// Only events older than this position.
    pub before_seq: Option<i64>,
    pub limit: i64,
}

const DELIVERY_COLS: &str = "seq, id, webhook_id, key_id, event_id, event_type, body, state, attempts, next_ms, created_ms, updated_ms, log";

fn delivery_row(r: &super::db::Row) -> super::db::DbResult<(DeliveryRow, String)> {
    Ok((
        DeliveryRow {
            seq: r.get(0)?,
            id: r.get(1)?,
            webhook_id: r.get(2)?,
            key_id: r.get(3)?,
            event_id: r.get(4)?,
            event_type: r.get(5)?,
            body: r.get(6)?,
            state: r.get(7)?,
            attempts: r.get(8)?,
            next_ms: r.get(9)?,
            created_ms: r.get(10)?,
            updated_ms: r.get(11)?,
            log: Vec::new(),
        },
        r.get(12)?,
    ))
}

fn parse_delivery((mut d, log): (DeliveryRow, String)) -> Result<DeliveryRow, ServerError> {
    d.log = serde_json::from_str(&log).map_err(|e| corrupt(format!("delivery log: {e}")))?;
    Ok(d)
}

fn to_json<T: Serialize>(v: &T) -> Result<String, ServerError> {
    serde_json::to_string(v).map_err(|e| corrupt(e.to_string()))
}

fn insert_delivery(conn: &Connection, d: &DeliveryRow) -> Result<(), ServerError> {
    conn.execute(
        "INSERT INTO webhook_deliveries (id, webhook_id, key_id, event_id, event_type, body, state, attempts, next_ms, created_ms, updated_ms, log)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        params![d.id, d.webhook_id, d.key_id, d.event_id, d.event_type, d.body, d.state,
                d.attempts, d.next_ms, d.created_ms, d.updated_ms, to_json(&d.log)?],
    )
    .map_err(store_err("insert delivery"))?;
    Ok(())
}

fn get_webhook_in(conn: &Connection, id: &str) -> Result<Option<WebhookRow>, ServerError> {
    let doc: Option<String> = conn
        .query_row("SELECT doc FROM webhooks WHERE id = ?1", params![id], |r| {
            r.get(0)
        })
        .optional()
        .map_err(store_err("get webhook"))?;
    doc.map(|d| serde_json::from_str(&d).map_err(|e| corrupt(format!("webhook: {e}"))))
        .transpose()
}

fn collect<T>(
    rows: impl Iterator<Item = super::db::DbResult<T>>,
    op: &'static str,
) -> Result<Vec<T>, ServerError> {
    rows.map(|r| r.map_err(store_err(op))).collect()
}

impl Store {
    /// Logs an event and queues its deliveries, in one transaction.
    pub(crate) fn insert_event(
        &self,
        e: &EventRow,
        deliveries: &[DeliveryRow],
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        tx.execute(
            "INSERT INTO events (id, key_id, type, resource_id, created_ms, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![e.id, e.key_id, e.ty, e.resource_id, e.created_ms, e.body],
        )
        .map_err(store_err("insert event"))?;
        for d in deliveries {
            insert_delivery(&tx, d)?;
        }
        tx.commit().map_err(store_err("commit"))
    }

    /// Events newest first.
    pub(crate) fn list_events(&self, q: &EventQuery<'_>) -> Result<Vec<EventRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT seq, id, key_id, type, resource_id, created_ms, body FROM events
                 WHERE (CAST(?1 AS TEXT) IS NULL OR key_id = ?1) AND (CAST(?2 AS TEXT) IS NULL OR resource_id = ?2)
                   AND (CAST(?3 AS TEXT) IS NULL OR type = ?3) AND (CAST(?4 AS BIGINT) IS NULL OR seq < ?4)
                 ORDER BY seq DESC LIMIT ?5",
            )
            .map_err(store_err("list events"))?;
        let rows = stmt
            .query_map(
                params![q.key_id, q.resource_id, q.ty, q.before_seq, q.limit],
                |r| {
                    Ok(EventRow {
                        seq: r.get(0)?,
                        id: r.get(1)?,
                        key_id: r.get(2)?,
                        ty: r.get(3)?,
                        resource_id: r.get(4)?,
                        created_ms: r.get(5)?,
                        body: r.get(6)?,
                    })
                },
            )
            .map_err(store_err("list events"))?;
        collect(rows, "list events")
    }

    /// Forgets events older than `before_ms` and all but the newest
    /// `keep`; finished deliveries likewise, and the oldest past `keep`
    /// whatever their state. Answers how many rows went.
    pub(crate) fn prune_events(
        &self,
        before_ms: i64,
        keep_events: i64,
        keep_deliveries: i64,
    ) -> Result<usize, ServerError> {
        let conn = self.conn();
        let mut n = conn
            .execute(
                "DELETE FROM events WHERE created_ms < ?1
                 OR seq <= (SELECT MAX(seq) FROM events) - ?2",
                params![before_ms, keep_events],
            )
            .map_err(store_err("prune events"))?;
        n += conn
            .execute(
                "DELETE FROM webhook_deliveries WHERE (state != 'pending' AND updated_ms < ?1)
                 OR seq <= (SELECT MAX(seq) FROM webhook_deliveries) - ?2",
                params![before_ms, keep_deliveries],
            )
            .map_err(store_err("prune deliveries"))?;
        Ok(n)
    }

    pub(crate) fn insert_webhook(&self, w: &WebhookRow) -> Result<(), ServerError> {
        let conn = self.conn();
        conn.execute(
            "INSERT INTO webhooks (id, key_id, created_ms, doc) VALUES (?1, ?2, ?3, ?4)",
            params![w.id, w.key_id, w.created_ms, to_json(w)?],
        )
        .map_err(store_err("insert webhook"))?;
        Ok(())
    }

    pub(crate) fn get_webhook(&self, id: &str) -> Result<Option<WebhookRow>, ServerError> {
        get_webhook_in(&self.conn(), id)
    }

    /// Webhooks oldest first; `key_id: None` reads every key's.
    pub(crate) fn list_webhooks(
        &self,
        key_id: Option<&str>,
    ) -> Result<Vec<WebhookRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT doc FROM webhooks WHERE (CAST(?1 AS TEXT) IS NULL OR key_id = ?1) ORDER BY created_ms, id")
            .map_err(store_err("list webhooks"))?;
        let docs = collect(
            stmt.query_map(params![key_id], |r| r.get::<_, String>(0))
                .map_err(store_err("list webhooks"))?,
            "list webhooks",
        )?;
        docs.iter()
            .map(|d| serde_json::from_str(d).map_err(|e| corrupt(format!("webhook: {e}"))))
            .collect()
    }

    /// The webhooks that hear of an event of `key_id`: its own and those
    /// of account-wide keys, of keys not revoked.
    pub(crate) fn webhooks_hearing(&self, key_id: &str) -> Result<Vec<WebhookRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT w.doc FROM webhooks w JOIN keys k ON k.id = w.key_id
                 WHERE k.revoked_at IS NULL AND (w.key_id = ?1 OR k.account_wide = 1)
                 ORDER BY w.created_ms, w.id",
            )
            .map_err(store_err("webhooks of an event"))?;
        let docs = collect(
            stmt.query_map(params![key_id], |r| r.get::<_, String>(0))
                .map_err(store_err("webhooks of an event"))?,
            "webhooks of an event",
        )?;
        docs.iter()
            .map(|d| serde_json::from_str(d).map_err(|e| corrupt(format!("webhook: {e}"))))
            .collect()
    }

    /// Read-modify-write of one webhook; `f` returns whether to write.
    pub(crate) fn update_webhook(
        &self,
        id: &str,
        f: impl FnOnce(&mut WebhookRow) -> bool,
    ) -> Result<Option<WebhookRow>, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let Some(mut w) = get_webhook_in(&tx, id)? else {
            return Ok(None);
        };
        if f(&mut w) {
            tx.execute(
                "UPDATE webhooks SET doc = ?2 WHERE id = ?1",
                params![id, to_json(&w)?],
            )
            .map_err(store_err("update webhook"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(Some(w))
    }

    /// Deletes a webhook and its deliveries.
    pub(crate) fn delete_webhook(&self, id: &str) -> Result<bool, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let n = tx
            .execute("DELETE FROM webhooks WHERE id = ?1", params![id])
            .map_err(store_err("delete webhook"))?;
        tx.execute(
            "DELETE FROM webhook_deliveries WHERE webhook_id = ?1",
            params![id],
        )
        .map_err(store_err("delete deliveries"))?;
        tx.commit().map_err(store_err("commit"))?;
        Ok(n > 0)
    }

    pub(crate) fn pending_deliveries(&self, key_id: &str) -> Result<i64, ServerError> {
        self.conn()
            .query_row(
                "SELECT COUNT(*) FROM webhook_deliveries WHERE key_id = ?1 AND state = 'pending'",
                params![key_id],
                |r| r.get(0),
            )
            .map_err(store_err("count deliveries"))
    }

    /// Pending deliveries due at `now`, soonest first, each claimed until
    /// `claim_until` so no other pass sends it meanwhile (and a restart
    /// takes it up after that).
    pub(crate) fn claim_due(
        &self,
        now: i64,
        claim_until: i64,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let due = {
            let mut stmt = tx
                .prepare(&format!(
                    "SELECT {DELIVERY_COLS} FROM webhook_deliveries
                     WHERE state = 'pending' AND next_ms <= ?1 ORDER BY next_ms, seq LIMIT ?2"
                ))
                .map_err(store_err("due deliveries"))?;
            let rows = collect(
                stmt.query_map(params![now, limit], delivery_row)
                    .map_err(store_err("due deliveries"))?,
                "due deliveries",
            )?;
            rows.into_iter()
                .map(parse_delivery)
                .collect::<Result<Vec<_>, _>>()?
        };
        for d in &due {
            tx.execute(
                "UPDATE webhook_deliveries SET next_ms = ?2 WHERE id = ?1",
                params![d.id, claim_until],
            )
            .map_err(store_err("claim delivery"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(due)
    }

    /// When the soonest pending delivery is due.
    pub(crate) fn next_due(&self) -> Result<Option<i64>, ServerError> {
        self.conn()
            .query_row(
                "SELECT MIN(next_ms) FROM webhook_deliveries WHERE state = 'pending'",
                [],
                |r| r.get(0),
            )
            .map_err(store_err("next delivery"))
    }

    pub(crate) fn get_delivery(&self, id: &str) -> Result<Option<DeliveryRow>, ServerError> {
        let conn = self.conn();
        let raw = conn
            .query_row(
                &format!("SELECT {DELIVERY_COLS} FROM webhook_deliveries WHERE id = ?1"),
                params![id],
                delivery_row,
            )
            .optional()
            .map_err(store_err("get delivery"))?;
        raw.map(parse_delivery).transpose()
    }

    /// Writes a delivery's outcome (state, attempts, schedule, log).
    pub(crate) fn save_delivery(&self, d: &DeliveryRow) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE webhook_deliveries SET state = ?2, attempts = ?3, next_ms = ?4, updated_ms = ?5, log = ?6
                 WHERE id = ?1",
                params![d.id, d.state, d.attempts, d.next_ms, d.updated_ms, to_json(&d.log)?],
            )
            .map_err(store_err("save delivery"))?;
        Ok(())
    }

    /// A webhook's deliveries newest first, older than `before_seq`.
    pub(crate) fn list_deliveries(
        &self,
        webhook_id: &str,
        state: Option<&str>,
        before_seq: Option<i64>,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {DELIVERY_COLS} FROM webhook_deliveries
                 WHERE webhook_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR state = ?2) AND (CAST(?3 AS BIGINT) IS NULL OR seq < ?3)
                 ORDER BY seq DESC LIMIT ?4"
            ))
            .map_err(store_err("list deliveries"))?;
        let rows = collect(
            stmt.query_map(params![webhook_id, state, before_seq, limit], delivery_row)
                .map_err(store_err("list deliveries"))?,
            "list deliveries",
        )?;
        rows.into_iter().map(parse_delivery).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(key: &str, n: i64, resource: &str) -> EventRow {
        EventRow {
            seq: 0,
            id: format!("e{n}"),
            key_id: key.into(),
            ty: if n % 2 == 0 {
                "sandbox.created"
            } else {
                "sandbox.stopped"
            }
            .into(),
            resource_id: resource.into(),
            created_ms: 1000 + n,
            body: format!("{{\"n\":{n}}}"),
        }
    }

    #[test]
    fn events_page_newest_first_per_key_and_filter() {
        crate::store::testing::each_engine(|s| {
            for n in 0..10 {
                s.insert_event(&event(if n < 7 { "a" } else { "b" }, n, "r1"), &[])
                    .unwrap();
            }
            let q = |key, before, limit| EventQuery {
                key_id: key,
                resource_id: None,
                ty: None,
                before_seq: before,
                limit,
            };
            let page = s.list_events(&q(Some("a"), None, 3)).unwrap();
            let ids: Vec<_> = page.iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids, ["e6", "e5", "e4"]);
            let next = s.list_events(&q(Some("a"), Some(page[2].seq), 3)).unwrap();
            let ids: Vec<_> = next.iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids, ["e3", "e2", "e1"]);
            let last = s.list_events(&q(Some("a"), Some(next[2].seq), 3)).unwrap();
            assert_eq!(last.len(), 1);
            // Another key's events are not among a key's.
            assert_eq!(s.list_events(&q(Some("b"), None, 50)).unwrap().len(), 3);
            assert_eq!(s.list_events(&q(None, None, 50)).unwrap().len(), 10);
            let typed = EventQuery {
                ty: Some("sandbox.stopped"),
                ..q(Some("a"), None, 50)
            };
            assert_eq!(s.list_events(&typed).unwrap().len(), 3);
            let other = EventQuery {
                resource_id: Some("r2"),
                ..q(Some("a"), None, 50)
            };
            assert!(s.list_events(&other).unwrap().is_empty());
            // Pruning by age, then by count.
            assert_eq!(s.prune_events(1002, 1000, 1000).unwrap(), 2);
            assert_eq!(s.prune_events(0, 5, 1000).unwrap(), 3);
            let left = s.list_events(&q(None, None, 50)).unwrap();
            let ids: Vec<_> = left.iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids, ["e9", "e8", "e7", "e6", "e5"]);
        });
    }
}
