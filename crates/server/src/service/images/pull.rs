//! A registry image as a build's base (docs/images.md "Registry images"):
//! pulled on the host through the build's own egress (`runtime_host::oci`),
//! its layers decompressed into plain tars, then unpacked by root inside a
//! throwaway machine on our own base image (layer tars are hostile: the
//! host never extracts them) onto a blank ext4 volume, which becomes the
//! image's first layer (`images/layers/<key>/disk.qcow2`). The key is the
//! manifest's digest and [`UNPACK_VERSION`], so a later build of the same
//! image skips the pull and the unpack, and a blob already kept skips its
//! download.

use std::path::{Path, PathBuf};

use runtime_host::oci::{self, PullOptions, Reference, RunConfig};
use runtime_host::{ExecEvent, ExecSpec, RunAs, VolumeDrive};

use super::layers;
use crate::domain::image::steps::{partial_layer, short_key};
use crate::domain::image::LogStream;
use crate::AppState;

/// Changes whenever the unpacking (and so the disk it makes) changes.
const UNPACK_VERSION: &str = "2";
/// Most bytes of one layer, compressed or not, and of an image's layers
/// together.
pub(super) const MAX_LAYER_BYTES: u64 = 8 << 30;
pub(super) const MAX_IMAGE_BYTES: u64 = 16 << 30;
/// The smallest disk a sandbox may have.
const MIN_DISK_MIB: u64 = 3072;
const SCRIPT: &str = include_str!("unpack.py");
const UNPACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// Why a registry base could not be made.
#[derive(Debug, thiserror::Error)]
pub(super) enum PullFailed {
    #[error("pulling {reference}: {cause}")]
    Pull {
        reference: String,
        cause: oci::PullError,
    },
    #[error("unpacking {reference}: {problem}")]
    Unpack { reference: String, problem: String },
}

/// A registry image made into a layer.
pub(super) struct Base {
    /// The layer's key (`oci-…`).
    pub(super) key: String,
    /// `registry/repo:tag@sha256:…`.
    pub(super) pinned: String,
    pub(super) config: RunConfig,
}

fn blobs_dir(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("blobs")
}

/// The layer key of a pulled manifest.
fn layer_key(manifest_digest: &str) -> String {
    let hex = manifest_digest.trim_start_matches("sha256:");
    format!("oci-v{UNPACK_VERSION}-{hex}")
}

/// The config of a pulled manifest, kept beside its layer so that a build
/// that finds the layer needs no pull (`config.json`).
fn config_path(st: &AppState, key: &str) -> PathBuf {
    layers::disk(st, key).with_file_name("config.json")
}

/// Pulls `r` (unless its layer is kept) and makes its layer, logging to
/// image `id`'s build log. `net` is a network set on the host (the
/// build's rules).
pub(super) async fn base(
    st: &AppState,
    id: &str,
    net: &str,
    r: &Reference,
    credentials: Option<oci::Credentials>,
) -> Result<Base, PullFailed> {
    let canonical = r.canonical();
    let log = |text: String| super::build::log_line(st, id, None, LogStream::System, &text);
    // A digest names its manifest for good: a kept layer needs no registry.
    if let Some(d) = &r.digest {
        let key = layer_key(d);
        if let Some(config) = kept(st, &key) {
            log(format!("{canonical}: layer {} (cached)", short_key(&key)));
            return Ok(Base {
                key,
                pinned: canonical,
                config,
            });
        }
    }
    log(format!("pulling {canonical}"));
    let opts = PullOptions {
        cache_dir: blobs_dir(st),
        mirrors: st.config().registry_mirrors.clone(),
        insecure: st.config().registry_insecure.clone(),
        max_layer_bytes: MAX_LAYER_BYTES,
        max_image_bytes: MAX_IMAGE_BYTES,
    };
    let progress = |line: String| log(line);
    let pulled = oci::pull(&**st.host(), net, r, credentials, &opts, &progress)
        .await
        .map_err(|cause| PullFailed::Pull {
            reference: canonical.clone(),
            cause,
        })?;
    if pulled.source != r.registry
        && !(r.registry == oci::DOCKER_HUB && pulled.source == oci::DOCKER_HUB_API)
    {
        log(format!("{canonical}: pulled from mirror {}", pulled.source));
    }
    let key = layer_key(&pulled.manifest_digest);
    let pinned = match &r.digest {
        Some(_) => canonical.clone(),
        None => format!("{canonical}@{}", pulled.manifest_digest),
    };
    if let Some(config) = kept(st, &key) {
        log(format!(
            "{canonical}: unpacked layer {} (cached)",
            short_key(&key)
        ));
        return Ok(Base {
            key,
            pinned,
            config,
        });
    }
    let unpack_err = |problem: String| PullFailed::Unpack {
        reference: canonical.clone(),
        problem,
    };
    let work = st.config().data_dir.join("images").join("unpack").join(net);
    let result = unpack(st, id, net, &pulled, &work, &key).await;
    if let Err(e) = std::fs::remove_dir_all(&work) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %work.display(), error = %e, "removing an unpack directory failed");
        }
    }
    result.map_err(|e| match e {
        Unpacked::Pull(cause) => PullFailed::Pull {
            reference: canonical.clone(),
            cause,
        },
        Unpacked::Other(p) => unpack_err(p),
    })?;
    Ok(Base {
        key,
        pinned,
        config: pulled.config,
    })
}

/// After a restart (no build runs yet): what pulls and unpacks cut short
/// left, their scratch directories and partial blobs, is removed.
pub(super) fn sweep(st: &AppState) {
    let images = st.config().data_dir.join("images");
    if let Err(e) = std::fs::remove_dir_all(images.join("unpack")) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, "removing old unpack directories failed");
        }
    }
    let Ok(blobs) = std::fs::read_dir(blobs_dir(st).join("sha256")) else {
        return;
    };
    for entry in blobs.flatten() {
        if entry.file_name().to_string_lossy().contains(".partial-") {
            if let Err(e) = std::fs::remove_file(entry.path()) {
                tracing::warn!(path = %entry.path().display(), error = %e, "removing a partial blob failed");
            }
        }
    }
}

/// A kept layer's config; `None` when the layer is not whole.
fn kept(st: &AppState, key: &str) -> Option<RunConfig> {
    if !layers::kept(st, key) {
        return None;
    }
    let text = std::fs::read(config_path(st, key)).ok()?;
    serde_json::from_slice::<KeptConfig>(&text)
        .ok()
        .map(|k| k.into_config())
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct KeptConfig {
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
}

impl KeptConfig {
    fn of(c: &RunConfig) -> Self {
        KeptConfig {
            env: c.env.clone(),
            working_dir: c.working_dir.clone(),
            user: c.user.clone(),
            cmd: c.cmd.clone(),
            entrypoint: c.entrypoint.clone(),
        }
    }

    fn into_config(self) -> RunConfig {
        RunConfig {
            env: self.env,
            working_dir: self.working_dir,
            user: self.user,
            cmd: self.cmd,
            entrypoint: self.entrypoint,
        }
    }
}

enum Unpacked {
    Pull(oci::PullError),
    Other(String),
}

impl From<std::io::Error> for Unpacked {
    fn from(e: std::io::Error) -> Self {
        Unpacked::Other(e.to_string())
    }
}

/// Runs `cmd`, failing with its stderr.
fn run(cmd: &mut std::process::Command, what: &str) -> Result<(), Unpacked> {
    let out = cmd
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .output()
        .map_err(|e| Unpacked::Other(format!("{what}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Unpacked::Other(format!(
            "{what}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Where a host's static busybox may be.
const BUSYBOX: &[&str] = &["/usr/bin/busybox", "/bin/busybox"];

/// Copies the host's static busybox and its applet list into `dir` for
/// the unpack (docs/images.md, "Images without a shell"); false when the
/// host has none (a dynamic one would need the image's libc).
fn supply_busybox(dir: &Path) -> bool {
    let Some(bb) = BUSYBOX
        .iter()
        .map(Path::new)
        .find(|p| is_static_elf(p).unwrap_or(false))
    else {
        return false;
    };
    let list = match std::process::Command::new(bb).arg("--list").output() {
        Ok(out) if out.status.success() => out.stdout,
        _ => return false,
    };
    std::fs::copy(bb, dir.join("busybox")).is_ok()
        && std::fs::write(dir.join("busybox.list"), list).is_ok()
}

/// Whether `path` is a 64-bit ELF executable with no program interpreter
/// (statically linked).
fn is_static_elf(path: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let mut head = Vec::new();
    std::fs::File::open(path)?
        .take(64 * 1024)
        .read_to_end(&mut head)?;
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 {
        return Ok(false);
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(head[0x20..0x28].try_into().unwrap_or_default()) as usize;
    let (size, count) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for i in 0..count {
        let Some(h) = phoff
            .checked_add(i * size)
            .and_then(|at| head.get(at..at.checked_add(4)?))
        else {
            return Ok(false);
        };
        if u32::from_le_bytes(h.try_into().unwrap_or_default()) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Unpacked> + Send + 'static,
) -> Result<T, Unpacked> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Unpacked::Other(e.to_string()))?
}

async fn unpack(
    st: &AppState,
    id: &str,
    vm: &str,
    pulled: &oci::Pulled,
    work: &Path,
    key: &str,
) -> Result<(), Unpacked> {
    use std::os::unix::fs::PermissionsExt;
    let log = |text: String| super::build::log_line(st, id, None, LogStream::System, &text);
    let tars = work.join("in");
    std::fs::create_dir_all(&tars)?;
    for p in [work.parent().unwrap_or(work), work] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o711))?;
    }
    // Plain tars, in order.
    let mut total: u64 = 0;
    for (i, l) in pulled.layers.iter().enumerate() {
        let n = oci::decompress(l, &tars.join(format!("{i:03}.tar")), MAX_LAYER_BYTES)
            .await
            .map_err(Unpacked::Pull)?;
        total += n;
        if total > MAX_IMAGE_BYTES {
            return Err(Unpacked::Pull(oci::PullError::TooBig {
                what: "the image's layers decompressed".into(),
                limit: MAX_IMAGE_BYTES,
            }));
        }
    }
    // The script rides on the layers' volume (it reads only `*.tar`), and
    // so does the host's static busybox, for an image with no shell.
    std::fs::write(tars.join("unpack.py"), SCRIPT)?;
    {
        let tars = tars.clone();
        if !blocking(move || Ok(supply_busybox(&tars))).await? {
            log("no static busybox on this host (Debian's busybox-static): an image without a shell gets none".into());
        }
    }
    log(format!(
        "unpacking {} layers ({:.1} MiB of tar)",
        pulled.layers.len(),
        total as f64 / 1048576.0
    ));
    // The layers as a volume, and a blank target sized from them.
    let in_mib = (total >> 20) + total / (8 << 20) + 64;
    let target_mib = ((total >> 20) * 3 / 2 + 512).max(MIN_DISK_MIB);
    let input = work.join("layers.ext4");
    let target = work.join("root.ext4");
    {
        let (input, tars, target) = (input.clone(), tars.clone(), target.clone());
        blocking(move || {
            run(
                std::process::Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-m", "0", "-E", "root_owner=0:0", "-d"])
                    .arg(&tars)
                    .arg(&input)
                    .arg(format!("{in_mib}M")),
                "mkfs.ext4 of the layers",
            )?;
            runtime_host::volume::create_volume_file(&target, target_mib as u32)
                .map_err(|e| Unpacked::Other(format!("the blank root file system: {e}")))
        })
        .await?;
    }
    let guest_ca_pem = crate::service::network::prepare_guest(st, vm);
    let spec = runtime_host::MachineSpec {
        id: vm.to_string(),
        vcpu: 2,
        memory_mib: 1024,
        disk_mib: 3072,
        hostname: "unpack".into(),
        guest_ca_pem,
        volumes: vec![
            VolumeDrive {
                file: input,
                path: "/mnt/oci-layers".into(),
                snapshot: false,
            },
            VolumeDrive {
                file: target.clone(),
                path: "/mnt/oci-root".into(),
                snapshot: false,
            },
        ],
        image: None,
        no_template: true,
    };
    st.host()
        .start(&spec)
        .await
        .map_err(|e| Unpacked::Other(format!("the unpack machine did not start: {e}")))?;
    let ran = run_script(st, id, vm).await;
    if let Err(e) = st.host().destroy(vm).await {
        tracing::warn!(image_id = id, vm, error = %e, "ending the unpack machine failed");
    }
    ran?;
    // The target is the image's first layer.
    let layers_dir = st.config().data_dir.join("images").join("layers");
    let done = layers_dir.join(key);
    let partial = layers_dir.join(partial_layer(key));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial)?;
    let disk = partial.join("disk.qcow2");
    {
        let (target, disk) = (target.clone(), disk.clone());
        blocking(move || {
            run(
                std::process::Command::new("qemu-img")
                    .args(["convert", "-q", "-O", "qcow2"])
                    .arg(&target)
                    .arg(&disk),
                "qemu-img convert",
            )
        })
        .await?;
    }
    let cfg = serde_json::to_vec(&KeptConfig::of(&pulled.config))
        .map_err(|e| Unpacked::Other(e.to_string()))?;
    std::fs::write(partial.join("config.json"), cfg)?;
    for (p, mode) in [
        (layers_dir.clone(), 0o711),
        (partial.clone(), 0o711),
        (disk, 0o644),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))?;
    }
    if layers::kept(st, key) {
        // Another build unpacked the same image meanwhile: its layer may be
        // in use already, so it stays and this copy goes.
        let _ = std::fs::remove_dir_all(&partial);
        log(format!("layer {} was kept meanwhile", short_key(key)));
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(&done);
    std::fs::rename(&partial, &done)?;
    log(format!("unpacked into layer {}", short_key(key)));
    Ok(())
}

async fn run_script(st: &AppState, id: &str, vm: &str) -> Result<(), Unpacked> {
    let spec = ExecSpec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            // The layers' volume is only read.
            "mount -o remount,ro /mnt/oci-layers && python3 /mnt/oci-layers/unpack.py /mnt/oci-layers /mnt/oci-root && umount /mnt/oci-root".into(),
        ],
        cwd: Some("/".into()),
        env: Vec::new(),
        user: RunAs::Root,
        timeout: Some(UNPACK_TIMEOUT),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    };
    let mut h = st
        .host()
        .exec(vm, spec)
        .await
        .map_err(|e| Unpacked::Other(format!("the unpack could not start: {e}")))?;
    let mut out = crate::domain::image::steps::StepOutput::default();
    let status = loop {
        match h.events.recv().await {
            Some(ExecEvent::Stdout(b)) | Some(ExecEvent::Stderr(b)) => {
                if let Some(done) = out.push(&b) {
                    super::build::log_line(st, id, None, LogStream::Output, &done);
                }
            }
            Some(ExecEvent::Exited(x)) => break x,
            None => return Err(Unpacked::Other("lost the unpack machine".into())),
        }
    };
    if let Some(rest) = out.finish() {
        super::build::log_line(st, id, None, LogStream::Output, &rest);
    }
    if status.code != Some(0) {
        return Err(Unpacked::Other(format!(
            "the unpack ended with {:?}; its last output:\n{}",
            status.code,
            out.tail().join("\n")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_static_elf_is_supplied_as_a_shell() {
        let dir = std::env::temp_dir().join(format!("rt-elf-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let elf = |interp: bool| {
            let mut b = vec![0u8; 64 + 56];
            b[..4].copy_from_slice(b"\x7fELF");
            b[4] = 2;
            b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
            b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
            b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
            b[64..68].copy_from_slice(&(if interp { 3u32 } else { 1 }).to_le_bytes());
            b
        };
        let write = |name: &str, data: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, data).unwrap();
            p
        };
        assert!(is_static_elf(&write("static", &elf(false))).unwrap());
        assert!(!is_static_elf(&write("dynamic", &elf(true))).unwrap());
        assert!(!is_static_elf(&write("script", b"#!/bin/sh\necho hi\n")).unwrap());
        // Program headers past what was read, or past any end: not static.
        let mut far = elf(false);
        far[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!is_static_elf(&write("far", &far)).unwrap());
        // This test binary is linked dynamically.
        assert!(!is_static_elf(Path::new("/proc/self/exe")).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn layer_keys_name_the_manifest_and_the_procedure() {
        let d = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(layer_key(&d), format!("oci-v2-{}", "ab".repeat(32)));
    }
}
