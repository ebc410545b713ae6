//! The embedded SQLite store: keys, sandboxes, snapshots, processes,
//! idempotency records, images (`images.rs`), volumes (`volumes.rs`),
//! private-registry credentials (`registries.rs`),
//! events with webhooks and their deliveries (`events.rs`), and the
//! account's usage: outbound bytes and API answers (`usage.rs`).
//!
//! The same code and migrations serve the embedded SQLite file (one
//! connection behind a mutex) and PostgreSQL (a pool of connections),
//! through `db.rs`; every call is short and never held across an
//! `.await`. The schema version lives in SQLite's `PRAGMA user_version`,
//! in PostgreSQL's one-row table `schema_version`.

mod charges;
pub(crate) mod db;
mod docs;
mod events;
mod idempotency;
mod images;
mod keys;
mod links;
mod nodes;
mod processes;
mod registries;
mod sandboxes;
mod sessions;
mod snapshots;
mod usage;
mod volumes;

use std::path::Path;
use std::sync::Mutex;

use db::{params, pg_connect, ConnGuard, Connection, DbError, Engine, Pool, MIGRATE_LOCK};

use crate::error::ServerError;

pub(super) const SCHEMA_VERSION: i64 = 20;

/// Several control planes on one store (v19): each server is a node with
/// the URL its peers reach it at and when it was last seen; a sandbox
/// belongs to the node whose machines run it, an image to the node whose
/// data directory holds its layers (`''`: made before v19, taken by the
/// first node to start); a lease names the one node that runs a
/// store-wide job until it lapses (docs/deploy.md, "Several control planes").
const SCHEMA_V19: &str = "
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    started_ms INTEGER NOT NULL,
    seen_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    until_ms INTEGER NOT NULL
);
ALTER TABLE sandboxes ADD COLUMN node TEXT NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes(node);
ALTER TABLE images ADD COLUMN node TEXT NOT NULL DEFAULT '';
";

/// Placement and failure (v20): what memory each node can still promise
/// new machines (`-1`: it cannot tell), whether it is draining (no new
/// sandboxes), and since when its peers hold it lost (`0`: not lost);
/// facts every node must agree on (`store_meta`: a check of the key that
/// seals secrets, so a node with another `secrets.key` is refused).
const SCHEMA_V20: &str = "
ALTER TABLE nodes ADD COLUMN free_mib INTEGER NOT NULL DEFAULT -1;
ALTER TABLE nodes ADD COLUMN draining INTEGER NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN lost_ms INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS store_meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
";

/// Charges folded by day (v18): how many minutes a row of `charges` spans,
/// 1 for a minute as the meter writes it, 1440 for a day whose minutes
/// were folded into one row once they were old (`Store::fold_charges`).
const SCHEMA_V18: &str = "
ALTER TABLE charges ADD COLUMN minutes INTEGER NOT NULL DEFAULT 1;
";

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
    engine: Engine,
    /// The node this server is ([`Store::on_node`]); `''` for the
    /// operator's commands and tests, which make no sandboxes of their own.
    node: String,
}

pub(crate) fn store_err(op: &'static str) -> impl FnOnce(DbError) -> ServerError {
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

/// Each schema version's SQL, oldest first (v6 also moves documents).
const MIGRATIONS: [(i64, &str); 20] = [
    (1, SCHEMA_V1),
    (2, SCHEMA_V2),
    (3, SCHEMA_V3),
    (4, SCHEMA_V4),
    (5, SCHEMA_V5),
    (6, SCHEMA_V6),
    (7, SCHEMA_V7),
    (8, SCHEMA_V8),
    (9, SCHEMA_V9),
    (10, SCHEMA_V10),
    (11, SCHEMA_V11),
    (12, SCHEMA_V12),
    (13, SCHEMA_V13),
    (14, SCHEMA_V14),
    (15, SCHEMA_V15),
    (16, SCHEMA_V16),
    (17, SCHEMA_V17),
    (18, SCHEMA_V18),
    (19, SCHEMA_V19),
    (20, SCHEMA_V20),
];

/// Runs the migrations after `version` on SQLite, each in a transaction
/// of its own.
fn migrate(conn: &mut Connection, version: i64) -> Result<(), ServerError> {
    for (v, sql) in MIGRATIONS {
        if version >= v {
            continue;
        }
        let op = MIGRATE_OPS[usize::try_from(v - 1).unwrap_or(0)];
        let tx = conn.transaction().map_err(store_err(op))?;
        step(&tx, v, sql, op)?;
        tx.commit().map_err(store_err(op))?;
    }
    Ok(())
}

/// One migration on `c` (in a transaction).
fn step(c: &Connection, v: i64, sql: &str, op: &'static str) -> Result<(), ServerError> {
    c.execute_batch(sql).map_err(store_err(op))?;
    if v == 6 {
        images::move_docs(c)?;
        volumes::move_docs(c)?;
    }
    Ok(())
}

const MIGRATE_OPS: [&str; 20] = [
    "migrate v1",
    "migrate v2",
    "migrate v3",
    "migrate v4",
    "migrate v5",
    "migrate v6",
    "migrate v7",
    "migrate v8",
    "migrate v9",
    "migrate v10",
    "migrate v11",
    "migrate v12",
    "migrate v13",
    "migrate v14",
    "migrate v15",
    "migrate v16",
    "migrate v17",
    "migrate v18",
    "migrate v19",
    "migrate v20",
];

fn too_new(version: i64, what: &str) -> Result<(), ServerError> {
    if version > SCHEMA_VERSION {
        return Err(corrupt(format!(
            "{what} has schema {version}, newer than this server ({SCHEMA_VERSION})"
        )));
    }
    Ok(())
}

/// Opens (creating or migrating) `data_dir/runtime.db`.
pub(crate) fn open_sqlite(data_dir: &Path) -> Result<Connection, ServerError> {
    std::fs::create_dir_all(data_dir).map_err(|source| ServerError::Io {
        op: "create data dir",
        path: data_dir.display().to_string(),
        source,
    })?;
    let raw = rusqlite::Connection::open(data_dir.join("runtime.db"))
        .map_err(|e| store_err("open")(e.into()))?;
    keep_private(data_dir)?;
    let sq = |op| move |e: rusqlite::Error| store_err(op)(e.into());
    raw.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(sq("busy_timeout"))?;
    raw.pragma_update(None, "journal_mode", "WAL")
        .map_err(sq("wal"))?;
    // NORMAL, not FULL: in WAL mode a commit survives a crash of the
    // process either way, and the store stays whole across a power loss;
    // FULL would only keep the last commits before one, at an fsync per
    // commit (3.6 ms against 0.08 ms here), and the meter commits every
    // running sandbox every second (docs/security.md, "Crashes tell the truth").
    raw.pragma_update(None, "synchronous", "NORMAL")
        .map_err(sq("synchronous"))?;
    let version: i64 = raw
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(sq("user_version"))?;
    too_new(version, "runtime.db")?;
    let mut conn = Connection::sqlite(raw);
    migrate(&mut conn, version)?;
    if version < SCHEMA_VERSION {
        if let Some(raw) = conn.as_sqlite() {
            raw.pragma_update(None, "user_version", SCHEMA_VERSION)
                .map_err(sq("set user_version"))?;
        }
    }
    Ok(conn)
}

/// Migrates a PostgreSQL database to the newest schema: in one
/// transaction under an advisory lock, so two control planes starting at
/// once migrate it once. The version is the one row of `schema_version`.
fn migrate_pg(conn: &mut Connection, what: &str) -> Result<(), ServerError> {
    let tx = conn.transaction().map_err(store_err("begin migrate"))?;
    tx.execute_batch(&format!(
        "SELECT pg_advisory_xact_lock({MIGRATE_LOCK});
         CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);"
    ))
    .map_err(store_err("schema version"))?;
    let version: Option<i64> = tx
        .query_row("SELECT MAX(version) FROM schema_version", [], |r| r.get(0))
        .map_err(store_err("schema version"))?;
    let version = version.unwrap_or(0);
    too_new(version, what)?;
    if version < SCHEMA_VERSION {
        for (v, sql) in MIGRATIONS {
            if version < v {
                step(
                    &tx,
                    v,
                    sql,
                    MIGRATE_OPS[usize::try_from(v - 1).unwrap_or(0)],
                )?;
            }
        }
        tx.execute("DELETE FROM schema_version", [])
            .map_err(store_err("set schema version"))?;
        tx.execute(
            "INSERT INTO schema_version (version) VALUES (?1)",
            params![SCHEMA_VERSION],
        )
        .map_err(store_err("set schema version"))?;
    }
    tx.commit().map_err(store_err("commit migrate"))
}

/// Opens one connection to the store at `at` (migrating it first), for
/// the operator's commands that run beside a server.
pub(crate) fn open_connection(at: &StoreAt) -> Result<Connection, ServerError> {
    match at {
        StoreAt::Sqlite(dir) => open_sqlite(dir),
        StoreAt::Postgres(url) => {
            let mut conn = pg_connect(url).map_err(|e| unreachable_store(url, e))?;
            migrate_pg(&mut conn, &redact(url))?;
            Ok(conn)
        }
    }
}

fn unreachable_store(url: &str, e: DbError) -> ServerError {
    ServerError::StoreUnreachable {
        url: redact(url),
        message: match &e {
            DbError::Postgres(p) => match std::error::Error::source(p) {
                Some(s) => format!("{p}: {s}"),
                None => p.to_string(),
            },
            other => other.to_string(),
        },
    }
}

/// A PostgreSQL URL without its password (`postgres://u:***@h/db`).
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some((a, h)) => (a, h),
        None => return url.to_string(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// Where the store is: SQLite's file in a data directory, or a
/// PostgreSQL database by URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAt {
    Sqlite(std::path::PathBuf),
    Postgres(String),
}

impl StoreAt {
    /// `--store`: absent or `sqlite`, the data directory's file; a
    /// `postgres://` or `postgresql://` URL, that database.
    pub fn parse(store: Option<&str>, data_dir: &Path) -> Result<Self, String> {
        match store {
            None | Some("sqlite") => Ok(StoreAt::Sqlite(data_dir.to_path_buf())),
            Some(u) if u.starts_with("postgres://") || u.starts_with("postgresql://") => {
                Ok(StoreAt::Postgres(u.to_string()))
            }
            Some(other) => Err(format!(
                "--store {}: give `sqlite` or a postgres:// URL",
                redact(other)
            )),
        }
    }
}

/// What names a store: a data directory (SQLite's file in it) or a
/// [`StoreAt`].
pub trait StoreLocation {
    fn store_at(&self) -> StoreAt;
}
impl StoreLocation for Path {
    fn store_at(&self) -> StoreAt {
        StoreAt::Sqlite(self.to_path_buf())
    }
}
impl StoreLocation for std::path::PathBuf {
    fn store_at(&self) -> StoreAt {
        StoreAt::Sqlite(self.clone())
    }
}
impl StoreLocation for StoreAt {
    fn store_at(&self) -> StoreAt {
        self.clone()
    }
}

/// PostgreSQL connections a server keeps.
const PG_POOL: usize = 4;

impl Store {
    /// Opens (creating or migrating) `data_dir/runtime.db`.
    pub fn open(data_dir: &Path) -> Result<Self, ServerError> {
        Ok(Store {
            engine: Engine::Sqlite(Mutex::new(open_sqlite(data_dir)?)),
            node: String::new(),
        })
    }

    /// Opens the store at `at`: for PostgreSQL, migrates it and keeps a
    /// few connections, each on a thread of its own.
    pub fn open_at(at: &StoreAt) -> Result<Self, ServerError> {
        match at {
            StoreAt::Sqlite(dir) => Self::open(dir),
            StoreAt::Postgres(url) => {
                let mut conns = vec![open_connection(at)?];
                for _ in 1..PG_POOL {
                    conns.push(pg_connect(url).map_err(|e| unreachable_store(url, e))?);
                }
                Ok(Store {
                    engine: Engine::Pg(Pool::new(conns)),
                    node: String::new(),
                })
            }
        }
    }

    pub(crate) fn conn(&self) -> ConnGuard<'_> {
        self.engine.conn()
    }
}

pub(crate) use events::{Attempt, DeliveryRow, EventQuery, EventRow, SealedSecret, WebhookRow};
pub(crate) use idempotency::{
    IdemClaim, StoredAnswer, IN_FLIGHT, PENDING_FORK, PENDING_SANDBOX, PENDING_SNAPSHOT,
};
pub(crate) use keys::insert_key;
pub use nodes::NodeRow;
pub(crate) use processes::{ProcEnd, ProcRow};
pub(crate) use registries::PutRegistry;
pub(crate) use sandboxes::SandboxRow;
pub(crate) use snapshots::SnapshotRow;
pub(crate) use usage::{ChargeRow, RequestCount};

#[cfg(test)]
#[path = "../../tests/support/pg.rs"]
pub(crate) mod pg_cluster;

/// The store's tests run on both engines: [`each_engine`] gives each test
/// a fresh store on SQLite, then on PostgreSQL (a throwaway cluster; where
/// PostgreSQL is not installed, a failure in CI, a skip elsewhere).
#[cfg(test)]
pub(crate) mod testing {
    use super::pg_cluster::PgCluster;
    use super::{Store, StoreAt};

    pub(crate) fn each_engine(f: impl Fn(&Store)) {
        let dir = std::env::temp_dir().join(format!("rt-store-{}", uuid::Uuid::new_v4()));
        let s = Store::open(&dir).unwrap_or_else(|e| panic!("sqlite: {e}"));
        f(&s);
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
        let Some(pg) = PgCluster::start() else {
            return;
        };
        let s = Store::open_at(&StoreAt::Postgres(pg.database()))
            .unwrap_or_else(|e| panic!("postgres: {e:?}"));
        f(&s);
    }

    /// [`each_engine`] for tests that open the store more than once (two
    /// control planes): a fresh SQLite directory, then a fresh database.
    pub(crate) fn each_location(f: impl Fn(&StoreAt)) {
        let dir = std::env::temp_dir().join(format!("rt-store-{}", uuid::Uuid::new_v4()));
        f(&StoreAt::Sqlite(dir.clone()));
        let _ = std::fs::remove_dir_all(&dir);
        let Some(pg) = PgCluster::start() else {
            return;
        };
        f(&StoreAt::Postgres(pg.database()));
    }

    /// A store on PostgreSQL with its cluster (kept alive beside it).
    pub(crate) fn postgres() -> Option<(Store, PgCluster)> {
        let pg = PgCluster::start()?;
        let s = Store::open_at(&StoreAt::Postgres(pg.database()))
            .unwrap_or_else(|e| panic!("postgres: {e:?}"));
        Some((s, pg))
    }
}

#[cfg(test)]
mod tests {
    use super::db::params;
    use super::testing;
    use super::*;

    /// Every table's columns, in order, with whether each may be NULL.
    fn columns(s: &Store) -> Vec<(String, String, bool)> {
        let conn = s.conn();
        if conn.as_sqlite().is_some() {
            let mut out = Vec::new();
            let tables: Vec<String> = conn
                .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            for t in tables {
                let cols: Vec<(String, bool)> = conn
                    .prepare(&format!(
                        "SELECT name, \"notnull\", pk FROM pragma_table_info('{t}') ORDER BY cid"
                    ))
                    .unwrap()
                    .query_map([], |r| {
                        let notnull: bool = r.get(1)?;
                        let pk: i64 = r.get(2)?;
                        Ok((r.get(0)?, !notnull && pk == 0))
                    })
                    .unwrap()
                    .map(Result::unwrap)
                    .collect();
                out.extend(cols.into_iter().map(|(c, n)| (t.clone(), c, n)));
            }
            out
        } else {
            conn.prepare(
                "SELECT table_name::text, column_name::text, is_nullable::text FROM information_schema.columns
                 WHERE table_schema = 'public' AND table_name != 'schema_version'
                 ORDER BY table_name, ordinal_position",
            )
            .unwrap()
            .query_map([], |r| {
                let nullable: String = r.get(2)?;
                Ok((r.get(0)?, r.get(1)?, nullable == "YES"))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect()
        }
    }

    #[test]
    fn both_engines_end_with_the_same_tables_and_columns() {
        let dir = std::env::temp_dir().join(format!("rt-store-{}", uuid::Uuid::new_v4()));
        let sqlite = Store::open(&dir).unwrap();
        let want = columns(&sqlite);
        assert!(want.len() > 100, "{want:?}");
        let Some((pg, _cluster)) = testing::postgres() else {
            return;
        };
        assert_eq!(columns(&pg), want);
        let version: i64 = pg
            .conn()
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        drop(sqlite);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_postgres_store_opens_again_and_two_open_at_once_migrate_once() {
        let Some(pg) = pg_cluster::PgCluster::start() else {
            return;
        };
        let url = pg.database();
        let at = StoreAt::Postgres(url);
        let opens: Vec<_> = (0..3)
            .map(|_| {
                let at = at.clone();
                std::thread::spawn(move || Store::open_at(&at).map(|_| ()))
            })
            .collect();
        for o in opens {
            o.join().unwrap().unwrap();
        }
        let s = Store::open_at(&at).unwrap();
        let n: i64 = s
            .conn()
            .query_row("SELECT COUNT(*) FROM schema_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 1);
        // Values of every kind go in and come out as they were.
        let conn = s.conn();
        conn.execute_batch("CREATE TABLE kinds (i INTEGER, r REAL, t TEXT, b BLOB, n TEXT)")
            .map(|_| ())
            .or_else(|_| {
                conn.execute_batch(
                    "CREATE TABLE kinds (i BIGINT, r DOUBLE PRECISION, t TEXT, b BYTEA, n TEXT)",
                )
            })
            .unwrap();
        conn.execute(
            "INSERT INTO kinds (i, r, t, b, n) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![i64::MIN, 1.5f64, "t'?", vec![0u8, 255], None::<String>],
        )
        .unwrap();
        let row: (i64, f64, String, Vec<u8>, Option<String>) = conn
            .query_row("SELECT i, r, t, b, n FROM kinds", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap();
        assert_eq!(row, (i64::MIN, 1.5, "t'?".to_string(), vec![0, 255], None));
    }

    #[test]
    fn a_store_url_that_does_not_answer_is_named_without_its_password() {
        let at = StoreAt::Postgres("postgres://me:hunter2@127.0.0.1:1/db".into());
        let e = Store::open_at(&at).err().unwrap().to_string();
        assert!(e.contains("postgres://me:***@127.0.0.1:1/db"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        assert_eq!(
            StoreAt::parse(Some("mysql://x"), Path::new("/d")),
            Err("--store mysql://x: give `sqlite` or a postgres:// URL".into())
        );
        assert_eq!(
            StoreAt::parse(None, Path::new("/d")),
            Ok(StoreAt::Sqlite("/d".into()))
        );
    }
}
