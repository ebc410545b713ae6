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
use crate::domain::volume::{
    expires_ms, hold_of, AttachMode, BackupState, Hold, Volume, VolumeBackup, MIN_SIZE_MIB,
};
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// A new volume, as its create asks.
pub(crate) struct CreateVolume {
    /// `None` only with `from_backup`: the backup's size.
    pub(crate) size_mib: Option<u32>,
    pub(crate) name: Option<String>,
    pub(crate) labels: BTreeMap<String, String>,
    /// A restore: the new volume holds this backup's bytes.
    pub(crate) from_backup: Option<String>,
    /// A shared volume: a directory that running sandboxes attach.
    pub(crate) shared: bool,
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
    /// A shared volume's attachments (ended ones too), oldest first.
    pub(crate) shares: Vec<crate::domain::volume::SharedAttachment>,
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
    let used_bytes = if d.shared {
        crate::service::shares::used_bytes(st, &d.id)
    } else {
        std::fs::metadata(file(st, &d.id))
            .map(|m| m.blocks() * 512)
            .unwrap_or(0)
    };
    let shares = if d.shared {
        crate::service::shares::of_volume(st, &d.id).unwrap_or_default()
    } else {
        Vec::new()
    };
    let holders = held
        .iter()
        .filter(|h| h.attachment.volume_id == d.id)
        .cloned()
        .collect();
    VolumeView {
        volume: d,
        used_bytes,
        holders,
        shares,
    }
}

/// Makes a volume: its file first, then its record. Names are unique among
/// the key's own volumes (409 `name_taken`).
pub(crate) async fn create(
    st: &AppState,
    key: &KeyInfo,
    cmd: CreateVolume,
) -> ApiResult<VolumeView> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "create volumes",
        });
    }
    let _g = st.inner.create_lock.lock().await;
    let source = match &cmd.from_backup {
        Some(b) => Some(own_ready_backup(st, key, b, "restore")?),
        None => None,
    };
    let size_mib = match (&source, cmd.size_mib) {
        (Some(b), Some(n)) if n < b.size_mib => {
            return Err(ApiError::invalid(
                "sizeMiB",
                format!(
                    "must be at least the backup's {} MiB (or omitted: the backup's size)",
                    b.size_mib
                ),
            ))
        }
        (Some(b), n) => n.unwrap_or(b.size_mib),
        (None, n) => n.unwrap_or(MIN_SIZE_MIB as u32),
    };
    let mut asked = crate::domain::quota::Usage::default();
    asked.add("volume.count", 1);
    asked.add("volume.mib", u64::from(size_mib));
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
        size_mib,
        created_at: iso(now),
        created_ms: now,
        restored_from: source.as_ref().map(|b| b.id.clone()),
        backup_policy: None,
        shared: cmd.shared,
    };
    if d.shared {
        let made = {
            let (st2, id) = (st.clone(), d.id.clone());
            tokio::task::spawn_blocking(move || crate::service::shares::make_dir(&st2, &id)).await
        };
        match made {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(ApiError::Failed {
                    code: codes::VOLUME_CREATE_FAILED,
                    message: format!("The volume's directory could not be made: {e}"),
                })
            }
            Err(e) => {
                return Err(ApiError::Internal {
                    what: e.to_string(),
                })
            }
        }
        st.store().insert_volume(&d)?;
        tracing::info!(volume_id = %d.id, size_mib = d.size_mib, "shared volume created");
        crate::service::events::record(st, &d.key_id, "volume.ready", &d.id, volume_data(&d));
        return Ok(view(st, d, &[]));
    }
    let path = file(st, &d.id);
    let size = d.size_mib;
    let from = source
        .as_ref()
        .map(|b| (backup_file(st, &b.id), b.sha256.clone()));
    let _busy = match &source {
        Some(b) => Some(Busy::mark(st, &b.id)?),
        None => None,
    };
    let made = tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
            // QEMU reopens drives by path as its own uid (see the host).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
        }
        match from {
            None => runtime_host::volume::create_volume_file(&path, size),
            // A restore: the backup's bytes, checked against its sum on
            // the way, grown to the size asked (the guest grows the file
            // system at its next mount).
            Some((backup, sha256)) => {
                let partial = path.with_extension("partial");
                let _ = std::fs::remove_file(&partial);
                runtime_host::volume::copy_sparse(
                    &backup,
                    &partial,
                    u64::from(size) << 20,
                    Some(&sha256),
                )?;
                std::fs::rename(&partial, &path)
            }
        }
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: e.to_string(),
    })?;
    made.map_err(|e| ApiError::Failed {
        code: codes::VOLUME_CREATE_FAILED,
        message: if source.is_some() {
            format!("The backup could not be restored: {e}")
        } else {
            format!("The volume's file could not be made: {e}")
        },
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
    if is_busy(st, &d.id) {
        return Err(busy_error(&d.id));
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
    if let Some(a) = crate::service::shares::of_volume(st, &d.id)?
        .into_iter()
        .find(|a| a.state.live())
    {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_IN_USE,
            message: format!(
                "Volume {} is attached to sandbox {} ({}); detach it first.",
                d.id, a.sandbox_id, a.id
            ),
            details: Some(
                json!({"volumeId": d.id, "sandboxId": a.sandbox_id, "attachmentId": a.id}),
            ),
        });
    }
    st.store().delete_volume(&d.id)?;
    if d.shared {
        if let Err(e) = std::fs::remove_dir_all(crate::service::shares::dir(st, &d.id)) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(volume_id = %d.id, error = %e, "removing the volume's directory failed");
            }
        }
        crate::service::shares::release_uid(st, &d.id);
    }
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
        if d.shared {
            return Err(ApiError::invalid(
                format!("volumes[{i}].volumeId"),
                "names a shared volume: attach it to the running sandbox with                  POST /v1/volumes/{id}:attach",
            ));
        }
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
        if is_busy(st, &a.volume_id) {
            return Err(busy_error(&a.volume_id));
        }
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
        trace_files: false,
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
    if st.store().attachments_of(sandbox_id)?.is_empty()
        && !crate::service::shares::sandbox_has(st, sandbox_id)?
    {
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

// ---- resize, backups and restores ----

/// Marks a volume (or a backup) busy while a backup, resize or restore
/// works on its file; unmarked when dropped.
pub(crate) struct Busy {
    st: AppState,
    id: String,
}

impl Busy {
    /// Marks `id`, or answers that another operation has it.
    fn mark(st: &AppState, id: &str) -> ApiResult<Busy> {
        let mut ops = st
            .inner
            .volume_ops
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !ops.insert(id.to_string()) {
            return Err(busy_error(id));
        }
        Ok(Busy {
            st: st.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut ops = self
            .st
            .inner
            .volume_ops
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ops.remove(&self.id);
    }
}

fn is_busy(st: &AppState, id: &str) -> bool {
    st.inner
        .volume_ops
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(id)
}

/// A passing refusal (the client waits `volume_releasing` out).
fn busy_error(id: &str) -> ApiError {
    ApiError::Conflict {
        code: codes::VOLUME_RELEASING,
        message: format!(
            "{id} is being backed up, resized or restored from; try again in a moment."
        ),
        details: Some(json!({"volumeId": id})),
    }
}

fn backup_dir(st: &AppState) -> PathBuf {
    st.config().data_dir.join("volume-backups")
}

/// A ready backup's file: written as `<id>.partial`, synced, then renamed.
fn backup_file(st: &AppState, id: &str) -> PathBuf {
    backup_dir(st).join(format!("{id}.img"))
}

fn backup_not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::VOLUME_BACKUP_NOT_FOUND,
        what: "volume backup",
        id: id.to_string(),
    }
}

/// A volume `key` may change: its own, or any with an account-wide key.
fn own(st: &AppState, key: &KeyInfo, which: &str, action: &'static str) -> ApiResult<Volume> {
    if key.read_only {
        return Err(ApiError::Forbidden { action });
    }
    let d = find(st, key, which)?;
    if d.key_id != key.id && !key.account_wide {
        return Err(not_found(which));
    }
    Ok(d)
}

/// Grows a volume no sandbox holds to `size_mib` (larger than it is): the
/// file at once; its file system when a guest next mounts it.
pub(crate) async fn resize(
    st: &AppState,
    key: &KeyInfo,
    which: &str,
    size_mib: u32,
) -> ApiResult<VolumeView> {
    let _g = st.inner.create_lock.lock().await;
    let d = own(st, key, which, "resize volumes")?;
    if size_mib <= d.size_mib {
        return Err(ApiError::invalid(
            "sizeMiB",
            format!(
                "must be larger than the volume's {} MiB: a volume only grows",
                d.size_mib
            ),
        ));
    }
    let held = holders(st).await?;
    if let Some(h) = held.iter().find(|h| h.attachment.volume_id == d.id) {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_IN_USE,
            message: format!(
                "Volume {} is attached to sandbox {}; only a detached volume is resized \
                 (a running machine's drive keeps its size).",
                d.id, h.sandbox_id
            ),
            details: Some(json!({"volumeId": d.id, "sandboxId": h.sandbox_id})),
        });
    }
    if d.shared
        && crate::service::shares::of_volume(st, &d.id)?
            .iter()
            .any(|a| a.state.live())
    {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_IN_USE,
            message: format!(
                "Volume {} is attached; only a detached shared volume is resized.",
                d.id
            ),
            details: Some(json!({"volumeId": d.id})),
        });
    }
    let _busy = Busy::mark(st, &d.id)?;
    let mut asked = crate::domain::quota::Usage::default();
    asked.add("volume.mib", u64::from(size_mib - d.size_mib));
    // The volume counts against its owner's quota, whoever grows it.
    crate::service::quotas::admit(st, &d.key_id, &asked)?;
    if d.shared {
        // Its size is a bound the host enforces, not a file to grow.
        st.store().set_volume_size(&d.id, size_mib)?;
        let d = find(st, key, &d.id)?;
        return Ok(view(st, d, &held));
    }
    let path = file(st, &d.id);
    tokio::task::spawn_blocking(move || runtime_host::volume::grow_volume_file(&path, size_mib))
        .await
        .map_err(|e| ApiError::Internal {
            what: e.to_string(),
        })?
        .map_err(|e| ApiError::Failed {
            code: codes::VOLUME_CREATE_FAILED,
            message: format!("The volume's file could not be grown: {e}"),
        })?;
    st.store().set_volume_size(&d.id, size_mib)?;
    tracing::info!(volume_id = %d.id, from = d.size_mib, to = size_mib, "volume resized");
    let d = Volume { size_mib, ..d };
    Ok(view(st, d, &held))
}

/// A backup `key` sees.
pub(crate) fn find_backup(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<VolumeBackup> {
    match st.store().get_backup(id)? {
        Some(b) if visible(key, &b.key_id) => Ok(b),
        _ => Err(backup_not_found(id)),
    }
}

/// A backup `key` may restore or delete (`doing`): its own (or any,
/// account-wide), ready.
fn own_ready_backup(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    doing: &str,
) -> ApiResult<VolumeBackup> {
    let b = find_backup(st, key, id)?;
    if b.key_id != key.id && !key.account_wide {
        return Err(backup_not_found(id));
    }
    if b.state != BackupState::Ready {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_BACKUP_NOT_READY,
            message: format!(
                "Backup {id} is {}; {doing} it once it is ready.",
                b.state.as_str()
            ),
            details: Some(json!({"backupId": id})),
        });
    }
    Ok(b)
}

/// Backups `key` sees, newest first: of one volume, in one state.
pub(crate) fn backups(
    st: &AppState,
    key: &KeyInfo,
    volume_id: Option<&str>,
    state: Option<BackupState>,
) -> ApiResult<Vec<VolumeBackup>> {
    // A name of the key's own volume names it; an id may be of a volume
    // since deleted (its backups outlive it).
    let volume_id = volume_id.map(|v| match find(st, key, v) {
        Ok(d) => d.id,
        Err(_) => v.to_string(),
    });
    Ok(st
        .store()
        .backups()?
        .into_iter()
        .filter(|b| visible(key, &b.key_id))
        .filter(|b| volume_id.as_ref().is_none_or(|v| b.volume_id == *v))
        .filter(|b| state.is_none_or(|s| b.state == s))
        .collect())
}

/// Runs `argv` as root in a running sandbox; its exit code, or why not.
async fn run_root(st: &AppState, sandbox_id: &str, argv: &[&str]) -> Result<i32, String> {
    use runtime_host::{ExecEvent, ExecSpec, RunAs};
    let spec = ExecSpec {
        argv: argv.iter().map(|a| a.to_string()).collect(),
        cwd: None,
        env: Vec::new(),
        user: RunAs::Root,
        timeout: Some(std::time::Duration::from_secs(30)),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    };
    let mut handle = st
        .host()
        .exec(sandbox_id, spec)
        .await
        .map_err(|e| e.to_string())?;
    let done = tokio::time::timeout(std::time::Duration::from_secs(35), async {
        while let Some(ev) = handle.events.recv().await {
            if let ExecEvent::Exited(x) = ev {
                return x
                    .code
                    .ok_or_else(|| "it was killed or timed out".to_string());
            }
        }
        Err("the guest's agent went away".to_string())
    })
    .await;
    done.unwrap_or_else(|_| Err("it timed out".into()))
}

/// Holds a volume's running writer still for a consistent copy: its file
/// system frozen (`fsfreeze`), thawed when dropped.
struct Frozen {
    st: AppState,
    sandbox_id: String,
    path: String,
}

impl Frozen {
    async fn thaw(self) {
        if let Err(e) = run_root(&self.st, &self.sandbox_id, &["fsfreeze", "-u", &self.path]).await
        {
            tracing::warn!(sandbox_id = %self.sandbox_id, error = %e, "thawing a volume after its backup failed");
        }
    }
}

/// What a backup asks.
pub(crate) struct BackupVolume {
    pub(crate) name: Option<String>,
    pub(crate) retention_days: u32,
}

/// Backs a volume up now: a point-in-time sparse copy in the server's
/// `volume-backups/`, checked (SHA-256 recorded) before it is `ready`.
/// A detached volume, or one whose writer is paused or stopped, is copied
/// as it is; a running writer's file system is frozen (`fsfreeze`, as root
/// in its guest) for the copy and thawed after.
pub(crate) async fn backup(
    st: &AppState,
    key: &KeyInfo,
    which: &str,
    cmd: BackupVolume,
) -> ApiResult<VolumeBackup> {
    let (d, writer, busy) = {
        let _g = st.inner.create_lock.lock().await;
        let d = own(st, key, which, "back volumes up")?;
        if d.shared {
            return Err(ApiError::Conflict {
                code: codes::VOLUME_NOT_SHARED,
                message: format!(
                    "Volume {} is shared: backups are taken of ordinary volumes only here.",
                    d.id
                ),
                details: Some(json!({"volumeId": d.id})),
            });
        }
        let mut asked = crate::domain::quota::Usage::default();
        asked.add("volume_backup.count", 1);
        asked.add(
            "volume_backup.mib",
            crate::domain::quota::mib_of(view(st, d.clone(), &[]).used_bytes),
        );
        crate::service::quotas::admit(st, &key.id, &asked)?;
        let held = holders(st).await?;
        let writer = held
            .into_iter()
            .find(|h| h.attachment.volume_id == d.id && h.attachment.mode == AttachMode::Rw);
        let busy = Busy::mark(st, &d.id)?;
        (d, writer, busy)
    };
    // The writer neither starts, wakes, pauses nor stops during the copy.
    let lock = writer.as_ref().map(|w| st.lifecycle_lock(&w.sandbox_id));
    let _life = match &lock {
        Some(l) => Some(
            tokio::time::timeout(std::time::Duration::from_secs(30), l.lock())
                .await
                .map_err(|_| in_use(&d.id, writer.as_ref(), "is changing state"))?,
        ),
        None => None,
    };
    let mut frozen = None;
    if let Some(w) = &writer {
        if w.hold != Hold::Active {
            return Err(in_use(&d.id, Some(w), "is releasing it"));
        }
        let state = st
            .store()
            .get_sandbox(&w.sandbox_id)?
            .map(|r| r.record.state);
        use crate::domain::lifecycle::SandboxState as S;
        match state {
            Some(S::Running) => {
                match run_root(st, &w.sandbox_id, &["fsfreeze", "-f", &w.attachment.path]).await {
                    Ok(0) => {
                        frozen = Some(Frozen {
                            st: st.clone(),
                            sandbox_id: w.sandbox_id.clone(),
                            path: w.attachment.path.clone(),
                        })
                    }
                    Ok(code) => {
                        return Err(in_use(
                            &d.id,
                            Some(w),
                            &format!("could not freeze it (fsfreeze exited {code})"),
                        ))
                    }
                    Err(e) => {
                        return Err(in_use(
                            &d.id,
                            Some(w),
                            &format!("could not freeze it ({e})"),
                        ))
                    }
                }
            }
            // Flushed before it paused or stopped; it writes nothing now.
            Some(S::Paused | S::Stopped) | None => {}
            Some(s) => return Err(in_use(&d.id, Some(w), &format!("is {}", s.as_str()))),
        }
    }
    let now = st.now_ms();
    let mut b = VolumeBackup {
        id: format!("vb-{}", uuid::Uuid::new_v4()),
        key_id: key.id.clone(),
        volume_id: d.id.clone(),
        name: cmd.name,
        state: BackupState::Pending,
        size_mib: d.size_mib,
        stored_bytes: 0,
        sha256: String::new(),
        retention_days: cmd.retention_days,
        created_ms: now,
        expires_ms: expires_ms(now, cmd.retention_days),
    };
    if let Err(e) = st.store().insert_backup(&b) {
        if let Some(f) = frozen {
            f.thaw().await;
        }
        return Err(e.into());
    }
    let (src, dir, done) = (file(st, &d.id), backup_dir(st), backup_file(st, &b.id));
    let copied = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        // Only the server reads backups (QEMU never opens them).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let partial = done.with_extension("partial");
        let c = runtime_host::volume::copy_sparse(&src, &partial, 0, None)?;
        std::fs::rename(&partial, &done)?;
        runtime_host::volume::sync_dir(&dir)?;
        Ok::<_, std::io::Error>(c)
    })
    .await;
    if let Some(f) = frozen {
        f.thaw().await;
    }
    drop(busy);
    let copied = match copied {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(failed_backup(st, &b.id, e.to_string())),
        Err(e) => return Err(failed_backup(st, &b.id, e.to_string())),
    };
    st.store()
        .backup_ready(&b.id, &copied.sha256, copied.stored_bytes)?;
    b.state = BackupState::Ready;
    b.sha256 = copied.sha256;
    b.stored_bytes = copied.stored_bytes;
    tracing::info!(backup_id = %b.id, volume_id = %d.id, stored_bytes = b.stored_bytes, "volume backed up");
    Ok(b)
}

fn in_use(volume_id: &str, w: Option<&Holder>, why: &str) -> ApiError {
    let sandbox_id = w.map(|w| w.sandbox_id.as_str()).unwrap_or("");
    ApiError::Conflict {
        code: codes::VOLUME_IN_USE,
        message: format!(
            "Volume {volume_id} is attached to sandbox {sandbox_id}, which {why}; \
             no consistent backup can be taken now."
        ),
        details: Some(json!({"volumeId": volume_id, "sandboxId": sandbox_id})),
    }
}

/// Forgets a backup whose copy failed (its record and any partial file).
fn failed_backup(st: &AppState, id: &str, why: String) -> ApiError {
    tracing::error!(backup_id = id, error = %why, "backing a volume up failed");
    remove_backup_files(st, id);
    if let Err(e) = st.store().delete_backup(id) {
        tracing::error!(backup_id = id, error = %e, "forgetting a failed backup failed");
    }
    ApiError::Failed {
        code: codes::VOLUME_BACKUP_FAILED,
        message: format!("The volume could not be backed up: {why}"),
    }
}

fn remove_backup_files(st: &AppState, id: &str) {
    let done = backup_file(st, id);
    for f in [done.with_extension("partial"), done] {
        if let Err(e) = std::fs::remove_file(&f) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(backup_id = id, error = %e, "removing a backup's file failed");
            }
        }
    }
}

/// Deletes a backup (its owner's, or any with an account-wide key).
pub(crate) fn delete_backup(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<VolumeBackup> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "delete volume backups",
        });
    }
    let b = own_ready_backup(st, key, id, "delete")?;
    let _busy = Busy::mark(st, &b.id)?;
    st.store().delete_backup(&b.id)?;
    remove_backup_files(st, &b.id);
    tracing::info!(backup_id = %b.id, "volume backup deleted");
    Ok(b)
}

/// Removes the backups whose retention ended (not one being restored).
pub(crate) fn expire_backups(st: &AppState, now: i64) {
    let list = match st.store().backups() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "reading volume backups failed");
            return;
        }
    };
    for b in list
        .into_iter()
        .filter(|b| b.state == BackupState::Ready && b.expires_ms <= now)
    {
        let Ok(_busy) = Busy::mark(st, &b.id) else {
            continue;
        };
        match st.store().delete_backup(&b.id) {
            Ok(_) => {
                remove_backup_files(st, &b.id);
                tracing::info!(backup_id = %b.id, "volume backup expired: deleted");
            }
            Err(e) => {
                tracing::error!(backup_id = %b.id, error = %e, "deleting an expired backup failed")
            }
        }
    }
}

/// At start: a backup an earlier server left pending never finished; it
/// goes, with its partial file, and so does any file no backup owns.
pub(crate) fn recover_backups(st: &AppState) {
    let list = match st.store().backups() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "reading volume backups failed");
            return;
        }
    };
    for b in list.iter().filter(|b| b.state == BackupState::Pending) {
        tracing::warn!(backup_id = %b.id, "a backup left unfinished: removed");
        remove_backup_files(st, &b.id);
        if let Err(e) = st.store().delete_backup(&b.id) {
            tracing::error!(backup_id = %b.id, error = %e, "forgetting an unfinished backup failed");
        }
    }
    let ready: std::collections::HashSet<String> = list
        .into_iter()
        .filter(|b| b.state == BackupState::Ready)
        .map(|b| format!("{}.img", b.id))
        .collect();
    if let Ok(entries) = std::fs::read_dir(backup_dir(st)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !ready.contains(&name) {
                tracing::warn!(file = %name, "a backup file no backup owns: removed");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    // A volume's file made or restored halfway.
    let volumes = st.config().data_dir.join("volumes");
    if let Ok(entries) = std::fs::read_dir(volumes) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "partial") {
                tracing::warn!(file = %e.path().display(), "a volume file left half made: removed");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Sets a volume's backup policy: the fields given change, the others stay.
pub(crate) async fn set_backup_policy(
    st: &AppState,
    key: &KeyInfo,
    which: &str,
    daily: Option<bool>,
    retention_days: Option<u32>,
) -> ApiResult<VolumeView> {
    let _g = st.inner.create_lock.lock().await;
    let d = own(st, key, which, "change volumes")?;
    let mut policy = d.backup_policy.unwrap_or_default();
    if let Some(on) = daily {
        policy.daily = on;
    }
    if let Some(days) = retention_days {
        policy.retention_days = days;
    }
    st.store().set_backup_policy(&d.id, policy)?;
    let held = holders(st).await?;
    Ok(view(
        st,
        Volume {
            backup_policy: Some(policy),
            ..d
        },
        &held,
    ))
}

/// Makes the daily backups that are due (one pass at a time; a volume
/// whose backup failed is tried again an hour later).
pub(crate) async fn daily_backups(st: &AppState) {
    let Ok(_pass) = Busy::mark(st, "daily backups") else {
        return;
    };
    let now = st.now_ms();
    let (volumes, backups) = match (st.store().volumes(), st.store().backups()) {
        (Ok(v), Ok(b)) => (v, b),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "reading volumes for daily backups failed");
            return;
        }
    };
    st.inner
        .daily_tried
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|id, _| volumes.iter().any(|d| d.id == *id));
    for d in volumes {
        let Some(policy) = d.backup_policy.filter(|p| p.daily) else {
            continue;
        };
        let newest = backups
            .iter()
            .filter(|b| b.volume_id == d.id)
            .map(|b| b.created_ms)
            .max();
        if !crate::domain::volume::daily_due(d.created_ms, newest, now) {
            continue;
        }
        {
            let mut tried = st
                .inner
                .daily_tried
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if tried.get(&d.id).is_some_and(|t| now < t + 3_600_000) {
                continue;
            }
            tried.insert(d.id.clone(), now);
        }
        let owner = KeyInfo {
            id: d.key_id.clone(),
            read_only: false,
            account_wide: false,
        };
        let cmd = BackupVolume {
            name: Some("daily".into()),
            retention_days: policy.retention_days,
        };
        match backup(st, &owner, &d.id, cmd).await {
            Ok(b) => {
                tracing::info!(volume_id = %d.id, backup_id = %b.id, "daily volume backup made")
            }
            Err(e) => {
                tracing::warn!(volume_id = %d.id, error = %e, "a daily volume backup failed; tried again in an hour")
            }
        }
    }
}
