//! MCP at `/mcp` through the router, against a fake host: the 401 and the
//! protected-resource metadata, sessions, `initialize`, the tools' schemas,
//! the API's checks shared (read-only keys, validation), bad arguments
//! named field by field, JSON-RPC errors, and an SSE answer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use fake::{FakeHost, Step};
use http_body_util::BodyExt;
use runtime_server::{create_key, ensure_admin_key, open_store, router, AppState, Config};
use serde_json::{json, Value};
use tower::ServiceExt;

struct T {
    dir: PathBuf,
    host: Arc<FakeHost>,
    state: AppState,
    admin: String,
}

impl T {
    fn new() -> T {
        let dir = std::env::temp_dir().join(format!("rt-mcp-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let host = Arc::new(FakeHost::default());
        let store = open_store(&dir).unwrap();
        let state = AppState::new(Config::new(&dir), store, host.clone());
        T {
            dir,
            host,
            state,
            admin,
        }
    }

    async fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (StatusCode, HeaderMap, String) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "mcp.test:8080");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = router(self.state.clone())
            .oneshot(b.body(Body::from(body.to_string())).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    /// A POST of one message as `key` in `session`.
    async fn rpc(
        &self,
        key: &str,
        session: Option<&str>,
        msg: Value,
    ) -> (StatusCode, HeaderMap, Value) {
        let auth = format!("Bearer {key}");
        let mut h = vec![
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
            ("accept", "application/json"),
        ];
        if let Some(s) = session {
            h.push(("mcp-session-id", s));
        }
        let (s, hd, body) = self.raw("POST", "/mcp", &h, &msg.to_string()).await;
        (s, hd, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// A session for `key`, initialized.
    async fn session(&self, key: &str) -> String {
        let (s, h, v) = self
            .rpc(
                key,
                None,
                json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "test", "version": "1"}}}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let sid = h["mcp-session-id"].to_str().unwrap().to_string();
        let (s, _, _) = self
            .rpc(
                key,
                Some(&sid),
                json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED);
        sid
    }

    /// A tool call's result.
    async fn tool(&self, key: &str, sid: &str, name: &str, args: Value) -> Value {
        let (s, _, v) = self
            .rpc(
                key,
                Some(sid),
                json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                       "params": {"name": name, "arguments": args}}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["id"], 9);
        let r = v["result"].clone();
        assert!(r.is_object(), "{v}");
        // The text is the structured content, as JSON.
        let text: Value = serde_json::from_str(r["content"][0]["text"].as_str().unwrap()).unwrap();
        assert_eq!(text, r["structuredContent"]);
        r
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn mcp_without_a_key_is_401_pointing_at_the_metadata() {
    let t = T::new();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}).to_string();
    let (s, h, body) = t.raw("POST", "/mcp", &[], &init).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(
        h["www-authenticate"],
        "Bearer resource_metadata=\"http://mcp.test:8080/.well-known/oauth-protected-resource\""
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "unauthorized");
    assert!(v["error"]["requestId"]
        .as_str()
        .unwrap()
        .starts_with("req_"));

    let (s, h, _) = t
        .raw(
            "POST",
            "/mcp",
            &[("authorization", "Bearer rtcloud_nope")],
            &init,
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(h["www-authenticate"]
        .to_str()
        .unwrap()
        .ends_with(", error=\"invalid_token\""));

    for path in [
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ] {
        let (s, _, body) = t.raw("GET", path, &[], "").await;
        assert_eq!(s, StatusCode::OK, "{path}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["resource"], "http://mcp.test:8080/mcp");
        assert_eq!(v["bearer_methods_supported"], json!(["header"]));
        assert!(v.get("authorization_servers").is_none());
    }
}

#[tokio::test]
async fn mcp_initialize_gives_a_session_instructions_and_tools() {
    let t = T::new();
    let (s, h, v) = t
        .rpc(
            &t.admin,
            None,
            json!({"jsonrpc": "2.0", "id": "a", "method": "initialize", "params": {
                "protocolVersion": "2025-03-26", "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"}}}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["id"], "a");
    let r = &v["result"];
    assert_eq!(r["protocolVersion"], "2025-03-26");
    assert_eq!(r["serverInfo"]["name"], "runtime");
    assert!(r["capabilities"]["tools"].is_object());
    let instructions = r["instructions"].as_str().unwrap();
    for needle in [
        "runtime_sandbox_create",
        "runtime_sandbox_exec",
        "delete",
        "idempotencyKey",
    ] {
        assert!(instructions.contains(needle), "{needle}");
    }
    let sid = h["mcp-session-id"].to_str().unwrap().to_string();
    assert!(sid.starts_with("mcp_"));

    // A version this server does not speak gets its newest.
    let (_, _, v) = t
        .rpc(
            &t.admin,
            None,
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                   "params": {"protocolVersion": "1999-01-01"}}),
        )
        .await;
    assert_eq!(v["result"]["protocolVersion"], "2025-06-18");

    let (s, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let tools = v["result"]["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    for want in [
        "runtime_sandbox_create",
        "runtime_sandbox_list",
        "runtime_sandbox_manage",
        "runtime_sandbox_exec",
        "runtime_sandbox_process",
        "runtime_sandbox_files_read",
        "runtime_sandbox_files_write",
        "runtime_sandbox_files_list",
        "runtime_sandbox_files_manage",
        "runtime_sandbox_files_watch",
        "runtime_sandbox_interpreter_run",
        "runtime_sandbox_fork",
        "runtime_snapshot",
        "runtime_sandbox_previews",
        "runtime_sandbox_network",
        "runtime_image",
        "runtime_volume",
        "runtime_sandbox_metrics",
        "runtime_events_list",
        "runtime_account",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for tool in tools {
        let s = &tool["inputSchema"];
        assert_eq!(s["type"], "object", "{}", tool["name"]);
        assert_eq!(s["additionalProperties"], false);
        assert!(tool["description"].as_str().unwrap().len() > 10);
        for hint in ["readOnlyHint", "destructiveHint", "idempotentHint"] {
            assert!(
                tool["annotations"][hint].is_boolean(),
                "{} {hint}",
                tool["name"]
            );
        }
    }
    let by = |n: &str| tools.iter().find(|t| t["name"] == n).unwrap();
    let exec = by("runtime_sandbox_exec");
    assert_eq!(exec["inputSchema"]["required"], json!(["id", "command"]));
    assert_eq!(exec["annotations"]["readOnlyHint"], false);
    assert_eq!(
        by("runtime_sandbox_list")["annotations"]["readOnlyHint"],
        true
    );
    assert_eq!(
        by("runtime_sandbox_manage")["annotations"]["destructiveHint"],
        true
    );
    assert_eq!(
        by("runtime_sandbox_manage")["inputSchema"]["properties"]["action"]["enum"],
        json!(["get", "stop", "pause", "wake", "extend", "restart", "update", "delete"])
    );

    let (s, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "2.0", "id": 3, "method": "ping"}),
        )
        .await;
    assert_eq!((s, v["result"].clone()), (StatusCode::OK, json!({})));
}

#[tokio::test]
async fn mcp_sessions_are_needed_owned_and_ended() {
    let t = T::new();
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    let (s, _, v) = t.rpc(&t.admin, None, list.clone()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["code"], -32600);
    let (s, _, v) = t.rpc(&t.admin, Some("mcp_nope"), list.clone()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], -32001);

    let sid = t.session(&t.admin).await;
    // Another key cannot use it.
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let (s, _, _) = t.rpc(&other, Some(&sid), list.clone()).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let auth = format!("Bearer {}", t.admin);
    let (s, h, _) = t.raw("GET", "/mcp", &[("authorization", &auth)], "").await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(h["allow"], "POST, DELETE");
    let (s, _, _) = t
        .raw(
            "DELETE",
            "/mcp",
            &[("authorization", &auth), ("mcp-session-id", &sid)],
            "",
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, _) = t.rpc(&t.admin, Some(&sid), list).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "an ended session is gone");
}

#[tokio::test]
async fn mcp_json_rpc_errors_have_their_codes() {
    let t = T::new();
    let sid = t.session(&t.admin).await;
    let (_, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "2.0", "id": 1, "method": "resources/read"}),
        )
        .await;
    assert_eq!(v["error"]["code"], -32601);
    assert_eq!(v["id"], 1);
    let (_, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                   "params": {"name": "runtime_teleport", "arguments": {}}}),
        )
        .await;
    assert_eq!(v["error"]["code"], -32602);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("runtime_teleport"));
    let (_, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": []}),
        )
        .await;
    assert_eq!(v["error"]["code"], -32602);
    let (_, _, v) = t
        .rpc(
            &t.admin,
            Some(&sid),
            json!({"jsonrpc": "1.0", "id": 4, "method": "ping"}),
        )
        .await;
    assert_eq!(v["error"]["code"], -32600);

    let auth = format!("Bearer {}", t.admin);
    let (s, _, body) = t
        .raw(
            "POST",
            "/mcp",
            &[("authorization", &auth), ("mcp-session-id", &sid)],
            "{not json",
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], -32700);
    assert_eq!(v["id"], Value::Null);

    // A batch answers each request in order.
    let (s, _, body) = t
        .raw(
            "POST",
            "/mcp",
            &[("authorization", &auth), ("mcp-session-id", &sid)],
            &json!([
                {"jsonrpc": "2.0", "id": 1, "method": "ping"},
                {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 0}},
                {"jsonrpc": "2.0", "id": 2, "method": "nope"},
            ])
            .to_string(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v[0]["id"], 1);
    assert_eq!(v[1]["error"]["code"], -32601);
    assert_eq!(v.as_array().unwrap().len(), 2);

    let big = "x".repeat(5 << 20);
    let (s, _, body) = t
        .raw(
            "POST",
            "/mcp",
            &[("authorization", &auth), ("mcp-session-id", &sid)],
            &big,
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
}

#[tokio::test]
async fn mcp_bad_arguments_name_each_field() {
    let t = T::new();
    let sid = t.session(&t.admin).await;
    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_exec",
            json!({"id": 5, "commnd": "ls", "timeoutMs": "soon"}),
        )
        .await;
    assert_eq!(r["isError"], true);
    let e = &r["structuredContent"]["error"];
    assert_eq!(e["code"], "invalid_request");
    assert_eq!(e["status"], 400);
    assert_eq!(
        e["message"],
        "Invalid request: command, commnd, id, timeoutMs."
    );
    let issues: Vec<(String, String)> = e["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["field"].as_str().unwrap().to_string(),
                i["message"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        issues,
        vec![
            ("command".into(), "is required".into()),
            ("commnd".into(), "unknown field".into()),
            ("id".into(), "must be a string".into()),
            ("timeoutMs".into(), "must be an integer".into()),
        ]
    );

    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_manage",
            json!({"id": "s", "action": "pause", "seconds": 60}),
        )
        .await;
    assert_eq!(
        r["structuredContent"]["error"]["details"]["issues"],
        json!([{"field": "seconds", "message": "is not used by action pause"}])
    );

    // What the API validates comes back as the API says it.
    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_create",
            json!({"vcpu": 99, "memoryMiB": 1}),
        )
        .await;
    assert_eq!(r["isError"], true);
    let e = &r["structuredContent"]["error"];
    assert_eq!(e["code"], "invalid_request");
    let fields: Vec<&str> = e["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, vec!["vcpu", "memoryMiB"]);
}

#[tokio::test]
async fn mcp_tools_share_the_apis_checks() {
    let t = T::new();
    let sid = t.session(&t.admin).await;
    t.host
        .script("echo hi", vec![Step::Out(b"hi\n".to_vec()), Step::Exit(0)]);
    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_create",
            json!({"name": "mcp-one", "idempotencyKey": "create-1"}),
        )
        .await;
    assert_eq!(r["isError"], false, "{r}");
    let sbx = r["structuredContent"]["id"].as_str().unwrap().to_string();
    assert_eq!(r["structuredContent"]["state"], "running");
    // The same key and input is the same sandbox.
    let again = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_create",
            json!({"name": "mcp-one", "idempotencyKey": "create-1"}),
        )
        .await;
    assert_eq!(again["structuredContent"]["id"], sbx.as_str());

    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_exec",
            json!({"id": sbx, "command": "echo hi"}),
        )
        .await;
    assert_eq!(r["isError"], false, "{r}");
    assert_eq!(r["structuredContent"]["exitCode"], 0);
    assert_eq!(r["structuredContent"]["stdout"], "hi\n");

    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_files_write",
            json!({"id": sbx, "path": "/workspace/a.txt", "content": "one\ntwo\nthree\n"}),
        )
        .await;
    assert_eq!(r["isError"], false, "{r}");
    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_files_read",
            json!({"id": sbx, "path": "/workspace/a.txt", "startLine": 2}),
        )
        .await;
    assert_eq!(r["structuredContent"]["content"], "two\nthree\n");

    // A read-only key may list, never change or read contents.
    let ro = create_key(&t.dir, Some("ro"), true, true).unwrap();
    let ro_sid = t.session(&ro).await;
    let r = t
        .tool(&ro, &ro_sid, "runtime_sandbox_list", json!({}))
        .await;
    assert_eq!(r["isError"], false, "{r}");
    let ids: Vec<&str> = r["structuredContent"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![sbx.as_str()]);
    for (tool, args) in [
        ("runtime_sandbox_create", json!({})),
        (
            "runtime_sandbox_exec",
            json!({"id": sbx, "command": "echo hi"}),
        ),
        (
            "runtime_sandbox_manage",
            json!({"id": sbx, "action": "delete"}),
        ),
        (
            "runtime_sandbox_files_read",
            json!({"id": sbx, "path": "/workspace/a.txt"}),
        ),
    ] {
        let r = t.tool(&ro, &ro_sid, tool, args).await;
        assert_eq!(r["isError"], true, "{tool}");
        let e = &r["structuredContent"]["error"];
        assert_eq!(e["code"], "forbidden", "{tool}");
        assert_eq!(e["status"], 403, "{tool}");
    }

    // Another key's sandbox does not exist for it.
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let osid = t.session(&other).await;
    let r = t
        .tool(
            &other,
            &osid,
            "runtime_sandbox_manage",
            json!({"id": sbx, "action": "get"}),
        )
        .await;
    assert_eq!(r["structuredContent"]["error"]["status"], 404);

    let r = t
        .tool(
            &t.admin,
            &sid,
            "runtime_sandbox_manage",
            json!({"id": sbx, "action": "delete"}),
        )
        .await;
    assert_eq!(r["isError"], false, "{r}");
    let r = t
        .tool(&t.admin, &sid, "runtime_sandbox_list", json!({"id": sbx}))
        .await;
    assert_eq!(r["structuredContent"]["error"]["status"], 404);
}

#[tokio::test]
async fn mcp_tool_calls_answer_as_sse_when_accepted() {
    let t = T::new();
    let sid = t.session(&t.admin).await;
    let auth = format!("Bearer {}", t.admin);
    let (s, h, body) = t
        .raw(
            "POST",
            "/mcp",
            &[
                ("authorization", &auth),
                ("mcp-session-id", &sid),
                ("mcp-protocol-version", "2025-06-18"),
                ("accept", "application/json, text/event-stream"),
            ],
            &json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                    "params": {"name": "runtime_account", "arguments": {"action": "get"}}})
            .to_string(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "text/event-stream");
    let data = body.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    let v: Value = serde_json::from_str(data).unwrap();
    assert_eq!(v["id"], 5);
    assert_eq!(v["result"]["isError"], false, "{v}");
    assert!(body.starts_with("event: message\n"));

    let (s, _, _) = t
        .raw(
            "POST",
            "/mcp",
            &[
                ("authorization", &auth),
                ("mcp-session-id", &sid),
                ("mcp-protocol-version", "1999-01-01"),
            ],
            &json!({"jsonrpc": "2.0", "id": 6, "method": "ping"}).to_string(),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}
