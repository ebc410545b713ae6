//! The host end of a TCP tunnel (`runtime_proto::flow`): a link stream
//! pumped into one end of a [`tokio::io::duplex`] pair, whose other end the
//! caller gets ([`crate::Host::connect`], [`crate::Outbound::accept`]).
//!
//! The guest is not trusted: it may send only what the host granted (at most
//! [`WINDOW`] buffered here per tunnel), a violation resets the tunnel, and
//! a caller that stops reading only stops the credits of its own tunnel.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use runtime_proto::flow::{RecvWindow, SendWindow};
use runtime_proto::{channel, Reply, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use crate::link::{Incoming, Stream};

#[cfg(doc)]
use runtime_proto::flow::WINDOW;

/// Tunnels one sandbox may have open on the host, both directions together.
pub const MAX_TUNNELS: usize = 512;
/// The buffer of the duplex pair (each direction).
const PIPE: usize = 64 * 1024;
/// Bytes read from the caller's end per frame.
const CHUNK: usize = 64 * 1024;

/// One tunnel's place in its sandbox's count; given back on drop.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    pub(crate) fn take(count: &Arc<AtomicUsize>) -> Option<Slot> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_TUNNELS).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(count)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Starts pumping an open tunnel stream; returns the caller's end.
pub(crate) fn start(stream: Stream, slot: Slot) -> DuplexStream {
    let (mine, theirs) = tokio::io::duplex(PIPE);
    tokio::spawn(async move {
        pump(stream, mine).await;
        drop(slot);
    });
    theirs
}

/// How a pump ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Both directions reached their end.
    Done,
    /// The guest reset it, or the link is gone: nothing to tell.
    Gone,
    /// Reset here (the caller dropped its end, or the guest broke the rules).
    Reset,
}

async fn pump(mut stream: Stream, end: DuplexStream) {
    let tx = stream.sender();
    let (mut rd, mut wr) = tokio::io::split(end);
    let mut send = SendWindow::default();
    let mut recv = RecvWindow::default();
    let mut inbox: VecDeque<Vec<u8>> = VecDeque::new();
    let mut current: Vec<u8> = Vec::new();
    let mut off = 0usize;
    let (mut read_eof, mut peer_eof, mut wr_shut) = (false, false, false);
    let mut buf = vec![0u8; CHUNK];
    // Open the guest's window.
    if tx.send(&Request::Credit { bytes: recv.open() }).is_err() {
        return;
    }
    let end = loop {
        if off == current.len() {
            current = inbox.pop_front().unwrap_or_default();
            off = 0;
        }
        if peer_eof && current.is_empty() && !wr_shut {
            let _ = wr.shutdown().await;
            wr_shut = true;
        }
        if read_eof && wr_shut {
            break End::Done;
        }
        let want = send.available().min(CHUNK);
        tokio::select! {
            inc = stream.recv() => match inc {
                None => break End::Gone,
                Some(Incoming::Data { channel: channel::INPUT, bytes }) => {
                    if peer_eof || recv.received(bytes.len()).is_err() {
                        tracing::warn!(stream = stream.id, "the guest overran a tunnel; resetting it");
                        break End::Reset;
                    }
                    if !bytes.is_empty() {
                        inbox.push_back(bytes);
                    }
                }
                Some(Incoming::Data { .. }) => break End::Reset,
                Some(Incoming::Reply(Reply::Credit { bytes })) => {
                    if send.grant(bytes).is_err() {
                        tracing::warn!(stream = stream.id, "the guest over-granted a tunnel; resetting it");
                        break End::Reset;
                    }
                }
                Some(Incoming::Reply(Reply::Eof)) => peer_eof = true,
                Some(Incoming::Reply(Reply::Close)) => break End::Gone,
                Some(Incoming::Reply(_)) => break End::Reset,
            },
            r = wr.write(&current[off..]), if off < current.len() => match r {
                Ok(n) => {
                    off += n;
                    if let Some(bytes) = recv.delivered(n) {
                        if tx.send(&Request::Credit { bytes }).is_err() {
                            break End::Gone;
                        }
                    }
                }
                Err(_) => break End::Reset,
            },
            r = rd.read(&mut buf[..want]), if !read_eof && want > 0 => match r {
                Ok(0) => {
                    // The caller shut down its write side or dropped its end:
                    // either way a half-close (a dropped end resets the
                    // tunnel only if bytes still come for it, as TCP would).
                    read_eof = true;
                    if tx.send(&Request::Eof).is_err() {
                        break End::Gone;
                    }
                }
                Ok(n) => {
                    send.sent(n);
                    if tx.send_data(&buf[..n]).await.is_err() {
                        break End::Gone;
                    }
                }
                Err(_) => break End::Reset,
            },
        }
    };
    if end == End::Reset {
        let _ = tx.send(&Request::Close);
    }
    stream.ended();
    tracing::debug!(stream = stream.id, end = ?end, "tunnel ended");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use runtime_proto::flow::WINDOW;
    use runtime_proto::{Frame, Kind, Request, GUEST_STREAM, MAX_PAYLOAD};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    use super::*;
    use crate::fake_guest::Guest;
    use crate::link::Link;

    /// `n` bytes from the guest on tunnel `stream`.
    async fn data(guest: &mut Guest, stream: u32, n: usize) {
        for piece in vec![b'x'; n].chunks(MAX_PAYLOAD) {
            guest
                .send(Frame::data(stream, channel::INPUT, piece.to_vec()).unwrap())
                .await;
        }
    }

    /// A link to a fake guest that opens one outbound tunnel: the host's end
    /// of it, and the guest.
    async fn outbound_tunnel() -> (Link, DuplexStream, Guest, u32) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let count = Arc::new(AtomicUsize::new(0));
        let acceptor: crate::link::Acceptor = Arc::new(move |s| {
            let _ = tx.send(start(s, Slot::take(&count).unwrap()));
        });
        let (link, mut guest) = Guest::linked_with(Some(acceptor)).await;
        let id = GUEST_STREAM | 5;
        guest.reply(id, &Reply::Outbound).await;
        let conn = rx.recv().await.unwrap();
        // The host opens the guest's window first.
        loop {
            let (s, req) = guest.request().await.unwrap();
            if s == id {
                assert_eq!(req, Request::Credit { bytes: WINDOW });
                break;
            }
        }
        (link, conn, guest, id)
    }

    #[tokio::test]
    async fn a_guest_that_overruns_its_window_is_reset() {
        let (_link, mut conn, mut guest, id) = outbound_tunnel().await;
        // The caller reads nothing: at most the pipe's worth is credited
        // back, so this is more than the guest may ever send.
        data(&mut guest, id, WINDOW as usize + PIPE + 1).await;
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let (s, req) = guest.request().await.unwrap();
                if s == id && req == Request::Close {
                    break;
                }
                assert!(matches!(req, Request::Credit { .. }), "unexpected {req:?}");
            }
        })
        .await
        .expect("the host resets the tunnel");
        // The caller's end ends too.
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut sink))
            .await
            .expect("the stream ends");
    }

    #[tokio::test]
    async fn a_caller_that_does_not_read_stops_the_credits() {
        let (_link, conn, mut guest, id) = outbound_tunnel().await;
        data(&mut guest, id, WINDOW as usize).await;
        // Credits come only for what reached the caller's pipe (it reads
        // nothing): at most the pipe's size.
        let mut credited = 0u64;
        while let Ok(Some((s, req))) =
            tokio::time::timeout(Duration::from_millis(500), guest.request()).await
        {
            if s == id {
                match req {
                    Request::Credit { bytes } => credited += u64::from(bytes),
                    other => panic!("{other:?}"),
                }
            }
        }
        assert!(
            credited <= PIPE as u64,
            "{credited} bytes credited to a caller that reads nothing"
        );
        drop(conn);
    }

    #[tokio::test]
    async fn half_close_both_ways_ends_quietly() {
        let (link, mut conn, mut guest, id) = outbound_tunnel().await;
        data(&mut guest, id, 10).await;
        guest.reply(id, &Reply::Eof).await;
        let mut got = Vec::new();
        conn.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"xxxxxxxxxx");
        // The caller can still write after the guest's EOF.
        guest.reply(id, &Reply::Credit { bytes: WINDOW }).await;
        conn.write_all(b"answer").await.unwrap();
        conn.shutdown().await.unwrap();
        let mut data = Vec::new();
        loop {
            let f = guest.frame().await.unwrap();
            if f.stream != id {
                continue;
            }
            match f.kind {
                Kind::Data => data.extend(f.payload),
                Kind::Control => match f.parse::<Request>().unwrap() {
                    Request::Eof => break,
                    Request::Credit { .. } => {}
                    other => panic!("{other:?}"),
                },
            }
        }
        assert_eq!(data, b"answer");
        // Frames crossing the end are dropped, the link goes on.
        guest.reply(id, &Reply::Credit { bytes: 1 }).await;
        assert!(!link.is_closed());
    }
}
