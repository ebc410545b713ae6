//! The connection side: SOCKS5 and HTTP proxy requests in, decisions,
//! tunnels, forwarded requests and TLS interception for secrets.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::timeout;

use crate::dns::Dns;
use crate::io::{idle, Activity, Prefixed, Watched};
use crate::limits::{CapFull, Limits, Upstream};
use crate::rules::{name_matches, Addrs, Host, Policy, Refusal, Special};
use crate::scrub::{copy_scrubbed, scrub_headers, ScrubbedBody, Scrubber};
use crate::secrets::{substitute, Applied};
use crate::tls::{read_hello, Hello};
use crate::{EgressConfig, SandboxNet};

type Body = BoxBody<Bytes, hyper::Error>;

pub(crate) struct Inner {
    pub cfg: EgressConfig,
    pub client_tls: Option<Arc<rustls::ClientConfig>>,
    pub own: crate::io::OwnAddrs,
    pub limits: Limits,
    pub dns: Dns,
    /// Connections to `runtime.internal` open now, per sandbox.
    pub api_slots: crate::limits::PerSandbox,
}

/// A destination that passed the rules, connected.
struct Opened {
    stream: Upstream,
    target: Checked,
}

/// A UDP destination that passed the rules: a socket connected to it and
/// its slot in the caps, where its bytes are counted.
struct OpenedUdp {
    socket: tokio::net::UdpSocket,
    permit: crate::limits::ConnPermit,
    target: Checked,
}

/// What the rules admitted: the addresses to try (as the rules saw them,
/// and where to really go) and the exemptions they were judged with.
struct Admitted {
    host: Host,
    candidates: Vec<(IpAddr, SocketAddr)>,
    special: Special,
}

/// What a connection is re-checked against when the policy changes: the
/// target, the address in use (never resolved again) and a TLS name.
#[derive(Debug, Clone)]
struct Checked {
    host: Host,
    port: u16,
    /// The address the rules saw (for a test stand-in, the stand-in's).
    addr: IpAddr,
    /// Where the connection really goes.
    socket: SocketAddr,
    special: Special,
    /// `runtime.internal`: judged by name alone, served in the host.
    api: bool,
}

impl Checked {
    /// An outbound destination (not `runtime.internal`) the rules admitted.
    fn outbound(host: Host, port: u16, addr: IpAddr, socket: SocketAddr, special: Special) -> Self {
        Checked {
            host,
            port,
            addr,
            socket,
            special,
            api: false,
        }
    }

    fn check(&self, policy: &Policy, sni: Option<&Host>) -> Result<(), Refusal> {
        if self.api {
            return policy.check_api(self.port);
        }
        policy.check(
            &self.host,
            self.port,
            Addrs::Known(&[self.addr]),
            &self.special,
        )?;
        match sni {
            Some(name) if name != &self.host => {
                policy.check(name, self.port, Addrs::Known(&[self.addr]), &self.special)
            }
            _ => Ok(()),
        }
    }
}

/// Why a destination could not be opened.
enum OpenError {
    Refused(Refusal),
    BadHost,
    Resolve,
    Connect,
    Full(CapFull),
    /// The sandbox has this many connections to `runtime.internal` open.
    ApiBusy(usize),
}

impl OpenError {
    fn socks_reply(&self) -> u8 {
        match self {
            OpenError::Refused(_) => 0x02,
            OpenError::BadHost | OpenError::Resolve => 0x04,
            OpenError::Connect => 0x05,
            OpenError::Full(_) | OpenError::ApiBusy(_) => 0x01,
        }
    }

    fn response(&self, host: &str) -> Response<Body> {
        match self {
            OpenError::Refused(r) => text(StatusCode::FORBIDDEN, Some(r.code()), &r.to_string()),
            OpenError::BadHost => text(
                StatusCode::BAD_REQUEST,
                None,
                &format!("{host:?} is not a valid host"),
            ),
            OpenError::Resolve => text(
                StatusCode::BAD_GATEWAY,
                Some("resolve-failed"),
                &format!("{host} could not be resolved"),
            ),
            OpenError::Connect => text(
                StatusCode::BAD_GATEWAY,
                Some("connect-failed"),
                &format!("{host} could not be reached"),
            ),
            OpenError::Full(full) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                Some("too-many-connections"),
                &full.to_string(),
            ),
            OpenError::ApiBusy(n) => text(
                StatusCode::TOO_MANY_REQUESTS,
                Some("api-busy"),
                &format!(
                    "this sandbox has {n} requests to {} open, the most a sandbox may; wait for one to end",
                    crate::API_HOST
                ),
            ),
        }
    }
}

fn text(status: StatusCode, code: Option<&str>, msg: &str) -> Response<Body> {
    let mut r = Response::new(full(format!("{msg}\n")));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Some(code) = code.and_then(|c| HeaderValue::from_str(c).ok()) {
        r.headers_mut().insert("x-runtime-egress", code);
    }
    r
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

pub(crate) async fn serve<IO>(inner: Arc<Inner>, mut io: IO, net: SandboxNet)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut first = [0u8; 1];
    match timeout(inner.cfg.handshake_timeout, io.read(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return,
    }
    if first[0] == 0x05 {
        socks(inner, io, net).await
    } else {
        http_proxy(inner, Prefixed::new(first.to_vec(), io), net).await
    }
}

impl Inner {
    /// Checks, resolves, checks every address, connects to one that passed.
    async fn open(&self, net: &SandboxNet, host: Host, port: u16) -> Result<Opened, OpenError> {
        let id = net.sandbox_id.as_str();
        if host.name() == Some(crate::API_HOST) && host.is_valid() && port != 0 {
            return self.open_api(net, host, port);
        }
        let Admitted {
            host,
            candidates,
            special,
        } = self.admit(net, host, port).await?;
        // The slot is taken before connecting: a guest cannot hold more
        // sockets than its cap even while they are still connecting.
        let mut permit = Some(self.limits.connection(id).map_err(OpenError::Full)?);
        // A few addresses at most: a name with many cannot hold the guest
        // (or the host) for long.
        for (addr, socket) in candidates.into_iter().take(4) {
            match timeout(self.cfg.connect_timeout, TcpStream::connect(socket)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    let Some(permit) = permit.take() else { break };
                    let stream = Upstream::new(stream, permit);
                    tracing::debug!(sandbox_id = id, target = %host, port, addr = %addr, decision = "allowed");
                    let target = Checked::outbound(host, port, addr, socket, special);
                    return Ok(Opened { stream, target });
                }
                Ok(Err(err)) => {
                    tracing::debug!(sandbox_id = id, target = %host, port, addr = %addr, error = %err, "connect failed")
                }
                Err(_) => {
                    tracing::debug!(sandbox_id = id, target = %host, port, addr = %addr, "connect timed out")
                }
            }
        }
        Err(OpenError::Connect)
    }

    /// The rules before any resolver is asked, the resolution, then the
    /// rules again on every address it gave (on the newest policy).
    async fn admit(&self, net: &SandboxNet, host: Host, port: u16) -> Result<Admitted, OpenError> {
        let id = net.sandbox_id.as_str();
        if !host.is_valid() || port == 0 {
            tracing::debug!(sandbox_id = id, target = %host, port, decision = "refused", reason = "invalid host");
            return Err(OpenError::BadHost);
        }
        let refused = |r: Refusal| {
            tracing::debug!(sandbox_id = id, target = %host, port, decision = "refused", reason = %r);
            OpenError::Refused(r)
        };
        // Refuse what no address could admit before asking any resolver, so
        // a refused name never leaves the host as a DNS query either.
        let own = self.own.get();
        let base = Special {
            own: own.clone(),
            exempt: Vec::new(),
        };
        let pre = net.policy.borrow().clone();
        match &host {
            Host::Ip(ip) => {
                let mut special = base.clone();
                if self.test_host(&host).is_some() {
                    special.exempt.push(*ip);
                }
                pre.check(&host, port, Addrs::Known(&[*ip]), &special)
                    .map_err(refused)?
            }
            Host::Name(_) => pre
                .check(&host, port, Addrs::Unresolved, &base)
                .map_err(refused)?,
        }
        let (candidates, exempt) = self.resolve(id, &host, port).await.ok_or_else(|| {
            tracing::debug!(sandbox_id = id, target = %host, port, decision = "failed", reason = "resolve");
            OpenError::Resolve
        })?;
        let special = Special { own, exempt };
        let addrs: Vec<IpAddr> = candidates.iter().map(|(ip, _)| *ip).collect();
        // The policy may have changed while resolving: decide on the newest.
        let policy = net.policy.borrow().clone();
        policy
            .check(&host, port, Addrs::Known(&addrs), &special)
            .map_err(refused)?;
        Ok(Admitted {
            host,
            candidates,
            special,
        })
    }

    /// A UDP flow to `host:port`: the same rules as a connection, a slot of
    /// the same caps, a socket connected to the first address that passed.
    async fn open_udp(
        &self,
        net: &SandboxNet,
        host: Host,
        port: u16,
    ) -> Result<OpenedUdp, OpenError> {
        let id = net.sandbox_id.as_str();
        if host.name() == Some(crate::API_HOST) {
            return Err(OpenError::BadHost);
        }
        let Admitted {
            host,
            candidates,
            special,
        } = self.admit(net, host, port).await?;
        let permit = self.limits.connection(id).map_err(OpenError::Full)?;
        let Some((addr, socket)) = candidates.into_iter().next() else {
            return Err(OpenError::Resolve);
        };
        let local: SocketAddr = if socket.is_ipv4() {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let sock = match tokio::net::UdpSocket::bind(local).await {
            Ok(s) => s,
            Err(err) => {
                tracing::debug!(sandbox_id = id, target = %host, port, error = %err, "udp bind failed");
                return Err(OpenError::Connect);
            }
        };
        if let Err(err) = sock.connect(socket).await {
            tracing::debug!(sandbox_id = id, target = %host, port, addr = %addr, error = %err, "udp connect failed");
            return Err(OpenError::Connect);
        }
        tracing::debug!(sandbox_id = id, target = %host, port, addr = %addr, decision = "allowed", "udp");
        Ok(OpenedUdp {
            socket: sock,
            permit,
            target: Checked::outbound(host, port, addr, socket, special),
        })
    }

    /// `runtime.internal`: the rules by name, a slot of the sandbox's API
    /// cap, then a connection to the server's own API in this process. It
    /// takes no slot of the outbound caps and its bytes are not counted as
    /// outbound traffic.
    fn open_api(&self, net: &SandboxNet, host: Host, port: u16) -> Result<Opened, OpenError> {
        let id = net.sandbox_id.as_str();
        let policy = net.policy.borrow().clone();
        policy.check_api(port).map_err(|r| {
            tracing::debug!(sandbox_id = id, target = %host, port, decision = "refused", reason = %r);
            OpenError::Refused(r)
        })?;
        let Some(api) = self.cfg.api.get() else {
            return Err(OpenError::Connect);
        };
        let permit = self
            .api_slots
            .get(id)
            .try_acquire_owned()
            .map_err(|_| OpenError::ApiBusy(self.api_slots.size()))?;
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        api.serve(id, theirs);
        tracing::debug!(sandbox_id = id, target = %host, port, decision = "allowed", "served by the API");
        let unspecified = IpAddr::from([0, 0, 0, 0]);
        Ok(Opened {
            stream: Upstream::api(ours, permit),
            target: Checked {
                host,
                port,
                addr: unspecified,
                socket: SocketAddr::new(unspecified, port),
                special: Special::default(),
                api: true,
            },
        })
    }

    fn test_host(&self, host: &Host) -> Option<SocketAddr> {
        let key = host.to_string();
        self.cfg
            .test_hosts
            .iter()
            .find(|(pattern, _)| match host {
                Host::Name(n) => name_matches(pattern, n),
                Host::Ip(ip) => pattern.parse::<IpAddr>().ok() == Some(*ip) || *pattern == key,
            })
            .map(|(_, sa)| *sa)
    }

    /// The addresses to try, each as (address the rules see, socket address),
    /// and the addresses exempt from the internal ranges (test stand-ins).
    async fn resolve(
        &self,
        sandbox_id: &str,
        host: &Host,
        port: u16,
    ) -> Option<(Vec<(IpAddr, SocketAddr)>, Vec<IpAddr>)> {
        if let Some(sa) = self.test_host(host) {
            let seen = match host {
                Host::Ip(ip) => *ip,
                Host::Name(_) => sa.ip(),
            };
            return Some((vec![(seen, sa)], vec![seen]));
        }
        match host {
            Host::Ip(ip) => Some((vec![(*ip, SocketAddr::new(*ip, port))], Vec::new())),
            Host::Name(name) => {
                let found = self.dns.lookup(sandbox_id, name, port).await?;
                let out = found.into_iter().map(|sa| (sa.ip(), sa)).collect();
                Some((out, Vec::new()))
            }
        }
    }

    /// Whether a CONNECT or SOCKS target gets TLS interception.
    fn intercepts(&self, net: &SandboxNet, target: &Checked) -> bool {
        !target.api
            && target.port == 443
            && target
                .host
                .name()
                .is_some_and(|n| net.secrets.borrow().iter().any(|s| s.covers(n)))
    }
}

/// Resolves when a policy change refuses what `check` says, or the policy's
/// sender is gone (the sandbox's network is withdrawn). Returns the reason.
async fn revoked(
    mut rx: watch::Receiver<Arc<Policy>>,
    check: impl Fn(&Policy) -> Result<(), Refusal>,
) -> String {
    loop {
        if rx.changed().await.is_err() {
            return "the sandbox's rules were withdrawn".into();
        }
        let policy = rx.borrow_and_update().clone();
        if let Err(r) = check(&policy) {
            return r.to_string();
        }
    }
}

// ---------------------------------------------------------------- SOCKS5

async fn socks<IO>(inner: Arc<Inner>, mut io: IO, net: SandboxNet)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let head = timeout(inner.cfg.handshake_timeout, socks_head(&mut io)).await;
    let Ok(Ok(Some((host, port)))) = head else {
        return;
    };
    match inner.open(&net, host.clone(), port).await {
        Err(e) => {
            let _ = io
                .write_all(&[5, e.socks_reply(), 0, 1, 0, 0, 0, 0, 0, 0])
                .await;
            let _ = io.shutdown().await;
        }
        Ok(opened) => {
            if io.write_all(&[5, 0, 0, 1, 0, 0, 0, 0, 0, 0]).await.is_err() {
                return;
            }
            relay(inner, io, opened, net).await
        }
    }
}

/// Reads the greeting and the request; answers the greeting. `None` when the
/// client asked for something unsupported (already answered).
async fn socks_head<IO: AsyncRead + AsyncWrite + Unpin>(
    io: &mut IO,
) -> std::io::Result<Option<(Host, u16)>> {
    let n = io.read_u8().await?;
    let mut methods = [0u8; 255];
    io.read_exact(&mut methods[..usize::from(n)]).await?;
    if !methods[..usize::from(n)].contains(&0) {
        io.write_all(&[5, 0xff]).await?;
        return Ok(None);
    }
    io.write_all(&[5, 0]).await?;
    let mut req = [0u8; 4];
    io.read_exact(&mut req).await?;
    let [ver, cmd, _, atyp] = req;
    if ver != 5 {
        return Ok(None);
    }
    let host = match atyp {
        1 => {
            let mut a = [0u8; 4];
            io.read_exact(&mut a).await?;
            Host::Ip(IpAddr::from(a))
        }
        3 => {
            let len = io.read_u8().await?;
            let mut name = vec![0u8; usize::from(len)];
            io.read_exact(&mut name).await?;
            match String::from_utf8(name) {
                Ok(s) => Host::parse(&s),
                Err(_) => Host::Name(String::new()),
            }
        }
        4 => {
            let mut a = [0u8; 16];
            io.read_exact(&mut a).await?;
            Host::Ip(IpAddr::from(a))
        }
        _ => {
            io.write_all(&[5, 8, 0, 1, 0, 0, 0, 0, 0, 0]).await?;
            return Ok(None);
        }
    };
    let port = io.read_u16().await?;
    if cmd != 1 {
        io.write_all(&[5, 7, 0, 1, 0, 0, 0, 0, 0, 0]).await?;
        return Ok(None);
    }
    Ok(Some((host, port)))
}

// ---------------------------------------------------------------- HTTP proxy

/// A CONNECT answered 200 (or a `connect-udp` answered 101), waiting for
/// hyper to hand over the stream.
struct Pending {
    upgrade: hyper::upgrade::OnUpgrade,
    opened: Upgraded,
}

enum Upgraded {
    Tunnel(Opened),
    Udp(OpenedUdp),
}

struct HttpState {
    inner: Arc<Inner>,
    net: SandboxNet,
    pending: Mutex<Option<Pending>>,
    /// The last target forwarded to, re-checked on policy changes.
    current: Mutex<Option<Checked>>,
    /// Upstream connections of forwarded requests; aborted with the connection.
    conns: Mutex<JoinSet<()>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Spawns an upstream connection's task, first dropping finished ones so a
/// long keep-alive connection does not pile them up.
fn spawn_reaped(
    set: &Mutex<JoinSet<()>>,
    task: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let mut set = lock(set);
    while set.try_join_next().is_some() {}
    set.spawn(task);
}

fn server_builder(cfg: &EgressConfig) -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(cfg.handshake_timeout)
        .max_buf_size(cfg.max_head_bytes.max(8192))
        .keep_alive(true);
    b
}

async fn http_proxy<IO>(inner: Arc<Inner>, io: IO, net: SandboxNet)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let state = Arc::new(HttpState {
        inner: inner.clone(),
        net: net.clone(),
        pending: Mutex::new(None),
        current: Mutex::new(None),
        conns: Mutex::new(JoinSet::new()),
    });
    let svc_state = state.clone();
    let svc = service_fn(move |req| {
        let state = svc_state.clone();
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    });
    let conn = server_builder(&inner.cfg)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades();
    let watch_state = state.clone();
    let guard = revoked(net.policy.clone(), move |p| {
        match &*lock(&watch_state.current) {
            Some(c) => c.check(p, None),
            None => Ok(()),
        }
    });
    tokio::select! {
        r = conn => {
            if let Err(err) = r {
                tracing::debug!(sandbox_id = %net.sandbox_id, error = %err, "proxy connection ended");
            }
        }
        reason = guard => {
            tracing::debug!(sandbox_id = %net.sandbox_id, reason = %reason, "connection closed by a rule change");
            return;
        }
    }
    let pending = lock(&state.pending).take();
    drop(state);
    if let Some(p) = pending {
        match (p.upgrade.await, p.opened) {
            (Ok(upgraded), Upgraded::Tunnel(opened)) => {
                relay(inner, TokioIo::new(upgraded), opened, net).await
            }
            (Ok(upgraded), Upgraded::Udp(opened)) => {
                udp_flow(inner, TokioIo::new(upgraded), opened, net).await
            }
            (Err(err), _) => tracing::debug!(error = %err, "CONNECT upgrade failed"),
        }
    }
}

async fn handle(state: Arc<HttpState>, mut req: Request<Incoming>) -> Response<Body> {
    if req.method() == Method::CONNECT {
        let Some(auth) = req.uri().authority().cloned() else {
            return text(StatusCode::BAD_REQUEST, None, "CONNECT needs host:port");
        };
        let host = Host::parse(auth.host());
        let port = auth.port_u16().unwrap_or(443);
        return match state.inner.open(&state.net, host, port).await {
            Err(e) => e.response(auth.host()),
            Ok(opened) => {
                let upgrade = hyper::upgrade::on(&mut req);
                *lock(&state.pending) = Some(Pending {
                    upgrade,
                    opened: Upgraded::Tunnel(opened),
                });
                Response::new(full(Bytes::new()))
            }
        };
    }
    if is_connect_udp(&req) {
        return connect_udp(&state, req).await;
    }
    match req.uri().scheme_str() {
        Some("http") => {}
        Some(_) => {
            return text(
                StatusCode::BAD_REQUEST,
                None,
                "only http:// URLs are forwarded as they are; use CONNECT for https",
            )
        }
        None => {
            return text(
                StatusCode::BAD_REQUEST,
                None,
                "this is a proxy: send an absolute URL (http://host/path) or CONNECT",
            )
        }
    }
    let Some(auth) = req.uri().authority().cloned() else {
        return text(StatusCode::BAD_REQUEST, None, "the URL has no host");
    };
    let port = auth.port_u16().unwrap_or(80);
    let opened = match state
        .inner
        .open(&state.net, Host::parse(auth.host()), port)
        .await
    {
        Ok(o) => o,
        Err(e) => return e.response(auth.host()),
    };
    *lock(&state.current) = Some(opened.target.clone());
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The rules judged the URL's host: the destination hears the same one
    // (a proxy replaces the Host of an absolute-form request, RFC 9112
    // 3.2.2), so a Host naming a denied site on a shared address goes
    // nowhere.
    match HeaderValue::from_str(auth.as_str()) {
        Ok(v) => {
            parts.headers.insert(header::HOST, v);
        }
        Err(_) => return text(StatusCode::BAD_REQUEST, None, "the URL's host is not valid"),
    }
    parts.uri = origin_form(&parts.uri);
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(opened.stream)).await {
            Ok(x) => x,
            Err(_) => return OpenError::Connect.response(auth.host()),
        };
    spawn_reaped(&state.conns, async move {
        let _ = conn.await;
    });
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => forwarded(resp),
        Err(err) => {
            tracing::debug!(sandbox_id = %state.net.sandbox_id, error = %err, "forwarded request failed");
            text(
                StatusCode::BAD_GATEWAY,
                Some("upstream-failed"),
                &format!("{} did not answer", auth.host()),
            )
        }
    }
}

/// An HTTP/1.1 `connect-udp` request (RFC 9298, 3.2).
fn is_connect_udp(req: &Request<Incoming>) -> bool {
    req.method() == Method::GET
        && req.uri().path().starts_with(crate::udp::PATH_PREFIX)
        && req
            .headers()
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("connect-udp"))
}

async fn connect_udp(state: &HttpState, mut req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some((host, port)) = crate::udp::parse_target(&path) else {
        return text(
            StatusCode::BAD_REQUEST,
            None,
            &format!(
                "{path:?} is not {}{{host}}/{{port}}/",
                crate::udp::PATH_PREFIX
            ),
        );
    };
    let shown = host.to_string();
    match state.inner.open_udp(&state.net, host, port).await {
        Err(e) => e.response(&shown),
        Ok(opened) => {
            let upgrade = hyper::upgrade::on(&mut req);
            *lock(&state.pending) = Some(Pending {
                upgrade,
                opened: Upgraded::Udp(opened),
            });
            let mut r = Response::new(full(Bytes::new()));
            *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            let h = r.headers_mut();
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, HeaderValue::from_static("connect-udp"));
            h.insert("capsule-protocol", HeaderValue::from_static("?1"));
            r
        }
    }
}

fn origin_form(uri: &Uri) -> Uri {
    uri.path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/")
        .parse()
        .unwrap_or_else(|_| Uri::from_static("/"))
}

fn forwarded(resp: Response<Incoming>) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.boxed())
}

/// Removes hop-by-hop headers (those `Connection` names included) and every
/// `Proxy-*` header.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in [
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(n);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for n in proxy {
        headers.remove(n);
    }
}

// ---------------------------------------------------------------- tunnels

/// Carries an accepted CONNECT or SOCKS stream to its destination: as it is,
/// or through TLS interception for a host a secret names.
async fn relay<G>(inner: Arc<Inner>, guest: G, opened: Opened, net: SandboxNet)
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if inner.intercepts(&net, &opened.target) {
        intercept(inner, guest, opened, net).await
    } else {
        tunnel(inner, guest, opened, net).await
    }
}

/// Reads the first bytes from the guest; for TLS, checks the ClientHello's
/// server name. Returns the bytes read and the name, or why to close.
async fn first_bytes<G: AsyncRead + Unpin>(
    inner: &Inner,
    net: &SandboxNet,
    guest: &mut G,
    target: &Checked,
    patient: bool,
) -> Result<(Vec<u8>, Option<Host>, bool), String> {
    let mut buf = Vec::new();
    if patient {
        // A tunnel may carry a protocol whose client speaks late (the server
        // first, or server push): wait for the first byte as long as it
        // takes, and bound only the rest of a ClientHello.
        let mut first = [0u8; 1];
        match guest.read(&mut first).await {
            Ok(1) => buf.push(first[0]),
            _ => return Ok((buf, None, true)),
        }
    }
    let hello = timeout(inner.cfg.handshake_timeout, read_hello(guest, &mut buf))
        .await
        .map_err(|_| "no ClientHello in time".to_string())?;
    let sni = match hello {
        Hello::NotTls => return Ok((buf, None, false)),
        Hello::Closed => return Ok((buf, None, true)),
        Hello::Malformed => return Err("a malformed TLS ClientHello".into()),
        Hello::Tls { sni } => sni.map(|s| Host::parse(&s)),
    };
    if let Some(name) = &sni {
        let policy = net.policy.borrow().clone();
        if let Err(r) = target.check(&policy, Some(name)) {
            tracing::debug!(
                sandbox_id = %net.sandbox_id, target = %target.host, port = target.port, sni = %name,
                decision = "refused", reason = %r
            );
            return Err(r.to_string());
        }
    }
    Ok((buf, sni, false))
}

async fn tunnel<G>(inner: Arc<Inner>, guest: G, opened: Opened, net: SandboxNet)
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let target = opened.target.clone();
    let sni: Arc<Mutex<Option<Host>>> = Arc::new(Mutex::new(None));
    let activity = Activity::new();
    let (gr, mut gw) = tokio::io::split(guest);
    let (ur, mut uw) = tokio::io::split(opened.stream);
    let mut gr = Watched::new(gr, activity.clone());
    let mut ur = Watched::new(ur, activity.clone());
    let up = {
        let sni = sni.clone();
        let (inner, net, target) = (inner.clone(), net.clone(), target.clone());
        async move {
            let (buf, name, closed) = first_bytes(&inner, &net, &mut gr, &target, true).await?;
            *lock(&sni) = name;
            let _ = uw.write_all(&buf).await;
            if !closed {
                let _ = tokio::io::copy(&mut gr, &mut uw).await;
            }
            let _ = uw.shutdown().await;
            Ok::<(), String>(())
        }
    };
    // The destination may speak first (SSH, SMTP): its bytes flow at once.
    let down = async move {
        let _ = tokio::io::copy(&mut ur, &mut gw).await;
        let _ = gw.shutdown().await;
    };
    let work = async {
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        while !(up_done && down_done) {
            tokio::select! {
                r = &mut up, if !up_done => {
                    r?;
                    up_done = true;
                }
                _ = &mut down, if !down_done => down_done = true,
            }
        }
        Ok::<(), String>(())
    };
    let check_sni = sni.clone();
    let check_target = target.clone();
    let guard = revoked(net.policy.clone(), move |p| {
        let name = lock(&check_sni).clone();
        check_target.check(p, name.as_ref())
    });
    // Either side may speak first, but one of them must within the
    // handshake timeout; after that, a tunnel quiet for the idle timeout
    // gives its sockets back.
    let quiet = idle(
        &activity,
        inner.cfg.handshake_timeout,
        inner.cfg.tunnel_idle_timeout,
    );
    tokio::select! {
        r = work => if let Err(reason) = r {
            tracing::debug!(sandbox_id = %net.sandbox_id, target = %target.host, reason = %reason, "tunnel closed");
        },
        reason = guard => {
            tracing::debug!(sandbox_id = %net.sandbox_id, target = %target.host, reason = %reason, "tunnel closed by a rule change");
        }
        reason = quiet => {
            tracing::debug!(sandbox_id = %net.sandbox_id, target = %target.host, reason, "tunnel closed");
        }
    }
}

/// Carries one UDP flow: each datagram capsule from the guest is sent to
/// the destination, each datagram from it comes back as a capsule; until
/// either side closes, the rules stop allowing it, or it is idle.
async fn udp_flow<G>(inner: Arc<Inner>, guest: G, opened: OpenedUdp, net: SandboxNet)
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let OpenedUdp {
        socket,
        permit,
        target,
    } = opened;
    let activity = Activity::new();
    let (mut gr, mut gw) = tokio::io::split(guest);
    let permit = &permit;
    let up = async {
        loop {
            match crate::udp::read_datagram(&mut gr).await {
                Ok(Some(d)) => {
                    activity.touch();
                    // A datagram the destination refuses (ICMP) is lost, as
                    // UDP's are; the flow goes on.
                    if socket.send(&d).await.is_ok() {
                        permit.count_sent(d.len());
                    }
                }
                Ok(None) => return "the guest closed the flow".to_string(),
                Err(e) => return format!("the guest's capsules: {e}"),
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; crate::udp::MAX_PAYLOAD];
        loop {
            match socket.recv(&mut buf).await {
                Ok(n) => {
                    activity.touch();
                    permit.count_received(n);
                    if let Err(e) = crate::udp::write_datagram(&mut gw, &buf[..n]).await {
                        return format!("the guest's stream: {e}");
                    }
                }
                // An ICMP error for an earlier datagram: later ones may pass.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Err(e) => return format!("the socket: {e}"),
            }
        }
    };
    let check = target.clone();
    let guard = revoked(net.policy.clone(), move |p| check.check(p, None));
    let quiet = idle(
        &activity,
        inner.cfg.handshake_timeout,
        inner.cfg.tunnel_idle_timeout,
    );
    let reason = tokio::select! {
        r = up => r,
        r = down => r,
        r = guard => format!("closed by a rule change: {r}"),
        r = quiet => r.to_string(),
    };
    tracing::debug!(sandbox_id = %net.sandbox_id, target = %target.host, port = target.port, reason = %reason, "udp flow ended");
}

/// Per intercepted connection: where requests go and the upstream in use.
struct Intercept {
    inner: Arc<Inner>,
    net: SandboxNet,
    target: Checked,
    name: String,
    /// A first connection, opened when the rules were checked.
    first: Mutex<Option<Upstream>>,
    sender: Mutex<Option<SendRequest<Incoming>>>,
    conns: Mutex<JoinSet<()>>,
}

async fn intercept<G>(inner: Arc<Inner>, mut guest: G, opened: Opened, net: SandboxNet)
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let target = opened.target.clone();
    let Some(name) = target.host.name().map(str::to_owned) else {
        return;
    };
    let id = net.sandbox_id.clone();
    let (buf, sni, closed) = match first_bytes(&inner, &net, &mut guest, &target, false).await {
        Ok(x) => x,
        Err(reason) => {
            tracing::debug!(sandbox_id = %id, target = %name, reason = %reason, "intercepted connection closed");
            return;
        }
    };
    if closed {
        return;
    }
    let cfg = match net.ca.server_config(&name) {
        Ok(c) => c,
        Err(err) => {
            tracing::warn!(sandbox_id = %id, target = %name, error = %err, "no certificate for an intercepted host");
            return;
        }
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    let tls = match timeout(
        inner.cfg.handshake_timeout,
        acceptor.accept(Prefixed::new(buf, guest)),
    )
    .await
    {
        Ok(Ok(tls)) => tls,
        _ => {
            tracing::debug!(sandbox_id = %id, target = %name, "the guest's TLS handshake failed");
            return;
        }
    };
    let state = Arc::new(Intercept {
        inner: inner.clone(),
        net: net.clone(),
        target: target.clone(),
        name,
        first: Mutex::new(Some(opened.stream)),
        sender: Mutex::new(None),
        conns: Mutex::new(JoinSet::new()),
    });
    let svc_state = state.clone();
    let svc = service_fn(move |req| {
        let state = svc_state.clone();
        async move { Ok::<_, Infallible>(intercepted_request(state, req).await) }
    });
    let conn = server_builder(&inner.cfg)
        .serve_connection(TokioIo::new(tls), svc)
        .with_upgrades();
    let guard = revoked(net.policy.clone(), move |p| target.check(p, sni.as_ref()));
    let work = async {
        let _ = conn.await;
        // Upgraded streams (WebSockets) go on after the HTTP connection ends;
        // idle upstream connections end with their sender.
        lock(&state.sender).take();
        lock(&state.first).take();
        let mut set = std::mem::take(&mut *lock(&state.conns));
        while set.join_next().await.is_some() {}
    };
    tokio::select! {
        _ = work => {}
        reason = guard => {
            tracing::debug!(sandbox_id = %id, reason = %reason, "intercepted connection closed by a rule change");
        }
    }
}

impl Intercept {
    /// A sender ready for the next request: the one in use, or a new TLS
    /// connection to the same address, which must verify as `name`.
    async fn sender(&self) -> Result<SendRequest<Incoming>, String> {
        let kept = lock(&self.sender).take();
        if let Some(mut s) = kept {
            if s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let tls = self.connect_tls().await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        spawn_reaped(&self.conns, async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// A request that asks to switch protocols (a WebSocket) gets its own
    /// upstream connection; on `101` both sides are joined byte for byte.
    async fn upgrade(
        &self,
        req: Request<Incoming>,
        guest: hyper::upgrade::OnUpgrade,
        needles: Vec<Vec<u8>>,
    ) -> Result<Response<Body>, String> {
        let tls = self.connect_tls().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        spawn_reaped(&self.conns, async move {
            let _ = conn.with_upgrades().await;
        });
        let mut resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            return Ok(scrubbed(resp, needles, false, &self.name));
        }
        let upstream = hyper::upgrade::on(&mut resp);
        let scrubber = Scrubber::new(needles.clone());
        let idle_timeout = self.inner.cfg.tunnel_idle_timeout;
        spawn_reaped(&self.conns, async move {
            if let (Ok(g), Ok(u)) = tokio::join!(guest, upstream) {
                join_upgraded(TokioIo::new(g), TokioIo::new(u), scrubber, idle_timeout).await;
            }
        });
        let (mut parts, body) = resp.into_parts();
        scrub_headers(&mut parts.headers, &needles);
        let proto = parts.headers.get(header::UPGRADE).cloned();
        strip_hop_by_hop(&mut parts.headers);
        keep_upgrade(&mut parts.headers, proto);
        Ok(Response::from_parts(parts, body.boxed()))
    }

    async fn connect_tls(&self) -> Result<tokio_rustls::client::TlsStream<Upstream>, String> {
        let cfg = self
            .inner
            .client_tls
            .clone()
            .ok_or("no TLS client configuration")?;
        let first = lock(&self.first).take();
        let stream = match first {
            Some(s) => s,
            None => {
                let permit = self
                    .inner
                    .limits
                    .connection(&self.net.sandbox_id)
                    .map_err(|full| full.to_string())?;
                let stream = timeout(
                    self.inner.cfg.connect_timeout,
                    TcpStream::connect(self.target.socket),
                )
                .await
                .map_err(|_| "connecting timed out".to_string())?
                .map_err(|e| format!("connecting failed: {e}"))?;
                Upstream::new(stream, permit)
            }
        };
        let server_name = ServerName::try_from(self.name.clone()).map_err(|e| e.to_string())?;
        let tls = timeout(
            self.inner.cfg.handshake_timeout,
            tokio_rustls::TlsConnector::from(cfg).connect(server_name, stream),
        )
        .await
        .map_err(|_| "the TLS handshake timed out".to_string())?
        .map_err(|e| format!("its certificate could not be verified or TLS failed: {e}"))?;
        Ok(tls)
    }
}

/// Joins an upgraded stream (a WebSocket) to its destination; what the
/// destination sends is scrubbed when the handshake carried a value.
async fn join_upgraded<G, U>(
    guest: G,
    upstream: U,
    scrubber: Option<Scrubber>,
    idle_timeout: std::time::Duration,
) where
    G: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    activity.touch();
    let (gr, gw) = tokio::io::split(guest);
    let (ur, mut uw) = tokio::io::split(upstream);
    let mut gr = Watched::new(gr, activity.clone());
    let ur = Watched::new(ur, activity.clone());
    let up = async move {
        let _ = tokio::io::copy(&mut gr, &mut uw).await;
        let _ = uw.shutdown().await;
    };
    let down = async move {
        match scrubber {
            Some(s) => copy_scrubbed(ur, gw, s).await,
            None => {
                let (mut ur, mut gw) = (ur, gw);
                let _ = tokio::io::copy(&mut ur, &mut gw).await;
                let _ = gw.shutdown().await;
            }
        }
    };
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = idle(&activity, idle_timeout, idle_timeout) => {}
    }
}

/// On a request that carries a value: ask for an answer the scrubber can
/// read (no compression, of the body or of WebSocket frames).
fn readable_answers(headers: &mut HeaderMap) {
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    headers.remove(header::SEC_WEBSOCKET_EXTENSIONS);
}

/// The answer to an intercepted request, scrubbed of the values the request
/// carried. A body in an encoding the scrubber cannot read (the request
/// asked for none) is refused rather than passed on unread.
fn scrubbed(
    resp: Response<Incoming>,
    needles: Vec<Vec<u8>>,
    head_only: bool,
    host: &str,
) -> Response<Body> {
    if needles.is_empty() {
        return forwarded(resp);
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Some(encoding) = unreadable_encoding(&parts.headers) {
        let bodiless = head_only
            || matches!(
                parts.status,
                StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
            )
            || body.is_end_stream();
        if !bodiless {
            tracing::debug!(target = %host, encoding = %encoding, "an encoded answer to a request with a secret refused");
            return text(
                StatusCode::BAD_GATEWAY,
                Some("encoded-response"),
                &format!(
                    "{host} answered a request that carried a secret in Content-Encoding \
                     {encoding:?}; the proxy must read such answers to keep the secret out \
                     of them and cannot read this encoding"
                ),
            );
        }
    }
    scrub_headers(&mut parts.headers, &needles);
    match Scrubber::new(needles) {
        Some(scrubber) => Response::from_parts(parts, ScrubbedBody::new(body, scrubber).boxed()),
        None => Response::from_parts(parts, body.boxed()),
    }
}

/// The answer's `Content-Encoding` when it is not `identity`.
fn unreadable_encoding(headers: &HeaderMap) -> Option<String> {
    let encodings: Vec<String> = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .flat_map(|v| {
            v.split(',')
                .map(|e| e.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|e| !e.is_empty() && e != "identity")
        .collect();
    (!encodings.is_empty()).then(|| encodings.join(", "))
}

/// Whether a request asks to switch protocols.
fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Puts back the two headers a protocol switch needs after hop-by-hop ones
/// were dropped.
fn keep_upgrade(headers: &mut HeaderMap, proto: Option<HeaderValue>) {
    if let Some(proto) = proto {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto);
    }
}

/// The host a request names (URL authority, else `Host`), lowercase, no port.
fn request_host(uri: &Uri, headers: &HeaderMap) -> Option<String> {
    let raw = match uri.host() {
        Some(h) => h.to_owned(),
        None => {
            let v = headers.get(header::HOST)?.to_str().ok()?;
            v.parse::<http::uri::Authority>().ok()?.host().to_owned()
        }
    };
    Some(raw.trim_end_matches('.').to_ascii_lowercase())
}

/// Methods whose answer is the request itself (RFC 9110 9.3.8): to a host
/// that gets secrets, that would be the value.
fn echoes_the_request(method: &Method) -> bool {
    method == Method::TRACE || method.as_str().eq_ignore_ascii_case("TRACK")
}

async fn intercepted_request(state: Arc<Intercept>, mut req: Request<Incoming>) -> Response<Body> {
    if echoes_the_request(req.method()) {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            Some("method-refused"),
            &format!(
                "{} is refused to {}: its answer would echo the request, secrets included",
                req.method(),
                state.name
            ),
        );
    }
    let guest_upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
    let proto = req.headers().get(header::UPGRADE).cloned();
    let (mut parts, body) = req.into_parts();
    let id = state.net.sandbox_id.as_str();
    strip_hop_by_hop(&mut parts.headers);
    if guest_upgrade.is_some() {
        keep_upgrade(&mut parts.headers, proto);
    }
    let host = request_host(&parts.uri, &parts.headers);
    parts.uri = origin_form(&parts.uri);
    if !parts.headers.contains_key(header::HOST) {
        if let Ok(v) = HeaderValue::from_str(&state.name) {
            parts.headers.insert(header::HOST, v);
        }
    }
    // The value goes only where the verified connection goes, and only when
    // the request names that host too (no fronting another virtual host).
    let mut applied = Applied::default();
    if host.as_deref() == Some(state.name.as_str()) {
        let secrets = state.net.secrets.borrow().clone();
        applied = substitute(
            &secrets,
            &state.name,
            parts.method.as_str(),
            &mut parts.uri,
            &mut parts.headers,
        );
        if !applied.names.is_empty() {
            tracing::debug!(sandbox_id = id, target = %state.name, secrets = ?applied.names, "secrets put into a request");
            readable_answers(&mut parts.headers);
        }
    }
    let head_only = parts.method == Method::HEAD;
    if let Some(guest) = guest_upgrade {
        return match state
            .upgrade(Request::from_parts(parts, body), guest, applied.needles)
            .await
        {
            Ok(resp) => resp,
            Err(reason) => {
                tracing::debug!(sandbox_id = id, target = %state.name, reason = %reason, "upgrade failed");
                text(
                    StatusCode::BAD_GATEWAY,
                    Some("upstream-failed"),
                    &format!("{} could not be reached securely: {reason}", state.name),
                )
            }
        };
    }
    let mut sender = match state.sender().await {
        Ok(s) => s,
        Err(reason) => {
            tracing::debug!(sandbox_id = id, target = %state.name, reason = %reason, "no upstream connection");
            return text(
                StatusCode::BAD_GATEWAY,
                Some("upstream-tls-failed"),
                &format!("{} could not be reached securely: {reason}", state.name),
            );
        }
    };
    let result = sender.send_request(Request::from_parts(parts, body)).await;
    *lock(&state.sender) = Some(sender);
    match result {
        Ok(resp) => scrubbed(resp, applied.needles, head_only, &state.name),
        Err(err) => {
            tracing::debug!(sandbox_id = id, target = %state.name, error = %err, "intercepted request failed");
            text(
                StatusCode::BAD_GATEWAY,
                Some("upstream-failed"),
                &format!("{} did not answer", state.name),
            )
        }
    }
}
