//! Snapshots.

use super::db::{params, Connection, OptionalExtension};

use super::{corrupt, store_err, Store, StoredAnswer};
use crate::domain::snapshot::Snapshot;
use crate::error::ServerError;

/// A snapshot as stored: its public record and its owner.
#[derive(Debug, Clone)]
pub struct SnapshotRow {
    pub seq: i64,
    pub key_id: String,
    pub record: Snapshot,
    /// When it was deleted; the record is then invisible.
    pub deleted: Option<String>,
}

type RawSnapshot = (i64, String, String, Option<String>);

fn raw_snapshot(r: &super::db::Row) -> super::db::DbResult<RawSnapshot> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
}

fn parse_snapshot((seq, key_id, record, deleted): RawSnapshot) -> Result<SnapshotRow, ServerError> {
    let record: Snapshot =
        serde_json::from_str(&record).map_err(|e| corrupt(format!("snapshot record: {e}")))?;
    Ok(SnapshotRow {
        seq,
        key_id,
        record,
        deleted,
    })
}

fn get_snapshot_row(conn: &Connection, id: &str) -> Result<Option<SnapshotRow>, ServerError> {
    let raw = conn
        .query_row(
            "SELECT seq, key_id, record, deleted FROM snapshots WHERE id = ?1",
            params![id],
            raw_snapshot,
        )
        .optional()
        .map_err(store_err("get snapshot"))?;
    raw.map(parse_snapshot).transpose()
}

impl Store {
    pub fn insert_snapshot(&self, key_id: &str, s: &Snapshot) -> Result<(), ServerError> {
        self.insert_snapshot_answered(key_id, s, None)
    }

    /// Inserts the snapshot and, in the same transaction, `answer` as the
    /// idempotency record of the request that made it.
    pub fn insert_snapshot_answered(
        &self,
        key_id: &str,
        s: &Snapshot,
        answer: Option<(&str, &str, &StoredAnswer)>,
    ) -> Result<(), ServerError> {
        let record = serde_json::to_string(s).map_err(|e| corrupt(e.to_string()))?;
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        tx.execute(
            "INSERT INTO snapshots (id, key_id, sandbox_id, state, record) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![s.id, key_id, s.sandbox_id, s.state, record],
        )
        .map_err(store_err("insert snapshot"))?;
        if let Some((key_id, idem_key, a)) = answer {
            super::idempotency::put(&tx, key_id, idem_key, a)?;
        }
        tx.commit().map_err(store_err("commit"))
    }

    pub fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, ServerError> {
        let conn = self.conn();
        get_snapshot_row(&conn, id)
    }

    /// Read-modify-write of one snapshot; `f` returns whether to write.
    pub fn update_snapshot(
        &self,
        id: &str,
        f: impl FnOnce(&mut SnapshotRow) -> bool,
    ) -> Result<Option<SnapshotRow>, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let Some(mut row) = get_snapshot_row(&tx, id)? else {
            return Ok(None);
        };
        if f(&mut row) {
            let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
            tx.execute(
                "UPDATE snapshots SET state = ?2, record = ?3, deleted = ?4 WHERE id = ?1",
                params![id, row.record.state, record, row.deleted],
            )
            .map_err(store_err("update snapshot"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(Some(row))
    }

    /// Every snapshot whose capture has not ended, deleted ones included
    /// (their directory waits for the capture's end).
    pub fn capturing_snapshots(&self) -> Result<Vec<SnapshotRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT seq, key_id, record, deleted FROM snapshots WHERE state = 'capturing'")
            .map_err(store_err("list capturing snapshots"))?;
        let rows = stmt
            .query_map([], raw_snapshot)
            .map_err(store_err("list capturing snapshots"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_snapshot(
                r.map_err(store_err("list capturing snapshots"))?,
            )?);
        }
        Ok(out)
    }

    /// Every snapshot not deleted, newest first.
    pub fn live_snapshots(&self) -> Result<Vec<SnapshotRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT seq, key_id, record, deleted FROM snapshots WHERE deleted IS NULL ORDER BY seq DESC")
            .map_err(store_err("list snapshots"))?;
        let rows = stmt
            .query_map([], raw_snapshot)
            .map_err(store_err("list snapshots"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_snapshot(r.map_err(store_err("list snapshots"))?)?);
        }
        Ok(out)
    }
}
