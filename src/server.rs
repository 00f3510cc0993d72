//! Listeners and lifecycles: the bounded accept loop (HTTP/1.1 keep-alive
//! and h2c via hyper-util's auto builder), the admin listener, the sweeper,
//! and graceful shutdown (stop accepting, drain connections and detached
//! upstream executions within the grace period).
//!
//! - `connection.rs`: one client connection, its deadlines and its close.
//! - `reload.rs`: SIGHUP reloads of the config, swapped in atomically.

mod connection;
pub mod reload;

use crate::admin::{Admin, StoreHealth};
use crate::clock::Clock;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::Store;
use anyhow::Context;
use arc_swap::ArcSwap;
use connection::Deadlines;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use reload::ReloadSource;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 flow-control windows, pinned rather than left to hyper's
/// defaults (the same values): a connection holds at most its connection
/// window of received bytes that the proxy has not read yet, whatever its
/// streams do; what is read is in the body budget.
const H2_STREAM_WINDOW: u32 = 1 << 20;
const H2_CONNECTION_WINDOW: u32 = 1 << 20;
/// Rapid reset (CVE-2023-44487): streams the client opens and resets
/// before the proxy has accepted them; past this many at once the
/// connection gets GOAWAY ENHANCE_YOUR_CALM (the h2 crate's default).
const H2_MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams the proxy itself had to reset for protocol errors the client
/// provoked ("MadeYouReset"); past this the connection is closed
/// (hyper's default).
const H2_MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// The most a client connection's HTTP/1 read buffer may hold (hyper's
/// default grows to ~400 KiB and keeps it for the connection's life, outside
/// every budget). A request head must fit in it: a longer one gets 431 and
/// the connection closes. 64 KiB leaves room for large cookies and JWTs
/// (Envoy allows ~60 KiB, nginx 32 KiB by default); README "Limits".
const H1_MAX_BUF_SIZE: usize = 64 << 10;
/// HTTP/2's header list limit (SETTINGS_MAX_HEADER_LIST_SIZE), pinned at
/// hyper's default: HPACK-decoded heads per stream are bounded by it.
const H2_MAX_HEADER_LIST_SIZE: u32 = 16 << 10;

/// Accept errors (EMFILE and friends) back off instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Already-bound sockets, so tests can bind port 0 and read the address.
pub struct Listeners {
    pub proxy: TcpListener,
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses the config names.
    pub async fn bind(config: &Config) -> std::io::Result<Self> {
        let proxy = TcpListener::bind(config.server.listen).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {}: {e}", config.server.listen),
            )
        })?;
        let admin = match &config.admin {
            Some(a) => Some(TcpListener::bind(a.listen).await.map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {} (admin): {e}", a.listen),
                )
            })?),
            None => None,
        };
        Ok(Self { proxy, admin })
    }
}

/// A proxy whose store is open and whose sockets are bound: ready to run.
pub struct Server {
    config: Config,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    listeners: Listeners,
    /// The process's clock (see [`Clock::from_env`]).
    clock: Clock,
    /// Where config reloads come from; none: the config never changes.
    reload: Option<ReloadSource>,
    /// Connections (and tunnels) at most, below `server.max_connections`
    /// when the file-descriptor limit cannot hold that (`fd_limit`).
    connection_limit: Option<usize>,
}

impl Server {
    /// Opens the configured store (instrumented, with its metrics in
    /// `metrics`, which stays the caller's so tests can read it).
    pub async fn open(
        config: Config,
        metrics: Arc<Metrics>,
        listeners: Listeners,
    ) -> anyhow::Result<Self> {
        let clock = Clock::from_env();
        let store = crate::store::open_with_metrics(&config, &metrics, clock)
            .await
            .context("cannot open the store")?;
        Ok(Self {
            config,
            store,
            metrics,
            listeners,
            clock,
            reload: None,
            connection_limit: None,
        })
    }

    /// Reloads the config from `source.path` on each of its requests
    /// (see [`reload`]).
    pub fn reload_on(mut self, source: ReloadSource) -> Self {
        self.reload = Some(source);
        self
    }

    /// Serves at most `limit` connections (and tunnels) at once, when that
    /// is below `server.max_connections`.
    pub fn limit_connections(mut self, limit: usize) -> Self {
        self.connection_limit = Some(limit);
        self
    }

    /// Runs until `shutdown` resolves, then drains.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        serve(self, shutdown).await
    }
}

async fn serve(server: Server, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let Server {
        config,
        store,
        metrics,
        listeners,
        clock,
        reload,
        connection_limit,
    } = server;
    // Reloads compare against the file's settings; connections and the
    // tunnel limit run with the lowered one.
    let file_config = config.clone();
    let mut config = config;
    if let Some(limit) = connection_limit {
        config.server.max_connections = config.server.max_connections.min(limit);
    }
    for w in config.warnings() {
        warn!("{w}");
    }
    metrics.register_routes(config.routes.iter().map(|r| &r.label));
    metrics.config_started(reload::unix_secs());
    // The proxy of the running config; a reload swaps in another, and each
    // request keeps the one it started on.
    let current = Arc::new(ArcSwap::from_pointee(Proxy::new(
        &config,
        store.clone(),
        metrics.clone(),
        clock,
    )?));
    let stop = CancellationToken::new();
    let draining = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let sweeper = tokio::spawn(sweep_loop(
        store.clone(),
        metrics.clone(),
        clock,
        config.store.sweep_interval,
        config.store.sweep_batch,
        stop.clone(),
    ));
    let health = StoreHealth::new(store.backend(), metrics.clone(), clock);
    let prober = tokio::spawn(health.clone().probe_loop(store.clone(), stop.clone()));
    let reloader = reload.map(|source| {
        tokio::spawn(reload::reload_loop(
            source,
            file_config,
            current.clone(),
            metrics.clone(),
            stop.clone(),
        ))
    });
    let admin_task = listeners.admin.map(|listener| {
        let admin = Arc::new(Admin {
            store: store.clone(),
            metrics: metrics.clone(),
            draining: draining.clone(),
            readiness: config.server.readiness,
            health: health.clone(),
        });
        info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listening");
        tokio::spawn(admin_loop(listener, admin, stop.clone()))
    });

    info!(
        addr = %listeners.proxy.local_addr()?,
        upstream = %config.server.upstream,
        store = store.backend(),
        routes = config.routes.iter().count(),
        "idemgate listening"
    );
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.server.header_read_timeout)
        .max_buf_size(H1_MAX_BUF_SIZE)
        .keep_alive(true);
    // Pings find dead h2 peers; idle connections of either protocol end
    // with the deadlines in connection.rs.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(H2_KEEPALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(config.server.h2_max_concurrent_streams)
        .max_header_list_size(H2_MAX_HEADER_LIST_SIZE)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_pending_accept_reset_streams(H2_MAX_PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(H2_MAX_LOCAL_ERROR_RESETS);
    let connections = Arc::new(Semaphore::new(config.server.max_connections));
    let deadlines = Deadlines {
        head: config.server.header_read_timeout,
        idle: config.server.idle_timeout,
    };
    // Cancelled to start every connection's graceful close; the tracker
    // tells when they have all ended.
    let drain = CancellationToken::new();
    let open = TaskTracker::new();
    let listener = listeners.proxy;
    // Readiness fails first; the listener keeps accepting for
    // shutdown_delay so load balancers notice before connections are refused.
    let shutdown = {
        let draining = draining.clone();
        let delay = config.server.shutdown_delay;
        async move {
            shutdown.await;
            draining.store(true, std::sync::atomic::Ordering::Relaxed);
            if !delay.is_zero() {
                info!(delay = ?delay, "shutdown requested: readiness fails, still accepting for the delay");
                tokio::time::sleep(delay).await;
            }
        }
    };
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = connections.clone().acquire_owned() => p?,
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = connection::serve(
            &builder,
            stream,
            peer,
            current.clone(),
            deadlines,
            drain.clone(),
        );
        let gauge = metrics.open_connections().clone();
        gauge.inc();
        open.spawn(async move {
            conn.await;
            gauge.dec();
            drop(permit);
        });
    }
    drop(listener);
    info!(grace = ?config.server.shutdown_grace, "shutting down: no new connections, draining");
    let deadline = tokio::time::Instant::now() + config.server.shutdown_grace;
    drain.cancel();
    current.load().drain();
    open.close();
    if tokio::time::timeout_at(deadline, open.wait())
        .await
        .is_err()
    {
        warn!("grace period over with connections still open; closing them");
    }
    // Upstream calls already made must still get their results recorded
    // (every generation of the proxy shares one task tracker).
    let proxy = current.load_full();
    proxy.tasks().close();
    if tokio::time::timeout_at(deadline, proxy.tasks().wait())
        .await
        .is_err()
    {
        warn!("grace period over with upstream requests still running; their keys recover when the lease runs out");
        for key_id in proxy.pending_completions() {
            error!(key.id = %key_id,
                "shutting down with this completion not recorded: the request executed, but a retry after its lease runs out will run it again");
        }
    }
    stop.cancel();
    let _ = sweeper.await;
    let _ = prober.await;
    if let Some(t) = reloader {
        let _ = t.await;
    }
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    info!("stopped");
    Ok(())
}

async fn admin_loop(listener: TcpListener, admin: Arc<Admin>, stop: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Deletes expired records in small batches every `interval`.
async fn sweep_loop(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    clock: Clock,
    interval: Duration,
    batch: u32,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        loop {
            match store.sweep(clock.now_millis(), batch).await {
                Ok(n) => {
                    metrics.swept(n);
                    if n > 0 {
                        debug!(deleted = n, "swept expired records");
                    }
                    if n < u64::from(batch) || stop.is_cancelled() {
                        break;
                    }
                    // Let live traffic in between batches.
                    tokio::task::yield_now().await;
                }
                Err(e) => {
                    warn!(error = %e, "sweep failed; retrying next interval");
                    break;
                }
            }
        }
    }
}
