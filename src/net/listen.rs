//! The one accept loop: the proxy's, the admin's and the demo's listeners
//! (and the test servers) accept through [`serve`].
//!
//! It holds a connection slot (a semaphore permit) before it accepts, so
//! past the limit connections wait in the kernel's backlog instead of
//! being accepted and starved; each accepted connection runs on a task of
//! the caller's [`TaskTracker`], which is how shutdown knows when they have
//! ended; the loop ends, dropping the socket, when `stop` resolves.
//!
//! Accept errors are of two kinds (as hyper 0.14's and axum's loops tell
//! them apart): a connection that died in the backlog costs only itself,
//! so the next is accepted at once; anything else (out of descriptors,
//! memory or buffers: EMFILE, ENFILE, ENOMEM, ENOBUFS) would fail again
//! straight away, so the loop backs off for [`ACCEPT_BACKOFF`] instead of
//! spinning, giving connections time to end and free what it lacks.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// How long the loop waits after an accept error that is not the
/// connection's own.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What an accept error says about the next accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AcceptError {
    /// The connection was reset or aborted before it was accepted: the
    /// next one is unaffected.
    Connection,
    /// The process or system lacks something (descriptors, memory): an
    /// accept now would fail the same way.
    Resource,
}

fn classify(e: &io::Error) -> AcceptError {
    match e.kind() {
        io::ErrorKind::ConnectionAborted
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionRefused => AcceptError::Connection,
        _ => AcceptError::Resource,
    }
}

/// Accepts on `listener` until `stop` resolves, with at most `limit`
/// connections open at once; each is served by the future `connection`
/// makes of it, on a task of `tasks`. `name` tells the listeners apart in
/// the log.
pub async fn serve<S, F>(
    name: &'static str,
    listener: TcpListener,
    limit: usize,
    tasks: &TaskTracker,
    stop: impl Future<Output = ()>,
    mut connection: S,
) where
    S: FnMut(TcpStream, SocketAddr) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limit));
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the slots are never closed"),
            () = &mut stop => return,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    if classify(&e) == AcceptError::Connection {
                        debug!(listener = name, error = %e, "connection lost before it was accepted");
                    } else {
                        warn!(listener = name, error = %e, "accept failed");
                        tokio::select! {
                            () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                            () = &mut stop => return,
                        }
                    }
                    continue;
                }
            },
            () = &mut stop => return,
        };
        let served = connection(stream, peer);
        tasks.spawn(async move {
            served.await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_of_the_connection_are_retried_at_once_others_back_off() {
        use io::ErrorKind::*;
        let connection =
            [ConnectionAborted, ConnectionReset, ConnectionRefused].map(io::Error::from);
        for e in connection {
            assert_eq!(classify(&e), AcceptError::Connection, "{e:?}");
        }
        let mut resource = vec![io::Error::from(OutOfMemory), io::Error::other("unknown")];
        // EMFILE, ENFILE, ENOBUFS, ENOMEM as Linux numbers them.
        #[cfg(target_os = "linux")]
        resource.extend([24, 23, 105, 12].map(io::Error::from_raw_os_error));
        for e in resource {
            assert_eq!(classify(&e), AcceptError::Resource, "{e:?}");
        }
    }
}
