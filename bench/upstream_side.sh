#!/usr/bin/env bash
# What the upstream sees per request behind idemgate and behind an nginx
# proxy: load-independent counts, so it can run beside a build.
#
#   bench/upstream_side.sh            # N=20000 requests, 32 connections
#   N=5000 C=32 bench/upstream_side.sh
#
# For each proxy (idemgate pass-through, nginx one worker with keepalive
# to the upstream, as in bench/run.sh), on the same upstream nginx (one
# worker, a fixed 201): connections the upstream accepted (stub_status,
# from the proxy's start, warm-up included), requests per connection, the
# upstream worker's syscalls per request (attached for the N
# measured requests, counted by `perf stat` on the syscall tracepoints:
# unlike strace it does not slow the worker, so the batching it sees is
# the real one), its context switches, and bytes written per request
# (/proc/PID/io wchar; recvfrom is not counted in rchar). The load is
# h2load --h1 with a fixed request count. Connection and syscall counts
# per request do not depend on timing; epoll_wait and context switches per
# request do (how many requests one wake-up finds), so compare those only
# between proxies measured back to back.
# Needs nginx, h2load (nghttp2-client) and perf.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-20000}"
C="${C:-32}"
WARM="${WARM:-2000}"
OUT="${OUT:-$(mktemp -d)}"
say() { echo "upstream_side: $*" >&2; }
for c in nginx h2load perf; do
  command -v "$c" >/dev/null || { say "missing $c (apt-get install nginx nghttp2-client linux-perf)"; exit 1; }
done
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# BIN: an idemgate binary built elsewhere (another commit); else this checkout's.
if [ -n "${BIN:-}" ]; then bin=$BIN; else
  cargo build --release --locked -q
  bin="${CARGO_TARGET_DIR:-$PWD/target}/release/idemgate"
fi

up=$(free_port); st=$(free_port); nx=$(free_port); ig=$(free_port); admin=$(free_port)
nginx_conf() { # file, server blocks
  cat >"$1" <<CONF
daemon off;
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
nginx_conf "$OUT/origin.conf" "server { listen 127.0.0.1:$up; location / { default_type application/json; return 201 '{\"id\":\"ord_1\",\"status\":\"created\"}'; } }
  server { listen 127.0.0.1:$st; location / { stub_status; } }"
nginx_conf "$OUT/proxy.conf" "upstream origin { server 127.0.0.1:$up; keepalive 64; }
  server { listen 127.0.0.1:$nx; location / { proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
cat >"$OUT/idemgate.toml" <<CONF
[server]
listen = "127.0.0.1:$ig"
upstream = "http://127.0.0.1:$up"
[admin]
listen = "127.0.0.1:$admin"
[store]
backend = "memory"
[log]
level = "warn"
[[route]]
methods = ["POST"]
path = "/orders"
CONF
printf '%s' '{"item":"book","qty":1}' >"$OUT/body.json"

wait_port() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; say "nothing on $1"; exit 1; }
load() { # url n
  h2load --h1 -n "$2" -c "$C" -m1 -t1 -d "$OUT/body.json" -H 'content-type: application/json' \
    -H 'authorization: Bearer bench' "$1" | grep -E '^requests:' >&2
}
# accepts handled requests, from stub_status
stub() { curl -s "http://127.0.0.1:$st/" | awk 'NR == 3 { print $1, $2, $3 }'; }
io() { awk '/^wchar:/ { print $2 }' "/proc/$1/io"; }

measure() { # name port
  local name=$1 port=$2
  # A fresh upstream per proxy, so its connection counts are the proxy's.
  nginx -c "$OUT/origin.conf" -p "$OUT" &
  local master=$!; pids+=("$master")
  wait_port "$up"; wait_port "$st"
  local worker; worker=$(pgrep -P "$master" | head -1)
  read -r a0 h0 r0 < <(stub)
  case $name in
    idemgate) "$bin" serve --config "$OUT/idemgate.toml" >"$OUT/idemgate.log" 2>&1 & ;;
    nginx) nginx -c "$OUT/proxy.conf" -p "$OUT" & ;;
  esac
  local proxy=$!; pids+=("$proxy")
  wait_port "$port"
  load "http://127.0.0.1:$port/plain" "$WARM"
  read -r a1 h1 r1 < <(stub)
  read -r wc0 < <(io "$worker")
  local ev=context-switches,task-clock
  for e in epoll_wait epoll_ctl recvfrom read readv writev write sendfile64 accept4 close; do ev+=",syscalls:sys_enter_$e"; done
  perf stat -x, -e "$ev" -p "$worker" -o "$OUT/$name.perf" &
  local tracer=$!
  sleep 1
  load "http://127.0.0.1:$port/plain" "$N"
  kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
  read -r a2 h2 r2 < <(stub)
  read -r wc1 < <(io "$worker")
  kill "$proxy" "$master" 2>/dev/null || true
  wait "$proxy" "$master" 2>/dev/null || true
  # stub_status counts its own connections and requests too: one per read
  # (the reads after the first: a1 and a2).
  local reqs=$((r2 - r1 - 1)) conns=$((a2 - a0 - 2)) during=$((a2 - a1 - 1))
  echo "| $name | $conns | $during | $reqs | $(awk -v b=$((wc1 - wc0)) -v n="$N" 'BEGIN { printf "%.1f", b / n }') |"
  {
    echo "## $name: the upstream worker, per request (perf stat -p, N=$N; task-clock in µs)"
    awk -F, -v n="$N" '$1 ~ /^[0-9.]+$/ { v = $1 / n; if ($3 == "task-clock") v = $1 * 1000 / n; sub(/^syscalls:sys_enter_/, "", $3); printf "%s %.3f\n", $3, v }' "$OUT/$name.perf"
  } >>"$OUT/syscalls.txt"
}

echo "| proxy | upstream connections accepted (from the proxy's start) | accepted during the $N | requests seen | bytes written per request |"
echo "|---|---:|---:|---:|---:|"
measure idemgate "$ig"
measure nginx "$nx"
echo
cat "$OUT/syscalls.txt"
echo "outputs: $OUT"
