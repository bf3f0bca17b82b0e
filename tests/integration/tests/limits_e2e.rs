//! A pod's limits hold as runc's do, on every backend this host runs (the namespace backend; the
//! vm backend on the QEMU stand-in, and on `bulkhead-vmm` where the probe allows):
//! - a fork bomb stops at the container's pids limit, kubelet's pod pids limit reaches the guest,
//!   and a second pod still answers exec;
//! - a container that floods stdout keeps its newest lines, and a second pod's exec stays quick.
//!
//! The tests of this file load the host on purpose, so they take turns.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::guests::GuestVmm;
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::images::FORKBOMB_BIN;
use bulkhead_integration::{
    cgroups, container_config, pod_config, skip, skip_if_unready, workspace_bin, Containerd, ContainerdConfig, Cri,
    RuntimeHandler,
};
use k8s_cri::v1 as cri;

const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;
/// The container pids limit the fork bomb meets (the figure).
const CONTAINER_PIDS: i64 = 64;
/// kubelet's podPidsLimit for the bomb's pod, set on its pod cgroup as kubelet would.
const POD_PIDS: u64 = 1000;
/// ExecSync's own deadline: a probe exec must answer within it, loaded host or not.
const EXEC_BOUND_SECS: i64 = 30;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One backend's handler in the private containerd.
struct Backend {
    handler: String,
    label: String,
    vm: bool,
}

/// A private containerd with a handler per backend this host runs, each starting containers from
/// containerd's default spec with a pids limit of [`CONTAINER_PIDS`].
struct Stand {
    containerd: Containerd,
    cri: Cri,
    backends: Vec<Backend>,
    state_dir: tempfile::TempDir,
    _config_dir: tempfile::TempDir,
}

impl Stand {
    async fn start(test: &str) -> Result<Option<Self>> {
        if skip_if_unready(test) {
            return Ok(None);
        }
        let agent = workspace_bin("bulkhead-agent");
        if !agent.is_file() {
            skip::missing_prerequisite(test, &format!("{} is not built", agent.display()));
            return Ok(None);
        }
        let state_dir = tempfile::Builder::new().prefix("bl").tempdir_in("/run")?;
        let config_dir = tempfile::tempdir()?;
        let base_spec = config_dir.path().join("base-spec.json");
        std::fs::write(&base_spec, serde_json::to_vec_pretty(&base_spec_with_pids_limit()?)?)?;
        let handler = |name: &str, config: &Path| RuntimeHandler {
            name: name.into(),
            base_runtime_spec: Some(base_spec.clone()),
            ..RuntimeHandler::bulkhead(Some(config))
        };

        let ns_config = config_dir.path().join("namespace.toml");
        std::fs::write(
            &ns_config,
            format!(
                "backend = \"namespace\"\nstate_dir = \"{}\"\n[namespace]\nagent_path = \"{}\"\n",
                state_dir.path().join("ns").display(),
                agent.display()
            ),
        )?;
        let mut handlers = vec![handler("bulkhead", &ns_config)];
        let mut backends = vec![Backend { handler: "bulkhead".into(), label: "namespace".into(), vm: false }];
        for (i, vmm) in [GuestVmm::QemuStandIn, GuestVmm::Bulkhead].into_iter().enumerate() {
            if let Some(why) = vmm.unavailable() {
                println!("{test}: not on {}: {why:?}", vmm.name());
                continue;
            }
            let path = config_dir.path().join(format!("vm{i}.toml"));
            let vm_state = state_dir.path().join(format!("vm{i}"));
            std::fs::write(&path, bulkhead_integration::guests::real_vm_config(&vm_state, 45_000, vmm)?)?;
            let name = format!("bulkhead-vm{i}");
            handlers.push(handler(&name, &path));
            backends.push(Backend { handler: name, label: format!("vm on {}", vmm.name()), vm: true });
        }
        let containerd = Containerd::start(ContainerdConfig { handlers, ..Default::default() }).await?;
        let cri = containerd.cri().await?;
        Ok(Some(Self { containerd, cri, backends, state_dir, _config_dir: config_dir }))
    }

    /// Runs a pod named `name` on `backend`, under `cgroup_parent` when given.
    async fn pod(
        &self,
        backend: &Backend,
        name: &str,
        cgroup_parent: Option<&str>,
    ) -> Result<(String, cri::PodSandboxConfig)> {
        let mut config = pod_config(name, &self.containerd.new_log_dir(name)?);
        if let (Some(parent), Some(linux)) = (cgroup_parent, config.linux.as_mut()) {
            linux.cgroup_parent = parent.into();
        }
        let id =
            self.cri.run_pod_sandbox(&config, &backend.handler).await.with_context(|| self.containerd.log_tail(60))?;
        Ok((id, config))
    }

    async fn container(&self, pod: &(String, cri::PodSandboxConfig), config: &cri::ContainerConfig) -> Result<String> {
        let id =
            self.cri.create_container(&pod.0, config, &pod.1).await.with_context(|| self.containerd.log_tail(40))?;
        self.cri.start_container(&id).await?;
        self.cri.wait_container(&id, Duration::from_secs(60), |s| s.state == RUNNING).await?;
        Ok(id)
    }

    async fn remove_pods(&self, pods: &[&str]) -> Result<()> {
        for pod in pods {
            self.cri.stop_pod_sandbox(pod).await?;
            self.cri.remove_pod_sandbox(pod).await?;
        }
        Ok(())
    }

    /// No process or mount of any pod is left.
    async fn nothing_left(&self) -> Result<()> {
        let state = self.state_dir.path().display().to_string();
        let within = Duration::from_secs(30);
        eventually_nothing("the pods' processes", within, || {
            processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
        })
        .await?;
        eventually_nothing("mounts", within, || mounts_with(&state)).await
    }
}

/// containerd's default spec (`ctr oci spec`) with `linux.resources.pids.limit` set, as a node
/// whose operator caps every container's processes hands it to containerd.
fn base_spec_with_pids_limit() -> Result<serde_json::Value> {
    let out = std::process::Command::new("ctr").args(["oci", "spec"]).output().context("ctr oci spec")?;
    if !out.status.success() {
        bail!("ctr oci spec: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut spec: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    spec["linux"]["resources"]["pids"] = serde_json::json!({ "limit": CONTAINER_PIDS });
    Ok(spec)
}

/// A container that runs until SIGTERM.
fn sleeper(name: &str) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"])
}

/// kubelet's pod cgroup, made as kubelet makes it (every hierarchy), with its pids limit; removed
/// when dropped (the pod's own cgroups below it are the shim's to remove first).
struct KubeletPodCgroup {
    path: String,
}

impl KubeletPodCgroup {
    fn new(tag: &str, pids_max: u64) -> Result<Self> {
        let path = format!("/bhlimits-{}-{tag}", std::process::id());
        for dir in cgroups::dirs(&path) {
            std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
            // v1 cpuset: a new cgroup has no CPUs until given its parent's, as kubelet gives them.
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Some(Ok(value)) = dir.parent().map(|parent| std::fs::read(parent.join(file))) {
                    std::fs::write(dir.join(file), value)?;
                }
            }
            if dir.join("pids.max").exists() {
                std::fs::write(dir.join("pids.max"), pids_max.to_string())?;
            }
        }
        Ok(Self { path })
    }
}

impl Drop for KubeletPodCgroup {
    fn drop(&mut self) {
        for dir in cgroups::dirs(&self.path) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// How long `exec` into `id` takes, each of `n` times; any failure is an error.
async fn exec_times(cri: &Cri, id: &str, n: usize) -> Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let out = cri.exec_sync(id, &["echo", "ok"], EXEC_BOUND_SECS).await?;
        if (out.exit_code, out.stdout.as_slice()) != (0, b"ok\n") {
            bail!("exec into {id}: {out:?}");
        }
        times.push(started.elapsed());
    }
    Ok(times)
}

/// The fork bomb's last score line in its log: (forked, eagain, other).
fn bomb_score(log: &str) -> Option<(u64, u64, u64)> {
    let line = log.lines().rev().find_map(|l| l.split_once("forked=").map(|(_, rest)| rest))?;
    let mut fields = line.split_whitespace();
    let forked = fields.next()?.parse().ok()?;
    let eagain = fields.next()?.strip_prefix("eagain=")?.parse().ok()?;
    let other = fields.next()?.strip_prefix("other=")?.parse().ok()?;
    Some((forked, eagain, other))
}

/// The first score in the bomb's log at `log_path` that `wanted` accepts (a line a second; 60 s at
/// most). The error quotes the log.
async fn wait_for_score(log_path: &str, wanted: impl Fn((u64, u64, u64)) -> bool) -> Result<(u64, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = std::fs::read_to_string(log_path).unwrap_or_default();
        match bomb_score(&log) {
            Some(score) if wanted(score) => return Ok(score),
            _ if Instant::now() > deadline => {
                let tail: Vec<&str> = log.lines().rev().take(10).collect();
                bail!("no such score within 60 s; the log ends {tail:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

#[test]
fn bomb_scores_parse() {
    let log = "2026-12-01T00:00:00Z stdout F forked=3 eagain=0 other=0\n\
               2026-12-01T00:00:01Z stdout F forked=63 eagain=4242 other=1\n";
    assert_eq!(bomb_score(log), Some((63, 4242, 1)));
    assert_eq!(bomb_score("nothing yet\n"), None);
    assert_eq!(bomb_score("x stdout F forked=1 eagain=zz other=0\n"), None);
}

#[tokio::test]
async fn a_fork_bomb_stops_at_the_pids_limit() -> Result<()> {
    let test = "a_fork_bomb_stops_at_the_pids_limit";
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(stand) = Stand::start(test).await? else { return Ok(()) };
    for (i, backend) in stand.backends.iter().enumerate() {
        fork_bomb_on(test, &stand, backend, i).await.with_context(|| format!("on the {} backend", backend.label))?;
    }
    stand.nothing_left().await
}

async fn fork_bomb_on(test: &str, stand: &Stand, backend: &Backend, i: usize) -> Result<()> {
    let label = &backend.label;
    let cri = &stand.cri;
    let kubelet_cgroup = KubeletPodCgroup::new(&format!("bomb{i}"), POD_PIDS)?;
    let bomb_pod = stand.pod(backend, &format!("bomb{i}"), Some(&kubelet_cgroup.path)).await?;
    let probe_pod = stand.pod(backend, &format!("probe{i}"), None).await?;
    let probe = stand.container(&probe_pod, &sleeper("probe")).await?;
    let idle = exec_times(cri, &probe, 5).await?;

    if backend.vm {
        // kubelet's pod limit binds only the pod's host processes; the guest carries it over the
        // parent of its containers.
        let watcher = stand.container(&bomb_pod, &sleeper("watcher")).await?;
        let out = cri.exec_sync(&watcher, &["cat", "/sys/fs/cgroup/bulkhead/pids.max"], EXEC_BOUND_SECS).await?;
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), POD_PIDS.to_string(), "{label}: {out:?}");
    }

    let bomb = stand.container(&bomb_pod, &container_config("bomb", &[FORKBOMB_BIN])).await?;
    let log_path = cri.container_status(&bomb).await?.log_path;
    // The bomb reaches the limit: the kernel refuses forks.
    let refused = wait_for_score(&log_path, |(_, eagain, _)| eagain > 0).await.context("no fork was refused")?;
    // The second pod answers while the bomb goes on.
    let loaded = exec_times(cri, &probe, 5).await?;
    let (forked, eagain, other) =
        wait_for_score(&log_path, |(_, eagain, _)| eagain > refused.1).await.context("the bomb stopped bombing")?;
    println!(
        "{test}: {label}: first refusal at {refused:?}; later forked={forked} eagain={eagain} other={other}; \
         probe exec idle {idle:?}, under the bomb {loaded:?}"
    );
    // Nothing the bomb made exits: the reporter and its forks stay within the limit.
    assert!(forked < CONTAINER_PIDS as u64, "{label}: {forked} forks succeeded under a limit of {CONTAINER_PIDS}");
    assert_eq!(cri.container_status(&bomb).await?.state, RUNNING, "{label}: the bomb is held, not killed");

    // The bomb's pod stops as any pod does.
    let started = Instant::now();
    stand.remove_pods(&[&bomb_pod.0]).await?;
    println!("{test}: {label}: the bomb's pod stopped and went in {:?}", started.elapsed());
    assert_eq!(exec_times(cri, &probe, 1).await?.len(), 1);
    stand.remove_pods(&[&probe_pod.0]).await?;
    eventually_nothing("the bomb pod's cgroups", Duration::from_secs(20), || {
        cgroups::dirs(&kubelet_cgroup.path)
            .iter()
            .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path().display().to_string())
            .collect()
    })
    .await?;
    Ok(())
}
