//! Volumes (contract §5 `volumes`, §11): persistent disks that outlive the
//! sandboxes using them. `POST /v1/volumes`, `GET /v1/volumes[/{id}]`,
//! `POST /v1/volumes/{id}:delete` (and `DELETE`).
//!
//! A volume is `data_dir/volumes/<id>.ext4`, a sparse raw file holding an
//! ext4 file system (made on the host once, owned inside by the sandbox
//! user); its record is a row of the store's `volumes`. A create names up
//! to four `{volumeId, path, mode}`; they are kept per sandbox (table
//! `volume_attachments`) and become the [`MachineSpec`] drives of every
//! start, wake and recovery. `rw`: the volume itself, one live sandbox at a
//! time. `snapshot`: the machine's own copy taken at boot (after a running
//! writer's guest flushed its writes), written freely and discarded with it.
//!
//! A sandbox holds its volumes while it may run again: not deleted, and not
//! stopped unless persistent. After it ends, they stay held until its
//! machine is gone (answered as `volume_releasing`, which the client waits
//! out). Fork and memory snapshots of a sandbox with volumes are refused
//! (`volume_attached`): a copy would share the drive, or restore a machine
//! whose devices differ.

use std::path::PathBuf;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::time::iso;
pub(crate) use crate::domain::volume::Attachment;
use crate::domain::volume::{
    hold_of, overlap, path_problem, AttachMode, Hold, Volume, MAX_ATTACH, MAX_SIZE_MIB,
    MIN_SIZE_MIB,
};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{checked_labels, checked_name};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::AppState;

fn file(st: &AppState, id: &str) -> PathBuf {
    st.config()
        .data_dir
        .join("volumes")
        .join(format!("{id}.ext4"))
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: "volume_not_found",
        what: "volume",
        id: id.to_string(),
    }
}

fn visible(key: &KeyInfo, d: &Volume) -> bool {
    crate::domain::access::visible(key, &d.key_id)
}

fn all(st: &AppState) -> ApiResult<Vec<Volume>> {
    Ok(st.store().volumes()?)
}

/// A volume by id, or by name among this key's.
fn find(st: &AppState, key: &KeyInfo, which: &str) -> ApiResult<Volume> {
    if let Some(d) = st.store().get_volume(which)? {
        if visible(key, &d) {
            return Ok(d);
        }
    }
    all(st)?
        .into_iter()
        .find(|d| visible(key, d) && d.name.as_deref() == Some(which))
        .ok_or_else(|| not_found(which))
}

/// The drives of a sandbox's machine, in the order of its create.
pub fn drives(st: &AppState, sandbox_id: &str) -> Vec<runtime_host::VolumeDrive> {
    // Only an unreadable store leaves them out (and says so).
    let list = match st.store().attachments_of(sandbox_id) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(sandbox_id, error = %e, "reading a sandbox's volumes failed");
            Vec::new()
        }
    };
    list.into_iter()
        .map(|a| runtime_host::VolumeDrive {
            file: file(st, &a.volume_id),
            snapshot: a.mode == AttachMode::Snapshot,
            path: a.path,
        })
        .collect()
}

async fn hold(st: &AppState, sandbox_id: &str) -> ApiResult<Hold> {
    let Some(row) = st.store().get_sandbox(sandbox_id)? else {
        return Ok(Hold::Free);
    };
    let r = &row.record;
    if let Some(h) = hold_of(row.deleted.is_some(), r.state, r.persistent) {
        return Ok(h);
    }
    // Ended: free once no lifecycle change is under way and no machine runs.
    let lock = st.lifecycle_lock(sandbox_id);
    let busy = lock.try_lock().is_err();
    if busy || st.host().cpu_time(sandbox_id).await.is_some() {
        return Ok(Hold::Releasing);
    }
    Ok(Hold::Free)
}

/// Who holds each volume: (volume, sandbox, path, mode, hold), without the
/// sandboxes that let go (whose records are dropped on the way).
async fn holders(st: &AppState) -> ApiResult<Vec<(String, String, Attachment, Hold)>> {
    let mut out = Vec::new();
    for (sandbox_id, list) in st.store().all_attachments(None)? {
        let h = hold(st, &sandbox_id).await?;
        if h == Hold::Free {
            if let Err(e) = st.store().drop_attachments(&sandbox_id) {
                tracing::warn!(sandbox_id = %sandbox_id, error = %e, "forgetting a sandbox's volumes failed");
            }
            continue;
        }
        for a in list {
            out.push((a.volume_id.clone(), sandbox_id.clone(), a, h));
        }
    }
    Ok(out)
}

fn answer(st: &AppState, d: &Volume, held: &[(String, String, Attachment, Hold)]) -> Value {
    use std::os::unix::fs::MetadataExt;
    let used = std::fs::metadata(file(st, &d.id))
        .map(|m| m.blocks() * 512)
        .unwrap_or(0);
    let attachments: Vec<Value> = held
        .iter()
        .filter(|(v, ..)| v == &d.id)
        .map(|(_, s, a, h)| {
            json!({"sandboxId": s, "path": a.path, "mode": a.mode.as_str(),
                   "state": if *h == Hold::Active { "attached" } else { "releasing" }})
        })
        .collect();
    json!({
        "id": d.id,
        "kind": "volume",
        "name": d.name,
        "labels": d.labels,
        "sizeMiB": d.size_mib,
        "usedBytes": used,
        "state": "ready",
        "region": "local",
        "createdAt": d.created_at,
        "attachments": attachments,
    })
}

pub async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let size = f.int("sizeMiB", MIN_SIZE_MIB, MAX_SIZE_MIB);
    if !f.present("sizeMiB") {
        f.issue("sizeMiB", "is required");
    }
    let name = checked_name(&mut f);
    let labels = checked_labels(&mut f).unwrap_or_default();
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, local");
        }
    }
    f.refuse("fromBackup", "backups are not supported by this server");
    f.refuse("shared", "shared disks are not supported by this server");
    f.finish()?;
    let size = size.unwrap_or(MIN_SIZE_MIB) as u32;
    let _g = st.inner.create_lock.lock().await;
    if let Some(n) = &name {
        if let Some(other) = all(&st)?
            .into_iter()
            .find(|d| visible(&ctx.key, d) && d.name.as_deref() == Some(n))
        {
            return Err(ApiError::Conflict {
                code: "name_taken",
                message: format!("A volume named {n} exists: {}.", other.id),
                details: Some(json!({"volumeId": other.id})),
            });
        }
    }
    let now = now_ms();
    let d = Volume {
        id: uuid::Uuid::new_v4().to_string(),
        key_id: ctx.key.id.clone(),
        name,
        labels,
        size_mib: size,
        created_at: iso(now),
        created_ms: now,
    };
    let path = file(&st, &d.id);
    let made = tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
            // QEMU reopens drives by path as its own uid (see the host).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
        }
        runtime_host::volume::create_volume_file(&path, size)
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: e.to_string(),
    })?;
    made.map_err(|e| ApiError::Failed {
        code: "volume_create_failed",
        message: format!("The volume's file could not be made: {e}"),
    })?;
    st.store().insert_volume(&d)?;
    tracing::info!(volume_id = %d.id, size_mib = size, "volume created");
    Ok(Reply::Json(StatusCode::CREATED, answer(&st, &d, &[])))
}

pub async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = find(&st, &ctx.key, &id)?;
    let held = holders(&st).await?;
    Reply::ok(answer(&st, &d, &held))
}

pub async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let name = f.string("name");
    let state = f.one_of("state", &["ready"]);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let _ = state;
    let held = holders(&st).await?;
    let mut rows: Vec<Volume> = all(&st)?
        .into_iter()
        .filter(|d| visible(&ctx.key, d))
        .filter(|d| name.as_ref().is_none_or(|n| d.name.as_ref() == Some(n)))
        .collect();
    let next =
        crate::http::extract::page_after(&mut rows, cursor.as_deref(), limit, |d| d.id.as_str())?;
    let data: Vec<Value> = rows.iter().map(|d| answer(&st, d, &held)).collect();
    Reply::ok(json!({ "data": data, "nextCursor": next }))
}

/// `POST /v1/volumes/{id}:delete` and `DELETE /v1/volumes/{id}`: refused
/// (409 `volume_in_use`) while a sandbox holds it; its bytes then go.
pub async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    if ctx.key.read_only {
        return Err(ApiError::Forbidden {
            action: "delete volumes",
        });
    }
    let _g = st.inner.create_lock.lock().await;
    let d = find(&st, &ctx.key, &id)?;
    if d.key_id != ctx.key.id && !ctx.key.account_wide {
        return Err(not_found(&id));
    }
    let held = holders(&st).await?;
    if let Some((_, sandbox_id, _, h)) = held.iter().find(|(v, ..)| v == &d.id) {
        return Err(ApiError::Conflict {
            code: "volume_in_use",
            message: format!(
                "Volume {} is {} sandbox {sandbox_id}; delete that sandbox first.",
                d.id,
                if *h == Hold::Active {
                    "attached to"
                } else {
                    "being released by"
                }
            ),
            details: Some(json!({"volumeId": d.id, "sandboxId": sandbox_id})),
        });
    }
    st.store().delete_volume(&d.id)?;
    if let Err(e) = std::fs::remove_file(file(&st, &d.id)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(volume_id = %d.id, error = %e, "removing the volume's file failed");
        }
    }
    tracing::info!(volume_id = %d.id, "volume deleted");
    Reply::ok(
        json!({"id": d.id, "kind": "volume", "name": d.name, "status": "deleted",
                     "deletedAt": iso(now_ms())}),
    )
}

pub async fn action(
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
        "resize" | "attach" | "backup" | "backup-policy" => {
            find(&st, &ctx.key, &id)?;
            Err(ApiError::Unsupported {
                feature: "this volume action",
            })
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/volumes/{id}:{verb}"),
        }),
    }
}

/// The `volumes` of a create, checked on their own (paths, modes, count).
pub fn parse_create(f: &mut Fields<'_>) -> Vec<Attachment> {
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

/// Resolves the create's volumes (ids or names) for `key` and checks that
/// no other sandbox holds an `rw` one; call under the create lock, then
/// [`keep`] once the sandbox exists.
pub async fn resolve(
    st: &AppState,
    key: &KeyInfo,
    wanted: &[Attachment],
) -> ApiResult<Vec<Attachment>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (i, a) in wanted.iter().enumerate() {
        let d = find(st, key, &a.volume_id)?;
        if out.iter().any(|b: &Attachment| b.volume_id == d.id) {
            return Err(ApiError::invalid(
                format!("volumes[{i}].volumeId"),
                "names a volume already attached by this create",
            ));
        }
        out.push(Attachment {
            volume_id: d.id,
            ..a.clone()
        });
    }
    let held = holders(st).await?;
    for a in out.iter().filter(|a| a.mode == AttachMode::Rw) {
        if let Some((_, sandbox_id, _, h)) = held
            .iter()
            .find(|(v, _, b, _)| v == &a.volume_id && b.mode == AttachMode::Rw)
        {
            return Err(match h {
                Hold::Releasing => ApiError::Conflict {
                    code: "volume_releasing",
                    message: format!(
                        "Volume {} is being released by sandbox {sandbox_id}; try again in a moment.",
                        a.volume_id
                    ),
                    details: Some(json!({"volumeId": a.volume_id, "sandboxId": sandbox_id})),
                },
                _ => ApiError::Conflict {
                    code: "volume_in_use",
                    message: format!(
                        "Volume {} is attached read-write to sandbox {sandbox_id}; one sandbox at a \
                         time may write it (attach it with mode \"snapshot\" for a private copy).",
                        a.volume_id
                    ),
                    details: Some(json!({"volumeId": a.volume_id, "sandboxId": sandbox_id})),
                },
            });
        }
    }
    // A snapshot view is a copy of the file: what a running writer has
    // written must be in the file first, not only in its guest's memory.
    for a in out.iter().filter(|a| a.mode == AttachMode::Snapshot) {
        for (_, sandbox_id, _, _) in held.iter().filter(|(v, _, b, h)| {
            v == &a.volume_id && b.mode == AttachMode::Rw && *h == Hold::Active
        }) {
            flush(st, sandbox_id).await;
        }
    }
    Ok(out)
}

/// Runs `sync` in a running sandbox (bounded; a failure only means the
/// view may miss the writer's latest writes).
async fn flush(st: &AppState, sandbox_id: &str) {
    use runtime_host::{ExecEvent, ExecSpec, RunAs};
    let spec = ExecSpec {
        argv: vec!["sync".into()],
        cwd: None,
        env: Vec::new(),
        user: RunAs::Root,
        timeout: Some(std::time::Duration::from_secs(30)),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
    };
    let Ok(mut handle) = st.host().exec(sandbox_id, spec).await else {
        return;
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(35), async {
        while let Some(ev) = handle.events.recv().await {
            if matches!(ev, ExecEvent::Exited(_)) {
                break;
            }
        }
    })
    .await;
}

/// Keeps a new sandbox's volumes (before its machine starts).
pub fn keep(st: &AppState, sandbox_id: &str, list: &[Attachment]) -> ApiResult<()> {
    if list.is_empty() {
        return Ok(());
    }
    st.store().set_attachments(sandbox_id, list)?;
    Ok(())
}

/// Refuses a copy of a sandbox with volumes (fork, memory snapshot).
pub fn refuse_copy(st: &AppState, sandbox_id: &str, what: &str) -> ApiResult<()> {
    if st.store().attachments_of(sandbox_id)?.is_empty() {
        return Ok(());
    }
    Err(ApiError::Conflict {
        code: "volume_attached",
        message: format!(
            "Sandbox {sandbox_id} has volumes attached; a {what} of it is not supported \
             (a copy would share the volume's drive)."
        ),
        details: Some(json!({"sandboxId": sandbox_id})),
    })
}
