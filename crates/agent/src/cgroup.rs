//! A cgroup per command, so that the kernel's out-of-memory kills among a
//! command and everything it started can be counted (`oom_kill` in the
//! group's `memory.events`, which the kernel counts against the victim's
//! group whether the sandbox as a whole ran out of memory or not).
//!
//! The groups sit directly under the root of the guest's cgroup2 tree
//! (mounted by init, with the memory controller given to its children).
//! The child moves itself in between its clone and exec, while still root.
//!
//! A group whose command ended with nothing left in it is kept for a later
//! command (a few of them, [`KEEP_IDLE`]) rather than removed: making a
//! group with the memory controller and removing it cost about 1 ms of
//! every short command under emulation. `memory.events` only counts up, so
//! a reused group remembers the count it was handed over with and reports
//! what came after.

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::sys::lock;

const ROOT: &str = "/sys/fs/cgroup";
/// Groups left with processes in them (a command's background children),
/// removed by a later command's end once they are empty. Bounded: past it
/// the oldest is forgotten (its directory stays, empty or not).
const MAX_LINGERING: usize = 1024;

/// Empty groups kept for reuse.
const KEEP_IDLE: usize = 4;

static NEXT: AtomicU64 = AtomicU64::new(1);
/// Set by [`enable`] in the guest's init only: an agent run elsewhere (its
/// tests on a host) makes no cgroups.
static ENABLED: AtomicBool = AtomicBool::new(false);
static LINGERING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Empty groups for the next commands, with their `oom_kill` counts.
static IDLE: Mutex<Vec<Group>> = Mutex::new(Vec::new());

/// Gives the root's children the memory controller (at start-up; without
/// it, commands run uncounted).
pub(crate) fn enable() {
    let control = format!("{ROOT}/cgroup.subtree_control");
    match std::fs::write(&control, "+memory") {
        Ok(()) => ENABLED.store(true, Ordering::Relaxed),
        Err(e) => crate::log!("enabling the memory controller: {e}"),
    }
}

/// One command's group.
pub(crate) struct Group {
    dir: PathBuf,
    /// `<dir>/cgroup.procs`, for the child to write itself into.
    procs: CString,
    /// Its `oom_kill` count when it was handed out (earlier commands').
    base: u32,
}

impl Group {
    /// A new group, or `None` where there is no cgroup2 tree with the
    /// memory controller (the command then runs as before, uncounted).
    pub(crate) fn new() -> Option<Group> {
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(g) = lock(&IDLE).pop() {
            return Some(g);
        }
        let dir = PathBuf::from(format!(
            "{ROOT}/cmd-{}",
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).ok()?;
        if !dir.join("memory.events").exists() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        let procs = CString::new(
            dir.join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .ok()?;
        Some(Group {
            dir,
            procs,
            base: 0,
        })
    }

    pub(crate) fn procs_path(&self) -> &std::ffi::CStr {
        &self.procs
    }

    /// How many processes of the group the kernel killed for memory
    /// (since it was handed out).
    pub(crate) fn oom_kills(&self) -> u32 {
        self.oom_kill_count().saturating_sub(self.base)
    }

    /// The kernel's count, since the group was made.
    fn oom_kill_count(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("memory.events"))
            .ok()
            .and_then(|text| parse_oom_kills(&text))
            .unwrap_or(0)
    }

    /// No process in it (nor in a group below it).
    fn is_empty(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events"))
            .is_ok_and(|text| text.lines().any(|l| l == "populated 0"))
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let mut lingering = lock(&LINGERING);
        lingering.retain(|d| std::fs::remove_dir(d).is_err() && d.exists());
        if self.is_empty() {
            let base = self.oom_kill_count();
            let mut idle = lock(&IDLE);
            if idle.len() < KEEP_IDLE {
                idle.push(Group {
                    dir: std::mem::take(&mut self.dir),
                    procs: std::mem::take(&mut self.procs),
                    base,
                });
                return;
            }
        }
        if std::fs::remove_dir(&self.dir).is_err() && self.dir.exists() {
            if lingering.len() >= MAX_LINGERING {
                lingering.remove(0);
            }
            lingering.push(self.dir.clone());
        }
    }
}

/// `oom_kill N` of a `memory.events` file.
fn parse_oom_kills(events: &str) -> Option<u32> {
    events.lines().find_map(|l| {
        let (key, value) = l.split_once(' ')?;
        (key == "oom_kill").then(|| value.trim().parse().ok())?
    })
}

/// In the spawned child (raw system calls only): moves the calling process into
/// the group whose `cgroup.procs` is `procs`. Failure leaves it where it is.
///
/// # Safety
/// Call only in a child of `crate::spawn::vfork` (or of `fork`).
pub(crate) unsafe fn join(procs: &std::ffi::CStr) {
    // SAFETY: open/write/close on a NUL-terminated path and a local buffer.
    unsafe {
        // Raw system calls: libc's open, write and close are cancellation
        // points that mark the calling thread, which the child shares.
        let fd = libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            procs.as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::syscall(libc::SYS_write, fd, b"0".as_ptr(), 1usize);
            libc::syscall(libc::SYS_close, fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oom_kill_count_is_read_from_memory_events() {
        let events = "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(events), Some(2));
        assert_eq!(parse_oom_kills("low 0\noom 0\n"), None);
        assert_eq!(parse_oom_kills("oom_kill x\n"), None);
    }
}
