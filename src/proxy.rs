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
//! - `waiters.rs`: duplicates waiting for a request in flight;
//!   `latency.rs`: each route's typical latency, for `Retry-After`.
//! - [`crate::lease`]: holding the key while the upstream runs.

pub mod admission;
pub mod forward;
pub mod headers;
mod latency;
mod log;
mod protected;
mod replay;
pub mod waiters;

use crate::body::budget::BodyBudget;
use crate::body::{self, boxed, ProxyBody};
use crate::clock::Clock;
use crate::config::{Config, Secret};
use crate::error::{KeyFate, Origin, ProxyError};
use crate::lease::Leases;
use crate::metrics::{Metrics, Outcome};
use crate::problem::Problem;
use crate::route::{normalize_path, RouteTable};
use crate::store::Store;
use forward::{ForwardError, Forwarder};
use http::{Request, Response};
use hyper::body::Incoming;
use log::RequestLog;
use protected::{parse_body, plan_key, prepare, read_body, resolve_key, KeyPlan};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// Serves every proxied request; one per process, shared by connections.
pub struct Proxy {
    /// The protected routes, tried in file order.
    routes: RouteTable,
    /// Claims and the leases they win (renew, complete, release).
    leases: Arc<Leases>,
    /// How long a client may take to send a protected request's body.
    request_body_timeout: Duration,
    /// Bounds the protected bodies buffered at once, process-wide.
    body_budget: Arc<BodyBudget>,
    /// Keys the scope digests when set (`IDEMGATE_SCOPE_SECRET`).
    scope_secret: Option<Secret>,
    /// The pooled upstream client.
    forwarder: Forwarder,
    metrics: Arc<Metrics>,
    /// Duplicates waiting for a request in flight (`in_flight = { wait }`).
    waiters: Arc<waiters::Waiters>,
    /// Each route's typical upstream latency, for `Retry-After`.
    latencies: latency::Latencies,
    /// Wakes waiters on other replicas (PostgreSQL with a waiting route).
    notifier: Option<crate::store::notify::KeyNotifier>,
    /// Detached work: protected requests from their claim on, and store
    /// writes that outlive them. Shutdown waits for it.
    tasks: TaskTracker,
}

/// How a request ended, and what the client gets.
type Served = (Outcome, Response<ProxyBody>);

impl Proxy {
    /// The one place the config becomes the request path's settings.
    pub fn new(
        config: &Config,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Self {
        let tasks = TaskTracker::new();
        let waiters = Arc::new(
            waiters::Waiters::new(waiters::MAX_WAITERS_PER_KEY, waiters::MAX_WAITERS_TOTAL)
                .with_gauge(metrics.waiters().clone()),
        );
        let notifier = waiters::spawn_notifier(config, &waiters);
        Self {
            routes: config.routes.clone(),
            leases: Leases::new(
                store,
                metrics.clone(),
                tasks.clone(),
                clock,
                crate::lease::MAX_PENDING_COMPLETIONS,
            ),
            request_body_timeout: config.server.request_body_timeout,
            body_budget: BodyBudget::new(
                config.server.max_buffered_body_bytes,
                metrics.buffered_body_bytes().clone(),
                metrics.body_budget_refusals().clone(),
            ),
            scope_secret: config.scope_secret.clone(),
            forwarder: Forwarder::new(&config.server),
            waiters,
            notifier,
            latencies: latency::Latencies::new(config.routes.iter().map(|r| &r.label)),
            metrics,
            tasks,
        }
    }

    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// The key ids of completions still waiting for the store.
    pub fn pending_completions(&self) -> Vec<String> {
        self.leases.backlog().key_ids()
    }

    /// Serves one request; never fails.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let mut log = RequestLog::start(req.method(), req.uri().path(), peer);
        if let Err(e) = admission::admit(&req) {
            return self.conclude(Err(e), log);
        }
        let path = normalize_path(req.uri().path());
        let Some(route) = self.routes.find(req.method(), &path).cloned() else {
            let (outcome, resp) = self.passthrough(req.map(boxed), peer).await;
            log.finish(&self.metrics, outcome, resp.status(), false);
            return resp;
        };
        log.set_route(&route.label);
        let plan = match plan_key(&route, req.headers(), self.scope_secret.as_ref()) {
            Ok(KeyPlan::Absent) => {
                let (outcome, resp) = self.passthrough(req.map(boxed), peer).await;
                log.finish(&self.metrics, outcome, resp.status(), false);
                return resp;
            }
            Ok(plan) => plan,
            Err(e) => return self.conclude(Err(e), log),
        };
        // Owned only here: pass-through requests never copy their path.
        let path = path.into_owned();
        let (parts, mut body) = req.into_parts();
        let timeout = self.request_body_timeout;
        let budget = &self.body_budget;
        let body = match read_body(&route, &parts.headers, &mut body, timeout, budget).await {
            Ok(body) => body,
            Err(e) => return self.conclude(Err(e), log),
        };
        let doc = parse_body(&route, &body);
        let key = match resolve_key(&route, plan, doc.as_ref()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let forwarded = Request::from_parts(parts, body::full(body));
                let (outcome, resp) = self.passthrough(forwarded, peer).await;
                log.finish(&self.metrics, outcome, resp.status(), false);
                return resp;
            }
            Err(e) => return self.conclude(Err(e), log),
        };
        let req = prepare(route, parts, body, key, doc, &path, peer);
        log.set_key_id(req.record_key.log_id());
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
        self.tasks.spawn(async move {
            let (outcome, resp) = respond(this.claim_and_execute(req).await);
            // Counted and logged before the client can see the answer, so a
            // client that reads its response also sees it in the metrics.
            let client_left = tx.is_closed();
            task_log.finish(&this.metrics, outcome, resp.status(), client_left);
            let _ = tx.send(resp);
        });
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
        let (outcome, resp) = respond(result);
        log.finish(&self.metrics, outcome, resp.status(), false);
        resp
    }

    /// Forwards without protection, streaming both ways.
    async fn passthrough(&self, req: Request<ProxyBody>, peer: SocketAddr) -> Served {
        match self.forwarder.send(req, peer).await {
            Ok(resp) => (Outcome::Passthrough, resp.map(boxed)),
            Err(e) => respond(Err(forward_error(e, KeyFate::Unprotected))),
        }
    }
}

/// Where a request's result becomes what the client gets: errors through
/// the one mapping in `problem.rs`, logged by who is at fault.
fn respond(result: Result<Served, ProxyError>) -> Served {
    match result {
        Ok(served) => served,
        Err(err) => {
            match err.origin() {
                Origin::Client => debug!(error = %err, "request refused"),
                _ => warn!(error = %err, "request failed"),
            }
            let problem = Problem::from_error(&err);
            (problem.outcome, problem.into_response())
        }
    }
}

fn forward_error(e: ForwardError, key: KeyFate) -> ProxyError {
    match e {
        ForwardError::Connect(reason) => ProxyError::UpstreamUnreachable { reason, key },
        ForwardError::Timeout => ProxyError::UpstreamTimeout { key },
        ForwardError::Failed(reason) => ProxyError::UpstreamFailed { reason, key },
    }
}
