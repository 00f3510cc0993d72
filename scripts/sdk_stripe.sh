#!/usr/bin/env bash
# The official Stripe Node library (npm `stripe`, 23.x) through idemgate on
# routes with `errors = "stripe"`: 400, 409 and 422 raise as the library's
# errors with the right status, type and code, and its retries follow
# Stripe-Should-Retry (scripts/sdk/stripe-node.mjs). Not in the default
# test command: it downloads the package from the npm registry.
#   scripts/sdk_stripe.sh [path/to/idemgate]   (default: target/debug/idemgate, built if absent)
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/debug/idemgate}"
[ -x "$bin" ] || cargo build --quiet --bin idemgate
command -v node >/dev/null || { echo "scripts/sdk_stripe.sh: needs node and npm" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
npm install --silent --prefix "$tmp" stripe@23 >&2
cp scripts/sdk/*.mjs "$tmp/"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up=$(free_port) px=$(free_port)
cat >"$tmp/idemgate.toml" <<TOML
[server]
listen = "127.0.0.1:$px"
upstream = "http://127.0.0.1:$up"
[store]
backend = "sqlite"
path = "$tmp/store.db"
[log]
level = "warn"
[defaults]
errors = "stripe"
[[route]]
methods = ["POST"]
path = "/v1/customers"
[[route]]
methods = ["POST"]
path = "/v1/charges"
key_header = "Order-Key"
TOML
node "$tmp/upstream.mjs" "$up" &
"$bin" serve --config "$tmp/idemgate.toml" &
for _ in $(seq 100); do
  curl -fs -o /dev/null "http://127.0.0.1:$up/hits" && curl -s -o /dev/null "http://127.0.0.1:$px/" && break
  sleep 0.1
done
node "$tmp/stripe-node.mjs" "$px" "http://127.0.0.1:$up/hits"
