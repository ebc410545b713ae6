//! One POST of a delivery: resolve the URL's host again, refuse it when
//! any address it resolves to is one a webhook may not reach (DNS
//! rebinding), connect only to an address checked, speak HTTP/1.1 (over
//! TLS for `https`), and take the answer's status. Redirects are not
//! followed: a 3xx is a failure, as the product documents.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, USER_AGENT};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::net::TcpStream;

use crate::domain::webhook::Target;

/// How an endpoint answered one attempt.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub status: Option<u16>,
    pub duration_ms: i64,
    pub error: Option<String>,
}

impl Outcome {
    pub(crate) fn ok(&self) -> bool {
        self.error.is_none() && self.status.is_some_and(|s| (200..300).contains(&s))
    }
}

/// The client side of TLS: the system's roots, ring, HTTP/1.1. `None`
/// only when ring offers no TLS version (then HTTPS deliveries fail).
pub(crate) fn tls_config() -> Option<Arc<ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for err in &native.errors {
        tracing::warn!(error = %err, "loading a system root certificate failed");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(added, ignored, "webhook root certificates");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tracing::error!(error = %e, "no TLS version for webhooks"))
        .ok()?;
    let mut cfg = builder.with_root_certificates(roots).with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Some(Arc::new(cfg))
}

/// POSTs `body` with `headers` to `target`, all within `timeout`.
pub(crate) async fn post(
    target: &Target,
    headers: &[(&'static str, String)],
    body: String,
    tls: Option<Arc<ClientConfig>>,
    timeout: Duration,
) -> Outcome {
    let start = Instant::now();
    let result = tokio::time::timeout(timeout, attempt(target, headers, body, tls)).await;
    let duration_ms = i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX);
    match result {
        Ok(Ok(status)) => Outcome {
            status: Some(status),
            duration_ms,
            error: None,
        },
        Ok(Err(e)) => Outcome {
            status: None,
            duration_ms,
            error: Some(e),
        },
        Err(_) => Outcome {
            status: None,
            duration_ms,
            error: Some(format!("timeout: no answer within {} s", timeout.as_secs())),
        },
    }
}

async fn attempt(
    target: &Target,
    headers: &[(&'static str, String)],
    body: String,
    tls: Option<Arc<ClientConfig>>,
) -> Result<u16, String> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("dns: {} did not resolve: {e}", target.host))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("dns: {} has no address", target.host));
    }
    if let Some(bad) = addrs.iter().find(|a| !target.may_connect(a.ip())) {
        return Err(format!(
            "refused: {} resolves to {}, a loopback, private or link-local address",
            target.host,
            bad.ip()
        ));
    }
    let mut last = String::new();
    let mut tcp = None;
    for addr in &addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = format!("connect: {addr}: {e}"),
        }
    }
    let tcp = tcp.ok_or(last)?;
    let _ = tcp.set_nodelay(true);
    let mut req = hyper::Request::builder()
        .method(hyper::Method::POST)
        .uri(target.path.as_str())
        .header(HOST, target.authority())
        .header(CONTENT_TYPE, "application/json")
        .header(CONTENT_LENGTH, body.len())
        .header(USER_AGENT, "runtime-webhooks/1");
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let req = req.body(body).map_err(|e| format!("request: {e}"))?;
    if target.https {
        let tls = tls.ok_or("tls: no TLS configuration")?;
        let name = ServerName::try_from(target.host.clone())
            .map_err(|e| format!("tls: {} is not a server name: {e}", target.host))?;
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        exchange(TokioIo::new(stream), req).await
    } else {
        exchange(TokioIo::new(tcp), req).await
    }
}

/// One request on a fresh connection; the answer's status.
async fn exchange<I>(io: I, req: hyper::Request<String>) -> Result<u16, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, String>(io)
        .await
        .map_err(|e| format!("http: {e}"))?;
    let send = sender.send_request(req);
    tokio::pin!(conn);
    tokio::pin!(send);
    let answer = tokio::select! {
        biased;
        r = &mut send => r,
        // A connection that closes after its answer (`connection: close`)
        // ends first; the answer is then waiting.
        c = &mut conn => match c {
            Ok(()) => send.await,
            Err(e) => return Err(format!("http: {e}")),
        },
    };
    answer
        .map(|resp| resp.status().as_u16())
        .map_err(|e| format!("http: {e}"))
}
