//! Why a VM could not be built or stopped running with an error: the crate-wide [`VmmError`] that
//! `builder.rs` and `vmm.rs` return and `main` reports. Each variant keeps its cause as its
//! source, so the report names the whole chain (`restoring blk0: ...: holds 8 sectors, ...`).

use bulkhead_vmm_api::restore::RestoreMismatch;

use crate::device_manager::DeviceManagerError;
use crate::snapshot::{file, kvm as kvm_state};

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM setup failed ({what})")]
    KvmSetup { what: &'static str, source: kvm_ioctls::Error },
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Boot(#[from] crate::boot::BootError),
    #[error(transparent)]
    Vcpu(#[from] crate::vcpu::VcpuError),
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// A host resource of the VM itself (an eventfd, a thread, the API socket).
    #[error("device {what}")]
    Device { what: String, source: std::io::Error },
    #[error("event loop: {0}")]
    EventLoop(String),
    #[error("snapshot {dir}")]
    Snapshot { dir: String, source: file::ReadError },
    #[error(transparent)]
    KvmState(#[from] kvm_state::KvmStateError),
    #[error(transparent)]
    RunConfig(#[from] RestoreMismatch),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

/// `VmmError::Device` naming `what`, for `map_err`.
pub(crate) fn dev_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
    let what = what.into();
    move |source| VmmError::Device { what, source }
}
