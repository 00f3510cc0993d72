//! A protected request, from its key to its stored answer: the one
//! hand-off from [`Proxy::handle`] is [`Proxy::protect`].
//!
//! 1. `prepare.rs` (pure but for reading the body, bounded in size and
//!    time): the key, its scope and the fingerprint, as one
//!    [`ProtectedRequest`].
//! 2. From the claim on, everything runs in a task of its own, so a client
//!    hang-up cancels neither a claim that already committed nor the
//!    upstream call and the storing of its answer.
//! 3. The claim ([`crate::lease`]): a live record is answered by
//!    [`decide`]; a won claim is a [`Lease`], renewed while the upstream
//!    runs and consumed by completing or releasing it, as [`settle`] says.
//!    On an `in_flight = { wait }` route a duplicate of a request in flight
//!    waits for its answer (`wait.rs`) instead of a 409.

pub(crate) mod prepare;
pub(super) mod wait;

use super::log::{respond, RequestLog, Served, Unstored};
use super::replay::{capture, replay};
use super::replay_check::Pending;
use super::request_id::RequestId;
use super::Proxy;
use crate::body::{boxed, full, Prefixed, ProxyBody};
use crate::error::{ForwardError, ProxyError};
use crate::idempotency::decision::retry_after_hint;
use crate::idempotency::{decide, settle, Decision, Record, RecordState, Settlement};
use crate::lease::{Acquired, ClaimRequest, KeyFate, Lease};
use crate::metrics::Outcome;
use crate::net::tls_server::TlsSession;
use crate::route::{InFlight, OnAmbiguous, OnStoreError, RouteConfig};
use crate::store::{Completion, StoreError};
use crate::telemetry::trace;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use prepare::{parse_body, plan_key, prepare, read_body, resolve_key, KeyPlan, ProtectedRequest};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::time::Instant;
use tracing::warn;

/// On an executed request's response: what recording its answer did
/// (recorded now, or still being retried in the background; or refused
/// because the lease was lost). A message consumer acks only once the
/// answer is recorded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recording(pub crate::lease::Completed);

impl Proxy {
    /// A message's delivery (`crate::consumer`): claimed, forwarded and
    /// recorded exactly as a protected HTTP request, in the caller's task.
    pub(crate) async fn deliver(&self, req: ProtectedRequest) -> Result<Served, ProxyError> {
        self.claim_and_execute(req).await
    }

    /// Keys the scope digests, for requests built outside the HTTP path.
    pub(crate) fn scope_secret(&self) -> Option<&crate::config::Secret> {
        self.services.scope_secret.as_ref()
    }

    /// A request on a protected route: passed through where it has no key
    /// (and needs none), refused where its key, scope or body is bad, and
    /// otherwise run from its claim on in a task of its own, whose response
    /// it waits for. The task finishes the request's log, so a client that
    /// left is still counted.
    pub(super) async fn protect(
        self: &Arc<Self>,
        route: Arc<RouteConfig>,
        req: Request<Incoming>,
        peer: SocketAddr,
        mut log: RequestLog,
    ) -> Response<ProxyBody> {
        let metrics = &self.services.metrics;
        let upstream = route.upstream.as_deref();
        let plan = match plan_key(
            &route,
            req.method(),
            req.headers(),
            req.extensions()
                .get::<TlsSession>()
                .and_then(|s| s.client.as_ref()),
            self.services.scope_secret.as_ref(),
        ) {
            Ok(KeyPlan::Absent) => {
                let served = self.forwarder.passthrough(upstream, req.map(boxed), peer);
                return log.conclude(metrics, served.await);
            }
            Ok(plan) => plan,
            Err(e) => return log.conclude(metrics, Err(e)),
        };
        let (parts, mut body) = req.into_parts();
        let (timeout, budget) = (self.request_body_timeout, &self.services.body_budget);
        let body = match read_body(&route, &parts.headers, &mut body, timeout, budget).await {
            Ok(body) => body,
            Err(e) => return log.conclude(metrics, Err(e)),
        };
        log.set_bytes_in(body.len() as u64);
        let doc = parse_body(&route, &body);
        let key = match resolve_key(&route, plan, doc.as_ref()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let forwarded = Request::from_parts(parts, full(body));
                let served = self.forwarder.passthrough(upstream, forwarded, peer);
                return log.conclude(metrics, served.await);
            }
            Err(e) => return log.conclude(metrics, Err(e)),
        };
        let req = prepare(route, parts, body, key, doc, peer);
        let key_id = req.record_key.log_id();
        trace::set_key_id(&key_id);
        log.set_key(key_id, req.record_key.scope);

        let (tx, rx) = tokio::sync::oneshot::channel();
        let (this, task_log) = (Arc::clone(self), log.clone());
        // Boxed: the claim-and-execute future is kilobytes, and a task
        // holding it unboxed copies it whole on spawn and at completion.
        self.services
            .tasks
            .spawn(Box::pin(trace::in_current(async move {
                let result = this.claim_and_execute(req).await;
                let (outcome, resp) = task_log.respond(result);
                // Counted and logged before the client can see the answer, so a
                // client that reads its response also sees it in the metrics.
                let client_left = tx.is_closed();
                task_log.finish(&this.services.metrics, outcome, &resp, client_left);
                let _ = tx.send(resp);
            })));
        match rx.await {
            Ok(resp) => resp,
            Err(_) => {
                let gone = "the request task ended without an answer";
                log.conclude(metrics, Err(ProxyError::Internal(gone.into())))
            }
        }
    }

    /// Claims, then executes or answers from the record found.
    async fn claim_and_execute(&self, req: ProtectedRequest) -> Result<Served, ProxyError> {
        let check = Pending::of(&req.route, &req.parts);
        let peer = req.peer;
        match (Box::pin(self.claim_and_answer(req)).await, check) {
            (Ok((Outcome::Replayed, stored)), Some(check)) => {
                self.checked_replay(check, stored, peer).await
            }
            (result, _) => result,
        }
    }

    /// A replay, once the upstream said the credential asking for it is
    /// still good (`replay_check`); else what the upstream said instead,
    /// or a 503 when it said nothing.
    async fn checked_replay(
        &self,
        check: Pending,
        stored: Response<ProxyBody>,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        let now = Instant::now();
        if self.replay_checks.holds(&check, now) {
            return Ok((Outcome::Replayed, stored));
        }
        let upstream = check.upstream();
        match self
            .forwarder
            .send_buffered(upstream, check.request(), Bytes::new(), peer)
            .await
        {
            Ok(answer) if answer.status().is_success() => {
                self.replay_checks.remember(&check, now);
                Ok((Outcome::Replayed, stored))
            }
            Ok(answer) => Ok((Outcome::ReplayDenied, answer.map(boxed))),
            Err(e) => {
                warn!(route = %check.route, upstream = upstream.unwrap_or("default"), error = %e,
                    "the replay check got no answer; the stored response was not replayed");
                Err(ProxyError::ReplayCheckFailed(e))
            }
        }
    }

    /// The claim, and what its outcome makes of the request: executed, a
    /// stored answer, a wait, or the store's failure handled.
    async fn claim_and_answer(&self, req: ProtectedRequest) -> Result<Served, ProxyError> {
        // Each branch that awaits is boxed: this future is spawned (moved
        // into its task) on every protected request, and unboxed it would be
        // as large as the largest branch's state, copied on each move, while
        // a replay needs none of them.
        match self.services.leases.acquire(self.claim_of(&req)).await {
            Ok(Acquired::Held(lease)) => Box::pin(self.execute_and_notify(req, lease)).await,
            Ok(Acquired::Existing(record)) => match (req.route.in_flight, &record.state) {
                (InFlight::Wait(wait), RecordState::InFlight { .. })
                    if record.fingerprint == req.fingerprint =>
                {
                    Box::pin(self.wait_for_answer(req, wait, record)).await
                }
                _ => self.answer(record, &req),
            },
            Err(e) => Box::pin(self.on_store_error(req, e)).await,
        }
    }

    /// What a request gets when its claim found a live record; a 409's
    /// `Retry-After` counts the route's usual upstream latency.
    fn answer(&self, record: Record, req: &ProtectedRequest) -> Result<Served, ProxyError> {
        let now = self.services.leases.clock().now_millis();
        let typical = self.latencies.typical(&req.route.label);
        match decide(record, &req.fingerprint, now) {
            Decision::Replay(stored) => Ok((Outcome::Replayed, replay(stored))),
            Decision::InFlight { retry_after_secs } => Err(ProxyError::InFlight {
                retry_after_secs: retry_after_hint(retry_after_secs, typical),
            }),
            Decision::Mismatch(reuse) => Err(ProxyError::Mismatch(reuse)),
            Decision::NotReplayable { status } => Err(ProxyError::NotReplayable { status }),
            Decision::OutcomeUnknown => Err(ProxyError::OutcomeUnknown),
        }
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
        self.services.waiting.finished(&key, waits);
        result
    }

    fn claim_of(&self, req: &ProtectedRequest) -> ClaimRequest {
        ClaimRequest {
            key: req.record_key,
            fingerprint: req.fingerprint,
            lease: req.route.lease,
            ttl: req.route.ttl,
            route: req.route.label.clone(),
            first_use: Some(req.first_use()),
            holding: req.holding.clone(),
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
                let id = req.parts.extensions.get::<RequestId>().cloned();
                let (upstream, peer) = (req.route.upstream.as_deref(), req.peer);
                let forwarded = Request::from_parts(req.parts, full(req.body));
                let served = self.forwarder.passthrough(upstream, forwarded, peer).await;
                let key_id = req.record_key.log_id();
                let shape = &req.route.errors;
                let (_, resp) = respond(served, id.as_ref(), Some(&key_id), shape);
                Ok((Outcome::Unguarded, resp))
            }
        }
    }

    /// Forwards while the lease is kept alive, then settles the key.
    async fn execute(&self, req: ProtectedRequest, lease: Lease) -> Result<Served, ProxyError> {
        let metrics = &self.services.metrics;
        metrics.in_flight().inc();
        let _upstream = self.forwarder.in_flight(req.route.upstream.as_deref());
        let started = Instant::now();
        let route = req.route.clone();
        let keeper = lease.keep_alive();
        tokio::pin!(keeper);
        let result = tokio::select! {
            r = self.forward_and_settle(req, lease, started) => r,
            never = &mut keeper => match never {},
        };
        metrics.upstream(&route.label, started.elapsed());
        self.latencies.record(&route.label, started.elapsed());
        metrics.in_flight().dec();
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
                let completed = lease
                    .complete_reporting(Completion::Unstored { status })
                    .await;
                let body = Prefixed::new(chunks, body);
                let mut resp = Response::from_parts(parts, boxed(body));
                resp.extensions_mut().insert(Unstored);
                resp.extensions_mut().insert(Recording(completed));
                return Ok((Outcome::Forwarded, resp));
            }
        }
        let body = concat(chunks);
        let stored = capture(method, &parts, body.clone(), route);
        let completed = lease.complete_reporting(Completion::Stored(stored)).await;
        let mut resp = Response::from_parts(parts, full(body));
        resp.extensions_mut().insert(Recording(completed));
        Ok((Outcome::Forwarded, resp))
    }
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().expect("one chunk"),
        _ => Bytes::from(chunks.concat()),
    }
}
