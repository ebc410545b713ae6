//! A machine's disks: its directory, the qcow2 overlay on the base or image
//! disk, the sparse copies of `snapshot` volumes, and which files QEMU opens
//! as drives.

use std::path::{Path, PathBuf};

use crate::machine::QemuHost;
use crate::qemu::VmPaths;
use crate::types::{BootStage, HostError, MachineSpec};

impl QemuHost {
    /// The uid and gid machine `id`'s QEMU runs as, when the server is
    /// root: its own from the persisted pool (claimed on first use).
    pub(crate) fn vm_uid(&self, id: &str) -> Result<Option<(u32, u32)>, HostError> {
        if !crate::uid::as_root() {
            return Ok(None);
        }
        let uid = self.uids.claim(id).map_err(Self::io(id, "claim a uid"))?;
        Ok(Some((uid, uid)))
    }

    /// A fresh, empty VM directory (owned by the VM's uid, so QEMU can
    /// write its captures there). A machine still there is ended first:
    /// without its directory nothing would find its QEMU again.
    pub(crate) async fn fresh_dir(&self, spec: &MachineSpec) -> Result<VmPaths, HostError> {
        let id = spec.id.as_str();
        let paths = self.paths(id);
        self.end_any(id).await;
        let _ = std::fs::remove_dir_all(&paths.dir);
        std::fs::create_dir_all(&paths.dir).map_err(Self::io(id, "create vm dir"))?;
        if let Some((uid, gid)) = self.vm_uid(id)? {
            std::os::unix::fs::chown(&paths.dir, Some(uid), Some(gid))
                .map_err(Self::io(id, "chown vm dir"))?;
        }
        // Its QEMU's and the server's alone: another machine's QEMU (another
        // uid) can neither list it nor read its disk, state or console.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&paths.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(Self::io(id, "chmod vm dir"))?;
        Ok(paths)
    }

    /// An empty overlay on the base image (or the spec's image) of the
    /// spec's disk size.
    pub(crate) async fn new_overlay(
        &self,
        spec: &MachineSpec,
        paths: &VmPaths,
    ) -> Result<(), HostError> {
        let id = spec.id.as_str();
        let out = tokio::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(
                spec.image
                    .as_ref()
                    .map_or(&self.cfg.artifacts.base, |i| &i.disk),
            )
            .arg(paths.overlay())
            .arg(format!("{}M", spec.disk_mib))
            .output()
            .await
            .map_err(Self::io(id, "create overlay"))?;
        if !out.status.success() {
            return Err(self.start_failed(
                id,
                BootStage::Disk,
                format!("qemu-img: {}", String::from_utf8_lossy(&out.stderr).trim()),
            ));
        }
        Ok(())
    }

    /// Each `snapshot` volume's own sparse copy, in the VM's directory: the
    /// copy-on-write view the machine writes to and that goes with it.
    pub(crate) async fn copy_snapshot_volumes(
        &self,
        spec: &MachineSpec,
        paths: &VmPaths,
    ) -> Result<(), HostError> {
        let id = spec.id.as_str();
        for (i, v) in spec.volumes.iter().enumerate() {
            if v.snapshot {
                copy_sparse(&v.file, &paths.volume_copy(i))
                    .await
                    .map_err(|e| {
                        self.start_failed(id, BootStage::Disk, format!("copy of volume: {e}"))
                    })?;
            }
        }
        Ok(())
    }
}

/// Gives the machine's disk and volume drives to its QEMU's uid (when it
/// has one of its own).
pub(crate) fn hand_to_qemu(
    spec: &MachineSpec,
    paths: &VmPaths,
    run_as: Option<(u32, u32)>,
) -> Result<(), HostError> {
    let id = spec.id.as_str();
    if let Some((uid, gid)) = run_as {
        // QEMU reopens its disk as its own uid after a migration; no other
        // uid may read them.
        use std::os::unix::fs::PermissionsExt;
        let own = |file: &Path, what: &'static str| {
            std::os::unix::fs::chown(file, Some(uid), Some(gid))
                .and_then(|()| {
                    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600))
                })
                .map_err(QemuHost::io(id, what))
        };
        own(&paths.overlay(), "chown disk")?;
        for file in drive_files(spec, paths) {
            own(&file, "chown volume")?;
        }
    }
    Ok(())
}

/// Grows the qcow2 image at `path` to `mib` MiB when it is smaller (never
/// shrinks it).
pub(crate) async fn grow_to(path: &Path, mib: u32) -> Result<(), String> {
    let size = crate::disk_files::virtual_size(path)
        .map_err(|e| format!("reading the disk's header: {e}"))?
        .ok_or("the disk is not qcow2")?;
    let want = u64::from(mib) << 20;
    if want <= size {
        return Ok(());
    }
    let out = tokio::process::Command::new("qemu-img")
        .args(["resize", "-q", "-f", "qcow2"])
        .arg(path)
        .arg(want.to_string())
        .output()
        .await
        .map_err(|e| format!("qemu-img resize: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "qemu-img resize: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Copies a disk image keeping its holes (and sharing extents where the
/// file system can).
pub(crate) async fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    let st = tokio::process::Command::new("cp")
        .args(["--sparse=always", "--reflink=auto"])
        .arg(from)
        .arg(to)
        .status()
        .await?;
    if st.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "cp {} failed: {st}",
            from.display()
        )))
    }
}

/// Makes the capture in `dir` durable before anyone is told it is ready:
/// every file in it, then the directory itself and its parent (which holds
/// its name) are fsynced, so a power loss cannot leave a "ready" capture
/// with truncated files or a name pointing nowhere. Blocking: run it on the
/// blocking pool for large captures ([`sync_dir_async`]).
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_file() {
            std::fs::File::open(e.path())?.sync_all()?;
        }
    }
    std::fs::File::open(dir)?.sync_all()?;
    if let Some(parent) = dir.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// [`sync_dir`] off the async threads.
pub(crate) async fn sync_dir_async(dir: &Path) -> std::io::Result<()> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || sync_dir(&dir))
        .await
        .map_err(std::io::Error::other)?
}

/// Fsyncs the files `files` (those that exist) and then `dir`, which holds
/// their names: a pause's kept state survives a power loss once recorded.
pub(crate) async fn sync_files(files: Vec<PathBuf>, dir: &Path) -> std::io::Result<()> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        for f in files.iter().filter(|f| f.exists()) {
            std::fs::File::open(f)?.sync_all()?;
        }
        std::fs::File::open(&dir)?.sync_all()
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The files QEMU opens as the volume drives, in the spec's order: the
/// volume itself (`rw`) or the machine's copy of it (`snapshot`).
pub(crate) fn drive_files(spec: &MachineSpec, paths: &VmPaths) -> Vec<PathBuf> {
    spec.volumes
        .iter()
        .enumerate()
        .map(|(i, v)| {
            if v.snapshot {
                paths.volume_copy(i)
            } else {
                v.file.clone()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::types::VolumeDrive;

    fn volume(file: &str, snapshot: bool) -> VolumeDrive {
        VolumeDrive {
            file: file.into(),
            path: "/data".into(),
            snapshot,
        }
    }

    #[test]
    fn drives_are_the_volumes_or_the_machines_copies_in_order() {
        let spec = MachineSpec {
            id: "sbx".into(),
            volumes: vec![
                volume("/vols/a.ext4", false),
                volume("/vols/b.ext4", true),
                volume("/vols/c.ext4", false),
            ],
            ..MachineSpec::default()
        };
        let paths = VmPaths::new("/state/sbx".into());
        assert_eq!(
            drive_files(&spec, &paths),
            [
                PathBuf::from("/vols/a.ext4"),
                PathBuf::from("/state/sbx/volume-1.ext4"),
                PathBuf::from("/vols/c.ext4"),
            ]
        );
        assert!(drive_files(&MachineSpec::default(), &paths).is_empty());
    }

    #[tokio::test]
    async fn copy_sparse_copies_and_reports_failure() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("rt-host-disks-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (from, to) = (dir.join("from.img"), dir.join("to.img"));
        let f = std::fs::File::create(&from).unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(b"superblock", 1024).unwrap();
        drop(f);
        copy_sparse(&from, &to).await.unwrap();
        assert!(std::fs::read(&from).unwrap() == std::fs::read(&to).unwrap());
        let e = copy_sparse(&dir.join("missing"), &dir.join("x"))
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("cp "), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
