//! Previews: a port of a sandbox served at
//! `http://<port>-<sandbox>.<preview domain>:<server port>/`, tunnelled over
//! the agent channel to the guest's `127.0.0.1:<port>`.
//!
//! A private preview needs a token, as the header `x-runtime-preview-token`,
//! the query parameter `runtime_preview_token` (which also sets a cookie for
//! the rest of the page's requests) or that cookie. Tokens are MACs of their
//! expiry under the preview's own secret: every read of a private preview
//! mints a fresh one, all stay good until they expire, and `:rotate`
//! replaces the secret, which refuses every earlier token and closes the
//! connections opened with them.

use std::collections::HashMap;
use std::sync::Mutex;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use hyper_util::rt::TokioIo;
use rand::RngCore;
use serde_json::{json, Value};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;

use crate::domain::access::KeyInfo;
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::service::sandboxes::{find, find_running};
use crate::AppState;

const KIND: &str = "preview";
const TOKEN_HEADER: &str = "x-runtime-preview-token";
const TOKEN_PARAM: &str = "runtime_preview_token";
const COOKIE: &str = "runtime_preview_token";
/// A token lasts a day unless asked otherwise (the docs' default).
const DEFAULT_TTL_S: i64 = 86_400;
const MAX_TTL_S: i64 = 30 * 86_400;

/// Connections served per preview, closed when it is rotated, made private
/// or deleted.
#[derive(Default)]
pub struct Live {
    cancels: Mutex<HashMap<(String, u16), CancellationToken>>,
}

impl Live {
    fn token(&self, sandbox: &str, port: u16) -> CancellationToken {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        m.entry((sandbox.to_string(), port)).or_default().clone()
    }

    /// Closes what was opened so far.
    fn cut(&self, sandbox: &str, port: u16) {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = m.remove(&(sandbox.to_string(), port)) {
            t.cancel();
        }
    }

    pub fn sandbox_gone(&self, sandbox: &str) {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|(s, _), t| {
            if s == sandbox {
                t.cancel();
            }
            s != sandbox
        });
    }
}

/// A preview as stored (`secret` never leaves the server).
struct Stored {
    id: String,
    port: u16,
    public: bool,
    secret: Vec<u8>,
    /// The token lifetime asked for at create, and the cap.
    ttl_s: i64,
    expires_cap_ms: Option<i64>,
    embed_origins: Vec<String>,
    created_ms: i64,
}

impl Stored {
    fn to_doc(&self) -> Value {
        json!({
            "id": self.id,
            "port": self.port,
            "public": self.public,
            "secret": hex::encode(&self.secret),
            "ttlS": self.ttl_s,
            "expiresCapMs": self.expires_cap_ms,
            "embedOrigins": self.embed_origins,
            "createdMs": self.created_ms,
        })
    }

    fn from_doc(v: &Value) -> Option<Stored> {
        Some(Stored {
            id: v["id"].as_str()?.to_string(),
            port: u16::try_from(v["port"].as_u64()?).ok()?,
            public: v["public"].as_bool()?,
            secret: hex::decode(v["secret"].as_str()?).ok()?,
            ttl_s: v["ttlS"].as_i64()?,
            expires_cap_ms: v["expiresCapMs"].as_i64(),
            embed_origins: v["embedOrigins"]
                .as_array()?
                .iter()
                .filter_map(|o| o.as_str().map(String::from))
                .collect(),
            created_ms: v["createdMs"].as_i64()?,
        })
    }

    fn mac(&self, expiry_s: i64) -> String {
        // Any key length is accepted by HMAC.
        let mut m = match Hmac::<Sha256>::new_from_slice(&self.secret) {
            Ok(m) => m,
            Err(_) => return String::new(),
        };
        m.update(format!("{}:{expiry_s}", self.port).as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
    }

    fn mint(&self, ttl_s: Option<i64>, cap_ms: Option<i64>) -> (String, i64) {
        let mut expiry_ms = now_ms() + ttl_s.unwrap_or(self.ttl_s) * 1000;
        for cap in [self.expires_cap_ms, cap_ms].into_iter().flatten() {
            expiry_ms = expiry_ms.min(cap);
        }
        let expiry_s = expiry_ms / 1000;
        (
            format!("{expiry_s}.{}", self.mac(expiry_s)),
            expiry_s * 1000,
        )
    }

    fn check(&self, token: &str) -> bool {
        let Some((exp, mac)) = token.split_once('.') else {
            return false;
        };
        let Ok(expiry_s) = exp.parse::<i64>() else {
            return false;
        };
        if expiry_s * 1000 <= now_ms() {
            return false;
        }
        let want = self.mac(expiry_s);
        // Constant time over the MAC's bytes.
        want.len() == mac.len()
            && want
                .bytes()
                .zip(mac.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

fn base_url(st: &AppState, sandbox: &str, port: u16) -> String {
    let c = st.config();
    let host = format!("{port}-{sandbox}.{}", c.preview_domain);
    let (scheme, default_port) = if c.tls.is_some() {
        ("https", 443)
    } else {
        ("http", 80)
    };
    match c.preview_port {
        0 => format!("{scheme}://{host}/"),
        p if p == default_port => format!("{scheme}://{host}/"),
        p => format!("{scheme}://{host}:{p}/"),
    }
}

fn answer(
    st: &AppState,
    sandbox: &str,
    p: &Stored,
    ttl_s: Option<i64>,
    cap_ms: Option<i64>,
) -> Value {
    let url = base_url(st, sandbox, p.port);
    let (token, expires) = if p.public {
        (Value::Null, Value::Null)
    } else {
        let (t, e) = p.mint(ttl_s, cap_ms);
        (json!(t), json!(iso(e)))
    };
    let with_token = match token.as_str() {
        Some(t) => format!("{url}?{TOKEN_PARAM}={t}"),
        None => url.clone(),
    };
    json!({
        "id": p.id,
        "sandboxId": sandbox,
        "port": p.port,
        "visibility": if p.public { "public" } else { "private" },
        "url": url,
        "token": token,
        "tokenExpiresAt": expires,
        "urlWithToken": with_token,
        "disabled": false,
        "embedOrigins": p.embed_origins,
        "createdAt": iso(p.created_ms),
    })
}

fn load(st: &AppState, sandbox: &str, port: u16) -> ApiResult<Option<Stored>> {
    Ok(st
        .store()
        .doc_get(KIND, sandbox, &port.to_string())?
        .as_ref()
        .and_then(Stored::from_doc))
}

fn not_found(sandbox: &str, port: u16) -> ApiError {
    ApiError::NotFound {
        code: "preview_not_found",
        what: "preview of port",
        id: format!("{port} of sandbox {sandbox}"),
    }
}

fn port_of(s: &str) -> ApiResult<u16> {
    s.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::invalid("port", "must be 1 to 65535"))
}

/// An origin for `embedOrigins`: `http(s)://host[:port]`, the host may start with `*.`.
fn valid_origin(o: &str) -> bool {
    let Some(rest) = o
        .strip_prefix("https://")
        .or_else(|| o.strip_prefix("http://"))
    else {
        return false;
    };
    let host = rest.split(':').next().unwrap_or("");
    let host = host.strip_prefix("*.").unwrap_or(host);
    !host.is_empty()
        && !rest.contains('/')
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// `POST …/previews`: shares a port, or changes how it is shared.
pub async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let port = f.int("port", 1, 65535).map(|p| p as u16);
    if !f.present("port") {
        f.issue("port", "is required");
    }
    let visibility = f.one_of("visibility", &["private", "public"]);
    let ttl = f.int("ttlSeconds", 60, MAX_TTL_S);
    let expires = f.string("expiresAt");
    let mut cap_ms = None;
    if let Some(e) = &expires {
        match parse_iso_ms(e) {
            Some(ms) if ms > now_ms() => cap_ms = Some(ms),
            Some(_) => f.issue("expiresAt", "must be in the future"),
            None => f.issue("expiresAt", "must be an ISO 8601 time"),
        }
    }
    let origins = match f.raw("embedOrigins") {
        None => None,
        Some(Value::Array(a)) => {
            let list: Vec<String> = a
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            if list.len() != a.len() || list.len() > 16 {
                f.issue("embedOrigins", "must be at most 16 origins (strings)");
            }
            for (i, o) in list.iter().enumerate() {
                if !valid_origin(o) {
                    f.issue(
                        &format!("embedOrigins[{i}]"),
                        "must be an origin such as https://app.example.com or https://*.example.com",
                    );
                }
            }
            Some(list)
        }
        Some(_) => {
            f.issue("embedOrigins", "must be an array of origins");
            None
        }
    };
    f.finish()?;
    let port = port.unwrap_or(0);
    let row = find(&st, &ctx.key, &id)?;
    if row.record.state == crate::domain::lifecycle::SandboxState::Stopped {
        return Err(ApiError::NotRunning {
            id,
            state: row.record.state,
        });
    }
    let existing = load(&st, &id, port)?;
    let created = existing.is_none();
    let mut p = existing.unwrap_or_else(|| {
        let mut secret = vec![0u8; 32];
        rand::thread_rng().fill_bytes(&mut secret);
        Stored {
            id: format!("prv_{}", uuid::Uuid::new_v4().simple()),
            port,
            public: false,
            secret,
            ttl_s: DEFAULT_TTL_S,
            expires_cap_ms: None,
            embed_origins: Vec::new(),
            created_ms: now_ms(),
        }
    });
    let was_public = p.public;
    if let Some(v) = visibility {
        p.public = v == "public";
    }
    if let Some(t) = ttl {
        p.ttl_s = t;
    }
    if expires.is_some() {
        p.expires_cap_ms = cap_ms;
    }
    if let Some(o) = origins {
        p.embed_origins = o;
    }
    st.store()
        .doc_put(KIND, &id, &port.to_string(), &p.to_doc())?;
    if was_public && !p.public {
        // Made private: whoever came in without a token is out.
        st.inner.previews.cut(&id, port);
    }
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(Reply::Json(status, answer(&st, &id, &p, ttl, cap_ms)))
}

pub async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    find(&st, &ctx.key, &id)?;
    let data: Vec<Value> = st
        .store()
        .doc_list(KIND, Some(&id))?
        .iter()
        .filter_map(|(_, _, d)| Stored::from_doc(d))
        .map(|p| answer(&st, &id, &p, None, None))
        .collect();
    Reply::ok(json!({ "data": data }))
}

pub async fn get(st: AppState, ctx: Ctx, id: String, port: String) -> ApiResult<Reply> {
    let port = port_of(&port)?;
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let ttl = f.q_int("ttlSeconds", 60, MAX_TTL_S);
    let cap = f.string("expiresAt");
    let cap_ms = match cap.as_deref().map(parse_iso_ms) {
        Some(None) => {
            f.issue("expiresAt", "must be an ISO 8601 time");
            None
        }
        Some(ms) => ms,
        None => None,
    };
    f.finish()?;
    find(&st, &ctx.key, &id)?;
    let p = load(&st, &id, port)?.ok_or_else(|| not_found(&id, port))?;
    Reply::ok(answer(&st, &id, &p, ttl, cap_ms))
}

pub async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    port: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let port = port_of(&port)?;
    no_fields(&body)?;
    if verb != "rotate" {
        return Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/previews/{port}:{verb}"),
        });
    }
    find(&st, &ctx.key, &id)?;
    let mut p = load(&st, &id, port)?.ok_or_else(|| not_found(&id, port))?;
    rand::thread_rng().fill_bytes(&mut p.secret);
    st.store()
        .doc_put(KIND, &id, &port.to_string(), &p.to_doc())?;
    st.inner.previews.cut(&id, port);
    Reply::ok(answer(&st, &id, &p, None, None))
}

pub async fn delete(st: AppState, ctx: Ctx, id: String, port: String) -> ApiResult<Reply> {
    let port = port_of(&port)?;
    find(&st, &ctx.key, &id)?;
    let p = load(&st, &id, port)?.ok_or_else(|| not_found(&id, port))?;
    st.store().doc_delete(KIND, &id, Some(&port.to_string()))?;
    st.inner.previews.cut(&id, port);
    Reply::ok(json!({"id": p.id, "sandboxId": id, "port": port, "deleted": true}))
}

/// Forgets a deleted sandbox's previews.
pub fn sandbox_gone(st: &AppState, id: &str) {
    if let Err(e) = st.store().doc_delete(KIND, id, None) {
        tracing::warn!(sandbox_id = id, error = %e, "forgetting previews failed");
    }
    st.inner.previews.sandbox_gone(id);
}

/// The preview a request's `Host` names: `<port>-<sandbox>.<domain>[:port]`.
pub fn target(st: &AppState, headers: &HeaderMap) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let host = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    let label = host
        .to_ascii_lowercase()
        .strip_suffix(&format!(
            ".{}",
            st.config().preview_domain.to_ascii_lowercase()
        ))?
        .to_string();
    let (port, sandbox) = label.split_once('-')?;
    if sandbox.contains('.') || sandbox.is_empty() {
        return None;
    }
    Some((port.parse().ok()?, sandbox.to_string()))
}

fn preview_error(status: StatusCode, code: &str, message: String) -> Response {
    let body = json!({"error": {"code": code, "status": status.as_u16(), "message": message}});
    (status, axum::Json(body)).into_response()
}

/// The token a request carries, and whether it came in the query.
fn presented(req: &Request) -> Option<(String, bool)> {
    if let Some(v) = req
        .headers()
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        return Some((v.trim().to_string(), false));
    }
    if let Some(q) = req.uri().query() {
        for part in q.split('&') {
            if let Some(v) = part.strip_prefix(&format!("{TOKEN_PARAM}=")) {
                return Some((v.to_string(), true));
            }
        }
    }
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(&format!("{COOKIE}=")))
        .map(|v| (v.to_string(), false))
}

/// Removes the token from what the guest's server sees.
fn scrub(req: &mut Request) {
    req.headers_mut().remove(TOKEN_HEADER);
    let cookies: Vec<String> = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.starts_with(&format!("{COOKIE}=")))
        .map(String::from)
        .collect();
    req.headers_mut().remove(header::COOKIE);
    if !cookies.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&cookies.join("; ")) {
            req.headers_mut().insert(header::COOKIE, v);
        }
    }
    let path = req.uri().path().to_string();
    let query: Vec<&str> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with(&format!("{TOKEN_PARAM}=")))
        .collect();
    let pq = if query.is_empty() {
        path
    } else {
        format!("{path}?{}", query.join("&"))
    };
    if let Ok(uri) = pq.parse() {
        *req.uri_mut() = uri;
    }
}

/// Serves one request to a preview.
pub async fn serve(st: AppState, mut req: Request, port: u16, sandbox: String) -> Response {
    let p = match load(&st, &sandbox, port) {
        Ok(Some(p)) => p,
        Ok(None) => {
            return preview_error(
                StatusCode::NOT_FOUND,
                "preview_not_found",
                format!("Port {port} of sandbox {sandbox} is not shared."),
            )
        }
        Err(e) => return e.into_response_with("preview"),
    };
    let mut set_cookie = None;
    if !p.public {
        match presented(&req) {
            None => {
                return preview_error(
                    StatusCode::UNAUTHORIZED,
                    "preview_token_required",
                    format!("This preview is private: send its token as the {TOKEN_HEADER} header or the {TOKEN_PARAM} query parameter."),
                )
            }
            Some((t, _)) if !p.check(&t) => {
                return preview_error(
                    StatusCode::FORBIDDEN,
                    "preview_token_invalid",
                    "The preview token is wrong, expired or was rotated.".into(),
                )
            }
            Some((t, from_query)) => {
                if from_query {
                    set_cookie = Some(t);
                }
            }
        }
    }
    scrub(&mut req);
    // Any visit counts as activity and wakes a paused sandbox.
    let system = KeyInfo {
        id: String::new(),
        read_only: false,
        account_wide: true,
    };
    if let Err(e) = find_running(&st, &system, &sandbox).await {
        return e.into_response_with("preview");
    }
    let cut = st.inner.previews.token(&sandbox, port);
    let mut resp = match forward(&st, &sandbox, port, req, cut).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Some(t) = set_cookie {
        if let Ok(v) =
            HeaderValue::from_str(&format!("{COOKIE}={t}; Path=/; HttpOnly; SameSite=Lax"))
        {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    if !p.embed_origins.is_empty() {
        if let Ok(v) =
            HeaderValue::from_str(&format!("frame-ancestors {}", p.embed_origins.join(" ")))
        {
            resp.headers_mut()
                .insert(header::CONTENT_SECURITY_POLICY, v);
        }
    }
    resp
}

/// Carries the request to the guest's port over a new connection, with
/// WebSocket (and any other) upgrades passed through.
async fn forward(
    st: &AppState,
    sandbox: &str,
    port: u16,
    mut req: Request,
    cut: CancellationToken,
) -> Result<Response, Response> {
    let io = st.host().connect(sandbox, port).await.map_err(|_| {
        preview_error(
            StatusCode::BAD_GATEWAY,
            "preview_unreachable",
            format!("Nothing listens on port {port} in the sandbox (a server must listen on 0.0.0.0 or localhost)."),
        )
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| {
            preview_error(
                StatusCode::BAD_GATEWAY,
                "preview_unreachable",
                format!("The sandbox's server did not answer: {e}"),
            )
        })?;
    let conn_cut = cut.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = conn.with_upgrades() => {}
            _ = conn_cut.cancelled() => {}
        }
    });
    let upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let mut resp = sender.send_request(req).await.map_err(|e| {
        preview_error(
            StatusCode::BAD_GATEWAY,
            "preview_unreachable",
            format!("The sandbox's server closed the connection: {e}"),
        )
    })?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_side) = upgrade {
            let guest_side = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                let (Ok(c), Ok(g)) = (client_side.await, guest_side.await) else {
                    return;
                };
                let mut c = TokioIo::new(c);
                let mut g = TokioIo::new(g);
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut c, &mut g) => {}
                    _ = cut.cancelled() => {}
                }
            });
        }
    }
    // The answer is ours to the client: our HTTP version, whatever the guest's.
    *resp.version_mut() = axum::http::Version::HTTP_11;
    Ok(resp.map(Body::new))
}
