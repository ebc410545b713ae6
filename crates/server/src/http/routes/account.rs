//! `GET /v1/usage`, `/v1/limits`, `/v1/me` (contract §12).

use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::error::ApiResult;
use crate::http::{Ctx, Reply};
use crate::service::billing::{self, Day};
use crate::AppState;

fn access(key: &KeyInfo) -> &'static str {
    if key.read_only {
        "read"
    } else {
        "full"
    }
}

/// `GET /v1/limits`: this key's access, daily limit and quotas.
pub(super) async fn limits(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let Day {
        limit,
        settled,
        held,
    } = billing::day_of(&st, &ctx.key.id, st.now_ms())?;
    let used = settled + held;
    Reply::ok(json!({
        "access": access(&ctx.key),
        "daily": {
            "limitMicros": limit.map(|l| l.to_string()),
            "usedMicros": used.to_string(),
            "settledMicros": settled.to_string(),
            "heldMicros": held.to_string(),
            "remainingMicros": limit.map(|l| (l - used).max(0).to_string()),
            "window": "24h",
        },
        "trial": Value::Null,
        "account": crate::service::quotas::rows(&st, &ctx.key.id)?,
    }))
}

/// `GET /v1/me`: who this key is. One server is one organization.
pub(super) async fn me(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let name = billing::key_name(&st, &ctx.key)?;
    let role = if ctx.key.read_only {
        "viewer"
    } else if ctx.key.account_wide {
        "admin"
    } else {
        "developer"
    };
    Reply::ok(json!({
        "orgId": "local",
        "orgName": "local",
        "principalId": ctx.key.id,
        "credentialId": ctx.key.id,
        "credentialName": name,
        "role": role,
        "access": access(&ctx.key),
        "accountWide": ctx.key.account_wide,
    }))
}

/// `GET /v1/usage`: what was charged and is held, per key and per sandbox,
/// for what this key sees (its own; everything for account-wide and
/// read-only keys).
pub(super) async fn usage(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let u = billing::usage(&st, &ctx.key)?;
    let spent: i64 = u.keys.iter().map(|k| k.spent).sum();
    let held: i64 = u.keys.iter().map(|k| k.held).sum();
    let per_sandbox: Vec<Value> = u
        .sandboxes
        .iter()
        .map(|s| {
            json!({
                "sandboxId": s.id,
                "name": s.name,
                "keyId": s.key_id,
                "state": s.state.map_or("deleted", |x| x.as_str()),
                "chargedMicros": s.charged.to_string(),
                "heldMicros": s.held.to_string(),
            })
        })
        .collect();
    let per_key: Vec<Value> = u
        .keys
        .iter()
        .map(|k| {
            json!({
                "keyId": k.id,
                "name": k.name,
                "spentMicros": k.spent.to_string(),
                "heldMicros": k.held.to_string(),
                "last24hMicros": k.last_day.to_string(),
            })
        })
        .collect();
    let p = &st.config().prices;
    Reply::ok(json!({
        "spent": spent.to_string(),
        "held": held.to_string(),
        "credited": "0",
        "expired": "0",
        "takenBack": "0",
        "available": Value::Null,
        "trial": Value::Null,
        "keys": per_key,
        "sandboxes": per_sandbox,
        "rates": {
            "compute": {
                "cpuMicrosPerVcpuHour": p.cpu_vcpu_hour.to_string(),
                "memoryMicrosPerGibHour": p.memory_gib_hour.to_string(),
            },
            "storage": {
                "pausedMicrosPerGibHour": p.paused_gib_hour.to_string(),
                "provisionedMicrosPerGibHour": p.kept_disk_gib_hour.to_string(),
            },
        },
    }))
}
