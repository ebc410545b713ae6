//! The request dispatcher: the reader loop decodes frames and hands each
//! request to its own thread, so nothing slow ever runs on the reader.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use runtime_proto::{channel, Decoder, FailCode, Frame, Kind, Reply, Request, User, VERSION};

use crate::exec::{self, ExecCtl, Input};
use crate::files::{self, ReadGate, WriteMsg};
use crate::link::{Link, Outbox};
use crate::reaper::Reaper;
use crate::share::{self, Shares};
use crate::sys::{errno, lock, log, log_limited, poll1, Fail, RateLimit};
use crate::tunnel::{self, Tunnels};
use crate::watch::{self, WatchCtl};

static STRAY: RateLimit = RateLimit::new(std::time::Duration::from_secs(10), 5);
static BAD_FRAMES: RateLimit = RateLimit::new(std::time::Duration::from_secs(10), 5);

/// What the reader keeps per stream for requests that receive more frames.
enum StreamState {
    Exec(Arc<ExecCtl>),
    Write(mpsc::Sender<WriteMsg>),
    Watch(Arc<WatchCtl>),
    /// A flow-controlled file read: its credits.
    Read(Arc<ReadGate>),
}

pub(crate) struct Agent {
    pub out: Arc<Outbox>,
    pub reaper: Arc<Reaper>,
    streams: Mutex<HashMap<u32, StreamState>>,
    /// How recent execs ended, for a host that reattaches after a restart.
    finished: Mutex<HashMap<u32, (Reply, std::time::Instant)>>,
    /// Open TCP tunnels.
    pub tunnels: Tunnels,
    /// Mounted shared volumes.
    pub shares: Shares,
    /// The session of the host connection the tunnels belong to.
    session: Mutex<u64>,
}

/// How long an ended exec's status is kept for [`Request::Attach`].
const FINISHED_KEPT: Duration = Duration::from_secs(3600);

impl Agent {
    /// Drops the state of a stream whose request has finished.
    pub(crate) fn forget(&self, stream: u32) {
        lock(&self.streams).remove(&stream);
    }

    /// Remembers how the exec on `stream` ended.
    pub(crate) fn finished(&self, stream: u32, exited: Reply) {
        let mut f = lock(&self.finished);
        f.retain(|_, (_, at)| at.elapsed() < FINISHED_KEPT);
        f.insert(stream, (exited, std::time::Instant::now()));
    }

    /// Kills every running command and ends every watch (test mode, before exiting).
    fn kill_all(&self) {
        for s in lock(&self.streams).values() {
            match s {
                StreamState::Exec(ctl) => crate::sys::kill_session(ctl.pgid(), libc::SIGKILL),
                StreamState::Watch(ctl) => ctl.stop(),
                StreamState::Read(gate) => gate.close(),
                StreamState::Write(_) => {}
            }
        }
    }

    /// Ends every watch and flow-controlled read: they belong to the host
    /// connection that started them (its credits never come).
    fn stop_watches(&self) {
        for s in lock(&self.streams).values() {
            match s {
                StreamState::Watch(ctl) => ctl.stop(),
                StreamState::Read(gate) => gate.close(),
                StreamState::Exec(_) | StreamState::Write(_) => {}
            }
        }
    }

    /// The credits of the flow-controlled read on `stream`, if it is one.
    fn read_gate(&self, stream: u32) -> Option<Arc<ReadGate>> {
        match lock(&self.streams).get(&stream) {
            Some(StreamState::Read(gate)) => Some(Arc::clone(gate)),
            _ => None,
        }
    }

    fn handle(self: &Arc<Self>, frame: Frame) {
        let stream = frame.stream;
        match frame.kind {
            Kind::Data => {
                if frame.channel == channel::INPUT
                    && (stream & runtime_proto::GUEST_STREAM != 0 || self.tunnels.contains(stream))
                {
                    tunnel::data(self, stream, frame.payload);
                    return;
                }
                if frame.channel == channel::INPUT && self.shares.contains(stream) {
                    self.shares.data(stream, frame.payload);
                    return;
                }
                if frame.channel != channel::INPUT {
                    log_limited!(
                        STRAY,
                        "data on channel {} of stream {stream} ignored",
                        frame.channel
                    );
                    return;
                }
                match lock(&self.streams).get(&stream) {
                    Some(StreamState::Exec(ctl)) => {
                        let _ = ctl.input.send(Input::Data(frame.payload));
                    }
                    Some(StreamState::Write(tx)) => {
                        let _ = tx.send(WriteMsg::Data(frame.payload));
                    }
                    Some(StreamState::Watch(_) | StreamState::Read(_)) => {
                        log_limited!(STRAY, "data for watch or read stream {stream} dropped")
                    }
                    None => log_limited!(STRAY, "data for idle stream {stream} dropped"),
                }
            }
            Kind::Control => match serde_json::from_slice::<Request>(&frame.payload) {
                Ok(req) => self.request(stream, req),
                Err(e) => {
                    log_limited!(BAD_FRAMES, "bad request on stream {stream}: {e}");
                    let fail = Fail::new(
                        FailCode::BadRequest,
                        format!("unknown or malformed request: {e}"),
                    );
                    self.out.reply_now(stream, &fail.reply());
                }
            },
        }
    }

    /// Runs `f` on a new thread; if none can be started, answers `Failed`.
    fn spawn(self: &Arc<Self>, stream: u32, f: impl FnOnce() + Send + 'static) -> bool {
        let started = std::thread::Builder::new()
            .name(format!("stream-{stream}"))
            .spawn(f);
        self.started(stream, started.map(drop))
    }

    /// Like [`Agent::spawn`], on a pooled thread ([`crate::pool`]): for work
    /// that leaves its thread as it found it.
    fn spawn_pooled(self: &Arc<Self>, stream: u32, f: impl FnOnce() + Send + 'static) -> bool {
        self.started(stream, crate::pool::run(f).map(drop))
    }

    /// Whether a stream's thread started; when not, the stream is answered.
    fn started(&self, stream: u32, started: std::io::Result<()>) -> bool {
        let Err(e) = started else { return true };
        log!("cannot start a thread: {e}");
        self.out.reply_now(
            stream,
            &Fail::new(FailCode::Io, format!("cannot start a thread: {e}")).reply(),
        );
        false
    }

    /// A file operation answered by one reply, run as `user`.
    fn file_op(
        self: &Arc<Self>,
        stream: u32,
        user: User,
        op: impl FnOnce() -> Result<Reply, Fail> + Send + 'static,
    ) {
        let out = Arc::clone(&self.out);
        self.spawn(stream, move || {
            let reply = files::become_user(user)
                .and_then(|()| op())
                .unwrap_or_else(Fail::reply);
            out.reply_now(stream, &reply);
        });
    }

    fn busy(&self, stream: u32) -> bool {
        if lock(&self.streams).contains_key(&stream) {
            let fail = Fail::new(FailCode::BadRequest, format!("stream {stream} is busy"));
            self.out.reply_now(stream, &fail.reply());
            return true;
        }
        false
    }

    fn request(self: &Arc<Self>, stream: u32, req: Request) {
        match req {
            Request::Hello { version, session } => {
                let mut current = lock(&self.session);
                if session == 0 || session != *current {
                    log!("hello from host (protocol {version})");
                    // A new host connection: the tunnels of the earlier
                    // one end, and their frames still queued go nowhere.
                    let mut ids = self.tunnels.reset_all();
                    // Shares stay mounted and wait to be joined again.
                    ids.extend(self.shares.detach_all());
                    self.out.purge(&ids);
                    // So do its watches (their inotify fds and threads).
                    self.stop_watches();
                    *current = session;
                }
                drop(current);
                self.out.release();
                let agent = env!("CARGO_PKG_VERSION").to_string();
                self.out.reply_now(
                    stream,
                    &Reply::Hello {
                        version: VERSION,
                        agent,
                    },
                );
            }
            Request::Ping => self.out.reply_now(stream, &Reply::Pong),
            Request::Quiesce => self.out.hold_after(stream, &Reply::Done),
            Request::Setup {
                hostname,
                unix_time_ms,
                entropy,
                ca_pem,
                environment,
            } => {
                let out = Arc::clone(&self.out);
                self.spawn(stream, move || {
                    let reply = match setup(
                        &hostname,
                        unix_time_ms,
                        &entropy,
                        ca_pem.as_deref(),
                        environment.as_deref(),
                    ) {
                        Ok(()) => Reply::Done,
                        Err(message) => Reply::Failed {
                            code: FailCode::Io,
                            message,
                        },
                    };
                    out.reply_now(stream, &reply);
                });
            }
            Request::Sync => {
                let out = Arc::clone(&self.out);
                self.spawn(stream, move || {
                    // SAFETY: plain syscall.
                    unsafe { libc::sync() };
                    out.reply_now(stream, &Reply::Done);
                });
            }
            Request::Exec(req) => {
                if self.busy(stream) {
                    return;
                }
                let (ctl, input) = ExecCtl::new();
                // Registered now, so stdin data right behind the request is kept.
                lock(&self.streams).insert(stream, StreamState::Exec(Arc::clone(&ctl)));
                let agent = Arc::clone(self);
                if !self.spawn_pooled(stream, move || exec::run(agent, stream, req, ctl, input)) {
                    self.forget(stream);
                }
            }
            Request::Attach => {
                let running = match lock(&self.streams).get(&stream) {
                    Some(StreamState::Exec(ctl)) => Some(ctl.pgid()),
                    _ => None,
                };
                let reply = match running {
                    Some(pid) if pid > 0 => Reply::Started { pid: pid as u32 },
                    _ => match lock(&self.finished).get(&stream) {
                        Some((exited, _)) => exited.clone(),
                        None => Fail::new(
                            FailCode::BadRequest,
                            format!("no process on stream {stream}"),
                        )
                        .reply(),
                    },
                };
                self.out.reply_now(stream, &reply);
            }
            Request::CloseStdin => {
                if let Some(StreamState::Exec(ctl)) = lock(&self.streams).get(&stream) {
                    let _ = ctl.input.send(Input::Close);
                }
            }
            Request::Signal { signal } => {
                if !(1..=64).contains(&signal) {
                    let fail = Fail::new(FailCode::BadRequest, format!("no signal {signal}"));
                    self.out.reply_now(stream, &fail.reply());
                } else if let Some(StreamState::Exec(ctl)) = lock(&self.streams).get(&stream) {
                    ctl.signal(signal);
                }
            }
            Request::Resize { size } => {
                if let Some(StreamState::Exec(ctl)) = lock(&self.streams).get(&stream) {
                    ctl.resize(size);
                }
            }
            Request::ReadFile { path, user, flow } => {
                let gate = if flow {
                    if self.busy(stream) {
                        return;
                    }
                    let gate = Arc::new(ReadGate::default());
                    lock(&self.streams).insert(stream, StreamState::Read(Arc::clone(&gate)));
                    Some(gate)
                } else {
                    None
                };
                let out = Arc::clone(&self.out);
                let agent = Arc::clone(self);
                let spawned = self.spawn(stream, move || {
                    if let Err(fail) = files::become_user(user)
                        .and_then(|()| files::read_file(&out, stream, &path, gate.as_deref()))
                    {
                        out.reply(stream, &fail.reply());
                    }
                    if flow {
                        agent.forget(stream);
                    }
                });
                if !spawned && flow {
                    self.forget(stream);
                }
            }
            Request::WriteFile { path, mode, user } => {
                if self.busy(stream) {
                    return;
                }
                let (tx, rx) = mpsc::channel();
                lock(&self.streams).insert(stream, StreamState::Write(tx));
                let out = Arc::clone(&self.out);
                let spawned = self.spawn(stream, move || {
                    let result = match files::become_user(user) {
                        Ok(()) => files::write_file(&path, mode, &rx),
                        Err(fail) => {
                            // The one reply comes after EndWrite.
                            while let Ok(WriteMsg::Data(_)) = rx.recv() {}
                            Err(fail)
                        }
                    };
                    out.reply_now(
                        stream,
                        &result.map(|()| Reply::Done).unwrap_or_else(Fail::reply),
                    );
                });
                if !spawned {
                    self.forget(stream);
                }
            }
            Request::EndWrite => match lock(&self.streams).remove(&stream) {
                Some(StreamState::Write(tx)) => {
                    let _ = tx.send(WriteMsg::End);
                }
                Some(other) => {
                    lock(&self.streams).insert(stream, other);
                    let fail = Fail::new(
                        FailCode::BadRequest,
                        "end_write on a stream that is not writing",
                    );
                    self.out.reply_now(stream, &fail.reply());
                }
                None => {
                    let fail = Fail::new(FailCode::BadRequest, "end_write without write_file");
                    self.out.reply_now(stream, &fail.reply());
                }
            },
            Request::Stat { path, user } => self.file_op(stream, user, move || files::stat(&path)),
            Request::List {
                path,
                depth,
                hidden,
                limit,
                user,
            } => self.file_op(stream, user, move || {
                files::list(&path, depth, hidden, limit)
            }),
            Request::Mkdir {
                path,
                parents,
                user,
            } => self.file_op(stream, user, move || files::mkdir(&path, parents)),
            Request::Remove {
                path,
                recursive,
                user,
            } => self.file_op(stream, user, move || files::remove(&path, recursive)),
            Request::Rename {
                from,
                to,
                overwrite,
                user,
            } => self.file_op(stream, user, move || files::rename(&from, &to, overwrite)),
            Request::Chmod { path, mode, user } => {
                self.file_op(stream, user, move || files::chmod(&path, mode))
            }
            Request::Connect { port } => {
                if self.busy(stream) {
                    return;
                }
                if stream & runtime_proto::GUEST_STREAM != 0 || self.tunnels.contains(stream) {
                    let fail = Fail::new(FailCode::BadRequest, format!("stream {stream} is busy"));
                    self.out.reply_now(stream, &fail.reply());
                    return;
                }
                tunnel::connect(self, stream, port);
            }
            Request::Watch(req) => {
                if self.busy(stream) {
                    return;
                }
                let ctl = match WatchCtl::new() {
                    Ok(ctl) => ctl,
                    Err(e) => {
                        let fail = Fail::io("eventfd", &e);
                        self.out.reply_now(stream, &fail.reply());
                        return;
                    }
                };
                lock(&self.streams).insert(stream, StreamState::Watch(Arc::clone(&ctl)));
                let agent = Arc::clone(self);
                if !self.spawn(stream, move || watch::run(agent, stream, req, ctl)) {
                    self.forget(stream);
                }
            }
            Request::Unwatch => {
                if let Some(StreamState::Watch(ctl)) = lock(&self.streams).get(&stream) {
                    ctl.stop();
                }
            }
            Request::Share { id, path } => {
                if self.busy(stream) {
                    return;
                }
                let agent = Arc::clone(self);
                self.spawn(stream, move || share::share(&agent, stream, id, path));
            }
            Request::Unshare { id } => {
                let agent = Arc::clone(self);
                self.spawn(stream, move || share::unshare(&agent, stream, &id));
            }
            Request::Credit { bytes } => match self.read_gate(stream) {
                Some(gate) => {
                    if !gate.credit(bytes) {
                        log_limited!(STRAY, "the host over-granted read {stream}; ending it");
                    }
                }
                None => tunnel::credit(self, stream, bytes),
            },
            Request::Eof => tunnel::eof(self, stream),
            Request::Close => {
                let mut streams = lock(&self.streams);
                match streams.get(&stream) {
                    Some(StreamState::Read(gate)) => gate.close(),
                    // A write the host gave up (its source failed): the
                    // temporary file goes, nothing is placed.
                    Some(StreamState::Write(_)) => {
                        streams.remove(&stream);
                    }
                    _ => {
                        drop(streams);
                        tunnel::close(self, stream);
                    }
                }
            }
        }
    }
}

fn setup(
    hostname: &str,
    unix_time_ms: u64,
    entropy: &[u8],
    ca_pem: Option<&str>,
    environment: Option<&str>,
) -> Result<(), String> {
    let mut errors = Vec::new();
    if let Some(env) = environment {
        if let Err(e) = write_environment(env) {
            errors.push(format!("writing {ENVIRONMENT_FILE}: {e}"));
        }
    }
    let done = match ca_pem {
        Some(pem) => install_ca(pem),
        // A template: keep the image's bundle now, so that each start from
        // it writes one file, not two.
        None => keep_system_bundle(),
    };
    if let Err(e) = done {
        errors.push(format!("installing the CA: {e}"));
    }
    if !hostname.is_empty() {
        // SAFETY: pointer and length of a valid buffer.
        if unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) } < 0 {
            errors.push(format!("sethostname: {}", std::io::Error::last_os_error()));
        }
    }
    if unix_time_ms > 0 {
        let ts = libc::timespec {
            tv_sec: (unix_time_ms / 1000) as libc::time_t,
            tv_nsec: ((unix_time_ms % 1000) * 1_000_000) as libc::c_long,
        };
        // SAFETY: a valid timespec.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
            errors.push(format!(
                "clock_settime: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    if !entropy.is_empty() {
        if let Err(e) = add_entropy(entropy) {
            errors.push(format!("entropy: {e}"));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// The sandbox's CA, on its own (`NODE_EXTRA_CA_CERTS`).
pub(crate) const CA_FILE: &str = "/usr/local/share/ca-certificates/runtime-egress.crt";
/// The bundle every TLS client reads (`SSL_CERT_FILE` and friends).
pub(crate) const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The image's own bundle, kept on first use so the CA is replaced, never appended twice.
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt.system";

/// Writes `bytes` to `path` atomically (temp file + rename), mode 0644.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp-runtime");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(&tmp)?;
    // No fsync: every start and wake writes these again, and a flush to
    // the disk would be most of the time a restore takes.
    f.write_all(bytes)?;
    std::fs::rename(&tmp, path)
}

/// Trusts `pem` system-wide: the CA on its own, and the bundle rebuilt as
/// the pristine system bundle plus it.
/// What the official client looks for to know it runs in a sandbox (and
/// then calls `http://runtime.internal`); the host sends its content.
const ENVIRONMENT_FILE: &str = "/run/runtime/environment.json";

/// Writes the sandbox's environment file: root's, readable by everyone,
/// replaced whole so a reader never sees half of it.
fn write_environment(json: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if json.len() > 64 * 1024 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the environment is too large",
        ));
    }
    let file = Path::new(ENVIRONMENT_FILE);
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    let mut text = json.trim().to_owned();
    text.push('\n');
    write_atomic(file, text.as_bytes())?;
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644))
}

fn install_ca(pem: &str) -> std::io::Result<()> {
    if !pem.contains("-----BEGIN CERTIFICATE-----") || pem.len() > 64 * 1024 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a PEM certificate",
        ));
    }
    let mut pem = pem.trim().to_owned();
    pem.push('\n');
    let ca = Path::new(CA_FILE);
    if std::fs::read(ca).is_ok_and(|old| old == pem.as_bytes())
        && std::fs::read(CA_BUNDLE).is_ok_and(|b| b.ends_with(pem.as_bytes()))
    {
        return Ok(()); // a wake: already trusted
    }
    if let Some(dir) = ca.parent() {
        std::fs::create_dir_all(dir)?;
    }
    write_atomic(ca, pem.as_bytes())?;
    keep_system_bundle()?;
    let mut all = std::fs::read(SYSTEM_BUNDLE)?;
    if !all.is_empty() && !all.ends_with(b"\n") {
        all.push(b'\n');
    }
    all.extend_from_slice(pem.as_bytes());
    write_atomic(Path::new(CA_BUNDLE), &all)
}

/// Keeps the image's own bundle beside it (once), so the sandbox's CA
/// replaces, never accumulates.
fn keep_system_bundle() -> std::io::Result<()> {
    let (bundle, system) = (Path::new(CA_BUNDLE), Path::new(SYSTEM_BUNDLE));
    if let Some(dir) = bundle.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if !system.exists() {
        let pristine = std::fs::read(bundle).unwrap_or_default();
        write_atomic(system, &pristine)?;
    }
    Ok(())
}

/// Mixes the host's bytes into the pool and credits them (RNDADDENTROPY),
/// so a restored copy does not share its random state with its siblings.
fn add_entropy(bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    f.write_all(bytes)?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    // SAFETY: `info` is laid out as rand_pool_info and outlives the call.
    unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    // Reseed the kernel's CRNG now, not at its next periodic reseed: a copy
    // of a template or a fork must not hand out its siblings' numbers.
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: an ioctl without argument on an fd we own.
    unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) };
    Ok(())
}

/// Opens the channel (retrying until it exists) and serves it. Returns only
/// in test mode, when the socket is gone.
pub(crate) fn serve(socket: Option<&Path>, reaper: &Arc<Reaper>, proxy_port: Option<u16>) {
    let mut logged = false;
    let link = loop {
        match Link::open(socket) {
            Ok(link) => break Arc::new(link),
            Err(e) => {
                if socket.is_some() {
                    log!(
                        "cannot connect to {}: {e}",
                        socket
                            .map(Path::display)
                            .map(|d| d.to_string())
                            .unwrap_or_default()
                    );
                    return;
                }
                if !logged {
                    log!("waiting for the host channel: {e}");
                    logged = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    log!("channel open");
    let out = Arc::new(Outbox::default());
    {
        let (out, link) = (Arc::clone(&out), Arc::clone(&link));
        if let Err(e) = std::thread::Builder::new()
            .name("writer".into())
            .spawn(move || out.run_writer(&link))
        {
            log!("cannot start the writer thread: {e}");
            return;
        }
    }
    let agent = Arc::new(Agent {
        out,
        reaper: Arc::clone(reaper),
        streams: Mutex::new(HashMap::new()),
        finished: Mutex::new(HashMap::new()),
        tunnels: Tunnels::default(),
        shares: Shares::default(),
        session: Mutex::new(0),
    });
    if let Some(port) = proxy_port {
        tunnel::listen(&agent, (std::net::Ipv4Addr::LOCALHOST, port).into());
        tunnel::listen(&agent, (std::net::Ipv6Addr::LOCALHOST, port).into());
    }
    if crate::net::TRANSPARENT.load(std::sync::atomic::Ordering::SeqCst) {
        let port = tunnel::TRANSPARENT_PORT;
        // Every IPv4 address: the prerouting rule redirects a container's
        // connection to the address of the bridge it came in on.
        tunnel::listen_transparent(&agent, (std::net::Ipv4Addr::UNSPECIFIED, port).into());
        tunnel::listen_transparent(&agent, (std::net::Ipv6Addr::LOCALHOST, port).into());
    }
    read_loop(&agent, &link);
    agent.kill_all();
}

fn read_loop(agent: &Arc<Agent>, link: &Link) {
    static READ_ERRORS: RateLimit = RateLimit::new(Duration::from_secs(10), 3);
    let fd = link.fd();
    let mut buf = vec![0u8; 256 * 1024];
    let mut dec = Decoder::new();
    loop {
        // SAFETY: reads into `buf`.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            dec.feed(&buf[..n as usize]);
            loop {
                match dec.next_frame() {
                    Ok(Some(frame)) => agent.handle(frame),
                    Ok(None) => break,
                    Err(e) => {
                        log_limited!(
                            BAD_FRAMES,
                            "out of sync with the host ({e}): dropping buffered bytes"
                        );
                        dec = Decoder::new();
                        break;
                    }
                }
            }
        } else if n == 0 {
            // The host hung up; it reconnects after a restart or a restore.
            dec = Decoder::new();
            if link.is_socket() {
                if !link.reconnect() {
                    log!("socket closed; exiting");
                    return;
                }
            } else {
                std::thread::sleep(Duration::from_millis(20));
            }
        } else {
            match errno() {
                libc::EINTR => {}
                libc::EAGAIN => {
                    let _ = poll1(fd, libc::POLLIN, 1000);
                }
                e => {
                    log_limited!(READ_ERRORS, "read from the host channel failed: errno {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}
