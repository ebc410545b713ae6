//! Custom images (contract §11, docs/images.md): builds from a recipe or a
//! Dockerfile, their records and logs, and what a sandbox of an image
//! boots on and starts.
//!
//! A build is a list of steps, each named by a key that hashes the key
//! before it with the step itself and the build state it runs in (env,
//! workdir, user): a hash chain starting at the base image's key
//! (`domain::image::steps`). The disk after each step is kept as a layer
//! ([`layers`]). A build skips the steps already kept, boots a build
//! machine on the layer the first other one runs on, and runs the rest one
//! by one as commands in it, booting another where a stage of a
//! multi-stage build starts on another layer or copies from a layer the
//! machine lacks ([`build`]). A sandbox created with the image
//! boots (or restores its own template) on the last layer.

mod build;
pub(crate) mod context;
mod follow;
mod layers;
mod prune;
mod pull;
pub(crate) mod registries;

use runtime_api::codes;
use std::collections::BTreeMap;

use runtime_host::oci::Reference;
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

pub(crate) use build::{recover, BuildSlots};
pub(crate) use follow::{follow, FollowEvent};
pub(crate) use prune::{prune_for, prune_if_short};

/// What a build is written as.
#[derive(Clone)]
pub(crate) enum BuildSource {
    /// A recipe object (checked by `domain::image::recipe`).
    Recipe(Value),
    Dockerfile(String),
    /// A registry image as it is (`image`).
    Image(String),
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
    /// Wins over a Dockerfile's `CMD`/`ENTRYPOINT` and a registry image's
    /// config; `null` drops those.
    pub(crate) start: Option<Value>,
    /// The uploaded build context a Dockerfile's COPY reads.
    pub(crate) context: Option<ContextRequest>,
    /// Its `.dockerignore` (applied again here).
    pub(crate) dockerignore: Option<String>,
    /// The stage to build.
    pub(crate) target: Option<String>,
    /// The build machine and the build's limits.
    pub(crate) build: crate::domain::image::BuildLimits,
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
        if visible(key, &d.key_id) && !d.deleted {
            return Ok(d);
        }
    }
    let wanted = ImageRef::parse(r).ok_or_else(|| not_found(r))?;
    let all = st.store().images()?;
    let own = || all.iter().filter(|d| d.key_id == key.id && !d.deleted);
    if let Some(d) = wanted.pick(own()) {
        return Ok(d.clone());
    }
    Err(missing(r, &wanted.name, own()))
}

/// `image_not_found` for reference `r` that names nothing: for a name the
/// key has built, its tags and versions (in `details` too); for a name it
/// never built, how to build it.
fn missing<'a>(r: &str, name: &str, own: impl Iterator<Item = &'a Image>) -> ApiError {
    let versions: Vec<&Image> = own.filter(|d| d.name.as_deref() == Some(name)).collect();
    if versions.is_empty() {
        return ApiError::Missing {
            code: codes::IMAGE_NOT_FOUND,
            message: format!("No image {r}: no image of this key is named {name}."),
            details: Some(json!({"ref": r, "name": name, "tags": [], "versions": []})),
            hint: Some(format!(
                "A sandbox starts only from an image built on this server: build it first, \
                 e.g. runtime.images.build(name=\"{}\", image=\"{r}\"), then use that name.",
                build_name(r)
            )),
        };
    }
    let mut tags: Vec<String> = versions.iter().flat_map(|d| d.tags.clone()).collect();
    tags.sort();
    tags.dedup();
    let mut numbers: Vec<u32> = versions.iter().map(|d| d.version).collect();
    numbers.sort_unstable();
    let list = |v: Vec<String>| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    ApiError::Missing {
        code: codes::IMAGE_NOT_FOUND,
        message: format!(
            "No image {r}. {name} has tags {} and versions {}.",
            list(tags.clone()),
            list(numbers.iter().map(|n| n.to_string()).collect())
        ),
        details: Some(json!({"ref": r, "name": name, "tags": tags, "versions": numbers})),
        hint: Some(format!(
            "Name one of them: {name}:<tag> or {name}@<version>."
        )),
    }
}

/// A name an image pulled from registry reference `r` could take: its
/// repository's last part (`ghcr.io/acme/app:1.4` → `app`).
fn build_name(r: &str) -> String {
    let no_digest = r.split('@').next().unwrap_or(r);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    let name = last.split(':').next().unwrap_or(last);
    if name.is_empty() {
        "app".into()
    } else {
        name.to_string()
    }
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
        .filter(|d| visible(key, &d.key_id) && !d.deleted)
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
        .filter(|d| visible(key, &d.key_id) && !d.deleted)
        .filter(|d| name.is_none_or(|n| d.name.as_deref() == Some(n)))
        .filter(|d| state.is_none_or(|s| d.state == s))
        .collect())
}

/// What a sandbox started from the image needs: its id and environment.
pub(crate) struct ForSandbox {
    pub(crate) id: String,
    pub(crate) env: Vec<(String, String)>,
    /// The image's file system, in MiB, when it has a disk of its own: a
    /// sandbox's disk may not be smaller.
    pub(crate) disk_mib: Option<u32>,
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
    let disk_mib = disk_mib(st, &d);
    Ok(ForSandbox {
        id: d.id,
        env: d.env,
        disk_mib,
    })
}

/// The size of image `d`'s own disk in MiB (its last layer's, which the
/// build machine's or the pull's file system fills), read from the qcow2
/// header; `None` for the server's plain image or a header it cannot read.
pub(crate) fn disk_mib(st: &AppState, d: &Image) -> Option<u32> {
    if d.is_plain_base() {
        return None;
    }
    let path = layers::disk(st, d.disk_key());
    match runtime_host::disk_files::virtual_size(&path) {
        Ok(Some(bytes)) => u32::try_from(bytes.div_ceil(1 << 20)).ok(),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(image_id = %d.id, error = %e, "reading the image's disk size failed");
            None
        }
    }
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

/// Where a build starts.
enum BaseOf {
    /// The server's own image.
    Ours,
    /// One of the caller's ready images.
    Image(Box<Image>),
    /// A registry image, pulled when the build runs.
    Registry(Reference),
}

/// What `r` names: one of the caller's images (by id or name), or else a
/// registry image. Only a ref that is neither is refused (naming `field`).
fn base_of(st: &AppState, key: &KeyInfo, r: Option<&str>, field: &str) -> ApiResult<BaseOf> {
    let Some(r) = r else {
        return Ok(BaseOf::Ours);
    };
    if r == "runtime" || r == "default" {
        return Ok(BaseOf::Ours);
    }
    match for_create(st, key, r) {
        Ok(d) => {
            let base = st.store().get_image(&d.id)?.ok_or_else(|| not_found(r))?;
            Ok(BaseOf::Image(Box::new(base)))
        }
        // An id that is not ours stays a 404, not a pull of a repository
        // named like it.
        Err(e @ (ApiError::NotFound { .. } | ApiError::Missing { .. }))
            if uuid::Uuid::parse_str(r).is_ok() =>
        {
            Err(e)
        }
        Err(ApiError::NotFound { .. } | ApiError::Missing { .. }) => {
            Reference::parse(r).map(BaseOf::Registry).map_err(|e| {
                ApiError::invalid(
                    field,
                    format!("{r} is neither one of your images nor a registry reference: {e}"),
                )
            })
        }
        Err(e) => Err(e),
    }
}

/// A build read into steps.
pub(super) struct Plan {
    pub(super) steps: Vec<steps_mod::Step>,
    pub(super) state: BuildState,
    pub(super) start: Option<Value>,
    pub(super) source: Source,
}

use crate::domain::image as steps_mod;

/// Reads `source` into steps on `base_key`, starting in `state`. `start` is
/// the create's own (`Some(null)` drops any), `inherited` the base's.
pub(super) fn plan(
    base_key: &str,
    state: BuildState,
    source: &BuildSource,
    cmd: &PlanInput,
    inherited: Option<Value>,
) -> ApiResult<Plan> {
    let invalid_dockerfile = |e: ImageError| match e {
        ImageError::NoSuchTarget(_) => ApiError::invalid("target", e.to_string()),
        e => ApiError::invalid("dockerfile", e.to_string()),
    };
    let mut b = Steps::new(base_key, state);
    b.disk = cmd.disk;
    for (k, v) in &cmd.env {
        b.state.set_env(k, v);
    }
    let mut start = cmd.start.clone();
    let source = match source {
        BuildSource::Dockerfile(text) => {
            let inputs = dockerfile::Inputs {
                files: &cmd.files,
                context: cmd.context.as_ref(),
                args: &cmd.build_args,
                target: cmd.target.as_deref(),
                externals: Some(&cmd.externals),
            };
            let parsed = dockerfile::parse(&mut b, text, inputs).map_err(invalid_dockerfile)?;
            start = start.or(parsed.start);
            Source::Dockerfile
        }
        BuildSource::Recipe(r) => {
            recipe::parse(&mut b, r).map_err(|e| ApiError::invalid("recipe", e.to_string()))?;
            Source::Recipe
        }
        BuildSource::Image(_) => Source::Image,
    };
    let start = start.or(inherited).filter(|s| !s.is_null());
    if b.steps.len() > steps::MAX_STEPS {
        return Err(ApiError::invalid(
            "recipe",
            ImageError::TooManySteps.to_string(),
        ));
    }
    Ok(Plan {
        steps: b.steps,
        state: b.state,
        start,
        source,
    })
}

/// What a build's steps are read from besides its source.
#[derive(Clone)]
pub(super) struct PlanInput {
    pub(super) files: Vec<InlineFile>,
    pub(super) build_args: Vec<(String, String)>,
    pub(super) env: Vec<(String, String)>,
    pub(super) start: Option<Value>,
    /// The uploaded context (`.dockerignore` applied) COPY reads.
    pub(super) context: Option<ctx::Manifest>,
    pub(super) target: Option<String>,
    /// The images a multi-stage Dockerfile names besides its chain's base
    /// (other stages' bases, `COPY --from`), as resolved so far: a
    /// registry image is here once pulled.
    pub(super) externals: BTreeMap<String, dockerfile::External>,
    /// The build disk when it is not the default (its steps' keys cover it).
    pub(super) disk: Option<u32>,
}

/// Registry images the build pulls first, then reads its steps again on:
/// the base of its chain, and those a multi-stage Dockerfile names besides.
pub(super) struct Pending {
    /// The chain's base, when it is a registry image.
    pub(super) reference: Option<Reference>,
    /// The others: as written, the reference, and the instruction naming
    /// it (`Dockerfile line 3 (COPY)`).
    pub(super) others: Vec<(String, Reference, String)>,
    /// The chain's base when it is not pulled: its key, state and start.
    pub(super) base_key: String,
    pub(super) state: BuildState,
    pub(super) inherited: Option<Value>,
    pub(super) source: BuildSource,
    pub(super) input: PlanInput,
    pub(super) key_id: String,
}

/// Where an image a Dockerfile names outside its chain starts, when it is
/// the server's or one of the caller's (`None`: a registry image).
fn external_of(
    st: &AppState,
    key: &KeyInfo,
    e: &dockerfile::ExternalRef,
    stages: &[String],
) -> ApiResult<Option<dockerfile::External>> {
    let ours = || dockerfile::External {
        key: layers::base_key(),
        state: BuildState {
            env: Vec::new(),
            workdir: None,
            user: ImageUser::Root,
        },
    };
    if dockerfile::is_ours(&e.reference) {
        return Ok(Some(ours()));
    }
    match base_of(st, key, Some(&e.reference), "dockerfile")? {
        BaseOf::Ours => Ok(Some(ours())),
        BaseOf::Image(base) => Ok(Some(dockerfile::External {
            key: base.disk_key().to_string(),
            state: BuildState {
                env: base.env.clone(),
                workdir: base.workdir.clone(),
                user: base.user,
            },
        })),
        // A bare word after --from is a stage's name mistyped more often
        // than an image without its tag.
        BaseOf::Registry(_) if e.copy && !e.reference.contains(['/', ':', '@', '.']) => Err(
            ApiError::invalid("dockerfile", e.unknown_stage(stages).to_string()),
        ),
        BaseOf::Registry(_) => Ok(None),
    }
}

/// The build state and start a registry image's config gives: its `Env`,
/// `WorkingDir`, `User` (root when empty, `root` or 0; any other user is
/// the sandbox user, uid 1000), `Entrypoint` + `Cmd` as an argv.
pub(super) fn registry_state(c: &runtime_host::oci::RunConfig) -> (BuildState, Option<Value>) {
    let mut state = BuildState {
        env: Vec::new(),
        workdir: None,
        user: ImageUser::Root,
    };
    for e in c.env.iter().flatten() {
        if let Some((k, v)) = e.split_once('=') {
            if !k.is_empty() {
                state.set_env(k, v);
            }
        }
    }
    state.workdir = c
        .working_dir
        .clone()
        .filter(|w| crate::domain::image::valid_abs(w) && w != "/");
    let user = c.user.as_deref().unwrap_or_default();
    let name = user.split(':').next().unwrap_or_default();
    state.user = if matches!(name, "" | "root" | "0") {
        ImageUser::Root
    } else {
        ImageUser::User
    };
    let argv: Vec<String> = c
        .entrypoint
        .iter()
        .flatten()
        .chain(c.cmd.iter().flatten())
        .cloned()
        .collect();
    let start = (!argv.is_empty()).then(|| json!({ "command": argv }));
    (state, start)
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
        externals: None,
    };
    // The base first: its key starts the chain and its state carries over.
    let mut externals = Vec::new();
    let mut stages = Vec::new();
    let (base_ref, field) = match &cmd.source {
        BuildSource::Recipe(r) => (recipe::base(r), "recipe"),
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
            let parsed = dockerfile::parse(&mut probe, text, inputs).map_err(invalid_dockerfile)?;
            externals = parsed.externals;
            stages = dockerfile::stage_names(text);
            (parsed.base, "dockerfile")
        }
        BuildSource::Image(r) => (Some(r.clone()), "image"),
    };
    // The other images a multi-stage build names: ours now, registry
    // images once pulled.
    let mut resolved = BTreeMap::new();
    let mut others = Vec::new();
    for e in &externals {
        match external_of(st, key, e, &stages)? {
            Some(x) => {
                resolved.insert(e.reference.clone(), x);
            }
            None => {
                let r = Reference::parse(&e.reference).map_err(|err| {
                    ApiError::invalid(
                        "dockerfile",
                        format!("{} is not a registry reference: {err}", e.reference),
                    )
                })?;
                others.push((
                    e.reference.clone(),
                    r,
                    format!("Dockerfile line {} ({})", e.line, e.op),
                ));
            }
        }
    }
    let input = PlanInput {
        files: cmd.files.clone(),
        build_args: cmd.build_args.clone(),
        env: cmd.env.clone(),
        start: cmd.start.clone(),
        context: manifest.clone(),
        target: cmd.target.clone(),
        externals: resolved,
        disk: cmd.build.other_disk(),
    };
    let mut pending = None;
    let (base_key, base_id, state, inherited) = match base_of(st, key, base_ref.as_deref(), field)?
    {
        BaseOf::Ours => (
            layers::base_key(),
            None,
            // On the server's own image, a Dockerfile starts as root (as
            // Docker does) and a recipe as the sandbox user.
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: match cmd.source {
                    BuildSource::Dockerfile(_) | BuildSource::Image(_) => ImageUser::Root,
                    BuildSource::Recipe(_) => ImageUser::User,
                },
            },
            None,
        ),
        BaseOf::Image(base) => {
            // On one of ours, both go on as the user it ended with, like
            // its env and workdir.
            let state = BuildState {
                env: base.env.clone(),
                workdir: base.workdir.clone(),
                user: base.user,
            };
            let inherited = matches!(cmd.source, BuildSource::Image(_))
                .then(|| base.start.clone())
                .flatten();
            (base.disk_key().to_string(), Some(base.id), state, inherited)
        }
        BaseOf::Registry(r) => {
            // Read now to check it; read again on the pulled image's
            // config and layer once the build has them.
            let key = format!(
                "pending-{}",
                crate::domain::access::sha256_hex(r.canonical().as_bytes())
            );
            let (state, _) = registry_state(&Default::default());
            pending = Some(r);
            (key, None, state, None)
        }
    };
    let p = plan(
        &base_key,
        state.clone(),
        &cmd.source,
        &input,
        inherited.clone(),
    )?;
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
        source: p.source,
        base: base_id,
        base_key,
        steps: p.steps,
        env: p.state.env,
        workdir: p.state.workdir,
        user: p.state.user,
        start: p.start,
        created_at: iso(now),
        created_ms: now,
        ready_at: None,
        build_seconds: None,
        build_vm: None,
        pulled: pending.as_ref().map(Reference::canonical),
        context: cmd.context.map(|c| c.archive),
        build: cmd.build,
        deleted: false,
    };
    {
        // Not while a prune removes layers this build may start on.
        let _g = st
            .inner
            .prune_gate
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        st.store().insert_image(&mut d)?;
    }
    tracing::info!(image_id = %d.id, version = d.version, steps = d.steps.len(), "image queued");
    let pending = (pending.is_some() || !others.is_empty()).then(|| Pending {
        reference: pending,
        others,
        base_key: d.base_key.clone(),
        state,
        inherited,
        source: cmd.source,
        input,
        key_id: key.id.clone(),
    });
    let st2 = st.clone();
    let id = d.id.clone();
    st.spawn(async move { build::build(st2, id, pending).await });
    Ok(d)
}

/// Deletes one version (its tags with it); refused while it builds. A
/// version sandboxes still use (not deleted ones, stopped persistent ones
/// included) is only marked deleted: gone from the API, kept for their
/// starts until a prune finds none left. The step cache (layers) stays.
pub(crate) async fn delete(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<()> {
    let _g = st.inner.create_lock.lock().await;
    let d = st
        .store()
        .get_image(id)?
        .filter(|d| (d.key_id == key.id || key.account_wide) && !d.deleted)
        .ok_or_else(|| not_found(id))?;
    if d.state.in_progress() {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_BUILDING,
            message: format!("Image {id} is still building."),
            details: None,
        });
    }
    if in_use(st, id)? {
        st.store().update_image(id, |d| {
            d.deleted = true;
            d.tags.clear();
            true
        })?;
    } else {
        st.store().delete_image(id)?;
    }
    Ok(())
}

/// Whether a sandbox that is not deleted started from image `id`.
pub(super) fn in_use(st: &AppState, id: &str) -> ApiResult<bool> {
    Ok(st
        .store()
        .live_sandboxes()?
        .iter()
        .any(|r| r.record.image.as_deref() == Some(id)))
}

/// `:tag` (`on`) and `:untag`: points `tag` of the image's name at this
/// version, taking it from any other version of the name, or takes it
/// off this version. Only a ready image takes a tag; only a named one has
/// tags. Under the create lock, as a build's tags move when it is ready.
pub(crate) async fn tag(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    tag: &str,
    on: bool,
) -> ApiResult<Image> {
    let _g = st.inner.create_lock.lock().await;
    let d = st
        .store()
        .get_image(id)?
        .filter(|d| (d.key_id == key.id || key.account_wide) && !d.deleted)
        .ok_or_else(|| not_found(id))?;
    let Some(name) = d.name.clone() else {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_NOT_READY,
            message: format!("Image {id} has no name, so it has no tags; build it with a name."),
            details: Some(json!({"imageId": id})),
        });
    };
    if !on {
        let Some(d) = st.store().update_image(id, |d| {
            let had = d.tags.len();
            d.tags.retain(|t| t != tag);
            d.tags.len() != had
        })?
        else {
            return Err(not_found(id));
        };
        return Ok(d);
    }
    if d.state != ImageState::Ready {
        return Err(ApiError::Conflict {
            code: codes::IMAGE_NOT_READY,
            message: format!(
                "Image {id} is {}; only a ready image takes a tag.",
                d.state.as_str()
            ),
            details: Some(json!({"imageId": id, "state": d.state})),
        });
    }
    for other in st.store().images()? {
        if other.id != d.id
            && other.key_id == d.key_id
            && other.name.as_deref() == Some(name.as_str())
            && other.tags.iter().any(|t| t == tag)
        {
            st.store().update_image(&other.id, |o| {
                o.tags.retain(|t| t != tag);
                true
            })?;
        }
    }
    let Some(d) = st.store().update_image(id, |d| {
        if d.tags.iter().any(|t| t == tag) {
            return false;
        }
        d.tags.push(tag.to_string());
        true
    })?
    else {
        return Err(not_found(id));
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use runtime_host::oci::RunConfig;

    use super::*;

    fn config(user: Option<&str>) -> RunConfig {
        RunConfig {
            env: Some(vec![
                "PATH=/usr/local/bin:/usr/bin".into(),
                "A=b=c".into(),
                "NOEQUALS".into(),
                "=x".into(),
            ]),
            working_dir: Some("/app".into()),
            user: user.map(str::to_string),
            cmd: Some(vec!["python3".into()]),
            entrypoint: Some(vec!["tini".into(), "--".into()]),
        }
    }

    #[test]
    fn a_registry_config_gives_env_workdir_user_and_start() {
        let (state, start) = registry_state(&config(None));
        assert_eq!(
            state.env,
            [
                ("PATH".to_string(), "/usr/local/bin:/usr/bin".to_string()),
                ("A".to_string(), "b=c".to_string())
            ]
        );
        assert_eq!(state.workdir.as_deref(), Some("/app"));
        assert_eq!(state.user, ImageUser::Root);
        assert_eq!(start, Some(json!({"command": ["tini", "--", "python3"]})));
        for root in ["root", "0", "0:0", "root:root", ""] {
            assert_eq!(
                registry_state(&config(Some(root))).0.user,
                ImageUser::Root,
                "{root}"
            );
        }
        for other in ["1000", "node", "nobody:nogroup", "999"] {
            assert_eq!(
                registry_state(&config(Some(other))).0.user,
                ImageUser::User,
                "{other}"
            );
        }
        // Nothing to run, and a workdir that is not absolute, give none.
        let bare = RunConfig {
            working_dir: Some("rel".into()),
            ..RunConfig::default()
        };
        let (state, start) = registry_state(&bare);
        assert_eq!((state.workdir, start), (None, None));
    }

    #[test]
    fn a_create_start_wins_and_null_drops_the_inherited_one() {
        let input = |start: Option<Value>| PlanInput {
            files: Vec::new(),
            build_args: Vec::new(),
            env: Vec::new(),
            start,
            context: None,
            target: None,
            externals: BTreeMap::new(),
            disk: None,
        };
        let (state, inherited) = registry_state(&config(None));
        let source = BuildSource::Image("x".into());
        let p = plan("k", state.clone(), &source, &input(None), inherited.clone());
        assert_eq!(p.ok().and_then(|p| p.start), inherited);
        let own = json!({"command": "serve"});
        let p = plan(
            "k",
            state.clone(),
            &source,
            &input(Some(own.clone())),
            inherited.clone(),
        );
        assert_eq!(p.ok().and_then(|p| p.start), Some(own));
        let p = plan(
            "k",
            state.clone(),
            &source,
            &input(Some(Value::Null)),
            inherited.clone(),
        );
        assert_eq!(p.ok().map(|p| p.start), Some(None));
        // A Dockerfile's CMD replaces the base's.
        let df = BuildSource::Dockerfile("FROM x\nCMD [\"a\"]".into());
        let p = plan("k", state, &df, &input(None), inherited);
        assert_eq!(
            p.ok().and_then(|p| p.start),
            Some(json!({"command": "'a'"}))
        );
    }
}
