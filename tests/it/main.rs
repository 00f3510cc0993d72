//! The integration tests, as one crate: `support` is compiled and the
//! binary linked once, and every suite runs in the same `cargo test` run.
//!
//! Every test talks to real sockets on ephemeral ports, and to the real
//! PostgreSQL and Redis named by `IDEMGATE_TEST_DATABASE_URL` and
//! `IDEMGATE_TEST_REDIS_URL` (`scripts/test.sh` provides them). Nothing
//! skips: a missing service fails the test with what to start.

mod support;

mod book_commands;
mod config_traps;
mod consumers;
mod consumers_js;
mod demo_docs;
mod doc_commands;
mod error_shapes;
mod faults;
mod fd_limit;
mod forwarding;
mod gateway;
mod h2_refused;
mod hostile_connections;
mod hostile_requests;
mod idempotency_status;
mod invariants;
mod lifecycle;
mod operations;
mod ops_metrics;
mod pg_failover;
mod pgbouncer;
mod postgres_durability;
mod postgres_retries;
mod postgres_tls;
mod problem_members;
mod properties;
mod read_buffers;
mod readiness;
mod redis_cluster;
mod redis_endpoint_failover;
mod redis_sentinel;
mod redis_tls;
mod regressions;
mod reload;
mod replay_check;
mod replicas;
mod request_id;
mod rough_edges;
mod route_features;
mod semantics;
mod store_contract;
mod store_paths;
mod tls_listener;
#[cfg(feature = "otel")]
mod tracing;
mod upstream_tls;
mod vault;
mod waiting;
mod webhooks;
