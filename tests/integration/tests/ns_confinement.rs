//! The `namespace` backend's confinement, end to end through a private containerd and CRI
//! (README: "The `namespace` backend gives no VM isolation"): the pod's agent runs in a minimal
//! root, without the host's files or another pod's, with the capabilities the READMEs state and
//! no_new_privs unset; the shim's container mounts reach it read-only where asked; containers
//! asking for more than containerd's default capabilities are refused by name; containers that
//! ask for nothing special still run as before (setuid allowed, a non-root user, exec, a
//! read-only rootfs); and no container can write a host sysctl, its cgroups, or open a host disk.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bulkhead_integration::host::{eventually_nothing, mounts_with, processes_with};
use bulkhead_integration::{container_config, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup, ShimEnv};
use k8s_cri::v1 as cri;

const RUNNING: i32 = cri::ContainerState::ContainerRunning as i32;

/// The agent's capabilities after its drop, as the READMEs state them: containerd's default
/// container set (CHOWN, DAC_OVERRIDE, FSETID, FOWNER, MKNOD, NET_RAW, SETGID, SETUID, SETFCAP,
/// SETPCAP, NET_BIND_SERVICE, SYS_CHROOT, KILL, AUDIT_WRITE) plus SYS_ADMIN and SYS_PTRACE.
const AGENT_CAPS: &str = "00000000a82c25fb";
/// A container trying what turns root in a container into root on the host, one `key=result`
/// line each. Writing release_agent needs CAP_SYS_ADMIN in the host's user namespace and must
/// fail; core_pattern is written its own value, so even a failing run changes nothing on the host.
const ESCAPES: &str = "mknod /tmp/disk b 8 0; echo mknod=$?; \
    echo open_disk=$(head -c 1 /tmp/disk 2>&1 >/dev/null); \
    echo image_node=$( (: > {image_node}) 2>&1 && echo opened); \
    mkdir -p /tmp/m; mount -t tmpfs t /tmp/m 2>/dev/null; echo mount=$?; \
    ra='none writable'; for f in /sys/fs/cgroup/*/release_agent /sys/fs/cgroup/release_agent; do \
    [ -e $f ] && [ -w $f ] && { echo /bin/true > $f 2>/dev/null && ra=written; }; done; echo release_agent=$ra; \
    v=$(cat /proc/sys/kernel/core_pattern); echo core_pattern=$(sh -c \"echo \\\"$v\\\" > /proc/sys/kernel/core_pattern\" 2>&1 && echo written); \
    echo pids_max=$(sh -c 'echo 100 > /sys/fs/cgroup/pids/pids.max' 2>&1; sh -c 'echo 100 > /sys/fs/cgroup/pids.max' 2>&1); \
    mkdir /sys/fs/cgroup/memory/x 2>/dev/null || mkdir /sys/fs/cgroup/x 2>/dev/null; echo cgroup_mkdir=$?; \
    if [ -e /sys/fs/cgroup/systemd/cgroup.procs ]; then \
    echo systemd_root=$(sh -c 'echo $$ > /sys/fs/cgroup/systemd/cgroup.procs' 2>&1); else echo systemd_root=absent; fi";

/// containerd's default container set alone: what a container gets.
const CONTAINER_CAPS: &str = "00000000a80425fb";

/// The `bulkhead` handler on the namespace backend, on a private containerd.
struct Env(ShimEnv);

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.0
    }
}

async fn setup(test: &str) -> Result<Option<Env>> {
    let version = ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"));
    let Some(setup) = Setup::new(test, version, &["bulkhead-agent", "containerd-shim-bulkhead-v2"])? else {
        return Ok(None);
    };
    let config = setup.namespace_config("bulkhead.toml", setup.state())?;
    let handlers = vec![RuntimeHandler::bulkhead(Some(&config))];
    Ok(Some(Env(setup.start(ContainerdConfig { handlers, ..Default::default() }).await?)))
}

impl Env {
    fn fail_context(&self) -> String {
        self.log_context(80)
    }

    /// ExecSync of `cmd` in container `id`; a failure (an exec that never answers among them: one
    /// did once in CI, in the no_new_privs container) carries containerd's log, the shim's lines in it.
    async fn exec(&self, id: &str, cmd: &[&str], timeout_s: i64) -> Result<cri::ExecSyncResponse> {
        self.cri.exec_sync(id, cmd, timeout_s).await.with_context(|| self.fail_context())
    }

    /// Creates and starts `ctr` in `pod_id`, waiting until it runs.
    async fn run(&self, pod_id: &str, pod: &cri::PodSandboxConfig, ctr: &cri::ContainerConfig) -> Result<String> {
        let id = self.cri.create_container(pod_id, ctr, pod).await.with_context(|| self.fail_context())?;
        self.cri.start_container(&id).await?;
        self.cri.wait_container(&id, Duration::from_secs(10), |s| s.state == RUNNING).await?;
        Ok(id)
    }

    /// A pod's directory below the shim's state dir.
    fn pod_dir(&self, pod_id: &str) -> PathBuf {
        self.state_dir.path().join(pod_id)
    }
}

fn sleeper(name: &str) -> cri::ContainerConfig {
    container_config(name, &["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"])
}

fn security(ctr: &mut cri::ContainerConfig) -> &mut cri::LinuxContainerSecurityContext {
    ctr.linux.get_or_insert_with(Default::default).security_context.get_or_insert_with(Default::default)
}

/// The pod's agent, once it runs from its minimal root (after it executed itself again there).
async fn agent_pid(pod_id: &str) -> Result<u32> {
    for _ in 0..100 {
        let found: Vec<u32> = processes_with(pod_id)
            .into_iter()
            .filter(|(_, cmd)| cmd.starts_with("/bulkhead-agent ") && cmd.contains("--in-minimal-root"))
            .map(|(pid, _)| pid)
            .collect();
        match found.as_slice() {
            [pid] => return Ok(*pid),
            [] => tokio::time::sleep(Duration::from_millis(50)).await,
            more => bail!("more than one agent for {pod_id}: {more:?}"),
        }
    }
    bail!("no agent in its minimal root for pod {pod_id}")
}

/// Whether the host is on cgroup v2 (one hierarchy at /sys/fs/cgroup) rather than v1.
fn cgroup_v2() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// The agent's user namespace map, as `guest_init::user_ns::ID_MAP` writes it.
const AGENT_ID_MAP: [&str; 3] = ["0", "0", "4294967294"];

/// The agent's `--cgroup-parent`: the pod's cgroup, absolute in the hierarchy.
fn agent_cgroup_parent(agent: u32) -> Result<String> {
    let cmdline = std::fs::read(format!("/proc/{agent}/cmdline"))?;
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let at = args.iter().position(|a| a == "--cgroup-parent").context("no --cgroup-parent")?;
    args.get(at + 1).cloned().context("--cgroup-parent without a value")
}

fn status_field(pid: u32, field: &str) -> Result<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
        .with_context(|| format!("{field} not in /proc/{pid}/status"))
}

/// Runs `busybox args...` (the container image's own busybox, reached through the pod's view)
/// inside the agent's user and mount namespaces and root, as root: what a container process that
/// got out of its own root into the agent's would see. Returns (success, stdout + stderr).
fn in_agent_root(agent: u32, busybox: &Path, args: &[&str]) -> Result<(bool, String)> {
    let target = agent.to_string();
    let nsenter = ["--target", &target, "--user", "--mount", "--root", "--wd=/"];
    let out =
        std::process::Command::new("nsenter").args(nsenter).arg(busybox).args(args).output().context("nsenter")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

/// The source the agent got for the mount at `destination` of container `ctr` (its bundle's
/// config.json, as the agent wrote it from the shim's rewritten spec).
fn agent_mount_source(pod_dir: &Path, ctr: &str, destination: &str) -> Result<String> {
    let config = pod_dir.join("agent/bundles").join(ctr).join("config.json");
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&config)?)?;
    let mounts = spec["mounts"].as_array().context("mounts")?;
    let m = mounts.iter().find(|m| m["destination"] == destination).with_context(|| format!("no {destination}"))?;
    Ok(m["source"].as_str().context("source")?.to_string())
}

#[tokio::test]
async fn the_agent_sees_neither_the_hosts_files_nor_another_pod() -> Result<()> {
    let Some(env) = setup("the_agent_sees_neither_the_hosts_files_nor_another_pod").await? else { return Ok(()) };
    let host_shadow = std::fs::read_to_string("/etc/shadow").context("the host's /etc/shadow")?;
    let shadow_line = host_shadow.lines().next().context("an empty /etc/shadow")?.to_string();

    let (rw, ro) = (tempfile::tempdir()?, tempfile::tempdir()?);
    std::fs::write(ro.path().join("config"), "from-the-host\n")?;
    let pod_a = env.pod("confined-a")?;
    let a = env.cri.run_pod_sandbox(&pod_a, "bulkhead").await.with_context(|| env.fail_context())?;
    let mut ctr = sleeper("a");
    ctr.mounts = vec![
        cri::Mount { container_path: "/data".into(), host_path: rw.path().display().to_string(), ..Default::default() },
        cri::Mount {
            container_path: "/ro".into(),
            host_path: ro.path().display().to_string(),
            readonly: true,
            ..Default::default()
        },
    ];
    let ctr_a = env.run(&a, &pod_a, &ctr).await?;
    let pod_b = env.pod("confined-b")?;
    let b = env.cri.run_pod_sandbox(&pod_b, "bulkhead").await.with_context(|| env.fail_context())?;
    let ctr_b = env.run(&b, &pod_b, &sleeper("b")).await?;
    let (agent_a, agent_b) = (agent_pid(&a).await?, agent_pid(&b).await?);

    // From the host, through the agent's root: no /etc, no other pod, no containerd state.
    for agent in [agent_a, agent_b] {
        let root = PathBuf::from(format!("/proc/{agent}/root"));
        assert!(!root.join("etc/shadow").exists(), "the agent {agent} can read /etc/shadow");
        assert!(!root.join("var").exists(), "containerd's state (/var/lib/...) is in the agent's root");
    }
    let root_a = PathBuf::from(format!("/proc/{agent_a}/root"));
    assert!(root_a.join(env.pod_dir(&a).strip_prefix("/")?).exists());
    assert!(!root_a.join(env.pod_dir(&b).strip_prefix("/")?).exists(), "pod a's agent sees pod b");
    // In the pod's own directory only its state and its view of the container mounts.
    let mut kept: Vec<String> = std::fs::read_dir(root_a.join(env.pod_dir(&a).strip_prefix("/")?))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    kept.sort();
    assert_eq!(kept, ["agent", "view"], "the shim's own files (pid file, records, sockets) stay outside");

    // From inside the agent's mount namespace, as root, with the container's own busybox.
    let rootfs_a = PathBuf::from(agent_mount_source(&env.pod_dir(&a), &ctr_a, "/data")?)
        .parent()
        .and_then(Path::parent)
        .context("view/<ctr>/volumes/<n>")?
        .join("rootfs");
    let busybox = rootfs_a.join("bin/busybox");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["cat", "/etc/shadow"])?;
    assert!(!ok && !text.contains(&shadow_line), "host's /etc/shadow read from the agent's root: {text}");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["ls", &env.state_dir.path().display().to_string()])?;
    assert!(ok, "{text}");
    assert_eq!(text.split_whitespace().collect::<Vec<_>>(), [a.as_str()], "other pods listed: {text}");
    let rootfs_b = env.pod_dir(&b).join("view").join(&ctr_b).join("rootfs/bin");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["ls", &rootfs_b.display().to_string()])?;
    assert!(!ok, "pod b's rootfs from pod a's agent: {text}");
    // The view is read-only, and so is a read-only volume in it (bound read-only from the start).
    let view_a = env.pod_dir(&a).join("view");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["mkdir", &view_a.join("planted").display().to_string()])?;
    assert!(!ok && text.contains("Read-only"), "{text}");
    let ro_source = agent_mount_source(&env.pod_dir(&a), &ctr_a, "/ro")?;
    assert!(ro_source.starts_with(&view_a.display().to_string()), "{ro_source}");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["touch", &format!("{ro_source}/planted")])?;
    assert!(!ok && text.contains("Read-only"), "a read-only volume is writable in the agent: {text}");
    let (ok, text) = in_agent_root(agent_a, &busybox, &["cat", &format!("{ro_source}/config")])?;
    assert!(ok && text == "from-the-host\n", "{text}");

    // From inside the container: no host file, the read-only volume read-only, the rw one written.
    let out = env.exec(&ctr_a, &["sh", "-c", "cat /etc/shadow; cat /proc/1/root/etc/shadow"], 10).await?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.exit_code != 0 && !text.contains(&shadow_line), "{text}");
    let out = env.exec(&ctr_a, &["sh", "-c", "touch /ro/x || echo refused; echo w > /data/f"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "refused\n");
    assert_eq!(std::fs::read_to_string(rw.path().join("f"))?, "w\n");
    assert!(!ro.path().join("x").exists());

    // The agent's privileges are over its own user namespace only, with the host's ids: what
    // needs the host's (a device node, a new cgroup hierarchy, release_agent, another pod's cgroup
    // or its own pod's limits) is refused; its containers' cgroups are its to make.
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/user"));
    assert_ne!(ns(&agent_a.to_string())?, ns("self")?, "the agent is in the host's user namespace");
    let map = std::fs::read_to_string(format!("/proc/{agent_a}/uid_map"))?;
    assert_eq!(map.split_whitespace().collect::<Vec<_>>(), AGENT_ID_MAP, "{map}");
    let state = env.pod_dir(&a).join("agent");
    let try_in_agent = |args: &[&str]| in_agent_root(agent_a, &busybox, args);
    let (ok, text) = try_in_agent(&["mknod", &state.join("disk").display().to_string(), "b", "8", "0"])?;
    assert!(!ok && text.contains("Operation not permitted"), "a device node made in the agent: {text}");
    let (ok, text) = try_in_agent(&["mount", "-t", "cgroup2", "none", &state.display().to_string()])?;
    assert!(!ok, "a cgroup hierarchy mounted in the agent: {text}");
    // One hierarchy on v2; on v1 the pids one stands for each.
    let (hierarchy, own_limit) =
        if cgroup_v2() { ("/sys/fs/cgroup", "cgroup.max.descendants") } else { ("/sys/fs/cgroup/pids", "pids.max") };
    let pod_cgroup = format!("{hierarchy}{}", agent_cgroup_parent(agent_a)?);
    let (ok, text) = try_in_agent(&["sh", "-c", &format!("echo 1 > {pod_cgroup}/{own_limit}")])?;
    assert!(!ok && text.contains("Read-only"), "the pod's own limit written from its agent: {text}");
    let (ok, text) = try_in_agent(&["mkdir", &format!("{hierarchy}/bulkhead-planted")])?;
    assert!(!ok && text.contains("Read-only"), "a cgroup made outside the pod: {text}");
    if !cgroup_v2() {
        let (ok, text) = try_in_agent(&["sh", "-c", &format!("echo /bin/true > {hierarchy}/release_agent")])?;
        assert!(!ok && text.contains("Read-only"), "release_agent written from the agent: {text}");
    }
    let (ok, text) = try_in_agent(&["sh", "-c", &format!("mkdir {pod_cgroup}/planted && rmdir {pod_cgroup}/planted")])?;
    assert!(ok, "the agent cannot make a cgroup in its pod's: {text}");

    // The agent's capabilities and no_new_privs are what the READMEs state.
    for agent in [agent_a, agent_b] {
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(status_field(agent, set)?, AGENT_CAPS, "{set} of agent {agent}");
        }
        assert_eq!(status_field(agent, "CapInh")?, "0000000000000000");
        assert_eq!(status_field(agent, "CapAmb")?, "0000000000000000");
        assert_eq!(status_field(agent, "NoNewPrivs")?, "0", "no_new_privs is left unset on the agent");
    }

    for (pod, ctr) in [(&a, &ctr_a), (&b, &ctr_b)] {
        env.cri.stop_pod_sandbox(pod).await?;
        env.cri.remove_pod_sandbox(pod).await?;
        let dir = env.pod_dir(pod);
        eventually_nothing("the pod's mounts and state", Duration::from_secs(15), || {
            let mut left: Vec<String> = [pod.as_str(), ctr.as_str()].iter().flat_map(|id| mounts_with(id)).collect();
            if dir.exists() {
                left.push(dir.display().to_string());
            }
            left
        })
        .await?;
    }
    Ok(())
}

#[tokio::test]
async fn containers_keep_the_default_capabilities_and_nothing_more() -> Result<()> {
    let Some(env) = setup("containers_keep_the_default_capabilities_and_nothing_more").await? else {
        return Ok(());
    };
    let pod = env.pod("capabilities")?;
    let pod_id = env.cri.run_pod_sandbox(&pod, "bulkhead").await.with_context(|| env.fail_context())?;

    // Asking for more than containerd's default set is refused, naming what was asked for (and
    // the container never runs):
    // CAP_SYS_ADMIN (mounts: host root without a VM), CAP_DAC_READ_SEARCH (open_by_handle_at
    // reaches any host file), CAP_SYS_PTRACE (the agent keeps it, a container never gets it).
    for (add, name) in
        [("SYS_ADMIN", "CAP_SYS_ADMIN"), ("DAC_READ_SEARCH", "CAP_DAC_READ_SEARCH"), ("SYS_PTRACE", "CAP_SYS_PTRACE")]
    {
        let mut ctr = sleeper(&format!("add-{}", add.to_lowercase().replace('_', "-")));
        security(&mut ctr).capabilities =
            Some(cri::Capability { add_capabilities: vec![add.into()], ..Default::default() });
        // CRI makes the task (and so asks the agent) at StartContainer.
        let id = env.cri.create_container(&pod_id, &ctr, &pod).await?;
        let err = env.cri.start_container(&id).await.unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains(name) && text.contains("namespace backend"), "{add}: {text}");
    }

    // A container asking for nothing: containerd's default set, and setuid binaries still
    // raise privileges (no_new_privs unset) unless the container asks for no_new_privs.
    let probe = "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status";
    let plain = env.run(&pod_id, &pod, &sleeper("plain")).await?;
    let out = env.exec(&plain, &["sh", "-c", probe], 10).await?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains(&format!("CapEff:\t{CONTAINER_CAPS}")) && text.contains("NoNewPrivs:\t0"), "{text}");
    // What a container reaches for first to become host root without a VM: none of it works.
    // (This harness's CRI requests carry no masked or read-only /proc paths, as kubelet's do: the
    // agent adds containerd's defaults itself.)
    let escapes = ESCAPES.replace("{image_node}", bulkhead_integration::images::IMAGE_NODE);
    let out = env.exec(&plain, &["sh", "-c", &escapes], 10).await?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let said = |key: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{key}="))).unwrap_or("missing");
    assert!(said("mknod").parse::<i32>().is_ok_and(|c| c != 0), "no device node in a user namespace: {text}");
    assert!(said("open_disk").contains("No such file"), "{text}");
    // The image's own node (/dev/null's numbers, which any devices cgroup allows): containerd
    // made it on the host, and only the rootfs's nodev keeps it from opening a host device.
    assert!(said("image_node").contains("Permission denied"), "a device node from the image opens: {text}");
    assert_ne!(said("mount"), "0", "{text}");
    assert_eq!(said("release_agent"), "none writable", "{text}");
    assert!(said("core_pattern").contains("Read-only file system"), "/proc/sys is read-only: {text}");
    assert!(said("pids_max").contains("Read-only file system"), "its own cgroup limits are read-only: {text}");
    assert_ne!(said("cgroup_mkdir"), "0", "{text}");
    assert!(said("systemd_root").contains("Read-only file system") || said("systemd_root") == "absent", "{text}");
    let mut nnp = sleeper("nnp");
    security(&mut nnp).no_new_privs = true;
    let nnp = env.run(&pod_id, &pod, &nnp).await?;
    let out = env.exec(&nnp, &["sh", "-c", probe], 10).await?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("NoNewPrivs:\t1"), "{out:?}");

    // A non-root container: it runs, and exec into it works (the agent needs its
    // CAP_SYS_PTRACE to join the namespaces of a process of another user).
    let mut user = sleeper("user");
    security(&mut user).run_as_user = Some(cri::Int64Value { value: 1000 });
    let user = env.run(&pod_id, &pod, &user).await?;
    let out = env.exec(&user, &["id", "-u"], 10).await?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "1000\n", "{out:?}");
    // A read-only rootfs (made read-only by libcontainer in the container, over the shim's mount).
    let mut read_only = sleeper("readonly");
    security(&mut read_only).readonly_rootfs = true;
    let read_only = env.run(&pod_id, &pod, &read_only).await?;
    let out = env.exec(&read_only, &["sh", "-c", "touch /x 2>&1; touch /tmp/y 2>&1"], 10).await?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.matches("Read-only file system").count() == 2, "{text}");

    env.cri.stop_pod_sandbox(&pod_id).await?;
    env.cri.remove_pod_sandbox(&pod_id).await?;
    let dir = env.pod_dir(&pod_id);
    eventually_nothing("the pod's state", Duration::from_secs(15), || {
        let mut left = mounts_with(&pod_id);
        if dir.exists() {
            left.push(dir.display().to_string());
        }
        left
    })
    .await
}

/// A host-network pod's `net.*` sysctls would be the node's: RunPodSandbox refuses them, naming
/// the sysctl, and leaves nothing behind. The value asked for is the node's own, so even a run
/// that fails this test changes nothing on the host.
#[tokio::test]
async fn a_host_network_pod_cannot_set_the_nodes_net_sysctls() -> Result<()> {
    let Some(env) = setup("a_host_network_pod_cannot_set_the_nodes_net_sysctls").await? else {
        return Ok(());
    };
    let key = "net.ipv4.tcp_keepalive_time";
    let now = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_keepalive_time")?.trim().to_string();
    let mut pod = env.pod("host-net-sysctl")?;
    let linux = pod.linux.as_mut().context("pod_config has linux")?;
    assert_eq!(
        linux.security_context.as_ref().and_then(|s| s.namespace_options.as_ref()).map(|n| n.network),
        Some(cri::NamespaceMode::Node as i32),
        "the pod is on the node's network"
    );
    linux.sysctls = [(key.to_string(), now)].into();
    let err = env.cri.run_pod_sandbox(&pod, "bulkhead").await.err().context("the pod started")?;
    let text = format!("{err:#}");
    assert!(text.contains(key) && text.contains("host network"), "{text}");
    let state = env.state_dir.path().display().to_string();
    eventually_nothing("the refused pod's state", Duration::from_secs(15), || {
        let mut left = mounts_with(&state);
        left.extend(processes_with(&state).into_iter().map(|(p, c)| format!("{p} {c}")));
        left.extend(bulkhead_integration::host::state_left(env.state_dir.path()));
        left
    })
    .await
}
