//! The store's two engines behind one small interface: the embedded SQLite
//! file (rusqlite) and PostgreSQL (the sync `postgres` crate). The calls
//! have rusqlite's names (`execute`, `query_row`, `prepare` + `query_map`,
//! `transaction`), so the store's code is the same for both.
//!
//! One SQL text serves both engines: it is written with `?N` placeholders in
//! the subset both accept (`ON CONFLICT ... DO UPDATE SET x = excluded.x`,
//! `RETURNING`, `CAST(... AS BIGINT)`), and translated for PostgreSQL in
//! one place, [`pg_sql`]: `?N` becomes `$N`, and in migrations
//! `INTEGER PRIMARY KEY AUTOINCREMENT` becomes `BIGSERIAL PRIMARY KEY` and
//! `INTEGER` `BIGINT`. Booleans are integers on both. A trailing
//! `FOR UPDATE` is kept for PostgreSQL and dropped for SQLite, whose one
//! writer serializes anyway.
//!
//! The `postgres` client runs a runtime of its own and must not be driven
//! from a tokio worker: each PostgreSQL connection lives on a std thread of
//! its own, and each call is sent there over a channel with owned SQL and
//! values and answered with owned rows. A pool holds a few of them; a
//! caller takes one for the length of its call or transaction.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// A value bound to a statement or read from a row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// The store's errors from either engine.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Postgres(#[from] postgres::Error),
    #[error("the query returned no row")]
    NoRow,
    #[error("column {index}: {what}")]
    Type { index: usize, what: String },
    /// A PostgreSQL connection's thread ended (it answers no more).
    #[error("the PostgreSQL connection's thread is gone")]
    Gone,
    /// PostgreSQL did not answer a connection or a call in time.
    #[error("PostgreSQL did not answer in time")]
    Timeout,
    #[error("cannot start a PostgreSQL connection's thread")]
    Spawn(#[source] std::io::Error),
    /// A call answered with the other kind of answer (a bug).
    #[error("a store call answered {what}")]
    Unexpected { what: &'static str },
}

impl DbError {
    /// The store did not answer: a PostgreSQL connection that is closed,
    /// cannot be made, or timed out (not a statement the server refused).
    pub fn is_unreachable(&self) -> bool {
        match self {
            DbError::Postgres(e) => {
                e.is_closed()
                    || e.as_db_error().is_none()
                        && std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
            }
            DbError::Gone | DbError::Timeout => true,
            _ => false,
        }
    }

    /// A constraint refused the write (unique, primary key, not null).
    pub fn is_constraint(&self) -> bool {
        match self {
            DbError::Sqlite(e) => {
                e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
            }
            DbError::Postgres(e) => e.code().is_some_and(|c| c.code().starts_with("23")),
            _ => false,
        }
    }
}

pub(crate) type DbResult<T> = Result<T, DbError>;

/// What a value of a Rust type is to the store.
pub(crate) trait ToValue {
    fn to_value(&self) -> Value;
}

impl<T: ToValue + ?Sized> ToValue for &T {
    fn to_value(&self) -> Value {
        (**self).to_value()
    }
}
impl<T: ToValue> ToValue for Option<T> {
    fn to_value(&self) -> Value {
        self.as_ref().map_or(Value::Null, ToValue::to_value)
    }
}
impl ToValue for Value {
    fn to_value(&self) -> Value {
        self.clone()
    }
}
impl ToValue for str {
    fn to_value(&self) -> Value {
        Value::Text(self.to_string())
    }
}
impl ToValue for String {
    fn to_value(&self) -> Value {
        Value::Text(self.clone())
    }
}
impl ToValue for [u8] {
    fn to_value(&self) -> Value {
        Value::Blob(self.to_vec())
    }
}
impl ToValue for Vec<u8> {
    fn to_value(&self) -> Value {
        Value::Blob(self.clone())
    }
}
impl ToValue for bool {
    fn to_value(&self) -> Value {
        Value::Int(i64::from(*self))
    }
}
impl ToValue for f64 {
    fn to_value(&self) -> Value {
        Value::Real(*self)
    }
}
macro_rules! int_to_value {
    ($($t:ty),*) => {$(
        impl ToValue for $t {
            fn to_value(&self) -> Value {
                Value::Int(i64::from(*self))
            }
        }
    )*};
}
int_to_value!(i64, i32, i16, u32, u16, u8);
macro_rules! wide_to_value {
    ($($t:ty),*) => {$(
        impl ToValue for $t {
            /// Past `i64::MAX` (never a real count) it is kept as the most.
            fn to_value(&self) -> Value {
                Value::Int(i64::try_from(*self).unwrap_or(i64::MAX))
            }
        }
    )*};
}
wide_to_value!(u64, usize);

/// The values of a statement: `params![a, b]`, `[]` or a `Vec<Value>`.
pub(crate) trait Params {
    fn into_values(self) -> Vec<Value>;
}
impl<const N: usize> Params for [Value; N] {
    fn into_values(self) -> Vec<Value> {
        self.into()
    }
}
impl Params for &[Value] {
    fn into_values(self) -> Vec<Value> {
        self.to_vec()
    }
}
impl Params for Vec<Value> {
    fn into_values(self) -> Vec<Value> {
        self
    }
}

/// `params![a, b, ...]`: each by reference, as rusqlite's.
macro_rules! params {
    () => {
        [] as [$crate::store::db::Value; 0]
    };
    ($($x:expr),+ $(,)?) => {
        [$($crate::store::db::ToValue::to_value(&$x)),+]
    };
}
pub(crate) use params;

/// A Rust type read from a column.
pub(crate) trait FromValue: Sized {
    fn from_value(v: &Value) -> Result<Self, String>;
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: &Value) -> Result<Self, String> {
        match v {
            Value::Null => Ok(None),
            v => T::from_value(v).map(Some),
        }
    }
}
impl FromValue for String {
    fn from_value(v: &Value) -> Result<Self, String> {
        match v {
            Value::Text(s) => Ok(s.clone()),
            other => Err(format!("{other:?} is not text")),
        }
    }
}
impl FromValue for Vec<u8> {
    fn from_value(v: &Value) -> Result<Self, String> {
        match v {
            Value::Blob(b) => Ok(b.clone()),
            Value::Text(s) => Ok(s.as_bytes().to_vec()),
            other => Err(format!("{other:?} is not bytes")),
        }
    }
}
impl FromValue for f64 {
    fn from_value(v: &Value) -> Result<Self, String> {
        match v {
            Value::Real(f) => Ok(*f),
            Value::Int(i) => Ok(*i as f64),
            other => Err(format!("{other:?} is not a number")),
        }
    }
}
impl FromValue for bool {
    fn from_value(v: &Value) -> Result<Self, String> {
        match v {
            Value::Int(i) => Ok(*i != 0),
            other => Err(format!("{other:?} is not a boolean")),
        }
    }
}
macro_rules! int_from_value {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn from_value(v: &Value) -> Result<Self, String> {
                match v {
                    Value::Int(i) => <$t>::try_from(*i)
                        .map_err(|_| format!("{i} is out of range for {}", stringify!($t))),
                    other => Err(format!("{other:?} is not an integer")),
                }
            }
        }
    )*};
}
int_from_value!(i64, i32, i16, u64, u32, u16, u8, usize);

/// A column's position (rusqlite's `get(0)`).
pub(crate) trait RowIndex {
    fn index(self) -> usize;
}
impl RowIndex for usize {
    fn index(self) -> usize {
        self
    }
}

/// One row read, with typed getters.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    vals: Vec<Value>,
}

impl Row {
    pub(crate) fn get<I: RowIndex, T: FromValue>(&self, i: I) -> DbResult<T> {
        let index = i.index();
        let v = self.vals.get(index).ok_or_else(|| DbError::Type {
            index,
            what: format!("the row has {} columns", self.vals.len()),
        })?;
        T::from_value(v).map_err(|what| DbError::Type { index, what })
    }
}

/// `.optional()` on a `query_row`: no row is `None`.
pub(crate) trait OptionalExtension<T> {
    fn optional(self) -> DbResult<Option<T>>;
}
impl<T> OptionalExtension<T> for DbResult<T> {
    fn optional(self) -> DbResult<Option<T>> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(DbError::NoRow) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The SQL for PostgreSQL: `?N` → `$N`; for a migration (`ddl`) the
/// types too. A `?` inside a quoted literal is left alone.
pub(crate) fn pg_sql(sql: &str, ddl: bool) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut quoted = false;
    for c in sql.chars() {
        if c == '\'' {
            quoted = !quoted;
        }
        if c == '?' && !quoted {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    if ddl {
        out = out
            .replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
            .replace("INTEGER", "BIGINT");
    }
    out
}

/// The SQL for SQLite: a trailing `FOR UPDATE` (PostgreSQL's row lock in
/// a read-modify-write) is dropped.
fn sqlite_sql(sql: &str) -> &str {
    let t = sql.trim_end();
    t.strip_suffix("FOR UPDATE").unwrap_or(sql)
}

/// One connection of either engine.
pub(crate) struct Connection {
    inner: Inner,
}

enum Inner {
    Sqlite(rusqlite::Connection),
    Pg(PgConn),
}

impl Connection {
    pub(crate) fn sqlite(conn: rusqlite::Connection) -> Self {
        Connection {
            inner: Inner::Sqlite(conn),
        }
    }

    /// The SQLite connection, for what only SQLite has (pragmas).
    pub(crate) fn as_sqlite(&self) -> Option<&rusqlite::Connection> {
        match &self.inner {
            Inner::Sqlite(c) => Some(c),
            Inner::Pg(_) => None,
        }
    }

    /// Runs one statement; answers the rows it changed.
    pub(crate) fn execute(&self, sql: &str, p: impl Params) -> DbResult<usize> {
        let vals = p.into_values();
        match &self.inner {
            Inner::Sqlite(c) => {
                let mut stmt = c.prepare_cached(sqlite_sql(sql))?;
                Ok(stmt.execute(rusqlite::params_from_iter(vals.iter()))?)
            }
            Inner::Pg(c) => match c.call(Req::Exec(pg_sql(sql, false), vals))? {
                Out::Count(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
                _ => Err(DbError::Unexpected {
                    what: "the wrong kind of answer",
                }),
            },
        }
    }

    /// Runs statements separated by `;`, without values (migrations).
    pub(crate) fn execute_batch(&self, sql: &str) -> DbResult<()> {
        match &self.inner {
            Inner::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Inner::Pg(c) => c.call(Req::Batch(pg_sql(sql, true))).map(|_| ()),
        }
    }

    fn rows(&self, sql: &str, vals: Vec<Value>) -> DbResult<Vec<Row>> {
        match &self.inner {
            Inner::Sqlite(c) => {
                let mut stmt = c.prepare_cached(sqlite_sql(sql))?;
                let n = stmt.column_count();
                let mut rows = stmt.query(rusqlite::params_from_iter(vals.iter()))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    let mut vals = Vec::with_capacity(n);
                    for i in 0..n {
                        vals.push(from_sqlite(r.get_ref(i)?));
                    }
                    out.push(Row { vals });
                }
                Ok(out)
            }
            Inner::Pg(c) => match c.call(Req::Query(pg_sql(sql, false), vals))? {
                Out::Rows(rows) => Ok(rows.into_iter().map(|vals| Row { vals }).collect()),
                _ => Err(DbError::Unexpected {
                    what: "the wrong kind of answer",
                }),
            },
        }
    }

    /// The first row's `f`; [`DbError::NoRow`] when there is none.
    pub(crate) fn query_row<T>(
        &self,
        sql: &str,
        p: impl Params,
        f: impl FnOnce(&Row) -> DbResult<T>,
    ) -> DbResult<T> {
        let rows = self.rows(sql, p.into_values())?;
        match rows.first() {
            Some(r) => f(r),
            None => Err(DbError::NoRow),
        }
    }

    pub(crate) fn prepare(&self, sql: &str) -> DbResult<Statement<'_>> {
        Ok(Statement {
            conn: self,
            sql: sql.to_string(),
        })
    }

    /// Begins a transaction; it rolls back unless committed. On
    /// PostgreSQL every transaction of the store takes one advisory lock
    /// first, so they run one at a time across every control plane, as
    /// SQLite's one writer does.
    pub(crate) fn transaction(&mut self) -> DbResult<Transaction<'_>> {
        match &self.inner {
            Inner::Sqlite(_) => self.execute_batch("BEGIN")?,
            Inner::Pg(c) => {
                c.call(Req::Batch(format!(
                    "BEGIN; SELECT pg_advisory_xact_lock({TX_LOCK})"
                )))?;
            }
        }
        Ok(Transaction {
            conn: self,
            open: true,
        })
    }
}

/// The advisory lock every PostgreSQL transaction of the store holds.
const TX_LOCK: i64 = 0x7275_6e74_0001;
/// The advisory lock migrations hold.
pub(crate) const MIGRATE_LOCK: i64 = 0x7275_6e74_0002;

fn from_sqlite(v: rusqlite::types::ValueRef<'_>) -> Value {
    use rusqlite::types::ValueRef;
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => Value::Int(i),
        ValueRef::Real(f) => Value::Real(f),
        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::Blob(b.to_vec()),
    }
}

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(i) => ValueRef::Integer(*i),
            Value::Real(f) => ValueRef::Real(*f),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

/// A statement to run with values (rusqlite's `prepare` + `query_map`).
pub(crate) struct Statement<'a> {
    conn: &'a Connection,
    sql: String,
}

impl Statement<'_> {
    /// Every row's `f`, read at once.
    pub(crate) fn query_map<T>(
        &mut self,
        p: impl Params,
        mut f: impl FnMut(&Row) -> DbResult<T>,
    ) -> DbResult<std::vec::IntoIter<DbResult<T>>> {
        let rows = self.conn.rows(&self.sql, p.into_values())?;
        Ok(rows.iter().map(&mut f).collect::<Vec<_>>().into_iter())
    }
}

/// A transaction: derefs to its connection; rolls back when dropped
/// uncommitted.
pub(crate) struct Transaction<'a> {
    conn: &'a mut Connection,
    open: bool,
}

impl Transaction<'_> {
    pub(crate) fn commit(mut self) -> DbResult<()> {
        self.open = false;
        self.conn.execute_batch("COMMIT")
    }
}

impl Deref for Transaction<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        if self.open {
            if let Err(e) = self.conn.execute_batch("ROLLBACK") {
                tracing::warn!(error = %e, "a store transaction did not roll back");
            }
        }
    }
}

// ---- PostgreSQL: a connection on its own thread ----

enum Req {
    Exec(String, Vec<Value>),
    Query(String, Vec<Value>),
    Batch(String),
}

enum Out {
    Count(u64),
    Rows(Vec<Vec<Value>>),
    Done,
}

type Job = (Req, mpsc::Sender<DbResult<Out>>);

struct PgConn {
    jobs: mpsc::Sender<Job>,
    /// How to connect again (a stuck connection is replaced).
    config: Box<postgres::Config>,
    /// A call got no answer in time: the thread may be stuck on a silent
    /// peer, so the pool replaces this connection when it is given back.
    stuck: std::sync::atomic::AtomicBool,
}

impl PgConn {
    fn call(&self, req: Req) -> DbResult<Out> {
        if self.stuck.load(std::sync::atomic::Ordering::Relaxed) {
            // Behind a call that got no answer: this one would get none.
            return Err(DbError::Timeout);
        }
        let (tx, rx) = mpsc::channel();
        self.jobs.send((req, tx)).map_err(|_| DbError::Gone)?;
        match rx.recv_timeout(PG_CALL_TIMEOUT) {
            Ok(out) => out,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.stuck.store(true, std::sync::atomic::Ordering::Relaxed);
                Err(DbError::Timeout)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(DbError::Gone),
        }
    }
}

/// Statements kept prepared per connection, at most.
const PG_STATEMENTS: usize = 256;

/// How long a connection attempt to PostgreSQL may take (TCP's connect),
/// and twice this its whole start (the server's greeting included).
const PG_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection whose peer stops answering (a machine cut from the
/// network drops packets, nothing refuses them) is found dead by TCP
/// keepalives: first probe after 5 s of quiet, then every 2 s, given up
/// after 3 unanswered (about 11 s); data sent and not acknowledged for
/// 10 s ends it too. Both ends are told: the server then ends the
/// session of a node cut from it, and its transaction's locks with it.
const PG_KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const PG_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const PG_KEEPALIVE_RETRIES: u32 = 3;
const PG_TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);
/// A call that gets no answer for this long fails (`Timeout`); its
/// connection is replaced. No statement of the store runs this long: a
/// wait this long is a server that holds the connection without
/// answering (the network alive, the server stalled).
const PG_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// A session left idle inside a transaction this long (its node stalled
/// mid-transaction) is ended by the server, so the store-wide transaction
/// lock never waits on a node for longer.
const PG_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);

/// The session settings each connection asks for: the server's side of
/// the keepalives and user timeout above, and the idle-in-transaction end.
fn pg_session_options() -> String {
    format!(
        "-c tcp_keepalives_idle={} -c tcp_keepalives_interval={} -c tcp_keepalives_count={} \
         -c tcp_user_timeout={} -c idle_in_transaction_session_timeout={}",
        PG_KEEPALIVE_IDLE.as_secs(),
        PG_KEEPALIVE_INTERVAL.as_secs(),
        PG_KEEPALIVE_RETRIES,
        PG_TCP_USER_TIMEOUT.as_millis(),
        PG_IDLE_IN_TRANSACTION.as_millis()
    )
}

/// The connection settings of `url` with this server's bounds (a URL's
/// own `connect_timeout` and keepalive settings are overridden; its
/// `options` are kept, ahead of ours).
fn pg_config(url: &str) -> DbResult<postgres::Config> {
    let mut config: postgres::Config = url.parse()?;
    let ours = pg_session_options();
    let options = match config.get_options() {
        Some(own) if !own.trim().is_empty() => format!("{own} {ours}"),
        _ => ours,
    };
    config
        .options(&options)
        .connect_timeout(PG_CONNECT_TIMEOUT)
        .keepalives(true)
        .keepalives_idle(PG_KEEPALIVE_IDLE)
        .keepalives_interval(PG_KEEPALIVE_INTERVAL)
        .keepalives_retries(PG_KEEPALIVE_RETRIES)
        .tcp_user_timeout(PG_TCP_USER_TIMEOUT);
    Ok(config)
}

/// Opens one PostgreSQL connection on a thread of its own.
pub(crate) fn pg_connect(url: &str) -> DbResult<Connection> {
    let config = pg_config(url)?;
    let (ready_tx, ready_rx) = mpsc::channel::<DbResult<()>>();
    let conn = pg_thread(config, Some(ready_tx))?;
    match ready_rx.recv_timeout(PG_CONNECT_TIMEOUT * 2) {
        Ok(Ok(())) => Ok(conn),
        Ok(Err(e)) => Err(e),
        // The thread ends once its connection attempt does.
        Err(mpsc::RecvTimeoutError::Timeout) => Err(DbError::Timeout),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(DbError::Gone),
    }
}

/// A connection's thread. With `ready`, it connects first and says how
/// that went (giving up when nobody waits any more); without, it connects
/// at its first call. A call finding the connection closed connects again.
fn pg_thread(
    config: postgres::Config,
    ready: Option<mpsc::Sender<DbResult<()>>>,
) -> DbResult<Connection> {
    let (jobs, rx) = mpsc::channel::<Job>();
    let own = config.clone();
    std::thread::Builder::new()
        .name("store-pg".into())
        .spawn(move || {
            let mut client = None;
            if let Some(ready) = ready {
                match own.connect(postgres::NoTls) {
                    Ok(c) => {
                        if ready.send(Ok(())).is_err() {
                            return;
                        }
                        client = Some(c);
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e.into()));
                        return;
                    }
                }
            }
            let mut prepared: HashMap<String, postgres::Statement> = HashMap::new();
            while let Ok((req, reply)) = rx.recv() {
                let open = match client.take() {
                    Some(c) if !c.is_closed() => c,
                    // Never connected, or the server went away: connect
                    // again for this call.
                    _ => match own.connect(postgres::NoTls) {
                        Ok(c) => {
                            prepared.clear();
                            c
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e.into()));
                            continue;
                        }
                    },
                };
                let c = client.insert(open);
                let _ = reply.send(pg_run(c, &mut prepared, req));
            }
        })
        .map_err(DbError::Spawn)?;
    Ok(Connection {
        inner: Inner::Pg(PgConn {
            jobs,
            config: Box::new(config),
            stuck: std::sync::atomic::AtomicBool::new(false),
        }),
    })
}

fn pg_run(
    client: &mut postgres::Client,
    prepared: &mut HashMap<String, postgres::Statement>,
    req: Req,
) -> DbResult<Out> {
    let (sql, vals, query) = match req {
        Req::Batch(sql) => {
            client.batch_execute(&sql)?;
            return Ok(Out::Done);
        }
        Req::Exec(sql, vals) => (sql, vals, false),
        Req::Query(sql, vals) => (sql, vals, true),
    };
    let stmt = match prepared.get(&sql) {
        Some(s) => s.clone(),
        None => {
            let s = client.prepare(&sql)?;
            if prepared.len() >= PG_STATEMENTS {
                prepared.clear();
            }
            prepared.insert(sql, s.clone());
            s
        }
    };
    let refs: Vec<&(dyn postgres::types::ToSql + Sync)> = vals
        .iter()
        .map(|v| v as &(dyn postgres::types::ToSql + Sync))
        .collect();
    if !query {
        return Ok(Out::Count(client.execute(&stmt, &refs)?));
    }
    let rows = client.query(&stmt, &refs)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let mut vals = Vec::with_capacity(r.len());
        for (i, col) in r.columns().iter().enumerate() {
            vals.push(pg_value(r, i, col.type_())?);
        }
        out.push(vals);
    }
    Ok(Out::Rows(out))
}

fn pg_value(r: &postgres::Row, i: usize, ty: &postgres::types::Type) -> DbResult<Value> {
    use postgres::types::Type;
    let v = match *ty {
        Type::INT8 => r.try_get::<_, Option<i64>>(i)?.map(Value::Int),
        Type::INT4 => r
            .try_get::<_, Option<i32>>(i)?
            .map(|v| Value::Int(v.into())),
        Type::INT2 => r
            .try_get::<_, Option<i16>>(i)?
            .map(|v| Value::Int(v.into())),
        Type::BOOL => r
            .try_get::<_, Option<bool>>(i)?
            .map(|v| Value::Int(v.into())),
        Type::FLOAT8 => r.try_get::<_, Option<f64>>(i)?.map(Value::Real),
        Type::FLOAT4 => r
            .try_get::<_, Option<f32>>(i)?
            .map(|v| Value::Real(v.into())),
        Type::TEXT | Type::VARCHAR | Type::NAME | Type::BPCHAR | Type::UNKNOWN => {
            r.try_get::<_, Option<String>>(i)?.map(Value::Text)
        }
        Type::BYTEA => r.try_get::<_, Option<Vec<u8>>>(i)?.map(Value::Blob),
        ref other => {
            return Err(DbError::Type {
                index: i,
                what: format!("PostgreSQL type {other} is not read by the store"),
            })
        }
    };
    Ok(v.unwrap_or(Value::Null))
}

impl postgres::types::ToSql for Value {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::{IsNull, Type};
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(i) => match *ty {
                Type::INT8 => i.to_sql(ty, out),
                Type::INT4 => i32::try_from(*i)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*i)?.to_sql(ty, out),
                Type::BOOL => (*i != 0).to_sql(ty, out),
                Type::FLOAT8 => (*i as f64).to_sql(ty, out),
                Type::TEXT | Type::VARCHAR | Type::UNKNOWN => i.to_string().to_sql(ty, out),
                ref other => Err(format!("an integer for a parameter of type {other}").into()),
            },
            Value::Real(f) => match *ty {
                Type::FLOAT8 => f.to_sql(ty, out),
                Type::FLOAT4 => (*f as f32).to_sql(ty, out),
                ref other => Err(format!("a real for a parameter of type {other}").into()),
            },
            Value::Text(s) => match *ty {
                Type::BYTEA => s.as_bytes().to_sql(ty, out),
                _ => s.as_str().to_sql(ty, out),
            },
            Value::Blob(b) => b.as_slice().to_sql(ty, out),
        }
    }

    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }

    postgres::types::to_sql_checked!();
}

// ---- The engines as the store holds them ----

/// The store's connections: SQLite's one, or a pool of PostgreSQL's.
pub(crate) enum Engine {
    Sqlite(Mutex<Connection>),
    Pg(Pool),
}

pub(crate) struct Pool {
    free: Mutex<Vec<Connection>>,
    returned: Condvar,
}

impl Pool {
    pub(crate) fn new(conns: Vec<Connection>) -> Self {
        Pool {
            free: Mutex::new(conns),
            returned: Condvar::new(),
        }
    }
}

impl Engine {
    /// A connection for one call or transaction: SQLite's under its lock,
    /// or a PostgreSQL one taken from the pool (waiting for one to be
    /// given back when all are in use).
    pub(crate) fn conn(&self) -> ConnGuard<'_> {
        match self {
            // A panic while holding the lock cannot leave SQLite inconsistent.
            Engine::Sqlite(m) => ConnGuard::Sqlite(m.lock().unwrap_or_else(|p| p.into_inner())),
            Engine::Pg(pool) => {
                let mut free = pool.free.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(c) = free.pop() {
                        return ConnGuard::Pg {
                            pool,
                            conn: Some(c),
                        };
                    }
                    free = pool.returned.wait(free).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}

pub(crate) enum ConnGuard<'a> {
    Sqlite(MutexGuard<'a, Connection>),
    Pg {
        pool: &'a Pool,
        conn: Option<Connection>,
    },
}

impl Deref for ConnGuard<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        match self {
            ConnGuard::Sqlite(g) => g,
            ConnGuard::Pg { conn, .. } => conn.as_ref().unwrap_or_else(|| unreachable!()),
        }
    }
}

impl DerefMut for ConnGuard<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        match self {
            ConnGuard::Sqlite(g) => g,
            ConnGuard::Pg { conn, .. } => conn.as_mut().unwrap_or_else(|| unreachable!()),
        }
    }
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        if let ConnGuard::Pg { pool, conn } = self {
            if let Some(mut c) = conn.take() {
                if let Inner::Pg(pg) = &c.inner {
                    if pg.stuck.load(std::sync::atomic::Ordering::Relaxed) {
                        // Its thread may wait on a silent peer for ever: a
                        // new connection, made at its first call, takes
                        // its place (the old thread ends with its socket).
                        match pg_thread((*pg.config).clone(), None) {
                            Ok(fresh) => c = fresh,
                            Err(e) => {
                                tracing::warn!(error = %e, "replacing a stuck store connection failed")
                            }
                        }
                    }
                }
                pool.free.lock().unwrap_or_else(|p| p.into_inner()).push(c);
                pool.returned.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_that_refuses_or_never_answers_is_unreachable_and_does_not_hang() {
        // Refused: nothing listens on the port.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let Err(refused) = pg_connect(&format!("postgres://u@127.0.0.1:{port}/db")) else {
            panic!("connected to a closed port");
        };
        assert!(refused.is_unreachable(), "{refused:?}");
        // Never answers: a listener that takes the connection and says nothing.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("postgres://u@{}/db", silent.local_addr().unwrap());
        let held = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
        let started = std::time::Instant::now();
        let Err(quiet) = pg_connect(&url) else {
            panic!("connected to a listener that says nothing");
        };
        assert!(quiet.is_unreachable(), "{quiet:?}");
        assert!(
            started.elapsed() < PG_CONNECT_TIMEOUT * 4,
            "gave up after {:?}",
            started.elapsed()
        );
        drop(held.join());
        // A statement the server refused is not a store that is away.
        assert!(!DbError::NoRow.is_unreachable());
    }

    #[test]
    fn placeholders_and_types_are_translated_for_postgres() {
        assert_eq!(
            pg_sql("SELECT a FROM t WHERE b = ?1 AND c = '?' AND d = ?2", false),
            "SELECT a FROM t WHERE b = $1 AND c = '?' AND d = $2"
        );
        assert_eq!(
            pg_sql(
                "CREATE TABLE t (seq INTEGER PRIMARY KEY AUTOINCREMENT, n INTEGER)",
                true
            ),
            "CREATE TABLE t (seq BIGSERIAL PRIMARY KEY, n BIGINT)"
        );
        assert_eq!(sqlite_sql("SELECT 1 FROM t FOR UPDATE"), "SELECT 1 FROM t ");
        assert_eq!(sqlite_sql("SELECT 1"), "SELECT 1");
    }
}
