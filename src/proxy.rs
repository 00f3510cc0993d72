//! The request path. [`Proxy::handle`] always produces a response (hyper
//! would abort the connection on an error): it finds the route, passes
//! unprotected requests through streaming, and hands protected ones to
//! `protected.rs`; [`respond`] is where a result becomes a response.
//!
//! - `admission.rs`: rules every request must meet before route lookup.
//! - `protected.rs`: a protected request from its key to its stored answer.
//! - `replay.rs`: capturing a response for storage, and replaying it.
//! - `forward.rs`: the upstream client; `headers.rs`: header rules.
//! - `log.rs`: the access log line and request metric, once per request.
//! - `request_id.rs`: `X-Request-Id`, kept or generated, and the problem
//!   `instance` it names.
//! - `waiters.rs`: duplicates waiting for a request in flight;
//!   `latency.rs`: each route's typical latency, for `Retry-After`.
//! - [`crate::lease`]: holding the key while the upstream runs.

pub mod admission;
pub mod forward;
pub mod headers;
mod latency;
mod log;
pub(crate) mod protected;
mod replay;
pub mod request_id;
pub mod waiters;

use crate::body::budget::BodyBudget;
use crate::body::{self, boxed, ProxyBody};
use crate::clock::Clock;
use crate::config::{Config, Secret, StoreConfig};
use crate::error::{Origin, ProxyError};
use crate::lease::{KeyFate, Leases};
use crate::metrics::{GaugeGuard, Metrics, Outcome};
use crate::net::connection::Guarded;
use crate::net::drain::Drain;
use crate::problem::Problem;
use crate::route::{normalize_path, RouteTable};
use crate::store::Store;
use crate::telemetry::trace;
use crate::upstream::UpstreamSetupError;
use forward::Forwarder;
use http::{Request, Response};
use hyper::body::Incoming;
use log::RequestLog;
use protected::{parse_body, plan_key, prepare, read_body, resolve_key, KeyPlan};
use request_id::{RequestId, X_REQUEST_ID};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// Serves every proxied request; shared by connections. A config reload
/// replaces it with [`Proxy::reconfigured`]: a request keeps the one it
/// started on (an `Arc`) to its end.
pub struct Proxy {
    /// The protected routes, tried in file order.
    routes: RouteTable,
    /// How long a client may take to send a protected request's body.
    request_body_timeout: Duration,
    /// The upstreams' pooled clients and the forwarding rules.
    forwarder: Forwarder,
    /// Each route's typical upstream latency, for `Retry-After`.
    latencies: latency::Latencies,
    /// What every generation shares (the store's leases, budgets, tasks).
    shared: Shared,
}

/// What every generation of the proxy (one per config reload) shares.
#[derive(Clone)]
struct Shared {
    /// Claims and the leases they win (renew, complete, release).
    leases: Arc<Leases>,
    /// Bounds the protected bodies buffered at once, process-wide.
    body_budget: Arc<BodyBudget>,
    /// Keys the scope digests when set (`IDEMGATE_SCOPE_SECRET`).
    scope_secret: Option<Secret>,
    metrics: Arc<Metrics>,
    /// One exporter per process: `[tracing]` changes need a restart.
    tracer: trace::Tracer,
    /// Duplicates waiting for a request in flight (`in_flight = { wait }`):
    /// one registry per process, so a request finishing on one config
    /// generation wakes the duplicates waiting on another.
    waiters: Arc<waiters::Waiters>,
    /// Wakes waiters on other replicas (PostgreSQL with a waiting route).
    notifier: Option<Arc<crate::store::notify::KeyNotifier>>,
    /// The store the process runs on (restart-only): what a notifier
    /// started on a later reload must listen to.
    store_config: Arc<StoreConfig>,
    /// Open tunnels, process-wide (at most the starting
    /// `server.max_connections`), so a reload does not add another limit.
    tunnels: Arc<Semaphore>,
    /// Cancelled when the server closes its connections (the drain's
    /// phase 3): duplicates still waiting answer 409 then.
    draining: CancellationToken,
    /// Detached work: protected requests from their claim on, and store
    /// writes that outlive them. Shutdown waits for it.
    tasks: TaskTracker,
}

/// How a request ended, and what the client gets.
type Served = (Outcome, Response<ProxyBody>);

impl Proxy {
    /// The one place the config becomes the request path's settings.
    /// Fails when an upstream's TLS files cannot be read.
    pub fn new(
        config: &Config,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        clock: Clock,
        drain: &Drain,
    ) -> Result<Self, UpstreamSetupError> {
        let tasks = drain.tasks.clone();
        let waiters = Arc::new(
            waiters::Waiters::new(waiters::MAX_WAITERS_PER_KEY, waiters::MAX_WAITERS_TOTAL)
                .with_gauge(metrics.waiters().clone()),
        );
        let notifier =
            waiters::spawn_notifier(&config.store, &config.routes, &waiters).map(Arc::new);
        let shared = Shared {
            leases: Leases::new(
                store,
                metrics.clone(),
                tasks.clone(),
                clock,
                crate::lease::MAX_PENDING_COMPLETIONS,
            ),
            body_budget: BodyBudget::new(
                config.server.max_buffered_body_bytes,
                metrics.buffered_body_bytes().clone(),
                metrics.body_budget_refusals().clone(),
            ),
            scope_secret: config.scope_secret.clone(),
            waiters,
            notifier,
            store_config: Arc::new(config.store.clone()),
            tunnels: Arc::new(Semaphore::new(config.server.max_connections)),
            draining: drain.close_connections.clone(),
            metrics,
            tracer: trace::Tracer::new(config.tracing.as_ref()),
            tasks,
        };
        Self::assemble(config, shared)
    }

    /// This proxy on a reloaded config: routes, per-route settings and the
    /// upstream client come from `config`; the store, the leases, the body
    /// budget and the detached tasks are this one's, so requests running
    /// on either proxy share them.
    /// Fails when an upstream's client cannot be built (its TLS files).
    pub fn reconfigured(&self, config: &Config) -> Result<Self, UpstreamSetupError> {
        let mut shared = self.shared.clone();
        // Started on the first config with a waiting route.
        if shared.notifier.is_none() {
            shared.notifier =
                waiters::spawn_notifier(&shared.store_config, &config.routes, &shared.waiters)
                    .map(Arc::new);
        }
        Self::assemble(config, shared)
    }

    /// The per-config part built from `config`, around the process-wide
    /// `shared` part: what a reload replaces, in one place.
    fn assemble(config: &Config, shared: Shared) -> Result<Self, UpstreamSetupError> {
        Ok(Self {
            routes: config.routes.clone(),
            forwarder: Forwarder::new(config, shared.metrics.clone(), shared.tunnels.clone())?,
            request_body_timeout: config.server.request_body_timeout,
            latencies: latency::Latencies::new(config.routes.iter().map(|r| &r.label)),
            shared,
        })
    }

    /// The key ids of completions still waiting for the store.
    pub fn pending_completions(&self) -> Vec<String> {
        self.shared.leases.backlog().key_ids()
    }

    /// Serves one request; never fails. The request id goes upstream (in
    /// `X-Request-Id`, and in the request's extensions for the problem
    /// mapping) and back on every response; everything runs under the
    /// request's trace span, when tracing is on.
    pub async fn handle(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let id = RequestId::of_request(req.headers());
        req.headers_mut().insert(X_REQUEST_ID, id.header_value());
        req.extensions_mut().insert(id.clone());
        let mut resp = self.serve(req, peer, id.clone()).await;
        resp.headers_mut().insert(X_REQUEST_ID, id.header_value());
        resp
    }

    async fn serve(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
        id: RequestId,
    ) -> Response<ProxyBody> {
        let span = self.shared.tracer.start(&req);
        trace::within(span, self.serve_traced(req, peer, id)).await
    }

    async fn serve_traced(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        id: RequestId,
    ) -> Response<ProxyBody> {
        let mut log = RequestLog::start(&req, peer, id);
        if let Err(e) = admission::admit(&mut req) {
            return self.conclude(Err(e), log);
        }
        let path = normalize_path(req.uri().path());
        let Some(route) = self.routes.find(req.method(), &path).cloned() else {
            let (outcome, resp) = self.passthrough(None, req.map(boxed), peer).await;
            log.finish(&self.shared.metrics, outcome, &resp, false);
            return resp;
        };
        log.set_route(&route.label);
        trace::set_route(&route.label);
        if let Err(e) = admission::refuse_protected_upgrade(&route, &req) {
            return self.conclude(Err(e), log);
        }
        let upstream = route.upstream.clone();
        let plan = match plan_key(&route, req.headers(), self.shared.scope_secret.as_ref()) {
            Ok(KeyPlan::Absent) => {
                let (outcome, resp) = self
                    .passthrough(upstream.as_deref(), req.map(boxed), peer)
                    .await;
                log.finish(&self.shared.metrics, outcome, &resp, false);
                return resp;
            }
            Ok(plan) => plan,
            Err(e) => return self.conclude(Err(e), log),
        };
        // Owned only here: pass-through requests never copy their path.
        let path = path.into_owned();
        let (parts, mut body) = req.into_parts();
        let timeout = self.request_body_timeout;
        let budget = &self.shared.body_budget;
        let body = match read_body(&route, &parts.headers, &mut body, timeout, budget).await {
            Ok(body) => body,
            Err(e) => return self.conclude(Err(e), log),
        };
        log.set_bytes_in(body.len() as u64);
        let doc = parse_body(&route, &body);
        let key = match resolve_key(&route, plan, doc.as_ref()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let forwarded = Request::from_parts(parts, body::full(body));
                let (outcome, resp) = self.passthrough(upstream.as_deref(), forwarded, peer).await;
                log.finish(&self.shared.metrics, outcome, &resp, false);
                return resp;
            }
            Err(e) => return self.conclude(Err(e), log),
        };
        let req = prepare(route, parts, body, key, doc, &path, peer);
        let key_id = req.record_key.log_id();
        trace::set_key_id(&key_id);
        log.set_key_id(key_id);
        self.run_detached(req, log).await
    }

    /// Runs a protected request from its claim on in a task of its own and
    /// waits for its response. The task finishes the request's log, so a
    /// client that left is still counted.
    async fn run_detached(
        self: &Arc<Self>,
        req: protected::ProtectedRequest,
        log: RequestLog,
    ) -> Response<ProxyBody> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let this = Arc::clone(self);
        let task_log = log.clone();
        self.shared.tasks.spawn(trace::in_current(async move {
            let (outcome, resp) = respond(
                this.claim_and_execute(req).await,
                Some(task_log.request_id()),
            );
            // Counted and logged before the client can see the answer, so a
            // client that reads its response also sees it in the metrics.
            let client_left = tx.is_closed();
            task_log.finish(&this.shared.metrics, outcome, &resp, client_left);
            let _ = tx.send(resp);
        }));
        match rx.await {
            Ok(resp) => resp,
            Err(_) => self.conclude(
                Err(ProxyError::Internal(
                    "the request task ended without an answer".into(),
                )),
                log,
            ),
        }
    }

    /// [`respond`], then the log line.
    fn conclude(&self, result: Result<Served, ProxyError>, log: RequestLog) -> Response<ProxyBody> {
        let (outcome, resp) = respond(result, Some(log.request_id()));
        log.finish(&self.shared.metrics, outcome, &resp, false);
        resp
    }

    /// Forwards without protection to the upstream called `upstream`
    /// (`None`: the default), streaming both ways.
    async fn passthrough(
        &self,
        upstream: Option<&str>,
        req: Request<ProxyBody>,
        peer: SocketAddr,
    ) -> Served {
        let id = req.extensions().get::<RequestId>().cloned();
        let in_flight = self.upstream_request(upstream);
        match self.forwarder.send(upstream, req, peer).await {
            Ok(resp) => {
                trace::record(Outcome::Passthrough, resp.status());
                (
                    Outcome::Passthrough,
                    resp.map(|body| boxed(Guarded::new(body, in_flight))),
                )
            }
            Err(e) => respond(
                Err(ProxyError::upstream(e, KeyFate::Unprotected)),
                id.as_ref(),
            ),
        }
    }
}

impl Proxy {
    /// Counts a request on the upstream (`idemgate_upstream_in_flight`)
    /// while the guard lives.
    fn upstream_request(&self, upstream: Option<&str>) -> GaugeGuard {
        self.shared
            .metrics
            .upstream_request(self.forwarder.label(upstream))
    }
}

/// Where a request's result becomes what the client gets: errors through
/// the one mapping in `problem.rs` (its `instance` naming the request id),
/// logged by who is at fault, and the outcome recorded on the request's
/// trace span.
fn respond(result: Result<Served, ProxyError>, id: Option<&RequestId>) -> Served {
    let (outcome, resp) = match result {
        Ok(served) => served,
        Err(err) => {
            let request_id = id.map(RequestId::as_str).unwrap_or("-");
            match err.origin() {
                Origin::Client => debug!(error = %err, request.id = request_id, "request refused"),
                _ => warn!(error = %err, request.id = request_id, "request failed"),
            }
            let mut problem = Problem::from_error(&err);
            problem.instance = id.map(RequestId::instance);
            (problem.outcome, problem.into_response())
        }
    };
    trace::record(outcome, resp.status());
    (outcome, resp)
}
