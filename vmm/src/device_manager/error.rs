//! How device assembly fails. Every variant keeps its cause as its source: a device that refuses
//! its saved state says which slot it is in and, below that, why.

use crate::devices::bus::BusError;
use crate::devices::legacy::persist::LegacyPersistError;
use crate::devices::virtio::net::device::NetError;
use crate::devices::virtio::persist::VirtioPersistError;

#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    #[error("device {what}")]
    Device { what: String, source: std::io::Error },
    #[error("net device on tap {tap}")]
    Net { tap: String, source: NetError },
    #[error("KVM setup failed ({what})")]
    Kvm { what: &'static str, source: kvm_ioctls::Error },
    #[error("bus")]
    Bus(#[from] BusError),
    /// A device or transport refused its saved state.
    #[error("restoring {what}")]
    Restore { what: String, source: VirtioPersistError },
    #[error("restoring {what}")]
    RestoreLegacy { what: &'static str, source: LegacyPersistError },
    /// The snapshot's slots do not hold the run's devices.
    #[error("restoring {what}: {reason}")]
    Slot { what: String, reason: String },
}
