//! `POST /v1/volumes` (and restores, `fromBackup`), `GET
//! /v1/volumes[/{id}]`, `POST /v1/volumes/{id}:delete` (and `DELETE`),
//! `:resize` and `:backup`, `/v1/volume-backups`, and the `volumes` field
//! of a sandbox create (docs/volumes.md).

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::time::iso;
use crate::domain::volume::SharedAttachment;
use crate::domain::volume::{
    overlap, path_problem, AttachMode, BackupState, Hold, VolumeBackup, DEFAULT_RETENTION_DAYS,
    MAX_ATTACH, MAX_RETENTION_DAYS, MAX_SIZE_MIB, MIN_RETENTION_DAYS, MIN_SIZE_MIB,
};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{
    checked_labels, checked_name, json_object, no_fields, page_after, query_object, Fields,
};
use crate::http::{Ctx, Reply};
use crate::service::attachments as shares;
use crate::service::volumes::{self, Attachment, BackupVolume, CreateVolume, VolumeView};
use crate::AppState;

fn render_attachment(a: &SharedAttachment) -> Value {
    json!({
        "id": a.id,
        "kind": "volume_attachment",
        "volumeId": a.volume_id,
        "sandboxId": a.sandbox_id,
        "path": a.path,
        "mode": "rw",
        "state": a.state.as_str(),
        "createdAt": iso(a.created_ms),
        "detachedAt": a.detached_ms.map(iso),
    })
}

fn render(v: &VolumeView) -> Value {
    let d = &v.volume;
    let policy = d.backup_policy.unwrap_or_default();
    let mut attachments: Vec<Value> = v
        .holders
        .iter()
        .map(|h| {
            json!({"sandboxId": h.sandbox_id, "path": h.attachment.path,
                   "mode": h.attachment.mode.as_str(),
                   "state": if h.hold == Hold::Active { "attached" } else { "releasing" }})
        })
        .collect();
    attachments.extend(
        v.shares
            .iter()
            .filter(|a| a.state.live())
            .map(render_attachment),
    );
    json!({
        "id": d.id,
        "kind": "volume",
        "name": d.name,
        "labels": d.labels,
        "sizeMiB": d.size_mib,
        "shared": d.shared,
        "usedBytes": v.used_bytes,
        "state": "ready",
        "region": "local",
        "createdAt": d.created_at,
        "attachments": attachments,
        "restoredFrom": d.restored_from,
        "backupPolicy": {
            "daily": policy.daily,
            "retentionDays": policy.retention_days,
            "schedule": null,
        },
    })
}

fn render_backup(b: &VolumeBackup) -> Value {
    json!({
        "id": b.id,
        "kind": "volume_backup",
        "volumeId": b.volume_id,
        "name": b.name,
        "state": b.state.as_str(),
        "sizeMiB": b.size_mib,
        "storedBytes": b.stored_bytes,
        "sha256": (!b.sha256.is_empty()).then_some(b.sha256.as_str()),
        "retentionDays": b.retention_days,
        "region": "local",
        "createdAt": iso(b.created_ms),
        "expiresAt": iso(b.expires_ms),
    })
}

pub(super) async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let size = f.int("sizeMiB", MIN_SIZE_MIB, MAX_SIZE_MIB);
    let from_backup = f.string("fromBackup");
    if from_backup.as_deref() == Some("") {
        f.issue("fromBackup", "must name a backup");
    }
    if !f.present("sizeMiB") && !f.present("fromBackup") {
        f.issue("sizeMiB", "is required (unless fromBackup is given)");
    }
    let name = checked_name(&mut f);
    let labels = checked_labels(&mut f).unwrap_or_default();
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, local");
        }
    }
    let shared = f.bool("shared").unwrap_or(false);
    if shared && f.present("fromBackup") {
        f.issue("shared", "a shared volume is not restored from a backup");
    }
    f.finish()?;
    let cmd = CreateVolume {
        size_mib: size.map(|n| n as u32),
        name,
        labels,
        from_backup,
        shared,
    };
    let v = volumes::create(&st, &ctx.key, cmd).await?;
    Ok(Reply::Json(StatusCode::CREATED, render(&v)))
}

pub(super) async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    Reply::ok(render(&volumes::get(&st, &ctx.key, &id).await?))
}

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let name = f.string("name");
    // Every volume is ready: the filter is checked, and keeps them all.
    let _state = f.one_of("state", &["ready"]);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let (mut rows, held) = volumes::list(&st, &ctx.key, name.as_deref()).await?;
    let next = page_after(&mut rows, cursor.as_deref(), limit, |d| d.id.as_str())?;
    let data: Vec<Value> = rows
        .into_iter()
        .map(|d| render(&volumes::view(&st, d, &held)))
        .collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

/// `POST /v1/volumes/{id}:delete` and `DELETE /v1/volumes/{id}`.
pub(super) async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = volumes::delete(&st, &ctx.key, &id).await?;
    Reply::ok(
        json!({"id": d.volume.id, "kind": "volume", "name": d.volume.name,
                     "status": "deleted", "deletedAt": d.deleted_at}),
    )
}

pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "delete" => {
            no_fields(&body)?;
            delete(st, ctx, id).await
        }
        "resize" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let size = f.int("sizeMiB", MIN_SIZE_MIB, MAX_SIZE_MIB);
            if !f.present("sizeMiB") {
                f.issue("sizeMiB", "is required");
            }
            f.finish()?;
            let size = size.unwrap_or(MIN_SIZE_MIB) as u32;
            let v = volumes::resize(&st, &ctx.key, &id, size).await?;
            Reply::ok(render(&v))
        }
        "backup" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let name = f.string("name");
            if let Some(n) = &name {
                if n.is_empty() || n.len() > 128 || n.chars().any(char::is_control) {
                    f.issue(
                        "name",
                        "must be 1 to 128 characters without control characters",
                    );
                }
            }
            let days = f.int("retentionDays", MIN_RETENTION_DAYS, MAX_RETENTION_DAYS);
            f.finish()?;
            let cmd = BackupVolume {
                name,
                retention_days: days.map_or(DEFAULT_RETENTION_DAYS, |d| d as u32),
            };
            let b = volumes::backup(&st, &ctx.key, &id, cmd).await?;
            Ok(Reply::Json(StatusCode::CREATED, render_backup(&b)))
        }
        // Shared volumes only: a drive cannot be hot-plugged into the
        // microVM (docs/volumes.md, "Shared volumes").
        "attach" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let sandbox_id = f.string("sandboxId");
            if sandbox_id.as_deref().is_none_or(str::is_empty) {
                f.issue("sandboxId", "is required");
            }
            let path = f.string("path");
            match path.as_deref() {
                None => f.issue("path", "is required"),
                Some(p) => {
                    if let Some(why) = path_problem(p) {
                        f.issue("path", why);
                    }
                }
            }
            f.finish()?;
            let a = shares::attach(
                &st,
                &ctx.key,
                &id,
                &sandbox_id.unwrap_or_default(),
                &path.unwrap_or_default(),
            )
            .await?;
            Ok(Reply::Json(StatusCode::CREATED, render_attachment(&a)))
        }
        "backup-policy" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let daily = f.bool("daily");
            let days = f.int("retentionDays", MIN_RETENTION_DAYS, MAX_RETENTION_DAYS);
            // `schedule: null` is "back to daily backups": nothing to change.
            let schedule = f.raw("schedule").filter(|v| !v.is_null()).is_some();
            let keep = f.raw("keep").is_some();
            f.finish()?;
            volumes::find(&st, &ctx.key, &id)?;
            if schedule || keep {
                return Err(ApiError::Unavailable {
                    product: "Volume backup schedules (everyMinutes, cron, keep)",
                });
            }
            let v = volumes::set_backup_policy(&st, &ctx.key, &id, daily, days.map(|d| d as u32))
                .await?;
            Reply::ok(render(&v))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/volumes/{id}:{verb}"),
        }),
    }
}

/// `GET /v1/volumes/{id}/attachments/{aid}`.
pub(super) async fn get_attachment(
    st: AppState,
    ctx: Ctx,
    id: String,
    aid: String,
) -> ApiResult<Reply> {
    Reply::ok(render_attachment(&shares::get(&st, &ctx.key, &id, &aid)?))
}

/// `POST /v1/volumes/{id}/attachments/{aid}:detach {}`.
pub(super) async fn attachment_action(
    st: AppState,
    ctx: Ctx,
    id: String,
    aid: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "detach" => {
            no_fields(&body)?;
            let a = shares::detach(&st, &ctx.key, &id, &aid).await?;
            Reply::ok(render_attachment(&a))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/volumes/{id}/attachments/{aid}:{verb}"),
        }),
    }
}

/// `GET /v1/volume-backups?volumeId&state&limit&cursor`, newest first.
pub(super) async fn list_backups(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let volume_id = f.string("volumeId").filter(|v| !v.is_empty());
    let state = f
        .one_of("state", &["pending", "ready"])
        .and_then(|s| BackupState::parse(&s));
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let mut rows = volumes::backups(&st, &ctx.key, volume_id.as_deref(), state)?;
    let next = page_after(&mut rows, cursor.as_deref(), limit, |b| b.id.as_str())?;
    let data: Vec<Value> = rows.iter().map(render_backup).collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

pub(super) async fn get_backup(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    Reply::ok(render_backup(&volumes::find_backup(&st, &ctx.key, &id)?))
}

/// `POST /v1/volume-backups/{id}:delete`.
pub(super) async fn backup_action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "delete" => {
            no_fields(&body)?;
            let b = volumes::delete_backup(&st, &ctx.key, &id)?;
            Reply::ok(
                json!({"id": b.id, "kind": "volume_backup", "volumeId": b.volume_id,
                             "status": "deleted", "deletedAt": iso(st.now_ms())}),
            )
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/volume-backups/{id}:{verb}"),
        }),
    }
}

/// The `volumes` of a sandbox create, checked on their own (paths, modes,
/// count); the service resolves them once the rest is valid.
pub(crate) fn parse_create(f: &mut Fields<'_>) -> Vec<Attachment> {
    let mut out = Vec::new();
    let Some(raw) = f.raw("volumes") else {
        return out;
    };
    let Some(items) = raw.as_array() else {
        f.issue("volumes", "must be a list of {volumeId, path, mode}");
        return out;
    };
    if items.len() > MAX_ATTACH {
        f.issue("volumes", format!("at most {MAX_ATTACH} volumes"));
        return out;
    }
    for (i, item) in items.iter().enumerate() {
        let field = |k: &str| format!("volumes[{i}].{k}");
        let Some(o) = item.as_object() else {
            f.issue(&format!("volumes[{i}]"), "must be {volumeId, path, mode}");
            continue;
        };
        for k in o.keys() {
            if !matches!(k.as_str(), "volumeId" | "path" | "mode") {
                f.issue(&field(k), "is not a field of a volume attachment");
            }
        }
        let volume_id = o.get("volumeId").and_then(Value::as_str).unwrap_or("");
        if volume_id.is_empty() {
            f.issue(&field("volumeId"), "is required");
        }
        let path = o.get("path").and_then(Value::as_str).unwrap_or("");
        if let Some(why) = path_problem(path) {
            f.issue(&field("path"), why);
        }
        let mode = match o.get("mode") {
            None | Some(Value::Null) => AttachMode::Rw,
            Some(m) => m.as_str().and_then(AttachMode::parse).unwrap_or_else(|| {
                f.issue(&field("mode"), "must be rw or snapshot");
                AttachMode::Rw
            }),
        };
        out.push(Attachment {
            volume_id: volume_id.to_string(),
            path: path.to_string(),
            mode,
        });
    }
    for (i, a) in out.iter().enumerate() {
        for b in &out[..i] {
            if overlap(&a.path, &b.path) {
                f.issue(
                    &format!("volumes[{i}].path"),
                    "overlaps the path of another volume",
                );
            }
        }
    }
    out
}
