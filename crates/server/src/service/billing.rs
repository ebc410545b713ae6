//! Spending checks (contract §12, docs/billing.md): `maxCostMicros` and
//! daily spending limits before anything starts, and what `/v1/usage`,
//! `/v1/limits` and `/v1/me` report. The meter that charges is
//! `service/meter.rs`, the arithmetic `domain::money`, the charges
//! `store/charges.rs`.

use runtime_api::codes;
use std::collections::BTreeMap;

use runtime_api::Sandbox;
use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::money::*;
use crate::error::{ApiError, ApiResult, ServerError};
use crate::store::SandboxRow;
use crate::AppState;

/// A key's day: its limit, what it settled in the last 24 hours and what
/// it holds now.
pub(crate) struct Day {
    pub limit: Option<i64>,
    pub settled: i64,
    pub held: i64,
}

/// A key's day as of `now`.
pub(crate) fn day_of(st: &AppState, key_id: &str, now: i64) -> Result<Day, ServerError> {
    let limit = st.store().daily_limit(key_id)?;
    let settled = st.store().settled_since(key_id, minute(now - DAY_MS))?;
    let rows = st.store().live_sandboxes()?;
    let held = held_now(
        &st.config().prices,
        rows.iter()
            .filter(|r| r.key_id == key_id)
            .map(|r| &r.record),
        now,
    );
    Ok(Day {
        limit,
        settled,
        held,
    })
}

fn spending_limit(limit: i64, used: i64, needed: i64) -> ApiError {
    ApiError::PaymentRequired {
        code: codes::SPENDING_LIMIT_REACHED,
        message: format!(
            "This key's daily spending limit ({limit} µ$) would be passed: {used} µ$ used or held in the last 24 hours, {needed} µ$ more needed."
        ),
        hint: "Room comes back as older spending leaves the 24-hour window; a person can raise the limit with `runtime keys limit` on the server.",
        details: json!({
            "limitMicros": limit.to_string(),
            "usedMicros": used.to_string(),
            "neededMicros": needed.to_string(),
        }),
    }
}

/// Refuses a create, wake or extend whose lease (`lease_seconds` at full
/// use) costs more than `maxCostMicros` (409 `budget_exceeded`) or than is
/// left of the key's daily limit (402 `spending_limit_reached`). Called
/// before anything starts, so a refusal costs nothing.
///
/// `lease_seconds` is the lease `maxCostMicros` bounds; `new_seconds` the
/// full-use seconds this call adds to what the key holds (an extend adds
/// only its own seconds; a fork of n copies, n leases).
pub(crate) fn check_spend(
    st: &AppState,
    key_id: &str,
    s: &Sandbox,
    lease_seconds: i64,
    new_seconds: i64,
) -> ApiResult<()> {
    let prices = &st.config().prices;
    let lease_cost = full_cost_micros(prices, s, lease_seconds);
    let needed = full_cost_micros(prices, s, new_seconds);
    if let Some(max) = s.max_cost_micros {
        let needed = lease_cost;
        if needed > max {
            return Err(ApiError::Conflict {
                code: codes::BUDGET_EXCEEDED,
                message: format!(
                    "The lease of {lease_seconds} s could cost {needed} µ$ at full use, more than maxCostMicros ({max})."
                ),
                details: Some(json!({
                    "maxCostMicros": max,
                    "leaseCostMicros": needed,
                    "leaseSeconds": lease_seconds,
                })),
            });
        }
    }
    let Day {
        limit,
        settled,
        held,
    } = day_of(st, key_id, st.now_ms())?;
    if let Some(limit) = limit {
        let used = settled + held;
        if settled >= limit || used.saturating_add(needed) > limit {
            return Err(spending_limit(limit, used, needed));
        }
    }
    Ok(())
}

/// A running sandbox's lease replaced by one of `seconds` from now (a wake
/// of an awake sandbox, or `:update` of `timeoutSeconds`): checked like an
/// extend, for the seconds it adds beyond what is held.
pub(crate) fn check_lease_change(st: &AppState, row: &SandboxRow, seconds: u32) -> ApiResult<()> {
    let seconds = i64::from(seconds);
    let left = if row.record.state == SandboxState::Running {
        lease_left_seconds(&row.record, st.now_ms())
    } else {
        first_lease_seconds(row.record.timeout_seconds)
    };
    check_spend(
        st,
        &row.key_id,
        &row.record,
        seconds,
        (seconds - left).max(0),
    )
}

/// What one key was charged and holds (`/v1/usage`).
pub(crate) struct KeyUsage {
    pub id: String,
    pub name: Option<String>,
    pub spent: i64,
    pub last_day: i64,
    pub held: i64,
}

/// What one sandbox was charged and holds; `state` is `None` once deleted.
pub(crate) struct SandboxUsage {
    pub id: String,
    pub name: Option<String>,
    pub key_id: String,
    pub state: Option<SandboxState>,
    pub charged: i64,
    pub held: i64,
}

pub(crate) struct Usage {
    pub keys: Vec<KeyUsage>,
    pub sandboxes: Vec<SandboxUsage>,
}

/// What was charged and is held, per key and per sandbox, for what `key`
/// sees (its own; everything for account-wide and read-only keys).
pub(crate) fn usage(st: &AppState, key: &KeyInfo) -> ApiResult<Usage> {
    let now = st.now_ms();
    let sees_all = key.account_wide || key.read_only;
    let live = st.store().live_sandboxes()?;
    let live: Vec<&SandboxRow> = live
        .iter()
        .filter(|r| crate::domain::access::visible(key, &r.key_id))
        .collect();
    let mut keys: BTreeMap<String, KeyUsage> = BTreeMap::new();
    for (id, name) in st.store().key_names()? {
        if sees_all || id == key.id {
            keys.insert(
                id.clone(),
                KeyUsage {
                    id,
                    name,
                    spent: 0,
                    last_day: 0,
                    held: 0,
                },
            );
        }
    }
    let mut charged: BTreeMap<String, (String, i64)> = BTreeMap::new();
    for c in st.store().charges_by_sandbox(minute(now - DAY_MS))? {
        if let Some(k) = keys.get_mut(&c.key_id) {
            k.spent += c.total;
            k.last_day += c.since;
            charged.insert(c.sandbox_id, (c.key_id, c.total));
        }
    }
    for r in &live {
        if let Some(k) = keys.get_mut(&r.key_id) {
            k.held += r.record.held_micros;
        }
    }
    let mut sandboxes = Vec::new();
    for r in &live {
        sandboxes.push(SandboxUsage {
            id: r.record.id.clone(),
            name: r.record.name.clone(),
            key_id: r.key_id.clone(),
            state: Some(r.record.state),
            charged: r.record.charged_micros,
            held: r.record.held_micros,
        });
        charged.remove(&r.record.id);
    }
    // Deleted sandboxes keep their charges.
    for (id, (key_id, spent)) in charged {
        sandboxes.push(SandboxUsage {
            id,
            name: None,
            key_id,
            state: None,
            charged: spent,
            held: 0,
        });
    }
    Ok(Usage {
        keys: keys.into_values().collect(),
        sandboxes,
    })
}

/// The name the key was made with, if any.
pub(crate) fn key_name(st: &AppState, key: &KeyInfo) -> ApiResult<Option<String>> {
    Ok(st.store().key_name(&key.id)?)
}
