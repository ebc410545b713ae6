//! PID 1 duties before the channel opens: file systems, loopback, growing
//! the root file system, /workspace. Every step logs its failure and goes on.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::Instant;

use crate::exec::SANDBOX_ID;
use crate::sys::{cstring, log};

/// Mounts, logging a failure (but not EBUSY, already mounted); whether it
/// is mounted now.
fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> bool {
    if !Path::new(target).exists() {
        if let Err(e) = std::fs::create_dir_all(target) {
            log!("mkdir {target}: {e}");
        }
    }
    let c = |s: &str| cstring(s).unwrap_or_default();
    let (source_c, target_c, fstype_c) = (c(source), c(target), c(fstype));
    let data_c: Option<CString> = data.map(c);
    // SAFETY: valid C strings (or NULL for data).
    let r = unsafe {
        libc::mount(
            source_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ptr(),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        // EBUSY: already mounted (the kernel mounts devtmpfs itself with DEVTMPFS_MOUNT).
        if e.raw_os_error() != Some(libc::EBUSY) {
            log!("mount {fstype} on {target}: {e}");
            return false;
        }
    }
    true
}

/// Fds 0-2 must be open, or the first pipes would land on them.
fn ensure_stdio() {
    for fd in 0..3 {
        // SAFETY: plain fcntl.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            continue;
        }
        for dev in [c"/dev/console", c"/dev/null"] {
            // SAFETY: a valid C string.
            let new = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_NOCTTY) };
            if new < 0 {
                continue;
            }
            if new != fd {
                // SAFETY: both fds are valid.
                unsafe {
                    libc::dup2(new, fd);
                    libc::close(new);
                }
            }
            break;
        }
    }
}

pub(crate) fn lo_up() -> io::Result<()> {
    // SAFETY: plain syscall.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; all zeroes is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: ioctls on our socket with a valid ifreq; the union field read is
    // the one SIOCGIFFLAGS fills.
    let r = unsafe {
        if libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            -1
        } else {
            ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            libc::ioctl(sock, libc::SIOCSIFFLAGS, &ifr)
        }
    };
    let result = if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    };
    // SAFETY: our socket.
    unsafe { libc::close(sock) };
    result
}

/// Bytes of the ext4 file system on `dev`, from its superblock.
fn ext4_size(dev: &str) -> io::Result<Option<u64>> {
    let f = std::fs::File::open(dev)?;
    let mut sb = [0u8; 1024];
    f.read_exact_at(&mut sb, 1024)?;
    let u32_at = |o: usize| u32::from_le_bytes([sb[o], sb[o + 1], sb[o + 2], sb[o + 3]]) as u64;
    if u16::from_le_bytes([sb[0x38], sb[0x39]]) != 0xEF53 {
        return Ok(None);
    }
    let block = 1024u64 << u32_at(0x18).min(16);
    let mut blocks = u32_at(0x04);
    if u32_at(0x60) & 0x80 != 0 {
        // INCOMPAT_64BIT: the high half of the block count.
        blocks |= u32_at(0x150) << 32;
    }
    Ok(Some(blocks * block))
}

/// Grows the root file system when the disk was made bigger than the image.
fn grow_root() {
    let Ok(sectors) = std::fs::read_to_string("/sys/block/vda/size") else {
        return;
    };
    let Ok(sectors) = sectors.trim().parse::<u64>() else {
        return;
    };
    let disk = sectors * 512;
    let fs = match ext4_size("/dev/vda") {
        Ok(Some(n)) => n,
        Ok(None) => return,
        Err(e) => {
            log!("cannot read the superblock of /dev/vda: {e}");
            return;
        }
    };
    if disk <= fs + (1 << 20) {
        return;
    }
    let Some(tool) = ["/sbin/resize2fs", "/usr/sbin/resize2fs"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        log!("/dev/vda has {disk} bytes, its file system {fs}, but resize2fs is missing");
        return;
    };
    let t = Instant::now();
    // The reaper does not run yet, so std may wait for this child itself.
    match std::process::Command::new(tool).arg("/dev/vda").status() {
        Ok(s) => log!(
            "resize2fs /dev/vda ({fs} -> {disk} bytes): {s} in {} ms",
            t.elapsed().as_millis()
        ),
        Err(e) => log!("resize2fs: {e}"),
    }
}

fn workspace() {
    let dir = Path::new("/workspace");
    if let Err(e) = std::fs::create_dir_all(dir) {
        log!("mkdir /workspace: {e}");
        return;
    }
    match std::fs::metadata(dir) {
        Ok(md) if md.uid() == SANDBOX_ID && md.gid() == SANDBOX_ID => {}
        Ok(_) => {
            if let Err(e) = std::os::unix::fs::chown(dir, Some(SANDBOX_ID), Some(SANDBOX_ID)) {
                log!("chown /workspace: {e}");
            }
        }
        Err(e) => log!("stat /workspace: {e}"),
    }
}

pub(crate) fn run() {
    let t = Instant::now();
    let nodev = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("proc", "/proc", "proc", nodev, None);
    mount("sysfs", "/sys", "sysfs", nodev, None);
    let root = c"/";
    // SAFETY: remount of / without MS_RDONLY: read-write.
    if unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT,
            std::ptr::null(),
        )
    } < 0
    {
        log!("remount / rw: {}", io::Error::last_os_error());
    }
    mount(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        libc::MS_NOSUID,
        Some("mode=0755"),
    );
    ensure_stdio();
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    );
    // The links udev or systemd would make: /dev/ptmx, and the stdio names
    // shells, `tee /dev/stderr` and `<(...)` reach through.
    for (link, target) in [
        ("/dev/ptmx", "pts/ptmx"),
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if std::fs::symlink_metadata(link).is_err() {
            if let Err(e) = std::os::unix::fs::symlink(target, link) {
                log!("symlink {link}: {e}");
            }
        }
    }
    let tmpfs = libc::MS_NOSUID | libc::MS_NODEV;
    mount("tmpfs", "/dev/shm", "tmpfs", tmpfs, Some("mode=1777"));
    mount("tmpfs", "/tmp", "tmpfs", tmpfs, Some("mode=1777"));
    mount("tmpfs", "/run", "tmpfs", tmpfs, Some("mode=755"));
    // favordynmods: each command moves its first process into a cgroup of
    // its own (cgroup.rs); without it every such move waits for an RCU
    // grace period, about 20 ms of each exec in a guest under emulation.
    if !mount(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        nodev,
        Some("favordynmods"),
    ) {
        mount("cgroup2", "/sys/fs/cgroup", "cgroup2", nodev, None);
    }
    crate::cgroup::enable();
    if let Err(e) = lo_up() {
        log!("bringing up lo: {e}");
    }
    crate::net::setup();
    grow_root();
    workspace();
    crate::sudo::supply();
    log!("init done in {} ms", t.elapsed().as_millis());
}
