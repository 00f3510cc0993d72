//! The access log line and the request metric: one of each per request,
//! written by [`RequestLog::finish`] wherever the request ends (the
//! connection's handler, or the detached task when the client has left).

use crate::metrics::{Metrics, Outcome};
use http::{Method, StatusCode};
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
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
}

impl RequestLog {
    pub fn start(method: &Method, path: &str, peer: SocketAddr) -> Self {
        Self {
            method: method.clone(),
            path: path.to_string(),
            route: UNROUTED.clone(),
            key_id: None,
            peer,
            started: Instant::now(),
        }
    }

    pub fn set_route(&mut self, label: &Arc<String>) {
        self.route = label.clone();
    }

    pub fn set_key_id(&mut self, id: String) {
        self.key_id = Some(id);
    }

    /// Counts the request and writes its access log line.
    pub fn finish(
        self,
        metrics: &Metrics,
        outcome: Outcome,
        status: StatusCode,
        client_left: bool,
    ) {
        metrics.request(&self.route, outcome);
        info!(
            target: "idemgate::access",
            method = %self.method,
            path = %self.path,
            route = %self.route,
            outcome = outcome.as_str(),
            status = status.as_u16(),
            latency_ms = self.started.elapsed().as_secs_f64() * 1000.0,
            key.id = self.key_id.as_deref().unwrap_or("-"),
            client.addr = %self.peer,
            client_left,
            "request"
        );
    }
}
