//! Traced files (`ExecRequest::trace_files`): which files a command, and
//! everything it starts, opened and wrote.
//!
//! fanotify with *mount* marks, on a mount namespace of the command's own:
//! before the fork the agent makes a notification group and lists the
//! mount points of real file stores (read from `/proc/self/mountinfo`, so
//! the child allocates nothing); the child, still root, leaves the agent's
//! mount namespace (`unshare(CLONE_NEWNS)`, the copy a slave so nothing it
//! mounts propagates out) and marks each of those mounts *in its new
//! namespace*. Those mount objects are used only by processes of that
//! namespace, the command and its descendants, so every event the group
//! gets is theirs, and no other command's opens, running at the same time,
//! are seen. The kernel queues an event at the open (or the close of a file
//! opened for writing) itself, so once the command has ended, what is
//! queued is complete.
//!
//! Why not the alternatives: ptrace would slow every system call and
//! conflicts with a command that traces (gdb, strace); seccomp user
//! notification sees the path a process *asked* for, not the file the
//! kernel opened (symlinks, relative paths, races). A fanotify group per
//! command with its own namespace needs no filter by pid, which would miss
//! what a command's children start after their parent exited.
//!
//! What a namespace of its own changes for the command: mounts it makes
//! (as root) are not seen outside it, and a mount made outside after it
//! started is not traced (and seen only where it propagates).

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use runtime_proto::TracedFiles;

use crate::sys::{errno, lock, poll1};

/// Most paths kept in each list; past it the answer is `truncated`.
pub(crate) const MAX_PATHS: usize = 10_000;
/// Most bytes of paths one answer carries (it travels in one frame of at
/// most [`runtime_proto::MAX_PAYLOAD`]); past it, `truncated`.
pub(crate) const MAX_BYTES: usize = 192 * 1024;

/// File systems that hold no files a command reads as data: not marked.
const PSEUDO: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "debugfs",
    "securityfs",
    "bpf",
    "tracefs",
    "pstore",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
    "autofs",
    "rpc_pipefs",
    "nsfs",
    "efivarfs",
    "selinuxfs",
];

/// The events asked for: opens (exec'd files included), closes after a
/// write, on directories too (an `opendir` is an open).
const MASK: u64 = libc::FAN_OPEN | libc::FAN_OPEN_EXEC | libc::FAN_CLOSE_WRITE | libc::FAN_ONDIR;

/// A notification group made before the fork, and the mount points its
/// child marks.
pub(crate) struct Trace {
    fd: OwnedFd,
    mounts: Vec<CString>,
}

impl Trace {
    /// A new group; `Err` when the kernel has no fanotify (or refuses it).
    pub(crate) fn new() -> std::io::Result<Trace> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
        // SAFETY: plain syscall; a non-negative result is a new fd we own.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK,
                // O_NONBLOCK: the agent's own open of a FIFO must not wait
                // for a writer.
                (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC | libc::O_NONBLOCK) as u32,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fanotify_init just returned this fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mounts = file_stores(&mountinfo)
            .into_iter()
            .filter_map(|m| CString::new(m).ok())
            .collect();
        Ok(Trace { fd, mounts })
    }

    /// In the spawned child, before it drops root: a mount namespace of its
    /// own, each file store in it marked. `false` when the namespace could
    /// not be made or no mount marked (errno says why); one mount that
    /// cannot be marked is skipped (it is hidden under another one, or not
    /// a file store fanotify takes).
    ///
    /// # Safety
    /// Async-signal-safe: only system calls on data made before the fork.
    pub(crate) unsafe fn enter(&self) -> bool {
        // SAFETY: plain system calls on NUL-terminated strings that outlive them.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) < 0 {
                return false;
            }
            let root = c"/".as_ptr();
            if libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ) < 0
            {
                return false;
            }
            let mut marked = 0;
            for m in &self.mounts {
                if libc::fanotify_mark(
                    self.fd.as_raw_fd(),
                    libc::FAN_MARK_ADD | libc::FAN_MARK_MOUNT,
                    MASK,
                    libc::AT_FDCWD,
                    m.as_ptr(),
                ) == 0
                {
                    marked += 1;
                }
            }
            // Not one: the kernel takes no marks, and an empty trace
            // would pass for a command that opened nothing.
            marked > 0
        }
    }

    /// Reads the group's events on a thread of its own until
    /// [`Collector::finish`].
    pub(crate) fn collect(self) -> Collector {
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        let done = crate::pool::run(move || {
            let files = read_events(&self.fd, &s.stop);
            *lock(&s.files) = Some(files);
        });
        let done = match done {
            Ok(d) => Some(d),
            Err(e) => {
                crate::sys::log!("cannot start a trace thread: {e}");
                None
            }
        };
        Collector { shared, done }
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    files: Mutex<Option<TracedFiles>>,
}

/// The thread reading a command's events.
pub(crate) struct Collector {
    shared: Arc<Shared>,
    done: Option<crate::pool::Done>,
}

impl Collector {
    /// The command has ended: what was queued is read, and the lists made.
    pub(crate) fn finish(self) -> TracedFiles {
        self.shared.stop.store(true, Ordering::SeqCst);
        let Some(done) = self.done else {
            return TracedFiles {
                truncated: true,
                ..TracedFiles::default()
            };
        };
        done.join();
        lock(&self.shared.files).take().unwrap_or(TracedFiles {
            truncated: true,
            ..TracedFiles::default()
        })
    }
}

/// The mount points of `/proc/self/mountinfo` whose file system holds
/// files, unescaped.
fn file_stores(mountinfo: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((head, tail)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = head.split(' ').nth(4) else {
            continue;
        };
        let Some(fstype) = tail.split(' ').next() else {
            continue;
        };
        if PSEUDO.contains(&fstype) {
            continue;
        }
        let point = unescape(point);
        if !out.contains(&point) {
            out.push(point);
        }
    }
    out
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = oct.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What the events said so far.
#[derive(Default)]
struct Sets {
    read: BTreeSet<String>,
    written: BTreeSet<String>,
    truncated: bool,
}

impl Sets {
    /// One event's path; `dir` when it is a directory (the kernel does not
    /// say so in the mask of a group that reports fds).
    fn add(&mut self, mask: u64, dir: bool, path: String) {
        let path = match path.strip_suffix(" (deleted)") {
            Some(p) => p.to_string(),
            None => path,
        };
        if !path.starts_with('/') {
            return;
        }
        let shown = if dir && !path.ends_with('/') {
            format!("{path}/")
        } else {
            path
        };
        if mask & libc::FAN_CLOSE_WRITE != 0 && !dir {
            insert(&mut self.written, &mut self.truncated, shown.clone());
        }
        if mask & (libc::FAN_OPEN | libc::FAN_OPEN_EXEC) != 0 {
            insert(&mut self.read, &mut self.truncated, shown);
        }
    }

    /// The lists, within [`MAX_BYTES`]: what was written first, then what
    /// was opened.
    fn into_files(self) -> TracedFiles {
        let mut budget = MAX_BYTES;
        let mut truncated = self.truncated;
        let mut take = |set: BTreeSet<String>| {
            let mut v = Vec::with_capacity(set.len());
            for p in set {
                // The path, its quotes and comma, and some escapes.
                let cost = p.len() + 4;
                if cost > budget {
                    truncated = true;
                    continue;
                }
                budget -= cost;
                v.push(p);
            }
            v
        };
        let written = take(self.written);
        let read = take(self.read);
        TracedFiles {
            read,
            written,
            truncated,
        }
    }
}

fn insert(set: &mut BTreeSet<String>, truncated: &mut bool, path: String) {
    if set.len() >= MAX_PATHS && !set.contains(&path) {
        *truncated = true;
        return;
    }
    set.insert(path);
}

/// Reads events until `stop`, then what is still queued.
fn read_events(fd: &OwnedFd, stop: &AtomicBool) -> TracedFiles {
    let mut sets = Sets::default();
    // Aligned for the event header; 4 KiB holds ~170 events.
    let mut buf = vec![0u64; 512];
    let mut errors = 0u32;
    loop {
        let stopping = stop.load(Ordering::SeqCst);
        if !stopping && matches!(poll1(fd.as_raw_fd(), libc::POLLIN, 25), Ok(0)) {
            continue;
        }
        // SAFETY: reads into `buf`, which has room for its byte length.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len() * std::mem::size_of::<u64>(),
            )
        };
        if n < 0 {
            match errno() {
                libc::EINTR => continue,
                libc::EAGAIN if stopping => break,
                libc::EAGAIN => continue,
                // The event could not be given (no fd to open it with): it is lost.
                _ => {
                    sets.truncated = true;
                    errors += 1;
                    if errors > 10_000 {
                        break;
                    }
                    continue;
                }
            }
        }
        if n == 0 {
            break;
        }
        // SAFETY: the kernel wrote `n` bytes of events at the start of `buf`.
        let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize) };
        parse(bytes, &mut sets);
    }
    sets.into_files()
}

/// Takes the events in `bytes`: each fd is read for its path, then closed.
fn parse(bytes: &[u8], sets: &mut Sets) {
    let head = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut at = 0;
    while at + head <= bytes.len() {
        // SAFETY: `head` bytes are there; read_unaligned copes with any alignment.
        let ev: libc::fanotify_event_metadata =
            unsafe { std::ptr::read_unaligned(bytes[at..].as_ptr().cast()) };
        let len = ev.event_len as usize;
        if len < head || ev.vers != libc::FANOTIFY_METADATA_VERSION {
            sets.truncated = true;
            return;
        }
        if ev.mask & libc::FAN_Q_OVERFLOW != 0 {
            sets.truncated = true;
        }
        if ev.fd >= 0 {
            // SAFETY: the kernel opened this fd for us; we own and close it.
            let file = unsafe { OwnedFd::from_raw_fd(ev.fd) };
            match std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
                Ok(p) => sets.add(ev.mask, is_dir(&file), p.to_string_lossy().into_owned()),
                Err(_) => sets.truncated = true,
            }
        }
        at += len;
    }
}

fn is_dir(fd: &OwnedFd) -> bool {
    // SAFETY: fstat fills the zeroed struct we own, from an fd we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe {
        libc::fstat(fd.as_raw_fd(), &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFDIR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_stores_skip_pseudo_file_systems_and_unescape() {
        let info = "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
                    23 22 0:5 / /dev rw - devtmpfs devtmpfs rw\n\
                    24 22 0:20 / /proc rw - proc proc rw\n\
                    25 22 0:21 / /tmp rw shared:1 - tmpfs tmpfs rw\n\
                    26 22 0:22 / /mnt/my\\040disk rw - tmpfs tmpfs rw\n\
                    27 22 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n\
                    28 25 0:24 / /tmp rw - tmpfs tmpfs rw\n\
                    garbage\n";
        assert_eq!(file_stores(info), ["/", "/tmp", "/mnt/my disk"]);
    }

    #[test]
    fn sets_sort_mark_directories_and_bound() {
        let mut s = Sets::default();
        s.add(libc::FAN_OPEN, false, "/b".into());
        s.add(libc::FAN_OPEN, false, "/a".into());
        s.add(libc::FAN_OPEN, true, "/d".into());
        s.add(libc::FAN_OPEN, true, "/".into());
        s.add(libc::FAN_CLOSE_WRITE, false, "/w (deleted)".into());
        s.add(libc::FAN_OPEN, false, "pipe:[123]".into());
        let f = s.into_files();
        assert_eq!(f.read, ["/", "/a", "/b", "/d/"]);
        assert_eq!(f.written, ["/w"]);
        assert!(!f.truncated);

        let mut s = Sets::default();
        for i in 0..MAX_PATHS + 5 {
            s.add(libc::FAN_OPEN, false, format!("/f{i}"));
        }
        let f = s.into_files();
        assert!(f.truncated);
        assert!(f.read.len() <= MAX_PATHS);
        let bytes: usize = f.read.iter().map(|p| p.len() + 4).sum();
        assert!(bytes <= MAX_BYTES);
    }
}
