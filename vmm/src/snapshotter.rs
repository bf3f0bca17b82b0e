//! Taking a snapshot of a running VM: collect vCPU, VM and device state of the paused VM and
//! write the state file and the memory file into a directory, each replaced atomically.
//!
//! The API thread pauses the vCPUs and posts the request ([`SnapshotRequests`]); the event loop
//! takes it ([`SnapshotService`]), so no device works while its state and guest memory are read,
//! and the API thread's seccomp list stays free of files and KVM. The vCPU threads save their
//! own registers (only a vCPU's thread may use its fd). What the host is (CPU fingerprint,
//! saveable MSRs) is probed when the VM is built ([`SnapshotHost`]), so the event loop needs no
//! `/dev/kvm` ioctl. Files are opened, renamed and removed relative to the snapshot directory's
//! fd, with fixed flags and an owner-only mode.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::SnapshotReport;
use event_manager::{EventOps, Events, MutEventSubscriber};
use kvm_ioctls::{Kvm, VmFd};
use nix::errno::Errno;
use nix::fcntl::{openat, renameat, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{unlinkat, UnlinkatFlags};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::config::ValidConfig;
use crate::device_manager::persist::SaveableDevices;
use crate::memory::{save_guest_memory, MemoryError};
use crate::snapshot::cpu::HostCpu;
use crate::snapshot::file::{self, SnapshotFileError};
use crate::snapshot::kvm::{self as kvm_state, KvmStateError};
use crate::snapshot::state::VmState;
use crate::snapshot::{MEMORY_FILE, STATE_FILE};
use crate::thread::{Mailbox, Slot};
use crate::vcpu::VcpuControl;

const SAVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the API thread waits for the event loop to write a snapshot (guest memory, fsync).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
const STATE_TMP: &str = ".state.tmp";
const MEMORY_TMP: &str = ".memory.tmp";

/// Flags of every file a snapshot opens. The seccomp list of the event loop allows `openat`
/// with exactly these (`seccomp/event_loop.rs`), and `mkdir` with exactly `DIR_MODE`.
pub const DIR_FLAGS: i32 = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
pub const FILE_FLAGS: i32 = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC | libc::O_NOFOLLOW;
/// Guest memory and registers may hold secrets: owner-only.
pub const FILE_MODE: u32 = 0o600;
pub const DIR_MODE: u32 = 0o700;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("this host cannot snapshot: {0}")]
    Host(String),
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error(transparent)]
    KvmState(#[from] KvmStateError),
    #[error("saving vCPU state: {0}")]
    Vcpus(String),
    #[error("{0}")]
    Device(String),
    #[error(transparent)]
    File(#[from] SnapshotFileError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// What a snapshot records about this host, probed once when the VM is built.
#[derive(Debug, Clone)]
pub struct SnapshotHost {
    pub cpu: HostCpu,
    /// The MSRs KVM can save here (KVM_GET_MSR_INDEX_LIST).
    pub msrs: Vec<u32>,
}

impl SnapshotHost {
    /// Refuses hosts whose XSAVE area outgrows the saved one (AMX).
    pub fn probe(kvm: &Kvm, cpu: HostCpu) -> Result<Self, SnapshotError> {
        kvm_state::check_xsave_size(kvm)?;
        Ok(Self { cpu, msrs: kvm_state::saveable_msrs(kvm)? })
    }
}

/// What a snapshot needs of a running VM.
pub struct Snapshotter {
    pub vm: Arc<VmFd>,
    pub mem: GuestMemoryMmap,
    pub devices: SaveableDevices,
    pub config: ValidConfig,
    pub irqchip: bool,
    /// This host, or why it cannot be snapshotted.
    pub host: Result<SnapshotHost, String>,
}

fn io<E: Into<std::io::Error>>(path: &Path) -> impl FnOnce(E) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.to_owned(), source: source.into() }
}

/// Opens `name` in `dir` for writing, fresh, owner-only, never through a symlink.
fn create_in(dir: &OwnedFd, dir_path: &Path, name: &str) -> Result<File, SnapshotError> {
    let flags = OFlag::from_bits_retain(FILE_FLAGS);
    let fd = openat(dir, name, flags, Mode::from_bits_truncate(FILE_MODE)).map_err(io(&dir_path.join(name)))?;
    Ok(File::from(fd))
}

/// The snapshot directory, created (one level, owner-only) if missing.
fn open_dir(dir: &Path) -> Result<OwnedFd, SnapshotError> {
    match nix::unistd::mkdir(dir, Mode::from_bits_truncate(DIR_MODE)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(io(dir)(e)),
    }
    nix::fcntl::open(dir, OFlag::from_bits_retain(DIR_FLAGS), Mode::empty()).map_err(io(dir))
}

impl Snapshotter {
    /// Writes a snapshot of the paused VM into `dir`. The VM stays paused.
    pub fn take(&self, control: &VcpuControl, dir: &Path) -> Result<SnapshotReport, SnapshotError> {
        let host = self.host.as_ref().map_err(|e| SnapshotError::Host(e.clone()))?;
        if let Some(reason) = self.devices.refuse_snapshot() {
            return Err(SnapshotError::Device(reason));
        }
        let t1 = Instant::now();
        let vcpus = usize::from(self.config.vcpus);
        let saved = control.save_vcpus(vcpus, host.msrs.clone(), SAVE_TIMEOUT).map_err(SnapshotError::Vcpus)?;
        let mut msrs_unreadable: Vec<u32> = saved.iter().flat_map(|(_, skipped)| skipped.iter().copied()).collect();
        msrs_unreadable.sort_unstable();
        msrs_unreadable.dedup();
        if !msrs_unreadable.is_empty() {
            let list: Vec<String> = msrs_unreadable.iter().map(|m| format!("{m:#x}")).collect();
            tracing::warn!(msrs = %list.join(","), "KVM lists these MSRs as saveable but would not read them");
        }
        let state = VmState {
            config: self.config.clone(),
            host_cpu: host.cpu.description.clone(),
            mem_file_bytes: self.config.mem_bytes,
            vm: kvm_state::save_vm(&self.vm, self.irqchip)?,
            vcpus: saved.into_iter().map(|(s, _)| s).collect(),
            devices: self.devices.save(),
        };
        let bytes = file::encode(&state, &host.cpu.fingerprint)?;
        let save_us = t1.elapsed().as_micros() as u64;

        let t2 = Instant::now();
        let dir_fd = open_dir(dir)?;
        let memory_file = create_in(&dir_fd, dir, MEMORY_TMP)?;
        let memory = save_guest_memory(&self.mem, &memory_file, &dir.join(MEMORY_TMP))?;
        drop(memory_file);
        let mut state_file = create_in(&dir_fd, dir, STATE_TMP)?;
        let state_tmp = dir.join(STATE_TMP);
        std::io::Write::write_all(&mut state_file, &bytes).map_err(io(&state_tmp))?;
        state_file.sync_all().map_err(io(&state_tmp))?;
        drop(state_file);
        // No moment where an old state file describes the new memory file.
        match unlinkat(&dir_fd, STATE_FILE, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => return Err(io(&dir.join(STATE_FILE))(e)),
        }
        renameat(&dir_fd, MEMORY_TMP, &dir_fd, MEMORY_FILE).map_err(io(&dir.join(MEMORY_FILE)))?;
        renameat(&dir_fd, STATE_TMP, &dir_fd, STATE_FILE).map_err(io(&dir.join(STATE_FILE)))?;
        nix::unistd::fsync(dir_fd.as_fd()).map_err(io(dir))?;
        let write_us = t2.elapsed().as_micros() as u64;
        tracing::info!(dir = %dir.display(), state_bytes = bytes.len(), memory_written = memory.written_bytes, save_us, write_us, "snapshot written");
        Ok(SnapshotReport {
            state_bytes: bytes.len() as u64,
            memory_bytes: memory.file_bytes,
            memory_written_bytes: memory.written_bytes,
            pause_us: 0,
            save_us,
            write_us,
            msrs_unreadable,
        })
    }
}

/// One snapshot request, answered in `done`.
struct Job {
    dir: PathBuf,
    done: Arc<Slot<Result<SnapshotReport, String>>>,
}

/// The API thread's end: posts a snapshot of the paused VM to the event loop and waits, bounded,
/// for its report.
pub struct SnapshotRequests {
    jobs: Arc<Mailbox<Job>>,
    wake: EventFd,
}

impl SnapshotRequests {
    pub fn take(&self, dir: &Path) -> Result<SnapshotReport, String> {
        let done = Slot::new();
        self.jobs.post(Job { dir: dir.to_owned(), done: Arc::clone(&done) });
        self.wake.write(1).map_err(|e| format!("cannot wake the event loop: {e}"))?;
        done.take_until(Instant::now() + SNAPSHOT_TIMEOUT)
            .unwrap_or_else(|| Err(format!("the snapshot did not finish within {SNAPSHOT_TIMEOUT:?}")))
    }
}

/// The event loop's end: takes the snapshots the API posts.
pub struct SnapshotService {
    snapshotter: Snapshotter,
    control: Arc<VcpuControl>,
    jobs: Arc<Mailbox<Job>>,
    wake: EventFd,
}

/// A snapshot service for the event loop and the API's handle on it.
pub fn service(
    snapshotter: Snapshotter,
    control: Arc<VcpuControl>,
) -> std::io::Result<(Arc<Mutex<SnapshotService>>, SnapshotRequests)> {
    let jobs = Mailbox::new();
    let wake = EventFd::new(libc::EFD_NONBLOCK)?;
    let requests = SnapshotRequests { jobs: Arc::clone(&jobs), wake: wake.try_clone()? };
    Ok((Arc::new(Mutex::new(SnapshotService { snapshotter, control, jobs, wake })), requests))
}

impl MutEventSubscriber for SnapshotService {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.wake, EventSet::IN)) {
            tracing::error!(error = ?e, "cannot watch snapshot requests");
        }
    }

    fn process(&mut self, events: Events, _: &mut EventOps) {
        if events.fd() != self.wake.as_raw_fd() {
            return;
        }
        let _ = self.wake.read();
        for job in self.jobs.drain() {
            let result = self.snapshotter.take(&self.control, &job.dir).map_err(|e| e.to_string());
            job.done.put(result);
        }
    }
}
