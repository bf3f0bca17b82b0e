//! The `vm` backend, the product: one jailed `bulkhead-vmm` per pod, running the guest kernel
//! with the agent as PID 1, reached through the VMM's hybrid-vsock Unix socket with the same
//! CONNECT handshake and `AgentClient` as the namespace backend.
//!
//! This file is the running sandbox (`VmSandbox`: its start, with a warm start's fallback to a
//! cold one, and the Sandbox operations); starting the processes is [`launch`]'s.
//!
//! Start: lay out `<state_dir>/<pod>/` ([`pod_dirs`]), size the VM from the pod ([`shape`]), make
//! the pod's shared directory ([`share`]) and the listener of its virtiofsd in the chroot, spawn
//! `bulkhead-vmm --config vm.json --jail jail.json` as a supervised child (it jails itself into
//! the chroot, the pod's cgroup and netns, as the configured uid), then virtiofsd on that
//! listener ([`virtiofsd`]), and dial the agent until it answers, the VMM exits, or the connect
//! timeout passes; the start's phases are logged ([`start_phases`]). A failure names the console
//! log and quotes its end ([`console`]), and everything started is torn down.
//!
//! Network: for a pod with a netns, the taps and redirects of [`crate::network::attach_vm`]
//! are made before the VMM starts (it opens the taps by name, inside that netns), the guest
//! NICs take the CNI interfaces' MACs, and SetupSandbox hands the agent their addresses and
//! routes. A host-network pod's VM has no NIC: the node's network is not the VM's to share.
//!
//! Running: the sandbox task's pid is the VMM's waiter (the jail's parent process, which relays
//! SIGTERM/SIGINT and dies with the shim); Pause/Resume go to the VMM's API socket ([`api`]);
//! Stats are the VMM's cgroup. A container's rootfs and volumes are mounted into the shared
//! directory and its spec points at them in the guest; a size-limited emptyDir is first given
//! its own filesystem ([`super::emptydir`]), which virtiofsd then serves like any volume. virtiofsd ending while the VM runs is
//! logged and ends the VM (the pod's sandbox fails); it is never restarted.

pub mod api;
mod balloon;
pub mod console;
pub mod ids;
mod launch;
pub mod pod_dirs;
pub mod resize;
pub mod shape;
pub mod share;
mod start_phases;
pub mod template;
pub mod template_builder;
pub mod virtiofsd;
pub(crate) mod warm;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use nix::sys::signal::Signal;
use oci_spec::runtime::{LinuxResources, Spec};
use tracing::{info, warn, Instrument};

use self::api::VmmApi;
use self::launch::{launch, start_failure, wait_restored, Launched, Origin, Started};
use self::pod_dirs::VmLayout;
use self::resize::{Limits, ResizeCeiling};
use self::shape::VmShape;
use self::share::SharedDir;
use self::start_phases::StartPhases;
use super::cgroup_primer::CgroupPrimer;
use super::cgroups::PodCgroup;
use super::emptydir::PodEmptyDirs;
use super::paths::{HostPids, PodPaths};
use super::supervise::{self, Supervised};
use super::{ContainerPlan, Sandbox, SandboxError, SandboxRequest, SandboxState};
use crate::agent::{AgentClient, Timeouts};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use crate::network::VmNetwork;

/// How long a VMM gets to shut down on SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Deadline of one API socket exchange.
const API_TIMEOUT: Duration = Duration::from_secs(5);
/// How long virtiofsd gets to exit on SIGTERM at teardown.
const VIRTIOFSD_GRACE: Duration = Duration::from_secs(1);
/// How long an unreachable agent's VMM gets to end on its own before the shim kills it.
const OWN_END_WAIT: Duration = Duration::from_secs(1);

pub struct VmSandbox {
    id: String,
    paths: PodPaths,
    agent: Arc<AgentClient>,
    /// The VMM's waiter: the sandbox task's process.
    vmm: Supervised,
    virtiofsd: Supervised,
    share: SharedDir,
    /// The pod's size-limited emptyDirs, mounted before they are shared.
    emptydirs: Arc<PodEmptyDirs>,
    api: VmmApi,
    cgroup: PodCgroup,
    /// The guest's NICs and routes (none for a host-network pod).
    network: Option<VmNetwork>,
    state: Mutex<SandboxState>,
    /// The pod's log directory, where a VM that ended on its own leaves its console.
    log_dir: Option<PathBuf>,
    /// How the VM's end came about, as far as the shim knows: what its teardown reports.
    ending: Mutex<Ending>,
    /// The VM's size against its containers' limits, for resizes.
    ceiling: ResizeCeiling,
    shape: VmShape,
}

/// Why a VM ends, as the shim sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Nobody asked: if the VM ends, it ended on its own (a guest kernel panic or reset, a
    /// triple fault, the VMM killed).
    Unasked,
    /// containerd asked (a signal to the sandbox task): a pod's ordinary end.
    Asked,
    /// The shim ended it because its agent could not be reached.
    AgentLost,
}

/// What a successful boot hands the sandbox.
struct Booted {
    agent: AgentClient,
    vmm: Supervised,
    virtiofsd: Supervised,
    network: Option<VmNetwork>,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Io { what, source }
}

/// Why a VM start failed: the VMM would not restore the template, or restored it but the agent
/// in it never answered (either way the template is moved aside and the pod boots cold: the
/// cold path is the proven one), or anything else, which a cold boot would meet as well.
enum BootFailure {
    Restore(SandboxError),
    Start(SandboxError),
}

impl BootFailure {
    fn into_error(self) -> SandboxError {
        match self {
            BootFailure::Restore(e) | BootFailure::Start(e) => e,
        }
    }
}

impl VmSandbox {
    pub async fn start(config: &Config, req: SandboxRequest) -> Result<Arc<Self>, SandboxError> {
        let paths = PodPaths::new(&config.state_dir, &req.sandbox_id)
            .ok_or_else(|| SandboxError::Setup(format!("sandbox id {:?} is not a plain id", req.sandbox_id)))?;
        // A leftover of an earlier crashed attempt must not confuse this one.
        cleanup(&paths).await;
        let mut started = Started::default();
        let mut phases = StartPhases::begin();
        // Once per start: it keys the template and sizes the VM that boots or restores.
        let shape = VmShape::for_pod(&config.vm, &req.resources).inspect_err(|e| warn!("{e}"))?;
        // A hostUsers: false pod's containers' mounts are idmapped with its maps, on the host, so
        // that virtiofsd serves the guest the ids the pod's user namespace expects.
        let userns = req
            .id_maps
            .as_ref()
            .map(crate::sandbox::idmap::IdmapUserns::new)
            .transpose()
            .map_err(|e| SandboxError::Setup(e.to_string()))?
            .map(Arc::new);
        let template = warm::template_for(config, &req, shape).await;
        phases.mark("template");
        let booted = match template {
            Some((store, template)) => {
                match Self::boot(config, &req, &paths, &mut started, shape, Some(&template.dir), &mut phases).await {
                    Err(BootFailure::Restore(e)) => {
                        // The VMM would not restore it, or its guest never answered: moved aside
                        // (the next pod rebuilds it), and this pod boots cold.
                        warm::set_aside(&store, &template, &e.to_string());
                        started.stop().await;
                        cleanup(&paths).await;
                        started = Started::default();
                        Self::boot(config, &req, &paths, &mut started, shape, None, &mut phases).await
                    }
                    other => other,
                }
            }
            None => Self::boot(config, &req, &paths, &mut started, shape, None, &mut phases).await,
        };
        match booted.map_err(BootFailure::into_error) {
            Ok(Booted { agent, vmm, virtiofsd, network }) => {
                let layout = VmLayout::new(&paths);
                let api = VmmApi::new(&layout.api_socket(), API_TIMEOUT);
                // Before any container: the guest must not settle into memory the pod does not have.
                if let Err(e) = balloon::hold_headroom(&api, shape).await {
                    let e = SandboxError::from(e);
                    warn!("the VM's memory to grow into could not go into its balloon: {e}");
                    drop((agent, vmm, virtiofsd));
                    started.stop().await;
                    cleanup(&paths).await;
                    return Err(e);
                }
                phases.log();
                Ok(Arc::new(Self {
                    id: req.sandbox_id,
                    api,
                    share: SharedDir::new(layout.shared_dir).with_idmap(userns),
                    emptydirs: Arc::new(PodEmptyDirs::new(&paths, req.emptydirs, &config.emptydir)),
                    paths,
                    agent: Arc::new(agent),
                    state: Mutex::new(SandboxState::Running { pid: vmm.pid }),
                    vmm,
                    virtiofsd,
                    network,
                    cgroup: req.cgroup,
                    log_dir: req.log_dir,
                    ending: Mutex::new(Ending::Unasked),
                    ceiling: ResizeCeiling::new(shape, &req.resources, config.vm.memory_mib),
                    shape,
                }))
            }
            Err(e) => {
                started.stop().await;
                cleanup(&paths).await;
                warn!("{e}");
                Err(e)
            }
        }
    }

    /// Starts virtiofsd and the VMM (booting, or restoring `template`) and dials the agent; what
    /// it started is in `started`.
    async fn boot(
        config: &Config,
        req: &SandboxRequest,
        paths: &PodPaths,
        started: &mut Started,
        shape: VmShape,
        template: Option<&Path>,
        phases: &mut StartPhases,
    ) -> Result<Booted, BootFailure> {
        // From now, ahead of the VMM's and virtiofsd's joins of the pod's cgroups: see the module.
        let primer = CgroupPrimer::start();
        let Launched { vmm, virtiofsd: fsd, network, layout } =
            launch(config, req, paths, started, shape, Origin::of_pod(template)).await.map_err(BootFailure::Start)?;
        phases.mark("launch");
        // virtiofsd has joined (before its exec); the VMM joins in its jail.
        if let Some(primer) = primer {
            tokio::spawn(primer.until_joined(vmm.pid, req.cgroup.sandbox()).in_current_span());
        }
        if template.is_some() {
            if let Err(why) = wait_restored(&layout, &vmm).await {
                phases.mark("restore_refused");
                let e = start_failure(&why, &vmm, &fsd, &layout, None).await;
                return Err(BootFailure::Restore(e));
            }
            phases.mark("restore");
        }
        let timeouts = Timeouts {
            connect: Duration::from_millis(config.agent.connect_timeout_ms),
            rpc: Duration::from_millis(config.agent.rpc_timeout_ms),
        };
        match supervise::dial_agent(&layout.vsock_socket(), timeouts, &vmm).await {
            Ok(agent) => {
                phases.mark("agent");
                info!(agent_version = %agent.agent_version, mode = %agent.mode, "agent connected");
                Ok(Booted { agent, vmm, virtiofsd: fsd, network })
            }
            // A restored guest that does not answer says the template is bad, as a refused
            // restore does; its console is in the error the template is set aside with.
            Err(failure) if template.is_some() => {
                phases.mark("restored_agent_silent");
                let why = format!("the restored guest's agent: {failure}");
                Err(BootFailure::Restore(start_failure(&why, &vmm, &fsd, &layout, None).await))
            }
            Err(failure) => Err(BootFailure::Start(
                start_failure(&format!("{failure}"), &vmm, &fsd, &layout, req.log_dir.as_deref()).await,
            )),
        }
    }
}

impl VmSandbox {
    /// The first note wins over a later one: a pod whose agent was lost and that containerd
    /// then stops still ended for that reason.
    fn note_end(&self, why: Ending) {
        let mut ending = self.ending.lock().unwrap_or_else(|p| p.into_inner());
        if *ending == Ending::Unasked {
            *ending = why;
        }
    }

    /// The VM did not end as a pod ordinarily does: the pod's state goes now, so the console
    /// stays with the pod's logs, and the shim's log says how it ended.
    fn report_end(&self, what: &str, exit: Option<ExitInfo>) {
        let console = VmLayout::new(&self.paths).console_log();
        let tail = console::tail(&console);
        let kept = self.log_dir.as_deref().and_then(|dir| console::keep(&console, dir));
        let kept = kept.map(|p| p.display().to_string()).unwrap_or_else(|| "not kept (no log directory)".into());
        let status = exit.map(|e| vmm_status(e.status)).unwrap_or_else(|| "running".into());
        warn!(
            status = %status,
            console = %kept,
            "{what}; bulkhead-vmm (pid {}){}; its console{tail}",
            self.vmm.pid,
            self.vmm.said()
        );
    }

    fn current(&self) -> SandboxState {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let (SandboxState::Running { pid }, Some(exit)) = (*state, self.vmm.exit()) {
            *state = SandboxState::Exited { pid, exit };
        }
        *state
    }
}

/// A VMM's exit status as the log says it: a signal's name (the waiter exits 128+signal), and
/// what SIGSYS means for our VMM.
fn vmm_status(status: u32) -> String {
    let signal = status.checked_sub(128).and_then(|n| Signal::try_from(i32::try_from(n).ok()?).ok());
    match signal {
        Some(Signal::SIGSYS) => format!(
            "{status} (SIGSYS: a VMM thread made a syscall outside its seccomp allow-list; the host kernel's log \
             names it, audit type=1326)"
        ),
        Some(sig) => format!("{status} ({sig})"),
        None => status.to_string(),
    }
}

/// Fills `buf` from the kernel's CSPRNG.
fn getrandom_fill(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Removes everything a VM pod left on the host: the VMM (its waiter, recognised by its command
/// line; the jailed VMM dies with it), the pod's cgroups, any mount, and the state dir with the
/// chroot and its device node. Safe to call repeatedly; used by `destroy`, after a failed
/// start, and by `delete` after a shim crash.
pub async fn cleanup(paths: &PodPaths) {
    let layout = VmLayout::new(paths);
    let vmm = layout.vmm_identity();
    let fsd = virtiofsd::identity(&layout.shared_dir);
    for (pid_file, args) in [(layout.pid_file(), &vmm[..]), (layout.virtiofsd_pid_file(), &fsd[..])] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        supervise::kill_recorded(&pid_file, &args).await;
    }
    super::remove_pod_state(paths).await;
    // After the VMM is gone: only then may another pod's VMM run as its id.
    if let (Some(state_dir), Some(pod)) = (paths.dir.parent(), paths.dir.file_name().and_then(|n| n.to_str())) {
        ids::release(state_dir, pod);
    }
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

    fn host_pids(&self) -> HostPids {
        HostPids { sandbox: self.pid(), vmm: Some(self.vmm.pid), virtiofsd: Some(self.virtiofsd.pid) }
    }

    fn guest_setup(&self, setup: &mut pb::SetupSandboxRequest) {
        if let Some(network) = &self.network {
            setup.interfaces = network.interfaces();
            setup.routes = network.routes.clone();
        }
        // The guest owns its clock and entropy pool; both start from the host's.
        setup.wall_clock_unix_nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        // The vCPUs to grow into stay offline until a resize asks for them.
        if self.shape.online < self.shape.vcpus {
            setup.online_cpus = u32::from(self.shape.online);
        }
        // kubelet's pod pids limit binds only host processes; the guest's are counted there.
        if let Some(limit) = self.cgroup.pids_limit() {
            info!(limit, "the pod's pids limit goes to the guest");
            setup.pids_limit = i64::try_from(limit).unwrap_or(i64::MAX);
        }
        let mut seed = vec![0u8; 64];
        match getrandom_fill(&mut seed) {
            Ok(()) => setup.entropy_seed = seed,
            Err(e) => warn!("no entropy seed for the guest: {e}"),
        }
    }

    async fn prepare_container(
        &self,
        container_id: &str,
        bundle_rootfs: &Path,
        mounts: &[Mount],
        spec: Spec,
    ) -> Result<ContainerPlan, SandboxError> {
        let mut spec = super::redirect_emptydirs(&self.emptydirs, container_id, spec).await?;
        if let Some(resources) = spec.linux().as_ref().and_then(|l| l.resources().as_ref()) {
            self.ceiling.created(container_id, Limits::of(resources));
        }
        let (share, id, bundle_rootfs, mounts) =
            (self.share.clone(), container_id.to_string(), bundle_rootfs.to_owned(), mounts.to_vec());
        // Mounts are blocking system calls: off the runtime's workers.
        let (rootfs, spec) = tokio::task::spawn_blocking(move || {
            share.prepare(&id, &bundle_rootfs, &mounts, &mut spec).map(|rootfs| (rootfs, spec))
        })
        .await
        .map_err(|e| SandboxError::Setup(format!("container {container_id}: share: {e}")))??;
        Ok(ContainerPlan { rootfs_path: rootfs.into(), rootfs_mounts: Vec::new(), spec })
    }

    async fn release_container(&self, container_id: &str) -> Result<(), SandboxError> {
        self.ceiling.removed(container_id);
        let (share, id) = (self.share.clone(), container_id.to_string());
        tokio::task::spawn_blocking(move || share.release(&id))
            .await
            .map_err(|e| SandboxError::Setup(format!("container {container_id}: unshare: {e}")))
    }

    async fn signal(&self, signal: u32) -> Result<(), SandboxError> {
        let SandboxState::Running { .. } = self.current() else {
            return Ok(());
        };
        let sig = Signal::try_from(signal as i32)
            .map_err(|source| SandboxError::Sys { what: format!("signal {signal} to sandbox {}", self.id), source })?;
        self.note_end(Ending::Asked);
        // The waiter relays SIGTERM/SIGINT to the VMM; any other signal ends the waiter, and the
        // VMM with it (its parent-death signal).
        self.vmm.signal(sig)
    }

    fn check_resize(&self, container_id: &str, resources: &LinuxResources) -> Result<(), SandboxError> {
        Ok(self.ceiling.check(container_id, Limits::of(resources))?)
    }

    async fn resized(&self, container_id: &str, resources: &LinuxResources) -> Result<(), SandboxError> {
        let follow = self.ceiling.resized(container_id, Limits::of(resources));
        if let Some(count) = follow.online {
            let online = self.agent.set_online_cpus(count).await?;
            self.ceiling.online(online);
            info!(container = %container_id, online, "the guest's online vCPUs follow the pod's CPU limits");
        }
        if let Some(guest) = follow.guest {
            let balloon = balloon::target(&self.api, guest).await?;
            self.ceiling.guest(guest);
            info!(container = %container_id, guest_mib = guest.get(), balloon_mib = balloon.get(),
                "the guest's memory follows the pod's memory limits");
            balloon::wait_deflated(&self.api, balloon, balloon::DEFLATE_WAIT).await;
        }
        Ok(())
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

    async fn end_unreachable(&self) -> Result<(), SandboxError> {
        // Every agent connection ending at once is often the VMM itself ending (a crash, a seccomp
        // kill): a moment's wait lets its own exit status and last words be what the log reports,
        // rather than the SIGKILL that would otherwise race them.
        if tokio::time::timeout(OWN_END_WAIT, self.vmm.wait()).await.is_ok() {
            return Ok(());
        }
        self.note_end(Ending::AgentLost);
        self.signal(libc::SIGKILL as u32).await
    }

    async fn destroy(&self) -> Result<(), SandboxError> {
        let ending = *self.ending.lock().unwrap_or_else(|p| p.into_inner());
        match (ending, self.vmm.exit()) {
            (Ending::Unasked, Some(exit)) => self.report_end("the VM ended on its own while the pod ran", Some(exit)),
            (Ending::AgentLost, exit) => {
                self.report_end("the VM was ended because its agent could not be reached", exit)
            }
            _ => {}
        }
        // The VM first: virtiofsd then sees its one connection close.
        if !self.vmm.stop(STOP_GRACE).await {
            warn!(pid = self.vmm.pid, "the VMM did not exit after SIGKILL");
        }
        if !self.virtiofsd.stop(VIRTIOFSD_GRACE).await {
            warn!(pid = self.virtiofsd.pid, "virtiofsd did not exit after SIGKILL");
        }
        cleanup(&self.paths).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::vmm_status;

    #[test]
    fn a_vmm_status_names_its_signal_and_what_sigsys_means() {
        assert_eq!(vmm_status(0), "0");
        assert_eq!(vmm_status(1), "1");
        assert_eq!(vmm_status(137), "137 (SIGKILL)");
        assert!(vmm_status(159).starts_with("159 (SIGSYS: a VMM thread made a syscall outside its seccomp"));
        // Past the last signal: a plain status.
        assert_eq!(vmm_status(255), "255");
    }
}
