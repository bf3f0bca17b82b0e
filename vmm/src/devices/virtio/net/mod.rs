//! virtio-net in userspace on a host tap device (the Firecracker model).
//!
//! `device.rs` speaks virtio (features, MAC/MTU config space, the RX and TX queues),
//! `packet.rs` parses the vnet header and frame chains, `tap.rs` is the host end (an existing
//! tap opened with a vnet header), `rate_limiter.rs` holds the token buckets and
//! `event_handler.rs` turns fd readiness into device work. The device does no ARP, DHCP or
//! filtering: the host side (the shim's tc redirect) owns the network.

pub mod device;
pub mod event_handler;
pub mod packet;
pub mod persist;
pub mod rate_limiter;
pub mod tap;

pub use device::Net;
