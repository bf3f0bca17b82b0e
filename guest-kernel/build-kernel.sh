#!/usr/bin/env bash
# Builds the guest vmlinux from Debian's linux-source-6.12, our patches (patches/*.patch, applied
# in name order; each says what it fixes) and bulkhead.config.
# The result is cached outside the checkout, keyed by a hash of the source package version, the
# patches, the config fragment, this script and the config check, so CI and later runs reuse it.
# Prints the vmlinux path on stdout.
#
#   build-kernel.sh                         build (or reuse) the kernel
#   build-kernel.sh --check-only [FRAGMENT] only configure: tinyconfig + FRAGMENT (default
#                                           bulkhead.config) + olddefconfig, then check that every
#                                           option of the fragment survived; no build, no cache
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${BULKHEAD_CACHE:-/var/cache/bulkhead}
log() { printf 'guest-kernel: %s\n' "$*" >&2; }

check_only=0
fragment="$here/bulkhead.config"
if [[ ${1:-} == --check-only ]]; then
  check_only=1
  fragment=$(realpath "${2:-$fragment}")
fi

src_pkg=linux-source-6.12
need=()
if ! dpkg-query -W -f='${Status}' "$src_pkg" 2>/dev/null | grep -q "install ok installed"; then
  need+=("$src_pkg" bc bison flex libelf-dev libssl-dev xz-utils)
fi
command -v patch >/dev/null || need+=(patch)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi
tarball=$(ls /usr/src/linux-source-6.12*.tar.xz | head -n 1)
version=$(dpkg-query -W -f='${Version}' "$src_pkg")
patches=("$here"/patches/*.patch)
[[ -e ${patches[0]} ]] || patches=()
key=$(printf '%s\n' "$src_pkg=$version" | cat - "${patches[@]}" "$fragment" "$0" "$here/check-config.py" \
  | sha256sum | cut -c1-16)
out="$cache/kernel-$key"
if ((!check_only)) && [[ -s "$out/vmlinux" ]]; then
  log "cached: $out/vmlinux"
  echo "$out/vmlinux"
  exit 0
fi

if ((check_only)); then
  work=$(mktemp -d "${TMPDIR:-/tmp}/bulkhead-kconfig.XXXXXX")
  trap 'rm -rf "$work"' EXIT
else
  work="$cache/build-$key"
  rm -rf "$work" && mkdir -p "$work"
fi
log "unpacking $tarball"
tar -C "$work" -xf "$tarball"
cd "$work"/linux-source-*
for p in "${patches[@]}"; do
  log "applying $(basename "$p")"
  patch -s -p1 --forward <"$p" >&2
done
make -s tinyconfig >&2
scripts/kconfig/merge_config.sh -m .config "$fragment" >&2
make -s olddefconfig >&2
# An option whose dependencies are missing is dropped without a word; stop here instead.
"$here/check-config.py" "$fragment" .config
if ((check_only)); then
  log "every option of $fragment survived olddefconfig"
  exit 0
fi
log "building vmlinux with $(nproc) jobs"
make -s -j"$(nproc)" vmlinux >&2
mkdir -p "$out.tmp"
cp vmlinux .config "$out.tmp/"
rm -rf "$out" && mv "$out.tmp" "$out"
cd / && rm -rf "$work"
log "built: $out/vmlinux"
echo "$out/vmlinux"
