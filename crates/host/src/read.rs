//! File reads on the link, with flow control when the agent has it
//! ([`runtime_proto::READ_FLOW_VERSION`]): the guest sends a file's bytes
//! only within the window the host grants ([`READ_WINDOW`]), and the host
//! grants more as its reader (an HTTP body, a whole read) takes them. So a
//! slow reader holds at most one window on the host, whatever the file's
//! size. A guest that sends beyond its window gets the stream reset
//! ([`Request::Close`]) and its bytes are dropped.

use runtime_proto::flow::{RecvWindow, READ_WINDOW};
use runtime_proto::{Reply, Request, User, READ_FLOW_VERSION};

use crate::link::{Incoming, Link, LinkError, Stream};
use crate::types::{GuestFailure, HostError};

/// Pieces of a streamed read waiting for its reader (each at most
/// [`runtime_proto::MAX_PAYLOAD`]); the window is credited as the reader
/// takes them.
pub(crate) const READ_PIECES: usize = 16;

/// A file larger than a read takes.
pub(crate) fn too_large(id: &str, path: &str) -> HostError {
    HostError::Guest {
        id: id.to_owned(),
        failure: GuestFailure::TooLarge,
        message: format!(
            "{path} is larger than a read takes ({} MiB): read it in parts with a command",
            runtime_proto::MAX_READ_BYTES >> 20
        ),
    }
}

/// A guest that sent beyond its read window.
pub(crate) fn overrun(id: &str) -> HostError {
    HostError::Guest {
        id: id.to_owned(),
        failure: GuestFailure::Io,
        message: "the guest sent a file's bytes beyond its window; the read was reset".into(),
    }
}

/// What a read yields next.
#[derive(Debug)]
pub(crate) enum Next {
    /// The size the guest announced (its `FileStart`).
    Start(u64),
    /// Bytes of the file; the reader calls [`Read::taken`] once it holds
    /// them no more.
    Bytes(Vec<u8>),
    /// Every byte was sent.
    Done,
    /// Another reply (a failure).
    Reply(Reply),
    /// The guest sent beyond its window: the stream is reset.
    Overrun,
    /// The link closed.
    Lost,
}

/// One file read under way on the link.
pub(crate) struct Read {
    /// Its stream, until the read ends early (then its route is gone and
    /// what the guest still sends on it is dropped).
    s: Option<Stream>,
    #[cfg(test)]
    id: u32,
    /// The window, when the agent has flow-controlled reads.
    win: Option<RecvWindow>,
    /// `Done`, a failure or a reset: nothing more to say to the guest.
    over: bool,
}

impl Read {
    /// Asks the guest for the file at `path`, and opens its window.
    pub(crate) fn start(link: &Link, path: &str, user: User) -> Result<Read, LinkError> {
        let flow = link.peer_version() >= READ_FLOW_VERSION;
        let s = link.open()?;
        s.send(&Request::ReadFile {
            path: path.to_owned(),
            user,
            flow,
        })?;
        let win = if flow {
            let mut w = RecvWindow::default();
            s.send(&Request::Credit {
                bytes: w.open_by(READ_WINDOW),
            })?;
            Some(w)
        } else {
            None
        };
        Ok(Read {
            #[cfg(test)]
            id: s.id,
            s: Some(s),
            win,
            over: false,
        })
    }

    /// What came next from the guest.
    pub(crate) async fn next(&mut self) -> Next {
        let Some(s) = self.s.as_mut().filter(|_| !self.over) else {
            return Next::Lost;
        };
        let next = match s.recv().await {
            None => Next::Lost,
            Some(Incoming::Reply(Reply::FileStart { size })) => return Next::Start(size),
            Some(Incoming::Reply(Reply::Done)) => Next::Done,
            Some(Incoming::Reply(r)) => Next::Reply(r),
            Some(Incoming::Data { bytes, .. }) => {
                let fits = match &mut self.win {
                    Some(w) => w.received(bytes.len()).is_ok(),
                    None => true,
                };
                if fits {
                    return Next::Bytes(bytes);
                }
                self.reset();
                return Next::Overrun;
            }
        };
        self.over = true;
        next
    }

    /// The reader took `n` bytes: the guest may send that many more.
    pub(crate) fn taken(&mut self, n: usize) {
        if self.over {
            return;
        }
        if let (Some(s), Some(bytes)) = (&self.s, self.win.as_mut().and_then(|w| w.delivered(n))) {
            let _ = s.send(&Request::Credit { bytes });
        }
    }

    /// Ends the read early: the guest stops, what it still sends is dropped.
    pub(crate) fn reset(&mut self) {
        if self.over {
            return;
        }
        self.over = true;
        if let Some(s) = self.s.take() {
            s.ended();
            if self.win.is_some() {
                let _ = s.send(&Request::Close);
            }
        }
    }

    /// Bytes received and not yet taken (at most one window).
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.win.as_ref().map_or(0, RecvWindow::buffered)
    }
}

impl Drop for Read {
    /// A reader that went away (an HTTP client that hung up) ends the read
    /// in the guest too.
    fn drop(&mut self) {
        self.reset();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use runtime_proto::{Frame, Kind, MAX_PAYLOAD};

    use super::*;
    use crate::fake_guest::Guest;

    /// The next request on `stream`, skipping the handshake's stream 0.
    async fn request_on(guest: &mut Guest, stream: u32) -> Request {
        let (s, r) = guest.request().await.unwrap();
        assert_eq!(s, stream);
        r
    }

    #[tokio::test]
    async fn a_read_opens_its_window_and_credits_only_what_the_reader_took() {
        let (link, mut guest) = Guest::linked_version(READ_FLOW_VERSION).await;
        let mut read = Read::start(&link, "/f", User::Root).unwrap();
        let id = read.id;
        assert!(matches!(
            request_on(&mut guest, id).await,
            Request::ReadFile { flow: true, .. }
        ));
        assert_eq!(
            request_on(&mut guest, id).await,
            Request::Credit { bytes: READ_WINDOW }
        );
        guest.reply(id, &Reply::FileStart { size: 1 << 30 }).await;
        assert!(matches!(read.next().await, Next::Start(_)));
        // The guest fills the window; the reader takes nothing yet.
        let frames = READ_WINDOW as usize / MAX_PAYLOAD;
        for _ in 0..frames {
            guest.output(id, 0, &vec![1u8; MAX_PAYLOAD]).await;
        }
        let mut got = Vec::new();
        for _ in 0..frames {
            match read.next().await {
                Next::Bytes(b) => got.push(b.len()),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(read.buffered(), READ_WINDOW as usize);
        // Taking one frame's bytes grants exactly that much, nothing before.
        read.taken(got[0]);
        let f = guest.stream_frame().await.unwrap();
        assert_eq!(f.kind, Kind::Control);
        assert_eq!(
            f.parse::<Request>().unwrap(),
            Request::Credit {
                bytes: MAX_PAYLOAD as u32
            }
        );
        assert_eq!(read.buffered(), READ_WINDOW as usize - MAX_PAYLOAD);
    }

    #[tokio::test]
    async fn a_guest_that_sends_beyond_its_window_is_reset_and_its_bytes_dropped() {
        let (link, mut guest) = Guest::linked_version(READ_FLOW_VERSION).await;
        let mut read = Read::start(&link, "/f", User::Root).unwrap();
        let id = read.id;
        request_on(&mut guest, id).await;
        request_on(&mut guest, id).await;
        guest.reply(id, &Reply::FileStart { size: 1 << 30 }).await;
        assert!(matches!(read.next().await, Next::Start(_)));
        let frames = READ_WINDOW as usize / MAX_PAYLOAD;
        for _ in 0..frames {
            guest.output(id, 0, &vec![1u8; MAX_PAYLOAD]).await;
        }
        // One byte beyond the window, then much more.
        guest.output(id, 0, b"x").await;
        for _ in 0..40 {
            guest.output(id, 0, &vec![2u8; MAX_PAYLOAD]).await;
        }
        for _ in 0..frames {
            assert!(matches!(read.next().await, Next::Bytes(_)));
        }
        assert!(matches!(read.next().await, Next::Overrun));
        // The guest is told to stop.
        assert_eq!(request_on(&mut guest, id).await, Request::Close);
        // Its later bytes are neither delivered nor kept as orphans.
        assert!(matches!(read.next().await, Next::Lost));
        let mut marker = link.open().unwrap();
        guest.reply(marker.id, &Reply::Done).await;
        assert!(matches!(
            marker.recv().await,
            Some(Incoming::Reply(Reply::Done))
        ));
        assert_eq!(link.orphan_bytes(), 0, "the overrun's bytes were kept");
        assert!(link.is_ended(id));
        drop(read);
    }

    #[tokio::test]
    async fn an_older_agent_reads_without_a_window() {
        let (link, mut guest) = Guest::linked_version(4).await;
        let mut read = Read::start(&link, "/f", User::Root).unwrap();
        let id = read.id;
        assert!(matches!(
            request_on(&mut guest, id).await,
            Request::ReadFile { flow: false, .. }
        ));
        guest.reply(id, &Reply::FileStart { size: 10 }).await;
        guest.send(Frame::data(id, 0, vec![0u8; 10]).unwrap()).await;
        guest.reply(id, &Reply::Done).await;
        assert!(matches!(read.next().await, Next::Start(10)));
        assert!(matches!(read.next().await, Next::Bytes(_)));
        assert!(matches!(read.next().await, Next::Done));
    }
}
