//! Caps on what guests take from the host: upstream connections, across all
//! sandboxes and per sandbox, so that no sandbox (or all of them together)
//! can use up the host's file descriptors.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How often at most a refusal by a cap is logged (with the count since).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Which cap refused a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CapFull {
    /// Every sandbox's connections together.
    Host(usize),
    /// This sandbox's.
    Sandbox(usize),
}

impl std::fmt::Display for CapFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapFull::Host(n) => write!(
                f,
                "the host has {n} outbound connections open, the most it allows; try again later"
            ),
            CapFull::Sandbox(n) => write!(
                f,
                "this sandbox has {n} outbound connections open, the most a sandbox may; close some first"
            ),
        }
    }
}

/// A semaphore per sandbox, made on first use; an entry lives while one of
/// its permits does, so the map holds only sandboxes with something open.
pub(crate) struct PerSandbox {
    size: usize,
    map: Mutex<HashMap<String, Weak<Semaphore>>>,
}

impl PerSandbox {
    pub(crate) fn new(size: usize) -> Self {
        Self {
            size: size.clamp(1, Semaphore::MAX_PERMITS),
            map: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn get(&self, sandbox_id: &str) -> Arc<Semaphore> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map.get(sandbox_id).and_then(Weak::upgrade) {
            return s;
        }
        map.retain(|_, w| w.strong_count() > 0);
        let s = Arc::new(Semaphore::new(self.size));
        map.insert(sandbox_id.to_owned(), Arc::downgrade(&s));
        s
    }
}

/// One slot of each cap, held as long as the connection is open, and
/// where its bytes are counted.
pub(crate) struct ConnPermit {
    _host: OwnedSemaphorePermit,
    _sandbox: OwnedSemaphorePermit,
    traffic: Arc<Counters>,
    /// This sandbox's outbound bytes not yet taken ([`Limits::take_outbound`]).
    outbound: Arc<AtomicU64>,
}

impl ConnPermit {
    /// Bytes sent to the destination outside an [`Upstream`] (a UDP flow's
    /// datagrams): counted as the sandbox's outbound traffic.
    pub(crate) fn count_sent(&self, n: usize) {
        self.traffic.sent.fetch_add(n as u64, Ordering::Relaxed);
        self.outbound.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Bytes received from the destination outside an [`Upstream`].
    pub(crate) fn count_received(&self, n: usize) {
        self.traffic.received.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// What the proxy carried since it started, every sandbox together.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    opened: AtomicU64,
    refused: AtomicU64,
}

/// The proxy's totals since it started ([`crate::Egress::traffic`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traffic {
    /// Bytes written to destinations.
    pub sent_bytes: u64,
    /// Bytes read from destinations.
    pub received_bytes: u64,
    /// Upstream connections opened.
    pub connections: u64,
    /// Upstream connections open now.
    pub connections_open: u64,
    /// New connections refused by a cap.
    pub refused: u64,
}

/// The connection caps shared by every sandbox of a host.
pub(crate) struct Limits {
    host: Arc<Semaphore>,
    max_host: usize,
    sandboxes: PerSandbox,
    refused: AtomicU64,
    last_warn: Mutex<Option<Instant>>,
    traffic: Arc<Counters>,
    /// Bytes each sandbox sent to destinations since they were last taken,
    /// for the server's per-key outbound usage. An entry lives while a
    /// connection of its sandbox is open or it has bytes not yet taken, so
    /// the map holds at most one entry per sandbox that used the network
    /// since the last take.
    outbound: Mutex<HashMap<String, Arc<AtomicU64>>>,
}

impl Limits {
    pub(crate) fn new(max_host: usize, max_sandbox: usize) -> Self {
        let max_host = max_host.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            host: Arc::new(Semaphore::new(max_host)),
            max_host,
            sandboxes: PerSandbox::new(max_sandbox),
            refused: AtomicU64::new(0),
            last_warn: Mutex::new(None),
            traffic: Arc::default(),
            outbound: Mutex::new(HashMap::new()),
        }
    }

    fn outbound_of(&self, sandbox_id: &str) -> Arc<AtomicU64> {
        let mut map = self.outbound.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(sandbox_id.to_owned()).or_default())
    }

    /// The bytes each sandbox sent to destinations since the last call,
    /// zeroed as they are taken (sandboxes with none are left out). A
    /// sandbox with nothing open and nothing left to take is forgotten.
    pub(crate) fn take_outbound(&self) -> Vec<(String, u64)> {
        let mut map = self.outbound.lock().unwrap_or_else(|e| e.into_inner());
        let mut taken = Vec::new();
        map.retain(|id, n| {
            let bytes = n.swap(0, Ordering::Relaxed);
            if bytes > 0 {
                taken.push((id.clone(), bytes));
            }
            // Only the map holds it: no connection can add to it any more.
            Arc::strong_count(n) > 1
        });
        taken
    }

    /// A slot for one more connection of `sandbox_id`, or which cap is full.
    /// Never waits: a guest that opens too many is refused at once.
    pub(crate) fn connection(&self, sandbox_id: &str) -> Result<ConnPermit, CapFull> {
        let result = match self.sandboxes.get(sandbox_id).try_acquire_owned() {
            Err(_) => Err(CapFull::Sandbox(self.sandboxes.size())),
            Ok(s) => match self.host.clone().try_acquire_owned() {
                Ok(h) => Ok(ConnPermit {
                    _host: h,
                    _sandbox: s,
                    traffic: Arc::clone(&self.traffic),
                    outbound: self.outbound_of(sandbox_id),
                }),
                Err(_) => Err(CapFull::Host(self.max_host)),
            },
        };
        match &result {
            Ok(_) => self.traffic.opened.fetch_add(1, Ordering::Relaxed),
            Err(full) => {
                self.note_refusal(sandbox_id, *full);
                self.traffic.refused.fetch_add(1, Ordering::Relaxed)
            }
        };
        result
    }

    /// What was carried since the proxy started.
    pub(crate) fn traffic(&self) -> Traffic {
        let t = &self.traffic;
        Traffic {
            sent_bytes: t.sent.load(Ordering::Relaxed),
            received_bytes: t.received.load(Ordering::Relaxed),
            connections: t.opened.load(Ordering::Relaxed),
            connections_open: (self.max_host - self.host.available_permits()) as u64,
            refused: t.refused.load(Ordering::Relaxed),
        }
    }

    /// A guest can trigger this at will: logged at most every [`WARN_EVERY`].
    fn note_refusal(&self, sandbox_id: &str, full: CapFull) {
        let count = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last_warn.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return;
        }
        *last = Some(Instant::now());
        self.refused.store(0, Ordering::Relaxed);
        let cap = match full {
            CapFull::Host(_) => "host",
            CapFull::Sandbox(_) => "sandbox",
        };
        tracing::warn!(
            sandbox_id,
            cap,
            refused = count,
            "outbound connections refused by a cap"
        );
    }
}

/// An upstream connection and its slot in the caps, given back on drop;
/// the bytes either way of an outbound one are counted.
pub(crate) struct Upstream {
    stream: Stream,
    permit: Permit,
}

enum Stream {
    Tcp(TcpStream),
    /// A connection to the server's own API (`runtime.internal`).
    Api(DuplexStream),
}

enum Permit {
    Conn(ConnPermit),
    /// A slot of the sandbox's API cap: not outbound, not counted.
    Api(#[allow(dead_code)] OwnedSemaphorePermit),
}

impl Upstream {
    pub(crate) fn new(stream: TcpStream, permit: ConnPermit) -> Self {
        Self {
            stream: Stream::Tcp(stream),
            permit: Permit::Conn(permit),
        }
    }

    pub(crate) fn api(stream: DuplexStream, permit: OwnedSemaphorePermit) -> Self {
        Self {
            stream: Stream::Api(stream),
            permit: Permit::Api(permit),
        }
    }

    fn counters(&self) -> Option<&Counters> {
        match &self.permit {
            Permit::Conn(p) => Some(&p.traffic),
            Permit::Api(_) => None,
        }
    }

    fn sent(&self, r: &Poll<io::Result<usize>>) {
        if let (Poll::Ready(Ok(n)), Permit::Conn(p)) = (r, &self.permit) {
            p.traffic.sent.fetch_add(*n as u64, Ordering::Relaxed);
            p.outbound.fetch_add(*n as u64, Ordering::Relaxed);
        }
    }
}

impl Stream {
    fn pin(&mut self) -> Pin<&mut (dyn AsyncReadWrite + Send)> {
        match self {
            Stream::Tcp(s) => Pin::new(s),
            Stream::Api(s) => Pin::new(s),
        }
    }
}

trait AsyncReadWrite: AsyncRead + AsyncWrite + Unpin {}
impl<T: AsyncRead + AsyncWrite + Unpin> AsyncReadWrite for T {}

impl AsyncRead for Upstream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = self.stream.pin().poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some(c)) = (&r, self.counters()) {
            let n = buf.filled().len().saturating_sub(before);
            c.received.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }
}

impl AsyncWrite for Upstream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = self.stream.pin().poll_write(cx, buf);
        self.sent(&r);
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream.pin().poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream.pin().poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = self.stream.pin().poll_write_vectored(cx, bufs);
        self.sent(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        match &self.stream {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Api(s) => s.is_write_vectored(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sandbox_has_its_own_cap_under_the_hosts() {
        let l = Limits::new(3, 2);
        let a1 = l.connection("a").unwrap();
        let _a2 = l.connection("a").unwrap();
        assert_eq!(l.connection("a").err(), Some(CapFull::Sandbox(2)));
        let _b1 = l.connection("b").unwrap();
        assert_eq!(l.connection("b").err(), Some(CapFull::Host(3)));
        // A closed connection gives both slots back.
        drop(a1);
        let _b2 = l.connection("b").unwrap();
        assert_eq!(l.connection("c").err(), Some(CapFull::Host(3)));
    }

    #[test]
    fn a_sandbox_with_nothing_open_is_forgotten() {
        let l = Limits::new(10, 1);
        drop(l.connection("a").unwrap());
        let _b = l.connection("b").unwrap();
        let map = l.sandboxes.map.lock().unwrap();
        assert!(!map.contains_key("a"));
        assert!(map.contains_key("b"));
    }

    #[tokio::test]
    async fn bytes_connections_and_refusals_are_counted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let echo = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(b"hello, world").await.unwrap();
        });
        let l = Limits::new(4, 1);
        let permit = l.connection("a").unwrap();
        assert_eq!(l.connection("a").err(), Some(CapFull::Sandbox(1)));
        let mut up = Upstream::new(TcpStream::connect(addr).await.unwrap(), permit);
        up.write_all(b"hello").await.unwrap();
        let mut got = Vec::new();
        up.read_to_end(&mut got).await.unwrap();
        echo.await.unwrap();
        assert_eq!(got, b"hello, world");
        let t = l.traffic();
        assert_eq!((t.sent_bytes, t.received_bytes), (5, 12));
        assert_eq!((t.connections, t.connections_open, t.refused), (1, 1, 1));
        drop(up);
        assert_eq!(l.traffic().connections_open, 0);
    }

    #[tokio::test]
    async fn outbound_bytes_are_taken_per_sandbox_once() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sink = tokio::spawn(async move {
            for _ in 0..2 {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = Vec::new();
                s.read_to_end(&mut buf).await.unwrap();
            }
        });
        let l = Limits::new(4, 2);
        let mut a = Upstream::new(
            TcpStream::connect(addr).await.unwrap(),
            l.connection("a").unwrap(),
        );
        let mut b = Upstream::new(
            TcpStream::connect(addr).await.unwrap(),
            l.connection("b").unwrap(),
        );
        a.write_all(b"abc").await.unwrap();
        b.write_all(b"de").await.unwrap();
        let mut taken = l.take_outbound();
        taken.sort();
        assert_eq!(taken, vec![("a".to_string(), 3), ("b".to_string(), 2)]);
        // Taken once: nothing new, nothing again; open connections stay known.
        assert_eq!(l.take_outbound(), vec![]);
        assert_eq!(l.outbound.lock().unwrap().len(), 2);
        a.write_all(b"fgh").await.unwrap();
        a.shutdown().await.unwrap();
        drop(a);
        b.shutdown().await.unwrap();
        drop(b);
        // Closed, its last bytes are still taken, then it is forgotten.
        assert_eq!(l.take_outbound(), vec![("a".to_string(), 3)]);
        assert!(l.outbound.lock().unwrap().is_empty());
        sink.await.unwrap();
    }
}
