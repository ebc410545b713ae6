//! The HTTP client of the `runtime sandbox` and `runtime image` commands:
//! one HTTP/1.1 connection per request (hyper's client connection), over
//! TCP or TLS (rustls with the system's roots), plus the WebSocket upgrade
//! the terminal and the tunnel use. Where the API is and which key calls
//! it is settled once in [`Target::resolve`].

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::login;

/// A byte stream to the server, plain or TLS.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The parts of the API's origin a connection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    pub tls: bool,
    /// The host as it goes in `Host` and the TLS name (no brackets).
    pub host: String,
    pub port: u16,
}

impl Origin {
    /// `http://host[:port]` or `https://host[:port]`, any path ignored.
    pub(crate) fn parse(url: &str) -> anyhow::Result<Origin> {
        let url = url.trim();
        let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else {
            bail!("{url:?} is not an http:// or https:// address");
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        if authority.is_empty() || authority.contains('@') {
            bail!("{url:?} has no host (give http://host:port)");
        }
        let default = if tls { 443 } else { 80 };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .with_context(|| format!("{url:?}: an unclosed [ in the host"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().with_context(|| format!("{url:?}: bad port"))?,
                None if after.is_empty() => default,
                None => bail!("{url:?}: bad host"),
            };
            (h.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (
                    h.to_string(),
                    p.parse().with_context(|| format!("{url:?}: bad port"))?,
                ),
                None => (authority.to_string(), default),
            }
        };
        Ok(Origin { tls, host, port })
    }

    /// `host:port` as the `Host` header and a connect address say it.
    pub(crate) fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    pub(crate) fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.authority())
    }
}

/// The options that say which server and key a remote command uses.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ConnArgs {
    /// The server's origin (http://host:port or https://...); else
    /// RUNTIME_API_URL, else the newest `runtime login`'s.
    #[arg(long, global = true, env = "RUNTIME_API_URL")]
    pub url: Option<String>,
    /// An API key; else RUNTIME_API_KEY, else the key `runtime login` saved
    /// for the server.
    #[arg(long, global = true, env = "RUNTIME_API_KEY", hide_env_values = true)]
    pub key: Option<String>,
}

impl ConnArgs {
    pub(crate) fn target(&self) -> anyhow::Result<Target> {
        Target::resolve(self.url.clone(), self.key.clone())
    }
}

/// Where the API is and the key that calls it.
#[derive(Clone)]
pub(crate) struct Target {
    pub origin: Origin,
    key: String,
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("origin", &self.origin)
            .field("key", &"<hidden>")
            .finish()
    }
}

/// A saved login (`runtime login`): its API origin and key.
fn saved_logins() -> Vec<(std::time::SystemTime, String)> {
    let dir = login::saved_path("http://x")
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        else {
            continue;
        };
        let Some(api) = v["apiOrigin"].as_str() else {
            continue;
        };
        // Only a login saved for this origin, privately, counts.
        if login::saved_path(api) != path || login::saved_key(api).is_none() {
            continue;
        }
        let when = e
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        out.push((when, api.to_string()));
    }
    out.sort();
    out
}

impl Target {
    /// The URL from `--url` (or `RUNTIME_API_URL`, as clap reads it), else
    /// the newest saved login's; the key from `--key` (or
    /// `RUNTIME_API_KEY`), else the key saved for that URL.
    pub(crate) fn resolve(url: Option<String>, key: Option<String>) -> anyhow::Result<Target> {
        let url = match url.filter(|u| !u.trim().is_empty()) {
            Some(u) => u,
            None => match saved_logins().pop() {
                Some((_, api)) => api,
                None => bail!(
                    "no server: give --url, set RUNTIME_API_URL, or run `runtime login --url http://host:port`"
                ),
            },
        };
        let origin = Origin::parse(&url)?;
        let key = match key.filter(|k| !k.trim().is_empty()) {
            Some(k) => k.trim().to_string(),
            None => login::saved_key(&login::origin(url.trim()))
                .or_else(|| login::saved_key(&origin.url()))
                .with_context(|| {
                    format!(
                        "no API key for {}: set RUNTIME_API_KEY or run `runtime login --url {}`",
                        origin.url(),
                        origin.url()
                    )
                })?,
        };
        let tls = if origin.tls {
            Some(tls_config()?)
        } else {
            None
        };
        Ok(Target { origin, key, tls })
    }

    /// A connection to the server, TLS when the URL says https.
    pub(crate) async fn connect(&self) -> anyhow::Result<Box<dyn Io>> {
        let addr = self.origin.authority();
        let tcp = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::net::TcpStream::connect(&addr),
        )
        .await
        .with_context(|| format!("connecting to {addr}: timed out"))?
        .with_context(|| format!("connecting to {addr}"))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some(cfg) => {
                let name = rustls::pki_types::ServerName::try_from(self.origin.host.clone())
                    .with_context(|| format!("{} is not a TLS server name", self.origin.host))?;
                let s = tokio_rustls::TlsConnector::from(cfg.clone())
                    .connect(name, tcp)
                    .await
                    .with_context(|| format!("TLS with {addr}"))?;
                Ok(Box::new(s))
            }
        }
    }

    /// Sends one request; the answer's body is left to read.
    pub(crate) async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<Response<Incoming>> {
        let io = self.connect().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .context("HTTP handshake")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.origin.authority())
            .header("authorization", format!("Bearer {}", self.key))
            .header(
                "user-agent",
                concat!("runtime-cli/", env!("CARGO_PKG_VERSION")),
            );
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(body))
            .with_context(|| format!("building {method} {path}"))?;
        sender
            .send_request(req)
            .await
            .with_context(|| format!("{method} {}{path}", self.origin.url()))
    }

    /// A JSON call: the answer's JSON on 2xx, an [`ApiFailure`] otherwise.
    pub(crate) async fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        self.json_with(method, path, body, &[]).await
    }

    pub(crate) async fn json_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Value> {
        let mut h = vec![("accept", "application/json")];
        let payload = match body {
            Some(v) => {
                h.push(("content-type", "application/json"));
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        h.extend_from_slice(headers);
        let resp = self.send(method, path, &h, payload).await?;
        let resp = check(resp).await?;
        let bytes = resp.into_body().collect().await?.to_bytes();
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{method} {path}: the answer is not JSON"))
    }

    /// Every item of a paged listing (`{data, nextCursor}`) at `path` with
    /// the filters `q`, 100 a page.
    pub(crate) async fn list_all(
        &self,
        path: &str,
        q: &[(&str, String)],
    ) -> anyhow::Result<Vec<Value>> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut page = q.to_vec();
            page.push(("limit", "100".into()));
            if let Some(c) = &cursor {
                page.push(("cursor", c.clone()));
            }
            let v = self
                .json("GET", &format!("{path}{}", query(&page)), None)
                .await?;
            all.extend(v["data"].as_array().cloned().unwrap_or_default());
            match v["nextCursor"].as_str() {
                Some(c) if !c.is_empty() => cursor = Some(c.to_string()),
                _ => return Ok(all),
            }
        }
    }

    /// Raw bytes in, the answer checked.
    pub(crate) async fn put_bytes(&self, path: &str, body: Bytes) -> anyhow::Result<Value> {
        let resp = self
            .send(
                "PUT",
                path,
                &[
                    ("content-type", "application/octet-stream"),
                    ("accept", "application/json"),
                ],
                body,
            )
            .await?;
        let resp = check(resp).await?;
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// A GET whose body is streamed by the caller.
    pub(crate) async fn get_stream(
        &self,
        path: &str,
        accept: &str,
    ) -> anyhow::Result<Response<Incoming>> {
        let resp = self
            .send("GET", path, &[("accept", accept)], Bytes::new())
            .await?;
        check(resp).await
    }

    /// Opens the WebSocket at `path` (with the key).
    pub(crate) async fn websocket(
        &self,
        path: &str,
    ) -> anyhow::Result<tokio_tungstenite::WebSocketStream<Box<dyn Io>>> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        use tokio_tungstenite::tungstenite::Error as WsError;
        let scheme = if self.origin.tls { "wss" } else { "ws" };
        let url = format!("{scheme}://{}{path}", self.origin.authority());
        let mut req = url
            .as_str()
            .into_client_request()
            .with_context(|| format!("a WebSocket request to {url}"))?;
        req.headers_mut().insert(
            "authorization",
            format!("Bearer {}", self.key)
                .parse()
                .context("the key is not a valid header value")?,
        );
        let io = self.connect().await?;
        match tokio_tungstenite::client_async(req, io).await {
            Ok((ws, _)) => Ok(ws),
            Err(WsError::Http(resp)) => {
                let status = resp.status().as_u16();
                let rid = resp
                    .headers()
                    .get("x-request-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let body = resp.body().clone().unwrap_or_default();
                Err(ApiFailure::from_body(status, rid, &body).into())
            }
            Err(e) => Err(anyhow::Error::new(e).context(format!("opening {url}"))),
        }
    }
}

/// Runs a client command of a server's API and exits with its status; a
/// failure is one line on stderr and status 1.
pub(crate) fn exit_with(cmd: impl std::future::Future<Output = anyhow::Result<i32>>) -> ! {
    let code = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => {
            let r = rt.block_on(cmd);
            // Never wait for a blocked read of stdin.
            rt.shutdown_timeout(Duration::from_millis(100));
            match r {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("runtime: {}", format!("{e:#}").replace('\n', " "));
                    1
                }
            }
        }
        Err(e) => {
            eprintln!("runtime: starting the async runtime: {e}");
            1
        }
    };
    std::process::exit(code)
}

fn tls_config() -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS settings")?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// An answer that is not 2xx: the API's error body, said on one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiFailure {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub request_id: Option<String>,
    /// `details.issues`: each wrong field and what is wrong with it.
    pub issues: Vec<(String, String)>,
}

impl ApiFailure {
    pub(crate) fn from_body(status: u16, request_id: Option<String>, body: &[u8]) -> ApiFailure {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let e = &v["error"];
        let text = String::from_utf8_lossy(body);
        let message = e["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| {
                let t = text.trim();
                if t.is_empty() {
                    "no message".to_string()
                } else {
                    t.chars().take(200).collect()
                }
            });
        let issues = e["details"]["issues"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|i| {
                        (
                            i["field"].as_str().unwrap_or("?").to_string(),
                            i["message"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        ApiFailure {
            status,
            code: e["code"].as_str().unwrap_or("error").to_string(),
            message,
            request_id: e["requestId"].as_str().map(str::to_string).or(request_id),
            issues,
        }
    }
}

impl fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message.trim_end())?;
        for (field, msg) in &self.issues {
            write!(f, "; {field}: {msg}")?;
        }
        write!(f, " ({} {}", self.status, self.code)?;
        if let Some(r) = &self.request_id {
            write!(f, ", request {r}")?;
        }
        write!(f, ")")
    }
}

impl std::error::Error for ApiFailure {}

/// The answer when 2xx; an [`ApiFailure`] read from its body otherwise.
pub(crate) async fn check(resp: Response<Incoming>) -> anyhow::Result<Response<Incoming>> {
    let status = resp.status().as_u16();
    if (200..300).contains(&status) {
        return Ok(resp);
    }
    let rid = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Err(ApiFailure::from_body(status, rid, &body).into())
}

/// Percent-encodes a path segment or a query value (everything but the
/// unreserved characters, so a `/` in a name stays inside its segment).
pub(crate) fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A query string from pairs (`?a=1&b=2`, or nothing).
pub(crate) fn query(pairs: &[(&str, String)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect();
    format!("?{}", parts.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins() {
        let o = Origin::parse("http://127.0.0.1:8080/x").unwrap();
        assert_eq!(
            o,
            Origin {
                tls: false,
                host: "127.0.0.1".into(),
                port: 8080
            }
        );
        assert_eq!(o.url(), "http://127.0.0.1:8080");
        let o = Origin::parse("https://api.example.com").unwrap();
        assert_eq!((o.tls, o.port), (true, 443));
        let o = Origin::parse("http://[::1]:9").unwrap();
        assert_eq!((o.host.as_str(), o.port), ("::1", 9));
        assert_eq!(o.authority(), "[::1]:9");
        assert!(Origin::parse("ftp://x").is_err());
        assert!(Origin::parse("http://").is_err());
        assert!(Origin::parse("http://h:notaport").is_err());
    }

    #[test]
    fn failures_are_one_line_with_the_request_id() {
        let body = br#"{"error":{"code":"sandbox_not_found","status":404,"message":"Sandbox x was not found.","requestId":"req_1"}}"#;
        let f = ApiFailure::from_body(404, None, body);
        assert_eq!(
            f.to_string(),
            "Sandbox x was not found. (404 sandbox_not_found, request req_1)"
        );
        let body = br#"{"error":{"code":"invalid_request","message":"Bad.","details":{"issues":[{"field":"vcpu","message":"must be 1 to 16"}]}}}"#;
        let f = ApiFailure::from_body(400, Some("req_2".into()), body);
        assert_eq!(
            f.to_string(),
            "Bad.; vcpu: must be 1 to 16 (400 invalid_request, request req_2)"
        );
        assert!(!f.to_string().contains('\n'));
        let f = ApiFailure::from_body(502, None, b"bad gateway");
        assert_eq!(f.to_string(), "bad gateway (502 error)");
    }

    #[test]
    fn queries_are_encoded() {
        assert_eq!(
            query(&[("path", "/a b/c&d".into()), ("n", "1".into())]),
            "?path=%2Fa%20b%2Fc%26d&n=1"
        );
        assert_eq!(query(&[]), "");
    }
}
