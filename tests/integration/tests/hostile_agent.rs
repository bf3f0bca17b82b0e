//! A hostile agent against the real shim and containerd (issue 12): `bulkhead-hostile-agent`
//! runs the real agent behind it and misbehaves on one reply (see that binary). For each way it
//! misbehaves, the pod's operation ends in an error within its bound; a reply that breaks the
//! connection ends the pod (its container reports 137) without a shim panic; the pod can still
//! be stopped and removed; and a bystander pod of the same containerd keeps working throughout.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::host::processes_with;
use bulkhead_integration::{
    container_config, workspace_bin, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup, ShimEnv,
};
use k8s_cri::v1 as cri;

/// The shim's frame-stall guard (5 s) or its RPC deadline (10 s), plus containerd's own work.
const ERROR_BOUND: Duration = Duration::from_secs(25);
const EXITED: i32 = cri::ContainerState::ContainerExited as i32;
const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;
const FAULTS: [&str; 7] = ["stall", "huge-length", "wrong-type", "big-error", "close", "oom-flood", "stdout-flood"];

/// One private containerd: `bulkhead` with the real agent, and `bh-<fault>` per fault.
struct Env(ShimEnv);

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.0
    }
}

async fn setup(test: &str) -> Result<Option<Env>> {
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let bins = ["bulkhead-agent", "bulkhead-hostile-agent", "containerd-shim-bulkhead-v2"];
    let Some(setup) = Setup::new(test, version, &bins)? else { return Ok(None) };
    let (agent, hostile) = (workspace_bin("bulkhead-agent"), workspace_bin("bulkhead-hostile-agent"));
    let config = |name: &str, agent_path: &Path| {
        let text = bulkhead_integration::guests::namespace_config(setup.state(), agent_path);
        setup.write_config(&format!("{name}.toml"), &text)
    };
    let mut handlers = vec![RuntimeHandler::bulkhead(Some(&config("bulkhead", &agent)?))];
    for fault in FAULTS {
        let on = if fault == "oom-flood" { "GetOomEvent" } else { "ExecProcess" };
        let wrapper = setup.write_config(
            &format!("agent-{fault}"),
            &format!(
                "#!/bin/sh\nexec {} --fault {fault} --on {on} --real {} -- \"$@\"\n",
                hostile.display(),
                agent.display()
            ),
        )?;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
        let name = format!("bh-{fault}");
        handlers
            .push(RuntimeHandler { name: name.clone(), ..RuntimeHandler::bulkhead(Some(&config(&name, &wrapper)?)) });
    }
    Ok(Some(Env(setup.start(ContainerdConfig { handlers, ..Default::default() }).await?)))
}

fn sleeper(name: &str) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"])
}

impl Env {
    /// A pod with one running sleeper under `handler`: (pod id, container id).
    async fn pod(&self, name: &str, handler: &str) -> Result<(String, String, cri::PodSandboxConfig)> {
        let pod = self.0.pod(name)?;
        let pod_id = self.cri.run_pod_sandbox(&pod, handler).await.with_context(|| self.fail_context())?;
        let ctr = self.cri.create_container(&pod_id, &sleeper(name), &pod).await?;
        self.cri.start_container(&ctr).await.with_context(|| self.fail_context())?;
        Ok((pod_id, ctr, pod))
    }

    /// The bystander answers an exec, promptly.
    async fn bystander_ok(&self, ctr: &str, during: &str) -> Result<()> {
        let started = Instant::now();
        let out = self.cri.exec_sync(ctr, &["echo", "still-here"], 10).await.context(format!("bystander {during}"))?;
        assert_eq!((out.exit_code, out.stdout.as_slice()), (0, &b"still-here\n"[..]), "bystander {during}");
        assert!(started.elapsed() < Duration::from_secs(5), "bystander exec {during} took {:?}", started.elapsed());
        Ok(())
    }

    fn fail_context(&self) -> String {
        self.log_context(80)
    }

    /// Whether any shim logged a panic (the shim's panic hook logs it as "panic: ...").
    fn shim_panicked(&self) -> bool {
        std::fs::read_to_string(self.containerd.log_path()).unwrap_or_default().contains("panic:")
    }

    /// The shim of `pod_id` still runs.
    fn shim_alive(&self, pod_id: &str) -> bool {
        processes_with(pod_id).iter().any(|(_, cmd)| cmd.contains("containerd-shim-bulkhead-v2"))
    }

    /// Stop and removal of a pod still work, within the bound.
    async fn remove_pod(&self, pod_id: &str) -> Result<()> {
        let started = Instant::now();
        self.cri.stop_pod_sandbox(pod_id).await.with_context(|| self.fail_context())?;
        self.cri.remove_pod_sandbox(pod_id).await.with_context(|| self.fail_context())?;
        if started.elapsed() > ERROR_BOUND {
            bail!("stopping and removing pod {pod_id} took {:?}", started.elapsed());
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_hostile_agent_fails_only_its_own_pod() -> Result<()> {
    let Some(env) = setup("a_hostile_agent_fails_only_its_own_pod").await? else { return Ok(()) };
    let (bystander_pod, bystander, _) = env.pod("bystander", "bulkhead").await?;
    env.bystander_ok(&bystander, "before").await?;

    // Reply faults on ExecProcess: the exec fails within the bound.
    for fault in ["stall", "huge-length", "wrong-type", "big-error", "close"] {
        let (pod_id, ctr, _) = env.pod(&format!("hostile-{fault}"), &format!("bh-{fault}")).await?;
        let started = Instant::now();
        let result = env.cri.exec_sync(&ctr, &["true"], 10).await;
        let took = started.elapsed();
        let err = match result {
            Ok(out) => bail!("{fault}: an exec through a hostile agent succeeded: {out:?}"),
            Err(e) => format!("{e:#}"),
        };
        println!("{fault}: exec failed after {took:?}: {}", &err[..err.len().min(300)]);
        assert!(took < ERROR_BOUND, "{fault}: the error took {took:?}: {err}");
        if fault == "big-error" {
            assert!(err.contains("bytes cut"), "{fault}: the agent's text is cut: {}", &err[..err.len().min(300)]);
            assert!(err.len() < 16 * 1024, "{fault}: {} bytes of error reached CRI", err.len());
        }
        if fault == "big-error" {
            // An error reply, however large, is only an error: the connection and the pod stay.
            assert!(env.shim_alive(&pod_id), "{fault}: the pod's shim died\n{}", env.fail_context());
            assert_eq!(env.cri.container_status(&ctr).await?.state, RUNNING, "{fault}: the container");
        } else {
            // The agent's connection is gone, so the pod ends: its container reports 137
            // (killed), and the shim goes once containerd has deleted the pod's tasks.
            let status = env.cri.wait_container(&ctr, ERROR_BOUND, |s| s.state == EXITED).await?;
            assert_eq!(status.exit_code, 137, "{fault}: {status:?}");
        }
        assert!(!env.shim_panicked(), "{fault}: the shim panicked\n{}", env.fail_context());
        env.bystander_ok(&bystander, &format!("after {fault}")).await?;
        env.remove_pod(&pod_id).await.with_context(|| format!("{fault}: removing the pod"))?;
    }

    // Floods: the pod keeps working, the shim holds back what the agent causes.
    for (fault, held_back) in
        [("oom-flood", "OOM events faster than one per second"), ("stdout-flood", "output lines suppressed")]
    {
        let (pod_id, ctr, _) = env.pod(&format!("hostile-{fault}"), &format!("bh-{fault}")).await?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = std::fs::read_to_string(env.containerd.log_path()).unwrap_or_default();
            if log.contains(held_back) {
                break;
            }
            if Instant::now() > deadline {
                bail!("{fault}: the shim never said {held_back:?}\n{}", env.fail_context());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let out = env.cri.exec_sync(&ctr, &["echo", "flooded"], 10).await.context(fault)?;
        assert_eq!(out.exit_code, 0, "{fault}: exec in the flooded pod");
        assert!(env.shim_alive(&pod_id), "{fault}: the pod's shim died");
        env.bystander_ok(&bystander, &format!("during {fault}")).await?;
        env.remove_pod(&pod_id).await.with_context(|| format!("{fault}: removing the pod"))?;
    }
    env.bystander_ok(&bystander, "at the end").await?;
    env.remove_pod(&bystander_pod).await
}

/// `kill -9` of the pod's agent (the one serving, in its user namespace; the first run waiting
/// for it goes with it), or of its sandbox process (the namespace launcher): the containers are
/// reported exited with 137, and the pod stops and goes without debris.
#[tokio::test]
async fn kill9_of_agent_or_sandbox_process_gives_137_and_leaves_nothing() -> Result<()> {
    let Some(env) = setup("kill9_of_agent_or_sandbox_process_gives_137_and_leaves_nothing").await? else {
        return Ok(());
    };
    const LAUNCHER: &str = "__bulkhead-ns-launch";
    for victim in ["agent", "sandbox"] {
        let (pod_id, ctr, _) = env.pod(&format!("kill9-{victim}"), "bulkhead").await?;
        // The launcher's command line names the agent too; only the serving agent's names its root.
        let is_victim = |cmd: &str| match victim {
            "agent" => cmd.contains("bulkhead-agent") && cmd.contains("--in-minimal-root"),
            _ => cmd.contains(LAUNCHER),
        };
        let pids: Vec<u32> =
            processes_with(&pod_id).into_iter().filter(|(_, cmd)| is_victim(cmd)).map(|(pid, _)| pid).collect();
        assert_eq!(pids.len(), 1, "one {victim} process of pod {pod_id}: {pids:?}");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pids[0] as i32), nix::sys::signal::Signal::SIGKILL)?;
        let status = env
            .cri
            .wait_container(&ctr, Duration::from_secs(15), |s| s.state == cri::ContainerState::ContainerExited as i32)
            .await
            .with_context(|| env.fail_context())?;
        assert_eq!(status.exit_code, 137, "kill -9 of the {victim}");
        env.remove_pod(&pod_id).await?;
        bulkhead_integration::host::eventually_nothing("processes of the pod", Duration::from_secs(15), || {
            processes_with(&pod_id).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
        })
        .await?;
        let state = env.state_dir.path().join(&pod_id);
        assert!(!state.exists(), "{} is left", state.display());
    }
    Ok(())
}
