//! virtio-fs as a vhost-user frontend: the guest's FUSE requests go straight from the virtqueues
//! to a backend process (virtiofsd) that maps guest memory; the VMM only sets the rings up,
//! forwards the backend's "used buffers" signal as an interrupt, and watches the connection.
//!
//! Rooms as in the other devices: `device.rs` (virtio semantics and the device's life),
//! `vhost_user.rs` (the backend connection), `event_handler.rs` (fd readiness) and `persist.rs`
//! (plain state). There is no `packet.rs`: the VMM never parses a FUSE message. The backend
//! exchanges run on the device's own threads: `worker.rs` (the backend thread) and `watchdog.rs`
//! (their deadlines), spawned confined through `crate::thread`. What several rooms share (the queue
//! count, the features offered) is here, so none of them imports another for it.

pub mod device;
pub mod event_handler;
pub mod persist;
#[cfg(test)]
pub mod test_utils;
pub mod vhost_user;
pub mod watchdog;
pub mod worker;

pub use device::Fs;
pub use worker::BackendThreads;

use crate::devices::virtio::VIRTIO_F_VERSION_1;

pub const NUM_REQUEST_QUEUES: u32 = 1;
/// The hiprio queue, then the request queues.
pub const NUM_QUEUES: usize = 1 + NUM_REQUEST_QUEUES as usize;
pub const VIRTIO_RING_F_INDIRECT_DESC: u64 = 1 << 28;
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
/// What the driver is offered. The ring features concern only driver and backend (the VMM never
/// walks these rings); a backend lacking one the driver acked fails activation.
pub const AVAIL_FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC | VIRTIO_RING_F_EVENT_IDX;
