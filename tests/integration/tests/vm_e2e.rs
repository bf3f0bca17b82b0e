//! Full VM end to end: the `vm` backend with the real guest kernel, initramfs and agent, through a
//! private containerd and CRI. Each test runs on the QEMU stand-in (`bulkhead-qemu-vmm`, QEMU
//! under TCG in the VMM's place) on every host, and its `_on_bulkhead_vmm` twin runs the same on
//! `bulkhead-vmm` where the host probe says ordinary guests run (elsewhere the twin prints one
//! ledgered SKIPPED line). Any error fails them. The twenty-pod burst is in `vm_burst`, its own binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::guests::{self, GuestVmm};
use bulkhead_integration::host::{guest_memory_kib, processes_with};
use bulkhead_integration::images::{self, CONFORMANCE_BIN};
use bulkhead_integration::vm_env::{console_log, guest_kernel_faults, nothing_left, VmEnv, CONNECT_TIMEOUT_MS};
use bulkhead_integration::{container_config, ContainerdConfig, ContainerdVersion, Cri, RuntimeHandler, Setup};
use k8s_cri::v1 as cri;

const EXITED: i32 = cri::ContainerState::ContainerExited as i32;
const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;

/// The containerd these tests run on: this run's (`BULKHEAD_CONTAINERD`, default 1.6), or the one a
/// `*_on_containerd_<x>_<y>` twin binary, which compiles this same file, is named after.
fn containerd_version() -> ContainerdVersion {
    ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"))
}
/// What the QEMU stand-in says when its guest resets (a panic with `panic=1`).
const GUEST_RESET: &str = "the guest shut down (guest-reset)";

/// A container that runs until SIGTERM (then exits 0), after `first`.
fn long_running(name: &str, first: &str) -> cri::ContainerConfig {
    let script = format!("{first}; trap 'exit 0' TERM; while true; do sleep 0.2; done");
    container_config(name, &["sh", "-c", &script])
}

/// Host directory `dir` at /data in a container, as kubelet passes an emptyDir.
fn data_volume(dir: &Path, read_only: bool) -> cri::Mount {
    cri::Mount {
        container_path: "/data".into(),
        host_path: dir.display().to_string(),
        readonly: read_only,
        ..Default::default()
    }
}

#[tokio::test]
async fn vm_backend_pod_runs_and_execs() -> Result<()> {
    pod_runs_and_execs("vm_backend_pod_runs_and_execs", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_backend_pod_runs_and_execs_on_bulkhead_vmm() -> Result<()> {
    pod_runs_and_execs("vm_backend_pod_runs_and_execs_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

async fn pod_runs_and_execs(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, None).await? else {
        return Ok(());
    };
    let cri = &env.cri;
    let pod = env.pod("vm-e2e")?;
    let started = Instant::now();
    let pod_id = env.run_pod(&pod).await?;
    println!("{test}: RunPodSandbox took {:?}", started.elapsed());

    // Two containers share an emptyDir (kubelet passes it as a host directory): the writer
    // read-write, the reader read-only and with a read-only rootfs. The directory is a shared
    // mount, as kubelet's are on a systemd node.
    let empty_dir = bulkhead_integration::host::SharedDir::new()?;
    std::fs::create_dir(empty_dir.path().join("later"))?;
    let volume = |read_only| data_volume(empty_dir.path(), read_only);
    let mut writer = long_running("writer", "echo out-line; echo err-line >&2; echo from-writer > /data/f");
    writer.mounts = vec![volume(false)];
    let mut reader = long_running("reader", "true");
    reader.mounts = vec![volume(true)];
    if let Some(linux) = reader.linux.as_mut() {
        linux.security_context =
            Some(cri::LinuxContainerSecurityContext { readonly_rootfs: true, ..Default::default() });
    }
    let w = cri.create_container(&pod_id, &writer, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&w).await?;
    let r = cri.create_container(&pod_id, &reader, &pod).await?;
    cri.start_container(&r).await?;
    cri.wait_container(&r, Duration::from_secs(60), |s| s.state == RUNNING).await?;

    // The container runs on the guest kernel, not the host's.
    let started = Instant::now();
    let out = cri.exec_sync(&w, &["uname", "-r"], 30).await?;
    println!("{test}: first ExecSync took {:?}", started.elapsed());
    assert_eq!(out.exit_code, 0, "{out:?}");
    let guest_release = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_string();
    assert!(!guest_release.is_empty());
    assert_ne!(guest_release, host_release, "the container must run on the guest kernel, not the host's");
    // Its identity came from SetupSandbox: the guest's clock started at 1970 and is the host's now.
    let guest_now: i64 = run_in(cri, &w, &["date", "+%s"]).await?.trim().parse()?;
    let host_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
    assert!((guest_now - host_now).abs() < 120, "guest clock {guest_now}, host clock {host_now}");
    // The guest's boot phases as its console shows them (diagnosis only: TCG is not KVM).
    let console = console_log(env.state_dir.path(), &pod_id);
    let console = std::fs::read_to_string(&console).unwrap_or_default();
    for mark in ["Linux version", "Run /init", "left the initramfs", "listening (vsock)", "shared directory mounted"] {
        if let Some(line) = console.lines().find(|l| l.contains(mark)) {
            println!("{test}: console: {}", line.chars().take(120).collect::<String>());
        }
    }
    // The agent mounts the pod's share only at SetupSandbox: a VM that answers the agent protocol holds nothing of
    // any pod yet (what a template is snapshotted from).
    let at = |mark: &str| console.lines().position(|l| l.contains(mark));
    let (listening, mounted) = (at("listening (vsock)"), at("shared directory mounted"));
    assert!(listening.is_some() && mounted.is_some(), "console lacks the agent's marks:\n{console}");
    assert!(listening < mounted, "the share was mounted before the agent listened:\n{console}");
    // What the guest kernel, the agent and two idle containers use of the VM's memory (a figure
    // for runtimeclass/README.md's overhead terms, not a check).
    let meminfo = run_in(cri, &w, &["cat", "/proc/meminfo"]).await?;
    let kib = |key: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(key)).unwrap_or_default();
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    println!(
        "{test}: guest memory in use: {} MiB of {} MiB (MemTotal - MemAvailable)",
        kib("MemTotal:").saturating_sub(kib("MemAvailable:")) / 1024,
        kib("MemTotal:") / 1024
    );

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

    // A mount made on the host under the volume after the pod started (another pod's secret
    // tmpfs under kubelet's directory, say) does not reach the pod: its binds are private.
    let later = bulkhead_integration::host::LaterMount::new(&empty_dir.path().join("later"))?;
    for (id, who) in [(&w, "writer"), (&r, "reader")] {
        let script = "cat /data/later/secret; echo planted > /data/later/planted";
        let out = cri.exec_sync(id, &["sh", "-c", script], 10).await?;
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("host-secret"),
            "the {who} sees the later mount: {out:?}"
        );
    }
    assert!(!empty_dir.path().join("later/planted").exists(), "the pod wrote into a mount made after it started");
    drop(later);

    // Read-only stays read-only inside the guest: the reader's rootfs and its view of the volume.
    for path in ["/rootfs-write", "/data/reader-write"] {
        let out = cri.exec_sync(&r, &["touch", path], 10).await?;
        assert_ne!(out.exit_code, 0, "{path} must not be writable: {out:?}");
    }
    assert!(!empty_dir.path().join("reader-write").exists());

    // Exit codes and logs reach CRI.
    let out = cri.exec_sync(&w, &["sh", "-c", "exit 7"], 10).await?;
    assert_eq!(out.exit_code, 7);
    let three = cri.create_container(&pod_id, &container_config("three", &["sh", "-c", "exit 3"]), &pod).await?;
    cri.start_container(&three).await?;
    let status = cri.wait_container(&three, Duration::from_secs(60), |s| s.state == EXITED).await?;
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
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

/// containerd's default spec (`ctr oci spec`), with what containerd on a node with AppArmor,
/// cgroup v2 and a hugetlb controller adds to every container: an AppArmor profile, a cgroup
/// namespace and kubelet's hugepage limits of 0 for each size the node has. This host has none of
/// the three (containerd drops the limits when the host has no hugetlb controller), so the test
/// hands them to containerd as the handler's base spec.
fn base_spec_of_an_ordinary_node() -> Result<serde_json::Value> {
    let out = std::process::Command::new(containerd_version().ctr())
        .args(["oci", "spec"])
        .output()
        .context("ctr oci spec")?;
    if !out.status.success() {
        bail!("ctr oci spec: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut spec: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    spec["process"]["apparmorProfile"] = "cri-containerd.apparmor.d".into();
    let namespaces = spec["linux"]["namespaces"].as_array_mut().context("linux.namespaces")?;
    namespaces.push(serde_json::json!({"type": "cgroup"}));
    spec["linux"]["resources"]["hugepageLimits"] =
        serde_json::json!([{"pageSize": "2MB", "limit": 0}, {"pageSize": "1GB", "limit": 0}]);
    Ok(spec)
}

#[tokio::test]
async fn vm_guest_runs_what_ordinary_pods_need() -> Result<()> {
    guest_conformance("vm_guest_runs_what_ordinary_pods_need", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_guest_runs_what_ordinary_pods_need_on_bulkhead_vmm() -> Result<()> {
    guest_conformance("vm_guest_runs_what_ordinary_pods_need_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// What kubelet and ordinary programs expect of a pod, in a container of a vm pod.
async fn guest_conformance(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, Some(base_spec_of_an_ordinary_node()?)).await? else {
        return Ok(());
    };
    // Many steps, any of which may fail far from the shim's reason: the log comes with the error.
    let checked = conformance_checks(&env).await;
    checked.with_context(|| format!("containerd's log (with the shim's), last lines:\n{}", env.containerd.log_tail(80)))
}

async fn conformance_checks(env: &VmEnv) -> Result<()> {
    let cri = &env.cri;
    let mut pod = env.pod("vm-conformance")?;
    // One pod sysctl from each namespaced group: IPC (kernel.shm*, kernel.msg*, kernel.sem),
    // POSIX message queues (fs.mqueue.*), network (net.*).
    let sysctls = [
        ("kernel.shm_rmid_forced", "1"),
        ("kernel.msgmax", "16384"),
        ("kernel.sem", "250\t32000\t32\t200"),
        ("fs.mqueue.msg_max", "20"),
        ("net.ipv4.ping_group_range", "0\t2147483647"),
    ];
    pod.linux.as_mut().unwrap().sysctls = sysctls.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let pod_id = env.run_pod(&pod).await?;

    // An init container that exits, then the app container, which sees what it left.
    let empty_dir = tempfile::tempdir()?;
    let data = data_volume(empty_dir.path(), false);
    let mut init = container_config("init", &["sh", "-c", "echo from-init > /data/init"]);
    init.mounts = vec![data.clone()];
    let init = cri.create_container(&pod_id, &init, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&init).await?;
    let status = cri.wait_container(&init, Duration::from_secs(60), |s| s.state == EXITED).await?;
    assert_eq!(status.exit_code, 0, "the init container: {status:?}");

    let mut app = long_running("app", "true");
    app.mounts = vec![data];
    let app = cri.create_container(&pod_id, &app, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    assert_eq!(sh_in(cri, &app, "cat /data/init").await?, "from-init\n");

    // flock, System V IPC, POSIX message queues, inotify, /dev/shm and friends, for real.
    let report = run_in(cri, &app, &[CONFORMANCE_BIN]).await?;
    for check in ["flock", "sysv_shm", "sysv_msg", "sysv_sem", "posix_mq", "inotify", "dev_shm", "madvise"] {
        assert!(report.lines().any(|l| l == format!("ok {check}")), "{check} missing from:\n{report}");
    }

    for (key, value) in sysctls {
        let got = sh_in(cri, &app, &format!("cat /proc/sys/{}", key.replace('.', "/"))).await?;
        assert_eq!(got.trim_end(), value, "pod sysctl {key}");
    }

    // Its own cgroup namespace: the container's cgroup is the root of what it sees, and the
    // hugepage limits are applied there.
    assert_eq!(sh_in(cri, &app, "cat /proc/self/cgroup").await?, "0::/\n");
    let hugetlb = sh_in(cri, &app, "cat /sys/fs/cgroup/hugetlb.2MB.max").await?;
    assert_eq!(hugetlb.trim(), "0", "the 2MB hugepage limit");

    // The spec carried an AppArmor profile, which the guest cannot apply: the shim says so.
    let log = std::fs::read_to_string(env.containerd.log_path())?;
    assert!(log.contains("the guest kernel has no LSM"), "no word of the dropped apparmorProfile in containerd's log");

    // A container running as a non-root user.
    let mut nobody = long_running("nobody", "true");
    nobody.linux.as_mut().unwrap().security_context = Some(cri::LinuxContainerSecurityContext {
        run_as_user: Some(cri::Int64Value { value: 65534 }),
        ..Default::default()
    });
    let nobody = cri.create_container(&pod_id, &nobody, &pod).await?;
    cri.start_container(&nobody).await?;
    let out = cri.exec_sync(&nobody, &["id", "-u"], 30).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "65534\n", "{out:?}");

    // CRI ContainerStats with the guest's real figures.
    sh_in(cri, &app, "dd if=/dev/zero of=/dev/null bs=1M count=64").await?;
    let stats = cri.container_stats(&app).await?;
    let memory = stats.memory.and_then(|m| m.working_set_bytes).map(|v| v.value).unwrap_or(0);
    let cpu = stats.cpu.and_then(|c| c.usage_core_nano_seconds).map(|v| v.value).unwrap_or(0);
    assert!(memory > 0 && cpu > 0, "ContainerStats: working set {memory} B, cpu {cpu} ns");

    for c in [&app, &nobody] {
        cri.stop_container(c, 10).await?;
    }
    for c in [&init, &app, &nobody] {
        cri.remove_container(c).await?;
    }
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

#[tokio::test]
async fn vm_pod_lives_in_kubelets_systemd_slice() -> Result<()> {
    systemd_slice("vm_pod_lives_in_kubelets_systemd_slice", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_pod_lives_in_kubelets_systemd_slice_on_bulkhead_vmm() -> Result<()> {
    systemd_slice("vm_pod_lives_in_kubelets_systemd_slice_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// With the systemd cgroup driver (EKS, kubeadm) kubelet makes the pod's slice with the pod's
/// limit on it and containerd names the sandbox `<slice>:cri-containerd:<id>`: the pod's host
/// processes (the VMM, virtiofsd) live in the sandbox's scope in that slice, are charged to it,
/// and, where systemd is PID 1 (the emulated node, an AL2023 node), the scope is systemd's
/// transient unit in kubelet's slice, as runc's systemd driver leaves it.
async fn systemd_slice(test: &str, vmm: GuestVmm) -> Result<()> {
    use bulkhead_integration::cgroups;
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, None).await? else {
        return Ok(());
    };
    let uid = format!("vm{}x{}", std::process::id(), Instant::now().elapsed().subsec_nanos());
    let kubelet = cgroups::KubeletPodCgroup::systemd_slice(&uid)?;
    let limit = 2u64 << 30;
    for file in ["memory.limit_in_bytes", "memory.max"] {
        kubelet.set(file, &limit.to_string())?;
    }
    let mut pod = env.pod("vm-slice")?;
    pod.linux.as_mut().unwrap().cgroup_parent = kubelet.cri_parent.clone();
    let pod_id = env.run_pod(&pod).await?;
    let scope = format!("{}/cri-containerd-{pod_id}.scope", kubelet.path);
    let state = env.state_dir.path().display().to_string();
    let helpers: Vec<(u32, String)> = processes_with(&state)
        .into_iter()
        .filter(|(_, cmd)| cmd.contains("vmm") || cmd.contains("virtiofsd"))
        .collect();
    assert!(helpers.iter().any(|(_, c)| c.contains("virtiofsd")), "no virtiofsd of the pod: {helpers:?}");
    assert!(helpers.iter().any(|(_, c)| c.contains("vmm")), "no VMM of the pod: {helpers:?}");
    for (pid, cmd) in &helpers {
        assert_eq!(cgroups::of_pid(*pid), Some(scope.clone()), "the cgroup of {pid} {cmd}");
    }
    if let Some(unit) = kubelet.systemd_scope_of(&pod_id)? {
        println!("{test}: {unit} is systemd's, in {}", kubelet.cri_parent);
    }
    // A container runs, and the guest's memory is charged to kubelet's slice.
    let ctr = env.cri.create_container(&pod_id, &long_running("app", "true"), &pod).await?;
    env.cri.start_container(&ctr).await?;
    env.cri.wait_container(&ctr, Duration::from_secs(120), |s| s.state == RUNNING).await?;
    let charged = kubelet.memory_charged().context("the slice's memory usage")?;
    assert!(charged > 0 && charged < limit, "the slice accounts the pod: {charged} bytes of {limit}");
    env.remove_pod_and_check_nothing_left(&pod_id).await?;
    bulkhead_integration::host::eventually_nothing("the pod's scope", Duration::from_secs(15), || {
        cgroups::existing(&scope)
    })
    .await?;
    assert!(kubelet.dirs().iter().all(|d| d.exists()), "kubelet's slice stays kubelet's");
    Ok(())
}

#[tokio::test]
async fn vm_container_sees_its_own_cgroup_and_memory_limit() -> Result<()> {
    own_cgroup("vm_container_sees_its_own_cgroup_and_memory_limit", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_container_sees_its_own_cgroup_and_memory_limit_on_bulkhead_vmm() -> Result<()> {
    own_cgroup("vm_container_sees_its_own_cgroup_and_memory_limit_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// With containerd's own spec, which on this cgroup v1 host has no cgroup namespace, a vm pod's
/// container still gets what runc gives it on a cgroup v2 node (the guest always is one): its
/// cgroup is the root of what it sees, and /sys/fs/cgroup shows its own limits, which follow an
/// UpdateContainerResources. Runtimes that size themselves from `memory.max` need both. A resize
/// beyond the VM's size is refused (`shim/src/sandbox/vm/resize.rs`).
async fn own_cgroup(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, None).await? else {
        return Ok(());
    };
    let cri = &env.cri;
    let pod = env.pod("vm-cgroup")?;
    let pod_id = env.run_pod(&pod).await?;

    // The container's own process writes what it sees, so not only execs are checked.
    let mut app = long_running("app", "cat /proc/self/cgroup > /cgroup-of-init");
    let limit: i64 = 64 << 20;
    app.linux.as_mut().unwrap().resources =
        Some(cri::LinuxContainerResources { memory_limit_in_bytes: limit, ..Default::default() });
    let app = cri.create_container(&pod_id, &app, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;

    assert_eq!(sh_in(cri, &app, "cat /proc/self/cgroup").await?, "0::/\n", "an exec's cgroup");
    let mut of_init = String::new();
    for _ in 0..100 {
        of_init = sh_in(cri, &app, "cat /cgroup-of-init 2>/dev/null || true").await?;
        if !of_init.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(of_init, "0::/\n", "the container process's cgroup");
    let memory_max = || sh_in(cri, &app, "cat /sys/fs/cgroup/memory.max");
    assert_eq!(memory_max().await?.trim(), limit.to_string(), "memory.max at create");

    let raised: i64 = 96 << 20;
    cri.update_container_resources(
        &app,
        cri::LinuxContainerResources { memory_limit_in_bytes: raised, ..Default::default() },
    )
    .await?;
    assert_eq!(memory_max().await?.trim(), raised.to_string(), "memory.max after UpdateContainerResources");

    // A resize the VM cannot hold (it keeps its boot size) is refused, naming the size and the
    // setting behind it, and the container keeps its limits and runs on.
    for (beyond, names) in [
        (cri::LinuxContainerResources { memory_limit_in_bytes: 64 << 30, ..Default::default() }, "vm.memory_mib"),
        (cri::LinuxContainerResources { cpu_period: 100_000, cpu_quota: 3_300_000, ..Default::default() }, "vm.vcpus"),
    ] {
        let err = cri.update_container_resources(&app, beyond).await.expect_err("a resize beyond the VM").to_string();
        assert!(err.contains("does not grow beyond") && err.contains(names), "{err}");
    }
    assert_eq!(memory_max().await?.trim(), raised.to_string(), "memory.max after the refused resizes");
    assert_eq!(cri.container_status(&app).await?.state, RUNNING, "the container after the refused resizes");

    cri.stop_container(&app, 10).await?;
    cri.remove_container(&app).await?;
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

#[tokio::test]
async fn vm_pod_vcpus_follow_a_cpu_resize() -> Result<()> {
    vcpus_follow_a_resize("vm_pod_vcpus_follow_a_cpu_resize", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_pod_vcpus_follow_a_cpu_resize_on_bulkhead_vmm() -> Result<()> {
    vcpus_follow_a_resize("vm_pod_vcpus_follow_a_cpu_resize_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// In-place resize of a vm pod's CPU: with `vm.max_vcpus = 2` its VM boots two vCPUs and keeps
/// one online (the pod's: containerd 1.6 passes no pod-level limit, so `vm.vcpus`, 1). A resize
/// of its one container to 2 CPUs brings the second online, so `nproc` inside says 2; back to 1
/// takes it offline again; 3 is more than the VM has and is refused, naming `vm.max_vcpus`.
async fn vcpus_follow_a_resize(test: &str, vmm: GuestVmm) -> Result<()> {
    in_vm_env_watched(test, vmm, "max_vcpus = 2\n", vcpus_follow_a_resize_in).await
}

/// Runs `body` in a fresh [`VmEnv`] with `vm_settings`. In the emulated node, where a guest sometimes stops on
/// the emulator's vCPU fault (two-vCPU guests most often), a failure that `node_kvm`'s watch tells apart as that
/// fault is retried once; any other failure is the test's.
async fn in_vm_env_watched(
    test: &str,
    vmm: GuestVmm,
    vm_settings: &str,
    body: impl AsyncFn(&VmEnv) -> Result<()>,
) -> Result<()> {
    bulkhead_integration::node_kvm::retry_emulator_fault(test, || async {
        let watch = bulkhead_integration::node_kvm::FaultWatch::start();
        let Some(env) = VmEnv::start_with_vm_settings(test, containerd_version(), vmm, vm_settings).await? else {
            return Ok(());
        };
        // Classified while the VM may still run: the environment goes only after this.
        body(&env).await.map_err(|e| watch.classify(e))
    })
    .await
}

async fn vcpus_follow_a_resize_in(env: &VmEnv) -> Result<()> {
    let cri = &env.cri;
    let pod = env.pod("vm-vcpus")?;
    let pod_id = env.run_pod(&pod).await?;
    let cpus =
        |n: i64| cri::LinuxContainerResources { cpu_period: 100_000, cpu_quota: n * 100_000, ..Default::default() };
    let mut app = long_running("app", "true");
    app.linux.as_mut().unwrap().resources = Some(cpus(1));
    let app = cri.create_container(&pod_id, &app, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    let nproc = || sh_in(cri, &app, "nproc; cat /sys/devices/system/cpu/online");
    assert_eq!(nproc().await?, "1\n0\n", "one of the two vCPUs online at the start");

    cri.update_container_resources(&app, cpus(2)).await.with_context(|| env.containerd.log_tail(40))?;
    assert_eq!(nproc().await?, "2\n0-1\n", "after a resize to 2 CPUs");
    assert_eq!(sh_in(cri, &app, "cat /sys/fs/cgroup/cpu.max").await?, "200000 100000\n");

    let err = cri.update_container_resources(&app, cpus(3)).await.expect_err("3 CPUs in a 2-vCPU VM").to_string();
    assert!(err.contains("2 vCPUs") && err.contains("vm.max_vcpus"), "{err}");
    assert_eq!(nproc().await?, "2\n0-1\n", "the refused resize changed nothing");

    cri.update_container_resources(&app, cpus(1)).await?;
    assert_eq!(nproc().await?, "1\n0\n", "after a resize back to 1 CPU");
    // In the node, the fault detector works (KVM's trace, the node's symbols) and finds none in a guest that answers.
    let fault = bulkhead_integration::node_kvm::emulator_fault()?;
    assert!(fault.is_none(), "a vCPU of a guest that answers is stuck: {fault:?}");

    cri.stop_container(&app, 10).await?;
    assert_eq!(cri.container_status(&app).await?.exit_code, 0, "the TERM trap exits 0");
    cri.remove_container(&app).await?;
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

#[tokio::test]
async fn vm_pod_memory_follows_a_resize() -> Result<()> {
    memory_follows_a_resize("vm_pod_memory_follows_a_resize", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_pod_memory_follows_a_resize_on_bulkhead_vmm() -> Result<()> {
    memory_follows_a_resize("vm_pod_memory_follows_a_resize_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// In-place resize of a vm pod's memory: with `vm.max_memory_mib = 512` its VM has 512 MiB and
/// its balloon holds all but the pod's 256 (`vm.memory_mib`: containerd 1.6 passes no pod-level
/// limit). Its container, limited to 64 MiB, is OOM-killed allocating 150; resized to 200 MiB,
/// the balloon gives the guest that much more, and the same allocation succeeds; 600 MiB is more
/// than the VM has and is refused, naming `vm.max_memory_mib`; back to 64 MiB, the balloon takes
/// the memory back from the guest, and the host memory its guest RAM holds (the memfd's pages,
/// not the VMM's RSS: see `guest_memory_kib`) falls by at least 64 of the 150 MiB a container held
/// in the pod's shm and then freed.
async fn memory_follows_a_resize(test: &str, vmm: GuestVmm) -> Result<()> {
    in_vm_env_watched(test, vmm, "max_memory_mib = 512\n", async |env| memory_follows_a_resize_in(test, env).await)
        .await
}

async fn memory_follows_a_resize_in(test: &str, env: &VmEnv) -> Result<()> {
    let cri = &env.cri;
    let pod = env.pod("vm-memory")?;
    let pod_id = env.run_pod(&pod).await?;
    let memory = |mib: i64| cri::LinuxContainerResources { memory_limit_in_bytes: mib << 20, ..Default::default() };
    let mut app = long_running("app", "true");
    app.linux.as_mut().unwrap().resources = Some(memory(64));
    let app = cri.create_container(&pod_id, &app, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    // The guest's MemTotal less what its kernel keeps: the balloon's pages leave MemTotal.
    let total_mib = || async {
        let text = sh_in(cri, &app, "grep MemTotal /proc/meminfo").await?;
        let kib: u64 = text.split_whitespace().nth(1).and_then(|v| v.parse().ok()).context("MemTotal")?;
        anyhow::Ok(kib >> 10)
    };
    // The driver inflates on its own time: a minute, however slow the guest's execs are.
    let until = |what: &'static str, ok: fn(u64) -> bool| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let last = total_mib().await?;
            if ok(last) {
                return anyhow::Ok(last);
            }
            if Instant::now() > deadline {
                bail!("{what}: MemTotal stayed at {last} MiB");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    until("the balloon holding the VM's memory beyond the pod's", |m| m <= 256).await?;
    let allocate = "dd if=/dev/zero of=/dev/null bs=150M count=1 2>/dev/null; echo dd-exit=$?";
    assert_eq!(sh_in(cri, &app, allocate).await?, "dd-exit=137\n", "150 MiB under a 64 MiB limit");

    cri.update_container_resources(&app, memory(200)).await.with_context(|| env.containerd.log_tail(40))?;
    let grown = total_mib().await?;
    assert!(grown >= 400, "the guest after a resize to 200 MiB (+256 for itself): MemTotal {grown} MiB");
    assert_eq!(sh_in(cri, &app, allocate).await?, "dd-exit=0\n", "150 MiB under a 200 MiB limit");
    // 150 MiB the container holds (a file in the pod's shm: guest memory), so resident on the host; then freed.
    // The host may get freed pages back before the resize (free page reporting); after it, they must be back.
    let vmm_pid: u32 =
        std::fs::read_to_string(env.state_dir.path().join(&pod_id).join("vm/vmm.pid"))?.trim().parse()?;
    let held_mib = || anyhow::Ok(guest_memory_kib(vmm_pid)? >> 10);
    assert_eq!(sh_in(cri, &app, "head -c 157286400 /dev/zero > /dev/shm/held && echo held").await?, "held\n");
    let touched = held_mib()?;
    assert!(touched >= 150, "the VM's guest memory on the host while 150 MiB are held: {touched} MiB");
    assert_eq!(sh_in(cri, &app, "rm /dev/shm/held && echo freed").await?, "freed\n");

    let err = cri.update_container_resources(&app, memory(600)).await.expect_err("600 MiB in a 512 MiB VM").to_string();
    assert!(err.contains("256 MiB for its containers") && err.contains("vm.max_memory_mib"), "{err}");

    cri.update_container_resources(&app, memory(64)).await?;
    until("the balloon taking back what the guest no longer needs", |m| m <= 320).await?;
    // The pages the balloon took go back to the host: the VM's resident memory falls.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = held_mib()?;
        if now + 64 <= touched {
            println!("{test}: the VM's guest memory on the host fell from {touched} MiB to {now} MiB (first reading 64 below)");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the VM's guest memory on the host after the resize down: {now} MiB, {touched} before"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(sh_in(cri, &app, "echo still-here").await?, "still-here\n", "nothing within 64 MiB was killed");

    cri.stop_container(&app, 10).await?;
    assert_eq!(cri.container_status(&app).await?.exit_code, 0, "the TERM trap exits 0");
    cri.remove_container(&app).await?;
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

#[tokio::test]
async fn vm_containers_come_and_go_cycle_after_cycle() -> Result<()> {
    containers_come_and_go("vm_containers_come_and_go_cycle_after_cycle", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_containers_come_and_go_cycle_after_cycle_on_bulkhead_vmm() -> Result<()> {
    containers_come_and_go("vm_containers_come_and_go_cycle_after_cycle_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

/// Containers that come and go as the ones above do: two sharing an emptyDir, each running a shell
/// that starts `sleep` every 0.2 s, stopped by SIGTERM and removed at once, cycle after cycle. Each
/// container's rootfs and volume are host mounts, so virtio-fs submounts in the guest that go with
/// it, while a RELEASE its processes left may still be in flight. Debian's 6.12 then poisoned the
/// busy inode and the RELEASE's reply oopsed the guest's virtio-fs worker, which hung every later
/// request of the pod's share (guest-kernel/patches/0001-*; in the emulated node 4 of 10 runs of the
/// test above). The guest kernel must say nothing of it and the pod must still serve.
async fn containers_come_and_go(test: &str, vmm: GuestVmm) -> Result<()> {
    const CYCLES: usize = 3;
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, None).await? else {
        return Ok(());
    };
    let cri = &env.cri;
    let pod = env.pod("vm-churn")?;
    let pod_id = env.run_pod(&pod).await?;
    let keeper = cri.create_container(&pod_id, &long_running("keeper", "true"), &pod).await?;
    cri.start_container(&keeper).await?;
    let empty_dir = bulkhead_integration::host::SharedDir::new()?;
    for i in 0..CYCLES {
        let mut ids = vec![];
        for (name, read_only) in [("a", false), ("b", true)] {
            let mut c = long_running(&format!("churn-{name}-{i}"), "cat /bin/bulkhead-conformance >/dev/null");
            c.mounts = vec![data_volume(empty_dir.path(), read_only)];
            let id = cri.create_container(&pod_id, &c, &pod).await?;
            cri.start_container(&id).await?;
            ids.push(id);
        }
        for id in &ids {
            cri.wait_container(id, Duration::from_secs(60), |s| s.state == RUNNING).await?;
            run_in(cri, id, &["ls", "/data"]).await?;
        }
        for id in &ids {
            cri.stop_container(id, 10).await?;
            assert_eq!(cri.container_status(id).await?.exit_code, 0, "cycle {i}: the TERM trap exits 0");
        }
        for id in &ids {
            cri.remove_container(id).await?;
        }
    }
    assert_eq!(run_in(cri, &keeper, &["echo", "still-serving"]).await?.trim(), "still-serving");
    let faults = guest_kernel_faults(env.state_dir.path(), &pod_id)?;
    assert!(faults.is_empty(), "the guest kernel faulted as containers came and went: {faults:#?}");

    cri.stop_container(&keeper, 10).await?;
    assert_eq!(cri.container_status(&keeper).await?.exit_code, 0, "the TERM trap exits 0");
    cri.remove_container(&keeper).await?;
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

/// Two static binaries whose text shares addresses (busybox and the conformance binary, both
/// linked at 0x400000), run one after the other, each read anew over virtio-fs (`--cache auto`
/// drops a file's pages on open). On the stand-in a page virtiofsd refilled once ran the code TCG
/// had translated from its old contents: one of them segfaulted within 45 runs, 3 of 3 tries,
/// until the stand-in zeroed freed pages (`standin::qemu`). Stand-in only: KVM keeps no
/// translated code, and a loop this long takes minutes in the emulated node.
#[tokio::test]
async fn binaries_read_over_virtio_fs_run_as_they_are() -> Result<()> {
    const RUNS: usize = 100;
    let test = "binaries_read_over_virtio_fs_run_as_they_are";
    let Some(env) = VmEnv::start(test, containerd_version(), GuestVmm::QemuStandIn, None).await? else {
        return Ok(());
    };
    let cri = &env.cri;
    let pod = env.pod("vm-reread")?;
    let pod_id = env.run_pod(&pod).await?;
    let app = cri.create_container(&pod_id, &long_running("app", "true"), &pod).await?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;
    // The conformance binary exits 1 on a check the default container lacks; a signal is >128.
    let script = format!(
        "for i in $(seq {RUNS}); do {CONFORMANCE_BIN} >/dev/null 2>&1; r=$?; \
         if [ $r -gt 1 ]; then echo \"run $i: $r\"; fi; done; echo done"
    );
    let out = cri.exec_sync(&app, &["sh", "-c", &script], 300).await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let console = std::fs::read_to_string(console_log(env.state_dir.path(), &pod_id))?;
    let crashes: Vec<&str> = console.lines().filter(|l| l.contains("segfault at") || l.contains("traps:")).collect();
    assert!(out.exit_code == 0 && text == "done\n", "{RUNS} runs of {CONFORMANCE_BIN}: exit {}: {text}", out.exit_code);
    assert!(crashes.is_empty(), "the guest's processes crashed: {crashes:#?}");
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

/// The guest is root in its VM, and a privileged container there may create device nodes, but
/// only on the guest's own filesystems: through virtio-fs they would be real nodes on the host's
/// disk (here in the container's writable layer), which any host process that later opens them
/// would take for the host's devices. virtiofsd runs without CAP_MKNOD, so the host refuses them;
/// a FIFO needs no capability and still works. The VMM plays no part (virtiofsd serves the share
/// the same for both), so this test has no `_on_bulkhead_vmm` twin.
#[tokio::test]
async fn a_guest_creates_no_device_node_on_the_hosts_disk() -> Result<()> {
    let test = "a_guest_creates_no_device_node_on_the_hosts_disk";
    let vmm = GuestVmm::QemuStandIn;
    let Some(env) = VmEnv::start(test, containerd_version(), vmm, None).await? else {
        return Ok(());
    };
    let cri = &env.cri;
    let mut pod = env.pod("vm-mknod")?;
    pod.linux.as_mut().unwrap().security_context.as_mut().unwrap().privileged = true;
    let pod_id = env.run_pod(&pod).await?;
    let mut app = long_running("app", "true");
    app.linux.as_mut().unwrap().security_context =
        Some(cri::LinuxContainerSecurityContext { privileged: true, ..Default::default() });
    let app = cri.create_container(&pod_id, &app, &pod).await.with_context(|| env.containerd.log_tail(40))?;
    cri.start_container(&app).await?;
    cri.wait_container(&app, Duration::from_secs(60), |s| s.state == RUNNING).await?;

    // In the guest's own /dev (a tmpfs of the guest's), a device node is the guest's business.
    assert_eq!(sh_in(cri, &app, "mknod /dev/bh-guest-disk b 8 0 && echo made").await?, "made\n");
    // On the rootfs, which the host serves, block and character devices are refused.
    let script = "mknod /bh-disk b 8 0; echo disk=$?; mknod /bh-mem c 1 1; echo mem=$?; mkfifo /bh-fifo; echo fifo=$?";
    let out = cri.exec_sync(&app, &["sh", "-c", script], 30).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stdout.contains("disk=0") && !stdout.contains("mem=0"), "a device node was made: {stdout}{stderr}");
    assert!(stdout.contains("fifo=0"), "a FIFO is not a device: {stdout}{stderr}");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
    // And the host's side of the share holds the FIFO, and no device node.
    let pod_dir = env.state_dir.path().join(&pod_id);
    let fifo = find_file(&pod_dir, "bh-fifo", 6).context("the FIFO is not in the pod's share on the host")?;
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)?.file_type().is_fifo(), "{}", fifo.display());
    for node in ["bh-disk", "bh-mem"] {
        assert!(find_file(&pod_dir, node, 6).is_none(), "{node} exists on the host");
    }

    cri.stop_container(&app, 10).await?;
    cri.remove_container(&app).await?;
    env.remove_pod_and_check_nothing_left(&pod_id).await
}

/// `cmd` in container `id`; its output (stdout, then stderr) when it exits 0, else an error.
async fn run_in(cri: &Cri, id: &str, cmd: &[&str]) -> Result<String> {
    let out = cri.exec_sync(id, cmd, 30).await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.exit_code != 0 {
        bail!("{cmd:?} exited {}: {text}", out.exit_code);
    }
    Ok(text)
}

/// `script` run by `sh -c` in container `id`, as [`run_in`].
async fn sh_in(cri: &Cri, id: &str, script: &str) -> Result<String> {
    run_in(cri, id, &["sh", "-c", script]).await
}

/// What a failed-boot test does on the host while RunPodSandbox runs.
#[derive(Clone, Copy)]
enum Meddling {
    None,
    /// Once the console shows this line, stop (SIGSTOP) the stand-in's `vhost-device-vsock`: a
    /// vhost-user backend that does not answer holds QEMU after its guest resets (measured with
    /// QEMU 7.2), the hang the stand-in's shutdown watch ends.
    StopVsockBackendAfter(&'static str),
}

/// RunPodSandbox with a guest whose `/init` is what `init` writes (into the directory it is
/// given), on `vmm`: must fail with the VM's exit (not the agent's connect timeout), quoting the
/// console, and the VMM must say `vmm_says`. Returns the error text; `None` (after one `SKIPPED`
/// line) when `test` cannot run here.
async fn failed_boot(
    test: &str,
    vmm: GuestVmm,
    init: impl FnOnce(&Path) -> Result<PathBuf>,
    meddling: Meddling,
    vmm_says: &str,
) -> Result<Option<String>> {
    let Some(setup) = Setup::new(test, containerd_version(), &["containerd-shim-bulkhead-v2"])? else {
        return Ok(None);
    };
    if vmm.skip(test) {
        return Ok(None);
    }
    let (kernel, _) = guests::kernel_and_initramfs()?;
    let init = init(setup.config_dir())?;
    let initramfs = setup.config_dir().join("initramfs.cpio.gz");
    guests::initramfs_with(&init, &initramfs)?;
    let cfg = setup.write_config(
        "bulkhead.toml",
        &guests::vm_config(setup.state(), CONNECT_TIMEOUT_MS, vmm, &kernel, &initramfs),
    )?;
    let env = setup
        .start(ContainerdConfig { handlers: vec![RuntimeHandler::bulkhead(Some(&cfg))], ..Default::default() })
        .await?;
    let (cri, containerd, state_dir) = (&env.cri, &env.containerd, &env.state_dir);
    let pod = env.pod(test)?;
    let started = Instant::now();
    let (ran, meddled) = tokio::join!(cri.run_pod_sandbox(&pod, "bulkhead"), meddle(state_dir.path(), meddling));
    let err = match ran {
        Ok(id) => bail!("pod {id} started with a guest that cannot boot"),
        Err(e) => format!("{e:#}"),
    };
    let took = started.elapsed();
    meddled?;
    println!("{test}: RunPodSandbox failed after {took:?}: {err}");
    // The VM's exit ends the wait, not the agent's connect timeout. The failure carries
    // containerd's log, where the shim relays the VMM's own lines.
    assert!(
        err.contains("before the agent answered"),
        "the failure was not the VM's exit ({took:?}); containerd's log:\n{}",
        containerd.log_tail(120)
    );
    // The VMM's own lines reach containerd's log through the shim, which may lag a little.
    let until = Instant::now() + Duration::from_secs(10);
    while !containerd.log_tail(400).contains(vmm_says) {
        if Instant::now() >= until {
            bail!("{} never said {vmm_says:?}; containerd's log:\n{}", vmm.name(), containerd.log_tail(120));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = containerd.log_tail(400);
    println!("{test}: {}", log.lines().find(|l| l.contains(vmm_says)).unwrap_or_default());
    nothing_left(state_dir.path()).await?;
    Ok(Some(err))
}

/// Does what `meddling` says to the VM under `state_dir`, within the connect timeout.
async fn meddle(state_dir: &Path, meddling: Meddling) -> Result<()> {
    let Meddling::StopVsockBackendAfter(line) = meddling else { return Ok(()) };
    let until = Instant::now() + Duration::from_millis(CONNECT_TIMEOUT_MS);
    let state = state_dir.display().to_string();
    loop {
        let console = find_file(state_dir, "console.log", 4);
        if console.and_then(|c| std::fs::read_to_string(c).ok()).is_some_and(|text| text.contains(line)) {
            break;
        }
        if Instant::now() >= until {
            bail!("the console never showed {line:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // This test's own backend: its command line names this test's state directory.
    let backends: Vec<u32> = processes_with(&state)
        .into_iter()
        .filter(|(_, cmdline)| cmdline.contains("vhost-device-vsock"))
        .map(|(pid, _)| pid)
        .collect();
    let [pid] = backends[..] else { bail!("want one vhost-device-vsock under {state}, found {backends:?}") };
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).context("SIGSTOP vhost-device-vsock")?;
    Ok(())
}

/// The first file called `name` at most `depth` directories below `dir`.
fn find_file(dir: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if entry.file_name() == name {
            return Some(path);
        }
        if depth > 0 && entry.file_type().is_ok_and(|t| t.is_dir()) {
            if let Some(found) = find_file(&path, name, depth - 1) {
                return Some(found);
            }
        }
    }
    None
}

/// What each VMM says when its guest resets: the stand-in, and `bulkhead-vmm`'s exit line.
fn guest_reset_line(vmm: GuestVmm) -> &'static str {
    match vmm {
        GuestVmm::QemuStandIn => GUEST_RESET,
        GuestVmm::Bulkhead => "reason=GuestReset",
    }
}

#[tokio::test]
async fn a_guest_kernel_that_panics_at_boot_fails_the_pod_with_the_console_tail() -> Result<()> {
    kernel_panic("a_guest_kernel_that_panics_at_boot_fails_the_pod_with_the_console_tail", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn a_guest_kernel_that_panics_at_boot_fails_the_pod_with_the_console_tail_on_bulkhead_vmm() -> Result<()> {
    let test = "a_guest_kernel_that_panics_at_boot_fails_the_pod_with_the_console_tail_on_bulkhead_vmm";
    kernel_panic(test, GuestVmm::Bulkhead).await
}

async fn kernel_panic(test: &str, vmm: GuestVmm) -> Result<()> {
    // An /init that is no program: the kernel finds no working init and panics.
    let not_a_program = |dir: &Path| {
        let init = dir.join("not-a-program");
        std::fs::write(&init, b"this is not an executable\n")?;
        Ok(init)
    };
    let Some(err) = failed_boot(test, vmm, not_a_program, Meddling::None, guest_reset_line(vmm)).await? else {
        return Ok(());
    };
    assert!(err.contains("VM did not start"), "{err}");
    assert!(err.contains("Kernel panic") && err.contains("No working init found"), "no console tail in: {err}");
    Ok(())
}

#[tokio::test]
async fn an_agent_that_exits_early_fails_the_pod_with_the_console_tail() -> Result<()> {
    early_exit("an_agent_that_exits_early_fails_the_pod_with_the_console_tail", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn an_agent_that_exits_early_fails_the_pod_with_the_console_tail_on_bulkhead_vmm() -> Result<()> {
    early_exit("an_agent_that_exits_early_fails_the_pod_with_the_console_tail_on_bulkhead_vmm", GuestVmm::Bulkhead)
        .await
}

async fn early_exit(test: &str, vmm: GuestVmm) -> Result<()> {
    let init = |dir: &Path| images::early_exit_init(dir);
    let Some(err) = failed_boot(test, vmm, init, Meddling::None, guest_reset_line(vmm)).await? else {
        return Ok(());
    };
    assert!(err.contains("VM did not start"), "{err}");
    assert!(err.contains(images::EARLY_EXIT_LINE), "the agent's last words are missing: {err}");
    Ok(())
}

/// The test harness's own promise: a QEMU held after its guest's reset (here by a vhost-user
/// backend that stopped answering) is ended by the stand-in, so the pod fails at once as on
/// `bulkhead-vmm`, not at the shim's connect timeout.
#[tokio::test]
async fn a_stand_in_whose_qemu_hangs_after_the_guest_reset_still_ends() -> Result<()> {
    let test = "a_stand_in_whose_qemu_hangs_after_the_guest_reset_still_ends";
    // Long enough after its line for the backend to be stopped before the reset.
    let init = |dir: &Path| images::late_exit_init(dir, 3);
    let meddling = Meddling::StopVsockBackendAfter(images::EARLY_EXIT_LINE);
    let says = "did not exit within 5s of its guest's shutdown; killed";
    let Some(err) = failed_boot(test, GuestVmm::QemuStandIn, init, meddling, says).await? else {
        return Ok(());
    };
    assert!(err.contains(images::EARLY_EXIT_LINE), "the agent's last words are missing: {err}");
    Ok(())
}
