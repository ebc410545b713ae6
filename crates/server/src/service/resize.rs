//! `:resize`: a sandbox at a new shape. More vCPUs or memory (or fewer) is
//! a restart from its own disk: its id, disk, volumes, env, name and
//! previews stay, its programs end. A larger disk alone grows while it
//! runs, its programs left running, where the host can do that (a sandbox
//! of the default image, whose file system the guest grows on the spot).
//! Admission is the create's: the key's quotas for what it adds, its
//! spending limit at the new price, and the host's room.

use std::time::Duration;

use runtime_api::codes;
use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::quota::Usage;
use crate::error::{ApiError, ApiResult};
use crate::service::lifecycle::{self, drive, Op};
use crate::service::sandboxes::{find, settle, wait_until};
use crate::store::SandboxRow;
use crate::AppState;

use SandboxState::{Paused, Pausing, Resuming, Running, Starting, Stopped, Stopping};

/// What a `:resize` asks for; `None` keeps the sandbox's own.
pub(crate) struct Ask {
    /// Whether a restart is allowed (`false`: an online disk grow or a refusal).
    pub restart: bool,
    pub vcpu: Option<u32>,
    pub memory_mib: Option<u32>,
    pub disk_mib: Option<u32>,
}

const RESIZE_NEEDS_RESTART: &str = "resize_needs_restart";

fn needs_restart(id: &str, why: &str) -> ApiError {
    ApiError::Conflict {
        code: RESIZE_NEEDS_RESTART,
        message: format!("Sandbox {id} can take this size only by a restart: {why}."),
        details: Some(json!({ "sandboxId": id })),
    }
}

/// `POST /v1/sandboxes/{id}:resize`, waiting up to `wait` for a restart to
/// end (`running`, or `stopped` when its boot failed).
pub(crate) async fn resize(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    ask: Ask,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Starting, Pausing, Resuming, Stopping]).await?;
    let r = &row.record;
    let vcpu = ask.vcpu.unwrap_or(r.vcpu);
    let memory = ask.memory_mib.unwrap_or(r.memory_mib);
    let disk = ask.disk_mib.unwrap_or(r.disk_mib);
    if disk < r.disk_mib {
        return Err(ApiError::invalid(
            "diskMiB",
            format!("a disk only grows: this one has {} MiB", r.disk_mib),
        ));
    }
    let floor = if r.cpu == "reserved" {
        vcpu * 1000
    } else {
        r.cpu_floor_millis.min(vcpu * 1000)
    };
    let reshaped = vcpu != r.vcpu || memory != r.memory_mib;
    if !reshaped && disk == r.disk_mib {
        return Ok(row);
    }
    if !reshaped && r.state == Running {
        let why = match grow_online(st, &row, disk).await? {
            None => return find(st, key, id),
            Some(why) => why,
        };
        if !ask.restart {
            return Err(needs_restart(id, &why));
        }
    } else if !ask.restart {
        let why = match r.state {
            Running => "its vCPUs and memory change only by a restart".to_string(),
            s => format!("it is {s}"),
        };
        return Err(needs_restart(id, &why));
    }
    match r.state {
        Running | Paused => {}
        Stopped if r.persistent => {}
        Stopped => {
            return Err(ApiError::Conflict {
                code: codes::NOT_PERSISTENT,
                message: format!(
                    "Sandbox {id} is stopped and not persistent, so it has no disk to restart from."
                ),
                details: Some(json!({ "sandboxId": id })),
            })
        }
        state => {
            return Err(ApiError::NotRunning {
                id: id.to_string(),
                state,
            })
        }
    }
    restart_at(st, key, &row, (vcpu, memory, disk, floor)).await?;
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s != Starting).await?;
    }
    find(st, key, id)
}

/// Grows the running sandbox's disk to `disk` MiB with its programs
/// running. `None`: done; otherwise why it could not (nothing changed but,
/// at worst, the size of its block device, which its next boot uses).
async fn grow_online(st: &AppState, row: &SandboxRow, disk: u32) -> ApiResult<Option<String>> {
    let id = row.record.id.as_str();
    if row.record.image.is_some() {
        return Ok(Some(
            "its disk grows while it runs only on the default image".into(),
        ));
    }
    let mut asked = Usage::default();
    asked.add("sandbox.disk_mib", u64::from(disk - row.record.disk_mib));
    crate::service::quotas::admit(st, &row.key_id, &asked)?;
    let lock = st.lifecycle_lock(id);
    let _g = lock.lock().await;
    match st.store().get_sandbox(id)? {
        Some(r) if r.deleted.is_none() && r.record.state == Running => {}
        _ => return Ok(Some("it stopped running".into())),
    }
    if let Err(e) = st.host().grow_disk(id, disk).await {
        tracing::warn!(sandbox_id = %id, error = %e, "growing the disk online failed");
        return Ok(Some(
            "the host could not grow its disk while it runs".into(),
        ));
    }
    st.store().update_sandbox(id, |r| {
        r.record.disk_mib = r.record.disk_mib.max(disk);
        true
    })?;
    st.notify_change();
    tracing::info!(sandbox_id = %id, disk_mib = disk, "disk grown online");
    Ok(None)
}

/// Admits the sandbox of `row` at `shape` (vCPUs, memory MiB, disk MiB, CPU
/// floor) and restarts it there from its own disk.
async fn restart_at(
    st: &AppState,
    key: &KeyInfo,
    row: &SandboxRow,
    shape: (u32, u32, u32, u32),
) -> ApiResult<()> {
    let r = &row.record;
    let id = r.id.as_str();
    let (vcpu, memory, disk, floor) = shape;
    // What it adds to its key's: the difference while its machine runs,
    // a whole machine when it is paused or stopped.
    let mut asked = Usage::default();
    let room_mib = if r.state == Running {
        asked.add("sandbox.vcpu", u64::from(vcpu.saturating_sub(r.vcpu)));
        asked.add(
            "sandbox.memory_mib",
            u64::from(memory.saturating_sub(r.memory_mib)),
        );
        memory.saturating_sub(r.memory_mib)
    } else {
        asked.add_machine(vcpu, memory);
        memory
    };
    asked.add("sandbox.disk_mib", u64::from(disk - r.disk_mib));
    crate::service::quotas::admit(st, &row.key_id, &asked)?;
    let mut resized = r.clone();
    (resized.vcpu, resized.memory_mib, resized.disk_mib) = (vcpu, memory, disk);
    resized.cpu_floor_millis = floor;
    let lease = crate::domain::money::first_lease_seconds(r.timeout_seconds);
    crate::service::billing::check_spend(st, &row.key_id, &resized, lease, lease)?;
    crate::service::quotas::admit_room(st, &[(vcpu, room_mib)]).await?;
    let _g = st.inner.create_lock.lock().await;
    if r.state == Stopped {
        crate::service::sandboxes::name_free_for_restart(st, key, row)?;
    }
    let from = r.state;
    let old = (r.vcpu, r.memory_mib, r.disk_mib, r.cpu_floor_millis);
    lifecycle::restart_changed(st, id, from, |r| {
        (r.vcpu, r.memory_mib, r.disk_mib, r.cpu_floor_millis) = shape;
    })?;
    drive(st, id, Op::Resize { from, old })?;
    Ok(())
}
