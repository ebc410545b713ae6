//! `GET /v1/sandboxes/{id}/console?bytes`: the tail of a sandbox's serial
//! console, for the web console's sandbox page. Read-only keys are refused
//! (`route::reveals_contents`): the guest writes there.

use serde_json::json;

use crate::error::ApiResult;
use crate::http::extract::{query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::console::{self as svc, MAX_TAIL_BYTES};
use crate::AppState;

pub(super) async fn log(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let bytes = f
        .q_int("bytes", 1, MAX_TAIL_BYTES as i64)
        .unwrap_or(64 << 10) as usize;
    f.finish()?;
    let (id, text) = svc::tail(&st, &ctx.key, &id, bytes).await?;
    Reply::ok(json!({ "sandboxId": id, "bytes": bytes, "text": text }))
}

/// `GET /v1/usage/daily?days`: `{days: [{date, spentMicros, keys: [{keyId,
/// name, spentMicros}]}]}`, oldest first, one row per UTC day with spending
/// (`days` 1–90, 30 by default), over the keys `GET /v1/usage` shows.
pub(super) async fn usage_daily(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let days = f.q_int("days", 1, svc::MAX_DAYS).unwrap_or(30);
    f.finish()?;
    let names = svc::key_names(&st)?;
    let mut out: Vec<serde_json::Value> = Vec::new();
    let mut current: Option<(i64, i64, Vec<serde_json::Value>)> = None;
    let flush = |c: Option<(i64, i64, Vec<serde_json::Value>)>, out: &mut Vec<_>| {
        if let Some((day, total, keys)) = c {
            out.push(json!({
                "date": date_of_day(day),
                "spentMicros": total.to_string(),
                "keys": keys,
            }));
        }
    };
    for d in svc::spend_by_day(&st, &ctx.key, days)? {
        if current.as_ref().is_some_and(|c| c.0 != d.day) {
            flush(current.take(), &mut out);
        }
        let c = current.get_or_insert((d.day, 0, Vec::new()));
        c.1 += d.micros;
        c.2.push(json!({
            "keyId": d.key_id,
            "name": names.get(&d.key_id).cloned().flatten(),
            "spentMicros": d.micros.to_string(),
        }));
    }
    flush(current, &mut out);
    Reply::ok(json!({ "days": out }))
}

/// `YYYY-MM-DD` of a day counted from 1970-01-01.
fn date_of_day(day: i64) -> String {
    crate::domain::time::iso(day * 86_400_000)
        .chars()
        .take(10)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::date_of_day;

    #[test]
    fn days_are_utc_dates() {
        assert_eq!(date_of_day(0), "1970-01-01");
        assert_eq!(date_of_day(19_782), "2024-02-29");
    }
}
