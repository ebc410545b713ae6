//! Volumes (contract §5 `volumes`, §11, docs/volumes.md): persistent disks
//! that outlive the sandboxes using them.
//!
//! A volume is `data_dir/volumes/<id>.ext4`, a sparse raw file holding an
//! ext4 file system (made on the host once, owned inside by the sandbox
//! user); its record is a row of the store's `volumes`. A create names up
//! to four `{volumeId, path, mode}`; they are kept per sandbox (table
//! `volume_attachments`) and become the [`MachineSpec`] drives of every
//! start, wake and recovery. `rw`: the volume itself, one live sandbox at a
//! time. `snapshot`: the machine's own copy taken at boot (after a running
//! writer's guest flushed its writes), written freely and discarded with it.
//!
//! A sandbox holds its volumes while it may run again: not deleted, and not
//! stopped unless persistent. After it ends, they stay held until its
//! machine is gone (answered as `volume_releasing`, which the client waits
//! out). Fork and memory snapshots of a sandbox with volumes are refused
//! (`volume_attached`): a copy would share the drive, or restore a machine
//! whose devices differ.
//!
//! [`MachineSpec`]: runtime_host::MachineSpec

use runtime_api::codes;
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::json;

use crate::domain::access::{visible, KeyInfo};
use crate::domain::time::iso;
pub(crate) use crate::domain::volume::Attachment;
use crate::domain::volume::{hold_of, AttachMode, Hold, Volume};
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// A new volume, as its create asks.
pub(crate) struct CreateVolume {
    pub(crate) size_mib: u32,
    pub(crate) name: Option<String>,
    pub(crate) labels: BTreeMap<String, String>,
}

/// A sandbox holding a volume.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    pub(crate) sandbox_id: String,
    pub(crate) attachment: Attachment,
    pub(crate) hold: Hold,
}

/// A volume as answered: its record, the bytes its file takes, and who
/// holds it.
pub(crate) struct VolumeView {
    pub(crate) volume: Volume,
    pub(crate) used_bytes: u64,
    pub(crate) holders: Vec<Holder>,
}

/// What a delete answers.
pub(crate) struct Deleted {
    pub(crate) volume: Volume,
    pub(crate) deleted_at: String,
}

fn file(st: &AppState, id: &str) -> PathBuf {
    st.config()
        .data_dir
        .join("volumes")
        .join(format!("{id}.ext4"))
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::VOLUME_NOT_FOUND,
        what: "volume",
        id: id.to_string(),
    }
}

/// A volume by id (one `key` sees), or by name among `key`'s own: a name
/// belongs to the key that made the volume, so an account-wide key uses
/// another key's volume by id only.
pub(crate) fn find(st: &AppState, key: &KeyInfo, which: &str) -> ApiResult<Volume> {
    if let Some(d) = st.store().get_volume(which)? {
        if visible(key, &d.key_id) {
            return Ok(d);
        }
    }
    st.store()
        .volumes()?
        .into_iter()
        .find(|d| d.key_id == key.id && d.name.as_deref() == Some(which))
        .ok_or_else(|| not_found(which))
}

/// `d` with the bytes its file takes and the holders among `held`.
pub(crate) fn view(st: &AppState, d: Volume, held: &[Holder]) -> VolumeView {
    use std::os::unix::fs::MetadataExt;
    let used_bytes = std::fs::metadata(file(st, &d.id))
        .map(|m| m.blocks() * 512)
        .unwrap_or(0);
    let holders = held
        .iter()
        .filter(|h| h.attachment.volume_id == d.id)
        .cloned()
        .collect();
    VolumeView {
        volume: d,
        used_bytes,
        holders,
    }
}

/// Makes a volume: its file first, then its record. Names are unique among
/// the key's own volumes (409 `name_taken`).
pub(crate) async fn create(
    st: &AppState,
    key: &KeyInfo,
    cmd: CreateVolume,
) -> ApiResult<VolumeView> {
    let _g = st.inner.create_lock.lock().await;
    let mut asked = crate::domain::quota::Usage::default();
    asked.add("volume.count", 1);
    asked.add("volume.mib", u64::from(cmd.size_mib));
    crate::service::quotas::admit(st, &key.id, &asked)?;
    if let Some(n) = &cmd.name {
        if let Some(other) = st
            .store()
            .volumes()?
            .into_iter()
            .find(|d| d.key_id == key.id && d.name.as_deref() == Some(n))
        {
            return Err(ApiError::Conflict {
                code: codes::NAME_TAKEN,
                message: format!("A volume named {n} exists: {}.", other.id),
                details: Some(json!({"volumeId": other.id})),
            });
        }
    }
    let now = st.now_ms();
    let d = Volume {
        id: uuid::Uuid::new_v4().to_string(),
        key_id: key.id.clone(),
        name: cmd.name,
        labels: cmd.labels,
        size_mib: cmd.size_mib,
        created_at: iso(now),
        created_ms: now,
    };
    let path = file(st, &d.id);
    let size = d.size_mib;
    let made = tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
            // QEMU reopens drives by path as its own uid (see the host).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
        }
        runtime_host::volume::create_volume_file(&path, size)
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: e.to_string(),
    })?;
    made.map_err(|e| ApiError::Failed {
        code: codes::VOLUME_CREATE_FAILED,
        message: format!("The volume's file could not be made: {e}"),
    })?;
    st.store().insert_volume(&d)?;
    tracing::info!(volume_id = %d.id, size_mib = size, "volume created");
    crate::service::events::record(st, &d.key_id, "volume.ready", &d.id, volume_data(&d));
    Ok(view(st, d, &[]))
}

pub(crate) async fn get(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<VolumeView> {
    let d = find(st, key, id)?;
    let held = holders(st).await?;
    Ok(view(st, d, &held))
}

/// The volumes `key` sees (named `name`, if given), newest first, and who
/// holds each.
pub(crate) async fn list(
    st: &AppState,
    key: &KeyInfo,
    name: Option<&str>,
) -> ApiResult<(Vec<Volume>, Vec<Holder>)> {
    let held = holders(st).await?;
    let rows = st
        .store()
        .volumes()?
        .into_iter()
        .filter(|d| visible(key, &d.key_id))
        .filter(|d| name.is_none_or(|n| d.name.as_deref() == Some(n)))
        .collect();
    Ok((rows, held))
}

/// Deletes a volume: refused (409 `volume_in_use`) while a sandbox holds
/// it; its bytes then go.
pub(crate) async fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Deleted> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "delete volumes",
        });
    }
    let _g = st.inner.create_lock.lock().await;
    let d = find(st, key, id)?;
    if d.key_id != key.id && !key.account_wide {
        return Err(not_found(id));
    }
    let held = holders(st).await?;
    if let Some(h) = held.iter().find(|h| h.attachment.volume_id == d.id) {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_IN_USE,
            message: format!(
                "Volume {} is {} sandbox {}; delete that sandbox first.",
                d.id,
                if h.hold == Hold::Active {
                    "attached to"
                } else {
                    "being released by"
                },
                h.sandbox_id
            ),
            details: Some(json!({"volumeId": d.id, "sandboxId": h.sandbox_id})),
        });
    }
    st.store().delete_volume(&d.id)?;
    if let Err(e) = std::fs::remove_file(file(st, &d.id)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(volume_id = %d.id, error = %e, "removing the volume's file failed");
        }
    }
    tracing::info!(volume_id = %d.id, "volume deleted");
    crate::service::events::record(st, &d.key_id, "volume.deleted", &d.id, volume_data(&d));
    Ok(Deleted {
        volume: d,
        deleted_at: iso(st.now_ms()),
    })
}

/// A volume as its events carry it.
fn volume_data(d: &Volume) -> serde_json::Value {
    json!({"volume": {"id": d.id, "name": d.name, "labels": d.labels,
                      "sizeMiB": d.size_mib, "createdAt": d.created_at}})
}

/// The drives of a sandbox's machine, in the order of its create.
pub(crate) fn drives(st: &AppState, sandbox_id: &str) -> Vec<runtime_host::VolumeDrive> {
    // Only an unreadable store leaves them out (and says so).
    let list = match st.store().attachments_of(sandbox_id) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(sandbox_id, error = %e, "reading a sandbox's volumes failed");
            Vec::new()
        }
    };
    list.into_iter()
        .map(|a| runtime_host::VolumeDrive {
            file: file(st, &a.volume_id),
            snapshot: a.mode == AttachMode::Snapshot,
            path: a.path,
        })
        .collect()
}

async fn hold(st: &AppState, sandbox_id: &str) -> ApiResult<Hold> {
    let Some(row) = st.store().get_sandbox(sandbox_id)? else {
        return Ok(Hold::Free);
    };
    let r = &row.record;
    if let Some(h) = hold_of(row.deleted.is_some(), r.state, r.persistent) {
        return Ok(h);
    }
    // Ended: free once no lifecycle change is under way and no machine runs.
    let lock = st.lifecycle_lock(sandbox_id);
    let busy = lock.try_lock().is_err();
    if busy || st.host().cpu_time(sandbox_id).await.is_some() {
        return Ok(Hold::Releasing);
    }
    Ok(Hold::Free)
}

/// Who holds each volume, without the sandboxes that let go (whose
/// attachments are dropped on the way).
async fn holders(st: &AppState) -> ApiResult<Vec<Holder>> {
    let mut out = Vec::new();
    for (sandbox_id, list) in st.store().all_attachments(None)? {
        let h = hold(st, &sandbox_id).await?;
        if h == Hold::Free {
            if let Err(e) = st.store().drop_attachments(&sandbox_id) {
                tracing::warn!(sandbox_id = %sandbox_id, error = %e, "forgetting a sandbox's volumes failed");
            }
            continue;
        }
        for a in list {
            out.push(Holder {
                sandbox_id: sandbox_id.clone(),
                attachment: a,
                hold: h,
            });
        }
    }
    Ok(out)
}

/// Resolves the create's volumes (ids or names) for `key` and checks that
/// no other sandbox holds an `rw` one; call under the create lock (after
/// [`flush_writers`], outside it), then [`keep`] once the sandbox exists.
pub(crate) async fn resolve(
    st: &AppState,
    key: &KeyInfo,
    wanted: &[Attachment],
) -> ApiResult<Vec<Attachment>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (i, a) in wanted.iter().enumerate() {
        let d = find(st, key, &a.volume_id)?;
        if out.iter().any(|b: &Attachment| b.volume_id == d.id) {
            return Err(ApiError::invalid(
                format!("volumes[{i}].volumeId"),
                "names a volume already attached by this create",
            ));
        }
        out.push(Attachment {
            volume_id: d.id,
            ..a.clone()
        });
    }
    let held = holders(st).await?;
    for a in out.iter().filter(|a| a.mode == AttachMode::Rw) {
        if let Some(h) = held
            .iter()
            .find(|h| h.attachment.volume_id == a.volume_id && h.attachment.mode == AttachMode::Rw)
        {
            let sandbox_id = &h.sandbox_id;
            return Err(match h.hold {
                Hold::Releasing => ApiError::Conflict {
                    code: codes::VOLUME_RELEASING,
                    message: format!(
                        "Volume {} is being released by sandbox {sandbox_id}; try again in a moment.",
                        a.volume_id
                    ),
                    details: Some(json!({"volumeId": a.volume_id, "sandboxId": sandbox_id})),
                },
                _ => ApiError::Conflict {
                    code: codes::VOLUME_IN_USE,
                    message: format!(
                        "Volume {} is attached read-write to sandbox {sandbox_id}; one sandbox at a \
                         time may write it (attach it with mode \"snapshot\" for a private copy).",
                        a.volume_id
                    ),
                    details: Some(json!({"volumeId": a.volume_id, "sandboxId": sandbox_id})),
                },
            });
        }
    }
    Ok(out)
}

/// A snapshot view is a copy of the file: what a running writer has written
/// must be in the file first, not only in its guest's memory. Runs the
/// writers' `sync` before the create lock is taken, so a writer that keeps
/// `sync` slow holds up only its own creates, never everyone's.
pub(crate) async fn flush_writers(st: &AppState, key: &KeyInfo, wanted: &[Attachment]) {
    let views: Vec<String> = wanted
        .iter()
        .filter(|a| a.mode == AttachMode::Snapshot)
        .filter_map(|a| find(st, key, &a.volume_id).ok().map(|d| d.id))
        .collect();
    if views.is_empty() {
        return;
    }
    let Ok(held) = holders(st).await else { return };
    for h in held.iter().filter(|h| {
        views.contains(&h.attachment.volume_id)
            && h.attachment.mode == AttachMode::Rw
            && h.hold == Hold::Active
    }) {
        flush(st, &h.sandbox_id).await;
    }
}

/// Runs `sync` in a running sandbox (bounded; a failure only means the
/// view may miss the writer's latest writes).
async fn flush(st: &AppState, sandbox_id: &str) {
    use runtime_host::{ExecEvent, ExecSpec, RunAs};
    let spec = ExecSpec {
        argv: vec!["sync".into()],
        cwd: None,
        env: Vec::new(),
        user: RunAs::Root,
        timeout: Some(std::time::Duration::from_secs(30)),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
    };
    let mut handle = match st.host().exec(sandbox_id, spec).await {
        Ok(h) => h,
        Err(e) => {
            tracing::debug!(sandbox_id, error = %e, "flushing a volume's writer failed");
            return;
        }
    };
    let done = tokio::time::timeout(std::time::Duration::from_secs(35), async {
        while let Some(ev) = handle.events.recv().await {
            if matches!(ev, ExecEvent::Exited(_)) {
                break;
            }
        }
    })
    .await;
    if done.is_err() {
        tracing::debug!(sandbox_id, "flushing a volume's writer timed out");
    }
}

/// Keeps a new sandbox's volumes (before its machine starts).
pub(crate) fn keep(st: &AppState, sandbox_id: &str, list: &[Attachment]) -> ApiResult<()> {
    if list.is_empty() {
        return Ok(());
    }
    st.store().set_attachments(sandbox_id, list)?;
    Ok(())
}

/// Refuses a copy of a sandbox with volumes (fork, memory snapshot).
pub(crate) fn refuse_copy(st: &AppState, sandbox_id: &str, what: &str) -> ApiResult<()> {
    if st.store().attachments_of(sandbox_id)?.is_empty() {
        return Ok(());
    }
    Err(ApiError::Conflict {
        code: codes::VOLUME_ATTACHED,
        message: format!(
            "Sandbox {sandbox_id} has volumes attached; a {what} of it is not supported \
             (a copy would share the volume's drive)."
        ),
        details: Some(json!({"sandboxId": sandbox_id})),
    })
}
