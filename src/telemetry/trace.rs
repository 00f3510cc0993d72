//! OpenTelemetry traces: the few hooks the request path calls, each a no-op
//! when tracing is off (no `[tracing]` section) or not compiled in (the
//! `otel` feature). The SDK, the OTLP exporter and its HTTP client are in
//! `trace/otel.rs`; nothing else in the crate names OpenTelemetry.
//!
//! One request is one server span, started by [`Tracer::start`] from the
//! client's `traceparent` (continuing its trace) and made current for the
//! request's futures by [`within`] (and [`in_current`] for the task a
//! protected request runs in). Under it, [`store`] and [`upstream`] open
//! child spans found through the current context, so the store seam and the
//! upstream client need no parameter threaded down to them. The span
//! carries the route, the outcome, the status and the key's id
//! (`RecordKey::log_id`, a truncated hash): never the key, a credential, a
//! query or a body.
//!
//! The server span ends when the request's response is handed to hyper and
//! its detached work (a protected request's task) is done; a pass-through
//! body that streams on afterwards is not in it. The upstream span ends at
//! the response head, or the failure.

use crate::metrics::Outcome;
use http::{Request, Response, StatusCode, Uri};
use std::fmt;
use std::future::Future;

#[cfg(feature = "otel")]
mod otel;
#[cfg(feature = "otel")]
use tokio_util::either::Either;

/// `[tracing]` as `config` parsed it (the settings live here, with their user).
#[derive(Clone, Debug, PartialEq)]
pub struct TracingConfig {
    /// Where spans are POSTed: the collector's base URL with `/v1/traces`
    /// appended, or the URL as written when it has a path of its own.
    pub traces_url: Uri,
    /// `service.name` of every span's resource.
    pub service_name: String,
    /// The share of traces started here that are recorded (0 to 1); a
    /// request carrying a `traceparent` follows its sampled flag.
    pub sampling_ratio: f64,
}

/// Starts request spans; cheap to clone. [`Tracer::disabled`] when the
/// config has no `[tracing]`.
#[derive(Clone, Default)]
pub struct Tracer {
    #[cfg(feature = "otel")]
    exporting: Option<std::sync::Arc<otel::Exporting>>,
}

/// A request's trace context, from [`Tracer::start`] to [`within`].
pub struct RequestTrace {
    #[cfg(feature = "otel")]
    cx: Option<opentelemetry::Context>,
}

/// A store call's or the upstream call's span; ends when dropped.
pub struct ChildSpan {
    #[cfg(feature = "otel")]
    span: Option<opentelemetry_sdk::trace::Span>,
}

// === impl Tracer ===

impl Tracer {
    pub fn disabled() -> Self {
        Self::default()
    }

    /// The exporter for `config` (its batch thread starts here); spans are
    /// flushed when the last clone is dropped. Without the `otel` feature
    /// there is no `[tracing]` config to pass (the section is refused).
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub fn new(config: Option<&TracingConfig>) -> Self {
        Self {
            #[cfg(feature = "otel")]
            exporting: config.and_then(|c| match otel::Exporting::launch(c) {
                Ok(e) => Some(std::sync::Arc::new(e)),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the OTLP exporter; running without traces");
                    None
                }
            }),
        }
    }

    pub fn is_enabled(&self) -> bool {
        #[cfg(feature = "otel")]
        return self.exporting.is_some();
        #[cfg(not(feature = "otel"))]
        false
    }

    /// The server span of one request: a child of the client's
    /// `traceparent` when it sent a valid one, else the root of a new trace.
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub fn start<B>(&self, req: &Request<B>) -> RequestTrace {
        RequestTrace {
            #[cfg(feature = "otel")]
            cx: self.exporting.as_ref().map(|e| e.start(req)),
        }
    }
}

/// Runs `fut` (a request's handling) with `trace` as the current context.
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn within<F: Future>(trace: RequestTrace, fut: F) -> impl Future<Output = F::Output> {
    #[cfg(feature = "otel")]
    return match trace.cx {
        Some(cx) => Either::Left(opentelemetry::context::FutureExt::with_context(fut, cx)),
        None => Either::Right(fut),
    };
    #[cfg(not(feature = "otel"))]
    fut
}

/// `fut` under the current request's context, for a task spawned from it.
pub fn in_current<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    let trace = RequestTrace {
        #[cfg(feature = "otel")]
        cx: otel::current_request(),
    };
    within(trace, fut)
}

/// The matched route: the span's `http.route` and name (`POST /orders`).
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn set_route(label: &str) {
    #[cfg(feature = "otel")]
    otel::with_server_span(|s| s.set_route(label));
}

/// The key's id (`RecordKey::log_id`), as `idemgate.key.id`.
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn set_key_id(id: &str) {
    #[cfg(feature = "otel")]
    otel::with_server_span(|s| s.set_key_id(id));
}

/// How the request ended; the last call wins (an unguarded forward first
/// records its pass-through, then `unguarded`).
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn record(outcome: Outcome, status: StatusCode) {
    #[cfg(feature = "otel")]
    otel::with_server_span(|s| s.record(outcome, status));
}

/// A store call's span (`store claim`), under the current request's span.
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn store(op: &'static str) -> ChildSpan {
    ChildSpan {
        #[cfg(feature = "otel")]
        span: otel::store_span(op),
    }
}

/// The upstream call's span, and its `traceparent` set on `req` (so the
/// upstream continues the trace under this span). Without a current
/// request trace, `req` is left as it is: a client's `traceparent` passes
/// through untouched.
#[cfg_attr(not(feature = "otel"), allow(unused_variables))]
pub fn upstream<B>(req: &mut Request<B>, upstream: &Uri) -> ChildSpan {
    ChildSpan {
        #[cfg(feature = "otel")]
        span: otel::upstream_span(req, upstream),
    }
}

/// The current request's trace id (32 hex digits), for log lines.
pub fn current_trace_id() -> Option<String> {
    #[cfg(feature = "otel")]
    return otel::current_trace_id();
    #[cfg(not(feature = "otel"))]
    None
}

// === impl ChildSpan ===

impl ChildSpan {
    /// Marks the span failed when `result` is an error.
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub fn finish<T, E: fmt::Display>(self, result: &Result<T, E>) {
        #[cfg(feature = "otel")]
        if let (Some(mut span), Err(e)) = (self.span, result) {
            otel::fail(&mut span, e);
        }
    }

    /// The upstream's status, or its failure.
    #[cfg_attr(not(feature = "otel"), allow(unused_variables))]
    pub fn finish_response<B, E: fmt::Display>(self, result: &Result<Response<B>, E>) {
        #[cfg(feature = "otel")]
        if let Some(mut span) = self.span {
            match result {
                Ok(resp) => otel::response(&mut span, resp.status()),
                Err(e) => otel::fail(&mut span, e),
            }
        }
    }
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::*;

    fn tracer() -> Tracer {
        // Nothing listens on port 9: exports fail, which these tests ignore.
        Tracer::new(Some(&TracingConfig {
            traces_url: "http://127.0.0.1:9/v1/traces".parse().unwrap(),
            service_name: "idemgate".into(),
            sampling_ratio: 1.0,
        }))
    }

    #[tokio::test]
    async fn the_current_trace_id_is_the_clients_inside_a_request_and_none_outside() {
        let tracer = tracer();
        assert!(tracer.is_enabled());
        let req = Request::post("/orders")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .body(())
            .unwrap();
        let inside = within(tracer.start(&req), async { current_trace_id() }).await;
        assert_eq!(inside.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        let spawned = within(tracer.start(&req), async {
            tokio::spawn(in_current(async { current_trace_id() }))
                .await
                .unwrap()
        })
        .await;
        assert_eq!(spawned, inside, "a task spawned with in_current keeps it");
        assert_eq!(current_trace_id(), None);
        let untraced = within(Tracer::disabled().start(&req), async { current_trace_id() }).await;
        assert_eq!(untraced, None);
    }

    #[tokio::test]
    async fn a_request_without_traceparent_gets_a_new_trace_and_upstream_headers_carry_it() {
        let tracer = tracer();
        let req = Request::get("/x").body(()).unwrap();
        let upstream: Uri = "http://127.0.0.1:3000".parse().unwrap();
        let (id, sent) = within(tracer.start(&req), async {
            let mut out = Request::get("/x").body(()).unwrap();
            drop(super::upstream(&mut out, &upstream));
            (current_trace_id(), out.headers()["traceparent"].clone())
        })
        .await;
        let id = id.expect("a trace id");
        assert_eq!(id.len(), 32);
        let sent = sent.to_str().unwrap();
        assert!(sent.starts_with(&format!("00-{id}-")), "{sent}");
        assert!(sent.ends_with("-01"), "sampled at ratio 1: {sent}");
    }
}
