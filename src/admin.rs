//! The admin listener, separate from proxied traffic: `GET /healthz` (the
//! process is up), `GET /readyz` (this replica can serve; with
//! `server.readiness = "store"` also: the store answers), `GET
//! /healthz/store` (the store's health and last error, as JSON) and `GET
//! /metrics` (Prometheus text format).
//!
//! Readiness does not follow the store by default: every replica shares
//! it, so one outage would mark them all unready at once and the Service
//! would drop even the traffic that needs no store (unprotected routes,
//! `on_store_error = "forward"`). The store's health is reported on its own
//! ([`StoreHealth`]: `/healthz/store`, `idemgate_store_up`), and so is the
//! Redis fast path's, by the same checks (`idemgate_redis_up`).

use crate::body::{full, ProxyBody};
use crate::clock::Clock;
use crate::config::Readiness;
use crate::metrics::Metrics;
use crate::store::{FastPathPing, Store};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Readiness must answer before a kubelet's 1 s probe timeout.
const READY_TIMEOUT: Duration = Duration::from_millis(800);

/// How often the store is pinged in the background for `idemgate_store_up`,
/// whatever the traffic: often enough for an alert to see an outage within
/// a scrape interval or two, rare enough to cost the store nothing.
pub const STORE_PROBE_INTERVAL: Duration = Duration::from_secs(5);

pub struct Admin {
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// Set when shutdown starts: readiness fails so load balancers move
    /// traffic away while in-flight requests drain.
    pub draining: CancellationToken,
    pub readiness: Readiness,
    pub health: Arc<StoreHealth>,
    /// Reloads the config; `None` where there is no file to reload.
    pub reload: Option<Arc<dyn Reload>>,
    /// `server.readiness = "upstream"`: asks the app whether it listens.
    pub upstream: Option<Arc<dyn UpstreamCheck>>,
    /// `[[consumer]]` broker states, one line each on `/healthz` (a
    /// broker outage does not make the process unhealthy or unready).
    pub consumers: crate::consumer::ConsumerHealth,
}

/// Whether the app behind the proxy answers, for `server.readiness =
/// "upstream"`; the server implements it over the running proxy.
#[async_trait::async_trait]
pub trait UpstreamCheck: Send + Sync {
    /// `Ok` once the upstream answered with any status; `Err` says why not.
    async fn check(&self, within: Duration) -> Result<(), String>;
}

/// A config reload asked for over the admin listener; the server's
/// reloader implements it (this module knows nothing of how).
#[async_trait::async_trait]
pub trait Reload: Send + Sync {
    /// Reloads; `Err` says why the reload was refused or could not run.
    async fn reload(&self) -> Result<(), String>;
}

/// Longer than any reload takes (it reads one file and builds clients).
const RELOAD_TIMEOUT: Duration = Duration::from_secs(10);

impl Admin {
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        if req.uri().path() == "/-/reload" {
            return self.reload(req.method(), peer).await;
        }
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, &format!("ok\n{}", self.consumers.lines())),
            "/readyz" if self.draining.is_cancelled() => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: shutting down\n",
            ),
            "/readyz" => match self.readiness {
                Readiness::Serving => self.ready(),
                Readiness::Store => match self.health.check(self.store.as_ref()).await {
                    Ok(()) => self.ready(),
                    Err(e) => text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &format!("not ready: {e}\n"),
                    ),
                },
                Readiness::Upstream => {
                    let answered = match &self.upstream {
                        Some(up) => up.check(READY_TIMEOUT).await,
                        None => Err("no upstream check configured".to_string()),
                    };
                    match answered {
                        Ok(()) => self.ready(),
                        Err(e) => text(
                            StatusCode::SERVICE_UNAVAILABLE,
                            &format!("not ready: the upstream does not answer yet: {e}\n"),
                        ),
                    }
                }
            },
            "/healthz/store" => {
                let up = self.health.check(self.store.as_ref()).await.is_ok();
                let status = if up {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let mut report = self.health.report();
                report["degraded"] = self.store.degraded().into();
                typed(status, &report.to_string(), "application/json")
            }
            "/metrics" => typed(
                StatusCode::OK,
                &self.metrics.encode(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /healthz, /readyz, /healthz/store, /metrics or POST /-/reload\n",
            ),
        }
    }

    /// `POST /-/reload`: only from this host (the admin port may be
    /// reachable in the cluster; a reload is an operator's act), answered
    /// once the reload is done or refused.
    async fn reload(&self, method: &Method, peer: SocketAddr) -> Response<ProxyBody> {
        if method != Method::POST {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use POST\n");
        }
        if !peer.ip().is_loopback() {
            return text(
                StatusCode::FORBIDDEN,
                "reload is accepted from loopback only: run `idemgate reload` in the container (kubectl exec)\n",
            );
        }
        let Some(reloader) = &self.reload else {
            return text(
                StatusCode::NOT_FOUND,
                "this process has no config file to reload\n",
            );
        };
        match tokio::time::timeout(RELOAD_TIMEOUT, reloader.reload()).await {
            Ok(Ok(())) => text(StatusCode::OK, "config reloaded\n"),
            Ok(Err(why)) => text(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("config reload refused, the running config stays: {why}\n"),
            ),
            Err(_) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "the reload did not finish in 10 s\n",
            ),
        }
    }
}

/// The store's health as last checked, for `/healthz/store` and the
/// `idemgate_store_up` gauge, and the Redis fast path's beside it
/// (`idemgate_redis_up`).
pub struct StoreHealth {
    backend: &'static str,
    metrics: Arc<Metrics>,
    clock: Clock,
    state: Mutex<HealthState>,
}

#[derive(Clone, Default)]
struct HealthState {
    up: Option<bool>,
    checked_at_ms: Option<i64>,
    /// The last failure's cause and time, kept after recovery so an
    /// operator can see what happened.
    last_error: Option<(String, i64)>,
    /// `None` without a `[redis]` section.
    redis: Option<RedisState>,
}

#[derive(Clone)]
struct RedisState {
    kind: &'static str,
    up: bool,
    /// As the store's: kept after recovery.
    last_error: Option<(String, i64)>,
}

fn error_json(e: &Option<(String, i64)>) -> serde_json::Value {
    e.as_ref()
        .map(|(cause, at)| serde_json::json!({ "cause": cause, "at": at }))
        .into()
}

impl StoreHealth {
    pub fn new(backend: &'static str, metrics: Arc<Metrics>, clock: Clock) -> Arc<Self> {
        Arc::new(Self {
            backend,
            metrics,
            clock,
            state: Mutex::new(HealthState::default()),
        })
    }

    /// Pings the store and, at the same time, the Redis fast path if there
    /// is one (each bounded), and records both; returns the store's result
    /// (Redis is a hint: its outage costs speed, not correctness).
    pub async fn check(&self, store: &dyn Store) -> Result<(), String> {
        let (result, redis) = tokio::join!(
            tokio::time::timeout(READY_TIMEOUT, store.ping()),
            tokio::time::timeout(READY_TIMEOUT, store.ping_fast_path()),
        );
        let result = match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("store timed out".to_string()),
        };
        let redis = match redis {
            Ok(ping) => ping,
            Err(_) => self.redis_kind().map(|kind| FastPathPing {
                kind,
                result: Err("redis timed out".to_string()),
            }),
        };
        let now = self.clock.now_millis();
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.up = Some(result.is_ok());
            s.checked_at_ms = Some(now);
            if let Err(e) = &result {
                s.last_error = Some((e.clone(), now));
            }
            if let Some(ping) = &redis {
                let last_error = match &ping.result {
                    Err(e) => Some((e.clone(), now)),
                    Ok(()) => s.redis.as_ref().and_then(|r| r.last_error.clone()),
                };
                s.redis = Some(RedisState {
                    kind: ping.kind,
                    up: ping.result.is_ok(),
                    last_error,
                });
            }
        }
        self.metrics.store_up(self.backend, result.is_ok());
        if let Some(ping) = &redis {
            self.metrics.redis_up(ping.kind, ping.result.is_ok());
        }
        result
    }

    /// The Redis kind seen by an earlier check, for a check that timed out.
    fn redis_kind(&self) -> Option<&'static str> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.redis.as_ref().map(|r| r.kind)
    }

    /// The Redis fast path's last check (`None` without one).
    fn redis_state(&self) -> Option<RedisState> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.redis.clone()
    }

    /// `{"backend", "up", "checked_at", "last_error": {"cause", "at"},
    /// "redis": {"kind", "up", "last_error"}}` (`redis` is null without a
    /// `[redis]` section), times as unix milliseconds.
    pub fn report(&self) -> serde_json::Value {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        serde_json::json!({
            "backend": self.backend,
            "up": s.up,
            "checked_at": s.checked_at_ms,
            "last_error": error_json(&s.last_error),
            "redis": s.redis.map(|r| serde_json::json!({
                "kind": r.kind,
                "up": r.up,
                "last_error": error_json(&r.last_error),
            })),
        })
    }

    /// Checks every [`STORE_PROBE_INTERVAL`] until `stop`.
    pub async fn probe_loop(self: Arc<Self>, store: Arc<dyn Store>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(STORE_PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Logged when the state changes, not every interval.
        let mut was_up = true;
        let mut redis_was_up = true;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            match self.check(store.as_ref()).await {
                Err(e) if was_up => {
                    tracing::warn!(store = self.backend, error = %e, "store health check failed");
                    was_up = false;
                }
                Ok(()) if !was_up => {
                    tracing::info!(store = self.backend, "store health check passes again");
                    was_up = true;
                }
                _ => {}
            }
            match self.redis_state() {
                Some(r) if !r.up && redis_was_up => {
                    let error = r.last_error.map(|(cause, _)| cause).unwrap_or_default();
                    tracing::warn!(error = %error, "{} fast path health check failed", r.kind);
                    redis_was_up = false;
                }
                Some(r) if r.up && !redis_was_up => {
                    tracing::info!("redis fast path health check passes again");
                    redis_was_up = true;
                }
                _ => {}
            }
        }
    }
}

impl Admin {
    /// `ready`, with a second line naming what is down without making the
    /// store unready (the Redis fast path, PostgreSQL answering alone): it
    /// costs speed, not correctness.
    fn ready(&self) -> Response<ProxyBody> {
        match self.store.degraded() {
            None => text(StatusCode::OK, "ready\n"),
            Some(note) => text(StatusCode::OK, &format!("ready\ndegraded: {note}\n")),
        }
    }
}

fn text(status: StatusCode, body: &str) -> Response<ProxyBody> {
    typed(status, body, "text/plain; charset=utf-8")
}

fn typed(status: StatusCode, body: &str, content_type: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    let value = HeaderValue::from_static(content_type);
    resp.headers_mut().insert(header::CONTENT_TYPE, value);
    resp
}
