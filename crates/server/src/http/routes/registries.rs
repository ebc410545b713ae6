//! Private-registry credentials: `GET` and `POST /v1/images/registries`,
//! `POST /v1/images/registries:delete`.

use axum::body::Bytes;
use serde_json::json;

use crate::domain::registry::{
    access_key_id_problem, is_ecr, normalize, password_problem, secret_access_key_problem,
    username_problem,
};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::images::registries::{self, Credential};
use crate::AppState;

/// A field's check: why its value is wrong, if it is.
type Check = fn(&str) -> Option<&'static str>;

const REGISTRY_FORMAT: &str =
    "must be a registry host[:port], such as ghcr.io or registry.example.com:5000";

/// The `registry` field, normalised; an issue when it is missing or wrong.
fn registry(f: &mut Fields<'_>) -> Option<String> {
    match f.string("registry") {
        None => {
            if !f.present("registry") {
                f.issue("registry", "is required");
            } else if f.issues.iter().all(|i| i.field != "registry") {
                f.issue("registry", REGISTRY_FORMAT);
            }
            None
        }
        Some(r) => {
            let n = normalize(&r);
            if n.is_none() {
                f.issue("registry", REGISTRY_FORMAT);
            }
            n
        }
    }
}

/// `POST /v1/images/registries`: `{registry, username, password}` or
/// `{registry, accessKeyId, secretAccessKey}`.
pub(super) async fn set(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let registry = registry(&mut f);
    let username = f.string("username");
    let password = f.string("password");
    let access_key_id = f.string("accessKeyId");
    let secret_access_key = f.string("secretAccessKey");
    let checks: [(&str, &Option<String>, Check); 4] = [
        ("username", &username, username_problem),
        ("password", &password, password_problem),
        ("accessKeyId", &access_key_id, access_key_id_problem),
        (
            "secretAccessKey",
            &secret_access_key,
            secret_access_key_problem,
        ),
    ];
    for (field, value, problem) in checks {
        if let Some(why) = value.as_deref().and_then(problem) {
            f.issue(field, why);
        }
    }
    let basic = username.is_some() || password.is_some();
    let ecr = access_key_id.is_some() || secret_access_key.is_some();
    let mut cred = None;
    if basic && ecr {
        for field in ["accessKeyId", "secretAccessKey"] {
            if f.present(field) {
                f.issue(
                    field,
                    "give username and password, or accessKeyId and secretAccessKey, not both",
                );
            }
        }
    } else if ecr {
        if access_key_id.is_none() {
            f.issue("accessKeyId", "is required with secretAccessKey");
        }
        if secret_access_key.is_none() {
            f.issue("secretAccessKey", "is required with accessKeyId");
        }
        if registry.as_deref().is_some_and(|r| !is_ecr(r)) {
            f.issue(
                "accessKeyId",
                "is for Amazon ECR registries (<account>.dkr.ecr.<region>.amazonaws.com); give username and password for others",
            );
        }
        if let (Some(access_key_id), Some(secret_access_key)) = (access_key_id, secret_access_key) {
            cred = Some(Credential::Ecr {
                access_key_id,
                secret_access_key,
            });
        }
    } else {
        if username.is_none() {
            f.issue("username", "is required (with password)");
        }
        if password.is_none() {
            f.issue(
                "password",
                "is required (with username): a password or token",
            );
        }
        if let (Some(username), Some(password)) = (username, password) {
            cred = Some(Credential::Password { username, password });
        }
    }
    f.finish()?;
    match (registry, cred) {
        (Some(registry), Some(cred)) => Reply::ok(registries::set(&st, &ctx.key, registry, cred)?),
        // finish() answered every case without both.
        _ => Err(ApiError::Internal {
            what: "a registry set passed its checks incomplete".into(),
        }),
    }
}

/// `GET /v1/images/registries`.
pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    Fields::new(&q).finish()?;
    Reply::ok(json!({"data": registries::list(&st, &ctx.key)?}))
}

/// `POST /v1/images/registries:delete` `{registry}`: the secret is erased.
pub(super) async fn delete(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let registry = registry(&mut f);
    f.finish()?;
    let registry = registry.unwrap_or_default();
    registries::delete(&st, &ctx.key, &registry)?;
    Reply::ok(json!({"registry": registry, "deleted": true}))
}
