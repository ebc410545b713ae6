//! Custom images (contract §11, docs/images.md): builds from a recipe or a
//! Dockerfile, their records and logs, and what a sandbox of an image
//! boots on and starts.
//!
//! A build is a list of steps, each named by a key that hashes the key
//! before it with the step itself and the build state it runs in (env,
//! workdir, user): a hash chain starting at the base image's key
//! (`domain::image::steps`). The disk after each step is kept as a layer
//! ([`layers`]). A build finds the longest prefix of its steps already
//! kept, boots one build machine on that layer, and runs the rest one by
//! one as commands in it ([`build`]). A sandbox created with the image
//! boots (or restores its own template) on the last layer.

mod build;
pub(crate) mod context;
mod layers;

use runtime_api::codes;
use std::collections::BTreeMap;

use runtime_host::RunAs;
use serde_json::{json, Value};

use crate::domain::access::{visible, KeyInfo};
use crate::domain::image::context::{ContextRequest, Ignore};
use crate::domain::image::steps::{self, BuildState, Steps};
use crate::domain::image::{
    context as ctx, dockerfile, recipe, start_argv, Image, ImageError, ImageRef, ImageState,
    ImageUser, InlineFile, LogLine, Source,
};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::AppState;

pub(crate) use build::recover;

/// What a build is written as.
pub(crate) enum BuildSource {
    /// A recipe object (checked by `domain::image::recipe`).
    Recipe(Value),
    Dockerfile(String),
}

/// A build, as its create asks (the fields already checked).
pub(crate) struct CreateImage {
    pub(crate) name: Option<String>,
    pub(crate) labels: BTreeMap<String, String>,
    /// Kept only when the image has a name.
    pub(crate) tags: Vec<String>,
    pub(crate) source: BuildSource,
    /// The files a Dockerfile's `COPY` may name.
    pub(crate) files: Vec<InlineFile>,
    pub(crate) build_args: Vec<(String, String)>,
    pub(crate) env: Vec<(String, String)>,
    /// Wins over a Dockerfile's `CMD`/`ENTRYPOINT`.
    pub(crate) start: Option<Value>,
    /// The uploaded build context a Dockerfile's COPY reads.
    pub(crate) context: Option<ContextRequest>,
    /// Its `.dockerignore` (applied again here).
    pub(crate) dockerignore: Option<String>,
    /// The stage to build.
    pub(crate) target: Option<String>,
}

/// An image as answered: its record and its log.
pub(crate) struct ImageView {
    pub(crate) image: Image,
    pub(crate) log: Vec<LogLine>,
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::IMAGE_NOT_FOUND,
        what: "image",
        id: id.to_string(),
    }
}

/// An image by id (one `key` sees), or by `name`, `name:tag` or
/// `name@version` among `key`'s own images: names belong to the key that
/// made them, so an account-wide key uses another key's image by id only.
pub(crate) fn resolve(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<Image> {
    if let Some(d) = st.store().get_image(r)? {
        if visible(key, &d.key_id) {
            return Ok(d);
        }
    }
    let wanted = ImageRef::parse(r).ok_or_else(|| not_found(r))?;
    let all = st.store().images()?;
    wanted
        .pick(all.iter().filter(|d| d.key_id == key.id))
        .cloned()
        .ok_or_else(|| not_found(r))
}

/// `d` with its log.
pub(crate) fn view(st: &AppState, image: Image) -> ApiResult<ImageView> {
    let log = st.store().image_log(&image.id)?;
    Ok(ImageView { image, log })
}

/// An image by id, as `key` sees it, with its log.
pub(crate) fn get(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<ImageView> {
    let d = st
        .store()
        .get_image(id)?
        .filter(|d| visible(key, &d.key_id))
        .ok_or_else(|| not_found(id))?;
    view(st, d)
}

/// An image by any reference, with its log.
pub(crate) fn find(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<ImageView> {
    view(st, resolve(st, key, r)?)
}

/// The images `key` sees (of `name`, in `state`, when given), newest first.
pub(crate) fn list(
    st: &AppState,
    key: &KeyInfo,
    name: Option<&str>,
    state: Option<ImageState>,
) -> ApiResult<Vec<Image>> {
    Ok(st
        .store()
        .images()?
        .into_iter()
        .filter(|d| visible(key, &d.key_id))
        .filter(|d| name.is_none_or(|n| d.name.as_deref() == Some(n)))
        .filter(|d| state.is_none_or(|s| d.state == s))
        .collect())
}

/// What a sandbox started from the image needs: its id and environment.
pub(crate) struct ForSandbox {
    pub(crate) id: String,
    pub(crate) env: Vec<(String, String)>,
}

/// The image a create names, which must be ready.
pub(crate) fn for_create(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<ForSandbox> {
    let d = resolve(st, key, r)?;
    if d.state != ImageState::Ready {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_NOT_READY,
            message: format!("Image {} is {}, not ready.", d.id, d.state.as_str()),
            details: Some(json!({"imageId": d.id, "state": d.state})),
        });
    }
    Ok(ForSandbox {
        id: d.id,
        env: d.env,
    })
}

/// An image for [`start_of`] and [`disk_of`], which have no error to answer.
fn load_quietly(st: &AppState, id: &str) -> Option<Image> {
    match st.store().get_image(id) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(image_id = id, error = %e, "reading an image failed");
            None
        }
    }
}

/// What a new sandbox of image `id` starts in the background: its `start`
/// command (a string run by bash, or an argv), in the image's workdir, as
/// the image's user.
pub(crate) fn start_of(st: &AppState, id: &str) -> Option<(Vec<String>, Option<String>, RunAs)> {
    let d = load_quietly(st, id)?;
    let argv = start_argv(d.start.as_ref())?;
    let user = match d.user {
        ImageUser::Root => RunAs::Root,
        ImageUser::User => RunAs::Sandbox,
    };
    Some((argv, d.workdir, user))
}

/// The disk a sandbox on image `id` boots on.
pub(crate) fn disk_of(st: &AppState, id: &str) -> Option<runtime_host::ImageDisk> {
    let d = load_quietly(st, id)?;
    if d.is_plain_base() {
        return None;
    }
    let key = d.disk_key();
    Some(runtime_host::ImageDisk {
        disk: layers::disk(st, key),
        key: steps::short_key(key),
    })
}

/// Reads the build into steps on its base, keeps the image (`queued`, the
/// next version of its name) and starts building it in the background.
pub(crate) async fn create(st: &AppState, key: &KeyInfo, cmd: CreateImage) -> ApiResult<Image> {
    let invalid_dockerfile = |e: ImageError| match e {
        ImageError::NoSuchTarget(_) => ApiError::invalid("target", e.to_string()),
        e => ApiError::invalid("dockerfile", e.to_string()),
    };
    // The context first: every chunk there, the archive whole and as listed.
    let manifest = match &cmd.context {
        Some(c) => {
            let mut m = context::manifest(st, &key.id, &c.archive)
                .await
                .map_err(|e| ApiError::invalid("context", e.to_string()))?;
            ctx::check_listed(&m, &c.files)
                .map_err(|e| ApiError::invalid("context", e.to_string()))?;
            if let Some(text) = &cmd.dockerignore {
                m.ignore(&Ignore::parse(text));
            }
            Some(m)
        }
        None => None,
    };
    let inputs = dockerfile::Inputs {
        files: &cmd.files,
        context: manifest.as_ref(),
        args: &cmd.build_args,
        target: cmd.target.as_deref(),
    };
    // The base first: its key starts the chain and its state carries over.
    let base_ref = match &cmd.source {
        BuildSource::Recipe(r) => recipe::base(r),
        // Read FROM before the rest: a dry parse finds the base.
        BuildSource::Dockerfile(text) => {
            let mut probe = Steps::new(
                "",
                BuildState {
                    env: Vec::new(),
                    workdir: None,
                    user: ImageUser::Root,
                },
            );
            dockerfile::parse(&mut probe, text, inputs)
                .map_err(invalid_dockerfile)?
                .base
        }
    };
    let (base_key, base_id, state) = match &base_ref {
        None => (
            layers::base_key(),
            None,
            // On the server's own image, a Dockerfile starts as root (as
            // Docker does) and a recipe as the sandbox user.
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: match cmd.source {
                    BuildSource::Dockerfile(_) => ImageUser::Root,
                    BuildSource::Recipe(_) => ImageUser::User,
                },
            },
        ),
        Some(r) => {
            // On one of ours, both go on as the user it ended with, like
            // its env and workdir.
            let d = for_create(st, key, r)?;
            let base = st.store().get_image(&d.id)?.ok_or_else(|| not_found(r))?;
            let state = BuildState {
                env: base.env.clone(),
                workdir: base.workdir.clone(),
                user: base.user,
            };
            (base.disk_key().to_string(), Some(base.id), state)
        }
    };
    let mut b = Steps::new(base_key.clone(), state);
    for (k, v) in &cmd.env {
        b.state.set_env(k, v);
    }
    let mut start = cmd.start;
    let source = match &cmd.source {
        BuildSource::Dockerfile(text) => {
            let parsed = dockerfile::parse(&mut b, text, inputs).map_err(invalid_dockerfile)?;
            if start.is_none() {
                start = parsed.start;
            }
            Source::Dockerfile
        }
        BuildSource::Recipe(r) => {
            recipe::parse(&mut b, r).map_err(|e| ApiError::invalid("recipe", e.to_string()))?;
            Source::Recipe
        }
    };
    if b.steps.len() > steps::MAX_STEPS {
        return Err(ApiError::invalid(
            "recipe",
            ImageError::TooManySteps.to_string(),
        ));
    }
    let now = st.now_ms();
    let mut d = Image {
        id: uuid::Uuid::new_v4().to_string(),
        key_id: key.id.clone(),
        tags: if cmd.name.is_some() {
            cmd.tags
        } else {
            Vec::new()
        },
        name: cmd.name,
        // The store gives it the next of its name.
        version: 0,
        labels: cmd.labels,
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
        context: cmd.context.map(|c| c.archive),
    };
    st.store().insert_image(&mut d)?;
    tracing::info!(image_id = %d.id, version = d.version, steps = d.steps.len(), "image queued");
    let st2 = st.clone();
    let id = d.id.clone();
    st.spawn(async move { build::build(st2, id).await });
    Ok(d)
}

/// Deletes one version; refused (409 `image_in_use`) while a sandbox that
/// is not deleted started from it, and while it builds. The step cache
/// (layers) stays.
pub(crate) async fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<()> {
    let _g = st.inner.create_lock.lock().await;
    let d = st
        .store()
        .get_image(id)?
        .filter(|d| d.key_id == key.id || key.account_wide)
        .ok_or_else(|| not_found(id))?;
    if d.state.in_progress() {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_BUILDING,
            message: format!("Image {id} is still building."),
            details: None,
        });
    }
    if let Some(user) = st
        .store()
        .live_sandboxes()?
        .into_iter()
        .find(|r| r.record.image.as_deref() == Some(id))
    {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_IN_USE,
            message: format!(
                "Image {id} is used by sandbox {}; delete that sandbox first.",
                user.record.id
            ),
            details: Some(json!({"sandboxId": user.record.id})),
        });
    }
    st.store().delete_image(id)?;
    Ok(())
}
