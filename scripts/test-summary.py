#!/usr/bin/env python3
"""Reads a `cargo test -- --show-output` log and prints the suite's one summary line:

    tests: N passed, N failed, N skipped

A test that printed `SKIPPED: <reason>` and passed counts as skipped (cargo counts it as
passed); one that printed SKIPPED and then failed counts as failed. Every skip must be allowed
for this host kind by the checked-in ledger (tests/skips.ledger); an unlisted skip fails the run.

Each failed test's output is repeated (its tail) before the summary line, and so is every
`RETRIED: ` line (a RunPodSandbox the harness tried again after the emulated node broke a guest's
boot: a triple fault before the agent answered, or a kernel that stopped before /init; or a test tried
again after a vCPU of its guest was found stuck in the node's KVM at a node-module address), with their count.

Exit status: 0 when nothing failed and every skip is listed, 1 otherwise.
"""
import argparse
import re
import sys

RUNNING = re.compile(r"^\s*Running (?:unittests )?\S+ \((?:.*/)?([^/()]+?)(?:-[0-9a-f]{16})?\)$")
RESULT = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed;")
BLOCK = re.compile(r"^---- (\S+) stdout ----$")
# How much of a failed test's output the summary repeats: its last lines, then its last warnings and
# errors (the shim's and VMM's lines in containerd's log, which a failing VmEnv test prints, and a
# guest kernel's fault), which are often further up than the tail reaches.
FAILURE_TAIL = 14
FAILURE_NOTABLE = 8
NOTABLE = re.compile(r"  (WARN|ERROR) |level=error|Kernel panic|BUG:|Oops:|TripleFault|ended on its own")
# anyhow's and std's backtraces: a header, then indented frames and `at` lines.
BACKTRACE_HEAD = re.compile(r"^(Stack backtrace:|stack backtrace:)$")
BACKTRACE_BODY = re.compile(r"^(\s+\S|\s*note: )")


def without_backtraces(lines):
    """The lines with every backtrace left out: the frames would fill the tail and push out the
    error message, the one line that says what failed."""
    out = []
    skipping = False
    for line in lines:
        if BACKTRACE_HEAD.match(line.strip()):
            skipping = True
            out.append("  [backtrace left out]")
            continue
        if skipping and (not line.strip() or BACKTRACE_BODY.match(line)):
            continue
        skipping = False
        out.append(line)
    return out


def parse(lines):
    """Yields (binary, test, section, output lines) for every test output block, and counts."""
    passed = failed = 0
    binary = "?"
    section = None
    current = None
    blocks = []
    for line in lines:
        line = line.rstrip("\n")
        m = RUNNING.match(line)
        if m:
            binary, section, current = m.group(1), None, None
            continue
        m = RESULT.match(line)
        if m:
            passed += int(m.group(1))
            failed += int(m.group(2))
            current = None
            continue
        if line in ("successes:", "failures:"):
            section, current = line[:-1], None
            continue
        m = BLOCK.match(line)
        if m:
            current = [binary, m.group(1), section, []]
            blocks.append(current)
            continue
        if current is not None:
            current[3].append(line)
    return passed, failed, blocks


def load_ledger(path):
    allowed = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 2)
            if len(parts) < 3:
                sys.exit(f"{path}:{n}: want '<host kind> <binary>::<test> <reason>'")
            kind, test, reason = parts
            allowed.setdefault(test, {})[kind] = reason
    return allowed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--host-kind", required=True, help="the host probe's kind: vmx, svm, pvm, unknown, absent")
    ap.add_argument("--status", type=int, default=0, help="cargo's exit status")
    args = ap.parse_args()
    with open(args.log, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines(keepends=True)
    passed, failed, blocks = parse(lines)
    allowed = load_ledger(args.ledger)
    skipped = 0
    unlisted = []
    failures = []
    for binary, test, section, output in blocks:
        if section == "failures":
            failures.append((binary, test, output))
            continue
        reasons = [l for l in output if l.startswith("SKIPPED: ")]
        if not reasons or section != "successes":
            continue  # a failed test that printed SKIPPED is counted as failed by cargo
        skipped += 1
        key = f"{binary}::{test}"
        kinds = allowed.get(key, {})
        if args.host_kind not in kinds and "*" not in kinds:
            unlisted.append(f"{key}: {reasons[0]}")
    if args.status != 0 and failed == 0:
        failed = 1  # a build failure or a crashed test binary has no "test result" line
    # Repeated at the end, where a CI excerpt (the log's tail) shows them: cargo prints the
    # failures' output in the middle of a long log, before the other test binaries run.
    for binary, test, output in failures:
        print(f"\nfailed: {binary}::{test} (its last {FAILURE_TAIL} lines at most, backtraces left out)")
        kept = [l for l in without_backtraces(output) if l.strip()]
        for line in kept[-FAILURE_TAIL:]:
            print(f"  {line[:1000]}")
        notable = [l for l in kept[:-FAILURE_TAIL] if NOTABLE.search(l)][-FAILURE_NOTABLE:]
        if notable:
            print(f"  its last {FAILURE_NOTABLE} warnings and errors at most, from further up:")
            for line in notable:
                print(f"    {line[:400]}")
    # The emulated node's kernel, where it reported trouble (tests/node/node.py): repeated too.
    for line in [l.rstrip("\n") for l in lines if l.startswith("node: kernel: ")][-20:]:
        print(line[:1000])
    # What the test harness tried again after the emulated node broke a guest (tests/integration/src/cri.rs,
    # node_kvm.rs): never hidden, always counted.
    retried = [l.rstrip("\n") for l in lines if l.startswith("RETRIED: ")]
    for line in retried:
        print(line[:1000])
    for u in unlisted:
        print(f"unlisted skip on a {args.host_kind} host: {u}")
    if unlisted:
        print(f"add a line to {args.ledger} only if the skip is right for this host kind")
    print()
    if retried:
        print(f"retried in the emulated node: {len(retried)} (guest boots or vCPUs the emulator broke)")
    print(f"tests: {passed - skipped} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed or unlisted or args.status else 0)


if __name__ == "__main__":
    main()
