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
        .raw(visit("/x", vec![("x-runtime-preview-token", fresh)]))
        .await;
    assert_eq!(s, StatusCode::OK);

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
