use serde::{de::DeserializeOwned, Serialize};

/// Bytes of the header after the length prefix: kind, channel, stream.
pub const HEADER_LEN: usize = 1 + 1 + 4;
/// The largest payload a frame may carry.
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// The largest frame (length prefix excluded).
pub const MAX_FRAME: usize = HEADER_LEN + MAX_PAYLOAD;

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {len} bytes exceeds the maximum of {MAX_FRAME}")]
    FrameTooLarge { len: usize },
    #[error("frame of {len} bytes is shorter than its header")]
    FrameTooShort { len: usize },
    #[error("unknown frame kind {kind}")]
    UnknownKind { kind: u8 },
    #[error("malformed control message on stream {stream}")]
    BadControl {
        stream: u32,
        #[source]
        source: serde_json::Error,
    },
    #[error("control message could not be encoded")]
    Encode(#[source] serde_json::Error),
    #[error("payload of {len} bytes exceeds the maximum of {MAX_PAYLOAD}")]
    PayloadTooLarge { len: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Control = 1,
    Data = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub channel: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn control<T: Serialize>(stream: u32, msg: &T) -> Result<Frame, ProtoError> {
        let payload = serde_json::to_vec(msg).map_err(ProtoError::Encode)?;
        if payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::PayloadTooLarge { len: payload.len() });
        }
        Ok(Frame {
            kind: Kind::Control,
            channel: 0,
            stream,
            payload,
        })
    }

    /// A data frame; callers split larger buffers into [`MAX_PAYLOAD`] pieces.
    pub fn data(stream: u32, channel: u8, payload: Vec<u8>) -> Result<Frame, ProtoError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::PayloadTooLarge { len: payload.len() });
        }
        Ok(Frame {
            kind: Kind::Data,
            channel,
            stream,
            payload,
        })
    }

    /// Decodes the JSON payload of a control frame.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ProtoError> {
        serde_json::from_slice(&self.payload).map_err(|source| ProtoError::BadControl {
            stream: self.stream,
            source,
        })
    }
}

/// Appends the encoded frame to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let len = (HEADER_LEN + frame.payload.len()) as u32;
    out.extend_from_slice(&len.to_be_bytes());
    out.push(frame.kind as u8);
    out.push(frame.channel);
    out.extend_from_slice(&frame.stream.to_be_bytes());
    out.extend_from_slice(&frame.payload);
}

/// Incremental decoder: feed bytes as they arrive, take whole frames out.
/// Frames taken leave the buffer at the next [`Decoder::feed`], once per
/// read rather than once per frame (a stream of tiny frames would
/// otherwise move the rest of the buffer for each one).
#[derive(Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`.
    start: usize,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet form a whole frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed. After an
    /// error the stream is out of sync and the connection must be dropped.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtoError> {
        let buf = &self.buf[self.start..];
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len > MAX_FRAME {
            return Err(ProtoError::FrameTooLarge { len });
        }
        if len < HEADER_LEN {
            return Err(ProtoError::FrameTooShort { len });
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let kind = match buf[4] {
            1 => Kind::Control,
            2 => Kind::Data,
            kind => return Err(ProtoError::UnknownKind { kind }),
        };
        let channel = buf[5];
        let stream = u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]);
        let payload = buf[4 + HEADER_LEN..4 + len].to_vec();
        self.start += 4 + len;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        Ok(Some(Frame {
            kind,
            channel,
            stream,
            payload,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(frames: &[Frame], chunk: usize) -> Vec<Frame> {
        let mut bytes = Vec::new();
        for f in frames {
            encode(f, &mut bytes);
        }
        let mut dec = Decoder::new();
        let mut out = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            dec.feed(piece);
            while let Some(f) = dec.next_frame().unwrap() {
                out.push(f);
            }
        }
        assert_eq!(dec.buffered(), 0);
        out
    }

    #[test]
    fn many_tiny_frames_of_one_read_come_out_in_order_and_the_rest_waits() {
        let mut bytes = Vec::new();
        for i in 0..10_000u32 {
            encode(
                &Frame {
                    kind: Kind::Data,
                    channel: 1,
                    stream: i,
                    payload: vec![i as u8],
                },
                &mut bytes,
            );
        }
        let whole = bytes.len();
        bytes.extend_from_slice(&[0, 0]); // half of the next frame's length
        let mut dec = Decoder::new();
        dec.feed(&bytes);
        for i in 0..10_000u32 {
            let f = dec.next_frame().unwrap().unwrap();
            assert_eq!((f.stream, f.payload[0]), (i, i as u8));
            assert_eq!(
                dec.buffered(),
                bytes.len() - whole * (i as usize + 1) / 10_000
            );
        }
        assert!(dec.next_frame().unwrap().is_none());
        assert_eq!(dec.buffered(), 2);
        // The next read completes it.
        dec.feed(&[0, (HEADER_LEN + 1) as u8, 2, 3, 0, 0, 0, 9, 42]);
        let f = dec.next_frame().unwrap().unwrap();
        assert_eq!(
            (f.kind, f.channel, f.stream, f.payload),
            (Kind::Data, 3, 9, vec![42])
        );
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn frames_survive_any_split() {
        let frames = vec![
            Frame::data(7, 1, b"hello".to_vec()).unwrap(),
            Frame::data(9, 2, vec![0u8; MAX_PAYLOAD]).unwrap(),
            Frame::data(1, 0, vec![]).unwrap(),
        ];
        for chunk in [1, 3, 4, 10, 4096, usize::MAX] {
            assert_eq!(roundtrip(&frames, chunk), frames);
        }
    }

    #[test]
    fn oversized_and_short_frames_are_refused() {
        let mut dec = Decoder::new();
        dec.feed(&((MAX_FRAME + 1) as u32).to_be_bytes());
        assert!(matches!(
            dec.next_frame(),
            Err(ProtoError::FrameTooLarge { .. })
        ));
        let mut dec = Decoder::new();
        dec.feed(&[0, 0, 0, 2, 1, 0]);
        assert!(matches!(
            dec.next_frame(),
            Err(ProtoError::FrameTooShort { len: 2 })
        ));
        let mut dec = Decoder::new();
        dec.feed(&[0, 0, 0, 6, 9, 0, 0, 0, 0, 0]);
        assert!(matches!(
            dec.next_frame(),
            Err(ProtoError::UnknownKind { kind: 9 })
        ));
        assert!(Frame::data(1, 1, vec![0; MAX_PAYLOAD + 1]).is_err());
    }

    #[test]
    fn decoder_never_panics_on_garbage() {
        // A cheap deterministic fuzz: xorshift bytes fed in odd pieces.
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..2000 {
            let mut dec = Decoder::new();
            let mut bytes = Vec::new();
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                bytes.push(x as u8);
            }
            // Keep lengths small so some frames complete.
            bytes[0] = 0;
            bytes[1] = 0;
            dec.feed(&bytes);
            while let Ok(Some(_)) = dec.next_frame() {}
        }
    }
}
