//! `runtime login`: a terminal asks for a key, a person approves it in the
//! browser (docs/keys.md).
//!
//! 1. The CLI sends `POST /v1/login/requests {"computer"}` (no key) and gets
//!    a request id, a short code to match, and a poll token.
//! 2. It opens `/login/{id}`: a page showing the code and the computer's
//!    name, where a person who holds an admin (account-wide, full) key
//!    names the new key, picks its access and daily limit, and approves.
//! 3. The CLI polls `POST /v1/login/requests/{id}:poll {"pollToken"}` and
//!    receives the new key once; the server keeps only its hash.
//!
//! Requests live in memory for 15 minutes; a restart forgets them.

use runtime_api::codes;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use serde_json::{json, Value};

use crate::domain::access::sha256_hex;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, parse_query, percent_decode, Fields};
use crate::http::serve::Peer;
use crate::AppState;

const TTL: Duration = Duration::from_secs(15 * 60);
const MAX_PENDING: usize = 64;
/// Most requests one address may have waiting: one source cannot fill the
/// server's [`MAX_PENDING`] for everyone else.
const MAX_PENDING_PER_SOURCE: usize = 8;

enum Outcome {
    Waiting,
    Approved { key: String },
    Denied,
}

struct LoginRequest {
    code: String,
    computer: String,
    poll_hash: String,
    created: Instant,
    outcome: Outcome,
    /// The address it came from (none: a caller in the same process).
    source: Option<std::net::IpAddr>,
}

/// The login requests under way.
#[derive(Default)]
pub(crate) struct Pending {
    requests: Mutex<HashMap<String, LoginRequest>>,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, LoginRequest>> {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, r| r.created.elapsed() < TTL);
        m
    }
}

pub(crate) fn is_login_path(path: &str) -> bool {
    path.starts_with("/v1/login/") || path.starts_with("/login/")
}

fn random_code() -> String {
    // No 0/O, 1/I: read aloud and typed.
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZ23456789";
    let mut rng = rand::thread_rng();
    let mut s: String = (0..8)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect();
    s.insert(4, '-');
    s
}

/// Whether a page that takes the admin key may be used over this
/// connection: over TLS, from this machine, or where the operator allowed
/// plain HTTP (`--login-over-http`). Otherwise the key would cross the
/// network in clear.
fn key_may_travel(st: &AppState, peer: Option<Peer>) -> bool {
    st.config().tls.is_some() || st.config().login_over_http || peer.is_none_or(|p| p.is_loopback())
}

fn plain_http_refused() -> Response {
    html(
        StatusCode::FORBIDDEN,
        "Connect a computer",
        "<p id=\"result\">This server speaks plain HTTP, so an admin key typed here would cross \
the network unencrypted. Open this page on the server's own machine (at its loopback address, \
for instance through <code>ssh -L</code>), or have the operator serve HTTPS \
(<code>--tls-cert</code>, <code>--tls-key</code>) or allow it with <code>--login-over-http</code>.</p>",
    )
}

pub(crate) async fn handle(st: &AppState, req: Request) -> ApiResult<Response> {
    let peer = req.extensions().get::<Peer>().copied();
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let body = axum::body::to_bytes(body, 64 << 10)
        .await
        .map_err(|_| ApiError::PayloadTooLarge { limit: 64 << 10 })?;
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let not_found = || ApiError::RouteNotFound {
        method: parts.method.to_string(),
        path: path.clone(),
    };
    match (parts.method.clone(), segs.as_slice()) {
        (Method::POST, ["v1", "login", "requests"]) => begin(st, &body, peer),
        (Method::POST, ["v1", "login", "requests", last]) => {
            let (id, verb) = last.split_once(':').ok_or_else(not_found)?;
            if verb != "poll" {
                return Err(not_found());
            }
            let id = percent_decode(id, false).ok_or_else(not_found)?;
            poll(st, &id, &body)
        }
        (Method::GET | Method::POST, ["login", id]) if !key_may_travel(st, peer) => {
            tracing::warn!(login = %id, peer = ?peer, "an approval page over plain HTTP from another machine was refused");
            Ok(plain_http_refused())
        }
        (Method::GET, ["login", id]) => Ok(page(st, id, None)),
        (Method::POST, ["login", id]) => Ok(decide(st, id, &body)),
        _ => Err(not_found()),
    }
}

fn begin(st: &AppState, body: &[u8], peer: Option<Peer>) -> ApiResult<Response> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let computer = f.string("computer").unwrap_or_default();
    if computer.chars().count() > 100 {
        f.issue("computer", "must be at most 100 characters");
    }
    f.finish()?;
    let id = uuid::Uuid::new_v4().to_string();
    let token = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let code = random_code();
    let source = peer.map(|p| p.0.ip().to_canonical());
    {
        let mut m = st.inner.logins.lock();
        let from_source = m
            .values()
            .filter(|r| source.is_some() && r.source == source)
            .count();
        if m.len() >= MAX_PENDING || from_source >= MAX_PENDING_PER_SOURCE {
            return Err(ApiError::Conflict {
                code: codes::BUSY,
                message: format!(
                    "Too many login requests are waiting{}; try again later.",
                    if from_source >= MAX_PENDING_PER_SOURCE {
                        " from this address"
                    } else {
                        ""
                    }
                ),
                details: None,
            });
        }
        m.insert(
            id.clone(),
            LoginRequest {
                code: code.clone(),
                computer: computer.chars().filter(|c| !c.is_control()).collect(),
                poll_hash: sha256_hex(token.as_bytes()),
                created: Instant::now(),
                outcome: Outcome::Waiting,
                source,
            },
        );
    }
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({
            "id": id,
            "code": code,
            "pollToken": token,
            "approvePath": format!("/login/{id}"),
            "expiresInSeconds": TTL.as_secs(),
        })),
    )
        .into_response())
}

fn poll(st: &AppState, id: &str, body: &[u8]) -> ApiResult<Response> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let token = f.string("pollToken").unwrap_or_default();
    f.finish()?;
    let mut m = st.inner.logins.lock();
    let gone = || ApiError::NotFound {
        code: codes::LOGIN_NOT_FOUND,
        what: "login request",
        id: id.to_string(),
    };
    let r = m.get(id).ok_or_else(gone)?;
    if r.poll_hash != sha256_hex(token.as_bytes()) {
        return Err(gone());
    }
    let answer: Value = match &r.outcome {
        Outcome::Waiting => json!({"status": "pending"}),
        Outcome::Denied => {
            m.remove(id);
            json!({"status": "denied"})
        }
        Outcome::Approved { key } => {
            let v = json!({"status": "approved", "key": key});
            // Handed over once; only its hash stays.
            m.remove(id);
            v
        }
    };
    Ok(axum::Json(answer).into_response())
}

fn escape(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '&' => "&amp;".into(),
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '"' => "&quot;".into(),
            '\'' => "&#39;".into(),
            c => c.to_string(),
        })
        .collect()
}

fn html(status: StatusCode, title: &str, main: &str) -> Response {
    let doc = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width\"><title>{title}</title>\
<style>body{{font-family:system-ui,sans-serif;max-width:34rem;margin:3rem auto;padding:0 1rem}}\
label{{display:block;margin:.8rem 0 .2rem}}input[type=text],input[type=password]{{width:100%;padding:.4rem}}\
.code{{font:700 1.6rem monospace;letter-spacing:.1em}}.error{{color:#b00020}}button{{margin:1rem .5rem 0 0;padding:.5rem 1rem}}</style>\
</head><body><h1>{title}</h1>{main}</body></html>"
    );
    let mut resp = (status, doc).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

fn page(st: &AppState, id: &str, error: Option<&str>) -> Response {
    let m = st.inner.logins.lock();
    let Some(r) = m.get(id).filter(|r| matches!(r.outcome, Outcome::Waiting)) else {
        return html(
            StatusCode::NOT_FOUND,
            "Connect a computer",
            "<p id=\"result\">This request does not exist or has expired. Run <code>runtime login</code> again.</p>",
        );
    };
    let computer = if r.computer.is_empty() {
        "a computer".to_string()
    } else {
        r.computer.clone()
    };
    let error = error
        .map(|e| format!("<p class=\"error\" id=\"error\">{}</p>", escape(e)))
        .unwrap_or_default();
    let main = format!(
        "<p><b id=\"computer\">{computer}</b> asks for an API key for this server. \
Check that the terminal shows this code:</p><p class=\"code\" id=\"code\">{code}</p>{error}\
<form method=\"post\" action=\"/login/{id}\">\
<label for=\"adminKey\">Admin key (from the server's <code>admin.key</code>)</label>\
<input type=\"password\" id=\"adminKey\" name=\"adminKey\" autocomplete=\"current-password\" required>\
<label for=\"name\">Name of the new key</label>\
<input type=\"text\" id=\"name\" name=\"name\" value=\"{name}\" maxlength=\"100\">\
<label for=\"dailyLimit\">Daily spending limit in dollars (empty: none)</label>\
<input type=\"text\" id=\"dailyLimit\" name=\"dailyLimit\" inputmode=\"decimal\" placeholder=\"e.g. 5.00\">\
<label><input type=\"checkbox\" id=\"readOnly\" name=\"readOnly\" value=\"on\"> Read only (list sandboxes and costs; change nothing)</label>\
<p>The key lasts until it is revoked (<code>runtime keys revoke</code>).</p>\
<button type=\"submit\" id=\"approve\" name=\"decision\" value=\"approve\">Create key</button>\
<button type=\"submit\" id=\"deny\" name=\"decision\" value=\"deny\" formnovalidate>Deny</button>\
</form>",
        computer = escape(&computer),
        code = escape(&r.code),
        id = escape(id),
        name = escape(&format!("login from {computer}")),
    );
    html(StatusCode::OK, "Connect a computer", &main)
}

/// Dollars as typed ("5", "5.25", "$0.10") to microdollars.
pub(crate) fn parse_dollars(s: &str) -> Option<i64> {
    let s = s.trim().trim_start_matches('$').replace(',', "");
    let (whole, frac) = s.split_once('.').unwrap_or((&s, ""));
    if whole.is_empty() && frac.is_empty()
        || frac.len() > 6
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let whole: i64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let frac: i64 = format!("{frac:0<6}").parse().ok()?;
    whole.checked_mul(1_000_000)?.checked_add(frac)
}

fn decide(st: &AppState, id: &str, body: &[u8]) -> Response {
    let form = std::str::from_utf8(body)
        .ok()
        .and_then(|b| parse_query(Some(b)).ok())
        .unwrap_or_default();
    let get = |k: &str| {
        form.iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    if !st.inner.logins.lock().contains_key(id) {
        return page(st, id, None);
    }
    let admin = get("adminKey");
    let approver = st
        .store()
        .find_key(&sha256_hex(admin.trim().as_bytes()))
        .ok()
        .flatten()
        .filter(|k| k.account_wide && !k.read_only);
    if approver.is_none() {
        let mut resp = page(st, id, Some("That is not an admin key of this server."));
        *resp.status_mut() = StatusCode::FORBIDDEN;
        return resp;
    }
    if get("decision") == "deny" {
        if let Some(r) = st.inner.logins.lock().get_mut(id) {
            r.outcome = Outcome::Denied;
        }
        return html(
            StatusCode::OK,
            "Request denied",
            "<p id=\"result\">Denied. The terminal gets no key.</p>",
        );
    }
    let limit_text = get("dailyLimit");
    let limit = if limit_text.trim().is_empty() {
        None
    } else {
        match parse_dollars(&limit_text) {
            Some(m) => Some(m),
            None => {
                let mut resp = page(
                    st,
                    id,
                    Some("The daily limit must be an amount in dollars, such as 5 or 0.25."),
                );
                *resp.status_mut() = StatusCode::BAD_REQUEST;
                return resp;
            }
        }
    };
    let name = get("name");
    let name = name.trim();
    let name = (!name.is_empty()).then(|| name.chars().take(100).collect::<String>());
    let read_only = get("readOnly") == "on";
    let made = crate::create_key(&st.config().store_at(), name.as_deref(), read_only, false)
        .and_then(|key| {
            if limit.is_some() {
                let id = crate::service::keys::key_id_of(&key)
                    .unwrap_or_default()
                    .to_string();
                let conn = st.store();
                crate::service::keys::set_limit_on(&conn.conn(), &id, limit)?;
            }
            Ok(key)
        });
    let key = match made {
        Ok(k) => k,
        Err(e) => {
            tracing::error!(error = %e, "creating a key for a login failed");
            return html(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Something failed",
                "<p id=\"result\">The key could not be created; see the server's log.</p>",
            );
        }
    };
    let mut m = st.inner.logins.lock();
    match m.get_mut(id) {
        Some(r) if matches!(r.outcome, Outcome::Waiting) => {
            r.outcome = Outcome::Approved { key };
        }
        _ => {
            return html(
                StatusCode::CONFLICT,
                "Already decided",
                "<p id=\"result\">This request was already decided.</p>",
            )
        }
    }
    tracing::info!(login = %id, read_only, "login approved");
    html(
        StatusCode::OK,
        "Key created",
        &format!(
            "<p id=\"result\">Approved: the terminal receives the key{}. You can close this tab.</p>",
            name.map(|n| format!(" <b>{}</b>", escape(&n))).unwrap_or_default()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dollars() {
        assert_eq!(parse_dollars("5"), Some(5_000_000));
        assert_eq!(parse_dollars("$0.25"), Some(250_000));
        assert_eq!(parse_dollars("1,000.000001"), Some(1_000_000_001));
        assert_eq!(parse_dollars(".5"), Some(500_000));
        assert_eq!(parse_dollars("-1"), None);
        assert_eq!(parse_dollars("1.0000001"), None);
        assert_eq!(parse_dollars("abc"), None);
        assert_eq!(parse_dollars(""), None);
    }

    #[test]
    fn escaping() {
        assert_eq!(escape("<a href='x'>&"), "&lt;a href=&#39;x&#39;&gt;&amp;");
    }
}
