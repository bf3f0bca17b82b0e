//! A scratch root laid out like a node, a private containerd started from that root's config (the system's 1.6, or
//! the 2.1 `make setup` unpacks, as `bulkhead_integration::ContainerdVersion` finds them), a fake shim that records
//! how it was called, and a local pause image. Only processes started here are stopped, by PID.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bulkhead_integration::ContainerdVersion;
use bulkhead_node_installer::error::{Error, Result as IResult};
use bulkhead_node_installer::installer::Settings;
use bulkhead_node_installer::node_paths::NodePaths;
use bulkhead_node_installer::restart::Restarter;
use serde_json::json;
use sha2::{Digest, Sha256};

pub const CONTAINERD: &str = "/usr/bin/containerd";
pub const PAUSE_IMAGE: &str = "bulkhead.test/pause:1";

/// Prints one SKIPPED line and returns false when this host cannot run the real-containerd tests.
pub fn can_run_containerd() -> bool {
    can_run_containerd_on(ContainerdVersion::V1_6)
}

/// [`can_run_containerd`] for containerd `version` (1.7 and 2.1: unpacked by `make setup`).
pub fn can_run_containerd_on(version: ContainerdVersion) -> bool {
    let test = std::thread::current().name().unwrap_or("real containerd test").to_string();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return !bulkhead_integration::skip::missing_prerequisite(&test, "real containerd tests need root");
    }
    for bin in [CONTAINERD, "/usr/bin/ctr"] {
        if !Path::new(bin).exists() {
            return !bulkhead_integration::skip::missing_prerequisite(
                &test,
                &format!("{bin} not installed (make setup)"),
            );
        }
    }
    if let Some(reason) = version.missing() {
        return !bulkhead_integration::skip::missing_prerequisite(&test, &reason);
    }
    true
}

pub struct Node {
    pub dir: tempfile::TempDir,
    pub artifacts: tempfile::TempDir,
}

impl Node {
    pub fn root(&self) -> &Path {
        self.dir.path()
    }
    pub fn config(&self) -> PathBuf {
        self.root().join("etc/containerd/config.toml")
    }
    pub fn socket(&self) -> PathBuf {
        self.root().join("run/containerd/containerd.sock")
    }
    /// Every line the fake shim appended: one per invocation.
    pub fn shim_calls(&self) -> Vec<String> {
        fs::read_to_string(self.artifacts.path().join("shim-calls.log"))
            .map(|s| s.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }

    pub fn settings(&self) -> Settings {
        Settings {
            layout: NodePaths::new(self.root(), self.root()),
            artifacts_dir: self.artifacts.path().join("image"),
            version: "0.1.0-test".into(),
            containerd_socket: "/run/containerd/containerd.sock".into(),
            startup_taint: Some("bulkhead.io/not-ready".into()),
            allow_pvm: false,
            cri_timeout: Duration::from_secs(30),
            gc_grace: Duration::ZERO,
            templates: Default::default(),
        }
    }

    /// The node's files the installer may touch (containerd's own root/state/logs excluded), with contents.
    pub fn snapshot(&self) -> Vec<(String, Vec<u8>)> {
        let mut out = vec![];
        for top in ["etc", "opt", "dev", "proc"] {
            walk(&self.root().join(top), self.root(), &mut out);
        }
        out.sort();
        out
    }
}

fn walk(p: &Path, root: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    let rel = p.strip_prefix(root).map(|r| r.display().to_string()).unwrap_or_default();
    let Ok(meta) = fs::symlink_metadata(p) else { return };
    if meta.is_dir() {
        out.push((format!("{rel}/"), vec![]));
        let mut entries: Vec<_> = fs::read_dir(p).map(|r| r.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        entries.sort();
        for e in entries {
            walk(&e, root, out);
        }
    } else if meta.file_type().is_symlink() {
        out.push((
            format!("{rel} -> {}", fs::read_link(p).map(|l| l.display().to_string()).unwrap_or_default()),
            vec![],
        ));
    } else {
        out.push((rel, fs::read(p).unwrap_or_default()));
    }
}

/// The user's own containerd config (version 2), as a node would have it.
pub fn user_config(root: &Path) -> String {
    let r = root.display();
    format!(
        r#"# The node's own config: the installer must never rewrite this.
version = 2
root = "{r}/var/lib/containerd"
state = "{r}/run/containerd"

[grpc]
  address = "{r}/run/containerd/containerd.sock"

[ttrpc]
  address = "{r}/run/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{r}/var/lib/containerd-opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{r}/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"#
    )
}

/// The user's own containerd 2.x config (version 3), as a node would have it: its CRI settings partly in a file of
/// its own that the main config imports (`etc/containerd/user.toml`, [`user_import_v3`]). NRI is off: on by default
/// in 2.x, it takes one host-wide socket that concurrent test containerds would fight over.
pub fn user_config_v3(root: &Path) -> String {
    let r = root.display();
    format!(
        r#"# The node's own config: the installer must never rewrite this.
version = 3
root = "{r}/var/lib/containerd"
state = "{r}/run/containerd"
imports = ["{r}/etc/containerd/user.toml"]

[grpc]
  address = "{r}/run/containerd/containerd.sock"

[ttrpc]
  address = "{r}/run/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{r}/var/lib/containerd-opt"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "{r}/etc/cni/net.d"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"#
    )
}

/// The file [`user_config_v3`] imports: settings a drop-in must not lose (2.x merges imports key by key).
pub fn user_import_v3() -> String {
    format!(
        r#"version = 3

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  NoNewKeyring = true
"#
    )
}

/// Lay out the scratch node: containerd config, /opt, a VMX cpuinfo and a /dev/kvm stand-in; and an image
/// artifact dir whose shim is a script that logs its arguments and fails.
pub fn node(kvm: bool) -> Node {
    let dir = tempfile::Builder::new().prefix("bhn").tempdir_in("/tmp").expect("tempdir");
    let artifacts = tempfile::Builder::new().prefix("bha").tempdir_in("/tmp").expect("tempdir");
    let r = dir.path();
    for d in ["etc/containerd", "etc/cni/net.d", "opt", "dev", "proc", "run/containerd", "var/lib"] {
        fs::create_dir_all(r.join(d)).expect("mkdir");
    }
    fs::write(r.join("etc/containerd/config.toml"), user_config(r)).expect("config");
    fs::write(r.join("proc/cpuinfo"), "processor\t: 0\nflags\t\t: fpu vmx sse2\n\n").expect("cpuinfo");
    if kvm {
        fs::write(r.join("dev/kvm"), "").expect("kvm");
    }
    let img = artifacts.path().join("image");
    fs::create_dir_all(&img).expect("mkdir");
    let log = artifacts.path().join("shim-calls.log");
    let shim = format!("#!/bin/sh\necho \"$*\" >> {}\necho 'fake bulkhead shim' >&2\nexit 1\n", log.display());
    write_exec(&img.join("containerd-shim-bulkhead-v2"), &shim);
    write_exec(&img.join("bulkhead-vmm"), "#!/bin/sh\nexit 0\n");
    write_exec(&img.join("virtiofsd"), "#!/bin/sh\nexit 0\n");
    fs::write(img.join("vmlinux"), vec![0x7fu8; 4096]).expect("kernel");
    fs::write(img.join("initramfs.cpio.gz"), vec![0x1fu8; 2048]).expect("initramfs");
    Node { dir, artifacts }
}

/// [`node`] with the user's version-3 config ([`user_config_v3`] and its import) in place of the version-2 one.
pub fn node_v3(kvm: bool) -> Node {
    let node = node(kvm);
    fs::write(node.config(), user_config_v3(node.root())).expect("config");
    fs::write(node.root().join("etc/containerd/user.toml"), user_import_v3()).expect("user import");
    node
}

/// Makes the image's shim an ELF (a copy of `sleep`) instead of the recording script, so that a process can
/// execute the installed shim binary: the kernel records a script's process as executing its interpreter.
pub fn elf_shim(node: &Node) {
    let shim = node.artifacts.path().join("image/containerd-shim-bulkhead-v2");
    fs::copy("/bin/sleep", &shim).expect("copy sleep");
}

/// A stand-in for a running bulkhead pod, the way the installer tells one: a process executing the installed shim
/// binary, started through `current` as containerd starts a shim, and the shim's own pod record naming it (written
/// with the shim crate's `PodRecord`) in the node's shim state dir. Dropping it ends the process, by its PID, and
/// removes the pod dir, as the shim's cleanup does.
pub struct FakePod {
    child: Child,
    pub dir: PathBuf,
}

impl FakePod {
    pub fn start(node: &Node, id: &str, name: &str) -> Self {
        let shim = node.root().join("opt/bulkhead/current/containerd-shim-bulkhead-v2");
        let child = Command::new(&shim).arg("3600").stdin(Stdio::null()).spawn().expect("start fake shim");
        let state = node.root().join("run/bulkhead");
        let paths = bulkhead_shim::sandbox::paths::PodPaths::new(&state, id).expect("plain id");
        fs::create_dir_all(&paths.dir).expect("pod dir");
        bulkhead_shim::sandbox::paths::PodRecord {
            sandbox_id: id.into(),
            pod_name: name.into(),
            pod_namespace: "default".into(),
            containerd_namespace: "k8s.io".into(),
            backend: "vm".into(),
            shim_pid: child.id(),
            pids: bulkhead_shim::sandbox::paths::HostPids { sandbox: child.id(), vmm: None, virtiofsd: None },
            started_at_unix: 1_700_000_000,
        }
        .write(&paths)
        .expect("pod record");
        Self { child, dir: paths.dir }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the kernel says the process executes.
    pub fn exe(&self) -> PathBuf {
        fs::read_link(format!("/proc/{}/exe", self.child.id())).expect("read exe")
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn stop(&mut self) {
        if self.is_running() {
            // SAFETY: kill(2) on the PID of the child this helper spawned and has not reaped (checked just above).
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for FakePod {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn write_exec(p: &Path, text: &str) {
    fs::write(p, text).expect("write");
    fs::set_permissions(p, fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Starts and restarts the scratch node's containerd by PID file: the installer binary's `--restart-command`
/// (`<path> restart`). Dropping it stops that containerd, by its PID.
pub struct Script {
    pub path: PathBuf,
    pidfile: PathBuf,
    count: PathBuf,
}

impl Script {
    pub fn new(node: &Node) -> Self {
        let a = node.artifacts.path();
        let (path, pidfile, count) = (a.join("ctd.sh"), a.join("containerd.pid"), a.join("restarts"));
        let text = format!(
            "#!/bin/sh\nPIDFILE={pid}\nif [ \"$1\" = restart ] && [ -s $PIDFILE ]; then\n  pid=$(cat $PIDFILE)\n  kill $pid 2>/dev/null\n  i=0\n  \
             while [ -d /proc/$pid ] && [ \"$(cut -d' ' -f3 /proc/$pid/stat 2>/dev/null)\" != Z ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done\n  \
             echo restart >> {count}\nfi\n{ctd} --config {cfg} >>{log} 2>&1 </dev/null &\necho $! > $PIDFILE\n",
            pid = pidfile.display(),
            count = count.display(),
            ctd = CONTAINERD,
            cfg = node.config().display(),
            log = a.join("containerd.log").display(),
        );
        write_exec(&path, &text);
        Self { path, pidfile, count }
    }

    pub fn run(&self, mode: &str) {
        // Another test thread's fork may still hold the script's write fd (until its child execs): exec then
        // fails with ETXTBSY for that moment, so try again, briefly.
        for _ in 0..100 {
            match Command::new(&self.path).arg(mode).status() {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                status => {
                    assert!(status.expect("script").success());
                    return;
                }
            }
        }
        panic!("{} stayed busy (ETXTBSY) for a second", self.path.display());
    }

    pub fn restarts(&self) -> usize {
        fs::read_to_string(&self.count).map(|s| s.lines().count()).unwrap_or(0)
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // Stop the containerd this test started, by its PID.
        if let Some(pid) = fs::read_to_string(&self.pidfile).ok().and_then(|s| s.trim().parse::<i32>().ok()) {
            // SAFETY: plain kill(2) on a PID this test's script started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                if stat.split(' ').nth(2) == Some("Z") {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A containerd the test owns; `restart` is the installer's injected restart.
pub struct Containerd {
    config: PathBuf,
    log: PathBuf,
    version: ContainerdVersion,
    child: Mutex<Option<Child>>,
    pub restarts: AtomicUsize,
}

impl Containerd {
    pub fn start(node: &Node) -> Self {
        Self::start_on(node, ContainerdVersion::V1_6)
    }

    /// The node's containerd, of `version`.
    pub fn start_on(node: &Node, version: ContainerdVersion) -> Self {
        let c = Self {
            config: node.config(),
            log: node.root().join("var/containerd.log"),
            version,
            child: Mutex::new(None),
            restarts: AtomicUsize::new(0),
        };
        c.spawn().expect("start containerd");
        println!("containerd {version}");
        c
    }

    pub fn version(&self) -> ContainerdVersion {
        self.version
    }

    fn spawn(&self) -> std::io::Result<()> {
        let log = fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut command = match self.version.bin_dir() {
            None => Command::new(CONTAINERD),
            Some(bin) => {
                let mut c = Command::new(bin.join("containerd"));
                // Its own shims (containerd-shim-runc-v2) before the system's.
                c.env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()));
                c
            }
        };
        let child = command
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        *self.child.lock().expect("lock") = Some(child);
        Ok(())
    }

    /// Stops containerd (by its PID) and leaves it down, as a restart that failed would.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().expect("lock").take() else { return };
        // SAFETY: signalling the PID of the child we spawned and have not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    pub fn log_tail(&self) -> String {
        let s = fs::read_to_string(&self.log).unwrap_or_default();
        s.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    pub fn restart_count(&self) -> usize {
        self.restarts.load(Ordering::SeqCst)
    }
}

impl Restarter for Containerd {
    fn restart(&self) -> IResult<()> {
        self.stop();
        self.spawn().map_err(|e| Error::Restart(e.to_string()))?;
        self.restarts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

fn tar_file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32) {
    let mut h = tar::Header::new_ustar();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_cksum();
    b.append_data(&mut h, path, data).expect("tar append");
}

/// An OCI image-layout tarball holding a one-file pause image (no registry is reachable here).
pub fn pause_image_tar(dir: &Path) -> PathBuf {
    let mut layer = tar::Builder::new(Vec::new());
    tar_file(&mut layer, "pause", b"#!/bin/sh\nexec sleep 3600\n", 0o755);
    let layer = layer.into_inner().expect("tar");
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha(&layer))]},
    })
    .to_string();
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{}", sha(config.as_bytes())), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": format!("sha256:{}", sha(&layer)), "size": layer.len()}],
    })
    .to_string();
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": format!("sha256:{}", sha(manifest.as_bytes())), "size": manifest.len(),
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": PAUSE_IMAGE,
                                       "org.opencontainers.image.ref.name": "1"}}],
    })
    .to_string();
    let mut out = tar::Builder::new(Vec::new());
    tar_file(&mut out, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644);
    tar_file(&mut out, "index.json", index.as_bytes(), 0o644);
    for blob in [layer.as_slice(), config.as_bytes(), manifest.as_bytes()] {
        tar_file(&mut out, &format!("blobs/sha256/{}", sha(blob)), blob, 0o644);
    }
    let p = dir.join("pause.tar");
    fs::write(&p, out.into_inner().expect("tar")).expect("write image");
    p
}

/// Whether containerd (up again after a restart) reports `handler`.
pub async fn registered(node: &Node, handler: &str) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match bulkhead_node_installer::cri::handler_registered(&node.socket(), handler).await {
            Ok(r) => return r,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "containerd not answering: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Import the pause image into the k8s.io namespace (retrying while containerd comes up).
pub fn import_pause(node: &Node) {
    import_pause_on(node, ContainerdVersion::V1_6)
}

/// [`import_pause`] with the `ctr` of containerd `version`.
pub fn import_pause_on(node: &Node, version: ContainerdVersion) {
    let tar = pause_image_tar(node.artifacts.path());
    import_on(node, version, &tar);
}

/// Imports the OCI archive `tar` into the node's containerd, k8s.io namespace, with its version's `ctr`.
pub fn import_on(node: &Node, version: ContainerdVersion, tar: &Path) {
    let ctr = version.bin_dir().map_or_else(|| PathBuf::from("/usr/bin/ctr"), |d| d.join("ctr"));
    // 2.x's ctr imports through the transfer service, which unpacks only for its configured snapshotters (not
    // `native`); `--local` is the classic import that takes `--snapshotter`, as 1.x's ctr does.
    let local: &[&str] = if version.config_format() == 3 { &["--local"] } else { &[] };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(&ctr)
            .arg("--address")
            .arg(node.socket())
            .args(["-n", "k8s.io", "images", "import", "--snapshotter", "native"])
            .args(local)
            .arg(tar)
            .output()
            .expect("run ctr");
        if out.status.success() {
            return;
        }
        assert!(Instant::now() < deadline, "ctr import failed: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(300));
    }
}
