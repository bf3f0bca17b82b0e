//! `make demo`: runs one Pod through containerd's CRI with the `bulkhead` handler on a
//! private containerd, and prints its output, an ExecSync result and each step's time. It uses
//! the `vm` backend where the host probe says ordinary guests run, and says in one line why it
//! uses the `namespace` backend elsewhere.

use anyhow::{bail, Context, Result};
use bulkhead_integration::{container_config, pod_config, skip_reason, Containerd, ContainerdConfig, RuntimeHandler};
use bulkhead_vmm_api::probe::KvmKind;
use std::path::PathBuf;
use std::time::{Duration, Instant};

struct Steps(Vec<(&'static str, Duration)>);

impl Steps {
    async fn time<T>(&mut self, name: &'static str, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let start = Instant::now();
        let out = fut.await.with_context(|| format!("step '{name}' failed"))?;
        let took = start.elapsed();
        println!("  {name:<28} {:>8.1} ms", took.as_secs_f64() * 1e3);
        self.0.push((name, took));
        Ok(out)
    }
}

#[tokio::main]
async fn main() {
    if let Err(e) = demo().await {
        eprintln!("bulkhead demo failed: {e:#}");
        std::process::exit(1);
    }
}

async fn demo() -> Result<()> {
    if let Some(reason) = skip_reason() {
        bail!("the demo cannot run here: {reason}");
    }
    let backend = match KvmKind::probe().ordinary_guests() {
        Ok(()) => {
            println!("bulkhead demo: this host runs VMs; building the guest kernel and initramfs (cached)...");
            let (kernel, initramfs) = bulkhead_integration::guests::kernel_and_initramfs()?;
            Backend::Vm { kernel, initramfs }
        }
        Err(why) => {
            println!("bulkhead demo: using the `namespace` backend (NO VM isolation), because {why}.");
            Backend::Namespace
        }
    };
    let shim = bulkhead_integration::workspace_bin("containerd-shim-bulkhead-v2");
    if !shim.exists() {
        bail!("{} is missing; run `make build` first", shim.display());
    }

    let cfg_dir = tempfile::tempdir()?;
    let cfg_path = cfg_dir.path().join("bulkhead.toml");
    std::fs::write(&cfg_path, backend.shim_config())?;

    println!("bulkhead demo: backend `{}`, shim {}", backend.name(), shim.display());
    let mut steps = Steps(vec![]);
    let containerd = steps
        .time("start private containerd", async {
            Containerd::start(ContainerdConfig {
                handlers: vec![RuntimeHandler::bulkhead(Some(&cfg_path))],
                ..Default::default()
            })
            .await
        })
        .await?;
    let cri = containerd.cri().await?;
    let log_dir = containerd.new_log_dir("demo")?;
    let pod = pod_config("bulkhead-demo", &log_dir);
    let pod_id = steps.time("RunPodSandbox", cri.run_pod_sandbox(&pod, "bulkhead")).await?;
    let script = "echo hello from a bulkhead pod; echo kernel: $(uname -r); exec sleep 3600";
    let ctr = steps
        .time("CreateContainer", cri.create_container(&pod_id, &container_config("hello", &["sh", "-c", script]), &pod))
        .await?;
    steps.time("StartContainer", cri.start_container(&ctr)).await?;
    let exec = steps.time("ExecSync (id; hostname)", cri.exec_sync(&ctr, &["sh", "-c", "id; hostname"], 10)).await?;
    steps.time("StopContainer", cri.stop_container(&ctr, 5)).await?;
    let status = cri.container_status(&ctr).await?;
    steps.time("RemoveContainer", cri.remove_container(&ctr)).await?;
    steps.time("StopPodSandbox", cri.stop_pod_sandbox(&pod_id)).await?;
    steps.time("RemovePodSandbox", cri.remove_pod_sandbox(&pod_id)).await?;

    println!("\ncontainer log (CRI log file hello.log):");
    let log = std::fs::read_to_string(log_dir.join("hello.log")).unwrap_or_default();
    for line in log.lines() {
        // CRI log lines: "<time> <stream> <P|F> <text>".
        println!("  | {}", line.splitn(4, ' ').nth(3).unwrap_or(line));
    }
    println!("\nExecSync `id; hostname`: exit code {}", exec.exit_code);
    for line in String::from_utf8_lossy(&exec.stdout).lines() {
        println!("  | {line}");
    }
    println!("\nfinal container state: exit code {} reason {:?}", status.exit_code, status.reason);
    let start: Duration = steps
        .0
        .iter()
        .filter(|(n, _)| matches!(*n, "RunPodSandbox" | "CreateContainer" | "StartContainer"))
        .map(|(_, d)| *d)
        .sum();
    println!("pod start (RunPodSandbox + CreateContainer + StartContainer): {:.1} ms", start.as_secs_f64() * 1e3);
    if log.is_empty() {
        bail!("the container wrote no output");
    }
    Ok(())
}

/// The backend the demo runs, and what its shim config needs.
enum Backend {
    Vm { kernel: PathBuf, initramfs: PathBuf },
    Namespace,
}

impl Backend {
    fn name(&self) -> &'static str {
        match self {
            Backend::Vm { .. } => "vm",
            Backend::Namespace => "namespace",
        }
    }

    fn shim_config(&self) -> String {
        match self {
            Backend::Vm { kernel, initramfs } => format!(
                "backend = \"vm\"\n\n[vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\n",
                bulkhead_integration::workspace_bin("bulkhead-vmm").display(),
                kernel.display(),
                initramfs.display()
            ),
            Backend::Namespace => format!(
                "backend = \"namespace\"\n\n[namespace]\nagent_path = \"{}\"\n",
                bulkhead_integration::workspace_bin("bulkhead-agent").display()
            ),
        }
    }
}
