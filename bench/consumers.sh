#!/usr/bin/env bash
# Message consumers' throughput (issue 24): messages per second through an
# idemgate [[consumer]] (SQLite store, fresh message keys, prefetch /
# max_ack_pending 32) against the same consumer without dedup (consume,
# POST, ack, in-process), on RabbitMQ and on NATS JetStream, delivering to
# the same in-process counting upstream. Needs the brokers running
# (scripts/test.sh starts them) and PostgreSQL at IDEMGATE_TEST_DATABASE_URL.
# Each row counts IDEMGATE_BENCH_MESSAGES (default 2000) queued messages
# from the first one executed to the last (start-up not counted).
set -euo pipefail
cd "$(dirname "$0")/.."
export IDEMGATE_BENCH_MESSAGES="${IDEMGATE_BENCH_MESSAGES:-2000}"
cargo test --release --test it consumers::throughput -- --ignored --nocapture --test-threads 1 2>&1 |
  grep -E '^\|'
