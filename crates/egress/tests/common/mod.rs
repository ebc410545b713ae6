//! Test destinations (plain HTTP, HTTPS with a CA of their own, raw TCP echo)
//! and a guest side made of `tokio::io::duplex`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use runtime_egress::{
    CertificateDer, Egress, EgressConfig, Policy, Rules, SandboxCa, SandboxNet, Secret,
};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// What a destination received.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub method: String,
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub(crate) type Log = Arc<Mutex<Vec<Seen>>>;

/// A CA for test destinations, and certificates it signs.
pub(crate) struct TestCa {
    cert: rcgen::Certificate,
    issuer: rcgen::Issuer<'static, KeyPair>,
}

impl TestCa {
    pub(crate) fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = p.self_signed(&key).unwrap();
        Self {
            cert,
            issuer: rcgen::Issuer::new(p, key),
        }
    }

    pub(crate) fn pem(&self) -> String {
        self.cert.pem()
    }

    pub(crate) fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    fn server_config(&self, names: &[&str]) -> Arc<rustls::ServerConfig> {
        let key = KeyPair::generate().unwrap();
        let p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(cfg)
    }
}

async fn record(log: Log, mut req: Request<Incoming>) -> Response<Full<Bytes>> {
    // A protocol switch: answer 101, then echo the raw bytes.
    let upgrade = req
        .headers()
        .contains_key("upgrade")
        .then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let uri = parts.uri.to_string();
    log.lock().unwrap().push(Seen {
        method: parts.method.to_string(),
        uri: uri.clone(),
        headers: parts.headers,
        body,
    });
    if let Some(upgrade) = upgrade {
        tokio::spawn(async move {
            if let Ok(up) = upgrade.await {
                let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        return Response::builder()
            .status(101)
            .header("connection", "upgrade")
            .header("upgrade", "websocket")
            .body(Full::new(Bytes::new()))
            .unwrap();
    }
    if uri.starts_with("/echo") {
        return echo(&log.lock().unwrap().last().unwrap().headers, &uri);
    }
    if uri.starts_with("/gzip") {
        // As a server that compresses whatever the client asked for.
        return Response::builder()
            .header("content-encoding", "gzip")
            .body(Full::new(Bytes::from_static(b"\x1f\x8b not really gzip")))
            .unwrap();
    }
    Response::new(Full::new(Bytes::from(format!("seen {uri}"))))
}

/// `/echo…`: the request reflected, as a careless host does: every header
/// in the body and the `authorization` in an answer header too.
fn echo(headers: &HeaderMap, uri: &str) -> Response<Full<Bytes>> {
    let mut body = format!("uri {uri}\n");
    for (k, v) in headers {
        body.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
    }
    let mut b = Response::builder();
    if let Some(auth) = headers.get("authorization") {
        b = b.header("x-echo-authorization", auth.clone());
    }
    b.body(Full::new(Bytes::from(body))).unwrap()
}

/// A plain HTTP destination that records every request.
pub(crate) async fn http_server() -> (SocketAddr, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let l = l.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let l = l.clone();
                    async move { Ok::<_, std::convert::Infallible>(record(l, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, log)
}

/// An HTTPS destination with a certificate for `names` signed by `ca`.
pub(crate) async fn https_server(ca: &TestCa, names: &[&str]) -> (SocketAddr, Log) {
    let cfg = ca.server_config(names);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let l = l.clone();
            let acceptor = tokio_rustls::TlsAcceptor::from(cfg.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                let svc = service_fn(move |req| {
                    let l = l.clone();
                    async move { Ok::<_, std::convert::Infallible>(record(l, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .with_upgrades()
                    .await;
            });
        }
    });
    (addr, log)
}

/// A TCP destination that echoes what it gets; counts connections.
pub(crate) async fn echo_server() -> (SocketAddr, Arc<Mutex<usize>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(Mutex::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            *c.lock().unwrap() += 1;
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, count)
}

/// One sandbox behind a proxy.
pub(crate) struct Sandbox {
    pub egress: Egress,
    pub policy: watch::Sender<Arc<Policy>>,
    pub secrets: watch::Sender<Arc<Vec<Secret>>>,
    pub ca: Arc<SandboxCa>,
}

pub(crate) fn policy(json: &str) -> Policy {
    let rules: Rules = serde_json::from_str(json).unwrap();
    rules.validate().unwrap()
}

impl Sandbox {
    pub(crate) fn new(cfg: EgressConfig, policy: Policy) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("runtime_egress=debug")
            .with_writer(|| LogWriter)
            .try_init();
        Self {
            egress: Egress::new(cfg),
            policy: watch::channel(Arc::new(policy)).0,
            secrets: watch::channel(Arc::new(Vec::new())).0,
            ca: Arc::new(SandboxCa::generate().unwrap()),
        }
    }

    /// A new connection from the guest, served by the proxy.
    pub(crate) fn guest(&self) -> DuplexStream {
        self.guest_as("sbx-test")
    }

    /// A new connection from the guest of sandbox `sandbox_id` (same rules,
    /// same proxy): for what the proxy counts per sandbox.
    pub(crate) fn guest_as(&self, sandbox_id: &str) -> DuplexStream {
        let (guest, host) = tokio::io::duplex(64 * 1024);
        let net = SandboxNet {
            sandbox_id: sandbox_id.into(),
            policy: self.policy.subscribe(),
            secrets: self.secrets.subscribe(),
            ca: self.ca.clone(),
        };
        let egress = self.egress.clone();
        tokio::spawn(async move { egress.serve(host, net).await });
        guest
    }

    pub(crate) fn set_policy(&self, p: Policy) {
        self.policy.send_replace(Arc::new(p));
    }
}

/// A proxy answer read by hand.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
}

/// Reads one HTTP answer (head and a Content-Length body) from `io`.
pub(crate) async fn read_answer<IO: AsyncRead + Unpin>(io: &mut IO) -> Result<Answer> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        if io.read(&mut b).await? == 0 {
            bail!(
                "closed before the head ended: {:?}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(b[0]);
        if head.len() > 65536 {
            bail!("head too long");
        }
    }
    let head = String::from_utf8(head)?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow!("no status"))?
        .parse()?;
    let mut a = Answer {
        status,
        head,
        body: String::new(),
    };
    let len: usize = a
        .header("content-length")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    io.read_exact(&mut body).await?;
    a.body = String::from_utf8(body)?;
    Ok(a)
}

/// `CONNECT target` on a new guest connection; the stream on 200.
pub(crate) async fn connect(sbx: &Sandbox, target: &str) -> Result<(Answer, DuplexStream)> {
    let mut g = sbx.guest();
    g.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let a = tokio::time::timeout(WAIT, read_answer(&mut g)).await??;
    Ok((a, g))
}

/// `CONNECT target` from sandbox `sandbox_id`; the stream on 200.
pub(crate) async fn connect_as(
    sbx: &Sandbox,
    sandbox_id: &str,
    target: &str,
) -> Result<(Answer, DuplexStream)> {
    let mut g = sbx.guest_as(sandbox_id);
    g.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let a = tokio::time::timeout(WAIT, read_answer(&mut g)).await??;
    Ok((a, g))
}

/// SOCKS5 CONNECT to a domain name; the reply code and the stream.
pub(crate) async fn socks(sbx: &Sandbox, host: &str, port: u16) -> Result<(u8, DuplexStream)> {
    let mut g = sbx.guest();
    g.write_all(&[5, 1, 0]).await?;
    let mut r = [0u8; 2];
    g.read_exact(&mut r).await?;
    if r != [5, 0] {
        bail!("greeting answered {r:?}");
    }
    let mut req = vec![5, 1, 0];
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(v4)) => {
            req.push(1);
            req.extend_from_slice(&v4.octets());
        }
        Ok(std::net::IpAddr::V6(v6)) => {
            req.push(4);
            req.extend_from_slice(&v6.octets());
        }
        Err(_) => {
            req.push(3);
            req.push(host.len() as u8);
            req.extend_from_slice(host.as_bytes());
        }
    }
    req.extend_from_slice(&port.to_be_bytes());
    g.write_all(&req).await?;
    let mut reply = [0u8; 10];
    tokio::time::timeout(WAIT, g.read_exact(&mut reply)).await??;
    Ok((reply[1], g))
}

/// A TLS client over `io` trusting only `roots`, sending `sni` (or no SNI).
pub(crate) async fn tls<IO: AsyncRead + AsyncWrite + Unpin>(
    io: IO,
    name: &str,
    roots: &[CertificateDer<'static>],
    send_sni: bool,
) -> Result<tokio_rustls::client::TlsStream<IO>> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone())?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(store)
    .with_no_client_auth();
    cfg.enable_sni = send_sni;
    let name = ServerName::try_from(name.to_string())?;
    let s = tokio::time::timeout(
        WAIT,
        tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, io),
    )
    .await
    .context("TLS handshake timed out")??;
    Ok(s)
}

/// An HTTP/1.1 client over `io`.
pub(crate) async fn client<IO: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: IO,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

pub(crate) struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

pub(crate) async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    req: Request<Full<Bytes>>,
) -> Result<Got> {
    tokio::time::timeout(WAIT, sender.ready()).await??;
    let resp = tokio::time::timeout(WAIT, sender.send_request(req)).await??;
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await??
        .to_bytes();
    Ok(Got {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

pub(crate) fn get(uri: &str, host: &str) -> Request<Full<Bytes>> {
    Request::get(uri)
        .header("host", host)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Whether the stream is closed (EOF or error) within [`WAIT`].
pub(crate) async fn closed<IO: AsyncRead + Unpin>(io: &mut IO) -> bool {
    let mut b = [0u8; 64];
    matches!(
        tokio::time::timeout(WAIT, io.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// Everything until the stream closes; `None` if it stays open past [`WAIT`].
pub(crate) async fn read_to_close<IO: AsyncRead + Unpin>(io: &mut IO) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    match tokio::time::timeout(WAIT, io.read_to_end(&mut out)).await {
        Ok(_) => Some(out),
        Err(_) => None,
    }
}

/// Everything logged in this test binary, for tests that check what a log
/// never holds.
pub(crate) static LOGS: Mutex<Vec<u8>> = Mutex::new(Vec::new());

pub(crate) struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        eprint!("{}", String::from_utf8_lossy(buf));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub(crate) fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}
