//! One served connection (the proxy's, through hyper-util's auto builder,
//! or the admin's HTTP/1), under the deadlines no hyper timer covers, and
//! closed gracefully on shutdown.
//!
//! hyper's HTTP/1 `header_read_timeout` only starts once the auto builder
//! has told HTTP/1 from HTTP/2, which waits for up to 24 bytes of the h2
//! preface; HTTP/2 has no head deadline at all, and an HTTP/2 connection
//! with no open stream stays open as long as its peer answers pings. So a
//! client that connects and sends nothing, one byte or part of the preface
//! would hold its connection slot forever. This module adds two deadlines
//! around the whole connection:
//!
//! - **head**: from accept until the first request head is complete
//!   (`server.header_read_timeout`), covering protocol detection and the
//!   HTTP/2 preface and SETTINGS exchange;
//! - **idle**: while no request is in progress after that
//!   (`server.idle_timeout`): HTTP/1.1 between requests, HTTP/2 with no
//!   open stream. An HTTP/1.1 connection is also held to hyper's own
//!   `header_read_timeout` for its next head, which starts when the
//!   previous response ends, so it closes at whichever is shorter.
//!
//! A request is in progress from the moment hyper hands its head to the
//! service until its response body is sent or dropped ([`Guarded`]). The
//! counts are atomics the deadline reads, at least every quarter of the
//! idle time, so a connection closes at most that much after its deadline
//! and a request never wakes its connection's task. At a deadline the connection is shut down gracefully (an HTTP/2 peer gets a
//! GOAWAY) and dropped if it has not closed [`CLOSE_GRACE`] later. The
//! durations come from the caller (the server's config).

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::{service_fn, Service};
use hyper_util::server::graceful::GracefulConnection;
use std::convert::Infallible;
use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// How long a connection being closed (deadline or shutdown) may take to
/// finish its goodbye once no request is in progress: an HTTP/2 GOAWAY and
/// its ping round trip. A peer that does not answer is dropped after it.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The two deadlines (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// From accept to the first complete request head.
    pub head: Duration,
    /// With no request in progress, after the first.
    pub idle: Duration,
}

/// How many requests are in progress on one connection, and when the last
/// one ended, as [`track`] counts them: what the deadlines of [`serve`]
/// read. Atomics, read only when a deadline is due: a request costs two
/// counter updates and a clock read, never a wake-up of the connection.
pub struct Activity(Arc<Counts>);

struct Counts {
    /// When the connection was accepted: the origin of `last_end`.
    epoch: Instant,
    in_progress: AtomicUsize,
    /// Nanoseconds from `epoch` to the end of the last request, plus one;
    /// 0 while none has ended.
    last_end: AtomicU64,
}

impl Counts {
    fn snapshot(&self) -> Seen {
        // The end time is written before the count drops (Release, below),
        // so a count of zero is read with the end that made it so.
        let busy = self.in_progress.load(Ordering::Acquire) > 0;
        let last_end = match self.last_end.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.epoch + Duration::from_nanos(n - 1)),
        };
        Seen { busy, last_end }
    }
}

/// The service of one connection: `handler` answers each request, which is
/// counted in progress from its head until its response body is sent or
/// dropped ([`Guarded`]).
pub fn track<H, F, B>(
    handler: H,
) -> (
    impl Service<
            Request<Incoming>,
            Response = Response<Guarded<B, InProgress>>,
            Error = Infallible,
            Future: Send + 'static,
        > + Send
        + 'static,
    Activity,
)
where
    H: Fn(Request<Incoming>) -> F + Send + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Unpin + Send + 'static,
{
    let counts = Arc::new(Counts {
        epoch: Instant::now(),
        in_progress: AtomicUsize::new(0),
        last_end: AtomicU64::new(0),
    });
    let activity = Activity(counts.clone());
    let svc = service_fn(move |req| {
        let guard = InProgress::begin(&counts);
        let resp = handler(req);
        async move { Ok::<_, Infallible>(resp.await.map(|body| Guarded::new(body, guard))) }
    });
    (svc, activity)
}

/// What the deadline check saw of a connection's requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    busy: bool,
    /// When the last request ended; `None` before any has.
    last_end: Option<Instant>,
}

/// What a connection does when its deadline is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Due {
    /// Not yet: look again then.
    Recheck(Instant),
    /// Its time is up: shut it down gracefully (or, while closing, drop it).
    Expired,
}

/// The deadline decision, pure: `accepted` is when the connection opened,
/// `closing` when its graceful shutdown began (if it has). Idle time counts
/// from the last request's end (or from the shutdown, when later). Requests
/// begin and end unseen between two looks, so the connection is looked at
/// again at least every quarter of the idle time (of the close grace while
/// closing): it closes at most that late.
fn due(now: Instant, seen: Seen, accepted: Instant, closing: Option<Instant>, d: Deadlines) -> Due {
    let (limit, tick) = match (closing, seen.last_end) {
        (Some(at), end) => (
            end.map_or(at, |end| end.max(at)) + CLOSE_GRACE,
            CLOSE_GRACE / 4,
        ),
        (None, None) => (accepted + d.head, d.idle / 4),
        (None, Some(end)) => (end + d.idle, d.idle / 4),
    };
    let next = now + tick.max(MIN_TICK);
    match seen.busy {
        true => Due::Recheck(next),
        false if now >= limit => Due::Expired,
        false => Due::Recheck(limit.min(next)),
    }
}

/// The shortest time between two looks at a connection's deadlines.
const MIN_TICK: Duration = Duration::from_millis(10);

/// Serves `conn` (a hyper connection whose service came from [`track`],
/// with `activity`) until it ends: its deadlines run out, `close` is
/// cancelled (graceful shutdown) and it finishes, or the peer closes it.
// Not an `async fn`: the future's `Send` is proven here, for any `C`,
// rather than at each caller's spawn (where hyper's higher-ranked bounds
// defeat the check).
#[allow(clippy::manual_async_fn)]
pub fn serve<C>(
    conn: C,
    activity: Activity,
    deadlines: Deadlines,
    close: CancellationToken,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static
where
    C: GracefulConnection + Send + 'static,
    C::Error: Display,
{
    async move {
        let counts = activity.0;
        tokio::pin!(conn);
        let accepted = counts.epoch;
        let mut closing: Option<Instant> = None;
        let next =
            |now: Instant, closing| match due(now, counts.snapshot(), accepted, closing, deadlines)
            {
                Due::Recheck(at) => at,
                Due::Expired => now,
            };
        let mut deadline = next(Instant::now(), None);
        loop {
            tokio::select! {
                ended = conn.as_mut() => {
                    if let Err(e) = ended {
                        debug!(error = %e, client.addr = %peer, "connection ended with an error");
                    }
                    return;
                }
                () = sleep_until(deadline) => {
                    let now = Instant::now();
                    match due(now, counts.snapshot(), accepted, closing, deadlines) {
                        Due::Recheck(at) => deadline = at,
                        Due::Expired if closing.is_some() => {
                            debug!(client.addr = %peer, "connection did not close in time; dropped");
                            return;
                        }
                        Due::Expired => {
                            debug!(client.addr = %peer, "no request in time; closing the connection");
                            conn.as_mut().graceful_shutdown();
                            closing = Some(now);
                            deadline = now + CLOSE_GRACE;
                        }
                    }
                }
                () = close.cancelled(), if closing.is_none() => {
                    conn.as_mut().graceful_shutdown();
                    let now = Instant::now();
                    closing = Some(now);
                    deadline = next(now, closing);
                }
            }
        }
    }
}

/// Counts one request as in progress on its connection while it lives.
pub struct InProgress(Arc<Counts>);

impl InProgress {
    fn begin(counts: &Arc<Counts>) -> Self {
        counts.in_progress.fetch_add(1, Ordering::AcqRel);
        Self(counts.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let counts = &self.0;
        let since = Instant::now().saturating_duration_since(counts.epoch);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - 1);
        counts.last_end.fetch_max(nanos + 1, Ordering::Release);
        counts.in_progress.fetch_sub(1, Ordering::Release);
    }
}

/// A body that holds `guard` until hyper has sent it (or dropped it): a
/// request in progress ([`track`]: a long streamed response is not
/// idleness), a gauge of requests in flight.
pub struct Guarded<B, G> {
    body: B,
    _guard: G,
}

impl<B, G> Guarded<B, G> {
    pub fn new(body: B, guard: G) -> Self {
        Self {
            body,
            _guard: guard,
        }
    }
}

impl<B: Body + Unpin, G: Unpin> Body for Guarded<B, G> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_due_after_the_head_then_the_idle_time_then_the_close_grace() {
        let d = Deadlines {
            head: Duration::from_secs(10),
            idle: Duration::from_secs(60),
        };
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let idle = |end: Option<u64>| Seen {
            busy: false,
            last_end: end.map(|e| t0 + s(e)),
        };
        let busy = |end: Option<u64>| Seen {
            busy: true,
            ..idle(end)
        };
        // (now, seen, closing since) -> due; the idle time's quarter is 15 s.
        let cases = [
            // No request yet: the head deadline, from accept.
            (10, idle(None), None, Due::Expired),
            (4, idle(None), None, Due::Recheck(t0 + s(10))),
            // A request in progress is never idle: looked at again later.
            (10, busy(None), None, Due::Recheck(t0 + s(25))),
            (100, busy(Some(5)), None, Due::Recheck(t0 + s(115))),
            // Idle time counts from the last request's end.
            (64, idle(Some(5)), None, Due::Recheck(t0 + s(65))),
            (65, idle(Some(5)), None, Due::Expired),
            (30, idle(Some(29)), None, Due::Recheck(t0 + s(45))),
            // Closing: one grace period from the shutdown or the last end,
            // whichever is later, once nothing is in progress.
            (
                20,
                idle(Some(5)),
                Some(20),
                Due::Recheck(t0 + s(20) + CLOSE_GRACE / 4),
            ),
            (21, idle(Some(5)), Some(20), Due::Expired),
            (
                29,
                idle(Some(29)),
                Some(20),
                Due::Recheck(t0 + s(29) + CLOSE_GRACE / 4),
            ),
            (30, idle(Some(29)), Some(20), Due::Expired),
            (
                25,
                busy(Some(5)),
                Some(20),
                Due::Recheck(t0 + s(25) + CLOSE_GRACE / 4),
            ),
            (21, idle(None), Some(20), Due::Expired),
        ];
        for (now, seen, closing, want) in cases {
            let got = due(t0 + s(now), seen, t0, closing.map(|c| t0 + s(c)), d);
            assert_eq!(got, want, "now {now}, {seen:?}, closing {closing:?}");
        }
    }
}
