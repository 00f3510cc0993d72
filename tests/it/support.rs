//! Shared harness for the integration tests: a counting test upstream, the
//! proxy on real sockets (127.0.0.1:0), an HTTP client, wait helpers.
//!
//! Semantics tests are written once as `async fn name(backend: Backend)` and
//! [`backend_tests!`] turns them into one `#[tokio::test]` per backend.

// The config file a test wants, as a TOML table.
pub mod config;
// The real binary as a child process.
pub mod process;
// PostgreSQL/Redis helpers: URLs, private redis-server, TCP relay.
pub mod services;

pub use config::{Route, TestConfig};
pub use process::{run_on_config_text, run_to_completion, Run, ServeProcess};

use services::{database_url, redis_url, require_postgres, require_redis};
pub use services::{database_url_via, TestSchema};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::body::{boxed, full, BoxError, ProxyBody};
use idemgate::metrics::Metrics;
use idemgate::server::{serve, Listeners};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

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
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("addr")
}

// ===== the test upstream =====

/// One request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A one-shot behaviour for the next request the upstream receives,
/// whatever its path or query (so a retry can be the same request).
#[derive(Clone, Debug)]
pub enum Action {
    Status(u16),
    Delay(Duration),
    /// Close the connection without answering.
    ResetBeforeResponse,
    /// Send the head and part of the body, then abort the connection.
    ResetMidBody,
}

#[derive(Default)]
struct UpState {
    seen: Mutex<Vec<Seen>>,
    hits: Mutex<HashMap<String, usize>>,
    actions: Mutex<VecDeque<Action>>,
    completed: Mutex<HashMap<String, usize>>,
}

/// A counting HTTP upstream (HTTP/1.1 and h2c).
///
/// Every path answers; `POST /orders` answers 201 with `Location` and a JSON
/// body carrying the hit number. Query parameters shape any answer:
/// `status=N`, `delay_ms=N`, `size=N` (N bytes of `x`, chunked),
/// `headers=1` (repeated `x-multi`, `Set-Cookie`, a fixed `Date`),
/// `hop=1` (a hop-by-hop header named by `Connection`),
/// `reset=before|body`.
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpState>,
    task: JoinHandle<()>,
}

/// The fixed `Date` the upstream sends with `headers=1`.
pub const UPSTREAM_DATE: &str = "Tue, 01 Dec 2026 08:00:00 GMT";

impl Upstream {
    pub async fn start() -> Self {
        Self::start_on(
            TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind upstream"),
        )
        .await
    }

    /// Starts on a given address (e.g. one the proxy was refused on before).
    pub async fn start_at(addr: SocketAddr) -> Self {
        let listener = wait_for("the upstream port to be free", || async {
            TcpListener::bind(addr).await.ok()
        })
        .await;
        Self::start_on(listener).await
    }

    pub async fn start_on(listener: TcpListener) -> Self {
        let addr = listener.local_addr().expect("upstream addr");
        let state = Arc::new(UpState::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = st.clone();
                        async move { upstream_handle(st, req).await }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, state, task }
    }

    /// An address nothing listens on: connecting to it is refused.
    pub fn refusing_addr() -> SocketAddr {
        free_port()
    }

    /// Queues a behaviour for the next request.
    pub fn push(&self, action: Action) {
        self.state.actions.lock().unwrap().push_back(action);
    }

    /// How many requests for `path` arrived (counted before any delay).
    pub fn hits(&self, path: &str) -> usize {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// How many responses for `path` the upstream finished producing.
    pub fn completed(&self, path: &str) -> usize {
        self.state
            .completed
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    pub fn total_hits(&self) -> usize {
        self.state.seen.lock().unwrap().len()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    pub fn last(&self) -> Seen {
        self.seen().pop().expect("the upstream saw no request")
    }

    pub async fn wait_hits(&self, path: &str, n: usize) {
        wait_until(&format!("{n} upstream hit(s) on {path}"), || {
            self.hits(path) >= n
        })
        .await;
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

async fn upstream_handle(
    st: Arc<UpState>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().map(str::to_string);
    let n = {
        let mut hits = st.hits.lock().unwrap();
        let n = hits.entry(path.clone()).or_default();
        *n += 1;
        *n
    };
    st.seen.lock().unwrap().push(Seen {
        method: parts.method.clone(),
        path: path.clone(),
        query: query.clone(),
        version: parts.version,
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let action = st.actions.lock().unwrap().pop_front();
    let q = |name: &str| query_param(query.as_deref(), name);

    let mut delay = q("delay_ms")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);
    let mut status = q("status").and_then(|v| v.parse::<u16>().ok());
    let mut reset = q("reset");
    match action {
        Some(Action::Status(s)) => status = Some(s),
        Some(Action::Delay(d)) => delay = Some(d),
        Some(Action::ResetBeforeResponse) => reset = Some("before".into()),
        Some(Action::ResetMidBody) => reset = Some("body".into()),
        None => {}
    }
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    if reset.as_deref() == Some("before") {
        return Err(std::io::Error::other(
            "reset before responding (on purpose)",
        ));
    }

    let is_order = parts.method == Method::POST && path == ORDERS;
    let default_status = if is_order { 201 } else { 200 };
    let status = StatusCode::from_u16(status.unwrap_or(default_status)).expect("status");
    let mut resp = Response::builder().status(status);
    if is_order {
        resp = resp.header("location", format!("/orders/{n}"));
    }
    if q("headers").is_some() {
        resp = resp
            .header("x-multi", "a, b")
            .header("x-multi", "c")
            .header("set-cookie", "session=one")
            .header("set-cookie", "theme=dark")
            .header("date", UPSTREAM_DATE)
            .header("x-after", "z");
    }
    if q("hop").is_some() {
        resp = resp
            .header("connection", "x-upstream-hop")
            .header("x-upstream-hop", "1");
    }
    resp = resp.header("x-upstream", "test");

    let done = {
        let st = st.clone();
        let path = path.clone();
        move || {
            *st.completed
                .lock()
                .unwrap()
                .entry(path.clone())
                .or_default() += 1
        }
    };

    if reset.as_deref() == Some("body") {
        // The head and a first chunk go out; the failure comes a moment
        // later, so the proxy has really seen the upstream's answer.
        let chunks = futures_util::stream::unfold(0u8, |step| async move {
            let item: Result<Frame<Bytes>, BoxError> = match step {
                0 => Ok(Frame::data(Bytes::from(vec![b'x'; 1000]))),
                1 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err("reset mid-body (on purpose)".into())
                }
                _ => return None,
            };
            Some((item, step + 1))
        });
        let body = StreamBody::new(chunks);
        return Ok(resp
            .header("content-length", "100000")
            .body(boxed(body))
            .expect("response"));
    }
    if let Some(size) = q("size").and_then(|v| v.parse::<usize>().ok()) {
        const CHUNK: usize = 16 * 1024;
        let mut chunks = Vec::new();
        let mut left = size;
        while left > 0 {
            let n = left.min(CHUNK);
            chunks.push(Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'x'; n]))));
            left -= n;
        }
        done();
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        return Ok(resp.body(boxed(body)).expect("response"));
    }
    let json = serde_json::json!({
        "id": n,
        "hits": n,
        "method": parts.method.as_str(),
        "path": path,
        "query": query,
        "received": String::from_utf8_lossy(&body),
    });
    done();
    Ok(resp
        .header("content-type", "application/json")
        .body(full(json.to_string()))
        .expect("response"))
}

// ===== the proxy =====

/// Where the proxy keeps its records; each semantics test runs once per
/// variant through [`backend_tests!`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Sqlite,
    /// PostgreSQL at `IDEMGATE_TEST_DATABASE_URL`, a schema of the test's own.
    Postgres,
    /// PostgreSQL plus the Redis fast path at `IDEMGATE_TEST_REDIS_URL`,
    /// with a key prefix of the test's own.
    PostgresRedis,
}

impl Backend {
    pub fn is_postgres(self) -> bool {
        matches!(self, Backend::Postgres | Backend::PostgresRedis)
    }
}

/// Builds a config around the test upstream and starts `serve` on it.
pub struct ProxyBuilder {
    backend: Backend,
    upstream: SocketAddr,
    /// `(dotted key, value)`, applied over the defaults in order.
    sets: Vec<(String, toml::Value)>,
    /// `(key, value)` set on every route.
    route_sets: Vec<(String, toml::Value)>,
    routes: Option<Vec<Route>>,
    sqlite_path: Option<PathBuf>,
    store_url: Option<String>,
    redis_url: Option<String>,
    admin: bool,
}

impl ProxyBuilder {
    /// Sets a config key over the defaults, e.g.
    /// `.set("server.upstream_timeout", "300ms")`.
    pub fn set(mut self, dotted: &str, value: impl Into<toml::Value>) -> Self {
        self.sets.push((dotted.to_string(), value.into()));
        self
    }

    /// Sets `key` on every route (the default `POST /orders` and
    /// `POST /payments`, or those given to [`ProxyBuilder::routes`]).
    pub fn each_route(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.route_sets.push((key.to_string(), value.into()));
        self
    }

    /// Replaces the default routes.
    pub fn routes(mut self, routes: Vec<Route>) -> Self {
        self.routes = Some(routes);
        self
    }

    /// Uses this SQLite file (shared between proxies) instead of a fresh one.
    pub fn sqlite_file(mut self, path: &Path) -> Self {
        self.backend = Backend::Sqlite;
        self.sqlite_path = Some(path.to_path_buf());
        self
    }

    /// Reaches PostgreSQL at this URL (e.g. [`database_url_via`] a
    /// [`services::TcpRelay`]) instead of `IDEMGATE_TEST_DATABASE_URL`.
    pub fn store_url(mut self, url: &str) -> Self {
        self.store_url = Some(url.to_string());
        self
    }

    /// Uses this Redis (a [`services::PrivateRedis`], or a closed port)
    /// instead of `IDEMGATE_TEST_REDIS_URL`; implies the fast path.
    pub fn redis_url(mut self, url: &str) -> Self {
        self.backend = Backend::PostgresRedis;
        self.redis_url = Some(url.to_string());
        self
    }

    /// Starts the admin listener (`/healthz`, `/readyz`, `/metrics`) too.
    pub fn admin(mut self) -> Self {
        self.admin = true;
        self
    }

    /// The config: the backend's store (PostgreSQL in `schema`), the default
    /// or given routes, then the builder's own settings over them.
    fn config(&self, sqlite_path: &Path, schema: Option<&TestSchema>) -> TestConfig {
        let mut config = TestConfig::new(self.upstream)
            .set("server.listen", "127.0.0.1:0")
            .set("server.shutdown_grace", "10s");
        config = match (self.backend, schema) {
            (Backend::Memory, _) => config.set("store.backend", "memory"),
            (Backend::Sqlite, _) => config
                .set("store.backend", "sqlite")
                .set("store.path", sqlite_path.display().to_string())
                .set("store.synchronous", "normal"),
            (Backend::Postgres | Backend::PostgresRedis, Some(schema)) => config
                .set("store.backend", "postgres")
                .set(
                    "store.url",
                    self.store_url.clone().unwrap_or_else(database_url),
                )
                .set("store.schema", schema.schema.as_str())
                .set("store.pool_size", 8)
                .set("store.connect_timeout", "1s")
                .set("store.timeout", "2s"),
            (Backend::Postgres | Backend::PostgresRedis, None) => {
                panic!("a PostgreSQL proxy needs a schema")
            }
        };
        if let (Backend::PostgresRedis, Some(schema)) = (self.backend, schema) {
            config = config
                .set(
                    "redis.url",
                    self.redis_url.clone().unwrap_or_else(redis_url),
                )
                .set("redis.prefix", schema.prefix.as_str())
                .set("redis.timeout", "250ms");
        }
        let routes = self
            .routes
            .clone()
            .unwrap_or_else(|| vec![Route::post(ORDERS), Route::post("/payments")]);
        for route in routes {
            config = config.route(route);
        }
        for (key, value) in &self.route_sets {
            config = config.each_route(key, value.clone());
        }
        for (dotted, value) in &self.sets {
            config = config.set(dotted, value.clone());
        }
        config
    }

    pub async fn start(self) -> Proxy {
        trace_init();
        let dir = Arc::new(tempfile::TempDir::new().expect("tempdir"));
        let sqlite_path = self
            .sqlite_path
            .clone()
            .unwrap_or_else(|| dir.path().join("idemgate.db"));
        let schema = if self.backend.is_postgres() {
            // Never skip: a missing server fails the test saying what to start.
            require_postgres(&database_url()).await;
            if self.backend == Backend::PostgresRedis && self.redis_url.is_none() {
                require_redis(&redis_url());
            }
            Some(Arc::new(TestSchema::new()))
        } else {
            None
        };
        let config = self.config(&sqlite_path, schema.as_deref()).parse();
        let metrics = Arc::new(Metrics::new());
        // With metrics, so the fast-path counters reach `/metrics`.
        let store = idemgate::store::open_with_metrics(&config, &metrics)
            .await
            .expect("open the store");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let admin = if self.admin {
            Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin"))
        } else {
            None
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr().expect("admin addr"));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            config,
            store,
            metrics.clone(),
            Listeners {
                proxy: listener,
                admin,
            },
            async move {
                let _ = rx.await;
            },
        ));
        Proxy {
            addr,
            admin_addr,
            metrics,
            _schema: schema,
            shutdown_tx: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }
}

/// A running proxy.
pub struct Proxy {
    pub addr: SocketAddr,
    /// The admin listener, when the builder asked for it.
    pub admin_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    /// The PostgreSQL schema and Redis prefix (postgres backends), dropped
    /// from the database with the proxy.
    _schema: Option<Arc<TestSchema>>,
    shutdown_tx: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
    _dir: Arc<tempfile::TempDir>,
}

impl Proxy {
    pub fn builder(backend: Backend, upstream: SocketAddr) -> ProxyBuilder {
        ProxyBuilder {
            backend,
            upstream,
            sets: Vec::new(),
            route_sets: Vec::new(),
            routes: None,
            sqlite_path: None,
            store_url: None,
            redis_url: None,
            admin: false,
        }
    }

    /// The default config: `POST /orders` and `POST /payments` protected.
    pub async fn start(backend: Backend, upstream: SocketAddr) -> Proxy {
        Self::builder(backend, upstream).start().await
    }

    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{}", self.addr, path_and_query)
    }

    pub fn post(&self, path_and_query: &str) -> Req {
        Req::new(Method::POST, self.url(path_and_query))
    }

    pub fn get(&self, path_and_query: &str) -> Req {
        Req::new(Method::GET, self.url(path_and_query))
    }

    pub fn request(&self, method: Method, path_and_query: &str) -> Req {
        Req::new(method, self.url(path_and_query))
    }

    /// `GET` on the admin listener (the builder must have asked for it).
    pub fn admin_get(&self, path: &str) -> Req {
        let admin = self
            .admin_addr
            .expect("start the proxy with .admin() to use the admin listener");
        Req::new(Method::GET, format!("http://{admin}{path}"))
    }

    /// `idemgate_redis_fast_path_hits_total`, as `/metrics` shows it.
    pub fn fast_path_hits(&self) -> u64 {
        metric_value(
            &self.metrics.encode(),
            "idemgate_redis_fast_path_hits_total",
        )
    }

    /// `idemgate_redis_fast_path_errors_total`, as `/metrics` shows it.
    pub fn fast_path_errors(&self) -> u64 {
        metric_value(
            &self.metrics.encode(),
            "idemgate_redis_fast_path_errors_total",
        )
    }

    /// Counter value for the default protected route.
    pub fn count(&self, outcome: idemgate::metrics::Outcome) -> u64 {
        self.metrics.request_count(ORDERS, outcome)
    }

    /// Sends the shutdown signal without waiting.
    pub fn signal_shutdown(&mut self) {
        if let Some(tx) = self.shutdown_tx.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for `serve` to return (after [`Proxy::signal_shutdown`]).
    pub async fn stopped(&mut self) {
        if let Some(task) = self.task.take() {
            bounded("the proxy to stop", task)
                .await
                .expect("serve task panicked")
                .expect("serve returned an error");
        }
    }

    pub async fn shutdown(mut self) {
        self.signal_shutdown();
        self.stopped().await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.signal_shutdown();
    }
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

// ===== the client =====

/// A request under construction.
pub struct Req {
    method: Method,
    url: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Option<ProxyBody>,
}

impl Req {
    pub fn new(method: Method, url: String) -> Self {
        Self {
            method,
            url,
            headers: Vec::new(),
            body: None,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }

    pub fn header_bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_bytes(value).expect("header value"),
        ));
        self
    }

    /// Sets `Idempotency-Key`.
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// A body with a `Content-Length`.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = Some(full(body));
        self
    }

    /// A body sent chunked, without a length.
    pub fn chunked(mut self, chunks: Vec<Bytes>) -> Self {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(c)));
        self.body = Some(boxed(StreamBody::new(futures_util::stream::iter(frames))));
        self
    }

    pub fn build(self) -> Request<ProxyBody> {
        let mut b = Request::builder().method(self.method).uri(self.url);
        for (n, v) in self.headers {
            b = b.header(n, v);
        }
        b.body(self.body.unwrap_or_else(|| full(Bytes::new())))
            .expect("request")
    }

    /// Sends on a fresh HTTP/1.1 connection and reads the whole response.
    pub async fn send(self) -> Resp {
        let what = format!("{} {}", self.method, self.url);
        bounded(&what, self.try_send())
            .await
            .unwrap_or_else(|e| panic!("{what} failed: {e}"))
    }

    /// Like [`Req::send`], but a transport error is returned, not a panic.
    pub async fn try_send(self) -> Result<Resp, BoxError> {
        let client: hyper_util::client::legacy::Client<HttpConnector, ProxyBody> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .build(HttpConnector::new());
        let resp = client.request(self.build()).await?;
        Resp::read(resp).await
    }
}

/// A response read whole.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub async fn read<B>(resp: Response<B>) -> Result<Self, BoxError>
    where
        B: hyper::body::Body,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(Into::into)?.to_bytes();
        Ok(Self {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        })
    }

    pub fn status(&self) -> u16 {
        self.status.as_u16()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ascii"))
    }

    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().expect("ascii").to_string())
            .collect()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts an RFC 9457 problem with `status`; returns its JSON.
    pub fn assert_problem(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status(), status, "body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json = self.json();
        assert_eq!(json["status"], status, "{json}");
        json
    }
}

/// An HTTP/1.1 connection kept open for several requests.
pub struct Http1Conn {
    sender: hyper::client::conn::http1::SendRequest<ProxyBody>,
    task: JoinHandle<()>,
}

impl Http1Conn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("http1 handshake");
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Self { sender, task }
    }

    pub async fn send(&mut self, req: Req) -> Resp {
        bounded("a request on a kept-alive connection", async {
            self.sender.ready().await.expect("connection ready");
            let resp = self
                .sender
                .send_request(req.build())
                .await
                .expect("send request");
            Resp::read(resp).await.expect("read response")
        })
        .await
    }

    /// Hangs up: the connection is closed with any request still pending.
    pub fn close(self) {
        self.task.abort();
    }
}

/// An h2c (HTTP/2 with prior knowledge) connection.
pub struct H2Conn {
    sender: hyper::client::conn::http2::SendRequest<ProxyBody>,
    _task: JoinHandle<()>,
}

impl H2Conn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("h2 handshake");
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Self {
            sender,
            _task: task,
        }
    }

    pub async fn send(&mut self, req: Req) -> Resp {
        bounded("an h2 request", async {
            self.sender.ready().await.expect("h2 ready");
            let resp = self
                .sender
                .send_request(req.build())
                .await
                .expect("h2 send");
            Resp::read(resp).await.expect("read h2 response")
        })
        .await
    }
}

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
