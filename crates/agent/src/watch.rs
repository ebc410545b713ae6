//! File watches ([`Request::Watch`](runtime_proto::Request::Watch)): one
//! thread per watch, holding one inotify instance, which it takes as the
//! requested user (the kernel checks read access to each directory with the
//! thread's file-system identity). Recursive watches add a watch for each
//! subdirectory, including ones created or moved in later, up to
//! `max_watches`. Changes are gathered for `batch_ms` after the first of a
//! batch, repeated writes of a file folded into one with a count.
//!
//! Everything is bounded: the watches per instance, the events a second
//! (beyond it they are counted and reported as an `overflow` notice), the
//! bytes of a batch, and the frames queued for the host (the outbox makes
//! the thread wait, and the kernel's own queue then overflows, which is
//! reported too). The inotify fd and the thread end with the watch.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use runtime_proto::{FailCode, Reply, WatchEvent, WatchKind, WatchNotice, WatchRequest};

use crate::agent::Agent;
use crate::files;
use crate::sys::{errno, Fail};

/// inotify watches per watch when the request names no number.
const DEFAULT_MAX_WATCHES: u32 = 8192;
/// The most any watch may ask for.
const MAX_MAX_WATCHES: u32 = 65_536;
/// New (unfolded) events reported per second; beyond it they are dropped
/// and counted (the product's `overflow`: more than 5,000 a second).
const EVENTS_PER_SECOND: u32 = 5000;
/// A batch is sent early once its paths reach this many bytes (a frame
/// holds 256 KiB).
const BATCH_BYTES: usize = 128 * 1024;
/// The longest `batch_ms`.
const MAX_BATCH_MS: u32 = 60_000;
/// How long a rename's first half waits for its second before it counts as
/// a move out of the tree. The kernel queues both halves inside one
/// `rename`, but a reader can wake between them (a busy or emulated CPU).
const MOVE_GRACE: Duration = Duration::from_millis(200);

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_EXCL_UNLINK;

/// How the host ends a watch: a flag and an eventfd that wakes its poll.
pub(crate) struct WatchCtl {
    efd: OwnedFd,
    stopped: AtomicBool,
}

impl WatchCtl {
    pub(crate) fn new() -> io::Result<Arc<WatchCtl>> {
        // SAFETY: plain syscall; the fd is owned at once.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(WatchCtl {
            // SAFETY: a fresh fd nothing else owns.
            efd: unsafe { OwnedFd::from_raw_fd(fd) },
            stopped: AtomicBool::new(false),
        }))
    }

    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

/// Runs the watch on `stream` until it is stopped or its root goes.
pub(crate) fn run(agent: Arc<Agent>, stream: u32, req: WatchRequest, ctl: Arc<WatchCtl>) {
    let out = Arc::clone(&agent.out);
    match files::become_user(req.user).and_then(|()| Watcher::open(&req)) {
        Err(fail) => out.reply(stream, &fail.reply()),
        Ok(mut w) => {
            out.reply(
                stream,
                &Reply::Watching {
                    watches: w.dirs.len() as u32,
                },
            );
            let reason = loop {
                match w.next_batch(&ctl) {
                    Step::Batch(events, notices) => {
                        out.reply(stream, &Reply::WatchEvents { events, notices })
                    }
                    Step::End(reason) => break reason,
                }
            };
            out.reply(
                stream,
                &Reply::WatchEnded {
                    reason: reason.into(),
                },
            );
        }
    }
    agent.forget(stream);
}

/// Which changes a watch reports: kinds and globs over the path relative
/// to its root.
#[derive(Debug, Default)]
pub(crate) struct Filter {
    kinds: Vec<WatchKind>,
    include: Vec<String>,
    exclude: Vec<String>,
}

impl Filter {
    pub(crate) fn new(kinds: &[WatchKind], include: &[String], exclude: &[String]) -> Filter {
        let clean = |v: &[String]| {
            v.iter()
                .map(|p| p.trim_start_matches("./").trim_end_matches('/').to_string())
                .filter(|p| !p.is_empty())
                .collect()
        };
        Filter {
            kinds: kinds.to_vec(),
            include: clean(include),
            exclude: clean(exclude),
        }
    }

    /// Whether `rel` (relative to the root, `/`-separated) or a directory
    /// it is under is excluded. A pattern without `/` matches any one path
    /// component (`node_modules`, `*.log`); one with `/` the path from the
    /// root (`build/**`, `src/*.tmp`).
    pub(crate) fn excluded(&self, rel: &str) -> bool {
        if rel.is_empty() {
            return false;
        }
        self.exclude.iter().any(|p| {
            if p.contains('/') {
                let mut end = 0;
                // The path itself, or any directory above it.
                loop {
                    let next = rel[end..].find('/').map(|i| end + i);
                    let prefix = &rel[..next.unwrap_or(rel.len())];
                    if glob(p.as_bytes(), prefix.as_bytes()) {
                        return true;
                    }
                    match next {
                        Some(i) => end = i + 1,
                        None => return false,
                    }
                }
            } else {
                rel.split('/').any(|c| glob(p.as_bytes(), c.as_bytes()))
            }
        })
    }

    /// Whether a change of `kind` to `rel` is reported.
    pub(crate) fn wanted(&self, kind: WatchKind, rel: &str) -> bool {
        if !self.kinds.is_empty() && !self.kinds.contains(&kind) {
            return false;
        }
        if self.excluded(rel) {
            return false;
        }
        if self.include.is_empty() {
            return true;
        }
        let name = rel.rsplit('/').next().unwrap_or(rel);
        self.include.iter().any(|p| {
            if p.contains('/') {
                glob(p.as_bytes(), rel.as_bytes())
            } else {
                glob(p.as_bytes(), name.as_bytes())
            }
        })
    }
}

/// Shell-style matching: `?` one character and `*` any run, neither
/// crossing `/`; `**` any run including `/` (and `**/` also none).
pub(crate) fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some(b'*') if p.get(1) == Some(&b'*') => {
            let rest = &p[2..];
            if let Some(after) = rest.strip_prefix(b"/") {
                if glob(after, s) {
                    return true;
                }
            }
            (0..=s.len()).any(|i| glob(rest, &s[i..]))
        }
        Some(b'*') => {
            let rest = &p[1..];
            for i in 0..=s.len() {
                if glob(rest, &s[i..]) {
                    return true;
                }
                if s.get(i) == Some(&b'/') {
                    break;
                }
            }
            false
        }
        Some(b'?') => matches!(s.first(), Some(c) if *c != b'/') && glob(&p[1..], &s[1..]),
        Some(c) => s.first() == Some(c) && glob(&p[1..], &s[1..]),
    }
}

/// The events of one batch: a write folds into the batch's last write of
/// the same path when nothing else happened to that path in between.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    events: Vec<WatchEvent>,
    last_write: HashMap<String, usize>,
    bytes: usize,
    pub(crate) started: Option<Instant>,
}

impl Batch {
    /// Adds `ev`; false when it folded into an earlier write.
    pub(crate) fn push(&mut self, ev: WatchEvent) -> bool {
        if ev.kind == WatchKind::Write {
            if let Some(&i) = self.last_write.get(&ev.path) {
                if let Some(e) = self.events.get_mut(i) {
                    e.count = e.count.saturating_add(ev.count);
                    return false;
                }
            }
            self.last_write.insert(ev.path.clone(), self.events.len());
        } else {
            self.last_write.remove(&ev.path);
            if let Some(old) = &ev.old_path {
                self.last_write.remove(old);
            }
        }
        self.bytes += 32 + ev.path.len() + ev.old_path.as_ref().map_or(0, String::len);
        self.started.get_or_insert_with(Instant::now);
        self.events.push(ev);
        true
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub(crate) fn full(&self) -> bool {
        self.bytes >= BATCH_BYTES
    }

    pub(crate) fn take(&mut self) -> Vec<WatchEvent> {
        self.last_write.clear();
        self.bytes = 0;
        self.started = None;
        std::mem::take(&mut self.events)
    }
}

/// At most `limit` new events a second; the rest are counted.
#[derive(Debug)]
pub(crate) struct Rate {
    limit: u32,
    window: Instant,
    used: u32,
    pub(crate) dropped: u64,
}

impl Rate {
    pub(crate) fn new(limit: u32) -> Rate {
        Rate {
            limit,
            window: Instant::now(),
            used: 0,
            dropped: 0,
        }
    }

    pub(crate) fn admit(&mut self, now: Instant) -> bool {
        if now.duration_since(self.window) >= Duration::from_secs(1) {
            self.window = now;
            self.used = 0;
        }
        if self.used < self.limit {
            self.used += 1;
            true
        } else {
            self.dropped += 1;
            false
        }
    }
}

pub(crate) enum Step {
    Batch(Vec<WatchEvent>, Vec<WatchNotice>),
    End(&'static str),
}

/// A rename's first half, waiting for its second.
struct MovedFrom {
    cookie: u32,
    path: String,
    is_dir: bool,
    /// The agent's own temporary file (a whole-file write's rename into place).
    temp: bool,
    seen: Instant,
}

pub(crate) struct Watcher {
    fd: OwnedFd,
    /// The root as asked (events name paths under it as the caller sees it).
    root: String,
    root_wd: i32,
    recursive: bool,
    max: u32,
    /// Watched directory (or the root file) per watch descriptor.
    dirs: HashMap<i32, String>,
    filter: Filter,
    batch_ms: u32,
    batch: Batch,
    notices: Vec<WatchNotice>,
    limit_noticed: bool,
    rate: Rate,
    moved: Vec<MovedFrom>,
    ended: Option<&'static str>,
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// Whether `name` is a temporary file of the agent's whole-file writes.
fn is_temp(name: &str) -> bool {
    name.starts_with('.') && name.contains(".agent-tmp-")
}

impl Watcher {
    pub(crate) fn open(req: &WatchRequest) -> Result<Watcher, Fail> {
        if !req.path.starts_with('/') || req.path.contains('\0') {
            return Err(Fail::new(
                FailCode::InvalidPath,
                format!("path {:?} must be absolute", req.path),
            ));
        }
        let root = match req.path.trim_end_matches('/') {
            "" => "/".to_string(),
            r => r.to_string(),
        };
        let md =
            std::fs::metadata(&root).map_err(|e| Fail::io(format_args!("watch {root}"), &e))?;
        // SAFETY: plain syscall; the fd is owned at once.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(Fail::io("inotify_init1", &io::Error::last_os_error()));
        }
        let max = match req.max_watches {
            0 => DEFAULT_MAX_WATCHES,
            n => n.min(MAX_MAX_WATCHES),
        };
        let mut w = Watcher {
            // SAFETY: a fresh fd nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            root: root.clone(),
            root_wd: -1,
            recursive: req.recursive && md.is_dir(),
            max,
            dirs: HashMap::new(),
            filter: Filter::new(&req.events, &req.include, &req.exclude),
            batch_ms: req.batch_ms.min(MAX_BATCH_MS),
            batch: Batch::default(),
            notices: Vec::new(),
            limit_noticed: false,
            rate: Rate::new(EVENTS_PER_SECOND),
            moved: Vec::new(),
            ended: None,
        };
        // The root follows a symlink (`/home/user` -> `/workspace`).
        w.root_wd = w
            .add_watch(&root, false)
            .map_err(|e| Fail::io(format_args!("watch {root}"), &e))?;
        if w.recursive {
            w.add_tree(&root, false);
        }
        Ok(w)
    }

    fn add_watch(&mut self, path: &str, subdir: bool) -> io::Result<i32> {
        let c = crate::sys::cstring(path)?;
        let mask = if subdir {
            MASK | libc::IN_ONLYDIR | libc::IN_DONT_FOLLOW
        } else {
            MASK
        };
        // SAFETY: a valid C string and our inotify fd.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), mask) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        self.dirs.insert(wd, path.to_string());
        Ok(wd)
    }

    /// Watches the directories under `dir` (not `dir` itself, already
    /// watched). With `report`, what is found is reported as created: it
    /// was made before its directory's watch could see it.
    fn add_tree(&mut self, dir: &str, report: bool) {
        let mut todo = vec![dir.to_string()];
        while let Some(d) = todo.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let name = String::from_utf8_lossy(e.file_name().as_bytes()).into_owned();
                if is_temp(&name) {
                    continue;
                }
                let path = join(&d, &name);
                let rel = self.rel(&path).to_string();
                if self.filter.excluded(&rel) {
                    continue;
                }
                let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
                if report {
                    self.emit(WatchKind::Create, path.clone(), None, is_dir);
                }
                if is_dir && self.watch_subdir(&path) {
                    todo.push(path);
                }
            }
        }
    }

    /// Adds a watch for the subdirectory `path`, within the limit.
    fn watch_subdir(&mut self, path: &str) -> bool {
        if self.dirs.len() as u32 >= self.max {
            self.limit(path);
            return false;
        }
        match self.add_watch(path, true) {
            Ok(_) => true,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                self.limit(path);
                false
            }
            Err(_) => false,
        }
    }

    fn limit(&mut self, path: &str) {
        if !self.limit_noticed {
            self.limit_noticed = true;
            self.notices.push(WatchNotice::Limit {
                watches: self.dirs.len() as u32,
                path: path.to_string(),
            });
        }
    }

    fn rel<'a>(&self, path: &'a str) -> &'a str {
        let root = self.root.as_str();
        if root == "/" {
            return path.trim_start_matches('/');
        }
        path.strip_prefix(root)
            .map(|r| r.trim_start_matches('/'))
            .unwrap_or(path)
    }

    fn emit(&mut self, kind: WatchKind, path: String, old_path: Option<String>, is_dir: bool) {
        if !self.filter.wanted(kind, self.rel(&path)) {
            return;
        }
        let ev = WatchEvent {
            kind,
            path,
            old_path,
            is_dir,
            count: 1,
        };
        // A write that folds costs nothing; a new event counts against the rate.
        if kind == WatchKind::Write && self.batch.last_write.contains_key(&ev.path) {
            self.batch.push(ev);
            return;
        }
        if self.rate.admit(Instant::now()) {
            self.batch.push(ev);
        }
    }

    /// Paths under the renamed directory `from` are now under `to`.
    fn moved_dir(&mut self, from: &str, to: &str) {
        let prefix = format!("{from}/");
        for d in self.dirs.values_mut() {
            if d == from {
                *d = to.to_string();
            } else if let Some(rest) = d.strip_prefix(&prefix) {
                *d = join(to, rest);
            }
        }
    }

    /// Stops watching `dir` and what is under it (moved out of the tree).
    fn unwatch_tree(&mut self, dir: &str) {
        let prefix = format!("{dir}/");
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, d)| *d == dir || d.starts_with(&prefix))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            // SAFETY: our fd and a descriptor it returned.
            unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) };
        }
    }

    /// Renames whose second half did not come within `MOVE_GRACE` (all of
    /// them once the watch ends): moved out of the tree.
    fn settle_moves(&mut self, all: bool) {
        let now = Instant::now();
        let (old, young): (Vec<_>, Vec<_>) = std::mem::take(&mut self.moved)
            .into_iter()
            .partition(|m| all || now.duration_since(m.seen) >= MOVE_GRACE);
        self.moved = young;
        for m in old {
            if m.temp {
                continue;
            }
            if m.is_dir {
                self.unwatch_tree(&m.path);
            }
            self.emit(WatchKind::Remove, m.path, None, m.is_dir);
        }
    }

    fn on_event(&mut self, wd: i32, mask: u32, cookie: u32, name: &str) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            self.notices.push(WatchNotice::Overflow { dropped: 0 });
            return;
        }
        let Some(dir) = self.dirs.get(&wd).cloned() else {
            return;
        };
        if mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&wd);
            if wd == self.root_wd {
                self.ended = Some("root-removed");
            }
            return;
        }
        if mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 {
            if wd == self.root_wd {
                self.ended = Some("root-removed");
            }
            return;
        }
        let is_dir = mask & libc::IN_ISDIR != 0;
        let path = if name.is_empty() {
            dir
        } else {
            join(&dir, name)
        };
        let temp = is_temp(name);
        if mask & libc::IN_MOVED_FROM != 0 {
            self.moved.push(MovedFrom {
                cookie,
                path,
                is_dir,
                temp,
                seen: Instant::now(),
            });
            return;
        }
        if mask & libc::IN_MOVED_TO != 0 {
            let from = self
                .moved
                .iter()
                .position(|m| m.cookie == cookie)
                .map(|i| self.moved.remove(i));
            if temp {
                return;
            }
            match from {
                // The agent's whole-file write: its temporary file renamed into place.
                Some(m) if m.temp => self.emit(WatchKind::Create, path.clone(), None, is_dir),
                Some(m) => {
                    if is_dir {
                        self.moved_dir(&m.path, &path);
                    }
                    self.emit(WatchKind::Rename, path.clone(), Some(m.path), is_dir);
                }
                None => {
                    self.emit(WatchKind::Create, path.clone(), None, is_dir);
                    if is_dir
                        && self.recursive
                        && !self.filter.excluded(self.rel(&path))
                        && self.watch_subdir(&path)
                    {
                        self.add_tree(&path, true);
                    }
                }
            }
            return;
        }
        if temp {
            return;
        }
        if mask & libc::IN_CREATE != 0 {
            self.emit(WatchKind::Create, path.clone(), None, is_dir);
            // Watched first, then scanned: nothing made meanwhile is missed.
            if is_dir
                && self.recursive
                && !self.filter.excluded(self.rel(&path))
                && self.watch_subdir(&path)
            {
                self.add_tree(&path, true);
            }
        } else if mask & libc::IN_DELETE != 0 {
            self.emit(WatchKind::Remove, path, None, is_dir);
        } else if mask & libc::IN_MODIFY != 0 {
            self.emit(WatchKind::Write, path, None, is_dir);
        } else if mask & libc::IN_ATTRIB != 0 {
            self.emit(WatchKind::Chmod, path, None, is_dir);
        }
    }

    /// Reads what the kernel has queued; false when nothing was there.
    fn read_events(&mut self) -> bool {
        // Aligned for `inotify_event`.
        let mut buf = vec![0u64; 8192];
        let mut any = false;
        loop {
            // SAFETY: reads into `buf`, which is 64 KiB long.
            let n =
                unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len() * 8) };
            if n <= 0 {
                if n < 0 && errno() == libc::EINTR {
                    continue;
                }
                return any;
            }
            any = true;
            // SAFETY: the kernel wrote `n` bytes into `buf`.
            let bytes =
                unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize) };
            let mut off = 0;
            const HEAD: usize = std::mem::size_of::<libc::inotify_event>();
            while off + HEAD <= bytes.len() {
                let field = |at: usize| {
                    let mut b = [0u8; 4];
                    b.copy_from_slice(&bytes[off + at..off + at + 4]);
                    b
                };
                let wd = i32::from_ne_bytes(field(0));
                let mask = u32::from_ne_bytes(field(4));
                let cookie = u32::from_ne_bytes(field(8));
                let len = u32::from_ne_bytes(field(12)) as usize;
                let end = (off + HEAD + len).min(bytes.len());
                let raw = &bytes[off + HEAD..end];
                let raw = &raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())];
                let name = String::from_utf8_lossy(raw).into_owned();
                self.on_event(wd, mask, cookie, &name);
                off = end;
            }
        }
    }

    fn ready(&mut self, all: bool) -> Option<Step> {
        self.settle_moves(all);
        if self.rate.dropped > 0 {
            self.notices.push(WatchNotice::Overflow {
                dropped: self.rate.dropped,
            });
            self.rate.dropped = 0;
        }
        if self.batch.is_empty() && self.notices.is_empty() {
            return None;
        }
        Some(Step::Batch(
            self.batch.take(),
            std::mem::take(&mut self.notices),
        ))
    }

    /// The next batch, once `batch_ms` passed since its first event (or it
    /// is full); or the end, once stopped or the root is gone (after what
    /// came before it).
    pub(crate) fn next_batch(&mut self, ctl: &WatchCtl) -> Step {
        loop {
            if self.ended.is_some() || ctl.is_stopped() {
                if let Some(step) = self.ready(true) {
                    return step;
                }
                return Step::End(self.ended.unwrap_or("stopped"));
            }
            let due = self
                .batch
                .started
                .map(|s| s + Duration::from_millis(u64::from(self.batch_ms)));
            // The oldest unpaired rename half settles once its grace is over.
            let settle = self.moved.iter().map(|m| m.seen + MOVE_GRACE).min();
            let wake = due.into_iter().chain(settle).min();
            let timeout = match wake {
                // Notices with no batch to wait for go out at once.
                _ if due.is_none() && !self.notices.is_empty() => 0,
                // Rounded up: a wake a fraction of a millisecond early would spin.
                Some(w) => w
                    .saturating_duration_since(Instant::now())
                    .as_micros()
                    .div_ceil(1000)
                    .min(i32::MAX as u128) as i32,
                None => -1,
            };
            if timeout == 0 || self.batch.full() {
                if let Some(step) = self.ready(false) {
                    return step;
                }
                continue;
            }
            let mut fds = [
                libc::pollfd {
                    fd: self.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: ctl.efd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds for the duration of the call.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if r < 0 && errno() != libc::EINTR {
                self.ended = Some("failed");
                continue;
            }
            if fds[0].revents != 0 {
                self.read_events();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn ev(kind: WatchKind, path: &str) -> WatchEvent {
        WatchEvent {
            kind,
            path: path.into(),
            old_path: None,
            is_dir: false,
            count: 1,
        }
    }

    #[test]
    fn globs_match_within_and_across_components() {
        assert!(glob(b"*.log", b"a.log"));
        assert!(!glob(b"*.log", b"d/a.log"));
        assert!(glob(b"**/*.log", b"d/e/a.log"));
        assert!(glob(b"**/*.log", b"a.log"));
        assert!(glob(b"build/**", b"build/x/y"));
        assert!(glob(b"a?c", b"abc"));
        assert!(!glob(b"a?c", b"a/c"));
        assert!(!glob(b"node_modules", b"node_modules2"));
    }

    #[test]
    fn filters_exclude_trees_and_include_names() {
        let f = Filter::new(&[], &[], &["node_modules".into(), "build/out".into()]);
        assert!(f.excluded("node_modules"));
        assert!(f.excluded("a/node_modules/x/y.js"));
        assert!(f.excluded("build/out/z"));
        assert!(!f.excluded("build/other"));
        assert!(f.wanted(WatchKind::Create, "src/a.py"));
        assert!(!f.wanted(WatchKind::Create, "node_modules/a.js"));
        let f = Filter::new(&[WatchKind::Remove], &["*.py".into()], &[]);
        assert!(f.wanted(WatchKind::Remove, "src/a.py"));
        assert!(!f.wanted(WatchKind::Create, "src/a.py"));
        assert!(!f.wanted(WatchKind::Remove, "src/a.txt"));
    }

    #[test]
    fn repeated_writes_fold_until_something_else_happens() {
        let mut b = Batch::default();
        assert!(b.push(ev(WatchKind::Create, "/w/a")));
        assert!(b.push(ev(WatchKind::Write, "/w/a")));
        assert!(!b.push(ev(WatchKind::Write, "/w/a")));
        assert!(b.push(ev(WatchKind::Write, "/w/b")));
        assert!(!b.push(ev(WatchKind::Write, "/w/a")));
        assert!(b.push(ev(WatchKind::Chmod, "/w/a")));
        assert!(b.push(ev(WatchKind::Write, "/w/a")));
        let got: Vec<(WatchKind, u32)> = b.take().iter().map(|e| (e.kind, e.count)).collect();
        assert_eq!(
            got,
            [
                (WatchKind::Create, 1),
                (WatchKind::Write, 3),
                (WatchKind::Write, 1),
                (WatchKind::Chmod, 1),
                (WatchKind::Write, 1)
            ]
        );
        assert!(b.is_empty() && b.started.is_none());
    }

    #[test]
    fn the_rate_drops_and_counts_beyond_its_limit() {
        let mut r = Rate::new(3);
        let t = Instant::now();
        assert!((0..5).filter(|_| r.admit(t)).count() == 3);
        assert_eq!(r.dropped, 2);
        assert!(r.admit(t + Duration::from_millis(1001)));
    }

    fn request(path: &str, recursive: bool) -> WatchRequest {
        WatchRequest {
            path: path.into(),
            recursive,
            events: vec![],
            include: vec![],
            exclude: vec!["skip".into()],
            batch_ms: 30,
            max_watches: 0,
            user: runtime_proto::User::Root,
        }
    }

    /// Batches until one has an event for which `until` holds.
    fn collect(
        w: &mut Watcher,
        ctl: &WatchCtl,
        until: impl Fn(&WatchEvent) -> bool,
    ) -> Vec<WatchEvent> {
        let mut all = Vec::new();
        for _ in 0..50 {
            match w.next_batch(ctl) {
                Step::Batch(events, _) => {
                    let done = events.iter().any(&until);
                    all.extend(events);
                    if done {
                        return all;
                    }
                }
                Step::End(r) => panic!("ended: {r} after {all:?}"),
            }
        }
        panic!("never saw it: {all:?}")
    }

    fn has(all: &[WatchEvent], kind: WatchKind, path: &str) -> bool {
        all.iter().any(|e| e.kind == kind && e.path == path)
    }

    #[test]
    fn inotify_sees_files_subdirectories_renames_and_the_root_going() {
        let dir = std::env::temp_dir().join(format!("agent-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("old")).unwrap();
        let root = dir.to_str().unwrap().to_string();
        let ctl = WatchCtl::new().unwrap();
        let mut w = Watcher::open(&request(&root, true)).unwrap();
        assert_eq!(w.dirs.len(), 2, "the root and its subdirectory");

        std::fs::write(dir.join("a.txt"), b"hi").unwrap();
        let a = format!("{root}/a.txt");
        let all = collect(&mut w, &ctl, |e| e.kind == WatchKind::Write && e.path == a);
        assert!(has(&all, WatchKind::Create, &a), "{all:?}");

        // A subdirectory made now, and a file in it right away.
        std::fs::create_dir(dir.join("new")).unwrap();
        std::fs::write(dir.join("new/b.txt"), b"x").unwrap();
        let b = format!("{root}/new/b.txt");
        let all = collect(&mut w, &ctl, |e| e.path == b);
        assert!(
            has(&all, WatchKind::Create, &format!("{root}/new")),
            "{all:?}"
        );
        std::fs::write(dir.join("new/c.txt"), b"x").unwrap();
        let c = format!("{root}/new/c.txt");
        collect(&mut w, &ctl, |e| e.kind == WatchKind::Create && e.path == c);

        // A rename, a chmod, a removal; an excluded directory says nothing.
        std::fs::create_dir(dir.join("skip")).unwrap();
        std::fs::write(dir.join("skip/z"), b"z").unwrap();
        std::fs::rename(dir.join("a.txt"), dir.join("d.txt")).unwrap();
        let d = format!("{root}/d.txt");
        let all = collect(&mut w, &ctl, |e| e.kind == WatchKind::Rename);
        let r = all.iter().find(|e| e.kind == WatchKind::Rename).unwrap();
        assert_eq!(
            (r.path.as_str(), r.old_path.as_deref()),
            (d.as_str(), Some(a.as_str()))
        );
        assert!(!all.iter().any(|e| e.path.contains("skip")), "{all:?}");
        std::fs::remove_file(dir.join("d.txt")).unwrap();
        collect(&mut w, &ctl, |e| e.kind == WatchKind::Remove && e.path == d);

        // The agent's whole-file write: a temporary file renamed into place.
        std::fs::write(dir.join(".e.txt.agent-tmp-1-0"), b"e").unwrap();
        std::fs::rename(dir.join(".e.txt.agent-tmp-1-0"), dir.join("e.txt")).unwrap();
        let e = format!("{root}/e.txt");
        let all = collect(&mut w, &ctl, |x| x.path == e);
        assert!(has(&all, WatchKind::Create, &e), "{all:?}");
        assert!(!all.iter().any(|x| x.path.contains("agent-tmp")), "{all:?}");

        std::fs::remove_dir_all(&dir).unwrap();
        let end = loop {
            match w.next_batch(&ctl) {
                Step::Batch(..) => continue,
                Step::End(r) => break r,
            }
        };
        assert_eq!(end, "root-removed");
    }

    #[test]
    fn a_rename_read_in_two_halves_is_still_a_rename() {
        let dir = std::env::temp_dir().join(format!("agent-watch-halves-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let root = dir.to_str().unwrap().to_string();
        let mut w = Watcher::open(&request(&root, false)).unwrap();
        let wd = w.root_wd;
        let kinds = |step: Option<Step>| match step {
            Some(Step::Batch(events, _)) => events
                .into_iter()
                .map(|e| (e.kind, e.path, e.old_path))
                .collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        // The reader woke between the halves, and its batch was due.
        w.on_event(wd, libc::IN_MOVED_FROM, 7, "a.txt");
        assert!(kinds(w.ready(false)).is_empty(), "the first half waits");
        w.on_event(wd, libc::IN_MOVED_TO, 7, "b.txt");
        let a = format!("{root}/a.txt");
        let b = format!("{root}/b.txt");
        assert_eq!(
            kinds(w.ready(false)),
            [(WatchKind::Rename, b.clone(), Some(a.clone()))]
        );
        // A half whose pair never comes is a move out, once its grace is over.
        w.on_event(wd, libc::IN_MOVED_FROM, 8, "b.txt");
        assert!(kinds(w.ready(false)).is_empty());
        w.moved[0].seen -= MOVE_GRACE;
        assert_eq!(
            kinds(w.ready(false)),
            [(WatchKind::Remove, b.clone(), None)]
        );
        // The end settles what is left at once.
        w.on_event(wd, libc::IN_MOVED_FROM, 9, "c.txt");
        assert_eq!(
            kinds(w.ready(true)),
            [(WatchKind::Remove, format!("{root}/c.txt"), None)]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stop_ends_it_and_the_limit_is_noticed() {
        let dir = std::env::temp_dir().join(format!("agent-watch-limit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["a", "b", "c"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let mut req = request(dir.to_str().unwrap(), true);
        req.max_watches = 2;
        let mut w = Watcher::open(&req).unwrap();
        assert_eq!(w.dirs.len(), 2);
        let ctl = WatchCtl::new().unwrap();
        match w.next_batch(&ctl) {
            Step::Batch(events, notices) => {
                assert!(events.is_empty());
                assert!(matches!(
                    notices[..],
                    [WatchNotice::Limit { watches: 2, .. }]
                ));
            }
            Step::End(r) => panic!("ended: {r}"),
        }
        ctl.stop();
        assert!(matches!(w.next_batch(&ctl), Step::End("stopped")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_root_fails_as_not_found() {
        let fail = Watcher::open(&request("/nonexistent-watch-root", false))
            .err()
            .unwrap();
        assert_eq!(fail.code, FailCode::FileNotFound);
    }
}
