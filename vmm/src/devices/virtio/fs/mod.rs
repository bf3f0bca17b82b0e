//! virtio-fs as a vhost-user frontend: the guest's FUSE requests go straight from the virtqueues
//! to a backend process (virtiofsd) that maps guest memory; the VMM only sets the rings up,
//! forwards the backend's "used buffers" signal as an interrupt, and watches the connection.
//!
//! Rooms as in the other devices: `device.rs` (virtio semantics and the device's life),
//! `vhost_user.rs` (the backend connection), `event_handler.rs` (fd readiness) and `persist.rs`
//! (plain state). There is no `packet.rs`: the VMM never parses a FUSE message. The backend
//! exchanges run on the device's own threads: `worker.rs` (the backend thread), `watchdog.rs`
//! (their deadlines) and `thread.rs` (spawning them confined, handing values between them).

pub mod device;
pub mod event_handler;
pub mod persist;
#[cfg(test)]
pub mod test_utils;
pub mod thread;
pub mod vhost_user;
pub mod watchdog;
pub mod worker;

pub use device::Fs;
pub use worker::BackendThreads;
