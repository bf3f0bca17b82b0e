//! `cri_warm_start`: RunPodSandbox to "sandbox ready" through CRI on the `vm` backend, warm
//! (restored from a template) against cold (booted), on this host's containerd 1.6 (issue 22).
//!
//! On every host, with the agent stub (`vmm/tests/guests/agent_stub.rs`) in place of the kernel:
//! a no_std test guest that answers the shim's Version and SetupSandbox as the agent would, so the
//! pod gets ready, and what is timed is the runtime's path: template lookup, layout, network,
//! virtiofsd, the jailed VMM booting or restoring, the agent's handshake and SetupSandbox. No
//! kernel boots, so a cold start here is as cheap as it can be.
//!
//! Where the host probe says ordinary guests run on `bulkhead-vmm` (VMX/SVM), also with the real
//! guest (kernel, initramfs, agent): RunPodSandbox, then a container and its first ExecSync,
//! timed to the exec's answer. Elsewhere (PVM) that part prints why it did not run.
//!
//! Two handlers on one containerd, `bulkhead-cold` (`vm.start = "cold"`) and `bulkhead-warm`
//! (`"warm"`), take turns pod by pod; host-network pods, then pod-network pods (the harness's CNI
//! bridge, so the VM has a NIC and the template one too). The first warm pod builds the template
//! (reported apart). Prints p50/p95 per handler and the medians of the shim's start phases (its
//! `VM started` log line). Release shim and VMM; a 256 MiB guest.
//!
//! In the emulated AMD-V node (`make bench-node`, scripts/node-bench.sh) the real guest runs:
//! there every pod takes tens of seconds, so `BULKHEAD_BENCH_PODS` (pods per handler, default 20),
//! `BULKHEAD_BENCH_NETWORK` (`host`, `pod` or `both`, the default) and `BULKHEAD_BENCH_GUESTS`
//! (`real` leaves the stub out) keep the run within the node's bound. Figures from the node are
//! for comparing warm with cold in one run only: the guest is emulated twice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::guests::{self, GuestVmm};
use bulkhead_integration::{container_config, pod_config, skip_reason, Containerd, ContainerdConfig, RuntimeHandler};

/// Pods per handler unless `BULKHEAD_BENCH_PODS` says otherwise.
const PODS: usize = 20;
const WARMUP: usize = 2;
/// What the first warm pod (it builds the template) may take beyond the CRI call's bound.
const TEMPLATE_BUILD_ALLOWANCE: Duration = Duration::from_secs(600);

/// Pods per handler: `BULKHEAD_BENCH_PODS`, else [`PODS`].
fn pods() -> usize {
    std::env::var("BULKHEAD_BENCH_PODS").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(PODS)
}
const HANDLERS: [&str; 2] = ["bulkhead-cold", "bulkhead-warm"];
const GUEST_MIB: u32 = 256;
const JAIL_IDS: u32 = 40_600;

#[derive(Default)]
struct Samples {
    ready: Vec<Duration>,
    /// Per phase of the shim's `VM started` line, its times (ms).
    phases: BTreeMap<String, Vec<f64>>,
    /// How each pod started, per the shim (`warm` or `cold`).
    starts: BTreeMap<String, usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Network {
    Host,
    Pod,
}

impl Network {
    fn name(self) -> &'static str {
        match self {
            Network::Host => "host-network pods (no NIC)",
            Network::Pod => "pod-network pods (CNI bridge, one NIC)",
        }
    }
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let Some(last) = sorted.len().checked_sub(1) else { return Duration::ZERO };
    sorted[((p / 100.0) * last as f64).round() as usize]
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The shim's `VM started` line for `pod_id`: how it started and its phases (ms).
fn start_line(log: &str, pod_id: &str) -> Option<(String, Vec<(String, f64)>)> {
    let line = log.lines().rev().find(|l| l.contains(pod_id) && l.contains("VM started"))?;
    let start = line.split_whitespace().find_map(|t| t.strip_prefix("start="))?.trim_matches('"').to_string();
    let phases = line.split_once("phases=")?.1;
    let parsed = phases
        .split_whitespace()
        .filter_map(|kv| {
            let (name, v) = kv.split_once('=')?;
            Some((name.to_string(), v.strip_suffix("ms")?.parse().ok()?))
        })
        .collect();
    Some((start, parsed))
}

/// What the pods' VMs run.
#[derive(Clone)]
enum Guest {
    /// The agent stub test guest on the release VMM: timed to sandbox ready.
    Stub { guest: PathBuf, vmm: PathBuf },
    /// The real guest on `bulkhead-vmm`: timed to a container's first exec.
    Real,
}

impl Guest {
    fn name(&self) -> &'static str {
        match self {
            Guest::Stub { .. } => "agent stub guest, RunPodSandbox -> sandbox ready",
            Guest::Real => "real guest, RunPodSandbox -> container started -> first ExecSync answered",
        }
    }
}

async fn one_pod(
    containerd: &Containerd,
    handler: &str,
    network: Network,
    guest: &Guest,
    n: usize,
    samples: Option<&mut Samples>,
) -> Result<Duration> {
    let cri = containerd.cri().await?;
    let name = format!("warm-bench-{handler}-{n}");
    let mut pod = pod_config(&name, &containerd.new_log_dir(&name)?);
    if network == Network::Pod {
        bulkhead_integration::cri::use_pod_network(&mut pod)?;
    }
    let started = Instant::now();
    let extra = if n == 0 && handler == "bulkhead-warm" { TEMPLATE_BUILD_ALLOWANCE } else { Duration::ZERO };
    let pod_id = cri.run_pod_sandbox_allowing(&pod, handler, extra).await?;
    let ready = started.elapsed();
    let status = cri.pod_sandbox_status(&pod_id).await?;
    if status.state != k8s_cri::v1::PodSandboxState::SandboxReady as i32 {
        bail!("{handler}: pod {pod_id} is not ready after RunPodSandbox: {status:?}");
    }
    let ready = match guest {
        Guest::Stub { .. } => ready,
        Guest::Real => {
            let ctr = cri.create_container(&pod_id, &container_config("sleeper", &["sleep", "3600"]), &pod).await?;
            cri.start_container(&ctr).await?;
            let out = cri.exec_sync(&ctr, &["echo", "hi"], 30).await?;
            if out.stdout != b"hi\n" || out.exit_code != 0 {
                bail!("{handler}: ExecSync echo hi gave {:?}/{}", String::from_utf8_lossy(&out.stdout), out.exit_code);
            }
            started.elapsed()
        }
    };
    let line = start_line(&containerd.log_tail(2000), &pod_id);
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    let (start, phases) = line.with_context(|| format!("{handler}: no `VM started` line for pod {pod_id}"))?;
    if let Some(s) = samples {
        s.ready.push(ready);
        *s.starts.entry(start).or_default() += 1;
        for (phase, v) in phases {
            s.phases.entry(phase).or_default().push(v);
        }
    }
    Ok(ready)
}

/// The shim's config: the `vm` backend booting `guest`, cold or warm.
fn config(dir: &Path, state_dir: &Path, guest: &Guest, warm: bool) -> Result<PathBuf> {
    let start = if warm { "warm" } else { "cold" };
    let vm = format!(
        "start = \"{start}\"\ntemplate_dir = \"{}\"\njail_id_first = {JAIL_IDS}\njail_id_count = 16\n",
        dir.join("templates").display()
    );
    let text = match guest {
        Guest::Stub { guest, vmm } => {
            let initramfs = dir.join("initramfs.cpio.gz");
            std::fs::write(&initramfs, b"not read by the test guest")?;
            format!(
                "backend = \"vm\"\nstate_dir = \"{}\"\n\n[agent]\nconnect_timeout_ms = 20000\n\n\
                 [vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\n\
                 memory_mib = {GUEST_MIB}\n{vm}",
                state_dir.display(),
                vmm.display(),
                guest.display(),
                initramfs.display(),
                bulkhead_integration::virtiofsd_path().display(),
            )
        }
        Guest::Real => {
            // The harness's config pins cold starts; each handler here says its own.
            let base = guests::real_vm_config(
                state_dir,
                bulkhead_integration::vm_env::CONNECT_TIMEOUT_MS,
                GuestVmm::Bulkhead,
            )?;
            format!("{}{vm}", base.replace(guests::COLD, ""))
        }
    };
    let path = dir.join(format!("bulkhead-{start}.toml"));
    std::fs::write(&path, text)?;
    Ok(path)
}

async fn measure(dir: &Path, guest: &Guest, network: Network) -> Result<Vec<Samples>> {
    let state_dir = dir.join("s");
    let handlers = HANDLERS
        .iter()
        .map(|name| {
            let warm = *name == "bulkhead-warm";
            let config = config(dir, &state_dir, guest, warm)?;
            Ok(RuntimeHandler { name: (*name).into(), ..RuntimeHandler::bulkhead(Some(&config)) })
        })
        .collect::<Result<Vec<_>>>()?;
    let containerd =
        Containerd::start(ContainerdConfig { handlers, cni_bridge: network == Network::Pod, ..Default::default() })
            .await?;
    for n in 0..WARMUP {
        for handler in HANDLERS {
            let took = one_pod(&containerd, handler, network, guest, n, None)
                .await
                .with_context(|| format!("warm-up {handler}"))?;
            if n == 0 && handler == "bulkhead-warm" {
                println!("  first warm pod (builds the template on first use): {:.1} ms", ms(took));
            }
        }
    }
    let mut samples: Vec<Samples> = HANDLERS.iter().map(|_| Samples::default()).collect();
    for n in 0..pods() {
        for (handler, s) in HANDLERS.iter().zip(samples.iter_mut()) {
            one_pod(&containerd, handler, network, guest, WARMUP + n, Some(s))
                .await
                .with_context(|| format!("{handler} pod"))?;
        }
    }
    Ok(samples)
}

fn report(guest: &Guest, network: Network, samples: &[Samples]) {
    println!("cri_warm_start: {} pods per handler, {}, {} (ms)", pods(), network.name(), guest.name());
    for (handler, s) in HANDLERS.iter().zip(samples) {
        let starts: Vec<String> = s.starts.iter().map(|(k, v)| format!("{v} {k}")).collect();
        println!(
            "  {handler:<14} p50 {:>7.1}  p95 {:>7.1}   (the shim says: {})",
            ms(percentile(&s.ready, 50.0)),
            ms(percentile(&s.ready, 95.0)),
            starts.join(", ")
        );
        let phases: Vec<String> =
            s.phases.iter().map(|(name, v)| format!("{name} {:.1}", median(v))).collect::<Vec<_>>();
        println!("    shim's start phases, median ms: {}", phases.join(", "));
    }
    let (cold, warm) = (&samples[0].ready, &samples[1].ready);
    println!(
        "  warm/cold: p50 {:.2}, p95 {:.2}",
        ms(percentile(warm, 50.0)) / ms(percentile(cold, 50.0)).max(f64::EPSILON),
        ms(percentile(warm, 95.0)) / ms(percentile(cold, 95.0)).max(f64::EPSILON)
    );
}

async fn run() -> Result<()> {
    if let Some(reason) = skip_reason() {
        println!("SKIPPED: cri_warm_start: {reason}");
        return Ok(());
    }
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        println!("SKIPPED: cri_warm_start: {why}");
        return Ok(());
    }
    let bin_dir = bulkhead_integration::target_dir();
    if !bin_dir.join("containerd-shim-bulkhead-v2").is_file() {
        println!("SKIPPED: cri_warm_start: no release shim in {} (`make bench` builds it)", bin_dir.display());
        return Ok(());
    }
    std::env::set_var("BULKHEAD_BIN_DIR", &bin_dir);
    if !bulkhead_integration::virtiofsd_path().is_file() {
        println!("SKIPPED: cri_warm_start: virtiofsd is missing (run `make setup`)");
        return Ok(());
    }
    // The stub run builds its VMM and test guest with cargo: not where only the real guest runs
    // (the emulated node, whose root is read-only and whose CPU is emulated).
    let only_real = std::env::var("BULKHEAD_BENCH_GUESTS").is_ok_and(|v| v == "real");
    let mut runs = Vec::new();
    if !only_real {
        let vmm = match bulkhead_benches::vmm_binary() {
            Ok(vmm) => vmm,
            Err(why) => bail!("cri_warm_start: {why}"),
        };
        let stub = match guests::build("agent_stub", &bin_dir.join("bulkhead-test-guests")) {
            Ok(guest) => guest,
            Err(why) => {
                println!("SKIPPED: cri_warm_start: {why}");
                return Ok(());
            }
        };
        println!("cri_warm_start: shim from {}, VMM {}, guest {}", bin_dir.display(), vmm.display(), stub.display());
        runs.push(Guest::Stub { guest: stub, vmm });
    }
    match GuestVmm::Bulkhead.unavailable() {
        None => runs.push(Guest::Real),
        Some(guests::Unavailable::Host(why) | guests::Unavailable::Prerequisite(why)) => {
            println!("cri_warm_start: not with the real guest on bulkhead-vmm here: {why}")
        }
    }
    let networks = match std::env::var("BULKHEAD_BENCH_NETWORK").as_deref() {
        Ok("host") => vec![Network::Host],
        Ok("pod") => vec![Network::Pod],
        Ok("both") | Err(_) => vec![Network::Host, Network::Pod],
        Ok(other) => bail!("BULKHEAD_BENCH_NETWORK={other}: host, pod or both"),
    };
    if runs.is_empty() {
        bail!("cri_warm_start: BULKHEAD_BENCH_GUESTS=real, but the real guest does not run on bulkhead-vmm here");
    }
    for guest in &runs {
        for &network in &networks {
            // Short: the VMs' sockets live below it. Fresh per run, so the first warm pod builds.
            let dir = PathBuf::from(format!("/run/bhw{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let measured = measure(&dir, guest, network).await;
            let _ = std::fs::remove_dir_all(&dir);
            report(guest, network, &measured.with_context(|| format!("{}, {}", guest.name(), network.name()))?);
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; a filter argument that does not match skips the run.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "cri_warm_start".contains(a.as_str())) {
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
