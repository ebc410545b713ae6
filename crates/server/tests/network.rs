//! The network through the router, against a fake host: rules, secrets,
//! previews and what the host's egress proxy is told to apply.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_server::{create_key, ensure_admin_key, open_store, router, AppState, Config};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

struct T {
    dir: PathBuf,
    host: Arc<FakeHost>,
    state: AppState,
    admin: String,
}

impl T {
    fn new(tweak: impl FnOnce(&mut Config)) -> T {
        let dir = std::env::temp_dir().join(format!("rt-net-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let host = Arc::new(FakeHost::default());
        let mut config = Config::new(&dir);
        config.preview_port = 8080;
        tweak(&mut config);
        let state = AppState::new(config, open_store(&dir).unwrap(), host.clone());
        T {
            dir,
            host,
            state,
            admin,
        }
    }

    async fn raw(&self, req: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
        let resp = router(self.state.clone()).oneshot(req).await.unwrap();
        let (s, h) = (resp.status(), resp.headers().clone());
        (s, h, resp.into_body().collect().await.unwrap().to_bytes())
    }

    async fn json_as(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"));
        if method != "GET" {
            b = b.header("idempotency-key", uuid::Uuid::new_v4().to_string());
        }
        let body = body.map_or(Body::empty(), |v| Body::from(v.to_string()));
        let (s, _, bytes) = self.raw(b.body(body).unwrap()).await;
        (s, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn json(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.json_as(&self.admin.clone(), method, path, body).await
    }

    async fn running(&self, body: Value) -> String {
        let mut req = Request::builder()
            .method("POST")
            .uri("/v1/sandboxes")
            .header("authorization", format!("Bearer {}", self.admin))
            .header("prefer", "wait=10")
            .body(Body::from(body.to_string()))
            .unwrap();
        req.headers_mut().insert(
            "idempotency-key",
            uuid::Uuid::new_v4().to_string().parse().unwrap(),
        );
        let (s, _, b) = self.raw(req).await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// The environment the last exec was given.
    async fn exec_env(&self, id: &str) -> Vec<(String, String)> {
        let (s, v) = self
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}:exec"),
                Some(json!({"command": "true"})),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        self.host.last_exec.lock().unwrap().clone().unwrap().env
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn issues(v: &Value) -> Vec<String> {
    v["error"]["details"]["issues"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| i["field"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn secrets_are_sealed_listed_without_values_and_given_as_placeholders() {
    let t = T::new(|_| {});
    let (s, v) = t
        .json(
            "PUT",
            "/v1/egress-secrets/9BAD",
            Some(json!({"value": "x\u{1}", "hosts": ["Bad.example.com", "ok.example.com"], "format": "Bearer", "rules": [{"methods": ["FETCH"], "paths": ["/a/../b"]}]})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let named = issues(&v);
    for f in [
        "name",
        "value",
        "hosts[0]",
        "format",
        "rules[0].methods[0]",
        "rules[0].paths[0]",
    ] {
        assert!(named.iter().any(|n| n == f), "{f} not named in {v}");
    }

    let value = "sk-live-0123456789abcdef";
    let (s, v) = t
        .json(
            "PUT",
            "/v1/egress-secrets/OPENAI_API_KEY",
            Some(json!({"value": value, "hosts": ["api.example.com"], "header": "authorization", "format": "Bearer {value}"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let placeholder = v["placeholder"].as_str().unwrap().to_string();
    assert!(
        placeholder.starts_with("rtsec_") && placeholder.len() > 30,
        "{v}"
    );
    assert_eq!(v["valueBytes"], value.len());
    assert!(!v.to_string().contains(value));

    // A new value keeps the placeholder.
    let (_, again) = t
        .json(
            "PUT",
            "/v1/egress-secrets/OPENAI_API_KEY",
            Some(json!({"value": "sk-new", "hosts": ["api.example.com"]})),
        )
        .await;
    assert_eq!(again["placeholder"], placeholder.as_str());
    assert!(again.get("header").is_none(), "{again}");

    let (s, list) = t.json("GET", "/v1/egress-secrets", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["secrets"][0]["name"], "OPENAI_API_KEY");
    assert!(!list.to_string().contains("sk-new"), "{list}");

    // Nothing on disk holds the value in the clear.
    for entry in std::fs::read_dir(&t.dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            let bytes = std::fs::read(&p).unwrap();
            assert!(
                !bytes.windows(6).any(|w| w == b"sk-new"),
                "{} holds the value",
                p.display()
            );
        }
    }

    let all = t.running(json!({})).await;
    let env = t.exec_env(&all).await;
    assert!(
        env.contains(&("OPENAI_API_KEY".into(), placeholder.clone())),
        "{env:?}"
    );
    let none = t.running(json!({"secrets": []})).await;
    assert!(!t
        .exec_env(&none)
        .await
        .iter()
        .any(|(k, _)| k == "OPENAI_API_KEY"));
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"secrets": ["NOPE"]})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(issues(&v), ["secrets[0]"]);

    let ro = create_key(&t.dir, Some("ro"), true, true).unwrap();
    let (s, _) = t.json_as(&ro, "GET", "/v1/egress-secrets", None).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, v) = t.json("GET", "/v1/secrets", None).await;
    assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{v}");

    let (s, v) = t
        .json("DELETE", "/v1/egress-secrets/OPENAI_API_KEY", None)
        .await;
    assert_eq!((s, v["deleted"].clone()), (StatusCode::OK, json!(true)));
    let (s, _) = t
        .json("DELETE", "/v1/egress-secrets/OPENAI_API_KEY", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(!t
        .exec_env(&all)
        .await
        .iter()
        .any(|(k, _)| k == "OPENAI_API_KEY"));
}

#[tokio::test]
async fn network_rules_are_checked_read_and_replaced() {
    let t = T::new(|_| {});
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"network": {"internet": true, "allow": ["ok.example.com", "bad host"], "deny": ["10.0.0.0/33"], "connect": ["db.example.com"]}})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let named = issues(&v);
    for f in ["network.allow[1]", "network.deny[0]", "network.connect[0]"] {
        assert!(named.iter().any(|n| n == f), "{f} not named in {v}");
    }

    let id = t
        .running(json!({"network": {"internet": true, "allow": ["*.example.org"]}}))
        .await;
    let (s, v) = t
        .json("GET", &format!("/v1/sandboxes/{id}/network"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["allow"], json!(["*.example.org"]));
    assert_eq!(v["sandboxId"], id.as_str());
    assert_eq!(v["ports"], json!([80, 443]));
    assert_eq!(v["enforced"], true);
    let v1 = v["version"].as_u64().unwrap();

    let (s, v) = t
        .json(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(json!({"internet": false, "allow": ["example.com"], "connect": ["example.com:5432"]})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["internet"], true,
        "an allow list keeps the internet on: {v}"
    );
    assert_eq!(v["ports"], json!([80, 443, 5432]));
    assert!(v["version"].as_u64().unwrap() > v1);
    let (s, v) = t
        .json(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(json!({"internet": "no", "extra": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let mut named = issues(&v);
    named.sort();
    assert_eq!(named, ["extra", "internet"], "{v}");
    let (s, v) = t
        .json(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(json!({"internet": false})),
        )
        .await;
    assert_eq!(
        (s, v["internet"].clone(), v["ports"].clone()),
        (StatusCode::OK, json!(false), json!([]))
    );
}

/// A local HTTP server standing for a guest port: answers each request with
/// its own head, so a test sees what reached the guest.
async fn echo_server() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{head}",
                    head.len()
                );
                let _ = c.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn previews_need_their_token_until_rotated_and_reach_the_guest_port() {
    let t = T::new(|_| {});
    let id = t.running(json!({})).await;
    let guest_server = echo_server().await;
    t.host
        .guest_ports
        .lock()
        .unwrap()
        .insert(3000, guest_server);

    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/previews"),
            Some(json!({"port": 0, "visibility": "secret", "embedOrigins": ["ftp://x"]})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let mut named = issues(&v);
    named.sort();
    assert_eq!(named, ["embedOrigins[0]", "port", "visibility"], "{v}");

    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/previews"),
            Some(json!({"port": 3000})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    assert_eq!(p["visibility"], "private");
    assert_eq!(p["url"], format!("http://3000-{id}.localhost:8080/"));
    let token = p["token"].as_str().unwrap().to_string();
    assert!(p["urlWithToken"].as_str().unwrap().ends_with(&token));
    // A read-only key sees the preview but gets no way in.
    let ro = create_key(&t.dir, Some("watcher"), true, true).unwrap();
    let (s, one) = t
        .json_as(
            &ro,
            "GET",
            &format!("/v1/sandboxes/{id}/previews/3000"),
            None,
        )
        .await;
    let (_, all) = t
        .json_as(&ro, "GET", &format!("/v1/sandboxes/{id}/previews"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{one}");
    for seen in [&one, &all["data"][0]] {
        assert_eq!(seen["port"], 3000, "{seen}");
        assert!(seen["token"].is_null(), "{seen}");
        assert_eq!(seen["urlWithToken"], seen["url"], "{seen}");
    }

    let host = format!("3000-{id}.localhost:8080");
    let visit = |path: &str, headers: Vec<(&'static str, String)>| {
        let mut b = Request::builder()
            .uri(path.to_string())
            .header("host", host.clone());
        for (k, v) in headers {
            b = b.header(k, v);
        }
        b.body(Body::empty()).unwrap()
    };
    let (s, _, b) = t.raw(visit("/x", vec![])).await;
    assert_eq!(
        s,
        StatusCode::UNAUTHORIZED,
        "{}",
        String::from_utf8_lossy(&b)
    );
    let (s, _, _) = t
        .raw(visit(
            "/x",
            vec![("x-runtime-preview-token", "1.bad".into())],
        ))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, b) = t
        .raw(visit(
            "/hello?a=1",
            vec![("x-runtime-preview-token", token.clone())],
        ))
        .await;
    let seen = String::from_utf8_lossy(&b).to_string();
    assert_eq!(s, StatusCode::OK, "{seen}");
    assert!(seen.starts_with("GET /hello?a=1 HTTP/1.1"), "{seen}");
    assert!(
        !seen.contains(&token),
        "the token reached the guest: {seen}"
    );
    // By query: the guest does not see it, and a cookie carries it on.
    let (s, h, b) = t
        .raw(visit(
            &format!("/q?runtime_preview_token={token}&b=2"),
            vec![],
        ))
        .await;
    let seen = String::from_utf8_lossy(&b).to_string();
    assert_eq!(s, StatusCode::OK);
    assert!(seen.starts_with("GET /q?b=2 HTTP/1.1"), "{seen}");
    let cookie = h
        .get("set-cookie")
        .unwrap()
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let (s, _, _) = t
        .raw(visit("/page", vec![("cookie", cookie.clone())]))
        .await;
    assert_eq!(s, StatusCode::OK);

    let (s, r) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/previews/3000:rotate"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let (s, _, _) = t
        .raw(visit(
            "/x",
            vec![("x-runtime-preview-token", token.clone())],
        ))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "the old token still works");
    let (s, _, _) = t.raw(visit("/page", vec![("cookie", cookie)])).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let fresh = r["token"].as_str().unwrap().to_string();
    let (s, _, _) = t
        .raw(visit(
            "/x",
            vec![("x-runtime-preview-token", fresh.clone())],
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    // Whoever reads the store alone cannot mint a token: the preview's
    // secret is there, but a token is a MAC under a key that also needs
    // `secrets.key`. A MAC under the stored secret itself is refused.
    let doc: String = rusqlite::Connection::open(t.dir.join("runtime.db"))
        .unwrap()
        .query_row(
            "SELECT doc FROM net_docs WHERE kind = 'preview' AND scope = ?1 AND name = '3000'",
            [&id],
            |r| r.get(0),
        )
        .unwrap();
    let doc: Value = serde_json::from_str(&doc).unwrap();
    assert_eq!(doc["keyed"], true, "{doc}");
    let secret = hex::decode(doc["secret"].as_str().unwrap()).unwrap();
    let expiry = fresh.split_once('.').unwrap().0;
    let forged = {
        use base64::Engine;
        use hmac::Mac;
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret).unwrap();
        m.update(format!("3000:{expiry}").as_bytes());
        let mac =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(m.finalize().into_bytes());
        format!("{expiry}.{mac}")
    };
    assert_ne!(forged, fresh);
    let (s, _, _) = t
        .raw(visit("/x", vec![("x-runtime-preview-token", forged)]))
        .await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "a token minted from the store alone works"
    );

    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/previews"),
            Some(json!({"port": 3000, "visibility": "public"})),
        )
        .await;
    assert_eq!(
        (s, p["token"].clone()),
        (StatusCode::OK, Value::Null),
        "{p}"
    );
    let (s, _, _) = t.raw(visit("/open", vec![])).await;
    assert_eq!(s, StatusCode::OK);
    let (s, l) = t
        .json("GET", &format!("/v1/sandboxes/{id}/previews"), None)
        .await;
    assert_eq!(
        (s, l["data"].as_array().unwrap().len()),
        (StatusCode::OK, 1)
    );

    // Nothing listening answers 502; a port not shared answers 404.
    t.json(
        "POST",
        &format!("/v1/sandboxes/{id}/previews"),
        Some(json!({"port": 4000, "visibility": "public"})),
    )
    .await;
    let mut req = visit("/", vec![]);
    req.headers_mut()
        .insert("host", format!("4000-{id}.localhost").parse().unwrap());
    assert_eq!(t.raw(req).await.0, StatusCode::BAD_GATEWAY);
    let mut req = visit("/", vec![]);
    req.headers_mut()
        .insert("host", format!("5000-{id}.localhost").parse().unwrap());
    assert_eq!(t.raw(req).await.0, StatusCode::NOT_FOUND);

    let (s, _) = t
        .json("DELETE", &format!("/v1/sandboxes/{id}/previews/3000"), None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t.raw(visit("/", vec![])).await.0, StatusCode::NOT_FOUND);
    let (s, _) = t
        .json("GET", &format!("/v1/sandboxes/{id}/previews/3000"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_host_gets_each_sandboxs_network_before_it_starts_and_every_change() {
    let t = T::new(|_| {});
    let secret =
        |name: &str, host: &str| json!({"value": format!("value-of-{name}"), "hosts": [host]});
    let (s, _) = t
        .json(
            "PUT",
            "/v1/egress-secrets/FIRST",
            Some(secret("FIRST", "api.example.com")),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let id = t
        .running(json!({"network": {"internet": true, "deny": ["example.org"]}}))
        .await;

    // Set before the machine started, with the CA its spec trusts.
    let net = t.host.network(&id).expect("no network set for the sandbox");
    let spec = t.host.specs.lock().unwrap().last().cloned().unwrap();
    assert_eq!(spec.guest_ca_pem.as_deref(), Some(net.ca.cert_pem()));
    assert!(net.policy.allows("example.com", 443).is_ok());
    assert!(net.policy.allows("example.org", 443).is_err());
    let names = |n: &runtime_host::GuestNet| -> Vec<String> {
        n.secrets.iter().map(|s| s.name.clone()).collect()
    };
    assert_eq!(names(&net), ["FIRST"]);

    // New rules: set again, the CA kept.
    let (s, _) = t
        .json(
            "PUT",
            &format!("/v1/sandboxes/{id}/network"),
            Some(json!({"internet": true, "deny": ["example.com"]})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let net2 = t.host.network(&id).unwrap();
    assert!(net2.policy.allows("example.com", 443).is_err());
    assert!(net2.policy.allows("example.org", 443).is_ok());
    assert_eq!(net2.ca.cert_pem(), net.ca.cert_pem());

    // A new secret and a deleted one: set again.
    let (s, _) = t
        .json(
            "PUT",
            "/v1/egress-secrets/SECOND",
            Some(secret("SECOND", "api.example.org")),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let mut got = names(&t.host.network(&id).unwrap());
    got.sort();
    assert_eq!(got, ["FIRST", "SECOND"]);
    let (s, _) = t.json("DELETE", "/v1/egress-secrets/FIRST", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(names(&t.host.network(&id).unwrap()), ["SECOND"]);

    // Deleted: forgotten on the host.
    let (s, _) = t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(t.host.network(&id).is_none());
    assert!(t.host.forgotten.lock().unwrap().contains(&id));
}

#[tokio::test]
async fn a_secret_belongs_to_the_key_that_set_it_and_reaches_only_its_sandboxes() {
    let t = T::new(|_| {});
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let put = |key: String, value: &'static str| {
        let t = &t;
        async move {
            t.json_as(
                &key,
                "PUT",
                "/v1/egress-secrets/TOKEN",
                Some(json!({"value": value, "hosts": ["api.example.com"]})),
            )
            .await
        }
    };
    let (s, admins) = put(t.admin.clone(), "admin-value").await;
    assert_eq!(s, StatusCode::OK, "{admins}");
    // Key B sees none of the admin's, and cannot delete it.
    let (_, list) = t.json_as(&b, "GET", "/v1/egress-secrets", None).await;
    assert_eq!(list["secrets"], json!([]), "{list}");
    let (s, _) = t
        .json_as(&b, "DELETE", "/v1/egress-secrets/TOKEN", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Its TOKEN is its own: another placeholder, the admin's value kept.
    let (s, bs) = put(b.clone(), "b-value").await;
    assert_eq!(s, StatusCode::OK, "{bs}");
    assert_ne!(bs["placeholder"], admins["placeholder"]);
    // B's sandbox gets B's secret only; a create naming one B lacks is refused.
    let sbx_b = {
        let mut req = Request::builder()
            .method("POST")
            .uri("/v1/sandboxes")
            .header("authorization", format!("Bearer {b}"))
            .header("prefer", "wait=10")
            .body(Body::from(json!({}).to_string()))
            .unwrap();
        req.headers_mut().insert(
            "idempotency-key",
            uuid::Uuid::new_v4().to_string().parse().unwrap(),
        );
        let (s, _, body) = t.raw(req).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_string()
    };
    let net = t.host.network(&sbx_b).expect("no network set");
    let values: Vec<String> = net
        .secrets
        .iter()
        .map(|s| format!("{} {}", s.name, s.placeholder))
        .collect();
    assert_eq!(
        values,
        [format!("TOKEN {}", bs["placeholder"].as_str().unwrap())]
    );
    let sbx_admin = t.running(json!({})).await;
    let net = t.host.network(&sbx_admin).unwrap();
    assert_eq!(net.secrets.len(), 1);
    assert_eq!(
        net.secrets[0].placeholder,
        admins["placeholder"].as_str().unwrap()
    );
    // B deletes its own; the admin's stays, and the admin's sandbox keeps it.
    let (s, _) = t
        .json_as(&b, "DELETE", "/v1/egress-secrets/TOKEN", None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(t.host.network(&sbx_b).unwrap().secrets.is_empty());
    assert_eq!(t.host.network(&sbx_admin).unwrap().secrets.len(), 1);
    let (_, list) = t.json("GET", "/v1/egress-secrets", None).await;
    assert_eq!(list["secrets"][0]["name"], "TOKEN", "{list}");
}

/// A server on a loopback port with `tweak`ed limits; its port, and what
/// stops it.
async fn serving(
    tweak: impl FnOnce(&mut Config),
) -> (u16, tokio::sync::oneshot::Sender<()>, String) {
    let dir = std::env::temp_dir().join(format!("rt-serve-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = ensure_admin_key(&dir).unwrap().unwrap();
    let mut config = Config::new(&dir);
    tweak(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(runtime_server::run(
        listener,
        config,
        Arc::new(FakeHost::default()),
        async move {
            let _ = stop_rx.await;
        },
    ));
    (port, stop_tx, admin)
}

/// Reads until the peer closes (or `within` passes): whether it closed.
async fn closed_within(c: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, c.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn slow_request_heads_and_idle_connections_are_cut_off() {
    let (port, _stop, admin) = serving(|c| c.header_read_timeout = Duration::from_secs(1)).await;
    // Slowloris: a head that never ends.
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    slow.write_all(b"GET /v1/me HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n")
        .await
        .unwrap();
    assert!(
        closed_within(&mut slow, Duration::from_secs(5)).await,
        "a slow head was kept"
    );
    // A connection that says nothing.
    let mut idle = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    assert!(
        closed_within(&mut idle, Duration::from_secs(5)).await,
        "an idle connection was kept"
    );
    // A request that comes whole is answered, and the kept-alive
    // connection closes once idle.
    let mut ok = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    ok.write_all(
        format!("GET /v1/me HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {admin}\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = [0u8; 12];
    ok.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert!(
        closed_within(&mut ok, Duration::from_secs(5)).await,
        "an idle keep-alive connection was kept"
    );
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let (port, _stop, admin) = serving(|c| c.max_connections = 1).await;
    let first = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    // Let the server take the first one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut second = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    second
        .write_all(format!("GET /v1/me HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {admin}\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = [0u8; 12];
    let early =
        tokio::time::timeout(Duration::from_millis(500), second.read_exact(&mut head)).await;
    assert!(early.is_err(), "answered beyond the cap");
    drop(first);
    tokio::time::timeout(Duration::from_secs(5), second.read_exact(&mut head))
        .await
        .expect("not answered once a slot was free")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
}

#[tokio::test]
async fn the_api_and_previews_are_served_over_tls_with_the_operators_certificate() {
    let dir = std::env::temp_dir().join(format!("rt-tls-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = ensure_admin_key(&dir).unwrap().unwrap();
    let cert =
        rcgen::generate_simple_self_signed(vec!["localhost".into(), "*.localhost".into()]).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), cert.signing_key.serialize_pem()).unwrap();
    let mut config = Config::new(&dir);
    config.tls = Some((dir.join("cert.pem"), dir.join("key.pem")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(runtime_server::run(
        listener,
        config,
        Arc::new(FakeHost::default()),
        async move {
            let _ = stop_rx.await;
        },
    ));

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let get = |host: String, path: &'static str, key: Option<String>| {
        let connector = connector.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            let auth = key
                .map(|k| format!("authorization: Bearer {k}\r\n"))
                .unwrap_or_default();
            tls.write_all(
                format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
            let mut out = Vec::new();
            let _ = tls.read_to_end(&mut out).await;
            String::from_utf8_lossy(&out).to_string()
        }
    };
    let api = get(format!("localhost:{port}"), "/v1/sandboxes", Some(admin)).await;
    assert!(api.starts_with("HTTP/1.1 200"), "{api}");
    let preview = get(format!("3000-abc.localhost:{port}"), "/", None).await;
    assert!(preview.starts_with("HTTP/1.1 404"), "{preview}");
    assert!(preview.contains("preview_not_found"), "{preview}");
    // Plain HTTP on the TLS port gets nowhere.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    plain
        .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("HTTP/1.1 200"));
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest server that answers every request with `head` (whole, with
/// `connection: close`), or never answers when `head` is `None`.
async fn guest_answering(head: Option<&'static str>) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = c.read(&mut buf).await;
                match head {
                    Some(h) => {
                        let _ = c.write_all(h.as_bytes()).await;
                    }
                    None => tokio::time::sleep(Duration::from_secs(30)).await,
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_preview_cannot_set_cookies_beyond_its_host_nor_take_every_connection() {
    let t = T::new(|c| {
        c.preview_max_concurrent = 1;
        c.preview_head_timeout = Duration::from_millis(500);
    });
    let id = t.running(json!({})).await;
    let cookies = guest_answering(Some(
        "HTTP/1.1 200 OK\r\nset-cookie: sid=1; Domain=localhost; Path=/; HttpOnly\r\n\
         set-cookie: theme=dark; domain=.localhost\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
    ))
    .await;
    let silent = guest_answering(None).await;
    {
        let mut ports = t.host.guest_ports.lock().unwrap();
        ports.insert(3000, cookies);
        ports.insert(4000, silent);
    }
    for port in [3000, 4000] {
        let (s, v) = t
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/previews"),
                Some(json!({"port": port, "visibility": "public"})),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let visit = |port: u16| {
        Request::builder()
            .uri("/")
            .header("host", format!("{port}-{id}.localhost:8080"))
            .body(Body::empty())
            .unwrap()
    };

    let (s, h, b) = t.raw(visit(3000)).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let set: Vec<&str> = h
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(set, ["sid=1; Path=/; HttpOnly", "theme=dark"]);

    // A guest that never answers holds the preview's one place until the
    // head times out (504); meanwhile a second visitor is refused (503).
    let first = tokio::spawn({
        let state = t.state.clone();
        let req = visit(4000);
        async move {
            let resp = router(state).oneshot(req).await.unwrap();
            resp.status()
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (s, h, b) = t.raw(visit(4000)).await;
    assert_eq!(
        s,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(h["retry-after"], "1");
    assert_eq!(first.await.unwrap(), StatusCode::GATEWAY_TIMEOUT);
    // The place is given back (as the timed-out connection's task ends):
    // the next visitor waits its own turn.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (s, _, _) = t.raw(visit(4000)).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT);
    // Another preview of the same sandbox was never held up.
    let (s, _, _) = t.raw(visit(3000)).await;
    assert_eq!(s, StatusCode::OK);
}
