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
//! service until its response body is sent or dropped ([`Guarded`]). At a
//! deadline the connection is shut down gracefully (an HTTP/2 peer gets a
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
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::watch;
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

/// How many requests are in progress on one connection, as [`track`]
/// counts them: what the idle deadline of [`serve`] watches.
pub struct Activity(watch::Receiver<usize>);

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
    let (in_progress, changes) = watch::channel(0usize);
    let in_progress = Arc::new(in_progress);
    let svc = service_fn(move |req| {
        let guard = InProgress::begin(&in_progress);
        let resp = handler(req);
        async move { Ok::<_, Infallible>(resp.await.map(|body| Guarded::new(body, guard))) }
    });
    (svc, Activity(changes))
}

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
        let mut changes = activity.0;
        tokio::pin!(conn);
        let mut deadline = Instant::now() + deadlines.head;
        let mut idle = true;
        let mut closing = false;
        let mut watching = true;
        loop {
            tokio::select! {
                ended = conn.as_mut() => {
                    if let Err(e) = ended {
                        debug!(error = %e, client.addr = %peer, "connection ended with an error");
                    }
                    return;
                }
                changed = changes.changed(), if watching => {
                    if changed.is_err() {
                        watching = false;
                        continue;
                    }
                    let busy = *changes.borrow_and_update() > 0;
                    if busy {
                        idle = false;
                    } else if !idle {
                        idle = true;
                        let wait = if closing { CLOSE_GRACE } else { deadlines.idle };
                        deadline = Instant::now() + wait;
                    }
                }
                () = sleep_until(deadline), if idle => {
                    if closing {
                        debug!(client.addr = %peer, "connection did not close in time; dropped");
                        return;
                    }
                    debug!(client.addr = %peer, "no request in time; closing the connection");
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                    deadline = Instant::now() + CLOSE_GRACE;
                }
                () = close.cancelled(), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                    if idle {
                        deadline = Instant::now() + CLOSE_GRACE;
                    }
                }
            }
        }
    }
}

/// Counts one request as in progress on its connection while it lives.
pub struct InProgress(Arc<watch::Sender<usize>>);

impl InProgress {
    fn begin(count: &Arc<watch::Sender<usize>>) -> Self {
        count.send_modify(|n| *n += 1);
        Self(count.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
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
