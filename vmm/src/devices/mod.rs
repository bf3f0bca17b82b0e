//! Devices: the I/O buses, legacy devices (8250 serial, i8042) and virtio devices.

pub mod bus;
pub mod legacy;
pub mod virtio;
