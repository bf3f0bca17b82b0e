//! Proves the harness end to end with the `runc` handler: a busybox container through
//! CRI on a private containerd, and ExecSync inside it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use bulkhead_integration::{container_config, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup};

#[tokio::test]
async fn runc_pod_exec_sync_echo() -> anyhow::Result<()> {
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let Some(setup) = Setup::new("runc_pod_exec_sync_echo", version, &[])? else { return Ok(()) };
    let env = setup.start(ContainerdConfig { handlers: vec![RuntimeHandler::runc()], ..Default::default() }).await?;
    let cri = &env.cri;

    let pod = env.pod("runc-echo")?;
    let pod_id = cri.run_pod_sandbox(&pod, "runc").await?;
    let ctr = cri.create_container(&pod_id, &container_config("sleeper", &["sleep", "3600"]), &pod).await?;
    cri.start_container(&ctr).await?;

    let out = cri.exec_sync(&ctr, &["echo", "hi"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert_eq!(out.exit_code, 0);
    assert!(out.stderr.is_empty(), "stderr: {}", String::from_utf8_lossy(&out.stderr));

    let listed = cri.list_containers(Some(&pod_id)).await?;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, ctr);

    cri.stop_container(&ctr, 2).await?;
    let status = cri.container_status(&ctr).await?;
    assert_eq!(status.state, k8s_cri::v1::ContainerState::ContainerExited as i32);
    cri.remove_container(&ctr).await?;
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    assert!(cri.list_pod_sandboxes().await?.is_empty());
    Ok(())
}
