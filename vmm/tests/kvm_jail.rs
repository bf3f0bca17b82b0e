//! KVM integration: the jailed VMM (`--jail`), run as the shim runs it. Each test makes its own
//! root-owned chroot, cgroup and (where needed) network namespace, runs a test guest in the jail
//! and looks at the VMM from the host: unprivileged, in its chroot, cgroup and netns; killed with
//! SIGSYS when any thread kind makes a forbidden syscall; refused before anything changes when
//! the jail document is bad; nothing left mounted on the host afterwards; and virtio-fs served
//! by a virtiofsd whose socket sits in the chroot, laid out as the shim lays it out; and a
//! snapshot taken in one jail restored in others (`--prepare` and `--restore`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

mod common;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::virtiofsd::Virtiofsd;
use common::*;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

const UID: u32 = 40_123;
const GID: u32 = 40_124;
const PROBE_ENV: &str = "BULKHEAD_VMM_SECCOMP_PROBE";
const SIGSYS_STATUS: i32 = 128 + libc::SIGSYS;

/// The jail needs root; so do these checks of it from the host.
fn skip_unless_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: {test}: the jail needs root");
        return true;
    }
    false
}

/// Mount points of this host's cgroup hierarchies (v1 and v2).
fn cgroup_mounts() -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        if right.starts_with("cgroup ") || right.starts_with("cgroup2 ") {
            out.push(PathBuf::from(left.split(' ').nth(4).unwrap()));
        }
    }
    out
}

fn host_mounts_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .map(String::from)
        .collect()
}

/// A jail of the test's own: a root-owned chroot on a nodev, nosuid, noexec tmpfs (as the pod
/// state dir on a node's /run), a cgroup name and optionally a network namespace. Dropping it
/// removes the cgroup, the netns and the tmpfs, also when the test failed.
struct Jail {
    dir: tempfile::TempDir,
    state: PathBuf,
    chroot: PathBuf,
    cgroup: String,
    netns: Option<String>,
}

impl Jail {
    fn new(with_netns: bool) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        let flags = MsFlags::MS_NODEV | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
        mount(Some("tmpfs"), &state, Some("tmpfs"), flags, Some("mode=755")).unwrap();
        let chroot = state.join("root");
        std::fs::create_dir(&chroot).unwrap();
        std::fs::set_permissions(&chroot, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cgroup = format!("/bulkhead-test-jail-{}-{n}", std::process::id());
        let netns = with_netns.then(|| {
            let name = format!("bulkhead-jail-{}-{n}", std::process::id());
            let ok = Command::new("ip").args(["netns", "add", &name]).status().unwrap().success();
            assert!(ok, "ip netns add {name}");
            name
        });
        Self { dir, state, chroot, cgroup, netns }
    }

    /// The document the shim would write: the guest at /guest.elf, a writable /run, the test's
    /// cgroup (and netns), /dev/net/tun.
    fn document(&self, guest: &Path) -> serde_json::Value {
        serde_json::json!({
            "id": "jail-test",
            "chroot": self.chroot,
            "uid": UID,
            "gid": GID,
            "read_only": [{ "host": guest, "jail": "/guest.elf" }],
            "writable_dirs": ["/run"],
            "cgroup": self.cgroup,
            "netns": self.netns.as_ref().map(|n| format!("/run/netns/{n}")),
            "tun": true,
        })
    }

    /// Where a path inside the jail is on the host.
    fn host(&self, jail_path: &str) -> PathBuf {
        self.chroot.join(jail_path.trim_start_matches('/'))
    }

    /// The VM config: the guest at /guest.elf, serial log and API socket in /run (all paths
    /// inside the jail).
    fn vm(&self) -> serde_json::Value {
        serde_json::json!({
            "raw_guest": { "image": "/guest.elf" },
            "vcpus": 1,
            "mem_mib": 32,
            "serial_log": "/run/serial.log",
            "api_socket": "/run/api.sock",
        })
    }

    fn spawn(&self, guest: &Path, env: &[(&str, &str)]) -> VmmProcess {
        self.spawn_vm(&self.document(guest), &self.vm(), env)
    }

    fn spawn_document(&self, document: &serde_json::Value, env: &[(&str, &str)]) -> VmmProcess {
        self.spawn_vm(document, &self.vm(), env)
    }

    /// Runs `bulkhead-vmm --config vm.json --jail jail.json --log-json`; the VM config names
    /// paths inside the jail.
    fn spawn_vm(&self, document: &serde_json::Value, vm: &serde_json::Value, env: &[(&str, &str)]) -> VmmProcess {
        let jail_json = self.dir.path().join("jail.json");
        std::fs::write(&jail_json, serde_json::to_vec_pretty(document).unwrap()).unwrap();
        let args = [OsStr::new("--jail"), jail_json.as_os_str(), OsStr::new("--log-json")];
        let mut vmm = VmmProcess::spawn_with(self.dir.path(), vm, GUEST_TIMEOUT, |cmd| {
            cmd.args(args).envs(env.iter().copied());
        });
        vmm.serial = self.host("/run/serial.log");
        vmm
    }

    /// Runs `bulkhead-vmm <args> --jail jail.json --log-json` (a restore: no VM config).
    fn spawn_jailed(&self, document: &serde_json::Value, args: &[&OsStr]) -> VmmProcess {
        let jail_json = self.dir.path().join("jail.json");
        std::fs::write(&jail_json, serde_json::to_vec_pretty(document).unwrap()).unwrap();
        let mut all = args.to_vec();
        all.extend([OsStr::new("--jail"), jail_json.as_os_str(), OsStr::new("--log-json")]);
        let mut vmm = VmmProcess::spawn_args(self.dir.path(), &all, GUEST_TIMEOUT);
        vmm.serial = self.host("/run/serial.log");
        vmm
    }

    /// The names and seccomp modes of the jailed VMM's threads (KVM's kernel workers left out).
    fn threads(pid: i32) -> Vec<(String, String)> {
        let dir = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        let mut t: Vec<(String, String)> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .map(|tid| (status_field(tid, "Name"), status_field(tid, "Seccomp")))
            .filter(|(name, _)| !name.starts_with("kvm-"))
            .collect();
        t.sort();
        t
    }

    fn cgroup_dirs(&self) -> Vec<PathBuf> {
        cgroup_mounts().iter().map(|m| m.join(self.cgroup.trim_start_matches('/'))).collect()
    }

    /// Waits for `needle` on `vmm`'s console. A VMM that exits first, or a timeout, fails the
    /// test with the VMM's status, stderr and console (a bare timeout once told nothing in CI).
    fn wait_for_serial(&self, vmm: &mut VmmProcess, needle: &str) {
        let log = self.host("/run/serial.log");
        let deadline = Instant::now() + GUEST_TIMEOUT;
        loop {
            if std::fs::read_to_string(&log).is_ok_and(|s| s.contains(needle)) {
                return;
            }
            let exited = vmm.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                let _ = vmm.child.kill();
                let status = vmm.child.wait().ok();
                let mut stderr = String::new();
                if let Some(mut e) = vmm.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
                }
                let serial = std::fs::read_to_string(&log).unwrap_or_default();
                panic!(
                    "no serial line {needle:?} ({}); the VMM: {status:?}\nstderr:\n{stderr}\nserial:\n{serial}",
                    if exited.is_some() { "it exited first" } else { "timed out" }
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        // A VMM killed by the test may take a moment to leave its cgroup.
        for dir in self.cgroup_dirs() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while dir.exists() && std::fs::remove_dir(&dir).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if let Some(ns) = &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = umount2(&self.state, MntFlags::MNT_DETACH);
    }
}

fn wait_until(timeout: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The jailed VMM: the waiter's only child (a host PID).
fn vmm_pid(waiter: i32) -> i32 {
    let children = format!("/proc/{waiter}/task/{waiter}/children");
    let mut pid = None;
    wait_until(Duration::from_secs(10), "the waiter's child", || {
        pid = std::fs::read_to_string(&children).ok().and_then(|s| s.split_whitespace().next()?.parse().ok());
        pid.is_some()
    });
    pid.unwrap()
}

/// A field of /proc/<pid>/status, whitespace-normalised.
fn status_field(pid: i32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(&format!("{name}:"))).unwrap_or_else(|| panic!("no {name}"));
    line[name.len() + 1..].split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Gone, or a zombie nobody reaped yet: either way it runs no more.
fn is_dead(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| s.lines().any(|l| l.starts_with("State:") && l.contains('Z')))
        .unwrap_or(true)
}

/// The `vmm_pid` the waiter logged (JSON log lines).
fn logged_vmm_pid(stderr: &str) -> i32 {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["fields"]["vmm_pid"].as_i64())
        .unwrap_or_else(|| panic!("no vmm_pid logged:\n{stderr}")) as i32
}

#[test]
fn jailed_vmm_runs_unprivileged_in_its_chroot_cgroup_and_netns() {
    if skip_unless_root("jailed_vmm_runs_unprivileged_in_its_chroot_cgroup_and_netns") {
        return;
    }
    let Some(guest) = guest_or_skip("idle") else { return };
    let jail = Jail::new(true);
    // A virtio-fs device the idle guest never drives: its backend threads exist all the same.
    let mut vm = jail.vm();
    vm["fs"] = serde_json::json!([{ "tag": "shared", "socket": "/run/fs0.sock" }]);
    let mut vmm = jail.spawn_vm(&jail.document(&guest), &vm, &[]);
    jail.wait_for_serial(&mut vmm, "idle guest up");
    let pid = vmm_pid(vmm.pid());

    // Not root, no capability, no_new_privs, seccomp, PID 1 of its own PID namespace.
    assert_eq!(status_field(pid, "Uid"), format!("{UID} {UID} {UID} {UID}"));
    assert_eq!(status_field(pid, "Gid"), format!("{GID} {GID} {GID} {GID}"));
    assert_eq!(status_field(pid, "Groups"), "");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, caps), "0000000000000000", "{caps}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "NSpid"), format!("{pid} 1"));
    // Every thread (main = event loop, vCPU, API, the fs device's backend and watchdog) runs
    // under a seccomp filter; the main thread installs its own once the others exist. KVM's
    // kernel workers (kvm-*) are not ours.
    let tasks = || -> Vec<(String, String)> {
        let dir = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        let mut t: Vec<(String, String)> = dir
            .map(|e| {
                let tid: i32 = e.unwrap().file_name().to_str().unwrap().parse().unwrap();
                (status_field(tid, "Name"), status_field(tid, "Seccomp"))
            })
            .filter(|(name, _)| !name.starts_with("kvm-"))
            .collect();
        t.sort();
        t
    };
    wait_until(Duration::from_secs(10), "a filter on every thread", || tasks().iter().all(|(_, mode)| mode == "2"));
    let names: Vec<String> = tasks().into_iter().map(|(name, _)| name).collect();
    assert_eq!(names, ["api", "bulkhead-vmm", "fs0-backend", "fs0-watchdog", "vcpu0"]);

    // Its root is the chroot (the same directory), and its mount table holds only the chroot
    // and the read-only guest image: no host mount is reachable.
    let root = std::fs::metadata(format!("/proc/{pid}/root")).unwrap();
    let chroot = std::fs::metadata(&jail.chroot).unwrap();
    assert_eq!((root.dev(), root.ino()), (chroot.dev(), chroot.ino()), "root is the chroot");
    // readlink says "/": the link resolves in the VMM's own mount namespace, whose root the
    // chroot now is; the inode above is what identifies the directory.
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/root")).unwrap(), Path::new("/"));
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let mounts: Vec<(&str, &str)> = mountinfo
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[4], f[5])
        })
        .collect();
    assert_eq!(mounts.len(), 2, "{mountinfo}");
    assert_eq!(mounts[0].0, "/");
    // The chroot sits on a nodev tmpfs; its own bind mount allows the device nodes, no more.
    let root_flags: Vec<&str> = mounts[0].1.split(',').collect();
    assert!(root_flags.contains(&"nosuid") && root_flags.contains(&"noexec"), "{mountinfo}");
    assert!(!root_flags.contains(&"nodev"), "{mountinfo}");
    assert_eq!(mounts[1].0, "/guest.elf");
    for flag in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(mounts[1].1.split(',').any(|f| f == flag), "guest.elf mount lacks {flag}: {mountinfo}");
    }
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap(),
        std::fs::read_link("/proc/self/ns/mnt").unwrap(),
        "own mount namespace"
    );

    // In the test's cgroup, in every hierarchy, and in the test's network namespace.
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(!cgroups.is_empty());
    for line in cgroups.lines() {
        assert!(line.ends_with(&format!(":{}", jail.cgroup)), "{line}\n{cgroups}");
    }
    for dir in jail.cgroup_dirs() {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert!(procs.lines().any(|p| p == pid.to_string()), "{} lacks {pid}", dir.display());
    }
    let netns = std::fs::metadata(format!("/run/netns/{}", jail.netns.as_ref().unwrap())).unwrap();
    assert_eq!(std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino(), netns.ino(), "pod netns");

    // Device nodes and the writable dir belong to the VMM's uid, and only to it.
    for dev in ["/dev/kvm", "/dev/net/tun"] {
        let meta = std::fs::symlink_metadata(jail.host(dev)).unwrap();
        assert!(meta.file_type().is_char_device(), "{dev}");
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o7777), (UID, GID, 0o600), "{dev}");
    }
    let run = std::fs::metadata(jail.host("/run")).unwrap();
    assert_eq!((run.uid(), run.gid(), run.mode() & 0o7777), (UID, GID, 0o700));

    // The API answers through the socket's host path; the VMM knows itself as PID 1.
    let api = jail.host("/run/api.sock");
    let mut s = UnixStream::connect(&api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"{\"cmd\":\"info\"}\n").unwrap();
    let mut line = String::new();
    BufReader::new(s.try_clone().unwrap()).read_line(&mut line).unwrap();
    let info: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!((info["ok"].as_bool(), info["info"]["pid"].as_u64()), (Some(true), Some(1)), "{line}");
    drop(s);
    // The boot's phases crossed the jail's fork: main's, the jail's steps, then the builder's.
    let phases: Vec<&str> =
        info["info"]["boot"]["phases"].as_array().unwrap().iter().filter_map(|p| p["name"].as_str()).collect();
    for step in ["parse arguments", "jail: join cgroup", "jail: drop privileges", "KVM_CREATE_VM, KVM_SET_TSS_ADDR"] {
        assert!(phases.contains(&step), "no {step:?} in {phases:?}");
    }
    assert!(info["info"]["boot"]["ready_unix_ns"].as_u64() <= info["info"]["first_kvm_run_unix_ns"].as_u64(), "{line}");

    assert!(host_mounts_under(&jail.chroot).is_empty(), "jail mounts leaked to the host");

    // SIGTERM to the waiter reaches the VMM, which stops cleanly; the waiter relays its 0.
    // SAFETY: the pid is our own child.
    assert_eq!(unsafe { libc::kill(vmm.pid(), libc::SIGTERM) }, 0);
    let run = vmm.wait();
    assert_eq!(run.status.code(), Some(0), "{}", run.stderr);
    assert!(run.stderr.contains("forwarding signal to the jailed VMM"), "{}", run.stderr);
    assert!(run.stderr.contains("termination signal; shutting down"), "{}", run.stderr);
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the waiter reaped the VMM");
    assert!(!api.exists(), "the VMM removed its API socket");

    // Nothing is left mounted, so the chroot comes apart like any directory.
    assert!(host_mounts_under(&jail.chroot).is_empty());
    std::fs::remove_dir_all(&jail.chroot).unwrap();
    assert!(!jail.chroot.exists());
}

#[test]
fn killing_the_waiter_kills_the_jailed_vmm() {
    if skip_unless_root("killing_the_waiter_kills_the_jailed_vmm") {
        return;
    }
    let Some(guest) = guest_or_skip("idle") else { return };
    let jail = Jail::new(false);
    let mut vmm = jail.spawn(&guest, &[]);
    jail.wait_for_serial(&mut vmm, "idle guest up");
    let pid = vmm_pid(vmm.pid());
    let run = vmm.kill_and_collect();
    assert_eq!(run.status.signal(), Some(libc::SIGKILL));
    wait_until(Duration::from_secs(10), "the VMM to die with its waiter", || is_dead(pid));
    assert!(host_mounts_under(&jail.chroot).is_empty());
}

#[test]
fn a_forbidden_syscall_kills_every_thread_kind_with_sigsys() {
    if skip_unless_root("a_forbidden_syscall_kills_every_thread_kind_with_sigsys") {
        return;
    }
    let Some(guest) = guest_or_skip("idle") else { return };
    for kind in ["vcpu", "event_loop", "api", "fs_backend", "fs_watchdog"] {
        let jail = Jail::new(false);
        // The fs threads start with the device, whether or not the guest drives it.
        let mut vm = jail.vm();
        vm["fs"] = serde_json::json!([{ "tag": "shared", "socket": "/run/fs0.sock" }]);
        let run = jail.spawn_vm(&jail.document(&guest), &vm, &[(PROBE_ENV, kind)]).wait();
        assert_eq!(run.status.code(), Some(SIGSYS_STATUS), "{kind}: the waiter relays 128+SIGSYS\n{}", run.stderr);
        assert!(run.stderr.contains("seccomp probe: calling a forbidden syscall"), "{kind}\n{}", run.stderr);
        assert!(run.stderr.contains(&format!("\"thread\":\"{kind}\"")), "{kind}\n{}", run.stderr);
        assert!(!run.stderr.contains("survived"), "{kind}\n{}", run.stderr);
    }

    // The waiter has a filter too: it dies of SIGSYS itself, and takes the VMM with it.
    let jail = Jail::new(false);
    let run = jail.spawn(&guest, &[(PROBE_ENV, "waiter")]).wait();
    assert_eq!(run.status.signal(), Some(libc::SIGSYS), "{}", run.stderr);
    let pid = logged_vmm_pid(&run.stderr);
    wait_until(Duration::from_secs(10), "the VMM to die with its waiter", || is_dead(pid));
}

/// The panic hook's eventfd is the VMM's own, made before the jail closes inherited fds: a jailed
/// VMM whose vCPU thread panics still stops the VM (exit 1 through the waiter, the panic on stderr)
/// instead of running on with a dead vCPU and writing the wake-up into whatever reused that fd.
#[test]
fn a_panic_probe_on_a_jailed_vcpu_ends_the_vm() {
    if skip_unless_root("a_panic_probe_on_a_jailed_vcpu_ends_the_vm") || !cfg!(debug_assertions) {
        return;
    }
    let Some(guest) = guest_or_skip("panic_probe") else { return };
    let jail = Jail::new(false);
    let run = jail.spawn(&guest, &[("BULKHEAD_VMM_PANIC_PROBE", "vcpu")]).wait();
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(run.stderr.contains("a guest write panicked the vCPU thread"), "{}", run.stderr);
    assert!(run.stderr.contains("bulkhead-vmm: VM failed"), "{}", run.stderr);
    assert!(!run.stderr.contains("cannot watch for thread panics"), "{}", run.stderr);
}

#[test]
fn seccomp_applies_without_the_jail() {
    let Some(guest) = guest_or_skip("idle") else { return };
    let dir = tempfile::tempdir().unwrap();
    let vmm = VmmProcess::spawn_with(dir.path(), &raw_config(dir.path(), &guest), GUEST_TIMEOUT, |cmd| {
        cmd.env(PROBE_ENV, "vcpu");
    });
    let run = vmm.wait();
    assert_eq!(run.status.signal(), Some(libc::SIGSYS), "{}", run.stderr);
    assert!(run.stderr.contains("seccomp probe: calling a forbidden syscall"), "{}", run.stderr);
}

#[test]
fn bad_jail_documents_are_refused_before_anything_changes() {
    if skip_unless_root("bad_jail_documents_are_refused_before_anything_changes") {
        return;
    }
    let Some(guest) = guest_or_skip("idle") else { return };
    type Spoil = fn(&Jail, &mut serde_json::Value);
    let cases: [(&str, Spoil, &str); 6] = [
        ("uid 0", |_, d| d["uid"] = 0.into(), "must not run as root"),
        ("chroot with ..", |j, d| d["chroot"] = format!("{}/../root", j.dir.path().display()).into(), "chroot"),
        ("read-only file escaping", |_, d| d["read_only"][0]["jail"] = "/../etc/passwd".into(), "read_only"),
        ("writable dir escaping", |_, d| d["writable_dirs"][0] = "/run/../../tmp".into(), "writable_dirs"),
        (
            "chroot not owned by root",
            |j, _| std::os::unix::fs::chown(&j.chroot, Some(1234), Some(1234)).unwrap(),
            "is owned by uid 1234, not root",
        ),
        (
            "chroot writable by others",
            |j, _| std::fs::set_permissions(&j.chroot, std::fs::Permissions::from_mode(0o777)).unwrap(),
            "writable by group or others",
        ),
    ];
    for (case, spoil, needle) in cases {
        let jail = Jail::new(false);
        let mut document = jail.document(&guest);
        spoil(&jail, &mut document);
        let run = jail.spawn_document(&document, &[]).wait();
        assert_eq!(run.status.code(), Some(1), "{case}\n{}", run.stderr);
        assert!(run.stderr.contains(needle), "{case}: wanted {needle:?}\n{}", run.stderr);
        assert!(
            run.stderr.contains("invalid jail config") || run.stderr.contains("jail refused"),
            "{case}\n{}",
            run.stderr
        );
        // Nothing changed: no cgroup, nothing in the chroot, nothing mounted.
        for dir in jail.cgroup_dirs() {
            assert!(!dir.exists(), "{case}: {} was created", dir.display());
        }
        assert_eq!(std::fs::read_dir(&jail.chroot).unwrap().count(), 0, "{case}: the chroot was touched");
        assert!(host_mounts_under(&jail.chroot).is_empty(), "{case}");
    }
}

const FS_CONTENT: &str = "bulkhead virtio-fs in a jail: these bytes came through the chroot's socket\n";

/// The layout the shim uses for a jailed VMM's virtio-fs (vmm/README.md, "virtio-fs in a jail"):
/// before either process starts, the shim binds the listening socket in a writable dir of the
/// chroot, gives it to the jail's uid (owner, mode 0600) and hands the listener to virtiofsd
/// (`--fd`), which runs as root outside the jail. The VM config names the socket's path inside
/// the chroot.
#[test]
fn jailed_vmm_reads_a_host_file_through_virtiofsd_on_a_socket_in_its_chroot() {
    if skip_unless_root("jailed_vmm_reads_a_host_file_through_virtiofsd_on_a_socket_in_its_chroot") {
        return;
    }
    let Some(guest) = guest_or_skip("fs") else { return };
    let jail = Jail::new(false);
    let shared = jail.dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("hello.txt"), FS_CONTENT).unwrap();

    // The shim's part: /run (a writable dir of the jail document) and the socket in it.
    let run_dir = jail.host("/run");
    std::fs::create_dir(&run_dir).unwrap();
    let socket = jail.host("/run/fs0.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::os::unix::fs::lchown(&socket, Some(UID), Some(GID)).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).unwrap();
    let virtiofsd = Virtiofsd::start_on_listener(&shared, listener, &jail.dir.path().join("virtiofsd.log"));

    let mut vm = jail.vm();
    vm["fs"] = serde_json::json!([{ "tag": "shared", "socket": "/run/fs0.sock" }]);
    let run = jail.spawn_vm(&jail.document(&guest), &vm, &[]).wait();
    let log = virtiofsd.log_text();
    assert_eq!(run.status.code(), Some(0), "{}\nserial:\n{}\nvirtiofsd:\n{log}", run.stderr, run.serial);
    assert!(run.serial.contains("driver ok\ninit 7."), "serial:\n{}\nvirtiofsd:\n{log}", run.serial);
    assert!(run.serial.contains(&format!("data<{FS_CONTENT}>\n")), "serial:\n{}", run.serial);
    assert!(run.serial.contains("fs done\n"), "serial:\n{}\nstderr:\n{}", run.serial, run.stderr);
    assert!(!run.stderr.contains("virtio-fs backend failed"), "{}", run.stderr);

    // The jail made /run the VMM's (the socket in it stays as the shim left it), and nothing
    // stays mounted.
    let dir = std::fs::metadata(&run_dir).unwrap();
    assert_eq!((dir.uid(), dir.gid(), dir.mode() & 0o7777), (UID, GID, 0o700));
    let sock = std::fs::symlink_metadata(&socket).unwrap();
    assert!(sock.file_type().is_socket());
    assert_eq!((sock.uid(), sock.gid(), sock.mode() & 0o7777), (UID, GID, 0o600));
    assert!(host_mounts_under(&jail.chroot).is_empty());
}

/// The counts a counter guest printed (complete `count <hex>` lines).
fn counts(text: &str) -> Vec<u64> {
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete.lines().filter_map(|l| l.strip_prefix("count ")).filter_map(|h| u64::from_str_radix(h, 16).ok()).collect()
}

/// A restored counter carries on from the snapshot: the template's console followed by the
/// restored one reads as one unbroken count. Joined, because the snapshot may cut a line: the
/// template printed `count 5` and the restored guest goes on with `\n`.
fn assert_counts_on(template: &str, restored: &str) {
    let all = counts(&format!("{template}{restored}"));
    assert!(all.len() > counts(template).len(), "the restored guest printed no count: {restored:?}");
    for (i, n) in all.iter().enumerate() {
        assert_eq!(*n, i as u64 + 1, "count broken at line {i}: template {template:?}\nrestored {restored:?}");
    }
}

/// The template and the pods as the shim runs them: the template VMM, jailed, writes its
/// snapshot into a writable dir of its chroot; the shim keeps the files in its template cache
/// (root's alone: the pods' VMMs open them before dropping root) and lists them read-only in
/// each pod's jail; a pod
/// restores them (`--prepare` then `restore`, or `--restore`) with paths inside its chroot.
#[test]
fn a_snapshot_taken_in_a_jail_restores_in_other_jails() {
    if skip_unless_root("a_snapshot_taken_in_a_jail_restores_in_other_jails") {
        return;
    }
    let Some(guest) = guest_or_skip("counter") else { return };
    let api_timeout = Duration::from_secs(30);
    let template = Jail::new(false);
    let mut vmm = template.spawn(&guest, &[]);
    template.wait_for_serial(&mut vmm, "count 3\n");
    let api = template.host("/run/api.sock");
    let resp = api_request(&api, &serde_json::json!({"cmd": "snapshot", "dir": "/run/snap"}), api_timeout);
    assert_eq!(resp["ok"], true, "{resp}");
    let snap = template.host("/run/snap");
    for f in ["state", "memory"] {
        let meta = std::fs::metadata(snap.join(f)).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o7777), (UID, GID, 0o600), "{f}");
    }
    let template_serial = std::fs::read_to_string(template.host("/run/serial.log")).unwrap();
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "shutdown"}), api_timeout)["ok"], true);
    let run = vmm.wait();
    assert_eq!(run.status.code(), Some(0), "{}", run.stderr);

    // The shim's template cache: root's alone (0700, files 0400), so the jailed VMM opens the
    // files before it drops root.
    let cache = template.dir.path().join("template");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).unwrap();
    for f in ["state", "memory"] {
        std::fs::copy(snap.join(f), cache.join(f)).unwrap();
        std::fs::set_permissions(cache.join(f), std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    let memory = std::fs::read(cache.join("memory")).unwrap();
    let pod_document = |pod: &Jail| {
        let mut doc = pod.document(&guest);
        doc["read_only"] = serde_json::json!([
            { "host": cache.join("state"), "jail": "/snapshot/state" },
            { "host": cache.join("memory"), "jail": "/snapshot/memory" },
        ]);
        doc
    };

    // A pod prepared ahead: the API thread answers (filtered) before the VM exists.
    let pod = Jail::new(false);
    let args = ["--prepare", "/snapshot", "--api-socket", "/run/api.sock"].map(OsStr::new);
    let mut vmm = pod.spawn_jailed(&pod_document(&pod), &args);
    let api = pod.host("/run/api.sock");
    wait_for_socket(&api, Duration::from_secs(10));
    let info = api_request(&api, &serde_json::json!({"cmd": "info"}), api_timeout);
    assert_eq!(info["info"]["state"], "prepared", "{info}");
    let pid = vmm_pid(vmm.pid());
    assert!(Jail::threads(pid).contains(&("api".into(), "2".into())), "{:?}", Jail::threads(pid));
    let restore = serde_json::json!({"cmd": "restore", "config": {"serial_log": "/run/serial.log"}});
    let restored = api_request(&api, &restore, api_timeout);
    assert_eq!(restored["ok"], true, "{restored}");
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "resume"}), api_timeout)["ok"], true);
    pod.wait_for_serial(&mut vmm, "count ");
    wait_until(GUEST_TIMEOUT, "three restored counts", || {
        counts(&std::fs::read_to_string(pod.host("/run/serial.log")).unwrap_or_default()).len() >= 3
    });
    // Every thread filtered, the snapshot files mounted read-only, nothing else of the host.
    wait_until(Duration::from_secs(10), "a filter on every thread", || {
        Jail::threads(pid).iter().all(|(_, mode)| mode == "2")
    });
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let mounts: Vec<(&str, &str)> =
        mountinfo.lines().map(|l| l.split(' ').collect::<Vec<_>>()).map(|f| (f[4], f[5])).collect();
    assert_eq!(mounts.iter().map(|m| m.0).collect::<Vec<_>>(), ["/", "/snapshot/state", "/snapshot/memory"]);
    assert!(mounts[1..].iter().all(|m| m.1.split(',').any(|f| f == "ro")), "{mountinfo}");
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "shutdown"}), api_timeout)["ok"], true);
    let run = vmm.wait();
    assert_eq!(run.status.code(), Some(0), "{}", run.stderr);
    assert_counts_on(&template_serial, &run.serial);

    // A pod restored at once; its run config is read on the host, its paths are the jail's.
    let pod = Jail::new(false);
    let run_config = pod.dir.path().join("restore.json");
    let run = serde_json::json!({"api_socket": "/run/api.sock", "serial_log": "/run/serial.log"});
    std::fs::write(&run_config, run.to_string()).unwrap();
    let args =
        [OsStr::new("--restore"), OsStr::new("/snapshot"), OsStr::new("--restore-config"), run_config.as_os_str()];
    let vmm = pod.spawn_jailed(&pod_document(&pod), &args);
    let api = pod.host("/run/api.sock");
    wait_for_socket(&api, Duration::from_secs(10));
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "resume"}), api_timeout)["ok"], true);
    wait_until(GUEST_TIMEOUT, "three restored counts", || {
        counts(&std::fs::read_to_string(pod.host("/run/serial.log")).unwrap_or_default()).len() >= 3
    });
    assert_eq!(api_request(&api, &serde_json::json!({"cmd": "shutdown"}), api_timeout)["ok"], true);
    let run = vmm.wait();
    assert_eq!(run.status.code(), Some(0), "{}", run.stderr);
    assert_counts_on(&template_serial, &run.serial);

    assert_eq!(std::fs::read(cache.join("memory")).unwrap(), memory, "no restore wrote the memory file");
    for jail in [&template, &pod] {
        assert!(host_mounts_under(&jail.chroot).is_empty(), "jail mounts leaked to the host");
    }
}
