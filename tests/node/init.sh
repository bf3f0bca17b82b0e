#!/bin/sh
# The emulated node's first init (busybox, in its initramfs): load the modules that reach the
# host's root, lay a tmpfs overlay over it, and hand over to systemd as PID 1 (cgroup v2), which
# runs the command unit that node.py wrote into the shared output directory.
# Any failure here powers the node off at once: node.py then reports the console's tail.
export PATH=/bin
fail() {
  echo "node-init: $*" >/dev/console
  echo "node-init: $*" >/out/init-failed 2>/dev/null
  poweroff -f
}
mkdir -p /proc /sys /dev /lower /ovl /newroot /out
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Modules in dependency order (node.py writes the list).
# Each line: the module's file, then its parameters, if any.
while read -r ko params; do
  # shellcheck disable=SC2086 # the parameters are words
  insmod "/modules/$ko" $params || fail "insmod $ko $params failed"
done </modules/order
opts=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$opts,cache=none" out /out || fail "cannot mount the output share"
# The host's root, read-only; cache=loose keeps binaries' pages after the first read.
mount -t 9p -o "$opts,ro,cache=loose" host /lower || fail "cannot mount the host's root"
mount -t tmpfs -o mode=0755,size=$(cat /node/upper_size) tmpfs /ovl || fail "cannot mount the overlay's tmpfs"
mkdir -p /ovl/upper /ovl/work
mount -t overlay -o lowerdir=/lower,upperdir=/ovl/upper,workdir=/ovl/work overlay /newroot \
  || fail "cannot mount the overlay root"
# What the host's root brings that a node must not see: its fstab (devices the node lacks), its
# machine id, and the marker that makes systemd believe it runs in a container (and then ignore
# the kernel's command line).
: >/newroot/etc/fstab
rm -f /newroot/.dockerenv /newroot/run/.containerenv
rm -f /newroot/etc/machine-id && : >/newroot/etc/machine-id
# systemd-tmpfiles would clean /tmp at boot (tmp.conf's D line): in the overlay that hides the host's
# /tmp, where a checkout (CI's clone) may live. The node's root is the host's: nothing cleans it.
for unit in systemd-tmpfiles-setup.service systemd-tmpfiles-clean.service systemd-tmpfiles-clean.timer; do
  ln -sf /dev/null "/newroot/etc/systemd/system/$unit"
done
# The node kernel's own modules (the host's /lib/modules is for the host's kernel), so modprobe
# and the kernel's autoload work in the node.
ver=$(cat /node/kernel_version)
mkdir -p "/newroot/lib/modules/$ver"
mount --bind "/newroot$(cat /node/modules_dir)" "/newroot/lib/modules/$ver" || fail "cannot bind the node's modules"
# The command's units, written by node.py.
cp /node/bulkhead-node.service /node/bulkhead-node.target /newroot/etc/systemd/system/ || fail "cannot install the units"
mkdir -p /newroot/bulkhead-node
mount --move /out /newroot/bulkhead-node || fail "cannot move the output share"
umount /proc /sys /dev 2>/dev/null
exec switch_root /newroot /lib/systemd/systemd --unit=bulkhead-node.target
