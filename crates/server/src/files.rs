//! Files (contract §7): content, list, stat, mkdir/remove/rename/chmod, and
//! chunked uploads written at their offsets into a file under the data dir.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use runtime_api::codes;
use runtime_host::{EntryKind, FileEntry, FileOp, FileOpResult, RunAs};
use serde_json::{json, Value};

use crate::domain::access::sha256_hex;
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult, ServerError};
use crate::http::extract::{json_object, no_fields, parse_mode, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::sandboxes::find_running;
use crate::store::SandboxRow;
use crate::AppState;

/// Largest `PUT …/files/content` body, and the chunk size of uploads.
pub const CHUNK_BYTES: usize = 1 << 20;

fn user_of(row: &SandboxRow, asked: Option<String>) -> RunAs {
    match asked.as_deref().unwrap_or(row.record.user.as_str()) {
        "root" => RunAs::Root,
        _ => RunAs::Sandbox,
    }
}

fn check_path(f: &mut Fields<'_>, name: &str, p: Option<String>) -> String {
    match p {
        Some(p) if p.starts_with('/') && !p.contains('\0') => p,
        Some(_) => {
            f.issue(name, "must be an absolute path");
            String::new()
        }
        None => {
            f.issue(name, "is required");
            String::new()
        }
    }
}

pub fn entry_json(e: &FileEntry) -> Value {
    let kind = match e.kind {
        EntryKind::File => "file",
        EntryKind::Directory => "directory",
        EntryKind::Symlink => "symlink",
        EntryKind::Other => "other",
    };
    json!({
        "name": e.name,
        "path": e.path,
        "type": kind,
        "size": e.size,
        "mode": format!("{:03o}", e.mode & 0o7777),
        "modifiedAt": iso(e.modified.saturating_mul(1000)),
    })
}

pub async fn read(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let user = f.one_of("user", &["sandbox", "root"]);
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    let data = st.host().read_file(&id, &path, user_of(&row, user)).await?;
    let mut resp = Response::new(Body::from(Bytes::new()));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&data.len().to_string()) {
        h.insert("x-content-length", v);
    }
    if let Ok(v) = HeaderValue::from_str(&sha256_hex(&data)) {
        h.insert("x-content-sha256", v);
    }
    *resp.body_mut() = Body::from(data);
    Ok(Reply::Raw(resp))
}

pub async fn write(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let mode = mode_field(&mut f);
    let user = f.one_of("user", &["sandbox", "root"]);
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    let size = body.len();
    let sha = sha256_hex(&body);
    st.host()
        .write_file(&id, &path, mode, user_of(&row, user), body.to_vec())
        .await?;
    Reply::ok(json!({ "path": path, "size": size, "sha256": sha }))
}

fn mode_field(f: &mut Fields<'_>) -> Option<u32> {
    let v = f.raw("mode")?;
    let m = parse_mode(v);
    if m.is_none() {
        f.issue("mode", "must be octal permission digits such as \"644\"");
    }
    m
}

/// Shell-style match: `*` and `?` within a segment, `**` across segments.
fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    match pat.first() {
        None => s.is_empty(),
        Some(b'*') if pat.get(1) == Some(&b'*') => {
            let rest = pat[2..].strip_prefix(b"/").unwrap_or(&pat[2..]);
            (0..=s.len()).any(|i| glob_match(rest, &s[i..]))
        }
        Some(b'*') => (0..=s.len())
            .take_while(|&i| i == 0 || s[i - 1] != b'/')
            .any(|i| glob_match(&pat[1..], &s[i..])),
        Some(b'?') => !s.is_empty() && s[0] != b'/' && glob_match(&pat[1..], &s[1..]),
        Some(c) => s.first() == Some(c) && glob_match(&pat[1..], &s[1..]),
    }
}

pub async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path").or_else(|| Some("/workspace".into()));
    let path = check_path(&mut f, "path", p);
    let depth = f.q_int("depth", 1, 64);
    let glob = f.string("glob").filter(|g| !g.is_empty());
    let hidden = f.q_bool("hidden").unwrap_or(false);
    let limit = f.q_int("limit", 1, 100_000).unwrap_or(10_000) as u32;
    let user = f.one_of("user", &["sandbox", "root"]);
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    // A glob with `/` or `**` looks deeper than the first level by default.
    let depth = depth.unwrap_or(match &glob {
        Some(g) if g.contains("**") => 64,
        Some(g) => g.matches('/').count() as i64 + 1,
        None => 1,
    }) as u32;
    let op = FileOp::List {
        path: path.clone(),
        depth,
        hidden,
        limit: if glob.is_some() { 100_000 } else { limit },
    };
    let (entries, truncated) = match st.host().file_op(&id, op, user_of(&row, user)).await? {
        FileOpResult::Listing { entries, truncated } => (entries, truncated),
        other => {
            return Err(ApiError::Internal {
                what: format!("list answered {other:?}"),
            })
        }
    };
    let root = path.trim_end_matches('/');
    let data: Vec<Value> = entries
        .iter()
        .filter(|e| match &glob {
            None => true,
            Some(g) => {
                let rel = e
                    .path
                    .strip_prefix(root)
                    .unwrap_or(&e.path)
                    .trim_start_matches('/');
                let target = if g.contains('/') {
                    rel
                } else {
                    e.name.as_str()
                };
                glob_match(g.as_bytes(), target.as_bytes())
            }
        })
        .take(limit as usize)
        .map(entry_json)
        .collect();
    Reply::ok(json!({ "data": data, "truncated": truncated }))
}

pub async fn stat(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let user = f.one_of("user", &["sandbox", "root"]);
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    match st
        .host()
        .file_op(&id, FileOp::Stat { path }, user_of(&row, user))
        .await?
    {
        FileOpResult::Stat(None) => Reply::ok(json!({ "exists": false })),
        FileOpResult::Stat(Some(e)) => {
            let mut v = entry_json(&e);
            v["exists"] = Value::Bool(true);
            Reply::ok(v)
        }
        other => Err(ApiError::Internal {
            what: format!("stat answered {other:?}"),
        }),
    }
}

pub async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let user = f.one_of("user", &["sandbox", "root"]);
    let (op, answer) = match verb.as_str() {
        "mkdir" => {
            let p = f.string("path");
            let path = check_path(&mut f, "path", p);
            let parents = f.bool("parents").unwrap_or(true);
            (
                FileOp::Mkdir {
                    path: path.clone(),
                    parents,
                },
                json!({ "path": path }),
            )
        }
        "remove" => {
            let p = f.string("path");
            let path = check_path(&mut f, "path", p);
            let recursive = f.bool("recursive").unwrap_or(false);
            (
                FileOp::Remove {
                    path: path.clone(),
                    recursive,
                },
                json!({ "path": path }),
            )
        }
        "rename" => {
            let p = f.string("from");
            let from = check_path(&mut f, "from", p);
            let p = f.string("to");
            let to = check_path(&mut f, "to", p);
            let overwrite = f.bool("overwrite").unwrap_or(false);
            (
                FileOp::Rename {
                    from: from.clone(),
                    to: to.clone(),
                    overwrite,
                },
                json!({ "from": from, "to": to }),
            )
        }
        "chmod" => {
            let p = f.string("path");
            let path = check_path(&mut f, "path", p);
            let mode = mode_field(&mut f);
            if !f.present("mode") {
                f.issue("mode", "is required");
            }
            let mode = mode.unwrap_or(0o644);
            (
                FileOp::Chmod {
                    path: path.clone(),
                    mode,
                },
                json!({ "path": path, "mode": format!("{mode:03o}") }),
            )
        }
        _ => {
            return Err(ApiError::RouteNotFound {
                method: "POST".into(),
                path: format!("/v1/sandboxes/{id}/files:{verb}"),
            })
        }
    };
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    let result = st.host().file_op(&id, op, user_of(&row, user)).await?;
    let mut answer = answer;
    match result {
        FileOpResult::Removed(r) => answer["removed"] = Value::Bool(r),
        _ if verb == "remove" => answer["removed"] = Value::Bool(true),
        _ => {}
    }
    Reply::ok(answer)
}

// ---- chunked uploads ----

struct Upload {
    path: String,
    size: u64,
    sha256: String,
    mode: Option<u32>,
    user: RunAs,
    file: PathBuf,
    /// offset -> length of each chunk received.
    received: BTreeMap<u64, u64>,
}

/// The sandbox an upload belongs to, and the upload.
type UploadSlot = (String, Arc<tokio::sync::Mutex<Upload>>);

pub struct Uploads {
    dir: PathBuf,
    map: Mutex<HashMap<String, UploadSlot>>,
}

impl Uploads {
    pub fn new(dir: PathBuf) -> Self {
        Uploads {
            dir,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, UploadSlot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn sandbox_gone(&self, sandbox_id: &str) {
        let gone: Vec<String> = {
            let mut m = self.lock();
            let ids: Vec<String> = m
                .iter()
                .filter(|(_, (s, _))| s == sandbox_id)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &ids {
                m.remove(k);
            }
            ids
        };
        for id in gone {
            let _ = std::fs::remove_file(self.dir.join(&id));
        }
    }

    fn get(&self, sandbox_id: &str, upload_id: &str) -> ApiResult<Arc<tokio::sync::Mutex<Upload>>> {
        match self.lock().get(upload_id) {
            Some((s, u)) if s == sandbox_id => Ok(u.clone()),
            _ => Err(ApiError::NotFound {
                code: codes::UPLOAD_NOT_FOUND,
                what: "upload",
                id: upload_id.to_string(),
            }),
        }
    }
}

fn io_err(op: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ApiError {
    let path = path.display().to_string();
    move |source| ApiError::Server(ServerError::Io { op, path, source })
}

pub async fn upload_begin(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let max = st.config().max_upload_bytes;
    let size = f.int("size", 0, max as i64);
    if !f.present("size") {
        f.issue("size", "is required");
    }
    let sha = f.string("sha256").map(|s| s.to_ascii_lowercase());
    match &sha {
        Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => {}
        Some(_) => f.issue("sha256", "must be 64 hex digits"),
        None => f.issue("sha256", "is required"),
    }
    let mode = mode_field(&mut f);
    let user = f.one_of("user", &["sandbox", "root"]);
    f.finish()?;
    let row = find_running(&st, &ctx.key, &id).await?;
    let upload_id = format!("upl_{}", uuid::Uuid::new_v4().simple());
    let dir = st.inner.uploads.dir.clone();
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(io_err("create uploads dir", &dir))?;
    let file = dir.join(&upload_id);
    let size = size.unwrap_or(0) as u64;
    let fh = tokio::fs::File::create(&file)
        .await
        .map_err(io_err("create upload file", &file))?;
    fh.set_len(size)
        .await
        .map_err(io_err("size upload file", &file))?;
    let up = Upload {
        path,
        size,
        sha256: sha.unwrap_or_default(),
        mode,
        user: user_of(&row, user),
        file,
        received: BTreeMap::new(),
    };
    st.inner.uploads.lock().insert(
        upload_id.clone(),
        (id.clone(), Arc::new(tokio::sync::Mutex::new(up))),
    );
    let mut answer = json!({ "uploadId": upload_id, "chunkBytes": CHUNK_BYTES });
    if let Some(m) = mode {
        answer["mode"] = json!(format!("{m:03o}"));
    }
    Ok(Reply::Json(StatusCode::CREATED, answer))
}

pub async fn upload_chunk(
    st: AppState,
    ctx: Ctx,
    id: String,
    upload_id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let offset = f.q_int("offset", 0, i64::MAX);
    if !f.present("offset") {
        f.issue("offset", "is required");
    }
    f.finish()?;
    find_running(&st, &ctx.key, &id).await?;
    let up = st.inner.uploads.get(&id, &upload_id)?;
    let mut u = up.lock().await;
    let offset = offset.unwrap_or(0) as u64;
    let len = body.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > u.size) {
        return Err(ApiError::invalid(
            "offset",
            format!("offset + chunk length is past the size ({})", u.size),
        ));
    }
    let file = u.file.clone();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&file)?;
        f.write_all_at(&body, offset)
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: format!("upload write task: {e}"),
    })?
    .map_err(io_err("write upload chunk", &u.file))?;
    u.received.insert(offset, len);
    Reply::ok(json!({ "uploadId": upload_id, "offset": offset, "size": len }))
}

fn covered(received: &BTreeMap<u64, u64>) -> u64 {
    let mut end = 0u64;
    for (&o, &l) in received {
        if o > end {
            break;
        }
        end = end.max(o + l);
    }
    end
}

pub async fn upload_action(
    st: AppState,
    ctx: Ctx,
    id: String,
    upload_id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    no_fields(&body)?;
    match verb.as_str() {
        "commit" => {
            find_running(&st, &ctx.key, &id).await?;
            let up = st.inner.uploads.get(&id, &upload_id)?;
            let u = up.lock().await;
            let have = covered(&u.received);
            if have < u.size {
                return Err(ApiError::Conflict {
                    code: codes::UPLOAD_INCOMPLETE,
                    message: format!("The upload has bytes up to {have} of {}.", u.size),
                    details: Some(json!({ "receivedThrough": have, "size": u.size })),
                });
            }
            let data = tokio::fs::read(&u.file)
                .await
                .map_err(io_err("read upload file", &u.file))?;
            let got = sha256_hex(&data);
            if got != u.sha256 {
                return Err(ApiError::Unprocessable {
                    code: codes::CHECKSUM_MISMATCH,
                    message: "The uploaded bytes do not match the sha256 given at the start."
                        .into(),
                    details: Some(json!({ "expected": u.sha256, "actual": got })),
                });
            }
            st.host()
                .write_file(&id, &u.path, u.mode, u.user, data)
                .await?;
            let _ = tokio::fs::remove_file(&u.file).await;
            st.inner.uploads.lock().remove(&upload_id);
            Reply::ok(
                json!({ "path": u.path, "size": u.size, "sha256": u.sha256, "committed": true }),
            )
        }
        "abort" => {
            crate::service::sandboxes::find(&st, &ctx.key, &id)?;
            let up = st.inner.uploads.get(&id, &upload_id)?;
            let u = up.lock().await;
            let _ = tokio::fs::remove_file(&u.file).await;
            st.inner.uploads.lock().remove(&upload_id);
            Reply::ok(json!({ "uploadId": upload_id, "aborted": true }))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/uploads/{upload_id}:{verb}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(b"*.py", b"a.py"));
        assert!(!glob_match(b"*.py", b"d/a.py"));
        assert!(glob_match(b"**/*.py", b"d/e/a.py"));
        assert!(glob_match(b"**/*.py", b"a.py"));
        assert!(glob_match(b"a?c", b"abc"));
    }

    #[test]
    fn coverage() {
        let mut r = BTreeMap::new();
        r.insert(4, 4);
        assert_eq!(covered(&r), 0);
        r.insert(0, 4);
        assert_eq!(covered(&r), 8);
    }
}
