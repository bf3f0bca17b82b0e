//! Harness: the real agent binary as PID 1 of fresh pid/mount/uts/ipc namespaces
//! (`unshare --fork --kill-child`), reached only through its Unix socket with the CONNECT
//! preamble, plus a busybox rootfs and OCI spec builders.
#![allow(dead_code)]

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use bulkhead_protocol::{
    agent::*,
    agent_ttrpc::AgentClient,
    client::connect_agent,
    handshake::dial_unix,
    ports,
    stream::{StreamHeader, StreamKind},
};
use serde_json::{json, Value};
use tokio::{io::AsyncReadExt, net::UnixStream};

pub const T: Duration = Duration::from_secs(20);

/// Returns false (after printing the SKIPPED line) when the test cannot run here.
pub fn can_run(test: &str) -> bool {
    let missing = |reason: &str| !bulkhead_integration::skip::missing_prerequisite(test, reason);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return missing("needs root (namespaces, mounts, cgroups)");
    }
    if !Path::new("/bin/busybox").exists() {
        return missing("/bin/busybox (static) is not installed (make setup)");
    }
    if Command::new("unshare").arg("--version").output().is_err() {
        return missing("unshare(1) not found");
    }
    true
}

pub fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(T.as_nanos() as i64)
}

pub fn ctx_ms(ms: u64) -> ttrpc::context::Context {
    ttrpc::context::with_timeout(Duration::from_millis(ms).as_nanos() as i64)
}

pub struct Agent {
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub cgroup_parent: String,
    child: Option<Child>,
    pub client: AgentClient,
    /// Whether [`Agent::create`] already sent the sandbox its identity.
    identified: std::sync::atomic::AtomicBool,
}

impl Agent {
    pub async fn start(name: &str) -> Agent {
        Self::start_with(name, Path::new(env!("CARGO_BIN_EXE_bulkhead-agent"))).await
    }

    /// Starts `bin` (e.g. the static musl build) as the agent.
    pub async fn start_with(name: &str, bin: &Path) -> Agent {
        Self::start_full(name, bin, None).await
    }

    /// Starts the agent listening on vsock; returns without a client (the caller dials).
    pub async fn start_vsock(name: &str) -> Agent {
        Self::start_full(name, Path::new(env!("CARGO_BIN_EXE_bulkhead-agent")), Some("vsock")).await
    }

    /// Starts the agent in `--mode guest` (its boot mounts land in the private mount
    /// namespace). Its state and socket live under the target dir, since the agent mounts
    /// fresh tmpfs on /tmp and /run.
    pub async fn start_guest_mode(name: &str) -> Agent {
        Self::start_inner(name, Path::new(env!("CARGO_BIN_EXE_bulkhead-agent")), None, "guest", true, &[]).await
    }

    /// Namespace mode, confined as the shim runs it: the agent's minimal root keeps the test's
    /// directory (`--share-dir`), where the tests put rootfs and volumes.
    async fn start_full(name: &str, bin: &Path, listen: Option<&str>) -> Agent {
        Self::start_inner(name, bin, listen, "namespace", false, &[]).await
    }

    /// Namespace mode with more agent flags (`--frame-stall-ms 300`, say).
    pub async fn start_with_flags(name: &str, flags: &[&str]) -> Agent {
        Self::start_inner(name, Path::new(env!("CARGO_BIN_EXE_bulkhead-agent")), None, "namespace", false, flags).await
    }

    /// Namespace mode in a fresh network namespace too (for the network setup test), unconfined:
    /// configuring links takes the CAP_NET_ADMIN a confined agent drops.
    pub async fn start_netns(name: &str) -> Agent {
        Self::start_inner(name, Path::new(env!("CARGO_BIN_EXE_bulkhead-agent")), None, "namespace", true, &[]).await
    }

    async fn start_inner(name: &str, bin: &Path, listen: Option<&str>, mode: &str, net: bool, flags: &[&str]) -> Agent {
        let parent = if mode == "guest" {
            // Guest mode mounts fresh /tmp, /run, /dev, /sys and /proc over the host's, so the
            // socket must live elsewhere; the checkout itself may be under /tmp (CI clones).
            let p = PathBuf::from("/var/lib/bulkhead-test");
            std::fs::create_dir_all(&p).expect("guest-mode test dir");
            p
        } else {
            PathBuf::from("/tmp")
        };
        let dir = tempfile::Builder::new().prefix("bhagent").tempdir_in(parent).expect("tempdir");
        let sock = dir.path().join("agent.sock");
        let cgroup_parent = format!("/bulkhead-test-{}-{name}", std::process::id());
        let log = std::fs::File::create(dir.path().join("agent.log")).expect("log file");
        let confinement: Vec<String> = match (mode, net) {
            ("namespace", false) => vec!["--share-dir".into(), dir.path().display().to_string()],
            ("namespace", true) => vec!["--unconfined".into()],
            _ => Vec::new(),
        };
        let child = Command::new("unshare")
            .args(["--fork", "--kill-child", "--pid", "--mount", "--uts", "--ipc"])
            .args(if net { &["--net"][..] } else { &[][..] })
            .arg(bin)
            .arg("--listen")
            .arg(listen.map(str::to_owned).unwrap_or_else(|| format!("unix:{}", sock.display())))
            .args(["--mode", mode, "--state-dir"])
            .arg(dir.path().join("state"))
            .args(["--cgroup-parent", &cgroup_parent])
            .args(&confinement)
            .args(flags)
            .env("BULKHEAD_AGENT_LOG", "info")
            .env("BULKHEAD_HELPER_LOG", std::env::var("BULKHEAD_HELPER_LOG").unwrap_or_else(|_| "error".into()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn unshare + agent");
        // Until `Agent` owns it, a failed start (a panic below) must still kill unshare, whose
        // --kill-child takes the agent with it.
        let mut child = KillOnDrop(Some(child));
        let deadline = Instant::now() + T;
        let client = loop {
            if listen.is_some() {
                match vsock_client(ports::AGENT_TTRPC).await {
                    Some(c) => break c,
                    None => {
                        assert!(
                            Instant::now() < deadline,
                            "vsock agent did not come up; log:\n{}",
                            read_log(dir.path())
                        );
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                }
            }
            if sock.exists() {
                if let Ok(c) = connect_agent(&sock, "e2e", Duration::from_secs(5)).await {
                    break c;
                }
            }
            assert!(Instant::now() < deadline, "agent did not come up; log:\n{}", read_log(dir.path()));
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Agent { dir, sock, cgroup_parent, child: child.0.take(), client, identified: Default::default() }
    }

    /// The agent's pid in the test's pid namespace (the child of `unshare`).
    pub fn agent_pid(&self) -> Option<i32> {
        let u = self.child.as_ref()?.id();
        let text = std::fs::read_to_string(format!("/proc/{u}/task/{u}/children")).ok()?;
        text.split_whitespace().next()?.parse().ok()
    }

    /// The agent that serves in namespace mode: the first run's child in its own user namespace
    /// (`guest_init::user_ns`), whose command line marks its minimal root.
    pub fn serving_pid(&self) -> Option<i32> {
        let first = self.agent_pid()?;
        let text = std::fs::read_to_string(format!("/proc/{first}/task/{first}/children")).ok()?;
        text.split_whitespace().filter_map(|p| p.parse::<i32>().ok()).find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|arg| arg == b"--in-minimal-root"))
        })
    }

    pub fn log(&self) -> String {
        read_log(self.dir.path())
    }

    /// Waits (bounded) for the agent process to exit on its own.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut()?;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = child.try_wait() {
                self.child = None;
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub async fn stream(&self, id: &str, exec: Option<&str>, kind: StreamKind) -> UnixStream {
        let mut s =
            dial_unix(&self.sock, ports::AGENT_STREAMS, Duration::from_secs(5)).await.expect("dial stream port");
        StreamHeader::new(id, exec, kind).open(&mut s, Duration::from_secs(5)).await.expect("stream attach");
        s
    }

    /// Gives the sandbox its identity (an empty SetupSandbox, which changes nothing), as the shim
    /// does before any container; tests of SetupSandbox itself send their own first.
    pub async fn identify(&self) -> ttrpc::Result<()> {
        self.client.setup_sandbox(ctx(), &SetupSandboxRequest::default()).await.map(|_| ())
    }

    pub async fn create(&self, id: &str, spec: &Value, terminal: bool) -> ttrpc::Result<u32> {
        if !self.identified.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.identify().await?;
        }
        let req = CreateContainerRequest {
            container_id: id.into(),
            oci_spec_json: serde_json::to_vec(spec).unwrap(),
            stdio: Some(StdioConfig { terminal, stdin: false, ..Default::default() }).into(),
            ..Default::default()
        };
        self.client.create_container(ctx(), &req).await.map(|r| r.pid)
    }

    /// Creates a container without a terminal; panics with the agent's log on failure.
    pub async fn create_ok(&self, id: &str, spec: &Value) -> u32 {
        self.create(id, spec, false).await.unwrap_or_else(|e| panic!("create: {e}\n{}", self.log()))
    }

    pub async fn start_ctr(&self, id: &str) {
        let req = StartContainerRequest { container_id: id.into(), ..Default::default() };
        self.client.start_container(ctx(), &req).await.unwrap_or_else(|e| panic!("start {id}: {e}\n{}", self.log()));
    }

    pub async fn wait(&self, id: &str, exec: &str) -> WaitProcessResponse {
        self.wait_ms(id, exec, T.as_millis() as u64)
            .await
            .unwrap_or_else(|e| panic!("wait {id}/{exec}: {e}\n{}", self.log()))
    }

    pub async fn wait_ms(&self, id: &str, exec: &str, ms: u64) -> ttrpc::Result<WaitProcessResponse> {
        let req = WaitProcessRequest { container_id: id.into(), exec_id: exec.into(), ..Default::default() };
        self.client.wait_process(ctx_ms(ms), &req).await
    }

    pub async fn exec(&self, id: &str, exec: &str, args: &[&str], terminal: bool) -> ttrpc::Result<u32> {
        self.exec_io(id, exec, args, terminal, false).await
    }

    pub async fn exec_io(
        &self,
        id: &str,
        exec: &str,
        args: &[&str],
        terminal: bool,
        stdin: bool,
    ) -> ttrpc::Result<u32> {
        let process = json!({
            "terminal": terminal,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
        });
        let req = ExecProcessRequest {
            container_id: id.into(),
            exec_id: exec.into(),
            process_json: serde_json::to_vec(&process).unwrap(),
            stdio: Some(StdioConfig { terminal, stdin, ..Default::default() }).into(),
            ..Default::default()
        };
        self.client.exec_process(ctx(), &req).await.map(|r| r.pid)
    }

    pub async fn signal(&self, id: &str, exec: &str, sig: i32) -> ttrpc::Result<()> {
        let req = SignalProcessRequest {
            container_id: id.into(),
            exec_id: exec.into(),
            signal: sig as u32,
            ..Default::default()
        };
        self.client.signal_process(ctx(), &req).await.map(|_| ())
    }

    pub async fn remove(&self, id: &str) {
        let req = RemoveContainerRequest { container_id: id.into(), force: true, ..Default::default() };
        self.client.remove_container(ctx(), &req).await.unwrap_or_else(|e| panic!("remove {id}: {e}\n{}", self.log()));
    }
}

struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Kill the agent (PID 1 of its namespace: everything below dies with it) and let
        // unshare reap it, so no zombie is left to the host's init; bounded, then force.
        if let Some(pid) = self.agent_pid() {
            // SAFETY: plain kill(2) on the agent we started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if self.wait_exit(Duration::from_secs(5)).is_none() {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        // Best effort: the per-test cgroup parent in every v1 controller (or v2). Killed
        // processes leave their cgroups asynchronously, so retry briefly (bounded).
        let rel = self.cgroup_parent.trim_start_matches('/');
        for _ in 0..40 {
            let mut left = false;
            let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
            if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
                roots.extend(rd.flatten().map(|e| e.path()));
            }
            for root in roots {
                let p = root.join(rel);
                if p.exists() && remove_cgroup_tree(&p).is_err() {
                    left = true;
                }
            }
            if !left {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn remove_cgroup_tree(p: &Path) -> std::io::Result<()> {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                let _ = remove_cgroup_tree(&e.path());
            }
        }
    }
    std::fs::remove_dir(p)
}

fn read_log(dir: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(dir.join("agent.log")) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// A busybox rootfs: /bin/busybox plus one symlink per applet.
pub fn busybox_rootfs(parent: &Path, name: &str) -> PathBuf {
    let root = parent.join(name);
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc", "shared", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let out = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&out.stdout).lines() {
        if applet != "busybox" && !applet.is_empty() {
            let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(applet));
        }
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\ntty:x:5:\n").unwrap();
    root
}

const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
];

/// [`spec`] with no extra mounts and no resource limits.
pub fn plain_spec(rootfs: &Path, args: &[&str]) -> Value {
    spec(rootfs, args, vec![], json!({}))
}

/// A runc-like default spec for `args` on `rootfs`, with extra mounts and resources.
pub fn spec(rootfs: &Path, args: &[&str], extra_mounts: Vec<Value>, resources: Value) -> Value {
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    mounts.extend(extra_mounts);
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {"bounding": CAPS, "effective": CAPS, "permitted": CAPS},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": "ctr",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}],
            "resources": resources,
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        }
    })
}

/// Reads `s` until EOF, bounded.
pub async fn read_all(s: &mut UnixStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .expect("stream did not reach EOF in time")
        .expect("stream read");
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads from `s` until `out` contains `needle`, bounded; returns everything read.
pub async fn read_until(s: &mut UnixStream, acc: &mut String, needle: &str) {
    let deadline = Instant::now() + T;
    let mut buf = [0u8; 4096];
    while !acc.contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, s.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {needle:?}; got {acc:?}"))
            .expect("read");
        assert!(n > 0, "EOF before {needle:?}; got {acc:?}");
        acc.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
}

pub fn code_of(e: &ttrpc::Error) -> ttrpc::Code {
    match e {
        ttrpc::Error::RpcStatus(s) => s.code(),
        _ => ttrpc::Code::UNKNOWN,
    }
}

/// Whether this kernel routes vsock to the local CID (vsock_loopback).
pub async fn vsock_loopback_works() -> bool {
    use tokio_vsock::{VsockAddr, VsockListener, VsockStream, VMADDR_CID_ANY, VMADDR_CID_LOCAL};
    let Ok(l) = VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, 47011)) else {
        return false;
    };
    let accept = tokio::spawn(async move { l.accept().await.is_ok() });
    let ok = matches!(
        tokio::time::timeout(Duration::from_secs(1), VsockStream::connect(VsockAddr::new(VMADDR_CID_LOCAL, 47011)))
            .await,
        Ok(Ok(_))
    );
    accept.abort();
    ok
}

/// A ttrpc client over vsock to the local CID (no preamble: on vsock the VMM answers it).
pub async fn vsock_client(port: u32) -> Option<AgentClient> {
    use tokio_vsock::{VsockAddr, VsockStream, VMADDR_CID_LOCAL};
    let s = tokio::time::timeout(Duration::from_secs(1), VsockStream::connect(VsockAddr::new(VMADDR_CID_LOCAL, port)))
        .await
        .ok()?
        .ok()?;
    let c = AgentClient::new(ttrpc::r#async::Client::new(ttrpc::r#async::transport::Socket::new(s)));
    let req = VersionRequest { protocol_version: bulkhead_protocol::PROTOCOL_VERSION, ..Default::default() };
    c.version(ctx(), &req).await.ok()?;
    Some(c)
}
