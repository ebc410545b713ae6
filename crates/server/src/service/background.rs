//! What runs without a request: the reaper (leases, idle pauses,
//! retention, old idempotency records and process output, expired
//! snapshots and volume backups, ended sessions and file links) and the recovery of what an earlier server left.

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

/// How long the housekeeping lease lasts: it is renewed each minute, so a
/// holder that stops is replaced within 90 s.
const HOUSEKEEPING_LEASE_MS: i64 = 90_000;

/// How long the lease of watching for lost nodes lasts: renewed every 5 s,
/// so its holder is replaced within 15 s of stopping.
const NODES_LEASE_MS: i64 = 15_000;

/// Ends leases, forgets old idempotency records and process output.
pub(crate) async fn reaper(st: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut n: u64 = 0;
    let mut secrets_seen = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = st.inner.cancel.cancelled() => return,
        }
        n += 1;
        let now = st.now_ms();
        if st.store().shared() {
            // A secret changed on another node: running sandboxes here use
            // its new value from now on.
            secrets_seen = crate::service::secrets::watch_peers(&st, secrets_seen);
        }
        match st.store().live_sandboxes_here() {
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
        if n.is_multiple_of(5) {
            crate::service::pool::tend(&st).await;
            // Peers read this node's URL, liveness and room here.
            match crate::service::nodes::beat(&st, false).await {
                // Held lost while cut from the store: settle what peers recorded.
                Ok(me) if me.lost_ms != 0 => {
                    crate::service::nodes::come_back(&st, me.lost_ms).await
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "saying this node is alive failed"),
            }
            // One node watches for peers that stay away.
            if st.store().shared()
                && st
                    .store()
                    .hold_lease("nodes", now, NODES_LEASE_MS)
                    .unwrap_or(false)
            {
                crate::service::nodes::notice_lost(&st, now);
            }
        }
        // The store-wide jobs run on the one control plane holding their
        // lease (any, on SQLite's one); another takes it once it lapses.
        if n % 60 == 1
            && st
                .store()
                .hold_lease("housekeeping", now, HOUSEKEEPING_LEASE_MS)
                .unwrap_or_else(|e| {
                    tracing::error!(error = %e, "taking the housekeeping lease failed");
                    false
                })
        {
            let ttl = st.config().idempotency_ttl.as_millis() as i64;
            if let Err(e) = st.store().idem_purge(now - ttl) {
                tracing::error!(error = %e, "purging idempotency records failed");
            }
            if let Err(e) = crate::service::links::prune(&st) {
                tracing::error!(error = %e, "forgetting ended file links failed");
            }
            if let Err(e) = crate::service::sessions::prune(&st) {
                tracing::error!(error = %e, "forgetting ended sessions failed");
            }
            crate::service::events::prune(&st, now);
        }
        if n % 60 == 1 {
            st.inner
                .procs
                .forget_old(st.store(), st.config().output_keep);
            crate::service::snapshots::expire(&st, now);
            crate::service::volumes::expire_backups(&st, now);
            let st2 = st.clone();
            st.spawn(async move { crate::service::volumes::daily_backups(&st2).await });
        }
        if n % 600 == 1 {
            let st2 = st.clone();
            let _ =
                tokio::task::spawn_blocking(move || crate::service::images::prune_if_short(&st2))
                    .await;
        }
        if n % 3600 == 2 {
            crate::service::images::context::prune(&st);
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

/// Settles what an earlier server left: machines no record owns end,
/// captures cut short fail, and every sandbox it left starting, running,
/// pausing, resuming or stopping is reattached or recorded as it truly is.
pub(crate) async fn recover(st: &AppState) -> Result<(), ServerError> {
    let rows = st.store().live_sandboxes_here()?;
    sweep(st, &rows).await;
    crate::service::snapshots::recover(st);
    crate::service::volumes::recover_backups(st);
    for row in rows {
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
                let starting = row.record.state == Starting;
                let event = match (found, starting) {
                    (true, _) => Event::Recovered,
                    // Its machine never finished its setup (and was ended):
                    // the start failed, as one that fails while we watch.
                    (false, true) => Event::BootFailed,
                    (false, false) => Event::MachineGone,
                };
                lifecycle::transition(st, &id, event, |r| {
                    if !found {
                        let why = if starting {
                            "start_failed"
                        } else {
                            "host_lost"
                        };
                        r.record.stop_reason = Some(why.into());
                        r.record.ended_at = Some(now.clone());
                    } else if r.record.ready_at.is_none() {
                        r.record.ready_at = Some(now.clone());
                    }
                })?;
                tracing::info!(sandbox_id = %id, found, "sandbox recovered");
                if found && lifecycle::owes_start_command(st, &id) {
                    // Its machine was set up but the server went before
                    // the image's `start` command: run it now.
                    if let Ok(Some(row)) = st.store().get_sandbox(&id) {
                        lifecycle::start_image_command(st, &row, false).await;
                    }
                }
                lifecycle::start_command_paid(st, &id);
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
                let event = settled_pause(found, st.host().has_paused_state(&id));
                let now = iso(st.now_ms());
                lifecycle::transition(st, &id, event, |r| match event {
                    Event::Recovered => r.record.paused_at = None,
                    Event::RecoveredSaved => {
                        if r.record.paused_at.is_none() {
                            r.record.paused_at = Some(now.clone());
                        }
                    }
                    _ => {
                        // Neither a machine nor a whole state to wake from.
                        r.record.stop_reason = Some("host_lost".into());
                        r.record.ended_at = Some(now.clone());
                        r.record.paused_at = None;
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
    crate::service::shares::recover(st).await;
    st.notify_change();
    Ok(())
}

/// Where a pause or wake cut short by a crash ends: `running` when its
/// machine still runs, `paused` only when a whole paused state is kept to
/// wake from, otherwise `stopped` (the machine and its memory are gone).
fn settled_pause(machine_runs: bool, state_kept: bool) -> Event {
    match (machine_runs, state_kept) {
        (true, _) => Event::Recovered,
        (false, true) => Event::RecoveredSaved,
        (false, false) => Event::MachineGone,
    }
}

/// Ends the machines the host finds that no live record owns: a sandbox
/// deleted while the earlier server died (its row marked, its machine not
/// yet ended), or one the store never knew.
async fn sweep(st: &AppState, rows: &[SandboxRow]) {
    let owned: std::collections::HashSet<String> =
        rows.iter().map(|r| r.record.id.clone()).collect();
    for id in st.host().sweep(&owned).await {
        crate::service::network::sandbox_gone(st, &id);
        tracing::info!(sandbox_id = %id, "ended a machine no sandbox owns");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_cut_short_is_paused_only_with_a_state_to_wake_from() {
        assert_eq!(settled_pause(true, false), Event::Recovered);
        assert_eq!(settled_pause(true, true), Event::Recovered);
        assert_eq!(settled_pause(false, true), Event::RecoveredSaved);
        assert_eq!(settled_pause(false, false), Event::MachineGone);
    }
}
