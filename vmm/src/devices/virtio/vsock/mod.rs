//! virtio-vsock in userspace, hybrid over Unix sockets (the Firecracker model):
//! - host -> guest: connect to `uds_path`, send `CONNECT <port>\n`, get `OK <local port>\n`;
//! - guest -> host: a guest connection to port P reaches a listener at `<uds_path>_<P>`.
//!
//! `device.rs` speaks virtio, `packet.rs` parses the wire format, `csm/` is the per-connection
//! state machine and `unix/` is the host-side multiplexer; the host side can change without
//! touching virtio code.

pub mod csm;
pub mod device;
pub mod event_handler;
pub mod packet;
pub mod persist;
pub mod unix;
pub mod wire;

pub use device::Vsock;

/// The host's CID, as seen by the guest.
pub const HOST_CID: u64 = 2;
/// Largest payload of one packet, either direction.
pub const MAX_PKT_PAYLOAD: usize = 64 * 1024;
