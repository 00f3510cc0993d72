//! Plumbing: each network mechanism written once, below everything else.
//! Nothing here imports a higher module (config, store, proxy, ...): it
//! takes durations, limits and closures instead.
//!
//! - `listen.rs`: the accept loop (connection limit, accept-error
//!   classification, tasks on a tracker, stop on a future).
//! - `connection.rs`: one served connection's head and idle deadlines and
//!   its graceful close.
//! - `drain.rs`: [`drain::Drain`], shutdown's phases as one value.

pub mod connection;
pub mod drain;
pub mod listen;
