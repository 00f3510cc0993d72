//! The upstreams: one pooled hyper-util client per configured upstream
//! (the default `[server] upstream` and each `[upstreams.NAME]`), built in
//! one place, [`Upstreams::from_config`], so a reload can build a new set.
//! Request rewriting and error mapping are `proxy/forward.rs`'s.
//!
//! - `tls.rs`: rustls settings for `https://` upstreams, handshake failures.
//! - `tunnel.rs`: the byte tunnel of an upgraded (WebSocket) connection.

pub mod tls;
pub mod tunnel;

use crate::body::ProxyBody;
use crate::config::{Config, UpstreamConfig, UpstreamProtocol};
use crate::net::errors::BoxError;
use crate::net::tls::TlsError;
use http::{Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// TCP keep-alive on upstream connections: finds dead peers behind NATs.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// An upstream whose client cannot be built.
#[derive(Debug, thiserror::Error)]
#[error("upstream {name} ({url}): {source}")]
pub struct UpstreamSetupError {
    name: String,
    url: String,
    #[source]
    source: Box<TlsError>,
}

/// Every upstream of one configuration.
#[derive(Clone)]
pub struct Upstreams {
    default: Arc<Upstream>,
    named: HashMap<String, Arc<Upstream>>,
}

impl Upstreams {
    /// The one place upstream config becomes clients: TLS files are read
    /// here, so an unreadable one fails the start (or the reload).
    pub fn from_config(config: &Config) -> Result<Self, UpstreamSetupError> {
        let default = Arc::new(Upstream::new(&config.server.default_upstream())?);
        let named = config
            .upstreams
            .iter()
            .map(|(name, cfg)| Ok((name.clone(), Arc::new(Upstream::new(cfg)?))))
            .collect::<Result<_, UpstreamSetupError>>()?;
        Ok(Self { default, named })
    }

    /// The upstream called `name`, or the default one. The config has
    /// checked every name a route can give.
    pub fn get(&self, name: Option<&str>) -> &Upstream {
        name.and_then(|n| self.named.get(n))
            .unwrap_or(&self.default)
    }
}

/// One upstream: where it is, how long it may take, and its client.
pub struct Upstream {
    /// Shared with the per-upstream metric labels.
    name: Arc<String>,
    url: Uri,
    timeout: Duration,
    protocol: UpstreamProtocol,
    client: UpstreamClient,
}

/// `http://` needs no TLS settings (no roots to load), so it keeps the
/// plain connector; both answer with the same future.
enum UpstreamClient {
    Plain(Client<HttpConnector, ProxyBody>),
    Tls(Client<Bounded<HttpsConnector<HttpConnector>>, ProxyBody>),
}

impl Upstream {
    fn new(cfg: &UpstreamConfig) -> Result<Self, UpstreamSetupError> {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(cfg.connect_timeout));
        http.set_nodelay(true);
        http.set_keepalive(Some(TCP_KEEPALIVE));
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new());
        let client = if cfg.is_https() {
            let tls = tls::client_config(&cfg.tls).map_err(|source| UpstreamSetupError {
                name: cfg.name.clone(),
                url: cfg.url.to_string(),
                source: Box::new(source),
            })?;
            http.enforce_http(false);
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_only();
            let connector = match cfg.protocol {
                // No ALPN: an HTTP/1.1-only upstream may not know it.
                UpstreamProtocol::Http1 => https.enable_http1().wrap_connector(http),
                // The upstream picks; h2 when it can.
                UpstreamProtocol::H2 => https.enable_all_versions().wrap_connector(http),
            };
            UpstreamClient::Tls(builder.build(Bounded {
                inner: connector,
                timeout: cfg.connect_timeout,
            }))
        } else {
            if cfg.protocol == UpstreamProtocol::H2 {
                // h2c with prior knowledge (RFC 9113 §3.3).
                builder.http2_only(true);
            }
            UpstreamClient::Plain(builder.build(http))
        };
        Ok(Self {
            name: Arc::new(cfg.name.clone()),
            url: cfg.url.clone(),
            timeout: cfg.timeout,
            protocol: cfg.protocol,
            client,
        })
    }

    /// `default` or the `[upstreams.NAME]` name, for logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as a metric label value.
    pub fn label(&self) -> &Arc<String> {
        &self.name
    }

    pub fn url(&self) -> &Uri {
        &self.url
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn protocol(&self) -> UpstreamProtocol {
        self.protocol
    }

    /// Sends `req` (absolute URI on this upstream) through the pool.
    pub fn request(&self, req: Request<ProxyBody>) -> ResponseFuture {
        match &self.client {
            UpstreamClient::Plain(c) => c.request(req),
            UpstreamClient::Tls(c) => c.request(req),
        }
    }
}

// === impl Bounded ===

/// A connector whose whole connect is bounded: for `https://` that is the
/// TCP connect and the TLS handshake, so an upstream that accepts and then
/// says nothing fails within `connect_timeout` (nothing was sent), not at
/// the request's `timeout`. `HttpConnector`'s own timeout covers TCP only.
#[derive(Clone)]
pub struct Bounded<C> {
    inner: C,
    timeout: Duration,
}

/// The connect (TCP and TLS handshake) took longer than `connect_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("connecting (TCP and TLS handshake) took longer than connect_timeout ({0:?})")]
pub struct ConnectTimedOut(Duration);

impl<C> tower_service::Service<Uri> for Bounded<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.inner.call(dst);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(Box::new(ConnectTimedOut(timeout)) as BoxError),
            }
        })
    }
}
