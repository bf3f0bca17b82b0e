//! `vm_pod`: what one `vm`-backend pod costs the host, measured where no Linux guest runs (PVM):
//! the idle test guest stands in for the kernel (as in `tests/integration/tests/vm_lifecycle.rs`),
//! so the guest touches almost no memory and the figures are the runtime's own floor.
//!
//! For N pods, one at a time, on a private containerd: RunPodSandbox (which waits for an agent
//! that never answers, then fails after `CONNECT_TIMEOUT_MS`); once the guest is up, sum VmRSS of
//! the pod's shim, the VMM (jail waiter + jailed VMM) and virtiofsd (main + sandboxed worker),
//! and ask the VMM's API `info` for its start and first-KVM_RUN times. Prints medians. Feeds
//! `overhead.podFixed` (runtimeclass/README.md). Skips with one line where it cannot run.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::host::processes_with;
use bulkhead_integration::{
    guests, pod_config, skip_reason, workspace_bin, Containerd, ContainerdConfig, RuntimeHandler,
};

const PODS: usize = 8;
const CONNECT_TIMEOUT_MS: u64 = 3000;

struct Sample {
    shim_kib: u64,
    vmm_kib: u64,
    virtiofsd_kib: u64,
    /// VMM `main` to its first KVM_RUN (jail, memory, devices, boot setup).
    start_to_run: Duration,
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn info(api: &Path) -> Result<serde_json::Value> {
    let mut s = UnixStream::connect(api).with_context(|| format!("connect {}", api.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"{\"cmd\":\"info\"}\n")?;
    let mut line = String::new();
    BufReader::new(s).take(16 * 1024).read_line(&mut line)?;
    Ok(serde_json::from_str(&line)?)
}

/// Waits until the pod's guest is up; returns the pod's state dir.
async fn wait_for_guest(state: &Path) -> Result<PathBuf> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pod = std::fs::read_dir(state).ok().and_then(|d| d.flatten().next()).map(|e| e.path());
        if let Some(pod) = pod {
            let console = std::fs::read_to_string(pod.join("vm/root/run/console.log")).unwrap_or_default();
            if console.contains("idle guest up") {
                return Ok(pod);
            }
        }
        if Instant::now() > deadline {
            bail!("the guest never came up");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn one_pod(containerd: &Containerd, state: &Path, n: usize) -> Result<Sample> {
    let cri = containerd.cri().await?;
    let name = format!("vm-pod-{n}");
    let pod = pod_config(&name, &containerd.new_log_dir(&name)?);
    let run = tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await });
    let pod_dir = wait_for_guest(state).await?;
    let pod_id = pod_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let sum = |needle: &str, exe: &str| -> u64 {
        processes_with(needle).into_iter().filter(|(_, cmd)| cmd.contains(exe)).map(|(pid, _)| rss_kib(pid)).sum()
    };
    let sample = Sample {
        shim_kib: sum(&format!("-id {pod_id}"), "containerd-shim-bulkhead-v2"),
        vmm_kib: sum(&pod_dir.join("vm/jail.json").display().to_string(), "bulkhead-vmm"),
        virtiofsd_kib: sum(&pod_dir.join("shared").display().to_string(), "virtiofsd"),
        start_to_run: {
            let info = info(&pod_dir.join("vm/root/run/api.sock"))?;
            let start = info.pointer("/info/start_unix_ns").and_then(serde_json::Value::as_u64);
            let run = info.pointer("/info/first_kvm_run_unix_ns").and_then(serde_json::Value::as_u64);
            match (start, run) {
                (Some(s), Some(r)) if r >= s => Duration::from_nanos(r - s),
                _ => bail!("API info without both times: {info}"),
            }
        },
    };
    if run.await?.is_ok() {
        bail!("a pod whose guest has no agent started");
    }
    Ok(sample)
}

fn median<T: Copy + Ord>(mut v: Vec<T>) -> T {
    v.sort_unstable();
    v[v.len() / 2]
}

async fn run() -> Result<()> {
    let skip = |why: &str| println!("SKIPPED: vm_pod: {why}");
    if let Some(reason) = skip_reason() {
        skip(&reason);
        return Ok(());
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        skip(&why);
        return Ok(());
    }
    let virtiofsd = bulkhead_integration::virtiofsd_path();
    let (vmm, shim) = (workspace_bin("bulkhead-vmm"), workspace_bin("containerd-shim-bulkhead-v2"));
    for bin in [&vmm, &shim, &virtiofsd] {
        if !bin.is_file() {
            skip(&format!("{} is missing (make setup; cargo build --workspace)", bin.display()));
            return Ok(());
        }
    }
    let dir = PathBuf::from(format!("/run/bhv{}", std::process::id()));
    std::fs::create_dir_all(dir.join("s"))?;
    let result = async {
        let guest = match guests::build("idle", &dir) {
            Ok(guest) => guest,
            Err(why) => {
                skip(&why);
                return Ok(());
            }
        };
        let initramfs = dir.join("initramfs");
        std::fs::write(&initramfs, b"not read by the test guest")?;
        let config = dir.join("bulkhead.toml");
        std::fs::write(
            &config,
            format!(
                "backend = \"vm\"\nstate_dir = \"{}\"\n[agent]\nconnect_timeout_ms = {CONNECT_TIMEOUT_MS}\n[vm]\n\
                 vmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\n",
                dir.join("s").display(),
                vmm.display(),
                guest.display(),
                initramfs.display(),
                virtiofsd.display()
            ),
        )?;
        let containerd = Containerd::start(ContainerdConfig {
            handlers: vec![RuntimeHandler::bulkhead(Some(&config))],
            ..Default::default()
        })
        .await?;
        let mut samples = Vec::new();
        for n in 0..PODS {
            samples.push(one_pod(&containerd, &dir.join("s"), n).await.with_context(|| format!("pod {n}"))?);
        }
        let mib = |kib: u64| kib as f64 / 1024.0;
        let (shim, vmm_kib, fsd) = (
            median(samples.iter().map(|s| s.shim_kib).collect()),
            median(samples.iter().map(|s| s.vmm_kib).collect()),
            median(samples.iter().map(|s| s.virtiofsd_kib).collect()),
        );
        let total = median(samples.iter().map(|s| s.shim_kib + s.vmm_kib + s.virtiofsd_kib).collect());
        let start = median(samples.iter().map(|s| s.start_to_run).collect());
        println!("vm_pod: {PODS} idle test-guest pods, one at a time, binaries from {}", vmm.display());
        println!(
            "host RSS per pod (MiB, median): shim {:.1} + VMM {:.1} (waiter + jailed VMM) + virtiofsd {:.1} (main + worker) = {:.1}",
            mib(shim),
            mib(vmm_kib),
            mib(fsd),
            mib(total)
        );
        println!("VMM main -> first KVM_RUN (API info, median): {:.1} ms", start.as_secs_f64() * 1e3);
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; a filter argument that does not match skips the run.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "vm_pod".contains(a.as_str())) {
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
