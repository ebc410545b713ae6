//! The host's egress proxy. Each connection a guest process makes arrives as
//! a byte stream that starts with SOCKS5 or an HTTP/1.1 proxy request
//! (`CONNECT`, or an absolute-form `GET http://…`); [`Egress::serve`] decides
//! it against the sandbox's [`Policy`], reconnects to the destination itself
//! and closes it the moment the policy stops allowing it. For the hosts a
//! [`Secret`] names it terminates TLS with the sandbox's own [`SandboxCa`],
//! puts the secret's value in the URL and headers, and forwards over TLS that
//! verifies the destination.
//!
//! Pure host-side: it depends on no other workspace crate and knows nothing of
//! VMs, the store or the API server, which hands it streams and watch
//! channels.

mod api;
mod ca;
mod dns;
mod error;
mod io;
mod limits;
mod proxy;
mod rules;
mod scrub;
mod secrets;
mod tls;
mod udp;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

pub use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

pub use api::{ApiSlot, InternalApi, API_HOST, API_PORT};
pub use ca::SandboxCa;
pub use error::EgressError;
pub use limits::Traffic;
pub use rules::{
    is_forbidden_port, is_internal, Issue, Policy, Refusal, Rules, FORBIDDEN_PORTS, MAX_ENTRIES,
    WEB_PORTS,
};
pub use secrets::{make_placeholder, Secret, SecretRule, SecretValue, PLACEHOLDER_PREFIX};

/// How the proxy runs. `Default` is what production uses.
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// TEST ONLY. A target matching a name or `*.domain` here (or an address
    /// written exactly) goes to this local socket address instead of being
    /// resolved, and that address is exempt from the internal ranges. Empty
    /// in production.
    pub test_hosts: Vec<(String, SocketAddr)>,
    /// TEST ONLY. Roots trusted for destinations besides the system's.
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// A guest has this long to finish a SOCKS or HTTP request head, a TLS
    /// ClientHello or a TLS handshake.
    pub handshake_timeout: Duration,
    /// Resolving a name, and connecting to one address, each take at most this.
    pub connect_timeout: Duration,
    /// Most bytes of one HTTP request or response head.
    pub max_head_bytes: usize,
    /// A tunnel (CONNECT, SOCKS, a WebSocket) with no byte either way for
    /// this long is closed. Before its first byte the bound is
    /// `handshake_timeout`.
    pub tunnel_idle_timeout: Duration,
    /// Most upstream connections open at once, every sandbox together.
    pub max_connections: usize,
    /// Most upstream connections one sandbox may have open at once.
    pub max_connections_per_sandbox: usize,
    /// Most DNS lookups one sandbox may have in flight; more wait for a
    /// slot within `connect_timeout`.
    pub max_lookups_per_sandbox: usize,
    /// Addresses that reach this host from outside though no interface
    /// carries them (a public address NATed to it, a load balancer in
    /// front of it): refused like its own (`--egress-deny-self`).
    pub deny_self: Vec<IpAddr>,
    /// Serves `http://runtime.internal` (the server's own API) once the
    /// server has put its handler in; empty, that name is unreachable.
    pub api: ApiSlot,
    /// Most connections to `runtime.internal` one sandbox may have open at
    /// once (each carries one request at a time); beyond it `429` with
    /// `X-Runtime-Egress: api-busy`.
    pub max_api_per_sandbox: usize,
}

impl Default for EgressConfig {
    fn default() -> Self {
        Self {
            test_hosts: Vec::new(),
            extra_roots: Vec::new(),
            handshake_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_head_bytes: 64 * 1024,
            tunnel_idle_timeout: Duration::from_secs(10 * 60),
            max_connections: 4096,
            max_connections_per_sandbox: 256,
            max_lookups_per_sandbox: 16,
            deny_self: Vec::new(),
            api: ApiSlot::default(),
            max_api_per_sandbox: 16,
        }
    }
}

/// One sandbox's view of the network: its rules, its secrets and its CA.
#[derive(Debug, Clone)]
pub struct SandboxNet {
    /// Named in every log line about this sandbox's connections.
    pub sandbox_id: String,
    /// The rules now. Each change is applied to open connections at once;
    /// dropping the sender closes every connection of the sandbox.
    pub policy: watch::Receiver<Arc<Policy>>,
    /// The secrets the sandbox may use. Interception is decided when a
    /// connection opens; substitution reads the newest list for each request.
    pub secrets: watch::Receiver<Arc<Vec<Secret>>>,
    /// Signs the certificates shown for intercepted hosts.
    pub ca: Arc<SandboxCa>,
}

/// The egress proxy, shared by every sandbox of a host.
#[derive(Clone)]
pub struct Egress {
    inner: Arc<proxy::Inner>,
}

impl Egress {
    pub fn new(cfg: EgressConfig) -> Self {
        let client_tls = match tls::client_config(&cfg.extra_roots) {
            Ok(c) => Some(c),
            Err(err) => {
                tracing::error!(error = %err, "no TLS client: hosts with secrets will fail");
                None
            }
        };
        let own = io::OwnAddrs::new(cfg.deny_self.clone());
        let limits = limits::Limits::new(cfg.max_connections, cfg.max_connections_per_sandbox);
        let dns = dns::Dns::system(cfg.connect_timeout, cfg.max_lookups_per_sandbox);
        let api_slots = limits::PerSandbox::new(cfg.max_api_per_sandbox);
        Self {
            inner: Arc::new(proxy::Inner {
                api_slots,
                cfg,
                client_tls,
                own,
                limits,
                dns,
            }),
        }
    }

    /// Serves one guest connection until it ends or the policy stops
    /// allowing it. Never panics on what the guest sends.
    pub async fn serve<IO>(&self, io: IO, net: SandboxNet)
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        proxy::serve(self.inner.clone(), io, net).await
    }

    /// The TLS client configuration the proxy verifies destinations with
    /// (the system's roots plus the test roots), for a client on the host
    /// that tunnels through the proxy and verifies the far end itself.
    pub fn client_tls(&self) -> Option<Arc<rustls::ClientConfig>> {
        self.inner.client_tls.clone()
    }

    /// Where `http://runtime.internal` is served: the server sets its
    /// handler here once it has one.
    pub fn api(&self) -> &ApiSlot {
        &self.inner.cfg.api
    }

    /// What the proxy carried for every sandbox since it started.
    pub fn traffic(&self) -> Traffic {
        self.inner.limits.traffic()
    }

    /// The bytes each sandbox sent to destinations (its outbound traffic;
    /// `runtime.internal` is not counted) since the last call, by sandbox
    /// id. Each byte is answered once: the server adds them to its store.
    pub fn take_outbound(&self) -> Vec<(String, u64)> {
        self.inner.limits.take_outbound()
    }
}
