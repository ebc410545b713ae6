//! Money (contract §12, docs/billing.md): prices and what a second, a
//! lease and a hold cost. Pure.
//!
//! Money is integer microdollars on the wire. The meter adds each second's
//! exact cost in [`UNITS_PER_MICRO`]ths of a microdollar and settles whole
//! microdollars, keeping the remainder, so a day of seconds charges exactly
//! the closed formula rounded down once, never a rounding per second.

use runtime_api::Sandbox;

use crate::domain::lifecycle::SandboxState;
use crate::domain::time::parse_iso_ms;

/// Exact amounts are counted in this fraction of a microdollar: seconds per
/// hour × nanoseconds per second × MiB per GiB, so one second of any price
/// per vCPU-hour (measured in ns) or per GiB-hour (sized in MiB) is whole.
pub(crate) const UNITS_PER_MICRO: i128 = 3_600 * 1_000_000_000 * 1_024;

pub(crate) const NS: i128 = 1_000_000_000;

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
    /// Per GiB (2^30 bytes) a key's sandboxes send out in a calendar month
    /// (UTC) past `outbound_allowance_bytes`; 0, outbound traffic is free.
    pub outbound_gib: u64,
    /// Bytes each key's sandboxes send out free each calendar month.
    pub outbound_allowance_bytes: u64,
}

impl Default for Prices {
    fn default() -> Self {
        Prices {
            cpu_vcpu_hour: 25_000,
            memory_gib_hour: 7_500,
            paused_gib_hour: 119,
            kept_disk_gib_hour: 153,
            outbound_gib: 0,
            outbound_allowance_bytes: 0,
        }
    }
}

pub(crate) fn mib_units(mib: u32, price_gib_hour: u64) -> i128 {
    i128::from(mib) * i128::from(price_gib_hour) * NS
}

/// The CPU time one running second is billed for: the measured use, capped
/// at every vCPU busy, and at least the floor (`cpu: "reserved"`: every vCPU).
pub(crate) fn billed_cpu_ns(s: &Sandbox, used_ns: u64) -> u64 {
    let all = u64::from(s.vcpu) * 1_000_000_000;
    let floor = if s.cpu == "reserved" {
        all
    } else {
        u64::from(s.cpu_floor_millis) * 1_000_000
    };
    used_ns.min(all).max(floor.min(all))
}

/// One running second of `s` with `used_ns` of vCPU time, in units.
pub(crate) fn running_second(p: &Prices, s: &Sandbox, used_ns: u64) -> i128 {
    i128::from(billed_cpu_ns(s, used_ns)) * i128::from(p.cpu_vcpu_hour) * 1_024
        + mib_units(s.memory_mib, p.memory_gib_hour)
        + kept_disk_second(p, s)
}

/// One second of storage a sandbox pays for in any state: its disk while
/// persistent.
pub(crate) fn kept_disk_second(p: &Prices, s: &Sandbox) -> i128 {
    if s.persistent {
        mib_units(s.disk_mib, p.kept_disk_gib_hour)
    } else {
        0
    }
}

/// One second of a sandbox in `state` (storage only unless running).
pub(crate) fn second_in_state(p: &Prices, s: &Sandbox, used_ns: u64) -> i128 {
    match s.state {
        SandboxState::Running => running_second(p, s, used_ns),
        SandboxState::Pausing | SandboxState::Paused | SandboxState::Resuming => {
            mib_units(s.memory_mib, p.paused_gib_hour) + kept_disk_second(p, s)
        }
        _ => kept_disk_second(p, s),
    }
}

/// One running second with every vCPU busy (compute only), in units.
pub(crate) fn full_second(p: &Prices, s: &Sandbox) -> i128 {
    i128::from(s.vcpu) * NS * i128::from(p.cpu_vcpu_hour) * 1_024
        + mib_units(s.memory_mib, p.memory_gib_hour)
}

/// `seconds` at full use, in microdollars rounded up.
pub(crate) fn full_cost_micros(p: &Prices, s: &Sandbox, seconds: i64) -> i64 {
    let units = full_second(p, s) * i128::from(seconds.max(0));
    i64::try_from((units + UNITS_PER_MICRO - 1) / UNITS_PER_MICRO).unwrap_or(i64::MAX)
}

/// A lease without an end is renewed each hour; this is its length.
pub(crate) const OPEN_LEASE_SECONDS: i64 = 3_600;

/// The length of the lease a create or wake starts.
pub(crate) fn first_lease_seconds(timeout_seconds: Option<u32>) -> i64 {
    timeout_seconds.map_or(OPEN_LEASE_SECONDS, i64::from)
}

/// Seconds left in the current lease of a running sandbox: to `endsAt`, or
/// to the next hourly renewal since it was ready when it has no end.
pub(crate) fn lease_left_seconds(s: &Sandbox, now: i64) -> i64 {
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
pub(crate) fn held_micros(p: &Prices, s: &Sandbox, now: i64) -> i64 {
    if s.state != SandboxState::Running {
        return 0;
    }
    full_cost_micros(p, s, lease_left_seconds(s, now))
}

/// Adds `units` to a remainder below one microdollar: (whole microdollars
/// to settle, new remainder).
pub(crate) fn settle(remainder: i128, units: i128) -> (i64, i128) {
    let total = remainder + units;
    (
        i64::try_from(total / UNITS_PER_MICRO).unwrap_or(i64::MAX),
        total % UNITS_PER_MICRO,
    )
}

/// A month's outbound traffic: what the allowance covered, and what the
/// bytes past it cost at `outbound_gib` per GiB, rounded down.
pub(crate) fn outbound_cost(p: &Prices, bytes: u64) -> (u64, i64) {
    let covered = bytes.min(p.outbound_allowance_bytes);
    let over = i128::from(bytes - covered);
    let micros = over * i128::from(p.outbound_gib) / (1i128 << 30);
    (covered, i64::try_from(micros).unwrap_or(i64::MAX))
}

pub(crate) fn minute(ms: i64) -> i64 {
    ms / 60_000
}

pub(crate) const DAY_MS: i64 = 24 * 3600 * 1000;

/// What sandboxes hold now, computed afresh (a record's `heldMicros` is as
/// of the last tick): the rest of a running one's lease, and the whole
/// first lease of one starting or waking.
pub(crate) fn held_now<'a>(
    p: &Prices,
    sandboxes: impl Iterator<Item = &'a Sandbox>,
    now: i64,
) -> i64 {
    sandboxes
        .map(|s| match s.state {
            SandboxState::Running => held_micros(p, s, now),
            SandboxState::Starting | SandboxState::Resuming => {
                full_cost_micros(p, s, first_lease_seconds(s.timeout_seconds))
            }
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outbound_past_the_allowance_costs_by_the_gib_rounded_down() {
        let p = Prices {
            outbound_gib: 90_000,
            outbound_allowance_bytes: 1 << 30,
            ..Prices::default()
        };
        assert_eq!(outbound_cost(&p, 0), (0, 0));
        assert_eq!(outbound_cost(&p, 1 << 30), (1 << 30, 0));
        assert_eq!(outbound_cost(&p, 3 << 30), (1 << 30, 180_000));
        // Half a byte's price is not charged.
        assert_eq!(outbound_cost(&p, (1 << 30) + 11_930), (1 << 30, 0));
        assert_eq!(outbound_cost(&p, (1 << 30) + 11_931), (1 << 30, 1));
        // The defaults: free.
        assert_eq!(outbound_cost(&Prices::default(), u64::MAX), (0, 0));
    }
    use serde_json::json;

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
}
