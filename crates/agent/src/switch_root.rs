//! Start-up from the initramfs: the agent is `/init` of a one-file
//! initramfs, so the root disk image does not carry it. Before anything else
//! it mounts `/dev/vda` and makes it the root, as `switch_root` does; the
//! agent keeps running from memory as PID 1.

use std::ffi::CString;
use std::time::{Duration, Instant};

const RAMFS_MAGIC: i64 = 0x8584_58f6;
const TMPFS_MAGIC: i64 = 0x0102_1994;

fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("bad path {s}"))
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn mount(
    src: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let (s, t, f, d) = (cstr(src)?, cstr(target)?, cstr(fstype)?, cstr(data)?);
    // SAFETY: all pointers are valid NUL-terminated strings for the call.
    let rc = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) };
    if rc != 0 {
        return Err(os_err(&format!("mount {src} on {target}")));
    }
    Ok(())
}

/// Whether `/` is the initramfs (ramfs or tmpfs).
pub(crate) fn in_initramfs() -> bool {
    let root = match cstr("/") {
        Ok(r) => r,
        Err(_) => return false,
    };
    // SAFETY: statfs fills the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(root.as_ptr(), &mut st) } != 0 {
        return false;
    }
    let t = st.f_type as i64;
    t == RAMFS_MAGIC || t == TMPFS_MAGIC
}

/// Mounts the root disk and moves `/` onto it.
pub(crate) fn switch_to_disk(device: &str) -> Result<(), String> {
    let _ = std::fs::create_dir_all("/dev");
    // The kernel does not mount devtmpfs for an initramfs.
    let _ = mount("devtmpfs", "/dev", "devtmpfs", 0, "");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::path::Path::new(device).exists() {
        if Instant::now() > deadline {
            return Err(format!("{device} did not appear"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::create_dir_all("/newroot").map_err(|e| format!("mkdir /newroot: {e}"))?;
    mount(device, "/newroot", "ext4", 0, "")?;
    // Leave /dev for the real root's own mounts.
    let dev = cstr("/dev")?;
    // SAFETY: valid path.
    unsafe { libc::umount2(dev.as_ptr(), libc::MNT_DETACH) };
    let newroot = cstr("/newroot")?;
    let dot = cstr(".")?;
    let slash = cstr("/")?;
    // SAFETY: valid paths; this is the switch_root sequence.
    unsafe {
        if libc::chdir(newroot.as_ptr()) != 0 {
            return Err(os_err("chdir /newroot"));
        }
    }
    mount(".", "/", "", libc::MS_MOVE, "")?;
    // SAFETY: valid paths.
    unsafe {
        if libc::chroot(dot.as_ptr()) != 0 {
            return Err(os_err("chroot"));
        }
        if libc::chdir(slash.as_ptr()) != 0 {
            return Err(os_err("chdir /"));
        }
    }
    // The agent's file in the initramfs is no longer reachable; nothing to free.
    Ok(())
}
