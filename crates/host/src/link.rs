//! The host end of the agent channel: one Unix socket (QEMU's chardev for the
//! virtio-serial port), multiplexed into streams. A reader task routes frames
//! to the stream that asked; a writer task owns the socket's write half.
//!
//! The write queue to the guest is bounded in bytes for data frames
//! ([`QUEUE_BYTES`]): a writer of file bytes, stdin, tunnel or share bytes
//! awaits room until the writer task has put earlier frames on the socket.
//! Control frames (requests, credits, resets, `EndWrite`) never wait, so the
//! frames that let the guest (and so the queue) move on are never stuck
//! behind data.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use runtime_proto::{
    channel, encode, Decoder, Frame, Kind, Reply, Request, GUEST_STREAM, MAX_PAYLOAD, VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// What the link's write queue holds at most of data frames (their encoded
/// bytes); a data writer awaits room beyond it.
pub(crate) const QUEUE_BYTES: usize = 8 << 20;

/// One encoded frame on its way to the writer task, with the room it
/// takes in the queue (data frames), given back once it is written.
struct Queued {
    buf: Vec<u8>,
    _room: Option<OwnedSemaphorePermit>,
}

/// What a stream receives from the guest.
#[derive(Debug)]
pub(crate) enum Incoming {
    Reply(Reply),
    Data { channel: u8, bytes: Vec<u8> },
}

type Routes = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Incoming>>>>;

/// Takes the streams the guest opens ([`Reply::Outbound`]); called on the
/// link's reader task, so it must not block. Without one they are refused.
pub(crate) type Acceptor = Arc<dyn Fn(Stream) + Send + Sync>;

/// Frames for streams nobody has opened on this connection yet: after a
/// restore or a restart the agent goes on sending on streams of the earlier
/// connection before the host takes them up again ([`Link::open_at`]).
#[derive(Default)]
struct Orphans {
    /// Per stream, each frame with what it costs.
    frames: HashMap<u32, Vec<(usize, Incoming)>>,
    bytes: usize,
}

/// What is kept for streams not taken up (the oldest beyond it is dropped).
const ORPHAN_BYTES: usize = 4 << 20;
/// At most one warning about a guest's undecodable bytes per this long.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What an orphan frame costs beyond its payload (its place in the map).
const ORPHAN_OVERHEAD: usize = 128;

/// Tunnels that ended on this connection: frames that cross their end (a
/// last credit, a reset) are dropped, not kept as orphans.
#[derive(Default)]
struct Ended {
    set: std::collections::HashSet<u32>,
    order: std::collections::VecDeque<u32>,
}

/// How many ended tunnels are remembered.
const ENDED_KEPT: usize = 4096;

impl Ended {
    fn add(&mut self, id: u32) {
        if self.set.insert(id) {
            self.order.push_back(id);
            if self.order.len() > ENDED_KEPT {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

impl Orphans {
    /// Keeps `inc`, which came in a frame of `payload` bytes: each frame
    /// costs its size plus a fixed overhead (an empty one too), so what a
    /// guest sends on streams nobody opened is bounded by what it holds.
    fn push(&mut self, stream: u32, inc: Incoming, payload: usize) {
        let cost = ORPHAN_OVERHEAD + payload;
        if cost > ORPHAN_BYTES {
            return;
        }
        while self.bytes + cost > ORPHAN_BYTES {
            let Some(&victim) = self.frames.keys().next() else {
                break;
            };
            if let Some(list) = self.frames.remove(&victim) {
                self.bytes -= list.iter().map(|(c, _)| c).sum::<usize>();
            }
        }
        self.bytes += cost;
        self.frames.entry(stream).or_default().push((cost, inc));
    }

    fn take(&mut self, stream: u32) -> Vec<Incoming> {
        let list = self.frames.remove(&stream).unwrap_or_default();
        self.bytes -= list.iter().map(|(c, _)| c).sum::<usize>();
        list.into_iter().map(|(_, i)| i).collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    #[error("the link is closed")]
    Closed,
    #[error("connecting to the agent socket failed")]
    Connect(#[source] std::io::Error),
    #[error("the agent did not answer the handshake in time")]
    HandshakeTimeout,
    #[error("the request could not be encoded")]
    Encode(#[source] runtime_proto::ProtoError),
}

/// A live link to one agent. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Link {
    writer: mpsc::UnboundedSender<Queued>,
    /// Room in the write queue for data frames, in bytes ([`QUEUE_BYTES`]).
    room: Arc<Semaphore>,
    routes: Routes,
    orphans: Arc<Mutex<Orphans>>,
    next: Arc<AtomicU32>,
    closed: tokio_util::sync::CancellationToken,
    /// Names this connection to the agent (`Hello`): tunnels live as long
    /// as it does.
    session: u64,
    ended: Arc<Mutex<Ended>>,
    /// The protocol version the agent answered `Hello` with (0 before).
    peer: Arc<AtomicU32>,
}

/// One open stream: send requests and data on it, receive what the guest says.
pub(crate) struct Stream {
    pub id: u32,
    link: Link,
    pub rx: mpsc::UnboundedReceiver<Incoming>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(mut routes) = self.link.routes.lock() {
            routes.remove(&self.id);
        }
    }
}

impl Stream {
    /// This stream (a tunnel) is finished: what the guest still sends on it
    /// is dropped.
    pub(crate) fn ended(&self) {
        if let Ok(mut e) = self.link.ended.lock() {
            e.add(self.id);
        }
    }

    pub(crate) fn send(&self, req: &Request) -> Result<(), LinkError> {
        self.sender().send(req)
    }

    pub(crate) async fn send_data(&self, bytes: &[u8]) -> Result<(), LinkError> {
        self.sender().send_data(bytes).await
    }

    /// The next reply, skipping nothing; `None` if the link closed.
    pub(crate) async fn recv(&mut self) -> Option<Incoming> {
        self.rx.recv().await
    }

    /// The next control reply (data frames are not expected here).
    pub(crate) async fn reply(&mut self) -> Result<Reply, LinkError> {
        loop {
            match self.rx.recv().await {
                Some(Incoming::Reply(r)) => return Ok(r),
                Some(Incoming::Data { .. }) => continue,
                None => return Err(LinkError::Closed),
            }
        }
    }

    /// A handle that can send on this stream from another task.
    pub(crate) fn sender(&self) -> StreamSender {
        StreamSender {
            id: self.id,
            link: self.link.clone(),
        }
    }
}

#[derive(Clone)]
pub(crate) struct StreamSender {
    id: u32,
    link: Link,
}

impl StreamSender {
    /// As [`Stream::ended`].
    pub(crate) fn ended(&self) {
        if let Ok(mut e) = self.link.ended.lock() {
            e.add(self.id);
        }
    }

    pub(crate) fn send(&self, req: &Request) -> Result<(), LinkError> {
        self.link
            .send_frame(Frame::control(self.id, req).map_err(LinkError::Encode)?)
    }
    /// Data on this stream's INPUT channel, in frames; awaits room in the
    /// link's write queue ([`QUEUE_BYTES`]) for each.
    pub(crate) async fn send_data(&self, bytes: &[u8]) -> Result<(), LinkError> {
        if bytes.is_empty() {
            return self.link.send_data_frame(self.id, &[]).await;
        }
        for piece in bytes.chunks(MAX_PAYLOAD) {
            self.link.send_data_frame(self.id, piece).await?;
        }
        Ok(())
    }
}

impl Link {
    /// The protocol version the agent speaks (its `Hello`).
    pub(crate) fn peer_version(&self) -> u32 {
        self.peer.load(Ordering::Relaxed)
    }

    /// Connects to the agent socket and completes the handshake, resending
    /// Hello until it is answered: the first frames after a (re)connect can be
    /// lost on virtio-serial.
    pub(crate) async fn connect(
        sock: &Path,
        timeout: Duration,
        acceptor: Option<Acceptor>,
    ) -> Result<(Link, Reply), LinkError> {
        let stream = UnixStream::connect(sock)
            .await
            .map_err(LinkError::Connect)?;
        Link::over(stream, timeout, acceptor).await
    }

    /// The handshake on a socket already connected (a restore connects
    /// before the vCPUs run, so the agent never writes to nobody).
    pub(crate) async fn over(
        stream: UnixStream,
        timeout: Duration,
        acceptor: Option<Acceptor>,
    ) -> Result<(Link, Reply), LinkError> {
        let (mut rd, mut wr) = stream.into_split();
        let routes: Routes = Arc::new(Mutex::new(HashMap::new()));
        let closed = tokio_util::sync::CancellationToken::new();
        let (writer, mut wq) = mpsc::unbounded_channel::<Queued>();
        let closed_w = closed.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = closed_w.cancelled() => break,
                    q = wq.recv() => match q {
                        // The frame's room is given back once it is written.
                        Some(q) => if wr.write_all(&q.buf).await.is_err() { closed_w.cancel(); break; },
                        None => break,
                    }
                }
            }
        });
        let (hello_tx, mut hello_rx) = mpsc::unbounded_channel::<Incoming>();
        if let Ok(mut r) = routes.lock() {
            r.insert(0, hello_tx);
        }
        // Streams of an earlier connection (a server before a restart, a
        // machine before a pause) may still be open in the agent: start this
        // connection's ids somewhere else.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let first = ((nanos as u32) ^ std::process::id().rotate_left(16)) & !GUEST_STREAM | 1;
        let session = session_id(nanos);
        let orphans: Arc<Mutex<Orphans>> = Arc::default();
        let link = Link {
            writer,
            room: Arc::new(Semaphore::new(QUEUE_BYTES)),
            routes: routes.clone(),
            orphans: orphans.clone(),
            next: Arc::new(AtomicU32::new(first)),
            closed: closed.clone(),
            session,
            ended: Arc::default(),
            peer: Arc::new(AtomicU32::new(0)),
        };
        let routes_r = routes.clone();
        let orphans_r = orphans.clone();
        let closed_r = closed.clone();
        let link_r = link.clone();
        tokio::spawn(async move {
            let mut dec = Decoder::new();
            let mut buf = vec![0u8; 64 * 1024];
            // A guest sending garbage would get one warning per read: at
            // most one per WARN_EVERY, with the count of the others.
            let (mut warned_at, mut unsaid) = (None::<std::time::Instant>, 0u64);
            loop {
                let n = tokio::select! {
                    _ = closed_r.cancelled() => break,
                    n = rd.read(&mut buf) => match n { Ok(0) | Err(_) => break, Ok(n) => n },
                };
                dec.feed(&buf[..n]);
                loop {
                    let frame = match dec.next_frame() {
                        Ok(Some(f)) => f,
                        Ok(None) => break,
                        Err(error) => {
                            if warned_at.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                                tracing::warn!(%error, since_last = unsaid, "agent stream out of sync; dropping buffered bytes");
                                (warned_at, unsaid) = (Some(std::time::Instant::now()), 0);
                            } else {
                                unsaid += 1;
                            }
                            dec = Decoder::new();
                            break;
                        }
                    };
                    let payload = frame.payload.len();
                    let incoming = match frame.kind {
                        Kind::Control => match frame.parse::<Reply>() {
                            Ok(r) => Incoming::Reply(r),
                            Err(error) => {
                                tracing::debug!(%error, "undecodable reply from agent");
                                continue;
                            }
                        },
                        Kind::Data => Incoming::Data {
                            channel: frame.channel,
                            bytes: frame.payload,
                        },
                    };
                    if frame.stream & GUEST_STREAM != 0 {
                        link_r.guest_stream(frame.stream, incoming, acceptor.as_ref());
                        continue;
                    }
                    // Orphans first, then routes (as in `open_at`), so a
                    // stream taken up meanwhile never loses a frame.
                    let Ok(mut o) = orphans_r.lock() else { break };
                    match routes_r
                        .lock()
                        .ok()
                        .and_then(|r| r.get(&frame.stream).cloned())
                    {
                        Some(tx) => {
                            drop(o);
                            let _ = tx.send(incoming);
                        }
                        None if frame.stream != 0 => {
                            let ended = link_r
                                .ended
                                .lock()
                                .map(|e| e.set.contains(&frame.stream))
                                .unwrap_or(false);
                            if !ended {
                                o.push(frame.stream, incoming, payload);
                            }
                        }
                        None => {}
                    }
                }
            }
            closed_r.cancel();
            if let Ok(mut r) = routes_r.lock() {
                r.clear();
            }
        });
        let deadline = tokio::time::Instant::now() + timeout;
        let hello = Frame::control(
            0,
            &Request::Hello {
                version: VERSION,
                session,
            },
        )
        .map_err(LinkError::Encode)?;
        let mut resend = Duration::from_millis(100);
        loop {
            link.send_frame(hello.clone())?;
            let wait = tokio::time::timeout(resend, hello_rx.recv());
            match wait.await {
                Ok(Some(Incoming::Reply(reply @ Reply::Hello { .. }))) => {
                    if let Reply::Hello { version, .. } = &reply {
                        link.peer.store(*version, Ordering::Relaxed);
                    }
                    if let Ok(mut r) = link.routes.lock() {
                        r.remove(&0);
                    }
                    return Ok((link, reply));
                }
                Ok(Some(_)) => continue,
                Ok(None) => return Err(LinkError::Closed),
                Err(_) => {
                    if tokio::time::Instant::now() >= deadline {
                        link.close();
                        return Err(LinkError::HandshakeTimeout);
                    }
                    resend = (resend * 2).min(Duration::from_millis(400));
                }
            }
        }
    }

    /// A frame on a guest-opened stream: its announcement goes to the
    /// acceptor (or is refused), frames of streams nobody holds are dropped.
    fn guest_stream(&self, id: u32, incoming: Incoming, acceptor: Option<&Acceptor>) {
        let route = self.routes.lock().ok().and_then(|r| r.get(&id).cloned());
        match (route, incoming) {
            (Some(tx), inc) => {
                let _ = tx.send(inc);
            }
            (None, Incoming::Reply(Reply::Outbound)) => {
                let (tx, rx) = mpsc::unbounded_channel();
                if let Ok(mut r) = self.routes.lock() {
                    r.insert(id, tx);
                }
                let stream = Stream {
                    id,
                    link: self.clone(),
                    rx,
                };
                match acceptor {
                    Some(accept) => accept(stream),
                    None => {
                        let _ = stream.send(&Request::Close);
                    }
                }
            }
            // A stream that ended (or was refused): its last frames cross.
            (None, _) => {}
        }
    }

    /// A control frame: queued at once, never waiting for room.
    fn send_frame(&self, frame: Frame) -> Result<(), LinkError> {
        self.queue(frame, None)
    }

    fn queue(&self, frame: Frame, room: Option<OwnedSemaphorePermit>) -> Result<(), LinkError> {
        if self.closed.is_cancelled() {
            return Err(LinkError::Closed);
        }
        let mut buf = Vec::with_capacity(frame.payload.len() + 16);
        encode(&frame, &mut buf);
        self.writer
            .send(Queued { buf, _room: room })
            .map_err(|_| LinkError::Closed)
    }

    /// One data frame (at most [`MAX_PAYLOAD`]): waits until the write queue
    /// has room for it (its payload and header, so empty frames count too).
    async fn send_data_frame(&self, stream: u32, piece: &[u8]) -> Result<(), LinkError> {
        let frame =
            Frame::data(stream, channel::INPUT, piece.to_vec()).map_err(LinkError::Encode)?;
        let cost = (piece.len() + runtime_proto::HEADER_LEN) as u32;
        let room = tokio::select! {
            _ = self.closed.cancelled() => return Err(LinkError::Closed),
            r = self.room.clone().acquire_many_owned(cost) => r.map_err(|_| LinkError::Closed)?,
        };
        self.queue(frame, Some(room))
    }

    /// Bytes kept for streams nobody opened.
    #[cfg(test)]
    pub(crate) fn orphan_bytes(&self) -> usize {
        self.orphans.lock().map(|o| o.bytes).unwrap_or(0)
    }

    /// Whether frames on `id` are dropped (a stream that ended).
    #[cfg(test)]
    pub(crate) fn is_ended(&self, id: u32) -> bool {
        self.ended
            .lock()
            .map(|e| e.set.contains(&id))
            .unwrap_or(false)
    }

    /// Bytes of data frames queued and not yet written to the socket.
    #[cfg(test)]
    pub(crate) fn queued_bytes(&self) -> usize {
        QUEUE_BYTES - self.room.available_permits()
    }

    pub(crate) fn open(&self) -> Result<Stream, LinkError> {
        if self.closed.is_cancelled() {
            return Err(LinkError::Closed);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        // Ids with the high bit are the guest's.
        let id = loop {
            let id = self.next.fetch_add(1, Ordering::Relaxed) & !GUEST_STREAM;
            if id != 0
                && !self
                    .routes
                    .lock()
                    .map(|r| r.contains_key(&id))
                    .unwrap_or(false)
            {
                break id;
            }
        };
        self.routes
            .lock()
            .map_err(|_| LinkError::Closed)?
            .insert(id, tx);
        Ok(Stream {
            id,
            link: self.clone(),
            rx,
        })
    }

    /// A stream with a given id: one opened by an earlier connection whose
    /// process still runs in the guest.
    pub(crate) fn open_at(&self, id: u32) -> Result<Stream, LinkError> {
        if self.closed.is_cancelled() || id == 0 {
            return Err(LinkError::Closed);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        // Route first, then hand over what came before: the reader takes the
        // orphans lock before it looks up a route, so the order is kept.
        let mut orphans = self.orphans.lock().map_err(|_| LinkError::Closed)?;
        self.routes
            .lock()
            .map_err(|_| LinkError::Closed)?
            .insert(id, tx.clone());
        for inc in orphans.take(id) {
            let _ = tx.send(inc);
        }
        drop(orphans);
        Ok(Stream {
            id,
            link: self.clone(),
            rx,
        })
    }

    /// One request, one reply.
    pub(crate) async fn call(&self, req: &Request) -> Result<Reply, LinkError> {
        let mut s = self.open()?;
        s.send(req)?;
        s.reply().await
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    pub(crate) fn close(&self) {
        self.closed.cancel();
    }

    /// Lets the agent's held output flow again after a quiesce (a `Hello` of
    /// this same session, so tunnels go on; its answer goes nowhere).
    pub(crate) fn release(&self) {
        let hello = Request::Hello {
            version: VERSION,
            session: self.session,
        };
        if let Ok(hello) = Frame::control(0, &hello) {
            let _ = self.send_frame(hello);
        }
    }

    /// Waits (bounded) until the reader has seen the end of the socket, so
    /// every frame the peer wrote before it went away has been delivered.
    pub(crate) async fn drained(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.closed.cancelled()).await;
    }
}

/// A non-zero session id, different for every connection of every process.
fn session_id(nanos: u64) -> u64 {
    use std::sync::atomic::AtomicU64;
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut x = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNT
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut seed = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut seed).is_ok() {
            x ^= u64::from_ne_bytes(seed);
        }
    }
    x.max(1)
}

#[cfg(test)]
mod tests {
    use runtime_proto::{FailCode, Kind, Reply};

    use super::*;
    use crate::fake_guest::Guest;

    #[tokio::test]
    async fn what_a_guest_sends_on_streams_nobody_opened_is_bounded() {
        let (link, mut guest) = Guest::linked().await;
        let mut marker = link.open().unwrap();
        let id = marker.id;
        // Host ids (no guest bit) far from those the link hands out.
        let other = |k: u32| ((id ^ 0x4000_0000).wrapping_add(k)) & !GUEST_STREAM;
        // Large replies and empty data frames, on host ids never opened.
        let big = Reply::Failed {
            code: FailCode::Io,
            message: "A".repeat(100 * 1024),
        };
        for stream in 1..=200u32 {
            guest.reply(other(stream), &big).await;
        }
        for stream in 0..50_000u32 {
            guest.output(other(1000 + stream), 1, &[]).await;
        }
        // Every frame before this one has been read.
        guest.reply(id, &Reply::Done).await;
        assert!(matches!(
            marker.recv().await,
            Some(Incoming::Reply(Reply::Done))
        ));
        let o = link.orphans.lock().unwrap();
        let held: usize = o
            .frames
            .values()
            .flatten()
            .map(|(_, i)| match i {
                Incoming::Data { bytes, .. } => bytes.len(),
                Incoming::Reply(Reply::Failed { message, .. }) => message.len(),
                Incoming::Reply(_) => 0,
            })
            .sum();
        let count: usize = o.frames.values().map(Vec::len).sum();
        assert!(o.bytes <= ORPHAN_BYTES, "{} accounted", o.bytes);
        assert!(held <= ORPHAN_BYTES, "{held} bytes held");
        assert!(
            count <= ORPHAN_BYTES / ORPHAN_OVERHEAD,
            "{count} frames held"
        );
        assert!(count > 0, "nothing kept at all");
    }

    #[tokio::test]
    async fn data_for_a_guest_that_does_not_read_waits_within_the_queue_bound() {
        let (link, mut guest) = Guest::linked().await;
        let s = link.open().unwrap();
        let id = s.id;
        let total = 64usize << 20;
        let writer = tokio::spawn(async move {
            let piece = vec![5u8; 1 << 20];
            for _ in 0..total >> 20 {
                s.send_data(&piece).await.unwrap();
            }
            // Control frames never wait for room.
            s.send(&Request::EndWrite).unwrap();
            s
        });
        // The guest reads nothing: the writer waits with at most the bound
        // queued (beyond what the socket itself holds).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !writer.is_finished(),
            "64 MiB queued for a guest that reads nothing"
        );
        let queued = link.queued_bytes();
        assert!(queued <= QUEUE_BYTES, "{queued} bytes queued");
        assert!(queued > QUEUE_BYTES / 2, "only {queued} bytes queued");
        // A control frame from elsewhere is queued at once meanwhile.
        let other = link.open().unwrap();
        other.send(&Request::Ping).unwrap();
        // Once the guest reads, every byte arrives in order, then EndWrite.
        let (mut got, mut ping) = (0usize, false);
        loop {
            let f = guest.stream_frame().await.unwrap();
            if f.stream == other.id {
                ping = true;
                continue;
            }
            assert_eq!(f.stream, id);
            match f.kind {
                Kind::Data => got += f.payload.len(),
                Kind::Control => {
                    assert_eq!(f.parse::<Request>().unwrap(), Request::EndWrite);
                    break;
                }
            }
        }
        assert_eq!(got, total);
        assert!(ping, "the control frame was not sent");
        writer.await.unwrap();
        assert_eq!(link.queued_bytes(), 0);
    }
}
