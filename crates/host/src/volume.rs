//! Volume files: an ext4 file system in a sparse raw file, made on the host
//! once and then only ever read and written by QEMU as a guest's drive (the
//! host never mounts what a guest wrote).

use std::path::Path;
use std::process::Command;

/// The uid and gid that own a new volume's root directory: the guest's
/// sandbox user, who can write to it at once.
pub const VOLUME_OWNER: (u32, u32) = (1000, 1000);

/// Creates `path` (which must not exist) as a sparse file of `size_mib` MiB
/// holding an empty ext4 file system whose root belongs to the sandbox user.
pub fn create_volume_file(path: &Path, size_mib: u32) -> std::io::Result<()> {
    let partial = path.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)?;
    file.set_len(u64::from(size_mib) << 20)?;
    drop(file);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-L", "volume", "-E"])
        .arg(format!(
            "root_owner={}:{},lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            VOLUME_OWNER.0, VOLUME_OWNER.1
        ))
        .arg(&partial)
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(std::io::Error::new(e.kind(), format!("mkfs.ext4: {e}")));
        }
    };
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(std::io::Error::other(format!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&partial, path)
}
