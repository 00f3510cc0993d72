//! How a request ends: [`respond`] turns its result into what the client
//! gets, and [`RequestLog::finish`] writes the access log line and the
//! request metric, one of each per request, wherever the request ends (the
//! connection's handler, or the detached task when the client has left).

use super::headers::content_length;
use super::request_id::RequestId;
use crate::body::ProxyBody;
use crate::error::{Origin, ProxyError};
use crate::metrics::{Metrics, Outcome};
use crate::problem::Problem;
use crate::route::errors::ErrorShape;
use crate::route::RouteConfig;
use crate::telemetry::trace;
use http::{header, Method, Request, Response, Version};
use http_body::Body;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// How a request ended, and what the client gets.
pub type Served = (Outcome, Response<ProxyBody>);

/// Where a request's result becomes what the client gets: errors through
/// the one mapping in `problem.rs` (its `instance` naming the request id,
/// its `key_id` the request's key once parsed), logged by who is at fault,
/// and the outcome recorded on the request's trace span.
pub fn respond(
    result: Result<Served, ProxyError>,
    id: Option<&RequestId>,
    key_id: Option<&str>,
    shape: &ErrorShape,
) -> Served {
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
            problem.key_id = key_id.map(str::to_string);
            (problem.outcome, problem.into_response(shape))
        }
    };
    trace::record(outcome, resp.status());
    (outcome, resp)
}

/// The route label of requests no route matched.
static UNROUTED: LazyLock<Arc<String>> = LazyLock::new(|| Arc::new("unrouted".to_string()));

/// What the access log says about one request, gathered as it goes.
#[derive(Clone, Debug)]
pub struct RequestLog {
    method: Method,
    /// The path as the client sent it (never the query: it may hold secrets).
    path: String,
    route: Arc<String>,
    /// The short non-reversible key id (`RecordKey::log_id`), once known.
    key_id: Option<String>,
    /// The shape of idemgate's error answers: the route's once it is
    /// known, else `[defaults] errors`.
    errors: ErrorShape,
    peer: SocketAddr,
    started: Instant,
    request_id: RequestId,
    version: Version,
    user_agent: Option<String>,
    /// The request body's length: `Content-Length`, or what a protected
    /// request's buffered body measured.
    bytes_in: Option<u64>,
}

/// How long the upstream took to answer with its head, put in the
/// response's extensions by the forwarder (absent when nothing was asked
/// upstream: replays, refusals).
#[derive(Clone, Copy, Debug)]
pub struct UpstreamTime(pub Duration);

/// User agents are the client's text: bounded in the log.
const MAX_USER_AGENT: usize = 256;

impl RequestLog {
    pub fn start<B>(
        req: &Request<B>,
        peer: SocketAddr,
        request_id: RequestId,
        errors: &ErrorShape,
    ) -> Self {
        let user_agent = req
            .headers()
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(MAX_USER_AGENT).collect());
        let bytes_in = content_length(req.headers());
        Self {
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            route: UNROUTED.clone(),
            key_id: None,
            errors: errors.clone(),
            peer,
            started: Instant::now(),
            request_id,
            version: req.version(),
            user_agent,
            bytes_in,
        }
    }

    pub fn set_route(&mut self, route: &RouteConfig) {
        self.route = route.label.clone();
        self.errors = route.errors.clone();
    }

    pub fn set_key_id(&mut self, id: String) {
        self.key_id = Some(id);
    }

    pub fn set_bytes_in(&mut self, n: u64) {
        self.bytes_in = Some(n);
    }

    /// [`respond`] with this request's id and key id.
    pub fn respond(&self, result: Result<Served, ProxyError>) -> Served {
        respond(
            result,
            Some(&self.request_id),
            self.key_id.as_deref(),
            &self.errors,
        )
    }

    /// [`respond`], then [`RequestLog::finish`]: a request answered where
    /// it was received.
    pub fn conclude(
        self,
        metrics: &Metrics,
        result: Result<Served, ProxyError>,
    ) -> Response<ProxyBody> {
        let (outcome, resp) = self.respond(result);
        self.finish(metrics, outcome, &resp, false);
        resp
    }

    /// Counts the request and writes its access log line. `bytes_out` is
    /// the response body's length when its head tells it (a streamed
    /// answer of unknown length logs none).
    pub fn finish<B: Body>(
        self,
        metrics: &Metrics,
        outcome: Outcome,
        resp: &Response<B>,
        client_left: bool,
    ) {
        metrics.request(&self.route, outcome);
        let bytes_out = resp.body().size_hint().exact();
        let upstream_ms = resp
            .extensions()
            .get::<UpstreamTime>()
            .map(|t| t.0.as_secs_f64() * 1000.0);
        info!(
            target: "idemgate::access",
            method = %self.method,
            request.id = self.request_id.as_str(),
            // Absent without tracing; `finish` runs inside the request's trace.
            trace.id = crate::telemetry::trace::current_trace_id().as_deref(),
            path = %self.path,
            protocol = ?self.version,
            route = %self.route,
            outcome = outcome.as_str(),
            status = resp.status().as_u16(),
            latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
            upstream_ms,
            bytes_in = self.bytes_in,
            bytes_out,
            key.id = self.key_id.as_deref().unwrap_or("-"),
            client.addr = %self.peer,
            user_agent = self.user_agent.as_deref(),
            client_left,
            "request"
        );
    }
}
