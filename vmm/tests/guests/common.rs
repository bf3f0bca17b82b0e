//! Shared code of the no_std test guests (built for x86_64-unknown-none by the test harness).
//! Guests start in 64-bit long mode at CPL0 with the first 4 GiB identity mapped and interrupts
//! off. They poll devices and never take an exception. Keep them tiny: under the PVM instruction
//! emulator every instruction costs microseconds.
#![allow(dead_code)]

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};

pub const MMIO_BASE: u64 = 0xd000_0000;
pub const MMIO_SLOT: u64 = 0x1000;

pub fn outb(port: u16, v: u8) {
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack)) }
}

pub fn puts(s: &str) {
    for b in s.bytes() {
        outb(0x3f8, b);
    }
}

pub fn put_hex(v: u64) {
    let digits = b"0123456789abcdef";
    let mut started = false;
    for i in (0..16).rev() {
        let d = ((v >> (i * 4)) & 0xf) as usize;
        if d != 0 || started || i == 0 {
            started = true;
            outb(0x3f8, digits[d]);
        }
    }
}

/// Pulse the i8042 reset line: the VMM exits 0.
pub fn reset() -> ! {
    outb(0x64, 0xfe);
    loop {
        unsafe { asm!("hlt", options(nomem, nostack)) }
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    puts("guest panic\n");
    reset()
}

pub fn r32(addr: u64) -> u32 {
    unsafe { read_volatile(addr as *const u32) }
}
pub fn w32(addr: u64, v: u32) {
    unsafe { write_volatile(addr as *mut u32, v) }
}
pub fn r16(addr: u64) -> u16 {
    unsafe { read_volatile(addr as *const u16) }
}
pub fn w16(addr: u64, v: u16) {
    unsafe { write_volatile(addr as *mut u16, v) }
}
pub fn w64(addr: u64, v: u64) {
    unsafe { write_volatile(addr as *mut u64, v) }
}
pub fn r64(addr: u64) -> u64 {
    unsafe { read_volatile(addr as *const u64) }
}
pub fn r8(addr: u64) -> u8 {
    unsafe { read_volatile(addr as *const u8) }
}
pub fn w8(addr: u64, v: u8) {
    unsafe { write_volatile(addr as *mut u8, v) }
}

// The virtio-mmio register map and status bits: the VMM's own file, taken as a module (a guest
// is compiled alone with rustc and cannot import the crate; the file holds constants only).
#[path = "../../src/devices/virtio/mmio_regs.rs"]
mod mmio_regs;
pub use mmio_regs::*;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

/// Finds the MMIO slot holding a device of `id`, or 0.
pub fn find_device(id: u32) -> u64 {
    for i in 0..8 {
        let base = MMIO_BASE + i * MMIO_SLOT;
        if r32(base + MAGIC) == MMIO_MAGIC && r32(base + DEVICE_ID) == id {
            return base;
        }
    }
    0
}

/// ACK, DRIVER, accept VERSION_1 only, FEATURES_OK. Returns false if the device refused.
pub fn negotiate(base: u64) -> bool {
    const DRIVER: u32 = STATUS_ACKNOWLEDGE | STATUS_DRIVER;
    w32(base + STATUS, 0);
    w32(base + STATUS, STATUS_ACKNOWLEDGE);
    w32(base + STATUS, DRIVER);
    w32(base + DEVICE_FEATURES_SEL, 1);
    if r32(base + DEVICE_FEATURES) & 1 == 0 {
        return false;
    }
    w32(base + DRIVER_FEATURES_SEL, 1);
    w32(base + DRIVER_FEATURES, 1);
    w32(base + DRIVER_FEATURES_SEL, 0);
    w32(base + DRIVER_FEATURES, 0);
    w32(base + STATUS, DRIVER | STATUS_FEATURES_OK);
    r32(base + STATUS) & STATUS_FEATURES_OK != 0
}

/// A split virtqueue at a fixed guest-physical address: descriptors, then avail, then used.
pub struct Vq {
    pub dev: u64,
    pub index: u32,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub avail_idx: u16,
    pub used_seen: u16,
}

impl Vq {
    pub const fn new(dev: u64, index: u32, base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * size as u64;
        let used = (avail + 6 + 2 * size as u64 + 3) & !3;
        Vq { dev, index, size, desc, avail, used, avail_idx: 0, used_seen: 0 }
    }

    /// Programs the queue registers. Returns false if the device has no such queue.
    pub fn setup(&self) -> bool {
        let b = self.dev;
        w32(b + QUEUE_SEL, self.index);
        if r32(b + QUEUE_NUM_MAX) < self.size as u32 {
            return false;
        }
        w32(b + QUEUE_NUM, self.size as u32);
        w32(b + QUEUE_DESC_LOW, self.desc as u32);
        w32(b + QUEUE_DESC_HIGH, 0);
        w32(b + QUEUE_DRIVER_LOW, self.avail as u32);
        w32(b + QUEUE_DRIVER_HIGH, 0);
        w32(b + QUEUE_DEVICE_LOW, self.used as u32);
        w32(b + QUEUE_DEVICE_HIGH, 0);
        w32(b + QUEUE_READY, 1);
        r32(b + QUEUE_READY) == 1
    }

    pub fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * i as u64;
        w64(d, addr);
        w32(d + 8, len);
        w16(d + 12, flags);
        w16(d + 14, next);
    }

    /// Makes chain `head` available and notifies the device.
    pub fn publish(&mut self, head: u16) {
        w16(self.avail + 4 + 2 * (self.avail_idx % self.size) as u64, head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        w16(self.avail + 2, self.avail_idx);
        w32(self.dev + QUEUE_NOTIFY, self.index);
    }

    /// The next used element (id, len) if the device produced one.
    pub fn poll_used(&mut self) -> Option<(u32, u32)> {
        if r16(self.used + 2) == self.used_seen {
            return None;
        }
        let e = self.used + 4 + 8 * (self.used_seen % self.size) as u64;
        self.used_seen = self.used_seen.wrapping_add(1);
        Some((r32(e), r32(e + 4)))
    }

    /// Polls for a used element, giving up after `spins` polls.
    pub fn wait_used(&mut self, spins: u32) -> Option<(u32, u32)> {
        for _ in 0..spins {
            if let Some(u) = self.poll_used() {
                return Some(u);
            }
        }
        None
    }
}

pub fn driver_ok(base: u64) -> bool {
    w32(base + STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
    r32(base + STATUS) & STATUS_DRIVER_OK != 0
}

pub const TYPE_VSOCK: u32 = 19;

// virtio-vsock's ops and header size: the VMM's own file, taken as a module like `mmio_regs`.
#[path = "../../src/devices/virtio/vsock/wire.rs"]
mod vsock_wire;
pub use vsock_wire::*;
/// Bytes of a vsock packet header, as a guest address offset.
pub const VSOCK_HDR: u64 = HDR_LEN as u64;

/// A stream packet's header, from this guest to the host (CID 2).
pub struct VsockHdr {
    pub src_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl VsockHdr {
    /// Writes the header at `b` (the spec's struct virtio_vsock_hdr, little endian).
    pub fn write(&self, b: u64) {
        w64(b, self.src_cid);
        w64(b + 8, 2);
        w32(b + 16, self.src_port);
        w32(b + 20, self.dst_port);
        w32(b + 24, self.len);
        w16(b + 28, TYPE_STREAM);
        w16(b + 30, self.op);
        w32(b + 32, self.flags);
        w32(b + 36, self.buf_alloc);
        w32(b + 40, self.fwd_cnt);
    }
}
/// Where `wait_for_restore` keeps vsock's queues and event buffers (no other guest uses them).
const VSOCK_QUEUES: u64 = 0x44_0000;
const EV_BUF: u64 = 0x45_0000;
/// Polls of the vsock event queue before giving up (tens of seconds under the PVM emulator).
const RESTORE_SPINS: u32 = 2_000_000;

/// The guest CID that makes a guest a template. Any other CID (or no vsock) is an ordinary run:
/// the shim's VMs have vsock at CID 3 and must not wait.
pub const TEMPLATE_CID: u64 = 100;

/// A template's wait: if the VM has vsock at [`TEMPLATE_CID`], sets it up with two event buffers
/// posted, says `waiting for restore` and waits (bounded) for an event, the transport reset a
/// restored VM's vsock sends; stops the VM if none comes. Otherwise returns at once.
pub fn wait_for_restore() {
    let base = find_device(TYPE_VSOCK);
    // virtio-vsock's config space is the 64-bit guest CID.
    if base == 0 || (r32(base + CONFIG) as u64 | (r32(base + CONFIG + 4) as u64) << 32) != TEMPLATE_CID {
        return;
    }
    let rx = Vq::new(base, 0, VSOCK_QUEUES, 8);
    let tx = Vq::new(base, 1, VSOCK_QUEUES + 0x1000, 8);
    let mut ev = Vq::new(base, 2, VSOCK_QUEUES + 0x2000, 8);
    if !negotiate(base) || !rx.setup() || !tx.setup() || !ev.setup() || !driver_ok(base) {
        puts("vsock setup failed\n");
        reset();
    }
    for i in 0..2u16 {
        ev.set_desc(i, EV_BUF + i as u64 * 0x100, 8, F_WRITE, 0);
        ev.publish(i);
    }
    puts("waiting for restore\n");
    if ev.wait_used(RESTORE_SPINS).is_none() {
        puts("never restored\n");
        reset();
    }
    puts("restored\n");
}
