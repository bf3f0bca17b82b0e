#!/usr/bin/env bash
# Runs the whole cargo test suite and ends with one plain summary line:
#   "tests: N passed, N failed, N skipped"
# "skipped" counts passing tests that printed a `SKIPPED: <reason>` line; each such skip must be
# allowed for this host kind (the host probe, `bulkhead-vmm --probe`) by tests/skips.ledger, or
# the run fails. A test that printed SKIPPED and then failed counts as failed.
# The containerd matrix needs nothing here: the end-to-end suites run on the run's containerd
# (BULKHEAD_CONTAINERD, default the system's 1.6), and their `*_on_containerd_<x>_<y>` twin test
# binaries (tests/integration/tests/) run the same tests on 1.7 and 2.1 from `make setup`.
set -uo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT

vmm=${CARGO_TARGET_DIR:-target}/debug/bulkhead-vmm
probe() { "$vmm" --probe 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["kvm"])' 2>/dev/null; }
kind=$(probe)
# Where this host's /dev/kvm runs no ordinary guest (PVM here), the real guest on bulkhead-vmm runs in the
# emulated node instead (scripts/node-stage.sh, after the host's run): the host's run leaves those tests out.
host_args=()
node_stage=
if [[ $kind != vmx && $kind != svm ]]; then
  host_args=(--skip _on_bulkhead_vmm)
  node_stage=1
fi

# libtest hides a passing test's stdout; --show-output prints it, so SKIPPED lines show.
cargo test --workspace --no-fail-fast "$@" -- --show-output "${host_args[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The fuzz crate is its own workspace: run its seed and regression tests so it keeps
# compiling against the decoders it fuzzes. It builds into the main target dir, whose dependency
# artifacts it shares (a second target dir cost CI several GB of disk).
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target} cargo test --manifest-path fuzz/Cargo.toml --no-fail-fast -- --show-output 2>&1 | tee -a "$log"
fuzz_status=${PIPESTATUS[0]}
((status == 0)) && status=$fuzz_status

if [[ -n $node_stage ]]; then
  scripts/node-stage.sh ${BULKHEAD_NODE_ALL:+--all} 2>&1 | tee -a "$log"
  node_status=${PIPESTATUS[0]}
  ((status == 0)) && status=$node_status
fi

if [[ -z $kind ]]; then
  echo "run-tests: cannot run the host probe ($vmm --probe); is the workspace built?" >&2
  kind=unprobed
fi
echo "run-tests: host kind $kind"
scripts/test-summary.py --log "$log" --ledger tests/skips.ledger --host-kind "$kind" --status "$status"
