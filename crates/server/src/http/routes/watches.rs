//! File watches (`…/files/watches`): start, list, read (by cursor, waiting
//! or followed as NDJSON) and stop; the work is in
//! [`crate::service::watches`].

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::files::valid_path;
use crate::error::ApiResult;
use crate::http::extract::{json_object, query_object, Fields};
use crate::http::reply::ndjson;
use crate::http::{Ctx, Reply};
use crate::service::watches::api::{self as watches, Start};
use crate::service::watches::wire::{
    kind_of, valid_id, DEFAULT_BATCH_MS, DEFAULT_MAX_WATCHES, DEFAULT_TIMEOUT_MS, EVENT_NAMES,
    MAX_BATCH_MS, MAX_GLOBS, MAX_GLOB_LEN, MAX_MAX_WATCHES, MAX_TIMEOUT_MS, MAX_WAIT_MS,
};
use crate::AppState;

/// A list of strings, each at most `max_len` long; issues go to `f`.
fn strings(f: &mut Fields<'_>, name: &str, max_items: usize, max_len: usize) -> Vec<String> {
    match f.raw(name) {
        None => Vec::new(),
        Some(Value::Array(a)) if a.len() <= max_items => {
            let mut out = Vec::new();
            for (i, v) in a.iter().enumerate() {
                match v.as_str() {
                    Some(s) if !s.is_empty() && s.len() <= max_len && !s.contains('\0') => {
                        out.push(s.to_string())
                    }
                    _ => f.issue(
                        &format!("{name}[{i}]"),
                        format!("must be a non-empty string of at most {max_len} bytes"),
                    ),
                }
            }
            out
        }
        Some(Value::Array(_)) => {
            f.issue(name, format!("must have at most {max_items} entries"));
            Vec::new()
        }
        Some(_) => {
            f.issue(name, "must be an array of strings");
            Vec::new()
        }
    }
}

pub(super) async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let path = match f.string("path") {
        Some(p) if valid_path(&p) => p,
        Some(_) => {
            f.issue("path", "must be an absolute path");
            String::new()
        }
        None => {
            if !f.present("path") {
                f.issue("path", "is required");
            }
            String::new()
        }
    };
    let recursive = f.bool("recursive").unwrap_or(false);
    let events = strings(&mut f, "events", EVENT_NAMES.len(), 16);
    let mut kinds = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if !EVENT_NAMES.contains(&e.as_str()) {
            f.issue(
                &format!("events[{i}]"),
                format!("must be one of {}", EVENT_NAMES.join(", ")),
            );
        } else if let Some(k) = kind_of(e) {
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
    }
    if f.present("events") && events.is_empty() && f.issues.is_empty() {
        f.issue("events", "must name at least one event");
    }
    let include = strings(&mut f, "include", MAX_GLOBS, MAX_GLOB_LEN);
    let exclude = strings(&mut f, "exclude", MAX_GLOBS, MAX_GLOB_LEN);
    let batch_ms = f
        .int("batchMs", 0, MAX_BATCH_MS)
        .unwrap_or(DEFAULT_BATCH_MS);
    let timeout_ms = f
        .int("timeoutMs", 0, MAX_TIMEOUT_MS)
        .unwrap_or(DEFAULT_TIMEOUT_MS);
    let max_watches = f
        .int("maxWatches", 1, MAX_MAX_WATCHES)
        .unwrap_or(DEFAULT_MAX_WATCHES);
    let watch_id = f.string("id");
    if let Some(w) = &watch_id {
        if !valid_id(w) {
            f.issue("id", "must be 1 to 64 letters, digits, '-', '_' or '.'");
        }
    }
    let webhook = f.bool("webhook").unwrap_or(false);
    f.finish()?;
    let start = Start {
        path,
        recursive,
        // Only `access` asked for: nothing is ever reported, but it runs.
        events: events
            .iter()
            .filter_map(|e| kind_of(e).map(crate::service::watches::wire::kind_name))
            .map(str::to_string)
            .fold(Vec::new(), |mut v, e| {
                if !v.contains(&e) {
                    v.push(e);
                }
                v
            }),
        kinds,
        include,
        exclude,
        batch_ms: batch_ms as u32,
        timeout_ms: timeout_ms as u64,
        max_watches: max_watches as u32,
        id: watch_id,
        webhook,
    };
    let w = watches::start(&st, &ctx.key, &id, start).await?;
    Ok(Reply::Json(StatusCode::CREATED, w.info()))
}

pub(super) async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let data = watches::list(&st, &ctx.key, &id)?;
    Reply::ok(json!({ "data": data }))
}

pub(super) async fn events(st: AppState, ctx: Ctx, id: String, w: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let cursor = f.q_int("cursor", 0, i64::MAX).unwrap_or(0) as u64;
    let follow = f.q_bool("follow").unwrap_or(false);
    let wait_ms = f.q_int("waitMs", 0, MAX_WAIT_MS).unwrap_or(0);
    f.finish()?;
    if follow {
        let lines = watches::follow(&st, &ctx.key, &id, &w, cursor)?;
        return Ok(Reply::Raw(ndjson(lines, st.config().heartbeat)));
    }
    let wait = Duration::from_millis(wait_ms as u64);
    Reply::ok(watches::read(&st, &ctx.key, &id, &w, cursor, wait).await?)
}

pub(super) async fn delete(st: AppState, ctx: Ctx, id: String, w: String) -> ApiResult<Reply> {
    let stopped = watches::stop(&st, &ctx.key, &id, &w).await?;
    Reply::ok(json!({ "id": w, "stopped": stopped }))
}
