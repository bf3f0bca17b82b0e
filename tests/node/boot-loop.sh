#!/usr/bin/env bash
# Boots the real guest on bulkhead-vmm many times in an emulated node, PAR at a time, and counts how many
# reached /init: the measure of the emulator's faults (tests/node/README.md), without containerd or the shim.
#
#   tests/node/boot-loop.sh [N] [PAR]        (default 30 boots, 2 at a time)
#
# Each boot is bounded (BOOT_BUDGET s, default 60, of the node's time); a boot that did not reach /init
# keeps its serial log and the VMM's stderr in $OUT (default target/node-boot-loop). Extra node.py
# options (--cpu, --smp, --accel) go in NODE_ARGS, extra guest kernel command-line words in EXTRA_CMDLINE.
# Exit status 0 only when every boot reached /init.
set -uo pipefail
cd "$(dirname "$0")/../.."
n=${1:-30} par=${2:-2}
out=${OUT:-${CARGO_TARGET_DIR:-$PWD/target}/node-boot-loop}

if [[ ${BULKHEAD_IN_NODE:-} != 1 ]]; then
  kernel=$(guest-kernel/build-kernel.sh) || exit 1
  make -s -C guest-kernel initramfs >/dev/null || exit 1
  [[ -x target/debug/bulkhead-vmm ]] || { echo "boot-loop: build the workspace first (cargo build)" >&2; exit 1; }
  rm -rf "$out" && mkdir -p "$out"
  # shellcheck disable=SC2086 # NODE_ARGS is a list of options
  exec python3 tests/node/node.py run --out "$out" --timeout $((n * 120 + 300)) ${NODE_ARGS:-} \
    --env "GUEST_KERNEL=$kernel" --env "GUEST_INITRAMFS=$PWD/guest-kernel/build/initramfs.cpio.gz" \
    --env "BOOT_BUDGET=${BOOT_BUDGET:-60}" --env "EXTRA_CMDLINE=${EXTRA_CMDLINE:-}" -- tests/node/boot-loop.sh "$n" "$par"
fi

# In the node: its output directory is /bulkhead-node (node.py).
out=/bulkhead-node
vmm=$PWD/target/debug/bulkhead-vmm
one() {
  local i=$1 d=/var/lib/bulkhead-test/boot-$1 result=timeout
  rm -rf "$d" && mkdir -p "$d"
  cat >"$d/vm.json" <<EOF
{"kernel": "$GUEST_KERNEL", "initramfs": "$GUEST_INITRAMFS",
 "cmdline": "console=ttyS0 reboot=k panic=1 i8042.noaux no_timer_check ${EXTRA_CMDLINE:-}",
 "mem_mib": 512, "vcpus": 2, "serial_log": "$d/serial.log",
 "vsock": {"uds_path": "$d/v.sock", "guest_cid": 3}}
EOF
  "$vmm" --config "$d/vm.json" >/dev/null 2>"$d/stderr" &
  local pid=$! started=$SECONDS
  while ((SECONDS - started < BOOT_BUDGET)); do
    if ! kill -0 "$pid" 2>/dev/null; then
      result=exited
      break
    fi
    if grep -q "Run /init" "$d/serial.log" 2>/dev/null; then
      result=init
      break
    fi
    sleep 0.2
  done
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  local why
  why=$(grep -o "reason=[A-Za-z]*" "$d/stderr" | tail -n 1)
  echo "boot $i: $result after $((SECONDS - started)) s ${why}"
  if [[ $result != init ]]; then
    cp "$d/serial.log" "$out/serial.$i.log" 2>/dev/null
    cp "$d/stderr" "$out/stderr.$i.log"
  fi
  rm -rf "$d"
}
for ((i = 1; i <= n; i += par)); do
  for ((j = i; j < i + par && j <= n; j++)); do
    one "$j" &
  done
  wait
done | tee "$out/results"
reached=$(grep -c ": init after" "$out/results")
echo "boot-loop: $reached of $n boots reached /init ($par at a time)"
((reached == n))
