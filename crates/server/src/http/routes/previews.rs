//! Previews: `POST`/`GET …/previews`, `GET`/`DELETE …/previews/{port}` and
//! `…/previews/{port}:rotate`. Visits are served by `http/preview_proxy.rs`.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::preview::{base_url, parse_port, valid_origin, MAX_TTL_S, TOKEN_PARAM};
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::previews::{self, Shared, TokenAsk};
use crate::AppState;

/// The port preview URLs name. On one machine, this server's. On several
/// nodes, the port of the address the caller used (`Host`; none: the
/// scheme's own), so that a URL made by whichever node the request was
/// carried to names the address the caller reaches them all at (a load
/// balancer's, say), not that node's.
fn url_port(st: &AppState, ctx: &Ctx) -> u16 {
    let own = st.config().preview_port;
    if !crate::service::nodes::several(st) {
        return own;
    }
    ctx.headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.parse::<axum::http::uri::Authority>().ok())
        .map_or(own, |a| a.port_u16().unwrap_or(0))
}

fn answer(st: &AppState, url_port: u16, p: &Shared) -> Value {
    let c = st.config();
    let url = base_url(
        c.tls.is_some(),
        &c.preview_domain,
        url_port,
        &p.sandbox_id,
        p.port,
    );
    let (token, expires) = match &p.token {
        None => (Value::Null, Value::Null),
        Some((t, e)) => (json!(t), json!(iso(*e))),
    };
    let with_token = match token.as_str() {
        Some(t) => format!("{url}?{TOKEN_PARAM}={t}"),
        None => url.clone(),
    };
    json!({
        "id": p.id,
        "sandboxId": p.sandbox_id,
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

fn port_of(s: &str) -> ApiResult<u16> {
    parse_port(s).ok_or_else(|| ApiError::invalid("port", "must be 1 to 65535"))
}

/// `POST …/previews`: shares a port, or changes how it is shared.
pub(super) async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
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
            Some(ms) if ms > st.now_ms() => cap_ms = Some(ms),
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
    let s = previews::Share {
        port: port.unwrap_or(0),
        public: visibility.map(|v| v == "public"),
        ttl_s: ttl,
        expires_cap_ms: cap_ms,
        embed_origins: origins,
    };
    let (p, created) = previews::share(&st, &ctx.key, &id, s)?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(Reply::Json(status, answer(&st, url_port(&st, &ctx), &p)))
}

/// `GET …/previews`.
pub(super) async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let at = url_port(&st, &ctx);
    let data: Vec<Value> = previews::list(&st, &ctx.key, &id)?
        .iter()
        .map(|p| answer(&st, at, p))
        .collect();
    Reply::ok(json!({ "data": data }))
}

/// `GET …/previews/{port}?ttlSeconds&expiresAt`: with a fresh token.
pub(super) async fn get(st: AppState, ctx: Ctx, id: String, port: String) -> ApiResult<Reply> {
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
    let ask = TokenAsk { ttl_s: ttl, cap_ms };
    let p = previews::get(&st, &ctx.key, &id, port, ask)?;
    Reply::ok(answer(&st, url_port(&st, &ctx), &p))
}

/// `POST …/previews/{port}:rotate`.
pub(super) async fn action(
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
    let p = previews::rotate(&st, &ctx.key, &id, port)?;
    Reply::ok(answer(&st, url_port(&st, &ctx), &p))
}

/// `DELETE …/previews/{port}`.
pub(super) async fn delete(st: AppState, ctx: Ctx, id: String, port: String) -> ApiResult<Reply> {
    let port = port_of(&port)?;
    let preview_id = previews::delete(&st, &ctx.key, &id, port)?;
    Reply::ok(json!({"id": preview_id, "sandboxId": id, "port": port, "deleted": true}))
}
