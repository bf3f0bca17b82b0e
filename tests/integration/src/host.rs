//! What a test looks at on the host to say "nothing of the pod is left": processes by their
//! command line, mounts, containerd's shim sockets, and polling until leftovers are gone.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::Containerd;

/// The pids of pod `pod_id`'s shim (serve mode; its namespace launcher left out).
pub fn pod_shim_pids(pod_id: &str) -> Vec<u32> {
    processes_with("containerd-shim-bulkhead-v2")
        .into_iter()
        .filter(|(_, cmd)| cmd.contains(pod_id) && !cmd.contains("__bulkhead-ns-launch"))
        .map(|(pid, _)| pid)
        .collect()
}

/// Host pids (other than this test's) whose command line contains `needle`, with that line.
pub fn processes_with(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == std::process::id() {
            continue;
        }
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// Resident memory (VmRSS, KiB) of process `pid` and every process below it: a VM's host
/// footprint, whether the VMM is the pid itself or its jailed child (bulkhead-vmm's waiter, the
/// stand-in's QEMU).
pub fn tree_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("pid {pid}"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0);
    let mut total = rss;
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).with_context(|| format!("pid {pid}'s threads"))?;
    for task in tasks.flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
            // A child that exited meanwhile has no footprint left.
            total += tree_rss_kib(child).unwrap_or(0);
        }
    }
    Ok(total)
}

/// Lines of this process's mountinfo that contain `needle`.
pub fn mounts_with(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// containerd's shim socket for `group` (same hash as the shim computes).
pub fn shim_socket(containerd: &Containerd, group: &str) -> PathBuf {
    use sha2::{Digest, Sha256};
    let key = containerd.address().join("k8s.io").join(group);
    let hash = hex::encode(Sha256::digest(key.display().to_string().as_bytes()));
    PathBuf::from(format!("/run/containerd/s/{hash}"))
}

/// Polls `check` (which returns what is still left over) until it is empty or `within` passes.
pub async fn eventually_nothing(what: &str, within: Duration, check: impl Fn() -> Vec<String>) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let left = check();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{what} still present after {within:?}: {left:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What is left in a shim's `state_dir`: every entry but the node's metrics directory
/// (`.metrics`, which stays for the node exporter), and whatever that directory still holds.
pub fn state_left(state_dir: &Path) -> Vec<String> {
    let list = |dir: &Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
    };
    let mut left = Vec::new();
    for path in list(state_dir) {
        if path.file_name().is_some_and(|n| n == ".metrics") {
            left.extend(list(&path));
        } else {
            left.push(path);
        }
    }
    left.into_iter().map(|p| p.display().to_string()).collect()
}

/// The pod's `bulkhead_output_dropped_bytes_total`, from its shim's metrics socket
/// (`<backend state dir>/.metrics/<pod id>.sock`, in whichever state dir under `state_root` runs it).
pub fn dropped_output(state_root: &Path, pod_id: &str) -> Result<u64> {
    use std::io::{Read, Write};
    let socket = std::fs::read_dir(state_root)?
        .flatten()
        .map(|backend| backend.path().join(".metrics").join(format!("{pod_id}.sock")))
        .find(|s| s.exists())
        .context("the pod's metrics socket")?;
    let mut stream = std::os::unix::net::UnixStream::connect(&socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let line = text.lines().find(|l| l.starts_with("bulkhead_output_dropped_bytes_total")).context("the metric")?;
    Ok(line.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as u64)
}

/// A directory that is a shared mount of its own, as kubelet's pod directories are on a node
/// whose `/` is shared (systemd's default): a bind of it that is not made private receives every
/// mount made under it later. Unmounted (with what is under it) on drop.
pub struct SharedDir {
    dir: tempfile::TempDir,
}

impl SharedDir {
    pub fn new() -> Result<Self> {
        use nix::mount::{mount, MsFlags};
        let dir = tempfile::tempdir()?;
        mount(Some(dir.path()), dir.path(), None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .with_context(|| format!("bind {} onto itself", dir.path().display()))?;
        let shared = Self { dir };
        mount(None::<&str>, shared.path(), None::<&str>, MsFlags::MS_SHARED, None::<&str>)
            .with_context(|| format!("make {} shared", shared.path().display()))?;
        Ok(shared)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A tmpfs mounted at `at` on the host (a directory that exists) holding a file `secret`, as a
/// node mounts another pod's secret volume under kubelet's directory; detached on drop.
pub struct LaterMount {
    at: PathBuf,
}

impl LaterMount {
    pub fn new(at: &Path) -> Result<Self> {
        use nix::mount::{mount, MsFlags};
        mount(Some("tmpfs"), at, Some("tmpfs"), MsFlags::empty(), Some("size=1m,mode=0755"))
            .with_context(|| format!("mount a tmpfs at {}", at.display()))?;
        let later = Self { at: at.to_owned() };
        std::fs::write(at.join("secret"), "host-secret\n")?;
        Ok(later)
    }
}

impl Drop for LaterMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.at, nix::mount::MntFlags::MNT_DETACH);
    }
}
