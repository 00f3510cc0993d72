#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: repeatable
# whatever else the machine does, so it can be run beside a build. Runs
# idemgate (pass-through, one key replayed, or fresh keys, on the store
# STORE names) and an nginx proxy in its own process on the same upstream,
# each under callgrind; the counters are zeroed after a warm-up, then N
# requests are sent (h2load --h1, 8 connections; fresh keys: wrk with
# bench/wrk.lua for SECONDS, its completed requests counted) and the
# counters dumped. Only idemgate's own instructions are counted: the
# store's processes are not under callgrind.
#
#   bench/profile.sh                 # pass-through, 20000 requests
#   MODE=replay N=5000 bench/profile.sh                  # memory store
#   MODE=replay STORE=postgres NGINX=0 bench/profile.sh  # or postgres+redis
#   MODE=fresh STORE=postgres SECONDS_=10 NGINX=0 bench/profile.sh
#   BIN=/path/to/old/idemgate NGINX=0 bench/profile.sh   # another build, idemgate only
#   callgrind_annotate --inclusive=yes $OUT/idemgate.out | head -60
#
# Needs valgrind, nginx and h2load (nghttp2-client). Leaves the callgrind
# outputs in $OUT (default: a new temporary directory, printed).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-20000}"
MODE="${MODE:-pass}"
STORE="${STORE:-memory}"
SECONDS_="${SECONDS_:-10}"
DB_URL="${IDEMGATE_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
REDIS_URL="${IDEMGATE_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
schema="profile_$$"
OUT="${OUT:-$(mktemp -d)}"
say() { echo "profile: $*" >&2; }
for c in valgrind nginx h2load callgrind_control; do
  command -v "$c" >/dev/null || { say "missing $c (apt-get install valgrind nginx nghttp2-client)"; exit 1; }
done
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ "$STORE" != memory ]; then
    psql -q "$DB_URL" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true
  fi
  if [ "$STORE" = postgres+redis ]; then
    redis-cli -u "$REDIS_URL" --scan --pattern "$schema:*" 2>/dev/null | xargs -r redis-cli -u "$REDIS_URL" DEL >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

# BIN: an idemgate binary built elsewhere (another commit); else this checkout's.
if [ -n "${BIN:-}" ]; then bin=$BIN; else
  cargo build --release --locked -q
  bin="${CARGO_TARGET_DIR:-$PWD/target}/release/idemgate"
fi

up=$(free_port); nx=$(free_port); ig=$(free_port); admin=$(free_port)
nginx_conf() { # file, listen-and-locations
  cat >"$1" <<CONF
daemon off;
master_process off;
worker_processes 1;
pid $OUT/$(basename "$1").pid;
error_log $OUT/$(basename "$1").err warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $OUT/body; proxy_temp_path $OUT/proxy;
  fastcgi_temp_path $OUT/fcgi; uwsgi_temp_path $OUT/uwsgi; scgi_temp_path $OUT/scgi;
  keepalive_requests 1000000;
  $2
}
CONF
}
nginx_conf "$OUT/origin.conf" "server { listen 127.0.0.1:$up; location / { default_type application/json; return 201 '{\"id\":\"ord_1\",\"status\":\"created\"}'; } }"
nginx_conf "$OUT/proxy.conf" "upstream origin { server 127.0.0.1:$up; keepalive 64; }
  server { listen 127.0.0.1:$nx; location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
nginx -c "$OUT/origin.conf" -p "$OUT" &
pids+=($!)

store_toml() {
  case $STORE in
    memory) printf '[store]\nbackend = "memory"\n' ;;
    postgres) printf '[store]\nbackend = "postgres"\nurl = "%s"\nschema = "%s"\n' "$DB_URL?sslmode=disable" "$schema" ;;
    postgres+redis) printf '[store]\nbackend = "postgres"\nurl = "%s"\nschema = "%s"\n[redis]\nurl = "%s"\nprefix = "%s"\n' \
      "$DB_URL?sslmode=disable" "$schema" "$REDIS_URL" "$schema" ;;
    *) say "STORE is memory, postgres or postgres+redis, not $STORE"; exit 1 ;;
  esac
}
cat >"$OUT/idemgate.toml" <<CONF
[server]
listen = "127.0.0.1:$ig"
upstream = "http://127.0.0.1:$up"
[admin]
listen = "127.0.0.1:$admin"
$(store_toml)
[log]
level = "warn"
[[route]]
methods = ["POST"]
path = "/orders"
CONF

path=/plain; hdr=()
case $MODE in
  pass) ;;
  replay) path=/orders; hdr=(-H 'idempotency-key: profile-one') ;;
  fresh) path=/orders; command -v wrk >/dev/null || { say "missing wrk"; exit 1; } ;;
  *) say "MODE is pass, replay or fresh, not $MODE"; exit 1 ;;
esac
printf '%s' '{"item":"book","qty":1}' >"$OUT/body.json"
load() { # url n
  if [ "$MODE" = fresh ]; then
    # wrk runs for a time, not a count: its completed requests are N.
    local secs=$SECONDS_
    [ "$2" -lt "$N" ] && secs=2
    KEYS=fresh PATH_=/orders wrk -t1 -c8 -d"${secs}s" -s bench/wrk.lua "${1%/orders}" >"$OUT/wrk.txt" 2>&1
    sed -n 's/.*RESULT requests=\([0-9]*\).*/\1/p' "$OUT/wrk.txt" >"$OUT/count"
    grep -E 'RESULT' "$OUT/wrk.txt" >&2
    return
  fi
  h2load --h1 -n "$2" -c 8 -m1 -t1 -d "$OUT/body.json" -H 'content-type: application/json' \
    -H 'authorization: Bearer bench' "${hdr[@]}" "$1" | grep -E '^requests:|^status codes:' >&2
}
wait_port() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; say "nothing on $1"; exit 1; }

measure() { # name port command...
  local name=$1 port=$2; shift 2
  valgrind --tool=callgrind --callgrind-out-file="$OUT/$name.out" "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!; pids+=("$pid")
  wait_port "$port"
  load "http://127.0.0.1:$port$path" 2000
  callgrind_control -z "$pid" >/dev/null
  load "http://127.0.0.1:$port$path" "$N"
  callgrind_control -d "$pid" >/dev/null
  sleep 1
  [ "$MODE" = fresh ] && N=$(cat "$OUT/count")
  local total; total=$(cat "$OUT/$name.out".* 2>/dev/null | awk '/^summary:/ { t += $2 } END { print t + 0 }')
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  echo "$name $((total / N))"
}

wait_port "$up"
a=$(measure idemgate "$ig" "$bin" serve --config "$OUT/idemgate.toml")
echo
echo "| process | instructions per request ($MODE, $STORE, N=$N) |"
echo "|---|---:|"
echo "| ${a% *} | ${a#* } |"
if [ "${NGINX:-1}" != 0 ]; then
  b=$(measure nginx "$nx" nginx -c "$OUT/proxy.conf" -p "$OUT")
  echo "| ${b% *} | ${b#* } |"
  echo "ratio idemgate / nginx: $(awk -v a="${a#* }" -v b="${b#* }" 'BEGIN { printf "%.2f", a / b }')"
fi
echo "callgrind outputs: $OUT"
