//! File operations. Each runs on its own thread, which first takes the
//! file-system identity of the requested user (`setfsuid`/`setfsgid` and the
//! raw `setgroups` syscall are per-thread on Linux), so files the sandbox
//! user creates belong to it and root-only files are refused.

use std::ffi::OsStr;
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Condvar, Mutex};

use runtime_proto::flow::SendWindow;
use runtime_proto::{
    channel, Entry, EntryType, FailCode, Frame, Reply, User, MAX_FRAME, MAX_PAYLOAD, MAX_READ_BYTES,
};

use crate::exec::SANDBOX_ID;
use crate::link::Outbox;
use crate::sys::{cstring, lock, Fail};

/// The credits of a flow-controlled read ([`runtime_proto::Request::ReadFile`]
/// `flow`): the read thread sends only what the host granted, and stops
/// when the host closes the stream (or a new host connection starts).
#[derive(Default)]
pub(crate) struct ReadGate {
    st: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Default)]
struct GateState {
    send: SendWindow,
    closed: bool,
}

impl ReadGate {
    /// The host's `Credit`; a grant beyond the bound closes the read
    /// (answers false).
    pub(crate) fn credit(&self, bytes: u32) -> bool {
        let mut st = lock(&self.st);
        let ok = st.send.grant(bytes).is_ok();
        if !ok {
            st.closed = true;
        }
        drop(st);
        self.cv.notify_all();
        ok
    }

    /// The host's `Close` (or a new host connection): the read stops.
    pub(crate) fn close(&self) {
        lock(&self.st).closed = true;
        self.cv.notify_all();
    }

    /// Waits until some bytes may be sent: how many (at most `max`), or
    /// `None` once the read is closed.
    fn wait(&self, max: usize) -> Option<usize> {
        let mut st = lock(&self.st);
        loop {
            if st.closed {
                return None;
            }
            let n = st.send.available().min(max);
            if n > 0 {
                return Some(n);
            }
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn sent(&self, n: usize) {
        lock(&self.st).send.sent(n);
    }
}

/// A listing never collects more than this many entries, whatever the limit.
const LIST_HARD_CAP: usize = 100_000;

/// Takes the file-system identity of `user` for the calling thread only.
pub(crate) fn become_user(user: User) -> Result<(), Fail> {
    if user == User::Root {
        return Ok(());
    }
    // SAFETY: raw syscalls changing only this thread's credentials (glibc's
    // setgroups wrapper would change every thread's).
    let ok = unsafe {
        libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0 && {
            libc::setfsgid(SANDBOX_ID);
            libc::setfsuid(SANDBOX_ID);
            // Each call returns the previous value: check both took.
            libc::setfsgid(u32::MAX) as u32 == SANDBOX_ID
                && libc::setfsuid(u32::MAX) as u32 == SANDBOX_ID
        }
    };
    if ok {
        Ok(())
    } else {
        Err(Fail::new(
            FailCode::PermissionDenied,
            "cannot take the sandbox user's identity",
        ))
    }
}

fn check_path(path: &str) -> Result<&Path, Fail> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(Fail::new(
            FailCode::InvalidPath,
            format!("path {path:?} must be absolute"),
        ));
    }
    Ok(Path::new(path))
}

/// Drops trailing slashes (but keeps "/").
fn normalize(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    if trimmed.is_empty() {
        "/".into()
    } else {
        trimmed.into()
    }
}

fn entry(path: &str, md: &Metadata) -> Entry {
    let name = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".into());
    let ft = md.file_type();
    let kind = if ft.is_symlink() {
        EntryType::Symlink
    } else if ft.is_dir() {
        EntryType::Directory
    } else if ft.is_file() {
        EntryType::File
    } else {
        EntryType::Other
    };
    Entry {
        name,
        path: path.into(),
        kind,
        size: md.len(),
        mode: md.mode() & 0o7777,
        modified: md.mtime(),
    }
}

/// Sends the file at `path` on `stream`: its size, its bytes (within the
/// credits of `gate` for a flow-controlled read), then `Done`. A read
/// closed by the host ends without another frame.
pub(crate) fn read_file(
    out: &Outbox,
    stream: u32,
    path: &str,
    gate: Option<&ReadGate>,
) -> Result<(), Fail> {
    let p = check_path(path)?;
    let file = File::open(p).map_err(|e| Fail::io(format_args!("open {path}"), &e))?;
    let md = file
        .metadata()
        .map_err(|e| Fail::io(format_args!("stat {path}"), &e))?;
    if md.is_dir() {
        return Err(Fail::new(
            FailCode::IsADirectory,
            format!("{path} is a directory"),
        ));
    }
    // A device or a pipe never ends (`/dev/zero`), and a read is held whole.
    if !md.is_file() {
        return Err(Fail::new(
            FailCode::BadRequest,
            format!("{path} is not a regular file"),
        ));
    }
    if md.len() > MAX_READ_BYTES {
        return Err(Fail::new(
            FailCode::TooLarge,
            format!(
                "{path} is {} bytes, more than a read takes ({} MiB): read it in parts with a command",
                md.len(),
                MAX_READ_BYTES >> 20
            ),
        ));
    }
    out.reply(stream, &Reply::FileStart { size: md.len() });
    // What it sends stops at the limit, even if the file grows meanwhile.
    let mut file = file.take(MAX_READ_BYTES + 1);
    let mut buf = vec![0u8; MAX_PAYLOAD];
    loop {
        let room = match gate {
            Some(g) => match g.wait(buf.len()) {
                Some(n) => n,
                None => return Ok(()),
            },
            None => buf.len(),
        };
        match file.read(&mut buf[..room]) {
            Ok(0) => break,
            Ok(n) => {
                if let Some(g) = gate {
                    g.sent(n);
                }
                out.data(stream, channel::INPUT, &buf[..n])
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Fail::io(format_args!("read {path}"), &e)),
        }
    }
    out.reply(stream, &Reply::Done);
    Ok(())
}

/// Creates `dir` and its missing parents. An existing non-directory gives EEXIST.
fn mkdir_p(dir: &Path) -> io::Result<()> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if dir.is_dir() {
                Ok(())
            } else {
                Err(e)
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match dir.parent() {
                Some(parent) if parent != dir => mkdir_p(parent)?,
                _ => return Err(e),
            }
            match fs::create_dir(dir) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
                other => other,
            }
        }
        Err(e) => Err(e),
    }
}

pub(crate) enum WriteMsg {
    Data(Vec<u8>),
    End,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Removes the temporary file unless it was renamed into place.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// Receives the file's bytes until `End`, then places it atomically.
/// After a failure the rest of the bytes are consumed and dropped, so the
/// one reply comes after `EndWrite` in every case.
pub(crate) fn write_file(
    path: &str,
    mode: Option<u32>,
    input: &mpsc::Receiver<WriteMsg>,
) -> Result<(), Fail> {
    let result = write_file_inner(path, mode, input);
    if result.is_err() {
        while let Ok(WriteMsg::Data(_)) = input.recv() {}
    }
    result
}

fn write_file_inner(
    path: &str,
    mode: Option<u32>,
    input: &mpsc::Receiver<WriteMsg>,
) -> Result<(), Fail> {
    let target = check_path(path)?;
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(Fail::new(
            FailCode::IsADirectory,
            format!("{path} is a directory"),
        ));
    };
    if fs::symlink_metadata(target)
        .map(|m| m.is_dir())
        .unwrap_or(false)
        || path.ends_with('/')
    {
        return Err(Fail::new(
            FailCode::IsADirectory,
            format!("{path} is a directory"),
        ));
    }
    mkdir_p(parent).map_err(|e| {
        if e.raw_os_error() == Some(libc::EEXIST) {
            Fail::new(
                FailCode::NotADirectory,
                format!("a parent of {path} is not a directory"),
            )
        } else {
            Fail::io(format_args!("create the parents of {path}"), &e)
        }
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(
        ".agent-tmp-{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp_path = parent.join(&tmp_name);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp_path)
        .map_err(|e| Fail::io(format_args!("create a file in {}", parent.display()), &e))?;
    let mut tmp = TempFile(Some(tmp_path.clone()));
    loop {
        match input.recv() {
            Ok(WriteMsg::Data(bytes)) => file
                .write_all(&bytes)
                .map_err(|e| Fail::io(format_args!("write {path}"), &e))?,
            Ok(WriteMsg::End) => break,
            Err(_) => return Err(Fail::new(FailCode::Io, "the write was abandoned")),
        }
    }
    // fchmod is not subject to the umask.
    file.set_permissions(fs::Permissions::from_mode(mode.unwrap_or(0o644) & 0o7777))
        .map_err(|e| Fail::io(format_args!("chmod {path}"), &e))?;
    drop(file);
    fs::rename(&tmp_path, target).map_err(|e| Fail::io(format_args!("rename onto {path}"), &e))?;
    tmp.0 = None;
    Ok(())
}

pub(crate) fn stat(path: &str) -> Result<Reply, Fail> {
    let p = check_path(path)?;
    match fs::symlink_metadata(p) {
        Ok(md) => Ok(Reply::Stat {
            entry: Some(entry(&normalize(path), &md)),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Reply::Stat { entry: None }),
        Err(e) => Err(Fail::io(format_args!("stat {path}"), &e)),
    }
}

fn join(dir: &str, name: &OsStr) -> String {
    let name = String::from_utf8_lossy(name.as_bytes());
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

pub(crate) fn list(path: &str, depth: u32, hidden: bool, limit: u32) -> Result<Reply, Fail> {
    let p = check_path(path)?;
    let md = fs::metadata(p).map_err(|e| Fail::io(format_args!("list {path}"), &e))?;
    if !md.is_dir() {
        return Err(Fail::new(
            FailCode::NotADirectory,
            format!("{path} is not a directory"),
        ));
    }
    let depth = depth.max(1);
    let mut entries = Vec::new();
    let mut truncated = false;
    let mut todo = vec![(normalize(path), 1u32)];
    'walk: while let Some((dir, level)) = todo.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let name = e.file_name();
            if !hidden && name.as_bytes().starts_with(b".") {
                continue;
            }
            let Ok(md) = e.metadata() else { continue };
            let child = join(&dir, &name);
            if md.is_dir() && level < depth {
                todo.push((child.clone(), level + 1));
            }
            entries.push(entry(&child, &md));
            if entries.len() >= LIST_HARD_CAP {
                truncated = true;
                break 'walk;
            }
        }
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    if limit > 0 && entries.len() > limit as usize {
        entries.truncate(limit as usize);
        truncated = true;
    }
    // The reply must fit in one frame: keep what fits and say it is truncated.
    let fits = |n: usize, entries: &[Entry]| {
        let reply = Reply::Listing {
            entries: entries[..n].to_vec(),
            truncated: true,
        };
        Frame::control(0, &reply)
            .map(|f| f.payload.len() + 64 < MAX_FRAME)
            .unwrap_or(false)
    };
    if !fits(entries.len(), &entries) {
        let (mut lo, mut hi) = (0, entries.len());
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if fits(mid, &entries) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        entries.truncate(lo);
        truncated = true;
    }
    Ok(Reply::Listing { entries, truncated })
}

pub(crate) fn mkdir(path: &str, parents: bool) -> Result<Reply, Fail> {
    let p = check_path(path)?;
    let r = if parents {
        mkdir_p(p)
    } else {
        fs::create_dir(p)
    };
    r.map_err(|e| Fail::io(format_args!("mkdir {path}"), &e))?;
    Ok(Reply::Done)
}

pub(crate) fn remove(path: &str, recursive: bool) -> Result<Reply, Fail> {
    let p = check_path(path)?;
    if normalize(path) == "/" {
        return Err(Fail::new(FailCode::InvalidPath, "refusing to remove /"));
    }
    let md = match fs::symlink_metadata(p) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Reply::Removed { removed: false })
        }
        Err(e) => return Err(Fail::io(format_args!("remove {path}"), &e)),
    };
    let r = if md.is_dir() {
        if recursive {
            fs::remove_dir_all(p)
        } else {
            fs::remove_dir(p)
        }
    } else {
        fs::remove_file(p)
    };
    r.map_err(|e| Fail::io(format_args!("remove {path}"), &e))?;
    Ok(Reply::Removed { removed: true })
}

pub(crate) fn rename(from: &str, to: &str, overwrite: bool) -> Result<Reply, Fail> {
    let (f, t) = (check_path(from)?, check_path(to)?);
    let ctx = || format!("rename {from} to {to}");
    if overwrite {
        fs::rename(f, t).map_err(|e| Fail::io(ctx(), &e))?;
        return Ok(Reply::Done);
    }
    let (cf, ct) = (cstring(from), cstring(to));
    let (Ok(cf), Ok(ct)) = (cf, ct) else {
        return Err(Fail::new(FailCode::InvalidPath, "a NUL byte in a path"));
    };
    // SAFETY: renameat2 with valid C strings.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            cf.as_ptr(),
            libc::AT_FDCWD,
            ct.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(Reply::Done);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // The file system cannot do it atomically: check, then rename.
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            if fs::symlink_metadata(t).is_ok() {
                return Err(Fail::new(
                    FailCode::AlreadyExists,
                    format!("{to} already exists"),
                ));
            }
            fs::rename(f, t).map_err(|e| Fail::io(ctx(), &e))?;
            Ok(Reply::Done)
        }
        _ => Err(Fail::io(ctx(), &e)),
    }
}

pub(crate) fn chmod(path: &str, mode: u32) -> Result<Reply, Fail> {
    let p = check_path(path)?;
    fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7777))
        .map_err(|e| Fail::io(format_args!("chmod {path}"), &e))?;
    Ok(Reply::Done)
}
