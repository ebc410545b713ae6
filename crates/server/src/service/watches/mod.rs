//! File watches (`…/files/watches`): each runs in the guest (the `Host`
//! watches with inotify) and is pumped by one owned task into its log,
//! which readers take by cursor, waiting or following. A watch ends on
//! `DELETE`, at its `timeoutMs`, when its root goes, when the sandbox
//! pauses (`paused`: it is ended in the guest before the machine stops)
//! and when the sandbox stops or is deleted. Watches live in the server's
//! memory: a restart of the server ends them.

pub(crate) mod api;
mod hook;
pub(crate) mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use runtime_api::codes;
use runtime_host::ChangeKind;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};

use crate::service::watches::wire::{kind_name, FutureCursor, Log, Read};
use crate::AppState;

/// How long an ending watch waits for the guest to confirm it ended.
const END_WAIT: Duration = Duration::from_secs(5);

/// What `POST …/files/watches` asks.
#[derive(Debug, Clone)]
pub(crate) struct Start {
    pub(crate) path: String,
    pub(crate) recursive: bool,
    pub(crate) events: Vec<String>,
    pub(crate) kinds: Vec<ChangeKind>,
    pub(crate) include: Vec<String>,
    pub(crate) exclude: Vec<String>,
    pub(crate) batch_ms: u32,
    /// 0: until stopped.
    pub(crate) timeout_ms: u64,
    pub(crate) max_watches: u32,
    pub(crate) id: Option<String>,
    /// Its changes also go to the account's webhooks (`sandbox.files.changed`).
    pub(crate) webhook: bool,
}

struct State {
    log: Log,
    /// Why it ended, once it has.
    ended: Option<String>,
    /// Why it was asked to end (it ends with this reason).
    ending: Option<&'static str>,
    watches: u32,
}

pub(crate) struct Watch {
    pub(crate) id: String,
    sandbox_id: String,
    start: Start,
    created_ms: i64,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    stop: watch::Sender<bool>,
}

impl Watch {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn running(&self) -> bool {
        self.state().ended.is_none()
    }

    /// Asks it to end with `reason` (the first reason asked wins).
    fn end(&self, reason: &'static str) {
        {
            let mut s = self.state();
            if s.ended.is_some() {
                return;
            }
            s.ending.get_or_insert(reason);
        }
        self.stop.send_replace(true);
    }

    fn finish(&self, guest_reason: String) {
        {
            let mut s = self.state();
            if s.ended.is_none() {
                s.ended = Some(s.ending.map(str::to_string).unwrap_or(guest_reason));
            }
        }
        self.bump();
    }

    /// Its record, as the API answers it.
    pub(crate) fn info(&self) -> Value {
        let s = self.state();
        let st = &self.start;
        let expires = (st.timeout_ms > 0).then(|| iso(self.created_ms + st.timeout_ms as i64));
        json!({
            "id": self.id,
            "sandboxId": self.sandbox_id,
            "path": st.path,
            "recursive": st.recursive,
            "events": if st.events.is_empty() {
                [ChangeKind::Create, ChangeKind::Write, ChangeKind::Remove, ChangeKind::Rename, ChangeKind::Chmod]
                    .iter().map(|k| kind_name(*k).to_string()).collect()
            } else {
                st.events.clone()
            },
            "include": st.include,
            "exclude": st.exclude,
            "batchMs": st.batch_ms,
            "timeoutMs": st.timeout_ms,
            "maxWatches": st.max_watches,
            "watches": s.watches,
            "webhook": st.webhook,
            "cursor": s.log.end(),
            "status": if s.ended.is_some() { "ended" } else { "running" },
            "endReason": s.ended,
            "createdAt": iso(self.created_ms),
            "expiresAt": expires,
        })
    }

    fn read(&self, cursor: u64) -> Result<(Read, Option<String>), FutureCursor> {
        let s = self.state();
        let r = s.log.read(cursor)?;
        // Ended for this reader once it has read everything.
        let ended = if r.next == s.log.end() {
            s.ended.clone()
        } else {
            None
        };
        Ok((r, ended))
    }
}

/// Every sandbox's watches.
#[derive(Default)]
pub(crate) struct Watches {
    by_sandbox: Mutex<HashMap<String, Vec<Arc<Watch>>>>,
}

impl Watches {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<Arc<Watch>>>> {
        self.by_sandbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, sandbox: &str, watch: &str) -> ApiResult<Arc<Watch>> {
        self.lock()
            .get(sandbox)
            .and_then(|v| v.iter().find(|w| w.id == watch).cloned())
            .ok_or_else(|| ApiError::NotFound {
                code: codes::NOT_FOUND,
                what: "watch",
                id: watch.to_string(),
            })
    }

    fn running(&self, sandbox: &str) -> Vec<Arc<Watch>> {
        self.lock()
            .get(sandbox)
            .map(|v| v.iter().filter(|w| w.running()).cloned().collect())
            .unwrap_or_default()
    }
}

/// Before a pause: ends the sandbox's watches (`paused`) and waits, a
/// little, for the guest to let go of them, so none runs in the saved
/// machine.
pub(crate) async fn sandbox_pausing(st: &AppState, sandbox_id: &str) {
    let running = st.inner.watches.running(sandbox_id);
    for w in &running {
        w.end("paused");
    }
    let _ = tokio::time::timeout(END_WAIT, async {
        for w in &running {
            let mut changed = w.changed.subscribe();
            while w.running() {
                if changed.changed().await.is_err() {
                    break;
                }
            }
        }
    })
    .await;
}

/// The sandbox stopped or was deleted: its watches end and are forgotten
/// (a follower still sees the end).
pub(crate) fn sandbox_gone(st: &AppState, sandbox_id: &str) {
    let gone = st.inner.watches.lock().remove(sandbox_id);
    for w in gone.unwrap_or_default() {
        w.end("sandbox-stopped");
        // No guest is left to confirm it.
        w.finish("sandbox-stopped".into());
    }
}
