//! Taking a snapshot of a running VM: pause every vCPU, collect vCPU, VM and device state, and
//! write the state file and the memory file into a directory, each replaced atomically. Runs on
//! the event-loop thread (the API's), so no device works while it reads their state.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_vmm_api::api::SnapshotReport;
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::GuestMemoryMmap;

use crate::config::ValidConfig;
use crate::devices::persist::SaveableDevices;
use crate::memory::{save_guest_memory, MemoryError};
use crate::snapshot::cpu::HostCpu;
use crate::snapshot::file::{self, SnapshotFileError};
use crate::snapshot::kvm::{self as kvm_state, KvmStateError};
use crate::snapshot::state::VmState;
use crate::snapshot::{MEMORY_FILE, STATE_FILE};
use crate::vcpu::VcpuControl;

const PAUSE_TIMEOUT: Duration = Duration::from_secs(2);
const SAVE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("vCPUs did not pause in time")]
    Pause,
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error(transparent)]
    KvmState(#[from] KvmStateError),
    #[error("saving vCPU state: {0}")]
    Vcpus(String),
    #[error(transparent)]
    File(#[from] SnapshotFileError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("{path}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// What a snapshot needs of a running VM.
pub struct Snapshotter {
    pub vm: Arc<VmFd>,
    pub mem: GuestMemoryMmap,
    pub devices: SaveableDevices,
    pub config: ValidConfig,
    pub irqchip: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.to_owned(), source }
}

/// Writes and syncs an owner-only file (the state holds guest registers).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

impl Snapshotter {
    /// Pauses the VM (it stays paused) and writes a snapshot into `dir`.
    pub fn take(&self, control: &VcpuControl, dir: &Path) -> Result<SnapshotReport, SnapshotError> {
        let t0 = Instant::now();
        let vcpus = usize::from(self.config.vcpus);
        if !control.pause(vcpus, PAUSE_TIMEOUT) {
            return Err(SnapshotError::Pause);
        }
        let pause_us = t0.elapsed().as_micros() as u64;

        let t1 = Instant::now();
        let kvm = Kvm::new().map_err(SnapshotError::Kvm)?;
        kvm_state::check_xsave_size(&kvm)?;
        let host = HostCpu::probe(&kvm).map_err(SnapshotError::Kvm)?;
        let msrs = kvm_state::saveable_msrs(&kvm)?;
        let saved = control.save_vcpus(vcpus, msrs, SAVE_TIMEOUT).map_err(SnapshotError::Vcpus)?;
        let mut msrs_unreadable: Vec<u32> = saved.iter().flat_map(|(_, skipped)| skipped.iter().copied()).collect();
        msrs_unreadable.sort_unstable();
        msrs_unreadable.dedup();
        if !msrs_unreadable.is_empty() {
            let list: Vec<String> = msrs_unreadable.iter().map(|m| format!("{m:#x}")).collect();
            tracing::warn!(msrs = %list.join(","), "KVM lists these MSRs as saveable but would not read them");
        }
        let state = VmState {
            config: self.config.clone(),
            host_cpu: host.description.clone(),
            mem_file_bytes: self.config.mem_bytes,
            vm: kvm_state::save_vm(&self.vm, self.irqchip)?,
            vcpus: saved.into_iter().map(|(s, _)| s).collect(),
            devices: self.devices.save(),
        };
        let bytes = file::encode(&state, &host.fingerprint)?;
        let save_us = t1.elapsed().as_micros() as u64;

        let t2 = Instant::now();
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let (state_path, memory_path) = (dir.join(STATE_FILE), dir.join(MEMORY_FILE));
        let (state_tmp, memory_tmp) = (dir.join(".state.tmp"), dir.join(".memory.tmp"));
        let memory = save_guest_memory(&self.mem, &memory_tmp)?;
        write_private(&state_tmp, &bytes).map_err(io(&state_tmp))?;
        // No moment where an old state file describes the new memory file.
        match std::fs::remove_file(&state_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&state_path)(e)),
            _ => {}
        }
        std::fs::rename(&memory_tmp, &memory_path).map_err(io(&memory_path))?;
        std::fs::rename(&state_tmp, &state_path).map_err(io(&state_path))?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))?;
        let write_us = t2.elapsed().as_micros() as u64;
        tracing::info!(dir = %dir.display(), state_bytes = bytes.len(), memory_written = memory.written_bytes, save_us, write_us, "snapshot written");
        Ok(SnapshotReport {
            state_bytes: bytes.len() as u64,
            memory_bytes: memory.file_bytes,
            memory_written_bytes: memory.written_bytes,
            pause_us,
            save_us,
            write_us,
            msrs_unreadable,
        })
    }
}
