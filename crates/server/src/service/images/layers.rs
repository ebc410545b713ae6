//! The layers a build keeps: after each step the build machine's disk is
//! captured as `data_dir/images/layers/<key>/disk.qcow2`, a qcow2 overlay
//! on the layer it started from (or on the base image). Layers go only
//! when pruned (`prune.rs`), once nothing uses them.

use std::path::PathBuf;

use runtime_host::HostError;

use crate::domain::image::steps;
use crate::AppState;

/// Why a step's disk could not be kept.
#[derive(Debug, thiserror::Error)]
pub(super) enum LayerError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Capture(HostError),
}

pub(super) fn dir(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("layers")
}

/// The disk of the layer named `key`.
pub(super) fn disk(st: &AppState, key: &str) -> PathBuf {
    dir(st).join(key).join("disk.qcow2")
}

/// Whether the layer named `key` is kept.
pub(super) fn kept(st: &AppState, key: &str) -> bool {
    disk(st, key).exists()
}

/// The key the server's own image starts a chain with.
pub(super) fn base_key() -> String {
    format!("base-{}", runtime_host::artifacts::rootfs_key())
}

/// Captures machine `vm`'s disk as the layer `key`: into a partial
/// directory first, readable by QEMU's user, then renamed into place (so a
/// layer that exists is whole).
pub(super) async fn keep(st: &AppState, vm: &str, key: &str) -> Result<(), LayerError> {
    let layers = dir(st);
    let done = layers.join(key);
    let partial = layers.join(steps::partial_layer(key));
    remove_dir(&partial);
    std::fs::create_dir_all(&layers)?;
    st.host()
        .capture(vm, &partial, false)
        .await
        .map_err(LayerError::Capture)?;
    {
        use std::os::unix::fs::PermissionsExt;
        let images = st.config().data_dir.join("images");
        for (p, mode) in [
            (images, 0o711),
            (layers.clone(), 0o711),
            (partial.clone(), 0o711),
            (partial.join("disk.qcow2"), 0o644),
        ] {
            if let Err(e) = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)) {
                tracing::warn!(path = %p.display(), error = %e, "opening a layer to QEMU's user failed");
            }
        }
    }
    remove_dir(&done);
    std::fs::rename(&partial, &done)?;
    Ok(())
}

/// Removes a directory that may not be there.
fn remove_dir(p: &std::path::Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %p.display(), error = %e, "removing an old layer failed");
        }
    }
}
