//! Shared volumes ([`Request::Share`](runtime_proto::Request::Share)): a 9P
//! mount whose transport is one end of a socketpair (`trans=fd`); the agent
//! pumps the other end to a host stream, whole messages at a time.
//!
//! The mount lives in guest memory, so it outlives the host connection: a
//! pause and wake, or a restart of the server, only change the stream. The
//! agent keeps each request the kernel sent until its reply came back (by
//! tag); when the host joins the share to a new stream, those are sent
//! again on [`channel::RESENT`] (the host answers a repeat from the reply
//! it kept, so nothing is done twice). Replies cross to the socket as they
//! come; bytes of a message cut by the old connection are dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use runtime_proto::{channel, FailCode, Reply, SHARE_MSIZE};

use crate::agent::Agent;
use crate::sys::{cstring, errno, lock, log, Fail};

/// Shares mounted at once; more are refused (the host allows 8 per sandbox).
const MAX_SHARES: usize = 32;
const STACK: usize = 256 * 1024;
/// A 9P header: `size[4] type[1] tag[2]`.
const HEADER: usize = 7;

enum Down {
    /// Bytes of the host's replies.
    Data(Vec<u8>),
    /// A new stream: drop a reply cut in half by the old one.
    Restart,
    End,
}

pub(crate) struct Share {
    id: String,
    path: String,
    /// The agent's end of the socketpair.
    sock: UnixStream,
    /// The stream it is joined to; 0 while no host is connected.
    stream: AtomicU32,
    /// Requests sent without a reply yet, by tag.
    inflight: Mutex<BTreeMap<u16, Vec<u8>>>,
    down: Mutex<mpsc::Sender<Down>>,
}

/// Every mounted share, by id and by stream.
#[derive(Default)]
pub(crate) struct Shares {
    by_id: Mutex<HashMap<String, Arc<Share>>>,
    by_stream: Mutex<HashMap<u32, Arc<Share>>>,
}

impl Shares {
    pub(crate) fn contains(&self, stream: u32) -> bool {
        lock(&self.by_stream).contains_key(&stream)
    }

    /// The host's bytes for the share on `stream` (from the reader thread:
    /// never blocks).
    pub(crate) fn data(&self, stream: u32, bytes: Vec<u8>) {
        if let Some(s) = lock(&self.by_stream).get(&stream) {
            let _ = lock(&s.down).send(Down::Data(bytes));
        }
    }

    /// A new host connection: every share leaves its stream (the mounts
    /// stay); returns the streams, whose queued frames must go nowhere.
    pub(crate) fn detach_all(&self) -> HashSet<u32> {
        let mut by_stream = lock(&self.by_stream);
        let ids: HashSet<u32> = by_stream.keys().copied().collect();
        for s in by_stream.values() {
            // Under the inflight lock: the pump sends nothing half-joined.
            let _g = lock(&s.inflight);
            s.stream.store(0, Ordering::SeqCst);
        }
        by_stream.clear();
        ids
    }
}

/// Frames one 9P message off `r`: `None` at the end.
fn read_msg(mut r: impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut head = [0u8; HEADER];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let size = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if !(HEADER..=SHARE_MSIZE).contains(&size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a 9P message of {size} bytes"),
        ));
    }
    let mut msg = vec![0u8; size];
    msg[..HEADER].copy_from_slice(&head);
    r.read_exact(&mut msg[HEADER..])?;
    Ok(Some(msg))
}

fn tag(msg: &[u8]) -> u16 {
    u16::from_le_bytes([msg[5], msg[6]])
}

/// Kernel -> host: each request is kept until its reply, and sent on the
/// current stream if there is one.
fn up(agent: &Agent, s: &Share) {
    loop {
        let msg = match read_msg(&s.sock) {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                log!("share {}: {e}", s.id);
                break;
            }
        };
        // Kept and the stream read under one lock: a rejoin either sends
        // it again or finds it sent on the new stream (never half-joined).
        // The send itself waits outside, as the outbox may be full.
        let stream = {
            let mut inflight = lock(&s.inflight);
            inflight.insert(tag(&msg), msg.clone());
            s.stream.load(Ordering::SeqCst)
        };
        if stream != 0 {
            agent.out.data(stream, channel::INPUT, &msg);
        }
    }
    end(agent, s);
}

/// Host -> kernel: whole replies, each clearing its request.
fn down(s: &Share, rx: mpsc::Receiver<Down>) {
    let mut buf: Vec<u8> = Vec::new();
    let mut sock = &s.sock;
    while let Ok(m) = rx.recv() {
        match m {
            Down::End => break,
            Down::Restart => buf.clear(),
            Down::Data(bytes) => {
                buf.extend_from_slice(&bytes);
                let mut off = 0;
                while buf.len() - off >= HEADER {
                    let size =
                        u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
                            as usize;
                    if !(HEADER..=SHARE_MSIZE).contains(&size) {
                        log!("share {}: a reply of {size} bytes; dropped", s.id);
                        buf.clear();
                        off = 0;
                        break;
                    }
                    if buf.len() - off < size {
                        break;
                    }
                    let msg = &buf[off..off + size];
                    lock(&s.inflight).remove(&tag(msg));
                    if sock.write_all(msg).is_err() {
                        return;
                    }
                    off += size;
                }
                buf.drain(..off);
            }
        }
    }
}

fn end(agent: &Agent, s: &Share) {
    let mut by_id = lock(&agent.shares.by_id);
    if by_id
        .get(&s.id)
        .is_some_and(|x| std::ptr::eq(x.as_ref(), s))
    {
        by_id.remove(&s.id);
    }
    drop(by_id);
    lock(&agent.shares.by_stream).retain(|_, x| !std::ptr::eq(x.as_ref(), s));
    let _ = lock(&s.down).send(Down::End);
}

/// [`Request::Share`](runtime_proto::Request::Share) on `stream` (on a
/// thread of its own: the mount waits for the host's first answers).
pub(crate) fn share(agent: &Arc<Agent>, stream: u32, id: String, path: String) {
    let existing = lock(&agent.shares.by_id).get(&id).cloned();
    if let Some(s) = existing {
        if s.path != path {
            let fail = Fail::new(
                FailCode::AlreadyExists,
                format!("share {id} is mounted at {}", s.path),
            );
            agent.out.reply_now(stream, &fail.reply());
            return;
        }
        rejoin(agent, &s, stream);
        agent.out.reply(stream, &Reply::Done);
        return;
    }
    let reply = match mount_new(agent, stream, &id, &path) {
        Ok(()) => Reply::Done,
        Err(f) => f.reply(),
    };
    agent.out.reply(stream, &reply);
}

/// Joins a mounted share to a new stream and sends again what it was
/// waiting for.
fn rejoin(agent: &Agent, s: &Arc<Share>, stream: u32) {
    let _ = lock(&s.down).send(Down::Restart);
    let again: Vec<Vec<u8>> = {
        let inflight = lock(&s.inflight);
        s.stream.store(stream, Ordering::SeqCst);
        inflight.values().cloned().collect()
    };
    lock(&agent.shares.by_stream).insert(stream, Arc::clone(s));
    for msg in &again {
        agent.out.data(stream, channel::RESENT, msg);
    }
    log!(
        "share {} joined again ({} requests sent again)",
        s.id,
        again.len()
    );
}

fn mount_new(agent: &Arc<Agent>, stream: u32, id: &str, path: &str) -> Result<(), Fail> {
    if !path.starts_with('/') || path.contains('\0') || path.split('/').any(|p| p == "..") {
        return Err(Fail::new(FailCode::InvalidPath, format!("bad path {path}")));
    }
    if lock(&agent.shares.by_id).len() >= MAX_SHARES {
        return Err(Fail::new(FailCode::Io, "too many shares"));
    }
    std::fs::create_dir_all(path).map_err(|e| Fail::io(format!("mkdir {path}"), &e))?;
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two fds into a valid array.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Fail::io("socketpair", &io::Error::last_os_error()));
    }
    // SAFETY: both fds were just made and are owned here.
    let (mine, kernel) = unsafe {
        (
            UnixStream::from_raw_fd(fds[0]),
            OwnedFd::from_raw_fd(fds[1]),
        )
    };
    let (tx, rx) = mpsc::channel();
    let s = Arc::new(Share {
        id: id.to_owned(),
        path: path.to_owned(),
        sock: mine,
        stream: AtomicU32::new(stream),
        inflight: Mutex::new(BTreeMap::new()),
        down: Mutex::new(tx),
    });
    lock(&agent.shares.by_id).insert(id.to_owned(), Arc::clone(&s));
    lock(&agent.shares.by_stream).insert(stream, Arc::clone(&s));
    let (a, su) = (Arc::clone(agent), Arc::clone(&s));
    let sd = Arc::clone(&s);
    let started = std::thread::Builder::new()
        .name("share-up".into())
        .stack_size(STACK)
        .spawn(move || up(&a, &su))
        .and_then(|_| {
            std::thread::Builder::new()
                .name("share-down".into())
                .stack_size(STACK)
                .spawn(move || down(&sd, rx))
        });
    if let Err(e) = started {
        let _ = s.sock.shutdown(std::net::Shutdown::Both);
        return Err(Fail::io("starting the share's threads", &e));
    }
    let fd = kernel.as_raw_fd();
    let opts = format!(
        "trans=fd,rfdno={fd},wfdno={fd},version=9p2000.L,msize={SHARE_MSIZE},cache=none,access=user"
    );
    let (src, dst, fstype, data) = (
        cstring(&format!("runtime-{id}")).map_err(|e| Fail::io("name", &e))?,
        cstring(path).map_err(|e| Fail::io("path", &e))?,
        cstring("9p").map_err(|e| Fail::io("type", &e))?,
        cstring(&opts).map_err(|e| Fail::io("options", &e))?,
    );
    // SAFETY: valid C strings; the kernel takes its own reference to `fd`.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    let err = errno();
    drop(kernel);
    if rc != 0 {
        // The kernel closed its end: the pump ends and forgets the share.
        let _ = s.sock.shutdown(std::net::Shutdown::Both);
        let e = io::Error::from_raw_os_error(err);
        return Err(Fail::io(format!("mount 9p at {path}"), &e));
    }
    log!("share {id} mounted at {path}");
    Ok(())
}

/// [`Request::Unshare`](runtime_proto::Request::Unshare): unmounts (lazily
/// if busy) and ends the pump; `Done` also when no such share is mounted.
pub(crate) fn unshare(agent: &Arc<Agent>, stream: u32, id: &str) {
    let s = lock(&agent.shares.by_id).remove(id);
    if let Some(s) = s {
        if let Ok(p) = cstring(&s.path) {
            // SAFETY: a valid C string.
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = s.sock.shutdown(std::net::Shutdown::Both);
        lock(&agent.shares.by_stream).retain(|_, x| !Arc::ptr_eq(x, &s));
        let _ = lock(&s.down).send(Down::End);
        log!("share {id} unmounted from {}", s.path);
    }
    agent.out.reply(stream, &Reply::Done);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn messages_are_framed_by_their_size() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&[100, 3, 0, b'h', b'i']);
        bytes.extend_from_slice(&7u32.to_le_bytes());
        bytes.extend_from_slice(&[120, 4, 0]);
        let mut r = &bytes[..];
        let a = read_msg(&mut r).unwrap().unwrap();
        assert_eq!((a.len(), tag(&a)), (9, 3));
        let b = read_msg(&mut r).unwrap().unwrap();
        assert_eq!((b.len(), tag(&b)), (7, 4));
        assert!(read_msg(&mut r).unwrap().is_none());
        let big = ((SHARE_MSIZE + 1) as u32).to_le_bytes();
        let mut r = &[big[0], big[1], big[2], big[3], 0, 0, 0][..];
        assert!(read_msg(&mut r).is_err());
    }
}
