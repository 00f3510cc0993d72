#!/usr/bin/env bash
# The invariant soak: every fault of tests/it/invariants.rs (a replica
# SIGKILLed or SIGTERMed, Redis killed or frozen, PostgreSQL cut off, clock
# skew, a slow or resetting upstream, clients hanging up, ...) under mixed
# traffic through three replicas, each fault injected again and again,
# then the invariant report: per fault, requests, executions, replays,
# releases and violations (0 expected).
#
#   scripts/soak.sh [SECONDS]    # SECONDS of load in all, split over the
#                                # faults (default 300); fails on a violation
#
# PostgreSQL and Redis as for scripts/test.sh (which it runs, so it starts
# throwaway servers where none answer); redis-server must be on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-300}"
case "$secs" in
  '' | *[!0-9]*) echo "usage: scripts/soak.sh [SECONDS]" >&2; exit 64 ;;
esac
export IDEMGATE_SOAK_SECS="$secs"
exec scripts/test.sh --test it invariants::soak -- --ignored --nocapture
