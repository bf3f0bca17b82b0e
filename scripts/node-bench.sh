#!/usr/bin/env bash
# `make bench-node`: the CRI warm-start benchmark with the real guest on bulkhead-vmm, in the
# emulated AMD-V node (tests/node/node.py). Warm (restored from a template) against cold (booted),
# RunPodSandbox to a container's first ExecSync, host-network pods, a few pods per handler: the
# node emulates the guest twice, so its figures compare warm with cold in one run and nothing else.
#
#   scripts/node-bench.sh
#
# BULKHEAD_BENCH_PODS (default 3) and BULKHEAD_BENCH_NETWORK (default host) size the run;
# NODE_TIMEOUT bounds the node (default 3600 s). Exit status: the bench's.
set -uo pipefail
cd "$(dirname "$0")/.."
say() { printf 'node bench: %s\n' "$*"; }

kernel=$(guest-kernel/build-kernel.sh) || { say "building the guest kernel failed"; exit 1; }
make -s -C guest-kernel initramfs >/dev/null || { say "make -C guest-kernel initramfs failed"; exit 1; }
initramfs=$PWD/guest-kernel/build/initramfs.cpio.gz
# Release shim, agent and VMM, as `make bench` compares them; then the bench binary itself.
cargo build -q --release -p bulkhead-shim -p bulkhead-agent -p bulkhead-vmm || { say "release build failed"; exit 1; }
exe=$(cargo bench -q -p bulkhead-benches --bench cri_warm_start --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cri_warm_start" and m.get("executable"):
        print(m["executable"])')
[[ -x $exe ]] || { say "no cri_warm_start bench binary (cargo bench -p bulkhead-benches --no-run)"; exit 1; }

out=${CARGO_TARGET_DIR:-$PWD/target}/node-bench
rm -rf "$out" && mkdir -p "$out"
say "cri_warm_start in the emulated node (QEMU TCG, AMD-V, cgroup v2, systemd as PID 1); its files in $out"
python3 tests/node/node.py run --out "$out" --timeout "${NODE_TIMEOUT:-3600}" \
  --env "BULKHEAD_GUEST_KERNEL=$kernel" --env "BULKHEAD_GUEST_INITRAMFS=$initramfs" \
  --env "BULKHEAD_BENCH_PODS=${BULKHEAD_BENCH_PODS:-3}" --env "BULKHEAD_BENCH_NETWORK=${BULKHEAD_BENCH_NETWORK:-host}" \
  --env "BULKHEAD_BENCH_GUESTS=real" -- "$exe" --bench cri_warm_start
status=$?
say "node status $status"
exit $status
