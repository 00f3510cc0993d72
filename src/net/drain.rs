//! [`Drain`]: graceful shutdown as one value whose fields are its phases,
//! in the order they happen (as mini-redis's `Listener` names its shutdown
//! handles by what they are for).

use std::future::Future;
use std::time::Duration;
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// The shutdown phases of one server. Handles are shared by cloning the
/// fields; the phases are entered in order, through the methods.
#[derive(Default)]
pub struct Drain {
    /// 1. Shutdown was asked for: readiness fails, so load balancers move
    ///    traffic away, while the listeners still accept (for a delay).
    pub requested: CancellationToken,
    /// 2. The listeners stop accepting: their loops end, sockets close.
    pub stop_accepting: CancellationToken,
    /// 3. Every open connection starts its graceful close, and what waits
    ///    on a connection's behalf (duplicates of a request in flight)
    ///    answers now.
    pub close_connections: CancellationToken,
    /// The open connections, waited for in phase 3 until the grace ends.
    pub connections: TaskTracker,
    /// 4. Detached work that outlives its connection (upstream calls and
    ///    the store writes that record them), waited for until the same
    ///    deadline.
    pub tasks: TaskTracker,
    /// 5. The background loops and the remaining listeners end.
    pub stop: CancellationToken,
}

impl Drain {
    /// Phases 1 and 2: when `shutdown` resolves, shutdown is requested;
    /// the listeners stop accepting `delay` later.
    pub async fn request_on(&self, shutdown: impl Future<Output = ()>, delay: Duration) {
        shutdown.await;
        self.requested.cancel();
        if !delay.is_zero() {
            info!(delay = ?delay, "shutdown requested: readiness fails, still accepting for the delay");
            tokio::time::sleep(delay).await;
        }
        self.stop_accepting.cancel();
    }

    /// Phase 3: closes every connection and waits for them until
    /// `deadline`; false when some were still open then.
    pub async fn close_connections(&self, deadline: Instant) -> bool {
        self.close_connections.cancel();
        wait(&self.connections, deadline).await
    }

    /// Phase 4: waits for the detached tasks until `deadline`; false when
    /// some were still running then.
    pub async fn wait_tasks(&self, deadline: Instant) -> bool {
        wait(&self.tasks, deadline).await
    }
}

async fn wait(tracker: &TaskTracker, deadline: Instant) -> bool {
    tracker.close();
    timeout_at(deadline, tracker.wait()).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accepting stops only after the delay; a connection that closes is
    /// waited for, a task past the deadline is not.
    #[tokio::test(start_paused = true)]
    async fn phases_run_in_order_and_the_grace_bounds_the_waits() {
        let drain = Drain::default();
        let started = Instant::now();
        let delay = Duration::from_secs(5);
        let requesting = drain.request_on(tokio::time::sleep(Duration::from_secs(1)), delay);
        tokio::join!(requesting, async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(drain.requested.is_cancelled());
            assert!(!drain.stop_accepting.is_cancelled(), "before the delay");
        });
        assert_eq!(started.elapsed(), Duration::from_secs(6));

        let closing = drain.close_connections.clone();
        drain
            .connections
            .spawn(async move { closing.cancelled().await });
        drain
            .tasks
            .spawn(tokio::time::sleep(Duration::from_secs(60)));
        let deadline = Instant::now() + Duration::from_secs(10);
        assert!(drain.close_connections(deadline).await, "closed in time");
        assert!(!drain.wait_tasks(deadline).await, "outlived the grace");
        assert_eq!(Instant::now(), deadline);
    }
}
