//! A vm pod's test environment: a private containerd whose `bulkhead` handler runs the real guest
//! (kernel, initramfs and agent) on a given VMM, with pod state in a fresh directory under /run, and
//! the check that a pod whose state lived there left nothing on the host (processes, mounts, state).
//! `vm_e2e` and `vm_burst` use it.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_cri::v1 as cri;

use crate::guests::{self, GuestVmm};
use crate::host::{eventually_nothing, mounts_with, processes_with};
use crate::shim_env::{Setup, ShimEnv};
use crate::{ContainerdConfig, ContainerdVersion, RuntimeHandler};

/// How long the shim waits for the agent: TCG boots in seconds, but a loaded CI host is slow.
/// Below the harness's 60 s CRI deadline, so a guest that never answers fails with the shim's
/// own error and console tail.
pub const CONNECT_TIMEOUT_MS: u64 = 45_000;

/// A private containerd whose `bulkhead` handler runs the real guest on a VMM (a [`ShimEnv`]:
/// `env.cri`, `env.containerd` and `env.state_dir`, the shim's, are its).
pub struct VmEnv {
    shim: ShimEnv,
}

impl std::ops::Deref for VmEnv {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

impl VmEnv {
    /// Starts containerd `version` with the handler's guest on `vmm`, the shim waiting
    /// [`CONNECT_TIMEOUT_MS`] for each guest's agent. `base_spec` becomes the handler's
    /// `base_runtime_spec`. `None`, after one `SKIPPED` line, when `test` cannot run here.
    pub async fn start(
        test: &str,
        version: ContainerdVersion,
        vmm: GuestVmm,
        base_spec: Option<serde_json::Value>,
    ) -> Result<Option<Self>> {
        Self::start_with(test, version, vmm, base_spec, CONNECT_TIMEOUT_MS).await
    }

    /// [`Self::start`], the shim waiting `connect_timeout_ms` for each guest's agent.
    pub async fn start_with(
        test: &str,
        version: ContainerdVersion,
        vmm: GuestVmm,
        base_spec: Option<serde_json::Value>,
        connect_timeout_ms: u64,
    ) -> Result<Option<Self>> {
        Self::start_configured(test, version, vmm, base_spec, connect_timeout_ms, "").await
    }

    /// [`Self::start`] with `vm_settings` (TOML lines) added to the shim config's `[vm]` table.
    pub async fn start_with_vm_settings(
        test: &str,
        version: ContainerdVersion,
        vmm: GuestVmm,
        vm_settings: &str,
    ) -> Result<Option<Self>> {
        Self::start_configured(test, version, vmm, None, CONNECT_TIMEOUT_MS, vm_settings).await
    }

    async fn start_configured(
        test: &str,
        version: ContainerdVersion,
        vmm: GuestVmm,
        base_spec: Option<serde_json::Value>,
        connect_timeout_ms: u64,
        vm_settings: &str,
    ) -> Result<Option<Self>> {
        let Some(setup) = Setup::new(test, version, &["containerd-shim-bulkhead-v2"])? else { return Ok(None) };
        if vmm.skip(test) {
            return Ok(None);
        }
        println!("{test}: the guest runs on {}", vmm.name());
        // `[vm]` is the config's last table, so lines added at its end land in it.
        let config = guests::real_vm_config(setup.state(), connect_timeout_ms, vmm)? + vm_settings;
        let cfg = setup.write_config("bulkhead.toml", &config)?;
        let mut handler = RuntimeHandler::bulkhead(Some(&cfg));
        if let Some(spec) = base_spec {
            handler.base_runtime_spec =
                Some(setup.write_config("base-spec.json", &serde_json::to_string_pretty(&spec)?)?);
        }
        let shim = setup.start(ContainerdConfig { handlers: vec![handler], ..Default::default() }).await?;
        Ok(Some(Self { shim }))
    }

    /// RunPodSandbox on the `bulkhead` handler; a failure carries containerd's log tail.
    pub async fn run_pod(&self, pod: &cri::PodSandboxConfig) -> Result<String> {
        self.cri.run_pod_sandbox(pod, "bulkhead").await.with_context(|| self.containerd.log_tail(60))
    }

    /// Stops and removes the pod, then checks the host keeps nothing of it.
    pub async fn remove_pod_and_check_nothing_left(&self, pod_id: &str) -> Result<()> {
        self.cri.stop_pod_sandbox(pod_id).await?;
        self.cri.remove_pod_sandbox(pod_id).await?;
        nothing_left(self.state_dir.path()).await
    }
}

/// Where pod `pod_id`'s guest console log lives under the shim's `state_dir` (the VMM writes it).
pub fn console_log(state_dir: &Path, pod_id: &str) -> std::path::PathBuf {
    state_dir.join(pod_id).join("vm/root/run/console.log")
}

/// Lines of each guest console a failing test prints.
const CONSOLE_LINES_ON_FAILURE: usize = 80;

impl Drop for VmEnv {
    /// A test that fails prints the end of every guest console still under the state dir (a guest
    /// kernel oops, or the agent's last words, says more than the assertion), and containerd's
    /// log. A test fails by panicking, or by returning an error with its pod still up (a passing
    /// test removes its pods, and their consoles with them). A VM that ended while its pod ran has
    /// its console kept with the pod's logs instead: that is printed too, whether the test goes on
    /// to fail by a panic or by an error (which Drop cannot tell from a pass).
    fn drop(&mut self) {
        let lines = CONSOLE_LINES_ON_FAILURE;
        let tails = console_tails(self.state_dir.path(), lines);
        for (pod, tail) in &tails {
            println!("guest console of pod {pod}, its last {lines} lines:\n{tail}");
        }
        let kept = kept_consoles(&self.containerd.dir().join("logs"), lines);
        for (path, tail) in &kept {
            println!(
                "a VM ended while its pod ran; its console, kept at {}, its last {lines} lines:\n{tail}",
                path.display()
            );
        }
        if std::thread::panicking() || !tails.is_empty() || !kept.is_empty() {
            println!("containerd's log (the shim's and VMM's lines in it), its last {lines} lines:");
            println!("{}", self.containerd.log_tail(lines));
        }
    }
}

/// The last `lines` lines of each pod's guest console under `state_dir`, by pod id.
pub fn console_tails(state_dir: &Path, lines: usize) -> Vec<(String, String)> {
    let Ok(pods) = std::fs::read_dir(state_dir) else { return vec![] };
    pods.flatten()
        .filter_map(|pod| {
            let pod_id = pod.file_name().to_string_lossy().into_owned();
            Some((pod_id.clone(), file_tail(&console_log(state_dir, &pod_id), lines)?))
        })
        .collect()
}

/// The consoles the shim kept in pod log directories under `logs` (one directory per pod) for VMs
/// that ended while their pods ran, with their last `lines` lines.
pub fn kept_consoles(logs: &Path, lines: usize) -> Vec<(std::path::PathBuf, String)> {
    let Ok(dirs) = std::fs::read_dir(logs) else { return vec![] };
    dirs.flatten()
        .map(|dir| dir.path().join(KEPT_CONSOLE))
        .filter_map(|path| Some((path.clone(), file_tail(&path, lines)?)))
        .collect()
}

/// What the shim calls a VM's console kept in its pod's log directory when the VM ended on its own
/// (shim/src/sandbox/vm/console.rs).
pub const KEPT_CONSOLE: &str = "bulkhead-vm-console.log";

/// The last `lines` lines of `path`, each cut at 240 characters; `None` if it cannot be read.
fn file_tail(path: &Path, lines: usize) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    Some(
        all[all.len().saturating_sub(lines)..]
            .iter()
            .map(|l| l.chars().take(240).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// What the guest kernel prints when it faults or finds its own state corrupt (an oops, a BUG, a
/// poisoned busy inode): a pod whose console shows one is broken even if it still answers.
pub const GUEST_KERNEL_FAULTS: [&str; 5] =
    ["Busy inodes after unmount", "BUG:", "Oops:", "general protection fault", "Kernel panic"];

/// The lines of pod `pod_id`'s guest console (under `state_dir`) that say its kernel faulted.
pub fn guest_kernel_faults(state_dir: &Path, pod_id: &str) -> Result<Vec<String>> {
    let path = console_log(state_dir, pod_id);
    let text = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(String::from_utf8_lossy(&text)
        .lines()
        .filter(|l| GUEST_KERNEL_FAULTS.iter().any(|f| l.contains(f)))
        .map(str::to_string)
        .collect())
}

/// No process, mount or state of a pod whose state lived in `state_dir` is left on the host.
pub async fn nothing_left(state_dir: &Path) -> Result<()> {
    let state = state_dir.display().to_string();
    let within = Duration::from_secs(20);
    eventually_nothing("VMM, QEMU, vhost-device-vsock and virtiofsd processes", within, || {
        processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    eventually_nothing("mounts", within, || mounts_with(&state)).await?;
    eventually_nothing("pod state", within, || crate::host::state_left(state_dir)).await
}
