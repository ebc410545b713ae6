//! Outbound UDP for programs that ignore the proxy variables
//! (docs/network.md): the interface that carries the default routes is a
//! TUN device this module reads. TCP never reaches it (the nat rule sends
//! it to the transparent listener first); every other packet does.
//!
//! - A datagram to port 53 is a DNS query: the sandbox's resolver answers
//!   it here, whatever address it was sent to, so no query leaves.
//! - Any other datagram belongs to a flow (its source and destination):
//!   the flow's first datagram opens a `connect-udp` stream (RFC 9298) to
//!   the host's egress proxy through the agent's proxy port, and the
//!   flow's datagrams go both ways as capsules. The host judges the target
//!   by the sandbox's rules, as a connection's; one it refuses gets an ICMP
//!   "administratively prohibited" back, so a connected socket fails at
//!   once instead of waiting.
//! - Everything else (fragments, raw IP, TCP when root deleted the rule)
//!   is dropped, as the dummy interface did.
//!
//! Bounded: at most [`MAX_FLOWS`] flows (each two threads), each with a
//! queue of [`QUEUE`] datagrams (beyond it they are dropped, as a network
//! would) and ended after [`IDLE`] without a datagram either way.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sys::{log, log_limited, RateLimit};

/// Flows open at once; datagrams of new flows beyond it are dropped.
pub(crate) const MAX_FLOWS: usize = 128;
/// Datagrams waiting for a flow's stream.
const QUEUE: usize = 64;
/// A flow with no datagram either way for this long ends.
const IDLE: Duration = Duration::from_secs(60);
/// A refused flow drops its datagrams this long before it is asked again.
const REFUSED_FOR: Duration = Duration::from_secs(5);
/// The proxy has this long to answer a flow's request.
const ANSWER: Duration = Duration::from_secs(30);
const STACK: usize = 128 * 1024;
/// Most bytes of a UDP payload (and a capsule's).
const MAX_PAYLOAD: usize = 65_535;

static DROPPED: RateLimit = RateLimit::new(Duration::from_secs(10), 3);

/// A UDP datagram read from the device.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Datagram<'a> {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub payload: &'a [u8],
}

/// The UDP datagram in an IP packet; `None` for anything else (other
/// protocols, fragments, IPv6 extension headers, malformed lengths).
pub(crate) fn parse(p: &[u8]) -> Option<Datagram<'_>> {
    let (src, dst, udp) = match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < 20 || ihl < 20 || p[9] != 17 {
                return None;
            }
            let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
            // More fragments, or a fragment's offset: not reassembled.
            if total > p.len() || total < ihl || u16::from_be_bytes([p[6], p[7]]) & 0x3fff != 0 {
                return None;
            }
            let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
            let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
            (IpAddr::V4(src), IpAddr::V4(dst), &p[ihl..total])
        }
        6 => {
            if p.len() < 40 || p[6] != 17 {
                return None;
            }
            let len = usize::from(u16::from_be_bytes([p[4], p[5]]));
            if 40 + len > p.len() {
                return None;
            }
            let src: [u8; 16] = p[8..24].try_into().ok()?;
            let dst: [u8; 16] = p[24..40].try_into().ok()?;
            (
                IpAddr::V6(Ipv6Addr::from(src)),
                IpAddr::V6(Ipv6Addr::from(dst)),
                &p[40..40 + len],
            )
        }
        _ => return None,
    };
    if udp.len() < 8 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if len < 8 || len > udp.len() {
        return None;
    }
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let dport = u16::from_be_bytes([udp[2], udp[3]]);
    Some(Datagram {
        src: SocketAddr::new(src, sport),
        dst: SocketAddr::new(dst, dport),
        payload: &udp[8..len],
    })
}

/// The internet checksum of the bytes of `parts` taken as one.
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut odd: Option<u8> = None;
    for part in parts {
        for &b in *part {
            match odd.take() {
                Some(hi) => sum += u32::from(u16::from_be_bytes([hi, b])),
                None => odd = Some(b),
            }
        }
    }
    if let Some(hi) = odd {
        sum += u32::from(hi) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IP header from `src` to `dst` for `len` bytes of protocol `proto`,
/// and the pseudo-header its transport checksum covers.
fn ip_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Option<(Vec<u8>, Vec<u8>)> {
    let l16 = u16::try_from(len).ok()?;
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = u16::try_from(len + 20).ok()?;
            let mut h = vec![0x45, 0];
            h.extend_from_slice(&total.to_be_bytes());
            h.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = checksum(&[&h]);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            let mut pseudo = Vec::with_capacity(12);
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&l16.to_be_bytes());
            Some((h, pseudo))
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&l16.to_be_bytes());
            h.extend_from_slice(&[proto, 64]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let mut pseudo = Vec::with_capacity(40);
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&(len as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
            Some((h, pseudo))
        }
        _ => None,
    }
}

/// An IP packet carrying `payload` from `src` to `dst` over UDP.
pub(crate) fn build(src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Option<Vec<u8>> {
    let len = payload.len() + 8;
    let (mut p, pseudo) = ip_header(src.ip(), dst.ip(), 17, len)?;
    let mut udp = Vec::with_capacity(len);
    udp.extend_from_slice(&src.port().to_be_bytes());
    udp.extend_from_slice(&dst.port().to_be_bytes());
    udp.extend_from_slice(&(len as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    let c = match checksum(&[&pseudo, &udp, payload]) {
        0 => 0xffff,
        c => c,
    };
    udp[6..8].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&udp);
    p.extend_from_slice(payload);
    Some(p)
}

/// The ICMP "destination unreachable, administratively prohibited" answer
/// to the packet `orig` (its source gets it, from its destination).
pub(crate) fn prohibited(orig: &[u8]) -> Option<Vec<u8>> {
    let d = parse(orig)?;
    let (proto, head, quoted) = match d.src.ip() {
        // type 3 (unreachable), code 13 (administratively prohibited)
        IpAddr::V4(_) => (1, [3u8, 13], &orig[..orig.len().min(28)]),
        // ICMPv6 type 1 (unreachable), code 1 (administratively prohibited)
        IpAddr::V6(_) => (58, [1u8, 1], &orig[..orig.len().min(1232)]),
    };
    let len = 8 + quoted.len();
    let (mut p, pseudo) = ip_header(d.dst.ip(), d.src.ip(), proto, len)?;
    let mut icmp = vec![head[0], head[1], 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(quoted);
    let c = if proto == 1 {
        checksum(&[&icmp])
    } else {
        checksum(&[&pseudo, &icmp])
    };
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&icmp);
    Some(p)
}

/// The `connect-udp` path for a target the transparent rules would ask for
/// (`name:port`, `1.2.3.4:port`, `[v6]:port`).
pub(crate) fn request_path(target: &str) -> Option<String> {
    let (host, port) = target.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(format!(
        "/.well-known/masque/udp/{}/{port}/",
        host.replace(':', "%3A")
    ))
}

fn put_varint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x3f => out.push(v as u8),
        0x40..=0x3fff => out.extend_from_slice(&(v as u16 | 0x4000).to_be_bytes()),
        0x4000..=0x3fff_ffff => out.extend_from_slice(&(v as u32 | 0x8000_0000).to_be_bytes()),
        _ => out.extend_from_slice(&(v | 0xc000_0000_0000_0000).to_be_bytes()),
    }
}

fn read_varint(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b[..1])?;
    let len = 1usize << (b[0] >> 6);
    r.read_exact(&mut b[1..len])?;
    let mut v = u64::from(b[0] & 0x3f);
    for x in &b[1..len] {
        v = (v << 8) | u64::from(*x);
    }
    Ok(v)
}

/// A DATAGRAM capsule (type 0) of context 0 carrying `payload`.
pub(crate) fn capsule(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 6);
    put_varint(&mut out, 0);
    put_varint(&mut out, payload.len() as u64 + 1);
    out.push(0);
    out.extend_from_slice(payload);
    out
}

/// The next datagram's payload from a capsule stream, other capsules
/// skipped; `None` at its end.
pub(crate) fn read_capsule(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    loop {
        let ty = match read_varint(r) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = read_varint(r)?;
        if len > (MAX_PAYLOAD + 8) as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "capsule too long",
            ));
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body)?;
        let mut at = &body[..];
        if ty == 0 && read_varint(&mut at)? == 0 {
            return Ok(Some(at.to_vec()));
        }
    }
}

/// One flow as the reader sees it.
struct Flow {
    tx: SyncSender<Vec<u8>>,
    done: Arc<AtomicBool>,
}

/// Reads the device until it fails; answers DNS, feeds flows.
pub(crate) fn run(tun: File, proxy: SocketAddr) {
    let tun = Arc::new(tun);
    let mut flows: HashMap<(SocketAddr, SocketAddr), Flow> = HashMap::new();
    let mut buf = vec![0u8; MAX_PAYLOAD + 64];
    loop {
        let n = match (&*tun).read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log!("udp: cannot read the device: {e}");
                return;
            }
        };
        let packet = &buf[..n];
        let Some(d) = parse(packet) else {
            continue;
        };
        if d.dst.port() == 53 {
            if let Some(a) = crate::dns::answer_here(d.payload) {
                if let Some(p) = build(d.dst, d.src, &a) {
                    let _ = (&*tun).write(&p);
                }
            }
            continue;
        }
        let key = (d.src, d.dst);
        if let Some(f) = flows.get(&key) {
            match f.tx.try_send(d.payload.to_vec()) {
                Ok(()) => continue,
                Err(TrySendError::Full(_)) => continue,
                Err(TrySendError::Disconnected(_)) => {
                    flows.remove(&key);
                }
            }
        }
        if flows.len() >= MAX_FLOWS {
            flows.retain(|_, f| !f.done.load(Ordering::Relaxed));
            if flows.len() >= MAX_FLOWS {
                log_limited!(
                    DROPPED,
                    "udp: {MAX_FLOWS} flows open: dropping a new one's datagram"
                );
                continue;
            }
        }
        let Some(target) = crate::tunnel::connect_target(d.dst, crate::dns::name_of) else {
            continue;
        };
        let Some(path) = request_path(&target) else {
            continue;
        };
        let (tx, rx) = sync_channel(QUEUE);
        let done = Arc::new(AtomicBool::new(false));
        let _ = tx.try_send(d.payload.to_vec());
        let start = Start {
            path,
            src: d.src,
            dst: d.dst,
            first: packet[..packet.len().min(1280)].to_vec(),
            tun: tun.clone(),
            proxy,
            done: done.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("udp-flow".into())
            .stack_size(STACK)
            .spawn(move || flow(start, rx));
        if spawned.is_ok() {
            flows.insert(key, Flow { tx, done });
        }
    }
}

struct Start {
    path: String,
    src: SocketAddr,
    dst: SocketAddr,
    /// The first packet (its start), quoted in an ICMP answer.
    first: Vec<u8>,
    tun: Arc<File>,
    proxy: SocketAddr,
    done: Arc<AtomicBool>,
}

/// Opens the flow's stream to the proxy: `Ok(None)` when it refused.
fn open(s: &Start) -> io::Result<Option<TcpStream>> {
    let c = TcpStream::connect_timeout(&s.proxy, ANSWER)?;
    c.set_nodelay(true)?;
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: runtime.proxy\r\nConnection: Upgrade\r\n\
         Upgrade: connect-udp\r\nCapsule-Protocol: ?1\r\n\r\n",
        s.path
    );
    (&c).write_all(req.as_bytes())?;
    c.set_read_timeout(Some(ANSWER))?;
    // Byte by byte: what follows the head is the first capsule's.
    let mut head = Vec::new();
    let mut r = &c;
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        if r.read(&mut b)? == 0 || head.len() > 16 * 1024 {
            return Ok(None);
        }
        head.push(b[0]);
    }
    c.set_read_timeout(None)?;
    let ok = head.starts_with(b"HTTP/1.1 101 ") || head.starts_with(b"HTTP/1.0 101 ");
    Ok(ok.then_some(c))
}

fn flow(s: Start, rx: Receiver<Vec<u8>>) {
    let stream = match open(&s) {
        Ok(Some(c)) => c,
        refused => {
            if let Err(e) = refused {
                log_limited!(DROPPED, "udp: cannot reach the proxy: {e}");
            }
            if let Some(p) = prohibited(&s.first) {
                let _ = (&*s.tun).write(&p);
            }
            // Datagrams sent meanwhile are dropped; after a while the flow
            // is asked for again (the rules may have changed).
            let until = Instant::now() + REFUSED_FOR;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                if matches!(rx.recv_timeout(left), Err(RecvTimeoutError::Disconnected)) {
                    break;
                }
            }
            s.done.store(true, Ordering::Relaxed);
            return;
        }
    };
    let epoch = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let touch = {
        let last = last.clone();
        move || last.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed)
    };
    let reader = match stream.try_clone() {
        Ok(r) => r,
        Err(_) => {
            s.done.store(true, Ordering::Relaxed);
            return;
        }
    };
    let (tun, src, dst) = (s.tun.clone(), s.src, s.dst);
    let touch_down = touch.clone();
    let down = std::thread::Builder::new()
        .name("udp-down".into())
        .stack_size(STACK)
        .spawn(move || {
            let mut r = BufReader::with_capacity(MAX_PAYLOAD + 16, reader);
            while let Ok(Some(d)) = read_capsule(&mut r) {
                touch_down();
                if let Some(p) = build(dst, src, &d) {
                    let _ = (&*tun).write(&p);
                }
            }
        });
    let down_ended = || down.as_ref().map(|h| h.is_finished()).unwrap_or(true);
    let mut w = &stream;
    loop {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(d) => {
                touch();
                // A stream the host ended (a rule change) takes no more.
                if down_ended() || w.write_all(&capsule(&d)).is_err() {
                    break;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let quiet = epoch.elapsed().as_millis() as u64 - last.load(Ordering::Relaxed);
                if quiet >= IDLE.as_millis() as u64 || down_ended() {
                    break;
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    s.done.store(true, Ordering::Relaxed);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    if let Ok(h) = down {
        let _ = h.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn packets_built_parse_back_with_valid_checksums() {
        for (src, dst) in [
            (sa("198.18.0.1:40000"), sa("198.18.0.7:5353")),
            (sa("[2001:2::1]:40000"), sa("[2001:db8::7]:443")),
        ] {
            for payload in [&b""[..], b"x", b"hello world", &[0xffu8; 1001][..]] {
                let p = build(src, dst, payload).unwrap();
                let d = parse(&p).unwrap();
                assert_eq!((d.src, d.dst, d.payload), (src, dst, payload));
                // The UDP checksum over its pseudo-header sums to zero.
                let ip_len = if src.is_ipv4() { 20 } else { 40 };
                let (_, pseudo) = ip_header(src.ip(), dst.ip(), 17, p.len() - ip_len).unwrap();
                assert_eq!(checksum(&[&pseudo, &p[ip_len..]]), 0);
                if src.is_ipv4() {
                    assert_eq!(checksum(&[&p[..20]]), 0, "the IPv4 header's");
                }
            }
        }
        // Mixed families have no packet.
        assert!(build(sa("1.2.3.4:1"), sa("[::1]:1"), b"").is_none());
    }

    #[test]
    fn what_is_not_a_whole_datagram_is_not_parsed() {
        let p = build(sa("198.18.0.1:1000"), sa("203.0.113.9:4242"), b"data").unwrap();
        assert!(parse(&p[..p.len() - 1]).is_none(), "cut short");
        let mut frag = p.clone();
        frag[6] |= 0x20; // more fragments
        assert!(parse(&frag).is_none());
        let mut tcp = p.clone();
        tcp[9] = 6;
        assert!(parse(&tcp).is_none());
        let mut bad = p.clone();
        bad[24..26].copy_from_slice(&100u16.to_be_bytes()); // UDP length past the end
        assert!(parse(&bad).is_none());
        assert!(parse(&[]).is_none());
        assert!(parse(&[0x45; 19]).is_none());
    }

    #[test]
    fn a_refusal_answers_with_icmp_quoting_the_datagram() {
        let p = build(sa("198.18.0.1:1000"), sa("203.0.113.9:4242"), b"data").unwrap();
        let icmp = prohibited(&p).unwrap();
        assert_eq!(&icmp[12..16], &[203, 0, 113, 9], "from the destination");
        assert_eq!(&icmp[16..20], &[198, 18, 0, 1]);
        assert_eq!((icmp[9], icmp[20], icmp[21]), (1, 3, 13));
        assert_eq!(checksum(&[&icmp[20..]]), 0);
        assert_eq!(&icmp[28..], &p[..28]);
        let p6 = build(sa("[2001:2::1]:1000"), sa("[2001:db8::7]:53"), b"q").unwrap();
        let icmp6 = prohibited(&p6).unwrap();
        assert_eq!((icmp6[6], icmp6[40], icmp6[41]), (58, 1, 1));
        let (_, pseudo) = ip_header(
            sa("[2001:db8::7]:0").ip(),
            sa("[2001:2::1]:0").ip(),
            58,
            icmp6.len() - 40,
        )
        .unwrap();
        assert_eq!(checksum(&[&pseudo, &icmp6[40..]]), 0);
    }

    #[test]
    fn targets_become_connect_udp_paths() {
        assert_eq!(
            request_path("udp.example.com:5353").unwrap(),
            "/.well-known/masque/udp/udp.example.com/5353/"
        );
        assert_eq!(
            request_path("[2001:db8::7]:443").unwrap(),
            "/.well-known/masque/udp/2001%3Adb8%3A%3A7/443/"
        );
        assert_eq!(
            request_path("203.0.113.9:123").unwrap(),
            "/.well-known/masque/udp/203.0.113.9/123/"
        );
    }

    #[test]
    fn capsules_round_trip_and_others_are_skipped() {
        let mut s = capsule(b"one");
        s.extend_from_slice(&[0x2a, 2, b'x', b'y']);
        s.extend(capsule(&[9u8; 300]));
        let mut r = &s[..];
        assert_eq!(read_capsule(&mut r).unwrap().unwrap(), b"one");
        assert_eq!(read_capsule(&mut r).unwrap().unwrap(), vec![9u8; 300]);
        assert!(read_capsule(&mut r).unwrap().is_none());
    }
}
