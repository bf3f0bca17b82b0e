//! A private containerd for one test: its own root, state, sockets and config in a temporary directory, of the
//! version the test asks for (`version`: the system's 1.6, or the 1.7 and 2.1 `make setup` unpacks), with the config
//! format that version reads (`config`). It is always stopped afterwards (success, failure or panic), and only the
//! PID the harness started is signalled.

mod config;
mod version;

pub use version::ContainerdVersion;

use crate::cri::Cri;
use crate::images;
use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Base for every harness directory; short, because Unix socket paths are limited.
const BASE_DIR: &str = "/var/lib/bulkhead-test";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_GRACE: Duration = Duration::from_secs(10);
const IMPORT_TIMEOUT: Duration = Duration::from_secs(120);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// One `[...containerd.runtimes.<name>]` entry of the CRI config.
#[derive(Clone, Debug)]
pub struct RuntimeHandler {
    pub name: String,
    /// `io.containerd.runc.v2`, or an absolute shim path (1.6.20 ignores `runtime_path`).
    pub runtime_type: String,
    /// String-valued `options` (for bulkhead: `ConfigPath`).
    pub options: Vec<(String, String)>,
    /// Pod annotations passed through to the runtime.
    pub pod_annotations: Vec<String>,
    /// An OCI spec every container of this handler starts from (CRI's `base_runtime_spec`).
    pub base_runtime_spec: Option<PathBuf>,
    /// Other string-valued keys of the runtime's table, as written (2.x's `sandboxer`, `io_type`...).
    pub settings: Vec<(String, String)>,
}

impl RuntimeHandler {
    pub fn runc() -> Self {
        Self {
            name: "runc".into(),
            runtime_type: "io.containerd.runc.v2".into(),
            options: vec![],
            pod_annotations: vec![],
            base_runtime_spec: None,
            settings: vec![],
        }
    }

    /// The `bulkhead` handler on the freshly built shim, with `config_path` as `ConfigPath`.
    pub fn bulkhead(config_path: Option<&Path>) -> Self {
        let shim = crate::workspace_bin("containerd-shim-bulkhead-v2");
        Self {
            name: "bulkhead".into(),
            runtime_type: shim.to_string_lossy().into_owned(),
            options: config_path
                .map(|p| vec![("ConfigPath".to_string(), p.to_string_lossy().into_owned())])
                .unwrap_or_default(),
            // What the node installer's drop-in lets through (node-installer/src/containerd/dropin.rs).
            pod_annotations: vec!["bulkhead.io/*".into()],
            base_runtime_spec: None,
            settings: vec![],
        }
    }
}

/// What to put in the private containerd's config.
#[derive(Clone, Debug)]
pub struct ContainerdConfig {
    pub handlers: Vec<RuntimeHandler>,
    /// A bridge CNI network for pod-network pods (host-network pods need none).
    pub cni_bridge: bool,
    /// Extra routes CNI gives every pod-network pod (with `cni_bridge`).
    pub cni_routes: Vec<CniRoute>,
    /// Raw TOML appended to the generated config.
    pub extra_toml: String,
    /// The umask containerd (and so every shim it starts) runs with; `None` keeps the test's.
    pub umask: Option<u32>,
    /// Which containerd to start; by default this run's ([`ContainerdVersion::from_env`]).
    pub version: ContainerdVersion,
}

impl Default for ContainerdConfig {
    /// `runc` plus `bulkhead` with no `ConfigPath` (the shim's default path applies).
    fn default() -> Self {
        Self {
            handlers: vec![RuntimeHandler::runc(), RuntimeHandler::bulkhead(None)],
            cni_bridge: false,
            cni_routes: Vec::new(),
            extra_toml: String::new(),
            umask: None,
            version: ContainerdVersion::default(),
        }
    }
}

/// A route for pod-network pods: `dst` (CIDR) via host `gateway_host` of the pod subnet, an
/// address a test's own namespace on the bridge holds (hosts 200-254 are never given to pods).
#[derive(Clone, Debug)]
pub struct CniRoute {
    pub dst: String,
    pub gateway_host: u8,
}

/// The harness's CNI bridge network: a /24, its hosts up to .199 given to pods, the rest left for
/// test stand-ins attached to the bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniNetwork {
    /// The Linux bridge in the host namespace (made by the bridge plugin with the first pod,
    /// removed when the harness stops).
    pub bridge: String,
    /// The first three octets of the /24.
    pub subnet: [u8; 3],
}

impl CniNetwork {
    fn for_port(port: u16) -> Self {
        Self { bridge: format!("bkt{port}"), subnet: [10, (200 + port % 50) as u8, (port % 250) as u8] }
    }

    /// Host `n` of the subnet.
    pub fn host(&self, n: u8) -> std::net::Ipv4Addr {
        let [a, b, c] = self.subnet;
        std::net::Ipv4Addr::new(a, b, c, n)
    }
}

/// A running private containerd. Dropping it removes all pods through CRI, stops the
/// daemon by PID, unmounts what it left under its directory, and deletes the directory.
pub struct Containerd {
    child: Option<Child>,
    dir: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    stream_port: u16,
    cni: Option<CniNetwork>,
    umask: Option<u32>,
    version: ContainerdVersion,
    /// What containerd's CRI says it is (`Version.runtime_version`), once it answered.
    runtime_version: String,
}

impl Containerd {
    /// Starts containerd with `config`, waits until CRI answers, and imports the local images.
    pub async fn start(config: ContainerdConfig) -> Result<Self> {
        std::fs::create_dir_all(BASE_DIR).with_context(|| format!("creating {BASE_DIR}"))?;
        let dir = tempfile::Builder::new()
            .prefix("c")
            .tempdir_in(BASE_DIR)
            .context("creating the containerd temp dir")?
            .keep();
        let stream_port = free_loopback_port()?;
        let mut this = Self {
            child: None,
            socket: dir.join("containerd.sock"),
            log: dir.join("containerd.log"),
            dir,
            stream_port,
            cni: config.cni_bridge.then(|| CniNetwork::for_port(stream_port)),
            umask: config.umask,
            version: config.version,
            runtime_version: String::new(),
        };
        if let Some(reason) = this.version.missing() {
            bail!("{reason}");
        }
        // From here on, `this` cleans up after itself if anything below fails.
        this.write_config(&config)?;
        this.spawn()?;
        this.wait_ready().await?;
        // One line per test: which containerd it ran on (libtest shows it with --show-output and on failure).
        println!("containerd {}", this.runtime_version);
        this.import_images().await?;
        Ok(this)
    }

    /// The containerd line this instance runs.
    pub fn version(&self) -> ContainerdVersion {
        self.version
    }

    /// The version containerd's CRI reports, e.g. `2.1.9+unknown` or `1.6.20~ds1`.
    pub fn runtime_version(&self) -> &str {
        &self.runtime_version
    }

    /// The `ctr` of this containerd's version.
    pub fn ctr(&self) -> PathBuf {
        self.version.ctr()
    }

    /// containerd's gRPC socket.
    pub fn address(&self) -> &Path {
        &self.socket
    }

    /// The directory holding this instance's config, root, state and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CNI bridge network, when the config asked for one.
    pub fn cni_network(&self) -> Option<&CniNetwork> {
        self.cni.as_ref()
    }

    /// containerd's own log (stdout and stderr), for failure messages.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of containerd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// PID of the containerd process, if running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub async fn cri(&self) -> Result<Cri> {
        Cri::connect(&self.socket).await
    }

    /// A new directory for pod logs, removed with this instance.
    pub fn new_log_dir(&self, name: &str) -> Result<PathBuf> {
        let d = self.dir.join("logs").join(name);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }

    fn write_config(&self, config: &ContainerdConfig) -> Result<()> {
        let toml = config::render(self.version, &self.dir, self.stream_port, images::PAUSE, config)?;
        std::fs::create_dir_all(self.dir.join("cni"))?;
        if let Some(cni) = &self.cni {
            let range = serde_json::json!({
                "subnet": format!("{}/24", cni.host(0)),
                "rangeEnd": cni.host(199).to_string(),
            });
            let routes: Vec<serde_json::Value> = config
                .cni_routes
                .iter()
                .map(|r| serde_json::json!({ "dst": r.dst, "gw": cni.host(r.gateway_host).to_string() }))
                .collect();
            let conflist = serde_json::json!({
                "cniVersion": "0.4.0",
                "name": "bulkhead-test",
                "plugins": [
                    { "type": "bridge", "bridge": cni.bridge, "isGateway": false, "ipMasq": false,
                      "ipam": { "type": "host-local", "ranges": [[range]], "routes": routes } },
                    { "type": "loopback" }
                ]
            });
            std::fs::write(self.dir.join("cni/10-bulkhead-test.conflist"), serde_json::to_vec_pretty(&conflist)?)?;
        }
        std::fs::write(self.dir.join("config.toml"), toml)?;
        Ok(())
    }

    /// Stops containerd by PID with SIGTERM, as systemd stops it (`KillMode=process`): its shims
    /// and their pods stay. Its config, root and state stay too, for [`Containerd::start_again`].
    pub fn stop(&mut self) {
        self.stop_daemon();
    }

    /// Starts the stopped containerd again on the same config, root and state, and waits until
    /// CRI answers: it finds its tasks again through their shims.
    pub async fn start_again(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("containerd is still running");
        }
        self.spawn()?;
        self.wait_ready().await
    }

    fn spawn(&mut self) -> Result<()> {
        use std::os::unix::process::CommandExt;
        let umask = self.umask;
        // Appended: a restarted containerd's log follows the first one's.
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut command = Command::new(self.version.containerd());
        if let Some(bin) = self.version.bin_dir() {
            // containerd looks its shims (containerd-shim-runc-v2) up on PATH first: its own, not the system's.
            let path = std::env::var("PATH").unwrap_or_default();
            command.env("PATH", format!("{}:{path}", bin.display()));
        }
        command
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(mask) = umask {
            // SAFETY: umask is async-signal-safe and changes only the child's own mask.
            unsafe {
                command.pre_exec(move || {
                    libc::umask(mask as libc::mode_t);
                    Ok(())
                });
            }
        }
        let child = command.spawn().with_context(|| {
            format!("spawning {} (is containerd {} installed?)", self.version.containerd().display(), self.version)
        })?;
        self.child = Some(child);
        Ok(())
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    self.child = None;
                    bail!("containerd exited during start-up ({status}); log tail:\n{}", self.log_tail(30));
                }
            }
            if self.socket.exists() {
                if let Ok(cri) = Cri::connect(&self.socket).await {
                    if let Ok(version) = cri.version().await {
                        self.runtime_version = version.runtime_version;
                        return Ok(());
                    }
                }
            }
            if start.elapsed() > READY_TIMEOUT {
                bail!("containerd not ready within {READY_TIMEOUT:?}; log tail:\n{}", self.log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn import_images(&self) -> Result<()> {
        let tarballs = images::build_all(&images_cache_dir())?;
        for tarball in [&tarballs.pause, &tarballs.busybox] {
            let out = tokio::time::timeout(
                IMPORT_TIMEOUT,
                tokio::process::Command::new(self.ctr())
                    .arg("--address")
                    .arg(&self.socket)
                    .args(["-n", "k8s.io", "images", "import"])
                    .arg(tarball)
                    .kill_on_drop(true)
                    .output(),
            )
            .await
            .map_err(|_| anyhow!("ctr images import {} timed out", tarball.display()))?
            .context("running ctr")?;
            if !out.status.success() {
                bail!("ctr images import {} failed: {}", tarball.display(), String::from_utf8_lossy(&out.stderr));
            }
        }
        // CRI learns about imported images asynchronously; wait until it lists both.
        let cri = self.cri().await?;
        let start = Instant::now();
        loop {
            let tags: Vec<String> = cri.list_images().await?.into_iter().flat_map(|i| i.repo_tags).collect();
            if [images::BUSYBOX, images::PAUSE].iter().all(|want| tags.iter().any(|t| t == want)) {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                bail!("CRI does not list the imported images; it has {tags:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Removes every pod through CRI, bounded; run from `Drop` on its own thread so it
    /// works whether or not the caller is inside a tokio runtime.
    fn remove_pods_blocking(&self) {
        let socket = self.socket.clone();
        let worker = std::thread::spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                tokio::time::timeout(CLEANUP_TIMEOUT, async { Cri::connect(&socket).await?.remove_all_pods().await })
                    .await
                    .map_err(|_| anyhow!("pod cleanup timed out"))?
            })
        });
        if let Ok(Err(e)) = worker.join() {
            eprintln!("harness: removing pods before stopping containerd: {e:#}");
        }
    }

    /// Shims of this containerd that outlived it (a test that failed before its pods were
    /// removed): they run in sessions of their own, so nothing else stops them. Found by the
    /// address they serve, killed by PID.
    fn kill_leftover_shims(&self) {
        let address = format!("-address {}", self.socket.display());
        for (pid, cmdline) in crate::host::processes_with(&address) {
            if cmdline.contains("containerd-shim") {
                eprintln!("harness: killing leftover shim {pid}");
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }

    fn stop_daemon(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < STOP_GRACE {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.child.is_some() && self.socket.exists() {
            self.remove_pods_blocking();
        }
        self.stop_daemon();
        self.kill_leftover_shims();
        if let Some(cni) = &self.cni {
            // The bridge plugin never removes its bridge; with the pods gone it is ours to remove.
            let _ = Command::new("ip").args(["link", "del", &cni.bridge]).output();
        }
        unmount_under(&self.dir);
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("harness: removing {}: {e}", self.dir.display());
        }
    }
}

/// Lazily unmounts every mount point below `dir`, deepest first.
pub fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn unescape_mount_path(s: &str) -> PathBuf {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from(String::from_utf8_lossy(&out).into_owned()))
}

fn free_loopback_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Where built image tarballs are cached between test processes.
fn images_cache_dir() -> PathBuf {
    crate::target_dir().join("bulkhead-test-images")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/a\040b/c"), PathBuf::from("/a b/c"));
        assert_eq!(unescape_mount_path("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape_mount_path(r"/trail\04"), PathBuf::from(r"/trail\04"));
    }

    #[test]
    fn cni_network_is_a_slash_24_with_room_for_stand_ins() {
        let net = CniNetwork::for_port(35335);
        assert_eq!(net.bridge, "bkt35335");
        assert_eq!(net.host(250), std::net::Ipv4Addr::new(10, 235, 85, 250));
    }
}
