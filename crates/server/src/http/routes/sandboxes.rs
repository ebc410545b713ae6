//! Sandboxes (contract §5): create, get, list, delete and the verbs
//! (`:stop`, `:pause`, `:wake`, `:extend`, `:update`, `:restart`,
//! `:retention`; `:fork` and `:snapshot` in snapshots.rs). Each handler
//! parses its request into a command, calls `service::sandboxes` and renders
//! the record.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::lease;
use crate::domain::lifecycle::SandboxState;
use crate::domain::names::valid_env_name;
use crate::domain::sandbox::Settings;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{
    check_env, checked_labels, checked_name, json_object, no_fields, prefer_wait, query_object,
    Fields,
};
use crate::http::{record_json, Ctx, Reply};
use crate::service::nodes::{self, Placement};
use crate::service::sandboxes::{self as svc, ListFilter, NewSandbox, Update};
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

fn wait_of(ctx: &Ctx) -> Option<Duration> {
    prefer_wait(&ctx.headers).map(Duration::from_secs)
}

fn parse_create(st: &AppState, key: &KeyInfo, body: &[u8]) -> ApiResult<NewSandbox> {
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
    let idle_pause_seconds = f
        .int("idlePauseSeconds", 0, 86400)
        .map_or(lease::DEFAULT_IDLE_PAUSE_SECONDS, |n| {
            lease::idle_pause_of(n as u32)
        });
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
    let net = super::network::parse_create(&mut f, || {
        crate::service::secrets::names(st, &key.id).unwrap_or_default()
    });
    f.refuse(
        "spreadFrom",
        "is not supported by this server (one machine)",
    );
    f.refuse("tailscale", "is not supported by this server");
    let volumes = crate::http::routes::volumes::parse_create(&mut f);
    f.finish()?;
    Ok(NewSandbox {
        settings: Settings {
            name,
            labels,
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
            max_total_cost_micros,
            max_cost_micros,
        },
        env,
        get_or_create,
        snapshot,
        shape_given,
        floor_given,
        net,
        volumes,
        image: image_ref,
        answer_slot: None,
    })
}

pub(super) async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let mut req = parse_create(&st, &ctx.key, &body)?;
    // Its image or snapshot is on another control plane: made there.
    if !ctx.headers.contains_key(crate::http::forward::FORWARDED_BY) {
        if let Some(node) = svc::node_for_create(&st, &ctx.key, &req)? {
            let answer = crate::http::forward::carry_parts(
                &st,
                &node,
                axum::http::Method::POST,
                "/v1/sandboxes",
                &ctx,
                body,
            )
            .await?;
            return Ok(Reply::Raw(answer));
        }
        // Tied to nothing: here when this node has room, else where there
        // is. (A `getOrCreate` of a name held here stays here.)
        let named_get = req.get_or_create && req.settings.name.is_some();
        if req.snapshot.is_none() && req.image.is_none() && !named_get {
            let asked = u64::from(req.settings.memory_mib);
            if let Placement::Peers(peers, refusal) = nodes::place(&st, asked).await? {
                let answer =
                    crate::http::forward::carry_to_first(&st, &peers, "/v1/sandboxes", &ctx, body)
                        .await?;
                return answer.map(Reply::Raw).ok_or(refusal);
            }
        }
    }
    req.answer_slot = answer_slot(&ctx);
    let made = svc::create(&st, &ctx.key, req, wait_of(&ctx)).await?;
    Ok(created_reply(&made))
}

/// Where the request's idempotent answer goes, when it has an
/// `Idempotency-Key`: a change stores a pending record there with what it
/// makes, in the same transaction.
pub(super) fn answer_slot(ctx: &Ctx) -> Option<svc::AnswerSlot> {
    ctx.idem.as_ref().map(|r| svc::AnswerSlot {
        key_id: ctx.key.id.clone(),
        idem_key: r.idem_key.clone(),
        fingerprint: r.fingerprint.clone(),
    })
}

/// A create's answer: `201` with the new sandbox, `200` with the one
/// `getOrCreate` found.
fn created_reply(made: &svc::Created) -> Reply {
    let status = if made.reused {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Reply::Json(
        status,
        record_json(
            &made.row.record,
            &[
                ("reused", Value::Bool(made.reused)),
                ("start", json!({"mode": made.start_mode})),
            ],
        ),
    )
}

/// The replay of a create whose answer a crash kept from being stored:
/// the sandbox its pending record names, as it is now.
pub(crate) fn replay_created(st: &AppState, id: &str) -> ApiResult<Reply> {
    Ok(created_reply(&svc::created(st, id)?))
}

fn record(s: &runtime_api::Sandbox) -> ApiResult<Reply> {
    Reply::ok(record_json(s, &[]))
}

pub(super) async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let wait_for = f
        .one_of("waitFor", &STATE_NAMES)
        .and_then(|s| SandboxState::parse(&s));
    let timeout = f.q_int("timeoutSeconds", 0, 120).unwrap_or(60);
    f.finish()?;
    let wait = wait_for.map(|s| (s, Duration::from_secs(timeout as u64)));
    record(&svc::get(&st, &ctx.key, &id, wait).await?.record)
}

/// `GET …/metrics?range`: CPU and memory over the range.
pub(super) async fn metrics(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let range = f.string("range");
    f.finish()?;
    Reply::ok(crate::service::metrics::get(
        &st,
        &ctx.key,
        &id,
        range.as_deref(),
    )?)
}

/// The prefix of the sandbox list's cursors (`domain::cursor`).
const CURSOR_PREFIX: &str = "seq:";

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
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
    let after_seq = f.cursor(CURSOR_PREFIX);
    f.finish()?;
    let filter = ListFilter {
        states,
        name,
        labels,
        include_stopped,
        limit,
        after_seq,
    };
    let (rows, more) = svc::list(&st, &ctx.key, &filter)?;
    let next = if more {
        rows.last()
            .map(|r| crate::domain::cursor::encode(CURSOR_PREFIX, r.seq))
    } else {
        None
    };
    let data: Vec<Value> = rows.iter().map(|r| record_json(&r.record, &[])).collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

pub(super) async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let deleted = svc::delete(&st, &ctx.key, &id)?;
    Reply::ok(serde_json::to_value(deleted).unwrap_or(Value::Null))
}

pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "stop" => {
            no_fields(&body)?;
            record(&svc::stop(&st, &ctx.key, &id, wait_of(&ctx)).await?.record)
        }
        "extend" => extend(st, ctx, id, body).await,
        "update" => update(st, ctx, id, body).await,
        "pause" => {
            no_fields(&body)?;
            record(&svc::pause(&st, &ctx.key, &id, wait_of(&ctx)).await?.record)
        }
        "wake" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let lease = f.int("timeoutSeconds", 60, 86400).map(|t| t as u32);
            f.finish()?;
            record(
                &svc::wake(&st, &ctx.key, &id, lease, wait_of(&ctx))
                    .await?
                    .record,
            )
        }
        "fork" => super::snapshots::fork(st, ctx, id, body).await,
        "snapshot" => super::snapshots::snapshot(st, ctx, id, body).await,
        "restart" => {
            no_fields(&body)?;
            record(
                &svc::restart_stopped(&st, &ctx.key, &id, wait_of(&ctx))
                    .await?
                    .record,
            )
        }
        "retention" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let days = f.int("days", 1, 365);
            if !f.present("days") {
                f.issue("days", "is required");
            }
            f.finish()?;
            let days = days.map(|d| d as u32);
            record(&svc::set_retention(&st, &ctx.key, &id, days)?.record)
        }
        "resize" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let restart = f.bool("restart").unwrap_or(true);
            let vcpu = f.int("vcpu", 1, 16).map(|n| n as u32);
            let memory_mib = f.int("memoryMiB", 128, 65536).map(|n| n as u32);
            let disk_mib = f.int("diskMiB", 3072, 1 << 20).map(|n| n as u32);
            if !f.present("vcpu") && !f.present("memoryMiB") && !f.present("diskMiB") {
                f.issue("vcpu", "give vcpu, memoryMiB or diskMiB");
            }
            f.finish()?;
            let ask = crate::service::resize::Ask {
                restart,
                vcpu,
                memory_mib,
                disk_mib,
            };
            record(
                &crate::service::resize::resize(&st, &ctx.key, &id, ask, wait_of(&ctx))
                    .await?
                    .record,
            )
        }
        "switch-image" => {
            use crate::service::switch::{self, KEEP_WORKSPACE};
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let image = f.string("image");
            if image.is_none() && !f.present("image") {
                f.issue("image", "is required: the image to move the sandbox to");
            }
            match f.string("keep") {
                Some(k) if k == KEEP_WORKSPACE => {}
                None if f.present("keep") => {}
                _ => f.issue(
                    "keep",
                    "must be \"workspace\": a switch keeps /workspace and loses the rest of the disk (snapshot the sandbox first to keep everything)",
                ),
            }
            f.finish()?;
            let image = image.unwrap_or_default();
            record(
                &switch::switch_image(&st, &ctx.key, &id, &image, wait_of(&ctx))
                    .await?
                    .record,
            )
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}:{verb}"),
        }),
    }
}

async fn extend(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let seconds = f.int("seconds", 1, 86400);
    if seconds.is_none() && !f.present("seconds") {
        f.issue("seconds", "is required");
    }
    f.finish()?;
    record(&svc::extend(&st, &ctx.key, &id, seconds.unwrap_or(0))?.record)
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
    // `null` takes the cap away; absent leaves it.
    let max_total_given = f.present("maxTotalCostMicros");
    let max_total = f.int("maxTotalCostMicros", 0, i64::MAX);
    // `0` or `null` takes the limit away.
    let timeout_given = f.present("timeoutSeconds");
    let timeout = f.int("timeoutSeconds", 0, 86400).filter(|&t| t != 0);
    if timeout.is_some_and(|t| t < 60) {
        f.issue(
            "timeoutSeconds",
            "must be 0 (no limit) or between 60 and 86400",
        );
    }
    let on_timeout = f.one_of("onTimeout", &["pause", "stop", "delete"]);
    // The create's name for it, accepted here too.
    let on_lease_end = f.one_of("onLeaseEnd", &["pause", "stop", "delete"]);
    let on_timeout = on_timeout.or(on_lease_end);
    f.finish()?;
    let u = Update {
        name: name_given.then_some(name),
        labels,
        env_changes,
        auto_wake,
        user,
        idle_pause_seconds: idle.map(|n| lease::idle_pause_of(n as u32)),
        persistent,
        max_total_cost_micros: max_total_given.then_some(max_total),
        on_lease_end: on_timeout,
        timeout_seconds: timeout_given.then_some(timeout.map(|t| t as u32)),
    };
    record(&svc::update(&st, &ctx.key, &id, u).await?.record)
}
