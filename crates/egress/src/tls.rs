//! TLS pieces: the crypto provider, the client configuration that verifies
//! destinations, and a bounded reader of a ClientHello's server name.

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::EgressError;

/// Most bytes read while waiting for a whole ClientHello.
pub(crate) const MAX_HELLO: usize = 64 * 1024;

/// Every TLS configuration here uses ring (no cmake or assembler toolchain).
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client side towards destinations: the system's roots plus `extra`.
pub(crate) fn client_config(
    extra: &[CertificateDer<'static>],
) -> Result<Arc<ClientConfig>, EgressError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for err in &native.errors {
        tracing::warn!(error = %err, "loading a system root certificate failed");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(added, ignored, "system root certificates");
    for cert in extra {
        if let Err(err) = roots.add(cert.clone()) {
            tracing::warn!(error = %err, "an extra root certificate was refused");
        }
    }
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(EgressError::Tls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// What the first bytes a client sent say.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Hello {
    /// Not a TLS handshake: the bytes go on as they are.
    NotTls,
    /// A whole ClientHello and the name it asks for, if any.
    Tls { sni: Option<String> },
    /// Looks like TLS but is not a ClientHello we can read.
    Malformed,
    /// The client closed before saying enough.
    Closed,
}

/// Reads from `io` into `buf` until the first bytes decide [`Hello`]. Never
/// reads more than [`MAX_HELLO`] bytes.
pub(crate) async fn read_hello<R: AsyncRead + Unpin>(io: &mut R, buf: &mut Vec<u8>) -> Hello {
    loop {
        match parse_hello(buf) {
            Parsed::Done(h) => return h,
            Parsed::More if buf.len() >= MAX_HELLO => return Hello::Malformed,
            Parsed::More => {}
        }
        let mut chunk = [0u8; 4096];
        let room = (MAX_HELLO - buf.len()).min(chunk.len());
        match io.read(&mut chunk[..room]).await {
            Ok(0) | Err(_) => return Hello::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

enum Parsed {
    Done(Hello),
    More,
}

fn parse_hello(buf: &[u8]) -> Parsed {
    let Some(&first) = buf.first() else {
        return Parsed::More;
    };
    if first != 0x16 {
        return Parsed::Done(Hello::NotTls);
    }
    // Gather the handshake bytes of every whole record so far.
    let mut handshake = Vec::new();
    let mut rest = buf;
    while rest.len() >= 5 {
        if rest[0] != 0x16 {
            return Parsed::Done(Hello::Malformed);
        }
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        if len == 0 || len > 16384 + 2048 {
            return Parsed::Done(Hello::Malformed);
        }
        let Some(body) = rest.get(5..5 + len) else {
            break;
        };
        handshake.extend_from_slice(body);
        rest = &rest[5 + len..];
    }
    if handshake.len() < 4 {
        return Parsed::More;
    }
    if handshake[0] != 1 {
        return Parsed::Done(Hello::Malformed);
    }
    let hs_len = (usize::from(handshake[1]) << 16)
        | (usize::from(handshake[2]) << 8)
        | usize::from(handshake[3]);
    if hs_len + 4 > MAX_HELLO {
        return Parsed::Done(Hello::Malformed);
    }
    match handshake.get(4..4 + hs_len) {
        None => Parsed::More,
        Some(body) => Parsed::Done(match client_hello_sni(body) {
            Some(sni) => Hello::Tls { sni },
            None => Hello::Malformed,
        }),
    }
}

/// A cursor that never reads past its slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(n)
    }
}

/// `Some(sni)` for a readable ClientHello body (`Some(None)`: no SNI).
fn client_hello_sni(body: &[u8]) -> Option<Option<String>> {
    let mut r = Reader(body);
    r.take(2)?; // legacy version
    r.take(32)?; // random
    r.vec8()?; // session id
    r.vec16()?; // cipher suites
    r.vec8()?; // compression methods
    if r.0.is_empty() {
        return Some(None); // no extensions at all
    }
    let mut exts = Reader(r.vec16()?);
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec16()?;
        if kind != 0 {
            continue;
        }
        let mut list = Reader(Reader(data).vec16()?);
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type == 0 {
                let name = std::str::from_utf8(name).ok()?;
                if name.is_empty() || !name.is_ascii() {
                    return None;
                }
                return Some(Some(name.trim_end_matches('.').to_ascii_lowercase()));
            }
        }
        return Some(None);
    }
    Some(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(sni: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let mut entry = vec![0u8];
            entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
            entry.extend_from_slice(name.as_bytes());
            let mut list = (entry.len() as u16).to_be_bytes().to_vec();
            list.extend_from_slice(&entry);
            exts.extend_from_slice(&[0, 0]);
            exts.extend_from_slice(&(list.len() as u16).to_be_bytes());
            exts.extend_from_slice(&list);
        }
        exts.extend_from_slice(&[0, 10, 0, 2, 0, 0x1d]); // another extension
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[tokio::test]
    async fn reads_sni_and_its_absence() {
        let bytes = hello(Some("API.Example.com"));
        let mut buf = Vec::new();
        let got = read_hello(&mut &bytes[..], &mut buf).await;
        assert_eq!(
            got,
            Hello::Tls {
                sni: Some("api.example.com".into())
            }
        );
        assert_eq!(buf, bytes);
        let bytes = hello(None);
        assert_eq!(
            read_hello(&mut &bytes[..], &mut Vec::new()).await,
            Hello::Tls { sni: None }
        );
        assert_eq!(
            read_hello(&mut &b"SSH-2.0-x\r\n"[..], &mut Vec::new()).await,
            Hello::NotTls
        );
    }

    #[test]
    fn partial_truncated_and_garbage_never_panic() {
        let bytes = hello(Some("a.example.org"));
        for cut in 0..bytes.len() {
            assert!(matches!(
                parse_hello(&bytes[..cut]),
                Parsed::More | Parsed::Done(Hello::Malformed)
            ));
        }
        // Every byte flipped in turn: some answer, never a panic.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xff;
            let _ = parse_hello(&b);
        }
        assert!(matches!(
            parse_hello(&[0x16, 3, 1, 0, 0]),
            Parsed::Done(Hello::Malformed)
        ));
    }
}
