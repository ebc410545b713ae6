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

/// Where VMs' uids come from: 2,000,000,000 and the 100,000,000 after, far
/// above the uids of the host's users. The first tried is where earlier
/// versions put a machine (by its hash alone), so their machines keep it.
pub(crate) const VM_UIDS: (u32, u32) = (2_000_000_000, 100_000_000);

/// Where shared volumes' uids come from: the 40,000,000 after the VMs'
/// (disjoint, so a volume's files are never a machine's; all below 2^31).
pub const VOLUME_UIDS: (u32, u32) = (2_100_000_000, 40_000_000);

/// Claims of every pool in this process are made one at a time.
static CLAIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A persisted pool of uids: each owner (a machine, a shared volume) gets
/// one no other owner of the pool holds, kept across restarts of the
/// server until it is released. Two directories of small files under
/// `dir`: `by-owner/<owner>` holds the owner's uid, `by-uid/<uid>` its
/// owner (claimed with `O_EXCL`, so a uid is never given twice). The first
/// uid tried is a hash of the owner, then the next free one.
#[derive(Debug, Clone)]
pub struct UidPool {
    dir: PathBuf,
    base: u32,
    span: u32,
}

impl UidPool {
    /// The pool in `dir` (made 0700 if missing) over `(base, span)`.
    pub fn open(dir: &Path, (base, span): (u32, u32)) -> std::io::Result<UidPool> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        for sub in ["by-owner", "by-uid"] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir.join(sub))?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        Ok(UidPool {
            dir: dir.to_owned(),
            base,
            span: span.max(1),
        })
    }

    fn owner_file(&self, owner: &str) -> PathBuf {
        self.dir.join("by-owner").join(file_name(owner))
    }

    fn uid_file(&self, uid: u32) -> PathBuf {
        self.dir.join("by-uid").join(uid.to_string())
    }

    /// The uid `owner` holds, if any.
    pub fn get(&self, owner: &str) -> Option<u32> {
        let text = std::fs::read_to_string(self.owner_file(owner)).ok()?;
        let uid: u32 = text.trim().parse().ok()?;
        (self.base..self.base.saturating_add(self.span))
            .contains(&uid)
            .then_some(uid)
    }

    /// The uid of `owner`: the one it holds, or a free one claimed now.
    pub fn claim(&self, owner: &str) -> std::io::Result<u32> {
        let _one_at_a_time = CLAIMING.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(uid) = self.get(owner) {
            return Ok(uid);
        }
        let start = hash(owner) % self.span;
        for i in 0..self.span {
            let uid = self.base + (start + i) % self.span;
            let file = self.uid_file(uid);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&file)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(owner.as_bytes())?;
                    // The owner's record last, whole (a crash in between
                    // leaves a claim without an owner: `sweep` drops it).
                    let record = self.owner_file(owner);
                    let tmp = record.with_extension("tmp");
                    std::fs::write(&tmp, uid.to_string())?;
                    std::fs::rename(&tmp, &record)?;
                    return Ok(uid);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("every uid of the pool is taken"))
    }

    /// Gives `owner`'s uid back (nothing when it holds none).
    pub fn release(&self, owner: &str) {
        let _one_at_a_time = CLAIMING.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(uid) = self.get(owner) {
            let _ = std::fs::remove_file(self.owner_file(owner));
            let _ = std::fs::remove_file(self.uid_file(uid));
        }
    }

    /// Releases every owner for which `keep` is false, and drops claims
    /// whose owner's record does not name them (a claim cut short).
    pub fn sweep(&self, keep: impl Fn(&str) -> bool) {
        let Ok(uids) = std::fs::read_dir(self.dir.join("by-uid")) else {
            return;
        };
        for e in uids.flatten() {
            let Some(uid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(owner) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            if self.get(&owner) != Some(uid) {
                let _ = std::fs::remove_file(e.path());
            } else if !keep(&owner) {
                self.release(&owner);
            }
        }
    }
}

/// `owner` as a file name: itself when it is plain, else hex.
fn file_name(owner: &str) -> String {
    let plain = !owner.is_empty()
        && !owner.starts_with('.')
        && owner
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if plain {
        owner.to_owned()
    } else {
        let mut s = String::from("x-");
        for b in owner.bytes() {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

/// Whether the server runs as root (only then have VMs uids of their own).
pub fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// FNV-1a of `id`: where an owner's search for a free uid starts.
fn hash(id: &str) -> u32 {
    let mut h: u32 = 2166136261;
    for b in id.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(16777619);
    }
    h
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn pool(name: &str) -> (PathBuf, UidPool) {
        let dir = std::env::temp_dir().join(format!("rt-uids-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let pool = UidPool::open(&dir, (1000, 4)).unwrap();
        (dir, pool)
    }

    #[test]
    fn owners_never_share_a_uid_and_keep_theirs_across_opens() {
        let (dir, p) = pool("share");
        let uids: Vec<u32> = ["a", "b", "c", "d"]
            .iter()
            .map(|o| p.claim(o).unwrap())
            .collect();
        let mut sorted = uids.clone();
        sorted.sort();
        // Four owners in a span of four: each has one, none twice.
        assert_eq!(sorted, vec![1000, 1001, 1002, 1003]);
        assert!(p.claim("e").is_err());
        // Another open of the same directory (a restart) finds the same.
        let again = UidPool::open(&dir, (1000, 4)).unwrap();
        for (o, uid) in ["a", "b", "c", "d"].iter().zip(&uids) {
            assert_eq!(again.claim(o).unwrap(), *uid);
        }
        // A released uid is free for the next owner; the others keep theirs.
        again.release("b");
        assert_eq!(again.get("b"), None);
        assert_eq!(again.claim("e").unwrap(), uids[1]);
        assert_eq!(again.claim("c").unwrap(), uids[2]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_sweep_releases_the_gone_and_a_claim_cut_short() {
        let (dir, p) = pool("sweep");
        let a = p.claim("a").unwrap();
        let b = p.claim("b").unwrap();
        // A claim cut short: the uid file without its owner's record.
        let orphan = (1000..1004).find(|u| ![a, b].contains(u)).unwrap();
        std::fs::write(dir.join("by-uid").join(orphan.to_string()), "z").unwrap();
        p.sweep(|o| o == "a");
        assert_eq!(p.get("a"), Some(a));
        assert_eq!(p.get("b"), None);
        assert!(!dir.join("by-uid").join(b.to_string()).exists());
        assert!(!dir.join("by-uid").join(orphan.to_string()).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn owners_with_odd_names_are_kept_in_plain_file_names() {
        assert_eq!(file_name("sbx_01"), "sbx_01");
        assert_eq!(file_name("../x"), "x-2e2e2f78");
        assert_eq!(file_name(""), "x-");
        let (dir, p) = pool("odd");
        let u = p.claim("../../etc/passwd").unwrap();
        assert_eq!(p.get("../../etc/passwd"), Some(u));
        let _ = std::fs::remove_dir_all(&dir);
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
