#!/usr/bin/env bash
# Boots the real guest on bulkhead-vmm many times in an emulated node, PAR at a time, and counts how many
# reached /init: the measure of the emulator's faults (tests/node/README.md), without containerd or the shim.
#
#   tests/node/boot-loop.sh [N] [PAR]        (default 30 boots, 2 at a time)
#
# Each boot is bounded (BOOT_BUDGET s, default 60, of the node's time); a boot that did not reach /init
# keeps its serial log and the VMM's stderr in $OUT (default target/node-boot-loop). Extra node.py
# options (--cpu, --smp, --accel) go in NODE_ARGS, extra guest kernel command-line words in EXTRA_CMDLINE.
# HOLD=S keeps each guest S s (of the node's time) once its agent listens, dialling the agent over vsock
# every second as the shim would, and counts a guest whose console reports a stall (RCU, soft lockup) or whose
# agent left a dial unanswered. For such a guest (at the first unanswered dial), and for one that never reached
# /init, the VMM's threads (state, wait channel, kernel stack) and the
# node's KVM counters are saved beside its log, twice, 3 s apart, to tell a vCPU blocked in the VMM from one
# spinning in the guest. VCPUS sets the guest's vCPUs (2),
# MEM_MIB its memory (512); BALLOON=1 gives it the balloon with free page reporting, as the shim's VMs have.
# Exit status 0 only when every boot reached /init (and, with HOLD, none stalled).
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
    --env "BOOT_BUDGET=${BOOT_BUDGET:-60}" --env "EXTRA_CMDLINE=${EXTRA_CMDLINE:-}" \
    --env "HOLD=${HOLD:-0}" --env "VCPUS=${VCPUS:-2}" --env "MEM_MIB=${MEM_MIB:-512}" --env "BALLOON=${BALLOON:-0}" \
    -- tests/node/boot-loop.sh "$n" "$par"
fi

# In the node: its output directory is /bulkhead-node (node.py).
out=/bulkhead-node
vmm=$PWD/target/debug/bulkhead-vmm
one() {
  local i=$1 d=/var/lib/bulkhead-test/boot-$1 result=timeout
  rm -rf "$d" && mkdir -p "$d"
  local balloon=""
  [[ ${BALLOON:-0} == 1 ]] && balloon=', "balloon": {"free_page_reporting": true}'
  cat >"$d/vm.json" <<EOF
{"kernel": "$GUEST_KERNEL", "initramfs": "$GUEST_INITRAMFS",
 "cmdline": "console=ttyS0 reboot=k panic=1 i8042.noaux no_timer_check ${EXTRA_CMDLINE:-}",
 "mem_mib": ${MEM_MIB:-512}, "vcpus": ${VCPUS:-2}, "serial_log": "$d/serial.log",
 "vsock": {"uds_path": "$d/v.sock", "guest_cid": 3}$balloon}
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
  if [[ $result == init ]] && ((${HOLD:-0} > 0)); then
    result=$(hold "$pid" "$d" "$i")
  elif [[ $result == timeout ]]; then
    { threads "$pid"; sleep 3; echo "==== 3 s later"; threads "$pid"; } >"$out/threads.$i.log" 2>&1
  fi
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  local why
  why=$(grep -o "reason=[A-Za-z]*" "$d/stderr" | tail -n 1)
  echo "boot $i: $result after $((SECONDS - started)) s ${why}"
  if [[ $result != init && $result != init+held* ]]; then
    cp "$d/serial.log" "$out/serial.$i.log" 2>/dev/null
    cp "$d/stderr" "$out/stderr.$i.log"
  fi
  rm -rf "$d"
}
# What a stalled guest's VMM is doing: each thread's state and where it waits, and KVM's exit counters.
threads() {
  local pid=$1 t
  for t in /proc/"$pid"/task/*; do
    echo "== $(cat "$t/comm") tid ${t##*/} state $(awk '{print $3}' "$t/stat") wchan $(cat "$t/wchan")"
    cat "$t/stack" 2>/dev/null
  done
  local vm
  for vm in /sys/kernel/debug/kvm/"$pid"-*; do
    grep -H . "$vm"/* "$vm"/vcpu*/* 2>/dev/null
  done
  # What a vCPU that runs but makes no progress exits for: KVM's exits and the instructions it
  # emulates (bytes and guest RIP), a fifth of a second of them (the node's other VMs' too:
  # the lines name the vCPU thread).
  local t=/sys/kernel/tracing
  [[ -d $t/events/kvm ]] || t=/sys/kernel/debug/tracing
  if [[ -d $t/events/kvm ]]; then
    echo >"$t/trace"
    echo 1 >"$t/events/kvm/kvm_exit/enable"
    echo 1 >"$t/events/kvm/kvm_emulate_insn/enable"
    sleep 0.2
    echo 0 >"$t/events/kvm/kvm_exit/enable"
    echo 0 >"$t/events/kvm/kvm_emulate_insn/enable"
    echo "== kvm trace (last 60 lines)"
    tail -n 60 "$t/trace"
    # The node's own kernel symbol at each emulated RIP, if any: a guest RIP that is a node address (its
    # modules' text) says the guest's saved state holds the node's, which only the emulator can have put there.
    local rip
    for rip in $(grep -o "kvm_emulate_insn: [0-9a-f]*:[0-9a-f]*" "$t/trace" | cut -d: -f3 | sort -u | head -n 5); do
      echo "== emulated RIP $rip in the node's kernel: $(node_symbol "$rip")"
    done
  fi
}
# The node kernel's symbol at or below address $1 (hex), from /proc/kallsyms, or "none" within 1 MiB.
node_symbol() {
  python3 - "$1" <<'PY'
import sys
rip, best = int(sys.argv[1], 16), None
with open("/proc/kallsyms") as f:
    for line in f:
        p = line.split()
        a = int(p[0], 16)
        if a <= rip and (best is None or a > best[0]):
            best = (a, p[2], p[3] if len(p) > 3 else "")
print(f"{best[1]}+{rip - best[0]:#x} {best[2]}".strip() if best and rip - best[0] < 1 << 20 else "none")
PY
}
# Dials the agent as the shim does (hybrid vsock: "CONNECT <port>"); prints what came back.
dial() {
  timeout 5 python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect(sys.argv[1])
s.sendall(b"CONNECT 1024\n"); print(s.recv(64).decode(errors="replace").strip() or "closed")' "$1" 2>&1 | tail -n 1
}
hold() {
  local pid=$1 d=$2 i=$3 started=$SECONDS dials=0 answered=0
  while ((SECONDS - started < BOOT_BUDGET)) && ! grep -q "port=1024" "$d/serial.log"; do sleep 0.2; done
  started=$SECONDS
  while ((SECONDS - started < HOLD)); do
    kill -0 "$pid" 2>/dev/null || { echo exited; return; }
    if grep -qE "rcu: INFO|soft lockup|hung_task|BUG:" "$d/serial.log"; then
      { threads "$pid"; sleep 3; echo "==== 3 s later"; threads "$pid"; } >"$out/threads.$i.log" 2>&1
      echo "stall (dials $answered/$dials answered)"
      return
    fi
    dials=$((dials + 1))
    if [[ $(dial "$d/v.sock") == OK* ]]; then
      answered=$((answered + 1))
    elif [[ ! -e $out/threads.$i.log ]]; then
      # The first dial the agent did not answer: what the VMM was doing then.
      { threads "$pid"; sleep 3; echo "==== 3 s later"; threads "$pid"; } >"$out/threads.$i.log" 2>&1
    fi
    sleep 1
  done
  if ((answered < dials)); then
    echo "unanswered (dials $answered/$dials answered)"
  else
    echo "init+held ${HOLD}s (dials $answered/$dials answered)"
  fi
}
for ((i = 1; i <= n; i += par)); do
  for ((j = i; j < i + par && j <= n; j++)); do
    one "$j" &
  done
  wait
done | tee "$out/results"
reached=$(grep -cE ": (init|stall|unanswered)" "$out/results")
stalled=$(grep -cE ": (stall|unanswered)" "$out/results")
echo "boot-loop: $reached of $n boots reached /init ($par at a time); $stalled stalled or left a dial unanswered"
((reached == n && stalled == 0))
