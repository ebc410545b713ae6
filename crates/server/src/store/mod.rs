//! The embedded SQLite store: keys, sandboxes, snapshots, processes,
//! idempotency records, images (`images.rs`), volumes (`volumes.rs`),
//! private-registry credentials (`registries.rs`),
//! events with webhooks and their deliveries (`events.rs`), and the
//! account's usage: outbound bytes and API answers (`usage.rs`).
//!
//! One connection behind a mutex; every call is short and never held across
//! an `.await`. Schema version lives in `PRAGMA user_version`.

mod charges;
mod docs;
mod events;
mod idempotency;
mod images;
mod keys;
mod links;
mod processes;
mod registries;
mod sandboxes;
mod sessions;
mod snapshots;
mod usage;
mod volumes;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use rusqlite::Connection;

use crate::error::ServerError;

pub(super) const SCHEMA_VERSION: i64 = 17;

/// Shared volumes (v17): a volume's `shared` flag, and the attachments of
/// shared volumes to running sandboxes, each with its state (attaching,
/// attached, detaching, detached), kept after it ends.
const SCHEMA_V17: &str = "
ALTER TABLE volumes ADD COLUMN shared INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS shared_attachments (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    volume_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    detached_ms INTEGER
);
CREATE INDEX IF NOT EXISTS shared_attachments_volume ON shared_attachments(volume_id);
CREATE INDEX IF NOT EXISTS shared_attachments_sandbox ON shared_attachments(sandbox_id);
";

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

/// Image names and versions belong to a key (v7): the same name may be
/// two keys' images, each with its own versions. SQLite changes a
/// constraint by copying the table.
const SCHEMA_V7: &str = "
CREATE TABLE images_v7 (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    name TEXT,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (key_id, name, version)
);
INSERT INTO images_v7 (id, key_id, name, version, state, created_ms, record)
    SELECT id, key_id, name, version, state, created_ms, record FROM images;
DROP TABLE images;
ALTER TABLE images_v7 RENAME TO images;
";

/// Secrets belong to a key (v8): their scope in `net_docs` is its id. Those
/// kept before (scope empty) go to the first account-wide key that may
/// change things, the admin's; with no such key they stay unowned, which
/// no key lists or gives to a sandbox.
const SCHEMA_V8: &str = "
UPDATE net_docs SET scope = (
    SELECT id FROM keys WHERE account_wide = 1 AND read_only = 0 AND revoked_at IS NULL
    ORDER BY created_at, id LIMIT 1)
WHERE kind = 'secret' AND scope = ''
  AND EXISTS (SELECT 1 FROM keys WHERE account_wide = 1 AND read_only = 0 AND revoked_at IS NULL);
";

/// A process's working directory (v9); older rows ran in the default.
const SCHEMA_V9: &str = "
ALTER TABLE processes ADD COLUMN cwd TEXT NOT NULL DEFAULT '/workspace';
";

/// Sandbox sessions and file links (v11): tokens for one sandbox, kept by
/// hash.
const SCHEMA_V11: &str = "
CREATE TABLE IF NOT EXISTS sandbox_sessions (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    name TEXT,
    origins TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    revoked_ms INTEGER
);
CREATE INDEX IF NOT EXISTS sandbox_sessions_sandbox ON sandbox_sessions(sandbox_id, created_ms);
CREATE TABLE IF NOT EXISTS file_links (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    path TEXT NOT NULL,
    method TEXT NOT NULL,
    filename TEXT,
    max_bytes INTEGER,
    wake INTEGER NOT NULL,
    archive INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    revoked_ms INTEGER
);
CREATE INDEX IF NOT EXISTS file_links_sandbox ON file_links(sandbox_id);
";

/// Private-registry credentials (v12): one per key and registry, the
/// secret sealed (`registries.rs`).
const SCHEMA_V12: &str = "
CREATE TABLE IF NOT EXISTS registry_credentials (
    key_id TEXT NOT NULL,
    registry TEXT NOT NULL,
    kind TEXT NOT NULL,
    username TEXT NOT NULL,
    sealed TEXT NOT NULL,
    secret_bytes INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (key_id, registry)
);
";

/// A key's own quotas (v13): a JSON object of quota name to maximum, set
/// by the operator; NULL, the server's for every quota.
const SCHEMA_V13: &str = "
ALTER TABLE keys ADD COLUMN quotas TEXT;
";

/// Volume backups (v14): one row per backup, `pending` while its copy is
/// made (a restart removes those), `ready` once written, synced, renamed
/// into place and checked; the backup a volume was restored from, and its
/// backup policy (JSON; NULL: no automatic backups).
const SCHEMA_V14: &str = "
ALTER TABLE volumes ADD COLUMN restored_from TEXT;
ALTER TABLE volumes ADD COLUMN backup_policy TEXT;
CREATE TABLE IF NOT EXISTS volume_backups (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    volume_id TEXT NOT NULL,
    name TEXT,
    state TEXT NOT NULL,
    size_mib INTEGER NOT NULL,
    stored_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    retention_days INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS volume_backups_volume ON volume_backups(volume_id);
";

/// A process is named by its sandbox and its id (v15): the copies of a
/// sandbox (a fork, a restore of a memory snapshot) take its running
/// processes on under the same ids.
const SCHEMA_V15: &str = "
CREATE TABLE processes_v15 (
    id TEXT NOT NULL,
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
    stdin_closed INTEGER NOT NULL DEFAULT 0,
    cwd TEXT NOT NULL DEFAULT '/workspace',
    PRIMARY KEY (sandbox_id, id)
);
INSERT INTO processes_v15 (id, sandbox_id, token, guest_pid, kind, command, argv, run_as, pty,
    stdin_pipe, output_encoding, state, exit_code, signal, timed_out, out_of_memory, duration_ms,
    started_ms, ended_ms, output_bytes, stdin_offset, stdin_closed, cwd)
SELECT id, sandbox_id, token, guest_pid, kind, command, argv, run_as, pty,
    stdin_pipe, output_encoding, state, exit_code, signal, timed_out, out_of_memory, duration_ms,
    started_ms, ended_ms, output_bytes, stdin_offset, stdin_closed, cwd FROM processes;
DROP TABLE processes;
ALTER TABLE processes_v15 RENAME TO processes;
";

/// The account's usage (v16): each key's outbound bytes per sandbox and
/// calendar month (YYYYMM); its authenticated API answers per hour and
/// operation, by status class (kept 90 days); the milliseconds each minute
/// of charges billed (rows from before v16 have 0), and an index for the
/// export's walk in order of minute.
const SCHEMA_V16: &str = "
CREATE TABLE IF NOT EXISTS outbound (
    key_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    month INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (key_id, sandbox_id, month)
);
CREATE INDEX IF NOT EXISTS outbound_month ON outbound(month, key_id);
CREATE TABLE IF NOT EXISTS request_counts (
    hour INTEGER NOT NULL,
    key_id TEXT NOT NULL,
    operation TEXT NOT NULL,
    calls INTEGER NOT NULL,
    client_errors INTEGER NOT NULL,
    server_errors INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, operation)
);
ALTER TABLE charges ADD COLUMN billed_ms INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS charges_minute ON charges(minute, sandbox_id);
";

/// Events, webhooks and their deliveries (v10). Events and deliveries are
/// bounded by age and count (service/events.rs prunes them).
const SCHEMA_V10: &str = "
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    key_id TEXT NOT NULL,
    type TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_key ON events(key_id, seq);
CREATE INDEX IF NOT EXISTS events_resource ON events(resource_id, seq);
CREATE INDEX IF NOT EXISTS events_created ON events(created_ms);
CREATE TABLE IF NOT EXISTS webhooks (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS webhooks_key ON webhooks(key_id);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    webhook_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_ms INTEGER,
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    log TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS deliveries_due ON webhook_deliveries(state, next_ms);
CREATE INDEX IF NOT EXISTS deliveries_webhook ON webhook_deliveries(webhook_id, seq);
CREATE INDEX IF NOT EXISTS deliveries_key ON webhook_deliveries(key_id, state);
";

/// Images and volumes in tables of their own (v6), with the constraints of
/// their names: an image's version is unique per name, a volume's name per
/// key. The migration moves their `net_docs` documents (kinds `image`,
/// `volume`, `sandbox_volumes`) here in the same transaction.
const SCHEMA_V6: &str = "
CREATE TABLE IF NOT EXISTS images (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    name TEXT,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (name, version)
);
CREATE TABLE IF NOT EXISTS image_logs (
    image_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    step INTEGER,
    stream TEXT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (image_id, seq)
);
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    name TEXT,
    labels TEXT NOT NULL,
    size_mib INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    UNIQUE (key_id, name)
);
CREATE TABLE IF NOT EXISTS volume_attachments (
    sandbox_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    volume_id TEXT NOT NULL,
    path TEXT NOT NULL,
    mode TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);
CREATE INDEX IF NOT EXISTS volume_attachments_volume ON volume_attachments(volume_id);
";

pub struct Store {
    conn: Mutex<Connection>,
}

pub(crate) fn store_err(op: &'static str) -> impl FnOnce(rusqlite::Error) -> ServerError {
    move |source| ServerError::Store { op, source }
}

pub(super) fn corrupt(what: impl Into<String>) -> ServerError {
    ServerError::Corrupt { what: what.into() }
}

/// The store holds sandboxes' `env`, commands, answers and preview token
/// secrets: only the server's user may read it (SQLite gives its `-wal`
/// and `-shm` the database file's mode).
fn keep_private(data_dir: &Path) -> Result<(), ServerError> {
    use std::os::unix::fs::PermissionsExt;
    for name in ["runtime.db", "runtime.db-wal", "runtime.db-shm"] {
        let p = data_dir.join(name);
        match std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(ServerError::Io {
                    op: "make the store private",
                    path: p.display().to_string(),
                    source: e,
                })
            }
            _ => {}
        }
    }
    Ok(())
}

/// Opens (creating or migrating) `data_dir/runtime.db`.
pub(crate) fn open_connection(data_dir: &Path) -> Result<Connection, ServerError> {
    std::fs::create_dir_all(data_dir).map_err(|source| ServerError::Io {
        op: "create data dir",
        path: data_dir.display().to_string(),
        source,
    })?;
    let mut conn = Connection::open(data_dir.join("runtime.db")).map_err(store_err("open"))?;
    keep_private(data_dir)?;
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(store_err("busy_timeout"))?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(store_err("wal"))?;
    // NORMAL, not FULL: in WAL mode a commit survives a crash of the
    // process either way, and the store stays whole across a power loss;
    // FULL would only keep the last commits before one, at an fsync per
    // commit (3.6 ms against 0.08 ms here), and the meter commits every
    // running sandbox every second (docs/security.md, "Crashes tell the truth").
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
    if version < 6 {
        let tx = conn.transaction().map_err(store_err("begin v6"))?;
        tx.execute_batch(SCHEMA_V6)
            .map_err(store_err("migrate v6"))?;
        images::move_docs(&tx)?;
        volumes::move_docs(&tx)?;
        tx.commit().map_err(store_err("commit v6"))?;
    }
    if version < 7 {
        let tx = conn.transaction().map_err(store_err("begin v7"))?;
        tx.execute_batch(SCHEMA_V7)
            .map_err(store_err("migrate v7"))?;
        tx.commit().map_err(store_err("commit v7"))?;
    }
    if version < 8 {
        conn.execute_batch(SCHEMA_V8)
            .map_err(store_err("migrate v8"))?;
    }
    if version < 9 {
        conn.execute_batch(SCHEMA_V9)
            .map_err(store_err("migrate v9"))?;
    }
    if version < 10 {
        let tx = conn.transaction().map_err(store_err("begin v10"))?;
        tx.execute_batch(SCHEMA_V10)
            .map_err(store_err("migrate v10"))?;
        tx.commit().map_err(store_err("commit v10"))?;
    }
    if version < 11 {
        conn.execute_batch(SCHEMA_V11)
            .map_err(store_err("migrate v11"))?;
    }
    if version < 12 {
        conn.execute_batch(SCHEMA_V12)
            .map_err(store_err("migrate v12"))?;
    }
    if version < 13 {
        conn.execute_batch(SCHEMA_V13)
            .map_err(store_err("migrate v13"))?;
    }
    if version < 14 {
        let tx = conn.transaction().map_err(store_err("begin v14"))?;
        tx.execute_batch(SCHEMA_V14)
            .map_err(store_err("migrate v14"))?;
        tx.commit().map_err(store_err("commit v14"))?;
    }
    if version < 15 {
        let tx = conn.transaction().map_err(store_err("begin v15"))?;
        tx.execute_batch(SCHEMA_V15)
            .map_err(store_err("migrate v15"))?;
        tx.commit().map_err(store_err("commit v15"))?;
    }
    if version < 16 {
        let tx = conn.transaction().map_err(store_err("begin v16"))?;
        tx.execute_batch(SCHEMA_V16)
            .map_err(store_err("migrate v16"))?;
        tx.commit().map_err(store_err("commit v16"))?;
    }
    if version < 17 {
        let tx = conn.transaction().map_err(store_err("begin v17"))?;
        tx.execute_batch(SCHEMA_V17)
            .map_err(store_err("migrate v17"))?;
        tx.commit().map_err(store_err("commit v17"))?;
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
}

pub(crate) use events::{Attempt, DeliveryRow, EventQuery, EventRow, SealedSecret, WebhookRow};
pub(crate) use idempotency::{StoredAnswer, PENDING_FORK, PENDING_SANDBOX, PENDING_SNAPSHOT};
pub(crate) use keys::insert_key;
pub(crate) use processes::{ProcEnd, ProcRow};
pub(crate) use registries::PutRegistry;
pub(crate) use sandboxes::SandboxRow;
pub(crate) use snapshots::SnapshotRow;
pub(crate) use usage::{ChargeRow, RequestCount};
