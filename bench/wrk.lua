-- wrk script for idemgate benchmarks. Environment:
--   KEYS=fresh   a new Idempotency-Key per request (unique across threads)
--   KEYS=one     one key for every request (replays)
--   KEYS=<n>     n keys, round-robin (a small working set)
--   KEYS=storm   one key of its own per path (the duplicate storm: a key
--                shared with another row would be a 422 for a new path)
--   BODY         the request body (default a small JSON order)
--   PATH_        the request path (default /orders)
-- done() prints one line, "RESULT requests=… duration_us=… non2xx=…
-- errors=… p50_us=… p99_us=… p999_us=…", that bench/run.sh parses.

local mode = os.getenv("KEYS") or "fresh"
local body = os.getenv("BODY") or '{"item":"book","qty":1}'
local path = os.getenv("PATH_") or "/orders"
local counter = 0
local prefix = ""
local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

function init(args)
  -- Unique per thread and per run: fresh keys never collide with a
  -- previous run against the same store.
  prefix = string.format("b%d-%d-%d", os.time(), tid or 0, math.random(1, 1e9))
end

local headers = {
  ["Content-Type"] = "application/json",
  ["Authorization"] = "Bearer bench",
}

function request()
  counter = counter + 1
  if mode == "fresh" then
    headers["Idempotency-Key"] = prefix .. "-" .. counter
  elseif mode == "one" then
    headers["Idempotency-Key"] = "bench-one"
  elseif mode == "storm" then
    headers["Idempotency-Key"] = "bench-storm" .. path
  elseif mode ~= "none" then
    headers["Idempotency-Key"] = "bench-set-" .. (counter % tonumber(mode))
  end
  return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
  local non2xx = summary.errors.status
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout
  io.write(string.format(
    "RESULT requests=%d duration_us=%d non2xx=%d errors=%d p50_us=%d p99_us=%d p999_us=%d\n",
    summary.requests, summary.duration, non2xx, errors,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
