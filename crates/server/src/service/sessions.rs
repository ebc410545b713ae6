//! Sandbox sessions: made by a key for one of its sandboxes, used by a
//! frontend with the token alone, ended by expiry, revocation or the key's
//! revocation. The HTTP edge gates what a session may reach
//! (`http::route::session_sandbox`).

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::session::{self, Session, ENDED_KEPT_MS, MAX_LIVE_PER_SANDBOX};
use crate::error::{ApiError, ApiResult};
use crate::service::sandboxes;
use crate::AppState;

/// What a create asks for, checked.
pub(crate) struct NewSession {
    pub ttl_seconds: i64,
    pub origins: Vec<String>,
    pub name: Option<String>,
}

/// Makes a session for `sandbox_id`; answers it and its token (shown once).
pub(crate) fn create(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    req: NewSession,
) -> ApiResult<(Session, String)> {
    let row = sandboxes::find(st, key, sandbox_id)?;
    let now = st.now_ms();
    let live = st
        .store()
        .list_sessions(&row.record.id, now)?
        .iter()
        .filter(|s| s.live(now))
        .count();
    if live >= MAX_LIVE_PER_SANDBOX {
        return Err(ApiError::quota(
            format!(
                "Sandbox {} already has {MAX_LIVE_PER_SANDBOX} live sessions.",
                row.record.id
            ),
            MAX_LIVE_PER_SANDBOX,
        ));
    }
    let (id, token) = session::new_token();
    let s = Session {
        id,
        sandbox_id: row.record.id.clone(),
        key_id: key.id.clone(),
        name: req.name,
        origins: req.origins,
        created_ms: now,
        expires_ms: now + req.ttl_seconds * 1000,
        revoked_ms: None,
    };
    st.store()
        .insert_session(&s, &sha256_hex(token.as_bytes()))?;
    Ok((s, token))
}

/// The sandbox's live sessions and those ended in the last day, newest first.
pub(crate) fn list(st: &AppState, key: &KeyInfo, sandbox_id: &str) -> ApiResult<Vec<Session>> {
    let row = sandboxes::find(st, key, sandbox_id)?;
    let now = st.now_ms();
    Ok(st
        .store()
        .list_sessions(&row.record.id, now - ENDED_KEPT_MS)?)
}

/// Ends a session now (revoking an ended one answers it as it is).
pub(crate) fn revoke(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    session_id: &str,
) -> ApiResult<Session> {
    let row = sandboxes::find(st, key, sandbox_id)?;
    let not_found = || ApiError::NotFound {
        code: runtime_api::codes::NOT_FOUND,
        what: "session",
        id: session_id.to_string(),
    };
    st.store()
        .get_session(&row.record.id, session_id)?
        .ok_or_else(not_found)?;
    st.store()
        .revoke_session(&row.record.id, session_id, st.now_ms())?;
    st.store()
        .get_session(&row.record.id, session_id)?
        .ok_or_else(not_found)
}

/// The live session a token names and the key it acts as; 401 when the
/// token is unknown, ended, or its key revoked.
pub(crate) fn authenticate(st: &AppState, token: &str) -> ApiResult<(Session, KeyInfo)> {
    let (s, key) = st
        .store()
        .find_session(&sha256_hex(token.as_bytes()))?
        .ok_or(ApiError::Unauthorized)?;
    let now = st.now_ms();
    if !s.live(now) {
        return Err(ApiError::SessionEnded {
            id: s.id.clone(),
            state: s.state(now),
        });
    }
    // A session acts for one sandbox, never more widely than its key.
    let key = KeyInfo {
        read_only: key.read_only,
        account_wide: false,
        id: key.id,
    };
    Ok((s, key))
}

/// Whether a page at `origin` may send requests with some live session
/// (for CORS preflights, which carry no token).
pub(crate) fn origin_in_use(st: &AppState, origin: &str) -> ApiResult<bool> {
    Ok(st.store().origin_in_live_session(origin, st.now_ms())?)
}

/// Forgets sessions ended over a day ago and those of deleted sandboxes.
pub(crate) fn prune(st: &AppState) -> ApiResult<usize> {
    Ok(st.store().prune_sessions(st.now_ms() - ENDED_KEPT_MS)?)
}
