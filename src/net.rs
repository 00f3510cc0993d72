//! Plumbing, each mechanism once. Nothing here imports from a higher module
//! (config, store, lease, proxy, ...): it takes plain values (paths,
//! durations, names, limits).
//!
//! - [`backoff`]: retry waits (doubling, jittered, capped; bounded by
//!   attempts or a time budget).
//! - [`errors`]: error chains printed once, causes found by type.
//! - [`tls`]: TLS clients (PEM files, trust roots, verifiers) and what a
//!   failed handshake means.

pub mod backoff;
pub mod errors;
pub mod tls;
