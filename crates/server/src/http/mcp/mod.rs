//! MCP over Streamable HTTP at `/mcp` (protocol 2025-06-18, and the
//! 2025-03-26 and 2024-11-05 clients): JSON-RPC in a POST, answered as JSON
//! or, for a tool call when the client accepts it, as a one-answer SSE
//! stream with keep-alive comments while the tool works. `Mcp-Session-Id`
//! is given by `initialize` and ended by `DELETE`; there is no
//! server-initiated stream (`GET` is 405). The bearer key is the API's: a
//! request without a valid one is 401 with `WWW-Authenticate` naming the
//! protected-resource metadata (RFC 9728), served here too.
//!
//! Each tool call is one request through the API's own path
//! ([`api`] calls the same `serve` every API request goes through) with the
//! caller's `Authorization`, so keys, read-only keys, spending limits,
//! quotas, validation and idempotency are the API's own.

mod schema;
mod session;
mod tools;

use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::Future;
use serde_json::{json, Map, Value};
use tracing::Instrument;

use crate::error::{ApiError, ApiResult};
use crate::AppState;

pub(crate) use session::Sessions;

/// The endpoint.
pub(crate) const PATH: &str = "/mcp";
const METADATA: &str = "/.well-known/oauth-protected-resource";

/// Protocol versions answered, newest first.
const VERSIONS: &[&str] = &["2025-06-18", "2025-03-26", "2024-11-05"];
/// The largest POST body (a file write of 1 MiB in base64 fits).
const MAX_BODY: usize = 4 << 20;
/// Most messages in one batch.
const MAX_BATCH: usize = 32;
/// The largest API answer a tool reads.
const MAX_ANSWER: usize = 16 << 20;
/// What a tool result keeps of command output, in characters.
const OUTPUT_SHARE: usize = 16_000;
/// What a file read answers at once, in characters (or bytes as base64).
const FILE_SHARE: usize = 64_000;

const INSTRUCTIONS: &str = "\
Runtime runs sandboxes: Linux virtual machines with Python, Node.js, git and a compiler, \
for running code safely.

1. Create one with runtime_sandbox_create (choose an idempotencyKey first and reuse it if \
you must retry after a lost reply). Check the returned state is `running`; its `id` is what \
every runtime_sandbox_* tool takes as `id`.
2. Run commands with runtime_sandbox_exec {id, command}; check exitCode, timedOut, the \
output and the truncation flags: a tool call that succeeded does not mean the command did. \
For a server or a long job use background: true, then runtime_sandbox_process action output.
3. Write and read files with runtime_sandbox_files_write and runtime_sandbox_files_read \
(paths are relative to /workspace unless absolute); list and manage them with \
runtime_sandbox_files_list and runtime_sandbox_files_manage.
4. Share a port with runtime_sandbox_previews; keep state with runtime_sandbox_manage \
action pause (wake it, or any call wakes it).
5. When done, runtime_sandbox_manage action delete (or stop), even if a step failed.

Errors are tool results with isError: the API's error body, with a code, a message naming \
each wrong field, a hint and a requestId. Back off and retry on no_capacity or \
host_unavailable with the same idempotencyKey; do not retry unavailable or unsupported. \
A read-only key may read records, never change anything or read files and output.";

/// Whether this server answers `path` here rather than the API's routes.
pub(crate) fn is_mcp_path(path: &str) -> bool {
    path == PATH
        || path == "/mcp/"
        || path == METADATA
        || path == "/.well-known/oauth-protected-resource/mcp"
}

/// `http(s)://host` as the client reached this server.
fn origin(st: &AppState, headers: &HeaderMap) -> String {
    let scheme = if st.config().tls.is_some() {
        "https"
    } else {
        "http"
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        })
        .unwrap_or("localhost");
    format!("{scheme}://{host}")
}

pub(crate) async fn handle(st: &AppState, req: Request, rid: &str) -> ApiResult<Response> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path != PATH && path != "/mcp/" {
        if method != Method::GET {
            return Err(ApiError::MethodNotAllowed {
                method: method.to_string(),
                path,
            });
        }
        let o = origin(st, req.headers());
        return Ok(axum::Json(json!({
            "resource": format!("{o}{PATH}"),
            "resource_name": "Runtime (self-hosted)",
            "bearer_methods_supported": ["header"],
        }))
        .into_response());
    }
    let caller = match super::authenticate(st, req.headers()) {
        Ok(c) => c,
        Err(e) if e.status() == StatusCode::UNAUTHORIZED => {
            return Ok(unauthorized(st, req.headers(), e, rid))
        }
        Err(e) => return Err(e),
    };
    let key_id = caller.key.id.clone();
    match method {
        Method::POST => post(st, req, &key_id).await,
        Method::DELETE => {
            let Some(sid) = session_header(req.headers()) else {
                return Err(ApiError::invalid(
                    "Mcp-Session-Id",
                    "name the session to end",
                ));
            };
            if st.inner.mcp.close(&sid, &key_id) {
                Ok(StatusCode::NO_CONTENT.into_response())
            } else {
                Ok(rpc_status(StatusCode::NOT_FOUND, session_gone()))
            }
        }
        m => {
            let mut resp = ApiError::MethodNotAllowed {
                method: m.to_string(),
                path,
            }
            .into_response_with(rid);
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST, DELETE"));
            Ok(resp)
        }
    }
}

/// The 401, pointing at the metadata (RFC 9728 §5.1).
fn unauthorized(st: &AppState, headers: &HeaderMap, e: ApiError, rid: &str) -> Response {
    let given = super::bearer(headers).is_some();
    let mut v = format!(
        "Bearer resource_metadata=\"{}{METADATA}\"",
        origin(st, headers)
    );
    if given {
        v.push_str(", error=\"invalid_token\"");
    }
    let mut resp = e.into_response_with(rid);
    if let Ok(h) = HeaderValue::from_str(&v) {
        resp.headers_mut().insert(header::WWW_AUTHENTICATE, h);
    }
    resp
}

fn session_header(headers: &HeaderMap) -> Option<String> {
    headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn rpc_error(id: Value, code: i64, message: impl Into<String>) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message.into()}})
}

fn session_gone() -> Value {
    rpc_error(
        Value::Null,
        -32001,
        "Session not found: it ended or expired; initialize again",
    )
}

/// A JSON-RPC answer with an HTTP status of its own.
fn rpc_status(status: StatusCode, v: Value) -> Response {
    (status, axum::Json(v)).into_response()
}

fn accepts(headers: &HeaderMap, kind: &str) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains(kind))
}

async fn post(st: &AppState, req: Request, key_id: &str) -> ApiResult<Response> {
    let (parts, body) = req.into_parts();
    let bytes = super::read_body(body, MAX_BODY).await?;
    let parsed: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return Ok(rpc_status(
                StatusCode::BAD_REQUEST,
                rpc_error(Value::Null, -32700, format!("Parse error: {e}")),
            ))
        }
    };
    let (messages, batch) = match parsed {
        Value::Array(a) if a.is_empty() || a.len() > MAX_BATCH => {
            return Ok(rpc_status(
                StatusCode::BAD_REQUEST,
                rpc_error(
                    Value::Null,
                    -32600,
                    format!("Invalid Request: a batch holds 1 to {MAX_BATCH} messages"),
                ),
            ))
        }
        Value::Array(a) => (a, true),
        v => (vec![v], false),
    };
    if let Some(v) = parts
        .headers
        .get("mcp-protocol-version")
        .and_then(|v| v.to_str().ok())
    {
        if !VERSIONS.contains(&v) {
            return Ok(rpc_status(
                StatusCode::BAD_REQUEST,
                rpc_error(
                    Value::Null,
                    -32600,
                    format!(
                        "Bad Request: MCP-Protocol-Version {v} is not one of {}",
                        VERSIONS.join(", ")
                    ),
                ),
            ));
        }
    }
    let initialize = messages
        .iter()
        .any(|m| m.get("method").and_then(Value::as_str) == Some("initialize"));
    let mut new_session = None;
    if initialize {
        if batch {
            return Ok(rpc_status(
                StatusCode::BAD_REQUEST,
                rpc_error(
                    Value::Null,
                    -32600,
                    "Invalid Request: initialize is sent alone, not in a batch",
                ),
            ));
        }
    } else {
        match session_header(&parts.headers) {
            None => {
                return Ok(rpc_status(
                    StatusCode::BAD_REQUEST,
                    rpc_error(
                        Value::Null,
                        -32600,
                        "Bad Request: no Mcp-Session-Id header; send initialize first",
                    ),
                ))
            }
            Some(sid) if !st.inner.mcp.touch(&sid, key_id) => {
                return Ok(rpc_status(StatusCode::NOT_FOUND, session_gone()))
            }
            Some(_) => {}
        }
    }
    let auth = parts.headers.get(header::AUTHORIZATION).cloned();
    let has_requests = messages
        .iter()
        .any(|m| m.get("method").is_some() && m.get("id").is_some());
    if !has_requests {
        // Notifications and client answers: nothing to say.
        for m in &messages {
            if m.get("method").is_none() && m.get("result").is_none() && m.get("error").is_none() {
                return Ok(rpc_status(
                    StatusCode::BAD_REQUEST,
                    rpc_error(Value::Null, -32600, "Invalid Request"),
                ));
            }
        }
        return Ok(StatusCode::ACCEPTED.into_response());
    }
    if initialize {
        new_session = Some(st.inner.mcp.open(key_id));
    }
    let calls_tool = messages
        .iter()
        .any(|m| m.get("method").and_then(Value::as_str) == Some("tools/call"));
    let sse = accepts(&parts.headers, "text/event-stream")
        && (calls_tool || !accepts(&parts.headers, "application/json"));
    let st2 = st.clone();
    let work = async move {
        let mut out = Vec::new();
        for m in messages {
            if let Some(a) = answer(&st2, auth.as_ref(), m).await {
                out.push(a);
            }
        }
        out
    };
    let mut resp = if sse {
        let mut r = Response::new(sse_body(Box::pin(work), st.config().heartbeat));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        let mut out = work.await;
        let v = if batch {
            Value::Array(out)
        } else {
            out.pop().unwrap_or(Value::Null)
        };
        axum::Json(v).into_response()
    };
    if let Some(sid) = new_session.and_then(|s| HeaderValue::from_str(&s).ok()) {
        resp.headers_mut().insert("mcp-session-id", sid);
    }
    Ok(resp)
}

type Work = Pin<Box<dyn Future<Output = Vec<Value>> + Send>>;

/// The answers as SSE `message` events once ready, with a comment every
/// `every` until then so that proxies and clients keep the stream open.
/// A client that hangs up drops the work; changes the API began run on in
/// their own tasks, as for any API client.
fn sse_body(work: Work, every: Duration) -> Body {
    enum S {
        Working(Work, tokio::time::Interval),
        Done,
    }
    let every = every.max(Duration::from_millis(100));
    let iv = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let stream = futures::stream::unfold(S::Working(work, iv), |s| async move {
        match s {
            S::Done => None,
            S::Working(mut work, mut iv) => {
                tokio::select! {
                    out = &mut work => {
                        let mut text = String::new();
                        for v in out {
                            text.push_str("event: message\ndata: ");
                            text.push_str(&v.to_string());
                            text.push_str("\n\n");
                        }
                        Some((Ok::<_, Infallible>(Bytes::from(text)), S::Done))
                    }
                    _ = iv.tick() => Some((Ok(Bytes::from_static(b": keep-alive\n\n")), S::Working(work, iv))),
                }
            }
        }
    });
    Body::from_stream(stream)
}

/// The answer to one message: `None` for notifications and answers.
async fn answer(st: &AppState, auth: Option<&HeaderValue>, m: Value) -> Option<Value> {
    let Value::Object(m) = m else {
        return Some(rpc_error(
            Value::Null,
            -32600,
            "Invalid Request: not an object",
        ));
    };
    let id = m.get("id").cloned();
    let method = m.get("method").and_then(Value::as_str);
    let id_ok = matches!(id, Some(Value::String(_) | Value::Number(_)));
    if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0")
        || (id.is_some() && !id_ok)
        || (method.is_none() && id.is_none())
    {
        return Some(rpc_error(
            if id_ok { id.unwrap_or(Value::Null) } else { Value::Null },
            -32600,
            "Invalid Request: jsonrpc must be \"2.0\", with a method, and an id that is a string or a number",
        ));
    }
    let (Some(method), Some(id)) = (method, id) else {
        // A notification, or an answer to a request we never sent.
        return None;
    };
    let params = m.get("params");
    if params.is_some_and(|p| !p.is_object()) {
        return Some(rpc_error(
            id,
            -32602,
            "Invalid params: params must be an object",
        ));
    }
    let result = match method {
        "initialize" => {
            let version = params
                .and_then(|p| p.get("protocolVersion"))
                .and_then(Value::as_str)
                .filter(|v| VERSIONS.contains(v))
                .unwrap_or(VERSIONS[0]);
            json!({
                "protocolVersion": version,
                "capabilities": {"tools": {"listChanged": false}},
                "serverInfo": {
                    "name": "runtime",
                    "title": "Runtime (self-hosted)",
                    "version": env!("CARGO_PKG_VERSION"),
                },
                "instructions": INSTRUCTIONS,
            })
        }
        "ping" => json!({}),
        "tools/list" => tools::list(),
        "tools/call" => {
            let name = params.and_then(|p| p.get("name")).and_then(Value::as_str);
            let Some(name) = name else {
                return Some(rpc_error(
                    id,
                    -32602,
                    "Invalid params: name the tool in params.name",
                ));
            };
            let Some(tool) = tools::find(name) else {
                return Some(rpc_error(id, -32602, format!("Unknown tool: {name}")));
            };
            call_tool(st, auth, tool, params.and_then(|p| p.get("arguments"))).await
        }
        other => return Some(rpc_error(id, -32601, format!("Method not found: {other}"))),
    };
    Some(json!({"jsonrpc": "2.0", "id": id, "result": result}))
}

fn new_rid() -> String {
    format!("req_{}", uuid::Uuid::new_v4().simple())
}

/// A tool result holding `v` (an object) as text and as structured content.
fn tool_result(v: Value, is_error: bool, mut extra: Vec<Value>) -> Value {
    let structured = match v {
        Value::Object(_) => v,
        other => json!({ "result": other }),
    };
    let mut content = vec![json!({"type": "text", "text": structured.to_string()})];
    content.append(&mut extra);
    json!({"content": content, "structuredContent": structured, "isError": is_error})
}

async fn call_tool(
    st: &AppState,
    auth: Option<&HeaderValue>,
    tool: &tools::Tool,
    args: Option<&Value>,
) -> Value {
    let plan = schema::check(tool.args, args).and_then(|a| tools::plan(tool, &a));
    let call = match plan {
        Ok(c) => c,
        Err(issues) => {
            let body = ApiError::Invalid { issues }.body(&new_rid());
            let v = serde_json::to_value(body).unwrap_or(Value::Null);
            return tool_result(v, true, Vec::new());
        }
    };
    let shape = call.shape;
    match api(st, auth, call).await {
        Answer::Failed(v) => tool_result(v, true, Vec::new()),
        Answer::Json(v) => shape_json(v, shape),
        Answer::Bytes(b) => match shape {
            tools::Shape::File { start, end } => {
                tool_result(file_text(&b, start, end), false, Vec::new())
            }
            _ => tool_result(
                json!({"text": cut_text(&String::from_utf8_lossy(&b), FILE_SHARE).0}),
                false,
                Vec::new(),
            ),
        },
    }
}

/// What the API answered.
enum Answer {
    Json(Value),
    Bytes(Bytes),
    /// The error body.
    Failed(Value),
}

/// One request through the API's own path, as the caller.
async fn api(st: &AppState, auth: Option<&HeaderValue>, call: tools::Call) -> Answer {
    let rid = new_rid();
    let mut b = axum::http::Request::builder()
        .method(call.method.clone())
        .uri(call.uri());
    if let Some(a) = auth {
        b = b.header(header::AUTHORIZATION, a.clone());
    }
    if let Some(k) = &call.idem {
        b = b.header("idempotency-key", k.as_str());
    }
    if call.settle {
        b = b.header("prefer", "wait=60");
    }
    if call.accept_json {
        b = b.header(header::ACCEPT, "application/json");
    }
    let body = match call.body {
        tools::Payload::None => Body::empty(),
        tools::Payload::Json(v) => {
            b = b.header(header::CONTENT_TYPE, "application/json");
            Body::from(v.to_string())
        }
        tools::Payload::Bytes(d) => {
            b = b.header(header::CONTENT_TYPE, "application/octet-stream");
            Body::from(d)
        }
    };
    let req = match b.body(body) {
        Ok(r) => r,
        Err(e) => {
            let err = ApiError::Internal {
                what: format!("building an MCP tool's request: {e}"),
            };
            return Answer::Failed(serde_json::to_value(err.body(&rid)).unwrap_or(Value::Null));
        }
    };
    let span = tracing::info_span!("request", request_id = %rid, method = %call.method, path = %call.path, via = "mcp");
    // A tool's call is an API answer of its key, counted as one.
    let mut counted = None;
    let resp = async {
        match super::serve(st, req, &rid, &mut None, &mut counted).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "request refused");
                e.into_response_with(&rid)
            }
        }
    }
    .instrument(span)
    .await;
    let status = resp.status();
    if let Some((key_id, operation)) = counted {
        st.inner
            .requests
            .record(st.now_ms(), &key_id, operation, status.as_u16());
    }
    let late = resp.headers().contains_key("runtime-late-answer");
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    let bytes = match axum::body::to_bytes(resp.into_body(), MAX_ANSWER).await {
        Ok(b) => b,
        Err(_) => {
            let err = ApiError::PayloadTooLarge { limit: MAX_ANSWER };
            return Answer::Failed(serde_json::to_value(err.body(&rid)).unwrap_or(Value::Null));
        }
    };
    if !json && status.is_success() && !late {
        return Answer::Bytes(bytes);
    }
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let is_error_body = v.pointer("/error/code").is_some() && v.pointer("/error/status").is_some();
    if !status.is_success() || (late && is_error_body) {
        return Answer::Failed(v);
    }
    Answer::Json(v)
}

fn shape_json(mut v: Value, shape: tools::Shape) -> Value {
    match shape {
        tools::Shape::Exec => {
            cut_streams(&mut v, &["stdout", "stderr"]);
            tool_result(v, false, Vec::new())
        }
        tools::Shape::Output => {
            cut_chunks(&mut v);
            tool_result(v, false, Vec::new())
        }
        tools::Shape::Interpreter => {
            cut_streams(&mut v, &["stdout", "stderr"]);
            let images = take_images(&mut v);
            tool_result(v, false, images)
        }
        _ => tool_result(v, false, Vec::new()),
    }
}

/// `s` kept to `budget` characters: its first line (up to half) and its
/// end, with a marker between; and how many characters were cut.
fn cut_text(s: &str, budget: usize) -> (String, usize) {
    let n = s.chars().count();
    if n <= budget {
        return (s.to_string(), 0);
    }
    let head: String = s
        .split_inclusive('\n')
        .next()
        .unwrap_or("")
        .chars()
        .take(budget / 2)
        .collect();
    let head_n = head.chars().count();
    let tail_n = budget.saturating_sub(head_n);
    let cut = n - head_n - tail_n;
    let tail: String = s.chars().skip(n - tail_n).collect();
    (format!("{head}\n[… {cut} characters cut …]\n{tail}"), cut)
}

/// The streams of `v` kept to [`OUTPUT_SHARE`] characters in all (a short
/// stream leaves its share to the others), with `outputCut` counting what
/// each lost.
fn cut_streams(v: &mut Value, fields: &[&str]) {
    let mut lens: Vec<(&str, usize)> = fields
        .iter()
        .map(|f| (*f, v[*f].as_str().map_or(0, |s| s.chars().count())))
        .collect();
    if lens.iter().map(|(_, n)| n).sum::<usize>() <= OUTPUT_SHARE {
        return;
    }
    lens.sort_by_key(|(_, n)| *n);
    let mut left = OUTPUT_SHARE;
    let mut cut = Map::new();
    let count = lens.len();
    for (i, (f, n)) in lens.into_iter().enumerate() {
        let share = left / (count - i);
        let keep = n.min(share);
        left -= keep;
        if keep < n {
            if let Some(s) = v[f].as_str() {
                let (kept, c) = cut_text(s, keep);
                v[f] = Value::String(kept);
                cut.insert(f.to_string(), json!(c));
            }
        }
    }
    v["outputCut"] = Value::Object(cut);
}

/// A process's output chunks kept to [`OUTPUT_SHARE`] characters; when cut,
/// `nextCursor` is where the next read starts.
fn cut_chunks(v: &mut Value) {
    let Some(chunks) = v.get_mut("chunks").and_then(Value::as_array_mut) else {
        return;
    };
    let mut left = OUTPUT_SHARE;
    let mut next = None;
    let mut keep = chunks.len();
    for (i, c) in chunks.iter_mut().enumerate() {
        let text = c["text"].as_str().unwrap_or("").to_string();
        let n = text.chars().count();
        if n <= left {
            left -= n;
            continue;
        }
        let head: String = text.chars().take(left).collect();
        let offset = c["offset"].as_u64().unwrap_or(0);
        next = Some(offset + head.len() as u64);
        if head.is_empty() {
            keep = i;
        } else {
            c["text"] = Value::String(head);
            keep = i + 1;
        }
        break;
    }
    if let Some(n) = next {
        chunks.truncate(keep);
        v["nextCursor"] = json!(n);
        v["more"] = json!(true);
        v["note"] = json!(format!(
            "Output past {OUTPUT_SHARE} characters is left for the next read from nextCursor."
        ));
    }
}

/// PNG results of the interpreter as MCP image content (up to 4), their
/// data replaced by a note in the JSON.
fn take_images(v: &mut Value) -> Vec<Value> {
    let mut out = Vec::new();
    if let Some(results) = v.get_mut("results").and_then(Value::as_array_mut) {
        for r in results {
            if let Some(png) = r.pointer_mut("/data/image~1png") {
                if let Some(data) = png.as_str().filter(|d| d.len() <= 2 << 20) {
                    if out.len() < 4 {
                        out.push(json!({"type": "image", "data": data, "mimeType": "image/png"}));
                        *png = json!(format!("[image content {}]", out.len()));
                        continue;
                    }
                }
                *png = json!("[image not shown: too large or too many]");
            }
        }
    }
    out
}

/// A file's bytes as the read tool answers them: text lines from `start`
/// to `end` (1-based, inclusive), or base64 when not UTF-8; at most
/// [`FILE_SHARE`] characters, cut at a line with `nextLine` to go on from.
fn file_text(b: &[u8], start: Option<usize>, end: Option<usize>) -> Value {
    let size = b.len();
    let Ok(text) = std::str::from_utf8(b) else {
        let share = FILE_SHARE / 4 * 3;
        let part = &b[..size.min(share)];
        return json!({
            "size": size,
            "encoding": "base64",
            "content": base64::engine::general_purpose::STANDARD.encode(part),
            "truncated": size > share,
        });
    };
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let total = lines.len();
    let first = start.unwrap_or(1).max(1);
    let last = end.unwrap_or(total).min(total);
    let mut content = String::new();
    let mut next_line = None;
    let mut shown_last = first.saturating_sub(1);
    for (i, l) in lines.iter().enumerate().take(last).skip(first - 1) {
        if content.len() + l.len() > FILE_SHARE {
            if content.is_empty() {
                content.push_str(&cut_text(l, FILE_SHARE).0);
                shown_last = i + 1;
                next_line = (i + 2 <= last).then_some(i + 2);
            } else {
                next_line = Some(i + 1);
            }
            break;
        }
        content.push_str(l);
        shown_last = i + 1;
    }
    let mut v = json!({
        "size": size,
        "encoding": "utf-8",
        "content": content,
        "totalLines": total,
        "startLine": first,
        "endLine": shown_last,
        "truncated": next_line.is_some(),
    });
    if let Some(n) = next_line {
        v["nextLine"] = json!(n);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_long_output_keeps_its_first_line_and_end() {
        let mut v =
            json!({"stdout": format!("first\n{}END", "x".repeat(40_000)), "stderr": "oops"});
        cut_streams(&mut v, &["stdout", "stderr"]);
        let out = v["stdout"].as_str().unwrap();
        assert!(out.starts_with("first\n"));
        assert!(out.ends_with("END"));
        assert_eq!(v["stderr"], "oops");
        let cut = v["outputCut"]["stdout"].as_u64().unwrap();
        assert_eq!(cut as usize, 40_009 - (OUTPUT_SHARE - 4));
        let mut short = json!({"stdout": "a", "stderr": "b"});
        cut_streams(&mut short, &["stdout", "stderr"]);
        assert!(short.get("outputCut").is_none());
    }

    #[test]
    fn mcp_file_reads_by_line() {
        let v = file_text(b"one\ntwo\nthree\n", Some(2), Some(3));
        assert_eq!(v["content"], "two\nthree\n");
        assert_eq!(v["totalLines"], 3);
        assert_eq!(v["endLine"], 3);
        assert_eq!(v["truncated"], false);
        let big = "y".repeat(100) + "\n";
        let text = big.repeat(1000);
        let v = file_text(text.as_bytes(), None, None);
        assert_eq!(v["truncated"], true);
        assert_eq!(v["nextLine"], FILE_SHARE / 101 + 1);
        let v = file_text(&[0xff, 0xfe], None, None);
        assert_eq!(v["encoding"], "base64");
    }

    #[test]
    fn mcp_output_chunks_stop_at_the_share() {
        let mut v = json!({"chunks": [
            {"stream": "stdout", "text": "a".repeat(OUTPUT_SHARE - 10), "offset": 0},
            {"stream": "stdout", "text": "b".repeat(100), "offset": OUTPUT_SHARE - 10},
        ], "nextCursor": OUTPUT_SHARE + 90});
        cut_chunks(&mut v);
        assert_eq!(v["nextCursor"], OUTPUT_SHARE);
        assert_eq!(v["chunks"][1]["text"], "b".repeat(10));
    }
}
