//! Sandbox backends: what runs a pod's agent. [`namespace`] (agent as PID 1 of fresh
//! namespaces, no VM isolation) and [`vm`] (one microVM per pod; shape only for now).
//! Everything above this trait is the same code on both backends.

pub mod cgroups;
pub mod launcher;
pub mod namespace;
pub mod paths;
pub mod vm;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;

use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;

use crate::agent::{AgentClient, AgentError};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{backend} backend is not implemented on this host: {reason}")]
    NotImplemented { backend: &'static str, reason: String },
    #[error("sandbox {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("sandbox {what}: {source}")]
    Sys { what: String, source: nix::Error },
    #[error("agent did not come up: {0}")]
    AgentStart(String),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Network(#[from] crate::network::NetworkError),
}

/// What a backend needs to start a pod.
#[derive(Debug, Clone)]
pub struct SandboxRequest {
    pub sandbox_id: String,
    /// The pod network namespace from the sandbox spec; `None` for host-network pods.
    pub netns: Option<PathBuf>,
    /// Where the pod's containers' cgroups go.
    pub cgroup: cgroups::PodCgroup,
}

/// Where the agent finds a container's rootfs: `path` in its own mount namespace, after
/// performing `mounts` (each relative to `path`).
#[derive(Debug, Clone, PartialEq)]
pub struct RootfsPlan {
    pub path: PathBuf,
    pub mounts: Vec<pb::Mount>,
}

/// Lifecycle of a sandbox, kept by each backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Running { pid: u32 },
    Exited { pid: u32, exit: ExitInfo },
}

#[async_trait]
pub trait Sandbox: Send + Sync {
    fn backend(&self) -> Backend;

    /// Host pid that stands for the sandbox (its process, reported as the sandbox task's pid).
    fn pid(&self) -> u32;

    /// The agent of this pod, connected and version-checked.
    fn agent(&self) -> Arc<AgentClient>;

    /// The host processes behind the sandbox, for `bulkhead-ctl ps` and the metrics. A backend
    /// with helper processes (the `vm` backend: VMM, virtiofsd) names them here.
    fn host_pids(&self) -> paths::HostPids {
        paths::HostPids { sandbox: self.pid(), ..Default::default() }
    }

    /// Prepares the host side of a new container (its rootfs, and what teardown must find
    /// after a crash) and plans how the agent assembles the rootfs from containerd's rootfs
    /// mounts (or, when there are none, the bundle's `rootfs` directory containerd prepared).
    async fn prepare_container(
        &self,
        container_id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
    ) -> Result<RootfsPlan, SandboxError>;

    /// Removes what [`Sandbox::prepare_container`] left on the host; idempotent. The agent
    /// unmounts its own mounts when it removes the container.
    async fn release_container(&self, container_id: &str) -> Result<(), SandboxError>;

    /// Sends a signal to the sandbox as a whole (SIGKILL ends the pod).
    async fn signal(&self, signal: u32) -> Result<(), SandboxError>;

    /// Resolves when the sandbox has exited.
    async fn wait(&self) -> ExitInfo;

    /// Stops the sandbox (if running) and removes everything it left on the host.
    async fn destroy(&self) -> Result<(), SandboxError>;
}

/// What starts sandboxes; the Task service holds one (tests give it a fake).
#[async_trait]
pub trait Backends: Send + Sync {
    async fn start(&self, config: &Config, req: SandboxRequest) -> Result<Arc<dyn Sandbox>, SandboxError>;
}

/// The real backends, chosen by `config.backend`.
pub struct ConfiguredBackends;

#[async_trait]
impl Backends for ConfiguredBackends {
    async fn start(&self, config: &Config, req: SandboxRequest) -> Result<Arc<dyn Sandbox>, SandboxError> {
        start(config, req).await
    }
}

/// Starts the sandbox of a pod with the configured backend.
pub async fn start(config: &Config, req: SandboxRequest) -> Result<Arc<dyn Sandbox>, SandboxError> {
    match config.backend {
        Backend::Namespace => Ok(namespace::NamespaceSandbox::start(config, req).await?),
        Backend::Vm => Ok(vm::VmSandbox::start(config, req).await?),
    }
}
