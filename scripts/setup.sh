#!/usr/bin/env bash
# Installs what bulkhead needs on a Debian 12 machine and skips whatever is already there.
# Idempotent: safe to run before every `make test` / `make demo`.
set -euo pipefail

log() { printf 'setup: %s\n' "$*"; }

# Debian packages: containerd + runc + CNI plugins for the end-to-end tests, a static
# busybox for test images, protoc for the CRI client, musl for the static agent,
# gcc/libc6-dev for the static pause binary, g++ for the fuzz crate (libFuzzer), iproute2 for
# test network namespaces, openssl for the installer's TLS client test certificates, the
# guest kernel's source and build tools (guest-kernel/build-kernel.sh), and libseccomp/libcap-ng
# headers and pkg-config to build virtiofsd, and QEMU: the test-only stand-in CPU that runs the
# real guest on hosts whose /dev/kvm runs no ordinary guest (tests/integration, `bulkhead-qemu-vmm`).
APT_PACKAGES=(
  containerd runc containernetworking-plugins busybox-static protobuf-compiler
  musl-tools gcc g++ libc6-dev make file iproute2 util-linux python3 python3-venv ca-certificates openssl
  linux-source-6.12 bc bison flex libelf-dev libssl-dev xz-utils
  libseccomp-dev libcap-ng-dev pkg-config
  qemu-system-x86
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    log "missing Debian packages: ${missing[*]}; run 'make setup' as root (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  log "Debian packages present"
fi

if ! command -v cargo >/dev/null || ! command -v rustup >/dev/null; then
  log "cargo/rustup not found: install the Rust toolchain with rustup first (https://rustup.rs)" >&2
  exit 1
fi

# The static guest agent is built for musl; the VMM's test guests may use the bare-metal target.
for target in x86_64-unknown-linux-musl x86_64-unknown-none; do
  if rustup target list --installed | grep -qx "$target"; then
    log "rustup target $target present"
  else
    log "adding rustup target $target"
    rustup target add "$target"
  fi
done

for c in clippy rustfmt; do
  if ! rustup component list --installed | grep -q "^$c"; then
    log "adding rustup component $c"
    rustup component add "$c"
  fi
done

# Offline Kubernetes schema validation for the manifests (runtimeclass/validate.sh), in a
# venv outside the checkout so Debian's externally-managed Python stays untouched.
venv="${BULKHEAD_CACHE:-/var/cache/bulkhead}/venv"
if "$venv/bin/kubernetes-validate" --help >/dev/null 2>&1 && "$venv/bin/python3" -c 'import yaml' 2>/dev/null; then
  log "kubernetes-validate present in $venv"
else
  log "installing kubernetes-validate into $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate==1.37.0 pyyaml
fi

# Host tools built from their published crates into cache dirs keyed by version, then linked
# at the stable path $BULKHEAD_CACHE/bin/<tool> that tests and the shim config use:
# - virtiofsd: the vhost-user-fs backend of the VMM's virtio-fs device (and of the shim's pods);
# - vhost-device-vsock: the host side of vsock for the QEMU stand-in (tests only); it serves the
#   same hybrid-vsock Unix socket and CONNECT protocol as bulkhead-vmm.
cache="${BULKHEAD_CACHE:-/var/cache/bulkhead}"
mkdir -p "$cache/bin"
cached_crate() {
  local crate=$1 version=$2 bin=$3
  local root="$cache/$crate-$version"
  if [[ -x "$root/bin/$bin" ]]; then
    log "$crate $version present in $root"
  else
    log "building $crate $version into $root (a minute or more on 2 cores, at low priority)"
    if ! nice -n 19 cargo install "$crate" --locked --version "=$version" --root "$root.tmp"; then
      log "cargo install $crate@$version failed; if that version is gone from crates.io, move the pin in scripts/setup.sh" >&2
      rm -rf "$root.tmp"
      exit 1
    fi
    rm -rf "$root" && mv "$root.tmp" "$root"
  fi
  ln -sfn "$root/bin/$bin" "$cache/bin/$bin"
}
cached_crate virtiofsd 1.14.0 virtiofsd
cached_crate vhost-device-vsock 0.3.0 vhost-device-vsock

log "done"
