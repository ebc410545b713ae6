//! Private-registry credentials through the router, against a fake host:
//! validation, normalisation, keys' scopes, sealing, read-only keys,
//! limits and idempotent replays.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_host::oci::Credentials;
use runtime_server::{create_key, ensure_admin_key, open_store, router, AppState, Config};
use serde_json::{json, Value};
use tower::ServiceExt;

fn basic(username: &str, password: &str) -> Option<Credentials> {
    Some(Credentials::Basic {
        username: username.into(),
        password: password.into(),
    })
}

struct T {
    dir: PathBuf,
    state: AppState,
    admin: String,
}

impl T {
    fn new() -> T {
        let dir = std::env::temp_dir().join(format!("rt-reg-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let admin = ensure_admin_key(&dir).unwrap().unwrap();
        let host = Arc::new(FakeHost::default());
        let state = AppState::new(Config::new(&dir), open_store(&dir).unwrap(), host);
        T { dir, state, admin }
    }

    async fn call(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
        idem: Option<&str>,
    ) -> (StatusCode, Value, bool) {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"));
        if method != "GET" {
            let k = idem.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_string);
            b = b.header("idempotency-key", k);
        }
        let body = body.map_or(Body::empty(), |v| Body::from(v.to_string()));
        let resp = router(self.state.clone())
            .oneshot(b.body(body).unwrap())
            .await
            .unwrap();
        let s = resp.status();
        let replayed = resp.headers().get("idempotency-replayed").is_some();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            s,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            replayed,
        )
    }

    async fn set(&self, key: &str, body: Value) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(key, "POST", "/v1/images/registries", Some(body), None)
            .await;
        (s, v)
    }

    async fn list(&self, key: &str) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(key, "GET", "/v1/images/registries", None, None)
            .await;
        (s, v)
    }

    async fn delete(&self, key: &str, registry: &str) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(
                key,
                "POST",
                "/v1/images/registries:delete",
                Some(json!({ "registry": registry })),
                None,
            )
            .await;
        (s, v)
    }

    async fn key_id(&self, key: &str) -> String {
        let (s, me, _) = self.call(key, "GET", "/v1/me", None, None).await;
        assert_eq!(s, StatusCode::OK, "{me}");
        me["credentialId"].as_str().unwrap().to_string()
    }

    /// Whether any file of the data dir holds `needle`.
    fn on_disk(&self, needle: &[u8]) -> Vec<PathBuf> {
        std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .filter(|p| {
                std::fs::read(p)
                    .unwrap()
                    .windows(needle.len())
                    .any(|w| w == needle)
            })
            .collect()
    }
}

impl Drop for T {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn issues(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v["error"]["details"]["issues"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| i["field"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[tokio::test]
async fn every_wrong_field_is_named_in_one_answer() {
    let t = T::new();
    let a = t.admin.clone();
    let cases = [
        (json!({}), vec!["password", "registry", "username"]),
        (
            json!({"registry": "ghcr.io/owner/repo", "username": "a:b", "password": "", "extra": 1}),
            vec!["extra", "password", "registry", "username"],
        ),
        (
            json!({"registry": 5, "username": "me"}),
            vec!["password", "registry"],
        ),
        (
            json!({"registry": "ghcr.io", "password": "tok"}),
            vec!["username"],
        ),
        (
            json!({"registry": "ghcr.io", "accessKeyId": "AKIAIOSFODNN7EXAMPLE"}),
            vec!["accessKeyId", "secretAccessKey"],
        ),
        (
            json!({"registry": "123456789012.dkr.ecr.us-east-1.amazonaws.com",
                   "accessKeyId": "lower", "secretAccessKey": "has space"}),
            vec!["accessKeyId", "secretAccessKey"],
        ),
        (
            json!({"registry": "ghcr.io", "username": "me", "password": "tok",
                   "accessKeyId": "AKIAIOSFODNN7EXAMPLE", "secretAccessKey": "s"}),
            vec!["accessKeyId", "secretAccessKey"],
        ),
        (
            json!({"registry": "ghcr.io:99999", "username": "me", "password": "p".repeat(16385)}),
            vec!["password", "registry"],
        ),
    ];
    for (body, want) in cases {
        let (s, v) = t.set(&a, body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["code"], "invalid_request", "{v}");
        assert_eq!(issues(&v), want, "{body}: {v}");
    }
    let (s, v) = t.delete(&a, "not a host").await;
    assert_eq!(
        (s, issues(&v)),
        (StatusCode::BAD_REQUEST, vec!["registry".into()])
    );
    // Nothing was kept by any of them.
    let (_, list) = t.list(&a).await;
    assert_eq!(list, json!({"data": []}));
}

#[tokio::test]
async fn a_credential_is_normalised_sealed_listed_without_secret_and_deleted() {
    let t = T::new();
    let a = t.admin.clone();
    let a_id = t.key_id(&a).await;
    let secret = "dckr_pat_0123456789abcdefXYZ";
    let (s, v) = t
        .set(
            &a,
            json!({"registry": "https://index.docker.io/v1/", "username": "me", "password": secret}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["registry"], "docker.io");
    assert_eq!(v["username"], "me");
    assert_eq!(v["kind"], "password");
    assert!(
        v["createdAt"].is_string() && v["updatedAt"].is_string(),
        "{v}"
    );
    assert!(!v.to_string().contains(secret), "{v}");
    let created = v["createdAt"].clone();

    // Every spelling of Docker Hub opens the one credential.
    for name in [
        "docker.io",
        "index.docker.io",
        "registry-1.docker.io",
        "Docker.IO",
    ] {
        assert_eq!(
            t.state.registry_credentials(&a_id, name),
            basic("me", secret),
            "{name}"
        );
    }
    assert_eq!(t.state.registry_credentials(&a_id, "ghcr.io"), None);

    // Set again replaces it, keeping its creation time.
    let secret2 = "ghp_second_token_value_987";
    let (s, v) = t
        .set(
            &a,
            json!({"registry": "registry-1.docker.io", "username": "me2", "password": secret2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["username"].clone(), v["createdAt"].clone()),
        (json!("me2"), created)
    );
    let (s, list) = t.list(&a).await;
    assert_eq!(s, StatusCode::OK);
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{list}");
    assert_eq!(data[0]["registry"], "docker.io");
    assert!(!list.to_string().contains(secret2), "{list}");
    assert_eq!(
        t.state.registry_credentials(&a_id, "docker.io"),
        basic("me2", secret2)
    );

    // An ECR access key is kept (its id shown, never its secret), for the
    // pull to exchange for a token.
    let ecr = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
    let aws_secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    let (s, v) = t
        .set(
            &a,
            json!({"registry": ecr, "accessKeyId": "AKIAIOSFODNN7EXAMPLE", "secretAccessKey": aws_secret}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["kind"].clone(), v["accessKeyId"].clone()),
        (json!("ecr"), json!("AKIAIOSFODNN7EXAMPLE"))
    );
    assert!(!v.to_string().contains(aws_secret));
    assert_eq!(
        t.state.registry_credentials(&a_id, ecr),
        Some(Credentials::Ecr {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_access_key: aws_secret.into()
        })
    );

    // No file of the data dir holds a secret in the clear (store, WAL).
    for s in [secret, secret2, aws_secret] {
        assert_eq!(t.on_disk(s.as_bytes()), Vec::<PathBuf>::new(), "{s}");
    }
    assert!(!t.on_disk(b"me2").is_empty(), "the user name is kept");

    let (s, v) = t.delete(&a, "index.docker.io").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v, json!({"registry": "docker.io", "deleted": true}));
    assert_eq!(t.state.registry_credentials(&a_id, "docker.io"), None);
    let (s, v) = t.delete(&a, "docker.io").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "registry_not_found");
    let (_, list) = t.list(&a).await;
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["registry"].as_str().unwrap())
        .collect();
    assert_eq!(names, [ecr]);
}

#[tokio::test]
async fn a_credential_belongs_to_the_key_that_set_it() {
    let t = T::new();
    let a = t.admin.clone();
    let b = create_key(&t.dir, Some("b"), false, false).unwrap();
    let (a_id, b_id) = (t.key_id(&a).await, t.key_id(&b).await);
    let (s, _) = t
        .set(
            &a,
            json!({"registry": "private.example.com", "username": "alice", "password": "a-secret"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    // B neither sees, deletes nor pulls with A's.
    let (_, list) = t.list(&b).await;
    assert_eq!(list, json!({"data": []}));
    let (s, _) = t.delete(&b, "private.example.com").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(
        t.state.registry_credentials(&b_id, "private.example.com"),
        None
    );
    // B's own for the same registry is another credential.
    let (s, _) = t
        .set(
            &b,
            json!({"registry": "PRIVATE.example.com", "username": "bob", "password": "b-secret"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        t.state.registry_credentials(&a_id, "private.example.com"),
        basic("alice", "a-secret")
    );
    assert_eq!(
        t.state.registry_credentials(&b_id, "private.example.com"),
        basic("bob", "b-secret")
    );
    let (s, _) = t.delete(&b, "private.example.com").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        t.state.registry_credentials(&b_id, "private.example.com"),
        None
    );
    assert_eq!(
        t.state.registry_credentials(&a_id, "private.example.com"),
        basic("alice", "a-secret")
    );
}

#[tokio::test]
async fn read_only_keys_list_but_never_change() {
    let t = T::new();
    let ro = create_key(&t.dir, Some("ro"), true, true).unwrap();
    let (s, v) = t.list(&ro).await;
    assert_eq!((s, v), (StatusCode::OK, json!({"data": []})));
    let (s, v) = t
        .set(
            &ro,
            json!({"registry": "ghcr.io", "username": "me", "password": "tok"}),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (s, _) = t
        .set(
            &t.admin,
            json!({"registry": "ghcr.io", "username": "me", "password": "tok"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = t.delete(&ro, "ghcr.io").await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (_, list) = t.list(&t.admin).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_key_keeps_a_bounded_number_and_sets_replay_by_idempotency_key() {
    let t = T::new();
    let a = t.admin.clone();
    for i in 0..32 {
        let (s, v) = t
            .set(
                &a,
                json!({"registry": format!("r{i}.example.com"), "username": "u", "password": "p"}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{i}: {v}");
    }
    let (s, v) = t
        .set(
            &a,
            json!({"registry": "r32.example.com", "username": "u", "password": "p"}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "quota_exceeded");
    // Replacing one of them is not a new one.
    let (s, _) = t
        .set(
            &a,
            json!({"registry": "r0.example.com", "username": "u2", "password": "p2"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (_, list) = t.list(&a).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 32);

    // One idempotency key: the first answer again, not a second set.
    let body = json!({"registry": "r1.example.com", "username": "again", "password": "p"});
    let body_sent = body.clone();
    let path = "/v1/images/registries";
    let (s1, v1, r1) = t
        .call(&a, "POST", path, Some(body.clone()), Some("set-1"))
        .await;
    let (s2, mut v2, r2) = t.call(&a, "POST", path, Some(body), Some("set-1")).await;
    assert_eq!(
        (s1, s2, r1, r2),
        (StatusCode::OK, StatusCode::OK, false, true)
    );
    assert_eq!(
        v2.as_object_mut().unwrap().remove("replayed"),
        Some(json!(true))
    );
    assert_eq!(v1, v2);
    // The stored fingerprint is keyed: a plain hash of the request would
    // let whoever reads the store test guesses of the password.
    let mut plain = format!("POST {path}?\n").into_bytes();
    plain.extend_from_slice(body_sent.to_string().as_bytes());
    let plain = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&plain));
    assert!(
        t.on_disk(plain.as_bytes()).is_empty(),
        "the store holds the body's plain hash"
    );
    let other = json!({"registry": "r1.example.com", "username": "other", "password": "p"});
    let (s3, v3, _) = t.call(&a, "POST", path, Some(other), Some("set-1")).await;
    assert_eq!(s3.as_u16() / 100, 4, "{v3}");
    let a_id = t.key_id(&a).await;
    assert_eq!(
        t.state.registry_credentials(&a_id, "r1.example.com"),
        basic("again", "p")
    );
}
