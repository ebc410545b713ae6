//! Lease, idle-pause and retention arithmetic. Pure: times are milliseconds
//! since the epoch, and `now` is always a parameter.

use runtime_api::Sandbox;

use crate::domain::time::{iso, parse_iso_ms};

/// When a lease of `timeout_seconds` begun at `now` ends (`None`: no lease).
pub(crate) fn lease_end(timeout_seconds: Option<u32>, now: i64) -> Option<String> {
    timeout_seconds.map(|t| iso(now + i64::from(t) * 1000))
}

/// Whether the sandbox's lease ended at `now`.
pub(crate) fn lease_ended(s: &Sandbox, now: i64) -> bool {
    s.ends_at
        .as_deref()
        .and_then(parse_iso_ms)
        .is_some_and(|end| end <= now)
}

/// A new sandbox's idle pause when its create names none (the client's
/// documented default).
pub(crate) const DEFAULT_IDLE_PAUSE_SECONDS: u32 = 300;
/// The shortest idle pause: a shorter one asked for is raised to it.
pub(crate) const MIN_IDLE_PAUSE_SECONDS: u32 = 60;

/// The idle pause kept for `asked` seconds: 0 is never, a shorter time
/// than [`MIN_IDLE_PAUSE_SECONDS`] is raised to it (as the client says).
pub(crate) fn idle_pause_of(asked: u32) -> u32 {
    if asked == 0 {
        0
    } else {
        asked.max(MIN_IDLE_PAUSE_SECONDS)
    }
}

/// Whether a sandbox with an idle pause has been idle long enough at `now`
/// (its last activity, or its start when there was none). Processes still
/// running are the caller's to weigh.
pub(crate) fn idle_for_long_enough(s: &Sandbox, now: i64) -> bool {
    if s.idle_pause_seconds == 0 || !s.pausable {
        return false;
    }
    let last = s
        .last_active_at
        .as_deref()
        .or(s.ready_at.as_deref())
        .and_then(parse_iso_ms)
        .unwrap_or(now);
    now - last >= i64::from(s.idle_pause_seconds) * 1000
}

/// When a paused sandbox's retention ends, from its `pausedAt`.
pub(crate) fn retention_end(s: &Sandbox) -> Option<String> {
    let days = i64::from(s.retention_days?);
    let paused = s.paused_at.as_deref().and_then(parse_iso_ms)?;
    Some(iso(paused + days * 86_400_000))
}

/// Whether a paused sandbox's retention has run out at `now`.
pub(crate) fn retention_over(s: &Sandbox, now: i64) -> bool {
    s.paused_expires_at
        .as_deref()
        .and_then(parse_iso_ms)
        .is_some_and(|t| t <= now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::lifecycle::SandboxState;

    const T0: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

    fn sandbox() -> Sandbox {
        serde_json::from_value(serde_json::json!({
            "id": "s", "kind": "sandbox", "name": null, "labels": {}, "status": "active",
            "state": "running", "region": "local", "funding": "paid", "vcpu": 1,
            "memoryMiB": 512, "diskMiB": 3072, "cpu": "shared", "cpuFloorMillis": 50,
            "pausable": true, "timeoutSeconds": 300, "idlePauseSeconds": 0, "autoWake": true,
            "persistent": false, "onLeaseEnd": "pause", "user": "sandbox",
            "createdAt": iso(T0), "readyAt": iso(T0), "expiresAt": null, "endsAt": null,
            "endedAt": null, "stopReason": null, "pausedAt": null, "pausedExpiresAt": null,
            "lastActiveAt": null, "chargedMicros": 0, "heldMicros": 0,
            "maxTotalCostMicros": null, "maxCostMicros": null, "envNames": [], "image": null
        }))
        .expect("a sandbox record")
    }

    #[test]
    fn a_lease_ends_its_seconds_after_it_began() {
        assert_eq!(lease_end(None, T0), None);
        assert_eq!(
            lease_end(Some(90), T0).as_deref(),
            Some("2026-01-01T00:01:30.000Z")
        );
        let mut s = sandbox();
        assert_eq!(s.state, SandboxState::Running);
        assert!(!lease_ended(&s, T0), "no lease never ends");
        s.ends_at = lease_end(Some(60), T0);
        assert!(!lease_ended(&s, T0 + 59_999));
        assert!(lease_ended(&s, T0 + 60_000));
    }

    #[test]
    fn a_short_idle_pause_is_raised_to_a_minute_and_zero_is_never() {
        assert_eq!(idle_pause_of(0), 0);
        assert_eq!(idle_pause_of(1), 60);
        assert_eq!(idle_pause_of(59), 60);
        assert_eq!(idle_pause_of(60), 60);
        assert_eq!(idle_pause_of(301), 301);
    }

    #[test]
    fn idle_counts_from_the_last_activity_or_the_start() {
        let mut s = sandbox();
        assert!(!idle_for_long_enough(&s, T0 + 86_400_000), "0 means never");
        s.idle_pause_seconds = 60;
        assert!(!idle_for_long_enough(&s, T0 + 59_999));
        assert!(idle_for_long_enough(&s, T0 + 60_000), "from readyAt");
        s.last_active_at = Some(iso(T0 + 30_000));
        assert!(!idle_for_long_enough(&s, T0 + 60_000));
        assert!(idle_for_long_enough(&s, T0 + 90_000));
        s.pausable = false;
        assert!(!idle_for_long_enough(&s, T0 + 90_000), "not pausable");
    }

    #[test]
    fn retention_runs_from_the_pause() {
        let mut s = sandbox();
        assert_eq!(retention_end(&s), None);
        s.retention_days = Some(2);
        assert_eq!(retention_end(&s), None, "not paused");
        s.paused_at = Some(iso(T0));
        let end = retention_end(&s);
        assert_eq!(end.as_deref(), Some("2026-01-03T00:00:00.000Z"));
        s.paused_expires_at = end;
        assert!(!retention_over(&s, T0 + 2 * 86_400_000 - 1));
        assert!(retention_over(&s, T0 + 2 * 86_400_000));
    }
}
