//! The `namespace` backend: `bulkhead-agent --mode namespace` as PID 1 of fresh
//! pid/mount/uts/ipc namespaces, in the pod's network namespace, reached through its Unix
//! socket with the same CONNECT handshake as the VM's hybrid vsock.
//!
//! It gives NO VM isolation: the workload shares the host kernel. It exists so the whole
//! shim/agent stack runs on hosts that cannot run guests, and is chosen only by
//! `backend = "namespace"`; every sandbox start logs a warning saying so.
//!
//! Host layout ([`PodPaths`]): the agent socket, the launcher pid file, the pod's cgroup record,
//! the agent's own state dir, the console log (the agent's output, also relayed into the shim
//! log by [`crate::logrelay`]), and the pod's container mounts ([`PodMounts`]: `rootfs/`, where
//! the shim mounts each container's rootfs and volume sources before CreateContainer, and
//! `view/`, its read-only slave view). A size-limited emptyDir is first given its own
//! filesystem ([`crate::sandbox::emptydir`]), which is then bound into `rootfs/` like any volume.
//!
//! The agent confines itself (guest-agent README, "Namespace mode"): it pivots into a minimal
//! root of its own that keeps only its binary, /proc, /sys with the cgroup hierarchies, a small
//! /dev, its state dir (`--state-dir`) and `view/` (`--share-dir`), at their host paths, and drops
//! every capability but containerd's default container set, CAP_SYS_ADMIN and CAP_SYS_PTRACE;
//! it serves from a user namespace of its own, so those are not the host's.
//! Its Unix socket is bound before the pivot and stays where the shim dials it. The host paths
//! containerd names (snapshot layers, kubelet's volumes) are not in that root: the shim mounts
//! them into `rootfs/`, they propagate into the agent's copy of `view/`, and the spec and rootfs
//! path the agent gets name them there ([`crate::sandbox::namespace_mounts`] explains why
//! propagation, and why not the agent mounting host paths).
//! Unless `[network] allow_metadata` is set, traffic to the cloud metadata endpoint is dropped
//! on the pod interfaces' egress before the agent starts ([`crate::network::block_metadata`]).
//! The pause container is not run: the agent is the pod's PID 1, and its launcher (already in
//! the pod's net/ipc/uts namespaces) is the sandbox task's process.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use nix::sys::signal::Signal;
use oci_spec::runtime::Spec;
use tracing::{info, warn};

use super::cgroups::PodCgroup;
use super::emptydir::PodEmptyDirs;
use super::launcher::{LaunchArgs, LAUNCH_ARG};
use super::namespace_mounts::PodMounts;
use super::paths::PodPaths;
use super::supervise::{self, LogTo, Supervised};
use super::{ContainerPlan, Sandbox, SandboxError, SandboxRequest, SandboxState};
use crate::agent::{AgentClient, Timeouts};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use crate::logrelay::{Component, ConsoleLog};
use crate::network::MetadataAccess;

/// `sun_path` of a Unix socket address, NUL included.
const SUN_PATH_MAX: usize = 108;

pub struct NamespaceSandbox {
    id: String,
    paths: PodPaths,
    agent: Arc<AgentClient>,
    state: Mutex<SandboxState>,
    launcher: Supervised,
    /// The pod's cgroups; its record on disk lets `delete` remove them after a crash.
    cgroup: Mutex<PodCgroup>,
    /// Where the containers' rootfs and volumes are mounted for the agent.
    mounts: PodMounts,
    /// The pod's size-limited emptyDirs, mounted before they are bound into `mounts`.
    emptydirs: Arc<PodEmptyDirs>,
}

fn sys(what: impl Into<String>) -> impl FnOnce(nix::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Sys { what, source }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Io { what, source }
}

impl NamespaceSandbox {
    pub async fn start(config: &Config, req: SandboxRequest) -> Result<Arc<Self>, SandboxError> {
        warn!(
            sandbox = %req.sandbox_id,
            "namespace backend: this pod runs with NO VM isolation (host kernel shared); \
             use backend = \"vm\" for isolation"
        );
        let paths = PodPaths::new(&config.state_dir, &req.sandbox_id)
            .ok_or_else(|| SandboxError::AgentStart(format!("sandbox id {:?} is not a plain id", req.sandbox_id)))?;
        // A leftover of an earlier crashed attempt must not confuse this one.
        cleanup(&paths).await;
        paths.create_dir().map_err(io(format!("create {}", paths.dir.display())))?;
        // A hostUsers: false pod's containers' mounts are idmapped with its maps (the agent makes
        // the pod's user namespace itself, at SetupSandbox).
        let userns = match req.id_maps.as_ref().map(super::idmap::IdmapUserns::new).transpose() {
            Ok(userns) => userns.map(Arc::new),
            Err(e) => {
                cleanup(&paths).await;
                return Err(SandboxError::Setup(e.to_string()));
            }
        };
        // Before the launcher: the agent's mount namespace must copy these to receive later mounts.
        let mounts = PodMounts::new(&paths, userns);
        if let Err(e) = mounts.create() {
            cleanup(&paths).await;
            return Err(SandboxError::Setup(format!("pod mounts: {e}")));
        }
        if let Some(maps) = &req.id_maps {
            // The containers' init opens its mounts' sources as the pod's root.
            if let Err(e) = super::idmap::open_to_pod_root(maps, &[&paths.dir, &paths.rootfs_dir()]) {
                cleanup(&paths).await;
                return Err(SandboxError::Setup(e.to_string()));
            }
        }
        // Before the agent (and so any container) runs; host-network pods are the node's network.
        if let (Some(netns), MetadataAccess::Blocked) = (&req.netns, MetadataAccess::from_config(&config.network)) {
            if let Err(e) = crate::network::block_metadata(netns, &paths.network_record()).await {
                cleanup(&paths).await;
                return Err(e.into());
            }
        }

        let agent_path = &config.namespace.agent_path;
        if !agent_path.is_file() {
            cleanup(&paths).await;
            return Err(SandboxError::AgentStart(format!(
                "namespace.agent_path {} is not a file",
                agent_path.display()
            )));
        }
        if let Err(e) = req.cgroup.write_record(&paths.cgroup_file()) {
            // The pod's mounts and metadata filter are already in place: nothing may stay.
            cleanup(&paths).await;
            return Err(io("write cgroup record")(e));
        }
        let socket = paths.agent_socket();
        if socket.as_os_str().len() >= SUN_PATH_MAX {
            cleanup(&paths).await;
            return Err(SandboxError::AgentStart(format!(
                "state_dir {} is too long: the agent socket {} exceeds {SUN_PATH_MAX} bytes",
                config.state_dir.display(),
                socket.display()
            )));
        }
        let launch = LaunchArgs {
            netns: req.netns.as_ref().map(|p| p.display().to_string()),
            cgroup: Some(req.cgroup.sandbox().display().to_string()),
            oom_score_adj: req.oom_score_adj,
            command: vec![
                agent_path.display().to_string(),
                "--listen".into(),
                listen_arg(&socket),
                "--mode".into(),
                "namespace".into(),
                // A host-network pod's net.* sysctls would be the node's: the agent refuses them.
                "--network".into(),
                if req.netns.is_none() { "host" } else { "own" }.into(),
                // Per pod, so a killed pod's leftovers are found and removed with it.
                "--state-dir".into(),
                paths.agent_state_dir().display().to_string(),
                "--cgroup-parent".into(),
                req.cgroup.parent.display().to_string(),
                // What its minimal root keeps besides its state: the view of the containers' mounts.
                "--share-dir".into(),
                mounts.view().display().to_string(),
            ],
        };
        let exe = std::env::current_exe().map_err(io("find own executable"))?;
        let mut command = tokio::process::Command::new(exe);
        command.arg(LAUNCH_ARG).args(launch.to_args());
        // The sandbox outlives the Create RPC that started it: its tasks log under their own span.
        let life_span = tracing::info_span!(parent: None, "sandbox", id = %req.sandbox_id);
        // The agent's output is this backend's console (in a VM it is the serial line).
        let console = ConsoleLog::create(&paths.console_log())
            .map_err(|e| warn!("console log {}: {e}", paths.console_log().display()))
            .ok();
        let log = LogTo { pod: req.sandbox_id.clone(), component: Component::Agent, console };
        let launcher = match supervise::spawn(command, "namespace launcher", &life_span, log) {
            Ok(launcher) => launcher,
            Err(e) => {
                cleanup(&paths).await;
                return Err(e);
            }
        };
        supervise::write_pid_file(&paths.pid_file(), launcher.pid)?;
        info!(sandbox = %req.sandbox_id, pid = launcher.pid, netns = ?req.netns, "agent launched");
        // Under systemd, the pod's scope in kubelet's slice is a unit of its own, as runc makes it.
        if let Some((slice, scope)) = req.cgroup.systemd_unit().filter(|_| super::cgroups::systemd_is_init()) {
            if let Err(e) = super::cgroups::systemd_scope(&slice, scope, launcher.pid) {
                warn!("the pod's systemd scope: {e}; its cgroup is used as it is");
            }
        }

        let timeouts = Timeouts {
            connect: Duration::from_millis(config.agent.connect_timeout_ms),
            rpc: Duration::from_millis(config.agent.rpc_timeout_ms),
        };
        let agent = match supervise::dial_agent(&socket, timeouts, &launcher).await {
            Ok(agent) => agent,
            Err(e) => {
                launcher.stop(Duration::ZERO).await;
                cleanup(&paths).await;
                return Err(SandboxError::AgentStart(format!("namespace launcher: {e}")));
            }
        };
        info!(agent_version = %agent.agent_version, mode = %agent.mode, "agent connected");
        Ok(Arc::new(Self {
            emptydirs: Arc::new(PodEmptyDirs::new(&paths, req.emptydirs, &config.emptydir)),
            id: req.sandbox_id,
            paths,
            agent: Arc::new(agent),
            state: Mutex::new(SandboxState::Running { pid: launcher.pid }),
            launcher,
            cgroup: Mutex::new(req.cgroup),
            mounts,
        }))
    }

    fn current(&self) -> SandboxState {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let (SandboxState::Running { pid }, Some(exit)) = (*state, self.launcher.exit()) {
            *state = SandboxState::Exited { pid, exit };
        }
        *state
    }
}

fn listen_arg(socket: &Path) -> String {
    format!("unix:{}", socket.display())
}

/// Removes everything a pod left on the host: kills its launcher (the agent dies with it, and
/// with the agent every process of its PID namespace; the launcher is recognised by its
/// command line, so a reused pid is never signalled), removes the cgroups the pod owns,
/// unmounts, removes socket and state. Safe to call repeatedly; used by `destroy` and by
/// `delete` after a shim crash.
pub async fn cleanup(paths: &PodPaths) {
    let listen = listen_arg(&paths.agent_socket());
    supervise::kill_recorded(&paths.pid_file(), &[LAUNCH_ARG, &listen]).await;
    super::remove_pod_state(paths).await;
}

#[async_trait]
impl Sandbox for NamespaceSandbox {
    fn backend(&self) -> Backend {
        Backend::Namespace
    }

    fn pid(&self) -> u32 {
        match self.current() {
            SandboxState::Running { pid } | SandboxState::Exited { pid, .. } => pid,
        }
    }

    fn agent(&self) -> Arc<AgentClient> {
        self.agent.clone()
    }

    async fn prepare_container(
        &self,
        container_id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: Spec,
    ) -> Result<ContainerPlan, SandboxError> {
        {
            // Recorded before the agent makes the cgroup, so a crash in between still cleans it.
            let mut cgroup = self.cgroup.lock().unwrap_or_else(|p| p.into_inner());
            if !cgroup.add_container(container_id) {
                return Err(SandboxError::AgentStart(format!("container id {container_id:?} is not a plain id")));
            }
            cgroup.write_record(&self.paths.cgroup_file()).map_err(io("write cgroup record"))?;
        }
        let setup = |what: &str, e: &dyn std::fmt::Display| {
            SandboxError::Setup(format!("container {container_id}: {what}: {e}"))
        };
        let mut spec = super::redirect_emptydirs(&self.emptydirs, container_id, spec).await?;
        let (pod, id, bundle_rootfs, mounts) =
            (self.mounts.clone(), container_id.to_string(), bundle_rootfs.to_owned(), mounts.to_vec());
        // Mounts are blocking system calls: off the runtime's workers.
        let (rootfs, spec) = tokio::task::spawn_blocking(move || {
            pod.prepare(&id, &bundle_rootfs, &mounts, &mut spec).map(|rootfs| (rootfs, spec))
        })
        .await
        .map_err(|e| setup("mounts", &e))?
        .map_err(|e| setup("mounts", &e))?;
        // Everything is mounted already: the agent mounts nothing of the host's.
        Ok(ContainerPlan { rootfs_path: rootfs, rootfs_mounts: Vec::new(), spec })
    }

    async fn release_container(&self, container_id: &str) -> Result<(), SandboxError> {
        let (pod, id) = (self.mounts.clone(), container_id.to_string());
        tokio::task::spawn_blocking(move || pod.release(&id))
            .await
            .map_err(|e| SandboxError::Setup(format!("container {container_id}: unmount: {e}")))
    }

    async fn signal(&self, signal: u32) -> Result<(), SandboxError> {
        let SandboxState::Running { .. } = self.current() else {
            return Ok(());
        };
        let sig = Signal::try_from(signal as i32).map_err(sys(format!("signal {signal} to sandbox {}", self.id)))?;
        self.launcher.signal(sig)
    }

    async fn pause(&self) -> Result<(), SandboxError> {
        // Freezing the launcher and agent would leave the containers running: no pod pause.
        Err(SandboxError::Unsupported {
            backend: "namespace",
            what: "pausing the pod sandbox (pause its containers)".into(),
        })
    }

    async fn resume(&self) -> Result<(), SandboxError> {
        Err(SandboxError::Unsupported { backend: "namespace", what: "resuming the pod sandbox".into() })
    }

    async fn stats(&self) -> Result<pb::StatsResponse, SandboxError> {
        let sandbox_cgroup = self.cgroup.lock().unwrap_or_else(|p| p.into_inner()).sandbox();
        super::host_stats(&sandbox_cgroup)
    }

    async fn wait(&self) -> ExitInfo {
        self.launcher.wait().await
    }

    async fn destroy(&self) -> Result<(), SandboxError> {
        if let SandboxState::Running { .. } = self.current() {
            // The agent is PID 1 of its namespace: killing it ends every process of the pod.
            self.launcher.stop(Duration::ZERO).await;
        }
        cleanup(&self.paths).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn cleanup_of_missing_state_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "nothing-here").unwrap();
        cleanup(&paths).await;
        assert!(!paths.dir.exists());
    }
}
