//! The guest kernel and the base disk image: built on demand by the recipes
//! in `guest/` (embedded in the binary), cached in the cache directory under
//! a hash of the recipe, and reused across data directories.
//!
//! Layout of the cache directory: `kernel-<hash>/vmlinux`,
//! `rootfs-<hash>/rootfs.ext4`, `base-<hash>.qcow2` (the read-only disk every
//! sandbox's overlay sits on) and `agent-<hash>.cpio` (an initramfs holding
//! only the static guest agent as `/init`; it mounts the disk and switches
//! root to it). Keeping the agent out of the disk image means a new agent
//! never rebuilds the 1+ GiB image.

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

const BUILD_KERNEL: &str = include_str!("../../../guest/build-kernel.sh");
const KERNEL_FRAGMENT: &str = include_str!("../../../guest/kernel.fragment");
const BUILD_ROOTFS: &str = include_str!("../../../guest/build-rootfs.sh");

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("cache directory {path} is not usable")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the guest agent binary {path} is missing (build the workspace first: cargo build --release)")]
    AgentMissing {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the {what} failed ({status}); its output is above")]
    Build { what: &'static str, status: String },
    #[error("could not run the {what} recipe")]
    Spawn {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The files a VM boots from.
#[derive(Debug, Clone)]
pub struct Artifacts {
    pub kernel: PathBuf,
    pub base: PathBuf,
    pub initrd: PathBuf,
    /// Identifies kernel + image; templates and snapshots are keyed by it.
    pub key: String,
}

fn hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..8])
}

pub fn kernel_key() -> String {
    hash(&[BUILD_KERNEL.as_bytes(), KERNEL_FRAGMENT.as_bytes()])
}

pub fn rootfs_key() -> String {
    hash(&[BUILD_ROOTFS.as_bytes()])
}

/// An exclusive lock on the cache directory while something is built.
struct CacheLock(#[allow(dead_code)] std::fs::File);

impl CacheLock {
    fn take(dir: &Path) -> Result<CacheLock, ArtifactError> {
        let path = dir.join(".lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| ArtifactError::Cache {
                path: path.clone(),
                source,
            })?;
        // SAFETY: flock on an fd we own; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(ArtifactError::Cache {
                path,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(CacheLock(f))
    }
}

/// Writes the recipes to a folder of the cache so each runs with its
/// neighbours (the kernel recipe reads `kernel.fragment` beside itself).
fn recipes(cache: &Path) -> Result<PathBuf, ArtifactError> {
    let key = hash(&[
        BUILD_KERNEL.as_bytes(),
        KERNEL_FRAGMENT.as_bytes(),
        BUILD_ROOTFS.as_bytes(),
    ]);
    let dir = cache.join(format!("recipes-{key}"));
    let io = |source| ArtifactError::Cache {
        path: dir.clone(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    for (name, text) in [
        ("build-kernel.sh", BUILD_KERNEL),
        ("kernel.fragment", KERNEL_FRAGMENT),
        ("build-rootfs.sh", BUILD_ROOTFS),
    ] {
        std::fs::write(dir.join(name), text).map_err(io)?;
    }
    Ok(dir)
}

fn run(what: &'static str, script: &Path, args: &[&Path]) -> Result<(), ArtifactError> {
    // Output is inherited: the recipes print their own progress.
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .status()
        .map_err(|source| ArtifactError::Spawn { what, source })?;
    if status.success() {
        Ok(())
    } else {
        Err(ArtifactError::Build {
            what,
            status: status.to_string(),
        })
    }
}

fn log(msg: &str) {
    eprintln!("[image] {msg}");
}

/// Builds whatever is missing and returns the kernel and base image paths.
/// Blocking; long the first time (kernel ~5 min, root filesystem a few).
pub fn ensure(cache: &Path, agent_bin: &Path) -> Result<Artifacts, ArtifactError> {
    std::fs::create_dir_all(cache).map_err(|source| ArtifactError::Cache {
        path: cache.to_owned(),
        source,
    })?;
    let mut agent = Vec::new();
    std::fs::File::open(agent_bin)
        .and_then(|mut f| f.read_to_end(&mut agent))
        .map_err(|source| ArtifactError::AgentMissing {
            path: agent_bin.to_owned(),
            source,
        })?;

    let kkey = kernel_key();
    let rkey = rootfs_key();
    let akey = hash(&[&agent]);
    let kernel = cache.join(format!("kernel-{kkey}")).join("vmlinux");
    let rootfs = cache.join(format!("rootfs-{rkey}")).join("rootfs.ext4");
    let base = cache.join(format!("base-{rkey}.qcow2"));
    let initrd = cache.join(format!("agent-{akey}.cpio"));
    let out = Artifacts {
        kernel: kernel.clone(),
        base: base.clone(),
        initrd: initrd.clone(),
        key: hash(&[kkey.as_bytes(), rkey.as_bytes(), akey.as_bytes()]),
    };
    if !initrd.exists() {
        write_initrd(&initrd, &agent).map_err(|source| ArtifactError::Cache {
            path: initrd.clone(),
            source,
        })?;
    }
    if kernel.exists() && base.exists() {
        return Ok(out);
    }
    let _lock = CacheLock::take(cache)?;
    let dir = recipes(cache)?;
    if !kernel.exists() {
        log(&format!(
            "building the guest kernel (cache key {kkey}); about 5 minutes on 2 cores"
        ));
        let kdir = cache.join(format!("kernel-{kkey}"));
        run("guest kernel", &dir.join("build-kernel.sh"), &[&kdir])?;
    } else {
        log(&format!("guest kernel: cached ({kkey})"));
    }
    if !base.exists() {
        if !rootfs.exists() {
            log(&format!(
                "building the root filesystem (cache key {rkey}); a few minutes"
            ));
            let rdir = cache.join(format!("rootfs-{rkey}"));
            run("root filesystem", &dir.join("build-rootfs.sh"), &[&rdir])?;
        } else {
            log(&format!("root filesystem: cached ({rkey})"));
        }
        log("converting the root filesystem to the read-only base image");
        let tmp = base.with_extension("partial");
        let status = Command::new("qemu-img")
            .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
            .arg(&rootfs)
            .arg(&tmp)
            .status()
            .map_err(|source| ArtifactError::Spawn {
                what: "base image",
                source,
            })?;
        if !status.success() {
            return Err(ArtifactError::Build {
                what: "base image",
                status: status.to_string(),
            });
        }
        let io = |source| ArtifactError::Cache {
            path: base.clone(),
            source,
        };
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o444))
            .map_err(io)?;
        std::fs::rename(&tmp, &base).map_err(io)?;
    }
    log(&format!(
        "kernel {} and image {} ready",
        kernel.display(),
        base.display()
    ));
    Ok(out)
}

/// An initramfs (`newc` cpio) holding the agent as `/init`, padded to 4 KiB.
fn write_initrd(path: &Path, agent: &[u8]) -> std::io::Result<()> {
    fn entry(out: &mut Vec<u8>, ino: u32, name: &str, mode: u32, data: &[u8]) {
        let namesize = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0, 0, 1, 0, data.len(), 0, 0, 0, 0, 0
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while !out.len().is_multiple_of(4) {
            out.push(0);
        }
        out.extend_from_slice(data);
        while !out.len().is_multiple_of(4) {
            out.push(0);
        }
    }
    let mut out = Vec::with_capacity(agent.len() + 4096);
    entry(&mut out, 1, "init", 0o100755, agent);
    entry(&mut out, 2, "TRAILER!!!", 0, &[]);
    // microvm places the initrd at the top of RAM; a partial last page can
    // overlap its firmware tables (shared/docs/feasibility-qemu.md §1).
    while out.len() % 4096 != 0 {
        out.push(0);
    }
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, &out)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initrd_is_a_padded_newc_archive_with_init() {
        let dir = std::env::temp_dir().join(format!("rt-initrd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.cpio");
        write_initrd(&p, b"\x7fELF-agent").unwrap();
        let data = std::fs::read(&p).unwrap();
        assert_eq!(data.len() % 4096, 0);
        assert!(data.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&data);
        assert!(text.contains("init\0"));
        assert!(text.contains("TRAILER!!!"));
        assert!(data.windows(10).any(|w| w == b"\x7fELF-agent".as_slice()));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
