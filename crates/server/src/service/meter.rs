//! The meter (contract §12, docs/billing.md): once a second it charges
//! every sandbox one second of its state, updates holds, stops those at
//! `maxTotalCostMicros` and pauses the running sandboxes of keys whose
//! daily limit is reached.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use runtime_api::Sandbox;

use crate::domain::lifecycle::SandboxState;
use crate::domain::money::*;
use crate::domain::time::parse_iso_ms;
use crate::error::ServerError;
use crate::service::billing::{day_of, Day};
use crate::service::lifecycle::{self, Op};
use crate::store::SandboxRow;
use crate::AppState;

/// The meter's memory: each running machine's vCPU time already billed.
#[derive(Default)]
pub(crate) struct Meter {
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

/// One tick of the meter: charges every sandbox one second of its state,
/// updates holds, stops those at `maxTotalCostMicros` and pauses the
/// running sandboxes of keys whose daily limit is reached. The background
/// task calls it once a second; tests call it directly.
/// vCPU time in one second above which a sandbox is not idle.
const BUSY_NS_PER_SECOND: u64 = 100_000_000;

pub(crate) async fn tick(st: &AppState) -> Result<(), ServerError> {
    let now = st.now_ms();
    let prices = st.config().prices.clone();
    let rows = st.store().live_sandboxes_here()?;
    let live: std::collections::HashSet<String> =
        rows.iter().map(|r| r.record.id.clone()).collect();
    st.inner.metrics.retain(&live);
    let mut keys_charged: BTreeMap<String, ()> = BTreeMap::new();
    for row in rows {
        let id = row.record.id.clone();
        let running = row.record.state == SandboxState::Running;
        let used = if running {
            let reading = st.host().cpu_time(&id).await;
            let used = st.inner.meter.used_ns(&id, row.record.vcpu, reading);
            // The same reading the bill is made from feeds the metrics.
            if reading.is_some() {
                let memory = if st.inner.metrics.due(&id, now) {
                    st.host().memory_bytes(&id).await
                } else {
                    None
                };
                st.inner.metrics.second(&id, now, used, memory);
            }
            used
        } else {
            st.inner.meter.forget(&id);
            st.inner.metrics.idle(&id);
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
        let remainder = st.store().meter_remainder(&id)?;
        let (whole, rest) = settle(remainder, units);
        if whole == 0 && held == row.record.held_micros {
            // Below a microdollar (a paused sandbox's storage): the record
            // stays as it is.
            st.store()
                .save_charge(&row.key_id, &id, minute(now), 0, 1000, rest)?;
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
        let billed_ms = if units > 0 { 1000 } else { 0 };
        st.store()
            .save_charge(&row.key_id, &id, minute(now), whole, billed_ms, rest)?;
        if whole > 0 {
            keys_charged.insert(row.key_id.clone(), ());
        }
        if cap_reached {
            tracing::info!(sandbox_id = %id, "lifetime cost cap reached: stopping");
            if let Err(e) = lifecycle::drive(
                st,
                &id,
                Op::Stop {
                    reason: "lifetime_cap",
                },
            )
            .map(|_| ())
            {
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
    let Some(limit) = st.store().daily_limit(&row.key_id)? else {
        return Ok(());
    };
    let Day { settled, held, .. } = day_of(st, &row.key_id, now)?;
    if settled.saturating_add(held) <= limit {
        return Ok(());
    }
    let id = &row.record.id;
    tracing::info!(sandbox_id = %id, key_id = %row.key_id, "the lease renewal passes the daily limit: pausing");
    let result = if row.record.pausable {
        lifecycle::drive(
            st,
            id,
            Op::Pause {
                reason: "spending_limit",
            },
        )
        .map(|_| ())
    } else {
        lifecycle::drive(
            st,
            id,
            Op::Stop {
                reason: "spending_limit",
            },
        )
        .map(|_| ())
    };
    if let Err(e) = result {
        tracing::error!(sandbox_id = %id, error = %e, "pausing at the renewal failed");
    }
    Ok(())
}

/// Pauses (or, if it cannot pause, stops) every running sandbox of a key
/// whose settled spending reached its daily limit.
pub(crate) fn enforce_daily_limit(
    st: &AppState,
    key_id: &str,
    now: i64,
) -> Result<(), ServerError> {
    let Some(limit) = st.store().daily_limit(key_id)? else {
        return Ok(());
    };
    if st.store().settled_since(key_id, minute(now - DAY_MS))? < limit {
        return Ok(());
    }
    for r in st.store().live_sandboxes_here()? {
        if r.key_id != key_id || r.record.state != SandboxState::Running {
            continue;
        }
        tracing::info!(sandbox_id = %r.record.id, key_id, "daily spending limit reached: pausing");
        let result = if r.record.pausable {
            lifecycle::drive(
                st,
                &r.record.id,
                Op::Pause {
                    reason: "spending_limit",
                },
            )
            .map(|_| ())
        } else {
            lifecycle::drive(
                st,
                &r.record.id,
                Op::Stop {
                    reason: "spending_limit",
                },
            )
            .map(|_| ())
        };
        if let Err(e) = result {
            tracing::error!(sandbox_id = %r.record.id, error = %e, "enforcing the daily limit failed");
        }
    }
    Ok(())
}

/// The meter, once a second until shutdown. Missed ticks are made up, so
/// every second is charged once.
pub(crate) async fn run(st: AppState) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
