//! UDP through the proxy: HTTP/1.1 `connect-udp` (RFC 9298) with the
//! capsule protocol (RFC 9297). A guest asks
//! `GET /.well-known/masque/udp/{host}/{port}/` with `Upgrade: connect-udp`;
//! once the rules admit the target the answer is `101`, and each datagram
//! then travels either way as a DATAGRAM capsule (type 0, context 0). One
//! such stream is one flow to one destination: the host sends from a socket
//! connected to it, so only that destination's answers come back.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::rules::Host;

/// Where a `connect-udp` request's path starts.
pub(crate) const PATH_PREFIX: &str = "/.well-known/masque/udp/";
/// The capsule type of a datagram.
const DATAGRAM: u64 = 0;
/// The most a UDP payload can hold; a capsule longer than this and its
/// context id is a broken peer.
pub(crate) const MAX_PAYLOAD: usize = 65_535;

/// The target of a `connect-udp` path: `{host}/{port}/`, the host an IP
/// address (an IPv6 one with its colons as `%3A`) or a name.
pub(crate) fn parse_target(path: &str) -> Option<(Host, u16)> {
    let rest = path.strip_prefix(PATH_PREFIX)?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = rest.split_once('/')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let host = host.replace("%3A", ":").replace("%3a", ":");
    if host.is_empty() || host.contains(['%', '/', '[', ']']) {
        return None;
    }
    Some((Host::parse(&host), port))
}

/// A QUIC variable-length integer (RFC 9000, 16).
pub(crate) fn put_varint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x3f => out.push(v as u8),
        0x40..=0x3fff => out.extend_from_slice(&(v as u16 | 0x4000).to_be_bytes()),
        0x4000..=0x3fff_ffff => out.extend_from_slice(&(v as u32 | 0x8000_0000).to_be_bytes()),
        _ => out.extend_from_slice(&(v | 0xc000_0000_0000_0000).to_be_bytes()),
    }
}

async fn read_varint<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<u64> {
    let first = r.read_u8().await?;
    let len = 1usize << (first >> 6);
    let mut v = u64::from(first & 0x3f);
    for _ in 1..len {
        v = (v << 8) | u64::from(r.read_u8().await?);
    }
    Ok(v)
}

/// A DATAGRAM capsule carrying `payload` with context id 0.
pub(crate) fn datagram_capsule(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 6);
    put_varint(&mut out, DATAGRAM);
    put_varint(&mut out, payload.len() as u64 + 1);
    out.push(0);
    out.extend_from_slice(payload);
    out
}

/// The next datagram's payload; other capsule types and contexts are
/// skipped (RFC 9297, 3.2). `None` at the end of the stream.
pub(crate) async fn read_datagram<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    loop {
        let ty = match read_varint(r).await {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = read_varint(r).await?;
        if len > (MAX_PAYLOAD + 8) as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a capsule of {len} bytes"),
            ));
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body).await?;
        if ty != DATAGRAM {
            continue;
        }
        let mut at = &body[..];
        let ctx = read_varint(&mut at).await?;
        if ctx == 0 {
            return Ok(Some(at.to_vec()));
        }
    }
}

/// Writes one datagram as a capsule.
pub(crate) async fn write_datagram<W: AsyncWrite + Unpin>(
    w: &mut W,
    payload: &[u8],
) -> io::Result<()> {
    w.write_all(&datagram_capsule(payload)).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn targets_are_hosts_and_ports_with_ipv6_colons_escaped() {
        let t = |p: &str| parse_target(p).map(|(h, port)| (h.to_string(), port));
        assert_eq!(
            t("/.well-known/masque/udp/udp.example.com/5353/"),
            Some(("udp.example.com".into(), 5353))
        );
        assert_eq!(
            t("/.well-known/masque/udp/192.0.2.6/443/"),
            Some(("192.0.2.6".into(), 443))
        );
        assert_eq!(
            t("/.well-known/masque/udp/2001%3Adb8%3A%3A42/53/").map(|(_, p)| p),
            Some(53)
        );
        assert!(matches!(
            parse_target("/.well-known/masque/udp/2001%3Adb8%3A%3A42/53/"),
            Some((Host::Ip(ip), 53)) if ip.to_string() == "2001:db8::42"
        ));
        for bad in [
            "/.well-known/masque/udp/example.com/0/",
            "/.well-known/masque/udp/example.com/x/",
            "/.well-known/masque/udp//53/",
            "/.well-known/masque/udp/a%2Fb/53/",
            "/.well-known/masque/udp/example.com/",
            "/elsewhere/example.com/53/",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn capsules_carry_datagrams_and_skip_what_is_not_one() {
        let mut stream = Vec::new();
        stream.extend(datagram_capsule(b"one"));
        // An unknown capsule type, then a datagram of another context.
        put_varint(&mut stream, 0x2a);
        put_varint(&mut stream, 2);
        stream.extend_from_slice(b"xy");
        put_varint(&mut stream, 0);
        put_varint(&mut stream, 3);
        stream.extend_from_slice(&[2, b'n', b'o']);
        let big = vec![7u8; 20_000];
        stream.extend(datagram_capsule(&big));
        stream.extend(datagram_capsule(b""));
        let mut r = &stream[..];
        assert_eq!(read_datagram(&mut r).await.unwrap().unwrap(), b"one");
        assert_eq!(read_datagram(&mut r).await.unwrap().unwrap(), big);
        assert_eq!(read_datagram(&mut r).await.unwrap().unwrap(), b"");
        assert!(read_datagram(&mut r).await.unwrap().is_none());

        // Every length form of a varint reads back.
        for v in [0u64, 63, 64, 16_383, 16_384, 1 << 29, (1 << 30) + 5] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            assert_eq!(read_varint(&mut &b[..]).await.unwrap(), v);
        }
        // A capsule longer than any datagram ends the stream.
        let mut huge = Vec::new();
        put_varint(&mut huge, 0);
        put_varint(&mut huge, 1 << 20);
        assert!(read_datagram(&mut &huge[..]).await.is_err());
    }
}
