//! The HTTP edge, the only layer that names axum: request ids, auth, the
//! read-only gate, bodies, idempotency and late answers around every
//! request; the route table in [`route`]; the handlers under [`routes`];
//! errors to answers in `error.rs`.

mod console;
mod error;
pub(crate) mod extract;
pub(crate) mod forward;
pub(crate) mod idempotency;
pub(crate) mod internal;
pub(crate) mod links;
pub(crate) mod login;
pub(crate) mod mcp;
mod preview_proxy;
pub(crate) mod reply;
pub(crate) mod route;
pub(crate) mod routes;
pub(crate) mod serve;
mod telemetry;
pub(crate) mod tls;
pub(crate) mod ws;

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tracing::Instrument;

use axum::extract::FromRequestParts;

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::session::{is_session_token, Session};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::parse_query;
use crate::http::route::{
    body_limit, carries_secret, operation, reveals_contents, route, session_sandbox, Route,
};
use crate::AppState;

/// What a handler answers.
pub(crate) enum Reply {
    /// A JSON answer; stored for idempotent replay when 2xx.
    Json(StatusCode, Value),
    /// A JSON answer holding a token or secret shown this once: `replay`,
    /// the answer without it, is what is stored for an idempotent replay.
    ShownOnce {
        status: StatusCode,
        body: Value,
        replay: Value,
    },
    /// Raw bytes or other non-JSON answers (never stored).
    Raw(Response),
    /// An NDJSON stream; `replay` names the process a duplicate follows.
    Stream { response: Response, replay: Value },
}

impl Reply {
    pub(crate) fn ok(v: Value) -> ApiResult<Reply> {
        Ok(Reply::Json(StatusCode::OK, v))
    }

    /// `record` answered with `field` set to `secret`; a replay answers
    /// `record` alone, with `marker: true` beside it when one is named.
    pub(crate) fn shown_once(
        status: StatusCode,
        record: Value,
        field: &str,
        secret: String,
        marker: Option<&str>,
    ) -> Reply {
        let mut body = record.clone();
        body[field] = Value::String(secret);
        let mut replay = record;
        if let Some(m) = marker {
            replay[m] = Value::Bool(true);
        }
        Reply::ShownOnce {
            status,
            body,
            replay,
        }
    }

    pub(crate) fn into_response(self) -> Response {
        match self {
            Reply::Json(status, v)
            | Reply::ShownOnce {
                status, body: v, ..
            } => (status, axum::Json(v)).into_response(),
            Reply::Raw(r) => r,
            Reply::Stream { response, .. } => response,
        }
    }
}

/// Who asks, and the parts of the request every handler may need.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub key: KeyInfo,
    pub headers: HeaderMap,
    pub query: Vec<(String, String)>,
    /// The request's idempotency key and fingerprint, when it has one.
    pub idem: Option<idempotency::Request>,
}

pub(crate) fn router(state: AppState) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(state)
}

async fn handle(State(st): State<AppState>, req: Request) -> Response {
    // Another control plane's sandbox: its node answers.
    let req = match forward::route(&st, req).await {
        Ok(req) => req,
        Err(answer) => return answer,
    };
    if let Some((port, sandbox)) = preview_proxy::target(&st, req.headers()) {
        let span = tracing::info_span!("preview", sandbox_id = %sandbox, port);
        return preview_proxy::serve(st, req, port, sandbox)
            .instrument(span)
            .await;
    }
    let arrived = std::time::Instant::now();
    let rid = format!("req_{}", uuid::Uuid::new_v4().simple());
    // Set once a session's request from one of its pages is let in.
    let mut cors: Option<String> = None;
    // Set once the caller is known: whose answer it is, and to what.
    let mut counted: Option<(String, String)> = None;
    let span = tracing::info_span!("request", request_id = %rid, method = %req.method(), path = %req.uri().path());
    let mut resp = async {
        let result = if mcp::is_mcp_path(req.uri().path()) {
            mcp::handle(&st, req, &rid).await
        } else if console::is_console_path(req.uri().path()) {
            console::handle(req.method(), req.uri().path(), req.headers())
        } else if login::is_login_path(req.uri().path()) {
            login::handle(&st, req).await
        } else if req.uri().path() == telemetry::PATH {
            telemetry::handle(&st, req).await
        } else if let Some(token) = links::token_of(req.uri().path()).map(str::to_string) {
            links::handle(&st, req, &token).await
        } else if req.method() == Method::OPTIONS {
            preflight(&st, req.headers())
        } else {
            serve(&st, req, &rid, &mut cors, &mut counted).await
        };
        let (resp, code) = match result {
            Ok(r) => (r, None),
            Err(e) => {
                tracing::debug!(error = %e, "request refused");
                let code = e.code();
                (e.into_response_with(&rid), Some(code))
            }
        };
        let took = arrived.elapsed();
        st.inner
            .telemetry
            .answered(resp.status().as_u16(), took, code);
        if let Some((key_id, operation)) = counted.take() {
            st.inner
                .requests
                .record(st.now_ms(), &key_id, operation, resp.status().as_u16());
        }
        tracing::debug!(
            status = resp.status().as_u16(),
            ms = took.as_secs_f64() * 1e3,
            "answered"
        );
        resp
    }
    .instrument(span)
    .await;
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    if let Some(origin) = &cors {
        allow_origin(&mut resp, origin);
    }
    resp
}

/// Who a request comes from: an API key, or a session acting for one
/// sandbox with the key that made it.
pub(crate) struct Caller {
    pub(crate) key: KeyInfo,
    pub(crate) session: Option<Session>,
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// The WebSocket subprotocol a page offers with the terminal, and the one
/// that carries its session token: a browser cannot set `Authorization` on
/// a WebSocket, and a URL would put the token in logs and history.
pub(crate) const TERMINAL_PROTOCOL: &str = "runtime-terminal";
const SESSION_PROTOCOL_PREFIX: &str = "runtime-session.";

/// A session token offered as a WebSocket subprotocol
/// (`Sec-WebSocket-Protocol: runtime-terminal, runtime-session.rtsess_…`).
/// Only a session token (short-lived, one sandbox, its page's origin
/// checked) is taken there, never an API key.
fn subprotocol_session(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|p| p.trim().strip_prefix(SESSION_PROTOCOL_PREFIX))
        .find(|t| is_session_token(t))
}

pub(crate) fn authenticate(st: &AppState, headers: &HeaderMap) -> ApiResult<Caller> {
    let token = bearer(headers)
        .or_else(|| subprotocol_session(headers))
        .ok_or(ApiError::Unauthorized)?;
    if is_session_token(token) {
        let (session, key) = crate::service::sessions::authenticate(st, token)?;
        return Ok(Caller {
            key,
            session: Some(session),
        });
    }
    let key = st
        .store()
        .find_key(&sha256_hex(token.as_bytes()))?
        .ok_or(ApiError::Unauthorized)?;
    Ok(Caller { key, session: None })
}

fn origin_of(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::ORIGIN)
        .and_then(|v| v.to_str().ok())
}

/// A session may use only its own sandbox's insides, and only from the
/// pages it names (a request without `Origin` is a backend's).
fn check_session(session: &Session, r: &Route, origin: Option<&str>) -> ApiResult<()> {
    match session_sandbox(r) {
        Some(id) if id == session.sandbox_id => {}
        Some(_) => {
            return Err(ApiError::SessionScope {
                action: "reach another sandbox",
            })
        }
        None => {
            return Err(ApiError::SessionScope {
                action: "change, manage or create anything, or reach beyond its sandbox",
            })
        }
    }
    match origin {
        Some(o) if !session.allows_origin(Some(o)) => Err(ApiError::OriginNotAllowed {
            origin: o.to_string(),
        }),
        _ => Ok(()),
    }
}

/// The headers that let a page at `origin` read an answer.
fn allow_origin(resp: &mut Response, origin: &str) {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(origin) {
        h.insert("access-control-allow-origin", v);
    }
    h.insert("vary", HeaderValue::from_static("Origin"));
    h.insert(
        "access-control-expose-headers",
        HeaderValue::from_static(
            "x-request-id, x-content-length, x-content-sha256, idempotency-replayed, runtime-late-answer",
        ),
    );
}

/// A CORS preflight (it carries no token): allowed for an origin some live
/// session names, refused otherwise.
fn preflight(st: &AppState, headers: &HeaderMap) -> ApiResult<Response> {
    let origin = origin_of(headers).ok_or_else(|| {
        ApiError::invalid("Origin", "a preflight (OPTIONS) names the page's origin")
    })?;
    if !crate::service::sessions::origin_in_use(st, origin)? {
        return Err(ApiError::OriginNotAllowed {
            origin: origin.to_string(),
        });
    }
    let mut resp = StatusCode::NO_CONTENT.into_response();
    allow_origin(&mut resp, origin);
    let h = resp.headers_mut();
    h.insert(
        "access-control-allow-methods",
        HeaderValue::from_static("GET, POST, PUT, DELETE"),
    );
    h.insert(
        "access-control-allow-headers",
        HeaderValue::from_static(
            "authorization, content-type, accept, idempotency-key, prefer, x-content-sha256",
        ),
    );
    h.insert("access-control-max-age", HeaderValue::from_static("600"));
    Ok(resp)
}

pub(crate) async fn read_body(body: Body, limit: usize) -> ApiResult<Bytes> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        // axum wraps http-body-util's LengthLimitError; any other failure is a
        // client that hung up mid-body, and then nobody reads the answer.
        tracing::debug!(error = %e, "reading the body failed");
        ApiError::PayloadTooLarge { limit }
    })
}

async fn serve(
    st: &AppState,
    req: Request,
    rid: &str,
    cors: &mut Option<String>,
    counted: &mut Option<(String, String)>,
) -> ApiResult<Response> {
    let (mut parts, body) = req.into_parts();
    let caller = authenticate(st, &parts.headers)?;
    *counted = Some((caller.key.id.clone(), "unknown".to_string()));
    let r = route(&parts.method, parts.uri.path())?;
    *counted = Some((caller.key.id.clone(), operation(&r)));
    if let Some(session) = &caller.session {
        let origin = origin_of(&parts.headers);
        check_session(session, &r, origin)?;
        *cors = origin.map(str::to_string);
    }
    let key = caller.key;
    if let Route::Terminal(id) | Route::Tunnel(id) = &r {
        // Both type into the sandbox: a change, whatever the method.
        if key.read_only {
            return Err(ApiError::Forbidden {
                action: "open terminals or tunnels",
            });
        }
        let upgrade = axum::extract::ws::WebSocketUpgrade::from_request_parts(&mut parts, st)
            .await
            .map_err(|_| {
                ApiError::invalid(
                    "Upgrade",
                    "this route is a WebSocket: send an Upgrade: websocket request",
                )
            })?
            .protocols([TERMINAL_PROTOCOL]);
        let query = parse_query(parts.uri.query())?;
        return match &r {
            Route::Terminal(_) => ws::terminal(st.clone(), key, id.clone(), query, upgrade).await,
            _ => ws::tunnel(st.clone(), key, id.clone(), upgrade).await,
        };
    }
    if parts.method != Method::GET && key.read_only {
        return Err(ApiError::Forbidden {
            action: "make changes",
        });
    }
    if key.read_only && reveals_contents(&r) {
        return Err(ApiError::Forbidden {
            action: "read files or process output",
        });
    }
    let query = parse_query(parts.uri.query())?;
    let bytes = if parts.method == Method::GET {
        Bytes::new()
    } else {
        read_body(body, body_limit(&r)).await?
    };
    let idem = match parts.headers.get("idempotency-key") {
        Some(v) if parts.method != Method::GET => {
            let k = v
                .to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key", "must be ASCII"))?;
            if !valid_idempotency_key(k) {
                return Err(ApiError::invalid(
                    "Idempotency-Key",
                    "must be 1-128 of [A-Za-z0-9_.:-], starting with a letter or digit",
                ));
            }
            let mut fp = Vec::new();
            fp.extend_from_slice(parts.method.as_str().as_bytes());
            fp.push(b' ');
            fp.extend_from_slice(parts.uri.path().as_bytes());
            fp.push(b'?');
            fp.extend_from_slice(parts.uri.query().unwrap_or("").as_bytes());
            fp.push(b'\n');
            fp.extend_from_slice(&bytes);
            // A body that carries a secret is fingerprinted with a key of
            // the server's, so the stored fingerprint cannot be used to
            // test guesses of the secret.
            let fingerprint = if carries_secret(&r) {
                st.sealer()?.keyed_digest(&fp)
            } else {
                sha256_hex(&fp)
            };
            Some(idempotency::Request {
                idem_key: k.to_string(),
                fingerprint,
                carried: parts.headers.contains_key(forward::FORWARDED_BY),
            })
        }
        _ => None,
    };
    let ctx = Ctx {
        key,
        headers: parts.headers.clone(),
        query,
        idem: idem.clone(),
    };

    let is_get = parts.method == Method::GET;
    let key_id = ctx.key.id.clone();
    let st2 = st.clone();
    let work = async move { routes::dispatch(st2, ctx, r, bytes).await };
    if is_get {
        // Reads run in the request's task; a hang-up simply ends them.
        return Ok(work.await?.into_response());
    }
    idempotency::execute(st, &key_id, idem, work, rid).await
}

/// A body that sends nothing until `fut` resolves, then its bytes.
pub(crate) fn deferred_body<F>(fut: F) -> Body
where
    F: std::future::Future<Output = Bytes> + Send + 'static,
{
    Body::from_stream(futures::stream::once(async move {
        Ok::<_, Infallible>(fut.await)
    }))
}

pub(crate) fn json_bytes(v: &impl serde::Serialize) -> Bytes {
    Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

/// A sandbox record as answered, with `extra` fields beside its own.
pub(crate) fn record_json(s: &runtime_api::Sandbox, extra: &[(&str, Value)]) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        for (k, x) in extra {
            m.insert((*k).to_string(), x.clone());
        }
    }
    v
}

fn valid_idempotency_key(k: &str) -> bool {
    (1..=128).contains(&k.len())
        && k.as_bytes()[0].is_ascii_alphanumeric()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_key_shape() {
        assert!(valid_idempotency_key("a1:b.c-d_e"));
        assert!(!valid_idempotency_key("-a"));
        assert!(!valid_idempotency_key(""));
        assert!(!valid_idempotency_key(&"a".repeat(129)));
    }
}
