//! Idempotency (contract §3) and late answers.
//!
//! Every change runs in an owned task, so a client that hangs up does not
//! cancel it halfway and a resend finds its stored answer. A duplicate that
//! arrives while the first runs waits for it, then replays. 2xx JSON answers
//! are stored for `idempotency_ttl`; errors are not (a resend runs again).
//! An NDJSON stream is stored as the process it follows: a duplicate follows
//! that process's output from the start (or gets 409 `output_gone` once the
//! process table dropped it).
//!
//! On a store several nodes share, a request is also claimed in the store
//! (`Store::idem_claim`) before it runs: a duplicate that reaches another
//! node while the first runs waits there for its answer (polling the store)
//! instead of running it again. A claim whose node is held lost, or this
//! node's own from before a restart, is taken over.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::Value;
use tokio::sync::watch;

use crate::error::{ApiError, ApiResult};
use crate::http::routes::processes;
use crate::http::{deferred_body, json_bytes, Reply};
use crate::store::{
    IdemClaim, StoredAnswer, IN_FLIGHT, PENDING_FORK, PENDING_SANDBOX, PENDING_SNAPSHOT,
};
use crate::AppState;

#[derive(Clone)]
pub(crate) struct Request {
    pub idem_key: String,
    pub fingerprint: String,
    /// Carried here by the node that claimed it (a create placed on this
    /// node): that node's claim in the shared store covers it.
    pub carried: bool,
}

type Slot = (String, String);

#[derive(Default)]
pub(crate) struct Inflight {
    map: Mutex<HashMap<Slot, (String, watch::Receiver<bool>)>>,
}

/// Removes the in-flight entry and wakes waiters, however the task ends.
struct Guard {
    st: AppState,
    slot: Slot,
    done: watch::Sender<bool>,
    /// The request is claimed in a store other nodes share too.
    shared: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut m = self
            .st
            .inner
            .inflight
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.remove(&self.slot);
        let _ = self.done.send(true);
    }
}

enum Claim {
    Replay(StoredAnswer),
    Wait(watch::Receiver<bool>),
    /// Another node runs it: look again in a moment.
    Elsewhere,
    Run(Guard),
}

/// How often a duplicate of a request another node runs looks for its answer.
const ELSEWHERE_POLL: std::time::Duration = std::time::Duration::from_millis(100);

fn claim(st: &AppState, key_id: &str, req: &Request) -> ApiResult<Claim> {
    let slot = (key_id.to_string(), req.idem_key.clone());
    let mut m = st
        .inner
        .inflight
        .map
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some((fp, rx)) = m.get(&slot) {
        if *fp != req.fingerprint {
            return Err(ApiError::IdempotencyKeyReused);
        }
        return Ok(Claim::Wait(rx.clone()));
    }
    let ttl_ms = st.config().idempotency_ttl.as_millis() as i64;
    let shared = st.store().shared() && !req.carried;
    if shared {
        let me = st.store().node().to_string();
        // A claim of a node held lost, or this node's own without a local
        // entry (from before a restart), runs nowhere any more.
        let gone = |owner: &str| {
            owner == me
                || match st.store().get_node(owner) {
                    Ok(Some(n)) => n.lost_ms > 0,
                    Ok(None) => true,
                    Err(_) => false,
                }
        };
        let found = st.store().idem_claim(
            key_id,
            &req.idem_key,
            &req.fingerprint,
            st.now_ms(),
            ttl_ms,
            &gone,
        )?;
        match found {
            IdemClaim::Run => {}
            IdemClaim::Stored(stored) => return Ok(Claim::Replay(stored)),
            IdemClaim::InFlight { .. } => return Ok(Claim::Elsewhere),
            IdemClaim::Reused => return Err(ApiError::IdempotencyKeyReused),
        }
    } else if let Some(stored) = st
        .store()
        .idem_get(key_id, &req.idem_key)?
        // A carried request: the claim is the carrying node's own.
        .filter(|s| s.kind != IN_FLIGHT)
    {
        if stored.created_ms + ttl_ms > st.now_ms() {
            if stored.fingerprint != req.fingerprint {
                return Err(ApiError::IdempotencyKeyReused);
            }
            return Ok(Claim::Replay(stored));
        }
    }
    let (tx, rx) = watch::channel(false);
    m.insert(slot.clone(), (req.fingerprint.clone(), rx));
    Ok(Claim::Run(Guard {
        st: st.clone(),
        slot,
        done: tx,
        shared,
    }))
}

fn replay(st: &AppState, stored: StoredAnswer) -> ApiResult<Response> {
    let body: Value = serde_json::from_str(&stored.body).map_err(|e| ApiError::Internal {
        what: format!("stored answer is not JSON: {e}"),
    })?;
    let mut resp = if stored.kind == PENDING_SANDBOX {
        let id = body
            .get("sandboxId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        replayed(crate::http::routes::sandboxes::replay_created(st, id)?)
    } else if stored.kind == PENDING_FORK {
        replayed(crate::http::routes::snapshots::replay_forked(st, &body)?)
    } else if stored.kind == PENDING_SNAPSHOT {
        replayed(crate::http::routes::snapshots::replay_snapshot(st, &body)?)
    } else if stored.kind == "stream" {
        let sandbox_id = body
            .get("sandboxId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let pid = body
            .get("processId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        processes::replay_stream(st, sandbox_id, pid)?
    } else {
        let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
        replayed(Reply::Json(status, body))
    };
    resp.headers_mut()
        .insert("idempotency-replayed", HeaderValue::from_static("true"));
    Ok(resp)
}

/// A stored JSON answer as replayed: marked `"replayed": true`.
fn replayed(reply: Reply) -> Response {
    match reply {
        Reply::Json(status, mut body) => {
            if let Value::Object(m) = &mut body {
                m.insert("replayed".into(), Value::Bool(true));
            }
            Reply::Json(status, body).into_response()
        }
        other => other.into_response(),
    }
}

/// Runs a change: once per idempotency key when one is given, in an owned
/// task, answering late (`runtime-late-answer`) when it outlasts the limit.
pub(crate) async fn execute<F>(
    st: &AppState,
    key_id: &str,
    req: Option<Request>,
    work: F,
    rid: &str,
) -> ApiResult<Response>
where
    F: Future<Output = ApiResult<Reply>> + Send + 'static,
{
    let guard = match &req {
        None => None,
        Some(r) => loop {
            match claim(st, key_id, r)? {
                Claim::Replay(stored) => return replay(st, stored),
                Claim::Wait(mut rx) => {
                    let _ = rx.wait_for(|done| *done).await;
                }
                Claim::Elsewhere => tokio::time::sleep(ELSEWHERE_POLL).await,
                Claim::Run(g) => break Some(g),
            }
        },
    };
    let fingerprint = req.map(|r| r.fingerprint);
    let st2 = st.clone();
    let mut task = st.spawn(async move {
        let result = work.await;
        if let (Some(g), Some(fp)) = (&guard, &fingerprint) {
            let stored = match &result {
                Err(_) => None,
                Ok(reply) => match reply {
                    Reply::Json(status, body) if status.is_success() => Some(StoredAnswer {
                        fingerprint: fp.clone(),
                        kind: "json".into(),
                        status: status.as_u16(),
                        body: body.to_string(),
                        created_ms: st2.now_ms(),
                    }),
                    // A token or secret is shown once: a replay answers without it.
                    Reply::ShownOnce { status, replay, .. } => Some(StoredAnswer {
                        fingerprint: fp.clone(),
                        kind: "json".into(),
                        status: status.as_u16(),
                        body: replay.to_string(),
                        created_ms: st2.now_ms(),
                    }),
                    Reply::Stream { replay, .. } => Some(StoredAnswer {
                        fingerprint: fp.clone(),
                        kind: "stream".into(),
                        status: 200,
                        body: replay.to_string(),
                        created_ms: st2.now_ms(),
                    }),
                    _ => None,
                },
            };
            if let Some(stored) = stored {
                // (Replaces this node's claim in a shared store.)
                if let Err(e) = st2.store().idem_put(&g.slot.0, &g.slot.1, &stored) {
                    tracing::error!(error = %e, "storing the idempotent answer failed");
                }
            } else if g.shared {
                // Nothing to replay: a resend runs again, on any node.
                if let Err(e) = st2.store().idem_release(&g.slot.0, &g.slot.1) {
                    tracing::error!(error = %e, "releasing the idempotency claim failed");
                }
            }
        }
        drop(guard);
        result
    });
    let late_after = st.config().late_answer_after;
    match tokio::time::timeout(late_after, &mut task).await {
        Ok(joined) => Ok(joined
            .map_err(|e| ApiError::Internal {
                what: format!("handler task: {e}"),
            })??
            .into_response()),
        Err(_) => {
            let rid = rid.to_string();
            let body = deferred_body(async move {
                let err = match task.await {
                    Ok(Ok(Reply::Json(_, v) | Reply::ShownOnce { body: v, .. })) => {
                        return json_bytes(&v)
                    }
                    Ok(Ok(_)) => ApiError::Internal {
                        what: "a late answer was not JSON".into(),
                    },
                    Ok(Err(e)) => e,
                    Err(e) => ApiError::Internal {
                        what: format!("handler task: {e}"),
                    },
                };
                json_bytes(&err.body(&rid))
            });
            let mut resp = Response::new(body);
            resp.headers_mut()
                .insert("runtime-late-answer", HeaderValue::from_static("true"));
            resp.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(resp)
        }
    }
}
