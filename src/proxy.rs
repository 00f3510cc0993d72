//! The request path. [`Proxy::handle`] always produces a response (hyper
//! would abort the connection on an error): it admits the request, finds
//! its route, passes unrouted requests through streaming and hands routed
//! ones, once, to `protected.rs`.
//!
//! - `admission.rs`: rules every request must meet before route lookup.
//! - `protected.rs`: a protected request from its key to its stored answer;
//!   `protected/prepare.rs`: its key, scope and fingerprint;
//!   `protected/wait.rs`: duplicates waiting for a request in flight.
//! - `replay.rs`: capturing a response for storage, and replaying it.
//! - `forward.rs`: the upstream client and pass-through; `headers.rs`:
//!   header rules.
//! - `log.rs`: where a result becomes a response; the access log line and
//!   request metric, once per request.
//! - `request_id.rs`: `X-Request-Id`, kept or generated, and the problem
//!   `instance` it names.
//! - `latency.rs`: each route's typical latency, for `Retry-After`.
//! - [`crate::lease`]: holding the key while the upstream runs.

pub mod admission;
pub mod forward;
pub mod headers;
mod latency;
mod log;
pub(crate) mod protected;
mod replay;
mod replay_check;
pub mod request_id;

use crate::body::budget::BodyBudget;
use crate::body::{boxed, ProxyBody};
use crate::clock::Clock;
use crate::config::{Config, Secret};
use crate::lease::Leases;
use crate::metrics::Metrics;
use crate::net::drain::Drain;
use crate::route::{normalize_path, RouteTable};
use crate::store::Store;
use crate::telemetry::trace;
use crate::upstream::UpstreamSetupError;
use forward::Forwarder;
use http::{Request, Response};
use hyper::body::Incoming;
use log::RequestLog;
use protected::wait::Waiting;
use request_id::{RequestId, X_REQUEST_ID};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

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
    /// Scopes whose `replay_check` passed lately (a reload forgets them).
    replay_checks: replay_check::Passed,
    services: Services,
}

/// The process's services, which every generation of the proxy (one per
/// config reload) shares.
#[derive(Clone)]
struct Services {
    /// Claims and the leases they win (renew, complete, release).
    leases: Arc<Leases>,
    /// Bounds the protected bodies buffered at once, process-wide.
    body_budget: Arc<BodyBudget>,
    /// Keys the scope digests when set (`IDEMGATE_SCOPE_SECRET`).
    scope_secret: Option<Secret>,
    metrics: Arc<Metrics>,
    /// One exporter per process: `[tracing]` changes need a restart.
    tracer: trace::Tracer,
    /// Duplicates waiting for a request in flight (`in_flight = { wait }`).
    waiting: Waiting,
    /// Detached work: protected requests from their claim on, and store
    /// writes that outlive them. Shutdown waits for it.
    tasks: TaskTracker,
}

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
        let waiting = Waiting::new(config, &metrics, drain.close_connections.clone());
        let services = Services {
            leases: Leases::new(
                store,
                metrics.clone(),
                tasks.clone(),
                clock,
                crate::lease::MAX_PENDING_COMPLETIONS,
            ),
            body_budget: BodyBudget::new(
                config.restart.server.max_buffered_body_bytes,
                metrics.buffered_body_bytes().clone(),
                metrics.body_budget_refusals().clone(),
            ),
            scope_secret: config.scope_secret.clone(),
            waiting,
            metrics,
            tracer: trace::Tracer::new(config.restart.tracing.as_ref()),
            tasks,
        };
        // Process-wide (at most the starting `server.max_connections`), so
        // a reload does not add another limit.
        let tunnels = Arc::new(Semaphore::new(config.restart.server.max_connections));
        Self::assemble(config, services, tunnels)
    }

    /// This proxy on a reloaded config: routes, per-route settings and the
    /// upstream client come from `config`; the store, the leases, the body
    /// budget and the detached tasks are this one's, so requests running
    /// on either proxy share them.
    /// Fails when an upstream's client cannot be built (its TLS files).
    pub fn reconfigured(&self, config: &Config) -> Result<Self, UpstreamSetupError> {
        let services = Services {
            waiting: self.services.waiting.reconfigured(&config.routes),
            ..self.services.clone()
        };
        Self::assemble(config, services, self.forwarder.tunnels.clone())
    }

    /// The per-config part built from `config`, around the process-wide
    /// `services` and open-tunnel limit: what a reload replaces, in one place.
    fn assemble(
        config: &Config,
        services: Services,
        tunnels: Arc<Semaphore>,
    ) -> Result<Self, UpstreamSetupError> {
        Ok(Self {
            routes: config.routes.clone(),
            forwarder: Forwarder::new(config, services.metrics.clone(), tunnels)?,
            request_body_timeout: config.server.request_body_timeout,
            latencies: latency::Latencies::new(config.routes.iter().map(|r| &r.label)),
            replay_checks: replay_check::Passed::default(),
            services,
        })
    }

    /// Whether the default upstream answers `GET path` (any status) within
    /// `within`: `server.readiness = "upstream"`.
    pub async fn probe_upstream(&self, path: &str, within: Duration) -> Result<u16, String> {
        self.forwarder.probe(path, within).await
    }

    /// The key ids of completions still waiting for the store.
    pub fn pending_completions(&self) -> Vec<String> {
        self.services.leases.backlog().key_ids()
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
        let span = self.services.tracer.start(&req);
        let mut resp = trace::within(span, self.serve(req, peer, id.clone())).await;
        resp.headers_mut().insert(X_REQUEST_ID, id.header_value());
        resp
    }

    /// Admission and the route: an unrouted request passes through, a
    /// routed one goes to [`Proxy::protect`].
    async fn serve(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        id: RequestId,
    ) -> Response<ProxyBody> {
        let mut log = RequestLog::start(&req, peer, id, self.routes.default_errors());
        let metrics = &self.services.metrics;
        if let Err(e) = admission::admit(&mut req) {
            // Refused before routing, but a protected route's answer still
            // says what idempotency did (`Idempotency-Status`).
            let path = normalize_path(req.uri().path());
            if let Some(route) = self.routes.find(req.method(), &path) {
                log.set_route(route);
            }
            return log.conclude(metrics, Err(e));
        }
        let path = normalize_path(req.uri().path());
        let Some(route) = self.routes.find(req.method(), &path).cloned() else {
            let keyed = log::carries_key(self.routes.key_headers(), req.headers());
            let served = self.forwarder.passthrough(None, req.map(boxed), peer);
            let mut resp = log.conclude(metrics, served.await);
            if keyed {
                log::mark_ignored(resp.headers_mut());
            }
            return resp;
        };
        log.set_route(&route);
        trace::set_route(&route.label);
        if let Some(prefix) = &route.strip_prefix {
            req.extensions_mut()
                .insert(forward::StripPrefix(prefix.clone()));
        }
        if let Err(e) = admission::refuse_protected_upgrade(&route, &req) {
            return log.conclude(metrics, Err(e));
        }
        // Boxed: the protected path's state is many times a pass-through's,
        // and every request's future is moved (copied) as large as its
        // largest branch; boxing keeps pass-through's small.
        Box::pin(self.protect(route, req, peer, log)).await
    }
}
