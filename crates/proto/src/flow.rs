//! TCP tunnels over the channel and their flow control.
//!
//! A tunnel is a stream that carries one TCP connection of the guest:
//! opened by the host with [`crate::Request::Connect`] (answered `Done`) or
//! by the guest with [`crate::Reply::Outbound`] (its id has
//! [`crate::GUEST_STREAM`] set, so the two sides never pick the same id).
//! From then on:
//!
//! * **Bytes** travel as [`crate::Kind::Data`] frames on
//!   [`crate::channel::INPUT`], both ways.
//! * **Credits.** Each side is the receiver of the other's bytes and owns
//!   a window: a sender may have at most as many bytes unacknowledged as
//!   the receiver granted. Every window starts at zero; the receiver opens
//!   it with a first `Credit` of [`WINDOW`] (the agent right after `Done` or
//!   `Outbound`, the host once it has the `Done` or accepted the
//!   `Outbound`), and grants more (`Credit { bytes }`) as it delivers bytes
//!   to its own end (the guest's socket, the host's stream), so a slow or
//!   idle reader holds at most one window in the other side's buffers and
//!   never stalls the channel for other streams. A sender that exceeds its
//!   window, or credits that would open a window beyond [`MAX_GRANT`], are a
//!   protocol violation: the stream is reset.
//! * **Half-close.** `Eof` after the last byte of one direction; the
//!   receiver shuts down the write side of its end once it has delivered the
//!   bytes before it. The other direction goes on (read until EOF works).
//!   A tunnel ends quietly once both directions saw their `Eof` and every
//!   byte was delivered.
//! * **Reset.** `Close` from either side ends the tunnel at once: the
//!   receiver resets its socket (or ends the host's stream) and forgets the
//!   stream. Frames that cross a `Close` are dropped. The agent answers
//!   tunnel frames for a guest-opened stream it does not know with `Close`.
//! * **File reads.** A [`crate::Request::ReadFile`] with `flow` uses the
//!   same credits for the file's bytes, guest to host: the host opens the
//!   window with a first `Credit` of [`READ_WINDOW`] and grants more as its
//!   reader (an HTTP body) takes the bytes; `Close` from the host ends the
//!   read. A guest that overruns its window gets `Close` and its bytes are
//!   dropped.
//! * **Reconnect.** On a `Hello` of a new session the agent resets every
//!   tunnel (the host that knew them is gone); the host ends every tunnel
//!   when its link to the agent closes (stop, pause, destroy).

/// The window each receiver grants: bytes in flight or buffered per
/// direction of one tunnel.
pub const WINDOW: u32 = 256 * 1024;

/// The window a host grants a flow-controlled file read: what the guest
/// may send ahead of the reader. Larger than a tunnel's, as a read is one
/// direction of bulk bytes in frames of [`crate::MAX_PAYLOAD`].
pub const READ_WINDOW: u32 = 2 * 1024 * 1024;

/// The largest window a receiver may have open (credits beyond it are a
/// violation).
pub const MAX_GRANT: u64 = 16 * 1024 * 1024;

/// A receiver grants more credit once this much was delivered (or when its
/// buffer runs empty), not on every write.
pub const CREDIT_BATCH: u32 = 32 * 1024;

/// The peer broke the flow-control rules; reset the tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("the peer sent {sent} bytes with only {allowed} of window left")]
    Overrun { sent: usize, allowed: u64 },
    #[error("the peer granted a window of {window} bytes, beyond {MAX_GRANT}")]
    OverGrant { window: u64 },
}

/// The sending side of one direction: how much the peer lets us send.
#[derive(Debug, Default, Clone)]
pub struct SendWindow {
    available: u64,
}

impl SendWindow {
    /// Bytes that may be sent now.
    pub fn available(&self) -> usize {
        self.available.min(usize::MAX as u64) as usize
    }

    /// The peer's `Credit`.
    pub fn grant(&mut self, bytes: u32) -> Result<(), Violation> {
        let window = self.available + u64::from(bytes);
        if window > MAX_GRANT {
            return Err(Violation::OverGrant { window });
        }
        self.available = window;
        Ok(())
    }

    /// Records `n` bytes sent; callers never send more than [`Self::available`].
    pub fn sent(&mut self, n: usize) {
        self.available = self.available.saturating_sub(n as u64);
    }
}

/// The receiving side of one direction: what the peer may still send, what
/// is buffered, what was delivered and not yet credited.
#[derive(Debug, Default, Clone)]
pub struct RecvWindow {
    /// Bytes the peer may still send (granted and not received).
    open: u64,
    /// Received and not yet delivered.
    buffered: u64,
    /// Delivered and not yet credited.
    pending: u64,
}

impl RecvWindow {
    /// The first credit to send: opens the window to [`WINDOW`].
    pub fn open(&mut self) -> u32 {
        self.open += u64::from(WINDOW);
        WINDOW
    }

    /// A first credit other than [`WINDOW`] (a read's [`READ_WINDOW`]):
    /// opens the window by `bytes`.
    pub fn open_by(&mut self, bytes: u32) -> u32 {
        self.open += u64::from(bytes);
        bytes
    }

    /// The peer sent `n` bytes.
    pub fn received(&mut self, n: usize) -> Result<(), Violation> {
        if n as u64 > self.open {
            return Err(Violation::Overrun {
                sent: n,
                allowed: self.open,
            });
        }
        self.open -= n as u64;
        self.buffered += n as u64;
        Ok(())
    }

    /// Bytes received and not yet delivered.
    pub fn buffered(&self) -> usize {
        self.buffered as usize
    }

    /// `n` bytes reached our end; returns the credit to send now, if any.
    pub fn delivered(&mut self, n: usize) -> Option<u32> {
        let n = (n as u64).min(self.buffered);
        self.buffered -= n;
        self.pending += n;
        if self.pending >= u64::from(CREDIT_BATCH) || (self.buffered == 0 && self.pending > 0) {
            let c = self.pending.min(u64::from(u32::MAX)) as u32;
            self.pending -= u64::from(c);
            self.open += u64::from(c);
            Some(c)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_start_closed_and_open_with_the_first_credit() {
        let mut r = RecvWindow::default();
        assert!(r.received(1).is_err(), "nothing granted yet");
        let mut s = SendWindow::default();
        assert_eq!(s.available(), 0);
        s.grant(r.open()).unwrap();
        assert_eq!(s.available(), WINDOW as usize);
        r.received(WINDOW as usize).unwrap();
        s.sent(WINDOW as usize);
        assert_eq!(s.available(), 0);
        assert_eq!(
            r.received(1),
            Err(Violation::Overrun {
                sent: 1,
                allowed: 0
            })
        );
    }

    #[test]
    fn a_sender_and_receiver_never_exceed_the_window() {
        // Simulate a lossless pipe with a slow reader: the receiver's buffer
        // never holds more than WINDOW and every byte gets through.
        let (mut s, mut r) = (SendWindow::default(), RecvWindow::default());
        s.grant(r.open()).unwrap();
        let total = 10 * WINDOW as usize + 12345;
        let (mut sent, mut delivered) = (0usize, 0usize);
        let mut x: u64 = 0x1234_5678;
        while delivered < total {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x as usize % 70_000).min(s.available()).min(total - sent);
            if n > 0 {
                r.received(n).unwrap();
                s.sent(n);
                sent += n;
            }
            assert!(r.buffered() <= WINDOW as usize);
            let d = ((x >> 20) as usize % 50_000).min(r.buffered());
            if let Some(c) = r.delivered(d) {
                s.grant(c).unwrap();
            }
            delivered += d;
            if s.available() == 0 && r.buffered() == 0 {
                panic!("stalled at {delivered} of {total}");
            }
        }
        assert_eq!(sent, total);
    }

    #[test]
    fn credits_are_batched_but_an_empty_buffer_always_credits() {
        let mut r = RecvWindow::default();
        r.open();
        r.received(100_000).unwrap();
        assert_eq!(r.delivered(1000), None);
        assert_eq!(
            r.delivered(CREDIT_BATCH as usize),
            Some(CREDIT_BATCH + 1000)
        );
        let rest = r.buffered();
        assert_eq!(r.delivered(rest), Some(rest as u32));
        assert_eq!(r.delivered(5), None, "nothing buffered, nothing to credit");
    }

    #[test]
    fn a_read_window_bounds_what_a_sender_may_have_ahead_of_a_slow_reader() {
        // A file read: the receiver opens READ_WINDOW and delivers nothing
        // (a stalled HTTP client); the sender fills the window and no more.
        let (mut s, mut r) = (SendWindow::default(), RecvWindow::default());
        s.grant(r.open_by(READ_WINDOW)).unwrap();
        let mut sent = 0usize;
        while s.available() > 0 {
            let n = s.available().min(crate::MAX_PAYLOAD);
            r.received(n).unwrap();
            s.sent(n);
            sent += n;
        }
        assert_eq!(sent, READ_WINDOW as usize);
        assert_eq!(r.buffered(), READ_WINDOW as usize);
        // One byte more is an overrun.
        assert_eq!(
            r.received(1),
            Err(Violation::Overrun {
                sent: 1,
                allowed: 0
            })
        );
        // Delivering a frame's worth grants exactly that much again.
        let c = r.delivered(crate::MAX_PAYLOAD).unwrap();
        assert_eq!(c as usize, crate::MAX_PAYLOAD);
        s.grant(c).unwrap();
        assert_eq!(s.available(), crate::MAX_PAYLOAD);
    }

    #[test]
    fn over_grants_are_refused() {
        let mut s = SendWindow::default();
        s.grant(u32::MAX).unwrap_err();
        s.grant((MAX_GRANT) as u32).unwrap();
        assert!(s.grant(1).is_err());
    }
}
