//! The OpenTelemetry SDK behind `trace.rs`: a tracer provider with a
//! parent-based ratio sampler, a batch span processor (its own thread, a
//! bounded queue: spans past it are dropped, never waited for) and the
//! OTLP/HTTP protobuf exporter, which posts through [`ExportClient`].
//!
//! No global provider or propagator is installed: the tracer travels in
//! the request's [`Context`] (as [`ActiveTracer`]), so two servers in one
//! process (the tests) keep their own exporters.

use super::TracingConfig;
use crate::metrics::Outcome;
use async_trait::async_trait;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, Span, SpanData,
    SpanExporter,
};
use opentelemetry_sdk::Resource;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Spans waiting for export; past this they are dropped (the SDK counts
/// and logs them) rather than holding memory or slowing requests.
const MAX_QUEUE: usize = 2048;
/// How often a batch is sent when the queue is not full.
const EXPORT_INTERVAL: Duration = Duration::from_secs(2);
/// One export (connect, send, answer); a collector slower than this loses
/// the batch, not the requests.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// A collector's answer is a small protobuf; anything larger is refused.
const MAX_EXPORT_RESPONSE: usize = 64 << 10;
/// Time given to the last batches at shutdown, after the drain: short,
/// so shutdown_delay + shutdown_grace + this stays within Kubernetes'
/// default 30 s termination grace (deploy/kustomize: 5 + 20 + 3).
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(3);

/// The running exporter. Dropping it flushes what is queued (on a blocking
/// thread, so a runtime worker never waits for the collector).
pub(super) struct Exporting {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// The tracer, in a request's context, for its child spans.
#[derive(Clone)]
struct ActiveTracer(SdkTracer);

/// The request's server span, in its context. Its outcome is set last and
/// written when the span ends: when the last clone of the context (the
/// connection's future, or the task a protected request runs in) is gone.
pub(super) struct ServerSpan {
    method: String,
    span: Mutex<Span>,
    result: Mutex<Option<(Outcome, StatusCode)>>,
}

// === impl Exporting ===

impl Exporting {
    pub(super) fn launch(config: &TracingConfig) -> Result<Self, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(ExportClient {
                timeout: EXPORT_TIMEOUT,
            })
            .with_endpoint(config.traces_url.to_string())
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| e.to_string())?;
        let exporter = Reporting {
            inner: exporter,
            url: config.traces_url.to_string(),
            failing: AtomicBool::new(false),
        };
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(MAX_QUEUE)
                    .with_scheduled_delay(EXPORT_INTERVAL)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sampling_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        let tracer = provider.tracer("idemgate");
        Ok(Self { provider, tracer })
    }

    /// The request's context: the client's trace (if any) with our server
    /// span current in it.
    pub(super) fn start<B>(&self, req: &Request<B>) -> Context {
        let parent = TraceContextPropagator::new()
            .extract_with_context(&Context::new(), &HeaderExtractor(req.headers()));
        let method = req.method().as_str().to_string();
        let span = self.tracer.build_with_context(
            SpanBuilder::from_name(method.clone())
                .with_kind(SpanKind::Server)
                .with_attributes([
                    KeyValue::new("http.request.method", method.clone()),
                    KeyValue::new("url.path", req.uri().path().to_string()),
                ]),
            &parent,
        );
        let own = span.span_context().clone();
        parent
            .with_remote_span_context(own)
            .with_value(ServerSpan {
                method,
                span: Mutex::new(span),
                result: Mutex::new(None),
            })
            .with_value(ActiveTracer(self.tracer.clone()))
    }
}

impl Drop for Exporting {
    fn drop(&mut self) {
        let provider = self.provider.clone();
        let flush = move || {
            if let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_FLUSH) {
                tracing::warn!(error = %e, "trace export did not finish at shutdown");
            }
        };
        match tokio::runtime::Handle::try_current() {
            // The runtime waits for its blocking tasks before it exits.
            Ok(rt) => drop(rt.spawn_blocking(flush)),
            Err(_) => flush(),
        }
    }
}

// === impl ServerSpan ===

impl ServerSpan {
    fn with_span(&self, f: impl FnOnce(&mut Span)) {
        f(&mut self.span.lock().unwrap_or_else(|p| p.into_inner()));
    }

    pub(super) fn set_route(&self, label: &str) {
        let name = format!("{} {label}", self.method);
        self.with_span(|s| {
            s.update_name(name);
            s.set_attribute(KeyValue::new("http.route", label.to_string()));
        });
    }

    pub(super) fn set_key_id(&self, id: &str) {
        self.with_span(|s| s.set_attribute(KeyValue::new("idemgate.key.id", id.to_string())));
    }

    pub(super) fn record(&self, outcome: Outcome, status: StatusCode) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some((outcome, status));
    }
}

impl Drop for ServerSpan {
    fn drop(&mut self) {
        let result = *self.result.get_mut().unwrap_or_else(|p| p.into_inner());
        let span = self.span.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some((outcome, status)) = result {
            span.set_attribute(KeyValue::new("idemgate.outcome", outcome.as_str()));
            span.set_attribute(status_code(status));
            // A server span fails on 5xx only: 4xx are the client's.
            if status.is_server_error() {
                span.set_status(Status::error(outcome.as_str()));
            }
        }
        span.end();
    }
}

// === hooks (see trace.rs) ===

/// The current context, if it belongs to a traced request.
pub(super) fn current_request() -> Option<Context> {
    Context::map_current(|cx| cx.get::<ActiveTracer>().is_some().then(|| cx.clone()))
}

pub(super) fn with_server_span(f: impl FnOnce(&ServerSpan)) {
    Context::map_current(|cx| {
        if let Some(s) = cx.get::<ServerSpan>() {
            f(s);
        }
    });
}

pub(super) fn current_trace_id() -> Option<String> {
    Context::map_current(|cx| {
        let sc = cx.span().span_context().clone();
        (cx.get::<ServerSpan>().is_some() && sc.is_valid()).then(|| sc.trace_id().to_string())
    })
}

/// A child of the current request's span, if it is sampled.
fn child(cx: &Context, builder: SpanBuilder) -> Option<Span> {
    let tracer = cx.get::<ActiveTracer>()?;
    cx.span()
        .span_context()
        .is_sampled()
        .then(|| tracer.0.build_with_context(builder, cx))
}

pub(super) fn store_span(op: &'static str) -> Option<Span> {
    Context::map_current(|cx| {
        child(
            cx,
            SpanBuilder::from_name(format!("store {op}"))
                .with_kind(SpanKind::Internal)
                .with_attributes([KeyValue::new("idemgate.store.op", op)]),
        )
    })
}

pub(super) fn upstream_span<B>(req: &mut Request<B>, upstream: &Uri) -> Option<Span> {
    Context::map_current(|cx| {
        cx.get::<ActiveTracer>()?;
        let method = req.method().as_str().to_string();
        let mut attributes = vec![KeyValue::new("http.request.method", method.clone())];
        if let Some(host) = upstream.host() {
            attributes.push(KeyValue::new("server.address", host.to_string()));
        }
        if let Some(port) = upstream.port_u16() {
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        let span = child(
            cx,
            SpanBuilder::from_name(format!("upstream {method}"))
                .with_kind(SpanKind::Client)
                .with_attributes(attributes),
        );
        // Unsampled, the upstream still gets the trace (flagged unsampled).
        let sent = match &span {
            Some(s) => cx.with_remote_span_context(s.span_context().clone()),
            None => cx.clone(),
        };
        TraceContextPropagator::new().inject_context(&sent, &mut HeaderInjector(req.headers_mut()));
        span
    })
}

pub(super) fn fail(span: &mut Span, e: &dyn fmt::Display) {
    span.set_status(Status::error(e.to_string()));
}

pub(super) fn response(span: &mut Span, status: StatusCode) {
    span.set_attribute(status_code(status));
    if status.is_server_error() {
        span.set_status(Status::error(status.to_string()));
    }
}

fn status_code(status: StatusCode) -> KeyValue {
    KeyValue::new("http.response.status_code", i64::from(status.as_u16()))
}

// === Reporting ===

/// The OTLP exporter, saying in the log when exports start failing and
/// when they recover: one line each, not one per lost batch.
#[derive(Debug)]
struct Reporting<E> {
    inner: E,
    url: String,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Err(e) if !self.failing.swap(true, Ordering::Relaxed) => {
                tracing::warn!(error = %e, url = %self.url, spans,
                    "trace export failing; spans are dropped until the collector answers");
            }
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!(url = %self.url, "trace export recovered");
            }
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

// === ExportClient ===

/// Posts one OTLP batch over plain HTTP/1.1 (hyper, one connection per
/// batch: a batch leaves every few seconds at most).
///
/// The SDK's batch processor runs exports on its own thread, outside any
/// runtime, so each export runs on a small current-thread runtime of its
/// own: it never needs the server's runtime, which may be busy, or gone
/// while the last batches flush at shutdown.
#[derive(Debug)]
struct ExportClient {
    timeout: Duration,
}

#[async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err("OTLP export called on a runtime thread; exports run on the batch processor's thread".into());
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async {
            tokio::time::timeout(self.timeout, post(request))
                .await
                .map_err(|_| HttpError::from("OTLP export timed out"))?
        })
    }
}

async fn post(request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
    let (mut parts, body) = request.into_parts();
    let authority = parts.uri.authority().cloned();
    let authority = authority.ok_or("the OTLP URL has no host")?;
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port)).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    parts
        .headers
        .insert(header::HOST, HeaderValue::from_str(authority.as_str())?);
    // Origin form on the request line.
    let path = parts.uri.path_and_query().cloned();
    parts.uri = Uri::from(path.ok_or("the OTLP URL has no path")?);
    let response = sender
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_EXPORT_RESPONSE)
        .collect()
        .await?
        .to_bytes();
    Ok(Response::from_parts(parts, body))
}
