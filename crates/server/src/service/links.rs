//! File links: made with a key for a path of one of its sandboxes, used
//! without a key by whoever holds the URL, as the sandbox's own user.

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::lifecycle::SandboxState;
use crate::domain::link::{self, Link, MAX_LIVE_PER_SANDBOX};
use crate::error::{ApiError, ApiResult};
use crate::service::sandboxes::{self, WAKE_WAIT};
use crate::AppState;

/// Links ended over a day ago are forgotten.
const ENDED_KEPT_MS: i64 = 86_400_000;

/// What a `files:link` asks, checked.
pub(crate) struct NewLink {
    pub path: String,
    pub method: String,
    pub ttl_seconds: i64,
    pub filename: Option<String>,
    pub max_bytes: Option<u64>,
    pub wake: bool,
    pub archive: bool,
}

pub(crate) fn create(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    req: NewLink,
) -> ApiResult<(Link, String)> {
    let row = sandboxes::find(st, key, sandbox_id)?;
    let now = st.now_ms();
    if st.store().live_links(&row.record.id, now)? >= MAX_LIVE_PER_SANDBOX {
        return Err(ApiError::quota(
            format!(
                "Sandbox {} already has {MAX_LIVE_PER_SANDBOX} live file links: revoke them (files:revoke-links) or let them expire.",
                row.record.id
            ),
            MAX_LIVE_PER_SANDBOX,
        ));
    }
    let (id, token) = link::new_token();
    let l = Link {
        id,
        sandbox_id: row.record.id.clone(),
        key_id: key.id.clone(),
        path: req.path,
        method: req.method,
        filename: req.filename,
        max_bytes: req.max_bytes,
        wake: req.wake,
        archive: req.archive,
        created_ms: now,
        expires_ms: now + req.ttl_seconds * 1000,
        revoked_ms: None,
    };
    st.store().insert_link(&l, &sha256_hex(token.as_bytes()))?;
    Ok((l, token))
}

/// `files:revoke-links`: ends every live link of the sandbox.
pub(crate) fn revoke_all(st: &AppState, key: &KeyInfo, sandbox_id: &str) -> ApiResult<usize> {
    let row = sandboxes::find(st, key, sandbox_id)?;
    Ok(st.store().revoke_links(&row.record.id, st.now_ms())?)
}

/// The link a token names, ready to use: the link and the key it acts as
/// (the sandbox's owner). Unknown tokens are 404, ended links 410; a
/// paused sandbox is woken when the link allows it, else 409.
pub(crate) async fn resolve(st: &AppState, token: &str) -> ApiResult<(Link, KeyInfo)> {
    let not_found = || ApiError::NotFound {
        code: runtime_api::codes::LINK_NOT_FOUND,
        what: "file link",
        id: "(this URL)".into(),
    };
    let l = st
        .store()
        .find_link(&sha256_hex(token.as_bytes()))?
        .ok_or_else(not_found)?;
    if let Some(why) = l.ended(st.now_ms()) {
        return Err(ApiError::LinkEnded { state: why });
    }
    let row = match st.store().get_sandbox(&l.sandbox_id)? {
        Some(r) if r.deleted.is_none() => r,
        _ => return Err(not_found()),
    };
    let owner = KeyInfo {
        id: row.key_id.clone(),
        read_only: false,
        account_wide: false,
    };
    let paused = matches!(
        row.record.state,
        SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming
    );
    if paused {
        if !l.wake {
            return Err(ApiError::NotRunning {
                id: row.record.id,
                state: row.record.state,
            });
        }
        sandboxes::ensure_awake(st, &l.sandbox_id, WAKE_WAIT).await?;
    }
    Ok((l, owner))
}

pub(crate) fn prune(st: &AppState) -> ApiResult<usize> {
    Ok(st.store().prune_links(st.now_ms() - ENDED_KEPT_MS)?)
}
