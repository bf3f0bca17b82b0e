//! Full VM end to end: the `vm` backend with the real guest kernel and agent, through a private
//! containerd and CRI. It runs only where the host probe says ordinary guests run (VMX/SVM); there
//! any error fails it. Elsewhere (our PVM hosts, where no Linux guest reaches userspace) it
//! prints the probe's one `SKIPPED:` line.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::time::Duration;

use anyhow::{Context, Result};
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{
    container_config, pod_config, skip, skip_if_unready, Containerd, ContainerdConfig, RuntimeHandler,
};
use bulkhead_vmm_api::probe::KvmKind;
use k8s_cri::v1 as cri;

const EXITED: i32 = cri::ContainerState::ContainerExited as i32;
const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;

/// A container that runs until SIGTERM (then exits 0), after `first`.
fn long_running(name: &str, first: &str) -> cri::ContainerConfig {
    let script = format!("{first}; trap 'exit 0' TERM; while true; do sleep 0.2; done");
    container_config(name, &["sh", "-c", &script])
}

#[tokio::test]
async fn vm_backend_pod_runs_and_execs() -> Result<()> {
    let test = "vm_backend_pod_runs_and_execs";
    if skip_if_unready(test) {
        return Ok(());
    }
    if let Err(why) = KvmKind::probe().ordinary_guests() {
        skip::host_cannot(test, &why);
        return Ok(());
    }
    let state_dir = tempfile::Builder::new().prefix("bv").tempdir_in("/run")?;
    let cfg_dir = tempfile::tempdir()?;
    let cfg = cfg_dir.path().join("bulkhead.toml");
    std::fs::write(&cfg, bulkhead_integration::guests::real_vm_config(state_dir.path(), 60_000)?)?;
    let containerd = Containerd::start(ContainerdConfig {
        handlers: vec![RuntimeHandler::bulkhead(Some(&cfg))],
        ..Default::default()
    })
    .await?;
    let cri = containerd.cri().await?;
    let pod = pod_config("vm-e2e", &containerd.new_log_dir("vm-e2e")?);
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| containerd.log_tail(40))?;

    // Two containers share an emptyDir (kubelet passes it as a host directory): the writer
    // read-write, the reader read-only and with a read-only rootfs.
    let empty_dir = tempfile::tempdir()?;
    let volume = |read_only| cri::Mount {
        container_path: "/data".into(),
        host_path: empty_dir.path().display().to_string(),
        readonly: read_only,
        ..Default::default()
    };
    let mut writer = long_running("writer", "echo out-line; echo err-line >&2; echo from-writer > /data/f");
    writer.mounts = vec![volume(false)];
    let mut reader = long_running("reader", "true");
    reader.mounts = vec![volume(true)];
    if let Some(linux) = reader.linux.as_mut() {
        linux.security_context =
            Some(cri::LinuxContainerSecurityContext { readonly_rootfs: true, ..Default::default() });
    }
    let w = cri.create_container(&pod_id, &writer, &pod).await?;
    cri.start_container(&w).await?;
    let r = cri.create_container(&pod_id, &reader, &pod).await?;
    cri.start_container(&r).await?;
    cri.wait_container(&r, Duration::from_secs(30), |s| s.state == RUNNING).await?;

    // The container runs on the guest kernel, not the host's.
    let out = cri.exec_sync(&w, &["uname", "-r"], 30).await?;
    assert_eq!(out.exit_code, 0);
    let guest_release = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string();
    assert_ne!(guest_release, host_release, "the container must run on the guest kernel, not the host's");

    // What one container writes to the shared volume, the other reads, and the host sees.
    let mut seen = String::new();
    for _ in 0..100 {
        let out = cri.exec_sync(&r, &["cat", "/data/f"], 10).await?;
        seen = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.exit_code == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen, "from-writer\n");
    assert_eq!(std::fs::read_to_string(empty_dir.path().join("f"))?, "from-writer\n");

    // Read-only stays read-only inside the guest: the reader's rootfs and its view of the volume.
    for path in ["/rootfs-write", "/data/reader-write"] {
        let out = cri.exec_sync(&r, &["touch", path], 10).await?;
        assert_ne!(out.exit_code, 0, "{path} must not be writable: {out:?}");
    }
    assert!(!empty_dir.path().join("reader-write").exists());

    // Exit codes and logs reach CRI.
    let three = cri.create_container(&pod_id, &container_config("three", &["sh", "-c", "exit 3"]), &pod).await?;
    cri.start_container(&three).await?;
    let status = cri.wait_container(&three, Duration::from_secs(30), |s| s.state == EXITED).await?;
    assert_eq!(status.exit_code, 3);
    let status = cri.container_status(&w).await?;
    let log = std::fs::read_to_string(&status.log_path).with_context(|| format!("read {}", status.log_path))?;
    assert!(log.lines().any(|l| l.contains(" stdout ") && l.ends_with("out-line")), "log: {log}");
    assert!(log.lines().any(|l| l.contains(" stderr ") && l.ends_with("err-line")), "log: {log}");

    // Removal: containers, then the pod; nothing of it is left on the host.
    for c in [&w, &r] {
        cri.stop_container(c, 10).await?;
        assert_eq!(cri.container_status(c).await?.exit_code, 0, "the TERM trap exits 0");
    }
    for c in [&w, &r, &three] {
        cri.remove_container(c).await?;
    }
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    let state = state_dir.path().display().to_string();
    let within = Duration::from_secs(20);
    eventually_nothing("VMM and virtiofsd processes", within, || {
        processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    eventually_nothing("mounts", within, || mounts_with(&state)).await?;
    eventually_nothing("pod state", within, || {
        std::fs::read_dir(state_dir.path())
            .map(|d| d.flatten().map(|e| e.path().display().to_string()).collect())
            .unwrap_or_default()
    })
    .await
}
