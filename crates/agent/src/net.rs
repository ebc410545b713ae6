//! Transparent egress set-up at boot (docs/network.md): an interface with
//! the default routes, so `connect()` to any address starts instead of
//! failing with `ENETUNREACH`, and an nftables rule that redirects every TCP
//! connection routed to it to the agent's transparent listener. The
//! interface is a TUN device the agent reads (`udp.rs`: UDP is carried to
//! the host's proxy, everything else dropped), or a dummy where the kernel
//! has no TUN. Whatever escapes the rule (rules deleted by root, raw
//! sockets) is dropped there.
//!
//! Both are written over netlink here, so the image needs no `nft` or `ip`
//! (registry images have neither).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::sys::cvt;

/// The interface that carries the default routes and drops what it gets.
pub(crate) const DUMMY: &str = "runtime0";
/// The dummy's own addresses (the source of redirected connections).
pub(crate) const DUMMY_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// In the IPv6 benchmarking range (RFC 5180), never routed on the internet.
pub(crate) const DUMMY_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
/// The nftables table the agent owns.
const TABLE: &str = "runtime";

// netlink
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;

// rtnetlink
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_F_NODAD: u8 = 0x02;
const RTA_OIF: u16 = 4;
const RTA_PREFSRC: u16 = 7;

// nfnetlink / nf_tables
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFPROTO_INET: u8 = 1;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NF_INET_PRE_ROUTING: u32 = 0;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_ACCEPT: u32 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_OIFNAME: u32 = 7;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
const NFT_REG_1: u32 = 1;
const NFTA_FIB_DREG: u16 = 1;
const NFTA_FIB_RESULT: u16 = 2;
const NFTA_FIB_FLAGS: u16 = 3;
const NFTA_FIB_F_DADDR: u32 = 1 << 1;
const NFT_FIB_RESULT_OIFNAME: u32 = 2;

/// A netlink message under construction: header, fixed part, attributes.
struct Msg {
    buf: Vec<u8>,
    /// Offsets of the nests still open.
    nests: Vec<usize>,
}

impl Msg {
    fn new(ty: u16, flags: u16, seq: u32, fixed: &[u8]) -> Msg {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&ty.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(fixed);
        pad(&mut buf);
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Msg {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        pad(&mut self.buf);
        self
    }

    fn str(&mut self, ty: u16, s: &str) -> &mut Msg {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v)
    }

    /// A big-endian u32, as nf_tables wants its numbers.
    fn be32(&mut self, ty: u16, v: u32) -> &mut Msg {
        self.attr(ty, &v.to_be_bytes())
    }

    fn begin(&mut self, ty: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    fn end(&mut self) -> &mut Msg {
        if let Some(at) = self.nests.pop() {
            let len = (self.buf.len() - at) as u16;
            self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// One nf_tables expression: `name` with the attributes `body` adds.
    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Msg)) -> &mut Msg {
        self.begin(NFTA_LIST_ELEM).str(NFTA_EXPR_NAME, name);
        self.begin(NFTA_EXPR_DATA);
        body(self);
        self.end().end()
    }

    fn cmp(&mut self, op: u32, value: &[u8]) -> &mut Msg {
        self.expr("cmp", |m| {
            m.be32(NFTA_CMP_SREG, NFT_REG_1).be32(NFTA_CMP_OP, op);
            m.begin(NFTA_CMP_DATA).attr(NFTA_DATA_VALUE, value).end();
        })
    }

    fn meta(&mut self, key: u32) -> &mut Msg {
        self.expr("meta", |m| {
            m.be32(NFTA_META_KEY, key).be32(NFTA_META_DREG, NFT_REG_1);
        })
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

fn pad(buf: &mut Vec<u8>) {
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

fn nl_socket(proto: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd =
        cvt(unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) })?;
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: 5,
        tv_usec: 0,
    };
    // SAFETY: a valid timeval on our socket.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    })?;
    Ok(fd)
}

/// Sends `msgs` as one datagram and waits for an ack of each sequence
/// number in `acks`; the first error the kernel reports is returned.
fn talk(proto: libc::c_int, msgs: &[Vec<u8>], acks: &[u32]) -> io::Result<()> {
    let fd = nl_socket(proto)?;
    let out: Vec<u8> = msgs.concat();
    // SAFETY: a zeroed sockaddr_nl is the kernel's address (pid 0).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sends our buffer to the kernel.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            out.as_ptr().cast(),
            out.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut pending: Vec<u32> = acks.to_vec();
    let mut buf = vec![0u8; 16 * 1024];
    while !pending.is_empty() {
        // SAFETY: reads into our buffer.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut rest = &buf[..n as usize];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let ty = u16::from_ne_bytes([rest[4], rest[5]]);
            let seq = u32::from_ne_bytes([rest[8], rest[9], rest[10], rest[11]]);
            if len < 16 || len > rest.len() {
                break;
            }
            if ty == NLMSG_ERROR && len >= 20 {
                let code = i32::from_ne_bytes([rest[16], rest[17], rest[18], rest[19]]);
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
                pending.retain(|s| *s != seq);
            }
            let step = (len + 3) & !3;
            rest = &rest[step.min(rest.len())..];
        }
    }
    Ok(())
}

fn nfgen(family: u8) -> [u8; 4] {
    let res = if family == 0 {
        NFNL_SUBSYS_NFTABLES.to_be_bytes()
    } else {
        [0, 0]
    };
    [family, 0, res[0], res[1]]
}

fn nft_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

/// An interface name as the kernel compares it: IFNAMSIZ bytes, NUL-padded.
fn ifname_bytes(ifname: &str) -> [u8; 16] {
    let mut name = [0u8; 16];
    let n = ifname.len().min(15);
    name[..n].copy_from_slice(&ifname.as_bytes()[..n]);
    name
}

/// One batch that makes the table, a nat chain on `hook` and its one rule,
/// `(match) meta l4proto tcp redirect to :port`.
fn nat_chain(chain: &str, hook: u32, port: u16, matches: impl FnOnce(&mut Msg)) -> io::Result<()> {
    let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
    let mut msgs = vec![Msg::new(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, &nfgen(0)).finish()];
    let mut m = Msg::new(nft_type(NFT_MSG_NEWTABLE), create, 2, &nfgen(NFPROTO_INET));
    m.str(NFTA_TABLE_NAME, TABLE);
    msgs.push(m.finish());
    let mut m = Msg::new(nft_type(NFT_MSG_NEWCHAIN), create, 3, &nfgen(NFPROTO_INET));
    m.str(NFTA_CHAIN_TABLE, TABLE).str(NFTA_CHAIN_NAME, chain);
    m.begin(NFTA_CHAIN_HOOK)
        .be32(NFTA_HOOK_HOOKNUM, hook)
        .be32(NFTA_HOOK_PRIORITY, (-100i32) as u32)
        .end();
    m.be32(NFTA_CHAIN_POLICY, NF_ACCEPT)
        .str(NFTA_CHAIN_TYPE, "nat");
    msgs.push(m.finish());
    let flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_APPEND | NLM_F_ACK;
    let mut m = Msg::new(nft_type(NFT_MSG_NEWRULE), flags, 4, &nfgen(NFPROTO_INET));
    m.str(NFTA_RULE_TABLE, TABLE).str(NFTA_RULE_CHAIN, chain);
    m.begin(NFTA_RULE_EXPRESSIONS);
    matches(&mut m);
    m.meta(NFT_META_L4PROTO)
        .cmp(NFT_CMP_EQ, &[libc::IPPROTO_TCP as u8]);
    m.expr("immediate", |m| {
        m.be32(NFTA_IMMEDIATE_DREG, NFT_REG_1);
        m.begin(NFTA_IMMEDIATE_DATA)
            .attr(NFTA_DATA_VALUE, &port.to_be_bytes())
            .end();
    });
    m.expr("redir", |m| {
        m.be32(NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
    });
    m.end();
    msgs.push(m.finish());
    msgs.push(Msg::new(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 5, &nfgen(0)).finish());
    talk(libc::NETLINK_NETFILTER, &msgs, &[2, 3, 4])
}

/// The nat rule: `table inet runtime { chain out { type nat hook output
/// priority -100; oifname "runtime0" meta l4proto tcp redirect to :port } }`:
/// every TCP connection the routes send to the dummy, that is to any
/// address that is neither the guest's own nor on another interface of it
/// (a bridge of containers inside).
pub(crate) fn redirect_tcp(port: u16, ifname: &str) -> io::Result<()> {
    let name = ifname_bytes(ifname);
    nat_chain("out", NF_INET_LOCAL_OUT, port, |m| {
        m.meta(NFT_META_OIFNAME).cmp(NFT_CMP_EQ, &name);
    })
}

/// The same for connections the guest forwards (containers on a bridge
/// inside, `sudo enable-docker`): `chain pre { type nat hook prerouting
/// priority -100; fib daddr oifname "runtime0" meta l4proto tcp redirect
/// to :port }`. The route lookup leaves alone what stays inside (one
/// container to another, to the guest's own addresses, published ports);
/// the redirect goes to the address of the interface the connection came
/// in on, so the listener takes every IPv4 address.
pub(crate) fn redirect_forwarded_tcp(port: u16, ifname: &str) -> io::Result<()> {
    let name = ifname_bytes(ifname);
    nat_chain("pre", NF_INET_PRE_ROUTING, port, |m| {
        m.expr("fib", |m| {
            m.be32(NFTA_FIB_DREG, NFT_REG_1)
                .be32(NFTA_FIB_RESULT, NFT_FIB_RESULT_OIFNAME)
                .be32(NFTA_FIB_FLAGS, NFTA_FIB_F_DADDR);
        });
        m.cmp(NFT_CMP_EQ, &name);
    })
}

fn ifindex(name: &str) -> io::Result<u32> {
    let c = crate::sys::cstring(name)?;
    // SAFETY: a valid C string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        i => Ok(i),
    }
}

/// The kernel makes a `dummy0` of its own at boot (numdummies=1): gone,
/// so the guest sees lo and ours only.
fn drop_kernel_dummy() {
    if ifindex("dummy0").is_ok() {
        let mut m = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, 9, &[0u8; 16]);
        m.str(IFLA_IFNAME, "dummy0");
        if let Err(e) = talk(libc::NETLINK_ROUTE, &[m.finish()], &[9]) {
            crate::sys::log!("cannot delete dummy0: {e}");
        }
    }
}

/// The dummy interface, up, with its addresses and the default routes
/// (IPv6 only when the kernel has it).
pub(crate) fn dummy_with_default_routes() -> io::Result<()> {
    drop_kernel_dummy();
    let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK;
    // ifinfomsg: family, pad, type, index, flags = IFF_UP, change = IFF_UP
    let mut ifi = vec![0u8; 16];
    ifi[8..12].copy_from_slice(&(libc::IFF_UP as u32).to_ne_bytes());
    ifi[12..16].copy_from_slice(&(libc::IFF_UP as u32).to_ne_bytes());
    let mut m = Msg::new(RTM_NEWLINK, create, 1, &ifi);
    m.str(IFLA_IFNAME, DUMMY);
    m.begin(IFLA_LINKINFO).str(IFLA_INFO_KIND, "dummy").end();
    talk(libc::NETLINK_ROUTE, &[m.finish()], &[1])?;
    addresses_and_routes()
}

/// `TUNSETIFF`, and the flags of a TUN device without packet information.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: i16 = 0x0001;
const IFF_NO_PI: i16 = 0x1000;

/// An `ifreq` naming `name`, with `value` in its union's first bytes.
fn ifreq(name: &str, value: &[u8]) -> [u8; 40] {
    let mut r = [0u8; 40];
    let n = name.len().min(15);
    r[..n].copy_from_slice(&name.as_bytes()[..n]);
    r[16..16 + value.len()].copy_from_slice(value);
    r
}

/// The same interface as a TUN device the agent holds (`udp.rs` reads
/// what is routed to it), up, with the largest MTU (so no datagram is
/// fragmented), its addresses and the default routes.
pub(crate) fn tun_with_default_routes() -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    drop_kernel_dummy();
    let path = "/dev/net/tun";
    if !std::path::Path::new(path).exists() {
        let _ = std::fs::create_dir_all("/dev/net");
        let c = crate::sys::cstring(path)?;
        // SAFETY: a valid C string; the misc device 10:200 is the TUN clone device.
        cvt(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(10, 200)) })?;
    }
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    let mut r = ifreq(DUMMY, &(IFF_TUN | IFF_NO_PI).to_ne_bytes());
    // SAFETY: a 40-byte ifreq for an ioctl that reads and writes one.
    cvt(unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, r.as_mut_ptr()) })?;
    // SAFETY: plain syscall; the fd is owned at once.
    let sock = unsafe {
        OwnedFd::from_raw_fd(cvt(libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            0,
        ))?)
    };
    let mut r = ifreq(DUMMY, &65_535i32.to_ne_bytes());
    // SAFETY: as above, on a socket.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFMTU, r.as_mut_ptr()) })?;
    let mut r = ifreq(DUMMY, &(libc::IFF_UP as i16).to_ne_bytes());
    // SAFETY: as above.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, r.as_mut_ptr()) })?;
    addresses_and_routes()?;
    Ok(tun)
}

/// The carrier's addresses and the default routes through it.
fn addresses_and_routes() -> io::Result<()> {
    let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK;
    let index = ifindex(DUMMY)?;
    let idx = index.to_ne_bytes();
    // ifaddrmsg: family, prefixlen, flags, scope, index
    let a4 = [
        libc::AF_INET as u8,
        32,
        0,
        0,
        idx[0],
        idx[1],
        idx[2],
        idx[3],
    ];
    let mut m = Msg::new(RTM_NEWADDR, create, 2, &a4);
    m.attr(IFA_LOCAL, &DUMMY_V4.octets())
        .attr(IFA_ADDRESS, &DUMMY_V4.octets());
    talk(libc::NETLINK_ROUTE, &[m.finish()], &[2])?;
    // rtmsg: family, dst_len, src_len, tos, table main, protocol boot,
    // scope link, type unicast, flags
    let r4 = [libc::AF_INET as u8, 0, 0, 0, 254, 3, 253, 1, 0, 0, 0, 0];
    let mut m = Msg::new(RTM_NEWROUTE, create, 3, &r4);
    m.attr(RTA_OIF, &idx).attr(RTA_PREFSRC, &DUMMY_V4.octets());
    talk(libc::NETLINK_ROUTE, &[m.finish()], &[3])?;
    if std::path::Path::new("/proc/net/if_inet6").exists() {
        let a6 = [
            libc::AF_INET6 as u8,
            128,
            IFA_F_NODAD,
            0,
            idx[0],
            idx[1],
            idx[2],
            idx[3],
        ];
        let mut m = Msg::new(RTM_NEWADDR, create, 4, &a6);
        m.attr(IFA_ADDRESS, &DUMMY_V6.octets());
        talk(libc::NETLINK_ROUTE, &[m.finish()], &[4])?;
        let r6 = [libc::AF_INET6 as u8, 0, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0];
        let mut m = Msg::new(RTM_NEWROUTE, create, 5, &r6);
        m.attr(RTA_OIF, &idx);
        talk(libc::NETLINK_ROUTE, &[m.finish()], &[5])?;
    }
    Ok(())
}

/// Whether the nat rule is in place (the transparent listener is needed).
pub(crate) static TRANSPARENT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// PID 1 at boot: the rule, the dummy and its routes, the resolver and
/// `/etc/resolv.conf`. Without the rule nothing else is set up: programs
/// that ignore the proxy variables then fail at once, as before.
pub(crate) fn setup() {
    let t = std::time::Instant::now();
    if let Err(e) = redirect_tcp(crate::tunnel::TRANSPARENT_PORT, DUMMY) {
        crate::sys::log!("transparent egress off: cannot add the nat rule: {e}");
        return;
    }
    TRANSPARENT.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Err(e) = redirect_forwarded_tcp(crate::tunnel::TRANSPARENT_PORT, DUMMY) {
        // An older kernel without nft's fib: the guest's own connections
        // are still carried; containers inside reach nothing over TCP.
        crate::sys::log!("containers' TCP not carried: cannot add the prerouting rule: {e}");
    }
    match tun_with_default_routes() {
        Ok(tun) => {
            let proxy = std::net::SocketAddr::from(([127, 0, 0, 1], runtime_proto::PROXY_PORT));
            let started = std::thread::Builder::new()
                .name("udp".into())
                .stack_size(256 * 1024)
                .spawn(move || crate::udp::run(tun, proxy));
            if let Err(e) = started {
                crate::sys::log!("outbound UDP off: {e}");
            }
        }
        Err(e) => {
            // An older kernel without TUN: the dummy drops what is routed to it.
            crate::sys::log!("outbound UDP off: no TUN device ({e}); {DUMMY} is a dummy");
            if let Err(e) = dummy_with_default_routes() {
                crate::sys::log!("cannot set up {DUMMY} and the default routes: {e}");
            }
        }
    }
    if crate::dns::start() {
        crate::dns::write_resolv_conf();
    }
    crate::sys::log!(
        "transparent egress set up in {} ms",
        t.elapsed().as_millis()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};

    /// Moves this thread (and the ones it starts) to a network namespace of
    /// its own with loopback up; false (skipped) where one cannot be made.
    fn own_netns() -> bool {
        // SAFETY: plain syscall; only this thread moves.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            eprintln!(
                "skipped: cannot make a network namespace: {}",
                io::Error::last_os_error()
            );
            return false;
        }
        crate::init::lo_up().unwrap();
        true
    }

    /// The rule and the dummy in a network namespace of this test's own
    /// thread (root only: skipped where a namespace cannot be made).
    #[test]
    fn the_rule_redirects_tcp_to_any_address_and_keeps_the_original() {
        if !own_netns() {
            return;
        }
        let port = 10901;
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        // Without a default route nothing starts: the dummy gives one.
        assert!(TcpStream::connect("203.0.113.9:4242").is_err());
        let ifname = match dummy_with_default_routes() {
            Ok(()) => DUMMY,
            // A host kernel without dummy interfaces: the route goes over lo.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                let ok = std::process::Command::new("ip")
                    .args(["route", "add", "default", "dev", "lo"])
                    .status()
                    .unwrap();
                assert!(ok.success());
                "lo"
            }
            Err(e) => panic!("dummy: {e}"),
        };
        redirect_tcp(port, ifname).unwrap();
        let mut c = TcpStream::connect("203.0.113.9:4242").unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let dst = crate::tunnel::original_dst(&s).unwrap();
        assert_eq!(dst, "203.0.113.9:4242".parse::<SocketAddr>().unwrap());
        c.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        // A connection to the listener itself was not redirected: its
        // original address is loopback, which asks the proxy for nothing.
        let _d = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (s2, _) = listener.accept().unwrap();
        let dst = crate::tunnel::original_dst(&s2).unwrap();
        assert_eq!(dst, SocketAddr::from(([127, 0, 0, 1], port)));
        assert_eq!(crate::tunnel::connect_target(dst, |_| None), None);
    }

    /// runtime0 as a TUN device with the default routes, or `None` (the
    /// test skipped) where this kernel has no TUN.
    fn tun_or_skip() -> Option<std::fs::File> {
        match tun_with_default_routes() {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("skipped: no TUN device here: {e}");
                None
            }
        }
    }

    fn ip(args: &[&str]) {
        let out = std::process::Command::new("ip")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
    }

    /// A container's connection (from another namespace over a veth pair,
    /// as from a bridge inside) to an address out there is redirected by
    /// the prerouting rule with its original address; one to the guest's
    /// own address on that link is not.
    #[test]
    fn the_prerouting_rule_redirects_forwarded_tcp_and_keeps_what_stays_inside() {
        if !own_netns() {
            return;
        }
        // runtime0 as the guest has it (nothing reads it here).
        let Some(_tun) = tun_or_skip() else {
            return;
        };
        let port = 10902;
        if let Err(e) = redirect_forwarded_tcp(port, DUMMY) {
            eprintln!("skipped: no nft fib in this kernel: {e}");
            return;
        }
        let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
        // The "container": a thread in a namespace of its own, at the
        // other end of a veth pair, routed through this one.
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let container = std::thread::spawn(move || {
            // SAFETY: plain syscalls; only this thread moves.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            go_rx.recv().unwrap();
            crate::init::lo_up().unwrap();
            ip(&["addr", "add", "10.99.0.2/24", "dev", "rtc0"]);
            ip(&["link", "set", "rtc0", "up"]);
            ip(&["route", "add", "default", "via", "10.99.0.1"]);
            // Without the rule nothing answers (this namespace forwards nothing).
            let to = "203.0.113.9:4242".parse().unwrap();
            let mut out = TcpStream::connect_timeout(&to, std::time::Duration::from_secs(5))
                .expect("redirected to the listener");
            out.write_all(b"out").unwrap();
            let mut inside = TcpStream::connect(("10.99.0.1", port)).unwrap();
            inside.write_all(b"in!").unwrap();
            (out, inside)
        });
        let tid = tid_rx.recv().unwrap().to_string();
        ip(&[
            "link", "add", "rth0", "type", "veth", "peer", "name", "rtc0",
        ]);
        ip(&["link", "set", "rtc0", "netns", &tid]);
        ip(&["addr", "add", "10.99.0.1/24", "dev", "rth0"]);
        ip(&["link", "set", "rth0", "up"]);
        go_tx.send(()).unwrap();
        // The container's end first: its failure is the test's.
        let _keep = container.join().unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        while let Ok((mut s, _)) = listener.accept() {
            s.set_nonblocking(false).unwrap();
            let mut buf = [0u8; 3];
            s.read_exact(&mut buf).unwrap();
            got.push((buf, crate::tunnel::original_dst(&s).unwrap()));
        }
        got.sort();
        assert_eq!(
            got,
            vec![
                (*b"in!", SocketAddr::from(([10, 99, 0, 1], port))),
                (*b"out", "203.0.113.9:4242".parse().unwrap()),
            ]
        );
    }

    /// A stand-in for the host's proxy: `connect-udp` to port 4242 answers
    /// 101 and echoes each datagram upper-cased; any other target, 403.
    fn udp_proxy() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                std::thread::spawn(move || {
                    let mut head = Vec::new();
                    let mut b = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        c.read_exact(&mut b).unwrap();
                        head.push(b[0]);
                    }
                    let head = String::from_utf8(head).unwrap();
                    if !head.starts_with("GET /.well-known/masque/udp/203.0.113.9/4242/ ") {
                        let _ = c.write_all(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n");
                        return;
                    }
                    c.write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: connect-udp\r\n\r\n",
                    )
                    .unwrap();
                    while let Ok(Some(d)) = crate::udp::read_capsule(&mut c) {
                        c.write_all(&crate::udp::capsule(&d.to_ascii_uppercase()))
                            .unwrap();
                    }
                });
            }
        });
        addr
    }

    #[test]
    fn udp_routed_to_the_tun_is_carried_answered_or_refused() {
        if !own_netns() {
            return;
        }
        let Some(tun) = tun_or_skip() else {
            return;
        };
        let proxy = udp_proxy();
        std::thread::spawn(move || crate::udp::run(tun, proxy));
        let wait = Some(std::time::Duration::from_secs(10));

        // A flow the proxy admits: both ways, from the address asked.
        let u = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        u.set_read_timeout(wait).unwrap();
        for word in [&b"ping"[..], b"again", &[b'z'; 30_000][..]] {
            u.send_to(word, "203.0.113.9:4242").unwrap();
            let mut buf = vec![0u8; 65_536];
            let (n, from) = u.recv_from(&mut buf).unwrap();
            assert_eq!(from, "203.0.113.9:4242".parse::<SocketAddr>().unwrap());
            assert_eq!(&buf[..n], &word.to_ascii_uppercase()[..]);
        }

        // A query to any resolver is answered here, with a reserved address.
        let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in ["udp", "example", "com"] {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        u.send_to(&q, "8.8.8.8:53").unwrap();
        let mut buf = [0u8; 512];
        let (n, from) = u.recv_from(&mut buf).unwrap();
        assert_eq!(from, "8.8.8.8:53".parse::<SocketAddr>().unwrap());
        assert_eq!(&buf[..2], &[0x12, 0x34]);
        let ip = Ipv4Addr::new(buf[n - 4], buf[n - 3], buf[n - 2], buf[n - 1]);
        assert!(crate::dns::in_range(ip), "{ip}");

        // A flow the proxy refuses: a connected socket hears it at once.
        let r = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        r.set_read_timeout(wait).unwrap();
        r.connect("203.0.113.9:5000").unwrap();
        r.send(b"refused").unwrap();
        let err = r.recv(&mut buf).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EHOSTUNREACH), "{err}");
    }
}
