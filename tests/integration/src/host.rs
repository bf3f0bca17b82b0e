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

/// Host processes with `marker` in their command line whose parent's has not: a container's shell forks
/// for each command it runs, and until the child execs it carries the same command line.
pub fn top_processes_with(marker: &str) -> Vec<(u32, String)> {
    let found = processes_with(marker);
    let pids: Vec<u32> = found.iter().map(|(pid, _)| *pid).collect();
    found.into_iter().filter(|(pid, _)| parent_of(*pid).is_none_or(|p| !pids.contains(&p))).collect()
}

/// The parent pid of `pid`, from /proc/<pid>/stat (after the command name's closing parenthesis:
/// the state, then the parent).
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` and every process below it, parents first: a VM's processes, whether the VMM is the pid
/// itself or its jailed child (bulkhead-vmm's waiter, the stand-in's QEMU). Children that exit
/// meanwhile are left out.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut next = 0;
    while next < tree.len() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", tree[next])) else {
            next += 1;
            continue;
        };
        for task in tasks.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            tree.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
        next += 1;
    }
    tree
}

/// The host memory (KiB) a VM's RAM holds: the pages allocated in its guest memory, the largest
/// memfd a process of `pid`'s tree has open (both VMMs keep guest RAM in one memfd, shared with
/// virtiofsd). It is what the balloon gives back, by punching holes in that memfd. The processes'
/// RSS is not: QEMU's TCG adds translated code to its anonymous memory while the guest runs
/// (measured on the stand-in: 19 to 204 MiB in 25 s of a resize test), and virtiofsd's RSS counts
/// again the guest pages it has written into.
pub fn guest_memory_kib(pid: u32) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut largest: Option<std::fs::Metadata> = None;
    for process in process_tree(pid) {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{process}/fd")) else { continue };
        for fd in fds.flatten() {
            if !std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:")) {
                continue;
            }
            // stat follows the fd's link to the memfd itself; a fd closed meanwhile is skipped.
            let Ok(meta) = std::fs::metadata(fd.path()) else { continue };
            if largest.as_ref().is_none_or(|l| meta.size() > l.size()) {
                largest = Some(meta);
            }
        }
    }
    let meta = largest.with_context(|| format!("no process in pid {pid}'s tree has a memfd open"))?;
    // st_blocks counts 512-byte units: a memfd's allocated pages, whoever maps them.
    Ok(meta.blocks() / 2)
}

/// Whether this host can idmap a mount of the filesystem `dir` is on (tmpfs can from Linux 6.3, ext4 and xfs
/// from 5.12, overlayfs layers from 5.19): containerd 2.x idmaps a `hostUsers: false` pod's image layers, and
/// fails the container where it cannot. Tries it: a detached clone of `dir`, idmapped with a user namespace of a
/// short-lived child mapping 0 onto 2^20, never attached.
pub fn can_idmap(dir: &Path) -> Result<bool> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new("sleep");
    child.arg("30").stdin(std::process::Stdio::null());
    // SAFETY: unshare(2) only, between fork and exec.
    unsafe {
        child.pre_exec(|| nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER).map_err(std::io::Error::from));
    }
    let mut child = child.spawn().context("spawn a child in a user namespace")?;
    let pid = child.id();
    let probe = (|| -> Result<bool> {
        // The child unshares before it executes; until then its user namespace is still ours.
        let ours = std::fs::read_link("/proc/self/ns/user")?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_link(format!("/proc/{pid}/ns/user"))? == ours {
            anyhow::ensure!(Instant::now() < deadline, "the probe's child never unshared its user namespace");
            std::thread::sleep(Duration::from_millis(5));
        }
        for map in ["uid_map", "gid_map"] {
            std::fs::write(format!("/proc/{pid}/{map}"), "0 1048576 65536\n")?;
        }
        let userns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
        let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
        let flags = libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC;
        // SAFETY: open_tree(2) with a NUL-terminated path; returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
        let fd = i32::try_from(nix::errno::Errno::result(fd)?)?;
        // SAFETY: open_tree just returned it.
        let tree = unsafe { OwnedFd::from_raw_fd(fd) };
        let attr = libc::mount_attr {
            attr_set: libc::MOUNT_ATTR_IDMAP,
            attr_clr: 0,
            propagation: 0,
            userns_fd: u64::try_from(userns.as_raw_fd())?,
        };
        // SAFETY: mount_setattr(2) on our detached tree, an empty path and a mount_attr that outlives the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const libc::mount_attr,
                std::mem::size_of::<libc::mount_attr>(),
            )
        };
        Ok(rc == 0)
    })();
    let _ = child.kill();
    let _ = child.wait();
    probe
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A memfd's pages as the balloon frees them: written ones count, a punched hole no longer does.
    #[test]
    fn guest_memory_counts_a_memfds_pages_less_its_holes() -> Result<()> {
        let name = c"host-rs-test-guest-memory";
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: the fd was just created and nothing else owns it.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // Larger than any other memfd a test process has: the one the helper must pick.
        file.set_len(1 << 30)?;
        std::io::Write::write_all(&mut &file, &vec![1u8; 3 << 20])?;
        assert_eq!(guest_memory_kib(std::process::id())?, 3 << 10);
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: fallocate on our own open fd, within its size.
        assert_eq!(unsafe { libc::fallocate(file.as_raw_fd(), mode, 1 << 20, 1 << 20) }, 0);
        assert_eq!(guest_memory_kib(std::process::id())?, 2 << 10);
        Ok(())
    }

    #[test]
    fn guest_memory_of_a_tree_without_a_memfd_is_an_error() -> Result<()> {
        let mut child = std::process::Command::new("sleep").arg("30").spawn()?;
        assert!(process_tree(std::process::id()).contains(&child.id()), "a child is in its parent's tree");
        let err = guest_memory_kib(child.id()).map(|_| ()).unwrap_err().to_string();
        child.kill()?;
        child.wait()?;
        assert!(err.contains("no process in pid") && err.contains("memfd"), "{err}");
        Ok(())
    }
}
