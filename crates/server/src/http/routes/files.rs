//! Files and chunked uploads (contract §7): `…/files/content`, `/list`,
//! `/stat`, `files:{mkdir,remove,rename,chmod}`, `…/uploads`, and folder
//! archives (`…/files/archive`, `…/files/archive/uploads`).

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use runtime_host::{EntryKind, FileEntry, FileOp};
use serde_json::{json, Value};

use crate::domain::access::sha256_hex;
use crate::domain::files::{list_depth, valid_path, CHUNK_BYTES, MAX_ARCHIVE_BYTES, MAX_GLOB};
use crate::domain::link;
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, parse_mode, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::{archives, files, links, uploads};
use crate::AppState;

const USERS: &[&str] = &["sandbox", "root"];

fn check_path(f: &mut Fields<'_>, name: &str, p: Option<String>) -> String {
    match p {
        Some(p) if valid_path(&p) => p,
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

fn mode_field(f: &mut Fields<'_>) -> Option<u32> {
    let v = f.raw("mode")?;
    let m = parse_mode(v);
    if m.is_none() {
        f.issue("mode", "must be octal permission digits such as \"644\"");
    }
    m
}

fn entry_json(e: &FileEntry) -> Value {
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

/// `GET …/files/content?path&user`: the bytes, with their length in a
/// header, and for a file of at most [`CHUNK_BYTES`] their SHA-256 too
/// (read whole first). A larger file streams as the guest sends it, never
/// held whole; one that fails part way cuts the stream, which the client
/// sees as short of its length.
pub(super) async fn read(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let user = f.one_of("user", USERS);
    f.finish()?;
    let mut fs = files::read_stream(&st, &ctx.key, &id, &path, user.as_deref()).await?;
    let size = fs.size;
    let mut resp = Response::new(Body::from(Bytes::new()));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&size.to_string()) {
        h.insert("x-content-length", v);
    }
    if size <= CHUNK_BYTES as u64 {
        let mut data = Vec::with_capacity(size as usize);
        while let Some(piece) = fs.pieces.recv().await {
            data.extend_from_slice(&piece?);
        }
        if let Ok(v) = HeaderValue::from_str(&sha256_hex(&data)) {
            resp.headers_mut().insert("x-content-sha256", v);
        }
        *resp.body_mut() = Body::from(data);
    } else {
        let stream = futures::stream::unfold(fs.pieces, |mut rx| async move {
            let piece = rx.recv().await?;
            Some((piece.map(Bytes::from).map_err(std::io::Error::other), rx))
        });
        *resp.body_mut() = Body::from_stream(stream);
    }
    Ok(Reply::Raw(resp))
}

/// `GET …/files/archive?path&gzip&user&exclude*`: the folder as a tar
/// stream, gzipped unless `gzip=false`.
pub(super) async fn archive_get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &["exclude"]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let gzip = f.q_bool("gzip").unwrap_or(true);
    let user = f.one_of("user", USERS);
    let mut exclude = Vec::new();
    if let Some(Value::Array(a)) = f.raw("exclude") {
        for e in a.iter().filter_map(Value::as_str) {
            let rel = e.trim_start_matches("./").trim_end_matches('/');
            if rel.is_empty() || rel.starts_with('/') || rel.split('/').any(|c| c == "..") {
                f.issue("exclude", format!("{e} is not a path inside the folder"));
            } else {
                exclude.push(rel.to_string());
            }
        }
    }
    f.finish()?;
    let pack = archives::Pack {
        path,
        gzip,
        user,
        exclude,
    };
    let stream = archives::pack(&st, &ctx.key, &id, pack).await?;
    let stream = futures::StreamExt::map(stream, |r| r.map(Bytes::from));
    let mut resp = Response::new(Body::from_stream(stream));
    let kind = if gzip {
        "application/gzip"
    } else {
        "application/x-tar"
    };
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    Ok(Reply::Raw(resp))
}

/// `PUT …/files/archive?path&user`: the body is a tar (gzipped or not),
/// unpacked into the folder.
pub(super) async fn archive_put(
    st: AppState,
    ctx: Ctx,
    id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let user = f.one_of("user", USERS);
    f.finish()?;
    let size =
        archives::unpack(&st, &ctx.key, &id, &path, user.as_deref(), Vec::from(body)).await?;
    Reply::ok(json!({ "path": path, "size": size }))
}

/// `PUT …/files/content?path&mode&user`: the body is the whole file.
pub(super) async fn write(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let mode = mode_field(&mut f);
    let user = f.one_of("user", USERS);
    f.finish()?;
    let w = files::Write {
        path,
        mode,
        user,
        data: Vec::from(body),
    };
    let done = files::write(&st, &ctx.key, &id, w).await?;
    Reply::ok(json!({ "path": done.path, "size": done.size, "sha256": done.sha256 }))
}

/// `files:link {path, method, expiresInSeconds, filename, wake, archive,
/// maxBytes}`: a URL that downloads (`GET`) or uploads (`PUT`) without a key.
fn link(
    st: &AppState,
    ctx: &Ctx,
    id: &str,
    obj: &serde_json::Map<String, Value>,
) -> ApiResult<Reply> {
    let mut f = Fields::new(obj);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let method = f
        .one_of("method", &["GET", "PUT"])
        .unwrap_or_else(|| "GET".into());
    let ttl_seconds = f
        .int("expiresInSeconds", 1, link::MAX_TTL_SECONDS)
        .unwrap_or(link::DEFAULT_TTL_SECONDS);
    let filename = f.string("filename");
    if let Some(why) = filename.as_deref().and_then(link::filename_problem) {
        f.issue("filename", why);
    }
    let wake = f.bool("wake").unwrap_or(true);
    let archive = f.bool("archive").unwrap_or(false);
    let max_bytes = f.int("maxBytes", 1, CHUNK_BYTES as i64).map(|n| n as u64);
    if method == "PUT" {
        if archive {
            f.issue("archive", "is for downloads (method GET)");
        }
        if filename.is_some() {
            f.issue("filename", "is for downloads (method GET)");
        }
    } else if max_bytes.is_some() {
        f.issue("maxBytes", "is for uploads (method PUT)");
    }
    f.finish()?;
    let req = links::NewLink {
        path,
        method,
        ttl_seconds,
        filename,
        max_bytes,
        wake,
        archive,
    };
    let (l, token) = links::create(st, &ctx.key, id, req)?;
    let host = ctx
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| format!("127.0.0.1:{}", st.config().preview_port));
    let scheme = if st.config().tls.is_some() {
        "https"
    } else {
        "http"
    };
    let url = format!("{scheme}://{host}/v1/links/{token}");
    // Replayed whole: the client reads `url` from every answer.
    Ok(Reply::Json(StatusCode::CREATED, l.wire(&url)))
}

/// `GET …/files/list?path&depth&glob&hidden&limit&user`.
pub(super) async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path").or_else(|| Some("/workspace".into()));
    let path = check_path(&mut f, "path", p);
    let depth = f.q_int("depth", 1, 64);
    let glob = f.string("glob").filter(|g| !g.is_empty());
    if glob.as_ref().is_some_and(|g| g.len() > MAX_GLOB) {
        f.issue("glob", format!("must be at most {MAX_GLOB} bytes"));
    }
    let hidden = f.q_bool("hidden").unwrap_or(false);
    let limit = f.q_int("limit", 1, 100_000).unwrap_or(10_000) as u32;
    let user = f.one_of("user", USERS);
    f.finish()?;
    let l = files::List {
        path,
        depth: list_depth(depth, glob.as_deref()),
        glob,
        hidden,
        limit,
        user,
    };
    let (entries, truncated) = files::list(&st, &ctx.key, &id, l).await?;
    let data: Vec<Value> = entries.iter().map(entry_json).collect();
    Reply::ok(json!({ "data": data, "truncated": truncated }))
}

/// `GET …/files/stat?path&user`.
pub(super) async fn stat(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let user = f.one_of("user", USERS);
    f.finish()?;
    match files::stat(&st, &ctx.key, &id, path, user.as_deref()).await? {
        None => Reply::ok(json!({ "exists": false })),
        Some(e) => {
            let mut v = entry_json(&e);
            v["exists"] = Value::Bool(true);
            Reply::ok(v)
        }
    }
}

/// `POST …/files:{mkdir,remove,rename,chmod}`.
pub(super) async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    match verb.as_str() {
        "link" => return link(&st, &ctx, &id, &obj),
        "revoke-links" => {
            Fields::new(&obj).finish()?;
            let n = links::revoke_all(&st, &ctx.key, &id)?;
            return Reply::ok(json!({ "revoked": n }));
        }
        _ => {}
    }
    let mut f = Fields::new(&obj);
    let user = f.one_of("user", USERS);
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
    let removed = files::act(&st, &ctx.key, &id, op, user.as_deref()).await?;
    let mut answer = answer;
    if let Some(r) = removed {
        answer["removed"] = Value::Bool(r);
    }
    Reply::ok(answer)
}

/// `POST …/uploads`: `{path, size, sha256, mode?, user?}`.
pub(super) async fn upload_begin(
    st: AppState,
    ctx: Ctx,
    id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let max = uploads::max_bytes(&st);
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
    let user = f.one_of("user", USERS);
    f.finish()?;
    let b = uploads::Begin {
        path,
        size: size.unwrap_or(0) as u64,
        sha256: sha.unwrap_or_default(),
        mode,
        user,
    };
    let upload_id = uploads::begin(&st, &ctx.key, &id, b).await?;
    let mut answer = json!({ "uploadId": upload_id, "chunkBytes": CHUNK_BYTES });
    if let Some(m) = mode {
        answer["mode"] = json!(format!("{m:03o}"));
    }
    Ok(Reply::Json(StatusCode::CREATED, answer))
}

/// The `offset` a chunk's `PUT` must name.
fn chunk_offset(ctx: &Ctx) -> ApiResult<u64> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let offset = f.q_int("offset", 0, i64::MAX);
    if !f.present("offset") {
        f.issue("offset", "is required");
    }
    f.finish()?;
    Ok(offset.unwrap_or(0) as u64)
}

/// `PUT …/uploads/{u}?offset=`: the body is one chunk.
pub(super) async fn upload_chunk(
    st: AppState,
    ctx: Ctx,
    id: String,
    upload_id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let offset = chunk_offset(&ctx)?;
    let len = body.len();
    uploads::chunk(&st, &ctx.key, &id, &upload_id, offset, Vec::from(body)).await?;
    Reply::ok(json!({ "uploadId": upload_id, "offset": offset, "size": len }))
}

/// `POST …/uploads/{u}:{commit,abort}`.
pub(super) async fn upload_action(
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
            let c = uploads::commit(&st, &ctx.key, &id, &upload_id).await?;
            Reply::ok(
                json!({ "path": c.path, "size": c.size, "sha256": c.sha256, "committed": true }),
            )
        }
        "abort" => {
            uploads::abort(&st, &ctx.key, &id, &upload_id, false).await?;
            Reply::ok(json!({ "uploadId": upload_id, "aborted": true }))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/uploads/{upload_id}:{verb}"),
        }),
    }
}

/// `POST …/files/archive/uploads`: `{path, gzip?, user?}`.
pub(super) async fn archive_upload_begin(
    st: AppState,
    ctx: Ctx,
    id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let p = f.string("path");
    let path = check_path(&mut f, "path", p);
    let gzip = f.bool("gzip").unwrap_or(true);
    let user = f.one_of("user", USERS);
    f.finish()?;
    let b = uploads::BeginArchive { path, gzip, user };
    let upload_id = uploads::begin_archive(&st, &ctx.key, &id, b).await?;
    Ok(Reply::Json(
        StatusCode::CREATED,
        json!({
            "uploadId": upload_id,
            "chunkBytes": CHUNK_BYTES,
            "maxBytes": MAX_ARCHIVE_BYTES,
        }),
    ))
}

/// `PUT …/files/archive/uploads/{u}?offset=`: the body is the next chunk.
pub(super) async fn archive_upload_chunk(
    st: AppState,
    ctx: Ctx,
    id: String,
    upload_id: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let offset = chunk_offset(&ctx)?;
    let len = body.len();
    let received =
        uploads::archive_chunk(&st, &ctx.key, &id, &upload_id, offset, Vec::from(body)).await?;
    Reply::ok(json!({ "uploadId": upload_id, "offset": offset, "size": len, "received": received }))
}

/// `POST …/files/archive/uploads/{u}:{commit,abort}`.
pub(super) async fn archive_upload_action(
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
            let (path, size) = uploads::commit_archive(&st, &ctx.key, &id, &upload_id).await?;
            Reply::ok(json!({ "path": path, "size": size, "committed": true }))
        }
        "abort" => {
            uploads::abort(&st, &ctx.key, &id, &upload_id, true).await?;
            Reply::ok(json!({ "uploadId": upload_id, "aborted": true }))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/files/archive/uploads/{upload_id}:{verb}"),
        }),
    }
}
