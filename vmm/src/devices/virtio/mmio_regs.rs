//! The virtio-mmio (version 2) register map (virtio spec 4.2.2) and the device status bits
//! (2.1): what a driver reads and writes in a device's 4 KiB slot. The one copy: the transport
//! (`mmio.rs`) serves these registers, the fuzz targets drive it through them, and the `no_std`
//! test guests, each compiled alone with rustc (no crate to import), take this very file as a
//! module (`#[path]` in `tests/guests/common.rs`). So it holds constants only: no `use`, no
//! `std`, nothing that depends on where it is compiled.

/// Offsets from the slot's base.
pub const MAGIC: u64 = 0x000;
pub const VERSION: u64 = 0x004;
pub const DEVICE_ID: u64 = 0x008;
pub const VENDOR_ID: u64 = 0x00c;
pub const DEVICE_FEATURES: u64 = 0x010;
pub const DEVICE_FEATURES_SEL: u64 = 0x014;
pub const DRIVER_FEATURES: u64 = 0x020;
pub const DRIVER_FEATURES_SEL: u64 = 0x024;
pub const QUEUE_SEL: u64 = 0x030;
pub const QUEUE_NUM_MAX: u64 = 0x034;
pub const QUEUE_NUM: u64 = 0x038;
pub const QUEUE_READY: u64 = 0x044;
pub const QUEUE_NOTIFY: u64 = 0x050;
pub const INTERRUPT_STATUS: u64 = 0x060;
pub const INTERRUPT_ACK: u64 = 0x064;
pub const STATUS: u64 = 0x070;
pub const QUEUE_DESC_LOW: u64 = 0x080;
pub const QUEUE_DESC_HIGH: u64 = 0x084;
pub const QUEUE_DRIVER_LOW: u64 = 0x090;
pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
pub const CONFIG_GENERATION: u64 = 0x0fc;
/// The device's config space starts here.
pub const CONFIG: u64 = 0x100;

/// What `MAGIC` reads: "virt", little-endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// What `VERSION` reads: the virtio 1.x (modern) register layout.
pub const MMIO_VERSION: u32 = 2;

/// Bits of `STATUS`.
pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;
