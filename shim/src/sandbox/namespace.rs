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
//! log by [`crate::logrelay`]), and `rootfs/<id>`, an empty directory per container. The agent's mount namespace is private (the agent makes `/`
//! rprivate at boot), so host mounts made after it started never appear inside it; instead
//! the agent performs containerd's rootfs mounts (overlay over snapshot directories, which
//! are plain directories both sides see) at `rootfs/<id>` itself, or bind-mounts the bundle's
//! `rootfs` directory when containerd prepared it. The shim mounts nothing on the host.
//! Unless `[network] allow_metadata` is set, traffic to the cloud metadata endpoint is dropped
//! on the pod interfaces' egress before the agent starts ([`crate::network::block_metadata`]).
//! The pause container is not run: the agent is the pod's PID 1, and its launcher (already in
//! the pod's net/ipc/uts namespaces) is the sandbox task's process.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bulkhead_protocol::agent as pb;
use containerd_shim::protos::types::mount::Mount;
use nix::mount::{umount2, MntFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;
use tracing::{debug, info, warn, Instrument};

use super::cgroups::PodCgroup;
use super::launcher::{LaunchArgs, LAUNCH_ARG};
use super::paths::PodPaths;
use super::{RootfsPlan, Sandbox, SandboxError, SandboxRequest, SandboxState};
use crate::agent::{AgentClient, Timeouts};
use crate::config::{Backend, Config};
use crate::exit::ExitInfo;
use crate::network::MetadataAccess;
use crate::logrelay::{relay, Component, ConsoleLog, Source};

/// `sun_path` of a Unix socket address, NUL included.
const SUN_PATH_MAX: usize = 108;

pub struct NamespaceSandbox {
    id: String,
    paths: PodPaths,
    agent: Arc<AgentClient>,
    state: Mutex<SandboxState>,
    exited: watch::Receiver<Option<ExitInfo>>,
    /// The pod's cgroups; its record on disk lets `delete` remove them after a crash.
    cgroup: Mutex<PodCgroup>,
}

/// How long teardown may spend removing the pod's cgroups before it reports them and moves on.
const CGROUP_TEARDOWN_BUDGET: Duration = Duration::from_millis(500);

/// Writes the pod's cgroup record atomically (a crash never leaves half a record).
fn write_cgroup_record(paths: &PodPaths, cgroup: &PodCgroup) -> Result<(), SandboxError> {
    let json = serde_json::to_vec(cgroup).map_err(|e| io("encode cgroup record")(std::io::Error::other(e)))?;
    let tmp = paths.cgroup_file().with_extension("json.tmp");
    std::fs::write(&tmp, json)
        .and_then(|()| std::fs::rename(&tmp, paths.cgroup_file()))
        .map_err(io("write cgroup record"))
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
        std::fs::create_dir_all(paths.rootfs_dir()).map_err(io(format!("create {}", paths.rootfs_dir().display())))?;
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
        write_cgroup_record(&paths, &req.cgroup)?;
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
            command: vec![
                agent_path.display().to_string(),
                "--listen".into(),
                format!("unix:{}", socket.display()),
                "--mode".into(),
                "namespace".into(),
                // Per pod, so a killed pod's leftovers are found and removed with it.
                "--state-dir".into(),
                paths.agent_state_dir().display().to_string(),
                "--cgroup-parent".into(),
                req.cgroup.parent.display().to_string(),
            ],
        };
        let exe = std::env::current_exe().map_err(io("find own executable"))?;
        let mut command = tokio::process::Command::new(exe);
        command
            .arg(LAUNCH_ARG)
            .args(launch.to_args())
            // The agent's log lines are relayed into the shim log: plain text, no colour codes.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: a Ctrl-C or group signal aimed at the shim is not the pod's.
            .process_group(0);
        // SAFETY: the closure only calls prctl, which is async-signal-safe. The parent-death
        // signal follows the spawning thread, a runtime worker that lives as long as the shim.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(io("spawn namespace launcher"))?;
        let pid = child.id().unwrap_or_default();
        // The sandbox outlives the Create RPC that started it: its tasks log under their own span.
        let life_span = tracing::info_span!(parent: None, "sandbox", id = %req.sandbox_id);
        std::fs::write(paths.pid_file(), pid.to_string()).map_err(io("write pid file"))?;
        info!(sandbox = %req.sandbox_id, pid, netns = ?req.netns, "agent launched");

        // The agent's output is this backend's console (in a VM it is the serial line).
        let console = ConsoleLog::create(&paths.console_log())
            .map_err(|e| warn!("console log {}: {e}", paths.console_log().display()))
            .ok();
        let source = |stream| Source { pod: req.sandbox_id.clone(), component: Component::Agent, stream };
        if let Some(pipe) = child.stdout.take() {
            tokio::spawn(relay(pipe, source("stdout"), console.clone()).instrument(life_span.clone()));
        }
        if let Some(pipe) = child.stderr.take() {
            tokio::spawn(relay(pipe, source("stderr"), console).instrument(life_span.clone()));
        }

        let (exit_tx, exit_rx) = watch::channel(None);
        tokio::spawn(
            async move {
                let exit = match child.wait().await {
                    Ok(status) => {
                        use std::os::unix::process::ExitStatusExt;
                        let code = status
                            .code()
                            .map(|c| c as u32)
                            .or_else(|| status.signal().map(|s| 128 + s as u32))
                            .unwrap_or(255);
                        ExitInfo::from_agent(code, 0, false)
                    }
                    Err(e) => {
                        warn!("wait for namespace launcher: {e}");
                        ExitInfo::from_agent(255, 0, false)
                    }
                };
                info!(status = exit.status, "sandbox exited");
                exit_tx.send_replace(Some(exit));
            }
            .instrument(life_span),
        );

        let timeouts = Timeouts {
            connect: Duration::from_millis(config.agent.connect_timeout_ms),
            rpc: Duration::from_millis(config.agent.rpc_timeout_ms),
        };
        let agent = match dial_agent(&socket, timeouts, &exit_rx).await {
            Ok(agent) => agent,
            Err(e) => {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                cleanup(&paths).await;
                return Err(e);
            }
        };
        info!(
            agent_version = %agent.agent_version,
            mode = %agent.mode,
            "agent connected"
        );
        Ok(Arc::new(Self {
            id: req.sandbox_id,
            paths,
            agent: Arc::new(agent),
            state: Mutex::new(SandboxState::Running { pid }),
            exited: exit_rx,
            cgroup: Mutex::new(req.cgroup),
        }))
    }

    fn current(&self) -> SandboxState {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let (SandboxState::Running { pid }, Some(exit)) = (*state, *self.exited.borrow()) {
            *state = SandboxState::Exited { pid, exit };
        }
        *state
    }
}

/// Retries the dial until the agent answers, the launcher dies, or the deadline passes.
async fn dial_agent(
    socket: &Path,
    timeouts: Timeouts,
    exited: &watch::Receiver<Option<ExitInfo>>,
) -> Result<AgentClient, SandboxError> {
    let deadline = Instant::now() + timeouts.connect;
    let mut last = String::from("socket never appeared");
    loop {
        if let Some(exit) = *exited.borrow() {
            return Err(SandboxError::AgentStart(format!(
                "agent exited with status {} before answering ({last})",
                exit.status
            )));
        }
        if socket.exists() {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = Timeouts { connect: left.min(Duration::from_secs(1)), rpc: timeouts.rpc };
            match AgentClient::connect(socket, attempt).await {
                Ok(agent) => return Ok(agent),
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(SandboxError::AgentStart(format!(
                "no answer within {:?} at {}: {last}",
                timeouts.connect,
                socket.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// containerd's rootfs mounts as the agent performs them at the rootfs path; with none, a
/// recursive bind of the bundle's `rootfs` directory.
fn agent_rootfs_mounts(bundle_rootfs: &Path, mounts: &[Mount]) -> Vec<pb::Mount> {
    if mounts.is_empty() {
        return vec![pb::Mount {
            source: bundle_rootfs.display().to_string(),
            destination: "/".into(),
            fstype: String::new(),
            options: vec!["rbind".into()],
            ..Default::default()
        }];
    }
    mounts
        .iter()
        .map(|m| pb::Mount {
            source: m.source.clone(),
            destination: "/".into(),
            fstype: m.type_.clone(),
            options: m.options.clone(),
            ..Default::default()
        })
        .collect()
}

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    // Never "everything": only a real, absolute directory below the root qualifies.
    if !dir.is_absolute() || dir.parent().is_none() {
        return Vec::new();
    }
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mountinfo)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mountinfo(field: &str) -> String {
    field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// Unmounts (lazily) everything at or below `dir`.
pub fn unmount_all(dir: &Path) {
    for target in mounts_below(dir) {
        if let Err(e) = umount2(&target, MntFlags::MNT_DETACH) {
            debug!("umount {}: {e}", target.display());
        }
    }
}

/// Whether `pid` is the launcher of the pod whose agent listens on `socket` (guards against
/// pid reuse after a crash, by anyone, another pod's launcher included).
fn is_launcher(pid: i32, socket: &Path) -> bool {
    let listen = format!("unix:{}", socket.display());
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            let mut args = cmdline.split(|b| *b == 0);
            args.clone().any(|arg| arg == LAUNCH_ARG.as_bytes()) && args.any(|arg| arg == listen.as_bytes())
        })
        .unwrap_or(false)
}

/// Removes everything a pod left on the host: kills its launcher (the agent dies with it, and
/// with the agent every process of its PID namespace), unmounts, removes socket and state.
/// Safe to call repeatedly; used by `destroy` and by `delete` after a shim crash.
pub async fn cleanup(paths: &PodPaths) {
    if let Ok(text) = std::fs::read_to_string(paths.pid_file()) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            let socket = paths.agent_socket();
            if pid > 1 && is_launcher(pid, &socket) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                // Bounded wait for it to go (it may be someone else's zombie to reap).
                for _ in 0..200 {
                    if !is_launcher(pid, &socket) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
    // With the agent gone, nobody else removes its containers' cgroups.
    let cgroup =
        std::fs::read(paths.cgroup_file()).ok().and_then(|bytes| serde_json::from_slice::<PodCgroup>(&bytes).ok());
    if let Some(cgroup) = cgroup {
        cgroup.remove(CGROUP_TEARDOWN_BUDGET).await;
    }
    if let Err(e) = crate::network::teardown(&paths.network_record()).await {
        warn!("pod network teardown: {e}");
    }
    unmount_all(&paths.dir);
    if let Err(e) = std::fs::remove_dir_all(&paths.dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!("remove {}: {e}", paths.dir.display());
        }
    }
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
    ) -> Result<RootfsPlan, SandboxError> {
        {
            // Recorded before the agent makes the cgroup, so a crash in between still cleans it.
            let mut cgroup = self.cgroup.lock().unwrap_or_else(|p| p.into_inner());
            if !cgroup.add_container(container_id) {
                return Err(SandboxError::AgentStart(format!("container id {container_id:?} is not a plain id")));
            }
            write_cgroup_record(&self.paths, &cgroup)?;
        }
        let target = self.paths.rootfs(container_id);
        std::fs::create_dir_all(&target).map_err(io(format!("create {}", target.display())))?;
        Ok(RootfsPlan { path: target, mounts: agent_rootfs_mounts(bundle_rootfs, mounts) })
    }

    async fn release_container(&self, container_id: &str) -> Result<(), SandboxError> {
        let target = self.paths.rootfs(container_id);
        match std::fs::remove_dir(&target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SandboxError::Io { what: format!("remove {}", target.display()), source: e }),
        }
    }

    async fn signal(&self, signal: u32) -> Result<(), SandboxError> {
        let SandboxState::Running { pid } = self.current() else {
            return Ok(());
        };
        let sig = Signal::try_from(signal as i32).map_err(sys(format!("signal {signal}")))?;
        match kill(Pid::from_raw(pid as i32), sig) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(SandboxError::Sys { what: format!("kill sandbox {}", self.id), source: e }),
        }
    }

    async fn wait(&self) -> ExitInfo {
        let mut rx = self.exited.clone();
        loop {
            if let Some(exit) = *rx.borrow_and_update() {
                return exit;
            }
            if rx.changed().await.is_err() {
                return ExitInfo::from_agent(255, 0, false);
            }
        }
    }

    async fn destroy(&self) -> Result<(), SandboxError> {
        if let SandboxState::Running { .. } = self.current() {
            self.signal(Signal::SIGKILL as u32).await?;
            let _ = tokio::time::timeout(Duration::from_secs(5), self.wait()).await;
        }
        cleanup(&self.paths).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rootfs_mounts_go_to_the_agent() {
        let overlay = Mount {
            type_: "overlay".into(),
            source: "overlay".into(),
            options: vec!["lowerdir=/l".into(), "upperdir=/u".into(), "workdir=/w".into()],
            ..Default::default()
        };
        let planned = agent_rootfs_mounts(Path::new("/b/rootfs"), &[overlay]);
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].fstype, "overlay");
        assert_eq!(planned[0].destination, "/");
        assert_eq!(planned[0].options[0], "lowerdir=/l");
        let bind = agent_rootfs_mounts(Path::new("/b/rootfs"), &[]);
        assert_eq!(bind[0].source, "/b/rootfs");
        assert_eq!(bind[0].options, vec!["rbind".to_string()]);
    }

    #[test]
    fn unmount_scope_is_never_the_whole_host() {
        assert!(mounts_below(Path::new("")).is_empty());
        assert!(mounts_below(Path::new("/")).is_empty());
        assert!(mounts_below(Path::new("relative/dir")).is_empty());
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }

    #[test]
    fn non_launcher_pids_are_left_alone() {
        // Our own process is not a launcher, so cleanup would never signal it.
        let socket = Path::new("/run/bulkhead/x/a.sock");
        assert!(!is_launcher(std::process::id() as i32, socket));
        assert!(!is_launcher(i32::MAX, socket));
    }

    #[tokio::test]
    async fn cleanup_of_missing_state_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PodPaths::new(dir.path(), "nothing-here").unwrap();
        cleanup(&paths).await;
        assert!(!paths.dir.exists());
    }
}
