//! Wiring: the proxy listener (HTTP/1.1 keep-alive and h2c via hyper-util's
//! auto builder; HTTPS with `server.tls_*`, the handshake in each
//! connection's task: [`crate::net::tls_server`]) and the admin listener,
//! both bounded and under deadlines
//! ([`crate::net`]), the sweeper, and graceful shutdown through one
//! [`Drain`] (stop accepting, drain connections and detached upstream
//! executions within the grace period).
//!
//! - `reload.rs`: SIGHUP reloads of the config, swapped in atomically.

pub mod fd_limit;
pub mod reload;

use crate::admin::{Admin, StoreHealth};
use crate::clock::Clock;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::net::connection::{self, Deadlines};
use crate::net::drain::Drain;
use crate::net::listen;
use crate::net::tls_server::{Alpn, ListenerTls, TlsListener, TlsSession};
use crate::proxy::Proxy;
use crate::store::Store;
use anyhow::Context;
use arc_swap::ArcSwap;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use reload::ReloadSource;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
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
/// (Envoy allows ~60 KiB, nginx 32 KiB by default); docs/book/src/operations.md,
/// "Memory".
const H1_MAX_BUF_SIZE: usize = 64 << 10;
/// HTTP/2's header list limit (SETTINGS_MAX_HEADER_LIST_SIZE), pinned at
/// hyper's default: HPACK-decoded heads per stream are bounded by it.
const H2_MAX_HEADER_LIST_SIZE: u32 = 16 << 10;

/// Admin connections open at once (probes, a scraper or two, a person):
/// the rest wait in the backlog. Counted in the descriptor budget
/// (`fd_limit`).
pub const ADMIN_MAX_CONNECTIONS: usize = 16;

/// Already-bound sockets, so tests can bind port 0 and read the address.
pub struct Listeners {
    pub proxy: TcpListener,
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses the config names.
    pub async fn bind(config: &Config) -> std::io::Result<Self> {
        let bind = |addr, what: &'static str| async move {
            TcpListener::bind(addr).await.map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot listen on {addr}{what}: {e}"))
            })
        };
        let proxy = bind(config.restart.server.listen, "").await?;
        let admin = match &config.restart.admin {
            Some(a) => Some(bind(a.listen, " (admin)").await?),
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
        config.restart.server.max_connections = config.restart.server.max_connections.min(limit);
    }
    for w in config.warnings() {
        warn!("{w}");
    }
    // Read before anything runs: a bad pair fails the start.
    let proxy_tls = listener_tls(config.restart.server.tls.as_ref(), Alpn::H2AndHttp1)?;
    let admin_tls = listener_tls(
        config.restart.admin.as_ref().and_then(|a| a.tls.as_ref()),
        Alpn::Http1,
    )?;
    metrics.register_routes(config.routes.iter().map(|r| &r.label));
    metrics.config_started(reload::unix_secs());
    // The proxy of the running config; a reload swaps in another, and each
    // request keeps the one it started on.
    let drain = Drain::default();
    let current = Arc::new(ArcSwap::from_pointee(Proxy::new(
        &config,
        store.clone(),
        metrics.clone(),
        clock,
        &drain,
    )?));
    let stop = drain.stop.clone();
    // Consumers stop taking messages when shutdown begins and finish
    // what they hold within the grace period.
    let mut consumers = crate::consumer::Consumers::start(
        &config.restart.consumers,
        current.clone(),
        metrics.clone(),
        drain.requested.clone(),
        config.restart.server.shutdown_grace,
    )
    .map_err(|e| anyhow::anyhow!(e))?;

    let sweeper = tokio::spawn(sweep_loop(
        store.clone(),
        metrics.clone(),
        clock,
        config.restart.store.sweep_interval,
        config.restart.store.sweep_batch,
        stop.clone(),
    ));
    let health = StoreHealth::new(store.backend(), metrics.clone(), clock);
    let prober = tokio::spawn(health.clone().probe_loop(store.clone(), stop.clone()));
    let reload_trigger = reload.as_ref().map(|source| {
        Arc::new(reload::Trigger(source.trigger.clone())) as Arc<dyn crate::admin::Reload>
    });
    let certificates: Vec<Arc<TlsListener>> =
        proxy_tls.iter().chain(admin_tls.iter()).cloned().collect();
    let cert_watchers: Vec<_> = certificates
        .iter()
        .map(|tls| tokio::spawn(tls.clone().watch(stop.clone())))
        .collect();
    let reloader = reload.map(|source| {
        tokio::spawn(reload::reload_loop(
            source,
            file_config,
            current.clone(),
            metrics.clone(),
            certificates,
            stop.clone(),
        ))
    });
    let deadlines = Deadlines {
        head: config.restart.server.header_read_timeout,
        idle: config.restart.server.idle_timeout,
    };
    let admin_task = listeners.admin.map(|listener| {
        let admin = Arc::new(Admin {
            store: store.clone(),
            metrics: metrics.clone(),
            draining: drain.requested.clone(),
            readiness: config.restart.server.readiness,
            health: health.clone(),
            reload: reload_trigger,
            upstream: (config.restart.server.readiness == crate::config::Readiness::Upstream)
                .then(|| {
                    Arc::new(UpstreamReadiness {
                        current: current.clone(),
                        path: config.restart.server.readiness_path.clone(),
                    }) as Arc<dyn crate::admin::UpstreamCheck>
                }),
            consumers: consumers.health(),
        });
        info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listening");
        tokio::spawn(admin_loop(listener, admin, admin_tls, deadlines, stop.clone()))
    });

    info!(
        addr = %listeners.proxy.local_addr()?,
        upstream = %config.server.upstream,
        store = store.backend(),
        routes = config.routes.iter().count(),
        "idemgate listening"
    );
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Moved into each connection's task (the TLS handshake runs there).
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.restart.server.header_read_timeout)
        .max_buf_size(H1_MAX_BUF_SIZE)
        .keep_alive(true);
    // Pings find dead h2 peers; idle connections of either protocol end
    // with the deadlines in net/connection.rs.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(H2_KEEPALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(config.restart.server.h2_max_concurrent_streams)
        .max_header_list_size(H2_MAX_HEADER_LIST_SIZE)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .max_pending_accept_reset_streams(H2_MAX_PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(H2_MAX_LOCAL_ERROR_RESETS);
    let builder = Arc::new(builder);
    let accepting = listen::serve(
        "proxy",
        listeners.proxy,
        config.restart.server.max_connections,
        &drain.connections,
        drain.stop_accepting.cancelled(),
        |stream, peer| {
            let _ = stream.set_nodelay(true);
            let current = current.clone();
            let builder = builder.clone();
            let tls = proxy_tls.clone();
            let close = drain.close_connections.clone();
            let gauge = metrics.open_connections().clone();
            gauge.inc();
            async move {
                match tls {
                    None => {
                        let io = TokioIo::new(stream);
                        proxy_connection(&builder, io, current, None, deadlines, close, peer).await;
                    }
                    Some(tls) => {
                        if let Some((stream, session, deadlines)) =
                            handshake(&tls, stream, deadlines, peer).await
                        {
                            let io = TokioIo::new(stream);
                            let session = Some(session);
                            proxy_connection(
                                &builder, io, current, session, deadlines, close, peer,
                            )
                            .await;
                        }
                    }
                }
                gauge.dec();
            }
        },
    );
    // A consumer refused at start-up (its settings cannot work with the
    // broker's side) stops the proxy as a config error would, after the
    // same graceful shutdown.
    let refused = consumers.refused();
    let refusal = std::sync::Mutex::new(None);
    let shutdown_or_refused = async {
        tokio::select! {
            () = shutdown => {}
            why = refused => {
                error!(error = %why, "a consumer's configuration is refused by its broker; stopping");
                *refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
            }
        }
    };
    // Readiness fails first; the listener keeps accepting for
    // shutdown_delay so load balancers notice before connections are refused.
    tokio::join!(
        accepting,
        drain.request_on(shutdown_or_refused, config.restart.server.shutdown_delay)
    );
    info!(grace = ?config.restart.server.shutdown_grace, "shutting down: no new connections, draining");
    let deadline = tokio::time::Instant::now() + config.restart.server.shutdown_grace;
    if !drain.close_connections(deadline).await {
        warn!("grace period over with connections still open; closing them");
    }
    // Upstream calls already made must still get their results recorded
    // (every generation of the proxy shares the drain's task tracker).
    if !drain.wait_tasks(deadline).await {
        warn!("grace period over with upstream requests still running; their keys recover when the lease runs out");
        for key_id in current.load().pending_completions() {
            error!(key.id = %key_id,
                "shutting down with this completion not recorded: the request executed, but a retry after its lease runs out will run it again");
        }
    }
    consumers.stopped().await;
    drain.stop.cancel();
    let _ = sweeper.await;
    let _ = prober.await;
    if let Some(t) = reloader {
        let _ = t.await;
    }
    for t in cert_watchers {
        let _ = t.await;
    }
    // Admin connections close now; they may take what is left of the grace.
    if let Some(t) = admin_task {
        let _ = tokio::time::timeout_at(deadline, t).await;
    }
    info!("stopped");
    match refusal.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(why) => Err(anyhow::anyhow!(why)),
        None => Ok(()),
    }
}

/// A listener's TLS, read now, if it has any.
fn listener_tls(
    settings: Option<&ListenerTls>,
    alpn: Alpn,
) -> anyhow::Result<Option<Arc<TlsListener>>> {
    settings
        .map(|s| TlsListener::new(s.clone(), alpn).map(Arc::new))
        .transpose()
        .context("cannot serve TLS")
}

/// The TLS handshake of one accepted connection, in its own task, within
/// the head deadline (which the rest of it then shortens): the stream,
/// the session (the client's verified certificate), and the deadlines
/// left. `None`: the handshake failed or stalled (logged at debug: a port
/// scan or a client that does not trust the certificate is not the
/// proxy's fault).
async fn handshake(
    tls: &TlsListener,
    stream: TcpStream,
    deadlines: Deadlines,
    peer: SocketAddr,
) -> Option<(
    tokio_rustls::server::TlsStream<TcpStream>,
    TlsSession,
    Deadlines,
)> {
    let started = tokio::time::Instant::now();
    match tls.accept(stream, deadlines.head).await {
        Ok((stream, client)) => {
            let head = deadlines.head.saturating_sub(started.elapsed());
            Some((
                stream,
                TlsSession { client },
                Deadlines { head, ..deadlines },
            ))
        }
        Err(e) => {
            debug!(error = %e, client.addr = %peer, "TLS handshake failed");
            None
        }
    }
}

/// One proxy connection on `io` (plain, or TLS with `session`): each
/// request gets the config of the moment, held to its end, and the
/// session in its extensions.
fn proxy_connection<I>(
    builder: &auto::Builder<TokioExecutor>,
    io: TokioIo<I>,
    current: Arc<ArcSwap<Proxy>>,
    session: Option<TlsSession>,
    deadlines: Deadlines,
    close: CancellationToken,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (svc, activity) = connection::track(move |mut req: http::Request<_>| {
        if let Some(session) = session {
            req.extensions_mut().insert(session);
        }
        current.load_full().handle(req, peer)
    });
    // Upgrades (WebSocket) pass on unprotected routes: proxy/forward.rs.
    let conn = builder.serve_connection_with_upgrades(io, svc).into_owned();
    connection::serve(conn, activity, deadlines, close, peer)
}

/// Serves the admin endpoints until `stop`, then closes its connections
/// gracefully and waits for them: at most [`ADMIN_MAX_CONNECTIONS`] at once,
/// each under the proxy's head and idle deadlines (and hyper's HTTP/1
/// header timeout, which needs the timer).
async fn admin_loop(
    listener: TcpListener,
    admin: Arc<Admin>,
    tls: Option<Arc<TlsListener>>,
    deadlines: Deadlines,
    stop: CancellationToken,
) {
    let open = TaskTracker::new();
    listen::serve(
        "admin",
        listener,
        ADMIN_MAX_CONNECTIONS,
        &open,
        stop.cancelled(),
        |stream, peer| {
            let admin = admin.clone();
            let tls = tls.clone();
            let stop = stop.clone();
            async move {
                match tls {
                    None => {
                        admin_connection(TokioIo::new(stream), admin, deadlines, stop, peer).await
                    }
                    Some(tls) => {
                        if let Some((stream, _, deadlines)) =
                            handshake(&tls, stream, deadlines, peer).await
                        {
                            admin_connection(TokioIo::new(stream), admin, deadlines, stop, peer)
                                .await;
                        }
                    }
                }
            }
        },
    )
    .await;
    open.close();
    open.wait().await;
}

/// One admin connection on `io` (plain or TLS), HTTP/1.
fn admin_connection<I>(
    io: TokioIo<I>,
    admin: Arc<Admin>,
    deadlines: Deadlines,
    stop: CancellationToken,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (svc, activity) = connection::track(move |req| {
        let admin = admin.clone();
        async move { admin.handle(req, peer).await }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(deadlines.head)
        .serve_connection(io, svc);
    connection::serve(conn, activity, deadlines, stop, peer)
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

/// `server.readiness = "upstream"`: the running proxy's default upstream
/// answers `path`.
struct UpstreamReadiness {
    current: Arc<ArcSwap<Proxy>>,
    path: String,
}

#[async_trait::async_trait]
impl crate::admin::UpstreamCheck for UpstreamReadiness {
    async fn check(&self, within: Duration) -> Result<(), String> {
        let proxy = self.current.load_full();
        proxy.probe_upstream(&self.path, within).await.map(|_| ())
    }
}
