//! Facts about disk files the control plane needs to let go of unused
//! ones: the file a qcow2 overlay rests on, and the free space of a file
//! system.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The longest backing file name QEMU writes (its own limit is 1023).
const MAX_BACKING_NAME: u32 = 4096;

/// The file qcow2 image `path` rests on, resolved against its directory
/// when relative; `None` for an image without one or a file that is not
/// qcow2.
pub fn backing_file(path: &Path) -> std::io::Result<Option<PathBuf>> {
    backing_of(std::fs::File::open(path)?, path)
}

/// [`backing_file`] of a file another uid may control: a link at `path`
/// is not followed, and anything but a regular file (a device, a FIFO) is
/// an error, not read.
pub fn backing_file_nofollow(path: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a regular file", path.display()),
        ));
    }
    backing_of(f, path)
}

fn backing_of(mut f: std::fs::File, path: &Path) -> std::io::Result<Option<PathBuf>> {
    let mut header = [0u8; 20];
    if f.read_exact(&mut header).is_err() || header[..4] != *b"QFI\xfb" {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().unwrap_or([0; 8]));
    let size = u32::from_be_bytes(header[16..20].try_into().unwrap_or([0; 4]));
    if offset == 0 || size == 0 || size > MAX_BACKING_NAME {
        return Ok(None);
    }
    f.seek(SeekFrom::Start(offset))?;
    let mut name = vec![0u8; size as usize];
    f.read_exact(&mut name)?;
    let name = PathBuf::from(String::from_utf8_lossy(&name).into_owned());
    Ok(Some(if name.is_absolute() {
        name
    } else {
        path.parent().unwrap_or(Path::new("/")).join(name)
    }))
}

/// The size qcow2 image `path` shows its guest (its header's), or `None`
/// for a file that is not qcow2.
pub fn virtual_size(path: &Path) -> std::io::Result<Option<u64>> {
    let mut header = [0u8; 32];
    let mut f = std::fs::File::open(path)?;
    if f.read_exact(&mut header).is_err() || header[..4] != *b"QFI\xfb" {
        return Ok(None);
    }
    Ok(Some(u64::from_be_bytes(
        header[24..32].try_into().unwrap_or([0; 8]),
    )))
}

/// The bytes free to an unprivileged writer on the file system of `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `s` a valid out pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_qcow2_overlay_names_the_file_it_rests_on() {
        let dir = std::env::temp_dir().join(format!("rt-disk-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("base.qcow2");
        let top = dir.join("top.qcow2");
        let run = |args: &[&str]| {
            let ok = std::process::Command::new("qemu-img")
                .args(args)
                .current_dir(&dir)
                .status()
                .unwrap()
                .success();
            assert!(ok, "qemu-img {args:?}");
        };
        run(&["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "16M"]);
        // Relative, as written: resolved against the overlay's directory.
        run(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "base.qcow2",
            "top.qcow2",
        ]);
        assert_eq!(backing_file(&top).unwrap(), Some(dir.join("base.qcow2")));
        assert_eq!(virtual_size(&top).unwrap(), Some(16 << 20));
        run(&["resize", "-q", "-f", "qcow2", "top.qcow2", "48M"]);
        assert_eq!(virtual_size(&top).unwrap(), Some(48 << 20));
        assert!(virtual_size(&dir.join("missing")).is_err());
        assert_eq!(backing_file(&base).unwrap(), None);
        std::fs::write(dir.join("plain"), b"not a disk").unwrap();
        assert_eq!(backing_file(&dir.join("plain")).unwrap(), None);
        assert_eq!(virtual_size(&dir.join("plain")).unwrap(), None);
        assert!(backing_file(&dir.join("missing")).is_err());
        assert!(free_bytes(&dir).unwrap() > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
