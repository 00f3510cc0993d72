#!/usr/bin/env bash
# The whole test suite, against real PostgreSQL and Redis.
#
# Uses the servers at IDEMGATE_TEST_DATABASE_URL / IDEMGATE_TEST_REDIS_URL
# (defaults: postgres://postgres@127.0.0.1:5432/test, redis://127.0.0.1:6379).
# When nothing answers there it starts throwaway ones: a temporary
# PostgreSQL cluster with pg_virtualenv (postgresql-common) and a private
# redis-server on a free port; as root on Debian/Ubuntu it installs them
# first. Only when none of that is possible does it stop, saying what to
# install. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

export IDEMGATE_TEST_DATABASE_URL="${IDEMGATE_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export IDEMGATE_TEST_REDIS_URL="${IDEMGATE_TEST_REDIS_URL:-redis://127.0.0.1:6379}"

say() { echo "scripts/test.sh: $*" >&2; }

# host and port out of scheme://[user[:pw]@]host:port[/db]
host_port() {
  local rest="${1#*://}"
  rest="${rest##*@}"
  rest="${rest%%/*}"
  echo "${rest%%:*} ${rest##*:}"
}

answers() { # host port
  timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

install_if_possible() { # command package...
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${*:2} (apt-get)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}") >&2
  fi
  command -v "$1" >/dev/null 2>&1
}

cleanup=()
trap 'for c in "${cleanup[@]}"; do eval "$c" || true; done' EXIT

read -r rhost rport <<<"$(host_port "$IDEMGATE_TEST_REDIS_URL")"
if ! answers "$rhost" "$rport"; then
  if install_if_possible redis-server redis-server; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 16379)
    dir=$(mktemp -d)
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
      --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
    cleanup+=("kill \$(cat $dir/redis.pid) 2>/dev/null; rm -rf $dir")
    for _ in $(seq 50); do answers 127.0.0.1 "$port" && break; sleep 0.1; done
    export IDEMGATE_TEST_REDIS_URL="redis://127.0.0.1:$port"
    say "started a private redis-server on port $port"
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    docker compose up -d --wait redis >&2
  else
    say "no Redis at $IDEMGATE_TEST_REDIS_URL and none can be started: install redis-server, or set IDEMGATE_TEST_REDIS_URL"
    exit 1
  fi
fi

# The TLS and pooler suites start private servers of their own: a
# PostgreSQL cluster (initdb from /usr/lib/postgresql/*/bin, run as the
# `postgres` OS user) and PgBouncer. Install them where we can; the tests
# say what is missing otherwise.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing postgresql (apt-get) for the private-cluster tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2 || true
fi
install_if_possible pgbouncer pgbouncer || say "pgbouncer is not installed: the pgbouncer suite will fail (apt-get install pgbouncer)"

read -r phost pport <<<"$(host_port "$IDEMGATE_TEST_DATABASE_URL")"
if ! answers "$phost" "$pport" && [ -z "${IDEMGATE_IN_PG_VIRTUALENV:-}" ]; then
  if install_if_possible pg_virtualenv postgresql postgresql-common; then
    say "no PostgreSQL at $phost:$pport: running the suite inside pg_virtualenv"
    # pg_virtualenv exports PGHOST/PGPORT/PGUSER/PGPASSWORD/PGDATABASE.
    exec pg_virtualenv -o "max_connections=200" bash -c '
      export IDEMGATE_IN_PG_VIRTUALENV=1
      export IDEMGATE_TEST_DATABASE_URL="postgres://${PGUSER}:${PGPASSWORD}@127.0.0.1:${PGPORT}/${PGDATABASE}"
      exec "$0" "$@"' "$0" "$@"
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    docker compose up -d --wait postgres >&2
  else
    say "no PostgreSQL at $IDEMGATE_TEST_DATABASE_URL and none can be started: install postgresql (pg_virtualenv), or set IDEMGATE_TEST_DATABASE_URL"
    exit 1
  fi
fi

say "PostgreSQL: $(echo "$IDEMGATE_TEST_DATABASE_URL" | sed -E 's#(://[^:/@]+):[^@]*@#\1:****@#'), Redis: $IDEMGATE_TEST_REDIS_URL"
cargo test --all-targets "$@"
