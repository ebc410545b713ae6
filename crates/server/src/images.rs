//! Custom images (contract §11): `POST /v1/images` with a `recipe` or a
//! `dockerfile`, `GET /v1/images[/{id}]`, `/v1/images/resolve`,
//! `/v1/images/{id}/logs`, `POST /v1/images/{id}:delete`.
//!
//! A build is a list of steps, each named by a key that hashes the key
//! before it with the step itself and the build state it runs in (env,
//! workdir, user): a hash chain starting at the base image's key. The disk
//! after each step is kept as a layer, `data_dir/images/layers/<key>/
//! disk.qcow2` (a qcow2 overlay on the layer it started from, or on the
//! base image). A build finds the longest prefix of its steps already kept,
//! boots one build machine on that layer, and runs the rest one by one as
//! commands in it (network through the egress proxy like any sandbox's, no
//! egress secrets), capturing the disk after each. A sandbox created with
//! the image boots (or restores its own template) on the last layer.

use std::path::PathBuf;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use runtime_host::RunAs;
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::image::steps::{self, BuildState, StepOutput, Steps};
use crate::domain::image::{
    dockerfile, recipe, start_argv, tags_on_ready, valid_tag, Image, ImageError, ImageRef,
    ImageState, ImageUser, InlineFile, LogLine, LogStream, Source, Step, StepState,
};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::AppState;

/// Most log lines an image keeps (the newest are dropped past it).
const MAX_LOG_LINES: usize = 5000;
const STEP_TIMEOUT: Duration = Duration::from_secs(1800);

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: "image_not_found",
        what: "image",
        id: id.to_string(),
    }
}

fn layers(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("layers")
}

/// The disk of a layer (`None` for the base image's own key).
pub fn layer_disk(st: &AppState, key: &str) -> PathBuf {
    layers(st).join(key).join("disk.qcow2")
}

fn root_key() -> String {
    format!("base-{}", runtime_host::artifacts::rootfs_key())
}

fn visible(key: &KeyInfo, d: &Image) -> bool {
    crate::domain::access::visible(key, &d.key_id)
}

fn load(st: &AppState, id: &str) -> ApiResult<Option<Image>> {
    Ok(st.store().get_image(id)?)
}

fn all(st: &AppState) -> ApiResult<Vec<Image>> {
    Ok(st.store().images()?)
}

fn log_of(st: &AppState, id: &str) -> ApiResult<Vec<LogLine>> {
    Ok(st.store().image_log(id)?)
}

/// An image by id, `name`, `name:tag` or `name@version`, as `key` sees it.
fn resolve(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<Image> {
    if let Some(d) = load(st, r)? {
        if visible(key, &d) {
            return Ok(d);
        }
    }
    let wanted = ImageRef::parse(r).ok_or_else(|| not_found(r))?;
    let all = all(st)?;
    wanted
        .pick(all.iter().filter(|d| visible(key, d)))
        .cloned()
        .ok_or_else(|| not_found(r))
}

/// An image for `start_of` and `disk_of`, which have no error to answer.
fn load_quietly(st: &AppState, id: &str) -> Option<Image> {
    match st.store().get_image(id) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(image_id = id, error = %e, "reading an image failed");
            None
        }
    }
}

/// What a sandbox started from the image needs: its disk and environment.
pub struct ForSandbox {
    pub id: String,
    pub env: Vec<(String, String)>,
}

/// The image a create names, which must be ready.
pub fn for_create(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<ForSandbox> {
    let d = resolve(st, key, r)?;
    if d.state != ImageState::Ready {
        return Err(ApiError::Conflict {
            code: "image_not_ready",
            message: format!("Image {} is {}, not ready.", d.id, d.state.as_str()),
            details: Some(json!({"imageId": d.id, "state": d.state})),
        });
    }
    Ok(ForSandbox {
        id: d.id,
        env: d.env,
    })
}

/// What a new sandbox of image `id` starts in the background: its `start`
/// command (a string run by bash, or an argv), in the image's workdir, as
/// the image's user.
pub fn start_of(st: &AppState, id: &str) -> Option<(Vec<String>, Option<String>, RunAs)> {
    let d = load_quietly(st, id)?;
    let argv = start_argv(d.start.as_ref())?;
    let user = match d.user {
        ImageUser::Root => RunAs::Root,
        ImageUser::User => RunAs::Sandbox,
    };
    Some((argv, d.workdir.clone(), user))
}

/// The disk a sandbox on image `id` boots on.
pub fn disk_of(st: &AppState, id: &str) -> Option<runtime_host::ImageDisk> {
    let d = load_quietly(st, id)?;
    if d.is_plain_base() {
        return None;
    }
    let key = d.disk_key();
    Some(runtime_host::ImageDisk {
        disk: layer_disk(st, key),
        key: steps::short_key(key),
    })
}

fn answer(d: &Image, log: &[LogLine]) -> Value {
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
        "steps": steps, "env": d.env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        "workdir": d.workdir, "user": d.user, "start": d.start, "createdAt": d.created_at,
        "readyAt": d.ready_at, "buildSeconds": d.build_seconds, "log": log.join("\n"),
        "region": "local",
    })
}

// ---- routes -----------------------------------------------------------

pub async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let name = crate::http::extract::checked_name(&mut f);
    if let Some(n) = &name {
        if n.contains([':', '@', '/']) {
            f.issue("name", "may not contain ':', '@' or '/'");
        }
    }
    let labels = crate::http::extract::checked_labels(&mut f).unwrap_or_default();
    let tags = f.raw("tags").cloned();
    let recipe = f.raw("recipe").cloned();
    let dockerfile = f.string("dockerfile");
    let files = f.raw("files").cloned();
    let build_args = f.string_map("buildArgs", 64).unwrap_or_default();
    let env = f.string_map("env", 64).unwrap_or_default();
    let start = f.raw("start").cloned();
    let _ = f.raw("build");
    let _ = f.bool("cache");
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, local");
        }
    }
    f.refuse("image", "building from a registry image is not supported by this server; use a recipe or a Dockerfile FROM one of its images");
    f.refuse(
        "context",
        "build contexts are not supported by this server; give small files inline in files",
    );
    f.refuse(
        "target",
        "multi-stage builds are not supported by this server",
    );
    f.refuse(
        "dockerignore",
        "build contexts are not supported by this server",
    );
    if recipe.is_some() == dockerfile.is_some() {
        f.issue("recipe", "give exactly one of recipe and dockerfile");
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
    let mut start = start.filter(|s| !s.is_null());
    let file_list: Vec<InlineFile> = match &files {
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
    let invalid_dockerfile = |e: ImageError| ApiError::invalid("dockerfile", e.to_string());
    // The base first: its key starts the chain and its state carries over.
    let base_ref = match (&recipe, &dockerfile) {
        (Some(r), _) => recipe::base(r),
        // Read FROM before the rest: a dry parse finds the base.
        (None, Some(text)) => {
            let mut probe = Steps::new(
                "",
                BuildState {
                    env: Vec::new(),
                    workdir: None,
                    user: ImageUser::Root,
                },
            );
            dockerfile::parse(&mut probe, text, &file_list, &build_args)
                .map_err(invalid_dockerfile)?
                .base
        }
        (None, None) => None,
    };
    let (base_key, base_id, state) = match &base_ref {
        None => (
            root_key(),
            None,
            // On the server's own image, a Dockerfile starts as root (as
            // Docker does) and a recipe as the sandbox user.
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: if dockerfile.is_some() {
                    ImageUser::Root
                } else {
                    ImageUser::User
                },
            },
        ),
        Some(r) => {
            // On one of ours, both go on as the user it ended with, like
            // its env and workdir.
            let d = for_create(&st, &ctx.key, r)?;
            let doc = load(&st, &d.id)?.ok_or_else(|| not_found(r))?;
            let state = BuildState {
                env: doc.env.clone(),
                workdir: doc.workdir.clone(),
                user: doc.user,
            };
            (doc.disk_key().to_string(), Some(doc.id), state)
        }
    };
    let mut b = Steps::new(base_key.clone(), state);
    for (k, v) in &env {
        b.state.set_env(k, v);
    }
    let source = if let Some(text) = &dockerfile {
        let parsed =
            dockerfile::parse(&mut b, text, &file_list, &build_args).map_err(invalid_dockerfile)?;
        if start.is_none() {
            start = parsed.start;
        }
        Source::Dockerfile
    } else {
        recipe::parse(&mut b, recipe.as_ref().unwrap_or(&Value::Null))
            .map_err(|e| ApiError::invalid("recipe", e.to_string()))?;
        Source::Recipe
    };
    if b.steps.len() > steps::MAX_STEPS {
        return Err(ApiError::invalid(
            "recipe",
            ImageError::TooManySteps.to_string(),
        ));
    }
    let now = now_ms();
    let mut d = Image {
        id: uuid::Uuid::new_v4().to_string(),
        key_id: ctx.key.id.clone(),
        tags: if name.is_some() { tags } else { Vec::new() },
        name,
        // The store gives it the next of its name.
        version: 0,
        labels,
        state: ImageState::Queued,
        error: None,
        source,
        base: base_id,
        base_key,
        steps: b.steps,
        env: b.state.env,
        workdir: b.state.workdir,
        user: b.state.user,
        start,
        created_at: iso(now),
        created_ms: now,
        ready_at: None,
        build_seconds: None,
        build_vm: None,
    };
    st.store().insert_image(&mut d)?;
    tracing::info!(image_id = %d.id, version = d.version, steps = d.steps.len(), "image queued");
    let st2 = st.clone();
    let id = d.id.clone();
    st.spawn(async move { build(st2, id).await });
    Ok(Reply::Json(StatusCode::CREATED, answer(&d, &[])))
}

pub async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = load(&st, &id)?
        .filter(|d| visible(&ctx.key, d))
        .ok_or_else(|| not_found(&id))?;
    let log = log_of(&st, &d.id)?;
    Reply::ok(answer(&d, &log))
}

pub async fn resolve_route(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let r = ctx
        .query
        .iter()
        .find(|(k, _)| k == "ref")
        .map(|(_, v)| v.clone())
        .ok_or_else(|| ApiError::invalid("ref", "is required"))?;
    let d = resolve(&st, &ctx.key, &r)?;
    let log = log_of(&st, &d.id)?;
    Reply::ok(answer(&d, &log))
}

pub async fn logs(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = load(&st, &id)?
        .filter(|d| visible(&ctx.key, d))
        .ok_or_else(|| not_found(&id))?;
    let after: u64 = ctx
        .query
        .iter()
        .find(|(k, _)| k == "after")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    if ctx.query.iter().any(|(k, v)| k == "follow" && v == "true") {
        return Err(ApiError::Unsupported {
            feature: "following build logs",
        });
    }
    let log = log_of(&st, &d.id)?;
    let lines: Vec<Value> = log
        .iter()
        .filter(|l| l.seq > after)
        .map(|l| json!({"seq": l.seq, "step": l.step, "stream": l.stream, "text": l.text}))
        .collect();
    let next = log.last().map_or(after, |l| l.seq.max(after));
    Reply::ok(json!({"lines": lines, "nextAfter": next,
                     "done": !d.state.in_progress()}))
}

pub async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let name = f.string("name");
    let state = f.one_of("state", &["queued", "building", "ready", "failed"]);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let mut rows: Vec<Image> = all(&st)?
        .into_iter()
        .filter(|d| visible(&ctx.key, d))
        .filter(|d| name.as_ref().is_none_or(|n| d.name.as_ref() == Some(n)))
        .filter(|d| state.as_ref().is_none_or(|s| d.state.as_str() == s))
        .collect();
    let next =
        crate::http::extract::page_after(&mut rows, cursor.as_deref(), limit, |d| d.id.as_str())?;
    let mut data: Vec<Value> = Vec::with_capacity(rows.len());
    for d in &rows {
        data.push(answer(d, &log_of(&st, &d.id)?));
    }
    Reply::ok(json!({"data": data, "nextCursor": next}))
}

/// Deletes one version; refused (409 `image_in_use`) while a sandbox that
/// is not deleted started from it. The step cache (layers) stays.
pub async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let _g = st.inner.create_lock.lock().await;
    let d = load(&st, &id)?
        .filter(|d| d.key_id == ctx.key.id || ctx.key.account_wide)
        .ok_or_else(|| not_found(&id))?;
    if d.state.in_progress() {
        return Err(ApiError::Conflict {
            code: "image_building",
            message: format!("Image {id} is still building."),
            details: None,
        });
    }
    if let Some(user) = st
        .store()
        .live_sandboxes()?
        .into_iter()
        .find(|r| r.record.image.as_deref() == Some(id.as_str()))
    {
        return Err(ApiError::Conflict {
            code: "image_in_use",
            message: format!(
                "Image {id} is used by sandbox {}; delete that sandbox first.",
                user.record.id
            ),
            details: Some(json!({"sandboxId": user.record.id})),
        });
    }
    st.store().delete_image(&id)?;
    Reply::ok(json!({"id": id, "kind": "image", "status": "deleted"}))
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
        "tag" | "untag" => Err(ApiError::Unsupported {
            feature: "moving image tags",
        }),
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/images/{id}:{verb}"),
        }),
    }
}

// ---- the build --------------------------------------------------------

/// After a restart: builds that were under way failed (their finished steps
/// stay cached, so building again resumes there); their machines end.
pub async fn recover(st: &AppState) -> Result<(), crate::ServerError> {
    let images = match all(st) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "reading images failed");
            return Ok(());
        }
    };
    for d in images.into_iter().filter(|d| d.state.in_progress()) {
        if let Some(vm) = &d.build_vm {
            if let Err(e) = st.host().destroy(vm).await {
                tracing::warn!(image_id = %d.id, vm = %vm, error = %e, "ending a build machine failed");
            }
            crate::net::sandbox_gone(st, vm);
        }
        update(st, &d.id, |d| {
            d.build_vm = None;
            d.state = ImageState::Failed;
            d.error = Some(
                "the server restarted during the build; build again (finished steps are cached)"
                    .into(),
            );
            fail_running_steps(d);
        });
    }
    Ok(())
}

fn fail_running_steps(d: &mut Image) {
    for s in &mut d.steps {
        if s.state == StepState::Running {
            s.state = StepState::Failed;
        }
    }
}

/// Appends `text`'s lines to an image's log (a failure is logged: the
/// build goes on).
fn log(st: &AppState, id: &str, step: Option<usize>, stream: LogStream, text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    if let Err(e) = st
        .store()
        .append_image_log(id, step, stream, &lines, MAX_LOG_LINES)
    {
        tracing::warn!(image_id = id, error = %e, "writing an image's log failed");
    }
}

/// Changes an image's record (a failure is logged: the build goes on).
fn update(st: &AppState, id: &str, f: impl FnOnce(&mut Image)) {
    let r = st.store().update_image(id, |d| {
        f(d);
        true
    });
    if let Err(e) = r {
        tracing::warn!(image_id = id, error = %e, "recording an image's build failed");
    }
}

async fn build(st: AppState, id: String) {
    let started = std::time::Instant::now();
    let result = run_build(&st, &id).await;
    let secs = started.elapsed().as_secs_f64();
    match result {
        Ok(()) => {
            log(
                &st,
                &id,
                None,
                LogStream::System,
                &format!("image ready in {secs:.1} s"),
            );
            let _g = st.inner.create_lock.lock().await;
            let d = match load(&st, &id) {
                Ok(Some(d)) => d,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(image_id = %id, error = %e, "reading a built image failed");
                    return;
                }
            };
            // Tags move to the newest ready version of the name.
            let mut tags = d.tags.clone();
            if d.name.is_some() {
                match all(&st) {
                    Ok(others) => {
                        let (kept, changed) = tags_on_ready(&d, &others);
                        for (other, t) in changed {
                            update(&st, &other, |o| o.tags = t);
                        }
                        tags = kept;
                    }
                    Err(e) => {
                        tracing::warn!(image_id = %id, error = %e, "moving tags to a built image failed")
                    }
                }
            }
            update(&st, &id, |d| {
                d.tags = tags;
                d.state = ImageState::Ready;
                d.ready_at = Some(iso(now_ms()));
                d.build_seconds = Some(secs);
            });
            tracing::info!(image_id = %id, secs, "image ready");
        }
        Err(message) => {
            log(
                &st,
                &id,
                None,
                LogStream::System,
                &format!("build failed: {message}"),
            );
            update(&st, &id, |d| {
                d.state = ImageState::Failed;
                d.error = Some(message.clone());
                d.build_seconds = Some(secs);
                fail_running_steps(d);
            });
            tracing::warn!(image_id = %id, %message, "image build failed");
        }
    }
}

async fn run_build(st: &AppState, id: &str) -> Result<(), String> {
    let d = load(st, id).ok().flatten().ok_or("the image went away")?;
    update(st, id, |d| d.state = ImageState::Building);
    // The longest prefix already kept.
    let mut from = d
        .steps
        .iter()
        .take_while(|s| layer_disk(st, &s.key).exists())
        .count();
    let base_layer = if from > 0 {
        Some(d.steps[from - 1].key.clone())
    } else if d.base.is_some() {
        Some(d.base_key.clone())
    } else {
        None
    };
    for s in &d.steps[..from] {
        log(
            st,
            id,
            Some(s.index),
            LogStream::System,
            &format!("{} (cached)", s.instruction),
        );
    }
    update(st, id, |d| {
        for s in d.steps.iter_mut().take(from) {
            s.state = StepState::Cached;
        }
    });
    if from == d.steps.len() {
        return Ok(());
    }
    let vm = format!("{}", uuid::Uuid::new_v4());
    // The build machine has the network of a sandbox with default rules
    // and no egress secrets.
    let net = crate::net::CreateNet {
        rules: None,
        secrets: Some(Vec::new()),
    };
    crate::net::store_create(st, &vm, &net).map_err(|e| e.to_string())?;
    update(st, id, |d| d.build_vm = Some(vm.clone()));
    let spec = runtime_host::MachineSpec {
        id: vm.clone(),
        vcpu: 2,
        memory_mib: 2048,
        // The smallest disk a sandbox may have: the guest grows its file
        // system to its disk, and a sandbox's disk may not be smaller.
        disk_mib: 3072,
        hostname: "build".into(),
        guest_ca_pem: crate::net::guest_ca_pem(st, &vm),
        volumes: Vec::new(),
        image: base_layer.map(|k| runtime_host::ImageDisk {
            disk: layer_disk(st, &k),
            key: steps::short_key(&k),
        }),
        // The first step's machine may come from the default template.
        no_template: from > 0 || d.base.is_some(),
    };
    log(
        st,
        id,
        None,
        LogStream::System,
        &format!(
            "build machine starting ({} of {} steps cached)",
            from,
            d.steps.len()
        ),
    );
    let result = async {
        st.host()
            .start(&spec)
            .await
            .map_err(|e| format!("the build machine did not start: {e}"))?;
        while from < d.steps.len() {
            let s = &d.steps[from];
            run_step(st, id, &vm, s).await?;
            from += 1;
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = st.host().destroy(&vm).await;
    crate::net::sandbox_gone(st, &vm);
    update(st, id, |d| d.build_vm = None);
    result
}

async fn run_step(st: &AppState, id: &str, vm: &str, s: &Step) -> Result<(), String> {
    use runtime_host::{ExecEvent, ExecSpec, RunAs};
    let started = std::time::Instant::now();
    update(st, id, |d| d.steps[s.index].state = StepState::Running);
    log(st, id, Some(s.index), LogStream::System, &s.instruction);
    let script = format!("set -e\n{}\nsync", s.script.as_deref().unwrap_or("true"));
    let mut env = s.env.clone();
    env.push(("DEBIAN_FRONTEND".into(), "noninteractive".into()));
    let spec = ExecSpec {
        argv: vec!["bash".into(), "-c".into(), script],
        cwd: s.workdir.clone(),
        env,
        user: if s.root { RunAs::Root } else { RunAs::Sandbox },
        timeout: Some(STEP_TIMEOUT),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
    };
    let mut h = st.host().exec(vm, spec).await.map_err(|e| {
        format!(
            "step {} ({}) could not start: {e}",
            s.index + 1,
            s.instruction
        )
    })?;
    let mut out = StepOutput::default();
    let status = loop {
        match h.events.recv().await {
            Some(ExecEvent::Stdout(b)) | Some(ExecEvent::Stderr(b)) => {
                if let Some(done) = out.push(&b) {
                    log(st, id, Some(s.index), LogStream::Output, &done);
                }
            }
            Some(ExecEvent::Exited(x)) => break x,
            None => {
                return Err(format!(
                    "step {} ({}): lost the build machine",
                    s.index + 1,
                    s.instruction
                ))
            }
        }
    };
    if let Some(rest) = out.finish() {
        log(st, id, Some(s.index), LogStream::Output, &rest);
    }
    if status.code != Some(0) {
        let why = match (status.code, status.timed_out) {
            (_, true) => "timed out".to_string(),
            (Some(c), _) => format!("exited with code {c}"),
            (None, _) => format!("was killed by signal {}", status.signal.unwrap_or(0)),
        };
        return Err(format!(
            "step {} ({}) {why}; its last output:\n{}",
            s.index + 1,
            s.instruction,
            out.tail().join("\n")
        ));
    }
    // Keep the disk as this step's layer.
    let dir = layers(st).join(&s.key);
    let partial = layers(st).join(steps::partial_layer(&s.key));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(layers(st)).map_err(|e| e.to_string())?;
    st.host()
        .capture(vm, &partial, false)
        .await
        .map_err(|e| format!("step {}: keeping its disk failed: {e}", s.index + 1))?;
    {
        use std::os::unix::fs::PermissionsExt;
        for p in [
            st.config().data_dir.join("images"),
            layers(st),
            partial.clone(),
        ] {
            let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o711));
        }
        let _ = std::fs::set_permissions(
            partial.join("disk.qcow2"),
            std::fs::Permissions::from_mode(0o644),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&partial, &dir).map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    update(st, id, |d| {
        d.steps[s.index].state = StepState::Done;
        d.steps[s.index].seconds = Some(secs);
    });
    Ok(())
}
