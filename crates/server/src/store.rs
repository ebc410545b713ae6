//! The embedded SQLite store: keys, sandboxes, snapshots, idempotency records.
//!
//! One connection behind a mutex; every call is short and never held across
//! an `.await`. Schema version lives in `PRAGMA user_version`.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use runtime_api::{DeletedSandbox, Sandbox};
use rusqlite::{params, Connection, OptionalExtension};

use crate::error::ServerError;
use crate::snapshots::Snapshot;

const SCHEMA_VERSION: i64 = 2;

const SCHEMA_V1: &str = "
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    name TEXT,
    hash TEXT NOT NULL UNIQUE,
    read_only INTEGER NOT NULL,
    account_wide INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    key_id TEXT NOT NULL,
    name TEXT,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    env TEXT NOT NULL,
    deleted TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_name ON sandboxes(name);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS idempotency (
    key_id TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    kind TEXT NOT NULL,
    status INTEGER NOT NULL,
    body TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    PRIMARY KEY (key_id, idem_key)
);
";

const SCHEMA_V2: &str = "
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    key_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    deleted TEXT
);
";

pub struct Store {
    conn: Mutex<Connection>,
}

#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub id: String,
    pub read_only: bool,
    pub account_wide: bool,
}

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

#[derive(Debug, Clone)]
pub struct StoredAnswer {
    pub fingerprint: String,
    /// `json` (replay body) or `stream` (body names the process to follow).
    pub kind: String,
    pub status: u16,
    pub body: String,
    pub created_ms: i64,
}

fn store_err(op: &'static str) -> impl FnOnce(rusqlite::Error) -> ServerError {
    move |source| ServerError::Store { op, source }
}

fn corrupt(what: impl Into<String>) -> ServerError {
    ServerError::Corrupt { what: what.into() }
}

/// Opens (creating or migrating) `data_dir/runtime.db`.
pub fn open_connection(data_dir: &Path) -> Result<Connection, ServerError> {
    std::fs::create_dir_all(data_dir).map_err(|source| ServerError::Io {
        op: "create data dir",
        path: data_dir.display().to_string(),
        source,
    })?;
    let conn = Connection::open(data_dir.join("runtime.db")).map_err(store_err("open"))?;
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(store_err("busy_timeout"))?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(store_err("wal"))?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(store_err("synchronous"))?;
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(store_err("user_version"))?;
    if version > SCHEMA_VERSION {
        return Err(corrupt(format!(
            "runtime.db has schema {version}, newer than this server ({SCHEMA_VERSION})"
        )));
    }
    if version < 1 {
        conn.execute_batch(SCHEMA_V1)
            .map_err(store_err("migrate v1"))?;
    }
    if version < 2 {
        conn.execute_batch(SCHEMA_V2)
            .map_err(store_err("migrate v2"))?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)
            .map_err(store_err("set user_version"))?;
    }
    Ok(conn)
}

impl Store {
    pub fn open(data_dir: &Path) -> Result<Self, ServerError> {
        Ok(Store {
            conn: Mutex::new(open_connection(data_dir)?),
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

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

    pub fn insert_sandbox(&self, row: &SandboxRow) -> Result<i64, ServerError> {
        let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
        let env = serde_json::to_string(&row.env).map_err(|e| corrupt(e.to_string()))?;
        let conn = self.conn();
        conn.execute(
            "INSERT INTO sandboxes (id, key_id, name, state, record, env) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![row.record.id, row.key_id, row.record.name, row.record.state, record, env],
        )
        .map_err(store_err("insert sandbox"))?;
        Ok(conn.last_insert_rowid())
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
            row.record.status = if row.deleted.is_some() {
                "deleted".into()
            } else {
                runtime_api::status_for_state(&row.record.state).into()
            };
            let record = serde_json::to_string(&row.record).map_err(|e| corrupt(e.to_string()))?;
            let env = serde_json::to_string(&row.env).map_err(|e| corrupt(e.to_string()))?;
            let deleted = match &row.deleted {
                Some(d) => Some(serde_json::to_string(d).map_err(|e| corrupt(e.to_string()))?),
                None => None,
            };
            tx.execute(
                "UPDATE sandboxes SET name = ?2, state = ?3, record = ?4, env = ?5, deleted = ?6 WHERE id = ?1",
                params![id, row.record.name, row.record.state, record, env, deleted],
            )
            .map_err(store_err("update sandbox"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(Some(row))
    }

    /// Every sandbox not deleted, newest first.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT seq, key_id, record, env, deleted FROM sandboxes WHERE deleted IS NULL ORDER BY seq DESC")
            .map_err(store_err("list sandboxes"))?;
        let rows = stmt
            .query_map([], raw_row)
            .map_err(store_err("list sandboxes"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_row(r.map_err(store_err("list sandboxes"))?)?);
        }
        Ok(out)
    }

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
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO idempotency (key_id, idem_key, fingerprint, kind, status, body, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![key_id, idem_key, a.fingerprint, a.kind, a.status, a.body, a.created_ms],
            )
            .map(|_| ())
            .map_err(store_err("put idempotency"))
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

/// A snapshot as stored: its public record and its owner.
#[derive(Debug, Clone)]
pub struct SnapshotRow {
    pub seq: i64,
    pub key_id: String,
    pub record: Snapshot,
    /// When it was deleted; the record is then invisible.
    pub deleted: Option<String>,
}

impl Store {
    pub fn insert_snapshot(&self, key_id: &str, s: &Snapshot) -> Result<(), ServerError> {
        let record = serde_json::to_string(s).map_err(|e| corrupt(e.to_string()))?;
        self.conn()
            .execute(
                "INSERT INTO snapshots (id, key_id, sandbox_id, state, record) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![s.id, key_id, s.sandbox_id, s.state, record],
            )
            .map(|_| ())
            .map_err(store_err("insert snapshot"))
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

type RawSnapshot = (i64, String, String, Option<String>);

fn raw_snapshot(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawSnapshot> {
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

type RawRow = (i64, String, String, String, Option<String>);

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
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

/// Inserts a key row (used by `create_key`, on its own connection).
pub fn insert_key(
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
