//! The access log line and the request metric: one of each per request,
//! written by [`RequestLog::finish`] wherever the request ends (the
//! connection's handler, or the detached task when the client has left).

use super::request_id::RequestId;
use crate::metrics::{Metrics, Outcome};
use http::{header, Method, Request, Response, Version};
use http_body::Body;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::time::Instant;
use tracing::info;

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
    pub fn start<B>(req: &Request<B>, peer: SocketAddr, request_id: RequestId) -> Self {
        let user_agent = req
            .headers()
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(MAX_USER_AGENT).collect());
        let bytes_in = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Self {
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            route: UNROUTED.clone(),
            key_id: None,
            peer,
            started: Instant::now(),
            request_id,
            version: req.version(),
            user_agent,
            bytes_in,
        }
    }

    pub fn set_route(&mut self, label: &Arc<String>) {
        self.route = label.clone();
    }

    pub fn set_key_id(&mut self, id: String) {
        self.key_id = Some(id);
    }

    pub fn set_bytes_in(&mut self, n: u64) {
        self.bytes_in = Some(n);
    }

    pub fn request_id(&self) -> &RequestId {
        &self.request_id
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
