//! Metering and money (contract §12, docs/billing.md): prices, the
//! once-a-second meter, `chargedMicros`/`heldMicros`, `maxCostMicros`,
//! `maxTotalCostMicros`, daily spending limits, and `GET /v1/usage`,
//! `/v1/limits`, `/v1/me`.
//!
//! Money is integer microdollars on the wire. The meter adds each second's
//! exact cost in [`UNITS_PER_MICRO`]ths of a microdollar and settles whole
//! microdollars, keeping the remainder, so a day of seconds charges exactly
//! the closed formula rounded down once, never a rounding per second.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use runtime_api::Sandbox;
use rusqlite::{params, OptionalExtension};
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::time::parse_iso_ms;
use crate::error::{ApiError, ApiResult, ServerError};
use crate::http::{Ctx, Reply};
use crate::store::{store_err, SandboxRow};
use crate::AppState;

/// Exact amounts are counted in this fraction of a microdollar: seconds per
/// hour × nanoseconds per second × MiB per GiB, so one second of any price
/// per vCPU-hour (measured in ns) or per GiB-hour (sized in MiB) is whole.
pub const UNITS_PER_MICRO: i128 = 3_600 * 1_000_000_000 * 1_024;

const NS: i128 = 1_000_000_000;

/// The operator's prices, in microdollars; defaults are Runtime Cloud's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prices {
    /// Per vCPU-hour of measured use (at least the floor) while running.
    pub cpu_vcpu_hour: u64,
    /// Per reserved GiB-hour of memory while running.
    pub memory_gib_hour: u64,
    /// Per GiB-hour of a paused sandbox's saved memory.
    pub paused_gib_hour: u64,
    /// Per GiB-hour of a persistent sandbox's disk, in every state.
    pub kept_disk_gib_hour: u64,
}

impl Default for Prices {
    fn default() -> Self {
        Prices {
            cpu_vcpu_hour: 25_000,
            memory_gib_hour: 7_500,
            paused_gib_hour: 119,
            kept_disk_gib_hour: 153,
        }
    }
}

fn mib_units(mib: u32, price_gib_hour: u64) -> i128 {
    i128::from(mib) * i128::from(price_gib_hour) * NS
}

/// The CPU time one running second is billed for: the measured use, capped
/// at every vCPU busy, and at least the floor (`cpu: "reserved"`: every vCPU).
pub fn billed_cpu_ns(s: &Sandbox, used_ns: u64) -> u64 {
    let all = u64::from(s.vcpu) * 1_000_000_000;
    let floor = if s.cpu == "reserved" {
        all
    } else {
        u64::from(s.cpu_floor_millis) * 1_000_000
    };
    used_ns.min(all).max(floor.min(all))
}

/// One running second of `s` with `used_ns` of vCPU time, in units.
pub fn running_second(p: &Prices, s: &Sandbox, used_ns: u64) -> i128 {
    i128::from(billed_cpu_ns(s, used_ns)) * i128::from(p.cpu_vcpu_hour) * 1_024
        + mib_units(s.memory_mib, p.memory_gib_hour)
        + kept_disk_second(p, s)
}

/// One second of storage a sandbox pays for in any state: its disk while
/// persistent.
fn kept_disk_second(p: &Prices, s: &Sandbox) -> i128 {
    if s.persistent {
        mib_units(s.disk_mib, p.kept_disk_gib_hour)
    } else {
        0
    }
}

/// One second of a sandbox in `state` (storage only unless running).
fn second_in_state(p: &Prices, s: &Sandbox, used_ns: u64) -> i128 {
    match s.state {
        SandboxState::Running => running_second(p, s, used_ns),
        SandboxState::Pausing | SandboxState::Paused | SandboxState::Resuming => {
            mib_units(s.memory_mib, p.paused_gib_hour) + kept_disk_second(p, s)
        }
        _ => kept_disk_second(p, s),
    }
}

/// One running second with every vCPU busy (compute only), in units.
pub fn full_second(p: &Prices, s: &Sandbox) -> i128 {
    i128::from(s.vcpu) * NS * i128::from(p.cpu_vcpu_hour) * 1_024
        + mib_units(s.memory_mib, p.memory_gib_hour)
}

/// `seconds` at full use, in microdollars rounded up.
pub fn full_cost_micros(p: &Prices, s: &Sandbox, seconds: i64) -> i64 {
    let units = full_second(p, s) * i128::from(seconds.max(0));
    i64::try_from((units + UNITS_PER_MICRO - 1) / UNITS_PER_MICRO).unwrap_or(i64::MAX)
}

/// A lease without an end is renewed each hour; this is its length.
pub const OPEN_LEASE_SECONDS: i64 = 3_600;

/// The length of the lease a create or wake starts.
pub fn first_lease_seconds(timeout_seconds: Option<u32>) -> i64 {
    timeout_seconds.map_or(OPEN_LEASE_SECONDS, i64::from)
}

/// Seconds left in the current lease of a running sandbox: to `endsAt`, or
/// to the next hourly renewal since it was ready when it has no end.
pub fn lease_left_seconds(s: &Sandbox, now: i64) -> i64 {
    match s.ends_at.as_deref().and_then(parse_iso_ms) {
        Some(end) => ((end - now).max(0) + 999) / 1000,
        None => {
            let since = s.ready_at.as_deref().and_then(parse_iso_ms).unwrap_or(now);
            let ran = ((now - since).max(0) / 1000) % OPEN_LEASE_SECONDS;
            OPEN_LEASE_SECONDS - ran
        }
    }
}

/// `heldMicros`: what the rest of the current lease could still cost at
/// full use; 0 unless running.
pub fn held_micros(p: &Prices, s: &Sandbox, now: i64) -> i64 {
    if s.state != SandboxState::Running {
        return 0;
    }
    full_cost_micros(p, s, lease_left_seconds(s, now))
}

/// Adds `units` to a remainder below one microdollar: (whole microdollars
/// to settle, new remainder).
pub fn settle(remainder: i128, units: i128) -> (i64, i128) {
    let total = remainder + units;
    (
        i64::try_from(total / UNITS_PER_MICRO).unwrap_or(i64::MAX),
        total % UNITS_PER_MICRO,
    )
}

/// The meter's memory: each running machine's vCPU time already billed.
#[derive(Default)]
pub struct Meter {
    billed_cpu: Mutex<HashMap<String, Duration>>,
    /// Per running sandbox without an end: which hourly lease it is in.
    open_leases: Mutex<HashMap<String, i64>>,
}

impl Meter {
    /// The vCPU time used since the last tick, at most one second of every
    /// vCPU; what is over carries to the next tick. The first reading of a
    /// machine (after a start or a wake) only sets the baseline: booting and
    /// restoring are not billed.
    fn used_ns(&self, id: &str, vcpu: u32, reading: Option<Duration>) -> u64 {
        let mut m = self.billed_cpu.lock().unwrap_or_else(|p| p.into_inner());
        let Some(now) = reading else {
            return 0;
        };
        let Some(last) = m.get(id).copied() else {
            m.insert(id.to_string(), now);
            return 0;
        };
        // A counter that went back belongs to a new machine.
        let (base, delta) = match now.checked_sub(last) {
            Some(d) => (last, d),
            None => (Duration::ZERO, now),
        };
        let used = delta.min(Duration::from_secs(u64::from(vcpu)));
        m.insert(id.to_string(), base + used);
        u64::try_from(used.as_nanos()).unwrap_or(u64::MAX)
    }

    fn forget(&self, id: &str) {
        self.billed_cpu
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.open_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Whether a running sandbox without an end just began a new hourly
    /// lease (a renewal) since the last tick.
    fn renewed(&self, s: &Sandbox, now: i64) -> bool {
        if s.ends_at.is_some() {
            return false;
        }
        let Some(ready) = s.ready_at.as_deref().and_then(parse_iso_ms) else {
            return false;
        };
        let lease = (now - ready).max(0) / 1000 / OPEN_LEASE_SECONDS;
        let mut m = self.open_leases.lock().unwrap_or_else(|p| p.into_inner());
        let before = m.insert(s.id.clone(), lease);
        before.is_some_and(|b| lease > b)
    }
}

fn minute(ms: i64) -> i64 {
    ms / 60_000
}

const DAY_MS: i64 = 24 * 3600 * 1000;

fn db_err(op: &'static str) -> impl FnOnce(rusqlite::Error) -> ServerError {
    store_err(op)
}

/// A key's daily spending limit, if it has one.
pub fn daily_limit(st: &AppState, key_id: &str) -> Result<Option<i64>, ServerError> {
    st.store()
        .conn()
        .query_row(
            "SELECT daily_limit_micros FROM keys WHERE id = ?1",
            params![key_id],
            |r| r.get::<_, Option<i64>>(0),
        )
        .optional()
        .map(Option::flatten)
        .map_err(db_err("read daily limit"))
}

/// Microdollars a key's sandboxes settled in the 24 hours before `now`.
pub fn settled_in_day(st: &AppState, key_id: &str, now: i64) -> Result<i64, ServerError> {
    st.store()
        .conn()
        .query_row(
            "SELECT COALESCE(SUM(micros), 0) FROM charges WHERE key_id = ?1 AND minute > ?2",
            params![key_id, minute(now - DAY_MS)],
            |r| r.get(0),
        )
        .map_err(db_err("sum charges"))
}

/// What a key's sandboxes hold now, computed afresh (a record's
/// `heldMicros` is as of the last tick): the rest of a running one's lease,
/// and the whole first lease of one starting or waking.
fn held_by_key(p: &Prices, rows: &[SandboxRow], key_id: &str, now: i64) -> i64 {
    rows.iter()
        .filter(|r| r.key_id == key_id)
        .map(|r| match r.record.state {
            SandboxState::Running => held_micros(p, &r.record, now),
            SandboxState::Starting | SandboxState::Resuming => {
                full_cost_micros(p, &r.record, first_lease_seconds(r.record.timeout_seconds))
            }
            _ => 0,
        })
        .sum()
}

/// A key's day: (limit, used = settled in 24 h + held now).
fn day_of(st: &AppState, key_id: &str, now: i64) -> Result<(Option<i64>, i64, i64), ServerError> {
    let limit = daily_limit(st, key_id)?;
    let settled = settled_in_day(st, key_id, now)?;
    let held = held_by_key(
        &st.config().prices,
        &st.store().live_sandboxes()?,
        key_id,
        now,
    );
    Ok((limit, settled, held))
}

fn spending_limit(limit: i64, used: i64, needed: i64) -> ApiError {
    ApiError::PaymentRequired {
        code: "spending_limit_reached",
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
pub fn check_spend(
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
                code: "budget_exceeded",
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
    let (limit, settled, held) = day_of(st, key_id, st.now_ms())?;
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
pub fn check_lease_change(st: &AppState, row: &SandboxRow, seconds: u32) -> ApiResult<()> {
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

/// One tick of the meter: charges every sandbox one second of its state,
/// updates holds, stops those at `maxTotalCostMicros` and pauses the
/// running sandboxes of keys whose daily limit is reached. The background
/// task calls it once a second; tests call it directly.
/// vCPU time in one second above which a sandbox is not idle.
const BUSY_NS_PER_SECOND: u64 = 100_000_000;

pub async fn tick(st: &AppState) -> Result<(), ServerError> {
    let now = st.now_ms();
    let prices = st.config().prices.clone();
    let rows = st.store().live_sandboxes()?;
    let mut keys_charged: BTreeMap<String, ()> = BTreeMap::new();
    for row in rows {
        let id = row.record.id.clone();
        let running = row.record.state == SandboxState::Running;
        let used = if running {
            let reading = st.host().cpu_time(&id).await;
            st.inner.meter.used_ns(&id, row.record.vcpu, reading)
        } else {
            st.inner.meter.forget(&id);
            0
        };
        // Work in the guest counts as activity for `idlePauseSeconds`, as
        // calls do: a second with a tenth of a vCPU or more busy.
        if running && used >= BUSY_NS_PER_SECOND {
            crate::service::sandboxes::touch(st, &row);
        }
        if running && st.inner.meter.renewed(&row.record, now) {
            renew(st, &row, now)?;
        }
        let units = second_in_state(&prices, &row.record, used);
        let held = held_micros(&prices, &row.record, now);
        if units == 0 && held == row.record.held_micros {
            continue;
        }
        let remainder = load_remainder(st, &id)?;
        let (whole, rest) = settle(remainder, units);
        if whole == 0 && held == row.record.held_micros {
            // Below a microdollar (a paused sandbox's storage): the record
            // stays as it is.
            save_charge(st, &row.key_id, &id, now, 0, rest)?;
            continue;
        }
        let mut cap_reached = false;
        let updated = st.store().update_sandbox(&id, |r| {
            if r.deleted.is_some() {
                return false;
            }
            r.record.charged_micros = r.record.charged_micros.saturating_add(whole);
            r.record.held_micros = held_micros(&prices, &r.record, now);
            cap_reached = r
                .record
                .max_total_cost_micros
                .is_some_and(|m| r.record.charged_micros >= m)
                && !matches!(
                    r.record.state,
                    SandboxState::Stopped | SandboxState::Stopping
                );
            true
        })?;
        if updated.is_none_or(|r| r.deleted.is_some()) {
            continue;
        }
        save_charge(st, &row.key_id, &id, now, whole, rest)?;
        if whole > 0 {
            keys_charged.insert(row.key_id.clone(), ());
        }
        if cap_reached {
            tracing::info!(sandbox_id = %id, "lifetime cost cap reached: stopping");
            if let Err(e) = crate::service::sandboxes::stop_for(st, &id, "lifetime_cap") {
                tracing::error!(sandbox_id = %id, error = %e, "stopping at the lifetime cap failed");
            }
        }
    }
    for key_id in keys_charged.keys() {
        enforce_daily_limit(st, key_id, now)?;
    }
    Ok(())
}

/// A running sandbox without an end renews its lease each hour; a renewal
/// that does not fit in its key's daily limit pauses it (or stops it, if it
/// cannot pause).
fn renew(st: &AppState, row: &SandboxRow, now: i64) -> Result<(), ServerError> {
    let Some(limit) = daily_limit(st, &row.key_id)? else {
        return Ok(());
    };
    let (_, settled, held) = day_of(st, &row.key_id, now)?;
    if settled.saturating_add(held) <= limit {
        return Ok(());
    }
    let id = &row.record.id;
    tracing::info!(sandbox_id = %id, key_id = %row.key_id, "the lease renewal passes the daily limit: pausing");
    let result = if row.record.pausable {
        crate::service::sandboxes::request_pause(st, id, "spending_limit").map(|_| ())
    } else {
        crate::service::sandboxes::stop_for(st, id, "spending_limit")
    };
    if let Err(e) = result {
        tracing::error!(sandbox_id = %id, error = %e, "pausing at the renewal failed");
    }
    Ok(())
}

/// Pauses (or, if it cannot pause, stops) every running sandbox of a key
/// whose settled spending reached its daily limit.
pub fn enforce_daily_limit(st: &AppState, key_id: &str, now: i64) -> Result<(), ServerError> {
    let Some(limit) = daily_limit(st, key_id)? else {
        return Ok(());
    };
    if settled_in_day(st, key_id, now)? < limit {
        return Ok(());
    }
    for r in st.store().live_sandboxes()? {
        if r.key_id != key_id || r.record.state != SandboxState::Running {
            continue;
        }
        tracing::info!(sandbox_id = %r.record.id, key_id, "daily spending limit reached: pausing");
        let result = if r.record.pausable {
            crate::service::sandboxes::request_pause(st, &r.record.id, "spending_limit").map(|_| ())
        } else {
            crate::service::sandboxes::stop_for(st, &r.record.id, "spending_limit")
        };
        if let Err(e) = result {
            tracing::error!(sandbox_id = %r.record.id, error = %e, "enforcing the daily limit failed");
        }
    }
    Ok(())
}

fn load_remainder(st: &AppState, id: &str) -> Result<i128, ServerError> {
    let r: Option<i64> = st
        .store()
        .conn()
        .query_row(
            "SELECT remainder FROM meter WHERE sandbox_id = ?1",
            params![id],
            |r| r.get(0),
        )
        .optional()
        .map_err(db_err("read meter"))?;
    Ok(i128::from(r.unwrap_or(0)))
}

/// Keeps the remainder and adds the settled microdollars to the minute's
/// charges, in one transaction.
fn save_charge(
    st: &AppState,
    key_id: &str,
    id: &str,
    now: i64,
    whole: i64,
    remainder: i128,
) -> Result<(), ServerError> {
    let mut conn = st.store().conn();
    let tx = conn.transaction().map_err(db_err("begin charge"))?;
    tx.execute(
        "INSERT INTO meter (sandbox_id, remainder) VALUES (?1, ?2)
         ON CONFLICT(sandbox_id) DO UPDATE SET remainder = excluded.remainder",
        params![id, i64::try_from(remainder).unwrap_or(0)],
    )
    .map_err(db_err("write meter"))?;
    if whole > 0 {
        tx.execute(
            "INSERT INTO charges (key_id, sandbox_id, minute, micros) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(key_id, sandbox_id, minute) DO UPDATE SET micros = micros + excluded.micros",
            params![key_id, id, minute(now), whole],
        )
        .map_err(db_err("write charge"))?;
    }
    tx.commit().map_err(db_err("commit charge"))
}

/// The meter, once a second until shutdown. Missed ticks are made up, so
/// every second is charged once.
pub async fn run(st: AppState) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.tick().await;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = st.inner.cancel.cancelled() => return,
        }
        if let Err(e) = tick(&st).await {
            tracing::error!(error = %e, "metering failed");
        }
    }
}

fn access(key: &KeyInfo) -> &'static str {
    if key.read_only {
        "read"
    } else {
        "full"
    }
}

/// `GET /v1/limits`: this key's access and daily limit.
pub async fn limits(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let (limit, settled, held) = day_of(&st, &ctx.key.id, st.now_ms())?;
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
    }))
}

/// `GET /v1/me`: who this key is. One server is one organization.
pub async fn me(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let name: Option<String> = st
        .store()
        .conn()
        .query_row(
            "SELECT name FROM keys WHERE id = ?1",
            params![ctx.key.id],
            |r| r.get(0),
        )
        .optional()
        .map_err(db_err("read key"))?
        .flatten();
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
pub async fn usage(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let now = st.now_ms();
    let sees_all = ctx.key.account_wide || ctx.key.read_only;
    let live = st.store().live_sandboxes()?;
    let live: Vec<&SandboxRow> = live
        .iter()
        .filter(|r| crate::service::sandboxes::visible(&ctx.key, r))
        .collect();
    struct Acc {
        name: Option<String>,
        spent: i64,
        day: i64,
        held: i64,
    }
    let mut keys: BTreeMap<String, Acc> = BTreeMap::new();
    let mut sandboxes: BTreeMap<String, (String, i64)> = BTreeMap::new();
    {
        let conn = st.store().conn();
        let mut stmt = conn
            .prepare("SELECT id, name FROM keys")
            .map_err(db_err("list keys"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
            })
            .map_err(db_err("list keys"))?;
        for r in rows {
            let (id, name) = r.map_err(db_err("list keys"))?;
            if sees_all || id == ctx.key.id {
                keys.insert(
                    id,
                    Acc {
                        name,
                        spent: 0,
                        day: 0,
                        held: 0,
                    },
                );
            }
        }
        let mut stmt = conn
            .prepare(
                "SELECT key_id, sandbox_id, SUM(micros), SUM(CASE WHEN minute > ?1 THEN micros ELSE 0 END)
                 FROM charges GROUP BY key_id, sandbox_id",
            )
            .map_err(db_err("sum charges"))?;
        let rows = stmt
            .query_map(params![minute(now - DAY_MS)], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })
            .map_err(db_err("sum charges"))?;
        for r in rows {
            let (key_id, sandbox_id, spent, day) = r.map_err(db_err("sum charges"))?;
            if let Some(k) = keys.get_mut(&key_id) {
                k.spent += spent;
                k.day += day;
                sandboxes.insert(sandbox_id, (key_id, spent));
            }
        }
    }
    for r in &live {
        if let Some(k) = keys.get_mut(&r.key_id) {
            k.held += r.record.held_micros;
        }
    }
    let spent: i64 = keys.values().map(|k| k.spent).sum();
    let held: i64 = keys.values().map(|k| k.held).sum();
    let mut per_sandbox = Vec::new();
    for r in &live {
        per_sandbox.push(json!({
            "sandboxId": r.record.id,
            "name": r.record.name,
            "keyId": r.key_id,
            "state": r.record.state,
            "chargedMicros": r.record.charged_micros.to_string(),
            "heldMicros": r.record.held_micros.to_string(),
        }));
        sandboxes.remove(&r.record.id);
    }
    // Deleted sandboxes keep their charges.
    for (id, (key_id, spent)) in sandboxes {
        per_sandbox.push(json!({
            "sandboxId": id,
            "name": Value::Null,
            "keyId": key_id,
            "state": "deleted",
            "chargedMicros": spent.to_string(),
            "heldMicros": "0",
        }));
    }
    let per_key: Vec<Value> = keys
        .iter()
        .map(|(id, k)| {
            json!({
                "keyId": id,
                "name": k.name,
                "spentMicros": k.spent.to_string(),
                "heldMicros": k.held.to_string(),
                "last24hMicros": k.day.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(vcpu: u32, memory_mib: u32, cpu: &str, floor: u32) -> Sandbox {
        let mut s: Sandbox = serde_json::from_value(json!({
            "id": "s", "kind": "sandbox", "name": null, "labels": {}, "status": "active",
            "state": "running", "region": "local", "funding": "paid", "vcpu": vcpu,
            "memoryMiB": memory_mib, "diskMiB": 4096, "cpu": cpu, "cpuFloorMillis": floor,
            "pausable": true, "timeoutSeconds": null, "idlePauseSeconds": 0, "autoWake": true,
            "persistent": false, "onLeaseEnd": "pause", "user": "sandbox",
            "createdAt": "2026-01-01T00:00:00.000Z", "readyAt": null, "expiresAt": null,
            "endsAt": null, "endedAt": null, "stopReason": null, "pausedAt": null,
            "pausedExpiresAt": null, "lastActiveAt": null, "chargedMicros": 0, "heldMicros": 0,
            "maxTotalCostMicros": null, "maxCostMicros": null, "envNames": [], "image": null
        }))
        .unwrap();
        s.state = SandboxState::Running;
        s
    }

    fn day(s: &Sandbox, used_ns: u64) -> i64 {
        let p = Prices::default();
        let (mut charged, mut rem) = (0i64, 0i128);
        for _ in 0..86_400 {
            let (whole, r) = settle(rem, running_second(&p, s, used_ns));
            charged += whole;
            rem = r;
        }
        charged
    }

    #[test]
    fn a_day_of_seconds_is_the_closed_formula() {
        // Idle 2 vCPU / 4 GiB at the 50 ms floor: 31,250 µ$ an hour.
        assert_eq!(day(&sandbox(2, 4096, "shared", 50), 0), 24 * 31_250);
        // Busy: 80,000 µ$ an hour; more than every vCPU is every vCPU.
        assert_eq!(
            day(&sandbox(2, 4096, "shared", 50), 2_000_000_000),
            24 * 80_000
        );
        assert_eq!(
            day(&sandbox(2, 4096, "shared", 50), 9_000_000_000),
            24 * 80_000
        );
        // Reserved bills every vCPU whatever the use.
        assert_eq!(day(&sandbox(2, 4096, "reserved", 2000), 0), 24 * 80_000);
        // An odd shape whose per-second cost has no finite decimal:
        // 3 vCPU at 137 ms measured, 1000 MiB. Closed formula, floored once.
        let s = sandbox(3, 1000, "shared", 50);
        let exact = 86_400i128 * (137_000_000i128 * 25_000 * 1_024 + 1000 * 7_500 * NS);
        assert_eq!(i128::from(day(&s, 137_000_000)), exact / UNITS_PER_MICRO);
        // A per-second rounding would have drifted by whole dollars' worth
        // of microdollars; this one is within 1 µ$ of the real number.
        let per_second_rounded =
            86_400 * (running_second(&Prices::default(), &s, 137_000_000) / UNITS_PER_MICRO);
        assert_ne!(per_second_rounded, exact / UNITS_PER_MICRO);
    }

    #[test]
    fn max_cost_is_the_contract_formula() {
        // timeoutSeconds/3600 × (vcpu×25,000 + GiB×7,500)
        let s = sandbox(2, 4096, "shared", 50);
        assert_eq!(full_cost_micros(&Prices::default(), &s, 3600), 80_000);
        assert_eq!(full_cost_micros(&Prices::default(), &s, 900), 20_000);
        // Rounded up: 1 s of 2 vCPU / 4 GiB is 22.2… µ$.
        assert_eq!(full_cost_micros(&Prices::default(), &s, 1), 23);
    }

    #[test]
    fn the_floor_and_the_cap() {
        let s = sandbox(2, 4096, "shared", 50);
        assert_eq!(billed_cpu_ns(&s, 0), 50_000_000);
        assert_eq!(billed_cpu_ns(&s, 700_000_000), 700_000_000);
        assert_eq!(billed_cpu_ns(&s, 5_000_000_000), 2_000_000_000);
    }

    #[test]
    fn the_meter_carries_cpu_over_one_second_to_the_next_tick() {
        let m = Meter::default();
        assert_eq!(m.used_ns("a", 1, Some(Duration::from_millis(500))), 0);
        // 1.5 s of one vCPU arrived in one tick: 1 s now, 0.5 s next.
        assert_eq!(
            m.used_ns("a", 1, Some(Duration::from_millis(2000))),
            1_000_000_000
        );
        assert_eq!(
            m.used_ns("a", 1, Some(Duration::from_millis(2000))),
            500_000_000
        );
        assert_eq!(m.used_ns("a", 1, Some(Duration::from_millis(2000))), 0);
        // A new machine's counter starts again.
        assert_eq!(
            m.used_ns("a", 1, Some(Duration::from_millis(300))),
            300_000_000
        );
        assert_eq!(m.used_ns("a", 1, None), 0);
    }
}
