//! Forwarding: request rewriting (URI, `Host`, hop-by-hop, `X-Forwarded-*`)
//! for the upstream a request goes to, the bounded wait for its response
//! head, connection upgrades (WebSocket) on requests that may pass them,
//! and what a client error means ([`ForwardError`]). The clients themselves
//! are `crate::upstream`'s.

use super::headers::{add_forwarded, join_cookies, strip_hop_by_hop, upgrade_protocol};
use crate::body::ProxyBody;
use crate::config::{Config, UpstreamProtocol};
use crate::metrics::Metrics;
use crate::route::resolve_dot_segments;
use crate::telemetry::trace;
use crate::upstream::tls::{self, TlsFailure};
use crate::upstream::{tunnel, Upstream, UpstreamSetupError, Upstreams};
use http::uri::Uri;
use http::{header, HeaderValue, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

/// Why the upstream gave no response head.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Nothing was sent: connection refused, DNS, connect timeout, or the
    /// TLS handshake failed.
    #[error("cannot connect to upstream: {0}")]
    Connect(ConnectError),
    /// No response head within the upstream timeout.
    #[error("upstream timed out")]
    Timeout,
    /// Sent (maybe), then the connection failed: reset, closed, protocol error.
    #[error("upstream request failed: {0}")]
    Failed(String),
    /// An upgrade request while `server.max_connections` tunnels are open;
    /// nothing was sent.
    #[error("too many upgraded connections are open")]
    TunnelsExhausted,
}

/// Why a connection to the upstream could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP or DNS: the error chain, for the log.
    #[error("{0}")]
    Transport(String),
    /// The TLS handshake: which upstream, and why.
    #[error("upstream {upstream}: {} ({})", failure.detail(), failure.cause())]
    Tls {
        upstream: String,
        failure: TlsFailure,
    },
}

pub struct Forwarder {
    upstreams: Upstreams,
    preserve_host: bool,
    trust_forwarded: bool,
    /// Open tunnels, at most `server.max_connections`: an upgraded
    /// connection leaves the server's connection limit when it upgrades.
    tunnels: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

impl Forwarder {
    /// The upstreams' clients ([`Upstreams::from_config`]) and the header
    /// policy, from one configuration.
    /// `tunnels` is the process's tunnel limit, shared across reloads.
    pub fn new(
        config: &Config,
        metrics: Arc<Metrics>,
        tunnels: Arc<Semaphore>,
    ) -> Result<Self, UpstreamSetupError> {
        Ok(Self {
            upstreams: Upstreams::from_config(config)?,
            preserve_host: config.server.preserve_host,
            trust_forwarded: config.server.trust_forwarded_headers,
            tunnels,
            metrics,
        })
    }

    /// How long the upstream called `name` (a route's `upstream`; `None`:
    /// the default) may take.
    /// The upstream called `name` (or the default) as a metric label.
    pub fn label(&self, name: Option<&str>) -> &Arc<String> {
        self.upstreams.get(name).label()
    }

    pub fn timeout(&self, name: Option<&str>) -> Duration {
        self.upstreams.get(name).timeout()
    }

    /// Sends `req` to the upstream called `name` (`None`: the default) and
    /// waits (bounded) for the response head. An HTTP/1.1 upgrade request
    /// (checked by the caller to be allowed) keeps its `Upgrade`; when the
    /// upstream switches protocols, a tunnel joins the two connections.
    pub async fn send(
        &self,
        name: Option<&str>,
        mut req: Request<ProxyBody>,
        peer: SocketAddr,
    ) -> Result<Response<Incoming>, ForwardError> {
        let upstream = self.upstreams.get(name);
        // Upgrades are HTTP/1.1's; an h2 upstream gets a plain request.
        let upgrade =
            upgrade_protocol(&req).filter(|_| upstream.protocol() == UpstreamProtocol::Http1);
        let slot = match upgrade {
            Some(_) => match self.tunnels.clone().try_acquire_owned() {
                Ok(slot) => Some(slot),
                Err(_) => {
                    self.metrics.tunnels().refused().inc();
                    return Err(ForwardError::TunnelsExhausted);
                }
            },
            None => None,
        };
        let client_side = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        self.rewrite(upstream, &mut req, peer, upgrade.as_ref())?;
        let span = trace::upstream(&mut req, upstream.url());
        let started = tokio::time::Instant::now();
        let result = match tokio::time::timeout(upstream.timeout(), upstream.request(req)).await {
            Err(_) => Err(ForwardError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(classify(upstream, &e)),
        };
        span.finish_response(&result);
        let mut resp = result?;
        // For the access log: upstream time apart from the total.
        resp.extensions_mut()
            .insert(super::log::UpstreamTime(started.elapsed()));
        let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
        let protocol = resp.headers().get(header::UPGRADE).cloned();
        strip_hop_by_hop(resp.headers_mut());
        if let (true, Some(client_side), Some(protocol), Some(slot)) =
            (switched, client_side, protocol, slot)
        {
            let upstream_side = hyper::upgrade::on(&mut resp);
            let h = resp.headers_mut();
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, protocol);
            self.spawn_tunnel(upstream, client_side, upstream_side, slot);
        }
        Ok(resp)
    }

    /// Makes `req` the request `upstream` gets: its URI, version, `Host`,
    /// hop-by-hop headers gone (an allowed upgrade's put back),
    /// `X-Forwarded-*`, cookies joined.
    fn rewrite(
        &self,
        upstream: &Upstream,
        req: &mut Request<ProxyBody>,
        peer: SocketAddr,
        upgrade: Option<&HeaderValue>,
    ) -> Result<(), ForwardError> {
        let h2 = upstream.protocol() == UpstreamProtocol::H2;
        let wants_trailers = accepts_trailers(req.headers());
        // Admission made `Host` the target's authority where it has one
        // (RFC 9112 §3.2.2, `:authority`): the host the scope saw.
        let original_host = req.headers().get(header::HOST).cloned();
        *req.uri_mut() = upstream_uri(upstream.url(), req.uri())?;
        // The client's version says nothing about the upstream's; the pooled
        // connection decides (hyper refuses an HTTP/2 request on an HTTP/1
        // connection, which ALPN may have chosen).
        *req.version_mut() = Version::HTTP_11;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        if let Some(protocol) = upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, protocol.clone());
        }
        // gRPC servers insist on `te: trailers` (the one TE value HTTP/2
        // allows, RFC 9113 §8.2.2): kept on h2 when the client sent it.
        if h2 && wants_trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        add_forwarded(headers, peer, original_host.clone(), self.trust_forwarded);
        join_cookies(headers);
        if !self.preserve_host || original_host.is_none() {
            // On HTTP/2 the same as `:authority` (from the URI).
            if let Some(auth) = upstream.url().authority() {
                if let Ok(v) = HeaderValue::from_str(auth.as_str()) {
                    headers.insert(header::HOST, v);
                }
            }
        } else if let Some(host) = original_host {
            headers.insert(header::HOST, host);
        }
        Ok(())
    }

    /// Once both sides have switched, copies between them (bounded idle
    /// time), holding a tunnel slot. Not on the shutdown tracker: a tunnel
    /// may live for hours, and ends with the process (its peers see the
    /// connection close).
    fn spawn_tunnel(
        &self,
        upstream: &Upstream,
        client_side: OnUpgrade,
        upstream_side: OnUpgrade,
        slot: OwnedSemaphorePermit,
    ) {
        let name = upstream.name().to_string();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::try_join!(client_side, upstream_side) {
                Ok((client, upstream)) => {
                    let tunnels = metrics.tunnels();
                    tunnels.open().inc();
                    let copied =
                        tunnel::run(client, upstream, tunnel::TUNNEL_IDLE_TIMEOUT, |up, down| {
                            tunnels.copied(up, down)
                        })
                        .await;
                    tunnels.open().dec();
                    debug!(
                        upstream = %name,
                        to_upstream = copied.to_upstream,
                        to_client = copied.to_client,
                        "tunnel closed"
                    );
                }
                Err(e) => debug!(upstream = %name, error = %e, "upgrade did not complete"),
            }
        });
    }
}

/// A client error as a [`ForwardError`]; a TLS failure is logged with its
/// cause here, where the upstream is known.
fn classify(upstream: &Upstream, e: &hyper_util::client::legacy::Error) -> ForwardError {
    if let Some(failure) = tls::failure_in(e) {
        warn!(
            upstream = %upstream.name(),
            url = %upstream.url(),
            cause = %failure.cause(),
            "TLS handshake with the upstream failed"
        );
        return ForwardError::Connect(ConnectError::Tls {
            upstream: upstream.name().to_string(),
            failure,
        });
    }
    if e.is_connect() {
        ForwardError::Connect(ConnectError::Transport(error_chain(e)))
    } else {
        ForwardError::Failed(error_chain(e))
    }
}

/// Whether the client's `TE` lists `trailers` (read before hop-by-hop
/// headers go).
fn accepts_trailers(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
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
