//! The web console through the router, against a fake host: its files and
//! their headers, and the routes it adds (`/v1/keys`, `/v1/usage/daily`,
//! `…/console`, the terminal's session subprotocol). The page itself is
//! driven in Chromium by `tests/e2e/test_console.py`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_server::{create_key, ensure_admin_key, open_store, router, AppState, Config};
use serde_json::{json, Value};
use tower::ServiceExt;

struct T {
    dir: PathBuf,
    state: AppState,
    admin: String,
}

impl T {
    fn new() -> T {
        let dir = std::env::temp_dir().join(format!("rt-console-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let store = open_store(&dir).unwrap();
        let state = AppState::new(Config::new(&dir), store, Arc::new(FakeHost::default()));
        T { dir, state, admin }
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let mut b = Request::builder().method(method).uri(path);
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let body = match body {
            Some(v) => {
                b = b.header("content-type", "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        let resp = router(self.state.clone())
            .oneshot(b.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, bytes)
    }

    async fn json(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let idem = uuid::Uuid::new_v4().to_string();
        let h: Vec<(&str, &str)> = if method == "GET" {
            vec![]
        } else {
            vec![("idempotency-key", &idem)]
        };
        let (s, _, b) = self.call(method, path, Some(key), &h, body).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
}

#[tokio::test]
async fn the_console_files_are_served_with_their_types_and_a_strict_policy() {
    let t = T::new();
    for (path, kind, needle) in [
        (
            "/console",
            "text/html; charset=utf-8",
            "<script src=\"/console/app.js\"",
        ),
        (
            "/console/",
            "text/html; charset=utf-8",
            "/console/style.css",
        ),
        (
            "/console/app.js",
            "text/javascript; charset=utf-8",
            "sessionStorage",
        ),
        (
            "/console/style.css",
            "text/css; charset=utf-8",
            "font-family",
        ),
    ] {
        let (s, h, b) = t.call("GET", path, None, &[], None).await;
        assert_eq!(s, StatusCode::OK, "{path}");
        assert_eq!(header(&h, "content-type"), kind, "{path}");
        let csp = header(&h, "content-security-policy");
        for part in [
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "frame-ancestors 'none'",
            "object-src 'none'",
        ] {
            assert!(csp.contains(part), "{path}: {csp}");
        }
        assert!(!csp.contains("unsafe"), "{path}: {csp}");
        assert_eq!(header(&h, "x-frame-options"), "DENY");
        assert_eq!(header(&h, "x-content-type-options"), "nosniff");
        assert_eq!(header(&h, "referrer-policy"), "no-referrer");
        assert_eq!(header(&h, "cache-control"), "no-cache");
        let body = String::from_utf8(b.to_vec()).unwrap();
        assert!(body.contains(needle), "{path}");
        // Revalidation: the same file again is a 304 without a body.
        let tag = header(&h, "etag").to_string();
        let (s, _, b) = t
            .call("GET", path, None, &[("if-none-match", &tag)], None)
            .await;
        assert_eq!(s, StatusCode::NOT_MODIFIED, "{path}");
        assert!(b.is_empty());
    }
    // The page holds no inline script or style for the policy to refuse.
    let (_, _, b) = t.call("GET", "/console", None, &[], None).await;
    let html = String::from_utf8(b.to_vec()).unwrap();
    assert_eq!(html.matches("<script").count(), 1);
    assert!(!html.contains("style=") && !html.contains("<style"));
    assert!(!html.contains(" onclick=") && !html.contains("javascript:"));
}

#[tokio::test]
async fn unknown_console_files_are_404_and_other_methods_405() {
    let t = T::new();
    for path in ["/console/nope.js", "/console/../v1/me", "/console/app.js/x"] {
        let (s, _, b) = t.call("GET", path, None, &[], None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "route_not_found", "{path}");
    }
    let (s, _, _) = t.call("POST", "/console/app.js", None, &[], None).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    // No key is needed for the files, and none is taken from them.
    let (s, _, _) = t.call("GET", "/consolex", None, &[], None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn an_admin_manages_keys_and_a_new_key_is_shown_once() {
    let t = T::new();
    let (s, v) = t.json(&t.admin, "GET", "/v1/keys", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(v["data"][0]["current"], true);
    assert_eq!(v["data"][0]["accountWide"], true);

    let body = json!({"name": "ci", "dailyLimitMicros": 5_000_000});
    let idem = [("idempotency-key", "make-ci")];
    let (s, _, b) = t
        .call(
            "POST",
            "/v1/keys",
            Some(&t.admin),
            &idem,
            Some(body.clone()),
        )
        .await;
    let made: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, StatusCode::CREATED, "{made}");
    let key = made["key"].as_str().unwrap().to_string();
    assert!(key.starts_with("rtcloud_"), "{made}");
    assert_eq!(made["name"], "ci");
    assert_eq!(made["access"], "full");
    assert_eq!(made["dailyLimitMicros"], 5_000_000);
    // The new key works; a replay of the create never shows it again.
    let (s, me) = t.json(&key, "GET", "/v1/me", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(me["credentialName"], "ci");
    let (s, _, b) = t
        .call("POST", "/v1/keys", Some(&t.admin), &idem, Some(body))
        .await;
    let replay: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, StatusCode::CREATED);
    assert!(replay.get("key").is_none(), "{replay}");
    assert_eq!(replay["keyRedacted"], true);
    assert_eq!(replay["id"], made["id"]);

    let id = made["id"].as_str().unwrap();
    let (s, v) = t
        .json(
            &t.admin,
            "POST",
            &format!("/v1/keys/{id}:limit"),
            Some(json!({"dailyLimitMicros": null})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["dailyLimitMicros"], Value::Null);
    let (s, v) = t
        .json(
            &t.admin,
            "POST",
            &format!("/v1/keys/{id}:limit"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(
        v["error"]["details"]["issues"][0]["field"],
        "dailyLimitMicros"
    );

    let (s, v) = t
        .json(&t.admin, "POST", &format!("/v1/keys/{id}:revoke"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["revokedAt"].is_string());
    assert_eq!(
        t.json(&key, "GET", "/v1/me", None).await.0,
        StatusCode::UNAUTHORIZED
    );

    // The admin key cannot revoke itself with a click.
    let admin_id = runtime_server::keys::key_id_of(&t.admin).unwrap();
    let (s, v) = t
        .json(
            &t.admin,
            "POST",
            &format!("/v1/keys/{admin_id}:revoke"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        t.json(&t.admin, "GET", "/v1/me", None).await.0,
        StatusCode::OK
    );

    // Bad input names every field at once.
    let (s, v) = t
        .json(
            &t.admin,
            "POST",
            "/v1/keys",
            Some(json!({"name": "", "readOnly": true, "accountWide": true, "dailyLimitMicros": -1, "x": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["name", "accountWide", "dailyLimitMicros", "x"],
        "{v}"
    );
}

#[tokio::test]
async fn other_keys_see_their_own_and_may_not_manage_keys() {
    let t = T::new();
    let dev = create_key(&t.dir, Some("dev"), false, false).unwrap();
    let ro = create_key(&t.dir, Some("watch"), true, false).unwrap();

    let (s, v) = t.json(&dev, "GET", "/v1/keys", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["data"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["data"][0]["name"], "dev");
    let (s, v) = t.json(&ro, "GET", "/v1/keys", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["data"].as_array().unwrap().len(), 3, "{v}");

    let (s, v) = t.json(&dev, "POST", "/v1/keys", Some(json!({}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["code"], "forbidden");
    let (s, v) = t.json(&ro, "POST", "/v1/keys", Some(json!({}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("read-only"));

    let admin_id = runtime_server::keys::key_id_of(&t.admin).unwrap();
    let (s, _) = t
        .json(&dev, "POST", &format!("/v1/keys/{admin_id}:revoke"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another key is not even seen");
    let dev_id = runtime_server::keys::key_id_of(&dev).unwrap();
    let (s, _) = t
        .json(
            &dev,
            "POST",
            &format!("/v1/keys/{dev_id}:limit"),
            Some(json!({"dailyLimitMicros": null})),
        )
        .await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "a key does not lift its own limit"
    );
    // Signing out for good: a key may revoke itself.
    let (s, v) = t
        .json(&dev, "POST", &format!("/v1/keys/{dev_id}:revoke"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        t.json(&dev, "GET", "/v1/me", None).await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn usage_by_day_and_the_console_log_answer_in_their_shapes() {
    let t = T::new();
    let ro = create_key(&t.dir, Some("watch"), true, false).unwrap();
    for k in [&t.admin, &ro] {
        let (s, v) = t.json(k, "GET", "/v1/usage/daily?days=7", None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert!(v["days"].is_array(), "{v}");
    }
    let (s, v) = t
        .json(&t.admin, "GET", "/v1/usage/daily?days=0", None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "days");

    let (s, v) = t
        .json(&t.admin, "POST", "/v1/sandboxes", Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (s, v) = t
        .json(
            &t.admin,
            "GET",
            &format!("/v1/sandboxes/{id}/console?bytes=100"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["sandboxId"], id.as_str());
    assert!(v["text"].is_string());
    // What the guest writes there is the sandbox's inside: not for read-only keys.
    let (s, v) = t
        .json(&ro, "GET", &format!("/v1/sandboxes/{id}/console"), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (s, _) = t
        .json(&t.admin, "GET", "/v1/sandboxes/nope/console", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_terminal_takes_a_session_token_as_a_subprotocol_and_never_a_key() {
    let t = T::new();
    let (s, v) = t
        .json(&t.admin, "POST", "/v1/sandboxes", Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (s, sess) = t
        .json(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{id}/sessions"),
            Some(json!({"ttlSeconds": 60, "origins": ["http://127.0.0.1:9"]})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{sess}");
    let token = sess["token"].as_str().unwrap();
    let path = format!("/v1/sandboxes/{id}/terminal");
    let offer = |t: &str| format!("runtime-terminal, runtime-session.{t}");

    // An API key offered there is not taken.
    let (s, _, _) = t
        .call(
            "GET",
            &path,
            None,
            &[("sec-websocket-protocol", &offer(&t.admin))],
            None,
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // The session is, from its own page's origin only.
    let (s, _, _) = t
        .call(
            "GET",
            &path,
            None,
            &[
                ("sec-websocket-protocol", &offer(token)),
                ("origin", "http://evil.example"),
            ],
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // Past the checks, what is left is the upgrade, which a router test
    // without a connection cannot make.
    let (s, _, b) = t
        .call(
            "GET",
            &path,
            None,
            &[
                ("sec-websocket-protocol", &offer(token)),
                ("origin", "http://127.0.0.1:9"),
            ],
            None,
        )
        .await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "Upgrade");
    // Another sandbox's terminal is out of the session's reach.
    let (s, _, _) = t
        .call(
            "GET",
            "/v1/sandboxes/other/terminal",
            None,
            &[("sec-websocket-protocol", &offer(token))],
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}
