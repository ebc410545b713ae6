//! QEMU's own uid: when the server runs as root, each VM's QEMU drops to a
//! uid of its own, which must reach the state and artifact directories.

use std::path::{Path, PathBuf};

use crate::machine::QemuConfig;

/// As root: opens the state directory to QEMU's uids (traverse only), and
/// fails when a directory above it or above the artifacts keeps them out.
pub(crate) fn let_qemu_reach(cfg: &QemuConfig) -> std::io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // QEMU drops to a uid of its own and reopens its disks by path
        // after a migration (pause, fork): it must reach them.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o711))?;
        for p in [&cfg.state_dir, &cfg.artifacts.base] {
            if let Some(dir) = unreachable_ancestor(p) {
                return Err(std::io::Error::other(format!(
                    "{} is not reachable by other users (no o+x), but QEMU runs as an unprivileged \
                     user and must reach {}: choose a data or cache directory outside a private home \
                     (the defaults for root are /var/lib/runtime and /var/cache/runtime), or chmod o+x {}",
                    dir.display(),
                    p.display(),
                    dir.display()
                )));
            }
        }
    }
    Ok(())
}

/// The first ancestor directory of `p` that others cannot traverse.
fn unreachable_ancestor(p: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let mut dir = p.parent();
    while let Some(d) = dir {
        if let Ok(m) = std::fs::metadata(d) {
            if m.permissions().mode() & 0o001 == 0 {
                return Some(d.to_owned());
            }
        }
        dir = d.parent();
    }
    None
}

/// A uid/gid of its own for each VM's QEMU, when the server runs as root.
pub(crate) fn vm_uid(id: &str) -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let uid = uid_for(id);
    Some((uid, uid))
}

/// The uid a shared volume's files belong to and its 9P servers run as,
/// when the server runs as root: one of the machines' range, derived from
/// the volume id (fixed across restarts, never a host user's).
pub fn volume_uid(volume_id: &str) -> Option<u32> {
    vm_uid(&format!("volume:{volume_id}")).map(|(u, _)| u)
}

/// The uid of machine `id`: FNV-1a of the id, in 2,000,000,000 and the
/// 100,000,000 after, far above the uids of the host's users.
fn uid_for(id: &str) -> u32 {
    let mut h: u32 = 2166136261;
    for b in id.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(16777619);
    }
    2_000_000_000 + (h % 100_000_000)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn each_machine_has_a_fixed_uid_of_its_own() {
        // Fixed: a machine that outlives a restart of the server keeps it.
        assert_eq!(uid_for(""), 2_066_136_261);
        assert_eq!(uid_for("a"), 2_026_002_220);
        assert_eq!(uid_for("sbx-1"), 2_044_483_338);
        for id in ["a", "sbx-1", "template-0123456789abcdef", "probe"] {
            let uid = uid_for(id);
            assert!((2_000_000_000..2_100_000_000).contains(&uid), "{id}: {uid}");
        }
    }

    #[test]
    fn vm_uid_only_as_root() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(
            vm_uid("sbx-1"),
            root.then_some((2_044_483_338, 2_044_483_338))
        );
    }

    #[test]
    fn the_first_directory_others_cannot_traverse_is_found() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("rt-host-uid-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (open, closed, inner) = (
            base.join("open"),
            base.join("open/closed"),
            base.join("open/closed/inner"),
        );
        std::fs::create_dir_all(&inner).unwrap();
        let mode = |p: &Path, m| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));
        mode(&base, 0o755).unwrap();
        mode(&open, 0o711).unwrap();
        mode(&closed, 0o700).unwrap();
        mode(&inner, 0o755).unwrap();
        assert_eq!(unreachable_ancestor(&inner.join("x")), Some(closed.clone()));
        assert_eq!(unreachable_ancestor(&closed), None);
        mode(&closed, 0o701).unwrap();
        assert_eq!(unreachable_ancestor(&inner.join("x")), None);
        let _ = std::fs::remove_dir_all(&base);
    }
}
