//! The shim's `vm` backend through a real containerd, a real jailed `bulkhead-vmm` and the pod's
//! real virtiofsd, up to the agent handshake (what this PVM host runs): a test guest stands in
//! for the kernel. One that never answers fails RunPodSandbox at the connect timeout, one that
//! resets at once fails it as soon as the VMM exits; both errors name the console log and quote
//! it. The virtio-fs guest reaches the pod's sandboxed virtiofsd through the socket in the
//! chroot. A virtiofsd killed under a running VM ends the VM. Afterwards, and after `kill -9` of
//! the shim followed by containerd's `delete`, nothing of the pod is left. Warm starts: a template
//! (built by `bulkhead-ctl template build` from a vsock guest) is restored into the pod's own VMM
//! and devices and left unchanged; one the VMM refuses is moved aside and the pod boots cold. With
//! the agent stub (a test guest that answers Version and SetupSandbox) a restored pod gets ready,
//! logs its start phases, and stops leaving nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::vm_env::KEPT_CONSOLE;
use bulkhead_integration::{
    cgroups, pod_config, skip, workspace_bin, ContainerdConfig, ContainerdVersion, Setup, ShimEnv,
};
use bulkhead_integration::{guests, RuntimeHandler};
use k8s_cri::v1 as cri;

/// The VMM's user and group in these tests (not `nobody`, so the checks mean something).
/// The VMM identities of the test's pods: `jail_id_first` and, by default, `jail_id_count`.
const JAIL_IDS: u32 = 40_200;
const JAIL_ID_COUNT: u32 = 16;

/// A private containerd whose `bulkhead` handler runs the `vm` backend with `guest` as kernel.
struct VmEnv {
    /// Its containerd goes first: the pods' cgroups are removable only then.
    shim: ShimEnv,
    connect_timeout: Duration,
    /// The shim's config (for `bulkhead-ctl`).
    config: PathBuf,
    /// The pods' cgroup parent (kubelet's role here); removed after containerd is gone.
    cgroup_parent: CgroupParent,
}

impl std::ops::Deref for VmEnv {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

struct CgroupParent(String);

impl Drop for CgroupParent {
    fn drop(&mut self) {
        for dir in cgroups::dirs(&self.0) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Prints `SKIPPED` and returns `None` when a prerequisite is missing (a failure under
/// `BULKHEAD_REQUIRE_E2E`): root, containerd, /dev/kvm, the guest toolchain, the built binaries.
async fn setup(test: &str, guest: &str, connect_timeout: Duration) -> Result<Option<VmEnv>> {
    setup_ids(test, guest, connect_timeout, JAIL_ID_COUNT, "").await
}

/// Like [`setup`], with `jail_ids` VMM identities for the pods and `more_vm` added to the
/// config's `[vm]` table.
async fn setup_ids(
    test: &str,
    guest: &str,
    connect_timeout: Duration,
    jail_ids: u32,
    more_vm: &str,
) -> Result<Option<VmEnv>> {
    setup_with(test, guest, connect_timeout, jail_ids, more_vm, false).await
}

/// [`setup_ids`], with the harness's CNI bridge for pod-network pods when `cni_bridge`.
async fn setup_with(
    test: &str,
    guest: &str,
    connect_timeout: Duration,
    jail_ids: u32,
    more_vm: &str,
    cni_bridge: bool,
) -> Result<Option<VmEnv>> {
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let Some(setup) = Setup::new(test, version, &["bulkhead-vmm", "containerd-shim-bulkhead-v2"])? else {
        return Ok(None);
    };
    if let Err(why) = bulkhead_vmm_api::probe::kvm_device_usable() {
        skip::missing_prerequisite(test, &why);
        return Ok(None);
    }
    let guest = match guests::build(guest, &bulkhead_integration::target_dir().join("bulkhead-test-guests")) {
        Ok(path) => path,
        Err(why) => {
            skip::missing_prerequisite(test, &why);
            return Ok(None);
        }
    };
    let virtiofsd = bulkhead_integration::virtiofsd_path();
    if !virtiofsd.is_file() {
        skip::missing_prerequisite(test, &format!("{} is missing (run `make setup`)", virtiofsd.display()));
        return Ok(None);
    }
    // The test guest ignores it, but the VM has one, as a pod's would.
    let initramfs = setup.write_config("initramfs.cpio.gz", "not read by the test guest")?;
    let config = setup.write_config(
        "bulkhead.toml",
        &format!(
            "backend = \"vm\"\nstate_dir = \"{}\"\n\n[agent]\nconnect_timeout_ms = {}\n\n\
             [vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nvirtiofsd_path = \"{}\"\n\
             memory_mib = 64\njail_id_first = {JAIL_IDS}\njail_id_count = {jail_ids}\n{more_vm}",
            setup.state().display(),
            connect_timeout.as_millis(),
            workspace_bin("bulkhead-vmm").display(),
            guest.display(),
            initramfs.display(),
            virtiofsd.display(),
        ),
    )?;
    let handlers = vec![RuntimeHandler::bulkhead(Some(&config))];
    let shim = setup.start(ContainerdConfig { handlers, cni_bridge, ..Default::default() }).await?;
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let cgroup_parent = CgroupParent(format!("/bhtest-vm-{}-{seq}", std::process::id()));
    Ok(Some(VmEnv { shim, connect_timeout, config, cgroup_parent }))
}

impl VmEnv {
    /// A pod (host network, as kubelet sends it) in the test's cgroup parent, and its log dir.
    fn pod(&self, name: &str) -> Result<(cri::PodSandboxConfig, PathBuf)> {
        let log_dir = self.containerd.new_log_dir(name)?;
        let mut pod = pod_config(name, &log_dir);
        if let Some(linux) = pod.linux.as_mut() {
            linux.cgroup_parent = self.cgroup_parent.0.clone();
        }
        Ok((pod, log_dir))
    }

    /// [`Self::pod`] with a pod network (the harness's CNI bridge).
    fn networked_pod(&self, name: &str) -> Result<(cri::PodSandboxConfig, PathBuf)> {
        let (mut pod, log_dir) = self.pod(name)?;
        bulkhead_integration::cri::use_pod_network(&mut pod)?;
        Ok((pod, log_dir))
    }

    fn state(&self) -> &Path {
        self.state_dir.path()
    }

    /// Nothing of the failed pod is left: VMM (waiter and jailed child), shim, state dir with
    /// chroot, device node and sockets, mounts, cgroups.
    async fn assert_nothing_left(&self) -> Result<()> {
        let within = Duration::from_secs(20);
        let state = self.state().display().to_string();
        eventually_nothing("VMM processes", within, || {
            processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
        })
        .await?;
        let address = self.containerd.address().display().to_string();
        eventually_nothing("shim processes", within, || {
            processes_with(&address)
                .into_iter()
                .filter(|(_, c)| c.contains("containerd-shim-bulkhead-v2"))
                .map(|(p, c)| format!("{p} {c}"))
                .collect()
        })
        .await?;
        eventually_nothing("pod state", within, || bulkhead_integration::host::state_left(self.state())).await?;
        eventually_nothing("mounts", within, || mounts_with(&state)).await?;
        eventually_nothing("cgroups", within, || {
            cgroups::dirs(&self.cgroup_parent.0)
                .into_iter()
                .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path().display().to_string())
                .collect()
        })
        .await
    }
}

impl VmEnv {
    /// The pod's state dir, once the shim made it.
    fn pod_dir(&self) -> Option<PathBuf> {
        // Node-level state (the VMM identities in `.ids`) is not a pod.
        let pod =
            std::fs::read_dir(self.state()).ok()?.flatten().find(|e| !e.file_name().to_string_lossy().starts_with('.'));
        Some(pod?.path())
    }

    /// Waits (while RunPodSandbox is under way) until the guest printed `line`.
    async fn wait_for_console(&self, line: &str) -> Result<PathBuf> {
        let console = || -> Option<(PathBuf, String)> {
            let pod = self.pod_dir()?;
            Some((pod.clone(), std::fs::read_to_string(pod.join("vm/root/run/console.log")).ok()?))
        };
        eventually_nothing("a guest that is not up yet", Duration::from_secs(60), || match console() {
            Some((_, text)) if text.contains(line) => vec![],
            other => vec![format!("console: {other:?}")],
        })
        .await?;
        self.pod_dir().context("the pod's state dir")
    }

    /// The pod's virtiofsd: the process the shim started, and its sandboxed worker (its child).
    fn virtiofsd(&self, pod_dir: &Path) -> Option<(u32, u32)> {
        let shared = format!("--shared-dir {}", pod_dir.join("shared").display());
        let pids: Vec<u32> = processes_with(&shared).into_iter().map(|(pid, _)| pid).collect();
        let parent_of = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit(") ").next()?.split(' ').nth(1)?.parse::<u32>().ok())
        };
        let main = *pids.iter().find(|pid| !parent_of(**pid).is_some_and(|p| pids.contains(&p)))?;
        let worker = *pids.iter().find(|pid| parent_of(**pid) == Some(main))?;
        Some((main, worker))
    }
}

/// The uid of the jailed VMM among `vmms` (its waiter stays root).
fn jailed_vmm_uid(vmms: &[(u32, String)]) -> Option<u32> {
    vmms.iter()
        .filter_map(|(pid, _)| status_field(*pid, "Uid").split_whitespace().next()?.parse::<u32>().ok())
        .find(|uid| *uid != 0)
}

/// The jailed VMM's pid and uid among `vmms`.
fn jailed_vmm(vmms: &[(u32, String)]) -> Option<(u32, u32)> {
    vmms.iter().find_map(|(pid, _)| {
        let uid = status_field(*pid, "Uid").split_whitespace().next()?.parse::<u32>().ok()?;
        (uid != 0).then_some((*pid, uid))
    })
}

fn status_field(pid: u32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix(&format!("{name}:"))).unwrap_or_default().trim().to_string()
}

/// The error names the console log (kept with the pod's logs) and quotes the guest's line.
fn assert_names_console(err: &str, log_dir: &Path, guest_line: &str) {
    let kept = log_dir.join(KEPT_CONSOLE);
    assert!(err.contains(&format!("console log {}", kept.display())), "the error names the console log: {err}");
    assert!(err.contains(guest_line), "the error quotes the console: {err}");
    let text = std::fs::read_to_string(&kept).unwrap_or_default();
    assert!(text.contains(guest_line), "the kept console log has the guest's output: {text:?}");
}

#[tokio::test]
async fn vm_guest_that_never_answers_fails_at_the_connect_timeout() -> Result<()> {
    let test = "vm_guest_that_never_answers_fails_at_the_connect_timeout";
    let Some(env) = setup(test, "idle", Duration::from_secs(4)).await? else { return Ok(()) };
    let (pod, log_dir) = env.pod("silent")?;
    let started = Instant::now();
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("a silent guest must fail")?;
    let took = started.elapsed();
    let err = format!("{err:#}");
    println!("RunPodSandbox failed after {took:?}, as it must: {err}");
    assert!(err.contains("did not answer within"), "{err}");
    assert!(took >= env.connect_timeout, "failed after {took:?}, before the connect timeout: {err}");
    assert!(took < env.connect_timeout + Duration::from_secs(15), "failed only after {took:?}: {err}");
    assert_names_console(&err, &log_dir, "idle guest up");
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_guest_that_exits_at_once_fails_at_once() -> Result<()> {
    let test = "vm_guest_that_exits_at_once_fails_at_once";
    let Some(env) = setup(test, "hello", Duration::from_secs(120)).await? else { return Ok(()) };
    let (pod, log_dir) = env.pod("resets")?;
    let started = Instant::now();
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("a guest that resets must fail")?;
    let took = started.elapsed();
    let err = format!("{err:#}");
    println!("RunPodSandbox failed after {took:?}, as it must: {err}");
    assert!(err.contains("exited with status 0 before the agent answered"), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}, the connect timeout is {:?}", env.connect_timeout);
    assert_names_console(&err, &log_dir, "hello from the bulkhead test guest");
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_guest_reaches_the_pods_virtiofsd() -> Result<()> {
    let test = "vm_guest_reaches_the_pods_virtiofsd";
    let Some(env) = setup(test, "fs", Duration::from_secs(120)).await? else { return Ok(()) };
    let (pod, log_dir) = env.pod("fs")?;
    // The fs guest speaks FUSE through the VM's virtio-fs device to the pod's virtiofsd (INIT,
    // then a LOOKUP of hello.txt, which the pod's empty shared directory does not have), then
    // resets; so RunPodSandbox fails, and the console shows how far it got.
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("the fs guest has no agent")?;
    let err = format!("{err:#}");
    println!("RunPodSandbox failed, as it must: {err}");
    let console = std::fs::read_to_string(log_dir.join(KEPT_CONSOLE))?;
    for line in ["fs tag bulkhead ", "driver ok\n", "init 7.", "hello.txt error 2\n"] {
        assert!(console.contains(line), "console lacks {line:?}:\n{console}");
    }
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_virtiofsd_killed_under_a_running_vm_ends_it() -> Result<()> {
    let test = "vm_virtiofsd_killed_under_a_running_vm_ends_it";
    let Some(env) = setup(test, "idle", Duration::from_secs(120)).await? else { return Ok(()) };
    let (pod, _log_dir) = env.pod("fsd-crash")?;
    let run = {
        let cri = env.cri.clone();
        tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await })
    };
    let pod_dir = env.wait_for_console("idle guest up").await?;
    let (virtiofsd, _) = env.virtiofsd(&pod_dir).context("the pod's virtiofsd runs")?;
    // A child of the shim this test's containerd started; signalled by PID only.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(virtiofsd as i32), nix::sys::signal::Signal::SIGKILL)?;
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(60), run).await.context("RunPodSandbox returns")??;
    let err = format!("{:#}", result.err().context("the VM must end with its virtiofsd")?);
    println!("RunPodSandbox failed after virtiofsd's kill, as it must: {err}");
    assert!(err.contains("virtiofsd") && err.contains("had exited with status 137"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "noticed after {:?}", started.elapsed());
    let log = std::fs::read_to_string(env.containerd.log_path())?;
    assert!(log.contains("virtiofsd exited while the VM runs"), "the shim logs the crash");
    env.assert_nothing_left().await
}

/// A VM that ends while its pod runs (here its VMM is killed; a guest kernel panic or triple fault
/// ends it the same way) leaves its console with the pod's logs once the pod goes, and the shim's
/// log says how it ended: the pod's own state, the console in it, does not outlive the pod.
#[tokio::test]
async fn a_vm_that_ends_while_its_pod_runs_leaves_its_console_with_the_pods_logs() -> Result<()> {
    let test = "a_vm_that_ends_while_its_pod_runs_leaves_its_console_with_the_pods_logs";
    let Some(env) = setup(test, "agent_stub", Duration::from_secs(20)).await? else { return Ok(()) };
    const SAID: &str = "the VM ended on its own while the pod ran";
    // A pod stopped as kubelet stops it is not one.
    let (pod, stopped_logs) = env.pod("stopped")?;
    let id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    env.cri.stop_pod_sandbox(&id).await?;
    env.cri.remove_pod_sandbox(&id).await?;
    assert!(!std::fs::read_to_string(env.containerd.log_path())?.contains(SAID));
    assert!(!stopped_logs.join(KEPT_CONSOLE).exists());

    let (pod, log_dir) = env.pod("ends-alone")?;
    let id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    let vm_dir = env.state().join(&id).join("vm").display().to_string();
    let vmms: Vec<u32> =
        processes_with(&vm_dir).into_iter().filter(|(_, c)| c.contains("bulkhead-vmm")).map(|(p, _)| p).collect();
    assert!(!vmms.is_empty(), "the pod's VMM runs");
    // Children of the shim this test's containerd started; signalled by PID only.
    for pid in vmms {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
    }
    let not_ready = cri::PodSandboxState::SandboxNotready as i32;
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.cri.pod_sandbox_status(&id).await?.state != not_ready {
        if Instant::now() >= deadline {
            bail!("the pod stayed ready after its VM ended\n{}", env.containerd.log_tail(60));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.cri.stop_pod_sandbox(&id).await?;
    env.cri.remove_pod_sandbox(&id).await?;
    let kept = log_dir.join(KEPT_CONSOLE);
    assert!(kept.is_file(), "no console kept at {}\n{}", kept.display(), env.containerd.log_tail(60));
    let log = std::fs::read_to_string(env.containerd.log_path())?;
    let said = log.lines().find(|l| l.contains(SAID)).unwrap_or_default();
    println!("{test}: {said}");
    assert!(said.contains(&kept.display().to_string()), "the shim's log names the kept console: {said:?}");
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_shim_kill9_then_delete_leaves_nothing() -> Result<()> {
    let test = "vm_shim_kill9_then_delete_leaves_nothing";
    let Some(env) = setup(test, "idle", Duration::from_secs(120)).await? else { return Ok(()) };
    let (pod, _log_dir) = env.pod("crash")?;
    let run = {
        let cri = env.cri.clone();
        tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await })
    };
    // The VM is up (jailed, its guest running) while the shim waits for the agent.
    let pod_dir = env.wait_for_console("idle guest up").await?;
    let vmms = processes_with(&env.state().display().to_string());
    assert!(!vmms.is_empty(), "the VMM runs");

    // Its virtiofsd runs sandboxed: its worker in mount, pid and net namespaces of its own,
    // under seccomp, seeing only the pod's shared directory; its listener in the chroot is the
    // jail user's alone.
    let (main, worker) = env.virtiofsd(&pod_dir).context("the pod's virtiofsd runs")?;
    // The VMM and virtiofsd are charged to the pod: they sit in the sandbox's cgroup.
    let sandbox_cgroup = format!("{}/{}", env.cgroup_parent.0, pod_dir.file_name().unwrap().to_string_lossy());
    for pid in vmms.iter().map(|(pid, _)| *pid).chain([main, worker]) {
        assert_eq!(cgroups::of_pid(pid).as_deref(), Some(sandbox_cgroup.as_str()), "cgroup of {pid}");
    }
    for ns in ["mnt", "pid", "net"] {
        let theirs = std::fs::read_link(format!("/proc/{worker}/ns/{ns}"))?;
        assert_ne!(theirs, std::fs::read_link(format!("/proc/self/ns/{ns}"))?, "{ns} namespace");
    }
    assert_eq!(status_field(worker, "Seccomp"), "2");
    let root = std::fs::metadata(format!("/proc/{worker}/root"))?;
    let shared = std::fs::metadata(pod_dir.join("shared"))?;
    use std::os::unix::fs::MetadataExt;
    assert_eq!((root.dev(), root.ino()), (shared.dev(), shared.ino()), "virtiofsd's root is the pod's shared dir");
    let socket = std::fs::symlink_metadata(pod_dir.join("vm/root/run/fs0.sock"))?;
    let jail_id = jailed_vmm_uid(&vmms).context("the jailed VMM")?;
    assert!((JAIL_IDS..JAIL_IDS + JAIL_ID_COUNT).contains(&jail_id), "the VMM runs as {jail_id}");
    assert_eq!((socket.uid(), socket.gid(), socket.mode() & 0o777), (jail_id, jail_id, 0o600));

    let address = env.containerd.address().display().to_string();
    let shims: Vec<u32> = processes_with(&address)
        .into_iter()
        .filter(|(_, cmd)| cmd.contains("containerd-shim-bulkhead-v2"))
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(shims.len(), 1, "one shim serves the pod: {shims:?}");
    // The shim is a descendant of the containerd this test started; signal it by PID only.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shims[0] as i32), nix::sys::signal::Signal::SIGKILL)?;

    let result = tokio::time::timeout(Duration::from_secs(60), run).await.context("RunPodSandbox returns")??;
    assert!(result.is_err(), "the pod cannot have started: {result:?}");
    // containerd runs the shim's `delete`, which tears the VM pod down through its backend.
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_pods_run_their_vmms_as_ids_of_their_own() -> Result<()> {
    let test = "vm_pods_run_their_vmms_as_ids_of_their_own";
    let Some(env) = setup(test, "idle", Duration::from_secs(30)).await? else { return Ok(()) };
    let mut runs = Vec::new();
    for name in ["ids-a", "ids-b"] {
        let (pod, _) = env.pod(name)?;
        let cri = env.cri.clone();
        runs.push(tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await }));
    }
    // Both VMs up (the idle guest never answers the agent handshake).
    let state = env.state().display().to_string();
    let mut vmms = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while vmms.len() < 2 {
        vmms = std::fs::read_dir(env.state())?
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .filter_map(|e| jailed_vmm(&processes_with(&e.path().join("vm").display().to_string())))
            .collect::<Vec<_>>();
        if Instant::now() > deadline {
            // Say why: what each pod's RunPodSandbox answered if it already has, and what runs.
            let mut answers = Vec::new();
            for run in runs.iter_mut().filter(|r| r.is_finished()) {
                answers.push(format!("{:?}", run.await));
            }
            bail!(
                "two jailed VMMs never ran under {state}: {vmms:?}; finished RunPodSandbox calls: {answers:?}; \
                 processes: {:?}; containerd's log:\n{}",
                processes_with(&state),
                env.containerd.log_tail(60)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ((pid_a, uid_a), (pid_b, uid_b)) = (vmms[0], vmms[1]);
    assert_ne!(uid_a, uid_b, "two pods' VMMs share an identity");
    for uid in [uid_a, uid_b] {
        assert!((JAIL_IDS..JAIL_IDS + JAIL_ID_COUNT).contains(&uid), "{uid} is outside the configured range");
    }
    // As A's identity, B's VMM cannot even be asked whether it exists (kill -0), nor traced.
    let as_a = |args: &[&str]| {
        std::process::Command::new("setpriv")
            .args(["--reuid", &uid_a.to_string(), "--regid", &uid_a.to_string(), "--clear-groups"])
            .args(args)
            .output()
    };
    let out = as_a(&["kill", "-0", &pid_b.to_string()])?;
    assert!(!out.status.success(), "A's identity may signal B's VMM");
    assert!(String::from_utf8_lossy(&out.stderr).contains("ermitted"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(as_a(&["kill", "-0", &pid_a.to_string()])?.status.success(), "the probe itself works");
    for run in runs {
        let result = tokio::time::timeout(Duration::from_secs(90), run).await.context("RunPodSandbox returns")??;
        assert!(result.is_err(), "the idle guest never answers");
    }
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_pod_without_a_free_identity_fails_with_a_clear_error() -> Result<()> {
    let test = "vm_pod_without_a_free_identity_fails_with_a_clear_error";
    let Some(env) = setup_ids(test, "idle", Duration::from_secs(30), 1, "").await? else { return Ok(()) };
    let (first, _) = env.pod("holds-the-id")?;
    let run = {
        let cri = env.cri.clone();
        tokio::spawn(async move { cri.run_pod_sandbox(&first, "bulkhead").await })
    };
    env.wait_for_console("idle guest up").await?;
    let (second, _) = env.pod("finds-none")?;
    let err = format!("{:#}", env.cri.run_pod_sandbox(&second, "bulkhead").await.err().context("no identity is left")?);
    assert!(err.contains("no free VMM identity") && err.contains("jail_id_count"), "{err}");
    let result = tokio::time::timeout(Duration::from_secs(90), run).await.context("RunPodSandbox returns")??;
    assert!(result.is_err(), "the idle guest never answers");
    env.assert_nothing_left().await
}

#[tokio::test]
async fn vm_pod_under_kubelets_systemd_slice() -> Result<()> {
    let test = "vm_pod_under_kubelets_systemd_slice";
    let Some(env) = setup(test, "idle", Duration::from_secs(20)).await? else { return Ok(()) };
    // kubelet with the systemd cgroup driver: the pod's parent is a slice it made, with the
    // pod's limits on it; containerd then names the sandbox `slice:cri-containerd:<id>`.
    let uid = format!("{}x{}", std::process::id(), Instant::now().elapsed().subsec_nanos());
    let kubelet = cgroups::KubeletPodCgroup::systemd_slice(&uid)?;
    let (slice, slice_path) = (kubelet.cri_parent.clone(), kubelet.path.clone());
    let made: Vec<PathBuf> = kubelet.dirs();
    let limit = 768u64 << 20;
    for file in ["memory.limit_in_bytes", "memory.max"] {
        kubelet.set(file, &limit.to_string())?;
    }
    let (mut pod, _) = env.pod("slice")?;
    pod.linux.as_mut().unwrap().cgroup_parent = slice.clone();
    let run = {
        let cri = env.cri.clone();
        tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await })
    };
    let pod_dir = env.wait_for_console("idle guest up").await?;
    let sandbox_id = pod_dir.file_name().unwrap().to_string_lossy().to_string();
    let scope = format!("{slice_path}/cri-containerd-{sandbox_id}.scope");
    let vmms = processes_with(&pod_dir.join("vm").display().to_string());
    let (fsd, fsd_worker) = env.virtiofsd(&pod_dir).context("the pod's virtiofsd runs")?;
    for pid in vmms.iter().map(|(pid, _)| *pid).chain([fsd, fsd_worker]) {
        assert_eq!(cgroups::of_pid(pid).as_deref(), Some(scope.as_str()), "cgroup of {pid}");
    }
    // The slice's limit is kubelet's; the pod's processes are charged to it.
    let memory = made.iter().find(|d| d.join("memory.usage_in_bytes").exists() || d.join("memory.current").exists());
    if let Some(dir) = memory {
        let usage = ["memory.usage_in_bytes", "memory.current"]
            .iter()
            .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .unwrap_or_default();
        let usage: u64 = usage.trim().parse().unwrap_or(0);
        assert!(usage > 0 && usage < limit, "the slice accounts the pod: {usage} bytes of {limit}");
    }
    let result = tokio::time::timeout(Duration::from_secs(90), run).await.context("RunPodSandbox returns")??;
    assert!(result.is_err(), "the idle guest never answers");
    env.assert_nothing_left().await?;
    eventually_nothing("the pod's scope", Duration::from_secs(20), || cgroups::existing(&scope)).await?;
    // kubelet's slice stays kubelet's: the shim never removes it. The test made it, so removes it
    // (and the levels above, unless something else lives there).
    assert!(made.iter().all(|d| d.exists()), "the shim removed kubelet's slice");
    Ok(())
}

/// SHA-256 of a file, for "the template is unchanged".
fn sha256_file(path: &Path) -> Result<String> {
    let out = std::process::Command::new("sha256sum").arg(path).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace().next().map(str::to_string).context("sha256sum")
}

/// A `vm.start = "warm"` env whose templates live in `templates`, booting the vsock guest: it
/// says what the agent says once it listens (what a template is snapshotted at), then waits for
/// an event on its vsock event queue: a restore's transport reset.
async fn setup_warm(test: &str, templates: &Path) -> Result<Option<VmEnv>> {
    setup_ids(test, "vsock_reset", Duration::from_secs(10), JAIL_ID_COUNT, &warm_config(templates)).await
}

/// The `[vm]` lines that make pods start warm from templates under `templates`.
fn warm_config(templates: &Path) -> String {
    format!("start = \"warm\"\ntemplate_dir = \"{}\"\n", templates.join("templates").display())
}

/// `bulkhead-ctl template ls --json`: whether it succeeded, and what it printed.
fn template_ls(env: &VmEnv) -> Result<(bool, serde_json::Value)> {
    let out = std::process::Command::new(workspace_bin("bulkhead-ctl"))
        .arg("--config")
        .arg(&env.config)
        .args(["template", "ls", "--json"])
        .output()?;
    Ok((out.status.success(), serde_json::from_slice(&out.stdout)?))
}

/// The template of the pod's shape, built ahead of time as an operator (or the installer) would
/// (`bulkhead-ctl template build`); its directory.
fn build_template(env: &VmEnv) -> Result<PathBuf> {
    let out = std::process::Command::new(workspace_bin("bulkhead-ctl"))
        .arg("--config")
        .arg(&env.config)
        .args(["template", "build", "--json"])
        .output()?;
    assert!(out.status.success(), "template build: {}", String::from_utf8_lossy(&out.stderr));
    let built: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(PathBuf::from(built["dir"].as_str().context("the template's dir")?))
}

#[tokio::test]
async fn a_restored_guest_that_never_answers_sets_the_template_aside_and_the_pod_boots_cold() -> Result<()> {
    let test = "a_restored_guest_that_never_answers_sets_the_template_aside_and_the_pod_boots_cold";
    let templates = tempfile::tempdir()?;
    let Some(env) = setup_warm(test, templates.path()).await? else { return Ok(()) };
    let template = build_template(&env)?;
    let files = |dir: &Path| -> Result<Vec<String>> {
        ["state", "memory", "template.json"].iter().map(|f| sha256_file(&dir.join(f))).collect()
    };
    let before = files(&template)?;

    let (pod, log_dir) = env.pod("warm")?;
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("the test guest has no agent")?;
    let err = format!("{err:#}");
    println!("{test}: RunPodSandbox: {err}");
    // The pod's VMM restored the template into the pod's own devices: the guest's first words on
    // the pod's console were what the pod's vsock device sent it, the transport reset (event id
    // 0, 4 bytes) only a restore sends. No agent answered, so the template went aside with that
    // console as its reason...
    let quarantine = templates.path().join("templates/.quarantine");
    let aside: Vec<PathBuf> = std::fs::read_dir(&quarantine)?.flatten().map(|e| e.path()).collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let reason = std::fs::read_to_string(aside[0].join("reason.txt"))?;
    println!("{test}: set aside: {reason}");
    assert!(reason.contains("the restored guest's agent") && reason.contains("event 0 len 4"), "{reason}");
    assert!(!reason.contains("listening (vsock)"), "the first attempt booted: {reason}");
    assert_eq!(files(&aside[0])?, before, "a restore changed the template's files");
    assert!(!template.exists(), "the template is still offered");
    // ...and the pod booted cold, the proven path (this guest has no agent either way).
    assert!(err.contains("listening (vsock)"), "{err}");
    assert_names_console(&err, &log_dir, "listening (vsock)");
    env.assert_nothing_left().await
}

/// The agent-stub pod `id` is ready, and was restored, not booted: the pod's console starts at
/// the restore's transport reset; a boot would have printed the stub's listening line first.
async fn assert_ready_and_restored(env: &VmEnv, id: &str, test: &str) -> Result<()> {
    let status = env.cri.pod_sandbox_status(id).await?;
    assert_eq!(status.state, cri::PodSandboxState::SandboxReady as i32, "{status:?}");
    let pod_dir = env.wait_for_console("transport reset").await?;
    let console = std::fs::read_to_string(pod_dir.join("vm/root/run/console.log"))?;
    println!("{test}: the pod's console: {console:?}");
    assert!(!console.contains("listening (vsock)"), "the pod's VM booted: {console}");
    Ok(())
}

#[tokio::test]
async fn a_restored_pod_whose_guest_answers_gets_ready_and_stops_leaving_nothing() -> Result<()> {
    let test = "a_restored_pod_whose_guest_answers_gets_ready_and_stops_leaving_nothing";
    let templates = tempfile::tempdir()?;
    let warm = warm_config(templates.path());
    // The agent stub answers the shim's calls (Version, SetupSandbox) as an agent would.
    let Some(env) = setup_ids(test, "agent_stub", Duration::from_secs(10), JAIL_ID_COUNT, &warm).await? else {
        return Ok(());
    };
    let template = build_template(&env)?;
    let files = |dir: &Path| -> Result<Vec<String>> {
        ["state", "memory", "template.json"].iter().map(|f| sha256_file(&dir.join(f))).collect()
    };
    let before = files(&template)?;

    let (pod, _) = env.pod("warm-ready")?;
    let id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.context("RunPodSandbox of a warm pod")?;
    assert_ready_and_restored(&env, &id, test).await?;
    let log = env.containerd.log_tail(400);
    let connected = log.lines().find(|l| l.contains("agent connected")).unwrap_or_default();
    println!("{test}: {connected}");
    assert!(connected.contains("stub"), "{log}");
    // The start's phases, as an operator reads them.
    let started = log.lines().find(|l| l.contains("VM started")).unwrap_or_default();
    println!("{test}: {started}");
    assert!(started.contains("start=\"warm\"") || started.contains("start=warm"), "{started}");
    for phase in ["template=", "launch=", "restore=", "agent="] {
        assert!(started.contains(phase), "no {phase} in {started}");
    }

    env.cri.stop_pod_sandbox(&id).await?;
    env.cri.remove_pod_sandbox(&id).await?;
    assert_eq!(files(&template)?, before, "a restore changed the template's files");
    env.assert_nothing_left().await
}

#[tokio::test]
async fn a_pod_with_a_network_restores_a_template_with_nics_onto_its_own_taps() -> Result<()> {
    let test = "a_pod_with_a_network_restores_a_template_with_nics_onto_its_own_taps";
    let templates = tempfile::tempdir()?;
    let warm = warm_config(templates.path());
    let Some(env) = setup_with(test, "agent_stub", Duration::from_secs(10), JAIL_ID_COUNT, &warm, true).await? else {
        return Ok(());
    };
    // No template yet: the pod builds the one its network needs (a NIC per CNI interface, in
    // a placeholder namespace of the shim's), then restores it onto its own taps.
    let (pod, _) = env.networked_pod("warm-net")?;
    let id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(60))?;
    // A restore needs a tap in the pod's namespace for the snapshot's NIC (the VMM refuses it
    // otherwise, and the pod would have booted cold).
    assert_ready_and_restored(&env, &id, test).await?;
    let (_, listed) = template_ls(&env)?;
    let rows = listed["templates"].as_array().context("templates")?;
    assert_eq!(rows.len(), 1, "{listed}");
    assert_eq!(rows[0]["state"], "ready", "{listed}");
    let mtus = rows[0]["nic_mtus"].as_array().context("nic_mtus")?;
    assert_eq!(mtus.len(), 1, "one NIC, as the pod has one CNI interface: {listed}");
    env.cri.stop_pod_sandbox(&id).await?;
    env.cri.remove_pod_sandbox(&id).await?;
    // The build's placeholder namespace, taps and VM are gone, as is the pod.
    env.assert_nothing_left().await
}

#[tokio::test]
async fn a_template_the_vmm_refuses_is_moved_aside_and_the_pod_boots_cold() -> Result<()> {
    let test = "a_template_the_vmm_refuses_is_moved_aside_and_the_pod_boots_cold";
    let templates = tempfile::tempdir()?;
    let Some(env) = setup_warm(test, templates.path()).await? else { return Ok(()) };
    let template = build_template(&env)?;
    // A state file the store's checks pass (its manifest says so) but the VMM refuses: what a
    // template from an incompatible VMM build looks like to the shim.
    let state = template.join("state");
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::write(&state, b"not a snapshot state")?;
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    let manifest_path = template.join("template.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest_path)?)?;
    for file in manifest["files"].as_array_mut().context("manifest files")? {
        if file["name"] == "state" {
            file["size"] = serde_json::json!(20);
            file["sha256"] = serde_json::json!(sha256_file(&state)?);
        }
    }
    std::fs::set_permissions(&manifest_path, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest)?)?;
    std::fs::set_permissions(&manifest_path, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    let (ok, listed) = template_ls(&env)?;
    assert!(ok && listed["templates"][0]["state"] == "ready", "the store takes it: {listed}");

    let (pod, _) = env.pod("refused")?;
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("the test guest has no agent")?;
    let err = format!("{err:#}");
    println!("{test}: RunPodSandbox: {err}");
    // Booted cold after the refused restore: the console is a boot's (the guest's first line),
    // with no restore's transport reset.
    assert!(err.contains("vsock ready") && !err.contains("event 0"), "{err}");
    // Moved aside with its reason, for the next pod to rebuild.
    assert!(!template.exists(), "the refused template is still in place");
    let quarantine = templates.path().join("templates/.quarantine");
    let reasons: Vec<String> = std::fs::read_dir(&quarantine)?
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("reason.txt")).ok())
        .collect();
    assert!(reasons.iter().any(|r| r.contains("restore failed")), "{reasons:?}");
    env.assert_nothing_left().await
}
