//! virtio-fs as a vhost-user frontend with a relay: the guest's FUSE requests are copied from the
//! driver's virtqueues into shadow vrings in a small region shared with a backend process
//! (virtiofsd), and the replies copied back; the backend never maps guest memory (`relay.rs`
//! says why). The VMM also sets the backend up and watches the connection.
//!
//! Rooms as in the other devices: `device.rs` (virtio semantics and the device's life),
//! `relay.rs` (the two sets of rings), `vhost_user.rs` (the backend connection),
//! `event_handler.rs` (fd readiness) and `persist.rs` (plain state). There is no `packet.rs`:
//! the VMM never parses a FUSE message, it only copies chains. The backend
//! exchanges run on the device's own threads: `worker.rs` (the backend thread) and `watchdog.rs`
//! (their deadlines), spawned confined through `crate::thread`. What several rooms share (the queue
//! count, the features offered) is here, so none of them imports another for it.

pub mod device;
pub mod event_handler;
pub mod persist;
pub mod relay;
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
/// What the driver is offered. The relay walks the driver's rings with `virtio-queue`, which
/// follows indirect tables; EVENT_IDX is not offered, as the relay interrupts for every batch
/// of replies (as the block device does). The backend's rings are the relay's business.
pub const AVAIL_FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_INDIRECT_DESC;
