//! `POST …:exec` and `…/processes` (contract §6): each handler checks its
//! request into a command, calls [`crate::service::processes`] and renders
//! the answer (JSON, or NDJSON events).

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use base64::Engine;
use runtime_host::TermSize;
use serde_json::{json, Value};

use crate::domain::process::{signal_number, MAX_TIMEOUT_MS, SIGTERM};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{check_env, json_object, query_object, Fields};
use crate::http::reply::{ndjson, ndjson_now};
use crate::http::{Ctx, Reply};
use crate::service::processes::{
    self, run_as, Command, ExecCommand, Executed, OutputRead, SpawnCommand, Write,
};
use crate::AppState;

pub(super) async fn exec(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let command = command(&mut f);
    let stream = f.bool("stream").unwrap_or(false);
    f.finish()?;
    let cmd = ExecCommand { command, stream };
    match processes::exec(&st, &ctx.key, &id, cmd).await? {
        Executed::Finished(result) => {
            Reply::ok(serde_json::to_value(result).unwrap_or(Value::Null))
        }
        Executed::Streaming { process_id, events } => Ok(Reply::Stream {
            response: ndjson(events, st.config().heartbeat),
            replay: json!({"sandboxId": id, "processId": process_id}),
        }),
    }
}

pub(super) async fn spawn(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let command = command(&mut f);
    let stdin_pipe = f.one_of("stdinMode", &["pipe"]).is_some();
    let mut pty = None;
    if let Some(p) = f.raw("pty") {
        match p {
            Value::Object(m) => {
                let mut pf = Fields::new(m);
                let cols = pf.int("cols", 1, 1000).unwrap_or(80) as u16;
                let rows = pf.int("rows", 1, 1000).unwrap_or(24) as u16;
                if let Err(ApiError::Invalid { issues }) = pf.finish() {
                    for i in issues {
                        f.issue(&format!("pty.{}", i.field), i.message);
                    }
                }
                pty = Some(TermSize { cols, rows });
            }
            _ => f.issue("pty", "must be an object {cols, rows}"),
        }
    }
    let base64_output =
        f.one_of("outputEncoding", &["utf8", "base64"]).as_deref() == Some("base64");
    f.finish()?;
    let cmd = SpawnCommand {
        command,
        stdin_pipe,
        pty,
        base64_output,
    };
    let proc = processes::spawn(&st, &ctx.key, &id, cmd).await?;
    Ok(Reply::Json(StatusCode::CREATED, proc.info()))
}

/// The fields exec and spawn share; issues go to `f`.
fn command(f: &mut Fields<'_>) -> Command {
    let command = f.string("command");
    let argv = match f.raw("argv") {
        None => None,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => Some(
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect::<Vec<_>>(),
        ),
        Some(_) => {
            f.issue("argv", "must be a non-empty array of strings");
            None
        }
    };
    let argv = match (command, argv) {
        (Some(c), None) => vec!["bash".to_string(), "-c".to_string(), c],
        (None, Some(a)) => a,
        (Some(_), Some(_)) => {
            f.issue("argv", "give command or argv, not both");
            Vec::new()
        }
        (None, None) => {
            if !f.present("argv") && !f.present("command") {
                f.issue("command", "command or argv is required");
            }
            Vec::new()
        }
    };
    let cwd = f.string("cwd");
    let env = f.string_map("env", 256);
    let env = check_env(f, env).unwrap_or_default();
    let stdin_text = f.string("stdin");
    let stdin_b64 = f.string("stdinBase64");
    let mut stdin = None;
    match (stdin_text, stdin_b64) {
        (Some(_), Some(_)) => f.issue("stdinBase64", "give stdin or stdinBase64, not both"),
        (Some(t), None) => stdin = Some(t.into_bytes()),
        (None, Some(b)) => match base64::engine::general_purpose::STANDARD.decode(b) {
            Ok(d) => stdin = Some(d),
            Err(_) => f.issue("stdinBase64", "is not valid base64"),
        },
        (None, None) => {}
    }
    let timeout_ms = f.int("timeoutMs", 1, MAX_TIMEOUT_MS);
    let user = f.one_of("user", &["sandbox", "root"]).map(|u| run_as(&u));
    let trace_files = f.bool("traceFiles").unwrap_or(false);
    Command {
        argv,
        cwd,
        env,
        user,
        stdin,
        timeout_ms,
        trace_files,
    }
}

pub(super) async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let procs = processes::list(&st, &ctx.key, &id)?;
    let data: Vec<Value> = procs.iter().map(|p| p.info()).collect();
    Reply::ok(json!({ "data": data }))
}

/// `GET …/processes/{pid}/files`.
pub(super) async fn files(st: AppState, ctx: Ctx, id: String, pid: String) -> ApiResult<Reply> {
    Reply::ok(processes::files(&st, &ctx.key, &id, &pid)?)
}

pub(super) async fn get(st: AppState, ctx: Ctx, id: String, pid: String) -> ApiResult<Reply> {
    Reply::ok(processes::get(&st, &ctx.key, &id, &pid)?.info())
}

pub(super) async fn output(st: AppState, ctx: Ctx, id: String, pid: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let cursor = f.q_int("cursor", 0, i64::MAX).unwrap_or(0) as u64;
    let follow = f.q_bool("follow").unwrap_or(false);
    let wait_ms = f.q_int("waitMs", 0, MAX_OUTPUT_WAIT_MS);
    f.finish()?;
    // The JSON polling form: asked for by `waitMs`, or by a JSON-only Accept.
    if !follow && (wait_ms.is_some() || accepts_only_json(&ctx.headers)) {
        let wait = Duration::from_millis(wait_ms.unwrap_or(0) as u64);
        let v = processes::output_polled(&st, &ctx.key, &id, &pid, cursor, wait).await?;
        return Reply::ok(v);
    }
    let response = match processes::output(&st, &ctx.key, &id, &pid, cursor, follow).await? {
        OutputRead::Follow(events) => ndjson(events, st.config().heartbeat),
        OutputRead::Now(events) => ndjson_now(&events),
    };
    Ok(Reply::Raw(response))
}

/// The longest `waitMs` of the output's polling form.
const MAX_OUTPUT_WAIT_MS: i64 = 60_000;

/// Whether the request's `Accept` names JSON and not NDJSON.
fn accepts_only_json(headers: &axum::http::HeaderMap) -> bool {
    let accept = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    accept.contains("application/json") && !accept.contains("ndjson")
}

/// `POST …/processes/{pid}:{verb}`.
pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    pid: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    match verb.as_str() {
        "write" => {
            let data = match f.string("base64") {
                Some(b) => match base64::engine::general_purpose::STANDARD.decode(b) {
                    Ok(d) => d,
                    Err(_) => {
                        f.issue("base64", "is not valid base64");
                        Vec::new()
                    }
                },
                None => Vec::new(),
            };
            let offset = f.int("offset", 0, i64::MAX).map(|o| o as u64);
            let eof = f.bool("eof").unwrap_or(false);
            f.finish()?;
            let w = Write { data, offset, eof };
            let offset = processes::write(&st, &ctx.key, &id, &pid, w).await?;
            Reply::ok(json!({ "offset": offset }))
        }
        "signal" => {
            let sig = match f.raw("signal") {
                None => Some(SIGTERM),
                Some(v) => {
                    let n = signal_number(v);
                    if n.is_none() {
                        f.issue(
                            "signal",
                            "must be a signal name such as SIGTERM, or its number",
                        );
                    }
                    n
                }
            };
            f.finish()?;
            let delivered = processes::signal(&st, &ctx.key, &id, &pid, sig).await?;
            Reply::ok(json!({ "id": pid, "signal": sig, "delivered": delivered }))
        }
        "resize" => {
            let cols = f.int("cols", 1, 1000);
            let rows = f.int("rows", 1, 1000);
            if !f.present("cols") {
                f.issue("cols", "is required");
            }
            if !f.present("rows") {
                f.issue("rows", "is required");
            }
            f.finish()?;
            let size = TermSize {
                cols: cols.unwrap_or(80) as u16,
                rows: rows.unwrap_or(24) as u16,
            };
            processes::resize(&st, &ctx.key, &id, &pid, size).await?;
            Reply::ok(json!({ "id": pid, "cols": size.cols, "rows": size.rows }))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/processes/{pid}:{verb}"),
        }),
    }
}

/// A duplicate of a streamed exec (idempotency) follows the same process
/// from the start; 409 `output_gone` once the process was forgotten.
pub(crate) fn replay_stream(st: &AppState, sandbox_id: &str, pid: &str) -> ApiResult<Response> {
    let events = processes::replay(st, sandbox_id, pid)?;
    Ok(ndjson(events, st.config().heartbeat))
}
