//! Body types and bounded reading.
//!
//! - `budget.rs`: the process-wide budget for buffered request bodies.

pub mod budget;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

pub use crate::net::errors::BoxError;

/// Every body the proxy sends, to clients and to the upstream.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn boxed<B>(body: B) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// Why a bounded read stopped early.
#[derive(Debug)]
pub enum ReadError {
    TooLarge,
    /// `room` refused the next chunk (the body budget is spent).
    NoRoom,
    Failed(BoxError),
}

/// Reads `body` whole, failing as soon as it passes `limit` bytes (the rest
/// stays unread in `body`, for [`drain`]). `expected` sizes the buffer
/// once when the length is known, so it never holds more than that.
/// `room(buf, more)` is asked before each chunk is appended: it makes room
/// for `more` bytes past `buf`'s length (growing its capacity itself, so
/// whoever accounts for the memory sees every allocation), or refuses.
pub async fn read_limited<B>(
    body: &mut B,
    limit: u64,
    expected: Option<u64>,
    mut room: impl FnMut(&mut Vec<u8>, usize) -> bool,
) -> Result<Vec<u8>, ReadError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let capacity = expected.map_or(0, |n| n.min(limit));
    let mut buf = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        if let Ok(data) = frame.into_data() {
            if (buf.len() + data.len()) as u64 > limit {
                return Err(ReadError::TooLarge);
            }
            if !room(&mut buf, data.len()) {
                return Err(ReadError::NoRoom);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf)
}

/// Reads and discards what is left of a refused request body, at most
/// `max_bytes` and `max_time`. Answering while the client is still sending
/// and then closing makes its kernel see a reset, which can destroy the
/// response before the client reads it (nginx's "lingering close").
/// Returns whether the body was read to its end.
pub async fn drain<B>(body: &mut B, max_bytes: u64, max_time: std::time::Duration) -> bool
where
    B: Body<Data = Bytes> + Unpin,
{
    let discard = async {
        let mut seen: u64 = 0;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Ok(data) = frame.into_data() {
                seen += data.len() as u64;
                if seen > max_bytes {
                    return false;
                }
            }
        }
        true
    };
    tokio::time::timeout(max_time, discard)
        .await
        .unwrap_or(false)
}

/// Chunks already read from a body, followed by the rest of it: lets the
/// proxy look at the start of an upstream response (to store it) and still
/// stream all of it when it turns out too large to keep.
pub struct Prefixed<B> {
    head: VecDeque<Bytes>,
    rest: B,
}

impl<B> Prefixed<B> {
    pub fn new(head: Vec<Bytes>, rest: B) -> Self {
        Self {
            head: head.into(),
            rest,
        }
    }
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(chunk) = self.head.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let head: u64 = self.head.iter().map(|b| b.len() as u64).sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + head);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn read_limited_accepts_the_limit_and_rejects_one_more_byte() {
        let any = |_: &mut Vec<u8>, _: usize| true;
        let ok = read_limited(&mut Full::new(Bytes::from_static(b"12345")), 5, None, any).await;
        assert_eq!(ok.unwrap(), b"12345");
        let over = read_limited(
            &mut Full::new(Bytes::from_static(b"123456")),
            5,
            Some(6),
            any,
        )
        .await;
        assert!(matches!(over, Err(ReadError::TooLarge)));
    }

    #[tokio::test]
    async fn prefixed_body_yields_head_then_rest() {
        let body = Prefixed::new(
            vec![Bytes::from_static(b"ab"), Bytes::from_static(b"c")],
            Full::new(Bytes::from_static(b"def")),
        );
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all, Bytes::from_static(b"abcdef"));
    }
}
