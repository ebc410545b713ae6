//! Small stream helpers.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// A stream whose first reads return bytes already taken from it.
pub(crate) struct Prefixed<IO> {
    prefix: Vec<u8>,
    pos: usize,
    inner: IO,
}

impl<IO> Prefixed<IO> {
    pub(crate) fn new(prefix: Vec<u8>, inner: IO) -> Self {
        Self {
            prefix,
            pos: 0,
            inner,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos < this.prefix.len() {
            let rest = &this.prefix[this.pos..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            if this.pos == this.prefix.len() {
                this.prefix = Vec::new();
                this.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// When a stream last carried a byte, either way; read by [`idle`].
pub(crate) struct Activity {
    start: Instant,
    /// Milliseconds from `start` to the last byte.
    last_ms: AtomicU64,
    any: AtomicBool,
}

impl Activity {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            any: AtomicBool::new(false),
        })
    }

    pub(crate) fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
        self.any.store(true, Ordering::Relaxed);
    }

    fn last(&self) -> (Instant, bool) {
        let ms = self.last_ms.load(Ordering::Relaxed);
        (
            self.start + Duration::from_millis(ms),
            self.any.load(Ordering::Relaxed),
        )
    }
}

/// Resolves once the stream has been quiet too long: `first` before any
/// byte went either way, `idle` after. A tunnel selects on it, so an idle
/// one gives its socket back.
pub(crate) async fn idle(activity: &Activity, first: Duration, idle: Duration) -> &'static str {
    loop {
        let (last, any) = activity.last();
        let deadline = last + if any { idle } else { first };
        if Instant::now() >= deadline {
            return if any {
                "no bytes either way for the idle timeout"
            } else {
                "no first byte in time"
            };
        }
        // Before the first byte, one may come at any moment and move the
        // deadline to `idle` from then: wake by that too, to look again.
        let wake = if any {
            deadline
        } else {
            deadline.min(Instant::now() + idle)
        };
        tokio::time::sleep_until(wake).await;
    }
}

/// A reader that notes each byte read in an [`Activity`].
pub(crate) struct Watched<R> {
    inner: R,
    activity: Arc<Activity>,
}

impl<R> Watched<R> {
    pub(crate) fn new(inner: R, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Watched<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

/// The addresses that are this host, which no sandbox may reach: its
/// interfaces' (read again at most every [`OwnAddrs::REFRESH`], so
/// addresses that come later, IPv6 temporary ones for one, are refused
/// too) and the operator's (`deny_self`: a public address in front of the
/// host that no interface carries).
pub(crate) struct OwnAddrs {
    fixed: Vec<std::net::IpAddr>,
    now: std::sync::Mutex<(std::time::Instant, Vec<std::net::IpAddr>)>,
}

impl OwnAddrs {
    pub(crate) const REFRESH: std::time::Duration = std::time::Duration::from_secs(30);

    pub(crate) fn new(fixed: Vec<std::net::IpAddr>) -> Self {
        let now = Self::read(&fixed);
        Self {
            fixed,
            now: std::sync::Mutex::new((std::time::Instant::now(), now)),
        }
    }

    fn read(fixed: &[std::net::IpAddr]) -> Vec<std::net::IpAddr> {
        let mut all = interface_addrs();
        all.extend_from_slice(fixed);
        all
    }

    /// The list now (a copy: it is short).
    pub(crate) fn get(&self) -> Vec<std::net::IpAddr> {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if now.0.elapsed() >= Self::REFRESH {
            *now = (std::time::Instant::now(), Self::read(&self.fixed));
        }
        now.1.clone()
    }
}

/// The host's own interface addresses, which no sandbox may reach.
pub(crate) fn interface_addrs() -> Vec<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifap` with a list that is freed below, once.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until
        // freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: `ifa_addr` points to a sockaddr; its family says which.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `ifap` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn prefix_then_inner() {
        let mut p = Prefixed::new(b"ab".to_vec(), &b"cd"[..]);
        let mut s = String::new();
        p.read_to_string(&mut s).await.unwrap();
        assert_eq!(s, "abcd");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_waits_for_the_first_byte_then_for_quiet() {
        let a = Activity::new();
        let start = Instant::now();
        let first = Duration::from_secs(30);
        let quiet = Duration::from_secs(600);
        assert_eq!(idle(&a, first, quiet).await, "no first byte in time");
        assert_eq!(start.elapsed(), first);
        let mut r = Watched::new(&b"x"[..], a.clone());
        let mut b = [0u8; 1];
        r.read_exact(&mut b).await.unwrap();
        let touched = Instant::now();
        assert_eq!(
            idle(&a, first, quiet).await,
            "no bytes either way for the idle timeout"
        );
        assert_eq!(touched.elapsed(), quiet);
    }

    #[test]
    fn finds_loopback_interface() {
        assert!(interface_addrs().iter().any(|a| a.is_loopback()));
    }

    #[test]
    fn own_addresses_hold_the_interfaces_and_the_operators() {
        let public: std::net::IpAddr = "203.0.113.7".parse().unwrap();
        let own = OwnAddrs::new(vec![public]);
        let got = own.get();
        assert!(got.contains(&public), "{got:?}");
        assert!(got.iter().any(|a| a.is_loopback()), "{got:?}");
        // Read again once the refresh is due.
        own.now.lock().unwrap().0 -= OwnAddrs::REFRESH;
        own.now.lock().unwrap().1.clear();
        let again = own.get();
        assert!(
            again.contains(&public) && again.iter().any(|a| a.is_loopback()),
            "{again:?}"
        );
    }
}
