//! Pod networking end to end on the `namespace` backend (issue 10), through a private containerd
//! and CRI: pods on the harness's CNI bridge reach each other over TCP at their PodSandboxStatus
//! IPs (bulkhead <-> bulkhead, bulkhead <-> runc), containers get the pod's DNS config, and the
//! cloud metadata endpoint is blocked for bulkhead pods unless the shim config allows it. The same
//! for a `vm`-backend pod with the real guest (taps and redirects into the guest, the metadata
//! drop on the tap): on the QEMU stand-in on every host, and on `bulkhead-vmm` where the host
//! probe says ordinary guests run (elsewhere that variant prints one SKIPPED line). There too, two
//! warm pods restored from one template each have their own hostname, entropy and address.
//!
//! The metadata endpoint is a stand-in: a network namespace this test creates and attaches to the
//! test's own bridge, holding 169.254.169.254 and a bridge address through which CNI routes
//! 169.254.169.254/32 for the test's pods. Traffic never leaves that bridge; the namespace and its
//! veth are deleted on drop, the bridge by the harness.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a broken fixture fails loudly

use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bulkhead_integration::guests::GuestVmm;
use bulkhead_integration::{
    container_config, workspace_bin, CniNetwork, CniRoute, ContainerdConfig, ContainerdVersion, RuntimeHandler, Setup,
    ShimEnv,
};
use k8s_cri::v1 as cri;

/// The stand-in's host number on the pod subnet (CNI gives pods .2 to .199).
const STANDIN_HOST: u8 = 250;
const METADATA_IP: &str = "169.254.169.254";
const STANDIN_REPLY: &str = "metadata-standin";

/// The containerd these tests run on: this run's (`BULKHEAD_CONTAINERD`, default 1.6), or the one a
/// `*_on_containerd_<x>_<y>` twin binary, which compiles this same file, is named after.
fn containerd_version() -> ContainerdVersion {
    ContainerdVersion::for_test_binary(env!("CARGO_CRATE_NAME"))
}

struct Env(ShimEnv);

impl std::ops::Deref for Env {
    type Target = ShimEnv;

    fn deref(&self) -> &ShimEnv {
        &self.0
    }
}

/// Handlers `runc`, `bulkhead` (metadata blocked, the default) and `bulkhead-md`
/// (`[network] allow_metadata = true`), all on one CNI bridge; with `vm`, also `bulkhead-vm`
/// (the vm backend with the real guest on that VMM, metadata blocked).
async fn setup(test: &str, vm: Option<GuestVmm>) -> Result<Option<Env>> {
    setup_with(test, vm, |_| String::new()).await
}

/// [`setup`], with `more_vm(config dir)` added to `bulkhead-vm`'s `[vm]` table.
async fn setup_with(test: &str, vm: Option<GuestVmm>, more_vm: impl Fn(&Path) -> String) -> Result<Option<Env>> {
    let bins = ["bulkhead-agent", "containerd-shim-bulkhead-v2"];
    let Some(setup) = Setup::new(test, containerd_version(), &bins)? else { return Ok(None) };
    if vm.is_some_and(|vmm| vmm.skip(test)) {
        return Ok(None);
    }
    assert!(bulkhead_integration::which("ip").is_some(), "ip (iproute2) is not installed: run `make setup`");
    let base = bulkhead_integration::guests::namespace_config(setup.state(), &workspace_bin("bulkhead-agent"));
    let blocked = setup.write_config("bulkhead.toml", &base)?;
    let allowed = setup.write_config("bulkhead-md.toml", &format!("{base}[network]\nallow_metadata = true\n"))?;
    let mut handlers = vec![
        RuntimeHandler::runc(),
        RuntimeHandler::bulkhead(Some(&blocked)),
        RuntimeHandler { name: "bulkhead-md".into(), ..RuntimeHandler::bulkhead(Some(&allowed)) },
    ];
    if let Some(vmm) = vm {
        // Below the harness's 60 s CRI deadline, so a slow boot fails with the shim's own error.
        let text = bulkhead_integration::guests::real_vm_config(&setup.state().join("vm"), 45_000, vmm)?;
        let more = more_vm(setup.config_dir());
        // A test that says how its pods start replaces the harness's cold start.
        let text = if more.contains("start =") { text.replace(bulkhead_integration::guests::COLD, "") } else { text };
        let vm_config = setup.write_config("bulkhead-vm.toml", &format!("{text}{more}"))?;
        handlers.push(RuntimeHandler { name: "bulkhead-vm".into(), ..RuntimeHandler::bulkhead(Some(&vm_config)) });
    }
    let config = ContainerdConfig {
        handlers,
        cni_bridge: true,
        cni_routes: vec![CniRoute { dst: format!("{METADATA_IP}/32"), gateway_host: STANDIN_HOST }],
        ..Default::default()
    };
    Ok(Some(Env(setup.start(config).await?)))
}

impl Env {
    /// A pod-network pod config named `name`.
    fn pod(&self, name: &str) -> Result<cri::PodSandboxConfig> {
        let mut pod = self.0.pod(name)?;
        bulkhead_integration::cri::use_pod_network(&mut pod)?;
        pod.hostname = name.into();
        Ok(pod)
    }

    /// Runs `pod` with `handler` and one started container running `command`; returns
    /// (pod id, container id, pod IP).
    async fn run(
        &self,
        pod: &cri::PodSandboxConfig,
        handler: &str,
        command: &[&str],
    ) -> Result<(String, String, String)> {
        self.run_allowing(pod, handler, command, Duration::ZERO).await
    }

    /// [`Self::run`] with RunPodSandbox allowed `extra` time (a pod that builds its template first).
    async fn run_allowing(
        &self,
        pod: &cri::PodSandboxConfig,
        handler: &str,
        command: &[&str],
        extra: Duration,
    ) -> Result<(String, String, String)> {
        let name = pod.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
        let pod_id =
            self.cri.run_pod_sandbox_allowing(pod, handler, extra).await.with_context(|| self.fail_context())?;
        let ctr = self.cri.create_container(&pod_id, &container_config(&name, command), pod).await?;
        self.cri.start_container(&ctr).await.with_context(|| self.fail_context())?;
        let ip = self.cri.pod_sandbox_status(&pod_id).await?.network.map(|n| n.ip).unwrap_or_default();
        if ip.is_empty() {
            bail!("pod {name} has no IP from CNI");
        }
        Ok((pod_id, ctr, ip))
    }

    /// A TCP connection from container `ctr` to `ip`:`port` (busybox `nc`, 3 s connect
    /// timeout): (exit code, what the server sent). busybox's static `wget` cannot be used: it
    /// crashes in the resolver even for an address.
    async fn fetch(&self, ctr: &str, ip: &str, port: u16) -> Result<(i32, String)> {
        let out = self.cri.exec_sync(ctr, &["nc", "-w", "3", ip, &port.to_string()], 10).await?;
        Ok((out.exit_code, String::from_utf8_lossy(&out.stdout).into_owned()))
    }

    /// Connects until the server sends `want` (it may still be starting), bounded.
    async fn fetch_eventually(&self, ctr: &str, ip: &str, port: u16, want: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let (code, got) = self.fetch(ctr, ip, port).await?;
            if code == 0 && got == want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("{ip}:{port} from {ctr}: exit {code}, got {got:?}; want {want:?}\n{}", self.fail_context());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn fail_context(&self) -> String {
        format!("containerd log tail:\n{}", self.containerd.log_tail(30))
    }
}

/// A container answering every TCP connection on port 8080 with `pong-<name>\n`.
fn server(name: &str) -> Vec<String> {
    ["nc", "-ll", "-p", "8080", "-e", "echo", &format!("pong-{name}")].map(String::from).to_vec()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test]
async fn pods_reach_each_other_over_tcp_and_see_the_pod_dns() -> Result<()> {
    let Some(env) = setup("pods_reach_each_other_over_tcp_and_see_the_pod_dns", None).await? else { return Ok(()) };
    let mut a_pod = env.pod("net-a")?;
    a_pod.dns_config = Some(cri::DnsConfig {
        servers: vec!["10.96.0.10".into()],
        searches: vec!["default.svc.cluster.local".into(), "svc.cluster.local".into()],
        options: vec!["ndots:5".into()],
    });
    let (_, a, a_ip) = env.run(&a_pod, "bulkhead", &strs(&server("a"))).await?;
    let (_, b, b_ip) = env.run(&env.pod("net-b")?, "bulkhead", &strs(&server("b"))).await?;
    let (_, r, r_ip) = env.run(&env.pod("net-r")?, "runc", &strs(&server("r"))).await?;

    // bulkhead <-> bulkhead, bulkhead <-> runc, at the addresses CRI reports.
    env.fetch_eventually(&a, &b_ip, 8080, "pong-b\n").await?;
    env.fetch_eventually(&b, &a_ip, 8080, "pong-a\n").await?;
    env.fetch_eventually(&a, &r_ip, 8080, "pong-r\n").await?;
    env.fetch_eventually(&r, &a_ip, 8080, "pong-a\n").await?;

    // The container sees the pod's DNS config (served by the agent from SetupSandbox).
    let out = env.cri.exec_sync(&a, &["cat", "/etc/resolv.conf"], 10).await?;
    let resolv = String::from_utf8_lossy(&out.stdout);
    assert!(resolv.contains("nameserver 10.96.0.10"), "{resolv}");
    assert!(resolv.contains("search default.svc.cluster.local svc.cluster.local"), "{resolv}");
    assert!(resolv.contains("options ndots:5"), "{resolv}");
    Ok(())
}

#[tokio::test]
async fn metadata_endpoint_is_blocked_unless_allowed() -> Result<()> {
    let Some(env) = setup("metadata_endpoint_is_blocked_unless_allowed", None).await? else { return Ok(()) };
    let want = format!("{STANDIN_REPLY}\n");
    let sleep = ["sleep", "3600"];
    // The control pod first: CNI makes the bridge the stand-in attaches to.
    let (_, control, _) = env.run(&env.pod("md-control")?, "runc", &sleep).await?;
    let standin = MetadataStandIn::start(env.containerd.cni_network().context("CNI bridge")?)?;
    env.fetch_eventually(&control, METADATA_IP, 80, &want).await.context("runc control pod")?;

    let (_, blocked, blocked_ip) = env.run(&env.pod("md-blocked")?, "bulkhead", &sleep).await?;
    let (code, got) = env.fetch(&blocked, METADATA_IP, 80).await?;
    assert!(code != 0 && got.is_empty(), "a bulkhead pod reached the metadata endpoint: exit {code}, {got:?}");
    let peers = standin.peers();
    assert!(!peers.contains(&blocked_ip.parse::<IpAddr>()?), "the stand-in saw {blocked_ip}: {peers:?}");

    let (_, allowed, _) = env.run(&env.pod("md-allowed")?, "bulkhead-md", &sleep).await?;
    env.fetch_eventually(&allowed, METADATA_IP, 80, &want).await.context("allow_metadata = true")?;
    Ok(())
}

#[tokio::test]
async fn vm_pod_is_on_the_pod_network_and_metadata_is_blocked() -> Result<()> {
    vm_pod_network("vm_pod_is_on_the_pod_network_and_metadata_is_blocked", GuestVmm::QemuStandIn).await
}

#[tokio::test]
async fn vm_pod_is_on_the_pod_network_and_metadata_is_blocked_on_bulkhead_vmm() -> Result<()> {
    vm_pod_network("vm_pod_is_on_the_pod_network_and_metadata_is_blocked_on_bulkhead_vmm", GuestVmm::Bulkhead).await
}

async fn vm_pod_network(test: &str, vmm: GuestVmm) -> Result<()> {
    let Some(env) = setup(test, Some(vmm)).await? else { return Ok(()) };
    println!("{test}: the guest runs on {}", vmm.name());
    let want = format!("{STANDIN_REPLY}\n");
    let (_, control, _) = env.run(&env.pod("vmnet-control")?, "runc", &strs(&server("r"))).await?;
    let standin = MetadataStandIn::start(env.containerd.cni_network().context("CNI bridge")?)?;
    env.fetch_eventually(&control, METADATA_IP, 80, &want).await.context("runc control pod")?;

    // The guest's NIC carries the pod's IP: a runc pod connects to a server inside the VM.
    let (_, vm, vm_ip) = env.run(&env.pod("vmnet-vm")?, "bulkhead-vm", &strs(&server("v"))).await?;
    env.fetch_eventually(&control, &vm_ip, 8080, "pong-v\n").await.context("runc pod -> vm pod")?;

    // The metadata drop sits on the tap, on the host side of the guest.
    let (code, got) = env.fetch(&vm, METADATA_IP, 80).await?;
    assert!(code != 0 && got.is_empty(), "a vm pod reached the metadata endpoint: exit {code}, {got:?}");
    let peers = standin.peers();
    assert!(!peers.contains(&vm_ip.parse::<IpAddr>()?), "the stand-in saw {vm_ip}: {peers:?}");
    Ok(())
}

/// Warm pods with the real guest (issue 22): two pod-network pods restored from one template (the
/// first builds it) each run a container with their own hostname, their own entropy and their own
/// address on the pod network. Only on `bulkhead-vmm`: the QEMU stand-in cannot restore its
/// snapshots, and PVM runs no ordinary guest (a ledgered SKIPPED line).
#[tokio::test]
async fn restored_vm_pods_are_each_their_own_on_bulkhead_vmm() -> Result<()> {
    let test = "restored_vm_pods_are_each_their_own_on_bulkhead_vmm";
    let vmm = GuestVmm::Bulkhead;
    let warm = |dir: &Path| format!("start = \"warm\"\ntemplate_dir = \"{}\"\n", dir.join("templates").display());
    let Some(env) = setup_with(test, Some(vmm), warm).await? else { return Ok(()) };
    let (_, control, _) = env.run(&env.pod("warm-control")?, "runc", &strs(&server("r"))).await?;
    let mut seen = Vec::new();
    for name in ["warm-a", "warm-b"] {
        // The first pod builds the template (hash the key's inputs, boot to the agent, snapshot,
        // publish) before its own restore: in the emulated node that took 332 s of a debug build.
        let extra = if name == "warm-a" { Duration::from_secs(540) } else { Duration::ZERO };
        let (pod_id, ctr, ip) = env.run_allowing(&env.pod(name)?, "bulkhead-vm", &strs(&server(name)), extra).await?;
        let log = env.containerd.log_tail(2000);
        let started = log.lines().find(|l| l.contains(&pod_id) && l.contains("VM started")).unwrap_or_default();
        assert!(started.contains("start=\"warm\""), "{name} did not start warm: {started:?}\n{}", env.fail_context());
        println!("{test}: {name}: {}", started.split("VM started").last().unwrap_or_default().trim());
        let run_owned = |cmd: String| {
            let (cri, ctr, containerd) = (&env.cri, ctr.clone(), &env.containerd);
            async move {
                // A bound ExecSync that runs out also ends 137: the time taken and the pod's logs tell
                // a slow emulated node from a kill.
                let began = std::time::Instant::now();
                let out = cri.exec_sync(&ctr, &["sh", "-c", &cmd], 30).await?;
                anyhow::ensure!(
                    out.exit_code == 0,
                    "{cmd}: exit {} after {:.1} s: {}\n{}",
                    out.exit_code,
                    began.elapsed().as_secs_f64(),
                    String::from_utf8_lossy(&out.stderr),
                    containerd.log_tail(80)
                );
                Ok::<_, anyhow::Error>(String::from_utf8_lossy(&out.stdout).trim().to_string())
            }
        };
        let run = |cmd: &str| run_owned(cmd.to_string());
        assert_eq!(run("hostname").await?, name);
        let random = run("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await?;
        assert_eq!(random.len(), 64, "{random:?}");
        // The wall clock is the host's, not the template's (warm-b restores minutes after the snapshot).
        let guest_now: i64 = run("date +%s").await?.parse()?;
        let host_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
        assert!((guest_now - host_now).abs() < 30, "{name}: guest clock {guest_now}, host clock {host_now}");
        // Its rootfs is the pod's virtio-fs share, reached through the restored device's relay:
        // a file written there is copied and read back.
        let file = format!("/written-by-{name}");
        assert_eq!(run_owned(format!("echo {name} > {file}.a && cp {file}.a {file}.b && cat {file}.b")).await?, name);
        // Its own address on the pod network: a runc pod reaches the server in this VM there.
        env.fetch_eventually(&control, &ip, 8080, &format!("pong-{name}\n"))
            .await
            .with_context(|| format!("{name} at {ip}"))?;
        seen.push((ip, random));
    }
    assert_ne!(seen[0].0, seen[1].0, "two restored pods share an address");
    assert_ne!(seen[0].1, seen[1].1, "two restored pods read the same bytes from /dev/urandom");
    Ok(())
}

/// The stand-in metadata endpoint: a namespace of the test's own on the CNI bridge, with a TCP
/// listener on 169.254.169.254:80 that answers every connection and records who connected.
struct MetadataStandIn {
    netns: String,
    host_end: String,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
    peers: Arc<Mutex<Vec<IpAddr>>>,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip")?;
    if !out.status.success() {
        bail!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

impl MetadataStandIn {
    fn start(cni: &CniNetwork) -> Result<Self> {
        // Tests of this binary run side by side, each with its own stand-in.
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let (pid, seq) = (std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst));
        let mut standin = Self {
            netns: format!("bhmd-{pid}-{seq}"),
            host_end: format!("bhmd{}x{}", pid % 1_000_000, seq % 100),
            stop: Arc::new(AtomicBool::new(false)),
            server: None,
            peers: Arc::default(),
        };
        ip(&["netns", "add", &standin.netns])?;
        let ns = standin.netns.clone();
        ip(&["link", "add", &standin.host_end, "type", "veth", "peer", "name", "md0", "netns", &ns])?;
        ip(&["link", "set", &standin.host_end, "master", &cni.bridge, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &ns, "link", "set", "md0", "up"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{METADATA_IP}/32"), "dev", "md0"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{}/24", cni.host(STANDIN_HOST)), "dev", "md0"])?;

        let handle = File::open(PathBuf::from("/run/netns").join(&ns))?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, peers) = (standin.stop.clone(), standin.peers.clone());
        standin.server = Some(std::thread::spawn(move || serve(handle, ready_tx, stop, peers)));
        ready_rx.recv_timeout(Duration::from_secs(5)).context("stand-in listener")??;
        Ok(standin)
    }

    fn peers(&self) -> Vec<IpAddr> {
        self.peers.lock().unwrap().clone()
    }
}

/// The listener thread: joins the stand-in's namespace (this thread only), answers every
/// connection with a fixed line until told to stop.
fn serve(
    netns: File,
    ready: std::sync::mpsc::Sender<Result<()>>,
    stop: Arc<AtomicBool>,
    peers: Arc<Mutex<Vec<IpAddr>>>,
) {
    // SAFETY: setns on a namespace fd we hold; it changes only this thread.
    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let _ = ready.send(Err(std::io::Error::last_os_error().into()));
        return;
    }
    let listener = match TcpListener::bind((METADATA_IP, 80)).and_then(|l| l.set_nonblocking(true).map(|()| l)) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((mut conn, peer)) => {
                peers.lock().unwrap().push(peer.ip());
                let _ = conn.set_nonblocking(false);
                let _ = conn.write_all(format!("{STANDIN_REPLY}\n").as_bytes());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

impl Drop for MetadataStandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
        // Deleting either end of a veth deletes both.
        let _ = Command::new("ip").args(["link", "del", &self.host_end]).output();
        if let Err(e) = ip(&["netns", "del", &self.netns]) {
            eprintln!("warning: {e}");
        }
    }
}
