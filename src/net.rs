//! Plumbing, each mechanism once. Nothing here imports from a higher module
//! (config, store, lease, proxy, ...): it takes plain parameters.
//!
//! - [`backoff`]: retry waits (doubling, jittered, capped; bounded by
//!   attempts or a time budget).

pub mod backoff;
