//! The admin listener, separate from proxied traffic: `GET /healthz` (the
//! process is up), `GET /readyz` (the store answers) and `GET /metrics`
//! (Prometheus text format).

use crate::body::{full, ProxyBody};
use crate::metrics::Metrics;
use crate::store::Store;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Readiness must answer before a kubelet's 1 s probe timeout.
const READY_TIMEOUT: Duration = Duration::from_millis(800);

pub struct Admin {
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// Set when shutdown starts: readiness fails so load balancers move
    /// traffic away while in-flight requests drain.
    pub draining: Arc<AtomicBool>,
}

impl Admin {
    pub async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" if self.draining.load(Ordering::Relaxed) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: shutting down\n",
            ),
            "/readyz" => match tokio::time::timeout(READY_TIMEOUT, self.store.ping()).await {
                // A fast path that is down costs speed, not correctness:
                // still ready, with the cause for the operator.
                Ok(Ok(())) => match self.store.degraded() {
                    None => text(StatusCode::OK, "ready\n"),
                    Some(note) => text(StatusCode::OK, &format!("ready\ndegraded: {note}\n")),
                },
                Ok(Err(e)) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("not ready: {e}\n"),
                ),
                Err(_) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: store timed out\n",
                ),
            },
            "/metrics" => {
                let mut resp = text(StatusCode::OK, &self.metrics.encode());
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                resp
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /healthz, /readyz or /metrics\n",
            ),
        }
    }
}

fn text(status: StatusCode, body: &str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}
