//! Running commands: spawn/exec in a new session as the requested user,
//! output pumps, stdin feeding, timeouts, and the one `Exited` at the end.
//!
//! Processes are started by hand (a vfork-style clone, [`crate::spawn`])
//! rather than with `std::process::Command`: the reaper owns
//! `waitpid(-1)`, and std's spawn waits on its child itself when exec
//! fails, which would race with the reaper.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use runtime_proto::{channel, ExecRequest, FailCode, PtySize, Reply, User};

use crate::agent::Agent;
use crate::link::Outbox;
use crate::reaper::Reaper;
use crate::sys::{cstring, cvt, errno, kill_session, lock, log, poll1, Fail};
use crate::trace::Trace;

pub(crate) const SANDBOX_ID: u32 = 1000;
const BASE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The sandbox user's: what `pip install`, `npm install -g` and `bun add -g`
/// put there comes first.
const SANDBOX_PATH: &str =
    "/workspace/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const WORKSPACE: &str = "/workspace";
/// The sandbox user's name when /etc/passwd has no uid 1000 (the image's
/// user is `runtime`; images built on the older base call it `user`).
const SANDBOX_NAME: &str = "runtime";
const PROXY: &str = "http://127.0.0.1:10800";
const SOCKS: &str = "socks5h://127.0.0.1:10800";
const NO_PROXY: &str = "localhost,127.0.0.1,::1";
const BUNDLE: &str = crate::agent::CA_BUNDLE;
/// The guest's only way out is the agent's proxy (`runtime_proto::PROXY_PORT`),
/// and its TLS trusts the sandbox's CA: every process is told so.
const NETWORK_ENV: &[(&str, &str)] = &[
    ("HTTP_PROXY", PROXY),
    ("HTTPS_PROXY", PROXY),
    ("http_proxy", PROXY),
    ("https_proxy", PROXY),
    ("ALL_PROXY", SOCKS),
    ("all_proxy", SOCKS),
    ("NO_PROXY", NO_PROXY),
    ("no_proxy", NO_PROXY),
    ("npm_config_proxy", PROXY),
    ("npm_config_https_proxy", PROXY),
    // Node's own fetch and http follow the variables above (Node 24).
    ("NODE_USE_ENV_PROXY", "1"),
    ("SSL_CERT_FILE", BUNDLE),
    ("REQUESTS_CA_BUNDLE", BUNDLE),
    ("CURL_CA_BUNDLE", BUNDLE),
    ("PIP_CERT", BUNDLE),
    ("GIT_SSL_CAINFO", BUNDLE),
];
/// After the main process exits, output is drained until EOF or this long of silence...
const IDLE_AFTER_EXIT: Duration = Duration::from_millis(200);
/// ...and never longer than this (something that escaped the group keeps writing).
const MAX_DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
const READ_CHUNK: usize = 64 * 1024;

/// What the reader thread forwards to a running process.
pub(crate) enum Input {
    Data(Vec<u8>),
    Close,
}

/// The handle the reader thread keeps for a running exec.
pub(crate) struct ExecCtl {
    pub input: mpsc::Sender<Input>,
    /// The process group (= session) id, 0 until started.
    pgid: AtomicI32,
    master: Mutex<Option<Arc<OwnedFd>>>,
}

impl ExecCtl {
    pub(crate) fn new() -> (Arc<ExecCtl>, mpsc::Receiver<Input>) {
        let (tx, rx) = mpsc::channel();
        (
            Arc::new(ExecCtl {
                input: tx,
                pgid: AtomicI32::new(0),
                master: Mutex::new(None),
            }),
            rx,
        )
    }

    pub(crate) fn pgid(&self) -> i32 {
        self.pgid.load(Ordering::SeqCst)
    }

    pub(crate) fn signal(&self, sig: i32) {
        let pgid = self.pgid();
        if pgid > 1 {
            // SAFETY: plain syscall; a negative pid addresses the process group.
            unsafe { libc::kill(-pgid, sig) };
        }
    }

    pub(crate) fn resize(&self, size: PtySize) {
        if let Some(master) = lock(&self.master).as_ref() {
            set_winsize(master.as_raw_fd(), size);
        }
    }
}

fn set_winsize(fd: RawFd, size: PtySize) {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from the pointer.
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) };
}

/// Everything the child needs, built before the spawn (the child must not allocate).
struct Plan {
    path: CString,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: CString,
    sandbox: bool,
}

fn bad(message: impl Into<String>) -> Fail {
    Fail::new(FailCode::BadRequest, message)
}

fn plan(req: &ExecRequest) -> Result<Plan, Fail> {
    let Some(argv0) = req.argv.first() else {
        return Err(bad("argv is empty"));
    };
    let sandbox_name;
    let (path, home, user) = match req.user {
        User::Sandbox => {
            sandbox_name = sandbox_user_name();
            (SANDBOX_PATH, WORKSPACE, sandbox_name.as_str())
        }
        User::Root => (BASE_PATH, "/root", "root"),
    };
    let mut env: Vec<(String, String)> = [
        ("PATH", path),
        ("HOME", home),
        ("USER", user),
        ("LOGNAME", user),
        ("SHELL", "/bin/bash"),
        ("LANG", "C.UTF-8"),
    ]
    .iter()
    .chain(NETWORK_ENV)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    // `npm install -g` as the sandbox user: into ~/.local (its bin is on
    // PATH). An environment variable rather than ~/.npmrc, which npm would
    // also read as the project config of every command run in /workspace
    // (root's included); `sudo` drops it, so root's prefix stays /usr/local.
    if req.user == User::Sandbox {
        env.push(("NPM_CONFIG_PREFIX".into(), format!("{WORKSPACE}/.local")));
    }
    // Node warns on every start about a missing extra CA file.
    if Path::new(crate::agent::CA_FILE).exists() {
        env.push(("NODE_EXTRA_CA_CERTS".into(), crate::agent::CA_FILE.into()));
    }
    if req.pty.is_some() {
        env.push(("TERM".into(), "xterm-256color".into()));
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') {
            return Err(bad(format!("invalid environment variable name {k:?}")));
        }
        match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.clone(), v.clone())),
        }
    }
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    let mut argv = req.argv.clone();
    let found = resolve(argv0, path_var).filter(|p| !is_shell(argv0) || Path::new(p).is_file());
    let path = match found {
        Some(p) => p,
        // An image without bash (Alpine, busybox): a shell command runs
        // through its POSIX `sh` instead (`bash -c`/`-lc`/`-l` take the
        // same options there); an image with no shell at all (distroless)
        // through the busybox supplied when it was unpacked, whose applets
        // then come after the image's own programs on PATH.
        None if is_shell(argv0) => {
            let Some((sh, supplied)) = fallback_shell(path_var, Path::new(SUPPLIED_SH)) else {
                return Err(Fail::new(
                    FailCode::CommandNotFound,
                    format!("{argv0}: command not found (and no sh either)"),
                ));
            };
            argv[0] = "sh".into();
            for (k, v) in env.iter_mut() {
                if k == "SHELL" {
                    *v = sh.clone();
                } else if k == "PATH" && supplied {
                    if !v.is_empty() {
                        v.push(':');
                    }
                    v.push_str(SUPPLIED_BIN);
                }
            }
            sh
        }
        None => {
            return Err(Fail::new(
                FailCode::CommandNotFound,
                format!("{argv0}: command not found"),
            ))
        }
    };
    let cwd = match &req.cwd {
        Some(cwd) if !cwd.starts_with('/') => {
            return Err(Fail::new(
                FailCode::InvalidPath,
                format!("cwd {cwd:?} is not absolute"),
            ));
        }
        Some(cwd) => cwd.clone(),
        // Outside the VM (tests) there may be no /workspace.
        None if Path::new(WORKSPACE).is_dir() => WORKSPACE.into(),
        None => "/".into(),
    };
    let nul = |_| bad("a NUL byte in argv, env or cwd");
    Ok(Plan {
        path: cstring(&path).map_err(nul)?,
        argv: argv
            .iter()
            .map(|a| cstring(a))
            .collect::<Result<_, _>>()
            .map_err(nul)?,
        envp: env
            .iter()
            .map(|(k, v)| cstring(&format!("{k}={v}")))
            .collect::<Result<_, _>>()
            .map_err(nul)?,
        cwd: cstring(&cwd).map_err(nul)?,
        sandbox: req.user == User::Sandbox,
    })
}

/// The name /etc/passwd gives uid 1000, read at every start so that the
/// image decides it: `runtime` now, `user` on disks built on the older base.
fn sandbox_user_name() -> String {
    std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|passwd| uid_name(&passwd, SANDBOX_ID))
        .unwrap_or_else(|| SANDBOX_NAME.to_string())
}

/// The first name of `uid` in a passwd file's text.
fn uid_name(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let uid_field = fields.nth(1)?;
        (!name.is_empty() && uid_field.parse() == Ok(uid)).then(|| name.to_string())
    })
}

/// `bash` by name or at its usual paths: what falls back to `sh`.
fn is_bash(argv0: &str) -> bool {
    matches!(argv0, "bash" | "/bin/bash" | "/usr/bin/bash")
}

/// bash or sh, by name or at their usual paths.
fn is_shell(argv0: &str) -> bool {
    is_bash(argv0) || matches!(argv0, "sh" | "/bin/sh" | "/usr/bin/sh")
}

/// The shell supplied to an image that has none (docs/images.md, "Images
/// without a shell"): busybox's `sh`, its applets beside it.
pub(crate) const SUPPLIED_SH: &str = "/usr/lib/runtime/bin/sh";
pub(crate) const SUPPLIED_BIN: &str = "/usr/lib/runtime/bin";

/// The image's own `sh` on `path_var`, else the `supplied` one if it is
/// there (true with it).
fn fallback_shell(path_var: &str, supplied: &Path) -> Option<(String, bool)> {
    resolve("sh", path_var).map(|sh| (sh, false)).or_else(|| {
        supplied
            .is_file()
            .then(|| (supplied.to_string_lossy().into_owned(), true))
    })
}

/// Looks `argv0` up in `PATH` like execvp; a name with a slash is taken as is.
fn resolve(argv0: &str, path_var: &str) -> Option<String> {
    if argv0.is_empty() {
        return None;
    }
    if argv0.contains('/') {
        return Some(argv0.to_string());
    }
    path_var.split(':').find_map(|dir| {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = Path::new(dir).join(argv0);
        let md = std::fs::metadata(&candidate).ok()?;
        (md.is_file() && md.permissions().mode() & 0o111 != 0)
            .then(|| candidate.to_string_lossy().into_owned())
    })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for two fds.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 just returned these fds and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn set_cloexec(fd: RawFd) {
    // SAFETY: plain fcntl.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
}

const STAGE_SETUP: u8 = 1;
const STAGE_USER: u8 = 2;
const STAGE_CWD: u8 = 3;
const STAGE_EXEC: u8 = 4;
const STAGE_TRACE: u8 = 5;

struct ChildFds {
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    /// The pty slave to make the controlling terminal.
    ctty: Option<RawFd>,
    /// Close-on-exec pipe: the stage and errno of a failure before exec.
    report: RawFd,
}

/// `setgroups(0, NULL)` (with 0), `setgid` or `setuid` of the calling
/// process alone, as a system call.
///
/// # Safety
/// Plain system call.
unsafe fn set_ids(call: libc::c_long, id: u32) -> libc::c_long {
    // SAFETY: setgroups with a count of 0 reads no list; the others take an id.
    unsafe {
        if call == libc::SYS_setgroups {
            libc::syscall(call, 0, std::ptr::null::<libc::gid_t>())
        } else {
            libc::syscall(call, id)
        }
    }
}

/// Runs in the child of [`crate::spawn::vfork`], which shares the agent's
/// memory until it execs: only async-signal-safe system calls, no
/// allocation, no writes to the parent's memory (errno aside), and it ends
/// in `execve` or `_exit`.
///
/// # Safety
/// Call only in such a child; the pointer arrays must be NULL-terminated.
unsafe fn child(
    plan: &Plan,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    fds: &ChildFds,
    cgroup: Option<&std::ffi::CStr>,
    trace: Option<&Trace>,
) -> ! {
    unsafe fn fail(report: RawFd, stage: u8) -> ! {
        let e = errno().to_ne_bytes();
        let msg = [stage, e[0], e[1], e[2], e[3]];
        // SAFETY: writes a local buffer; _exit never returns. A raw
        // write: libc's marks the (shared) thread for cancellation.
        unsafe {
            libc::syscall(libc::SYS_write, report, msg.as_ptr(), msg.len());
            libc::_exit(127)
        }
    }
    // SAFETY: all calls below are async-signal-safe syscalls on valid
    // pointers prepared by the parent before the spawn.
    unsafe {
        // The agent's dispositions (Rust ignores SIGPIPE) must not leak;
        // signals stay blocked until none of its handlers is left.
        crate::spawn::reset_signals();
        if libc::setsid() < 0 {
            fail(fds.report, STAGE_SETUP);
        }
        // Its own cgroup (while still root), so its out-of-memory kills count.
        if let Some(procs) = cgroup {
            crate::cgroup::join(procs);
        }
        // Its own mount namespace, traced (while still root).
        if let Some(t) = trace {
            if !t.enter() {
                fail(fds.report, STAGE_TRACE);
            }
        }
        if let Some(tty) = fds.ctty {
            if libc::ioctl(tty, libc::TIOCSCTTY, 0) < 0 {
                fail(fds.report, STAGE_SETUP);
            }
        }
        for (src, dst) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
            if src == dst {
                libc::fcntl(src, libc::F_SETFD, 0);
            } else if libc::dup2(src, dst) < 0 {
                fail(fds.report, STAGE_SETUP);
            }
        }
        if plan.sandbox {
            // The agent made the stdio pipes, so they belong to root with
            // mode 0600: reopening one by path (`/dev/stdout`,
            // `/proc/self/fd/1`, as `tee /dev/stderr` or the R driver do)
            // would fail for the sandbox user. They are this child's alone,
            // so they become its user's, as a container runtime does; any
            // other file (`/dev/null`, the pty slave) is left as it is.
            for fd in 0..3 {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) == 0
                    && st.st_mode & libc::S_IFMT == libc::S_IFIFO
                    && libc::fchown(fd, SANDBOX_ID, SANDBOX_ID) < 0
                {
                    fail(fds.report, STAGE_USER);
                }
            }
            // Raw system calls: glibc's would change every thread of the
            // agent too (the child shares its memory, see crate::spawn).
            if set_ids(libc::SYS_setgroups, 0) < 0
                || set_ids(libc::SYS_setgid, SANDBOX_ID) < 0
                || set_ids(libc::SYS_setuid, SANDBOX_ID) < 0
            {
                fail(fds.report, STAGE_USER);
            }
        } else {
            set_ids(libc::SYS_setgroups, 0);
        }
        if libc::chdir(plan.cwd.as_ptr()) < 0 {
            fail(fds.report, STAGE_CWD);
        }
        libc::execve(plan.path.as_ptr(), argv.as_ptr(), envp.as_ptr());
        fail(fds.report, STAGE_EXEC)
    }
}

/// A started process: the parent's ends of its stdio.
struct Child {
    pid: i32,
    status: mpsc::Receiver<i32>,
    started: Instant,
    stdout: Option<Arc<OwnedFd>>,
    stderr: Option<Arc<OwnedFd>>,
    stdin: Option<Arc<OwnedFd>>,
    master: Option<Arc<OwnedFd>>,
    /// Its cgroup, counting its out-of-memory kills (none without cgroups).
    group: Option<crate::cgroup::Group>,
}

fn start(reaper: &Reaper, req: &ExecRequest, trace: Option<&Trace>) -> Result<Child, Fail> {
    let plan = plan(req)?;
    let argv: Vec<*const libc::c_char> = plan
        .argv
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const libc::c_char> = plan
        .envp
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let io_fail = |what: &str| {
        let e = io::Error::last_os_error();
        Fail::io(what, &e)
    };
    let (report_r, report_w) = pipe().map_err(|e| Fail::io("pipe", &e))?;

    // Parent ends, and the child ends which the parent closes after the spawn.
    let mut parent = Child {
        pid: 0,
        status: mpsc::channel().1,
        started: Instant::now(),
        stdout: None,
        stderr: None,
        stdin: None,
        master: None,
        group: crate::cgroup::Group::new(),
    };
    let mut child_ends: Vec<OwnedFd> = Vec::new();
    let mut guard;
    let fds = match req.pty {
        None => {
            let (out_r, out_w) = pipe().map_err(|e| Fail::io("pipe", &e))?;
            let (err_r, err_w) = pipe().map_err(|e| Fail::io("pipe", &e))?;
            let stdin_child: OwnedFd = if req.stdin {
                let (r, w) = pipe().map_err(|e| Fail::io("pipe", &e))?;
                parent.stdin = Some(Arc::new(w));
                r
            } else {
                std::fs::File::open("/dev/null")
                    .map_err(|e| Fail::io("/dev/null", &e))?
                    .into()
            };
            parent.stdout = Some(Arc::new(out_r));
            parent.stderr = Some(Arc::new(err_r));
            let fds = ChildFds {
                stdin: stdin_child.as_raw_fd(),
                stdout: out_w.as_raw_fd(),
                stderr: err_w.as_raw_fd(),
                ctty: None,
                report: report_w.as_raw_fd(),
            };
            child_ends.extend([stdin_child, out_w, err_w]);
            guard = reaper.fork_lock();
            fds
        }
        Some(size) => {
            // Under the fork lock: openpty's fds are not close-on-exec yet.
            guard = reaper.fork_lock();
            let (mut m, mut s) = (-1, -1);
            let ws = libc::winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: valid out pointers and a valid winsize; name and termios may be NULL.
            if unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws) }
                < 0
            {
                return Err(io_fail("openpty"));
            }
            set_cloexec(m);
            set_cloexec(s);
            // SAFETY: openpty just returned these fds.
            let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
            let master = Arc::new(master);
            parent.master = Some(Arc::clone(&master));
            parent.stdout = Some(Arc::clone(&master));
            if req.stdin {
                parent.stdin = Some(master);
            }
            let fds = ChildFds {
                stdin: slave.as_raw_fd(),
                stdout: slave.as_raw_fd(),
                stderr: slave.as_raw_fd(),
                ctty: Some(slave.as_raw_fd()),
                report: report_w.as_raw_fd(),
            };
            child_ends.push(slave);
            fds
        }
    };

    let cgroup = parent.group.as_ref().map(|g| g.procs_path());
    // SAFETY: the child only runs `child`, which keeps crate::spawn's rules;
    // argv/envp are NULL-terminated.
    let pid = unsafe { crate::spawn::vfork(|| child(&plan, &argv, &envp, &fds, cgroup, trace)) }
        .map_err(|e| Fail::io("clone", &e))?;
    parent.pid = pid;
    parent.status = guard.register(pid);
    parent.started = Instant::now();
    drop(guard);
    drop(child_ends);
    drop(report_w);

    let mut msg = [0u8; 5];
    let mut got = 0;
    while got < msg.len() {
        // SAFETY: reads into the unfilled tail of `msg`.
        let n = unsafe {
            libc::read(
                report_r.as_raw_fd(),
                msg[got..].as_mut_ptr().cast(),
                msg.len() - got,
            )
        };
        if n > 0 {
            got += n as usize;
        } else if n == 0 || errno() != libc::EINTR {
            break;
        }
    }
    if got == msg.len() {
        // The child failed before exec and exits; the reaper collects it.
        let e = io::Error::from_raw_os_error(i32::from_ne_bytes([msg[1], msg[2], msg[3], msg[4]]));
        let argv0 = req.argv.first().map(String::as_str).unwrap_or("");
        return Err(match msg[0] {
            STAGE_EXEC if e.raw_os_error() == Some(libc::ENOENT) => Fail::new(
                FailCode::CommandNotFound,
                format!("{argv0}: command not found"),
            ),
            STAGE_EXEC => Fail::io(format_args!("cannot execute {argv0}"), &e),
            STAGE_CWD => Fail::io(
                format_args!("cannot enter {}", plan.cwd.to_string_lossy()),
                &e,
            ),
            STAGE_USER => Fail::io("cannot switch user", &e),
            STAGE_TRACE => Fail::new(
                FailCode::Io,
                format!("cannot trace the command's files: {e}"),
            ),
            _ => Fail::io("cannot set up the process", &e),
        });
    }
    Ok(parent)
}

/// When the main process exited; pumps drain a little longer, then stop.
#[derive(Default)]
struct Drain(Mutex<Option<Instant>>);

impl Drain {
    fn exited_at(&self) -> Option<Instant> {
        *lock(&self.0)
    }
}

/// Copies one output fd to Data frames as soon as bytes are available.
fn pump(out: &Outbox, stream: u32, chan: u8, fd: &OwnedFd, drain: &Drain) {
    let fd = fd.as_raw_fd();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut last = Instant::now();
    loop {
        let exited = drain.exited_at();
        let timeout = if exited.is_some() { 50 } else { 250 };
        let mut idle = false;
        match poll1(fd, libc::POLLIN, timeout) {
            Ok(0) => idle = true,
            Ok(_) => {
                // SAFETY: reads into `buf`.
                let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
                if n > 0 {
                    out.data(stream, chan, &buf[..n as usize]);
                    last = Instant::now();
                } else if n == 0 {
                    return;
                } else {
                    match errno() {
                        libc::EINTR | libc::EAGAIN => {}
                        // EIO: every slave fd of the pty is closed.
                        _ => return,
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(_) => return,
        }
        if let Some(t) = exited.or_else(|| drain.exited_at()) {
            let now = Instant::now();
            if now.duration_since(t) >= MAX_DRAIN_AFTER_EXIT
                || (idle && now.duration_since(t.max(last)) >= IDLE_AFTER_EXIT)
            {
                return;
            }
        }
    }
}

fn write_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: writes from a valid buffer.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Feeds stdin from the host's INPUT data; closing drops the pipe (EOF), or
/// on a pty sends ^D (the terminal's end-of-file).
fn feed_stdin(fd: Arc<OwnedFd>, pty: bool, input: mpsc::Receiver<Input>) {
    while let Ok(msg) = input.recv() {
        match msg {
            Input::Data(bytes) => {
                if write_all(fd.as_raw_fd(), &bytes).is_err() && !pty {
                    return;
                }
            }
            Input::Close if pty => {
                let _ = write_all(fd.as_raw_fd(), &[4]);
            }
            Input::Close => return,
        }
    }
}

/// Runs `f` on a pooled thread ([`crate::pool`]); `None` (logged) when no
/// thread could be had.
fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) -> Option<crate::pool::Done> {
    match crate::pool::run(f) {
        Ok(done) => Some(done),
        Err(e) => {
            log!("cannot start a {name} thread: {e}");
            None
        }
    }
}

/// Runs one exec request to its end: `Started`, output, `Exited` (or one `Failed`).
pub(crate) fn run(
    agent: Arc<Agent>,
    stream: u32,
    req: ExecRequest,
    ctl: Arc<ExecCtl>,
    input: mpsc::Receiver<Input>,
) {
    let out = Arc::clone(&agent.out);
    let trace = match req.trace_files.then(Trace::new).transpose() {
        Ok(t) => t,
        Err(e) => {
            agent.forget(stream);
            out.reply(
                stream,
                &Fail::new(
                    FailCode::Io,
                    format!("cannot trace the command's files: {e}"),
                )
                .reply(),
            );
            return;
        }
    };
    let child = match start(&agent.reaper, &req, trace.as_ref()) {
        Ok(c) => c,
        Err(fail) => {
            agent.forget(stream);
            out.reply(stream, &fail.reply());
            return;
        }
    };
    let collector = trace.map(Trace::collect);
    let pid = child.pid;
    ctl.pgid.store(pid, Ordering::SeqCst);
    *lock(&ctl.master) = child.master.clone();
    out.reply(stream, &Reply::Started { pid: pid as u32 });

    let drain = Arc::new(Drain::default());
    let mut pumps = Vec::new();
    for (fd, chan) in [
        (child.stdout, channel::STDOUT),
        (child.stderr, channel::STDERR),
    ] {
        let Some(fd) = fd else { continue };
        let (out, drain) = (Arc::clone(&out), Arc::clone(&drain));
        pumps.extend(spawn_thread("exec-output", move || {
            pump(&out, stream, chan, &fd, &drain)
        }));
    }
    match child.stdin {
        Some(fd) => {
            let pty = req.pty.is_some();
            spawn_thread("exec-stdin", move || feed_stdin(fd, pty, input));
        }
        None => drop(input),
    }

    let deadline = req
        .timeout_ms
        .map(|ms| child.started + Duration::from_millis(ms));
    let mut timed_out = false;
    let status = loop {
        let next = match deadline {
            Some(d) if !timed_out => child
                .status
                .recv_timeout(d.saturating_duration_since(Instant::now())),
            _ => child
                .status
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(status) => break Some(status),
            Err(RecvTimeoutError::Timeout) => {
                kill_session(pid, libc::SIGKILL);
                timed_out = true;
            }
            Err(RecvTimeoutError::Disconnected) => {
                log!("lost the exit status of pid {pid}");
                break None;
            }
        }
    };
    let duration_ms = child.started.elapsed().as_millis() as u64;
    if timed_out || req.kill_group_on_exit {
        kill_session(pid, libc::SIGKILL);
    }
    *lock(&drain.0) = Some(Instant::now());
    for p in pumps {
        p.join();
    }
    // Its output drained: what it (and what it started) opened is queued.
    let files = collector.map(|c| c.finish());

    let (mut exit_code, signal) = match status {
        Some(s) if libc::WIFEXITED(s) => (Some(libc::WEXITSTATUS(s)), None),
        Some(s) if libc::WIFSIGNALED(s) => (None, Some(libc::WTERMSIG(s))),
        _ => (None, None),
    };
    if timed_out {
        exit_code = None;
    }
    let oom_kills = child.group.as_ref().map_or(0, |g| g.oom_kills());
    // Its group goes now, or once what it left running has ended.
    drop(child.group);
    let exited = Reply::Exited {
        exit_code,
        signal,
        timed_out,
        duration_ms,
        out_of_memory: oom_kills > 0,
        oom_kills,
        files,
    };
    agent.finished(stream, exited.clone());
    agent.forget(stream);
    *lock(&ctl.master) = None;
    drop(ctl);
    out.reply(stream, &exited);
}

#[cfg(test)]
mod tests {
    use super::{plan, uid_name};
    use runtime_proto::{ExecRequest, User};

    fn request(argv: &[&str], path: &std::path::Path) -> ExecRequest {
        ExecRequest {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            cwd: Some("/".into()),
            env: vec![("PATH".into(), path.display().to_string())],
            user: User::Root,
            timeout_ms: None,
            stdin: false,
            pty: None,
            kill_group_on_exit: false,
            trace_files: false,
        }
    }

    fn argv_of(p: &super::Plan) -> Vec<String> {
        p.argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_shell_command_runs_through_sh_when_there_is_no_bash() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rt-agent-sh-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let exe = |name: &str| {
            let p = dir.join(name);
            std::fs::write(&p, "#!/bin/true\n").unwrap_or_default();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
                .unwrap_or_default();
        };
        exe("sh");
        let sh = dir.join("sh").display().to_string();
        for argv in [
            &["bash", "-c", "echo $((1+2))"][..],
            &["bash", "-lc", "echo hi"],
            &["bash", "-l"],
        ] {
            let p = plan(&request(argv, &dir))
                .map_err(|e| e.message)
                .unwrap_or_else(|m| panic!("{m}"));
            assert_eq!(p.path.to_string_lossy(), sh);
            let mut want: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
            want[0] = "sh".into();
            assert_eq!(argv_of(&p), want);
            assert!(p
                .envp
                .iter()
                .any(|e| e.to_string_lossy() == format!("SHELL={sh}")));
        }
        // Another missing program is still not found; bash, once there, runs.
        assert!(plan(&request(&["python3", "-c", "1"], &dir)).is_err());
        exe("bash");
        let p = plan(&request(&["bash", "-c", "true"], &dir)).map_err(|e| e.message);
        assert_eq!(
            p.map(|p| argv_of(&p)),
            Ok(vec!["bash".to_string(), "-c".into(), "true".into()])
        );
        // Without sh either, the error says so.
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap_or_default();
        let e = plan(&request(&["bash", "-c", "true"], &empty))
            .err()
            .map(|e| e.message);
        assert_eq!(
            e.as_deref(),
            Some("bash: command not found (and no sh either)")
        );
        // The supplied shell, when there, is taken only where the image has
        // no sh of its own.
        let supplied = dir.join("supplied-sh");
        let empty_path = empty.to_string_lossy().into_owned();
        assert_eq!(super::fallback_shell(&empty_path, &supplied), None);
        std::fs::write(&supplied, b"").unwrap();
        assert_eq!(
            super::fallback_shell(&empty_path, &supplied),
            Some((supplied.to_string_lossy().into_owned(), true))
        );
        let with_sh = format!("{}:{}", empty.display(), dir.display());
        assert_eq!(
            super::fallback_shell(&with_sh, &supplied).map(|(_, s)| s),
            Some(false)
        );
        assert!(
            super::is_shell("/bin/sh") && super::is_shell("bash") && !super::is_shell("python3")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn uid_name_reads_the_passwd_file() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      bad line\n\
                      :x:1000:1000::/:/bin/sh\n\
                      runtime:x:1000:1000::/workspace:/bin/bash\n\
                      user:x:1000:1000::/workspace:/bin/bash\n";
        assert_eq!(uid_name(passwd, 1000).as_deref(), Some("runtime"));
        assert_eq!(uid_name(passwd, 0).as_deref(), Some("root"));
        assert_eq!(uid_name(passwd, 1001), None);
        assert_eq!(
            uid_name("user:x:1000:1000::/workspace:/bin/bash", 1000).as_deref(),
            Some("user")
        );
    }
}
