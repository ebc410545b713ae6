//! Admission: a request that would start machines, keep snapshots,
//! volumes or uploads, or run processes passes only within its key's
//! quotas (409 `quota_exceeded`, `details.limit` naming the quota) and, for
//! machines, only while the host has room for them (503 `no_capacity`,
//! which passes as others stop). The rules are in `domain::quota`; this
//! counts what a key holds from the store.

use runtime_api::{codes, SandboxState};
use serde_json::json;

use crate::domain::quota::{self, Free, Limits, Usage, QUOTAS};
use crate::error::{ApiError, ApiResult};
use crate::store::SandboxRow;
use crate::AppState;

/// A machine that runs, or is about to, holds CPU and memory; a paused,
/// pausing or stopping one is giving them back.
fn holds_machine(state: SandboxState) -> bool {
    matches!(
        state,
        SandboxState::Starting | SandboxState::Running | SandboxState::Resuming
    )
}

/// A sandbox whose disk is kept: every one but a stopped one that was not
/// persistent.
fn holds_disk(row: &SandboxRow) -> bool {
    row.record.state != SandboxState::Stopped || row.record.persistent
}

/// What `key_id` holds now, for every quota of the account.
pub(crate) fn usage(st: &AppState, key_id: &str) -> ApiResult<Usage> {
    let mut u = Usage::default();
    for row in st.store().live_sandboxes()? {
        if row.key_id != key_id {
            continue;
        }
        if holds_machine(row.record.state) {
            u.add_machine(row.record.vcpu, row.record.memory_mib);
        }
        if holds_disk(&row) {
            u.add("sandbox.disk_mib", u64::from(row.record.disk_mib));
        }
    }
    for s in st.store().live_snapshots()? {
        if s.key_id == key_id && s.deleted.is_none() && s.record.state != "failed" {
            u.add("snapshot.count", 1);
            // One being captured holds what it was admitted for.
            let admitted = match s.record.state.as_str() {
                "capturing" => admitted_capture(st, &s.record.id),
                _ => 0,
            };
            u.add(
                "snapshot.mib",
                quota::mib_of(s.record.size_bytes.max(admitted)),
            );
        }
    }
    for v in st.store().volumes()? {
        if v.key_id == key_id {
            u.add("volume.count", 1);
            u.add("volume.mib", u64::from(v.size_mib));
        }
    }
    for b in st.store().backups()? {
        if b.key_id == key_id {
            u.add("volume_backup.count", 1);
            u.add("volume_backup.mib", quota::mib_of(b.stored_bytes));
        }
    }
    u.add("image.builds", st.inner.build_slots.running(key_id));
    let (n, bytes) = st.inner.uploads.under_way(key_id);
    u.add("upload.count", n);
    u.add("upload.mib", quota::mib_of(bytes));
    Ok(u)
}

/// The bytes snapshot `id` was admitted for while it is captured (0 when
/// it is not).
fn admitted_capture(st: &AppState, id: &str) -> u64 {
    st.inner
        .capturing
        .lock()
        .map_or(0, |m| m.get(id).copied().unwrap_or(0))
}

/// Snapshot `id`, admitted for `bytes`, holds them until it is captured.
pub(crate) fn hold_capture(st: &AppState, id: &str, bytes: u64) {
    if let Ok(mut m) = st.inner.capturing.lock() {
        m.insert(id.to_string(), bytes);
    }
}

/// Snapshot `id`'s capture ended: it counts its real size from now on.
pub(crate) fn release_capture(st: &AppState, id: &str) {
    if let Ok(mut m) = st.inner.capturing.lock() {
        m.remove(id);
    }
}

/// The quotas `key_id` is held to: the server's, with the key's own in
/// their place (`runtime keys quota`).
pub(crate) fn limits(st: &AppState, key_id: &str) -> ApiResult<Limits> {
    Ok(st.config().quotas.for_key(&st.store().key_quotas(key_id)?))
}

/// The `account` rows of `/v1/limits`: every quota with its maximum and
/// what the key uses of it (processes are per sandbox: no use shown).
pub(crate) fn rows(st: &AppState, key_id: &str) -> ApiResult<serde_json::Value> {
    let used = usage(st, key_id)?;
    let limits = limits(st, key_id)?;
    Ok(QUOTAS
        .iter()
        .map(|q| {
            let per_sandbox = q.limit == "process.count";
            json!({
                "limit": q.limit,
                "label": q.label,
                "unit": q.unit,
                "max": limits.max(q.limit),
                "used": if per_sandbox { serde_json::Value::Null } else { used.get(q.limit).into() },
            })
        })
        .collect())
}

fn exceeded(e: &quota::Exceeded) -> ApiError {
    ApiError::Conflict {
        code: codes::QUOTA_EXCEEDED,
        message: e.message(),
        details: Some(json!({
            "limit": e.quota.limit,
            "max": e.max,
            "used": e.used,
            "asked": e.asked,
        })),
    }
}

/// Whether `key_id` may hold `asked` more.
pub(crate) fn admit(st: &AppState, key_id: &str, asked: &Usage) -> ApiResult<()> {
    let used = usage(st, key_id)?;
    quota::check(&limits(st, key_id)?, &used, asked).map_err(|e| exceeded(&e))
}

/// Whether `key_id` may start machines of `shapes` (vCPUs, memory MiB),
/// `new_disk_mib` of disk more, and the host has room for them now.
pub(crate) async fn admit_machines(
    st: &AppState,
    key_id: &str,
    shapes: &[(u32, u32)],
    new_disk_mib: u64,
) -> ApiResult<()> {
    admit_machine_quota(st, key_id, shapes, new_disk_mib)?;
    admit_room(st, shapes).await
}

/// The quota part of [`admit_machines`]: no wait, so a create counts and
/// inserts under its lock without holding it across a call to the host.
pub(crate) fn admit_machine_quota(
    st: &AppState,
    key_id: &str,
    shapes: &[(u32, u32)],
    new_disk_mib: u64,
) -> ApiResult<()> {
    let mut asked = Usage::default();
    for (vcpu, memory) in shapes {
        asked.add_machine(*vcpu, *memory);
    }
    asked.add("sandbox.disk_mib", new_disk_mib);
    admit(st, key_id, &asked)
}

/// The host part of [`admit_machines`]: room for machines of `shapes`.
pub(crate) async fn admit_room(st: &AppState, shapes: &[(u32, u32)]) -> ApiResult<()> {
    let asked: u64 = shapes.iter().map(|(_, m)| u64::from(*m)).sum();
    host_room(st, asked).await
}

/// What the host has free now, in MiB (`None`: it cannot tell).
pub(crate) async fn host_free(st: &AppState) -> Option<Free> {
    let room = st.host().room().await?;
    let mib = |b: u64| b >> 20;
    Some(Free {
        memory_total: mib(room.memory_total),
        memory_available: mib(room.memory_available),
        ram_dir_total: mib(room.ram_dir_total),
        ram_dir_free: mib(room.ram_dir_free),
        disk: mib(room.disk_free),
    })
}

/// Memory promised to this node's machines (on a shared store, the other
/// nodes' machines are theirs to count).
fn promised_here(st: &AppState) -> ApiResult<u64> {
    Ok(st
        .store()
        .live_sandboxes_here()?
        .iter()
        .filter(|r| holds_machine(r.record.state))
        .map(|r| u64::from(r.record.memory_mib))
        .sum())
}

/// The memory (MiB) of new machines this host can take now, for its
/// peers' placement (`None`: it cannot tell).
pub(crate) async fn headroom_here(st: &AppState) -> Option<u64> {
    let free = host_free(st).await?;
    let promised = promised_here(st).ok()?;
    Some(quota::headroom(&free, promised, &st.config().reserve))
}

/// The host's room for machines of `asked_mib` memory in all, beside the
/// memory promised to every key's running machines.
pub(crate) async fn host_room(st: &AppState, asked_mib: u64) -> ApiResult<()> {
    let Some(free) = host_free(st).await else {
        return Ok(());
    };
    let promised = promised_here(st)?;
    quota::room_for(&free, promised, asked_mib, &st.config().reserve).map_err(|why| {
        tracing::warn!(reason = %why, "a machine was refused for want of room");
        ApiError::NoCapacity {
            message: format!("No room on the host for this sandbox now: {why}."),
            details: json!({ "memoryMiB": asked_mib }),
        }
    })
}

/// Whether an upload of `size` bytes fits, within `limits`, beside those
/// its key has under way (`(count, bytes)`).
pub(crate) fn admit_upload(limits: &Limits, under_way: (u64, u64), size: u64) -> ApiResult<()> {
    let mut used = Usage::default();
    used.add("upload.count", under_way.0);
    used.add("upload.mib", quota::mib_of(under_way.1));
    let mut asked = Usage::default();
    asked.add("upload.count", 1);
    asked.add("upload.mib", quota::mib_of(size).max(1));
    quota::check(limits, &used, &asked).map_err(|e| exceeded(&e))
}

/// Whether an upload under way may grow by `more` bytes, within `limits`,
/// beside those its key has under way (`(count, bytes)`, the growing one
/// counted).
pub(crate) fn admit_upload_growth(
    limits: &Limits,
    under_way: (u64, u64),
    more: u64,
) -> ApiResult<()> {
    let mut used = Usage::default();
    used.add("upload.mib", quota::mib_of(under_way.1));
    let mut asked = Usage::default();
    asked.add(
        "upload.mib",
        quota::mib_of(under_way.1 + more).saturating_sub(quota::mib_of(under_way.1)),
    );
    quota::check(limits, &used, &asked).map_err(|e| exceeded(&e))
}

/// Whether sandbox `sandbox_id` of key `key_id` may run one more process:
/// ended ones are forgotten to make room, oldest first; running ones fill
/// it.
pub(crate) fn admit_process(st: &AppState, key_id: &str, sandbox_id: &str) -> ApiResult<()> {
    let limits = limits(st, key_id)?;
    let max = limits.max("process.count");
    st.inner
        .procs
        .make_room(st.store(), sandbox_id, max)
        .or_else(|running| {
            let mut used = Usage::default();
            used.add("process.count", running);
            let mut asked = Usage::default();
            asked.add("process.count", 1);
            quota::check(&limits, &used, &asked).map_err(|e| exceeded(&e))
        })
}
