//! Sandboxes: the public record as JSON beside the columns lists filter on.
//! The rules that follow from a state (status, holds) are applied on write.

use super::db::{params, Connection, OptionalExtension};
use runtime_api::{DeletedSandbox, Sandbox};

use super::{corrupt, store_err, Store, StoredAnswer};
use crate::error::ServerError;

/// A sandbox as stored: its public record plus what is never echoed.
#[derive(Debug, Clone)]
pub struct SandboxRow {
    pub seq: i64,
    pub key_id: String,
    pub record: Sandbox,
    pub env: Vec<(String, String)>,
    /// Set once deleted; the record is then invisible to GET and list.
    pub deleted: Option<DeletedSandbox>,
}

type RawRow = (i64, String, String, String, Option<String>);

fn raw_row(r: &super::db::Row) -> super::db::DbResult<RawRow> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

fn parse_row((seq, key_id, record, env, deleted): RawRow) -> Result<SandboxRow, ServerError> {
    let record: Sandbox =
        serde_json::from_str(&record).map_err(|e| corrupt(format!("sandbox record: {e}")))?;
    let env = serde_json::from_str(&env).map_err(|e| corrupt(format!("sandbox env: {e}")))?;
    let deleted = match deleted {
        Some(d) => {
            Some(serde_json::from_str(&d).map_err(|e| corrupt(format!("deleted record: {e}")))?)
        }
        None => None,
    };
    Ok(SandboxRow {
        seq,
        key_id,
        record,
        env,
        deleted,
    })
}

fn get_row(conn: &Connection, id: &str) -> Result<Option<SandboxRow>, ServerError> {
    let raw = conn
        .query_row(
            "SELECT seq, key_id, record, env, deleted FROM sandboxes WHERE id = ?1",
            params![id],
            raw_row,
        )
        .optional()
        .map_err(store_err("get sandbox"))?;
    raw.map(parse_row).transpose()
}

impl Store {
    pub fn insert_sandbox(&self, row: &SandboxRow) -> Result<i64, ServerError> {
        self.insert_sandbox_answered(row, None)
    }

    /// Inserts the sandbox and, in the same transaction, `answer` as the
    /// idempotency record `(key_id, idem_key)` of the request that made it:
    /// a crash leaves both or neither.
    pub fn insert_sandbox_answered(
        &self,
        row: &SandboxRow,
        answer: Option<(&str, &str, &StoredAnswer)>,
    ) -> Result<i64, ServerError> {
        let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
        let env = serde_json::to_string(&row.env).map_err(|e| corrupt(e.to_string()))?;
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let seq: i64 = tx
            .query_row(
                "INSERT INTO sandboxes (id, key_id, name, state, record, env, node) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING seq",
                params![row.record.id, row.key_id, row.record.name, row.record.state.as_str(), record, env, self.node],
                |r| r.get(0),
            )
            .map_err(store_err("insert sandbox"))?;
        if let Some((key_id, idem_key, a)) = answer {
            super::idempotency::put(&tx, key_id, idem_key, a)?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(seq)
    }

    /// Inserts the sandboxes (a fork's copies) and, in the same
    /// transaction, `answer` as the idempotency record of the request that
    /// made them: a crash leaves all of them and the record, or none.
    pub fn insert_sandboxes_answered(
        &self,
        rows: &[SandboxRow],
        answer: Option<(&str, &str, &StoredAnswer)>,
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        for row in rows {
            let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
            let env = serde_json::to_string(&row.env).map_err(|e| corrupt(e.to_string()))?;
            tx.execute(
                "INSERT INTO sandboxes (id, key_id, name, state, record, env, node) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![row.record.id, row.key_id, row.record.name, row.record.state.as_str(), record, env, self.node],
            )
            .map_err(store_err("insert sandbox"))?;
        }
        if let Some((key_id, idem_key, a)) = answer {
            super::idempotency::put(&tx, key_id, idem_key, a)?;
        }
        tx.commit().map_err(store_err("commit"))
    }

    pub fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRow>, ServerError> {
        let conn = self.conn();
        get_row(&conn, id)
    }

    /// Read-modify-write of one sandbox in a transaction. `f` returns whether
    /// to write; the row as it is afterwards is returned.
    pub fn update_sandbox(
        &self,
        id: &str,
        f: impl FnOnce(&mut SandboxRow) -> bool,
    ) -> Result<Option<SandboxRow>, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let Some(mut row) = get_row(&tx, id)? else {
            return Ok(None);
        };
        if f(&mut row) {
            crate::domain::sandbox::follow_state(&mut row.record, row.deleted.is_some());
            let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
            let env = serde_json::to_string(&row.env).map_err(|e| corrupt(e.to_string()))?;
            let deleted = match &row.deleted {
                Some(d) => Some(serde_json::to_string(d).map_err(|e| corrupt(e.to_string()))?),
                None => None,
            };
            tx.execute(
                "UPDATE sandboxes SET name = ?2, state = ?3, record = ?4, env = ?5, deleted = ?6 WHERE id = ?1",
                params![id, row.record.name, row.record.state.as_str(), record, env, deleted],
            )
            .map_err(store_err("update sandbox"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(Some(row))
    }

    /// How many sandboxes not deleted are in each state (states with none
    /// are left out), for the operator's metrics.
    pub fn count_by_state(&self) -> Result<Vec<(String, u64)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT state, COUNT(*) FROM sandboxes WHERE deleted IS NULL GROUP BY state ORDER BY state",
            )
            .map_err(store_err("count sandboxes"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
            .map_err(store_err("count sandboxes"))?;
        let mut out = Vec::new();
        for r in rows {
            let (state, n) = r.map_err(store_err("count sandboxes"))?;
            out.push((state, u64::try_from(n).unwrap_or(0)));
        }
        Ok(out)
    }

    /// Every sandbox not deleted, newest first.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRow>, ServerError> {
        self.live(None)
    }

    /// Every sandbox not deleted whose machines are this node's, newest
    /// first: the ones its leases, meter and recovery act on.
    pub fn live_sandboxes_here(&self) -> Result<Vec<SandboxRow>, ServerError> {
        self.live(Some(&self.node))
    }

    /// Every sandbox not deleted whose machines are node `node`'s.
    pub fn live_sandboxes_of(&self, node: &str) -> Result<Vec<SandboxRow>, ServerError> {
        self.live(Some(node))
    }

    fn live(&self, node: Option<&str>) -> Result<Vec<SandboxRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT seq, key_id, record, env, deleted FROM sandboxes WHERE deleted IS NULL AND (CAST(?1 AS TEXT) IS NULL OR node = ?1) ORDER BY seq DESC")
            .map_err(store_err("list sandboxes"))?;
        let rows = stmt
            .query_map(params![node], raw_row)
            .map_err(store_err("list sandboxes"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_row(r.map_err(store_err("list sandboxes"))?)?);
        }
        Ok(out)
    }
}
