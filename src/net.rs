//! Plumbing: each mechanism written once, taking plain values (paths,
//! durations, names), never importing from the layers above.
//! - [`tls`]: TLS clients (PEM files, trust roots, verifiers) and what a
//!   failed handshake means.
//! - [`errors`]: error chains printed once, causes found by type.

pub mod errors;
pub mod tls;
