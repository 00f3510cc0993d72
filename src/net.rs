//! Plumbing, each mechanism once. Nothing here imports from a higher module
//! (config, store, lease, proxy, ...): it takes plain values (paths,
//! durations, names, limits, closures).
//!
//! - [`backoff`]: retry waits (doubling, jittered, capped; bounded by
//!   attempts or a time budget).
//! - [`connection`]: one served connection's head and idle deadlines and
//!   its graceful close.
//! - [`drain`]: [`drain::Drain`], shutdown's phases as one value.
//! - [`errors`]: error chains printed once, causes found by type.
//! - [`listen`]: the accept loop (connection limit, accept-error
//!   classification, tasks on a tracker, stop on a future).
//! - [`tls`]: TLS clients (PEM files, trust roots, verifiers) and what a
//!   failed handshake means.
//! - [`tls_server`]: TLS on the listeners (the pair served and rotated,
//!   mTLS, the handshake deadline, the client's identity).

pub mod backoff;
pub mod connection;
pub mod drain;
pub mod errors;
pub mod listen;
pub mod tls;
pub mod tls_server;
