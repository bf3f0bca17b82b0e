#!/usr/bin/env python3
"""Fails when the kernel's final .config lost an option that the fragment sets.

olddefconfig silently drops an option whose dependencies are not met (IPC_NS without SYSVIPC,
say). Run after it: every `CONFIG_X=value` line of the fragment must be in .config with that
value, and every `CONFIG_X=n` must be unset there. Prints one line per lost option, naming it,
what the fragment asked and what the kernel got, and exits 1.
"""
import re
import sys

LINE = re.compile(r"^(CONFIG_[A-Za-z0-9_]+)=(.*)$")
UNSET = re.compile(r"^# (CONFIG_[A-Za-z0-9_]+) is not set$")


def read_config(path):
    values = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            m = LINE.match(line)
            if m:
                values[m.group(1)] = m.group(2)
            elif UNSET.match(line):
                values[UNSET.match(line).group(1)] = "n"
    return values


def lost(fragment, final):
    out = []
    for name, want in fragment.items():
        got = final.get(name, "n")
        if got != want:
            out.append((name, want, got))
    return out


def main(argv):
    if len(argv) != 3:
        print(f"usage: {argv[0]} FRAGMENT DOTCONFIG", file=sys.stderr)
        return 2
    fragment, final = read_config(argv[1]), read_config(argv[2])
    missing = lost(fragment, final)
    for name, want, got in missing:
        shown = "unset" if got == "n" else got
        print(f"guest-kernel: {name}={want} from {argv[1]} did not survive olddefconfig "
              f"(the kernel has it {shown}): a dependency is missing", file=sys.stderr)
    if missing:
        print(f"guest-kernel: {len(missing)} option(s) of the fragment lost; add what they depend on",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
