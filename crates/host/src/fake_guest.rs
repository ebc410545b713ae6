//! For unit tests: a fake agent on the other end of a socket pair (or
//! behind a machine's agent socket), linked to the host's side by the real
//! handshake.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use runtime_proto::{encode, Decoder, Frame, Kind, Reply, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::link::{Acceptor, Link};

pub(crate) struct Guest {
    sock: UnixStream,
    dec: Decoder,
}

impl Guest {
    /// A link to a new fake guest, the handshake done.
    pub(crate) async fn linked() -> (Link, Guest) {
        Guest::linked_with(None).await
    }

    /// As [`Guest::linked`], the guest's outbound streams handed to
    /// `acceptor`.
    pub(crate) async fn linked_with(acceptor: Option<Acceptor>) -> (Link, Guest) {
        Guest::linked_as(acceptor, 1).await
    }

    /// As [`Guest::linked`], the guest speaking protocol `version`.
    pub(crate) async fn linked_version(version: u32) -> (Link, Guest) {
        Guest::linked_as(None, version).await
    }

    async fn linked_as(acceptor: Option<Acceptor>, version: u32) -> (Link, Guest) {
        let (host_side, guest_side) = UnixStream::pair().unwrap();
        let answer = tokio::spawn(Guest::new(guest_side).answer_hello(version));
        let (link, _) = Link::over(host_side, Duration::from_secs(5), acceptor)
            .await
            .unwrap();
        (link, answer.await.unwrap())
    }

    /// A fake guest behind `listener` (a machine's agent socket): it
    /// answers the handshake of the first host to connect.
    pub(crate) fn serving(listener: UnixListener) -> tokio::task::JoinHandle<Guest> {
        tokio::spawn(async move {
            let (sock, _) = listener.accept().await.unwrap();
            Guest::new(sock).answer_hello(1).await
        })
    }

    fn new(sock: UnixStream) -> Guest {
        Guest {
            sock,
            dec: Decoder::new(),
        }
    }

    async fn answer_hello(mut self, version: u32) -> Guest {
        let f = self.frame().await.unwrap();
        assert_eq!((f.stream, f.kind), (0, Kind::Control));
        assert!(matches!(f.parse().unwrap(), Request::Hello { .. }));
        self.reply(
            0,
            &Reply::Hello {
                version,
                agent: "fake".into(),
            },
        )
        .await;
        self
    }

    /// The next frame from the host, of any stream.
    pub(crate) async fn frame(&mut self) -> Option<Frame> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if let Some(f) = self.dec.next_frame().unwrap() {
                return Some(f);
            }
            let n = self.sock.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            self.dec.feed(&buf[..n]);
        }
    }

    /// The next frame of a stream the host opened (the handshake's stream
    /// 0, which the host may repeat, skipped).
    pub(crate) async fn stream_frame(&mut self) -> Option<Frame> {
        loop {
            let f = self.frame().await?;
            if f.stream != 0 {
                return Some(f);
            }
        }
    }

    /// The next request on a stream the host opened, and that stream.
    pub(crate) async fn request(&mut self) -> Option<(u32, Request)> {
        let f = self.stream_frame().await?;
        assert_eq!(f.kind, Kind::Control, "a request, not data");
        Some((f.stream, f.parse().unwrap()))
    }

    pub(crate) async fn send(&mut self, f: Frame) {
        let mut out = Vec::new();
        encode(&f, &mut out);
        self.sock.write_all(&out).await.unwrap();
    }

    pub(crate) async fn reply(&mut self, stream: u32, r: &Reply) {
        self.send(Frame::control(stream, r).unwrap()).await;
    }

    pub(crate) async fn output(&mut self, stream: u32, channel: u8, bytes: &[u8]) {
        self.send(Frame::data(stream, channel, bytes.to_vec()).unwrap())
            .await;
    }
}
