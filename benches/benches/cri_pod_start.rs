//! CRI pod start and ExecSync latency: `bulkhead` (namespace backend) against `runc`, in the
//! same run, on a private containerd of each line this host has: Debian 12's 1.6 and the 2.1
//! `make setup` unpacks (issue 21; a line that is missing is named and skipped).
//! - Host-network pods through containerd's `podsandbox` path on every line (a sandbox container,
//!   which bulkhead runs as the pod's sandbox without a pause process).
//! - On 2.x also pod-network pods (the CNI bridge), where `bulkhead-sandboxer` (`sandboxer =
//!   "shim"`: the shim's sandbox API, no pause container at all) runs beside `runc` and `bulkhead`
//!   on the `podsandbox` path. 2.1.9 cannot start a host-network pod through a shim sandboxer.
//!
//! Per pod: RunPodSandbox + CreateContainer + StartContainer (one timing), then
//! `EXECS_PER_POD` ExecSync `echo hi` calls (one timing each). Handlers alternate pod by pod
//! so that drift on the host hits both alike. Prints p50/p95 and the bulkhead/runc ratio.
//! Goals: pod start ratio <= 1.3, ExecSync ratio <= 1.5.
//!
//! It also samples, once per running pod, the RSS of the runtime's own host processes (not the
//! workload's): runc's shim and pause; bulkhead's shim, its launcher and the agent. That figure
//! feeds `overhead.podFixed` (runtimeclass/README.md).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::{
    container_config, pod_config, skip_reason, skip_reason_on, workspace_bin, Containerd, ContainerdConfig,
    ContainerdVersion, RuntimeHandler,
};

/// Pods measured per handler (after warm-up).
const PODS: usize = 20;
const WARMUP: usize = 2;
const EXECS_PER_POD: usize = 5;

#[derive(Default)]
struct Samples {
    pod_start: Vec<Duration>,
    exec_sync: Vec<Duration>,
    /// Runtime processes' RSS per running pod, KiB.
    rss_kib: Vec<u64>,
}

/// Executable names of each handler's per-pod host processes.
fn runtime_processes(handler: &str) -> &'static [&'static str] {
    match handler {
        "runc" => &["containerd-shim-runc-v2", "pause"],
        _ => &["containerd-shim-bulkhead-v2", "bulkhead-agent"],
    }
}

/// Sums VmRSS over processes whose executable's file name is in `names` (shared pages are
/// counted in each process, so this errs high). Only one pod runs at a time in this bench.
fn rss_of(names: &[&str]) -> u64 {
    let Ok(procs) = std::fs::read_dir("/proc") else { return 0 };
    let mut total = 0;
    for entry in procs.flatten() {
        let path = entry.path();
        let Ok(exe) = std::fs::read_link(path.join("exe")) else { continue };
        let name = exe.file_name().map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string());
        if !name.is_some_and(|n| names.contains(&n.as_str())) {
            continue;
        }
        let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
        total += kib.unwrap_or(0);
    }
    total
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn one_pod(
    containerd: &Containerd,
    handler: &str,
    network: Network,
    n: usize,
    samples: Option<&mut Samples>,
) -> Result<()> {
    let cri = containerd.cri().await?;
    let name = format!("bench-{handler}-{n}");
    let mut pod = pod_config(&name, &containerd.new_log_dir(&name)?);
    if network == Network::Pod {
        bulkhead_integration::cri::use_pod_network(&mut pod)?;
    }
    let ctr = container_config("sleeper", &["sleep", "3600"]);

    let started = Instant::now();
    let pod_id = cri.run_pod_sandbox(&pod, handler).await?;
    let ctr_id = cri.create_container(&pod_id, &ctr, &pod).await?;
    cri.start_container(&ctr_id).await?;
    let pod_start = started.elapsed();

    let rss_kib = rss_of(runtime_processes(handler));
    let mut execs = Vec::new();
    for _ in 0..EXECS_PER_POD {
        let started = Instant::now();
        let out = cri.exec_sync(&ctr_id, &["echo", "hi"], 10).await?;
        execs.push(started.elapsed());
        if out.stdout != b"hi\n" || out.exit_code != 0 {
            bail!("{handler}: ExecSync echo hi gave {:?}/{}", String::from_utf8_lossy(&out.stdout), out.exit_code);
        }
    }
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    if let Some(samples) = samples {
        samples.pod_start.push(pod_start);
        samples.exec_sync.extend(execs);
        samples.rss_kib.push(rss_kib);
    }
    Ok(())
}

async fn run() -> Result<()> {
    if let Some(reason) = skip_reason() {
        println!("SKIPPED: cri_pod_start: {reason}");
        return Ok(());
    }
    let bin_dir = choose_bin_dir();
    println!("cri_pod_start: shim and agent from {}", bin_dir.display());
    std::env::set_var("BULKHEAD_BIN_DIR", &bin_dir);
    let agent = workspace_bin("bulkhead-agent");
    if !agent.is_file() || !workspace_bin("containerd-shim-bulkhead-v2").is_file() {
        println!("SKIPPED: cri_pod_start: shim or agent not built (run `cargo build --workspace`)");
        return Ok(());
    }
    let state_dir = tempfile_dir()?;
    let config = state_dir.join("bulkhead.toml");
    std::fs::write(&config, bulkhead_integration::guests::namespace_config(&state_dir.join("s"), &agent))?;
    let result = async {
        for version in [ContainerdVersion::V1_6, ContainerdVersion::V2_1] {
            if let Some(reason) = skip_reason_on(version) {
                println!("cri_pod_start: not on containerd {version}: {reason}");
                continue;
            }
            let mut runs = vec![Network::Host];
            if version != ContainerdVersion::V1_6 && version != ContainerdVersion::V1_7 {
                runs.push(Network::Pod);
            }
            for network in runs {
                let samples = measure(version, &config, network)
                    .await
                    .with_context(|| format!("containerd {version}, {}", network.name()))?;
                report(version, network, &samples);
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&state_dir);
    result
}

#[derive(Clone, Copy, PartialEq)]
enum Network {
    /// Host-network pods: no CNI, so the runtime's own cost shows.
    Host,
    /// Pod-network pods on the harness's CNI bridge (what a shim sandboxer on 2.1 needs).
    Pod,
}

impl Network {
    fn name(self) -> &'static str {
        match self {
            Network::Host => "host-network pods",
            Network::Pod => "pod-network pods (CNI bridge)",
        }
    }

    fn handlers(self) -> &'static [&'static str] {
        match self {
            Network::Host => &["runc", "bulkhead"],
            Network::Pod => &["runc", "bulkhead", "bulkhead-sandboxer"],
        }
    }
}

/// Warm-up pods, then [`PODS`] pods per handler, handlers taking turns pod by pod, on a private
/// containerd `version`; the samples in `network.handlers()` order.
async fn measure(version: ContainerdVersion, config: &std::path::Path, network: Network) -> Result<Vec<Samples>> {
    let bulkhead = RuntimeHandler::bulkhead(Some(config));
    // The shim sandboxer's runtime has no options (2.1 would read them as runc's at StartContainer): its shims
    // find the config through BULKHEAD_CONFIG.
    let mut sandboxer = RuntimeHandler { name: "bulkhead-sandboxer".into(), options: vec![], ..bulkhead.clone() };
    sandboxer.settings.push(("sandboxer".into(), "shim".into()));
    let mut handlers = vec![RuntimeHandler::runc(), bulkhead];
    if network == Network::Pod {
        handlers.push(sandboxer);
    }
    let containerd = Containerd::start(ContainerdConfig {
        handlers,
        cni_bridge: network == Network::Pod,
        extra_toml: format!(
            "\n[plugins.'io.containerd.shim.v1.manager']\n  env = ['BULKHEAD_CONFIG={}']\n",
            config.display()
        ),
        version,
        ..Default::default()
    })
    .await?;
    for n in 0..WARMUP {
        for handler in network.handlers() {
            one_pod(&containerd, handler, network, n, None).await.with_context(|| format!("warm-up {handler}"))?;
        }
    }
    let mut samples: Vec<Samples> = network.handlers().iter().map(|_| Samples::default()).collect();
    for n in 0..PODS {
        for (handler, s) in network.handlers().iter().zip(samples.iter_mut()) {
            one_pod(&containerd, handler, network, WARMUP + n, Some(s))
                .await
                .with_context(|| format!("{handler} pod"))?;
        }
    }
    Ok(samples)
}

/// Release builds of the shim and agent when present (a fair match for runc), else the debug
/// builds `make build` leaves. BULKHEAD_BIN_DIR overrides both.
fn choose_bin_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("BULKHEAD_BIN_DIR") {
        return dir.into();
    }
    let here = bulkhead_integration::target_dir();
    let has_bins =
        |d: &std::path::Path| d.join("containerd-shim-bulkhead-v2").is_file() && d.join("bulkhead-agent").is_file();
    if has_bins(&here) {
        return here;
    }
    let debug = here.parent().map(|p| p.join("debug")).unwrap_or_default();
    if has_bins(&debug) {
        debug
    } else {
        here
    }
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    // Short: the agent socket lives below it.
    let dir = std::path::PathBuf::from(format!("/run/bhb{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn report(version: ContainerdVersion, network: Network, samples: &[Samples]) {
    println!(
        "cri_pod_start on containerd {version}: {PODS} pods per handler, {EXECS_PER_POD} ExecSync per pod, {}",
        network.name()
    );
    let handlers = network.handlers();
    let mut header = format!("{:<34}", "metric (ms)");
    for h in handlers {
        header.push_str(&format!(" {:>12} {:>12}", format!("{h} p50"), "p95"));
    }
    println!("{header}");
    let runc = &samples[0];
    for (name, pick, goal) in [
        ("RunPodSandbox+Create+Start", (|s: &Samples| s.pod_start.clone()) as fn(&Samples) -> Vec<Duration>, 1.3),
        ("ExecSync echo", |s: &Samples| s.exec_sync.clone(), 1.5),
    ] {
        let mut line = format!("{name:<34}");
        for s in samples {
            let v = pick(s);
            line.push_str(&format!(" {:>12.1} {:>12.1}", ms(percentile(&v, 50.0)), ms(percentile(&v, 95.0))));
        }
        println!("{line}");
        let r = pick(runc);
        for (h, s) in handlers.iter().zip(samples).skip(1) {
            let b = pick(s);
            let ratio = ms(percentile(&b, 50.0)) / ms(percentile(&r, 50.0)).max(f64::EPSILON);
            let verdict = if ratio <= goal { "meets" } else { "MISSES" };
            println!(
                "  ratio {h}/runc p50 = {ratio:.2} ({verdict} goal <= {goal}); p95 ratio = {:.2}",
                ms(percentile(&b, 95.0)) / ms(percentile(&r, 95.0)).max(f64::EPSILON)
            );
        }
    }
    let median_mib = |v: &[u64]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.get(v.len() / 2).map_or(0.0, |k| *k as f64 / 1024.0)
    };
    let rss: Vec<String> =
        handlers.iter().zip(samples).map(|(h, s)| format!("{h} {:.1}", median_mib(&s.rss_kib))).collect();
    println!(
        "host RSS of runtime processes per pod (MiB, median; runc: shim + pause, bulkhead: shim + launcher + agent): {}",
        rss.join(", ")
    );
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; a filter argument that does not match skips the run.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "cri_pod_start".contains(a.as_str())) {
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
