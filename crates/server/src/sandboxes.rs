//! Sandboxes (contract §5): create, get, list, stop, pause, wake, delete,
//! extend, update; the state machine, waits, leases, idle pauses, auto-wake
//! and recovery after a restart.
//!
//! Every host operation on a sandbox runs in an owned task under its
//! lifecycle lock, after the store moved it to a transitional state
//! (`starting`, `pausing`, `resuming`, `stopping`); the task re-reads the
//! state under the lock and only records its outcome when nothing else
//! (a stop, a delete) changed it meanwhile.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use base64::Engine;
use runtime_api::Sandbox;
use serde_json::{json, Value};

use crate::domain::lease;
use crate::domain::lifecycle::SandboxState;
use crate::domain::names::valid_env_name;
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{
    check_env, checked_labels, checked_name, json_object, no_fields, prefer_wait, query_object,
    Fields,
};
use crate::http::{record_json, Ctx, Reply};
use crate::service::lifecycle::{drive, CaptureDir, Op};
use crate::service::sandboxes::*;
use crate::store::SandboxRow;
use crate::AppState;

use SandboxState::{Paused, Pausing, Resuming, Running, Starting, Stopped, Stopping};

/// The states by their wire names, for the query parameters that name them.
const STATE_NAMES: [&str; 7] = [
    Starting.as_str(),
    Running.as_str(),
    Pausing.as_str(),
    Paused.as_str(),
    Resuming.as_str(),
    Stopping.as_str(),
    Stopped.as_str(),
];

struct CreateReq {
    record: Sandbox,
    env: Vec<(String, String)>,
    get_or_create: bool,
    snapshot: Option<String>,
    /// The shape fields the request named (a snapshot's shape must match them).
    shape_given: Vec<(&'static str, u32)>,
    floor_given: bool,
    net: crate::net::CreateNet,
    volumes: Vec<crate::volumes::Attachment>,
    image: Option<String>,
}

fn parse_create(st: &AppState, body: &[u8]) -> ApiResult<CreateReq> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let name = checked_name(&mut f);
    let labels = checked_labels(&mut f).unwrap_or_default();
    let funding = f
        .one_of("funding", &["trial", "paid"])
        .unwrap_or_else(|| "paid".into());
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, \"local\"");
        }
    }
    let vcpu_given = f.int("vcpu", 1, 16);
    let memory_given = f.int("memoryMiB", 128, 65536);
    let disk_given = f.int("diskMiB", 3072, 1 << 20);
    let shape_given: Vec<(&'static str, u32)> = [
        ("vcpu", vcpu_given),
        ("memoryMiB", memory_given),
        ("diskMiB", disk_given),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k, v as u32)))
    .collect();
    let floor_given = f.present("cpuFloorMillis");
    let vcpu = vcpu_given.unwrap_or(2) as u32;
    let memory_mib = memory_given.unwrap_or(4096) as u32;
    let disk_mib = disk_given.unwrap_or(4096) as u32;
    let cpu = f
        .one_of("cpu", &["shared", "reserved"])
        .unwrap_or_else(|| "shared".into());
    let floor_default = if cpu == "reserved" { vcpu * 1000 } else { 50 };
    let cpu_floor_millis = f
        .int("cpuFloorMillis", 0, i64::from(vcpu) * 1000)
        .map(|n| n as u32)
        .unwrap_or(floor_default);
    let timeout_seconds = f.int("timeoutSeconds", 60, 86400).map(|n| n as u32);
    let on_lease_end = f
        .one_of("onLeaseEnd", &["pause", "stop", "delete"])
        .unwrap_or_else(|| "pause".into());
    let pausable = f.bool("pausable").unwrap_or(true);
    let idle_pause_seconds = f.int("idlePauseSeconds", 0, 86400).unwrap_or(0) as u32;
    if (1..60).contains(&idle_pause_seconds) {
        f.issue(
            "idlePauseSeconds",
            "must be 0 (never) or between 60 and 86400",
        );
    }
    let auto_wake = f.bool("autoWake").unwrap_or(true);
    let user = f
        .one_of("user", &["sandbox", "root"])
        .unwrap_or_else(|| "sandbox".into());
    let persistent = f.bool("persistent").unwrap_or(false);
    let max_total_cost_micros = f.int("maxTotalCostMicros", 0, i64::MAX);
    let max_cost_micros = f.int("maxCostMicros", 0, i64::MAX);
    let get_or_create = f.bool("getOrCreate").unwrap_or(false);
    if get_or_create && name.is_none() {
        f.issue("getOrCreate", "needs a name");
    }
    let env = f.string_map("env", 32);
    let env = check_env(&mut f, env).unwrap_or_default();
    let image = f.raw("image");
    let image_ref = match image {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "default" => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            f.issue(
                "image",
                "must be an image id, name, name:tag or name@version",
            );
            None
        }
    };
    let snapshot = f.string("snapshot");
    if snapshot.is_some() && image.is_some() {
        f.issue("snapshot", "give image or snapshot, not both");
    }
    let net = crate::net::parse_create(st, &mut f);
    f.refuse(
        "spreadFrom",
        "is not supported by this server (one machine)",
    );
    f.refuse("tailscale", "is not supported by this server");
    let volumes = crate::volumes::parse_create(&mut f);
    f.finish()?;

    let now = st.now_ms();
    let ends_at = timeout_seconds.map(|t| iso(now + i64::from(t) * 1000));
    let mut env_names: Vec<String> = env.iter().map(|(k, _)| k.clone()).collect();
    env_names.sort();
    env_names.dedup();
    let record = Sandbox {
        id: uuid::Uuid::new_v4().to_string(),
        kind: "sandbox".into(),
        name,
        labels,
        status: Starting.status().into(),
        state: Starting,
        region: "local".into(),
        funding,
        vcpu,
        memory_mib,
        disk_mib,
        cpu,
        cpu_floor_millis,
        pausable,
        timeout_seconds,
        idle_pause_seconds,
        auto_wake,
        persistent,
        on_lease_end,
        user,
        created_at: iso(now),
        ready_at: None,
        expires_at: ends_at.clone(),
        ends_at,
        ended_at: None,
        stop_reason: None,
        paused_at: None,
        paused_expires_at: None,
        retention_days: None,
        last_active_at: Some(iso(now)),
        charged_micros: 0,
        held_micros: 0,
        max_total_cost_micros,
        max_cost_micros,
        env_names,
        image: None,
    };
    Ok(CreateReq {
        record,
        env,
        get_or_create,
        snapshot,
        shape_given,
        floor_given,
        net,
        volumes,
        image: image_ref,
    })
}

pub async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let mut req = parse_create(&st, &body)?;
    if let Some(r) = &req.image {
        // The image's environment first; the create's own variables win.
        let img = crate::images::for_create(&st, &ctx.key, r)?;
        let mut env = img.env;
        env.retain(|(k, _)| !req.env.iter().any(|(n, _)| n == k));
        env.append(&mut req.env);
        req.env = env;
        let mut names: Vec<String> = req.env.iter().map(|(k, _)| k.clone()).collect();
        names.sort();
        names.dedup();
        req.record.env_names = names;
        req.record.image = Some(img.id);
    }
    let wait = prefer_wait(&ctx.headers);
    let from = match &req.snapshot {
        Some(sid) => {
            let snap = crate::snapshots::find_ready(&st, &ctx.key, sid)?;
            let s = &snap.record;
            if !req.volumes.is_empty() && s.mode == "memory" {
                return Err(ApiError::invalid(
                    "volumes",
                    "a start from a memory snapshot cannot attach volumes (its machine had none); \
                     use a disk snapshot",
                ));
            }
            let want = [
                ("vcpu", s.vcpu),
                ("memoryMiB", s.memory_mib),
                ("diskMiB", s.disk_mib),
            ];
            let issues: Vec<runtime_api::Issue> = req
                .shape_given
                .iter()
                .filter_map(|(k, v)| {
                    let (_, w) = want.iter().find(|(n, _)| n == k)?;
                    (v != w).then(|| runtime_api::Issue {
                        field: (*k).to_string(),
                        message: format!("must be {w}, the value of snapshot {sid} (or left out)"),
                    })
                })
                .collect();
            if !issues.is_empty() {
                return Err(ApiError::Invalid { issues });
            }
            let r = &mut req.record;
            r.vcpu = s.vcpu;
            r.memory_mib = s.memory_mib;
            r.disk_mib = s.disk_mib;
            if r.cpu == "reserved" && !req.floor_given {
                r.cpu_floor_millis = r.vcpu * 1000;
            }
            r.cpu_floor_millis = r.cpu_floor_millis.min(r.vcpu * 1000);
            Some(Arc::new(CaptureDir {
                path: crate::snapshots::dir(&st, sid),
                temporary: false,
            }))
        }
        None => None,
    };
    let start_mode = if from.is_some() { "snapshot" } else { "boot" };
    let created = {
        let _g = st.inner.create_lock.lock().await;
        let holder = match &req.record.name {
            Some(n) => name_holder(&st, n, None)?,
            None => None,
        };
        match holder {
            Some(h) if req.get_or_create && visible(&ctx.key, &h) => {
                let id = h.record.id.clone();
                if h.record.state == Stopped {
                    let lease = crate::billing::first_lease_seconds(h.record.timeout_seconds);
                    crate::billing::check_spend(&st, &h.key_id, &h.record, lease, lease)?;
                    restart(&st, &id)?;
                }
                Err(id)
            }
            Some(h) => {
                let sandbox_id = visible(&ctx.key, &h).then(|| h.record.id.clone());
                return Err(ApiError::NameTaken {
                    name: h.record.name.unwrap_or_default(),
                    sandbox_id,
                });
            }
            None => {
                // Before anything starts: a refusal costs nothing.
                let lease = crate::billing::first_lease_seconds(req.record.timeout_seconds);
                crate::billing::check_spend(&st, &ctx.key.id, &req.record, lease, lease)?;
                let row = SandboxRow {
                    seq: 0,
                    key_id: ctx.key.id.clone(),
                    record: req.record,
                    env: req.env,
                    deleted: None,
                };
                let volumes = crate::volumes::resolve(&st, &ctx.key, &req.volumes).await?;
                crate::net::store_create(&st, &row.record.id, &req.net)?;
                crate::volumes::keep(&st, &row.record.id, &volumes)?;
                st.store().insert_sandbox(&row)?;
                tracing::info!(sandbox_id = %row.record.id, "sandbox created");
                drive(&st, &row.record.id, Op::Start { from })?;
                Ok(row.record.id)
            }
        }
    };
    let (id, reused) = match created {
        Ok(id) => (id, false),
        Err(id) => (id, true),
    };
    if let Some(secs) = wait {
        wait_until(&st, &id, Duration::from_secs(secs), |s| {
            s != Starting && s != Stopping
        })
        .await?;
    }
    let row = st
        .store()
        .get_sandbox(&id)?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    let status = if reused {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok(Reply::Json(
        status,
        record_json(
            &row.record,
            &[
                ("reused", Value::Bool(reused)),
                ("start", json!({"mode": start_mode})),
            ],
        ),
    ))
}

/// `:restart`: a stopped persistent sandbox starts again from its disk; a
/// live one answers as it is; a stopped one that is not persistent is 409
/// `not_persistent`.
async fn restart_action(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    no_fields(&body)?;
    let row = settle(&st, &ctx.key, &id, &[Stopping]).await?;
    if row.record.state == Stopped {
        if !row.record.persistent {
            return Err(ApiError::Conflict {
                code: "not_persistent",
                message: format!(
                    "Sandbox {id} is stopped and not persistent, so it has no disk to restart from."
                ),
                details: Some(json!({ "sandboxId": id })),
            });
        }
        let _g = st.inner.create_lock.lock().await;
        if let Some(n) = &row.record.name {
            if let Some(h) = name_holder(&st, n, Some(&id))? {
                let sandbox_id = visible(&ctx.key, &h).then(|| h.record.id.clone());
                return Err(ApiError::NameTaken {
                    name: n.clone(),
                    sandbox_id,
                });
            }
        }
        let lease = crate::billing::first_lease_seconds(row.record.timeout_seconds);
        crate::billing::check_spend(&st, &row.key_id, &row.record, lease, lease)?;
        restart(&st, &id)?;
    }
    if let Some(secs) = prefer_wait(&ctx.headers) {
        wait_until(&st, &id, Duration::from_secs(secs), |s| s != Starting).await?;
    }
    Reply::ok(record_json(&find(&st, &ctx.key, &id)?.record, &[]))
}

async fn pause(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    no_fields(&body)?;
    let row = settle(&st, &ctx.key, &id, &[Starting, Resuming]).await?;
    let mut asked = false;
    match row.record.state {
        Running if !row.record.pausable => {
            return Err(ApiError::Conflict {
                code: "not_pausable",
                message: format!("Sandbox {id} was created with pausable: false."),
                details: Some(json!({ "sandboxId": id })),
            })
        }
        Running => asked = request_pause(&st, &id, "requested")?,
        Pausing | Paused => {}
        _ => {
            return Err(ApiError::NotRunning {
                id,
                state: row.record.state,
            })
        }
    }
    if let Some(secs) = prefer_wait(&ctx.headers) {
        wait_until(&st, &id, Duration::from_secs(secs), |s| s != Pausing).await?;
    }
    let row = find(&st, &ctx.key, &id)?;
    // Running again: the pause failed, or it paused and a call (a resuming
    // stream) woke it at once.
    let failed = asked
        && row.record.state == Running
        && st
            .inner
            .pause_failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&id);
    if failed {
        return Err(ApiError::Failed {
            code: "pause_failed",
            message: format!("Sandbox {id} could not be paused; it runs on."),
        });
    }
    Reply::ok(record_json(&row.record, &[]))
}

async fn wake(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let lease = f.int("timeoutSeconds", 60, 86400).map(|t| t as u32);
    f.finish()?;
    let row = settle(&st, &ctx.key, &id, &[Pausing]).await?;
    let mut asked = false;
    match row.record.state {
        Paused => {
            let seconds = crate::billing::first_lease_seconds(lease.or(row.record.timeout_seconds));
            crate::billing::check_spend(&st, &row.key_id, &row.record, seconds, seconds)?;
            asked = drive(&st, &id, Op::Wake { lease })?
        }
        Resuming => {}
        Running | Starting => {
            // Already awake: done. A new limit asked for applies from now.
            if let Some(t) = lease {
                crate::billing::check_lease_change(&st, &row, t)?;
                st.store().update_sandbox(&id, |r| {
                    let end = iso(st.now_ms() + i64::from(t) * 1000);
                    r.record.timeout_seconds = Some(t);
                    r.record.ends_at = Some(end.clone());
                    r.record.expires_at = Some(end);
                    true
                })?;
                st.notify_change();
            }
        }
        _ => {
            return Err(ApiError::NotRunning {
                id,
                state: row.record.state,
            })
        }
    }
    if let Some(secs) = prefer_wait(&ctx.headers) {
        wait_until(&st, &id, Duration::from_secs(secs), |s| s != Resuming).await?;
    }
    let row = find(&st, &ctx.key, &id)?;
    if asked && row.record.state == Paused {
        return Err(ApiError::Failed {
            code: "wake_failed",
            message: format!("Sandbox {id} could not be woken; it stays paused."),
        });
    }
    Reply::ok(record_json(&row.record, &[]))
}

pub async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let wait_for = f
        .one_of("waitFor", &STATE_NAMES)
        .and_then(|s| SandboxState::parse(&s));
    let timeout = f.q_int("timeoutSeconds", 0, 120).unwrap_or(60);
    f.finish()?;
    find(&st, &ctx.key, &id)?;
    if let Some(target) = wait_for {
        // A sandbox that stopped will not reach any other state by itself.
        wait_until(&st, &id, Duration::from_secs(timeout as u64), |s| {
            s == target || s == Stopped
        })
        .await?;
    }
    Reply::ok(record_json(&find(&st, &ctx.key, &id)?.record, &[]))
}

fn encode_cursor(seq: i64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("seq:{seq}"))
}

fn decode_cursor(c: &str) -> Option<i64> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .ok()?;
    String::from_utf8(raw)
        .ok()?
        .strip_prefix("seq:")?
        .parse()
        .ok()
}

pub async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &["state", "label"]);
    let mut f = Fields::new(&q);
    let mut states = Vec::new();
    if let Some(Value::Array(a)) = f.raw("state") {
        for s in a.iter().filter_map(Value::as_str) {
            if let Some(state) = SandboxState::parse(s) {
                states.push(state);
            } else {
                f.issue("state", format!("{s} is not a state"));
            }
        }
    }
    let name = f.string("name");
    let mut labels = Vec::new();
    if let Some(Value::Array(a)) = f.raw("label") {
        for l in a.iter().filter_map(Value::as_str) {
            match l.split_once(':') {
                Some((k, v)) => labels.push((k.to_string(), v.to_string())),
                None => f.issue("label", format!("{l} is not key:value")),
            }
        }
    }
    let include_stopped = f.q_bool("includeStopped").unwrap_or(false);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = match f.string("cursor") {
        Some(c) if !c.is_empty() => match decode_cursor(&c) {
            Some(seq) => Some(seq),
            None => {
                f.issue("cursor", "is not a cursor this server gave");
                None
            }
        },
        _ => None,
    };
    f.finish()?;
    let mut rows = st
        .store()
        .live_sandboxes()?
        .into_iter()
        .filter(|r| visible(&ctx.key, r))
        .filter(|r| cursor.is_none_or(|c| r.seq < c))
        .filter(|r| {
            if states.is_empty() {
                include_stopped || r.record.state != Stopped
            } else {
                states.contains(&r.record.state)
            }
        })
        .filter(|r| {
            name.as_ref()
                .is_none_or(|n| r.record.name.as_ref() == Some(n))
        })
        .filter(|r| {
            labels
                .iter()
                .all(|(k, v)| r.record.labels.get(k) == Some(v))
        })
        .take(limit + 1)
        .collect::<Vec<_>>();
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last().map(|r| encode_cursor(r.seq))
    } else {
        None
    };
    let data: Vec<Value> = rows.iter().map(|r| record_json(&r.record, &[])).collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

pub async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let row = match st.store().get_sandbox(&id)? {
        Some(r) if visible(&ctx.key, &r) => r,
        _ => return Err(ApiError::sandbox_not_found(&id)),
    };
    if let Some(d) = row.deleted {
        return Reply::ok(serde_json::to_value(d).unwrap_or(Value::Null));
    }
    let row = delete_sandbox(&st, &id, "deleted")?;
    Reply::ok(serde_json::to_value(row.deleted).unwrap_or(Value::Null))
}

pub async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "stop" => {
            no_fields(&body)?;
            find(&st, &ctx.key, &id)?;
            stop_for(&st, &id, "requested")?;
            if let Some(secs) = prefer_wait(&ctx.headers) {
                wait_until(&st, &id, Duration::from_secs(secs), |s| s == Stopped).await?;
            }
            Reply::ok(record_json(&find(&st, &ctx.key, &id)?.record, &[]))
        }
        "extend" => extend(st, ctx, id, body).await,
        "update" => update(st, ctx, id, body).await,
        "pause" => pause(st, ctx, id, body).await,
        "wake" => wake(st, ctx, id, body).await,
        "fork" => crate::snapshots::fork(st, ctx, id, body).await,
        "snapshot" => crate::snapshots::snapshot(st, ctx, id, body).await,
        "restart" => restart_action(st, ctx, id, body).await,
        "retention" => retention(st, ctx, id, body).await,
        "resize" | "switch-image" => {
            find(&st, &ctx.key, &id)?;
            Err(ApiError::Unsupported {
                feature: "this sandbox action",
            })
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}:{verb}"),
        }),
    }
}

/// `:retention {days}`: a paused sandbox is deleted `days` after its pause
/// (this pause and later ones).
async fn retention(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let days = f.int("days", 1, 365);
    if !f.present("days") {
        f.issue("days", "is required");
    }
    f.finish()?;
    find(&st, &ctx.key, &id)?;
    let row = st
        .store()
        .update_sandbox(&id, |r| {
            r.record.retention_days = days.map(|d| d as u32);
            if r.record.state == Paused {
                r.record.paused_expires_at = lease::retention_end(&r.record);
            }
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    st.notify_change();
    Reply::ok(record_json(&row.record, &[]))
}

async fn extend(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let seconds = f.int("seconds", 1, 86400);
    if seconds.is_none() && !f.present("seconds") {
        f.issue("seconds", "is required");
    }
    f.finish()?;
    let seconds = seconds.unwrap_or(0);
    let row = find(&st, &ctx.key, &id)?;
    if row.record.state != Running && row.record.state != Starting {
        return Err(ApiError::NotRunning {
            id,
            state: row.record.state,
        });
    }
    if row.record.ends_at.is_some() {
        let left = crate::billing::lease_left_seconds(&row.record, st.now_ms());
        crate::billing::check_spend(&st, &row.key_id, &row.record, left + seconds, seconds)?;
    }
    let row = st
        .store()
        .update_sandbox(&id, |r| {
            let Some(end) = r.record.ends_at.as_deref().and_then(parse_iso_ms) else {
                return false;
            };
            let end = iso(end.max(st.now_ms()) + seconds * 1000);
            r.record.ends_at = Some(end.clone());
            r.record.expires_at = Some(end);
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    st.notify_change();
    Reply::ok(record_json(&row.record, &[]))
}

async fn update(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let name_given = f.present("name");
    let name = checked_name(&mut f);
    let labels = checked_labels(&mut f);
    let mut env_changes: Vec<(String, Option<String>)> = Vec::new();
    match f.raw("env") {
        None => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                match v {
                    Value::String(s) if valid_env_name(k) => {
                        env_changes.push((k.clone(), Some(s.clone())))
                    }
                    Value::Null if valid_env_name(k) => env_changes.push((k.clone(), None)),
                    Value::String(_) | Value::Null => {
                        f.issue(&format!("env.{k}"), "is not a valid variable name")
                    }
                    _ => f.issue(&format!("env.{k}"), "must be a string or null"),
                }
            }
        }
        Some(_) => f.issue("env", "must be an object"),
    }
    let auto_wake = f.bool("autoWake");
    let user = f.one_of("user", &["sandbox", "root"]);
    let idle = f.int("idlePauseSeconds", 0, 86400);
    let persistent = f.bool("persistent");
    let max_total = f.int("maxTotalCostMicros", 0, i64::MAX);
    let timeout_given = f.present("timeoutSeconds");
    let timeout = f.int("timeoutSeconds", 60, 86400);
    let on_timeout = f.one_of("onTimeout", &["pause", "stop", "delete"]);
    // The create's name for it, accepted here too.
    let on_lease_end = f.one_of("onLeaseEnd", &["pause", "stop", "delete"]);
    let on_timeout = on_timeout.or(on_lease_end);
    f.finish()?;
    let row = find(&st, &ctx.key, &id)?;
    if let (Some(t), Running | Starting) = (timeout, row.record.state) {
        crate::billing::check_lease_change(&st, &row, t as u32)?;
    }
    let _g = st.inner.create_lock.lock().await;
    if let Some(n) = &name {
        if let Some(h) = name_holder(&st, n, Some(&id))? {
            let sandbox_id = visible(&ctx.key, &h).then(|| h.record.id.clone());
            return Err(ApiError::NameTaken {
                name: n.clone(),
                sandbox_id,
            });
        }
    }
    let row = st
        .store()
        .update_sandbox(&id, |r| {
            let s = &mut r.record;
            if name_given {
                s.name = name.clone();
            }
            if let Some(l) = &labels {
                s.labels = l.clone();
            }
            for (k, v) in &env_changes {
                r.env.retain(|(n, _)| n != k);
                if let Some(v) = v {
                    r.env.push((k.clone(), v.clone()));
                }
            }
            let mut names: Vec<String> = r.env.iter().map(|(k, _)| k.clone()).collect();
            names.sort();
            names.dedup();
            s.env_names = names;
            s.auto_wake = auto_wake.unwrap_or(s.auto_wake);
            s.user = user.clone().unwrap_or(s.user.clone());
            s.idle_pause_seconds = idle.map(|n| n as u32).unwrap_or(s.idle_pause_seconds);
            s.persistent = persistent.unwrap_or(s.persistent);
            if max_total.is_some() {
                s.max_total_cost_micros = max_total;
            }
            if let Some(o) = &on_timeout {
                s.on_lease_end = o.clone();
            }
            if timeout_given {
                s.timeout_seconds = timeout.map(|t| t as u32);
                s.ends_at = timeout.map(|t| iso(st.now_ms() + t * 1000));
                s.expires_at = s.ends_at.clone();
            }
            true
        })?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    st.notify_change();
    Reply::ok(record_json(&row.record, &[]))
}
