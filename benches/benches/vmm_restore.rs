//! `vmm_restore`: how fast a snapshot of a 256 MiB guest becomes a running vCPU again, and what
//! each additional VM restored from one snapshot costs in memory.
//!
//! Setup: boot the release `bulkhead-vmm` with a flat guest that writes one word into each page
//! of 64 MiB ("template data"), prints `R`, then reads every one of those pages, dirties 1 MiB
//! of its own and prints `P` before halting. The VM is snapshotted after `R`.
//!
//! - cold path: spawn `bulkhead-vmm --restore` with a restore config that says `resume`, as the
//!   shim's does (the guest runs once restored, no API round trip); time from just before spawn
//!   to the first KVM_RUN, and the VMM's own restore phases (host KVM ioctls apart from the
//!   VMM's work).
//! - pooled path: a `bulkhead-vmm --prepare` process did the host-heavy half already; time from
//!   the `restore` request to the first KVM_RUN.
//! - memory: 10 restores of the one snapshot side by side, each run until `P`; PSS of every VMM
//!   from /proc/<pid>/smaps_rollup after each start.
//! - virtio-fs templates: the same guest with a virtio-fs device (never probed by this flat
//!   guest, so no virtiofsd is needed); cold path and memory again, for the 64 MiB template and
//!   for one whose guest wrote 240 MiB. The device's backend sees only its relay region, so the
//!   memory file is mapped privately as without virtio-fs (before the relay it was copied into
//!   a memfd: 66.95 ms and +65.2 MiB per VM). `kvm_snapshot`'s virtio-fs test proves a probed
//!   device serves FUSE from the pod's own virtiofsd after such a restore.
//!
//! Goals: restore -> running <= 5 ms; each additional VM <= 10% of guest size (PSS).
//! Skips with one line when /dev/kvm is unusable.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_benches::{unix_ns, vmm_binary};
use bulkhead_vmm_api::command_line::{Start, VmmCommand};

const RUNS: usize = 10;
const MEMORY_VMS: usize = 10;
const GUEST_MIB: u64 = 256;
const GOAL_RESTORE_MS: f64 = 5.0;
const GOAL_EXTRA_VM_FRACTION: f64 = 0.10;
const WAIT: Duration = Duration::from_secs(60);

/// Pages the template guest writes (64 MiB from 16 MiB on), and the most it may (up to 256 MiB).
const TEMPLATE_PAGES: u32 = 16384;
const DENSE_PAGES: u32 = 61440;

/// Flat 64-bit guest, loaded at 1 MiB (see the module doc for what it does); it writes and
/// reads back `pages` pages (patched into both loop counts).
fn guest_code(pages: u32) -> Vec<u8> {
    let mut code = GUEST.to_vec();
    for at in [10, 49] {
        code[at..at + 4].copy_from_slice(&pages.to_le_bytes());
    }
    code
}

const GUEST: &[u8] = &[
    0x48, 0xc7, 0xc7, 0x00, 0x00, 0x00, 0x01, // mov rdi, 0x1000000
    0x48, 0xc7, 0xc1, 0x00, 0x40, 0x00, 0x00, // mov rcx, 16384 pages (64 MiB)
    0x48, 0x89, 0x3f, // 1: mov [rdi], rdi
    0x48, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, // add rdi, 4096
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf1, // jnz 1b
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'R', 0xee, 0xb0, b'\n', 0xee, // "R\n"
    0x48, 0xc7, 0xc7, 0x00, 0x00, 0x00, 0x01, // mov rdi, 0x1000000
    0x48, 0xc7, 0xc1, 0x00, 0x40, 0x00, 0x00, // mov rcx, 16384
    0x48, 0x8b, 0x07, // 2: mov rax, [rdi]
    0x48, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, // add rdi, 4096
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf1, // jnz 2b
    0x48, 0xc7, 0xc7, 0x00, 0x00, 0x00, 0x05, // mov rdi, 0x5000000
    0x48, 0xc7, 0xc1, 0x00, 0x01, 0x00, 0x00, // mov rcx, 256 pages (1 MiB)
    0x48, 0x89, 0x3f, // 3: mov [rdi], rdi
    0x48, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, // add rdi, 4096
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf1, // jnz 3b
    0xb0, b'P', 0xee, 0xb0, b'\n', 0xee, // "P\n"
    0xf4, 0xeb, 0xfd, // hlt; jmp back to the hlt
];

type Res<T> = Result<T, String>;

/// A VMM child that is killed (by PID) when dropped.
struct Vmm(Child);

impl Vmm {
    fn spawn(vmm: &Path, start: Start) -> Res<Self> {
        let child = Command::new(vmm)
            .args(VmmCommand { start, jail: None, log_json: false }.to_args())
            .env("BULKHEAD_VMM_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn: {e}"))?;
        Ok(Self(child))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Res<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("{what}: not within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

/// An API connection: one JSON line out, one back.
struct Api(UnixStream, BufReader<UnixStream>);

impl Api {
    /// Connects once the socket listens (its file appears at bind, a moment before listen).
    fn connect_when_listening(path: &Path) -> Res<Self> {
        let deadline = Instant::now() + WAIT;
        loop {
            match Self::connect(path) {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_micros(50)),
            }
        }
    }

    fn connect(path: &Path) -> Res<Self> {
        let s = UnixStream::connect(path).map_err(|e| format!("{}: {e}", path.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        let r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
        Ok(Self(s, r))
    }

    fn call(&mut self, req: &serde_json::Value) -> Res<serde_json::Value> {
        self.0.write_all(format!("{req}\n").as_bytes()).map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.1.read_line(&mut line).map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("{line:?}: {e}"))?;
        if v["ok"] != true {
            return Err(format!("{req} failed: {v}"));
        }
        Ok(v)
    }
}

fn first_kvm_run(api: &Path) -> Res<serde_json::Value> {
    wait_for("the restored VM's API socket", WAIT, || api.exists())?;
    let mut conn = Api::connect_when_listening(api)?;
    let deadline = Instant::now() + WAIT;
    loop {
        let v = conn.call(&serde_json::json!({"cmd": "info"}))?;
        if v["info"]["first_kvm_run_unix_ns"].is_u64() {
            return Ok(v["info"].clone());
        }
        if Instant::now() > deadline {
            return Err("no KVM_RUN after the restore".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn serial_has(path: &Path, needle: &str) -> bool {
    std::fs::read_to_string(path).map(|t| t.contains(needle)).unwrap_or(false)
}

/// A template: how much its guest writes, and whether it has a virtio-fs device.
#[derive(Clone, Copy)]
struct Template {
    name: &'static str,
    pages: u32,
    fs: bool,
}

/// Boots the template guest and snapshots it after its data is written.
fn make_snapshot(vmm: &Path, dir: &Path, t: Template) -> Res<PathBuf> {
    let guest = dir.join(format!("{}.bin", t.name));
    std::fs::write(&guest, guest_code(t.pages)).map_err(|e| e.to_string())?;
    let (api, serial) = (dir.join(format!("{}.sock", t.name)), dir.join(format!("{}.log", t.name)));
    let mut cfg = serde_json::json!({
        "raw_guest": { "image": guest, "format": "flat", "load_addr": 0x100000 },
        "vcpus": 1,
        "mem_mib": GUEST_MIB,
        "api_socket": api,
        "serial_log": serial,
    });
    if t.fs {
        // Never probed by this guest: nothing connects to the socket.
        cfg["fs"] = serde_json::json!([{ "tag": "rootfs", "socket": dir.join("template-fs.sock") }]);
    }
    let cfg_path = dir.join(format!("{}.json", t.name));
    std::fs::write(&cfg_path, cfg.to_string()).map_err(|e| e.to_string())?;
    let _vm = Vmm::spawn(vmm, Start::Boot { config: cfg_path.clone() })?;
    wait_for("template guest data", WAIT, || serial_has(&serial, "R\n"))?;
    let snap = dir.join(format!("{}-snap", t.name));
    let v = Api::connect(&api)?.call(&serde_json::json!({"cmd": "snapshot", "dir": snap}))?;
    let s = &v["snapshot"];
    println!(
        "  snapshot `{}`: state {} B, memory file {} MiB ({} MiB of data), pause {} us, save {} us, write {} ms",
        t.name,
        s["state_bytes"],
        s["memory_bytes"].as_u64().unwrap_or(0) >> 20,
        s["memory_written_bytes"].as_u64().unwrap_or(0) >> 20,
        s["pause_us"],
        s["save_us"],
        s["write_us"].as_u64().unwrap_or(0) / 1000,
    );
    Ok(snap)
}

/// A run's settings: its sockets and log; a virtio-fs template's run names its own (unused)
/// virtiofsd socket.
fn run_config(dir: &Path, name: &str, t: Template) -> Res<(PathBuf, PathBuf, PathBuf)> {
    let (api, serial) = (dir.join(format!("{name}.sock")), dir.join(format!("{name}.log")));
    let path = dir.join(format!("{name}.json"));
    let mut cfg = serde_json::json!({"api_socket": api, "serial_log": serial, "resume": true});
    if t.fs {
        cfg["fs_sockets"] = serde_json::json!([dir.join(format!("{name}-fs.sock"))]);
    }
    std::fs::write(&path, cfg.to_string()).map_err(|e| e.to_string())?;
    Ok((path, api, serial))
}

struct Sample {
    total_ms: f64,
    in_process_ms: f64,
    restored_to_run_ms: f64,
    phases: Vec<(String, f64, bool)>,
}

fn phases_of(info: &serde_json::Value) -> Vec<(String, f64, bool)> {
    info["restore"]["phases"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    let name = p["name"].as_str().unwrap_or("?").to_string();
                    (name, p["us"].as_u64().unwrap_or(0) as f64 / 1000.0, p["host"] == true || p["kvm"] == true)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Cold path: a new process restores, running at once.
fn cold(vmm: &Path, snap: &Path, dir: &Path, t: Template, i: usize) -> Res<Sample> {
    let (cfg, api, _) = run_config(dir, &format!("{}-cold{i}", t.name), t)?;
    let t0 = unix_ns();
    let _vm = Vmm::spawn(vmm, Start::Restore { snapshot: snap.to_path_buf(), restore_config: cfg.to_path_buf() })?;
    let info = first_kvm_run(&api)?;
    let first = info["first_kvm_run_unix_ns"].as_u64().unwrap_or(0);
    let start = info["start_unix_ns"].as_u64().unwrap_or(0);
    let ready = info["restore"]["ready_unix_ns"].as_u64().unwrap_or(0);
    Ok(Sample {
        total_ms: first.saturating_sub(t0) as f64 / 1e6,
        in_process_ms: first.saturating_sub(start) as f64 / 1e6,
        restored_to_run_ms: first.saturating_sub(ready) as f64 / 1e6,
        phases: phases_of(&info),
    })
}

/// Pooled path: a prepared process is restored on request, running at once.
fn pooled(vmm: &Path, snap: &Path, dir: &Path, i: usize) -> Res<Sample> {
    let api = dir.join(format!("pool{i}.sock"));
    let serial = dir.join(format!("pool{i}.log"));
    let _vm = Vmm::spawn(vmm, Start::Prepare { snapshot: snap.to_path_buf(), api_socket: api.to_path_buf() })?;
    wait_for("prepared API socket", WAIT, || api.exists())?;
    let mut conn = Api::connect_when_listening(&api)?;
    conn.call(&serde_json::json!({"cmd": "info"}))?;
    let t0 = unix_ns();
    let config = serde_json::json!({"serial_log": serial, "resume": true});
    let restored = conn.call(&serde_json::json!({"cmd": "restore", "config": config}))?;
    let info = first_kvm_run(&api)?;
    let first = info["first_kvm_run_unix_ns"].as_u64().unwrap_or(0);
    let requested = restored["restore"]["requested_unix_ns"].as_u64().unwrap_or(0);
    let ready = restored["restore"]["ready_unix_ns"].as_u64().unwrap_or(0);
    Ok(Sample {
        total_ms: first.saturating_sub(t0) as f64 / 1e6,
        in_process_ms: first.saturating_sub(requested) as f64 / 1e6,
        restored_to_run_ms: first.saturating_sub(ready) as f64 / 1e6,
        phases: phases_of(&restored),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn report(name: &str, samples: &[Sample], request_label: &str) {
    let total = median(samples.iter().map(|s| s.total_ms).collect());
    let min = samples.iter().map(|s| s.total_ms).fold(f64::MAX, f64::min);
    let max = samples.iter().map(|s| s.total_ms).fold(0.0, f64::max);
    println!(
        "  {name}: {request_label} -> first KVM_RUN: median {total:.2} ms (min {min:.2}, max {max:.2}); goal <= {GOAL_RESTORE_MS} ms: {}",
        if total <= GOAL_RESTORE_MS { "met" } else { "MISSED" }
    );
    println!(
        "    inside the VMM: median {:.2} ms; of which restored -> first KVM_RUN {:.2} ms",
        median(samples.iter().map(|s| s.in_process_ms).collect()),
        median(samples.iter().map(|s| s.restored_to_run_ms).collect()),
    );
    let mut by_phase: BTreeMap<(usize, String, bool), Vec<f64>> = BTreeMap::new();
    for s in samples {
        for (i, (n, ms, kvm)) in s.phases.iter().enumerate() {
            by_phase.entry((i, n.clone(), *kvm)).or_default().push(*ms);
        }
    }
    let (mut kvm_ms, mut vmm_ms) = (0.0, 0.0);
    for ((_, n, kvm), v) in by_phase {
        let m = median(v);
        if kvm {
            kvm_ms += m;
        } else {
            vmm_ms += m;
        }
        println!("    {:>7.3} ms  {}  {n}", m, if kvm { "host KVM" } else { "VMM     " });
    }
    println!("    phases total: host KVM ioctls {kvm_ms:.2} ms, VMM's own work {vmm_ms:.2} ms");
}

fn pss_kib(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    Some((field("Pss:")?, field("Rss:")?))
}

/// Restores MEMORY_VMS VMs side by side; returns the total PSS after each one ran to `P`.
fn memory(vmm: &Path, snap: &Path, dir: &Path, t: Template) -> Res<()> {
    let mut vms = Vec::new();
    let mut totals = Vec::new();
    let mut last = Vec::new();
    for i in 0..MEMORY_VMS {
        let (cfg, api, serial) = run_config(dir, &format!("{}-mem{i}", t.name), t)?;
        let vm = Vmm::spawn(vmm, Start::Restore { snapshot: snap.to_path_buf(), restore_config: cfg.to_path_buf() })?;
        wait_for("restored API socket", WAIT, || api.exists())?;
        wait_for("guest pass over its memory", WAIT, || serial_has(&serial, "P\n"))?;
        vms.push(vm);
        // Let the page cache and the VMMs settle.
        std::thread::sleep(Duration::from_millis(100));
        last = vms.iter().map(|v| pss_kib(v.pid()).ok_or("cannot read smaps_rollup")).collect::<Result<Vec<_>, _>>()?;
        totals.push(last.iter().map(|(p, _)| p).sum::<u64>());
    }
    let guest_kib = GUEST_MIB * 1024;
    let marginal_kib = (totals[MEMORY_VMS - 1] - totals[0]) as f64 / (MEMORY_VMS - 1) as f64;
    let per_vm = median(last.iter().map(|(p, _)| *p as f64).collect());
    let rss = median(last.iter().map(|(_, r)| *r as f64).collect());
    let goal = GOAL_EXTRA_VM_FRACTION * guest_kib as f64;
    println!(
        "  memory (`{}`): {MEMORY_VMS} VMs restored from one snapshot, each read {} MiB of template data and dirtied 1 MiB",
        t.name,
        t.pages / 256
    );
    println!(
        "    total PSS after each VM (MiB): {}",
        totals.iter().map(|t| format!("{:.1}", *t as f64 / 1024.0)).collect::<Vec<_>>().join(", ")
    );
    let verdict = if marginal_kib <= goal { "met" } else { "MISSED" };
    println!(
        "    each additional VM: {:.1} MiB PSS ({:.1}% of the {GUEST_MIB} MiB guest); goal <= {:.0}%: {verdict}",
        marginal_kib / 1024.0,
        100.0 * marginal_kib / guest_kib as f64,
        GOAL_EXTRA_VM_FRACTION * 100.0,
    );
    println!(
        "    with all {MEMORY_VMS} running: median PSS {:.1} MiB, RSS {:.1} MiB per VMM (RSS counts the shared pages in full)",
        per_vm / 1024.0,
        rss / 1024.0
    );
    Ok(())
}

fn main() -> std::io::Result<()> {
    // `cargo bench` passes --bench; a filter that is not ours means "not this bench".
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "vmm_restore".contains(a.as_str())) {
        return Ok(());
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        println!("SKIPPED: vmm_restore: {why}");
        return Ok(());
    }
    let vmm = match vmm_binary() {
        Ok(p) => p,
        Err(e) => {
            println!("SKIPPED: vmm_restore: {e}");
            return Ok(());
        }
    };
    let fail = |what: &str, e: String| std::io::Error::other(format!("vmm_restore: {what}: {e}"));
    let dir = tempfile::tempdir()?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "vmm_restore (1 vCPU, {GUEST_MIB} MiB guest, release build, {RUNS} runs per path; loadavg {})",
        load.trim()
    );
    let plain = Template { name: "template", pages: TEMPLATE_PAGES, fs: false };
    let snap = make_snapshot(&vmm, dir.path(), plain).map_err(|e| fail("template", e))?;

    let mut samples = Vec::new();
    for i in 0..RUNS {
        samples.push(cold(&vmm, &snap, dir.path(), plain, i).map_err(|e| fail("cold restore", e))?);
    }
    report("cold path (`bulkhead-vmm --restore`)", &samples, "spawn");

    let mut samples = Vec::new();
    for i in 0..RUNS {
        samples.push(pooled(&vmm, &snap, dir.path(), i).map_err(|e| fail("pooled restore", e))?);
    }
    report("pooled path (`--prepare`, then `restore`)", &samples, "`restore` request");

    memory(&vmm, &snap, dir.path(), plain).map_err(|e| fail("memory", e))?;

    for t in [
        Template { name: "fs-template", pages: TEMPLATE_PAGES, fs: true },
        Template { name: "fs-dense", pages: DENSE_PAGES, fs: true },
    ] {
        let snap = make_snapshot(&vmm, dir.path(), t).map_err(|e| fail(t.name, e))?;
        let mut samples = Vec::new();
        for i in 0..RUNS {
            samples.push(cold(&vmm, &snap, dir.path(), t, i).map_err(|e| fail("cold restore (virtio-fs)", e))?);
        }
        report(&format!("cold path, `{}` (virtio-fs)", t.name), &samples, "spawn");
        memory(&vmm, &snap, dir.path(), t).map_err(|e| fail("memory (virtio-fs)", e))?;
    }
    Ok(())
}
