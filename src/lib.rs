//! idemgate: an idempotency reverse proxy.
pub mod config;
pub mod idempotency;
pub mod route;
pub mod store;
