//! The embedded SQLite store: keys, sandboxes, snapshots, processes,
//! idempotency records.
//!
//! One connection behind a mutex; every call is short and never held across
//! an `.await`. Schema version lives in `PRAGMA user_version`.

mod charges;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use runtime_api::{DeletedSandbox, Sandbox};
use rusqlite::{params, Connection, OptionalExtension};

use crate::domain::access::KeyInfo;
use crate::domain::snapshot::Snapshot;
use crate::error::ServerError;

const SCHEMA_VERSION: i64 = 5;

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

/// Processes, so a restart of the server can take them up again (v3).
const SCHEMA_V3: &str = "
CREATE TABLE IF NOT EXISTS processes (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    token INTEGER NOT NULL,
    guest_pid INTEGER NOT NULL,
    kind TEXT NOT NULL,
    command TEXT NOT NULL,
    argv TEXT NOT NULL,
    run_as TEXT NOT NULL,
    pty INTEGER NOT NULL,
    stdin_pipe INTEGER NOT NULL,
    output_encoding TEXT NOT NULL,
    state TEXT NOT NULL,
    exit_code INTEGER,
    signal INTEGER,
    timed_out INTEGER NOT NULL DEFAULT 0,
    out_of_memory INTEGER NOT NULL DEFAULT 0,
    duration_ms INTEGER,
    started_ms INTEGER NOT NULL,
    ended_ms INTEGER,
    output_bytes INTEGER NOT NULL DEFAULT 0,
    stdin_offset INTEGER NOT NULL DEFAULT 0,
    stdin_closed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS processes_sandbox ON processes(sandbox_id);
";

/// Billing (v4): a key's daily spending limit; each sandbox's metered
/// remainder below one microdollar; charges per key, sandbox and minute for
/// the 24-hour window and `GET /v1/usage` (see billing.rs).
const SCHEMA_V4: &str = "
ALTER TABLE keys ADD COLUMN daily_limit_micros INTEGER;
CREATE TABLE IF NOT EXISTS meter (
    sandbox_id TEXT PRIMARY KEY,
    remainder INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS charges (
    key_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    minute INTEGER NOT NULL,
    micros INTEGER NOT NULL,
    PRIMARY KEY (key_id, sandbox_id, minute)
);
CREATE INDEX IF NOT EXISTS charges_key_minute ON charges(key_id, minute);
";

/// The network's documents (v5): previews, rules, secrets, sandbox CAs,
/// each a JSON document under (kind, scope, name).
const SCHEMA_V5: &str = "
CREATE TABLE IF NOT EXISTS net_docs (
    kind TEXT NOT NULL,
    scope TEXT NOT NULL,
    name TEXT NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (kind, scope, name)
);
";

pub struct Store {
    conn: Mutex<Connection>,
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

pub(crate) fn store_err(op: &'static str) -> impl FnOnce(rusqlite::Error) -> ServerError {
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
    }
    if version < 3 {
        conn.execute_batch(SCHEMA_V3)
            .map_err(store_err("migrate v3"))?;
    }
    if version < 4 {
        conn.execute_batch(SCHEMA_V4)
            .map_err(store_err("migrate v4"))?;
    }
    if version < 5 {
        conn.execute_batch(SCHEMA_V5)
            .map_err(store_err("migrate v5"))?;
    }
    if version < SCHEMA_VERSION {
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

    pub(crate) fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn doc_put(
        &self,
        kind: &str,
        scope: &str,
        name: &str,
        doc: &serde_json::Value,
    ) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "INSERT INTO net_docs (kind, scope, name, doc) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (kind, scope, name) DO UPDATE SET doc = excluded.doc",
                params![kind, scope, name, doc.to_string()],
            )
            .map_err(store_err("put doc"))?;
        Ok(())
    }

    pub fn doc_get(
        &self,
        kind: &str,
        scope: &str,
        name: &str,
    ) -> Result<Option<serde_json::Value>, ServerError> {
        let text: Option<String> = self
            .conn()
            .query_row(
                "SELECT doc FROM net_docs WHERE kind = ?1 AND scope = ?2 AND name = ?3",
                params![kind, scope, name],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("get doc"))?;
        text.map(|t| serde_json::from_str(&t).map_err(|e| corrupt(format!("{kind} doc: {e}"))))
            .transpose()
    }

    /// Every document of a kind in a scope (every scope when `None`), by name.
    pub fn doc_list(
        &self,
        kind: &str,
        scope: Option<&str>,
    ) -> Result<Vec<(String, String, serde_json::Value)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT scope, name, doc FROM net_docs WHERE kind = ?1 AND (?2 IS NULL OR scope = ?2)
                 ORDER BY scope, name",
            )
            .map_err(store_err("list docs"))?;
        let rows = stmt
            .query_map(params![kind, scope], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(store_err("list docs"))?;
        let mut out = Vec::new();
        for r in rows {
            let (scope, name, text) = r.map_err(store_err("list docs"))?;
            let doc =
                serde_json::from_str(&text).map_err(|e| corrupt(format!("{kind} doc: {e}")))?;
            out.push((scope, name, doc));
        }
        Ok(out)
    }

    /// Deletes one document (`Some(name)`) or a scope's of that kind; answers how many went.
    pub fn doc_delete(
        &self,
        kind: &str,
        scope: &str,
        name: Option<&str>,
    ) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM net_docs WHERE kind = ?1 AND scope = ?2 AND (?3 IS NULL OR name = ?3)",
                params![kind, scope, name],
            )
            .map_err(store_err("delete doc"))
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
            params![row.record.id, row.key_id, row.record.name, row.record.state.as_str(), record, env],
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
                row.record.state.status().into()
            };
            // Only a running sandbox holds money for its lease (billing.rs).
            if row.record.state != runtime_api::SandboxState::Running {
                row.record.held_micros = 0;
            }
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

/// A process as stored (contract §6): what its record shows, plus the
/// host's `token` to take it up again after a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcRow {
    pub id: String,
    pub sandbox_id: String,
    pub token: u64,
    pub guest_pid: u32,
    /// `exec` or `spawn`.
    pub kind: String,
    pub command: String,
    pub argv: Vec<String>,
    /// `sandbox` or `root`.
    pub user: String,
    pub pty: bool,
    pub stdin_pipe: bool,
    /// `utf8` or `base64`.
    pub output_encoding: String,
    /// `running`, `exited` or `lost`.
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub out_of_memory: bool,
    pub duration_ms: Option<u64>,
    pub started_ms: i64,
    pub ended_ms: Option<i64>,
    /// Output bytes produced so far: the offset the next byte gets.
    pub output_bytes: u64,
    pub stdin_offset: u64,
    pub stdin_closed: bool,
}

/// How a process ended, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcEnd {
    pub state: &'static str,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub out_of_memory: bool,
    pub duration_ms: u64,
    pub ended_ms: i64,
    pub output_bytes: u64,
}

const PROC_COLUMNS: &str =
    "id, sandbox_id, token, guest_pid, kind, command, argv, run_as, pty, stdin_pipe, \
     output_encoding, state, exit_code, signal, timed_out, out_of_memory, duration_ms, started_ms, \
     ended_ms, output_bytes, stdin_offset, stdin_closed";

fn proc_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(ProcRow, String)> {
    let token: i64 = r.get(2)?;
    let duration: Option<i64> = r.get(16)?;
    let output_bytes: i64 = r.get(19)?;
    let stdin_offset: i64 = r.get(20)?;
    Ok((
        ProcRow {
            id: r.get(0)?,
            sandbox_id: r.get(1)?,
            token: token as u64,
            guest_pid: r.get(3)?,
            kind: r.get(4)?,
            command: r.get(5)?,
            argv: Vec::new(),
            user: r.get(7)?,
            pty: r.get(8)?,
            stdin_pipe: r.get(9)?,
            output_encoding: r.get(10)?,
            state: r.get(11)?,
            exit_code: r.get(12)?,
            signal: r.get(13)?,
            timed_out: r.get(14)?,
            out_of_memory: r.get(15)?,
            duration_ms: duration.map(|d| d.max(0) as u64),
            started_ms: r.get(17)?,
            ended_ms: r.get(18)?,
            output_bytes: output_bytes.max(0) as u64,
            stdin_offset: stdin_offset.max(0) as u64,
            stdin_closed: r.get(21)?,
        },
        r.get(6)?,
    ))
}

impl Store {
    pub fn insert_process(&self, p: &ProcRow) -> Result<(), ServerError> {
        let argv = serde_json::to_string(&p.argv).map_err(|e| corrupt(e.to_string()))?;
        self.conn()
            .execute(
                &format!(
                    "INSERT INTO processes ({PROC_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22)"
                ),
                params![
                    p.id,
                    p.sandbox_id,
                    p.token as i64,
                    p.guest_pid,
                    p.kind,
                    p.command,
                    argv,
                    p.user,
                    p.pty,
                    p.stdin_pipe,
                    p.output_encoding,
                    p.state,
                    p.exit_code,
                    p.signal,
                    p.timed_out,
                    p.out_of_memory,
                    p.duration_ms.map(|d| d as i64),
                    p.started_ms,
                    p.ended_ms,
                    p.output_bytes as i64,
                    p.stdin_offset as i64,
                    p.stdin_closed,
                ],
            )
            .map(|_| ())
            .map_err(store_err("insert process"))
    }

    /// Every stored process, oldest first.
    pub fn all_processes(&self) -> Result<Vec<ProcRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {PROC_COLUMNS} FROM processes ORDER BY started_ms, id"
            ))
            .map_err(store_err("list processes"))?;
        let rows = stmt
            .query_map([], proc_row)
            .map_err(store_err("list processes"))?;
        let mut out = Vec::new();
        for r in rows {
            let (mut p, argv) = r.map_err(store_err("list processes"))?;
            p.argv =
                serde_json::from_str(&argv).map_err(|e| corrupt(format!("process argv: {e}")))?;
            out.push(p);
        }
        Ok(out)
    }

    /// Records how many output bytes a running process has produced.
    pub fn process_output(&self, id: &str, output_bytes: u64) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET output_bytes = ?2 WHERE id = ?1",
                params![id, output_bytes as i64],
            )
            .map(|_| ())
            .map_err(store_err("update process output"))
    }

    pub fn process_stdin(&self, id: &str, offset: u64, closed: bool) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET stdin_offset = ?2, stdin_closed = ?3 WHERE id = ?1",
                params![id, offset as i64, closed],
            )
            .map(|_| ())
            .map_err(store_err("update process stdin"))
    }

    pub fn process_ended(&self, id: &str, e: &ProcEnd) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET state = ?2, exit_code = ?3, signal = ?4, timed_out = ?5, \
                 out_of_memory = ?6, duration_ms = ?7, ended_ms = ?8, output_bytes = ?9 WHERE id = ?1",
                params![
                    id,
                    e.state,
                    e.exit_code,
                    e.signal,
                    e.timed_out,
                    e.out_of_memory,
                    e.duration_ms as i64,
                    e.ended_ms,
                    e.output_bytes as i64,
                ],
            )
            .map(|_| ())
            .map_err(store_err("update process end"))
    }

    pub fn delete_processes_of(&self, sandbox_id: &str) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM processes WHERE sandbox_id = ?1",
                params![sandbox_id],
            )
            .map_err(store_err("delete processes"))
    }

    pub fn delete_process(&self, id: &str) -> Result<(), ServerError> {
        self.conn()
            .execute("DELETE FROM processes WHERE id = ?1", params![id])
            .map(|_| ())
            .map_err(store_err("delete process"))
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
