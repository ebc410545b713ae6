//! The build: a build machine on the layer the first step not kept runs
//! on (another for each later stage of a multi-stage build that runs on
//! another layer, with the layers its `COPY --from` steps copy out of as
//! volumes), each remaining step run in it as a command (network through
//! the egress proxy like any sandbox's, no egress secrets), its disk kept
//! as a layer after each. Every change to the image's record and log goes through the
//! store as it happens, so a client polling the image sees the build move.

use std::time::{Duration, Instant};

use runtime_host::{ExecEvent, ExecSpec, HostError, RunAs};

use super::context;
use super::layers::{self, LayerError};
use crate::domain::image::context::ContextError;
use crate::domain::image::steps::{self, StepEnd, StepOutput};
use crate::domain::image::{tags_on_ready, Image, ImageState, LogStream, Step, StepState};
use crate::domain::time::iso;
use crate::error::ApiError;
use crate::AppState;

/// Most log lines an image keeps (the newest are dropped past it).
const MAX_LOG_LINES: usize = 5000;
const STEP_TIMEOUT: Duration = Duration::from_secs(1800);

/// Why a build failed. The text is the image's `error`: the failing step's
/// number and instruction, how it ended and its last output.
#[derive(Debug, thiserror::Error)]
pub(super) enum BuildError {
    #[error("the image went away")]
    Gone,
    #[error("{0}")]
    Network(ApiError),
    #[error("the build machine did not start: {0}")]
    MachineStart(HostError),
    #[error("step {n} ({instruction}) could not start: {cause}")]
    StepStart {
        n: usize,
        instruction: String,
        cause: HostError,
    },
    #[error("step {n} ({instruction}): lost the build machine")]
    MachineLost { n: usize, instruction: String },
    #[error("step {n} ({instruction}) {end}; its last output:\n{tail}")]
    StepFailed {
        n: usize,
        instruction: String,
        end: StepEnd,
        tail: String,
    },
    #[error("step {n} ({instruction}): placing its files failed: {cause}")]
    Place {
        n: usize,
        instruction: String,
        cause: context::PlaceError,
    },
    #[error("step {n}: keeping its disk failed: {cause}")]
    KeepDisk { n: usize, cause: HostError },
    #[error("{0}")]
    Io(std::io::Error),
    #[error("{0}")]
    Pull(super::pull::PullFailed),
    #[error("{what}: {cause}")]
    PullFor {
        what: String,
        cause: super::pull::PullFailed,
    },
    #[error("on the pulled image: {0}")]
    Replan(ApiError),
    #[error("{0}")]
    Source(String),
    #[error("the build took longer than its limit, timeoutSeconds {seconds} (give build.timeoutSeconds up to 3600)")]
    TimedOut { seconds: u32 },
    #[error("step {n} ({instruction}) left {used_mib} MiB in the image, over its limit, maxImageMiB {max_mib} (give build.maxImageMiB up to 20480)")]
    TooBig {
        n: usize,
        instruction: String,
        used_mib: u64,
        max_mib: u32,
    },
}

/// After a restart: builds that were under way failed (their finished steps
/// stay cached, so building again resumes there); their machines end.
pub(crate) async fn recover(st: &AppState) -> Result<(), crate::ServerError> {
    super::pull::sweep(st);
    sweep_scratch(st);
    let images = match st.store().images() {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "reading images failed");
            return Ok(());
        }
    };
    let me = st.store().node().to_string();
    // Another control plane's builds are its own to settle.
    let here = |id: &str| {
        st.store()
            .image_node(id)
            .map(|n| n.is_none_or(|n| n == me))
            .unwrap_or(false)
    };
    for d in images
        .into_iter()
        .filter(|d| d.state.in_progress() && here(&d.id))
    {
        if let Some(vm) = &d.build_vm {
            if let Err(e) = st.host().destroy(vm).await {
                tracing::warn!(image_id = %d.id, vm = %vm, error = %e, "ending a build machine failed");
            }
            crate::service::network::sandbox_gone(st, vm);
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
pub(super) fn log_line(
    st: &AppState,
    id: &str,
    step: Option<usize>,
    stream: LogStream,
    text: &str,
) {
    let lines: Vec<&str> = text.lines().collect();
    if let Err(e) = st
        .store()
        .append_image_log(id, step, stream, &lines, MAX_LOG_LINES)
    {
        tracing::warn!(image_id = id, error = %e, "writing an image's log failed");
    }
    st.notify_image_change();
}

use log_line as log;

/// Changes an image's record (a failure is logged: the build goes on).
fn update(st: &AppState, id: &str, f: impl FnOnce(&mut Image)) {
    let r = st.store().update_image(id, |d| {
        f(d);
        true
    });
    if let Err(e) = r {
        tracing::warn!(image_id = id, error = %e, "recording an image's build failed");
    }
    st.notify_image_change();
}

/// Changes one step of an image's record.
fn update_step(st: &AppState, id: &str, index: usize, f: impl FnOnce(&mut Step)) {
    update(st, id, |d| {
        if let Some(s) = d.steps.get_mut(index) {
            f(s);
        }
    });
}

/// Pulls one registry image into a layer. The pull goes through a network
/// of its own with the build machine's settings (default rules, no egress
/// secrets); the unpack machine uses it too (and ends it), and recovery
/// ends it as a build machine.
async fn pull_one(
    st: &AppState,
    id: &str,
    r: &runtime_host::oci::Reference,
    key_id: &str,
    failed: impl FnOnce(super::pull::PullFailed) -> BuildError,
) -> Result<super::pull::Base, BuildError> {
    let net = uuid::Uuid::new_v4().to_string();
    let settings = crate::domain::network::CreateNet {
        rules: None,
        secrets: Some(Vec::new()),
    };
    crate::service::network::store_create(st, &net, &settings).map_err(BuildError::Network)?;
    let _ = crate::service::network::prepare_guest(st, &net);
    update(st, id, |d| d.build_vm = Some(net.clone()));
    // Credentials of the caller's key for this registry (images.registries).
    let credentials = super::registries::credentials_for(st, key_id, &r.registry);
    let pulled = super::pull::base(st, id, &net, r, credentials).await;
    crate::service::network::sandbox_gone(st, &net);
    update(st, id, |d| d.build_vm = None);
    pulled.map_err(failed)
}

/// How many builds each key runs at once (`image.builds`, read at each
/// try so that a changed quota applies to the builds waiting): the rest
/// wait `queued`, in no promised order.
#[derive(Default)]
pub(crate) struct BuildSlots {
    running: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    freed: tokio::sync::Notify,
}

/// A running build's place, given back when dropped.
struct Slot<'a> {
    slots: &'a BuildSlots,
    key_id: String,
}

impl BuildSlots {
    /// The builds `key_id` runs now.
    pub(crate) fn running(&self, key_id: &str) -> u64 {
        self.running
            .lock()
            .map_or(0, |m| m.get(key_id).copied().unwrap_or(0))
    }

    /// Takes a place for one of `key_id`'s builds once it has fewer than
    /// `limit()` running; `None` when the server shuts down meanwhile.
    async fn take(
        &self,
        key_id: &str,
        limit: impl Fn() -> u64,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> Option<Slot<'_>> {
        loop {
            // Registered before the count is read: a place freed between
            // the two wakes it.
            let freed = self.freed.notified();
            {
                let mut m = self.running.lock().unwrap_or_else(|p| p.into_inner());
                let n = m.entry(key_id.to_string()).or_default();
                if *n < limit().max(1) {
                    *n += 1;
                    return Some(Slot {
                        slots: self,
                        key_id: key_id.to_string(),
                    });
                }
            }
            tokio::select! {
                _ = freed => {}
                _ = cancel.cancelled() => return None,
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut m = self.slots.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.key_id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.key_id);
            }
        }
        drop(m);
        self.slots.freed.notify_waiters();
    }
}

/// Builds image `id` and records how that ended.
pub(super) async fn build(st: AppState, id: String, pending: Option<super::Pending>) {
    let key_id = match st.store().get_image(&id) {
        Ok(Some(d)) => d.key_id,
        _ => return,
    };
    let limit = || {
        crate::service::quotas::limits(&st, &key_id).map_or(
            crate::domain::quota::Limits::default().max("image.builds"),
            |l| l.max("image.builds"),
        )
    };
    if st.inner.build_slots.running(&key_id) >= limit().max(1) {
        log(
            &st,
            &id,
            None,
            LogStream::System,
            &format!(
                "queued: this key runs {} builds at once (image.builds)",
                limit().max(1)
            ),
        );
    }
    let Some(_slot) = st
        .inner
        .build_slots
        .take(&key_id, limit, &st.inner.cancel)
        .await
    else {
        return;
    };
    let started = Instant::now();
    let result = run_build(&st, &id, pending).await;
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
            let d = match st.store().get_image(&id) {
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
                match st.store().images() {
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
            let at = iso(st.now_ms());
            update(&st, &id, |d| {
                d.tags = tags;
                d.state = ImageState::Ready;
                d.ready_at = Some(at);
                d.build_seconds = Some(secs);
            });
            tracing::info!(image_id = %id, secs, "image ready");
        }
        Err(e) => {
            let message = e.to_string();
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

/// Pulls the registry images a build names (the base of its chain, and
/// those other stages start FROM or `COPY --from` names) into layers,
/// then reads the build's steps again on their keys and configs; answers
/// the image as recorded then.
async fn pull_base(st: &AppState, id: &str, mut p: super::Pending) -> Result<Image, BuildError> {
    let mut root = None;
    if let Some(r) = &p.reference {
        root = Some(pull_one(st, id, r, &p.key_id, BuildError::Pull).await?);
    }
    for (written, r, what) in &p.others {
        let failed = |cause| BuildError::PullFor {
            what: what.clone(),
            cause,
        };
        let base = pull_one(st, id, r, &p.key_id, failed).await?;
        let (state, _) = super::registry_state(&base.config);
        p.input.externals.insert(
            written.clone(),
            crate::domain::image::dockerfile::External {
                key: base.key,
                state,
            },
        );
    }
    let (base_key, state, start, pinned) = match root {
        Some(base) => {
            let (state, start) = super::registry_state(&base.config);
            (base.key, state, start, Some(base.pinned))
        }
        None => (
            p.base_key.clone(),
            p.state.clone(),
            p.inherited.clone(),
            None,
        ),
    };
    let plan =
        super::plan(&base_key, state, &p.source, &p.input, start).map_err(BuildError::Replan)?;
    let mut out = None;
    let r = st.store().update_image(id, |d| {
        d.base_key = base_key.clone();
        d.steps = plan.steps.clone();
        d.env = plan.state.env.clone();
        d.workdir = plan.state.workdir.clone();
        d.user = plan.state.user;
        d.start = plan.start.clone();
        if let Some(pinned) = &pinned {
            d.pulled = Some(pinned.clone());
        }
        out = Some(d.clone());
        true
    });
    if let Err(e) = r {
        tracing::warn!(image_id = id, error = %e, "recording a pulled base failed");
    }
    out.ok_or(BuildError::Gone)
}

async fn run_build(
    st: &AppState,
    id: &str,
    pending: Option<super::Pending>,
) -> Result<(), BuildError> {
    let d = match st.store().get_image(id) {
        Ok(Some(d)) => d,
        Ok(None) => return Err(BuildError::Gone),
        Err(e) => {
            tracing::warn!(image_id = id, error = %e, "reading an image to build failed");
            return Err(BuildError::Gone);
        }
    };
    update(st, id, |d| d.state = ImageState::Building);
    let limit = Duration::from_secs(u64::from(d.build.timeout_seconds));
    let deadline = Instant::now() + limit;
    let seconds = d.build.timeout_seconds;
    let timed_out = || BuildError::TimedOut { seconds };
    // A pull is not cut short (its machine and network end with it); the
    // limit is checked when it is done.
    let d = match pending {
        Some(p) => pull_base(st, id, p).await?,
        None => d,
    };
    if Instant::now() >= deadline {
        return Err(timed_out());
    }
    // The steps already kept are not run (a step's layer rests on the
    // one it ran on, so those are kept too).
    let kept: Vec<bool> = d.steps.iter().map(|s| layers::kept(st, &s.key)).collect();
    for s in d.steps.iter().filter(|s| kept.get(s.index) == Some(&true)) {
        log(
            st,
            id,
            Some(s.index),
            LogStream::System,
            &format!("{} (cached)", s.instruction),
        );
    }
    update(st, id, |d| {
        for s in d
            .steps
            .iter_mut()
            .filter(|s| kept.get(s.index) == Some(&true))
        {
            s.state = StepState::Cached;
        }
    });
    let cached = kept.iter().filter(|k| **k).count();
    if cached == d.steps.len() {
        return Ok(());
    }
    let mut machine: Option<Machine> = None;
    let result = async {
        for (i, s) in d.steps.iter().enumerate() {
            if kept[i] {
                continue;
            }
            let on = on_layer(&d, i);
            let fits = machine
                .as_ref()
                .is_some_and(|m| m.at == on && s.from_layer.iter().all(|l| m.sources.contains(l)));
            if !fits {
                if let Some(m) = machine.take() {
                    end_machine(st, id, m).await;
                }
                // The sources this step and the rest of its chain copy
                // from that are there now, as one machine's volumes.
                let mut sources: Vec<String> = Vec::new();
                for (j, later) in d.steps.iter().enumerate().skip(i) {
                    if j > i && later.on.is_some() {
                        break;
                    }
                    if let Some(l) = &later.from_layer {
                        if !sources.contains(l) && (j == i || layers::kept(st, l)) {
                            sources.push(l.clone());
                        }
                    }
                }
                log(
                    st,
                    id,
                    None,
                    LogStream::System,
                    &format!(
                        "build machine starting ({cached} of {} steps cached{})",
                        d.steps.len(),
                        if sources.is_empty() {
                            String::new()
                        } else {
                            format!(", {} stage layers to copy from", sources.len())
                        }
                    ),
                );
                machine = Some(start_machine(st, &d, &on, sources).await?);
            }
            let m = machine.as_mut().ok_or(BuildError::Gone)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            match run_step(st, &d, &m.vm, s, left.min(STEP_TIMEOUT)).await {
                Err(BuildError::StepFailed { .. }) if Instant::now() >= deadline => {
                    return Err(timed_out())
                }
                r => r?,
            }
            m.at = s.key.clone();
        }
        Ok(())
    }
    .await;
    if let Some(m) = machine.take() {
        end_machine(st, id, m).await;
    }
    result
}

/// A build machine while it runs: on which layer its disk now is, and the
/// source layers it has as volumes (with their scratch copies' folder).
struct Machine {
    vm: String,
    at: String,
    sources: Vec<String>,
    scratch: Option<std::path::PathBuf>,
}

/// The layer step `i` runs on: its own `on` (a stage's first step), the
/// step before's, or the base's.
fn on_layer(d: &Image, i: usize) -> String {
    match d.steps.get(i).and_then(|s| s.on.clone()) {
        Some(k) => k,
        None => match i.checked_sub(1).and_then(|j| d.steps.get(j)) {
            Some(prev) => prev.key.clone(),
            None => d.base_key.clone(),
        },
    }
}

/// Where the build's copies of `COPY --from` source layers go while its
/// machine runs (removed with it, and at a restart).
fn scratch_root(st: &AppState) -> std::path::PathBuf {
    st.config().data_dir.join("images").join("from")
}

/// Boots a build machine on layer `on` (the server's own image for its
/// base key) with `sources` (layers) as volumes at their mount points: each
/// a raw copy of the layer's disk, which the machine may write (its journal
/// is replayed at the mount) and which goes with it.
async fn start_machine(
    st: &AppState,
    d: &Image,
    on: &str,
    sources: Vec<String>,
) -> Result<Machine, BuildError> {
    let vm = uuid::Uuid::new_v4().to_string();
    // The build machine has the network of a sandbox with default rules
    // and no egress secrets.
    let net = crate::domain::network::CreateNet {
        rules: None,
        secrets: Some(Vec::new()),
    };
    crate::service::network::store_create(st, &vm, &net).map_err(BuildError::Network)?;
    update(st, &d.id, |d| d.build_vm = Some(vm.clone()));
    let mut m = Machine {
        vm: vm.clone(),
        at: on.to_string(),
        sources: sources.clone(),
        scratch: None,
    };
    let ours = on == layers::base_key();
    let mut volumes = Vec::new();
    if !sources.is_empty() {
        let dir = scratch_root(st).join(&vm);
        m.scratch = Some(dir.clone());
        let copies = copy_sources(st, &dir, &sources).await;
        let files = match copies {
            Ok(f) => f,
            Err(e) => {
                end_machine(st, &d.id, m).await;
                return Err(e);
            }
        };
        for (file, layer) in files.into_iter().zip(&sources) {
            volumes.push(runtime_host::VolumeDrive {
                file,
                path: steps::from_mount(layer),
                snapshot: false,
            });
        }
    }
    let spec = runtime_host::MachineSpec {
        id: vm.clone(),
        vcpu: d.build.vcpu,
        memory_mib: d.build.memory_mib,
        // The guest grows its file system to its disk: the image's is this
        // large, and a sandbox from it has at least this disk.
        disk_mib: d.build.disk_mib,
        hostname: "build".into(),
        guest_ca_pem: crate::service::network::prepare_guest(st, &vm),
        volumes,
        image: (!ours).then(|| runtime_host::ImageDisk {
            disk: layers::disk(st, on),
            key: steps::short_key(on),
        }),
        // A machine on the server's own image may come from its template.
        no_template: !ours,
    };
    if let Err(e) = st.host().start(&spec).await {
        end_machine(st, &d.id, m).await;
        return Err(BuildError::MachineStart(e));
    }
    Ok(m)
}

/// Raw copies of `layers`' disks in `dir`, in order (the guest mounts a
/// volume as a raw ext4 file system).
async fn copy_sources(
    st: &AppState,
    dir: &std::path::Path,
    sources: &[String],
) -> Result<Vec<std::path::PathBuf>, BuildError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(BuildError::Io)?;
    for p in [scratch_root(st), dir.to_path_buf()] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o711))
            .map_err(BuildError::Io)?;
    }
    let mut out = Vec::new();
    for (n, layer) in sources.iter().enumerate() {
        if layer == &layers::base_key() {
            return Err(BuildError::Source(
                "COPY --from the server's own image as it is: copy from a stage that has a step of its own (or from one of your images)".into(),
            ));
        }
        let disk = layers::disk(st, layer);
        if !disk.exists() {
            return Err(BuildError::Source(format!(
                "the layer {} to copy from is not there (pruned meanwhile?): build again",
                steps::short_key(layer)
            )));
        }
        let file = dir.join(format!("{n}.raw"));
        let status = tokio::process::Command::new("qemu-img")
            .args(["convert", "-q", "-f", "qcow2", "-O", "raw"])
            .arg(&disk)
            .arg(&file)
            .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
            .output()
            .await
            .map_err(BuildError::Io)?;
        if !status.status.success() {
            return Err(BuildError::Source(format!(
                "copying layer {}: qemu-img convert: {}",
                steps::short_key(layer),
                String::from_utf8_lossy(&status.stderr).trim()
            )));
        }
        out.push(file);
    }
    Ok(out)
}

/// Ends a build machine, its network and its scratch copies.
async fn end_machine(st: &AppState, id: &str, m: Machine) {
    if let Err(e) = st.host().destroy(&m.vm).await {
        tracing::warn!(image_id = id, vm = %m.vm, error = %e, "ending the build machine failed");
    }
    crate::service::network::sandbox_gone(st, &m.vm);
    update(st, id, |d| d.build_vm = None);
    if let Some(dir) = m.scratch {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %dir.display(), error = %e, "removing a build's copies failed");
            }
        }
    }
}

/// After a restart: the copies of source layers that builds left.
fn sweep_scratch(st: &AppState) {
    if let Err(e) = std::fs::remove_dir_all(scratch_root(st)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, "removing old build copies failed");
        }
    }
}

async fn run_step(
    st: &AppState,
    d: &Image,
    vm: &str,
    s: &Step,
    timeout: Duration,
) -> Result<(), BuildError> {
    let id = d.id.as_str();
    let started = Instant::now();
    let n = s.index + 1;
    update_step(st, id, s.index, |s| s.state = StepState::Running);
    log(st, id, Some(s.index), LogStream::System, &s.instruction);
    if let Some(plan) = &s.copy {
        let archive = d.context.as_ref().ok_or_else(|| BuildError::Place {
            n,
            instruction: s.instruction.clone(),
            cause: context::PlaceError::Context(ContextError::Missing(Vec::new())),
        })?;
        context::place(st, &d.key_id, archive, plan, vm)
            .await
            .map_err(|cause| BuildError::Place {
                n,
                instruction: s.instruction.clone(),
                cause,
            })?;
    }
    // In a subshell: its status is its last command's, so a failing `a &&
    // b` at the end fails the step (after `set -e` alone, bash would go on
    // to `sync` and succeed).
    let script = format!(
        "(\nset -e\n{}\n) && sync",
        s.script.as_deref().unwrap_or("true")
    );
    let mut env = s.env.clone();
    env.push(("DEBIAN_FRONTEND".into(), "noninteractive".into()));
    let spec = ExecSpec {
        argv: vec!["bash".into(), "-c".into(), script],
        cwd: s.workdir.clone(),
        env,
        user: if s.root { RunAs::Root } else { RunAs::Sandbox },
        timeout: Some(timeout),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    };
    let mut h = st
        .host()
        .exec(vm, spec)
        .await
        .map_err(|cause| BuildError::StepStart {
            n,
            instruction: s.instruction.clone(),
            cause,
        })?;
    runtime_host::crash_point(st.config().test_crash_at.as_deref(), "build_step");
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
                return Err(BuildError::MachineLost {
                    n,
                    instruction: s.instruction.clone(),
                })
            }
        }
    };
    if let Some(rest) = out.finish() {
        log(st, id, Some(s.index), LogStream::Output, &rest);
    }
    if let Some(end) = StepEnd::of(status.code, status.timed_out, status.signal) {
        return Err(BuildError::StepFailed {
            n,
            instruction: s.instruction.clone(),
            end,
            tail: out.tail().join("\n"),
        });
    }
    // Over the image's size limit: failed, and not kept.
    match used_mib(st, vm).await {
        Some(used_mib) if used_mib > u64::from(d.build.max_image_mib) => {
            return Err(BuildError::TooBig {
                n,
                instruction: s.instruction.clone(),
                used_mib,
                max_mib: d.build.max_image_mib,
            });
        }
        Some(used_mib) => log(
            st,
            id,
            Some(s.index),
            LogStream::System,
            &format!("{used_mib} MiB in the image"),
        ),
        None => log(
            st,
            id,
            Some(s.index),
            LogStream::System,
            "no df in the image (nor ours): its size is not checked against maxImageMiB",
        ),
    }
    // Keep the disk as this step's layer.
    layers::keep(st, vm, &s.key).await.map_err(|e| match e {
        LayerError::Io(e) => BuildError::Io(e),
        LayerError::Capture(cause) => BuildError::KeepDisk { n, cause },
    })?;
    let secs = started.elapsed().as_secs_f64();
    update_step(st, id, s.index, |s| {
        s.state = StepState::Done;
        s.seconds = Some(secs);
    });
    Ok(())
}

/// What the build machine's root file system holds, in MiB (`df`'s used
/// blocks): the image's `df`, else the one of the busybox supplied to an
/// image without a shell (distroless); `None` when neither answers
/// anything readable (the limit is then not checked for that step).
async fn used_mib(st: &AppState, vm: &str) -> Option<u64> {
    for df in ["df", "/usr/lib/runtime/bin/df"] {
        if let Some(mib) = df_used_mib(st, vm, df).await {
            return Some(mib);
        }
    }
    None
}

async fn df_used_mib(st: &AppState, vm: &str, df: &str) -> Option<u64> {
    let spec = ExecSpec {
        argv: vec![df.into(), "-Pk".into(), "/".into()],
        cwd: None,
        env: Vec::new(),
        user: RunAs::Root,
        timeout: Some(Duration::from_secs(60)),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    };
    let mut h = st.host().exec(vm, spec).await.ok()?;
    let mut out = Vec::new();
    loop {
        match h.events.recv().await? {
            ExecEvent::Stdout(b) if out.len() < 64 * 1024 => out.extend_from_slice(&b),
            ExecEvent::Exited(x) if x.code == Some(0) => break,
            ExecEvent::Exited(_) => return None,
            _ => {}
        }
    }
    df_used_kib(&String::from_utf8_lossy(&out)).map(|k| k.div_ceil(1024))
}

/// The `Used` column (KiB) of `df -Pk /`'s one line of data.
fn df_used_kib(text: &str) -> Option<u64> {
    text.lines().nth(1)?.split_whitespace().nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::df_used_kib;

    #[test]
    fn the_used_column_of_df_is_read_and_anything_else_is_not() {
        let gnu = "Filesystem     1024-blocks    Used Available Capacity Mounted on\n/dev/vda           3030800 1893216    964412      67% /\n";
        assert_eq!(df_used_kib(gnu), Some(1_893_216));
        let busybox = "Filesystem           1024-blocks      Used Available Capacity Mounted on\n/dev/vda               3030800     51200   2979600   2% /\n";
        assert_eq!(df_used_kib(busybox), Some(51_200));
        assert_eq!(df_used_kib("df: /: No such file or directory\n"), None);
        assert_eq!(df_used_kib("header\n/dev/vda x y\n"), None);
    }
}
