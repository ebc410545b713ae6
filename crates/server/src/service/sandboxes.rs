//! Sandboxes as the other services use them: finding one a key may see,
//! waking it for a call, waiting for a state, names, deletion, the lease
//! reaper and recovery after a restart. Moves along the lifecycle go
//! through [`crate::service::lifecycle`].

use std::sync::Arc;
use std::time::Duration;

use runtime_api::DeletedSandbox;
use runtime_host::HostError;
use tokio::time::Instant;

use crate::domain::access::KeyInfo;
use crate::domain::lease;
use crate::domain::lifecycle::{next, Event, SandboxState};
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult, ServerError};
use crate::service::lifecycle::{self, disk_dir, drive, CaptureDir, Op};
use crate::store::SandboxRow;
use crate::AppState;

use SandboxState::{Paused, Pausing, Resuming, Running, Starting, Stopped, Stopping};

/// How long a call on a paused sandbox waits for its wake.
pub(crate) const WAKE_WAIT: Duration = Duration::from_secs(120);

/// Whether `key` may see the sandbox of `row` (domain::access::visible).
pub(crate) fn visible(key: &KeyInfo, row: &SandboxRow) -> bool {
    crate::domain::access::visible(key, &row.key_id)
}

/// The sandbox as this key may see it (deleted or foreign ones are 404).
pub(crate) fn find(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<SandboxRow> {
    match st.store().get_sandbox(id)? {
        Some(row) if row.deleted.is_none() && visible(key, &row) => Ok(row),
        _ => Err(ApiError::sandbox_not_found(id)),
    }
}

/// The sandbox, which must be awake (exec, files, processes). A paused one
/// with `autoWake` is woken first (callers arriving together share one
/// wake); without it the answer is 409 `sandbox_paused`. The call counts as
/// activity for `idlePauseSeconds`.
pub(crate) async fn find_running(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<SandboxRow> {
    let mut row = find(st, key, id)?;
    if row.record.state != Running {
        let wakes = match row.record.state {
            Resuming => true,
            Paused | Pausing => row.record.auto_wake,
            _ => false,
        };
        if !wakes {
            return Err(ApiError::NotRunning {
                id: row.record.id,
                state: row.record.state,
            });
        }
        ensure_awake(st, id, WAKE_WAIT).await?;
        row = find(st, key, id)?;
        if row.record.state != Running {
            return Err(ApiError::NotRunning {
                id: row.record.id,
                state: row.record.state,
            });
        }
    }
    touch(st, &row);
    Ok(row)
}

/// Records activity (`lastActiveAt`), at most once a second per sandbox:
/// API calls, preview visits, and CPU use the meter measured (billing.rs).
pub(crate) fn touch(st: &AppState, row: &SandboxRow) {
    let now = st.now_ms();
    let recent = row
        .record
        .last_active_at
        .as_deref()
        .and_then(parse_iso_ms)
        .is_some_and(|t| now - t < 1000);
    if recent {
        return;
    }
    if let Err(e) = st.store().update_sandbox(&row.record.id, |r| {
        r.record.last_active_at = Some(iso(now));
        true
    }) {
        tracing::warn!(sandbox_id = %row.record.id, error = %e, "recording activity failed");
    }
}

/// Wakes the sandbox if it is paused (or waits for the pause under way to
/// end, then wakes it) and returns once it runs.
pub(crate) async fn ensure_awake(st: &AppState, id: &str, timeout: Duration) -> ApiResult<()> {
    let deadline = Instant::now() + timeout;
    let mut asked = false;
    loop {
        let row = match st.store().get_sandbox(id)? {
            Some(r) if r.deleted.is_none() => r,
            _ => return Err(ApiError::sandbox_not_found(id)),
        };
        let state = row.record.state;
        match state {
            Running => return Ok(()),
            Paused if asked => {
                return Err(ApiError::Failed {
                    code: "wake_failed",
                    message: format!("Sandbox {id} could not be woken; it stays paused."),
                })
            }
            Paused => {
                let lease = crate::billing::first_lease_seconds(row.record.timeout_seconds);
                crate::billing::check_spend(st, &row.key_id, &row.record, lease, lease)?;
                drive(st, id, Op::Wake { lease: None })?;
                asked = true;
                continue;
            }
            Pausing | Resuming | Starting => {}
            _ => {
                return Err(ApiError::NotRunning {
                    id: id.into(),
                    state,
                })
            }
        }
        if state == Resuming {
            asked = true;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(ApiError::Host(HostError::Timeout {
                id: id.into(),
                what: "the wake",
            }));
        }
        wait_until(st, id, deadline - now, |s| s != state).await?;
    }
}

/// The live sandbox that holds `name`, if any: not stopped, or stopped and persistent.
pub(crate) fn name_holder(
    st: &AppState,
    name: &str,
    except: Option<&str>,
) -> Result<Option<SandboxRow>, ServerError> {
    Ok(st.store().live_sandboxes()?.into_iter().find(|r| {
        r.record.name.as_deref() == Some(name)
            && Some(r.record.id.as_str()) != except
            && (r.record.state != Stopped || r.record.persistent)
    }))
}

/// Moves a stopped persistent sandbox back to `starting` and starts it
/// from its kept disk (a fresh boot of the same files), or boots it when
/// no disk was kept.
pub(crate) fn restart(st: &AppState, id: &str) -> ApiResult<()> {
    let now = st.now_ms();
    let moved = lifecycle::transition(st, id, Event::Restart, |r| {
        r.record.ended_at = None;
        r.record.stop_reason = None;
        r.record.ready_at = None;
        r.record.ends_at = lease::lease_end(r.record.timeout_seconds, now);
        r.record.expires_at = r.record.ends_at.clone();
    })?;
    if !moved {
        return Ok(());
    }
    let disk = disk_dir(st, id);
    let from = disk.join("disk.qcow2").exists().then(|| {
        Arc::new(CaptureDir {
            path: disk,
            temporary: false,
        })
    });
    drive(st, id, Op::Start { from })?;
    Ok(())
}

/// Stops a sandbox for `reason` (the meter's caps and limits).
pub(crate) fn stop_for(st: &AppState, id: &str, reason: &'static str) -> ApiResult<()> {
    drive(st, id, Op::Stop { reason }).map(|_| ())
}

/// Pauses a running sandbox for `reason`; `false` when it was not running.
pub(crate) fn request_pause(st: &AppState, id: &str, reason: &'static str) -> ApiResult<bool> {
    drive(st, id, Op::Pause { reason })
}

/// Waits until the sandbox is in none of `states` (bounded), answering the row.
pub(crate) async fn settle(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    states: &'static [SandboxState],
) -> ApiResult<SandboxRow> {
    let row = find(st, key, id)?;
    if !states.contains(&row.record.state) {
        return Ok(row);
    }
    wait_until(st, id, WAKE_WAIT, |s| !states.contains(&s)).await?;
    find(st, key, id)
}

/// The source of a fork or snapshot: running or paused, after any start,
/// pause or wake under way ended.
pub(crate) async fn settled_source(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Starting, Pausing, Resuming]).await?;
    match row.record.state {
        Running | Paused => Ok(row),
        _ => Err(ApiError::NotRunning {
            id: row.record.id,
            state: row.record.state,
        }),
    }
}

/// Waits until `done(state)` holds or `timeout` passes.
pub(crate) async fn wait_until(
    st: &AppState,
    id: &str,
    timeout: Duration,
    done: impl Fn(SandboxState) -> bool,
) -> ApiResult<()> {
    let deadline = Instant::now() + timeout;
    let mut rx = st.inner.changes.subscribe();
    loop {
        match st.store().get_sandbox(id)? {
            Some(r) if r.deleted.is_none() && !done(r.record.state) => {}
            _ => return Ok(()),
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => return Ok(()),
        }
    }
}

/// Marks the sandbox deleted (from any state) and destroys its machine and
/// saved state in an owned task.
pub(crate) fn delete_sandbox(st: &AppState, id: &str, reason: &str) -> ApiResult<SandboxRow> {
    let now = iso(st.now_ms());
    let row = st
        .store()
        .update_sandbox(id, |r| {
            if r.deleted.is_some() {
                return false;
            }
            if r.record.state != Stopped {
                r.record.ended_at = Some(now.clone());
                r.record.stop_reason = Some(reason.into());
            }
            let Ok(state) = next(r.record.state, Event::Delete) else {
                return false;
            };
            r.record.state = state;
            r.deleted = Some(DeletedSandbox {
                id: r.record.id.clone(),
                kind: "sandbox".into(),
                name: r.record.name.clone(),
                labels: r.record.labels.clone(),
                status: "deleted".into(),
                state,
                deleted_at: now.clone(),
                ended_at: r.record.ended_at.clone(),
            });
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    st.notify_change();
    st.inner.procs.sandbox_gone(st.store(), id);
    st.inner.uploads.sandbox_gone(id);
    crate::previews::sandbox_gone(st, id);
    crate::net::sandbox_gone(st, id);
    let st2 = st.clone();
    let id2 = id.to_string();
    st.spawn(async move {
        let lock = st2.lifecycle_lock(&id2);
        let _g = lock.lock().await;
        let disk = disk_dir(&st2, &id2);
        if let Err(e) = std::fs::remove_dir_all(&disk) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox_id = %id2, error = %e, "removing the kept disk failed");
            }
        }
        match st2.host().destroy(&id2).await {
            Ok(()) | Err(runtime_host::HostError::NoSuchMachine { .. }) => {
                tracing::info!(sandbox_id = %id2, "sandbox destroyed")
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %id2, error = %e, "destroying the sandbox failed")
            }
        }
    });
    Ok(row)
}

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
            crate::snapshots::expire(&st, now);
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
