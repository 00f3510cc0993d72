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
  # The peer's keys: "<agent>:POST:<key>", the keys bench/wrk.lua sends.
  if [ -n "${PEER_BIN:-}" ]; then
    redis-cli -u "$REDIS_URL" --scan --pattern "*:POST:b*" 2>/dev/null | xargs -r redis-cli -u "$REDIS_URL" DEL >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

say "building the release binary"
cargo build --release --locked -q
bin="${CARGO_TARGET_DIR:-$PWD/target}/release/idemgate"

# ----- the upstream: nginx, one worker, a fixed 201 -----
# The upstream and every nginx proxy row run as separate nginx processes:
# a proxy that shared its only worker with the upstream it proxies to would
# pay for the upstream's work too, which flatters the comparison.
up_port=$(free_port)
nginx_common() { # dir
  cat <<EOF
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 4096; }
EOF
}
nginx_http_common() { # dir
  cat <<EOF
  access_log off;
  client_body_temp_path $1/body;
  proxy_temp_path $1/proxy;
  fastcgi_temp_path $1/fastcgi;
  uwsgi_temp_path $1/uwsgi;
  scgi_temp_path $1/scgi;
  keepalive_requests 1000000;
EOF
}
start_nginx() { # dir -> pushes the master's pid onto pids
  nginx -c "$1/nginx.conf" -p "$1"
  # One pid (a first `cat` that succeeded used to print it twice, and the
  # cleanup's `kill "<pid>\n<pid>"` then left nginx running).
  for _ in $(seq 20); do [ -s "$1/nginx.pid" ] && break; sleep 0.1; done
  pids+=("$(cat "$1/nginx.pid")")
}
mkdir -p "$work/origin"
{
  echo "worker_processes 1;"
  nginx_common "$work/origin"
  echo "http {"
  nginx_http_common "$work/origin"
  cat <<EOF
  server {
    listen 127.0.0.1:$up_port;
    location /storm/ {
      access_log $work/origin/storm.log;
      default_type application/json;
      return 201 '{"id":"ord_1","status":"created"}';
    }
    location / {
      default_type application/json;
      return 201 '{"id":"ord_1","status":"created"}';
    }
  }
}
EOF
} >"$work/origin/nginx.conf"
start_nginx "$work/origin"
origin_pid=${pids[-1]}

# One ECDSA P-256 certificate for both TLS rows (what cert-manager issues by default).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$work/tls.key" -out "$work/tls.crt" 2>/dev/null

# ----- nginx as the proxy, in its own process: one worker, and `auto` -----
# Each listens plain (HTTP/1.1), h2c, and TLS with the certificate above.
start_nginx_proxy() { # name workers -> sets NX_PORT, NX_H2_PORT, NX_TLS_PORT, NX_PID
  local dir="$work/$1"
  NX_PORT=$(free_port)
  NX_H2_PORT=$(free_port)
  NX_TLS_PORT=$(free_port)
  mkdir -p "$dir"
  {
    echo "worker_processes $2;"
    nginx_common "$dir"
    echo "http {"
    nginx_http_common "$dir"
    cat <<EOF
  upstream origin { server 127.0.0.1:$up_port; keepalive 64; }
  server {
    listen 127.0.0.1:$NX_PORT;
    listen 127.0.0.1:$NX_H2_PORT http2;
    listen 127.0.0.1:$NX_TLS_PORT ssl;
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
  } >"$dir/nginx.conf"
  start_nginx "$dir"
  NX_PID=${pids[-1]}
}

# ----- idemgate, one process per store -----
# IG_KEYS: IDEMGATE_STORE_ENCRYPTION_KEYS for this one (default: none).
start_idemgate() { # name backend extra-toml [extra-server-toml] [extra-/orders-route-toml] -> sets IG_PORT, IG_PID
  local name=$1 backend=$2 extra=$3 server_extra=${4:-} route_extra=${5:-}
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
$route_extra
[[route]]
methods = ["POST"]
path = "/storm/*"
EOF
  IDEMGATE_STORE_ENCRYPTION_KEYS="${IG_KEYS:-}" "$bin" serve --config "$work/$name.toml" >"$work/$name.log" 2>&1 &
  IG_PID=$!
  pids+=("$IG_PID")
  for _ in $(seq 100); do
    if curl -s -o /dev/null "http://127.0.0.1:$admin/healthz"; then return 0; fi
    sleep 0.1
  done
  say "idemgate ($name) did not start:"; cat "$work/$name.log" >&2; exit 1
}

peak_rss_mib() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status" 2>/dev/null || echo "-"; }

# ----- CPU per request, per process group, from /proc/PID/stat -----
# utime + stime of every thread of a process, in clock ticks; a process
# that exits during a row loses its ticks, so the pid sets are taken after
# the warm-up, when the pools are open.
tck=$(getconf CLK_TCK)
ticks() { # pids... -> summed utime + stime
  local t=0 p v
  for p in "$@"; do
    v=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$p/stat" 2>/dev/null) || continue
    t=$((t + ${v:-0}))
  done
  echo "$t"
}
family() { if [ -n "$1" ]; then echo "$1"; pgrep -P "$1" || true; fi; }
# The stores every row may touch: PostgreSQL (every backend), Redis, PgBouncer.
store_pids() { pgrep -x postgres || true; pgrep -x redis-server || true; pgrep -x pgbouncer || true; }
us_per_req() { awk -v t="$1" -v k="$tck" -v n="$2" 'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / k / n; else print "-" }'; }

declare -A RPS P99 P999 CPU RSS
record() { # label rps p99_ms p999_ms cpu_us rss
  RPS[$1]=$2; P99[$1]=$3; P999[$1]=$4; CPU[$1]=$5; RSS[$1]=$6
}

rows=()
wanted() { [ -z "${ONLY:-}" ] || [[ $1 =~ $ONLY ]]; }
# Sets PX_PIDS/UP_PIDS/ST_PIDS and their tick counts before a measured run.
cpu_start() { # proxy-pid
  PX_PIDS=$(family "$1"); UP_PIDS=$(family "$origin_pid"); ST_PIDS=$(store_pids)
  # shellcheck disable=SC2086
  { T_PX=$(ticks $PX_PIDS); T_UP=$(ticks $UP_PIDS); T_ST=$(ticks $ST_PIDS); }
}
cpu_end() { # requests -> sets C_PX C_UP C_ST (µs per request)
  # shellcheck disable=SC2086
  { C_PX=$(us_per_req $(($(ticks $PX_PIDS) - T_PX)) "$1")
    C_UP=$(us_per_req $(($(ticks $UP_PIDS) - T_UP)) "$1")
    C_ST=$(us_per_req $(($(ticks $ST_PIDS) - T_ST)) "$1"); }
  [ -n "$PX_PIDS" ] || C_PX="-"
}
add_row() { # label conns rps p50 p99 p999 non2xx rss execs
  local row
  row=$(printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |' "$1" "$2" "$3" "$4" "$5" "$6" \
    "$C_PX" "$C_UP" "$C_ST" "$7" "$8" "$9")
  rows+=("$row")
  record "$1" "$3" "$5" "$6" "$C_PX" "$8"
  say "$row"
}
ms() { awk -v v="$1" 'BEGIN { printf "%.2f", v / 1000 }'; }

run() { # label url keys conns [pid] [storm-path]
  local label=$1 url=$2 keys=$3 conns=$4 pid=${5:-} storm=${6:-}
  wanted "$label" || return 0
  local path="${PATH_:-/orders}"
  [ -n "$storm" ] && path="$storm"
  PATH_="$path" KEYS="$keys" wrk -t1 -c"$conns" -d"${WARMUP}s" -s bench/wrk.lua "$url" >/dev/null 2>&1 || true
  cpu_start "$pid"
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
  cpu_end "$requests"
  local rps; rps=$(awk -v r="$requests" -v d="$duration" 'BEGIN { printf "%.0f", r / (d / 1e6) }')
  local rss="-"; [ -n "$pid" ] && rss=$(peak_rss_mib "$pid")
  local execs="-"
  # Warm-up included: the one key must have run exactly once in all.
  if [ -n "$storm" ]; then execs=$(grep -c "POST $storm " "$work/origin/storm.log" || true); fi
  add_row "$label" "$conns" "$rps" "$(ms "$p50")" "$(ms "$p99")" "$(ms "$p999")" "$non2xx" "$rss" "$execs"
}

# HTTP/2 without TLS (prior knowledge), h2load with one stream per
# connection so the concurrency equals wrk's. h2load reports the mean
# latency and the maximum, not percentiles: the p99 columns hold the
# mean, the p99.9 column the maximum.
run_h2() { # label url keys(none|one) [pid]
  local label=$1 url=$2 keys=$3 pid=${4:-}
  wanted "$label" || return 0
  local args=(-c"$CONNS" -m1 -t1 -d "$work/body.json" -H 'content-type: application/json' -H 'authorization: Bearer bench')
  [ "$keys" = one ] && args+=(-H 'idempotency-key: bench-h2-one')
  h2load "${args[@]}" -D "$WARMUP" "$url" >/dev/null 2>&1 || true
  cpu_start "$pid"
  # --log-file: one line per request (start, status, microseconds), the
  # latency percentiles h2load itself does not print.
  local log="$work/h2.log"
  local out; out=$(h2load "${args[@]}" --log-file="$log" -D "$DURATION" "$url" 2>&1 || true)
  local rps ok failed p50 p99 p999
  rps=$(awk '/^finished in/ { gsub(",", "", $4); printf "%.0f", $4 }' <<<"$out")
  ok=$(awk '/^requests:/ { print $8 }' <<<"$out")
  failed=$(awk '/^status codes:/ { print $5 + $7 + $9 }' <<<"$out")
  cpu_end "${ok:-0}"
  read -r p50 p99 p999 < <(cut -f3 "$log" | sort -n | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "- - -"; exit }
    printf "%.2f %.2f %.2f\n", v[int(NR * 0.5) + 1] / 1000, v[int(NR * 0.99) + 1] / 1000, v[int(NR * 0.999) + 1] / 1000 }')
  rm -f "$log"
  local rss="-"; [ -n "$pid" ] && rss=$(peak_rss_mib "$pid")
  add_row "$label" "$CONNS" "${rps:-0}" "$p50" "$p99" "$p999" "${failed:-?}" "$rss" "-"
}
printf '%s' '{"item":"book","qty":1}' >"$work/body.json"

up="http://127.0.0.1:$up_port"
run "upstream direct (nginx)" "$up" none "$CONNS"
start_nginx_proxy nginx1 1
nginx1=$NX_PORT; nginx1_h2=$NX_H2_PORT; nginx1_tls=$NX_TLS_PORT; nginx1_pid=$NX_PID
run "nginx plain proxy, own process, 1 worker" "http://127.0.0.1:$nginx1" none "$CONNS" "$nginx1_pid"
start_nginx_proxy nginxauto auto
run "nginx plain proxy, own process, worker_processes auto" "http://127.0.0.1:$NX_PORT" none "$CONNS" "$NX_PID"
kill "$NX_PID" 2>/dev/null || true

start_idemgate sqlite sqlite "path = \"$work/bench.db\"
synchronous = \"full\""
sqlite="http://127.0.0.1:$IG_PORT"; sqlite_pid=$IG_PID
PATH_=/plain run "idemgate pass-through (unprotected)" "$sqlite" none "$CONNS" "$sqlite_pid"
run_h2 "h2c nginx plain proxy, own process, 1 worker" "http://127.0.0.1:$nginx1_h2/plain" none "$nginx1_pid"
run_h2 "h2c idemgate pass-through (unprotected)" "$sqlite/plain" none "$sqlite_pid"
# One runtime worker, like the single nginx worker it is compared with:
# tokio reads TOKIO_WORKER_THREADS (default: one per core).
if [ -z "${ONLY:-}" ] || [[ "idemgate pass-through, 1 worker thread" =~ $ONLY ]]; then
  TOKIO_WORKER_THREADS=1 start_idemgate one_worker memory ""
  PATH_=/plain run "idemgate pass-through, 1 worker thread" "http://127.0.0.1:$IG_PORT" none "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
fi
# TLS termination, same certificate, kept-alive connections (wrk reuses
# them: this is the record layer's cost, not the handshake's), against nginx.
run "nginx proxy terminating TLS, own process, 1 worker" "https://127.0.0.1:$nginx1_tls" none "$CONNS" "$nginx1_pid"
if wanted "idemgate pass-through over TLS (listener)"; then
  start_idemgate listener_tls memory "" "tls_cert_file = \"$work/tls.crt\"
tls_key_file = \"$work/tls.key\""
  PATH_=/plain run "idemgate pass-through over TLS (listener)" "https://127.0.0.1:$IG_PORT" none "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
fi
run "fresh keys, sqlite (synchronous = full)" "$sqlite" fresh "$CONNS" "$sqlite_pid"
run "one key replayed, sqlite" "$sqlite" one "$CONNS" "$sqlite_pid"
run "100 keys, sqlite" "$sqlite" 100 "$CONNS" "$sqlite_pid"
run "duplicate storm, sqlite" "$sqlite" storm "$STORM_CONNS" "$sqlite_pid" /storm/sqlite
# The replay vault's costs, on SQLite beside the rows above: responses
# sealed at rest (AES-256-GCM), and a replay_check before each replay (a
# GET to the same nginx upstream, which answers 201).
if wanted "sealed at rest" || wanted "replay_check"; then
  IG_KEYS="bench:$(head -c 32 /dev/urandom | base64)" start_idemgate sealed sqlite "path = \"$work/sealed.db\"
synchronous = \"full\""
  run "fresh keys, sqlite, sealed at rest" "http://127.0.0.1:$IG_PORT" fresh "$CONNS" "$IG_PID"
  run "one key replayed, sqlite, sealed at rest" "http://127.0.0.1:$IG_PORT" one "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
  start_idemgate checked sqlite "path = \"$work/checked.db\"
synchronous = \"full\"" "" 'replay_check = { path = "/v1/session" }'
  run "one key replayed, sqlite, replay_check" "http://127.0.0.1:$IG_PORT" one "$CONNS" "$IG_PID"
  kill "$IG_PID" 2>/dev/null || true
fi

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
run_h2 "h2c one key replayed, postgres" "$pg/orders" one "$pg_pid"
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
run_h2 "h2c one key replayed, postgres + redis" "$rd/orders" one "$rd_pid"
run "100 keys, postgres + redis" "$rd" 100 "$CONNS" "$rd_pid"
run "duplicate storm, postgres + redis" "$rd" storm "$STORM_CONNS" "$rd_pid" /storm/redis

# ----- the peer: ldclabs/idempotent-proxy, built from source -----
# Redis only (a lock with SET NX, the response cached in Redis: not
# durable), the strongest open-source idempotency proxy to compare with.
# Its source is not part of this repository: build it once with
#   git clone https://github.com/ldclabs/idempotent-proxy && cd idempotent-proxy &&
#   cargo build --release -p idempotent-proxy-server
# and pass PEER_BIN=/path/to/target/release/idempotent-proxy-server.
if [ -n "${PEER_BIN:-}" ] && wanted "idempotent-proxy"; then
  peer_port=$(free_port)
  mkdir -p "$work/peer"
  # It insists on a .env file in its working directory.
  cat >"$work/peer/.env" <<EOF
SERVER_ADDR=127.0.0.1:$peer_port
REDIS_URL=${REDIS_URL#redis://}
URL_ORDERS=http://127.0.0.1:$up_port/orders
LOG_LEVEL=warn
EOF
  (cd "$work/peer" && exec "$PEER_BIN" >"$work/peer/peer.log" 2>&1) &
  peer_pid=$!
  pids+=("$peer_pid")
  for _ in $(seq 100); do
    curl -s -o /dev/null "http://127.0.0.1:$peer_port/" && break
    sleep 0.1
  done
  checkpoint
  PATH_=/URL_ORDERS run "fresh keys, idempotent-proxy peer (Redis only)" "http://127.0.0.1:$peer_port" fresh "$CONNS" "$peer_pid"
  PATH_=/URL_ORDERS run "one key replayed, idempotent-proxy peer (Redis only)" "http://127.0.0.1:$peer_port" one "$CONNS" "$peer_pid"
  kill "$peer_pid" 2>/dev/null || true
elif [ -z "${PEER_BIN:-}" ]; then
  say "PEER_BIN not set: the idempotent-proxy rows are not measured"
fi

if [ -z "${ONLY:-}" ]; then
say "loading $LIVE_KEYS live keys into PostgreSQL"
psql -q "$DB_URL" -v ON_ERROR_STOP=1 -c "
  INSERT INTO $schema.idempotency_records
    (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, status, headers, body)
  SELECT sha256(('s' || g)::bytea), sha256(('k' || g)::bytea), sha256(('f' || g)::bytea), 'completed', NULL, 0,
         (extract(epoch from now()) * 1000)::bigint,
         (extract(epoch from now()) * 1000)::bigint + 86400000, 201, NULL, '{}'::bytea
  FROM generate_series(1, $LIVE_KEYS) g;" >/dev/null
# Vacuumed as a table of that size in service would be: an insert-driven
# autovacuum of the load otherwise runs during the row (a 127 ms p99.9 on
# 2026-12-06). VACUUM cannot share psql's one-string transaction.
psql -q "$DB_URL" -v ON_ERROR_STOP=1 -c "VACUUM (ANALYZE) $schema.idempotency_records" >/dev/null
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
rows+=("| pgbench: claim + complete statements (requests/s) | $CONNS | $pgb | | | | | | | | | |")
fi

echo
echo "CPU columns: utime + stime per request, in µs, of the process under test (idemgate, the nginx proxy or the peer), of the upstream nginx, and of every PostgreSQL, Redis and PgBouncer process."
echo
echo "| row | conns | req/s | p50 ms | p99 ms | p99.9 ms | CPU µs/req proxy | CPU µs/req upstream | CPU µs/req stores | non-2xx | peak RSS MiB | upstream executions |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"

# ----- the targets of issue 23, as ratios within this run -----
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "-" }'; }
verdict() { # value op bound
  awk -v v="$1" -v o="$2" -v b="$3" 'BEGIN { if (v == "-" || v == "") print "not measured";
    else if ((o == ">=" && v + 0 >= b) || (o == "<=" && v + 0 <= b)) print "met"; else print "**not met**" }'
}
target() { # description value op bound
  local v=${2:--}
  echo "| $1 | $v | $3 $4 | $(verdict "$v" "$3" "$4") |"
}
pass="idemgate pass-through (unprotected)"; nx="nginx plain proxy, own process, 1 worker"
peer_fresh="fresh keys, idempotent-proxy peer (Redis only)"
echo
echo "| target | measured | bound | verdict |"
echo "|---|---:|---:|---|"
target "pass-through req/s vs nginx (own process, 1 worker)" "$(ratio "${RPS[$pass]:-}" "${RPS[$nx]:-}")" ">=" 1.0
target "pass-through p99 vs nginx" "$(ratio "${P99[$pass]:-}" "${P99[$nx]:-}")" "<=" 1.5
target "pass-through CPU per request vs nginx" "$(ratio "${CPU[$pass]:-}" "${CPU[$nx]:-}")" "<=" 1.25
target "fresh keys, postgres vs the Redis-only peer" "$(ratio "${RPS[fresh keys, postgres]:-}" "${RPS[$peer_fresh]:-}")" ">=" 1.0
target "fresh keys, postgres + redis vs postgres alone" "$(ratio "${RPS[fresh keys, postgres + redis]:-}" "${RPS[fresh keys, postgres]:-}")" ">=" 1.0
target "one key replayed, postgres vs pass-through" "$(ratio "${RPS[one key replayed, postgres]:-}" "${RPS[$pass]:-}")" ">=" 0.5
target "one key replayed, postgres + redis vs pass-through" "$(ratio "${RPS[one key replayed, postgres + redis]:-}" "${RPS[$pass]:-}")" ">=" 1.0
target "replay p99.9, postgres (ms)" "${P999[one key replayed, postgres]:-}" "<=" 100
target "replay p99.9, postgres + redis (ms)" "${P999[one key replayed, postgres + redis]:-}" "<=" 100
target "fresh keys, sqlite (synchronous = full) vs pass-through" "$(ratio "${RPS[fresh keys, sqlite (synchronous = full)]:-}" "${RPS[$pass]:-}")" ">=" 0.25
target "TLS pass-through req/s vs nginx terminating TLS" "$(ratio "${RPS[idemgate pass-through over TLS (listener)]:-}" "${RPS[nginx proxy terminating TLS, own process, 1 worker]:-}")" ">=" 1.0
target "TLS pass-through CPU per request vs nginx terminating TLS" "$(ratio "${CPU[idemgate pass-through over TLS (listener)]:-}" "${CPU[nginx proxy terminating TLS, own process, 1 worker]:-}")" "<=" 1.25
target "h2c pass-through vs h2c nginx" "$(ratio "${RPS[h2c idemgate pass-through (unprotected)]:-}" "${RPS[h2c nginx plain proxy, own process, 1 worker]:-}")" ">=" 1.0
target "h2c pass-through p99 vs h2c nginx" "$(ratio "${P99[h2c idemgate pass-through (unprotected)]:-}" "${P99[h2c nginx plain proxy, own process, 1 worker]:-}")" "<=" 1.5
target "h2c pass-through CPU per request vs h2c nginx" "$(ratio "${CPU[h2c idemgate pass-through (unprotected)]:-}" "${CPU[h2c nginx plain proxy, own process, 1 worker]:-}")" "<=" 1.25
target "h2c one key replayed, postgres vs h2c pass-through" "$(ratio "${RPS[h2c one key replayed, postgres]:-}" "${RPS[h2c idemgate pass-through (unprotected)]:-}")" ">=" 0.5
target "h2c one key replayed, postgres + redis vs h2c pass-through" "$(ratio "${RPS[h2c one key replayed, postgres + redis]:-}" "${RPS[h2c idemgate pass-through (unprotected)]:-}")" ">=" 1.0
max_rss=-
for label in "${!RSS[@]}"; do
  case $label in *nginx*|*peer*|upstream*) continue ;; esac
  v=${RSS[$label]}; [ "$v" = "-" ] && continue
  if [ "$max_rss" = "-" ] || [ "$v" -gt "$max_rss" ]; then max_rss=$v; fi
done
target "idemgate peak RSS, every row (MiB)" "$max_rss" "<=" 64
echo
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); load settings: wrk -t1 -c$CONNS -d${DURATION}s after ${WARMUP}s warm-up"
