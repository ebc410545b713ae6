//! `GET /metrics` through the router, against a fake host: who may read it,
//! its format, and that what the server does moves its counters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use fake::FakeHost;
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
        let dir = std::env::temp_dir().join(format!("rt-telemetry-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let store = open_store(&dir).unwrap();
        let host = Arc::new(FakeHost::default());
        let state = AppState::new(Config::new(&dir), store, host.clone());
        T {
            dir,
            host,
            state,
            admin,
        }
    }

    async fn call(
        &self,
        key: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, HeaderMap, String) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("prefer", "wait=10");
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
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
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    async fn metrics(&self) -> String {
        let (status, headers, text) = self.call(Some(&self.admin), "GET", "/metrics", None).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(
            headers["content-type"],
            "text/plain; version=0.0.4; charset=utf-8"
        );
        text
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The value of one series (its name with labels, exactly).
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[tokio::test]
async fn only_the_accounts_keys_read_the_metrics() {
    let t = T::new();
    let (status, headers, body) = t.call(None, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(headers.contains_key("x-request-id"));
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "unauthorized");

    // A tenant's own key sees only its own sandboxes: not the server's.
    let tenant = create_key(&t.dir, Some("tenant"), false, false).unwrap();
    let (status, _, body) = t.call(Some(&tenant), "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "forbidden");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("account-wide or read-only"),
        "{err}"
    );

    // A read-only key made for the scraper may.
    let scraper = create_key(&t.dir, Some("scraper"), true, false).unwrap();
    let (status, _, body) = t.call(Some(&scraper), "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("# TYPE runtime_sandboxes gauge"), "{body}");

    let (status, _, _) = t.call(Some(&t.admin), "POST", "/metrics", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn what_the_server_does_moves_its_counters() {
    let t = T::new();
    let before = t.metrics().await;
    // A host that cannot tell its room has no host gauges.
    assert!(!before.contains("runtime_host_memory_total_bytes"));
    let gib = 1u64 << 30;
    *t.host.room.lock().unwrap() = Some(runtime_host::Room {
        memory_total: 16 * gib,
        memory_available: 12 * gib,
        ram_dir_total: 8 * gib,
        ram_dir_free: 8 * gib,
        disk_free: 100 * gib,
    });
    let created = value(&before, "runtime_sandboxes_created_total");
    let ok_2xx = value(&before, "runtime_http_responses_total{class=\"2xx\"}");

    let (status, _, body) = t
        .call(Some(&t.admin), "POST", "/v1/sandboxes", Some(json!({})))
        .await;
    assert!(status.is_success(), "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, _, body) = t
        .call(
            Some(&t.admin),
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "echo hi"})),
        )
        .await;
    assert!(status.is_success(), "{body}");
    let (status, _, _) = t
        .call(Some(&t.admin), "GET", "/v1/sandboxes/sbx_missing", None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, body) = t
        .call(
            Some(&t.admin),
            "POST",
            &format!("/v1/sandboxes/{id}:pause"),
            None,
        )
        .await;
    assert!(status.is_success(), "{body}");
    let (status, _, body) = t
        .call(
            Some(&t.admin),
            "POST",
            &format!("/v1/sandboxes/{id}:wake"),
            None,
        )
        .await;
    assert!(status.is_success(), "{body}");

    let after = t.metrics().await;
    assert_eq!(
        value(&after, "runtime_sandboxes_created_total"),
        created + 1.0
    );
    assert_eq!(value(&after, "runtime_sandboxes{state=\"running\"}"), 1.0);
    assert_eq!(
        value(
            &after,
            "runtime_machine_starts_total{from=\"image\",result=\"ok\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "runtime_machine_start_seconds_count{from=\"image\"}"
        ),
        1.0
    );
    assert_eq!(
        value(&after, "runtime_sandbox_pauses_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        value(&after, "runtime_sandbox_wakes_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(value(&after, "runtime_sandbox_wake_seconds_count"), 1.0);
    assert!(value(&after, "runtime_processes_started_total{kind=\"exec\"}") >= 1.0);
    assert_eq!(
        value(&after, "runtime_refusals_total{code=\"sandbox_not_found\"}"),
        1.0
    );
    assert!(value(&after, "runtime_http_responses_total{class=\"2xx\"}") >= ok_2xx + 4.0);
    assert!(value(&after, "runtime_http_responses_total{class=\"4xx\"}") >= 1.0);
    assert_eq!(
        value(&after, "runtime_host_memory_available_bytes"),
        (12 * gib) as f64
    );
    assert_eq!(
        value(&after, "runtime_host_disk_free_bytes"),
        (100 * gib) as f64
    );
}
