//! `http://runtime.internal`: the API as code inside a sandbox reaches it.
//! The host's egress proxy judges the name by the sandbox's rules, bounds
//! how many connections it has open, and hands each connection here naming
//! the sandbox it comes from (`runtime_egress::InternalApi`). Each request
//! then goes through the same router as the listener's, so it meets the
//! same auth, roles, request ids and errors; its peer is the sandbox
//! ([`SANDBOX_PEER`], never loopback), its `Host` is `runtime.internal`
//! whatever the guest wrote (so no preview is reached this way). Only
//! `/v1/…` and the MCP paths are served; `GET /v1/environment` answers the
//! sandbox's environment file without a key (it holds nothing secret).

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::DuplexStream;
use tower::ServiceExt;
use tracing::Instrument;

use crate::error::ApiError;
use crate::http::serve::Peer;

/// The peer every request from a sandbox has: the guest's own address on
/// its dummy interface (RFC 2544's range), which is not loopback, so
/// nothing that trusts this machine's loopback trusts a sandbox.
pub(crate) const SANDBOX_PEER: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 1), 0));

/// The server's side of `runtime.internal`.
pub(crate) struct InSandboxApi {
    app: axum::Router,
    header_read: Duration,
}

impl InSandboxApi {
    pub(crate) fn new(app: axum::Router, header_read: Duration) -> Self {
        Self { app, header_read }
    }
}

impl runtime_egress::InternalApi for InSandboxApi {
    fn serve(&self, sandbox_id: &str, stream: DuplexStream) {
        let app = self.app.clone();
        let id: Arc<str> = sandbox_id.into();
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (app, id) = (app.clone(), id.clone());
                async move { Ok::<_, Infallible>(answer(app, id, req).await) }
            });
            if let Err(e) = builder
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades()
                .await
            {
                tracing::debug!(error = %e, "a connection to runtime.internal ended with an error");
            }
        });
    }
}

/// Whether `path` is served at `runtime.internal`.
pub(crate) fn served(path: &str) -> bool {
    path.starts_with("/v1/") || crate::http::mcp::is_mcp_path(path)
}

async fn answer(app: axum::Router, sandbox_id: Arc<str>, req: Request<Incoming>) -> Response {
    let path = req.uri().path();
    if path == "/v1/environment" && req.method() == Method::GET {
        let mut resp = (
            StatusCode::OK,
            axum::Json(runtime_host::guest_environment(&sandbox_id)),
        )
            .into_response();
        resp.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        return resp;
    }
    if !served(path) {
        let rid = format!("req_{}", uuid::Uuid::new_v4().simple());
        let e = ApiError::RouteNotFound {
            method: req.method().to_string(),
            path: path.to_string(),
        };
        let mut resp = e.into_response_with(&rid);
        if let Ok(v) = HeaderValue::from_str(&rid) {
            resp.headers_mut().insert("x-request-id", v);
        }
        return resp;
    }
    let (mut parts, body) = req.into_parts();
    parts.headers.insert(
        header::HOST,
        HeaderValue::from_static(runtime_egress::API_HOST),
    );
    parts.extensions.insert(Peer(SANDBOX_PEER));
    let req = Request::from_parts(parts, Body::new(body));
    let span = tracing::info_span!("in_sandbox", sandbox_id = %sandbox_id);
    match app.oneshot(req).instrument(span).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_api_and_mcp_are_served() {
        assert!(served("/v1/me"));
        assert!(served("/v1/sandboxes/x/exec"));
        assert!(served("/mcp"));
        for p in ["/", "/login/abc", "/v1", "/console", "/f/token", "/x/v1/me"] {
            assert!(!served(p), "{p}");
        }
    }

    #[test]
    fn the_sandbox_is_never_loopback() {
        assert!(!Peer(SANDBOX_PEER).is_loopback());
    }
}
