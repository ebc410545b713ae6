//! Following a process's output: the events of a streamed exec, of
//! `…/output?follow=true` and of a replayed streamed exec, as batches of
//! JSON events. The HTTP layer writes them as NDJSON (with its heartbeats).

use std::sync::Arc;

use futures::stream::BoxStream;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::service::processes::table::{Link, Proc};
use crate::AppState;

/// Batches of stream events, in order; the stream ends after the last.
pub(crate) type Events = BoxStream<'static, Vec<Value>>;

struct Follow {
    proc: Arc<Proc>,
    cursor: u64,
    rx: watch::Receiver<u64>,
    send_start: bool,
    done: bool,
    cancel: CancellationToken,
}

/// Follows `proc` from `cursor` (after a `start` event when `send_start`)
/// until its `exit` event. A pause ends it with `continue {processId,
/// cursor}` once all the process delivered was sent, and so does the
/// server's shutdown: the reader resumes from there.
pub(super) fn events(st: &AppState, proc: Arc<Proc>, cursor: u64, send_start: bool) -> Events {
    let f = Follow {
        rx: proc.changed.subscribe(),
        proc,
        cursor,
        send_start,
        done: false,
        cancel: st.inner.cancel.clone(),
    };
    Box::pin(futures::stream::unfold(f, |mut f| async move {
        if f.done {
            return None;
        }
        if f.send_start {
            f.send_start = false;
            let start = json!({"type": "start", "processId": f.proc.id});
            return Some((vec![start], f));
        }
        loop {
            let (mut events, cursor, exit) = f.proc.read_from(f.cursor);
            f.cursor = cursor;
            if let Some(e) = exit {
                events.push(e.event(f.proc.memory_mib));
                f.done = true;
            }
            if !events.is_empty() {
                return Some((events, f));
            }
            let detached = {
                let s = f.proc.state();
                s.link == Link::Detached && s.exit.is_none()
            };
            if detached {
                // Paused: all it delivered was sent; resume from here after the wake.
                f.done = true;
                return Some((vec![resume_at(&f)], f));
            }
            tokio::select! {
                _ = f.rx.changed() => {}
                _ = f.cancel.cancelled() => {
                    // The server is shutting down: tell the reader where to resume.
                    f.done = true;
                    return Some((vec![resume_at(&f)], f));
                }
            }
        }
    }))
}

fn resume_at(f: &Follow) -> Value {
    json!({"type": "continue", "processId": f.proc.id, "cursor": f.cursor})
}
