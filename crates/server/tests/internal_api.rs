//! `http://runtime.internal` as the server answers it: each connection the
//! host's proxy hands over (here a duplex stream, as the proxy's) goes
//! through the same router, with the key it carries, the sandbox as its
//! peer and `runtime.internal` as its host.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::sync::Arc;
use std::time::Duration;

use fake::FakeHost;
use runtime_server::{create_key, ensure_admin_key, in_sandbox_api, open_store, AppState, Config};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct T {
    dir: std::path::PathBuf,
    state: AppState,
    admin: String,
}

fn t() -> T {
    let dir = std::env::temp_dir().join(format!("rt-internal-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = ensure_admin_key(&dir).unwrap().unwrap();
    let config = Config::new(&dir);
    let store = open_store(&dir).unwrap();
    let state = AppState::new(config, store, Arc::new(FakeHost::default()));
    T { dir, state, admin }
}

/// One request on a new connection from `sandbox`: status, head, body.
async fn ask(t: &T, sandbox: &str, request: &str) -> (u16, String, String) {
    let (mut guest, ours) = tokio::io::duplex(64 * 1024);
    in_sandbox_api(&t.state).serve(sandbox, ours);
    guest.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), guest.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

fn get(path: &str, key: Option<&str>, host: &str) -> String {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")
}

fn json_of(body: &str) -> Value {
    // The answer may be chunked: the JSON is the line that starts with `{`.
    let line = body
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON in {body:?}"));
    serde_json::from_str(line).unwrap()
}

#[tokio::test]
async fn the_key_the_request_carries_is_who_asks() {
    let t = t();
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let (status, head, body) = ask(
        &t,
        "sbx-1",
        &get("/v1/me", Some(&other), "runtime.internal"),
    )
    .await;
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase().contains("x-request-id: req_"),
        "{head}"
    );
    let me = json_of(&body);
    assert_eq!(me["credentialName"], "other", "{me}");
    assert_eq!(me["role"], "developer", "{me}");
    let (status, _, body) = ask(
        &t,
        "sbx-1",
        &get("/v1/me", Some(&t.admin), "runtime.internal"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["role"], "admin", "{body}");
    // No key, or a wrong one: 401 in the one error shape.
    for key in [None, Some("rt_wrong")] {
        let (status, _, body) = ask(&t, "sbx-1", &get("/v1/me", key, "runtime.internal")).await;
        assert_eq!(status, 401, "{body}");
        assert!(json_of(&body)["error"]["code"].is_string(), "{body}");
    }
}

#[tokio::test]
async fn only_v1_and_mcp_are_served_and_the_host_header_is_ignored() {
    let t = t();
    for path in ["/", "/login/abc", "/console"] {
        let (status, _, body) =
            ask(&t, "sbx-1", &get(path, Some(&t.admin), "runtime.internal")).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(json_of(&body)["error"]["code"], "route_not_found", "{body}");
    }
    // A Host naming a preview reaches the API, not the preview.
    let (status, _, body) = ask(
        &t,
        "sbx-1",
        &get("/v1/me", Some(&t.admin), "8080-sbx-other.localhost"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body)["role"], "admin", "{body}");
}

#[tokio::test]
async fn the_environment_names_the_sandbox_that_asks_and_needs_no_key() {
    let t = t();
    for id in ["sbx-a", "sbx-b"] {
        let (status, _, body) =
            ask(&t, id, &get("/v1/environment", None, "runtime.internal")).await;
        assert_eq!(status, 200, "{body}");
        let env = json_of(&body);
        assert_eq!(env["RUNTIME_SANDBOX_ID"], id);
        assert_eq!(env["RUNTIME_API_URL"], "http://runtime.internal");
        assert!(env.get("RUNTIME_ID_TOKEN_REQUEST_TOKEN").is_none(), "{env}");
    }
}

#[tokio::test]
async fn a_login_started_from_a_sandbox_cannot_reach_its_approval_page() {
    let t = t();
    let body = r#"{"computer":"sandbox"}"#;
    let req = format!(
        "POST /v1/login/requests HTTP/1.1\r\nHost: runtime.internal\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (status, _, answer) = ask(&t, "sbx-1", &req).await;
    assert_eq!(status, 201, "{answer}");
    let path = json_of(&answer)["approvePath"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(path.starts_with("/login/"), "{path}");
    // The approval page is not served at runtime.internal, either way.
    for method in ["GET", "POST"] {
        let req = format!("{method} {path} HTTP/1.1\r\nHost: runtime.internal\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let (status, _, _) = ask(&t, "sbx-1", &req).await;
        assert_eq!(status, 404, "{method}");
    }
}

#[tokio::test]
async fn mcp_is_served_with_the_key_the_request_carries() {
    let t = t();
    let body = serde_json::json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "inside", "version": "1"}}})
    .to_string();
    let post = |key: Option<&str>| {
        let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        format!(
            "POST /mcp HTTP/1.1\r\nHost: runtime.internal\r\n{auth}Content-Type: application/json\r\nAccept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let (status, head, answer) = ask(&t, "sbx-1", &post(Some(&t.admin))).await;
    assert_eq!(status, 200, "{head}\n{answer}");
    assert!(
        head.to_ascii_lowercase().contains("mcp-session-id"),
        "{head}"
    );
    assert_eq!(json_of(&answer)["id"], 0, "{answer}");
    let (status, _, answer) = ask(&t, "sbx-1", &post(None)).await;
    assert_eq!(status, 401, "{answer}");
}
