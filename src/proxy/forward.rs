//! The upstream client: a pooled keep-alive hyper-util client, request
//! rewriting (URI, `Host`, hop-by-hop, `X-Forwarded-*`) and timeouts.

use super::headers::{add_forwarded, join_cookies, strip_hop_by_hop};
use crate::body::ProxyBody;
use crate::config::ServerConfig;
use crate::route::resolve_dot_segments;
use http::uri::Uri;
use http::{header, HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::Duration;

/// Why the upstream gave no response head.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Nothing was sent: connection refused, DNS, connect timeout.
    #[error("cannot connect to upstream: {0}")]
    Connect(String),
    /// No response head within the upstream timeout.
    #[error("upstream timed out")]
    Timeout,
    /// Sent (maybe), then the connection failed: reset, closed, protocol error.
    #[error("upstream request failed: {0}")]
    Failed(String),
}

#[derive(Clone)]
pub struct Forwarder {
    client: Client<HttpConnector, ProxyBody>,
    upstream: Uri,
    timeout: Duration,
    preserve_host: bool,
    trust_forwarded: bool,
}

impl Forwarder {
    /// The one place server config becomes client builders.
    pub fn new(cfg: &ServerConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.upstream_connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.upstream_pool_idle_timeout)
            .pool_max_idle_per_host(cfg.upstream_pool_max_idle)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .build(connector);
        Self {
            client,
            upstream: cfg.upstream.clone(),
            timeout: cfg.upstream_timeout,
            preserve_host: cfg.preserve_host,
            trust_forwarded: cfg.trust_forwarded_headers,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends `req` upstream and waits (bounded) for the response head.
    pub async fn send(
        &self,
        mut req: Request<ProxyBody>,
        peer: SocketAddr,
    ) -> Result<Response<Incoming>, ForwardError> {
        // An absolute-form target's authority wins over `Host` (RFC 9112
        // §3.2.2); on HTTP/2 it is `:authority`, which `Host` must match.
        let original_host = req
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .or_else(|| req.headers().get(header::HOST).cloned());
        *req.uri_mut() = upstream_uri(&self.upstream, req.uri())?;
        // The upstream sees HTTP/1.1 whatever the client spoke.
        *req.version_mut() = http::Version::HTTP_11;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        add_forwarded(headers, peer, original_host.clone(), self.trust_forwarded);
        join_cookies(headers);
        if !self.preserve_host || original_host.is_none() {
            if let Some(auth) = self.upstream.authority() {
                if let Ok(v) = HeaderValue::from_str(auth.as_str()) {
                    headers.insert(header::HOST, v);
                }
            }
        } else if let Some(host) = original_host {
            headers.insert(header::HOST, host);
        }
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(ForwardError::Timeout),
            Ok(Ok(mut resp)) => {
                strip_hop_by_hop(resp.headers_mut());
                // For the access log: upstream time apart from the total.
                resp.extensions_mut()
                    .insert(super::log::UpstreamTime(started.elapsed()));
                Ok(resp)
            }
            Ok(Err(e)) if e.is_connect() => Err(ForwardError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(ForwardError::Failed(error_chain(&e))),
        }
    }
}

/// The upstream's base path joined with the request's path, its
/// dot-segments resolved first so the result cannot leave the base.
pub fn upstream_uri(upstream: &Uri, original: &Uri) -> Result<Uri, ForwardError> {
    let base = upstream.path().trim_end_matches('/');
    let path = match original.path() {
        "" => Cow::Borrowed("/"),
        path => resolve_dot_segments(path),
    };
    let joined = match original.query() {
        Some(query) => format!("{base}{path}?{query}"),
        None => format!("{base}{path}"),
    };
    let mut parts = upstream.clone().into_parts();
    parts.path_and_query = Some(
        joined
            .parse()
            .map_err(|e| ForwardError::Failed(format!("bad request path: {e}")))?,
    );
    Uri::from_parts(parts).map_err(|e| ForwardError::Failed(format!("bad upstream URI: {e}")))
}

/// "a: b: c" from an error and its sources: hyper's Display is one level only.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}
