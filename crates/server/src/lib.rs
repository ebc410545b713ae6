//! The control plane: the Runtime Cloud HTTP API (axum), keys, validation,
//! idempotency, waits, the sandbox lifecycle and leases, over an embedded
//! SQLite store. It drives machines only through [`runtime_host::Host`] and
//! answers with the types of `runtime-api`; it never speaks the guest
//! protocol, nor runs the egress proxy (the host does, with the rules the
//! server sets on it). Workspace crates it uses: `runtime-api`,
//! `runtime-host` (the trait and its types) and `runtime-egress` (the types
//! of rules and secrets).
//!
//! Four layers, each a directory, and the rule between them (kept by
//! `tests/layers.rs`):
//!
//! ```text
//! http/     the only code that names axum, StatusCode, Bytes: one route table
//!    │      (route.rs), extractors, the one error mapping, and routes/ with one
//!    ▼      file per resource that parses a request, calls a service, renders
//! service/  orchestration over the store, the Host and owned tasks; the
//!    │  \   lifecycle driver (lifecycle.rs) and the clock
//!    ▼   ▼
//! domain/ ◀ store/   pure types and rules (no I/O, `now` a parameter) ◀ typed
//!                    rows and migrations, no business rules
//! ```
//! `http → service → {domain, store}`, `store → domain`; `domain` imports
//! nothing of the crate; `error.rs` (the error enums) serves every layer.
//! Every file is in a layer; no two modules import each other in a circle.

mod domain;
mod error;
mod http;
mod service;
mod store;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use runtime_host::Host;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use domain::money::Prices;

/// A `.dockerignore` read as the server reads it: whether a context path
/// (`a/b.txt`, `/`-separated, relative) is left out. For the CLI's build
/// context, which leaves out what the server would.
pub fn dockerignore(text: &str) -> impl Fn(&str) -> bool {
    let ignore = domain::image::context::Ignore::parse(text);
    move |path: &str| ignore.excluded(path)
}
pub use domain::quota::{Limits as Quotas, Reserve};
pub use domain::webhook::AllowHost;
pub use error::{ApiError, ServerError};
pub use http::route::ROUTE_SAMPLES;
pub use http::serve::Peer;
pub use service::clock::Clock;
pub use service::keys;
pub use service::simulate::{simulate_placement, SimReport};
pub use store::{redact as redact_store_url, NodeRow, Store, StoreAt, StoreLocation};

/// Warm machines per image and shape, unless the operator says otherwise.
pub const DEFAULT_WARM_POOL: u32 = 2;
/// Host memory (MiB) all warm machines may hold, unless the operator says
/// otherwise.
pub const DEFAULT_WARM_POOL_MEMORY_MIB: u64 = 2048;

/// The server's settings, loaded once by the CLI and passed down.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    /// Where the store is (`--store`); `None`, SQLite's file in `data_dir`.
    pub store: Option<StoreAt>,
    /// An answer not ready after this long is sent as `200` +
    /// `runtime-late-answer: true`, its JSON following when done.
    pub late_answer_after: Duration,
    /// Silence on an NDJSON stream after which a `\n` is sent.
    pub heartbeat: Duration,
    /// How long an exited process's output stays readable.
    pub output_keep: Duration,
    /// Output kept per process for resuming readers.
    pub output_buffer_bytes: usize,
    /// Largest chunked upload.
    pub max_upload_bytes: u64,
    /// How long idempotency records are kept.
    pub idempotency_ttl: Duration,
    /// How long `run` waits for owned tasks after the listener closed.
    pub drain_timeout: Duration,
    /// Previews are served at `<port>-<sandbox>.<preview_domain>`.
    pub preview_domain: String,
    /// The port in preview URLs; 0 = the port the server listens on.
    pub preview_port: u16,
    /// Most requests (and upgraded connections) one preview serves at once;
    /// more are refused with 503 until some end.
    pub preview_max_concurrent: usize,
    /// How long a preview's guest server may take to answer a request's
    /// head before the visitor gets 504.
    pub preview_head_timeout: Duration,
    /// Serve HTTPS with this certificate chain and key (PEM files).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Let `runtime login`'s approval page, which takes the admin key, be
    /// used over plain HTTP from other machines (otherwise only from this
    /// one, or over TLS).
    pub login_over_http: bool,
    /// What running, paused and kept sandboxes cost (docs/billing.md).
    pub prices: Prices,
    /// Where the service reads the time (tests run on tokio's paused time).
    pub clock: Clock,
    /// A request head must arrive whole within this (from a connection's
    /// start or its last answer: idle keep-alive connections close too).
    pub header_read_timeout: Duration,
    /// Most HTTP connections open at once; the next wait in the backlog.
    pub max_connections: usize,
    /// Hosts webhooks may reach over plain HTTP and at private addresses
    /// (`--webhook-allow-host`).
    pub webhook_allow: Vec<AllowHost>,
    /// How many milliseconds a second of the webhook retry schedule lasts:
    /// 1000, but tests shorten it.
    pub webhook_second_ms: i64,
    /// What each key may hold at once (`--quota name=value`).
    pub quotas: Quotas,
    /// What the host keeps free when admitting machines.
    pub reserve: Reserve,
    /// Warm machines kept per image and shape a create used
    /// (`--warm-pool`; 0: none). See docs/memory.md, "Warm machines".
    pub warm_pool: u32,
    /// Host memory all warm machines together may hold, in MiB
    /// (`--warm-pool-memory-mib`).
    pub warm_pool_memory_mib: u64,
    /// TEST ONLY (`--test-crash-at`): the step at which the server kills
    /// itself, for the crash tests ([`runtime_host::crash_point`]).
    pub test_crash_at: Option<String>,
    /// Registry mirrors (`--registry-mirror docker.io=host[:port]`): the
    /// mirror is asked first for that registry's images.
    pub registry_mirrors: Vec<(String, String)>,
    /// Registries (or mirrors) pulled from over plain HTTP
    /// (`--registry-insecure host[:port]`, for labs and tests).
    pub registry_insecure: Vec<String>,
    /// Certificates (PEM) every sandbox trusts beside the public ones and
    /// its own CA (`--guest-ca`): empty unless the operator gives some.
    pub guest_cas: String,
    /// The URL other control planes on the same store reach this one at
    /// (`--node-url`), for requests about its sandboxes; `None`: the
    /// address it listens on (docs/deploy.md, "Several control planes").
    pub node_url: Option<String>,
    /// A node not seen for this long is held lost by its peers, its
    /// running sandboxes recorded `stopped` with `stopReason: host_lost`
    /// (`--host-lost-after`; docs/deploy.md, "A node that stays away").
    pub host_lost_after: Duration,
}

impl Config {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Config {
            data_dir: data_dir.into(),
            store: None,
            node_url: None,
            host_lost_after: Duration::from_secs(30),
            late_answer_after: Duration::from_secs(90),
            heartbeat: Duration::from_secs(15),
            output_keep: Duration::from_secs(600),
            output_buffer_bytes: 1 << 20,
            max_upload_bytes: 1 << 30,
            idempotency_ttl: Duration::from_secs(24 * 3600),
            drain_timeout: Duration::from_secs(10),
            preview_domain: "localhost".into(),
            preview_port: 0,
            preview_max_concurrent: 128,
            preview_head_timeout: Duration::from_secs(120),
            tls: None,
            login_over_http: false,
            prices: Prices::default(),
            clock: Clock::System,
            header_read_timeout: Duration::from_secs(30),
            max_connections: 4096,
            webhook_allow: Vec::new(),
            webhook_second_ms: 1000,
            quotas: Quotas::default(),
            reserve: Reserve::default(),
            warm_pool: DEFAULT_WARM_POOL,
            warm_pool_memory_mib: DEFAULT_WARM_POOL_MEMORY_MIB,
            test_crash_at: None,
            registry_mirrors: Vec::new(),
            registry_insecure: Vec::new(),
            guest_cas: String::new(),
        }
    }
}

/// Everything a request handler reaches. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    store: Store,
    host: Arc<dyn Host>,
    /// Bumped on every sandbox state change; waits re-read the store.
    changes: watch::Sender<u64>,
    /// Bumped on every change of an image's record or log; followers of a
    /// build's log re-read the store.
    image_changes: watch::Sender<u64>,
    /// One lifecycle lock per sandbox: start, stop and destroy never overlap.
    lifecycle: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serializes name checks with inserts (and quota checks with the
    /// inserts they admit).
    create_lock: tokio::sync::Mutex<()>,
    /// Snapshots being captured and the bytes each was admitted for: they
    /// count against `snapshot.mib` until their real size is recorded.
    capturing: Mutex<HashMap<String, u64>>,
    /// Held while images are pruned and while a new image is inserted.
    prune_gate: Mutex<()>,
    /// Builds running per key (`image.builds`): the rest wait `queued`.
    build_slots: service::images::BuildSlots,
    inflight: http::idempotency::Inflight,
    procs: service::processes::Table,
    /// The interpreter's contexts and their kernels.
    interpreter: service::interpreter::Contexts,
    /// Sandboxes whose last pause failed (they ran on), for the `:pause`
    /// answer: a sandbox running again may also have paused and been woken.
    pause_failed: Mutex<HashSet<String>>,
    /// Why the last `:switch-image` of a sandbox was undone, for its answer
    /// (one entry per sandbox, taken by the answer).
    switch_failures: Mutex<std::collections::HashMap<String, String>>,
    /// Volumes being backed up, resized or restored into: no sandbox
    /// attaches them and no delete takes them meanwhile.
    volume_ops: Mutex<HashSet<String>>,
    /// When each volume's daily backup was last tried.
    daily_tried: Mutex<HashMap<String, i64>>,
    uploads: service::uploads::Uploads,
    watches: service::watches::Watches,
    previews: service::previews::live::Live,
    /// The key that seals secret values, read or made on first use.
    sealer: std::sync::OnceLock<domain::secret::Sealer>,
    nets: service::network::Nets,
    meter: service::meter::Meter,
    metrics: service::metrics::Metrics,
    /// The operator's counters (`GET /metrics`).
    telemetry: domain::telemetry::Telemetry,
    /// API answers not yet written (`GET /v1/usage/requests`).
    requests: service::usage::RequestBatch,
    /// When this server started, for its uptime.
    started: std::time::Instant,
    logins: http::login::Pending,
    /// MCP sessions (`/mcp`).
    mcp: http::mcp::Sessions,
    hooks: service::webhooks::Hooks,
    /// Warm machines per image and shape.
    pools: service::pool::Pools,
    /// Which node runs each sandbox asked about (a sandbox never moves).
    owners: http::forward::Owners,
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl AppState {
    pub fn new(config: Config, store: Store, host: Arc<dyn Host>) -> Self {
        let uploads_dir = config.data_dir.join("uploads");
        // Partial uploads do not survive a restart.
        let _ = std::fs::remove_dir_all(&uploads_dir);
        AppState {
            inner: Arc::new(Inner {
                changes: watch::channel(0).0,
                image_changes: watch::channel(0).0,
                lifecycle: Mutex::new(HashMap::new()),
                create_lock: tokio::sync::Mutex::new(()),
                capturing: Mutex::new(HashMap::new()),
                prune_gate: Mutex::new(()),
                build_slots: service::images::BuildSlots::default(),
                inflight: http::idempotency::Inflight::default(),
                procs: service::processes::Table::new(config.clock),
                interpreter: service::interpreter::Contexts::default(),
                pause_failed: Mutex::new(HashSet::new()),
                switch_failures: Mutex::default(),
                volume_ops: Mutex::new(HashSet::new()),
                daily_tried: Mutex::new(HashMap::new()),
                uploads: service::uploads::Uploads::new(uploads_dir),
                watches: service::watches::Watches::default(),
                previews: service::previews::live::Live::default(),
                sealer: std::sync::OnceLock::new(),
                nets: service::network::Nets::default(),
                meter: service::meter::Meter::default(),
                metrics: service::metrics::Metrics::default(),
                telemetry: domain::telemetry::Telemetry::default(),
                requests: service::usage::RequestBatch::default(),
                started: std::time::Instant::now(),
                logins: http::login::Pending::default(),
                mcp: http::mcp::Sessions::default(),
                hooks: service::webhooks::Hooks::default(),
                pools: service::pool::Pools::default(),
                owners: http::forward::Owners::default(),
                tasks: TaskTracker::new(),
                cancel: CancellationToken::new(),
                config,
                store,
                host,
            }),
        }
    }

    fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Now, in milliseconds since the epoch, by the configured clock.
    pub(crate) fn now_ms(&self) -> i64 {
        self.inner.config.clock.now_ms()
    }

    /// The URL this control plane's peers reach it at (`run` settles it).
    pub(crate) fn node_url(&self) -> &str {
        self.config().node_url.as_deref().unwrap_or_default()
    }

    /// Whether sandbox `id`'s machines are this node's (or it has no
    /// record): another control plane's are left to it.
    pub(crate) fn runs_here(&self, id: &str) -> bool {
        match self.store().sandbox_node(id) {
            Ok(Some(n)) => n == self.store().node(),
            Ok(None) => true,
            Err(_) => false,
        }
    }

    fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The credentials key `key_id` pulls from `registry` with
    /// (`service::images::registries::credentials_for`), for tests that
    /// drive the router.
    pub fn registry_credentials(
        &self,
        key_id: &str,
        registry: &str,
    ) -> Option<runtime_host::oci::Credentials> {
        service::images::registries::credentials_for(self, key_id, registry)
    }

    fn host(&self) -> &Arc<dyn Host> {
        &self.inner.host
    }

    fn sealer(&self) -> Result<&domain::secret::Sealer, ApiError> {
        if let Some(s) = self.inner.sealer.get() {
            return Ok(s);
        }
        let s = service::secrets::open_sealer(&self.config().data_dir)?;
        Ok(self.inner.sealer.get_or_init(|| s))
    }

    fn secrets_changed(&self) {
        service::network::secrets_changed(self);
    }

    fn notify_change(&self) {
        self.inner.changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn notify_image_change(&self) {
        self.inner
            .image_changes
            .send_modify(|v| *v = v.wrapping_add(1));
    }

    fn lifecycle_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self
            .inner
            .lifecycle
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_string()).or_default().clone()
    }

    fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.tasks.spawn(fut)
    }

    /// Starts the lease reaper and housekeeping. `run` calls it; tests may.
    pub fn start_background(&self) {
        let st = self.clone();
        self.spawn(async move { service::background::reaper(st).await });
        let st = self.clone();
        self.spawn(async move { service::meter::run(st).await });
        let st = self.clone();
        self.spawn(async move { service::webhooks::run(st).await });
        let st = self.clone();
        self.spawn(async move { service::usage::run(st).await });
    }

    /// One tick of the meter (one second of every sandbox). The background
    /// runs it each second; tests call it to move time on.
    pub async fn meter_tick(&self) -> Result<(), ServerError> {
        service::meter::tick(self).await
    }

    /// Ends streams and background tasks, waiting up to the drain timeout.
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        self.inner.tasks.close();
        if tokio::time::timeout(self.config().drain_timeout, self.inner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("tasks still running after the drain timeout");
        }
        // Refills have stopped: no warm machine outlives the server.
        service::pool::drain(self).await;
    }
}

impl Config {
    /// Where the store is: `store`, or SQLite's file in `data_dir`.
    pub fn store_at(&self) -> StoreAt {
        self.store
            .clone()
            .unwrap_or_else(|| StoreAt::Sqlite(self.data_dir.clone()))
    }
}

/// Opens (creating or migrating) the store at `at`: a data directory
/// (its `runtime.db`) or a [`StoreAt`].
pub fn open_store(at: &(impl StoreLocation + ?Sized)) -> Result<Store, ServerError> {
    Store::open_at(&at.store_at())
}

/// On first start creates the account-wide admin key, writes it to
/// `data_dir/admin.key` (mode 0600) and returns it to be printed once.
pub fn ensure_admin_key(data_dir: &Path) -> Result<Option<String>, ServerError> {
    ensure_admin_key_in(data_dir, data_dir)
}

/// [`ensure_admin_key`] with the store elsewhere (`--store`): the file is
/// still `data_dir/admin.key`, the key's hash goes to `at`.
pub fn ensure_admin_key_in(
    data_dir: &Path,
    at: &(impl StoreLocation + ?Sized),
) -> Result<Option<String>, ServerError> {
    let path = data_dir.join("admin.key");
    if path.exists() {
        return Ok(None);
    }
    std::fs::create_dir_all(data_dir).map_err(|source| ServerError::Io {
        op: "create data dir",
        path: data_dir.display().to_string(),
        source,
    })?;
    let key = create_key(at, Some("admin"), false, true)?;
    write_secret_file(&path, &key)?;
    Ok(Some(key))
}

fn write_secret_file(path: &Path, contents: &str) -> Result<(), ServerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| ServerError::Io {
        op: "write admin key",
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(format!("{contents}\n").as_bytes())
        .map_err(io)?;
    f.sync_all().map_err(io)
}

/// Creates a key and returns it (only its SHA-256 is stored). Uses its own
/// connection, so it works while a server runs on the same file.
pub fn create_key(
    at: &(impl StoreLocation + ?Sized),
    name: Option<&str>,
    read_only: bool,
    account_wide: bool,
) -> Result<String, ServerError> {
    let conn = store::open_connection(&at.store_at())?;
    let (id, key) = domain::access::new_key();
    store::insert_key(
        &conn,
        &id,
        name,
        &domain::access::sha256_hex(key.as_bytes()),
        read_only,
        account_wide,
        &service::clock::now_iso(),
    )?;
    Ok(key)
}

/// The whole API as a router, so tests drive it without a socket.
pub fn router(state: AppState) -> axum::Router {
    http::router(state)
}

/// The API as code in a sandbox reaches it at `http://runtime.internal`:
/// what [`run`] hands the host's egress proxy, public so tests drive it
/// without a VM. Each connection it serves names its sandbox.
pub fn in_sandbox_api(state: &AppState) -> Arc<dyn runtime_egress::InternalApi> {
    Arc::new(http::internal::InSandboxApi::new(
        router(state.clone()),
        state.config().header_read_timeout,
    ))
}

/// Reattaches to the sandboxes an earlier server left starting or running:
/// found ones are `running`, the rest `stopped` with `stopReason: host_lost`.
/// Then takes up the processes of the running ones (`lost` when the host no
/// longer knows them) and reloads the records of those that ended.
pub async fn recover(state: &AppState) -> Result<(), ServerError> {
    service::background::recover(state).await?;
    service::images::recover(state).await?;
    service::processes::recover(state).await
}

/// With several nodes on one PostgreSQL store: whether this data
/// directory's `secrets.key` is the one the store's secrets are sealed
/// with (a node without it, or with another, is refused; see
/// [`run`], which checks it too). Nothing to check on SQLite.
pub fn check_secrets_key(data_dir: &Path, at: &StoreAt) -> Result<(), ServerError> {
    if !matches!(at, StoreAt::Postgres(_)) {
        return Ok(());
    }
    service::secrets::check_shared_key(data_dir, &open_store(at)?)
}

/// Recovers sandboxes, serves until `shutdown` resolves, then drains.
pub async fn run(
    listener: tokio::net::TcpListener,
    config: Config,
    host: Arc<dyn Host>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let mut config = config;
    if config.preview_port == 0 {
        config.preview_port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    }
    let tls = match &config.tls {
        Some((cert, key)) => Some(http::tls::load(cert, key)?),
        None => None,
    };
    let node = node_id(&config.data_dir)?;
    let node_url = match &config.node_url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None => default_node_url(listener.local_addr().ok(), config.tls.is_some()),
    };
    config.node_url = Some(node_url.clone());
    let store = open_store(&config.store_at())?.on_node(&node);
    if store.shared() {
        service::secrets::check_shared_key(&config.data_dir, &store)?;
    }
    if store.shared() {
        // Requests this node had claimed before it stopped run nowhere now:
        // their resends run again.
        let dropped = store.idem_release_all_mine()?;
        if dropped > 0 {
            tracing::info!(node = %node, requests = dropped, "dropped the idempotency claims of requests cut short");
        }
    }
    let adopted = store.adopt_unowned()?;
    if adopted > 0 {
        tracing::info!(node = %node, sandboxes = adopted, "took the sandboxes no node owned");
    }
    tracing::info!(node = %node, url = %node_url, "this control plane's node");
    let state = AppState::new(config, store, host);
    let me = service::nodes::beat(&state, true).await?;
    recover(&state).await?;
    if me.lost_ms != 0 {
        // Its peers held it lost while it was away: settle what they recorded.
        service::nodes::come_back(&state, me.lost_ms).await;
    }
    state.start_background();
    let app = router(state.clone());
    // Code in the sandboxes reaches the same router at runtime.internal.
    state.host().serve_api(Some(in_sandbox_api(&state)));
    let limits = http::serve::Limits {
        header_read: state.config().header_read_timeout,
        max_connections: state.config().max_connections,
        drain: state.config().drain_timeout.max(Duration::from_secs(30)),
    };
    let cancel = state.inner.cancel.clone();
    let stop = async move {
        shutdown.await;
        // Ends long streams so the graceful shutdown can finish.
        cancel.cancel();
    };
    match tls {
        Some(cfg) => {
            let listener =
                http::tls::TlsListener::new(listener, cfg).map_err(|source| ServerError::Io {
                    op: "listen",
                    path: "the TLS listener".into(),
                    source,
                })?;
            http::serve::serve(listener, app, limits, stop).await
        }
        None => http::serve::serve(listener, app, limits, stop).await,
    }
    state.host().serve_api(None);
    state.shutdown().await;
    // Another control plane takes this one's store-wide jobs at once, and
    // places no more creates here.
    let _ = state.store().release_leases();
    let _ = state.store().node_leaving();
    Ok(())
}

/// This server's node id: `node.id` in the data directory, made on the
/// first start. It names the machines of this data directory, so it moves
/// with it.
fn node_id(data_dir: &Path) -> Result<String, ServerError> {
    let path = data_dir.join("node.id");
    let io = |source| ServerError::Io {
        op: "node id",
        path: path.display().to_string(),
        source,
    };
    // Only a missing (or empty) file is made anew: a new id would leave this
    // machine's sandboxes to a node that never comes back.
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => Ok(id.trim().to_string()),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e)),
        Ok(_) | Err(_) => {
            std::fs::create_dir_all(data_dir).map_err(io)?;
            let id = format!("node_{}", uuid::Uuid::new_v4().simple());
            let tmp = data_dir.join("node.id.tmp");
            std::fs::write(&tmp, format!("{id}\n")).map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(id)
        }
    }
}

/// The URL peers reach a server listening at `addr` at: that address, or
/// the machine's host name when it listens on every address.
fn default_node_url(addr: Option<std::net::SocketAddr>, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let Some(addr) = addr else {
        return format!("{scheme}://127.0.0.1:8080");
    };
    if addr.ip().is_unspecified() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        return format!("{scheme}://{host}:{}", addr.port());
    }
    format!("{scheme}://{addr}")
}

#[cfg(test)]
mod node_id_tests {
    #[test]
    fn a_node_keeps_its_id_and_an_unreadable_one_is_an_error_not_a_new_id() {
        let dir = std::env::temp_dir().join(format!("rt-node-{}", uuid::Uuid::new_v4()));
        let first = super::node_id(&dir).unwrap();
        assert!(first.starts_with("node_"), "{first}");
        assert_eq!(super::node_id(&dir).unwrap(), first);
        // A node.id that cannot be read (here a directory) is not replaced.
        let other = dir.join("other");
        std::fs::create_dir_all(other.join("node.id")).unwrap();
        assert!(super::node_id(&other).is_err());
        assert!(other.join("node.id").is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
