//! The account's usage beyond charges (docs/billing.md): each key's
//! outbound bytes this month, its API answers per hour, and the export of
//! settled charges.
//!
//! Neither counter writes the store on the path that counts: the request
//! path adds to an in-memory batch under a short mutex, the egress proxy to
//! per-sandbox atomics, and [`run`] moves both into the store every few
//! seconds (and once more on shutdown).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use time::OffsetDateTime;

use crate::domain::access::KeyInfo;
use crate::domain::money::outbound_cost;
use crate::error::ServerError;
use crate::store::{ChargeRow, RequestCount};

/// One settled row of the export: a sandbox's minute of charges.
pub(crate) type ExportRow = ChargeRow;
use crate::AppState;

/// How often the batches are written to the store.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_secs(5);

pub(crate) const HOUR_MS: i64 = 3_600_000;

/// Hours of API answers kept: 90 days, the longest range asked for.
pub(crate) const KEEP_HOURS: i64 = 90 * 24;

/// `[calls, clientErrors, serverErrors]`.
type Classes = [u64; 3];

/// API answers not yet in the store, per (hour, key, operation). Its size
/// is bounded by the keys (only a person makes them) times the fixed set of
/// operation names times the hours between two flushes.
#[derive(Default)]
pub(crate) struct RequestBatch {
    counts: Mutex<HashMap<(i64, String, String), Classes>>,
}

impl RequestBatch {
    /// Counts one authenticated answer of `key_id` with `status`.
    pub(crate) fn record(&self, now_ms: i64, key_id: &str, operation: String, status: u16) {
        let hour = now_ms.div_euclid(HOUR_MS);
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let c = m.entry((hour, key_id.to_string(), operation)).or_default();
        c[0] += 1;
        match status {
            400..=499 => c[1] += 1,
            500..=599 => c[2] += 1,
            _ => {}
        }
    }

    fn take(&self) -> Vec<RequestCount> {
        let m = std::mem::take(&mut *self.counts.lock().unwrap_or_else(|p| p.into_inner()));
        m.into_iter()
            .map(|((hour, key_id, operation), c)| RequestCount {
                hour,
                key_id,
                operation,
                calls: c[0],
                client_errors: c[1],
                server_errors: c[2],
            })
            .collect()
    }
}

/// `YYYYMM` of the calendar month (UTC) of `ms`, and when it began.
pub(crate) fn month_of(ms: i64) -> (i64, i64) {
    let t = OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let start = t
        .replace_day(1)
        .map(|d| d.replace_time(time::Time::MIDNIGHT))
        .unwrap_or(t);
    (
        i64::from(t.year()) * 100 + i64::from(u8::from(t.month())),
        (start.unix_timestamp_nanos() / 1_000_000) as i64,
    )
}

/// When the month after the one that began at `start_ms` begins.
fn next_month(start_ms: i64) -> i64 {
    // 32 days on is always inside the next month.
    month_of(start_ms + 32 * 86_400_000).1
}

/// Moves the counted answers and the egress proxy's outbound bytes into
/// the store. What the store refuses is logged and dropped, so the batches
/// stay bounded.
pub(crate) fn flush(st: &AppState) -> Result<(), ServerError> {
    let now = st.now_ms();
    let counts = st.inner.requests.take();
    let keep_from = now.div_euclid(HOUR_MS) - KEEP_HOURS;
    let requests = st.store().add_request_counts(&counts, keep_from);
    let sent = st.host().take_egress_outbound();
    let outbound = if sent.is_empty() {
        Ok(0)
    } else {
        st.store().add_outbound(month_of(now).0, &sent)
    };
    requests?;
    outbound.map(|_| ())
}

/// Days after which a sandbox's charges per minute are folded into one
/// row per UTC day (docs/billing.md, "The settled-usage export").
pub(crate) const FOLD_AFTER_DAYS: i64 = 35;

const DAY_MS: i64 = 86_400_000;

/// Folds the charges of the days that ended [`FOLD_AFTER_DAYS`] ago or
/// earlier into a row per sandbox and day, once per UTC day (`folded` is
/// the day it last ran).
async fn fold_old_charges(st: &AppState, folded: &mut Option<i64>) {
    let today = st.now_ms().div_euclid(DAY_MS);
    if *folded == Some(today) {
        return;
    }
    // One control plane folds a day's charges (the others see it done).
    match st.store().hold_lease("fold", st.now_ms(), 3_600_000) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::error!(error = %e, "taking the fold lease failed");
            return;
        }
    }
    // The first fold of a store kept for months is long: off the workers.
    let st2 = st.clone();
    let cutoff = (today - FOLD_AFTER_DAYS) * 1440;
    let done = tokio::task::spawn_blocking(move || st2.store().fold_charges(cutoff)).await;
    match done {
        Ok(Ok(n)) => {
            *folded = Some(today);
            if n > 0 {
                tracing::info!(rows = n, "folded old charges by day");
            }
        }
        Ok(Err(e)) => tracing::error!(error = %e, "folding old charges failed"),
        Err(e) => tracing::error!(error = %e, "folding old charges failed"),
    }
}

/// Flushes every [`FLUSH_EVERY`] until the server stops, then once more;
/// folds old charges by day once a day.
pub(crate) async fn run(st: AppState) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut folded = None;
    loop {
        fold_old_charges(&st, &mut folded).await;
        let stop = tokio::select! {
            _ = tick.tick() => false,
            _ = st.inner.cancel.cancelled() => true,
        };
        if let Err(e) = flush(&st) {
            tracing::error!(error = %e, "writing usage counters failed");
        }
        if stop {
            return;
        }
    }
}

/// Whether `key` sees every key's usage (account-wide and read-only keys,
/// as `billing::usage`), or only its own.
pub(crate) fn sees_all(key: &KeyInfo) -> bool {
    key.account_wide || key.read_only
}

/// One key's outbound month.
pub(crate) struct KeyOutbound {
    pub key_id: String,
    pub bytes: u64,
    pub covered: u64,
    pub charged: i64,
}

/// This month's outbound traffic of the keys `key` sees: the month's
/// start and end, and per key what was sent, what its allowance covered and
/// what the rest cost.
pub(crate) fn outbound(
    st: &AppState,
    key: &KeyInfo,
) -> Result<(i64, i64, Vec<KeyOutbound>), ServerError> {
    // Bytes still in the proxy's counters count as sent.
    flush(st)?;
    let (month, start) = month_of(st.now_ms());
    let prices = &st.config().prices;
    let rows = st
        .store()
        .outbound_by_key(month)?
        .into_iter()
        .filter(|(k, _)| sees_all(key) || *k == key.id)
        .map(|(key_id, bytes)| {
            let (covered, charged) = outbound_cost(prices, bytes);
            KeyOutbound {
                key_id,
                bytes,
                covered,
                charged,
            }
        })
        .collect();
    Ok((start, next_month(start), rows))
}

/// The hours a range covers, the current partial one included.
pub(crate) fn range_hours(range: &str) -> Option<i64> {
    match range {
        "24h" => Some(24),
        "7d" => Some(7 * 24),
        "30d" => Some(30 * 24),
        "90d" => Some(KEEP_HOURS),
        _ => None,
    }
}

/// Answers counted for one operation or one hour.
#[derive(Default, Clone, Copy)]
pub(crate) struct Tally {
    pub calls: u64,
    pub client_errors: u64,
    pub server_errors: u64,
}

impl Tally {
    fn add(&mut self, c: &RequestCount) {
        self.calls += c.calls;
        self.client_errors += c.client_errors;
        self.server_errors += c.server_errors;
    }
}

pub(crate) struct Requests {
    pub since: i64,
    pub until: i64,
    pub total: Tally,
    pub operations: BTreeMap<String, Tally>,
    pub hours: BTreeMap<i64, Tally>,
}

/// The answers of the keys `key` sees in the last `hours` hours (the
/// current one partly).
pub(crate) fn requests(st: &AppState, key: &KeyInfo, hours: i64) -> Result<Requests, ServerError> {
    flush(st)?;
    let now = st.now_ms();
    let from = now.div_euclid(HOUR_MS) - hours + 1;
    let who = (!sees_all(key)).then_some(key.id.as_str());
    let mut r = Requests {
        since: from * HOUR_MS,
        until: now,
        total: Tally::default(),
        operations: BTreeMap::new(),
        hours: BTreeMap::new(),
    };
    for c in st.store().request_counts(from, who)? {
        r.total.add(&c);
        r.hours.entry(c.hour).or_default().add(&c);
        r.operations.entry(c.operation.clone()).or_default().add(&c);
    }
    Ok(r)
}

/// How long after a minute ends its charges are taken as settled: the
/// meter's tick that read the clock in that minute may still be writing.
pub(crate) const SETTLE_MARGIN_MS: i64 = 10_000;

pub(crate) const EXPORT_DEFAULT_LIMIT: i64 = 1_000;
pub(crate) const EXPORT_MAX_LIMIT: i64 = 10_000;

/// One page of settled charges of the keys `key` sees, whose minute ended
/// in `[since, until)` and by now: the rows (one more than `limit` when
/// there are more) and the time through which the range is final.
pub(crate) fn export_page(
    st: &AppState,
    key: &KeyInfo,
    since: i64,
    until: i64,
    after: Option<&(i64, String)>,
    limit: usize,
) -> Result<(Vec<ChargeRow>, i64), ServerError> {
    let settled = st.now_ms() - SETTLE_MARGIN_MS;
    let final_through = until.min(settled).max(since);
    let who = (!sees_all(key)).then_some(key.id.as_str());
    let rows = st
        .store()
        .charge_rows(since, final_through, who, after, limit + 1)?;
    Ok((rows, final_through))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_begin_on_the_first_at_midnight_utc() {
        // 2026-12-03T07:32:22Z
        let (m, start) = month_of(1_796_283_142_000);
        assert_eq!(m, 202_612);
        assert_eq!(crate::domain::time::iso(start), "2026-12-01T00:00:00.000Z");
        assert_eq!(
            crate::domain::time::iso(next_month(start)),
            "2027-01-01T00:00:00.000Z"
        );
        let (m, start) = month_of(start - 1);
        assert_eq!(m, 202_611);
        assert_eq!(crate::domain::time::iso(start), "2026-11-01T00:00:00.000Z");
    }

    #[test]
    fn answers_are_counted_by_hour_key_operation_and_class() {
        let b = RequestBatch::default();
        for status in [200, 201, 404, 400, 503, 101] {
            b.record(HOUR_MS * 10 + 5, "k1", "sandboxes.create".into(), status);
        }
        b.record(HOUR_MS * 11, "k1", "sandboxes.create".into(), 200);
        b.record(HOUR_MS * 10, "k2", "sandboxes.create".into(), 500);
        let mut got = b.take();
        got.sort_by(|a, b| (a.hour, &a.key_id).cmp(&(b.hour, &b.key_id)));
        let tuples: Vec<_> = got
            .iter()
            .map(|c| {
                (
                    c.hour,
                    c.key_id.as_str(),
                    c.calls,
                    c.client_errors,
                    c.server_errors,
                )
            })
            .collect();
        assert_eq!(
            tuples,
            vec![
                (10, "k1", 6, 2, 1),
                (10, "k2", 1, 0, 1),
                (11, "k1", 1, 0, 0)
            ]
        );
        assert!(b.take().is_empty());
    }
}
