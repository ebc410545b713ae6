//! `…/sessions`: `POST` makes a session (its token shown once), `GET`
//! lists them, `POST …/sessions/{s}:revoke` ends one.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::session::{
    origin_problem, DEFAULT_TTL_SECONDS, MAX_NAME_CHARS, MAX_ORIGINS, MAX_TTL_SECONDS,
    MIN_TTL_SECONDS,
};
use crate::error::ApiResult;
use crate::http::extract::{json_object, no_fields, Fields};
use crate::http::{Ctx, Reply};
use crate::service::sessions::{self as svc, NewSession};
use crate::AppState;

pub(super) async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let ttl_seconds = f
        .int("ttlSeconds", MIN_TTL_SECONDS, MAX_TTL_SECONDS)
        .unwrap_or(DEFAULT_TTL_SECONDS);
    let mut origins = Vec::new();
    match f.raw("origins") {
        None => {}
        Some(Value::Array(list)) if list.len() > MAX_ORIGINS => {
            f.issue("origins", format!("may list at most {MAX_ORIGINS} origins"))
        }
        Some(Value::Array(list)) => {
            for (i, o) in list.iter().enumerate() {
                match o.as_str() {
                    None => f.issue(&format!("origins[{i}]"), "must be a string"),
                    Some(o) => match origin_problem(o) {
                        Some(why) => f.issue(&format!("origins[{i}]"), why),
                        None if !origins.iter().any(|x: &String| x == o) => {
                            origins.push(o.to_string())
                        }
                        None => {}
                    },
                }
            }
        }
        Some(_) => f.issue("origins", "must be a list of origins"),
    }
    let name = f.string("name");
    if let Some(n) = &name {
        if n.is_empty() || n.chars().count() > MAX_NAME_CHARS || n.chars().any(char::is_control) {
            f.issue(
                "name",
                format!(
                    "must be 1 to {MAX_NAME_CHARS} characters, none of them control characters"
                ),
            );
        }
    }
    f.finish()?;
    let req = NewSession {
        ttl_seconds,
        origins,
        name,
    };
    let (s, token) = svc::create(&st, &ctx.key, &id, req)?;
    Ok(Reply::shown_once(
        StatusCode::CREATED,
        s.wire(st.now_ms()),
        "token",
        token,
        None,
    ))
}

pub(super) async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let now = st.now_ms();
    let data: Vec<Value> = svc::list(&st, &ctx.key, &id)?
        .iter()
        .map(|s| s.wire(now))
        .collect();
    Reply::ok(json!({ "data": data }))
}

pub(super) async fn revoke(
    st: AppState,
    ctx: Ctx,
    id: String,
    session: String,
    body: Bytes,
) -> ApiResult<Reply> {
    no_fields(&body)?;
    let s = svc::revoke(&st, &ctx.key, &id, &session)?;
    Reply::ok(s.wire(st.now_ms()))
}
