//! TCP tunnels over the channel (see `runtime_proto::flow`): connections
//! the host opens into the guest ([`Request::Connect`]) and connections
//! guest processes open to the proxy port, handed to the host raw.
//!
//! Each tunnel has two threads: `up` reads the socket while the host's
//! credit allows and queues Data frames; `down` writes what the host sent
//! and grants credit as it is written. The reader thread only moves bytes
//! into a tunnel's inbox (bounded by the window it granted) and never
//! blocks on a socket.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use runtime_proto::flow::{RecvWindow, SendWindow};
use runtime_proto::{channel, FailCode, Reply, GUEST_STREAM};

use crate::agent::Agent;
use crate::sys::{errno, lock, log, log_limited, poll1, Fail, RateLimit};

/// Tunnels open at once, both directions together; more are refused.
pub(crate) const MAX_TUNNELS: usize = 512;
/// Bytes read from a socket per frame.
const CHUNK: usize = 64 * 1024;
/// How long a connection into the guest may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const STACK: usize = 256 * 1024;

static REFUSED: RateLimit = RateLimit::new(Duration::from_secs(10), 3);

#[derive(Default)]
struct St {
    /// What the host lets us send.
    send: SendWindow,
    /// What we let the host send, and what of it waits for the socket.
    recv: RecvWindow,
    inbox: VecDeque<Vec<u8>>,
    /// The host sent `Eof`: shut down our write side after the inbox.
    eof_in: bool,
    aborted: bool,
    read_done: bool,
    write_done: bool,
    /// A transparent connection: the proxy's answer to our `CONNECT`, read
    /// so far; `None` once it said 200 (or for other tunnels).
    head: Option<Vec<u8>>,
}

pub(crate) struct Tunnel {
    id: u32,
    sock: TcpStream,
    /// What goes to the host before the socket's bytes (a `CONNECT`).
    prefix: Option<Vec<u8>>,
    st: Mutex<St>,
    cv: Condvar,
}

impl Tunnel {
    fn wait<'a>(&self, g: std::sync::MutexGuard<'a, St>) -> std::sync::MutexGuard<'a, St> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }
}

/// Every open tunnel, by stream id.
#[derive(Default)]
pub(crate) struct Tunnels {
    map: Mutex<HashMap<u32, Arc<Tunnel>>>,
    next: AtomicU32,
    /// Connects under way, and whether the host gave up on them (`Close`).
    connecting: Mutex<HashMap<u32, bool>>,
}

impl Tunnels {
    fn get(&self, id: u32) -> Option<Arc<Tunnel>> {
        lock(&self.map).get(&id).cloned()
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        lock(&self.map).contains_key(&id)
    }

    fn remove(&self, id: u32) {
        lock(&self.map).remove(&id);
    }

    /// Registers a tunnel unless too many are open.
    fn insert(&self, t: &Arc<Tunnel>) -> bool {
        let mut m = lock(&self.map);
        if m.len() >= MAX_TUNNELS || m.contains_key(&t.id) {
            return false;
        }
        m.insert(t.id, Arc::clone(t));
        true
    }

    fn full(&self) -> bool {
        lock(&self.map).len() >= MAX_TUNNELS
    }

    /// A fresh id for a guest-opened stream.
    fn fresh_id(&self) -> u32 {
        let m = lock(&self.map);
        loop {
            let id = GUEST_STREAM | (self.next.fetch_add(1, Ordering::Relaxed) & !GUEST_STREAM);
            if id != GUEST_STREAM && !m.contains_key(&id) {
                return id;
            }
        }
    }

    /// Resets every tunnel (a new host connection): returns their ids.
    pub(crate) fn reset_all(&self) -> HashSet<u32> {
        let all: Vec<Arc<Tunnel>> = lock(&self.map).drain().map(|(_, t)| t).collect();
        let ids = all.iter().map(|t| t.id).collect();
        for t in all {
            abort(None, &t);
        }
        ids
    }
}

/// Ends a tunnel at once: its socket is reset (linger 0 on close) and its
/// threads stop. With `tell`, the host hears `Close`.
fn abort(tell: Option<&Agent>, t: &Tunnel) {
    {
        let mut st = lock(&t.st);
        if st.aborted {
            return;
        }
        st.aborted = true;
        st.inbox.clear();
    }
    t.cv.notify_all();
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid linger struct on a socket we own.
    unsafe {
        libc::setsockopt(
            t.sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    // Wakes a blocked read without sending FIN; the close (when the last
    // thread lets go) sends the reset.
    let _ = t.sock.shutdown(std::net::Shutdown::Read);
    if let Some(agent) = tell {
        agent.tunnels.remove(t.id);
        agent.out.reply_late(t.id, &Reply::Close);
    }
}

fn abort_and_forget(agent: &Agent, t: &Tunnel, tell: bool) {
    agent.tunnels.remove(t.id);
    if tell {
        abort(Some(agent), t);
    } else {
        abort(None, t);
    }
}

fn finish(agent: &Agent, t: &Tunnel, read: bool) {
    let done = {
        let mut st = lock(&t.st);
        if read {
            st.read_done = true;
        } else {
            st.write_done = true;
        }
        st.read_done && st.write_done && !st.aborted
    };
    if done {
        agent.tunnels.remove(t.id);
    }
}

/// Socket -> host, within the host's credit.
fn up(agent: &Agent, t: &Tunnel) {
    if let Some(prefix) = &t.prefix {
        let mut st = lock(&t.st);
        while st.send.available() < prefix.len() && !st.aborted {
            st = t.wait(st);
        }
        if st.aborted {
            return;
        }
        st.send.sent(prefix.len());
        drop(st);
        agent.out.data(t.id, channel::INPUT, prefix);
        // Nothing of the program's goes out before the proxy said yes.
        let mut st = lock(&t.st);
        while st.head.is_some() && !st.aborted {
            st = t.wait(st);
        }
        if st.aborted {
            return;
        }
    }
    let mut buf = vec![0u8; CHUNK];
    loop {
        let want = {
            let mut st = lock(&t.st);
            while st.send.available() == 0 && !st.aborted {
                st = t.wait(st);
            }
            if st.aborted {
                return;
            }
            st.send.available().min(CHUNK)
        };
        match (&t.sock).read(&mut buf[..want]) {
            Ok(n) => {
                let mut st = lock(&t.st);
                if st.aborted {
                    return;
                }
                if n == 0 {
                    drop(st);
                    agent.out.reply(t.id, &Reply::Eof);
                    finish(agent, t, true);
                    return;
                }
                st.send.sent(n);
                drop(st);
                agent.out.data(t.id, channel::INPUT, &buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                if !lock(&t.st).aborted {
                    abort_and_forget(agent, t, true);
                }
                return;
            }
        }
    }
}

/// Writes all of `buf` unless the tunnel is aborted meanwhile (checked while
/// the socket cannot take more, so a reader that never reads does not pin
/// this thread).
fn write_all(t: &Tunnel, mut buf: &[u8]) -> io::Result<()> {
    let fd = t.sock.as_raw_fd();
    while !buf.is_empty() {
        // SAFETY: sends from a valid buffer; MSG_NOSIGNAL: EPIPE, no SIGPIPE.
        let n = unsafe {
            libc::send(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n > 0 {
            buf = &buf[n as usize..];
            continue;
        }
        match errno() {
            libc::EINTR => {}
            libc::EAGAIN => {
                if lock(&t.st).aborted {
                    return Err(io::ErrorKind::ConnectionAborted.into());
                }
                let _ = poll1(fd, libc::POLLOUT, 250);
            }
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
    Ok(())
}

enum Answer {
    /// The proxy's answer is not whole yet: nothing for the socket.
    Waiting,
    /// The tunnel is open; the socket's bytes start at this offset.
    Open(usize),
    /// The proxy refused (or answered nonsense): reset the program's connection.
    Refused,
}

/// The longest answer head the proxy sends to a `CONNECT`.
const MAX_HEAD: usize = 8 * 1024;

/// For a transparent connection, reads the proxy's answer to its
/// `CONNECT` off the front of what the host sends: only a `200` opens it.
fn proxy_answer(t: &Tunnel, chunk: &[u8]) -> Answer {
    let mut st = lock(&t.st);
    let Some(head) = st.head.as_mut() else {
        return Answer::Open(0);
    };
    let had = head.len();
    head.extend_from_slice(chunk);
    let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if head.len() > MAX_HEAD {
            Answer::Refused
        } else {
            Answer::Waiting
        };
    };
    let ok = head.starts_with(b"HTTP/1.1 200 ") || head.starts_with(b"HTTP/1.0 200 ");
    if !ok {
        let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
        log_limited!(
            REFUSED,
            "transparent connection refused by the proxy: {}",
            String::from_utf8_lossy(line)
        );
        return Answer::Refused;
    }
    st.head = None;
    drop(st);
    t.cv.notify_all();
    Answer::Open(end + 4 - had)
}

/// Host -> socket, granting credit as bytes are written.
fn down(agent: &Agent, t: &Tunnel) {
    loop {
        let chunk = {
            let mut st = lock(&t.st);
            loop {
                if st.aborted {
                    return;
                }
                if let Some(c) = st.inbox.pop_front() {
                    break c;
                }
                if st.eof_in && st.head.is_some() {
                    // The proxy hung up without a `200`: refused.
                    drop(st);
                    abort_and_forget(agent, t, true);
                    return;
                }
                if st.eof_in {
                    drop(st);
                    let _ = t.sock.shutdown(std::net::Shutdown::Write);
                    finish(agent, t, false);
                    return;
                }
                st = t.wait(st);
            }
        };
        let rest = match proxy_answer(t, &chunk) {
            Answer::Waiting => &[][..],
            Answer::Open(at) => &chunk[at..],
            Answer::Refused => {
                if !lock(&t.st).aborted {
                    abort_and_forget(agent, t, true);
                }
                return;
            }
        };
        if !rest.is_empty() && write_all(t, rest).is_err() {
            if !lock(&t.st).aborted {
                abort_and_forget(agent, t, true);
            }
            return;
        }
        let credit = lock(&t.st).recv.delivered(chunk.len());
        if let Some(bytes) = credit {
            agent.out.reply(t.id, &Reply::Credit { bytes });
        }
    }
}

/// Starts the pumps of a registered tunnel; resets it if that fails.
fn run(agent: &Arc<Agent>, t: Arc<Tunnel>) {
    for dir in ["up", "down"] {
        let (a, tt) = (Arc::clone(agent), Arc::clone(&t));
        let spawned = std::thread::Builder::new()
            .name(format!("tunnel-{dir}"))
            .stack_size(STACK)
            .spawn(move || {
                if dir == "up" {
                    up(&a, &tt)
                } else {
                    down(&a, &tt)
                }
            });
        if let Err(e) = spawned {
            log!("cannot start a tunnel thread: {e}");
            abort_and_forget(agent, &t, true);
            return;
        }
    }
}

fn new_tunnel(id: u32, sock: TcpStream) -> Arc<Tunnel> {
    with_prefix(id, sock, None)
}

fn with_prefix(id: u32, sock: TcpStream, prefix: Option<Vec<u8>>) -> Arc<Tunnel> {
    let _ = sock.set_nodelay(true);
    let st = St {
        head: prefix.as_ref().map(|_| Vec::new()),
        ..St::default()
    };
    Arc::new(Tunnel {
        id,
        sock,
        prefix,
        st: Mutex::new(st),
        cv: Condvar::new(),
    })
}

/// [`Request::Connect`](runtime_proto::Request::Connect) on `stream`: on its
/// own thread (a connect may take a while).
pub(crate) fn connect(agent: &Arc<Agent>, stream: u32, port: u16) {
    if agent.tunnels.full() {
        let fail = Fail::new(FailCode::Io, "too many connections");
        agent.out.reply_late(stream, &fail.reply());
        return;
    }
    lock(&agent.tunnels.connecting).insert(stream, false);
    let a = Arc::clone(agent);
    let spawned = std::thread::Builder::new()
        .name("tunnel-connect".into())
        .stack_size(STACK)
        .spawn(move || {
            let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            let sock = TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT).or_else(|e| {
                if e.kind() == io::ErrorKind::ConnectionRefused {
                    TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e)
                } else {
                    Err(e)
                }
            });
            // The host gave up meanwhile: nobody to answer, nothing to keep.
            if lock(&a.tunnels.connecting).remove(&stream) == Some(true) {
                if let Ok(s) = sock {
                    abort(None, &new_tunnel(stream, s));
                }
                return;
            }
            let sock = match sock {
                Ok(s) => s,
                Err(e) => {
                    let code = if e.kind() == io::ErrorKind::ConnectionRefused {
                        FailCode::ConnectionRefused
                    } else {
                        FailCode::Io
                    };
                    let fail = Fail::new(code, format!("connect to port {port}: {e}"));
                    a.out.reply(stream, &fail.reply());
                    return;
                }
            };
            let t = new_tunnel(stream, sock);
            let credit = lock(&t.st).recv.open();
            if !a.tunnels.insert(&t) {
                abort(None, &t);
                let fail = Fail::new(FailCode::Io, "too many connections or stream busy");
                a.out.reply(stream, &fail.reply());
                return;
            }
            a.out.reply(stream, &Reply::Done);
            a.out.reply(stream, &Reply::Credit { bytes: credit });
            run(&a, t);
        });
    if let Err(e) = spawned {
        lock(&agent.tunnels.connecting).remove(&stream);
        let fail = Fail::new(FailCode::Io, format!("cannot start a thread: {e}"));
        agent.out.reply_late(stream, &fail.reply());
    }
}

/// Data from the host for a tunnel.
pub(crate) fn data(agent: &Agent, stream: u32, bytes: Vec<u8>) {
    let Some(t) = agent.tunnels.get(stream) else {
        unknown(agent, stream);
        return;
    };
    let mut st = lock(&t.st);
    if st.aborted {
        return;
    }
    let ok = !st.eof_in && st.recv.received(bytes.len()).is_ok();
    if ok {
        if !bytes.is_empty() {
            st.inbox.push_back(bytes);
        }
        drop(st);
        t.cv.notify_all();
    } else {
        drop(st);
        log_limited!(REFUSED, "the host overran tunnel {stream}; resetting it");
        abort_and_forget(agent, &t, true);
    }
}

/// A tunnel frame for a stream the agent does not know: a guest-opened
/// stream that ended (or was reset by a new session) is answered `Close`,
/// so the host side ends too; host-chosen ids are left alone (a crossing
/// `Close` already ended them).
fn unknown(agent: &Agent, stream: u32) {
    if stream & GUEST_STREAM != 0 {
        agent.out.reply_late(stream, &Reply::Close);
    }
}

/// The host's `Credit`.
pub(crate) fn credit(agent: &Agent, stream: u32, bytes: u32) {
    let Some(t) = agent.tunnels.get(stream) else {
        unknown(agent, stream);
        return;
    };
    let ok = lock(&t.st).send.grant(bytes).is_ok();
    t.cv.notify_all();
    if !ok {
        log_limited!(
            REFUSED,
            "the host over-granted tunnel {stream}; resetting it"
        );
        abort_and_forget(agent, &t, true);
    }
}

/// The host's `Eof`.
pub(crate) fn eof(agent: &Agent, stream: u32) {
    let Some(t) = agent.tunnels.get(stream) else {
        unknown(agent, stream);
        return;
    };
    lock(&t.st).eof_in = true;
    t.cv.notify_all();
}

/// The host's `Close`.
pub(crate) fn close(agent: &Agent, stream: u32) {
    if let Some(t) = agent.tunnels.get(stream) {
        abort_and_forget(agent, &t, false);
    } else if let Some(cancelled) = lock(&agent.tunnels.connecting).get_mut(&stream) {
        *cancelled = true;
    }
}

/// Accepts connections to the proxy port on `addr`, each a guest-opened
/// tunnel. Returns once the listener runs (or could not bind).
pub(crate) fn listen(agent: &Arc<Agent>, addr: SocketAddr) {
    accept_on(agent, addr, "proxy-listen", outbound);
}

/// Runs a thread `name` that hands each connection accepted on `addr` to
/// `each`. Returns once it runs (or `addr` could not be bound).
fn accept_on(agent: &Arc<Agent>, addr: SocketAddr, name: &str, each: fn(&Arc<Agent>, TcpStream)) {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            // [::1] is missing when the guest kernel has no IPv6.
            if addr.is_ipv4() {
                log!("cannot listen on {addr}: {e}");
            }
            return;
        }
    };
    let a = Arc::clone(agent);
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .stack_size(STACK)
        .spawn(move || loop {
            match listener.accept() {
                Ok((sock, _)) => each(&a, sock),
                Err(e) => {
                    log_limited!(REFUSED, "accept on {addr}: {e}");
                    // Out of fds or memory: let some tunnels end first.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
    if let Err(e) = spawned {
        log!("cannot start the {name} thread: {e}");
    }
}

fn outbound(agent: &Arc<Agent>, sock: TcpStream) {
    let t = new_tunnel(agent.tunnels.fresh_id(), sock);
    let credit = lock(&t.st).recv.open();
    if !agent.tunnels.insert(&t) {
        log_limited!(REFUSED, "{MAX_TUNNELS} connections open: refusing another");
        abort(None, &t);
        return;
    }
    // Registered before it is announced: the host's credit finds it.
    agent.out.reply(t.id, &Reply::Outbound);
    agent.out.reply(t.id, &Reply::Credit { bytes: credit });
    run(agent, t);
}

/// Where the nat rule sends every TCP connection routed to the dummy.
pub(crate) const TRANSPARENT_PORT: u16 = 10801;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST`: the address a redirected
/// connection was made to, from conntrack.
const SO_ORIGINAL_DST: libc::c_int = 80;

/// The address a redirected connection was made to (`None` when it was
/// not redirected: someone connected to the port itself).
pub(crate) fn original_dst(sock: &TcpStream) -> Option<SocketAddr> {
    let fd = sock.as_raw_fd();
    match sock.local_addr().ok()? {
        SocketAddr::V4(_) => {
            // SAFETY: sockaddr_in is plain data; all zeroes is valid.
            let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            // SAFETY: getsockopt into a buffer of `len` bytes.
            let r = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_IP,
                    SO_ORIGINAL_DST,
                    (&mut sa as *mut libc::sockaddr_in).cast(),
                    &mut len,
                )
            };
            (r == 0).then(|| {
                let ip = Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
                SocketAddr::from((ip, u16::from_be(sa.sin_port)))
            })
        }
        SocketAddr::V6(_) => {
            // SAFETY: as above, for sockaddr_in6.
            let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            // SAFETY: as above.
            let r = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_IPV6,
                    SO_ORIGINAL_DST,
                    (&mut sa as *mut libc::sockaddr_in6).cast(),
                    &mut len,
                )
            };
            (r == 0).then(|| {
                let ip = Ipv6Addr::from(sa.sin6_addr.s6_addr);
                SocketAddr::from((ip, u16::from_be(sa.sin6_port)))
            })
        }
    }
}

/// What a redirected connection to `dst` asks the proxy for: the name
/// behind a reserved address, or the address itself. `None`: nothing to
/// ask (loopback, or a reserved address no name maps to).
pub(crate) fn connect_target(
    dst: SocketAddr,
    name_of: impl Fn(Ipv4Addr) -> Option<String>,
) -> Option<String> {
    let port = dst.port();
    let ip = match dst.ip() {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => std::net::IpAddr::V6(v6),
        },
        v4 => v4,
    };
    if ip.is_loopback() || ip.is_unspecified() || port == 0 {
        return None;
    }
    match ip {
        std::net::IpAddr::V4(v4) if crate::dns::in_range(v4) => {
            name_of(v4).map(|name| format!("{name}:{port}"))
        }
        std::net::IpAddr::V4(v4) => Some(format!("{v4}:{port}")),
        std::net::IpAddr::V6(v6) => Some(format!("[{v6}]:{port}")),
    }
}

/// Accepts the connections the nat rule redirects, each a guest-opened
/// tunnel that starts with `CONNECT target` to the host's proxy.
pub(crate) fn listen_transparent(agent: &Arc<Agent>, addr: SocketAddr) {
    accept_on(agent, addr, "transparent", transparent);
}

fn reset(sock: TcpStream) {
    abort(None, &new_tunnel(0, sock));
}

fn transparent(agent: &Arc<Agent>, sock: TcpStream) {
    let target = original_dst(&sock).and_then(|dst| connect_target(dst, crate::dns::name_of));
    let Some(target) = target else {
        reset(sock);
        return;
    };
    let prefix = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").into_bytes();
    let t = with_prefix(agent.tunnels.fresh_id(), sock, Some(prefix));
    let credit = lock(&t.st).recv.open();
    if !agent.tunnels.insert(&t) {
        log_limited!(REFUSED, "{MAX_TUNNELS} connections open: refusing another");
        abort(None, &t);
        return;
    }
    agent.out.reply(t.id, &Reply::Outbound);
    agent.out.reply(t.id, &Reply::Credit { bytes: credit });
    run(agent, t);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transparent_tunnel() -> Arc<Tunnel> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        with_prefix(1, c, Some(b"CONNECT x:1 HTTP/1.1\r\n\r\n".to_vec()))
    }

    #[test]
    fn only_a_200_opens_a_transparent_tunnel_and_its_head_is_not_passed_on() {
        let t = transparent_tunnel();
        assert!(matches!(
            proxy_answer(&t, b"HTTP/1.1 200 OK\r\nda"),
            Answer::Waiting
        ));
        assert!(matches!(proxy_answer(&t, b"te: x\r\n"), Answer::Waiting));
        // The head ends in this chunk; the server's first bytes follow it.
        assert!(matches!(proxy_answer(&t, b"\r\nSSH-2.0"), Answer::Open(2)));
        assert!(lock(&t.st).head.is_none());
        assert!(matches!(proxy_answer(&t, b"more"), Answer::Open(0)));

        let t = transparent_tunnel();
        let refused = b"HTTP/1.1 403 Forbidden\r\nX-Runtime-Egress: port-not-allowed\r\n\r\nno";
        assert!(matches!(proxy_answer(&t, refused), Answer::Refused));
        let t = transparent_tunnel();
        assert!(matches!(
            proxy_answer(&t, &[b'x'; MAX_HEAD + 1]),
            Answer::Refused
        ));
        let t = transparent_tunnel();
        assert!(matches!(
            proxy_answer(&t, b"HTTP/1.1 2000 OK\r\n\r\n"),
            Answer::Refused
        ));
        // Other tunnels pass everything.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let plain = new_tunnel(2, TcpStream::connect(l.local_addr().unwrap()).unwrap());
        assert!(matches!(
            proxy_answer(&plain, b"HTTP/1.1 403 x\r\n\r\n"),
            Answer::Open(0)
        ));
    }

    #[test]
    fn targets_are_names_for_reserved_addresses_and_addresses_otherwise() {
        let name_of = |ip: Ipv4Addr| {
            (ip == Ipv4Addr::new(198, 18, 0, 7)).then(|| "db.example.com".to_string())
        };
        let t = |s: &str| connect_target(s.parse().unwrap(), name_of);
        assert_eq!(t("198.18.0.7:5432").as_deref(), Some("db.example.com:5432"));
        assert_eq!(
            t("198.18.0.8:5432"),
            None,
            "a reserved address with no name"
        );
        assert_eq!(t("93.184.215.14:80").as_deref(), Some("93.184.215.14:80"));
        assert_eq!(t("[2001:db8::1]:22").as_deref(), Some("[2001:db8::1]:22"));
        assert_eq!(
            t("[::ffff:198.18.0.7]:443").as_deref(),
            Some("db.example.com:443")
        );
        assert_eq!(t("127.0.0.1:80"), None);
        assert_eq!(t("[::1]:80"), None);
        assert_eq!(t("0.0.0.0:80"), None);
    }
}
