//! The watch routes' work: start, list, stop, read by cursor, follow.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::BoxStream;
use runtime_api::codes;
use runtime_host::{WatchSpec, WatchUpdate};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::domain::access::KeyInfo;
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::files::user_of;
use crate::service::sandboxes::{find, find_running};

use crate::service::watches::wire::{
    event_json, notice_json, Entry, FutureCursor, Log, Read, ENDED_KEPT, FOLLOW_SECONDS, LOG_BYTES,
    MAX_WATCHES_PER_SANDBOX,
};
use crate::AppState;

pub(crate) use super::Start;
use super::{State, Watch, END_WAIT};

fn too_many() -> ApiError {
    ApiError::quota(
        format!(
            "At most {MAX_WATCHES_PER_SANDBOX} watches run in a sandbox at once: stop one first."
        ),
        MAX_WATCHES_PER_SANDBOX,
    )
}

/// `POST …/files/watches`: starts the watch in the guest and answers its
/// record. A watch `id` that names a running watch of the same path
/// answers it (a retry); of another path, 409 `already_exists`.
pub(crate) async fn start(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    start: Start,
) -> ApiResult<Arc<Watch>> {
    let row = find_running(st, key, sandbox_id).await?;
    let table = &st.inner.watches;
    if let Some(id) = &start.id {
        if let Ok(w) = table.get(sandbox_id, id) {
            if w.running() && w.start.path == start.path {
                return Ok(w);
            }
            if w.running() {
                return Err(ApiError::Conflict {
                    code: codes::ALREADY_EXISTS,
                    message: format!("Watch {id} already watches {}.", w.start.path),
                    details: Some(json!({"field": "id"})),
                });
            }
        }
    }
    if table.running(sandbox_id).len() >= MAX_WATCHES_PER_SANDBOX {
        return Err(too_many());
    }
    let spec = WatchSpec {
        path: start.path.clone(),
        recursive: start.recursive,
        kinds: start.kinds.clone(),
        include: start.include.clone(),
        exclude: start.exclude.clone(),
        batch_ms: start.batch_ms,
        max_watches: start.max_watches,
        user: user_of(&row, None),
    };
    let mut handle = st.host().watch(sandbox_id, spec).await?;
    let id = start
        .id
        .clone()
        .unwrap_or_else(|| format!("watch_{}", uuid::Uuid::new_v4().simple()));
    let w = Arc::new(Watch {
        id,
        sandbox_id: sandbox_id.to_string(),
        created_ms: st.now_ms(),
        state: Mutex::new(State {
            log: Log::new(LOG_BYTES),
            ended: None,
            ending: None,
            watches: handle.watches,
        }),
        changed: watch::channel(0).0,
        stop: watch::channel(false).0,
        start,
    });
    {
        // Checked again under the lock: two starts may have raced.
        let mut m = table.lock();
        let list = m.entry(sandbox_id.to_string()).or_default();
        if list.iter().filter(|w| w.running()).count() >= MAX_WATCHES_PER_SANDBOX {
            drop(m);
            let _ = handle.stop.try_send(());
            return Err(too_many());
        }
        list.retain(|o| o.id != w.id);
        list.push(Arc::clone(&w));
        let ended: Vec<String> = list
            .iter()
            .filter(|o| !o.running())
            .map(|o| o.id.clone())
            .collect();
        if ended.len() > ENDED_KEPT {
            let drop_ids = &ended[..ended.len() - ENDED_KEPT];
            list.retain(|o| !drop_ids.contains(&o.id));
        }
    }
    let w2 = Arc::clone(&w);
    let st2 = st.clone();
    let cancel = st.inner.cancel.clone();
    st.spawn(async move {
        let mut stop = w2.stop.subscribe();
        let timeout = w2.start.timeout_ms;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout);
        let mut stopping: Option<tokio::time::Instant> = None;
        loop {
            let give_up = stopping.unwrap_or(deadline);
            tokio::select! {
                u = handle.updates.recv() => match u {
                    Some(WatchUpdate::Batch { changes, misses }) => {
                        let now = iso(st2.now_ms());
                        {
                            let mut s = w2.state();
                            for c in &changes {
                                s.log.push(Entry::Event(event_json(c, &now)));
                            }
                            for m in &misses {
                                s.log.push(Entry::Notice(notice_json(m)));
                            }
                        }
                        w2.bump();
                    }
                    Some(WatchUpdate::Ended { reason }) => {
                        w2.finish(reason);
                        return;
                    }
                    None => {
                        w2.finish("lost".into());
                        return;
                    }
                },
                _ = tokio::time::sleep_until(deadline), if timeout > 0 && stopping.is_none() => {
                    w2.end("timeout");
                }
                r = stop.changed(), if stopping.is_none() => {
                    if r.is_err() || *stop.borrow() {
                        let _ = handle.stop.try_send(());
                        stopping = Some(tokio::time::Instant::now() + END_WAIT);
                    }
                }
                _ = tokio::time::sleep_until(give_up), if stopping.is_some() => {
                    tracing::debug!(watch_id = %w2.id, "the guest did not confirm the watch's end");
                    w2.finish("stopped".into());
                    return;
                }
                _ = cancel.cancelled() => {
                    let _ = handle.stop.try_send(());
                    w2.end("server-stopped");
                    w2.finish("server-stopped".into());
                    return;
                }
            }
        }
    });
    if w.start.webhook {
        let (st3, w3) = (st.clone(), Arc::clone(&w));
        let (key_id, name) = (row.key_id.clone(), row.record.name.clone());
        st.spawn(async move { super::hook::send_changes(&st3, &w3, &key_id, name).await });
    }
    tracing::debug!(sandbox_id, watch_id = %w.id, "watch started");
    Ok(w)
}

/// `GET …/files/watches`: the running watches.
pub(crate) fn list(st: &AppState, key: &KeyInfo, sandbox_id: &str) -> ApiResult<Vec<Value>> {
    find(st, key, sandbox_id)?;
    Ok(st
        .inner
        .watches
        .running(sandbox_id)
        .iter()
        .map(|w| w.info())
        .collect())
}

/// `DELETE …/files/watches/{w}`: ends it; answers once the guest has.
pub(crate) async fn stop(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    watch_id: &str,
) -> ApiResult<bool> {
    find(st, key, sandbox_id)?;
    let w = st.inner.watches.get(sandbox_id, watch_id)?;
    w.end("stopped");
    let mut changed = w.changed.subscribe();
    let _ = tokio::time::timeout(END_WAIT + Duration::from_secs(1), async {
        while w.running() {
            if changed.changed().await.is_err() {
                break;
            }
        }
    })
    .await;
    Ok(true)
}

/// A read's answer: `{events, nextCursor, notices?, lostBytes?, ended?}`.
fn read_json(r: Read, ended: Option<String>) -> Value {
    let mut notices = r.notices;
    if let Some(reason) = &ended {
        notices.push(json!({"k": "end", "reason": reason}));
    }
    let mut v = json!({"events": r.events, "nextCursor": r.next});
    if !notices.is_empty() {
        v["notices"] = json!(notices);
    }
    if r.lost > 0 {
        v["lostBytes"] = json!(r.lost);
    }
    if ended.is_some() {
        v["ended"] = json!(true);
    }
    v
}

fn future(cursor: u64, e: FutureCursor) -> ApiError {
    ApiError::invalid(
        "cursor",
        format!(
            "{cursor} is past the end of the watch's events ({}): use a nextCursor this watch answered",
            e.end
        ),
    )
}

/// `GET …/events?cursor&waitMs`: what came after `cursor`, waiting up to
/// `wait` for something when nothing has. Never wakes the sandbox.
pub(crate) async fn read(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    watch_id: &str,
    cursor: u64,
    wait: Duration,
) -> ApiResult<Value> {
    find(st, key, sandbox_id)?;
    let w = st.inner.watches.get(sandbox_id, watch_id)?;
    let mut changed = w.changed.subscribe();
    let deadline = tokio::time::Instant::now() + wait;
    let mut first = true;
    loop {
        let (r, ended) = w.read(cursor).map_err(|e| future(cursor, e))?;
        if first && r.is_empty() && ended.is_some() {
            // Ended before this read, nothing new: a loop that polls on
            // after the end (Blaxel's after a pause) waits its `waitMs`
            // rather than spin.
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = st.inner.cancel.cancelled() => {}
            }
            return Ok(read_json(r, ended));
        }
        first = false;
        if !r.is_empty() || ended.is_some() {
            return Ok(read_json(r, ended));
        }
        tokio::select! {
            c = changed.changed() => if c.is_err() { return Ok(read_json(r, ended)) },
            _ = tokio::time::sleep_until(deadline) => return Ok(read_json(r, ended)),
            _ = st.inner.cancel.cancelled() => return Ok(read_json(r, ended)),
        }
    }
}

/// Lines of a followed watch, in batches.
pub(crate) type Lines = BoxStream<'static, Vec<Value>>;

struct Follow {
    w: Arc<Watch>,
    cursor: u64,
    rx: watch::Receiver<u64>,
    until: tokio::time::Instant,
    done: bool,
    cancel: tokio_util::sync::CancellationToken,
}

/// `GET …/events?cursor&follow=true`: `events` lines (and notices) as they
/// come, then `end` (or `paused`), or `continue` after [`FOLLOW_SECONDS`].
pub(crate) fn follow(
    st: &AppState,
    key: &KeyInfo,
    sandbox_id: &str,
    watch_id: &str,
    cursor: u64,
) -> ApiResult<Lines> {
    find(st, key, sandbox_id)?;
    let w = st.inner.watches.get(sandbox_id, watch_id)?;
    w.read(cursor).map_err(|e| future(cursor, e))?;
    let f = Follow {
        rx: w.changed.subscribe(),
        w,
        cursor,
        until: tokio::time::Instant::now() + Duration::from_secs(FOLLOW_SECONDS),
        done: false,
        cancel: st.inner.cancel.clone(),
    };
    Ok(Box::pin(futures::stream::unfold(f, |mut f| async move {
        if f.done {
            return None;
        }
        loop {
            let (r, ended) = match f.w.read(f.cursor) {
                Ok(x) => x,
                Err(_) => (
                    Read {
                        next: f.cursor,
                        ..Read::default()
                    },
                    None,
                ),
            };
            let mut lines = Vec::new();
            if r.lost > 0 {
                lines.push(json!({"k": "lost", "bytes": r.lost, "cursor": r.next}));
            }
            if !r.events.is_empty() {
                lines.push(json!({"k": "events", "events": r.events, "cursor": r.next}));
            }
            for mut n in r.notices {
                n["cursor"] = json!(r.next);
                lines.push(n);
            }
            f.cursor = r.next;
            if let Some(reason) = ended {
                f.done = true;
                lines.push(match reason.as_str() {
                    "paused" => json!({"k": "paused", "cursor": f.cursor}),
                    "failed" => json!({
                        "k": "failure",
                        "code": "watch_failed",
                        "status": 502,
                        "message": "The watch failed in the sandbox.",
                        "cursor": f.cursor,
                    }),
                    _ => json!({"k": "end", "reason": reason, "cursor": f.cursor}),
                });
            }
            if !lines.is_empty() {
                return Some((lines, f));
            }
            tokio::select! {
                _ = f.rx.changed() => {}
                _ = tokio::time::sleep_until(f.until) => {
                    f.done = true;
                    return Some((vec![json!({"k": "continue", "cursor": f.cursor})], f));
                }
                _ = f.cancel.cancelled() => {
                    f.done = true;
                    return Some((vec![json!({"k": "continue", "cursor": f.cursor})], f));
                }
            }
        }
    })))
}
