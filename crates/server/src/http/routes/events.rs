//! `GET /v1/events`, `/v1/webhooks[/{id}[:update|:rotate-secret|:delete|
//! :test|/deliveries]]` and `POST /v1/webhook-deliveries/{d}:retry`
//! (docs/api.md#events-and-webhooks).

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::events::{CURSOR_PREFIX, DEFAULT_LIMIT, MAX_LIMIT, TYPES};
use crate::domain::webhook::{KEEP_PREVIOUS_DEFAULT_S, KEEP_PREVIOUS_MAX_S, MAX_DESCRIPTION};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::events::{self, ListEvents};
use crate::service::webhooks::{self, Change, NewWebhook, Outcome};
use crate::AppState;

/// `limit` (1 to 200, 50 by default) and `cursor` of a list.
fn page(f: &mut Fields<'_>) -> (i64, Option<i64>) {
    let limit = f.q_int("limit", 1, MAX_LIMIT).unwrap_or(DEFAULT_LIMIT);
    let before = f.cursor(CURSOR_PREFIX);
    (limit, before)
}

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let resource_id = f.string("resourceId").filter(|s| !s.is_empty());
    let ty = f.string("type").filter(|s| !s.is_empty());
    if let Some(t) = &ty {
        if !TYPES.contains(&t.as_str()) {
            f.issue("type", format!("must be one of {}", TYPES.join(", ")));
        }
    }
    let (limit, before) = page(&mut f);
    f.finish()?;
    let p = events::list(
        &st,
        &ctx.key,
        ListEvents {
            resource_id,
            ty,
            before,
            limit,
        },
    )?;
    Reply::ok(json!({ "data": p.data, "nextCursor": p.next_cursor }))
}

/// `events`: a list of known types (empty or absent: every type).
fn event_types(f: &mut Fields<'_>) -> Option<Vec<String>> {
    let raw = f.raw("events")?;
    let Some(items) = raw.as_array() else {
        f.issue("events", "must be a list of event types");
        return None;
    };
    let mut out = Vec::new();
    for (i, v) in items.iter().enumerate() {
        match v.as_str() {
            Some(t) if TYPES.contains(&t) => {
                if !out.iter().any(|o| o == t) {
                    out.push(t.to_string());
                }
            }
            Some(t) => f.issue(
                &format!("events[{i}]"),
                format!("{t} is not an event type; one of {}", TYPES.join(", ")),
            ),
            None => f.issue(&format!("events[{i}]"), "must be a string"),
        }
    }
    Some(out)
}

fn description(f: &mut Fields<'_>) -> Option<String> {
    let d = f.string("description")?;
    if d.chars().count() > MAX_DESCRIPTION {
        f.issue(
            "description",
            format!("must be at most {MAX_DESCRIPTION} characters"),
        );
        return None;
    }
    Some(d)
}

fn url(st: &AppState, f: &mut Fields<'_>, required: bool) -> Option<String> {
    let Some(u) = f.string("url") else {
        if required {
            f.issue("url", "is required");
        }
        return None;
    };
    match webhooks::target(st, &u) {
        Ok(_) => Some(u),
        Err(why) => {
            f.issue("url", why);
            None
        }
    }
}

/// A webhook with its secret, shown this once: a replay answers the
/// record with `secretRedacted: true` instead.
fn with_secret(status: StatusCode, w: Value, secret: String) -> Reply {
    Reply::shown_once(status, w, "secret", secret, Some("secretRedacted"))
}

pub(super) async fn create_webhook(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let url = url(&st, &mut f, true);
    let events = event_types(&mut f).unwrap_or_default();
    let description = description(&mut f);
    f.finish()?;
    let Some(url) = url else {
        return Err(ApiError::invalid("url", "is required"));
    };
    let cmd = NewWebhook {
        url,
        events,
        description,
    };
    let (w, secret) = webhooks::create(&st, &ctx.key, cmd).await?;
    Ok(with_secret(
        StatusCode::CREATED,
        webhooks::render(&w, st.now_ms()),
        secret,
    ))
}

pub(super) async fn list_webhooks(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let now = st.now_ms();
    let data: Vec<Value> = webhooks::list(&st, &ctx.key)?
        .iter()
        .map(|w| webhooks::render(w, now))
        .collect();
    Reply::ok(json!({ "data": data, "nextCursor": null }))
}

pub(super) async fn get_webhook(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let w = webhooks::find(&st, &ctx.key, &id)?;
    Reply::ok(webhooks::render(&w, st.now_ms()))
}

pub(super) async fn delete_webhook(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let w = webhooks::delete(&st, &ctx.key, &id)?;
    Reply::ok(json!({"id": w.id, "kind": "webhook", "status": "deleted"}))
}

fn outcome(o: &Outcome) -> Value {
    json!({"ok": o.ok(), "status": o.status, "durationMs": o.duration_ms, "error": o.error})
}

pub(super) async fn webhook_action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "update" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let change = Change {
                url: url(&st, &mut f, false),
                events: event_types(&mut f),
                description: description(&mut f),
                enabled: f.bool("enabled"),
            };
            f.finish()?;
            let w = webhooks::update(&st, &ctx.key, &id, change)?;
            Reply::ok(webhooks::render(&w, st.now_ms()))
        }
        "rotate-secret" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let keep = f
                .int("keepPreviousSeconds", 0, KEEP_PREVIOUS_MAX_S)
                .unwrap_or(KEEP_PREVIOUS_DEFAULT_S);
            f.finish()?;
            let (w, secret) = webhooks::rotate(&st, &ctx.key, &id, keep)?;
            Ok(with_secret(
                StatusCode::OK,
                webhooks::render(&w, st.now_ms()),
                secret,
            ))
        }
        "delete" => {
            no_fields(&body)?;
            delete_webhook(st, ctx, id).await
        }
        "test" => {
            no_fields(&body)?;
            let o = webhooks::test(&st, &ctx.key, &id).await?;
            Reply::ok(outcome(&o))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/webhooks/{id}:{verb}"),
        }),
    }
}

pub(super) async fn deliveries(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let state = f.one_of("state", &["pending", "succeeded", "failed"]);
    let (limit, before) = page(&mut f);
    f.finish()?;
    let (rows, next) = webhooks::deliveries(&st, &ctx.key, &id, state.as_deref(), before, limit)?;
    let data: Vec<Value> = rows.iter().map(webhooks::render_delivery).collect();
    Reply::ok(
        json!({ "data": data, "nextCursor": next.map(|s| crate::domain::cursor::encode(CURSOR_PREFIX, s)) }),
    )
}

pub(super) async fn delivery_action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "retry" => {
            no_fields(&body)?;
            let d = webhooks::retry(&st, &ctx.key, &id).await?;
            Reply::ok(webhooks::render_delivery(&d))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/webhook-deliveries/{id}:{verb}"),
        }),
    }
}
