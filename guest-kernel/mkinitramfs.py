#!/usr/bin/env python3
"""Writes a gzip'd newc initramfs with the agent as /init.

Written directly (no cpio(1), no mknod): entries are owned by root, mtime 0, so the image is
reproducible and building it needs no privileges. Usage: mkinitramfs.py <agent> <out.cpio.gz>
"""
import gzip
import os
import stat
import sys

DIRS = ["dev", "proc", "sys", "tmp", "run", "etc", "sbin"]
# (path, mode, major, minor): the nodes the kernel and PID 1 need before devtmpfs is mounted.
NODES = [("dev/console", stat.S_IFCHR | 0o600, 5, 1), ("dev/null", stat.S_IFCHR | 0o666, 1, 3)]


def entry(ino, name, mode, data=b"", rmajor=0, rminor=0, nlink=1):
    name_b = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmajor, rminor, len(name_b), 0]
    hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = hdr + name_b
    out += b"\0" * ((4 - len(out) % 4) % 4)
    out += data
    out += b"\0" * ((4 - len(data) % 4) % 4)
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    agent, out_path = sys.argv[1], sys.argv[2]
    with open(agent, "rb") as f:
        init = f.read()
    parts, ino = [], 1
    for d in DIRS:
        parts.append(entry(ino, d, stat.S_IFDIR | 0o755, nlink=2))
        ino += 1
    for name, mode, major, minor in NODES:
        parts.append(entry(ino, name, mode, rmajor=major, rminor=minor))
        ino += 1
    parts.append(entry(ino, "init", stat.S_IFREG | 0o755, init))
    parts.append(entry(0, "TRAILER!!!", 0))
    tmp = f"{out_path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(b"".join(parts))
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()
