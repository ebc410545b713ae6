//! `:attach`, `…/attachments/{id}` and `:detach` of shared volumes
//! (docs/volumes.md, "Shared volumes"); the rest of their life is in
//! `service::shares`.

use runtime_api::codes;
use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::volume::{
    overlap, ShareState, SharedAttachment, MAX_SHARES_PER_SANDBOX, MAX_SHARES_PER_VOLUME,
};
use crate::error::{ApiError, ApiResult};
use crate::service::shares::{not_found, of_volume, spec};
use crate::AppState;

/// `POST /v1/volumes/{id}:attach {sandboxId, path}`.
pub(crate) async fn attach(
    st: &AppState,
    key: &KeyInfo,
    volume: &str,
    sandbox_id: &str,
    path: &str,
) -> ApiResult<SharedAttachment> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "attach volumes",
        });
    }
    let v = crate::service::volumes::find(st, key, volume)?;
    if !v.shared {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_NOT_SHARED,
            message: format!(
                "Volume {} is not shared: only shared volumes (created with shared: true) attach \
                 to a running sandbox; name an ordinary volume in the sandbox's create (volumes).",
                v.id
            ),
            details: Some(json!({"volumeId": v.id})),
        });
    }
    let row = crate::service::sandboxes::find_running(st, key, sandbox_id).await?;
    let sid = row.record.id.clone();
    let lock = st.lifecycle_lock(&sid);
    let _g = lock.lock().await;
    let row = crate::service::sandboxes::find(st, key, &sid)?;
    if row.record.state != SandboxState::Running {
        return Err(ApiError::NotRunning {
            id: sid,
            state: row.record.state,
        });
    }
    // The path: free among the sandbox's volumes and attachments.
    let mine: Vec<SharedAttachment> = st
        .store()
        .shares_of_sandbox(&sid)?
        .into_iter()
        .filter(|a| a.state.live())
        .collect();
    if let Some(a) = mine.iter().find(|a| a.volume_id == v.id && a.path == path) {
        return Err(ApiError::Conflict {
            code: codes::VOLUME_IN_USE,
            message: format!(
                "Volume {} is attached to sandbox {sid} at {path} already ({}).",
                v.id, a.id
            ),
            details: Some(json!({"volumeId": v.id, "sandboxId": sid, "attachmentId": a.id})),
        });
    }
    let drives = st.store().attachments_of(&sid)?;
    if mine.iter().any(|a| overlap(&a.path, path)) || drives.iter().any(|d| overlap(&d.path, path))
    {
        return Err(ApiError::invalid(
            "path",
            "overlaps the path of another volume of the sandbox",
        ));
    }
    if mine.len() >= MAX_SHARES_PER_SANDBOX {
        return Err(ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message: format!(
                "Sandbox {sid} has {MAX_SHARES_PER_SANDBOX} shared volumes attached, the most it may."
            ),
            details: Some(json!({"sandboxId": sid, "limit": MAX_SHARES_PER_SANDBOX})),
        });
    }
    let live = of_volume(st, &v.id)?
        .iter()
        .filter(|a| a.state.live())
        .count();
    if live >= MAX_SHARES_PER_VOLUME {
        return Err(ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message: format!(
                "Volume {} has {MAX_SHARES_PER_VOLUME} attachments, the most it may.",
                v.id
            ),
            details: Some(json!({"volumeId": v.id, "limit": MAX_SHARES_PER_VOLUME})),
        });
    }
    let now = st.now_ms();
    let mut a = SharedAttachment {
        id: format!("va-{}", crate::domain::session::ordered_hex()),
        key_id: key.id.clone(),
        volume_id: v.id.clone(),
        sandbox_id: sid.clone(),
        path: path.to_string(),
        state: ShareState::Attaching,
        created_ms: now,
        detached_ms: None,
    };
    let share = spec(st, &v, &a).map_err(|e| ApiError::Internal {
        what: format!("the volume's uid: {e}"),
    })?;
    st.store().insert_share(&a)?;
    match st.host().share(&sid, share).await {
        Ok(()) => {
            runtime_host::crash_point(st.config().test_crash_at.as_deref(), "attach_served");
            st.store().set_share_state(
                &a.id,
                &[ShareState::Attaching],
                ShareState::Attached,
                now,
            )?;
            a.state = ShareState::Attached;
            tracing::info!(volume_id = %v.id, sandbox_id = %sid, attachment_id = %a.id, path, "shared volume attached");
            crate::service::events::record(
                st,
                &a.key_id,
                "volume.attached",
                &v.id,
                json!({"attachmentId": a.id, "sandboxId": sid, "path": path}),
            );
            Ok(a)
        }
        Err(e) => {
            let _ = st.host().unshare(&sid, &a.id).await;
            st.store().set_share_state(
                &a.id,
                &[ShareState::Attaching],
                ShareState::Detached,
                st.now_ms(),
            )?;
            Err(ApiError::Failed {
                code: codes::VOLUME_ATTACH_FAILED,
                message: format!("The sandbox could not mount volume {}: {e}", v.id),
            })
        }
    }
}

/// An attachment of a volume `key` sees.
pub(crate) fn get(
    st: &AppState,
    key: &KeyInfo,
    volume: &str,
    attachment_id: &str,
) -> ApiResult<SharedAttachment> {
    let v = crate::service::volumes::find(st, key, volume)?;
    match st.store().get_share(attachment_id)? {
        Some(a) if a.volume_id == v.id => Ok(a),
        _ => Err(not_found(attachment_id)),
    }
}

/// `POST /v1/volumes/{id}/attachments/{aid}:detach`: unmounts it in the
/// guest (lazily if busy) and ends its server; answers the detached record.
pub(crate) async fn detach(
    st: &AppState,
    key: &KeyInfo,
    volume: &str,
    attachment_id: &str,
) -> ApiResult<SharedAttachment> {
    if key.read_only {
        return Err(ApiError::Forbidden {
            action: "detach volumes",
        });
    }
    let a = get(st, key, volume, attachment_id)?;
    if a.key_id != key.id && !key.account_wide {
        return Err(not_found(attachment_id));
    }
    let lock = st.lifecycle_lock(&a.sandbox_id);
    let _g = lock.lock().await;
    if !st.store().set_share_state(
        &a.id,
        &[ShareState::Attached],
        ShareState::Detaching,
        st.now_ms(),
    )? {
        let now = st.store().get_share(&a.id)?.unwrap_or(a);
        return Err(ApiError::Conflict {
            code: codes::VOLUME_NOT_ATTACHED,
            message: format!("Attachment {} is {}.", now.id, now.state.as_str()),
            details: Some(json!({"attachmentId": now.id, "state": now.state.as_str()})),
        });
    }
    if let Err(e) = st.host().unshare(&a.sandbox_id, &a.id).await {
        tracing::warn!(attachment_id = %a.id, error = %e, "unmounting a shared volume failed");
    }
    st.store().set_share_state(
        &a.id,
        &[ShareState::Detaching],
        ShareState::Detached,
        st.now_ms(),
    )?;
    tracing::info!(attachment_id = %a.id, volume_id = %a.volume_id, "shared volume detached");
    crate::service::events::record(
        st,
        &a.key_id,
        "volume.detached",
        &a.volume_id,
        json!({"attachmentId": a.id, "sandboxId": a.sandbox_id}),
    );
    Ok(st.store().get_share(&a.id)?.unwrap_or(a))
}
