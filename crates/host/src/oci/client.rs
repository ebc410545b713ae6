//! HTTP/1.1 to registries through the egress proxy: `CONNECT` then TLS
//! (verified with the proxy's own roots) for `https`, absolute-URI
//! requests for the operator's plain-`http` registries. One connection per
//! request; the registry's auth challenge answered once per pull
//! (anonymous or Basic credentials for a bearer token, or Basic itself);
//! redirects followed to any host the build's rules allow, without the
//! registry's credentials.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::auth::{parse_challenge, Challenge};
use super::PullError;
use crate::types::{EgressConnection, HostError};

/// Opens a new connection into the egress proxy (as the pull's network).
pub type Connector<'a> = dyn Fn() -> Result<EgressConnection, HostError> + Send + Sync + 'a;

/// Most redirects one request follows.
const MAX_REDIRECTS: usize = 5;
/// Most bytes of a CONNECT answer's head.
const MAX_CONNECT_HEAD: usize = 8 * 1024;
/// Most bytes of a token answer or an error body read.
const MAX_SMALL_BODY: usize = 64 * 1024;

/// A registry as one pull speaks to it.
pub(super) struct Client<'a> {
    /// Connections through the egress of the pull's network.
    pub(super) connect: &'a Connector<'a>,
    /// `https` or `http` (the operator's insecure registries).
    pub(super) scheme: &'static str,
    /// `host[:port]` the API answers on.
    pub(super) authority: String,
    pub(super) credentials: Option<(String, String)>,
    /// The `Authorization` value once the challenge is answered.
    auth: Option<String>,
}

impl<'a> Client<'a> {
    pub(super) fn new(
        connect: &'a Connector<'a>,
        scheme: &'static str,
        authority: String,
        credentials: Option<(String, String)>,
    ) -> Self {
        Client {
            connect,
            scheme,
            authority,
            credentials,
            auth: None,
        }
    }

    /// `path` on the registry.
    pub(super) fn url(&self, path: &str) -> Result<Uri, PullError> {
        parse_uri(&format!("{}://{}{}", self.scheme, self.authority, path))
    }

    fn basic(&self) -> Option<String> {
        self.credentials.as_ref().map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        })
    }

    /// GET `url` with the registry's credentials, answering its challenge
    /// once and following redirects. The answer may be any status.
    pub(super) async fn get(
        &mut self,
        url: Uri,
        accept: Option<&str>,
    ) -> Result<Response<Incoming>, PullError> {
        let mut url = url;
        let mut challenged = false;
        for _ in 0..=MAX_REDIRECTS {
            let ours = url.authority().map(|a| a.as_str()) == Some(self.authority.as_str());
            let auth = if ours { self.auth.clone() } else { None };
            let resp = send(self.connect, &url, accept, auth.as_deref()).await?;
            match resp.status() {
                StatusCode::UNAUTHORIZED if ours && !challenged => {
                    challenged = true;
                    let ch = resp
                        .headers()
                        .get(header::WWW_AUTHENTICATE)
                        .and_then(|v| v.to_str().ok())
                        .and_then(parse_challenge);
                    match ch {
                        Some(Challenge::Basic) => match self.basic() {
                            Some(b) => self.auth = Some(b),
                            None => return Ok(resp),
                        },
                        Some(Challenge::Bearer {
                            realm,
                            service,
                            scope,
                        }) => {
                            let token = self.token(&realm, service, scope).await?;
                            self.auth = Some(format!("Bearer {token}"));
                        }
                        None => return Ok(resp),
                    }
                }
                StatusCode::MOVED_PERMANENTLY
                | StatusCode::FOUND
                | StatusCode::SEE_OTHER
                | StatusCode::TEMPORARY_REDIRECT
                | StatusCode::PERMANENT_REDIRECT => {
                    let loc = resp
                        .headers()
                        .get(header::LOCATION)
                        .and_then(|v| v.to_str().ok())
                        .ok_or_else(|| PullError::Protocol {
                            url: url.to_string(),
                            problem: "a redirect without a Location".into(),
                        })?;
                    url = join(&url, loc)?;
                }
                _ => return Ok(resp),
            }
        }
        Err(PullError::Protocol {
            url: url.to_string(),
            problem: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    /// A bearer token from the registry's token service (anonymous, or
    /// with the credentials as Basic).
    async fn token(
        &self,
        realm: &str,
        service: Option<String>,
        scope: Option<String>,
    ) -> Result<String, PullError> {
        let mut q = Vec::new();
        if let Some(s) = service {
            q.push(format!("service={}", encode(&s)));
        }
        if let Some(s) = scope {
            q.push(format!("scope={}", encode(&s)));
        }
        let sep = if realm.contains('?') { '&' } else { '?' };
        let url = if q.is_empty() {
            parse_uri(realm)?
        } else {
            parse_uri(&format!("{realm}{sep}{}", q.join("&")))?
        };
        let basic = self.basic();
        let mut url = url;
        let mut resp = None;
        for _ in 0..=MAX_REDIRECTS {
            let r = send(self.connect, &url, None, basic.as_deref()).await?;
            if r.status().is_redirection() {
                if let Some(loc) = r
                    .headers()
                    .get(header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                {
                    url = join(&url, loc)?;
                    continue;
                }
            }
            resp = Some(r);
            break;
        }
        let resp = resp.ok_or_else(|| PullError::Protocol {
            url: url.to_string(),
            problem: "too many redirects".into(),
        })?;
        let status = resp.status();
        let body = read_small(resp, &url).await?;
        if !status.is_success() {
            return Err(PullError::Denied {
                registry: self.authority.clone(),
                answer: format!("{status} {}", error_text(&body)),
            });
        }
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|_| PullError::Protocol {
                url: url.to_string(),
                problem: "the token answer is not JSON".into(),
            })?;
        v.get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .filter(|t| !t.is_empty() && t.len() < 16 * 1024)
            .map(str::to_string)
            .ok_or_else(|| PullError::Protocol {
                url: url.to_string(),
                problem: "the token answer has no token".into(),
            })
    }
}

pub(super) fn parse_uri(s: &str) -> Result<Uri, PullError> {
    let u: Uri = s.parse().map_err(|_| PullError::Protocol {
        url: s.chars().take(200).collect(),
        problem: "not a URL".into(),
    })?;
    match (u.scheme_str(), u.host()) {
        (Some("https" | "http"), Some(_)) => Ok(u),
        _ => Err(PullError::Protocol {
            url: s.chars().take(200).collect(),
            problem: "not an http(s) URL".into(),
        }),
    }
}

/// `loc` (absolute, or a path) relative to `base`.
fn join(base: &Uri, loc: &str) -> Result<Uri, PullError> {
    if loc.starts_with("http://") || loc.starts_with("https://") {
        return parse_uri(loc);
    }
    let scheme = base.scheme_str().unwrap_or("https");
    let auth = base.authority().map(|a| a.as_str()).unwrap_or_default();
    if loc.starts_with('/') {
        parse_uri(&format!("{scheme}://{auth}{loc}"))
    } else {
        Err(PullError::Protocol {
            url: base.to_string(),
            problem: format!("a redirect to {loc:?}"),
        })
    }
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The text of a registry's error body: its first `errors[].message`
/// (and code), or the start of the body.
pub(super) fn error_text(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if let Some(e) = v.get("errors").and_then(|e| e.get(0)) {
            let code = e.get("code").and_then(|c| c.as_str()).unwrap_or_default();
            let msg = e
                .get("message")
                .and_then(|c| c.as_str())
                .unwrap_or_default();
            return format!("{code}: {msg}").chars().take(300).collect();
        }
    }
    String::from_utf8_lossy(body)
        .chars()
        .filter(|c| !c.is_control())
        .take(300)
        .collect()
}

/// A body of at most 64 KiB.
pub(super) async fn read_small(resp: Response<Incoming>, url: &Uri) -> Result<Vec<u8>, PullError> {
    read_limited(resp, url, MAX_SMALL_BODY).await
}

/// A body of at most `max` bytes.
pub(super) async fn read_limited(
    resp: Response<Incoming>,
    url: &Uri,
    max: usize,
) -> Result<Vec<u8>, PullError> {
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| PullError::Transfer {
            url: url.to_string(),
            cause: e.to_string(),
        })?;
        if let Some(d) = frame.data_ref() {
            if out.len() + d.len() > max {
                return Err(PullError::TooBig {
                    what: url.to_string(),
                    limit: max as u64,
                });
            }
            out.extend_from_slice(d);
        }
    }
    Ok(out)
}

/// One GET on a new connection through the egress proxy.
async fn send(
    connect: &Connector<'_>,
    url: &Uri,
    accept: Option<&str>,
    auth: Option<&str>,
) -> Result<Response<Incoming>, PullError> {
    let mut headers = Vec::new();
    if let Some(a) = accept {
        headers.push((header::ACCEPT, a.to_string()));
    }
    if let Some(a) = auth {
        headers.push((header::AUTHORIZATION, a.to_string()));
    }
    send_with(connect, url, Method::GET, &headers, Bytes::new()).await
}

/// One request with `headers` and `body` on a new connection through the
/// egress proxy.
pub(super) async fn send_with(
    connect: &Connector<'_>,
    url: &Uri,
    method: Method,
    headers: &[(header::HeaderName, String)],
    body: Bytes,
) -> Result<Response<Incoming>, PullError> {
    let transfer = |cause: String| PullError::Transfer {
        url: url.to_string(),
        cause,
    };
    let https = url.scheme_str() == Some("https");
    let host_name = url.host().unwrap_or_default().to_string();
    let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
    let authority = url
        .authority()
        .map(|a| a.as_str().to_string())
        .unwrap_or_default();
    let conn = connect().map_err(|e| transfer(e.to_string()))?;
    let mut io = conn.stream;
    let target = if https {
        url.path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into())
    } else {
        url.to_string()
    };
    let mut req = Request::builder()
        .method(method)
        .uri(target)
        .header(header::HOST, &authority)
        .header(header::USER_AGENT, "runtime-image-pull/1");
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| transfer(e.to_string()))?;
    if https {
        let tls = conn
            .tls
            .ok_or_else(|| transfer("this host has no TLS client".into()))?;
        tunnel(&mut io, &host_name, port)
            .await
            .map_err(|e| PullError::Connect {
                host: format!("{host_name}:{port}"),
                answer: e,
            })?;
        let name = rustls::pki_types::ServerName::try_from(host_name.clone())
            .map_err(|e| transfer(e.to_string()))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::clone(&tls))
            .connect(name, io)
            .await
            .map_err(|e| transfer(format!("TLS: {e}")))?;
        request(TokioIo::new(tls), req)
            .await
            .map_err(|e| transfer(e.to_string()))
    } else {
        let resp = request(TokioIo::new(io), req)
            .await
            .map_err(|e| transfer(e.to_string()))?;
        // The proxy's own refusal of the destination.
        if resp.headers().get("x-runtime-egress").is_some() {
            let body = read_small(resp, url).await.unwrap_or_default();
            return Err(PullError::Connect {
                host: format!("{host_name}:{port}"),
                answer: error_text(&body),
            });
        }
        Ok(resp)
    }
}

async fn request<IO>(io: IO, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, String>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "registry connection ended");
        }
    });
    send.send_request(req).await.map_err(|e| e.to_string())
}

/// `CONNECT host:port` through the proxy; `Err` carries its answer.
async fn tunnel(io: &mut tokio::io::DuplexStream, host: &str, port: u16) -> Result<(), String> {
    let head = format!("CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n");
    io.write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if got.len() > MAX_CONNECT_HEAD {
            return Err("the proxy's answer head is too long".into());
        }
        let n = io.read(&mut b).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the proxy closed the connection".into());
        }
        got.push(b[0]);
    }
    let text = String::from_utf8_lossy(&got);
    let status = text.lines().next().unwrap_or_default().to_string();
    if status.split_whitespace().nth(1) == Some("200") {
        return Ok(());
    }
    // The proxy says why in a header or a short body; the status line is
    // the gist.
    let why = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("X-Runtime-Egress: ")
                .or_else(|| l.strip_prefix("x-runtime-egress: "))
        })
        .map(|w| format!(" ({w})"))
        .unwrap_or_default();
    Err(format!("{status}{why}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn redirects_join_and_queries_encode() {
        let base: Uri = "https://r.example.com/v2/x/blobs/sha256:1".parse().unwrap();
        assert_eq!(
            join(&base, "/blob?a=1").unwrap().to_string(),
            "https://r.example.com/blob?a=1"
        );
        assert_eq!(
            join(&base, "https://cdn.example.net/b")
                .unwrap()
                .to_string(),
            "https://cdn.example.net/b"
        );
        assert!(join(&base, "ftp://x").is_err());
        assert!(join(&base, "relative").is_err());
        assert_eq!(encode("repository:a/b:pull"), "repository%3Aa%2Fb%3Apull");
    }

    #[test]
    fn registry_errors_read_their_first_message() {
        assert_eq!(
            error_text(br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown","detail":{}}]}"#),
            "MANIFEST_UNKNOWN: manifest unknown"
        );
        assert_eq!(error_text(b"not found\n"), "not found");
    }
}
