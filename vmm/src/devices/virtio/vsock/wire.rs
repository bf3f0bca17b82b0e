//! virtio-vsock's wire constants (virtio spec 5.10.6): the packet header's size, the stream
//! type, the ops and the shutdown flags. The one copy: the device (`packet.rs`) uses them, and the
//! `no_std` test guests, each compiled alone with rustc, take this very file as a module (`#[path]`
//! in `tests/guests/common.rs`), as they do `mmio_regs.rs`. So it holds constants only.

/// Bytes of a packet header; the payload follows it.
pub const HDR_LEN: usize = 44;
pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;
