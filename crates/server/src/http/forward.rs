//! Several control planes on one store: a request about a sandbox whose
//! machines another control plane (node) runs is carried to that node as it
//! came (method, path, headers with the caller's key, body streamed both
//! ways, WebSocket and other upgrades passed through), and its answer is the
//! caller's. The node checks the key again against the shared store, so no
//! trust passes between control planes. Only PostgreSQL stores are shared;
//! on SQLite nothing is looked up.
//!
//! A sandbox is named by the path (`/v1/sandboxes/{id}[:verb][/...]`) or by
//! a preview's host (`<port>-<id>.<preview domain>`). Creates stay on the
//! node they reach; forks, snapshots and everything else about a sandbox go
//! to its node.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::error::ApiError;
use crate::store::NodeRow;
use crate::AppState;

/// Set on a carried request: the node that carried it. A node never
/// carries such a request again (no loops).
pub(crate) const FORWARDED_BY: &str = "x-runtime-forwarded-by";

/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The most sandboxes whose node is remembered; past it the memory starts
/// over (a sandbox never changes node, so an entry is never stale).
const OWNERS_MAX: usize = 100_000;

/// Which node runs each sandbox asked about.
#[derive(Default)]
pub(crate) struct Owners(Mutex<HashMap<String, String>>);

impl Owners {
    fn get(&self, id: &str) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    fn put(&self, id: &str, node: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= OWNERS_MAX {
            m.clear();
        }
        m.insert(id.to_string(), node.to_string());
    }
}

/// The sandbox an API path is about: `/v1/sandboxes/{id}`, with or without
/// a `:verb` or a sub-path.
pub(crate) fn sandbox_in_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let seg = rest.split('/').next()?;
    let id = seg.split(':').next()?;
    (!id.is_empty()).then_some(id)
}

/// Serves `req` here (`Ok`), or answers it from the node that runs its
/// sandbox (`Err`: the peer's answer, or why it could not be had).
pub(crate) async fn route(st: &AppState, req: Request) -> Result<Request, Response> {
    if !st.store().shared() || req.headers().contains_key(FORWARDED_BY) {
        return Ok(req);
    }
    let sandbox = match super::preview_proxy::target(st, req.headers()) {
        Some((_, id)) => id,
        None => match sandbox_in_path(req.uri().path()) {
            Some(id) => id.to_string(),
            // A file link is used without a key: its sandbox is the link's.
            None => match super::links::token_of(req.uri().path()).map(|t| {
                st.store()
                    .find_link(&crate::domain::access::sha256_hex(t.as_bytes()))
            }) {
                Some(Ok(Some(link))) => link.sandbox_id,
                // No link (answered 404 here), or not a link's path.
                _ => return Ok(req),
            },
        },
    };
    let me = st.store().node();
    let node = match st.inner.owners.get(&sandbox) {
        Some(n) => n,
        None => match st.store().sandbox_node(&sandbox) {
            Ok(Some(n)) => {
                st.inner.owners.put(&sandbox, &n);
                n
            }
            // Unknown here: answered (404) here. A store error too.
            Ok(None) | Err(_) => return Ok(req),
        },
    };
    if node == me || node.is_empty() {
        return Ok(req);
    }
    let peer = match st.store().get_node(&node) {
        Ok(Some(peer)) => peer,
        Ok(None) | Err(_) => {
            return Err(unreachable(&node, "is not known to the store".into())
                .into_response_with("forward"))
        }
    };
    // Its node is held lost: its record (stopped) is read, and the sandbox
    // deleted, here; the rest needs its machine or its disk there.
    if peer.lost_ms != 0 && answered_without_node(req.method(), req.uri().path()) {
        return Ok(req);
    }
    Err(carry_to(st, &peer, req)
        .await
        .unwrap_or_else(|e| e.into_response_with("forward")))
}

/// What of a lost node's sandbox another node answers: reading its record
/// and deleting it (`GET` and `DELETE /v1/sandboxes/{id}`).
fn answered_without_node(method: &axum::http::Method, path: &str) -> bool {
    let whole = sandbox_in_path(path).is_some_and(|id| path == format!("/v1/sandboxes/{id}"));
    whole && (method == axum::http::Method::GET || method == axum::http::Method::DELETE)
}

fn unreachable(node: &str, why: String) -> ApiError {
    ApiError::NodeUnreachable {
        node: node.to_string(),
        message: format!("The control plane that runs this sandbox ({node}) {why}; try again."),
    }
}

/// Carries a request already read here (a create whose image or snapshot
/// is on `node`) to `node`: its method, `path` with the query it came
/// with, its headers and body.
pub(crate) async fn carry_parts(
    st: &AppState,
    node: &str,
    method: axum::http::Method,
    path: &str,
    ctx: &super::Ctx,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    carry(st, node, rebuilt(method, path, ctx, body)?).await
}

/// Carries a create already read here to the first of `peers` that
/// accepts a connection (placement's ranking); `None` when none did, so
/// nothing was sent anywhere.
pub(crate) async fn carry_to_first(
    st: &AppState,
    peers: &[NodeRow],
    path: &str,
    ctx: &super::Ctx,
    body: bytes::Bytes,
) -> Result<Option<Response>, ApiError> {
    for peer in peers {
        match connect(peer).await {
            Ok(sender) => {
                let req = rebuilt(axum::http::Method::POST, path, ctx, body)?;
                return send(st, &peer.id, sender, req).await.map(Some);
            }
            Err(e) => {
                tracing::warn!(node = %peer.id, error = %e, "a node placed on did not answer: trying the next")
            }
        }
    }
    Ok(None)
}

/// A request read here, as it came: method, `path` with its query,
/// headers and body.
fn rebuilt(
    method: axum::http::Method,
    path: &str,
    ctx: &super::Ctx,
    body: bytes::Bytes,
) -> Result<Request, ApiError> {
    let mut uri = path.to_string();
    for (i, (k, v)) in ctx.query.iter().enumerate() {
        uri.push(if i == 0 { '?' } else { '&' });
        uri.push_str(&query_escape(k));
        uri.push('=');
        uri.push_str(&query_escape(v));
    }
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = method;
    *req.uri_mut() = uri.parse().map_err(|e| ApiError::Internal {
        what: format!("carrying {uri}: {e}"),
    })?;
    *req.headers_mut() = ctx.headers.clone();
    Ok(req)
}

/// `s` percent-encoded for a query (all but RFC 3986's unreserved).
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Carries `req` to `node` and brings its answer back.
async fn carry(st: &AppState, node: &str, req: Request) -> Result<Response, ApiError> {
    let peer = st
        .store()
        .get_node(node)
        .ok()
        .flatten()
        .ok_or_else(|| unreachable(node, "is not known to the store".into()))?;
    carry_to(st, &peer, req).await
}

/// Carries `req` to `peer` and brings its answer back.
async fn carry_to(st: &AppState, peer: &NodeRow, req: Request) -> Result<Response, ApiError> {
    let sender = connect(peer).await?;
    send(st, &peer.id, sender, req).await
}

/// An HTTP/1 connection to `peer`, or why none could be had (then nothing
/// was sent to it).
async fn connect(
    peer: &NodeRow,
) -> Result<hyper::client::conn::http1::SendRequest<Body>, ApiError> {
    let node = peer.id.as_str();
    let unreachable = |why: String| unreachable(node, why);
    let authority = peer
        .url
        .strip_prefix("http://")
        .map(|a| a.trim_end_matches('/'))
        .ok_or_else(|| {
            unreachable(format!(
                "has the URL {}, which is not plain http:// (carrying over TLS is not supported yet)",
                peer.url
            ))
        })?
        .to_string();
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&authority))
        .await
        .map_err(|_| {
            unreachable(format!(
                "did not accept a connection at {authority} within 5 s"
            ))
        })?
        .map_err(|e| unreachable(format!("refused a connection at {authority}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(tcp))
        .await
        .map_err(|e| unreachable(format!("did not speak HTTP: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

/// Sends `req` on a connection to node `node` and brings its answer back,
/// an upgrade passed through both ways.
async fn send(
    st: &AppState,
    node: &str,
    mut sender: hyper::client::conn::http1::SendRequest<Body>,
    mut req: Request,
) -> Result<Response, ApiError> {
    if let Ok(v) = HeaderValue::from_str(st.store().node()) {
        req.headers_mut().insert(FORWARDED_BY, v);
    }
    let upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let mut resp = sender
        .send_request(req)
        .await
        .map_err(|e| unreachable(node, format!("closed the connection: {e}")))?;
    if let Some(caller_side) = upgrade {
        splice_upgrade(caller_side, &mut resp, None, ());
    }
    *resp.version_mut() = axum::http::Version::HTTP_11;
    Ok(resp.map(Body::new))
}

/// When `resp` switches protocols: once the caller's side (`caller`) and
/// the answering side are both upgraded, passes bytes both ways until
/// either ends or `cut` fires, holding `hold` (a slot, say) as long.
pub(crate) fn splice_upgrade<T: Send + 'static>(
    caller: hyper::upgrade::OnUpgrade,
    resp: &mut hyper::Response<hyper::body::Incoming>,
    cut: Option<tokio_util::sync::CancellationToken>,
    hold: T,
) {
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let other = hyper::upgrade::on(resp);
    tokio::spawn(async move {
        let _hold = hold;
        let (Ok(c), Ok(o)) = (caller.await, other.await) else {
            return;
        };
        let mut c = TokioIo::new(c);
        let mut o = TokioIo::new(o);
        let cut = cut.unwrap_or_default();
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut c, &mut o) => {}
            _ = cut.cancelled() => {}
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_is_read_from_every_form_of_its_path() {
        assert_eq!(sandbox_in_path("/v1/sandboxes/sbx_1"), Some("sbx_1"));
        assert_eq!(sandbox_in_path("/v1/sandboxes/sbx_1:fork"), Some("sbx_1"));
        assert_eq!(
            sandbox_in_path("/v1/sandboxes/sbx_1/processes/p/stream"),
            Some("sbx_1")
        );
        assert_eq!(sandbox_in_path("/v1/sandboxes"), None);
        assert_eq!(sandbox_in_path("/v1/sandboxes/"), None);
        assert_eq!(sandbox_in_path("/v1/sandboxes/:fork"), None);
        assert_eq!(sandbox_in_path("/v1/images/img_1"), None);
        assert_eq!(query_escape("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn owners_are_remembered_and_bounded() {
        let o = Owners::default();
        o.put("a", "n1");
        assert_eq!(o.get("a").as_deref(), Some("n1"));
        for i in 0..OWNERS_MAX {
            o.put(&format!("s{i}"), "n2");
        }
        assert!(o.0.lock().unwrap().len() <= OWNERS_MAX);
    }
}
