//! Prometheus metrics, built once and passed down (no globals), served on
//! the admin port. Names are prefixed `idemgate_`; label values come from
//! enums' `as_str`, never from request data.
//!
//! This module names no other part of the crate: the store layer reports
//! into it ([`Metrics::store_op`], [`FastPathStats`]), never the reverse.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod consumers;
mod process;

/// How a request ended, as counted and logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Claimed and forwarded; the upstream's answer was stored.
    Forwarded,
    /// Answered from the store without calling the upstream.
    Replayed,
    /// 409: another request holds the key.
    Conflict,
    /// 422: the key was used for a different request.
    Mismatch,
    /// 400: a required key was absent.
    MissingKey,
    /// 400: the key was malformed.
    InvalidKey,
    /// 400/501: the request was malformed (or its body unreadable), or
    /// used a transfer-coding other than chunked.
    InvalidRequest,
    /// 413: the request body was over the route's limit.
    TooLarge,
    /// 503: the body budget was spent; the body was not read.
    Overloaded,
    /// 410: executed once, response too large to replay.
    NotReplayable,
    /// 424: the first request's outcome is unknown (`on_ambiguous = "keep"`).
    OutcomeUnknown,
    /// 503: the store could not answer; nothing forwarded.
    StoreError,
    /// The store could not answer and the route forwards unguarded.
    Unguarded,
    /// Upstream 5xx, refused, reset or timed out; the key was released.
    UpstreamError,
    /// Not a protected request (no route, or no key where optional).
    Passthrough,
    /// A stored answer withheld: the `replay_check` said no, and its
    /// answer went to the client instead.
    ReplayDenied,
    /// 503: the `replay_check` got no answer; nothing replayed or run.
    ReplayCheckFailed,
    Internal,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::InvalidRequest => "invalid_request",
            Outcome::TooLarge => "too_large",
            Outcome::Overloaded => "overloaded",
            Outcome::NotReplayable => "not_replayable",
            Outcome::OutcomeUnknown => "outcome_unknown",
            Outcome::StoreError => "store_error",
            Outcome::Unguarded => "unguarded",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Passthrough => "passthrough",
            Outcome::ReplayDenied => "replay_denied",
            Outcome::ReplayCheckFailed => "replay_check_failed",
            Outcome::Internal => "internal",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: Arc<String>,
    outcome: &'static str,
}

/// Every label bounded: a route label, a registered method (or "other"),
/// a status class, an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    route: Arc<String>,
    method: &'static str,
    status_class: &'static str,
    outcome: &'static str,
}

/// One request as counted: [`Metrics::request`].
#[derive(Clone, Copy, Debug)]
pub struct RequestSample<'a> {
    pub route: &'a Arc<String>,
    pub outcome: Outcome,
    /// A registered method's name, or `"other"`: never the client's text.
    pub method: &'static str,
    pub status: u16,
    /// From the request's head to its answer's head.
    pub took: Duration,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: Arc<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: &'static str,
}

/// The Redis kind asked: `redis`, `redis cluster` or `redis sentinel`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: Arc<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_duration: Family<DurationLabels, Histogram>,
    /// [`Metrics::request`]'s series, each looked up in its families once.
    request_series: RequestSeries,
    takeovers: Family<RouteLabels, Counter>,
    lost_fences: Family<RouteLabels, Counter>,
    store_latency: Family<OpLabels, Histogram>,
    upstream_latency: Family<RouteLabels, Histogram>,
    in_flight: Gauge,
    pending_completions: Gauge,
    waiters: Gauge,
    buffered_body_bytes: Gauge,
    body_budget_refusals: Counter,
    swept: Counter,
    fast_path: Arc<FastPathCollector>,
    store_up: Family<BackendLabels, Gauge>,
    /// No series until the first check: only a configured `[redis]` has one.
    redis_up: Family<KindLabels, Gauge>,
    config_reloads: Family<ResultLabels, Counter>,
    last_reload_success: Gauge<f64, AtomicU64>,
    open_connections: Gauge,
    upstream_in_flight: Family<UpstreamLabels, Gauge>,
    tunnels: TunnelMetrics,
    sealed_unreadable: Family<ReasonLabels, Counter>,
    consumers: consumers::ConsumerMetrics,
}

/// The request counter and duration histogram of each kind of request
/// seen, so counting one does not look it up in two `Family`s: those hash
/// every label (the route's text too) with SipHash under a lock, about a
/// thousand instructions per request (bench/profile.sh). Here a key is a
/// few words: the route's `Arc` by address (the entry holds the `Arc`, so
/// the address is not reused while cached), the outcome, and the method
/// and status class by the address of their `&'static str`. No key holds
/// request data, so the hasher need not resist chosen collisions.
#[derive(Default)]
struct RequestSeries(std::sync::RwLock<SeriesMap>);

type SeriesMap = std::collections::HashMap<
    SeriesKey,
    (Counter, Histogram),
    std::hash::BuildHasherDefault<WordHasher>,
>;

/// Past this many entries the cache starts over: each reload brings new
/// route `Arc`s, and the old ones' entries would otherwise stay.
const REQUEST_SERIES_MAX: usize = 4096;

impl RequestSeries {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, SeriesMap> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, key: SeriesKey, series: (Counter, Histogram)) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        if map.len() >= REQUEST_SERIES_MAX {
            map.clear();
        }
        map.insert(key, series);
    }
}

struct SeriesKey {
    route: Arc<String>,
    outcome: Outcome,
    method: &'static str,
    status_class: &'static str,
}

impl PartialEq for SeriesKey {
    fn eq(&self, other: &Self) -> bool {
        // Two literals with the same text at two addresses are two keys
        // for one series: harmless.
        Arc::ptr_eq(&self.route, &other.route)
            && self.outcome == other.outcome
            && std::ptr::eq(self.method, other.method)
            && std::ptr::eq(self.status_class, other.status_class)
    }
}

impl Eq for SeriesKey {}

impl std::hash::Hash for SeriesKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(Arc::as_ptr(&self.route) as usize);
        state.write_usize(self.method.as_ptr() as usize);
        state.write_usize(self.status_class.as_ptr() as usize);
        state.write_u8(self.outcome as u8);
    }
}

/// A multiply-rotate hash of a few machine words (the `FxHash` recipe).
#[derive(Default)]
struct WordHasher(u64);

impl std::hash::Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// `"2xx"` and so on; anything outside 100..=599 is `"other"`.
fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        5 => "5xx",
        _ => "other",
    }
}

fn latency_family<S: Clone + Eq + std::hash::Hash>() -> Family<S, Histogram> {
    // 0.5 ms .. ~16 s
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0005, 2.0, 16)))
}

/// Registers a new metric under `name` and hands it back.
fn add<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    add_metric(registry, name, help, M::default())
}

fn add_metric<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

fn route_labels(route: &Arc<String>) -> RouteLabels {
    RouteLabels {
        route: route.clone(),
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // process_* keep their conventional names; everything else is
        // idemgate_*.
        let mut root = Registry::default();
        root.register_collector(Box::new(process::ProcessCollector));
        let registry = root.sub_registry_with_prefix("idemgate");
        let fast_path = Arc::new(FastPathCollector::default());
        registry.register_collector(Box::new(fast_path.clone()));
        // The exposition lists metrics in the order they are registered,
        // which is the order of these fields.
        let metrics = Self {
            requests: add(registry, "requests", "Requests by route and outcome"),
            request_duration: add_metric(
                registry,
                "request_duration_seconds",
                "Time from a request's head to its answer's head, for all traffic served (protected, replayed, refused, passed through), by route, method, status class and outcome",
                latency_family(),
            ),
            request_series: RequestSeries::default(),
            takeovers: add(
                registry,
                "lease_takeovers",
                "In-flight claims taken over after their holder's lease ran out",
            ),
            lost_fences: add(
                registry,
                "lost_fences",
                "Completions or releases refused because the claim had been taken over",
            ),
            store_latency: add_metric(
                registry,
                "store_duration_seconds",
                "Store operation latency",
                latency_family(),
            ),
            upstream_latency: add_metric(
                registry,
                "upstream_duration_seconds",
                "Upstream latency of protected requests, to the end of the stored body",
                latency_family(),
            ),
            in_flight: add(
                registry,
                "in_flight",
                "Protected requests currently executing upstream",
            ),
            pending_completions: add(
                registry,
                "pending_completions",
                "Upstream answers received but not yet recorded in the store (retried in the background)",
            ),
            waiters: add(
                registry,
                "waiters",
                "Duplicates waiting for the answer of a request in flight (in_flight = { wait })",
            ),
            buffered_body_bytes: add(
                registry,
                "buffered_body_bytes",
                "Bytes of protected request bodies reserved in the body budget (server.max_buffered_body_bytes)",
            ),
            body_budget_refusals: add(
                registry,
                "body_budget_refusals",
                "Protected requests refused with 503 because the body budget was spent",
            ),
            swept: add(registry, "swept_records", "Expired records deleted by the sweeper"),
            fast_path,
            store_up: add(
                registry,
                "store_up",
                "1 while the store answers its health check (every few seconds, and on /readyz or /healthz/store), 0 after one failed",
            ),
            redis_up: add(
                registry,
                "redis_up",
                "1 while the Redis fast path answers its health check (with the store's), 0 after one failed; only with a [redis] section",
            ),
            config_reloads: add(
                registry,
                "config_reloads",
                "Config reloads (SIGHUP) by result: ok, or error (the old config keeps serving)",
            ),
            last_reload_success: add(
                registry,
                "config_last_reload_success_timestamp_seconds",
                "When the running config was loaded (start or last successful reload), unix seconds",
            ),
            open_connections: add(
                registry,
                "open_connections",
                "Client connections open on the proxy listener",
            ),
            sealed_unreadable: add(
                registry,
                "sealed_unreadable",
                "Stored responses that did not open (IDEMGATE_STORE_ENCRYPTION_KEYS), by reason: unknown_key, forged, malformed, plaintext (store.plaintext_responses = \"refuse\"); their keys get 410 and never run again",
            ),
            upstream_in_flight: add(
                registry,
                "upstream_in_flight",
                "Requests using an upstream connection now (sent, answer not yet fully read), by upstream: compare with its pool size",
            ),
            tunnels: {
                // Registered here for its place in the exposition.
                let build_info: Family<BuildLabels, Gauge> =
                    add(registry, "build_info", "The running build (always 1)");
                build_info
                    .get_or_create(&BuildLabels {
                        version: env!("CARGO_PKG_VERSION"),
                    })
                    .set(1);
                TunnelMetrics::register(registry)
            },
            consumers: consumers::ConsumerMetrics::register(registry),
            registry: root,
        };
        for result in ["ok", "error"] {
            drop(
                metrics
                    .config_reloads
                    .get_or_create(&ResultLabels { result }),
            );
        }
        metrics
    }

    /// `[[consumer]]` metrics.
    pub fn consumers(&self) -> &consumers::ConsumerMetrics {
        &self.consumers
    }

    pub fn tunnels(&self) -> &TunnelMetrics {
        &self.tunnels
    }

    /// Counts one request on `upstream` until the guard is dropped.
    pub fn upstream_request(&self, upstream: &Arc<String>) -> GaugeGuard {
        let gauge = self
            .upstream_in_flight
            .get_or_create(&UpstreamLabels {
                upstream: upstream.clone(),
            })
            .clone();
        gauge.inc();
        GaugeGuard(gauge)
    }

    /// The store's health as last checked.
    pub fn store_up(&self, backend: &'static str, up: bool) {
        self.store_up
            .get_or_create(&BackendLabels { backend })
            .set(i64::from(up));
    }

    /// The Redis fast path's health as last checked.
    pub fn redis_up(&self, kind: &'static str, up: bool) {
        self.redis_up
            .get_or_create(&KindLabels { kind })
            .set(i64::from(up));
    }

    /// A config load at start or on reload: `ok`, at `unix_secs`, or not.
    pub fn config_loaded(&self, ok: bool, unix_secs: f64) {
        let result = if ok { "ok" } else { "error" };
        self.config_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
        if ok {
            self.last_reload_success.set(unix_secs);
        }
    }

    /// The start-up load: the timestamp, not counted as a reload.
    pub fn config_started(&self, unix_secs: f64) {
        self.last_reload_success.set(unix_secs);
    }

    pub fn open_connections(&self) -> &Gauge {
        &self.open_connections
    }

    pub fn request(&self, r: RequestSample<'_>) {
        let key = SeriesKey {
            route: r.route.clone(),
            outcome: r.outcome,
            method: r.method,
            status_class: status_class(r.status),
        };
        let took = r.took.as_secs_f64();
        if let Some((count, duration)) = self.request_series.read().get(&key) {
            count.inc();
            duration.observe(took);
            return;
        }
        let outcome = key.outcome.as_str();
        let count = self
            .requests
            .get_or_create(&RequestLabels {
                route: key.route.clone(),
                outcome,
            })
            .clone();
        let duration = self
            .request_duration
            .get_or_create(&DurationLabels {
                route: key.route.clone(),
                method: key.method,
                status_class: key.status_class,
                outcome,
            })
            .clone();
        count.inc();
        duration.observe(took);
        self.request_series.insert(key, (count, duration));
    }

    /// Creates every route's series at zero, so dashboards and "absent"
    /// alerts see them before the first event.
    pub fn register_routes<'a>(&self, labels: impl IntoIterator<Item = &'a Arc<String>>) {
        for route in labels {
            let l = route_labels(route);
            drop(self.takeovers.get_or_create(&l));
            drop(self.lost_fences.get_or_create(&l));
        }
    }

    pub fn takeover(&self, route: &Arc<String>) {
        self.takeovers.get_or_create(&route_labels(route)).inc();
    }

    pub fn lost_fence(&self, route: &Arc<String>) {
        self.lost_fences.get_or_create(&route_labels(route)).inc();
    }

    /// A sealed response that did not open, and why.
    pub fn sealed_unreadable(&self, reason: &'static str) {
        self.sealed_unreadable
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn store_op(&self, op: &'static str, took: Duration) {
        self.store_latency
            .get_or_create(&OpLabels { op })
            .observe(took.as_secs_f64());
    }

    pub fn upstream(&self, route: &Arc<String>, took: Duration) {
        self.upstream_latency
            .get_or_create(&route_labels(route))
            .observe(took.as_secs_f64());
    }

    pub fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    pub fn waiters(&self) -> &Gauge {
        &self.waiters
    }

    pub fn pending_completions(&self) -> &Gauge {
        &self.pending_completions
    }

    pub fn buffered_body_bytes(&self) -> &Gauge {
        &self.buffered_body_bytes
    }

    pub fn body_budget_refusals(&self) -> &Counter {
        &self.body_budget_refusals
    }

    pub fn swept(&self, n: u64) {
        self.swept.inc_by(n);
    }

    pub fn attach_fast_path(&self, counters: Arc<dyn FastPathStats>) {
        *self
            .fast_path
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(counters);
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Current value of `idemgate_requests_total{route,outcome}` (for tests).
    pub fn request_count(&self, route: &str, outcome: Outcome) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                route: Arc::new(route.to_string()),
                outcome: outcome.as_str(),
            })
            .get()
    }
}

/// Holds a gauge one higher while it lives.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The Redis fast path's counters, read at each scrape (implemented by the
/// store layer's `FastPathCounters`).
pub trait FastPathStats: std::fmt::Debug + Send + Sync + 'static {
    /// Claims answered from Redis alone.
    fn hits(&self) -> u64;
    /// Claims that went to the inner store because Redis had no answer.
    fn misses(&self) -> u64;
    /// Redis failures, timeouts or bypasses; the inner store answered alone.
    fn errors(&self) -> u64;
}

#[derive(Debug, Default)]
struct FastPathCollector {
    counters: Mutex<Option<Arc<dyn FastPathStats>>>,
}

impl Collector for FastPathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = self
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(stats) = counters else {
            return Ok(());
        };
        for (name, help, value) in [
            (
                "redis_fast_path_hits",
                "Requests answered from Redis without asking the authoritative store",
                stats.hits(),
            ),
            (
                "redis_fast_path_misses",
                "Requests that Redis could not answer and went to the authoritative store",
                stats.misses(),
            ),
            (
                "redis_fast_path_errors",
                "Redis failures or timeouts that fell back to the authoritative store",
                stats.errors(),
            ),
        ] {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct FixedStats;

    impl FastPathStats for FixedStats {
        fn hits(&self) -> u64 {
            3
        }
        fn misses(&self) -> u64 {
            0
        }
        fn errors(&self) -> u64 {
            0
        }
    }

    #[test]
    fn exposition_has_prefixed_names_and_labels() {
        let m = Metrics::new();
        let route = Arc::new("/orders".to_string());
        let sample = RequestSample {
            route: &route,
            outcome: Outcome::Replayed,
            method: "POST",
            status: 201,
            took: Duration::from_millis(3),
        };
        m.request(sample);
        m.request(sample);
        m.request(RequestSample {
            status: 999,
            ..sample
        });
        m.takeover(&route);
        m.attach_fast_path(Arc::new(FixedStats));
        let text = m.encode();
        for line in [
            r#"idemgate_requests_total{route="/orders",outcome="replayed"} 3"#,
            r#"idemgate_request_duration_seconds_count{route="/orders",method="POST",status_class="2xx",outcome="replayed"} 2"#,
            r#"idemgate_request_duration_seconds_count{route="/orders",method="POST",status_class="other",outcome="replayed"} 1"#,
            r#"idemgate_lease_takeovers_total{route="/orders"} 1"#,
            "idemgate_redis_fast_path_hits_total 3",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        assert_eq!(m.request_count("/orders", Outcome::Replayed), 3);
    }

    /// The cached series are the families' own: a second route `Arc` with
    /// the same text (a reload's) counts into the same series, and a full
    /// cache starting over loses no count.
    #[test]
    fn cached_request_series_are_the_families_series() {
        let m = Metrics::new();
        let first = Arc::new("/orders".to_string());
        let reloaded = Arc::new("/orders".to_string());
        for route in [&first, &reloaded, &first] {
            m.request(RequestSample {
                route,
                outcome: Outcome::Forwarded,
                method: "POST",
                status: 201,
                took: Duration::from_millis(1),
            });
        }
        assert_eq!(m.request_count("/orders", Outcome::Forwarded), 3);
        for i in 0..REQUEST_SERIES_MAX + 1 {
            let route = Arc::new(format!("/r{}", i % 3));
            m.request(RequestSample {
                route: &route,
                outcome: Outcome::Passthrough,
                method: "GET",
                status: 200,
                took: Duration::from_millis(1),
            });
        }
        let counted: u64 = (0..3)
            .map(|i| m.request_count(&format!("/r{i}"), Outcome::Passthrough))
            .sum();
        assert_eq!(counted, REQUEST_SERIES_MAX as u64 + 1);
        assert!(m.request_series.read().len() <= REQUEST_SERIES_MAX);
        let text = m.encode();
        assert!(
            text.contains(r#"idemgate_request_duration_seconds_count{route="/orders",method="POST",status_class="2xx",outcome="forwarded"} 3"#),
            "{text}"
        );
    }

    /// The operations series are there from the start; process_* keep
    /// their conventional unprefixed names.
    #[test]
    fn build_reload_connection_and_process_series() {
        let m = Metrics::new();
        assert!(
            !m.encode().contains("idemgate_redis_up{"),
            "no Redis series without a [redis] section"
        );
        m.store_up("postgres", false);
        m.redis_up("redis", true);
        m.config_loaded(false, 0.0);
        m.open_connections().inc();
        let text = m.encode();
        for line in [
            format!(
                "idemgate_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
            "idemgate_store_up{backend=\"postgres\"} 0".to_string(),
            "idemgate_redis_up{kind=\"redis\"} 1".to_string(),
            "idemgate_config_reloads_total{result=\"ok\"} 0".to_string(),
            "idemgate_config_reloads_total{result=\"error\"} 1".to_string(),
            "idemgate_open_connections 1".to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        #[cfg(target_os = "linux")]
        for name in [
            "process_cpu_seconds_total ",
            "process_open_fds ",
            "process_resident_memory_bytes ",
        ] {
            assert!(text.lines().any(|l| l.starts_with(name)), "{name}\n{text}");
        }
    }
}

// ===== tunnels =====

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

/// Upgraded connections passed through as tunnels: how many are open, how
/// many were refused at the limit, and the bytes copied each way.
pub struct TunnelMetrics {
    open: Gauge,
    refused: Counter,
    bytes: Family<DirectionLabels, Counter>,
}

impl TunnelMetrics {
    fn register(registry: &mut Registry) -> Self {
        Self {
            open: add(
                registry,
                "tunnels_open",
                "Upgraded connections (WebSocket) currently tunnelled to an upstream",
            ),
            refused: add(
                registry,
                "tunnels_refused",
                "Upgrade requests refused with 503 because server.max_connections tunnels were open",
            ),
            bytes: add(
                registry,
                "tunnel_bytes",
                "Bytes copied through tunnels, by direction (to_upstream, to_client)",
            ),
        }
    }

    pub fn open(&self) -> &Gauge {
        &self.open
    }

    pub fn refused(&self) -> &Counter {
        &self.refused
    }

    /// Counts bytes as a tunnel copies them.
    pub fn copied(&self, to_upstream: u64, to_client: u64) {
        for (direction, n) in [("to_upstream", to_upstream), ("to_client", to_client)] {
            if n > 0 {
                self.bytes
                    .get_or_create(&DirectionLabels { direction })
                    .inc_by(n);
            }
        }
    }
}
