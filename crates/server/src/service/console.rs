//! What the web console reads that no other route answers: the tail of a
//! sandbox's serial console (its kernel's messages), as its host keeps it.

use crate::domain::access::KeyInfo;
use crate::error::ApiResult;
use crate::service::sandboxes;
use crate::AppState;

/// Most of the console one answer carries.
pub(crate) const MAX_TAIL_BYTES: usize = 256 << 10;

/// The sandbox's id and the last `max_bytes` of its console (empty when
/// its host keeps none, e.g. before its first boot or after a delete).
pub(crate) async fn tail(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    max_bytes: usize,
) -> ApiResult<(String, String)> {
    let row = sandboxes::find(st, key, id)?;
    let text = st
        .host()
        .console_tail(&row.record.id, max_bytes.min(MAX_TAIL_BYTES))
        .await
        .unwrap_or_default();
    Ok((row.record.id, text))
}

/// Days of spending one answer covers at most.
pub(crate) const MAX_DAYS: i64 = 90;

/// One UTC day's spending of one key.
pub(crate) struct DaySpend {
    /// Days since 1970-01-01.
    pub day: i64,
    pub key_id: String,
    pub micros: i64,
}

/// What the keys `key` sees spent per UTC day, the last `days` days (today
/// included), oldest first: its own, or every key's for account-wide and
/// read-only keys (as `GET /v1/usage`).
pub(crate) fn spend_by_day(st: &AppState, key: &KeyInfo, days: i64) -> ApiResult<Vec<DaySpend>> {
    let today = st.now_ms().div_euclid(86_400_000);
    let first = today - days.clamp(1, MAX_DAYS) + 1;
    Ok(st
        .store()
        .charges_by_day(first * 1440 - 1)?
        .into_iter()
        .filter(|(_, k, _)| crate::domain::access::visible(key, k))
        .map(|(day, key_id, micros)| DaySpend {
            day,
            key_id,
            micros,
        })
        .collect())
}

/// Every key's name by id.
pub(crate) fn key_names(
    st: &AppState,
) -> ApiResult<std::collections::HashMap<String, Option<String>>> {
    Ok(st.store().key_names()?.into_iter().collect())
}
