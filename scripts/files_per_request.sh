#!/usr/bin/env bash
# The src/ files whose code runs while idemgate serves one protected request
# (a new key on SQLite, POST /orders to the demo upstream), found by
# callgrind: counters are zeroed after a warm-up request so one-time
# initialisation is left out. Prints the files in path order and their count.
#   scripts/files_per_request.sh [path/to/debug/idemgate]   (default target/debug/idemgate)
set -euo pipefail
bin=$(realpath "${1:-target/debug/idemgate}")
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up=$(free_port) px=$(free_port)
cat >"$tmp/c.toml" <<TOML
[server]
listen = "127.0.0.1:$px"
upstream = "http://127.0.0.1:$up"
[store]
backend = "sqlite"
path = "$tmp/s.db"
[[route]]
methods = ["POST"]
path = "/orders"
TOML
"$bin" demo-upstream --listen "127.0.0.1:$up" >/dev/null 2>&1 &
valgrind --tool=callgrind --callgrind-out-file="$tmp/cg.out" "$bin" serve --config "$tmp/c.toml" >"$tmp/log" 2>&1 &
vg=$!
for _ in $(seq 240); do curl -fs -o /dev/null "http://127.0.0.1:$px/" -X GET 2>/dev/null && break; sleep 0.5; done
post() { curl -s -o /dev/null -w '%{http_code}\n' -X POST "http://127.0.0.1:$px/orders" \
  -H "Idempotency-Key: $1" -H 'Authorization: Bearer t' -H 'Content-Type: application/json' -d '{"item":"a"}'; }
post warm-up >/dev/null
sleep 1
callgrind_control -z "$vg" >/dev/null
echo "status of the measured request: $(post measured)" >&2
callgrind_control -d "$vg" >/dev/null
dump=$(ls "$tmp"/cg.out.* | tail -1)
root=$(cd "$(dirname "$bin")/../.." && pwd)
callgrind_annotate --threshold=100 "$dump" 2>/dev/null |
  grep -o "$root/src/[^:]*\.rs" | sed "s|$root/||" | sort -u | tee "$tmp/files"
echo "$(wc -l <"$tmp/files") files"
