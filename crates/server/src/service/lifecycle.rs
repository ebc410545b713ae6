//! The one driver of the sandbox lifecycle: every start (create, restart,
//! fork copy, snapshot restore), stop, pause and wake goes through
//! [`drive`]. It
//! 1. moves the record to the transitional state with a compare-and-set
//!    along an edge of [`domain::lifecycle::next`](crate::domain::lifecycle::next)
//!    (a start finds the record already `starting`),
//! 2. spawns the owned task, which takes the sandbox's lifecycle lock and
//!    re-reads it (a stop or delete queued meanwhile wins),
//! 3. runs the `Host` call with the operation's hooks around it,
//! 4. maps the call's `Result` to the ending [`Event`],
//! 5. records the outcome with a compare-and-set from the transitional state,
//! 6. and tells the waiters.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use runtime_api::Sandbox;
use runtime_host::{HostError, MachineSpec};

use crate::domain::lifecycle::{next, Event, SandboxState};
use crate::domain::telemetry::Outcome;
use crate::domain::time::iso;
use crate::error::{ApiResult, ServerError};
use crate::store::SandboxRow;
use crate::AppState;

/// A capture a machine starts from: a snapshot's directory, a kept disk, or
/// a fork's temporary one, removed once the last copy started from it.
pub(crate) struct CaptureDir {
    pub path: PathBuf,
    pub temporary: bool,
}

impl Drop for CaptureDir {
    fn drop(&mut self) {
        if self.temporary {
            if let Err(e) = std::fs::remove_dir_all(&self.path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.path.display(), error = %e, "removing a capture failed");
                }
            }
        }
    }
}

/// A `:switch-image` task: given the state and the sandbox's row, it
/// moves the machine and records the outcome.
pub(crate) type SwitchTask =
    Box<dyn FnOnce(AppState, SandboxRow) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// What to do to a sandbox.
pub(crate) enum Op {
    /// Boot the `starting` sandbox, or restore it from a capture; `warm`:
    /// its machine is a warm one it took (`service::pool`), running
    /// already, which only takes on its identity.
    Start {
        from: Option<Arc<CaptureDir>>,
        warm: bool,
    },
    Stop {
        reason: &'static str,
    },
    Pause {
        reason: &'static str,
    },
    /// With a new lease of `lease` seconds, else its `timeoutSeconds`.
    Wake {
        lease: Option<u32>,
    },
    /// Boot the `starting` sandbox again from its own disk, at the shape its
    /// record now has (`:resize`). `from`: the state it was in, whose
    /// machine (running or paused) is ended first keeping its disk; `old`:
    /// the shape (vCPUs, memory MiB, disk MiB, CPU floor) a running one
    /// goes back to when its disk could not be kept.
    Resize {
        from: SandboxState,
        old: (u32, u32, u32, u32),
    },
    /// Move the `starting` sandbox to the image its record now names
    /// (`:switch-image`, service/switch.rs): the task, run under the
    /// sandbox's lifecycle lock like the others. Handed in as a task so
    /// this module does not depend on the switch, which depends on it.
    Switch {
        task: SwitchTask,
    },
}

impl Op {
    /// The request's event and the state the task expects to find.
    fn edge(&self) -> (Option<Event>, SandboxState) {
        match self {
            Op::Start { .. } | Op::Resize { .. } | Op::Switch { .. } => {
                (None, SandboxState::Starting)
            }
            Op::Stop { .. } => (Some(Event::Stop), SandboxState::Stopping),
            Op::Pause { .. } => (Some(Event::Pause), SandboxState::Pausing),
            Op::Wake { .. } => (Some(Event::Wake), SandboxState::Resuming),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Op::Start { .. } => "start",
            Op::Stop { .. } => "stop",
            Op::Pause { .. } => "pause",
            Op::Wake { .. } => "wake",
            Op::Resize { .. } => "resize",
            Op::Switch { .. } => "switch-image",
        }
    }
}

/// Moves a sandbox that was `from` (running, paused or stopped) into
/// `starting` for a new machine (`Event::Resize`: a resize or an image
/// switch), applying `change` to its record in the same write; one that
/// was not running gets a new lease. Then its programs, terminals and
/// watches end with its old machine. `NotRunning` when something else
/// moved it meanwhile (a stop, a pause, a delete).
pub(crate) fn restart_changed(
    st: &AppState,
    id: &str,
    from: SandboxState,
    change: impl FnOnce(&mut Sandbox),
) -> ApiResult<()> {
    let now = st.now_ms();
    let moved = transition(st, id, Event::Resize, |row| {
        let r = &mut row.record;
        change(r);
        r.ready_at = None;
        if from != SandboxState::Running {
            r.ended_at = None;
            r.stop_reason = None;
            r.paused_at = None;
            r.paused_expires_at = None;
            r.ends_at = crate::domain::lease::lease_end(r.timeout_seconds, now);
            r.expires_at = r.ends_at.clone();
        }
    })?;
    if !moved {
        let state = st
            .store()
            .get_sandbox(id)?
            .map_or(SandboxState::Stopped, |r| r.record.state);
        return Err(crate::error::ApiError::NotRunning {
            id: id.to_string(),
            state,
        });
    }
    st.inner.procs.sandbox_gone(st.store(), id);
    crate::service::watches::sandbox_gone(st, id);
    Ok(())
}

/// Moves the sandbox along `event` if that edge exists from its state (and
/// it is not deleted), applying `edit` in the same write. `true` when it moved.
pub(crate) fn transition(
    st: &AppState,
    id: &str,
    event: Event,
    edit: impl FnOnce(&mut SandboxRow),
) -> Result<bool, ServerError> {
    let mut moved = None;
    let row = st.store().update_sandbox(id, |r| {
        if r.deleted.is_some() {
            return false;
        }
        let Ok(to) = next(r.record.state, event) else {
            return false;
        };
        moved = Some(r.record.state);
        r.record.state = to;
        edit(r);
        true
    })?;
    if let (Some(from), Some(row)) = (moved, &row) {
        crate::service::events::sandbox_moved(st, row, from, event);
    }
    if moved.is_some() {
        st.notify_change();
    }
    Ok(moved.is_some())
}

/// Records the outcome `event` of the host call begun in state `from`,
/// unless something else (a stop, a delete) moved the sandbox meanwhile.
/// Answers the row as it is afterwards and whether this wrote it.
pub(crate) fn record(
    st: &AppState,
    id: &str,
    from: SandboxState,
    event: Event,
    edit: impl FnOnce(&mut Sandbox),
) -> Result<(Option<SandboxRow>, bool), ServerError> {
    let mut wrote = false;
    let row = st.store().update_sandbox(id, |r| {
        if r.record.state != from || r.deleted.is_some() {
            return false;
        }
        let Ok(to) = next(from, event) else {
            return false;
        };
        r.record.state = to;
        edit(&mut r.record);
        wrote = true;
        true
    })?;
    if let (true, Some(row)) = (wrote, &row) {
        crate::service::events::sandbox_moved(st, row, from, event);
    }
    Ok((row, wrote))
}

/// Starts `op` on the sandbox. `false` when the sandbox was not in a state
/// the operation starts from (so callers arriving together share one pause
/// or wake); a start always goes ahead.
pub(crate) fn drive(st: &AppState, id: &str, op: Op) -> ApiResult<bool> {
    let (event, expect) = op.edge();
    if let Some(event) = event {
        let lease = match &op {
            Op::Wake { lease } => *lease,
            _ => None,
        };
        let moved = transition(st, id, event, |r| {
            if lease.is_some() {
                r.record.timeout_seconds = lease;
            }
        })?;
        if !moved {
            return Ok(false);
        }
    }
    if let Op::Stop { .. } = op {
        // Nothing more reaches its processes and previews.
        st.inner.procs.sandbox_gone(st.store(), id);
        st.inner.previews.sandbox_gone(id);
        crate::service::watches::sandbox_gone(st, id);
    }
    let st2 = st.clone();
    let id = id.to_string();
    let span = tracing::info_span!("lifecycle", sandbox_id = %id, op = op.name());
    st.spawn(tracing::Instrument::instrument(
        async move {
            let lock = st2.lifecycle_lock(&id);
            let _g = lock.lock().await;
            let row = match st2.store().get_sandbox(&id) {
                Ok(Some(r)) if r.deleted.is_none() && r.record.state == expect => r,
                Ok(_) => return,
                Err(e) => {
                    tracing::error!(error = %e, "reading the sandbox failed");
                    return;
                }
            };
            run(&st2, row, op).await;
            st2.notify_change();
        },
        span,
    ));
    Ok(true)
}

/// The task's part of [`drive`], under the lifecycle lock.
async fn run(st: &AppState, row: SandboxRow, op: Op) {
    let id = row.record.id.clone();
    let now = st.now_ms();
    match op {
        Op::Start { from, warm } => boot(st, &row, from, warm).await,
        Op::Resize { from, old } => resize(st, &row, from, old).await,
        Op::Switch { task } => task(st.clone(), row.clone()).await,
        Op::Stop { reason } => {
            if row.record.persistent {
                // Ended first, its writes flushed: the kept disk has all of them.
                if let Err(e) = st.host().stop(&id, true).await {
                    tracing::warn!(error = %e, "host stop failed");
                }
                keep_disk(st, &id, &disk_dir(st, &id)).await;
            }
            if let Err(e) = st.host().stop(&id, false).await {
                tracing::warn!(error = %e, "host stop failed; recording the sandbox as stopped");
            }
            crate::service::shares::sandbox_ended(st, &id);
            let out = record(st, &id, SandboxState::Stopping, Event::Halted, |r| {
                r.stop_reason = Some(reason.into());
                r.ended_at = Some(iso(now));
            });
            if let Err(e) = out {
                tracing::error!(error = %e, "recording the stop failed");
            }
            tracing::info!(reason, "sandbox stopped");
        }
        Op::Pause { reason } => {
            // Its processes detach rather than end: a wake takes them up again.
            st.inner.procs.sandbox_pausing(&id);
            // Its watches end (`paused`), in the guest too, before it stops.
            crate::service::watches::sandbox_pausing(st, &id).await;
            let began = std::time::Instant::now();
            let result = st.host().pause(&id).await;
            st.inner
                .telemetry
                .pauses
                .record(outcome(&result), began.elapsed());
            let ev = match &result {
                Ok(()) => Event::Suspended,
                Err(HostError::NoSuchMachine { .. }) => Event::MachineGone,
                Err(_) => Event::PauseFailed,
            };
            if ev == Event::PauseFailed {
                // It runs on: take up any process whose handle closed.
                st.inner.procs.pause_failed(&id);
                crate::service::processes::recover::reattach(st, &id).await;
            }
            let now = iso(st.now_ms());
            let out = record(st, &id, SandboxState::Pausing, ev, |r| match ev {
                Event::Suspended => {
                    // Why it is paused (`idle`, `requested`, `lease_end`,
                    // `spending_limit`), until it wakes.
                    r.stop_reason = Some(reason.into());
                    r.paused_at = Some(now.clone());
                    r.paused_expires_at = crate::domain::lease::retention_end(r);
                }
                Event::MachineGone => {
                    r.stop_reason = Some("host_lost".into());
                    r.ended_at = Some(now.clone());
                }
                _ => {}
            });
            note_pause(st, &id, result.is_err());
            match (&result, out) {
                (Ok(()), Ok(_)) => tracing::info!(reason, "sandbox paused"),
                (Err(e), Ok(_)) => tracing::warn!(reason, error = %e, "pausing the sandbox failed"),
                (_, Err(e)) => tracing::error!(error = %e, "recording the pause failed"),
            }
            if ev == Event::MachineGone {
                machine_gone(st, &id);
            }
        }
        Op::Wake { .. } => {
            let began = std::time::Instant::now();
            let result = st.host().wake(&machine_spec(st, &row.record)).await;
            st.inner
                .telemetry
                .wakes
                .record(outcome(&result), began.elapsed());
            if result.is_ok() {
                // Before it is `running`, so a call that woke it finds them attached.
                crate::service::processes::recover::reattach(st, &id).await;
                // Its shared volumes' mounts are joined to the new link.
                crate::service::shares::reestablish(st, &id).await;
            }
            let ev = match &result {
                Ok(()) => Event::Woken,
                Err(HostError::NotPaused { .. }) => Event::MachineGone,
                Err(_) => Event::WakeFailed,
            };
            let now = st.now_ms();
            let out = record(st, &id, SandboxState::Resuming, ev, |r| match ev {
                Event::Woken => {
                    r.stop_reason = None;
                    r.paused_at = None;
                    r.paused_expires_at = None;
                    r.last_active_at = Some(iso(now));
                    r.ends_at = crate::domain::lease::lease_end(r.timeout_seconds, now);
                    r.expires_at = r.ends_at.clone();
                }
                Event::MachineGone => {
                    r.stop_reason = Some("host_lost".into());
                    r.ended_at = Some(iso(now));
                }
                _ => {}
            });
            match (&result, out) {
                (Ok(()), Ok(_)) => tracing::info!("sandbox woken"),
                (Err(e), Ok(_)) => tracing::warn!(error = %e, "waking the sandbox failed"),
                (_, Err(e)) => tracing::error!(error = %e, "recording the wake failed"),
            }
            if ev == Event::MachineGone {
                machine_gone(st, &id);
            }
        }
    }
}

/// Boots the `starting` sandbox of `row` (or restores it from `from`, or
/// has the warm machine it took take on its identity) and records how that
/// went.
pub(crate) async fn boot(
    st: &AppState,
    row: &SandboxRow,
    from: Option<Arc<CaptureDir>>,
    warm: bool,
) {
    let id = row.record.id.clone();
    let spec = machine_spec(st, &row.record);
    let began = std::time::Instant::now();
    let mut warmed = false;
    // The processes its capture carries, taken up once it is restored.
    let carried = from
        .as_ref()
        .map(|dir| crate::service::processes::carry::load(&dir.path))
        .unwrap_or_default();
    // A new machine of an image with a `start` command owes it: a marker
    // says so until it runs, so a crash before then still runs it
    // (`background::recover`).
    let fresh = from.is_none();
    if fresh {
        owe_start_command(st, &row.record);
    }
    let result = match &from {
        Some(dir) => st.host().restore(&spec, &dir.path).await,
        None if warm => match st.host().assume(&spec).await {
            Ok(()) => {
                warmed = true;
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "the warm machine could not take on the sandbox: starting another");
                if let Err(e) = st.host().stop(&id, false).await {
                    tracing::warn!(error = %e, "ending the warm machine failed");
                }
                st.host().start(&spec).await
            }
        },
        None => st.host().start(&spec).await,
    };
    let restored = from.is_some();
    let t = &st.inner.telemetry;
    let timed = if restored {
        &t.starts_capture
    } else if warmed {
        &t.starts_warm
    } else {
        &t.starts_image
    };
    timed.record(outcome(&result), began.elapsed());
    drop(from);
    if result.is_ok() {
        runtime_host::crash_point(st.config().test_crash_at.as_deref(), "machine_up");
        // Before it is `running`, so a call that finds it running finds them.
        crate::service::processes::carry::adopt(st, &id, row.record.memory_mib, carried).await;
    }
    let now = st.now_ms();
    let ev = if result.is_ok() {
        Event::Booted
    } else {
        Event::BootFailed
    };
    let out = record(st, &id, SandboxState::Starting, ev, |r| match ev {
        Event::Booted => {
            r.ready_at = Some(iso(now));
            r.last_active_at = Some(iso(now));
        }
        _ => {
            r.stop_reason = Some("start_failed".into());
            r.ended_at = Some(iso(now));
        }
    });
    match (&result, out) {
        (Ok(()), Ok((Some(row), _))) => {
            tracing::info!("sandbox running");
            start_image_command(st, &row, restored).await;
        }
        (Ok(()), Ok((None, _))) => tracing::info!("sandbox running"),
        (Err(e), Ok(_)) => tracing::warn!(error = %e, "sandbox failed to start"),
        (_, Err(e)) => tracing::error!(error = %e, "recording the start failed"),
    }
    if fresh {
        start_command_paid(st, &id);
    }
}

/// Where the marker of a sandbox that still owes its image's `start`
/// command is.
fn start_marker(st: &AppState, id: &str) -> PathBuf {
    st.config().data_dir.join("start-owed").join(id)
}

/// Marks `s` as owing its image's `start` command (when its image has one).
fn owe_start_command(st: &AppState, s: &Sandbox) {
    let Some(image) = s.image.as_deref() else {
        return;
    };
    if crate::service::images::start_of(st, image).is_none() {
        return;
    }
    let marker = start_marker(st, &s.id);
    let made = marker
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&marker, b""));
    if let Err(e) = made {
        tracing::warn!(sandbox_id = %s.id, error = %e, "marking the start command as owed failed");
    }
}

/// The `start` command of `id` ran (or never will): its marker goes.
pub(crate) fn start_command_paid(st: &AppState, id: &str) {
    let _ = std::fs::remove_file(start_marker(st, id));
}

/// Whether `id` still owes its image's `start` command (a crash came
/// between its machine's start and the command's).
pub(crate) fn owes_start_command(st: &AppState, id: &str) -> bool {
    start_marker(st, id).exists()
}

/// `:resize`: ends the machine of the sandbox (running or paused) keeping
/// its disk, then boots that disk at the shape the record now has. One
/// whose disk could not be kept is `stopped` (`resize_failed`) at its old
/// shape.
async fn resize(st: &AppState, row: &SandboxRow, from: SandboxState, old: (u32, u32, u32, u32)) {
    let id = row.record.id.clone();
    let persistent = row.record.persistent;
    // A persistent sandbox's disk is kept where a stop keeps it; another's
    // only until it has booted from it.
    let dir = if persistent {
        disk_dir(st, &id)
    } else {
        disk_dir(st, &id).with_extension("resize")
    };
    if from != SandboxState::Stopped {
        // Its machine ends: so do its shared volumes' mounts.
        crate::service::shares::sandbox_ended(st, &id);
        if from == SandboxState::Running {
            if let Err(e) = st.host().stop(&id, true).await {
                tracing::warn!(error = %e, "ending the machine for the resize failed");
            }
        }
        if !keep_disk(st, &id, &dir).await {
            let now = st.now_ms();
            let out = record(st, &id, SandboxState::Starting, Event::BootFailed, |r| {
                (r.vcpu, r.memory_mib, r.disk_mib, r.cpu_floor_millis) = old;
                r.stop_reason = Some("resize_failed".into());
                r.ended_at = Some(iso(now));
            });
            if let Err(e) = out {
                tracing::error!(error = %e, "recording the failed resize failed");
            }
            return;
        }
        if let Err(e) = st.host().stop(&id, false).await {
            tracing::warn!(error = %e, "ending the machine for the resize failed");
        }
    }
    let from = dir.join("disk.qcow2").exists().then(|| {
        Arc::new(CaptureDir {
            path: dir,
            temporary: !persistent,
        })
    });
    boot(st, row, from, false).await;
}

fn outcome<T, E>(r: &Result<T, E>) -> Outcome {
    if r.is_ok() {
        Outcome::Ok
    } else {
        Outcome::Failed
    }
}

/// Remembers whether the last pause of `id` failed, for the `:pause` answer:
/// a sandbox running again may also have paused and been woken.
fn note_pause(st: &AppState, id: &str, failed: bool) {
    let mut set = st
        .inner
        .pause_failed
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if failed {
        set.insert(id.to_string());
    } else {
        set.remove(id);
    }
}

pub(crate) fn machine_spec(st: &AppState, s: &Sandbox) -> MachineSpec {
    MachineSpec {
        id: s.id.clone(),
        vcpu: s.vcpu,
        memory_mib: s.memory_mib,
        disk_mib: s.disk_mib,
        hostname: format!("sbx-{}", s.id.chars().take(8).collect::<String>()),
        guest_ca_pem: crate::service::network::prepare_guest(st, &s.id),
        volumes: crate::service::volumes::drives(st, &s.id),
        image: s
            .image
            .as_deref()
            .and_then(|i| crate::service::images::disk_of(st, i)),
        no_template: false,
    }
}

/// Copies whose source could not be captured: `stopped` with
/// `start_failed`, as a failed boot.
pub(crate) fn fail_start(st: &AppState, ids: &[String]) {
    let at = iso(st.now_ms());
    for id in ids {
        let r = record(st, id, SandboxState::Starting, Event::BootFailed, |r| {
            r.stop_reason = Some("start_failed".into());
            r.ended_at = Some(at.clone());
        });
        if let Err(e) = r {
            tracing::error!(sandbox_id = %id, error = %e, "recording a failed start failed");
        }
    }
    st.notify_change();
}

/// A new sandbox of an image with a `start` command runs it in the
/// background (listed with its processes). Not after a restore from a
/// snapshot, whose processes are already there.
pub(crate) async fn start_image_command(st: &AppState, row: &SandboxRow, restored_snapshot: bool) {
    if restored_snapshot || row.record.state != SandboxState::Running {
        return;
    }
    let Some(image) = row.record.image.as_deref() else {
        return;
    };
    let Some((argv, cwd, user)) = crate::service::images::start_of(st, image) else {
        return;
    };
    match crate::service::processes::start::start_background(st, row, argv, cwd, user).await {
        Ok(p) => {
            tracing::info!(process_id = %p.id(), "image start command running")
        }
        Err(e) => {
            tracing::warn!(error = %e, "the image's start command did not start")
        }
    }
}

/// What the server held for a sandbox whose machine is gone (its
/// processes, watches and shared volumes' mounts) ends.
pub(crate) fn machine_gone(st: &AppState, id: &str) {
    st.inner.procs.sandbox_gone(st.store(), id);
    crate::service::watches::sandbox_gone(st, id);
    crate::service::shares::sandbox_ended(st, id);
}

/// Where a persistent sandbox's disk is kept while it is stopped.
pub(crate) fn disk_dir(st: &AppState, id: &str) -> PathBuf {
    st.config().data_dir.join("disks").join(id)
}

/// Captures the disk of a sandbox (paused, or ended keeping its disk) into
/// `dest` ([`disk_dir`] for a persistent one), replacing the previous
/// capture only once the new one is whole. A failure keeps the previous
/// one, if any; `false` then.
pub(crate) async fn keep_disk(st: &AppState, id: &str, dest: &Path) -> bool {
    let fresh = dest.with_extension("new");
    remove_dir_quietly(&fresh);
    if let Some(parent) = dest.parent() {
        if let Err(e) = std::fs::create_dir_all(parent) {
            tracing::error!(error = %e, "creating the disks directory failed");
            return false;
        }
    }
    match st.host().capture(id, &fresh, false).await {
        Ok(()) => {
            remove_dir_quietly(dest);
            match std::fs::rename(&fresh, dest) {
                Ok(()) => {
                    tracing::info!("disk kept for a restart");
                    true
                }
                Err(e) => {
                    tracing::error!(error = %e, "keeping the disk capture failed");
                    false
                }
            }
        }
        Err(e) => {
            remove_dir_quietly(&fresh);
            tracing::warn!(error = %e, "capturing the disk of the sandbox failed");
            false
        }
    }
}

pub(crate) fn remove_dir_quietly(p: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %p.display(), error = %e, "removing a directory failed");
        }
    }
}
