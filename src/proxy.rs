//! The request path. [`Proxy::handle`] always produces a response (hyper
//! would abort the connection on an error); the protected path uses `?`
//! freely and `problem.rs` maps whatever it returns.
//!
//! From its claim on, a request runs in a task of its own ([`Proxy::run_detached`]):
//! if the client hangs up, hyper drops the handler, but the upstream call,
//! the lease renewal and the storing of the response carry on, so the
//! client's retry gets the replay instead of a second execution.

pub mod forward;
pub mod headers;

use crate::body::{boxed, drain, full, read_limited, Prefixed, ProxyBody, ReadError};
use crate::config::{Backend, Config, OnStoreError, RouteConfig, Secret};
use crate::error::{KeyFate, ProxyError};
use crate::idempotency::{
    decide, settle, Decision, Fingerprint, IdempotencyKey, RecordKey, Scope, Settlement,
};
use crate::metrics::{Metrics, Outcome};
use crate::problem::Problem;
use crate::route::RouteTable;
use crate::store::{
    now_millis, Claim, ClaimOutcome, Completion, Fence, LeaseToken, Store, StoreError,
    StoredResponse,
};
use bytes::Bytes;
use forward::{ForwardError, Forwarder};
use http::{header, request, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

/// The replay marker Stripe uses (and IETF httpapi issue #46 asks for).
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How often a completion or release is tried before giving up on the store.
const STORE_WRITE_ATTEMPTS: u32 = 4;
const STORE_WRITE_BACKOFF: Duration = Duration::from_millis(100);
/// A refused (413) body is read and discarded up to this much, so the client
/// sees the 413 instead of a reset; past it the connection is just closed.
const DRAIN_MAX_BYTES: u64 = 16 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(2);
/// How long a completion keeps being retried in the background while the
/// store is down (at least the route's lease).
const MIN_COMPLETION_PERSIST: Duration = Duration::from_secs(60);
/// Renewing more often than this would only load the store.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(100);

static UNROUTED: std::sync::LazyLock<Arc<String>> =
    std::sync::LazyLock::new(|| Arc::new("unrouted".to_string()));

pub struct Proxy {
    routes: RouteTable,
    store: Arc<dyn Store>,
    store_timeout: Duration,
    request_body_timeout: Duration,
    scope_secret: Option<Secret>,
    forwarder: Forwarder,
    metrics: Arc<Metrics>,
    /// Detached upstream executions; shutdown waits for them.
    tasks: TaskTracker,
}

type Served = (Outcome, Response<ProxyBody>);

impl Proxy {
    /// The one place the config becomes the request path's settings.
    pub fn new(config: &Config, store: Arc<dyn Store>, metrics: Arc<Metrics>) -> Self {
        Self {
            routes: config.routes.clone(),
            store,
            store_timeout: store_call_bound(config),
            request_body_timeout: config.server.request_body_timeout,
            scope_secret: config.scope_secret.clone(),
            forwarder: Forwarder::new(&config.server),
            metrics,
            tasks: TaskTracker::new(),
        }
    }

    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Serves one request; never fails.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let route = self.routes.find(&method, &path).cloned();
        let mut key_id = None;
        let (outcome, resp) = match &route {
            None => self.passthrough(req.map(boxed), peer).await,
            Some(route) => match self.protected(route, req, peer, &mut key_id).await {
                Ok(served) => served,
                Err(err) => {
                    let problem = Problem::from_error(&err);
                    match err.origin() {
                        crate::error::Origin::Client => debug!(error = %err, "request refused"),
                        _ => warn!(error = %err, "request failed"),
                    }
                    (problem.outcome, problem.into_response())
                }
            },
        };
        let label = route.as_ref().map(|r| &r.label).unwrap_or(&UNROUTED);
        self.metrics.request(label, outcome);
        info!(
            target: "idemgate::access",
            method = %method,
            path = %path,
            route = %label,
            outcome = outcome.as_str(),
            status = resp.status().as_u16(),
            latency_ms = started.elapsed().as_secs_f64() * 1000.0,
            key.id = key_id.as_deref().unwrap_or("-"),
            client.addr = %peer,
            "request"
        );
        resp
    }

    async fn protected(
        self: &Arc<Self>,
        route: &Arc<RouteConfig>,
        req: Request<Incoming>,
        peer: SocketAddr,
        key_id: &mut Option<String>,
    ) -> Result<Served, ProxyError> {
        let key =
            IdempotencyKey::from_headers(req.headers(), &route.key_header).map_err(|reason| {
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
            return Ok(self.passthrough(req.map(boxed), peer).await);
        };
        let too_large = ProxyError::BodyTooLarge {
            limit: route.max_request_body,
        };
        let (parts, mut body) = req.into_parts();
        let declared = content_length(&parts.headers);
        if declared.is_some_and(|n| n > route.max_request_body) {
            if declared.is_some_and(|n| n <= DRAIN_MAX_BYTES) {
                drain(&mut body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
            }
            return Err(too_large);
        }
        let read = read_limited(&mut body, route.max_request_body);
        let Ok(read) = tokio::time::timeout(self.request_body_timeout, read).await else {
            return Err(ProxyError::BodyTimeout);
        };
        let body = match read {
            Ok(bytes) => bytes,
            Err(ReadError::TooLarge) => {
                drain(&mut body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
                return Err(too_large);
            }
            Err(ReadError::Failed(e)) => return Err(ProxyError::BodyRead(e.to_string())),
        };

        let fingerprint = fingerprint_of(&parts, route, &body);
        let scope = Scope::derive(
            parts
                .headers
                .get(&route.scope_header)
                .map(HeaderValue::as_bytes),
            self.scope_secret.as_ref().map(Secret::expose),
        );
        let record_key = RecordKey::new(scope, &key);
        *key_id = Some(record_key.log_id());
        let claim = Claim {
            key: record_key,
            fingerprint,
            token: LeaseToken::random(),
            now: now_millis(),
            lease_ms: route.lease.as_millis() as i64,
            ttl_ms: route.ttl.as_millis() as i64,
        };

        self.run_detached(route.clone(), parts, body, claim, peer)
            .await
    }

    /// Claims, then executes: everything from the claim on runs in a task of
    /// its own, so a client hang-up cancels neither a claim that already
    /// committed nor the upstream call and the storing of its answer.
    async fn claim_and_execute(
        &self,
        route: &RouteConfig,
        parts: request::Parts,
        body: Bytes,
        claim: &Claim,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        // The claim runs as a task of its own: when it outlasts the store
        // timeout it is not dropped (it may still commit), it is followed
        // by a fenced release.
        let started = Instant::now();
        let store = self.store.clone();
        let owned = claim.clone();
        let mut pending = self.tasks.spawn(async move { store.claim(&owned).await });
        let claimed = match tokio::time::timeout(self.store_timeout, &mut pending).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(StoreError::Unavailable(format!(
                "claim task failed: {join}"
            ))),
            Err(_) => {
                let claim = claim.clone();
                let giveback = self.give_back(&claim);
                self.tasks.spawn(async move {
                    match pending.await {
                        Ok(Ok(ClaimOutcome::Claimed { .. })) => {
                            debug!(key.id = %claim.key.log_id(), "a timed-out claim landed late; giving it back");
                            giveback.run().await;
                        }
                        // The store gave up on it, but it may still commit.
                        Ok(Err(StoreError::Timeout)) => giveback.run().await,
                        _ => {}
                    }
                });
                Err(StoreError::Unavailable(
                    "the store did not answer the claim in time".into(),
                ))
            }
        };
        self.metrics.store_op("claim", started.elapsed());
        let claimed = match claimed {
            Ok(outcome) => outcome,
            Err(e) => {
                if matches!(e, StoreError::Timeout) {
                    // The store's own deadline fired; its statement may
                    // still commit server-side.
                    self.tasks.spawn(self.give_back(claim).run());
                }
                return self.on_store_error(route, e, parts, body, peer).await;
            }
        };
        match claimed {
            ClaimOutcome::Existing(record) => {
                match decide(record, &claim.fingerprint, now_millis()) {
                    Decision::Replay(stored) => Ok((Outcome::Replayed, replay_response(stored))),
                    Decision::InFlight { retry_after_secs } => {
                        Err(ProxyError::InFlight { retry_after_secs })
                    }
                    Decision::Mismatch => Err(ProxyError::Mismatch),
                    Decision::NotReplayable { status } => Err(ProxyError::NotReplayable { status }),
                }
            }
            ClaimOutcome::Claimed { takeover } => {
                if takeover {
                    self.metrics.takeover(&route.label);
                    info!(key.id = %claim.key.log_id(), route = %route.label, "took over a claim whose lease ran out");
                }
                self.execute(route, parts, body, claim, peer).await
            }
        }
    }

    /// A fenced release of a claim whose outcome is unknown, retried until
    /// the claim's lease would have run out anyway. Fenced by our token, so
    /// it never touches another holder's record.
    fn give_back(&self, claim: &Claim) -> GiveBack {
        GiveBack {
            store: self.store.clone(),
            timeout: self.store_timeout,
            claim: claim.clone(),
        }
    }

    async fn on_store_error(
        &self,
        route: &RouteConfig,
        err: StoreError,
        parts: request::Parts,
        body: Bytes,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        match route.on_store_error {
            OnStoreError::Reject => Err(ProxyError::Store(err)),
            OnStoreError::Forward => {
                warn!(error = %err, route = %route.label, "store unavailable; forwarding unguarded (on_store_error = \"forward\")");
                let (_, resp) = self
                    .passthrough(Request::from_parts(parts, full(body)), peer)
                    .await;
                Ok((Outcome::Unguarded, resp))
            }
        }
    }

    /// Runs [`Proxy::claim_and_execute`] in its own task and waits for it.
    async fn run_detached(
        self: &Arc<Self>,
        route: Arc<RouteConfig>,
        parts: request::Parts,
        body: Bytes,
        claim: Claim,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let this = Arc::clone(self);
        self.tasks.spawn(async move {
            let result = this
                .claim_and_execute(&route, parts, body, &claim, peer)
                .await;
            if let Err(unsent) = tx.send(result) {
                // The handler is gone with its access log line: count the
                // request here so metrics still see what happened.
                let outcome = match &unsent {
                    Ok((outcome, _)) => *outcome,
                    Err(e) => Problem::from_error(e).outcome,
                };
                this.metrics.request(&route.label, outcome);
                info!(target: "idemgate::access", route = %route.label, outcome = outcome.as_str(),
                    key.id = %claim.key.log_id(), client.addr = %peer, "client left before the response");
            }
        });
        rx.await.unwrap_or_else(|_| {
            Err(ProxyError::Internal(
                "the request task ended without an answer".into(),
            ))
        })
    }

    async fn execute(
        &self,
        route: &RouteConfig,
        parts: request::Parts,
        body: Bytes,
        claim: &Claim,
        peer: SocketAddr,
    ) -> Result<Served, ProxyError> {
        self.metrics.in_flight().inc();
        let started = Instant::now();
        let keeper = self.keep_lease(route, claim);
        tokio::pin!(keeper);
        let result = tokio::select! {
            r = self.forward_and_settle(route, parts, body, claim, peer, started) => r,
            never = &mut keeper => match never {},
        };
        self.metrics.upstream(&route.label, started.elapsed());
        self.metrics.in_flight().dec();
        result
    }

    /// Renews the lease every third of its length until dropped.
    async fn keep_lease(&self, route: &RouteConfig, claim: &Claim) -> Infallible {
        let every = (route.lease / 3).max(MIN_RENEW_INTERVAL);
        // Each renewal must give up in time for another try within the
        // lease, whatever the store timeout says.
        let attempt_timeout = self.store_timeout.min(every);
        let mut wait = every;
        loop {
            tokio::time::sleep(wait).await;
            let until = now_millis() + route.lease.as_millis() as i64;
            let renew = self.store.renew(&claim.key, &claim.token, until);
            let started = Instant::now();
            let result = tokio::time::timeout(attempt_timeout, renew).await;
            self.metrics.store_op("renew", started.elapsed());
            match result {
                Ok(Ok(Fence::Held)) => wait = every,
                Ok(Ok(Fence::Lost)) => {
                    // The completion will be refused too; that is where it is counted.
                    debug!(key.id = %claim.key.log_id(), "lease lost");
                    return std::future::pending().await;
                }
                // Retry soon, backing off so a recovering store is not stormed.
                Ok(Err(e)) => {
                    warn!(key.id = %claim.key.log_id(), error = %e, "lease renewal failed; retrying");
                    wait = retry_wait(wait, every);
                }
                Err(_) => {
                    warn!(key.id = %claim.key.log_id(), "lease renewal timed out; retrying");
                    wait = retry_wait(wait, every);
                }
            }
        }
    }

    async fn forward_and_settle(
        &self,
        route: &RouteConfig,
        mut parts: request::Parts,
        body: Bytes,
        claim: &Claim,
        peer: SocketAddr,
        started: Instant,
    ) -> Result<Served, ProxyError> {
        parts.headers.remove(header::TRANSFER_ENCODING);
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        let req = Request::from_parts(parts, full(body));
        let resp = match self.forwarder.send(req, peer).await {
            Ok(resp) => resp,
            Err(e) => {
                let fate = self.release(route, claim).await;
                return Err(forward_error(e, fate));
            }
        };
        let status = resp.status().as_u16();
        match settle(status) {
            Settlement::Release => {
                let _ = self.release(route, claim).await;
                Ok((Outcome::UpstreamError, resp.map(boxed)))
            }
            Settlement::Store => {
                let deadline = started + self.forwarder.timeout();
                self.store_response(route, claim, resp, deadline).await
            }
        }
    }

    /// Reads the upstream body (bounded in size and time) and records it.
    async fn store_response(
        &self,
        route: &RouteConfig,
        claim: &Claim,
        resp: Response<Incoming>,
        deadline: Instant,
    ) -> Result<Served, ProxyError> {
        let (parts, mut body) = resp.into_parts();
        let status = parts.status.as_u16();
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut size: u64 = 0;
        loop {
            // The head said below 500: the upstream executed. A body that
            // then fails must not free the key (the retry would run twice);
            // it completes without a replayable response instead.
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    let key = self
                        .finish(route, claim, Completion::Unstored { status })
                        .await;
                    return Err(ProxyError::UpstreamTimeout { key });
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    let key = self
                        .finish(route, claim, Completion::Unstored { status })
                        .await;
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
                warn!(key.id = %claim.key.log_id(), route = %route.label, limit = route.max_response_body,
                    "response larger than max_response_body; key completed without a stored body");
                self.finish(route, claim, Completion::Unstored { status })
                    .await;
                let body = Prefixed::new(chunks, body);
                return Ok((Outcome::Forwarded, Response::from_parts(parts, boxed(body))));
            }
        }
        let body = concat(chunks);
        let stored = StoredResponse {
            status,
            headers: headers::stored_headers(&parts.headers, route),
            body: body.clone(),
        };
        self.finish(route, claim, Completion::Stored(stored)).await;
        Ok((Outcome::Forwarded, Response::from_parts(parts, full(body))))
    }

    /// Records the completion. A few quick attempts happen before the
    /// response goes back; if the store is still down, the attempts go on in
    /// the background: until the completion lands the key stays in flight,
    /// and once its lease runs out a retry would run the request again.
    async fn finish(&self, route: &RouteConfig, claim: &Claim, completion: Completion) -> KeyFate {
        let recorder = CompletionRecorder {
            ambiguous: Default::default(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            store_timeout: self.store_timeout,
            route: route.label.clone(),
            claim: claim.clone(),
            completion,
        };
        for attempt in 1..=STORE_WRITE_ATTEMPTS {
            match recorder.attempt().await {
                Some(Fence::Held) => return KeyFate::Kept,
                Some(Fence::Lost) => return KeyFate::TakenOver,
                None => {}
            }
            if attempt < STORE_WRITE_ATTEMPTS {
                tokio::time::sleep(STORE_WRITE_BACKOFF * attempt).await;
            }
        }
        let persist = route.lease.max(MIN_COMPLETION_PERSIST);
        warn!(key.id = %claim.key.log_id(), for_secs = persist.as_secs(),
            "could not record completion yet; retrying in the background");
        self.tasks.spawn(recorder.persist(persist));
        KeyFate::Kept
    }

    /// Gives the key back so a retry runs again; says whether it did.
    async fn release(&self, route: &RouteConfig, claim: &Claim) -> KeyFate {
        let mut ambiguous = false;
        for attempt in 1..=STORE_WRITE_ATTEMPTS {
            match self
                .timed("release", self.store.release(&claim.key, &claim.token))
                .await
            {
                Ok(Fence::Held) => return KeyFate::Released,
                // An earlier attempt that timed out may have deleted it.
                Ok(Fence::Lost) if ambiguous => return KeyFate::Released,
                Ok(Fence::Lost) => {
                    self.metrics.lost_fence(&route.label);
                    warn!(key.id = %claim.key.log_id(), "release refused: the claim had been taken over");
                    return KeyFate::TakenOver;
                }
                Err(e) if attempt < STORE_WRITE_ATTEMPTS => {
                    ambiguous = true;
                    warn!(key.id = %claim.key.log_id(), attempt, error = %e, "could not release key; retrying");
                    tokio::time::sleep(STORE_WRITE_BACKOFF * attempt).await;
                }
                Err(e) => error!(key.id = %claim.key.log_id(), error = %e,
                    "could not release key; a retry gets 409 until the lease runs out"),
            }
        }
        KeyFate::Locked
    }

    /// Forwards without protection, streaming both ways.
    async fn passthrough(&self, req: Request<ProxyBody>, peer: SocketAddr) -> Served {
        match self.forwarder.send(req, peer).await {
            Ok(resp) => (Outcome::Passthrough, resp.map(boxed)),
            Err(e) => {
                let err = forward_error(e, KeyFate::Unprotected);
                warn!(error = %err, "upstream failed");
                let problem = Problem::from_error(&err);
                (problem.outcome, problem.into_response())
            }
        }
    }

    /// A store call bounded by the store timeout, with its latency recorded.
    async fn timed<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.store_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        };
        self.metrics.store_op(op, started.elapsed());
        result
    }
}

/// See [`Proxy::give_back`].
struct GiveBack {
    store: Arc<dyn Store>,
    timeout: Duration,
    claim: Claim,
}

impl GiveBack {
    async fn run(self) {
        let c = &self.claim;
        let until = Instant::now() + Duration::from_millis(c.lease_ms.max(0) as u64);
        let mut backoff = STORE_WRITE_BACKOFF;
        // Lost means "no row with our token (yet)": a late commit may still
        // land, so keep looking until the lease would have freed the key.
        while Instant::now() < until {
            let release = self.store.release(&c.key, &c.token);
            if let Ok(Ok(Fence::Held)) = tokio::time::timeout(self.timeout, release).await {
                debug!(key.id = %c.key.log_id(), "gave back a claim whose outcome was unknown");
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// The proxy's own bound on a store call. PostgreSQL enforces
/// `store.timeout` itself (and cleans up after it), so the proxy allows
/// that plus the Redis round trips in front of it and a margin: the inner
/// deadline fires first and the outer one only catches what is stuck.
fn store_call_bound(config: &Config) -> Duration {
    const MARGIN: Duration = Duration::from_millis(250);
    match config.store.backend {
        Backend::Postgres => {
            let redis = config
                .redis
                .as_ref()
                .map(|r| r.timeout * 2)
                .unwrap_or_default();
            config.store.timeout + redis + MARGIN
        }
        Backend::Sqlite | Backend::Memory => config.store.timeout,
    }
}

/// One completion write, fenced, with everything it needs to outlive the
/// request that made it.
struct CompletionRecorder {
    /// An earlier attempt failed without an answer: it may have landed.
    ambiguous: std::sync::atomic::AtomicBool,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    store_timeout: Duration,
    route: Arc<String>,
    claim: Claim,
    completion: Completion,
}

impl CompletionRecorder {
    /// The store's answer (a `Lost` after an unanswered attempt counts as
    /// `Held`: that attempt may have landed), or `None` to try again.
    async fn attempt(&self) -> Option<Fence> {
        let c = &self.claim;
        let started = Instant::now();
        // The ttl counts from the claim, but a request that ran nearly as
        // long as its ttl must still replay for at least a lease afterwards.
        let expires_at = c.expires_at().max(now_millis() + c.lease_ms);
        let write = self
            .store
            .complete(&c.key, &c.token, &self.completion, expires_at);
        let result = tokio::time::timeout(self.store_timeout, write).await;
        self.metrics.store_op("complete", started.elapsed());
        match result {
            Ok(Ok(Fence::Held)) => Some(Fence::Held),
            Ok(Ok(Fence::Lost)) if self.ambiguous.load(Ordering::Relaxed) => {
                debug!(key.id = %c.key.log_id(), "completion already recorded by an earlier attempt, or taken over");
                Some(Fence::Held)
            }
            Ok(Ok(Fence::Lost)) => {
                self.metrics.lost_fence(&self.route);
                warn!(key.id = %c.key.log_id(), route = %self.route,
                    "completion refused: the lease ran out and another request took the key over");
                Some(Fence::Lost)
            }
            Ok(Err(e)) => {
                self.ambiguous.store(true, Ordering::Relaxed);
                warn!(key.id = %c.key.log_id(), error = %e, "could not record completion");
                None
            }
            Err(_) => {
                self.ambiguous.store(true, Ordering::Relaxed);
                warn!(key.id = %c.key.log_id(), "could not record completion: store timed out");
                None
            }
        }
    }

    /// Keeps trying for `persist`, backing off up to a second between tries.
    async fn persist(self, persist: Duration) {
        let deadline = Instant::now() + persist;
        let mut backoff = STORE_WRITE_BACKOFF;
        while Instant::now() < deadline {
            tokio::time::sleep(backoff).await;
            // Nothing else renews the lease now; without this a retry could
            // take the key over and run the request again meanwhile.
            let c = &self.claim;
            let renew = self
                .store
                .renew(&c.key, &c.token, now_millis() + c.lease_ms);
            if let Ok(Ok(Fence::Lost)) = tokio::time::timeout(self.store_timeout, renew).await {
                // Taken over, or an earlier attempt did land: one last try says which.
                self.attempt().await;
                return;
            }
            if self.attempt().await.is_some() {
                info!(key.id = %self.claim.key.log_id(), "completion recorded after a store outage");
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
        error!(key.id = %self.claim.key.log_id(),
            "gave up recording completion; a retry after the lease runs out will run the request again");
    }
}

/// The next wait after a failed renewal: from 100 ms doubling, at most half
/// the renewal interval, so several tries still fit in the lease.
fn retry_wait(previous: Duration, every: Duration) -> Duration {
    let cap = (every / 2).max(MIN_RENEW_INTERVAL);
    if previous >= every {
        MIN_RENEW_INTERVAL
    } else {
        (previous * 2).min(cap)
    }
}

fn forward_error(e: ForwardError, key: KeyFate) -> ProxyError {
    match e {
        ForwardError::Connect(reason) => ProxyError::UpstreamUnreachable { reason, key },
        ForwardError::Timeout => ProxyError::UpstreamTimeout { key },
        ForwardError::Failed(reason) => ProxyError::UpstreamFailed { reason, key },
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

fn fingerprint_of(parts: &request::Parts, route: &RouteConfig, body: &[u8]) -> Fingerprint {
    let headers: Vec<(&HeaderName, Vec<&[u8]>)> = route
        .fingerprint_headers
        .iter()
        .map(|name| {
            let values = parts
                .headers
                .get_all(name)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect();
            (name, values)
        })
        .collect();
    // The normalized path: the spelling that matched the route is the resource.
    Fingerprint::compute(
        &parts.method,
        &crate::route::normalize_path(parts.uri.path()),
        parts.uri.query(),
        &headers,
        body,
    )
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().expect("one chunk"),
        _ => Bytes::from(chunks.concat()),
    }
}

/// The stored response, byte for byte, plus the replay marker.
fn replay_response(stored: StoredResponse) -> Response<ProxyBody> {
    let mut resp = Response::new(full(stored.body));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    for (name, value) in stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.append(n, v);
            }
            _ => warn!("dropping an invalid stored header"),
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    resp
}
