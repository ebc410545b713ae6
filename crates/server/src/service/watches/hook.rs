//! A watch started with `webhook: true` also sends what changed to the
//! account's webhooks, as `sandbox.files.changed` events: read from the
//! watch's log by one task of its own (never waking the sandbox), at most
//! one event every [`WINDOW`] with up to [`EVENTS`] changes, `more`
//! counting those left out and `overflow` saying some were dropped; a last
//! one says why the watch `ended`.

use std::time::Duration;

use serde_json::{json, Value};

use super::Watch;
use crate::AppState;

/// At most one event per watch in this time.
pub(crate) const WINDOW: Duration = Duration::from_secs(2);
/// At most this many changes in one event.
pub(crate) const EVENTS: usize = 100;

/// A change as the event carries it.
fn change(e: &Value) -> Value {
    let mut out = json!({
        "type": e["type"],
        "path": e["path"],
        "isDir": e["isDir"],
    });
    for k in ["oldPath", "count"] {
        if let Some(v) = e.get(k).filter(|v| !v.is_null()) {
            out[k] = v.clone();
        }
    }
    out
}

/// Sends `w`'s changes as events of `key_id` until the watch ends.
pub(crate) async fn send_changes(st: &AppState, w: &Watch, key_id: &str, name: Option<String>) {
    let mut changed = w.changed.subscribe();
    let mut cursor = 0;
    loop {
        let mut events = Vec::new();
        let (mut more, mut overflow) = (0usize, false);
        let ended = loop {
            let Ok((read, end)) = w.read(cursor) else {
                return;
            };
            if read.is_empty() {
                break end;
            }
            cursor = read.next;
            overflow |= read.lost > 0
                || read
                    .notices
                    .iter()
                    .any(|n| matches!(n["k"].as_str(), Some("overflow" | "lost" | "limit")));
            for e in &read.events {
                if events.len() < EVENTS {
                    events.push(change(e));
                } else {
                    more += 1;
                }
            }
        };
        if !events.is_empty() || overflow || ended.is_some() {
            let data = json!({
                "sandbox": {"id": w.sandbox_id, "name": name},
                "watch": {"id": w.id, "path": w.start.path},
                "events": events,
                "more": more,
                "overflow": overflow,
                "ended": ended,
            });
            crate::service::events::record(
                st,
                key_id,
                "sandbox.files.changed",
                &w.sandbox_id,
                data,
            );
        }
        if ended.is_some() {
            return;
        }
        if changed.changed().await.is_err() {
            return;
        }
        // What else changes meanwhile goes in the same event.
        tokio::time::sleep(WINDOW).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_carries_the_documented_fields_only() {
        let e = json!({"type": "rename", "path": "/w/b", "oldPath": "/w/a", "isDir": false,
                       "paths": ["/w/a", "/w/b"], "time": "t"});
        assert_eq!(
            change(&e),
            json!({"type": "rename", "path": "/w/b", "oldPath": "/w/a", "isDir": false})
        );
        let e =
            json!({"type": "write", "path": "/w/n", "isDir": false, "count": 2, "oldPath": null});
        assert_eq!(
            change(&e),
            json!({"type": "write", "path": "/w/n", "isDir": false, "count": 2})
        );
    }
}
