//! Moves the available index far past what the queue holds: on virtio-blk again and again (each
//! time the device must stop with NEEDS_RESET, and serve again after a reset), then once on
//! vsock's TX queue.
#![no_std]
#![no_main]

mod common;
use common::*;

const HDR: u64 = 0x41_0000;
const DATA: u64 = 0x41_1000;
const STATUS_BYTE: u64 = 0x41_2000;
const JUMPS: u64 = 40;

fn up(base: u64, vq: &Vq) {
    if !negotiate(base) || !vq.setup() || !driver_ok(base) {
        puts("setup failed\n");
        reset();
    }
}

/// Jumps the avail index of `vq` by `by`, notifies, and waits for NEEDS_RESET.
fn jump(base: u64, vq: &Vq, by: u16) -> bool {
    w16(vq.avail + 2, r16(vq.avail + 2).wrapping_add(by));
    w32(base + QUEUE_NOTIFY, vq.index);
    for _ in 0..200_000 {
        if r32(base + STATUS) & 0x40 != 0 {
            return true;
        }
    }
    false
}

#[no_mangle]
pub extern "C" fn _start() -> ! {
    let blk = find_device(2);
    if blk == 0 {
        puts("no blk\n");
        reset();
    }
    let mut caught = 0u64;
    for n in 0..JUMPS {
        let vq = Vq::new(blk, 0, 0x40_0000, 8);
        w16(vq.avail + 2, 0);
        up(blk, &vq);
        if jump(blk, &vq, 9 + (n as u16) * 1000) {
            caught += 1;
        }
        w32(blk + STATUS, 0);
    }
    puts("blk jumps caught ");
    put_hex(caught);
    puts("\n");

    // After a reset the device serves again.
    let mut vq = Vq::new(blk, 0, 0x40_0000, 8);
    w16(vq.avail + 2, 0);
    w16(vq.used + 2, 0);
    up(blk, &vq);
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

    let vs = find_device(TYPE_VSOCK);
    if vs == 0 || !negotiate(vs) {
        puts("no vsock\n");
        reset();
    }
    let rx = Vq::new(vs, 0, 0x40_1000, 8);
    let tx = Vq::new(vs, 1, 0x40_2000, 8);
    let ev = Vq::new(vs, 2, 0x40_3000, 8);
    if !rx.setup() || !tx.setup() || !ev.setup() || !driver_ok(vs) {
        puts("vsock setup failed\n");
        reset();
    }
    if jump(vs, &tx, 0x8000) {
        puts("vsock jump caught\n");
    }
    puts("jumps done\n");
    reset()
}
