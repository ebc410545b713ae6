//! `GET /v1/usage`, `/v1/usage/requests`, `/v1/usage/export`,
//! `/v1/limits`, `/v1/me` (contract §12, docs/billing.md).

use base64::Engine;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::billing::{self, Day};
use crate::service::usage::{self, ExportRow, Tally};
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
/// and this month's outbound traffic, for what this key sees (its own;
/// everything for account-wide and read-only keys).
pub(super) async fn usage(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let u = billing::usage(&st, &ctx.key)?;
    // `available`: what this key's own daily limit leaves, as `/v1/limits`
    // says; without a limit, nothing bounds it here.
    let day = billing::day_of(&st, &ctx.key.id, st.now_ms())?;
    let available = day
        .limit
        .map(|l| (l - day.settled - day.held).max(0).to_string());
    let outbound = outbound_json(&st, &ctx.key, &u.keys)?;
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
        "available": available,
        "trial": Value::Null,
        "keys": per_key,
        "sandboxes": per_sandbox,
        "outbound": outbound,
        "rates": {
            "egress": {
                "outbound": {
                    "microsPerGib": p.outbound_gib.to_string(),
                    "allowanceBytes": p.outbound_allowance_bytes.to_string(),
                },
            },
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

/// `outbound` of `GET /v1/usage`: this calendar month's (UTC) bytes the
/// sandboxes of the keys `key` sees sent out, each key's allowance and what
/// went past it cost.
fn outbound_json(st: &AppState, key: &KeyInfo, names: &[billing::KeyUsage]) -> ApiResult<Value> {
    let (start, end, rows) = usage::outbound(st, key)?;
    let p = &st.config().prices;
    let (mut bytes, mut covered, mut charged) = (0u64, 0u64, 0i64);
    let keys: Vec<Value> = rows
        .iter()
        .map(|r| {
            bytes = bytes.saturating_add(r.bytes);
            covered = covered.saturating_add(r.covered);
            charged = charged.saturating_add(r.charged);
            json!({
                "keyId": r.key_id,
                "name": names.iter().find(|k| k.id == r.key_id).and_then(|k| k.name.clone()),
                "bytes": r.bytes.to_string(),
                "coveredBytes": r.covered.to_string(),
                "chargedMicros": r.charged.to_string(),
            })
        })
        .collect();
    Ok(json!({
        "month": iso(start).chars().take(7).collect::<String>(),
        "since": iso(start),
        "until": iso(end),
        "bytes": bytes.to_string(),
        "allowanceBytes": p.outbound_allowance_bytes.to_string(),
        "coveredBytes": covered.to_string(),
        "chargedBytes": (bytes - covered).to_string(),
        "chargedMicros": charged.to_string(),
        "microsPerGib": p.outbound_gib.to_string(),
        "keys": keys,
    }))
}

fn tally_json(t: &Tally) -> serde_json::Map<String, Value> {
    let errors = t.client_errors + t.server_errors;
    let percent = if t.calls == 0 {
        Value::Null
    } else {
        // Two decimals, as a number.
        let hundredths = (u128::from(errors) * 10_000 / u128::from(t.calls)) as f64;
        json!(hundredths / 100.0)
    };
    let mut m = serde_json::Map::new();
    m.insert("calls".into(), t.calls.to_string().into());
    m.insert("clientErrors".into(), t.client_errors.to_string().into());
    m.insert("serverErrors".into(), t.server_errors.to_string().into());
    m.insert("errorPercent".into(), percent);
    m
}

/// `GET /v1/usage/requests?range=24h|7d|30d|90d`: the authenticated API
/// answers of the keys this key sees, in all, per operation and per hour.
pub(super) async fn usage_requests(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let range = f
        .one_of("range", &["24h", "7d", "30d", "90d"])
        .unwrap_or_else(|| "24h".into());
    f.finish()?;
    let hours = usage::range_hours(&range).unwrap_or(24);
    let r = usage::requests(&st, &ctx.key, hours)?;
    let mut out = tally_json(&r.total);
    out.insert("range".into(), range.into());
    out.insert("since".into(), iso(r.since).into());
    out.insert("until".into(), iso(r.until).into());
    let operations: Vec<Value> = r
        .operations
        .iter()
        .map(|(op, t)| {
            let mut m = tally_json(t);
            m.insert("operation".into(), op.clone().into());
            Value::Object(m)
        })
        .collect();
    let per_hour: Vec<Value> = r
        .hours
        .iter()
        .map(|(h, t)| {
            let mut m = tally_json(t);
            m.insert("hour".into(), iso(h * usage::HOUR_MS).into());
            Value::Object(m)
        })
        .collect();
    out.insert("operations".into(), operations.into());
    out.insert("hours".into(), per_hour.into());
    Reply::ok(Value::Object(out))
}

/// The export's columns, in order; `csv` has a header of these on the
/// first page.
const EXPORT_COLUMNS: &[&str] = &[
    "intervalId",
    "resourceId",
    "keyId",
    "name",
    "kind",
    "meter",
    "fundedBy",
    "startsAt",
    "endsAt",
    "settledAt",
    "billedMilliseconds",
    "chargedMicros",
    "quotedRates",
    "measurementsJson",
    "evidence",
    "final",
];

const CURSOR_PREFIX: &str = "export:";

fn export_cursor(minute: i64, sandbox_id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(format!("{CURSOR_PREFIX}{minute}:{sandbox_id}"))
}

fn parse_export_cursor(c: &str) -> Option<(i64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .ok()?;
    let s = std::str::from_utf8(&raw).ok()?;
    let (minute, id) = s.strip_prefix(CURSOR_PREFIX)?.split_once(':')?;
    let minute = minute.parse::<i64>().ok()?;
    (!id.is_empty()).then(|| (minute, id.to_string()))
}

/// A UTC time in RFC 3339 ending in `Z`, as milliseconds.
fn utc_field(f: &mut Fields<'_>, name: &str) -> Option<i64> {
    let Some(s) = f.string(name) else {
        if !f.present(name) {
            f.issue(name, "is required: a UTC time such as 2026-09-01T00:00:00Z");
        }
        return None;
    };
    match parse_iso_ms(&s) {
        Some(ms) if s.ends_with('Z') => Some(ms),
        _ => {
            f.issue(
                name,
                "must be a UTC time in RFC 3339 ending in Z, such as 2026-09-01T00:00:00Z",
            );
            None
        }
    }
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv_field(out: &mut String, v: &str) {
    if v.contains([',', '"', '\n', '\r']) {
        out.push('"');
        out.push_str(&v.replace('"', "\"\""));
        out.push('"');
    } else {
        out.push_str(v);
    }
}

fn quoted_rates(st: &AppState) -> Value {
    let p = &st.config().prices;
    json!([
        {"meter": "cpu", "unit": "vcpu-hour", "micros": p.cpu_vcpu_hour.to_string()},
        {"meter": "memory", "unit": "gib-hour", "micros": p.memory_gib_hour.to_string()},
        {"meter": "paused", "unit": "gib-hour", "micros": p.paused_gib_hour.to_string()},
        {"meter": "provisioned", "unit": "gib-hour", "micros": p.kept_disk_gib_hour.to_string()},
    ])
}

fn export_row(r: &ExportRow, rates: &Value) -> Value {
    let start = r.minute * 60_000;
    let end = start + r.minutes.max(1) * 60_000;
    json!({
        "intervalId": format!("{}:{}", r.sandbox_id, r.minute),
        "resourceId": r.sandbox_id,
        "keyId": r.key_id,
        "name": r.name,
        "kind": "sandbox",
        "meter": "runtime",
        "fundedBy": "account",
        "startsAt": iso(start),
        "endsAt": iso(end),
        "settledAt": iso(end),
        "billedMilliseconds": r.billed_ms.to_string(),
        "chargedMicros": r.micros.to_string(),
        "quotedRates": rates,
        "measurementsJson": Value::Null,
        "evidence": "measured",
        "final": r.ended,
    })
}

fn csv_line(out: &mut String, row: &Value) {
    for (i, col) in EXPORT_COLUMNS.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match &row[*col] {
            Value::Null => {}
            Value::String(s) => csv_field(out, s),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            other => csv_field(out, &other.to_string()),
        }
    }
    out.push('\n');
}

/// `GET /v1/usage/export?since&until&cursor&limit`: one page of the
/// settled charges of the keys this key sees, one row per sandbox and
/// minute, whose minute ended at `since` or later and before `until`.
pub(super) async fn usage_export(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let since = utc_field(&mut f, "since");
    let until = utc_field(&mut f, "until");
    let limit = f
        .q_int("limit", 1, usage::EXPORT_MAX_LIMIT)
        .unwrap_or(usage::EXPORT_DEFAULT_LIMIT);
    let after = match f.string("cursor") {
        Some(c) => {
            let parsed = parse_export_cursor(&c);
            if parsed.is_none() {
                f.issue("cursor", "is not a cursor this server gave");
            }
            parsed
        }
        None => None,
    };
    if let (Some(s), Some(u)) = (since, until) {
        if u <= s {
            f.issue("until", "must be after since");
        }
    }
    f.finish()?;
    let (Some(since), Some(until)) = (since, until) else {
        return Err(ApiError::invalid("since", "is required"));
    };
    let limit = usize::try_from(limit).unwrap_or(1);
    let (mut rows, final_through) =
        usage::export_page(&st, &ctx.key, since, until, after.as_ref(), limit)?;
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last().map(|r| export_cursor(r.minute, &r.sandbox_id))
    } else {
        None
    };
    let rates = quoted_rates(&st);
    let data: Vec<Value> = rows.iter().map(|r| export_row(r, &rates)).collect();
    let mut csv = String::new();
    if after.is_none() {
        csv.push_str(&EXPORT_COLUMNS.join(","));
        csv.push('\n');
    }
    for row in &data {
        csv_line(&mut csv, row);
    }
    Reply::ok(json!({
        "since": iso(since),
        "until": iso(until),
        "finalThrough": iso(final_through),
        "nextCursor": next,
        "csv": csv,
        "data": data,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_cursors_round_trip_and_refuse_anything_else() {
        let c = export_cursor(29_000_000, "sbx_a:b");
        assert_eq!(
            parse_export_cursor(&c),
            Some((29_000_000, "sbx_a:b".to_string()))
        );
        assert_eq!(parse_export_cursor("nope"), None);
        assert_eq!(parse_export_cursor(&export_cursor(5, "")), None);
        let other = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("e42");
        assert_eq!(parse_export_cursor(&other), None);
    }

    #[test]
    fn csv_fields_are_quoted_only_when_they_must_be() {
        let mut s = String::new();
        csv_field(&mut s, "plain");
        s.push('|');
        csv_field(&mut s, "a,b");
        s.push('|');
        csv_field(&mut s, "say \"hi\"");
        assert_eq!(s, "plain|\"a,b\"|\"say \"\"hi\"\"\"");
    }
}
