//! Events and webhooks through the router, against a fake host, with a
//! loopback receiver the operator allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::FakeHost;
use hmac::{Hmac, Mac};
use http_body_util::BodyExt;
use runtime_server::{
    create_key, ensure_admin_key, open_store, router, AllowHost, AppState, Config,
};
use serde_json::{json, Value};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

struct T {
    dir: PathBuf,
    state: AppState,
    admin: String,
}

impl T {
    fn new() -> T {
        let dir = std::env::temp_dir().join(format!("rt-events-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        T::open(dir, admin)
    }

    fn open(dir: PathBuf, admin: String) -> T {
        let mut config = Config::new(&dir);
        config.webhook_allow = vec![AllowHost::parse("127.0.0.1").unwrap()];
        // A minute of the retry schedule lasts 0.3 s.
        config.webhook_second_ms = 5;
        let store = open_store(&dir).unwrap();
        let state = AppState::new(config, store, Arc::new(FakeHost::default()));
        T { dir, state, admin }
    }

    async fn call(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"))
            .header("prefer", "wait=10");
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
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn ok(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> Value {
        let (s, v) = self.call(key, method, path, body).await;
        assert!(s.is_success(), "{method} {path}: {s} {v}");
        v
    }

    async fn sandbox(&self, key: &str) -> String {
        let v = self.ok(key, "POST", "/v1/sandboxes", Some(json!({}))).await;
        assert_eq!(v["state"], "running", "{v}");
        v["id"].as_str().unwrap().to_string()
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn types(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

fn fields(v: &Value) -> Vec<String> {
    let mut f: Vec<String> = v["error"]["details"]["issues"]
        .as_array()
        .or_else(|| v["error"]["issues"].as_array())
        .unwrap_or_else(|| panic!("no issues: {v}"))
        .iter()
        .map(|i| i["field"].as_str().unwrap().to_string())
        .collect();
    f.sort();
    f
}

#[tokio::test]
async fn a_sandboxs_life_is_listed_newest_first_and_pages() {
    let t = T::new();
    let id = t.sandbox(&t.admin).await;
    let act = |verb: &'static str| {
        let path = format!("/v1/sandboxes/{id}:{verb}");
        let t = &t;
        async move { t.ok(&t.admin, "POST", &path, Some(json!({}))).await }
    };
    assert_eq!(act("pause").await["state"], "paused");
    assert_eq!(act("wake").await["state"], "running");
    t.ok(&t.admin, "DELETE", &format!("/v1/sandboxes/{id}"), None)
        .await;
    let all = t
        .ok(
            &t.admin,
            "GET",
            &format!("/v1/events?resourceId={id}"),
            None,
        )
        .await;
    assert_eq!(
        types(&all),
        [
            "sandbox.deleted",
            "sandbox.stopped",
            "sandbox.woken",
            "sandbox.paused",
            "sandbox.running",
            "sandbox.created"
        ],
        "{all}"
    );
    let paused = &all["data"][3];
    assert_eq!(paused["data"]["sandbox"]["id"], id.as_str());
    assert_eq!(paused["data"]["sandbox"]["state"], "paused");
    assert_eq!(paused["data"]["sandbox"]["previousState"], "pausing");
    assert_eq!(paused["data"]["sandbox"]["stopReason"], "requested");
    assert!(paused["createdAt"].as_str().unwrap().ends_with('Z'));
    assert_eq!(all["nextCursor"], Value::Null);

    // Pages of two follow their cursor to the end.
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let p = t
            .ok(
                &t.admin,
                "GET",
                &format!("/v1/events?resourceId={id}&limit=2&cursor={cursor}"),
                None,
            )
            .await;
        seen.extend(types(&p));
        match p["nextCursor"].as_str() {
            Some(c) => cursor = c.to_string(),
            None => break,
        }
    }
    assert_eq!(seen, types(&all));
    let typed = t
        .ok(&t.admin, "GET", "/v1/events?type=sandbox.paused", None)
        .await;
    assert_eq!(types(&typed), ["sandbox.paused"]);

    let (s, v) = t
        .call(
            &t.admin,
            "GET",
            "/v1/events?limit=201&cursor=nope&type=x.y&size=1",
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(fields(&v), ["cursor", "limit", "size", "type"]);
}

#[tokio::test]
async fn a_key_never_sees_another_keys_events_or_webhooks() {
    let t = T::new();
    let a = create_key(&t.dir, Some("a"), false, false).unwrap();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let id = t.sandbox(&a).await;
    let hook = t
        .ok(
            &a,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": "https://example.com/h"})),
        )
        .await;
    let hid = hook["id"].as_str().unwrap();
    assert_eq!(
        types(&t.ok(&a, "GET", "/v1/events", None).await),
        ["sandbox.running", "sandbox.created"]
    );
    assert!(types(&t.ok(&b, "GET", "/v1/events", None).await).is_empty());
    assert!(types(
        &t.ok(&b, "GET", &format!("/v1/events?resourceId={id}"), None)
            .await
    )
    .is_empty());
    assert_eq!(
        t.ok(&b, "GET", "/v1/webhooks", None).await["data"],
        json!([])
    );
    for (m, p, body) in [
        ("GET", format!("/v1/webhooks/{hid}"), None),
        ("GET", format!("/v1/webhooks/{hid}/deliveries"), None),
        (
            "POST",
            format!("/v1/webhooks/{hid}:update"),
            Some(json!({"enabled": false})),
        ),
        (
            "POST",
            format!("/v1/webhooks/{hid}:rotate-secret"),
            Some(json!({})),
        ),
        ("POST", format!("/v1/webhooks/{hid}:test"), None),
        ("POST", format!("/v1/webhooks/{hid}:delete"), None),
    ] {
        let (s, v) = t.call(&b, m, &p, body).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{m} {p}: {v}");
        assert_eq!(v["error"]["code"], "not_found", "{v}");
    }
    // The owner and the account-wide admin still see it, unchanged.
    let again = t.ok(&a, "GET", &format!("/v1/webhooks/{hid}"), None).await;
    assert_eq!(again["enabled"], true);
    assert_eq!(again.get("secret"), None);
    assert_eq!(
        t.ok(&t.admin, "GET", "/v1/webhooks", None).await["data"][0]["id"],
        hid
    );
    // A's events reach a's webhook, not b's.
    let bh = t
        .ok(
            &b,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": "https://example.com/b"})),
        )
        .await;
    t.ok(
        &a,
        "POST",
        &format!("/v1/sandboxes/{id}:stop"),
        Some(json!({})),
    )
    .await;
    let bd = t
        .ok(
            &b,
            "GET",
            &format!("/v1/webhooks/{}/deliveries", bh["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(bd["data"], json!([]), "{bd}");
    let ad = t
        .ok(&a, "GET", &format!("/v1/webhooks/{hid}/deliveries"), None)
        .await;
    assert_eq!(ad["data"][0]["eventType"], "sandbox.stopped", "{ad}");
}

#[tokio::test]
async fn a_bad_webhook_is_refused_naming_every_wrong_field() {
    let t = T::new();
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(
                json!({"url": "http://example.com/h", "events": ["sandbox.stopped", "nope"],
                        "description": "d".repeat(300), "extra": 1}),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(fields(&v), ["description", "events[1]", "extra", "url"]);
    for url in [
        "https://127.0.0.2/h",
        "https://169.254.169.254/latest",
        "https://localhost/h",
        "https://10.0.0.1/",
        "ftp://example.com/",
        "http://127.0.0.1.nip.io/",
    ] {
        let (s, v) = t
            .call(&t.admin, "POST", "/v1/webhooks", Some(json!({"url": url})))
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{url}: {v}");
        assert_eq!(fields(&v), ["url"], "{url}");
    }
    let (s, v) = t
        .call(&t.admin, "POST", "/v1/webhooks", Some(json!({})))
        .await;
    assert_eq!(
        (s, fields(&v)),
        (StatusCode::BAD_REQUEST, vec!["url".to_string()])
    );
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            "/v1/webhooks/nope:update",
            Some(json!({"enabled": false})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = t
        .call(&t.admin, "POST", "/v1/webhook-deliveries/nope:retry", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    // The operator's host is fine over plain http.
    let ok = t
        .ok(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": "http://127.0.0.1:9/h"})),
        )
        .await;
    assert!(ok["secret"].as_str().unwrap().starts_with("whsec_"));
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/webhooks/{}:rotate-secret", ok["id"].as_str().unwrap()),
            Some(json!({"keepPreviousSeconds": 604801})),
        )
        .await;
    assert_eq!(
        (s, fields(&v)),
        (
            StatusCode::BAD_REQUEST,
            vec!["keepPreviousSeconds".to_string()]
        )
    );
}

/// A loopback HTTP receiver: answers each POST with the next status of
/// `answers` (then 204) and keeps its headers and body.
struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<(Vec<(String, String)>, String)>>>,
}

async fn receiver(answers: Vec<u16>) -> Receiver {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://127.0.0.1:{}/hook", l.local_addr().unwrap().port());
    let got: Arc<Mutex<Vec<(Vec<(String, String)>, String)>>> = Arc::default();
    let got2 = got.clone();
    let answers = Arc::new(Mutex::new(answers));
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let got = got2.clone();
            let answers = answers.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head, body) = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let len = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        if body.len() >= len {
                            break (head.to_string(), body[..len].to_string());
                        }
                    }
                };
                let headers = head
                    .lines()
                    .skip(1)
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                    .collect();
                got.lock().unwrap().push((headers, body));
                let status = {
                    let mut a = answers.lock().unwrap();
                    if a.is_empty() {
                        204
                    } else {
                        a.remove(0)
                    }
                };
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    Receiver { url, got }
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> &'a str {
    h.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} in {h:?}"))
}

/// The `v1` signatures of a `Runtime-Signature` that `secret` made.
fn signed_by(sig: &str, body: &str, secret: &str) -> bool {
    let t = sig.split(',').find_map(|p| p.strip_prefix("t=")).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    let want = hex::encode(mac.finalize().into_bytes());
    sig.split(',')
        .any(|p| p.strip_prefix("v1=") == Some(want.as_str()))
}

async fn wait_for(r: &Receiver, n: usize) {
    for _ in 0..200 {
        if r.got.lock().unwrap().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the receiver got {} of {n}", r.got.lock().unwrap().len());
}

#[tokio::test]
async fn deliveries_are_signed_retried_after_a_failure_and_logged() {
    let t = T::new();
    t.state.start_background();
    let r = receiver(vec![500]).await;
    let hook = t
        .ok(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": r.url, "events": ["sandbox.created"]})),
        )
        .await;
    let hid = hook["id"].as_str().unwrap().to_string();
    let secret = hook["secret"].as_str().unwrap().to_string();
    assert_eq!(hook["events"], json!(["sandbox.created"]));
    let id = t.sandbox(&t.admin).await;
    // The first answer is 500; the retry (60 schedule seconds later) succeeds.
    wait_for(&r, 2).await;
    let got = r.got.lock().unwrap().clone();
    for (h, body) in &got {
        assert!(
            signed_by(header(h, "runtime-signature"), body, &secret),
            "{h:?}"
        );
        assert!(!signed_by(
            header(h, "runtime-signature"),
            body,
            "whsec_wrong"
        ));
        let e: Value = serde_json::from_str(body).unwrap();
        assert_eq!(e["type"], "sandbox.created");
        assert_eq!(e["data"]["sandbox"]["id"], id.as_str());
        assert_eq!(header(h, "runtime-webhook-id"), e["id"].as_str().unwrap());
        assert_eq!(header(h, "runtime-event-type"), "sandbox.created");
    }
    assert_eq!(got[0].1, got[1].1, "a retry sends the same body");
    assert_eq!(header(&got[0].0, "runtime-delivery-attempt"), "1");
    assert_eq!(header(&got[1].0, "runtime-delivery-attempt"), "2");
    let mut log = Value::Null;
    for _ in 0..100 {
        log = t
            .ok(
                &t.admin,
                "GET",
                &format!("/v1/webhooks/{hid}/deliveries"),
                None,
            )
            .await;
        if log["data"][0]["state"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = &log["data"][0];
    assert_eq!(d["state"], "succeeded", "{log}");
    assert_eq!(d["attemptCount"], 2);
    assert_eq!(d["attempts"][0]["status"], 500);
    assert_eq!(d["attempts"][1]["status"], 204);
    assert_eq!(
        log["data"].as_array().unwrap().len(),
        1,
        "only sandbox.created: {log}"
    );
    let failed = t
        .ok(
            &t.admin,
            "GET",
            &format!("/v1/webhooks/{hid}/deliveries?state=failed"),
            None,
        )
        .await;
    assert_eq!(failed["data"], json!([]));

    // :test answers the endpoint's status; a rotation signs with both.
    let test = t
        .ok(&t.admin, "POST", &format!("/v1/webhooks/{hid}:test"), None)
        .await;
    assert_eq!(
        (test["ok"].clone(), test["status"].clone()),
        (json!(true), json!(204)),
        "{test}"
    );
    let rotated = t
        .ok(
            &t.admin,
            "POST",
            &format!("/v1/webhooks/{hid}:rotate-secret"),
            Some(json!({})),
        )
        .await;
    let new = rotated["secret"].as_str().unwrap().to_string();
    assert_ne!(new, secret);
    assert!(rotated["previousSecretExpiresAt"].is_string(), "{rotated}");
    t.ok(&t.admin, "POST", &format!("/v1/webhooks/{hid}:test"), None)
        .await;
    let (h, body) = r.got.lock().unwrap().last().cloned().unwrap();
    let sig = header(&h, "runtime-signature");
    assert_eq!(sig.matches("v1=").count(), 2, "{sig}");
    assert!(signed_by(sig, &body, &secret) && signed_by(sig, &body, &new));
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["type"],
        "webhook.test"
    );
    // 0 ends the old one now.
    let again = t
        .ok(
            &t.admin,
            "POST",
            &format!("/v1/webhooks/{hid}:rotate-secret"),
            Some(json!({"keepPreviousSeconds": 0})),
        )
        .await;
    t.ok(&t.admin, "POST", &format!("/v1/webhooks/{hid}:test"), None)
        .await;
    let (h, body) = r.got.lock().unwrap().last().cloned().unwrap();
    let sig = header(&h, "runtime-signature");
    assert_eq!(sig.matches("v1=").count(), 1, "{sig}");
    assert!(signed_by(sig, &body, again["secret"].as_str().unwrap()));
    assert!(!signed_by(sig, &body, &new));
    // A manual retry sends the delivery once more.
    let did = d["id"].as_str().unwrap();
    let before = r.got.lock().unwrap().len();
    let retried = t
        .ok(
            &t.admin,
            "POST",
            &format!("/v1/webhook-deliveries/{did}:retry"),
            None,
        )
        .await;
    assert_eq!(retried["attemptCount"], 3, "{retried}");
    assert_eq!(r.got.lock().unwrap().len(), before + 1);
    t.state.shutdown().await;
}

#[tokio::test]
async fn a_pending_delivery_survives_a_restart() {
    let t = T::new();
    // A receiver that is not there yet: the port is taken, then freed.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let hook = t
        .ok(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": format!("http://127.0.0.1:{port}/hook"), "events": ["sandbox.created"]})),
        )
        .await;
    let hid = hook["id"].as_str().unwrap().to_string();
    // No worker runs: the delivery is only queued.
    t.sandbox(&t.admin).await;
    let pending = t
        .ok(
            &t.admin,
            "GET",
            &format!("/v1/webhooks/{hid}/deliveries?state=pending"),
            None,
        )
        .await;
    assert_eq!(pending["data"].as_array().unwrap().len(), 1, "{pending}");
    // A new server on the same data directory sends it.
    let t2 = T::open(t.dir.clone(), t.admin.clone());
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    t2.state.start_background();
    let (mut s, _) = tokio::time::timeout(Duration::from_secs(10), l.accept())
        .await
        .expect("the restarted server delivers")
        .unwrap();
    let mut buf = vec![0u8; 8192];
    let n = s.read(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(text.starts_with("POST /hook HTTP/1.1"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("runtime-event-type: sandbox.created"),
        "{text}"
    );
    t2.state.shutdown().await;
    std::mem::forget(t2); // t owns the directory
}

#[tokio::test]
async fn a_replayed_create_leaves_the_secret_out_and_it_is_not_stored_plain() {
    let t = T::new();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let resp = router(t.state.clone())
            .oneshot(
                Request::builder()
                    .method("POST")
                    .uri("/v1/webhooks")
                    .header("authorization", format!("Bearer {}", t.admin))
                    .header("idempotency-key", "hook-1")
                    .header("content-type", "application/json")
                    .body(Body::from(
                        json!({"url": "https://example.com/h"}).to_string(),
                    ))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert!(resp.status().is_success());
        let b = resp.into_body().collect().await.unwrap().to_bytes();
        answers.push(serde_json::from_slice::<Value>(&b).unwrap());
    }
    let secret = answers[0]["secret"].as_str().unwrap().to_string();
    assert_eq!(answers[1]["id"], answers[0]["id"]);
    assert_eq!(answers[1].get("secret"), None, "{}", answers[1]);
    assert_eq!(answers[1]["secretRedacted"], true);
    // Nothing on disk holds the secret as it was shown.
    for entry in std::fs::read_dir(&t.dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            let bytes = std::fs::read(&p).unwrap();
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{} holds the secret",
                p.display()
            );
        }
    }
}

#[tokio::test]
async fn a_disabled_webhook_gets_no_deliveries_and_an_enabled_filter_applies() {
    let t = T::new();
    let all = t
        .ok(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": "https://example.com/a"})),
        )
        .await;
    let off = t
        .ok(
            &t.admin,
            "POST",
            "/v1/webhooks",
            Some(json!({"url": "https://example.com/b"})),
        )
        .await;
    let (aid, oid) = (all["id"].as_str().unwrap(), off["id"].as_str().unwrap());
    let changed = t
        .ok(
            &t.admin,
            "POST",
            &format!("/v1/webhooks/{oid}:update"),
            Some(json!({"enabled": false, "events": ["sandbox.deleted"], "description": "off"})),
        )
        .await;
    assert_eq!(
        (
            changed["enabled"].clone(),
            changed["events"].clone(),
            changed["description"].clone()
        ),
        (json!(false), json!(["sandbox.deleted"]), json!("off"))
    );
    t.sandbox(&t.admin).await;
    let got = |id: &str| format!("/v1/webhooks/{id}/deliveries");
    let a = t.ok(&t.admin, "GET", &got(aid), None).await;
    let types: Vec<&str> = a["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["eventType"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["sandbox.running", "sandbox.created"]);
    assert_eq!(
        t.ok(&t.admin, "GET", &got(oid), None).await["data"],
        json!([])
    );
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/webhooks/{oid}:update"),
            Some(json!({"url": "https://10.0.0.1/"})),
        )
        .await;
    assert_eq!(
        (s, fields(&v)),
        (StatusCode::BAD_REQUEST, vec!["url".to_string()])
    );
    t.ok(
        &t.admin,
        "POST",
        &format!("/v1/webhooks/{aid}:delete"),
        None,
    )
    .await;
    let (s, _) = t
        .call(&t.admin, "GET", &format!("/v1/webhooks/{aid}"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}
