//! Misbehaves on purpose: unknown MMIO, bad descriptor chains (out-of-range address, loop,
//! oversized length), a vsock packet with a lying length. After each blk fault it resets the
//! device and finally proves blk works again.
#![no_std]
#![no_main]

mod common;
use common::*;

const HDR: u64 = 0x41_0000;
const DATA: u64 = 0x41_1000;
const STATUS_BYTE: u64 = 0x41_2000;

fn blk_up(base: u64) -> Vq {
    let vq = Vq::new(base, 0, 0x40_0000, 8);
    if !negotiate(base) || !vq.setup() || !driver_ok(base) {
        puts("blk setup failed\n");
        reset();
    }
    vq
}

/// Waits until the device reports NEEDS_RESET and prints the status.
fn expect_needs_reset(base: u64, what: &str) {
    let mut s = 0;
    for _ in 0..200_000 {
        s = r32(base + STATUS);
        if s & 0x40 != 0 {
            break;
        }
    }
    puts(what);
    puts(" status=");
    put_hex(s as u64);
    puts("\n");
}

fn bad_chain(base: u64, data_addr: u64, data_len: u32, next: u16, what: &str) {
    let mut vq = blk_up(base);
    w32(HDR, 0);
    w64(HDR + 8, 0);
    vq.set_desc(0, HDR, 16, F_NEXT, 1);
    vq.set_desc(1, data_addr, data_len, F_NEXT | F_WRITE, next);
    vq.set_desc(2, STATUS_BYTE, 1, F_WRITE, 0);
    vq.publish(0);
    expect_needs_reset(base, what);
    w32(base + STATUS, 0);
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    puts("hostile start\n");
    // Unknown MMIO: nothing there, an empty virtio slot, and an unknown register.
    w32(0xdfff_0000, 0xdead);
    let _ = r32(0xdfff_0004);
    w32(MMIO_BASE + 7 * MMIO_SLOT, 1);
    let blk = find_device(2);
    if blk == 0 {
        puts("no blk\n");
        reset();
    }
    w32(blk + 0x0f0, 1);
    puts("unknown mmio survived\n");

    bad_chain(blk, 0x7fff_ffff_f000, 512, 2, "blk out-of-range");
    bad_chain(blk, DATA, 512, 0, "blk loop");
    bad_chain(blk, DATA, 0x7fff_f000, 2, "blk oversized");

    // After a reset the device serves again.
    let mut vq = blk_up(blk);
    w32(HDR, 0);
    w64(HDR + 8, 0);
    w8(STATUS_BYTE, 0xff);
    vq.set_desc(0, HDR, 16, F_NEXT, 1);
    vq.set_desc(1, DATA, 512, F_NEXT | F_WRITE, 2);
    vq.set_desc(2, STATUS_BYTE, 1, F_WRITE, 0);
    vq.publish(0);
    if vq.wait_used(2_000_000).is_some() && r8(STATUS_BYTE) == 0 {
        puts("blk recovered\n");
    }

    // vsock: a header that claims 60000 payload bytes in a 52-byte buffer.
    let vs = find_device(19);
    if vs == 0 || !negotiate(vs) {
        puts("no vsock\n");
        reset();
    }
    let rx = Vq::new(vs, 0, 0x40_1000, 8);
    let mut tx = Vq::new(vs, 1, 0x40_2000, 8);
    let ev = Vq::new(vs, 2, 0x40_3000, 8);
    if !rx.setup() || !tx.setup() || !ev.setup() || !driver_ok(vs) {
        puts("vsock setup failed\n");
        reset();
    }
    let b = 0x42_0000;
    w64(b, r64(vs + CONFIG));
    w64(b + 8, 2);
    w32(b + 16, 1);
    w32(b + 20, 2);
    w32(b + 24, 60000);
    w16(b + 28, 1);
    w16(b + 30, 5);
    tx.set_desc(0, b, 52, 0, 0);
    tx.publish(0);
    expect_needs_reset(vs, "vsock lying length");
    puts("hostile done\n");
    reset()
}
