//! Previews: a port of a sandbox served at
//! `http://<port>-<sandbox>.<preview domain>:<server port>/`, tunnelled over
//! the agent channel to the guest's `127.0.0.1:<port>`.
//!
//! A private preview needs a token (see [`crate::domain::preview`]). Every
//! read of a private preview mints a fresh one, all stay good until they
//! expire, and `:rotate` replaces the preview's secret, which refuses every
//! earlier token and closes the connections opened with them.
//!
//! The records and tokens are here; the reverse proxy that serves visits
//! is `http/preview_proxy.rs`, which asks [`admit`], [`wake`] and
//! [`connect`]. The connections served are in [`live`].

pub(crate) mod live;

use rand::RngCore;
use runtime_api::codes;
use runtime_host::{DuplexStream, HostError};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::SandboxState;
use crate::domain::preview::{Preview, DEFAULT_TTL_S};
use crate::error::{ApiError, ApiResult};
use crate::service::sandboxes::{find, find_running};
use crate::AppState;

use live::KIND;

/// A preview as answered: never its secret, a fresh token when private.
pub(crate) struct Shared {
    pub(crate) id: String,
    pub(crate) sandbox_id: String,
    pub(crate) port: u16,
    pub(crate) public: bool,
    /// The token and its expiry (ms), for a private preview.
    pub(crate) token: Option<(String, i64)>,
    pub(crate) embed_origins: Vec<String>,
    pub(crate) created_ms: i64,
}

/// A token's lifetime as a read asks it: seconds, and a latest expiry (ms).
#[derive(Clone, Copy, Default)]
pub(crate) struct TokenAsk {
    pub(crate) ttl_s: Option<i64>,
    pub(crate) cap_ms: Option<i64>,
}

/// `mint`: whether a private preview's answer carries a token (never for a
/// read-only key, whose look must not become a way in).
fn shared(
    st: &AppState,
    sandbox: &str,
    p: &Preview,
    ask: TokenAsk,
    mint: bool,
) -> ApiResult<Shared> {
    let token = if !p.public && mint {
        Some(p.mint(&mac_key(st, p)?, ask.ttl_s, ask.cap_ms, st.now_ms()))
    } else {
        None
    };
    Ok(Shared {
        id: p.id.clone(),
        sandbox_id: sandbox.to_string(),
        port: p.port,
        public: p.public,
        token,
        embed_origins: p.embed_origins.clone(),
        created_ms: p.created_ms,
    })
}

/// The key a preview's tokens are MACs under: for a keyed preview, its
/// secret's digest under the server's sealing key (`secrets.key`, outside
/// the store), so whoever reads the store alone cannot mint a token.
fn mac_key(st: &AppState, p: &Preview) -> ApiResult<Vec<u8>> {
    if !p.keyed {
        return Ok(p.secret.clone());
    }
    let mut data = b"preview token key:".to_vec();
    data.extend_from_slice(&p.secret);
    Ok(st.sealer()?.keyed_digest(&data).into_bytes())
}

fn load(st: &AppState, sandbox: &str, port: u16) -> ApiResult<Option<Preview>> {
    Ok(st
        .store()
        .doc_get(KIND, sandbox, &port.to_string())?
        .as_ref()
        .and_then(Preview::from_doc))
}

fn save(st: &AppState, sandbox: &str, p: &Preview) -> ApiResult<()> {
    st.store()
        .doc_put(KIND, sandbox, &p.port.to_string(), &p.to_doc())?;
    Ok(())
}

fn not_found(sandbox: &str, port: u16) -> ApiError {
    ApiError::NotFound {
        code: codes::PREVIEW_NOT_FOUND,
        what: "preview of port",
        id: format!("{port} of sandbox {sandbox}"),
    }
}

/// What `POST …/previews` asks: the port, and what to change of how it is
/// shared (`None`: as it is, or the default for a new one).
pub(crate) struct Share {
    pub(crate) port: u16,
    pub(crate) public: Option<bool>,
    pub(crate) ttl_s: Option<i64>,
    /// The latest expiry of its tokens (ms), when `expiresAt` was given.
    pub(crate) expires_cap_ms: Option<i64>,
    pub(crate) embed_origins: Option<Vec<String>>,
}

/// `POST …/previews`: shares a port, or changes how it is shared. Answers
/// the preview and whether it is new.
pub(crate) fn share(st: &AppState, key: &KeyInfo, id: &str, s: Share) -> ApiResult<(Shared, bool)> {
    let row = find(st, key, id)?;
    if row.record.state == SandboxState::Stopped {
        return Err(ApiError::NotRunning {
            id: id.to_string(),
            state: row.record.state,
        });
    }
    let port = s.port;
    let existing = load(st, id, port)?;
    let created = existing.is_none();
    let mut p = existing.unwrap_or_else(|| {
        let mut secret = vec![0u8; 32];
        rand::thread_rng().fill_bytes(&mut secret);
        Preview {
            id: format!("prv_{}", uuid::Uuid::new_v4().simple()),
            port,
            public: false,
            secret,
            keyed: true,
            ttl_s: DEFAULT_TTL_S,
            expires_cap_ms: None,
            embed_origins: Vec::new(),
            created_ms: st.now_ms(),
        }
    });
    let was_public = p.public;
    if let Some(v) = s.public {
        p.public = v;
    }
    if let Some(t) = s.ttl_s {
        p.ttl_s = t;
    }
    if let Some(cap) = s.expires_cap_ms {
        p.expires_cap_ms = Some(cap);
    }
    if let Some(o) = s.embed_origins {
        p.embed_origins = o;
    }
    save(st, id, &p)?;
    if was_public && !p.public {
        // Made private: whoever came in without a token is out.
        st.inner.previews.cut(id, port);
    }
    let ask = TokenAsk {
        ttl_s: s.ttl_s,
        cap_ms: s.expires_cap_ms,
    };
    Ok((shared(st, id, &p, ask, true)?, created))
}

/// `GET …/previews`: the sandbox's previews (tokens of the default
/// lifetime, none for a read-only key).
pub(crate) fn list(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Vec<Shared>> {
    find(st, key, id)?;
    st.store()
        .doc_list(KIND, Some(id))?
        .iter()
        .filter_map(|(_, _, d)| Preview::from_doc(d))
        .map(|p| shared(st, id, &p, TokenAsk::default(), !key.read_only))
        .collect()
}

/// `GET …/previews/{port}`: the preview, with a token as asked (none for a
/// read-only key).
pub(crate) fn get(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    port: u16,
    ask: TokenAsk,
) -> ApiResult<Shared> {
    find(st, key, id)?;
    let p = load(st, id, port)?.ok_or_else(|| not_found(id, port))?;
    shared(st, id, &p, ask, !key.read_only)
}

/// `POST …/previews/{port}:rotate`: a new secret; earlier tokens are
/// refused and their connections closed.
pub(crate) fn rotate(st: &AppState, key: &KeyInfo, id: &str, port: u16) -> ApiResult<Shared> {
    find(st, key, id)?;
    let mut p = load(st, id, port)?.ok_or_else(|| not_found(id, port))?;
    rand::thread_rng().fill_bytes(&mut p.secret);
    p.keyed = true;
    save(st, id, &p)?;
    st.inner.previews.cut(id, port);
    shared(st, id, &p, TokenAsk::default(), true)
}

/// `DELETE …/previews/{port}`: stops sharing; open connections close.
/// Answers the preview's id.
pub(crate) fn delete(st: &AppState, key: &KeyInfo, id: &str, port: u16) -> ApiResult<String> {
    find(st, key, id)?;
    let p = load(st, id, port)?.ok_or_else(|| not_found(id, port))?;
    st.store().doc_delete(KIND, id, Some(&port.to_string()))?;
    st.inner.previews.cut(id, port);
    Ok(p.id)
}

/// Whether a visit to a preview may come in.
pub(crate) enum Admission {
    /// The port is not shared.
    NotShared,
    /// A private preview and no token.
    TokenRequired,
    /// A token that is wrong, expired or rotated away.
    TokenInvalid,
    /// In (by its token when private), and the origins that may embed
    /// the preview.
    Admitted {
        private: bool,
        embed_origins: Vec<String>,
    },
}

/// Checks a visit to port `port` of `sandbox` carrying `token`.
pub(crate) fn admit(
    st: &AppState,
    sandbox: &str,
    port: u16,
    token: Option<&str>,
) -> ApiResult<Admission> {
    let Some(p) = load(st, sandbox, port)? else {
        return Ok(Admission::NotShared);
    };
    if !p.public {
        match token {
            None => return Ok(Admission::TokenRequired),
            Some(t) if !p.check(&mac_key(st, &p)?, t, st.now_ms()) => {
                return Ok(Admission::TokenInvalid)
            }
            Some(_) => {}
        }
    }
    Ok(Admission::Admitted {
        private: !p.public,
        embed_origins: p.embed_origins,
    })
}

/// A visit counts as activity and wakes a paused sandbox.
pub(crate) async fn wake(st: &AppState, sandbox: &str) -> ApiResult<()> {
    let system = KeyInfo {
        id: String::new(),
        read_only: false,
        account_wide: true,
    };
    find_running(st, &system, sandbox).await?;
    Ok(())
}

/// A new connection to the guest's port, and what closes it when the
/// preview is rotated, made private or deleted.
/// A place for one more request to the preview (at most
/// `preview_max_concurrent` at once, so anonymous visitors cannot take every
/// tunnel of the sandbox); `None` when they are all taken.
pub(crate) fn slot(st: &AppState, sandbox: &str, port: u16) -> Option<OwnedSemaphorePermit> {
    st.inner
        .previews
        .slot(sandbox, port, st.config().preview_max_concurrent)
}

pub(crate) async fn connect(
    st: &AppState,
    sandbox: &str,
    port: u16,
) -> Result<(DuplexStream, CancellationToken), HostError> {
    let cut = st.inner.previews.token(sandbox, port);
    let io = st.host().connect(sandbox, port).await?;
    Ok((io, cut))
}
