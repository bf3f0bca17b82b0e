#!/usr/bin/env bash
# The emulated-node stage of `make test`: the full path on bulkhead-vmm (real guest kernel, agent, containerd
# and shim) inside a QEMU TCG node with AMD-V, cgroup v2 and systemd as PID 1 (tests/node/node.py).
#
#   scripts/node-stage.sh [--all]
#
# Runs the `_on_bulkhead_vmm` tests of the listed integration binaries in one node, one test at a time, and
# prints their libtest output (for scripts/test-summary.py) and one line of its own. Without --all it runs the
# set `make test` keeps within CI's time (NODE_TESTS below); with --all (`make test-node`), every binary.
# Exit status: 0 when every test ran and passed there.
set -uo pipefail
cd "$(dirname "$0")/.."

# Each entry: an integration test binary and the filter of what runs in the node.
NODE_TESTS=(
  # The vCPU resize twin is the one test whose guest has two vCPUs, which the emulator sometimes stops
  # (tests/node/README.md): it retries once on that fault alone, told apart by tests/integration's node_kvm.
  vm_e2e::_on_bulkhead_vmm
  network_e2e::_on_bulkhead_vmm
  emptydir_e2e::_on_bulkhead_vmm
  containerd_2x::_on_bulkhead_vmm
  # The namespace backend on cgroup v2 (the host's run is v1): its pods, cgroups, OOM kills and
  # kubelet's systemd slice, and its agent's confinement in a user namespace of its own.
  shim_e2e::
  ns_confinement::
)
NODE_TESTS_MORE=(
  vm_e2e_on_containerd_2_1::_on_bulkhead_vmm
  network_e2e_on_containerd_2_1::_on_bulkhead_vmm
)
tests=("${NODE_TESTS[@]}")
if [[ ${1:-} == --all ]]; then
  tests+=("${NODE_TESTS_MORE[@]}")
fi
# NODE_TESTS_ONLY="binary::filter ...": just those (while working on one test).
if [[ -n ${NODE_TESTS_ONLY:-} ]]; then
  read -r -a tests <<<"$NODE_TESTS_ONLY"
fi

say() { printf 'node stage: %s\n' "$*"; }
started=$(date +%s)

# The guest kernel and initramfs, built here: inside the node a kernel hash and a cargo build would take
# minutes of emulation.
kernel=$(guest-kernel/build-kernel.sh) || { say "building the guest kernel failed"; exit 1; }
make -s -C guest-kernel initramfs >/dev/null || { say "make -C guest-kernel initramfs failed"; exit 1; }
initramfs=$PWD/guest-kernel/build/initramfs.cpio.gz

# The test binaries, as `cargo test` built them for the host's run: the newest of each name (a clean clone has
# one). Found on disk rather than through cargo, whose lock a concurrent cargo command may hold for long.
deps=${CARGO_TARGET_DIR:-$PWD/target}/debug/deps
specs=()
for t in "${tests[@]}"; do
  name=${t%%::*} filter=${t#*::}
  exe=$(find "$deps" -maxdepth 1 -type f -executable -regextype egrep -regex ".*/${name}-[0-9a-f]{16}" \
    -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -n 1 | cut -d' ' -f2-)
  if [[ -z $exe ]]; then
    say "no built test binary $name in $deps (cargo test -p bulkhead-integration --no-run)"
    exit 1
  fi
  specs+=("$exe::$filter")
done

out=${CARGO_TARGET_DIR:-$PWD/target}/node
rm -rf "$out" && mkdir -p "$out"
envs=(--env "BULKHEAD_GUEST_KERNEL=$kernel" --env "BULKHEAD_GUEST_INITRAMFS=$initramfs")
for v in BULKHEAD_REQUIRE_E2E BULKHEAD_CONTAINERD RUST_LOG; do
  [[ -n ${!v:-} ]] && envs+=(--env "$v=${!v}")
done
say "${#specs[@]} test binaries in the emulated node (QEMU TCG, AMD-V, cgroup v2, systemd as PID 1); its files in $out"
python3 tests/node/node.py tests --out "$out" --timeout "${NODE_TIMEOUT:-2400}" "${envs[@]}" -- "${specs[@]}" \
  | tee "$out/stage.log"
status=${PIPESTATUS[0]}
read -r passed failed < <(python3 - "$out/stage.log" <<'EOF'
import re, sys
p = f = 0
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"^test result: \w+\. (\d+) passed; (\d+) failed;", line)
    if m:
        p += int(m.group(1)); f += int(m.group(2))
print(p, f)
EOF
)
say "ran $(( ${passed:-0} + ${failed:-0} )) tests in the emulated node on bulkhead-vmm: ${passed:-0} passed, ${failed:-0} failed, node status $status, $(( $(date +%s) - started )) s"
if ((status != 0)) || [[ ${passed:-0} == 0 ]]; then
  exit 1
fi
