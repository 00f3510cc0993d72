#!/usr/bin/env bash
# The whole test suite, against real PostgreSQL and Redis.
#
# Uses the servers at IDEMGATE_TEST_DATABASE_URL / IDEMGATE_TEST_REDIS_URL
# (defaults: postgres://postgres@127.0.0.1:5432/test, redis://127.0.0.1:6379).
# When nothing answers there it starts throwaway ones: a temporary
# PostgreSQL cluster with pg_virtualenv (postgresql-common) and a private
# redis-server on a free port; as root on Debian/Ubuntu it installs them
# first; without them it runs throwaway containers (docker) on free ports.
# Everything it starts is removed when it exits. Only when none of that is
# possible does it stop, saying what to install. Extra arguments go to
# `cargo test`.
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

answers() { # host port: does something accept there within 2 s?
  if command -v timeout >/dev/null 2>&1; then
    timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
    return
  fi
  # No timeout(1) (macOS): the same with a watchdog.
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null &
  local probe=$! watchdog rc=0
  (sleep 2; kill "$probe" 2>/dev/null) &
  watchdog=$!
  wait "$probe" 2>/dev/null || rc=$?
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
  return "$rc"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo "$1"
}

have_docker() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }

# A throwaway container publishing one port on 127.0.0.1 only, removed on
# exit (the compose file publishes no ports, and its database is not the
# tests' postgres/test). Sets $container; not for $(...), whose subshell
# would lose the cleanup.
start_container() { # host-port container-port docker-run-args...
  container=$(docker run -d --rm -p "127.0.0.1:$1:$2" "${@:3}")
  cleanup+=("docker rm -f $container >/dev/null")
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
# ${a[@]+...}: an empty array under set -u is an error in bash 3 (macOS).
trap 'for c in ${cleanup[@]+"${cleanup[@]}"}; do eval "$c" || true; done' EXIT

read -r rhost rport <<<"$(host_port "$IDEMGATE_TEST_REDIS_URL")"
if ! answers "$rhost" "$rport"; then
  if install_if_possible redis-server redis-server; then
    port=$(free_port 16379)
    dir=$(mktemp -d)
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
      --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
    cleanup+=("kill \$(cat $dir/redis.pid) 2>/dev/null; rm -rf $dir")
    for _ in $(seq 50); do answers 127.0.0.1 "$port" && break; sleep 0.1; done
    export IDEMGATE_TEST_REDIS_URL="redis://127.0.0.1:$port"
    say "started a private redis-server on port $port"
  elif have_docker; then
    port=$(free_port 16379)
    start_container "$port" 6379 redis:7-alpine redis-server --save "" --appendonly no
    for _ in $(seq 100); do answers 127.0.0.1 "$port" && break; sleep 0.1; done
    export IDEMGATE_TEST_REDIS_URL="redis://127.0.0.1:$port"
    say "started a Redis container on port $port"
  else
    say "no Redis at $IDEMGATE_TEST_REDIS_URL and none can be started: install redis-server, or set IDEMGATE_TEST_REDIS_URL"
    exit 1
  fi
fi
# The Redis TLS and Cluster suites start their own redis-server (--tls-port,
# --cluster-enabled) and join clusters with redis-cli --cluster create.
install_if_possible redis-server redis-server ||
  say "redis-server is not installed: the Redis fault, TLS and Cluster tests will fail saying so"
install_if_possible redis-cli redis-tools ||
  say "redis-cli is not installed (redis-tools): the Redis Cluster tests will fail saying so"

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
    # Not exec'd: this shell's EXIT trap still has a private redis-server
    # and its folder to clean up when the suite ends.
    status=0
    pg_virtualenv -o "max_connections=200" bash -c '
      export IDEMGATE_IN_PG_VIRTUALENV=1
      export IDEMGATE_TEST_DATABASE_URL="postgres://${PGUSER}:${PGPASSWORD}@127.0.0.1:${PGPORT}/${PGDATABASE}"
      exec "$0" "$@"' "$0" "$@" || status=$?
    exit "$status"
  elif have_docker; then
    port=$(free_port 15432)
    start_container "$port" 5432 -e POSTGRES_HOST_AUTH_METHOD=trust -e POSTGRES_DB=test \
      postgres:16-alpine -c max_connections=200
    for _ in $(seq 300); do
      docker exec "$container" pg_isready -h 127.0.0.1 -U postgres -d test >/dev/null 2>&1 && break
      sleep 0.2
    done
    export IDEMGATE_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$port/test"
    say "started a PostgreSQL container on port $port"
  else
    say "no PostgreSQL at $IDEMGATE_TEST_DATABASE_URL and none can be started: install postgresql (pg_virtualenv), or set IDEMGATE_TEST_DATABASE_URL"
    exit 1
  fi
fi

# The consumer tests (tests/it/consumers.rs) use RabbitMQ on 127.0.0.1:5672
# (guest/guest, with rabbitmqctl) and NATS with JetStream on 127.0.0.1:4222,
# and start private nats-servers of their own. Installed where missing (as
# root with apt-get), started where stopped; never stopped by this script
# (other work on the machine may share them). The tests fail, naming what
# to start, when one still does not answer.
install_if_possible rabbitmq-server rabbitmq-server ||
  say "rabbitmq-server is not installed: the consumer tests will fail saying so"
install_if_possible nats-server nats-server ||
  say "nats-server is not installed: the consumer tests will fail saying so"
if ! answers 127.0.0.1 5672 && command -v rabbitmq-server >/dev/null 2>&1; then
  say "starting RabbitMQ (rabbitmq-server -detached)"
  rabbitmq-server -detached >&2 || true
  for _ in $(seq 120); do answers 127.0.0.1 5672 && break; sleep 0.5; done
fi
if ! answers 127.0.0.1 4222 && command -v nats-server >/dev/null 2>&1; then
  say "starting nats-server with JetStream on 127.0.0.1:4222"
  mkdir -p /var/lib/nats-server
  if command -v start-stop-daemon >/dev/null 2>&1; then
    start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log >&2 || true
  else
    nohup nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server >/dev/null 2>&1 &
  fi
  for _ in $(seq 50); do answers 127.0.0.1 4222 && break; sleep 0.1; done
fi

say "PostgreSQL: $(echo "$IDEMGATE_TEST_DATABASE_URL" | sed -E 's#(://[^:/@]+):[^@]*@#\1:****@#'), Redis: $IDEMGATE_TEST_REDIS_URL"
# `otel` (OpenTelemetry traces) is not a default feature; test it too.
cargo test --all-targets --features otel "$@"
