//! The `vm` backend, the product: one jailed `bulkhead-vmm` per pod, running the guest kernel
//! with the agent as PID 1, reached through the VMM's hybrid-vsock Unix socket with the same
//! CONNECT handshake and `AgentClient` as the namespace backend.
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
pub mod console;
pub mod ids;
pub mod pod_dirs;
pub mod shape;
pub mod share;
mod start_phases;
pub mod template;
pub mod template_builder;
pub mod virtiofsd;
pub(crate) mod warm;

use std::ffi::CString;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use nix::sys::signal::Signal;
use oci_spec::runtime::Spec;
use tracing::{error, info, warn, Instrument};

use self::api::VmmApi;
use self::pod_dirs::{VmLayout, VmPlan};
use self::shape::VmShape;
use self::share::SharedDir;
use self::start_phases::StartPhases;
use super::cgroup_primer::CgroupPrimer;
use super::cgroups::{self, PodCgroup};
use super::emptydir::PodEmptyDirs;
use super::paths::{HostPids, PodPaths};
use super::supervise::{self, LogTo, Supervised};
use super::{ContainerPlan, Sandbox, SandboxError, SandboxRequest, SandboxState};
use crate::agent::{AgentClient, Timeouts};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use crate::logrelay::Component;
use crate::network::{MetadataAccess, VmAttach, VmNetwork};
use bulkhead_vmm_api::config::{LinkState, NetConfig};

/// How long a VMM gets to shut down on SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Deadline of one API socket exchange.
const API_TIMEOUT: Duration = Duration::from_secs(5);
/// How long virtiofsd gets to exit on SIGTERM at teardown.
const VIRTIOFSD_GRACE: Duration = Duration::from_secs(1);
/// How long after virtiofsd's exit the VMM may take to exit too before that counts as a crash
/// (when the VM stops, virtiofsd sees its connection close and may exit first).
const FOLLOW_GRACE: Duration = Duration::from_secs(1);

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

/// What a start has started so far, stopped again if the start fails.
#[derive(Default)]
pub(super) struct Started {
    vmm: Option<Supervised>,
    virtiofsd: Option<Supervised>,
}

impl Started {
    pub(super) async fn stop(&self) {
        for child in [&self.vmm, &self.virtiofsd].into_iter().flatten() {
            child.stop(Duration::ZERO).await;
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
        let template = warm::template_for(config, &req).await;
        phases.mark("template");
        let booted = match template {
            Some((store, template)) => {
                match Self::boot(config, &req, &paths, &mut started, Some(&template.dir), &mut phases).await {
                    Err(BootFailure::Restore(e)) => {
                        // The VMM would not restore it, or its guest never answered: moved aside
                        // (the next pod rebuilds it), and this pod boots cold.
                        warm::set_aside(&store, &template, &e.to_string());
                        started.stop().await;
                        cleanup(&paths).await;
                        started = Started::default();
                        Self::boot(config, &req, &paths, &mut started, None, &mut phases).await
                    }
                    other => other,
                }
            }
            None => Self::boot(config, &req, &paths, &mut started, None, &mut phases).await,
        };
        match booted.map_err(BootFailure::into_error) {
            Ok(Booted { agent, vmm, virtiofsd, network }) => {
                phases.log();
                let layout = VmLayout::new(&paths);
                Ok(Arc::new(Self {
                    id: req.sandbox_id,
                    api: VmmApi::new(&layout.api_socket(), API_TIMEOUT),
                    share: SharedDir::new(layout.shared_dir),
                    emptydirs: Arc::new(PodEmptyDirs::new(&paths, req.emptydirs, &config.emptydir)),
                    paths,
                    agent: Arc::new(agent),
                    state: Mutex::new(SandboxState::Running { pid: vmm.pid }),
                    vmm,
                    virtiofsd,
                    network,
                    cgroup: req.cgroup,
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
        template: Option<&Path>,
        phases: &mut StartPhases,
    ) -> Result<Booted, BootFailure> {
        let shape = VmShape::for_pod(&config.vm, &req.resources).map_err(BootFailure::Start)?;
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

/// What a [`launch`]ed VMM starts from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Origin<'a> {
    /// A pod's VM, booted.
    PodBoot,
    /// A pod's VM, restored from the template in this directory.
    PodRestore(&'a Path),
    /// A template's VM, booted with its NICs' links down: their taps are placeholders with no
    /// network, and the restore that puts a pod's taps in their place raises the links and tells
    /// the guest (virtio-net's link status and config interrupt).
    Template,
}

impl<'a> Origin<'a> {
    fn of_pod(template: Option<&'a Path>) -> Self {
        template.map_or(Origin::PodBoot, Origin::PodRestore)
    }

    fn template(self) -> Option<&'a Path> {
        match self {
            Origin::PodRestore(dir) => Some(dir),
            Origin::PodBoot | Origin::Template => None,
        }
    }

    fn link(self) -> LinkState {
        match self {
            Origin::Template => LinkState::Down,
            Origin::PodBoot | Origin::PodRestore(_) => LinkState::Up,
        }
    }
}

/// What [`launch`] started: the VMM (booting) and the pod's virtiofsd.
pub(super) struct Launched {
    pub vmm: Supervised,
    pub virtiofsd: Supervised,
    pub network: Option<VmNetwork>,
    pub layout: VmLayout,
}

/// Lays the VM out in `paths`, starts the pod's virtiofsd and the jailed VMM booting a VM of
/// `shape`, or restoring a template (a warm start, running as soon as it is restored: see
/// [`wait_restored`]); what it started is in `started`. A pod's start and a template's build both
/// begin here, so a template is booted exactly as a pod's VM is, but for its NICs' links.
pub(super) async fn launch(
    config: &Config,
    req: &SandboxRequest,
    paths: &PodPaths,
    started: &mut Started,
    shape: VmShape,
    origin: Origin<'_>,
) -> Result<Launched, SandboxError> {
    let template = origin.template();
    let vmm_path = vm_file("vmm_path", &config.vm.vmm_path)?;
    let virtiofsd_path = vm_file("virtiofsd_path", &config.vm.virtiofsd_path)?;
    let kernel = vm_file("kernel_path", &config.vm.kernel_path)?;
    let initramfs = vm_file("initramfs_path", &config.vm.initramfs_path)?;
    let layout = VmLayout::new(paths);

    paths.create_dir().map_err(io(format!("create {}", paths.dir.display())))?;
    // The pod's own VMM identity (after its directory exists: see `ids`).
    let range = ids::IdRange { first: config.vm.jail_id_first, count: config.vm.jail_id_count };
    let jail_id =
        ids::allocate(&config.state_dir, &req.sandbox_id, range).map_err(|e| SandboxError::Setup(e.to_string()))?;
    // Recorded before anything is added, so a failed start and `delete` find what to remove.
    let network = match &req.netns {
        Some(netns) => {
            let attach = VmAttach {
                netns,
                record: &paths.network_record(),
                tap_uid: jail_id,
                tap_gid: jail_id,
                metadata: MetadataAccess::from_config(&config.network),
            };
            Some(crate::network::attach_vm(&attach).await?)
        }
        None => {
            info!(sandbox = %req.sandbox_id, "host-network pod: the VM gets no NIC");
            None
        }
    };
    let net = network
        .iter()
        .flat_map(|n| &n.nics)
        .map(|nic| NetConfig {
            tap: nic.tap.clone(),
            mac: nic.mac.clone(),
            mtu: Some(nic.mtu),
            rate_limiter: None,
            link: origin.link(),
        })
        .collect();
    let plan = VmPlan {
        id: &req.sandbox_id,
        kernel: &kernel,
        initramfs: &initramfs,
        uid: jail_id,
        gid: jail_id,
        cgroup: req.cgroup.sandbox(),
        netns: req.netns.clone(),
        shape,
        net,
        template,
    };
    layout
        .create(&plan)
        .and_then(|()| req.cgroup.write_record(&paths.cgroup_file()))
        .map_err(io(format!("lay out the VM in {}", layout.dir.display())))?;
    let share = SharedDir::new(layout.shared_dir.clone());
    share.create()?;
    // The sandbox outlives the Create RPC that started it: its tasks log under their own span.
    let life_span = tracing::info_span!(parent: None, "sandbox", id = %req.sandbox_id);

    let listener = virtiofsd::listen(&layout.fs_socket(), plan.uid, plan.gid)
        .map_err(io(format!("listen at {}", layout.fs_socket().display())))?;
    // virtiofsd's memory is the pod's too: it joins the sandbox cgroup the VMM joins.
    let (procs, problems) = cgroups::procs_files(&plan.cgroup);
    if !problems.is_empty() {
        return Err(SandboxError::Setup(format!("virtiofsd's cgroup: {}", problems.join("; "))));
    }
    let procs = procs
        .iter()
        .map(|p| CString::new(p.as_os_str().as_encoded_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SandboxError::Setup(format!("virtiofsd's cgroup: {e}")))?;
    let log = |component| LogTo { pod: req.sandbox_id.clone(), component, console: None };
    // The VMM first, then virtiofsd: each joins the pod's cgroups as it starts (the VMM in its
    // jail, virtiofsd before exec), and a cgroup move waits for an RCU grace period unless
    // another move is under way. Started together they share one wait; one after the other, the
    // shim waited for both (about 13 ms for virtiofsd's spawn on a cgroup v1 host). The VMM
    // finds virtiofsd's socket already listening; its connection waits there for virtiofsd.
    let mut command = tokio::process::Command::new(&vmm_path);
    command.args(layout.vmm_args(&plan));
    let vmm = supervise::spawn(command, "bulkhead-vmm", &life_span, log(Component::Vmm))?;
    started.vmm = Some(vmm.clone());
    supervise::write_pid_file(&layout.pid_file(), vmm.pid)?;

    let command = virtiofsd::command(&virtiofsd_path, &share.dir, &listener, procs);
    let fsd = supervise::spawn(command, "virtiofsd", &life_span, log(Component::Virtiofsd))?;
    drop(listener);
    // Under systemd, the pod's scope in kubelet's slice is a unit of its own, as runc makes it.
    if let Some((slice, scope)) = req.cgroup.systemd_unit().filter(|_| cgroups::systemd_is_init()) {
        if let Err(e) = cgroups::systemd_scope(&slice, scope, fsd.pid) {
            warn!("the pod's systemd scope: {e}; its cgroup is used as it is");
        }
    }
    started.virtiofsd = Some(fsd.clone());
    supervise::write_pid_file(&layout.virtiofsd_pid_file(), fsd.pid)?;
    tokio::spawn(watch_virtiofsd(fsd.clone(), vmm.clone()).instrument(life_span));
    info!(
        sandbox = %req.sandbox_id, pid = vmm.pid, virtiofsd = fsd.pid, jail_id, vcpus = shape.vcpus,
        mem_mib = shape.mem_mib, netns = ?req.netns, cgroup = %plan.cgroup.display(),
        template = ?template, "VMM started"
    );
    Ok(Launched { vmm, virtiofsd: fsd, network, layout })
}

/// How long a restoring VMM may take to bind its API socket (the restore is done by then).
const RESTORE_TIMEOUT: Duration = Duration::from_secs(20);
/// How often the restoring VMM's API socket is looked for: the restore itself takes a few ms, so
/// a coarser poll would be a good share of a warm start.
const RESTORE_POLL: Duration = Duration::from_millis(1);

/// Until the restored VM runs. The VMM resumes it by itself (the restore config's `resume`: no
/// API round trip before the guest runs) and binds its API socket after the restore, so the
/// socket is the sign. An error if the VMM fails first (it would not restore the template) or
/// takes too long.
async fn wait_restored(layout: &VmLayout, vmm: &Supervised) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + RESTORE_TIMEOUT;
    loop {
        match vmm.exit() {
            // The guest ran and stopped itself (status 0), maybe before the socket was seen: the
            // restore took, and the agent's dial reports the early end.
            Some(exit) if exit.status == 0 => return Ok(()),
            Some(exit) => {
                return Err(format!("the restore failed: the VMM exited with status {}{}", exit.status, vmm.said()))
            }
            None => {}
        }
        if layout.api_socket().exists() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("the restored VM's API socket did not appear within {RESTORE_TIMEOUT:?}"));
        }
        tokio::time::sleep(RESTORE_POLL).await;
    }
}

/// The error of a VM start that failed after [`launch`]: stops the VMM, names virtiofsd's own
/// failure, and quotes the console (a copy of which stays with the pod's logs, `log_dir`).
pub(super) async fn start_failure(
    failure: &str,
    vmm: &Supervised,
    fsd: &Supervised,
    layout: &VmLayout,
    log_dir: Option<&Path>,
) -> SandboxError {
    vmm.stop(Duration::ZERO).await;
    let mut reason = format!("bulkhead-vmm (pid {}): {failure}", vmm.pid);
    // virtiofsd exits 0 when the VMM closes its connection; anything else is its own failure.
    if let Some(exit) = fsd.exit().filter(|e| e.status != 0) {
        reason.push_str(&format!("; virtiofsd (pid {}) had exited with status {}{}", fsd.pid, exit.status, fsd.said()));
    }
    let console = layout.console_log();
    let tail = console::tail(&console);
    // The pod's state goes; a copy of the console stays with the pod's logs.
    let kept = log_dir.and_then(|dir| console::keep(&console, dir));
    SandboxError::VmStart { reason, console_log: kept.unwrap_or(console), tail }
}

impl VmSandbox {
    fn current(&self) -> SandboxState {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let (SandboxState::Running { pid }, Some(exit)) = (*state, self.vmm.exit()) {
            *state = SandboxState::Exited { pid, exit };
        }
        *state
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

/// virtiofsd must live as long as the VM: if it ends while the VM runs (crashed, killed), that
/// is logged and the VM is ended with it, so the pod's sandbox fails instead of serving a dead
/// filesystem. It is never restarted.
async fn watch_virtiofsd(virtiofsd: Supervised, vmm: Supervised) {
    let exit = virtiofsd.wait().await;
    if tokio::time::timeout(FOLLOW_GRACE, vmm.wait()).await.is_ok() {
        return;
    }
    error!(
        virtiofsd = virtiofsd.pid,
        status = exit.status,
        vmm = vmm.pid,
        "virtiofsd exited while the VM runs; ending the VM (the pod's sandbox fails, virtiofsd is not restarted)"
    );
    if let Err(e) = vmm.signal(Signal::SIGKILL) {
        error!("end the VM after virtiofsd's exit: {e}");
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
    use super::*;

    #[test]
    fn only_a_templates_nics_start_with_their_links_down() {
        let dir = Path::new("/templates/k1");
        assert_eq!(Origin::Template.link(), LinkState::Down);
        assert_eq!(Origin::Template.template(), None, "a template is booted");
        assert_eq!(Origin::of_pod(None).link(), LinkState::Up);
        assert_eq!(Origin::of_pod(None).template(), None);
        assert_eq!(Origin::of_pod(Some(dir)).link(), LinkState::Up);
        assert_eq!(Origin::of_pod(Some(dir)).template(), Some(dir));
    }
}
