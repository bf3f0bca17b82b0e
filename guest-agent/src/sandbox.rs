//! The sandbox: the agent's containers and the operations the service exposes. One method
//! per RPC; the ttrpc layer (service.rs) only converts messages. A create is composed from
//! spec.rs, dns.rs, bundle.rs, rootfs.rs, process_io.rs and runtime/, each step undone by a
//! [`Rollback`] if a later one fails.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use bulkhead_protocol::stream::validate_id;
use oci_spec::runtime::Spec;

use crate::{
    bundle,
    cgroup_v1_devices::{self, DevicesStub},
    cgroups::{self, Cgroup, Hierarchy},
    cli::{AgentOpts, Mode, PodNetwork},
    container::{Container, Event, ExitRecord, NewContainer},
    dns,
    error::{AgentError, Result},
    guest_init::{self, SandboxSettings},
    host_view,
    mount::GuestMount,
    oom::OomEvents,
    pod_userns::PodUserns,
    privileges,
    process_io::{ProcessIoSetup, StdioRequest},
    reaper::Reaper,
    rollback::Rollback,
    rootfs,
    runtime::Runtime,
    spec,
    stdio::PumpOpts,
    syscall::{LinuxSyscall, Syscall},
};

const OOM_POLL: Duration = Duration::from_millis(200);
/// How long WaitProcess holds an exit for the process's output to be handed on first
/// (`ProcessIo::output_handed_on`): well below the shim's 2 s drain after the exit.
const OUTPUT_BEFORE_EXIT: Duration = Duration::from_secs(1);

pub struct CreateRequest {
    pub id: String,
    pub spec_json: Vec<u8>,
    pub rootfs_path: String,
    pub rootfs_mounts: Vec<GuestMount>,
    pub stdio: StdioRequest,
}

/// Whether the shim has given this sandbox its identity (SetupSandbox: hostname, clock, entropy,
/// mounts, network). A VM restored from a template starts `Awaited` however long the template
/// ran, because templates are snapshotted before any pod's SetupSandbox: no container may start
/// with the template's clock, random state or hostname.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Identity {
    Awaited,
    Given,
}

pub struct Sandbox {
    pub mode: Mode,
    /// Whose network namespace the pod is in (namespace mode: the node's refuses `net.*` sysctls).
    pub network: PodNetwork,
    /// Namespace mode in the minimal root with the capability drop (crate::privileges): every
    /// container and exec is checked against the capabilities containers may have.
    pub confined: bool,
    /// Namespace mode in a user namespace of its own (`guest_init::user_ns`): no sysfs mounts.
    in_user_ns: bool,
    state_dir: PathBuf,
    cgroup_parent: PathBuf,
    io: ProcessIoSetup,
    reaper: Reaper,
    runtime: Runtime,
    pub oom: Arc<OomEvents>,
    containers: Mutex<HashMap<String, Arc<Container>>>,
    /// Ids between reservation and insertion (create in progress), and exec ids likewise.
    reserved: Mutex<HashSet<String>>,
    identity: Mutex<Identity>,
    /// A hostUsers: false pod's namespaces, from its SetupSandbox on.
    pod_userns: Mutex<Option<Arc<PodUserns>>>,
    sys: LinuxSyscall,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Releases a reservation on every exit path.
struct Reservation<'a> {
    set: &'a Mutex<HashSet<String>>,
    key: String,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock(self.set).remove(&self.key);
    }
}

impl Sandbox {
    pub fn new(opts: &AgentOpts, reaper: Reaper) -> anyhow::Result<Self> {
        std::fs::create_dir_all(opts.state_dir.join("bundles"))?;
        let runtime = Runtime::new(opts.state_dir.join("libcontainer"), reaper.clone())?;
        Ok(Self {
            mode: opts.mode,
            network: opts.network,
            confined: opts.confined(),
            in_user_ns: opts.confined() && guest_init::user_ns::serving_in_one()?,
            state_dir: opts.state_dir.clone(),
            cgroup_parent: opts.cgroup_parent.clone(),
            io: ProcessIoSetup::new(
                opts.state_dir.join("sock"),
                PumpOpts { backlog: opts.stream_backlog_bytes, stall: opts.stream_stall_ms },
            )?,
            reaper,
            runtime,
            oom: Arc::new(OomEvents::default()),
            containers: Mutex::new(HashMap::new()),
            reserved: Mutex::new(HashSet::new()),
            identity: Mutex::new(Identity::Awaited),
            pod_userns: Mutex::new(None),
            sys: LinuxSyscall,
        })
    }

    pub fn container(&self, id: &str) -> Result<Arc<Container>> {
        lock(&self.containers).get(id).cloned().ok_or_else(|| AgentError::NotFound(format!("container {id}")))
    }

    fn reserve(&self, key: String, what: &str) -> Result<Reservation<'_>> {
        let mut r = lock(&self.reserved);
        let taken = r.contains(&key) || (what == "container" && lock(&self.containers).contains_key(&key));
        if taken {
            return Err(AgentError::AlreadyExists(format!("{what} {key}")));
        }
        r.insert(key.clone());
        Ok(Reservation { set: &self.reserved, key })
    }

    /// Applies SetupSandbox; says whether the pod has a user namespace of its own.
    pub fn setup(&self, s: &SandboxSettings) -> Result<bool> {
        let pod_cgroup =
            Path::new(cgroups::ROOT).join(self.cgroup_parent.strip_prefix("/").unwrap_or(&self.cgroup_parent));
        // Held throughout: a second SetupSandbox racing this one must not mount the share twice.
        let mut identity = lock(&self.identity);
        guest_init::apply_setup(s, self.mode, self.network, &self.sys, &dns::pod_file(&self.state_dir), &pod_cgroup)?;
        let userns = self.setup_pod_userns(s)?;
        // Last, so that a failed setup leaves nothing mounted and can be tried again.
        if *identity == Identity::Awaited {
            crate::shared_fs::mount_shared_dir(self.mode, &self.sys, &crate::shared_fs::kernel_cmdline())
                .map_err(|e| AgentError::Internal(format!("{e:#}")))?;
        }
        *identity = Identity::Given;
        Ok(userns)
    }

    /// Makes the pod's user namespace the first time SetupSandbox asks for one; a repeated
    /// SetupSandbox must ask for the same maps.
    fn setup_pod_userns(&self, s: &SandboxSettings) -> Result<bool> {
        if s.uid_mappings.is_empty() && s.gid_mappings.is_empty() {
            return Ok(lock(&self.pod_userns).is_some());
        }
        let mut slot = lock(&self.pod_userns);
        if let Some(made) = slot.as_ref() {
            return if made.has_maps(&s.uid_mappings, &s.gid_mappings) {
                Ok(true)
            } else {
                Err(AgentError::FailedPrecondition("the pod already has a user namespace with other maps".into()))
            };
        }
        let made = PodUserns::create(&s.uid_mappings, &s.gid_mappings, &s.hostname, &self.reaper)?;
        tracing::info!(uid_map = ?s.uid_mappings, gid_map = ?s.gid_mappings, "the pod has a user namespace of its own");
        *slot = Some(Arc::new(made));
        Ok(true)
    }

    /// Brings `count` of the guest's CPUs online (the others offline); returns how many are.
    /// Guest mode only: in namespace mode the CPUs are the host's.
    pub async fn set_online_cpus(&self, count: u32) -> Result<u32> {
        if self.mode != crate::cli::Mode::Guest {
            return Err(AgentError::Unsupported("online CPUs in namespace mode: the CPUs are the host's".into()));
        }
        // CPU hotplug waits for the CPU to come up or stop: off the runtime's workers.
        tokio::task::spawn_blocking(move || crate::online_cpus::set(Path::new(crate::online_cpus::SYSFS_CPUS), count))
            .await
            .map_err(|e| AgentError::internal("online CPUs", e))?
    }

    /// Refuses work that needs the pod's identity before SetupSandbox has given it.
    fn check_identity(&self, what: &str) -> Result<()> {
        match *lock(&self.identity) {
            Identity::Given => Ok(()),
            Identity::Awaited => Err(AgentError::FailedPrecondition(format!(
                "{what} before SetupSandbox: the sandbox has no identity yet (hostname, clock, entropy)"
            ))),
        }
    }

    // ---- create / exec ---------------------------------------------------------------

    pub async fn create_container(self: &Arc<Self>, req: CreateRequest) -> Result<i32> {
        validate_id(&req.id)?;
        self.check_identity(&format!("create of container {}", req.id))?;
        let _res = self.reserve(req.id.clone(), "container")?;
        let hierarchy = Hierarchy::detect()?;
        let mut spec = spec::parse_spec(&req.spec_json)?;
        if self.confined {
            let caps = spec.process().as_ref().and_then(|p| p.capabilities().as_ref());
            privileges::check_container(caps, &format!("container {}", req.id))?;
        }
        if self.mode == Mode::Namespace {
            let sysctls = spec.linux().as_ref().and_then(|l| l.sysctl().clone()).unwrap_or_default();
            guest_init::check_namespaced(sysctls.keys().map(String::as_str), self.network)?;
            host_view::keep_proc_read_only(&mut spec);
            if self.in_user_ns {
                host_view::bind_sysfs(&mut spec, Path::new(host_view::CONTAINER_SYSFS));
            }
        }
        let seal_cgroups = self.mode == Mode::Namespace && host_view::wants_read_only_cgroups(&spec);
        let cgroup_path = self.cgroup_parent.join(&req.id);
        let rootfs = spec::adapt_to_sandbox(&mut spec, &req.rootfs_path, req.stdio.terminal, &cgroup_path)?;
        spec::fit_spec_hugepages(&mut spec, &spec::hugepage_sizes())?;
        // In namespace mode containerd already decided from the host's hierarchy, which is ours.
        if self.mode == Mode::Guest && hierarchy == Hierarchy::V2 && spec::give_cgroup_namespace(&mut spec) {
            tracing::debug!(container = %req.id, "cgroup namespace added: the guest is on cgroup v2");
        }
        let pod_dns = dns::pod_file(&self.state_dir);
        if pod_dns.exists() {
            dns::point_at_pod_file(&mut spec, &pod_dns);
        }
        let seccomp = spec::take_seccomp(&mut spec)?;
        let pod_userns = lock(&self.pod_userns).clone();
        let asks_userns = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .is_some_and(|list| list.iter().any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::User));
        match &pod_userns {
            Some(userns) => {
                userns.join(&mut spec, &req.id)?;
                if self.mode == Mode::Guest {
                    host_view::bind_sysfs(&mut spec, Path::new("/sys"));
                }
            }
            None if asks_userns => {
                return Err(AgentError::Unsupported(format!(
                    "container {} asks for a user namespace its pod does not have (only a pod's own, hostUsers: \
                     false, is supported)",
                    req.id
                )))
            }
            None => {}
        }
        // Declared after the reservation, so the id stays reserved until the undo is done.
        let mut undo = Rollback::default();
        let bundle = self.state_dir.join("bundles").join(&req.id);
        let laid_out = lay_out(&self.sys, &bundle, &spec, seccomp.as_deref(), &rootfs, &req.rootfs_mounts, &mut undo)?;
        let (child_io, pending) = self.io.prepare(&req.stdio)?;
        let runtime = &self.runtime;
        let id = req.id.clone();
        // A failed create may leave libcontainer state (and a waiting init) behind.
        undo.push(format!("delete libcontainer container {id}"), move || runtime.delete_blocking(&id, true));
        let devices_stub = if self.in_user_ns && hierarchy == Hierarchy::V1 {
            let stub = DevicesStub::place(&self.sys, &cgroup_v1_devices::hierarchy()?, &cgroup_path)?;
            // Registered after the delete, so it runs before it: the cgroup cannot go with the binds in it.
            let (sys, placed) = (&self.sys, stub.clone());
            undo.push(format!("lift the devices stub of {}", req.id), move || {
                placed.lift_and_remove(sys);
                Ok::<(), AgentError>(())
            });
            Some(stub)
        } else {
            None
        };
        let joined = pod_userns.as_deref().map(PodUserns::inherited).unwrap_or_default();
        let pid = self.runtime.create(&req.id, &bundle, child_io, laid_out.seccomp_file.as_deref(), &joined).await?;
        if seal_cgroups {
            // Before the container starts: its init waits for Start.
            let sealed = tokio::task::spawn_blocking(move || host_view::seal_cgroup_mounts(pid))
                .await
                .map_err(|e| AgentError::Internal(format!("cgroup mounts: {e}")))??;
            tracing::debug!(container = %req.id, sealed, "cgroup mounts made read-only");
        }
        let io = self.io.finish(pending, &format!("{}/init", req.id)).await?;
        undo.disarm();
        let c = Container::new(
            NewContainer {
                id: req.id.clone(),
                bundle,
                cgroup: Cgroup::new(cgroup_path, hierarchy),
                rootfs_mounts: laid_out.rootfs_mounts,
                devices_stub,
                init_pid: pid,
                init_io: io,
            },
            &self.reaper,
        );
        c.set_monitor(self.spawn_oom_monitor(&c));
        lock(&self.containers).insert(req.id.clone(), c);
        tracing::info!(container = %req.id, pid, "container created");
        Ok(pid)
    }

    pub async fn start_container(&self, id: &str) -> Result<i32> {
        let c = self.container(id)?;
        c.check(Event::Start)?;
        self.runtime.start(id).await?;
        // A fast process (`echo`) may already have exited and moved the container to
        // Stopped; that is a successful start.
        if let Err(e) = c.transition(Event::Start) {
            if c.state() != crate::container::ContainerState::Stopped {
                return Err(e);
            }
        }
        Ok(c.init.pid)
    }

    pub async fn exec_process(&self, id: &str, exec_id: &str, process_json: &[u8], stdio: StdioRequest) -> Result<i32> {
        validate_id(exec_id)?;
        let c = self.container(id)?;
        match c.state() {
            crate::container::ContainerState::Running => {}
            other => {
                return Err(AgentError::FailedPrecondition(format!(
                    "cannot exec in container {id}: it is {}",
                    other.name()
                )))
            }
        }
        let _res = self.reserve(format!("{id}/{exec_id}"), "exec")?;
        if c.has_exec(exec_id) {
            return Err(AgentError::AlreadyExists(format!("exec {exec_id} in container {id}")));
        }
        let seccomp_file = bundle::seccomp_file(&c.bundle);
        let process = spec::exec_process(process_json, stdio.terminal, seccomp_file.is_some())?;
        if self.confined {
            privileges::check_container(process.capabilities().as_ref(), &format!("exec {exec_id} in {id}"))?;
        }
        let path = bundle::write_exec_process(&c.bundle, exec_id, &process)?;
        let (child_io, pending) = self.io.prepare(&stdio)?;
        // An exec joins its pod's user namespace, if it has one, as its container did.
        let pod_userns = lock(&self.pod_userns).clone();
        let joined = pod_userns.as_deref().map(PodUserns::inherited).unwrap_or_default();
        let pid =
            self.runtime.exec(id, &path, child_io, seccomp_file.as_deref(), &joined, pod_userns.is_some()).await?;
        let io = self.io.finish(pending, &format!("{id}/{exec_id}")).await?;
        c.add_exec(exec_id, pid, io, &self.reaper);
        tracing::info!(container = id, exec = exec_id, pid, "exec started");
        Ok(pid)
    }

    // ---- signals, wait, tty -----------------------------------------------------------------

    pub fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let sig = i32::try_from(signal)
            .ok()
            .filter(|s| (1..=64).contains(s))
            .ok_or_else(|| AgentError::InvalidArgument(format!("signal {signal} out of range")))?;
        let c = self.container(id)?;
        if all && exec_id.is_empty() {
            for pid in c.cgroup.pids()? {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid as i32, sig) };
            }
            return Ok(());
        }
        let p = c.process(exec_id)?;
        if p.exited().is_some() {
            return Err(AgentError::NotFound(format!("process {id}/{exec_id} (already exited)")));
        }
        // SAFETY: plain kill(2) on a pid we have not reaped yet (so it cannot be reused).
        let rc = unsafe { libc::kill(p.pid, sig) };
        if rc != 0 {
            return Err(AgentError::internal("kill", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    pub async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitRecord> {
        let p = self.container(id)?.process(exec_id)?;
        let exit = p.wait().await;
        if !p.io.output_handed_on(OUTPUT_BEFORE_EXIT).await {
            tracing::info!(container = %id, exec = %exec_id, bound = ?OUTPUT_BEFORE_EXIT,
                "the process's output is still open after its exit (a child holds it); reporting the exit");
        }
        Ok(exit)
    }

    pub fn resize(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        let p = self.container(id)?.process(exec_id)?;
        let dim = |v: u32| u16::try_from(v).map_err(|_| AgentError::InvalidArgument(format!("tty size {v}")));
        p.io.resize(dim(rows)?, dim(cols)?).map_err(AgentError::FailedPrecondition)
    }

    pub fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        let p = self.container(id)?.process(exec_id)?;
        p.io.close_stdin();
        Ok(())
    }

    // ---- resources ----------------------------------------------------------------------

    pub async fn pause(&self, id: &str) -> Result<()> {
        let c = self.container(id)?;
        c.check(Event::Pause)?;
        self.runtime.pause(id).await?;
        c.transition(Event::Pause).map(|_| ())
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let c = self.container(id)?;
        c.check(Event::Resume)?;
        self.runtime.resume(id).await?;
        c.transition(Event::Resume).map(|_| ())
    }

    pub fn update(&self, id: &str, resources_json: &[u8]) -> Result<()> {
        let mut r = spec::parse_resources(resources_json)?;
        spec::fit_hugepage_limits(&mut r, &spec::hugepage_sizes())?;
        self.container(id)?.cgroup.update(&r)
    }

    fn spawn_oom_monitor(&self, c: &Arc<Container>) -> tokio::task::JoinHandle<()> {
        // Polling the counter works the same on v1 and v2 and needs no eventfd plumbing;
        // a 200 ms delay on an OOM event is acceptable.
        let weak = Arc::downgrade(c);
        let oom = self.oom.clone();
        let id = c.id.clone();
        let mut last = c.oom_baseline();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(OOM_POLL).await;
                let Some(c) = weak.upgrade() else { return };
                if let Some(n) = c.cgroup.oom_kill_count() {
                    if n > last {
                        oom.publish(&id);
                        last = n;
                    }
                }
            }
        })
    }

    // ---- removal and shutdown ----------------------------------------------------------

    pub async fn remove(&self, id: &str, force: bool) -> Result<()> {
        let c = self.container(id)?;
        let state = c.state();
        use crate::container::ContainerState as S;
        if !force && matches!(state, S::Running | S::Paused) {
            return Err(AgentError::FailedPrecondition(format!(
                "container {id} is {}; stop it or remove with force",
                state.name()
            )));
        }
        if let Some(stub) = &c.devices_stub {
            stub.lift(&self.sys);
        }
        self.runtime.delete(id, true).await?;
        rootfs::unmount_all(&self.sys, &c.rootfs_mounts);
        bundle::remove(&c.bundle);
        lock(&self.containers).remove(id);
        tracing::info!(container = id, "container removed");
        Ok(())
    }

    /// Stops everything: TERM, then KILL after `grace`, then removes every container.
    pub async fn destroy(&self, grace: Duration) {
        let all: Vec<Arc<Container>> = lock(&self.containers).values().cloned().collect();
        for c in &all {
            let _ = self.signal(&c.id, "", libc::SIGTERM as u32, true);
        }
        let _ = tokio::time::timeout(grace, async {
            for c in &all {
                c.init.wait().await;
            }
        })
        .await;
        for c in &all {
            if let Err(e) = self.remove(&c.id, true).await {
                tracing::warn!(container = %c.id, error = %e, "remove at destroy");
            }
        }
    }
}

/// What [`lay_out`] made that outlives the create.
struct LaidOut {
    rootfs_mounts: Vec<PathBuf>,
    seccomp_file: Option<PathBuf>,
}

/// The synchronous first half of a create, each step registered on `undo`: the bundle with the
/// seccomp filters, the rootfs mounts, then (the rootfs being in place) config.json.
fn lay_out<'a>(
    sys: &'a dyn Syscall,
    bundle_dir: &Path,
    spec: &Spec,
    seccomp: Option<&[u8]>,
    rootfs: &Path,
    mounts: &[GuestMount],
    undo: &mut Rollback<'a>,
) -> Result<LaidOut> {
    bundle::create(bundle_dir, undo)?;
    let seccomp_file = seccomp.map(|bpf| bundle::write_seccomp(bundle_dir, bpf)).transpose()?;
    let rootfs_mounts = rootfs::mount_all(sys, rootfs, mounts, undo)?;
    rootfs::check_is_dir(rootfs)?;
    bundle::write_config(bundle_dir, spec)?;
    Ok(LaidOut { rootfs_mounts, seccomp_file })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syscall::test::{Call, RecordingSyscall};

    fn bind(source: &str, destination: &str) -> GuestMount {
        GuestMount { source: source.into(), destination: destination.into(), fstype: String::new(), options: vec![] }
    }

    #[test]
    fn a_create_failing_midway_undoes_exactly_what_it_did() {
        let state = tempfile::tempdir().unwrap();
        let bundle_dir = state.path().join("bundles/c1");
        let sys = RecordingSyscall::failing_mount("/rootfs/b", libc::EPERM);
        let mounts = [bind("a", "/a"), bind("b", "/b"), bind("c", "/c")];
        let mut undo = Rollback::default();
        let err = lay_out(&sys, &bundle_dir, &Spec::default(), Some(b"bpf"), Path::new("/rootfs"), &mounts, &mut undo)
            .err()
            .unwrap();
        assert!(matches!(err, AgentError::FailedPrecondition(_)), "{err}");
        assert!(bundle_dir.join("seccomp.bpf").exists(), "done before the failure");
        assert!(!bundle_dir.join("config.json").exists(), "never reached");
        drop(undo);
        assert!(!bundle_dir.exists(), "the bundle is removed");
        assert!(state.path().join("bundles").exists(), "but nothing above it");
        assert_eq!(
            sys.calls(),
            [
                Call::Mkdir("/rootfs/a".into()),
                Call::Mount {
                    source: Some("a".into()),
                    target: "/rootfs/a".into(),
                    fstype: None,
                    flags: nix::mount::MsFlags::empty(),
                    data: None
                },
                Call::Mkdir("/rootfs/b".into()),
                Call::Mount {
                    source: Some("b".into()),
                    target: "/rootfs/b".into(),
                    fstype: None,
                    flags: nix::mount::MsFlags::empty(),
                    data: None
                },
                Call::Umount("/rootfs/a".into()),
            ],
            "only the mount that succeeded is undone; c is never tried"
        );
    }

    #[test]
    fn a_create_that_succeeds_keeps_what_it_laid_out() {
        let state = tempfile::tempdir().unwrap();
        let rootfs = tempfile::tempdir().unwrap();
        let bundle_dir = state.path().join("c2");
        std::fs::create_dir_all(&bundle_dir).unwrap();
        std::fs::write(bundle_dir.join("stale"), b"left over from a failed create").unwrap();
        let sys = RecordingSyscall::default();
        let mut undo = Rollback::default();
        let laid_out =
            lay_out(&sys, &bundle_dir, &Spec::default(), None, rootfs.path(), &[bind("v", "/data")], &mut undo)
                .unwrap();
        undo.disarm();
        assert_eq!(laid_out.rootfs_mounts, [rootfs.path().join("data")]);
        assert_eq!(laid_out.seccomp_file, None);
        assert!(!bundle_dir.join("stale").exists(), "the bundle starts clean");
        let config: Spec = serde_json::from_slice(&std::fs::read(bundle_dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config, Spec::default());
        assert!(!sys.calls().iter().any(|c| matches!(c, Call::Umount(_))));
    }
}
