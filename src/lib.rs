//! idemgate: an idempotency reverse proxy. It sits in front of an unmodified
//! HTTP API and makes the configured routes safe to retry: a repeated
//! request with the same `Idempotency-Key` gets the stored response instead
//! of a second execution.
//!
//! # Layout
//! - [`net`]: plumbing written once, importing nothing above it: backoff,
//!   the accept loop, connection deadlines, the shutdown phases
//!   ([`net::drain::Drain`]), TLS clients and handshake diagnosis, error
//!   chains.
//! - [`config`]: the TOML file, parsed strictly into typed settings.
//! - `route`: path patterns and the protected-route table.
//! - [`idempotency`]: the protocol as pure functions: key parsing, scope,
//!   fingerprint, and the decision from a stored record.
//! - [`store`]: the storage trait, its backends (memory, SQLite, ...) and
//!   the seam every call goes through (bounded, timed).
//! - `lease`: holding a claimed key: renew, complete, release, and the
//!   one rule for writes whose answer was lost.
//! - `proxy`: the request path: protected requests, replay, forwarding.
//! - `upstream`: the upstreams' pooled clients (named, HTTPS, HTTP/2) and
//!   the byte tunnel of upgraded connections.
//! - [`clock`]: the wall clock, injected so tests can pause it.
//! - `problem`: RFC 9457 responses, the one error-to-response mapping.
//! - [`server`]: wiring: the listeners, sweeper and graceful shutdown.
//! - `admin`, [`metrics`], [`telemetry`]: health, Prometheus, logs and
//!   (feature `otel`) OpenTelemetry traces.
//! - [`keys`]: the `keys` commands that inspect and repair records.
//! - [`demo`]: a small orders API to try idemgate against, and its commands.
//! - `fuzzing`: not a stable API; the crate-private parsers and codecs,
//!   for fuzz targets and property tests.

pub(crate) mod admin;
pub mod body;
pub mod cli;
pub mod clock;
pub mod config;
pub mod demo;
pub(crate) mod error;
pub mod fd_limit;
#[doc(hidden)]
pub mod fuzzing;
pub mod idempotency;
pub mod keys;
pub(crate) mod lease;
pub mod metrics;
pub mod net;
pub(crate) mod problem;
pub(crate) mod proxy;
pub(crate) mod route;
pub mod server;
pub(crate) mod shutdown;
pub mod store;
pub mod telemetry;
pub(crate) mod upstream;

use config::Config;
use metrics::Metrics;
use std::sync::Arc;

/// `idemgate serve`: binds, opens the store, runs until SIGTERM/SIGINT;
/// SIGHUP (or a change, with `server.watch_config`) reloads `path`.
pub async fn run(config: Config, path: std::path::PathBuf) -> anyhow::Result<()> {
    // Before any socket or file is opened: they count against it.
    let limit = match fd_limit::reconcile(&config) {
        Ok(plan) => {
            if plan.lowered() {
                tracing::warn!("{plan}");
            } else {
                tracing::info!("{plan}");
            }
            Some(plan.effective)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the file-descriptor limit (RLIMIT_NOFILE); max_connections is not checked against it");
            None
        }
    };
    // First, so an early SIGHUP reloads instead of killing the process.
    let hangups = server::reload::requests(&path, config.server.watch_config)?;
    let listeners = server::Listeners::bind(&config).await?;
    let metrics = Arc::new(Metrics::new());
    let mut server = server::Server::open(config, metrics, listeners).await?;
    if let Some(limit) = limit {
        server = server.limit_connections(limit);
    }
    server
        .reload_on(server::reload::ReloadSource {
            path,
            requests: hangups,
        })
        .run(shutdown::signal())
        .await
}
