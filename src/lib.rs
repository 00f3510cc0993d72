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
pub mod clock;
pub mod cmd;
pub mod config;
pub(crate) mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod idempotency;
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
