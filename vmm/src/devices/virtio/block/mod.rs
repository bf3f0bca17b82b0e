//! virtio-blk backed by a host file.

pub mod device;
pub mod event_handler;
pub mod packet;
pub mod persist;

pub use device::Block;
