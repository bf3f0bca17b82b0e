//! Virtio devices over the virtio-mmio transport.
//!
//! Every device lives in its own folder with the same rooms: `device.rs` (virtio semantics),
//! `event_handler.rs` (fd readiness -> device work), `packet.rs` (wire parsing, every length checked
//! against guest memory) and `persist.rs` (plain serialisable state, virtqueue indices included,
//! built from the live device by its `save`: persist imports device, never the reverse); what
//! several rooms share is in the folder's `mod.rs`. The transport is `mmio.rs`, its register map
//! `mmio_regs.rs`; which devices a VM gets, in which slot, is `device_manager/`'s business.

pub mod balloon;
pub mod block;
pub mod chain;
pub mod fs;
pub mod mmio;
pub mod mmio_regs;
pub mod net;
pub mod persist;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::log_throttle::LogThrottle;

pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_BALLOON: u32 = 5;
pub const TYPE_VSOCK: u32 = 19;
pub const TYPE_FS: u32 = 26;
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x1;
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x2;

/// The device-to-driver interrupt: the status bits the driver reads (and acks) through the
/// transport, plus an eventfd that is an irqfd when the in-kernel irqchip is present.
#[derive(Clone)]
pub struct IrqTrigger {
    status: Arc<AtomicU32>,
    evt: Arc<EventFd>,
}

impl IrqTrigger {
    pub fn new(evt: EventFd) -> Self {
        Self { status: Arc::new(AtomicU32::new(0)), evt: Arc::new(evt) }
    }

    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            tracing::warn!(error = %e, "failed to signal virtio interrupt");
        }
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Sets the status bits a snapshot recorded, without signalling: a pending interrupt is part
    /// of the restored irqchip state already.
    pub fn restore_status(&self, bits: u32) {
        self.status.store(bits & (VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG), Ordering::SeqCst);
    }

    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

/// Why a device refused to go live or stopped serving.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DeviceError {
    #[error("queue {0} is not valid in guest memory (addresses or size)")]
    InvalidQueue(usize),
    #[error("driver did not set up queue {0}")]
    QueueNotReady(usize),
    #[error("malformed descriptor chain: {0}")]
    Chain(#[from] chain::ChainError),
    #[error("malformed request: {0}")]
    Request(String),
    #[error("guest memory access failed: {0}")]
    Memory(String),
    #[error("vhost-user backend failed: {0}")]
    Backend(String),
}

impl DeviceError {
    /// A guest memory access failed (for `map_err`).
    pub fn memory(e: impl std::fmt::Display) -> Self {
        Self::Memory(e.to_string())
    }

    /// The driver's request broke the device's rules (for `map_err`).
    pub fn request(e: impl std::fmt::Display) -> Self {
        Self::Request(e.to_string())
    }
}

/// What a virtio device must offer the transport.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    fn avail_features(&self) -> u64;
    fn set_acked_features(&mut self, features: u64);
    fn queue_max_sizes(&self) -> &[u16];
    /// One eventfd per queue; the transport signals it on QueueNotify.
    fn queue_events(&self) -> &[EventFd];
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// DRIVER_OK: the device takes ownership of the queues and starts serving.
    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqTrigger) -> Result<(), DeviceError>;
    /// Driver reset: drop queues and connections, back to the inactive state. Work that must
    /// finish before the reset write returns but runs elsewhere (a vhost-user backend stopping
    /// its vrings) comes back as a `PendingReset`.
    fn reset(&mut self) -> Option<PendingReset>;
    /// The device hit a fatal guest error and no longer serves (reported as DEVICE_NEEDS_RESET).
    fn is_broken(&self) -> bool;
}

/// The rest of a reset, which the transport waits for after it released the device lock (so the
/// event loop can still reach the device meanwhile). The wait is bounded by the device.
pub struct PendingReset(Box<dyn FnOnce() + Send>);

impl PendingReset {
    pub fn new(wait: impl FnOnce() + Send + 'static) -> Self {
        Self(Box::new(wait))
    }

    pub fn wait(self) {
        (self.0)()
    }
}

/// The life of a device between driver resets. A device stops serving on the first fatal guest
/// error and stays `Broken` until the driver resets it.
pub enum DeviceState<A> {
    Inactive,
    Active(A),
    Broken(DeviceError),
}

impl<A> DeviceState<A> {
    pub fn is_broken(&self) -> bool {
        matches!(self, DeviceState::Broken(_))
    }
}

/// A device's guest-triggered log lines, throttled per kind: the guest can repeat either at will
/// (break the device, reset it, break it again).
#[derive(Debug, Default)]
pub struct DeviceLogs {
    /// The device stopped serving on a malformed chain or request.
    pub faults: LogThrottle,
    /// A write to a read-only config space.
    pub config_writes: LogThrottle,
}

/// Copies `data.len()` bytes of a read-only config space starting at `offset`. Bytes past the end
/// (or an offset that overflows) read as zero, so a guest probing any offset never faults the VMM.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = offset.checked_add(i as u64).and_then(|o| config.get(o as usize).copied()).unwrap_or(0);
    }
}

/// Checks queue readiness and validity against guest memory before a device goes live.
pub fn validate_queues(mem: &GuestMemoryMmap, queues: &[Queue]) -> Result<(), DeviceError> {
    use virtio_queue::QueueT;
    for (i, q) in queues.iter().enumerate() {
        if !q.ready() {
            return Err(DeviceError::QueueNotReady(i));
        }
        if !q.is_valid(mem) {
            return Err(DeviceError::InvalidQueue(i));
        }
    }
    Ok(())
}
