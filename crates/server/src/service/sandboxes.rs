//! Sandboxes: create, get, list, the verbs, delete; and what the other
//! services use: finding one a key may see, waking it for a call, waiting
//! for a state, names. Moves along the lifecycle go through
//! [`crate::service::lifecycle`]; the reaper and recovery are in
//! [`crate::service::background`].

use runtime_api::codes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use runtime_api::DeletedSandbox;
use runtime_host::HostError;
use serde_json::json;
use tokio::time::Instant;

use crate::domain::access::KeyInfo;
use crate::domain::lease;
use crate::domain::lifecycle::{next, Event, SandboxState};
use crate::domain::sandbox::{env_names, new_record, Settings};
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
                    code: codes::WAKE_FAILED,
                    message: format!("Sandbox {id} could not be woken; it stays paused."),
                })
            }
            Paused => {
                let lease = crate::domain::money::first_lease_seconds(row.record.timeout_seconds);
                crate::service::billing::check_spend(st, &row.key_id, &row.record, lease, lease)?;
                admit_machine(st, &row, 0).await?;
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

/// The live sandbox of key `owner` that holds `name`, if any: not
/// stopped, or stopped and persistent. Names belong to the key that made
/// the sandbox: another key's sandbox of the same name is not this one,
/// whatever that key may see.
pub(crate) fn name_holder(
    st: &AppState,
    owner: &str,
    name: &str,
    except: Option<&str>,
) -> Result<Option<SandboxRow>, ServerError> {
    Ok(st.store().live_sandboxes()?.into_iter().find(|r| {
        r.key_id == owner
            && r.record.name.as_deref() == Some(name)
            && Some(r.record.id.as_str()) != except
            && (r.record.state != Stopped || r.record.persistent)
    }))
}

/// Whether the sandbox's key may run its machine again, and the host has
/// room for it; `new_disk_mib` of disk is added to its key's.
async fn admit_machine(st: &AppState, row: &SandboxRow, new_disk_mib: u64) -> ApiResult<()> {
    let shape = (row.record.vcpu, row.record.memory_mib);
    crate::service::quotas::admit_machines(st, &row.key_id, &[shape], new_disk_mib).await
}

/// The disk a restart adds to its key's: none for a persistent sandbox,
/// whose disk was kept (and counted) while it was stopped.
fn restarted_disk(row: &SandboxRow) -> u64 {
    if row.record.persistent {
        0
    } else {
        u64::from(row.record.disk_mib)
    }
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
    drive(st, id, Op::Start { from, warm: false })?;
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
    let mut from = None;
    let row = st
        .store()
        .update_sandbox(id, |r| {
            if r.deleted.is_some() {
                return false;
            }
            from = Some(r.record.state);
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
    if let Some(from) = from.filter(|_| row.deleted.is_some()) {
        crate::service::events::sandbox_moved(st, &row, from, Event::Delete);
        crate::service::events::sandbox_event(st, &row, "sandbox.deleted", &[]);
    }
    st.notify_change();
    st.inner.procs.sandbox_gone(st.store(), id);
    st.inner.uploads.sandbox_gone(id);
    crate::service::watches::sandbox_gone(st, id);
    crate::service::previews::live::sandbox_gone(st, id);
    crate::service::network::sandbox_gone(st, id);
    crate::service::shares::sandbox_ended(st, id);
    // Marked deleted, its machine not ended yet.
    runtime_host::crash_point(st.config().test_crash_at.as_deref(), "delete_destroy");
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

/// With several control planes on one store: the node a create must run
/// on because its image's layers or its snapshot are there, or (with
/// `getOrCreate`) the sandbox holding its name is (`None`: this one will
/// do). Unknown or unready images and snapshots are left to the
/// create's own checks here.
pub(crate) fn node_for_create(
    st: &AppState,
    key: &KeyInfo,
    req: &NewSandbox,
) -> ApiResult<Option<String>> {
    if !st.store().shared() {
        return Ok(None);
    }
    let node = if let Some(r) = &req.image {
        match crate::service::images::resolve(st, key, r) {
            Ok(img) => st.store().image_node(&img.id)?,
            Err(_) => None,
        }
    } else if let Some(sid) = &req.snapshot {
        match crate::service::snapshots::records::find_ready(st, key, sid) {
            Ok(snap) => st.store().sandbox_node(&snap.record.sandbox_id)?,
            Err(_) => None,
        }
    } else if let (true, Some(name)) = (req.get_or_create, &req.settings.name) {
        // `getOrCreate` answers the name's holder, woken or restarted
        // where its machine or disk is.
        match name_holder(st, &key.id, name, None)? {
            Some(h) if visible(key, &h) => st.store().sandbox_node(&h.record.id)?,
            _ => None,
        }
    } else {
        None
    };
    Ok(node.filter(|n| !n.is_empty() && n != st.store().node()))
}

/// A create, parsed: the settings of the record and what starts it.
pub(crate) struct NewSandbox {
    pub settings: Settings,
    pub env: Vec<(String, String)>,
    pub get_or_create: bool,
    pub snapshot: Option<String>,
    /// The shape fields the request named (a snapshot's shape must match them).
    pub shape_given: Vec<(&'static str, u32)>,
    pub floor_given: bool,
    pub net: crate::domain::network::CreateNet,
    pub volumes: Vec<crate::service::volumes::Attachment>,
    pub image: Option<String>,
    /// The idempotency record of the request, stored with the new sandbox.
    pub answer_slot: Option<AnswerSlot>,
}

/// Where a create's idempotent answer goes: the key's id, the request's
/// `Idempotency-Key` and its fingerprint. The sandbox a create makes is
/// stored with a pending record there in one transaction, so a resend
/// after a crash finds that sandbox and never makes a second.
#[derive(Clone)]
pub(crate) struct AnswerSlot {
    pub key_id: String,
    pub idem_key: String,
    pub fingerprint: String,
}

impl AnswerSlot {
    /// A pending record of `kind` naming what the request made (`body`),
    /// stored with it at `now_ms`.
    pub(crate) fn pending(
        &self,
        kind: &str,
        body: serde_json::Value,
        now_ms: i64,
    ) -> crate::store::StoredAnswer {
        crate::store::StoredAnswer {
            fingerprint: self.fingerprint.clone(),
            kind: kind.into(),
            status: 201,
            body: body.to_string(),
            created_ms: now_ms,
        }
    }
}

/// The pending answer of a create of `id` at `now_ms`.
fn pending_answer(slot: &AnswerSlot, id: &str, now_ms: i64) -> crate::store::StoredAnswer {
    slot.pending(
        crate::store::PENDING_SANDBOX,
        serde_json::json!({ "sandboxId": id }),
        now_ms,
    )
}

/// A create's answer replayed from its pending record (the server died
/// before the answer was stored): the sandbox it made, as it is now.
pub(crate) fn created(st: &AppState, id: &str) -> ApiResult<Created> {
    let row = st
        .store()
        .get_sandbox(id)?
        .filter(|r| r.deleted.is_none())
        .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    let start_mode = if row.record.snapshot.is_some() {
        "snapshot"
    } else {
        "boot"
    };
    Ok(Created {
        row,
        reused: false,
        start_mode,
    })
}

/// What a create made: the sandbox, whether `getOrCreate` found it, and
/// how it starts (`boot` or `snapshot`).
pub(crate) struct Created {
    pub row: SandboxRow,
    pub reused: bool,
    pub start_mode: &'static str,
}

/// Creates a sandbox (or, with `getOrCreate`, finds the one of that name
/// and starts it again when it is stopped), then waits up to `wait` for it
/// to leave `starting`.
pub(crate) async fn create(
    st: &AppState,
    key: &KeyInfo,
    req: NewSandbox,
    wait: Option<Duration>,
) -> ApiResult<Created> {
    let NewSandbox {
        settings,
        mut env,
        get_or_create,
        snapshot,
        shape_given,
        floor_given,
        net,
        volumes,
        image,
        answer_slot,
    } = req;
    let mut record = new_record(
        settings,
        uuid::Uuid::new_v4().to_string(),
        &env,
        st.now_ms(),
    );
    if let Some(r) = &image {
        // The image's environment first; the create's own variables win.
        let img = crate::service::images::for_create(st, key, r)?;
        // A disk smaller than the image's file system cannot hold it: the
        // default grows to it, a smaller one asked for is refused.
        if let Some(floor) = img.disk_mib.filter(|&m| m > record.disk_mib) {
            if shape_given.iter().any(|(k, _)| *k == "diskMiB") {
                return Err(ApiError::invalid(
                    "diskMiB",
                    format!(
                        "must be at least {floor}, the disk of image {} (or left out)",
                        img.id
                    ),
                ));
            }
            record.disk_mib = floor;
        }
        let mut merged = img.env;
        merged.retain(|(k, _)| !env.iter().any(|(n, _)| n == k));
        merged.append(&mut env);
        env = merged;
        record.env_names = env_names(&env);
        record.image = Some(img.id);
    }
    let from = match &snapshot {
        Some(sid) => {
            let snap = crate::service::snapshots::records::find_ready(st, key, sid)?;
            let s = &snap.record;
            if !volumes.is_empty() && s.mode == "memory" {
                return Err(ApiError::invalid(
                    "volumes",
                    "a start from a memory snapshot cannot attach volumes (its machine had none); \
                     use a disk snapshot",
                ));
            }
            let want = [
                ("vcpu", s.vcpu),
                ("memoryMiB", s.memory_mib),
                ("diskMiB", s.disk_mib),
            ];
            // A memory snapshot resumes its machine as it was: its shape
            // only. A disk snapshot boots fresh at any vCPUs and memory, on
            // a disk at least as large as the one saved.
            let disk_only = s.mode == "disk";
            let issues: Vec<runtime_api::Issue> = shape_given
                .iter()
                .filter_map(|(k, v)| {
                    let (_, w) = want.iter().find(|(n, _)| n == k)?;
                    let fits = match (disk_only, *k) {
                        (true, "diskMiB") => v >= w,
                        (true, _) => true,
                        (false, _) => v == w,
                    };
                    let message = if disk_only {
                        format!("must be at least {w}, the disk of snapshot {sid} (or left out)")
                    } else {
                        format!("must be {w}, the value of snapshot {sid} (or left out)")
                    };
                    (!fits).then(|| runtime_api::Issue {
                        field: (*k).to_string(),
                        message,
                    })
                })
                .collect();
            if !issues.is_empty() {
                return Err(ApiError::Invalid { issues });
            }
            let given = |k: &str| shape_given.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
            let r = &mut record;
            r.vcpu = s.vcpu;
            r.memory_mib = s.memory_mib;
            r.disk_mib = s.disk_mib;
            if disk_only {
                r.vcpu = given("vcpu").unwrap_or(s.vcpu);
                r.memory_mib = given("memoryMiB").unwrap_or(s.memory_mib);
                r.disk_mib = given("diskMiB").unwrap_or(s.disk_mib);
            }
            if r.cpu == "reserved" && !floor_given {
                r.cpu_floor_millis = r.vcpu * 1000;
            }
            r.cpu_floor_millis = r.cpu_floor_millis.min(r.vcpu * 1000);
            Some(Arc::new(CaptureDir {
                path: crate::service::snapshots::records::dir(st, sid),
                temporary: false,
            }))
        }
        None => None,
    };
    let start_mode = if from.is_some() { "snapshot" } else { "boot" };
    crate::service::volumes::flush_writers(st, key, &volumes).await;
    // The host's room is asked before the create lock (a new sandbox's
    // only wait on the host), so creates at once wait for each other only
    // for their counts and inserts. A `getOrCreate` may find its sandbox
    // running and start nothing: it asks under the lock, as before.
    let shape = [(record.vcpu, record.memory_mib)];
    if !get_or_create {
        crate::service::quotas::admit_room(st, &shape).await?;
    }
    let (id, reused) = {
        let _g = st.inner.create_lock.lock().await;
        let holder = match &record.name {
            Some(n) => name_holder(st, &key.id, n, None)?,
            None => None,
        };
        match holder {
            Some(h) if get_or_create && visible(key, &h) => {
                let id = h.record.id.clone();
                if h.record.state == Stopped {
                    let lease = crate::domain::money::first_lease_seconds(h.record.timeout_seconds);
                    crate::service::billing::check_spend(st, &h.key_id, &h.record, lease, lease)?;
                    admit_machine(st, &h, restarted_disk(&h)).await?;
                    restart(st, &id)?;
                }
                (id, true)
            }
            Some(h) => {
                let sandbox_id = visible(key, &h).then(|| h.record.id.clone());
                return Err(ApiError::NameTaken {
                    name: h.record.name.unwrap_or_default(),
                    sandbox_id,
                });
            }
            None => {
                // Before anything starts: a refusal costs nothing.
                let lease = crate::domain::money::first_lease_seconds(record.timeout_seconds);
                crate::service::billing::check_spend(st, &key.id, &record, lease, lease)?;
                crate::service::quotas::admit_machine_quota(
                    st,
                    &key.id,
                    &shape,
                    u64::from(record.disk_mib),
                )?;
                if get_or_create {
                    crate::service::quotas::admit_room(st, &shape).await?;
                }
                // A warm machine of its image and shape, when it can take
                // one: the sandbox gets the machine's id.
                let warm = if crate::service::pool::fits(volumes.len(), snapshot.is_some()) {
                    crate::service::pool::take(st, &record)
                } else {
                    None
                };
                if let Some(w) = &warm {
                    record.id = w.id().to_owned();
                }
                let row = SandboxRow {
                    seq: 0,
                    key_id: key.id.clone(),
                    record,
                    env,
                    deleted: None,
                };
                let mut row = row;
                row.record.snapshot = snapshot.clone();
                let volumes = crate::service::volumes::resolve(st, key, &volumes).await?;
                crate::service::network::store_create(st, &row.record.id, &net)?;
                row.record.secrets = crate::service::network::load(st, &row.record.id)?.secrets;
                crate::service::volumes::keep(st, &row.record.id, &volumes)?;
                let pending = answer_slot
                    .as_ref()
                    .map(|a| (a, pending_answer(a, &row.record.id, st.now_ms())));
                st.store().insert_sandbox_answered(
                    &row,
                    pending
                        .as_ref()
                        .map(|(a, p)| (a.key_id.as_str(), a.idem_key.as_str(), p)),
                )?;
                tracing::info!(sandbox_id = %row.record.id, "sandbox created");
                st.inner.telemetry.sandboxes_created.inc();
                crate::service::events::sandbox_event(st, &row, "sandbox.created", &[]);
                let warmed = warm.is_some();
                if let Some(w) = warm {
                    w.keep();
                }
                drive(st, &row.record.id, Op::Start { from, warm: warmed })?;
                (row.record.id, false)
            }
        }
    };
    if let Some(wait) = wait {
        wait_until(st, &id, wait, |s| s != Starting && s != Stopping).await?;
    }
    runtime_host::crash_point(st.config().test_crash_at.as_deref(), "create_answer");
    let row = st
        .store()
        .get_sandbox(&id)?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    Ok(Created {
        row,
        reused,
        start_mode,
    })
}

/// The sandbox, after waiting up to the given time for it to reach the
/// given state (or `stopped`, which it will not leave by itself).
pub(crate) async fn get(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    wait_for: Option<(SandboxState, Duration)>,
) -> ApiResult<SandboxRow> {
    find(st, key, id)?;
    if let Some((target, timeout)) = wait_for {
        wait_until(st, id, timeout, |s| s == target || s == Stopped).await?;
    }
    find(st, key, id)
}

/// Which sandboxes a list asks for.
pub(crate) struct ListFilter {
    /// Only these states (empty: all but `stopped`, unless `include_stopped`).
    pub states: Vec<SandboxState>,
    pub name: Option<String>,
    pub labels: Vec<(String, String)>,
    pub include_stopped: bool,
    pub limit: usize,
    /// Only sandboxes created after the one with this sequence number.
    pub after_seq: Option<i64>,
}

/// One page of the sandboxes `key` sees, oldest first (as the client
/// documents), and whether more follow.
pub(crate) fn list(
    st: &AppState,
    key: &KeyInfo,
    f: &ListFilter,
) -> ApiResult<(Vec<SandboxRow>, bool)> {
    let mut rows = st
        .store()
        .live_sandboxes()?
        .into_iter()
        .rev()
        .filter(|r| visible(key, r))
        .filter(|r| f.after_seq.is_none_or(|c| r.seq > c))
        .filter(|r| {
            if f.states.is_empty() {
                f.include_stopped || r.record.state != Stopped
            } else {
                f.states.contains(&r.record.state)
            }
        })
        .filter(|r| {
            f.name
                .as_ref()
                .is_none_or(|n| r.record.name.as_ref() == Some(n))
        })
        .filter(|r| {
            f.labels
                .iter()
                .all(|(k, v)| r.record.labels.get(k) == Some(v))
        })
        .take(f.limit + 1)
        .collect::<Vec<_>>();
    let more = rows.len() > f.limit;
    rows.truncate(f.limit);
    Ok((rows, more))
}

/// Deletes the sandbox (a second delete answers the first's record).
pub(crate) fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<DeletedSandbox> {
    let row = match st.store().get_sandbox(id)? {
        Some(r) if visible(key, &r) => r,
        _ => return Err(ApiError::sandbox_not_found(id)),
    };
    let deleted = match row.deleted {
        Some(d) => Some(d),
        None => delete_sandbox(st, id, "deleted")?.deleted,
    };
    deleted.ok_or_else(|| ApiError::sandbox_not_found(id))
}

/// `:stop`, waiting up to `wait` for `stopped`.
pub(crate) async fn stop(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    find(st, key, id)?;
    stop_for(st, id, "requested")?;
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s == Stopped).await?;
    }
    find(st, key, id)
}

/// `:restart`: a stopped persistent sandbox starts again from its disk; a
/// live one answers as it is; a stopped one that is not persistent is 409
/// `not_persistent`.
pub(crate) async fn restart_stopped(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Stopping]).await?;
    if row.record.state == Stopped {
        if !row.record.persistent {
            return Err(ApiError::Conflict {
                code: codes::NOT_PERSISTENT,
                message: format!(
                    "Sandbox {id} is stopped and not persistent, so it has no disk to restart from."
                ),
                details: Some(json!({ "sandboxId": id })),
            });
        }
        let _g = st.inner.create_lock.lock().await;
        name_free_for_restart(st, key, &row)?;
        let lease = crate::domain::money::first_lease_seconds(row.record.timeout_seconds);
        crate::service::billing::check_spend(st, &row.key_id, &row.record, lease, lease)?;
        admit_machine(st, &row, restarted_disk(&row)).await?;
        restart(st, id)?;
    }
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s != Starting).await?;
    }
    find(st, key, id)
}

/// A stopped sandbox starts again only while no other live one of its key
/// took its name meanwhile (409 `name_taken`). Called under the create lock.
pub(crate) fn name_free_for_restart(
    st: &AppState,
    key: &KeyInfo,
    row: &SandboxRow,
) -> ApiResult<()> {
    if let Some(n) = &row.record.name {
        if let Some(h) = name_holder(st, &row.key_id, n, Some(&row.record.id))? {
            let sandbox_id = visible(key, &h).then(|| h.record.id.clone());
            return Err(ApiError::NameTaken {
                name: n.clone(),
                sandbox_id,
            });
        }
    }
    Ok(())
}

/// `:pause`, waiting up to `wait` for the pause to end; 409 `pause_failed`
/// when it ran on.
pub(crate) async fn pause(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Starting, Resuming]).await?;
    let mut asked = false;
    match row.record.state {
        Running if !row.record.pausable => {
            return Err(ApiError::Conflict {
                code: codes::NOT_PAUSABLE,
                message: format!("Sandbox {id} was created with pausable: false."),
                details: Some(json!({ "sandboxId": id })),
            })
        }
        Running => asked = request_pause(st, id, "requested")?,
        Pausing | Paused => {}
        _ => {
            return Err(ApiError::NotRunning {
                id: id.to_string(),
                state: row.record.state,
            })
        }
    }
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s != Pausing).await?;
    }
    let row = find(st, key, id)?;
    // Running again: the pause failed, or it paused and a call (a resuming
    // stream) woke it at once.
    let failed = asked
        && row.record.state == Running
        && st
            .inner
            .pause_failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id);
    if failed {
        return Err(ApiError::Failed {
            code: codes::PAUSE_FAILED,
            message: format!("Sandbox {id} could not be paused; it runs on."),
        });
    }
    Ok(row)
}

/// `:wake`, with a new lease of `lease` seconds when given (an awake
/// sandbox takes it from now); 409 `wake_failed` when it stayed paused.
pub(crate) async fn wake(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    lease: Option<u32>,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Pausing]).await?;
    let mut asked = false;
    match row.record.state {
        Paused => {
            let seconds =
                crate::domain::money::first_lease_seconds(lease.or(row.record.timeout_seconds));
            crate::service::billing::check_spend(st, &row.key_id, &row.record, seconds, seconds)?;
            admit_machine(st, &row, 0).await?;
            asked = drive(st, id, Op::Wake { lease })?
        }
        Resuming => {}
        Running | Starting => {
            // Already awake: done. A new limit asked for applies from now.
            if let Some(t) = lease {
                crate::service::billing::check_lease_change(st, &row, t)?;
                let now = st.now_ms();
                st.store().update_sandbox(id, |r| {
                    r.record.timeout_seconds = Some(t);
                    r.record.ends_at = lease::lease_end(Some(t), now);
                    r.record.expires_at = r.record.ends_at.clone();
                    true
                })?;
                st.notify_change();
            }
        }
        _ => {
            return Err(ApiError::NotRunning {
                id: id.to_string(),
                state: row.record.state,
            })
        }
    }
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s != Resuming).await?;
    }
    let row = find(st, key, id)?;
    if asked && row.record.state == Paused {
        return Err(ApiError::Failed {
            code: codes::WAKE_FAILED,
            message: format!("Sandbox {id} could not be woken; it stays paused."),
        });
    }
    Ok(row)
}

/// `:retention {days}`: a paused sandbox is deleted `days` after its pause
/// (this pause and later ones).
pub(crate) fn set_retention(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    days: Option<u32>,
) -> ApiResult<SandboxRow> {
    find(st, key, id)?;
    let row = st
        .store()
        .update_sandbox(id, |r| {
            r.record.retention_days = days;
            if r.record.state == Paused {
                r.record.paused_expires_at = lease::retention_end(&r.record);
            }
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    st.notify_change();
    Ok(row)
}

/// `:extend`: the lease of an awake sandbox ends `seconds` later.
pub(crate) fn extend(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    seconds: i64,
) -> ApiResult<SandboxRow> {
    let row = find(st, key, id)?;
    if row.record.state != Running && row.record.state != Starting {
        return Err(ApiError::NotRunning {
            id: id.to_string(),
            state: row.record.state,
        });
    }
    if row.record.ends_at.is_some() {
        let left = crate::domain::money::lease_left_seconds(&row.record, st.now_ms());
        crate::service::billing::check_spend(
            st,
            &row.key_id,
            &row.record,
            left + seconds,
            seconds,
        )?;
    }
    let now = st.now_ms();
    let row = st
        .store()
        .update_sandbox(id, |r| {
            let Some(end) = r.record.ends_at.as_deref().and_then(parse_iso_ms) else {
                return false;
            };
            let end = iso(end.max(now) + seconds * 1000);
            r.record.ends_at = Some(end.clone());
            r.record.expires_at = Some(end);
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    st.notify_change();
    Ok(row)
}

/// `:update`: each field given is changed; `None` leaves it as it is.
pub(crate) struct Update {
    /// `Some(None)` removes the name.
    pub name: Option<Option<String>>,
    pub labels: Option<BTreeMap<String, String>>,
    /// Variables to set (`Some`) or remove (`None`).
    pub env_changes: Vec<(String, Option<String>)>,
    pub auto_wake: Option<bool>,
    pub user: Option<String>,
    pub idle_pause_seconds: Option<u32>,
    pub persistent: Option<bool>,
    /// `Some(None)` removes the cap.
    pub max_total_cost_micros: Option<Option<i64>>,
    pub on_lease_end: Option<String>,
    /// `Some(None)` removes the lease; a new one runs from now.
    pub timeout_seconds: Option<Option<u32>>,
}

pub(crate) async fn update(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    u: Update,
) -> ApiResult<SandboxRow> {
    let row = find(st, key, id)?;
    if let (Some(Some(t)), Running | Starting) = (u.timeout_seconds, row.record.state) {
        crate::service::billing::check_lease_change(st, &row, t)?;
    }
    let _g = st.inner.create_lock.lock().await;
    if let Some(Some(n)) = &u.name {
        if let Some(h) = name_holder(st, &row.key_id, n, Some(id))? {
            let sandbox_id = visible(key, &h).then(|| h.record.id.clone());
            return Err(ApiError::NameTaken {
                name: n.clone(),
                sandbox_id,
            });
        }
    }
    let now = st.now_ms();
    let row = st
        .store()
        .update_sandbox(id, |r| {
            for (k, v) in &u.env_changes {
                r.env.retain(|(n, _)| n != k);
                if let Some(v) = v {
                    r.env.push((k.clone(), v.clone()));
                }
            }
            let s = &mut r.record;
            if let Some(name) = &u.name {
                s.name = name.clone();
            }
            if let Some(l) = &u.labels {
                s.labels = l.clone();
            }
            s.env_names = env_names(&r.env);
            s.auto_wake = u.auto_wake.unwrap_or(s.auto_wake);
            s.user = u.user.clone().unwrap_or(s.user.clone());
            s.idle_pause_seconds = u.idle_pause_seconds.unwrap_or(s.idle_pause_seconds);
            s.persistent = u.persistent.unwrap_or(s.persistent);
            if let Some(cap) = u.max_total_cost_micros {
                s.max_total_cost_micros = cap;
            }
            if let Some(o) = &u.on_lease_end {
                s.on_lease_end = o.clone();
            }
            if let Some(t) = u.timeout_seconds {
                s.timeout_seconds = t;
                s.ends_at = lease::lease_end(t, now);
                s.expires_at = s.ends_at.clone();
            }
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(id))?;
    st.notify_change();
    Ok(row)
}
