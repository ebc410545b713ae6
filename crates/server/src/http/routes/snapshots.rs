//! `:fork`, `:snapshot`, `GET|DELETE /v1/snapshots/{id}`, `GET /v1/snapshots`.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::names::valid_name;
use crate::domain::snapshot::Snapshot;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{
    checked_labels, checked_name, json_object, no_fields, prefer_wait, query_object, Fields,
};
use crate::http::{record_json, Ctx, Reply};
use crate::service::snapshots::{
    self as svc, Fork, ListFilter, NewSnapshot, DEFAULT_RETENTION_DAYS, MAX_FORK,
};
use crate::AppState;

fn wait_of(ctx: &Ctx) -> Option<Duration> {
    prefer_wait(&ctx.headers).map(Duration::from_secs)
}

pub(super) async fn fork(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let count = f.int("count", 1, MAX_FORK).unwrap_or(1) as usize;
    let name = checked_name(&mut f);
    if name.as_deref().is_some_and(valid_name) && count > 1 {
        f.issue("name", "names one copy: leave it out when count is above 1");
    }
    let labels = checked_labels(&mut f);
    let keep_snapshot = f.bool("keepSnapshot").unwrap_or(false);
    let _ = f.one_of("funding", &["trial", "paid"]);
    let net = super::network::parse_create(&mut f, || {
        crate::service::secrets::names(&st, &ctx.key.id).unwrap_or_default()
    });
    f.finish()?;
    let req = Fork {
        count,
        name,
        labels,
        net,
        keep_snapshot,
        answer_slot: super::sandboxes::answer_slot(&ctx),
    };
    let (copies, kept) = svc::fork(&st, &ctx.key, &id, req, wait_of(&ctx)).await?;
    let out: Vec<Value> = copies.iter().map(|r| record_json(&r.record, &[])).collect();
    Ok(forked(out, kept.as_ref()))
}

/// A fork's answer: its copies and the snapshot it kept.
fn forked(copies: Vec<Value>, kept: Option<&Snapshot>) -> Reply {
    let mut answer = json!({ "sandboxes": copies });
    if let Some(s) = kept {
        answer["snapshot"] = s.wire();
    }
    Reply::Json(StatusCode::CREATED, answer)
}

/// A fork's answer replayed from its pending record (the server died
/// before the answer was stored): its copies and kept snapshot as they
/// are now (deleted ones left out).
pub(crate) fn replay_forked(st: &AppState, pending: &Value) -> ApiResult<Reply> {
    let (copies, kept) = svc::replayed_fork(st, pending)?;
    let out: Vec<Value> = copies.iter().map(|r| record_json(&r.record, &[])).collect();
    Ok(forked(out, kept.as_ref()))
}

/// A snapshot's answer replayed from its pending record: the snapshot as
/// it is now.
pub(crate) fn replay_snapshot(st: &AppState, pending: &Value) -> ApiResult<Reply> {
    Ok(Reply::Json(
        StatusCode::CREATED,
        svc::replayed_snapshot(st, pending)?.wire(),
    ))
}

pub(super) async fn snapshot(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let name = checked_name(&mut f);
    let labels = checked_labels(&mut f).unwrap_or_default();
    let retention_days = f
        .int("retentionDays", 1, 365)
        .unwrap_or(DEFAULT_RETENTION_DAYS);
    let mode = f
        .one_of("mode", &["memory", "disk"])
        .unwrap_or_else(|| "memory".into());
    f.finish()?;
    let req = NewSnapshot {
        name,
        labels,
        retention_days,
        mode,
        answer_slot: super::sandboxes::answer_slot(&ctx),
    };
    let snap = svc::snapshot(&st, &ctx.key, &id, req, wait_of(&ctx)).await?;
    Ok(Reply::Json(StatusCode::CREATED, snap.wire()))
}

pub(super) async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    Reply::ok(svc::get(&st, &ctx.key, &id)?.wire())
}

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let sandbox_id = f.string("sandboxId");
    let name = f.string("name");
    let state = f.one_of("state", &["capturing", "ready", "failed"]);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let before_seq = match f.string("cursor") {
        Some(c) if !c.is_empty() => match c.parse::<i64>() {
            Ok(seq) => Some(seq),
            Err(_) => {
                f.issue("cursor", "is not a cursor this server gave");
                None
            }
        },
        _ => None,
    };
    f.finish()?;
    let filter = ListFilter {
        sandbox_id,
        name,
        state,
        limit,
        before_seq,
    };
    let (rows, more) = svc::list(&st, &ctx.key, &filter)?;
    let next = if more {
        rows.last().map(|r| r.seq.to_string())
    } else {
        None
    };
    let data: Vec<Value> = rows.iter().map(|r| r.record.wire()).collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

/// `DELETE /v1/snapshots/{id}` and `POST /v1/snapshots/{id}:delete` (the
/// client's). Deleting again answers the same; sandboxes started from it
/// are not affected.
pub(super) async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let at = svc::delete(&st, &ctx.key, &id)?;
    Reply::ok(json!({"id": id, "kind": "snapshot", "status": "deleted", "deletedAt": at}))
}

pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "delete" => {
            no_fields(&body)?;
            delete(st, ctx, id).await
        }
        "update" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let name_given = f.present("name");
            let name = checked_name(&mut f);
            let labels = checked_labels(&mut f);
            let if_labels = f
                .string_map("ifLabels", 1024)
                .map(|l| l.into_iter().collect());
            f.finish()?;
            let change = svc::SnapshotChange {
                name: name_given.then_some(name),
                labels,
                if_labels,
            };
            Reply::ok(svc::update(&st, &ctx.key, &id, change)?.wire())
        }
        "extend" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let days = f.int("retentionDays", 1, 365);
            if days.is_none() && !f.present("retentionDays") {
                f.issue("retentionDays", "is required");
            }
            f.finish()?;
            let days = days.unwrap_or(DEFAULT_RETENTION_DAYS) as u32;
            Reply::ok(svc::extend(&st, &ctx.key, &id, days)?.wire())
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/snapshots/{id}:{verb}"),
        }),
    }
}
