#!/usr/bin/env python3
"""The emulated node: a whole Kubernetes-like node with a real /dev/kvm (AMD-V), inside QEMU TCG.

These hosts' /dev/kvm is PVM, which runs no ordinary guest, so bulkhead-vmm cannot boot the real
guest here. QEMU's TCG emulates AMD-V with nested paging (`-cpu max`; trixie's QEMU 10, see QEMU
below), and Debian 12's own kernel loads kvm-amd inside it. The node's root is this host's own root, read-only over 9p under a
tmpfs overlay, so the node runs the same binaries, caches and test executables; systemd is PID 1
on a cgroup v2 hierarchy, as on an EKS AL2023 node.

    node.py run   --out DIR [--timeout S] [--env K=V ...] -- COMMAND...
    node.py tests --out DIR [--timeout S] [--per-binary-timeout S] [--env K=V ...] -- BINARY[::FILTER]...
      (FILTER: libtest's words, e.g. "_on_bulkhead_vmm --skip some_test")

The node's disk (/dev/vda, ext4, at /var/lib/bulkhead-test) is a sparse image made for each node as
DIR/.node/disk.img and deleted when the node ends.

`run` boots a node, runs COMMAND there (bash -c of the words, in the current directory) and
powers it off. `tests` runs libtest binaries there, one after the other, each with
`--test-threads=1 --show-output [FILTER]` under its own bound, and prints one summary line.
Both stream the command's output as it comes, and leave in DIR: `output.log` (the command's
stdout and stderr), `status` (its exit status), `console.log` (the node's serial console) and
`qemu.log`. The exit status is the command's; 124 when a bound ran out; 125 when the node never
ran the command (the console's tail says why). When the node's own kernel panics during `tests`,
a new node runs the test binaries that had not finished, once, and the first node's console is
kept as `console-node-panicked.log`.

Every step is bounded, and the node dies with this script (PR_SET_PDEATHSIG on QEMU, which is
also stopped by its PID when this script ends): nothing is left running on the host.

The node's kernel is Debian's, pinned and unpacked by `make setup` (scripts/setup.sh) into
$BULKHEAD_CACHE/node-kernel, with its modules.dep.
"""
import argparse
import ctypes
import gzip
import os
import shlex
import signal
import stat
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("BULKHEAD_CACHE", "/var/cache/bulkhead")
# Trixie's QEMU (10.0), unpacked by `make setup` (scripts/setup.sh, cached_node_qemu), not Debian 12's
# 7.2: 7.2's SVM emulation breaks nested guests. It does not intercept XSETBV, so our guest's XCR0
# changed behind the node's KVM (every guest boot warned "XSAVE consistency problem"), and with two
# VMs in the node cold guests triple-faulted and the node's own kernel overflowed its stack in a
# VMM's vCPU thread (tests/node/README.md has the figures). BULKHEAD_NODE_QEMU names another build.
QEMU = os.environ.get("BULKHEAD_NODE_QEMU", os.path.join(CACHE, "qemu-node", "qemu-system-x86_64"))
NODE_CPU = "max"
NODE_ACCEL = "tcg,thread=multi"
NODE_SMP = 2
BUSYBOX = "/bin/busybox"
# Modules the node's first init loads to reach its root, and that the node needs before
# anything could autoload them; their dependencies come from modules.dep.
BOOT_MODULES = ["virtio_pci", "9pnet_virtio", "9p", "overlay", "kvm-amd", "dummy", "virtio_blk", "ext4"]
# Parameters of those modules, by file name (BULKHEAD_NODE_KVM_AMD: kvm-amd's, for experiments).
MODULE_PARAMS = {"kvm-amd.ko": os.environ.get("BULKHEAD_NODE_KVM_AMD", "")}
# Where the output share appears inside the node (init.sh moves it there).
NODE_OUT = "/bulkhead-node"
# Where the node's disk (ext4 on virtio-blk) is mounted: the integration tests' state (their containerd roots).
TEST_STATE = "/var/lib/bulkhead-test"
# The command unit: systemd runs it once and powers the node off whatever its result.
SERVICE = """[Unit]
Description=bulkhead emulated-node command
DefaultDependencies=no
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Service]
Type=oneshot
# As containerd's own unit: it makes and manages cgroups below its own.
Delegate=yes
ExecStart=/bin/bash {out}/.node/run
TimeoutStartSec=infinity
"""
TARGET = """[Unit]
Description=bulkhead emulated node
DefaultDependencies=no
Requires=bulkhead-node.service
After=bulkhead-node.service
AllowIsolate=yes
"""


def log(msg):
    print(f"node: {msg}", flush=True)


def kernel_dir():
    """The pinned node kernel that `make setup` unpacked: (vmlinuz, version, modules dir)."""
    root = os.path.realpath(os.path.join(CACHE, "node-kernel"))
    modules = os.path.join(root, "lib/modules")
    try:
        (version,) = os.listdir(modules)
    except (FileNotFoundError, ValueError):
        sys.exit(f"node: no node kernel in {root} (run `make setup`)")
    vmlinuz = os.path.join(root, f"boot/vmlinuz-{version}")
    moddir = os.path.join(modules, version)
    if not os.path.isfile(vmlinuz) or not os.path.isfile(os.path.join(moddir, "modules.dep")):
        sys.exit(f"node: {root} is incomplete (no vmlinuz or modules.dep; run `make setup`)")
    return vmlinuz, version, moddir


def module_order(moddir, wanted):
    """The .ko paths (relative to moddir) of `wanted` and their dependencies, dependencies first."""
    deps = {}
    by_name = {}
    with open(os.path.join(moddir, "modules.dep"), encoding="utf-8") as f:
        for line in f:
            path, _, rest = line.partition(":")
            deps[path] = rest.split()
            name = os.path.basename(path).split(".ko")[0]
            by_name[name] = path
            by_name[name.replace("-", "_")] = path
    order = []

    def visit(path):
        if path in order:
            return
        # modules.dep lists every (transitive) dependency, deepest last.
        for dep in reversed(deps.get(path, [])):
            visit(dep)
        order.append(path)

    for name in wanted:
        path = by_name.get(name) or by_name.get(name.replace("-", "_"))
        if path is None:
            sys.exit(f"node: the node kernel has no module {name}")
        visit(path)
    return order


def cpio_entry(ino, name, mode, data=b"", nlink=1):
    name_b = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name_b), 0]
    out = b"070701" + b"".join(b"%08X" % f for f in fields) + name_b
    out += b"\0" * ((4 - len(out) % 4) % 4)
    return out + data + b"\0" * ((4 - len(data) % 4) % 4)


def write_initramfs(path, files):
    """A gzip'd newc archive of `files` ({name: (mode, bytes)}), with the directories they need."""
    parts, dirs, ino = [], set(), 1
    for name in sorted(files):
        pieces = name.split("/")[:-1]
        for i in range(1, len(pieces) + 1):
            d = "/".join(pieces[:i])
            if d not in dirs:
                dirs.add(d)
                parts.append(cpio_entry(ino, d, stat.S_IFDIR | 0o755, nlink=2))
                ino += 1
        mode, data = files[name]
        if not stat.S_IFMT(mode):
            mode |= stat.S_IFREG
        parts.append(cpio_entry(ino, name, mode, data))
        ino += 1
    for d in ["bin", "proc", "sys", "dev", "lower", "ovl", "newroot", "out"]:
        if d not in dirs:
            parts.append(cpio_entry(ino, d, stat.S_IFDIR | 0o755, nlink=2))
            ino += 1
    parts.append(cpio_entry(0, "TRAILER!!!", 0))
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=1) as gz:
        gz.write(b"".join(parts))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def prepare(out, command, env, upper_mib):
    """Writes the node's initramfs and the command's script into out/.node."""
    vmlinuz, version, moddir = kernel_dir()
    node_dir = os.path.join(out, ".node")
    os.makedirs(node_dir, exist_ok=True)
    order = module_order(moddir, BOOT_MODULES)
    files = {
        "init": (0o755, read(os.path.join(HERE, "init.sh"))),
        "bin/busybox": (0o755, read(BUSYBOX)),
        "modules/order": (0o644, "".join(
            f"{os.path.basename(p)} {MODULE_PARAMS.get(os.path.basename(p), '')}".strip() + "\n"
            for p in order).encode()),
        "node/kernel_version": (0o644, version.encode()),
        "node/modules_dir": (0o644, moddir.encode()),
        "node/upper_size": (0o644, f"{upper_mib}m".encode()),
        "node/bulkhead-node.service": (0o644, SERVICE.format(out=NODE_OUT).encode()),
        "node/bulkhead-node.target": (0o644, TARGET.encode()),
    }
    for p in order:
        files[f"modules/{os.path.basename(p)}"] = (0o644, read(os.path.join(moddir, p)))
    # busybox's applets the first init uses, as symlinks to it.
    for applet in ["sh", "mount", "umount", "insmod", "mkdir", "cat", "cp", "rm", "poweroff", "switch_root"]:
        files[f"bin/{applet}"] = (stat.S_IFLNK | 0o777, b"busybox")
    initramfs = os.path.join(node_dir, "initramfs.cpio.gz")
    write_initramfs(initramfs, files)

    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    script = f"""# The command the node runs (node.py): its output and status go to the shared directory.
{exports}cd {shlex.quote(os.getcwd())} || exit 125
exec >{NODE_OUT}/output.log 2>&1
echo "node: systemd is PID 1 ($(cat /proc/1/comm)); cgroup $(stat -fc %T /sys/fs/cgroup); kernel $(uname -r)"
echo "node: /dev/kvm: $(ls -l /dev/kvm 2>&1)"
# containerd's streaming server (exec, attach) serves on the node's default-route address. The
# node has no NIC: a dummy interface carries that route, so no traffic ever leaves the node.
ip link add bulkhead-d0 type dummy && ip link set bulkhead-d0 up \\
  && ip addr add 192.0.2.1/24 dev bulkhead-d0 && ip route add default dev bulkhead-d0 \\
  || echo "node: the dummy default route could not be set up"
ip link set lo up
# containerd's overlay snapshots cannot have their upper layers on the node's overlay root: the state
# trees get mounts of their own, as on a node's disk. (Not /tmp: a checkout there, as CI's may be, must
# stay visible.) The tests' containerd roots are on the node's ext4 disk: containerd 2.x idmaps a
# hostUsers: false pod's image layers there, which Linux 6.1 cannot do on tmpfs (from 6.3).
mkdir -p {TEST_STATE} && mount -t ext4 -o discard,noatime /dev/vda {TEST_STATE} \
  || {{ echo "node: cannot mount the node's disk at {TEST_STATE}: a tmpfs instead"; mount -t tmpfs -o mode=0755 tmpfs {TEST_STATE}; }}
for dir in /var/lib/bulkhead /var/lib/containerd; do
  mkdir -p $dir && mount -t tmpfs -o mode=0755 tmpfs $dir || echo "node: cannot mount a tmpfs at $dir"
done
# A process that crashes in the node leaves its core beside the output, for gdb on the host (same binaries).
mkdir -p {NODE_OUT}/cores && echo "{NODE_OUT}/cores/core.%e.%p" >/proc/sys/kernel/core_pattern && ulimit -c unlimited
# The system bus, through which the shim (busctl) and containerd ask systemd for transient scopes.
systemctl start dbus.socket dbus.service || echo "node: the system bus did not start"
{command}
status=$?
for core in {NODE_OUT}/cores/*; do
  [ -e "$core" ] && echo "node: a process crashed in the node: its core is $core (on the host: the output directory's cores/)"
done
echo $status >{NODE_OUT}/status
sync
exit $status
"""
    with open(os.path.join(node_dir, "run"), "w", encoding="utf-8") as f:
        f.write(script)
    return vmlinuz, initramfs


def pdeathsig():
    """In QEMU's child: die with this script (SIGKILL), wherever it is killed."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setpgid(0, 0)


def make_disk(path, gib):
    """A fresh sparse ext4 image of `gib` GiB at `path`: the node's disk. The host pays only for the blocks the
    node keeps (it mounts with discard)."""
    if os.path.exists(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.truncate(gib << 30)
    mkfs = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "bulkhead-node", "-E",
                           "lazy_itable_init=1,lazy_journal_init=1,nodiscard", path],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    if mkfs.returncode != 0:
        sys.exit(f"node: mkfs.ext4 of the node's disk {path} failed: {mkfs.stderr.strip()}")


def boot(out, vmlinuz, initramfs, mem_mib, smp, cpu, accel, timeout, disk):
    """Boots the node and streams output.log until QEMU ends or `timeout` s pass.
    Returns (exit status or None, timed out)."""
    console = os.path.join(out, "console.log")
    cmdline = " ".join([
        "console=ttyS0", "panic=-1", "rdinit=/init",
        "systemd.unit=bulkhead-node.target", "systemd.unified_cgroup_hierarchy=1", "cgroup_no_v1=all",
        "systemd.show_status=error", "systemd.log_level=notice",
        # The node's clock is emulated and slow: a watchdog or a TSC check would misjudge it.
        "nowatchdog", "tsc=unstable", "no_timer_check", "mitigations=off",
    ])
    args = [
        QEMU, "-accel", accel, "-cpu", cpu, "-smp", str(smp), "-m", str(mem_mib),
        "-nodefaults", "-no-reboot", "-display", "none", "-serial", f"file:{console}",
        "-kernel", vmlinuz, "-initrd", initramfs, "-append", cmdline,
        "-virtfs", "local,path=/,mount_tag=host,security_model=passthrough,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={out},mount_tag=out,security_model=passthrough,multidevs=remap",
        # cache=unsafe: the disk dies with the node, so its flushes need not reach the host's disk.
        "-drive", f"file={disk},if=virtio,format=raw,cache=unsafe,discard=unmap",
    ]
    with open(os.path.join(out, "qemu.log"), "wb") as qlog:
        qemu = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT,
                                preexec_fn=pdeathsig)
    log(f"QEMU {qemu.pid} boots the node ({smp} vCPUs, {mem_mib} MiB, -accel {accel} -cpu {cpu}); console {console}")

    def stop(signum, _frame):
        qemu.kill()
        qemu.wait()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    output = os.path.join(out, "output.log")
    deadline = time.monotonic() + timeout
    offset = 0
    timed_out = False
    try:
        while True:
            offset = stream(output, offset)
            if qemu.poll() is not None:
                break
            if time.monotonic() >= deadline:
                timed_out = True
                log(f"the node did not finish within {timeout} s; stopping QEMU {qemu.pid}")
                break
            time.sleep(0.5)
    finally:
        if qemu.poll() is None:
            qemu.kill()
        qemu.wait()
        stream(output, offset)
    status_file = os.path.join(out, "status")
    try:
        return int(read(status_file).strip()), timed_out
    except (FileNotFoundError, ValueError):
        return None, timed_out


def stream(path, offset):
    """Copies what `path` gained since `offset` to stdout; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(1 << 20)
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return offset + len(data)


def tail(path, n):
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path} is missing)"
    return "\n".join(lines[-n:])


def run_node(opts, command):
    if not os.access(QEMU, os.X_OK):
        sys.exit(f"node: no QEMU for the node at {QEMU} (`make setup` unpacks it)")
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    for stale in ["output.log", "status", "console.log", "qemu.log", "init-failed"]:
        try:
            os.remove(os.path.join(out, stale))
        except FileNotFoundError:
            pass
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": "/root",
           "BULKHEAD_CACHE": CACHE, "BULKHEAD_IN_NODE": "1", "RUST_BACKTRACE": "1"}
    for kv in opts.env:
        k, sep, v = kv.partition("=")
        if not sep:
            sys.exit(f"node: --env wants K=V, not {kv!r}")
        env[k] = v
    vmlinuz, initramfs = prepare(out, command, env, opts.upper_mib)
    disk = os.path.join(out, ".node", "disk.img")
    make_disk(disk, opts.disk_gib)
    started = time.monotonic()
    try:
        status, timed_out = boot(out, vmlinuz, initramfs, opts.mem_mib, opts.smp, opts.cpu, opts.accel,
                                 opts.timeout, disk)
    finally:
        # What the tests left there is gone with the node, as their tmpfs would be.
        os.remove(disk)
    took = time.monotonic() - started
    if timed_out:
        log(f"timed out after {took:.0f} s; the console's tail:\n{tail(os.path.join(out, 'console.log'), 30)}")
        return 124
    if status is None:
        log(f"the node ended after {took:.0f} s without its command's exit status; the console's tail:\n"
            f"{tail(os.path.join(out, 'console.log'), 40)}\nQEMU said:\n{tail(os.path.join(out, 'qemu.log'), 10)}")
        return 125
    log(f"the command exited {status}; the node ran {took:.0f} s")
    if status != 0:
        # What the node's kernel said of memory, kills and faults: a test that failed because the
        # node ran short (or a VMM was killed) says so here, and the console itself is kept.
        for line in kernel_trouble(os.path.join(out, "console.log")):
            log(f"kernel: {line}")
    return status


# Console lines that say the node itself was in trouble.
# "type=1326" is the audit record of a seccomp kill (a VMM thread's syscall outside its allow-list).
TROUBLE = ("out of memory", "oom-kill", "killed process", "segfault", "general protection", "bug:",
           "soft lockup", "hung task", "blocked for more than", "page allocation failure", "type=1326")


def kernel_trouble(console, most=20):
    try:
        with open(console, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    found = [l.strip() for l in lines if any(t in l.lower() for t in TROUBLE)]
    return found[-most:]


def cmd_run(opts):
    if not opts.command:
        sys.exit("node: run wants a command after --")
    return run_node(opts, shlex.join(["bash", "-c", " ".join(opts.command)]))


# How the node's own kernel says it died (its console); a guest's panic is in the guest's console file.
NODE_PANIC = "Kernel panic - not syncing"


def tests_command(specs, per_binary_timeout, progress):
    """The node's script for `specs`: each binary under its bound, its exit status appended to
    `progress` (a path inside the node) once it ended."""
    lines = []
    for i, spec in enumerate(specs):
        binary, _, filt = spec.partition("::")
        name = os.path.basename(binary)
        # FILTER is libtest's words: a name filter, then any `--skip NAME`.
        words = [binary, "--test-threads=1", "--show-output"] + filt.split()
        # cargo's own header, so the summary script attributes the tests to their binary.
        lines.append(f"echo '     Running {name} ({binary})'")
        lines.append(f"timeout -k 10 {per_binary_timeout} {shlex.join(words)}; rc=$?")
        lines.append(f"echo \"{i} $rc\" >>{shlex.quote(progress)}; [ $rc = 0 ] || failed=1")
    return "failed=0\n" + "\n".join(lines) + "\n(exit $failed)"


def ended(progress):
    """The exit statuses of the specs that ended, in order, from a progress file."""
    try:
        with open(progress, encoding="utf-8") as f:
            return [int(line.split()[1]) for line in f if len(line.split()) == 2]
    except FileNotFoundError:
        return []


def node_panicked(console):
    try:
        with open(console, "rb") as f:
            return [l for l in f.read().decode(errors="replace").splitlines() if NODE_PANIC in l]
    except FileNotFoundError:
        return []


def set_aside_panicked_node(out, progress):
    """Keeps a panicked node's console (and its progress file, if a binary had ended) under names of their own, for
    the next node's run. Returns the exit statuses of the binaries that ended, and where the console went."""
    statuses = ended(progress)
    crashed = os.path.join(out, "console-node-panicked.log")
    os.replace(os.path.join(out, "console.log"), crashed)
    # A node that died in its first binary never wrote one.
    if os.path.exists(progress):
        os.replace(progress, os.path.join(out, "progress-node-panicked"))
    return statuses, crashed


def cmd_tests(opts):
    if not opts.command:
        sys.exit("node: tests wants BINARY[::FILTER] arguments after --")
    specs = list(opts.command)
    for spec in specs:
        binary = spec.partition("::")[0]
        if not os.access(binary, os.X_OK):
            sys.exit(f"node: {binary} is not an executable test binary")
    out = os.path.abspath(opts.out)
    progress = os.path.join(out, "progress")
    if os.path.exists(progress):
        os.remove(progress)
    status = run_node(opts, tests_command(specs, opts.per_binary_timeout, f"{NODE_OUT}/progress"))
    panic = node_panicked(os.path.join(out, "console.log")) if status == 125 else []
    if not panic:
        return status
    # The node's own kernel died: on these hosts that is QEMU's emulation of AMD-V failing the
    # node (its vCPU threads overflow their stacks; tests/node/README.md), not a test's result.
    # The test binary it was running never finished, so it has no result: a fresh node runs it
    # and the rest, once, and this says so loudly. The first node's console is kept.
    statuses, crashed = set_aside_panicked_node(out, progress)
    left = specs[len(statuses):]
    log(f"THE NODE'S KERNEL PANICKED ({panic[-1].strip()}) after {len(statuses)} of {len(specs)} test "
        f"binaries; its console is {crashed}. A new node runs the {len(left)} left, once.")
    status = run_node(opts, tests_command(left, opts.per_binary_timeout, f"{NODE_OUT}/progress"))
    if status == 0 and any(rc != 0 for rc in statuses):
        status = 1
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in ["run", "tests"]:
        p = sub.add_parser(verb)
        p.add_argument("--out", required=True, help="the output directory, shared with the node")
        p.add_argument("--timeout", type=int, default=1800, help="bound on the whole node, in seconds")
        # Room for a VM's memory, virtiofsd, containerd and the tmpfs mounts the tests fill, with
        # headroom: TCG maps guest RAM lazily, so the host pays only for what the node touches.
        p.add_argument("--mem-mib", type=int, default=8192)
        p.add_argument("--upper-mib", type=int, default=3072, help="the overlay's tmpfs size")
        p.add_argument("--disk-gib", type=int, default=16, help=f"the node's disk (ext4 at {TEST_STATE}), sparse")
        p.add_argument("--smp", type=int, default=NODE_SMP)
        p.add_argument("--accel", default=NODE_ACCEL, help="QEMU's -accel for the node (default: %(default)s)")
        p.add_argument("--cpu", default=NODE_CPU, help="QEMU's -cpu for the node (default: %(default)s)")
        p.add_argument("--env", action="append", default=[], help="K=V for the command's environment")
        if verb == "tests":
            p.add_argument("--per-binary-timeout", type=int, default=900)
        p.add_argument("command", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.command and opts.command[0] == "--":
        opts.command = opts.command[1:]
    return cmd_run(opts) if opts.verb == "run" else cmd_tests(opts)


if __name__ == "__main__":
    sys.exit(main())
