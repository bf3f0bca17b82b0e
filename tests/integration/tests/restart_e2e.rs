//! Pods outlive a containerd restart, as with runc: containerd is stopped (SIGTERM by PID, as
//! systemd's `KillMode=process` stops it) for 10 s with pods running, then started again on the
//! same state. Every pod still answers exec and reports its state, a container that exited
//! during the gap reports its exit code, a container's log resumes (a gap only if the shim says
//! it dropped bytes), and every pod then stops and goes, leaving nothing. On the namespace
//! backend and on the vm backend (the QEMU stand-in; `bulkhead-vmm` where the probe allows).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::guests::GuestVmm;
use bulkhead_integration::host::{dropped_output, eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{
    container_config, pod_config, skip, Containerd, ContainerdConfig, ContainerdVersion, Cri, RuntimeHandler, Setup,
};
use k8s_cri::v1 as cri;

const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;
const EXITED: i32 = cri::ContainerState::ContainerExited as i32;
/// How long containerd stays away.
const GAP: Duration = Duration::from_secs(10);

/// Prints 0, 1, 2... every 100 ms.
fn counter(name: &str) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", "i=0; while true; do echo \"n=$i\"; i=$((i+1)); sleep 0.1; done"])
}

/// Exits with 7 after `secs` seconds.
fn exits_later(name: &str, secs: u32) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", &format!("sleep {secs}; exit 7")])
}

/// The counter values a CRI log file holds, in order.
fn counts(log: &str) -> Vec<u64> {
    log.lines().filter_map(|l| l.rsplit_once("n=").and_then(|(_, n)| n.trim().parse().ok())).collect()
}

struct Pod {
    name: String,
    id: String,
    counter: String,
    exiter: String,
}

async fn start_pod(cri: &Cri, containerd: &Containerd, handler: &str, name: &str) -> Result<Pod> {
    let config = pod_config(name, &containerd.new_log_dir(name)?);
    let id = cri.run_pod_sandbox(&config, handler).await.with_context(|| containerd.log_tail(40))?;
    let counter_id = cri.create_container(&id, &counter(&format!("{name}-counter")), &config).await?;
    cri.start_container(&counter_id).await?;
    // Exits 4 s after it starts: inside the gap.
    let exiter = cri.create_container(&id, &exits_later(&format!("{name}-exiter"), 4), &config).await?;
    cri.start_container(&exiter).await?;
    Ok(Pod { name: name.into(), id, counter: counter_id, exiter })
}

#[tokio::test]
async fn pods_outlive_a_containerd_restart() -> Result<()> {
    let test = "pods_outlive_a_containerd_restart";
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let Some(setup) = Setup::new(test, version, &["bulkhead-agent", "containerd-shim-bulkhead-v2"])? else {
        return Ok(());
    };
    let ns_config = setup.namespace_config("namespace.toml", &setup.state().join("ns"))?;
    let mut handlers = vec![RuntimeHandler::bulkhead(Some(&ns_config))];
    let vmms: Vec<GuestVmm> = [GuestVmm::QemuStandIn, GuestVmm::Bulkhead]
        .into_iter()
        .filter(|vmm| match vmm.unavailable() {
            None => true,
            Some(why) => {
                println!("{test}: not on {}: {why:?}", vmm.name());
                false
            }
        })
        .collect();
    if vmms.is_empty() {
        skip::missing_prerequisite(test, "no VMM can boot the real guest here (run `make setup`)");
        return Ok(());
    }
    for (i, vmm) in vmms.iter().enumerate() {
        let text = bulkhead_integration::guests::real_vm_config(&setup.state().join(format!("vm{i}")), 45_000, *vmm)?;
        let path = setup.write_config(&format!("vm{i}.toml"), &text)?;
        handlers.push(RuntimeHandler { name: format!("bulkhead-vm{i}"), ..RuntimeHandler::bulkhead(Some(&path)) });
    }
    let mut env = setup.start(ContainerdConfig { handlers, ..Default::default() }).await?;
    let cri = env.cri.clone();
    let containerd = &mut env.containerd;

    let mut pods = vec![start_pod(&cri, containerd, "bulkhead", "ns-pod").await?];
    for (i, vmm) in vmms.iter().enumerate() {
        println!("{test}: a vm pod on {}", vmm.name());
        pods.push(start_pod(&cri, containerd, &format!("bulkhead-vm{i}"), &format!("vm{i}-pod")).await?);
    }
    // The counters run; what they have written so far.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<u64> = {
        let mut v = Vec::new();
        for pod in &pods {
            let log = std::fs::read_to_string(cri.container_status(&pod.counter).await?.log_path)?;
            v.push(counts(&log).last().copied().context("the counter has written")?);
        }
        v
    };

    containerd.stop();
    let stopped_at = Instant::now();
    let shims = processes_with(&containerd.address().display().to_string())
        .into_iter()
        .filter(|(_, c)| c.contains("containerd-shim-bulkhead-v2"))
        .count();
    assert_eq!(shims, pods.len(), "every pod's shim outlives containerd");
    tokio::time::sleep(GAP.saturating_sub(stopped_at.elapsed())).await;
    containerd.start_again().await?;
    let cri = containerd.cri().await?;

    for (pod, last_before) in pods.iter().zip(before) {
        let name = &pod.name;
        let out = cri
            .exec_sync(&pod.counter, &["echo", "after-restart"], 30)
            .await
            .with_context(|| format!("{name}: exec after the restart\n{}", containerd.log_tail(60)))?;
        assert_eq!((out.exit_code, out.stdout.as_slice()), (0, &b"after-restart\n"[..]), "{name}");
        assert_eq!(cri.container_status(&pod.counter).await?.state, RUNNING, "{name}: the counter runs on");
        let exiter = cri.wait_container(&pod.exiter, Duration::from_secs(30), |s| s.state == EXITED).await?;
        assert_eq!(exiter.exit_code, 7, "{name}: the container that exited in the gap: {exiter:?}");
        assert!(pod.id.len() == 64, "{name}");

        // The counter's log resumes: later values arrive, and none is missing unless dropped.
        let status = cri.container_status(&pod.counter).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let seen = loop {
            let seen = counts(&std::fs::read_to_string(&status.log_path)?);
            let last = seen.last().copied().unwrap_or(0);
            // Past what the counter had written when containerd came back.
            if last > last_before + (GAP.as_millis() as u64 / 100) + 10 {
                break seen;
            }
            if Instant::now() > deadline {
                bail!("{name}: the counter's log did not resume: last {last}, before the gap {last_before}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let holes: Vec<(u64, u64)> = seen.windows(2).filter(|w| w[1] != w[0] + 1).map(|w| (w[0], w[1])).collect();
        let dropped = dropped_output(env.state_dir.path(), &pod.id)?;
        println!(
            "{test}: {name}: counter at {last_before} before the gap, log continues to {}; holes {holes:?}",
            seen.last().unwrap_or(&0)
        );
        assert!(holes.is_empty() || dropped > 0, "{name}: the log has holes {holes:?} and nothing was dropped");
    }

    for pod in &pods {
        cri.stop_pod_sandbox(&pod.id).await?;
        cri.remove_pod_sandbox(&pod.id).await?;
    }
    let state = env.state_dir.path().display().to_string();
    let within = Duration::from_secs(30);
    eventually_nothing("the pods' processes", within, || {
        processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    eventually_nothing("mounts", within, || mounts_with(&state)).await?;
    let address = containerd.address().display().to_string();
    eventually_nothing("shims", within, || {
        processes_with(&address)
            .into_iter()
            .filter(|(_, c)| c.contains("containerd-shim-bulkhead-v2"))
            .map(|(p, c)| format!("{p} {c}"))
            .collect()
    })
    .await
}
