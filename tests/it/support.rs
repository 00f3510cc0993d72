//! Shared harness for the integration tests. Every suite uses the same
//! pieces:
//!
//! - [`brokers`]: RabbitMQ and NATS JetStream for the consumer tests;
//! - [`serve`]: the one test server builder (HTTP/1.1, h2c, TLS, a handler);
//! - [`upstream`]: a counting test upstream on 127.0.0.1:0;
//! - [`proxy`]: the proxy in-process on a real socket, per [`Backend`];
//! - [`process`]: the real binary as a child process (`serve`, one-shot commands);
//! - [`config`]: the config file either of them runs on, as a TOML table;
//! - [`client`]: requests and responses, fresh or on kept-alive connections;
//! - [`pg_cluster`]: a private PostgreSQL cluster with TLS (its own CA);
//! - [`pgbouncer`]: a private PgBouncer in transaction pooling mode;
//! - [`tls_upstream`]: a test CA and an HTTPS upstream (TLS, ALPN, mTLS);
//! - [`h2_upstream`]: a gRPC-shaped h2c upstream that answers with trailers;
//! - [`h2_refusing`]: h2c upstreams that refuse streams (REFUSED_STREAM, GOAWAY);
//! - [`ws_upstream`]: a WebSocket echo upstream and frame helpers;
//! - [`services`]: PostgreSQL and Redis (URLs, schemas, a private
//!   `redis-server`, a TCP relay that can cut PostgreSQL off);
//! - for the invariant harness: [`recording_upstream`] (logs every
//!   execution), [`traffic`] (mixed clients, what each saw) and
//!   [`checker`] (the invariants over both);
//! - [`otlp_receiver`] (feature `otel`): an OTLP/HTTP trace receiver;
//! - here: bounded waits, tracing and [`backend_tests!`].
//!
//! Semantics tests are written once as `async fn name(backend: Backend)` and
//! [`backend_tests!`] turns them into one `#[tokio::test]` per backend.

pub mod brokers;
pub mod checker;
pub mod client;
pub mod cluster;
pub mod config;
pub mod fast_path;
pub mod h2_refusing;
pub mod h2_upstream;
#[cfg(feature = "otel")]
pub mod otlp_receiver;
pub mod pg_cluster;
pub mod pgbouncer;
pub mod process;
pub mod proxy;
pub mod recording_upstream;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_tls;
pub mod seed;
pub mod serve;
pub mod services;
pub mod tls_upstream;
pub mod traffic;
pub mod upstream;
pub mod ws_upstream;

pub use client::{H2Conn, Http1Conn, Req, Resp};
pub use config::{Route, TestConfig};
pub use process::{run_on_config_text, run_to_completion, Run, ServeProcess};
pub use proxy::{Backend, Proxy};
pub use services::{database_url_via, TestSchema};
pub use upstream::{Action, Upstream, UPSTREAM_DATE};

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

/// Upper bound for any wait in the tests: generous, but a hang still fails.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// The route every default config protects (and its metrics label).
pub const ORDERS: &str = "/orders";

// ===== tracing =====

/// Logs to the test's captured output; `RUST_LOG` picks the level.
pub fn trace_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(filter)
        .try_init();
}

// ===== waiting =====

/// Polls `cond` until it holds; panics naming `what` after [`DEADLINE`].
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`wait_until`] with an async condition that yields a value.
pub async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Bounds a future by [`DEADLINE`].
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A free port on 127.0.0.1 (bound, then released).
pub fn free_port() -> SocketAddr {
    // Below the kernel's ephemeral range: a port picked here for a child
    // process to bind later cannot be taken meanwhile by one of the
    // thousands of client connections the suites open (those get
    // ephemeral ports).
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let range = low.saturating_sub(12_000).max(1024)..low;
    // A port handed out is not bound until its process starts: never hand
    // it out again in this run (two tests drawing the same port made one
    // replica exit before listening).
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..1000 {
        let port = rand::random_range(range.clone());
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
        if !handed_out.contains(&port) && std::net::TcpListener::bind(addr).is_ok() {
            handed_out.insert(port);
            return addr;
        }
    }
    panic!("no free port in {range:?}");
}

/// Generates one `#[tokio::test]` per backend for each `async fn name(Backend)`
/// in the invoking file. Adding a backend is one line here.
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        $crate::support::backend_tests!(@on memory, Memory; $($name),*);
        $crate::support::backend_tests!(@on sqlite, Sqlite; $($name),*);
        $crate::support::backend_tests!(@on postgres, Postgres; $($name),*);
        $crate::support::backend_tests!(@on postgres_redis, PostgresRedis; $($name),*);
    };
    (@on $module:ident, $variant:ident; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::$variant).await;
                }
            )*
        }
    };
}
pub(crate) use backend_tests;

/// [`backend_tests!`] for tests about time, in a module `timed`: on the
/// memory and SQLite stores, whose leases the proxy's own clock judges,
/// they run on a paused tokio clock that jumps to the next timer whenever
/// every task waits (the in-process proxy keeps time by it), so a 2 s
/// upstream delay costs no wall time; on PostgreSQL, whose server clock
/// judges leases, in real time.
macro_rules! timed_backend_tests {
    ($($name:ident),* $(,)?) => {
        mod timed {
            $crate::support::timed_backend_tests!(@paused memory, Memory; $($name),*);
            $crate::support::timed_backend_tests!(@paused sqlite, Sqlite; $($name),*);
            $crate::support::timed_backend_tests!(@real postgres, Postgres; $($name),*);
            $crate::support::timed_backend_tests!(@real postgres_redis, PostgresRedis; $($name),*);
        }
    };
    (@paused $module:ident, $variant:ident; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::super::$name($crate::support::Backend::$variant).await;
                }
            )*
        }
    };
    (@real $module:ident, $variant:ident; $($name:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::super::$name($crate::support::Backend::$variant).await;
                }
            )*
        }
    };
}
pub(crate) use timed_backend_tests;

// ===== metrics =====

/// The value of an unlabelled sample `name` in Prometheus/OpenMetrics text
/// (0 when absent).
pub fn metric_value(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            (n == name).then(|| v.trim().parse::<f64>().ok())?
        })
        .map(|v| v as u64)
        .unwrap_or(0)
}
