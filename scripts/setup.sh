#!/usr/bin/env bash
# Installs what bulkhead needs on a Debian 12 machine and skips whatever is already there.
# Idempotent: safe to run before every `make test` / `make demo`.
set -euo pipefail

log() { printf 'setup: %s\n' "$*"; }

# Debian packages: containerd + runc + CNI plugins for the end-to-end tests, a static
# busybox for test images, protoc for the CRI client, musl for the static agent (strip, binutils),
# gcc/libc6-dev for the static pause binary, g++ for the fuzz crate (libFuzzer), iproute2 for
# test network namespaces, openssl for the installer's TLS client test certificates, the
# guest kernel's source and build tools (guest-kernel/build-kernel.sh), and libseccomp/libcap-ng
# headers and pkg-config to build virtiofsd, and QEMU: the test-only stand-in CPU that runs the
# real guest on hosts whose /dev/kvm runs no ordinary guest (tests/integration, `bulkhead-qemu-vmm`);
# e2fsprogs for mkfs.ext4, which the shim runs to give a size-limited emptyDir its own filesystem;
# kmod for the emulated node (tests/node): depmod for its kernel's modules, and modprobe inside it.
APT_PACKAGES=(
  containerd runc containernetworking-plugins busybox-static protobuf-compiler
  musl-tools gcc g++ libc6-dev binutils make file iproute2 util-linux e2fsprogs python3 python3-venv ca-certificates openssl
  linux-source-6.12 bc bison flex libelf-dev libssl-dev xz-utils
  libseccomp-dev libcap-ng-dev pkg-config
  qemu-system-x86 kmod
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

# Test-only containerd lines beside the system's 1.6 (tests/integration/src/containerd.rs picks one per test:
# BULKHEAD_CONTAINERD=1.6|1.7|2.1): Debian's own packages of newer suites, fetched with apt through a private
# sources list, lists and cache under $cache/apt, and unpacked with dpkg-deb -x into $cache/<package>-<version>/.
# Nothing is installed: the system's sources, package lists and packages stay as they are. Each version is fetched
# once, keyed by version; $cache/<package>-<line> links to the pinned one and is what the tests use.
# Move a pin here when Debian drops that version (setup says so); the tests print the version they run on.
CONTAINERD_17=1.7.24~ds1-6+deb13u1 # trixie
CONTAINERD_21=2.1.9+ds1-5          # sid
RUNC_13=1.3.6+ds1-1                # sid: containerd 2.1's tested runc (its script/setup/runc-version)
DEBIAN_MIRROR=${BULKHEAD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
apt_dir="$cache/apt"
apt_opts=(
  -o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=-
  -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "Dir::Cache::archives=$apt_dir/archives"
)
apt_updated=
private_apt_update() {
  [[ -n $apt_updated ]] && return
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache" "$apt_dir/archives/partial" "$apt_dir/download"
  # bookworm only for patchelf (below), built for this system's libraries.
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg suite
  : >"$apt_dir/sources.list"
  for suite in bookworm trixie sid; do
    echo "deb [signed-by=$keyring] $DEBIAN_MIRROR $suite main" >>"$apt_dir/sources.list"
  done
  # apt downloads as _apt where it can: let it write its partial dirs.
  if id _apt >/dev/null 2>&1; then
    chown _apt:root "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/download"
  fi
  log "updating the private package lists in $apt_dir (bookworm, trixie, sid)"
  apt-get "${apt_opts[@]}" -q update >/dev/null
  apt_updated=1
}

# Downloads package=version (or package/suite) into $apt_dir/download and prints the .deb's path. A pinned
# version Debian no longer carries fails setup with how to move the pin.
fetch_deb() {
  local want=$1 pin_var=$2 name=${1%%[=/]*}
  private_apt_update
  rm -f "$apt_dir/download/${name}_"*.deb
  if ! (cd "$apt_dir/download" && apt-get "${apt_opts[@]}" -q download "$want" >/dev/null 2>"$apt_dir/download.err"); then
    grep -v '^W:' "$apt_dir/download.err" >&2 || true
    if [[ -n $pin_var ]]; then
      log "$want is not in Debian's archive any more. See what is there now with:" >&2
      log "  apt-cache ${apt_opts[*]} policy $name" >&2
      log "then move $pin_var in scripts/setup.sh to that version and run make setup again" >&2
    fi
    exit 1
  fi
  ls "$apt_dir/download/${name}_"*.deb
}

# Unpacks the pinned package into $cache/<name>-<version>/ (once), links $cache/<name>-<line> to it, and checks
# that `<binary> --version` runs and names the version.
cached_deb() {
  local name=$1 version=$2 line=$3 pin_var=$4 binary=$5
  local root="$cache/$name-$version"
  if [[ -x "$root/$binary" ]]; then
    log "$name $version present in $root"
  else
    log "fetching $name $version into $root"
    private_apt_update # here, not in fetch_deb's subshell: once per run
    local deb
    deb=$(fetch_deb "$name=$version" "$pin_var")
    rm -rf "$root.tmp" && mkdir -p "$root.tmp"
    dpkg-deb -x "$deb" "$root.tmp"
    rm -f "$deb"
    if [[ $name == runc ]]; then
      runnable_runc "$root.tmp"
    fi
    rm -rf "$root" && mv "$root.tmp" "$root"
  fi
  local upstream=${version%%[~+]*} said
  said=$("$root/$binary" --version 2>&1) || true
  if [[ $said != *"$upstream"* ]]; then
    log "$root/$binary does not run here or is not $upstream: $said" >&2
    exit 1
  fi
  ln -sfn "$root" "$cache/$name-$line"
}

# sid's runc needs glibc 2.38 (__isoc23_strtol); Debian 12 has 2.36. Give it a loader and libraries of its own:
# trixie's libc6 and libseccomp2 unpacked beside it, named by its ELF interpreter and runpath (bookworm's patchelf,
# unpacked, not installed). `runc init` re-executes the same file, so it runs on the same loader; the container's
# own processes are exec'd afresh and never see these libraries.
runnable_runc() {
  local root=$1 deb
  for pkg in libc6/trixie libseccomp2/trixie patchelf/bookworm; do
    deb=$(fetch_deb "$pkg" "")
    dpkg-deb -x "$deb" "$root/runtime"
    dpkg-deb -f "$deb" Package Version | paste -sd' ' >>"$root/runtime/VERSIONS"
    rm -f "$deb"
  done
  # The libraries' final place: $root is renamed into place after this.
  local libs="${root%.tmp}/runtime/usr/lib/x86_64-linux-gnu"
  "$root/runtime/usr/bin/patchelf" --set-interpreter "$libs/ld-linux-x86-64.so.2" --set-rpath "$libs" \
    "$root/usr/sbin/runc"
}

# The emulated node's kernel (tests/node/node.py): Debian 12's own, whose kvm-amd runs bulkhead-vmm inside QEMU's
# TCG with SVM. Unpacked (not installed) into $cache/<package>-<version>/ with its modules.dep, linked as
# $cache/node-kernel. Pinned by version: move the pin when bookworm's archive drops it (setup says so).
NODE_KERNEL=linux-image-6.1.0-50-amd64
NODE_KERNEL_VERSION=6.1.176-1 # bookworm
cached_node_kernel() {
  local root="$cache/$NODE_KERNEL-$NODE_KERNEL_VERSION" release=${NODE_KERNEL#linux-image-}
  if [[ -f $root/lib/modules/$release/modules.dep && -f $root/boot/vmlinuz-$release ]]; then
    log "node kernel $NODE_KERNEL $NODE_KERNEL_VERSION present in $root"
  else
    log "fetching the node kernel $NODE_KERNEL $NODE_KERNEL_VERSION into $root"
    private_apt_update
    local deb
    deb=$(fetch_deb "$NODE_KERNEL=$NODE_KERNEL_VERSION" NODE_KERNEL_VERSION)
    rm -rf "$root.tmp" && mkdir -p "$root.tmp"
    dpkg-deb -x "$deb" "$root.tmp"
    rm -f "$deb"
    depmod -b "$root.tmp" "$release"
    rm -rf "$root" && mv "$root.tmp" "$root"
  fi
  ln -sfn "$root" "$cache/node-kernel"
}
cached_node_kernel

# The emulated node's QEMU (tests/node/node.py): trixie's, not Debian 12's 7.2, whose SVM emulation breaks nested
# guests (no XSETBV intercept; with two VMs in the node, guests triple-faulted and the node's kernel crashed in a
# VMM's vCPU thread: tests/node/README.md). It needs glibc 2.38+, so it runs on trixie's loader and libraries: it
# and the packages it depends on in trixie (scripts/debian-closure.py) are unpacked, not installed, into
# $cache/qemu-node-<version>/root, behind a wrapper that names the loader, the libraries and the firmware
# directories. Linked as $cache/qemu-node. Pinned by version: move the pin when trixie's archive drops it.
NODE_QEMU=1:10.0.13+ds-0+deb13u1 # trixie
cached_node_qemu() {
  local version=${NODE_QEMU#*:}
  local root="$cache/qemu-node-$version" upstream=${version%%[~+]*}
  if [[ -x $root/qemu-system-x86_64 ]] && "$root/qemu-system-x86_64" --version 2>/dev/null | grep -qF "$upstream"; then
    log "node QEMU $NODE_QEMU present in $root"
  else
    log "fetching the node's QEMU $NODE_QEMU and its trixie libraries into $root"
    private_apt_update
    local pkgs deb
    if ! pkgs=$(python3 "$(dirname "$0")/debian-closure.py" --apt-dir "$apt_dir" --suite trixie \
      --skip debconf --skip adduser --skip qemu-system-common --skip ipxe-qemu "qemu-system-x86=$NODE_QEMU"); then
      log "see what trixie has now with: apt-cache ${apt_opts[*]} policy qemu-system-x86" >&2
      log "then move NODE_QEMU in scripts/setup.sh to that version and run make setup again" >&2
      exit 1
    fi
    rm -rf "$root.tmp" && mkdir -p "$root.tmp/root"
    rm -f "$apt_dir/download/"*.deb
    # shellcheck disable=SC2086 # one word a package
    if ! (cd "$apt_dir/download" && apt-get "${apt_opts[@]}" -q download $pkgs >/dev/null 2>"$apt_dir/download.err"); then
      grep -v '^W:' "$apt_dir/download.err" >&2 || true
      exit 1
    fi
    for deb in "$apt_dir/download/"*.deb; do
      dpkg-deb -x "$deb" "$root.tmp/root"
    done
    rm -f "$apt_dir/download/"*.deb
    echo "$pkgs" >"$root.tmp/VERSIONS"
    {
      echo '#!/bin/sh'
      echo "# trixie's QEMU on trixie's loader and libraries (scripts/setup.sh, cached_node_qemu)."
      echo "r=$root/root"
      echo 'lib=$r/usr/lib/x86_64-linux-gnu'
      echo 'exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$r/usr/bin/qemu-system-x86_64" \'
      echo '  -L "$r/usr/share/qemu" -L "$r/usr/share/seabios" "$@"'
    } >"$root.tmp/qemu-system-x86_64"
    chmod +x "$root.tmp/qemu-system-x86_64"
    rm -rf "$root" && mv "$root.tmp" "$root"
    if ! "$root/qemu-system-x86_64" --version 2>&1 | grep -qF "$upstream"; then
      log "$root/qemu-system-x86_64 does not run here: $("$root/qemu-system-x86_64" --version 2>&1 | head -n 3)" >&2
      exit 1
    fi
  fi
  ln -sfn "$root" "$cache/qemu-node"
}
cached_node_qemu

cached_deb containerd "$CONTAINERD_17" 1.7 CONTAINERD_17 usr/bin/containerd
cached_deb containerd "$CONTAINERD_21" 2.1 CONTAINERD_21 usr/bin/containerd
cached_deb runc "$RUNC_13" 1.3 RUNC_13 usr/sbin/runc

log "done"
