//! A protected request, from its key to its stored answer.
//!
//! 1. [`plan_key`], [`resolve_key`] and [`prepare`] (pure): the key (from a
//!    header, or from the body through a JSON pointer), its scope (the
//!    client's headers, or the route's fixed consumer name) and the
//!    request's fingerprint (the body raw or as canonical JSON), gathered
//!    into one [`ProtectedRequest`] once the body is read (bounded in size
//!    and time).
//! 2. [`Proxy::run_detached`]: from the claim on, everything runs in a task
//!    of its own, so a client hang-up cancels neither a claim that already
//!    committed nor the upstream call and the storing of its answer.
//! 3. The claim ([`crate::lease`]): a live record is answered by
//!    [`decide`]; a won claim is a [`Lease`], renewed while the upstream
//!    runs and consumed by completing or releasing it, as [`settle`] says.
//!    On an `in_flight = { wait }` route a duplicate of a request in flight
//!    waits for its answer ([`super::waiters`]) instead of a 409.

use super::replay::{capture, replay};
use super::{Proxy, Served};
use crate::body::budget::BodyBudget;
use crate::body::{boxed, drain, full, read_limited, Prefixed, ReadError};
use crate::config::Secret;
use crate::error::BodyKeyError;
use crate::error::ForwardError;
use crate::error::ProxyError;
use crate::idempotency::canonical_json::{self, Json, JsonError};
use crate::idempotency::decision::retry_after_hint;
use crate::idempotency::{
    decide, settle, Decision, Fingerprint, IdempotencyKey, RecordKey, RecordState, Scope,
    Settlement,
};
use crate::lease::{Acquired, ClaimRequest, KeyFate, Lease};
use crate::metrics::Outcome;
use crate::net::backoff::Backoff;
use crate::route::{FingerprintMode, InFlight, OnAmbiguous, OnStoreError, RouteConfig};
use crate::store::{Completion, Record, StoreError};
use bytes::Bytes;
use http::{header, request, HeaderValue, Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, warn};

/// A refused (413, 503) body is read and discarded up to this much, so the client
/// sees the answer instead of a reset; past it the connection is just closed.
const DRAIN_MAX_BYTES: u64 = 16 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(2);
/// A waiting duplicate's timer (the backstop when no notification comes,
/// e.g. the holder is another replica): doubling from 50 ms to 1 s, with
/// jitter so a crowd of waiters spreads out.
const WAIT_POLL: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));

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

/// Whose key it is: the route's fixed consumer name (`scope = { value }`),
/// or the route's scope headers, each sent at most once.
pub fn scope_of(
    route: &RouteConfig,
    headers: &http::HeaderMap,
    scope_secret: Option<&Secret>,
) -> Result<Scope, ProxyError> {
    let secret = scope_secret.map(Secret::expose);
    match &route.scope_value {
        Some(value) => Ok(Scope::of_value(value, secret)),
        None => Ok(Scope::of_request(headers, &route.scope_headers, secret)?),
    }
}

/// What is known of a request's key before its body is read.
#[derive(Debug)]
pub enum KeyPlan {
    /// From a header.
    Ready(RecordKey),
    /// In the body (`key = { json = .. }`), in this scope.
    InBody(Scope),
    /// No key, on a route that does not require one: passed through.
    Absent,
}

/// The key, or where to find it: checked before the body is read (a bad
/// header or scope is refused without reading it).
pub fn plan_key(
    route: &RouteConfig,
    headers: &http::HeaderMap,
    scope_secret: Option<&Secret>,
) -> Result<KeyPlan, ProxyError> {
    if route.key_json.is_some() {
        return Ok(KeyPlan::InBody(scope_of(route, headers, scope_secret)?));
    }
    Ok(match key_of(route, headers, scope_secret)? {
        Some(key) => KeyPlan::Ready(key),
        None => KeyPlan::Absent,
    })
}

/// The body as JSON, parsed once, if the route reads its key from it or
/// fingerprints it as JSON.
pub fn parse_body(route: &RouteConfig, body: &[u8]) -> Option<Result<Json, JsonError>> {
    (route.key_json.is_some() || route.fingerprint == FingerprintMode::Json)
        .then(|| canonical_json::parse(body))
}

/// The key once the body is read: `Ok(None)` where a body key is absent
/// and the route does not require one. The content type is not checked
/// (SNS sends JSON as `text/plain`). A string is the key as written; an
/// integer, its digits as written (never through a double, which would
/// merge ids above 2^53); anything else is refused.
pub fn resolve_key(
    route: &RouteConfig,
    plan: KeyPlan,
    doc: Option<&Result<Json, JsonError>>,
) -> Result<Option<RecordKey>, ProxyError> {
    let scope = match plan {
        KeyPlan::Ready(key) => return Ok(Some(key)),
        KeyPlan::Absent => return Ok(None),
        KeyPlan::InBody(scope) => scope,
    };
    let Some(pointer) = &route.key_json else {
        return Err(ProxyError::Internal("a body key without a pointer".into()));
    };
    let refuse = |reason: BodyKeyError| {
        if reason.is_missing() && !route.require_key {
            return Ok(None);
        }
        Err(ProxyError::BodyKey {
            pointer: pointer.to_string(),
            reason,
        })
    };
    let doc = match doc {
        Some(Ok(doc)) => doc,
        Some(Err(e)) => return refuse(BodyKeyError::NotJson(e.clone())),
        None => {
            return Err(ProxyError::Internal(
                "a body key without a parsed body".into(),
            ))
        }
    };
    let text = match pointer.find(doc) {
        None => return refuse(BodyKeyError::Missing),
        Some(Json::String(s)) => s.as_str(),
        Some(Json::Number { text, .. }) if is_integer(text) => text,
        Some(_) => return refuse(BodyKeyError::WrongType),
    };
    match IdempotencyKey::from_value(text) {
        Ok(key) => Ok(Some(RecordKey::new(scope, &key))),
        Err(e) => refuse(BodyKeyError::Invalid(e)),
    }
}

/// `-?digits`: an integer as JSON writes it (no fraction, no exponent).
fn is_integer(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// What of the body the fingerprint covers: the bytes as sent, or with
/// `fingerprint = "json"` the canonical form (RFC 8785) after removing
/// `fingerprint_ignore`; a body that is not I-JSON (not JSON, a duplicate
/// member name, nesting past the limit) counts as its bytes.
fn fingerprinted_body<'a>(
    route: &RouteConfig,
    body: &'a [u8],
    doc: Option<Result<Json, JsonError>>,
) -> std::borrow::Cow<'a, [u8]> {
    match (route.fingerprint, doc) {
        (FingerprintMode::Json, Some(Ok(mut doc))) => {
            for pointer in &route.fingerprint_ignore {
                pointer.remove(&mut doc);
            }
            let mut out = Vec::with_capacity(body.len());
            canonical_json::write(&doc, &mut out);
            std::borrow::Cow::Owned(out)
        }
        _ => std::borrow::Cow::Borrowed(body),
    }
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
    let scope = scope_of(route, headers, scope_secret)?;
    Ok(Some(RecordKey::new(scope, &key)))
}

/// Fingerprints the request under its scoped key; `doc` is the body as
/// [`parse_body`] parsed it.
pub fn prepare(
    route: Arc<RouteConfig>,
    parts: request::Parts,
    body: Bytes,
    record_key: RecordKey,
    doc: Option<Result<Json, JsonError>>,
    normalized_path: &str,
    peer: SocketAddr,
) -> ProtectedRequest {
    let covered = fingerprinted_body(&route, &body, doc);
    let fingerprint = Fingerprint::of_request(
        &parts,
        normalized_path,
        &route.fingerprint_headers,
        &covered,
    );
    ProtectedRequest {
        record_key,
        fingerprint,
        route,
        parts,
        body,
        peer,
    }
}

/// What a request gets when its claim found a live record; `typical` is
/// the route's usual upstream latency (for a 409's `Retry-After`).
fn answer_existing(
    record: Record,
    fingerprint: &Fingerprint,
    now: i64,
    typical: Option<Duration>,
) -> Result<Served, ProxyError> {
    match decide(record, fingerprint, now) {
        Decision::Replay(stored) => Ok((Outcome::Replayed, replay(stored))),
        Decision::InFlight { retry_after_secs } => Err(ProxyError::InFlight {
            retry_after_secs: retry_after_hint(retry_after_secs, typical),
        }),
        Decision::Mismatch => Err(ProxyError::Mismatch),
        Decision::NotReplayable { status } => Err(ProxyError::NotReplayable { status }),
        Decision::OutcomeUnknown => Err(ProxyError::OutcomeUnknown),
    }
}

/// Reads a protected request's body whole, within the route's size limit,
/// the server's `request_body_timeout` and the global body budget (see
/// [`crate::body::budget`]): its length is reserved before a byte is read,
/// or, when it has none, its buffer as the chunks arrive; the bytes
/// returned hold that reservation until they are dropped.
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
    let Some(mut reservation) = budget.try_reserve(expected.unwrap_or(0)) else {
        drain_if_small(body, expected).await;
        return Err(ProxyError::Overloaded);
    };
    let limit = route.max_request_body;
    let read = read_limited(body, limit, expected, |buf, more| {
        reservation.make_room(buf, more, limit)
    });
    let Ok(read) = tokio::time::timeout(timeout, read).await else {
        return Err(ProxyError::BodyTimeout);
    };
    match read {
        Ok(bytes) => Ok(reservation.hold(bytes)),
        Err(ReadError::TooLarge) => {
            drain(body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
            Err(too_large)
        }
        Err(ReadError::NoRoom) => Err(ProxyError::Overloaded),
        Err(ReadError::Failed(e)) => Err(ProxyError::BodyRead(e)),
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
        let claim = self.claim_of(&req);
        match self.shared.leases.acquire(claim).await {
            Ok(Acquired::Held(lease)) => self.execute_and_notify(req, lease).await,
            Ok(Acquired::Existing(record)) => match (req.route.in_flight, &record.state) {
                (InFlight::Wait(wait), RecordState::InFlight { .. })
                    if record.fingerprint == req.fingerprint =>
                {
                    self.wait_for_answer(req, wait, record).await
                }
                _ => self.answer(record, &req),
            },
            Err(e) => self.on_store_error(req, e).await,
        }
    }

    fn answer(&self, record: Record, req: &ProtectedRequest) -> Result<Served, ProxyError> {
        let now = self.shared.leases.clock().now_millis();
        let typical = self.latencies.typical(&req.route.label);
        answer_existing(record, &req.fingerprint, now, typical)
    }

    /// Executes, then wakes this process's waiters on the key, whatever
    /// the outcome (completed, released, or left to its lease).
    async fn execute_and_notify(
        &self,
        req: ProtectedRequest,
        lease: Lease,
    ) -> Result<Served, ProxyError> {
        let key = req.record_key;
        let waits = matches!(req.route.in_flight, InFlight::Wait(_));
        let result = self.execute(req, lease).await;
        self.shared.waiters.notify(&key);
        if let (true, Some(notifier)) = (waits, &self.shared.notifier) {
            notifier.publish(key.log_id());
        }
        result
    }

    /// `in_flight = { wait }`: waits for the first request's answer, up
    /// to `wait`, then replays it. Woken by this process's notifications
    /// and by a backoff timer (the holder may be another replica); each
    /// time, one waiter per key claims again through the store, which
    /// decides: a final record is shared with the others, a released key
    /// is won by exactly one claim, which executes (the rest keep waiting
    /// for it). When the wait runs out: 409.
    async fn wait_for_answer(
        &self,
        req: ProtectedRequest,
        wait: Duration,
        first: Record,
    ) -> Result<Served, ProxyError> {
        let deadline = Instant::now() + wait;
        let mut last = first;
        let Ok(mut guard) = self.shared.waiters.enter(req.record_key) else {
            let retry_after_secs = match self.answer(last, &req) {
                Err(ProxyError::InFlight { retry_after_secs }) => retry_after_secs,
                _ => 1,
            };
            return Err(ProxyError::TooManyWaiters { retry_after_secs });
        };
        let mut polls: u32 = 0;
        loop {
            let notified = tokio::select! {
                () = guard.changed() => true,
                () = tokio::time::sleep(WAIT_POLL.delay(polls + 1, rand::random())) => {
                    polls = polls.saturating_add(1);
                    false
                }
                () = tokio::time::sleep_until(deadline) => return self.answer(last, &req),
                // Shutting down: a 409 now (retry on another replica), not
                // a connection cut at the end of the grace period.
                () = self.shared.draining.cancelled() => return self.answer(last, &req),
            };
            // Only an answer of the execution this waiter is waiting for (or
            // a later one): one published before an operator's delete and a
            // new execution of the key is not.
            if let Some(record) = guard
                .published()
                .filter(|r| r.created_at >= last.created_at)
            {
                return self.answer(record, &req);
            }
            let Some(check) = guard.try_check(notified) else {
                continue;
            };
            match self.shared.leases.acquire(self.claim_of(&req)).await {
                Ok(Acquired::Held(lease)) => {
                    check.done();
                    drop(guard);
                    return self.execute_and_notify(req, lease).await;
                }
                Ok(Acquired::Existing(record)) => {
                    check.done();
                    // Still running: wait on. A different request that took a
                    // released key over is answered now (422), as on arrival.
                    let running = matches!(record.state, RecordState::InFlight { .. });
                    if running && record.fingerprint == req.fingerprint {
                        last = record;
                        continue;
                    }
                    if !running {
                        guard.publish(record.clone());
                    }
                    return self.answer(record, &req);
                }
                // The wait is bounded anyway: keep waiting, and answer 409
                // from the last record seen if the store stays away.
                Err(e) => {
                    check.done();
                    debug!(error = %e, "store check while waiting failed");
                }
            }
        }
    }

    fn claim_of(&self, req: &ProtectedRequest) -> ClaimRequest {
        ClaimRequest {
            key: req.record_key,
            fingerprint: req.fingerprint,
            lease: req.route.lease,
            ttl: req.route.ttl,
            route: req.route.label.clone(),
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
                let upstream = req.route.upstream.as_deref();
                let (_, resp) = self.passthrough(upstream, forwarded, req.peer).await;
                Ok((Outcome::Unguarded, resp))
            }
        }
    }

    /// Forwards while the lease is kept alive, then settles the key.
    async fn execute(&self, req: ProtectedRequest, lease: Lease) -> Result<Served, ProxyError> {
        self.shared.metrics.in_flight().inc();
        let _upstream = self.upstream_request(req.route.upstream.as_deref());
        let started = Instant::now();
        let route = req.route.clone();
        let keeper = lease.keep_alive();
        tokio::pin!(keeper);
        let result = tokio::select! {
            r = self.forward_and_settle(req, lease, started) => r,
            never = &mut keeper => match never {},
        };
        self.shared
            .metrics
            .upstream(&route.label, started.elapsed());
        self.latencies.record(&route.label, started.elapsed());
        self.shared.metrics.in_flight().dec();
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
            .send_buffered(route.upstream.as_deref(), parts, body, peer)
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                let fate = match (&e, route.on_ambiguous) {
                    // Nothing was sent, or nothing ran: always safe to run again.
                    (
                        ForwardError::Unreachable(_)
                        | ForwardError::Tls { .. }
                        | ForwardError::Refused(_)
                        | ForwardError::TunnelsExhausted,
                        _,
                    )
                    | (_, OnAmbiguous::Release) => lease.release().await,
                    // Sent, never answered: it may have executed.
                    (_, OnAmbiguous::Keep) => match lease.complete(Completion::Unknown).await {
                        KeyFate::Kept => KeyFate::Unknown,
                        other => other,
                    },
                };
                return Err(ProxyError::upstream(e, fate));
            }
        };
        match settle(resp.status().as_u16(), &route.release_statuses) {
            Settlement::Release => {
                lease.release().await;
                Ok((Outcome::UpstreamError, resp.map(boxed)))
            }
            Settlement::Store => {
                let deadline = started + self.forwarder.timeout(route.upstream.as_deref());
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
                    return Err(ProxyError::upstream(ForwardError::Timeout, key));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    let key = lease.complete(Completion::Unstored { status }).await;
                    return Err(ProxyError::upstream(ForwardError::Failed(e.into()), key));
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
        let doc = parse_body(r, body.as_bytes());
        prepare(
            r.clone(),
            parts,
            Bytes::from(body.to_string()),
            record_key,
            doc,
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

    #[test]
    fn body_key_table() {
        let required = route("key = { json = \"/message/messageId\" }\nscope = { value = \"c\" }");
        let optional = route(
            "key = { json = \"/message/messageId\" }\nscope = { value = \"c\" }\nrequire_key = false",
        );
        let resolve = |r: &RouteConfig, body: &str| {
            let plan = plan_key(r, &parts(&[]).headers, None).unwrap();
            assert!(matches!(plan, KeyPlan::InBody(_)));
            let doc = parse_body(r, body.as_bytes());
            resolve_key(r, plan, doc.as_ref())
        };
        let key = |body: &str| resolve(&required, body).unwrap().unwrap();
        let slug = |r: &RouteConfig, body: &str| match resolve(r, body) {
            Err(e) => crate::problem::Problem::from_error(&e).slug,
            Ok(k) => panic!("{body}: a key {k:?}"),
        };
        let m = |id: &str| format!(r#"{{"message":{{"messageId":{id}}}}}"#);
        assert_eq!(key(&m("\"1\"")), key(&m("\"1\"")));
        assert_ne!(key(&m("\"1\"")), key(&m("\"2\"")));
        // An integer is its digits: 1 and "1" are one key, 1.0 is refused.
        assert_eq!(key(&m("1")), key(&m("\"1\"")));
        assert_eq!(key(&m("-7")), key(&m("\"-7\"")));
        for (body, want) in [
            ("not json".to_string(), "key-missing"),
            (r#"{"message":{}}"#.to_string(), "key-missing"),
            (r#"{"message":"x"}"#.to_string(), "key-missing"),
            (
                r#"{"message":{"messageId":1},"message":{}}"#.to_string(),
                "key-missing",
            ),
            (m("1.0"), "key-invalid"),
            (m("1e3"), "key-invalid"),
            (m("true"), "key-invalid"),
            (m("{}"), "key-invalid"),
            (m("\"\""), "key-invalid"),
            (m("\"tab\\there\""), "key-invalid"),
        ] {
            assert_eq!(slug(&required, &body), want, "{body}");
        }
        // Optional: no key there means unprotected; a bad one is still 400.
        assert!(matches!(resolve(&optional, "not json"), Ok(None)));
        assert!(matches!(resolve(&optional, r#"{"message":{}}"#), Ok(None)));
        assert_eq!(slug(&optional, &m("1.5")), "key-invalid");
        // The scope is the route's consumer, whatever the credential.
        let with_auth = |auth: &str| {
            let h = parts(&[("authorization", auth)]).headers;
            match plan_key(&required, &h, None).unwrap() {
                KeyPlan::InBody(scope) => scope,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(with_auth("a"), with_auth("b"));
        assert_eq!(with_auth("a"), Scope::of_value("c", None));
    }

    #[test]
    fn json_fingerprints_ignore_order_whitespace_and_the_ignored_members() {
        let r = route("fingerprint = \"json\"\nfingerprint_ignore = [\"/attempt\"]");
        let fp = |body: &str| prepared(&r, &[], "/o", body).fingerprint;
        let base = fp(r#"{"a":1,"b":[1,2],"attempt":1}"#);
        assert_eq!(base, fp(r#" { "b" : [1, 2.0], "a": 1, "attempt": 7 } "#));
        assert_eq!(base, fp(r#"{"a":1,"b":[1,2]}"#));
        assert_ne!(base, fp(r#"{"a":1,"b":[2,1]}"#));
        assert_ne!(base, fp(r#"{"a":"1","b":[1,2]}"#));
        // Not I-JSON: the bytes, exactly as a raw route would see them.
        let raw = route("");
        for body in ["plain", r#"{"a":1,"a":1}"#] {
            assert_eq!(fp(body), prepared(&raw, &[], "/o", body).fingerprint);
        }
    }
}
