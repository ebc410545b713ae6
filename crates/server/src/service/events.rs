//! The event log (docs/api.md#events): each lifecycle change of a sandbox,
//! snapshot or volume is logged under the key that owns the resource, and
//! queued for the webhooks that hear it. Logging never fails the change it
//! records: a store error is logged and the event lost.

use runtime_api::Sandbox;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::events::{self, wanted};
use crate::domain::lifecycle::{Event, SandboxState};
use crate::domain::time::iso;
use crate::domain::webhook::MAX_PENDING;
use crate::error::{ApiError, ApiResult};
use crate::store::{Attempt, DeliveryRow, EventQuery, EventRow, SandboxRow};
use crate::AppState;

/// The sandbox as an event carries it.
fn sandbox_json(s: &Sandbox, previous: Option<SandboxState>) -> Value {
    json!({
        "id": s.id,
        "name": s.name,
        "labels": s.labels,
        "state": s.state,
        "previousState": previous,
        "stopReason": s.stop_reason,
        "vcpu": s.vcpu,
        "memoryMiB": s.memory_mib,
        "diskMiB": s.disk_mib,
        "region": s.region,
        "funding": s.funding,
        "pausable": s.pausable,
    })
}

/// Logs what the sandbox's move from `from` along `event` means (nothing
/// for most requests; see [`events::sandbox_types`]).
pub(crate) fn sandbox_moved(st: &AppState, row: &SandboxRow, from: SandboxState, event: Event) {
    for ty in events::sandbox_types(from, event) {
        let data = json!({ "sandbox": sandbox_json(&row.record, Some(from)) });
        record(st, &row.key_id, ty, &row.record.id, data);
    }
}

/// `sandbox.created` (and `sandbox.deleted`), with `extra` beside the sandbox.
pub(crate) fn sandbox_event(st: &AppState, row: &SandboxRow, ty: &str, extra: &[(&str, Value)]) {
    let mut data = json!({ "sandbox": sandbox_json(&row.record, None) });
    for (k, v) in extra {
        data[*k] = v.clone();
    }
    record(st, &row.key_id, ty, &row.record.id, data);
}

/// Logs an event of `key_id`'s resource and queues a delivery to each
/// enabled webhook that hears it and wants its type.
pub(crate) fn record(st: &AppState, key_id: &str, ty: &str, resource_id: &str, data: Value) {
    if let Err(e) = try_record(st, key_id, ty, resource_id, data) {
        tracing::error!(error = %e, event_type = ty, resource_id, "logging an event failed");
    }
}

fn try_record(
    st: &AppState,
    key_id: &str,
    ty: &str,
    resource_id: &str,
    data: Value,
) -> ApiResult<()> {
    let now = st.now_ms();
    let id = uuid::Uuid::new_v4().to_string();
    let body = json!({ "id": id, "type": ty, "createdAt": iso(now), "data": data }).to_string();
    let hooks: Vec<_> = st
        .store()
        .webhooks_hearing(key_id)?
        .into_iter()
        .filter(|w| w.enabled && wanted(&w.events, ty))
        .collect();
    let mut deliveries = Vec::with_capacity(hooks.len());
    for w in hooks {
        // The bound is the webhook owner's: a flood of one key's events
        // cannot queue without end.
        let full = st.store().pending_deliveries(&w.key_id)? >= MAX_PENDING;
        let mut d = DeliveryRow {
            seq: 0,
            id: uuid::Uuid::new_v4().to_string(),
            webhook_id: w.id.clone(),
            key_id: w.key_id.clone(),
            event_id: id.clone(),
            event_type: ty.to_string(),
            body: body.clone(),
            state: "pending".into(),
            attempts: 0,
            next_ms: Some(now),
            created_ms: now,
            updated_ms: now,
            log: Vec::new(),
        };
        if full {
            tracing::warn!(webhook_id = %w.id, "too many pending deliveries: one dropped");
            d.state = "failed".into();
            d.next_ms = None;
            d.log.push(Attempt {
                at_ms: now,
                status: None,
                duration_ms: 0,
                error: Some(format!(
                    "pending_limit: {MAX_PENDING} deliveries of this key were waiting"
                )),
                manual: false,
            });
        }
        deliveries.push(d);
    }
    let queued = deliveries.iter().any(|d| d.state == "pending");
    st.store().insert_event(
        &EventRow {
            seq: 0,
            id,
            key_id: key_id.to_string(),
            ty: ty.to_string(),
            resource_id: resource_id.to_string(),
            created_ms: now,
            body,
        },
        &deliveries,
    )?;
    if queued {
        st.inner.hooks.wake();
    }
    Ok(())
}

/// A page of `GET /v1/events`.
pub(crate) struct Page {
    pub data: Vec<Value>,
    pub next_cursor: Option<String>,
}

pub(crate) struct ListEvents {
    pub resource_id: Option<String>,
    pub ty: Option<String>,
    /// A position from [`events::parse_cursor`].
    pub before: Option<i64>,
    pub limit: i64,
}

/// Events this key may see, newest first: its own, or every key's for an
/// account-wide or read-only key (as with sandboxes).
pub(crate) fn list(st: &AppState, key: &KeyInfo, q: ListEvents) -> ApiResult<Page> {
    let all = key.account_wide || key.read_only;
    let mut rows = st.store().list_events(&EventQuery {
        key_id: (!all).then_some(key.id.as_str()),
        resource_id: q.resource_id.as_deref(),
        ty: q.ty.as_deref(),
        before_seq: q.before,
        limit: q.limit + 1,
    })?;
    let limit = usize::try_from(q.limit).unwrap_or(0);
    let next_cursor = if rows.len() > limit {
        limit
            .checked_sub(1)
            .and_then(|i| rows.get(i))
            .map(|r| crate::domain::cursor::encode(events::CURSOR_PREFIX, r.seq))
    } else {
        None
    };
    rows.truncate(limit);
    let data = rows
        .iter()
        .map(|r| {
            serde_json::from_str(&r.body).map_err(|e| ApiError::Internal {
                what: format!("a logged event is not JSON: {e}"),
            })
        })
        .collect::<ApiResult<Vec<Value>>>()?;
    Ok(Page { data, next_cursor })
}

/// Forgets events and finished deliveries past 14 days, and the oldest
/// past the table bounds. The reaper runs it every minute.
pub(crate) fn prune(st: &AppState, now: i64) {
    match st.store().prune_events(
        now - events::KEEP_MS,
        events::MAX_EVENTS,
        events::MAX_DELIVERIES,
    ) {
        Ok(0) => {}
        Ok(n) => tracing::debug!(rows = n, "old events and deliveries pruned"),
        Err(e) => tracing::error!(error = %e, "pruning events failed"),
    }
}
