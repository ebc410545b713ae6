//! `runtime`: the one binary. `serve` runs the control plane and the host in
//! one process with an embedded store; `keys` manages API keys in a data
//! directory; `login` asks a server for a key through the browser and saves
//! it where `withruntime` reads it; `mcp` bridges stdio to a server's MCP
//! endpoint; `image build` builds (or verifies) the
//! guest kernel and image, or with `--file` a custom image from a TOML
//! recipe on a running server; `sandbox ...` and `image ls|logs|tag|rm`
//! are clients of any server's API (docs/cli.md).
//!
//! Environment is read here and nowhere else: `RUNTIME_CACHE_DIR`,
//! `RUNTIME_AGENT_BIN`, `XDG_DATA_HOME`, `XDG_CACHE_HOME`, `XDG_CONFIG_HOME`,
//! `RUNTIME_AUTH_URL`, `RUNTIME_API_URL`, `RUNTIME_API_KEY`, `HOME`. Root's defaults are `/var/lib/runtime` and
//! `/var/cache/runtime`.

mod client;
mod copy;
mod forward;
mod image;
mod login;
mod mcp;
mod output;
mod sandbox;
mod shell;
mod tar;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use runtime_host::{artifacts, choose_accel, probe_boot, Accel, QemuConfig, QemuHost};

#[derive(Parser)]
#[command(
    name = "runtime",
    version,
    about = "Self-hosted sandboxes for AI agents, as QEMU microVMs"
)]
struct Cli {
    /// How log lines look on stderr: `text` for people, `json` (one object
    /// a line, with the request's id and route) for a log collector.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once at start: the size of the serve variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// (internal) Serves a shared volume's directory as 9P on stdin/stdout,
    /// as the volume's uid; started by the server for each attachment.
    #[command(name = "9p-serve", hide = true)]
    NinePServe {
        /// Drop to this uid (and gid) before reading anything.
        #[arg(long)]
        uid: Option<u32>,
        /// No file grows past this many bytes.
        #[arg(long)]
        max_bytes: u64,
        dir: std::path::PathBuf,
    },
    /// Serve the Runtime API (builds the guest kernel and image first if needed).
    Serve {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Where the store is: `sqlite` (the default, `runtime.db` in the
        /// data directory) or a PostgreSQL URL, postgres://USER@HOST/DB
        /// (docs/deploy.md, "PostgreSQL").
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// With several control planes on one PostgreSQL store: the
        /// http:// URL the others reach this one at, for requests about its
        /// sandboxes (default: the listen address; the host name when it
        /// listens on every address). docs/deploy.md, "Several control planes".
        #[arg(long, env = "RUNTIME_NODE_URL", value_name = "URL")]
        node_url: Option<String>,
        /// Seconds a VM may take from QEMU's start until its agent answers.
        #[arg(long, default_value_t = 120)]
        boot_timeout: u64,
        /// Boot every sandbox instead of restoring a pre-booted template of
        /// its shape.
        #[arg(long)]
        no_templates: bool,
        /// Sandboxes restored from a template (and warm machines) map its
        /// memory copy-on-write instead of each taking a copy: about 40 MiB
        /// less host memory per idle sandbox, but their pause, fork and
        /// snapshot write the whole memory (docs/memory.md).
        #[arg(long, env = "RUNTIME_SHARE_TEMPLATE_MEMORY")]
        share_template_memory: bool,
        #[command(flatten)]
        net: NetArgs,
        #[command(flatten)]
        prices: PriceArgs,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Ask a server for an API key, approved by a person in the browser, and
    /// save it where the `withruntime` client reads a saved login.
    Login {
        /// The server's origin, e.g. http://127.0.0.1:8080.
        #[arg(long)]
        url: String,
        /// The name this computer gives itself on the approval page.
        #[arg(long)]
        computer: Option<String>,
        /// Print the approval address without opening a browser.
        #[arg(long)]
        no_browser: bool,
    },
    /// A stdio MCP server for agents (`claude mcp add runtime -- runtime
    /// mcp`): forwards each message to the server's `/mcp` with the key.
    Mcp {
        /// The server's origin; without it, the one `runtime login` saved.
        #[arg(long, env = "RUNTIME_API_URL")]
        url: Option<String>,
        /// An API key; without it, the key `runtime login` saved for the
        /// server (keep keys out of command lines: use the environment).
        #[arg(long, env = "RUNTIME_API_KEY", hide_env_values = true, hide = true)]
        key: Option<String>,
    },
    /// API keys of a data directory.
    Keys {
        #[command(subcommand)]
        cmd: KeysCmd,
    },
    /// The nodes that share a PostgreSQL store (docs/deploy.md,
    /// "Placement"): list them, drain one, take it back.
    Host {
        #[command(subcommand)]
        cmd: HostCmd,
    },
    /// The guest kernel and root filesystem image, and custom images.
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
    /// Sandboxes on a server: create, exec, shell, cp, ... (docs/cli.md).
    Sandbox(sandbox::SandboxArgs),
}

/// Previews and the egress proxy.
#[derive(clap::Args)]
struct NetArgs {
    /// Previews are served at `<port>-<sandbox>.<domain>` on the server's
    /// port; `localhost` resolves to loopback in browsers and curl.
    #[arg(long, default_value = "localhost")]
    preview_domain: String,
    /// TEST ONLY, never in production: egress to NAME (or `*.domain`) goes
    /// to ADDR (`ip:port`) instead of being resolved, and ADDR is exempt
    /// from the refusal of private addresses. Repeatable.
    #[arg(long = "egress-test-map", value_name = "NAME=ADDR")]
    egress_test_map: Vec<String>,
    /// TEST ONLY: a PEM file of CA certificates the egress proxy trusts
    /// for destinations, besides the system's. Repeatable.
    #[arg(long = "egress-test-root", value_name = "PEM")]
    egress_test_root: Vec<PathBuf>,
    /// Most outbound connections the egress proxy keeps open at once, every
    /// sandbox together (each sandbox has at most 256); beyond it a new one
    /// is refused.
    #[arg(
        long = "egress-max-connections",
        value_name = "N",
        default_value_t = 4096
    )]
    egress_max_connections: usize,
    /// An address that reaches this server from outside though none of
    /// its interfaces carries it (a public IP NATed to it, a load
    /// balancer): sandboxes may not connect to it, as to the server's own
    /// addresses. Repeatable.
    #[arg(long = "egress-deny-self", value_name = "IP")]
    egress_deny_self: Vec<std::net::IpAddr>,
    /// Serve HTTPS (the API and the previews) with this PEM certificate
    /// chain; give a wildcard for `*.<preview domain>` to cover previews.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Let `runtime login`'s approval page, where the admin key is typed,
    /// be used over plain HTTP from other machines. Without TLS it is
    /// otherwise served only to this machine's loopback.
    #[arg(long)]
    login_over_http: bool,
    /// Webhooks may point at HOST (any port, or only PORT) over plain
    /// http:// and at loopback, private or link-local addresses, which are
    /// otherwise refused. Repeatable; `[v6]` in brackets.
    #[arg(long = "webhook-allow-host", value_name = "HOST[:PORT]")]
    webhook_allow_host: Vec<String>,
    /// TEST ONLY: a second of the webhook retry schedule lasts this many
    /// milliseconds (1000), so tests see retries soon.
    #[arg(long = "webhook-test-second-ms", hide = true, default_value_t = 1000)]
    webhook_test_second_ms: u32,
    /// TEST ONLY: the server kills itself (SIGKILL) at this step
    /// (`capture_running`, `pause_capture`, `pause_kept`, `wake_running`,
    /// `delete_destroy`, `create_answer`, `machine_up`, `fork_answer`,
    /// `snapshot_answer`, `build_step`, `attach_served`), so the crash tests
    /// hit it exactly.
    #[arg(long = "test-crash-at", hide = true, value_name = "POINT")]
    test_crash_at: Option<String>,
    /// Image builds pull REGISTRY's images (`docker.io` for Docker Hub)
    /// from MIRROR (`host[:port]`) first, then from the registry itself.
    /// Repeatable.
    #[arg(long = "registry-mirror", value_name = "REGISTRY=MIRROR")]
    registry_mirror: Vec<String>,
    /// Image builds speak plain HTTP to this registry or mirror
    /// (`host[:port]`), for labs and tests. Repeatable.
    #[arg(long = "registry-insecure", value_name = "HOST[:PORT]")]
    registry_insecure: Vec<String>,
    /// A PEM file of CA certificates every sandbox trusts beside the public
    /// ones (for outbound traffic that passes a TLS-inspecting proxy).
    /// Repeatable; off by default.
    #[arg(long = "guest-ca", value_name = "PEM")]
    guest_ca: Vec<PathBuf>,
}

impl NetArgs {
    fn apply(&self, c: &mut runtime_server::Config) -> anyhow::Result<()> {
        c.preview_domain = self.preview_domain.trim_matches('.').to_ascii_lowercase();
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            c.tls = Some((cert.clone(), key.clone()));
        }
        c.login_over_http = self.login_over_http;
        for h in &self.webhook_allow_host {
            let a = runtime_server::AllowHost::parse(h)
                .with_context(|| format!("--webhook-allow-host {h}: expected HOST[:PORT]"))?;
            c.webhook_allow.push(a);
        }
        c.webhook_second_ms = i64::from(self.webhook_test_second_ms.max(1));
        for m in &self.registry_mirror {
            let (reg, mirror) = m
                .split_once('=')
                .filter(|(r, m)| !r.is_empty() && !m.is_empty() && !m.contains('/'))
                .with_context(|| format!("--registry-mirror {m}: expected REGISTRY=HOST[:PORT]"))?;
            c.registry_mirrors
                .push((reg.to_ascii_lowercase(), mirror.to_ascii_lowercase()));
        }
        for h in &self.registry_insecure {
            anyhow::ensure!(
                !h.is_empty() && !h.contains('/'),
                "--registry-insecure {h}: expected HOST[:PORT]"
            );
            c.registry_insecure.push(h.to_ascii_lowercase());
        }
        for path in &self.guest_ca {
            c.guest_cas.push_str(&guest_ca(path)?);
        }
        c.test_crash_at = self.test_crash_at.clone();
        if let Some(p) = &self.test_crash_at {
            eprintln!("runtime: WARNING: test-only crash point {p} is set (--test-crash-at)");
        }
        Ok(())
    }

    /// The egress proxy's settings: the default ones, with the test-only
    /// host map and roots when given.
    fn egress(&self) -> anyhow::Result<runtime_egress::EgressConfig> {
        let mut e = runtime_egress::EgressConfig {
            max_connections: self.egress_max_connections,
            ..runtime_egress::EgressConfig::default()
        };
        anyhow::ensure!(
            e.max_connections > 0,
            "--egress-max-connections must be at least 1"
        );
        e.deny_self = self
            .egress_deny_self
            .iter()
            .map(|ip| ip.to_canonical())
            .collect();
        for m in &self.egress_test_map {
            let (name, addr) = m
                .split_once('=')
                .with_context(|| format!("--egress-test-map {m}: expected NAME=IP:PORT"))?;
            let addr: SocketAddr = addr
                .parse()
                .with_context(|| format!("--egress-test-map {m}: {addr} is not IP:PORT"))?;
            e.test_hosts.push((name.to_ascii_lowercase(), addr));
        }
        for path in &self.egress_test_root {
            let pem = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let ders = pem_certificates(&pem);
            anyhow::ensure!(!ders.is_empty(), "{} holds no certificate", path.display());
            e.extra_roots.extend(ders.into_iter().map(Into::into));
        }
        if !e.test_hosts.is_empty() || !e.extra_roots.is_empty() {
            eprintln!("runtime: WARNING: test-only egress settings are on (--egress-test-*)");
        }
        Ok(e)
    }
}

/// The certificates of a `--guest-ca` file, each checked to be one a
/// TLS client can trust, as PEM again (nothing else of the file reaches a
/// guest).
fn guest_ca(path: &std::path::Path) -> anyhow::Result<String> {
    use base64::Engine;
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("--guest-ca: reading {}", path.display()))?;
    let ders = pem_certificates(&pem);
    anyhow::ensure!(
        !ders.is_empty(),
        "--guest-ca {}: holds no PEM certificate",
        path.display()
    );
    let mut out = String::new();
    for (i, der) in ders.into_iter().enumerate() {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der.clone().into()).map_err(|e| {
            anyhow::anyhow!(
                "--guest-ca {}: certificate {} is not usable: {e}",
                path.display(),
                i + 1
            )
        })?;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&der);
        out.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            out.push_str(std::str::from_utf8(line).unwrap_or_default());
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
    }
    Ok(out)
}

/// The DER of each `CERTIFICATE` block of a PEM text.
fn pem_certificates(pem: &str) -> Vec<Vec<u8>> {
    use base64::Engine;
    let mut out = Vec::new();
    let mut body: Option<String> = None;
    for line in pem.lines().map(str::trim) {
        match line {
            "-----BEGIN CERTIFICATE-----" => body = Some(String::new()),
            "-----END CERTIFICATE-----" => {
                if let Some(b) = body.take() {
                    if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(b) {
                        out.push(der);
                    }
                }
            }
            l => {
                if let Some(b) = body.as_mut() {
                    b.push_str(l);
                }
            }
        }
    }
    out
}

/// Prices in microdollars (docs/billing.md); the defaults are Runtime Cloud's.
#[derive(clap::Args)]
struct PriceArgs {
    /// Per vCPU-hour of measured CPU use (at least the sandbox's floor).
    #[arg(long, default_value_t = 25_000)]
    price_cpu_vcpu_hour: u64,
    /// Per GiB-hour of memory while running.
    #[arg(long, default_value_t = 7_500)]
    price_memory_gib_hour: u64,
    /// Per GiB-hour of a paused sandbox's saved memory.
    #[arg(long, default_value_t = 119)]
    price_paused_gib_hour: u64,
    /// Per GiB-hour of a persistent sandbox's disk.
    #[arg(long, default_value_t = 153)]
    price_kept_disk_gib_hour: u64,
    /// Per GiB a key's sandboxes send out in a month past the allowance
    /// (0: outbound traffic is free).
    #[arg(long, default_value_t = 0)]
    price_outbound_gib: u64,
    /// Bytes each key's sandboxes send out free each calendar month (UTC).
    #[arg(long, default_value_t = 0)]
    outbound_allowance_bytes: u64,
}

/// What each key may hold, and what the host keeps free (docs/security.md).
#[derive(clap::Args)]
struct LimitArgs {
    /// A quota of every key, NAME=VALUE (`sandbox.count=20`,
    /// `sandbox.memory_mib=65536`, ...; `GET /v1/limits` lists them with
    /// their defaults). Repeatable.
    #[arg(long = "quota", value_name = "NAME=VALUE")]
    quota: Vec<String>,
    /// Running sandboxes' memory may add up to this times the host's.
    #[arg(long, default_value_t = 4.0)]
    memory_overcommit: f64,
    /// Memory (MiB) a start must leave available on the host.
    #[arg(long, default_value_t = 512)]
    reserve_memory_mib: u64,
    /// Disk (MiB) a start must leave free in the data directory.
    #[arg(long, default_value_t = 2048)]
    reserve_disk_mib: u64,
    /// Warm machines kept running per image and shape that a create has
    /// used, restored from the shape's template ahead of time so a create
    /// only gives one its identity (0: none; docs/memory.md).
    #[arg(long, value_name = "N", default_value_t = runtime_server::DEFAULT_WARM_POOL)]
    warm_pool: u32,
    /// Host memory (MiB) all warm machines together may hold; they are
    /// also ended whenever the host is short of memory.
    #[arg(long, value_name = "MIB", default_value_t = runtime_server::DEFAULT_WARM_POOL_MEMORY_MIB)]
    warm_pool_memory_mib: u64,
    /// With several nodes on one store: a node not seen for this many
    /// seconds is held lost and its running sandboxes recorded stopped
    /// (`stopReason: host_lost`); at least 15 (nodes beat every 5 s).
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    host_lost_after: u64,
}

impl LimitArgs {
    fn apply(&self, c: &mut runtime_server::Config) -> anyhow::Result<()> {
        for q in &self.quota {
            c.quotas
                .set(q)
                .map_err(|e| anyhow::anyhow!("--quota {q}: {e}"))?;
        }
        if !(self.memory_overcommit.is_finite() && self.memory_overcommit > 0.0) {
            anyhow::bail!("--memory-overcommit takes a positive number");
        }
        if self.host_lost_after < 15 {
            anyhow::bail!(
                "--host-lost-after {}: give at least 15 seconds (nodes say they are alive every 5 s)",
                self.host_lost_after
            );
        }
        c.host_lost_after = std::time::Duration::from_secs(self.host_lost_after);
        c.warm_pool = self.warm_pool;
        c.warm_pool_memory_mib = self.warm_pool_memory_mib;
        c.reserve = runtime_server::Reserve {
            memory_mib: self.reserve_memory_mib,
            disk_mib: self.reserve_disk_mib,
            memory_overcommit: self.memory_overcommit,
        };
        Ok(())
    }
}

#[derive(Subcommand)]
enum KeysCmd {
    /// Create a key and print it alone on stdout.
    Create {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store` (default: the data
        /// directory's SQLite file).
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        #[arg(long)]
        read_only: bool,
        #[arg(long)]
        account_wide: bool,
        #[arg(long)]
        name: Option<String>,
        /// The most the key may commit in any 24 hours, in microdollars.
        #[arg(long)]
        daily_limit_micros: Option<u64>,
        /// A quota of this key alone, NAME=VALUE in place of the server's
        /// `--quota` (repeatable; `runtime keys quota` changes them later).
        #[arg(long = "quota", value_name = "NAME=VALUE")]
        quota: Vec<String>,
    },
    /// List the keys (never the keys themselves: only hashes are kept).
    List {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store` (default: the data
        /// directory's SQLite file).
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id or name; its next request answers 401.
    Revoke {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store` (default: the data
        /// directory's SQLite file).
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// The key itself (rtcloud_...), its id or its name.
        key: String,
    },
    /// Set or remove a key's daily spending limit.
    Limit {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store` (default: the data
        /// directory's SQLite file).
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// The key itself (rtcloud_...), its id or its name.
        key: String,
        /// The most the key may commit in any 24 hours, in microdollars.
        #[arg(long, conflicts_with = "none", required_unless_present = "none")]
        daily_limit_micros: Option<u64>,
        /// Remove the limit.
        #[arg(long)]
        none: bool,
    },
    /// Show or set a key's own quotas, which replace the server's for it
    /// alone (higher or lower); NAME=default gives it the server's back.
    Quota {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store` (default: the data
        /// directory's SQLite file).
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// The key itself (rtcloud_...), its id or its name.
        key: String,
        /// NAME=VALUE (`sandbox.count=20`) or NAME=default.
        #[arg(value_name = "NAME=VALUE")]
        settings: Vec<String>,
    },
}

#[derive(Subcommand)]
enum HostCmd {
    /// Every node: its URL, when it was last seen, the memory it can still
    /// take, whether it is drained or held lost, its sandboxes.
    List {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store`.
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// No new sandboxes go to NODE: creates that reach it run on the
    /// others; its sandboxes keep running (their forks and snapshots stay
    /// there too) until they end or it is stopped.
    Drain {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store`.
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        /// The node's id (`node.id` in its data directory; `runtime host list`).
        node: String,
    },
    /// (bench) Places CREATES sandboxes on HOSTS simulated hosts with the
    /// server's own ranking and prints what it measured as JSON; with
    /// --store, also times the read of that many nodes' rows there.
    #[command(hide = true)]
    Simulate {
        #[arg(long, default_value_t = 1000)]
        hosts: usize,
        #[arg(long, default_value_t = 100_000)]
        creates: usize,
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
    },
    /// Takes a drained NODE back: it gets new sandboxes again.
    Resume {
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// The store, as `runtime serve --store`.
        #[arg(long, env = "RUNTIME_STORE", hide_env_values = true)]
        store: Option<String>,
        node: String,
    },
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Without --file: build (or verify) the default kernel and image in the
    /// cache directory. With --file: build a custom image from a TOML recipe
    /// on a running server, through its API.
    Build(ImageBuild),
    #[command(flatten)]
    Remote(image::RemoteCmd),
}

#[derive(clap::Args)]
struct ImageBuild {
    /// A folder with a Dockerfile: built on the server with the folder as
    /// its context (what its .dockerignore leaves in).
    #[arg(value_name = "DIR", conflicts_with_all = ["file", "from"])]
    dir: Option<PathBuf>,
    /// A registry image (python:3.12-slim, ghcr.io/acme/app:1.4) built as it is.
    #[arg(long, value_name = "REF", conflicts_with = "file")]
    from: Option<String>,
    /// A TOML recipe (base, apt, pip, npm, commands, env, files, workdir,
    /// and the image's name, tags, start; see docs/images.md).
    #[arg(long, short = 'f', value_name = "TOML")]
    file: Option<PathBuf>,
    /// The image's name (wins over the file's).
    #[arg(long)]
    name: Option<String>,
    /// With DIR or --from: NAME[:TAG] (repeatable, one name). With --file: a
    /// tag for the new version (repeatable; wins over the file's tags).
    #[arg(long = "tag", short = 't', value_name = "TAG")]
    tags: Vec<String>,
    /// The Dockerfile, when it is not DIR/Dockerfile.
    #[arg(long, value_name = "PATH", requires = "dir")]
    dockerfile: Option<PathBuf>,
    /// A build argument NAME=VALUE (repeatable).
    #[arg(long = "build-arg", value_name = "NAME=VALUE", requires = "dir")]
    build_args: Vec<String>,
    /// The stage to build, when not the last.
    #[arg(long, requires = "dir")]
    target: Option<String>,
    /// The build machine's disk, and so the image's file system, in MiB.
    #[arg(long)]
    disk_mib: Option<u32>,
    /// What the image's file system may hold, in MiB.
    #[arg(long)]
    max_image_mib: Option<u32>,
    /// The whole build's time limit, in seconds.
    #[arg(long, value_name = "SECONDS")]
    timeout: Option<u32>,
    /// The server's origin.
    #[arg(long, env = "RUNTIME_API_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// An API key; without it, the key `runtime login` saved for the server.
    #[arg(long, env = "RUNTIME_API_KEY", hide_env_values = true)]
    key: Option<String>,
}

/// The `POST /v1/images` body of `image build DIR` or `--from REF` (a
/// folder's context is uploaded first).
fn image_build_body(b: &ImageBuild) -> anyhow::Result<serde_json::Value> {
    use serde_json::json;
    let (name, tags) = image::name_and_tags(b.name.as_deref(), &b.tags)?;
    let mut body = json!({ "name": name });
    if !tags.is_empty() {
        body["tags"] = json!(tags);
    }
    let mut limits = serde_json::Map::new();
    for (k, v) in [
        ("diskMiB", b.disk_mib),
        ("maxImageMiB", b.max_image_mib),
        ("timeoutSeconds", b.timeout),
    ] {
        if let Some(v) = v {
            limits.insert(k.into(), json!(v));
        }
    }
    if !limits.is_empty() {
        body["build"] = serde_json::Value::Object(limits);
    }
    if let Some(r) = &b.from {
        body["image"] = json!(r);
        return Ok(body);
    }
    let dir = b.dir.as_deref().context("a folder or --from")?;
    let dockerfile = b
        .dockerfile
        .clone()
        .unwrap_or_else(|| dir.join("Dockerfile"));
    let text = std::fs::read_to_string(&dockerfile)
        .with_context(|| format!("reading {}", dockerfile.display()))?;
    let mut args = serde_json::Map::new();
    for a in &b.build_args {
        let (k, v) = a
            .split_once('=')
            .with_context(|| format!("--build-arg {a}: give NAME=VALUE"))?;
        args.insert(k.into(), json!(v));
    }
    let target = image::Target::new(&b.url, b.key.clone())?;
    let packed = image::pack_context(dir, &dockerfile)?;
    body["dockerfile"] = json!(text);
    body["context"] = image::upload_context(&target, &packed)?;
    if let Some(d) = &packed.dockerignore {
        body["dockerignore"] = json!(d);
    }
    if !args.is_empty() {
        body["buildArgs"] = serde_json::Value::Object(args);
    }
    if let Some(t) = &b.target {
        body["target"] = json!(t);
    }
    Ok(body)
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Root's VMs run as other uids that must reach the data and cache
/// directories, so root gets system directories instead of its private home.
fn data_dir(arg: Option<PathBuf>) -> PathBuf {
    arg.unwrap_or_else(|| {
        if is_root() {
            return PathBuf::from("/var/lib/runtime");
        }
        std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home().join(".local/share"))
            .join("runtime")
    })
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("RUNTIME_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if is_root() {
        return PathBuf::from("/var/cache/runtime");
    }
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache"))
        .join("runtime")
}

/// The static guest agent: `RUNTIME_AGENT_BIN`, or where the README's build
/// puts it beside this binary.
fn agent_bin() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("RUNTIME_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating this binary")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let profile = dir
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or("release");
    let candidates = [
        dir.join("../x86_64-unknown-linux-gnu")
            .join(profile)
            .join("runtime-agent"),
        dir.join("runtime-agent-static"),
    ];
    for c in &candidates {
        if c.exists() {
            return Ok(c.clone());
        }
    }
    bail!(
        "the static guest agent was not found (looked at {}); build it with scripts/build.sh or set RUNTIME_AGENT_BIN",
        candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// The agent runs from an initramfs with no libraries: it must be static.
fn check_static(path: &Path) -> anyhow::Result<()> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if data.len() < 64 || &data[..4] != b"\x7fELF" {
        bail!("{} is not an ELF binary", path.display());
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[32..40].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        if o + 4 > data.len() {
            break;
        }
        if u32::from_le_bytes(data[o..o + 4].try_into()?) == 3 {
            bail!(
                "{} is dynamically linked; the guest agent must be static (see scripts/build.sh)",
                path.display()
            );
        }
    }
    Ok(())
}

fn build_artifacts() -> anyhow::Result<artifacts::Artifacts> {
    let agent = agent_bin()?;
    check_static(&agent)?;
    Ok(artifacts::ensure(&cache_dir(), &agent)?)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
}

/// Raises the open-file limit to its hard limit: every connection, tunnel,
/// machine and disk holds descriptors, and the default soft limit (often
/// 1024) would run out under load long before memory does.
fn raise_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            let wanted = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                eprintln!(
                    "runtime: could not raise the open-file limit from {}",
                    lim.rlim_cur
                );
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    listen: SocketAddr,
    data_dir: PathBuf,
    (store, node_url): (Option<String>, Option<String>),
    boot_timeout: u64,
    (templates, share_template_memory): (bool, bool),
    prices: runtime_server::Prices,
    net: NetArgs,
    limits: LimitArgs,
) -> anyhow::Result<()> {
    raise_open_files();
    // Settings first: a wrong one is said before minutes of building.
    let mut config = runtime_server::Config::new(data_dir.clone());
    let at = runtime_server::StoreAt::parse(store.as_deref(), &data_dir)
        .map_err(|e| anyhow::anyhow!(e))?;
    if let runtime_server::StoreAt::Postgres(url) = &at {
        // A store that does not answer is said now, not after the build.
        runtime_server::open_store(&at)?;
        eprintln!(
            "runtime: store PostgreSQL at {}",
            runtime_server::redact_store_url(url)
        );
    }
    config.store = Some(at.clone());
    if let Some(u) = node_url {
        if !u.starts_with("http://") {
            anyhow::bail!("--node-url {u}: give an http:// URL (control planes carry requests to each other over plain HTTP for now)");
        }
        config.node_url = Some(u);
    }
    net.apply(&mut config)?;
    limits.apply(&mut config)?;
    if !templates {
        // Warm machines are template restores: without templates, none.
        config.warm_pool = 0;
    }
    config.prices = prices;
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        // Others may pass through (QEMU's own uids reach their files) but
        // neither list nor change what is in it.
        let mode = std::fs::metadata(&data_dir)?.permissions().mode() & 0o7777;
        std::fs::set_permissions(&data_dir, std::fs::Permissions::from_mode(mode & !0o066))
            .with_context(|| format!("making {} private", data_dir.display()))?;
        // Snapshots and kept disks are copied into a machine's own directory
        // before it starts: no QEMU uid needs to reach them.
        for private in ["snapshots", "disks"] {
            let dir = data_dir.join(private);
            std::fs::create_dir_all(&dir)
                .and_then(|()| {
                    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                })
                .with_context(|| format!("making {} private", dir.display()))?;
        }
    }
    let arts = tokio::task::spawn_blocking(build_artifacts).await??;
    // Measured once, before any machine boots (their command line names it).
    let tsc = tokio::task::spawn_blocking(runtime_host::host_tsc_khz).await?;
    let (mut accel, mut why) = choose_accel();
    let mut qemu_cfg = QemuConfig {
        state_dir: data_dir.join("vms"),
        images_dir: data_dir.join("images"),
        qemu_binary: PathBuf::from("qemu-system-x86_64"),
        artifacts: arts,
        accel,
        boot_timeout: Duration::from_secs(boot_timeout),
        templates,
        share_template_memory,
        egress: net.egress()?,
        test_crash_at: net.test_crash_at.clone(),
    };
    if accel == Accel::Kvm {
        match probe_boot(qemu_cfg.clone()).await {
            Ok(t) => why = format!("{why}; probe boot answered in {} ms", t.as_millis()),
            Err(e) => {
                accel = Accel::Tcg;
                why = format!("a probe boot under KVM failed ({e}); using TCG");
            }
        }
        qemu_cfg.accel = accel;
    }
    eprintln!("runtime: accelerator {accel} ({why})");
    match tsc {
        Some(khz) => eprintln!("runtime: guests' TSC at the host's {khz} kHz"),
        None => {
            eprintln!("runtime: the host's TSC frequency is unknown; guests calibrate their own")
        }
    }
    let host = QemuHost::new(qemu_cfg).context("preparing the VM directory")?;
    runtime_server::check_secrets_key(&data_dir, &at)?;
    if let Some(key) = runtime_server::ensure_admin_key_in(&data_dir, &at)? {
        eprintln!(
            "runtime: created the admin key (saved to {}):",
            data_dir.join("admin.key").display()
        );
        println!("{key}");
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let scheme = if config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let ram_dir = host.ram_dir().to_owned();
    let server = runtime_server::run(listener, config, Arc::new(host), shutdown_signal());
    println!(
        "runtime: listening on {scheme}://{addr} (data dir {})",
        data_dir.display()
    );
    server.await?;
    // Machines outlive the server (and keep their RAM files); with none
    // left, the directory of RAM files goes too.
    let _ = std::fs::remove_dir(&ram_dir);
    Ok(())
}

/// The store of `runtime keys`: `--store`, or the data directory's.
fn store_at(d: Option<PathBuf>, store: Option<String>) -> anyhow::Result<runtime_server::StoreAt> {
    runtime_server::StoreAt::parse(store.as_deref(), &data_dir(d)).map_err(|e| anyhow::anyhow!(e))
}

fn micros(m: u64) -> anyhow::Result<i64> {
    i64::try_from(m).context("the limit is too large")
}

fn hosts(cmd: HostCmd) -> anyhow::Result<()> {
    let (at, node, drain) = match cmd {
        HostCmd::List {
            data_dir,
            store,
            json,
        } => return list_hosts(&store_at(data_dir, store)?, json),
        HostCmd::Simulate {
            hosts,
            creates,
            store,
        } => {
            let at = match store {
                Some(s) => Some(
                    runtime_server::StoreAt::parse(Some(&s), &data_dir(None))
                        .map_err(|e| anyhow::anyhow!(e))?,
                ),
                None => None,
            };
            let report = runtime_server::simulate_placement(hosts, creates, at.as_ref())?;
            println!("{}", serde_json::to_string(&report)?);
            return Ok(());
        }
        HostCmd::Drain {
            data_dir,
            store,
            node,
        } => (store_at(data_dir, store)?, node, true),
        HostCmd::Resume {
            data_dir,
            store,
            node,
        } => (store_at(data_dir, store)?, node, false),
    };
    let store = runtime_server::Store::open_at(&at)?;
    if !store.set_draining(&node, drain)? {
        let known: Vec<String> = store.nodes()?.into_iter().map(|n| n.id).collect();
        anyhow::bail!(
            "no node {node} in the store (its nodes: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        );
    }
    println!(
        "node {node} {}",
        if drain {
            "drained: new sandboxes go to the other nodes"
        } else {
            "takes new sandboxes again"
        }
    );
    Ok(())
}

fn list_hosts(at: &runtime_server::StoreAt, json: bool) -> anyhow::Result<()> {
    let store = runtime_server::Store::open_at(at)?;
    let counts: std::collections::HashMap<String, i64> =
        store.sandboxes_per_node()?.into_iter().collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    if !json {
        println!(
            "{:<36}  {:<28}  {:>10}  {:>10}  {:<8}  {:>9}",
            "NODE", "URL", "SEEN S AGO", "FREE MIB", "STATE", "SANDBOXES"
        );
    }
    for n in store.nodes()? {
        let state = if n.lost_ms != 0 {
            "lost"
        } else if n.draining {
            "drained"
        } else {
            "ready"
        };
        let sandboxes = counts.get(&n.id).copied().unwrap_or(0);
        let ago = (now - n.seen_ms).max(0) / 1000;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "node": n.id, "url": n.url, "seenMsAgo": (now - n.seen_ms).max(0),
                    "freeMiB": (n.free_mib >= 0).then_some(n.free_mib), "state": state,
                    "sandboxes": sandboxes,
                })
            );
        } else {
            let free = if n.free_mib >= 0 {
                n.free_mib.to_string()
            } else {
                "-".to_string()
            };
            println!(
                "{:<36}  {:<28}  {:>10}  {:>10}  {:<8}  {:>9}",
                n.id, n.url, ago, free, state, sandboxes
            );
        }
    }
    Ok(())
}

fn keys(cmd: KeysCmd) -> anyhow::Result<()> {
    use runtime_server::keys;
    match cmd {
        KeysCmd::Create {
            data_dir: d,
            store,
            read_only,
            account_wide,
            name,
            daily_limit_micros,
            quota,
        } => {
            let dir = store_at(d, store)?;
            // Checked before the key is made: a wrong one makes none.
            keys::KeyQuotas::default()
                .apply(&quota)
                .map_err(|e| anyhow::anyhow!("--quota: {e}"))?;
            let key = runtime_server::create_key(&dir, name.as_deref(), read_only, account_wide)?;
            let id = keys::key_id_of(&key).context("the new key has no id")?;
            if let Some(m) = daily_limit_micros {
                keys::set_daily_limit(&dir, id, Some(micros(m)?))?;
            }
            if !quota.is_empty() {
                keys::set_quotas(&dir, id, &quota)?;
            }
            println!("{key}");
        }
        KeysCmd::List {
            data_dir: d,
            store,
            json,
        } => {
            let all = keys::list_keys(&store_at(d, store)?)?;
            if !json {
                println!(
                    "{:<36}  {:<24}  {:<6}  {:<8}  {:>14}  {:<24}  {:<24}  QUOTAS",
                    "ID", "NAME", "ACCESS", "SCOPE", "DAILY LIMIT µ$", "CREATED", "REVOKED"
                );
            }
            for k in all {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "id": k.id,
                            "name": k.name,
                            "access": if k.read_only { "read" } else { "full" },
                            "accountWide": k.account_wide,
                            "dailyLimitMicros": k.daily_limit_micros,
                            "quotas": k.quotas,
                            "createdAt": k.created_at,
                            "revokedAt": k.revoked_at,
                        })
                    );
                } else {
                    println!(
                        "{:<36}  {:<24}  {:<6}  {:<8}  {:>14}  {:<24}  {:<24}  {}",
                        k.id,
                        k.name.as_deref().unwrap_or("-"),
                        if k.read_only { "read" } else { "full" },
                        if k.account_wide { "account" } else { "own" },
                        k.daily_limit_micros
                            .map_or_else(|| "-".to_string(), |m| m.to_string()),
                        k.created_at,
                        k.revoked_at.as_deref().unwrap_or("-"),
                        quota_text(&k.quotas),
                    );
                }
            }
        }
        KeysCmd::Revoke {
            data_dir: d,
            store,
            key,
        } => {
            let k = keys::revoke_key(&store_at(d, store)?, &key)?;
            eprintln!(
                "runtime: key {} ({}) revoked at {}",
                k.id,
                k.name.as_deref().unwrap_or("no name"),
                k.revoked_at.as_deref().unwrap_or("?")
            );
        }
        KeysCmd::Limit {
            data_dir: d,
            store,
            key,
            daily_limit_micros,
            none: _,
        } => {
            let limit = daily_limit_micros.map(micros).transpose()?;
            let k = keys::set_daily_limit(&store_at(d, store)?, &key, limit)?;
            match k.daily_limit_micros {
                Some(m) => eprintln!("runtime: key {} may commit {m} µ$ in any 24 hours", k.id),
                None => eprintln!("runtime: key {} has no daily limit", k.id),
            }
        }
        KeysCmd::Quota {
            data_dir: d,
            store,
            key,
            settings,
        } => {
            let dir = store_at(d, store)?;
            let k = if settings.is_empty() {
                keys::find_key(&dir, &key)?
            } else {
                keys::set_quotas(&dir, &key, &settings)?
            };
            println!("{}", quota_text(&k.quotas));
            eprintln!(
                "runtime: key {}'s other quotas are the server's (`runtime serve --quota`)",
                k.id
            );
        }
    }
    Ok(())
}

/// A key's own quotas as `name=value` words (`-`: none, the server's).
fn quota_text(q: &runtime_server::keys::KeyQuotas) -> String {
    if q.is_empty() {
        return "-".into();
    }
    q.iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUNTIME_LOG")
        .unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        // Each line: time, level, message and fields, and the spans it is
        // in (the request's `request_id`, method and path; a sandbox's id).
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    match cli.cmd {
        Cmd::NinePServe {
            uid,
            max_bytes,
            dir,
        } => {
            runtime_host::share::serve(&dir, uid, max_bytes)?;
            Ok(())
        }
        Cmd::Serve {
            listen,
            data_dir: d,
            store,
            node_url,
            boot_timeout,
            no_templates,
            share_template_memory,
            net,
            prices,
            limits,
        } => {
            let prices = runtime_server::Prices {
                cpu_vcpu_hour: prices.price_cpu_vcpu_hour,
                memory_gib_hour: prices.price_memory_gib_hour,
                paused_gib_hour: prices.price_paused_gib_hour,
                kept_disk_gib_hour: prices.price_kept_disk_gib_hour,
                outbound_gib: prices.price_outbound_gib,
                outbound_allowance_bytes: prices.outbound_allowance_bytes,
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(serve(
                listen,
                data_dir(d),
                (store, node_url),
                boot_timeout,
                (!no_templates, share_template_memory),
                prices,
                net,
                limits,
            ))
        }
        Cmd::Login {
            url,
            computer,
            no_browser,
        } => login::run(&url, computer, !no_browser),
        Cmd::Mcp { url, key } => mcp::run(mcp::target(url, key)?),
        Cmd::Keys { cmd } => keys(cmd),
        Cmd::Host { cmd } => hosts(cmd),
        Cmd::Sandbox(args) => client::exit_with(sandbox::run(args)),
        Cmd::Image {
            cmd: ImageCmd::Remote(cmd),
        } => client::exit_with(image::remote(cmd)),
        Cmd::Image {
            cmd: ImageCmd::Build(b),
        } if b.dir.is_some() || b.from.is_some() => {
            let body = image_build_body(&b)?;
            image::build(&image::Target::new(&b.url, b.key.clone())?, &body)?;
            Ok(())
        }
        Cmd::Image {
            cmd:
                ImageCmd::Build(ImageBuild {
                    file: Some(file),
                    name,
                    tags,
                    url,
                    key,
                    ..
                }),
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let body = image::body_from_toml(&text, name.as_deref(), &tags)
                .with_context(|| format!("{}", file.display()))?;
            image::build(&image::Target::new(&url, key)?, &body)?;
            Ok(())
        }
        Cmd::Image {
            cmd: ImageCmd::Build(_),
        } => {
            let arts = build_artifacts()?;
            println!(
                "kernel {}\nimage {}\nagent {}",
                arts.kernel.display(),
                arts.base.display(),
                arts.initrd.display()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn a_guest_ca_file_gives_its_certificates_as_pem_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("guest-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (
            runtime_egress::SandboxCa::generate().unwrap(),
            runtime_egress::SandboxCa::generate().unwrap(),
        );
        let text = format!(
            "# a comment\n{}{}-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            a.cert_pem(),
            b.cert_pem()
        );
        let got = guest_ca(&file(&dir, "two.pem", &text)).unwrap();
        let ders = pem_certificates(&got);
        assert_eq!(
            ders,
            vec![a.cert_der().to_vec(), b.cert_der().to_vec()],
            "{got}"
        );
        assert!(
            !got.contains("PRIVATE KEY") && !got.contains("comment"),
            "{got}"
        );

        let none = guest_ca(&file(&dir, "none.pem", "not a certificate\n")).unwrap_err();
        assert!(
            none.to_string().contains("holds no PEM certificate"),
            "{none}"
        );
        let junk = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let bad = guest_ca(&file(&dir, "junk.pem", junk)).unwrap_err();
        assert!(
            bad.to_string().contains("certificate 1 is not usable"),
            "{bad}"
        );
        let missing = guest_ca(&dir.join("missing.pem")).unwrap_err();
        assert!(missing.to_string().contains("reading"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
