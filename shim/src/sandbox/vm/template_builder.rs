//! Builds the `vm` backend's snapshot templates ([`TemplateBuilder`]). A template's VM is booted
//! exactly as a pod's ([`super::launch::launch`]: the jail, the pod's device set, a virtiofsd of its own
//! over an empty share, and for a key with NICs, taps on placeholder links in a network
//! namespace of its own: [`PlaceholderNetns`]), but with no pod: it runs until the agent says it listens
//! (its console's [`READY_LINE`]), before any SetupSandbox, so the share is not mounted and no
//! NIC is configured. Its NICs' links are down ([`Origin::Template`]); a pod's restore raises them. The VMM's API then writes the snapshot inside the jail, and its files are
//! copied (holes kept) into the store's staging directory, owned by root. The VM and everything
//! it left go, whatever happened.
//!
//! What the template VM's VMM wrote (its console, the snapshot) is in its `run/`, which its jail
//! uid owns: root opens those files with [`open_log`] (no link followed, no blocking open,
//! a regular file of one link only), so a FIFO there cannot hang a build that holds the key's
//! lock, nor a link (`state` -> /etc/shadow) put a host file into the store.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bulkhead_vmm_api::restore::{MEMORY_FILE, STATE_FILE};
use tracing::info;

use super::api::VmmApi;
use super::cleanup;
use super::console::open_log;
use super::launch::{launch, start_failure, Launched, Origin, Started};
use super::pod_dirs::VmLayout;
use super::shape::VmShape;
use super::template::{KeyInputs, TemplateBuilder};
use crate::config::Config;
use crate::network::placeholder::PlaceholderNetns;
use crate::sandbox::cgroups::PodCgroup;
use crate::sandbox::paths::PodPaths;
use crate::sandbox::supervise::Supervised;
use crate::sandbox::SandboxRequest;

/// What the agent prints once it accepts connections (`guest-agent/src/transport.rs`): the VM
/// is then as far as a template goes.
pub const READY_LINE: &str = "listening (vsock)";
/// How long the guest may take to get there (1.6 s of guest time under TCG; a loaded host).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the console is read while waiting.
const POLL: Duration = Duration::from_millis(20);
/// Bytes of console read per look: the ready line is looked for in what is new.
const CONSOLE_CHUNK: u64 = 64 << 10;
/// Writing the snapshot: the guest's memory, inside the jail.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// The snapshot's directory inside the jail (its writable run dir).
const JAIL_SNAPSHOT_DIR: &str = "/run/snapshot";
/// The cgroup namespace of template VMs (the shim's own tree, not a pod's).
const NAMESPACE: &str = "bulkhead-templates";

pub struct VmTemplateBuilder {
    config: Arc<Config>,
}

impl VmTemplateBuilder {
    pub fn new(config: Arc<Config>) -> Self {
        Self { config }
    }
}

#[async_trait]
impl TemplateBuilder for VmTemplateBuilder {
    async fn build(&self, inputs: &KeyInputs, dir: &Path) -> Result<(), String> {
        let BuildVm { id, paths, netns_path } = self.build_vm(inputs)?;
        // What a build killed midway left behind.
        self.discard(inputs).await;
        // The placeholder namespace's pin lives in the state dir, which on a fresh node no pod
        // has made yet (the first warm pod with a network failed there with ENOENT).
        paths.create_dir().map_err(|e| format!("the template VM's directory: {e}"))?;
        let netns = match inputs.nic_mtus.as_slice() {
            [] => None,
            mtus => Some(
                PlaceholderNetns::create(&netns_path, mtus)
                    .await
                    .map_err(|e| format!("the template's placeholder network: {e}"))?,
            ),
        };
        let req = SandboxRequest {
            sandbox_id: id.clone(),
            netns: netns.as_ref().map(|n| n.path().to_path_buf()),
            cgroup: PodCgroup::for_pod(&id, NAMESPACE, None),
            resources: Default::default(),
            log_dir: None,
            emptydirs: Default::default(),
            oom_score_adj: None,
            id_maps: None,
        };
        let shape =
            VmShape { vcpus: inputs.vcpus, online: inputs.vcpus, mem: inputs.memory_mib, mem_start: inputs.memory_mib };
        let mut started = Started::default();
        let result = match launch(&self.config, &req, &paths, &mut started, shape, Origin::Template).await {
            Ok(launched) => snapshot(&launched, dir).await,
            Err(e) => Err(e.to_string()),
        };
        started.stop().await;
        // Its taps and redirects (in the placeholder namespace) go first, then the namespace.
        cleanup(&paths).await;
        drop(netns);
        result
    }

    async fn discard(&self, inputs: &KeyInputs) {
        match self.build_vm(inputs) {
            Ok(BuildVm { paths, netns_path, .. }) => {
                // The VMM and virtiofsd by their pid files, then mounts, cgroups, the identity.
                cleanup(&paths).await;
                PlaceholderNetns::remove_at(&netns_path);
            }
            Err(e) => tracing::warn!(error = %e, "template: nothing to discard"),
        }
    }
}

/// Where a key's template VM lives while it is built: one key, one VM (under the key's lock).
struct BuildVm {
    id: String,
    paths: PodPaths,
    /// Beside the template VM's directory, not in it: a pinned namespace file cannot be removed.
    netns_path: PathBuf,
}

impl VmTemplateBuilder {
    fn build_vm(&self, inputs: &KeyInputs) -> Result<BuildVm, String> {
        let id = format!("tpl-{}", inputs.key().short());
        let paths = PodPaths::new(&self.config.state_dir, &id).ok_or_else(|| format!("bad template id {id}"))?;
        let netns_path = self.config.state_dir.join(format!("{id}.netns"));
        Ok(BuildVm { id, paths, netns_path })
    }
}

/// Waits for the guest's ready line, snapshots the VM into `dir` and checks what it wrote.
async fn snapshot(launched: &Launched, dir: &Path) -> Result<(), String> {
    let Launched { vmm, virtiofsd, layout, .. } = launched;
    let started = Instant::now();
    if let Err(why) = wait_ready(&layout.console_log(), vmm).await {
        let err = start_failure(&why, vmm, virtiofsd, layout, None).await;
        return Err(format!("the template VM never got ready: {err}"));
    }
    let booted = started.elapsed();
    let api = VmmApi::new(&layout.api_socket(), SNAPSHOT_TIMEOUT);
    if let Err(e) = api.snapshot(Path::new(JAIL_SNAPSHOT_DIR)).await {
        // Whether the VMM was still there says whose failure it was; the console says more.
        let vmm_state = match vmm.exit() {
            Some(exit) => format!("the VMM had exited with status {}{}", exit.status, vmm.said()),
            None => "the VMM was running".into(),
        };
        let err = start_failure(&format!("snapshot: {e} ({vmm_state})"), vmm, virtiofsd, layout, None).await;
        return Err(err.to_string());
    }
    let written = host_path(layout, JAIL_SNAPSHOT_DIR);
    // The VMM made this directory: opened once without following a link, its files are named
    // through the descriptor (`run/` itself is the shim's, in the root-owned chroot).
    let written =
        open_dir_nofollow(&written).map_err(|e| format!("the snapshot's directory {}: {e}", written.display()))?;
    let written = PathBuf::from(format!("/proc/self/fd/{}", written.as_raw_fd()));
    for name in [STATE_FILE, MEMORY_FILE] {
        copy_keeping_holes(&written.join(name), &dir.join(name))
            .map_err(|e| format!("copy {name} of the snapshot: {e}"))?;
    }
    info!(
        booted_ms = booted.as_millis() as u64,
        snapshot_ms = (started.elapsed() - booted).as_millis() as u64,
        "template VM snapshotted"
    );
    Ok(())
}

fn host_path(layout: &VmLayout, jail_path: &str) -> PathBuf {
    layout.chroot().join(jail_path.trim_start_matches('/'))
}

/// Until the console shows [`READY_LINE`]; an error if the VMM exits first or it takes longer
/// than [`READY_TIMEOUT`].
async fn wait_ready(console: &Path, vmm: &Supervised) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut seen = 0u64;
    // The end of what was read last, so that a line split across two reads is still found.
    let mut carry = Vec::new();
    loop {
        let (new, end) = read_from(console, seen)?;
        seen = end;
        carry.extend_from_slice(&new);
        if carry.windows(READY_LINE.len()).any(|w| w == READY_LINE.as_bytes()) {
            return Ok(());
        }
        let keep = carry.len().saturating_sub(READY_LINE.len());
        carry.drain(..keep);
        if let Some(exit) = vmm.exit() {
            return Err(format!("it exited (status {}) before its console said {READY_LINE:?}", exit.status));
        }
        if Instant::now() >= deadline {
            return Err(format!("its console did not say {READY_LINE:?} within {READY_TIMEOUT:?}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Up to [`CONSOLE_CHUNK`] bytes of `path` from `from`, and where the next read starts; nothing
/// while there is no console yet, an error if what is there is not a plain file
/// ([`open_log`]). A console that shrank (it never does) is read from its start again.
fn read_from(path: &Path, from: u64) -> Result<(Vec<u8>, u64), String> {
    let mut file = match open_log(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), from)),
        Err(e) => return Err(format!("its console {}: {e}", path.display())),
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let from = if len < from { 0 } else { from };
    if file.seek(SeekFrom::Start(from)).is_err() {
        return Ok((Vec::new(), from));
    }
    let mut bytes = Vec::new();
    let _ = file.take(CONSOLE_CHUNK).read_to_end(&mut bytes);
    let end = from + bytes.len() as u64;
    Ok((bytes, end))
}

/// A directory, opened without following a link (`O_PATH`: only to name what is in it).
fn open_dir_nofollow(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Bytes a plain copy moves per read and write: bounded, so a huge data extent costs no more
/// memory than this.
const COPY_CHUNK: usize = 1 << 20;

/// How [`copy_keeping_holes`] moved the data: what the tests check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyWay {
    /// `copy_file_range(2)` all along.
    Kernel,
    /// Reads and writes, because the kernel refused (EXDEV between two filesystems, as from the
    /// state dir on tmpfs to the template store on disk) or was never asked.
    ReadWrite,
}

/// Copies `from` to a new file `to` (mode 0600, this process's), data extents only: the guest's
/// memory file is mostly holes, which stay holes.
fn copy_keeping_holes(from: &Path, to: &Path) -> std::io::Result<()> {
    copy_keeping_holes_by(from, to, CopyWay::Kernel).map(|_| ())
}

/// [`copy_keeping_holes`], trying `way` first: `Kernel` falls back to `ReadWrite` for good when
/// `copy_file_range` cannot do this pair of files. Returns the way it ended with.
fn copy_keeping_holes_by(from: &Path, to: &Path, mut way: CopyWay) -> std::io::Result<CopyWay> {
    use nix::unistd::{lseek, Whence};
    use std::os::unix::fs::OpenOptionsExt;
    let src = open_log(from)?;
    let len = src.metadata()?.len();
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(to)?;
    dst.set_len(len)?;
    let mut buf = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        let data = match lseek(&src, pos as i64, Whence::SeekData) {
            Ok(off) => off as u64,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = (lseek(&src, data as i64, Whence::SeekHole)? as u64).min(len);
        let mut off = data;
        if way == CopyWay::Kernel {
            match kernel_copy(&src, &dst, &mut off, hole) {
                Ok(()) => {}
                // EXDEV: two filesystems the kernel will not copy between; the others: a
                // filesystem or kernel without it. The range goes on from where it stopped.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EXDEV | libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
                    ) =>
                {
                    info!(error = %e, from = %from.display(), to = %to.display(), "copy_file_range refused; copying by read and write");
                    way = CopyWay::ReadWrite;
                }
                Err(e) => return Err(e),
            }
        }
        if way == CopyWay::ReadWrite {
            plain_copy(&src, &dst, off, hole, &mut buf)?;
        }
        pos = hole;
    }
    dst.sync_all()?;
    Ok(way)
}

/// `copy_file_range` of `[*off, end)`; `*off` is how far it got, also on an error.
fn kernel_copy(src: &std::fs::File, dst: &std::fs::File, off: &mut u64, end: u64) -> std::io::Result<()> {
    while *off < end {
        let (mut off_in, mut off_out) = (*off as i64, *off as i64);
        let left = (end - *off) as usize;
        // SAFETY: both fds are open for the call; the offsets are this function's own cells.
        let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, left, 0) };
        match n {
            n if n > 0 => *off += n as u64,
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            _ => return Err(std::io::Error::last_os_error()),
        }
    }
    Ok(())
}

/// `[off, end)` of `src` to the same place in `dst` through `buf`, [`COPY_CHUNK`] at a time.
fn plain_copy(
    src: &std::fs::File,
    dst: &std::fs::File,
    mut off: u64,
    end: u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    buf.resize(COPY_CHUNK, 0);
    while off < end {
        let want = ((end - off) as usize).min(COPY_CHUNK);
        let n = src.read_at(&mut buf[..want], off)?;
        if n == 0 {
            // The file shrank under us: the snapshot is not what was written.
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        dst.write_all_at(&buf[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A 64 MiB file at `path` with 8 KiB of data at 8 MiB and 4 KiB at its end, holes elsewhere.
    fn sparse_file(path: &Path) {
        let mut f = std::fs::File::create(path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(8 << 20)).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        f.seek(SeekFrom::Start((64 << 20) - 4096)).unwrap();
        f.write_all(&[9u8; 4096]).unwrap();
    }

    fn assert_same_with_holes(from: &Path, to: &Path) {
        assert_eq!(std::fs::read(from).unwrap(), std::fs::read(to).unwrap());
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(to).unwrap().blocks() * 512;
        assert!(blocks < 1 << 20, "the holes stayed holes: {blocks} bytes allocated");
    }

    #[test]
    fn a_copy_keeps_the_data_and_the_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("memory"), dir.path().join("copy"));
        sparse_file(&from);
        copy_keeping_holes(&from, &to).unwrap();
        assert_same_with_holes(&from, &to);
        assert!(copy_keeping_holes(&from, &to).is_err(), "an existing file is not overwritten");
    }

    /// What a jail uid can leave in its `run/` in place of the snapshot: a FIFO (a plain open
    /// would wait for a writer forever, holding the key's lock), a link or a hard link to a host
    /// file (a plain open would copy it into the store). Each is refused at once, and nothing is
    /// written where the store would publish it.
    #[test]
    fn a_fifo_or_a_link_in_place_of_the_snapshot_is_refused_and_nothing_is_copied() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("shadow");
        std::fs::write(&secret, b"root:$6$secret").unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let hard = dir.path().join("hard");
        std::fs::hard_link(&secret, &hard).unwrap();
        for (from, says) in [(&fifo, "not a regular file"), (&link, "symbolic link"), (&hard, "2 links")] {
            let to = dir.path().join("copy");
            let err = copy_keeping_holes(from, &to).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("refused"), "{}: {err}", from.display());
            assert!(!to.exists(), "{}: nothing is copied", from.display());
        }
        // The console is opened the same way: a FIFO fails the wait at once.
        let err = read_from(&fifo, 0).unwrap_err();
        assert!(err.contains("not a regular file"), "{err}");
        // And the snapshot's directory is not reached through a link.
        let dir_link = dir.path().join("snapshot");
        std::os::unix::fs::symlink(dir.path(), &dir_link).unwrap();
        assert!(open_dir_nofollow(&dir_link).is_err());
        assert!(open_dir_nofollow(dir.path()).is_ok());
    }

    #[test]
    fn a_regular_snapshot_file_is_read_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        std::fs::write(&path, b"state").unwrap();
        let file = open_log(&path).unwrap();
        let flags =
            nix::fcntl::OFlag::from_bits_truncate(nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_GETFL).unwrap());
        assert!(!flags.contains(nix::fcntl::OFlag::O_NONBLOCK));
    }

    #[test]
    fn a_copy_by_read_and_write_keeps_the_data_and_the_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("memory"), dir.path().join("copy"));
        sparse_file(&from);
        assert_eq!(copy_keeping_holes_by(&from, &to, CopyWay::ReadWrite).unwrap(), CopyWay::ReadWrite);
        assert_same_with_holes(&from, &to);
    }

    /// The layout of a real node: the snapshot on tmpfs (the state dir under /run), the store on
    /// disk. Where the kernel refuses `copy_file_range` between them, this runs the fallback.
    #[test]
    fn a_copy_from_tmpfs_to_another_filesystem_keeps_the_data_and_the_holes() {
        use std::os::unix::fs::MetadataExt;
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            println!("SKIPPED: no writable /dev/shm");
            return;
        };
        let disk = tempfile::tempdir().unwrap();
        let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
        if dev(shm.path()) == dev(disk.path()) {
            println!("SKIPPED: /dev/shm and {} are one filesystem", disk.path().display());
            return;
        }
        let (from, to) = (shm.path().join("memory"), disk.path().join("copy"));
        sparse_file(&from);
        let way = copy_keeping_holes_by(&from, &to, CopyWay::Kernel).unwrap();
        println!("tmpfs -> {}: copied by {way:?}", disk.path().display());
        assert_same_with_holes(&from, &to);
    }

    #[test]
    fn the_console_is_read_on_from_where_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        assert_eq!(read_from(&console, 0).unwrap(), (Vec::new(), 0));
        std::fs::write(&console, b"booting\nlisten").unwrap();
        let (a, end) = read_from(&console, 0).unwrap();
        assert_eq!((a.as_slice(), end), (&b"booting\nlisten"[..], 14));
        std::fs::write(&console, b"booting\nlistening (vsock) port=1024\n").unwrap();
        let (b, end) = read_from(&console, end).unwrap();
        assert_eq!((b.as_slice(), end), (&b"ing (vsock) port=1024\n"[..], 36));
    }
}
