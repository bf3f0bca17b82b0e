//! The shim's `vm` backend through a real containerd and a real jailed `bulkhead-vmm`, up to the
//! agent handshake (what this PVM host runs): a test guest stands in for the kernel. One that
//! never answers fails RunPodSandbox at the connect timeout, one that resets at once fails it as
//! soon as the VMM exits; both errors name the console log and quote it; afterwards, and after
//! `kill -9` of the shim followed by containerd's `delete`, nothing of the pod is left.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{
    cgroups, pod_config, skip, skip_if_unready, workspace_bin, Containerd, ContainerdConfig, Cri,
};
use bulkhead_integration::{guests, RuntimeHandler};
use k8s_cri::v1 as cri;

/// What the console copy kept with the pod's logs is called (shim/src/sandbox/vm/console.rs).
const KEPT_CONSOLE: &str = "bulkhead-vm-console.log";

/// A private containerd whose `bulkhead` handler runs the `vm` backend with `guest` as kernel.
struct VmEnv {
    containerd: Containerd,
    cri: Cri,
    state_dir: tempfile::TempDir,
    connect_timeout: Duration,
    _config_dir: tempfile::TempDir,
    /// The pods' cgroup parent (kubelet's role here); removed after containerd is gone.
    cgroup_parent: CgroupParent,
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
    if skip_if_unready(test) {
        return Ok(None);
    }
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
    let vmm = workspace_bin("bulkhead-vmm");
    for bin in [&vmm, &workspace_bin("containerd-shim-bulkhead-v2")] {
        if !bin.is_file() {
            skip::missing_prerequisite(
                test,
                &format!("{} is not built (run `cargo build --workspace`)", bin.display()),
            );
            return Ok(None);
        }
    }
    let state_dir = tempfile::Builder::new().prefix("bv").tempdir_in("/run")?;
    let config_dir = tempfile::tempdir()?;
    // The test guest ignores it, but the VM has one, as a pod's would.
    let initramfs = config_dir.path().join("initramfs.cpio.gz");
    std::fs::write(&initramfs, b"not read by the test guest")?;
    let config = config_dir.path().join("bulkhead.toml");
    std::fs::write(
        &config,
        format!(
            "backend = \"vm\"\nstate_dir = \"{}\"\n\n[agent]\nconnect_timeout_ms = {}\n\n\
             [vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\nmemory_mib = 64\n",
            state_dir.path().display(),
            connect_timeout.as_millis(),
            vmm.display(),
            guest.display(),
            initramfs.display()
        ),
    )?;
    let containerd = Containerd::start(ContainerdConfig {
        handlers: vec![RuntimeHandler::bulkhead(Some(&config))],
        ..Default::default()
    })
    .await?;
    let cri = containerd.cri().await?;
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let cgroup_parent = CgroupParent(format!("/bhtest-vm-{}-{seq}", std::process::id()));
    Ok(Some(VmEnv { containerd, cri, state_dir, connect_timeout, _config_dir: config_dir, cgroup_parent }))
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
        eventually_nothing("pod state", within, || {
            std::fs::read_dir(self.state())
                .map(|d| d.flatten().map(|e| e.path().display().to_string()).collect())
                .unwrap_or_default()
        })
        .await?;
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
async fn vm_shim_kill9_then_delete_leaves_nothing() -> Result<()> {
    let test = "vm_shim_kill9_then_delete_leaves_nothing";
    let Some(env) = setup(test, "idle", Duration::from_secs(120)).await? else { return Ok(()) };
    let (pod, _log_dir) = env.pod("crash")?;
    let run = {
        let cri = env.cri.clone();
        tokio::spawn(async move { cri.run_pod_sandbox(&pod, "bulkhead").await })
    };
    // The VM is up (jailed, its guest running) while the shim waits for the agent.
    let state = env.state().to_owned();
    let console = || -> Option<String> {
        let pod_dir = std::fs::read_dir(&state).ok()?.flatten().next()?.path();
        std::fs::read_to_string(pod_dir.join("vm/root/run/console.log")).ok()
    };
    eventually_nothing("a guest that is not up yet", Duration::from_secs(60), || match console() {
        Some(text) if text.contains("idle guest up") => vec![],
        other => vec![format!("console: {other:?}")],
    })
    .await?;
    let vmms = processes_with(&env.state().display().to_string());
    assert!(!vmms.is_empty(), "the VMM runs");
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
