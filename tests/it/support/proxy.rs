//! The proxy in-process: [`ProxyBuilder`] renders a [`TestConfig`] for a
//! [`Backend`] around the test upstream and runs `serve` on 127.0.0.1:0,
//! keeping time by tokio's clock ([`Clock::following_tokio`]), so that a
//! test on a paused runtime ([`super::timed_backend_tests!`]) advances the
//! proxy's leases with its timers.

use super::services::{database_url, redis_url, require_postgres, require_redis, TestSchema};
use super::{bounded, metric_value, trace_init, Req, Route, TestConfig, ORDERS};
use http::Method;
use idemgate::clock::Clock;
use idemgate::metrics::Metrics;
use idemgate::server::{Listeners, Server};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Where the proxy keeps its records; each semantics test runs once per
/// variant through [`super::backend_tests!`].
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

    /// Reaches PostgreSQL at this URL (e.g. [`super::database_url_via`] a
    /// [`super::services::TcpRelay`]) instead of `IDEMGATE_TEST_DATABASE_URL`.
    pub fn store_url(mut self, url: &str) -> Self {
        self.store_url = Some(url.to_string());
        self
    }

    /// Uses this Redis (a [`super::services::PrivateRedis`], or a closed port)
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
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let admin = if self.admin {
            Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin"))
        } else {
            None
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr().expect("admin addr"));
        let (tx, rx) = oneshot::channel::<()>();
        let listeners = Listeners {
            proxy: listener,
            admin,
        };
        // Tokio's clock, so a test on a paused runtime moves leases, ttls
        // and timers together (in real time it reads the same as the system's).
        let server = Clock::following_tokio()
            .scope(Server::open(config, metrics.clone(), listeners))
            .await
            .expect("open the store");
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
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
