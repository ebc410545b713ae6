//! What runs without a request: the reaper (leases, idle pauses,
//! retention, old idempotency records and process output, expired
//! snapshots, ended sessions and file links) and the recovery of what an earlier server left.

use std::time::Duration;

use crate::domain::lease;
use crate::domain::lifecycle::{Event, SandboxState};
use crate::domain::time::iso;
use crate::error::{ApiResult, ServerError};
use crate::service::lifecycle;
use crate::service::sandboxes::{delete_sandbox, request_pause, stop_for};
use crate::store::SandboxRow;
use crate::AppState;

use SandboxState::{Paused, Pausing, Resuming, Running, Starting, Stopping};

/// Ends leases, forgets old idempotency records and process output.
pub(crate) async fn reaper(st: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = st.inner.cancel.cancelled() => return,
        }
        n += 1;
        let now = st.now_ms();
        match st.store().live_sandboxes() {
            Ok(rows) => {
                for r in rows.iter().filter(|r| r.record.state == Running) {
                    if let Err(e) = end_lease_or_idle(&st, r, now) {
                        tracing::error!(sandbox_id = %r.record.id, error = %e, "ending the lease failed");
                    }
                }
                let expired = rows
                    .iter()
                    .filter(|r| r.record.state == Paused && lease::retention_over(&r.record, now));
                for r in expired {
                    tracing::info!(sandbox_id = %r.record.id, "paused past its retention: deleted");
                    if let Err(e) = delete_sandbox(&st, &r.record.id, "retention_expired") {
                        tracing::error!(sandbox_id = %r.record.id, error = %e, "deleting at retention's end failed");
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "reading sandboxes for leases failed"),
        }
        if n % 60 == 1 {
            let ttl = st.config().idempotency_ttl.as_millis() as i64;
            if let Err(e) = st.store().idem_purge(now - ttl) {
                tracing::error!(error = %e, "purging idempotency records failed");
            }
            st.inner
                .procs
                .forget_old(st.store(), st.config().output_keep);
            crate::service::snapshots::expire(&st, now);
            if let Err(e) = crate::service::links::prune(&st) {
                tracing::error!(error = %e, "forgetting ended file links failed");
            }
            if let Err(e) = crate::service::sessions::prune(&st) {
                tracing::error!(error = %e, "forgetting ended sessions failed");
            }
            crate::service::events::prune(&st, now);
        }
    }
}

/// Applies `onLeaseEnd` to a running sandbox whose lease ended, or pauses
/// one idle (no call and no process of ours running) for `idlePauseSeconds`.
fn end_lease_or_idle(st: &AppState, r: &SandboxRow, now: i64) -> ApiResult<()> {
    let s = &r.record;
    if lease::lease_ended(s, now) {
        tracing::info!(sandbox_id = %s.id, on_lease_end = %s.on_lease_end, "lease ended");
        return match s.on_lease_end.as_str() {
            "pause" if s.pausable => request_pause(st, &s.id, "lease_end").map(|_| ()),
            "delete" => delete_sandbox(st, &s.id, "timeout").map(|_| ()),
            _ => stop_for(st, &s.id, "timeout"),
        };
    }
    if lease::idle_for_long_enough(s, now) && !st.inner.procs.running_in(&s.id) {
        tracing::info!(sandbox_id = %s.id, "idle: pausing");
        request_pause(st, &s.id, "idle")?;
    }
    Ok(())
}

/// Reattaches every sandbox an earlier server left starting, running or stopping.
pub(crate) async fn recover(st: &AppState) -> Result<(), ServerError> {
    for row in st.store().live_sandboxes()? {
        let id = row.record.id.clone();
        match row.record.state {
            Starting | Running => {
                let found = match st
                    .host()
                    .recover(&lifecycle::machine_spec(st, &row.record))
                    .await
                {
                    Ok(found) => found,
                    Err(e) => {
                        tracing::warn!(sandbox_id = %id, error = %e, "recovering the sandbox failed");
                        false
                    }
                };
                let now = iso(st.now_ms());
                let event = if found {
                    Event::Recovered
                } else {
                    Event::MachineGone
                };
                lifecycle::transition(st, &id, event, |r| {
                    if !found {
                        r.record.stop_reason = Some("host_lost".into());
                        r.record.ended_at = Some(now.clone());
                    } else if r.record.ready_at.is_none() {
                        r.record.ready_at = Some(now.clone());
                    }
                })?;
                tracing::info!(sandbox_id = %id, found, "sandbox recovered");
            }
            Pausing | Resuming => {
                // A machine still running means the pause had not happened
                // or the wake had; otherwise its saved state is on disk.
                let pausing = row.record.state == Pausing;
                let found = st
                    .host()
                    .recover(&lifecycle::machine_spec(st, &row.record))
                    .await
                    .unwrap_or(false);
                let event = if found {
                    Event::Recovered
                } else {
                    Event::RecoveredSaved
                };
                lifecycle::transition(st, &id, event, |r| {
                    if found {
                        r.record.paused_at = None;
                    } else if r.record.paused_at.is_none() {
                        r.record.paused_at = Some(iso(st.now_ms()));
                    }
                })?;
                if found && pausing {
                    if let Err(e) = request_pause(st, &id, "requested") {
                        tracing::warn!(sandbox_id = %id, error = %e, "finishing a pause failed");
                    }
                }
                tracing::info!(sandbox_id = %id, found, "sandbox recovered from a pause or wake");
            }
            Stopping => {
                // Finish the stop an earlier server began: back to running
                // (its machine, if any, is still there), then the stop again.
                lifecycle::transition(st, &id, Event::Recovered, |_| {})?;
                if let Err(e) = stop_for(st, &id, "requested") {
                    tracing::warn!(sandbox_id = %id, error = %e, "finishing a stop failed");
                }
            }
            _ => {}
        }
    }
    st.notify_change();
    Ok(())
}
