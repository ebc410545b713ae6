//! Shared volumes on the host (docs/volumes.md, "Shared volumes"): a
//! directory served as 9P2000.L to a guest's mount over the agent link.
//!
//! Per attachment: a child process (`runtime 9p-serve`, [`serve`]) runs the
//! `p9` crate's server over the volume's directory as the volume's own
//! unprivileged uid, and a task relays between the link stream and that
//! child's socket. The relay ([`Relay`]) reads the 9P framing only: it cuts
//! off a guest that sends a message longer than the mount's `msize`,
//! answers writes itself with `ENOSPC` while the tree is at its size, and
//! keeps the last reply per tag so a request the agent sends again after a
//! new connection (a wake, a restart of the server) is answered once.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use runtime_proto::{channel, Reply, Request, SHARE_MSIZE};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::link::{Incoming, Stream};

/// A 9P header: `size[4] type[1] tag[2]`.
const HEADER: usize = 7;
const TWRITE: u8 = 118;
const RLERROR: u8 = 7;
/// Replies kept for requests sent again, in bytes (the oldest go first;
/// a request sent again whose reply is gone is done again).
const CACHE_BYTES: usize = 8 << 20;
/// How often the tree's usage is measured, and at most how many entries.
const USAGE_EVERY: Duration = Duration::from_secs(1);
pub(crate) const USAGE_MAX_ENTRIES: usize = 200_000;

/// What the relay does with a message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Out {
    ToServer(Vec<u8>),
    ToGuest(Vec<u8>),
}

/// The guest broke the framing: the share is cut off.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Cut(pub(crate) String);

/// The 9P relay's state (pure: bytes in, messages out).
#[derive(Default)]
pub(crate) struct Relay {
    /// Partial guest messages, per channel (INPUT, RESENT).
    guest: [Vec<u8>; 2],
    server: Vec<u8>,
    /// Requests at the server, by tag: the request's hash.
    pending: HashMap<u16, [u8; 32]>,
    /// The last reply per tag, with its request's hash.
    done: HashMap<u16, ([u8; 32], Vec<u8>)>,
    order: VecDeque<u16>,
    done_bytes: usize,
}

fn tag(msg: &[u8]) -> u16 {
    u16::from_le_bytes([msg[5], msg[6]])
}

fn digest(msg: &[u8]) -> [u8; 32] {
    Sha256::digest(msg).into()
}

/// `Rlerror` with `errno` for `tag`.
pub(crate) fn rlerror(tag: u16, errno: u32) -> Vec<u8> {
    let mut m = Vec::with_capacity(11);
    m.extend_from_slice(&11u32.to_le_bytes());
    m.push(RLERROR);
    m.extend_from_slice(&tag.to_le_bytes());
    m.extend_from_slice(&errno.to_le_bytes());
    m
}

/// Splits whole messages off the front of `buf`.
fn split(buf: &mut Vec<u8>) -> Result<Vec<Vec<u8>>, Cut> {
    let mut out = Vec::new();
    let mut off = 0;
    while buf.len() - off >= HEADER {
        let size =
            u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if !(HEADER..=SHARE_MSIZE).contains(&size) {
            return Err(Cut(format!(
                "a 9P message of {size} bytes (at most {SHARE_MSIZE})"
            )));
        }
        if buf.len() - off < size {
            break;
        }
        out.push(buf[off..off + size].to_vec());
        off += size;
    }
    buf.drain(..off);
    Ok(out)
}

impl Relay {
    /// Bytes from the guest on `ch` (INPUT, or RESENT for requests sent
    /// again); `full`: the tree is at its size.
    pub(crate) fn guest_bytes(
        &mut self,
        ch: u8,
        bytes: &[u8],
        full: bool,
        out: &mut Vec<Out>,
    ) -> Result<(), Cut> {
        let resent = ch == channel::RESENT;
        let buf = &mut self.guest[usize::from(resent)];
        buf.extend_from_slice(bytes);
        for msg in split(buf)? {
            let t = tag(&msg);
            let h = digest(&msg);
            if resent {
                if self.pending.get(&t) == Some(&h) {
                    // Its reply is still to come.
                    continue;
                }
                if let Some((rh, reply)) = self.done.get(&t) {
                    if *rh == h {
                        out.push(Out::ToGuest(reply.clone()));
                        continue;
                    }
                }
            } else if let Some((_, r)) = self.done.remove(&t) {
                // A new request on a tag: its last reply arrived.
                self.done_bytes -= r.len();
            }
            if msg[4] == TWRITE && full {
                out.push(Out::ToGuest(rlerror(t, libc::ENOSPC as u32)));
                continue;
            }
            self.pending.insert(t, h);
            out.push(Out::ToServer(msg));
        }
        Ok(())
    }

    /// Bytes from the server: replies, kept for a request sent again.
    pub(crate) fn server_bytes(&mut self, bytes: &[u8], out: &mut Vec<Out>) -> Result<(), Cut> {
        self.server.extend_from_slice(bytes);
        for reply in split(&mut self.server)? {
            let t = tag(&reply);
            if let Some(h) = self.pending.remove(&t) {
                if let Some((_, old)) = self.done.insert(t, (h, reply.clone())) {
                    self.done_bytes -= old.len();
                }
                self.done_bytes += reply.len();
                self.order.push_back(t);
                while self.done_bytes > CACHE_BYTES {
                    let Some(old) = self.order.pop_front() else {
                        break;
                    };
                    if let Some((_, r)) = self.done.remove(&old) {
                        self.done_bytes -= r.len();
                    }
                }
                if self.order.len() > 4 * 65536 {
                    let done = &self.done;
                    self.order.retain(|t| done.contains_key(t));
                }
            }
            out.push(Out::ToGuest(reply));
        }
        Ok(())
    }

    /// The guest is joined to a new stream: a message cut by the old one is
    /// dropped (the agent sends it again whole).
    pub(crate) fn new_stream(&mut self) {
        self.guest[0].clear();
        self.guest[1].clear();
    }
}

/// The blocks a tree takes (bytes), walked without following links, at
/// most [`USAGE_MAX_ENTRIES`] entries (a larger tree counts what was seen).
pub fn tree_usage(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0u64;
    let mut seen = 0usize;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(m) = std::fs::symlink_metadata(&dir) {
            total += m.blocks() * 512;
        }
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            seen += 1;
            if seen > USAGE_MAX_ENTRIES {
                return total;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if let Ok(m) = e.metadata() {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

/// One attachment's share, as the host runs it.
#[derive(Debug, Clone)]
pub struct ShareSpec {
    /// The attachment id (names the share to the agent).
    pub id: String,
    /// The volume's directory on the host.
    pub dir: PathBuf,
    /// The uid (and gid) its files belong to and its server runs as
    /// (`None`: the server's own, when it does not run as root).
    pub uid: Option<u32>,
    /// The volume's size: writes stop (`ENOSPC`) at it.
    pub size_bytes: u64,
    /// Where the guest mounts it.
    pub path: String,
}

/// A running share: its relay task, told of new streams and of its end.
pub(crate) struct ShareHandle {
    pub(crate) spec: ShareSpec,
    streams: mpsc::UnboundedSender<(Stream, oneshot::Sender<Result<(), String>>)>,
    stop: tokio_util::sync::CancellationToken,
}

impl ShareHandle {
    /// Joins the share to a new stream (already sent `Share`); the answer
    /// says whether the agent mounted (or joined) it.
    pub(crate) async fn join(&self, stream: Stream) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.streams
            .send((stream, tx))
            .map_err(|_| "the share's relay ended".to_string())?;
        match tokio::time::timeout(Duration::from_secs(60), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err("the share's relay ended".into()),
            Err(_) => Err("the agent did not mount the share in time".into()),
        }
    }

    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for ShareHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts the share's server process and relay (no stream yet).
pub(crate) fn start(spec: ShareSpec, exe: &Path) -> std::io::Result<ShareHandle> {
    let (parent, child) = std::os::unix::net::UnixStream::pair()?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("9p-serve")
        .arg("--max-bytes")
        .arg(spec.size_bytes.to_string());
    if let Some(uid) = spec.uid {
        cmd.arg("--uid").arg(uid.to_string());
    }
    cmd.arg(&spec.dir)
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            child.try_clone()?,
        )))
        .stdout(std::process::Stdio::from(std::os::fd::OwnedFd::from(child)))
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    // Like a QEMU, a server of its own uid gets a network namespace with
    // nothing in it: it serves a socket pair and needs no network.
    if spec.uid.is_some() && crate::qemu::own_netns_works() {
        // SAFETY: `unshare_net` makes one system call.
        unsafe {
            cmd.pre_exec(crate::qemu::unshare_net);
        }
    }
    let proc = cmd.spawn()?;
    parent.set_nonblocking(true)?;
    let sock = tokio::net::UnixStream::from_std(parent)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let full = Arc::new(AtomicBool::new(false));
    {
        let (dir, size, full, stop) = (
            spec.dir.clone(),
            spec.size_bytes,
            Arc::clone(&full),
            stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let d = dir.clone();
                let used = tokio::task::spawn_blocking(move || tree_usage(&d))
                    .await
                    .unwrap_or(0);
                full.store(used >= size, Ordering::Relaxed);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(USAGE_EVERY) => {}
                }
            }
        });
    }
    let id = spec.id.clone();
    tokio::spawn(relay(id, proc, sock, rx, stop.clone(), full));
    Ok(ShareHandle {
        spec,
        streams: tx,
        stop,
    })
}

type Join = (Stream, oneshot::Sender<Result<(), String>>);

async fn relay(
    id: String,
    mut proc: tokio::process::Child,
    sock: tokio::net::UnixStream,
    mut joins: mpsc::UnboundedReceiver<Join>,
    stop: tokio_util::sync::CancellationToken,
    full: Arc<AtomicBool>,
) {
    let (mut rd, mut wr) = sock.into_split();
    let mut relay = Relay::default();
    let mut current: Option<Stream> = None;
    let mut answer: Option<oneshot::Sender<Result<(), String>>> = None;
    let mut buf = vec![0u8; 64 * 1024];
    let mut out = Vec::new();
    let why = loop {
        for o in out.drain(..) {
            match o {
                Out::ToServer(m) => {
                    if wr.write_all(&m).await.is_err() {
                        return end(&id, &mut proc, current, "the 9P server ended").await;
                    }
                }
                Out::ToGuest(m) => {
                    if let Some(s) = &current {
                        // A reply lost with the link is kept: the agent
                        // sends its request again on the next stream.
                        let _ = s.send_data(&m).await;
                    }
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break "stopped",
            j = joins.recv() => match j {
                None => break "stopped",
                Some((s, tx)) => {
                    relay.new_stream();
                    if let Some(old) = current.replace(s) {
                        old.ended();
                    }
                    if let Some(a) = answer.replace(tx) {
                        let _ = a.send(Err("joined to another stream".into()));
                    }
                }
            },
            inc = async {
                match current.as_mut() {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            } => match inc {
                // The link is gone (a pause, a stop): wait for the next.
                None => current = None,
                Some(Incoming::Data { channel: ch, bytes }) if ch == channel::INPUT || ch == channel::RESENT => {
                    if let Err(Cut(why)) = relay.guest_bytes(ch, &bytes, full.load(Ordering::Relaxed), &mut out) {
                        tracing::warn!(share = %id, "cutting off a share: {why}");
                        if let Some(s) = &current {
                            let _ = s.send(&Request::Unshare { id: id.clone() });
                        }
                        break "cut off";
                    }
                }
                Some(Incoming::Data { .. }) => {}
                Some(Incoming::Reply(Reply::Done)) => {
                    if let Some(a) = answer.take() {
                        let _ = a.send(Ok(()));
                    }
                }
                Some(Incoming::Reply(Reply::Failed { message, .. })) => {
                    if let Some(a) = answer.take() {
                        let _ = a.send(Err(message));
                    }
                }
                Some(Incoming::Reply(_)) => {}
            },
            r = rd.read(&mut buf) => match r {
                Ok(0) | Err(_) => break "the 9P server ended",
                Ok(n) => {
                    if relay.server_bytes(&buf[..n], &mut out).is_err() {
                        break "the 9P server sent a bad reply";
                    }
                }
            },
        }
    };
    if let Some(a) = answer.take() {
        let _ = a.send(Err(why.to_string()));
    }
    end(&id, &mut proc, current, why).await;
}

async fn end(id: &str, proc: &mut tokio::process::Child, current: Option<Stream>, why: &str) {
    tracing::debug!(share = %id, why, "share relay ended");
    if let Some(s) = current {
        s.ended();
    }
    let _ = proc.start_kill();
    let _ = proc.wait().await;
}

/// `runtime 9p-serve`: serves `dir` as 9P2000.L on stdin/stdout, as `uid`
/// (dropped to before any byte is read), files mapped to uid/gid 1000 for
/// the guest, no new privileges, files at most `max_bytes` long, at most
/// 4096 open files. Returns when stdin ends.
pub fn serve(dir: &Path, uid: Option<u32>, max_bytes: u64) -> std::io::Result<()> {
    use std::io::{BufReader, BufWriter};
    std::env::set_current_dir(dir)?;
    let cvt = |rc: libc::c_int, what: &str| {
        if rc == 0 {
            Ok(())
        } else {
            let e = std::io::Error::last_os_error();
            Err(std::io::Error::new(e.kind(), format!("{what}: {e}")))
        }
    };
    // SAFETY: plain syscalls on values, no memory is shared.
    unsafe {
        if let Some(u) = uid {
            cvt(libc::setgroups(0, std::ptr::null()), "setgroups")?;
            cvt(libc::setresgid(u, u, u), "setresgid")?;
            cvt(libc::setresuid(u, u, u), "setresuid")?;
        }
        cvt(
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
            "no_new_privs",
        )?;
        cvt(
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0),
            "pdeathsig",
        )?;
        let fsize = libc::rlimit {
            rlim_cur: max_bytes,
            rlim_max: max_bytes,
        };
        cvt(libc::setrlimit(libc::RLIMIT_FSIZE, &fsize), "RLIMIT_FSIZE")?;
        let files = libc::rlimit {
            rlim_cur: 4096,
            rlim_max: 4096,
        };
        cvt(
            libc::setrlimit(libc::RLIMIT_NOFILE, &files),
            "RLIMIT_NOFILE",
        )?;
        // A write past RLIMIT_FSIZE fails with EFBIG instead of killing.
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // SAFETY: geteuid/getegid have no preconditions.
    let (me, mg) = unsafe { (libc::geteuid(), libc::getegid()) };
    let mut server = p9::Server::with_config(p9::Config {
        root: Path::new(".").into(),
        msize: SHARE_MSIZE as u32,
        uid_map: [(me, 1000)].into_iter().collect(),
        gid_map: [(mg, 1000)].into_iter().collect(),
        ascii_casefold: false,
    })?;
    let mut rd = BufReader::new(std::io::stdin().lock());
    let mut wr = BufWriter::new(std::io::stdout().lock());
    loop {
        // Ends at EOF (or a framing error).
        if let Err(e) = server.handle_message(&mut rd, &mut wr) {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Ok(());
            }
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn msg(kind: u8, tag: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((HEADER + body.len()) as u32).to_le_bytes());
        m.push(kind);
        m.extend_from_slice(&tag.to_le_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn requests_go_to_the_server_and_replies_to_the_guest() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        let req = msg(110, 1, b"walk");
        // In two pieces: nothing until it is whole.
        r.guest_bytes(channel::INPUT, &req[..5], false, &mut out)
            .unwrap();
        assert!(out.is_empty());
        r.guest_bytes(channel::INPUT, &req[5..], false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(req.clone())]);
        out.clear();
        let rep = msg(111, 1, b"ok");
        r.server_bytes(&rep, &mut out).unwrap();
        assert_eq!(out, vec![Out::ToGuest(rep)]);
    }

    #[test]
    fn a_request_sent_again_is_answered_once() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        let req = msg(TWRITE, 9, b"fid+data");
        r.guest_bytes(channel::INPUT, &req, false, &mut out)
            .unwrap();
        // Sent again while the server still works on it: dropped.
        r.guest_bytes(channel::RESENT, &req, false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(req.clone())]);
        out.clear();
        let rep = msg(119, 9, b"count");
        r.server_bytes(&rep, &mut out).unwrap();
        out.clear();
        // The reply was lost with the link: sent again, answered from the
        // kept reply, not done twice.
        r.new_stream();
        r.guest_bytes(channel::RESENT, &req, false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToGuest(rep.clone())]);
        out.clear();
        // A different request on that tag sent again is new work.
        let other = msg(TWRITE, 9, b"other");
        r.guest_bytes(channel::RESENT, &other, false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(other)]);
        out.clear();
        // An identical request as new traffic (not sent again) is done again.
        let mut r = Relay::default();
        r.guest_bytes(channel::INPUT, &req, false, &mut out)
            .unwrap();
        r.server_bytes(&rep, &mut out).unwrap();
        out.clear();
        r.guest_bytes(channel::INPUT, &req, false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(req)]);
    }

    #[test]
    fn a_request_lost_on_the_way_is_done_when_sent_again() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        let req = msg(TWRITE, 3, b"x");
        // Half of it came on the old stream.
        r.guest_bytes(channel::INPUT, &req[..4], false, &mut out)
            .unwrap();
        r.new_stream();
        r.guest_bytes(channel::RESENT, &req, false, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(req)]);
    }

    #[test]
    fn writes_are_refused_with_enospc_while_full() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        let w = msg(TWRITE, 4, b"data");
        r.guest_bytes(channel::INPUT, &w, true, &mut out).unwrap();
        assert_eq!(out, vec![Out::ToGuest(rlerror(4, libc::ENOSPC as u32))]);
        assert_eq!(rlerror(4, 28), [11, 0, 0, 0, 7, 4, 0, 28, 0, 0, 0]);
        out.clear();
        // Reads and removes still pass (they free space).
        let unlink = msg(76, 5, b"name");
        r.guest_bytes(channel::INPUT, &unlink, true, &mut out)
            .unwrap();
        assert_eq!(out, vec![Out::ToServer(unlink)]);
    }

    #[test]
    fn an_oversized_or_undersized_message_cuts_the_guest_off() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        let mut big = ((SHARE_MSIZE + 1) as u32).to_le_bytes().to_vec();
        big.extend_from_slice(&[TWRITE, 0, 0]);
        assert!(r
            .guest_bytes(channel::INPUT, &big, false, &mut out)
            .is_err());
        let mut r = Relay::default();
        assert!(r
            .guest_bytes(channel::INPUT, &[3, 0, 0, 0, 1, 0, 0], false, &mut out)
            .is_err());
        // The largest allowed passes.
        let mut r = Relay::default();
        let m = msg(TWRITE, 1, &vec![0u8; SHARE_MSIZE - HEADER]);
        r.guest_bytes(channel::INPUT, &m, false, &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn kept_replies_are_bounded() {
        let mut r = Relay::default();
        let mut out = Vec::new();
        for t in 0..200u16 {
            r.guest_bytes(channel::INPUT, &msg(116, t, b"read"), false, &mut out)
                .unwrap();
            r.server_bytes(&msg(117, t, &vec![0u8; 128 * 1024]), &mut out)
                .unwrap();
        }
        assert!(r.done_bytes <= CACHE_BYTES);
        assert!(r.done.len() < 200);
    }

    #[test]
    fn usage_counts_blocks_and_does_not_follow_links() {
        let dir = std::env::temp_dir().join(format!("rt-share-usage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::write(dir.join("a/f"), vec![1u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink("/usr", dir.join("usr")).unwrap();
        let used = tree_usage(&dir);
        assert!((1 << 20..4 << 20).contains(&used), "{used}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
