//! Everything under `/v1/sandboxes/{id}/interpreter` (contract §8): runs
//! and contexts. Each handler checks its request into a command, calls
//! [`crate::service::interpreter`] and renders the answer.

use axum::body::Bytes;
use axum::http::{Method, StatusCode};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::domain::interpreter::{
    context_language, is_language, valid_context_id, LanguageIssue, DEFAULT_TIMEOUT_MS, LANGUAGES,
    MAX_CODE_BYTES,
};
use crate::domain::process::MAX_TIMEOUT_MS;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{check_env, json_object, no_fields, Fields};
use crate::http::reply::ndjson;
use crate::http::{Ctx, Reply};
use crate::service::interpreter::{self, CreateContext, Ran, RunCommand, RunEvent};
use crate::AppState;

/// `rest` are the segments after `interpreter`, `verb` the action of the
/// last one.
pub(super) async fn handle(
    st: AppState,
    ctx: Ctx,
    method: Method,
    id: String,
    rest: Vec<String>,
    verb: Option<String>,
    body: Bytes,
) -> ApiResult<Reply> {
    let r: Vec<&str> = rest.iter().map(String::as_str).collect();
    let not_found = || ApiError::RouteNotFound {
        method: method.to_string(),
        path: format!("/v1/sandboxes/{id}/interpreter/{}", rest.join("/")),
    };
    match (&method, r.as_slice(), verb.as_deref()) {
        (&Method::POST, [], Some("run")) => run(st, ctx, id, body).await,
        (&Method::GET, ["contexts"], None) => {
            let list = interpreter::contexts(&st, &ctx.key, &id)?;
            let data: Vec<Value> = list.iter().map(|c| c.info()).collect();
            Reply::ok(json!({ "data": data }))
        }
        (&Method::POST, ["contexts"], None) => create(st, ctx, id, body).await,
        (&Method::POST, ["contexts", c], Some(v)) => {
            no_fields(&body)?;
            let cx = interpreter::context(&st, &ctx.key, &id, c)?;
            match v {
                "restart" => {
                    interpreter::restart(&cx).await;
                    Reply::ok(cx.info())
                }
                "interrupt" => {
                    let sent = interpreter::interrupt(&cx).await;
                    Reply::ok(json!({ "id": cx.id(), "interrupted": sent }))
                }
                _ => Err(not_found()),
            }
        }
        (&Method::DELETE, ["contexts", c], None) => {
            let deleted = interpreter::delete_context(&st, &ctx.key, &id, c).await?;
            Reply::ok(json!({ "id": c, "deleted": deleted }))
        }
        (&Method::GET, ["contexts", c, "results", name], None) => {
            if ctx.key.read_only {
                return Err(ApiError::Forbidden {
                    action: "read interpreter output",
                });
            }
            Reply::ok(interpreter::result(&st, &ctx.key, &id, c, name)?)
        }
        (_, [] | ["contexts"] | ["contexts", _] | ["contexts", _, "results", _], _) => {
            Err(ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: format!("/v1/sandboxes/{id}/interpreter/{}", rest.join("/")),
            })
        }
        _ => Err(not_found()),
    }
}

fn bad_language() -> ApiError {
    ApiError::invalid(
        "language",
        format!("must be one of {}", LANGUAGES.join(", ")),
    )
}

async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let cid = f.string("id");
    let language = f.string("language");
    let cwd = f.string("cwd");
    let env = f.string_map("env", 256);
    let env = check_env(&mut f, env).unwrap_or_default();
    if let Some(c) = &cid {
        if !valid_context_id(c) {
            f.issue(
                "id",
                "must be 1-63 of [a-z0-9-], starting with a letter or digit",
            );
        }
    }
    if let Some(c) = &cwd {
        if !c.starts_with('/') {
            f.issue("cwd", "must be an absolute path");
        }
    }
    f.finish()?;
    let language = match context_language(cid.as_deref(), language.as_deref()) {
        Ok(l) => l,
        Err(LanguageIssue::Unknown) => return Err(bad_language()),
        Err(LanguageIssue::NotItsOwn { id: c, language }) => {
            return Err(ApiError::invalid(
                "id",
                format!("{c} is the default context of {c}; its language cannot be {language}"),
            ))
        }
    };
    let cmd = CreateContext {
        id: cid,
        language,
        cwd,
        env,
    };
    let cx = interpreter::create_context(&st, &ctx.key, &id, cmd).await?;
    Ok(Reply::Json(StatusCode::CREATED, cx.info()))
}

fn parse_run(body: &[u8]) -> ApiResult<RunCommand> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let code = f.string("code");
    if !f.present("code") {
        f.issue("code", "is required");
    }
    if code.as_ref().is_some_and(|c| c.len() > MAX_CODE_BYTES) {
        f.issue("code", format!("must be at most {MAX_CODE_BYTES} bytes"));
    }
    let language = f.string("language");
    let context = f.string("context");
    let timeout_ms = f.int("timeoutMs", 0, MAX_TIMEOUT_MS);
    let stream = f.bool("stream").unwrap_or(false);
    let interrupt_on_disconnect = f.bool("interruptOnDisconnect").unwrap_or(false);
    if let Some(c) = &context {
        if !valid_context_id(c) {
            f.issue(
                "context",
                "must be 1-63 of [a-z0-9-], starting with a letter or digit",
            );
        }
    }
    if !language.as_deref().is_none_or(is_language) {
        f.issue(
            "language",
            format!("must be one of {}", LANGUAGES.join(", ")),
        );
    }
    f.finish()?;
    Ok(RunCommand {
        code: code.unwrap_or_default(),
        language,
        context,
        timeout_ms: timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
        stream,
        interrupt_on_disconnect,
    })
}

async fn run(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let req = parse_run(&body)?;
    match interpreter::run(&st, &ctx.key, &id, req).await? {
        Ran::Done(exec) => Reply::ok(exec),
        Ran::Streaming(events) => {
            let lines = events.map(|e| vec![run_event(e)]);
            Ok(Reply::Raw(ndjson(lines, st.config().heartbeat)))
        }
    }
}

/// A streamed run's event as its NDJSON line.
fn run_event(e: RunEvent) -> Value {
    match e {
        RunEvent::Event(v) => v,
        RunEvent::Execution(exec) => json!({"k": "execution", "execution": exec}),
        RunEvent::Failure(e) => {
            let b = e.body("");
            json!({"k": "failure", "code": b.error.code, "message": b.error.message,
                   "hint": b.error.hint, "status": b.error.status})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_requests_are_checked() {
        assert!(matches!(bad_language(), ApiError::Invalid { .. }));
        assert!(parse_run(br#"{"code":"1","language":"cobol"}"#).is_err());
        assert!(parse_run(br#"{"language":"python"}"#).is_err());
        assert!(parse_run(br#"{"code":"1","context":"Bad"}"#).is_err());
        for l in LANGUAGES {
            let body = json!({"code": "1", "language": l}).to_string();
            assert!(parse_run(body.as_bytes()).is_ok(), "{l}");
        }
        let r = parse_run(br#"{"code":"x"}"#).ok();
        assert_eq!(r.map(|r| r.timeout_ms), Some(DEFAULT_TIMEOUT_MS));
    }

    #[test]
    fn a_failure_carries_the_errors_code_and_status() {
        let v = run_event(RunEvent::Failure(ApiError::invalid("code", "is required")));
        assert_eq!(v["k"], "failure");
        assert_eq!(v["code"], "invalid_request");
        assert_eq!(v["status"], 400);
    }
}
