//! Where guests' RAM lives: the directory of their RAM files (tmpfs where
//! the host has room), which RAM a machine about to start gets, and sparse
//! copies of RAM files.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::machine::QemuHost;
use crate::qemu;

/// Which RAM a machine about to start gets (see [`qemu::Ram`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RamPlan<'a> {
    /// A file of its own, empty or filled with a copy of this RAM file.
    Own { fill: Option<&'a Path> },
    /// A private mapping of a fork's frozen RAM file.
    CopyOf(&'a Path),
    /// Anonymous memory, for a state that holds the whole memory.
    Anon,
}

impl<'a> RamPlan<'a> {
    /// For a machine started from a capture: booted (`loads_state` false)
    /// or loading the captured state, whose RAM file is `ram` when the
    /// captured machine had one. A fork's copies, and a template's restores
    /// when the host shares templates' memory (`shared`), map that file
    /// privately (sharing the pages none of them writes); anything else
    /// started from it gets a file of its own.
    pub(crate) fn restoring(loads_state: bool, ram: Option<&'a Path>, shared: bool) -> Self {
        match (loads_state, ram) {
            (false, _) => RamPlan::Own { fill: None },
            (true, None) => RamPlan::Anon,
            (true, Some(ram)) if shared => RamPlan::CopyOf(ram),
            (true, Some(ram)) => RamPlan::Own { fill: Some(ram) },
        }
    }

    /// For a paused machine waking: a file of its own filled from the RAM
    /// file its pause kept, or, without one, anonymous memory (its state
    /// holds the whole memory).
    pub(crate) fn waking(ram: Option<&'a Path>) -> Self {
        match ram {
            Some(ram) => RamPlan::Own { fill: Some(ram) },
            None => RamPlan::Anon,
        }
    }
}

/// A machine's own RAM file while the machine starts: removed when this is
/// dropped (whatever failed), unless [kept](StartingRam::keep) once the
/// machine is up.
pub(crate) struct StartingRam(Option<PathBuf>);

impl StartingRam {
    pub(crate) fn new(file: Option<PathBuf>) -> Self {
        StartingRam(file)
    }

    pub(crate) fn file(&self) -> Option<&PathBuf> {
        self.0.as_ref()
    }

    /// The machine is up: its file stays.
    pub(crate) fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for StartingRam {
    fn drop(&mut self) {
        if let Some(f) = &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl QemuHost {
    /// The RAM file a machine maps shared (its own memory).
    pub(crate) fn own_ram(&self, id: &str) -> PathBuf {
        self.ram_dir.join(format!("{id}.ram"))
    }

    /// Where forks keep their capture while the copies start: on the disk
    /// of the data directory, not the memory file system. A copy that is
    /// itself captured later reads its whole memory, which in a file on
    /// tmpfs would allocate (and hold) every page never written; in the
    /// page cache of a disk file those are clean and reclaimable.
    pub(crate) fn forks_dir(&self) -> PathBuf {
        self.cfg.state_dir.join(".forks")
    }

    /// RAM files of machines that no longer run (a crash of the server, a
    /// killed QEMU), and the captures of forks cut short, would hold host
    /// memory and disk for nothing.
    pub(crate) fn drop_stale_ram(&self) {
        if let Ok(forks) = std::fs::read_dir(self.forks_dir()) {
            for f in forks.flatten() {
                let _ = std::fs::remove_dir_all(f.path());
            }
        }
        let Ok(entries) = std::fs::read_dir(&*self.ram_dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".ram") else {
                continue;
            };
            let paths = self.paths(id);
            let alive =
                qemu::read_pid(&paths).is_some_and(|pid| qemu::is_our_qemu(pid, &paths.dir));
            if !alive {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The directory of the guests' RAM files. `RUNTIME_RAM_DIR` chooses it;
/// otherwise `/dev/shm` (tmpfs: the pages are the memory itself, never
/// written back to a disk), one directory per state directory so that
/// servers side by side never meet. A `/dev/shm` smaller than half the
/// host's memory (a container's default is 64 MiB) would end guests with
/// SIGBUS once full: then a directory beside the state directory, where the
/// files are ordinary files (the kernel writes their pages back to the disk
/// now and then).
pub(crate) fn choose_dir(state_dir: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("RUNTIME_RAM_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    let room = statvfs_bytes(shm).unwrap_or(0);
    if !shm_has_room(room, host_memory_bytes()) {
        tracing::warn!(
            shm_bytes = room,
            "/dev/shm is missing or small: guest RAM files go to the data directory's disk \
             (set RUNTIME_RAM_DIR to a tmpfs to keep them in memory)"
        );
        return state_dir.join(".ram");
    }
    let abs = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_owned());
    shm.join(shm_dir_name(&abs))
}

/// Whether a memory file system of `room` bytes holds the guests of a host
/// with `memory` bytes: at least half of it.
fn shm_has_room(room: u64, memory: u64) -> bool {
    room >= memory / 2
}

/// The name of the RAM directory in `/dev/shm` for the state directory at
/// the absolute path `state_dir`.
fn shm_dir_name(state_dir: &Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(state_dir.as_os_str().as_encoded_bytes());
    format!("runtime-{}", &hex::encode(digest)[..16])
}

/// The size of the file system at `path`, in bytes.
fn statvfs_bytes(path: &Path) -> Option<u64> {
    statvfs_sizes(path).map(|(total, _)| total)
}

/// The size of the file system at `path` and what an unprivileged writer
/// may still use of it, in bytes.
fn statvfs_sizes(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((
        st.f_blocks.saturating_mul(st.f_frsize),
        st.f_bavail.saturating_mul(st.f_frsize),
    ))
}

/// MemTotal of /proc/meminfo, in bytes (0 when unknown).
fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| mem_total(&m))
        .unwrap_or(0)
}

/// The MemTotal line of a `/proc/meminfo`, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    meminfo_bytes(meminfo, "MemTotal:")
}

/// One `Name: N kB` line of a `/proc/meminfo`, in bytes.
fn meminfo_bytes(meminfo: &str, name: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// What the host has free now: memory, the RAM directory and the state
/// directory's disk (`None` when /proc/meminfo cannot be read).
pub(crate) fn room(ram_dir: &Path, state_dir: &Path) -> Option<crate::Room> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let (ram_total, ram_free) = statvfs_sizes(ram_dir).unwrap_or((0, 0));
    Some(crate::Room {
        memory_total: mem_total(&meminfo)?,
        memory_available: meminfo_bytes(&meminfo, "MemAvailable:")?,
        ram_dir_total: ram_total,
        ram_dir_free: ram_free,
        disk_free: statvfs_sizes(state_dir).map_or(0, |(_, free)| free),
    })
}

/// Copies a RAM file: only its data (the pages the guest touched), holes
/// stay holes. `cp --sparse=always` would also look for zeros in the data,
/// several times slower.
pub(crate) async fn copy_ram(from: &Path, to: &Path) -> std::io::Result<()> {
    let (from, to) = (from.to_owned(), to.to_owned());
    tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let src = std::fs::File::open(&from)?;
        let len = src.metadata()?.len();
        let dst = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&to)?;
        dst.set_len(len)?;
        let mut buf = vec![0u8; 4 << 20];
        let mut at: u64 = 0;
        while at < len {
            // SAFETY: lseek on an open descriptor; no memory is involved.
            let data = unsafe { libc::lseek(src.as_raw_fd(), at as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENXIO) {
                    break; // no data after `at`
                }
                return Err(e);
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(src.as_raw_fd(), data, libc::SEEK_HOLE) };
            if hole < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let end = hole as u64;
            for (pos, n) in pieces(data as u64, end, buf.len()) {
                src.read_exact_at(&mut buf[..n], pos)?;
                dst.write_all_at(&buf[..n], pos)?;
            }
            at = end;
        }
        Ok(())
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The reads that copy the bytes `[start, end)` through a buffer of `buf`
/// bytes: each one's offset and length, in order.
fn pieces(start: u64, end: u64, buf: usize) -> impl Iterator<Item = (u64, usize)> {
    let mut pos = start;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let n = buf.min((end - pos) as usize);
        let at = pos;
        pos += n as u64;
        Some((at, n))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn pieces_cover_a_range_in_buffer_sized_reads() {
        let p: Vec<_> = pieces(4096, 4096 + 10, 4).collect();
        assert_eq!(p, [(4096, 4), (4100, 4), (4104, 2)]);
        let exact: Vec<_> = pieces(0, 8, 4).collect();
        assert_eq!(exact, [(0, 4), (4, 4)]);
        let one: Vec<_> = pieces(100, 101, 4 << 20).collect();
        assert_eq!(one, [(100, 1)]);
        assert_eq!(pieces(7, 7, 4).count(), 0);
        assert_eq!(pieces(9, 7, 4).count(), 0);
    }

    #[test]
    fn pieces_of_a_large_range_are_contiguous_and_complete() {
        let (start, end, buf) = (3u64, 3 + (10 << 20) + 5, 4usize << 20);
        let mut next = start;
        for (at, n) in pieces(start, end, buf) {
            assert_eq!(at, next);
            assert!(n > 0 && n <= buf);
            next = at + n as u64;
        }
        assert_eq!(next, end);
    }

    #[test]
    fn mem_total_is_read_in_bytes() {
        let meminfo =
            "MemFree:         1000 kB\nMemTotal:       16318412 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(mem_total(meminfo), Some(16318412 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: lots\n"), None);
        assert!(host_memory_bytes() > 0, "this host's /proc/meminfo");
    }

    #[test]
    fn shm_needs_half_the_host_memory() {
        let gib = 1u64 << 30;
        assert!(shm_has_room(8 * gib, 16 * gib));
        assert!(shm_has_room(16 * gib, 16 * gib));
        assert!(!shm_has_room(8 * gib - 1, 16 * gib));
        // A container's default /dev/shm.
        assert!(!shm_has_room(64 << 20, 4 * gib));
        // No /dev/shm at all.
        assert!(!shm_has_room(0, 4 * gib));
        // Memory unknown: whatever /dev/shm there is.
        assert!(shm_has_room(0, 0));
    }

    #[test]
    fn each_state_directory_has_its_own_shm_directory() {
        // Fixed: servers find their RAM files again after an upgrade.
        assert_eq!(
            shm_dir_name(Path::new("/var/lib/runtime")),
            "runtime-a21c5423210b38c3"
        );
        assert_ne!(
            shm_dir_name(Path::new("/var/lib/runtime")),
            shm_dir_name(Path::new("/var/lib/runtime2"))
        );
    }

    #[test]
    fn the_ram_plan_of_a_restore() {
        let ram = Path::new("/caps/memory.ram");
        // A capture of the disk only boots, into a file of its own.
        assert_eq!(
            RamPlan::restoring(false, Some(ram), true),
            RamPlan::Own { fill: None }
        );
        assert_eq!(
            RamPlan::restoring(false, None, false),
            RamPlan::Own { fill: None }
        );
        // A state with its whole memory loads into anonymous memory.
        assert_eq!(RamPlan::restoring(true, None, true), RamPlan::Anon);
        // A fork's copies share its frozen file; others copy it.
        assert_eq!(
            RamPlan::restoring(true, Some(ram), true),
            RamPlan::CopyOf(ram)
        );
        assert_eq!(
            RamPlan::restoring(true, Some(ram), false),
            RamPlan::Own { fill: Some(ram) }
        );
    }

    #[test]
    fn the_ram_plan_of_a_wake() {
        let ram = Path::new("/vm/paused.ram");
        assert_eq!(RamPlan::waking(Some(ram)), RamPlan::Own { fill: Some(ram) });
        assert_eq!(RamPlan::waking(None), RamPlan::Anon);
    }

    #[test]
    fn a_starting_machines_ram_file_goes_unless_kept() {
        let dir = scratch("guard");
        let (lost, kept) = (dir.join("lost.ram"), dir.join("kept.ram"));
        std::fs::write(&lost, b"x").unwrap();
        std::fs::write(&kept, b"x").unwrap();
        {
            let guard = StartingRam::new(Some(lost.clone()));
            assert_eq!(guard.file(), Some(&lost));
        }
        assert!(!lost.exists(), "a failed start removes the file");
        StartingRam::new(Some(kept.clone())).keep();
        assert!(kept.exists(), "a machine that is up keeps it");
        assert_eq!(StartingRam::new(None).file(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rt-host-ram-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[tokio::test]
    async fn copy_ram_copies_the_data_and_keeps_the_holes() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = scratch("copy");
        let (from, to) = (dir.join("from.ram"), dir.join("to.ram"));
        let len: u64 = 64 << 20;
        {
            let f = std::fs::File::create(&from).unwrap();
            f.set_len(len).unwrap();
            f.write_all_at(b"first page", 0).unwrap();
            // Data larger than the copy's buffer, across its boundary.
            let big: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
            f.write_all_at(&big, (20 << 20) + 123).unwrap();
            f.write_all_at(b"last", len - 4).unwrap();
        }
        copy_ram(&from, &to).await.unwrap();
        let (a, b) = (std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
        assert_eq!(a.len(), b.len());
        assert!(a == b, "the copy differs");
        let (src, dst) = (
            std::fs::metadata(&from).unwrap(),
            std::fs::metadata(&to).unwrap(),
        );
        assert_eq!(dst.mode() & 0o777, 0o600);
        if src.blocks() * 512 < len / 2 {
            // The file system keeps holes: so does the copy.
            assert!(
                dst.blocks() * 512 < len / 2,
                "the copy allocated {} bytes",
                dst.blocks() * 512
            );
        }
        // It never writes over a file that is there.
        assert!(copy_ram(&from, &to).await.is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn copy_ram_of_an_empty_file_is_all_hole() {
        let dir = scratch("empty");
        let (from, to) = (dir.join("from.ram"), dir.join("to.ram"));
        std::fs::File::create(&from)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        copy_ram(&from, &to).await.unwrap();
        let b = std::fs::read(&to).unwrap();
        assert_eq!(b.len(), 8 << 20);
        assert!(b.iter().all(|&x| x == 0));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
