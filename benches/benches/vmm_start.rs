//! `vmm_start`: how fast `bulkhead-vmm` gets a vCPU running, phase by phase, and what an idle
//! VMM costs.
//!
//! Two shapes, `RUNS` starts each (after one warm-up), interleaved so host drift hits both alike:
//! - `pod`: as the shim starts it (as root): first the pod's virtiofsd (its listener in the
//!   chroot, joined to the pod's cgroup before exec, as the shim does), then the VMM, jailed (a
//!   fresh chroot, that cgroup, a network namespace, the pod's uid), with the shim's device set
//!   (serial log, vsock, virtio-fs, balloon, API socket), 256 MiB, and the real guest kernel and
//!   initramfs (`guest-kernel/`, built and cached like the tests do). The goal (<= 5 ms spawn ->
//!   first KVM_RUN) is judged here.
//! - `bare`: no jail, no devices, a 3-byte raw guest (`hlt; jmp .-1`), 128 MiB: the figure this
//!   bench printed before the phase split.
//!
//! Each start: spawn, wait for the API socket, ask `info` for the boot phases (host KVM ioctls
//! apart from the VMM's own work) and the first KVM_RUN; the spawn -> `main` phase is this side's.
//! Then, once idle, the VMM's (and for `pod` its waiter's) RSS, PSS and USS.
//!
//! `BULKHEAD_BENCH_BASELINE=<dir>[:<dir>...]` adds each dir's `bulkhead-vmm` (a build with boot
//! phases) to every round: before/after figures of a change, in one run.
//! Skips with one line when /dev/kvm is unusable.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_benches::phases::{median, print_table, Start};
use bulkhead_benches::procmem::{mib, processes, Mem};
use bulkhead_benches::{baselines, unix_ns, vmm_binary};
use bulkhead_vmm_api::command_line::{self, VmmCommand};
use bulkhead_vmm_api::config::{BalloonConfig, FsConfig, VmConfig, VsockConfig, DEFAULT_CMDLINE};
use bulkhead_vmm_api::jail::{JailConfig, JailFile};
use bulkhead_vmm_api::memory::Mib;

const RUNS: usize = 20;
const GOAL_START_MS: f64 = 5.0;
const GOAL_RSS_MIB: f64 = 10.0;
/// The jail's uid and gid (no entry in /etc/passwd, as on a node).
const JAIL_ID: u32 = 41_924;

type Res<T> = Result<T, String>;

#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Pod,
    Bare,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Pod => "pod (jailed, shim's devices, real kernel + initramfs, 256 MiB)",
            Shape::Bare => "bare (no jail, no devices, 3-byte raw guest, 128 MiB)",
        }
    }
}

struct Sample {
    start: Start,
    /// The VMM's (and its waiter's) memory once idle.
    mem: Mem,
    vmm_rss_kib: u64,
}

/// What every `pod` start shares: the guest files, virtiofsd, a cgroup (made in every
/// hierarchy) and a network namespace.
struct PodHost {
    dir: PathBuf,
    kernel: PathBuf,
    initramfs: PathBuf,
    virtiofsd: PathBuf,
    cgroup: String,
    /// `cgroup.procs` of the cgroup in every hierarchy.
    procs: Vec<CString>,
    netns: Option<String>,
}

/// The `cgroup.procs` files of `cgroup` in every mounted hierarchy, made where missing (a new v1
/// cpuset cgroup gets its parent's cpus and mems, as the jail does).
fn make_cgroup(cgroup: &str) -> Res<Vec<CString>> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
    let mut procs = Vec::new();
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || !(f[2] == "cgroup" || f[2] == "cgroup2") {
            continue;
        }
        let (root, dir) = (Path::new(f[1]), Path::new(f[1]).join(cgroup.trim_start_matches('/')));
        if !dir.exists() {
            std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if f[3].split(',').any(|o| o == "cpuset") {
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    let v = std::fs::read_to_string(root.join(file)).map_err(|e| e.to_string())?;
                    std::fs::write(dir.join(file), v.trim()).map_err(|e| e.to_string())?;
                }
            }
        }
        let file = dir.join("cgroup.procs");
        procs.push(CString::new(file.into_os_string().into_encoded_bytes()).map_err(|e| e.to_string())?);
    }
    Ok(procs)
}

/// The pod's virtiofsd as the shim starts it: serving `shared` on `listener` (inherited), in the
/// pod's cgroup (joined between fork and exec).
fn spawn_virtiofsd(bin: &Path, shared: &Path, listener: &UnixListener, procs: Vec<CString>) -> Res<Child> {
    let fd = listener.as_raw_fd();
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--fd={fd}"))
        .arg("--shared-dir")
        .arg(shared)
        .args(["--sandbox", "namespace", "--seccomp", "kill", "--cache", "auto", "--modcaps=-mknod"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: between fork and exec: fcntl, open, write and close only, on an fd this process
    // holds and on paths made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            for file in &procs {
                let cg = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if cg < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(cg, b"0".as_ptr().cast(), 1);
                libc::close(cg);
                if written != 1 {
                    return Err(std::io::Error::other("join the cgroup"));
                }
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| format!("spawn {}: {e}", bin.display()))
}

impl PodHost {
    fn new(dir: &Path) -> Res<Self> {
        let (kernel, initramfs) = bulkhead_integration::guests::kernel_and_initramfs().map_err(|e| format!("{e:#}"))?;
        // The jail takes plain absolute paths only.
        let canonical = |p: PathBuf| std::fs::canonicalize(&p).map_err(|e| format!("{}: {e}", p.display()));
        let (kernel, initramfs) = (canonical(kernel)?, canonical(initramfs)?);
        let pid = std::process::id();
        let netns = format!("bhbench{pid}");
        let netns = Command::new("ip")
            .args(["netns", "add", &netns])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
            .then_some(netns);
        if netns.is_none() {
            println!("  (no `ip netns add` here: the pod shape starts without a network namespace)");
        }
        let virtiofsd = bulkhead_integration::virtiofsd_path();
        if !virtiofsd.is_file() {
            return Err(format!("{} is missing (make setup)", virtiofsd.display()));
        }
        let cgroup = format!("/bulkhead-bench-{pid}");
        let procs = make_cgroup(&cgroup)?;
        Ok(Self { dir: dir.to_owned(), kernel, initramfs, virtiofsd, cgroup, procs, netns })
    }

    /// A fresh root-owned chroot, the two documents and the pod's virtiofsd (started), as the
    /// shim lays them out and starts it.
    fn lay_out(&self, i: usize) -> Res<(PathBuf, PathBuf, PathBuf, Vmm)> {
        let pod = self.dir.join(format!("pod{i}"));
        let chroot = pod.join("root");
        let e = |e: std::io::Error| format!("{}: {e}", pod.display());
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&pod).map_err(e)?;
        std::fs::DirBuilder::new().mode(0o755).create(&chroot).map_err(e)?;
        std::fs::DirBuilder::new().mode(0o755).create(chroot.join("run")).map_err(e)?;
        std::fs::DirBuilder::new().mode(0o755).create(pod.join("shared")).map_err(e)?;
        let socket = chroot.join("run/fs0.sock");
        let listener = UnixListener::bind(&socket).map_err(e)?;
        std::os::unix::fs::lchown(&socket, Some(JAIL_ID), Some(JAIL_ID)).map_err(e)?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).map_err(e)?;
        let virtiofsd = Vmm(spawn_virtiofsd(&self.virtiofsd, &pod.join("shared"), &listener, self.procs.clone())?);
        let jail = JailConfig {
            id: format!("bench{i}"),
            chroot: chroot.clone(),
            uid: JAIL_ID,
            gid: JAIL_ID,
            read_only: vec![
                JailFile { host: self.kernel.clone(), jail: "/vmlinux".into() },
                JailFile { host: self.initramfs.clone(), jail: "/initramfs.cpio.gz".into() },
            ],
            writable_dirs: vec!["/run".into()],
            cgroup: Some(self.cgroup.clone().into()),
            netns: self.netns.as_ref().map(|n| format!("/run/netns/{n}").into()),
            tun: false,
        };
        let vm = VmConfig {
            kernel: Some("/vmlinux".into()),
            initramfs: Some("/initramfs.cpio.gz".into()),
            cmdline: Some(format!("{DEFAULT_CMDLINE} bulkhead.shared=bulkhead")),
            raw_guest: None,
            vcpus: 1,
            mem_mib: Mib(256),
            serial_log: Some("/run/console.log".into()),
            vsock: Some(VsockConfig { uds_path: "/run/vsock.sock".into(), guest_cid: 3 }),
            block: Vec::new(),
            // The VMM connects once the guest's driver is ready, which is after a start.
            fs: vec![FsConfig { tag: "bulkhead".into(), socket: "/run/fs0.sock".into(), queue_size: 1024 }],
            net: Vec::new(),
            api_socket: Some("/run/api.sock".into()),
            balloon: Some(BalloonConfig { free_page_reporting: true }),
        };
        let (jail_path, vm_path) = (pod.join("jail.json"), pod.join("vm.json"));
        let json = |v: serde_json::Result<Vec<u8>>| v.map_err(|e| e.to_string());
        std::fs::write(&jail_path, json(serde_json::to_vec(&jail))?).map_err(e)?;
        std::fs::write(&vm_path, json(serde_json::to_vec(&vm))?).map_err(e)?;
        Ok((vm_path, jail_path, chroot.join("run/api.sock"), virtiofsd))
    }

    /// The cgroup in every hierarchy (the jail made them), once every VMM is gone.
    fn remove(&self) {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2") {
                let _ = std::fs::remove_dir(Path::new(f[1]).join(self.cgroup.trim_start_matches('/')));
            }
        }
        if let Some(ns) = &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A spawned VMM (or virtiofsd), killed (by pid) with its children and reaped when dropped.
struct Vmm(Child);

impl Drop for Vmm {
    fn drop(&mut self) {
        let pid = self.0.id();
        let children = processes().into_iter().filter(|p| p.ppid == pid).map(|p| p.pid);
        for child in children.collect::<Vec<_>>() {
            // SAFETY: kill(2) on a child of the process this bench spawned, found just now.
            unsafe { libc::kill(child as i32, libc::SIGKILL) };
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn info(api: &Path) -> Res<serde_json::Value> {
    let mut s = UnixStream::connect(api).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    s.write_all(b"{\"cmd\":\"info\"}\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).map_err(|e| e.to_string())?;
    serde_json::from_str(&line).map_err(|e| e.to_string())
}

/// Waits for the first KVM_RUN; returns the `info` object.
fn first_kvm_run(api: &Path) -> Res<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(v) = info(api) {
            if v["info"]["first_kvm_run_unix_ns"].is_u64() {
                return Ok(v["info"].clone());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no KVM_RUN within 10 s ({})", api.display()));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Spawns `vmm` with its stderr in `err`; returns it and the time just before the spawn.
fn spawn(vmm: &Path, command: VmmCommand, err: &Path) -> Res<(Vmm, u64)> {
    let stderr = std::fs::File::create(err).map_err(|e| format!("{}: {e}", err.display()))?;
    let t0 = unix_ns();
    let child = Command::new(vmm)
        .args(command.to_args())
        .env("BULKHEAD_VMM_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", vmm.display()))?;
    Ok((Vmm(child), t0))
}

fn one_run(vmm: &Path, shape: Shape, dir: &Path, pod: Option<&PodHost>, i: usize) -> Res<Sample> {
    let err = dir.join(format!("vmm{i}.err"));
    let mut virtiofsd = None;
    let (child, t0, api) = match (shape, pod) {
        (Shape::Bare, _) => {
            let api = dir.join(format!("api{i}.sock"));
            let cfg = serde_json::json!({
                "raw_guest": { "image": dir.join("idle.bin"), "format": "flat", "load_addr": 0x100000 },
                "vcpus": 1,
                "mem_mib": 128,
                "api_socket": api,
            });
            let cfg_path = dir.join(format!("vm{i}.json"));
            std::fs::write(&cfg_path, cfg.to_string()).map_err(|e| e.to_string())?;
            let boot =
                VmmCommand { start: command_line::Start::Boot { config: cfg_path }, jail: None, log_json: false };
            let (child, t0) = spawn(vmm, boot, &err)?;
            (child, t0, api)
        }
        (Shape::Pod, Some(pod)) => {
            let (vm, jail, api, fsd) = pod.lay_out(i)?;
            virtiofsd = Some(fsd);
            let boot =
                VmmCommand { start: command_line::Start::Boot { config: vm }, jail: Some(jail), log_json: false };
            let (child, t0) = spawn(vmm, boot, &err)?;
            (child, t0, api)
        }
        (Shape::Pod, None) => return Err("no pod host".into()),
    };
    let v = first_kvm_run(&api).map_err(|e| {
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        format!("{e}; stderr: {}", stderr.trim())
    })?;
    let start = Start::from_boot_info(&v, Some(t0)).ok_or(format!("no boot phases in {v}"))?;
    // Let the VMM settle into idle before measuring memory.
    std::thread::sleep(Duration::from_millis(200));
    let waiter = child.0.id();
    let mut pids = vec![waiter];
    pids.extend(processes().into_iter().filter(|p| p.ppid == waiter).map(|p| p.pid));
    let mems: Vec<Mem> = pids.iter().filter_map(|p| Mem::of(*p)).collect();
    let vmm_rss_kib = Mem::of(*pids.last().unwrap_or(&waiter)).map_or(0, |m| m.rss);
    drop(child);
    drop(virtiofsd);
    if shape == Shape::Pod {
        // The jailed VMM dies with its waiter; its chroot can go once it is gone.
        let deadline = Instant::now() + Duration::from_secs(5);
        while pids.iter().any(|p| Path::new(&format!("/proc/{p}")).exists()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = std::fs::remove_dir_all(dir.join(format!("pod{i}")));
    }
    Ok(Sample { start, mem: Mem::sum(&mems), vmm_rss_kib })
}

struct Series {
    binary: String,
    shape: Shape,
    samples: Vec<Sample>,
}

fn report(series: &[Series]) {
    for s in series {
        let starts: Vec<Start> = s.samples.iter().map(|x| x.start.clone()).collect();
        let title = format!("{} -- {}", s.binary, s.shape.name());
        print_table(&title, "spawn -> first KVM_RUN", &starts, GOAL_START_MS);
        let med = |f: fn(&Sample) -> u64| median(s.samples.iter().map(|x| mib(f(x))).collect());
        let rss = med(|x| x.vmm_rss_kib);
        let what = if s.shape == Shape::Pod { "waiter + jailed VMM" } else { "VMM" };
        println!(
            "    idle {what}: PSS {:.2} MiB, USS {:.2} MiB, RSS {:.2} MiB; the VMM's RSS {rss:.2} MiB (goal <= {GOAL_RSS_MIB} MiB: {})",
            med(|x| x.mem.pss),
            med(|x| x.mem.uss),
            med(|x| x.mem.rss),
            if rss <= GOAL_RSS_MIB { "met" } else { "MISSED" }
        );
    }
}

fn main() -> std::io::Result<()> {
    // `cargo bench` passes --bench; a filter that is not ours means "not this bench".
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "vmm_start".contains(a.as_str())) {
        return Ok(());
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        println!("SKIPPED: vmm_start: {why}");
        return Ok(());
    }
    let vmm = match vmm_binary() {
        Ok(p) => p,
        Err(e) => {
            println!("SKIPPED: vmm_start: {e}");
            return Ok(());
        }
    };
    let mut binaries = vec![("this build".to_string(), vmm)];
    binaries.extend(baselines().into_iter().map(|(label, dir)| (label, dir.join("bulkhead-vmm"))));
    // Short: the pod shape's sockets live below it.
    let dir = PathBuf::from(format!("/run/bhs{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // hlt; jmp back to the hlt.
    std::fs::write(dir.join("idle.bin"), [0xf4, 0xeb, 0xfd])?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("vmm_start ({RUNS} starts per shape and binary, 1 vCPU, release build; loadavg {})", load.trim());
    for (label, path) in &binaries {
        println!("  {label}: {}", path.display());
    }
    // SAFETY: geteuid has no preconditions.
    let pod = if unsafe { libc::geteuid() } != 0 {
        println!("  pod shape SKIPPED: the jail needs root");
        None
    } else {
        match PodHost::new(&dir) {
            Ok(p) => Some(p),
            Err(e) => {
                println!("  pod shape SKIPPED: no guest kernel and initramfs ({e}); `make kernel initramfs`");
                None
            }
        }
    };
    let shapes: Vec<Shape> =
        [Shape::Pod, Shape::Bare].into_iter().filter(|s| *s == Shape::Bare || pod.is_some()).collect();
    let mut series: Vec<Series> = Vec::new();
    for (label, _) in &binaries {
        for shape in &shapes {
            series.push(Series { binary: label.clone(), shape: *shape, samples: Vec::new() });
        }
    }
    let result = (|| {
        let mut i = 0;
        // Round 0 is a warm-up (page cache, the cgroup's creation), not counted.
        for round in 0..=RUNS {
            for s in series.iter_mut() {
                let Some((_, path)) = binaries.iter().find(|(l, _)| *l == s.binary) else { continue };
                let sample = one_run(path, s.shape, &dir, pod.as_ref(), i)
                    .map_err(|e| format!("{} {}: run {round}: {e}", s.binary, s.shape.name()))?;
                i += 1;
                if round > 0 {
                    s.samples.push(sample);
                }
            }
        }
        Res::Ok(())
    })();
    if let Some(pod) = &pod {
        pod.remove();
    }
    let _ = std::fs::remove_dir_all(&dir);
    result.map_err(|e| std::io::Error::other(format!("vmm_start: {e}")))?;
    report(&series);
    Ok(())
}
