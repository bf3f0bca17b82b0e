//! Sandbox backends: what runs a pod's agent. [`namespace`] (agent as PID 1 of fresh
//! namespaces, no VM isolation) and [`vm`] (one jailed microVM per pod). Everything above this
//! trait is the same code on both backends; [`supervise`] is what both do with their host
//! processes, [`cgroups`] and [`cgroup_stats`] the pod's host cgroups, [`mounts`] and [`paths`]
//! what teardown finds on the host ([`mounts`] also the rules both backends' container mounts
//! share), [`emptydir`] the disks that hold size-limited emptyDirs (both backends, before their
//! own sharing of a container's volumes). A container's OCI spec travels through them typed
//! (`oci_spec::runtime::Spec`, [`crate::spec`]) and is encoded once, by the Task service.

pub mod cgroup_primer;
pub mod cgroup_stats;
pub mod cgroups;
pub mod container_tree;
pub mod emptydir;
pub mod idmap;
pub mod launcher;
pub mod mounts;
pub mod namespace;
pub mod namespace_mounts;
pub mod paths;
pub mod supervise;
pub mod vm;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;

use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use oci_spec::runtime::{LinuxResources, Spec};

use crate::agent::{AgentClient, AgentClientError};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use crate::spec::PodResources;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("the {backend} backend does not support {what}")]
    Unsupported { backend: &'static str, what: String },
    #[error("sandbox {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("sandbox {what}: {source}")]
    Sys { what: String, source: nix::Error },
    #[error("cannot set up the sandbox: {0}")]
    Setup(String),
    #[error("agent did not come up: {0}")]
    AgentStart(String),
    /// The VM never brought its agent up; the console log is where the guest said why.
    #[error("VM did not start: {reason}; console log {console_log}{tail}")]
    VmStart { reason: String, console_log: PathBuf, tail: String },
    // Boxed: these carry paths and messages, and every Result of the shim carries this enum.
    #[error("VMM API: {0}")]
    VmmApi(Box<vm::api::ApiError>),
    #[error("sharing with the VM: {0}")]
    Share(Box<mounts::MountError>),
    #[error("size-limited emptyDir: {0}")]
    EmptyDir(Box<emptydir::EmptyDirError>),
    #[error(transparent)]
    Agent(#[from] AgentClientError),
    #[error(transparent)]
    Network(#[from] crate::network::NetworkError),
    #[error(transparent)]
    Resize(#[from] vm::resize::ResizeRefused),
}

impl From<vm::api::ApiError> for SandboxError {
    fn from(e: vm::api::ApiError) -> Self {
        Self::VmmApi(Box::new(e))
    }
}

impl From<mounts::MountError> for SandboxError {
    fn from(e: mounts::MountError) -> Self {
        Self::Share(Box::new(e))
    }
}

impl From<emptydir::EmptyDirError> for SandboxError {
    fn from(e: emptydir::EmptyDirError) -> Self {
        Self::EmptyDir(Box::new(e))
    }
}

/// What a backend needs to start a pod.
#[derive(Debug, Clone)]
pub struct SandboxRequest {
    pub sandbox_id: String,
    /// The pod network namespace from the sandbox spec; `None` for host-network pods.
    pub netns: Option<PathBuf>,
    /// Where the pod's containers' cgroups go.
    pub cgroup: cgroups::PodCgroup,
    /// The pod's sandbox-level resources, as containerd passes them (VM shape).
    pub resources: PodResources,
    /// The pod's log directory (kubelet's, removed with the pod), if containerd names one.
    pub log_dir: Option<PathBuf>,
    /// The size limits of the pod's emptyDir volumes, read from the sandbox spec.
    pub emptydirs: emptydir::EmptyDirPolicy,
    /// The sandbox process's OOM score adjustment (the pause container's, for the `namespace`
    /// backend's agent), from the sandbox spec.
    pub oom_score_adj: Option<i32>,
    /// A `hostUsers: false` pod's id maps (namespace backend only): its containers' rootfs and
    /// volumes are mounted idmapped with them.
    pub id_maps: Option<crate::spec::PodIdMaps>,
}

/// What the agent gets for a new container: its rootfs at `rootfs_path` (in the agent's view)
/// after performing `rootfs_mounts` (each relative to it), and the OCI spec to run, as the
/// backend adapted it (bind-mount sources point where the agent sees them: the pod's shared
/// directory in the VM, or the pod's view on the host). The Task service encodes the spec.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerPlan {
    pub rootfs_path: PathBuf,
    pub rootfs_mounts: Vec<pb::Mount>,
    pub spec: Spec,
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

    /// Adds what this backend's guest needs to the pod's SetupSandbox (the vm backend: the
    /// guest's NICs and routes, wall clock and entropy seed). The default adds nothing.
    fn guest_setup(&self, _setup: &mut pb::SetupSandboxRequest) {}

    /// Prepares the host side of a new container (its rootfs and volumes, and what teardown
    /// must find after a crash) and plans how the agent gets the rootfs from containerd's rootfs
    /// mounts (or, when there are none, the bundle's `rootfs` directory containerd prepared) and
    /// which spec (`spec`, adapted as the backend needs) it runs.
    async fn prepare_container(
        &self,
        container_id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: Spec,
    ) -> Result<ContainerPlan, SandboxError>;

    /// Removes what [`Sandbox::prepare_container`] left on the host; idempotent. The agent
    /// unmounts its own mounts when it removes the container.
    async fn release_container(&self, container_id: &str) -> Result<(), SandboxError>;

    /// Sends a signal to the sandbox as a whole (SIGKILL ends the pod).
    async fn signal(&self, signal: u32) -> Result<(), SandboxError>;

    /// Ends the sandbox because its agent cannot be reached (its processes are beyond the
    /// shim's reach): SIGKILL, which a backend may note first, to report that end at teardown.
    async fn end_unreachable(&self) -> Result<(), SandboxError> {
        self.signal(libc::SIGKILL as u32).await
    }

    /// Whether the sandbox can take a container's new limits (`resources`, OCI) before the agent
    /// applies them. The default takes any: the pod's host cgroups are what binds it.
    fn check_resize(&self, _container_id: &str, _resources: &LinuxResources) -> Result<(), SandboxError> {
        Ok(())
    }

    /// A container's limits once the agent applied them (a resize; create goes through
    /// [`Sandbox::prepare_container`]): what the sandbox itself follows (the vm backend: the
    /// guest's online vCPUs).
    async fn resized(&self, _container_id: &str, _resources: &LinuxResources) -> Result<(), SandboxError> {
        Ok(())
    }

    /// Pauses the whole sandbox (every container with it), or says the backend cannot.
    async fn pause(&self) -> Result<(), SandboxError>;

    /// Undoes [`Sandbox::pause`].
    async fn resume(&self) -> Result<(), SandboxError>;

    /// What the sandbox itself uses on the host (its cgroup: the VMM, or launcher and agent).
    async fn stats(&self) -> Result<pb::StatsResponse, SandboxError>;

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

/// Removes everything a pod of `backend` left on the host (its processes, mounts, cgroups and
/// state). Idempotent; `delete` runs it after a shim crash, with what the bundle record says.
pub async fn cleanup(backend: Backend, paths: &paths::PodPaths) {
    match backend {
        Backend::Namespace => namespace::cleanup(paths).await,
        Backend::Vm => vm::cleanup(paths).await,
    }
}

/// How long teardown may spend removing the pod's cgroups before it reports them and moves on.
const CGROUP_TEARDOWN_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

/// What every backend's teardown ends with, once the pod's processes are gone: the cgroups the
/// pod owns (from its record: with the agent gone nobody else removes its containers'), any
/// mount below the pod's state dir, and the state dir itself.
async fn remove_pod_state(paths: &paths::PodPaths) {
    if let Some(cgroup) = cgroups::PodCgroup::read_record(&paths.cgroup_file()) {
        cgroup.remove(CGROUP_TEARDOWN_BUDGET).await;
    }
    // After the VMM (or launcher) is gone; from the record alone, so also after a shim crash.
    if let Err(e) = crate::network::teardown(&paths.network_record()).await {
        tracing::warn!("pod network teardown: {e}");
    }
    // The metrics entries, in case the shim that served them crashed (the gid is not needed).
    if let Some(endpoint) = crate::metrics::dir::PodEndpoint::of(paths, 0) {
        endpoint.remove();
    }
    mounts::unmount_all(&paths.dir);
    // Never recurse into a mount that stayed: it may be a volume with the user's data.
    let left = mounts::mounts_below(&paths.dir);
    if !left.is_empty() {
        tracing::error!(mounts = ?left, dir = %paths.dir.display(), "mounts stayed below the pod's state; leaving it");
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(&paths.dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("remove {}: {e}", paths.dir.display());
        }
    }
}

/// Points the limited emptyDirs of a container's spec at the pod's disks for them
/// ([`emptydir`]), off the async runtime's workers (mkfs and mounts block); both backends call
/// it before they share the container's volumes.
async fn redirect_emptydirs(
    emptydirs: &Arc<emptydir::PodEmptyDirs>,
    container_id: &str,
    mut spec: Spec,
) -> Result<Spec, SandboxError> {
    let disks = emptydirs.clone();
    tokio::task::spawn_blocking(move || disks.redirect(&mut spec).map(|()| spec))
        .await
        .map_err(|e| SandboxError::Setup(format!("container {container_id}: emptyDir volumes: {e}")))?
        .map_err(SandboxError::from)
}

/// The sandbox cgroup's usage on the host.
fn host_stats(cgroup: &Path) -> Result<pb::StatsResponse, SandboxError> {
    cgroup_stats::read_stats(&cgroups::cgroup_mounts(), cgroup).ok_or_else(|| SandboxError::Io {
        what: format!("read stats of cgroup {}", cgroup.display()),
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    })
}
