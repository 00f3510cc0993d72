#!/usr/bin/env bash
# One-command benchmark: every idemgate mode side by side, on loopback.
#
#   bench/run.sh                 # all rows, prints one table
#   DURATION=8 CONNS=32 bench/run.sh
#   ONLY='pgbouncer|TLS' DURATION=2 bench/run.sh   # only the rows whose label matches
#
# Needs wrk, nginx, pgbench (postgresql-client), pgbouncer and redis-server; as root on
# Debian/Ubuntu it installs the missing ones with apt, elsewhere it names
# them. PostgreSQL at IDEMGATE_TEST_DATABASE_URL (default
# postgres://postgres@127.0.0.1:5432/test) and Redis at
# IDEMGATE_TEST_REDIS_URL (default redis://127.0.0.1:6379), as for the
# tests. Every row runs with the same load (wrk -t1 -c$CONNS -d${DURATION}s
# after a 2 s warm-up), except the duplicate storm (256 connections). The
# numbers are only comparable within one run: do not run it while
# something else builds.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-8}"
CONNS="${CONNS:-32}"
WARMUP="${WARMUP:-2}"
STORM_CONNS="${STORM_CONNS:-256}"
LIVE_KEYS="${LIVE_KEYS:-1000000}"
DB_URL="${IDEMGATE_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
REDIS_URL="${IDEMGATE_TEST_REDIS_URL:-redis://127.0.0.1:6379}"

say() { echo "bench: $*" >&2; }

need() { # command package
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing $2"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >&2
  fi
  command -v "$1" >/dev/null 2>&1 || { say "missing $1: install $2"; exit 1; }
}
need wrk wrk
need nginx nginx
need openssl openssl
need pgbench postgresql-client
need redis-cli redis-tools
need psql postgresql-client
need pgbouncer pgbouncer

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

work=$(mktemp -d)
pids=()
schema="bench_$$"
prefix="bench$$"
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  psql -q "$DB_URL" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
  redis-cli -u "$REDIS_URL" --scan --pattern "$prefix:*" 2>/dev/null | xargs -r redis-cli -u "$REDIS_URL" DEL >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

say "building the release binary"
cargo build --release --locked -q
bin="${CARGO_TARGET_DIR:-$PWD/target}/release/idemgate"

# ----- the upstream (nginx, one worker, a fixed 201), a plain nginx proxy
# and an nginx proxy terminating TLS with the certificate idemgate's TLS row uses -----
up_port=$(free_port)
px_port=$(free_port)
tls_px_port=$(free_port)
mkdir -p "$work/nginx"
# One ECDSA P-256 certificate for both TLS rows (what cert-manager issues by default).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$work/tls.key" -out "$work/tls.crt" 2>/dev/null
cat >"$work/nginx/nginx.conf" <<EOF
worker_processes 1;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx/body;
  proxy_temp_path $work/nginx/proxy;
  fastcgi_temp_path $work/nginx/fastcgi;
  uwsgi_temp_path $work/nginx/uwsgi;
  scgi_temp_path $work/nginx/scgi;
  keepalive_requests 1000000;
  upstream origin { server 127.0.0.1:$up_port; keepalive 64; }
  server {
    listen 127.0.0.1:$up_port;
    location /storm/ {
      access_log $work/nginx/storm.log;
      default_type application/json;
      return 201 '{"id":"ord_1","status":"created"}';
    }
    location / {
      default_type application/json;
      return 201 '{"id":"ord_1","status":"created"}';
    }
  }
  server {
    listen 127.0.0.1:$px_port;
    location / {
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
  server {
    listen 127.0.0.1:$tls_px_port ssl;
    ssl_certificate $work/tls.crt;
    ssl_certificate_key $work/tls.key;
    ssl_protocols TLSv1.2 TLSv1.3;
    location / {
      proxy_pass http://origin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF
nginx -c "$work/nginx/nginx.conf" -p "$work/nginx"
# One pid (a first `cat` that succeeded used to print it twice, and the
# cleanup's `kill "<pid>\n<pid>"` then left nginx running).
for _ in $(seq 20); do [ -s "$work/nginx/nginx.pid" ] && break; sleep 0.1; done
pids+=("$(cat "$work/nginx/nginx.pid")")

# ----- idemgate, one process per store -----
start_idemgate() { # name backend extra-toml [extra-server-toml] -> sets IG_PORT, IG_PID
  local name=$1 backend=$2 extra=$3 server_extra=${4:-}
  IG_PORT=$(free_port)
  local admin; admin=$(free_port)
  cat >"$work/$name.toml" <<EOF
[server]
listen = "127.0.0.1:$IG_PORT"
upstream = "http://127.0.0.1:$up_port"
max_connections = 10000
$server_extra
[admin]
listen = "127.0.0.1:$admin"
[store]
backend = "$backend"
$extra
[log]
level = "warn"
[[route]]
methods = ["POST"]
path = "/orders"
[[route]]
methods = ["POST"]
path = "/storm/*"
EOF
  "$bin" serve --config "$work/$name.toml" >"$work/$name.log" 2>&1 &
  IG_PID=$!
  pids+=("$IG_PID")
  for _ in $(seq 100); do
    if curl -s -o /dev/null "http://127.0.0.1:$admin/healthz"; then return 0; fi
    sleep 0.1
  done
  say "idemgate ($name) did not start:"; cat "$work/$name.log" >&2; exit 1
}

peak_rss_mib() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status" 2>/dev/null || echo "-"; }

rows=()
run() { # label url keys conns [pid] [storm-path]
  local label=$1 url=$2 keys=$3 conns=$4 pid=${5:-} storm=${6:-}
  if [ -n "${ONLY:-}" ] && ! [[ $label =~ $ONLY ]]; then return 0; fi
  local path="${PATH_:-/orders}"
  [ -n "$storm" ] && path="$storm"
  PATH_="$path" KEYS="$keys" wrk -t1 -c"$conns" -d"${WARMUP}s" -s bench/wrk.lua "$url" >/dev/null 2>&1 || true
  local out
  out=$(PATH_="$path" KEYS="$keys" wrk -t1 -c"$conns" -d"${DURATION}s" -s bench/wrk.lua "$url" 2>&1 | grep '^RESULT' || true)
  local requests=0 duration=1 non2xx=0 p50=0 p99=0 p999=0 kv
  for kv in $out; do
    case $kv in
      requests=*) requests=${kv#*=} ;;
      duration_us=*) duration=${kv#*=} ;;
      non2xx=*) non2xx=${kv#*=} ;;
      p50_us=*) p50=${kv#*=} ;;
      p99_us=*) p99=${kv#*=} ;;
      p999_us=*) p999=${kv#*=} ;;
    esac
  done
  local rps; rps=$(awk -v r="$requests" -v d="$duration" 'BEGIN { printf "%.0f", r / (d / 1e6) }')
  local rss="-"; [ -n "$pid" ] && rss=$(peak_rss_mib "$pid")
  local execs="-"
  # Warm-up included: the one key must have run exactly once in all.
  if [ -n "$storm" ]; then execs=$(grep -c "POST $storm " "$work/nginx/storm.log" || true); fi
  local row
  row=$(printf '| %s | %s | %s | %.2f | %.2f | %.2f | %s | %s | %s |' "$label" "$conns" "$rps" \
    "$(awk -v v="$p50" 'BEGIN{print v/1000}')" "$(awk -v v="$p99" 'BEGIN{print v/1000}')" \
    "$(awk -v v="$p999" 'BEGIN{print v/1000}')" "$non2xx" "$rss" "$execs")
  rows+=("$row")
  say "$row"
}

up="http://127.0.0.1:$up_port"
run "upstream direct (nginx)" "$up" none "$CONNS"
run "nginx plain proxy" "http://127.0.0.1:$px_port" none "$CONNS"

start_idemgate sqlite sqlite "path = \"$work/bench.db\"
synchronous = \"full\""
sqlite="http://127.0.0.1:$IG_PORT"; sqlite_pid=$IG_PID
PATH_=/plain run "idemgate pass-through (unprotected)" "$sqlite" none "$CONNS" "$sqlite_pid"
# One runtime worker, like the single nginx worker it is compared with:
# tokio reads TOKIO_WORKER_THREADS (default: one per core).
if [ -z "${ONLY:-}" ] || [[ "idemgate pass-through, 1 worker thread" =~ $ONLY ]]; then
  TOKIO_WORKER_THREADS=1 start_idemgate one_worker memory ""
  PATH_=/plain run "idemgate pass-through, 1 worker thread" "http://127.0.0.1:$IG_PORT" none "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
fi
# TLS termination, same certificate, kept-alive connections (wrk reuses
# them: this is the record layer's cost, not the handshake's), against nginx.
run "nginx proxy terminating TLS" "https://127.0.0.1:$tls_px_port" none "$CONNS"
if [ -z "${ONLY:-}" ] || [[ "idemgate pass-through over TLS (listener)" =~ $ONLY ]]; then
  start_idemgate listener_tls memory "" "tls_cert_file = \"$work/tls.crt\"
tls_key_file = \"$work/tls.key\""
  PATH_=/plain run "idemgate pass-through over TLS (listener)" "https://127.0.0.1:$IG_PORT" none "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
fi
run "fresh keys, sqlite (synchronous = full)" "$sqlite" fresh "$CONNS" "$sqlite_pid"
run "one key replayed, sqlite" "$sqlite" one "$CONNS" "$sqlite_pid"
run "100 keys, sqlite" "$sqlite" 100 "$CONNS" "$sqlite_pid"
run "duplicate storm, sqlite" "$sqlite" storm "$STORM_CONNS" "$sqlite_pid" /storm/sqlite

# Start the PostgreSQL rows from a quiet server: flush whatever an earlier
# run (or the 1M-row load below) left for the checkpointer.
checkpoint() { psql -q "$DB_URL" -c CHECKPOINT >/dev/null 2>&1 || true; sleep 1; }
checkpoint
# The plain rows connect without TLS (sslmode=disable), as before TLS
# support: comparable with earlier runs. The TLS row shows its cost.
with_query() { case $1 in *\?*) echo "$1&$2" ;; *) echo "$1?$2" ;; esac; }
start_idemgate postgres postgres "url = \"$(with_query "$DB_URL" sslmode=disable)\"
schema = \"$schema\""
pg="http://127.0.0.1:$IG_PORT"; pg_pid=$IG_PID
run "fresh keys, postgres" "$pg" fresh "$CONNS" "$pg_pid"
run "one key replayed, postgres" "$pg" one "$CONNS" "$pg_pid"
run "100 keys, postgres" "$pg" 100 "$CONNS" "$pg_pid"
run "duplicate storm, postgres" "$pg" storm "$STORM_CONNS" "$pg_pid" /storm/postgres

start_idemgate tls postgres "url = \"$(with_query "$DB_URL" sslmode=require)\"
schema = \"$schema\""
tls="http://127.0.0.1:$IG_PORT"; tls_pid=$IG_PID
checkpoint
run "fresh keys, postgres over TLS (sslmode=require)" "$tls" fresh "$CONNS" "$tls_pid"

# PgBouncer in transaction pooling mode in front of the same database,
# with as many server connections as idemgate's pool: pgbouncer=true
# (unnamed statements, SET LOCAL per call) against the direct rows above.
if [ -z "${ONLY:-}" ] || [[ "fresh keys, postgres via pgbouncer" =~ $ONLY ]]; then
  bouncer_port=$(free_port)
  mkdir -p "$work/pgbouncer"
  chmod 755 "$work"
  read -r bh bp bu bpw bdb <<<"$(python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(p.hostname or "127.0.0.1", p.port or 5432, p.username or "postgres", u.unquote(p.password or "-"), p.path.lstrip("/") or "postgres")' "$DB_URL")"
  [ "$bpw" = "-" ] && bpw=""
  echo "\"$bu\" \"\"" >"$work/pgbouncer/userlist.txt"
  cat >"$work/pgbouncer/pgbouncer.ini" <<INI
[databases]
* = host=$bh port=$bp user=$bu ${bpw:+password=$bpw}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bouncer_port
unix_socket_dir =
auth_type = trust
auth_file = $work/pgbouncer/userlist.txt
pool_mode = transaction
default_pool_size = 16
max_client_conn = 1000
logfile = $work/pgbouncer/pgbouncer.log
pidfile = $work/pgbouncer/pgbouncer.pid
INI
  # PgBouncer refuses to run as root.
  as_pg=()
  if [ "$(id -u)" = 0 ]; then chown -R postgres "$work/pgbouncer"; as_pg=(runuser -u postgres --); fi
  "${as_pg[@]}" pgbouncer -d "$work/pgbouncer/pgbouncer.ini"
  for _ in $(seq 50); do [ -s "$work/pgbouncer/pgbouncer.pid" ] && break; sleep 0.1; done
  pids+=("$(cat "$work/pgbouncer/pgbouncer.pid")")
  start_idemgate bouncer postgres "url = \"postgres://$bu@127.0.0.1:$bouncer_port/$bdb?pgbouncer=true\"
schema = \"$schema\""
  bn="http://127.0.0.1:$IG_PORT"; bn_pid=$IG_PID
  checkpoint
  run "fresh keys, postgres via pgbouncer (transaction mode)" "$bn" fresh "$CONNS" "$bn_pid"
  run "100 keys, postgres via pgbouncer (transaction mode)" "$bn" 100 "$CONNS" "$bn_pid"
fi

start_idemgate redis postgres "url = \"$(with_query "$DB_URL" sslmode=disable)\"
schema = \"$schema\"
[redis]
url = \"$REDIS_URL\"
prefix = \"$prefix\""
rd="http://127.0.0.1:$IG_PORT"; rd_pid=$IG_PID
checkpoint
run "fresh keys, postgres + redis" "$rd" fresh "$CONNS" "$rd_pid"
run "one key replayed, postgres + redis" "$rd" one "$CONNS" "$rd_pid"
run "100 keys, postgres + redis" "$rd" 100 "$CONNS" "$rd_pid"
run "duplicate storm, postgres + redis" "$rd" storm "$STORM_CONNS" "$rd_pid" /storm/redis

if [ -z "${ONLY:-}" ]; then
say "loading $LIVE_KEYS live keys into PostgreSQL"
psql -q "$DB_URL" -v ON_ERROR_STOP=1 -c "
  INSERT INTO $schema.idempotency_records
    (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, status, headers, body)
  SELECT sha256(('s' || g)::bytea), sha256(('k' || g)::bytea), sha256(('f' || g)::bytea), 'completed', NULL, 0,
         (extract(epoch from now()) * 1000)::bigint,
         (extract(epoch from now()) * 1000)::bigint + 86400000, 201, NULL, '{}'::bytea
  FROM generate_series(1, $LIVE_KEYS) g;
  ANALYZE $schema.idempotency_records;" >/dev/null
checkpoint
run "fresh keys, postgres, $LIVE_KEYS live keys" "$pg" fresh "$CONNS" "$pg_pid"

# ----- the store's own limit: the claim + complete statements through pgbench -----
cat >"$work/claim_complete.sql" <<EOF
\set k random(1, 2000000000)
\set t random(1, 2000000000)
INSERT INTO $schema.idempotency_records AS r
  (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, takeover)
VALUES (sha256(('pgb' || :k)::bytea), sha256(('pgb' || :k || :t)::bytea), sha256('f'::bytea), 'in_flight',
        sha256(('t' || :t)::bytea), (extract(epoch from statement_timestamp()) * 1000)::bigint + 30000,
        (extract(epoch from statement_timestamp()) * 1000)::bigint,
        (extract(epoch from statement_timestamp()) * 1000)::bigint + 86400000, FALSE)
ON CONFLICT (scope, key) DO UPDATE SET state = 'in_flight' WHERE r.state <> 'in_flight'
RETURNING takeover;
UPDATE $schema.idempotency_records SET state = 'completed', status = 201, headers = NULL, body = '{}'::bytea,
  token = NULL, locked_until = 0
WHERE scope = sha256(('pgb' || :k)::bytea) AND key = sha256(('pgb' || :k || :t)::bytea)
  AND token = sha256(('t' || :t)::bytea) AND state = 'in_flight';
EOF
checkpoint
pgb=$(pgbench -n -c "$CONNS" -j 1 -T "$DURATION" -f "$work/claim_complete.sql" "$DB_URL" 2>&1 | awk '/^tps/ {printf "%.0f", $3}')
rows+=("| pgbench: claim + complete statements (requests/s) | $CONNS | $pgb | | | | | | |")
fi

echo
echo "| row | conns | req/s | p50 ms | p99 ms | p99.9 ms | non-2xx | peak RSS MiB | upstream executions |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); load settings: wrk -t1 -c$CONNS -d${DURATION}s after ${WARMUP}s warm-up"
