//! The server through its router, against a fake host.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

mod fake;
#[path = "support/pg.rs"]
mod pg;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use base64::Engine;
use fake::{FakeHost, Step};
use http_body_util::BodyExt;
use runtime_server::{
    create_key, ensure_admin_key, ensure_admin_key_in, open_store, router, AppState, Clock, Config,
    StoreAt,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

struct T {
    dir: PathBuf,
    host: Arc<FakeHost>,
    state: AppState,
    admin: String,
    /// Where its store is (the data dir's SQLite, or PostgreSQL).
    at: StoreAt,
    /// The PostgreSQL cluster of a server on it, stopped after the rest.
    _pg: Option<pg::PgCluster>,
}

fn tmpdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("rt-server-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl T {
    fn new() -> T {
        Self::with(|_| {})
    }

    /// A server whose clock follows tokio's: under `start_paused` its leases,
    /// idle pauses and retention move only with `tokio::time::advance`.
    fn on_paused_time() -> T {
        let now = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
        Self::with(|c| c.clock = Clock::following_tokio(now))
    }

    fn with(tweak: impl FnOnce(&mut Config)) -> T {
        let dir = tmpdir();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        Self::open(dir, admin, Arc::new(FakeHost::default()), tweak)
    }

    /// A server on a PostgreSQL store (a throwaway cluster), or `None`
    /// where PostgreSQL is not installed outside CI.
    fn on_postgres() -> Option<T> {
        let cluster = pg::PgCluster::start()?;
        let at = StoreAt::Postgres(cluster.database());
        let dir = tmpdir();
        let admin = ensure_admin_key_in(&dir, &at).unwrap().unwrap();
        let at2 = at.clone();
        let mut t = Self::open(dir, admin, Arc::new(FakeHost::default()), move |c| {
            c.store = Some(at2)
        });
        assert_eq!(t.at, at);
        t._pg = Some(cluster);
        Some(t)
    }

    fn open(
        dir: PathBuf,
        admin: String,
        host: Arc<FakeHost>,
        tweak: impl FnOnce(&mut Config),
    ) -> T {
        let mut config = Config::new(&dir);
        config.heartbeat = Duration::from_millis(200);
        tweak(&mut config);
        let at = config.store_at();
        let store = open_store(&at).unwrap();
        let state = AppState::new(config, store, host.clone());
        T {
            dir,
            host,
            state,
            admin,
            at,
            _pg: None,
        }
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: Body,
    ) -> (StatusCode, HeaderMap, Bytes) {
        let mut b = Request::builder().method(method).uri(path);
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = router(self.state.clone())
            .oneshot(b.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, bytes)
    }

    async fn json(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.json_as(&self.admin.clone(), method, path, body, &[])
            .await
    }

    async fn json_as(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value) {
        let idem = uuid::Uuid::new_v4().to_string();
        let mut h: Vec<(&str, &str)> = headers.to_vec();
        if method != "GET" && !headers.iter().any(|(k, _)| *k == "idempotency-key") {
            h.push(("idempotency-key", &idem));
        }
        let body = match body {
            Some(v) => {
                h.push(("content-type", "application/json"));
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        let (s, hd, b) = self.call(method, path, Some(key), &h, body).await;
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        if let Some(rid) = v.pointer("/error/requestId") {
            assert_eq!(
                hd.get("x-request-id").unwrap().to_str().unwrap(),
                rid.as_str().unwrap()
            );
        }
        (s, v)
    }

    async fn running(&self, body: Value) -> String {
        let (s, v) = self
            .json_as(
                &self.admin.clone(),
                "POST",
                "/v1/sandboxes",
                Some(body),
                &[("prefer", "wait=10")],
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["state"], "running", "{v}");
        v["id"].as_str().unwrap().to_string()
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn assert_error(v: &Value, status: u16, code: &str) {
    let e = &v["error"];
    assert_eq!(e["code"], code, "{v}");
    assert_eq!(e["status"], status, "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(
        e["requestId"]
            .as_str()
            .is_some_and(|r| r.starts_with("req_")),
        "{v}"
    );
}

fn ndjson(b: &[u8]) -> Vec<Value> {
    b.split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

#[tokio::test]
async fn missing_or_bad_key_is_401_with_the_error_body() {
    let t = T::new();
    let (s, h, b) = t
        .call("GET", "/v1/sandboxes", None, &[], Body::empty())
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_error(&v, 401, "unauthorized");
    assert_eq!(h["x-request-id"].to_str().unwrap(), v["error"]["requestId"]);
    let (s, v) = t
        .json_as("rtcloud_nope", "GET", "/v1/sandboxes", None, &[])
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_error(&v, 401, "unauthorized");
    // The admin key works, and ensure_admin_key does not make a second one.
    assert_eq!(t.json("GET", "/v1/sandboxes", None).await.0, StatusCode::OK);
    assert_eq!(ensure_admin_key(&t.dir).unwrap(), None);
}

#[tokio::test]
async fn read_only_keys_get_403_on_changes() {
    let t = T::new();
    let ro = create_key(&t.dir, Some("ro"), true, true).unwrap();
    let (s, v) = t
        .json_as(&ro, "POST", "/v1/sandboxes", Some(json!({})), &[])
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_error(&v, 403, "forbidden");
    let (s, _) = t.json_as(&ro, "GET", "/v1/sandboxes", None, &[]).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn keys_see_only_their_sandboxes() {
    let t = T::new();
    let a = create_key(&t.dir, Some("a"), false, false).unwrap();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let (s, v) = t
        .json_as(
            &a,
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "mine"})),
            &[("prefer", "wait=5")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    let id = v["id"].as_str().unwrap();
    let (s, v) = t
        .json_as(&b, "GET", &format!("/v1/sandboxes/{id}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "sandbox_not_found");
    let (s, _) = t
        .json_as(&b, "DELETE", &format!("/v1/sandboxes/{id}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, v) = t.json_as(&b, "GET", "/v1/sandboxes", None, &[]).await;
    assert_eq!(v["data"].as_array().unwrap().len(), 0);
    let (s, _) = t
        .json_as(&a, "GET", &format!("/v1/sandboxes/{id}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::OK);
    // The admin key is account-wide.
    let (s, _) = t.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn a_sandbox_name_belongs_to_its_key_and_get_or_create_never_adopts_anothers() {
    let t = T::new();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let create = |key: String, body: Value| {
        let t = &t;
        async move {
            t.json_as(
                &key,
                "POST",
                "/v1/sandboxes",
                Some(body),
                &[("prefer", "wait=5")],
            )
            .await
        }
    };
    let (s, theirs) = create(b.clone(), json!({"name": "worker"})).await;
    assert_eq!(s, StatusCode::CREATED, "{theirs}");
    // The account-wide admin key asks for "worker": it gets one of its own.
    let (s, mine) = create(
        t.admin.clone(),
        json!({"name": "worker", "getOrCreate": true}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{mine}");
    assert_ne!(mine["id"], theirs["id"]);
    assert_ne!(mine["reused"], true, "{mine}");
    // Each key's name is still taken for itself, and found by getOrCreate.
    let (s, again) = create(
        t.admin.clone(),
        json!({"name": "worker", "getOrCreate": true}),
    )
    .await;
    assert_eq!((s, &again["id"]), (StatusCode::OK, &mine["id"]), "{again}");
    let (s, v) = create(b.clone(), json!({"name": "worker"})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "name_taken");
    assert_eq!(v["error"]["details"]["sandboxId"], theirs["id"], "{v}");
    let (s, v) = create(b.clone(), json!({"name": "worker", "getOrCreate": true})).await;
    assert_eq!((s, &v["id"]), (StatusCode::OK, &theirs["id"]), "{v}");
}

#[tokio::test]
async fn a_sandbox_whose_network_settings_are_gone_gets_no_network() {
    let t = T::new();
    let kept = t.running(json!({"network": {"internet": true}})).await;
    let gone = t.running(json!({"network": {"internet": true}})).await;
    for id in [&kept, &gone] {
        let net = t.host.network(id).expect("no network set");
        assert!(net.policy.allows("example.com", 443).is_ok());
    }
    t.state.shutdown().await;
    // The record of one sandbox's rules is lost (a damaged store).
    let conn = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
    let n = conn
        .execute(
            "DELETE FROM net_docs WHERE kind = 'sandbox-net' AND scope = ?1",
            [&gone],
        )
        .unwrap();
    assert_eq!(n, 1);
    drop(conn);
    let host = Arc::new(FakeHost::default());
    for id in [&kept, &gone] {
        host.recoverable.lock().unwrap().insert(id.clone());
    }
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let net = host.network(&kept).expect("no network set");
    assert!(net.policy.allows("example.com", 443).is_ok());
    // Fails closed: no rules kept, no way out.
    let net = host.network(&gone).expect("no network set");
    assert!(net.policy.allows("example.com", 443).is_err());
    assert!(net.secrets.is_empty());
}

#[tokio::test]
async fn unknown_routes_and_malformed_json_use_the_one_error_body() {
    let t = T::new();
    let (s, v) = t.json("GET", "/v1/nothing", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "route_not_found");
    let (s, v) = t
        .json("POST", "/v1/sandboxes/x:frobnicate", Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["status"], 404);
    let (s, _, b) = t
        .call(
            "POST",
            "/v1/sandboxes",
            Some(&t.admin),
            &[
                ("content-type", "application/json"),
                ("idempotency-key", "k1"),
            ],
            Body::from("{not json"),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_error(&v, 400, "invalid_request");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "body");
    let (s, v) = t
        .json(
            "GET",
            "/v1/sandboxes/00000000-0000-0000-0000-000000000000",
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "sandbox_not_found");
}

#[tokio::test]
async fn one_400_names_every_wrong_field() {
    let t = T::new();
    let body = json!({
        "vcpu": 99, "memoryMiB": "lots", "user": "admin", "timeoutSeconds": 10,
        "bogus": 1, "network": {"internet": "no"}, "labels": {"a": 1}
    });
    let (s, v) = t.json("POST", "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, 400, "invalid_request");
    let mut fields: Vec<String> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap().to_string())
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "bogus",
            "labels.a",
            "memoryMiB",
            "network.internet",
            "timeoutSeconds",
            "user",
            "vcpu"
        ]
    );
    // Nothing was created.
    let (_, v) = t
        .json("GET", "/v1/sandboxes?includeStopped=true", None)
        .await;
    assert_eq!(v["data"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn sandbox_lifecycle_create_get_list_stop_delete() {
    let t = T::new();
    *t.host.start_delay_ms.lock().unwrap() = 50;
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "web", "labels": {"team": "search"}, "env": {"TOKEN": "s3cr3t-value"}, "vcpu": 4, "timeoutSeconds": 600})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "running");
    assert_eq!(v["status"], "active");
    assert_eq!(v["vcpu"], 4);
    assert_eq!(v["memoryMiB"], 4096);
    assert_eq!(v["envNames"], json!(["TOKEN"]));
    // The env's value is never echoed.
    assert!(!v.to_string().contains("s3cr3t-value"), "{v}");
    assert!(v["endsAt"].as_str().unwrap().ends_with('Z'));
    assert!(v["readyAt"].is_string());
    let id = v["id"].as_str().unwrap().to_string();

    // Without Prefer, create answers `starting`; waitFor then settles it.
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"labels": {"team": "ads"}})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(v["state"], "starting");
    assert_eq!(v["endsAt"], Value::Null);
    let id2 = v["id"].as_str().unwrap().to_string();
    let (_, v) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id2}?waitFor=running&timeoutSeconds=10"),
            None,
        )
        .await;
    assert_eq!(v["state"], "running");

    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"name": "web"})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "name_taken");
    assert_eq!(v["error"]["details"]["sandboxId"], id);
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "web", "getOrCreate": true})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["id"], id);
    assert_eq!(v["reused"], true);

    let id3 = t.running(json!({"labels": {"team": "search"}})).await;

    let (_, v) = t
        .json("GET", "/v1/sandboxes?label=team%3Asearch", None)
        .await;
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    // Oldest first, as the client documents.
    assert_eq!(ids, [id.as_str(), id3.as_str()]);
    let (_, v) = t.json("GET", "/v1/sandboxes?name=web", None).await;
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    // Paging with a cursor visits each one once.
    let (_, v) = t.json("GET", "/v1/sandboxes?limit=2", None).await;
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    let cursor = v["nextCursor"].as_str().unwrap().to_string();
    let (_, v2) = t
        .json(
            "GET",
            &format!("/v1/sandboxes?limit=2&cursor={cursor}"),
            None,
        )
        .await;
    assert_eq!(v2["data"].as_array().unwrap().len(), 1);
    assert_eq!(v2["nextCursor"], Value::Null);
    assert_eq!(v2["data"][0]["id"], id3);
    let (s, v) = t
        .json("GET", "/v1/sandboxes?limit=0&state=sleeping", None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"].as_array().unwrap().len(), 2);

    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:stop"),
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["state"], "stopped");
    assert_eq!(v["stopReason"], "requested");
    assert!(v["endedAt"].is_string());
    assert_eq!(
        t.host.stopped.lock().unwrap().as_slice(),
        &[(id.clone(), false)]
    );
    // A stopped sandbox no longer holds its name.
    let (_, v) = t.json("GET", "/v1/sandboxes?state=running", None).await;
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    let (_, v) = t
        .json("GET", "/v1/sandboxes?includeStopped=true", None)
        .await;
    assert_eq!(v["data"].as_array().unwrap().len(), 3);
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "sandbox_not_running");

    let (s, v) = t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["status"], "deleted");
    assert_eq!(v["state"], "stopped");
    assert_eq!(v["labels"], json!({"team": "search"}));
    let (s, again) = t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(again, v);
    let (s, _) = t.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        t.host.destroyed.lock().unwrap().as_slice(),
        std::slice::from_ref(&id)
    );
}

#[tokio::test]
async fn a_failed_start_is_stopped_with_start_failed() {
    let t = T::new();
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(json!({"memoryMiB": 128})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(v["state"], "stopped");
    assert_eq!(v["stopReason"], "start_failed");
}

#[tokio::test]
async fn idempotent_replay_and_reuse() {
    idempotent_replay_and_reuse_on(T::new()).await;
}

#[tokio::test]
async fn idempotent_replay_and_reuse_on_postgres() {
    if let Some(t) = T::on_postgres() {
        idempotent_replay_and_reuse_on(t).await;
    }
}

async fn idempotent_replay_and_reuse_on(t: T) {
    let h = [("idempotency-key", "create-1"), ("prefer", "wait=5")];
    let admin = t.admin.clone();
    let (s1, v1) = t
        .json_as(
            &admin,
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "once"})),
            &h,
        )
        .await;
    assert_eq!(s1, StatusCode::CREATED);
    let (_, hd, b) = t
        .call(
            "POST",
            "/v1/sandboxes",
            Some(&admin),
            &h,
            Body::from(json!({"name": "once"}).to_string()),
        )
        .await;
    let v2: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v2["id"], v1["id"]);
    assert_eq!(v2["replayed"], true);
    assert_eq!(hd["idempotency-replayed"], "true");
    assert_eq!(t.host.started.lock().unwrap().len(), 1);
    let (s, v) = t
        .json_as(
            &admin,
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "twice"})),
            &h,
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_error(&v, 422, "idempotency_key_reused");
    // Keys are per API key: another key may use the same idempotency key.
    let other = create_key(&t.at, None, false, true).unwrap();
    let (s, v) = t
        .json_as(
            &other,
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "other"})),
            &h,
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn a_duplicate_in_flight_waits_then_replays() {
    let t = T::new();
    *t.host.start_delay_ms.lock().unwrap() = 300;
    let admin = t.admin.clone();
    let h = [("idempotency-key", "same"), ("prefer", "wait=10")];
    let body = json!({"labels": {"x": "y"}});
    let (a, b) = tokio::join!(
        t.json_as(&admin, "POST", "/v1/sandboxes", Some(body.clone()), &h),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            t.json_as(&admin, "POST", "/v1/sandboxes", Some(body.clone()), &h)
                .await
        }
    );
    assert_eq!(a.0, StatusCode::CREATED);
    assert_eq!(b.0, StatusCode::CREATED);
    assert_eq!(a.1["id"], b.1["id"]);
    assert_eq!(b.1["replayed"], true);
    assert_eq!(b.1["state"], "running");
    assert_eq!(t.host.started.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn commands_and_kernels_take_only_valid_variable_names() {
    let t = T::new();
    let id = t.running(json!({})).await;
    for (path, body) in [
        (
            format!("/v1/sandboxes/{id}:exec"),
            json!({"command": "true", "env": {"OK_1": "a", "BAD=NAME": "b", "1X": "c"}}),
        ),
        (
            format!("/v1/sandboxes/{id}/interpreter/contexts"),
            json!({"language": "python", "env": {"BAD=NAME": "b", "1X": "c"}}),
        ),
    ] {
        let (s, v) = t.json("POST", &path, Some(body)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {v}");
        assert_error(&v, 400, "invalid_request");
        let mut fields: Vec<&str> = v["error"]["details"]["issues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["field"].as_str().unwrap())
            .collect();
        fields.sort();
        assert_eq!(fields, ["env.1X", "env.BAD=NAME"], "{path}: {v}");
    }
}

#[tokio::test]
async fn exec_answers_json_with_exit_code_and_stdin() {
    let t = T::new();
    let id = t.running(json!({"env": {"A": "1", "B": "2"}})).await;
    t.host.script(
        "hello",
        vec![
            Step::Out(b"hi\n".to_vec()),
            Step::Err(b"warn\n".to_vec()),
            Step::Exit(3),
        ],
    );
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "hello", "env": {"B": "3"}, "cwd": "/tmp"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["exitCode"], 3);
    assert_eq!(v["stdout"], "hi\n");
    assert_eq!(v["stderr"], "warn\n");
    assert_eq!(v["timedOut"], false);
    assert_eq!(v["stdoutTruncated"], false);
    assert!(v["processId"].as_str().unwrap().starts_with("proc_"));
    let spec = t.host.last_exec.lock().unwrap().clone().unwrap();
    assert_eq!(spec.argv, ["bash", "-c", "hello"]);
    assert_eq!(spec.cwd.as_deref(), Some("/tmp"));
    assert!(spec.kill_group_on_exit);
    assert_eq!(spec.timeout, Some(Duration::from_secs(60)));
    // The request's env comes after the sandbox's, so it wins.
    let b_vals: Vec<&str> = spec
        .env
        .iter()
        .filter(|(k, _)| k == "B")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(b_vals.last(), Some(&"3"));

    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"argv": ["cat"], "stdin": "abc"})),
        )
        .await;
    assert_eq!(v["stdout"], "abc");
    assert_eq!(v["exitCode"], 0);

    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "x", "argv": ["y"], "timeoutMs": -1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn exec_keeps_64_kib_per_stream() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let mut steps: Vec<Step> = (0..20).map(|_| Step::Out(vec![b'x'; 10_000])).collect();
    steps.push(Step::Err(b"small".to_vec()));
    steps.push(Step::Exit(0));
    t.host.script("big", steps);
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "big"})),
        )
        .await;
    assert_eq!(v["stdout"].as_str().unwrap().len(), 65_536);
    assert_eq!(v["stdoutTruncated"], true);
    assert_eq!(v["stderr"], "small");
    assert_eq!(v["stderrTruncated"], false);
}

#[tokio::test]
async fn streamed_exec_sends_ndjson_with_byte_offsets() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let euro = "€".as_bytes(); // e2 82 ac
    t.host.script(
        "mixed",
        vec![
            Step::Out(b"a".to_vec()),
            Step::Err(b"bb".to_vec()),
            Step::Out(euro[..2].to_vec()),
            Step::Sleep(30),
            Step::Out([&euro[2..], b"\n"].concat()),
            Step::Out(vec![0xff, b'x']),
            Step::Exit(0),
        ],
    );
    let (s, h, b) = t
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(&t.admin),
            &[
                ("idempotency-key", "stream-1"),
                ("accept", "application/x-ndjson"),
            ],
            Body::from(
                json!({"command": "mixed", "stream": true, "timeoutMs": 86_400_000}).to_string(),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["content-type"], "application/x-ndjson");
    let ev = ndjson(&b);
    let types: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["start", "stdout", "stderr", "stdout", "stdout", "exit"],
        "{ev:?}"
    );
    let pid = ev[0]["processId"].as_str().unwrap().to_string();
    assert_eq!(
        (ev[1]["data"].as_str(), ev[1]["offset"].as_u64()),
        (Some("a"), Some(0))
    );
    assert_eq!(
        (ev[2]["data"].as_str(), ev[2]["offset"].as_u64()),
        (Some("bb"), Some(1))
    );
    assert_eq!(
        (ev[3]["data"].as_str(), ev[3]["offset"].as_u64()),
        (Some("€\n"), Some(3))
    );
    assert!(ev[3].get("base64").is_none());
    assert_eq!(ev[4]["offset"], 7);
    assert_eq!(
        ev[4]["base64"],
        base64::engine::general_purpose::STANDARD.encode([0xff, b'x'])
    );
    assert_eq!(ev[5]["exitCode"], 0);
    assert_eq!(ev[5]["state"], "exited");

    // Resuming from a cursor replays only what follows it.
    let (_, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?cursor=3&follow=true"),
            Some(&t.admin),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    assert_eq!(ev[0]["offset"], 3);
    assert_eq!(ev[0]["data"], "€\n");
    assert_eq!(ev.last().unwrap()["type"], "exit");
    // A duplicate of the stream follows the same process (it does not run twice).
    let (_, h, b) = t
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(&t.admin),
            &[("idempotency-key", "stream-1")],
            Body::from(
                json!({"command": "mixed", "stream": true, "timeoutMs": 86_400_000}).to_string(),
            ),
        )
        .await;
    assert_eq!(h["idempotency-replayed"], "true");
    let ev = ndjson(&b);
    assert_eq!(ev[0]["processId"], pid.as_str());
    assert_eq!(ev.len(), 6);
}

#[tokio::test]
async fn a_reader_behind_the_buffer_gets_truncated() {
    let t = T::new();
    let id = t.running(json!({})).await;
    // 3 MiB of output; 1 MiB is kept.
    let mut steps: Vec<Step> = (0..48).map(|_| Step::Out(vec![b'y'; 65_536])).collect();
    steps.push(Step::Exit(0));
    t.host.script("flood", steps);
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "flood"})),
        )
        .await;
    let pid = v["processId"].as_str().unwrap();
    let (_, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?cursor=0"),
            Some(&t.admin),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    assert_eq!(ev[0]["type"], "truncated");
    assert_eq!(ev[0]["droppedBytes"], 2 << 20);
    assert_eq!(ev[0]["resumeAt"], 2 << 20);
    assert_eq!(ev[1]["offset"], 2 << 20);
    let got: usize = ev
        .iter()
        .filter_map(|e| e["data"].as_str())
        .map(str::len)
        .sum();
    assert_eq!(got, 1 << 20);
}

#[tokio::test]
async fn process_output_polls_as_json_with_wait_ms() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script(
        "slow",
        vec![
            Step::Out(b"one\n".to_vec()),
            Step::Sleep(400),
            Step::Out(b"two\n".to_vec()),
            Step::Exit(0),
        ],
    );
    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"command": "slow"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    let pid = p["id"].as_str().unwrap().to_string();
    let url = |q: &str| format!("/v1/sandboxes/{id}/processes/{pid}/output?{q}");
    let mut text = String::new();
    let mut cursor = 0;
    let mut polls = 0;
    let last = loop {
        polls += 1;
        let (s, v) = t
            .json("GET", &url(&format!("cursor={cursor}&waitMs=2000")), None)
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        for c in v["chunks"].as_array().unwrap() {
            assert_eq!(c["stream"], "stdout");
            text.push_str(c["text"].as_str().unwrap());
        }
        cursor = v["nextCursor"].as_u64().unwrap();
        if v["process"]["state"] == "exited" && v["chunks"].as_array().unwrap().is_empty() {
            break v;
        }
        assert!(polls < 10, "{v}");
    };
    assert_eq!(text, "one\ntwo\n");
    assert_eq!((cursor, last["process"]["exitCode"].as_i64()), (8, Some(0)));
    // Without waitMs, a JSON-only Accept gets the same form at once.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "GET",
            &url("cursor=4"),
            None,
            &[("accept", "application/json")],
        )
        .await;
    assert_eq!(
        (s, v["chunks"][0]["text"].as_str()),
        (StatusCode::OK, Some("two\n"))
    );
    let (s, v) = t.json("GET", &url("cursor=0&waitMs=60001"), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "waitMs");
}

#[tokio::test]
async fn traced_files_come_with_the_exit_and_from_the_process() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host
        .script("build", vec![Step::Out(b"ok\n".to_vec()), Step::Exit(0)]);
    let want = json!({"read": ["/etc/", "/usr/bin/build"], "written": ["/workspace/build.out"], "truncated": false});
    // A plain exec: the answer carries them.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "build", "traceFiles": true})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        t.host
            .last_exec
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .trace_files
    );
    assert_eq!(v["files"], want);
    let exec_pid = v["processId"].as_str().unwrap().to_string();
    // So does the process afterwards.
    let (s, v) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{exec_pid}/files"),
            None,
        )
        .await;
    assert_eq!((s, &v), (StatusCode::OK, &want));
    // Untraced: no files in the answer, and the process says why it has none.
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "build", "traceFiles": false})),
        )
        .await;
    assert!(v.get("files").is_none(), "{v}");
    assert!(
        !t.host
            .last_exec
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .trace_files
    );
    let plain = v["processId"].as_str().unwrap().to_string();
    let (s, v) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{plain}/files"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["code"], "process_not_traced");
    // Streamed: the exit event carries them.
    let (s, _, b) = t
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(&t.admin),
            &[("accept", "application/x-ndjson")],
            Body::from(json!({"command": "build", "stream": true, "traceFiles": true}).to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let ev = ndjson(&b);
    let exit = ev.last().unwrap();
    assert_eq!(exit["type"], "exit");
    assert_eq!(exit["files"], want);
    // A spawned process: 409 while it runs, the lists once it ended.
    t.host
        .script("slowbuild", vec![Step::Sleep(300), Step::Exit(0)]);
    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"command": "slowbuild", "traceFiles": true})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    assert_eq!(p["traceFiles"], true);
    let pid = p["id"].as_str().unwrap().to_string();
    let files = format!("/v1/sandboxes/{id}/processes/{pid}/files");
    let (s, v) = t.json("GET", &files, None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "process_running");
    let mut tries = 0;
    let v = loop {
        let (s, v) = t.json("GET", &files, None).await;
        if s == StatusCode::OK {
            break v;
        }
        tries += 1;
        assert!(tries < 100, "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(v["written"], json!(["/workspace/slowbuild.out"]));
    assert_eq!(v["truncated"], false);
    // Unknown processes are 404; a wrong type is named.
    let (s, _) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/proc_nope/files"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "build", "traceFiles": "yes"})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "traceFiles");
    // An agent older than traced files: 501, and nothing ran.
    *t.host.old_agent.lock().unwrap() = true;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "build", "traceFiles": true})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{v}");
    assert_eq!(v["error"]["code"], "unsupported");
}

#[tokio::test]
async fn spawned_process_takes_offset_tracked_input() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"argv": ["cat"], "stdinMode": "pipe"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    assert_eq!(p["state"], "running");
    let pid = p["id"].as_str().unwrap().to_string();
    let w = |data: &str, offset: u64, eof: bool| json!({"base64": base64::engine::general_purpose::STANDARD.encode(data), "offset": offset, "eof": eof});
    let path = format!("/v1/sandboxes/{id}/processes/{pid}:write");
    let (_, v) = t.json("POST", &path, Some(w("hello", 0, false))).await;
    assert_eq!(v["offset"], 5);
    // A retried write is not typed twice.
    let (_, v) = t.json("POST", &path, Some(w("hello", 0, false))).await;
    assert_eq!(v["offset"], 5);
    let (s, v) = t.json("POST", &path, Some(w("zzz", 9, false))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["details"]["offset"], 5);
    let (_, v) = t.json("POST", &path, Some(w("lo world", 3, true))).await;
    assert_eq!(v["offset"], 11);
    let (_, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?cursor=6&follow=true"),
            Some(&t.admin),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    assert_eq!(ev[0]["data"], "world");
    assert_eq!(ev[0]["offset"], 6);
    assert_eq!(ev.last().unwrap()["type"], "exit");
    assert_eq!(t.host.stdin_seen.lock().unwrap().as_slice(), b"hello world");
    let (_, v) = t
        .json("GET", &format!("/v1/sandboxes/{id}/processes"), None)
        .await;
    assert_eq!(v["data"][0]["id"], pid.as_str());
    assert_eq!(v["data"][0]["state"], "exited");
    assert_eq!(v["data"][0]["stdinOffset"], 11);
    let (s, _) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/proc_nope"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn uploads_take_chunks_in_any_order_and_check_sha256() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let data: Vec<u8> = (0..2_621_440u32).map(|i| (i % 251) as u8).collect();
    let sha = hex::encode(Sha256::digest(&data));
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{id}/uploads"), Some(json!({"path": "/workspace/big.bin", "size": data.len(), "sha256": sha, "mode": "755"})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["mode"], "755");
    let u = v["uploadId"].as_str().unwrap().to_string();
    let step = v["chunkBytes"].as_u64().unwrap() as usize;
    let commit = format!("/v1/sandboxes/{id}/uploads/{u}:commit");
    for (n, off) in [2 * step, 0].into_iter().enumerate() {
        let chunk = data[off..(off + step).min(data.len())].to_vec();
        let key = format!("c{n}");
        let (s, _, _) = t
            .call(
                "PUT",
                &format!("/v1/sandboxes/{id}/uploads/{u}?offset={off}"),
                Some(&t.admin),
                &[("idempotency-key", &key)],
                Body::from(chunk),
            )
            .await;
        assert_eq!(s, StatusCode::OK);
    }
    let (s, v) = t.json("POST", &commit, Some(json!({}))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "upload_incomplete");
    let chunk = data[step..2 * step].to_vec();
    t.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/uploads/{u}?offset={step}"),
        Some(&t.admin),
        &[("idempotency-key", "c9")],
        Body::from(chunk),
    )
    .await;
    let (s, v) = t.json("POST", &commit, Some(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let files = t.host.files.lock().unwrap().clone();
    let (stored, mode) = files
        .get(&(id.clone(), "/workspace/big.bin".into()))
        .unwrap();
    assert_eq!(stored, &data);
    assert_eq!(*mode, 0o755);

    // A wrong sha256 is refused at commit and nothing is written.
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/uploads"),
            Some(json!({"path": "/workspace/bad.bin", "size": 4, "sha256": "0".repeat(64)})),
        )
        .await;
    let u = v["uploadId"].as_str().unwrap().to_string();
    t.call(
        "PUT",
        &format!("/v1/sandboxes/{id}/uploads/{u}?offset=0"),
        Some(&t.admin),
        &[("idempotency-key", "b0")],
        Body::from("abcd"),
    )
    .await;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/uploads/{u}:commit"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_error(&v, 422, "checksum_mismatch");
    assert!(!t
        .host
        .files
        .lock()
        .unwrap()
        .contains_key(&(id.clone(), "/workspace/bad.bin".into())));
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/uploads/{u}:abort"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["aborted"], true);
}

#[tokio::test]
async fn files_round_trip_and_map_guest_errors() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let base = format!("/v1/sandboxes/{id}");
    let (s, _, _) = t
        .call(
            "PUT",
            &format!("{base}/files/content?path=%2Fworkspace%2Fa.txt&mode=600"),
            Some(&t.admin),
            &[("idempotency-key", "w1")],
            Body::from("hello"),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, h, b) = t
        .call(
            "GET",
            &format!("{base}/files/content?path=/workspace/a.txt"),
            Some(&t.admin),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(&b[..], b"hello");
    assert_eq!(h["x-content-length"], "5");
    assert_eq!(h["x-content-sha256"], hex::encode(Sha256::digest(b"hello")));
    let (_, v) = t
        .json(
            "GET",
            &format!("{base}/files/stat?path=/workspace/a.txt"),
            None,
        )
        .await;
    assert_eq!(v["exists"], true);
    assert_eq!(v["mode"], "600");
    assert_eq!(v["type"], "file");
    assert!(v["modifiedAt"].as_str().unwrap().ends_with('Z'));
    let (_, v) = t
        .json(
            "GET",
            &format!("{base}/files/stat?path=/workspace/none"),
            None,
        )
        .await;
    assert_eq!(v, json!({"exists": false}));
    let (_, v) = t
        .json("GET", &format!("{base}/files/list?glob=*.txt"), None)
        .await;
    assert_eq!(v["data"][0]["name"], "a.txt");
    // A glob that would cost a list too much is refused, by name.
    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/files/list?glob={}", "*a".repeat(513)),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "glob", "{v}");
    // Stars cost nothing: the matcher does not backtrack.
    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/files/list?glob={}b", "*a".repeat(200)),
            None,
        )
        .await;
    assert_eq!(
        (s, v["data"].as_array().map(Vec::len)),
        (StatusCode::OK, Some(0)),
        "{v}"
    );

    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/files/content?path=/workspace/none"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "file_not_found");
    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/files/content?path=/workspace"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "is_a_directory");
    let (s, v) = t
        .json("GET", &format!("{base}/files/content?path=/root/x"), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_error(&v, 403, "permission_denied");
    let (s, v) = t
        .json(
            "POST",
            &format!("{base}/files:mkdir"),
            Some(json!({"path": "/workspace", "parents": false})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "already_exists");
    let (s, v) = t
        .json("GET", &format!("{base}/files/content?path=relative"), None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "path");

    let (s, _) = t
        .json(
            "POST",
            &format!("{base}/files:rename"),
            Some(json!({"from": "/workspace/a.txt", "to": "/workspace/b.txt", "overwrite": false})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = t
        .json(
            "POST",
            &format!("{base}/files:remove"),
            Some(json!({"path": "/workspace/b.txt", "recursive": false})),
        )
        .await;
    assert_eq!(v["removed"], true);
    let (_, v) = t
        .json(
            "POST",
            &format!("{base}/files:remove"),
            Some(json!({"path": "/workspace/b.txt", "recursive": false})),
        )
        .await;
    assert_eq!(v["removed"], false);

    let (s, _, b) = t
        .call(
            "PUT",
            &format!("{base}/files/content?path=/workspace/huge"),
            Some(&t.admin),
            &[("idempotency-key", "w2")],
            Body::from(vec![0u8; (1 << 20) + 1]),
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_error(&v, 413, "payload_too_large");
}

#[tokio::test]
async fn slow_answers_are_sent_late() {
    let t = T::with(|c| c.late_answer_after = Duration::from_millis(100));
    let id = t.running(json!({})).await;
    t.host.script(
        "slow",
        vec![Step::Sleep(400), Step::Out(b"done".to_vec()), Step::Exit(0)],
    );
    let (s, h, b) = t
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(&t.admin),
            &[("idempotency-key", "slow-1")],
            Body::from(json!({"command": "slow"}).to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["runtime-late-answer"], "true");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["stdout"], "done");
    // A late error is the one error body.
    let (s, h, b) = t
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(&t.admin),
            &[("idempotency-key", "slow-2")],
            Body::from(json!({"command": "slowfail"}).to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(h["runtime-late-answer"], "true");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v.as_object().unwrap().len(), 1);
    assert_error(&v, 400, "command_not_found");
}

#[tokio::test]
async fn restart_recovers_found_sandboxes_and_stops_lost_ones() {
    let t = T::new();
    let kept = t.running(json!({"name": "kept"})).await;
    let lost = t.running(json!({"name": "lost"})).await;
    let stopped = t.running(json!({})).await;
    t.json_as(
        &t.admin.clone(),
        "POST",
        &format!("/v1/sandboxes/{stopped}:stop"),
        Some(json!({})),
        &[("prefer", "wait=5")],
    )
    .await;
    t.state.shutdown().await;

    let host = Arc::new(FakeHost::default());
    host.recoverable.lock().unwrap().insert(kept.clone());
    host.recoverable.lock().unwrap().insert(stopped.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host, |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let (_, v) = t2.json("GET", &format!("/v1/sandboxes/{kept}"), None).await;
    assert_eq!(v["state"], "running");
    assert_eq!(v["name"], "kept");
    let (_, v) = t2.json("GET", &format!("/v1/sandboxes/{lost}"), None).await;
    assert_eq!(v["state"], "stopped");
    assert_eq!(v["stopReason"], "host_lost");
    let (_, v) = t2
        .json("GET", &format!("/v1/sandboxes/{stopped}"), None)
        .await;
    assert_eq!(v["stopReason"], "requested");
}

// ---- memory: pause, wake, auto-wake, leases, idle, fork, snapshots ----

impl T {
    async fn act(&self, id: &str, verb: &str, body: Value) -> (StatusCode, Value) {
        self.json_as(
            &self.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:{verb}"),
            Some(body),
            &[("prefer", "wait=10")],
        )
        .await
    }

    async fn sandbox(&self, id: &str) -> Value {
        self.json("GET", &format!("/v1/sandboxes/{id}"), None)
            .await
            .1
    }

    /// Edits a stored record field, as time passing would.
    fn set_field(&self, id: &str, field: &str, value: &str) {
        let conn = rusqlite::Connection::open(self.dir.join("runtime.db")).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        let n = conn
            .execute(
                &format!(
                    "UPDATE sandboxes SET record = json_set(record, '$.{field}', ?1) WHERE id = ?2"
                ),
                rusqlite::params![value, id],
            )
            .unwrap();
        assert_eq!(n, 1);
    }

    async fn wait_state(&self, id: &str, want: &str) -> Value {
        for _ in 0..100 {
            let (s, v) = self.json("GET", &format!("/v1/sandboxes/{id}"), None).await;
            if (want == "gone" && s == StatusCode::NOT_FOUND) || v["state"] == want {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{id} never reached {want}: {}", self.sandbox(id).await);
    }
}

#[tokio::test]
async fn pause_then_wake_and_the_idempotent_repeats() {
    let t = T::new();
    let id = t.running(json!({"timeoutSeconds": 600})).await;
    let (s, v) = t.act(&id, "pause", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "paused");
    assert_eq!(v["status"], "paused");
    assert!(
        v["pausedAt"].as_str().is_some_and(|p| p.ends_with('Z')),
        "{v}"
    );
    assert_eq!(t.host.paused.lock().unwrap().as_slice(), [id.as_str()]);
    // Pausing a paused sandbox is fine and does not reach the host again.
    let (s, v) = t.act(&id, "pause", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("paused")));
    assert_eq!(t.host.paused.lock().unwrap().len(), 1);

    let (s, v) = t.act(&id, "wake", json!({"timeoutSeconds": 120})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running");
    assert_eq!(v["status"], "active");
    assert_eq!(v["pausedAt"], Value::Null);
    assert_eq!(v["timeoutSeconds"], 120);
    assert_eq!(t.host.woken.lock().unwrap().as_slice(), [id.as_str()]);
    // Waking a running sandbox answers the record.
    let (s, v) = t.act(&id, "wake", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    assert_eq!(t.host.woken.lock().unwrap().len(), 1);

    let (s, v) = t
        .act(&id, "wake", json!({"timeoutSeconds": 5, "x": 1}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["timeoutSeconds", "x"]);

    // Without Prefer the answer is the transitional state.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:pause"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["state"] == "pausing" || v["state"] == "paused", "{v}");
    t.wait_state(&id, "paused").await;

    // Stop of a paused sandbox works.
    let (s, v) = t.act(&id, "stop", json!({})).await;
    assert_eq!(
        (s, v["state"].as_str()),
        (StatusCode::OK, Some("stopped")),
        "{v}"
    );
    let (s, v) = t.act(&id, "pause", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "sandbox_not_running");
}

#[tokio::test]
async fn a_call_on_a_paused_sandbox_wakes_it_once() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host
        .script("hello", vec![Step::Out(b"hi\n".to_vec()), Step::Exit(0)]);
    t.act(&id, "pause", json!({})).await;
    *t.host.wake_delay_ms.lock().unwrap() = 300;
    let call = |path: String, body: Value| {
        let st = t.state.clone();
        let admin = t.admin.clone();
        tokio::spawn(async move {
            let req = Request::builder()
                .method("POST")
                .uri(path)
                .header("authorization", format!("Bearer {admin}"))
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .body(Body::from(body.to_string()))
                .unwrap();
            let resp = router(st).oneshot(req).await.unwrap();
            let status = resp.status();
            let b = resp.into_body().collect().await.unwrap().to_bytes();
            (status, serde_json::from_slice::<Value>(&b).unwrap())
        })
    };
    let a = call(
        format!("/v1/sandboxes/{id}:exec"),
        json!({"command": "hello"}),
    );
    let b = call(
        format!("/v1/sandboxes/{id}:exec"),
        json!({"command": "hello"}),
    );
    // A wake asked for while the auto-wake runs joins it.
    let c = call(format!("/v1/sandboxes/{id}:wake"), json!({}));
    for h in [a, b] {
        let (s, v) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["stdout"], "hi\n");
    }
    let (s, v) = c.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(t.host.woken.lock().unwrap().as_slice(), [id.as_str()]);
    let v = t.sandbox(&id).await;
    assert_eq!(v["state"], "running");
    assert!(v["lastActiveAt"].as_str().is_some());

    // Files wake it too.
    t.act(&id, "pause", json!({})).await;
    let (s, _, _) = t
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files/content?path=/workspace/a"),
            Some(&t.admin),
            &[("idempotency-key", "w1")],
            Body::from("x"),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t.host.woken.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn without_auto_wake_a_paused_sandbox_answers_409() {
    let t = T::new();
    let id = t.running(json!({"autoWake": false})).await;
    t.act(&id, "pause", json!({})).await;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "x"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "sandbox_paused");
    let (s, v) = t
        .json(
            "GET",
            &format!("/v1/sandboxes/{id}/files/content?path=/a"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "sandbox_paused");
    assert!(t.host.woken.lock().unwrap().is_empty());
    // A sandbox created with pausable: false refuses to pause.
    let other = t.running(json!({"pausable": false})).await;
    let (s, v) = t.act(&other, "pause", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "not_pausable");
}

#[tokio::test]
async fn a_bad_exec_or_spawn_on_a_paused_sandbox_is_refused_without_waking_it() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.act(&id, "pause", json!({})).await;
    for (path, body) in [
        (format!("/v1/sandboxes/{id}:exec"), json!({"command": 5})),
        (
            format!("/v1/sandboxes/{id}/processes"),
            json!({"argv": [], "pty": 1}),
        ),
    ] {
        let (s, v) = t.json("POST", &path, Some(body)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_error(&v, 400, "invalid_request");
    }
    assert!(t.host.woken.lock().unwrap().is_empty());
    assert_eq!(t.sandbox(&id).await["state"], "paused");
}

#[tokio::test]
async fn delete_while_paused_destroys_the_saved_state() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.act(&id, "pause", json!({})).await;
    let (s, v) = t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "deleted");
    t.wait_state(&id, "gone").await;
    for _ in 0..50 {
        if t.host.destroyed.lock().unwrap().contains(&id) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never destroyed");
}

impl T {
    /// A raw streamed call, collected whole.
    fn stream(
        &self,
        method: &str,
        path: String,
        body: Option<Value>,
    ) -> tokio::task::JoinHandle<Bytes> {
        let st = self.state.clone();
        let admin = self.admin.clone();
        let method = method.to_string();
        tokio::spawn(async move {
            let req = Request::builder()
                .method(method.as_str())
                .uri(path)
                .header("authorization", format!("Bearer {admin}"))
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .body(match body {
                    Some(b) => Body::from(b.to_string()),
                    None => Body::empty(),
                })
                .unwrap();
            let resp = router(st).oneshot(req).await.unwrap();
            resp.into_body().collect().await.unwrap().to_bytes()
        })
    }

    async fn spawn_proc(&self, id: &str, cmd: &str) -> String {
        let (s, v) = self
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/processes"),
                Some(json!({ "command": cmd })),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    async fn wait_proc_exited(&self, id: &str, pid: &str) -> Value {
        for _ in 0..100 {
            let (_, v) = self
                .json("GET", &format!("/v1/sandboxes/{id}/processes/{pid}"), None)
                .await;
            if v["state"] != "running" {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("process {pid} never ended");
    }
}

/// Output events joined, checking that offsets follow each other.
fn joined_output(events: &[Value], mut at: u64) -> (String, u64) {
    let mut out = String::new();
    for e in events {
        if e["type"] == "stdout" || e["type"] == "stderr" {
            assert_eq!(
                e["offset"].as_u64(),
                Some(at),
                "gap or duplicate: {events:?}"
            );
            let d = e["data"].as_str().unwrap();
            at += d.len() as u64;
            out.push_str(d);
        }
    }
    (out, at)
}

fn pausable_script() -> Vec<Step> {
    vec![
        Step::Out(b"a\n".to_vec()),
        Step::Sleep(300),
        Step::Out(b"b\n".to_vec()),
        Step::Sleep(100),
        Step::Out(b"c\n".to_vec()),
        Step::Exit(0),
    ]
}

#[tokio::test]
async fn a_pause_ends_a_streamed_exec_with_continue_and_following_resumes_it() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script("long", pausable_script());
    let stream = t.stream(
        "POST",
        format!("/v1/sandboxes/{id}:exec"),
        Some(json!({"command": "long", "stream": true})),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (s, v) = t.act(&id, "pause", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("paused")));
    let b = tokio::time::timeout(Duration::from_secs(5), stream)
        .await
        .unwrap()
        .unwrap();
    let ev = ndjson(&b);
    assert_eq!(ev[0]["type"], "start", "{ev:?}");
    let pid = ev[0]["processId"].as_str().unwrap().to_string();
    let last = ev.last().unwrap();
    assert_eq!(last["type"], "continue", "{ev:?}");
    assert_eq!(last["processId"], pid.as_str());
    let (first, at) = joined_output(&ev, 0);
    assert_eq!(first, "a\n");
    assert_eq!(last["cursor"].as_u64(), Some(at));
    // Still running while paused.
    let (_, p) = t.process(&id, &pid).await;
    assert_eq!(p["state"], "running", "{p}");
    assert_eq!(t.sandbox(&id).await["state"], "paused");

    // Following from the cursor wakes the sandbox and yields the rest.
    let (s, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?cursor={at}&follow=true"),
            Some(&t.admin.clone()),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let ev = ndjson(&b);
    let (rest, _) = joined_output(&ev, at);
    assert_eq!(format!("{first}{rest}"), "a\nb\nc\n", "{ev:?}");
    let last = ev.last().unwrap();
    assert_eq!(last["type"], "exit", "{ev:?}");
    assert_eq!(
        (last["exitCode"].as_i64(), last["state"].as_str()),
        (Some(0), Some("exited"))
    );
    assert_eq!(t.sandbox(&id).await["state"], "running");
    assert_eq!(t.host.woken.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn an_unstreamed_exec_answers_after_the_wake() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script("long", pausable_script());
    let exec = t.stream(
        "POST",
        format!("/v1/sandboxes/{id}:exec"),
        Some(json!({"command": "long"})),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    t.act(&id, "pause", json!({})).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!exec.is_finished());
    t.act(&id, "wake", json!({})).await;
    let b = tokio::time::timeout(Duration::from_secs(5), exec)
        .await
        .unwrap()
        .unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (v["exitCode"].as_i64(), v["stdout"].as_str()),
        (Some(0), Some("a\nb\nc\n")),
        "{v}"
    );
}

#[tokio::test]
async fn a_spawned_process_runs_on_across_a_pause_and_its_exit_is_recorded() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script(
        "bg",
        vec![
            Step::Out(b"x\n".to_vec()),
            Step::Sleep(300),
            Step::Out(b"y\n".to_vec()),
            Step::Sleep(300),
            Step::Exit(7),
        ],
    );
    let pid = t.spawn_proc(&id, "bg").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    t.act(&id, "pause", json!({})).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(t.process(&id, &pid).await.1["state"], "running");
    let (s, v) = t.act(&id, "wake", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    assert_eq!(t.process(&id, &pid).await.1["state"], "running");
    let v = t.wait_proc_exited(&id, &pid).await;
    assert_eq!(
        (v["state"].as_str(), v["exitCode"].as_i64()),
        (Some("exited"), Some(7)),
        "{v}"
    );
    assert_eq!(v["outputBytes"], 4);
    let (_, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?cursor=0"),
            Some(&t.admin.clone()),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    assert_eq!(joined_output(&ev, 0).0, "x\ny\n");
    assert_eq!(ev.last().unwrap()["type"], "exit");
}

#[tokio::test]
async fn a_process_whose_attach_fails_after_the_wake_is_lost() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host
        .script("forever", vec![Step::Sleep(60_000), Step::Exit(0)]);
    let pid = t.spawn_proc(&id, "forever").await;
    t.act(&id, "pause", json!({})).await;
    t.host.procs.lock().unwrap().clear();
    t.act(&id, "wake", json!({})).await;
    assert_eq!(t.process(&id, &pid).await.1["state"], "lost");
}

#[tokio::test]
async fn a_restart_while_paused_keeps_the_process_for_the_wake() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script(
        "bg",
        vec![
            Step::Out(b"x\n".to_vec()),
            Step::Sleep(300),
            Step::Out(b"y\n".to_vec()),
            Step::Exit(5),
        ],
    );
    let pid = t.spawn_proc(&id, "bg").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    t.act(&id, "pause", json!({})).await;
    t.state.shutdown().await;

    let t2 = T::open(t.dir.clone(), t.admin.clone(), t.host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    assert_eq!(t2.sandbox(&id).await["state"], "paused");
    let (s, v) = t2.process(&id, &pid).await;
    assert_eq!(
        (s, v["state"].as_str()),
        (StatusCode::OK, Some("running")),
        "{v}"
    );
    assert_eq!(v["outputBytes"], 2);
    t2.act(&id, "wake", json!({})).await;
    let v = t2.wait_proc_exited(&id, &pid).await;
    assert_eq!(
        (v["state"].as_str(), v["exitCode"].as_i64()),
        (Some("exited"), Some(5)),
        "{v}"
    );
    assert_eq!(v["outputBytes"], 4);
    t2.state.shutdown().await;
}

// ---- persistent sandboxes and :restart ----

#[tokio::test]
async fn a_persistent_sandbox_keeps_its_disk_across_stop_and_restart() {
    let t = T::new();
    let id = t
        .running(json!({"persistent": true, "name": "keeper"}))
        .await;
    let disk = t.dir.join("disks").join(&id);
    let (s, v) = t.act(&id, "stop", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("stopped")));
    {
        let caps = t.host.captures.lock().unwrap();
        assert_eq!(caps.len(), 1);
        assert_eq!((caps[0].0.as_str(), caps[0].2), (id.as_str(), false));
    }
    assert!(t
        .host
        .stopped
        .lock()
        .unwrap()
        .contains(&(id.clone(), false)));
    assert!(disk.join("disk.qcow2").exists());

    let (s, v) = t.act(&id, "restart", json!({})).await;
    assert_eq!(
        (s, v["state"].as_str()),
        (StatusCode::OK, Some("running")),
        "{v}"
    );
    assert_eq!(v["id"], id.as_str());
    assert_eq!(
        t.host.restored.lock().unwrap().last(),
        Some(&(id.clone(), disk.clone()))
    );
    // Restarting a running one answers it as it is.
    let (s, v) = t.act(&id, "restart", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    assert_eq!(t.host.restored.lock().unwrap().len(), 1);

    // getOrCreate of the stopped holder restarts it from its disk too.
    t.act(&id, "stop", json!({})).await;
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(json!({"name": "keeper", "getOrCreate": true})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["id"].as_str(), v["reused"].as_bool()),
        (Some(id.as_str()), Some(true))
    );
    assert_eq!(v["state"], "running");
    assert_eq!(t.host.restored.lock().unwrap().len(), 2);
    assert_eq!(t.host.captures.lock().unwrap().len(), 2);

    // A delete removes the kept disk.
    t.act(&id, "stop", json!({})).await;
    assert!(disk.exists());
    t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    for _ in 0..50 {
        if !disk.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the kept disk was not removed");
}

#[tokio::test]
async fn restart_of_a_stopped_sandbox_that_is_not_persistent_is_409() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.act(&id, "stop", json!({})).await;
    assert!(t.host.captures.lock().unwrap().is_empty());
    let (s, v) = t.act(&id, "restart", json!({})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "not_persistent");
}

// ---- :resize ----

#[tokio::test]
async fn a_resize_restarts_the_sandbox_at_its_new_shape_from_its_own_disk() {
    let t = T::new();
    let id = t
        .running(json!({"vcpu": 1, "memoryMiB": 1024, "name": "sized"}))
        .await;
    // The same shape: nothing to do, nothing restarted.
    let (s, v) = t.act(&id, "resize", json!({"vcpu": 1})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    assert!(t.host.captures.lock().unwrap().is_empty());

    let (s, v) = t
        .act(
            &id,
            "resize",
            json!({"restart": true, "vcpu": 2, "memoryMiB": 2048, "diskMiB": 8192}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["id"].as_str(),
            v["state"].as_str(),
            v["vcpu"].as_u64(),
            v["memoryMiB"].as_u64(),
            v["diskMiB"].as_u64(),
            v["name"].as_str()
        ),
        (
            Some(id.as_str()),
            Some("running"),
            Some(2),
            Some(2048),
            Some(8192),
            Some("sized")
        ),
        "{v}"
    );
    // Ended with its writes flushed, its disk taken, then booted from it at
    // the new shape.
    assert!(t.host.stopped.lock().unwrap().contains(&(id.clone(), true)));
    let caps = t.host.captures.lock().unwrap().clone();
    assert_eq!(caps.len(), 1);
    assert_eq!((caps[0].0.as_str(), caps[0].2), (id.as_str(), false));
    let kept = t.dir.join("disks").join(format!("{id}.resize"));
    assert_eq!(
        t.host.restored.lock().unwrap().last(),
        Some(&(id.clone(), kept.clone()))
    );
    let spec = t.host.specs.lock().unwrap().last().unwrap().clone();
    assert_eq!(
        (spec.id.as_str(), spec.vcpu, spec.memory_mib, spec.disk_mib),
        (id.as_str(), 2, 2048, 8192)
    );
    // Not persistent: its disk is not kept once it booted from it.
    assert!(!kept.exists());
}

#[tokio::test]
async fn a_resize_names_every_wrong_field_and_refuses_what_it_cannot_do() {
    let t = T::with(|c| c.quotas.set("sandbox.memory_mib=3072").unwrap());
    let id = t.running(json!({"vcpu": 1, "memoryMiB": 1024})).await;
    let (s, v) = t.act(&id, "resize", json!({})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("vcpu"), "{v}");
    let (s, v) = t
        .act(
            &id,
            "resize",
            json!({"vcpu": 0, "memoryMiB": "big", "diskMiB": 100, "restart": 1, "colour": "red"}),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    for field in ["vcpu", "memoryMiB", "diskMiB", "restart", "colour"] {
        assert!(v.to_string().contains(field), "{field}: {v}");
    }
    // A disk only grows.
    let (s, v) = t.act(&id, "resize", json!({"diskMiB": 3072})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("diskMiB"), "{v}");
    // No restart allowed: more vCPUs, or a disk this host cannot grow live.
    for ask in [
        json!({"restart": false, "vcpu": 2}),
        json!({"restart": false, "diskMiB": 8192}),
    ] {
        let (s, v) = t.act(&id, "resize", ask).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert_error(&v, 409, "resize_needs_restart");
    }
    // Past the key's memory quota: refused, nothing changed.
    let (s, v) = t.act(&id, "resize", json!({"memoryMiB": 4096})).await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(s, StatusCode::CONFLICT);
    let v = t.sandbox(&id).await;
    assert_eq!(
        (
            v["state"].as_str(),
            v["memoryMiB"].as_u64(),
            v["vcpu"].as_u64()
        ),
        (Some("running"), Some(1024), Some(1))
    );
    assert!(t.host.captures.lock().unwrap().is_empty());
    // Unknown sandboxes are 404; a stopped one that is not persistent has
    // no disk to start from.
    let (s, v) = t.act("nope", "resize", json!({"vcpu": 2})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    t.act(&id, "stop", json!({})).await;
    let (s, v) = t.act(&id, "resize", json!({"vcpu": 2})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "not_persistent");
}

#[tokio::test]
async fn a_stopped_persistent_sandbox_resized_starts_at_its_new_shape() {
    let t = T::new();
    let id = t
        .running(json!({"persistent": true, "vcpu": 1, "memoryMiB": 512}))
        .await;
    t.act(&id, "stop", json!({})).await;
    let disk = t.dir.join("disks").join(&id);
    assert!(disk.join("disk.qcow2").exists());
    let (s, v) = t
        .act(&id, "resize", json!({"memoryMiB": 1024, "diskMiB": 5000}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["state"].as_str(),
            v["memoryMiB"].as_u64(),
            v["diskMiB"].as_u64()
        ),
        (Some("running"), Some(1024), Some(5000))
    );
    assert_eq!(
        t.host.restored.lock().unwrap().last(),
        Some(&(id.clone(), disk.clone()))
    );
    // Its kept disk stays where a stop keeps it.
    assert!(disk.join("disk.qcow2").exists());
}

#[tokio::test]
async fn a_fork_that_keeps_its_snapshot_starts_the_copies_from_it_and_answers_it() {
    let t = T::new();
    let id = t.running(json!({"labels": {"team": "ml"}})).await;
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:fork"),
            Some(json!({"count": 2, "keepSnapshot": true})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let snap = &v["snapshot"];
    let sid = snap["id"].as_str().expect("the kept snapshot").to_string();
    assert_eq!(
        (
            snap["state"].as_str(),
            snap["mode"].as_str(),
            snap["sourceSandboxId"].as_str()
        ),
        (Some("ready"), Some("memory"), Some(id.as_str())),
        "{snap}"
    );
    assert_eq!(snap["labels"], json!({"team": "ml"}));
    let copies = v["sandboxes"].as_array().unwrap();
    assert_eq!(copies.len(), 2);
    assert!(copies.iter().all(|c| c["state"] == "running"), "{v}");
    // One capture, the snapshot's, which both copies started from and
    // which stays.
    let caps = t.host.captures.lock().unwrap().clone();
    assert_eq!(caps.len(), 1);
    let kept = t.dir.join("snapshots").join(&sid);
    assert_eq!(caps[0].1, kept);
    let restored = t.host.restored.lock().unwrap().clone();
    assert_eq!(restored.len(), 2);
    assert!(
        restored.iter().all(|(_, from)| *from == kept),
        "{restored:?}"
    );
    assert!(kept.exists());
    let (s, v) = t.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("ready")));
    // Without it, no snapshot is answered or kept.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:fork"),
            Some(json!({"keepSnapshot": false})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(v.get("snapshot").is_none(), "{v}");
    let (_, list) = t.json("GET", "/v1/snapshots", None).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn fork_makes_running_copies_and_leaves_the_source_as_it_was() {
    fork_makes_running_copies_on(T::new()).await;
}

#[tokio::test]
async fn fork_makes_running_copies_on_postgres() {
    if let Some(t) = T::on_postgres() {
        fork_makes_running_copies_on(t).await;
    }
}

async fn fork_makes_running_copies_on(t: T) {
    let id = t
        .running(json!({"vcpu": 1, "memoryMiB": 512, "labels": {"a": "b"}, "env": {"K": "v"}}))
        .await;
    t.host.files.lock().unwrap().insert(
        (id.clone(), "/workspace/f".into()),
        (b"src".to_vec(), 0o644),
    );
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:fork"),
            Some(json!({"count": 2})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let copies = v["sandboxes"].as_array().unwrap();
    assert_eq!(copies.len(), 2);
    let mut ids = vec![id.clone()];
    for c in copies {
        assert_eq!(c["state"], "running", "{c}");
        assert_eq!(
            (c["vcpu"].as_u64(), c["memoryMiB"].as_u64()),
            (Some(1), Some(512))
        );
        assert_eq!(c["labels"], json!({"a": "b"}));
        assert_eq!(c["envNames"], json!(["K"]));
        let cid = c["id"].as_str().unwrap().to_string();
        assert!(!ids.contains(&cid));
        let (s, _, b) = t
            .call(
                "GET",
                &format!("/v1/sandboxes/{cid}/files/content?path=/workspace/f"),
                Some(&t.admin),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!((s, &b[..]), (StatusCode::OK, &b"src"[..]));
        ids.push(cid);
    }
    assert_eq!(t.sandbox(&id).await["state"], "running");
    let caps = t.host.captures.lock().unwrap().clone();
    assert_eq!(caps.len(), 1);
    assert!(caps[0].2, "a fork captures memory");
    // The temporary capture is gone once the copies run.
    assert!(!caps[0].1.exists());
    assert_eq!(t.host.restored.lock().unwrap().len(), 2);
    // The copies trust their source's CA: its processes, in the copies'
    // memory, loaded that one.
    let ca_of = |sid: &str| {
        t.host
            .specs
            .lock()
            .unwrap()
            .iter()
            .find(|m| m.id == sid)
            .and_then(|m| m.guest_ca_pem.clone())
            .expect("a CA")
    };
    for cid in &ids[1..] {
        assert_eq!(ca_of(cid), ca_of(&id));
    }
    let (_, list) = t.json("GET", "/v1/sandboxes", None).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 3);

    // Without count: one copy, and a paused source stays paused.
    t.act(&id, "pause", json!({})).await;
    let (s, v) = t
        .act(&id, "fork", json!({"name": "copy", "labels": {}}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let one = &v["sandboxes"].as_array().unwrap()[0];
    assert_eq!(one["state"], "running");
    assert_eq!(one["name"], "copy");
    assert_eq!(one["labels"], json!({}));
    assert_eq!(t.sandbox(&id).await["state"], "paused");

    let (s, v) = t
        .act(&id, "fork", json!({"count": 9, "name": "x", "bad": 1}))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["count", "bad"]);
    let (s, v) = t.act(&id, "fork", json!({"count": 2, "name": "x"})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "name");
}

#[tokio::test]
async fn update_takes_the_time_limit_away_with_zero_and_the_cap_with_null() {
    let t = T::new();
    let id = t
        .running(json!({"timeoutSeconds": 600, "maxTotalCostMicros": 5_000_000}))
        .await;
    let v = t.sandbox(&id).await;
    assert!(v["endsAt"].is_string());
    assert_eq!(v["maxTotalCostMicros"], 5_000_000);
    // Every secret that reaches it, unless its create chose.
    assert_eq!(v["secrets"], Value::Null);
    let none = t.running(json!({"secrets": []})).await;
    assert_eq!(t.sandbox(&none).await["secrets"], json!([]));
    // Absent leaves both as they are.
    let (s, v) = t.act(&id, "update", json!({"labels": {"a": "b"}})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["timeoutSeconds"].as_u64(),
            v["maxTotalCostMicros"].as_i64()
        ),
        (Some(600), Some(5_000_000))
    );
    let (s, v) = t
        .act(
            &id,
            "update",
            json!({"timeoutSeconds": 0, "maxTotalCostMicros": null}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (&v["timeoutSeconds"], &v["endsAt"], &v["maxTotalCostMicros"]),
        (&Value::Null, &Value::Null, &Value::Null)
    );
    let (s, v) = t.act(&id, "update", json!({"timeoutSeconds": 30})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(
        v["error"]["details"]["issues"][0]["field"],
        "timeoutSeconds"
    );
    let (s, v) = t.act(&id, "update", json!({"timeoutSeconds": 120})).await;
    assert_eq!(
        (s, v["timeoutSeconds"].as_u64()),
        (StatusCode::OK, Some(120))
    );
    assert!(v["endsAt"].is_string());
}

#[tokio::test]
async fn snapshot_then_get_list_create_from_it_and_delete() {
    snapshot_then_get_list_create_from_it_and_delete_on(T::new()).await;
}

#[tokio::test]
async fn snapshot_then_get_list_create_from_it_and_delete_on_postgres() {
    if let Some(t) = T::on_postgres() {
        snapshot_then_get_list_create_from_it_and_delete_on(t).await;
    }
}

async fn snapshot_then_get_list_create_from_it_and_delete_on(t: T) {
    let id = t.running(json!({"vcpu": 1, "memoryMiB": 1024})).await;
    let (s, snap) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:snapshot"),
            Some(json!({"name": "s1", "labels": {"k": "v"}, "retentionDays": 2})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{snap}");
    assert_eq!(snap["state"], "ready");
    assert_eq!(snap["mode"], "memory");
    assert_eq!(snap["sandboxId"], id.as_str());
    assert!(snap["sizeBytes"].as_u64().unwrap() > 0);
    // The names the client reads.
    assert_eq!(snap["sourceSandboxId"], id.as_str());
    assert_eq!(
        snap["shape"],
        json!({"vcpu": 1, "memoryMiB": 1024, "diskMiB": 4096})
    );
    assert_eq!(snap["storedBytes"], snap["sizeBytes"]);
    assert_eq!(snap["meteredBytes"], snap["sizeBytes"]);
    assert!(snap.as_object().unwrap().contains_key("sourceImageId"));
    let sid = snap["id"].as_str().unwrap().to_string();

    // :update replaces what is given; ifLabels fences it; :extend keeps it
    // that many days from now.
    let snap_url = |verb: &str| format!("/v1/snapshots/{sid}:{verb}");
    let (s, v) = t
        .json(
            "POST",
            &snap_url("update"),
            Some(json!({"labels": {"k": "w", "n": "1"}})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["name"].as_str(), &v["labels"]),
        (Some("s1"), &json!({"k": "w", "n": "1"}))
    );
    let (s, v) = t
        .json(
            "POST",
            &snap_url("update"),
            Some(json!({"name": null, "labels": {}, "ifLabels": {"k": "v"}})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "snapshot_metadata_changed");
    let (s, v) = t
        .json(
            "POST",
            &snap_url("update"),
            Some(json!({"name": null, "ifLabels": {"k": "w", "n": "1"}, "bad": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "bad");
    let (s, v) = t
        .json(
            "POST",
            &snap_url("update"),
            Some(json!({"name": null, "ifLabels": {"k": "w", "n": "1"}})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (&v["name"], &v["labels"]),
        (&Value::Null, &json!({"k": "w", "n": "1"}))
    );
    let (s, v) = t
        .json(
            "POST",
            &snap_url("extend"),
            Some(json!({"retentionDays": 30})),
        )
        .await;
    assert_eq!((s, v["retentionDays"].as_u64()), (StatusCode::OK, Some(30)));
    let created = v["createdAt"].as_str().unwrap().to_string();
    let expires = v["expiresAt"].as_str().unwrap().to_string();
    assert!(expires > created, "{expires} after {created}");
    for bad in [
        json!({}),
        json!({"retentionDays": 0}),
        json!({"retentionDays": 366}),
    ] {
        let (s, v) = t.json("POST", &snap_url("extend"), Some(bad)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_eq!(v["error"]["details"]["issues"][0]["field"], "retentionDays");
    }
    let (s, _) = t
        .json(
            "POST",
            "/v1/snapshots/nope:extend",
            Some(json!({"retentionDays": 3})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(t
        .dir
        .join("snapshots")
        .join(&sid)
        .join("memory.state")
        .exists());
    let (s, v) = t.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("ready")));
    let (_, v) = t.json("GET", "/v1/snapshots", None).await;
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(t.sandbox(&id).await["state"], "running");

    // Another key sees none of it.
    let other = create_key(&t.at, None, false, false).unwrap();
    let (s, _) = t
        .json_as(&other, "GET", &format!("/v1/snapshots/{sid}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, v) = t.json_as(&other, "GET", "/v1/snapshots", None, &[]).await;
    assert_eq!(v["data"], json!([]));

    // Create from it: the snapshot's shape; another shape is refused by name.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(json!({"snapshot": sid})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "running");
    assert_eq!(v["start"]["mode"], "snapshot");
    assert_eq!(v["snapshot"], sid.as_str(), "the record names its snapshot");
    assert_eq!(t.sandbox(&id).await["snapshot"], Value::Null);
    assert_eq!(
        (v["vcpu"].as_u64(), v["memoryMiB"].as_u64()),
        (Some(1), Some(1024))
    );
    assert_eq!(t.host.restored.lock().unwrap().len(), 1);
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"snapshot": sid, "vcpu": 2, "memoryMiB": 1024})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"].as_array().unwrap().len(), 1);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "vcpu");
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"snapshot": sid, "image": "default"})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "snapshot");
    let (s, _) = t
        .json("POST", "/v1/sandboxes", Some(json!({"snapshot": "nope"})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    // A disk snapshot of a paused sandbox leaves it paused.
    t.act(&id, "pause", json!({})).await;
    let (s, v) = t.act(&id, "snapshot", json!({"mode": "disk"})).await;
    assert_eq!(
        (s, v["state"].as_str(), v["mode"].as_str()),
        (StatusCode::CREATED, Some("ready"), Some("disk"))
    );
    assert!(!t
        .dir
        .join("snapshots")
        .join(v["id"].as_str().unwrap())
        .join("memory.state")
        .exists());
    assert_eq!(t.sandbox(&id).await["state"], "paused");
    // A disk snapshot boots at any vCPUs and memory, on a disk no smaller
    // than the one saved.
    let disk_sid = v["id"].as_str().unwrap().to_string();
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"snapshot": disk_sid, "vcpu": 2, "memoryMiB": 2048, "diskMiB": 3072})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let issues = v["error"]["details"]["issues"].as_array().unwrap();
    assert_eq!(issues.len(), 1, "{v}");
    assert_eq!(issues[0]["field"], "diskMiB");
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(json!({"snapshot": disk_sid, "vcpu": 2, "memoryMiB": 2048, "diskMiB": 8192})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        (
            v["vcpu"].as_u64(),
            v["memoryMiB"].as_u64(),
            v["diskMiB"].as_u64()
        ),
        (Some(2), Some(2048), Some(8192))
    );
    let spec = t.host.specs.lock().unwrap().last().unwrap().clone();
    assert_eq!((spec.vcpu, spec.memory_mib, spec.disk_mib), (2, 2048, 8192));

    // Delete (the client's POST :delete, and DELETE), then it is gone.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/snapshots/{sid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("deleted")));
    let (s, _) = t
        .json("DELETE", &format!("/v1/snapshots/{sid}"), None)
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = t.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "snapshot_not_found");
    assert!(!t.dir.join("snapshots").join(&sid).exists());
}

#[tokio::test(start_paused = true)]
async fn lease_end_pauses_stops_or_deletes_as_asked() {
    let t = T::on_paused_time();
    let paused = t.running(json!({"timeoutSeconds": 60})).await;
    let stopped = t
        .running(json!({"timeoutSeconds": 60, "onLeaseEnd": "stop"}))
        .await;
    let deleted = t
        .running(json!({"timeoutSeconds": 60, "onLeaseEnd": "delete"}))
        .await;
    let kept = t.running(json!({"timeoutSeconds": 600})).await;
    t.state.start_background();
    tokio::time::advance(Duration::from_secs(30)).await;
    for id in [&paused, &stopped, &deleted, &kept] {
        assert_eq!(
            t.sandbox(id).await["state"],
            "running",
            "30 s into a 60 s lease"
        );
    }
    tokio::time::advance(Duration::from_secs(31)).await;
    let v = t.wait_state(&paused, "paused").await;
    assert!(v["pausedAt"].is_string());
    let v = t.wait_state(&stopped, "stopped").await;
    assert_eq!(v["stopReason"], "timeout");
    t.wait_state(&deleted, "gone").await;
    assert_eq!(t.sandbox(&kept).await["state"], "running");
    // The wake gives it a new lease, so it is not paused again at once...
    let (s, v) = t.act(&paused, "wake", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    tokio::time::advance(Duration::from_secs(50)).await;
    assert_eq!(t.sandbox(&paused).await["state"], "running");
    // ...but once that lease ends too.
    tokio::time::advance(Duration::from_secs(15)).await;
    t.wait_state(&paused, "paused").await;
    t.state.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_idle_sandbox_pauses_itself() {
    let t = T::on_paused_time();
    let idle = t.running(json!({"idlePauseSeconds": 60})).await;
    let busy = t.running(json!({"idlePauseSeconds": 60})).await;
    let never = t.running(json!({"idlePauseSeconds": 0})).await;
    // The client's documented default, and a short one raised to a minute.
    let defaulted = t.running(json!({})).await;
    assert_eq!(t.sandbox(&defaulted).await["idlePauseSeconds"], 300);
    let short = t.running(json!({"idlePauseSeconds": 10})).await;
    assert_eq!(t.sandbox(&short).await["idlePauseSeconds"], 60);
    t.act(&short, "update", json!({"idlePauseSeconds": 0}))
        .await;
    assert_eq!(t.sandbox(&short).await["idlePauseSeconds"], 0);
    let (s, v) = t
        .act(&short, "update", json!({"idlePauseSeconds": 5}))
        .await;
    assert_eq!(
        (s, v["idlePauseSeconds"].as_i64()),
        (StatusCode::OK, Some(60))
    );
    t.act(&short, "update", json!({"idlePauseSeconds": 0}))
        .await;
    t.state.start_background();
    // The busy one is called every 20 s; the others not at all.
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(20)).await;
        t.host.script("hello", vec![Step::Exit(0)]);
        let (s, _) = t
            .json(
                "POST",
                &format!("/v1/sandboxes/{busy}:exec"),
                Some(json!({"command": "hello"})),
            )
            .await;
        assert_eq!(s, StatusCode::OK);
    }
    t.wait_state(&idle, "paused").await;
    assert_eq!(t.sandbox(&idle).await["stopReason"], "idle");
    assert_eq!(t.sandbox(&busy).await["state"], "running");
    assert_eq!(t.sandbox(&never).await["state"], "running");
    assert_eq!(
        t.sandbox(&defaulted).await["state"],
        "running",
        "300 s are not up"
    );
    // A call wakes it and counts as activity.
    t.host.script("hello", vec![Step::Exit(0)]);
    let (s, _) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{idle}:exec"),
            Some(json!({"command": "hello"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let woken = t.sandbox(&idle).await;
    assert_eq!(
        (woken["state"].as_str(), &woken["stopReason"]),
        (Some("running"), &Value::Null)
    );
    tokio::time::advance(Duration::from_secs(50)).await;
    assert_eq!(t.sandbox(&idle).await["state"], "running");
    // The default's 300 s pass with no call: it pauses too.
    tokio::time::advance(Duration::from_secs(320)).await;
    t.wait_state(&defaulted, "paused").await;
    assert_eq!(t.sandbox(&never).await["state"], "running");
    assert_eq!(t.sandbox(&short).await["state"], "running");
    t.state.shutdown().await;
}

#[tokio::test]
async fn a_restart_keeps_paused_sandboxes_paused_and_applies_ended_leases() {
    let t = T::new();
    let paused = t.running(json!({})).await;
    let ended = t.running(json!({"timeoutSeconds": 60})).await;
    t.act(&paused, "pause", json!({})).await;
    t.state.shutdown().await;
    // The lease ends while the server is down.
    t.set_field(&ended, "endsAt", "2001-01-01T00:00:00Z");

    let host = Arc::new(FakeHost::default());
    host.recoverable.lock().unwrap().insert(ended.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host, |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    assert_eq!(t2.sandbox(&paused).await["state"], "paused");
    t2.state.start_background();
    t2.wait_state(&ended, "paused").await;
    let (s, v) = t2.act(&paused, "wake", json!({})).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("running")));
    t2.state.shutdown().await;
}

// ---- processes across a restart of the server ----

impl T {
    async fn process(&self, id: &str, pid: &str) -> (StatusCode, Value) {
        self.json("GET", &format!("/v1/sandboxes/{id}/processes/{pid}"), None)
            .await
    }

    fn process_rows(&self, sandbox_id: &str) -> i64 {
        let conn = rusqlite::Connection::open(self.dir.join("runtime.db")).unwrap();
        conn.query_row(
            "SELECT COUNT(*) FROM processes WHERE sandbox_id = ?1",
            rusqlite::params![sandbox_id],
            |r| r.get(0),
        )
        .unwrap()
    }
}

#[tokio::test]
async fn a_restart_takes_up_running_processes() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host.script(
        "ticker",
        vec![
            Step::Out(b"one\n".to_vec()),
            Step::Sleep(700),
            // Written while no server listens: lost.
            Step::Out(b"two\n".to_vec()),
            Step::Sleep(1200),
            Step::Out(b"three\n".to_vec()),
            Step::Sleep(300),
            Step::Exit(3),
        ],
    );
    t.host
        .script("forgotten", vec![Step::Sleep(60_000), Step::Exit(0)]);
    t.host
        .script("quick", vec![Step::Out(b"done\n".to_vec()), Step::Exit(0)]);
    let spawn = |cmd: &'static str| {
        let t = &t;
        let id = id.clone();
        async move {
            let (s, v) = t
                .json(
                    "POST",
                    &format!("/v1/sandboxes/{id}/processes"),
                    Some(json!({"command": cmd, "cwd": "/tmp"})),
                )
                .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            assert_eq!(v["cwd"], "/tmp");
            v["id"].as_str().unwrap().to_string()
        }
    };
    let ticker = spawn("ticker").await;
    let forgotten = spawn("forgotten").await;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}:exec"),
            Some(json!({"command": "quick"})),
        )
        .await;
    assert_eq!(
        (s, v["exitCode"].as_i64()),
        (StatusCode::OK, Some(0)),
        "{v}"
    );
    let quick = v["processId"].as_str().unwrap().to_string();
    for _ in 0..50 {
        if t.process(&id, &ticker).await.1["outputBytes"] == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(t.process(&id, &ticker).await.1["outputBytes"], 4);
    let before = t.process(&id, &ticker).await.1;
    t.state.shutdown().await;
    assert_eq!(t.process_rows(&id), 3);

    // The guest forgets one process; "two" is written meanwhile.
    let forgotten_token = {
        let procs = t.host.procs.lock().unwrap();
        let mut tokens: Vec<u64> = procs.keys().copied().collect();
        tokens.sort();
        tokens[1]
    };
    t.host.procs.lock().unwrap().remove(&forgotten_token);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    t.host.recoverable.lock().unwrap().insert(id.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), t.host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();

    let (s, v) = t2.process(&id, &ticker).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["outputBytes"], 4);
    assert_eq!(v["cwd"], "/tmp");
    for k in [
        "command",
        "argv",
        "cwd",
        "user",
        "pid",
        "startedAt",
        "pty",
        "outputEncoding",
    ] {
        assert_eq!(v[k], before[k], "{k}");
    }
    let (_, v) = t2.process(&id, &forgotten).await;
    assert_eq!(v["state"], "lost", "{v}");
    assert_eq!(v["exitCode"], Value::Null);
    assert!(v["endedAt"].is_string());
    let (_, v) = t2.process(&id, &quick).await;
    assert_eq!(v["cwd"], "/workspace", "the default");
    assert_eq!(
        (
            v["state"].as_str(),
            v["exitCode"].as_i64(),
            v["outputBytes"].as_u64()
        ),
        (Some("exited"), Some(0), Some(5)),
        "{v}"
    );
    let (_, v) = t2
        .json("GET", &format!("/v1/sandboxes/{id}/processes"), None)
        .await;
    assert_eq!(v["data"].as_array().unwrap().len(), 3, "{v}");

    // A reader from an older cursor learns what was dropped, then follows
    // the later output at offsets continuing from the stored count.
    let (_, _, b) = t2
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{ticker}/output?cursor=0&follow=true"),
            Some(&t2.admin),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    let types: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["truncated", "stdout", "exit"], "{ev:?}");
    assert_eq!(
        (ev[0]["droppedBytes"].as_u64(), ev[0]["resumeAt"].as_u64()),
        (Some(4), Some(4))
    );
    assert_eq!(
        (ev[1]["data"].as_str(), ev[1]["offset"].as_u64()),
        (Some("three\n"), Some(4))
    );
    assert_eq!(
        (ev[2]["exitCode"].as_i64(), ev[2]["state"].as_str()),
        (Some(3), Some("exited"))
    );
    let (_, v) = t2.process(&id, &ticker).await;
    assert_eq!(
        (
            v["state"].as_str(),
            v["exitCode"].as_i64(),
            v["outputBytes"].as_u64()
        ),
        (Some("exited"), Some(3), Some(10)),
        "{v}"
    );
    t2.state.shutdown().await;

    // Another restart: what ended stays as it was, its output gone.
    let t3 = T::open(t.dir.clone(), t.admin.clone(), t.host.clone(), |_| {});
    runtime_server::recover(&t3.state).await.unwrap();
    let (_, v) = t3.process(&id, &ticker).await;
    assert_eq!(
        (v["state"].as_str(), v["exitCode"].as_i64()),
        (Some("exited"), Some(3))
    );
    let (_, _, b) = t3
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/processes/{ticker}/output?cursor=4"),
            Some(&t3.admin),
            &[],
            Body::empty(),
        )
        .await;
    let ev = ndjson(&b);
    assert_eq!(ev[0]["type"], "truncated", "{ev:?}");
    assert_eq!(ev[0]["resumeAt"], 10);
    assert_eq!(ev.last().unwrap()["type"], "exit");
    assert_eq!(t3.process(&id, &forgotten).await.1["state"], "lost");

    // Deleting the sandbox removes its process records.
    let (s, _) = t3
        .json("DELETE", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t3.process_rows(&id), 0);
    t3.state.shutdown().await;
}

#[tokio::test]
async fn a_process_that_ended_while_the_server_was_down_is_exited() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.host
        .script("brief", vec![Step::Sleep(300), Step::Exit(7)]);
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"command": "brief"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let pid = v["id"].as_str().unwrap().to_string();
    t.state.shutdown().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    t.host.recoverable.lock().unwrap().insert(id.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), t.host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let mut v = Value::Null;
    for _ in 0..50 {
        v = t2.process(&id, &pid).await.1;
        if v["state"] != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        (v["state"].as_str(), v["exitCode"].as_i64()),
        (Some("exited"), Some(7)),
        "{v}"
    );
    t2.state.shutdown().await;
}

#[tokio::test]
async fn a_run_after_a_pause_starts_its_context_afresh() {
    let t = T::new();
    t.host.drivers.lock().unwrap().insert("python".into());
    let id = t.running(json!({})).await;
    let path = format!("/v1/sandboxes/{id}/interpreter:run");
    let (s, v) = t.json("POST", &path, Some(json!({"code": "one"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["status"].as_str(), v["stdout"].as_str()),
        (Some("ok"), Some("one"))
    );
    assert_eq!(v["contextStarted"], true);
    let (_, v) = t.json("POST", &path, Some(json!({"code": "two"}))).await;
    assert_eq!(
        (v["status"].as_str(), v["contextStarted"].as_bool()),
        (Some("ok"), Some(false))
    );
    // The pause closed the kernel's handle: the next run (which wakes the
    // sandbox) starts a fresh one instead of answering `lost`.
    t.act(&id, "pause", json!({})).await;
    let (s, v) = t.json("POST", &path, Some(json!({"code": "three"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "ok", "{v}");
    assert_eq!(v["stdout"], "three");
    assert_eq!(v["contextStarted"], true);
}

#[tokio::test]
async fn interpreter_starts_each_language_in_its_own_driver() {
    let t = T::new();
    let id = t.running(json!({})).await;
    // (language, the driver's program, its last argument, a line of it)
    let cases = [
        ("python", "python3", "python", "run_python"),
        ("bash", "python3", "bash", "run_bash"),
        ("go", "python3", "go", "run_go"),
        ("javascript", "node", "", "vm.createContext"),
        ("typescript", "node", "typescript", "transpileModule"),
        ("r", "stdbuf", "", "globalenv()"),
        ("java", "bash", "", "JShell.builder()"),
    ];
    for (lang, program, last, marker) in cases {
        // The fake guest has no such program: the driver exits at once.
        let (s, v) = t
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/interpreter:run"),
                Some(json!({"code": "1", "language": lang})),
            )
            .await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{lang}: {v}");
        assert_eq!(v["error"]["code"], "interpreter_start_failed", "{lang}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(lang),
            "{v}"
        );
        let spec = t.host.last_exec.lock().unwrap().clone().unwrap();
        assert_eq!(spec.argv[0], program, "{lang}");
        assert!(spec.stdin, "{lang}");
        let joined = spec.argv.join("\n");
        assert!(joined.contains(marker), "{lang}: {marker}");
        if !last.is_empty() {
            assert_eq!(spec.argv.last().unwrap(), last, "{lang}");
        }
    }
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/interpreter:run"),
            Some(json!({"code": "1", "language": "cobol"})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "language");
    // A language's name is its default context: another language may not take it.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/interpreter/contexts"),
            Some(json!({"id": "go", "language": "r"})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/interpreter/contexts"),
            Some(json!({"language": "typescript"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["language"], "typescript");
    assert!(v["id"].as_str().unwrap().starts_with("ctx-"), "{v}");
}

#[tokio::test(start_paused = true)]
async fn a_paused_sandbox_is_deleted_when_its_retention_ends() {
    let t = T::on_paused_time();
    let id = t.running(json!({})).await;
    let kept = t.running(json!({})).await;
    let (s, v) = t.act(&id, "retention", json!({"days": 0})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = t.act(&id, "retention", json!({"days": 2})).await;
    assert_eq!(
        (s, v["retentionDays"].clone()),
        (StatusCode::OK, json!(2)),
        "{v}"
    );
    assert!(
        v["pausedExpiresAt"].is_null(),
        "running: nothing expires yet: {v}"
    );
    for s in [&id, &kept] {
        let (st, v) = t.act(s, "pause", json!({})).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        t.wait_state(s, "paused").await;
    }
    let v = t.sandbox(&id).await;
    let paused = runtime_server_iso_ms(v["pausedAt"].as_str().unwrap());
    let expires = runtime_server_iso_ms(v["pausedExpiresAt"].as_str().unwrap());
    assert_eq!(expires - paused, 2 * 86_400_000, "{v}");
    assert!(t.sandbox(&kept).await["pausedExpiresAt"].is_null());
    t.state.start_background();
    tokio::time::advance(Duration::from_secs(2 * 86_400 - 60)).await;
    assert_eq!(t.sandbox(&id).await["state"], "paused", "a minute before");
    tokio::time::advance(Duration::from_secs(61)).await;
    t.wait_state(&id, "gone").await;
    assert_eq!(t.sandbox(&kept).await["state"], "paused");
    t.state.shutdown().await;
}

fn runtime_server_iso_ms(s: &str) -> i64 {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).unwrap();
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

#[tokio::test]
async fn cpu_use_in_the_guest_keeps_a_sandbox_from_idling() {
    let t = T::new();
    let working = t.running(json!({"idlePauseSeconds": 60})).await;
    let quiet = t.running(json!({"idlePauseSeconds": 60})).await;
    // Both were last called 57 s ago: idle in 3 s unless something happens.
    let then = time::OffsetDateTime::now_utc() - time::Duration::seconds(57);
    let then = then
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    t.set_field(&working, "lastActiveAt", &then);
    t.set_field(&quiet, "lastActiveAt", &then);
    // The working one's vCPUs run half the time; the quiet one's not at all.
    let host = t.host.clone();
    let id = working.clone();
    let burner = tokio::spawn(async move {
        loop {
            {
                let mut cpu = host.cpu.lock().unwrap();
                *cpu.entry(id.clone()).or_default() += Duration::from_millis(125);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    t.host
        .cpu
        .lock()
        .unwrap()
        .insert(quiet.clone(), Duration::from_secs(1));
    t.state.start_background();
    t.wait_state(&quiet, "paused").await;
    tokio::time::sleep(Duration::from_millis(4000)).await;
    assert_eq!(t.sandbox(&working).await["state"], "running");
    burner.abort();
    t.state.shutdown().await;
}

// ---- volumes ----

/// The fields a 400 names.
fn issue_fields(v: &Value) -> Vec<String> {
    v["error"]["details"]["issues"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| i["field"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn write_at(path: &std::path::Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

#[tokio::test]
async fn volumes_resize_back_up_and_restore_checking_input_and_owners() {
    let t = T::new();
    let (_, vol) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "src"})),
        )
        .await;
    let vid = vol["id"].as_str().unwrap().to_string();
    assert_eq!(vol["restoredFrom"], Value::Null, "{vol}");
    let file = t.dir.join("volumes").join(format!("{vid}.ext4"));
    write_at(&file, 10 << 20, b"original bytes");

    // Resize: every wrong field named; only growth; unknown volumes 404.
    let tr = &t;
    let resize = |body: Value| {
        let path = format!("/v1/volumes/{vid}:resize");
        async move { tr.json("POST", &path, Some(body)).await }
    };
    for (body, field) in [
        (json!({}), "sizeMiB"),
        (json!({"sizeMiB": 64}), "sizeMiB"),
        (json!({"sizeMiB": 32}), "sizeMiB"),
        (json!({"sizeMiB": "big"}), "sizeMiB"),
        (json!({"sizeMiB": 2_000_000}), "sizeMiB"),
        (json!({"sizeMiB": 128, "shrink": true}), "shrink"),
    ] {
        let (s, v) = resize(body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} {v}");
        assert_eq!(issue_fields(&v), [field], "{body} {v}");
    }
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes/nope:resize",
            Some(json!({"sizeMiB": 128})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "volume_not_found");
    let (s, v) = resize(json!({"sizeMiB": 128})).await;
    assert_eq!(
        (s, v["sizeMiB"].as_u64()),
        (StatusCode::OK, Some(128)),
        "{v}"
    );
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 128 << 20);
    let (_, v) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(v["sizeMiB"], 128);

    // Backup: bad fields named, each.
    let backup_path = format!("/v1/volumes/{vid}:backup");
    let (s, v) = t
        .json(
            "POST",
            &backup_path,
            Some(json!({"retentionDays": 0, "name": "", "daily": true})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let mut fields = issue_fields(&v);
    fields.sort();
    assert_eq!(fields, ["daily", "name", "retentionDays"], "{v}");
    let (s, v) = t
        .json("POST", &backup_path, Some(json!({"retentionDays": 366})))
        .await;
    assert_eq!(
        (s, issue_fields(&v)),
        (StatusCode::BAD_REQUEST, vec!["retentionDays".to_string()])
    );
    let (s, v) = t
        .json("POST", "/v1/volumes/nope:backup", Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    let (s, b) = t
        .json(
            "POST",
            &backup_path,
            Some(json!({"name": "first", "retentionDays": 3})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    assert_eq!(
        (
            b["state"].as_str(),
            b["volumeId"].as_str(),
            b["sizeMiB"].as_u64(),
            b["name"].as_str()
        ),
        (Some("ready"), Some(vid.as_str()), Some(128), Some("first")),
        "{b}"
    );
    let created = time::OffsetDateTime::parse(
        b["createdAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let expires = time::OffsetDateTime::parse(
        b["expiresAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert_eq!(expires - created, time::Duration::days(3));
    let bid = b["id"].as_str().unwrap().to_string();
    let copy = t.dir.join("volume-backups").join(format!("{bid}.img"));
    assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&file).unwrap());
    assert!(b["storedBytes"].as_u64().unwrap() < 64 << 20, "{b}");
    assert_eq!(b["sha256"].as_str().map(str::len), Some(64), "{b}");
    // A default backup keeps 7 days.
    let (_, b2) = t.json("POST", &backup_path, Some(json!({}))).await;
    assert_eq!(b2["retentionDays"], 7, "{b2}");
    let bid2 = b2["id"].as_str().unwrap().to_string();

    // The volume's bytes change after the backup.
    write_at(&file, 10 << 20, b"CHANGED bytes!");

    // Lists: newest first, paged, filtered; bad queries named.
    let (_, v) = t
        .json(
            "GET",
            &format!("/v1/volume-backups?volumeId={vid}&limit=1"),
            None,
        )
        .await;
    assert_eq!(v["data"][0]["id"], bid2.as_str(), "{v}");
    let next = v["nextCursor"].as_str().unwrap().to_string();
    let (_, v) = t
        .json(
            "GET",
            &format!("/v1/volume-backups?volumeId=src&limit=1&cursor={next}"),
            None,
        )
        .await;
    assert_eq!(v["data"][0]["id"], bid.as_str(), "{v}");
    assert_eq!(v["nextCursor"], Value::Null, "{v}");
    let (_, v) = t
        .json("GET", "/v1/volume-backups?volumeId=other&state=ready", None)
        .await;
    assert_eq!(v["data"], json!([]), "{v}");
    let (s, v) = t
        .json(
            "GET",
            "/v1/volume-backups?state=lost&limit=0&cursor=zz",
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let mut fields = issue_fields(&v);
    fields.sort();
    assert_eq!(fields, ["limit", "state"], "{v}");
    let (s, v) = t.json("GET", "/v1/volume-backups/vb-nope", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "volume_backup_not_found");

    // Another key sees none of it and restores nothing of it.
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let (s, _) = t
        .json_as(
            &other,
            "GET",
            &format!("/v1/volume-backups/{bid}"),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, v) = t
        .json_as(&other, "GET", "/v1/volume-backups", None, &[])
        .await;
    assert_eq!(v["data"], json!([]), "{v}");
    for (path, body) in [
        (format!("/v1/volume-backups/{bid}:delete"), json!({})),
        ("/v1/volumes".to_string(), json!({"fromBackup": bid})),
        (format!("/v1/volumes/{vid}:backup"), json!({})),
        (format!("/v1/volumes/{vid}:resize"), json!({"sizeMiB": 256})),
    ] {
        let (s, v) = t.json_as(&other, "POST", &path, Some(body), &[]).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path} {v}");
    }

    // Restores: unknown backup 404; smaller than the backup, 400 naming
    // sizeMiB; the backup's bytes and size, or larger.
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": "vb-nope"})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "volume_backup_not_found");
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": bid, "sizeMiB": 64})),
        )
        .await;
    assert_eq!(
        (s, issue_fields(&v)),
        (StatusCode::BAD_REQUEST, vec!["sizeMiB".to_string()]),
        "{v}"
    );
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": 7, "shared": true})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let mut fields = issue_fields(&v);
    fields.sort();
    assert_eq!(fields, ["fromBackup", "shared"], "{v}");
    let (s, r) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": bid, "name": "restored"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{r}");
    assert_eq!(
        (r["sizeMiB"].as_u64(), r["restoredFrom"].as_str()),
        (Some(128), Some(bid.as_str())),
        "{r}"
    );
    let restored = t
        .dir
        .join("volumes")
        .join(format!("{}.ext4", r["id"].as_str().unwrap()));
    let bytes = std::fs::read(&restored).unwrap();
    assert_eq!(&bytes[10 << 20..(10 << 20) + 14], b"original bytes");
    assert_eq!(bytes.len(), 128 << 20);
    let (s, r) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": bid, "sizeMiB": 256})),
        )
        .await;
    assert_eq!(
        (s, r["sizeMiB"].as_u64()),
        (StatusCode::CREATED, Some(256)),
        "{r}"
    );

    // A backup whose copy changed on disk is refused, and makes nothing.
    let copy2 = t.dir.join("volume-backups").join(format!("{bid2}.img"));
    write_at(&copy2, 10 << 20, b"X");
    let before = std::fs::read_dir(t.dir.join("volumes")).unwrap().count();
    let (s, v) = t
        .json("POST", "/v1/volumes", Some(json!({"fromBackup": bid2})))
        .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(v.to_string().contains("checksum"), "{v}");
    assert_eq!(
        std::fs::read_dir(t.dir.join("volumes")).unwrap().count(),
        before
    );

    // An ordinary volume attaches at create only (shared ones attach to a
    // running sandbox); backup schedules of their own are not served.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:attach"),
            Some(json!({"sandboxId": "s", "path": "/data"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "attach {v}");
    assert_error(&v, 409, "volume_not_shared");
    for (verb, body) in [
        ("backup-policy", json!({"schedule": {"everyMinutes": 15}})),
        ("backup-policy", json!({"keep": {"last": 3}})),
    ] {
        let (s, v) = t
            .json("POST", &format!("/v1/volumes/{vid}:{verb}"), Some(body))
            .await;
        assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{verb} {v}");
        assert_error(&v, 501, "unavailable");
    }
    // A policy: daily backups and their retention, kept on the volume.
    let policy_path = format!("/v1/volumes/{vid}:backup-policy");
    assert_eq!(vol["backupPolicy"]["daily"], false, "{vol}");
    let (s, v) = t
        .json(
            "POST",
            &policy_path,
            Some(json!({"daily": "yes", "retentionDays": 0, "hourly": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let mut fields = issue_fields(&v);
    fields.sort();
    assert_eq!(fields, ["daily", "hourly", "retentionDays"], "{v}");
    let (s, v) = t
        .json(
            "POST",
            &policy_path,
            Some(json!({"daily": true, "retentionDays": 14, "schedule": null})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["backupPolicy"],
        json!({"daily": true, "retentionDays": 14, "schedule": null})
    );
    let (_, v) = t
        .json("POST", &policy_path, Some(json!({"daily": false})))
        .await;
    assert_eq!(v["backupPolicy"]["retentionDays"], 14, "{v}");
    let (_, v) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(v["backupPolicy"]["daily"], false, "{v}");
    let (s, _) = t
        .json("GET", &format!("/v1/volumes/{vid}/attachments/a1"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Attached: no resize; a running writer is frozen for its backup (and
    // thawed after), and a writer that cannot be frozen is refused.
    let a = t
        .running(json!({"volumes": [{"volumeId": vid, "path": "/data"}]}))
        .await;
    let (s, v) = resize(json!({"sizeMiB": 512})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_in_use");
    let (s, v) = t.json("POST", &backup_path, Some(json!({}))).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(v.to_string().contains("freeze"), "{v}");
    t.host.script("/data", vec![Step::Exit(0)]);
    let (s, v) = t.json("POST", &backup_path, Some(json!({}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let thaw = t.host.last_exec.lock().unwrap().clone().unwrap();
    assert_eq!(thaw.argv, ["fsfreeze", "-u", "/data"]);
    // Paused, it is copied as it is (no command runs in it).
    t.act(&a, "pause", json!({})).await;
    *t.host.last_exec.lock().unwrap() = None;
    let (s, v) = t.json("POST", &backup_path, Some(json!({}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(t.host.last_exec.lock().unwrap().is_none());

    // Deletes: the owner's; then gone, file and all.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volume-backups/{bid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(
        (s, v["status"].as_str()),
        (StatusCode::OK, Some("deleted")),
        "{v}"
    );
    assert!(!copy.exists());
    let (s, _) = t
        .json("GET", &format!("/v1/volume-backups/{bid}"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = t
        .json(
            "POST",
            &format!("/v1/volume-backups/{bid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // The quota counts backups.
    let (_, v) = t.json("GET", "/v1/limits", None).await;
    let row = v["account"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["limit"] == "volume_backup.count")
        .cloned()
        .unwrap_or_default();
    assert_eq!(row["used"], 3, "{v}");
}

#[tokio::test]
async fn volume_growth_and_backups_count_against_quotas() {
    let t = T::new();
    let k = create_key(&t.dir, Some("small"), false, false).unwrap();
    runtime_server::keys::set_quotas(
        &t.dir,
        "small",
        &["volume.mib=100".into(), "volume_backup.count=1".into()],
    )
    .unwrap();
    let (s, vol) = t
        .json_as(&k, "POST", "/v1/volumes", Some(json!({"sizeMiB": 64})), &[])
        .await;
    assert_eq!(s, StatusCode::CREATED, "{vol}");
    let vid = vol["id"].as_str().unwrap().to_string();
    let (s, v) = t
        .json_as(
            &k,
            "POST",
            &format!("/v1/volumes/{vid}:resize"),
            Some(json!({"sizeMiB": 128})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["details"]["limit"], "volume.mib", "{v}");
    let (s, v) = t
        .json_as(
            &k,
            "POST",
            &format!("/v1/volumes/{vid}:resize"),
            Some(json!({"sizeMiB": 100})),
            &[],
        )
        .await;
    assert_eq!(
        (s, v["sizeMiB"].as_u64()),
        (StatusCode::OK, Some(100)),
        "{v}"
    );
    let backup = format!("/v1/volumes/{vid}:backup");
    let (s, b) = t.json_as(&k, "POST", &backup, Some(json!({})), &[]).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let (s, v) = t.json_as(&k, "POST", &backup, Some(json!({})), &[]).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["details"]["limit"], "volume_backup.count", "{v}");
    // A restore is a volume like any other: past volume.mib it is refused.
    let (s, v) = t
        .json_as(
            &k,
            "POST",
            "/v1/volumes",
            Some(json!({"fromBackup": b["id"]})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["details"]["limit"], "volume.mib", "{v}");
}

#[tokio::test]
async fn backups_expire_outlive_their_volume_and_leftovers_go_at_restart() {
    let t = T::new();
    let (_, vol) = t
        .json("POST", "/v1/volumes", Some(json!({"sizeMiB": 16})))
        .await;
    let vid = vol["id"].as_str().unwrap().to_string();
    let tr = &t;
    let backup = |days: u32| {
        let path = format!("/v1/volumes/{vid}:backup");
        async move {
            let (s, b) = tr
                .json("POST", &path, Some(json!({"retentionDays": days})))
                .await;
            assert_eq!(s, StatusCode::CREATED, "{b}");
            b["id"].as_str().unwrap().to_string()
        }
    };
    let (short, long) = (backup(1).await, backup(30).await);
    // Another volume is backed up daily, each kept 5 days.
    let (_, daily) = t
        .json("POST", "/v1/volumes", Some(json!({"sizeMiB": 16})))
        .await;
    let daily = daily["id"].as_str().unwrap().to_string();
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{daily}:backup-policy"),
            Some(json!({"daily": true, "retentionDays": 5})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Deleting the volume keeps its backups.
    let (s, _) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = t
        .json("GET", &format!("/v1/volume-backups?volumeId={vid}"), None)
        .await;
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2), "{v}");
    t.state.shutdown().await;

    // What a crash left: a half-made copy and a file no backup owns.
    let dir = t.dir.join("volume-backups");
    std::fs::write(dir.join("vb-x.partial"), b"half").unwrap();
    std::fs::write(dir.join("stray.img"), b"stray").unwrap();
    std::fs::write(t.dir.join("volumes").join("v-x.partial"), b"half").unwrap();
    // A backup the crash cut short: its record still pending, its copy half
    // written (as the server leaves them mid-copy).
    {
        let conn = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
        conn.execute(
            "INSERT INTO volume_backups (id, key_id, volume_id, name, state, size_mib, \
             stored_bytes, sha256, retention_days, created_ms, expires_ms) \
             SELECT 'vb-cut', key_id, volume_id, NULL, 'pending', size_mib, 0, '', 7, \
             created_ms, expires_ms FROM volume_backups WHERE id = ?1",
            rusqlite::params![long],
        )
        .unwrap();
    }
    std::fs::write(dir.join("vb-cut.partial"), b"half").unwrap();
    // Two days on, the one-day backup has expired.
    let later = time::OffsetDateTime::now_utc().unix_timestamp() * 1000 + 2 * 86_400_000;
    let t2 = T::open(
        t.dir.clone(),
        t.admin.clone(),
        Arc::new(FakeHost::default()),
        |c| c.clock = Clock::following_tokio(later),
    );
    runtime_server::recover(&t2.state).await.unwrap();
    assert!(!dir.join("vb-x.partial").exists());
    assert!(!dir.join("vb-cut.partial").exists());
    let (s, _) = t2.json("GET", "/v1/volume-backups/vb-cut", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(!dir.join("stray.img").exists());
    assert!(!t.dir.join("volumes").join("v-x.partial").exists());
    assert!(dir.join(format!("{long}.img")).exists());
    t2.state.start_background();
    let mut gone = false;
    for _ in 0..100 {
        let (s, _) = t2
            .json("GET", &format!("/v1/volume-backups/{short}"), None)
            .await;
        if s == StatusCode::NOT_FOUND {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the expired backup stayed");
    // More than an hour after it was made, the daily volume has its backup.
    let mut made = Value::Null;
    for _ in 0..100 {
        let (_, v) = t2
            .json("GET", &format!("/v1/volume-backups?volumeId={daily}"), None)
            .await;
        if v["data"][0]["state"] == "ready" {
            made = v["data"][0].clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        (made["name"].as_str(), made["retentionDays"].as_u64()),
        (Some("daily"), Some(5)),
        "{made}"
    );
    assert!(!dir.join(format!("{short}.img")).exists());
    // The other restores into a new volume, though its own is gone.
    let (s, r) = t2
        .json("POST", "/v1/volumes", Some(json!({"fromBackup": long})))
        .await;
    assert_eq!(
        (s, r["sizeMiB"].as_u64()),
        (StatusCode::CREATED, Some(16)),
        "{r}"
    );
    t2.state.shutdown().await;
}

/// The spec the fake host last started `id` with.
fn started_spec(t: &T, id: &str) -> runtime_host::MachineSpec {
    t.host
        .specs
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|s| s.id == id)
        .cloned()
        .unwrap()
}

/// The `account` row of `/v1/limits` named `limit`.
async fn quota_row(t: &T, key: &str, limit: &str) -> Value {
    let (s, v) = t.json_as(key, "GET", "/v1/limits", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["account"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["limit"] == limit)
        .cloned()
        .unwrap_or_else(|| panic!("no row {limit} in {v}"))
}

#[tokio::test]
async fn quotas_bound_what_each_key_runs_and_keeps() {
    let t = T::with(|c| {
        for q in [
            "sandbox.count=2",
            "sandbox.memory_mib=3072",
            "volume.count=1",
            "snapshot.count=1",
        ] {
            c.quotas.set(q).unwrap();
        }
    });
    let row = quota_row(&t, &t.admin, "sandbox.count").await;
    assert_eq!(
        (row["max"].as_u64(), row["used"].as_u64()),
        (Some(2), Some(0)),
        "{row}"
    );
    assert_eq!(row["unit"], "count");
    let a = t.running(json!({"memoryMiB": 1024})).await;
    let b = t.running(json!({"memoryMiB": 1024})).await;
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 512})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(v["error"]["details"]["limit"], "sandbox.count", "{v}");
    assert_eq!(v["error"]["details"]["used"], 2, "{v}");
    let row = quota_row(&t, &t.admin, "sandbox.memory_mib").await;
    assert_eq!(
        (row["used"].as_u64(), row["unit"].as_str()),
        (Some(2048), Some("mib"))
    );

    // Another key's quota is its own.
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let (s, v) = t
        .json_as(
            &other,
            "POST",
            "/v1/sandboxes",
            Some(json!({"memoryMiB": 1024})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // A paused sandbox holds no CPU or memory: room for another, and
    // then its wake is what passes the quota.
    let (s, _) = t
        .json_as(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{a}:pause"),
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    t.wait_state(&a, "paused").await;
    let c = t.running(json!({"memoryMiB": 1024})).await;
    let (s, v) = t.act(&a, "wake", json!({})).await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(s, StatusCode::CONFLICT);
    // The memory quota too, by the sandbox's size.
    t.act(&c, "stop", json!({})).await;
    let (_, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 2560})))
        .await;
    assert_eq!(v["error"]["details"]["limit"], "sandbox.memory_mib", "{v}");
    let (s, v) = t.act(&a, "wake", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let _ = b;

    // Volumes and snapshots.
    let vol = json!({"sizeMiB": 64});
    let (s, _) = t.json("POST", "/v1/volumes", Some(vol.clone())).await;
    assert_eq!(s, StatusCode::CREATED);
    let (_, v) = t.json("POST", "/v1/volumes", Some(vol)).await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(v["error"]["details"]["limit"], "volume.count");
    let (s, v) = t
        .json_as(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{a}:snapshot"),
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert!(s.is_success(), "{v}");
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{a}:snapshot"),
            Some(json!({})),
        )
        .await;
    assert_eq!(v["error"]["details"]["limit"], "snapshot.count", "{v}");
    let row = quota_row(&t, &t.admin, "snapshot.count").await;
    assert_eq!(row["used"], 1, "{row}");
}

#[tokio::test]
async fn a_snapshot_asks_its_estimated_size_of_the_quota_before_the_capture() {
    let t = T::with(|c| c.quotas.set("snapshot.mib=100").unwrap());
    let id = t.running(json!({})).await;
    let path = format!("/v1/sandboxes/{id}:snapshot");
    let snapshot = || t.json("POST", &path, Some(json!({})));
    // The host says the capture would take 150 MiB: refused up front.
    *t.host.capture_bytes.lock().unwrap() = Some(150 << 20);
    let (s, v) = snapshot().await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["details"]["limit"], "snapshot.mib", "{v}");
    assert_eq!(v["error"]["details"]["asked"], 150, "{v}");
    assert_eq!(quota_row(&t, &t.admin, "snapshot.count").await["used"], 0);
    // A byte over a MiB counts as a whole one; within the quota it is taken.
    *t.host.capture_bytes.lock().unwrap() = Some((100 << 20) + 1);
    let (s, v) = snapshot().await;
    assert_eq!(v["error"]["details"]["asked"], 101, "{v}");
    assert!(s.is_client_error(), "{v}");
    *t.host.capture_bytes.lock().unwrap() = Some(100 << 20);
    let (s, v) = snapshot().await;
    assert!(s.is_success(), "{v}");
}

#[tokio::test]
async fn a_snapshot_being_captured_holds_what_it_was_admitted_for() {
    let t = T::with(|c| c.quotas.set("snapshot.mib=100").unwrap());
    let a = t.running(json!({})).await;
    let b = t.running(json!({})).await;
    *t.host.capture_bytes.lock().unwrap() = Some(60 << 20);
    *t.host.capture_delay_ms.lock().unwrap() = 1500;
    let (pa, pb) = (
        format!("/v1/sandboxes/{a}:snapshot"),
        format!("/v1/sandboxes/{b}:snapshot"),
    );
    let (s, first) = t.json("POST", &pa, Some(json!({}))).await;
    assert!(s.is_success(), "{first}");
    assert_eq!(first["state"], "capturing", "{first}");
    // While the first is captured it holds its 60 MiB: a second of 60
    // would pass 100, so it is refused (before, it counted 0 until ready).
    let (s, v) = t.json("POST", &pb, Some(json!({}))).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["details"]["limit"], "snapshot.mib", "{v}");
    assert_eq!(v["error"]["details"]["used"], 60, "{v}");
    // Once ready it counts its real size (the fake's capture is tiny).
    let sid = first["id"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (_, v) = t.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
        if v["state"] != "capturing" || std::time::Instant::now() > deadline {
            assert_eq!(v["state"], "ready", "{v}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (s, v) = t.json("POST", &pb, Some(json!({}))).await;
    assert!(s.is_success(), "{v}");
}

#[tokio::test]
async fn a_keys_own_quotas_replace_the_servers_for_it_alone_while_it_runs() {
    let t = T::with(|c| c.quotas.set("sandbox.count=1").unwrap());
    let small = create_key(&t.dir, Some("small"), false, false).unwrap();
    let big = create_key(&t.dir, Some("big"), false, false).unwrap();
    // Set on the data directory while the server runs, as `runtime keys
    // quota` does: the next admission uses them.
    runtime_server::keys::set_quotas(&t.dir, "big", &["sandbox.count=3".into()]).unwrap();
    let k = runtime_server::keys::set_quotas(
        &t.dir,
        "small",
        &["volume.count=0".into(), "process.count=7".into()],
    )
    .unwrap();
    assert_eq!(k.quotas.get("volume.count"), Some(0));
    // Every wrong setting is named, and none of them is applied.
    let e = runtime_server::keys::set_quotas(
        &t.dir,
        "small",
        &[
            "sandbox.count=5".into(),
            "sandbox.cores=2".into(),
            "volume.mib=x".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("sandbox.cores") && e.contains("\"x\""), "{e}");
    let k = runtime_server::keys::find_key(&t.dir, "small").unwrap();
    assert_eq!(k.quotas.get("sandbox.count"), None, "{k:?}");

    let create = |key: &str| {
        let key = key.to_string();
        let t = &t;
        async move {
            t.json_as(
                &key,
                "POST",
                "/v1/sandboxes",
                Some(json!({"memoryMiB": 512})),
                &[],
            )
            .await
        }
    };
    for _ in 0..3 {
        let (s, v) = create(&big).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (_, v) = create(&big).await;
    assert_eq!(v["error"]["details"]["max"], 3, "{v}");
    let row = quota_row(&t, &big, "sandbox.count").await;
    assert_eq!(
        (row["max"].as_u64(), row["used"].as_u64()),
        (Some(3), Some(3)),
        "{row}"
    );
    // The small key keeps the server's sandbox quota and its own others.
    let (s, v) = create(&small).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, v) = create(&small).await;
    assert_eq!(v["error"]["details"]["max"], 1, "{v}");
    let (_, v) = t
        .json_as(
            &small,
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64})),
            &[],
        )
        .await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(v["error"]["details"]["limit"], "volume.count", "{v}");
    assert_eq!(quota_row(&t, &small, "process.count").await["max"], 7);
    // `default` gives the key the server's back.
    runtime_server::keys::set_quotas(&t.dir, "big", &["sandbox.count=default".into()]).unwrap();
    assert_eq!(quota_row(&t, &big, "sandbox.count").await["max"], 1);
}

#[tokio::test]
async fn uploads_and_processes_have_quotas_per_key_and_sandbox() {
    let t = T::with(|c| {
        c.quotas.set("upload.count=1").unwrap();
        c.quotas.set("process.count=2").unwrap();
    });
    let id = t.running(json!({})).await;
    let up =
        |n: u32| json!({"path": format!("/workspace/f{n}"), "size": 10, "sha256": "0".repeat(64)});
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{id}/uploads"), Some(up(1)))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let first = v["uploadId"].as_str().unwrap().to_string();
    let (_, v) = t
        .json("POST", &format!("/v1/sandboxes/{id}/uploads"), Some(up(2)))
        .await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(v["error"]["details"]["limit"], "upload.count");
    let (s, _) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/uploads/{first}:abort"),
            Some(json!({})),
        )
        .await;
    assert!(s.is_success());
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{id}/uploads"), Some(up(3)))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // Ended processes make room (oldest first); running ones fill it.
    t.host
        .script("hold", vec![Step::Sleep(60_000), Step::Exit(0)]);
    for _ in 0..3 {
        let (s, v) = t
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}:exec"),
                Some(json!({"command": "true"})),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    for _ in 0..2 {
        let (s, v) = t
            .json(
                "POST",
                &format!("/v1/sandboxes/{id}/processes"),
                Some(json!({"command": "hold"})),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"command": "hold"})),
        )
        .await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(v["error"]["details"]["limit"], "process.count", "{v}");
    let (_, v) = t
        .json("GET", &format!("/v1/sandboxes/{id}/processes"), None)
        .await;
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2), "{v}");
}

#[tokio::test]
async fn a_host_without_room_refuses_machines_up_front() {
    let t = T::new();
    let gib = 1u64 << 30;
    *t.host.room.lock().unwrap() = Some(runtime_host::Room {
        memory_total: 4 * gib,
        memory_available: 3 * gib,
        ram_dir_total: 2 * gib,
        ram_dir_free: 2 * gib,
        disk_free: 100 * gib,
    });
    // 4 x 4 GiB may be promised: a 16 GiB machine fits, then nothing more.
    let big = t.running(json!({"memoryMiB": 16384})).await;
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 512})))
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_error(&v, 503, "no_capacity");
    assert_eq!(v["error"]["retryable"], true, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("promised"),
        "{v}"
    );
    t.act(&big, "stop", json!({})).await;
    // Memory available now, and disk, are checked too.
    t.host
        .room
        .lock()
        .unwrap()
        .as_mut()
        .unwrap()
        .memory_available = 600 << 20;
    let (_, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 512})))
        .await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("memory available"),
        "{v}"
    );
    *t.host.room.lock().unwrap() = Some(runtime_host::Room {
        memory_total: 4 * gib,
        memory_available: 3 * gib,
        ram_dir_total: 2 * gib,
        ram_dir_free: 2 * gib,
        disk_free: gib,
    });
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 512})))
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("disk"),
        "{v}"
    );
    t.host.room.lock().unwrap().as_mut().unwrap().disk_free = 100 * gib;
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"memoryMiB": 512})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn the_store_and_uploads_are_readable_only_by_the_server() {
    use std::os::unix::fs::PermissionsExt;
    let t = T::new();
    let id = t.running(json!({})).await;
    let body = json!({"path": "/workspace/f", "size": 10, "sha256": "0".repeat(64)});
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{id}/uploads"), Some(body))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let upload = t.dir.join("uploads").join(v["uploadId"].as_str().unwrap());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for (p, want) in [
        (t.dir.join("runtime.db"), 0o600),
        (t.dir.join("runtime.db-wal"), 0o600),
        (t.dir.join("uploads"), 0o700),
        (upload, 0o600),
    ] {
        assert_eq!(mode(&p), want, "{}", p.display());
    }
}

#[tokio::test]
async fn a_writer_slow_to_sync_holds_up_only_its_own_views() {
    let t = T::new();
    let (_, vol) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "slow"})),
        )
        .await;
    let vid = vol["id"].as_str().unwrap().to_string();
    t.running(json!({"volumes": [{"volumeId": vid, "path": "/data"}]}))
        .await;
    // The writer's `sync` (run before a snapshot view is made) takes long.
    t.host
        .script("sync", vec![Step::Sleep(1500), Step::Exit(0)]);
    let other = create_key(&t.dir, Some("other"), false, false).unwrap();
    let view = json!({"volumes": [{"volumeId": vid, "path": "/v", "mode": "snapshot"}]});
    let order = std::sync::Mutex::new(Vec::new());
    tokio::join!(
        async {
            let (s, v) = t.json("POST", "/v1/sandboxes", Some(view)).await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            order.lock().unwrap().push("view");
        },
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (s, v) = t
                .json_as(&other, "POST", "/v1/sandboxes", Some(json!({})), &[])
                .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            order.lock().unwrap().push("plain");
        }
    );
    // The other key's create did not wait for the writer's flush.
    assert_eq!(*order.lock().unwrap(), vec!["plain", "view"]);
}

#[tokio::test]
async fn volumes_create_attach_exclusively_and_delete_only_when_free() {
    let t = T::new();
    let (s, v) = t.json("POST", "/v1/volumes", Some(json!({}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v.to_string().contains("sizeMiB"), "{v}");
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "data", "shared": "yes"})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, vol) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "data"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{vol}");
    assert_eq!(
        (vol["state"].as_str(), vol["sizeMiB"].as_u64()),
        (Some("ready"), Some(64))
    );
    let vid = vol["id"].as_str().unwrap().to_string();
    let file = t.dir.join("volumes").join(format!("{vid}.ext4"));
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 64 << 20);
    // A real ext4 file system (the magic at 0x438).
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(&bytes[0x438..0x43a], &[0x53, 0xef]);
    let (s, v) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "data"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "name_taken");
    // Another key's "data" is its own; the admin's "data" still names the
    // admin's, and key B's names B's.
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let (s, theirs) = t
        .json_as(
            &b,
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 64, "name": "data"})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{theirs}");
    assert_ne!(theirs["id"], vol["id"]);
    for (key, want) in [(&t.admin, &vol["id"]), (&b, &theirs["id"])] {
        let (s, v) = t.json_as(key, "GET", "/v1/volumes/data", None, &[]).await;
        assert_eq!((s, &v["id"]), (StatusCode::OK, want), "{v}");
    }
    let (s, _) = t
        .json_as(
            &b,
            "DELETE",
            &format!("/v1/volumes/{}", theirs["id"].as_str().unwrap()),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::OK);

    // Paths and modes are checked before anything starts, each by name.
    let bad = json!({"volumes": [
        {"volumeId": vid, "path": "data"},
        {"volumeId": vid, "path": "/"},
        {"volumeId": vid, "path": "/etc/x"},
        {"volumeId": vid, "path": "/mnt/../proc", "mode": "ro"},
    ]});
    let (s, v) = t.json("POST", "/v1/sandboxes", Some(bad)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    for f in [
        "volumes[0].path",
        "volumes[1].path",
        "volumes[2].path",
        "volumes[3].path",
        "volumes[3].mode",
    ] {
        assert!(fields.contains(&f), "{f} in {fields:?}");
    }
    let five: Vec<Value> = (0..5)
        .map(|i| json!({"volumeId": vid, "path": format!("/v{i}")}))
        .collect();
    let (s, _) = t
        .json("POST", "/v1/sandboxes", Some(json!({"volumes": five})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"volumes": [
            {"volumeId": vid, "path": "/data"}, {"volumeId": vid, "path": "/data/x", "mode": "snapshot"}]})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"volumes": [{"volumeId": "nope", "path": "/data"}]})),
        )
        .await;
    assert_error(&v, 404, "volume_not_found");
    assert_eq!(s, StatusCode::NOT_FOUND);

    // A writer, by name; its machine gets the drive.
    let a = t
        .running(json!({"volumes": [{"volumeId": "data", "path": "/data"}]}))
        .await;
    let spec = started_spec(&t, &a);
    assert_eq!(spec.volumes.len(), 1);
    assert_eq!(spec.volumes[0].file, file);
    assert_eq!(
        (spec.volumes[0].path.as_str(), spec.volumes[0].snapshot),
        ("/data", false)
    );
    let (_, v) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(v["attachments"][0]["sandboxId"], a.as_str(), "{v}");
    assert_eq!(v["attachments"][0]["mode"], "rw");

    // One writer at a time; snapshot views beside it.
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"volumes": [{"volumeId": vid, "path": "/other"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_in_use");
    assert_eq!(v["error"]["details"]["sandboxId"], a.as_str());
    let b = t
        .running(
            json!({"volumes": [{"volumeId": vid, "path": "/workspace/view", "mode": "snapshot"}]}),
        )
        .await;
    assert!(started_spec(&t, &b).volumes[0].snapshot);

    // No copies of a machine with volumes; no delete while attached.
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{a}:fork"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_attached");
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{b}:snapshot"),
            Some(json!({})),
        )
        .await;
    assert_error(&v, 409, "volume_attached");
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_in_use");

    // Another key sees nothing of it.
    let other = create_key(&t.dir, None, false, false).unwrap();
    let (s, _) = t
        .json_as(&other, "GET", &format!("/v1/volumes/{vid}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, v) = t.json_as(&other, "GET", "/v1/volumes", None, &[]).await;
    assert_eq!(v["data"], json!([]));
    let (s, _) = t
        .json_as(
            &other,
            "POST",
            "/v1/sandboxes",
            Some(json!({"volumes": [{"volumeId": vid, "path": "/d"}]})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Once the writer is deleted, the next one may write; the file stays.
    t.json("DELETE", &format!("/v1/sandboxes/{a}"), None).await;
    let mut c = None;
    for _ in 0..100 {
        let (s, v) = t
            .json_as(
                &t.admin.clone(),
                "POST",
                "/v1/sandboxes",
                Some(json!({"volumes": [{"volumeId": vid, "path": "/data"}]})),
                &[("prefer", "wait=10")],
            )
            .await;
        if s == StatusCode::CREATED {
            c = Some(v["id"].as_str().unwrap().to_string());
            break;
        }
        assert_error(&v, 409, "volume_releasing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = c.expect("the volume was released");
    assert!(t.host.destroyed.lock().unwrap().contains(&a));
    assert!(file.exists());
    let (_, v) = t.json("GET", "/v1/volumes", None).await;
    assert_eq!(v["data"][0]["id"], vid.as_str());
    let holders: Vec<&str> = v["data"][0]["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["sandboxId"].as_str().unwrap())
        .collect();
    assert!(
        holders.contains(&b.as_str())
            && holders.contains(&c.as_str())
            && !holders.contains(&a.as_str()),
        "{v}"
    );

    t.json("DELETE", &format!("/v1/sandboxes/{b}"), None).await;
    t.json("DELETE", &format!("/v1/sandboxes/{c}"), None).await;
    let mut deleted = false;
    for _ in 0..100 {
        let (s, v) = t
            .json(
                "POST",
                &format!("/v1/volumes/{vid}:delete"),
                Some(json!({})),
            )
            .await;
        if s == StatusCode::OK {
            assert_eq!(v["status"], "deleted");
            deleted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(deleted);
    assert!(!file.exists());
    let (s, _) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn volumes_survive_a_restart_of_the_server_and_specs_keep_them() {
    let t = T::new();
    let (_, vol) = t
        .json("POST", "/v1/volumes", Some(json!({"sizeMiB": 32})))
        .await;
    let vid = vol["id"].as_str().unwrap().to_string();
    let a = t
        .running(json!({"volumes": [{"volumeId": vid, "path": "/data"}]}))
        .await;
    // A new server process on the same data dir.
    let host = Arc::new(FakeHost::default());
    host.recoverable.lock().unwrap().insert(a.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host, |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let (s, v) = t2.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["attachments"][0]["sandboxId"], a.as_str());
    let (s, v) = t2
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"volumes": [{"volumeId": vid, "path": "/d"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    std::mem::forget(t2); // the same directory: removed once, by `t`
}

// ---- images ----

#[tokio::test]
async fn image_requests_are_checked_before_any_build() {
    let t = T::new();
    let cases = [
        (json!({}), "recipe"),
        (
            json!({"recipe": {"pip": ["x"]}, "dockerfile": "FROM runtime"}),
            "recipe",
        ),
        (json!({"recipe": {"bogus": 1}}), "recipe"),
        (
            json!({"recipe": {"pip": ["--index-url=http://x"]}}),
            "recipe",
        ),
        (json!({"recipe": {"workdir": "relative"}}), "recipe"),
        (json!({"dockerfile": "RUN true"}), "dockerfile"),
        (
            json!({"dockerfile": "FROM runtime\nONBUILD RUN true"}),
            "dockerfile",
        ),
        (
            json!({"dockerfile": "FROM runtime\nCOPY missing.txt /x"}),
            "dockerfile",
        ),
        (
            json!({"dockerfile": "FROM runtime\nUSER nobody"}),
            "dockerfile",
        ),
        (json!({"image": "python:3.12", "recipe": {}}), "recipe"),
        // Neither one of the caller's images nor a registry reference.
        (json!({"image": "Not A Ref"}), "image"),
        (json!({"recipe": {"base": "Nope!"}}), "recipe"),
        (
            json!({"dockerfile": "FROM reg.example.com/x:-bad"}),
            "dockerfile",
        ),
        (json!({"recipe": {}, "name": "a:b"}), "name"),
    ];
    for (body, field) in cases {
        let (s, v) = t.json("POST", "/v1/images", Some(body.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert!(
            v["error"]["details"]["issues"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["field"] == field),
            "{body} -> {v}"
        );
    }
    // A base id that is not one of ours (any other name is a registry
    // reference), an image a create names that does not exist.
    let (s, v) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"recipe": {"base": "0b6c1c52-5bd4-4f43-9d36-0d1c3c1e6f00"}})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "image_not_found");
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"image": "nope:latest"})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = t.json("GET", "/v1/images/resolve?ref=nope", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    // "default" is the server's own image, as before.
    t.running(json!({"image": "default"})).await;
}

#[tokio::test]
async fn a_copy_of_a_directory_of_inline_files_copies_each_of_them() {
    // The official client's Daytona layer sends `add_local_dir` (and a
    // Dockerfile's `COPY ./conf/ ...`) as inline files under a directory.
    let t = T::new();
    let (s, v) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({
                "dockerfile": "FROM runtime\nCOPY ctx/1 /opt/tree\nCOPY ./conf/ /etc/c/\n",
                "files": [
                    {"path": "ctx/1/top.txt", "content": "dG9w", "encoding": "base64"},
                    {"path": "ctx/1/sub/deep.txt", "content": "deep"},
                    {"path": "conf//a.conf", "content": "a", "mode": 0o600},
                ],
            })),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let steps: Vec<&str> = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["instruction"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            "COPY /opt/tree/sub/deep.txt (4 bytes, sha256 74611c1d6455)",
            "COPY /opt/tree/top.txt (3 bytes, sha256 28720365c5e7)",
            "COPY /etc/c/a.conf (1 bytes, sha256 ca978112ca1b)",
        ],
        "{v}"
    );
    // A directory with nothing under it is still no source.
    let (s, v) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"dockerfile": "FROM runtime\nCOPY ctx/2 /x\n",
                        "files": [{"path": "ctx/1/top.txt", "content": "top"}]})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        v["error"]["details"]["issues"],
        json!([{"field": "dockerfile",
                "message": "Dockerfile line 2 (COPY): ctx/2 is not among the build's files"}]),
        "{v}"
    );
}

/// Builds `body` and waits until it is no longer queued or building.
async fn built(t: &T, body: Value) -> Value {
    let (s, v) = t.json("POST", "/v1/images", Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED, "{body} -> {v}");
    finished(t, v["id"].as_str().unwrap()).await
}

/// Waits until image `id` is no longer queued or building.
async fn finished(t: &T, id: &str) -> Value {
    for _ in 0..200 {
        let (_, v) = t.json("GET", &format!("/v1/images/{id}"), None).await;
        if !matches!(v["state"].as_str(), Some("queued" | "building")) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("image {id} never finished building");
}

#[tokio::test]
async fn a_registry_reference_is_queued_as_a_pull_and_fails_naming_it() {
    let t = T::new();
    // Not one of the caller's names: a registry image, read as Docker does.
    let (s, v) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"name": "py", "image": "python:3.12-slim"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["source"], "image", "{v}");
    assert_eq!(v["pulled"], "docker.io/library/python:3.12-slim", "{v}");
    assert_eq!(v["steps"], json!([]), "{v}");
    // The fake host has no egress: the pull fails, naming the reference,
    // and the image is failed, with no layer left.
    let v = finished(&t, v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "failed", "{v}");
    let err = v["error"].as_str().unwrap();
    assert!(
        err.starts_with("pulling docker.io/library/python:3.12-slim:"),
        "{err}"
    );
    // A name of the caller's own still means that image.
    let app = built(
        &t,
        json!({"name": "python", "dockerfile": "FROM runtime\nENV A=1"}),
    )
    .await;
    assert_eq!(app["state"], "ready", "{app}");
    let (s, v) = t
        .json("POST", "/v1/images", Some(json!({"image": "python"})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["base"], app["id"], "{v}");
    assert_eq!(v["pulled"], Value::Null, "{v}");
    let v = finished(&t, v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "ready", "{v}");
}

#[tokio::test]
async fn a_build_machine_has_the_shape_its_build_asks_for() {
    let t = T::new();
    for cmd in ["true", "echo two"] {
        t.host
            .script(&format!("(\nset -e\n{cmd}\n) && sync"), vec![Step::Exit(0)]);
    }
    let v = built(
        &t,
        json!({"recipe": {"commands": ["true"]}, "build": {"vcpu": 1, "memoryMiB": 1024, "timeoutSeconds": 120, "diskMiB": 5120}}),
    )
    .await;
    assert_eq!(v["state"], "ready", "{v}");
    assert_eq!(
        v["build"],
        json!({"vcpu": 1, "memoryMiB": 1024, "timeoutSeconds": 120, "maxImageMiB": 8192, "diskMiB": 5120})
    );
    let specs = t.host.specs.lock().unwrap().clone();
    let machine = specs
        .iter()
        .find(|s| s.hostname == "build")
        .expect("a build machine started");
    assert_eq!(
        (machine.vcpu, machine.memory_mib, machine.disk_mib),
        (1, 1024, 5120)
    );
    // Without `build`, the defaults.
    let plain = built(&t, json!({"recipe": {"commands": ["echo two"]}})).await;
    assert_eq!(plain["build"]["vcpu"], 2, "{plain}");
    assert_eq!(plain["build"]["diskMiB"], 3072, "{plain}");
    let specs = t.host.specs.lock().unwrap().clone();
    let last = specs.iter().rev().find(|s| s.hostname == "build").unwrap();
    assert_eq!((last.vcpu, last.memory_mib, last.disk_mib), (2, 2048, 3072));
    // The same step on another disk is another layer (its file system is
    // another size), so it runs again; on the default disk it is cached.
    let again = built(&t, json!({"recipe": {"commands": ["true"]}})).await;
    assert_eq!(again["state"], "ready", "{again}");
    assert_eq!(again["steps"][0]["cached"], false, "{again}");
    let cached = built(
        &t,
        json!({"recipe": {"commands": ["true"]}, "build": {"diskMiB": 5120}}),
    )
    .await;
    assert_eq!(cached["steps"][0]["cached"], true, "{cached}");
    // Out of range, wrong types, unknown fields: each named, nothing queued.
    let (s, e) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"recipe": {}, "build": {"vcpu": 0, "memoryMiB": "x", "diskMiB": 40000, "cacheMiB": 1}})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{e}");
    let text = e.to_string();
    for f in [
        "build.vcpu",
        "build.memoryMiB",
        "build.diskMiB",
        "build.cacheMiB",
    ] {
        assert!(text.contains(f), "{f} not named: {text}");
    }
    let (_, list) = t.json("GET", "/v1/images", None).await;
    assert_eq!(list["data"].as_array().map(Vec::len), Some(4), "{list}");
}

#[tokio::test]
async fn an_image_built_on_one_of_ours_keeps_its_user_and_env() {
    let t = T::new();
    // No RUN, WORKDIR or COPY: no steps, so the fake host need run nothing.
    let parent = built(
        &t,
        json!({"name": "parent", "dockerfile": "FROM runtime\nENV A=1\nUSER user\nCMD sleep 1"}),
    )
    .await;
    assert_eq!(parent["state"], "ready", "{parent}");
    assert_eq!(parent["user"], "user", "{parent}");
    // A Dockerfile on it goes on as its USER (not root), with its ENV.
    let child = built(
        &t,
        json!({"name": "child", "dockerfile": "FROM parent\nENV B=2"}),
    )
    .await;
    assert_eq!(child["state"], "ready", "{child}");
    assert_eq!(child["base"], parent["id"], "{child}");
    assert_eq!(child["user"], "user", "{child}");
    assert_eq!(child["env"], json!(["A", "B"]), "{child}");
    // A root parent stays root under a recipe too; the server's own image
    // still starts a Dockerfile as root and a recipe as the sandbox user.
    let rooted = built(
        &t,
        json!({"name": "rooted", "dockerfile": "FROM parent\nUSER root"}),
    )
    .await;
    assert_eq!(rooted["user"], "root", "{rooted}");
    let on_root = built(&t, json!({"recipe": {"base": "rooted", "env": {"C": "3"}}})).await;
    assert_eq!(on_root["user"], "root", "{on_root}");
    assert_eq!(on_root["env"], json!(["A", "C"]), "{on_root}");
    let plain = built(&t, json!({"dockerfile": "FROM runtime"})).await;
    assert_eq!(plain["user"], "root", "{plain}");
    let recipe = built(&t, json!({"recipe": {"files": {"/etc/x": "y"}}})).await;
    assert_eq!(recipe["user"], "user", "{recipe}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_builds_of_one_name_get_distinct_versions() {
    // Each create is its own task on a multi-threaded runtime, so nothing
    // but the server orders them: each name's versions must be 1..N, once
    // each. (Before the store assigned versions, about one round in three
    // gave two images one version.)
    let t = T::new();
    const N: usize = 48;
    for round in 0..8 {
        let name = format!("race{round}");
        let mut tasks = Vec::new();
        for _ in 0..N {
            let state = t.state.clone();
            let admin = t.admin.clone();
            let body = json!({"name": name, "recipe": {}}).to_string();
            tasks.push(tokio::spawn(async move {
                let req = Request::builder()
                    .method("POST")
                    .uri("/v1/images")
                    .header("authorization", format!("Bearer {admin}"))
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap();
                let resp = router(state).oneshot(req).await.unwrap();
                let status = resp.status();
                let b = resp.into_body().collect().await.unwrap().to_bytes();
                let v: Value = serde_json::from_slice(&b).unwrap();
                assert_eq!(status, StatusCode::CREATED, "{v}");
                v["version"].as_u64().unwrap()
            }));
        }
        let mut versions = Vec::new();
        for task in tasks {
            versions.push(task.await.unwrap());
        }
        versions.sort_unstable();
        assert_eq!(versions, (1..=N as u64).collect::<Vec<_>>(), "{name}");
        // Each version resolves to one image of that version.
        for v in [1, N as u64] {
            let (s, img) = t
                .json("GET", &format!("/v1/images/resolve?ref={name}@{v}"), None)
                .await;
            assert_eq!(s, StatusCode::OK, "{img}");
            assert_eq!(img["version"], v, "{img}");
        }
    }
}

#[tokio::test]
async fn a_name_resolves_to_its_ready_version_while_a_new_one_builds_or_after_it_failed() {
    let t = T::new();
    let v1 = built(&t, json!({"name": "app", "recipe": {}})).await;
    assert_eq!(v1["state"], "ready", "{v1}");
    // A new version that fails keeps the name on the ready one (its tags
    // move only when it is ready).
    let v2 = built(&t, json!({"name": "app", "recipe": {"commands": ["nope"]}})).await;
    assert_eq!(
        (v2["state"].as_str(), v2["version"].as_u64()),
        (Some("failed"), Some(2)),
        "{v2}"
    );
    for r in ["app", "app:latest"] {
        let (s, v) = t
            .json("GET", &format!("/v1/images/resolve?ref={r}"), None)
            .await;
        assert_eq!((s, &v["id"]), (StatusCode::OK, &v1["id"]), "{r}: {v}");
    }
    let sbx = t.running(json!({"image": "app"})).await;
    let (_, v) = t.json("GET", &format!("/v1/sandboxes/{sbx}"), None).await;
    assert_eq!(v["image"], v1["id"], "{v}");
    // So does one still building; once ready, the name is its.
    t.host.script(
        "(\nset -e\nslow\n) && sync",
        vec![Step::Sleep(400), Step::Exit(0)],
    );
    let (s, v3) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"name": "app", "recipe": {"commands": ["slow"]}})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v3}");
    let (_, v) = t.json("GET", "/v1/images/resolve?ref=app", None).await;
    assert_eq!(v["id"], v1["id"], "{v}");
    let v3 = finished(&t, v3["id"].as_str().unwrap()).await;
    assert_eq!(v3["state"], "ready", "{v3}");
    let (_, v) = t.json("GET", "/v1/images/resolve?ref=app", None).await;
    assert_eq!(v["id"], v3["id"], "{v}");
    // A name with no ready version yet still names its build (not ready).
    t.host.script(
        "(\nset -e\nslower\n) && sync",
        vec![Step::Sleep(2000), Step::Exit(0)],
    );
    let (_, fresh) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"name": "fresh", "recipe": {"commands": ["slower"]}})),
        )
        .await;
    let (_, v) = t.json("GET", "/v1/images/resolve?ref=fresh", None).await;
    assert_eq!(v["id"], fresh["id"], "{v}");
    let (s, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"image": "fresh"})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "image_not_ready");
}

#[tokio::test]
async fn a_version_in_use_is_deleted_from_the_api_and_its_sandboxes_keep_it() {
    let t = T::new();
    let v1 = built(&t, json!({"name": "app", "recipe": {"env": {"V": "1"}}})).await;
    let id = v1["id"].as_str().unwrap().to_string();
    let (s, sbx) = t
        .json("POST", "/v1/sandboxes", Some(json!({"image": "app"})))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{sbx}");
    let sid = sbx["id"].as_str().unwrap().to_string();
    // Deleted while the sandbox runs on it: as the product does.
    let (s, v) = t.json("DELETE", &format!("/v1/images/{id}"), None).await;
    assert!(s.is_success(), "{s} {v}");
    let (s, v) = t.json("GET", &format!("/v1/images/{id}"), None).await;
    assert_error(&v, 404, "image_not_found");
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, list) = t.json("GET", "/v1/images", None).await;
    assert_eq!(list["data"], json!([]), "{list}");
    let (_, v) = t.json("GET", "/v1/images/resolve?ref=app", None).await;
    assert_error(&v, 404, "image_not_found");
    let (_, v) = t
        .json("POST", "/v1/sandboxes", Some(json!({"image": id})))
        .await;
    assert_error(&v, 404, "image_not_found");
    let (_, v) = t.json("DELETE", &format!("/v1/images/{id}"), None).await;
    assert_error(&v, 404, "image_not_found");
    // The sandbox keeps its image; the name's next build is version 2.
    let (s, v) = t.json("GET", &format!("/v1/sandboxes/{sid}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["image"], json!(id), "{v}");
    let v2 = built(&t, json!({"name": "app", "recipe": {"env": {"V": "2"}}})).await;
    assert_eq!(v2["version"], 2, "{v2}");
    assert_eq!(v2["tags"], json!(["latest"]), "{v2}");
}

#[tokio::test]
async fn an_image_name_belongs_to_its_key_and_resolves_only_among_its_images() {
    let t = T::new();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let mine = built(
        &t,
        json!({"name": "app", "recipe": {"env": {"WHO": "admin"}}}),
    )
    .await;
    // Key B builds an image of the same name: versions of its own, and the
    // admin's keeps its tags.
    let (s, v) = t
        .json_as(
            &b,
            "POST",
            "/v1/images",
            Some(json!({"name": "app", "recipe": {"env": {"WHO": "b"}}})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let theirs = finished(&t, v["id"].as_str().unwrap()).await;
    assert_eq!(
        (theirs["state"].as_str(), theirs["version"].as_u64()),
        (Some("ready"), Some(1)),
        "{theirs}"
    );
    let (_, again) = t
        .json(
            "GET",
            &format!("/v1/images/{}", mine["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(again["tags"], json!(["latest"]), "{again}");
    // Each key's "app" is its own, the admin's too (it sees B's by id).
    for r in ["app", "app:latest", "app@1"] {
        let (_, v) = t
            .json("GET", &format!("/v1/images/resolve?ref={r}"), None)
            .await;
        assert_eq!(v["id"], mine["id"], "{r}: {v}");
        let (_, v) = t
            .json_as(&b, "GET", &format!("/v1/images/resolve?ref={r}"), None, &[])
            .await;
        assert_eq!(v["id"], theirs["id"], "{r}: {v}");
    }
    let sbx = t.running(json!({"image": "app"})).await;
    let (_, v) = t.json("GET", &format!("/v1/sandboxes/{sbx}"), None).await;
    assert_eq!(v["image"], mine["id"], "{v}");
    let (s, v) = t
        .json(
            "GET",
            &format!("/v1/images/{}", theirs["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn tags_go_to_the_newest_ready_version_whatever_order_builds_end_in() {
    let t = T::new();
    // A build step's command is its script in a subshell after `set -e`, then `sync`.
    let hold = |cmd: &str, ms: u64| {
        t.host.script(
            &format!("(\nset -e\n{cmd}\n) && sync"),
            vec![Step::Sleep(ms), Step::Exit(0)],
        );
    };
    hold("short", 50);
    hold("long", 500);
    for (first, second) in [("short", "long"), ("long", "short")] {
        let name = format!("app-{first}");
        let create = |cmd: &str| json!({"name": name, "recipe": {"commands": [cmd]}});
        let (_, older) = t.json("POST", "/v1/images", Some(create(first))).await;
        let (_, newer) = t.json("POST", "/v1/images", Some(create(second))).await;
        assert_eq!(
            (older["version"].as_u64(), newer["version"].as_u64()),
            (Some(1), Some(2))
        );
        for id in [&older["id"], &newer["id"]] {
            assert_eq!(finished(&t, id.as_str().unwrap()).await["state"], "ready");
        }
        // Whichever ended last, `latest` is version 2's.
        let (_, v) = t
            .json("GET", &format!("/v1/images/resolve?ref={name}"), None)
            .await;
        assert_eq!(v["id"], newer["id"], "{first} first: {v}");
        let (_, v) = t
            .json(
                "GET",
                &format!("/v1/images/{}", newer["id"].as_str().unwrap()),
                None,
            )
            .await;
        assert_eq!(v["tags"], json!(["latest"]), "{first} first: {v}");
        let (_, v) = t
            .json(
                "GET",
                &format!("/v1/images/{}", older["id"].as_str().unwrap()),
                None,
            )
            .await;
        assert_eq!(v["tags"], json!([]), "{first} first: {v}");
    }
}

#[tokio::test]
async fn tags_move_by_hand_and_a_reference_that_names_nothing_lists_what_exists() {
    let t = T::new();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let v1 = built(
        &t,
        json!({"name": "web", "dockerfile": "FROM runtime\nENV V=1"}),
    )
    .await;
    let v2 = built(
        &t,
        json!({"name": "web", "dockerfile": "FROM runtime\nENV V=2"}),
    )
    .await;
    let (id1, id2) = (v1["id"].as_str().unwrap(), v2["id"].as_str().unwrap());
    let t = &t;
    let resolve = |r: &str| {
        let path = format!("/v1/images/resolve?ref={r}");
        async move { t.json("GET", &path, None).await }
    };
    // `prod` on version 1, then moved to version 2: one version holds a tag.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/images/{id1}:tag"),
            Some(json!({"tag": "prod"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["tags"], json!(["prod"]), "{v}");
    assert_eq!(resolve("web:prod").await.1["id"], id1);
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/images/{id2}:tag"),
            Some(json!({"tag": "prod"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["tags"], json!(["latest", "prod"]), "{v}");
    assert_eq!(resolve("web:prod").await.1["id"], id2);
    let (_, old) = t.json("GET", &format!("/v1/images/{id1}"), None).await;
    assert_eq!(old["tags"], json!([]), "{old}");
    // Untagged, `web:prod` names nothing, and the answer lists what exists.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/images/{id2}:untag"),
            Some(json!({"tag": "prod"})),
        )
        .await;
    assert_eq!((s, &v["tags"]), (StatusCode::OK, &json!(["latest"])), "{v}");
    let (s, v) = resolve("web:prod").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "image_not_found");
    assert_eq!(v["error"]["details"]["tags"], json!(["latest"]), "{v}");
    assert_eq!(v["error"]["details"]["versions"], json!([1, 2]), "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("latest") && message.contains("1, 2"),
        "{v}"
    );
    // A name never built: how to build it.
    let (s, v) = resolve("python:3.12-slim").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["details"]["versions"], json!([]), "{v}");
    assert!(
        v["error"]["hint"]
            .as_str()
            .unwrap()
            .contains("image=\"python:3.12-slim\""),
        "{v}"
    );
    // Bad tags are named; an image without a name has no tags; another key
    // does not see the image at all.
    for body in [
        json!({}),
        json!({"tag": "a:b"}),
        json!({"tag": "x", "other": 1}),
    ] {
        let (s, v) = t
            .json("POST", &format!("/v1/images/{id1}:tag"), Some(body.clone()))
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {v}");
    }
    let (_, v) = t
        .json(
            "POST",
            &format!("/v1/images/{id1}:tag"),
            Some(json!({"tag": "a b", "x": 1})),
        )
        .await;
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    assert!(fields.contains(&"tag") && fields.contains(&"x"), "{v}");
    let unnamed = built(t, json!({"dockerfile": "FROM runtime"})).await;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/images/{}:tag", unnamed["id"].as_str().unwrap()),
            Some(json!({"tag": "x"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, v) = t
        .json_as(
            &b,
            "POST",
            &format!("/v1/images/{id1}:tag"),
            Some(json!({"tag": "x"})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (_, mine) = t.json("GET", &format!("/v1/images/{id1}"), None).await;
    assert_eq!(mine["tags"], json!([]), "{mine}");
}

/// The NDJSON events of a followed log, collected whole.
async fn followed(t: &T, id: &str, after: u64) -> Vec<Value> {
    let body = t
        .stream(
            "GET",
            format!("/v1/images/{id}/logs?follow=true&after={after}"),
            None,
        )
        .await
        .unwrap();
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

#[tokio::test]
async fn a_followed_build_log_streams_each_line_as_written_then_the_image() {
    let t = T::new();
    t.host.script(
        "(\nset -e\necho one; sleep 1; echo two\n) && sync",
        vec![
            Step::Out(b"one\n".to_vec()),
            Step::Sleep(600),
            Step::Out(b"two\n".to_vec()),
            Step::Exit(0),
        ],
    );
    let (s, v) = t
        .json(
            "POST",
            "/v1/images",
            Some(json!({"name": "slow", "dockerfile": "FROM runtime\nRUN echo one; sleep 1; echo two"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    // Followed from the start, while it builds: every line, then `done`.
    let started = std::time::Instant::now();
    let events = followed(&t, &id, 0).await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "{events:?}"
    );
    let (last, lines) = events.split_last().unwrap();
    assert_eq!(last["type"], "done", "{events:?}");
    assert_eq!(last["image"]["state"], "ready", "{last}");
    assert!(lines.iter().all(|e| e["type"] == "line"), "{events:?}");
    let texts: Vec<&str> = lines.iter().map(|e| e["text"].as_str().unwrap()).collect();
    let one = texts.iter().position(|l| *l == "one").unwrap();
    let two = texts.iter().position(|l| *l == "two").unwrap();
    assert!(one < two, "{texts:?}");
    assert_eq!(lines[two]["step"], 0, "{events:?}");
    let seqs: Vec<u64> = lines.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    // From a seq on, only what came after it; the image's plain log agrees.
    let after = seqs[one];
    let rest = followed(&t, &id, after).await;
    assert_eq!(rest.len(), events.len() - one - 1, "{rest:?}");
    assert!(rest[0]["seq"].as_u64().unwrap() > after, "{rest:?}");
    let (_, plain) = t.json("GET", &format!("/v1/images/{id}/logs"), None).await;
    assert_eq!(
        plain["lines"].as_array().unwrap().len(),
        lines.len(),
        "{plain}"
    );
    // An image nobody has: a 404 answer, not a stream.
    let (s, v) = t
        .json("GET", "/v1/images/nope/logs?follow=true", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = t
        .json("GET", &format!("/v1/images/{id}/logs?follow=maybe"), None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
}

#[tokio::test]
async fn a_multi_stage_build_boots_each_stage_with_the_layers_it_copies_from() {
    let t = T::new();
    for cmd in ["echo build", "echo final", "set -- '/run/runtime-from/"] {
        t.host
            .script(&format!("(\nset -e\n{cmd}*"), vec![Step::Exit(0)]);
    }
    let text = "FROM runtime AS build\nRUN echo build\nFROM runtime AS unused\nRUN echo unused\n\
                FROM runtime\nRUN echo final\nCOPY --from=build /out /app/\n";
    let v = built(&t, json!({"name": "ms", "dockerfile": text})).await;
    assert_eq!(v["state"], "ready", "{v}");
    let steps = v["steps"].as_array().unwrap();
    let shown: Vec<&str> = steps
        .iter()
        .map(|s| s["instruction"].as_str().unwrap())
        .collect();
    assert_eq!(shown[..2], ["RUN echo build", "RUN echo final"]);
    assert!(
        shown[2].starts_with("COPY --from=build /out /app/ (from layer "),
        "{shown:?}"
    );
    assert_eq!(shown.len(), 3, "the unused stage is not built: {shown:?}");
    assert!(steps.iter().all(|s| s["state"] == "done"), "{v}");
    // One machine per stage, both on the server's image; the second has
    // the build stage's last layer as a volume (a raw copy, gone after).
    let builds: Vec<runtime_host::MachineSpec> = t
        .host
        .specs
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.hostname == "build")
        .cloned()
        .collect();
    assert_eq!(builds.len(), 2, "{builds:?}");
    assert!(builds.iter().all(|s| s.image.is_none()));
    assert!(builds[0].volumes.is_empty());
    assert_eq!(builds[1].volumes.len(), 1);
    let layers = t.dir.join("images").join("layers");
    let first: Vec<String> = std::fs::read_dir(&layers)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mount = builds[1].volumes[0].path.clone();
    let key = mount.trim_start_matches("/run/runtime-from/");
    assert!(first.iter().any(|k| k == key), "{mount} {first:?}");
    assert!(builds[1].volumes[0]
        .file
        .starts_with(t.dir.join("images").join("from")));
    assert!(!builds[1].volumes[0].file.exists());
    // Built again: every step cached, no machine.
    let again = built(&t, json!({"name": "ms", "dockerfile": text})).await;
    assert!(
        again["steps"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["state"] == "cached"),
        "{again}"
    );
    let machines = t
        .host
        .specs
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.hostname == "build")
        .count();
    assert_eq!(machines, 2);
}

#[tokio::test]
async fn a_prune_removes_only_the_layers_and_blobs_nothing_uses() {
    let t = T::new();
    let layers = t.dir.join("images").join("layers");
    let run = |args: &[&str]| {
        let ok = std::process::Command::new(args[0])
            .args(&args[1..])
            .status()
            .unwrap()
            .success();
        assert!(ok, "{args:?}");
    };
    for cmd in ["echo kept", "echo gone"] {
        t.host
            .script(&format!("(\nset -e\n{cmd}\n) && sync"), vec![Step::Exit(0)]);
    }
    let kept = built(
        &t,
        json!({"name": "kept", "dockerfile": "FROM runtime\nRUN echo kept"}),
    )
    .await;
    let gone = built(
        &t,
        json!({"name": "gone", "dockerfile": "FROM runtime\nRUN echo gone"}),
    )
    .await;
    assert_eq!(
        (kept["state"].as_str(), gone["state"].as_str()),
        (Some("ready"), Some("ready"))
    );
    let before: HashSet<String> = std::fs::read_dir(&layers)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(before.len(), 2, "{before:?}");
    let (s, v) = t
        .json(
            "DELETE",
            &format!("/v1/images/{}", gone["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // A layer no record names but a machine's disk rests on (through a
    // qcow2 backing file), one nothing uses, and one too young to judge.
    std::fs::create_dir_all(layers.join("rested-on")).unwrap();
    let base = layers.join("rested-on").join("disk.qcow2");
    run(&[
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        base.to_str().unwrap(),
        "8M",
    ]);
    let vm = t.dir.join("vms").join("some-vm");
    std::fs::create_dir_all(&vm).unwrap();
    let overlay = vm.join("overlay.qcow2");
    run(&[
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        base.to_str().unwrap(),
        overlay.to_str().unwrap(),
    ]);
    std::fs::create_dir_all(layers.join("orphan")).unwrap();
    std::fs::write(layers.join("orphan").join("disk.qcow2"), b"x").unwrap();
    std::fs::create_dir_all(layers.join("young")).unwrap();
    let blobs = t.dir.join("images").join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join("ab12"), b"blob").unwrap();
    std::fs::write(blobs.join("fresh"), b"blob").unwrap();
    for e in std::fs::read_dir(&layers).unwrap() {
        let p = e.unwrap().path();
        if !p.ends_with("young") {
            run(&["touch", "-d", "1 hour ago", p.to_str().unwrap()]);
        }
    }
    run(&[
        "touch",
        "-d",
        "1 hour ago",
        blobs.join("ab12").to_str().unwrap(),
    ]);
    // Only an admin key prunes.
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let (s, v) = t
        .json_as(&b, "POST", "/v1/images:prune", Some(json!({})), &[])
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (s, v) = t.json("POST", "/v1/images:prune", Some(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["removedLayers"].as_u64(), v["removedBlobs"].as_u64()),
        (Some(2), Some(1)),
        "{v}"
    );
    let after: HashSet<String> = std::fs::read_dir(&layers)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        after.contains("rested-on") && after.contains("young"),
        "{after:?}"
    );
    assert!(!after.contains("orphan"), "{after:?}");
    // The deleted image's layer went; the kept image's stayed and builds on.
    assert_eq!(after.len(), 3, "{after:?} (before: {before:?})");
    assert!(blobs.join("fresh").exists() && !blobs.join("ab12").exists());
    let (_, again) = t.json("POST", "/v1/images:prune", Some(json!({}))).await;
    assert_eq!(again["removedLayers"], 0, "{again}");
    let child = built(
        &t,
        json!({"name": "kept", "dockerfile": "FROM runtime\nRUN echo kept"}),
    )
    .await;
    assert!(
        child["steps"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["state"] == "cached"),
        "{child}"
    );
}

// ---- sessions ----

#[tokio::test(start_paused = true)]
async fn a_session_reaches_only_its_sandbox_from_its_pages_until_it_ends() {
    let t = T::on_paused_time();
    let admin = t.admin.clone();
    let mine = t.running(json!({})).await;
    let other = t.running(json!({})).await;
    let base = format!("/v1/sandboxes/{mine}/sessions");
    let made = t
        .json_as(
            &admin,
            "POST",
            &base,
            Some(json!({"ttlSeconds": 120, "origins": ["https://app.example.com"], "name": "ui"})),
            &[("idempotency-key", "sess-1")],
        )
        .await;
    assert_eq!(made.0, StatusCode::CREATED, "{}", made.1);
    let token = made.1["token"].as_str().unwrap().to_string();
    assert!(token.starts_with("rtsess_"), "{token}");
    assert_eq!(made.1["state"], "active");
    assert_eq!(made.1["sandboxId"], mine.as_str());
    // A replay answers the same session without its token (shown once).
    let again = t
        .json_as(
            &admin,
            "POST",
            &base,
            Some(json!({"ttlSeconds": 120, "origins": ["https://app.example.com"], "name": "ui"})),
            &[("idempotency-key", "sess-1")],
        )
        .await;
    assert_eq!(again.1["id"], made.1["id"]);
    assert!(again.1.get("token").is_none(), "{}", again.1);

    // Its sandbox's record and insides: yes.
    let (s, v) = t
        .json_as(&token, "GET", &format!("/v1/sandboxes/{mine}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = t
        .json_as(
            &token,
            "GET",
            &format!("/v1/sandboxes/{mine}/processes"),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Anything else: 403 in the one shape.
    for (m, p) in [
        ("POST", format!("/v1/sandboxes/{mine}:pause")),
        ("POST", format!("/v1/sandboxes/{mine}:fork")),
        ("DELETE", format!("/v1/sandboxes/{mine}")),
        ("POST", base.clone()),
        ("GET", "/v1/sandboxes".to_string()),
        ("GET", format!("/v1/sandboxes/{other}")),
        ("GET", "/v1/usage".to_string()),
    ] {
        let (s, v) = t.json_as(&token, m, &p, None, &[]).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{m} {p}: {v}");
        assert_error(&v, 403, "forbidden");
    }
    // From its page: let in, with the CORS headers; from another: refused.
    let (s, h, _) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{mine}"),
            Some(&token),
            &[("origin", "https://app.example.com")],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        h.get("access-control-allow-origin").unwrap(),
        "https://app.example.com"
    );
    let (s, h, _) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{mine}"),
            Some(&token),
            &[("origin", "https://evil.example.org")],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert!(h.get("access-control-allow-origin").is_none());
    // A preflight names no token: allowed for a live session's origin only.
    let (s, h, _) = t
        .call(
            "OPTIONS",
            &format!("/v1/sandboxes/{mine}:exec"),
            None,
            &[
                ("origin", "https://app.example.com"),
                ("access-control-request-method", "POST"),
            ],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert!(h
        .get("access-control-allow-headers")
        .unwrap()
        .to_str()
        .unwrap()
        .contains("authorization"));
    let (s, _, _) = t
        .call(
            "OPTIONS",
            "/v1/sandboxes",
            None,
            &[("origin", "https://evil.example.org")],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // The list shows it; a revoke ends it at once.
    let (_, list) = t.json("GET", &base, None).await;
    assert_eq!(list["data"][0]["id"], made.1["id"]);
    let sid = made.1["id"].as_str().unwrap();
    let (s, v) = t
        .json("POST", &format!("{base}/{sid}:revoke"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "revoked");
    let (s, v) = t
        .json_as(&token, "GET", &format!("/v1/sandboxes/{mine}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    assert_error(&v, 401, "unauthorized");

    // Another ends when its time is up.
    let (_, short) = t.json("POST", &base, Some(json!({"ttlSeconds": 60}))).await;
    let short_token = short["token"].as_str().unwrap().to_string();
    let (s, _) = t
        .json_as(
            &short_token,
            "GET",
            &format!("/v1/sandboxes/{mine}"),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    tokio::time::advance(Duration::from_secs(61)).await;
    let (s, v) = t
        .json_as(
            &short_token,
            "GET",
            &format!("/v1/sandboxes/{mine}"),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("expired"),
        "{v}"
    );
    let (_, list) = t.json("GET", &base, None).await;
    let states: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["expired", "revoked"], "{list}");
}

#[tokio::test]
async fn a_session_ends_with_its_key_and_bad_requests_name_each_field() {
    let t = T::new();
    let agent = create_key(&t.dir, Some("agent"), false, false).unwrap();
    let (s, v) = t
        .json_as(
            &agent,
            "POST",
            "/v1/sandboxes",
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let base = format!("/v1/sandboxes/{id}/sessions");
    let (s, v) = t
        .json_as(
            &agent,
            "POST",
            &base,
            Some(json!({"ttlSeconds": 5, "origins": ["https://app.example.com/", 7], "name": "", "extra": 1})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    for f in ["ttlSeconds", "origins[0]", "origins[1]", "name", "extra"] {
        assert!(fields.contains(&f), "{f} not in {fields:?}");
    }
    // Another key's sandbox is not found, for sessions too.
    let stranger = create_key(&t.dir, Some("stranger"), false, false).unwrap();
    let (s, _) = t
        .json_as(&stranger, "POST", &base, Some(json!({})), &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, made) = t.json_as(&agent, "POST", &base, Some(json!({})), &[]).await;
    let token = made["token"].as_str().unwrap().to_string();
    let (s, _) = t
        .json_as(&token, "GET", &format!("/v1/sandboxes/{id}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::OK);
    runtime_server::keys::revoke_key(&t.dir, "agent").unwrap();
    let (s, _) = t
        .json_as(&token, "GET", &format!("/v1/sandboxes/{id}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

// ---- metrics ----

#[tokio::test(start_paused = true)]
async fn metrics_come_from_the_meters_readings() {
    let t = T::on_paused_time();
    let id = t.running(json!({"vcpu": 2, "memoryMiB": 1024})).await;
    let path = format!("/v1/sandboxes/{id}/metrics");
    let (s, v) = t.json("GET", &path, None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["latest"].is_null(), "{v}");
    assert_eq!(v["vcpu"], 2);
    assert_eq!(v["memoryLimitBytes"], 1u64 << 30);
    // One of two vCPUs busy for 25 seconds: 50 %.
    let mut used = Duration::ZERO;
    for _ in 0..25 {
        t.host.cpu.lock().unwrap().insert(id.clone(), used);
        t.state.meter_tick().await.unwrap();
        used += Duration::from_secs(1);
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let (_, v) = t.json("GET", &path, None).await;
    assert_eq!(v["stepSeconds"], 10, "{v}");
    assert_eq!(v["latest"]["cpuPercent"], 50.0, "{v}");
    assert_eq!(v["latest"]["cpuCores"], 1.0, "{v}");
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 90);
    assert!(points.iter().filter(|p| p["cpuPercent"] == 50.0).count() >= 1);
    let (_, day) = t.json("GET", &format!("{path}?range=24h"), None).await;
    assert_eq!(day["stepSeconds"], 480);
    let (s, v) = t.json("GET", &format!("{path}?range=2h"), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "range");
    // Paused: no latest reading; the earlier points stay.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:pause"),
            None,
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    t.state.meter_tick().await.unwrap();
    let (_, v) = t.json("GET", &path, None).await;
    assert!(v["latest"].is_null(), "{v}");
    assert!(v["points"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["cpuPercent"] == 50.0));
}

// ---- file links ----

#[tokio::test(start_paused = true)]
async fn file_links_download_and_upload_without_a_key_until_they_end() {
    let t = T::on_paused_time();
    let id = t.running(json!({})).await;
    let (s, _, _) = t
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files/content?path=/workspace/report.csv"),
            Some(&t.admin.clone()),
            &[],
            Body::from(&b"a,b\n1,2\n"[..]),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let links = format!("/v1/sandboxes/{id}/files:link");
    let (s, v) = t
        .json(
            "POST",
            &links,
            Some(json!({"path": "/workspace/report.csv", "expiresInSeconds": 60})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let url = v["url"].as_str().unwrap();
    assert!(url.contains("/v1/links/rtlnk_"), "{url}");
    let path = &url[url.find("/v1/links/").unwrap()..];
    // No key: the bytes, named after the file; one range.
    let (s, h, b) = t.call("GET", path, None, &[], Body::empty()).await;
    assert_eq!((s, &b[..]), (StatusCode::OK, &b"a,b\n1,2\n"[..]));
    assert!(h
        .get("content-disposition")
        .unwrap()
        .to_str()
        .unwrap()
        .contains("report.csv"));
    let (s, h, b) = t
        .call("GET", path, None, &[("range", "bytes=4-")], Body::empty())
        .await;
    assert_eq!((s, &b[..]), (StatusCode::PARTIAL_CONTENT, &b"1,2\n"[..]));
    assert_eq!(h.get("content-range").unwrap(), "bytes 4-7/8");
    let (s, _, b) = t
        .call("GET", path, None, &[("range", "bytes=50-")], Body::empty())
        .await;
    assert_eq!(s, StatusCode::RANGE_NOT_SATISFIABLE);
    assert_error(
        &serde_json::from_slice(&b).unwrap(),
        416,
        "range_not_satisfiable",
    );
    // A download link does not upload.
    let (s, _, _) = t.call("PUT", path, None, &[], Body::from("x")).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);

    // An upload link writes its path, up to its maxBytes.
    let (s, v) = t
        .json(
            "POST",
            &links,
            Some(json!({"path": "/workspace/in.bin", "method": "PUT", "maxBytes": 8})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let up = v["url"].as_str().unwrap();
    let up = up[up.find("/v1/links/").unwrap()..].to_string();
    let (s, _, b) = t.call("PUT", &up, None, &[], Body::from("12345678")).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let (_, _, b) = t
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files/content?path=/workspace/in.bin"),
            Some(&t.admin.clone()),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(&b[..], b"12345678");
    let (s, _, _) = t.call("PUT", &up, None, &[], Body::from("123456789")).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);

    // Revoked: 410 link_revoked; expired: 410 link_expired; unknown: 404.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/files:revoke-links"),
            None,
        )
        .await;
    assert_eq!((s, v["revoked"].as_u64()), (StatusCode::OK, Some(2)), "{v}");
    let (s, _, b) = t.call("GET", path, None, &[], Body::empty()).await;
    assert_eq!(s, StatusCode::GONE);
    assert_error(&serde_json::from_slice(&b).unwrap(), 410, "link_revoked");
    let (_, v) = t
        .json(
            "POST",
            &links,
            Some(json!({"path": "/workspace/report.csv", "expiresInSeconds": 5})),
        )
        .await;
    let short = v["url"].as_str().unwrap();
    let short = short[short.find("/v1/links/").unwrap()..].to_string();
    tokio::time::advance(Duration::from_secs(6)).await;
    let (s, _, b) = t.call("GET", &short, None, &[], Body::empty()).await;
    assert_eq!(s, StatusCode::GONE);
    assert_error(&serde_json::from_slice(&b).unwrap(), 410, "link_expired");
    let (s, _, b) = t
        .call("GET", "/v1/links/rtlnk_nothing", None, &[], Body::empty())
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&serde_json::from_slice(&b).unwrap(), 404, "link_not_found");

    // Bad input names every wrong field.
    let (s, v) = t
        .json(
            "POST",
            &links,
            Some(json!({
                "path": "relative", "method": "POST", "expiresInSeconds": 999999999,
                "filename": "a/b", "maxBytes": 0
            })),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    for f in ["path", "method", "expiresInSeconds", "filename", "maxBytes"] {
        assert!(fields.contains(&f), "{f} not in {fields:?}");
    }
}

#[tokio::test]
async fn file_watches_start_read_follow_stop_and_refuse_bad_input() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let base = format!("/v1/sandboxes/{id}/files/watches");
    let (s, w) = t
        .json(
            "POST",
            &base,
            Some(json!({"path": "/workspace", "recursive": true})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{w}");
    let wid = w["id"].as_str().unwrap().to_string();
    assert_eq!(
        (w["path"].as_str(), w["cursor"].as_u64()),
        (Some("/workspace"), Some(0))
    );
    assert_eq!(
        (w["batchMs"].as_u64(), w["timeoutMs"].as_u64()),
        (Some(100), Some(3_600_000))
    );
    let (s, v) = t.json("GET", &base, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], wid.as_str(), "{v}");

    // A waiting read answers as soon as a file is written.
    let reader = {
        let (t2, url) = (
            router(t.state.clone()),
            format!("{base}/{wid}/events?cursor=0&waitMs=5000"),
        );
        let admin = t.admin.clone();
        tokio::spawn(async move {
            let req = Request::builder()
                .uri(url)
                .header("authorization", format!("Bearer {admin}"))
                .body(Body::empty())
                .unwrap();
            let resp = t2.oneshot(req).await.unwrap();
            let b = resp.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice::<Value>(&b).unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (s, _, _) = t
        .call(
            "PUT",
            &format!("/v1/sandboxes/{id}/files/content?path=/workspace/a.txt"),
            Some(&t.admin),
            &[("idempotency-key", "wa")],
            Body::from("hi"),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let read = reader.await.unwrap();
    assert_eq!(read["events"][0]["type"], "create", "{read}");
    assert_eq!(read["events"][0]["path"], "/workspace/a.txt", "{read}");
    let next = read["nextCursor"].as_u64().unwrap();
    assert!(next > 0 && read.get("ended").is_none(), "{read}");
    // Nothing new: a read without a wait answers at once.
    let (_, v) = t
        .json("GET", &format!("{base}/{wid}/events?cursor={next}"), None)
        .await;
    assert_eq!(
        (
            v["events"].as_array().map(Vec::len),
            v["nextCursor"].as_u64()
        ),
        (Some(0), Some(next))
    );
    // A cursor from the future.
    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/{wid}/events?cursor={}", next + 1),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "cursor", "{v}");
    let (s, v) = t
        .json(
            "GET",
            &format!("{base}/{wid}/events?cursor=0&waitMs=9000"),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "waitMs", "{v}");

    // Stopped: gone from the list; a follower from 0 sees the event, then the end.
    let (s, v) = t.json("DELETE", &format!("{base}/{wid}"), None).await;
    assert_eq!(
        (s, v["stopped"].as_bool()),
        (StatusCode::OK, Some(true)),
        "{v}"
    );
    let (_, v) = t.json("GET", &base, None).await;
    assert_eq!(v["data"], json!([]), "{v}");
    let (s, _, b) = t
        .call(
            "GET",
            &format!("{base}/{wid}/events?cursor=0&follow=true"),
            Some(&t.admin),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let lines = ndjson(&b);
    assert_eq!(lines[0]["k"], "events", "{lines:?}");
    assert_eq!(lines[0]["events"][0]["path"], "/workspace/a.txt");
    assert_eq!(lines.last().unwrap()["k"], "end", "{lines:?}");
    assert_eq!(lines.last().unwrap()["reason"], "stopped", "{lines:?}");
    let (_, v) = t
        .json("GET", &format!("{base}/{wid}/events?cursor={next}"), None)
        .await;
    assert_eq!(v["ended"], true, "{v}");
    assert_eq!(
        v["notices"][0],
        json!({"k": "end", "reason": "stopped"}),
        "{v}"
    );

    // Bad input, every wrong field named; a missing path; an unknown watch.
    let (s, v) = t
        .json(
            "POST",
            &base,
            Some(json!({"path": "rel", "batchMs": -5, "timeoutMs": "x", "events": ["create", "open"], "webhook": "yes", "colour": 1})),
        )
        .await;
    assert_error(&v, 400, "invalid_request");
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let fields: Vec<&str> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["field"].as_str().unwrap())
        .collect();
    for f in [
        "path",
        "batchMs",
        "timeoutMs",
        "events[1]",
        "webhook",
        "colour",
    ] {
        assert!(fields.contains(&f), "{f} not in {fields:?}");
    }
    let (s, v) = t
        .json("POST", &base, Some(json!({"path": "/workspace/none"})))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "file_not_found");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/workspace/none"),
        "{v}"
    );
    let (s, v) = t.json("GET", &format!("{base}/nope/events"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, 404, "not_found");
    let (s, _) = t.json("DELETE", &format!("{base}/nope"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // At most four at once.
    for _ in 0..4 {
        let (s, v) = t
            .json("POST", &base, Some(json!({"path": "/workspace"})))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (s, v) = t
        .json("POST", &base, Some(json!({"path": "/workspace"})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_error(&v, 409, "quota_exceeded");

    // A pause ends them (`paused`), in the guest too.
    let (s, _) = t.act(&id, "pause", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = t.json("GET", &base, None).await;
    assert_eq!(v["data"], json!([]), "{v}");
    assert!(t.host.watches.lock().unwrap().is_empty());
}

// ---- crashes tell the truth (issue 13) ----

/// Sets a stored row's state, as a server killed in that state left it.
fn crash_in_state(dir: &std::path::Path, table: &str, id: &str, state: &str) {
    let conn = rusqlite::Connection::open(dir.join("runtime.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    let n = conn
        .execute(
            &format!(
                "UPDATE {table} SET state = ?1, record = json_set(record, '$.state', ?1) WHERE id = ?2"
            ),
            rusqlite::params![state, id],
        )
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn a_snapshot_cut_short_by_a_crash_fails_and_its_partial_capture_goes() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let (s, snap) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:snapshot"),
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{snap}");
    let sid = snap["id"].as_str().unwrap().to_string();
    t.state.shutdown().await;
    // Killed mid-capture: the record `capturing`, the directory half made.
    crash_in_state(&t.dir, "snapshots", &sid, "capturing");
    let partial = t.dir.join("snapshots").join(&sid);
    std::fs::write(partial.join("memory.state"), b"half").unwrap();

    let host = Arc::new(FakeHost::default());
    host.recoverable.lock().unwrap().insert(id.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host, |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let (_, v) = t2.json("GET", &format!("/v1/snapshots/{sid}"), None).await;
    assert_eq!(v["state"], "failed", "{v}");
    assert!(!partial.exists(), "its partial capture is left");
    assert_eq!(t2.sandbox(&id).await["state"], "running");
    // A snapshot of it cannot start a sandbox.
    let (s, _) = t2
        .json("POST", "/v1/sandboxes", Some(json!({"snapshot": sid})))
        .await;
    assert!(s.is_client_error(), "{s}");
}

#[tokio::test]
async fn a_pause_cut_short_is_paused_only_with_a_whole_state() {
    let t = T::new();
    let with_state = t.running(json!({})).await;
    let without = t.running(json!({})).await;
    let runs = t.running(json!({})).await;
    t.state.shutdown().await;
    for id in [&with_state, &without, &runs] {
        crash_in_state(&t.dir, "sandboxes", id, "pausing");
    }
    let host = Arc::new(FakeHost::default());
    host.saved.lock().unwrap().insert(with_state.clone());
    host.recoverable.lock().unwrap().insert(runs.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    assert_eq!(t2.sandbox(&with_state).await["state"], "paused");
    let v = t2.sandbox(&without).await;
    assert_eq!(
        (v["state"].as_str(), v["stopReason"].as_str()),
        (Some("stopped"), Some("host_lost")),
        "{v}"
    );
    // Its machine runs on; the pause it was asked for is made again.
    let v = t2.wait_state(&runs, "paused").await;
    assert_eq!(v["state"], "paused", "{v}");
    assert_eq!(*host.paused.lock().unwrap(), vec![runs.clone()]);
}

#[tokio::test]
async fn a_start_cut_short_without_its_machine_is_a_failed_start() {
    let t = T::new();
    let id = t.running(json!({})).await;
    t.state.shutdown().await;
    crash_in_state(&t.dir, "sandboxes", &id, "starting");
    let t2 = T::open(
        t.dir.clone(),
        t.admin.clone(),
        Arc::new(FakeHost::default()),
        |_| {},
    );
    runtime_server::recover(&t2.state).await.unwrap();
    let v = t2.sandbox(&id).await;
    assert_eq!(
        (v["state"].as_str(), v["stopReason"].as_str()),
        (Some("stopped"), Some("start_failed")),
        "{v}"
    );
}

#[tokio::test]
async fn machines_no_live_record_owns_are_ended_on_recovery() {
    let t = T::new();
    let kept = t.running(json!({})).await;
    let deleted = t.running(json!({})).await;
    t.state.shutdown().await;
    // Marked deleted, its machine not ended yet, when the server died.
    let conn = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
    conn.execute(
        "UPDATE sandboxes SET deleted = json_object('id', id) WHERE id = ?1",
        [&deleted],
    )
    .unwrap();
    drop(conn);
    let host = Arc::new(FakeHost::default());
    let unknown = uuid::Uuid::new_v4().to_string();
    for m in [&kept, &deleted, &unknown] {
        host.machines.lock().unwrap().insert(m.clone());
    }
    host.recoverable.lock().unwrap().insert(kept.clone());
    let t2 = T::open(t.dir.clone(), t.admin.clone(), host.clone(), |_| {});
    runtime_server::recover(&t2.state).await.unwrap();
    let mut swept = host.swept.lock().unwrap().clone();
    swept.sort();
    let mut want = vec![deleted.clone(), unknown.clone()];
    want.sort();
    assert_eq!(swept, want);
    assert_eq!(t2.sandbox(&kept).await["state"], "running");
}

#[tokio::test]
async fn an_idempotent_create_resent_after_a_crash_answers_its_sandbox() {
    let t = T::new();
    *t.host.start_delay_ms.lock().unwrap() = 1500;
    let body = json!({"labels": {"crash": "idem"}});
    let first = {
        let (dir, admin, host) = (t.dir.clone(), t.admin.clone(), t.host.clone());
        let body = body.clone();
        tokio::spawn(async move {
            let t1 = T::open(dir, admin.clone(), host, |_| {});
            t1.json_as(
                &admin,
                "POST",
                "/v1/sandboxes",
                Some(body),
                &[("idempotency-key", "k1"), ("prefer", "wait=30")],
            )
            .await
        })
    };
    // While the first waits for its sandbox, its record is stored with it.
    let conn = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    let mut pending = None;
    for _ in 0..100 {
        pending = conn
            .query_row(
                "SELECT kind, body FROM idempotency WHERE idem_key = 'k1'",
                [],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )
            .ok();
        if pending.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (kind, stored) = pending.expect("no idempotency record beside the new sandbox");
    assert_eq!(kind, "sandbox");
    let made: Value = serde_json::from_str(&stored).unwrap();
    let id = made["sandboxId"].as_str().unwrap().to_string();

    // A restarted server knows nothing of the request in flight: the resend
    // answers the sandbox made, and makes no other.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(body.clone()),
            &[("idempotency-key", "k1")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["id"], id.as_str(), "{v}");
    assert_eq!(v["replayed"], true, "{v}");
    let (s1, v1) = first.await.unwrap();
    assert_eq!(s1, StatusCode::CREATED, "{v1}");
    assert_eq!(v1["id"], id.as_str());
    let (_, list) = t
        .json(
            "GET",
            "/v1/sandboxes?label=crash%3Aidem&includeStopped=true",
            None,
        )
        .await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");
    // Once answered, the stored answer replaces the pending record.
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            "/v1/sandboxes",
            Some(body),
            &[("idempotency-key", "k1")],
        )
        .await;
    assert_eq!(
        (s, v["id"].as_str()),
        (StatusCode::CREATED, Some(id.as_str()))
    );
    assert_eq!(v["state"], "running", "{v}");
}

// ---- build contexts ----

fn sha_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A gzipped tar of `(path, data)` files.
fn tgz(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (p, d) in files {
        let mut h = tar::Header::new_ustar();
        h.set_size(d.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, p, *d).unwrap();
    }
    let raw = b.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &raw).unwrap();
    gz.finish().unwrap()
}

impl T {
    async fn put_chunk(&self, key: &str, sha: &str, data: Vec<u8>) -> (StatusCode, Value) {
        let (s, _, b) = self
            .call(
                "PUT",
                &format!("/v1/images/context/{sha}"),
                Some(key),
                &[("content-type", "application/octet-stream")],
                Body::from(data),
            )
            .await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    async fn missing(&self, key: &str, digests: &[&str]) -> Value {
        let (s, v) = self
            .json_as(
                key,
                "POST",
                "/v1/images/context/missing",
                Some(json!({ "digests": digests })),
                &[],
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["missing"].clone()
    }
}

fn issue(v: &Value) -> String {
    v["error"]["details"]["issues"][0]["message"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[tokio::test]
async fn context_chunks_are_kept_per_key_and_checked() {
    let t = T::new();
    let a = create_key(&t.dir, Some("a"), false, false).unwrap();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let data = b"chunk one".to_vec();
    let sha = sha_hex(&data);
    assert_eq!(t.missing(&a, &[&sha, &sha]).await, json!([sha]));
    let (s, v) = t.put_chunk(&a, &sha, data.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v, json!({"sha256": sha, "size": 9}));
    assert_eq!(t.missing(&a, &[&sha]).await, json!([]));
    // Another key's upload does not count for b, and b learns nothing of it.
    assert_eq!(t.missing(&b, &[&sha]).await, json!([sha]));
    // A body that is not its name's digest.
    let wrong = sha_hex(b"other");
    let (s, v) = t.put_chunk(&b, &wrong, data.clone()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_error(&v, 400, "invalid_request");
    assert_eq!(
        issue(&v),
        format!("the body's SHA-256 is {sha}, not {wrong}")
    );
    assert_eq!(t.missing(&b, &[&wrong]).await, json!([wrong]));
    // Names that are no digest; a chunk over 1 MiB; an empty one.
    let (s, v) = t.put_chunk(&a, "ABC", data.clone()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let big = vec![7u8; (1 << 20) + 1];
    let (s, _) = t.put_chunk(&a, &sha_hex(&big), big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    let (s, _) = t.put_chunk(&a, &sha_hex(b""), Vec::new()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v) = t
        .json_as(
            &a,
            "POST",
            "/v1/images/context/missing",
            Some(json!({"digests": ["x"]})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(issue(&v), "x is not a SHA-256 (64 lowercase hex digits)");
    let (s, v) = t
        .json_as(
            &a,
            "POST",
            "/v1/images/context/missing",
            Some(json!({"digests": 3})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, _, _) = t
        .call(
            "GET",
            "/v1/images/context/missing",
            Some(&a),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn a_context_build_needs_its_chunks_whole_and_as_listed() {
    let t = T::new();
    let a = create_key(&t.dir, Some("a"), false, false).unwrap();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let archive = tgz(&[("app/main.py", b"print(1)\n"), ("README", b"hi\n")]);
    let sha = sha_hex(&archive);
    let files = json!([
        {"path": "app/main.py", "sha256": sha_hex(b"print(1)\n"), "size": 9, "mode": 420},
        {"path": "README", "sha256": sha_hex(b"hi\n"), "size": 3, "mode": 420},
    ]);
    let body = |files: &Value| {
        json!({"dockerfile": "FROM runtime\nCOPY app/ /srv/\n", "context": {
            "archive": {"sha256": sha, "size": archive.len(), "chunks": [sha]}, "files": files}})
    };
    // Not uploaded yet: the 400 lists the chunk.
    let (s, v) = t
        .json_as(&a, "POST", "/v1/images", Some(body(&files)), &[])
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        issue(&v),
        format!("chunks missing on this server (upload them first): {sha}")
    );
    assert_eq!(
        t.put_chunk(&a, &sha, archive.clone()).await.0,
        StatusCode::OK
    );
    // b may not build on a's chunk.
    let (s, v) = t
        .json_as(&b, "POST", "/v1/images", Some(body(&files)), &[])
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(issue(&v).contains(&sha), "{v}");
    // A list that does not match the archive.
    let mut other = files.clone();
    other[1]["sha256"] = json!(sha_hex(b"else"));
    let (s, v) = t
        .json_as(&a, "POST", "/v1/images", Some(body(&other)), &[])
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        issue(&v),
        "files lists README, which the archive does not have (or has with other contents)"
    );
    let (s, v) = t
        .json_as(
            &a,
            "POST",
            "/v1/images",
            Some(body(&json!([files[0].clone()]))),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        issue(&v),
        "the archive has README, which files does not list"
    );
    // A size that is not the archive's.
    let mut wrong = body(&files);
    wrong["context"]["archive"]["size"] = json!(archive.len() + 1);
    let (s, v) = t.json_as(&a, "POST", "/v1/images", Some(wrong), &[]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        issue(&v).contains("not archive.size and archive.sha256"),
        "{v}"
    );
    // Inline files and a context together; a context with a recipe.
    let mut both = body(&files);
    both["files"] = json!([{"path": "a", "content": "x"}]);
    let (s, v) = t.json_as(&a, "POST", "/v1/images", Some(both), &[]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "files");
    // Whole and listed: queued, its COPY step names what it copies.
    let (s, v) = t
        .json_as(&a, "POST", "/v1/images", Some(body(&files)), &[])
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let step = v["steps"][0]["instruction"].as_str().unwrap_or("");
    assert!(
        step.starts_with("COPY app/ /srv/ (1 files, 9 bytes, sha256 "),
        "{v}"
    );
}

#[tokio::test]
async fn archive_uploads_stage_ordered_chunks_on_disk_within_bounds() {
    use std::os::unix::fs::PermissionsExt;
    let t = T::with(|c| c.quotas.set("upload.mib=2").unwrap());
    let id = t.running(json!({})).await;
    let base = format!("/v1/sandboxes/{id}/files/archive/uploads");
    let (s, v) = t
        .json(
            "POST",
            &base,
            Some(json!({"path": "/workspace/a", "gzip": false})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["chunkBytes"], 1 << 20);
    assert_eq!(v["maxBytes"], 1u64 << 30);
    let u = v["uploadId"].as_str().unwrap().to_string();
    let staged = t.dir.join("uploads").join(&u);
    let put = |off: usize, data: Vec<u8>, key: String| {
        let path = format!("{base}/{u}?offset={off}");
        let t = &t;
        async move {
            let (s, _, body) = t
                .call(
                    "PUT",
                    &path,
                    Some(&t.admin),
                    &[("idempotency-key", &key)],
                    Body::from(data),
                )
                .await;
            (s, serde_json::from_slice::<Value>(&body).unwrap())
        }
    };
    let mib = 1 << 20;
    let first: Vec<u8> = (0..mib).map(|i| (i % 253) as u8).collect();
    let (s, v) = put(0, first.clone(), "a0".into()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["received"], mib);
    // On the host's disk, the server's alone, as it came.
    assert_eq!(std::fs::read(&staged).unwrap(), first);
    assert_eq!(
        std::fs::metadata(&staged).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // A gap is refused, naming `offset` and the offset expected.
    let (s, v) = put(mib + 1, vec![1], "a1".into()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["details"]["issues"][0]["field"], "offset");
    assert!(
        v["error"]["details"]["issues"][0]["message"]
            .as_str()
            .unwrap()
            .contains(&mib.to_string()),
        "{v}"
    );
    // A resend of the same bytes is taken; different bytes are not.
    let (s, v) = put(0, first[..10].to_vec(), "a2".into()).await;
    assert_eq!((s, &v["received"]), (StatusCode::OK, &json!(mib)), "{v}");
    let (s, v) = put(0, vec![9; 10], "a3".into()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(std::fs::read(&staged).unwrap(), first);
    // The key's upload space counts the bytes as they come.
    let (s, _) = put(mib, vec![2; mib], "a4".into()).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = put(2 * mib, vec![3; 10], "a5".into()).await;
    assert_error(&v, 409, "quota_exceeded");
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["details"]["limit"], "upload.mib", "{v}");
    assert_eq!(std::fs::metadata(&staged).unwrap().len(), 2 * mib as u64);
    // Abort removes the bytes; the id is then unknown.
    let (s, _) = t
        .json("POST", &format!("{base}/{u}:abort"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(!staged.exists());
    let (_, v) = put(2 * mib, vec![3; 10], "a6".into()).await;
    assert_error(&v, 404, "upload_not_found");

    // At most 8 open per sandbox; deleting the sandbox removes them.
    let mut ids = Vec::new();
    for _ in 0..8 {
        let (s, v) = t
            .json("POST", &base, Some(json!({"path": "/workspace/b"})))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        ids.push(v["uploadId"].as_str().unwrap().to_string());
    }
    let (_, v) = t
        .json("POST", &base, Some(json!({"path": "/workspace/b"})))
        .await;
    assert_error(&v, 409, "quota_exceeded");
    assert!(ids.iter().all(|u| t.dir.join("uploads").join(u).exists()));
    let (s, _) = t.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s.is_success());
    assert!(ids.iter().all(|u| !t.dir.join("uploads").join(u).exists()));
}

#[tokio::test]
async fn the_copies_of_a_sandbox_carry_its_running_processes_under_their_ids() {
    let t = T::new();
    let id = t.running(json!({})).await;
    let (s, p) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes"),
            Some(json!({"argv": ["cat"], "stdinMode": "pipe"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    let pid = p["id"].as_str().unwrap().to_string();
    let w = json!({"base64": base64::engine::general_purpose::STANDARD.encode("hi"), "offset": 0});
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{id}/processes/{pid}:write"),
            Some(w),
        )
        .await;
    assert_eq!((s, v["offset"].as_u64()), (StatusCode::OK, Some(2)), "{v}");
    let (s, v) = t
        .json_as(
            &t.admin.clone(),
            "POST",
            &format!("/v1/sandboxes/{id}:fork"),
            Some(json!({})),
            &[("prefer", "wait=10")],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let cid = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
    let (s, c) = t
        .json("GET", &format!("/v1/sandboxes/{cid}/processes/{pid}"), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{c}");
    assert_eq!(
        (
            c["id"].as_str(),
            c["state"].as_str(),
            c["stdinOffset"].as_u64()
        ),
        (Some(pid.as_str()), Some("running"), Some(2)),
        "{c}"
    );
    let (_, l) = t
        .json("GET", &format!("/v1/sandboxes/{cid}/processes"), None)
        .await;
    assert_eq!(l["data"].as_array().map(Vec::len), Some(1), "{l}");
    // The source keeps its own record of it.
    let (s, src) = t
        .json("GET", &format!("/v1/sandboxes/{id}/processes/{pid}"), None)
        .await;
    assert_eq!(
        (s, src["state"].as_str()),
        (StatusCode::OK, Some("running"))
    );
    // A memory snapshot carries it into a create from it; a disk one does not.
    for (mode, carried) in [("memory", true), ("disk", false)] {
        let (s, snap) = t
            .json_as(
                &t.admin.clone(),
                "POST",
                &format!("/v1/sandboxes/{id}:snapshot"),
                Some(json!({"mode": mode})),
                &[("prefer", "wait=10")],
            )
            .await;
        assert_eq!(snap["state"], "ready", "{s} {snap}");
        let rid = t.running(json!({"snapshot": snap["id"]})).await;
        let (s, _) = t
            .json("GET", &format!("/v1/sandboxes/{rid}/processes/{pid}"), None)
            .await;
        let want = if carried {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        };
        assert_eq!(s, want, "{mode}");
    }
}

/// The idempotency record of `idem_key` as it is stored now (kind, body),
/// waited for up to a second.
async fn stored_answer(t: &T, idem_key: &str) -> Option<(String, Value)> {
    let conn = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    for _ in 0..100 {
        let row = conn
            .query_row(
                "SELECT kind, body FROM idempotency WHERE idem_key = ?1",
                [idem_key],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )
            .ok();
        if let Some((kind, body)) = row {
            return Some((kind, serde_json::from_str(&body).unwrap()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test]
async fn an_idempotent_fork_or_snapshot_resent_after_a_crash_answers_what_it_made() {
    let t = T::new();
    let id = t.running(json!({"labels": {"crash": "fork"}})).await;
    *t.host.capture_delay_ms.lock().unwrap() = 1500;
    let mut servers = Vec::new();
    for (verb, body, kind) in [
        ("fork", json!({"count": 2}), "fork"),
        ("snapshot", json!({"mode": "memory"}), "snapshot"),
    ] {
        let idem = format!("k-{verb}");
        let first = {
            let (dir, admin, host) = (t.dir.clone(), t.admin.clone(), t.host.clone());
            let (path, body, idem) = (
                format!("/v1/sandboxes/{id}:{verb}"),
                body.clone(),
                idem.clone(),
            );
            tokio::spawn(async move {
                let t1 = T::open(dir, admin.clone(), host, |_| {});
                let answer = t1
                    .json_as(
                        &admin,
                        "POST",
                        &path,
                        Some(body),
                        &[("idempotency-key", idem.as_str()), ("prefer", "wait=30")],
                    )
                    .await;
                // Kept: dropping it would remove the data directory.
                (answer, t1)
            })
        };
        // While the first waits for its capture, its record is stored with
        // what it made.
        let (stored_kind, pending) = stored_answer(&t, &idem)
            .await
            .expect("no idempotency record beside what the request made");
        assert_eq!(stored_kind, kind, "{pending}");
        // A restarted server knows nothing of the request in flight: the
        // resend answers what was made, and makes nothing more.
        let (s, v) = t
            .json_as(
                &t.admin.clone(),
                "POST",
                &format!("/v1/sandboxes/{id}:{verb}"),
                Some(body.clone()),
                &[("idempotency-key", idem.as_str())],
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["replayed"], true, "{v}");
        let ((s1, v1), t1) = first.await.unwrap();
        assert_eq!(s1, StatusCode::CREATED, "{v1}");
        servers.push(t1);
        if verb == "fork" {
            let ids = |v: &Value| -> Vec<String> {
                v["sandboxes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c["id"].as_str().unwrap().to_string())
                    .collect()
            };
            assert_eq!(ids(&v).len(), 2, "{v}");
            assert_eq!(ids(&v), ids(&v1));
            assert_eq!(json!(ids(&v)), pending["sandboxIds"]);
            let (_, list) = t
                .json("GET", "/v1/sandboxes?label=crash%3Afork", None)
                .await;
            assert_eq!(list["data"].as_array().unwrap().len(), 3, "{list}");
        } else {
            assert_eq!(v["id"], pending["snapshotId"], "{v}");
            assert_eq!(v["id"], v1["id"]);
            let (_, list) = t
                .json("GET", &format!("/v1/snapshots?sandboxId={id}"), None)
                .await;
            assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");
        }
        // Once answered, the answer replaces the pending record.
        let (stored_kind, _) = stored_answer(&t, &idem).await.unwrap();
        assert_eq!(stored_kind, "json");
    }
}

// ---- Account usage: outbound, request counts, the settled export ----

/// The sorted `field`s of a 400's issues.
fn sorted_issue_fields(v: &Value) -> Vec<String> {
    let mut f: Vec<String> = v["error"]["details"]["issues"]
        .as_array()
        .unwrap_or_else(|| panic!("no issues: {v}"))
        .iter()
        .map(|i| i["field"].as_str().unwrap().to_string())
        .collect();
    f.sort();
    f
}

impl T {
    /// A new key that is neither account-wide nor read-only, and its id.
    async fn own_key(&self, name: &str) -> (String, String) {
        let key = create_key(&self.dir, Some(name), false, false).unwrap();
        let (s, me) = self.json_as(&key, "GET", "/v1/me", None, &[]).await;
        assert_eq!(s, StatusCode::OK, "{me}");
        let id = me["credentialId"].as_str().unwrap().to_string();
        (key, id)
    }

    async fn running_as(&self, key: &str, body: Value) -> String {
        let (s, v) = self
            .json_as(
                key,
                "POST",
                "/v1/sandboxes",
                Some(body),
                &[("prefer", "wait=10")],
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    fn sent(&self, sandbox: &str, bytes: u64) {
        *self
            .host
            .outbound
            .lock()
            .unwrap()
            .entry(sandbox.to_string())
            .or_default() += bytes;
    }
}

#[tokio::test]
async fn usage_answers_outbound_per_key_with_its_allowance_and_what_it_cost() {
    // 1 µ$ a byte past 1,000 bytes a month.
    let t = T::with(|c| {
        c.prices.outbound_gib = 1 << 30;
        c.prices.outbound_allowance_bytes = 1000;
    });
    let (a, a_id) = t.own_key("a").await;
    let (b, b_id) = t.own_key("b").await;
    let sa = t.running_as(&a, json!({})).await;
    let sb = t.running_as(&b, json!({})).await;
    t.sent(&sa, 1500);
    t.sent(&sb, 300);
    // Bytes of a machine no sandbox has are not anyone's.
    t.sent("warm-nobody", 9999);

    let (s, u) = t.json_as(&a, "GET", "/v1/usage", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{u}");
    let o = &u["outbound"];
    assert_eq!(o["bytes"], "1500", "{u}");
    assert_eq!(o["allowanceBytes"], "1000");
    assert_eq!(o["coveredBytes"], "1000");
    assert_eq!(o["chargedBytes"], "500");
    assert_eq!(o["chargedMicros"], "500");
    assert_eq!(o["keys"].as_array().unwrap().len(), 1, "{u}");
    assert_eq!(o["keys"][0]["keyId"], a_id.as_str());
    assert_eq!(o["keys"][0]["name"], "a");
    let now = time::OffsetDateTime::now_utc();
    assert_eq!(
        o["month"],
        format!("{:04}-{:02}", now.year(), u8::from(now.month()))
    );
    assert!(o["since"].as_str().unwrap().ends_with("-01T00:00:00.000Z"));
    for field in ["credited", "expired", "takenBack"] {
        assert_eq!(u[field], "0", "{field}: {u}");
    }
    // No daily limit: nothing bounds what is available, and no trial.
    assert_eq!(u["available"], Value::Null);
    assert_eq!(u["trial"], Value::Null);
    assert_eq!(
        u["rates"]["egress"]["outbound"]["microsPerGib"],
        (1u64 << 30).to_string()
    );

    // More bytes are added once: they grow, and taking again adds nothing.
    t.sent(&sa, 100);
    let (_, u) = t.json_as(&a, "GET", "/v1/usage", None, &[]).await;
    assert_eq!(u["outbound"]["bytes"], "1600");
    let (_, u) = t.json_as(&a, "GET", "/v1/usage", None, &[]).await;
    assert_eq!(u["outbound"]["bytes"], "1600");
    assert_eq!(u["outbound"]["chargedMicros"], "600");

    // B sees its own only, under its own allowance.
    let (_, u) = t.json_as(&b, "GET", "/v1/usage", None, &[]).await;
    assert_eq!(u["outbound"]["bytes"], "300", "{u}");
    assert_eq!(u["outbound"]["chargedMicros"], "0");
    assert_eq!(u["outbound"]["keys"][0]["keyId"], b_id.as_str());
    // The account-wide admin sees both keys.
    let (_, u) = t.json("GET", "/v1/usage", None).await;
    assert_eq!(u["outbound"]["bytes"], "1900", "{u}");
    assert_eq!(u["outbound"]["coveredBytes"], "1300");
    assert_eq!(u["outbound"]["chargedMicros"], "600");
    assert_eq!(u["outbound"]["keys"].as_array().unwrap().len(), 2);

    // With a daily limit, available is what it leaves after spent and held.
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/keys/{a_id}:limit"),
            Some(json!({"dailyLimitMicros": 5_000_000})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, u) = t.json_as(&a, "GET", "/v1/usage", None, &[]).await;
    let (_, l) = t.json_as(&a, "GET", "/v1/limits", None, &[]).await;
    let available: i64 = u["available"].as_str().unwrap().parse().unwrap();
    // The running sandbox holds the rest of its lease.
    assert!((1..5_000_000).contains(&available), "{u}");
    assert_eq!(u["available"], l["daily"]["remainingMicros"], "{l}");
}

#[tokio::test]
async fn usage_requests_counts_answers_by_class_and_operation_per_key() {
    let t = T::new();
    let (a, _) = t.own_key("a").await;
    let (b, _) = t.own_key("b").await;
    for _ in 0..3 {
        let (s, _) = t.json_as(&a, "GET", "/v1/sandboxes", None, &[]).await;
        assert_eq!(s, StatusCode::OK);
    }
    let (s, _) = t
        .json_as(&a, "GET", "/v1/sandboxes/sbx_none", None, &[])
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // A call without a valid key is nobody's.
    let (s, _) = t
        .json_as("rtcloud_nope", "GET", "/v1/sandboxes", None, &[])
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    let (s, r) = t
        .json_as(&a, "GET", "/v1/usage/requests?range=24h", None, &[])
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["range"], "24h");
    // The own_key lookup of /v1/me counts too.
    assert_eq!(r["calls"], "5", "{r}");
    assert_eq!(r["clientErrors"], "1");
    assert_eq!(r["serverErrors"], "0");
    assert_eq!(r["errorPercent"], 20.0);
    let op = |name: &str| {
        r["operations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["operation"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name}: {r}"))
    };
    assert_eq!(op("sandboxes.list")["calls"], "3");
    assert_eq!(op("sandboxes.list")["errorPercent"], 0.0);
    assert_eq!(op("sandboxes.get")["calls"], "1");
    assert_eq!(op("sandboxes.get")["errorPercent"], 100.0);
    assert_eq!(op("me.get")["calls"], "1");
    let hours = r["hours"].as_array().unwrap();
    assert!(!hours.is_empty() && hours.len() <= 2, "{r}");
    let since = time::OffsetDateTime::parse(
        r["since"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let until = time::OffsetDateTime::parse(
        r["until"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let span = until - since;
    assert!(span > time::Duration::hours(23) && span <= time::Duration::hours(24));

    // The earlier call to usage/requests is counted by the next.
    let (_, r) = t
        .json_as(&a, "GET", "/v1/usage/requests?range=90d", None, &[])
        .await;
    assert_eq!(r["calls"], "6", "{r}");

    // B sees only its own: its /v1/me.
    let (_, r) = t.json_as(&b, "GET", "/v1/usage/requests", None, &[]).await;
    assert_eq!(r["calls"], "1", "{r}");
    assert_eq!(r["range"], "24h");
    // The admin sees every key's.
    let (_, r) = t.json("GET", "/v1/usage/requests?range=7d", None).await;
    assert_eq!(r["calls"], "9", "{r}");

    // A fresh server has none: errorPercent is null.
    let fresh = T::new();
    let (s, r) = fresh.json("GET", "/v1/usage/requests", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (&r["calls"], &r["errorPercent"], &r["operations"]),
        (&json!("0"), &Value::Null, &json!([])),
        "{r}"
    );

    // A bad range, and a field it does not take, are named.
    let (s, v) = t
        .json_as(&a, "GET", "/v1/usage/requests?range=2d&bogus=1", None, &[])
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, 400, "invalid_request");
    assert_eq!(sorted_issue_fields(&v), ["bogus", "range"]);
}

fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// Every page of an export, following `nextCursor`.
async fn export_pages(t: &T, key: &str, since: &str, until: &str, limit: usize) -> Vec<Value> {
    let mut pages = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/v1/usage/export?since={since}&until={until}&limit={limit}");
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let (s, v) = t.json_as(key, "GET", &path, None, &[]).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        cursor = v["nextCursor"].as_str().map(str::to_string);
        pages.push(v);
        if cursor.is_none() {
            return pages;
        }
        assert!(pages.len() < 100, "the cursor never ends");
    }
}

#[tokio::test(start_paused = true)]
async fn usage_export_pages_settled_charges_as_csv_and_keys_see_their_own() {
    let start = time::OffsetDateTime::now_utc().unix_timestamp() * 1000;
    let t = T::with(|c| c.clock = Clock::following_tokio(start));
    let (a, a_id) = t.own_key("a").await;
    let (b, _) = t.own_key("b").await;
    let sa = t.running_as(&a, json!({"name": "alpha,one"})).await;
    let sb = t.running_as(&b, json!({})).await;
    // Three minutes of charges, a few ticks each.
    for _ in 0..9 {
        t.state.meter_tick().await.unwrap();
        tokio::time::advance(Duration::from_secs(20)).await;
    }
    // Past the last minute and the settling margin.
    tokio::time::advance(Duration::from_secs(120)).await;
    let (s, _) = t
        .json_as(&a, "DELETE", &format!("/v1/sandboxes/{sa}"), None, &[])
        .await;
    assert_eq!(s, StatusCode::OK);
    // The server's now, to the second.
    let (_, r) = t.json("GET", "/v1/usage/requests", None).await;
    let server_now = time::OffsetDateTime::parse(
        r["until"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let now = server_now.replace_millisecond(0).unwrap();
    let since = rfc3339(now - time::Duration::hours(1));
    let until = rfc3339(now + time::Duration::hours(1));

    // The admin's export, two rows a page, is the one-page export cut up.
    let whole = export_pages(&t, &t.admin.clone(), &since, &until, 1000).await;
    assert_eq!(whole.len(), 1);
    let rows = whole[0]["data"].as_array().unwrap().clone();
    assert!(rows.len() >= 6, "{}", whole[0]);
    let paged = export_pages(&t, &t.admin.clone(), &since, &until, 2).await;
    assert_eq!(paged.len(), rows.len().div_ceil(2));
    let csv: String = paged.iter().map(|p| p["csv"].as_str().unwrap()).collect();
    assert_eq!(csv, whole[0]["csv"].as_str().unwrap());
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), rows.len() + 1);
    assert!(
        lines[0].starts_with("intervalId,resourceId,keyId,name,"),
        "{csv}"
    );
    assert_eq!(
        csv.matches("intervalId").count(),
        1,
        "the header is on the first page only"
    );
    // A name with a comma is quoted.
    assert!(csv.contains(",\"alpha,one\","), "{csv}");
    // Final through the settling margin before now (until is later).
    let margin = rfc3339(server_now - time::Duration::seconds(10));
    for p in &paged {
        assert_eq!(p["finalThrough"], t_iso_ms(&margin, &server_now), "{p}");
        assert_eq!(p["since"], t_iso(&since));
        assert_eq!(p["until"], t_iso(&until));
    }

    // Each sandbox's rows add up to what it was charged; the deleted one's
    // rows are final, the running one's not.
    let (_, admin_usage) = t.json("GET", "/v1/usage", None).await;
    for (id, final_) in [(&sa, true), (&sb, false)] {
        let mine: Vec<&Value> = rows.iter().filter(|r| r["resourceId"] == **id).collect();
        assert!(mine.len() >= 3, "{id}: {rows:?}");
        let sum: i64 = mine
            .iter()
            .map(|r| r["chargedMicros"].as_str().unwrap().parse::<i64>().unwrap())
            .sum();
        let charged = admin_usage["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["sandboxId"] == **id)
            .unwrap()["chargedMicros"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap();
        assert_eq!(sum, charged, "{id}");
        let billed: i64 = mine
            .iter()
            .map(|r| {
                r["billedMilliseconds"]
                    .as_str()
                    .unwrap()
                    .parse::<i64>()
                    .unwrap()
            })
            .sum();
        assert_eq!(billed, 9000, "{id}");
        assert!(mine.iter().all(|r| r["final"] == final_), "{id}: {mine:?}");
        assert!(mine.iter().all(|r| r["kind"] == "sandbox"));
    }

    // A and B each see their own sandbox's rows only.
    let pages = export_pages(&t, &a, &since, &until, 1000).await;
    let mine = pages[0]["data"].as_array().unwrap();
    assert!(!mine.is_empty());
    assert!(mine
        .iter()
        .all(|r| r["resourceId"] == sa.as_str() && r["keyId"] == a_id.as_str()));
    let pages = export_pages(&t, &b, &since, &until, 1000).await;
    assert!(pages[0]["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["resourceId"] == sb.as_str()));

    // A range that ends before the charges began has none, but a header.
    let early = rfc3339(now - time::Duration::hours(2));
    let pages = export_pages(&t, &a, &early, &since, 1000).await;
    assert_eq!(pages[0]["data"], json!([]));
    assert_eq!(pages[0]["csv"].as_str().unwrap().lines().count(), 1);
    assert_eq!(pages[0]["finalThrough"], t_iso(&since));

    // Every wrong field is named at once.
    let (s, v) = t
        .json_as(
            &a,
            "GET",
            "/v1/usage/export?since=yesterday&until=2026-01-01T00:00:00%2B01:00&limit=0&cursor=zzz&bogus=1",
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, 400, "invalid_request");
    assert_eq!(
        sorted_issue_fields(&v),
        ["bogus", "cursor", "limit", "since", "until"]
    );
    let (s, v) = t.json_as(&a, "GET", "/v1/usage/export", None, &[]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(sorted_issue_fields(&v), ["since", "until"]);
    let (s, v) = t
        .json_as(
            &a,
            "GET",
            &format!("/v1/usage/export?since={until}&until={since}&limit=10001"),
            None,
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(sorted_issue_fields(&v), ["limit", "until"]);
}

/// `s` (RFC 3339, whole seconds, `Z`) as the server writes times.
fn t_iso(s: &str) -> String {
    format!("{}.000Z", s.trim_end_matches('Z'))
}

/// `s` (RFC 3339 to the second, maybe with a fraction) with the
/// milliseconds of `t`, as the server writes times.
fn t_iso_ms(s: &str, t: &time::OffsetDateTime) -> String {
    let whole = &s[..19];
    format!("{whole}.{:03}Z", t.millisecond())
}

#[tokio::test]
async fn shared_volumes_attach_to_running_sandboxes_and_detach() {
    let t = T::new();
    let (s, vol) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 32, "name": "team", "shared": true})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{vol}");
    assert_eq!(vol["shared"], true, "{vol}");
    let vid = vol["id"].as_str().unwrap().to_string();
    assert!(t.dir.join("volumes").join(format!("{vid}.d")).is_dir());
    let (_, plain) = t
        .json("POST", "/v1/volumes", Some(json!({"sizeMiB": 32})))
        .await;
    let pid = plain["id"].as_str().unwrap().to_string();
    let a = t.running(json!({})).await;
    let b = t.running(json!({})).await;
    let attach = |v: &str| format!("/v1/volumes/{v}:attach");

    // Every wrong field is named at once.
    let (s, v) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"path": "/a/../b", "x": 1})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let mut fields = issue_fields(&v);
    fields.sort();
    assert_eq!(fields, ["path", "sandboxId", "x"], "{v}");
    // Ordinary volumes attach at create only; unknown ids are 404.
    let (s, v) = t
        .json(
            "POST",
            &attach(&pid),
            Some(json!({"sandboxId": a, "path": "/mnt/x"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_not_shared");
    let (s, v) = t
        .json(
            "POST",
            &attach("nope"),
            Some(json!({"sandboxId": a, "path": "/mnt/x"})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "volume_not_found");
    let (s, v) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"sandboxId": "sbx-nope", "path": "/mnt/x"})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    // Two sandboxes attach it; the volume lists both.
    let (s, x) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"sandboxId": a, "path": "/mnt/team"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{x}");
    assert_eq!(
        (x["kind"].as_str(), x["state"].as_str(), x["mode"].as_str()),
        (Some("volume_attachment"), Some("attached"), Some("rw")),
        "{x}"
    );
    assert!(x["id"].as_str().unwrap().starts_with("va-"));
    assert!(x["detachedAt"].is_null());
    let (s, y) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"sandboxId": b, "path": "/mnt/team"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{y}");
    let xid = x["id"].as_str().unwrap().to_string();
    let yid = y["id"].as_str().unwrap().to_string();
    {
        let shared = t.host.shared.lock().unwrap();
        assert_eq!(shared.len(), 2);
        assert_eq!(shared[0].0, a);
        assert_eq!(shared[0].1.id, xid);
        assert_eq!(shared[0].1.path, "/mnt/team");
        assert_eq!(shared[0].1.size_bytes, 32 << 20);
        assert!(shared[0].1.dir.ends_with(format!("volumes/{vid}.d")));
    }
    let (_, v) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    let ids: Vec<&str> = v["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [xid.as_str(), yid.as_str()], "{v}");
    // Once per path; nested paths refused; no fork, no delete meanwhile.
    let (s, v) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"sandboxId": a, "path": "/mnt/team"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, v) = t
        .json(
            "POST",
            &attach(&vid),
            Some(json!({"sandboxId": a, "path": "/mnt/team/in"})),
        )
        .await;
    assert_eq!(
        (s, issue_fields(&v)),
        (StatusCode::BAD_REQUEST, vec!["path".to_string()]),
        "{v}"
    );
    let (s, v) = t
        .json("POST", &format!("/v1/sandboxes/{a}:fork"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_attached");
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_in_use");
    // A shared volume is not named in a create.
    let (s, v) = t
        .json(
            "POST",
            "/v1/sandboxes",
            Some(json!({"volumes": [{"volumeId": vid, "path": "/data"}]})),
        )
        .await;
    assert_eq!(
        (s, issue_fields(&v)),
        (
            StatusCode::BAD_REQUEST,
            vec!["volumes[0].volumeId".to_string()]
        ),
        "{v}"
    );

    // Get, detach, detach again.
    let one = format!("/v1/volumes/{vid}/attachments/{xid}");
    let (s, v) = t.json("GET", &one, None).await;
    assert_eq!(
        (s, v["sandboxId"].as_str()),
        (StatusCode::OK, Some(a.as_str())),
        "{v}"
    );
    let (s, v) = t
        .json("GET", &format!("/v1/volumes/{pid}/attachments/{xid}"), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_error(&v, 404, "volume_attachment_not_found");
    let (s, v) = t
        .json("POST", &format!("{one}:detach"), Some(json!({"x": 1})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = t
        .json("POST", &format!("{one}:detach"), Some(json!({})))
        .await;
    assert_eq!(
        (s, v["state"].as_str()),
        (StatusCode::OK, Some("detached")),
        "{v}"
    );
    assert!(v["detachedAt"].is_string(), "{v}");
    assert_eq!(
        t.host.unshared.lock().unwrap().as_slice(),
        [(a.clone(), xid.clone())]
    );
    let (s, v) = t
        .json("POST", &format!("{one}:detach"), Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_error(&v, 409, "volume_not_attached");

    // Deleting the sandbox ends its attachments; then the volume goes.
    let (s, _) = t.json("DELETE", &format!("/v1/sandboxes/{b}"), None).await;
    assert!(s.is_success());
    let (_, v) = t
        .json("GET", &format!("/v1/volumes/{vid}/attachments/{yid}"), None)
        .await;
    assert_eq!(v["state"], "detached", "{v}");
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(!t.dir.join("volumes").join(format!("{vid}.d")).exists());
}

#[tokio::test]
async fn a_shared_volume_that_cannot_be_mounted_is_recorded_detached() {
    let t = T::new();
    let (_, vol) = t
        .json(
            "POST",
            "/v1/volumes",
            Some(json!({"sizeMiB": 16, "shared": true})),
        )
        .await;
    let vid = vol["id"].as_str().unwrap().to_string();
    let a = t.running(json!({})).await;
    *t.host.share_fails.lock().unwrap() = true;
    let (s, v) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:attach"),
            Some(json!({"sandboxId": a, "path": "/mnt/v"})),
        )
        .await;
    assert_eq!(s.as_u16() / 100, 5, "{v}");
    assert_eq!(v["error"]["code"], "volume_attach_failed", "{v}");
    let (_, v) = t.json("GET", &format!("/v1/volumes/{vid}"), None).await;
    assert_eq!(v["attachments"], json!([]), "{v}");
    // Nothing holds it: it may be deleted.
    let (s, _) = t
        .json(
            "POST",
            &format!("/v1/volumes/{vid}:delete"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn a_key_runs_at_most_its_quota_of_builds_at_once_and_queues_the_rest() {
    let t = T::with(|c| c.quotas.set("image.builds=2").unwrap());
    t.host.script(
        "(\nset -e\nslow-build\n) && sync",
        vec![Step::Sleep(800), Step::Exit(0)],
    );
    let slow = json!({"recipe": {"commands": ["slow-build"]}});
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (s, v) = t.json("POST", "/v1/images", Some(slow.clone())).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        ids.push(v["id"].as_str().unwrap_or_default().to_string());
    }
    // Two run; the third waits, queued, and its log says why.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let row = quota_row(&t, &t.admin, "image.builds").await;
    assert_eq!(
        (row["max"].as_u64(), row["used"].as_u64()),
        (Some(2), Some(2)),
        "{row}"
    );
    let mut states = Vec::new();
    for id in &ids {
        let (_, v) = t.json("GET", &format!("/v1/images/{id}"), None).await;
        states.push(v["state"].as_str().unwrap_or_default().to_string());
    }
    states.sort();
    assert_eq!(states, ["building", "building", "queued"], "{states:?}");
    // Another key's builds are its own: not behind this key's queue.
    let other = create_key(&t.dir, Some("other-builder"), false, false).unwrap();
    let (s, v) = t
        .json_as(
            &other,
            "POST",
            "/v1/images",
            Some(json!({"recipe": {}})),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let theirs = finished(&t, v["id"].as_str().unwrap_or_default()).await;
    assert_eq!(theirs["state"], "ready", "{theirs}");
    // Every one of this key's is built in the end, and the places are given back.
    for id in &ids {
        assert_eq!(finished(&t, id).await["state"], "ready");
    }
    let (_, log) = t
        .json("GET", &format!("/v1/images/{}/logs", ids[2]), None)
        .await;
    assert!(log.to_string().contains("image.builds"), "{log}");
    let row = quota_row(&t, &t.admin, "image.builds").await;
    assert_eq!(row["used"].as_u64(), Some(0), "{row}");
}
