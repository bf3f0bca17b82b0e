//! What only containerd 2.x does with the shim, on containerd 2.1 whatever the run's default (the suites themselves
//! run on 2.1 through their `*_on_containerd_2_1` twins):
//! - it reads the shim's bare-address answer to `start` as bootstrap version 2 (ttrpc, Task API v2), and the pod's
//!   later containers still go through `start` to the pod's one shim: the shim never claims version 3, which would
//!   stop 2.x running `start` and `delete` for them (pod grouping, cleanup after a crash);
//! - its introspection (`PluginInfo` of a runtime, `shim -info`) gets the runtime's name and version and the
//!   one feature it checks before creating a container with idmapped mounts: supported;
//! - a runtime configured with `sandboxer = "shim"` runs a pod-network pod through the shim's sandbox API, with no
//!   pause container, and stop and remove leave nothing behind (a host-network pod never reaches the shim on that
//!   path: 2.1.9 itself crashes on it, fixed upstream in 2.3.0), and a pod it refuses (hostPID) fails naming why;
//! - `bulkhead-ctl doctor` names the containerd version, passes such a sandboxer and fails one with runtime options
//!   (2.1 then fails every StartContainer);
//! - a shim-sandboxer pod survives a containerd restart, and one whose shim is killed goes NOTREADY, its workload
//!   ends, and CRI removes it leaving nothing;
//! - a `hostUsers: false` pod runs on the namespace backend through both paths, and on the vm backend, as root in
//!   the pod's user namespace and the mapped ids outside, with idmapped rootfs and volumes;
//! - the harness's runc runtime on 2.1 runs sid's runc 1.3, the runc 2.1 is tested with (not the system's 1.1).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use bulkhead_integration::guests::GuestVmm;
use bulkhead_integration::{
    container_config, workspace_bin, Containerd, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup, ShimEnv,
};

const VERSION: ContainerdVersion = ContainerdVersion::V2_1;

/// containerd 2.1 with `bulkhead` (the namespace backend, its config at `config`) and the test's handlers.
struct Env {
    shim: ShimEnv,
    config: std::path::PathBuf,
}

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.shim
    }
}

impl std::ops::DerefMut for Env {
    fn deref_mut(&mut self) -> &mut ShimEnv {
        &mut self.shim
    }
}

/// `bulkhead` as a second handler, `bulkhead-sandboxer`, whose 2.x `sandboxer` is the shim itself. It has no runtime
/// options (2.1 would read them as runc's at StartContainer): the shim finds its config through `BULKHEAD_CONFIG`,
/// which [`SHIM_ENV`] sets.
fn with_sandboxer(bulkhead: RuntimeHandler) -> Vec<RuntimeHandler> {
    let mut h = RuntimeHandler { name: "bulkhead-sandboxer".into(), options: vec![], ..bulkhead };
    h.settings.push(("sandboxer".into(), "shim".into()));
    vec![h]
}

/// [`with_sandboxer`], plus the same with the runtime options kept (`bulkhead-sandboxer-options`).
fn with_sandboxers(bulkhead: RuntimeHandler) -> Vec<RuntimeHandler> {
    let mut kept = RuntimeHandler { name: "bulkhead-sandboxer-options".into(), ..bulkhead.clone() };
    kept.settings.push(("sandboxer".into(), "shim".into()));
    let mut all = with_sandboxer(bulkhead);
    all.push(kept);
    all
}

/// containerd's shim manager `env`, which every shim it starts inherits.
fn shim_env(config: &std::path::Path) -> String {
    format!("\n[plugins.'io.containerd.shim.v1.manager']\n  env = ['BULKHEAD_CONFIG={}']\n", config.display())
}

/// containerd 2.1 with `bulkhead` on the namespace backend, plus `handlers` made from it.
async fn setup(test: &str, more: impl Fn(RuntimeHandler) -> Vec<RuntimeHandler>) -> Result<Option<Env>> {
    setup_with(test, more, false).await
}

async fn setup_with(
    test: &str,
    more: impl Fn(RuntimeHandler) -> Vec<RuntimeHandler>,
    cni_bridge: bool,
) -> Result<Option<Env>> {
    let bins = ["bulkhead-agent", "containerd-shim-bulkhead-v2", "bulkhead-ctl"];
    let Some(setup) = Setup::new(test, VERSION, &bins)? else { return Ok(None) };
    let config = setup.namespace_config("bulkhead.toml", setup.state())?;
    let bulkhead = RuntimeHandler::bulkhead(Some(&config));
    let mut handlers = vec![bulkhead.clone()];
    handlers.extend(more(bulkhead));
    let extra_toml = shim_env(&config);
    let shim = setup.start(ContainerdConfig { handlers, cni_bridge, extra_toml, ..Default::default() }).await?;
    Ok(Some(Env { shim, config }))
}

/// containerd's log lines `connecting to shim <id>` (with the address, protocol and bootstrap version it uses).
fn connections(containerd: &Containerd, id: &str) -> Vec<String> {
    let log = std::fs::read_to_string(containerd.log_path()).unwrap_or_default();
    log.lines().filter(|l| l.contains(&format!("connecting to shim {id}"))).map(str::to_string).collect()
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|f| f.strip_prefix(&format!("{key}="))).map(|v| v.trim_matches('"'))
}

#[tokio::test]
async fn containerd_2_reaches_the_pods_one_shim_through_the_version_2_bootstrap() -> Result<()> {
    let test = "containerd_2_reaches_the_pods_one_shim_through_the_version_2_bootstrap";
    let Some(env) = setup(test, |_| vec![]).await? else { return Ok(()) };
    let pod = env.pod("bootstrap")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.containerd.log_tail(40))?;
    let script = "trap 'exit 0' TERM; while true; do sleep 0.2; done";
    let ctr = env.cri.create_container(&pod_id, &container_config("c", &["sh", "-c", script]), &pod).await?;
    env.cri.start_container(&ctr).await?;
    let out = env.cri.exec_sync(&ctr, &["echo", "on-2.1"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "on-2.1\n");

    let (sandbox, container) = (connections(&env.containerd, &pod_id), connections(&env.containerd, &ctr));
    assert_eq!(sandbox.len(), 1, "{sandbox:?}");
    assert_eq!(container.len(), 1, "{container:?}");
    for line in [&sandbox[0], &container[0]] {
        assert_eq!((field(line, "protocol"), field(line, "version")), (Some("ttrpc"), Some("2")), "{line}");
    }
    // The container's `start` handed back the pod's shim: one socket, one shim.
    assert_eq!(field(&container[0], "address"), field(&sandbox[0], "address"));
    let socket = bulkhead_integration::host::shim_socket(&env.containerd, &pod_id);
    assert_eq!(field(&sandbox[0], "address"), Some(format!("unix://{}", socket.display()).as_str()));

    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;
    bulkhead_integration::host::eventually_nothing("the pod's shim", Duration::from_secs(15), || {
        bulkhead_integration::host::processes_with(&pod_id).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await
}

#[tokio::test]
async fn containerd_2_introspects_the_runtime() -> Result<()> {
    let test = "containerd_2_introspects_the_runtime";
    let Some(env) = setup(test, |_| vec![]).await? else { return Ok(()) };
    // PluginInfo of the runtime: containerd runs `shim -info` and decodes what it prints.
    let out = Command::new(env.containerd.ctr())
        .arg("--address")
        .arg(env.containerd.address())
        .args(["plugins", "inspect-runtime", "--runtime"])
        .arg(workspace_bin("containerd-shim-bulkhead-v2"))
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(info["Name"], "io.containerd.bulkhead.v2", "{info}");
    assert!(!info["Version"]["Version"].as_str().unwrap_or_default().is_empty(), "{info}");
    // Idmapped mounts: the namespace backend makes them for a hostUsers: false pod's containers.
    assert_eq!(info.pointer("/Features/linux/mountExtensions/idmap/enabled"), Some(&serde_json::json!(true)));
    // What CRI tells kubelet of it: no user namespaces on the handler; kubelet publishes it in the node's
    // status.runtimeHandlers, and sends no hostUsers: false pod to a handler without them. containerd before 2.4
    // introspects runc-type runtimes only, so 2.1 reports no features for bulkhead at all; later ones ask `-info`
    // above, whose features list the `user` namespace only for a handler without runtime options (this one has).
    let status = env.cri.status().await?;
    let handler =
        status.runtime_handlers.iter().find(|h| h.name == "bulkhead").context("no bulkhead handler in CRI Status")?;
    assert!(!handler.features.as_ref().is_some_and(|f| f.user_namespaces), "{handler:?}");
    Ok(())
}

#[tokio::test]
async fn doctor_names_containerd_2_and_checks_the_sandboxer() -> Result<()> {
    let test = "doctor_names_containerd_2_and_checks_the_sandboxer";
    let Some(env) = setup(test, with_sandboxers).await? else { return Ok(()) };
    let doctor = |handler: &str| {
        let out = Command::new(workspace_bin("bulkhead-ctl"))
            .arg("--config")
            .arg(&env.config)
            .args(["doctor", "--json", "--containerd-socket"])
            .arg(env.containerd.address())
            .args(["--handler", handler])
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let line = |name: &str| json["checks"].as_array().unwrap().iter().find(|c| c["name"] == name).cloned();
        (out.status.success(), line("containerd").unwrap(), line("shim binary"), line("sandboxer"), json.clone())
    };
    let (ok, containerd, shim, sandboxer, json) = doctor("bulkhead");
    assert!(ok, "{json}");
    let version = format!("containerd {}", env.containerd.runtime_version());
    assert!(containerd["detail"].as_str().unwrap().starts_with(&version), "{containerd}");
    assert_eq!(shim.map(|s| s["ok"].clone()), Some(serde_json::json!(true)), "{json}");
    assert!(sandboxer.is_none(), "the default sandboxer (podsandbox) is fine: {json}");

    let (ok, _, _, sandboxer, json) = doctor("bulkhead-sandboxer");
    assert!(ok, "{json}");
    let sandboxer = sandboxer.unwrap();
    assert_eq!(sandboxer["ok"], true, "{sandboxer}");
    assert!(sandboxer["detail"].as_str().unwrap().contains("no pause container"), "{sandboxer}");

    let (ok, _, _, sandboxer, json) = doctor("bulkhead-sandboxer-options");
    assert!(!ok, "{json}");
    let sandboxer = sandboxer.unwrap();
    assert_eq!(sandboxer["ok"], false);
    assert!(sandboxer["detail"].as_str().unwrap().contains("remove the options"), "{sandboxer}");
    Ok(())
}

#[tokio::test]
async fn a_pod_runs_through_the_sandbox_api_with_no_pause_container() -> Result<()> {
    let test = "a_pod_runs_through_the_sandbox_api_with_no_pause_container";
    let Some(env) = setup_with(test, with_sandboxer, true).await? else { return Ok(()) };
    println!("containerd {}", env.containerd.runtime_version());
    let mut pod = env.pod("sandboxer")?;
    pod.hostname = "sandboxer-host".into();
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    ns.context("namespace options")?.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    let pod_id =
        env.cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await.with_context(|| env.containerd.log_tail(40))?;
    let status = env.cri.pod_sandbox_status(&pod_id).await?;
    assert_eq!(status.state, k8s_cri::v1::PodSandboxState::SandboxReady as i32, "{status:?}");
    let ip = status.network.as_ref().map(|n| n.ip.clone()).unwrap_or_default();
    assert!(!ip.is_empty(), "CNI gave the pod an address: {status:?}");

    // The sandbox controller, not a pause task: containerd knows no container of the pod's id, and the pod's
    // bundle is the sandbox controller's.
    let ctr_list = Command::new(env.containerd.ctr())
        .arg("--address")
        .arg(env.containerd.address())
        .args(["-n", "k8s.io", "containers", "ls", "-q"])
        .output()?;
    let listed = String::from_utf8_lossy(&ctr_list.stdout).into_owned();
    assert!(ctr_list.status.success() && !listed.contains(&pod_id), "a pause container exists: {listed}");
    let found = Command::new("find")
        .arg(env.containerd.dir())
        .args(["-path", "*/io.containerd.sandbox.controller.v1.shim/*"])
        .args(["-name", "config.json"])
        .output()?;
    let found = String::from_utf8_lossy(&found.stdout).into_owned();
    assert!(
        found.contains(&format!("/{pod_id}/config.json")),
        "CreateSandbox wrote no spec into the sandbox bundle: {found:?}"
    );

    let script = "trap 'exit 0' TERM; while true; do sleep 0.2; done";
    let ctr = env.cri.create_container(&pod_id, &container_config("c", &["sh", "-c", script]), &pod).await?;
    env.cri.start_container(&ctr).await?;
    let out = env.cri.exec_sync(&ctr, &["hostname"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "sandboxer-host\n", "the pod config's hostname");
    let out = env.cri.exec_sync(&ctr, &["sh", "-c", "exit 3"], 10).await?;
    assert_eq!(out.exit_code, 3);
    // Containers still go through `start` to the pod's one shim.
    let (sandbox, container) = (connections(&env.containerd, &pod_id), connections(&env.containerd, &ctr));
    assert_eq!(field(&container[0], "address"), field(&sandbox[0], "address"), "{sandbox:?} {container:?}");

    env.cri.stop_pod_sandbox(&pod_id).await?;
    let status = env.cri.pod_sandbox_status(&pod_id).await?;
    assert_eq!(status.state, k8s_cri::v1::PodSandboxState::SandboxNotready as i32, "{status:?}");
    env.cri.remove_pod_sandbox(&pod_id).await?;
    assert!(env.cri.list_pod_sandboxes().await?.is_empty());
    bulkhead_integration::host::eventually_nothing("the pod's shim and its processes", Duration::from_secs(15), || {
        bulkhead_integration::host::processes_with(&pod_id).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    bulkhead_integration::host::eventually_nothing("the pod's bundles", Duration::from_secs(15), || {
        let found = Command::new("find").arg(env.containerd.dir()).args(["-name", &pod_id]).output();
        found.map(|o| String::from_utf8_lossy(&o.stdout).lines().map(str::to_string).collect()).unwrap_or_default()
    })
    .await
}

#[tokio::test]
async fn a_vm_pod_runs_through_the_sandbox_api() -> Result<()> {
    vm_pod_through_the_sandbox_api("a_vm_pod_runs_through_the_sandbox_api", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn a_vm_pod_runs_through_the_sandbox_api_on_bulkhead_vmm() -> Result<()> {
    vm_pod_through_the_sandbox_api("a_vm_pod_runs_through_the_sandbox_api_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// containerd 2.1 with a CNI bridge and `bulkhead` on the vm backend (the real guest on `vmm`), plus
/// `bulkhead-sandboxer`, the same config through `BULKHEAD_CONFIG` with the shim as sandboxer. `None`, after one
/// `SKIPPED` line, where `test` cannot run.
async fn vm_sandboxer_env(test: &str, vmm: GuestVmm) -> Result<Option<ShimEnv>> {
    let Some(setup) = Setup::new(test, VERSION, &["containerd-shim-bulkhead-v2"])? else { return Ok(None) };
    if vmm.skip(test) {
        return Ok(None);
    }
    println!("{test}: containerd {}, the guest runs on {}", VERSION.line(), vmm.name());
    let config = setup
        .write_config("bulkhead.toml", &bulkhead_integration::guests::real_vm_config(setup.state(), 45_000, vmm)?)?;
    let env = setup
        .start(ContainerdConfig {
            handlers: with_sandboxer(RuntimeHandler::bulkhead(Some(&config))),
            cni_bridge: true,
            extra_toml: shim_env(&config),
            ..Default::default()
        })
        .await?;
    Ok(Some(env))
}

/// The vm backend (the real guest) through the shim sandboxer: RunPodSandbox starts the VM, a container runs on the
/// guest kernel with the pod config's hostname, and stop and remove leave no process, mount or state.
async fn vm_pod_through_the_sandbox_api(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = vm_sandboxer_env(test, vmm).await? else { return Ok(()) };
    let (cri, containerd, state_dir) = (&env.cri, &env.containerd, &env.state_dir);
    let mut pod = env.pod("vm-sandboxer")?;
    pod.hostname = "vm-sandboxer".into();
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    ns.context("namespace options")?.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await.with_context(|| containerd.log_tail(60))?;
    let script = "trap 'exit 0' TERM; while true; do sleep 0.2; done";
    let ctr = cri.create_container(&pod_id, &container_config("c", &["sh", "-c", script]), &pod).await?;
    cri.start_container(&ctr).await?;
    let out = cri.exec_sync(&ctr, &["sh", "-c", "uname -r; hostname"], 30).await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string();
    let guest_release = lines.next().unwrap_or_default();
    assert!(!guest_release.is_empty() && guest_release != host_release, "not the guest kernel: {text:?}");
    assert_eq!(lines.next(), Some("vm-sandboxer"), "{text:?}");

    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    let state = state_dir.path().display().to_string();
    let within = Duration::from_secs(20);
    bulkhead_integration::host::eventually_nothing("the pod's processes", within, || {
        let mut left = bulkhead_integration::host::processes_with(&state);
        left.extend(bulkhead_integration::host::processes_with(&pod_id));
        left.into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    bulkhead_integration::host::eventually_nothing("mounts", within, || {
        bulkhead_integration::host::mounts_with(&state)
    })
    .await?;
    bulkhead_integration::host::eventually_nothing("pod state", within, || {
        bulkhead_integration::host::state_left(state_dir.path())
    })
    .await
}

#[tokio::test]
async fn a_sandbox_api_pod_outlives_a_containerd_restart() -> Result<()> {
    let test = "a_sandbox_api_pod_outlives_a_containerd_restart";
    let Some(mut env) = setup_with(test, with_sandboxer, true).await? else { return Ok(()) };
    let mut pod = env.pod("restart")?;
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    ns.context("namespace options")?.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    let pod_id =
        env.cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await.with_context(|| env.containerd.log_tail(40))?;
    let script = "trap 'exit 0' TERM; while true; do sleep 0.2; done";
    let ctr = env.cri.create_container(&pod_id, &container_config("c", &["sh", "-c", script]), &pod).await?;
    env.cri.start_container(&ctr).await?;

    // containerd goes away and comes back on the same state: it reconnects to the pod's shim (Task Connect for the
    // sandbox id, then the sandbox API's Status and Wait).
    env.containerd.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    env.containerd.start_again().await?;
    let cri = env.containerd.cri().await?;
    let status = cri.pod_sandbox_status(&pod_id).await.with_context(|| env.containerd.log_tail(40))?;
    assert_eq!(status.state, k8s_cri::v1::PodSandboxState::SandboxReady as i32, "{status:?}");
    let out = cri.exec_sync(&ctr, &["echo", "back"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "back\n");

    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    bulkhead_integration::host::eventually_nothing("the pod's shim and its processes", Duration::from_secs(15), || {
        bulkhead_integration::host::processes_with(&pod_id).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await
}

#[tokio::test]
async fn a_sandbox_api_pods_shim_killed_leaves_a_notready_pod_that_goes_cleanly() -> Result<()> {
    let test = "a_sandbox_api_pods_shim_killed_leaves_a_notready_pod_that_goes_cleanly";
    let Some(env) = setup_with(test, with_sandboxer, true).await? else { return Ok(()) };
    let mut pod = env.pod("crash")?;
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    ns.context("namespace options")?.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    let pod_id =
        env.cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await.with_context(|| env.containerd.log_tail(40))?;
    let marker = format!("crash-marker-{}", std::process::id());
    let script = format!("trap 'exit 0' TERM; while true; do sleep 0.2; done # {marker}");
    let ctr = env.cri.create_container(&pod_id, &container_config("c", &["sh", "-c", &script]), &pod).await?;
    env.cri.start_container(&ctr).await?;

    let shims = bulkhead_integration::host::pod_shim_pids(&pod_id);
    assert_eq!(shims.len(), 1, "one shim serves the pod: {shims:?}");
    // A descendant of the containerd this test started; signalled by PID only.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shims[0] as i32), nix::sys::signal::Signal::SIGKILL)?;

    // containerd sees the sandbox's Wait end (the pod goes NOTREADY) and runs `delete` for it, which tears the
    // pod down: no workload process is left. Until containerd has dropped the dead shim, 2.1's PodSandboxStatus
    // fails with the closed connection (it does not map the controller's error), as it would for any shim.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let status = env.cri.pod_sandbox_status(&pod_id).await;
        if status.as_ref().is_ok_and(|s| s.state == k8s_cri::v1::PodSandboxState::SandboxNotready as i32) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the pod is not NOTREADY after its shim died: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bulkhead_integration::host::eventually_nothing("workload processes", Duration::from_secs(20), || {
        bulkhead_integration::host::processes_with(&marker).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await?;
    let exited = k8s_cri::v1::ContainerState::ContainerExited as i32;
    env.cri.wait_container(&ctr, Duration::from_secs(20), |s| s.state == exited).await?;
    let _ = env.cri.stop_container(&ctr, 1).await;
    env.cri.remove_container(&ctr).await?;
    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;
    bulkhead_integration::host::eventually_nothing("the pod's processes", Duration::from_secs(15), || {
        bulkhead_integration::host::processes_with(&pod_id).into_iter().map(|(p, c)| format!("{p} {c}")).collect()
    })
    .await
}

#[tokio::test]
async fn a_pod_the_sandbox_api_refuses_fails_naming_why_and_leaves_nothing() -> Result<()> {
    let test = "a_pod_the_sandbox_api_refuses_fails_naming_why_and_leaves_nothing";
    let Some(env) = setup_with(test, with_sandboxer, true).await? else { return Ok(()) };
    let mut pod = env.pod("hostpid")?;
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    let ns = ns.context("namespace options")?;
    ns.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    ns.pid = k8s_cri::v1::NamespaceMode::Node as i32;
    let err = match env.cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await {
        Ok(id) => anyhow::bail!("hostPID pod {id} started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("hostPID"), "{err}");
    no_pod_and_no_shim_left(&env).await
}

/// No pod in CRI, and no bulkhead shim of this containerd runs (after a refused RunPodSandbox, or once a test removed its pods).
async fn no_pod_and_no_shim_left(env: &Env) -> Result<()> {
    assert!(env.cri.list_pod_sandboxes().await?.is_empty());
    bulkhead_integration::host::eventually_nothing("shims", Duration::from_secs(10), || {
        let address = format!("-address {}", env.containerd.address().display());
        let shims = bulkhead_integration::host::processes_with(&address);
        shims
            .into_iter()
            .filter(|(_, c)| c.contains("containerd-shim-bulkhead"))
            .map(|(p, c)| format!("{p} {c}"))
            .collect()
    })
    .await
}

/// The id maps of the `hostUsers: false` pods below: container ids 0..65536 onto host ids from 2^20, as kubelet
/// hands a pod one 65536-id range above the node's own ids.
const POD_HOST_ID: u32 = 1 << 20;

fn pod_id_maps() -> Vec<k8s_cri::v1::IdMapping> {
    vec![k8s_cri::v1::IdMapping { host_id: POD_HOST_ID, container_id: 0, length: 65536 }]
}

/// `pod` as kubelet asks for `hostUsers: false`: a pod network (containerd 2.1 makes it in the user namespace it
/// pins) and a user namespace with the pod's id maps.
fn with_pod_user_namespace(pod: &mut k8s_cri::v1::PodSandboxConfig) -> Result<()> {
    let ns = pod.linux.as_mut().and_then(|l| l.security_context.as_mut()).and_then(|s| s.namespace_options.as_mut());
    let ns = ns.context("namespace options")?;
    ns.network = k8s_cri::v1::NamespaceMode::Pod as i32;
    ns.userns_options = Some(k8s_cri::v1::UserNamespace {
        mode: k8s_cri::v1::NamespaceMode::Pod as i32,
        uids: pod_id_maps(),
        gids: pod_id_maps(),
    });
    Ok(())
}

/// A volume as kubelet mounts one into a user-namespaced container: with the pod's id maps, which containerd
/// passes on as an idmapped mount.
fn idmapped_volume(host: &std::path::Path, at: &str, readonly: bool) -> k8s_cri::v1::Mount {
    k8s_cri::v1::Mount {
        container_path: at.into(),
        host_path: host.display().to_string(),
        readonly,
        uid_mappings: pod_id_maps(),
        gid_mappings: pod_id_maps(),
        ..Default::default()
    }
}

/// The uid and gid (real) of host process `pid`, from /proc/<pid>/status.
fn host_ids(pid: u32) -> Result<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let first = |key: &str| -> Result<u32> {
        let line = status.lines().find(|l| l.starts_with(key)).with_context(|| format!("{key} of {pid}"))?;
        Ok(line.split_whitespace().nth(1).context(key.to_string())?.parse()?)
    };
    Ok((first("Uid:")?, first("Gid:")?))
}

/// The one host process whose command line has `marker` and whose parent's has not (a shell's forks carry the
/// same command line until they exec).
async fn top_process_with(marker: &str) -> Result<u32> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let top = bulkhead_integration::host::top_processes_with(marker);
        if let [(pid, _)] = top.as_slice() {
            return Ok(*pid);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "not one process with {marker}: {top:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `test` cannot run here, saying why on one line: containerd 2.x idmaps a `hostUsers: false` pod's image
/// layers in its root (`containerd_root`), and fails the container where the kernel cannot idmap that filesystem
/// (tmpfs before Linux 6.3; the emulated node keeps its tests' state on an ext4 disk for this).
fn skip_without_idmap(test: &str, containerd_root: &std::path::Path) -> Result<bool> {
    if bulkhead_integration::host::can_idmap(containerd_root)? {
        return Ok(false);
    }
    let fs = Command::new("stat").args(["-f", "-c", "%T"]).arg(containerd_root).output()?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    println!(
        "SKIPPED: {test}: Linux {} cannot idmap mounts of {} ({}), which containerd 2.x needs for the pod's image",
        kernel.trim(),
        containerd_root.display(),
        String::from_utf8_lossy(&fs.stdout).trim()
    );
    Ok(true)
}

/// A user-namespaced pod's container: its volumes (an emptyDir and a configMap-like read-only one, both
/// idmapped as kubelet asks), the marker in its command line, and the container's id once started.
struct UsernsContainer {
    id: String,
    marker: String,
    empty_dir: tempfile::TempDir,
    _config_map: tempfile::TempDir,
}

/// Creates and starts a container in `pod_id` as kubelet would in a `hostUsers: false` pod: its pod's namespace
/// options (the user namespace's among them), a PID namespace of its own, and idmapped volumes; its rootfs
/// read-only if `read_only_root`.
async fn start_userns_container(
    cri: &bulkhead_integration::Cri,
    containerd: &Containerd,
    pod_id: &str,
    pod: &k8s_cri::v1::PodSandboxConfig,
    marker: &str,
    read_only_root: bool,
) -> Result<UsernsContainer> {
    // Beside containerd's root, as kubelet keeps a pod's volumes on the node's disk: they are idmapped too.
    let empty_dir = tempfile::tempdir_in(containerd.dir())?;
    let config_map = tempfile::tempdir_in(containerd.dir())?;
    std::fs::write(config_map.path().join("key"), "value")?;
    let script = format!("trap 'exit 0' TERM; while true; do sleep 0.2; done # {marker}");
    let mut c = container_config(if read_only_root { "app-ro" } else { "app" }, &["sh", "-c", &script]);
    let mut ns = pod.linux.as_ref().and_then(|l| l.security_context.as_ref()).and_then(|s| s.namespace_options.clone());
    if let Some(ns) = ns.as_mut() {
        ns.pid = k8s_cri::v1::NamespaceMode::Container as i32;
    }
    let linux = c.linux.get_or_insert_with(Default::default);
    let security = linux.security_context.get_or_insert_with(Default::default);
    security.namespace_options = ns;
    security.readonly_rootfs = read_only_root;
    c.mounts =
        vec![idmapped_volume(empty_dir.path(), "/data", false), idmapped_volume(config_map.path(), "/config", true)];
    let id = cri.create_container(pod_id, &c, pod).await.with_context(|| containerd.log_tail(60))?;
    cri.start_container(&id).await.with_context(|| containerd.log_tail(60))?;
    Ok(UsernsContainer { id, marker: marker.into(), empty_dir, _config_map: config_map })
}

/// `script` in the container through ExecSync, its output's words joined by one space; a failure carries its stderr.
async fn sh_words(cri: &bulkhead_integration::Cri, ctr: &str, script: &str) -> Result<String> {
    let out = cri.exec_sync(ctr, &["sh", "-c", script], 30).await?;
    let text = String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ");
    anyhow::ensure!(out.exit_code == 0, "{script}: exit {}: {}", out.exit_code, String::from_utf8_lossy(&out.stderr));
    Ok(text)
}

/// What a `hostUsers: false` pod's container sees on either backend: root in the pod's user namespace
/// (`/proc/self/uid_map` shows the pod's maps, `id -u` says 0), its image's files root's (the rootfs is idmapped)
/// and writable, the configMap's file readable, and a file it makes in the emptyDir its root's; on disk that file
/// is the volume's own root's (the mount is idmapped, so nothing on the host is the pod's ids').
async fn container_sees_root_in_its_user_namespace(
    cri: &bulkhead_integration::Cri,
    c: &UsernsContainer,
    what: &str,
) -> Result<()> {
    let ids = format!("0 {POD_HOST_ID} 65536 0 {POD_HOST_ID} 65536");
    assert_eq!(sh_words(cri, &c.id, "cat /proc/self/uid_map /proc/self/gid_map").await?, ids, "{what}");
    assert_eq!(sh_words(cri, &c.id, "id -u; id -g").await?, "0 0", "{what}");
    let rootfs = sh_words(cri, &c.id, "stat -c %u:%g /bin/sh /etc; touch /etc/made-here && echo ok").await?;
    assert_eq!(rootfs, "0:0 0:0 ok", "{what}: rootfs");
    assert_eq!(sh_words(cri, &c.id, "cat /config/key").await?, "value", "{what}: configMap");
    let made = sh_words(cri, &c.id, "echo hi > /data/made && stat -c %u:%g /data/made").await?;
    assert_eq!(made, "0:0", "{what}: emptyDir");
    use std::os::unix::fs::MetadataExt;
    let on_disk = std::fs::metadata(c.empty_dir.path().join("made"))?;
    assert_eq!((on_disk.uid(), on_disk.gid()), (0, 0), "{what}: on disk, through no idmap");
    // An exec on a terminal (`kubectl exec -it`) is in the pod's user namespace too. The terminal echoes the
    // typed line with its expansions unexpanded; only the output has the values.
    let typed = "read a b c </proc/self/uid_map; [ -t 0 ] && t=yes; echo \"uid=$(id -u) host=$b term=$t\"; exit\n";
    let tty = bulkhead_integration::ws::tty_exec(cri, &c.id, typed).await?;
    assert!(tty.stdout.contains(&format!("uid=0 host={POD_HOST_ID} term=yes")), "{what}: TTY exec: {:?}", tty.stdout);
    assert!(tty.status.contains("Success"), "{what}: TTY exec status: {}", tty.status);
    Ok(())
}

/// A `hostUsers: false` pod on the namespace backend, through both of 2.1's paths (the pause-container path and
/// the shim as sandboxer): its container is root in the pod's user namespace and runs as the mapped ids on the
/// host ([`container_sees_root_in_its_user_namespace`]); the emptyDir file it made is the mapped id's seen through
/// its mount from the host; an exec joins the container's user and IPC namespaces with its capabilities; and stop
/// and remove leave nothing.
#[tokio::test]
async fn a_host_users_false_pod_runs_as_mapped_ids_with_idmapped_mounts() -> Result<()> {
    let test = "a_host_users_false_pod_runs_as_mapped_ids_with_idmapped_mounts";
    // containerd 2.1 starts a user-namespaced container only on a handler without runtime options: it sets the
    // console's owner in them as runc's, and fails on any other type (`can't unmarshal type
    // "runtimeoptions.v1.Options" to output "containerd.runc.v1.Options"`). So both handlers here find the config
    // through BULKHEAD_CONFIG, as a 2.x install should: `bulkhead-env` on CRI's pause-container path, and
    // `bulkhead-sandboxer` with the shim as sandboxer.
    let handlers = |bulkhead: RuntimeHandler| {
        let env = RuntimeHandler { name: "bulkhead-env".into(), options: vec![], ..bulkhead.clone() };
        let mut all = with_sandboxer(bulkhead);
        all.push(env);
        all
    };
    let Some(env) = setup_with(test, handlers, true).await? else { return Ok(()) };
    if skip_without_idmap(test, env.containerd.dir())? {
        return Ok(());
    }
    for handler in ["bulkhead-env", "bulkhead-sandboxer"] {
        let mut pod = env.pod(&format!("userns-{handler}"))?;
        with_pod_user_namespace(&mut pod)?;
        let pod_id = env.cri.run_pod_sandbox(&pod, handler).await.with_context(|| env.containerd.log_tail(60))?;
        let marker = format!("userns-marker-{handler}");
        let c = start_userns_container(&env.cri, &env.containerd, &pod_id, &pod, &marker, false).await?;
        container_sees_root_in_its_user_namespace(&env.cri, &c, handler).await?;

        let pid = top_process_with(&c.marker).await?;
        assert_eq!(host_ids(pid)?, (POD_HOST_ID, POD_HOST_ID), "{handler}: the container's ids on the host");
        // An exec is where its container is: the same user and IPC namespaces, the same capabilities.
        let init_caps = std::fs::read_to_string(format!("/proc/{pid}/status"))?
            .lines()
            .find(|l| l.starts_with("CapEff:"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .context("CapEff")?;
        assert_eq!(sh_words(&env.cri, &c.id, "grep CapEff: /proc/self/status").await?, init_caps, "{handler}");
        let ns_of = |ns: &str| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).map(|l| l.display().to_string());
        let exec_ns = sh_words(&env.cri, &c.id, "readlink /proc/self/ns/user; readlink /proc/self/ns/ipc").await?;
        assert_eq!(exec_ns, format!("{} {}", ns_of("user")?, ns_of("ipc")?), "{handler}");
        use std::os::unix::fs::MetadataExt;
        let through_mount = std::fs::metadata(format!("/proc/{pid}/root/data/made"))?;
        assert_eq!((through_mount.uid(), through_mount.gid()), (POD_HOST_ID, POD_HOST_ID), "{handler}");

        env.cri.stop_container(&c.id, 10).await?;
        env.cri.remove_container(&c.id).await?;
        env.cri.stop_pod_sandbox(&pod_id).await?;
        env.cri.remove_pod_sandbox(&pod_id).await?;
    }
    no_pod_and_no_shim_left(&env).await
}

#[tokio::test]
async fn a_host_users_false_vm_pod_runs_as_mapped_ids_with_idmapped_mounts() -> Result<()> {
    host_users_false_vm_pod("a_host_users_false_vm_pod_runs_as_mapped_ids_with_idmapped_mounts", GuestVmm::QemuStandIn)
        .await
}

#[tokio::test]
async fn a_host_users_false_vm_pod_runs_as_mapped_ids_with_idmapped_mounts_on_bulkhead_vmm() -> Result<()> {
    let test = "a_host_users_false_vm_pod_runs_as_mapped_ids_with_idmapped_mounts_on_bulkhead_vmm";
    host_users_false_vm_pod(test, GuestVmm::Bulkhead).await
}

/// A `hostUsers: false` pod on the vm backend (the real guest), through the shim as sandboxer (a handler without
/// runtime options, as 2.1 needs): the agent gives the pod a user namespace in the guest, and the shim shares the
/// container's rootfs and volumes with the guest idmapped, so virtiofsd serves the ids that namespace expects
/// ([`container_sees_root_in_its_user_namespace`]). Seen from outside the VM, through the share, the emptyDir file
/// the container made is the mapped id's; a container with a read-only rootfs starts too (the share makes its
/// mount points in the rootfs before it goes read-only); and stop and remove leave nothing.
async fn host_users_false_vm_pod(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = vm_sandboxer_env(test, vmm).await? else { return Ok(()) };
    let (cri, containerd, state_dir) = (&env.cri, &env.containerd, &env.state_dir);
    if skip_without_idmap(test, containerd.dir())? {
        return Ok(());
    }
    let mut pod = env.pod("userns-vm")?;
    with_pod_user_namespace(&mut pod)?;
    let pod_id = cri.run_pod_sandbox(&pod, "bulkhead-sandboxer").await.with_context(|| containerd.log_tail(60))?;
    let console = || {
        let log = bulkhead_integration::vm_env::console_log(state_dir.path(), &pod_id);
        format!("guest console:\n{}", std::fs::read_to_string(log).unwrap_or_default())
    };
    let c = start_userns_container(cri, containerd, &pod_id, &pod, "userns-vm-marker", false)
        .await
        .with_context(console)?;
    container_sees_root_in_its_user_namespace(cri, &c, "vm").await.with_context(console)?;
    // The share's copy of the emptyDir (one of the container's volumes) is the idmapped mount the guest sees.
    let volumes = state_dir.path().join(&pod_id).join("shared").join(&c.id).join("volumes");
    let shared = std::fs::read_dir(&volumes)?
        .flatten()
        .map(|v| v.path().join("made"))
        .find(|made| made.exists())
        .with_context(|| format!("no volume of {} holds the file", volumes.display()))?;
    use std::os::unix::fs::MetadataExt;
    let seen = std::fs::metadata(&shared)?;
    assert_eq!((seen.uid(), seen.gid()), (POD_HOST_ID, POD_HOST_ID), "through the share");
    // A read-only rootfs: the share makes its mount points in it, as the pod's root.
    let ro =
        start_userns_container(cri, containerd, &pod_id, &pod, "userns-vm-ro", true).await.with_context(console)?;
    let seen = sh_words(cri, &ro.id, "stat -c %u:%g /etc /data; touch /etc/x 2>/dev/null || echo read-only").await?;
    assert_eq!(seen, "0:0 0:0 read-only", "read-only rootfs");
    cri.stop_container(&ro.id, 10).await?;
    cri.remove_container(&ro.id).await?;

    cri.stop_container(&c.id, 10).await?;
    cri.remove_container(&c.id).await?;
    cri.stop_pod_sandbox(&pod_id).await?;
    cri.remove_pod_sandbox(&pod_id).await?;
    let within = Duration::from_secs(20);
    bulkhead_integration::host::eventually_nothing("mounts", within, || {
        bulkhead_integration::host::mounts_with(&state_dir.path().display().to_string())
    })
    .await?;
    bulkhead_integration::host::eventually_nothing("pod state", within, || {
        bulkhead_integration::host::state_left(state_dir.path())
    })
    .await
}

#[tokio::test]
async fn the_runc_runtime_runs_runc_1_3() -> Result<()> {
    let test = "the_runc_runtime_runs_runc_1_3";
    let Some(env) = setup(test, |_| vec![RuntimeHandler::runc()]).await? else { return Ok(()) };
    // containerd introspects runc's `features`: CRI user namespaces need its idmap mounts, which runc 1.1 lacks.
    let status = env.cri.status().await?;
    let runc = status.runtime_handlers.iter().find(|h| h.name == "runc").context("no runc handler in CRI Status")?;
    assert_eq!(runc.features.as_ref().map(|f| f.user_namespaces), Some(true), "{runc:?}");
    let out = Command::new(VERSION.runc().context("2.1 has a runc of its own")?).arg("--version").output()?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("runc version 1.3."), "{out:?}");
    Ok(())
}
