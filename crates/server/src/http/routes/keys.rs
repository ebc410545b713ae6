//! `/v1/keys`: this server's own key management, what the console's keys
//! page calls (docs/keys.md). `GET` lists, `POST` makes a key (shown once),
//! `POST /v1/keys/{k}:revoke` and `:limit {dailyLimitMicros}` change one.
//! Runtime Cloud has no such routes (its keys are managed on its website);
//! who may do what is `service::keys::api`'s.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, Fields};
use crate::http::{Ctx, Reply};
use crate::service::keys::api::{self as svc, NewKey};
use crate::service::keys::KeyRecord;
use crate::AppState;

/// Names as the approval page takes them.
const MAX_NAME_CHARS: usize = 100;
/// A daily limit at most a million dollars, in microdollars.
const MAX_LIMIT_MICROS: i64 = 1_000_000_000_000;

fn wire(k: &KeyRecord, ctx: &Ctx) -> Value {
    json!({
        "id": k.id,
        "name": k.name,
        "access": if k.read_only { "read" } else { "full" },
        "accountWide": k.account_wide,
        "dailyLimitMicros": k.daily_limit_micros,
        "quotas": k.quotas,
        "createdAt": k.created_at,
        "revokedAt": k.revoked_at,
        "current": k.id == ctx.key.id,
    })
}

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let data: Vec<Value> = svc::list(&st, &ctx.key)?
        .iter()
        .map(|k| wire(k, &ctx))
        .collect();
    Reply::ok(json!({ "data": data }))
}

/// `dailyLimitMicros`: a whole number of microdollars, or null for none.
fn limit(f: &mut Fields) -> Option<i64> {
    f.int("dailyLimitMicros", 0, MAX_LIMIT_MICROS)
}

pub(super) async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let name = f.string("name").map(|n| n.trim().to_string());
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
    let read_only = f.bool("readOnly").unwrap_or(false);
    let account_wide = f.bool("accountWide").unwrap_or(false);
    if read_only && account_wide {
        f.issue(
            "accountWide",
            "a read-only key already sees every sandbox and is never account-wide",
        );
    }
    let daily_limit_micros = limit(&mut f);
    f.finish()?;
    let req = NewKey {
        name,
        read_only,
        account_wide,
        daily_limit_micros,
    };
    let (record, secret) = svc::create(&st, &ctx.key, req)?;
    Ok(Reply::shown_once(
        StatusCode::CREATED,
        wire(&record, &ctx),
        "key",
        secret,
        Some("keyRedacted"),
    ))
}

pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let record = match verb.as_str() {
        "revoke" => {
            no_fields(&body)?;
            svc::revoke(&st, &ctx.key, &id)?
        }
        "limit" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            if !f.present("dailyLimitMicros") {
                f.issue(
                    "dailyLimitMicros",
                    "is required: microdollars, or null for no limit",
                );
            }
            let micros = limit(&mut f);
            f.finish()?;
            svc::set_limit(&st, &ctx.key, &id, micros)?
        }
        _ => {
            return Err(ApiError::RouteNotFound {
                method: "POST".into(),
                path: format!("/v1/keys/{id}:{verb}"),
            })
        }
    };
    Reply::ok(wire(&record, &ctx))
}
