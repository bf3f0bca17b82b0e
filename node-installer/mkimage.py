#!/usr/bin/env python3
"""Builds the bulkhead-node-installer image as an OCI image-layout tar, without a container engine.

The image is one layer laid out as the Containerfile's final stage lays it out:
  /usr/local/bin/bulkhead-node-installer          the entrypoint (`run` by default)
  /opt/bulkhead-artifacts/<name>                  every --artifact, flat, under the installer's names
  /usr/local/bin/bulkhead-ctl -> /opt/bulkhead-artifacts/bulkhead-ctl   (when shipped)
  /bin/busybox, /bin/sh and /usr/bin/nsenter      (--busybox: the DaemonSet restarts containerd via nsenter)
  /tmp
with ENV BULKHEAD_ARTIFACTS=/opt/bulkhead-artifacts.

Reproducible: entries sorted, owned by 0:0 with no user/group names, every mtime = --epoch (default
$SOURCE_DATE_EPOCH, else 0), gzip without name or timestamp, JSON with sorted keys. Same inputs, same
digest. `ctr images import` and `skopeo copy oci-archive:...` read the result.

Usage: mkimage.py --out FILE --ref NAME:TAG --installer PATH --artifact NAME=PATH [...]
                  [--busybox PATH] [--gzip-level 0-9] [--epoch SECONDS]
Prints the image (manifest) digest on stdout.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import time

ARTIFACT_DIR = "opt/bulkhead-artifacts"
INSTALLER = "usr/local/bin/bulkhead-node-installer"
CHUNK = 1 << 20


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class Entries:
    """The layer's entries by path: ('dir', mode) | ('file', mode, src) | ('link', target)."""

    def __init__(self):
        self.entries = {}

    def add_dirs(self, path):
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self.entries.setdefault("/".join(parts[:i]), ("dir", 0o755))

    def dir(self, path, mode=0o755):
        self.add_dirs(path)
        self.entries[path] = ("dir", mode)

    def file(self, path, src, mode=0o755):
        if not os.path.isfile(src):
            sys.exit(f"mkimage: {src} (for /{path}) is not a file")
        self.add_dirs(path)
        self.entries[path] = ("file", mode, src)

    def link(self, path, target):
        self.add_dirs(path)
        self.entries[path] = ("link", target)


def tar_info(name, epoch):
    if len(name) > 99:
        sys.exit(f"mkimage: path too long for ustar: {name}")
    info = tarfile.TarInfo(name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = epoch
    return info


def write_layer(entries, out, epoch):
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(entries.entries):
            entry = entries.entries[path]
            info = tar_info(path, epoch)
            if entry[0] == "dir":
                info.type, info.mode = tarfile.DIRTYPE, entry[1]
                tar.addfile(info)
            elif entry[0] == "link":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry[1]
                tar.addfile(info)
            else:
                info.mode, info.size = entry[1], os.path.getsize(entry[2])
                with open(entry[2], "rb") as f:
                    tar.addfile(info, f)


def add_blob(tar, data_or_path, epoch):
    """Adds a blob under blobs/sha256/; returns (digest, size)."""
    if isinstance(data_or_path, bytes):
        digest, size = hashlib.sha256(data_or_path).hexdigest(), len(data_or_path)
        info = tar_info(f"blobs/sha256/{digest}", epoch)
        info.mode, info.size = 0o644, size
        tar.addfile(info, io.BytesIO(data_or_path))
    else:
        digest, size = sha256_file(data_or_path), os.path.getsize(data_or_path)
        info = tar_info(f"blobs/sha256/{digest}", epoch)
        info.mode, info.size = 0o644, size
        with open(data_or_path, "rb") as f:
            tar.addfile(info, f)
    return f"sha256:{digest}", size


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ref", required=True, help="image name with tag, e.g. ghcr.io/org/bulkhead-node-installer:0.1.0")
    p.add_argument("--installer", required=True)
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--busybox")
    p.add_argument("--gzip-level", type=int, default=6)
    p.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
    a = p.parse_args()
    if ":" not in a.ref.rsplit("/", 1)[-1]:
        sys.exit("mkimage: --ref needs a tag (NAME:TAG)")
    tag = a.ref.rsplit(":", 1)[1]

    entries = Entries()
    entries.file(INSTALLER, a.installer)
    names = []
    for spec in a.artifact:
        name, sep, src = spec.partition("=")
        if not sep or not name or "/" in name:
            sys.exit(f"mkimage: --artifact wants NAME=PATH with a plain NAME, not {spec!r}")
        mode = 0o644 if name in ("vmlinux", "initramfs.cpio.gz", "config.toml") else 0o755
        entries.file(f"{ARTIFACT_DIR}/{name}", src, mode)
        names.append(name)
    if "bulkhead-ctl" in names:
        entries.link("usr/local/bin/bulkhead-ctl", f"/{ARTIFACT_DIR}/bulkhead-ctl")
    if a.busybox:
        entries.file("bin/busybox", a.busybox)
        entries.link("bin/sh", "busybox")
        entries.link("usr/bin/nsenter", "/bin/busybox")
    entries.dir("tmp", 0o1777)

    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".mkimage-") as work:
        layer_tar = os.path.join(work, "layer.tar")
        with open(layer_tar, "wb") as f:
            write_layer(entries, f, a.epoch)
        diff_id = "sha256:" + sha256_file(layer_tar)
        layer_gz = os.path.join(work, "layer.tar.gz")
        with open(layer_tar, "rb") as src, open(layer_gz, "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=a.gzip_level) as gz:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    gz.write(chunk)
        os.unlink(layer_tar)

        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.epoch))
        config = canonical({
            "architecture": "amd64",
            "os": "linux",
            "created": created,
            "config": {
                "Entrypoint": [f"/{INSTALLER}"],
                "Cmd": ["run"],
                "Env": [
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    f"BULKHEAD_ARTIFACTS=/{ARTIFACT_DIR}",
                ],
                "Labels": {"org.opencontainers.image.title": "bulkhead-node-installer", "org.opencontainers.image.version": tag},
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created, "created_by": "node-installer/mkimage.py"}],
        })
        tmp_out = os.path.join(work, "image.tar")
        with open(tmp_out, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            layout = b'{"imageLayoutVersion":"1.0.0"}'
            layer_digest, layer_size = add_blob(tar, layer_gz, a.epoch)
            config_digest, config_size = add_blob(tar, config, a.epoch)
            manifest = canonical({
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": layer_size}],
            })
            manifest_digest, manifest_size = add_blob(tar, manifest, a.epoch)
            index = canonical({
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [{
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": a.ref, "org.opencontainers.image.ref.name": tag},
                }],
            })
            for name, data in (("oci-layout", layout), ("index.json", index)):
                info = tar_info(name, a.epoch)
                info.mode, info.size = 0o644, len(data)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp_out, a.out)
    print(f"mkimage: {a.ref} {manifest_digest} -> {a.out} ({os.path.getsize(a.out)} bytes, "
          f"{time.monotonic() - started:.1f} s)", file=sys.stderr)
    print(manifest_digest)


if __name__ == "__main__":
    main()
