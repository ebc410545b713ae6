//! Money and keys through the router, against a fake host whose vCPU time
//! the tests set: metering against the closed formula, budgets refused
//! before anything starts, lifetime caps, daily limits, read-only keys,
//! revocation and the login approval.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_server::{
    create_key, ensure_admin_key, keys, open_store, router, AppState, Config, ROUTE_SAMPLES,
};
use serde_json::{json, Value};
use tower::ServiceExt;

/// A request to `router(st)` as if from `peer` over plain HTTP.
async fn from_peer(
    st: &AppState,
    peer: &str,
    method: &str,
    path: &str,
    body: String,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    req.extensions_mut()
        .insert(runtime_server::Peer(peer.parse().unwrap()));
    let resp = router(st.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&b).into_owned())
}

struct T {
    dir: PathBuf,
    host: Arc<FakeHost>,
    state: AppState,
    admin: String,
}

impl T {
    fn new() -> T {
        let dir = std::env::temp_dir().join(format!("rt-billing-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let host = Arc::new(FakeHost::default());
        let state = AppState::new(Config::new(&dir), open_store(&dir).unwrap(), host.clone());
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
        key: Option<&str>,
        content_type: &str,
        body: String,
    ) -> (StatusCode, Vec<u8>) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", content_type)
            .header("prefer", "wait=10");
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        if method != "GET" {
            b = b.header("idempotency-key", uuid::Uuid::new_v4().to_string());
        }
        let resp = router(self.state.clone())
            .oneshot(b.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        (
            status,
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
    }

    async fn call(&self, key: &str, method: &str, path: &str, body: Value) -> (StatusCode, Value) {
        let body = if method == "GET" {
            String::new()
        } else {
            body.to_string()
        };
        let (s, b) = self
            .raw(method, path, Some(key), "application/json", body)
            .await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    async fn create(&self, key: &str, body: Value) -> Value {
        let (s, v) = self.call(key, "POST", "/v1/sandboxes", body).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["state"], "running", "{v}");
        v
    }

    async fn get(&self, key: &str, id: &str) -> Value {
        let (s, v) = self
            .call(key, "GET", &format!("/v1/sandboxes/{id}"), Value::Null)
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }

    async fn ticks(&self, n: usize) {
        for _ in 0..n {
            self.state.meter_tick().await.unwrap();
        }
    }

    /// Sets the vCPU time the host reports for `id`.
    fn cpu(&self, id: &str, t: Duration) {
        self.host.cpu.lock().unwrap().insert(id.to_string(), t);
    }

    fn key_with_limit(&self, limit: Option<i64>) -> String {
        let key = create_key(&self.dir, Some("agent"), false, false).unwrap();
        if limit.is_some() {
            keys::set_daily_limit(&self.dir, keys::key_id_of(&key).unwrap(), limit).unwrap();
        }
        key
    }
}

fn micros(v: &Value) -> i64 {
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("not microdollars: {v}"))
}

/// µ$ for `seconds` of a sandbox at `cpu_vcpu` vCPUs billed and `gib` GiB,
/// the contract's closed formula (floored once).
fn formula(seconds: i64, cpu_millis: i64, mib: i64) -> i64 {
    // (cpu_millis/1000 × 25,000 + mib/1024 × 7,500) / 3600 per second
    seconds * (cpu_millis * 25_000 * 1024 + mib * 7_500 * 1000) / (3600 * 1000 * 1024)
}

#[tokio::test]
async fn idle_reserved_and_busy_sandboxes_are_charged_by_the_formula() {
    let t = T::new();
    let idle = t.create(&t.admin, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let reserved = t.create(&t.admin, json!({"cpu": "reserved"})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let busy = t.create(&t.admin, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let half = t
        .create(
            &t.admin,
            json!({"vcpu": 4, "memoryMiB": 1000, "cpuFloorMillis": 300}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Busy: both vCPUs all the time; half: 0.1 vCPU, under its 0.3 floor
    // for the first half hour, then 2.5 vCPUs.
    t.cpu(&busy, Duration::ZERO);
    t.cpu(&half, Duration::ZERO);
    for i in 1..=3600u64 {
        t.cpu(&busy, Duration::from_secs(2 * i));
        let h = if i <= 1800 {
            Duration::from_millis(100 * i)
        } else {
            Duration::from_millis(100 * 1800 + 2500 * (i - 1800))
        };
        t.cpu(&half, h);
        t.state.meter_tick().await.unwrap();
    }
    // The first reading is the baseline (booting is not billed): the floor.
    assert_eq!(
        micros(&t.get(&t.admin, &idle).await["chargedMicros"]),
        31_250
    );
    assert_eq!(
        micros(&t.get(&t.admin, &reserved).await["chargedMicros"]),
        80_000
    );
    let busy_units = 3599 * (2000 * 25_000 * 1024 + 4096 * 7_500 * 1000)
        + (50 * 25_000 * 1024 + 4096 * 7_500 * 1000);
    assert_eq!(
        micros(&t.get(&t.admin, &busy).await["chargedMicros"]),
        busy_units / (3600 * 1000 * 1024)
    );
    assert_eq!(
        micros(&t.get(&t.admin, &half).await["chargedMicros"]),
        (1800 * (300 * 25_000 * 1024 + 1000 * 7_500 * 1000)
            + 1800 * (2500 * 25_000 * 1024 + 1000 * 7_500 * 1000))
            / (3600 * 1000 * 1024)
    );
    assert_eq!(formula(3600, 50, 4096), 31_250);

    // Held: the rest of the current hour at full use, never below what a
    // lease of that many seconds costs.
    let v = t.get(&t.admin, &idle).await;
    let held = micros(&v["heldMicros"]);
    assert!((1..=80_000).contains(&held), "{v}");

    // Usage per sandbox and per key adds up to the records.
    let (s, u) = t.call(&t.admin, "GET", "/v1/usage", Value::Null).await;
    assert_eq!(s, StatusCode::OK, "{u}");
    let total: i64 = [&idle, &reserved, &busy, &half]
        .iter()
        .map(|id| {
            u["sandboxes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["sandboxId"] == **id)
                .map(|x| micros(&x["chargedMicros"]))
                .unwrap()
        })
        .sum();
    assert_eq!(micros(&u["spent"]), total, "{u}");
    assert_eq!(u["rates"]["compute"]["cpuMicrosPerVcpuHour"], "25000");
}

#[tokio::test]
async fn a_day_of_ticks_has_no_drift() {
    let t = T::new();
    // 3 vCPU, 1000 MiB, 137 ms a second: no finite decimal per second.
    let id = t
        .create(&t.admin, json!({"vcpu": 3, "memoryMiB": 1000}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    t.cpu(&id, Duration::ZERO);
    for i in 1..=86_400u64 {
        t.cpu(&id, Duration::from_millis(137 * i));
        t.state.meter_tick().await.unwrap();
    }
    let v = t.get(&t.admin, &id).await;
    let exact = 86_399i128 * (137 * 25_000 * 1024 + 1000 * 7_500 * 1000)
        + (50 * 25_000 * 1024 + 1000 * 7_500 * 1000);
    assert_eq!(
        i128::from(micros(&v["chargedMicros"])),
        exact / (3600 * 1000 * 1024)
    );
}

#[tokio::test]
async fn max_cost_refuses_before_anything_starts() {
    let t = T::new();
    // One hour of 2 vCPU / 4 GiB at full use: 80,000 µ$.
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            "/v1/sandboxes",
            json!({"timeoutSeconds": 3600, "maxCostMicros": 79_999}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "budget_exceeded");
    // Without a timeout the first lease is an hour too.
    let (s, _) = t
        .call(
            &t.admin,
            "POST",
            "/v1/sandboxes",
            json!({"maxCostMicros": 79_999}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(t.host.started.lock().unwrap().is_empty());
    let (_, list) = t
        .call(
            &t.admin,
            "GET",
            "/v1/sandboxes?includeStopped=true",
            Value::Null,
        )
        .await;
    assert_eq!(list["data"].as_array().unwrap().len(), 0, "{list}");

    let v = t
        .create(
            &t.admin,
            json!({"timeoutSeconds": 900, "maxCostMicros": 20_000}),
        )
        .await;
    let id = v["id"].as_str().unwrap().to_string();
    // Extending to more than the budget's worth of lease is refused.
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{id}:extend"),
            json!({"seconds": 600}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "budget_exceeded");
    // A wake into a longer lease is refused and it stays paused.
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{id}:pause"),
            json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "paused");
    let woken_before = t.host.woken.lock().unwrap().len();
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{id}:wake"),
            json!({"timeoutSeconds": 3600}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(t.host.woken.lock().unwrap().len(), woken_before);
    assert_eq!(t.get(&t.admin, &id).await["state"], "paused");
    let (s, v) = t
        .call(
            &t.admin,
            "POST",
            &format!("/v1/sandboxes/{id}:wake"),
            json!({}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running");
}

#[tokio::test]
async fn the_lifetime_cap_stops_the_sandbox() {
    let t = T::new();
    let v = t.create(&t.admin, json!({"maxTotalCostMicros": 100})).await;
    let id = v["id"].as_str().unwrap().to_string();
    // Idle 2 vCPU / 4 GiB: 8.68 µ$ a second; 100 µ$ after 12 s.
    t.ticks(11).await;
    assert_eq!(t.get(&t.admin, &id).await["state"], "running");
    t.ticks(1).await;
    let (s, v) = t
        .call(
            &t.admin,
            "GET",
            &format!("/v1/sandboxes/{id}?waitFor=stopped&timeoutSeconds=10"),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["stopReason"], "lifetime_cap");
    assert_eq!(micros(&v["chargedMicros"]), formula(12, 50, 4096));
    assert_eq!(micros(&v["heldMicros"]), 0);
}

#[tokio::test]
async fn the_daily_limit_refuses_then_pauses_the_keys_sandboxes() {
    let t = T::new();
    // 60 s of 2 vCPU / 4 GiB at full use: 1,334 µ$ (rounded up).
    let key = t.key_with_limit(Some(2_000));
    let other = t.key_with_limit(None);
    let (s, lim) = t.call(&key, "GET", "/v1/limits", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(lim["access"], "full");
    assert_eq!(lim["daily"]["limitMicros"], "2000");
    assert_eq!(lim["daily"]["usedMicros"], "0");
    assert_eq!(lim["daily"]["window"], "24h");

    let first = t.create(&key, json!({"timeoutSeconds": 60})).await;
    let id = first["id"].as_str().unwrap().to_string();
    let other_id = t.create(&other, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The second lease does not fit beside the first one's hold (counted
    // before any tick updated the record).
    let started = t.host.started.lock().unwrap().len();
    let (s, v) = t
        .call(&key, "POST", "/v1/sandboxes", json!({"timeoutSeconds": 60}))
        .await;
    assert_eq!(s, StatusCode::PAYMENT_REQUIRED, "{v}");
    assert_eq!(v["error"]["code"], "spending_limit_reached");
    assert_eq!(t.host.started.lock().unwrap().len(), started);

    // Busy (80,000 µ$/h, 22.2 µ$/s): the limit is reached mid-run and the
    // key's running sandbox pauses; the other key's runs on.
    t.cpu(&id, Duration::ZERO);
    let mut secs = 0u64;
    while t.get(&key, &id).await["state"] == "running" {
        secs += 1;
        assert!(secs < 200, "never paused");
        t.cpu(&id, Duration::from_secs(2 * secs));
        t.state.meter_tick().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (_, v) = t
        .call(
            &key,
            "GET",
            &format!("/v1/sandboxes/{id}?waitFor=paused&timeoutSeconds=10"),
            Value::Null,
        )
        .await;
    assert_eq!(v["state"], "paused", "{v}");
    assert!(micros(&v["chargedMicros"]) >= 2_000, "{v}");
    assert_eq!(t.get(&other, &other_id).await["state"], "running");

    // Now every spend answers 402: create, wake, and an exec that would wake it.
    for (method, path, body) in [
        ("POST", "/v1/sandboxes".to_string(), json!({})),
        ("POST", format!("/v1/sandboxes/{id}:wake"), json!({})),
        (
            "POST",
            format!("/v1/sandboxes/{id}:exec"),
            json!({"command": "true"}),
        ),
    ] {
        let (s, v) = t.call(&key, method, &path, body).await;
        assert_eq!(s, StatusCode::PAYMENT_REQUIRED, "{path}: {v}");
        assert_eq!(v["error"]["code"], "spending_limit_reached");
        assert_eq!(v["error"]["status"], 402);
    }
    assert_eq!(t.get(&key, &id).await["state"], "paused");
    // The key cannot raise its own limit: there is no route for it.
    for (method, path) in [("POST", "/v1/limits"), ("PUT", "/v1/limits")] {
        let (s, _) = t
            .call(
                &key,
                method,
                path,
                json!({"daily": {"limitMicros": "999999999"}}),
            )
            .await;
        assert!(
            s == StatusCode::METHOD_NOT_ALLOWED || s == StatusCode::NOT_FOUND,
            "{s}"
        );
    }
    let (_, lim) = t.call(&key, "GET", "/v1/limits", Value::Null).await;
    assert_eq!(lim["daily"]["limitMicros"], "2000");
    assert_eq!(lim["daily"]["remainingMicros"], "0");
    // A person raises it on the server; the wake goes through.
    keys::set_daily_limit(&t.dir, keys::key_id_of(&key).unwrap(), Some(1_000_000)).unwrap();
    let (s, v) = t
        .call(&key, "POST", &format!("/v1/sandboxes/{id}:wake"), json!({}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn every_longer_lease_is_checked_against_the_owners_daily_limit() {
    let t = T::new();
    let key = t.key_with_limit(Some(5_000));
    let id = t.create(&key, json!({"timeoutSeconds": 60})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let before = t.get(&key, &id).await["endsAt"].clone();
    let path = |verb: &str| format!("/v1/sandboxes/{id}:{verb}");
    // 600 s more at 22.2 µ$/s does not fit in 5,000 µ$; the admin acting
    // on the key's sandbox is held to the key's limit too.
    for (who, verb, body) in [
        (&key, "extend", json!({"seconds": 600})),
        (&t.admin, "extend", json!({"seconds": 600})),
        (&key, "wake", json!({"timeoutSeconds": 3600})),
        (&key, "update", json!({"timeoutSeconds": 3600})),
    ] {
        let (s, v) = t.call(who, "POST", &path(verb), body).await;
        assert_eq!(s, StatusCode::PAYMENT_REQUIRED, "{verb}: {v}");
        assert_eq!(v["error"]["code"], "spending_limit_reached");
    }
    assert_eq!(t.get(&key, &id).await["endsAt"], before);
    // What fits goes through.
    let (s, v) = t
        .call(&key, "POST", &path("extend"), json!({"seconds": 60}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_ne!(v["endsAt"], before);
}

#[tokio::test]
async fn an_hourly_renewal_past_the_daily_limit_pauses() {
    let t = T::new();
    // No timeout: leases of an hour, 80,000 µ$ at full use, renewed hourly.
    let key = t.key_with_limit(Some(100_000));
    let id = t.create(&key, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    t.ticks(2).await;
    // A person lowers the limit: not reached, but another hour would pass it.
    keys::set_daily_limit(&t.dir, keys::key_id_of(&key).unwrap(), Some(80_005)).unwrap();
    t.ticks(1).await;
    assert_eq!(t.get(&key, &id).await["state"], "running");
    // An hour later (the record says it was ready an hour ago).
    let db = rusqlite::Connection::open(t.dir.join("runtime.db")).unwrap();
    let ready = time::OffsetDateTime::now_utc() - time::Duration::milliseconds(3_600_500);
    let ready = ready
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    db.execute(
        "UPDATE sandboxes SET record = json_set(record, '$.readyAt', ?2) WHERE id = ?1",
        rusqlite::params![id, ready],
    )
    .unwrap();
    t.ticks(1).await;
    let (_, v) = t
        .call(
            &key,
            "GET",
            &format!("/v1/sandboxes/{id}?waitFor=paused&timeoutSeconds=10"),
            Value::Null,
        )
        .await;
    assert_eq!(v["state"], "paused", "{v}");
}

#[tokio::test]
async fn read_only_keys_are_refused_every_change_and_every_look_inside() {
    let t = T::new();
    let id = t.create(&t.admin, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    t.ticks(3).await;
    let ro = create_key(&t.dir, Some("watcher"), true, false).unwrap();
    let mut changes = 0;
    for (method, sample) in ROUTE_SAMPLES {
        let path = sample.replace("{id}", &id);
        let (s, body) = t
            .raw(method, &path, Some(&ro), "application/json", "{}".into())
            .await;
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let inside = [
            "/files",
            "/processes",
            "/interpreter",
            "/terminal",
            "/tunnel",
            "/egress-secrets",
            "/console",
        ]
        .iter()
        .any(|p| path.contains(p));
        if *method != "GET" || inside {
            changes += usize::from(*method != "GET");
            assert_eq!(s, StatusCode::FORBIDDEN, "{method} {path}: {v}");
            assert_eq!(v["error"]["code"], "forbidden", "{method} {path}");
        } else {
            assert_ne!(s, StatusCode::FORBIDDEN, "{method} {path}: {v}");
        }
    }
    assert!(changes >= 25, "{changes}");
    // What it may read: every sandbox and its cost, its limits and usage.
    let (_, list) = t.call(&ro, "GET", "/v1/sandboxes", Value::Null).await;
    let seen = &list["data"].as_array().unwrap()[0];
    assert_eq!(seen["id"], id.as_str());
    assert_eq!(micros(&seen["chargedMicros"]), formula(3, 50, 4096));
    let (_, lim) = t.call(&ro, "GET", "/v1/limits", Value::Null).await;
    assert_eq!(lim["access"], "read");
    let (_, me) = t.call(&ro, "GET", "/v1/me", Value::Null).await;
    assert_eq!(me["role"], "viewer");
    assert_eq!(me["credentialId"], keys::key_id_of(&ro).unwrap());
    let (s, u) = t.call(&ro, "GET", "/v1/usage", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(micros(&u["spent"]), formula(3, 50, 4096));
    // Nothing changed.
    assert_eq!(t.get(&t.admin, &id).await["state"], "running");
    assert!(t.host.stopped.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_revoked_key_is_refused_at_once_and_listed_as_revoked() {
    let t = T::new();
    let key = create_key(&t.dir, Some("ci"), false, false).unwrap();
    let (s, _) = t.call(&key, "GET", "/v1/me", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    let k = keys::revoke_key(&t.dir, "ci").unwrap();
    assert!(k.revoked_at.is_some());
    let (s, v) = t.call(&key, "GET", "/v1/sandboxes", Value::Null).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    assert_eq!(v["error"]["code"], "unauthorized");
    let listed = keys::list_keys(&t.dir).unwrap();
    let row = listed.iter().find(|r| r.id == k.id).unwrap();
    assert!(row.revoked_at.is_some());
    // The store holds hashes only.
    let db = std::fs::read(t.dir.join("runtime.db")).unwrap();
    // `rtcloud_<36-character id>_<secret>`; the secret may hold `_` itself.
    let secret = &key["rtcloud_".len() + 37..];
    assert_eq!(secret.len(), 43, "{key}");
    assert!(!db.windows(secret.len()).any(|w| w == secret.as_bytes()));
    assert!(matches!(
        keys::revoke_key(&t.dir, "nobody"),
        Err(runtime_server::ServerError::KeyNotFound { .. })
    ));
}

fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

#[tokio::test]
async fn login_keeps_the_admin_key_off_plain_http_and_each_source_to_its_share() {
    let t = T::new();
    let begin = |peer: &'static str| {
        let st = t.state.clone();
        async move {
            let (s, b) = from_peer(&st, peer, "POST", "/v1/login/requests", "{}".into()).await;
            (s, serde_json::from_str::<Value>(&b).unwrap_or(Value::Null))
        }
    };
    let (s, req) = begin("192.0.2.7:40000").await;
    assert_eq!(s, StatusCode::CREATED, "{req}");
    let page = req["approvePath"].as_str().unwrap().to_string();
    // Over plain HTTP from another machine, the page that takes the admin
    // key is refused, and so is a post of the key to it.
    let (s, body) = from_peer(&t.state, "192.0.2.7:40001", "GET", &page, String::new()).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body.contains("plain HTTP") && !body.contains("adminKey"),
        "{body}"
    );
    let approve = form(&[("adminKey", &t.admin), ("decision", "approve")]);
    let (s, _) = from_peer(&t.state, "[2001:db8::1]:5", "POST", &page, approve.clone()).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // From this machine (v4, v6 or v4 in v6), it is served.
    for local in ["127.0.0.1:9", "[::1]:9", "[::ffff:127.0.0.1]:9"] {
        let (s, body) = from_peer(&t.state, local, "GET", &page, String::new()).await;
        assert_eq!(s, StatusCode::OK, "{local}: {body}");
        assert!(body.contains("adminKey"), "{body}");
    }
    // One address has at most 8 requests waiting; others still get theirs.
    for _ in 1..8 {
        assert_eq!(begin("192.0.2.7:1").await.0, StatusCode::CREATED);
    }
    let (s, v) = begin("192.0.2.7:2").await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "busy", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("from this address"),
        "{v}"
    );
    assert_eq!(begin("198.51.100.3:1").await.0, StatusCode::CREATED);

    // The operator may allow plain HTTP (`--login-over-http`).
    let mut config = Config::new(&t.dir);
    config.login_over_http = true;
    let open = AppState::new(config, open_store(&t.dir).unwrap(), t.host.clone());
    let (s, req) = {
        let (s, b) = from_peer(
            &open,
            "192.0.2.9:1",
            "POST",
            "/v1/login/requests",
            "{}".into(),
        )
        .await;
        (s, serde_json::from_str::<Value>(&b).unwrap())
    };
    assert_eq!(s, StatusCode::CREATED);
    let page = req["approvePath"].as_str().unwrap();
    let (s, body) = from_peer(&open, "192.0.2.9:2", "GET", page, String::new()).await;
    assert_eq!(s, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn login_is_approved_on_the_page_with_the_admin_key() {
    let t = T::new();
    let (s, b) = t
        .raw(
            "POST",
            "/v1/login/requests",
            None,
            "application/json",
            json!({"computer": "laptop <b>"}).to_string(),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED);
    let req: Value = serde_json::from_slice(&b).unwrap();
    let id = req["id"].as_str().unwrap();
    let code = req["code"].as_str().unwrap();
    let token = req["pollToken"].as_str().unwrap();
    let poll = || async {
        let (s, b) = t
            .raw(
                "POST",
                &format!("/v1/login/requests/{id}:poll"),
                None,
                "application/json",
                json!({ "pollToken": token }).to_string(),
            )
            .await;
        (
            s,
            serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null),
        )
    };
    assert_eq!(poll().await.1["status"], "pending");

    let (s, page) = t
        .raw(
            "GET",
            req["approvePath"].as_str().unwrap(),
            None,
            "",
            String::new(),
        )
        .await;
    let page = String::from_utf8(page).unwrap();
    assert_eq!(s, StatusCode::OK);
    assert!(page.contains(code), "{page}");
    assert!(page.contains("laptop &lt;b&gt;") && !page.contains("laptop <b>"));

    let t = &t;
    let post = |body: String| async move {
        let (s, b) = t
            .raw(
                "POST",
                &format!("/login/{id}"),
                None,
                "application/x-www-form-urlencoded",
                body,
            )
            .await;
        (s, String::from_utf8(b).unwrap())
    };
    // A key that is not the admin key approves nothing.
    let plain = create_key(&t.dir, None, false, false).unwrap();
    let (s, _) = post(form(&[("adminKey", &plain), ("decision", "approve")])).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(poll().await.1["status"], "pending");
    let (s, done) = post(form(&[
        ("adminKey", &t.admin),
        ("name", "laptop key"),
        ("dailyLimit", "0.50"),
        ("decision", "approve"),
    ]))
    .await;
    assert_eq!(s, StatusCode::OK, "{done}");
    assert!(done.contains("Approved"), "{done}");
    let (s, v) = poll().await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["status"], "approved");
    let key = v["key"].as_str().unwrap().to_string();
    // Handed over once.
    assert_eq!(poll().await.0, StatusCode::NOT_FOUND);
    let (s, lim) = t.call(&key, "GET", "/v1/limits", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(lim["daily"]["limitMicros"], "500000");
    assert_eq!(lim["access"], "full");
    let k = keys::list_keys(&t.dir).unwrap();
    assert!(k.iter().any(|r| r.name.as_deref() == Some("laptop key")
        && r.daily_limit_micros == Some(500_000)
        && !r.account_wide));
}
