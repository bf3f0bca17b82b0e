//! The `vm` backend, the product: one jailed `bulkhead-vmm` per pod, running the guest kernel
//! with the agent as PID 1, reached through the VMM's hybrid-vsock Unix socket with the same
//! CONNECT handshake and `AgentClient` as the namespace backend.
//!
//! Start: lay out `<state_dir>/<pod>/vm/` ([`layout`]), size the VM from the pod ([`shape`]),
//! spawn `bulkhead-vmm --config vm.json --jail jail.json` as a supervised child (it jails itself
//! into the chroot, the pod's cgroup and netns, as the configured uid), and dial the agent until
//! it answers, the VMM exits, or the connect timeout passes. A failure names the console log and
//! quotes its end ([`console`]), and everything started is torn down.
//!
//! Running: the sandbox task's pid is the VMM's waiter (the jail's parent process, which relays
//! SIGTERM/SIGINT and dies with the shim); Pause/Resume go to the VMM's API socket ([`api`]);
//! Stats are the VMM's cgroup.

pub mod api;
pub mod console;
pub mod layout;
pub mod shape;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use nix::sys::signal::Signal;
use tracing::{info, warn};

use self::api::VmmApi;
use self::layout::{VmLayout, VmPlan};
use self::shape::VmShape;
use super::cgroups::PodCgroup;
use super::paths::PodPaths;
use super::supervise::{self, Supervised};
use super::{RootfsPlan, Sandbox, SandboxError, SandboxRequest, SandboxState};
use crate::agent::{AgentClient, Timeouts};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;

/// How long a VMM gets to shut down on SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Deadline of one API socket exchange.
const API_TIMEOUT: Duration = Duration::from_secs(5);

pub struct VmSandbox {
    id: String,
    paths: PodPaths,
    agent: Arc<AgentClient>,
    /// The VMM's waiter: the sandbox task's process.
    vmm: Supervised,
    api: VmmApi,
    cgroup: PodCgroup,
    state: Mutex<SandboxState>,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Io { what, source }
}

/// A file the VM needs, resolved to what it names now (an upgrade that flips a symlink later
/// does not change a running pod's files).
fn vm_file(field: &str, path: &Path) -> Result<std::path::PathBuf, SandboxError> {
    let resolved =
        std::fs::canonicalize(path).map_err(|e| SandboxError::Setup(format!("vm.{field} {}: {e}", path.display())))?;
    if !resolved.is_file() {
        return Err(SandboxError::Setup(format!("vm.{field} {} is not a file", path.display())));
    }
    Ok(resolved)
}

impl VmSandbox {
    pub async fn start(config: &Config, req: SandboxRequest) -> Result<Arc<Self>, SandboxError> {
        let paths = PodPaths::new(&config.state_dir, &req.sandbox_id)
            .ok_or_else(|| SandboxError::Setup(format!("sandbox id {:?} is not a plain id", req.sandbox_id)))?;
        // A leftover of an earlier crashed attempt must not confuse this one.
        cleanup(&paths).await;
        let vmm_path = vm_file("vmm_path", &config.vm.vmm_path)?;
        let kernel = vm_file("kernel_path", &config.vm.kernel_path)?;
        let initramfs = vm_file("initramfs_path", &config.vm.initramfs_path)?;
        let shape = VmShape::for_pod(&config.vm, &req.resources)?;
        let layout = VmLayout::new(&paths);
        let plan = VmPlan {
            id: &req.sandbox_id,
            kernel: &kernel,
            initramfs: &initramfs,
            uid: config.vm.jailer_uid,
            gid: config.vm.jailer_gid,
            cgroup: req.cgroup.sandbox(),
            netns: req.netns.clone(),
            shape,
        };
        let laid_out = layout
            .create(&plan)
            .and_then(|()| req.cgroup.write_record(&paths.cgroup_file()))
            .map_err(io(format!("lay out the VM in {}", layout.dir.display())));
        if let Err(e) = laid_out {
            cleanup(&paths).await;
            return Err(e);
        }

        let mut command = tokio::process::Command::new(&vmm_path);
        command.args(layout.vmm_args());
        // The sandbox outlives the Create RPC that started it: its tasks log under their own span.
        let life_span = tracing::info_span!(parent: None, "sandbox", id = %req.sandbox_id);
        let vmm = match supervise::spawn(command, "bulkhead-vmm", &life_span) {
            Ok(vmm) => vmm,
            Err(e) => {
                cleanup(&paths).await;
                return Err(e);
            }
        };
        if let Err(e) = supervise::write_pid_file(&layout.pid_file(), vmm.pid) {
            vmm.stop(Duration::ZERO).await;
            cleanup(&paths).await;
            return Err(e);
        }
        info!(
            sandbox = %req.sandbox_id, pid = vmm.pid, vcpus = shape.vcpus, mem_mib = shape.mem_mib,
            netns = ?req.netns, cgroup = %plan.cgroup.display(), "VMM started"
        );

        let timeouts = Timeouts {
            connect: Duration::from_millis(config.agent.connect_timeout_ms),
            rpc: Duration::from_millis(config.agent.rpc_timeout_ms),
        };
        let agent = match supervise::dial_agent(&layout.vsock_socket(), timeouts, &vmm).await {
            Ok(agent) => agent,
            Err(failure) => {
                vmm.stop(Duration::ZERO).await;
                let console = layout.console_log();
                let tail = console::tail(&console);
                // The pod's state goes; a copy of the console stays with the pod's logs.
                let kept = req.log_dir.as_deref().and_then(|dir| console::keep(&console, dir));
                cleanup(&paths).await;
                let error = SandboxError::VmStart {
                    reason: format!("bulkhead-vmm (pid {}): {failure}", vmm.pid),
                    console_log: kept.unwrap_or(console),
                    tail,
                };
                warn!("{error}");
                return Err(error);
            }
        };
        info!(agent_version = %agent.agent_version, mode = %agent.mode, "agent connected");
        Ok(Arc::new(Self {
            id: req.sandbox_id,
            api: VmmApi::new(&layout.api_socket(), API_TIMEOUT),
            paths,
            agent: Arc::new(agent),
            state: Mutex::new(SandboxState::Running { pid: vmm.pid }),
            vmm,
            cgroup: req.cgroup,
        }))
    }

    fn current(&self) -> SandboxState {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let (SandboxState::Running { pid }, Some(exit)) = (*state, self.vmm.exit()) {
            *state = SandboxState::Exited { pid, exit };
        }
        *state
    }
}

/// Removes everything a VM pod left on the host: the VMM (its waiter, recognised by its command
/// line; the jailed VMM dies with it), the pod's cgroups, any mount, and the state dir with the
/// chroot and its device node. Safe to call repeatedly; used by `destroy`, after a failed
/// start, and by `delete` after a shim crash.
pub async fn cleanup(paths: &PodPaths) {
    let layout = VmLayout::new(paths);
    let args = layout.vmm_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    supervise::kill_recorded(&layout.pid_file(), &args).await;
    super::remove_pod_state(paths).await;
}

#[async_trait]
impl Sandbox for VmSandbox {
    fn backend(&self) -> Backend {
        Backend::Vm
    }

    fn pid(&self) -> u32 {
        match self.current() {
            SandboxState::Running { pid } | SandboxState::Exited { pid, .. } => pid,
        }
    }

    fn agent(&self) -> Arc<AgentClient> {
        self.agent.clone()
    }

    async fn prepare_container(&self, _: &str, _: &Path, _: &[Mount]) -> Result<RootfsPlan, SandboxError> {
        Err(SandboxError::Unsupported { backend: "vm", what: "container rootfs sharing yet".into() })
    }

    async fn release_container(&self, _: &str) -> Result<(), SandboxError> {
        Ok(())
    }

    async fn signal(&self, signal: u32) -> Result<(), SandboxError> {
        let SandboxState::Running { .. } = self.current() else {
            return Ok(());
        };
        let sig = Signal::try_from(signal as i32)
            .map_err(|source| SandboxError::Sys { what: format!("signal {signal} to sandbox {}", self.id), source })?;
        // The waiter relays SIGTERM/SIGINT to the VMM; any other signal ends the waiter, and the
        // VMM with it (its parent-death signal).
        self.vmm.signal(sig)
    }

    async fn pause(&self) -> Result<(), SandboxError> {
        Ok(self.api.pause().await?)
    }

    async fn resume(&self) -> Result<(), SandboxError> {
        Ok(self.api.resume().await?)
    }

    async fn stats(&self) -> Result<pb::StatsResponse, SandboxError> {
        super::host_stats(&self.cgroup.sandbox())
    }

    async fn wait(&self) -> ExitInfo {
        self.vmm.wait().await
    }

    async fn destroy(&self) -> Result<(), SandboxError> {
        if let SandboxState::Running { .. } = self.current() {
            if !self.vmm.stop(STOP_GRACE).await {
                warn!(pid = self.vmm.pid, "the VMM did not exit after SIGKILL");
            }
        }
        cleanup(&self.paths).await;
        Ok(())
    }
}
