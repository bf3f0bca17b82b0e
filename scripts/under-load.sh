#!/usr/bin/env bash
# The suite's stability check (issue 20, "stable under load"): while a CPU hog spins on one core,
# the integration and KVM test binaries (bulkhead-integration, bulkhead-vmm) must pass RUNS times
# in a row (default 3). Prints each run's wall time and its summary line; stops at the first
# failing run and exits 1. Not part of `make test` (it triples the suite's time); run it after a
# change to timing-sensitive code: `make under-load` or `scripts/under-load.sh [RUNS]`.
# The workspace must be built (`make build`, `make kernel`): the end-to-end tests start the
# freshly built binaries.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-3}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "under-load: RUNS must be a positive integer, got '$runs'" >&2; exit 2; }
cores=$(nproc)
hog_core=$((cores - 1))

# Each run's whole log stays for the post-mortem of a failure.
logs=${CARGO_TARGET_DIR:-target}/under-load
mkdir -p "$logs"
hog=
cleanup() {
  # Only the hog this script started, by PID.
  [[ -n $hog ]] && kill "$hog" 2>/dev/null && wait "$hog" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Build before the hog starts: the runs measure tests, not compilation.
cargo test -p bulkhead-integration -p bulkhead-vmm --no-run >/dev/null 2>&1 ||
  { echo "under-load: the test binaries do not build (cargo test --no-run)" >&2; exit 1; }

taskset -c "$hog_core" bash -c 'while :; do :; done' &
hog=$!
echo "under-load: CPU hog pid $hog on core $hog_core of $cores"

vmm=${CARGO_TARGET_DIR:-target}/debug/bulkhead-vmm
kind=$("$vmm" --probe 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["kvm"])' 2>/dev/null)
kind=${kind:-unprobed}

declare -a walls=()
for ((i = 1; i <= runs; i++)); do
  log=$logs/run-$i.log
  start=$(date +%s)
  cargo test -p bulkhead-integration -p bulkhead-vmm --no-fail-fast -- --show-output >"$log" 2>&1
  status=$?
  wall=$(($(date +%s) - start))
  walls+=("$wall")
  summary=$(scripts/test-summary.py --log "$log" --ledger tests/skips.ledger --host-kind "$kind" --status "$status" 2>&1)
  ok=$?
  echo "under-load: run $i/$runs: ${wall} s: $(tail -n 1 <<<"$summary")"
  if ((ok != 0)); then
    grep -E '^test .* FAILED' "$log" | head -n 40
    echo "under-load: run $i failed under load (host kind $kind; log $log); wall times so far: ${walls[*]} s" >&2
    exit 1
  fi
done
echo "under-load: $runs runs passed under a one-core CPU hog (host kind $kind); wall times: ${walls[*]} s"
