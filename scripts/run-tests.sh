#!/usr/bin/env bash
# Runs the whole cargo test suite and ends with one plain summary line:
#   "tests: N passed, N failed, N skipped"
# where "skipped" counts tests that printed a `SKIPPED: <reason>` line (cargo counts them
# as passed, so they are moved out of "passed" here). Exit status is cargo's.
set -uo pipefail

log=$(mktemp)
trap 'rm -f "$log"' EXIT

# libtest hides a passing test's stdout; --show-output prints it, so SKIPPED lines show.
cargo test --workspace --no-fail-fast "$@" -- --show-output 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The fuzz crate is its own workspace: run its seed and regression tests so it keeps
# compiling against the decoders it fuzzes.
cargo test --manifest-path fuzz/Cargo.toml --no-fail-fast -- --show-output 2>&1 | tee -a "$log"
fuzz_status=${PIPESTATUS[0]}
((status == 0)) && status=$fuzz_status

passed=$(awk '/^test result:/ { for (i = 1; i <= NF; i++) if ($(i+1) ~ /^passed/) s += $i } END { print s + 0 }' "$log")
failed=$(awk '/^test result:/ { for (i = 1; i <= NF; i++) if ($(i+1) ~ /^failed/) s += $i } END { print s + 0 }' "$log")
skipped=$(grep -c '^SKIPPED: ' "$log" || true)
if ((status != 0 && failed == 0)); then
  failed=1 # a build failure or a crashed test binary has no "test result" line
fi
echo
echo "tests: $((passed - skipped)) passed, ${failed} failed, ${skipped} skipped"
exit "$status"
