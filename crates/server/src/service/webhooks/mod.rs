//! Webhooks (docs/api.md#webhooks): their records with sealed secrets, the
//! worker that sends pending deliveries on the documented schedule, `:test`
//! and `:retry`.
//!
//! A delivery is a store row from the moment its event is logged. The
//! worker claims due rows for [`CLAIM_MS`] (longer than an attempt's
//! timeout) before sending, so nothing is sent twice at once, and a row
//! claimed by a server that stopped is taken up again after that: nothing
//! pending is lost across a restart.

mod send;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use runtime_api::codes;
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::domain::access::{visible, KeyInfo};
use crate::domain::events::TEST_TYPE;
use crate::domain::time::iso;
use crate::domain::webhook::{
    check_url, new_secret, retry_delay_ms, signature_header, Target, MAX_LIVE_SECRETS,
    MAX_WEBHOOKS, TIMEOUT_S,
};
use crate::error::{ApiError, ApiResult};
use crate::store::{Attempt, DeliveryRow, SealedSecret, WebhookRow};
use crate::AppState;

pub(crate) use send::Outcome;

/// How long a claimed delivery is left to its sender before another pass
/// (or a restarted server) may send it.
const CLAIM_MS: i64 = 60_000;
/// Deliveries sent at once.
const IN_FLIGHT: usize = 8;
/// Attempts kept in a delivery's log.
const LOG_KEEP: usize = 20;

/// The worker's wake-up and the TLS client configuration, made once.
#[derive(Default)]
pub(crate) struct Hooks {
    notify: Notify,
    tls: OnceLock<Option<Arc<rustls::ClientConfig>>>,
}

impl Hooks {
    /// A delivery was queued: look now rather than at the next tick.
    pub(crate) fn wake(&self) {
        self.notify.notify_one();
    }

    fn tls(&self) -> Option<Arc<rustls::ClientConfig>> {
        self.tls.get_or_init(send::tls_config).clone()
    }
}

pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::NOT_FOUND,
        what: "webhook",
        id: id.to_string(),
    }
}

fn delivery_not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::NOT_FOUND,
        what: "webhook delivery",
        id: id.to_string(),
    }
}

/// A webhook as answered (never its secrets).
pub(crate) fn render(w: &WebhookRow, now: i64) -> Value {
    let previous_until = w
        .secrets
        .iter()
        .skip(1)
        .filter_map(|s| s.expires_ms)
        .filter(|t| *t > now)
        .max();
    json!({
        "id": w.id,
        "kind": "webhook",
        "url": w.url,
        "events": w.events,
        "description": w.description,
        "enabled": w.enabled,
        "createdAt": iso(w.created_ms),
        "updatedAt": iso(w.updated_ms),
        "failingSince": w.failing_since_ms.map(iso),
        "previousSecretExpiresAt": previous_until.map(iso),
    })
}

/// A delivery as answered.
pub(crate) fn render_delivery(d: &DeliveryRow) -> Value {
    let attempts: Vec<Value> = d
        .log
        .iter()
        .map(|a| {
            json!({"at": iso(a.at_ms), "status": a.status, "durationMs": a.duration_ms,
                   "error": a.error, "manual": a.manual})
        })
        .collect();
    let last = d.log.last();
    json!({
        "id": d.id,
        "kind": "webhook_delivery",
        "webhookId": d.webhook_id,
        "eventId": d.event_id,
        "eventType": d.event_type,
        "state": d.state,
        "attemptCount": d.log.len(),
        "attempts": attempts,
        "status": last.and_then(|a| a.status),
        "durationMs": last.map(|a| a.duration_ms),
        "error": last.and_then(|a| a.error.clone()),
        "nextAttemptAt": if d.state == "pending" { d.next_ms.map(iso) } else { None },
        "createdAt": iso(d.created_ms),
        "updatedAt": iso(d.updated_ms),
    })
}

/// The webhook, when this key may see it.
pub(crate) fn find(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<WebhookRow> {
    match st.store().get_webhook(id)? {
        Some(w) if visible(key, &w.key_id) => Ok(w),
        _ => Err(not_found(id)),
    }
}

pub(crate) fn list(st: &AppState, key: &KeyInfo) -> ApiResult<Vec<WebhookRow>> {
    let all = key.account_wide || key.read_only;
    Ok(st
        .store()
        .list_webhooks((!all).then_some(key.id.as_str()))?)
}

/// Where `url` points, by the operator's policy; the refusal says why.
pub(crate) fn target(st: &AppState, url: &str) -> Result<Target, String> {
    check_url(url, &st.config().webhook_allow)
}

fn seal(st: &AppState, id: &str, secret: &str) -> ApiResult<String> {
    st.sealer()?
        .seal(&format!("webhook:{id}"), secret)
        .ok_or_else(|| ApiError::Internal {
            what: "sealing a webhook secret failed".into(),
        })
}

/// The secrets that sign now, the current one first.
fn live_secrets(st: &AppState, w: &WebhookRow, now: i64) -> ApiResult<Vec<String>> {
    let sealer = st.sealer()?;
    let name = format!("webhook:{}", w.id);
    Ok(w.secrets
        .iter()
        .filter(|s| s.expires_ms.is_none_or(|t| t > now))
        .filter_map(|s| {
            let v = sealer.unseal(&name, &s.sealed);
            if v.is_none() {
                tracing::error!(webhook_id = %w.id, "a webhook secret does not unseal");
            }
            v
        })
        .collect())
}

pub(crate) struct NewWebhook {
    pub url: String,
    pub events: Vec<String>,
    pub description: Option<String>,
}

/// Makes a webhook; answers it and its secret, which is never shown again.
pub(crate) async fn create(
    st: &AppState,
    key: &KeyInfo,
    cmd: NewWebhook,
) -> ApiResult<(WebhookRow, String)> {
    let _g = st.inner.create_lock.lock().await;
    let mine = st.store().list_webhooks(Some(&key.id))?.len();
    if mine >= MAX_WEBHOOKS {
        return Err(ApiError::quota(
            format!("A key can have {MAX_WEBHOOKS} webhooks; delete one first."),
            MAX_WEBHOOKS,
        ));
    }
    let now = st.now_ms();
    let id = uuid::Uuid::new_v4().to_string();
    let secret = new_secret();
    let w = WebhookRow {
        secrets: vec![SealedSecret {
            sealed: seal(st, &id, &secret)?,
            expires_ms: None,
        }],
        id,
        key_id: key.id.clone(),
        url: cmd.url,
        events: cmd.events,
        description: cmd.description,
        enabled: true,
        created_ms: now,
        updated_ms: now,
        failing_since_ms: None,
    };
    st.store().insert_webhook(&w)?;
    tracing::info!(webhook_id = %w.id, "webhook created");
    Ok((w, secret))
}

/// The fields of `:update` that were given.
#[derive(Default)]
pub(crate) struct Change {
    pub url: Option<String>,
    pub events: Option<Vec<String>>,
    pub description: Option<String>,
    pub enabled: Option<bool>,
}

pub(crate) fn update(st: &AppState, key: &KeyInfo, id: &str, c: Change) -> ApiResult<WebhookRow> {
    find(st, key, id)?;
    let now = st.now_ms();
    st.store()
        .update_webhook(id, |w| {
            if let Some(u) = c.url {
                w.url = u;
            }
            if let Some(e) = c.events {
                w.events = e;
            }
            if let Some(d) = c.description {
                w.description = Some(d);
            }
            if let Some(e) = c.enabled {
                w.enabled = e;
            }
            w.updated_ms = now;
            true
        })?
        .ok_or_else(|| not_found(id))
}

/// A new secret; the current one keeps signing for `keep_s` seconds (0:
/// it and every earlier one end now).
pub(crate) fn rotate(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    keep_s: i64,
) -> ApiResult<(WebhookRow, String)> {
    find(st, key, id)?;
    let now = st.now_ms();
    let secret = new_secret();
    let sealed = seal(st, id, &secret)?;
    let w = st
        .store()
        .update_webhook(id, |w| {
            w.secrets.retain(|s| s.expires_ms.is_none_or(|t| t > now));
            if keep_s == 0 {
                w.secrets.clear();
            } else if let Some(cur) = w.secrets.first_mut() {
                let until = now + keep_s * 1000;
                cur.expires_ms = Some(cur.expires_ms.map_or(until, |t| t.min(until)));
            }
            w.secrets.insert(
                0,
                SealedSecret {
                    sealed,
                    expires_ms: None,
                },
            );
            w.secrets.truncate(MAX_LIVE_SECRETS);
            w.updated_ms = now;
            true
        })?
        .ok_or_else(|| not_found(id))?;
    tracing::info!(webhook_id = %id, keep_s, "webhook secret rotated");
    Ok((w, secret))
}

pub(crate) fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<WebhookRow> {
    let w = find(st, key, id)?;
    st.store().delete_webhook(id)?;
    tracing::info!(webhook_id = %id, "webhook deleted");
    Ok(w)
}

/// The headers of one attempt, the signature made now.
fn headers(
    secrets: &[String],
    body: &str,
    now_ms: i64,
    event_id: &str,
    event_type: &str,
    delivery_id: &str,
    attempt: usize,
) -> Vec<(&'static str, String)> {
    let t = now_ms.div_euclid(1000);
    vec![
        (
            "runtime-signature",
            signature_header(t, body.as_bytes(), secrets),
        ),
        ("runtime-webhook-id", event_id.to_string()),
        ("runtime-event-type", event_type.to_string()),
        ("runtime-delivery-id", delivery_id.to_string()),
        ("runtime-delivery-attempt", attempt.to_string()),
    ]
}

async fn post(
    st: &AppState,
    w: &WebhookRow,
    body: String,
    hdrs: &[(&'static str, String)],
) -> Outcome {
    let target = match target(st, &w.url) {
        Ok(t) => t,
        // The operator's policy changed since the webhook was made.
        Err(why) => {
            return Outcome {
                status: None,
                duration_ms: 0,
                error: Some(format!("refused: the url {why}")),
            }
        }
    };
    send::post(
        &target,
        hdrs,
        body,
        st.inner.hooks.tls(),
        Duration::from_secs(TIMEOUT_S),
    )
    .await
}

/// `:test`: a signed `webhook.test` now; how the endpoint answered.
pub(crate) async fn test(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Outcome> {
    let w = find(st, key, id)?;
    let now = st.now_ms();
    let event_id = uuid::Uuid::new_v4().to_string();
    let body = json!({
        "id": event_id, "type": TEST_TYPE, "createdAt": iso(now),
        "data": {"webhook": {"id": w.id, "url": w.url}},
    })
    .to_string();
    let secrets = live_secrets(st, &w, now)?;
    let hdrs = headers(&secrets, &body, now, &event_id, TEST_TYPE, &event_id, 1);
    let out = post(st, &w, body, &hdrs).await;
    tracing::info!(webhook_id = %id, status = ?out.status, error = ?out.error, "webhook test sent");
    Ok(out)
}

/// A webhook's deliveries this key may read, newest first.
pub(crate) fn deliveries(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    state: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> ApiResult<(Vec<DeliveryRow>, Option<i64>)> {
    find(st, key, id)?;
    let mut rows = st.store().list_deliveries(id, state, before, limit + 1)?;
    let limit = usize::try_from(limit).unwrap_or(0);
    let next = if rows.len() > limit {
        limit
            .checked_sub(1)
            .and_then(|i| rows.get(i))
            .map(|d| d.seq)
    } else {
        None
    };
    rows.truncate(limit);
    Ok((rows, next))
}

/// `:retry`: sends the delivery once, now, whatever its state.
pub(crate) async fn retry(
    st: &AppState,
    key: &KeyInfo,
    delivery_id: &str,
) -> ApiResult<DeliveryRow> {
    let d = st
        .store()
        .get_delivery(delivery_id)?
        .ok_or_else(|| delivery_not_found(delivery_id))?;
    if find(st, key, &d.webhook_id).is_err() {
        return Err(delivery_not_found(delivery_id));
    }
    deliver(st, d, true).await
}

/// One attempt of `d`, recorded: on success it is `succeeded`; a scheduled
/// attempt that fails waits for the next on the schedule, or is `failed`
/// after the last; a manual one that fails leaves a pending delivery on
/// its schedule and marks a finished one `failed`.
async fn deliver(st: &AppState, mut d: DeliveryRow, manual: bool) -> ApiResult<DeliveryRow> {
    let now = st.now_ms();
    let Some(w) = st.store().get_webhook(&d.webhook_id)? else {
        // Its webhook went (with its deliveries) while this was claimed.
        return Ok(d);
    };
    let out = if !w.enabled && !manual {
        Outcome {
            status: None,
            duration_ms: 0,
            error: Some("disabled: the webhook is disabled".into()),
        }
    } else {
        let secrets = live_secrets(st, &w, now)?;
        let hdrs = headers(
            &secrets,
            &d.body,
            now,
            &d.event_id,
            &d.event_type,
            &d.id,
            d.log.len() + 1,
        );
        post(st, &w, d.body.clone(), &hdrs).await
    };
    let ok = out.ok();
    let done = st.now_ms();
    d.log.push(Attempt {
        at_ms: now,
        status: out.status,
        duration_ms: out.duration_ms,
        error: out.error.clone(),
        manual,
    });
    if d.log.len() > LOG_KEEP {
        let extra = d.log.len() - LOG_KEEP;
        d.log.drain(..extra);
    }
    d.updated_ms = done;
    if ok {
        d.state = "succeeded".into();
        d.next_ms = None;
    } else if !w.enabled && !manual {
        d.state = "failed".into();
        d.next_ms = None;
    } else if !manual {
        d.attempts += 1;
        match retry_delay_ms(d.attempts, st.config().webhook_second_ms) {
            Some(wait) => d.next_ms = Some(done + wait),
            None => {
                d.state = "failed".into();
                d.next_ms = None;
            }
        }
    } else if d.state != "pending" {
        d.state = "failed".into();
    }
    st.store().save_delivery(&d)?;
    st.store()
        .update_webhook(&w.id, |w| match (ok, w.failing_since_ms) {
            (true, Some(_)) => {
                w.failing_since_ms = None;
                true
            }
            (false, None) => {
                w.failing_since_ms = Some(now);
                true
            }
            _ => false,
        })?;
    tracing::debug!(
        delivery_id = %d.id, webhook_id = %w.id, status = ?out.status,
        error = ?out.error, state = %d.state, "webhook delivery attempted"
    );
    if d.state == "pending" {
        st.inner.hooks.wake();
    }
    Ok(d)
}

/// The worker: sends due deliveries, up to [`IN_FLIGHT`] at once, until
/// the server shuts down. Sends in flight then are aborted; their claims
/// run out and a later server sends them.
pub(crate) async fn run(st: AppState) {
    let mut inflight: JoinSet<()> = JoinSet::new();
    loop {
        while inflight.try_join_next().is_some() {}
        let room = IN_FLIGHT.saturating_sub(inflight.len());
        if room > 0 {
            let now = st.now_ms();
            match st
                .store()
                .claim_due(now, now + CLAIM_MS, i64::try_from(room).unwrap_or(1))
            {
                Ok(due) => {
                    for d in due {
                        let st2 = st.clone();
                        inflight.spawn(async move {
                            let id = d.id.clone();
                            if let Err(e) = deliver(&st2, d, false).await {
                                tracing::error!(delivery_id = %id, error = %e, "a delivery failed to record");
                            }
                        });
                    }
                }
                Err(e) => tracing::error!(error = %e, "reading due deliveries failed"),
            }
        }
        // With no room, a send ending wakes the loop.
        let wait = match st.store().next_due() {
            Ok(Some(t)) if inflight.len() < IN_FLIGHT => (t - st.now_ms()).clamp(10, 1000),
            _ => 1000,
        };
        tokio::select! {
            _ = st.inner.hooks.notify.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(wait as u64)) => {}
            Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
            _ = st.inner.cancel.cancelled() => {
                inflight.shutdown().await;
                return;
            }
        }
    }
}
