//! Letting go of what no image uses (`POST /v1/images:prune`, `runtime
//! image prune`, and on its own when the data directory's disk is short):
//! layers that no image record names and no disk rests on, and the blob
//! cache of registry pulls (every pulled image is already a layer).
//!
//! A layer is kept when an image record (of any state, so a failed build's
//! steps stay cached until its image is deleted) names it as a step or a
//! base, or when any qcow2 disk under the data directory (a machine's
//! overlay, a template, a snapshot, another kept layer) rests on it through
//! its chain of backing files. Anything younger than [`MIN_AGE`] stays: it
//! may belong to a build that just started. The records are read and the
//! layers removed under the prune gate, which a new image's insert also
//! takes, so a build never starts on a layer being removed.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use runtime_host::disk_files::{backing_file, free_bytes};

use super::layers;
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// What is younger than this is never removed.
const MIN_AGE: Duration = Duration::from_secs(600);
/// How deep under the data directory disks are looked for.
const MAX_DEPTH: usize = 5;
/// Below this many free bytes, the server prunes on its own.
pub(crate) const PRUNE_BELOW_FREE: u64 = 2 << 30;

/// What a prune removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pruned {
    pub(crate) layers: usize,
    pub(crate) blobs: usize,
    pub(crate) bytes: u64,
}

fn blobs_dir(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("blobs")
}

/// Removes the layers and blobs nothing uses.
pub(crate) fn prune(st: &AppState) -> ApiResult<Pruned> {
    let _g = st
        .inner
        .prune_gate
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let io = |what: &'static str| {
        move |e: std::io::Error| ApiError::Internal {
            what: format!("{what}: {e}"),
        }
    };
    let data = st.config().data_dir.clone();
    // Backing files are compared as the file system resolves them, so a
    // data directory named through a link still matches.
    let layers_dir = layers::dir(st);
    let layers_dir = layers_dir.canonicalize().unwrap_or(layers_dir);
    let mut named: HashSet<String> = HashSet::new();
    for d in st.store().images()? {
        // A deleted version no sandbox uses any more goes now.
        if d.deleted && !super::in_use(st, &d.id)? {
            st.store().delete_image(&d.id)?;
            continue;
        }
        named.insert(d.base_key.clone());
        named.extend(d.steps.iter().map(|s| s.key.clone()));
        // What a COPY --from copied out of (a pulled image no step rests on).
        named.extend(d.steps.iter().filter_map(|s| s.from_layer.clone()));
    }
    // Every disk that may rest on a layer: outside the layers, and the
    // named layers themselves.
    let mut roots = Vec::new();
    let data = data.canonicalize().unwrap_or(data);
    disks_under(&data, &layers_dir, MAX_DEPTH, &mut roots).map_err(io("listing disks"))?;
    roots.extend(named.iter().map(|k| layers::disk(st, k)));
    let mut used: HashSet<String> = named;
    for root in roots {
        let mut at = root;
        // A chain is short; the bound guards against a loop.
        for _ in 0..256 {
            let next = match backing_file(&at) {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                // A disk that cannot be read might rest on anything.
                Err(e) => return Err(io("reading a disk's backing file")(e)),
            };
            if let Some(key) = layer_of(&layers_dir, &next) {
                if !used.insert(key) {
                    break;
                }
            }
            at = next;
        }
    }
    let mut out = Pruned::default();
    let now = SystemTime::now();
    let old = |p: &Path| {
        std::fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .map(|t| now.duration_since(t).unwrap_or_default() >= MIN_AGE)
            .unwrap_or(false)
    };
    if let Ok(entries) = std::fs::read_dir(&layers_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let p = e.path();
            if used.contains(&name) || !old(&p) {
                continue;
            }
            let bytes = size_of(&p);
            match std::fs::remove_dir_all(&p) {
                Ok(()) => {
                    out.layers += 1;
                    out.bytes += bytes;
                }
                Err(e) => tracing::warn!(layer = %name, error = %e, "removing a layer failed"),
            }
        }
    }
    let mut blobs = Vec::new();
    files_under(&blobs_dir(st), 3, &mut blobs);
    for b in blobs.into_iter().filter(|b| old(b)) {
        let bytes = size_of(&b);
        if std::fs::remove_file(&b).is_ok() {
            out.blobs += 1;
            out.bytes += bytes;
        }
    }
    if out.layers + out.blobs > 0 {
        tracing::info!(
            layers = out.layers,
            blobs = out.blobs,
            bytes = out.bytes,
            "pruned images"
        );
    }
    Ok(out)
}

/// Prunes when the data directory's file system has less than
/// [`PRUNE_BELOW_FREE`] bytes free.
pub(crate) fn prune_if_short(st: &AppState) {
    match free_bytes(&st.config().data_dir) {
        Ok(free) if free < PRUNE_BELOW_FREE => {
            tracing::warn!(free, "the data directory's disk is short: pruning images");
            if let Err(e) = prune(st) {
                tracing::warn!(error = %e, "pruning images failed");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "reading the data directory's free space failed"),
    }
}

/// The layer key of `disk` when it is a layer's disk.
fn layer_of(layers_dir: &Path, disk: &Path) -> Option<String> {
    let disk = disk.canonicalize().unwrap_or_else(|_| disk.to_path_buf());
    let rest = disk.strip_prefix(layers_dir).ok()?;
    let first = rest.components().next()?;
    Some(first.as_os_str().to_string_lossy().into_owned())
}

/// The `.qcow2` files under `dir`, down to `depth`, leaving out `skip`
/// and symbolic links.
fn disks_under(
    dir: &Path,
    skip: &Path,
    depth: usize,
    out: &mut Vec<PathBuf>,
) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        let p = e.path();
        let t = e.file_type()?;
        if p == skip || t.is_symlink() {
            continue;
        }
        if t.is_dir() && depth > 0 {
            disks_under(&p, skip, depth - 1, out)?;
        } else if t.is_file() && p.extension().is_some_and(|x| x == "qcow2") {
            out.push(p);
        }
    }
    Ok(())
}

/// The regular files under `dir`, down to `depth`.
fn files_under(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() && depth > 0 {
            files_under(&e.path(), depth - 1, out);
        } else if t.is_file() {
            out.push(e.path());
        }
    }
}

/// The bytes `p` holds on disk (a directory's files summed).
fn size_of(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if !m.is_dir() {
        return m.blocks() * 512;
    }
    let mut files = Vec::new();
    files_under(p, 3, &mut files);
    files
        .iter()
        .filter_map(|f| std::fs::symlink_metadata(f).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// A prune asked for by `key`, which must be an admin key (layers and
/// blobs are shared by every key's builds).
pub(crate) async fn prune_for(
    st: &AppState,
    key: &crate::domain::access::KeyInfo,
) -> ApiResult<Pruned> {
    if !key.account_wide || key.read_only {
        return Err(ApiError::AdminOnly {
            action: "prune images",
        });
    }
    let st = st.clone();
    tokio::task::spawn_blocking(move || prune(&st))
        .await
        .map_err(|e| ApiError::Internal {
            what: format!("pruning images: {e}"),
        })?
}
