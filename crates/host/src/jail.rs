//! A QEMU's own view of the files (docs/security.md, "A guest that took
//! over its QEMU"): a mount namespace whose root is an empty, read-only
//! tmpfs holding only what that QEMU opens, each at its host path: the
//! system's programs and libraries (`/usr`, read-only), its kernel and
//! initrd, its disk's backing chain and a fork's frozen memory (read-only),
//! its own directory, memory file and volume files, a few devices, and
//! `/proc`. The paths stay the host's, so QEMU reopening a backing file by
//! name after a migration finds it, which a plain chroot would break.
//!
//! Nothing else of the host is there: not the data directory, not
//! `runtime.db`, not another machine's directory or another key's image.
//!
//! [`Jail::plan`] does everything that allocates (paths, the list of
//! mounts) in the server; [`Jail::enter`] runs in the forked child before
//! exec and makes system calls only.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// What a QEMU sees of one host path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    ReadOnly,
    ReadWrite,
}

/// One step of building the jail, with its paths inside the new root.
#[derive(Debug)]
enum Step {
    Dir(CString),
    File(CString),
    Symlink {
        target: CString,
        at: CString,
    },
    Bind {
        from: CString,
        at: CString,
        ro: bool,
    },
}

/// The mounts that make one QEMU's root, ready to run in a forked child.
#[derive(Debug)]
pub(crate) struct Jail {
    /// The directory the tmpfs root is mounted on (it exists on the host).
    root: CString,
    steps: Vec<Step>,
    /// QEMU's working directory, entered again once inside.
    cwd: CString,
}

/// System directories that are links into `/usr` on a merged-`/usr`
/// system, or directories of their own on an older one.
const SYSTEM_DIRS: [&str; 6] = ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"];

/// Devices QEMU opens (`/dev/kvm` is added when the machine uses KVM).
const DEVICES: [&str; 4] = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path holds a NUL byte"))
}

/// `p` made absolute and without `.` or `..` (lexically).
pub(crate) fn normal(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

impl Jail {
    /// The jail over `root` (an empty directory of the server's) that
    /// shows `paths` and the system's programs, with `cwd` as the working
    /// directory. A path under another one shown is left to that one.
    pub(crate) fn plan(root: &Path, paths: &[(PathBuf, Access)], cwd: &Path) -> io::Result<Jail> {
        let mut shown: Vec<(PathBuf, Access, bool)> = Vec::new();
        let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
        shown.push((PathBuf::from("/usr"), Access::ReadOnly, true));
        for d in SYSTEM_DIRS {
            let p = Path::new(d);
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.file_type().is_symlink() => {
                    links.push((p.into(), std::fs::read_link(p)?))
                }
                Ok(m) if m.is_dir() => shown.push((p.into(), Access::ReadOnly, true)),
                _ => {}
            }
        }
        for f in ["/etc/ld.so.cache"] {
            if Path::new(f).is_file() {
                shown.push((f.into(), Access::ReadOnly, false));
            }
        }
        for d in DEVICES {
            shown.push((d.into(), Access::ReadWrite, false));
        }
        shown.push((PathBuf::from("/proc"), Access::ReadWrite, true));
        for (p, access) in paths {
            let meta = std::fs::metadata(p)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
            shown.push((normal(p), *access, meta.is_dir()));
        }
        // Directories first, shortest first, so a path under one shown is
        // seen to be and left out, unless it must be writable and that one
        // is not (it is then mounted over its place there).
        shown.sort_by_key(|(p, _, dir)| (!*dir, p.as_os_str().len()));
        let mut kept: Vec<(PathBuf, Access, bool)> = Vec::new();
        for (p, access, dir) in shown {
            let covered = kept.iter().any(|(k, kaccess, kdir)| {
                *kdir
                    && p.starts_with(k)
                    && (*kaccess == Access::ReadWrite || access == Access::ReadOnly)
            });
            if !covered && !links.iter().any(|(l, _)| p.starts_with(l)) {
                kept.push((p, access, dir));
            }
        }

        let mut steps = Vec::new();
        let mut made: Vec<PathBuf> = Vec::new();
        let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
        // The directories down to `p` (and `p` too when `itself`), each once.
        let mut make_dirs = |p: &Path, itself: bool, steps: &mut Vec<Step>| -> io::Result<()> {
            let mut chain: Vec<&Path> = p.ancestors().skip(usize::from(!itself)).collect();
            chain.reverse();
            for a in chain {
                if a == Path::new("/") || made.iter().any(|m| m == a) {
                    continue;
                }
                made.push(a.to_owned());
                steps.push(Step::Dir(cstr(&inside(a))?));
            }
            Ok(())
        };
        for (at, target) in &links {
            make_dirs(at, false, &mut steps)?;
            steps.push(Step::Symlink {
                target: cstr(target)?,
                at: cstr(&inside(at))?,
            });
        }
        for (p, access, dir) in &kept {
            make_dirs(p, *dir, &mut steps)?;
            let at = cstr(&inside(p))?;
            if !*dir {
                steps.push(Step::File(at.clone()));
            }
            steps.push(Step::Bind {
                from: cstr(p)?,
                at,
                ro: *access == Access::ReadOnly,
            });
        }
        Ok(Jail {
            root: cstr(root)?,
            steps,
            cwd: cstr(cwd)?,
        })
    }

    /// Enters a mount namespace of its own and makes the jail its root.
    ///
    /// # Safety
    ///
    /// For a forked child before exec: it makes system calls only and
    /// allocates nothing.
    pub(crate) unsafe fn enter(&self) -> io::Result<()> {
        fn check(r: libc::c_int) -> io::Result<()> {
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
        // SAFETY: system calls on NUL-terminated strings this jail owns,
        // in a child of its own (the caller's promise).
        unsafe {
            let none = std::ptr::null::<libc::c_char>();
            check(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing mounted here propagates back to the host.
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"size=64k,nr_inodes=4096,mode=0755".as_ptr().cast(),
            ))?;
            for step in &self.steps {
                match step {
                    Step::Dir(at) => {
                        if libc::mkdir(at.as_ptr(), 0o755) < 0 {
                            let e = io::Error::last_os_error();
                            if e.raw_os_error() != Some(libc::EEXIST) {
                                return Err(e);
                            }
                        }
                    }
                    Step::File(at) => {
                        let fd = libc::open(
                            at.as_ptr(),
                            // Read-only: under a read-only mount the file
                            // is already there; only a missing one is made.
                            libc::O_CREAT | libc::O_RDONLY | libc::O_CLOEXEC,
                            0o644,
                        );
                        check(fd)?;
                        libc::close(fd);
                    }
                    Step::Symlink { target, at } => {
                        check(libc::symlink(target.as_ptr(), at.as_ptr()))?
                    }
                    Step::Bind { from, at, ro } => {
                        check(libc::mount(
                            from.as_ptr(),
                            at.as_ptr(),
                            none,
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                        if *ro {
                            check(libc::mount(
                                none,
                                at.as_ptr(),
                                none,
                                libc::MS_BIND
                                    | libc::MS_REMOUNT
                                    | libc::MS_RDONLY
                                    | libc::MS_NOSUID,
                                std::ptr::null(),
                            ))?;
                        }
                    }
                }
            }
            // The tmpfs becomes the root (pivot_root(".", ".") stacks the old
            // root under the new one, then it is detached), read-only.
            check(libc::chdir(self.root.as_ptr()))?;
            check(
                libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int,
            )?;
            check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                std::ptr::null(),
            ))?;
            check(libc::chdir(self.cwd.as_ptr()))
        }
    }
}

/// Whether a child of this process can have a mount namespace of its own
/// with a tmpfs mounted in it (root, not refused by a container's rules):
/// probed once, on `root`.
pub(crate) fn works(root: &Path) -> bool {
    static WORKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| {
        let probe = || -> io::Result<bool> {
            let jail = Jail::plan(root, &[], Path::new("/"))?;
            let mut cmd = std::process::Command::new("true");
            cmd.stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            // SAFETY: `enter` makes system calls only.
            unsafe {
                use std::os::unix::process::CommandExt;
                cmd.pre_exec(move || jail.enter());
            }
            Ok(cmd.status()?.success())
        };
        let works = probe().unwrap_or(false);
        if !works {
            tracing::warn!(
                "QEMU cannot have a mount namespace of its own here: it sees the host's files"
            );
        }
        works
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn steps(j: &Jail) -> Vec<String> {
        j.steps
            .iter()
            .map(|s| match s {
                Step::Dir(a) => format!("dir {}", a.to_str().unwrap()),
                Step::File(a) => format!("file {}", a.to_str().unwrap()),
                Step::Symlink { target, at } => {
                    format!(
                        "link {} -> {}",
                        at.to_str().unwrap(),
                        target.to_str().unwrap()
                    )
                }
                Step::Bind { from, at, ro } => format!(
                    "bind {} {} {}",
                    from.to_str().unwrap(),
                    at.to_str().unwrap(),
                    if *ro { "ro" } else { "rw" }
                ),
            })
            .collect()
    }

    #[test]
    fn the_plan_shows_each_path_once_at_its_host_path() {
        let t = std::env::temp_dir().join(format!("rt-jail-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        let vm = t.join("data/sandboxes/sb1");
        std::fs::create_dir_all(&vm).unwrap();
        std::fs::write(vm.join("disk.qcow2"), b"").unwrap();
        let image = t.join("data/images/im1/disk.qcow2");
        std::fs::create_dir_all(image.parent().unwrap()).unwrap();
        std::fs::write(&image, b"").unwrap();
        let root = t.join("jail");
        let j = Jail::plan(
            &root,
            &[
                (vm.clone(), Access::ReadWrite),
                // Under the machine's own directory: already there.
                (vm.join("disk.qcow2"), Access::ReadOnly),
                // Named with `..`: shown at the path it means.
                (vm.join("../../images/im1/disk.qcow2"), Access::ReadOnly),
                // A read-only directory above the machine's: the machine's
                // own is still mounted writable over its place in it.
                (t.join("data/sandboxes"), Access::ReadOnly),
            ],
            &vm,
        )
        .unwrap();
        let s = steps(&j);
        let r = root.display().to_string();
        let v = vm.display().to_string();
        let i = image.display().to_string();
        assert!(s.contains(&format!("bind {v} {r}{v} rw")), "{s:?}");
        let sandboxes = t.join("data/sandboxes").display().to_string();
        let above = format!("bind {sandboxes} {r}{sandboxes} ro");
        let over = format!("bind {v} {r}{v} rw");
        let at = |x: &str| s.iter().position(|y| y == x).unwrap();
        assert!(at(&above) < at(&over), "{s:?}");
        assert!(s.contains(&format!("file {r}{i}")), "{s:?}");
        assert!(s.contains(&format!("bind {i} {r}{i} ro")), "{s:?}");
        assert!(s.contains(&format!("bind /usr {r}/usr ro")), "{s:?}");
        assert!(
            s.contains(&format!("bind /dev/null {r}/dev/null rw")),
            "{s:?}"
        );
        assert_eq!(
            s.iter()
                .filter(|x| x.starts_with("bind") && x.contains("disk.qcow2"))
                .count(),
            1
        );
        // No other part of the data directory is shown.
        assert!(
            !s.iter()
                .any(|x| x.starts_with("bind") && x.contains("/data ")),
            "{s:?}"
        );
        // Each directory is made once, before what is in it.
        let dirs: Vec<_> = s.iter().filter(|x| x.starts_with("dir")).collect();
        let mut unique = dirs.clone();
        unique.dedup();
        assert_eq!(dirs.len(), unique.len());
        let pos = |x: &str| s.iter().position(|y| y == x).unwrap();
        assert!(
            pos(&format!("dir {r}{}", t.join("data").display())) < pos(&format!("file {r}{i}"))
        );
        // A missing path is an error at plan time, not in the child.
        assert!(Jail::plan(&root, &[(t.join("gone"), Access::ReadOnly)], &vm).is_err());
        std::fs::remove_dir_all(&t).unwrap();
    }
}
