//! A protected request, from its key to its stored answer.
//!
//! 1. [`key_of`] and [`prepare`] (pure): the key, the client's scope and the
//!    request's fingerprint, gathered into one [`ProtectedRequest`] once the
//!    body is read (bounded in size and time).
//! 2. [`Proxy::run_detached`]: from the claim on, everything runs in a task
//!    of its own, so a client hang-up cancels neither a claim that already
//!    committed nor the upstream call and the storing of its answer.
//! 3. The claim ([`crate::lease`]): a live record is answered by
//!    [`decide`]; a won claim is a [`Lease`], renewed while the upstream
//!    runs and consumed by completing or releasing it, as [`settle`] says.

use super::forward::ForwardError;
use super::replay::{capture, replay};
use super::{forward, forward_error, Proxy, Served};
use crate::body::budget::BodyBudget;
use crate::body::{boxed, drain, full, read_limited, Prefixed, ReadError};
use crate::config::Secret;
use crate::error::KeyFate;
use crate::error::ProxyError;
use crate::idempotency::{
    decide, settle, Decision, Fingerprint, IdempotencyKey, RecordKey, Scope, Settlement,
};
use crate::lease::{Acquired, ClaimRequest, Lease};
use crate::metrics::Outcome;
use crate::route::{OnAmbiguous, OnStoreError, RouteConfig};
use crate::store::{Completion, Record, StoreError};
use bytes::Bytes;
use http::{header, request, HeaderValue, Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::warn;

/// A refused (413, 503) body is read and discarded up to this much, so the client
/// sees the answer instead of a reset; past it the connection is just closed.
const DRAIN_MAX_BYTES: u64 = 16 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(2);

/// Everything the protected path needs about one request, built once.
#[derive(Debug)]
pub struct ProtectedRequest {
    pub route: Arc<RouteConfig>,
    pub parts: request::Parts,
    pub body: Bytes,
    pub record_key: RecordKey,
    pub fingerprint: Fingerprint,
    pub peer: SocketAddr,
}

/// The request's idempotency key in the client's scope (the route's scope
/// headers, each sent at most once); `None` where the key is absent and
/// the route does not require one. Checked before the body is read.
pub fn key_of(
    route: &RouteConfig,
    headers: &http::HeaderMap,
    scope_secret: Option<&Secret>,
) -> Result<Option<RecordKey>, ProxyError> {
    let key = IdempotencyKey::from_headers(headers, &route.key_header).map_err(|reason| {
        ProxyError::InvalidKey {
            header: route.key_header.clone(),
            reason,
        }
    })?;
    let Some(key) = key else {
        if route.require_key {
            return Err(ProxyError::MissingKey {
                header: route.key_header.clone(),
            });
        }
        return Ok(None);
    };
    let secret = scope_secret.map(Secret::expose);
    let scope = Scope::of_request(headers, &route.scope_headers, secret)?;
    Ok(Some(RecordKey::new(scope, &key)))
}

/// Fingerprints the request under its scoped key.
pub fn prepare(
    route: Arc<RouteConfig>,
    parts: request::Parts,
    body: Bytes,
    record_key: RecordKey,
    normalized_path: &str,
    peer: SocketAddr,
) -> ProtectedRequest {
    let fingerprint =
        Fingerprint::of_request(&parts, normalized_path, &route.fingerprint_headers, &body);
    ProtectedRequest {
        record_key,
        fingerprint,
        route,
        parts,
        body,
        peer,
    }
}

/// What a request gets when its claim found a live record.
fn answer_existing(
    record: Record,
    fingerprint: &Fingerprint,
    now: i64,
) -> Result<Served, ProxyError> {
    match decide(record, fingerprint, now) {
        Decision::Replay(stored) => Ok((Outcome::Replayed, replay(stored))),
        Decision::InFlight { retry_after_secs } => Err(ProxyError::InFlight { retry_after_secs }),
        Decision::Mismatch => Err(ProxyError::Mismatch),
        Decision::NotReplayable { status } => Err(ProxyError::NotReplayable { status }),
        Decision::OutcomeUnknown => Err(ProxyError::OutcomeUnknown),
    }
}

/// Reads a protected request's body whole, within the route's size limit,
/// the server's `request_body_timeout` and the global body budget (see
/// [`crate::body::budget`]): its length, or the route's limit when it has
/// none, is reserved before a byte is read, and the bytes returned hold
/// that reservation until they are dropped.
pub async fn read_body(
    route: &RouteConfig,
    headers: &http::HeaderMap,
    body: &mut Incoming,
    timeout: Duration,
    budget: &Arc<BodyBudget>,
) -> Result<Bytes, ProxyError> {
    let too_large = ProxyError::BodyTooLarge {
        limit: route.max_request_body,
    };
    let declared = content_length(headers);
    if declared.is_some_and(|n| n > route.max_request_body) {
        drain_if_small(body, declared).await;
        return Err(too_large);
    }
    let expected = http_body::Body::size_hint(body).exact();
    let Some(reservation) = budget.try_reserve(expected.unwrap_or(route.max_request_body)) else {
        drain_if_small(body, expected).await;
        return Err(ProxyError::Overloaded);
    };
    let read = read_limited(body, route.max_request_body, expected);
    let Ok(read) = tokio::time::timeout(timeout, read).await else {
        return Err(ProxyError::BodyTimeout);
    };
    match read {
        Ok(bytes) => Ok(reservation.hold(bytes)),
        Err(ReadError::TooLarge) => {
            drain(body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
            Err(too_large)
        }
        Err(ReadError::Failed(e)) => Err(ProxyError::BodyRead(e.to_string())),
    }
}

/// Reads and discards a refused body of known, small length, so the client
/// sees the refusal instead of a reset.
async fn drain_if_small(body: &mut Incoming, length: Option<u64>) {
    if length.is_some_and(|n| n <= DRAIN_MAX_BYTES) {
        drain(body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
    }
}

fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

impl Proxy {
    /// Claims, then executes or answers from the record found.
    pub(super) async fn claim_and_execute(
        &self,
        req: ProtectedRequest,
    ) -> Result<Served, ProxyError> {
        let claim = ClaimRequest {
            key: req.record_key,
            fingerprint: req.fingerprint,
            lease: req.route.lease,
            ttl: req.route.ttl,
            route: req.route.label.clone(),
        };
        match self.leases.acquire(claim).await {
            Ok(Acquired::Held(lease)) => self.execute(req, lease).await,
            Ok(Acquired::Existing(record)) => {
                answer_existing(record, &req.fingerprint, self.leases.clock().now_millis())
            }
            Err(e) => self.on_store_error(req, e).await,
        }
    }

    async fn on_store_error(
        &self,
        req: ProtectedRequest,
        err: StoreError,
    ) -> Result<Served, ProxyError> {
        match req.route.on_store_error {
            OnStoreError::Reject => Err(ProxyError::Store(err)),
            OnStoreError::Forward => {
                warn!(error = %err, route = %req.route.label, "store unavailable; forwarding unguarded (on_store_error = \"forward\")");
                let forwarded = Request::from_parts(req.parts, full(req.body));
                let (_, resp) = self.passthrough(forwarded, req.peer).await;
                Ok((Outcome::Unguarded, resp))
            }
        }
    }

    /// Forwards while the lease is kept alive, then settles the key.
    async fn execute(&self, req: ProtectedRequest, lease: Lease) -> Result<Served, ProxyError> {
        self.metrics.in_flight().inc();
        let _upstream = self.upstream_request();
        let started = Instant::now();
        let route = req.route.clone();
        let keeper = lease.keep_alive();
        tokio::pin!(keeper);
        let result = tokio::select! {
            r = self.forward_and_settle(req, lease, started) => r,
            never = &mut keeper => match never {},
        };
        self.metrics.upstream(&route.label, started.elapsed());
        self.metrics.in_flight().dec();
        result
    }

    async fn forward_and_settle(
        &self,
        req: ProtectedRequest,
        lease: Lease,
        started: Instant,
    ) -> Result<Served, ProxyError> {
        let ProtectedRequest {
            route,
            mut parts,
            body,
            peer,
            ..
        } = req;
        let method = parts.method.clone();
        parts.headers.remove(header::TRANSFER_ENCODING);
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        let resp = match self
            .forwarder
            .send(Request::from_parts(parts, full(body)), peer)
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                let fate = match (&e, route.on_ambiguous) {
                    // Nothing was sent: always safe to run again.
                    (ForwardError::Connect(_), _) | (_, OnAmbiguous::Release) => {
                        lease.release().await
                    }
                    // Sent, never answered: it may have executed.
                    (_, OnAmbiguous::Keep) => match lease.complete(Completion::Unknown).await {
                        KeyFate::Kept => KeyFate::Unknown,
                        other => other,
                    },
                };
                return Err(forward_error(e, fate));
            }
        };
        match settle(resp.status().as_u16(), &route.release_statuses) {
            Settlement::Release => {
                lease.release().await;
                Ok((Outcome::UpstreamError, resp.map(boxed)))
            }
            Settlement::Store => {
                let deadline = started + self.forwarder.timeout();
                self.store_response(&route, &method, lease, resp, deadline)
                    .await
            }
        }
    }

    /// Reads the upstream body (bounded in size and time) and records it.
    async fn store_response(
        &self,
        route: &RouteConfig,
        method: &Method,
        lease: Lease,
        resp: Response<Incoming>,
        deadline: Instant,
    ) -> Result<Served, ProxyError> {
        let (parts, mut body) = resp.into_parts();
        let status = parts.status.as_u16();
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut size: u64 = 0;
        loop {
            // The head was a status the route stores: the upstream executed. A body that
            // then fails must not free the key (the retry would run twice);
            // it completes without a replayable response instead.
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    let key = lease.complete(Completion::Unstored { status }).await;
                    return Err(ProxyError::UpstreamTimeout { key });
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    let key = lease.complete(Completion::Unstored { status }).await;
                    return Err(ProxyError::UpstreamFailed {
                        reason: forward::error_chain(&e),
                        key,
                    });
                }
                Ok(Some(Ok(frame))) => frame,
            };
            // Trailers are not stored; replays carry none.
            let Ok(data) = frame.into_data() else {
                continue;
            };
            size += data.len() as u64;
            chunks.push(data);
            if size > route.max_response_body {
                // The side effect happened: the key must never run again,
                // but this response cannot be kept. Record that, then stream.
                warn!(key.id = %lease.log_id(), route = %route.label, limit = route.max_response_body,
                    "response larger than max_response_body; key completed without a stored body");
                lease.complete(Completion::Unstored { status }).await;
                let body = Prefixed::new(chunks, body);
                return Ok((Outcome::Forwarded, Response::from_parts(parts, boxed(body))));
            }
        }
        let body = concat(chunks);
        let stored = capture(method, &parts, body.clone(), route);
        lease.complete(Completion::Stored(stored)).await;
        Ok((Outcome::Forwarded, Response::from_parts(parts, full(body))))
    }
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().expect("one chunk"),
        _ => Bytes::from(chunks.concat()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ProxyError;

    fn route(extra: &str) -> Arc<RouteConfig> {
        crate::config::test_route(extra)
    }

    fn parts(headers: &[(&str, &str)]) -> request::Parts {
        let mut b = Request::post("/o");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn key_table() {
        let required = route("");
        let optional = route("require_key = false");
        let key = |h: &[(&str, &str)], r: &RouteConfig| key_of(r, &parts(h).headers, None);
        assert!(matches!(
            key(&[], &required),
            Err(ProxyError::MissingKey { .. })
        ));
        assert!(matches!(key(&[], &optional), Ok(None)));
        assert!(matches!(
            key(&[("idempotency-key", "")], &optional),
            Err(ProxyError::InvalidKey { .. })
        ));
        let quoted = key(&[("idempotency-key", "\"k1\"")], &required).unwrap();
        let bare = key(&[("idempotency-key", "k1")], &required).unwrap();
        assert_eq!(quoted.unwrap(), bare.unwrap());
        let twice = [
            ("idempotency-key", "k1"),
            ("authorization", "a"),
            ("authorization", "b"),
        ];
        assert!(matches!(
            key(&twice, &required),
            Err(ProxyError::RepeatedScopeHeader(_))
        ));
        // Without a key there is no scope to decide: passed through.
        assert!(matches!(key(&twice[1..], &optional), Ok(None)));
    }

    fn prepared(
        r: &Arc<RouteConfig>,
        headers: &[(&str, &str)],
        path: &str,
        body: &str,
    ) -> ProtectedRequest {
        let peer = "127.0.0.1:1".parse().unwrap();
        let parts = parts(headers);
        let mut keyed = parts.headers.clone();
        keyed.insert("idempotency-key", HeaderValue::from_static("k1"));
        let record_key = key_of(r, &keyed, None).unwrap().unwrap();
        prepare(
            r.clone(),
            parts,
            Bytes::from(body.to_string()),
            record_key,
            path,
            peer,
        )
    }

    #[test]
    fn prepare_scopes_by_credential_and_fingerprints_the_request() {
        let r = route("fingerprint_headers = [\"x-tenant\"]");
        let base = prepared(&r, &[("authorization", "a")], "/o", "{}");
        let same = prepared(&r, &[("authorization", "a")], "/o", "{}");
        assert_eq!(base.record_key, same.record_key);
        assert_eq!(base.fingerprint, same.fingerprint);

        let other_client = prepared(&r, &[("authorization", "b")], "/o", "{}");
        assert_ne!(base.record_key, other_client.record_key);
        assert_eq!(base.fingerprint, other_client.fingerprint);

        for (i, other) in [
            prepared(&r, &[("authorization", "a")], "/o", "{ }"),
            prepared(&r, &[("authorization", "a")], "/p", "{}"),
            prepared(&r, &[("authorization", "a"), ("x-tenant", "1")], "/o", "{}"),
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(base.record_key, other.record_key, "case {i}");
            assert_ne!(base.fingerprint, other.fingerprint, "case {i}");
        }
    }
}
