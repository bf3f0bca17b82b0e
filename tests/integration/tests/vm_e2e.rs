//! Full VM end to end: the `vm` backend with the real guest kernel and agent. It runs
//! only where /dev/kvm is backed by VMX/SVM; elsewhere it prints one `SKIPPED:` line
//! naming the reason (on our PVM hosts no Linux guest reaches userspace).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use anyhow::{bail, Context, Result};
use bulkhead_integration::{
    container_config, pod_config, skip, skip_if_unready, Containerd, ContainerdConfig, RuntimeHandler,
};
use bulkhead_vmm_api::probe::KvmKind;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds (or reuses the cached) guest kernel and the initramfs, returning both paths.
fn guest_artifacts() -> Result<(PathBuf, PathBuf)> {
    let root = repo_root();
    let out =
        Command::new(root.join("guest-kernel/build-kernel.sh")).output().context("guest-kernel/build-kernel.sh")?;
    if !out.status.success() {
        bail!("building the guest kernel failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let kernel = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let status = Command::new("make").arg("-C").arg(root.join("guest-kernel")).arg("initramfs").status()?;
    if !status.success() {
        bail!("make -C guest-kernel initramfs failed");
    }
    let initramfs = root.join("guest-kernel/build/initramfs.cpio.gz");
    if !initramfs.exists() {
        bail!("{} was not produced", initramfs.display());
    }
    Ok((kernel, initramfs))
}

#[tokio::test]
async fn vm_backend_pod_runs_and_execs() -> Result<()> {
    if skip_if_unready("vm_backend_pod_runs_and_execs") {
        return Ok(());
    }
    if let Err(why) = KvmKind::probe().ordinary_guests() {
        skip::host_cannot("vm_backend_pod_runs_and_execs", &why);
        return Ok(());
    }
    let (kernel, initramfs) = guest_artifacts()?;
    let cfg_dir = tempfile::tempdir()?;
    let cfg = cfg_dir.path().join("bulkhead.toml");
    std::fs::write(
        &cfg,
        format!(
            "backend = \"vm\"\n\n[vm]\nvmm_path = \"{}\"\nkernel_path = \"{}\"\ninitramfs_path = \"{}\"\n",
            bulkhead_integration::workspace_bin("bulkhead-vmm").display(),
            kernel.display(),
            initramfs.display()
        ),
    )?;
    let containerd = Containerd::start(ContainerdConfig {
        handlers: vec![RuntimeHandler::bulkhead(Some(&cfg))],
        ..Default::default()
    })
    .await?;
    let cri = containerd.cri().await?;
    let pod = pod_config("vm-e2e", &containerd.new_log_dir("vm-e2e")?);
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead").await?;
    let ctr = cri.create_container(&pod_id, &container_config("c", &["sleep", "3600"]), &pod).await?;
    cri.start_container(&ctr).await?;
    let out = cri.exec_sync(&ctr, &["uname", "-r"], 30).await?;
    assert_eq!(out.exit_code, 0);
    let guest_release = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string();
    assert_ne!(guest_release, host_release, "the container must run on the guest kernel, not the host's");
    cri.stop_container(&ctr, 5).await?;
    cri.remove_container(&ctr).await?;
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    Ok(())
}
