#!/usr/bin/env python3
"""Prints PACKAGE=VERSION, one a line, for a Debian package of one suite and every package it depends
on in that suite (Depends and Pre-Depends; the first of alternatives; virtual packages through their
first provider), leaving out the packages named with --skip.

    debian-closure.py --apt-dir DIR --suite trixie [--skip PKG ...] PACKAGE=VERSION ...

`apt-cache depends --recurse` would take each dependency's candidate, the newest of every suite in
the sources list; here each one is asked for in the suite itself (`apt-cache show PKG/SUITE`). The
roots are named with their version, so a pin Debian dropped fails here with the package's name.
DIR is the private apt directory setup keeps (its sources.list, lists/ and cache/).
"""
import argparse
import re
import subprocess
import sys


def show(apt_opts, spec):
    done = subprocess.run(["apt-cache", *apt_opts, "show", spec], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    record = done.stdout.split("\n\n")[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^([\w-]+): (.*)$", record, re.M)}


def provider(apt_opts, name):
    done = subprocess.run(["apt-cache", *apt_opts, "showpkg", name], capture_output=True, text=True)
    m = re.search(r"^Reverse Provides: *\n(\S+)", done.stdout, re.M)
    return m.group(1) if m else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apt-dir", required=True)
    parser.add_argument("--suite", required=True)
    parser.add_argument("--skip", action="append", default=[])
    parser.add_argument("roots", nargs="+", metavar="PACKAGE=VERSION")
    opts = parser.parse_args()
    d = opts.apt_dir
    apt_opts = ["-o", f"Dir::Etc::sourcelist={d}/sources.list", "-o", "Dir::Etc::sourceparts=-",
                "-o", f"Dir::State::Lists={d}/lists", "-o", f"Dir::Cache={d}/cache"]
    roots = opts.roots
    found = {}
    todo = []
    for root in roots:
        name, _, version = root.partition("=")
        fields = show(apt_opts, root)
        if fields is None:
            sys.exit(f"debian-closure: {root} is not in Debian's archive any more")
        found[name] = fields["Version"]
        todo.append(fields)
    skip = set(opts.skip)
    seen = set(found) | skip
    while todo:
        fields = todo.pop()
        for key in ("Pre-Depends", "Depends"):
            for dep in filter(None, (d.strip() for d in fields.get(key, "").split(","))):
                name = dep.split("|")[0].split()[0].split(":")[0]
                if name in seen:
                    continue
                seen.add(name)
                got = show(apt_opts, f"{name}/{opts.suite}")
                if got is None:
                    real = provider(apt_opts, name)
                    if real is None or real in seen:
                        continue
                    seen.add(real)
                    name, got = real, show(apt_opts, f"{real}/{opts.suite}")
                    if got is None:
                        sys.exit(f"debian-closure: {dep} has no package in {opts.suite}")
                found[name] = got["Version"]
                todo.append(got)
    for name in sorted(found):
        print(f"{name}={found[name]}")


if __name__ == "__main__":
    main()
