//! Memory copies of a sandbox (contract §5): `:fork` and `:snapshot`,
//! the snapshots' records, deletion and expiry.
//!
//! Both capture the source through [`runtime_host::Host::capture`] under its
//! lifecycle lock (a running source stops for the copy and goes on, a
//! paused one stays paused). A fork captures memory into a temporary
//! directory under `data_dir/forks/` and restores each copy from it as a new
//! sandbox; the directory goes once the last copy started. A snapshot keeps
//! its capture in `data_dir/snapshots/<id>/` until deleted or expired; a
//! create with `snapshot` restores from it with the snapshot's shape.

use runtime_api::codes;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;

use tokio::time::Instant;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::snapshot::Snapshot;
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult};
use crate::service::lifecycle::{drive, fail_start, CaptureDir, Op};
use crate::service::sandboxes::AnswerSlot;
use crate::service::sandboxes::{name_holder, settled_source, wait_until};
use crate::store::{SandboxRow, SnapshotRow};
use crate::AppState;

pub(crate) mod records;

use records::{dir, find, not_found, visible};

/// Most copies one fork makes.
pub(crate) const MAX_FORK: i64 = 8;
pub(crate) const DEFAULT_RETENTION_DAYS: i64 = 30;

fn size_of(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => size_of(&e.path()),
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                // Allocated bytes: captures are sparse.
                m.blocks() * 512
            }
            Err(_) => 0,
        })
        .sum()
}

fn remove_dir(p: &Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %p.display(), error = %e, "removing a capture failed");
        }
    }
}

/// A fork, parsed.
pub(crate) struct Fork {
    pub count: usize,
    pub name: Option<String>,
    pub labels: Option<BTreeMap<String, String>>,
    pub net: crate::domain::network::CreateNet,
    /// The copies start from a snapshot of the source that is kept (and
    /// answered), rather than from a capture dropped once they started.
    pub keep_snapshot: bool,
    /// The request's idempotency record, stored with the copies.
    pub answer_slot: Option<AnswerSlot>,
}

/// How long a fork with `keepSnapshot` waits for its snapshot.
const KEPT_SNAPSHOT_WAIT: Duration = Duration::from_secs(600);

/// `:fork`: `count` new sandboxes from a capture of `id`'s memory, each
/// started as its source was; waits up to `wait` for them to leave
/// `starting`. Answers the copies as they are then.
pub(crate) async fn fork(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    req: Fork,
    wait: Option<Duration>,
) -> ApiResult<(Vec<SandboxRow>, Option<Snapshot>)> {
    let Fork {
        count,
        name,
        labels,
        net,
        keep_snapshot,
        answer_slot,
    } = req;
    let src = settled_source(st, key, id).await?;
    crate::service::volumes::refuse_copy(st, id, "fork")?;
    let lease = crate::domain::money::first_lease_seconds(src.record.timeout_seconds);
    let copies_cost = i64::try_from(count)
        .unwrap_or(i64::MAX)
        .saturating_mul(lease);
    crate::service::billing::check_spend(st, &key.id, &src.record, lease, copies_cost)?;
    // Kept: a memory snapshot of the source, taken first (its own quota),
    // which the copies then start from.
    let kept = if keep_snapshot {
        let req = NewSnapshot {
            name: None,
            labels: src.record.labels.clone(),
            retention_days: DEFAULT_RETENTION_DAYS,
            mode: "memory".into(),
            answer_slot: None,
        };
        let snap = snapshot(st, key, id, req, Some(KEPT_SNAPSHOT_WAIT)).await?;
        if snap.state != "ready" {
            return Err(ApiError::Failed {
                code: codes::SNAPSHOT_FAILED,
                message: format!(
                    "The snapshot of sandbox {id} the fork was to keep is {}: {}",
                    snap.state,
                    snap.error.as_deref().unwrap_or("no copy was started")
                ),
            });
        }
        Some(snap)
    } else {
        None
    };

    let now = st.now_ms();
    let copies: Vec<SandboxRow> = {
        let _g = st.inner.create_lock.lock().await;
        // Counted under the lock: two forks at once cannot both take the last place.
        let shapes = vec![(src.record.vcpu, src.record.memory_mib); count];
        let disks = u64::from(src.record.disk_mib) * count as u64;
        crate::service::quotas::admit_machines(st, &key.id, &shapes, disks).await?;
        if let Some(n) = &name {
            if let Some(h) = name_holder(st, &key.id, n, None)? {
                let sandbox_id =
                    crate::service::sandboxes::visible(key, &h).then(|| h.record.id.clone());
                return Err(ApiError::NameTaken {
                    name: n.clone(),
                    sandbox_id,
                });
            }
        }
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            let mut r = src.record.clone();
            r.id = uuid::Uuid::new_v4().to_string();
            r.name = name.clone();
            if let Some(l) = &labels {
                r.labels = l.clone();
            }
            r.state = SandboxState::Starting;
            r.status = r.state.status().into();
            r.created_at = iso(now);
            r.ready_at = None;
            r.ends_at = r.timeout_seconds.map(|t| iso(now + i64::from(t) * 1000));
            r.expires_at = r.ends_at.clone();
            r.ended_at = None;
            r.stop_reason = None;
            r.paused_at = None;
            r.paused_expires_at = None;
            r.last_active_at = Some(iso(now));
            r.charged_micros = 0;
            r.held_micros = 0;
            // A copy of a sandbox, not of a snapshot.
            r.snapshot = None;
            let mut row = SandboxRow {
                seq: 0,
                key_id: key.id.clone(),
                record: r,
                env: src.env.clone(),
                deleted: None,
            };
            crate::service::network::copy_settings(
                st,
                &src.record.id,
                &row.record.id,
                net.secrets.clone(),
            )?;
            row.record.secrets = crate::service::network::load(st, &row.record.id)?.secrets;
            out.push(row);
        }
        // The copies and the request's pending record, in one transaction:
        // a resend after a crash answers these copies and makes no more.
        let pending = answer_slot.as_ref().map(|a| {
            let ids: Vec<&str> = out.iter().map(|r| r.record.id.as_str()).collect();
            let body = serde_json::json!({
                "sandboxIds": ids,
                "snapshotId": kept.as_ref().map(|s| s.id.clone()),
            });
            (a, a.pending(crate::store::PENDING_FORK, body, now))
        });
        st.store().insert_sandboxes_answered(
            &out,
            pending
                .as_ref()
                .map(|(a, p)| (a.key_id.as_str(), a.idem_key.as_str(), p)),
        )?;
        for row in &out {
            st.inner.telemetry.sandboxes_created.inc();
            crate::service::events::sandbox_event(
                st,
                row,
                "sandbox.created",
                &[("forkedFrom", serde_json::Value::from(src.record.id.clone()))],
            );
        }
        out
    };
    st.notify_change();
    tracing::info!(sandbox_id = %id, count, "fork requested");

    let ids: Vec<String> = copies.iter().map(|c| c.record.id.clone()).collect();
    let st2 = st.clone();
    let src_id = id.to_string();
    let task_ids = ids.clone();
    let kept_dir = kept.as_ref().map(|s| dir(st, &s.id));
    st.spawn(async move {
        let (capture, result) = match kept_dir {
            Some(path) => (
                Arc::new(CaptureDir {
                    path,
                    temporary: false,
                }),
                Ok(()),
            ),
            None => {
                let capture = Arc::new(CaptureDir {
                    path: st2
                        .host()
                        .scratch_dir()
                        .unwrap_or_else(|| st2.config().data_dir.join("forks"))
                        .join(uuid::Uuid::new_v4().to_string()),
                    temporary: true,
                });
                let result = {
                    let lock = st2.lifecycle_lock(&src_id);
                    let _g = lock.lock().await;
                    let r = st2.host().capture(&src_id, &capture.path, true).await;
                    if r.is_ok() {
                        crate::service::processes::carry::save(&st2, &src_id, &capture.path);
                    }
                    r
                };
                (capture, result)
            }
        };
        match result {
            Ok(()) => {
                for cid in task_ids {
                    let from = Some(capture.clone());
                    if let Err(e) = drive(&st2, &cid, Op::Start { from, warm: false }) {
                        tracing::error!(sandbox_id = %cid, error = %e, "starting a fork's copy failed");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %src_id, error = %e, "capturing the source of a fork failed");
                fail_start(&st2, &task_ids);
            }
        }
    });

    if let Some(wait) = wait {
        let deadline = Instant::now() + wait;
        for cid in &ids {
            let left = deadline.saturating_duration_since(Instant::now());
            wait_until(st, cid, left, |s| s != SandboxState::Starting).await?;
        }
    }
    runtime_host::crash_point(st.config().test_crash_at.as_deref(), "fork_answer");
    let mut out = Vec::with_capacity(ids.len());
    for cid in &ids {
        if let Some(r) = st.store().get_sandbox(cid)? {
            out.push(r);
        }
    }
    Ok((out, kept))
}

/// A snapshot, parsed.
pub(crate) struct NewSnapshot {
    pub name: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub retention_days: i64,
    /// `memory` or `disk`.
    pub mode: String,
    /// The request's idempotency record, stored with the snapshot.
    pub answer_slot: Option<AnswerSlot>,
}

/// `:snapshot`: captures `id` into a snapshot kept `retention_days`; waits
/// up to `wait` for the capture to end.
pub(crate) async fn snapshot(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    req: NewSnapshot,
    wait: Option<Duration>,
) -> ApiResult<Snapshot> {
    let NewSnapshot {
        name,
        labels,
        retention_days: retention,
        mode,
        answer_slot,
    } = req;
    let id = id.to_string();
    let src = settled_source(st, key, &id).await?;
    if mode == "memory" {
        crate::service::volumes::refuse_copy(st, &id, "memory snapshot")?;
    }
    // Its size is known once taken: it asks for what the host estimates
    // (the disk as written, the memory held), at least a MiB, so a key at
    // its bytes' quota takes no more.
    let estimate = st.host().capture_estimate(&id, mode == "memory");
    let admitted_mib = crate::domain::quota::mib_of(estimate.unwrap_or(0)).max(1);
    let mut asked = crate::domain::quota::Usage::default();
    asked.add("snapshot.count", 1);
    asked.add("snapshot.mib", admitted_mib);
    // Checked and inserted under one lock, and held at what it was
    // admitted for while it is captured: two at once cannot both pass.
    let _admission = st.inner.create_lock.lock().await;
    crate::service::quotas::admit(st, &key.id, &asked)?;
    let now = st.now_ms();
    let snap = Snapshot {
        id: uuid::Uuid::new_v4().to_string(),
        kind: "snapshot".into(),
        sandbox_id: id.clone(),
        name,
        labels,
        mode,
        state: "capturing".into(),
        size_bytes: 0,
        vcpu: src.record.vcpu,
        memory_mib: src.record.memory_mib,
        disk_mib: src.record.disk_mib,
        retention_days: retention as u32,
        created_at: iso(now),
        ready_at: None,
        expires_at: Some(iso(now + retention * 86_400_000)),
        error: None,
        source_image_id: src.record.image.clone(),
    };
    let pending = answer_slot.as_ref().map(|a| {
        let body = serde_json::json!({ "snapshotId": snap.id });
        (a, a.pending(crate::store::PENDING_SNAPSHOT, body, now))
    });
    crate::service::quotas::hold_capture(st, &snap.id, admitted_mib << 20);
    let inserted = st.store().insert_snapshot_answered(
        &key.id,
        &snap,
        pending
            .as_ref()
            .map(|(a, p)| (a.key_id.as_str(), a.idem_key.as_str(), p)),
    );
    drop(_admission);
    if let Err(e) = inserted {
        crate::service::quotas::release_capture(st, &snap.id);
        return Err(e.into());
    }
    tracing::info!(sandbox_id = %id, snapshot_id = %snap.id, mode = %snap.mode, "snapshot requested");
    let sid = snap.id.clone();
    let st2 = st.clone();
    let memory = snap.mode == "memory";
    st.spawn(async move {
        let path = dir(&st2, &sid);
        let result = {
            let lock = st2.lifecycle_lock(&id);
            let _g = lock.lock().await;
            let r = st2.host().capture(&id, &path, memory).await;
            if r.is_ok() && memory {
                crate::service::processes::carry::save(&st2, &id, &path);
            }
            r
        };
        let size = size_of(&path);
        let at = iso(st2.now_ms());
        let mut gone = false;
        let updated = st2.store().update_snapshot(&sid, |r| {
            if r.deleted.is_some() {
                gone = true;
                return false;
            }
            match &result {
                Ok(()) => {
                    r.record.state = "ready".into();
                    r.record.size_bytes = size;
                    r.record.ready_at = Some(at.clone());
                }
                Err(e) => {
                    r.record.state = "failed".into();
                    r.record.error = Some(format!("The capture failed: {e}."));
                }
            }
            true
        });
        crate::service::quotas::release_capture(&st2, &sid);
        if gone || result.is_err() {
            remove_dir(&path);
        }
        if let Ok(Some(row)) = &updated {
            if !gone {
                let ty = if result.is_ok() {
                    "snapshot.ready"
                } else {
                    "snapshot.failed"
                };
                snapshot_event(&st2, row, ty);
            }
        }
        match (&result, updated) {
            (Ok(()), Ok(_)) => tracing::info!(snapshot_id = %sid, size, "snapshot ready"),
            (Err(e), Ok(_)) => tracing::warn!(snapshot_id = %sid, error = %e, "snapshot failed"),
            (_, Err(e)) => {
                tracing::error!(snapshot_id = %sid, error = %e, "recording the snapshot failed")
            }
        }
        st2.notify_change();
    });
    if let Some(wait) = wait {
        let deadline = Instant::now() + wait;
        let mut rx = st.inner.changes.subscribe();
        while find(st, key, &snap.id)?.record.state == "capturing" {
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                break;
            }
        }
    }
    runtime_host::crash_point(st.config().test_crash_at.as_deref(), "snapshot_answer");
    Ok(find(st, key, &snap.id)?.record)
}

pub(crate) fn get(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Snapshot> {
    Ok(find(st, key, id)?.record)
}

/// `:update`: what is given is replaced, the rest kept.
pub(crate) struct SnapshotChange {
    /// `Some(None)` removes the name.
    pub name: Option<Option<String>>,
    pub labels: Option<BTreeMap<String, String>>,
    /// Made only while the labels are still these (a fence for two writers).
    pub if_labels: Option<BTreeMap<String, String>>,
}

/// Changes a snapshot's name or labels.
pub(crate) fn update(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    c: SnapshotChange,
) -> ApiResult<Snapshot> {
    find(st, key, id)?;
    let mut changed_under = None;
    let row = st
        .store()
        .update_snapshot(id, |r| {
            if r.deleted.is_some() {
                return false;
            }
            if c.if_labels.as_ref().is_some_and(|l| *l != r.record.labels) {
                changed_under = Some(r.record.labels.clone());
                return false;
            }
            if let Some(n) = &c.name {
                r.record.name = n.clone();
            }
            if let Some(l) = &c.labels {
                r.record.labels = l.clone();
            }
            true
        })?
        .filter(|r| r.deleted.is_none())
        .ok_or_else(|| not_found(id))?;
    if let Some(labels) = changed_under {
        return Err(ApiError::Conflict {
            code: codes::SNAPSHOT_METADATA_CHANGED,
            message: format!("Snapshot {id}'s labels are no longer those given as ifLabels."),
            details: Some(serde_json::json!({ "snapshotId": id, "labels": labels })),
        });
    }
    Ok(row.record)
}

/// `:extend`: keeps the snapshot `days` from now.
pub(crate) fn extend(st: &AppState, key: &KeyInfo, id: &str, days: u32) -> ApiResult<Snapshot> {
    find(st, key, id)?;
    let now = st.now_ms();
    let row = st
        .store()
        .update_snapshot(id, |r| {
            if r.deleted.is_some() {
                return false;
            }
            r.record.retention_days = days;
            r.record.expires_at = Some(iso(now + i64::from(days) * 86_400_000));
            true
        })?
        .filter(|r| r.deleted.is_none())
        .ok_or_else(|| not_found(id))?;
    Ok(row.record)
}

/// Which snapshots a list asks for.
pub(crate) struct ListFilter {
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    pub state: Option<String>,
    pub limit: usize,
    /// Only snapshots made before the one with this sequence number.
    pub before_seq: Option<i64>,
}

/// One page of the snapshots `key` sees, newest first, and whether more follow.
pub(crate) fn list(
    st: &AppState,
    key: &KeyInfo,
    f: &ListFilter,
) -> ApiResult<(Vec<SnapshotRow>, bool)> {
    let ListFilter {
        sandbox_id,
        name,
        state,
        limit,
        before_seq: cursor,
    } = f;
    let limit = *limit;
    let mut rows: Vec<SnapshotRow> = st
        .store()
        .live_snapshots()?
        .into_iter()
        .filter(|r| visible(key, r))
        .filter(|r| cursor.is_none_or(|c| r.seq < c))
        .filter(|r| {
            sandbox_id
                .as_ref()
                .is_none_or(|s| &r.record.sandbox_id == s)
        })
        .filter(|r| {
            name.as_ref()
                .is_none_or(|n| r.record.name.as_ref() == Some(n))
        })
        .filter(|r| state.as_ref().is_none_or(|s| &r.record.state == s))
        .take(limit + 1)
        .collect();
    let more = rows.len() > limit;
    rows.truncate(limit);
    Ok((rows, more))
}

/// `DELETE /v1/snapshots/{id}` and `POST /v1/snapshots/{id}:delete` (the
/// client's). Deleting again answers the same; sandboxes started from it
/// are not affected.
/// Answers when it was deleted.
pub(crate) fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<String> {
    let row = match st.store().get_snapshot(id)? {
        Some(r) if visible(key, &r) => r,
        _ => return Err(not_found(id)),
    };
    if let Some(at) = row.deleted {
        return Ok(at);
    }
    let at = iso(st.now_ms());
    let mut wrote = false;
    let after = st.store().update_snapshot(id, |r| {
        if r.deleted.is_some() {
            return false;
        }
        r.deleted = Some(at.clone());
        wrote = true;
        true
    })?;
    if let (true, Some(row)) = (wrote, &after) {
        snapshot_event(st, row, "snapshot.deleted");
    }
    // A capture under way removes its directory when it ends.
    if row.record.state != "capturing" {
        remove_dir(&dir(st, id));
    }
    tracing::info!(snapshot_id = %id, "snapshot deleted");
    Ok(at)
}

/// After a restart: no capture of the earlier server goes on, so every
/// snapshot still `capturing` is `failed` (a deleted one stays deleted) and
/// its partial directory goes. Its source's machine, which the capture may
/// have left stopped, is run on by the host's recovery.
pub(crate) fn recover(st: &AppState) {
    let rows = match st.store().capturing_snapshots() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "reading snapshots cut short failed");
            return;
        }
    };
    for r in rows {
        let id = r.record.id.clone();
        let updated = st.store().update_snapshot(&id, |x| {
            x.record.state = "failed".into();
            x.record.error =
                Some("The capture was cut short by a restart of the server; take it again.".into());
            true
        });
        remove_dir(&dir(st, &id));
        match updated {
            Ok(Some(row)) if row.deleted.is_none() => {
                snapshot_event(st, &row, "snapshot.failed");
                tracing::info!(snapshot_id = %id, "a capture cut short: snapshot failed");
            }
            Ok(_) => {}
            Err(e) => tracing::error!(snapshot_id = %id, error = %e, "failing a snapshot failed"),
        }
    }
}

/// Deletes snapshots past their `expiresAt`.
pub(crate) fn expire(st: &AppState, now: i64) {
    let rows = match st.store().live_snapshots() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "reading snapshots to expire failed");
            return;
        }
    };
    for r in rows {
        let due = r
            .record
            .expires_at
            .as_deref()
            .and_then(parse_iso_ms)
            .is_some_and(|t| t <= now);
        if !due || r.record.state == "capturing" || !st.runs_here(&r.record.sandbox_id) {
            continue;
        }
        let at = iso(now);
        match st.store().update_snapshot(&r.record.id, |x| {
            x.deleted = Some(at.clone());
            true
        }) {
            Ok(Some(row)) => snapshot_event(st, &row, "snapshot.deleted"),
            Ok(None) => {}
            Err(e) => {
                tracing::error!(snapshot_id = %r.record.id, error = %e, "expiring the snapshot failed");
                continue;
            }
        }
        remove_dir(&dir(st, &r.record.id));
        tracing::info!(snapshot_id = %r.record.id, "snapshot expired");
    }
}

/// Logs a snapshot's event with its record as it is now.
fn snapshot_event(st: &AppState, row: &crate::store::SnapshotRow, ty: &str) {
    let snapshot = serde_json::to_value(&row.record).unwrap_or_default();
    crate::service::events::record(
        st,
        &row.key_id,
        ty,
        &row.record.id,
        serde_json::json!({ "snapshot": snapshot }),
    );
}

/// The copies and kept snapshot a fork's pending idempotency record names
/// (`{"sandboxIds", "snapshotId"}`), as they are now (deleted copies left
/// out), for a resend after a crash.
pub(crate) fn replayed_fork(
    st: &AppState,
    pending: &serde_json::Value,
) -> ApiResult<(Vec<SandboxRow>, Option<Snapshot>)> {
    let mut copies = Vec::new();
    for id in pending["sandboxIds"].as_array().into_iter().flatten() {
        if let Some(row) = st.store().get_sandbox(id.as_str().unwrap_or_default())? {
            if row.deleted.is_none() {
                copies.push(row);
            }
        }
    }
    let kept = match pending["snapshotId"].as_str() {
        Some(id) => st.store().get_snapshot(id)?.map(|r| r.record),
        None => None,
    };
    Ok((copies, kept))
}

/// The snapshot a snapshot's pending idempotency record names
/// (`{"snapshotId"}`), as it is now.
pub(crate) fn replayed_snapshot(st: &AppState, pending: &serde_json::Value) -> ApiResult<Snapshot> {
    let id = pending["snapshotId"].as_str().unwrap_or_default();
    st.store()
        .get_snapshot(id)?
        .filter(|r| r.deleted.is_none())
        .map(|r| r.record)
        .ok_or_else(|| ApiError::NotFound {
            code: runtime_api::codes::SNAPSHOT_NOT_FOUND,
            what: "snapshot",
            id: id.to_string(),
        })
}
