//! Custom images (contract §11, docs/images.md): `POST /v1/images` with a
//! `recipe` or a `dockerfile`, `GET /v1/images[/{id}]`,
//! `/v1/images/resolve`, `/v1/images/{id}/logs`, `POST
//! /v1/images/{id}:delete` (and `DELETE`).

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::domain::image::context::{ContextRequest, MAX_DOCKERIGNORE_BYTES};
use crate::domain::image::{
    valid_tag, BuildLimits, Image, ImageState, InlineFile, LogLine, StepState,
};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{
    checked_labels, checked_name, json_object, no_fields, page_after, query_object, Fields,
};
use crate::http::reply::ndjson;
use crate::http::{Ctx, Reply};
use crate::service::images::{self, BuildSource, CreateImage, FollowEvent};
use crate::AppState;
use futures::StreamExt;

fn render(d: &Image, log: &[LogLine]) -> Value {
    let steps: Vec<Value> = d
        .steps
        .iter()
        .map(|s| {
            json!({"index": s.index, "instruction": s.instruction, "state": s.state,
                   "cached": s.state == StepState::Cached, "seconds": s.seconds})
        })
        .collect();
    let log: Vec<String> = log
        .iter()
        .map(|l| match l.step {
            Some(i) => format!("[{}] {}", i + 1, l.text),
            None => l.text.clone(),
        })
        .collect();
    json!({
        "id": d.id, "kind": "image", "name": d.name, "version": d.version, "tags": d.tags,
        "labels": d.labels, "state": d.state, "error": d.error, "source": d.source, "base": d.base,
        "pulled": d.pulled,
        "steps": steps, "env": d.env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        "workdir": d.workdir, "user": d.user, "start": d.start, "createdAt": d.created_at,
        "readyAt": d.ready_at, "buildSeconds": d.build_seconds, "log": log.join("\n"),
        "region": "local", "build": d.build,
    })
}

/// The body of `POST /v1/images` as a build.
fn parse_create(body: &[u8]) -> ApiResult<CreateImage> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let name = checked_name(&mut f);
    if let Some(n) = &name {
        if n.contains([':', '@', '/']) {
            f.issue("name", "may not contain ':', '@' or '/'");
        }
    }
    let labels = checked_labels(&mut f).unwrap_or_default();
    let tags = f.raw("tags").cloned();
    let recipe = f.raw("recipe").cloned();
    let dockerfile = f.string("dockerfile");
    let image = f.string("image");
    let files = f.raw("files").cloned();
    let build_args = f.string_map("buildArgs", 64).unwrap_or_default();
    let env = f.string_map("env", 64).unwrap_or_default();
    let start = f.raw("start").cloned();
    let build = build_limits(&mut f);
    // Accepted and ignored: every build uses the step cache.
    let _ = f.bool("cache");
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, local");
        }
    }
    let context = f.raw("context").cloned().filter(|c| !c.is_null());
    let dockerignore = f.string("dockerignore");
    let target = f.string("target").filter(|t| !t.is_empty());
    if dockerignore
        .as_ref()
        .is_some_and(|d| d.len() > MAX_DOCKERIGNORE_BYTES)
    {
        f.issue(
            "dockerignore",
            format!("at most {MAX_DOCKERIGNORE_BYTES} bytes"),
        );
    }
    if (recipe.is_some() || image.is_some()) && (context.is_some() || target.is_some()) {
        f.issue(
            if context.is_some() {
                "context"
            } else {
                "target"
            },
            "is for a dockerfile build, not a recipe or an image",
        );
    }
    if context.is_some() && files.as_ref().is_some_and(|f| !f.is_null()) {
        f.issue("files", "give files inline or a context, not both");
    }
    let sources = [recipe.is_some(), dockerfile.is_some(), image.is_some()];
    if sources.iter().filter(|s| **s).count() != 1 {
        f.issue("recipe", "give exactly one of image, recipe and dockerfile");
    }
    if image.as_ref().is_some_and(|i| i.trim().is_empty()) {
        f.issue(
            "image",
            "must be an image reference such as python:3.12-slim",
        );
    }
    let tags: Vec<String> = match tags {
        None | Some(Value::Null) => vec!["latest".to_string()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        Some(_) => {
            f.issue("tags", "must be a list of strings");
            Vec::new()
        }
    };
    if !tags.iter().all(|t| valid_tag(t)) {
        f.issue(
            "tags",
            "each tag is 1-128 characters without ':', '@', '/' or spaces",
        );
    }
    f.finish()?;
    let context = context
        .map(|c| ContextRequest::parse(&c))
        .transpose()
        .map_err(|e| ApiError::invalid("context", e.to_string()))?;
    let files: Vec<InlineFile> = match &files {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(InlineFile::parse)
            .collect::<Result<_, _>>()
            .map_err(|e| ApiError::invalid("files", e.to_string()))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "files",
                "must be a list of {path, content}",
            ))
        }
    };
    let source = match (recipe, dockerfile, image) {
        (Some(r), _, _) => BuildSource::Recipe(r),
        (None, Some(text), _) => BuildSource::Dockerfile(text),
        (None, None, Some(i)) => BuildSource::Image(i),
        // `finish` refused a body with none.
        (None, None, None) => {
            return Err(ApiError::invalid(
                "recipe",
                "give exactly one of image, recipe and dockerfile",
            ))
        }
    };
    Ok(CreateImage {
        name,
        labels,
        tags,
        source,
        files,
        build_args,
        env,
        // `null` drops the image's own (a Dockerfile's CMD, a registry
        // image's config).
        start,
        context,
        dockerignore,
        target,
        build,
    })
}

/// `build: {vcpu, memoryMiB, timeoutSeconds, maxImageMiB, diskMiB}`: each
/// absent one is its default.
fn build_limits(f: &mut Fields<'_>) -> BuildLimits {
    let mut out = BuildLimits::default();
    let Some(v) = f.raw("build") else {
        return out;
    };
    let Value::Object(obj) = v else {
        f.issue("build", "must be an object");
        return out;
    };
    let mut b = Fields::nested(obj, "build");
    let take = |b: &mut Fields<'_>, name: &str, (lo, hi): (u32, u32), slot: &mut u32| {
        if let Some(n) = b.int(name, i64::from(lo), i64::from(hi)) {
            *slot = u32::try_from(n).unwrap_or(*slot);
        }
    };
    take(&mut b, "vcpu", BuildLimits::VCPU, &mut out.vcpu);
    take(
        &mut b,
        "memoryMiB",
        BuildLimits::MEMORY_MIB,
        &mut out.memory_mib,
    );
    take(
        &mut b,
        "timeoutSeconds",
        BuildLimits::TIMEOUT_SECONDS,
        &mut out.timeout_seconds,
    );
    take(
        &mut b,
        "maxImageMiB",
        BuildLimits::MAX_IMAGE_MIB,
        &mut out.max_image_mib,
    );
    take(&mut b, "diskMiB", BuildLimits::DISK_MIB, &mut out.disk_mib);
    f.absorb(b);
    out
}

pub(super) async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let cmd = parse_create(&body)?;
    let d = images::create(&st, &ctx.key, cmd).await?;
    Ok(Reply::Json(StatusCode::CREATED, render(&d, &[])))
}

pub(super) async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let v = images::get(&st, &ctx.key, &id)?;
    Reply::ok(render(&v.image, &v.log))
}

pub(super) async fn resolve(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let r = ctx
        .query
        .iter()
        .find(|(k, _)| k == "ref")
        .map(|(_, v)| v.clone())
        .ok_or_else(|| ApiError::invalid("ref", "is required"))?;
    let v = images::find(&st, &ctx.key, &r)?;
    Reply::ok(render(&v.image, &v.log))
}

pub(super) async fn logs(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let after = f.q_int("after", 0, i64::MAX).unwrap_or(0) as u64;
    let follow = f.q_bool("follow").unwrap_or(false);
    f.finish()?;
    if follow {
        let events = images::follow(&st, &ctx.key, &id, after)?.map(|batch| {
            batch
                .into_iter()
                .map(|e| match e {
                    FollowEvent::Line(l) => json!({"type": "line", "seq": l.seq, "step": l.step,
                                                   "stream": l.stream, "text": l.text}),
                    FollowEvent::Done(v) => {
                        json!({"type": "done", "image": render(&v.image, &v.log)})
                    }
                    FollowEvent::Continue(after) => json!({"type": "continue", "after": after}),
                    FollowEvent::Error(e) => json!({"type": "error",
                        "error": {"code": e.code(), "message": e.to_string()}}),
                })
                .collect::<Vec<Value>>()
        });
        return Ok(Reply::Raw(ndjson(events, st.config().heartbeat)));
    }
    let v = images::get(&st, &ctx.key, &id)?;
    let lines: Vec<Value> = v
        .log
        .iter()
        .filter(|l| l.seq > after)
        .map(|l| json!({"seq": l.seq, "step": l.step, "stream": l.stream, "text": l.text}))
        .collect();
    let next = v.log.last().map_or(after, |l| l.seq.max(after));
    Reply::ok(json!({"lines": lines, "nextAfter": next,
                     "done": !v.image.state.in_progress()}))
}

pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let name = f.string("name");
    let state = f
        .one_of("state", &["queued", "building", "ready", "failed"])
        .and_then(|s| ImageState::parse(&s));
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let mut rows = images::list(&st, &ctx.key, name.as_deref(), state)?;
    let next = page_after(&mut rows, cursor.as_deref(), limit, |d| d.id.as_str())?;
    let mut data: Vec<Value> = Vec::with_capacity(rows.len());
    for d in rows {
        let v = images::view(&st, d)?;
        data.push(render(&v.image, &v.log));
    }
    Reply::ok(json!({"data": data, "nextCursor": next}))
}

/// `POST /v1/images/{id}:delete` and `DELETE /v1/images/{id}`.
pub(super) async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    images::delete(&st, &ctx.key, &id).await?;
    Reply::ok(json!({"id": id, "kind": "image", "status": "deleted"}))
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
        "tag" | "untag" => {
            let obj = json_object(&body)?;
            let mut f = Fields::new(&obj);
            let tag = f.string("tag");
            match &tag {
                None => f.issue("tag", "is required"),
                Some(t) if !valid_tag(t) => {
                    f.issue("tag", "is 1-128 characters without ':', '@', '/' or spaces")
                }
                Some(_) => {}
            }
            f.finish()?;
            let tag = tag.unwrap_or_default();
            let d = images::tag(&st, &ctx.key, &id, &tag, verb == "tag").await?;
            let v = images::view(&st, d)?;
            Reply::ok(render(&v.image, &v.log))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/images/{id}:{verb}"),
        }),
    }
}

/// `POST /v1/images:prune` (admin keys): removes the layers and blobs no
/// image uses.
pub(super) async fn prune(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    no_fields(&body)?;
    let p = images::prune_for(&st, &ctx.key).await?;
    Reply::ok(json!({"removedLayers": p.layers, "removedBlobs": p.blobs, "freedBytes": p.bytes}))
}

/// `POST /v1/images/context/missing` `{digests: [...]}`: `{missing: [...]}`,
/// the caller's own chunks only.
pub(super) async fn context_missing(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let digests = f.raw("digests").cloned();
    let digests: Vec<String> = match digests {
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|d| d.as_str().map(str::to_string))
            .collect(),
        _ => {
            f.issue("digests", "must be a list of SHA-256 digests");
            Vec::new()
        }
    };
    f.finish()?;
    let missing = images::context::missing(&st, &ctx.key, &digests)?;
    Reply::ok(json!({ "missing": missing }))
}

/// `PUT /v1/images/context/{sha256}` with the chunk's raw bytes.
pub(super) async fn context_put(
    st: AppState,
    ctx: Ctx,
    sha: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let v = images::context::put(&st, &ctx.key, &sha, &body)?;
    Reply::ok(v)
}
