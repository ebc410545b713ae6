//! Small helpers over libc: errno, polling, logging, failure codes.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use runtime_proto::{FailCode, Reply};

/// Logs one line to stderr (the serial console). Never panics, unlike `eprintln!`.
macro_rules! log {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "agent: {}", format_args!($($t)*));
    }};
}
pub(crate) use log;

/// Locks a mutex, ignoring poisoning: a panicked thread must not take the agent down.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(crate) fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Polls one fd; returns the `revents` (0 on timeout).
pub(crate) fn poll1(fd: RawFd, events: i16, timeout_ms: i32) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: `p` is a valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if r == 0 { 0 } else { p.revents })
}

/// A request that failed, ready to become [`Reply::Failed`].
#[derive(Debug)]
pub(crate) struct Fail {
    pub code: FailCode,
    pub message: String,
}

impl Fail {
    pub(crate) fn new(code: FailCode, message: impl Into<String>) -> Fail {
        Fail {
            code,
            message: message.into(),
        }
    }

    /// An OS error, its code mapped from errno; `context` says what was done.
    pub(crate) fn io(context: impl std::fmt::Display, e: &io::Error) -> Fail {
        Fail {
            code: code_for(e),
            message: format!("{context}: {e}"),
        }
    }

    pub(crate) fn reply(self) -> Reply {
        Reply::Failed {
            code: self.code,
            message: self.message,
        }
    }
}

pub(crate) fn code_for(e: &io::Error) -> FailCode {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FailCode::FileNotFound,
        Some(libc::EISDIR) => FailCode::IsADirectory,
        Some(libc::ENOTDIR) => FailCode::NotADirectory,
        Some(libc::EACCES) | Some(libc::EPERM) => FailCode::PermissionDenied,
        Some(libc::EEXIST) => FailCode::AlreadyExists,
        Some(libc::ENOTEMPTY) => FailCode::DirectoryNotEmpty,
        Some(libc::ENAMETOOLONG) => FailCode::InvalidPath,
        _ => FailCode::Io,
    }
}

/// Lets through at most `burst` messages per `period`; for anything the guest
/// or the host can trigger in a loop.
pub(crate) struct RateLimit {
    period: Duration,
    burst: u32,
    state: Mutex<(Option<Instant>, u32, u64)>,
}

impl RateLimit {
    pub(crate) const fn new(period: Duration, burst: u32) -> RateLimit {
        RateLimit {
            period,
            burst,
            state: Mutex::new((None, 0, 0)),
        }
    }

    /// `Some(suppressed)` when this message may be logged (with the number
    /// suppressed since the last one), `None` when it must be dropped.
    pub(crate) fn allow(&self) -> Option<u64> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        match st.0 {
            Some(start) if now.duration_since(start) < self.period => {}
            _ => {
                st.0 = Some(now);
                st.1 = 0;
            }
        }
        if st.1 < self.burst {
            st.1 += 1;
            let suppressed = st.2;
            st.2 = 0;
            Some(suppressed)
        } else {
            st.2 += 1;
            None
        }
    }
}

/// Logs through a [`RateLimit`].
macro_rules! log_limited {
    ($limit:expr, $($t:tt)*) => {{
        if let Some(suppressed) = $limit.allow() {
            if suppressed > 0 {
                $crate::sys::log!("{} ({} similar messages suppressed)", format_args!($($t)*), suppressed);
            } else {
                $crate::sys::log!($($t)*);
            }
        }
    }};
}
pub(crate) use log_limited;

/// Sends `sig` to the process group `sid` and to every other process of the
/// session `sid` (a shell on a pty puts its jobs in their own groups).
pub(crate) fn kill_session(sid: i32, sig: i32) {
    if sid <= 1 {
        return;
    }
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe { libc::kill(-sid, sig) };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name: state ppid pgrp session ...
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let session = rest
            .split_whitespace()
            .nth(3)
            .and_then(|s| s.parse::<i32>().ok());
        if session == Some(sid) {
            // SAFETY: plain syscall.
            unsafe { libc::kill(pid, sig) };
        }
    }
}
