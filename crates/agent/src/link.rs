//! The channel to the host: the virtio-serial port (or a Unix socket in
//! tests), the outgoing frame queue and its single writer thread.
//!
//! The fd is non-blocking: the port allows one open file, shared by the
//! reader and the writer, and a write to a port nobody listens on would
//! otherwise block forever.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use runtime_proto::{encode, Frame, Reply, MAX_PAYLOAD, PORT_NAME};

use crate::sys::{cvt, errno, lock, log, log_limited, poll1, RateLimit};

/// Ordered frames (output, file bytes) buffered beyond this make producers wait.
const ORDERED_CAP: usize = 1 << 20;
/// A write batch stops growing past this.
const BATCH: usize = 256 * 1024;
/// A frame is dropped when the host has been gone this long while writing it.
const HANGUP_DROP: Duration = Duration::from_secs(5);
/// A frame is dropped when the host takes nothing for this long.
const STALL_DROP: Duration = Duration::from_secs(30);

static DROPPED: RateLimit = RateLimit::new(Duration::from_secs(10), 5);

pub(crate) struct Link {
    fd: OwnedFd,
    /// Test mode: the socket to reconnect to after the host hangs up.
    socket: Option<PathBuf>,
}

impl Link {
    pub(crate) fn open(socket: Option<&Path>) -> io::Result<Link> {
        let fd: OwnedFd = match socket {
            Some(path) => UnixStream::connect(path)?.into(),
            None => {
                let dev = find_port()?;
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_NOCTTY)
                    .open(&dev)?
                    .into()
            }
        };
        set_nonblocking(fd.as_raw_fd())?;
        Ok(Link {
            fd,
            socket: socket.map(Path::to_path_buf),
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub(crate) fn is_socket(&self) -> bool {
        self.socket.is_some()
    }

    /// Test mode: connects again to the socket and puts the new connection
    /// under the same fd number (so the writer follows). False when the
    /// socket is gone for good.
    pub(crate) fn reconnect(&self) -> bool {
        let Some(path) = &self.socket else {
            return false;
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            if !path.exists() {
                return false;
            }
            if let Ok(stream) = UnixStream::connect(path) {
                let new: OwnedFd = stream.into();
                // SAFETY: both fds are open; dup2 atomically replaces ours.
                let ok = unsafe { libc::dup2(new.as_raw_fd(), self.fd.as_raw_fd()) } >= 0;
                if ok && set_nonblocking(self.fd.as_raw_fd()).is_ok() {
                    return true;
                }
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Writes all of `buf`, or drops it if the host is gone or stalled too
    /// long (frames written while nobody listens may be lost).
    pub(crate) fn write_all(&self, buf: &[u8]) {
        let fd = self.fd.as_raw_fd();
        let mut off = 0;
        let mut progress = Instant::now();
        let mut hangup: Option<Instant> = None;
        while off < buf.len() {
            let rest = &buf[off..];
            // SAFETY: `rest` is a valid buffer of that length.
            let n = unsafe { libc::write(fd, rest.as_ptr().cast(), rest.len()) };
            if n > 0 {
                off += n as usize;
                progress = Instant::now();
                hangup = None;
                continue;
            }
            let now = Instant::now();
            let gone = match errno() {
                libc::EINTR => continue,
                libc::EAGAIN => {
                    let rev = poll1(fd, libc::POLLOUT, 100).unwrap_or(0);
                    rev & libc::POLLOUT == 0 && rev & (libc::POLLHUP | libc::POLLERR) != 0
                }
                _ => true,
            };
            if gone {
                let since = *hangup.get_or_insert(now);
                if now.duration_since(since) >= HANGUP_DROP {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            } else {
                hangup = None;
            }
            if now.duration_since(progress) >= STALL_DROP {
                break;
            }
        }
        if off < buf.len() {
            log_limited!(
                DROPPED,
                "host not listening: dropped {} bytes of frames",
                buf.len() - off
            );
        }
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain fcntl on an fd we own.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

/// `/dev/vportNpM` of the port named [`PORT_NAME`].
fn find_port() -> io::Result<PathBuf> {
    for entry in std::fs::read_dir("/sys/class/virtio-ports")?.flatten() {
        let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim() == PORT_NAME {
            return Ok(Path::new("/dev").join(entry.file_name()));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no virtio port named {PORT_NAME}"),
    ))
}

/// An entry of the ordered queue.
enum Item {
    Frame(Vec<u8>),
    /// A reply after which ordered output is held until the next `Hello`
    /// (the host is about to stop the machine: nothing may be in flight).
    Hold(Vec<u8>),
}

#[derive(Default)]
struct Queues {
    /// Replies with no ordering constraint (pong, hello, file metadata):
    /// they overtake output so a busy stream does not stall them.
    urgent: VecDeque<Vec<u8>>,
    /// Frames whose order matters within a stream (started, output, exited).
    ordered: VecDeque<Item>,
    ordered_bytes: usize,
    held: bool,
}

/// Outgoing frames, drained by the one writer thread.
#[derive(Default)]
pub(crate) struct Outbox {
    queues: Mutex<Queues>,
    ready: Condvar,
    space: Condvar,
}

impl Outbox {
    /// A reply that may overtake queued output. Never blocks.
    pub(crate) fn reply_now(&self, stream: u32, reply: &Reply) {
        if let Some(bytes) = encode_reply(stream, reply) {
            lock(&self.queues).urgent.push_back(bytes);
            self.ready.notify_one();
        }
    }

    /// A reply ordered after everything this stream sent before it.
    pub(crate) fn reply(&self, stream: u32, reply: &Reply) {
        if let Some(bytes) = encode_reply(stream, reply) {
            self.push_ordered(bytes);
        }
    }

    /// Data, split into frames; waits while too much output is buffered.
    pub(crate) fn data(&self, stream: u32, channel: u8, bytes: &[u8]) {
        for chunk in bytes.chunks(MAX_PAYLOAD) {
            match Frame::data(stream, channel, chunk.to_vec()) {
                Ok(frame) => {
                    let mut out = Vec::with_capacity(chunk.len() + 10);
                    encode(&frame, &mut out);
                    self.push_ordered(out);
                }
                Err(e) => log!("cannot frame data: {e}"),
            }
        }
    }

    /// A reply ordered after this stream's earlier frames, without waiting
    /// for space: for the reader thread, which must never block (tunnel
    /// resets; bounded by what the host sends).
    pub(crate) fn reply_late(&self, stream: u32, reply: &Reply) {
        if let Some(bytes) = encode_reply(stream, reply) {
            let mut q = lock(&self.queues);
            q.ordered_bytes += bytes.len();
            q.ordered.push_back(Item::Frame(bytes));
            drop(q);
            self.ready.notify_one();
        }
    }

    /// Drops the queued (or held) frames of these streams: tunnels of a host
    /// connection that is gone must not reach the next one.
    pub(crate) fn purge(&self, streams: &std::collections::HashSet<u32>) {
        if streams.is_empty() {
            return;
        }
        let mut q = lock(&self.queues);
        let mut dropped = 0;
        q.ordered.retain(|item| match item {
            Item::Frame(f) if f.len() >= 10 => {
                let id = u32::from_be_bytes([f[6], f[7], f[8], f[9]]);
                let keep = !streams.contains(&id);
                if !keep {
                    dropped += f.len();
                }
                keep
            }
            _ => true,
        });
        q.ordered_bytes -= dropped;
        drop(q);
        self.space.notify_all();
    }

    fn push_ordered(&self, bytes: Vec<u8>) {
        let mut q = lock(&self.queues);
        while q.ordered_bytes >= ORDERED_CAP {
            q = self.space.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        q.ordered_bytes += bytes.len();
        q.ordered.push_back(Item::Frame(bytes));
        drop(q);
        self.ready.notify_one();
    }

    /// `reply` once everything queued before it is written, then hold
    /// ordered output until [`Outbox::release`].
    pub(crate) fn hold_after(&self, stream: u32, reply: &Reply) {
        if let Some(bytes) = encode_reply(stream, reply) {
            lock(&self.queues).ordered.push_back(Item::Hold(bytes));
            self.ready.notify_one();
        }
    }

    /// Lets held output flow again (a host said `Hello`).
    pub(crate) fn release(&self) {
        lock(&self.queues).held = false;
        self.ready.notify_one();
    }

    /// Waits for frames and takes a batch: urgent ones first.
    fn next_batch(&self) -> Vec<u8> {
        let mut q = lock(&self.queues);
        while q.urgent.is_empty() && (q.ordered.is_empty() || q.held) {
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        let mut batch = Vec::new();
        while let Some(f) = q.urgent.pop_front() {
            batch.extend_from_slice(&f);
        }
        while batch.len() < BATCH && !q.held {
            match q.ordered.pop_front() {
                None => break,
                Some(Item::Frame(f)) => {
                    q.ordered_bytes -= f.len();
                    batch.extend_from_slice(&f);
                }
                Some(Item::Hold(f)) => {
                    batch.extend_from_slice(&f);
                    q.held = true;
                }
            }
        }
        drop(q);
        self.space.notify_all();
        batch
    }

    /// The writer thread's loop.
    pub(crate) fn run_writer(&self, link: &Link) -> ! {
        loop {
            let batch = self.next_batch();
            link.write_all(&batch);
        }
    }
}

fn encode_reply(stream: u32, reply: &Reply) -> Option<Vec<u8>> {
    let frame = match Frame::control(stream, reply) {
        Ok(f) => f,
        Err(e) => {
            log!("cannot encode a reply on stream {stream}: {e}");
            let failed = Reply::Failed {
                code: runtime_proto::FailCode::Io,
                message: format!("reply could not be encoded: {e}"),
            };
            Frame::control(stream, &failed).ok()?
        }
    };
    let mut out = Vec::with_capacity(frame.payload.len() + 10);
    encode(&frame, &mut out);
    Some(out)
}
