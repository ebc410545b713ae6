//! Shared volumes attached to running sandboxes (docs/volumes.md, "Shared
//! volumes"): their directories, records and lifecycle (the API calls are
//! in `service::attachments`).
//!
//! A shared volume is a directory, `data_dir/volumes/<id>.d` (0700, owned by
//! a uid of its own when the server runs as root); each attachment is a 9P
//! mount in the guest that the host serves from it (`runtime_host::share`).
//! Each state change is in the store before the guest work starts and after
//! it ends (attaching -> attached, detaching -> detached), so a crash
//! leaves true records; [`recover`] finishes or undoes what it cut short.

use std::path::PathBuf;

use runtime_api::codes;

use crate::domain::lifecycle::SandboxState;
use crate::domain::volume::{ShareState, SharedAttachment, Volume};
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// A shared volume's directory on the host.
pub(crate) fn dir(st: &AppState, volume_id: &str) -> PathBuf {
    st.config()
        .data_dir
        .join("volumes")
        .join(format!("{volume_id}.d"))
}

/// The uid a shared volume's files belong to (and its 9P servers run
/// as), when the server is root: its own from the volumes' persisted pool
/// (`data_dir/volumes/.uids`), never a machine's or another volume's.
pub(crate) fn uid(st: &AppState, volume_id: &str) -> std::io::Result<Option<u32>> {
    if !runtime_host::as_root() {
        return Ok(None);
    }
    pool(st)?.claim(volume_id).map(Some)
}

fn pool(st: &AppState) -> std::io::Result<runtime_host::UidPool> {
    let volumes = st.config().data_dir.join("volumes");
    std::fs::create_dir_all(&volumes)?;
    runtime_host::UidPool::open(&volumes.join(".uids"), runtime_host::VOLUME_UIDS)
}

/// Gives a deleted shared volume's uid back to the pool.
pub(crate) fn release_uid(st: &AppState, volume_id: &str) {
    if let Ok(p) = pool(st) {
        p.release(volume_id);
    }
}

/// Makes a shared volume's directory (0700, its own uid).
pub(crate) fn make_dir(st: &AppState, volume_id: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let d = dir(st, volume_id);
    if let Some(parent) = d.parent() {
        std::fs::create_dir_all(parent)?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711))?;
    }
    std::fs::create_dir(&d)?;
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
    if let Some(u) = uid(st, volume_id)? {
        std::os::unix::fs::chown(&d, Some(u), Some(u))?;
    }
    Ok(())
}

/// Bytes a shared volume's tree takes.
pub(crate) fn used_bytes(st: &AppState, volume_id: &str) -> u64 {
    runtime_host::share::tree_usage(&dir(st, volume_id))
}

pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::VOLUME_ATTACHMENT_NOT_FOUND,
        what: "volume attachment",
        id: id.to_string(),
    }
}

pub(crate) fn spec(
    st: &AppState,
    v: &Volume,
    a: &SharedAttachment,
) -> std::io::Result<runtime_host::ShareSpec> {
    Ok(runtime_host::ShareSpec {
        id: a.id.clone(),
        dir: dir(st, &v.id),
        uid: uid(st, &v.id)?,
        size_bytes: u64::from(v.size_mib) << 20,
        path: a.path.clone(),
    })
}

/// The attachments of a volume, oldest first.
pub(crate) fn of_volume(st: &AppState, volume_id: &str) -> ApiResult<Vec<SharedAttachment>> {
    Ok(st.store().shares_of_volume(volume_id)?)
}

/// Whether a sandbox has live attachments (fork and memory snapshots are
/// refused then, as for its create-time volumes).
pub(crate) fn sandbox_has(st: &AppState, sandbox_id: &str) -> ApiResult<bool> {
    Ok(st
        .store()
        .shares_of_sandbox(sandbox_id)?
        .iter()
        .any(|a| a.state.live()))
}

/// The sandbox's machine has ended (a stop, a delete, a failed wake): its
/// attachments are detached (the host ended their servers with it).
pub(crate) fn sandbox_ended(st: &AppState, sandbox_id: &str) {
    let list = match st.store().shares_of_sandbox(sandbox_id) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(sandbox_id, error = %e, "reading the sandbox's shared volumes failed");
            return;
        }
    };
    for a in list.into_iter().filter(|a| a.state.live()) {
        let all = [
            ShareState::Attaching,
            ShareState::Attached,
            ShareState::Detaching,
        ];
        if let Err(e) = st
            .store()
            .set_share_state(&a.id, &all, ShareState::Detached, st.now_ms())
        {
            tracing::warn!(attachment_id = %a.id, error = %e, "recording a detach failed");
        }
    }
}

/// After a wake (or a restart of the server that found the machine
/// running): each attached share of the sandbox is served again; the
/// agent joins its mount to the new stream. The host skips shares it
/// still serves.
pub(crate) async fn reestablish(st: &AppState, sandbox_id: &str) {
    let Ok(list) = st.store().shares_of_sandbox(sandbox_id) else {
        return;
    };
    for a in list.into_iter().filter(|a| a.state == ShareState::Attached) {
        let Ok(Some(v)) = st.store().get_volume(&a.volume_id) else {
            continue;
        };
        let served = match spec(st, &v, &a) {
            Ok(spec) => st
                .host()
                .share(sandbox_id, spec)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(error) = served {
            tracing::warn!(attachment_id = %a.id, %error, "serving a shared volume again failed");
        }
    }
}

/// At start: `attaching` ones are undone (their mount may or may not have
/// been made: it is taken down), `detaching` ones finished, and the
/// attachments of sandboxes that no longer run are detached; the rest are
/// served again where their sandbox runs.
pub(crate) async fn recover(st: &AppState) {
    let Ok(list) = st.store().live_shares() else {
        return;
    };
    let mut running = std::collections::BTreeSet::new();
    for a in list {
        let row = st.store().get_sandbox(&a.sandbox_id).ok().flatten();
        let state = row
            .as_ref()
            .filter(|r| r.deleted.is_none())
            .map(|r| r.record.state);
        let alive = matches!(
            state,
            Some(
                SandboxState::Running
                    | SandboxState::Paused
                    | SandboxState::Pausing
                    | SandboxState::Resuming
            )
        );
        let now = st.now_ms();
        if !alive || a.state != ShareState::Attached {
            if alive && state == Some(SandboxState::Running) {
                let _ = st.host().unshare(&a.sandbox_id, &a.id).await;
            }
            let _ = st.store().set_share_state(
                &a.id,
                &[
                    ShareState::Attaching,
                    ShareState::Attached,
                    ShareState::Detaching,
                ],
                ShareState::Detached,
                now,
            );
            continue;
        }
        if state == Some(SandboxState::Running) {
            running.insert(a.sandbox_id.clone());
        }
    }
    for id in running {
        reestablish(st, &id).await;
    }
}
