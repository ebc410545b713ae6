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

/// Grows the volume file `path` to `size_mib` MiB (never shrinks it): the
/// new space is a hole. The file system inside is grown by the guest when
/// it next mounts the volume (`mount_volumes.sh`): the host never reads
/// what a guest wrote.
pub fn grow_volume_file(path: &Path, size_mib: u32) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    let want = u64::from(size_mib) << 20;
    if file.metadata()?.len() < want {
        file.set_len(want)?;
    }
    file.sync_all()
}

/// The unit of [`copy_sparse`]'s checksum and of the holes it leaves.
const CHUNK: u64 = 64 << 10;

/// What [`copy_sparse`] copied: the checksum of its content and the bytes
/// the copy takes on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    /// Hex SHA-256 of the content, independent of where holes are: the
    /// length, then each 64 KiB chunk that is not all zeros, preceded by
    /// its offset.
    pub sha256: String,
    pub stored_bytes: u64,
}

/// The next offset at or after `from` where `file` has data (`SEEK_DATA`),
/// and where that data ends (`SEEK_HOLE`); `None` past the last data.
fn next_data(file: &std::fs::File, from: u64, len: u64) -> std::io::Result<Option<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    if from >= len {
        return Ok(None);
    }
    let fd = file.as_raw_fd();
    // SAFETY: lseek on a descriptor this function borrows; no memory is touched.
    let start = unsafe { libc::lseek(fd, from as libc::off_t, libc::SEEK_DATA) };
    if start < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            // A file system without SEEK_DATA: all of it is data.
            Some(libc::EINVAL) => Ok(Some((from, len))),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Some((start as u64, (end as u64).min(len))))
}

/// Copies `src` to `dst` (made anew, never an existing file), reading only
/// the data `src` holds and leaving holes where it has only zeros; checks
/// and syncs the copy. `dst` ends up as long as `src`, or `grow_to` bytes if
/// larger. With `expect`, a copy whose checksum differs is removed and an
/// error.
pub fn copy_sparse(
    src: &Path,
    dst: &Path,
    grow_to: u64,
    expect: Option<&str>,
) -> std::io::Result<Copied> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::{FileExt, MetadataExt};
    let from = std::fs::File::open(src)?;
    let len = from.metadata()?.len();
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    let result = (|| {
        let mut hash = Sha256::new();
        hash.update(len.to_le_bytes());
        let mut buf = vec![0u8; CHUNK as usize];
        let mut next_chunk = 0u64;
        let mut pos = 0u64;
        while let Some((start, end)) = next_data(&from, pos, len)? {
            let mut chunk = (start / CHUNK).max(next_chunk);
            while chunk * CHUNK < end {
                let off = chunk * CHUNK;
                let n = CHUNK.min(len - off) as usize;
                from.read_exact_at(&mut buf[..n], off)?;
                if buf[..n].iter().any(|&b| b != 0) {
                    hash.update(off.to_le_bytes());
                    hash.update(&buf[..n]);
                    to.write_all_at(&buf[..n], off)?;
                }
                chunk += 1;
            }
            next_chunk = chunk;
            pos = chunk * CHUNK;
        }
        to.set_len(len.max(grow_to))?;
        to.sync_all()?;
        let sha256 = hex::encode(hash.finalize());
        if let Some(want) = expect {
            if want != sha256 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("checksum {sha256} is not the recorded {want}"),
                ));
            }
        }
        Ok(Copied {
            sha256,
            stored_bytes: to.metadata()?.blocks() * 512,
        })
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(dst);
    }
    result
}

/// Syncs the directory `dir`, so that a rename into it survives a crash.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    fn tmp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "volume-test-{name}-{}-{}",
            std::process::id(),
            uuid_like()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn uuid_like() -> u128 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    }

    #[test]
    fn a_sparse_copy_keeps_the_bytes_leaves_holes_and_checks_its_sum() {
        let dir = tmp("copy");
        let src = dir.join("src");
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&[7u8; 100_000], 10 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        // Zeros written out are no different from a hole.
        f.write_all_at(&vec![0u8; 1 << 20], 30 << 20).unwrap();
        drop(f);
        let a = copy_sparse(&src, &dir.join("a"), 0, None).unwrap();
        assert_eq!(
            std::fs::read(&src).unwrap(),
            std::fs::read(dir.join("a")).unwrap()
        );
        let meta = std::fs::metadata(dir.join("a")).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "{} bytes",
            meta.blocks() * 512
        );
        assert_eq!(a.stored_bytes, meta.blocks() * 512);
        // The copy of the copy has the same sum; a larger copy is grown.
        let b = copy_sparse(&dir.join("a"), &dir.join("b"), 80 << 20, Some(&a.sha256)).unwrap();
        assert_eq!(b.sha256, a.sha256);
        assert_eq!(std::fs::metadata(dir.join("b")).unwrap().len(), 80 << 20);
        // A changed byte is refused, and its copy removed; an existing
        // destination is never overwritten.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("a"))
            .unwrap();
        f.write_all_at(b"X", 10 << 20).unwrap();
        drop(f);
        let err = copy_sparse(&dir.join("a"), &dir.join("c"), 0, Some(&a.sha256)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(!dir.join("c").exists());
        assert!(copy_sparse(&src, &dir.join("b"), 0, None).is_err());
        assert!(dir.join("b").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn growing_a_volume_file_never_shrinks_it() {
        let dir = tmp("grow");
        let path = dir.join("v");
        std::fs::write(&path, b"data").unwrap();
        grow_volume_file(&path, 2).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20);
        grow_volume_file(&path, 1).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20);
        assert_eq!(&std::fs::read(&path).unwrap()[..4], b"data");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
