//! Warm machines through the router, against a fake host: a create takes
//! one of its shape's pool and gives it its identity; warm machines are not
//! listed; a warm machine that cannot take on its sandbox is ended and the
//! sandbox starts the usual way; a shutdown ends every warm machine; with
//! the pool off nothing is started ahead.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_server::{ensure_admin_key, open_store, router, AppState, Config};
use serde_json::{json, Value};
use tower::ServiceExt;

struct T {
    host: Arc<FakeHost>,
    state: AppState,
    admin: String,
}

impl T {
    fn new(warm_pool: u32) -> T {
        let dir = std::env::temp_dir().join(format!("rt-pool-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let store = open_store(&dir).unwrap();
        let host = Arc::new(FakeHost::default());
        let mut config = Config::new(&dir);
        config.warm_pool = warm_pool;
        let state = AppState::new(config, store, host.clone());
        T { host, state, admin }
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("prefer", "wait=10")
            .header("authorization", format!("Bearer {}", self.admin));
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

    async fn create(&self) -> Value {
        let (status, body) = self
            .call(
                "POST",
                "/v1/sandboxes",
                Some(json!({"vcpu": 1, "memoryMiB": 1024})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(body["state"], "running", "{body}");
        body
    }

    /// Waits until the fake has started `n` warm machines.
    async fn warm_started(&self, n: usize) {
        for _ in 0..500 {
            if self.host.warm.lock().unwrap().len() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{} warm machines started, not {n}",
            self.host.warm.lock().unwrap().len()
        );
    }
}

#[tokio::test]
async fn a_create_takes_a_warm_machine_and_gives_it_its_identity() {
    let t = T::new(2);
    // The first create of the shape finds its pool empty, and makes it.
    let first = t.create().await;
    let first_id = first["id"].as_str().unwrap().to_string();
    assert!(t.host.started.lock().unwrap().contains(&first_id));
    t.warm_started(2).await;
    let warm: Vec<String> = t.host.warm.lock().unwrap().clone();
    assert!(!warm.contains(&first_id));

    // Warm machines are nobody's.
    let (_, list) = t.call("GET", "/v1/sandboxes", None).await;
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [first_id.as_str()], "{list}");

    let second = t.create().await;
    let id = second["id"].as_str().unwrap().to_string();
    assert_eq!(id, warm[0], "the oldest warm machine is taken");
    assert!(
        !t.host.started.lock().unwrap().contains(&id),
        "it was started again"
    );
    let assumed = t.host.assumed.lock().unwrap().clone();
    assert_eq!(assumed.len(), 1);
    let spec = &assumed[0];
    assert_eq!(spec.id, id);
    assert_eq!(spec.hostname, format!("sbx-{}", &id[..8]));
    assert!(spec
        .guest_ca_pem
        .as_deref()
        .unwrap()
        .contains("BEGIN CERTIFICATE"));
    assert!(t.host.network(&id).is_some(), "its network is set");
    // The pool refills what was taken.
    t.warm_started(3).await;

    // A warm machine that cannot take on its sandbox is ended; the sandbox
    // starts the usual way, under the same id.
    *t.host.assume_fails.lock().unwrap() = true;
    let third = t.create().await;
    let id3 = third["id"].as_str().unwrap().to_string();
    assert!(t.host.warm.lock().unwrap().contains(&id3));
    assert!(t
        .host
        .stopped
        .lock()
        .unwrap()
        .contains(&(id3.clone(), false)));
    assert!(t.host.started.lock().unwrap().contains(&id3));

    // A shutdown ends every warm machine no sandbox took.
    t.warm_started(4).await;
    t.state.shutdown().await;
    let taken = [first_id, id, id3];
    let destroyed = t.host.destroyed.lock().unwrap().clone();
    for w in t.host.warm.lock().unwrap().iter() {
        if !taken.contains(w) {
            assert!(
                destroyed.contains(w),
                "warm machine {w} outlived the shutdown"
            );
        }
    }
    for s in &taken {
        assert!(
            !destroyed.contains(s),
            "sandbox {s} was ended by the shutdown"
        );
    }
}

#[tokio::test]
async fn with_the_pool_off_nothing_starts_ahead() {
    let t = T::new(0);
    t.create().await;
    t.create().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(t.host.warm.lock().unwrap().is_empty());
    assert_eq!(t.host.started.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_create_of_another_shape_finds_its_pool_empty() {
    let t = T::new(2);
    t.create().await;
    t.warm_started(2).await;
    // A shape of its own: no pool yet; the create starts its machine.
    let (status, body) = t
        .call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"vcpu": 2, "memoryMiB": 1024})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let id = body["id"].as_str().unwrap();
    assert!(t.host.started.lock().unwrap().iter().any(|s| s == id));
    assert!(t.host.assumed.lock().unwrap().is_empty());
}
