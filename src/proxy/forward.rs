//! Forwarding: request rewriting (URI, `Host`, hop-by-hop, `X-Forwarded-*`)
//! for the upstream a request goes to, the bounded wait for its response
//! head, connection upgrades (WebSocket) on requests that may pass them,
//! and what a client error means (as a [`ForwardError`]);
//! [`Forwarder::passthrough`], an unprotected request. The clients
//! themselves are `crate::upstream`'s.

use super::headers::{add_forwarded, join_cookies, list_items, strip_hop_by_hop, upgrade_protocol};
use super::log::Served;
use crate::body::{boxed, ProxyBody};
use crate::config::{Config, UpstreamProtocol};
use crate::error::{ForwardError, ProxyError};
use crate::lease::KeyFate;
use crate::metrics::{GaugeGuard, Metrics, Outcome};
use crate::net::connection::Guarded;
use crate::net::errors::{self, Chain};
use crate::net::tls_server::TlsSession;
use crate::route::resolve_dot_segments;
use crate::telemetry::trace;
use crate::upstream::tls;
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

pub struct Forwarder {
    upstreams: Upstreams,
    preserve_host: bool,
    trust_forwarded: bool,
    /// Open tunnels, at most `server.max_connections`: an upgraded
    /// connection leaves the server's connection limit when it upgrades.
    /// The process's, handed from one config's forwarder to the next.
    pub(super) tunnels: Arc<Semaphore>,
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

    /// Counts a request on the upstream called `name` (or the default;
    /// `idemgate_upstream_in_flight`) while the guard lives.
    pub fn in_flight(&self, name: Option<&str>) -> GaugeGuard {
        self.metrics
            .upstream_request(self.upstreams.get(name).label())
    }

    /// How long the upstream called `name` (a route's `upstream`; `None`:
    /// the default) may take.
    pub fn timeout(&self, name: Option<&str>) -> Duration {
        self.upstreams.get(name).timeout()
    }

    /// `GET path` on the default upstream, for `server.readiness =
    /// "upstream"`: `Ok` with any HTTP answer (the app listens), else why
    /// not. The body is dropped unread.
    pub async fn probe(&self, path: &str, within: Duration) -> Result<u16, String> {
        let req = Request::get(path)
            .header(http::header::HOST, "localhost")
            .body(crate::body::full(bytes::Bytes::new()))
            .map_err(|e| e.to_string())?;
        let peer = SocketAddr::from(([127, 0, 0, 1], 0));
        let deadline = tokio::time::Instant::now() + within;
        match self.send(None, req, peer, deadline).await {
            Ok(resp) => Ok(resp.status().as_u16()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Forwards without protection to the upstream called `name` (`None`:
    /// the default), streaming both ways.
    pub async fn passthrough(
        &self,
        name: Option<&str>,
        req: Request<ProxyBody>,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        let in_flight = self.in_flight(name);
        let deadline = tokio::time::Instant::now() + self.timeout(name);
        let resp = self.send(name, req, peer, deadline).await;
        let resp = resp.map_err(|e| ProxyError::upstream(e, KeyFate::Unprotected))?;
        Ok((
            Outcome::Passthrough,
            resp.map(|body| boxed(Guarded::new(body, in_flight))),
        ))
    }

    /// Sends a request whose body is in memory (a protected one), as
    /// [`Forwarder::send`]; when the upstream refused it unprocessed
    /// ([`ForwardError::Refused`]) it is sent once more, on a new stream,
    /// within the same upstream timeout. RFC 9113 §8.7 says such a request
    /// can be retried safely: nothing of it ran, the key is still held, and
    /// the body is the same bytes.
    pub async fn send_buffered(
        &self,
        name: Option<&str>,
        parts: http::request::Parts,
        body: bytes::Bytes,
        peer: SocketAddr,
    ) -> Result<Response<Incoming>, ForwardError> {
        let deadline = tokio::time::Instant::now() + self.timeout(name);
        // Only an HTTP/2 upstream refuses a stream unprocessed: the head is
        // copied for a second try there alone, not on every request.
        let h2 = self.upstreams.get(name).protocol() == UpstreamProtocol::H2;
        let again = h2.then(|| Request::from_parts(parts.clone(), crate::body::full(body.clone())));
        let first = Request::from_parts(parts, crate::body::full(body));
        match (self.send(name, first, peer, deadline).await, again) {
            (Err(ForwardError::Refused(e)), Some(again)) => {
                warn!(upstream = %self.upstreams.get(name).name(), reason = %Chain(&*e),
                    "the upstream refused the request before processing it; sending it once more on a new stream");
                self.send(name, again, peer, deadline).await
            }
            (first, _) => first,
        }
    }

    /// Sends `req` to the upstream called `name` (`None`: the default), its
    /// response head due by `deadline`. An HTTP/1.1 upgrade request
    /// (checked by the caller to be allowed) keeps its `Upgrade`; when the
    /// upstream switches protocols, a tunnel joins the two connections.
    async fn send(
        &self,
        name: Option<&str>,
        mut req: Request<ProxyBody>,
        peer: SocketAddr,
        deadline: tokio::time::Instant,
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
        let result = match tokio::time::timeout_at(deadline, upstream.request(req)).await {
            Err(_) => Err(ForwardError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(classify(upstream, e)),
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
        let strip = req.extensions().get::<StripPrefix>().map(|s| s.0.clone());
        let tls = req.extensions().get::<TlsSession>().is_some();
        *req.uri_mut() = upstream_uri(upstream.url(), req.uri(), strip.as_deref())?;
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
        add_forwarded(
            headers,
            peer,
            original_host.clone(),
            tls,
            self.trust_forwarded,
        );
        join_cookies(headers);
        // The upstream's, on HTTP/2 the same as `:authority` (from the URI).
        let host = original_host.filter(|_| self.preserve_host).or_else(|| {
            let authority = upstream.url().authority()?;
            HeaderValue::from_str(authority.as_str()).ok()
        });
        if let Some(host) = host {
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
fn classify(upstream: &Upstream, e: hyper_util::client::legacy::Error) -> ForwardError {
    if let Some(failure) = tls::failure_in(&e) {
        warn!(
            upstream = %upstream.name(),
            url = %upstream.url(),
            cause = %failure.cause(),
            "TLS handshake with the upstream failed"
        );
        let upstream = upstream.name().to_string();
        return ForwardError::Tls { upstream, failure };
    }
    if e.is_connect() {
        ForwardError::Unreachable(e.into())
    } else if refused_unprocessed(&e) {
        ForwardError::Refused(e.into())
    } else {
        ForwardError::Failed(e.into())
    }
}

/// Whether `e`'s source chain holds an HTTP/2 error that says the upstream
/// processed none of the request (hyper-util wraps hyper's error, which
/// wraps h2's; hyper-util's own retry covers only requests never handed to
/// a connection, not these).
fn refused_unprocessed(e: &(dyn std::error::Error + 'static)) -> bool {
    errors::find::<h2::Error>(e)
        .is_some_and(|h2| unprocessed(h2.is_remote(), h2.is_go_away(), h2.reason()))
}

/// RFC 9113: the peer's `RST_STREAM` with `REFUSED_STREAM` (§8.7), or its
/// `GOAWAY` (§6.8). h2 gives a stream the peer's GOAWAY error only when the
/// stream is above the frame's last-stream-id (or opened after it): a
/// stream at or below it that then fails sees the connection's end (an
/// I/O error), which stays ambiguous. Our own resets and GOAWAYs say
/// nothing about the upstream.
fn unprocessed(remote: bool, go_away: bool, reason: Option<h2::Reason>) -> bool {
    remote && (go_away || reason == Some(h2::Reason::REFUSED_STREAM))
}

/// Whether the client's `TE` lists `trailers` (read before hop-by-hop
/// headers go).
fn accepts_trailers(headers: &http::HeaderMap) -> bool {
    list_items(headers, header::TE).any(|t| t.eq_ignore_ascii_case("trailers"))
}

/// The upstream's base path joined with the request's path, its
/// dot-segments resolved first so the result cannot leave the base.
pub fn upstream_uri(
    upstream: &Uri,
    original: &Uri,
    strip: Option<&str>,
) -> Result<Uri, ForwardError> {
    let base = upstream.path().trim_end_matches('/');
    let resolved = match original.path() {
        "" => Cow::Borrowed("/"),
        path => resolve_dot_segments(path),
    };
    // After the dot-segments are resolved, so `/api/../api/x` loses `/api`
    // as `/api/x` does, and before the base path is joined.
    let path = match strip {
        Some(prefix) => crate::route::strip_path_prefix(&resolved, prefix),
        None => &resolved,
    };
    let mut parts = upstream.clone().into_parts();
    let unchanged = base.is_empty() && path == original.path();
    parts.path_and_query = match original.path_and_query() {
        // Nothing to join or resolve: the client's bytes, shared, as they
        // were parsed (no copy, no second parse).
        Some(pq) if unchanged => Some(pq.clone()),
        _ => {
            let joined = match original.query() {
                Some(query) => format!("{base}{path}?{query}"),
                None => format!("{base}{path}"),
            };
            Some(
                joined
                    .parse()
                    .map_err(|e| ForwardError::Failed(format!("bad request path: {e}").into()))?,
            )
        }
    };
    Uri::from_parts(parts)
        .map_err(|e| ForwardError::Failed(format!("bad upstream URI: {e}").into()))
}

#[cfg(test)]
mod tests {
    use super::unprocessed;
    use h2::Reason;

    #[test]
    fn refused_or_goaway_from_the_upstream_is_unprocessed_and_nothing_else() {
        // (remote, go_away, reason) -> unprocessed
        let cases = [
            (true, false, Some(Reason::REFUSED_STREAM), true),
            (true, true, Some(Reason::NO_ERROR), true),
            (true, true, Some(Reason::INTERNAL_ERROR), true),
            // A reset for another reason: the stream may have run.
            (true, false, Some(Reason::CANCEL), false),
            (true, false, Some(Reason::INTERNAL_ERROR), false),
            // Ours (h2 reset or closed it): says nothing about the upstream.
            (false, false, Some(Reason::REFUSED_STREAM), false),
            (false, true, Some(Reason::PROTOCOL_ERROR), false),
            // No HTTP/2 reason (an I/O error).
            (false, false, None, false),
        ];
        for (remote, go_away, reason, want) in cases {
            assert_eq!(
                unprocessed(remote, go_away, reason),
                want,
                "remote {remote}, go_away {go_away}, {reason:?}"
            );
        }
    }
}

/// A route's `strip_prefix`, in a request's extensions: [`upstream_uri`]
/// removes it from the path it forwards.
#[derive(Clone, Debug)]
pub struct StripPrefix(pub std::sync::Arc<str>);
