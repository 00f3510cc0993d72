//! How a request ends: [`respond`] turns its result into what the client
//! gets, and [`RequestLog::finish`] writes the access log line and the
//! request metric, one of each per request, wherever the request ends (the
//! connection's handler, or the detached task when the client has left).

use super::headers::content_length;
use super::request_id::RequestId;
use crate::body::ProxyBody;
use crate::error::{Origin, ProxyError};
use crate::idempotency::Scope;
use crate::metrics::{Metrics, Outcome, RequestSample};
use crate::problem::Problem;
use crate::route::errors::ErrorShape;
use crate::route::RouteConfig;
use crate::telemetry::trace;
use http::header::{HeaderName, HeaderValue};
use http::{header, HeaderMap, Method, Request, Response, Version};
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
    let (served, _) = respond_naming(result, id, key_id, shape);
    served
}

/// [`respond`], and the slug of the problem it answered with, if any.
fn respond_naming(
    result: Result<Served, ProxyError>,
    id: Option<&RequestId>,
    key_id: Option<&str>,
    shape: &ErrorShape,
) -> (Served, Option<&'static str>) {
    let mut slug = None;
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
            slug = Some(problem.slug);
            (problem.outcome, problem.into_response(shape))
        }
    };
    trace::record(outcome, resp.status());
    ((outcome, resp), slug)
}

/// What idempotency did for a request: on every answer to a request that
/// matched a protected route, and (`ignored`) to one that carried a key
/// header but matched none. README "Idempotency-Status" lists the values.
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// Put in a response's extensions by a request that executed but whose
/// answer was too large to store: `Idempotency-Status: unstored`.
#[derive(Clone, Copy, Debug)]
pub struct Unstored;

/// The `Idempotency-Status` of a routed request that ended with `outcome`,
/// or with idemgate's own error answer `problem` (its type's slug, which
/// names the problem as the README's problem table does).
fn status_value(outcome: Outcome, problem: Option<&'static str>, unstored: bool) -> &'static str {
    if let Some(slug) = problem {
        return slug;
    }
    match outcome {
        Outcome::Forwarded if unstored => "unstored",
        Outcome::Forwarded => "created",
        Outcome::Replayed => "replayed",
        // An upstream answer in `release_statuses`: nothing ran, the key is free.
        Outcome::UpstreamError => "released",
        Outcome::Unguarded => "unguarded",
        // A protected route, but no key where none is required.
        Outcome::Passthrough => "no-key",
        // The upstream's own answer to the replay check, passed on.
        Outcome::ReplayDenied => "replay-denied",
        // Only idemgate's own errors end so, and they name a problem.
        other => other.as_str(),
    }
}

/// Whether an unrouted request carries one of the routes' key headers: its
/// answer says `Idempotency-Status: ignored` ([`mark_ignored`]).
pub fn carries_key(key_headers: &[HeaderName], req: &HeaderMap) -> bool {
    key_headers.iter().any(|h| req.contains_key(h))
}

/// `Idempotency-Status: ignored`, unless the upstream (which may implement
/// idempotency itself) set the header.
pub fn mark_ignored(resp: &mut HeaderMap) {
    resp.entry(IDEMPOTENCY_STATUS)
        .or_insert(HeaderValue::from_static("ignored"));
}

/// A method as a metric label: the registered ones by name, any other as
/// `"other"` (a client's invented method must not mint a series).
fn method_label(method: &Method) -> &'static str {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    match KNOWN.iter().find(|m| *m == method) {
        Some(m) => m.as_str(),
        None if method.as_str() == "QUERY" => "QUERY",
        None => "other",
    }
}

/// The route label of requests no route matched.
static UNROUTED: LazyLock<Arc<String>> = LazyLock::new(|| Arc::new("unrouted".to_string()));

/// What the access log says about one request, gathered as it goes.
#[derive(Clone, Debug)]
pub struct RequestLog {
    method: Method,
    /// The target as the client sent it; only its path is logged (never
    /// the query: it may hold secrets). A clone shares the bytes: nothing
    /// is copied for a line that is never written.
    target: http::Uri,
    route: Arc<String>,
    /// The short non-reversible key id (`RecordKey::log_id`), once known.
    key_id: Option<String>,
    /// The key's scope digest, once known: what `idemgate keys --scope`
    /// takes, so an operator goes from this line to the record without
    /// the client's credential. A digest (HMAC-SHA256 with
    /// `IDEMGATE_SCOPE_SECRET`), never a header value.
    scope: Option<Scope>,
    /// The shape of idemgate's error answers: the route's once it is
    /// known, else `[defaults] errors`.
    errors: ErrorShape,
    peer: SocketAddr,
    started: Instant,
    request_id: RequestId,
    version: Version,
    /// Bounded to [`MAX_USER_AGENT`] when written.
    user_agent: Option<HeaderValue>,
    /// The request body's length: `Content-Length`, or what a protected
    /// request's buffered body measured.
    bytes_in: Option<u64>,
}

/// How long the upstream took to answer with its head, put in the
/// response's extensions by the forwarder (absent when nothing was asked
/// upstream: replays, refusals).
#[derive(Clone, Copy, Debug)]
pub struct UpstreamTime(pub Duration);

/// A scope as the access log writes it: its digest in hex (as `keys show`
/// prints it and `keys --scope` takes it), or `-`.
struct LoggedScope(Option<Scope>);

impl std::fmt::Display for LoggedScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(scope) => scope.0.iter().try_for_each(|b| write!(f, "{b:02x}")),
            None => f.write_str("-"),
        }
    }
}

/// User agents are the client's text: bounded in the log.
const MAX_USER_AGENT: usize = 256;

/// The first [`MAX_USER_AGENT`] characters of a textual `User-Agent`
/// (visible ASCII, so characters are bytes); none for one that is not text.
fn bounded_user_agent(v: &HeaderValue) -> Option<&str> {
    let v = v.to_str().ok()?;
    Some(&v[..v.len().min(MAX_USER_AGENT)])
}

impl RequestLog {
    pub fn start<B>(
        req: &Request<B>,
        peer: SocketAddr,
        request_id: RequestId,
        errors: &ErrorShape,
    ) -> Self {
        let user_agent = req.headers().get(header::USER_AGENT).cloned();
        let bytes_in = content_length(req.headers());
        Self {
            method: req.method().clone(),
            target: req.uri().clone(),
            route: UNROUTED.clone(),
            key_id: None,
            scope: None,
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

    /// The request's key: its id (`RecordKey::log_id`) and its scope.
    pub fn set_key(&mut self, id: String, scope: Scope) {
        self.key_id = Some(id);
        self.scope = Some(scope);
    }

    pub fn set_bytes_in(&mut self, n: u64) {
        self.bytes_in = Some(n);
    }

    /// [`respond`] with this request's id and key id, and on a protected
    /// route its `Idempotency-Status` (replacing any the upstream sent).
    pub fn respond(&self, result: Result<Served, ProxyError>) -> Served {
        let id = Some(&self.request_id);
        let ((outcome, mut resp), slug) =
            respond_naming(result, id, self.key_id.as_deref(), &self.errors);
        // A protected route matched: its answers say what idemgate did.
        if !Arc::ptr_eq(&self.route, &UNROUTED) {
            let unstored = resp.extensions().get::<Unstored>().is_some();
            let value = status_value(outcome, slug, unstored);
            resp.headers_mut()
                .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static(value));
        }
        (outcome, resp)
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
        let latency = self.started.elapsed();
        metrics.request(RequestSample {
            route: &self.route,
            outcome,
            method: method_label(&self.method),
            status: resp.status().as_u16(),
            took: latency,
        });
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
            path = %self.target.path(),
            protocol = ?self.version,
            route = %self.route,
            outcome = outcome.as_str(),
            status = resp.status().as_u16(),
            latency_ms = latency.as_secs_f64() * 1000.0,
            upstream_ms,
            bytes_in = self.bytes_in,
            bytes_out,
            key.id = self.key_id.as_deref().unwrap_or("-"),
            scope = %LoggedScope(self.scope),
            client.addr = %self.peer,
            user_agent = self.user_agent.as_ref().and_then(bounded_user_agent),
            client_left,
            "request"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_of_a_protected_request_has_a_status() {
        let cases = [
            (Outcome::Forwarded, None, false, "created"),
            (Outcome::Forwarded, None, true, "unstored"),
            (Outcome::Replayed, None, false, "replayed"),
            (Outcome::ReplayDenied, None, false, "replay-denied"),
            (
                Outcome::ReplayCheckFailed,
                Some("replay-check-unavailable"),
                false,
                "replay-check-unavailable",
            ),
            (Outcome::UpstreamError, None, false, "released"),
            (Outcome::Unguarded, None, false, "unguarded"),
            (Outcome::Passthrough, None, false, "no-key"),
            // idemgate's own answers name their problem, whatever the outcome.
            (Outcome::Conflict, Some("in-flight"), false, "in-flight"),
            (Outcome::Mismatch, Some("key-reused"), false, "key-reused"),
            (
                Outcome::UpstreamError,
                Some("upstream-failed"),
                false,
                "upstream-failed",
            ),
        ];
        for (outcome, problem, unstored, want) in cases {
            assert_eq!(
                status_value(outcome, problem, unstored),
                want,
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn methods_outside_the_registered_set_are_one_label() {
        for (method, label) in [
            ("GET", "GET"),
            ("POST", "POST"),
            ("QUERY", "QUERY"),
            ("PSOT", "other"),
            ("BREW", "other"),
        ] {
            let m = Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(method_label(&m), label);
        }
    }

    #[test]
    fn ignored_marks_only_keyed_requests_and_keeps_the_upstreams_own_status() {
        let keys = [HeaderName::from_static("idempotency-key")];
        let mut req = HeaderMap::new();
        assert!(!carries_key(&keys, &req));
        req.insert("idempotency-key", HeaderValue::from_static("k"));
        assert!(carries_key(&keys, &req));
        let mut resp = HeaderMap::new();
        mark_ignored(&mut resp);
        assert_eq!(resp[IDEMPOTENCY_STATUS], "ignored");
        let mut theirs = HeaderMap::new();
        theirs.insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("replayed"));
        mark_ignored(&mut theirs);
        assert_eq!(theirs[IDEMPOTENCY_STATUS], "replayed");
    }
}
