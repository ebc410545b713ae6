//! The guest's resolver (docs/network.md): answers DNS on
//! `127.0.0.53:53` (UDP and TCP) by handing out an address of the reserved
//! range `198.18.0.0/15` for each name asked, and maps it back when a
//! program connects there. The host decides at connect time, so every name
//! gets an address and a change of the rules applies at once.
//!
//! `A` queries get the mapped address; every other type (`AAAA` included)
//! an empty answer, so clients use IPv4. The table holds at most
//! [`CAPACITY`] names, the least recently used one going first; a name
//! asked again keeps its address. Addresses are handed out in turn over the
//! whole range, so an address freed by eviction is not reused before the
//! rest of the range was.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::sys::{lock, log, log_limited, RateLimit};

/// Where the resolver listens; `/etc/resolv.conf` names it.
pub(crate) const RESOLVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 53);
/// The first address of the reserved range (RFC 2544's benchmarking block).
pub(crate) const RANGE_BASE: u32 = u32::from_be_bytes([198, 18, 0, 0]);
/// Addresses in the range: a /15.
pub(crate) const RANGE_SIZE: u32 = 1 << 17;
/// Names mapped at once.
pub(crate) const CAPACITY: usize = 8192;
/// The TTL of an answer: short, so a program asks again (and keeps its
/// name's mapping fresh) instead of holding an address for long.
const TTL: u32 = 60;
const TCP_CONNS: usize = 32;
const STACK: usize = 128 * 1024;

static REFUSED: RateLimit = RateLimit::new(Duration::from_secs(10), 3);

/// The name <-> address table.
pub(crate) struct Names {
    by_name: HashMap<String, (u32, u64)>,
    by_addr: HashMap<u32, String>,
    /// Use tick -> offset, oldest first.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    /// The next offset to try.
    next: u32,
    capacity: usize,
}

impl Names {
    pub(crate) fn new(capacity: usize) -> Names {
        Names {
            by_name: HashMap::new(),
            by_addr: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            next: 2,
            capacity: capacity.clamp(1, (RANGE_SIZE - 3) as usize),
        }
    }

    fn touch(&mut self, name: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((offset, used)) = self.by_name.get_mut(name) {
            self.lru.remove(used);
            *used = tick;
            self.lru.insert(tick, *offset);
        }
    }

    /// The address of `name` (lowercase), mapping it if new.
    pub(crate) fn address(&mut self, name: &str) -> Ipv4Addr {
        if let Some(&(offset, _)) = self.by_name.get(name) {
            self.touch(name);
            return Ipv4Addr::from(RANGE_BASE + offset);
        }
        while self.by_name.len() >= self.capacity {
            let Some((_, offset)) = self.lru.pop_first() else {
                break;
            };
            if let Some(old) = self.by_addr.remove(&offset) {
                self.by_name.remove(&old);
            }
        }
        // Offsets 0 (the network) and 1 (the dummy's own address) and the
        // last one are never handed out.
        let offset = loop {
            let o = self.next;
            self.next = if o + 1 >= RANGE_SIZE - 1 { 2 } else { o + 1 };
            if !self.by_addr.contains_key(&o) {
                break o;
            }
        };
        self.tick += 1;
        self.by_name.insert(name.to_string(), (offset, self.tick));
        self.by_addr.insert(offset, name.to_string());
        self.lru.insert(self.tick, offset);
        Ipv4Addr::from(RANGE_BASE + offset)
    }

    /// The name mapped to `ip`, if any (a connection counts as a use).
    pub(crate) fn name(&mut self, ip: Ipv4Addr) -> Option<String> {
        let offset = u32::from(ip).checked_sub(RANGE_BASE)?;
        let name = self.by_addr.get(&offset)?.clone();
        self.touch(&name);
        Some(name)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }
}

pub(crate) fn in_range(ip: Ipv4Addr) -> bool {
    u32::from(ip).wrapping_sub(RANGE_BASE) < RANGE_SIZE
}

fn table() -> &'static Mutex<Names> {
    static T: OnceLock<Mutex<Names>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(Names::new(CAPACITY)))
}

/// The answer to a query that came by another way than the listeners
/// (a datagram to any address's port 53, `udp.rs`).
pub(crate) fn answer_here(q: &[u8]) -> Option<Vec<u8>> {
    answer(q, table())
}

/// The name behind a reserved address.
pub(crate) fn name_of(ip: Ipv4Addr) -> Option<String> {
    lock(table()).name(ip)
}

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
const RCODE_FORMERR: u8 = 1;
const RCODE_NXDOMAIN: u8 = 3;
const RCODE_NOTIMP: u8 = 4;

/// The question of a query: its name (lowercase, no trailing dot), type,
/// class, and where it ends in the message.
fn question(q: &[u8]) -> Option<(String, u16, u16, usize)> {
    let mut at = 12;
    let mut name = String::new();
    loop {
        let len = *q.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        // No compression in a question; labels of 63 bytes at most.
        if len > 63 {
            return None;
        }
        let label = q.get(at..at + len)?;
        at += len;
        if !name.is_empty() {
            name.push('.');
        }
        for &b in label {
            name.push(b.to_ascii_lowercase() as char);
        }
        if name.len() > 253 {
            return None;
        }
    }
    let ty = u16::from_be_bytes([*q.get(at)?, *q.get(at + 1)?]);
    let class = u16::from_be_bytes([*q.get(at + 2)?, *q.get(at + 3)?]);
    Some((name, ty, class, at + 4))
}

/// A name the proxy could be asked for: letters, digits, `-` and `_` in
/// dot-separated labels.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The answer to one query, or `None` for something that is not a query.
pub(crate) fn answer(q: &[u8], names: &Mutex<Names>) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 {
        return None; // too short, or an answer itself
    }
    let head = |rcode: u8, qd: u16, an: u16| {
        let mut h = vec![
            q[0],
            q[1],
            0x80 | (q[2] & 0x79), // QR, the opcode, RD
            0x80 | rcode,         // RA
        ];
        h.extend_from_slice(&qd.to_be_bytes());
        h.extend_from_slice(&an.to_be_bytes());
        h.extend_from_slice(&[0, 0, 0, 0]);
        h
    };
    let opcode = (q[2] >> 3) & 0x0f;
    if opcode != 0 {
        return Some(head(RCODE_NOTIMP, 0, 0));
    }
    if u16::from_be_bytes([q[4], q[5]]) != 1 {
        return Some(head(RCODE_FORMERR, 0, 0));
    }
    let Some((name, ty, class, end)) = question(q) else {
        return Some(head(RCODE_FORMERR, 0, 0));
    };
    let the_question = &q[12..end];
    if !valid_name(&name) {
        let mut out = head(RCODE_NXDOMAIN, 1, 0);
        out.extend_from_slice(the_question);
        return Some(out);
    }
    if ty != TYPE_A || class != CLASS_IN {
        // No data of that type: AAAA included, so clients fall back to A.
        let mut out = head(0, 1, 0);
        out.extend_from_slice(the_question);
        return Some(out);
    }
    let ip = lock(names).address(&name);
    let mut out = head(0, 1, 1);
    out.extend_from_slice(the_question);
    out.extend_from_slice(&[0xc0, 12]); // the name: a pointer to the question's
    out.extend_from_slice(&TYPE_A.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out.extend_from_slice(&TTL.to_be_bytes());
    out.extend_from_slice(&4u16.to_be_bytes());
    out.extend_from_slice(&ip.octets());
    Some(out)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> bool {
    match std::thread::Builder::new()
        .name(name.into())
        .stack_size(STACK)
        .spawn(f)
    {
        Ok(_) => true,
        Err(e) => {
            log!("cannot start {name}: {e}");
            false
        }
    }
}

fn serve_tcp(mut s: TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    loop {
        let mut len = [0u8; 2];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let mut q = vec![0u8; u16::from_be_bytes(len) as usize];
        if s.read_exact(&mut q).is_err() {
            return;
        }
        let Some(a) = answer(&q, table()) else {
            return;
        };
        let mut out = (a.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&a);
        if s.write_all(&out).is_err() {
            return;
        }
    }
}

/// Starts the resolver's UDP and TCP listeners.
pub(crate) fn start() -> bool {
    let addr = SocketAddr::from((RESOLVER, 53));
    let udp = match UdpSocket::bind(addr) {
        Ok(u) => u,
        Err(e) => {
            log!("cannot listen for DNS on {addr}/udp: {e}");
            return false;
        }
    };
    let tcp = match TcpListener::bind(addr) {
        Ok(t) => t,
        Err(e) => {
            log!("cannot listen for DNS on {addr}/tcp: {e}");
            return false;
        }
    };
    let udp_ok = spawn("dns-udp", move || {
        let mut buf = vec![0u8; 4096];
        loop {
            match udp.recv_from(&mut buf) {
                Ok((n, from)) => {
                    if let Some(a) = answer(&buf[..n], table()) {
                        let _ = udp.send_to(&a, from);
                    }
                }
                Err(e) => {
                    log_limited!(REFUSED, "dns recv: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    });
    static OPEN: AtomicUsize = AtomicUsize::new(0);
    let tcp_ok = spawn("dns-tcp", move || loop {
        match tcp.accept() {
            Ok((s, _)) => {
                if OPEN.fetch_add(1, Ordering::SeqCst) >= TCP_CONNS {
                    OPEN.fetch_sub(1, Ordering::SeqCst);
                    log_limited!(
                        REFUSED,
                        "{TCP_CONNS} DNS connections open: refusing another"
                    );
                    continue;
                }
                if !spawn("dns-conn", move || {
                    serve_tcp(s);
                    OPEN.fetch_sub(1, Ordering::SeqCst);
                }) {
                    OPEN.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e) => {
                log_limited!(REFUSED, "dns accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    });
    udp_ok && tcp_ok
}

/// Points `/etc/resolv.conf` at the resolver (a regular file, replacing a
/// link or another server).
pub(crate) fn write_resolv_conf() {
    let want = format!(
        "# written by the sandbox agent at boot: names resolve inside the sandbox\nnameserver {RESOLVER}\n"
    );
    let path = std::path::Path::new("/etc/resolv.conf");
    let is_file = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file());
    if is_file && std::fs::read_to_string(path).is_ok_and(|s| s == want) {
        return;
    }
    let _ = std::fs::remove_file(path);
    if let Err(e) = std::fs::write(path, want) {
        log!("cannot write /etc/resolv.conf: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(id: u16, name: &str, ty: u16) -> Vec<u8> {
        let mut q = id.to_be_bytes().to_vec();
        q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&ty.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        q
    }

    fn a_of(answer: &[u8]) -> Option<Ipv4Addr> {
        if u16::from_be_bytes([answer[6], answer[7]]) != 1 {
            return None;
        }
        let ip = &answer[answer.len() - 4..];
        Some(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
    }

    #[test]
    fn a_names_get_reserved_addresses_that_map_back() {
        let names = Mutex::new(Names::new(16));
        let a = answer(&query(7, "Db.Example.COM", TYPE_A), &names).unwrap();
        assert_eq!(&a[..2], &7u16.to_be_bytes());
        assert_eq!(a[3] & 0x0f, 0, "rcode");
        let ip = a_of(&a).unwrap();
        assert!(in_range(ip), "{ip}");
        assert_ne!(ip, Ipv4Addr::new(198, 18, 0, 1), "the dummy's own address");
        assert_eq!(
            lock(&names).name(ip).as_deref(),
            Some("db.example.com"),
            "lowercased"
        );
        // The same name keeps its address; another gets another.
        let again = a_of(&answer(&query(8, "db.example.com", TYPE_A), &names).unwrap());
        assert_eq!(again, Some(ip));
        let other = a_of(&answer(&query(9, "x.example.org", TYPE_A), &names).unwrap()).unwrap();
        assert_ne!(other, ip);
        assert_eq!(lock(&names).name(Ipv4Addr::new(198, 19, 255, 200)), None);
        assert_eq!(lock(&names).name(Ipv4Addr::new(8, 8, 8, 8)), None);
    }

    #[test]
    fn aaaa_and_other_types_are_empty_and_bad_names_do_not_exist() {
        let names = Mutex::new(Names::new(16));
        let a = answer(&query(1, "example.com", 28), &names).unwrap();
        assert_eq!((a[3] & 0x0f, a_of(&a)), (0, None));
        assert_eq!(lock(&names).len(), 0, "AAAA maps nothing");
        let a = answer(&query(2, "bad name.com", TYPE_A), &names).unwrap();
        assert_eq!(a[3] & 0x0f, RCODE_NXDOMAIN);
        assert!(answer(&[1, 2, 3], &names).is_none());
        let mut truncated = query(3, "example.com", TYPE_A);
        truncated.truncate(20);
        assert_eq!(answer(&truncated, &names).unwrap()[3] & 0x0f, RCODE_FORMERR);
    }

    #[test]
    fn the_table_is_bounded_and_drops_the_least_recently_used() {
        let mut t = Names::new(3);
        let a = t.address("a");
        let b = t.address("b");
        let c = t.address("c");
        assert_eq!(t.name(a).as_deref(), Some("a")); // a used again: b is oldest
        let d = t.address("d");
        assert_eq!(t.len(), 3);
        assert_eq!(t.name(b), None, "b was evicted");
        assert_eq!(t.name(c).as_deref(), Some("c"));
        assert_eq!(t.name(d).as_deref(), Some("d"));
        assert_ne!(d, b, "a freed address is not reused at once");
        for i in 0..10_000 {
            t.address(&format!("n{i}"));
        }
        assert_eq!(t.len(), 3);
        assert!(t.by_addr.len() == 3 && t.lru.len() == 3);
    }

    #[test]
    fn addresses_wrap_around_the_range_skipping_those_in_use() {
        let mut t = Names::new(2);
        t.next = RANGE_SIZE - 3;
        let keep = t.address("keep");
        assert_eq!(u32::from(keep) - RANGE_BASE, RANGE_SIZE - 3);
        let x = t.address("x");
        assert_eq!(u32::from(x) - RANGE_BASE, RANGE_SIZE - 2);
        let y = t.address("y"); // wraps; never the last address nor 0 or 1
        assert_eq!(u32::from(y) - RANGE_BASE, 2);
    }
}
