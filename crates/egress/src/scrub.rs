//! Scrubbing a secret's value from what its host answers, so a host that
//! echoes a request back (an error quoting a header, a debug endpoint) does
//! not show the value to the code that sent it. Each occurrence becomes as
//! many `*`, so lengths (`Content-Length`, ranges) stay true.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What an occurrence is replaced with, byte for byte.
const MASK: u8 = b'*';

/// A streaming scrubber: bytes in, the same number of bytes out, every
/// needle masked even when it is split across chunks. It holds back at most
/// the longest needle's length minus one.
pub(crate) struct Scrubber {
    needles: Vec<Vec<u8>>,
    /// The tail of what came in that may be the start of a needle.
    held: Vec<u8>,
}

impl Scrubber {
    /// `None` when there is nothing to scrub.
    pub(crate) fn new(needles: Vec<Vec<u8>>) -> Option<Self> {
        let needles = longest_first(&needles);
        (!needles.is_empty()).then_some(Self {
            needles,
            held: Vec::new(),
        })
    }

    /// Takes the next chunk; returns what can be let through now.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.held.len() + chunk.len());
        buf.extend_from_slice(&self.held);
        buf.extend_from_slice(chunk);
        self.mask(&mut buf);
        let keep = self.partial_tail(&buf);
        let out = buf.split_to(buf.len() - keep);
        self.held.clear();
        self.held.extend_from_slice(&buf);
        out.freeze()
    }

    /// The end of the stream: what was held back (it holds no whole needle).
    pub(crate) fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.held))
    }

    /// Masks every whole needle in `buf`.
    fn mask(&self, buf: &mut [u8]) {
        for needle in &self.needles {
            mask_all(buf, needle);
        }
    }

    /// How many bytes at the end of `buf` could begin a needle that the
    /// next chunk completes. Holding only those (not always the longest
    /// needle's length) lets a stream of small messages, such as
    /// server-sent events, through without delay.
    fn partial_tail(&self, buf: &[u8]) -> usize {
        let mut keep = 0;
        for needle in &self.needles {
            let longest = (needle.len() - 1).min(buf.len());
            for n in (keep + 1..=longest).rev() {
                if buf[buf.len() - n..] == needle[..n] {
                    keep = n;
                    break;
                }
            }
        }
        keep
    }
}

/// The non-empty needles, longest first: a value that contains another
/// (`v` and `v-p`) is masked whole before the shorter one is looked for.
fn longest_first(needles: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = needles.iter().filter(|n| !n.is_empty()).cloned().collect();
    out.sort_by_key(|n| std::cmp::Reverse(n.len()));
    out
}

/// Replaces each occurrence of `needle` in `buf` with [`MASK`].
fn mask_all(buf: &mut [u8], needle: &[u8]) {
    let (n, first) = (needle.len(), needle[0]);
    let mut i = 0;
    while i + n <= buf.len() {
        if buf[i] == first && buf[i..i + n] == *needle {
            buf[i..i + n].fill(MASK);
            i += n;
        } else {
            i += 1;
        }
    }
}

/// Masks the needles in every header value.
pub(crate) fn scrub_headers(headers: &mut HeaderMap, needles: &[Vec<u8>]) {
    let needles = longest_first(needles);
    for value in headers.values_mut() {
        let mut bytes = value.as_bytes().to_vec();
        for needle in &needles {
            mask_all(&mut bytes, needle);
        }
        if bytes != value.as_bytes() {
            // The mask is a visible ASCII byte: the value stays valid.
            if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                *value = v;
            }
        }
    }
}

/// A response body passed through a [`Scrubber`]; trailers are scrubbed
/// too. Its size hint is the inner one: scrubbing keeps every length.
pub(crate) struct ScrubbedBody<B> {
    inner: B,
    scrubber: Scrubber,
    /// A trailers frame waiting until the held-back bytes went out.
    trailers: Option<HeaderMap>,
    done: bool,
}

impl<B> ScrubbedBody<B> {
    pub(crate) fn new(inner: B, scrubber: Scrubber) -> Self {
        Self {
            inner,
            scrubber,
            trailers: None,
            done: false,
        }
    }
}

impl<B> Body for ScrubbedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let out = this.scrubber.push(&data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(frame) => {
                        if let Ok(mut t) = frame.into_trailers() {
                            scrub_headers(&mut t, &this.scrubber.needles);
                            this.trailers = Some(t);
                        }
                    }
                },
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = this.scrubber.finish();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Copies `from` to `to` through `scrubber` until `from` ends, then shuts
/// `to` down. For an upgraded stream's bytes from the destination.
pub(crate) async fn copy_scrubbed<R, W>(mut from: R, mut to: W, mut scrubber: Scrubber)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let out = scrubber.push(&buf[..n]);
        if to.write_all(&out).await.is_err() {
            return;
        }
    }
    let _ = to.write_all(&scrubber.finish()).await;
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn scrubber(needles: &[&str]) -> Scrubber {
        Scrubber::new(needles.iter().map(|n| n.as_bytes().to_vec()).collect()).unwrap()
    }

    /// Feeds `chunks` in order; returns everything let through.
    fn run(s: &mut Scrubber, chunks: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&s.push(c));
        }
        out.extend_from_slice(&s.finish());
        out
    }

    #[test]
    fn several_occurrences_become_masks_of_the_same_length() {
        let mut s = scrubber(&["sk-secret"]);
        let out = run(&mut s, &[b"a sk-secret b sk-secretsk-secret c"]);
        assert_eq!(out, b"a ********* b ****************** c");
    }

    #[test]
    fn a_value_inside_a_longer_one_leaves_nothing_of_either() {
        let mut s = scrubber(&["sk-1", "sk-1-p"]);
        assert_eq!(run(&mut s, &[b"a sk-1-p b sk-1 c"]), b"a ****** b **** c");
        let mut h = HeaderMap::new();
        h.insert("x", HeaderValue::from_static("sk-1-p"));
        scrub_headers(&mut h, &[b"sk-1".to_vec(), b"sk-1-p".to_vec()]);
        assert_eq!(h["x"], "******");
    }

    #[test]
    fn a_value_split_across_chunks_is_caught_at_every_cut() {
        let text = b"head sk-secret-42 tail";
        for cut in 0..=text.len() {
            for cut2 in cut..=text.len() {
                let mut s = scrubber(&["sk-secret-42"]);
                let out = run(&mut s, &[&text[..cut], &text[cut..cut2], &text[cut2..]]);
                assert_eq!(out, b"head ************ tail", "cut at {cut} and {cut2}");
            }
        }
        // One byte at a time.
        let mut s = scrubber(&["sk-secret-42"]);
        let chunks: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(run(&mut s, &chunks), b"head ************ tail");
    }

    #[test]
    fn the_percent_encoded_form_is_caught_too() {
        let mut s = scrubber(&["a b&c", "a%20b%26c"]);
        let out = run(&mut s, &[b"q=a%20b", b"%26c and a b&c"]);
        assert_eq!(out, b"q=********* and *****");
    }

    #[test]
    fn only_a_possible_start_of_a_needle_is_held_back() {
        let mut s = scrubber(&["sk-secret"]);
        // Nothing here can begin the value: all of it goes through at once.
        assert_eq!(&s.push(b"data: {}\n\n")[..], b"data: {}\n\n");
        // "sk-" may be its start: held until the next chunk says.
        assert_eq!(&s.push(b"x sk-")[..], b"x ");
        assert_eq!(&s.push(b"other")[..], b"sk-other");
        assert_eq!(&s.finish()[..], b"");
        // Never more than the longest needle less one.
        let mut s = scrubber(&["aaaa"]);
        assert_eq!(&s.push(b"aaaaaaa")[..], b"****");
        assert_eq!(s.held.len(), 3);
    }

    #[test]
    fn nothing_to_scrub_is_no_scrubber() {
        assert!(Scrubber::new(vec![]).is_none());
        assert!(Scrubber::new(vec![Vec::new()]).is_none());
    }

    #[test]
    fn header_values_are_masked() {
        let mut h = HeaderMap::new();
        h.insert("x-echo", HeaderValue::from_static("Bearer sk-secret"));
        h.insert("location", HeaderValue::from_static("/a?k=sk-secret&b"));
        h.insert("x-other", HeaderValue::from_static("fine"));
        scrub_headers(&mut h, &[b"sk-secret".to_vec()]);
        assert_eq!(h["x-echo"], "Bearer *********");
        assert_eq!(h["location"], "/a?k=*********&b");
        assert_eq!(h["x-other"], "fine");
    }

    #[tokio::test]
    async fn a_body_is_scrubbed_across_frames_and_keeps_its_length() {
        let chunks = [
            &b"{\"echo\":\"sk-se"[..],
            b"cret\",",
            b"\"again\":\"s",
            b"k-secret\"}",
        ];
        let inner = Frames(chunks.iter().map(|c| Bytes::copy_from_slice(c)).collect());
        let body = ScrubbedBody::new(inner, scrubber(&["sk-secret"]));
        let out = body.collect().await.unwrap().to_bytes();
        assert_eq!(
            &out[..],
            b"{\"echo\":\"*********\",\"again\":\"*********\"}"
        );
    }

    #[tokio::test]
    async fn an_upgraded_stream_is_scrubbed() {
        let (mut up, up_far) = tokio::io::duplex(64);
        let (guest_far, mut guest) = tokio::io::duplex(64);
        let task = tokio::spawn(copy_scrubbed(up_far, guest_far, scrubber(&["sk-secret"])));
        up.write_all(b"frame sk-sec").await.unwrap();
        up.write_all(b"ret end").await.unwrap();
        drop(up);
        let mut out = Vec::new();
        guest.read_to_end(&mut out).await.unwrap();
        task.await.unwrap();
        assert_eq!(out, b"frame ********* end");
    }

    /// A body of the given frames, one per poll.
    struct Frames(std::collections::VecDeque<Bytes>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }
}
