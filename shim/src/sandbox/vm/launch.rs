//! Starting a VM: lay the pod (or a template) out, start its virtiofsd and its jailed VMM,
//! booting or restoring ([`launch`]), wait for a restore to take ([`wait_restored`]), and turn a
//! start that fails after that into an error that quotes the console ([`start_failure`]). A pod's
//! start (`VmSandbox::start`) and a template's build (`template_builder`) both begin here.

use std::ffi::CString;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use tracing::{error, info, warn, Instrument};

use super::pod_dirs::{VmLayout, VmPlan};
use super::shape::VmShape;
use super::share::SharedDir;
use super::{console, ids, io, virtiofsd};
use crate::config::Config;
use crate::logrelay::Component;
use crate::network::{MetadataAccess, VmAttach, VmNetwork};
use crate::sandbox::cgroups;
use crate::sandbox::paths::PodPaths;
use crate::sandbox::supervise::{self, LogTo, Supervised};
use crate::sandbox::{SandboxError, SandboxRequest};
use bulkhead_vmm_api::config::{LinkState, NetConfig};

/// How long after virtiofsd's exit the VMM may take to exit too before that counts as a crash
/// (when the VM stops, virtiofsd sees its connection close and may exit first).
const FOLLOW_GRACE: Duration = Duration::from_secs(1);

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
    pub(super) fn of_pod(template: Option<&'a Path>) -> Self {
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
    if let Some(maps) = &req.id_maps {
        // The guest's containers' init opens its mounts' sources below the share as the pod's root.
        crate::sandbox::idmap::open_to_pod_root(maps, &[&share.mounts_dir()])
            .map_err(|e| SandboxError::Setup(e.to_string()))?;
    }
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
        mem_mib = shape.mem.get(), netns = ?req.netns, cgroup = %plan.cgroup.display(),
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
pub(super) async fn wait_restored(layout: &VmLayout, vmm: &Supervised) -> Result<(), String> {
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
