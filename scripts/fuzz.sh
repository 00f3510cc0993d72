#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ (cargo-fuzz, libFuzzer, AddressSanitizer,
# debug assertions) and runs each for a bounded time, one after another.
# Fails on the first crash, leak, timeout or broken property; libFuzzer
# saves the input that did it under fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   # default 60 s, every target
#
# Targets: key, path, config, codec, redis_value, fingerprint, canonical_json (see the
# comment at the top of each fuzz/fuzz_targets/*.rs). New inputs that
# reach new code go to fuzz/corpus/<target>/ (not committed); the seeds in
# fuzz/seeds/<target>/ and the dictionaries in fuzz/dict/ are.
#
# Needs cargo-fuzz (installed from crates.io when missing) and a nightly
# compiler; without one, the installed stable compiler is used with
# RUSTC_BOOTSTRAP=1. FUZZ_TARGET_DIR sets the build directory (default
# fuzz/target: the flags differ from a normal build's, so share none).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(key path config codec redis_value fingerprint canonical_json)
fi
case "$seconds" in
  ''|*[!0-9]*) echo "scripts/fuzz.sh: SECONDS_PER_TARGET must be a number, not '$seconds'" >&2; exit 64 ;;
esac

say() { echo "scripts/fuzz.sh: $*" >&2; }

if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

cargo_fuzz=(cargo fuzz)
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  cargo_fuzz=(cargo +nightly fuzz)
else
  say "no nightly toolchain: using stable with RUSTC_BOOTSTRAP=1"
  export RUSTC_BOOTSTRAP=1
fi

target_dir="${FUZZ_TARGET_DIR:-fuzz/target}"
"${cargo_fuzz[@]}" build --target-dir "$target_dir" >&2

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
  dict=()
  [ -f "fuzz/dict/$t.dict" ] && dict=("-dict=fuzz/dict/$t.dict")
  say "$t: ${seconds}s"
  if ! "${cargo_fuzz[@]}" run --target-dir "$target_dir" "$t" "fuzz/corpus/$t" "${seeds[@]}" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
      -print_final_stats=1 "${dict[@]}" 2>&1 | tee "$logs/$t.log" | { grep -E '^(#[0-9]+ +DONE|Done )' || true; } >&2 \
     || ! grep -q '^Done ' "$logs/$t.log"; then
    say "$t FAILED: see the output below and fuzz/artifacts/$t/"
    tail -n 60 "$logs/$t.log" | cut -c1-300 >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$t.log")
  cov=$(grep -oE 'cov: [0-9]+' "$logs/$t.log" | tail -n 1)
  summary+=("$t: ${runs:-?} runs in ${seconds}s, ${cov:-cov: ?}, no crash")
done
printf 'scripts/fuzz.sh: %s\n' "${summary[@]}" >&2
